"""--memory-budget in a pipeline (--devices K, --microbatches M): which forward values each stage's
backward reads from its forward, held once per microbatch in flight, and which it recomputes.

What a stage holds for a step's activations (its `activation_bytes`):
  the larger of its forward's and its backward's arena (they run in turn over one region),
  plus its kernels' workspace,
  plus, per microbatch in flight, the forward values its backward reads (the stash its forward
  returns, and the activations that came from earlier stages).
The budget bounds that, per stage: each stage is one device. Params, their gradients and the
optimizer state are not in it, as on one device (DESIGN.md §1.5).

A stage over budget is planned on its chain of layers (passes/checkpoint.py's build_chain, over
its forward and backward as one sequence) by a DP from the last layer (`top_level`): each layer is
either kept whole for its backward, its values stashed by the forward, or lies in a segment that
the backward recomputes from the value entering it, which is stashed; a segment is recomputed by
the Revolve-style chain DP within the memory the backward works in. A stashed value costs once per
microbatch in flight, a recomputation once. The DP's byte model is checked against the true count
(the two functions' liveness plans, and the values the backward takes, times the microbatches in
flight), and asked for less by the excess until a plan fits. A value the backward reads from the
stash is never recomputed after: it is there anyway. The forward still runs all its nodes,
because other stages read them. With GPipe's schedule and a small budget this is GPipe's
re-materialisation: each stage keeps little more than the activations it receives, and its
backward runs its forward again.
"""
import numpy as np

from gradc.ops import get_op

from .analysis import node_flops
from .checkpoint import MEMORY_UNITS, Solution, build_chain, steps_of
from .memory import arena_total, peak_bytes, plan_entry
from .schedule import float_to_readers
from .stage_split import made_forward, split_stages, stage_context, stage_nodes, stage_pair
from .storage import LEAVES, buffer_bytes, value_bytes

MAX_TRIES = 12   # plans tried when the DP's byte model falls short of the true count


def stage_plan(graph, f, dims, with_runs=True):
    """The memory plan of one stage function."""
    plan = plan_entry(graph, f["fname"], f["steps"], f["roots"], dims, with_runs=with_runs)
    plan["roots"] = f["roots"]
    return plan


def held_per_microbatch(graph, bwd, dims):
    """Bytes of the values stage's backward `bwd` takes that a forward made: its stash and the
    activations received from earlier stages (a forward scan's stacks included; a view counted
    whole, since the forward returns a copy of it; not other stages' params, one copy of which
    serves every microbatch)."""
    source = {u: graph.operands(u)[0] if graph.op(u) == "transfer" else u for u in bwd["received"]}
    return sum(value_bytes(graph, u, dims) for u, v in source.items()
               if graph.op(v) != "param" and made_forward(graph, v))


def activation_bytes(graph, fwd, bwd, plans, flight, dims):
    """What a stage holds for a step's activations (the module docstring's count)."""
    peak = max(arena_total(plans[f["fname"]]) + (plans[f["fname"]]["workspace_bytes"] or 0) for f in (fwd, bwd))
    return int(peak + flight * held_per_microbatch(graph, bwd, dims))


def stage_functions(functions, k):
    """Stage k's forward and backward functions (of split_stages)."""
    return tuple(next(f for f in functions if f["stage"] == k and f["kind"] == kind) for kind in "FB")


class StageBudgetError(Exception):
    """Stage `stage` needs more than the budget by every plan: `minimum` is the least found,
    `store_all` the count with every activation kept."""

    def __init__(self, stage, minimum, store_all, flight):
        super().__init__(stage)
        self.stage, self.minimum, self.store_all, self.flight = stage, minimum, store_all, flight


