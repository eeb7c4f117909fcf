"""lr_grad with batch statistics (passes/lr_statistics.py, DESIGN.md §1.9): batch norm's mean and variance
over the rows, read back by the rows, taken per perturbed copy; and losses not affine in their reduction
over rows (the root of a mean squared error), one per copy. Each estimate is checked for bias per param
through the interpreter (fuzz_lr.assert_unbiased); one compiled module against the interpreter; refusals."""
from types import SimpleNamespace

import numpy as np
import pytest
import sympy as sp

import gradc as gc
from gradc.passes.pipeline import build_training_graph

from fuzz_lr import assert_unbiased, check_lr_compiled


def _batch_norm(h, axes, m, name, folded=False):
    """Batch norm in training mode: the batch's mean and (biased) variance over `axes`, a learned gain and
    shift per feature; `folded`: the gain applied to the statistic, (h - mu) * (g / sqrt(var + eps)) + b."""
    keep = len(axes) > 1
    mu = h.mean(axis=axes, keepdims=keep)
    var = gc.square(h - mu).mean(axis=axes, keepdims=keep)
    shape = (1, h.shape[1], 1, 1) if keep else (h.shape[1],)
    g, b = m.param(f"{name}_g", shape, init="ones"), m.param(f"{name}_b", shape, init="zeros")
    if folded:
        return (h - mu) * (g / gc.sqrt(var + 1e-5)) + b
    return (h - mu) / gc.sqrt(var + 1e-5) * g + b


def _bn_mlp():
    m = gc.Model("lrbnmlp")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    h = gc.tanh(_batch_norm(x @ m.param("W0", (5, 6)), (0,), m, "bn0"))
    h = gc.relu(_batch_norm(h @ m.param("W1", (6, 6)), (0,), m, "bn1"))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W2", (6, 3)), y))
    return m


def _bn_conv():
    m = gc.Model("lrbnconv")
    x, y = m.input("x", ("B", 1, 6, 6)), m.input("y", ("B",), dtype="int64")
    h = gc.conv2d(x, m.param("w", (3, 1, 3, 3), init="he_normal"), padding=1)
    h = gc.max_pool2d(gc.relu(_batch_norm(h, (0, 2, 3), m, "bn")), 2).reshape(("B", -1))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W", (27, 4)), y))
    return m


def _centred():
    """Rows centred by their batch's mean alone, h - h.mean(0), between two layers (no variance)."""
    m = gc.Model("lrcentred")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (5, 6)))
    m.minimize(gc.softmax_cross_entropy((h - h.mean(axis=0)) @ m.param("W1", (6, 3)), y))
    return m


def _time_major():
    """A scan's stacked results (T, B, H), rows on axis 1, normalised over the batch at each step
    (hs - hs.mean(1)) / sqrt(var + eps); the loss the root of the mean cross-entropy over (T, B)."""
    m = gc.Model("lrtimemajor")
    x, h0, y = m.input("x", ("T", "B", 2)), m.input("h0", ("B", 3)), m.input("y", ("T", "B"), dtype="int64")
    W, U = m.param("W", (3, 3)), m.param("U", (2, 3))
    _, hs = gc.scan(lambda h, xt: (gc.tanh(h @ W + xt @ U),) * 2, h0, x)
    centred = hs - hs.mean(axis=1, keepdims=True)
    normed = centred / gc.sqrt(gc.square(centred).mean(axis=1, keepdims=True) + 1e-3)
    m.minimize(gc.sqrt(gc.softmax_cross_entropy(normed @ m.param("V", (3, 4)), y)))
    return m


def _root_loss(kind):
    """A loss not affine in its mean over rows: "rmse", the root of a mean squared error; "log", the log of
    a cross-entropy's mean; "penalised", the root of a cross-entropy plus an L2 penalty (the penalty's part
    exact, from the unperturbed loss)."""
    m = gc.Model(f"lr{kind}")
    x = m.input("x", ("B", 5))
    W1 = m.param("W1", (6, 3))
    out = gc.tanh(x @ m.param("W0", (5, 6))) @ W1
    if kind == "rmse":
        m.minimize(gc.sqrt(gc.mse(out, m.input("t", ("B", 3)))))
    elif kind == "penalised":
        xent = gc.softmax_cross_entropy(out, m.input("y", ("B",), dtype="int64"))
        m.minimize(gc.sqrt(xent + 0.3 * gc.square(W1).sum()))
    else:
        m.minimize(gc.log(gc.softmax_cross_entropy(out, m.input("y", ("B",), dtype="int64"))))
    return m


