"""Facts about a compiled graph for `gradc inspect`: FLOPs, and what the backward keeps."""
import numpy as np
import sympy as sp

from gradc.ops import get_op
from gradc.shapes import size


def flops(graph, nodes):
    """Total FLOPs of `nodes`; a sympy expression in the symbolic dims."""
    total = sp.Integer(0)
    for n in nodes:
        node = graph.node(n)
        shapes = [graph.shape(u) for u in node["inputs"]]
        total += sp.sympify(get_op(node["op"]).flops(node["attrs"], shapes, node["shape"]))
    return sp.expand(total)


def saved_for_backward(graph, nodes):
    """Forward values (and inputs) that backward nodes among `nodes` read: what training keeps."""
    saved = []
    for n in graph.topo_order(nodes):
        if graph.node(n)["phase"] != "forward" or graph.op(n) in ("param", "const"):
            continue
        if any(graph.node(u)["phase"] == "backward" for u in graph.users(n) if u in nodes):
            saved.append(n)
    return saved


def nbytes(graph, n):
    return sp.sympify(size(graph.shape(n))) * np.dtype(graph.dtype(n)).itemsize


def node_flops(graph, n, dims):
    """FLOPs of one node as an int, with the symbolic dims bound by `dims`."""
    node = graph.node(n)
    bind = lambda shape: tuple(dims.get(d, d) if isinstance(d, str) else d for d in shape)
    shapes = [bind(graph.shape(u)) for u in node["inputs"]]
    return int(sp.sympify(get_op(node["op"]).flops(node["attrs"], shapes, bind(node["shape"]))))
