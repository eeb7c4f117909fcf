"""Which kernel computes one GEMM site of a --target cuda module, chosen per call by its size.

- the 16x16-tile kernel for small products (many small blocks keep the GPU busy);
- the register-tiled kernel (128x128 block tiles) once its tiles fill every multiprocessor;
- when the 16x16 tiles are too few to fill the GPU and the K dim is long (a weight's gradient summed
  over K*B rows, a scan's over T*B), split-K: the 16x16 kernel over slices of K into a work array
  (`temp_array`: held with a captured graph; float64, so each slice's float64 sum rounds once, at the
  end), then one kernel that adds the slices and applies the site's epilogue. The slices are added
  in a fixed order: the result does not depend on timing;
- with CuPy installed (the `cublas` extra) and a product of at least LIBRARY_MIN_FLOP, cuBLAS
  through CuPy for the product, then the site's epilogue kernel in place. Only sites with no
  operand prologue take it (cuBLAS reads plain matrices). GRADC_CUBLAS=0 turns it off.
"""
import os

import numpy as np

from .cuda import BIG, TILE, big_tiles, flat, load_cuda, simulated, slices, tiles
from .cuda_host import temp_array

LIBRARY_MIN_FLOP = 2 * 512 ** 3   # below this, launch and library overheads outweigh cuBLAS's speed
SLICE_MIN_DEPTH = 8 * TILE        # a split-K slice is at least this deep (fewer, longer slices: less to add)
BLOCKS_PER_SM = 4                 # split-K aims at this many blocks per multiprocessor
_SM_COUNT = []
_CUPY = []


def _sm_count():
    if not _SM_COUNT:
        _SM_COUNT.append(getattr(load_cuda().get_current_device(), "MULTIPROCESSOR_COUNT", 1))
    return _SM_COUNT[0]


def slices_for(m, n, depth, sms):
    """How many slices of K the 16x16 kernel's product is split into: 1 when its tiles fill the GPU's
    `sms` multiprocessors already; else enough for about BLOCKS_PER_SM blocks on each, each slice at
    least SLICE_MIN_DEPTH deep."""
    tiles_count = -(-m // TILE) * -(-n // TILE)
    if tiles_count == 0 or tiles_count >= sms:
        return 1
    return max(1, min(depth // SLICE_MIN_DEPTH, -(-BLOCKS_PER_SM * sms // tiles_count)))


def library():
    """CuPy when the cuBLAS path is on and importable (never under the simulator), else None."""
    if not _CUPY:
        found = None
        if os.environ.get("GRADC_CUBLAS", "1") != "0" and not simulated():
            try:
                import cupy
                found = cupy
            except ImportError:
                pass
        _CUPY.append(found)
    return _CUPY[0]


def _stream_pointer(stream):
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    return int(stream.handle)


class _StreamlessInterface:
    """A device array as CuPy should read it: on the stream CuPy is given (the runner's, where the
    kernels that wrote it ran), with no stream of its own to wait on. numba-cuda cannot write an
    array's stream into __cuda_array_interface__ when it is a cuda.core stream (a TypeError), so a
    numba array's interface is written here from its pointer."""

    def __init__(self, a):
        self.array = a

    @property
    def __cuda_array_interface__(self):
        a = self.array
        if hasattr(a, "device_ctypes_pointer"):   # numba's
            return {"shape": tuple(a.shape), "strides": tuple(a.strides), "typestr": a.dtype.str, "version": 3,
                    "data": (a.device_ctypes_pointer.value or 0, False), "stream": None}
        return a.__cuda_array_interface__   # (the runner hands numba arrays only; another keeps its own stream)


class Gemm:
    """One GEMM site: `site(stream, *args)` launches the kernel chosen for these shapes.

    args: A's operands, B's, the epilogue's, then out (the kernels' own argument order); A is read
    transposed with `transpose_a`. split: (the slices kernel, the kernel that adds the slices and
    applies the epilogue, how many of args are A's and B's operands). cublas: (transpose_a,
    transpose_b, epilogue kernel or None) where cuBLAS may take the product."""

    def __init__(self, small, large, transpose_a=False, split=None, cublas=None):
        self.small, self.large, self.transpose_a, self.split, self.cublas = small, large, transpose_a, split, cublas

    def __call__(self, stream, *args):
        out = args[-1]
        m, n = out.shape
        depth = args[0].shape[0 if self.transpose_a else 1]
        if self.split is not None:
            count = slices_for(m, n, depth, _sm_count())
            if count > 1:   # before cuBLAS: few outputs; this way the call can be captured in a graph
                return self._split(stream, count, args)
        if self.cublas is not None and library() is not None and 2 * m * n * depth >= LIBRARY_MIN_FLOP:
            return self._library(stream, *args)
        if m >= BIG and n >= BIG and -(-m // BIG) * -(-n // BIG) >= _sm_count():
            return self.large[big_tiles(out, stream)](*args)
        return self.small[tiles(out, stream)](*args)

    def _split(self, stream, count, args):
        kernel, add, operands = self.split
        out = args[-1]
        parts = temp_array((count,) + tuple(out.shape), np.float64)   # each slice's sum rounded once, at the end
        kernel[slices(parts, stream)](*args[:operands], parts)
        add[flat(out, stream)](parts, *args[operands:])

    def _library(self, stream, a, b, *rest):
        *epilogue_args, out = rest
        ta, tb, epilogue = self.cublas
        cupy = library()
        with cupy.cuda.ExternalStream(_stream_pointer(stream)):
            A, B, C = (cupy.asarray(_StreamlessInterface(x)) for x in (a, b, out))
            cupy.matmul(A.T if ta else A, B.T if tb else B, out=C)
        if epilogue is not None:   # bias, activation, ... over the product, in place
            epilogue[flat(out, stream)](out, *epilogue_args, out)