def _trial(kind):
    """Statistics found by new-user trial K: "max_scaled", a layer scaled by its batch's max |h| (and the
    input by its own, which no noise reaches); "moments", batch norm's variance as E[h^2] - mu^2;
    "reshaped", a conv's per-channel mean taken as (C,) and reshaped to (1, C, 1, 1); "column_rmse", the
    sum of per-column RMSEs; "log_mse_plus_xent", the log of one task's mse plus another's cross-entropy."""
    m = gc.Model(f"lrtrial{kind}")
    x, y, t = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64"), m.input("t", ("B", 3))
    W0, W1 = m.param("W0", (5, 6)), m.param("W1", (6, 3))
    h = x @ W0
    if kind == "max_scaled":
        h = (x / gc.abs(x).max(axis=0)) @ W0
        h = h / gc.abs(h).max(axis=0)
    elif kind == "moments":
        mu = h.mean(axis=0)
        h = (h - mu) / gc.sqrt(gc.square(h).mean(axis=0) - mu * mu + 1e-3)
    elif kind == "reshaped":
        c = gc.conv2d(h.reshape(("B", 1, 2, 3)), m.param("k", (2, 1, 2, 2)), padding=1)   # (B, 2, 3, 4)
        c = c - c.mean(axis=(0, 2, 3)).reshape((1, 2, 1, 1))
        h = c.reshape(("B", 24)) @ m.param("P", (24, 6))
    out = gc.tanh(h) @ W1
    if kind == "column_rmse":
        m.minimize(gc.sqrt(gc.square(out - t).mean(axis=0)).sum())
    elif kind == "log_mse_plus_xent":
        m.minimize(gc.log(gc.mse(out, t)) + gc.softmax_cross_entropy(gc.tanh(h) @ m.param("W2", (6, 3)), y))
    else:
        m.minimize(gc.softmax_cross_entropy(out, y))
    return m


def _in_a_sum(kind):
    """A batch statistic added in a site's sum (found by review L: compile crashed): "sum", h @ W1 + mean(h);
    "gain", tanh(h * g + mean(h)); "mix", (h - mu) * g + mu."""
    m = gc.Model(f"lrinsum{kind}")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (5, 3)))
    mu = h.mean(axis=0)
    if kind == "sum":
        out = h @ m.param("W1", (3, 3)) + mu
    elif kind == "gain":
        out = gc.tanh(h * m.param("bn_g", (3,), init="ones") + mu) @ m.param("W1", (3, 3))
    else:
        out = ((h - mu) * m.param("bn_g", (3,), init="ones") + mu) @ m.param("W1", (3, 3))
    m.minimize(gc.softmax_cross_entropy(out, y))
    return m


def _param_on_statistic(kind):
    """A param applied to a batch statistic the rows read (noise on each copy's value): "folded", batch norm
    with its scale folded, (h - mu) * (g / sqrt(var + eps)) + b, in an MLP; "folded_conv", the same per channel
    after a conv; "scaled_mean", h - s * h.mean(0); "input_folded", the folded batch norm of the input itself
    (statistics no noise reaches: an estimate with no part for g before, found by the lr fuzzer)."""
    m = gc.Model(f"lrstatparam{kind}")
    y = m.input("y", ("B",), dtype="int64")
    if kind == "input_folded":
        h = m.input("x", ("B", 5))
        axes, shape = (0,), (5,)
    elif kind == "folded_conv":
        x = m.input("x", ("B", 1, 6, 6))
        h = gc.conv2d(x, m.param("w", (3, 1, 3, 3), init="he_normal"), padding=1)
        axes, shape = (0, 2, 3), (1, 3, 1, 1)
    else:
        x = m.input("x", ("B", 5))
        h = gc.tanh(x @ m.param("W0", (5, 6))) @ m.param("W1", (6, 6))
        axes, shape = (0,), (6,)
    if kind == "scaled_mean":
        h = h - h.mean(axis=axes, keepdims=len(axes) > 1) * m.param("s", shape, init="ones")
    else:
        h = _batch_norm(h, axes, m, "bn", folded=True)
    h = gc.relu(h)
    if kind == "folded_conv":
        h = gc.max_pool2d(h, 2).reshape(("B", -1))
    width = {"folded_conv": 27, "input_folded": 5}.get(kind, 6)
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W", (width, 3)), y))
    return m


