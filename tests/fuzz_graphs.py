"""Random gradc models for fuzzing gradc against PyTorch autograd (no tests here: see test_fuzz.py).

A case is one or more random programs. A program is a list of steps over named values (inputs,
params, earlier steps); gradc and torch both run that one list, so the two cannot drift apart.
Programs are grown while being evaluated in torch on the case's own data: a step is kept only if
its value is finite and moderate, and no operand sits near a kink (relu and abs at 0, ties in
maximum and max) or outside a domain (log, sqrt, pow and div get bases and denominators >= 0.3).
Shapes are tracked symbolically by rules written here, not gradc's, so a valid model that gradc
refuses shows up as a failure instead of being avoided.

Besides dense ops the programs use the ops of DESIGN.md §1.7: images (N, C, H, W) come from an
input ("B", C, H, W) or a reshape of a (B, k) value (H, W <= 8, C <= 4) and go through conv2d
(stride, padding, dilation, groups, bias), max_pool2d (no ties in a window) and avg_pool2d; basic
indexing (ints, slices, steps, negatives, `...`, None), a value split into adjacent pieces each read
by an op of its own (an LSTM's gates: their adjoints join into a concat), concat and stack, take (an embedding of
an int64 input: the labels or an `ids` input), softmax_cross_entropy of (B, C) logits or of (B, k, C)
with labels (B, k), matmul with an operand of rank >= 3, and dropout /
gaussian_noise seeded by an int64 () input, and gc.scan (DESIGN.md §1.8) over a random recurrent
cell: one or two carries, one or two sequences (a new input, a stack of activations, or the ys of
an earlier scan), gates, closed-over params and activations, a scan in the step (over the whole
sequence, from the step's carry), forward or reverse. torch gets the same random values: the program knows
each random op's stream and draws them with gradc.ops.random.draw, the reference gradc's kernels
reproduce (a program's streams count from 0 in a combined case too; its own seed input keeps it apart).

`random_case(seed)` and `combined_case(seeds)` give a `Case`; `check_interpreted` and
`check_compiled` compare gradc with torch and raise AssertionError naming the seeds and printing
the programs.
"""
import math
import operator
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import sympy as sp
import torch
import torch.nn.functional as F

import gradc as gc
from gradc.interpret import evaluate
from gradc.ops.random import draw
from gradc.passes.pipeline import build_training_graph
from gradc.passes.scan_checkpoint import checkpoint_scans

BATCH = "B"
LIMIT = 20.0        # largest |value| a step may produce
DOMAIN = 0.3        # smallest base of log/sqrt/pow and denominator of div
KINK = 1e-3         # least distance from a kink of relu/abs/maximum/max
MAX_PARAMS = 12
SEED = "seed"       # the int64 () input random ops draw from

# gc.elementwise user ops, registered once per process, each with its torch twin.
USER_OPS = {
    "fuzz_mish": (gc.elementwise("fuzz_mish", lambda u: u * sp.tanh(sp.log(1 + sp.exp(u)))),
                  lambda u: u * torch.tanh(torch.log(1 + torch.exp(u)))),
    "fuzz_rational": (gc.elementwise("fuzz_rational", lambda u: u / (1 + u ** 2)),
                      lambda u: u / (1 + u ** 2)),
    "fuzz_gauss": (gc.elementwise("fuzz_gauss", lambda u: sp.exp(-u ** 2 / 2) + u / 4),
                   lambda u: torch.exp(-u ** 2 / 2) + u / 4),
    "fuzz_mix": (gc.elementwise("fuzz_mix", lambda a, b: a * sp.tanh(b) + b ** 2 / 4),
                 lambda a, b: a * torch.tanh(b) + b ** 2 / 4),
    # a Piecewise (Huber's loss, by a float constant that 15 digits would round)
    "fuzz_huber": (gc.elementwise("fuzz_huber", lambda u: sp.Piecewise((u ** 2 / 2, sp.Abs(u) <= 1),
                                                                     (sp.Abs(u) - sp.S.Half, True)) * (1 / 3)),
                   lambda u: torch.where(u.abs() <= 1, u ** 2 / 2, u.abs() - 0.5) * (1 / 3)),
}
UNARY = {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
         "softplus": F.softplus, "gelu": F.gelu, "sin": torch.sin, "cos": torch.cos, "sqrt": torch.sqrt,
         "square": torch.square, "abs": torch.abs}
BINARY = {"add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul),
          "div": ("/", operator.truediv), "pow": ("**", operator.pow)}
REDUCE = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax}


# ---- programs ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Const:
    """A python float or a small numpy array, written into the model as a constant."""
    value: object
    name: str = ""      # arrays are listed by name above the steps


@dataclass
class Step:
    out: str
    op: str
    args: tuple         # value names or Consts
    kw: dict
    tag: str            # op plus variant, for coverage counts


class Cell:
    """The step of a scan as a small program of its own: its carries and slices by body names, the
    outer values it closes over by their names, the new carries and the y_t it returns."""

    def __init__(self, name, carries, xs, closed, steps, new, ys):
        self.name, self.carries, self.xs, self.closed = name, carries, xs, closed
        self.steps, self.new, self.ys = steps, new, ys

    def run(self, carry, xt, closed, backend, dims):
        env = dict(zip(self.carries, carry)) | dict(zip(self.xs, xt)) | dict(zip(self.closed, closed))
        for step in self.steps:
            args = [_const(a, backend) if isinstance(a, Const) else env[a] for a in step.args]
            env[step.out] = _RUN[backend][step.op](args, step.kw, dims)
        return [env[n] for n in self.new], [env[n] for n in self.ys]

    def text(self, batch):
        def joined(names):
            return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
        lines = [f"def {self.name}(carry, xt):", f"    {', '.join(self.carries)} = carry", f"    {', '.join(self.xs)} = xt"]
        for st in self.steps:
            if st.op == "scan":   # a nested scan: its step is defined in this one's (it closes over our values)
                lines += ["    " + line for line in st.kw["cell"].text(batch)]
            lines.append(f"    {st.out} = {_TEXT[st.op](st, [_arg_text(a) for a in st.args], batch)}")
        lines.append(f"    return {joined(list(self.new))}, {joined(list(self.ys)) if self.ys else None}")
        return lines


@dataclass
class Program:
    seed: int
    dims: dict                                  # {"B": concrete batch size}
    inputs: dict = field(default_factory=dict)  # name -> (shape, dtype)
    params: dict = field(default_factory=dict)  # name -> (shape, trainable, decay)
    steps: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)  # output name -> value name
    loss: str = ""
    weight_decay: float = 0.0

    def text(self, prefix=""):
        """The program as DSL code (with `prefix` on leaf names and the batch dim, as the model has it)."""
        b = prefix + BATCH
        lines = [f"# seed {self.seed}: {b}={self.dims[BATCH]}"]
        for name, (shape, dtype) in self.inputs.items():
            lines.append(f"{name} = m.input({prefix + name!r}, {_shape_text(shape, b)}"
                         + (f", dtype={dtype!r})" if dtype != "float" else ")"))
        for name, (shape, trainable, decay) in self.params.items():
            extra = ("" if trainable else ", trainable=False") + ("" if decay is None else f", decay={decay}")
            lines.append(f"{name} = m.param({prefix + name!r}, {_shape_text(shape, b)}{extra})")
        for step in self.steps:
            for a in step.args:
                if isinstance(a, Const) and a.name:
                    lines.append(f"{a.name} = np.array({np.array2string(a.value, separator=', ', precision=17)})")
        for step in self.steps:
            if step.op == "scan":
                lines += step.kw["cell"].text(b)
            lines.append(f"{step.out} = {_TEXT[step.op](step, [_arg_text(a) for a in step.args], b)}")
        lines += [f"m.output({prefix + o!r}, {v})" for o, v in self.outputs.items()]
        lines.append(f"m.minimize({self.loss}, weight_decay={self.weight_decay})")
        return "\n".join(lines)

    def output_inputs(self):
        """The inputs the outputs read."""
        need = set(self.outputs.values())
        for step in reversed(self.steps):
            if step.out in need:
                need.update(a for a in step.args if isinstance(a, str))
        return [n for n in self.inputs if n in need]

    def run(self, env, backend, dims):
        """Values of every step: backend "gradc" (env holds Tensors) or "torch" (env holds tensors)."""
        env = dict(env)
        for step in self.steps:
            args = [_const(a, backend) if isinstance(a, Const) else env[a] for a in step.args]
            env[step.out] = _RUN[backend][step.op](args, step.kw, dims)
        return env


