"""gradc/ops/fused_reduce.py: a sum, mean or max of an elementwise expression in one loop (CPU builds), against
torch and the interpreter, over every path of its kernel (a number, the last axis reduced or kept, keepdims)."""
import json

import numpy as np
import pytest
import torch

import gradc as gc
from gradc.interpret import evaluate
from gradc.passes.pipeline import build_training_graph


def _terms(x, y, W, b, f):
    """The loss's terms, each a reduction of an elementwise expression (f: gradc's functions or torch's)."""
    h = f["tanh"](x @ W + b)                                   # (B, 3, 4)
    t2 = f["sum"](h * y, (0,), False)                          # (3, 4): the last axis kept
    return [f["mean"]((h - y) ** 2, (0, 1, 2), False),         # a number
            f["mean"](t2 * t2, (0, 1), False),
            f["sum"](f["max"](abs(h - y), (2,), False), (0, 1), False),   # a max over the last axis
            f["mean"](f["sum"](h * h, (1, 2), True), (0, 1, 2), False),    # keepdims, two axes with the last
            0.01 * f["mean"](f["sum"](f["exp"](x), (1,), False), (0, 1), False),   # a middle axis
            f["mean"](f["sum"](h * x, (2,), False), (0, 1), False)]    # the last axis alone (four lanes)


OURS = {"tanh": gc.tanh, "exp": gc.exp, "sum": lambda v, a, k: v.sum(axis=a, keepdims=k),
        "mean": lambda v, a, k: v.mean(axis=a, keepdims=k), "max": lambda v, a, k: v.max(axis=a, keepdims=k)}
TORCH = {"tanh": torch.tanh, "exp": torch.exp, "sum": lambda v, a, k: v.sum(dim=a, keepdim=k),
         "mean": lambda v, a, k: v.mean(dim=a, keepdim=k), "max": lambda v, a, k: v.amax(dim=a, keepdim=k)}


def _model():
    m = gc.Model("fused_reductions")
    x, y = m.input("x", ("B", 3, 4)), m.input("y", ("B", 3, 4))
    W, b = m.param("W", (4, 4)), m.param("b", (4,), init="normal", decay=True)   # (||b||^2: a vector's lanes)
    m.minimize(sum(_terms(x, y, W, b, OURS)), weight_decay=0.1)
    return m


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), pytest.param("float32", 2e-5, marks=pytest.mark.slow)])
def test_fused_reductions_match_torch(tmp_path, dtype, rtol):
    m = _model()
    mod = gc.compile(m, out=str(tmp_path), dtype=dtype, order=1, warm=False)
    graph = json.loads((tmp_path / "fused_reductions.graph.json").read_text())
    ops = {n["op"] for n in graph["nodes"]}
    assert {"fused_sum", "fused_mean", "fused_max"} <= ops and "square" not in ops, ops   # (the decay's too)
    rng = np.random.default_rng(11)
    params = {"W": rng.standard_normal((4, 4)).astype(dtype), "b": rng.standard_normal(4).astype(dtype)}
    inputs = {k: rng.standard_normal((5, 3, 4)).astype(dtype) for k in ("x", "y")}
    loss, grads = mod.loss_and_grad(params, **inputs)
    W, b = (torch.tensor(params[k], dtype=torch.float64, requires_grad=True) for k in ("W", "b"))
    x, y = (torch.tensor(inputs[k], dtype=torch.float64) for k in ("x", "y"))
    expected = sum(_terms(x, y, W, b, TORCH)) + 0.05 * ((W ** 2).sum() + (b ** 2).sum())
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=rtol)
    np.testing.assert_allclose(grads["W"], W.grad.numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(grads["b"], b.grad.numpy(), rtol=rtol, atol=rtol)
    # the interpreter evaluates the fused graph as the module computes it
    g = build_training_graph(m, dtype, order=1)
    assert any(g.op(n) == "fused_max" for n in g.nx.nodes)
    value = evaluate(g, params, inputs, [g.objective], dtype=np.dtype(dtype).type)[g.objective]
    assert float(value) == pytest.approx(loss, rel=10 * rtol)


def test_a_value_read_twice_or_returned_is_not_folded(tmp_path):
    """The square a model also outputs, and one two sums read, keep their buffers (they are read elsewhere)."""
    m = gc.Model("kept_squares")
    x = m.input("x", ("B", 3))
    s = x * m.param("w", (3,))
    sq = s * s
    m.output("sq", sq)
    t = gc.exp(s)
    m.minimize(sq.sum() + t.sum() + t.mean())
    g = build_training_graph(m, "float64", order=1)
    for kept, reductions in ((sq, ["sum"]), (t, ["mean", "sum"])):
        assert sorted(g.op(u) for u in g.users(kept.node) if g.node(u)["phase"] == "forward") == reductions
    assert "fused_sum" in [g.op(n) for n in g.nx.nodes]   # (the backward's sum over the rows of g * x is one loop)
