"""Liveness and buffer assignment of one entry point, and the plan the codegen follows.

An entry's `steps` are node ids in execution order; a node may appear more than once when the
retention plan recomputes it. Each computation of a value that owns a buffer is one tensor with
an inclusive live interval [start, end] over the steps: from the step that writes it to the last
step that reads that computation. Values the entry returns (or writes into a caller's buffer)
are its outputs and get no arena buffer; a view of an arena buffer that is returned keeps that
buffer to the end. In an hvp block the steps from `loop_from` on run once per tangent row, so a
value made before the loop and read inside it lives to the end.

Under a budget that keeping every value does not meet, a scan may keep carry checkpoints instead of
its stacks (passes/scan_checkpoint.py): plan_memory plans the graph both ways and rewrites it when
the checkpoints recompute less, or when only they fit.
"""
import copy

import numpy as np

from gradc.ops import get_op
from gradc.shapes import bind_dims, expr_text
from gradc.runtime import conv_cores
from gradc.runtime.arena import ALIGN_BYTES, layout_by_device

from .analysis import node_flops
from .checkpoint import BudgetError, build_chain, plan_retention
from .entries import by_fname, entries
from .in_place import share_in_place
from .part_runs import extend_over_runs, part_runs
from .scan_checkpoint import checkpoint_scans, pairs
from .schedule import memory_order
from .stage_split import made_forward
from .storage import base, buffer_bytes, in_arena, owns_buffer


def liveness(graph, steps, returned, loop_from=None):
    """(tensors, in_place): tensors [{"node", "start", "end", "recomputed", "retained"}] in the order the
    steps create them, `retained`: a forward value the backward reads; in_place: the (operand's step,
    reader's step) pairs whose elementwise reader writes over its operand (passes/in_place.py), one
    tensor for both (its "over": the operands' nodes)."""
    current = {}   # value -> index of the tensor holding its latest computation
    tensors, computed, reads = [], set(), {}   # reads: tensor -> the (step, operand) pairs reading it
    last_step = {}  # value -> the step of its latest computation
    for t, n in enumerate(steps):
        last_step[n] = t
        backward = graph.node(n)["phase"] != "forward"
        for u in graph.operands(n):
            i = current.get(u)
            if i is not None:
                reads.setdefault(i, []).append((t, u))
                tensors[i]["end"] = max(tensors[i]["end"], t)
                # (a forward scan's stacks, which autodiff projects for the backward, are the forward's: trial R
                # saw an RNN's kept states called temporary, and "kept for the backward" leave them out)
                tensors[i]["retained"] |= backward and made_forward(graph, tensors[i]["node"])
        if base(graph, n) != n:
            i = current.get(graph.operands(n)[0])
            if i is not None:
                current[n] = i
        elif in_arena(graph, n) and n not in returned:
            current[n] = len(tensors)
            # a multi-result op's statement (a scan's) writes its results (kind "project"): their
            # buffers are live from its step on
            start = last_step[graph.operands(n)[0]] if get_op(graph.op(n)).kind == "project" else t
            tensors.append({"node": n, "start": start, "made": t, "end": t, "recomputed": n in computed,
                            "retained": False})
        computed.add(n)
    last = len(steps) - 1
    for r in returned:
        i = current.get(r)
        if i is not None:
            tensors[i]["end"] = last
    if loop_from is not None:
        for tensor in tensors:
            if tensor["start"] < loop_from <= tensor["end"]:
                tensor["end"] = last
    return share_in_place(graph, steps, tensors, reads, returned, loop_from)


# the sizes an unbound dim is given when part runs are checked against the peak: the bytes of a value
# grow with the batch, a param's do not, so a run that fits one batch size may not fit another
UNBOUND_SIZES = (1, 8, 64, 512, 4096)


