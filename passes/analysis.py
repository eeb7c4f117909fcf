"""Facts about a compiled graph for `gradc inspect`: FLOPs, and what the backward keeps."""
import numpy as np
import sympy as sp

from gradc.ops import get_op
from gradc.ops.scan_layout import operand_leaves
from gradc.shapes import bind_dims, size


def flops(graph, nodes):
    """Total FLOPs of `nodes`; a sympy expression in the symbolic dims."""
    terms = []
    for n in nodes:
        node = graph.node(n)
        shapes = [graph.shape(u) for u in node["inputs"]]
        terms.append(get_op(node["op"]).flops(node["attrs"], shapes, node["shape"]))
    # one Add of every term: adding them one by one re-sorts the growing sum each time
    return sp.expand(sp.Add(*map(sp.sympify, terms)))


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
    bind = lambda shape: bind_dims(shape, dims)
    shapes = [bind(graph.shape(u)) for u in node["inputs"]]
    flops = sp.sympify(get_op(node["op"]).flops(node["attrs"], shapes, bind(node["shape"])))
    # a region's body (a scan's step) has shapes of its own: its dims are bound here
    return int(flops.subs({s: dims[s.name] for s in flops.free_symbols if s.name in dims}))


def index_inputs(graph):
    """int inputs whose values index something (labels into classes, rows of a table: ops whose
    record has `indexes`), with how many values they may take, so that the module can check
    them at call time; an input read by several gets the smallest int bound. The ints may reach
    the op through layout ops (reshape, slice, concat, ...) and through scans: a step's labels
    are a slice of a scanned sequence or a value the step closes over."""
    inputs = set(graph.inputs.values())   # not lr_grad's tiled copies
    return {graph.node(u)["name"]: bound for u, bound in _indexing_leaves(graph).items() if u in inputs}


def _indexing_leaves(graph):
    """{input leaf of `graph` (a scan body's placeholder too): the least bound of what it indexes}."""
    bounds = {}

    def reach(u, bound):
        stack = [u]
        while stack:
            u = stack.pop()
            if get_op(graph.op(u)).kind == "layout":
                stack.extend(graph.operands(u))
            elif graph.op(u) == "input":
                old = bounds.get(u)
                bounds[u] = bound if old is None or isinstance(old, str) or (
                    isinstance(bound, int) and bound < old) else old

    for n in graph.nx.nodes:
        rule = get_op(graph.op(n)).indexes
        if rule is not None:
            j, bound = rule(graph, n)
            reach(graph.operands(n)[j], bound)
        elif graph.op(n) == "scan":   # the body's indexing leaves stand for the scan's operands
            attrs = graph.attrs(n)
            leaves = list(attrs["body"].inputs.values())
            inner = _indexing_leaves(attrs["body"])
            for u, j in zip(graph.operands(n), operand_leaves(attrs)):
                if leaves[j] in inner:
                    reach(u, inner[leaves[j]])
    return bounds
