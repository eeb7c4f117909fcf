"""`gradc inspect OUT/NAME`: a readable summary of the graph dump `compile` wrote."""
import os
import re
from collections import Counter

from .errors import GradcError
from .files import read_json, write_beside_dumps
from .inspect_kernels import kernel_listing, ptx
from .inspect_layers import layers_report
from .inspect_partition import partition_report
from .sizes import format_size


def _load(build):
    # (build/mlp/, as a shell completes a folder's name, is build/mlp)
    base = re.sub(r"(\.graph\.json|\.py)$", "", build.rstrip(os.sep) or build)
    path = base + ".graph.json"
    if not os.path.isfile(path):
        builds = sorted(os.path.join(build, f[:-len(".graph.json")]) for f in os.listdir(build)
                        if f.endswith(".graph.json")) if os.path.isdir(build) else []
        raise GradcError(f"{path}: not found; give OUT/NAME of a `gradc compile` output ("
                         + (f"{build} is a folder of builds: {', '.join(builds)})" if builds else "e.g. build/mlp)"))
    return base, read_json(path)


def _shape(s):
    if not isinstance(s, list) or not all((type(d) is int and d >= 0) or (isinstance(d, str) and d) for d in s):
        raise ValueError(f"a shape is {s!r}, not a list of sizes")   # (an edited dump: cli.py names the build)
    inner = ", ".join(str(d) for d in s)
    return f"({inner},)" if len(s) == 1 else f"({inner})"


def report(build, graph=False, memory=False, partition=False, kernels=False, ptx_of=None, run_module=False,
           layers=False):
    """The summary of a build, read from its dumps. Only run_module=True (--run-module) imports the
    build's module, and so runs its code: for registers and PTX from the driver."""
    base, data = _load(build)
    meta = data["graph"]
    if ptx_of is not None:
        return ptx(base, ptx_of, meta["kernels"], run_module)
    nodes = {n["id"]: n for n in data["nodes"]}
    lines = [f"model {meta['model']} ({meta['dtype']}, gradc {meta['gradc_version']}) from {meta['source']}"]
    lr_only = set(meta.get("lr_grad", {}).get("nodes", ()))   # lr_grad's copies of the forward, counted apart
    phases = Counter(n["phase"] for i, n in nodes.items() if i not in lr_only)
    lines.append("nodes per phase: " + ", ".join(f"{p} {c}" for p, c in phases.items())
                 + (f"; lr_grad's estimate {len(lr_only & nodes.keys())} more" if lr_only else ""))
    params = meta["params"]
    total = sum(_numel(p["shape"]) for p in params.values())
    lines.append(f"params: {len(params)} arrays, {total:,} values, "
                 f"{sum(p['trainable'] for p in params.values())} trainable; weight_decay {meta['weight_decay']}")
    for name, p in params.items():
        # (a frozen param is never decayed, whatever its decay flag says: trial Y)
        flags = ("trainable" if p["trainable"] else "frozen") + (", decay" if p["decay"] and p["trainable"] else "")
        lines.append(f"  {name:<16} {_shape(p['shape']):<16} {flags}")
    lines.append("inputs: " + ", ".join(f"{k} {_shape(nodes[v]['shape'])} {nodes[v]['dtype']}"
                                         for k, v in meta["inputs"].items()))
    lines.append(f"FLOPs per call: forward {meta['flops']['forward']}; loss_and_grad (one training step) "
                 f"{meta['flops']['loss_and_grad']}" + (f"; hvp {meta['flops']['hvp']}" if "hvp" in meta["flops"] else ""))
    lines.append(f"kernels: {len(meta['kernels'])} (gradc inspect --kernels lists them)")
    lr = meta.get("lr_grad")   # (a dump of an older gradc has none)
    if lr is not None:
        lines.append(f"lr_grad: refuses this model: {lr['why']}" if lr["why"] else
                     f"lr_grad: {len(lr['sites'])} noise site(s)" + "".join(f"\n  {s}" for s in lr["sites"]))
    saved = meta["saved_for_backward"]
    lines.append(f"forward values the backward reads: {len(saved)} (gradc inspect --memory: which are kept, which "
                 f"a --memory-budget recomputes, and their bytes)")
    for s in saved:
        label = s["name"] or f"%{s['node']} {s['op']}"
        lines.append(f"  {label:<24} {_shape(s['shape']):<16} {s['src']}")
    if graph:
        lines.append("")
        lines += _graph_table(nodes, lr_only)
    if kernels:
        lines.append("")
        lines += kernel_listing(base, meta["kernels"], run_module)
    if memory:
        lines.append("")
        lines += memory_report(base)
    if layers:
        lines.append("")
        lines += layers_report(base, data)
    if partition:
        lines.append("")
        lines += partition_report(base, data)
    return "\n".join(lines)


