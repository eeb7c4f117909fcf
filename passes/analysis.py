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


# sizes given to the symbolic dims when following each int element to what it indexes: a map that
# differs between them (a reshape that mixes a symbolic axis into fixed ones) is not trusted
BINDINGS = (2, 3, 5)


def index_inputs(graph, dims=None):
    """int inputs whose values index something (labels into classes, rows of a table: ops whose
    record has `indexes`), with how many values they may take, so that the module can check
    them at call time. The ints may reach the op through layout ops (reshape, slice, concat, ...)
    and through scans: a step's labels are a slice of a scanned sequence or a value the step
    closes over.

    {name: bound} where every element indexes below one bound (an int, or a dim's name);
    {name: {bound: [(start, stop), ...]}} where elements differ (`pr[:, 0]` rows of a table,
    `pr[:, 1]` labels): each bound with the ranges of the flat positions over the input's fixed
    axes whose elements it limits (an element limited twice is checked against both).

    `graph` is the model's, before --bind (its ops that neither the loss nor an output reads left out, as
    the passes leave them out of the module): every symbolic dim takes each of the small BINDINGS here,
    where a bound one would number all of its elements (--bind B=10**10: 75 GiB); a bound that is a dim
    `dims` binds is its size."""
    roots = [r for r in [graph.loss, *graph.outputs.values()] if r is not None]
    read = graph.ancestors(roots)   # (an op whose value nothing reads is no module's: no check)
    maps = [_element_bounds(graph, b, read) for b in BINDINGS]
    dims = dims or {}
    out = {}
    for name, u in graph.inputs.items():
        if not graph.dtype(u).startswith("int"):
            continue
        # a dim --bind fixed is still any size to the model (it is taken whole): its axis is not a position
        shape, declared = graph.shape(u), graph.declared_shapes.get(u, graph.shape(u))
        seen = [{bound: _fixed_positions(shape, declared, b, mask) for bound, mask in m.get(u, {}).items()}
                for b, m in zip(BINDINGS, maps)]
        if not any(seen):
            continue
        positions = seen[0]
        if any(s.keys() != positions.keys() or any((s[k] != positions[k]).any() for k in s) for s in seen[1:]):
            count = size(_fixed(declared))   # not the same in every binding: every bound on every element
            positions = {bound: np.ones(count, bool) for s in seen for bound in s}
        named = {}   # (a dim bound to 10 and a literal 10 are one bound)
        for bound, mask in positions.items():
            named[dims.get(bound, bound)] = named.get(dims.get(bound, bound), False) | mask
        out[name] = _compact(named)
    return out


def _fixed(shape):
    return tuple(d for d in shape if not isinstance(d, str))


def _bound(shape, b):
    return tuple(b if isinstance(d, str) else d for d in shape)


def _fixed_positions(shape, declared, b, mask):
    """Which flat positions over the fixed axes of the `declared` shape a mask of the elements of `shape`
    (its symbolic dims b) touches."""
    symbolic = tuple(i for i, d in enumerate(declared) if isinstance(d, str))
    return mask.reshape(_bound(shape, b)).any(axis=symbolic).reshape(-1)


def _compact(positions):
    """The module's entry for one input (index_inputs' docstring): a bound alone when it is the
    only one and limits every element."""
    if len(positions) == 1 and next(iter(positions.values())).all():
        return next(iter(positions))
    out = {}
    for bound in sorted(positions, key=str):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], positions[bound].astype(np.int8), [0]])))
        out[bound] = [(int(a), int(z)) for a, z in zip(edges[::2], edges[1::2])]
    return out


def _element_bounds(graph, b, read=None):
    """{int input leaf of `graph` (a scan body's placeholder too): {bound: mask of its flat elements
    that index below it}}, every symbolic dim taken as b. Each leaf's elements are numbered and
    carried through the layout ops by the ops' own numpy evaluation, so that each indexing op
    sees which elements it reads."""
    dims = _Every(b)
    ids, leaves, total = {}, [], 0
    for n in graph.topo_order():
        if graph.op(n) == "input" and graph.dtype(n).startswith("int"):
            shape = _bound(graph.shape(n), b)
            ids[n] = total + np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
            leaves.append((n, total))
            total += ids[n].size
        elif get_op(graph.op(n)).kind == "layout" and any(u in ids for u in graph.operands(n)):
            args = [ids[u] if u in ids else np.full(_bound(graph.shape(u), b), -1, np.int64)
                    for u in graph.operands(n)]
            ids[n] = np.asarray(get_op(graph.op(n)).evaluate(graph.attrs(n), args, _bound(graph.shape(n), b), dims))
    limits = {}   # bound -> mask over every leaf's element ids

    def limit(elements, bound):
        elements = elements[elements >= 0]
        limits.setdefault(bound, np.zeros(total, bool))[elements] = True

    for n in graph.nx.nodes if read is None else read:
        rule = get_op(graph.op(n)).indexes
        if rule is not None:
            j, bound = rule(graph, n)
            u = graph.operands(n)[j]
            if u in ids:
                limit(ids[u], bound)
        elif graph.op(n) == "scan":   # the body's limits on its leaves fall on the scan's operands
            attrs = graph.attrs(n)
            body_leaves = list(attrs["body"].inputs.values())
            inner = _element_bounds(attrs["body"], b)
            for u, j in zip(graph.operands(n), operand_leaves(attrs)):
                leaf = body_leaves[j]
                if leaf not in inner or u not in ids:
                    continue
                operand = ids[u]
                for bound, mask in inner[leaf].items():
                    if operand.size == mask.size:   # a closed-over value: element for element
                        limit(operand.reshape(-1)[mask], bound)
                    elif operand.size and operand[0].size == mask.size:   # a sequence: step t reads operand[t]
                        limit(operand.reshape(operand.shape[0], -1)[:, mask], bound)
                    else:   # a layout not foreseen here: the bound on every element
                        limit(operand, bound)
    return {n: {bound: mask[start:start + ids[n].size] for bound, mask in limits.items()
                if mask[start:start + ids[n].size].any()}
            for n, start in leaves if any(mask[start:start + ids[n].size].any() for mask in limits.values())}


class _Every(dict):
    """Dims where every symbolic dim has the one size."""
    def __init__(self, b):
        super().__init__()
        self.b = b

    def __missing__(self, key):
        return self.b