def fit_stages(graph, order, K, trainable, functions, plans, budget, flights, dims):
    """Stage functions (and their plans) whose activation bytes fit `budget` on every stage, with the
    least recomputation the DP finds; and a record per stage for the dumps. Raises StageBudgetError."""
    backward_of, records, refused = {}, [], []
    for k in range(K):
        fwd, bwd = stage_functions(functions, k)
        store_all = activation_bytes(graph, fwd, bwd, plans, flights[k], dims)
        record = {"stage": k, "budget_bytes": budget, "store_all_bytes": store_all, "activation_bytes": store_all,
                  "in_flight": flights[k], "method": "store-all", "recompute_flops_per_microbatch": 0, "recomputed": [],
                  "part_runs": True}
        if store_all > budget:
            try:
                backward_of[k], record = _recompute(graph, order, K, trainable, k, budget, flights[k], dims, record)
            except StageBudgetError as e:
                refused.append(e)
        records.append(record)
    if refused:   # the stage that needs most: its least is the least budget every stage fits
        raise max(refused, key=lambda e: e.minimum)
    if backward_of:   # a recomputing stage's functions keep their part runs where the stage still fits with them
        functions = split_stages(graph, order, K, trainable, backward_of)
        plans = {f["fname"]: plans[f["fname"]] if f["stage"] not in backward_of
                 else stage_plan(graph, f, dims, with_runs=records[f["stage"]]["part_runs"]) for f in functions}
    for k, record in enumerate(records):
        fwd, bwd = stage_functions(functions, k)
        record.update(activation_bytes=activation_bytes(graph, fwd, bwd, plans, flights[k], dims),
                      held_per_microbatch_bytes=held_per_microbatch(graph, bwd, dims))
    return functions, plans, records


def backward_steps(graph, steps, forward):
    """A stage's backward from the steps of a DP schedule that follow its first forward sweep,
    without recomputing what it has read from the stash (or a scan's result, which only its scan's
    statement writes)."""
    members, made, stashed, out = set(forward), set(), set(), []
    for n in steps:
        if n in stashed or graph.op(n) in LEAVES:
            continue
        if get_op(graph.op(n)).kind == "project" and graph.operands(n)[0] not in made:
            stashed.add(n)   # its scan ran in the forward only: the forward returns it
            continue
        stashed |= {u for u in graph.operands(n) if u in members and u not in made}
        out.append(n)
        made.add(n)
    return out


def top_level(solution, m):
    """The stage's plans when its backward works in m units, by a DP over the chain's layers from the
    last: layer s is kept whole for its backward (its K_s stashed), or layers s..k-1 are recomputed
    in the backward from x_s by the chain DP in m units (x_k stashed; k = L: nothing after).
    Returns (cost, how): cost[s, u] the least recompute for layers s.. with at most u units stashed
    (never more for a larger u: every choice's is so, from cost[L] = 0 up), how[s, u] the choice (-1
    keep, k recompute up to k, -2 none)."""
    L, Q = solution.L, solution.Q
    u = np.arange(Q + 1)
    cost = np.full((L + 1, Q + 1), np.inf)
    how = np.full((L + 1, Q + 1), -2, dtype=np.int64)
    cost[L] = 0.0
    b = np.asarray(solution.b)
    for s in range(L - 1, -1, -1):
        best = np.full(Q + 1, np.inf)
        if m >= solution.T[s]:
            best = np.where(u >= solution.K[s], cost[s + 1][np.maximum(u - solution.K[s], 0)], np.inf)
        choice = np.where(np.isfinite(best), -1, -2)
        ks = np.arange(s + 1, L + 1)
        rest = u[None, :] - b[ks][:, None]   # units left after stashing x_k
        after = np.where(rest >= 0, np.take_along_axis(cost[ks], np.maximum(rest, 0), axis=1), np.inf)
        cand = solution.opt[s, ks, m][:, None] + after
        k_best = cand.argmin(axis=0)
        split = cand[k_best, u]
        better = split < best
        cost[s] = np.where(better, split, best)
        how[s] = np.where(better, ks[k_best], choice)
    return cost, how


def top_ops(solution, how, m, u):
    """The backward's ops of the top-level plan with at most u units stashed (top_level's choices)."""
    pieces, s, L = [], 0, solution.L
    while s < L:
        k = int(how[s, u])
        if k == -1:
            pieces.append((s, None))
            u, s = u - solution.K[s], s + 1
        else:
            pieces.append((s, k))
            u, s = u - solution.b[k], k
    ops = []
    for s, k in reversed(pieces):
        ops += [("B", s)] if k is None else solution.ops(m, s, k)
    return ops


