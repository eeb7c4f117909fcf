"""Placement: the device of every node, and a transfer node on every edge between devices.

Forward nodes take the stage the partitioner gave them. A derivative node runs where the node it
differentiates runs (`of`, followed back to a forward node or a param). A param lives with its
first forward reader: its gradient is made there (one reader) or summed there (the sum's `of`
is the param), so the stage that owns a param also owns its gradient. Inputs and constants are handed to every device by
the caller, so they never travel. A value read on another device gets one transfer node per
reading device (phase `transfer`), which every reader there shares.
"""
from gradc.ops import get_op

from .storage import LEAVES

REPLICATED = ("input", "const")


def device_name(target, stage, stages):
    return target if stages == 1 else f"{target}:{stage}"


def home(graph, n):
    """The forward node or param whose device a derivative node runs on (n itself for those)."""
    seen = set()
    while graph.node(n)["phase"] != "forward" and graph.op(n) != "param":
        of = graph.node(n).get("of")
        of = None if of is None else graph.survivor(of)
        if of is None or of in seen:
            return None
        seen.add(n)
        n = of
    return n


def assign_stages(graph, stage_of, stages, estimate=frozenset()):
    """stage per node from `stage_of` (forward nodes the partitioner placed). The rest: params with
    their first reader (not counting lr_grad's `estimate` nodes, which run whole); derivatives by
    home; other forward nodes (outputs the loss does not need, the estimate's) with their latest
    operand, but the weight decay's ||p||^2, which runs with its param. Replicated leaves get the stage of their
    first reader (a label)."""
    stage = dict(stage_of)
    order = graph.topo_order()
    rank = {n: i for i, n in enumerate(order)}
    # a view of a param (a conv's bias reshaped) goes where it is read: the schedule makes it first, so
    # the cut put it in stage 0, and the param (with its first reader) away from its gradient
    for n in reversed(order):
        if n in stage and get_op(graph.op(n)).view and graph.op(graph.operands(n)[0]) == "param":
            readers = [stage[u] for u in graph.users(n) if u in stage]
            if readers:
                stage[n] = min(readers)

    for n in order:   # a multi-result op's results (a scan's) are written where it runs
        if n in stage and get_op(graph.op(n)).kind == "project" and graph.operands(n)[0] in stage:
            stage[n] = stage[graph.operands(n)[0]]
    for n in order:
        if n in stage or graph.op(n) in LEAVES or graph.node(n)["phase"] != "forward":
            continue
        stage[n] = max((stage[u] for u in graph.operands(n) if u in stage), default=0)
    decay = {n: graph.survivor(graph.node(n)["decay_of"]) for n in order if graph.node(n).get("decay_of") is not None}
    for p in graph.params.values():   # with its first reader, which is where its gradient adds up
        readers = sorted((u for u in graph.users(p) if u in stage and u not in estimate and u not in decay),
                         key=rank.get)
        stage[p] = stage[readers[0]] if readers else 0
    for n, p in decay.items():        # ||p||^2 where p lives: the objective's stage gets a scalar, not p
        stage[n] = stage[p]
    for n in graph.inputs.values():   # an input is labelled with its first forward reader's stage
        readers = [stage[u] for u in graph.users(n) if u in stage]
        if readers:
            stage[n] = min(readers)
    for n in order:
        if n in stage or graph.op(n) in REPLICATED:
            continue
        h = home(graph, n)
        if h is not None and h in stage:
            stage[n] = stage[h]
        else:
            stage[n] = max((stage[u] for u in graph.operands(n) if u in stage), default=stages - 1)
    for n in order:   # the other replicated leaves: where they are first read
        if n not in stage:
            stage[n] = min((stage[u] for u in graph.users(n) if u in stage), default=0)
    return stage


def insert_transfers(graph, stage, target, stages):
    """Set every node's device; add the transfer nodes. Returns [(transfer node, value, from, to)]."""
    made = {}
    for n in graph.topo_order():
        graph.node(n)["device"] = device_name(target, stage[n], stages)
    for n in graph.topo_order():
        operands = graph.operands(n)
        moved = list(operands)
        for i, u in enumerate(operands):
            if graph.op(u) in REPLICATED or stage[u] == stage[n]:
                continue
            key = (u, stage[n])
            if key not in made:
                t = graph.apply("transfer", [u], {"source": graph.node(u)["device"], "target": graph.node(n)["device"]},
                                phase="transfer", src=graph.node(u)["src"], of=u)
                graph.node(t)["device"] = graph.node(n)["device"]
                stage[t] = stage[n]
                made[key] = t
            moved[i] = made[key]
        if moved != operands:
            graph.set_operands(n, moved)
    return [(t, u, stage[u], to) for (u, to), t in made.items()]
