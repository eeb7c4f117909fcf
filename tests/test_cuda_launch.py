"""Launch sizes of the CUDA target without a GPU: the reductions' fold lanes (gradc/runtime/cuda.py) and
the split-K GEMM's slice count (gradc/runtime/cuda_gemm.py)."""
import numpy as np
import pytest

from gradc.runtime.cuda import FEW_KEPT, THREADS, TILE, folds
from gradc.runtime.cuda_gemm import SLICE_MIN_DEPTH, slices_for


@pytest.fixture(autouse=True)
def on_a_gpu(monkeypatch):
    """Launch sizes as on a GPU (the simulator runs 8 threads a block)."""
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)


@pytest.mark.parametrize("shape, axes", [((2048, 10), (0,)), ((8, 2048, 64), (0, 1)), ((32, 64, 128), (0,)),
                                         ((32, 64), (0,)), ((5, 67), (1,)), ((7, 3, 5), (1,)), ((3, 1), (0,)),
                                         ((4096, 300), (0,)), ((300, 4096), (1,))])
def test_fold_lanes_cover_every_kept_index_with_full_blocks(shape, axes):
    grid, (bx, by), _ = folds(np.empty(shape), axes)
    kept = int(np.prod([n for d, n in enumerate(shape) if d not in axes]))
    folded = int(np.prod([shape[d] for d in axes]))
    fold, lanes = (bx, by) if len(shape) - 1 in axes else (by, bx)   # x runs along memory
    assert bx * by == THREADS and fold & (fold - 1) == 0   # the tree halves fold lanes
    assert grid * lanes >= kept > (grid - 1) * lanes        # every kept index, no block left idle
    assert fold <= max(1, 2 * folded)                         # no more fold lanes than elements (to a power of 2)
    if kept < FEW_KEPT:
        assert fold == min(THREADS, 1 << (folded - 1).bit_length())   # few kept indices: every lane folds


def test_a_long_sum_over_few_columns_is_folded_by_a_whole_block():
    """A bias gradient over lr_grad's K*B rows (2048 x 10) used to be 10 threads adding 2048 values each."""
    grid, (bx, by), _ = folds(np.empty((2048, 10)), (0,))
    assert (grid, bx, by) == (10, 1, THREADS)


def test_split_k_only_where_the_tiles_leave_the_gpu_idle():
    sms = 132
    assert slices_for(4096, 4096, 4096, sms) == 1                 # its tiles fill the GPU already
    assert slices_for(128, 10, 2048, sms) == 2048 // SLICE_MIN_DEPTH   # lr_grad's dW over K*B rows: 8 tiles
    assert slices_for(64, 64, 16384, sms) == -(-4 * sms // 16)    # a scan's dW over T*K*B rows: 16 tiles
    assert slices_for(64, 64, 64, sms) == 1                       # K too short to share out
    assert slices_for(0, 10, 2048, sms) == slices_for(10, 0, 2048, sms) == 1   # nothing to compute
    for m, n, depth in ((1, 1, 10 ** 6), (17, 33, 999), (200, 100, 300)):
        count = slices_for(m, n, depth, sms)
        assert count == 1 or depth // count >= SLICE_MIN_DEPTH and count * -(-m // TILE) * -(-n // TILE) <= 8 * sms
