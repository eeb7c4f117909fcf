"""gradc/runtime/cuda_gemm.py without a GPU: the interface CuPy reads a numba array through."""
import ctypes

import numpy as np

from gradc.runtime.cuda_gemm import _StreamlessInterface


class _NumbaLike:
    """What _StreamlessInterface reads of a numba device array: a view at an offset into an arena."""

    def __init__(self, base, offset, shape):
        self.dtype = np.dtype(np.float32)
        self.shape = shape
        self.strides = tuple(int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))
        self.device_ctypes_pointer = ctypes.c_void_p(base + offset * self.dtype.itemsize if shape and all(shape) else None)

    @property
    def __cuda_array_interface__(self):   # numba-cuda's own raises for an array on a cuda.core stream
        raise TypeError("int() argument must be ... not 'cuda.core._stream.Stream'")


def test_a_numba_array_is_handed_over_by_pointer_shape_strides_and_dtype_with_no_stream():
    view = _NumbaLike(0x7F0000000000, 96, (3, 5))
    cai = _StreamlessInterface(view).__cuda_array_interface__
    assert cai == {"shape": (3, 5), "strides": (20, 4), "typestr": "<f4", "version": 3,
                   "data": (0x7F0000000000 + 96 * 4, False), "stream": None}
    empty = _StreamlessInterface(_NumbaLike(0x7F0000000000, 0, (0, 5))).__cuda_array_interface__
    assert empty["data"] == (0, False) and empty["shape"] == (0, 5)
