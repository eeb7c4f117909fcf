"""Second order: every op's Hessian-vector product against float64 finite differences of the gradient;
closed forms, symmetry, shared weights, and bad input."""
import numpy as np
import pytest
import sympy as sp

import gradc as gc
from gradc.interpret import evaluate
from gradc.passes.pipeline import build_training_graph
from gradc.runtime import hessian

EPS = 1e-5


def assert_hvp_matches_fd(model, params, inputs, rng, rtol=1e-5, atol=1e-7):
    """H v (interpreter, float64) against (g(theta + eps v) - g(theta - eps v)) / 2 eps for a random v."""
    graph = build_training_graph(model, "float64", order=2)
    names = [p for p in graph.params if model.param_info[p]["trainable"]]
    v = {p: rng.standard_normal(np.shape(params[p])) for p in names}
    hv = evaluate(graph, params, inputs, [n for n in graph.hvps.values() if n is not None], tangents=v)
    grads = [n for n in graph.grads.values() if n is not None]

    def grad_at(sign):
        shifted = dict(params) | {p: params[p] + sign * EPS * v[p] for p in names}
        return evaluate(graph, shifted, inputs, grads)
    up, down = grad_at(1), grad_at(-1)
    for p in names:
        g = graph.grads[p]
        fd = (up[g] - down[g]) / (2 * EPS) if g is not None else np.zeros(np.shape(params[p]))
        got = hv[graph.hvps[p]] if graph.hvps[p] is not None else np.zeros_like(fd)
        np.testing.assert_allclose(got, fd, rtol=rtol, atol=atol, err_msg=f"(H v) for {p!r}")
    return graph


def _model_with(name, shape, build):
    """loss = sum(R * out * out), out = build(x * w, w2): the op sits between params and the loss, and
    the adjoint reaching it depends on the params too (so its VJP's own derivatives are exercised)."""
    m = gc.Model(name)
    x = m.input("x", shape)
    w = m.param("w", shape)
    w2 = m.param("w2", shape)
    out = build(x * w, w2)
    r = np.random.default_rng(7).standard_normal(out.shape)
    m.minimize((out * out * r).sum() if out.shape else out * out * float(r))
    return m


UNARY = ["exp", "log", "tanh", "sigmoid", "relu", "softplus", "gelu", "sin", "cos", "sqrt", "square", "abs"]


@pytest.mark.parametrize("op", UNARY)
def test_unary_hvp(op, rng):
    fn = getattr(gc, op)
    m = _model_with(f"h_{op}", (3, 4), lambda a, w2: fn(a) * w2 + fn(a * w2))
    params = {"w": rng.uniform(0.5, 1.5, (3, 4)), "w2": rng.uniform(0.5, 1.5, (3, 4))}
    assert_hvp_matches_fd(m, params, {"x": rng.uniform(0.5, 1.5, (3, 4)) * rng.choice([-1, 1], (3, 4))
                                      if op not in ("log", "sqrt") else rng.uniform(0.5, 1.5, (3, 4))}, rng)


@pytest.mark.parametrize("op,fn", [("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
                                   ("div", lambda a, b: a / (b * b + 1.0)), ("pow", lambda a, b: (a * a + 1.0) ** b),
                                   ("maximum", lambda a, b: gc.maximum(a, b) * a)])
@pytest.mark.parametrize("sb", [(3, 4), (4,), (3, 1), ()])
def test_binary_broadcast_hvp(op, fn, sb, rng):
    m = gc.Model(f"h2_{op}")
    x = m.input("x", (3, 4))
    a = m.param("a", (3, 4))
    b = m.param("b", sb)
    out = fn(x * a, b)
    m.minimize((out * out * np.random.default_rng(3).standard_normal((3, 4))).sum())
    params = {"a": rng.uniform(0.5, 1.5, (3, 4)), "b": np.array(rng.uniform(0.5, 1.5, sb))}
    assert_hvp_matches_fd(m, params, {"x": rng.standard_normal((3, 4))}, rng)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,))])
