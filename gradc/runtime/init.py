"""Parameter initialisers and the module's stored arrays."""
import numbers
import os

import numpy as np


def _fans(shape):
    """(fan_in, fan_out): a matrix (in, out) as `x @ W` reads it; a conv weight (out, in / groups, kh, kw)
    as torch.nn.init counts it (each output sums in / groups x kh x kw products); other ranks per matrix
    of their last two dims (a batch of matrices)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 4:
        receptive = shape[2] * shape[3]
        return shape[1] * receptive, shape[0] * receptive
    return shape[-2], shape[-1]


def draw(init, shape, rng):
    """One initial value in float64 (fans: _fans)."""
    fan_in, fan_out = _fans(shape)
    if init == "zeros":
        return np.zeros(shape)
    if init == "ones":
        return np.ones(shape)
    if init == "normal":
        return rng.standard_normal(shape)
    if init == "uniform":
        return rng.uniform(0.0, 1.0, shape)
    if init == "glorot_uniform":
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape)
    if init == "he_normal":
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    raise ValueError(f"unknown init {init!r}")


def init_from(inits, shapes, float_dtype, seed, data):
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"init_params: seed must be an int >= 0, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    params = {}
    for name, init in inits.items():
        if init.startswith("data:"):
            value = data[init[5:]]
        else:
            value = draw(init, shapes[name], rng)
        params[name] = np.ascontiguousarray(value, dtype=float_dtype).reshape(shapes[name])
    return params


def load_data(module_file, keys):
    """Arrays too large to write into the module live in NAME.data.npz beside it."""
    if not keys:
        return {}
    # NAME.py is a link through OUT/.gradc/NAME, which a new compile switches: read the data of the
    # build this module's code came from, not whatever build is current now
    path = os.path.splitext(os.path.realpath(module_file))[0] + ".data.npz"
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in keys}
