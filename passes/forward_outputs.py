"""The `forward` entry's own outputs: what the declared outputs need, without the rest of a scan.

A scan computes every per-step output its step returns. A language model's step returns its logits
and its loss, and the loss reads the labels: `forward(params, x=...)` for the logits alone would
need the labels, and compute each step's loss, when the scan is shared with the training entries.
Here the declared outputs get their own copy of such a scan (and of what lies between it and them),
whose body keeps the carries and the per-step outputs the declared outputs read, and whose operands
are only what those read. The copies are `distinct` (CSE keeps them apart); the training entries
still read the one scan that computes everything in one pass. graph.forward_outputs names them.

Before any of that, `lean_scans` does the same to the training graph itself for what neither the loss
nor an output reads (a y the step returns and the model never uses).
"""
import copy

from gradc.ops.scan import FINAL, YS, index_of, kind_of, parts

from .simplify import eliminate_dead


def lean_forward_outputs(graph):
    """Set graph.forward_outputs: each declared output, or its lean copy where a scan it reads has
    per-step outputs it does not read."""
    roots = list(graph.outputs.values())
    new = lean_roots(graph, roots)
    graph.forward_outputs = dict(zip(graph.outputs, new)) if new != roots else {}


def lean_scans(graph):
    """The training graph's scans compute only what the loss and the outputs read: a per-step output
    nothing reads (a step's y left unused) is not computed, nor what only it needs, and the values only it
    read are no longer the scan's operands (a param only it read does not reach the loss). The graph is
    the model's here (no entry reads a scan's stacks yet); what the copies replace is removed."""
    roots = [graph.loss] + list(graph.outputs.values())
    new = lean_roots(graph, roots, distinct=False)
    if new != roots:
        graph.loss, graph.outputs = new[0], dict(zip(graph.outputs, new[1:]))
        eliminate_dead(graph, new)


def lean_roots(graph, roots, distinct=True):
    """`roots`, with a copy of every value on the way to them that depends on a scan computing
    per-step outputs the roots do not read; the copies' scans compute only what is read. `distinct`:
    CSE keeps the copies apart from what they copy (both stay)."""
    needed = graph.ancestors(roots)
    copied = {}
    for n in graph.topo_order(needed):
        op = graph.op(n)
        if op == "scan":
            read = {graph.attrs(u)["index"] for u in graph.users(n) if u in needed}
            lean = _lean_scan(graph, n, read, copied, distinct)
            if lean is not None:
                copied[n] = lean
        elif op == "scan_out" and graph.operands(n)[0] in copied:
            scan, index_map = copied[graph.operands(n)[0]]
            copied[n] = _copy(graph, n, [scan], distinct, index=index_map[graph.attrs(n)["index"]])
        elif any(u in copied for u in graph.operands(n)):
            copied[n] = _copy(graph, n, [_value(copied.get(u, u)) for u in graph.operands(n)], distinct)
    return [_value(copied.get(r, r)) for r in roots]


def _value(entry):
    return entry[0] if isinstance(entry, tuple) else entry


def _copy(graph, n, operands, distinct, **changed):
    node = graph.node(n)
    c = graph.apply(node["op"], operands, dict(node["attrs"], **changed), src=node["src"], distinct=distinct)
    graph.node(c)["stage"] = node.get("stage")
    return c


def _lean_scan(graph, n, read, copied, distinct):
    """(the lean copy of scan n, {old result index: new}) when its body can lose per-step outputs
    (and the leaves only they read), or it reads a copied value; None when it stays as it is."""
    attrs = graph.attrs(n)
    body, leaves, outputs, K, X, C, M = parts(attrs)
    ys = [i for i in range(M) if index_of(attrs, YS, i) in read]
    operands = [_value(copied.get(u, u)) for u in graph.operands(n)]
    read_leaves = body.ancestors(outputs)
    if len(ys) == M and operands == graph.operands(n) and all(leaf in read_leaves for leaf in leaves[K:]):
        return None   # (a leaf no step reads, a sequence the step ignores, would be asked for in vain)
    lean = copy.deepcopy(body)
    kept_outputs = [f for j, f in enumerate(lean.outputs) if j < K or j - K in ys]
    lean.outputs = {name: lean.outputs[name] for name in kept_outputs}
    inner = lean_roots(lean, list(lean.outputs.values()), distinct)   # the body's own scans, the same way
    lean.outputs = dict(zip(lean.outputs, inner))
    used = lean.ancestors(inner)
    names = list(lean.inputs)
    # the carries stay (the loop threads them), and one sequence at least (it gives the length): a float
    # one where there is one (an int sequence is most likely the labels forward should not ask for)
    keep = [j for j, leaf in enumerate(leaves) if j < K or lean.inputs[names[j]] in used]
    if not any(K <= j < K + X for j in keep):
        floats = [j for j in range(K, K + X) if lean.dtype(lean.inputs[names[j]]).startswith("float")]
        keep = sorted(keep + [(floats or [K])[0]])
    lean.inputs = {names[j]: lean.inputs[names[j]] for j in keep}
    alive = used | set(lean.inputs.values())
    lean.remove([v for v in lean.nx.nodes if v not in alive])
    xs = sum(1 for j in keep if K <= j < K + X)
    scan = _copy(graph, n, [operands[j] for j in keep], distinct, body=lean, carries=K, xs=xs)
    index_map = {index_of(attrs, FINAL, k): k for k in range(K)}
    index_map |= {index_of(attrs, YS, i): K + new for new, i in enumerate(ys)}
    assert all(kind_of(attrs, i)[0] in (FINAL, YS) for i in read), "a forward reads a scan's stacks"
    return scan, index_map
