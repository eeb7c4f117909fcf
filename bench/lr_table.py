"""Seed 003's comparison on data that ships with our packages: accuracy and time per epoch, backprop
(loss_and_grad) against likelihood-ratio training (Trainer(gradient="lr")), for
  - an MLP on scikit-learn's digits,
  - an RNN (gc.scan) on the digits read as 8 rows of 8 pixels, noise on every step's pre-activation,
  - a 2-layer GCN on networkx's karate club (features: the identity) and on a Cora-sized stochastic block
    model (2708 nodes, 7 blocks, noisy block-indicator features), a normalised adjacency as a constant.
Same optimizer (Adam), same steps; float32 builds.

    python bench/lr_table.py [--quick] [--target cuda]
"""
import argparse
import sys
import tempfile
import time

import numpy as np

import gradc as gc

OUT = tempfile.mkdtemp(prefix="gradc-lr-table-")


def digits():
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(y))
    tr, te = idx[:1500], idx[1500:]
    return X[tr], y[tr].astype(np.int64), X[te], y[te].astype(np.int64)


def mlp_model():
    m = gc.Model("lrt_mlp")
    x = m.input("x", ("B", 64))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i, (a, b) in enumerate([(64, 128), (128, 10)]):
        h = h @ m.param(f"W{i}", (a, b)) + m.param(f"b{i}", (b,), init="zeros")
        if i == 0:
            h = gc.tanh(h)
    m.output("logits", h)
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=1e-4)
    return m


def rnn_model():
    m = gc.Model("lrt_rnn")
    x = m.input("x", ("B", 64))
    y = m.input("y", ("B",), dtype="int64")
    h0 = x * 0.0   # the initial state: zeros, one row per example
    Wx, Wh, b = m.param("Wx", (8, 64)), m.param("Wh", (64, 64)), m.param("bh", (64,), init="zeros")
    rows = gc.transpose(x.reshape(("B", 8, 8)), (1, 0, 2))   # 8 steps of 8 pixels: (T, B, 8)
    # one noise site per step: the pre-activation x_t @ Wx + h @ Wh + b
    h, _ = gc.scan(lambda h, xt: (gc.tanh(xt @ Wx + h @ Wh + b), None), h0, rows)
    logits = h @ m.param("Wo", (64, 10)) + m.param("bo", (10,), init="zeros")
    m.output("logits", logits)
    m.minimize(gc.softmax_cross_entropy(logits, y))
    return m


def gcn_model(name, A, f, c, hidden=16):
    m = gc.Model(name)
    n = A.shape[0]
    x = m.input("x", (n, f))
    y = m.input("y", (n,), dtype="int64")
    w = m.input("w", (n,))   # 1 on the training nodes: the loss is a weighted mean
    h = gc.relu(A @ x @ m.param("W0", (f, hidden)))
    logits = A @ h @ m.param("W1", (hidden, c))
    m.output("logits", logits)
    rows = -gc.log_softmax(logits)
    m.minimize((w * (rows * m.input("Y", (n, c))).sum(axis=1)).sum(), weight_decay=5e-4)
    return m


def normalised(A):
    A = A + np.eye(A.shape[0])
    d = 1 / np.sqrt(A.sum(1))
    return (d[:, None] * A * d[None, :]).astype(np.float32)


def karate():
    import networkx as nx
    G = nx.karate_club_graph()
    y = np.array([G.nodes[i]["club"] == "Officer" for i in range(34)], dtype=np.int64)
    train = np.zeros(34, np.float32)
    train[[0, 33, 1, 32]] = 1   # two labelled nodes per club (the leaders and one more)
    return normalised(nx.to_numpy_array(G)), np.eye(34, dtype=np.float32), y, train


