"""RNNs (gc.scan) across devices, microbatches and MPI ranks: a scan runs whole in one stage (its
results with it), and its sequences split on their batch axis, 1 for a time-major (T, B, ...) input.
Each build against the one-device build of the same model, float64 (that build is checked against
torch by test_scan.py)."""
import json
import os
import sys

import numpy as np
import pytest

import gradc as gc
from gradc.compiler import compile_model
from gradc.errors import GradcError
from gradc.passes.rows import batch_dim

from conftest import cuda_script
from test_mpi import _check_ranks, _one_process, _ranks

T, B, D, H, C = 5, 7, 3, 6, 4


def _seq_rnn(name="seq_rnn", time_major=True, encoder=True):
    """An encoder (or none), a tanh RNN over the encoded sequence and a head reading its last state and
    the mean of its states; weight decay on the matrices. B = 7 rows make unequal microbatches."""
    m = gc.Model(name)
    x = m.input("x", ("T", "B", D) if time_major else ("B", "T", D))
    y = m.input("y", ("B",), dtype="int64")
    xs = x if time_major else gc.transpose(x, (1, 0, 2))
    W, b = m.param("W", (H, H)), m.param("b", (H,), init="normal")
    E = m.param("E", (D, H))
    e = gc.tanh(xs @ E) if encoder else xs

    def step(h, e_t):
        h = gc.tanh(h @ W + (e_t if encoder else e_t @ E) + b)
        return h, h

    h0 = xs.sum(axis=0) @ np.zeros((D, H))   # a zero state with the batch's rows
    hT, hs = gc.scan(step, h0, e)
    z = gc.relu(hs.mean(axis=0) @ m.param("V1", (H, H)))
    m.minimize(gc.softmax_cross_entropy((z + hT) @ m.param("V", (H, C)) + m.param("c", (C,)), y), weight_decay=1e-3)
    return m


def _data(mod, rng, time_major=True):
    x = rng.standard_normal((T, B, D) if time_major else (B, T, D))
    return {"x": x, "y": rng.integers(0, C, B)}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The one-device build, time-major or batch-major, made when a test first asks for it."""
    root, built = tmp_path_factory.mktemp("one"), {}

    def build(time_major):
        if time_major not in built:
            built[time_major] = compile_model(_seq_rnn(time_major=time_major), out=str(root / str(time_major)),
                                              order=1, dtype="float64", warm_cache=False)
        return built[time_major]
    return build


def _against_one_device(one, many, inputs):
    params = one.init_params(3)
    l1, g1 = one.loss_and_grad(params, **inputs)
    l2, g2 = many.loss_and_grad(params, **inputs)
    assert l2 == pytest.approx(l1, abs=1e-12)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=0, atol=1e-12, err_msg=k)
    t1, t2 = (mod.Trainer(params, optimizer="adam", lr=0.01) for mod in (one, many))
    for _ in range(2):
        assert t2.step(**inputs) == pytest.approx(t1.step(**inputs), abs=1e-12)
    for k in params:   # (a CUDA Trainer's params are device arrays)
        got = t2.params[k].copy_to_host() if hasattr(t2.params[k], "copy_to_host") else t2.params[k]
        np.testing.assert_allclose(got, t1.params[k], rtol=0, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("K,M,schedule,time_major", [
    pytest.param(2, 1, "sequential", True, marks=pytest.mark.slow), (2, 3, "1f1b", True),
    pytest.param(1, 3, "gpipe", True, marks=pytest.mark.slow),
    pytest.param(2, 2, "gpipe", False, marks=pytest.mark.slow),
    pytest.param(3, 2, "1f1b", True, marks=pytest.mark.slow)])
def test_a_scan_across_devices_and_microbatches_gives_the_one_device_gradients(tmp_path, one_device, K, M, schedule,
                                                                               time_major):
    model = _seq_rnn(time_major=time_major)
    # --devices binds every dim; microbatches keep the batch dim symbolic in the code
    bind = {"T": T, "B": B} if K > 1 else {}
    many = compile_model(model, out=str(tmp_path), order=1, dtype="float64", warm_cache=False, bind=bind,
                         devices=K, microbatches=M, schedule=schedule)
    _against_one_device(one_device(time_major), many, _data(many, np.random.default_rng(K + M), time_major))
    if M > 1:   # the microbatches cut a time-major sequence on its axis 1
        assert many._PIPELINE.batch_inputs == ({"x": 1, "y": 0} if time_major else {"x": 0, "y": 0})
    if K > 1:   # the scan, and the results it writes, are on one device
        with open(tmp_path / f"{model.name}.graph.json") as f:
            graph = json.load(f)
        nodes = {n["id"]: n for n in graph["nodes"]}
        # the model's scan: the one the backward's differentiates (lr_grad's perturbed copy is another)
        (scan,) = [nodes[n["of"]] for n in nodes.values() if n["op"] == "scan" and n["phase"] == "backward"]
        outs = [nodes[link["target"]] for link in graph["links"] if link["source"] == scan["id"]]
        assert outs and {n["op"] for n in outs} == {"scan_out"} and {n["device"] for n in outs} == {scan["device"]}


@pytest.mark.slow
def test_lr_grad_of_a_scan_in_a_pipeline_build_runs_whole(tmp_path):
    """The encoder's product of the whole sequence (T, B, D) @ E gets its noise with the rows on axis 1."""
    model = _seq_rnn("lr_rnn")
    one = compile_model(model, out=str(tmp_path / "one"), order=1, dtype="float64", warm_cache=False)
    many = compile_model(model, out=str(tmp_path / "many"), order=1, dtype="float64", warm_cache=False,
                         bind={"T": T, "B": B}, devices=2, microbatches=2)
    inputs = _data(many, np.random.default_rng(5))
    params = many.init_params(4)
    l1, g1 = one.lr_grad(params, samples=4, sigma=1e-2, seed=3, **inputs)
    l2, g2 = many.lr_grad(params, samples=4, sigma=1e-2, seed=3, **inputs)
    assert l2 == pytest.approx(l1, abs=1e-12)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=0, atol=1e-12, err_msg=k)


