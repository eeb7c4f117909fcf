"""Activation retention on a general DAG by mixed-integer programming, as Checkmate (Jain et al. 2020).

The graph is coarsened to a few dozen nodes. The chain builder's layers (passes/checkpoint.py)
each split in two: the part later layers read (A_j) and the rest, which only the backward reads
(R_j); each backward group is one node (B_j). In the topological order A_0 R_0 A_1 R_1 ...
B_{L-1} ... B_0, stage t computes node t for the first time, after recomputing whatever earlier
forward nodes it needs (Checkmate's frontier-advancing form):

  R[t,i]    node i runs in stage t (a backward node runs only in its own stage)
  S[t,v]    value v is held from stage t-1 into stage t
  F[t,v,k]  value v is freed in stage t just after node k runs
  U[t,k]    bytes held while node k runs in stage t, at most the budget

  minimise   the forward work of every recomputation
  subject to R[t,t] = 1;  R[t,k] <= R[t,i] + S[t,v] for each value v of node i that k reads;
             S[t+1,v] <= S[t,v] + R[t,i] (v made by i);
             U[t,0] = sum_v S[t,v] M_v + R[t,0] Made_0;
             U[t,k] = U[t,k-1] + R[t,k] Made_k - sum_v F[t,v,k-1] M_v;
             F[t,v,k] <= R[t,k],  F[t,v,k] <= 1 - S[t+1,v],  F[t,v,k] <= 1 - R[t,j] for later readers j.

Checkmate's nodes have one output; a coarse node has several, read by different nodes, so here
memory is held and freed per value (the buffers of one node that the same nodes read). F only
ever lowers U, so its upper bounds are all it needs (the disaggregated form, whose LP relaxation
is tighter than one aggregated constraint). Buffers internal to a coarse node are not modelled,
which is why the caller checks every plan's true peak by liveness. HiGHS solves it under a time limit; the best plan found
and its optimality gap are returned.
"""
import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_array

from .checkpoint import build_chain
from .in_place import written_into_results
from .storage import LEAVES, base, owns_buffer, written_with_operand

MILP_LAYERS = 12          # chain layers before the split: at most 3 x 12 coarse nodes
TIME_LIMIT_S = 20.0       # for all solves of one plan
LEAST_SHARE = 0.75        # of it, for the solves under the budget (the rest: the plan of least memory)
STATUS = {0: "optimal", 1: "time limit", 2: "infeasible"}
MAX_SOLVES = 4            # the model budget follows the true peak's distance from the budget


@dataclass
class Coarse:
    """The coarse graph. A value is every buffer of one node that the same set of other nodes
    reads: such buffers are made, kept and freed together."""
    members: list         # graph nodes of each coarse node, in order
    backward: set         # coarse nodes that are backward (never recomputed)
    work: list            # forward work of each coarse node
    values: list          # (maker, sorted readers, bytes)
    scratch: list         # the most bytes a node's own temporaries take while it runs
    layers: int = 0       # chain layers the forward came from

    def __post_init__(self):
        self.reads = [[] for _ in self.members]   # value ids node k reads
        for v, (_, ks, _) in enumerate(self.values):
            for k in ks:
                self.reads[k].append(v)
        self.made = [sum(held for i, _, held in self.values if i == k) for k in range(len(self.members))]

    def store_all_bytes(self):
        """The model's peak when every node runs once and each value is kept to its last reader."""
        held, peak = 0, 0
        for k in range(len(self.members)):
            held += self.made[k]
            peak = max(peak, held + self.scratch[k])
            held -= sum(b for i, ks, b in self.values if max(ks) == k)
        return peak

    def __len__(self):
        return len(self.members)


