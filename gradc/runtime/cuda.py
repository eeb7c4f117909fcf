"""The one place gradc imports CUDA from (DESIGN.md, CUDA packages), and kernel launch sizes.

numba_cuda_mlir first (numba-cuda's successor), numba.cuda otherwise; numba.cuda always under
numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1), which numba_cuda_mlir does not have. Nothing is
imported until `load_cuda()`: the CPU target never needs a CUDA package.
"""
import functools
import os
import warnings

import numpy as np

THREADS = 256   # threads per block of a one-dimensional launch
TILE = 16       # the GEMM's tile edge, and its thread block's (codegen/cuda.py)
BIG = 128       # the register-tiled GEMM's block tile edge: TILE x TILE threads, PER x PER outputs each
PER = BIG // TILE
BK = 8          # the depth of the K slices it stages through shared memory


def load_cuda():
    """The `cuda` module kernels are compiled with."""
    if simulated():
        from numba import cuda
        _quiet_wrapping_in_the_simulator()
        return cuda
    try:
        from numba_cuda_mlir import cuda
    except ImportError:
        try:
            from numba import cuda
        except ImportError as e:
            raise ImportError("the CUDA target needs numba-cuda (pip install numba-cuda)") from e
    return cuda


@functools.cache
def _quiet_wrapping_in_the_simulator():
    """The simulator runs kernels on numpy scalars, which warn where the random hash's uint64 arithmetic wraps,
    as it is meant to (silently on a GPU). Python's filters cannot tell that from a float overflow in the same
    kernel: both go quiet in gradc's cached kernels under the simulator (README, CUDA). Installed once (each
    new filter resets the warnings already shown)."""
    warnings.filterwarnings("ignore", r"overflow encountered in scalar (multiply|add)", RuntimeWarning,
                            module=r"gradc_kernel_cache\.k_")


def simulated():
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def is_device_array(x):
    """A CUDA array: anything with __cuda_array_interface__ (numba, torch, cupy), or the simulator's."""
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray"


def array_dtype(x):
    """The numpy dtype of an array: numpy's or numba's, or any CUDA array's (torch, cupy) from its
    __cuda_array_interface__ (torch's own dtype objects are not numpy dtypes)."""
    if isinstance(getattr(x, "dtype", None), np.dtype):   # numpy's, numba's: no interface dict to build
        return x.dtype
    cai = getattr(x, "__cuda_array_interface__", None)
    return np.dtype(cai["typestr"]) if cai is not None else np.dtype(x.dtype)


def to_numpy(x):
    """A host copy of a CUDA array (numba's, or any other through __cuda_array_interface__)."""
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return load_cuda().as_cuda_array(x).copy_to_host()


def blocks(n, threads=THREADS):
    """Blocks of `threads` that cover n items (at least one)."""
    return max(1, -(-n // threads))


# The simulator runs every thread of a block as a Python thread: one-thread-per-item kernels (which
# check their bounds, so any block size is right) get small blocks there, which also runs more blocks.
SIMULATED_THREADS = 8


def _per_item(n, stream):
    threads = SIMULATED_THREADS if simulated() else THREADS
    return blocks(max(1, n), threads), threads, stream


# Launch configurations [blocks, threads, stream] the generated host code indexes kernels with:
def flat(out, stream=0):
    """One thread per element of `out`."""
    return _per_item(int(np.prod(out.shape)), stream)


def rows(x, axes, stream=0):
    """One thread per index of `x` over the axes not in `axes` (a reduction's kept index)."""
    return _per_item(int(np.prod([n for d, n in enumerate(x.shape) if d not in axes])), stream)


def tiles(out, stream=0):
    """One TILE x TILE block per tile of the matrix `out` (the GEMM)."""
    m, n = out.shape
    return (-(-n // TILE), -(-m // TILE)), (TILE, TILE), stream


def slices(parts, stream=0):
    """One TILE x TILE block per tile of parts[z] for each slice z (a split-K GEMM's partial products)."""
    z, m, n = parts.shape
    return (-(-n // TILE), -(-m // TILE), z), (TILE, TILE), stream


def big_tiles(out, stream=0):
    """One TILE x TILE block per BIG x BIG tile of the matrix `out` (the register-tiled GEMM)."""
    m, n = out.shape
    return (-(-n // BIG), -(-m // BIG)), (TILE, TILE), stream


FEW_KEPT = 4 * THREADS   # a reduction keeping fewer indices than this spends every lane of a block on folding


def folds(x, axes, stream=0):
    """A reduction of `x` over `axes`: blocks of kept lanes x fold lanes, each kept index folded by
    its fold lanes (a strided share each, then a tree in shared memory), so that a few long sums (a
    bias gradient over K*B rows) use many threads. Warps run along memory where there are enough kept
    indices to fill the GPU that way: over fold lanes when the last axis is reduced, else over kept
    lanes; with few kept indices every lane folds (block dims (fold, kept) or (kept, fold): the kernel
    reads which from its text)."""
    shape = tuple(x.shape)
    kept = int(np.prod([n for d, n in enumerate(shape) if d not in axes]))
    folded = int(np.prod([shape[d] for d in axes]))
    threads = SIMULATED_THREADS if simulated() else THREADS
    fold = min(_power_of_two_at_least(folded), threads)
    if len(shape) - 1 in axes:
        return blocks(max(1, kept), threads // fold), (fold, threads // fold), stream
    if kept >= FEW_KEPT:   # a warp of kept lanes reads 32 neighbours
        fold = max(1, min(fold, threads // min(32, threads)))
    return blocks(max(1, kept), threads // fold), (threads // fold, fold), stream


def _power_of_two_at_least(n):
    return 1 << max(0, int(n) - 1).bit_length()


def block(stream=0):
    """One block of THREADS threads (a reduction to one value, in shared memory)."""
    return 1, SIMULATED_THREADS if simulated() else THREADS, stream


def launch_config(grid, args, stream=0):
    """A kernel's launch from codegen/cuda.py's `launch` entry: ("flat", i), ("rows", i, reduced
    axes), ("folds", i, reduced axes), ("tiles", i), ("slices", i) or ("block",), over args[i] of the
    kernel's arguments."""
    kind = grid[0]
    if kind == "flat":
        return flat(args[grid[1]], stream)
    if kind == "rows":
        return rows(args[grid[1]], grid[2], stream)
    if kind == "folds":
        return folds(args[grid[1]], grid[2], stream)
    if kind == "tiles":
        return tiles(args[grid[1]], stream)
    if kind == "slices":
        return slices(args[grid[1]], stream)
    if kind == "big_tiles":
        return big_tiles(args[grid[1]], stream)
    if kind == "block":
        return block(stream)
    raise ValueError(f"unknown launch grid {grid!r}")