def test_the_batch_dim_is_the_leading_dim_the_loss_is_a_mean_over():
    """A time-major sequence leads with T, over which the scan mixes; its labels lead with B."""
    assert batch_dim(_seq_rnn().graph) == "B"
    assert batch_dim(_seq_rnn(time_major=False).graph) == "B"
    assert batch_dim(_seq_rnn().graph, override="T") == "T"
    m = gc.Model("no_rows")   # no dim the loss is a mean over: the first input's leading dim, whose check says why
    x = m.input("x", ("B", 3))
    m.minimize((gc.transpose(x, (1, 0)) @ x @ m.param("W", (3, 3))).sum())
    assert batch_dim(m.graph) == "B"
    m = gc.Model("centred")   # B mixed (a batch statistic), the loss a mean over L: never split along L unasked
    x = m.input("x", ("B", "L", 3))
    z = gc.tanh(x @ m.param("W", (3, 4)))
    m.minimize(((z - z.mean(axis=0)) ** 2).sum(axis=2).mean())
    assert batch_dim(m.graph) == "B"


def _time_major_regression(name="regress"):
    """No input leads with B: the default batch dim is T, which the scan mixes; --batch-dim B names it."""
    m = gc.Model(name)
    x, target = m.input("x", ("T", "B", D)), m.input("target", ("T", "B", 1))
    W, U = m.param("W", (H, H)), m.param("U", (D, H))

    def step(h, x_t):
        h = gc.tanh(h @ W + x_t @ U)
        return h, h

    _, hs = gc.scan(step, x.sum(axis=0) @ np.zeros((D, H)), x)
    m.minimize(gc.mse(hs @ m.param("V", (H, 1)), target))
    return m


