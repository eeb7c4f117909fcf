"""The generated module against the interpreter on composite DAGs (float64), and float32 behaviour."""
import math
import re

import numpy as np
import pytest
import sympy as sp
import torch

import gradc as gc
from gradc.codegen.work_sizes import WorkSizes
from gradc.codegen.entry import BODY_CONST_LIMIT, array_source
from gradc.interpret import evaluate
from gradc.ops import get_op
from gradc.passes.pipeline import build_training_graph
from gradc.runtime import blas
from gradc.runtime.blas import matmul_into



def mlp_weight_decay():
    m = gc.Model("cg_mlp")
    x = m.input("x", ("B", 5))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (5, 7)) + m.param("b0", (7,)))
    h = h @ m.param("W1", (7, 3)) + m.param("b1", (3,))
    m.output("logits", h)
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=0.01)
    return m


def shared_weights():
    m = gc.Model("cg_shared")
    x = m.input("x", ("B", 4))
    w = m.param("W", (4, 4))
    h = gc.tanh(x @ w)
    h = gc.sigmoid(h @ w) + h          # W used twice, h fans out
    m.output("h", h)
    m.minimize(gc.mse(h, x))
    return m


def reused_input():
    m = gc.Model("cg_reuse")
    x = m.input("x", ("B", 3))
    w = m.param("w", (3,))
    out = x * x * w + gc.exp(-x) * x + (x @ w.reshape((3, 1))).sum()
    m.minimize(out.mean())
    return m


def residual():
    m = gc.Model("cg_residual")
    x = m.input("x", ("B", 6))
    t = m.input("t", ("B", 6))
    h = x
    skips = []
    for i in range(3):
        f = gc.relu(h @ m.param(f"W{i}", (6, 6)) + m.param(f"b{i}", (6,)))
        h = h + f                        # skip connection
        skips.append(h)
    out = h + skips[0] * 0.5             # a long skip
    m.output("out", out)
    m.minimize(gc.mse(out, t))
    return m


def frozen_and_unused():
    m = gc.Model("cg_frozen")
    x = m.input("x", ("B", 3))
    frozen = m.param("E", (3, 3), init="normal", trainable=False)
    w = m.param("w", (3, 2))
    m.param("unused", (2,), init="ones")
    m.minimize(gc.softplus(x @ frozen @ w).sum(), weight_decay=0.1)
    return m


def reductions_and_attention():
    m = gc.Model("cg_attention")
    x = m.input("x", ("T", 4))
    wq = m.param("Wq", (4, 4))
    wk = m.param("Wk", (4, 4))
    scores = (x @ wq) @ (x @ wk).T / 2.0
    att = gc.softmax(scores, axis=-1) @ x
    pooled = gc.max(att, axis=0) + att.mean(axis=0) - gc.log_softmax(att, axis=0).sum(axis=0, keepdims=True).reshape((4,))
    m.output("pooled", pooled)
    m.minimize(gc.sum(pooled * pooled))
    return m


def user_ops():
    mish = gc.elementwise("cg_mish", lambda u: u * sp.tanh(sp.log(1 + sp.exp(u))))
    huber = gc.elementwise("cg_huber", lambda u: sp.Piecewise((u ** 2 / 2, sp.Abs(u) <= 1), (sp.Abs(u) - sp.S.Half, True))
                           + sp.Heaviside(u - 2, 0.7) * u)
    m = gc.Model("cg_user")
    x = m.input("x", ("B", 4))
    w = m.param("w", (4, 4))
    h = mish(x @ w)
    out = gc.maximum(h, -h * 0.3) + gc.abs(h) + gc.gelu(h) + gc.sqrt(gc.square(h) + 1.0) + huber(h * 2.0)
    m.minimize(gc.mean(out) + gc.mean(gc.sin(x) * gc.cos(out)))
    return m


def layout_ops():
    m = gc.Model("cg_layout")
    x = m.input("x", ("B", 2, 3))
    w = m.param("w", (6, 4))
    h = gc.transpose(x, (0, 2, 1)).reshape(("B", 6))       # (B, 6)
    g = x.reshape(("B", -1)) @ w                            # (B, 4)
    out = h.sum(axis=1, keepdims=True) * g
    m.minimize((out ** 2).mean())
    return m


def scalars():
    m = gc.Model("cg_scalars")
    x = m.input("x", ("B", 3))
    temp = m.input("temp", ())
    s = m.param("s", (), init="ones")
    w = m.param("w", (3,), init="uniform")
    logits = x * w / (temp * s)
    m.output("scale", s * 2.0)
    m.minimize(gc.log_softmax(logits, axis=1).mean() * -1.0 + s * s)
    return m


def constants_and_array_init():
    big = np.linspace(-1.0, 1.0, 600).reshape(20, 30)
    m = gc.Model("cg_consts")
    x = m.input("x", ("B", 20))
    w = m.param("w", (30,), init=np.linspace(0.1, 0.3, 30))
    out = (x @ big) * w + big.sum(axis=0)
    m.output("out", out)
    m.minimize(gc.mean(gc.tanh(out)))
    return m


def integer_labels_int32():
    m = gc.Model("cg_int32")
    x = m.input("x", ("B", 3))
    y = m.input("y", ("B",), dtype="int32")
    w = m.param("w", (3, 5))
    logits = x @ w
    m.minimize(gc.softmax_cross_entropy(logits, y) + gc.softmax_cross_entropy(logits * 2.0, y))
    return m


