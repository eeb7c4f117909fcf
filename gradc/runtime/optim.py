"""Optimizer steps the Trainer runs after the gradients (in place, PyTorch's definitions).

Hyperparameters arrive in the params' dtype, so float32 updates are float32 arithmetic
that vectorises (as PyTorch computes them). Params, optimizer state and gradients arrive as flat 1-D buffers (the Trainer keeps its trained
params in one, and `_loss_and_grad` writes every gradient into one), so one loop updates a model
of any depth and compiles once.
"""
import math

import numpy as np
from numba import njit

kernel = njit(cache=True, error_model="numpy")


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def sum_squares(g):
    """Sum of g*g, accumulated in float64. Reassociation lets LLVM vectorise the sum; no flag
    that assumes finite values is set, so a NaN or Inf still shows in the result."""
    acc = 0.0
    for i in range(g.size):
        gi = np.float64(g[i])
        acc += gi * gi
    return acc


@kernel
def accumulate(out, weight, x):
    """out += weight * x in one pass, no temporary (a pipeline adds up its microbatches' gradients
    so; numpy's `out += weight * x` takes two passes and a buffer the size of x)."""
    for i in range(out.size):
        out[i] += weight * x[i]


def clip_scale(sum_sq, clip_norm):
    """torch.nn.utils.clip_grad_norm_: scale by clip/(norm + 1e-6) when that is below 1 (Python
    floats: float64, as torch computes it)."""
    coef = clip_norm / (math.sqrt(sum_sq) + 1e-6)
    return coef if coef < 1.0 else 1.0


# what an update call does: count the elements whose new param or state would not be finite (a step
# that overflows must change nothing), write the update, or both in one call: count, then write if
# none would be (a single process; across ranks, every rank's count is summed before anyone writes)
CHECK, WRITE, CHECKED_WRITE = 0, 1, 2


@njit(cache=True, error_model="numpy", inline="always")
def _sgd(p, v, g, lr, momentum, scale):
    vi = momentum * v + scale * g
    return vi, p - lr * vi


@kernel
def sgd_update(p, v, g, lr, momentum, scale, mode):
    """The SGD update of every element, as `mode` says (CHECK, WRITE, CHECKED_WRITE); returns the
    count of elements that would not be finite (0 when only writing)."""
    bad = 0
    if mode != WRITE:
        for i in range(p.size):
            vi, pi = _sgd(p[i], v[i], g[i], lr, momentum, scale)
            if not (math.isfinite(vi) and math.isfinite(pi)):
                bad += 1
    if mode == WRITE or (mode == CHECKED_WRITE and bad == 0):
        for i in range(p.size):
            v[i], p[i] = _sgd(p[i], v[i], g[i], lr, momentum, scale)
    return bad


@njit(cache=True, error_model="numpy", inline="always")
def _adam(p, m, v, g, lr_over_bias1, beta1, beta2, eps, root2, scale, one):
    gi = scale * g
    mi = beta1 * m + (one - beta1) * gi
    vi = beta2 * v + (one - beta2) * gi * gi
    return mi, vi, p - lr_over_bias1 * mi / (math.sqrt(vi) / root2 + eps)


@kernel
def adam_update(p, m, v, g, lr, beta1, beta2, eps, bias1, bias2, scale, mode):
    """The Adam update of every element, as `mode` says; returns the count of non-finite ones."""
    step = lr / bias1
    root2 = math.sqrt(bias2)
    one = p.dtype.type(1.0)
    bad = 0
    if mode != WRITE:
        for i in range(p.size):
            mi, vi, pi = _adam(p[i], m[i], v[i], g[i], step, beta1, beta2, eps, root2, scale, one)
            if not (math.isfinite(mi) and math.isfinite(vi) and math.isfinite(pi)):
                bad += 1
    if mode == WRITE or (mode == CHECKED_WRITE and bad == 0):
        for i in range(p.size):
            m[i], v[i], p[i] = _adam(p[i], m[i], v[i], g[i], step, beta1, beta2, eps, root2, scale, one)
    return bad
