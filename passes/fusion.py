"""Elementwise fusion: chains of elementwise ops become one `fused` node, one loop.

A producer is inlined into its consumer when the consumer is its only user and no entry
point returns it; scalar constants become literals. The fused expression is the sympy
composition of the pieces, so `tanh(x @ W + b)` is one loop and so is its backward
`g * (1 - y**2)`.

With `draws` (the CUDA target), normal random draws are computed where they are read: a `random`
node becomes the expression of its values (NormalDraw of the element's flat index, gradc/ops/random.py),
and a short expression of a draw (lr_grad's noise times its mask and sigma) is inlined into every
elementwise reader of its shape, however many there are. On a GPU the hash and Box-Muller of an
element cost less than a kernel launch, a store and a reload per reader; lr_grad's noise then lives in
no buffer at all. The CPU keeps one loop per draw: it makes two normals per pair of uniforms, which in
line each reader would compute for every element. An expression with a draw goes only into readers of
its own shape, where the flat index of an element is the same.
"""
import numpy as np
import sympy as sp

from gradc.ops import get_op
from gradc.ops.elementwise import FLAT, X, expr_of
from gradc.ops.random import drawn_expression


MAX_OPERANDS = 24   # a kernel with more arguments reads badly and gains nothing
MAX_RECOMPUTED_OPS = 8   # a draw inlined into several readers: the draw times a few factors, no more


def _elementwise(graph, n):
    return get_op(graph.op(n)).kind == "elementwise"


def literal(value):
    value = float(value)
    return sp.Integer(int(value)) if value.is_integer() and abs(value) < 2**53 else sp.Float(value)


def distributes(expr, mapping):
    """Whether expr.xreplace(mapping) would multiply a number other than +-1 into a sum: sympy does
    (1e9*(a - 1) -> 1e9*a - 1e9), and float arithmetic then lost x in x + (a - 1)*1e9, a mask's
    usual form (its float32 softmax rows came out uniform). Such a sum keeps a loop of its own."""
    for m in expr.atoms(sp.Mul):
        factors = [f.xreplace(mapping) for f in m.args]
        product = sp.Mul(*factors)
        # (a sum times 1 is that sum, and times -1 its exact negation)
        if product.is_Add and product not in factors and -product not in factors:
            return True
    return False


def _recomputed(graph, u, draws):
    """Whether u is a short expression of a draw that every reader (elementwise, of u's shape) recomputes."""
    expr = expr_of(graph, u)
    return (draws and expr.has(FLAT) and sp.count_ops(expr) <= MAX_RECOMPUTED_OPS
            and all(_elementwise(graph, r) and graph.shape(r) == graph.shape(u) for r in graph.users(u)))


def _inline(graph, n, roots, draws=False):
    """Compose n's expression with its fusable operands; True when anything changed."""
    expr, operands = expr_of(graph, n), list(graph.operands(n))
    changed = False
    progress = True
    while progress:
        progress = False
        for i, u in enumerate(operands):
            op = graph.op(u)
            if op == "const" and all(d == 1 for d in graph.shape(u)) and len(graph.shape(u)) <= len(graph.shape(n)):
                piece, pieces = literal(np.asarray(graph.attrs(u)["value"]).reshape(())), []
            elif _elementwise(graph, u) and u not in roots and u != n and (
                    graph.users(u) == [n] or not graph.operands(u) or _recomputed(graph, u, draws)) and (
                    graph.shape(u) == graph.shape(n) or not expr_of(graph, u).has(FLAT)):
                # a sole user takes the producer over; a constant fill (no operands) is copied into every user,
                # and so is a draw's short expression; a draw's element is its reader's only in the same shape
                piece, pieces = expr_of(graph, u), list(graph.operands(u))
            else:
                continue
            rest = operands[:i] + operands[i + 1:]
            new = list(dict.fromkeys(rest + pieces))
            if len(new) > MAX_OPERANDS:
                continue
            outer = {X[j]: X[new.index(v)] for j, v in enumerate(operands) if j != i}
            outer[X[i]] = piece.xreplace({X[m]: X[new.index(v)] for m, v in enumerate(pieces)})
            if distributes(expr, outer):
                continue
            composed = expr.xreplace(outer)
            kept = set().union(*(outer[x].free_symbols for x in expr.free_symbols if x in outer))
            if not kept <= composed.free_symbols:
                continue   # sympy dropped an operand (0 * log(x) is 0; x * (1/x) is 1): numpy's nan stays (trial V)
            graph.merge_into(u, n)   # u's value now lives inside n (its derivatives run where n does)
            expr, operands = composed, new
            changed = progress = True
            break
    if changed:
        node = graph.node(n)
        node["op"] = "fused"
        node["attrs"] = {"expr": expr, "shape": node["shape"]}
        graph.set_operands(n, operands)
    return changed


