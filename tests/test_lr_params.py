"""lr_grad with params read other than as a product's factor (passes/likelihood_ratio.py, DESIGN.md §1.9):
gains and other elementwise ops on batch rows (a site of their own), factors made of params (weight
normalisation, a low-rank product, a standardised conv kernel: their VJP taken exactly), and terms of
params alone added to the loss (an L2 penalty written in the loss, a constant: differentiated exactly).
Each estimate is checked for bias per param through the interpreter (fuzz_lr.assert_unbiased);
one compiled module against the interpreter; the uses still refused."""
from types import SimpleNamespace

import numpy as np
import pytest

import gradc as gc
from gradc.passes.pipeline import build_training_graph

from fuzz_lr import assert_unbiased, check_lr_compiled


def _mlp(name, hidden, loss=lambda xent, W0, W1: xent, first=None):
    """x (B, 5) -> hidden(m, h) -> logits over 3 classes; `first` the first layer's factor (default W0)."""
    m = gc.Model(name)
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    W0, W1 = m.param("W0", (5, 6)), m.param("W1", (6, 3))
    h = hidden(m, x @ (first(m, W0) if first else W0))
    m.minimize(loss(gc.softmax_cross_entropy(gc.tanh(h) @ W1, y), W0, W1))
    return m


def _layer_norm(m, h):
    g, b = m.param("g", (6,), init="ones"), m.param("b", (6,), init="zeros")
    mu = h.mean(axis=1, keepdims=True)
    sd = gc.sqrt(gc.square(h - mu).mean(axis=1, keepdims=True) + 1e-5)
    return (h - mu) / sd * g + b


def _standardised_conv():
    """A conv net whose kernel is standardised (w - its mean) / its norm, then scaled by a learned gain per
    channel after the pool: the kernel a factor made of a param, the gain a site of its own."""
    m = gc.Model("lrstdconv")
    x, y = m.input("x", ("B", 1, 6, 6)), m.input("y", ("B",), dtype="int64")
    w = m.param("w", (3, 1, 3, 3), init="he_normal")
    centred = w - w.mean()
    h = gc.max_pool2d(gc.relu(gc.conv2d(x, centred / gc.sqrt(gc.square(centred).sum()))), 2)
    h = (h * m.param("g", (1, 3, 1, 1), init="ones")).reshape(("B", -1))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W", (12, 4)), y))
    return m


def _scan_of_a_scaled_weight():
    """An RNN whose recurrent weight is W * s (made outside the step, closed over), its stacked results
    (T, B, H) scaled by a learned gain (rows on axis 1) before the loss, with a penalty on s."""
    m = gc.Model("lrscaledrnn")
    x, h0, y = m.input("x", ("T", "B", 2)), m.input("h0", ("B", 3)), m.input("y", ("T", "B"), dtype="int64")
    W, s, U = m.param("W", (3, 3)), m.param("s", (3, 1), init="ones"), m.param("U", (2, 3))
    Ws = W * s
    _, hs = gc.scan(lambda h, xt: (gc.tanh(h @ Ws + xt @ U),) * 2, h0, x)
    logits = (hs * m.param("g", (3,), init="ones")) @ m.param("V", (3, 4))
    m.minimize(gc.softmax_cross_entropy(logits, y) + 0.1 * gc.square(s - 1.0).sum())
    return m


def _cell_with_a_gain(kind):
    """An RNN whose step scales a product by a gain (layer-norm style, "gain"; a gate of a param, "gate"),
    or adds a bias to a sum that is not a product's ("bias": tanh(2 x_t + h + b)): elementwise sites in
    the step."""
    m = gc.Model(f"lrstep{kind}")
    x, h0, y = m.input("x", ("T", "B", 3)), m.input("h0", ("B", 3)), m.input("y", ("B",), dtype="int64")
    W, V = m.param("W", (3, 3)), m.param("V", (3, 4))
    if kind == "gain":
        g, b = m.param("g", (3,), init="ones"), m.param("b", (3,))
        step = lambda h, xt: (gc.tanh((xt @ W) * g + b) + 0.5 * h, None)
    elif kind == "gate":   # sigmoid(s) reads no step value: the step closes over it, made before the loop
        s = m.param("s", (3,))
        step = lambda h, xt: (gc.tanh(xt @ W) * gc.sigmoid(s) + h, None)
    else:
        b = m.param("b", (3,))
        step = lambda h, xt: (gc.tanh(xt * 2.0 + h @ W * 0.5 + h + b), None)
    hT, _ = gc.scan(step, h0, x)
    m.minimize(gc.softmax_cross_entropy(hT @ V, y))
    return m