def keeps_the_peak(graph, steps, tensors, dims):
    """fits(first, last, nodes) for part_runs: whether a run of `nodes` over steps first..last, every
    value it touches kept live over all of it, stays within the peak of live bytes `tensors` give, at
    `dims` and each of UNBOUND_SIZES for a dim they leave unbound. A run that would raise it is cut
    there: the arena's peak is what it would be without runs (an inference chain keeps two layers'
    values, not every value of the run). The live bytes are counted on the first call (most entries
    never ask)."""
    held = {}   # value -> the tensors holding it (an in-place reader's holds its operands' too: passes/in_place.py)
    for t in tensors:
        for v in [t["node"], *t.get("over", ())]:
            held.setdefault(v, []).append(t)
    profiles = []   # (bytes of each value, live bytes per step, peak), at each size

    def count():
        unbound = {d for n in held for d in graph.shape(n) if isinstance(d, str)} - set(dims)
        for guess in UNBOUND_SIZES if unbound else (None,):
            filled = dict(dims, **{d: guess for d in unbound})
            size_of = {n: buffer_bytes(graph, n, filled) for n in held}
            live = np.zeros(max(len(steps), 1), dtype=np.int64)
            for t in tensors:
                live[t["start"]:t["end"] + 1] += size_of[t["node"]]
            profiles.append((size_of, live, live.max()))

    run = {"first": None, "nodes": []}   # what the last call's run touched: part_runs grows a run a node a call

    def fits(first, last, nodes):
        if not profiles:
            count()
        if run["first"] != first or nodes[:len(run["nodes"])] != run["nodes"]:
            run.update(first=first, nodes=[], touched=set(), counted=set(), start=[], end=[],
                       sizes=[[] for _ in profiles])
        for n in nodes[len(run["nodes"]):]:
            for u in {base(graph, v) for v in list(graph.operands(n)) + [n]} - run["touched"]:
                run["touched"].add(u)
                for t in held.get(u, ()):
                    if id(t) in run["counted"]:   # (one buffer for an operand and its in-place reader)
                        continue
                    run["counted"].add(id(t))
                    run["start"].append(t["start"])
                    run["end"].append(t["end"])
                    for sizes, (size_of, _, _) in zip(run["sizes"], profiles):
                        sizes.append(size_of[t["node"]])
        run["nodes"] = list(nodes)
        start, end = np.array(run["start"], dtype=np.int64), np.array(run["end"], dtype=np.int64)
        kept = (start <= last) & (end >= first)   # each kept over first..last, not only over its own steps
        before, after = start[kept] - first, end[kept] + 1 - first   # (before > 0: steps 0..before-1 gain it)
        for sizes, (_, live, peak) in zip(run["sizes"], profiles):
            size = np.array(sizes, dtype=np.int64)[kept]
            change = np.zeros(last - first + 2, dtype=np.int64)   # the extra bytes' steps, as a difference
            change[0] += size[before > 0].sum()
            np.add.at(change, before[before > 0], -size[before > 0])
            np.add.at(change, np.minimum(after, last - first + 1), size)
            if (live[first:last + 1] + np.cumsum(change)[:-1]).max() > peak:
                return False
        return True
    return fits


def live_bytes(tensors, steps):
    """Bytes live at each step."""
    live = np.zeros(max(len(steps), 1), dtype=np.int64)
    for t in tensors:
        live[t["start"]:t["end"] + 1] += t["bytes"]
    return live


def step_floor(graph, steps, tensors):
    """The most bytes one step needs at once: its output and the buffers it reads. No plan of these
    steps, with any recomputation, can have a smaller peak."""
    made = {t.get("made", t["start"]): t for t in tensors}
    # (an in-place reader's tensor is its operands' buffer: reading them counts it, writing it adds nothing)
    owner_bytes = {v: t["bytes"] for t in tensors for v in [t["node"], *t.get("over", ())]}
    floor = 0
    for t, n in enumerate(steps):
        reads = {base(graph, u) for u in graph.operands(n)}
        need = sum(owner_bytes.get(u, 0) for u in reads) + (made[t]["bytes"] if t in made else 0)
        floor = max(floor, need)
    return floor


