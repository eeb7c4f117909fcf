"""Random values from a counter-based generator: `random` draws, for every element of its output,
a number that depends only on (seed, stream, element index). There is no generator state: the
same node gives the same values in every pass that computes it (forward, backward, hvp, a
recompute under checkpointing), in the interpreter and in compiled code alike.

The generator is splitmix64's finaliser (Steele, Lea, Flood 2014) used as a counter hash:
    key  = mix(seed ^ mix((stream + 1) * GAMMA))
    u(c) = mix(key + (c + 1) * GAMMA) >> 11, times 2**-53        (in [0, 1), 53 random bits)
all in wrapping uint64 arithmetic, with c a counter derived from the C-order element index i.
`seed` is an int input of shape () (e.g. m.input("seed", (), dtype="int64")); `stream` is a
number the DSL gives each random op of a model, so two dropouts with one seed draw independent
masks.

attrs["dist"]:
  "dropout": keep element i when u(i) >= p; the value is 1/(1-p) where kept, else 0
             (gc.dropout(x, p, seed) is x * that: inverted dropout, as torch's)
  "normal":  N(0, 1) by Box-Muller from u1 = 1 - u(2i) in (0, 1] and u2 = u(2i + 1):
             sqrt(-2 log u1) * cos(2 pi u2)   (gc.gaussian_noise(x, std, seed) is x + std * that)
"""
import math

import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import size
from .kernel_text import index, unravel

GAMMA = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
DISTS = ("dropout", "normal")


def mix(z):
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.asarray(z, dtype=np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(M2)
        return z ^ (z >> np.uint64(31))


def key_of(seed, stream):
    with np.errstate(over="ignore"):
        s = np.asarray(seed).astype(np.int64).astype(np.uint64)
        return mix(s ^ mix(np.uint64((stream + 1) * GAMMA % 2 ** 64)))


def uniform(key, counters):
    """u(c) in [0, 1) for uint64 counters c: 53 bits of mix(key + (c + 1) * GAMMA)."""
    with np.errstate(over="ignore"):
        c = np.asarray(counters, dtype=np.uint64)
        bits = mix(key + (c + np.uint64(1)) * np.uint64(GAMMA))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def draw(dist, p, seed, stream, shape):
    """The values of a `random` node (float64), the reference every target reproduces."""
    key = key_of(seed, stream)
    i = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64)
    if dist == "dropout":
        return np.where(uniform(key, i) >= p, 1.0 / (1.0 - p), 0.0).reshape(shape)
    u1 = 1.0 - uniform(key, 2 * i)
    u2 = uniform(key, 2 * i + np.uint64(1))
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)).reshape(shape)


def _infer(attrs, shapes, dtypes):
    (seed,), (ds,) = shapes, dtypes
    if not ds.startswith("int") or tuple(seed) != ():
        raise ShapeError(f"the seed must be an int tensor of shape () (e.g. m.input('seed', (), dtype='int64')), "
                         f"got shape {seed} dtype {ds}")
    if attrs["dist"] not in DISTS:
        raise ShapeError(f"unknown distribution {attrs['dist']!r} (one of {', '.join(DISTS)})")
    if attrs["dist"] == "dropout" and not 0.0 <= attrs["p"] < 1.0:
        raise ShapeError(f"dropout probability {attrs['p']} is outside [0, 1)")
    return tuple(attrs["shape"]), attrs.get("dtype", "float")


def _evaluate(attrs, values, out_shape, dims):
    return draw(attrs["dist"], attrs.get("p", 0.0), values[0], attrs["stream"], out_shape)


def random_rows(graph, n, ins, fail):
    fail("draws its values by element index over the whole batch (a microbatch would draw the first rows' "
         "values again)")


# ---- lowering: the same hash as `draw`, in the kernel, one element per iteration or thread ------------
def mix_lines(var, pad):
    """Lines that apply splitmix64's finaliser to the uint64 local `var` (wrapping, as numpy)."""
    return [f"{pad}{var} = ({var} ^ ({var} >> np.uint64(30))) * np.uint64({M1})",
            f"{pad}{var} = ({var} ^ ({var} >> np.uint64(27))) * np.uint64({M2})",
            f"{pad}{var} = {var} ^ ({var} >> np.uint64(31))"]


def _uniform_lines(var, counter, pad):
    """u = uniform(key, counter) into the float local `var` (counter: an int expression)."""
    return ([f"{pad}z = key + np.uint64({counter} + 1) * np.uint64({GAMMA})"] + mix_lines("z", pad) +
            [f"{pad}{var} = float(z >> np.uint64(11)) * {2.0 ** -53!r}"])


def _value_lines(dist, pad):
    """The value of element i into `v` (p and scale are arguments of the kernel)."""
    if dist == "dropout":
        return _uniform_lines("u", "i", pad) + [f"{pad}v = scale if u >= p else 0.0"]
    return (_uniform_lines("u1", "2 * i", pad) + _uniform_lines("u2", "2 * i + 1", pad) +
            [f"{pad}v = math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos({2 * math.pi!r} * u2)"])


def _key_lines(seed, pad):
    return [f"{pad}key = np.uint64({seed}) ^ stream_key"] + mix_lines("key", pad)


def _cpu_source(name, dist, rank):
    lines = [f"def {name}(seed, stream_key, p, scale, out):"] + _key_lines("seed", "    ")
    lines += ["    flat = out.reshape(out.size)", "    for i in range(out.size):"]
    lines += _value_lines(dist, "        ") + ["        flat[i] = v"]
    return "\n".join(lines), f"out = {dist} draws of (seed, stream, element index)"


def _cuda_source(name, dist, rank):
    lines = [f"def {name}(seed, stream_key, p, scale, out):", "    i = cuda.grid(1)", "    if i >= out.size:",
             "        return"] + _key_lines("seed[0]", "    ") + _value_lines(dist, "    ")
    lines += unravel(rank) + [f"    out[{index([f'i{d}' for d in range(rank)], '0')}] = v"]
    return "\n".join(lines), f"out = {dist} draws of (seed, stream, element index)", ("flat", -1)


def _arguments(s):
    """The stream's key, p and the kept values' scale as literals of the call."""
    p = float(s.attrs.get("p", 0.0))
    stream_key = int(mix(np.uint64((s.attrs["stream"] + 1) * GAMMA % 2 ** 64)))
    return [f"np.uint64({stream_key})", repr(p), repr(1.0 / (1.0 - p))]


def _lower(make):
    def lower(s):
        dist, rank = s.attrs["dist"], len(s.shape)
        kernel = s.kernel(("random", dist, rank), f"random_{dist}", lambda kname: make(kname, dist, rank))
        return s.into_out(kernel, [s.args[0]] + _arguments(s))
    return lower


register(Op("random", "nn", _infer, _evaluate,
            lambda attrs, in_shapes, out_shape: 10 * size(out_shape), vjp=lambda ctx, n, g: [None], arity=1,
            rows=random_rows, cpu=_lower(_cpu_source), cuda=_lower(_cuda_source),
            doc="counter-based random values of attrs shape from an int seed: dist dropout (a scaled keep mask, "
                "keep probability 1 - p) or normal (N(0, 1)); attrs stream tells a model's random ops apart"))
