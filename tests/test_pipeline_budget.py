"""--memory-budget in a pipeline (passes/stage_retention.py): each stage's activations (its forward's or
backward's arena, its workspace, and per microbatch in flight what its backward reads from the forward)
fit the budget, its backward recomputing the rest; the gradients stay the one-device build's (float64).
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gradc as gc
from gradc.compiler import compile_model
from gradc.errors import GradcError

from conftest import cuda_script
from test_memory import _dag, _inputs, _mlp
from test_mpi import _check_ranks, _one_process, _ranks
from test_scan_devices import _against_one_device

BATCH = 12


def _stages(out, name):
    with open(out / f"{name}.memplan.json") as f:
        return json.load(f)["stages"]


def _least(model, out, batch=BATCH, **options):
    """The least budget every stage fits, as the error for a 1-byte budget names it (with the stage)."""
    with pytest.raises(GradcError, match=r"--memory-budget 1 byte is below the least stage (\d+) can be planned to") as e:
        compile_model(model, out=str(out), order=1, bind={"B": batch}, warm_cache=False, dtype="float64",
                      memory_budget=1, **options)
    return int(re.search(r"planned to, (?:[^(,]*\()?([\d,]+) bytes", str(e.value)).group(1).replace(",", ""))


def _check_counts(mod, stages, budget, inputs):
    """Each stage's record against its plans, and the bytes its backward takes from the forwards
    against what the executor hands it when it runs (views come back as copies, a scan's stacks
    count): every array it takes but the gradients the next stage sends and the params."""
    pipe = mod._PIPELINE
    grad_made = {node for (k, kind), (_, _, _, roots) in pipe.functions.items() if kind == "B" for node in roots}
    source = {t: u for t, u, _, _, _ in pipe.transfers}
    taken = {}
    call = pipe.memory.call

    def counting(fn, fname, args, micro, stage=0):
        (k, kind), (_, _, spec, _) = next((key, f) for key, f in pipe.functions.items() if f[1] == fname)
        if kind == "B":
            held = sum(a.nbytes for (what, key), a in zip(spec, args)
                       if what == "v" and source.get(key, key) not in grad_made)
            taken[k] = max(taken.get(k, 0), held)
        return call(fn, fname, args, micro, stage)

    pipe.memory.call = counting
    try:
        mod.loss_and_grad(mod.init_params(1), **inputs)
    finally:
        pipe.memory.call = call
    for st in stages:
        r, k = st["retention"], st["stage"]
        fwd, bwd = st["forward"], st["backward"]
        peak = max(sum(f["arena_bytes"].values()) + (f["workspace_bytes"] or 0) for f in (fwd, bwd))
        assert r["held_per_microbatch_bytes"] == taken[k], (k, r, taken)
        assert r["activation_bytes"] == peak + r["in_flight"] * taken[k] <= budget
        assert r["store_all_bytes"] >= r["activation_bytes"]
        # a value the backward recomputes is one it does not take from the forward
        again = {t["node"] for t in bwd["tensors"] if t["recomputed"]}
        assert again <= set(r["recomputed"])
        assert not set(r["recomputed"]) & {key for what, key in pipe.functions[(k, "B")][2] if what == "v"}


@pytest.mark.parametrize("make,K,M,schedule", [
    (lambda: _mlp(layers=10, width=16), 2, 4, "gpipe"),
    pytest.param(lambda: _mlp(layers=10, width=16), 1, 4, "gpipe", marks=pytest.mark.slow),
    pytest.param(_dag, 3, 3, "1f1b", marks=pytest.mark.slow),
    pytest.param(_dag, 2, 2, "sequential", marks=pytest.mark.slow),
], ids=["mlp-2x4-gpipe", "mlp-1x4-gpipe", "dag-3x3-1f1b", "dag-2x2-sequential"])
def test_budgeted_stages_fit_and_give_the_one_device_gradients(tmp_path, make, K, M, schedule):
    model = make()
    options = dict(devices=K, microbatches=M, schedule=schedule)
    one = compile_model(model, out=str(tmp_path / "one"), order=1, bind={"B": BATCH}, warm_cache=False, dtype="float64")
    inputs = _inputs(one, BATCH, np.random.default_rng(7))
    roomy = compile_model(model, out=str(tmp_path / "all"), order=1, bind={"B": BATCH}, warm_cache=False,
                          dtype="float64", memory_budget="1GiB", **options)
    store_all = _stages(tmp_path / "all", model.name)
    assert all(st["retention"]["method"] == "store-all" and not st["retention"]["recomputed"] for st in store_all)
    _against_one_device(one, roomy, inputs)
    most = max(st["retention"]["store_all_bytes"] for st in store_all)
    least = _least(model, tmp_path / "none", **options)
    assert least < most
    for budget in sorted({least, (least + most) // 2}):
        mod = compile_model(model, out=str(tmp_path / "b"), order=1, bind={"B": BATCH}, warm_cache=False,
                            dtype="float64", memory_budget=budget, **options)
        stages = _stages(tmp_path / "b", model.name)
        _check_counts(mod, stages, budget, inputs)
        assert any(st["retention"]["recompute_flops_per_microbatch"] > 0 for st in stages)
        _against_one_device(one, mod, inputs)


def test_a_stage_that_starts_by_reshaping_what_it_receives(tmp_path):
    """Stage 1's first op is a view of the transfer into it (the chain reads its base's bytes)."""
    m = gc.Model("flat")
    x = m.input("x", ("B", 4, 4))
    y = m.input("y", ("B",), dtype="int64")
    with m.stage(0):
        h = gc.tanh(x * m.param("s", (4, 4), init="normal"))
    with m.stage(1):
        h = h.reshape(("B", 16))
        for i in range(3):
            h = gc.tanh(h @ m.param(f"W{i}", (16, 16)))
        m.minimize(gc.softmax_cross_entropy(h @ m.param("Wo", (16, 5)), y))
    options = dict(devices=2, microbatches=3, schedule="gpipe")
    one = compile_model(m, out=str(tmp_path / "one"), order=1, bind={"B": BATCH}, warm_cache=False, dtype="float64")
    least = _least(m, tmp_path / "none", **options)
    mod = compile_model(m, out=str(tmp_path / "b"), order=1, bind={"B": BATCH}, warm_cache=False, dtype="float64",
                        memory_budget=least, **options)
    inputs = _inputs(one, BATCH, np.random.default_rng(3))
    _check_counts(mod, _stages(tmp_path / "b", m.name), least, inputs)
    _against_one_device(one, mod, inputs)


@pytest.mark.slow
def test_gpipe_keeps_little_more_than_the_stage_inputs_under_a_small_budget(tmp_path):
    """GPipe's re-materialisation: with 8 microbatches in flight, the least budget holds a fraction of
    what keeping every activation does, the backward running the stage's forward again."""
    model = _mlp(layers=16, width=32)
    options = dict(devices=2, microbatches=8, schedule="gpipe")
    least = _least(model, tmp_path / "none", batch=64, **options)
    compile_model(model, out=str(tmp_path / "b"), order=1, bind={"B": 64}, warm_cache=False, dtype="float64",
                  memory_budget=least, **options)
    for st in _stages(tmp_path / "b", model.name):
        r = st["retention"]
        assert r["activation_bytes"] <= least and r["activation_bytes"] < 0.3 * r["store_all_bytes"]
        assert r["recompute_flops_per_microbatch"] > 0


