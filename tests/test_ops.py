"""Every op's gradient against float64 central finite differences, through the interpreter."""
import numpy as np
import pytest
import sympy as sp
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import gradc as gc
from gradc.interpret import evaluate
from gradc.passes.pipeline import build_training_graph

from conftest import assert_grads_match_fd

UNARY = {
    "exp": (gc.exp, "any"), "log": (gc.log, "positive"), "tanh": (gc.tanh, "any"),
    "sigmoid": (gc.sigmoid, "any"), "relu": (gc.relu, "any"), "softplus": (gc.softplus, "any"),
    "gelu": (gc.gelu, "any"), "sin": (gc.sin, "any"), "cos": (gc.cos, "any"), "sqrt": (gc.sqrt, "positive"),
    "square": (gc.square, "any"), "abs": (gc.abs, "any"), "neg": (lambda t: -t, "any"),
}


def _values(rng, shape, domain):
    if domain == "positive":
        v = rng.uniform(0.5, 2.0, shape)
    elif domain == "nonzero":
        v = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        v = rng.standard_normal(shape)
    return np.array(v, dtype=np.float64)   # 0-d arrays too, so FD can perturb them in place


def _weighted_sum(model, out, rng):
    """sum(out * R) with random R, so that every output element matters differently."""
    r = rng.standard_normal(out.shape)
    model.minimize((out * r).sum() if out.shape else out * float(r))


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 2)])
def test_unary_gradient(name, shape, rng):
    fn, domain = UNARY[name]
    m = gc.Model(f"u_{name}")
    x = m.input("x", shape)
    w = m.param("w", shape)
    out = fn(x * w)
    _weighted_sum(m, out, rng)
    params = {"w": _values(rng, shape, "positive")}
    assert_grads_match_fd(m, params, {"x": _values(rng, shape, domain)})


BINARY = {
    "add": (lambda a, b: a + b, "any", "any"), "sub": (lambda a, b: a - b, "any", "any"),
    "mul": (lambda a, b: a * b, "any", "any"), "div": (lambda a, b: a / b, "any", "nonzero"),
    "pow": (lambda a, b: a ** b, "positive", "any"), "maximum": (gc.maximum, "any", "any"),
}


@pytest.mark.parametrize("name", sorted(BINARY))
@settings(max_examples=12, deadline=None)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
       seed=st.integers(0, 2**16))
def test_binary_broadcast_gradient(name, shapes, seed):
    fn, da, db = BINARY[name]
    rng = np.random.default_rng(seed)
    sa, sb = shapes.input_shapes
    m = gc.Model(f"b_{name}")
    a = m.input("a", sa)
    b = m.param("b", sb)
    out = fn(a, b)
    assert out.shape == np.broadcast_shapes(sa, sb)
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {"b": _values(rng, sb, db)}, {"a": _values(rng, sa, da)})


def test_python_scalars_and_arrays_as_constants(rng):
    m = gc.Model("consts")
    x = m.input("x", (3, 4))
    c = rng.standard_normal((4,))
    out = (2.0 - x) * c / 3 + x ** 2 + 1.5 ** x + c * x
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {}, {"x": rng.standard_normal((3, 4))})


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,))])
def test_matmul_gradient(sa, sb, rng):
    m = gc.Model("mm")
    a = m.input("a", sa)
    b = m.param("b", sb)
    out = a @ b
    assert out.shape == np.matmul(np.ones(sa), np.ones(sb)).shape
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {"b": rng.standard_normal(sb)}, {"a": rng.standard_normal(sa)})


def test_matmul_chains_with_transposes(rng):
    m = gc.Model("mmt")
    a = m.input("a", (3, 4))
    w = m.param("w", (5, 4))
    v = m.param("v", (3, 5))
    out = (a @ w.T).T @ v + gc.matmul(v.T, a @ w.T)
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {"w": rng.standard_normal((5, 4)), "v": rng.standard_normal((3, 5))},
                          {"a": rng.standard_normal((3, 4))})


@pytest.mark.parametrize("axes", [None, (0, 1, 2), (2, 0, 1), (1, 0, 2)])
def test_transpose_gradient(axes, rng):
    m = gc.Model("tr")
    x = m.input("x", (2, 3, 4))
    out = gc.transpose(x, axes) * m.param("w", tuple(np.transpose(np.ones((2, 3, 4)), axes).shape))
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {"w": rng.standard_normal(out.shape)}, {"x": rng.standard_normal((2, 3, 4))})


@pytest.mark.parametrize("target", [(6, 4), (-1,), (4, -1, 2), (24, 1), (1, 2, 12)])
def test_reshape_gradient(target, rng):
    m = gc.Model("rs")
    x = m.input("x", (2, 3, 4))
    out = gc.tanh(x.reshape(target))
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {}, {"x": rng.standard_normal((2, 3, 4))})


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (1,), (-3, -1)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduction_gradient(op, axis, keepdims, rng):
    m = gc.Model(f"r_{op}")
    x = m.input("x", (2, 3, 4))
    out = getattr(gc, op)(x * 1.5, axis=axis, keepdims=keepdims)
    assert out.shape == getattr(np, op)(np.ones((2, 3, 4)), axis=axis, keepdims=keepdims).shape
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {}, {"x": rng.standard_normal((2, 3, 4))})


