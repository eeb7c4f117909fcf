"""Activation retention under a memory budget: what the backward keeps, what it recomputes.

The forward graph, in execution order, is cut into a chain of layers (a few dozen) at the points
where the fewest bytes cross; a layer's backward nodes run in the latest group whose forward
values are still there. On that chain a dynamic program in the style of Revolve, for layers of
unequal cost and size (Beaumont et al. 2019), finds the cheapest schedule for every memory size:

  Opt(s, t, m): least forward work to backprop layers s..t-1, given their input x_s, in m bytes.
    base (t = s+1)  run layer s keeping what its backward needs (K_s), then its backward (T_s).
    keep first      run layer s keeping K_s, then Opt(s+1, t, m - K_s), then layer s's backward.
    split at k      run layers s..k-1 keeping only their outputs, keep x_k (b_k), then
                    Opt(k, t, m - b_k), drop x_k, then Opt(s, k, m) recomputes from x_s.

A kept layer keeps its input until its backward (which reads it). With equal layers this is
Revolve's binomial schedule; with every layer kept it is store-all.
A DAG that is not a chain is the same chain of layers whose cuts carry several values (skip
connections); the plan is then optimal for that chain only, and passes/checkmate.py plans the
graph as a DAG as well (passes/memory.py keeps the better plan). The DP's byte counts are a model: the
plan is turned into steps, its true peak comes from liveness, and the budget search keeps the
largest DP memory whose true peak fits.
"""
from dataclasses import dataclass, field

import numpy as np

from gradc.ops import get_op

from .in_place import written_into_results
from .storage import LEAVES, base, owns_buffer, written_with_operand

MAX_LAYERS = 128
MEMORY_UNITS = 128


@dataclass
class Chain:
    layers: list          # forward nodes of each layer, in order
    groups: list          # backward nodes of each layer (run after its forward is there)
    flops: list           # f_j: forward work of layer j
    cut: list             # b_j (j = 0..L): bytes that cross into layer j (b_0 = 0: the model's inputs)
    keep: list            # K_j: bytes layer j leaves for its backward and for layer j+1
    transient: list       # T_j: bytes of layer j's backward values
    needed: list = field(default_factory=list)   # forward nodes of layer j needed for x_{j+1} alone
    skips: int = 0        # forward values read more than one layer after their own: the graph is not a chain
    prelude: list = field(default_factory=list)  # run once before layer 0: the weight decay's terms (_prelude)


# ---- the dynamic program ---------------------------------------------------------------------
INF = np.inf


class Solution:
    """Opt for every (s, t) and every memory size 0..Q units, with the choices to rebuild a schedule."""

    def __init__(self, f, b, K, T, Q):
        L = len(f)
        self.L, self.Q = L, Q
        self.f, self.b, self.K, self.T = list(f), list(b), list(K), list(T)
        m = np.arange(Q + 1)
        F = np.concatenate([[0], np.cumsum(f)])
        pair = np.array([b[j] + b[j + 1] if j > 0 else b[1] for j in range(L)] + [0])   # x_j and x_{j+1} at once
        self.opt = np.full((L + 1, L + 1, Q + 1), INF)
        self.how = np.full((L + 1, L + 1, Q + 1), -2, dtype=np.int64)   # -1 keep first, k split, -2 none
        for s in range(L):
            ok = m >= K[s] + T[s]
            self.opt[s, s + 1] = np.where(ok, f[s], INF)
            self.how[s, s + 1] = np.where(ok, -1, -2)
        for length in range(2, L + 1):
            for s in range(L - length + 1):
                t = s + length
                best = np.where(m >= K[s] + T[s], f[s] + _shifted(self.opt[s + 1, t], K[s]), INF)
                how = np.where(np.isfinite(best), -1, -2)
                ks = np.arange(s + 1, t)
                # split at each k at once: rows are k, columns are m
                after = self.opt[ks, t]                                        # Opt(k, t, .)
                shift = m[None, :] - np.asarray(b)[ks][:, None]               # m - b_k
                after = np.where(shift >= 0, np.take_along_axis(after, np.maximum(shift, 0), axis=1), INF)
                held = pair[ks - 1]   # x_{k-1} and x_k at once, on the forward from x_s to x_k
                held[0] = b[s + 1]      # (x_s is the caller's)
                sweep = np.maximum.accumulate(held)
                cand = (F[ks] - F[s])[:, None] + after + self.opt[s, ks]
                cand = np.where(m[None, :] >= sweep[:, None], cand, INF)
                k_best = cand.argmin(axis=0)
                split = cand[k_best, m]
                better = split < best
                self.opt[s, t] = np.where(better, split, best)
                self.how[s, t] = np.where(better, ks[k_best], how)

    def cost(self, m):
        return self.opt[0, self.L, m]

    def smallest_memory(self):
        """The least m (units) with a schedule, or None."""
        feasible = np.flatnonzero(np.isfinite(self.opt[0, self.L]))
        return int(feasible[0]) if feasible.size else None

    def ops(self, m, s=0, t=None):
        """The schedule of layers s..t-1 (all by default) in memory m: ("F", j, keep) and ("B", j) in
        execution order."""
        out = []
        self._emit(s, self.L if t is None else t, m, out)
        return out

    def _emit(self, s, t, m, out):
        how = int(self.how[s, t, m])
        if how == -2:
            raise AssertionError(f"no schedule for layers {s}..{t - 1} in {m} units")
        if how == -1:
            out.append(("F", s, True))
            if t > s + 1:
                self._emit(s + 1, t, m - self.K[s], out)
            out.append(("B", s))
            return
        out.extend(("F", j, False) for j in range(s, how))
        self._emit(how, t, m - self.b[how], out)
        self._emit(s, how, m, out)


