"""Pipeline parallelism on this machine: one process against two MPI ranks running 1F1B.

An MLP of equal layers (so its two stages balance), float32, one BLAS thread per process on both
sides. For M = 1, 2, 4, 8 microbatches it times loss_and_grad (a training step less the
optimizer's update) three ways:
  one-device   the build without stages (the whole batch at once), in one process
  1 process    the 2-stage build, both stages' functions run one after another in one process
  2 ranks      the same build under mpiexec -n 2: rank r runs stage r, transfers go by MPI
With equal stages GPipe/1F1B leave a share (K-1)/(M+K-1) of the stage time idle, so two ranks
should take T_1proc / K / (1 - bubble). The table gives the measured bubble, 1 - T_1proc / (K T_2),
next to that formula, and the measured throughput against the formula's prediction.
Rounds alternate the two sides (each a fresh launch, warmed up, medians over calls).

    python bench/pipeline.py [--quick]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

LAYERS, WIDTH, BATCH = 8, 512, 1024
K = 2
ONE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}

WORKER = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import pipe_mlp as pipe
    import one_mlp as one
    ms, calls = json.loads(sys.argv[2]), int(sys.argv[3])
    comm = pipe._PIPELINE.comm
    rng = np.random.default_rng(0)
    x = rng.standard_normal((%(batch)d, %(width)d)).astype(np.float32)
    y = rng.integers(0, 10, %(batch)d)
    params = pipe.init_params(0)

    def timed(fn):
        times = []
        for i in range(calls + 2):   # two warm-up calls
            if comm is not None:
                comm.barrier()
            t = time.perf_counter()
            fn()
            if comm is not None:
                comm.barrier()
            if i >= 2:
                times.append(time.perf_counter() - t)
        return float(np.median(times))

    out = {}
    if comm is None:
        out["one-device"] = timed(lambda: one.loss_and_grad(params, x=x, y=y))
    for m in ms:
        pipe._PIPELINE.reschedule("1f1b", m)
        out[m] = timed(lambda: pipe.loss_and_grad(params, x=x, y=y))
    if comm is None or comm.Get_rank() == 0:
        print(json.dumps(out))
''') % {"batch": BATCH, "width": WIDTH}


def model(name):
    import gradc as gc
    m = gc.Model(name)
    x = m.input("x", ("B", WIDTH))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(LAYERS):
        h = gc.tanh(h @ m.param(f"W{i}", (WIDTH, WIDTH)) + m.param(f"b{i}", (WIDTH,)))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("Wo", (WIDTH, 10)), y))
    return m


def build(out):
    from gradc.compiler import compile_model
    compile_model(model("one_mlp"), out=out, order=1, bind={"B": BATCH})
    mod = compile_model(model("pipe_mlp"), out=out, order=1, bind={"B": BATCH}, devices=K, schedule="1f1b",
                        microbatches=2)
    return mod.PARTITION


def launch(out, ms, calls, ranks):
    env = dict(os.environ, **ONE_THREAD)
    script = os.path.join(out, "worker.py")
    cmd = [sys.executable, script, out, json.dumps(ms), str(calls)]
    if ranks > 1:
        mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [mpiexec, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(ranks)] + cmd
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"worker failed ({ranks} ranks):\n{r.stdout}\n{r.stderr}")
    line = [x for x in r.stdout.splitlines() if x.startswith("{")][-1]   # (mpiexec adds terminal codes after it)
    return {k if k == "one-device" else int(k): v for k, v in json.loads(line).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    args = ap.parse_args()
    rounds, calls = (2, 3) if args.quick else (5, 5)   # this shared machine is noisy: medians over 5 fresh launches
    ms = [1, 2, 4, 8]
    out = tempfile.mkdtemp(prefix="gradc-bench-pipeline-")
    try:
        plan = build(out)
        with open(os.path.join(out, "worker.py"), "w") as f:
            f.write(WORKER)
        one, two = [], []
        for _ in range(rounds):
            one.append(launch(out, ms, calls, 1))
            two.append(launch(out, ms, calls, K))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    med = lambda runs, key: statistics.median(r[key] for r in runs)
    flops = [s["forward_flops"] + s["backward_flops"] for s in plan["stage"]]
    print(f"MLP {LAYERS} x {WIDTH}, batch {BATCH}, float32; stages' FLOPs {flops} (balance "
          f"{min(flops) / max(flops):.3f}); one BLAS thread per process; {rounds} rounds x {calls} calls, medians")
    print(f"one-device build, one process: {1e3 * med(one, 'one-device'):.1f} ms")
    print("| M | 1 process ms | 2 ranks ms | speed-up | bubble measured | (K-1)/(M+K-1) | "
          "throughput / predicted |")
    print("|---|---|---|---|---|---|---|")
    for m in ms:
        t1, t2 = med(one, m), med(two, m)
        formula = (K - 1) / (m + K - 1)
        predicted = t1 / K / (1 - formula)
        print(f"| {m} | {1e3 * t1:.1f} | {1e3 * t2:.1f} | {t1 / t2:.2f}x | {1 - t1 / (K * t2):.3f} | {formula:.3f} | "
              f"{predicted / t2:.2f} |")


if __name__ == "__main__":
    main()
