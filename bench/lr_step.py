"""Where one training step's time goes, backprop against likelihood-ratio (Trainer(gradient="lr")), on
lr_table's MLP and scan RNN at batch 64: the median time of a Trainer step, of loss_and_grad and lr_grad
alone, and of the host's part of lr_grad (the leaves it adds: seed, sigma, the labels' copies; its masks
are kept); then cProfile's top host functions over LR steps. On a CUDA build it also says how the calls
ran: captured, replayed from a CUDA graph, or launched directly.

    python bench/lr_step.py [--target cuda] [--samples K] [--steps N]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import numpy as np

import gradc as gc
from lr_table import OUT, digits, mlp_model, rnn_model


def median_ms(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    K, n = args.samples, args.steps
    X, y, _, _ = digits()
    x, y = X[:64], y[:64]
    print(f"{'model':<6} {'what':<40} {'ms':>8}")
    for label, make in (("MLP", mlp_model), ("RNN", rnn_model)):
        mod = gc.compile(make(), out=OUT, order=1, warm_cache=False, target=args.target)
        params = mod.init_params(0)
        bp = mod.Trainer(params, optimizer="adam", lr=1e-3)
        lr = mod.Trainer(params, optimizer="adam", lr=1e-3, gradient="lr", samples=K)
        options = dict(samples=K, sigma=1e-2, seed=0, antithetic=True, layerwise=False, baseline=True)
        a = mod._SIGNATURE.inputs({"x": x, "y": y}, mod._LOSS_INPUTS, "lr_step")
        plain = mod.Trainer(params, optimizer="adam", lr=1e-3, gradient="lr", samples=K, antithetic=False)
        layerwise = mod.Trainer(params, optimizer="adam", lr=1e-3, gradient="lr", samples=K, layerwise=True)
        rows = {"Trainer.step, backprop": lambda: bp.step(x=x, y=y),
                f"Trainer.step, lr K={K}": lambda: lr.step(x=x, y=y),
                f"Trainer.step, lr K={K} plain+baseline": lambda: plain.step(x=x, y=y),
                f"Trainer.step, lr K={K} layer-wise": lambda: layerwise.step(x=x, y=y),
                "loss_and_grad": lambda: mod.loss_and_grad(params, x=x, y=y),
                f"lr_grad K={K}": lambda: mod.lr_grad(params, x=x, y=y, **options),
                "  of which host leaves (seed, labels)": lambda: mod._LR.leaves(a, *options.values())}
        for what, fn in rows.items():
            for _ in range(5):
                fn()
            first = median_ms(fn, 1)   # after the warm-up: a slow one here is work redone at every call
            print(f"{label:<6} {what:<40} {median_ms(fn, n):>8.3f}   (one call after warm-up: {first:.3f})", flush=True)
        runner = getattr(mod, "_CUDA", None)
        if runner is not None:
            print(f"{label:<6} CUDA graph calls: {runner.calls} ({runner.graph_error or 'no capture error'})")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            lr.step(x=x, y=y)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        print(f"{label}: cProfile of {n} LR steps, by own time")
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
