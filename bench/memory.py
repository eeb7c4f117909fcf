"""Activation memory against recomputation: gradc's planned budgets vs torch checkpoint_sequential.

A 64-layer tanh MLP (width 256, batch 256, float32, SGD step). gradc is compiled at budgets of
100%, 50% and 25% of its keep-everything peak and at the sqrt(L) point (2 sqrt(L) activations
plus the step's temporaries); each row gives the planned peak, the recomputed FLOPs, and the
step time. PyTorch runs the same step plainly and with checkpoint_sequential at the segment
count whose peak is closest to (not above) gradc's. PyTorch's CPU allocator reports no peak, so
its peak is counted in activations: S segment inputs, one segment's activations, two gradients.
Recompute time is a configuration's step time minus the same framework's keep-everything step.

    python bench/memory.py [--quick]
"""
import argparse
import math
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved  # noqa: E402

LAYERS, WIDTH, BATCH, CLASSES, LR = 64, 256, 256, 10, 0.01
ACT = BATCH * WIDTH * 4   # bytes of one activation


def model(layers=LAYERS, name="mem64"):
    import gradc as gc
    m = gc.Model(name)
    x = m.input("x", ("B", WIDTH))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(layers):
        h = gc.tanh(h @ m.param(f"W{i}", (WIDTH, WIDTH)) + m.param(f"b{i}", (WIDTH,)))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("Wo", (WIDTH, CLASSES)), y))
    return m


def data(layers=LAYERS):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH)
    params = {f"W{i}": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32) for i in range(layers)}
    params |= {f"b{i}": np.zeros(WIDTH, np.float32) for i in range(layers)}
    params["Wo"] = (rng.standard_normal((WIDTH, CLASSES)) / np.sqrt(WIDTH)).astype(np.float32)
    return x, y, params


def build_gradc(budgets, out):
    from gradc.compiler import compile_model
    x, y, params = data()
    tasks, info = {}, {}
    for label, budget in budgets.items():
        mod = compile_model(model(), out=os.path.join(out, label), order=1, bind={"B": BATCH}, warm_cache=False,
                            memory_budget=budget)
        tr = mod.Trainer(params, optimizer="sgd", lr=LR)
        tasks[label] = lambda tr=tr: tr.step(x=x, y=y)
        plan = mod.MEMORY_PLAN
        info[label] = {"peak": plan["peak_bytes"], "recompute_flops": plan["recompute_flops"],
                       "method": plan["method"], "loss": float(mod.forward(params, x=x, y=y)["loss"])}
    return tasks, info


def torch_mlp(params, layers=LAYERS):
    """The same MLP in torch, with `params`: its layers (Linear, Tanh, ...) and its head."""
    import torch
    body = []
    for i in range(layers):
        lin = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(params[f"W{i}"].T.copy()))
            lin.bias.zero_()
        body += [lin, torch.nn.Tanh()]
    head = torch.nn.Linear(WIDTH, CLASSES, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(params["Wo"].T.copy()))
    return body, head


def build_torch(segment_counts):
    import torch
    from torch.utils.checkpoint import checkpoint_sequential
    torch.manual_seed(0)
    x, y, params = data()
    layers, head = torch_mlp(params)
    body = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(list(body.parameters()) + list(head.parameters()), lr=LR)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step(segments):
        opt.zero_grad(set_to_none=True)
        h = body(tx) if segments is None else checkpoint_sequential(body, segments, tx, use_reentrant=False)
        loss = torch.nn.functional.cross_entropy(head(h), ty)
        loss.backward()
        opt.step()
        return loss

    tasks = {"keep all": lambda: step(None)}
    tasks |= {f"{s} segments": (lambda s=s: step(s)) for s in segment_counts}
    with torch.no_grad():
        loss0 = float(torch.nn.functional.cross_entropy(head(body(tx)), ty))
    return tasks, {"loss": loss0, "threads": torch.get_num_threads()}


def torch_peak_acts(segments):
    """checkpoint_sequential keeps each segment's input, runs the last segment plainly, and
    recomputes one segment at a time: S inputs + one segment's L/S activations + 2 gradients."""
    return segments + math.ceil(LAYERS / segments) + 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from gradc.compiler import compile_model
    out = tempfile.mkdtemp(prefix="gradc-bench-memory-")
    probe = compile_model(model(), out=os.path.join(out, "probe"), order=1, bind={"B": BATCH}, warm_cache=False)
    store_all = probe.MEMORY_PLAN["peak_bytes"]
    overhead = store_all - LAYERS * ACT            # temporaries beyond one activation per layer
    sqrt_point = int(2 * math.sqrt(LAYERS) * ACT + overhead)
    budgets = {"100%": None, "50%": store_all // 2, "25%": store_all // 4, "sqrt(L)": sqrt_point}
    # torch segment counts: for each gradc budget, the count whose modelled peak is closest below
    targets = {label: (b or store_all) / ACT for label, b in budgets.items()}
    match = {label: min((s for s in range(1, LAYERS * 2 + 1) if torch_peak_acts(s) <= t),
                        key=lambda s: (-(torch_peak_acts(s)), s), default=None) for label, t in targets.items()}
    segs = sorted({s for s in match.values() if s})
    rounds = 5 if args.quick else 15
    medians, infos = interleaved({"gradc": (build_gradc, (budgets, out)), "torch": (build_torch, (segs,))},
                                 rounds=rounds, calls={})
    g, t = medians["gradc"], medians.get("torch")
    ginfo = infos["gradc"]
    forward_flops = 2 * BATCH * WIDTH * WIDTH * LAYERS
    print(f"# {LAYERS}-layer MLP, width {WIDTH}, batch {BATCH}, float32, SGD step; {rounds} interleaved rounds, "
          f"median ms; one activation = {ACT / 2**20:.2f} MiB; one forward = {forward_flops / 1e9:.2f} GFLOP")
    if t:
        print(f"# first losses: gradc {ginfo['100%']['loss']:.6f}, torch {infos['torch']['loss']:.6f}; "
              f"torch threads {infos['torch']['threads']}")
    print("| budget | gradc peak MiB | recompute (forwards) | gradc step ms | gradc recompute ms |"
          " torch segments | torch peak MiB (modelled) | torch step ms | torch recompute ms | recompute time gradc/torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label in budgets:
        gi = ginfo[label]
        g_re = g[label] - g["100%"]
        row = (f"| {label} | {gi['peak'] / 2**20:.2f} | {gi['recompute_flops'] / forward_flops:.2f} | "
               f"{g[label] * 1e3:.2f} | {g_re * 1e3:.2f} |")
        s = match[label]
        if t and label == "100%":
            row += f" keep all | {(LAYERS + 2) * ACT / 2**20:.2f} | {t['keep all'] * 1e3:.2f} | 0 | |"
        elif t and s:
            t_re = t[f"{s} segments"] - t["keep all"]
            ratio = f"{g_re / t_re:.2f}x" if t_re > 0 else "n/a"
            row += (f" {s} | {torch_peak_acts(s) * ACT / 2**20:.2f} | {t[f'{s} segments'] * 1e3:.2f} | "
                    f"{t_re * 1e3:.2f} | {ratio} |")
        else:
            row += " none fits | | | | |"
        print(row)


if __name__ == "__main__":
    main()