def test_matmul_and_layout_hvp(sa, sb, rng):
    m = gc.Model("h_mm")
    a = m.param("a", sa)
    b = m.param("b", sb)
    out = gc.tanh(a @ b)
    out = out + gc.transpose(out).T * 0.5 if out.ndim == 2 else out
    m.minimize(gc.sum(gc.square(out.reshape((-1,)))) + gc.sum(out))
    assert_hvp_matches_fd(m, {"a": rng.standard_normal(sa), "b": rng.standard_normal(sb)}, {}, rng)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, True), ((0, 2), False), (-1, True)])
def test_reduction_hvp(op, axis, keepdims, rng):
    m = _model_with(f"h_{op}", (2, 3, 4), lambda a, w2: getattr(gc, op)(gc.tanh(a) * w2, axis=axis, keepdims=keepdims) ** 2)
    params = {"w": rng.standard_normal((2, 3, 4)), "w2": rng.standard_normal((2, 3, 4))}
    assert_hvp_matches_fd(m, params, {"x": rng.standard_normal((2, 3, 4))}, rng)


@pytest.mark.parametrize("fn", [gc.softmax, gc.log_softmax])
@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_hvp(fn, axis, rng):
    m = _model_with("h_sm", (3, 4), lambda a, w2: fn(a * w2, axis=axis))
    params = {"w": rng.standard_normal((3, 4)), "w2": rng.standard_normal((3, 4))}
    assert_hvp_matches_fd(m, params, {"x": rng.standard_normal((3, 4))}, rng)


def test_losses_and_user_op_hvp(rng):
    soft = gc.elementwise("h_soft", lambda u, s: sp.log(1 + sp.exp(u * s)) / s + sp.Abs(u) * sp.sin(s))
    m = gc.Model("h_losses")
    x = m.input("x", ("N", 3))
    y = m.input("y", ("N",), dtype="int64")
    t = m.input("t", ("N", 4))
    w = m.param("w", (3, 4))
    s = m.param("s", (4,))
    z = soft(x @ w, s)
    scale = gc.sigmoid(gc.sum(s))             # the losses' adjoints depend on params too
    m.minimize(gc.softmax_cross_entropy(z, y) * scale + gc.mse(gc.sigmoid(z), t) * scale + gc.max(z) * scale,
               weight_decay=0.2)
    params = {"w": rng.standard_normal((3, 4)), "s": rng.uniform(0.5, 1.5, 4)}
    assert_hvp_matches_fd(m, params, {"x": rng.standard_normal((5, 3)), "y": rng.integers(0, 4, 5),
                                      "t": rng.uniform(0, 1, (5, 4))}, rng)


def test_piecewise_linear_ops_have_zero_curvature(rng):
    m = gc.Model("h_relu")
    x = m.input("x", (5,))
    w = m.param("w", (5,))
    m.minimize(gc.sum(gc.relu(x * w) + gc.abs(x - w) + gc.maximum(w, x)))
    graph = build_training_graph(m, "float64", order=2)
    out = evaluate(graph, {"w": rng.standard_normal(5)}, {"x": rng.standard_normal(5)},
                   [n for n in graph.hvps.values() if n is not None], tangents={"w": rng.standard_normal(5)})
    assert all(np.all(v == 0) for v in out.values())


# ---- the generated module ------------------------------------------------------------------------
def test_quadratic_hessian_is_its_matrix(build_dir, rng):
    a = rng.standard_normal((6, 6))
    a = a @ a.T
    m = gc.Model("h_quad")
    theta = m.param("theta", (6,), init="normal")
    c = m.param("c", (), init="ones")
    m.minimize(0.5 * (theta @ (a @ theta)) + gc.sum(theta) * 3.0 + c * c * 2.5)
    mod = gc.compile(m, out=build_dir, dtype="float64", warm_cache=False)
    H = mod.hessian(mod.init_params(0))
    expected = np.zeros((7, 7))
    expected[:6, :6] = a
    expected[6, 6] = 5.0
    np.testing.assert_allclose(H, expected, rtol=1e-12, atol=1e-12)
    v = {"theta": rng.standard_normal(6), "c": np.array(2.0)}
    hv = mod.hvp(mod.init_params(0), v)
    np.testing.assert_allclose(hv["theta"], a @ v["theta"], rtol=1e-12)
    assert hv["c"].shape == () and float(hv["c"]) == pytest.approx(10.0)