MODELS = {"bn_mlp": _bn_mlp, "bn_conv": _bn_conv, "centred": _centred,
          "rmse": lambda: _root_loss("rmse"), "log_loss": lambda: _root_loss("log"),
          "penalised_root": lambda: _root_loss("penalised"), "time_major": _time_major,
          **{kind: (lambda kind=kind: _trial(kind)) for kind in ("max_scaled", "moments", "reshaped", "column_rmse",
                                                                 "log_mse_plus_xent")},
          **{f"in_a_{kind}": (lambda kind=kind: _in_a_sum(kind)) for kind in ("sum", "gain", "mix")},
          **{kind: (lambda kind=kind: _param_on_statistic(kind)) for kind in ("folded", "folded_conv", "scaled_mean",
                                                                              "input_folded")}}
TRIAL = ("max_scaled", "moments", "reshaped", "column_rmse", "log_mse_plus_xent")


def _problem(name, rng, B=8):
    graph = build_training_graph(MODELS[name](), "float64", order=1)
    params = {p: 0.5 * rng.normal(size=graph.shape(n)) + (1.0 if p.endswith("_g") else 0.0)
              for p, n in graph.params.items()}
    if name == "time_major":
        return graph, params, {"x": rng.normal(size=(3, B, 2)), "h0": rng.normal(size=(B, 3)),
                               "y": rng.integers(0, 4, (3, B))}
    inputs = {"x": rng.normal(size=(B, 1, 6, 6) if name in ("bn_conv", "folded_conv") else (B, 5))}
    if name in TRIAL:
        return graph, params, dict(inputs, y=rng.integers(0, 3, B), t=rng.normal(size=(B, 3)))
    if name == "rmse":
        inputs["t"] = rng.normal(size=(B, 3))
    else:
        inputs["y"] = rng.integers(0, 4 if name == "bn_conv" else 3, B)
    return graph, params, inputs


@pytest.mark.parametrize("name", list(MODELS))
def test_batch_statistics_are_taken_per_copy_without_bias(name):
    graph, params, inputs = _problem(name, np.random.default_rng(0))
    assert graph.lr["why"] is None, graph.lr["why"]
    assert_unbiased(graph, params, inputs, name, "")


def test_a_site_before_a_statistic_pairs_with_its_copys_whole_loss():
    """The first layer's noise reaches every row through the batch's mean: "sample"; the gain after the
    statistic and the last layer reach their own row only: "row"."""
    graph, _, _ = _problem("bn_mlp", np.random.default_rng(1))
    pairs = [(s["op"], s["pairs"]) for s in graph.lr["sites"]]
    assert pairs == [("matmul", "sample"), ("mul", "sample"), ("matmul", "sample"), ("mul", "row"),
                     ("matmul", "row")], pairs


@pytest.mark.parametrize("name", ["bn_conv", "rmse", "folded"] + [pytest.param(name, marks=pytest.mark.slow)
                                                                     for name in ("time_major", "in_a_mix",
                                                                                  "folded_conv")])
def test_the_compiled_estimate_is_the_interpreters(name, tmp_path):
    _, params, inputs = _problem(name, np.random.default_rng(2))
    check_lr_compiled(SimpleNamespace(model=MODELS[name](), params=params, inputs=inputs, seeds=name,
                                      text=lambda: name), str(tmp_path))


def test_the_bias_check_finds_a_site_before_a_statistic_paired_per_row(monkeypatch):
    """The check can fail: with the sites whose noise reaches a batch statistic paired with their own row's
    loss alone (the coupling through the batch's mean left out), the batch-normed MLP is biased."""
    from gradc.passes import likelihood_ratio
    graph, params, inputs = _problem("bn_mlp", np.random.default_rng(0))
    pairing = likelihood_ratio._Builder.pairing
    monkeypatch.setattr(likelihood_ratio._Builder, "pairing",
                        lambda self, site: "row" if not self.mixing else pairing(self, site))
    graph = build_training_graph(_bn_mlp(), "float64", order=1)
    with pytest.raises(AssertionError, match="mean squared z-score"):
        assert_unbiased(graph, params, inputs, "bn_mlp paired per row", "")


@pytest.mark.parametrize("mode", [dict(antithetic=False), dict(layerwise=True), dict(baseline=False)],
                         ids=["plain", "layerwise", "no_baseline"])
def test_a_param_applied_to_a_statistic_is_unbiased_in_every_mode(mode):
    """The per-copy masks of a statistic's site under each option: one sign per copy, set at call time."""
    graph, params, inputs = _problem("scaled_mean", np.random.default_rng(0))
    assert_unbiased(graph, params, inputs, f"scaled_mean {mode}", "", samples=64 if mode.get("layerwise") else 256,
                    mode=mode)


