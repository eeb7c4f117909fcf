"""Matrix products by the BLAS that Numba's kernels link: from plain-Python entry points, from
compiled code, and with explicit strides from inside kernels.

A plain entry (codegen/entry.py) calls `matmul_into`, and compiled code (a scan's loop, an hvp block)
`matmul_in_kernel`, Numba functions of this package for every module: compiled once per install for
each dtype and array layout they meet (Numba's cache beside this file; a few seconds the first
time), not per model, so they cost a build nothing, where a kernel around np.dot per module cost
0.6-0.9 s of compile on an empty cache. It calls scipy's
BLAS, not numpy's, because the conv and scan kernels call scipy's OpenBLAS from inside Numba, and
numpy ships an OpenBLAS of its own: two BLAS thread pools spinning on the same cores made a LeNet
step 5x slower. It runs without the GIL, as the kernels do, so threaded Hessian rows still run side
by side. Being compiled, one call costs about 0.5 us of dispatch where scipy's f2py wrapper and a
thread toggle from Python cost 2-3 us: a small MLP's step makes eight.
"""
import ctypes

import numpy as np
import scipy.linalg.cython_blas
from llvmlite.binding import add_symbol
from numba import cfunc, njit, types
from numba.np.linalg import ensure_blas

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


def _stand_ins():
    """Thread functions for a BLAS that is not an OpenBLAS: they say "one thread" and change nothing."""
    @cfunc(types.intc())
    def one_thread():
        return 1

    @cfunc(types.void(types.intc))
    def ignore_count(n):
        pass
    return one_thread.address, ignore_count.address


# matmul_into names the thread functions by these symbols, so that Numba's cache of it stays valid
# from one process to the next (an address compiled in would not)
_ADDRESSES = (_stand_ins() if _GET_THREADS is None else
              tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (_GET_THREADS, _SET_THREADS)))
add_symbol("gradc_blas_get_threads", _ADDRESSES[0])
add_symbol("gradc_blas_set_threads", _ADDRESSES[1])
_BLAS_GET_THREADS = types.ExternalFunction("gradc_blas_get_threads", types.intc())
_BLAS_SET_THREADS = types.ExternalFunction("gradc_blas_set_threads", types.void(types.intc))


def threads_now():
    """BLAS's thread count in force now; 1 where gradc cannot read it (a BLAS other than OpenBLAS)."""
    return _GET_THREADS() if _GET_THREADS is not None else 1


def set_threads(n):
    if _SET_THREADS is not None:
        _SET_THREADS(n)


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


@njit(nogil=True, error_model="numpy", cache=True)
def _rows_apart(x):
    """How many elements apart x's rows are, for BLAS's leading dim; -1 if its rows are not each
    contiguous (BLAS cannot read it in place)."""
    rows, cols = x.shape
    if x.size and cols > 1 and x.strides[1] != x.itemsize:
        return -1
    if rows <= 1 or cols == 0:   # a stride BLAS never steps by is whatever numpy made it
        return max(cols, 1)
    apart = x.strides[0] // x.itemsize
    return apart if x.strides[0] % x.itemsize == 0 and apart >= max(cols, 1) else -1


# gemm's alpha and beta, by pointer: constants compiled into matmul_into, so that a call allocates nothing
_ONE_ZERO_F4 = np.array([1.0, 0.0], np.float32)
_ONE_ZERO_F8 = np.array([1.0, 0.0], np.float64)


@njit(nogil=True, error_model="numpy", cache=True)
def _gemm(one_zero, a, ta, b, tb, c, m, n, k):
    """c = op(a) @ op(b) (m x n, inner dim k), every operand's rows contiguous; BLAS's status."""
    return _XXGEMM(115 if c.itemsize == 4 else 100, 84 if tb else 78, 84 if ta else 78, n, m, k,   # 's'/'d', 'T'/'N'
                   one_zero[:1].ctypes, b.ctypes, _rows_apart(b), a.ctypes, _rows_apart(a), one_zero[1:].ctypes,
                   c.ctypes, _rows_apart(c))