def _shifted(row, by):
    """row[m - by] for every m (inf where m < by)."""
    out = np.full_like(row, INF)
    if by <= len(row) - 1:
        out[by:] = row[:len(row) - by]
    return out


# ---- from the graph to a chain ---------------------------------------------------------------
def build_chain(graph, order, sizes, flops_of, returned=(), max_layers=MAX_LAYERS, even_work=False):
    """Cut the forward part of `order` (a store-all schedule) into layers and group the backward.

    Boundaries are the cheapest cuts (fewest crossing bytes); with `even_work`, the cheapest cut
    near each of max_layers - 1 points that split the forward work evenly (a coarse graph). A value
    in `returned` (the entry's results: the params' gradients) is written into its caller's buffer,
    so it costs the plan nothing."""
    nodes = set(order)
    returned = set(returned) | written_into_results(graph, returned)
    held = lambda v: owns_buffer(graph, v) and v not in returned   # a value the plan's memory holds
    prelude = _prelude(graph, order)
    first = set(prelude)
    forward = [n for n in order if graph.node(n)["phase"] == "forward" and graph.op(n) not in LEAVES
               and n not in first]
    backward = [n for n in order if graph.node(n)["phase"] != "forward" and graph.op(n) not in LEAVES]
    pos = {n: i for i, n in enumerate(forward)}
    fwd_set = set(forward)
    last_read = {}   # forward buffer -> last forward position reading it (or a view of it)
    last_fwd = {}    # forward value -> last forward position reading it
    bwd_readers = set()
    for n in nodes:
        for u in graph.operands(n):
            if u in fwd_set:
                owner = base(graph, u)
                if n in fwd_set:
                    last_read[owner] = max(last_read.get(owner, -1), pos[n])
                    last_fwd[u] = max(last_fwd.get(u, -1), pos[n])
                else:
                    bwd_readers.add(owner)
    # bytes crossing each boundary p (between forward positions p-1 and p)
    crossing = np.zeros(len(forward) + 1, dtype=np.int64)
    for v in forward:
        if held(v) and last_read.get(v, -1) > pos[v]:
            crossing[pos[v] + 1:last_read[v] + 1] += sizes[v]
    cum_flops = np.concatenate([[0], np.cumsum([flops_of(n) for n in forward])])
    choose = _even_work_boundaries if even_work else _choose_boundaries
    starts = choose(graph, forward, crossing, cum_flops, max_layers)
    while True:
        layer_of = _layer_index(forward, starts)
        last_layer = {v: layer_of[forward[p]] for v, p in last_fwd.items()}
        groups, bad = _assign_backward(graph, backward, fwd_set, layer_of, last_layer, len(starts))
        if not bad:
            break
        lo, hi = bad   # layers lo..hi must be one layer for some backward node to find its values
        starts = [p for p in starts if not (starts[lo] < p <= starts[hi])]
    for n in forward:   # a scan's results are written by its statement: a layer recomputed alone would not
        if get_op(graph.op(n)).kind == "project" and layer_of[n] != layer_of.get(graph.operands(n)[0], layer_of[n]):
            raise AssertionError(f"{graph.describe(n)} is in another layer than the {graph.op(graph.operands(n)[0])} "
                                 f"that writes it: the schedule must run a multi-result op's results right after it")
    bounds = starts + [len(forward)]
    layers = [forward[bounds[j]:bounds[j + 1]] for j in range(len(starts))]
    L = len(layers)
    cut = [0] + [int(crossing[bounds[j]]) for j in range(1, L)] + [0]
    keep, transient, needed = [], [], []
    for j, members in enumerate(layers):
        crosses = {v for v in members if last_fwd.get(v, -1) >= bounds[j + 1]}   # read by later layers
        kept = {base(graph, v) for v in crosses} | {v for v in members if v in bwd_readers}
        keep.append(sum(sizes[v] for v in kept if held(v)))
        transient.append(sum(sizes.get(n, 0) for n in groups[j] if held(n)))
        needed.append(_ancestors_within(graph, crosses, set(members)))
    # a value smaller than the DP's memory unit (a weight-decay term, a scalar loss) cannot change its
    # plan: it counts as a skip only from a unit up (the unit is 1/MEMORY_UNITS of store-all's peak,
    # which is at least the most bytes crossing any boundary)
    skips = sum(1 for v, last in last_layer.items()
                if last > layer_of[v] + 1 and sizes[v] * MEMORY_UNITS >= crossing.max(initial=0))
    return Chain(layers, groups, [int(cum_flops[bounds[j + 1]] - cum_flops[bounds[j]]) for j in range(L)],
                 cut, keep, transient, needed, skips, prelude)