def sbm(n=2708, k=7, f=64, seed=0):
    import networkx as nx
    rng = np.random.default_rng(seed)
    sizes = [n // k + (i < n % k) for i in range(k)]
    p = np.full((k, k), 0.0008)
    np.fill_diagonal(p, 0.006)   # about Cora's 2 x 5429 edges over 2708 nodes
    G = nx.stochastic_block_model(sizes, p.tolist(), seed=seed)
    y = np.concatenate([[i] * s for i, s in enumerate(sizes)]).astype(np.int64)
    proto = rng.normal(size=(k, f))
    X = (proto[y] * 0.3 + rng.normal(size=(n, f))).astype(np.float32)
    train = np.zeros(n, np.float32)
    for i in range(k):
        train[np.flatnonzero(y == i)[:20]] = 1   # Cora's split: 20 labelled nodes per class
    return normalised(nx.to_numpy_array(G)), X, y, train


def run_batches(make, data, variants, epochs, batch, target):
    Xtr, ytr, Xte, yte = data
    mod = gc.compile(make(), out=OUT, order=1, warm_cache=False, target=target)
    rows = []
    for label, opts in variants.items():
        tr = mod.Trainer(mod.init_params(0), optimizer="adam", lr=opts.pop("lr", 3e-3), **opts)
        tr.step(x=Xtr[:batch], y=ytr[:batch])   # compile
        rng = np.random.default_rng(1)
        t = time.perf_counter()
        for _ in range(epochs):
            perm = rng.permutation(len(ytr))
            for s in range(0, len(ytr) - batch + 1, batch):
                i = perm[s:s + batch]
                tr.step(x=Xtr[i], y=ytr[i])
        per_epoch = (time.perf_counter() - t) / epochs
        acc = (mod.forward(tr.params, x=Xte)["logits"].argmax(1) == yte).mean()
        rows.append((label, acc, per_epoch))
    return rows


def run_graph(name, graph, variants, epochs, target):
    A, X, y, train = graph
    c = int(y.max()) + 1
    mod = gc.compile(gcn_model(name, A, X.shape[1], c), out=OUT, order=1, warm_cache=False, target=target)
    Y = np.eye(c, dtype=np.float32)[y] / train.sum()
    inputs = {"x": X, "y": y, "w": train, "Y": Y}
    test = train == 0
    rows = []
    for label, opts in variants.items():
        tr = mod.Trainer(mod.init_params(0), optimizer="adam", lr=opts.pop("lr", 1e-2), **opts)
        tr.step(**inputs)
        t = time.perf_counter()
        for _ in range(epochs):
            tr.step(**inputs)   # full batch: an epoch is a step
        per_epoch = (time.perf_counter() - t) / epochs
        pred = mod.forward(tr.params, x=X)["logits"].argmax(1)
        rows.append((label, (pred[test] == y[test]).mean(), per_epoch))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the same table on a GPU, where the K copies of a small model cost little more than one")
    args = ap.parse_args()
    t = args.target
    e = 3 if args.quick else 20
    K = 16 if args.quick else 32
    variants = lambda: {"BP": {}, f"LR K={K}": dict(gradient="lr", samples=K),
                        f"LR K={K} layer-wise": dict(gradient="lr", samples=K, layerwise=True),
                        f"LR K={K} plain+baseline": dict(gradient="lr", samples=K, antithetic=False)}
    print(f"{'task':<22} {'method':<24} {'test acc':>8} {'s/epoch':>8}")
    table = [("MLP digits", lambda: run_batches(mlp_model, digits(), variants(), e, 64, t)),
             ("RNN digits (rows)", lambda: run_batches(rnn_model, digits(), variants(), max(1, e // 2), 64, t)),
             ("GCN karate", lambda: run_graph("lrt_karate", karate(), variants(), 10 * e, t)),
             ("GCN SBM 2708 nodes", lambda: run_graph("lrt_sbm", sbm(), variants(), 5 * e, t))]
    for task, run in table:
        for label, acc, sec in run():
            print(f"{task:<22} {label:<24} {100 * acc:>7.1f}% {sec:>8.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