@njit(nogil=True, error_model="numpy", cache=True)
def matmul_into(a, b, ta, tb, out):
    """out = op(a) @ op(b), op transposing where ta / tb say; returns the BLAS threads it ran on.
    `out` is row-major, so BLAS (column-major) sees out.T and computes out.T = op(b).T @ op(a).T,
    reading a.T and b.T without a copy. Operands whose rows are not contiguous are copied first.
    A product below SERIAL_BELOW runs on one BLAS thread (the module docstring says why)."""
    return _product(a, b, ta, tb, out, True)


@njit(nogil=True, error_model="numpy", cache=True)
def matmul_in_kernel(a, b, ta, tb, out):
    """matmul_into for compiled code (a scan's step, BPPSA's parallel sweeps, an hvp block): BLAS's
    thread count is left as it is. Setting it is process-wide and costs microseconds: a step's small
    products paid it each, and BPPSA's Numba threads setting it at once ran 20x slower (bench/rnn.py)."""
    _product(a, b, ta, tb, out, False)


@njit(nogil=True, error_model="numpy", cache=True)
def _product(a, b, ta, tb, out, serial_when_small):
    """The product, and the BLAS threads it ran on; the common case (one dtype, every operand's rows
    contiguous) in a few lines, which a compiled caller inlines at each product."""
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    if a.itemsize != out.itemsize or b.itemsize != out.itemsize or m == 0 or n == 0 or k == 0 \
            or _rows_apart(a) < 0 or _rows_apart(b) < 0 or _rows_apart(out) < 0:
        return _matmul_copying(a, b, ta, tb, out, serial_when_small)
    return _gemm_threads(a, ta, b, tb, out, m, n, k, serial_when_small)


@njit(nogil=True, error_model="numpy", cache=True)
def _gemm_threads(a, ta, b, tb, out, m, n, k, serial_when_small):
    """_gemm on BLAS's threads in force, or on one where the product is small (SERIAL_BELOW) and
    the caller asks for that."""
    in_force = _BLAS_GET_THREADS()   # (a limit the user set, threadpoolctl's say, stays)
    serial = serial_when_small and in_force > 1 and m * n * k < SERIAL_BELOW
    if serial:
        _BLAS_SET_THREADS(1)
    ran_on = _BLAS_GET_THREADS() if serial_when_small else in_force   # what BLAS runs this product on
    if out.itemsize == 4:
        status = _gemm(_ONE_ZERO_F4, a, ta, b, tb, out, m, n, k)
    else:
        status = _gemm(_ONE_ZERO_F8, a, ta, b, tb, out, m, n, k)
    if serial:
        _BLAS_SET_THREADS(in_force)
    if status != 0:
        raise RuntimeError("matmul_into: Numba's BLAS (scipy.linalg.cython_blas) is not available")
    return ran_on


@njit(nogil=True, error_model="numpy", cache=True)
def _matmul_copying(a, b, ta, tb, out, serial_when_small):
    """The rare cases: mixed dtypes (refused), an empty product, operands whose rows are not
    contiguous (copied first)."""
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    if a.itemsize != out.itemsize or b.itemsize != out.itemsize:   # BLAS's kind follows out: no silent mix
        raise ValueError("matmul_into: a, b and out must have one float dtype")
    if m == 0 or n == 0:   # BLAS refuses an empty product
        return 0
    if k == 0:   # a sum over nothing
        out[...] = 0
        return 0
    if _rows_apart(a) < 0:
        a = np.ascontiguousarray(a)
    if _rows_apart(b) < 0:
        b = np.ascontiguousarray(b)
    if _rows_apart(out) > 0:
        return _gemm_threads(a, ta, b, tb, out, m, n, k, serial_when_small)
    target = np.empty((m, n), out.dtype)
    ran_on = _gemm_threads(a, ta, b, tb, target, m, n, k, serial_when_small)
    out[...] = target
    return ran_on
