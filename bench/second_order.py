"""Second order, side by side in one run: gradc's hvp against its own gradient, and gradc's
hessian against jax.hessian (jit) and torch.func.hessian, on the same MLP, batch and params.

    python bench/second_order.py [--quick]

The MLP is 16-32-32-10 (1,930 params), tanh, softmax cross-entropy, batch 64, float32. Each
framework runs in its own worker process, rounds interleaved (bench/harness.py); medians.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

import gradc as gc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_step import deep_mlp, jax_loss, mlp  # noqa: E402  (the same models and JAX loss)
from harness import interleaved  # noqa: E402

SIZES, BATCH = [16, 32, 32, 10], 64


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], BATCH).astype(np.int64))


def build_gradc(params, out):
    mod = gc.compile(mlp("so_mlp", SIZES), out=out)
    x, y = data()
    v = {k: np.random.default_rng(1).standard_normal(a.shape).astype(np.float32) for k, a in params.items()}
    tasks = {"grad": lambda: mod.loss_and_grad(params, x=x, y=y),
             "hvp": lambda: mod.hvp(params, v, x=x, y=y),
             "hessian": lambda: mod.hessian(params, x=x, y=y)}
    return tasks, mod.hessian(params, x=x, y=y)


def build_jax(params, out):
    import jax
    import jax.numpy as jnp
    loss = jax_loss(SIZES)
    x, y = map(jnp.asarray, data())
    p = {k: jnp.asarray(a) for k, a in params.items()}
    hess = jax.jit(jax.hessian(loss))
    run = lambda: jax.block_until_ready(hess(p, x, y))
    return {"hessian": run}, _flatten(run(), list(params), params)


def build_torch(params, out):
    import torch
    from torch.func import hessian
    x, y = map(torch.from_numpy, data())
    names = list(params)
    tensors = tuple(torch.tensor(params[k]) for k in names)

    def loss(*ps):
        h = x
        n = len(SIZES) - 1
        for i in range(n):
            h = h @ ps[2 * i] + ps[2 * i + 1]
            if i < n - 1:
                h = torch.tanh(h)
        return torch.nn.functional.cross_entropy(h, y)
    hess = hessian(loss, argnums=tuple(range(len(names))))
    run = lambda: hess(*tensors)
    blocks = run()
    nested = {names[i]: {names[j]: blocks[i][j].numpy() for j in range(len(names))} for i in range(len(names))}
    return {"hessian": run}, _flatten(nested, names, params)


def _flatten(blocks, names, params):
    size = {k: int(np.size(params[k])) for k in names}
    return np.block([[np.asarray(blocks[p][q]).reshape(size[p], size[q]) for q in names] for p in names])


def compile_times():
    """gradc compile's graph passes and codegen for the 100-layer MLP, first order and second order."""
    out = {}
    for order in (1, 2):
        m = deep_mlp(f"deep_o{order}")
        timings = {}
        with tempfile.TemporaryDirectory() as folder:
            gc.compile(m, out=folder, order=order, warm_cache=False, timings=timings)
        out[order] = timings
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 5 if args.quick else 15
    with tempfile.TemporaryDirectory() as out:
        params = gc.compile(mlp("so_init", SIZES), out=out, warm_cache=False).init_params(0)
        builders = {"gradc": (build_gradc, (params, out)), "jax jit": (build_jax, (params, out)),
                    "torch.func": (build_torch, (params, out))}
        med, hessians = interleaved(builders, rounds, {"grad": 200, "hvp": 200, "hessian": 3}, warmup=3)
    P = sum(int(np.size(a)) for a in params.values())
    g = med["gradc"]
    print(f"# MLP {'-'.join(map(str, SIZES))}, {P} params, batch {BATCH}, float32, {os.cpu_count()} cores")
    print("\n| gradc | ms | vs gradient |")
    print("|---|---|---|")
    print(f"| loss_and_grad | {g['grad'] * 1e3:.4f} | 1.00x |")
    print(f"| hvp | {g['hvp'] * 1e3:.4f} | {g['hvp'] / g['grad']:.2f}x |")
    print("\n| full Hessian (P x P) | ms | gradc / this |")
    print("|---|---|---|")
    for name in ("gradc", "jax jit", "torch.func"):
        if name in med:
            print(f"| {name} | {med[name]['hessian'] * 1e3:.2f} | {g['hessian'] / med[name]['hessian']:.2f}x |")
    times = compile_times()
    print("\n| gradc compile, 100-layer MLP (width 64), seconds | --order 1 | --order 2 |")
    print("|---|---|---|")
    for key in ("autodiff", "second_order", "simplify", "fusion", "codegen", "passes_total"):
        print(f"| {key} | {times[1].get(key, 0):.3f} | {times[2].get(key, 0):.3f} |")
    for name in ("jax jit", "torch.func"):
        if name in hessians:
            diff = np.max(np.abs(hessians["gradc"] - hessians[name])) / np.max(np.abs(hessians[name]))
            print(f"# max |H_gradc - H_{name.split()[0]}| / max |H| = {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
