"""Optimizer kernels the generated Trainer steps call (in place, PyTorch's definitions)."""
import math

from numba import njit

kernel = njit(cache=True, error_model="numpy")


@kernel
def sum_squares(g):
    flat = g.reshape(g.size)
    acc = 0.0
    for i in range(flat.size):
        acc += flat[i] * flat[i]
    return acc


@kernel
def clip_scale(sum_sq, clip_norm):
    """torch.nn.utils.clip_grad_norm_: scale by clip/(norm + 1e-6) when that is below 1."""
    coef = clip_norm / (math.sqrt(sum_sq) + 1e-6)
    return coef if coef < 1.0 else 1.0


@kernel
def sgd_update(p, v, g, lr, momentum, scale):
    """v = momentum*v + g; p -= lr*v (g scaled by the clip factor first)."""
    pf, vf, gf = p.reshape(p.size), v.reshape(v.size), g.reshape(g.size)
    for i in range(pf.size):
        vi = momentum * vf[i] + scale * gf[i]
        vf[i] = vi
        pf[i] -= lr * vi


@kernel
def adam_update(p, m, v, g, lr, beta1, beta2, eps, bias1, bias2, scale):
    """Adam with bias correction: p -= (lr/bias1) * m / (sqrt(v)/sqrt(bias2) + eps)."""
    pf, mf, vf, gf = p.reshape(p.size), m.reshape(m.size), v.reshape(v.size), g.reshape(g.size)
    step = lr / bias1
    root2 = math.sqrt(bias2)
    for i in range(pf.size):
        gi = scale * gf[i]
        mi = beta1 * mf[i] + (1.0 - beta1) * gi
        vi = beta2 * vf[i] + (1.0 - beta2) * gi * gi
        mf[i] = mi
        vf[i] = vi
        pf[i] -= step * mi / (math.sqrt(vi) / root2 + eps)
