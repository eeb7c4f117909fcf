"""Matrix products by the BLAS that Numba's kernels link: from plain-Python entry points, and with
explicit strides from inside kernels.

A plain entry (codegen/entry.py) calls `matmul_into` rather than a Numba kernel around np.dot:
the kernel cost about 0.6 s of Numba compile on an empty cache (a 30-layer MLP's whole warm-up was
1.9 s), and this costs nothing to compile. It calls scipy's gemm, not numpy's np.dot, because the
conv and scan kernels call scipy's OpenBLAS from inside Numba, and numpy ships an OpenBLAS of its
own: two BLAS thread pools spinning on the same cores made a LeNet step 5x slower. scipy's wrapper
releases the GIL, as the kernels do, so threaded Hessian rows still run side by side.
"""
import ctypes

import numpy as np
import scipy.linalg.cython_blas
from numba import njit, types
from numba.np.linalg import ensure_blas
from scipy.linalg.blas import dgemm, sgemm

_GEMM = {"f": sgemm, "d": dgemm}

# OpenBLAS runs every product above m*n*k = 2^18 on all its threads, and its workers then spin for
# about 0.1 s waiting for the next one. On 2 cores that spinning slowed the single-threaded kernels
# between products 2-10x: bench/cpu_step.py's small MLP (products up to 64 x 128 x 128) stepped in
# 180 us with one BLAS thread, and in 180-300 us with two (300 whenever the second core was
# contended). A product below SERIAL_BELOW (8 MFLOP) gains little from a second thread, so it runs on
# one; the count in force goes back after it, for everything else (kernels' products included).
SERIAL_BELOW = 1 << 22


def _thread_functions():
    """(set, get) the thread count of the BLAS behind scipy's cython_blas (which Numba's kernels call
    too) when it is an OpenBLAS, else (None, None): products then run as that BLAS decides."""
    lib = ctypes.CDLL(scipy.linalg.cython_blas.__file__)   # dlsym searches its dependencies: the BLAS
    for prefix in ("scipy_", ""):   # scipy's wheels rename OpenBLAS's symbols
        setter, getter = (getattr(lib, f"{prefix}openblas_{what}_num_threads", None) for what in ("set", "get"))
        if setter is not None and getter is not None:
            setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
            return setter, getter
    return None, None


_SET_THREADS, _GET_THREADS = _thread_functions()
_MULTITHREADED = _GET_THREADS is not None and _GET_THREADS() > 1


def threads_now():
    """BLAS's thread count in force now; 1 where gradc cannot read it (a BLAS other than OpenBLAS)."""
    return _GET_THREADS() if _GET_THREADS is not None else 1


def set_threads(n):
    if _SET_THREADS is not None:
        _SET_THREADS(n)


def matmul_into(a, b, ta, tb, out):
    """out = op(a) @ op(b), op transposing where ta / tb say. `out` is C-ordered, so BLAS (column
    major) sees out.T and computes out.T = op(b).T @ op(a).T, reading a.T and b.T without a copy."""
    if out.size:   # BLAS refuses an empty product; a product over an empty inner dim is zeros, which gemm writes
        target = out.T
        threads = _GET_THREADS() if _MULTITHREADED and out.size * a.shape[0 if ta else 1] < SERIAL_BELOW else 1
        if threads > 1:   # (the count in force now: a limit the user set, threadpoolctl's say, stays)
            _SET_THREADS(1)
        try:
            written = _GEMM[out.dtype.char](1.0, b.T, a.T, 0.0, target, tb, ta, 1)
        finally:
            if threads > 1:
                _SET_THREADS(threads)
        if written is not target:   # out was not C-ordered, so the wrapper wrote a copy
            out[...] = written.T


# BLAS's gemm as Numba's helper library exports it (the function np.dot calls inside Numba, which
# calls scipy's BLAS): a kernel names it by symbol, so Numba's on-disk cache of the kernel stays valid
_XXGEMM = types.ExternalFunction("numba_xxgemm", types.intc(
    types.char, types.char, types.char, types.intp, types.intp, types.intp,   # kind, transa, transb, m, n, k
    types.voidptr, types.voidptr, types.intp, types.voidptr, types.intp,      # alpha, a, lda, b, ldb
    types.voidptr, types.voidptr, types.intp))                                # beta, c, ldc
ensure_blas()


@njit(nogil=True, error_model="numpy", cache=True)
def gemm_strided(a, a_off, lda, ta, b, b_off, ldb, tb, c, c_off, ldc, m, n, k, beta):
    """c[c_off + i ldc + j] = beta c[...] + sum over l of op(a)[i, l] op(b)[l, j], for i < m, j < n, on
    flat row-major arrays with explicit row strides (op(a) is a's rows from a_off, lda apart; ta: a
    holds op(a) transposed; the same for b). np.dot inside Numba takes whole contiguous matrices; a
    convolution multiplies shifted windows of one band (gradc/ops/conv.py), which only strides can
    name. BLAS is column-major, so it computes c.T = op(b).T @ op(a).T."""
    if m == 0 or n == 0:
        return
    alpha = np.ones(1, c.dtype)
    scale = np.full(1, beta, c.dtype)
    status = _XXGEMM(115 if c.itemsize == 4 else 100, 84 if tb else 78, 84 if ta else 78, n, m, k,   # 's'/'d', 'T'/'N'
                     alpha.ctypes, b[b_off:].ctypes, ldb, a[a_off:].ctypes, lda, scale.ctypes, c[c_off:].ctypes, ldc)
    if status != 0:   # Numba could not load scipy's BLAS: c is unwritten
        raise RuntimeError("gemm_strided: Numba's BLAS (scipy.linalg.cython_blas) is not available")
