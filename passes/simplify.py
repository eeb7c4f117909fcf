"""Graph clean-up: algebraic identities, constant folding, CSE and DCE."""
import hashlib

import numpy as np

from gradc.ops import get_op
from gradc.ops.elementwise import X

LEAVES = ("input", "param", "const")


def _const_value(graph, n):
    return graph.attrs(n)["value"] if graph.op(n) == "const" else None


def _is_scalar_const(graph, n, value):
    v = _const_value(graph, n)
    return v is not None and np.ndim(v) == 0 and float(v) == value


def _identity_target(graph, n):
    """The node n is equal to, when an identity makes n redundant; else None."""
    op, ins, attrs, shape = graph.op(n), graph.operands(n), graph.attrs(n), graph.shape(n)
    same = [u for u in ins if graph.shape(u) == shape]
    if op in ("reshape", "broadcast_to") and graph.shape(ins[0]) == shape:
        return ins[0]
    if op == "transpose" and tuple(attrs["axes"]) == tuple(range(len(shape))):
        return ins[0]
    if op in ("sum", "mean", "max") and not attrs["axes"]:
        return ins[0]
    if op == "neg" and graph.op(ins[0]) == "neg":
        return graph.operands(ins[0])[0]
    if op in ("add", "sub") and _is_scalar_const(graph, ins[1], 0.0) and ins[0] in same:
        return ins[0]
    if op == "add" and _is_scalar_const(graph, ins[0], 0.0) and ins[1] in same:
        return ins[1]
    if op in ("mul", "div") and _is_scalar_const(graph, ins[1], 1.0) and ins[0] in same:
        return ins[0]
    if op == "mul" and _is_scalar_const(graph, ins[0], 1.0) and ins[1] in same:
        return ins[1]
    if op == "fused" and attrs["expr"] == X[0] and ins[0] in same:
        return ins[0]
    return None


def _compose_layout(graph, n):
    """reshape(reshape(x)) -> reshape(x); transpose(transpose(x)) -> one transpose."""
    op, (u,) = graph.op(n), graph.operands(n) or (None,)
    if op == "reshape" and graph.op(u) == "reshape":
        graph.set_operands(n, graph.operands(u))
        return True
    if op == "transpose" and graph.op(u) == "transpose":
        inner, outer = graph.attrs(u)["axes"], graph.attrs(n)["axes"]
        graph.attrs(n)["axes"] = tuple(inner[i] for i in outer)
        graph.set_operands(n, graph.operands(u))
        return True
    return False


def apply_identities(graph):
    changed = False
    for n in graph.topo_order():
        if graph.op(n) in LEAVES:
            continue
        if graph.op(n) in ("reshape", "transpose") and _compose_layout(graph, n):
            changed = True
        target = _identity_target(graph, n)
        if target is not None and target != n and graph.dtype(target) == graph.dtype(n):
            graph.replace_uses(n, target)
            changed = True
    return changed


def _bigger_than_operands(graph, n, ins):
    """Folding would materialise a broadcast (or a shape only known at run time)."""
    if any(isinstance(d, str) for d in graph.shape(n)):
        return True
    size = int(np.prod(graph.shape(n)))
    return size > 1 and size > max((int(np.prod(graph.shape(u))) for u in ins), default=1)


def fold_constants(graph):
    """Evaluate nodes whose operands are all constants (and counts over int dims)."""
    changed = False
    for n in graph.topo_order():
        op, ins = graph.op(n), graph.operands(n)
        if op in LEAVES:
            continue
        if op == "count" and any(isinstance(d, str) for d in graph.attrs(n)["dims"]):
            continue
        if not all(graph.op(u) == "const" for u in ins) or get_op(op).kind in ("region", "project"):
            continue
        if _bigger_than_operands(graph, n, ins):
            continue   # a stretched constant stays a node: fusion turns it into a literal instead
        args = [np.asarray(graph.attrs(u)["value"], dtype=np.float64) for u in ins]
        value = np.asarray(get_op(op).evaluate(graph.attrs(n), args, graph.shape(n), {}), dtype=np.float64)
        node = graph.node(n)
        node["op"] = "const"
        node["attrs"] = {"value": float(value) if value.ndim == 0 else value,
                         "shape": node["shape"], "dtype": node["dtype"]}
        graph.set_operands(n, [])
        changed = True
    return changed


def _key(graph, n):
    node = graph.node(n)
    if node["op"] in ("input", "param"):
        return None
    parts = []
    for k, v in sorted(node["attrs"].items()):
        if isinstance(v, np.ndarray):
            v = (v.shape, hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest())
        parts.append((k, v if not isinstance(v, list) else tuple(v)))
    return (node["op"], tuple(node["inputs"]), tuple(parts), node["shape"], node["dtype"])


def eliminate_common(graph):
    """CSE: nodes with the same op, operands and attrs become one."""
    seen, changed = {}, False
    for n in graph.topo_order():
        key = _key(graph, n)
        if key is None:
            continue
        first = seen.setdefault(key, n)
        if first != n:
            graph.replace_uses(n, first)
            changed = True
    return changed


def eliminate_dead(graph, roots=None):
    """DCE: keep what the roots need, and every input and param (they are the module's API)."""
    keep = graph.ancestors(graph.roots() if roots is None else roots)
    keep |= set(graph.inputs.values()) | set(graph.params.values()) | set(graph.tangents.values())
    dead = [n for n in graph.nx.nodes if n not in keep]
    graph.remove(dead)
    return bool(dead)


def simplify(graph):
    """Also inside scan bodies (their outputs are their roots)."""
    for body in graph.bodies():
        _simplify(body)
    _simplify(graph)


def _simplify(graph):
    for _ in range(10):
        changed = apply_identities(graph)
        changed |= fold_constants(graph)
        changed |= eliminate_common(graph)
        changed |= eliminate_dead(graph)
        if not changed:
            return