def peak_bytes(graph, steps, returned, dims):
    """The true peak of `steps` (what the arena cannot go below; part runs never raise it)."""
    tensors, _ = liveness(graph, steps, set(returned))
    for t in tensors:
        t["bytes"] = buffer_bytes(graph, t["node"], dims)
    return int(live_bytes(tensors, steps).max())


def workspace_bytes(graph, steps, dims, runs=()):
    """The most bytes the CPU kernels of `steps` allocate for themselves at once (a convolution's
    im2col tile: the op record's `workspace`), outside the arena; None when a dim is unbound. A part
    run's parts may each be in a different kernel, and each holds its own buffers for the values the
    run sums: it counts its largest kernel's workspace at the run's parts, plus those buffers. The int
    values' buffers (storage.in_arena) come on top, all of them (each lives until the call returns)."""
    in_run = {t: run for run in runs for t in range(run["first"], run["last"] + 1)}
    parts = {}
    for run in runs:
        n_img = run["dim"] if isinstance(run["dim"], int) else dims.get(run["dim"])
        if not isinstance(n_img, int):
            return None
        parts[run["first"]] = conv_cores.planned_parts(n_img, run["image_work"] * n_img, conv_cores.cores())
    most, per_run = 0, {}
    for t, n in enumerate(steps):
        rule = get_op(graph.op(n)).workspace
        if rule is None or not graph.node(n)["device"].startswith("cpu"):
            continue
        run = in_run.get(t)
        b = rule(graph, n, dims) if run is None else rule(graph, n, dims, parts=parts[run["first"]])
        if b is None:
            return None
        most = max(most, b)
        if run is not None:
            per_run[run["first"]] = max(per_run.get(run["first"], 0), b)
    for run in runs:
        sums = sum(buffer_bytes(graph, n, dims) for n in run["summed"])
        most = max(most, per_run.get(run["first"], 0) + (parts[run["first"]] - 1) * sums)
    ints = sum(buffer_bytes(graph, n, dims) for n in set(steps) if owns_buffer(graph, n) and not in_arena(graph, n))
    return most + ints if isinstance(ints, int) else None


def arena_total(plan):
    """The bytes of a plan's arena over all devices: what the module allocates for the entry."""
    return sum(plan["arena_bytes"].values())


def fits_budget(plan, budget):
    """Whether a plan's arena and workspace fit `budget` bytes."""
    return arena_total(plan) + (plan["workspace_bytes"] or 0) <= budget