def deep_chain():
    m = gc.Model("cg_deep")
    x = m.input("x", ("B", 4))
    h = x
    for i in range(12):
        h = gc.tanh(h @ m.param(f"W{i}", (4, 4))) + h * 0.1
    m.minimize(gc.mean(h * h))
    return m


def broadcast_patterns():
    m = gc.Model("cg_broadcast")
    x = m.input("x", ("B", 3, 4))
    a = m.param("a", (1, 4), init="normal")
    b = m.param("b", (3, 1), init="normal")
    c = m.param("c", (4,), init="normal")
    s = m.param("s", (), init="ones")
    out = gc.tanh(x * a + b) - x / (c * c + 1.0) * s + (a + b)      # (B,3,4), (1,4), (3,1), (4,), ()
    m.output("out", out)
    m.minimize(gc.mean(out * out) + gc.sum(a * b))
    return m


def reductions_rank3():
    m = gc.Model("cg_reduce3")
    x = m.input("x", ("B", 3, 4))
    w = m.param("w", (3, 4), init="normal")
    h = x * w
    r = gc.sum(h, axis=(0, 2), keepdims=True) * gc.max(h, axis=(0, 2), keepdims=True)   # (1, 3, 1)
    q = gc.max(h, axis=1) + gc.mean(h, axis=(1,))                                          # (B, 4)
    z = gc.softmax(h, axis=1) * r + gc.log_softmax(h, axis=0)
    m.output("q", q)
    m.minimize(gc.mean(z) + gc.mean(q * q) + gc.max(h) * 0.1)
    return m


def row_params_and_objective_output():
    """Params of shape (1, N), (N, 1) and () whose gradients end in a reshape of a reduction (they once
    came back as uninitialised memory), a constant stored in the data file, and the objective also
    declared as an output."""
    m = gc.Model("cg_rows")
    x = m.input("x", ("B", 5))
    p = m.param("p", (1, 5), init="normal")
    q = m.param("q", (5, 1), init="normal")
    s = m.param("s", (), init="normal")
    c = np.random.default_rng(0).normal(size=(5, 60))   # 300 values: more than the module writes inline
    h = gc.tanh(x * p + q.T * s)
    loss = (h * h).sum() + ((h @ c) ** 2).mean() * 0.01 + (h @ q).sum()
    m.output("loss_copy", loss)
    m.minimize(loss)
    return m


MODELS = [row_params_and_objective_output, broadcast_patterns, reductions_rank3, mlp_weight_decay, shared_weights, reused_input, residual, frozen_and_unused, reductions_and_attention,
          user_ops, layout_ops, scalars, constants_and_array_init, integer_labels_int32, deep_chain]


WITH_HVP = [scalars, broadcast_patterns, residual, row_params_and_objective_output]


def _inputs(module, rng, batch=5):
    out = {}
    for name, (shape, dtype) in module.INPUTS.items():
        concrete = tuple(batch if isinstance(d, str) else d for d in shape)
        if dtype.startswith("int"):
            out[name] = rng.integers(0, module._INDEX_BOUNDS[name], concrete).astype(dtype)
        else:
            out[name] = np.asarray(rng.uniform(0.5, 1.5, concrete) * rng.choice([-1, 1], concrete), dtype=dtype)
    if "temp" in out:
        out["temp"] = np.array(1.7)
    return out


# the default run compiles three: the (1, N) params (broadcasting too), fan-out and a residual DAG; the
# fuzzer's default programs broadcast every way (tests/test_fuzz.py)
DEFAULT_MODELS = [row_params_and_objective_output, shared_weights, residual]


@pytest.mark.parametrize("make", [m if m in DEFAULT_MODELS else pytest.param(m, marks=pytest.mark.slow) for m in MODELS],
                         ids=lambda f: f.__name__)
def test_generated_matches_interpreter(make, build_dir, rng):
    model = make()
    mod = gc.compile(model, out=build_dir, dtype="float64", warm_cache=False)
    _check_against_interpreter(model, mod, rng, hvp=make in WITH_HVP)


@pytest.mark.parametrize("make", [row_params_and_objective_output, scalars, reductions_and_attention, residual],
                         ids=lambda f: f.__name__)
def test_plain_python_entries_match_the_interpreter(make, build_dir, rng, monkeypatch):
    """Entry points run as plain Python over the compiled kernels; hvp's block function too where the
    graph is large: here every one does."""
    import gradc.codegen.entry as entry
    monkeypatch.setattr(entry, "COMPILED_ENTRY_MAX_STEPS", 0)
    model = make()
    mod = gc.compile(model, out=build_dir, dtype="float64", warm_cache=False)
    source = open(mod.__file__).read()
    assert not re.search(r"@\w*kernel\ndef _hvp_block", source)
    assert "def _hvp_block(" in source and "def _loss_and_grad(" in source
    assert "= buffers[" in source and "= view(arena" not in source
    _check_against_interpreter(model, mod, rng, hvp=True)


