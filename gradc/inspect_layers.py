"""`gradc inspect OUT/NAME --memory --layers`: each layer's weight and output bytes beside the
inference and training peaks of the memory plan (seed 004's VGG-16 table, from a compiled graph).

A layer is a forward product with weights or a pooling (an op of kind conv, matmul or pool); its
weights are the params it reads and those its elementwise successors read (a bias; one that sums
the products of several layers gives its params to the last of them); its output is
its value (the activation after it has the same size). A scan is one layer (an RNN): its weights are
the params its steps read, its output the results the model reads (the final carries, the ys).
"""
import os

import numpy as np

from gradc.ops import REGISTRY

from .files import read_json
from .sizes import format_size

LAYER_KINDS = ("conv", "matmul", "pool")


def _kind(op):
    """An op's kind; a `gc.elementwise` op of the model (registered when its model file runs, which inspect does
    not do) is elementwise."""
    return REGISTRY[op].kind if op in REGISTRY else "elementwise"


def _bytes(shape, itemsize):
    if any(isinstance(d, str) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _size(b):
    return "?" if b is None else format_size(b).split(" (")[0]


def layer_rows(data):
    """(label, op, output shapes, weight bytes, output bytes) per layer, in forward order (a scan may have
    several outputs: its final carries and ys)."""
    meta = data["graph"]
    itemsize = np.dtype(meta["dtype"]).itemsize
    nodes = {n["id"]: n for n in data["nodes"]}
    operands, users = {n: [] for n in nodes}, {n: [] for n in nodes}
    for link in sorted(data["links"], key=lambda e: (e["target"], e["index"])):
        operands[link["target"]].append(link["source"])
        users[link["source"]].append(link["target"])
    param_of = {n: node["name"] for n, node in nodes.items() if node["op"] == "param"}
    model = set()   # the user's forward: what the loss and the outputs are computed from (not lr_grad's copies)
    stack = [meta["loss"], *meta["outputs"].values()]
    while stack:
        n = stack.pop()
        if n is not None and n not in model:
            model.add(n)
            stack.extend(operands[n])
    rows, pools, counted = [], 0, set()
    for n in sorted(nodes):
        node = nodes[n]
        if n in model and node["op"] == "scan":
            rows.append(_scan_row(n, nodes, operands, users, model, param_of, itemsize, counted))
            continue
        if n not in model or _kind(node["op"]) not in LAYER_KINDS:
            continue
        sent = [n] + [u for u in users[n] if nodes[u]["op"] == "transfer"]   # its bias may be added on the next stage
        # a sum of two layers' products and a bias (fused into one node) gives the bias to the later layer only:
        # each counted it, and the weights' total counted it twice (trial P)
        readers = [u for v in sent for u in users[v] if u in model and _kind(nodes[u]["op"]) == "elementwise"
                   and _last_layer_read(u, nodes, operands) == n]
        weights = list(dict.fromkeys(w for m in [n] + readers for u in operands[m]
                                     if (w := _param_under(u, nodes, operands, param_of)) is not None))
        if weights:
            label = _weights_label(weights, param_of, counted)
        else:
            pools += 1
            label = f"{node['op']} {pools}"
        weight_bytes = _new_weight_bytes(weights, nodes, itemsize, counted)
        rows.append((label, node["op"], [node["shape"]], weight_bytes, _bytes(node["shape"], itemsize)))
    return rows


def _weights_label(weights, param_of, counted):
    """The layer's params by name; one an earlier layer read (a tied weight: a decoder's W.T) says so."""
    return ", ".join(param_of[u] + (" (tied)" if u in counted else "") for u in weights)


def _new_weight_bytes(weights, nodes, itemsize, counted):
    """The bytes of the params no earlier layer counted (a tied weight is counted once: trial S), and
    marks them counted."""
    new = [u for u in weights if u not in counted]
    counted.update(new)
    return sum(_bytes(nodes[u]["shape"], itemsize) for u in new)


def _last_layer_read(u, nodes, operands):
    """The last layer (in forward order) whose product node u reads, directly or sent from another stage."""
    read = [operands[v][0] if nodes[v]["op"] == "transfer" and operands[v] else v for v in operands[u]]
    return max(v for v in read if _kind(nodes[v]["op"]) in LAYER_KINDS)


def _param_under(u, nodes, operands, param_of):
    """The param a value is, through layout ops (a bias reshaped to broadcast, or sent from the stage that
    owns it: a transfer is a layout op), or None."""
    while _kind(nodes[u]["op"]) == "layout" and operands[u]:
        u = operands[u][0]
    return u if u in param_of else None


def _scan_row(n, nodes, operands, users, model, param_of, itemsize, counted):
    weights = list(dict.fromkeys(w for u in operands[n] if (w := _param_under(u, nodes, operands, param_of))
                                 is not None))
    results = [u for u in users[n] if u in model]   # what the model reads, not the stacks the backward reads
    sizes = [_bytes(nodes[u]["shape"], itemsize) for u in results]
    return (_weights_label(weights, param_of, counted) or "scan", "scan", [nodes[u]["shape"] for u in results],
            _new_weight_bytes(weights, nodes, itemsize, counted), None if None in sizes else sum(sizes))


def layers_report(base, data):
    rows = layer_rows(data)
    if not rows:
        return ["layers: none (no conv, matmul or pool in the forward)"]
    lines = [f"layers ({data['graph']['dtype']}, shapes as compiled):",
             f"  {'layer (weights)':<22} {'op':<12} {'output shape':<22} {'weights':>12} {'output':>12}"]
    for label, op, shapes, wb, ob in rows:
        shape_text = " + ".join("(" + ", ".join(str(d) for d in shape) + ")" for shape in shapes)
        if len(label) > 22:   # every weight named (trial R: a GRU's nine lost three to the column), the row below it
            lines.append(f"  {label}")
            label = ""
        lines.append(f"  {label:<22} {op:<12} {shape_text:<22} {_size(wb):>12} {_size(ob):>12}")
    outputs = [ob for *_, ob in rows]
    total_out = None if None in outputs else sum(outputs)
    lines.append(f"  {'total':<22} {'':<12} {'':<22} {_size(sum(r[3] for r in rows)):>12} {_size(total_out):>12}")
    if total_out is None:
        unbound = sorted({d for _, _, shapes, _, _ in rows for shape in shapes for d in shape if isinstance(d, str)})
        return lines + [f"  (?: dims {', '.join(unbound)} are symbolic in the code; compile with --bind "
                        f"{unbound[0]}=INT for bytes and peaks: a --microbatches build keeps its batch dim "
                        f"symbolic, and --memory and --partition give its sizes per microbatch)"]
    path = base + ".memplan.json"
    if not os.path.isfile(path):
        return lines + [f"  ({path} not found: no peaks)"]
    plan = read_json(path)
    entries = plan["entries"]
    inference = entries.get("forward") or entries.get("forward_loss")
    kept = sum(t["bytes"] for t in plan["tensors"] if t["retained"]) if plan["peak_bytes"] is not None else None
    workspace = lambda d: f" + kernel workspace {_size(d['workspace_bytes'])}" if d.get("workspace_bytes") else ""
    lines += [f"  inference ({'forward' if 'forward' in entries else 'forward_loss'}) peak: "
              f"{_size(inference['peak_bytes'])}{workspace(inference)}: a layer's input is freed once the layer has read it",
              f"  training (loss_and_grad) peak: {_size(plan['peak_bytes'])}{workspace(plan)}; kept for the backward: "
              f"{_size(kept)}",
              "  (activations only: params, their gradients and optimizer state are held apart; the kernel workspace "
              "is a scan's step buffers, a convolution's im2col tile, outside the plan's arena)"
              if workspace(plan) or workspace(inference) else
              "  (activations only: params, their gradients and optimizer state are held apart)"]
    return lines

