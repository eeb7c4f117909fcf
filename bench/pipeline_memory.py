"""A pipeline under --memory-budget: GPipe's re-materialisation, gradc against PyTorch.

A 32-layer tanh MLP (width 256, batch 256, float32, SGD step) in 2 stages over 8 microbatches,
GPipe's schedule (every forward, then every backward), one process (gradc's stages are virtual
devices). gradc is compiled keeping every activation, at a budget halfway to its least, and at the
least budget its error names; each row gives the most activation bytes any stage holds (planned:
its arena, workspace and stash times the microbatches in flight), the recomputed FLOPs and the
step time. PyTorch runs the same microbatch loop with each stage plain, and with each stage under
torch.utils.checkpoint (what GPipe does: a stage keeps its input per microbatch and runs its
forward again in its backward). PyTorch's CPU allocator reports no peak, so its bytes are counted
in activations: plain, a stage keeps 2 per layer per microbatch in flight; checkpointed, its input
per microbatch and, in its backward, one microbatch's activations.

    python bench/pipeline_memory.py [--quick]
"""
import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved  # noqa: E402
from memory import BATCH, LR, WIDTH, data as mlp_data, model as mlp, torch_mlp  # noqa: E402  (the same MLP, fewer layers)

LAYERS = 32
STAGES, MICRO = 2, 8
OPTIONS = dict(devices=STAGES, microbatches=MICRO, schedule="gpipe")
ACT = BATCH // MICRO * WIDTH * 4   # bytes of one microbatch's activation


def model():
    return mlp(LAYERS, "pipe32")


def data():
    return mlp_data(LAYERS)


def least_budget(out):
    """The least budget every stage fits, as compile's error names it."""
    from gradc.compiler import compile_model
    from gradc.errors import GradcError
    try:
        compile_model(model(), out=out, order=1, bind={"B": BATCH}, warm_cache=False, memory_budget=1, **OPTIONS)
    except GradcError as e:
        return int(re.search(r"planned to, (?:[^(,]*\()?([\d,]+) bytes", str(e)).group(1).replace(",", ""))
    raise AssertionError("a 1-byte budget compiled")


def build_gradc(budgets, out):
    import json
    from gradc.compiler import compile_model
    x, y, params = data()
    tasks, info = {}, {}
    for label, budget in budgets.items():
        path = os.path.join(out, label)
        mod = compile_model(model(), out=path, order=1, bind={"B": BATCH}, warm_cache=False,
                            memory_budget=budget or "64GiB", **OPTIONS)
        tr = mod.Trainer(params, optimizer="sgd", lr=LR)
        tasks[label] = lambda tr=tr: tr.step(x=x, y=y)
        with open(os.path.join(path, "pipe32.memplan.json")) as f:
            stages = [st["retention"] for st in json.load(f)["stages"]]
        info[label] = {"held": max(r["activation_bytes"] for r in stages),
                       "recompute_flops": MICRO * sum(r["recompute_flops_per_microbatch"] for r in stages),
                       "loss": float(mod.forward(params, x=x, y=y)["loss"])}
    return tasks, info


def build_torch():
    import torch
    from torch.utils.checkpoint import checkpoint
    x, y, params = data()
    layers, head = torch_mlp(params, LAYERS)
    per = len(layers) // STAGES
    stages = [torch.nn.Sequential(*layers[k * per:(k + 1) * per]) for k in range(STAGES)]
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()] + list(head.parameters()), lr=LR)
    xs, ys = torch.from_numpy(x).chunk(MICRO), torch.from_numpy(y).chunk(MICRO)

    def step(remat):
        opt.zero_grad(set_to_none=True)
        losses = []
        for xm, ym in zip(xs, ys):   # every forward, then every backward (GPipe)
            h = xm
            for s in stages:
                h = checkpoint(s, h, use_reentrant=False) if remat else s(h)
            losses.append(torch.nn.functional.cross_entropy(head(h), ym) * (len(ym) / BATCH))
        loss = sum(losses)
        loss.backward()
        opt.step()
        return loss

    tasks = {"keep all": lambda: step(False), "checkpointed stages": lambda: step(True)}
    with torch.no_grad():
        h = torch.from_numpy(x)
        for s in stages:
            h = s(h)
        loss0 = float(torch.nn.functional.cross_entropy(head(h), torch.from_numpy(y)))
    return tasks, {"loss": loss0, "threads": torch.get_num_threads()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="gradc-bench-pipeline-memory-")
    least = least_budget(os.path.join(out, "probe"))
    budgets = {"keep all": None, "halfway": None, "least": least}
    rounds = 5 if args.quick else 11
    # the halfway budget needs keep-all's figure: one build first, then the three timed side by side
    _, probe = build_gradc({"keep all": None}, os.path.join(out, "first"))
    budgets["halfway"] = (least + probe["keep all"]["held"]) // 2
    medians, infos = interleaved({"gradc": (build_gradc, (budgets, out)), "torch": (build_torch, ())},
                                 rounds=rounds, calls={})
    g, t, gi = medians["gradc"], medians.get("torch"), infos["gradc"]
    forward_flops = 2 * BATCH * WIDTH * WIDTH * LAYERS
    print(f"# {LAYERS}-layer MLP, width {WIDTH}, batch {BATCH} in {MICRO} microbatches, {STAGES} stages, gpipe, "
          f"float32, SGD step; {rounds} interleaved rounds, median ms; one microbatch activation "
          f"{ACT / 2**10:.0f} KiB; one forward {forward_flops / 1e9:.2f} GFLOP")
    if t:
        print(f"# first losses: gradc {gi['keep all']['loss']:.6f}, torch {infos['torch']['loss']:.6f}; "
              f"torch threads {infos['torch']['threads']}")
    print("| gradc budget | most a stage holds, MiB | recompute (forwards) | gradc step ms | x keep-all |")
    print("|---|---|---|---|---|")
    for label in budgets:
        print(f"| {label} | {gi[label]['held'] / 2**20:.2f} | {gi[label]['recompute_flops'] / forward_flops:.2f} | "
              f"{g[label] * 1e3:.2f} | {g[label] / g['keep all']:.2f} |")
    if t:
        per_stage = LAYERS // STAGES
        plain = MICRO * 2 * per_stage * ACT
        remat = MICRO * ACT + 2 * per_stage * ACT
        print("| torch | activations a stage holds, MiB (modelled) | | torch step ms | x keep-all |")
        print("|---|---|---|---|---|")
        for label, held in (("keep all", plain), ("checkpointed stages", remat)):
            print(f"| {label} | {held / 2**20:.2f} | {1.0 if label != 'keep all' else 0.0:.2f} | {t[label] * 1e3:.2f} | "
                  f"{t[label] / t['keep all']:.2f} |")
        print(f"# gradc least / torch checkpointed step time: {g['least'] / t['checkpointed stages']:.2f}x")


if __name__ == "__main__":
    main()
