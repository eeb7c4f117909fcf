"""One elementwise layer's loss_and_grad, gradc against PyTorch eager, per activation: the model is
mean(act(x * w + b)) with x (256, 4096), float32 and float64, each framework in its own worker process on
one thread, rounds interleaved (bench/harness.py); medians and ratios (gradc / torch, < 1: gradc faster).
A float32 build's tanh, sigmoid, softplus and erf (gelu's) are polynomials that vectorise
(codegen/sympy_print.py); the others, and every float64 one, call libm once an element.

    python bench/activations.py [--quick] [--acts relu,tanh,sigmoid,softplus,gelu,exp]
"""
import argparse
import os
import sys
import tempfile

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")   # one thread each: the kernels here are one loop each
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved  # noqa: E402

SHAPE = (256, 4096)
ACTS = ("relu", "tanh", "sigmoid", "softplus", "gelu", "exp")   # gc.<act> against torch's of the same name


def _data(dtype):
    rng = np.random.default_rng(0)
    return (rng.normal(size=SHAPE).astype(dtype), (1 + 0.1 * rng.normal(size=SHAPE[1])).astype(dtype),
            (0.1 * rng.normal(size=SHAPE[1])).astype(dtype))


def gradc_tasks(acts, dtype, out):
    import gradc as gc
    x, w, b = _data(dtype)
    tasks = {}
    for act in acts:
        m = gc.Model(f"act_{act}_{dtype}")
        xs = m.input("x", ("B", SHAPE[1]))
        m.minimize(getattr(gc, act)(xs * m.param("w", (SHAPE[1],)) + m.param("b", (SHAPE[1],))).mean())
        mod = gc.compile(m, out=out, dtype=dtype, order=1)
        tasks[act] = (lambda mod: lambda: mod.loss_and_grad({"w": w, "b": b}, x=x))(mod)
    return tasks, None


def torch_tasks(acts, dtype):
    import torch
    torch.set_num_threads(1)
    x, w, b = (torch.tensor(a) for a in _data(dtype))
    w.requires_grad_(True)
    b.requires_grad_(True)
    tasks = {}
    for act in acts:
        f = getattr(torch.nn.functional, act, None) or getattr(torch, act)

        def step(f=f):
            loss = f(x * w + b).mean()
            return loss.item(), torch.autograd.grad(loss, [w, b])
        tasks[act] = step
    return tasks, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--acts", default=",".join(ACTS))
    args = ap.parse_args()
    acts = args.acts.split(",")
    unknown = [a for a in acts if a not in ACTS]
    if unknown:
        ap.error(f"unknown activation(s) {unknown}: choose from {','.join(ACTS)}")
    out = tempfile.mkdtemp(prefix="gradc-acts-")
    print(f"loss_and_grad of mean(act(x * w + b)), x {SHAPE}, 1 thread, median ms (gradc / torch eager)")
    for dtype in ("float32", "float64"):
        times, _ = interleaved({"gradc": (gradc_tasks, (acts, dtype, out)), "torch": (torch_tasks, (acts, dtype))},
                               rounds=3 if args.quick else 7, calls={a: 5 for a in acts})
        for act in acts:
            g, t = times["gradc"][act], times.get("torch", {}).get(act)
            ratio = f"{g / t:5.2f}x" if t else "  -  "
            print(f"  {dtype}  {act:<9} gradc {1e3 * g:7.2f}   torch {1e3 * t if t else float('nan'):7.2f}   {ratio}")


if __name__ == "__main__":
    main()
