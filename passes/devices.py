"""The device plan of `--devices K`: cost model, stages, placement, transfers, pipeline schedule.

The cost model is per forward node: its FLOPs and those of its derivative nodes, the bytes it
reads and writes, and its output bytes (what a transfer moves). Seconds come from nominal rates
(FLOP_RATE, LINK_RATE, recorded in the plan); only their ratio steers the cut. Work is counted for
the whole batch (a step's), bytes held for one microbatch (`memory_dims`: the batch dim bound to
the largest microbatch's rows).
"""
import numpy as np

from gradc.runtime.schedules import in_flight
from gradc.sizes import format_size

from .analysis import node_flops
from .likelihood_ratio import estimate_nodes
from .partition import Infeasible, Problem, least_memory, partition
from .pipeline_schedule import bubble, simulate
from .placement import assign_stages, device_name, home, insert_transfers
from .stage_retention import held_per_microbatch
from .storage import LEAVES, base, buffer_bytes, value_bytes

FLOP_RATE = {"cpu": 20e9, "cuda": 20e12}    # FLOP/s of one device
LINK_RATE = {"cpu": 5e9, "cuda": 25e9}      # bytes/s between two devices
MAX_POSITIONS = 400                         # the DP's tables are positions^2


class DevicePlanError(Exception):
    pass


def node_costs(graph, dims, skip=frozenset()):
    """Per node but those in `skip`: flops, bytes read, bytes written (its output: what a transfer of
    it moves)."""
    out = {}
    for n in graph.nx.nodes:
        if graph.op(n) in LEAVES or n in skip:
            continue
        written = value_bytes(graph, n, dims)
        read = sum(value_bytes(graph, u, dims) for u in set(graph.operands(n)))
        out[n] = {"flops": node_flops(graph, n, dims), "read": read, "written": written}
    return out


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


def _pins_apart(pins, K):
    """Why the pins (a stage or None per position, in the forward's order) leave no cut of K contiguous
    stages: a pin after a later stage's, or stages with fewer positions between their neighbours' pins
    than they are; None when it is neither (the cut fails on other grounds)."""
    last = {}
    for i, k in enumerate(pins):
        if k is None:
            continue
        later = [j for j, s in last.items() if s > k]
        if later:
            return (f"an op pinned to stage {k} comes after one pinned to stage {pins[later[0]]} in the model's "
                    f"order (the order it was written in): stages run in that order, so write stage {k}'s ops first")
        last[i] = k
    placed = [(i, k) for i, k in enumerate(pins) if k is not None]
    pinned = {k for _, k in placed}
    before = lambda k: max((s for s in pinned if s < k), default=-1)   # the pinned stage before stage k
    for k in range(K):   # unpinned stages in a row share the positions between their neighbours' pins
        if k in pinned:
            continue
        below = max((i for i, s in placed if s < k), default=-1)
        above = min((i for i, s in placed if s > k), default=len(pins))
        empty = [j for j in range(K) if j not in pinned and before(j) == before(k)]
        if above - below - 1 < len(empty):
            return (f"stage{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} would hold no op: "
                    f"{above - below - 1} op(s) lie between the ops pinned before and after "
                    f"{'them' if len(empty) > 1 else 'it'}")
    return None


def step_bytes(graph, n, dims):
    """The bytes step n needs at once: its output and the buffers it reads (no arena holding n
    can be smaller)."""
    reads = {base(graph, u) for u in graph.operands(n)}
    return buffer_bytes(graph, n, dims) + sum(buffer_bytes(graph, u, dims) for u in reads if graph.op(u) not in LEAVES)


