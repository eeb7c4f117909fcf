"""`gradc inspect --partition`: the stages, their FLOPs, memory and transfers, and the pipeline
schedule as a text Gantt chart (a PNG too with the viz extra)."""
import os

from .files import read_json, write_beside_dumps
from .runtime.schedules import SCHEDULES
from .sizes import format_size

WIDTH = 72   # columns of the Gantt chart


def partition_report(base, graph):
    """`graph`: the build's graph dump, whose nodes say which device runs them."""
    path = base + ".partition.json"
    if not os.path.isfile(path):
        devices = sorted({n["device"] for n in graph["nodes"] if n.get("device")})
        if len(devices) > 1:
            return [f"partition: {path} not found, though the graph's nodes run on {len(devices)} devices "
                    f"({', '.join(devices)}); compile the model again"]
        return ["partition: one device (compiled without --devices K)"]
    plan = read_json(path)
    K, M = plan["stages"], plan["microbatches"]
    counts = all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in (K, M))
    if not counts or plan["schedule"] not in SCHEDULES or len(plan["stage"]) != K:   # (cli.py names the build)
        raise ValueError(f"{path} plans {K!r} stages, {M!r} microbatches, schedule {plan['schedule']!r} and "
                         f"{len(plan['stage'])} stage entries, not a pipeline gradc makes")
    cost = plan["cost_model"]
    lines = [f"partition: {K} stages on {plan['target']}, schedule {plan['schedule']}, {M} microbatch"
             + ("es" if M != 1 else "") + f"; cost model {cost['flop_rate']:.3g} FLOP/s per device, "
             f"{format_size(int(cost['link_bytes_per_s'])).split(' (')[0]}/s between devices",
             f"  {'stage':<6}{'device':<9}{'nodes':>6}{'fwd FLOPs':>14}{'bwd FLOPs':>14}{'memory':>14}"
             f"{'sent':>14}{'received':>14}  params"]
    short = lambda b: format_size(b).split(" (")[0]
    for s in plan["stage"]:
        lines.append(f"  {s['stage']:<6}{s['device']:<9}{len(s['nodes']):>6}{s['forward_flops']:>14,}"
                     f"{s['backward_flops']:>14,}{short(s['memory_bytes']):>14}{short(s['sent_bytes']):>14}"
                     f"{short(s['received_bytes']):>14}  {', '.join(s['params']) or '-'}")
    moved = [t for t in plan["transfers"] if t.get("carries") != "second"]   # a training step's
    hvps = [t for t in plan["transfers"] if t.get("carries") == "second"]
    lines.append(f"  transfers: {len(moved)} nodes, {format_size(sum(t['bytes'] for t in moved))} per step"
                 + (f" (e.g. %{moved[0]['value']} {moved[0]['from']} -> {moved[0]['to']})" if moved else "")
                 + (f"; hvp's own: {len(hvps)} more, {short(sum(t['bytes'] for t in hvps))} per call" if hvps else ""))
    if plan["device_memory"] is not None:
        lines.append(f"  device memory limit {format_size(plan['device_memory'])}: params, their gradients, and the "
                     f"kept activations of the microbatches in flight")
    lines.append(f"  schedule ({plan['makespan_s'] * 1e3:.3g} ms modelled; idle {100 * plan['bubble']:.1f}% of "
                 f"stage time; GPipe's (K-1)/(M+K-1) = {100 * plan['bubble_formula']:.1f}%):")
    lines += ["    " + row for row in gantt(plan["timeline"], K, plan["makespan_s"])]
    lines.append("    digits: forward of microbatch 0-9, letters: backward of microbatch a=0, b=1, ...; '*' two or "
                 "more in one column; '.' idle")
    png = _gantt_png(base, plan)
    lines.append(f"  chart: {png}" if png else "  (install the viz extra for a PNG of the schedule)")
    return lines


def gantt(rows, K, makespan):
    """One text row per stage: each op fills the columns of its time span; a column that two or more ops
    share shows '*' (a fast stage's ops are shorter than a column: one overwrote another, trial T)."""
    cells = [[set() for _ in range(WIDTH)] for _ in range(K)]
    scale = WIDTH / makespan if makespan > 0 else 0.0
    for r in rows:
        mark = str(r["microbatch"] % 10) if r["op"] == "F" else chr(ord("a") + r["microbatch"] % 26)
        lo = min(int(r["start"] * scale), WIDTH - 1)
        hi = max(lo + 1, int(round(r["end"] * scale)))
        for c in range(lo, min(hi, WIDTH)):
            cells[r["stage"]][c].add(mark)
    width = len(str(K - 1))   # (stage 10 lines up under stage 9)
    return [f"stage {k:>{width}} |{''.join('.' if not c else c.pop() if len(c) == 1 else '*' for c in row)}|"
            for k, row in enumerate(cells)]


def _gantt_png(base, plan):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    K = plan["stages"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * K + 1.5))
    for r in plan["timeline"]:
        color = "#4c8bd6" if r["op"] == "F" else "#e8913a"
        ax.broken_barh([(r["start"] * 1e3, (r["end"] - r["start"]) * 1e3)], (r["stage"] - 0.4, 0.8), color=color,
                       edgecolor="white")
        ax.text((r["start"] + r["end"]) / 2 * 1e3, r["stage"], f"{r['op']}{r['microbatch']}", ha="center",
                va="center", fontsize=7, color="white")
    ax.set_yticks(range(K), [s["device"] for s in plan["stage"]])
    ax.invert_yaxis()
    ax.set_xlabel("ms (cost model)")
    ax.set_title(f"{plan['schedule']}, {K} stages, {plan['microbatches']} microbatches")
    fig.tight_layout()
    path = write_beside_dumps(base, ".partition.png", lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path
