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

An optional second operand `half` (an int of shape (), 0 or 1) pairs the two halves of the output:
with half = 1, element i of the second half (i >= size // 2) takes the value element i - size // 2
draws. The likelihood-ratio pass (passes/likelihood_ratio.py) uses it for antithetic pairs: the
K perturbed copies are stacked on the rows, and copy k + K/2 gets the noise of copy k (its sign
comes from a mask), chosen at call time without a second kernel.

attrs["dist"]:
  "dropout": keep element i when u(i) >= p; the value is 1/(1-p) where kept, else 0
             (gc.dropout(x, p, seed) is x * that: inverted dropout, as torch's)
  "normal":  N(0, 1) by Box-Muller, both of its values: elements 2q and 2q + 1 from u1 = 1 - u(2q) in
             (0, 1] and u2 = u(2q + 1), as sqrt(-2 log u1) times cos(2 pi u2) and sin(2 pi u2)
             (gc.gaussian_noise(x, std, seed) is x + std * that)
"""
import math

import numpy as np
import sympy as sp

from . import Op, register
from ..errors import ShapeError
from ..runtime import conv_cores
from ..shapes import size
from .elementwise import FLAT, SIZE, X
from .kernel_text import index, unravel
from .scalar import NUMPY_FUNCTIONS

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


def draw(dist, p, seed, stream, shape, half=0):
    """The values of a `random` node (float64), the reference every target reproduces."""
    key = key_of(seed, stream)
    count = int(np.prod(shape, dtype=np.int64))
    i = _counters(np.arange(count, dtype=np.uint64), count, half)
    if dist == "dropout":
        return np.where(uniform(key, i) >= p, 1.0 / (1.0 - p), 0.0).reshape(shape)
    return _normal(key, i).reshape(shape)


def _counters(j, count, half):
    """The element whose draw element j takes: with `half`, the second half repeats the first."""
    return np.where(j >= count // 2, j - np.uint64(count // 2), j) if half else j


def _normal(key, i):
    """N(0, 1) values of elements i by Box-Muller (see the module's docstring)."""
    q = i // np.uint64(2)
    u1 = 1.0 - uniform(key, 2 * q)
    u2 = uniform(key, 2 * q + np.uint64(1))
    trig = np.where(i % np.uint64(2) == 0, np.cos(2.0 * math.pi * u2), np.sin(2.0 * math.pi * u2))
    return np.sqrt(-2.0 * np.log(u1)) * trig


def stream_key(stream):
    """mix((stream + 1) * GAMMA): the part of an element's key that the stream gives (a literal of the kernels)."""
    return int(mix(np.uint64((stream + 1) * GAMMA % 2 ** 64)))


# ---- a normal draw inside another kernel (passes/fusion.py, CUDA) ------------------------------------
class NormalDraw(sp.Function):
    """NormalDraw(seed, half, stream key, j, size): element j of a `random` node's normal draws, `size`
    of them, as the node's own kernel writes it. passes/fusion.py puts it in the expression of each
    elementwise kernel that reads the draws (j: FLAT, the element that kernel computes; size: SIZE),
    where recomputing it costs less than the draw's own kernel, its store and the reloads."""
    nargs = 5
    is_real = True
    flops = 10   # an element's cost in a fused kernel's count (as the random op's own)

    def fdiff(self, argindex=1):   # (a value of the seed: no derivative reaches through it)
        return sp.S.Zero


def drawn_expression(graph, n):
    """The expression over X[0] (the seed) and X[1] (the half flag, when given) that `random` node n
    computes, when it draws normal values (else None: dropout keeps its own kernel)."""
    attrs = graph.attrs(n)
    if attrs["dist"] != "normal":
        return None
    half = X[1] if len(graph.operands(n)) > 1 else sp.S.Zero
    return NormalDraw(X[0], half, sp.Integer(stream_key(attrs["stream"])), FLAT, SIZE)


def _normal_draws(seed, half, key, j, count):
    """NormalDraw's values (the interpreter's, through numpy)."""
    with np.errstate(over="ignore"):
        full = mix(np.asarray(seed).astype(np.int64).astype(np.uint64) ^ np.uint64(int(key)))
    j = np.asarray(j).astype(np.uint64)
    return _normal(full, _counters(j, int(count), int(np.asarray(half).reshape(-1)[0]))).reshape(np.shape(j))


NUMPY_FUNCTIONS["NormalDraw"] = _normal_draws


def _infer(attrs, shapes, dtypes):
    if len(shapes) == 2:   # the `half` operand: an int of shape ()
        if not dtypes[1].startswith("int") or tuple(shapes[1]) != ():
            raise ShapeError(f"the half operand must be an int of shape (), got shape {shapes[1]} dtype {dtypes[1]}")
    elif len(shapes) != 1:
        raise ShapeError(f"takes a seed and an optional half flag, got {len(shapes)} operands")
    seed, ds = shapes[0], dtypes[0]
    if not ds.startswith("int") or tuple(seed) != ():
        raise ShapeError(f"the seed must be an int tensor of shape () (e.g. m.input('seed', (), dtype='int64')), "
                         f"got shape {seed} dtype {ds}")
    if attrs["dist"] not in DISTS:
        raise ShapeError(f"unknown distribution {attrs['dist']!r} (one of {', '.join(DISTS)})")
    if attrs["dist"] == "dropout" and not 0.0 <= attrs["p"] < 1.0:
        raise ShapeError(f"dropout probability {attrs['p']} is outside [0, 1)")
    return tuple(attrs["shape"]), attrs.get("dtype", "float")


def _evaluate(attrs, values, out_shape, dims):
    half = int(np.asarray(values[1]).reshape(-1)[0]) if len(values) > 1 else 0
    return draw(attrs["dist"], attrs.get("p", 0.0), values[0], attrs["stream"], out_shape, half)


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
    return _pair_lines("i // 2", pad) + [f"{pad}v = r * (math.cos(a) if i % 2 == 0 else math.sin(a))"]


def _pair_lines(q, pad):
    """Box-Muller's radius `r` and angle `a` of pair q (elements 2q and 2q + 1 are r cos a, r sin a)."""
    return (_uniform_lines("u1", f"2 * ({q})", pad) + _uniform_lines("u2", f"2 * ({q}) + 1", pad) +
            [f"{pad}r = math.sqrt(-2.0 * math.log(1.0 - u1))", f"{pad}a = {2 * math.pi!r} * u2"])


def _key_lines(seed, pad):
    return [f"{pad}key = np.uint64({seed}) ^ stream_key"] + mix_lines("key", pad)


def _cpu_source(name, dist, rank, paired=False):
    """The distinct draws first (elements 0 .. size - mid - 1), those in [first, last) only (a part of them:
    gradc/runtime/conv_cores.py's draws_on_cores runs several at once; `first` even); then, in a call
    that made them all, with half != 0 the second half copied from them: element j >= mid has what
    element j - mid draws (copied last to first, so an element is read before it is overwritten)."""
    head = "seed, half, stream_key, p, scale, out, first, last" if paired else "seed, stream_key, p, scale, out, first, last"
    lines = [f"def {name}({head}):"] + _key_lines("seed", "    ")
    lines += ["    flat = out.reshape(out.size)"]
    lines += (["    mid = out.size // 2 if half != 0 else out.size", "    n = out.size - mid if half != 0 else out.size"]
              if paired else ["    n = out.size"])
    lines += ["    last = min(last, n)"]
    if dist == "dropout":
        lines += ["    for i in range(first, last):"] + _value_lines(dist, "        ") + ["        flat[i] = v"]
    else:   # a pair of normals per pair of uniforms
        lines += ["    for q in range(first // 2, (last + 1) // 2):"] + _pair_lines("q", "        ")
        lines += ["        flat[2 * q] = r * math.cos(a)", "        if 2 * q + 1 < last:",
                  "            flat[2 * q + 1] = r * math.sin(a)"]
    if paired:
        lines += ["    if half != 0 and first == 0 and last == n:",
                  "        for j in range(out.size - 1, mid - 1, -1):", "            flat[j] = flat[j - mid]"]
    what = " (the second half repeats the first's when half != 0)" if paired else ""
    return "\n".join(lines), f"out = {dist} draws of (seed, stream, element index) [first, last){what}"


def _cuda_source(name, dist, rank, paired=False):
    head = "seed, half, stream_key, p, scale, out" if paired else "seed, stream_key, p, scale, out"
    lines = [f"def {name}({head}):", "    j = cuda.grid(1)", "    if j >= out.size:", "        return"]
    if paired:
        lines += ["    mid = out.size // 2 if half[0] != 0 else out.size", "    i = j - mid if j >= mid else j"]
    else:
        lines += ["    i = j"]
    lines += _key_lines("seed[0]", "    ") + _value_lines(dist, "    ")
    lines += unravel(rank, flat="j") + [f"    out[{index([f'i{d}' for d in range(rank)], '0')}] = v"]
    what = " (the second half repeats the first's when half != 0)" if paired else ""
    return "\n".join(lines), f"out = {dist} draws of (seed, stream, element index){what}", ("flat", -1)


def normal_draw_source():
    """The device function that computes NormalDraw's value (codegen/sympy_print.py's helper)."""
    lines = ["def _normal_draw(seed, half, stream_key, j, size):",
             "    # element j of a random node's normal draws (gradc/ops/random.py), computed where it is read",
             "    mid = size // 2 if half != 0 else size",
             "    i = j - mid if j >= mid else j"]
    return "\n".join(lines + _key_lines("seed", "    ") + _value_lines("normal", "    ") + ["    return v"])


def _arguments(s):
    """The stream's key, p and the kept values' scale as literals of the call."""
    p = float(s.attrs.get("p", 0.0))
    return [f"np.uint64({stream_key(s.attrs['stream'])})", repr(p), repr(1.0 / (1.0 - p))]


def _lower(make, cpu=False):
    """CPU: a plain entry draws over parts of the values at once (draws_on_cores, gradc/runtime/conv_cores.py);
    a compiled function calls the kernel for all of them."""
    def lower(s):
        dist, rank, paired = s.attrs["dist"], len(s.shape), len(s.operands) > 1
        kernel = s.kernel(("random", dist, rank, paired), f"random_{dist}" + ("_paired" if paired else ""),
                          lambda kname: make(kname, dist, rank, paired))
        args = s.args[:2] + _arguments(s)
        if not cpu:
            return s.into_out(kernel, args)
        if not s.split_batch:   # (every value: the range's end is clipped to their count)
            return [s.alloc(), s.call(kernel, args + [s.out, "0", f"{s.out}.size"]) + s.note]
        return [s.alloc(), f"draws_on_cores({kernel}, {', '.join(args + [s.out])}, dist={dist!r}, "
                           f"most={conv_cores.cores()}){s.note}"]
    return lower


register(Op("random", "nn", _infer, _evaluate,
            lambda attrs, in_shapes, out_shape: 10 * size(out_shape), vjp=lambda ctx, n, g: [None] * len(ctx.graph.operands(n)),
            arity=None, rows=random_rows, cpu=_lower(_cpu_source, cpu=True), cuda=_lower(_cuda_source),
            doc="counter-based random values of attrs shape from an int seed: dist dropout (a scaled keep mask, "
                "keep probability 1 - p) or normal (N(0, 1)); attrs stream tells a model's random ops apart"))