def test_batch_dim_names_the_dim_of_a_model_no_input_leads_with(tmp_path):
    with pytest.raises(GradcError, match=r"--microbatches 2: .* \(the batch dim taken is 'T'; the inputs also have 'B': "
                                         r"--batch-dim names the batch dim\)"):
        compile_model(_time_major_regression(), out=str(tmp_path / "t"), microbatches=2, warm_cache=False)
    one = compile_model(_time_major_regression(), out=str(tmp_path / "one"), order=1, dtype="float64", warm_cache=False)
    assert one._ROWS["reduction"] is None and "--batch-dim names the batch dim" in one._ROWS["why"]
    # --batch-dim alone names the dim data-parallel ranks split; with microbatches, the dim they split
    named = compile_model(_time_major_regression(), out=str(tmp_path / "named"), order=1, dtype="float64",
                          warm_cache=False, batch_dim="B")
    assert named._ROWS["batch"] == "B" and named._ROWS["batch_inputs"] == {"x": 1, "target": 1}
    many = compile_model(_time_major_regression(), out=str(tmp_path / "many"), order=1, dtype="float64",
                         warm_cache=False, batch_dim="B", microbatches=3)
    rng = np.random.default_rng(8)
    _against_one_device(one, many, {"x": rng.standard_normal((T, B, D)), "target": rng.standard_normal((T, B, 1))})


def test_when_no_leading_dim_splits_the_error_says_why_for_each(tmp_path):
    """T mixes through the scan; B through a centring over the batch in the step: both reasons, with lines."""
    m = gc.Model("mixes_both")
    x, y = m.input("x", ("T", "B", D)), m.input("y", ("B",), dtype="int64")
    W, U = m.param("W", (H, H)), m.param("U", (D, H))

    def step(h, x_t):
        h = gc.tanh(h @ W + x_t @ U)
        return h - h.mean(axis=0), None

    hT, _ = gc.scan(step, x.sum(axis=0) @ np.zeros((D, H)), x)
    m.minimize(gc.softmax_cross_entropy(hT @ m.param("V", (H, C)), y))
    with pytest.raises(GradcError, match=r"--microbatches 2: .* \(the batch dim taken is 'T'; the inputs also have 'B': "
                                         r"--batch-dim names the batch dim; with 'B': .*\(scan\) runs sub \(at "
                                         r".*test_scan_devices.py:\d+\) in its step, which mixes"):
        compile_model(m, out=str(tmp_path), microbatches=2, warm_cache=False)


def test_a_time_step_of_a_time_major_sequence_keeps_its_rows(tmp_path):
    """x[0] and hs[-1] are a slice (1, B, H) seen as (B, H): the rows move from axis 1 to 0."""
    m = gc.Model("last_state")
    x, y = m.input("x", (T, "B", D)), m.input("y", ("B",), dtype="int64")
    W, U = m.param("W", (H, H)), m.param("U", (D, H))

    def step(h, x_t):
        h = gc.tanh(h @ W + x_t @ U)
        return h, h

    _, hs = gc.scan(step, gc.tanh(x[0] @ m.param("S", (D, H))), x)
    m.minimize(gc.softmax_cross_entropy(hs[-1] @ m.param("V", (H, C)), y))
    one = compile_model(m, out=str(tmp_path / "one"), order=1, dtype="float64", warm_cache=False)
    many = compile_model(m, out=str(tmp_path / "many"), order=1, dtype="float64", warm_cache=False, microbatches=2)
    assert one._ROWS["reduction"] == "mean" and one._ROWS["batch_inputs"] == {"x": 1, "y": 0}
    _against_one_device(one, many, _data(one, np.random.default_rng(9)))


def _language_model(name="lm", accumulate=False):
    """Next-token loss computed in the step (a mean over B) and stacked by the scan, then averaged
    over T: a mean of per-row terms still. (accumulate: summed into a carry instead, which the rows
    rules cannot see is linear: refused.)"""
    m = gc.Model(name)
    tok, nxt = m.input("tok", ("T", "B"), dtype="int64"), m.input("nxt", ("T", "B"), dtype="int64")
    emb, W, Wo = m.param("emb", (C, H), init="normal"), m.param("W", (H, H)), m.param("Wo", (H, C))

    def step(carry, inp):
        h, total = carry if accumulate else (carry, None)
        t_t, n_t = inp
        h = gc.tanh(h @ W + gc.take(emb, t_t))
        loss = gc.softmax_cross_entropy(h @ Wo, n_t)
        return ((h, total + loss), None) if accumulate else (h, loss)

    h0 = gc.take(emb, tok).sum(axis=0) * 0.0
    if accumulate:
        (_, total), _ = gc.scan(step, (h0, m.param("t0", (), init="zeros") * 1.0), (tok, nxt))
        m.minimize(total)
    else:
        _, losses = gc.scan(step, h0, (tok, nxt))
        m.minimize(losses.mean())
    return m


