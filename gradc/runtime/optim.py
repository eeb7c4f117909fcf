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


@kernel
def clip_scale(sum_sq, clip_norm):
    """torch.nn.utils.clip_grad_norm_: scale by clip/(norm + 1e-6) when that is below 1."""
    coef = clip_norm / (math.sqrt(sum_sq) + 1e-6)
    return coef if coef < 1.0 else 1.0


@kernel
def sgd_update(p, v, g, lr, momentum, scale, write):
    """The SGD update of every element; writes it when `write`, else only counts the elements whose
    new param or state would not be finite (a step that overflows must change nothing)."""
    bad = 0
    for i in range(p.size):
        vi = momentum * v[i] + scale * g[i]
        pi = p[i] - lr * vi
        if write:
            v[i] = vi
            p[i] = pi
        elif not (math.isfinite(vi) and math.isfinite(pi)):
            bad += 1
    return bad


@kernel
def adam_update(p, m, v, g, lr, beta1, beta2, eps, bias1, bias2, scale, write):
    """The Adam update of every element; writes it when `write`, else counts the non-finite ones."""
    step = lr / bias1
    root2 = math.sqrt(bias2)
    one = p.dtype.type(1.0)
    bad = 0
    for i in range(p.size):
        gi = scale * g[i]
        mi = beta1 * m[i] + (one - beta1) * gi
        vi = beta2 * v[i] + (one - beta2) * gi * gi
        pi = p[i] - step * mi / (math.sqrt(vi) / root2 + eps)
        if write:
            m[i] = mi
            v[i] = vi
            p[i] = pi
        elif not (math.isfinite(mi) and math.isfinite(vi) and math.isfinite(pi)):
            bad += 1
    return bad
