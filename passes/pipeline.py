"""The pass order, from the user's forward graph to the graph codegen reads."""
import copy
import time

import numpy as np

from gradc.errors import GradcError
from gradc.ir import FLOAT_DTYPES

from .autodiff import build_backward
from .fusion import fuse_elementwise, split_second_order_uses
from .objective import add_objective
from .second_order import build_hvp
from .simplify import simplify


def _bind_shape(shape, dims):
    return tuple(dims.get(d, d) if isinstance(d, str) else d for d in shape)


def bind(graph, dtype, dims, src):
    """Concrete float dtype everywhere; symbolic dims named in `dims` become ints."""
    if dtype not in FLOAT_DTYPES:
        raise GradcError(f"unknown dtype {dtype!r} (use {' or '.join(FLOAT_DTYPES)})", src)
    declared = {d for n in graph.nx.nodes for d in graph.shape(n) if isinstance(d, str)}
    unknown = sorted(set(dims) - declared)
    if unknown:
        raise GradcError(f"--bind names dim {', '.join(unknown)} that model {graph.name!r} does not have "
                         f"(its dims: {', '.join(sorted(declared)) or 'none'})", src)
    for name, n in graph.inputs.items():
        d = graph.dtype(n)
        if d.startswith("float") and d != "float" and d != dtype:
            raise GradcError(f"input {name!r} is declared {d} but the model is compiled for {dtype} "
                             f"(declare it with dtype=None, or compile with --dtype {d})", graph.node(n)["src"])
    for n in graph.nx.nodes:
        node = graph.node(n)
        if node["dtype"].startswith("float"):
            node["dtype"] = dtype
        node["shape"] = _bind_shape(node["shape"], dims)
        attrs = node["attrs"]
        for key in ("shape", "dims"):
            if key in attrs:
                attrs[key] = _bind_shape(attrs[key], dims)
        if attrs.get("num_classes") in dims:
            attrs["num_classes"] = dims[attrs["num_classes"]]
        if "dtype" in attrs and attrs["dtype"].startswith("float"):
            attrs["dtype"] = dtype


def constants_in_dtype(graph, dtype):
    """Array constants take the build's float dtype, converted once here (folding works in float64):
    a float64 array in a float32 kernel would not type. One that does not fit the dtype is refused."""
    for n in graph.nx.nodes:
        if graph.op(n) != "const" or np.ndim(graph.attrs(n)["value"]) == 0:
            continue
        value = np.asarray(graph.attrs(n)["value"])
        with np.errstate(over="ignore"):
            cast = value.astype(dtype)
        if (np.isfinite(value) & ~np.isfinite(cast)).any():
            raise GradcError(f"constant array {graph.shape(n)} has values beyond {dtype}'s range "
                             f"(largest magnitude {np.abs(value[np.isfinite(value)]).max():.3g}); scale it or compile "
                             f"with --dtype float64", graph.node(n)["src"])
        graph.attrs(n)["value"] = cast


def build_training_graph(model, dtype="float32", dims=None, timings=None, order=1):
    """Copy the model's graph and run every pass over it; `timings` collects seconds per pass.

    order 2 adds the Hessian-vector product nodes (phase `second`)."""
    timings = {} if timings is None else timings
    if model.graph.loss is None:
        raise GradcError(f"model {model.name!r} has no minimize(loss): nothing to differentiate", model.src)

    def timed(name, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
        return out

    graph = copy.deepcopy(model.graph)
    timed("bind", bind, graph, dtype, dict(dims or {}), model.src)
    info = model.param_info
    trainable = [p for p in graph.params if info[p]["trainable"]]
    decayed = [p for p in trainable if info[p]["decay"]]
    timed("objective", add_objective, graph, decayed, model.weight_decay)
    timed("autodiff", build_backward, graph, trainable)
    if order == 2:
        timed("second_order", build_hvp, graph, trainable)
    timed("simplify", simplify, graph)
    if order == 2:
        timed("fusion", split_second_order_uses, graph)
    timed("fusion", fuse_elementwise, graph)
    timed("simplify", simplify, graph)
    timed("constants", constants_in_dtype, graph, dtype)
    timed("validate", graph.validate)
    return graph

