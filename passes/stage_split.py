"""loss_and_grad split into one forward and one backward function per stage, for pipelines.

Stage k's forward runs its forward nodes for one microbatch. It returns what other stages read
(the sources of transfer nodes), what its own backward reads (the stash), and the objective
when it is on k. Stage k's backward runs its backward nodes: it receives its stash and the
transfers into k, and returns what other stages read and the gradients of the params on k.
Transfer nodes run in neither: the executor hands a transfer node the value of its source
(a copy between virtual devices, a message between MPI ranks).
"""
from gradc.ops import get_op

from .likelihood_ratio import estimate_nodes
from .storage import LEAVES


def stage_index(graph, n):
    device = graph.node(n)["device"]
    return int(device.rsplit(":", 1)[1]) if ":" in device else 0


def made_forward(graph, n):
    """n is made by the forward: a forward node, or a result of one (a forward scan's stacks, which
    autodiff projects for the backward, are written by the forward scan's statement)."""
    if get_op(graph.op(n)).kind == "project":
        n = graph.operands(n)[0]
    return graph.node(n)["phase"] == "forward"


def split_stages(graph, order, K, trainable, backward_of=None):
    """[{"fname", "stage", "kind" ("F"|"B"), "steps", "received", "roots", "sends", "grads", "objective"}]
    for every stage and kind; `order` is loss_and_grad's store-all order. `backward_of` (stage ->
    node list) gives a stage's backward steps where they recompute forward values
    (passes/stage_retention.py); a stage's forward always runs all its forward nodes."""
    context = stage_context(graph, trainable)
    functions = []
    for k in range(K):
        forward, backward = stage_nodes(graph, order, k)
        if backward_of and k in backward_of:
            backward = backward_of[k]
        functions += stage_pair(graph, k, forward, backward, *context)
    return functions


def stage_context(graph, trainable):
    """What stage_pair needs of the whole graph: {source value: transfer nodes that carry it} and
    {gradient node: its param}."""
    transfer_of = {}
    for n in graph.nx.nodes:
        if graph.op(n) == "transfer":
            transfer_of.setdefault(graph.operands(n)[0], []).append(n)
    grad_root = {graph.grads[p]: p for p in trainable if graph.grads.get(p) is not None}
    for r, p in grad_root.items():   # the stage that owns (and updates) a param makes its gradient
        if stage_index(graph, r) != stage_index(graph, graph.params[p]):
            raise AssertionError(f"the gradient of {p!r} is made on {graph.node(r)['device']}, "
                                 f"but {p!r} lives on {graph.node(graph.params[p])['device']}")
    return transfer_of, grad_root


def stage_nodes(graph, order, k):
    """Stage k's forward and backward nodes, in `order`."""
    mine = [n for n in order if stage_index(graph, n) == k and graph.op(n) not in LEAVES + ("transfer",)]
    return [n for n in mine if made_forward(graph, n)], [n for n in mine if not made_forward(graph, n)]


def stash_of(graph, forward, backward):
    """The forward values the backward reads before it computes them (all it reads of the forward,
    unless it recomputes some)."""
    made, read = set(), set()
    for n in backward:
        read |= {u for u in graph.operands(n) if u not in made}
        made.add(n)
    return [n for n in forward if n in read]


def stage_pair(graph, k, forward, backward, transfer_of, grad_root):
    """Stage k's forward and backward functions (see split_stages) from their nodes in order."""
    stash = stash_of(graph, forward, backward)
    out = []
    for kind, nodes in (("F", forward), ("B", backward)):
        members = set(nodes)
        made, leaves, received = set(), [], []
        for n in nodes:
            for u in graph.operands(n):
                if u in made:
                    continue
                if graph.op(u) in LEAVES:
                    leaves.append(u)
                elif graph.op(u) == "transfer" or (kind == "B" and u in stash):
                    received.append(u)
                else:
                    raise AssertionError(f"stage {k} {kind}: reads %{u} on {graph.node(u)['device']} without a transfer")
            made.add(n)
        sends = [n for n in nodes if n in transfer_of] if kind == "F" else \
            [n for n in dict.fromkeys(nodes) if n in transfer_of and not made_forward(graph, n)]
        grads = [n for n in nodes if n in grad_root]
        objective = graph.objective if kind == "F" and graph.objective in members else None
        roots = list(dict.fromkeys(([objective] if objective is not None else []) + sends + grads
                                   + (stash if kind == "F" else [])))
        out.append({"fname": f"_stage{k}_{'forward' if kind == 'F' else 'backward'}", "stage": k,
                    "kind": kind, "steps": list(dict.fromkeys(leaves)) + nodes,
                    "received": list(dict.fromkeys(received)), "roots": roots, "sends": sends,
                    "grads": {n: grad_root[n] for n in grads}, "objective": objective})
    return out


def transfers(graph):
    """[(transfer node, source value, from stage, to stage, "F"|"B"|"param")]: when the source is made."""
    out = []
    estimate = estimate_nodes(graph)   # lr_grad's copies: it runs whole, not in the stages
    for n in graph.nx.nodes:
        if graph.op(n) != "transfer" or n in estimate:
            continue
        u = graph.operands(n)[0]
        when = "param" if graph.op(u) == "param" else "F" if graph.node(u)["phase"] == "forward" else "B"
        out.append((n, u, stage_index(graph, u), stage_index(graph, n), when))
    return sorted(out)
