"""Curvature of a trained digits MLP: top Hessian eigenvalues by Lanczos on gradc's hvp.

    python examples/curvature_digits.py [--quick]

Lanczos (scipy's eigsh, ARPACK) needs only Hessian-vector products, so it scales to models whose
Hessian would not fit in memory. On a small model it is checked against `eigvalsh` of the full
Hessian from `hessian()`; then it runs on the 64-128-128-10 MLP (26,122 params), whose Hessian
(2.7 GB in float32) the example never forms.
"""
import argparse
import os
import sys
import time

import numpy as np
from scipy.sparse.linalg import LinearOperator, eigsh

import gradc as gc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_digits import load_data  # noqa: E402


def mlp(name, hidden):
    m = gc.Model(name)
    x = m.input("x", ("B", 64))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i, (a, b) in enumerate(zip([64] + hidden, hidden + [10])):
        h = h @ m.param(f"W{i}", (a, b)) + m.param(f"b{i}", (b,))
        if i < len(hidden):
            h = gc.tanh(h)
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=1e-4)
    return m


def train(mod, X, y, epochs, rng):
    tr = mod.Trainer(mod.init_params(seed=0), optimizer="sgd", lr=0.05, momentum=0.9)
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for idx in np.array_split(order, len(order) // 64):
            tr.step(x=X[idx], y=y[idx])
    return tr.params


def top_eigenvalues(mod, params, X, y, k):
    """The k largest eigenvalues of the Hessian of the objective on (X, y), from hvp alone."""
    slices = mod.GRAD_SLICES

    def matvec(v):
        v = np.asarray(v, dtype=mod.DTYPE).ravel()
        hv = mod.hvp(params, {p: v[a:b].reshape(mod.PARAM_SHAPES[p]) for p, (a, b) in slices.items()}, x=X, y=y)
        return np.concatenate([hv[p].ravel() for p in slices])
    op = LinearOperator((mod.GRAD_SIZE, mod.GRAD_SIZE), matvec=matvec, dtype=mod.DTYPE)
    values = eigsh(op, k=k, which="LA", tol=1e-10, return_eigenvectors=False)
    return np.sort(values)[::-1]


def main(argv=None):
    ap = argparse.ArgumentParser(description="Top Hessian eigenvalues of a digits MLP with gradc.")
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--quick", action="store_true", help="fewer epochs, skip the large model")
    ap.add_argument("-k", type=int, default=5)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    X_train, X_test, y_train, y_test = load_data()
    X_train, X_test = X_train.astype(np.float64), X_test.astype(np.float64)
    X_h, y_h = X_train[:256], y_train[:256]           # the batch whose loss we study

    small = gc.compile(mlp("curv_small", [16]), out=args.out, dtype="float64")
    params = train(small, X_train, y_train, 3 if args.quick else 10, rng)
    t = time.perf_counter()
    full = np.linalg.eigvalsh(small.hessian(params, x=X_h, y=y_h))[::-1][:args.k]
    t_full = time.perf_counter() - t
    t = time.perf_counter()
    lanczos = top_eigenvalues(small, params, X_h, y_h, args.k)
    t_lanczos = time.perf_counter() - t
    print(f"64-16-10 MLP ({small.GRAD_SIZE} params): top {args.k} Hessian eigenvalues")
    print(f"  {'eigvalsh(hessian())':>22} {'Lanczos on hvp()':>18}")
    for a, b in zip(full, lanczos):
        print(f"  {a:22.10f} {b:18.10f}")
    err = float(np.max(np.abs(full - lanczos) / np.abs(full)))
    print(f"  largest relative difference {err:.2e}; full Hessian + eigvalsh {t_full:.2f}s, Lanczos {t_lanczos:.2f}s")

    if not args.quick:
        big = gc.compile(mlp("curv_big", [128, 128]), out=args.out, dtype="float64")
        params = train(big, X_train, y_train, 10, rng)
        t = time.perf_counter()
        values = top_eigenvalues(big, params, X_h, y_h, args.k)
        print(f"64-128-128-10 MLP ({big.GRAD_SIZE} params, Hessian never formed): top {args.k} eigenvalues "
              f"{np.array2string(values, precision=5)} in {time.perf_counter() - t:.1f}s")
    return err


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-6 else 1)
