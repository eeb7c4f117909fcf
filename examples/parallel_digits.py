"""One digits MLP trained three ways: serially, data parallel over 2 MPI ranks, and with a
parameter server (1 server, 2 workers, staleness 2); the loss curves go to one PNG.

    python examples/parallel_digits.py [--epochs 20] [--out build/examples]

This process compiles the model, trains it serially, then runs itself under
`mpiexec -n 2 ... --role data` and `mpiexec -n 3 ... --role ps` (the mpi extra: pip install -e
'.[examples,mpi]'). Under mpiexec the same script runs on every rank:

    tr = mod.Trainer(params, optimizer="sgd", lr=0.05, momentum=0.9, parallel="data")
    loss = tr.step(x=my_rows_x, y=my_rows_y)       # every rank its own rows; the loss is the global one

    with mod.Trainer(params, ..., parallel="ps", servers=1, staleness=2) as tr:
        if tr.is_worker:                            # servers skip the loop and serve on leaving the block
            loss = tr.step(x=..., y=...)
    tr.save(path)                                   # rank 0 writes the final params
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import matplotlib
import numpy as np
from matplotlib.ticker import MaxNLocator

import gradc as gc

matplotlib.use("Agg")   # (before pyplot is imported: no display needed)
import matplotlib.pyplot as plt  # noqa: E402

model = gc.Model("parallel_digits")
x = model.input("x", ("B", 64))
y = model.input("y", ("B",), dtype="int64")
h = gc.tanh(x @ model.param("W0", (64, 128)) + model.param("b0", (128,)))
h = gc.tanh(h @ model.param("W1", (128, 128)) + model.param("b1", (128,)))
logits = h @ model.param("W2", (128, 10)) + model.param("b2", (10,))
model.output("logits", logits)
model.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-4)

BATCH, LR = 64, 0.05


def load_data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, digits.target.astype(np.int64), test_size=0.25,
                                                        random_state=0, stratify=digits.target)
    mean, std = X_train.mean(0), X_train.std(0) + 1e-3
    return (X_train - mean) / std, (X_test - mean) / std, y_train, y_test


def batches(n, epochs, rng):
    """The global batches of every epoch: (epoch, indices)."""
    for epoch in range(epochs):
        order = rng.permutation(n)
        for idx in np.array_split(order, n // BATCH):
            yield epoch, idx


def train(mod, role, epochs, out):
    """Train as `role` (serial, data, ps); on rank 0 return the mean loss of each epoch and the test accuracy."""
    X, X_test, Y, y_test = load_data()
    rng = np.random.default_rng(0)
    options = dict(optimizer="sgd", lr=LR, momentum=0.9)
    if role == "serial":
        tr, me, n = mod.Trainer(mod.init_params(0), **options), 0, 1
    elif role == "data":
        tr = mod.Trainer(mod.init_params(0), **options, parallel="data")
        me, n = tr.worker, tr.workers
    else:
        tr = mod.Trainer(mod.init_params(0), **options, parallel="ps", servers=1, staleness=2)
        me, n = tr.worker, tr.workers
    curve = {}
    with tr:
        if tr.is_worker:
            for epoch, idx in batches(len(X), epochs, rng):
                mine = idx[me::n]   # this rank's share of the global batch (data: the loss is the global one)
                curve.setdefault(epoch, []).append(tr.step(x=X[mine], y=Y[mine]))
    losses = [float(np.mean(v)) for _, v in sorted(curve.items())]
    if role == "ps":   # the workers' own losses, averaged over workers
        from mpi4py import MPI
        gathered = MPI.COMM_WORLD.gather(losses, root=0)
        losses = list(np.mean([g for g in gathered if g], axis=0)) if gathered else losses
    accuracy = float(np.mean(mod.forward(tr.params, x=X_test)["logits"].argmax(1) == y_test))
    tr.save(os.path.join(out, f"{role}.npz"))
    return losses, accuracy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--role", choices=("serial", "data", "ps"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:   # a rank under mpiexec: the module is compiled already
        sys.path.insert(0, args.out)
        mod = __import__(model.name)
        losses, accuracy = train(mod, args.role, args.epochs, args.out)
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 0:
            with open(os.path.join(args.out, f"{args.role}.json"), "w") as f:
                json.dump({"losses": losses, "accuracy": accuracy}, f)
        return None
    os.makedirs(args.out, exist_ok=True)
    mod = gc.compile(model, out=args.out)
    results = {}
    losses, accuracy = train(mod, "serial", args.epochs, args.out)
    results["serial"] = {"losses": losses, "accuracy": accuracy}
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for role, ranks in (("data", 2), ("ps", 3)):
        subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), sys.executable, "-m",
                        "mpi4py", os.path.abspath(__file__), "--role", role, "--epochs", str(args.epochs),
                        "--out", args.out], check=True, env=env, timeout=1200)
        with open(os.path.join(args.out, f"{role}.json")) as f:
            results[role] = json.load(f)
    labels = {"serial": "serial (1 process)", "data": "data parallel (2 ranks)",
              "ps": "parameter server (1 server, 2 workers, staleness 2)"}
    for role, r in results.items():
        print(f"{labels[role]:<52} final loss {r['losses'][-1]:.4f}  test accuracy {r['accuracy']:.2%}")
    legend = {"serial": "serial (1 process)",
              "data": "data parallel (2 ranks): the serial curve, the same global batches",
              "ps": "parameter server (staleness 2): the workers' own losses"}
    style = {"serial": dict(lw=5, alpha=0.35), "data": dict(ls="--", marker="o", ms=3), "ps": dict(marker="s", ms=3)}
    fig, ax = plt.subplots(figsize=(7, 4))
    for role, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{legend[role]}: {r['accuracy']:.1%}",
                **style[role])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training loss")
    ax.set_yscale("log")
    ax.set_title("digits MLP: serial, data parallel, parameter server")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(args.out, "parallel_digits.png")
    fig.savefig(png, dpi=120)
    print(f"loss curves: {png}")
    return min(r["accuracy"] for r in results.values())


if __name__ == "__main__":
    worst = main()
    sys.exit(0 if worst is None or worst >= 0.9 else 1)