def _check_against_interpreter(model, mod, rng, hvp):
    graph = build_training_graph(model, "float64")
    params = mod.init_params(seed=3)
    inputs = _inputs(mod, rng)

    loss, grads = mod.loss_and_grad(params, **inputs)
    trainable = [p for p in mod.PARAM_ORDER if model.param_info[p]["trainable"]]
    assert sorted(grads) == sorted(trainable)
    want = [graph.objective] + [n for n in graph.grads.values() if n is not None] + \
           [n for n in graph.input_grads.values() if n is not None] + list(graph.outputs.values())
    ref = evaluate(graph, params, inputs, want)
    np.testing.assert_allclose(loss, ref[graph.objective], rtol=1e-10)
    for p in trainable:
        node = graph.grads[p]
        expected = ref[node] if node is not None else np.zeros(mod.PARAM_SHAPES[p])
        np.testing.assert_allclose(grads[p], expected, rtol=1e-9, atol=1e-12, err_msg=p)
        assert grads[p].shape == mod.PARAM_SHAPES[p] and grads[p].dtype == np.float64

    gi = mod.input_grads(params, **inputs)
    for name, node in graph.input_grads.items():
        expected = ref[node] if node is not None else np.zeros_like(inputs[name])
        np.testing.assert_allclose(gi[name], expected, rtol=1e-9, atol=1e-12, err_msg=name)

    out = mod.forward(params, **inputs)
    assert out["loss"] == pytest.approx(loss, rel=1e-12)
    for name, node in graph.outputs.items():
        np.testing.assert_allclose(out[name], ref[node], rtol=1e-10, atol=1e-12, err_msg=name)
    out_only = mod.forward(params, **{k: v for k, v in inputs.items() if k in mod._OUTPUT_INPUTS})
    assert ("loss" in out_only) == set(mod._LOSS_INPUTS).issubset(mod._OUTPUT_INPUTS)

    if hvp:   # the second-order block's expressions (powers in denominators, scalars)
        graph2 = build_training_graph(model, "float64", order=2)
        v = {p: rng.standard_normal(mod.PARAM_SHAPES[p]) for p in trainable}
        ref2 = evaluate(graph2, params, inputs, [graph2.hvps[p] for p in trainable], tangents=v)
        hv = mod.hvp(params, v, **inputs)
        for p in trainable:
            np.testing.assert_allclose(hv[p], ref2[graph2.hvps[p]], rtol=1e-9, atol=1e-12, err_msg=p)


def test_float32_build_matches_float64_reference(build_dir, rng):
    model = mlp_weight_decay()
    mod = gc.compile(model, out=build_dir, warm_cache=False)
    assert mod.DTYPE == "float32"
    graph = build_training_graph(model, "float64")
    params = mod.init_params(1)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    loss, grads = mod.loss_and_grad(params, x=x, y=y)
    assert all(g.dtype == np.float32 for g in grads.values())
    ref = evaluate(graph, params, {"x": x, "y": y}, [graph.objective] + list(graph.grads.values()))
    np.testing.assert_allclose(loss, ref[graph.objective], rtol=1e-5)
    for p, node in graph.grads.items():
        np.testing.assert_allclose(grads[p], ref[node], rtol=1e-4, atol=1e-6, err_msg=p)


@pytest.mark.slow
def test_float32_build_with_a_float64_constant(build_dir, rng):
    """The constant (float64 in the model) is converted once at compile time to the build's dtype."""
    model = row_params_and_objective_output()
    mod = gc.compile(model, out=build_dir, warm_cache=False)
    graph = build_training_graph(model, "float64")
    params = mod.init_params(1)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    loss, grads = mod.loss_and_grad(params, x=x)
    ref = evaluate(graph, params, {"x": x}, [graph.objective] + list(graph.grads.values()))
    np.testing.assert_allclose(loss, ref[graph.objective], rtol=1e-5)
    for p, node in graph.grads.items():
        assert grads[p].dtype == np.float32
        np.testing.assert_allclose(grads[p], ref[node], rtol=1e-4, atol=1e-5, err_msg=p)
    assert mod.forward(params, x=x)["loss_copy"] == pytest.approx(loss, rel=1e-6)


def test_a_constant_beyond_the_dtype_is_refused(tmp_path):
    m = gc.Model("cg_huge_const")
    x = m.input("x", ("B", 3))
    m.minimize((x * m.param("w", (3,)) * np.full(3, 1e300)).sum())
    with pytest.raises(gc.GradcError, match=r"test_codegen.py:\d+: a constant of this line is 1e\+300, which "
                                            r"float32 holds as inf"):
        gc.compile(m, out=str(tmp_path), warm_cache=False)


def test_a_constant_array_holding_inf_masks_a_softmax(tmp_path):
    """A -inf mask written as a constant array (attention's): the module wrote it as `inf`, a NameError at import."""
    m = gc.Model("cg_inf_mask")
    x, y = m.input("x", ("B", 4)), m.input("y", ("B", 4))
    mask = np.array([0.0, -np.inf, 0.0, -np.inf])
    m.minimize((gc.softmax(x * m.param("s", (), init="ones") + mask, axis=1) * y).sum())
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm=False)
    rng = np.random.default_rng(2)
    X, Y = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    e = np.exp(X + mask - X[:, [0, 2]].max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    loss, grads = mod.loss_and_grad({"s": np.float64(1.0)}, x=X, y=Y)
    assert loss == pytest.approx(float((p * Y).sum()), rel=1e-12)
    expected = (p * (Y - (p * Y).sum(1, keepdims=True)) * X)[:, [0, 2]].sum()   # d/ds of sum(softmax(s x + mask) y)
    assert float(grads["s"]) == pytest.approx(float(expected), rel=1e-10)


def test_a_constant_array_of_signed_zeros_keeps_each_sign(tmp_path):
    """[-0.0, 0.0, ...] was written as np.full(..., -0.0): -0.0 == 0.0, so it looked like one value, and x / c
    gave -inf where numpy gives inf (review finding)."""
    m = gc.Model("cg_signed_zeros")
    x = m.input("x", (4,))
    c = np.array([-0.0, 0.0, -0.0, 0.0])
    m.output("ratio", x / c)
    m.minimize((x * m.param("b", (4,), init="ones")).sum())
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm=False)
    with np.errstate(divide="ignore"):
        assert np.array_equal(mod.forward({"b": np.ones(4)}, x=np.ones(4))["ratio"], np.ones(4) / c)


