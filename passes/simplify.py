"""Graph clean-up: algebraic identities, constant folding, CSE and DCE."""
import hashlib

import numpy as np

from gradc.ops import get_op

LEAVES = ("input", "param", "const")


def apply_identities(graph):
    """Each op record's identities (its `simplify` rule, gradc/ops): a node equal to another value of
    its dtype is replaced by it everywhere; a node rewritten in place counts as a change too."""
    changed = False
    for n in graph.topo_order():
        rule = get_op(graph.op(n)).simplify
        target = rule(graph, n) if rule is not None else None
        if target == n:
            changed = True
        elif target is not None and graph.dtype(target) == graph.dtype(n):
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
    if node["op"] in ("input", "param") or node.get("distinct"):
        return None
    parts = []
    for k, v in sorted(node["attrs"].items()):
        if isinstance(v, np.ndarray):
            v = (v.shape, hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest())
        parts.append((k, v if not isinstance(v, list) else tuple(v)))
    return (node["op"], tuple(node["inputs"]), tuple(parts), node["shape"], node["dtype"])


def eliminate_common(graph):
    """CSE: nodes with the same op, operands and attrs become one (never a `distinct` node)."""
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