def test_tensor_methods_match_functions(rng):
    m = gc.Model("methods")
    x = m.input("x", (3, 4))
    out = x.sum(axis=0) + x.mean(axis=0, keepdims=False) + x.max(axis=0) + x.T.sum(axis=1)
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {}, {"x": rng.standard_normal((3, 4))})


@pytest.mark.parametrize("fn", [gc.softmax, gc.log_softmax])
@pytest.mark.parametrize("shape,axis", [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1), ((5,), 0)])
def test_softmax_gradient(fn, shape, axis, rng):
    m = gc.Model("sm")
    x = m.input("x", shape)
    out = fn(x, axis=axis)
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {}, {"x": rng.standard_normal(shape) * 3})


def test_softmax_cross_entropy_gradient_and_value(rng):
    m = gc.Model("ce")
    z = m.input("z", ("N", 4))
    y = m.input("y", ("N",), dtype="int64")
    w = m.param("w", (4, 4))
    m.minimize(gc.softmax_cross_entropy(z @ w, y))
    zv, yv, wv = rng.standard_normal((5, 4)), rng.integers(0, 4, 5), rng.standard_normal((4, 4))
    graph = assert_grads_match_fd(m, {"w": wv}, {"z": zv, "y": yv})
    logits = zv @ wv
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    expected = -logp[np.arange(5), yv].mean()
    got = evaluate(graph, {"w": wv}, {"z": zv, "y": yv}, [graph.objective])[graph.objective]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_mse_gradient_and_value(rng):
    m = gc.Model("mse")
    p = m.input("p", (3, 2))
    t = m.input("t", (3, 2))
    m.minimize(gc.mse(gc.sigmoid(p), t))
    pv, tv = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    graph = assert_grads_match_fd(m, {}, {"p": pv, "t": tv})
    expected = np.mean((1 / (1 + np.exp(-pv)) - tv) ** 2)
    got = evaluate(graph, {}, {"p": pv, "t": tv}, [graph.objective])[graph.objective]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_user_elementwise_ops(rng):
    mish = gc.elementwise("mish_t", lambda u: u * sp.tanh(sp.log(1 + sp.exp(u))))
    blend = gc.elementwise("blend_t", lambda a, b: a * sp.exp(-b ** 2) + sp.Abs(a - b) + sp.Max(a, 2 * b))
    m = gc.Model("user")
    x = m.input("x", (3, 4))
    w = m.param("w", (4,))
    out = blend(mish(x), w)
    _weighted_sum(m, out, rng)
    assert_grads_match_fd(m, {"w": rng.standard_normal(4)}, {"x": rng.standard_normal((3, 4))})