def _noised_carry(kind):
    """A step whose noised value is also returned (found by review): "carry", a gained carry s * d + x_t U
    that the next pre-activation also adds; "y", a product returned as a y and added into the carry.
    The noise must stay on the returned value (a site's chain stops there)."""
    m = gc.Model(f"lrnoised{kind}")
    x, h0, y = m.input("x", ("T", "B", 3)), m.input("h0", ("B", 3)), m.input("y", ("B",), dtype="int64")
    W, U, V = m.param("W", (3, 3)), m.param("U", (3, 3)), m.param("V", (6, 4))
    if kind == "carry":
        d = m.param("d", (3,), init="ones")

        def step(c, xt):
            h, s = c
            s2 = s * d + xt @ U
            return (gc.tanh(h @ W + s2), s2), None
        (hT, sT), _ = gc.scan(step, (h0, h0), x)
        m.minimize(gc.softmax_cross_entropy(gc.concat([hT, sT], axis=1) @ V, y))
    else:
        def step(h, xt):
            z = xt @ U
            return gc.tanh(h @ W + z), z
        hT, zs = gc.scan(step, h0, x)
        m.minimize(gc.softmax_cross_entropy(gc.concat([hT, hT], axis=1) @ V, y) + gc.square(zs).mean())
    return m


def _penalty_over_a_count():
    """((nll * mask).sum() + 0.1 * |W0|^2) / mask.sum(): a penalty divided by the token count with the
    loss (found by review: refused as reading the loss's rows; mask.sum() is a constant of the estimate)."""
    m = gc.Model("lrpencount")
    x, t, mask = m.input("x", ("B", 5)), m.input("t", ("B", 3)), m.input("mask", ("B",))
    W0, W1 = m.param("W0", (5, 6)), m.param("W1", (6, 3))
    err = gc.square(gc.tanh(x @ W0) @ W1 - t).sum(axis=1)
    m.minimize(((err * mask).sum() + 0.1 * gc.square(W0).sum()) / mask.sum())
    return m


def _uncertainty_weighted():
    """Two tasks weighted by learned log-variances (Kendall et al.): l1 * exp(-s1) + l2 * exp(-s2) + s1 + s2,
    a classifier and a regressor on one hidden layer. The factors' parts read the losses after their
    reduction over rows (the unperturbed forward's), the shares are the losses scaled."""
    m = gc.Model("lruncertain")
    x, y, t = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64"), m.input("t", ("B", 2))
    W0, W1, W2 = m.param("W0", (5, 6)), m.param("W1", (6, 3)), m.param("W2", (6, 2))
    s1, s2 = m.param("s1", (1,)), m.param("s2", ())
    h = gc.tanh(x @ W0)
    l1, l2 = gc.softmax_cross_entropy(h @ W1, y), gc.square(h @ W2 - t).mean()
    m.minimize((l1 * gc.exp(-s1) + s1).sum() + l2 / gc.exp(s2) + s2)
    return m


MODELS = {
    "gain": lambda: _mlp("lrgain", lambda m, h: h * m.param("g", (6,), init="ones") + m.param("b", (6,))),
    "layer_norm": lambda: _mlp("lrln", _layer_norm),
    "gate_of_a_param": lambda: _mlp("lrgate", lambda m, h: h * gc.sigmoid(m.param("s", (1, 6)))),
    "weight_norm": lambda: _mlp("lrwn", lambda m, h: h, first=lambda m, V: V * (
        m.param("gn", (6,), init="ones") / gc.sqrt(gc.square(V).sum(axis=0)))),
    "low_rank": lambda: _mlp("lrlow", lambda m, h: h,
                             first=lambda m, W: W + m.param("U", (5, 2)) @ m.param("V", (2, 6))),
    "l2_in_the_loss": lambda: _mlp("lrl2", lambda m, h: h, loss=lambda xent, W0, W1: xent + 0.5 + 0.5 * (
        gc.square(W0).sum() + (W1 * W1).mean())),
    "affine_loss": lambda: _mlp("lraffine", lambda m, h: h, loss=lambda xent, W0, W1: 1.0 - 2.0 * (0.5 - xent)),
    "standardised_conv": _standardised_conv,
    "scan_of_a_scaled_weight": _scan_of_a_scaled_weight,
    "gain_in_a_step": lambda: _cell_with_a_gain("gain"),
    "bias_in_a_step": lambda: _cell_with_a_gain("bias"),
    "gate_in_a_step": lambda: _cell_with_a_gain("gate"),
    "noised_carry": lambda: _noised_carry("carry"),
    "noised_y": lambda: _noised_carry("y"),
    "penalty_over_a_count": _penalty_over_a_count,
    "loss_scaled_by_params": lambda: _mlp("lrscaledloss", lambda m, h: h, loss=lambda xent, W0, W1: xent * gc.exp(
        W1.sum()) + 0.1 * W0.sum()),
    "uncertainty_weighted": _uncertainty_weighted,
}
INPUTS = {
    "standardised_conv": lambda rng, B: {"x": rng.normal(size=(B, 1, 6, 6)), "y": rng.integers(0, 4, B)},
    "scan_of_a_scaled_weight": lambda rng, B: {"x": rng.normal(size=(4, B, 2)), "h0": rng.normal(size=(B, 3)),
                                               "y": rng.integers(0, 4, (4, B))},
    "gain_in_a_step": lambda rng, B: {"x": rng.normal(size=(4, B, 3)), "h0": rng.normal(size=(B, 3)),
                                      "y": rng.integers(0, 4, B)},
}
INPUTS["bias_in_a_step"] = INPUTS["gate_in_a_step"] = INPUTS["gain_in_a_step"]
INPUTS["noised_carry"] = INPUTS["noised_y"] = INPUTS["gain_in_a_step"]
INPUTS["uncertainty_weighted"] = lambda rng, B: {"x": rng.normal(size=(B, 5)), "y": rng.integers(0, 3, B),
                                                 "t": rng.normal(size=(B, 2))}
