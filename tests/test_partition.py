"""Device partitioning: the stage DP against brute force, by the same cost model written directly."""
import itertools

import numpy as np
import pytest

from gradc.passes.partition import Infeasible, Problem, least_memory, partition


def _stage_cost(problem, a, b):
    """Seconds and bytes of the stage holding positions a..b-1, straight from the definitions."""
    work = sum(problem.work[a:b])
    moved, params = 0, 0
    for made, readers, nbytes in problem.values:
        reads_here = any(a <= r < b for r in readers)
        if made < 0:
            params += nbytes if reads_here else 0
        elif made < a and reads_here:
            moved += nbytes                     # received
        elif a <= made < b and any(r >= b for r in readers):
            moved += nbytes                     # sent
    workspace = max((problem.workspace or [0] * problem.n)[a:b])
    return work + 2 * problem.seconds_per_byte * moved, sum(problem.kept[a:b]), 2 * params, workspace


def _brute_force(problem, K, limit, in_flight=None):
    in_flight = in_flight or [1] * K
    best = np.inf
    for cuts in itertools.combinations(range(1, problem.n), K - 1):
        starts = [0, *cuts]
        bounds = starts + [problem.n]
        slowest = 0.0
        for k in range(K):
            a, b = bounds[k], bounds[k + 1]
            seconds, kept, params, workspace = _stage_cost(problem, a, b)
            memory = kept * in_flight[k] + params + workspace
            pins = problem.pins or [None] * problem.n
            if memory > limit or any(p is not None and p != k for p in pins[a:b]):
                slowest = np.inf
                break
            slowest = max(slowest, seconds)
        best = min(best, slowest)
    return best


def _random_problem(rng, n):
    values = []
    for p in range(n):
        later = sorted(set(rng.integers(p + 1, n + 1, int(rng.integers(1, 3))).tolist()) - {n})
        if later:
            values.append((p, later, int(rng.integers(1, 50))))
    for _ in range(int(rng.integers(1, 4))):   # params, one maybe shared by several positions
        values.append((-1, sorted(set(rng.integers(0, n, int(rng.integers(1, 3))).tolist())), int(rng.integers(1, 30))))
    pins = [None] * n
    if rng.random() < 0.5:
        p = int(rng.integers(0, n))
        pins[p] = int(rng.integers(0, 3))
    workspace = rng.integers(0, 60, n).tolist() if rng.random() < 0.7 else []
    return Problem(rng.uniform(0.5, 5.0, n).tolist(), values, rng.integers(0, 40, n).tolist(),
                   float(rng.uniform(0.0, 0.2)), pins, workspace)


def _random_cut(seed):
    """A random problem of n positions, a stage count K, a memory limit and each stage's microbatches in flight."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    problem = _random_problem(rng, n)
    K = int(rng.integers(1, min(n, 4) + 1))
    limit = float(rng.choice([np.inf, rng.uniform(20, 200)]))
    return problem, n, K, limit, rng.integers(1, 4, K).tolist()


@pytest.mark.parametrize("seed", range(60))
def test_partition_is_optimal_against_brute_force(seed):
    problem, n, K, limit, in_flight = _random_cut(seed)
    expected = _brute_force(problem, K, limit, in_flight)
    if not np.isfinite(expected):
        with pytest.raises(Infeasible):
            partition(problem, K, limit, in_flight)
        return
    starts, slowest = partition(problem, K, limit, in_flight)
    assert slowest == pytest.approx(expected)
    bounds = starts + [n]
    assert starts[0] == 0 and len(starts) == K and all(a < b for a, b in zip(bounds, bounds[1:]))
    assert max(_stage_cost(problem, a, b)[0] for a, b in zip(bounds, bounds[1:])) == pytest.approx(slowest)


@pytest.mark.parametrize("seed", range(30))
def test_least_memory_is_the_smallest_limit_any_cut_fits(seed):
    """What --device-memory's error names when no cut fits: the least bytes per device, and its stage."""
    problem, n, K, _, in_flight = _random_cut(seed)
    least = least_memory(problem, K, in_flight)
    if least is None:   # the pins admit no cut
        with pytest.raises(Infeasible):
            partition(problem, K, np.inf, in_flight)
        return
    need, stage = least
    starts, _ = partition(problem, K, need, in_flight)
    with pytest.raises(Infeasible):
        partition(problem, K, need - 1, in_flight)
    assert 0 <= stage < K


def test_balanced_chain_splits_evenly():
    problem = Problem([1.0] * 12, [(p, [p + 1], 8) for p in range(11)], [0] * 12, 0.0)
    starts, slowest = partition(problem, 4)
    assert starts == [0, 3, 6, 9] and slowest == 3.0


def test_too_many_stages_or_too_little_memory_is_infeasible():
    problem = Problem([1.0] * 3, [(0, [1], 8), (1, [2], 8)], [10, 10, 10], 0.0)
    with pytest.raises(Infeasible):
        partition(problem, 4)
    with pytest.raises(Infeasible):
        partition(problem, 2, memory_limit=15)
    assert partition(problem, 3, memory_limit=10)[0] == [0, 1, 2]
