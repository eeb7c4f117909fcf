"""Int values a model makes (a column of its labels, a transposed or joined index array, a slice of a
scanned int sequence): each owns a buffer of its own dtype, outside the arena of floats
(passes/storage.in_arena), which the plan counts as workspace. Against torch in float64, on the
CPU target and (in a subprocess, under numba-cuda's simulator) the CUDA target."""
import json
import os
import sys

import numpy as np
import pytest
import torch

import gradc as gc
from gradc.compiler import compile_model

from conftest import cuda_script

B, T = 5, 4


def indexed():
    m = gc.Model("int_indexed")
    idx = m.input("idx", ("B", 3), dtype="int64")
    Y = m.input("Y", ("B", 2), dtype="int64")
    E, W = m.param("E", (11, 6), init="normal"), m.param("W", (6, 4))
    a = gc.take(E, idx[:, 0])                                   # a column: a strided int slice
    b = gc.take(E, gc.transpose(idx, (1, 0))).sum(axis=0)
    c = gc.take(E, gc.concat([idx, idx[:, ::-1]], axis=1)).mean(axis=1)
    m.output("column", idx[:, 1])
    m.minimize(gc.softmax_cross_entropy(gc.tanh(a + b * c) @ W, Y[:, 1]))
    return m


def torch_indexed(p, inputs):
    E, W, i = p["E"], p["W"], torch.tensor(inputs["idx"])
    h = torch.tanh(E[i[:, 0]] + E[i.T].sum(0) * E[torch.cat([i, i.flip(1)], 1)].mean(1)) @ W
    return torch.nn.functional.cross_entropy(h, torch.tensor(inputs["Y"][:, 1]))


def scanned():
    m = gc.Model("int_scanned")
    tok = m.input("tok", ("T", "B", 2), dtype="int64")
    y = m.input("y", ("B", 2), dtype="int64")
    E, W, V = m.param("E", (9, 5), init="normal"), m.param("W", (5, 5)), m.param("V", (5, 3))

    def step(h, t):   # int values made in the step: a column and a join of the step's tokens
        return gc.tanh(h @ W + gc.take(E, t[:, 1]) + gc.take(E, gc.concat([t, t], axis=1)).mean(axis=1)), None

    hT, _ = gc.scan(step, gc.take(E, y[:, 1]) * 0.5, tok)
    m.minimize(gc.softmax_cross_entropy(hT @ V, y[:, 0]))
    return m


def torch_scanned(p, inputs):
    E, t, y = p["E"], torch.tensor(inputs["tok"]), torch.tensor(inputs["y"])
    h = E[y[:, 1]] * 0.5
    for s in range(t.shape[0]):
        h = torch.tanh(h @ p["W"] + E[t[s, :, 1]] + E[torch.cat([t[s], t[s]], 1)].mean(1))
    return torch.nn.functional.cross_entropy(h @ p["V"], y[:, 0])


MODELS = {"indexed": (indexed, torch_indexed), "scanned": (scanned, torch_scanned)}


def data(name, rng):
    if name == "indexed":
        return {"idx": rng.integers(0, 11, (B, 3)), "Y": rng.integers(0, 4, (B, 2))}
    return {"tok": rng.integers(0, 9, (T, B, 2)), "y": rng.integers(0, 3, (B, 2))}


def torch_grads(name, params, inputs):
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    loss = MODELS[name][1](tp, inputs)
    grads = torch.autograd.grad(loss, list(tp.values()), create_graph=True)
    return tp, loss, dict(zip(tp, grads))


@pytest.mark.parametrize("name", ["indexed", pytest.param("scanned", marks=pytest.mark.slow)])
def test_int_values_match_torch(tmp_path, name):
    mod = compile_model(MODELS[name][0](), out=str(tmp_path), dtype="float64", order=2 if name == "indexed" else 1,
                        warm_cache=False)
    rng = np.random.default_rng(3)
    params = {k: rng.standard_normal(s) for k, s in mod.PARAM_SHAPES.items()}
    inputs = data(name, rng)
    tp, expected, tg = torch_grads(name, params, inputs)
    loss, grads = mod.loss_and_grad(params, **inputs)
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    for k in grads:
        np.testing.assert_allclose(grads[k], tg[k].detach().numpy(), rtol=1e-10, atol=1e-13, err_msg=k)
    if name == "indexed":
        column = mod.forward(params, **inputs)["column"]
        assert column.dtype == np.int64 and (column == inputs["idx"][:, 1]).all()
        v = {k: rng.standard_normal(s) for k, s in mod.PARAM_SHAPES.items()}
        dot = sum((tg[k] * torch.tensor(v[k])).sum() for k in tg)
        hv = mod.hvp(params, v, **inputs)
        for k, h in zip(tp, torch.autograd.grad(dot, list(tp.values()))):
            np.testing.assert_allclose(hv[k], h.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"hvp {k}")