INPUTS["penalty_over_a_count"] = lambda rng, B: {"x": rng.normal(size=(B, 5)), "t": rng.normal(size=(B, 3)),
                                                 "mask": (rng.random(B) < 0.7).astype(float)}


def _problem(name, rng, B=7):
    graph = build_training_graph(MODELS[name](), "float64", order=1)
    params = {p: 0.5 * rng.normal(size=graph.shape(n)) + (1.0 if p in ("g", "gn") else 0.0)
              for p, n in graph.params.items()}
    inputs = INPUTS[name](rng, B) if name in INPUTS else {"x": rng.normal(size=(B, 5)), "y": rng.integers(0, 3, B)}
    return graph, params, inputs


@pytest.mark.parametrize("name", list(MODELS))
def test_params_read_other_than_as_a_factor_are_estimated_without_bias(name):
    graph, params, inputs = _problem(name, np.random.default_rng(1))
    assert graph.lr["why"] is None, graph.lr["why"]
    assert_unbiased(graph, params, inputs, name, "")


@pytest.mark.parametrize("name", ["layer_norm", "scan_of_a_scaled_weight", "gain_in_a_step", "uncertainty_weighted"])
def test_the_compiled_estimate_is_the_interpreters(name, tmp_path):
    graph, params, inputs = _problem(name, np.random.default_rng(2))
    check_lr_compiled(SimpleNamespace(model=MODELS[name](), params=params, inputs=inputs, seeds=name,
                                      text=lambda: name), str(tmp_path))


def test_dropconnect_is_the_same_for_every_row_with_the_batch_bound_to_a_weights_size():
    """Dropout of a weight (5, 6) with B bound to 6: the draw meets no rows, so it is a weight's noise, the
    same in every copy (found by review: its 6 was taken for the batch's)."""
    m = gc.Model("lrdropconnect")
    x, y, draw = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64"), m.input("draw", (), dtype="int64")
    W0, W1 = m.param("W0", (5, 6)), m.param("W1", (6, 3))
    m.minimize(gc.softmax_cross_entropy(gc.tanh(x @ gc.dropout(W0, 0.3, draw)) @ W1, y))
    graph = build_training_graph(m, "float64", dims={"B": 6}, order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(3)
    params = {p: rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    assert_unbiased(graph, params, {"x": rng.normal(size=(6, 5)), "y": rng.integers(0, 3, 6), "draw": np.array(5)},
                    "dropconnect", "")


def test_a_loss_scaled_by_a_param_in_a_scans_step_is_refused():
    """Outside a scan such a factor is differentiated exactly (loss_scaled_by_params above); in a step its
    part would need each step's loss, which the copy does not return."""
    m = gc.Model("lrstepscaled")
    x, y, h0 = m.input("x", ("T", "B", 3)), m.input("y", ("T", "B"), dtype="int64"), m.input("h0", ("B", 3))
    W, s = m.param("W", (3, 3)), m.param("s", (1,), init="ones")

    def step(h, xs):
        h = gc.tanh(xs[0] @ W + h)
        return h, gc.softmax_cross_entropy(h, xs[1]) * s
    _, losses = gc.scan(step, h0, (x, y))
    m.minimize(losses.mean())
    why = build_training_graph(m, "float64", order=1).lr["why"]
    assert "combines the step's loss with a value made of params" in why, why