def _layout(tensors, itemsize):
    """Offsets (bytes) of `tensors` (with "bytes", "start", "end", "device") in one arena region per
    device, and each region's bytes."""
    offsets, regions = layout_by_device([t["bytes"] // itemsize for t in tensors],
                                        [(t["start"], t["end"]) for t in tensors],
                                        [t["device"] for t in tensors], max(1, ALIGN_BYTES // itemsize))
    return [o * itemsize for o in offsets], {d: r * itemsize for d, r in regions.items()}


def arena_bytes(graph, steps, returned, dims):
    """The bytes `steps` lay out to in the arena (all devices), without part runs."""
    tensors, _ = liveness(graph, steps, set(returned))
    for t in tensors:
        t["bytes"] = buffer_bytes(graph, t["node"], dims)
        t["device"] = graph.node(t["node"])["device"]
    itemsize = np.dtype(graph.dtype(tensors[0]["node"])).itemsize if tensors else 1
    return sum(_layout(tensors, itemsize)[1].values())


def plan_entry(graph, entry, steps, returned, dims, loop_from=None, with_runs=True):
    """The plan of one entry point: its steps, tensors with offsets, peak and arena bytes (per
    device: each node's buffer lives on its device, in that device's region), and its part runs
    (passes/part_runs.py; none without `with_runs`, or in an hvp block's loop).

    With a symbolic dim left unbound, byte counts are expressions (strings) and offsets are laid
    out by the module on its first call with each shape."""
    tensors, in_place = liveness(graph, steps, set(returned), loop_from)
    runs = []
    if with_runs and loop_from is None:
        runs = part_runs(graph, steps, dims, keeps_the_peak(graph, steps, tensors, dims))
        extend_over_runs(graph, tensors, runs)
    dtypes = {graph.dtype(t["node"]) for t in tensors}
    if len(dtypes) > 1:
        raise AssertionError(f"{entry}: buffers of several dtypes {dtypes}; the arena holds one")
    for t in tensors:
        n = t["node"]
        t["bytes"] = buffer_bytes(graph, n, dims)
        t["shape"] = bind_dims(graph.shape(n), dims)
        t["device"] = graph.node(n)["device"]
    devices = sorted({graph.node(n)["device"] for n in steps})
    plan = {"entry": entry, "steps": list(steps), "tensors": tensors, "loop_from": loop_from, "part_runs": runs,
            "in_place": in_place}
    if all(isinstance(t["bytes"], int) for t in tensors):
        itemsize = np.dtype(dtypes.pop()).itemsize if dtypes else 1
        offsets, regions = _layout(tensors, itemsize)
        for t, o in zip(tensors, offsets):
            t["offset"] = o
        live = live_bytes(tensors, steps)
        plan["lower_bound_bytes"] = step_floor(graph, steps, tensors)
        plan["live_bytes"] = live.tolist()
        plan["workspace_bytes"] = workspace_bytes(graph, steps, dims, runs)
        plan["peak_bytes"] = int(live.max())
        plan["peak_step"] = int(live.argmax())
        plan["arena_bytes"] = {d: regions.get(d, 0) for d in devices}
    else:
        for t in tensors:
            t["offset"] = None
            t["bytes"] = expr_text(t["bytes"])
        plan["live_bytes"] = plan["workspace_bytes"] = None
        plan["peak_bytes"] = plan["peak_step"] = plan["lower_bound_bytes"] = None
        plan["arena_bytes"] = {d: None for d in devices}
    return plan


def entry_roots(graph, order):
    """The compiled entry points of a build (passes/entries.py) and the values each returns."""
    return {e.fname: [r for r in e.roots(graph) if r is not None] for e in entries(graph, order)}


def store_all_steps(graph, roots, sizes):
    return memory_order(graph, graph.ancestors(roots), keep=roots, sizes=sizes)


def hvp_steps(graph, roots, sizes):
    """The hvp block's steps: what does not depend on the tangents once, then (from loop_from) the rest."""
    nodes = graph.ancestors(roots)
    varying = set(graph.tangents.values())
    for n in graph.topo_order(nodes):
        if any(u in varying for u in graph.operands(n)):
            varying.add(n)
    fixed = memory_order(graph, nodes - varying, keep=roots, sizes=sizes)
    return fixed + memory_order(graph, nodes & varying, keep=roots, sizes=sizes), len(fixed)


def representative_sizes(graph, dims, guess=64):
    """Bytes per node for ordering decisions: unbound dims count as `guess`."""
    declared = {d for n in graph.nx.nodes for d in graph.shape(n) if isinstance(d, str)}
    filled = {d: dims.get(d, guess) for d in declared} | dict(dims)
    return {n: buffer_bytes(graph, n, filled) for n in graph.nx.nodes}


def plan_memory(graph, dims, order, budget=None):
    """Plans of every entry point (fname -> plan). Under a `budget` (bytes, with every dim bound)
    loss_and_grad keeps or recomputes activations (passes/checkpoint.py), and its scans may keep
    carry checkpoints (rewriting `graph`); raises BudgetError when the budget is below what any plan
    needs. Other entry points keep every value they need."""
    try:
        plans, refusal = _plan_entries(graph, dims, order, budget), None
    except BudgetError as e:
        plans, refusal = None, e
    fits_as_is = plans is not None and plans["_loss_and_grad"]["method"] == "store-all"
    budgeted = graph.ancestors(entry_roots(graph, order)["_loss_and_grad"]) if budget is not None else set()
    if budget is None or fits_as_is or not pairs(graph, budgeted):
        if refusal:
            raise refusal
        return plans
    trial = copy.deepcopy(graph)
    done = checkpoint_scans(trial, dims, budgeted)
    try:
        tried = _plan_entries(trial, dims, order, budget) if done else None
    except BudgetError as e:
        if refusal:
            raise BudgetError(min(refusal.minimum, e.minimum), refusal.store_all, refusal.workspace,
                              refusal.store_all_peak) from None
        tried = None
    extra = _checkpoint_flops(done, tried["_loss_and_grad"]) if tried else 0
    if tried is None or (plans is not None and plans["_loss_and_grad"]["recompute_flops"]
                         <= tried["_loss_and_grad"]["recompute_flops"] + extra):
        if refusal:
            raise refusal
        return plans
    store_all = refusal.store_all_peak if refusal else plans["_loss_and_grad"]["store_all_peak_bytes"]
    graph.__dict__.update(trial.__dict__)   # the build goes on with the rewritten graph (same node ids as the plans)
    plans = tried
    plan = plans["_loss_and_grad"]
    plan.update(recompute_flops=plan["recompute_flops"] + extra, scan_checkpoints=done, store_all_peak_bytes=store_all,
                method=f"{plan['method']} + carry checkpoints in {len(done)} scan(s)")
    return plans


def _checkpoint_flops(done, plan):
    """The FLOPs the plan's backward scans spend recomputing carries."""
    ran = set(plan["steps"])
    return sum(d["recompute_flops"] for d in done if d["backward"] in ran)


def _plan_entries(graph, dims, order, budget):
    sizes = representative_sizes(graph, dims)
    plans = {}
    for fname, roots in entry_roots(graph, order).items():
        entry, loop_from = by_fname(fname), None
        if entry.tangent_rows:
            steps, loop_from = hvp_steps(graph, roots, sizes)
        else:
            steps = store_all_steps(graph, roots, sizes)
        plan = plan_entry(graph, fname, steps, roots, dims, loop_from)
        if entry.budgeted:
            if budget is not None and not fits_budget(plan, budget):   # part runs go before any value is recomputed
                plan = plan_entry(graph, fname, steps, roots, dims, loop_from, with_runs=False)
            plan.update(store_all_peak_bytes=plan["peak_bytes"], budget_bytes=budget, recompute_flops=0,
                        method="store-all")
            # the kernels' own workspace comes out of the budget before any activation is kept
            room = None if budget is None else budget - (plan["workspace_bytes"] or 0)
            if room is not None and room < arena_total(plan):
                work = plan["workspace_bytes"] or 0
                try:
                    plan = _within_budget(graph, steps, roots, dims, sizes, room, plan, budget)
                except BudgetError as e:
                    raise BudgetError(e.minimum + work, e.store_all + work, work, e.store_all_peak) from None
                plan["budget_bytes"] = budget
        plan["roots"] = roots
        plans[fname] = plan
    return plans


def _within_budget(graph, order, roots, dims, sizes, budget, store_all, total):
    """The least-recompute plan whose arena fits `budget`: the chain DP, and on a graph with skips
    also the MILP over its coarse DAG; the better of the two, or BudgetError when neither fits.
    A plan is measured by its live bytes' peak, and where that fits, by the arena its buffers lay
    out to (which can be larger: gaps between buffers). Its part runs stay where it fits `total`
    (the budget with the workspace) with them."""
    work = {}
    flops_of = lambda n: work[n] if n in work else work.setdefault(n, node_flops(graph, n, dims))
    peaks = {}   # steps -> their live peak, of the chain DP's plans measured

    def peak_of(s, returned=roots):
        return _measure(s, returned)[0]

    def dp_peak_of(s, returned=roots):
        value, live = _measure(s, returned)
        peaks[tuple(s)] = live
        return value

    def _measure(s, returned):
        live = peak_bytes(graph, s, returned, dims)
        return (live if live > budget else arena_bytes(graph, s, returned, dims)), live

    extra_work = lambda s: sum(map(flops_of, s)) - sum(map(flops_of, set(s)))
    chain = build_chain(graph, order, sizes, flops_of, roots)
    candidates, refusal = [], None
    try:
        steps, info = plan_retention(graph, chain, order, budget, dp_peak_of, arena_total(store_all))
        info["method"] = f"dp-chain over {info['layers']} layers (Revolve-style, heterogeneous)"
        candidates.append((extra_work(steps), peak_of(steps), steps, info))
    except BudgetError as e:
        refusal = e
    milp_info = milp_least = None
    if chain.skips:
        # imported here: scipy.optimize takes ~0.5 s to import, and only a --memory-budget build needs it
        from . import checkmate
        steps, milp_info, milp_least = checkmate.plan(graph, order, sizes, flops_of, budget, peak_of, roots)
        if steps is not None:
            gap = milp_info["gap"]
            milp_info["method"] = (f"checkmate-milp over {milp_info['coarse_nodes']} coarse nodes "
                                   f"({milp_info['status']}, gap {100 * gap:.1f}%)")
            candidates.append((extra_work(steps), peak_of(steps), steps, milp_info))
    if not candidates:
        # the least a budget can be and compile: the least arena of the chain DP's plans (before refusing it
        # measures each of its schedules), of the MILP's plan of least memory (a U-Net's long skips leave the
        # chain few layers to cut), or keeping every activation, whichever is least
        least = [arena_total(store_all), _least_arena(graph, peaks, roots, dims) if peaks else refusal.minimum]
        if milp_least is not None:
            least.append(arena_bytes(graph, milp_least, roots, dims))
        raise BudgetError(min(least), arena_total(store_all), store_all_peak=store_all["peak_bytes"])
    _, _, steps, chosen = min(candidates, key=lambda c: c[:2])
    info = dict(chosen, candidates=[{"method": c[3]["method"], "extra_flops": int(c[0]), "peak_bytes": int(c[1])}
                                    for c in candidates])
    if milp_info is not None and chosen is not milp_info:
        info["milp"] = milp_info   # what the MILP did (no plan in time, or a worse one): the DP is the fallback
    plan = plan_entry(graph, "_loss_and_grad", steps, roots, dims)
    if not fits_budget(plan, total):
        plan = plan_entry(graph, "_loss_and_grad", steps, roots, dims, with_runs=False)
    # every computation the schedule runs again (a scan's values are its scan_out nodes, of no FLOPs
    # of their own: counting the recomputed values left out a second run of the scan)
    recompute = extra_work(steps)
    plan.update(store_all_peak_bytes=store_all["peak_bytes"], budget_bytes=budget, recompute_flops=int(recompute),
                method=info["method"], retention=info,
                lower_bound_bytes=min(store_all["lower_bound_bytes"], plan["lower_bound_bytes"]),
                store_all_live_bytes=store_all["live_bytes"])
    return plan


def _least_arena(graph, peaks, roots, dims):
    """The least arena among the chain DP's plans measured ({steps: live peak}): a plan of a lower live peak
    can lay out to a larger arena (gaps), so each is laid out in the order of its peak until the peaks alone
    reach the least arena found."""
    best = None
    for steps, live in sorted(peaks.items(), key=lambda kv: kv[1]):
        if best is not None and live >= best:
            break
        arena = arena_bytes(graph, list(steps), roots, dims)
        best = arena if best is None else min(best, arena)
    return best


def _entry_document(graph, plan, name=None):
    tensors = [{"node": t["node"], "op": graph.op(t["node"]), "shape": [str(d) if isinstance(d, str) else d for d in t["shape"]],
                "bytes": t["bytes"], "start": t["start"], "end": t["end"], "device": t["device"], "offset": t["offset"],
                "retained": t["retained"] and not t["recomputed"], "recomputed": t["recomputed"], "src": graph.node(t["node"])["src"]}
               for t in plan["tensors"]]
    for doc_t, t in zip(tensors, plan["tensors"]):
        if t.get("over"):   # the operands an elementwise step wrote over: their buffer is this one
            doc_t["over"] = list(t["over"])
    doc = {"entry": name or by_fname(plan["entry"]).public, "schedule": plan["steps"], "peak_bytes": plan["peak_bytes"],
           "peak_step": plan["peak_step"], "store_all_peak_bytes": plan.get("store_all_peak_bytes", plan["peak_bytes"]),
           "lower_bound_bytes": plan.get("lower_bound_bytes"), "budget_bytes": plan.get("budget_bytes"),
           "recompute_flops": plan.get("recompute_flops", 0), "method": plan.get("method", "store-all"),
           "arena_bytes": plan["arena_bytes"], "workspace_bytes": plan.get("workspace_bytes"),
           "live_bytes": plan["live_bytes"], "tensors": tensors}
    if plan["loop_from"] is not None:
        doc["loop_from"] = plan["loop_from"]
    if plan.get("in_place"):   # (operand's step, reader's step): the reader wrote over the operand (passes/in_place.py)
        doc["in_place"] = [list(pair) for pair in plan["in_place"]]
    if plan.get("part_runs"):   # steps run over parts of the batch at once (passes/part_runs.py)
        doc["part_runs"] = [{"first": r["first"], "last": r["last"], "nodes": r["nodes"], "summed": r["summed"]}
                            for r in plan["part_runs"]]
    if "scan_checkpoints" in plan:
        doc["scan_checkpoints"] = plan["scan_checkpoints"]
    if "store_all_live_bytes" in plan:
        doc["store_all_live_bytes"] = plan["store_all_live_bytes"]
        doc["retention"] = plan["retention"]
    return doc


def memplan_document(graph, plans):
    """NAME.memplan.json: the loss_and_grad plan at the top (DESIGN.md §1.5), every entry under "entries"
    (Trainer.step runs loss_and_grad into its own flat buffers, then an update that allocates nothing)."""
    doc = _entry_document(graph, plans["_loss_and_grad"])
    doc["entries"] = {by_fname(f).public: _entry_document(graph, p) for f, p in plans.items()}
    doc["entries"]["Trainer.step"] = dict(doc["entries"]["loss_and_grad"], entry="Trainer.step")
    return doc


def stage_documents(graph, plans, pipeline):
    """NAME.memplan.json's "stages" of a pipeline build: each stage's forward and backward plans, and
    what it holds for a step's activations under --memory-budget (passes/stage_retention.py)."""
    out = []
    for k in range(pipeline["stages"]):
        doc = {"stage": k}
        for f in pipeline["functions"]:
            if f["stage"] == k:
                entry = doc["forward" if f["kind"] == "F" else "backward"] = _entry_document(graph, plans[f["fname"]],
                                                                                            f["fname"])
                for t in entry["tensors"] if f["kind"] == "B" else ():   # a forward value the backward makes again
                    if made_forward(graph, t["node"]):
                        t.update(recomputed=True, retained=False)
        if pipeline.get("retention"):
            doc["retention"] = {key: v for key, v in pipeline["retention"][k].items() if key != "stage"}
        out.append(doc)
    return out


def summary(doc):
    """MEMORY_PLAN in the module: the numbers of the plan, without the per-tensor tables."""
    keys = ("entry", "peak_bytes", "store_all_peak_bytes", "lower_bound_bytes", "budget_bytes", "recompute_flops",
            "method", "arena_bytes", "workspace_bytes")   # (a budget counts the arena and the workspace: trial Y)
    out = {k: doc[k] for k in keys}
    out["retained"] = sorted({t["node"] for t in doc["tensors"] if t["retained"]})
    out["recomputed"] = sorted({t["node"] for t in doc["tensors"] if t["recomputed"]})
    out["entries"] = {e: {k: d[k] for k in ("peak_bytes", "arena_bytes")} for e, d in doc["entries"].items()}
    return out