def plan_devices(graph, order, dims, K, target="cpu", device_memory=None, schedule="sequential", microbatches=1,
                 memory_dims=None):
    """Cut `order`'s forward (loss_and_grad's store-all order) into K stages, place every node,
    add the transfers; returns the PARTITION document. Raises DevicePlanError."""
    memory_dims = memory_dims or dims
    estimate = estimate_nodes(graph)   # lr_grad's: the cut is of the training step
    costs = node_costs(graph, dims, estimate)
    # the cut is of the model's forward; weight decay's ||p||^2 runs wherever its param lands (placement)
    forward = [n for n in order if graph.node(n)["phase"] == "forward" and graph.op(n) not in LEAVES
               and graph.node(n).get("decay_of") is None]
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
    floors = np.zeros(len(groups))   # the largest step of the position's forward or backward
    for n, c in costs.items():
        h = n if n in at else homes.get(n)
        phase = graph.node(n)["phase"]
        if h in at and phase in ("forward", "backward"):
            work[at[h]] += c["flops"]
            floors[at[h]] = max(floors[at[h]], step_bytes(graph, n, memory_dims))
    values, kept = [], np.zeros(len(groups))
    for n in forward:
        readers = set()
        for u in graph.users(n):
            if graph.node(u)["phase"] == "second":   # (hvp's reads: the cut is of the training step)
                continue
            h = u if u in at else homes.get(u)
            if h in at and at[h] != at[n]:
                readers.add(at[h])
        if any(graph.node(u)["phase"] != "forward" for u in graph.users(n)):
            kept[at[n]] += buffer_bytes(graph, n, memory_dims)   # kept for the backward (views hold nothing)
        if readers:
            values.append((at[n], sorted(readers), costs[n]["written"]))
    for p in graph.params.values():
        readers = sorted({at[u] for u in graph.users(p) if u in at})
        if readers:
            values.append((-1, readers, value_bytes(graph, p, dims)))
    rate, link = FLOP_RATE[target], LINK_RATE[target]
    # a stage's arena region is at least as large as its functions' largest step
    problem = Problem((work / rate).tolist(), values, kept.tolist(), 1.0 / link, pins, floors.tolist())
    flight = in_flight(schedule, K, microbatches)
    limit = np.inf if device_memory is None else device_memory
    try:
        starts, slowest = partition(problem, K, limit, flight)
    except Infeasible:
        pinned = [f"{graph.describe(n)} [{graph.node(n)['src']}] -> stage {graph.node(n)['stage']}"
                  for n in forward if graph.node(n).get("stage") is not None]
        apart = _pins_apart(pins, K) if pinned else None
        if apart:
            pinned = [apart] + pinned[:4]
        least = least_memory(problem, K, flight) if device_memory is not None else None
        why = ([f"fits --device-memory {format_size(device_memory)} per device under the {schedule} schedule"]
               if device_memory is not None else []) + (["keeps every pinned op on its stage (" +
                                                         "; ".join(pinned[:4]) + ")"] if pinned else [])
        need = (f": the least any cut needs (by the cost model, an estimate that can be above what the stages' "
                f"plans hold) is {format_size(least[0])} per device (its stage "
                f"{least[1]}: its params and their gradients, the activations it keeps for {max(flight)} "
                f"microbatch(es) in flight, its largest step)") if least else ""
        raise DevicePlanError(f"no cut of the model into {K} contiguous stages " + " and ".join(why) + need) from None
    bounds = starts + [len(groups)]
    stage_of = {n: k for k in range(K) for g in groups[bounds[k]:bounds[k + 1]] for n in g}
    stage = assign_stages(graph, stage_of, K, estimate)
    transfers = insert_transfers(graph, stage, target, K)
    estimate = estimate_nodes(graph)   # with the transfers made for them: the stages list neither
    doc = _document(graph, problem, bounds, stage, [t for t in transfers if t[0] not in estimate], costs, dims,
                    target, K, schedule, microbatches, flight, rate, link, slowest, device_memory, forward, estimate)
    doc["lr_grad_transfers"] = sorted(t[0] for t in transfers if t[0] in estimate)   # copies inside lr_grad
    return doc


