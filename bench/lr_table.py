"""Seed 003's comparison on data that ships with our packages: accuracy and time per epoch, backprop
(loss_and_grad) against likelihood-ratio training (Trainer(gradient="lr")), for
  - an MLP on scikit-learn's digits,
  - an RNN (gc.scan) on the digits read as 8 rows of 8 pixels, noise on every step's pre-activation,
  - a 2-layer GCN on networkx's karate club (features: the identity) and on a Cora-sized stochastic block
    model (2708 nodes, 7 blocks, noisy block-indicator features), a normalised adjacency as a constant.
Same optimizer (Adam), same steps, same initial params; float32 builds. The first row of each task is
torch eager backprop on the same device (the anchor: what a user runs today). Times are per epoch after
the first, which compiles kernels and captures CUDA graphs (a task of one epoch, --quick's RNN: that one).

    python bench/lr_table.py [--quick] [--target cuda] [--tasks mlp,rnn,karate,sbm]
"""
import argparse
import sys
import tempfile
import time
from functools import partial

import numpy as np

import gradc as gc

OUT = tempfile.mkdtemp(prefix="gradc-lr-table-")
TORCH = "torch eager BP (anchor)"


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


def run_batches(task, make, data, variants, epochs, batch, target, weight_decay):
    Xtr, ytr, Xte, yte = data
    mod = gc.compile(make(), out=OUT, order=1, warm_cache=False, target=target)
    rows = []
    for label, opts in variants.items():
        if label == TORCH:
            step, logits = torch_trainer(task, mod.init_params(0), target, 3e-3, weight_decay)
        else:
            tr = mod.Trainer(mod.init_params(0), optimizer="adam", lr=opts.pop("lr", 3e-3), **opts)
            step, logits = tr.step, lambda x: mod.forward(tr.params, x=x)["logits"]
        step(x=Xtr[:batch], y=ytr[:batch])   # compile
        rng = np.random.default_rng(1)
        t = time.perf_counter()
        for epoch in range(epochs):
            if epoch == 1:   # the first epoch is not timed: on CUDA its second step captures the graph
                t = time.perf_counter()
            perm = rng.permutation(len(ytr))
            for s in range(0, len(ytr) - batch + 1, batch):
                i = perm[s:s + batch]
                step(x=Xtr[i], y=ytr[i])
        per_epoch = (time.perf_counter() - t) / max(1, epochs - 1)
        acc = (np.asarray(logits(Xte)).argmax(1) == yte).mean()
        rows.append((label, acc, per_epoch))
    return rows


def torch_forward(task, P, x, A=None):
    """The same model in torch (anchor): the logits from params P (tensors named as gradc's)."""
    import torch
    if task == "mlp":
        return torch.tanh(x @ P["W0"] + P["b0"]) @ P["W1"] + P["b1"]
    if task == "rnn":
        h = torch.zeros(x.shape[0], 64, dtype=x.dtype, device=x.device)
        for xt in x.reshape(-1, 8, 8).transpose(0, 1):
            h = torch.tanh(xt @ P["Wx"] + h @ P["Wh"] + P["bh"])
        return h @ P["Wo"] + P["bo"]
    return A @ torch.relu(A @ x @ P["W0"]) @ P["W1"]