def test_a_param_applied_to_a_statistic_gets_noise_per_copy():
    """Batch norm's folded scale g / sqrt(var + eps): a site whose value is a statistic, noised once per copy
    (a mask of one sign per copy), paired with the copy's whole loss; the bias after it is a site on rows."""
    graph, _, _ = _problem("folded", np.random.default_rng(1))
    sites = [(s["op"], s["pairs"], s["per_copy"]) for s in graph.lr["sites"]]
    assert sites == [("matmul", "sample", False), ("matmul", "sample", False), ("div", "copy", True),
                     ("add", "row", False), ("matmul", "row", False)], sites
    assert [tuple(graph.shape(graph.lr["leaves"][f"mask{i}"])) for i in (2, 3)] == [("K_lr", 1), ("KB_lr", 1)]


def test_the_memory_check_counts_one_sign_per_copy_for_a_statistics_site(monkeypatch):
    """Review M: the check before the leaves are made counted a statistic's mask (one sign per copy) as one
    sign per copy and row. 8 bytes for each of a call's 1000 copies times 1000 rows (their flags) and 5:
    enough memory for that, not for a second sign per row."""
    from gradc.codegen.lr_api import lr_info
    from gradc.runtime import lr
    graph, _, _ = _problem("folded", np.random.default_rng(1))
    info = dict(lr_info(graph), masks=[("mask0", 2, True)], tiled={})
    monkeypatch.setattr(lr, "available_bytes", lambda: 8 * 1000 * (1000 + 5))
    lr.LikelihoodRatio("m", np.float64, info)._refuse_beyond_memory(1000, False, 1000, 1000)
    info["masks"] = [("mask0", 2, False)]
    with pytest.raises(MemoryError, match="noise signs alone need"):
        lr.LikelihoodRatio("m", np.float64, info)._refuse_beyond_memory(1000, False, 1000, 1000)


def test_a_param_the_estimate_does_not_reach_is_refused_not_given_zero(monkeypatch):
    """The safety net (`uncovered`): with the folded batch norm of an input built the old way (its sums
    constants, so no site or exact VJP goes through g), lr_grad is refused naming g; before, g's estimate
    was silently 0."""
    from gradc.passes import likelihood_ratio
    monkeypatch.setattr(likelihood_ratio._Builder, "sites_on_statistics", lambda self, tops, rowful: None)
    why = build_training_graph(MODELS["input_folded"](), "float64", order=1).lr["why"]
    assert "param 'bn_g' (5,) reaches the loss, but the estimate has no part for it" in why, why


def test_a_param_whose_gradient_is_zero_is_estimated_as_zero():
    """A param under sign(): loss_and_grad's gradient is 0, and so is the estimate (found by review: the
    safety net's first version refused it, as a param without a part)."""
    m = gc.Model("lrsignparam")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    sign = gc.elementwise("lrsign", lambda a: sp.sign(a))
    h = gc.tanh(x @ m.param("W0", (5, 6))) * sign(m.param("p", (6,)))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W", (6, 3)), y))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    assert graph.grads["p"] is None and graph.lr_grads["p"] is None


def test_a_max_of_a_sum_over_rows_that_no_noise_reaches_compiles():
    """x.sum(axis=0).max() scaling a layer (found by trial K: compile crashed in the estimate's pass): a
    constant of the estimate, whose loss_and_grad and lr_grad both work."""
    m = gc.Model("lrmaxofsum")
    x, t = m.input("x", ("B", 5)), m.input("t", ("B", 2))
    m.minimize(gc.mse((x @ m.param("W", (5, 2))) / x.sum(axis=0).max(), t))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(3)
    params = {"W": rng.normal(size=(5, 2))}
    assert_unbiased(graph, params, {"x": np.abs(rng.normal(size=(6, 5))), "t": rng.normal(size=(6, 2))}, "max of sum",
                    "")


def test_a_rule_refusing_what_the_estimate_builds_refuses_lr_grad_only(monkeypatch):
    """Compile never fails because of the estimate's pass (review L found a reshape rule refusing a
    statistic's view): such an error becomes lr_grad's reason, and loss_and_grad is built as ever."""
    from gradc.errors import GradcError
    from gradc.passes import likelihood_ratio

    def refuse(self):
        raise GradcError("reshape: a rule refused")
    monkeypatch.setattr(likelihood_ratio._Builder, "exact_parts", refuse)
    graph = build_training_graph(_bn_mlp(), "float64", order=1)
    assert "lr_grad cannot build its estimate of this model: reshape: a rule refused" in graph.lr["why"]
    assert all(graph.grads[p] is not None for p in graph.params)