def test_cross_entropy_and_log_softmax_keep_their_digits_at_large_logits(tmp_path):
    """Both are invariant to adding an offset to every logit of a row; they computed x - (m + log sum), whose
    sum rounds log sum away: at an offset of 1e7 the float64 loss was 2.7e-10 off, and tied logits of -1e30
    had a log_softmax of 0 (a new user's trial, against torch). (x - m) - log sum keeps them."""
    m = gc.Model("cg_big_logits")
    z, y = m.input("z", ("B", 3)), m.input("y", ("B",), dtype="int64")
    m.output("ls", gc.log_softmax(z, axis=1))
    m.minimize(gc.softmax_cross_entropy(z * m.param("s", (), init="ones"), y))
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm=False)
    base = np.array([[0.25, 0.25, 0.25], [0.0, 1.0, 2.0]])
    Y = np.array([0, 2])
    loss0 = mod.loss_and_grad({"s": np.float64(1.0)}, z=base, y=Y)[0]
    ls0 = mod.forward({"s": np.float64(1.0)}, z=base)["ls"]
    assert loss0 == pytest.approx(np.mean([np.log(3.0), np.log(1 + np.exp(-1) + np.exp(-2))]), rel=1e-15)
    for offset in (1e5, 1e7, 1e10, -1e30):
        loss = mod.loss_and_grad({"s": np.float64(1.0)}, z=base + offset, y=Y)[0]
        ls = mod.forward({"s": np.float64(1.0)}, z=base + offset)["ls"]
        assert loss == pytest.approx(loss0, rel=1e-15, abs=0) or offset == -1e30, offset   # (-1e30: spacing 1e14)
        assert np.allclose(ls[0], ls0[0], rtol=1e-15, atol=0), (offset, ls)   # tied logits: -log 3 each
    xent = get_op("softmax_xent").evaluate   # the interpreter's
    assert xent({}, [base + 1e7, Y], (2,), {}) == pytest.approx(xent({}, [base, Y], (2,), {}), rel=1e-15, abs=0)


def test_float32_sums_over_many_values_keep_float32_precision(tmp_path):
    """A float32 build's reductions summed in float32: a mean of 2e6 values lost 1e-4 of itself (a new
    user's trial; torch's cascaded sums keep ~1e-7). The full one (mse) and those over the last axis, in
    four running sums (s: 6 a row, so 2 left over; total: a vector's), run in float64 now. A sum that
    keeps the last axis (the param's gradient, c: one between kept axes) adds into its float32 output: here
    250,003 rows leave ~1e-6."""
    m = gc.Model("cg_long_sums")
    x, t = m.input("x", ("B", 6)), m.input("t", ("B", 6))
    a = m.param("a", (6,), init="ones")
    m.output("s", x.sum(axis=1))
    m.output("total", x.sum(axis=1).sum())
    m.output("c", x.reshape(("B", 6, 1)).mean(axis=0, keepdims=True))
    m.minimize(gc.mse(x * a, t))
    mod = gc.compile(m, out=str(tmp_path), dtype="float32", warm=False)
    rng = np.random.default_rng(3)
    X = rng.normal(3.0, 1.0, (250_003, 6)).astype(np.float32)
    T = rng.normal(0.0, 1.0, (250_003, 6)).astype(np.float32)
    A = rng.uniform(0.5, 1.5, 6).astype(np.float32)
    loss, grads = mod.loss_and_grad({"a": A}, x=X, t=T)
    out = mod.forward({"a": A}, x=X)
    X64 = X.astype(np.float64)
    d = X64 * A - T
    assert loss == pytest.approx(np.mean(d * d), rel=1e-6)
    assert np.allclose(grads["a"], (d * X).mean(axis=0) / 3, rtol=1e-5, atol=0)
    assert np.allclose(out["c"].ravel(), X64.mean(axis=0), rtol=1e-5, atol=0)
    assert np.allclose(out["s"], X64.sum(axis=1), rtol=1e-6, atol=0)
    assert float(out["total"]) == pytest.approx(X64.sum(), rel=1e-6)


def test_extreme_inputs_stay_finite_in_float32(build_dir):
    """|x| = 100 in float32: stable forms of sigmoid, softplus, log_softmax, cross-entropy, gelu, tanh."""
    m = gc.Model("cg_extreme")
    x = m.input("x", ("B", 4))
    y = m.input("y", ("B",), dtype="int64")
    s = gc.sigmoid(x) + gc.softplus(x) + gc.softplus(-x) + gc.gelu(x) + gc.tanh(x) + gc.log_softmax(x, axis=1)
    s = s + gc.softmax(x, axis=0) + gc.relu(x) + gc.abs(x)
    m.output("s", s)
    m.minimize(gc.softmax_cross_entropy(x, y) + gc.mean(s))
    mod = gc.compile(m, out=build_dir, warm_cache=False)
    x_val = np.array([[100, -100, 100, -100], [-100, -100, -100, 100], [100, 100, 100, 100]], np.float32)
    y_val = np.array([1, 0, 2])
    loss, grads = mod.loss_and_grad({}, x=x_val, y=y_val)
    gi = mod.input_grads({}, x=x_val, y=y_val)["x"]
    out = mod.forward({}, x=x_val)["s"]
    assert np.isfinite(loss) and np.all(np.isfinite(gi)) and np.all(np.isfinite(out))
    assert loss == pytest.approx(np.mean([200.0 + np.log(2.0), 200.0, np.log(4.0)]) + float(np.mean(out.astype(np.float64))),
                                 rel=1e-4)


