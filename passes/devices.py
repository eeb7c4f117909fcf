"""The device plan of `--devices K`: cost model, stages, placement, transfers, pipeline schedule.

The cost model is per forward node: its FLOPs and those of its derivative nodes, the bytes it
reads and writes, and its output bytes (what a transfer moves). Seconds come from nominal rates
(FLOP_RATE, LINK_RATE, recorded in the plan); only their ratio steers the cut.
"""
import numpy as np

from gradc.runtime.schedules import in_flight

from .analysis import node_flops
from .partition import Infeasible, Problem, partition
from .pipeline_schedule import bubble, simulate
from .placement import assign_stages, device_name, home, insert_transfers
from .storage import LEAVES, buffer_bytes

FLOP_RATE = {"cpu": 20e9, "cuda": 20e12}    # FLOP/s of one device
LINK_RATE = {"cpu": 5e9, "cuda": 25e9}      # bytes/s between two devices
MAX_POSITIONS = 400                         # the DP's tables are positions^2


class DevicePlanError(Exception):
    pass


def node_costs(graph, dims):
    """Per node: flops, bytes read, bytes written (its output: what a transfer of it moves)."""
    out = {}
    for n in graph.nx.nodes:
        if graph.op(n) in LEAVES:
            continue
        written = _value_bytes(graph, n, dims)
        read = sum(_value_bytes(graph, u, dims) for u in set(graph.operands(n)))
        out[n] = {"flops": node_flops(graph, n, dims), "read": read, "written": written}
    return out


def _value_bytes(graph, n, dims):
    shape = [dims.get(d, d) if isinstance(d, str) else d for d in graph.shape(n)]
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(graph.dtype(n)).itemsize


