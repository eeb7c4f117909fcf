"""Where one training step's time goes, backprop against likelihood-ratio (Trainer(gradient="lr")), on
lr_table's MLP and scan RNN at batch 64: the median time of a Trainer step, of loss_and_grad and lr_grad
alone, and of the host's part of lr_grad (the leaves it adds: seed, sigma, the labels' copies; its masks
are kept); then cProfile's top host functions over backprop and LR steps. On a CUDA build it also says how the calls
ran (captured, replayed from a CUDA graph, or launched directly), the device time of one replay of each
captured graph alone (no copies, no host work), and with --kernels (torch installed) each kernel's and
copy's device time per step, from torch's profiler (CUPTI sees every kernel in the process).

With --epochs R it also times whole epochs of lr_table's training loop (shuffled batches of 64 over the
1500 training digits), backprop and LR trainers in alternating rounds, R each: medians and their ratio.

    python bench/lr_step.py [--target cuda] [--samples K] [--steps N] [--model mlp|rnn] [--kernels] [--epochs R]
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import numpy as np

import gradc as gc
from gradc.runtime.cuda_host import _DIRECT
from gradc.runtime.kernel_cache import KERNELS
from lr_table import OUT, digits, mlp_model, rnn_model


def median_ms(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def replay_ms(runner, n):
    """The device time of one replay of each graph the runner captured, replayed back to back (a Trainer
    step's graph updates its params at each replay: the trainers have taken n more steps after this)."""
    out = {}
    for (fn, shapes), captured in runner._graphs.items():
        if captured is _DIRECT:
            continue
        runner.sync()
        t = time.perf_counter()
        for _ in range(n):
            captured.graph.launch(runner.stream)
        runner.sync()
        name = getattr(fn, "__name__", str(fn))
        owner = getattr(fn, "__self__", None)   # a Trainer's step: say which
        mode = f" ({getattr(owner, 'gradient', '')}, {len(shapes)} args)" if owner is not None else ""
        out[f"{name}{mode} #{len(out)}"] = 1e3 * (time.perf_counter() - t) / n
    return out


def kernel_table(step, n, top=16):
    """(kernel or copy, calls per step, device us per step) over n steps, from torch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    # a cached kernel's device name holds its cache file's name (k_<hash>), not the module's gN_ name
    names = {os.path.basename(path)[:-3]: name for _, name, _, path in KERNELS if path}
    rows = []
    for e in prof.key_averages():
        us = next((getattr(e, a) for a in ("self_device_time_total", "self_cuda_time_total", "device_time_total",
                                           "cuda_time_total") if getattr(e, a, 0)), 0)
        if us:
            named = [name for stem, name in names.items() if stem in e.key]
            rows.append(("/".join(sorted(set(named))) if named else e.key[:60], e.count / n, us / n))
    rows.sort(key=lambda r: -r[2])
    return rows[:top], sum(r[2] for r in rows)


def epoch_rounds(trainers, X, y, rounds, batch=64):
    """ms per epoch of each trainer (name -> step), medians over `rounds` epochs taken in turn."""
    rng = np.random.default_rng(1)
    times = {name: [] for name in trainers}
    for r in range(rounds + 1):   # round 0 warms up (the graphs' capture)
        for name, step in trainers.items():
            perm = rng.permutation(len(y))
            t = time.perf_counter()
            for s in range(0, len(y) - batch + 1, batch):
                i = perm[s:s + batch]
                step(x=X[i], y=y[i])
            if r:
                times[name].append(1e3 * (time.perf_counter() - t))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", choices=("mlp", "rnn"), help="one model only (default: both)")
    ap.add_argument("--kernels", action="store_true", help="per-kernel device time (CUDA, torch installed)")
    ap.add_argument("--epochs", type=int, default=0, help="rounds of whole epochs, backprop against LR")
    args = ap.parse_args()
    K, n = args.samples, args.steps
    X_train, y_train, _, _ = digits()
    x, y = X_train[:64], y_train[:64]
    print(f"{'model':<6} {'what':<40} {'ms':>8}")
    for label, make in (("MLP", mlp_model), ("RNN", rnn_model)):
        if args.model and args.model != label.lower():
            continue
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
        if args.epochs:
            epochs = epoch_rounds({"backprop": bp.step, f"lr K={K}": lr.step, f"lr K={K} plain+baseline": plain.step},
                                  X_train, y_train, args.epochs)
            for name, ms in epochs.items():
                print(f"{label:<6} epoch, {name:<33} {ms:>8.3f}   ({ms / epochs['backprop']:.2f}x backprop's, "
                      f"median of {args.epochs} rounds)", flush=True)
        runner = getattr(mod, "_CUDA", None)
        if runner is not None:
            print(f"{label:<6} CUDA graph calls: {runner.calls} ({runner.graph_error or 'no capture error'})")
            for what, ms in replay_ms(runner, n).items():
                print(f"{label:<6} one graph replay alone: {what:<38} {ms:>8.3f}")
            if args.kernels:
                for name, step in (("backprop", lambda: bp.step(x=x, y=y)), (f"lr K={K}", lambda: lr.step(x=x, y=y))):
                    try:
                        by_kernel, total = kernel_table(step, min(n, 50))
                    except Exception as e:   # a torch without CUDA or profiler support: the rest still runs
                        print(f"{label}: no kernel table ({type(e).__name__}: {e})")
                        break
                    print(f"{label}: device time per Trainer.step, {name}: {total:.1f} us; by kernel or copy:")
                    for kname, calls, us in by_kernel:
                        print(f"    {kname:<48} {calls:>5.1f} calls {us:>8.1f} us")
        for name, trainer in (("backprop", bp), ("LR", lr)):   # the host's share, each beside the other
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                trainer.step(x=x, y=y)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            print(f"{label}: cProfile of {n} {name} steps, by own time")
            print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