def test_scalar_arithmetic_gives_inf_and_nan_never_an_exception(build_dir):
    """Scalars the entries compute (a loss made of means) follow numpy: log(0) = -inf, an overflowing
    exp = inf, 0/0 and a negative to the power 1.5 = nan, in forward, loss_and_grad and the Trainer,
    whose step then refuses with FloatingPointError as documented."""
    m = gc.Model("cg_scalar_edges")
    x = m.input("x", ("B", 3))
    w, v, u, z = (m.param(k, (3, 2)) for k in "WVUZ")
    square_mean = gc.mean(gc.square(x @ w))
    ratio = gc.mean(x @ z) / gc.mean(gc.square(x @ z))
    m.minimize(gc.log(square_mean) + gc.exp(gc.mean(x @ v)) + gc.mean(x @ u) ** 1.5 + ratio)
    mod = gc.compile(m, out=build_dir, dtype="float64", warm_cache=False)
    ones, fine = np.ones((3, 2)), {k: np.full((3, 2), 0.1) for k in "WVUZ"}
    x_val = np.ones((4, 3))

    def terms(p, xv):
        h = {k: xv @ p[k] for k in "WVUZ"}
        with np.errstate(all="ignore"):
            return (np.log(np.mean(h["W"] ** 2)) + np.exp(np.mean(h["V"])) + np.float64(np.mean(h["U"])) ** 1.5
                    + np.mean(h["Z"]) / np.mean(h["Z"] ** 2))

    assert mod.loss_and_grad(fine, x=x_val)[0] == pytest.approx(terms(fine, x_val), rel=1e-12)
    cases = [(fine | {"W": 0 * ones}, x_val, -np.inf), (fine | {"V": ones}, np.full((4, 3), 300.0), np.inf),
             (fine | {"U": -ones}, x_val, np.nan), (fine | {"Z": 0 * ones}, x_val, np.nan)]
    for params, xv, want in cases:
        assert np.isnan(want) and np.isnan(terms(params, xv)) or terms(params, xv) == want
        loss, grads = mod.loss_and_grad(params, x=xv)
        assert (np.isnan(loss) if np.isnan(want) else loss == want), (want, loss)
        assert np.isnan(mod.forward(params, x=xv)["loss"]) if np.isnan(want) else mod.forward(params, x=xv)["loss"] == want
        with pytest.raises(FloatingPointError, match="the loss is"):
            mod.Trainer(params, optimizer="sgd", lr=0.1).step(x=xv)