def _positions(graph, forward):
    """Consecutive forward nodes grouped into at most MAX_POSITIONS positions; a pin change
    always starts a new one."""
    per = max(1, len(forward) // MAX_POSITIONS)   # so that there are at least min(len, MAX_POSITIONS) groups
    groups, pin_of = [], []
    for n in forward:
        pin = graph.node(n).get("stage")
        if groups and len(groups[-1]) < per and (pin is None or pin_of[-1] in (None, pin)):
            groups[-1].append(n)
            pin_of[-1] = pin if pin is not None else pin_of[-1]
        else:
            groups.append([n])
            pin_of.append(pin)
    return groups, pin_of


def plan_devices(graph, order, dims, K, target="cpu", device_memory=None, schedule="sequential", microbatches=1):
    """Cut `order`'s forward (loss_and_grad's store-all order) into K stages, place every node,
    add the transfers; returns the PARTITION document. Raises DevicePlanError."""
    costs = node_costs(graph, dims)
    forward = [n for n in order if graph.node(n)["phase"] == "forward" and graph.op(n) not in LEAVES]
    if len(forward) < K:
        raise DevicePlanError(f"--devices {K}: the model has {len(forward)} forward ops, fewer than {K} stages")
    for n in forward:
        pin = graph.node(n).get("stage")
        if pin is not None and pin >= K:
            raise DevicePlanError(f"{graph.describe(n)} is pinned to stage {pin} but --devices is {K} "
                                  f"(stages 0..{K - 1}) [{graph.node(n)['src']}]")
    groups, pins = _positions(graph, forward)
    at = {n: i for i, g in enumerate(groups) for n in g}
    homes = {n: home(graph, n) for n in graph.nx.nodes if graph.node(n)["phase"] != "forward"}
    work = np.zeros(len(groups))   # a training step's: the forward and the backward
    for n, c in costs.items():
        h = n if n in at else homes.get(n)
        if h in at and graph.node(n)["phase"] in ("forward", "backward"):
            work[at[h]] += c["flops"]
    values, kept = [], np.zeros(len(groups))
    for n in forward:
        readers = set()
        for u in graph.users(n):
            h = u if u in at else homes.get(u)
            if h in at and at[h] != at[n]:
                readers.add(at[h])
        if any(graph.node(u)["phase"] != "forward" for u in graph.users(n)):
            kept[at[n]] += buffer_bytes(graph, n, dims)   # kept for the backward (views hold nothing)
        if readers:
            values.append((at[n], sorted(readers), costs[n]["written"]))
    for p in graph.params.values():
        readers = sorted({at[u] for u in graph.users(p) if u in at})
        if readers:
            values.append((-1, readers, _value_bytes(graph, p, dims)))
    rate, link = FLOP_RATE[target], LINK_RATE[target]
    problem = Problem((work / rate).tolist(), values, kept.tolist(), 1.0 / link, pins)
    flight = in_flight(schedule, K, microbatches)
    limit = np.inf if device_memory is None else device_memory
    try:
        starts, slowest = partition(problem, K, limit, flight)
    except Infeasible:
        pinned = [f"{graph.describe(n)} [{graph.node(n)['src']}] -> stage {graph.node(n)['stage']}"
                  for n in forward if graph.node(n).get("stage") is not None]
        why = ([f"fits --device-memory {device_memory} bytes per device under the {schedule} schedule"]
               if device_memory is not None else []) + (["keeps every pinned op on its stage (" +
                                                         "; ".join(pinned[:4]) + ")"] if pinned else [])
        raise DevicePlanError(f"no cut of the model into {K} contiguous stages " + " and ".join(why)) from None
    bounds = starts + [len(groups)]
    stage_of = {n: k for k in range(K) for g in groups[bounds[k]:bounds[k + 1]] for n in g}
    stage = assign_stages(graph, stage_of, K)
    transfers = insert_transfers(graph, stage, target, K)
    return _document(graph, problem, bounds, stage, transfers, costs, dims, target, K, schedule, microbatches,
                     flight, rate, link, slowest, device_memory, forward)


def _document(graph, problem, bounds, stage, transfers, costs, dims, target, K, schedule, M, flight, rate, link,
              slowest, device_memory, forward):
    stages = []
    for k in range(K):
        nodes = [n for n in graph.topo_order() if stage[n] == k and graph.op(n) not in LEAVES]
        fwd = sum(costs[n]["flops"] for n in nodes if n in costs and graph.node(n)["phase"] == "forward")
        bwd = sum(costs[n]["flops"] for n in nodes if n in costs and graph.node(n)["phase"] == "backward")
        second = sum(costs[n]["flops"] for n in nodes if n in costs and graph.node(n)["phase"] == "second")
        a, b = bounds[k], bounds[k + 1]
        kept = float(sum(problem.kept[a:b]))
        params = sorted(name for name, p in graph.params.items() if stage[p] == k)
        param_bytes = sum(_value_bytes(graph, graph.params[p], dims) for p in params)
        stages.append({"stage": k, "device": device_name(target, k, K), "nodes": nodes, "params": params,
                       "forward_flops": int(fwd), "backward_flops": int(bwd), "second_order_flops": int(second),
                       "bytes_read": int(sum(costs[n]["read"] for n in nodes if n in costs)),
                       "bytes_written": int(sum(costs[n]["written"] for n in nodes if n in costs)),
                       "kept_bytes_per_microbatch": int(kept), "in_flight": flight[k],
                       "memory_bytes": int(kept * flight[k] + 2 * param_bytes),
                       "sent_bytes": 0, "received_bytes": 0})
    moves = []
    for t, u, src, dst in transfers:
        nbytes = _value_bytes(graph, t, dims)
        stages[src]["sent_bytes"] += nbytes
        stages[dst]["received_bytes"] += nbytes
        carries = graph.node(u)["phase"] if graph.op(u) != "param" else "param"
        moves.append({"node": t, "value": u, "from": device_name(target, src, K), "to": device_name(target, dst, K),
                      "bytes": nbytes, "carries": carries})
    # per microbatch: work over the rate; a boundary moves what crosses it, both ways
    per_mb = 1.0 / M
    fwd_s = [s["forward_flops"] / rate * per_mb for s in stages]
    bwd_s = [s["backward_flops"] / rate * per_mb for s in stages]
    cross = [sum(m["bytes"] for m in moves if m["from"] == stages[k]["device"] and m["to"] == stages[k + 1]["device"])
             / link * per_mb for k in range(K - 1)] + [0.0]
    rows, makespan = simulate(schedule, fwd_s, bwd_s, cross, M)
    return {"stages": K, "target": target, "schedule": schedule, "microbatches": M, "order": forward,
            "cost_model": {"flop_rate": rate, "link_bytes_per_s": link, "slowest_stage_s": slowest},
            "device_memory": device_memory, "stage": stages, "transfers": moves,
            "timeline": rows, "makespan_s": makespan, "bubble": bubble(rows, K, makespan),
            "bubble_formula": (K - 1) / (M + K - 1)}
