"""Indexing, concat/stack, take, batched matmul and random ops compiled: one model through every new
op, on the CPU target and (under numba-cuda's simulator, in a subprocess) the CUDA target, against
the interpreter and torch; and the per-row (microbatch) rules of the new ops."""
import json
import os

import numpy as np
import pytest

import gradc as gc
from gradc.interpret import evaluate
from gradc.ops.random import draw
from gradc.passes.pipeline import build_training_graph
from gradc.passes.rows import RowsError, loss_reduction
from conftest import cuda_script


def every_new_op():
    """take, concat, a batched matmul with a 2-D weight, dropout, noise, a batched product of two
    activations (one transposed), basic indexing with steps, stack."""
    m = gc.Model("ix_all")
    x = m.input("x", ("B", 5, 4))
    idx = m.input("i", ("B", 3), dtype="int64")
    seed = m.input("seed", (), dtype="int64")
    E = m.param("E", (7, 4), init="normal")
    W = m.param("W", (4, 6), init="normal")
    e = gc.take(E, idx)                                      # (B, 3, 4)
    h = gc.concat([x, e], axis=1)                            # (B, 8, 4)
    h = gc.tanh(h @ W)                                       # (B, 8, 6)
    h = gc.dropout(h, 0.25, seed)
    h = gc.gaussian_noise(h, 0.1, seed)
    m.output("h", h)
    s = gc.softmax(h @ gc.transpose(h, (0, 2, 1)), axis=-1)  # (B, 8, 8)
    o = s @ h                                                # (B, 8, 6)
    z = gc.stack([o[:, 0], o[:, -1], o[:, 1::3].sum(axis=1)], axis=1)   # (B, 3, 6)
    m.minimize(gc.mean(gc.square(z)))
    return m


def inputs_for(batch, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 5, 4)), "i": rng.integers(0, 7, (batch, 3)), "seed": np.array(42)}


def torch_loss(torch, p, i, mask, noise):
    e = torch.nn.functional.embedding(i["i"], p["E"])
    h = torch.tanh(torch.cat([i["x"], e], 1) @ p["W"]) * mask + 0.1 * noise
    o = torch.softmax(h @ h.transpose(1, 2), -1) @ h
    z = torch.stack([o[:, 0], o[:, -1], o[:, 1::3].sum(1)], 1)
    return (z ** 2).mean()


@pytest.mark.slow
def test_cpu_module_matches_the_interpreter_and_torch(build_dir):
    torch = pytest.importorskip("torch")
    m = every_new_op()
    mod = gc.compile(m, out=build_dir, dtype="float64", warm_cache=False)
    params, inputs = mod.init_params(0), inputs_for(3)
    graph = build_training_graph(m, "float64", order=2)
    rng = np.random.default_rng(1)
    v = {p: rng.standard_normal(params[p].shape) for p in params}
    ref = evaluate(graph, params, inputs, [graph.objective, graph.outputs["h"]] +
                   [graph.grads[p] for p in params] + [graph.hvps[p] for p in params], tangents=v)
    loss, grads = mod.loss_and_grad(params, **inputs)
    np.testing.assert_allclose(loss, ref[graph.objective], rtol=1e-13)
    hv = mod.hvp(params, v, **inputs)
    for p in params:
        np.testing.assert_allclose(grads[p], ref[graph.grads[p]], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(hv[p], ref[graph.hvps[p]], rtol=1e-12, atol=1e-14)
    # the same mask and noise as the interpreter's, and the same as every other call with this seed
    out = mod.forward(params, **inputs)
    np.testing.assert_allclose(out["h"], ref[graph.outputs["h"]], rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(mod.forward(params, **inputs)["h"], out["h"])
    other = mod.forward(params, **(inputs | {"seed": np.array(43)}))["h"]
    assert np.mean(other != out["h"]) > 0.99
    # against torch, with the interpreter's mask and noise
    mask, noise = draw("dropout", 0.25, np.array(42), 0, (3, 8, 6)), draw("normal", 0.0, np.array(42), 1, (3, 8, 6))
    tp = {k: torch.tensor(val, requires_grad=True) for k, val in params.items()}
    ti = {k: torch.tensor(val) for k, val in inputs.items()}
    t_loss = torch_loss(torch, tp, ti, torch.tensor(mask), torch.tensor(noise))
    t_grads = torch.autograd.grad(t_loss, [tp[p] for p in params], create_graph=True)
    t_hv = torch.autograd.grad(sum((g * torch.tensor(v[p])).sum() for p, g in zip(params, t_grads)),
                               [tp[p] for p in params])
    np.testing.assert_allclose(loss, t_loss.item(), rtol=1e-12)
    for p, g, h in zip(params, t_grads, t_hv):
        np.testing.assert_allclose(grads[p], g.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(hv[p], h.numpy(), rtol=1e-9, atol=1e-11)
    # an index outside the table is refused before any kernel runs
    bad = inputs | {"i": np.array([[0, 7, 1]] * 3)}
    with pytest.raises(ValueError, match=r"input 'i' holds 7 at \[0, 1\], outside 0..6"):
        mod.loss_and_grad(params, **bad)
    with pytest.raises(ValueError, match="input 'i' holds -1"):
        mod.forward(params, **(inputs | {"i": -np.ones((3, 3), dtype=np.int64)}))


def test_cuda_module_under_the_simulator_matches_the_interpreter(tmp_path):
    errors = json.loads(cuda_script(os.path.join(os.path.dirname(__file__), "indexing_cuda_runs.py"), tmp_path))
    assert errors and all(e <= 1e-12 for e in errors.values()), errors


# ---- rows: which of the new ops keep the batch rows apart (DESIGN.md §1.6) --------------------------
def _rows(build):
    m = gc.Model("rows")
    x = m.input("x", ("B", 4, 3))
    out = build(m, x)
    m.minimize(gc.mean(out) if out.ndim else out)
    return loss_reduction(m.graph, "B")


@pytest.mark.parametrize("build", [
    lambda m, x: x[:, 1:, ::2],
    lambda m, x: gc.concat([x, x * 2], axis=2),
    lambda m, x: gc.stack([x, x], axis=-1),
    lambda m, x: gc.take(m.param("E", (5, 2)), m.input("i", ("B", 2), dtype="int64")),
    lambda m, x: x @ m.param("W", (3, 2)),
    lambda m, x: x @ gc.transpose(x, (0, 2, 1)),
    lambda m, x: m.param("P", (2, 4)) @ x,
], ids=["slice", "concat", "stack", "take", "bmm_weight", "bmm_self", "bmm_left"])
def test_per_row_ops(build):
    assert _rows(build) == "mean"


@pytest.mark.parametrize("build,why", [
    (lambda m, x: gc.take(gc.reshape(x, ("B", 12)), m.input("i", (2,), dtype="int64")), "reads a table that holds batch rows"),
    (lambda m, x: gc.dropout(x, 0.5, m.input("seed", (), dtype="int64")),
     r"\(gc.dropout\) draws each value from its seed and the element's index in the whole batch"),
    (lambda m, x: gc.transpose(x, (1, 2, 0)) @ x.reshape(("B", 12)), "multiplies along the batch dim"),
], ids=["take_rows_table", "dropout", "bmm_across_rows"])
def test_ops_that_mix_rows_are_named(build, why):
    with pytest.raises(RowsError, match=why):
        _rows(build)
