"""The one place gradc imports CUDA from (DESIGN.md, CUDA packages), and kernel launch sizes.

numba_cuda_mlir first (numba-cuda's successor), numba.cuda otherwise; numba.cuda always under
numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1), which numba_cuda_mlir does not have. Nothing is
imported until `load_cuda()`: the CPU target never needs a CUDA package.
"""
import os

import numpy as np

THREADS = 256   # threads per block of a one-dimensional launch
TILE = 16       # the GEMM's tile edge (codegen/cuda.py)


def load_cuda():
    """The `cuda` module kernels are compiled with."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from numba import cuda
        return cuda
    try:
        from numba_cuda_mlir import cuda
    except ImportError:
        try:
            from numba import cuda
        except ImportError as e:
            raise ImportError("the CUDA target needs numba-cuda (pip install numba-cuda)") from e
    return cuda


def blocks(n, threads=THREADS):
    """Blocks of `threads` that cover n items (at least one)."""
    return max(1, -(-n // threads))


def launch_config(grid, args):
    """(blocks, threads) of a kernel's launch: grid is codegen/cuda.py's ("flat", i),
    ("rows", i, reduced axes) or ("tiles", i), over args[i] of the kernel's arguments."""
    kind, at = grid[0], grid[1]
    shape = args[at].shape
    if kind == "flat":
        return blocks(max(1, int(np.prod(shape)))), THREADS
    if kind == "rows":
        kept = [n for d, n in enumerate(shape) if d not in grid[2]]
        return blocks(max(1, int(np.prod(kept)))), THREADS
    if kind == "tiles":
        m, n = shape
        return (-(-n // TILE), -(-m // TILE)), (TILE, TILE)
    raise ValueError(f"unknown launch grid {grid!r}")