def memory_report(base):
    """The loss_and_grad plan: peak and when, the largest live values there, kept vs recomputed;
    a PNG of live bytes over the schedule (with matplotlib)."""
    path = base + ".memplan.json"
    if not os.path.isfile(path):
        raise GradcError(f"{path}: not found (compiled by an older gradc, or removed?): compile the model again")
    plan = read_json(path)
    if plan["peak_bytes"] is None:
        return [f"memory plan of {plan['entry']}: dims are symbolic, so bytes are formulas; "
                f"compile with --bind DIM=INT for byte counts"] + [
                f"  %{t['node']:<6} {t['op']:<12} {t['bytes']:>16} bytes  steps {t['start']}..{t['end']}" for t in plan["tensors"]]
    steps = plan["schedule"]
    at = plan["peak_step"]
    arena = sum(plan["arena_bytes"].values())
    lines = [f"memory plan of {plan['entry']} ({plan['method']}), per call, dims bound:",
             f"  peak {format_size(plan['peak_bytes'])} at step {at} of {len(steps)} (%{steps[at]})",
             f"  arena {format_size(arena)}: {arena / max(plan['peak_bytes'], 1):.3f}"
             f" x the peak of live bytes (the least any buffer assignment needs)"
             + ("" if len(plan["arena_bytes"]) == 1 else
                "; per device " + ", ".join(f"{d} {format_size(b).split(' (')[0]}" for d, b in plan["arena_bytes"].items())),
             f"  keeping every activation: {format_size(plan['store_all_peak_bytes'])}; this plan's largest step "
             f"needs {format_size(plan['lower_bound_bytes'])} at once (a budget's plan may split a scan's steps "
             f"smaller)"]
    if plan.get("workspace_bytes"):
        lines.append(f"  kernel workspace (a convolution's im2col tile, a scan's recomputed segment or BPPSA's maps, "
                     f"outside the arena): at most {format_size(plan['workspace_bytes'])}")
    if plan["budget_bytes"] is not None:
        lines.append(f"  budget {format_size(plan['budget_bytes'])}; recomputed {plan['recompute_flops']:,} FLOPs")
    for run in plan.get("part_runs", ()):
        lines.append(f"  part run: steps {run['first']}..{run['last']} ({len(run['nodes'])} kernels"
                     + (f", {len(run['summed'])} sums over the images" if run["summed"] else "")
                     + ") on parts of the batch at once; what it touches lives over all of it")
    for ck in plan.get("scan_checkpoints", ()):
        lines.append(f"  scan %{ck['scan']} ({ck['src']}): {ck['steps']} steps, keeps the carry every {ck['every']} "
                     f"steps ({ck['checkpoints']} checkpoints); its backward %{ck['backward']} recomputes each segment "
                     f"({ck['recompute_flops']:,} FLOPs)")
    if plan.get("in_place"):
        lines.append(f"  in place: {len(plan['in_place'])} elementwise steps write over the operand they alone read, "
                     f"one buffer for both")
    live = [t for t in plan["tensors"] if t["start"] <= at <= t["end"]]
    lines.append(f"  largest values live at the peak ({len(live)} in all):")
    for t in sorted(live, key=lambda t: -t["bytes"])[:8]:
        what = "kept for the backward" if t["retained"] else "recomputed" if t["recomputed"] else "temporary"
        lines.append(f"    %{t['node']:<6} {t['op']:<12} {_shape(t['shape']):<14} {format_size(t['bytes']):<28} {what:<22} {t['src']}")
    kept = [t for t in plan["tensors"] if t["retained"]]
    again = [t for t in plan["tensors"] if t["recomputed"]]
    lines.append(f"  kept for the backward: {len(kept)} values, {format_size(sum(t['bytes'] for t in kept))}; "
                 f"recomputed: {len(again)} computations, {format_size(sum(t['bytes'] for t in again))}"
                 + (" (besides the scans' segments above)" if plan.get("scan_checkpoints") else ""))
    lines.append("  other entry points (peak of the arena, + the kernels' workspace): " + "; ".join(
        f"{e} peak {format_size(d['peak_bytes'])}" + (f" + {format_size(d['workspace_bytes'])}" if d.get("workspace_bytes") else "")
        for e, d in plan["entries"].items() if d["peak_bytes"] is not None))
    lines += _stage_lines(plan.get("stages", ()))
    png = _live_bytes_png(base, plan)
    lines.append(f"  live bytes over the schedule: {png}" if png else
                 "  (install the viz extra, pip install 'gradc[viz]', for a PNG of live bytes over the schedule)")
    return lines