def _recompute(graph, order, K, trainable, k, budget, flight, dims, record):
    """Stage k's backward nodes (recomputations included) under `budget`, and its record: the least
    recompute top_level finds whose true count fits, the DP's byte model corrected by the true
    count's excess until it does."""
    forward, backward = stage_nodes(graph, order, k)
    members = set(forward) | set(backward)   # and what they read (a view of a received value has its base there)
    sizes = {n: buffer_bytes(graph, n, dims) for n in members | {u for n in members for u in graph.operands(n)}}
    work = {}
    flops_of = lambda n: work[n] if n in work else work.setdefault(n, node_flops(graph, n, dims))
    tried, context = {}, stage_context(graph, trainable)

    def count(nodes, with_runs=False):
        key = (tuple(nodes), with_runs)
        if key not in tried:
            fwd, bwd = stage_pair(graph, k, forward, nodes, *context)
            plans = {f["fname"]: stage_plan(graph, f, dims, with_runs) for f in (fwd, bwd)}
            tried[key] = activation_bytes(graph, fwd, bwd, plans, flight, dims)
        return tried[key]

    if count(backward) <= budget:   # part runs go before any value is recomputed
        return backward, dict(record, method="store-all without part runs", part_runs=False)
    sequence = float_to_readers(graph, forward + backward, set(forward))
    returned = stage_pair(graph, k, forward, backward, *context)[1]["roots"]   # its gradients sent or returned
    chain = build_chain(graph, sequence, sizes, flops_of, returned)
    unit = max(1, -(-peak_bytes(graph, sequence, [], dims) // MEMORY_UNITS))   # one microbatch's pass: the DP's scale
    units = lambda xs: [-(-int(x) // unit) for x in xs]
    solution = Solution(chain.flops, units(chain.cut), units(chain.keep), units(chain.transient), 2 * MEMORY_UNITS)
    plans = {m: top_level(solution, m) for m in np.unique(np.geomspace(1, solution.Q, 40).astype(int))}
    nodes_of = lambda m, u: backward_steps(graph, steps_of(chain, top_ops(solution, plans[m][1], m, u), [],
                                                           prelude=False), forward)

    def cheapest(limit):
        """(m, u) of the least recompute whose modelled bytes (u stashed per microbatch in flight, m
        working) are at most `limit` units, or None."""
        best = None
        for m, (cost, _) in plans.items():
            u = min((limit - m) // flight, solution.Q) if limit >= m else -1
            if u >= 0 and np.isfinite(cost[0, u]) and (best is None or (cost[0, u], m) < best[0]):
                best = ((cost[0, u], m), m, u)
        return best and best[1:]

    def plan(nodes):
        recomputed = [n for n in nodes if made_forward(graph, n)]
        return nodes, dict(record, method=f"dp over {len(chain.layers)} layers: kept, or recomputed in the backward "
                                          f"(Revolve-style within)", recomputed=sorted(set(recomputed)),
                           recompute_flops_per_microbatch=int(sum(map(flops_of, recomputed))),
                           part_runs=count(nodes, True) <= budget)

    limit = budget // unit
    for _ in range(MAX_TRIES):
        choice = cheapest(limit)
        if choice is None:
            break
        nodes = nodes_of(*choice)
        if count(nodes) <= budget:
            return plan(nodes)
        limit -= max(1, -(-(count(nodes) - budget) // unit))   # the model fell short by this much: ask it for less
    # each working memory's plan with the fewest units stashed, counted: tried at every budget, so the
    # least of them (or store-all's count, where less) is a budget that compiles, and what the error names
    fewest = {m: int(np.argmax(np.isfinite(cost[0]))) for m, (cost, _) in plans.items() if np.isfinite(cost[0]).any()}
    least = min(fewest, key=lambda m: (count(nodes_of(m, fewest[m])), m), default=None)
    if least is not None and count(nodes_of(least, fewest[least])) <= budget:
        return plan(nodes_of(least, fewest[least]))
    named = [count(nodes_of(m, u)) for m, u in fewest.items()] + [count(backward), record["store_all_bytes"]]
    raise StageBudgetError(k, min(named), record["store_all_bytes"], flight)
