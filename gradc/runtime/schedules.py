"""The order each pipeline stage runs its microbatches' forwards ("F") and backwards ("B") in.

  sequential  one microbatch at a time through every stage and back (no overlap)
  gpipe       every forward, then every backward (GPipe); stage k holds M microbatches' activations
  1f1b        stage k runs min(K-k, M) forwards, then alternates one backward and one forward, then
              the remaining backwards (PipeDream-Flush); it holds at most K-k microbatches

Shared by the compiler (its cost-model timeline) and the generated module (its executor).
"""

SCHEDULES = ("sequential", "gpipe", "1f1b")


def stage_orders(schedule, K, M):
    """Per stage, the ops ("F"|"B", microbatch) in the order that stage runs them."""
    if schedule == "sequential":
        return [[(op, m) for m in range(M) for op in ("F", "B")] for _ in range(K)]
    if schedule == "gpipe":
        return [[("F", m) for m in range(M)] + [("B", m) for m in range(M)] for _ in range(K)]
    if schedule == "1f1b":
        orders = []
        for k in range(K):
            warm = min(K - k, M)
            ops = [("F", m) for m in range(warm)]
            for m in range(M - warm):
                ops += [("B", m), ("F", warm + m)]
            ops += [("B", m) for m in range(M - warm, M)]
            orders.append(ops)
        return orders
    raise ValueError(f"unknown schedule {schedule!r} (use {', '.join(SCHEDULES)})")


def in_flight(schedule, K, M):
    """Most microbatches whose activations stage k holds at once."""
    if schedule == "sequential":
        return [1] * K
    if schedule == "gpipe":
        return [M] * K
    return [min(K - k, M) for k in range(K)]


def ready(op, k, m, K, done):
    """Whether stage k may run `op` on microbatch m, given the set `done` of (op, stage, m) run so far."""
    if op == "F":
        return k == 0 or ("F", k - 1, m) in done
    return ("F", k, m) in done and (k == K - 1 or ("B", k + 1, m) in done)


def interleave(schedule, K, M):
    """One global order of (stage, op, microbatch) that keeps every stage's order and every dependency
    (what one process running all stages does)."""
    orders = stage_orders(schedule, K, M)
    position, done, out = [0] * K, set(), []
    while len(out) < sum(len(o) for o in orders):
        progressed = False
        for k in range(K):
            if position[k] < len(orders[k]):
                op, m = orders[k][position[k]]
                if ready(op, k, m, K, done):
                    done.add((op, k, m))
                    out.append((k, op, m))
                    position[k] += 1
                    progressed = True
        if not progressed:
            raise AssertionError(f"{schedule}: the stage orders deadlock")
    return out