FUSED_REDUCTIONS = {"sum": "fused_sum", "mean": "fused_mean", "max": "fused_max"}


def fuse_reduction_prologues(graph):
    """A sum, mean or max whose operand is an elementwise value that it alone reads, of operands all of that
    value's shape (floats, no draw), becomes one loop over them (gradc/ops/fused_reduce.py): the weight
    decay's squares and a loss's squared errors get no buffer. CPU builds; outside scan steps."""
    roots = set(graph.roots())
    for n in graph.topo_order():
        if n not in graph or graph.op(n) not in FUSED_REDUCTIONS:
            continue
        (u,) = graph.operands(n)
        if not _elementwise(graph, u) or u in roots or graph.users(u) != [n] or graph.shape(u) == ():
            continue
        expr, operands = expr_of(graph, u), list(graph.operands(u))
        if (expr.has(FLAT) or not operands or len(operands) > MAX_OPERANDS
                or any(graph.shape(v) != graph.shape(u) or not graph.dtype(v).startswith("float") for v in operands)):
            continue
        graph.merge_into(u, n)
        node = graph.node(n)
        node["op"] = FUSED_REDUCTIONS[node["op"]]
        node["attrs"] = dict(node["attrs"], expr=expr)
        graph.set_operands(n, operands)


def split_second_order_uses(graph):
    """An elementwise value that first-order code and second-order code both read is computed twice:
    once for each. Otherwise the second-order reader keeps it from fusing into its first-order
    reader, and loss_and_grad of an --order 2 build would fill buffers that --order 1 fuses away.
    Reverse topological order, so that copies made for second-order readers are copied in turn."""
    roots = set(graph.roots())
    for n in reversed(graph.topo_order()):
        if n in roots or not _elementwise(graph, n):
            continue
        second = [u for u in graph.users(n) if graph.node(u)["phase"] == "second"]
        if not second or len(second) == len(graph.users(n)):
            continue
        node = graph.node(n)
        copy = graph.add_node(node["op"], node["inputs"], node["attrs"], node["shape"], node["dtype"], phase="second",
                              src=node["src"], name=node.get("name"), of=node.get("of"))
        for u in second:
            graph.set_operands(u, [copy if v == n else v for v in graph.operands(u)])


def fuse_elementwise(graph, draws=False):
    """Also inside scan bodies: a step's chain of elementwise ops is one loop too. `draws`: normal random
    draws are computed in their readers (see the module's docstring)."""
    for body in graph.bodies():
        _fuse(body, draws)
    return _fuse(graph, draws)


def _as_expression(graph, n):
    """Random node n (normal draws) as the fused node of its values' expression; True when it is one now."""
    expr = drawn_expression(graph, n)
    if expr is None:
        return False
    node = graph.node(n)
    node["op"] = "fused"
    node["attrs"] = {"expr": expr, "shape": node["shape"]}
    return True


def _fuse(graph, draws=False):
    roots = set(graph.roots())
    changed = False
    for n in graph.topo_order():
        if n in graph and draws and graph.op(n) == "random":
            changed |= _as_expression(graph, n)
        if n in graph and _elementwise(graph, n):
            changed |= _inline(graph, n, roots, draws)
    return changed
