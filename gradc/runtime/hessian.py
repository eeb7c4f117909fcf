"""Run-time helpers of the generated hvp/hessian: memory check, symmetry, order-1 stubs."""
import os

import numpy as np
from numba import njit

MEMORY_SHARE = 0.8   # of the memory available now, what one Hessian may take


def available_bytes():
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def hessian_buffer(model, rows, size, dtype):
    """An uninitialised (rows, size) array, or MemoryError when it would not fit in memory."""
    need = rows * size * np.dtype(dtype).itemsize
    free = available_bytes()
    if free is not None and need > MEMORY_SHARE * free:
        raise MemoryError(f"{model}.hessian: {rows} x {size} {np.dtype(dtype).name} values need {need / 2**30:.1f} GiB, "
                          f"but only {free / 2**30:.1f} GiB of memory is available; use hvp(), or hessian_rows() "
                          f"for a block of rows")
    return np.empty((rows, size), dtype=dtype)


@njit(cache=True)
def symmetrize(H):
    """(H + H.T) / 2 in place: the two reverse passes agree only up to rounding."""
    n = H.shape[0]
    for i in range(n):
        for j in range(i + 1, n):
            m = 0.5 * (H[i, j] + H[j, i])
            H[i, j] = m
            H[j, i] = m


def second_order_missing(model):
    raise RuntimeError(f"{model} was compiled with --order 1, which leaves out hvp and hessian; "
                       f"recompile with `gradc compile --order 2` (the default) to get them")