@contextmanager
def _stdout_silenced():
    """HiGHS prints a stray debug line from C on stdout whatever its options (HiGHS issue #2783)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def coarsen(graph, order, sizes, flops_of, returned, peak_of):
    """The forward of `order` as chain layers split in two (what later layers read, the rest),
    then the backward in runs of about equal work. A backward node written by a forward node's statement
    (autodiff's added results of a forward scan; a view) joins that node's piece."""
    returned = set(returned) | written_into_results(graph, returned)   # (what lives in a result's array: nothing)
    chain = build_chain(graph, order, sizes, flops_of, returned, max_layers=MILP_LAYERS, even_work=True)
    nodes = [chain.prelude] if chain.prelude else []
    for j, members in enumerate(chain.layers):
        # a scan's results go where the scan goes: recomputing one means running the scan
        need = chain.needed[j] | {n for n in members
                                  if written_with_operand(graph, n) and graph.operands(n)[0] in chain.needed[j]}
        needed = [n for n in members if n in need]
        rest = [n for n in members if n not in need]
        nodes += [part for part in (needed, rest) if part]
    forward = len(nodes)
    where = {n: i for i, members in enumerate(nodes) for n in members}
    backward = []
    for n in order:
        if graph.op(n) in LEAVES or graph.node(n)["phase"] == "forward":
            continue
        if written_with_operand(graph, n) and graph.operands(n)[0] in where:
            where[n] = where[graph.operands(n)[0]]   # (recomputing it means running its operand's statement)
            nodes[where[n]].append(n)
        else:
            backward.append(n)
    nodes += _even_pieces(graph, backward, flops_of, MILP_LAYERS)
    where = {n: i for i, members in enumerate(nodes) for n in members}
    readers = {}   # buffer -> coarse nodes other than its own that read it
    for k, members in enumerate(nodes):
        for n in members:
            for u in graph.operands(n):
                if graph.op(u) in LEAVES:
                    continue
                for v in {u, base(graph, u)} - {w for w in (base(graph, u),) if graph.op(w) in LEAVES}:
                    # (a view of a leaf, such as a bias reshaped to broadcast, reads no coarse node)
                    if where[v] > k:
                        raise AssertionError(f"coarse node {k} reads {v} of the later node {where[v]}")
                    if where[v] < k:
                        readers.setdefault(v, set()).add(k)
    grouped = {}
    for v, ks in readers.items():
        key = (where[v], tuple(sorted(ks)))
        grouped[key] = grouped.get(key, 0) + (sizes[v] if owns_buffer(graph, v) and v not in returned else 0)
    outputs = set(readers) | set(returned)   # a node's outputs are values; its scratch is the rest
    return Coarse(nodes, set(range(forward, len(nodes))), [sum(map(flops_of, m)) for m in nodes],
                  [(i, list(ks), held) for (i, ks), held in sorted(grouped.items())],
                  [peak_of(members, outputs) for members in nodes], len(chain.layers))


def _even_pieces(graph, nodes, flops_of, count):
    """`nodes` (in order) cut into at most `count` runs of about equal work; a node written with its
    operand (a scan's result) stays in its operand's run."""
    work = np.cumsum([flops_of(n) + 1 for n in nodes])
    piece = np.minimum((work - 1) * count // work[-1], count - 1) if len(nodes) else []
    runs = {}
    for n, p in zip(nodes, piece):
        if runs and written_with_operand(graph, n):
            p = max(runs)
        runs.setdefault(int(p), []).append(n)
    return [runs[p] for p in sorted(runs)]


class _Program:
    """Variables by name, and sparse constraint rows."""

    def __init__(self):
        self.index, self.lb, self.ub, self.integer, self.cost = {}, [], [], [], []
        self.rows, self.cols, self.vals, self.row_lb, self.row_ub = [], [], [], [], []

    def var(self, key, lb=0.0, ub=1.0, integer=True, cost=0.0):
        self.index[key] = len(self.lb)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(int(integer))
        self.cost.append(cost)

    def row(self, terms, lb=-np.inf, ub=np.inf):
        r = len(self.row_lb)
        for key, coef in terms:
            self.rows.append(r)
            self.cols.append(self.index[key])
            self.vals.append(coef)
        self.row_lb.append(lb)
        self.row_ub.append(ub)

    def solve(self, seconds):
        """scipy's milp (HiGHS) in a thread of its own, which this one waits for: HiGHS lets the GIL go but
        checks for no signal, so Ctrl-C in a solve on this thread waited for its time limit (up to 10 s,
        a trial found); waiting in short joins, this thread raises KeyboardInterrupt at once (the solve,
        a daemon thread, ends with the process)."""
        A = coo_array((self.vals, (self.rows, self.cols)), shape=(len(self.row_lb), len(self.lb))).tocsr()
        outcome, done = {}, threading.Event()

        def run():
            try:
                outcome["result"] = milp(np.array(self.cost), integrality=np.array(self.integer),
                                         bounds=(np.array(self.lb), np.array(self.ub)),
                                         constraints=LinearConstraint(A, self.row_lb, self.row_ub),
                                         options={"time_limit": max(seconds, 0.1), "disp": False})
            except BaseException as e:   # raised again on the caller's thread
                outcome["error"] = e
            finally:
                done.set()
        with _stdout_silenced():
            solver = threading.Thread(target=run, name="gradc-milp", daemon=True)
            try:
                solver.start()
                while not done.wait(0.05):
                    pass
            except BaseException:   # Ctrl-C: the caller goes on at once; the solve ends by its time limit
                # (an event, not the thread's is_alive: a join a signal interrupts marks the thread stopped)
                _ABANDONED.append((done, time.monotonic() + max(seconds, 0.1)))
                raise
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]


_ABANDONED = []   # (done event, deadline) of the solves a signal left running


def solves_running():
    """Whether a solve that a signal left running still runs. The process must not exit while HiGHS runs:
    C++'s statics are destroyed under it, and the process aborted ("terminate called without an active
    exception", status 134) after a Ctrl-C during a --memory-budget compile."""
    return any(not done.is_set() for done, _ in _ABANDONED)


@atexit.register
def _wait_for_abandoned_solves():
    """At exit, wait for those solves (each ends by its time limit, at most seconds away)."""
    for done, deadline in _ABANDONED:
        done.wait(max(0.0, deadline - time.monotonic()) + 1.0)


def solve_stages(coarse, budget, seconds):
    """Which coarse nodes each stage runs ([[i, ...] per stage]) under `budget` model bytes, with
    the solver's report; stages is None when no plan was found in time (or none exists).
    With budget None: the plan of least model peak (recompute breaks ties)."""
    n, values = len(coarse), coarse.values
    p = _Program()
    least_memory = budget is None
    cap = np.inf if least_memory else float(budget)
    scale = 1.0 / (sum(coarse.work) + n + 1) if least_memory else 1.0
    if least_memory:
        p.var("P", ub=np.inf, integer=False, cost=1.0)
    for t in range(n):
        for i in range(t + 1):
            first = i == t
            p.var(("R", t, i), lb=float(first), ub=float(first or i not in coarse.backward),
                  cost=0.0 if first else (coarse.work[i] + 1.0) * scale)
            p.var(("U", t, i), ub=cap, integer=False)
        for v, (i, _, _) in enumerate(values):
            if i < t:
                p.var(("S", t, v))
    frees = {}   # (t, k) -> values that may be freed just after node k runs in stage t
    for t in range(n):
        for v, (i, ks, _) in enumerate(values):
            for k in [i] + ks:
                if k <= t:
                    frees.setdefault((t, k), []).append(v)
                    p.var(("F", t, v, k))
    for t in range(n):
        for k in range(t + 1):
            for v in coarse.reads[k]:
                p.row([(("R", t, k), 1), (("R", t, values[v][0]), -1), (("S", t, v), -1)], ub=0)
        for v, (i, ks, held) in enumerate(values):
            if i <= t < n - 1:
                p.row([(("S", t + 1, v), 1), (("R", t, i), -1)] + ([(("S", t, v), -1)] if i < t else []), ub=0)
        held_in = [(("S", t, v), -held) for v, (i, _, held) in enumerate(values) if i < t]
        p.row([(("U", t, 0), 1), (("R", t, 0), -coarse.made[0])] + held_in, lb=0, ub=0)
        for k in range(1, t + 1):
            p.row([(("U", t, k), 1), (("U", t, k - 1), -1), (("R", t, k), -coarse.made[k])]
                  + [(("F", t, v, k - 1), values[v][2]) for v in frees.get((t, k - 1), ())], lb=0, ub=0)
        for k in range(t + 1):
            if least_memory:
                p.row([(("U", t, k), 1), (("R", t, k), coarse.scratch[k]), ("P", -1)], ub=0)
            elif coarse.scratch[k]:
                p.row([(("U", t, k), 1), (("R", t, k), coarse.scratch[k])], ub=cap)
        for k in range(t + 1):
            for v in frees.get((t, k), ()):
                p.row([(("F", t, v, k), 1), (("R", t, k), -1)], ub=0)
                if t < n - 1:
                    p.row([(("F", t, v, k), 1), (("S", t + 1, v), 1)], ub=1)
                for j in values[v][1]:
                    if k < j <= t:
                        p.row([(("F", t, v, k), 1), (("R", t, j), 1)], ub=1)
    started = time.perf_counter()
    res = p.solve(seconds)
    report = {"status": STATUS.get(res.status, res.message), "seconds": round(time.perf_counter() - started, 3),
              "gap": None if res.x is None else float(getattr(res, "mip_gap", 0.0) or 0.0),
              "objective": None if res.x is None else float(res.fun),
              "variables": len(p.lb), "constraints": len(p.row_lb)}
    if res.x is None:
        return None, report
    stages = [[i for i in range(t + 1) if res.x[p.index[("R", t, i)]] > 0.5] for t in range(n)]
    return stages, report


def plan(graph, order, sizes, flops_of, budget, peak_of, returned):
    """(steps of loss_and_grad whose true bytes (peak_of) fit `budget` from the MILP, or None; info; the steps
    of the plan of least model memory where it was tried, else None: what a refusal's minimum can name).

    The model's bytes are not the true ones, so the model budget moves by the difference between
    the true peak and the budget after each solve: down when the plan does not fit, up when it
    leaves room (a cheaper plan may fit); the cheapest plan that fits is kept. When none fits,
    the plan of least model memory is tried, and its true peak is info["least_peak"].
    peak_of(steps, returned): the true bytes of steps, with `returned` values outside the arena (the
    peak of live bytes, or where that fits the budget, the arena they lay out to)."""
    coarse = coarsen(graph, order, sizes, flops_of, set(returned), peak_of)
    leaves = [n for n in order if graph.op(n) in LEAVES]
    info = {"coarse_nodes": len(coarse), "layers": coarse.layers, "solves": []}
    # the model and liveness differ by about the same share at every budget: start from that share
    target = int(budget * coarse.store_all_bytes() / peak_of(order, returned))
    start, best, tried = time.perf_counter(), None, set()
    # the solves for the budget leave a quarter of the time to the plan of least memory: a budget just
    # below the least took it all, and the refusal named the chain DP's larger least (trial W)
    deadline = start + LEAST_SHARE * TIME_LIMIT_S

    def attempt(model_budget, until):
        stages, report = solve_stages(coarse, model_budget, until - time.perf_counter())
        report["model_budget"] = None if model_budget is None else int(model_budget)
        info["solves"].append(report)
        if stages is None:
            return None, None
        steps = leaves + [n for stage in stages for i in stage for n in coarse.members[i]]
        report["true_peak"] = peak = int(peak_of(steps, returned))
        return steps, peak

    for _ in range(MAX_SOLVES):
        if deadline <= time.perf_counter() or target <= 0 or target in tried:
            break
        tried.add(target)
        steps, peak = attempt(target, deadline)
        if steps is None:
            break
        if peak <= budget and (best is None or info["solves"][-1]["objective"] < best[0]["objective"]):
            best = (info["solves"][-1], steps)
        target += budget - peak
    least = None
    if best is None and start + TIME_LIMIT_S > time.perf_counter():
        least, peak = attempt(None, start + TIME_LIMIT_S)
        if least is not None:
            info["least_peak"] = peak
            if peak <= budget:
                best = (info["solves"][-1], least)
    if best is None:
        return None, info, least
    info.update(gap=best[0]["gap"], status=best[0]["status"])
    return best[1], info, least