@pytest.mark.parametrize("K,M", [(2, 3), (1, 2)])
def test_int_values_in_a_pipeline_give_the_one_device_gradients(tmp_path, K, M):
    """(With K=2, M=3 the last stage's forward is the loss's mean of a received (B,) value: no step there
    used B, and the stage function's dims once missed it, a KeyError at compile time.)"""
    one = compile_model(indexed(), out=str(tmp_path / "one"), dtype="float64", order=1, warm_cache=False)
    many = compile_model(indexed(), out=str(tmp_path / "many"), dtype="float64", order=1, warm_cache=False,
                         devices=K, microbatches=M, bind={"B": B} if K > 1 else {})
    rng = np.random.default_rng(6)
    params, inputs = {k: rng.standard_normal(s) for k, s in one.PARAM_SHAPES.items()}, data("indexed", rng)
    (l1, g1), (l2, g2) = one.loss_and_grad(params, **inputs), many.loss_and_grad(params, **inputs)
    assert l2 == pytest.approx(l1, abs=1e-12)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=0, atol=1e-12, err_msg=k)


def test_the_arena_holds_floats_and_the_int_buffers_are_workspace(tmp_path):
    mod = compile_model(indexed(), out=str(tmp_path / "f32"), dtype="float32", order=1, bind={"B": B},
                        warm_cache=False)
    with open(tmp_path / "f32" / "int_indexed.memplan.json") as f:
        plan = json.load(f)["entries"]["loss_and_grad"]
    # the int slice (B,), the transposed (3, B) and the joined (B, 6) index arrays, and Y's column (B,)
    assert plan["workspace_bytes"] >= 8 * (B + 3 * B + 6 * B + B)
    rng = np.random.default_rng(4)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in mod.PARAM_SHAPES.items()}
    inputs = data("indexed", rng)
    _, expected, tg = torch_grads("indexed", {k: v.astype(np.float64) for k, v in params.items()}, inputs)
    loss, grads = mod.loss_and_grad(params, **inputs)
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for k in grads:
        np.testing.assert_allclose(grads[k], tg[k].detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


def packed():
    """One int input packing several kinds of index: each element is checked against what it indexes."""
    m = gc.Model("int_packed")
    pr = m.input("pr", ("B", 3), dtype="int64")            # rows of E; labels; rows of E and labels
    seq = m.input("seq", ("T", "B", 2), dtype="int64")     # per step: rows of F, labels
    E, F = m.param("E", (8, 4), init="normal"), m.param("F", (6, 4), init="normal")
    U, W = m.param("U", (4, 4)), m.param("W", (4, 3))

    def step(h, s):
        h = gc.tanh(h @ U + gc.take(F, s[:, 0]))
        return h, gc.softmax_cross_entropy(h @ W, s[:, 1])

    hT, losses = gc.scan(step, gc.take(E, pr[:, 0]) + gc.take(E, pr[:, 2]), seq)
    m.minimize(losses.mean() + gc.softmax_cross_entropy(hT @ W, pr[:, 1])
               + gc.softmax_cross_entropy(hT @ W, pr[:, 2]))
    return m


def torch_packed(p, inputs):
    pr, seq = torch.tensor(inputs["pr"]), torch.tensor(inputs["seq"])
    xent = torch.nn.functional.cross_entropy
    h, losses = p["E"][pr[:, 0]] + p["E"][pr[:, 2]], []
    for s in seq:
        h = torch.tanh(h @ p["U"] + p["F"][s[:, 0]])
        losses.append(xent(h @ p["W"], s[:, 1]))
    return torch.stack(losses).mean() + xent(h @ p["W"], pr[:, 1]) + xent(h @ p["W"], pr[:, 2])


def test_each_element_of_an_int_input_is_checked_against_what_it_indexes(tmp_path):
    """A column of table rows beside a column of labels was checked against the smaller range: a row
    index of 7 into 8 rows was refused as a label of 3 classes. Each element is now checked against
    the bounds of the ops that read it (both, where two do), inside a scan's steps too."""
    mod = compile_model(packed(), out=str(tmp_path), dtype="float64", order=1, warm_cache=False)
    assert mod._INDEX_BOUNDS == {"pr": {3: [(1, 3)], 8: [(0, 1), (2, 3)]}, "seq": {3: [(1, 2)], 6: [(0, 1)]}}
    rng = np.random.default_rng(5)
    params = {k: rng.standard_normal(s) for k, s in mod.PARAM_SHAPES.items()}
    pr = np.stack([rng.integers(0, 8, B), rng.integers(0, 3, B), rng.integers(0, 3, B)], axis=1)
    pr[0, 0] = 7                                     # the last row of E: once refused
    seq = np.stack([rng.integers(0, 6, (T, B)), rng.integers(0, 3, (T, B))], axis=2)
    seq[1, 2] = (5, 2)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    expected = torch_packed(tp, {"pr": pr, "seq": seq})
    tg = dict(zip(tp, torch.autograd.grad(expected, list(tp.values()))))
    loss, grads = mod.loss_and_grad(params, pr=pr, seq=seq)
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    for k in grads:
        np.testing.assert_allclose(grads[k], tg[k].numpy(), rtol=1e-10, atol=1e-13, err_msg=k)
    tr = mod.Trainer(params, optimizer="sgd", lr=0.1)
    for name, at, value, shown in (("pr", (1, 0), 8, r"8 at \[1, 0\], outside 0..7"),
                                   ("pr", (2, 1), 3, r"3 at \[2, 1\], outside 0..2"),
                                   ("pr", (3, 2), 3, r"3 at \[3, 2\], outside 0..2"),   # a row of E, but a label too
                                   ("pr", (4, 2), -1, r"-1 at \[4, 2\], outside 0..2"),
                                   ("seq", (3, 4, 0), 6, r"6 at \[3, 4, 0\], outside 0..5"),
                                   ("seq", (0, 1, 1), 3, r"3 at \[0, 1, 1\], outside 0..2")):
        bad = {"pr": pr.copy(), "seq": seq.copy()}
        bad[name][at] = value
        for call in (lambda: mod.loss_and_grad(params, **bad), lambda: mod.forward(params, **bad),
                     lambda: tr.step(**bad)):
            with pytest.raises(ValueError, match=f"input '{name}' holds {shown}: the values there index"):
                call()
    assert tr.steps == 0


def test_a_bound_batch_dim_is_not_a_position_of_the_checks(tmp_path):
    """With --bind B, every row of a packed input became a position of its own: a range per row in the
    module, walked at every call."""
    unbound = compile_model(packed(), out=str(tmp_path / "free"), dtype="float64", order=1, warm_cache=False)
    bound = compile_model(packed(), out=str(tmp_path / "bound"), dtype="float64", order=1, warm_cache=False,
                          bind={"B": 4096, "T": T})
    assert bound._INDEX_BOUNDS == unbound._INDEX_BOUNDS
    pr = np.zeros((4096, 3), np.int64)
    pr[4000, 0] = 8
    with pytest.raises(ValueError, match=r"input 'pr' holds 8 at \[4000, 0\], outside 0..7"):
        bound.forward(bound.init_params(0), pr=pr, seq=np.zeros((T, 4096, 2), np.int64))


def test_a_batch_bound_to_ten_billion_rows_compiles(tmp_path):
    """The checks' analysis numbered every element of each int input at its bound size: --bind B=10**10
    asked numpy for 75 GiB and the CLI said "internal error". It reads the model before --bind now;
    a bound it names by a dim (labels into the classes C of an input's logits) is that dim's size."""
    free = compile_model(packed(), out=str(tmp_path / "free"), dtype="float64", order=1, warm_cache=False)
    huge = compile_model(packed(), out=str(tmp_path / "huge"), dtype="float64", order=1, warm_cache=False,
                         bind={"B": 10 ** 10, "T": T})
    assert huge._INDEX_BOUNDS == free._INDEX_BOUNDS
    m = gc.Model("int_named_classes")
    z, y = m.input("z", ("B", "C")), m.input("y", ("B",), dtype="int64")
    m.minimize(gc.softmax_cross_entropy(z * m.param("s", (), init="ones"), y))
    assert compile_model(m, out=str(tmp_path / "c"), order=1, warm_cache=False)._INDEX_BOUNDS == {"y": "C"}
    assert compile_model(m, out=str(tmp_path / "c5"), order=1, warm_cache=False,
                         bind={"C": 5})._INDEX_BOUNDS == {"y": 5}
    # a lookup nothing reads is no op of the module: its table's 3 rows do not limit y (review: y = 3 was refused)
    m = gc.Model("int_dead_take")
    x, y = m.input("x", ("B", 4)), m.input("y", ("B",), dtype="int64")
    gc.take(m.param("E", (3, 4), init="normal"), y)
    m.minimize(gc.softmax_cross_entropy(x @ m.param("W", (4, 4)), y))
    with pytest.warns(UserWarning, match="param 'E' does not reach the loss"):
        mod = compile_model(m, out=str(tmp_path / "dead"), dtype="float64", order=1, warm_cache=False)
    assert mod._INDEX_BOUNDS == {"y": 4}
    assert np.isfinite(mod.loss_and_grad(mod.init_params(0), x=np.ones((2, 4)), y=np.array([3, 0]))[0])


def test_a_numpy_table_is_a_constant_of_take(tmp_path):
    """gc.take refused a numpy array (numpy arrays are constants everywhere else): a one-hot table makes a
    per-row cross-entropy."""
    m = gc.Model("int_onehot")
    x, y = m.input("x", ("B", 4)), m.input("y", ("B",), dtype="int64")
    logits = x @ m.param("W", (4, 4))
    m.minimize(-(gc.log_softmax(logits, axis=-1) * gc.take(np.eye(4), y)).sum(axis=1).mean())
    mod = compile_model(m, out=str(tmp_path), dtype="float64", order=1, warm_cache=False)
    assert mod._INDEX_BOUNDS == {"y": 4}
    rng = np.random.default_rng(8)
    p, x, y = {"W": rng.standard_normal((4, 4))}, rng.standard_normal((B, 4)), rng.integers(0, 4, B)
    W = torch.tensor(p["W"], requires_grad=True)
    expected = torch.nn.functional.cross_entropy(torch.tensor(x) @ W, torch.tensor(y))
    expected.backward()
    loss, grads = mod.loss_and_grad(p, x=x, y=y)
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    np.testing.assert_allclose(grads["W"], W.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_a_bound_by_a_dim_whose_carrier_is_not_given_is_not_checked(tmp_path):
    """Labels read as table rows (10) by an output and as classes of an input table (V) by the loss: forward
    with the labels alone raised AssertionError (no input carries V), and so did the compile's warm-up."""
    m = gc.Model("int_carrier")
    y, tbl = m.input("y", ("B",), dtype="int64"), m.input("tbl", ("B", "V"))
    emb = gc.take(m.param("P", (10, 4), init="normal"), y)
    m.output("emb", emb)
    m.minimize(gc.softmax_cross_entropy(tbl, y) + (emb * emb).sum())
    mod = compile_model(m, out=str(tmp_path), dtype="float64", order=1)
    assert mod._INDEX_BOUNDS == {"y": {10: [(0, 1)], "V": [(0, 1)]}} and mod._OUTPUT_INPUTS == ("y",)
    p, y = mod.init_params(0), np.array([9, 0, 5])
    np.testing.assert_array_equal(mod.forward(p, y=y)["emb"], p["P"][y])
    with pytest.raises(ValueError, match=r"input 'y' holds 9 at \[0\], outside 0..3: .* index 4 classes"):
        mod.forward(p, y=y, tbl=np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"input 'y' holds 10 at \[2\], outside 0..9"):
        mod.forward(p, y=np.array([1, 2, 10]))


@pytest.mark.slow
def test_int_values_on_the_cuda_target_under_the_simulator(tmp_path):
    errors = json.loads(cuda_script(__file__, tmp_path))
    assert set(errors) == {"indexed", "scanned"} and all(e <= 1e-12 for e in errors.values()), errors


def _cuda_errors(out):
    """The largest difference of loss and gradients of each model's CUDA build from torch's."""
    errors = {}
    for name, (make, _) in MODELS.items():
        mod = gc.compile(make(), out=os.path.join(out, name), target="cuda", dtype="float64", order=1, warm="none")
        rng = np.random.default_rng(5)
        params = {k: rng.standard_normal(s) for k, s in mod.PARAM_SHAPES.items()}
        inputs = data(name, rng)
        _, expected, tg = torch_grads(name, params, inputs)
        loss, grads = mod.loss_and_grad(params, **inputs)
        errors[name] = max([abs(loss - expected.item())] +
                           [float(np.abs(grads[k] - tg[k].detach().numpy()).max()) for k in grads])
    return errors


if __name__ == "__main__":   # the CUDA check, in a process of its own (the simulator is chosen at import)
    print(json.dumps(_cuda_errors(sys.argv[1])))
