"""The pass order, from the user's forward graph to the graph the planners and codegen read."""
import copy
import math
import time
from dataclasses import dataclass

import numpy as np
import sympy as sp

from gradc.errors import GradcError
from gradc.ir import FLOAT_DTYPES
from gradc.shapes import bind_dims

from .autodiff import build_backward
from .forward_outputs import lean_forward_outputs, lean_scans
from .fusion import fuse_elementwise, fuse_reduction_prologues, split_second_order_uses
from .gemm_fusion import fuse_gemms
from .likelihood_ratio import build_lr
from .objective import add_objective
from .part_runs import batch_rows
from .second_order import build_hvp
from .simplify import simplify


LARGEST_BYTES = 2 ** 62   # numpy counts elements and bytes in int64: no tensor can be larger


def check_bound_dims(graph, dims, src):
    """GradcError at `src` when `dims` (--bind) names a dim the model does not have, or makes a tensor larger
    than numpy can count (its bytes past int64: an OverflowError deep in the planner)."""
    declared = {d for n in graph.nx.nodes for d in graph.shape(n) if isinstance(d, str)}
    unknown = sorted(set(dims) - declared)
    if unknown:
        raise GradcError(f"--bind names dim {', '.join(unknown)} that model {graph.name!r} does not have "
                         f"(its dims: {', '.join(sorted(declared)) or 'none'})", src)
    for g in [graph] + graph.bodies():
        for n in g.nx.nodes:
            shape = bind_dims(g.shape(n), dims)
            if all(isinstance(d, int) for d in shape) and math.prod(shape) * 8 >= LARGEST_BYTES:
                bound = ", ".join(f"{d}={dims[d]}" for d in g.shape(n) if isinstance(d, str) and d in dims)
                raise GradcError(f"{f'--bind {bound}: ' if bound else ''}{g.describe(n)} would be of shape "
                                 f"{tuple(shape)}, more elements than numpy can hold in one array",
                                 src if bound else g.node(n)["src"])


def bind(graph, dtype, dims, src):
    """Concrete float dtype everywhere; symbolic dims named in `dims` become ints."""
    if dtype not in FLOAT_DTYPES:
        raise GradcError(f"unknown dtype {dtype!r} (use {' or '.join(FLOAT_DTYPES)})", src)
    check_bound_dims(graph, dims, src)
    for name, n in graph.inputs.items():
        d = graph.dtype(n)
        if d.startswith("float") and d != "float" and d != dtype:
            raise GradcError(f"input {name!r} is declared {d} but the model is compiled for {dtype} "
                             f"(declare it with dtype=None, or compile with --dtype {d})", graph.node(n)["src"])
    rows = batch_rows(graph)   # (before the dims become ints: the runs still know the batch)
    graph.batch_rows = None if rows is None else (dims.get(rows[0], rows[0]), rows[1])
    graph.declared_shapes = {n: graph.shape(n) for n in graph.nx.nodes}   # (lr_grad tells the batch's axes by them)
    for g in [graph] + graph.bodies():
        _bind_nodes(g, dtype, dims)


def _bind_nodes(graph, dtype, dims):
    for n in graph.nx.nodes:
        node = graph.node(n)
        if node["dtype"].startswith("float"):
            node["dtype"] = dtype
        node["shape"] = bind_dims(node["shape"], dims)
        attrs = node["attrs"]
        for key in ("shape", "dims"):
            if key in attrs:
                attrs[key] = bind_dims(attrs[key], dims)
        if attrs.get("num_classes") in dims:
            attrs["num_classes"] = dims[attrs["num_classes"]]
        if "dtype" in attrs and attrs["dtype"].startswith("float"):
            attrs["dtype"] = dtype


def unheld(value, dtype, zero=True):
    """Why the float type `dtype` cannot hold `value`, or None: an element it would make inf, or with `zero` a
    value whose nonzero elements would all be 0 (1e-50 in float32; a window whose tail underflows is held)."""
    v = np.asarray(value, dtype=np.float64).ravel()
    with np.errstate(over="ignore", under="ignore"):
        cast = v.astype(dtype)
    inf = np.flatnonzero(np.isfinite(v) & ~np.isfinite(cast))
    lost = (v != 0) & (cast == 0)
    if inf.size:
        x, held = float(v[inf[0]]), "-inf" if v[inf[0]] < 0 else "inf"
    elif zero and lost.any() and lost.sum() == np.count_nonzero(v):
        x, held = float(v[np.flatnonzero(lost)[0]]), "0"
    else:
        return None
    return f"{x!r}, which {dtype} holds as {held}: compile with --dtype float64, or rescale"


def folded_unheld(number, dtype):
    """unheld for a sympy number a fused expression holds: one float64 cannot hold (sympy's range is wider) is
    written as `inf`, a NameError in the kernel. Only overflow: a folded number that underflows to 0 is most
    often a product that underflows anyway (an hvp squares a user's 1e-23 inside tanh)."""
    value = float(number)
    if not np.isfinite(value):
        return f"{str(sp.Float(number, 3)).lower()}, beyond float64 (whose largest is 1.8e308): rescale"
    return unheld(value, dtype, zero=False)


