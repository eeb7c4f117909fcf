"""Run-time helpers of the generated hvp/hessian: memory check, symmetry, order-1 stubs."""
import numbers
import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit

from gradc.runtime import kernel_cache
from gradc.runtime.host_memory import MEMORY_SHARE, available_bytes


def hessian_buffer(model, rows, size, dtype):
    """An uninitialised (rows, size) array, or MemoryError when it would not fit in memory."""
    need = rows * size * np.dtype(dtype).itemsize
    free = available_bytes()
    if free is not None and need > MEMORY_SHARE * free:
        raise MemoryError(f"{model}.hessian: {rows} x {size} {np.dtype(dtype).name} values need {need / 2**30:.1f} GiB, "
                          f"but only {free / 2**30:.1f} GiB of memory is available; use hvp(), or hessian_rows() "
                          f"for a block of rows")
    return np.empty((rows, size), dtype=dtype)


def hessian_row_range(model, start, stop, size):
    """hessian_rows' start and stop, checked: ints with 0 <= start <= stop <= size."""
    for name, v in (("start", start), ("stop", stop)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{model}.hessian_rows: {name} must be an int, got {v!r}")
    if start > stop:
        raise ValueError(f"{model}.hessian_rows: start {start} is after stop {stop} (rows start..stop-1)")
    if not 0 <= start <= stop <= size:
        rows = f"{size} rows, 0..{size - 1}" if size else "no rows"
        raise ValueError(f"{model}.hessian_rows: start {start} and stop {stop} must be within 0..{size} (the "
                         f"Hessian has {rows}; stop is one past the last row returned)")
    return int(start), int(stop)


BLOCK_ROWS = 32


def in_blocks(hvp_block, H, first_row, workers=None):
    """Fill H with rows first_row.. of the Hessian: hvp_block(V, OUT) on blocks of basis vectors.

    Each block is one call (one compiled function for a graph of up to 120 steps) that runs the
    forward and backward once and then one tangent per row; the generated kernels release the GIL,
    so the blocks run on every core (`workers` threads; default: one per core)."""
    rows, size = H.shape

    def block(start):
        stop = min(start + BLOCK_ROWS, rows)
        V = np.zeros((stop - start, size), dtype=H.dtype)
        V[np.arange(stop - start), first_row + np.arange(start, stop)] = 1.0
        hvp_block(V, H[start:stop])

    starts = list(range(0, rows, BLOCK_ROWS))
    if starts and kernel_cache.any_parallel():
        block(starts.pop(0))   # alone: it starts Numba's threading layer, which says if threads may share it
    workers = min(workers or os.cpu_count() or 1, len(starts))
    if workers <= 1 or not _threads_may_share_parallel_kernels():
        for s in starts:
            block(s)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(block, starts))


def _threads_may_share_parallel_kernels():
    """Whether two threads may run parallel kernels (BPPSA's) at once: not under Numba's workqueue
    threading layer (its fallback where neither TBB nor OpenMP loads), which aborts then."""
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:   # no parallel kernel has run
        return True


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
