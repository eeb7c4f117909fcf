"""Data parallel and parameter-server training over MPI on this machine (DESIGN.md §1.10).

Throughput: a wide MLP (256 -> 1024 -> 1024 -> 1024 -> 10, float32, tanh), whose step is
compute-bound (GEMMs), a fixed batch of rows per rank (weak scaling, as DDP is used), one BLAS
thread per process. Samples per second of
  serial        the plain Trainer in one process
  data R        Trainer(parallel="data") under mpiexec -n R; R > cores is marked oversubscribed
and the seconds per step each rank spends in the MPI calls of the gradient reduction, with
overlap (bucketed Iallreduce started as buckets are final) and without (blocking Allreduce per
bucket after the module's one-call compiled backward). With overlap the rank runs the module's
_loss_and_grad_streamed, which starts a bucket's reduction as soon as its gradients are written;
"4 stages" is the same MLP compiled with --devices 4 and run with stage_ranks=1 (every stage in
the rank's process), whose buckets start as each stage's backward ends.

Parameter server: the digits MLP (64 -> 128 -> 128 -> 10), 2 workers of 32 rows a step, SGD with
momentum, the same epochs: final test accuracy and worker samples/s at staleness 0, 1, 4 (1 server
+ 2 workers: 3 processes on this machine's cores, oversubscribed when it has 2), against sync data
parallel on 2 ranks.

    python bench/data_parallel.py [--quick]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

ONE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}
WIDTH, DEPTH, IN, ROWS = 1024, 3, 256, 256

RANK = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    cfg = json.loads(sys.argv[2])
    m = __import__(cfg["module"])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((cfg["rows"], m.INPUTS["x"][0][1])).astype(m.DTYPE)
    y = rng.integers(0, 10, cfg["rows"]).astype(np.int64)
    opts = {} if cfg["parallel"] is None else dict(parallel="data", **cfg["options"])
    tr = m.Trainer(m.init_params(0), optimizer="sgd", lr=1e-3, momentum=0.9, **opts)
    for _ in range(3):
        tr.step(x=x, y=y)
    comm.Barrier()
    c0 = tr.comm_seconds
    t = time.perf_counter()
    for _ in range(cfg["steps"]):
        tr.step(x=x, y=y)
    elapsed = time.perf_counter() - t
    comm_s = (tr.comm_seconds - c0) / cfg["steps"]
    out = comm.gather((elapsed, comm_s), root=0)
    if rank == 0:
        print("RESULT", json.dumps({"elapsed": max(e for e, _ in out), "comm": sum(c for _, c in out) / len(out)}))
''')

PS_RANK = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    cfg = json.loads(sys.argv[2])
    m = __import__("digits_ps")
    data = np.load(cfg["data"])
    X, Y, Xt, Yt = data["X"], data["Y"], data["Xt"], data["Yt"]
    comm = MPI.COMM_WORLD
    opts = dict(optimizer="sgd", lr=cfg["lr"], momentum=0.9)
    if cfg["mode"] == "data":
        tr = m.Trainer(m.init_params(0), **opts, parallel="data")
        me, n = tr._parallel.replica, tr._parallel.replicas
    else:
        tr = m.Trainer(m.init_params(0), **opts, parallel="ps", servers=1, staleness=cfg["staleness"])
        me, n = tr.worker, tr.workers
    steps, rows = 0, 0
    t = time.perf_counter()
    with tr:
        if tr.is_worker:
            shard = np.arange(len(X))[me::n]
            rng = np.random.default_rng(me)
            for epoch in range(cfg["epochs"]):
                order = rng.permutation(shard)
                for i in range(len(order) // cfg["batch"]):
                    idx = order[i * cfg["batch"]:(i + 1) * cfg["batch"]]
                    tr.step(x=X[idx], y=Y[idx])
                    rows += len(idx)
    elapsed = time.perf_counter() - t
    total = comm.reduce(rows, root=0)
    span = comm.reduce(elapsed, op=MPI.MAX, root=0)
    if comm.Get_rank() == 0:
        acc = float(np.mean(m.forward(tr.params, x=Xt)["logits"].argmax(1) == Yt))
        print("RESULT", json.dumps({"samples_s": total / span, "accuracy": acc}))
''')


def wide_mlp(name, depth=DEPTH, width=WIDTH):
    import gradc as gc
    m = gc.Model(name)
    x = m.input("x", ("B", IN))
    y = m.input("y", ("B",), dtype="int64")
    h, n = x, IN
    for i in range(depth):
        h = gc.tanh(h @ m.param(f"W{i}", (n, width)) + m.param(f"b{i}", (width,)))
        n = width
    m.minimize(gc.softmax_cross_entropy(h @ m.param("Wo", (n, 10)), y))
    return m


def digits_mlp():
    import gradc as gc
    m = gc.Model("digits_ps")
    x = m.input("x", ("B", 64))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (64, 128)) + m.param("b0", (128,)))
    h = gc.tanh(h @ m.param("W1", (128, 128)) + m.param("b1", (128,)))
    logits = h @ m.param("W2", (128, 10)) + m.param("b2", (10,))
    m.output("logits", logits)
    m.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-4)
    return m


def mpirun(n, script, build, cfg):
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    out = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(n),
                          sys.executable, "-m", "mpi4py", script, build, json.dumps(cfg)],
                         capture_output=True, text=True, env=dict(os.environ, **ONE_THREAD), timeout=900)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(out.stdout + out.stderr)
    return json.loads(lines[-1][7:])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    from gradc.compiler import compile_model
    cores = os.cpu_count()
    steps = 5 if args.quick else 20
    work = tempfile.mkdtemp(prefix="gradc-dp-")
    os.environ.update(ONE_THREAD)
    compile_model(wide_mlp("wide"), out=work, order=1)
    compile_model(wide_mlp("wide4"), out=work, order=1, bind={"B": ROWS}, devices=4)
    (script := os.path.join(work, "rank.py")) and open(script, "w").write(RANK)
    print(f"wide MLP {IN}->{'->'.join([str(WIDTH)] * DEPTH)}->10 float32, {ROWS} rows per rank, {steps} steps, "
          f"one BLAS thread per process, {cores} cores")
    print(f"{'run':<34} {'ranks':>5} {'samples/s':>10} {'speedup':>8} {'comm s/step':>12}")
    base = None
    rows = [("serial (plain Trainer)", "wide", 1, None, {})]
    for R in (1, 2) + ((3,) if not args.quick else ()):
        rows.append(("data, overlap", "wide", R, "data", {"overlap": True}))
        if R == 2:
            rows.append(("data, no overlap", "wide", R, "data", {"overlap": False}))
            rows.append(("data, 4 stages, overlap", "wide4", R, "data", {"overlap": True, "stage_ranks": 1}))
            rows.append(("data, 4 stages, no overlap", "wide4", R, "data", {"overlap": False, "stage_ranks": 1}))
    for label, module, R, parallel, options in rows:
        res = mpirun(R, script, work, {"module": module, "rows": ROWS, "steps": steps, "parallel": parallel,
                                       "options": options})
        sps = R * ROWS * steps / res["elapsed"]
        base = base or sps
        mark = " (oversubscribed)" if R > cores else ""
        print(f"{label + mark:<34} {R:>5} {sps:>10.0f} {sps / base:>7.2f}x {res['comm']:>12.4f}", flush=True)

    # ---- parameter server on digits ----
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)
    Xtr, Xt, Ytr, Yt = train_test_split(X, d.target.astype(np.int64), test_size=0.25, random_state=0,
                                        stratify=d.target)
    mean, std = Xtr.mean(0), Xtr.std(0) + 1e-3
    np.savez(os.path.join(work, "digits.npz"), X=(Xtr - mean) / std, Y=Ytr, Xt=(Xt - mean) / std, Yt=Yt)
    compile_model(digits_mlp(), out=work, order=1)
    (ps_script := os.path.join(work, "ps.py")) and open(ps_script, "w").write(PS_RANK)
    epochs = 5 if args.quick else 20
    print(f"\ndigits MLP 64->128->128->10, 2 workers x 32 rows a step, SGD lr 0.05 momentum 0.9, {epochs} epochs")
    print(f"{'run':<40} {'ranks':>5} {'samples/s':>10} {'test acc':>9}")
    cfg = {"data": os.path.join(work, "digits.npz"), "epochs": epochs, "batch": 32, "lr": 0.05}
    for label, n, extra in [("sync data parallel", 2, {"mode": "data"})] + [
            (f"ps staleness {s}", 3, {"mode": "ps", "staleness": s}) for s in (0, 1, 4)]:
        res = mpirun(n, ps_script, work, cfg | extra)
        mark = " (1 server + 2 workers, oversubscribed)" if n > cores else ""
        print(f"{label + mark:<40} {n:>5} {res['samples_s']:>10.0f} {res['accuracy']:>8.2%}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