def constants_in_dtype(graph, dtype):
    """Array constants take the build's float dtype, converted once here (folding works in float64):
    a float64 array in a float32 kernel would not type. One that folding made beyond the dtype is refused, and so
    is a number a fused expression folded to (x * 1e20 * 1e20: each constant fits, their product does not)."""
    for g in graph.bodies():
        constants_in_dtype(g, dtype)
    for n in graph.nx.nodes:
        expr = graph.attrs(n).get("expr")   # a fused expression: its numbers are written into the kernel
        if isinstance(expr, sp.Basic):
            if expr.has(sp.zoo):   # sympy's 1/0 is an infinity of no sign: numpy's x / 0 is inf, -inf or nan by x
                raise GradcError("the expression of this line divides by the constant 0 (or takes the log of 0): "
                                 "sympy makes it an infinity of no sign, which no float holds; take the constant out "
                                 "or give it as an input", graph.node(n)["src"])
            # a number, or a constant a function makes of one (sp.exp(100) in a user op: trial V)
            constants = [a for a in expr.atoms(sp.Number) if a.is_finite] + \
                [a for a in expr.atoms(sp.Function, sp.Pow) if not a.free_symbols]
            why = next(filter(None, (folded_unheld(a, dtype) for a in constants)), None)
            if why:
                raise GradcError(f"the expression of this line folds to the number {why}", graph.node(n)["src"])
        if graph.op(n) != "const" or np.ndim(graph.attrs(n)["value"]) == 0:
            continue
        why = unheld(graph.attrs(n)["value"], dtype, zero=False)   # (a folded value may underflow to 0)
        if why:
            raise GradcError(f"a constant array {graph.shape(n)} computed from this line holds {why}",
                             graph.node(n)["src"])
        graph.attrs(n)["value"] = np.asarray(graph.attrs(n)["value"]).astype(dtype)


def on_device(graph, device):
    """Every node runs on `device` (a pipeline's placement later moves nodes to their stages)."""
    for n in graph.nx.nodes:
        graph.node(n)["device"] = device


# The pass order, the one place it is written: (timing name, pass, when it runs). A pass takes the
# graph and the build (model, dtype, dims, order, target) and rewrites the graph in place.
PASSES = (
    # a scan computes only the per-step outputs something reads
    ("forward_outputs", lambda g, b: lean_scans(g), None),
    ("bind", lambda g, b: bind(g, b.dtype, b.dims, b.model.src), None),
    ("objective", lambda g, b: add_objective(g, b.decayed, b.model.weight_decay), None),
    # lr_grad's forward-only graph: K noised copies of the forward stacked on the rows (DESIGN.md §1.9)
    ("likelihood_ratio", lambda g, b: build_lr(g, b.trainable, b.decayed, b.model.weight_decay), None),
    ("autodiff", lambda g, b: build_backward(g, b.trainable), None),
    ("second_order", lambda g, b: build_hvp(g, b.trainable), lambda b: b.order == 2),
    # `forward` reads no more of a scan than its outputs need (a step's loss and its labels stay out)
    ("forward_outputs", lambda g, b: lean_forward_outputs(g), None),
    ("simplify", lambda g, b: simplify(g), None),
    # a value read by first- and second-order code is computed once for each, so --order 2
    # leaves loss_and_grad as lean as --order 1 builds it
    ("fusion", lambda g, b: split_second_order_uses(g), lambda b: b.order == 2),
    # CUDA: normal draws computed in the kernels that read them (passes/fusion.py says why)
    ("fusion", lambda g, b: fuse_elementwise(g, draws=b.target == "cuda"), None),
    # CPU: a sum of squares (the weight decay's, a loss's) is one loop, with no buffer of the squares
    ("fusion", lambda g, b: fuse_reduction_prologues(g), lambda b: b.target == "cpu"),
    ("simplify", lambda g, b: simplify(g), None),
    ("constants", lambda g, b: constants_in_dtype(g, b.dtype), None),
    ("validate", lambda g, b: g.validate(), None),
    # CUDA: before any plan, so that a fused product never gets a buffer or a stage
    ("gemm_fusion", lambda g, b: fuse_gemms(g), lambda b: b.target == "cuda"),
    ("gemm_fusion", lambda g, b: on_device(g, "cuda:0"), lambda b: b.target == "cuda"),
)


@dataclass(frozen=True)
class Build:
    """What the passes need to know of one build."""
    model: object
    dtype: str
    dims: dict
    order: int
    target: str

    @property
    def trainable(self):
        return [p for p in self.model.graph.params if self.model.param_info[p]["trainable"]]

    @property
    def decayed(self):
        return [p for p in self.trainable if self.model.param_info[p]["decay"]]


def build_training_graph(model, dtype="float32", dims=None, timings=None, order=1, target="cpu"):
    """Copy the model's graph and run every pass of PASSES over it; `timings` collects seconds
    per pass. order 2 adds the Hessian-vector product nodes (phase `second`)."""
    timings = {} if timings is None else timings
    if model.graph.loss is None:
        raise GradcError(f"model {model.name!r} has no minimize(loss): nothing to differentiate", model.src)
    build = Build(model, dtype, dict(dims or {}), order, target)
    graph = copy.deepcopy(model.graph)
    for name, run, when in PASSES:
        if when is None or when(build):
            t = time.perf_counter()
            run(graph, build)
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
    return graph