def _prelude(graph, order):
    """The weight decay's terms that read params (and each other) alone, in `order`: they run once before
    the layers and are never recomputed with one. A term that CSE merged into the user's own node (a
    gc.square(W) of the model) is the user's: it stays in its layer, and so do the terms that read it."""
    prelude = {}
    for n in order:
        if graph.node(n).get("decay_term") and all(graph.op(u) in LEAVES or u in prelude for u in graph.operands(n)):
            prelude[n] = None
    return list(prelude)


def _choose_boundaries(graph, forward, crossing, cum_flops, max_layers):
    """Layer starts: the cheapest boundaries (fewest crossing bytes), spread evenly among equals."""
    candidates = [p for p in range(1, len(forward)) if not written_with_operand(graph, forward[p])]
    if len(candidates) + 1 <= max_layers:
        return [0] + candidates
    chosen, room = [], max_layers - 1
    by_bytes = {}
    for p in candidates:
        by_bytes.setdefault(int(crossing[p]), []).append(p)
    for _, group in sorted(by_bytes.items()):
        if len(group) <= room:
            chosen += group
            room -= len(group)
            continue
        # an even spread of `room` boundaries over this group, by forward work done so far
        targets = np.linspace(cum_flops[group[0]], cum_flops[group[-1]], room + 2)[1:-1]
        at = np.array([cum_flops[p] for p in group])
        picked = {group[int(np.abs(at - x).argmin())] for x in targets}
        chosen += sorted(picked)
        break
    return [0] + sorted(set(chosen))


def _even_work_boundaries(graph, forward, crossing, cum_flops, max_layers):
    """In each window of forward work around a point k/max_layers of the total, the cut fewest bytes cross."""
    candidates = np.array([p for p in range(1, len(forward)) if not written_with_operand(graph, forward[p])],
                          dtype=np.int64)
    if len(candidates) + 1 <= max_layers:
        return [0] + candidates.tolist()
    edges = np.linspace(0, cum_flops[-1], 2 * max_layers + 1)[1::2]   # windows centred on k/max_layers
    at = cum_flops[candidates]
    chosen = set()
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = candidates[(at > lo) & (at <= hi)]
        if inside.size:
            chosen.add(int(inside[np.argmin(crossing[inside])]))
    return [0] + sorted(chosen)


def _layer_index(forward, starts):
    layer_of, j = {}, 0
    for p, n in enumerate(forward):
        while j + 1 < len(starts) and starts[j + 1] <= p:
            j += 1
        layer_of[n] = j
    return layer_of


