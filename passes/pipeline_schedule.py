"""Pipeline schedules timed under the cost model (the orders are gradc/runtime/schedules.py).

Timing is an event simulation: an op starts when its stage is free and its input has arrived
(the previous stage's forward, or the next stage's backward, plus the transfer). With equal
stages and no transfer time, GPipe and 1F1B idle a share (K-1)/(M+K-1) of the time (the bubble).
"""

from gradc.runtime.schedules import interleave


def simulate(schedule, forward, backward, transfer, M):
    """Rows {"stage", "op", "microbatch", "start", "end"} in start order, and the makespan.

    forward[k], backward[k]: seconds of one microbatch's forward / backward on stage k;
    transfer[k]: seconds to send one microbatch's boundary values from stage k to k+1 (and its
    gradients back). Ops are taken in `interleave`'s order, which respects every dependency."""
    K = len(forward)
    done, rows, free = {}, [], [0.0] * K
    for k, op, m in interleave(schedule, K, M):
        if op == "F":
            arrival = 0.0 if k == 0 else done[("F", k - 1, m)] + transfer[k - 1]
        else:
            arrival = done[("F", k, m)] if k == K - 1 else done[("B", k + 1, m)] + transfer[k]
        start = max(free[k], arrival)
        end = start + (forward[k] if op == "F" else backward[k])
        done[(op, k, m)] = free[k] = end
        rows.append({"stage": k, "op": op, "microbatch": m, "start": start, "end": end})
    rows.sort(key=lambda r: (r["start"], r["stage"]))
    return rows, max(free)


def bubble(rows, K, makespan):
    """The share of stage-time spent idle."""
    busy = sum(r["end"] - r["start"] for r in rows)
    return 1.0 - busy / (K * makespan) if makespan > 0 else 0.0
