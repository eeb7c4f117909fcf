"""`gradc inspect OUT/NAME`: a readable summary of the graph dump `compile` wrote."""
import json
import os
import re
from collections import Counter

from .errors import GradcError


def _load(build):
    base = re.sub(r"(\.graph\.json|\.py)$", "", build)
    path = base + ".graph.json"
    if not os.path.isfile(path):
        raise GradcError(f"{path}: not found; give OUT/NAME of a `gradc compile` output (e.g. build/mlp)")
    with open(path) as f:
        return base, json.load(f)


def _shape(s):
    inner = ", ".join(str(d) for d in s)
    return f"({inner},)" if len(s) == 1 else f"({inner})"


def report(build, graph=False, memory=False, partition=False, kernels=False):
    base, data = _load(build)
    meta = data["graph"]
    nodes = {n["id"]: n for n in data["nodes"]}
    lines = [f"model {meta['model']} ({meta['dtype']}, gradc {meta['gradc_version']}) from {meta['source']}"]
    phases = Counter(n["phase"] for n in nodes.values())
    lines.append("nodes per phase: " + ", ".join(f"{p} {c}" for p, c in phases.items()))
    params = meta["params"]
    total = sum(_numel(p["shape"]) for p in params.values())
    lines.append(f"params: {len(params)} arrays, {total:,} values, "
                 f"{sum(p['trainable'] for p in params.values())} trainable; weight_decay {meta['weight_decay']}")
    for name, p in params.items():
        flags = ("trainable" if p["trainable"] else "frozen") + (", decay" if p["decay"] else "")
        lines.append(f"  {name:<16} {_shape(p['shape']):<16} {flags}")
    lines.append("inputs: " + ", ".join(f"{k} {_shape(nodes[v]['shape'])} {nodes[v]['dtype']}"
                                         for k, v in meta["inputs"].items()))
    lines.append(f"FLOPs per call: forward {meta['flops']['forward']}; loss_and_grad (one training step) "
                 f"{meta['flops']['loss_and_grad']}" + (f"; hvp {meta['flops']['hvp']}" if "hvp" in meta["flops"] else ""))
    lines.append(f"kernels: {len(meta['kernels'])} (gradc inspect --kernels lists them)")
    saved = meta["saved_for_backward"]
    lines.append(f"values saved for the backward: {len(saved)} (gradc inspect --memory for bytes)")
    for s in saved:
        label = s["name"] or f"%{s['node']} {s['op']}"
        lines.append(f"  {label:<24} {_shape(s['shape']):<16} {s['src']}")
    if graph:
        lines.append("")
        lines += _graph_table(nodes)
    if kernels:
        lines.append("")
        lines += _kernel_listing(base, meta["kernels"])
    if memory:
        lines.append("")
        lines.append("values the backward keeps (bytes per call; dims as declared):")
        for s in saved:
            label = s["name"] or f"%{s['node']} {s['op']}"
            lines.append(f"  {label:<24} {_shape(s['shape']):<16} {s['bytes']:>14} B   {s['src']}")
        lines.append("no memory plan in this build: every value is allocated per call, and all of the above are kept"
                     " (--memory-budget is a later milestone)")
    if partition:
        lines.append("")
        lines.append("partition: one device (cpu); --devices K is a later milestone")
    return "\n".join(lines)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return n


def _graph_table(nodes):
    lines = []
    for phase in ("forward", "backward", "second", "transfer", "update"):
        members = [n for n in nodes.values() if n["phase"] == phase]
        if not members:
            continue
        lines.append(f"{phase} ({len(members)} nodes):")
        for n in sorted(members, key=lambda n: n["id"]):
            expr = n["attrs"].get("expr")
            what = n["op"] + (f" {n['name']}" if n.get("name") else "") + (f" = {expr}" if expr else "")
            lines.append(f"  %{n['id']:<5} {what[:60]:<60} {_shape(n['shape']):<14} {n['src']}")
    return lines


def _kernel_listing(base, kernels):
    source = ""
    if os.path.isfile(base + ".py"):
        with open(base + ".py") as f:
            source = f.read()
    lines = [f"kernels ({len(kernels)}):"]
    for k in kernels:
        lines.append(f"  {k['name']}: {k['computes']}")
        m = re.search(rf"^def {re.escape(k['name'])}\(.*?(?=^@|\Z)", source, re.S | re.M)
        if m:
            lines += ["      " + line for line in m.group(0).rstrip().splitlines()]
    return lines