def test_hessian_of_shared_weights_dag_matches_fd_and_is_symmetric(build_dir, rng):
    m = gc.Model("h_shared")
    x = m.input("x", ("B", 3))
    y = m.input("y", ("B",), dtype="int64")
    w = m.param("W", (3, 3))
    b = m.param("b", (3,))
    frozen = m.param("F", (3, 3), init="normal", trainable=False)
    h = gc.tanh(x @ w + b)
    h = gc.softplus(h @ w) + h @ frozen           # W used twice, h fans out
    m.minimize(gc.softmax_cross_entropy(h, y) + gc.mean(gc.max(h, axis=1)), weight_decay=0.05)
    mod = gc.compile(m, out=build_dir, dtype="float64", warm_cache=False)
    params = mod.init_params(4)
    X, Y = rng.standard_normal((7, 3)), rng.integers(0, 3, 7)
    H = mod.hessian(params, x=X, y=Y)
    assert H.shape == (12, 12) and mod.GRAD_SIZE == 12
    np.testing.assert_array_equal(H, H.T)

    def flat(g):
        return np.concatenate([np.ravel(g[k]) for k in mod.TRAINABLE])
    fd = np.zeros((12, 12))
    for i in range(12):
        e = np.zeros(12)
        e[i] = 1e-6
        shifted = [{k: params[k] + s * e[a:b_].reshape(params[k].shape) if k in mod.GRAD_SLICES else params[k]
                    for k in params for a, b_ in [mod.GRAD_SLICES.get(k, (0, 0))]} for s in (1, -1)]
        fd[:, i] = (flat(mod.loss_and_grad(shifted[0], x=X, y=Y)[1]) -
                    flat(mod.loss_and_grad(shifted[1], x=X, y=Y)[1])) / 2e-6
    np.testing.assert_allclose(H, fd, rtol=1e-5, atol=1e-7)
    rows = mod.hessian_rows(params, 3, 7, x=X, y=Y)
    np.testing.assert_allclose(rows, H[3:7], rtol=1e-12, atol=1e-14)
    v = {k: rng.standard_normal(params[k].shape) for k in mod.TRAINABLE}
    hv = mod.hvp(params, v, x=X, y=Y)
    np.testing.assert_allclose(flat(hv), H @ flat(v), rtol=1e-10, atol=1e-12)


def test_bad_second_order_input(build_dir, tmp_path, monkeypatch):
    m = gc.Model("h_bad")
    x = m.input("x", ("B", 4))
    w = m.param("w", (4, 3))
    big = m.param("big", (400, 400))
    m.minimize(gc.sum(gc.tanh(x @ w)) + gc.sum(big * big))
    mod = gc.compile(m, out=build_dir, warm_cache=False)
    p = mod.init_params(0)
    X = np.ones((2, 4), np.float32)
    good = {"w": np.ones((4, 3), np.float32), "big": np.ones((400, 400), np.float32)}
    with pytest.raises(ValueError, match=r"v missing \['big'\]"):
        mod.hvp(p, {"w": good["w"]}, x=X)
    with pytest.raises(ValueError, match=r"unknown or not trainable \['z'\]"):
        mod.hvp(p, good | {"z": X}, x=X)
    with pytest.raises(ValueError, match=r"v\['w'\] has shape \(3, 4\), expected \(4, 3\)"):
        mod.hvp(p, good | {"w": np.ones((3, 4), np.float32)}, x=X)
    with pytest.raises(ValueError, match=r"v\['w'\] has dtype float64"):
        mod.hvp(p, good | {"w": np.ones((4, 3))}, x=X)
    monkeypatch.setattr(hessian, "available_bytes", lambda: 64 * 2**30)   # on any machine: the 102 GB never fit
    with pytest.raises(MemoryError, match=r"160012 x 160012 float32 values need 95.4 GiB, but only 64.0 GiB"):
        mod.hessian(p, x=X)                      # refused before anything is allocated
    with pytest.raises(ValueError, match=r"start 5 and stop 200000 must be within 0..160012 \(the Hessian has 160012 rows, 0..160011"):
        mod.hessian_rows(p, 5, 200000, x=X)
    with pytest.raises(ValueError, match=r"hessian_rows: start 5 is after stop 2 \(rows start..stop-1\)"):
        mod.hessian_rows(p, 5, 2, x=X)
    with pytest.raises(ValueError, match=r"hessian_rows: start must be an int, got 1.0"):
        mod.hessian_rows(p, 1.0, 3, x=X)
    first = gc.compile(m, out=str(tmp_path), order=1, warm_cache=False)
    with pytest.raises(RuntimeError, match="compiled with --order 1.*--order 2"):
        first.hvp(p, good, x=X)
    with pytest.raises(RuntimeError, match="--order 2"):
        first.hessian(p, x=X)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("parallel", [True, False])