def _stage_lines(stages):
    """A pipeline's stages: each one's forward and backward arenas and, under --memory-budget, what it
    holds per microbatch in flight and what its backward recomputes (passes/stage_retention.py)."""
    lines = ["  pipeline stages: loss_and_grad and Trainer.step run as these, a microbatch per call (the plan above "
             "is of one process over the whole batch; --memory-budget bounds each stage):"] if stages else []
    for st in stages:
        fwd, bwd = st["forward"], st["backward"]
        line = (f"    stage {st['stage']}: forward arena {_short(sum(fwd['arena_bytes'].values()))}, backward arena "
                f"{_short(sum(bwd['arena_bytes'].values()))}")
        r = st.get("retention")
        if r:
            line += (f"; holds {_short(r['activation_bytes'])} for activations ({_short(r['held_per_microbatch_bytes'])} "
                     f"per microbatch x {r['in_flight']} in flight) against a budget of {_short(r['budget_bytes'])}, "
                     f"{_short(r['store_all_bytes'])} keeping every activation; " +
                     (f"its backward recomputes {len(r['recomputed'])} forward values "
                      f"({r['recompute_flops_per_microbatch']:,} FLOPs a microbatch)"
                      if r["recomputed"] else "it recomputes nothing"))
        lines.append(line)
    return lines


def _short(nbytes):
    return format_size(nbytes).split(" (")[0]


def _live_bytes_png(base, plan):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.5))
    store_all = plan.get("store_all_live_bytes", plan["live_bytes"])
    ax.plot(range(len(store_all)), [b / 2**20 for b in store_all], label="keep every activation", color="#999")
    if "store_all_live_bytes" in plan:
        ax.plot(range(len(plan["live_bytes"])), [b / 2**20 for b in plan["live_bytes"]],
                label=f"this plan ({format_size(plan['budget_bytes']).split(' (')[0]} budget)", color="#c33")
        ax.axhline(plan["budget_bytes"] / 2**20, ls="--", color="#c33", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("live MiB")
    ax.set_title(f"{plan['entry']}: live bytes over the schedule")
    ax.legend()
    fig.tight_layout()
    path = write_beside_dumps(base, ".memory.png", lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path


def _numel(shape):
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return n


def _graph_table(nodes, lr_only):
    """The nodes by phase, as the summary line counts them: lr_grad's copies of the forward under a heading
    of their own (they were listed, and counted, as the forward: trial P)."""
    lines = []
    for phase in ("forward", "backward", "second", "transfer", "update", "lr_grad"):
        members = [n for i, n in nodes.items() if (n["phase"] == phase and i not in lr_only)
                   or (phase == "lr_grad" and i in lr_only)]
        if not members:
            continue
        lines.append(f"{phase} ({len(members)} nodes):" if phase != "lr_grad" else
                     f"lr_grad's estimate ({len(members)} nodes: the forward's noised copies and the estimate):")
        for n in sorted(members, key=lambda n: n["id"]):
            expr = n["attrs"].get("expr")
            what = n["op"] + (f" {n['name']}" if n.get("name") else "") + (f" = {expr}" if expr else "")
            what = what if len(what) <= 60 else what[:59] + "…"   # (a cut expression says so: trial R)
            lines.append(f"  %{n['id']:<5} {what:<60} {_shape(n['shape']):<14} {n['src']}")
    return lines