def test_piecewise_and_heaviside_user_ops_are_sympys_formulas(rng):
    """A Piecewise op evaluates its clauses in order and differentiates clause by clause; Heaviside(0) is
    sympy's 1/2 (H0 given: that value), its derivative 0: values, gradients and Hessians against torch."""
    huber = gc.elementwise("huber_t", lambda u: sp.Piecewise((u ** 2 / 2, sp.Abs(u) <= 1), (sp.Abs(u) - sp.S.Half, True)))
    gate = gc.elementwise("gate_t", lambda u, c: sp.Piecewise((c * sp.tanh(u), (u > 0) & (c > 0)), (sp.exp(u) * c, True))
                          + sp.Heaviside(u - 1) * u + sp.Heaviside(u, 0) * c)
    m = gc.Model("piecewise")
    x = m.input("x", (9,))
    c = m.param("c", (9,))
    y = gate(huber(x) * 2, c)
    m.output("y", y)
    m.minimize((y * y).sum())
    xv = np.array([-2.0, -1.0, -0.3, 0.0, 0.25, 0.5, 1.0, 1.5, 2.5])   # |x| = 1 and u = 1 take the first clause
    cv = rng.standard_normal(9)
    cv[:3] = np.abs(cv[:3])

    def torch_y(xt, ct):
        h = torch.where(xt.abs() <= 1, xt ** 2 / 2, xt.abs() - 0.5) * 2
        g = torch.where((h > 0) & (ct > 0), ct * torch.tanh(h), torch.exp(h) * ct)
        step = lambda u, at0: torch.where(u > 0, 1.0, torch.where(u == 0, at0, 0.0)).detach()   # torch's heaviside, a constant
        return g + step(h - 1, 0.5) * h + step(h, 0.0) * ct
    graph = build_training_graph(m, "float64")
    got = evaluate(graph, {"c": cv}, {"x": xv}, [graph.outputs["y"], graph.grads["c"], graph.input_grads["x"]])
    xt, ct = torch.tensor(xv, requires_grad=True), torch.tensor(cv, requires_grad=True)
    yt = torch_y(xt, ct)
    np.testing.assert_allclose(got[graph.outputs["y"]], yt.detach().numpy(), rtol=1e-14)
    # x = +-1: huber's first clause gives 1/2, so u = 1 and Heaviside(u - 1) = 1/2; x = 0: u = 0, Heaviside(u, 0) = 0
    np.testing.assert_allclose(got[graph.outputs["y"]][[1, 6]], cv[[1, 6]] * np.tanh(1.0) * (cv[[1, 6]] > 0)
                               + np.exp(1.0) * cv[[1, 6]] * (cv[[1, 6]] <= 0) + 0.5 + cv[[1, 6]], rtol=1e-14)
    loss = (yt * yt).sum()
    gc_, gx = torch.autograd.grad(loss, [ct, xt], create_graph=True)
    np.testing.assert_allclose(got[graph.grads["c"]], gc_.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(got[graph.input_grads["x"]], gx.detach().numpy(), rtol=1e-13)
    hess = torch.autograd.functional.hessian(lambda ct: (torch_y(torch.tensor(xv), ct) ** 2).sum(), torch.tensor(cv))
    order2 = build_training_graph(m, "float64", order=2)
    v = rng.standard_normal(9)
    hv = evaluate(order2, {"c": cv}, {"x": xv}, [order2.hvps["c"]], tangents={"c": v})[order2.hvps["c"]]
    np.testing.assert_allclose(hv, hess.numpy() @ v, rtol=1e-12)


def test_heaviside_is_exactly_one_above_zero_whatever_its_value_at_zero():
    """Found by a review: written as Step + 2 H0 (Tie - Step), H0 = 0.7 gave 1 - 1 ulp above 0."""
    m = gc.Model("heaviside_h0")
    x = m.input("x", (3,))
    step_at = lambda h0: (lambda u: sp.Heaviside(u, h0))
    hs = [gc.elementwise(f"heaviside_{i}", step_at(h0)) for i, h0 in enumerate((0.7, 1 / 3, 0.58))]
    outs = [h(x) for h in hs]
    for i, o in enumerate(outs):
        m.output(f"h{i}", o)
    m.minimize(sum(((o * x).sum() for o in outs[1:]), (outs[0] * x).sum()))
    graph = build_training_graph(m, "float64")
    got = evaluate(graph, {}, {"x": np.array([2.0, 0.0, -2.0])}, [graph.outputs[f"h{i}"] for i in range(3)])
    for node, h0 in zip(got, (0.7, 1 / 3, 0.58)):
        assert got[node].tolist() == [1.0, h0, 0.0]


def test_weight_decay_is_in_the_objective(rng):
    m = gc.Model("wd")
    x = m.input("x", (4, 3))
    w = m.param("w", (3, 2))
    b = m.param("b", (2,))                 # 1-D: no decay by default
    v = m.param("v", (2,), decay=True)      # opted in
    m.minimize(((x @ w + b) * v).sum(), weight_decay=0.3)
    params = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2), "v": rng.standard_normal(2)}
    inputs = {"x": rng.standard_normal((4, 3))}
    graph = assert_grads_match_fd(m, params, inputs)
    base = ((inputs["x"] @ params["w"] + params["b"]) * params["v"]).sum()
    expected = base + 0.15 * ((params["w"] ** 2).sum() + (params["v"] ** 2).sum())
    got = evaluate(graph, params, inputs, [graph.objective])[graph.objective]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_kink_conventions_follow_pytorch():
    """relu'(0) = 0, abs'(0) = 0, maximum splits a tie evenly, max picks the first maximum."""
    m = gc.Model("kinks")
    x = m.input("x", (4,))
    y = m.input("y", (4,))
    m.minimize(gc.relu(x).sum() + gc.abs(x).sum() + gc.maximum(x, y).sum() + gc.max(y))
    graph = build_training_graph(m, "float64")
    xv = np.array([0.0, 1.0, -1.0, 2.0])
    yv = np.array([0.0, 3.0, 3.0, 2.0])      # ties with x at 0 and 3; y's max 3 appears twice
    out = evaluate(graph, {}, {"x": xv, "y": yv}, [graph.input_grads["x"], graph.input_grads["y"]])
    np.testing.assert_array_equal(out[graph.input_grads["x"]], [0 + 0 + 0.5, 1 + 1 + 0, 0 - 1 + 0, 1 + 1 + 0.5])
    np.testing.assert_array_equal(out[graph.input_grads["y"]], [0.5, 1 + 1, 1, 0.5])


def test_integer_inputs_are_never_differentiated(rng):
    m = gc.Model("ints")
    z = m.input("z", (3, 4))
    y = m.input("y", (3,), dtype="int32")
    m.minimize(gc.softmax_cross_entropy(z, y))
    graph = build_training_graph(m, "float64")
    assert "y" not in graph.input_grads and "z" in graph.input_grads


def test_param_that_does_not_reach_the_loss_gets_no_gradient_node(rng):
    m = gc.Model("unused")
    x = m.input("x", (3,))
    w = m.param("w", (3,))
    m.param("lonely", (2, 2))
    m.minimize((x * w).sum())
    graph = build_training_graph(m, "float64")
    assert graph.grads["lonely"] is None and graph.grads["w"] is not None