def torch_trainer(task, params, target, lr, weight_decay):
    """torch eager Adam on the same objective (decay on params of ndim >= 2) from the same initial
    params: (step(x, y, **graph) -> loss, logits(x, **graph))."""
    import torch
    P = {k: torch_tensor(v, target).clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.Adam(P.values(), lr=lr)
    t = partial(torch_tensor, target=target)

    def objective(x, y, w=None, A=None, Y=None):
        logits = torch_forward(task, P, t(x), A)
        if w is None:
            loss = torch.nn.functional.cross_entropy(logits, t(y))
        else:
            loss = (t(w) * (-torch.log_softmax(logits, 1) * t(Y)).sum(1)).sum()
        return loss + weight_decay / 2 * sum((p * p).sum() for p in P.values() if p.ndim >= 2)

    def step(**inputs):
        opt.zero_grad()
        loss = objective(**inputs)
        loss.backward()
        opt.step()
        return loss.item()   # read the loss, as Trainer.step does

    def logits(x, A=None):
        with torch.no_grad():
            return torch_forward(task, P, t(x), A).cpu().numpy()
    return step, logits


def torch_tensor(a, target):
    import torch
    return torch.as_tensor(a, device="cuda" if target == "cuda" else "cpu")


def run_graph(name, graph, variants, epochs, target):
    A, X, y, train = graph
    c = int(y.max()) + 1
    mod = gc.compile(gcn_model(name, A, X.shape[1], c), out=OUT, order=1, warm_cache=False, target=target)
    Y = np.eye(c, dtype=np.float32)[y] / train.sum()
    inputs = {"x": X, "y": y, "w": train, "Y": Y}
    test = train == 0
    rows = []
    for label, opts in variants.items():
        if label == TORCH:
            step, logits = torch_trainer("gcn", mod.init_params(0), target, 1e-2, 5e-4)
            A_t = torch_tensor(A, target)
            step, logits = partial(step, A=A_t), partial(logits, A=A_t)
        else:
            tr = mod.Trainer(mod.init_params(0), optimizer="adam", lr=opts.pop("lr", 1e-2), **opts)
            step, logits = tr.step, lambda x: mod.forward(tr.params, x=x)["logits"]
        step(**inputs)
        t = time.perf_counter()
        for epoch in range(epochs):
            if epoch == 1:   # the first is not timed: on CUDA it captures the graph
                t = time.perf_counter()
            step(**inputs)   # full batch: an epoch is a step
        per_epoch = (time.perf_counter() - t) / max(1, epochs - 1)
        pred = np.asarray(logits(X)).argmax(1)
        rows.append((label, (pred[test] == y[test]).mean(), per_epoch))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the same table on a GPU, where the K copies of a small model cost little more than one")
    ap.add_argument("--tasks", default="mlp,rnn,karate,sbm", help="the rows to run, comma-separated (default: all)")
    args = ap.parse_args()
    t = args.target
    e = 3 if args.quick else 20
    K = 16 if args.quick else 32
    variants = lambda: {TORCH: {}, "BP": {}, f"LR K={K}": dict(gradient="lr", samples=K),
                        f"LR K={K} layer-wise": dict(gradient="lr", samples=K, layerwise=True),
                        f"LR K={K} plain+baseline": dict(gradient="lr", samples=K, antithetic=False)}
    print(f"{'task':<22} {'method':<24} {'test acc':>8} {'ms/epoch':>9}")
    table = [("mlp", "MLP digits", lambda: run_batches("mlp", mlp_model, digits(), variants(), e, 64, t, 1e-4)),
             ("rnn", "RNN digits (rows)", lambda: run_batches("rnn", rnn_model, digits(), variants(), max(1, e // 2), 64, t, 0.0)),
             ("karate", "GCN karate", lambda: run_graph("lrt_karate", karate(), variants(), 10 * e, t)),
             ("sbm", "GCN SBM 2708 nodes", lambda: run_graph("lrt_sbm", sbm(), variants(), 5 * e, t))]
    wanted = args.tasks.split(",")
    unknown = sorted(set(wanted) - {key for key, _, _ in table})
    if unknown:
        ap.error(f"--tasks: no task {', '.join(unknown)} (the tasks: mlp, rnn, karate, sbm)")
    failed = 0
    for _, task, run in (row for row in table if row[0] in wanted):
        try:
            rows = run()
        except Exception as e:   # one task's failure should not hide the others' rows
            print(f"{task:<22} failed: {type(e).__name__}: {e}", flush=True)
            failed += 1
            continue
        for label, acc, sec in rows:
            print(f"{task:<22} {label:<24} {100 * acc:>7.1f}% {1e3 * sec:>9.2f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
