"""One SGD-momentum training step: gradc's generated module vs PyTorch eager vs JAX jit.

Same model (tanh MLP, softmax cross-entropy), same batch, same initial params, float32, in one
run; each framework in its own worker process, rounds interleaved (bench/harness.py). Reports
medians per step and ratios. Also times `gradc compile` of a 100-layer MLP (passes alone, and with Numba's
warm-up).

    python bench/cpu_step.py            # full run
    python bench/cpu_step.py --quick    # fewer rounds
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

import gradc as gc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved  # noqa: E402

LR, MOMENTUM = 0.05, 0.9
MODELS = [("64-128-128-10", [64, 128, 128, 10], 64), ("784-512-512-10", [784, 512, 512, 10], 128)]


def mlp(name, sizes):
    m = gc.Model(name)
    x = m.input("x", ("B", sizes[0]))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        h = h @ m.param(f"W{i}", (a, b)) + m.param(f"b{i}", (b,))
        if i < len(sizes) - 2:
            h = gc.tanh(h)
    m.output("logits", h)
    m.minimize(gc.softmax_cross_entropy(h, y))
    return m


def gradc_stepper(sizes, params, out):
    mod = gc.compile(mlp("bench_" + "_".join(map(str, sizes)), sizes), out=out, order=1)
    tr = mod.Trainer(params, optimizer="sgd", lr=LR, momentum=MOMENTUM)
    return lambda x, y: tr.step(x=x, y=y)


def torch_stepper(sizes, params):
    import torch
    ws = [torch.tensor(params[f"W{i}"], requires_grad=True) for i in range(len(sizes) - 1)]
    bs = [torch.tensor(params[f"b{i}"], requires_grad=True) for i in range(len(sizes) - 1)]
    opt = torch.optim.SGD(ws + bs, lr=LR, momentum=MOMENTUM)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        h = x
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = h @ w + b
            if i < len(ws) - 1:
                h = torch.tanh(h)
        loss = torch.nn.functional.cross_entropy(h, y)
        loss.backward()
        opt.step()
        return loss.item()
    return step, torch.from_numpy


def jax_loss(sizes):
    """The same MLP and loss in JAX."""
    import jax
    import jax.numpy as jnp

    def loss_fn(p, x, y):
        h = x
        n = len(sizes) - 1
        for i in range(n):
            h = h @ p[f"W{i}"] + p[f"b{i}"]
            if i < n - 1:
                h = jnp.tanh(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    return loss_fn


def jax_stepper(sizes, params):
    import jax
    import jax.numpy as jnp
    loss_fn = jax_loss(sizes)

    @jax.jit
    def update(p, v, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        v = jax.tree.map(lambda vi, gi: MOMENTUM * vi + gi, v, g)
        p = jax.tree.map(lambda pi, vi: pi - LR * vi, p, v)
        return p, v, loss

    state = {"p": {k: jnp.asarray(v) for k, v in params.items()}}
    state["v"] = jax.tree.map(jnp.zeros_like, state["p"])

    def step(x, y):
        state["p"], state["v"], loss = update(state["p"], state["v"], x, y)
        return float(loss)   # waits for the result, as the other two do
    return step, jnp.asarray


def build(name, sizes, batch, params, out):
    """In a worker: the framework's training step on the shared batch and params."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], batch).astype(np.int64)
    if name == "gradc":
        step, convert = gradc_stepper(sizes, params, out), (lambda a: a)
    else:
        step, convert = (torch_stepper if name == "torch eager" else jax_stepper)(sizes, params)
    x, y = convert(x), convert(y)
    first = step(x, y)            # same params everywhere: the same first loss
    return {"step": lambda: step(x, y)}, first


def bench_step(rounds, steps_per_round):
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for label, sizes, batch in MODELS:
            params = gc.compile(mlp("init_" + "_".join(map(str, sizes)), sizes), out=out,
                                warm_cache=False).init_params(0)
            builders = {name: (build, (name, sizes, batch, params, out)) for name in ("gradc", "torch eager", "jax jit")}
            med, first = interleaved(builders, rounds, {"step": steps_per_round}, warmup=20)
            rows.append((label, batch, {k: v["step"] for k, v in med.items()}, first))
    return rows


def deep_mlp(name, layers=100, width=64):
    """The compile-time benchmark's model: `layers` tanh layers of `width`."""
    m = gc.Model(name)
    x = m.input("x", ("B", width))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(layers):
        h = gc.tanh(h @ m.param(f"W{i}", (width, width)) + m.param(f"b{i}", (width,)))
    m.minimize(gc.softmax_cross_entropy(h, y))
    return m


def bench_compile():
    m = deep_mlp("deep")
    with tempfile.TemporaryDirectory() as out:
        timings = {}
        t = time.perf_counter()
        gc.compile(m, out=out, timings=timings, order=1)   # first order; bench/second_order.py times --order 2
        total = time.perf_counter() - t
    return timings, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (5 if args.quick else 21)
    print(f"# cpu_step: {os.cpu_count()} cores, numpy {np.__version__}, float32, SGD momentum {MOMENTUM}")
    rows = bench_step(rounds, 20 if args.quick else 100)
    print("\n| model | batch | gradc ms | torch eager ms | jax jit ms | gradc / torch | gradc / jax |")
    print("|---|---|---|---|---|---|---|")
    for label, batch, med, first in rows:
        t = {k: med.get(k) for k in ("gradc", "torch eager", "jax jit")}
        fmt = lambda v: "n/a" if v is None else f"{v * 1e3:.4f}"
        ratio = lambda k: "n/a" if t[k] is None else f"{t['gradc'] / t[k]:.2f}x"
        print(f"| {label} | {batch} | {fmt(t['gradc'])} | {fmt(t['torch eager'])} | {fmt(t['jax jit'])} | "
              f"{ratio('torch eager')} | {ratio('jax jit')} |")
        losses = ", ".join(f"{k} {v:.6f}" for k, v in first.items())
        print(f"#   first-step loss (same params): {losses}")
    timings, total = bench_compile()
    print("\n| gradc compile --order 1, 100-layer MLP (width 64) | seconds |")
    print("|---|---|")
    print(f"| graph passes + codegen | {timings['passes_total']:.3f} |")
    for k in ("autodiff", "simplify", "fusion", "codegen"):
        print(f"|   {k} | {timings.get(k, 0):.3f} |")
    print(f"| Numba warm-up (compile + cache) | {timings.get('numba_warm', 0):.3f} |")
    print(f"| total `compile` | {total:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