def test_a_loss_made_in_the_step_splits_over_microbatches(tmp_path):
    one = compile_model(_language_model(), out=str(tmp_path / "one"), order=1, dtype="float64", warm_cache=False,
                        batch_dim="B")
    assert one._ROWS["reduction"] == "mean" and one._ROWS["batch_inputs"] == {"tok": 1, "nxt": 1}
    many = compile_model(_language_model(), out=str(tmp_path / "many"), order=1, dtype="float64", warm_cache=False,
                         batch_dim="B", microbatches=3)
    rng = np.random.default_rng(11)
    _against_one_device(one, many, {"tok": rng.integers(0, C, (T, B)), "nxt": rng.integers(0, C, (T, B))})
    with pytest.raises(GradcError, match=r"--microbatches 2: .*\(scan\) runs add \(at .*test_scan_devices.py:\d+\) in "
                                         r"its step, which combines the loss reduced over rows with a value without batch rows"):
        compile_model(_language_model("acc", accumulate=True), out=str(tmp_path / "acc"), batch_dim="B",
                      microbatches=2, warm_cache=False)


def test_what_microbatches_cannot_split_is_refused_by_name(tmp_path):
    m = gc.Model("twice")
    x = m.input("x", ("B", "B"))
    m.minimize((x.sum(axis=1) * m.param("w", (1,))).mean())
    with pytest.raises(GradcError, match=r"test_scan_devices.py:\d+: --microbatches 2: 'x' has the batch dim 'B' on more than one axis"):
        compile_model(m, out=str(tmp_path), microbatches=2, warm_cache=False)
    # the scan carries its state over T: a split of T is refused, naming the op that mixes T's rows
    with pytest.raises(GradcError, match=r"--microbatches 2: .* so microbatches \(or data-parallel shards\) would not"):
        compile_model(_seq_rnn("over_t"), out=str(tmp_path), microbatches=2, batch_dim="T", warm_cache=False)
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]


@pytest.mark.slow
def test_two_mpi_ranks_run_the_stages_of_a_scan_model(tmp_path):
    model = _seq_rnn("mpi_rnn")
    mod = compile_model(model, out=str(tmp_path / "build"), order=1, bind={"T": T, "B": B}, warm_cache=False,
                        dtype="float64", devices=2, schedule="1f1b", microbatches=2)
    inputs = _data(mod, np.random.default_rng(6))
    np.savez(tmp_path / "inputs.npz", **inputs)
    expected = _one_process(mod, inputs)   # (this also fills Numba's cache for the ranks)
    ranks = _ranks(tmp_path, str(tmp_path / "build"), model.name)
    _check_ranks(ranks, mod._PIPELINE.grad_stages, *expected, tol=1e-12)


@pytest.mark.slow
def test_a_scan_across_devices_on_the_cuda_target_under_the_simulator(tmp_path):
    assert cuda_script(__file__, tmp_path) == "ok"


if __name__ == "__main__":   # the CUDA check, in a process of its own (the simulator is chosen at import)
    model, out = _seq_rnn("cuda_rnn"), sys.argv[1]
    one = compile_model(model, out=os.path.join(out, "one"), order=1, dtype="float64", warm_cache=False)
    many = compile_model(model, out=os.path.join(out, "many"), target="cuda", order=1, dtype="float64",
                         bind={"T": T, "B": B}, devices=2, microbatches=2, schedule="1f1b")
    _against_one_device(one, many, _data(many, np.random.default_rng(7)))
    print("ok")
