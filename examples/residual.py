"""A DAG with fan-out and skip connections: a residual MLP fitting a smooth function.

    python examples/residual.py [--quick]
    gradc compile examples/residual.py -o build && gradc inspect build/residual_net --graph

The input feeds every block (fan-out), each block adds its output to the running sum (skip),
and a long skip carries the first block's output to the head; one weight matrix is shared by
two blocks. The backward pass sums every path's contribution.
"""
import argparse
import os
import sys

import numpy as np

import gradc as gc

WIDTH, BLOCKS = 32, 4

model = gc.Model("residual_net")
x = model.input("x", ("B", 2))
target = model.input("t", ("B", 1))
embed = model.param("We", (2, WIDTH))
h0 = gc.tanh(x @ embed)
shared = model.param("Ws", (WIDTH, WIDTH))          # used by blocks 1 and 3
h = h0
for i in range(BLOCKS):
    w = shared if i in (1, 3) else model.param(f"W{i}", (WIDTH, WIDTH))
    block = gc.gelu(h @ w + model.param(f"b{i}", (WIDTH,)) + x @ model.param(f"U{i}", (2, WIDTH)))
    h = h + 0.5 * block                               # skip connection
pred = (h + h0) @ model.param("Wo", (WIDTH, 1))       # long skip from the first block
model.output("pred", pred)
model.minimize(gc.mse(pred, target), weight_decay=1e-5)


def make_data(n, rng):
    X = rng.uniform(-2, 2, (n, 2)).astype(np.float32)
    T = (np.sin(X[:, :1] * 1.5) * np.cos(X[:, 1:]) + 0.3 * X[:, :1]).astype(np.float32)
    return X, T


def main(argv=None):
    ap = argparse.ArgumentParser(description="Fit a residual MLP with gradc.")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--quick", action="store_true", help="300 steps")
    args = ap.parse_args(argv)
    steps = 300 if args.quick else args.steps
    rng = np.random.default_rng(0)
    X, T = make_data(2048, rng)
    X_val, T_val = make_data(512, rng)
    net = gc.compile(model, out=args.out)
    trainer = net.Trainer(net.init_params(seed=1), optimizer="adam", lr=3e-3, clip_norm=5.0)
    start = net.forward(trainer.params, x=X_val, t=T_val)["loss"]
    for step in range(steps):
        idx = rng.integers(0, len(X), 128)
        trainer.step(x=X[idx], t=T[idx])
    end = net.forward(trainer.params, x=X_val, t=T_val)["loss"]
    print(f"validation objective {start:.4f} -> {end:.4f} after {steps} Adam steps")
    return start, end


if __name__ == "__main__":
    s, e = main()
    sys.exit(0 if e < 0.5 * s else 1)