def test_hessian_blocks_fill_every_row_once_with_or_without_threads(monkeypatch, shared, parallel):
    """in_blocks runs the first block alone where parallel kernels are loaded (it starts Numba's
    threading layer), then the rest on threads, or in order where two threads may not share them."""
    from gradc.runtime import hessian, kernel_cache
    monkeypatch.setattr(hessian, "_threads_may_share_parallel_kernels", lambda: shared)
    monkeypatch.setattr(kernel_cache, "any_parallel", lambda: parallel)
    calls = []

    def hvp_block(V, out):
        calls.append(int(np.argmax(V[0])))
        out[...] = V * 2.0 + np.arange(V.shape[1])

    H = np.full((70, 75), np.nan)
    hessian.in_blocks(hvp_block, H, first_row=5, workers=2)
    expected = 2.0 * np.eye(75)[5:75] + np.arange(75)
    np.testing.assert_array_equal(H, expected)
    assert sorted(calls) == [5, 5 + hessian.BLOCK_ROWS, 5 + 2 * hessian.BLOCK_ROWS]
    if parallel:
        assert calls[0] == 5
    if not shared:
        assert calls == sorted(calls)


def test_powers_at_a_zero_base_have_finite_gradients_and_hvps():
    """d(x**n)/dx was n*Y/x with Y = x**n (sympy's form, the output reused): 0/0 = NaN wherever x = 0, so a
    trial's ((x - t)**2).mean() had NaN gradients where x == t, and relu(h)**2 where a unit was off. The
    gradients and H v at exact zeros, against torch (float64)."""
    import torch
    m = gc.Model("pow_at_zero")
    x, t = m.input("x", ("B", 2)), m.input("t", ("B", 2))
    W = m.param("W", (2, 2))
    m.minimize(((x @ W - t) ** 2).mean() + (gc.relu(x @ W) ** 2).mean() + ((x @ W) ** 3).mean())
    X, T = np.array([[1., 2.], [0., 0.], [3., -4.]]), np.array([[-1., 0.], [0., 4.5], [-5., 4.]])
    Wv, v = np.array([[1., -1.], [2., -3.]]), np.array([[0.5, -1.], [2., 0.25]])   # x @ W - t is 0 at [0, 0], [1, :]
    graph = build_training_graph(m, "float64", order=2)
    out = evaluate(graph, {"W": Wv}, {"x": X, "t": T}, [graph.grads["W"], graph.hvps["W"]], tangents={"W": v})

    def loss(w):
        h = torch.tensor(X) @ w
        return ((h - torch.tensor(T)) ** 2).mean() + (torch.relu(h) ** 2).mean() + (h ** 3).mean()
    w = torch.tensor(Wv, requires_grad=True)
    (g,) = torch.autograd.grad(loss(w), w, create_graph=True)
    (hv,) = torch.autograd.grad(g, w, torch.tensor(v))
    np.testing.assert_allclose(out[graph.grads["W"]], g.detach().numpy(), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(out[graph.hvps["W"]], hv.numpy(), rtol=1e-13, atol=1e-13)


def test_a_negative_base_to_a_param_power_compiles_and_follows_torch(tmp_path):
    """d/dp (-2)**p is (-2)**p log(-2), which sympy evaluates to a complex log(2) + I pi: the kernel did not
    compile (Numba: a complex into a float array). The real value there is NaN, as torch's; the loss
    ((-2)**p at whole p) and the other gradients are as torch's."""
    import torch
    m = gc.Model("negative_base")
    x = m.input("x", ("B", 3))
    p, w = m.param("p", (3,)), m.param("w", (3,))
    m.minimize(((-2.0) ** p * x).sum() + (w * x * x).sum())
    rng = np.random.default_rng(2)
    X = rng.normal(size=(4, 3))
    P = {"p": np.array([2.0, 3.0, 1.0]), "w": rng.normal(size=3)}
    mod = gc.compile(m, out=str(tmp_path / "build"), dtype="float64", order=1)
    loss, grads = mod.loss_and_grad(P, x=X)
    T = {k: torch.tensor(v, requires_grad=True) for k, v in P.items()}
    want = ((-2.0) ** T["p"] * torch.tensor(X)).sum() + (T["w"] * torch.tensor(X) ** 2).sum()
    want_p, want_w = torch.autograd.grad(want, [T["p"], T["w"]])
    assert loss == pytest.approx(want.item(), rel=1e-13)
    assert np.isnan(grads["p"]).all() and torch.isnan(want_p).all()
    np.testing.assert_allclose(grads["w"], want_w.numpy(), rtol=1e-13)
    graph = build_training_graph(m, "float64")
    out = evaluate(graph, P, {"x": X}, [graph.grads["p"], graph.grads["w"]])
    assert np.isnan(out[graph.grads["p"]]).all()
    np.testing.assert_allclose(out[graph.grads["w"]], want_w.numpy(), rtol=1e-13)


def test_a_varying_power_at_a_zero_base_follows_torch():
    """base ** exponent with both varying: d/d exponent was b**e * log(b), 0 * -inf = NaN at b = 0, and
    d/d base e * b**(e - 1), 0 * inf at b = e = 0 (a trial's learned exponent on relu's outputs, GeM
    pooling, had a NaN gradient at every step). Now 0 there, as torch's; H v, where torch's own is NaN,
    against central differences of the gradient (float64)."""
    import torch
    m = gc.Model("pow_varying_at_zero")
    x = m.input("x", ("B", 3))
    W, p = m.param("W", (3, 2)), m.param("p", ())
    a, b = m.param("a", (3,)), m.param("b", (3,))
    m.minimize((gc.relu(x @ W) ** (p * 3.0)).mean() + (a ** b).sum())
    rng = np.random.default_rng(5)
    X = rng.normal(size=(6, 3))
    P = {"W": rng.normal(size=(3, 2)), "p": np.array(0.8), "a": np.array([0.0, 0.0, 1.5]),
         "b": np.array([2.0, 0.0, -0.5])}
    V = {k: rng.normal(size=np.shape(v)) for k, v in P.items()}
    V["a"][:2] = V["b"][:2] = 0.0   # (a step along them leaves the zero base: no difference quotient there)
    graph = build_training_graph(m, "float64", order=2)
    wanted = [graph.grads[k] for k in P]
    out = evaluate(graph, P, {"x": X}, wanted + [graph.hvps[k] for k in P], tangents=V)
    T = {k: torch.tensor(v, requires_grad=True) for k, v in P.items()}
    h = torch.tensor(X) @ T["W"]
    grads = torch.autograd.grad((torch.relu(h) ** (T["p"] * 3.0)).mean() + (T["a"] ** T["b"]).sum(), list(T.values()))
    assert (np.asarray(X) @ P["W"] <= 0).any()   # some units are off: relu's output is exactly 0 there
    for k, g in zip(P, grads):
        np.testing.assert_allclose(out[graph.grads[k]], g.numpy(), rtol=1e-13, atol=1e-13, err_msg=k)

    def gradient(shift):
        q = {k: v + shift * V[k] for k, v in P.items()}
        return evaluate(graph, q, {"x": X}, wanted)
    up, down = gradient(1e-6), gradient(-1e-6)
    for k, n in zip(P, wanted):
        np.testing.assert_allclose(out[graph.hvps[k]], (up[n] - down[n]) / 2e-6, rtol=1e-6, atol=1e-7, err_msg=k)