def test_budget_errors_and_the_cli(tmp_path):
    model = _mlp(layers=4, width=8)
    with pytest.raises(GradcError, match=r"--memory-budget auto applies to one device"):
        compile_model(model, out=str(tmp_path / "o"), order=1, bind={"B": 8}, memory_budget="auto", microbatches=2)
    with pytest.raises(GradcError, match=r"--memory-budget needs every symbolic dim bound with --bind \(unbound: B"):
        compile_model(model, out=str(tmp_path / "o"), order=1, memory_budget="1MiB", microbatches=2)
    assert not (tmp_path / "o").exists()
    (tmp_path / "model.py").write_text(
        "import gradc as gc\nm = gc.Model('chain')\nx = m.input('x', ('B', 8))\nh = x\n"
        "for i in range(6):\n    h = gc.tanh(h @ m.param(f'W{i}', (8, 8)))\nm.minimize(gc.mean(h * h))\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "gradc.cli", "compile", "model.py", "-o", "out", "--order", "1",
                                     "--bind", "B=16", "--devices", "2", "--microbatches", "4", "--schedule", "gpipe",
                                     "--warm", "none", *a], cwd=tmp_path, capture_output=True, text=True)
    r = run("--memory-budget", "100")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(r"model.py:2: .*--memory-budget 100 bytes is below the least stage [01] can be planned to, .* "
                     r"for each of the 4 microbatch\(es\) it holds under the gpipe schedule; keeping every activation "
                     r"needs ", r.stderr), r.stderr
    assert not (tmp_path / "out").exists()
    r = run("--memory-budget", "1.5KiB")
    assert r.returncode == 0, r.stderr
    shown = subprocess.run([sys.executable, "-m", "gradc.cli", "inspect", "out/chain", "--memory"], cwd=tmp_path,
                           capture_output=True, text=True).stdout
    assert re.search(r"stage 0: forward arena .* per microbatch x 4 in flight\) against a budget of 1.50 KiB, .* "
                     r"keeping every activation; its backward recomputes \d+ forward values", shown), shown


