"""Carry checkpoints of scans under --memory-budget (DESIGN.md §1.8): keep the carry of every k-th
step, and recompute a segment's carries just before the backward runs its steps.

The backward of a scan reads the carry each step read and the carry it wrote: stacks of T carries
that grow with T when nothing else of a recurrent model does. Keeping every k-th carry instead and
running the step again over each segment (from its checkpoint, into a buffer of k + 1 carries)
holds ceil(T/k) + k + 1 carries, fewest near k = sqrt(T), for one more forward of the scan's
carries whatever k is (each step runs once more). gradc/ops/scan.py says what the two scans' attrs
then mean; gradc/ops/scan_loop.py writes their loops.

Only a first-order reverse backward of the budgeted entry (loss_and_grad) reads checkpoints: BPPSA
reads every step's carry at once, and hvp's scans keep reading the full stacks, which stay results
of the forward scan (loss_and_grad then never writes them).
"""
import math

import sympy as sp

from gradc.ops.scan import (CHECKPOINT, OSTACK, STACK, checkpoints, kind_of, parts, recompute_step_flops, result, steps,
                            vjp_of)


def _results(graph, n, kinds):
    """The scan_out nodes of scan n whose kind is in `kinds`."""
    return [u for u in graph.users(n) if graph.op(u) == "scan_out" and kind_of(graph.attrs(n), graph.attrs(u)["index"])[0] in kinds]


def pairs(graph, within=None):
    """(forward scan, its backward scan) for every first-order reverse backward scan (among the nodes
    `within`, default all) that can read checkpoints instead of its forward's stacks (the stacks stay
    results for other readers)."""
    found = []
    for b in sorted(graph.nx.nodes if within is None else within):
        battrs = graph.attrs(b)
        info = vjp_of(battrs) if graph.op(b) == "scan" else None
        if info is None or info["second_order"] or battrs.get("backward") == "bppsa" or battrs.get("recompute_every") \
                or (STACK + "_in", 0) not in info["layout"]:   # (a forward without carries keeps no stacks)
            continue
        j = info["layout"].index((STACK + "_in", 0))
        stack = graph.operands(b)[j]
        n = graph.operands(stack)[0] if graph.op(stack) == "scan_out" else None
        if n is not None and graph.op(n) == "scan" and not vjp_of(graph.attrs(n)) and \
                isinstance(steps(graph, n), int) and _is_vjp_of(graph, n, b, info["layout"]):
            found.append((n, b))
    return found


def _is_vjp_of(graph, n, b, layout):
    """Whether b's stack, sequence and closed-over leaves are n's stacks, sequences and closed values."""
    _, _, _, K, X, _, _ = parts(graph.attrs(n))
    fops, bops = graph.operands(n), graph.operands(b)
    for j, (what, i) in enumerate(layout):
        if what in (STACK + "_in", OSTACK + "_in"):
            kind = what[:-len("_in")]
            if graph.op(bops[j]) != "scan_out" or graph.operands(bops[j]) != [n] or \
                    kind_of(graph.attrs(n), graph.attrs(bops[j])["index"]) != (kind, i):
                return False
        elif what == "x" and bops[j] != fops[K + i] or what == "closed" and bops[j] != fops[K + X + i]:
            return False
    return True


def segment_length(T):
    """k = ceil(sqrt(T)): the fewest carries held, ceil(T/k) + k + 1."""
    return math.isqrt(T - 1) + 1 if T > 1 else 1


def worth_it(graph, n, b):
    """Whether checkpoints hold fewer carries than the stacks b reads."""
    T = steps(graph, n)
    k = segment_length(T)
    layout = vjp_of(graph.attrs(b))["layout"]
    stacks = sum(1 for what, _ in layout if what in (STACK + "_in", OSTACK + "_in"))
    carries = parts(graph.attrs(n))[3]
    return (checkpoints(T, k) + k + 1) * carries < T * stacks


def checkpoint(graph, n, b, dims):
    """Rewrite backward scan b to read checkpoints of forward scan n every k steps (k = segment_length)."""
    T = steps(graph, n)
    k = segment_length(T)
    fattrs = dict(graph.attrs(n), checkpoint_every=k)
    graph.node(n)["attrs"] = fattrs
    emit = lambda op, inputs, **attrs: graph.apply(op, inputs, attrs, src=graph.node(n)["src"], phase=graph.node(n)["phase"])
    battrs = dict(graph.attrs(b), recompute_every=k, recompute_body=fattrs["body"])
    ops = []
    for (what, i), u in zip(vjp_of(battrs)["layout"], graph.operands(b)):
        if what == STACK + "_in":
            ops.append(result(graph, n, CHECKPOINT, i, emit))
        elif what != OSTACK + "_in":
            ops.append(u)
    graph.node(b)["attrs"] = battrs
    graph.set_operands(b, ops)
    graph.remove([u for u in _results(graph, n, (STACK, OSTACK)) if not list(graph.users(u))])
    return {"scan": n, "backward": b, "steps": T, "every": k, "checkpoints": checkpoints(T, k),
            "src": graph.node(n)["src"], "recompute_flops": recompute_flops(graph, b, dims)}


def recompute_flops(graph, b, dims):
    """The FLOPs backward scan b spends running its forward's carries again."""
    work = steps(graph, b) * recompute_step_flops(graph.attrs(b))
    return int(sp.sympify(work).subs({sp.Symbol(d): v for d, v in dims.items()}))


def checkpoint_scans(graph, dims, within=None):
    """Checkpoint every scan (whose backward is among `within`) where that holds fewer carries;
    returns what was done, per scan."""
    done = [checkpoint(graph, n, b, dims) for n, b in pairs(graph, within) if worth_it(graph, n, b)]
    graph.validate()
    return done