def _assign_backward(graph, backward, fwd_set, layer_of, last_layer, L):
    """Group of each backward node: the latest (lowest layer) where its forward operands are there
    (made in that layer, or crossing into it) and after the nodes it reads. Returns (groups, None),
    or (None, (lo, hi)): layers lo..hi must become one for some backward node to find its values."""
    group = {}
    for n in backward:
        at, lo = INF, 0
        for u in graph.operands(n):
            if u in group:
                at = min(at, group[u])
            elif u in fwd_set:
                at = min(at, max(layer_of[u], last_layer.get(u, -1)))
                lo = max(lo, layer_of[u])
        group[n] = at
        if at != INF and at < lo:
            return None, (int(at), lo)
    users = {}
    for n in backward:
        for u in graph.operands(n):
            users.setdefault(u, []).append(n)
    for n in reversed(backward):   # values that read nothing forward run with their first reader
        if group[n] == INF:
            group[n] = max((group[u] for u in users.get(n, ()) if group[u] != INF), default=L - 1)
    groups = [[] for _ in range(L)]
    for n in backward:
        groups[int(group[n])].append(n)
    return groups, None


def _ancestors_within(graph, targets, members):
    """The nodes of `members` that `targets` depend on, inside `members`."""
    seen, stack = set(), [t for t in targets if t in members]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(u for u in graph.operands(n) if u in members)
    return seen


# ---- from a DP schedule to the steps of the entry point --------------------------------------
def steps_of(chain, ops, leaves, prelude=True):
    """Node ids in execution order: the leaves, the prelude (which a stage's backward, whose forward ran it,
    leaves out), then each layer op (a layer run without keeping computes only what the next layer reads)."""
    steps = list(leaves) + (chain.prelude if prelude else [])
    for op in ops:
        if op[0] == "F":
            j, keep = op[1], op[2]
            steps += chain.layers[j] if keep else [n for n in chain.layers[j] if n in chain.needed[j]]
        else:
            steps += chain.groups[op[1]]
    return steps


class BudgetError(Exception):
    """The budget is below the least this model can be planned to (bytes; `store_all`: what keeping
    every activation needs; `workspace`: the kernels' own, which both figures include;
    `store_all_peak`: the store-all plan's peak of live bytes, where known)."""

    def __init__(self, minimum, store_all, workspace=0, store_all_peak=None):
        super().__init__(minimum)
        self.minimum = minimum
        self.store_all = store_all
        self.workspace = workspace
        self.store_all_peak = store_all_peak


def plan_retention(graph, chain, order, budget, peak_of, store_all_peak):
    """Steps of loss_and_grad whose true peak (`peak_of(steps)`) fits `budget` with the least recompute,
    by the DP over `chain` (build_chain of `order`).

    Returns (steps, info) where info has the chain's size and the DP's choice; raises BudgetError."""
    unit = max(1, -(-store_all_peak // MEMORY_UNITS))
    units = lambda xs: [-(-int(x) // unit) for x in xs]
    Q = 2 * MEMORY_UNITS
    solution = Solution(chain.flops, units(chain.cut), units(chain.keep), units(chain.transient), Q)
    leaves = [n for n in order if graph.op(n) in LEAVES]
    m_min = solution.smallest_memory()
    if m_min is None:   # the chain's byte model overcounts this graph badly: store-all is the least it knows
        raise BudgetError(store_all_peak, store_all_peak)
    tried, measured = {}, {}   # m -> (true peak, steps); a schedule -> the same (many m share one)

    def peak(m):
        if m not in tried:
            schedule = tuple(solution.ops(m))
            if schedule not in measured:
                steps = steps_of(chain, list(schedule), leaves)
                measured[schedule] = (peak_of(steps), steps)
            tried[m] = measured[schedule]
        return tried[m][0]

    lo, hi = m_min, Q   # the largest m whose true peak fits (true peaks grow with m, up to noise)
    near = range(m_min, min(Q, m_min + 8) + 1)   # (the least memories the DP knows: the noise is there too)
    if peak(lo) > budget:
        lo = next((m for m in near if peak(m) <= budget), None)
        if lo is None:   # the noise can be larger (a plan of more units peaking lower): every schedule, once each
            lo = next((m for m in range(m_min, Q + 1) if peak(m) <= budget), None)
        if lo is None:
            raise BudgetError(min(min(p for p, _ in tried.values()), store_all_peak), store_all_peak)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    fitting = [m for m, (p, _) in tried.items() if p <= budget]
    best = min(fitting, key=lambda m: (solution.cost(m), tried[m][0]))
    info = {"layers": len(chain.layers), "skips": chain.skips, "dp_units": int(best), "unit_bytes": int(unit),
            "dp_forward_work": float(solution.cost(best)), "minimum_peak_bytes": min(p for p, _ in tried.values())}
    return tried[best][1], info
