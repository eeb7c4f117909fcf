"""One SGD-momentum training step of a conv net: gradc's generated module vs PyTorch eager vs JAX jit.

Two models, float32, same batch and initial params in every framework, each framework in its own
worker process with rounds interleaved (bench/harness.py); medians per step and ratios:

  lenet  LeNet-5 style on (B, 1, 28, 28): conv 5x5 (6, pad 2), relu, max pool 2, conv 5x5 (16), relu,
         max pool 2, dense 400-120-84-10
  vgg    a VGG block on (B, 64, 56, 56): two conv 3x3 (64, pad 1) + relu, max pool 2, average pool 28,
         dense 64-10

    python bench/conv_step.py            # full run
    python bench/conv_step.py --quick    # fewer rounds
"""
import argparse
import os
import sys
import tempfile

import numpy as np

import gradc as gc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved  # noqa: E402

LR, MOMENTUM = 0.01, 0.9

# name: (input shape without the batch, batch, params {name: shape}, steps per round)
MODELS = {
    "lenet": ((1, 28, 28), 64, {"c1": (6, 1, 5, 5), "c1b": (6,), "c2": (16, 6, 5, 5), "c2b": (16,),
                                "W3": (400, 120), "b3": (120,), "W4": (120, 84), "b4": (84,),
                                "W5": (84, 10), "b5": (10,)}, 20),
    "vgg": ((64, 56, 56), 8, {"c1": (64, 64, 3, 3), "c1b": (64,), "c2": (64, 64, 3, 3), "c2b": (64,),
                              "W3": (64, 10), "b3": (10,)}, 2),
}


def forward(name, lib, x, p):
    """The model's logits in one of the three libraries (ops: conv, relu, max_pool, avg_pool, flatten)."""
    conv, relu, max_pool, avg_pool, flatten = lib
    if name == "lenet":
        h = max_pool(relu(conv(x, p["c1"], p["c1b"], 2)), 2)
        h = max_pool(relu(conv(h, p["c2"], p["c2b"], 0)), 2)
        h = relu(flatten(h) @ p["W3"] + p["b3"])
        h = relu(h @ p["W4"] + p["b4"])
        return h @ p["W5"] + p["b5"]
    h = relu(conv(x, p["c1"], p["c1b"], 1))
    h = max_pool(relu(conv(h, p["c2"], p["c2b"], 1)), 2)
    return flatten(avg_pool(h, 28)) @ p["W3"] + p["b3"]


GC_OPS = (lambda x, w, b, pad: gc.conv2d(x, w, b, padding=pad), gc.relu, gc.max_pool2d, gc.avg_pool2d,
          lambda h: h.reshape(("B", -1)))


def model(name):
    shape, _, params, _ = MODELS[name]
    m = gc.Model(f"bench_conv_{name}")
    x = m.input("x", ("B",) + shape)
    y = m.input("y", ("B",), dtype="int64")
    p = {k: m.param(k, s, init="he_normal" if len(s) == 4 else None) for k, s in params.items()}
    logits = forward(name, GC_OPS, x, p)
    m.minimize(gc.softmax_cross_entropy(logits, y))
    return m


def gradc_stepper(name, params, out):
    mod = gc.compile(model(name), out=out, order=1)
    tr = mod.Trainer(params, optimizer="sgd", lr=LR, momentum=MOMENTUM)
    return (lambda x, y: tr.step(x=x, y=y)), (lambda a: a)


def torch_stepper(name, params):
    import torch
    F = torch.nn.functional
    p = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.SGD(list(p.values()), lr=LR, momentum=MOMENTUM)
    ops = (lambda x, w, b, pad: F.conv2d(x, w, b, padding=pad), torch.relu, F.max_pool2d, F.avg_pool2d,
           lambda h: h.reshape(h.shape[0], -1))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(name, ops, x, p), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step, torch.from_numpy


def jax_stepper(name, params):
    import jax
    import jax.numpy as jnp

    def conv(x, w, b, pad):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), [(pad, pad), (pad, pad)],
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + b[None, :, None, None]

    def max_pool(x, k):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, k, k), (1, 1, k, k), "VALID")

    def avg_pool(x, k):
        return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, k, k), (1, 1, k, k), "VALID") / (k * k)

    ops = (conv, jax.nn.relu, max_pool, avg_pool, lambda h: h.reshape(h.shape[0], -1))

    def loss_fn(p, x, y):
        logp = jax.nn.log_softmax(forward(name, ops, x, p))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

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


def build(framework, name, params, out):
    """In a worker: the framework's training step on the shared batch and params."""
    shape, batch, _, _ = MODELS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    if framework == "gradc":
        step, convert = gradc_stepper(name, params, out)
    else:
        step, convert = (torch_stepper if framework == "torch eager" else jax_stepper)(name, params)
    x, y = convert(x), convert(y)
    first = step(x, y)            # same params everywhere: the same first loss
    return {"step": lambda: step(x, y)}, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--models", default="lenet,vgg")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 11)
    print(f"# conv_step: {os.cpu_count()} cores, numpy {np.__version__}, float32, SGD momentum {MOMENTUM}")
    print("\n| model | batch | gradc ms | torch eager ms | jax jit ms | gradc / torch | gradc / jax |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for name in args.models.split(","):
            params = gc.compile(model(name), out=out, warm=False).init_params(0)
            builders = {f: (build, (f, name, params, out)) for f in ("gradc", "torch eager", "jax jit")}
            spread = {}
            med, first = interleaved(builders, rounds, {"step": MODELS[name][3]}, warmup=3, spread=spread)
            t = {k: med.get(k, {}).get("step") for k in ("gradc", "torch eager", "jax jit")}
            fmt = lambda v: "n/a" if v is None else f"{v * 1e3:.3f}"
            ratio = lambda k: "n/a" if t[k] is None or t["gradc"] is None else f"{t['gradc'] / t[k]:.2f}x"
            print(f"| {name} | {MODELS[name][1]} | {fmt(t['gradc'])} | {fmt(t['torch eager'])} | "
                  f"{fmt(t['jax jit'])} | {ratio('torch eager')} | {ratio('jax jit')} |", flush=True)
            print(f"#   first-step loss (same params): {', '.join(f'{k} {v:.6f}' for k, v in first.items())}",
                  flush=True)
            # the machine is shared: a median alone hides a framework that ran slow for some rounds
            extremes = ", ".join(f"{k} {v['step'][0] * 1e3:.1f}-{v['step'][1] * 1e3:.1f}" for k, v in spread.items())
            print(f"#   fastest-slowest round, ms: {extremes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
