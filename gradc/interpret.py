"""A numpy evaluator of the IR: the reference that passes and generated code are tested against."""
import numpy as np

from .ops import get_op


def bind_dims(graph, inputs):
    """Values of the symbolic dims, read off the given inputs."""
    dims = {}
    for name, n in graph.inputs.items():
        if name not in inputs:
            continue
        for d, actual in zip(graph.shape(n), np.shape(inputs[name])):
            if isinstance(d, str):
                if dims.setdefault(d, actual) != actual:
                    raise ValueError(f"dim {d} is {dims[d]} in one input and {actual} in {name!r}")
    return dims


def evaluate(graph, params, inputs, nodes, dtype=np.float64, tangents=None):
    """Values of `nodes` (ids), computing only what they depend on. Floats are computed in `dtype`.

    `tangents` (param name -> array) binds the tangent leaves of a second-order graph."""
    dims = bind_dims(graph, inputs)
    names = {n: name for name, n in graph.params.items()} | {n: name for name, n in graph.inputs.items()}
    tangent_of = {n: p for p, n in graph.tangents.items()}
    values = {}
    for n in graph.topo_order(graph.ancestors(nodes)):
        node = graph.node(n)
        op = node["op"]
        if op in ("param", "input"):
            if n in tangent_of:
                v = np.asarray(tangents[tangent_of[n]])
            else:
                v = np.asarray((params if op == "param" else inputs)[names[n]])
            values[n] = v.astype(dtype) if v.dtype.kind == "f" else v
            continue
        shape = tuple(dims[d] if isinstance(d, str) else d for d in node["shape"])
        args = [values[u] for u in node["inputs"]]
        out = np.asarray(get_op(op).evaluate(node["attrs"], args, shape, dims))
        if out.dtype.kind == "f" or op == "const":
            out = out.astype(dtype)
        if out.shape != shape:
            raise AssertionError(f"node {n} ({op}) evaluated to shape {out.shape}, expected {shape}")
        values[n] = out
    return {n: values[n] for n in nodes}
