"""Device partitioning: the forward order cut into K contiguous stages, the slowest stage least.

Positions are the forward nodes in execution order. Each carries its own work and the work of
the backward nodes that differentiate it (they run on its device). A stage [a, b) costs its
work, plus the bytes it receives (values made before a that it reads) and sends (values it
makes that later stages read), twice (the activation forward, its gradient backward), at the
link's speed. It holds the params it reads (with their gradients), the activations it keeps
for the backward (per microbatch in flight), and a workspace: the most bytes one of its steps
needs at once (the largest of its positions' own). A dynamic program over (stage count, end) finds the cut into exactly K
non-empty stages whose slowest stage is least (PipeDream's partitioner, without replication),
with every stage within the memory limit and every pinned position in its stage. It is optimal
for this cost model; tests check it against brute force.

Stage tables are (n+1) x (n+1) arrays indexed [a, b]. A value adds to a rectangle of them,
kept as a 2-D difference array, so building every table costs O(n^2 + reads).
"""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Problem:
    work: list                 # seconds of compute per position (forward and its backward)
    values: list               # (made at, sorted reader positions, bytes); made at -1: a param
    kept: list                 # bytes each position keeps for the backward
    seconds_per_byte: float    # the link between devices
    pins: list = field(default_factory=list)   # stage index or None per position (empty: none)
    workspace: list = field(default_factory=list)   # bytes per position (empty: none)

    @property
    def n(self):
        return len(self.work)


class Infeasible(Exception):
    """No cut into K stages meets the memory limit and the pins."""


def _read_in(table, made, readers, weight):
    """Add `weight` to [a, b] wherever a stage [a, b) reads a value made before a."""
    lo = made
    for r in readers:
        # for a in (lo, r] the first reader at or after a is r: the stage reads it when b > r
        table[lo + 1, r + 1] += weight
        table[r + 1, r + 1] -= weight
        lo = r


def _sent_out(table, made, readers, weight):
    """Add `weight` to [a, b] wherever a stage [a, b) makes a value a later stage reads."""
    last = readers[-1]
    if last <= made:
        return
    # a <= made < b <= last
    table[0, made + 1] += weight
    table[made + 1, made + 1] -= weight
    table[0, last + 1] -= weight
    table[made + 1, last + 1] += weight


def stage_tables(problem):
    """seconds[a, b], kept[a, b], params[a, b] (bytes, with their gradients) and workspace[a, b]
    of a stage holding positions a..b-1 (a < b)."""
    n = problem.n
    diff_bytes = np.zeros((n + 2, n + 2))   # activation bytes in and out
    diff_params = np.zeros((n + 2, n + 2))  # param bytes read
    for made, readers, nbytes in problem.values:
        if not readers:
            continue
        if made < 0:
            _read_in(diff_params, -1, readers, nbytes)
        else:
            _read_in(diff_bytes, made, readers, nbytes)
            _sent_out(diff_bytes, made, readers, nbytes)
    moved = diff_bytes.cumsum(0).cumsum(1)[:n + 1, :n + 1]
    params = diff_params.cumsum(0).cumsum(1)[:n + 1, :n + 1]
    work = np.concatenate([[0.0], np.cumsum(problem.work)])
    kept = np.concatenate([[0.0], np.cumsum(problem.kept)])
    seconds = work[None, :] - work[:, None] + 2 * problem.seconds_per_byte * moved
    own = np.asarray(problem.workspace or [0.0] * n, dtype=float)
    workspace = np.zeros((n + 1, n + 1))
    for a in range(n):   # the largest of positions a..b-1, for every b > a
        workspace[a, a + 1:] = np.maximum.accumulate(own[a:])
    return seconds, kept[None, :] - kept[:, None], 2 * params, workspace


def _pin_ok(problem, K):
    """ok[k][a, b]: every pinned position in [a, b) is pinned to stage k."""
    n = problem.n
    pins = list(problem.pins) or [None] * n
    ok = []
    for k in range(K):
        bad = np.array([p is not None and p != k for p in pins], dtype=np.int64)
        bad_before = np.concatenate([[0], np.cumsum(bad)])
        ok.append(bad_before[None, :] - bad_before[:, None] == 0)
    return ok


def partition(problem, K, memory_limit=np.inf, in_flight=None):
    """Stage starts [0, s_1, ..., s_{K-1}] and the slowest stage's seconds; raises Infeasible.

    in_flight[k]: how many microbatches' kept activations stage k holds at once (the schedule's)."""
    n = problem.n
    if not 1 <= K <= n:
        raise Infeasible(f"{K} stages of {n} positions")
    seconds, memory, pinned = _stage_costs(problem, K, in_flight)
    starts, slowest = _least_largest(K, n, lambda k, b: np.where(
        (memory[k][:b, b] <= memory_limit) & pinned[k][:b, b], seconds[:b, b], np.inf))
    if starts is None:
        raise Infeasible(f"no cut into {K} stages fits {memory_limit} bytes per device with the pins given")
    return starts, slowest


def least_memory(problem, K, in_flight=None):
    """(the least bytes per device any cut into K stages needs under the cost model, the stage that
    needs them in that cut), pins respected; None when no cut keeps the pins."""
    _, memory, pinned = _stage_costs(problem, K, in_flight)
    starts, most = _least_largest(K, problem.n, lambda k, b: np.where(pinned[k][:b, b], memory[k][:b, b], np.inf))
    if starts is None:
        return None
    bounds = starts + [problem.n]
    return int(np.ceil(most)), int(np.argmax([memory[k][bounds[k], bounds[k + 1]] for k in range(K)]))


def _stage_costs(problem, K, in_flight):
    """seconds[a, b] of a stage holding positions a..b-1; memory[k][a, b], its bytes as stage k (which
    holds in_flight[k] microbatches' kept activations); pinned[k][a, b], whether its pins allow it."""
    in_flight = in_flight or [1] * K
    seconds, kept, params, workspace = stage_tables(problem)
    memory = [kept * in_flight[k] + params + workspace for k in range(K)]
    return seconds, memory, _pin_ok(problem, K)


def _least_largest(K, n, cost):
    """The cut of positions 0..n-1 into K non-empty contiguous stages whose largest stage cost is least:
    (starts, that cost), or (None, inf) when every cut has an infinite one. cost(k, b): stage k's cost
    for positions a..b-1, as an array over a = 0..b-1."""
    best = np.full((K + 1, n + 1), np.inf)    # best[k, b]: the least largest cost of k stages over 0..b-1
    start = np.zeros((K + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, K + 1):
        for b in range(k, n + 1):
            largest = np.maximum(best[k - 1, :b], cost(k - 1, b))
            i = int(np.argmin(largest))
            best[k, b], start[k, b] = largest[i], i
    if not np.isfinite(best[K, n]):
        return None, np.inf
    starts, b = [], n
    for k in range(K, 0, -1):
        b = int(start[k, b])
        starts.append(b)
    return starts[::-1], float(best[K, n])