def test_trainer_matches_reference_optimizers(build_dir, rng):
    """SGD momentum, Adam and clip_norm against straightforward numpy versions of PyTorch's rules."""
    mod = gc.compile(mlp_weight_decay(), out=build_dir, dtype="float64", warm_cache=False)
    params = mod.init_params(5)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    for opt, kw in (("sgd", dict(lr=0.1, momentum=0.9)), ("sgd", dict(lr=0.3, momentum=0.0, clip_norm=0.05)),
                    ("adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6)), ("adam", dict(lr=0.01, clip_norm=0.1))):
        tr = mod.Trainer(params, optimizer=opt, **kw)
        ref = {k: v.copy() for k, v in params.items()}
        state = {k: [np.zeros_like(v), np.zeros_like(v)] for k, v in params.items()}
        for t in range(1, 5):
            loss = tr.step(x=x, y=y)
            ref_loss, g = mod.loss_and_grad(ref, x=x, y=y)
            assert loss == pytest.approx(ref_loss, rel=1e-12)
            norm = np.sqrt(sum((v ** 2).sum() for v in g.values()))
            scale = min(1.0, kw["clip_norm"] / (norm + 1e-6)) if "clip_norm" in kw else 1.0
            for k in ref:
                gk = g[k] * scale
                if opt == "sgd":
                    state[k][0] = kw["momentum"] * state[k][0] + gk
                    ref[k] -= kw["lr"] * state[k][0]
                else:
                    b1, b2 = kw.get("betas", (0.9, 0.999))
                    eps = kw.get("eps", 1e-8)
                    state[k][0] = b1 * state[k][0] + (1 - b1) * gk
                    state[k][1] = b2 * state[k][1] + (1 - b2) * gk * gk
                    denom = np.sqrt(state[k][1]) / np.sqrt(1 - b2 ** t) + eps
                    ref[k] -= kw["lr"] / (1 - b1 ** t) * state[k][0] / denom
        for k in ref:
            np.testing.assert_allclose(tr.params[k], ref[k], rtol=1e-10, atol=1e-13, err_msg=f"{opt} {kw} {k}")
        assert all(np.array_equal(params[k], mod.init_params(5)[k]) for k in params), "caller's params changed"


@pytest.mark.parametrize("classes", [10, 3])
def test_float32_cross_entropy_gradient_is_accurate_when_the_label_is_nearly_certain(classes, build_dir, rng):
    """softmax - onehot at the label is p - 1, which cancels as p nears 1: the float32 kernel computes it
    from the logits in full precision, not from a rounded softmax (whose float32 ulp of 1 would be
    1-5% of the gradient here). Softmax, for the other entries, against float64 too."""
    m = gc.Model("confident")
    z = m.input("z", ("N", classes))
    y = m.input("y", ("N",), dtype="int64")
    m.output("p", gc.softmax(z, axis=-1))
    m.minimize(gc.softmax_cross_entropy(z, y))
    mod = gc.compile(m, out=build_dir, warm_cache=False)
    rows = 16
    labels = rng.integers(0, classes, rows)
    logits = rng.standard_normal((rows, classes))
    logits[np.arange(rows), labels] += rng.uniform(12, 15, rows)   # p of the label: 1 - 1e-5 or so
    z32 = logits.astype(np.float32)
    exact = z32.astype(np.float64)
    p = np.exp(exact - exact.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = (p - np.eye(classes)[labels]) / rows
    got = mod.input_grads({}, z=z32, y=labels)["z"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    np.testing.assert_allclose(mod.forward({}, z=z32)["p"], p, rtol=2e-6, atol=0)


def test_fused_kernels_in_generated_source(build_dir):
    """tanh(x @ W + b) is one loop, and so is its backward g * (1 - y*y)."""
    mod = gc.compile(mlp_weight_decay(), out=build_dir, warm_cache=False)
    source = open(mod.__file__).read()
    assert "_tanh(a0 + a1)" in source                    # forward: bias add and tanh in one loop
    assert "(FLOAT(1.0) - (a1 * a1))" in source          # backward: g * (1 - y*y) from the saved output, in float32
    # products by BLAS with transpose flags, never a transpose copy
    assert re.search(r"matmul_into\(\w+, \w+, True, False, \w+\)", source)   # dW = x.T @ g
    assert re.search(r"matmul_into\(\w+, \w+, False, True, \w+\)", source)   # dx = g @ W.T


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_into_is_numpys_product_for_every_transpose_and_empty_dims(dtype, rng):
    """The BLAS call of plain entries: out is C-ordered and BLAS column-major, so a swapped
    transpose or a copied out would be wrong silently; an empty out or inner dim must work too."""
    for m, k, n in [(5, 7, 3), (1, 4, 6), (6, 1, 1), (0, 3, 4), (3, 0, 4), (3, 4, 0)]:
        for ta in (False, True):
            for tb in (False, True):
                a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
                b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
                out = np.full((m, n), np.nan, dtype)
                matmul_into(a, b, ta, tb, out)
                want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
                np.testing.assert_allclose(out, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5,
                                           err_msg=f"{(m, k, n)} ta={ta} tb={tb}")
                strided = np.full((n, m), np.nan, dtype).T   # an out BLAS cannot write in place
                matmul_into(a, b, ta, tb, strided)
                np.testing.assert_array_equal(strided, out)
                # operands BLAS cannot read in place (every other column; column-major), and rows apart
                # by more than their length (a slice of wider rows), which it can
                for view in (lambda x: np.repeat(x, 2, axis=1)[:, ::2], np.asfortranarray,
                             lambda x: np.pad(x, ((0, 0), (0, 3)), constant_values=np.nan)[:, :x.shape[1]]):
                    again = np.full((m, n), np.nan, dtype)
                    matmul_into(view(a), view(b), ta, tb, again)
                    np.testing.assert_array_equal(again, out)
    other = np.float64 if dtype == np.float32 else np.float32   # BLAS's kind follows out: a mix is refused
    with pytest.raises(ValueError, match="one float dtype"):
        matmul_into(np.ones((2, 3), other), np.ones((3, 2), dtype), False, False, np.empty((2, 2), dtype))


def test_small_products_run_on_one_blas_thread_and_leave_blas_its_own_count():
    """A product below SERIAL_BELOW runs on one OpenBLAS thread (its workers would spin after it, slowing
    the kernels between products); the count in force goes back after it, so kernels' products keep
    BLAS's own, and a limit the user set (threadpoolctl's, say) stays. matmul_into returns the count
    it ran the product on."""
    if not blas._MULTITHREADED:
        pytest.skip("the BLAS behind scipy is not a multithreaded OpenBLAS")
    own = blas.threads_now()

    def products():
        ran = []
        for m in (8, 512):   # 8 x 64 x 64 is below the threshold, 512 x 512 x 64 above
            a, b = np.ones((m, 64), np.float32), np.ones((64, m), np.float32)
            out = np.empty((m, m), np.float32)
            before = blas.threads_now()
            ran.append(matmul_into(a, b, False, False, out))
            assert (out == 64).all() and blas.threads_now() == before
        return ran
    try:
        assert products() == [1, own]
        blas.set_threads(1)   # the user's limit
        assert products() == [1, 1] and blas.threads_now() == 1
    finally:
        blas.set_threads(own)


def test_a_blas_that_is_not_openblas_gets_thread_functions_that_say_one_thread():
    """matmul_into calls the thread functions by symbol; where scipy's BLAS is not an OpenBLAS, the symbols
    name stand-ins: the count is 1 (so no product changes it) and setting it does nothing."""
    import ctypes
    get_address, set_address = blas._stand_ins()
    assert ctypes.CFUNCTYPE(ctypes.c_int)(get_address)() == 1
    ctypes.CFUNCTYPE(None, ctypes.c_int)(set_address)(4)


def test_a_constant_array_made_in_a_scan_body_has_its_values():
    """What a body writes for a constant array (it takes none as an argument): np.full for one value,
    else the values written in, inf and nan included; a large array of many values is refused."""
    scope = {"np": np, "math": math, "FLOAT": np.float32}
    for value in (np.zeros((1, 1)), np.full((2, 3), -2.5), np.array([[1.0, np.inf], [-np.inf, 0.125]]),
                  np.array([np.nan, 3.0])):
        made = eval(array_source(value), scope)
        assert made.dtype == np.float32 and made.shape == value.shape
        np.testing.assert_array_equal(made, value.astype(np.float32))
    with pytest.raises(NotImplementedError, match="distinct values"):
        array_source(np.arange(BODY_CONST_LIMIT + 1.0), BODY_CONST_LIMIT)


def test_a_scan_steps_work_offsets_are_summed_term_by_term(tmp_path, rng):
    """A step's intermediates lie one after another in its work array; each view's offset is the sum
    of the sizes before it, written term by term (`128*d_B + 6`), and no two views overlap."""
    sizes = WorkSizes()
    assert sizes.source() == "0"
    for shape in [("B", 4), (2, 3), ("B", "T", 2), ("T", "B"), ("B", 1)]:
        sizes.add(shape, {"B": "d_B", "T": "d_T"})
    assert sizes.source() == "3*d_B*d_T + 5*d_B + 6"
    m = gc.Model("cg_work")
    x = m.input("x", ("T", "B", 3))
    W, U = m.param("W", (3, 5)), m.param("U", (5, 5))
    hT, hs = gc.scan(lambda h, x_t: (gc.tanh(x_t @ W + h @ U) * 2.0, h), m.input("h0", ("B", 5)), x)
    m.minimize(gc.mse(hT, m.input("y", ("B", 5))))
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm=False)
    source = (tmp_path / "cg_work.py").read_text()
    assert "(d_B*" not in source
    steps = source.split("# one step:")[1:]   # each step, written into its loop kernel
    assert steps
    for step in steps:   # each view starts where the one before it ends (d_B and d_KB_lr set to 7)
        views = re.findall(r"view\(work, ([^(]+), \(([^)]*)\)\)", step[:step.index("\n\n")])
        ends = [(eval(o, {"d_B": 7, "d_KB_lr": 7}), math.prod(eval(f"({shape},)", {"d_B": 7, "d_KB_lr": 7})))
                for o, shape in views]
        assert ends and ends[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ends, ends[1:])), views
    p = mod.init_params(0)
    inputs = {"x": rng.standard_normal((4, 2, 3)), "h0": rng.standard_normal((2, 5)), "y": rng.standard_normal((2, 5))}
    loss, grads = mod.loss_and_grad(p, **inputs)
    tW, tU = (torch.tensor(p[k], requires_grad=True) for k in ("W", "U"))
    h = torch.tensor(inputs["h0"])
    for x_t in torch.tensor(inputs["x"]):
        h = torch.tanh(x_t @ tW + h @ tU) * 2.0
    expected = ((h - torch.tensor(inputs["y"])) ** 2).mean()
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    np.testing.assert_allclose(grads["W"], tW.grad.numpy(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(grads["U"], tU.grad.numpy(), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_mask_added_as_a_large_number_keeps_the_values_it_masks(tmp_path, dtype, rng):
    """x + (a - 1) * 1e9, attention's usual mask: sympy multiplied 1e9 into (a - 1) when fusion composed the
    ops, and the kernel's x + 1e9*a - 1e9 lost x where a = 1 (float32: every softmax row uniform; trial O).
    Each form keeps x exactly where the mask is 1, and the gradients are torch's."""
    forms = {"plus": lambda x, a: x + (a - 1.0) * 1e9, "minus": lambda x, a: x - (1.0 - a) * 1e9,
             "left": lambda x, a: x + 1e9 * (a - 1.0), "scaled": lambda x, a: x * a + (a - 1.0) * 1e9}
    m = gc.Model(f"cg_mask_{dtype}")
    x, a = m.input("x", ("N", 3)), m.input("a", ("N", 3))
    W = m.param("W", (3, 3))
    h = x @ W
    loss = 0.0
    for name, form in forms.items():
        m.output(name, form(h, a))
        loss = loss + (gc.softmax(form(h, a), axis=1) * x).sum()
    m.minimize(loss)
    mod = gc.compile(m, out=str(tmp_path), dtype=dtype, warm=False)
    ft = np.dtype(dtype).type
    params = {"W": rng.standard_normal((3, 3)).astype(ft)}
    xv = rng.standard_normal((4, 3)).astype(ft)
    av = np.ones((4, 3), ft)
    av[1, 2] = av[3, 0] = 0.0
    out = mod.forward(params, x=xv, a=av)
    hv = xv @ params["W"]
    for name in forms:
        kept = av == 1
        np.testing.assert_allclose(out[name][kept], (hv * av if name == "scaled" else hv)[kept],
                                   rtol=1e-6 if dtype == "float32" else 1e-14, err_msg=name)
        assert np.all(out[name][~kept] < -1e8), name
    loss_value, grads = mod.loss_and_grad(params, x=xv, a=av)
    tW = torch.tensor(params["W"].astype(np.float64), requires_grad=True)
    tx, ta = torch.tensor(xv.astype(np.float64)), torch.tensor(av.astype(np.float64))
    th = tx @ tW
    expected = sum((torch.softmax(form(th, ta), dim=1) * tx).sum() for form in forms.values())
    expected.backward()
    tol = 1e-4 if dtype == "float32" else 1e-12
    assert loss_value == pytest.approx(expected.item(), rel=tol)
    np.testing.assert_allclose(grads["W"], tW.grad.numpy(), rtol=tol, atol=tol)


def test_functions_of_negated_sums_fuse_and_match_torch(tmp_path, rng):
    """tanh(-(x @ W) - b), sin(-x - y), ...: sympy writes f(-u) as -f(u) where u 'could extract a minus
    sign'; a composition that kept a number out of every sum made it loop forever (a review of the mask fix)."""
    m = gc.Model("cg_negated")
    x, y = m.input("x", ("N", 3)), m.input("y", ("N", 3))
    W, b = m.param("W", (3, 3)), m.param("b", (3,))
    forms = [lambda x, y, W, b, f: f["tanh"](-(x @ W) - b), lambda x, y, W, b, f: f["tanh"](x - y - 2.0),
             lambda x, y, W, b, f: f["tanh"](1.0 - x @ W - y), lambda x, y, W, b, f: f["sin"](-(x @ W) - y),
             lambda x, y, W, b, f: f["cos"](-(x @ W) - 1.0) * 3.0]
    ours = {"tanh": gc.tanh, "sin": gc.sin, "cos": gc.cos}
    m.minimize(sum((form(x, y, W, b, ours) ** 2).sum() for form in forms))
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm=False)
    params = {"W": rng.standard_normal((3, 3)), "b": rng.standard_normal(3)}
    inputs = {"x": rng.standard_normal((4, 3)), "y": rng.standard_normal((4, 3))}
    loss, grads = mod.loss_and_grad(params, **inputs)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tx, ty = torch.tensor(inputs["x"]), torch.tensor(inputs["y"])
    theirs = {"tanh": torch.tanh, "sin": torch.sin, "cos": torch.cos}
    expected = sum((form(tx, ty, tp["W"], tp["b"], theirs) ** 2).sum() for form in forms)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-13)
    for k in params:
        np.testing.assert_allclose(grads[k], tp[k].grad.numpy(), rtol=1e-11, atol=1e-13, err_msg=k)


def test_fused_sums_keep_their_signs_and_the_float32_exp_its_polynomial(tmp_path, rng):
    """Keeping a sum whole with sympy's UnevaluatedExpr (a first fix of the mask) printed a + b - c + d as
    x0 - (x1 + (x2 + x3)), broke hvp through tanh, and made exp(-(x*w - 1)**2) in float32 call math.exp (it
    forgot that its sum is real; a fresh user's trial): fusion composes plain sympy expressions."""
    m = gc.Model("cg_signs")
    x = m.input("x", ("B", 3))
    h = x @ m.param("W", (3, 4))
    m.minimize((h ** 2).mean() + gc.tanh(h).sum(axis=1).mean() - gc.exp(h).mean() + h.sum())
    mod = gc.compile(m, out=str(tmp_path / "signs"), dtype="float64", warm=False)
    params, xv = {"W": rng.standard_normal((3, 4))}, rng.standard_normal((5, 3))
    loss, grads = mod.loss_and_grad(params, x=xv)
    tW = torch.tensor(params["W"], requires_grad=True)
    th = torch.tensor(xv) @ tW
    expected = (th ** 2).mean() + torch.tanh(th).sum(1).mean() - torch.exp(th).mean() + th.sum()
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-13)
    np.testing.assert_allclose(grads["W"], tW.grad.numpy(), rtol=1e-12, atol=1e-13)
    v = {"W": rng.standard_normal((3, 4))}
    hv = torch.autograd.functional.hvp(lambda w: ((torch.tensor(xv) @ w) ** 2).mean() + torch.tanh(torch.tensor(xv) @ w)
                                       .sum(1).mean() - torch.exp(torch.tensor(xv) @ w).mean() + (torch.tensor(xv) @ w)
                                       .sum(), torch.tensor(params["W"]), torch.tensor(v["W"]))[1]
    np.testing.assert_allclose(mod.hvp(params, v, x=xv)["W"], hv.numpy(), rtol=1e-11, atol=1e-12)
    m = gc.Model("cg_kept_sign")
    x = m.input("x", ("B", 4))
    m.minimize(gc.exp(-gc.square(x * m.param("w", (4,)) - 1.0)).sum())
    gc.compile(m, out=str(tmp_path / "exp"), warm=False)
    source = (tmp_path / "exp" / "cg_kept_sign.py").read_text()
    kernels = source[source.index("# ---- kernels"):]
    assert "_exp_nonpositive(" in kernels and "math.exp(" not in kernels


def test_a_transposed_weight_is_a_transpose_flag_not_a_copy(tmp_path, rng):
    """`h @ W.T` (PyTorch's (out, in) layout) and a tied decoder made a transposed copy of the weight every
    step, and W.T's gradient a product then its transposed copy (trial Y): both are transpose flags now."""
    m = gc.Model("cg_wt")
    x, y = m.input("x", ("B", 32)), m.input("y", ("B",), dtype="int64")
    W0, W1 = m.param("W0", (64, 32)), m.param("W1", (10, 64))
    logits = gc.tanh(x @ W0.T) @ W1.T
    z = gc.tanh(logits @ W1)                 # the tied decoder
    m.minimize(gc.softmax_cross_entropy(logits, y) + gc.mean(z * z), weight_decay=0.01)
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=1, warm=False)
    source = (tmp_path / "cg_wt.py").read_text()
    step = source[source.index("def _loss_and_grad("):source.index("def ", source.index("def _loss_and_grad(") + 4)]
    assert "transpose" not in step, step
    p = {"W0": rng.standard_normal((64, 32)), "W1": rng.standard_normal((10, 64))}
    xs, ys = rng.standard_normal((5, 32)), rng.integers(0, 10, 5)
    loss, grads = mod.loss_and_grad(p, x=xs, y=ys)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    lg = torch.tanh(torch.tensor(xs) @ tp["W0"].T) @ tp["W1"].T
    zt = torch.tanh(lg @ tp["W1"])
    expected = (torch.nn.functional.cross_entropy(lg, torch.tensor(ys)) + (zt * zt).mean()
                + 0.005 * sum((v ** 2).sum() for v in tp.values()))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-13)
    for k in p:
        np.testing.assert_allclose(grads[k], tp[k].grad.numpy(), rtol=1e-11, atol=1e-13, err_msg=k)
