"""Matrix products of plain-Python entry points, by the BLAS that Numba's kernels link.

A plain entry (codegen/entry.py) calls `matmul_into` rather than a Numba kernel around np.dot:
the kernel cost about 0.6 s of Numba compile on an empty cache (a 30-layer MLP's whole warm-up was
1.9 s), and this costs nothing to compile. It calls scipy's gemm, not numpy's np.dot, because the
conv and scan kernels call scipy's OpenBLAS from inside Numba, and numpy ships an OpenBLAS of its
own: two BLAS thread pools spinning on the same cores made a LeNet step 5x slower. scipy's wrapper
releases the GIL, as the kernels do, so threaded Hessian rows still run side by side.
"""
from scipy.linalg.blas import dgemm, sgemm

_GEMM = {"f": sgemm, "d": dgemm}


def matmul_into(a, b, ta, tb, out):
    """out = op(a) @ op(b), op transposing where ta / tb say. `out` is C-ordered, so BLAS (column
    major) sees out.T and computes out.T = op(b).T @ op(a).T, reading a.T and b.T without a copy."""
    if out.size:   # BLAS refuses an empty product; a product over an empty inner dim is zeros, which gemm writes
        _GEMM[out.dtype.char](1.0, b.T, a.T, 0.0, out.T, tb, ta, 1)