def _shape_text(shape, batch):
    dims = [repr(batch if d == BATCH else d) for d in shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"


def _arg_text(a):
    return (a.name or repr(a.value)) if isinstance(a, Const) else a


def _const(c, backend):
    if backend == "gradc":
        return c.value
    return torch.as_tensor(c.value, dtype=torch.float64)


def _concrete(shape, dims):
    return tuple(dims.get(d, d) if isinstance(d, str) else d for d in shape)


def _axis_kw(kw):
    parts = [] if kw["axis"] is None else [f"axis={kw['axis']!r}"]
    return parts + (["keepdims=True"] if kw["keepdims"] else [])


def _torch_reduce(fn):
    def run(args, kw, dims):
        (a,) = args
        axis = tuple(range(a.dim())) if kw["axis"] is None else kw["axis"]
        return fn(a, dim=axis, keepdim=kw["keepdims"])
    return run


def _gradc_reduce(name):
    def run(args, kw, dims):
        (a,) = args
        if kw["form"] == "method":
            return getattr(a, name)(axis=kw["axis"], keepdims=kw["keepdims"])
        return getattr(gc, name)(a, axis=kw["axis"], keepdims=kw["keepdims"])
    return run


def _reduce_text(name):
    def text(step, args, batch):
        kws = _axis_kw(step.kw)
        if step.kw["form"] == "method":
            return f"{args[0]}.{name}({', '.join(kws)})"
        return f"gc.{name}({', '.join([args[0]] + kws)})"
    return text


def _gradc_transpose(args, kw, dims):
    (a,) = args
    if kw["form"] == "T":
        return a.T
    return gc.transpose(a) if kw["axes"] is None else gc.transpose(a, kw["axes"])


def _transpose_text(step, args, batch):
    if step.kw["form"] == "T":
        return f"{args[0]}.T"
    return f"gc.transpose({args[0]})" if step.kw["axes"] is None else f"gc.transpose({args[0]}, {step.kw['axes']})"


def _gradc_reshape(args, kw, dims):
    (a,) = args
    shape = tuple(dims.get(d, d) if isinstance(d, str) else d for d in kw["shape"])   # dims: renamed batch dims
    return a.reshape(shape) if kw["form"] == "method" else gc.reshape(a, shape)


def _reshape_text(step, args, batch):
    shape = _shape_text(step.kw["shape"], batch)
    return f"{args[0]}.reshape({shape})" if step.kw["form"] == "method" else f"gc.reshape({args[0]}, {shape})"


def _gradc_matmul(args, kw, dims):
    return args[0] @ args[1] if kw["form"] == "op" else gc.matmul(*args)


# conv2d, pools: kw holds only the keyword arguments the program spells out (the rest are defaults)
def _gradc_conv(args, kw, dims):
    x, w, *b = args
    return gc.conv2d(x, w, *b, **kw)


def _torch_conv(args, kw, dims):
    x, w, *b = args
    return F.conv2d(x, w, b[0] if b else None, **kw)


def _conv_text(step, args, batch):
    parts = args[:2] + ([f"bias={args[2]}"] if len(args) == 3 else []) + [f"{k}={v!r}" for k, v in step.kw.items()]
    return f"gc.conv2d({', '.join(parts)})"


def _pool_text(name):
    def text(step, args, batch):
        kw = dict(step.kw)
        parts = [args[0], repr(kw.pop("kernel_size"))] + [f"{k}={v!r}" for k, v in kw.items()]
        return f"gc.{name}({', '.join(parts)})"
    return text


def _key_items(key, rank):
    """The index as one item per axis (None items add an axis): `...` and missing trailing axes become `:`."""
    items = key if isinstance(key, tuple) else (key,)
    consuming = len([i for i in items if i is not None and i is not Ellipsis])
    if Ellipsis in items:
        at = items.index(Ellipsis)
        return items[:at] + (slice(None),) * (rank - consuming) + items[at + 1:]
    return items + (slice(None),) * (rank - consuming)


def _torch_index(args, kw, dims):
    """numpy basic indexing in torch (whose slices refuse negative steps): select and index_select."""
    (x,) = args
    axis = 0
    for item in _key_items(kw["key"], x.dim()):
        if item is None:
            x = x.unsqueeze(axis)
            axis += 1
        elif isinstance(item, int):
            x = x.select(axis, item)
        else:
            r = range(*item.indices(x.shape[axis]))
            if r != range(x.shape[axis]):
                x = x.index_select(axis, torch.tensor(list(r), dtype=torch.long))
            axis += 1
    return x


def _item_text(item):
    if item is None:
        return "None"
    if item is Ellipsis:
        return "..."
    if isinstance(item, int):
        return str(item)
    parts = ["" if v is None else str(v) for v in (item.start, item.stop, item.step)]
    return ":".join(parts[:2]) + (f":{parts[2]}" if item.step is not None else "")


def _index_text(step, args, batch):
    key = step.kw["key"]
    items = key if isinstance(key, tuple) else (key,)
    return f"{args[0]}[{', '.join(_item_text(i) for i in items)}{',' * (isinstance(key, tuple) and len(key) == 1)}]"


def _gradc_random(args, kw, dims):
    x, seed = args
    y = gc.dropout(x, kw["p"], seed) if kw["dist"] == "dropout" else gc.gaussian_noise(x, kw["std"], seed)
    stream = x.model.graph.random_streams - 1
    if stream != kw["stream"]:
        raise AssertionError(f"fuzz_graphs: the random op drew stream {stream}, the program says {kw['stream']}")
    return y


def _torch_random(args, kw, dims):
    """The same draws as gradc's: gradc.ops.random.draw is the reference its kernels reproduce."""
    x, seed = args
    if kw["dist"] == "dropout":
        return x * torch.as_tensor(draw("dropout", kw["p"], seed.item(), kw["stream"], tuple(x.shape)))
    return x + kw["std"] * torch.as_tensor(draw("normal", 0.0, seed.item(), kw["stream"], tuple(x.shape)))


def _random_text(step, args, batch):
    if step.kw["dist"] == "dropout":
        return f"gc.dropout({args[0]}, {step.kw['p']!r}, {args[1]})"
    return f"gc.gaussian_noise({args[0]}, {step.kw['std']!r}, {args[1]})"


def _gradc_scan(args, kw, dims):
    """gc.scan over the cell; its results as one flat tuple: the final carries, then the ys."""
    cell = kw["cell"]
    K, X = len(cell.carries), len(cell.xs)
    init, xs, closed = args[:K], args[K:K + X], args[K + X:]

    def step(carry, xt):
        new, ys = cell.run(carry if K > 1 else (carry,), xt if X > 1 else (xt,), closed, "gradc", dims)
        return (tuple(new) if K > 1 else new[0]), (tuple(ys) if len(ys) > 1 else ys[0] if ys else None)
    carry, ys = gc.scan(step, tuple(init) if K > 1 else init[0], tuple(xs) if X > 1 else xs[0], reverse=kw["reverse"])
    return (tuple(carry) if K > 1 else (carry,)) + (tuple(ys) if len(cell.ys) > 1 else (ys,) if cell.ys else ())


def _torch_scan(args, kw, dims):
    """The same as a Python loop over the steps (from the last one when reverse); ys[t] is step t's."""
    cell = kw["cell"]
    K, X = len(cell.carries), len(cell.xs)
    carry, xs, closed = list(args[:K]), args[K:K + X], args[K + X:]
    T = xs[0].shape[0]
    ys = [[None] * T for _ in cell.ys]
    for t in (range(T - 1, -1, -1) if kw["reverse"] else range(T)):
        carry, y = cell.run(carry, [x[t] for x in xs], closed, "torch", dims)
        for m, v in enumerate(y):
            ys[m][t] = v
    return tuple(carry) + tuple(torch.stack(v) for v in ys)


def _scan_text(step, args, b):
    cell = step.kw["cell"]
    K, X = len(cell.carries), len(cell.xs)

    def joined(names):
        return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
    return (f"gc.scan({cell.name}, {joined(args[:K])}, {joined(args[K:K + X])}"
            f"{', reverse=True' if step.kw['reverse'] else ''})")


# Each op: how gradc builds it, how torch computes it, how it reads as DSL code.
# gradc runners get a dims map that renames the batch dim (reshape targets name it).
_RUN = {"gradc": {}, "torch": {}}
_TEXT = {}
for _name, (_sym, _fn) in BINARY.items():
    _RUN["gradc"][_name] = _RUN["torch"][_name] = (lambda fn: lambda args, kw, dims: fn(*args))(_fn)
    _TEXT[_name] = (lambda sym: lambda step, args, b: f"{args[0]} {sym} {args[1]}")(_sym)
for _name, _fn in UNARY.items():
    _RUN["gradc"][_name] = (lambda f: lambda args, kw, dims: f(args[0]))(getattr(gc, _name))
    _RUN["torch"][_name] = (lambda f: lambda args, kw, dims: f(args[0]))(_fn)
    _TEXT[_name] = (lambda n: lambda step, args, b: f"gc.{n}({args[0]})")(_name)
for _name, (_apply, _fn) in USER_OPS.items():
    _RUN["gradc"][_name] = (lambda f: lambda args, kw, dims: f(*args))(_apply)
    _RUN["torch"][_name] = (lambda f: lambda args, kw, dims: f(*args))(_fn)
    _TEXT[_name] = (lambda n: lambda step, args, b: f"{n}({', '.join(args)})")(_name)
for _name, _fn in REDUCE.items():
    _RUN["gradc"][_name] = _gradc_reduce(_name)
    _RUN["torch"][_name] = _torch_reduce(_fn)
    _TEXT[_name] = _reduce_text(_name)
for _name, _fn in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
    _RUN["gradc"][_name] = (lambda f: lambda args, kw, dims: f(args[0], axis=kw["axis"]))(getattr(gc, _name))
    _RUN["torch"][_name] = (lambda f: lambda args, kw, dims: f(args[0], dim=kw["axis"]))(_fn)
    _TEXT[_name] = (lambda n: lambda step, args, b: f"gc.{n}({args[0]}, axis={step.kw['axis']})")(_name)
_RUN["gradc"].update({
    "neg": lambda args, kw, dims: -args[0],
    "maximum": lambda args, kw, dims: gc.maximum(*args),
    "matmul": _gradc_matmul,
    "transpose": _gradc_transpose,
    "reshape": _gradc_reshape,
    "xent": lambda args, kw, dims: gc.softmax_cross_entropy(*args),
    "mse": lambda args, kw, dims: gc.mse(*args),
    "conv2d": _gradc_conv,
    "max_pool2d": lambda args, kw, dims: gc.max_pool2d(args[0], **kw),
    "avg_pool2d": lambda args, kw, dims: gc.avg_pool2d(args[0], **kw),
    "index": lambda args, kw, dims: args[0][kw["key"]],
    "concat": lambda args, kw, dims: gc.concat(list(args), axis=kw["axis"]),
    "stack": lambda args, kw, dims: gc.stack(list(args), axis=kw["axis"]),
    "take": lambda args, kw, dims: gc.take(*args),
    "random": _gradc_random,
    "scan": _gradc_scan,
    "item": lambda args, kw, dims: args[0][kw["i"]],
})
_RUN["torch"].update({
    "neg": lambda args, kw, dims: -args[0],
    "maximum": lambda args, kw, dims: torch.maximum(*args),
    "matmul": lambda args, kw, dims: args[0] @ args[1],
    "transpose": lambda args, kw, dims: args[0].permute(kw["axes"] or tuple(reversed(range(args[0].dim())))),
    "reshape": lambda args, kw, dims: args[0].reshape(_concrete(kw["shape"], dims)),
    "xent": lambda args, kw, dims: F.cross_entropy(args[0].reshape(-1, args[0].shape[-1]), args[1].reshape(-1)),
    "mse": lambda args, kw, dims: F.mse_loss(*args),
    "conv2d": _torch_conv,
    "max_pool2d": lambda args, kw, dims: F.max_pool2d(args[0], **kw),
    "avg_pool2d": lambda args, kw, dims: F.avg_pool2d(args[0], **kw),
    "index": _torch_index,
    "concat": lambda args, kw, dims: torch.cat(list(args), dim=kw["axis"]),
    "stack": lambda args, kw, dims: torch.stack(list(args), dim=kw["axis"]),
    "take": lambda args, kw, dims: F.embedding(args[1], args[0]),
    "random": _torch_random,
    "scan": _torch_scan,
    "item": lambda args, kw, dims: args[0][kw["i"]],
})
_TEXT.update({
    "neg": lambda step, args, b: f"-{args[0]}",
    "maximum": lambda step, args, b: f"gc.maximum({args[0]}, {args[1]})",
    "matmul": lambda step, args, b: f"{args[0]} @ {args[1]}" if step.kw["form"] == "op" else f"gc.matmul({args[0]}, {args[1]})",
    "transpose": _transpose_text,
    "reshape": _reshape_text,
    "xent": lambda step, args, b: f"gc.softmax_cross_entropy({args[0]}, {args[1]})",
    "mse": lambda step, args, b: f"gc.mse({args[0]}, {args[1]})",
    "conv2d": _conv_text,
    "max_pool2d": _pool_text("max_pool2d"),
    "avg_pool2d": _pool_text("avg_pool2d"),
    "index": _index_text,
    "concat": lambda step, args, b: f"gc.concat([{', '.join(args)}], axis={step.kw['axis']})",
    "stack": lambda step, args, b: f"gc.stack([{', '.join(args)}], axis={step.kw['axis']})",
    "take": lambda step, args, b: f"gc.take({args[0]}, {args[1]})",
    "random": _random_text,
    "scan": _scan_text,
    "item": lambda step, args, b: args[0] + "".join(f"[{i}]" for i in step.kw["path"]),
})


# ---- symbolic shapes (numpy rules; the batch dim is never stretched and never equals an int) ----
def broadcast(*shapes):
    """The broadcast shape, or None."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        dims = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def matmul_shape(a, b):
    if not (1 <= len(a) <= 2 and 1 <= len(b) <= 2) or a[-1] != b[0]:
        return None
    return a[:-1] + b[1:]


def batch_matmul_shape(a, b):
    """numpy's matmul shape when an operand has rank >= 3 (batch dims broadcast), or None."""
    if not a or not b or max(len(a), len(b)) < 3 or a[-1] != (b[0] if len(b) == 1 else b[-2]):
        return None
    batch = broadcast(a[:-2], b[:-2])
    if batch is None:
        return None
    return batch + a[-2:-1] + (b[-1:] if len(b) >= 2 else ())


def conv_len(n, k, stride, padding, dilation=1):
    return (n + 2 * padding - dilation * (k - 1) - 1) // stride + 1


def _pair(v):
    return tuple(v) if isinstance(v, tuple) else (v, v)


def reduced_shape(shape, axis, keepdims):
    axes = range(len(shape)) if axis is None else [a % len(shape) for a in np.atleast_1d(axis)]
    return tuple(1 if i in axes else d for i, d in enumerate(shape)) if keepdims else \
        tuple(d for i, d in enumerate(shape) if i not in axes)


# ---- generation ----------------------------------------------------------------------------------
class _Reject(Exception):
    """A step whose value would be ill-conditioned for the comparison: try another."""


def _draw(rng, shape):
    """Moderate random values, never exactly 0."""
    kind = rng.integers(3)
    if kind == 0:
        a = rng.normal(0.0, 0.8, shape)
    elif kind == 1:
        a = rng.uniform(-1.2, 1.2, shape)
    else:
        a = rng.uniform(0.3, 1.2, shape) * rng.choice([-1.0, 1.0], shape)
    a = np.asarray(a, dtype=np.float64)
    a[a == 0] = 0.5
    return a


class _Generator:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.later = np.random.default_rng([seed, 1])   # choices added later draw here: a seed's program stays
        rng = self.rng
        # distinct feature dims so that a mixed-up axis changes a shape; B=1 now and then (a stretched axis of length 1)
        batch, self.N, self.M, self.C = (int(d) for d in rng.choice(np.arange(2, 7), 4, replace=False))
        if rng.random() < 0.1:
            batch = 1
        self.prog = Program(seed, {BATCH: batch})
        self.shapes, self.values, self.uses = {}, {}, Counter()
        self.data = {}
        self.consts = 0
        self.single_use = set()   # params no later step may read
        self.int_high = {}        # int input -> its values' bound (take's table rows)
        self.streams = 0          # random ops so far: the next one draws this stream

    # values
    def add_input(self, name, shape, dtype="float", high=None):
        self.prog.inputs[name] = (shape, dtype)
        if name == self.SEED_INPUT:
            value = np.asarray(self.rng.integers(0, 2 ** 62), dtype=np.int64)
        elif dtype == "int64":
            self.int_high[name] = high or self.C
            value = self.rng.integers(0, self.int_high[name], _concrete(shape, self.prog.dims))
        else:
            value = _draw(self.rng, _concrete(shape, self.prog.dims))
        self._leaf(name, shape, value)
        return name

    def add_param(self, shape, trainable=True, decay=None, scale=1.0):
        name = f"p{len(self.prog.params)}"
        self.prog.params[name] = (shape, trainable, decay)
        self._leaf(name, shape, np.asarray(_draw(self.rng, shape) * scale))
        return name

    def _leaf(self, name, shape, value):
        self.shapes[name] = shape
        self.data[name] = value
        self.values[name] = torch.as_tensor(value)

    def const(self, shape):
        if shape == ():
            return Const(float(np.round(self.rng.uniform(0.5, 2.0) * self.rng.choice([-1, 1]), 3)))
        self.consts += 1
        return Const(np.round(_draw(self.rng, shape), 3), f"C{self.consts - 1}")

    def shape_of(self, x):
        return np.shape(x.value) if isinstance(x, Const) else self.shapes[x]

    def floats(self, pred=lambda s: True, leaves=True):
        return [n for n, s in self.shapes.items()
                if pred(s) and n not in self.single_use and self.prog.inputs.get(n, ((), "float"))[1] == "float"
                and (leaves or n not in self.prog.inputs and n not in self.prog.params)]

    def pick(self, names):
        """A random name, recent steps and params likelier (fan-out and shared weights)."""
        if not names:
            raise _Reject("no operand")
        order = {n: i / len(self.shapes) for i, n in enumerate(self.shapes)}
        w = np.array([0.5 + 4 * order[n] ** 2 + (n in self.prog.params) for n in names])
        return names[self.rng.choice(len(names), p=w / w.sum())]

    def emit(self, op, args, result, tag=None, bounded=True, **kw):
        """Append a step after checking its value in torch; raise _Reject if it is ill-conditioned.

        Only the loss terms may exceed LIMIT (bounded=False): nothing downstream amplifies them."""
        vals = [_const(a, "torch") if isinstance(a, Const) else self.values[a] for a in args]
        out = _RUN["torch"][op](vals, kw, self.prog.dims)
        _check_conditioning(op, vals, out, kw, bounded)
        if tuple(out.shape) != _concrete(result, self.prog.dims):
            raise AssertionError(f"fuzz_graphs: shape rule for {op} says {result}, torch gives {tuple(out.shape)}")
        name = f"v{len(self.prog.steps)}"
        self.prog.steps.append(Step(name, op, tuple(args), kw, tag or op))
        self.uses.update(a for a in args if isinstance(a, str))
        self.shapes[name], self.values[name] = result, out
        return name

    def attempt(self, move, *args, tries=6):
        """Run a move, retrying with fresh random choices (steps a failed try already emitted are valid and stay)."""
        for _ in range(tries):
            try:
                return move(*args)
            except _Reject:
                continue
        return None

    # moves
    def positive(self, v):
        """v itself when all of it is >= DOMAIN, else a positive function of it."""
        if self.values[v].min() >= DOMAIN:
            return v
        kind = self.rng.integers(4)
        if kind == 0:
            return self.emit("add", [self.emit("softplus", [v], self.shapes[v]), Const(0.5)], self.shapes[v])
        if kind == 1:
            return self.emit("add", [self.emit("square", [v], self.shapes[v]), Const(1.0)], self.shapes[v])
        if kind == 2:
            return self.emit("add", [self.emit("sigmoid", [v], self.shapes[v]), Const(0.3)], self.shapes[v])
        return self.emit("exp", [self.emit("mul", [v, Const(0.25)], self.shapes[v])], self.shapes[v])

    def unary(self, v=None):
        v = v or self.pick(self.floats())
        op = self.rng.choice(list(UNARY) + ["neg"] + [n for n in USER_OPS if n != "fuzz_mix"])
        if op in ("log", "sqrt"):
            v = self.positive(v)
        return self.emit(str(op), [v], self.shapes[v])

    def binary(self, a=None, op=None):
        """a (op) b for a partner b that broadcasts with a: another value or a constant."""
        rng = self.rng
        a = a or self.pick(self.floats())
        op = op or str(rng.choice(list(BINARY) + ["maximum", "fuzz_mix"], p=[.2, .15, .2, .15, .1, .1, .1]))
        sa = self.shapes[a]
        partners = [n for n in self.floats(lambda s: broadcast(s, sa) is not None and len(broadcast(s, sa)) <= 4)
                    if n != a]
        if partners and rng.random() < 0.75:
            b = self.pick(partners)
        else:   # a python scalar or an array of the int-only suffix of a's shape (B axes become 1)
            cshape = () if rng.random() < 0.5 or not sa else tuple(1 if d == BATCH else d for d in sa[rng.integers(len(sa)):])
            b = self.const(cshape)
        if rng.random() < 0.5 and op != "pow":
            a, b = b, a
        shape = broadcast(self.shape_of(a), self.shape_of(b))
        if op == "div" and not isinstance(b, Const):
            b = self.positive(b)
        elif op == "div" and isinstance(b.value, np.ndarray):
            b = Const(np.abs(b.value) + 0.5, b.name)
        elif op == "div":
            b = Const(abs(b.value) + 0.5)
        if op == "pow":
            return self.power(a, b, shape)
        return self.emit(op, [a, b], shape, tag=f"{op}[const]" if any(isinstance(x, Const) for x in (a, b)) else op)

    def power(self, a, b, shape):
        """base ** exponent with a positive base: value ** c, c ** value, or value ** value."""
        kind = self.rng.integers(3)
        if kind == 0 or isinstance(a, Const):
            c = Const(float(self.rng.choice([2.0, 3.0, 0.5, -1.0, 1.5, -0.5, 2.5])))
            return self.emit("pow", [self.positive(a if not isinstance(a, Const) else b), c],
                             self.shapes[a if not isinstance(a, Const) else b], tag="pow[const exp]")
        if kind == 1:
            return self.emit("pow", [Const(float(self.rng.choice([0.5, 1.5, 2.0]))), a], self.shapes[a],
                             tag="pow[const base]")
        if isinstance(b, Const):
            raise _Reject("value ** value needs two values")
        return self.emit("pow", [self.positive(a), self.emit("tanh", [b], self.shapes[b])], shape, tag="pow[value exp]")

    def matmul(self, a=None, b=None):
        """a @ b over rank-1/2 operands; a new weight (or a constant matrix) when nothing fits."""
        rng = self.rng
        form = str(rng.choice(["op", "fn"]))
        if a is None:
            a = self.pick(self.floats(lambda s: 1 <= len(s) <= 2))
        sa = self.shapes[a]
        if b is None:
            partners = self.floats(lambda s: matmul_shape(sa, s) is not None)
            if partners and rng.random() < 0.6:
                b = self.pick(partners)
            elif isinstance(sa[-1], int) and rng.random() < 0.2:
                b = self.const((sa[-1],) + ((int(rng.integers(2, 6)),) if rng.random() < 0.7 else ()))
            else:
                if len(self.prog.params) >= MAX_PARAMS or not isinstance(sa[-1], int):
                    raise _Reject("no partner")
                b = self.add_param((sa[-1], int(rng.choice([self.N, self.M, self.C])))
                                   if rng.random() < 0.8 else (sa[-1],))
        sb = self.shape_of(b)
        shape = matmul_shape(sa, sb)
        if shape is None:
            raise _Reject("inner dims differ")
        tag = "matmul[" + {(2, 2): "mm", (2, 1): "mv", (1, 2): "vm", (1, 1): "dot"}[len(sa), len(sb)] + "]"
        return self.emit("matmul", [a, b], shape, tag=tag, form=form)

    def const_matmul(self):
        """constant @ value: numpy's operand on the left."""
        b = self.pick(self.floats(lambda s: 1 <= len(s) <= 2 and isinstance(s[0], int)))
        sb = self.shapes[b]
        c = self.const((int(self.rng.integers(2, 6)), sb[0]))
        return self.emit("matmul", [c, b], matmul_shape(c.value.shape, sb), tag="matmul[const]", form="op")

    def layout(self, v=None):
        v = v or self.pick(self.floats(lambda s: len(s) >= 1))
        s = self.shapes[v]
        rng = self.rng
        if len(s) >= 2 and rng.random() < (0.45 if len(s) == 2 else 0.7):
            if len(s) == 2:
                form = str(rng.choice(["T", "fn", "axes"]))
                return self.emit("transpose", [v], s[::-1], tag=f"transpose[{form}]", form=form,
                                 axes=(1, 0) if form == "axes" else None)
            axes = tuple(int(i) for i in rng.permutation(len(s)))
            if axes == tuple(range(len(s))):
                axes = axes[1:] + axes[:1]
            return self.emit("transpose", [v], tuple(s[i] for i in axes), tag=f"transpose[{len(s)}d]", form="axes",
                             axes=axes)
        target = self.reshape_target(s)
        shown = list(target)
        ints = [i for i, d in enumerate(target) if isinstance(d, int)]
        if ints and rng.random() < 0.3:   # -1 only ever stands for ints: B stays named
            shown[ints[rng.integers(len(ints))]] = -1
        return self.emit("reshape", [v], target, tag="reshape", form=str(rng.choice(["method", "fn"])),
                         shape=tuple(shown))

    def rank3(self):
        """A rank-3 detour: reshape a matrix to rank 3, maybe broadcast it (an outer product when the
        partner fills the unit axis), then transpose and/or reduce it over two axes."""
        v = self.pick(self.floats(lambda s: len(s) == 2))
        s = self.shapes[v]
        at = int(self.rng.integers(3))
        t = self.emit("reshape", [v], s[:at] + (1,) + s[at:], tag="reshape", form="method", shape=s[:at] + (1,) + s[at:])
        if self.rng.random() < 0.5:
            t = self.binary(t)
        if self.rng.random() < 0.6:
            t = self.layout(t) if len(self.shapes[t]) == 3 else t
        return self.reduce(t) if len(self.shapes[t]) == 3 else t

    # images (N, C, H, W), convolutions, pools
    def image(self):
        """A 4-D value from a (B, k) one: reshaped when k factors as C*H*W, else through a new weight."""
        rng = self.rng
        a = self.pick(self.floats(lambda s: len(s) == 2 and s[0] == BATCH and isinstance(s[1], int)))
        k = self.shapes[a][1]
        chw = [(c, h, k // (c * h)) for c in range(1, 5) for h in range(1, 9)
               if k % (c * h) == 0 and 1 <= k // (c * h) <= 8 and h * (k // (c * h)) > 1]
        if not chw or rng.random() < 0.6:
            if len(self.prog.params) >= MAX_PARAMS:
                raise _Reject("no room for a weight")
            c, h, w = int(rng.integers(1, 4)), int(rng.integers(2, 7)), int(rng.integers(2, 7))
            a = self.matmul(a, self.add_param((k, c * h * w), scale=1 / math.sqrt(k)))
        else:
            c, h, w = chw[rng.integers(len(chw))]
        target = (BATCH, c, h, w)
        return self.emit("reshape", [a], target, tag="reshape[image]", form=str(rng.choice(["method", "fn"])),
                         shape=target)

    def images(self):
        names = self.floats(lambda s: len(s) == 4 and all(isinstance(d, int) for d in s[1:]))
        if not names:
            self.image()
            names = self.floats(lambda s: len(s) == 4 and all(isinstance(d, int) for d in s[1:]))
        return names

    def conv(self):
        rng = self.rng
        x = self.pick(self.images())
        _, c, h, w = self.shapes[x]
        groups = int(rng.choice([g for g in range(1, c + 1) if c % g == 0])) if rng.random() < 0.35 else 1
        o = groups * int(rng.integers(1, max(1, 4 // groups) + 1))
        kh, kw = (int(k) for k in rng.integers(1, 4, 2))
        kw_ = {}
        stride, padding, dilation = (1, 1), (0, 0), (1, 1)
        if rng.random() < 0.4:
            stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        if rng.random() < 0.5:
            padding = (int(rng.integers(0, 2)), int(rng.integers(0, 3)))
        if rng.random() < 0.25:
            dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        for name, v, default in (("stride", stride, (1, 1)), ("padding", padding, (0, 0)),
                                 ("dilation", dilation, (1, 1))):
            if v != default or rng.random() < 0.1:
                kw_[name] = v[0] if v[0] == v[1] and rng.random() < 0.7 else v
        if groups > 1 or rng.random() < 0.1:
            kw_["groups"] = groups
        ho, wo = (conv_len(n, k, s, p, d) for n, k, s, p, d in zip((h, w), (kh, kw), stride, padding, dilation))
        if ho < 1 or wo < 1:
            raise _Reject("kernel larger than the input")
        wshape = (o, c // groups, kh, kw)
        shared = [p for p in self.floats(lambda s: s == wshape) if p in self.prog.params]
        if shared and rng.random() < 0.5:
            weight = self.pick(shared)
        elif len(self.prog.params) < MAX_PARAMS:
            weight = self.add_param(wshape, scale=1 / math.sqrt(c // groups * kh * kw))
        else:
            raise _Reject("no room for a weight")
        args = [x, weight]
        if rng.random() < 0.5 and len(self.prog.params) < MAX_PARAMS:
            args.append(self.add_param((o,), scale=0.5))
        tag = "conv2d[" + ", ".join(["bias"] * (len(args) == 3) + sorted(kw_)) + "]"
        return self.emit("conv2d", args, (self.shapes[x][0], o, ho, wo), tag=tag.replace("[]", ""), **kw_)

    def pool(self):
        rng = self.rng
        x = self.pick(self.images())
        n, c, h, w = self.shapes[x]
        op = str(rng.choice(["max_pool2d", "avg_pool2d"]))
        kernel = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        if kernel == (1, 1):
            kernel = (2, 2)
        stride = kernel
        kw = {"kernel_size": kernel[0] if kernel[0] == kernel[1] and rng.random() < 0.7 else kernel}
        if rng.random() < 0.5:
            stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
            kw["stride"] = stride[0] if stride[0] == stride[1] else stride
        padding = (0, 0)
        if rng.random() < 0.35:
            padding = tuple(int(rng.integers(0, k // 2 + 1)) for k in kernel)
            kw["padding"] = padding[0] if padding[0] == padding[1] else padding
        ho, wo = (conv_len(d, k, s, p) for d, k, s, p in zip((h, w), kernel, stride, padding))
        if ho < 1 or wo < 1:
            raise _Reject("window larger than the input")
        tag = op + ("[" + ", ".join(k for k in ("stride", "padding") if k in kw) + "]" if len(kw) > 1 else "")
        return self.emit(op, [x], (n, c, ho, wo), tag=tag, **kw)

    # indexing, joins, embeddings, batched matmul, random ops
    def index(self):
        rng = self.rng
        v = self.pick(self.floats(lambda s: len(s) >= 1 and any(isinstance(d, int) and d > 1 for d in s)))
        s = self.shapes[v]
        items, shape = [], []
        for d in s:
            kind = rng.random()
            if isinstance(d, str) or kind < 0.3:
                items.append(slice(None))
                shape.append(d)
            elif kind < 0.5:
                i = int(rng.integers(d))
                items.append(i - d if rng.random() < 0.4 else i)
            else:
                step = [None, None, 1, 2, -1, -2][rng.integers(6)]
                start, stop = (None if rng.random() < 0.35 else int(rng.integers(-d, d + 1)) for _ in range(2))
                item = slice(start, stop, step)
                n = len(range(*item.indices(d)))
                if n == 0:
                    raise _Reject("empty slice")
                items.append(item)
                shape.append(n)
        if all(isinstance(i, slice) and (isinstance(d, str) or i.indices(d) == (0, d, 1)) for i, d in zip(items, s)):
            raise _Reject("the whole value")
        if rng.random() < 0.1:
            at = int(rng.integers(len(items) + 1))
            items.insert(at, None)
            shape.insert(at - sum(isinstance(i, int) for i in items[:at]), 1)
        # a run of whole axes written as `...` (at most one), or trailing ones left out
        whole = [j for j, i in enumerate(items) if i == slice(None)]
        if whole and rng.random() < 0.4:
            j = whole[rng.integers(len(whole))]
            end = j
            while end + 1 < len(items) and items[end + 1] == slice(None):
                end += 1
            items[j:end + 1] = [Ellipsis]
        while Ellipsis not in items and items and items[-1] == slice(None) and rng.random() < 0.6:   # after `...` they count
            items.pop()
        if not items:
            raise _Reject("no index")
        key = items[0] if len(items) == 1 and rng.random() < 0.8 else tuple(items)
        tags = {"int" if isinstance(i, int) else "None" if i is None else "..." if i is Ellipsis else
                "step" if isinstance(i, slice) and i.step not in (None, 1) else "slice" for i in items}
        if any(isinstance(i, int) and i < 0 or isinstance(i, slice) and any(
                b is not None and b < 0 for b in (i.start, i.stop, i.step)) for i in items):
            tags.add("negative")
        return self.emit("index", [v], tuple(shape), tag=f"index[{', '.join(sorted(tags))}]", key=key)

    def split(self):
        """A value cut into adjacent pieces along an int axis, read in any order, each through an op of its own
        (an LSTM's gates): the pieces' adjoints join into a concat (gradc/ops/index.py)."""
        rng = self.rng
        v = self.pick(self.floats(lambda s: any(isinstance(d, int) and d >= 2 for d in s)))
        s = self.shapes[v]
        axis = int(rng.choice([a for a, d in enumerate(s) if isinstance(d, int) and d >= 2]))
        k = int(rng.integers(2, min(4, s[axis]) + 1))
        bounds = [0, *sorted(int(c) for c in rng.choice(np.arange(1, s[axis]), k - 1, replace=False)), s[axis]]
        for i in rng.permutation(k)[:k - int(rng.random() < 0.3)]:   # (now and then a piece is left unread)
            key = (slice(None),) * axis + (slice(bounds[i], bounds[i + 1]),)
            piece = self.emit("index", [v], s[:axis] + (bounds[i + 1] - bounds[i],) + s[axis + 1:],
                              tag="split[piece]", key=key)
            self.unary(piece)

    def join(self):
        rng = self.rng
        op = "stack" if rng.random() < 0.35 else "concat"
        if op == "stack":
            a = self.pick(self.floats(lambda s: 1 <= len(s) <= 3))
            s = self.shapes[a]
            others = self.floats(lambda t: t == s)
            axis = int(rng.integers(-len(s) - 1, len(s) + 1))
        else:
            a = self.pick(self.floats(lambda s: any(isinstance(d, int) for d in s)))
            s = self.shapes[a]
            ax = int(rng.choice([i for i, d in enumerate(s) if isinstance(d, int)]))
            others = self.floats(lambda t: len(t) == len(s) and isinstance(t[ax], int) and
                                 all(d == e for i, (d, e) in enumerate(zip(s, t)) if i != ax))
            axis = ax - len(s) if rng.random() < 0.3 else ax
        operands = [a] + [self.pick(others) for _ in range(1 if rng.random() < 0.75 else 2)]
        if op == "stack":
            r = axis % (len(s) + 1)
            shape = s[:r] + (len(operands),) + s[r:]
        else:
            shape = s[:ax] + (sum(self.shapes[o][ax] for o in operands),) + s[ax + 1:]
        return self.emit(op, operands, shape, tag=f"{op}[{len(operands)}]", axis=axis)

    def take(self):
        rng = self.rng
        ints = [n for n in self.int_high if n in self.prog.inputs]
        if not ints or rng.random() < 0.3:
            name = f"ids{len(self.int_high)}"
            shape = (BATCH,) if rng.random() < 0.5 else (BATCH, int(rng.integers(2, 4)))
            ints.append(self.add_input(name, shape, "int64", high=int(rng.integers(3, 8))))
        idx = ints[rng.integers(len(ints))]
        rows = self.int_high[idx]
        s = self.shapes[idx]
        if len(s) == 2 and self.later.random() < 0.4:   # an index array the model makes: a column, reversed, joined
            kind = int(self.later.integers(3))
            if kind == 2:
                idx = self.emit("concat", [idx, idx], (s[0], 2 * s[1]), tag="concat[int values]", axis=1)
            else:
                key = (slice(None), int(self.later.integers(s[1]))) if kind == 0 else (slice(None), slice(None, None, -1))
                idx = self.emit("index", [idx], (s[0],) if kind == 0 else s, tag="index[int values]", key=key)
            self.single_use.add(idx)   # an int value: never a float operand
        tables = self.floats(lambda s: len(s) == 2 and s[0] == rows and isinstance(s[1], int))
        if tables and rng.random() < 0.5:
            table = self.pick(tables)
        elif len(self.prog.params) < MAX_PARAMS:
            table = self.add_param((rows, int(rng.choice([self.N, self.M, self.C]))))
        else:
            raise _Reject("no table")
        tag = "take[" + ("param" if table in self.prog.params else "value") + f", idx rank {len(self.shapes[idx])}]"
        return self.emit("take", [table, idx], self.shapes[idx] + self.shapes[table][1:], tag=tag)

    def batch_matmul(self):
        """matmul with an operand of rank >= 3 (batched over the leading dims, broadcast as numpy)."""
        rng = self.rng
        a = self.pick(self.floats(lambda s: len(s) >= 3))
        sa = self.shapes[a]
        partners = self.floats(lambda s: batch_matmul_shape(sa, s) is not None)
        left = False
        if partners and rng.random() < 0.5:
            b = self.pick(partners)
        else:
            if len(self.prog.params) >= MAX_PARAMS or not isinstance(sa[-1], int):
                raise _Reject("no partner")
            k = int(rng.choice([self.N, self.M, self.C]))
            left = isinstance(sa[-2], int) and rng.random() < 0.3
            kind = rng.random()
            batch = tuple(1 if isinstance(d, str) or rng.random() < 0.5 else d for d in sa[-3:-2]) if kind < 0.3 else ()
            if left:   # weight @ a: (.., k, sa[-2]) @ (.., sa[-2], sa[-1])
                b = self.add_param(batch + (k, sa[-2]), scale=1 / math.sqrt(sa[-2]))
            else:
                b = self.add_param(batch + (sa[-1], k) if kind < 0.85 else (sa[-1],), scale=1 / math.sqrt(sa[-1]))
        a, b = (b, a) if left else (a, b)
        shape = batch_matmul_shape(self.shapes[a], self.shapes[b])
        if shape is None:
            raise _Reject("inner dims differ")
        tag = f"matmul[batched {len(self.shapes[a])}d @ {len(self.shapes[b])}d]"
        return self.emit("matmul", [a, b], shape, tag=tag, form=str(rng.choice(["op", "fn"])))

    SEED_INPUT = SEED   # the int input random ops draw from
    STEP_GAINS = 0.0    # the chance of a gain (a param read elementwise) in a scan's step, and of a product
                        # returned as a y besides its sum (the lr fuzzer's)

    def random(self):
        rng = self.rng
        if self.SEED_INPUT not in self.prog.inputs:
            self.add_input(self.SEED_INPUT, (), "int64")
        v = self.pick(self.floats(lambda s: len(s) >= 1))
        if rng.random() < 0.5:
            kw = {"dist": "dropout", "p": float(rng.choice([0.1, 0.25, 0.5]))}
        else:
            kw = {"dist": "normal", "std": float(rng.choice([0.1, 0.5, 1.0]))}
        out = self.emit("random", [v, self.SEED_INPUT], self.shapes[v], tag="dropout" if kw["dist"] == "dropout"
                        else "gaussian_noise", stream=self.streams, **kw)
        self.streams += 1
        return out

    def scan(self):
        """gc.scan of a random recurrent cell over a sequence; its carries and ys join the values."""
        rng = self.rng
        if len(self.prog.params) >= MAX_PARAMS:
            raise _Reject("params")
        rows = self.floats(lambda s: len(s) == 2 and s[0] == BATCH and isinstance(s[1], int))
        a = self.pick(rows)
        H = self.shapes[a][1]
        K = 2 if rng.random() < 0.35 else 1
        init = [a] + ([self.pick([n for n in rows if self.shapes[n] == (BATCH, H)])] if K == 2 else [])
        seqs = self.floats(lambda s: len(s) == 3 and isinstance(s[0], int) and s[1] == BATCH and isinstance(s[2], int))
        r = rng.random()
        if seqs and r < 0.4:   # another scan's ys, or any (T, B, D) value
            xs = [self.pick(seqs)]
        elif r < 0.7:
            xs = [self.add_input(f"s{len(self.prog.inputs)}", (int(rng.integers(2, 6)), BATCH, int(rng.choice([self.N, self.M]))))]
        else:   # activations stacked into a sequence: their gradients come out of the scan's
            first = self.pick(rows)
            same = [n for n in rows if self.shapes[n] == self.shapes[first]]
            parts = [first] + [self.pick(same) for _ in range(int(rng.integers(1, 4)))]
            xs = [self.emit("stack", parts, (len(parts),) + self.shapes[first], tag="stack[scan xs]", axis=0)]
        T = self.shapes[xs[0]][0]
        if rng.random() < 0.25:
            xs.append(self.add_input(f"s{len(self.prog.inputs)}", (T, BATCH, int(rng.choice([self.M, self.C])))))
        steps, closed = [], []
        hs, xn = [f"h{k}" for k in range(K)], [f"x{j}" for j in range(len(xs))]

        def op(name, args, **kw):
            for u in args:
                if isinstance(u, str) and u in self.shapes and u not in closed:
                    closed.append(u)
            steps.append(Step(f"u{len(steps)}", name, tuple(args), kw, name))
            return steps[-1].out

        def weight(n_in, n_out):
            return self.add_param((n_in, n_out), scale=0.9 / math.sqrt(n_in))

        terms = [op("matmul", [hs[0], weight(H, H)], form="op")]
        if K == 2 and rng.random() < 0.5:
            terms.append(op("matmul", [hs[1], weight(H, H)], form="fn"))
        terms += [op("matmul", [x, weight(self.shapes[s][2], H)], form="op") for x, s in zip(xn, xs)]
        if rng.random() < 0.6:
            terms.append(self.add_param((H,), scale=0.5))
        returned = None   # a product added into the pre-activation and returned as a y too (the lr fuzzer's)
        if self.STEP_GAINS and rng.random() < self.STEP_GAINS:
            returned = op("matmul", [xn[0], weight(self.shapes[xs[0]][2], H)], form="op")
            terms.append(returned)
        nested = self.nest_rng.random() < self.nest_chance
        if nested:   # a scan in the step: over the whole first sequence, from the carry it also closes over
            seq = xs[0]
            Wi, Ui = weight(H, H), weight(self.shapes[seq][2], H)
            inner_steps = []

            def inner_op(name, args, **kw):
                inner_steps.append(Step(f"w{len(self.prog.steps)}_{len(inner_steps)}", name, tuple(args), kw, name))
                return inner_steps[-1].out

            pre = inner_op("add", [inner_op("matmul", ["g0", Wi], form="op"), inner_op("matmul", ["y0", Ui], form="op")])
            pre = inner_op("add", [pre, inner_op("mul", [hs[0], Const(0.5)])])
            inner = Cell(f"cell{len(self.prog.steps)}_in", ("g0",), ("y0",), (Wi, Ui, hs[0]), inner_steps,
                         (inner_op(str(self.nest_rng.choice(["tanh", "sigmoid"])), [pre]),), ())
            res = op("scan", [hs[0], seq, Wi, Ui, hs[0]], cell=inner, reverse=bool(self.nest_rng.random() < 0.5))
            terms.append(op("mul", [op("item", [res], i=0, path=(0,)), Const(0.5)]))
        outer = [n for n in rows if self.shapes[n] == (BATCH, H) and n not in init]
        if outer and rng.random() < 0.3:   # a closed-over activation: its gradient sums over the steps
            terms.append(op("mul", [self.pick(outer), Const(0.3)]))
        pre = terms[0]
        for t in terms[1:]:
            pre = op("add", [pre, t])
        f = str(rng.choice(["tanh", "sigmoid", "sin", "fuzz_rational"]))
        cand = op(f, [pre])
        if self.STEP_GAINS and rng.random() < self.STEP_GAINS:   # a gain, maybe clipped, on the step's candidate
            cand = op(str(rng.choice(["mul", "maximum"])), [cand, self.add_param((H,), scale=0.5)])
        gated = rng.random() < 0.4
        if gated:   # GRU-like: z * h + (1 - z) * cand
            z = op("sigmoid", [op("add", [op("matmul", [hs[0], weight(H, H)], form="op"),
                                          op("matmul", [xn[0], weight(self.shapes[xs[0]][2], H)], form="op")])])
            cand = op("add", [op("mul", [z, hs[0]]), op("mul", [op("sub", [Const(1.0), z]), cand])])
        new = [cand]
        if K == 2:
            new.append(op("add", [op("mul", [hs[1], Const(0.6)]), op("mul", [cand, op("tanh", [hs[1]])])])
                       if rng.random() < 0.5 else op("fuzz_mix", [hs[1], cand]))
        kinds = rng.permutation(4)[:int(rng.choice([0, 1, 1, 2]))]
        ys = [[lambda: cand, lambda: op("tanh", [op("mul", [cand, hs[0]])]),
               lambda: op("matmul", [cand, weight(H, self.C)], form="op"),
               lambda: op("softmax", [cand], axis=-1)][k]() for k in kinds] + ([returned] if returned else [])
        cell = Cell(f"cell{len(self.prog.steps)}", tuple(hs), tuple(xn), tuple(closed), steps, tuple(new), tuple(ys))
        reverse = bool(rng.random() < 0.3)
        args = init + xs + closed
        kw = {"cell": cell, "reverse": reverse}
        out = _RUN["torch"]["scan"]([self.values[u] for u in args], kw, self.prog.dims)
        if not all(torch.isfinite(o).all() and o.abs().max() <= LIMIT for o in out):
            raise _Reject("large")
        name = f"v{len(self.prog.steps)}"
        tag = (f"scan[{K} carr{'y' if K == 1 else 'ies'}, {len(xs)} xs, {len(ys)} ys" + ", gated" * gated +
               ", a scan in the step" * nested +
               ", reverse" * reverse + ", over a scan" * any(self.prog_step(x) == "item" for x in xs) + "]")
        self.prog.steps.append(Step(name, "scan", tuple(args), kw, tag))
        self.uses.update(args)
        self.values[name] = out   # a tuple: no operand of other steps, so no shape
        results = [((BATCH, H), (0,) if K == 1 else (0, k)) for k in range(K)]
        results += [((T, BATCH) + tuple(out[K + m].shape[2:]), (1,) if len(ys) == 1 else (1, m)) for m in range(len(ys))]
        for i, (shape, path) in enumerate(results):
            self.emit("item", [name], shape, tag="scan result", i=i, path=path)
        return name

    def prog_step(self, name):
        """The op of the step that made `name` (None for a leaf)."""
        return next((st.op for st in self.prog.steps if st.out == name), None)

    def reshape_target(self, s):
        rng = self.rng
        options = []
        if len(s) < 3:
            at = int(rng.integers(len(s) + 1))
            options.append(s[:at] + (1,) + s[at:])
        if 1 in s:
            options.append(tuple(d for d in s if d != 1))
        if len(s) == 2 and BATCH in s:
            options.append(s[::-1])
        for i in range(len(s) - 1):
            if isinstance(s[i], int) and isinstance(s[i + 1], int):
                options.append(s[:i] + (s[i] * s[i + 1],) + s[i + 2:])
        if len(s) >= 3 and all(isinstance(d, int) for d in s[1:]):   # flatten: (B, C, H, W) -> (B, C*H*W)
            options += [(s[0], math.prod(s[1:]))] * 2
        for i, d in enumerate(s):
            if isinstance(d, int) and d in (4, 6) and len(s) < 3:
                options.append(s[:i] + (2, d // 2) + s[i + 1:])
        if not options:
            raise _Reject("no reshape")
        return options[rng.integers(len(options))]

    def reduce(self, v=None):
        v = v or self.pick(self.floats(lambda s: len(s) >= 1))
        s = self.shapes[v]
        rng = self.rng
        op = str(rng.choice(["sum", "mean", "max"]))
        if rng.random() < 0.25:
            axis = None
        elif len(s) >= 3 and rng.random() < 0.5:
            axis = tuple(sorted(int(i) for i in rng.choice(len(s), 2, replace=False)))
        else:
            axis = int(rng.integers(len(s))) - (len(s) if rng.random() < 0.3 else 0)
        keepdims = bool(rng.random() < 0.4)
        tag = f"{op}[{'all' if axis is None else 'axes'}{', keepdims' if keepdims else ''}]"
        return self.emit(op, [v], reduced_shape(s, axis, keepdims), tag=tag, axis=axis, keepdims=keepdims,
                         form=str(rng.choice(["method", "fn"])))

    def softmax(self, v=None):
        v = v or self.pick(self.floats(lambda s: len(s) >= 1))
        op = str(self.rng.choice(["softmax", "log_softmax"]))
        return self.emit(op, [v], self.shapes[v], axis=int(self.rng.integers(len(self.shapes[v]))) - 1
                         if len(self.shapes[v]) > 1 else -1)

    def logits(self):
        """A (B, C) value for softmax_cross_entropy: one that exists, or a batch value times a weight."""
        have = self.floats(lambda s: s == (BATCH, self.C), leaves=False)
        if have and self.rng.random() < 0.5:
            return self.pick(have)
        a = self.pick(self.floats(lambda s: len(s) == 2 and s[0] == BATCH and isinstance(s[1], int)))
        weights = [p for p in self.floats(lambda s: s == (self.shapes[a][1], self.C)) if p in self.prog.params]
        w = self.pick(weights) if weights and self.rng.random() < 0.5 else self.add_param((self.shapes[a][1], self.C))
        return self.matmul(a, w)

    def logits_per_position(self, k):
        """A (B, k, C) value for softmax_cross_entropy with labels (B, k): a batch value times a weight
        (B, k * C), reshaped."""
        a = self.pick(self.floats(lambda s: len(s) == 2 and s[0] == BATCH and isinstance(s[1], int)))
        flat = self.matmul(a, self.add_param((self.shapes[a][1], k * self.C)))
        return self.emit("reshape", [flat], (BATCH, k, self.C), tag="reshape[logits per position]",
                         form=str(self.rng.choice(["method", "fn"])), shape=(BATCH, k, self.C))

    def term(self, v):
        """v reduced to a scalar loss term."""
        rng = self.rng
        s = self.shapes[v]
        if s == ():
            return v
        kind = rng.integers(4)
        if kind == 0:   # a weighted sum: a constant array breaks symmetries between elements
            cshape = tuple(1 if d == BATCH else d for d in s[rng.integers(len(s)):])
            w = self.emit("mul", [v, self.const(cshape)], s, tag="mul[const]", bounded=False)
            return self.emit("sum", [w], (), tag="sum[all]", bounded=False, axis=None, keepdims=False, form="method")
        if kind == 1:
            return self.emit("mean", [v], (), tag="mean[all]", bounded=False, axis=None, keepdims=False, form="fn")
        if kind == 2:
            sq = self.emit("square", [v], s, bounded=False)
            return self.emit("sum", [sq], (), tag="sum[all]", bounded=False, axis=None, keepdims=False, form="fn")
        targets = [n for n in self.floats(lambda t: t == s) if n != v]
        if targets:
            target = self.pick(targets)
        elif BATCH not in s:
            target = self.const(s)
        else:
            raise _Reject("no mse target")
        return self.emit("mse", [v, target], (), tag="mse[const]" if isinstance(target, Const) else "mse",
                         bounded=False)


def _check_conditioning(op, vals, out, kw, bounded):
    if not torch.isfinite(out).all() or (bounded and out.abs().max() > LIMIT):
        raise _Reject("large")
    x = vals[0]
    if op in ("relu", "abs") and x.abs().min() < KINK:
        raise _Reject("kink")
    if op == "maximum" and (vals[0] - vals[1]).abs().min() < KINK:
        raise _Reject("tie")
    if op in ("log", "sqrt") and x.min() < DOMAIN:
        raise _Reject("domain")
    if op == "div" and vals[1].abs().min() < DOMAIN:
        raise _Reject("domain")
    if op == "pow" and (vals[0].min() < DOMAIN or vals[1].abs().max() > 3):
        raise _Reject("domain")
    if op in ("exp", "softplus", "fuzz_mish") and x.max() > 3:
        raise _Reject("large")
    if op == "max_pool2d":
        kernel, stride, padding = (_pair(kw.get(k, d)) for k, d in (("kernel_size", None), ("stride", kw["kernel_size"]),
                                                                    ("padding", 0)))
        xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0]), value=-math.inf)
        windows = xp.unfold(2, kernel[0], stride[0]).unfold(3, kernel[1], stride[1]).reshape(-1, kernel[0] * kernel[1])
        if windows.shape[1] > 1:
            top = windows.topk(2, dim=1).values
            if (top[:, 0] - top[:, 1]).min() < KINK:
                raise _Reject("tie")
    if op == "max":
        axes = list(range(x.dim())) if kw["axis"] is None else [a % x.dim() for a in np.atleast_1d(kw["axis"])]
        rest = [a for a in range(x.dim()) if a not in axes]
        slices = x.permute(rest + axes).reshape(-1, math.prod(x.shape[a] for a in axes))
        if slices.shape[1] > 1:
            top = slices.topk(2, dim=1).values
            if (top[:, 0] - top[:, 1]).min() < KINK:
                raise _Reject("tie")


def _generate(seed, small=False, nested=True):
    g = _Generator(seed)
    rng = g.rng
    x = g.add_input("x", (BATCH, g.N))
    if rng.random() < 0.5:
        g.add_input("z", (BATCH, g.M))
    xent = rng.random() < 0.6
    if xent:
        g.add_input("y", (BATCH,), dtype="int64")
    # params that broadcast against (B, N) / (N, B) activations: their gradients are reductions
    # (and a reshape for (1, N) and (N, 1)); one might be frozen or decay though it is 1-D
    frozen = rng.random() < 0.2
    broadcasting = [((1, g.N), True, None), ((g.N,), not frozen, None), ((), True, rng.random() < 0.3 or None),
                    ((g.N, 1), True, None)]
    order = rng.permutation(len(broadcasting))
    for i in order:
        shape, trainable, decay = broadcasting[i]
        p = g.add_param(shape, trainable, decay)
        if shape == (g.N, 1):
            form = str(rng.choice(["T", "fn", "axes"]))
            partner = g.emit("transpose", [x], (g.N, BATCH), tag=f"transpose[{form}]", form=form,
                             axes=(1, 0) if form == "axes" else None)
        else:
            partner = g.pick(g.floats(lambda s: s == (BATCH, g.N)))
        g.attempt(lambda: _use_param(g, partner, p), tries=10)
        if len(shape) == 2 and rng.random() < 0.5:   # used once: its gradient ends in the reshape of a sum
            g.single_use.add(p)
    g.attempt(lambda: g.matmul(g.pick(g.floats(lambda s: s == (BATCH, g.N))), g.add_param((g.N, g.M))))
    if "z" in g.prog.inputs and rng.random() < 0.85:   # else z stays unused: a valid model too
        g.attempt(g.binary, "z")
    if rng.random() < 0.3:   # an image input (B, C, H, W); else images come from reshapes of (B, k) values
        g.add_input("img", (BATCH, int(rng.integers(1, 5)), int(rng.integers(2, 9)), int(rng.integers(2, 9))))
    # about half the programs are image programs: their moves lean to convolutions and pools
    vision = "img" in g.prog.inputs or rng.random() < 0.35
    moves = [g.unary, g.binary, g.matmul, g.const_matmul, g.layout, g.reduce, g.softmax, g.rank3,
             g.conv, g.pool, g.index, g.join, g.take, g.batch_matmul, g.random]
    weights = np.array([0.24, 0.28, 0.12, 0.03, 0.1, 0.12, 0.06, 0.05] +
                       ([0.2, 0.14, 0.1, 0.05, 0.05, 0.06, 0.05] if vision else [0.0, 0.0, 0.1, 0.05, 0.05, 0.04, 0.05]))
    for _ in range(int(rng.integers(3, 7) if small else rng.integers(8, 18))):
        g.attempt(moves[rng.choice(len(moves), p=weights / weights.sum())])
    # a split and scans draw from streams of their own: every other move of a seed stays what it was
    g.rng, main = np.random.default_rng([seed, 17]), rng
    if g.rng.random() < 0.3:
        g.attempt(g.split)
    g.rng = np.random.default_rng([seed, 7])
    g.nest_rng = np.random.default_rng([seed, 11])   # (whether a scan's step holds a scan: a stream of its own too)
    g.nest_chance = 0.3 if nested else 0.0
    for chance in (0.3, 0.4):
        if g.rng.random() >= chance or not g.attempt(g.scan):
            break
    g.rng = main
    # objective: every unused step (so nothing is dead) plus cross-entropy
    terms = []
    if xent:
        side = np.random.default_rng([seed, 13])
        if side.random() < 0.3:   # a sequence's loss: labels (B, k), logits (B, k, C), from a stream of their own
            g.rng, k = side, int(side.integers(2, 4))
            labels = g.add_input("yk", (BATCH, k), dtype="int64")
            logits = g.attempt(lambda: g.logits_per_position(k))
            g.rng = main
        else:
            labels, logits = "y", g.attempt(g.logits)
        if logits:
            terms.append(g.emit("xent", [logits, labels], (), bounded=False))
    sinks = [n for n in g.floats(leaves=False) if not g.uses[n] and n not in terms]
    for v in sinks:
        t = g.attempt(g.term, v)
        if t:
            terms.append(t)
    outputs = [n for n in g.floats(lambda s: s != (), leaves=False) if n not in terms]
    for i, v in enumerate(rng.choice(outputs, min(len(outputs), int(rng.integers(1, 3))), replace=False)):
        g.prog.outputs[f"out{i}"] = str(v)
    loss = terms[0]
    for t in terms[1:]:
        w = g.emit("mul", [t, Const(float(np.round(rng.uniform(0.3, 1.5), 3)))], (), tag="mul[const]", bounded=False)
        loss = g.emit(str(rng.choice(["add", "sub"])), [loss, w], (), bounded=False)
    g.prog.loss = loss
    g.prog.weight_decay = float(rng.choice([0.0, 0.0, 0.01, 0.1]))
    return g.prog, g.data


def _use_param(g, partner, p):
    """One binary op between a batch activation and a broadcasting param, the param on either side."""
    rng = g.rng
    op = str(rng.choice(["add", "sub", "mul", "div", "maximum", "fuzz_mix"]))
    a, b = (partner, p) if rng.random() < 0.6 else (p, partner)
    if op == "div":
        b = g.positive(b)
    return g.emit(op, [a, b], broadcast(g.shapes[a], g.shapes[b]))


# ---- cases ---------------------------------------------------------------------------------------
class Case:
    """One gradc Model built from one or more programs, its data, and the same objective in torch."""

    def __init__(self, programs, data, name):
        self.programs, self.name = programs, name
        self.seeds = [p.seed for p in programs]
        self.prefixes = [""] if len(programs) == 1 else [f"g{i}_" for i in range(len(programs))]
        self.weight_decay = programs[0].weight_decay
        self.params, self.inputs, self.trainable, self.decayed = {}, {}, [], []
        for prog, prefix, values in zip(programs, self.prefixes, data):
            for n, (shape, trainable, decay) in prog.params.items():
                self.params[prefix + n] = values[n]
                if trainable:
                    self.trainable.append(prefix + n)
                    if (len(shape) >= 2 if decay is None else decay):
                        self.decayed.append(prefix + n)
            for n in prog.inputs:
                self.inputs[prefix + n] = values[n]
        self.float_inputs = [n for n, v in self.inputs.items() if v.dtype.kind == "f"]
        rng = np.random.default_rng([*self.seeds, 99])
        self.tangents = {p: _draw(rng, self.params[p].shape) for p in self.trainable}
        try:
            self.model = self._build()
        except Exception as e:   # a valid model that gradc refuses is a finding too
            raise AssertionError(f"gradc refused the model of seed(s) {self.seeds}: {e!r}\nprogram:\n{self.text()}") from e

    def _build(self):
        m = gc.Model(self.name)
        losses = []
        for prog, prefix in zip(self.programs, self.prefixes):
            dims = {BATCH: prefix + BATCH}
            env = {n: m.input(prefix + n, _concrete(s, dims), dtype=None if d == "float" else d)
                   for n, (s, d) in prog.inputs.items()}
            # each program's random ops draw streams 0, 1, ... as when it was generated (by itself); the
            # programs' own seed inputs keep their draws apart
            m.graph.random_streams = 0
            env |= {n: m.param(prefix + n, s, trainable=t, decay=d) for n, (s, t, d) in prog.params.items()}
            env = prog.run(env, "gradc", dims)
            for o, v in prog.outputs.items():
                m.output(prefix + o, env[v])
            losses.append(env[prog.loss])
        m.minimize(sum(losses[1:], losses[0]), weight_decay=self.weight_decay)
        return m

    def torch_run(self, tensors):
        """(objective, outputs) in torch from a dict of tensors named as the model's params and inputs."""
        loss, outputs = 0.0, {}
        for prog, prefix in zip(self.programs, self.prefixes):
            env = {n: tensors[prefix + n] for n in list(prog.inputs) + list(prog.params)}
            env = prog.run(env, "torch", {BATCH: prog.dims[BATCH]})
            outputs |= {prefix + o: env[v] for o, v in prog.outputs.items()}
            loss = loss + env[prog.loss]
        decay = sum((tensors[p] ** 2).sum() for p in self.decayed)
        return loss + self.weight_decay / 2 * decay, outputs

    def torch_objective(self, tensors):
        return self.torch_run(tensors)[0]

    def text(self):
        return "\n".join(p.text(prefix) for p, prefix in zip(self.programs, self.prefixes))

    def coverage(self):
        """Counter of op variants and graph features in this case."""
        counts = Counter()
        for prog in self.programs:
            counts.update(s.tag for s in prog.steps)
            uses = Counter(a for s in prog.steps for a in s.args if isinstance(a, str))
            counts["feature: fan-out (a step used twice or more)"] += any(
                uses[s.out] >= 2 for s in prog.steps)
            counts["feature: shared weight (a param used twice or more)"] += any(uses[p] >= 2 for p in prog.params)
            counts["feature: const array"] += any(isinstance(a, Const) and a.name for s in prog.steps for a in s.args)
            counts["feature: int labels"] += "y" in prog.inputs
            counts["feature: labels (B, k), logits (B, k, C)"] += "yk" in prog.inputs
            counts["feature: (1, N) or (N, 1) param read once"] += any(
                len(s) == 2 and 1 in s and uses[p] == 1 for p, (s, _, _) in prog.params.items())
            counts["feature: frozen param"] += any(not t for _, t, _ in prog.params.values())
            counts["feature: weight decay"] += prog.weight_decay > 0
            counts["feature: batch of 1"] += prog.dims[BATCH] == 1
            counts["feature: image input"] += "img" in prog.inputs
            counts["feature: conv then pool"] += any(
                s.op in ("max_pool2d", "avg_pool2d") and any(t.out == s.args[0] and t.op == "conv2d" for t in prog.steps)
                for s in prog.steps)
            counts["feature: random ops seeded by an input"] += any(s.op == "random" for s in prog.steps)
        return counts


def random_case(seed, small=False):
    """small: fewer random steps (a model Numba compiles in seconds, not a minute)."""
    prog, data = _generate(seed, small)
    return Case([prog], [data], f"fuzz{seed}{'s' * small}")


def combined_case(seeds, small=True, nested=True):
    """One model holding the programs of several seeds (leaf names and batch dims prefixed g0_, g1_, ...);
    nested=False: no scan in a scan's step (the seeds' programs are otherwise the same)."""
    made = [_generate(s, small, nested) for s in seeds]
    return Case([p for p, _ in made], [d for _, d in made], "fuzz_" + "_".join(map(str, seeds)) + "s" * small)


# ---- checks --------------------------------------------------------------------------------------
def torch_reference(case):
    """Objective, outputs, gradients and H v of a case by torch autograd in float64."""
    leaves = {n: torch.tensor(v, requires_grad=n in case.trainable or n in case.float_inputs)
              for n, v in {**case.params, **case.inputs}.items()}
    objective, outputs = case.torch_run(leaves)
    wrt = case.trainable + case.float_inputs
    grads = torch.autograd.grad(objective, [leaves[n] for n in wrt], create_graph=True, allow_unused=True)
    grads = dict(zip(wrt, grads))
    gv = sum((grads[p] * torch.as_tensor(case.tangents[p])).sum() for p in case.trainable if grads[p] is not None)
    if torch.is_tensor(gv) and gv.requires_grad:
        hv = torch.autograd.grad(gv, [leaves[p] for p in case.trainable], allow_unused=True)
    else:
        hv = [None] * len(case.trainable)

    def array(t, name):
        return np.zeros(np.shape(leaves[name])) if t is None else t.detach().numpy(force=True)   # (a ZeroTensor too)
    return {"loss": objective.item(), "outputs": {k: v.detach().numpy() for k, v in outputs.items()},
            "grads": {p: array(grads[p], p) for p in case.trainable},
            "input_grads": {i: array(grads[i], i) for i in case.float_inputs},
            "hvps": {p: array(h, p) for p, h in zip(case.trainable, hv)}}


def gradc_interpreted(case, checkpointed=False):
    """The same quantities from gradc's order-2 training graph through its numpy interpreter. With
    `checkpointed`, the graph's dims are bound to the case's and every scan's backward that can reads
    carry checkpoints (passes/scan_checkpoint.py, what --memory-budget may choose); None when no
    scan's was rewritten."""
    if checkpointed:
        dims = {}
        for name, n in case.model.graph.inputs.items():
            for d, actual in zip(case.model.graph.shape(n), np.shape(case.inputs[name])):
                if isinstance(d, str):
                    dims[d] = actual
        graph = build_training_graph(case.model, "float64", dims=dims, order=2)
        if not checkpoint_scans(graph, dims):
            return None
    else:
        graph = build_training_graph(case.model, "float64", order=2)
    tables = {"grads": graph.grads, "input_grads": graph.input_grads, "hvps": graph.hvps, "outputs": graph.outputs}
    roots = [graph.objective] + [n for t in tables.values() for n in t.values() if n is not None]
    values = evaluate(graph, case.params, case.inputs, list(dict.fromkeys(roots)), tangents=case.tangents)
    leaves = {**case.params, **case.inputs}
    got = {"loss": float(values[graph.objective])}
    for key, table in tables.items():
        got[key] = {k: values[n] if n is not None else np.zeros(np.shape(leaves[k])) for k, n in table.items()}
    return got


def gradc_compiled(case, out, dtype="float64", hessian=True, **options):
    """The same quantities from the module gc.compile writes (plus the Hessian times v, as "hessian_v",
    unless hessian=False); options go to gc.compile (target, scan_backward)."""
    mod = gc.compile(case.model, out=out, dtype=dtype, **({"warm_cache": False} | options))
    cast = lambda d: {k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in d.items()}
    params, inputs, v = cast(case.params), cast(case.inputs), cast(case.tangents)
    loss, grads = mod.loss_and_grad(params, **inputs)
    fwd = mod.forward(params, **inputs)
    needed = [prefix + n for prog, prefix in zip(case.programs, case.prefixes) for n in prog.output_inputs()]
    # the module asks for no more than the outputs read (a scan's read for its other outputs alone may be left
    # out: passes/forward_outputs.py); with only those (when they are all the objective reads, "loss" comes too)
    assert set(mod._OUTPUT_INPUTS) <= set(needed), (mod._OUTPUT_INPUTS, needed)
    fwd_outputs_only = {k: x for k, x in mod.forward(params, **{k: inputs[k] for k in mod._OUTPUT_INPUTS}).items()
                        if k != "loss"}
    flat_v = np.concatenate([case.tangents[p].ravel() for p in mod.PARAM_ORDER if p in case.trainable])
    hessian_v = {"hessian_v": mod.hessian(params, **inputs) @ flat_v} if hessian else {}
    return hessian_v | {"loss": loss, "forward_loss": fwd["loss"],
            "outputs": {k: x for k, x in fwd.items() if k != "loss"}, "outputs_only": fwd_outputs_only,
            "grads": grads, "input_grads": mod.input_grads(params, **inputs), "hvps": mod.hvp(params, v, **inputs),
            "param_order": [p for p in mod.PARAM_ORDER if p in case.trainable]}


def least_budget(case, out, options):
    """The least --memory-budget every stage fits, as the error for a 1-byte budget names it."""
    try:
        gradc_compiled(case, out, hessian=False, order=2, memory_budget=1, **options)
    except gc.GradcError as e:
        found = re.search(r"below the least stage \d+ can be planned to, (?:[^(,]*\()?([\d,]+) bytes", str(e))
        if found:
            return int(found.group(1).replace(",", ""))
        raise
    return 1   # (stages that hold nothing)


def check_pipelined(case, out, schedule="1f1b", budget=False):
    """One program compiled with --devices 2 and --microbatches 2 (--devices 2 alone where the rows
    check refuses microbatches, naming why: a batch statistic, random ops, one row) against torch;
    with `budget`, under the least --memory-budget its stages fit (so they recompute). Returns the
    options it ran with."""
    (prog,) = case.programs
    batch = prog.dims[BATCH]
    ref = torch_reference(case)
    tries = ([dict(microbatches=2, schedule=schedule)] if batch >= 2 else []) + [{}]
    for extra in tries:
        options = dict(devices=2, bind={BATCH: batch}, **extra)
        try:
            if budget:
                options["memory_budget"] = least_budget(case, out, options)
            got = gradc_compiled(case, out, hessian=False, order=2, **options)
        except gc.GradcError as e:
            if extra and "--microbatches 2: " in str(e):
                continue
            raise _crashed(case, f"compiled {options}", e) from e
        except Exception as e:
            raise _crashed(case, f"compiled {options}", e) from e
        compare(case, got, ref, where=f"compiled {options}")
        return options


def compare(case, got, ref, rtol=1e-8, rtol_hvp=1e-7, where="interpreter"):
    """Raise AssertionError listing every mismatch, with the seeds and programs to reproduce it.

    Each array is compared to rtol plus an absolute slack of rtol times the largest reference value
    of its kind, so a tiny element that cancels is not judged on its own."""
    problems = []

    def check(label, a, b, tol, scale):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            problems.append(f"{label}: shape {a.shape}, expected {b.shape}")
        elif not np.allclose(a, b, rtol=tol, atol=tol * scale, equal_nan=False):
            err = np.abs(a - b).max()
            problems.append(f"{label}: max abs error {err:.3g} (tolerance {tol:g}, scale {scale:.3g})\n"
                            f"      got      {np.array2string(a.ravel()[:8], precision=10)}\n"
                            f"      expected {np.array2string(b.ravel()[:8], precision=10)}")

    def scale(table):
        return max([np.abs(v).max(initial=0.0) for v in table.values()] + [1e-12])

    check("loss", got["loss"], ref["loss"], rtol, abs(ref["loss"]))
    if "forward_loss" in got:
        check("forward loss", got["forward_loss"], ref["loss"], rtol, abs(ref["loss"]))
        for k, v in got["outputs_only"].items():
            check(f"forward (no labels) output {k}", v, ref["outputs"][k], rtol, np.abs(ref["outputs"][k]).max())
        if "hessian_v" in got:
            hv = np.concatenate([ref["hvps"][p].ravel() for p in got["param_order"]])
            check("hessian @ v", got["hessian_v"], hv, rtol_hvp, np.abs(hv).max(initial=1e-12))
    for key, tol in (("outputs", rtol), ("grads", rtol), ("input_grads", rtol), ("hvps", rtol_hvp)):
        if set(got[key]) != set(ref[key]):
            problems.append(f"{key}: names {sorted(got[key])}, expected {sorted(ref[key])}")
            continue
        # hvps all ~0 (roundoff of second-order terms that cancel, seed 169 of the lr fuzzer): judged against
        # 1e-8 of the gradients' size, the level below which float64 cannot tell them from 0
        floor = 1e-8 * scale(ref["grads"]) if key == "hvps" else 0.0
        for name in ref[key]:
            check(f"{key[:-1]} {name}", got[key][name], ref[key][name], tol, max(scale(ref[key]), floor))
    if problems:
        raise AssertionError(f"gradc ({where}) differs from torch for seed(s) {case.seeds}:\n  "
                             + "\n  ".join(problems) + "\nprogram:\n" + case.text())


def _crashed(case, where, e):
    return AssertionError(f"gradc ({where}) crashed for seed(s) {case.seeds}: {e!r}\nprogram:\n{case.text()}")


def check_interpreted(case):
    try:
        got = gradc_interpreted(case)
    except Exception as e:
        raise _crashed(case, "interpreter", e) from e
    ref = torch_reference(case)
    compare(case, got, ref)
    model = case.model.graph
    if any(model.op(n) == "scan" for n in model.nx.nodes):
        try:
            got = gradc_interpreted(case, checkpointed=True)
        except Exception as e:
            raise _crashed(case, "interpreter, carry checkpoints", e) from e
        if got is not None:
            compare(case, got, ref, where="interpreter, carry checkpoints")


def check_compiled(case, out, dtype="float64", rtol=1e-8, rtol_hvp=1e-7):
    try:
        got = gradc_compiled(case, out, dtype)
    except Exception as e:
        raise _crashed(case, f"compiled {dtype}", e) from e
    compare(case, got, torch_reference(case), rtol, rtol_hvp, where=f"compiled {dtype}")