@pytest.mark.slow
def test_a_budgeted_rnn_recomputes_its_scan_in_the_backward(tmp_path):
    """A stage whose backward runs its scan again (the scan and its results in the backward's steps)."""
    from test_scan_devices import _seq_rnn
    model = _seq_rnn()
    options = dict(microbatches=3, schedule="gpipe")
    bind = {"T": 5, "B": 7}
    one = compile_model(model, out=str(tmp_path / "one"), order=1, bind=bind, warm_cache=False, dtype="float64")
    rng = np.random.default_rng(2)
    inputs = {"x": rng.standard_normal((5, 7, 3)), "y": rng.integers(0, 4, 7)}
    with pytest.raises(GradcError, match=r"planned to, (?:[^(,]*\()?([\d,]+) bytes") as e:
        compile_model(model, out=str(tmp_path / "n"), order=1, bind=bind, warm_cache=False, dtype="float64",
                      memory_budget=1, **options)
    least = int(re.search(r"planned to, (?:[^(,]*\()?([\d,]+) bytes", str(e.value)).group(1).replace(",", ""))
    roomy = compile_model(model, out=str(tmp_path / "all"), order=1, bind=bind, warm_cache=False, dtype="float64",
                          memory_budget="1GiB", **options)
    (st,) = _stages(tmp_path / "all", model.name)   # the forward's scan stacks are what the backward takes
    _check_counts(roomy, [st], 2**30, inputs)
    mod = compile_model(model, out=str(tmp_path / "b"), order=1, bind=bind, warm_cache=False, dtype="float64",
                        memory_budget=least, **options)
    (st,) = _stages(tmp_path / "b", model.name)
    _check_counts(mod, [st], least, inputs)
    again = {t["op"] for t in st["backward"]["tensors"] if t["recomputed"]}
    assert "scan_out" in again and st["retention"]["activation_bytes"] < st["retention"]["store_all_bytes"]
    _against_one_device(one, mod, inputs)


@pytest.mark.slow
def test_two_mpi_ranks_run_budgeted_stages(tmp_path):
    model = _dag()
    options = dict(devices=2, schedule="1f1b", microbatches=3)
    least = _least(model, tmp_path / "none", **options)
    mod = compile_model(model, out=str(tmp_path / "build"), order=1, bind={"B": BATCH}, warm_cache=False,
                        dtype="float64", memory_budget=least, **options)
    inputs = _inputs(mod, BATCH, np.random.default_rng(4))
    np.savez(tmp_path / "inputs.npz", **inputs)
    expected = _one_process(mod, inputs)
    ranks = _ranks(tmp_path, str(tmp_path / "build"), model.name)
    _check_ranks(ranks, mod._PIPELINE.grad_stages, *expected, tol=1e-12)


@pytest.mark.slow
def test_cuda_budgeted_stages_under_the_simulator(tmp_path):
    least = _least(_mlp(layers=6, width=8), tmp_path / "none", **CUDA_OPTIONS)
    assert cuda_script(__file__, tmp_path, least) == "ok"


CUDA_OPTIONS = dict(devices=2, microbatches=2, schedule="gpipe")

if __name__ == "__main__":   # the CUDA check, in a process of its own (the simulator is chosen at import)
    out, least = sys.argv[1], int(sys.argv[2])
    model = _mlp(layers=6, width=8)
    one = compile_model(model, out=f"{out}/one", order=1, bind={"B": BATCH}, warm_cache=False, dtype="float64")
    many = compile_model(model, out=f"{out}/gpu", order=1, bind={"B": BATCH}, warm_cache=False, dtype="float64",
                         target="cuda", memory_budget=least, **CUDA_OPTIONS)
    assert any(st["retention"]["recompute_flops_per_microbatch"] for st in _stages(Path(out) / "gpu", model.name))
    _against_one_device(one, many, _inputs(one, BATCH, np.random.default_rng(5)))
    print("ok")
