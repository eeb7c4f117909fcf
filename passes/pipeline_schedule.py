"""Pipeline schedules timed under the cost model (the orders are gradc/runtime/schedules.py).

Timing is an event simulation: an op starts when its stage is free and its input has arrived
(the previous stage's forward, or the next stage's backward, plus the transfer). With equal
stages and no transfer time, GPipe and 1F1B idle a share (K-1)/(M+K-1) of the time (the bubble).
"""

from gradc.runtime.schedules import SCHEDULES, in_flight, ready, stage_orders  # noqa: F401 (re-exported)


def simulate(schedule, forward, backward, transfer, M):
    """Rows {"stage", "op", "microbatch", "start", "end"} in start order, and the makespan.

    forward[k], backward[k]: seconds of one microbatch's forward / backward on stage k;
    transfer[k]: seconds to send one microbatch's boundary values from stage k to k+1 (and its
    gradients back)."""
    K = len(forward)
    orders = stage_orders(schedule, K, M)
    done, rows = {}, []
    free = [0.0] * K
    position = [0] * K
    if schedule == "sequential":   # one microbatch at a time through the whole pipeline
        t = 0.0
        for m in range(M):
            for op, stages in (("F", range(K)), ("B", range(K - 1, -1, -1))):
                for k in stages:
                    seconds = forward[k] if op == "F" else backward[k]
                    rows.append({"stage": k, "op": op, "microbatch": m, "start": t, "end": t + seconds})
                    t += seconds
                    if op == "F" and k < K - 1:
                        t += transfer[k]
                    elif op == "B" and k > 0:
                        t += transfer[k - 1]
        return rows, t
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(K):
            if position[k] == len(orders[k]):
                continue
            op, m = orders[k][position[k]]
            if op == "F":
                need = None if k == 0 else ("F", k - 1, m)
                arrival = 0.0 if need is None else done.get(need)
                arrival = arrival if need is None or arrival is None else arrival + transfer[k - 1]
            else:
                need = ("F", k, m) if k == K - 1 else ("B", k + 1, m)
                arrival = done.get(need)
                if arrival is not None and k < K - 1:
                    arrival += transfer[k]
            if arrival is None or ("F", k, m) not in done and op == "B":
                continue
            start = max(free[k], arrival)
            end = start + (forward[k] if op == "F" else backward[k])
            done[(op, k, m)] = free[k] = end
            rows.append({"stage": k, "op": op, "microbatch": m, "start": start, "end": end})
            position[k] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise AssertionError(f"{schedule}: the stage orders deadlock")
    rows.sort(key=lambda r: (r["start"], r["stage"]))
    return rows, max(free)


def bubble(rows, K, makespan):
    """The share of stage-time spent idle."""
    busy = sum(r["end"] - r["start"] for r in rows)
    return 1.0 - busy / (K * makespan) if makespan > 0 else 0.0