def _document(graph, problem, bounds, stage, transfers, costs, dims, target, K, schedule, M, flight, rate, link,
              slowest, device_memory, forward, estimate):
    stages = []
    for k in range(K):
        nodes = [n for n in graph.topo_order() if stage[n] == k and graph.op(n) not in LEAVES and n not in estimate]
        fwd = sum(costs[n]["flops"] for n in nodes if n in costs and graph.node(n)["phase"] == "forward")
        bwd = sum(costs[n]["flops"] for n in nodes if n in costs and graph.node(n)["phase"] == "backward")
        second = sum(costs[n]["flops"] for n in nodes if n in costs and graph.node(n)["phase"] == "second")
        step = [n for n in nodes if graph.node(n)["phase"] != "second"]   # a training step's (hvp's apart)
        a, b = bounds[k], bounds[k + 1]
        kept = float(sum(problem.kept[a:b]))
        params = sorted(name for name, p in graph.params.items() if stage[p] == k)
        param_bytes = sum(value_bytes(graph, graph.params[p], dims) for p in params)
        stages.append({"stage": k, "device": device_name(target, k, K), "nodes": nodes, "params": params,
                       "forward_flops": int(fwd), "backward_flops": int(bwd), "second_order_flops": int(second),
                       "bytes_read": int(sum(costs[n]["read"] for n in step if n in costs)),
                       "bytes_written": int(sum(costs[n]["written"] for n in step if n in costs)),
                       "kept_bytes_per_microbatch": int(kept), "in_flight": flight[k],
                       "workspace_bytes": int(max(problem.workspace[a:b])),
                       "model_memory_bytes": int(kept * flight[k] + 2 * param_bytes + max(problem.workspace[a:b])),
                       "sent_bytes": 0, "received_bytes": 0})
    moves = []
    for t, u, src, dst in transfers:
        nbytes = value_bytes(graph, t, dims)
        carries = graph.node(u)["phase"] if graph.op(u) != "param" else "param"
        if carries != "second":   # a training step's traffic (trial T: hvp's was counted in it)
            stages[src]["sent_bytes"] += nbytes
            stages[dst]["received_bytes"] += nbytes
        moves.append({"node": t, "value": u, "from": device_name(target, src, K), "to": device_name(target, dst, K),
                      "bytes": nbytes, "carries": carries})
    # per microbatch: work over the rate; a boundary moves what crosses it, both ways
    per_mb = 1.0 / M
    fwd_s = [s["forward_flops"] / rate * per_mb for s in stages]
    bwd_s = [s["backward_flops"] / rate * per_mb for s in stages]
    cross = [sum(m["bytes"] for m in moves if m["from"] == stages[k]["device"] and m["to"] == stages[k + 1]["device"]
                 and m["carries"] != "second") / link * per_mb for k in range(K - 1)] + [0.0]
    rows, makespan = simulate(schedule, fwd_s, bwd_s, cross, M)
    return {"stages": K, "target": target, "schedule": schedule, "microbatches": M, "order": forward,
            "cost_model": {"flop_rate": rate, "link_bytes_per_s": link, "slowest_stage_s": slowest},
            "device_memory": device_memory, "stage": stages, "transfers": moves,
            "timeline": rows, "makespan_s": makespan, "bubble": bubble(rows, K, makespan),
            "bubble_formula": (K - 1) / (M + K - 1)}


def stage_memory(graph, doc, functions, plans, dims):
    """What each stage holds by its stage functions' own memory plans, written into `doc`'s stages
    (`memory_bytes`, with its parts): its region of the arena (the larger of its forward's and its
    backward's: they run in turn over one buffer), its params and their gradients, a copy of each
    param of another stage that it reads, and per
    microbatch in flight the forward values its backward reads (its stash, and what came from
    earlier stages). Returns the bytes per stage."""
    held = []
    for st in doc["stage"]:
        k = st["stage"]
        fwd, bwd = (next(f for f in functions if f["stage"] == k and f["kind"] == kind) for kind in "FB")
        arenas = {f["kind"]: sum(plans[f["fname"]]["arena_bytes"].values()) for f in (fwd, bwd)}
        source = {u: graph.operands(u)[0] if graph.op(u) == "transfer" else u for f in (fwd, bwd) for u in f["received"]}
        copies = {u for u, v in source.items() if graph.op(v) == "param"}   # other stages' params: one copy each
        stash = held_per_microbatch(graph, bwd, dims)
        params = 2 * sum(value_bytes(graph, graph.params[p], dims) for p in st["params"]) \
            + sum(value_bytes(graph, u, dims) for u in copies)
        total = max(arenas.values()) + st["in_flight"] * stash + params
        st.update(arena_bytes={"forward": arenas["F"], "backward": arenas["B"]}, stash_bytes_per_microbatch=stash,
                  memory_bytes=int(total))
        held.append(int(total))
    return held
