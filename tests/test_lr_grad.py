"""lr_grad: the likelihood-ratio estimate (passes/likelihood_ratio.py, DESIGN.md §1.9).

The estimator's statistics are checked through the numpy interpreter of its graph (fast: no Numba),
on an MLP, a conv net and a graph convolution, in float64; one compiled module checks that the
generated code computes the same graph, the argument checks, and Trainer(gradient="lr").
"""
import json
import os

import numpy as np
import pytest

import gradc as gc
from gradc.codegen.lr_api import lr_info
from gradc.interpret import evaluate
from gradc.passes.likelihood_ratio import estimate_nodes
from gradc.passes.lr_sites import KB
from gradc.passes.pipeline import build_training_graph
from gradc.runtime.lr import KEPT_HOST_SETS, LikelihoodRatio

SCALARS = ("lr:seed", "lr:half", "lr:sigma", "lr:scale")


def mlp(weight_decay=1e-2):
    m = gc.Model("lrmlp")
    x = m.input("x", ("B", 5))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i, (a, b) in enumerate([(5, 7), (7, 3)]):
        W = m.param(f"W{i}", (a, b))
        bias = m.param(f"b{i}", (b,), init="normal")
        h = h @ W + bias
        if i == 0:
            h = gc.tanh(h)
    m.output("logits", h)
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=weight_decay)
    return m


def conv():
    m = gc.Model("lrconv")
    x = m.input("x", ("B", 1, 6, 6))
    y = m.input("y", ("B",), dtype="int64")
    w = m.param("w", (3, 1, 3, 3), init="he_normal")
    cb = m.param("cb", (1, 3, 1, 1), init="zeros")
    h = gc.max_pool2d(gc.relu(gc.conv2d(x, w) + cb), 2).reshape(("B", -1))
    W = m.param("W", (12, 4))
    b = m.param("b", (4,), init="zeros")
    m.minimize(gc.softmax_cross_entropy(h @ W + b, y))
    return m


def gcn(A):
    m = gc.Model("lrgcn")
    x = m.input("x", (6, 4))
    y = m.input("y", (6,), dtype="int64")
    W0, W1 = m.param("W0", (4, 5)), m.param("W1", (5, 3))
    h = gc.tanh(A @ x @ W0)
    m.minimize(gc.softmax_cross_entropy(A @ h @ W1, y), weight_decay=1e-2)
    return m


def problem(name, rng):
    if name == "mlp":
        params = {"W0": rng.normal(size=(5, 7)), "b0": 0.1 * rng.normal(size=7), "W1": rng.normal(size=(7, 3)),
                  "b1": 0.1 * rng.normal(size=3)}
        return mlp(), params, {"x": rng.normal(size=(8, 5)), "y": rng.integers(0, 3, 8)}
    if name == "conv":
        params = {"w": rng.normal(size=(3, 1, 3, 3)), "cb": 0.1 * rng.normal(size=(1, 3, 1, 1)),
                  "W": rng.normal(size=(12, 4)), "b": 0.1 * rng.normal(size=4)}
        return conv(), params, {"x": rng.normal(size=(5, 1, 6, 6)), "y": rng.integers(0, 4, 5)}
    A = rng.uniform(size=(6, 6))
    A = (A + A.T) / 2
    A /= A.sum(1, keepdims=True)   # a normalised adjacency, as a constant
    return gcn(A), {"W0": rng.normal(size=(4, 5)), "W1": rng.normal(size=(5, 3))}, {
        "x": rng.normal(size=(6, 4)), "y": rng.integers(0, 3, 6)}


def interpret_lr(graph, params, inputs, samples, sigma, seed, antithetic=True, layerwise=False, baseline=True):
    """(estimate, true gradient) as flat vectors, through the interpreter of the lr graph."""
    lr = LikelihoodRatio("m", np.float64, lr_info(graph))
    leaves = lr.leaves(dict(inputs), *lr.check(samples, sigma, seed, antithetic, layerwise, baseline))
    saved = dict(graph.inputs)
    graph.inputs = saved | {f"lr:{k}": n for k, n in graph.lr["leaves"].items() if n in graph}
    try:
        values = {k: (v[0] if k in SCALARS else v) for k, v in leaves.items()}
        names = [p for p in params if graph.lr_grads.get(p) is not None]
        out = evaluate(graph, params, values, [graph.lr_grads[p] for p in names] + [graph.grads[p] for p in names])
    finally:
        graph.inputs = saved
    est = np.concatenate([out[graph.lr_grads[p]].ravel() for p in names])
    true = np.concatenate([out[graph.grads[p]].ravel() for p in names])
    return est, true


def assert_mean_converges(graph, params, inputs, seeds):
    """The mean of `seeds` estimates goes to the gradient like 1/sqrt(K): 16x the samples shrinks its error
    by about 4 (asserted: 2.5), to below 0.4 of the gradient's norm."""
    errors = []
    for samples in (16, 256):
        runs = [interpret_lr(graph, params, inputs, samples, 1e-3, seed) for seed in range(seeds)]
        true = runs[0][1]
        assert np.linalg.norm(true) > 1e-3
        mean = np.mean([e for e, _ in runs], axis=0)
        errors.append(np.linalg.norm(mean - true) / np.linalg.norm(true))
    assert errors[1] < errors[0] / 2.5 and errors[1] < 0.4, errors


@pytest.mark.parametrize("name", ["mlp", "conv", "gcn"])
def test_mean_over_seeds_converges_to_the_gradient(name):
    m, params, inputs = problem(name, np.random.default_rng(0))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None
    assert graph.lr["per_row"] == (name != "gcn")   # A @ H mixes rows: each sample's whole loss pairs with its noise
    assert_mean_converges(graph, params, inputs, seeds=8)


@pytest.mark.parametrize("reduce", [lambda e: e.mean(axis=0).sum(), lambda e: e.sum(axis=0, keepdims=True).mean(),
                                    lambda e: e.T.mean(axis=1, keepdims=True).sum()], ids=["mean", "keepdims", "axis1"])
def test_a_loss_averaged_over_rows_then_summed_over_outputs_is_estimated(reduce):
    """((pred - t)**2).mean(axis=0).sum(): the reduction over rows leaves one value per output, summed after
    it. Each row's shares are kept per output and summed (it was refused, or viewed to the wrong shape); with
    keepdims, and with the rows on axis 1 (a fuzzer's program had keepdims refused)."""
    m = gc.Model("lrmse")
    x, t = m.input("x", ("B", 5)), m.input("t", ("B", 3))
    W0, W1, b1 = m.param("W0", (5, 6)), m.param("W1", (6, 3)), m.param("b1", (3,), init="normal")
    m.minimize(reduce(gc.square(gc.tanh(x @ W0) @ W1 + b1 - t)))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(4)
    params = {k: rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(7, 5)), "t": rng.normal(size=(7, 3))}
    assert_mean_converges(graph, params, inputs, seeds=8)


def test_a_tied_embedding_gets_the_parts_of_its_lookup_and_its_product():
    """E read by take (a bag of token embeddings) and as the output layer's factor E^T: two sites, the
    table's estimate the sum of the lookup's scatter-add and the product's part."""
    m = gc.Model("lrtied")
    tok, y = m.input("tok", ("B", 3), dtype="int64"), m.input("y", ("B",), dtype="int64")
    E, W = m.param("E", (6, 4), init="normal"), m.param("W", (4, 4))
    h = gc.tanh(gc.take(E, tok).mean(axis=1) @ W)
    m.minimize(gc.softmax_cross_entropy(h @ gc.transpose(E, (1, 0)), y))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None and [s["op"] for s in graph.lr["sites"]] == ["take", "matmul", "matmul"]
    rng = np.random.default_rng(12)
    params = {k: rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    assert_mean_converges(graph, params, {"tok": rng.integers(0, 6, (5, 3)), "y": rng.integers(0, 6, 5)}, seeds=8)


def test_a_bias_added_after_a_scale_or_another_op_is_its_own_site():
    """From a new-user trial: (x @ W) * 0.5 + b and logits + c (c added after the product's other uses, or
    after a scan's stacked logits) were refused as misused params. The add gets noise of its own; the
    bias's part is the add's VJP (a sum over rows)."""
    m = gc.Model("lrbias")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    W0, b0, W1, c = m.param("W0", (5, 6)), m.param("b0", (6,)), m.param("W1", (6, 3)), m.param("c", (3,))
    h = gc.tanh((x @ W0) * 0.5 + b0)
    logits = h @ W1
    m.minimize(gc.softmax_cross_entropy(logits + c, y) + 0.1 * gc.square(logits).mean())
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    assert [s["op"] for s in graph.lr["sites"]] == ["matmul", "add", "matmul", "add"]
    rng = np.random.default_rng(16)
    params = {k: rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    assert_mean_converges(graph, params, {"x": rng.normal(size=(6, 5)), "y": rng.integers(0, 3, 6)}, seeds=8)


@pytest.mark.parametrize("kind", ["centred", "masked"])
def test_a_sum_over_rows_no_noise_reaches_is_a_constant_of_the_estimate(kind):
    """Inputs centred by their batch mean (x - x.mean(0)), and a loss weighted by mask / mask.sum() inside
    the sum: those sums are the same in every copy. Found by review: a first version paired each copy's
    rows with the sum's per-row shares (a biased estimate, 1.4 and 5.7 relative error); before, refused."""
    m = gc.Model(f"lr_{kind}")
    x, y, mask = m.input("x", ("B", 4)), m.input("y", ("B",), dtype="int64"), m.input("mask", ("B",))
    W, V = m.param("W", (4, 5)), m.param("V", (5, 3))
    h = gc.tanh((x - x.mean(axis=0) if kind == "centred" else x) @ W) @ V
    nll = -(gc.log_softmax(h, axis=-1) * gc.take(np.eye(3), y)).sum(axis=-1)
    m.minimize((nll * mask / mask.sum()).sum() if kind == "masked" else nll.mean())
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(17)
    params = {k: 0.7 * rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(6, 4)) + 1, "y": rng.integers(0, 3, 6), "mask": np.array([1.0, 1, 0, 1, 1, 1])}
    assert_mean_converges(graph, params, inputs, seeds=8)


def test_a_mean_over_rows_added_to_a_sum_over_rows_is_estimated():
    """A classifier's mean cross-entropy plus a summed regression term: each row's share is l_b / B + r_b.
    The kinds differ, which matters to microbatches (the weights of their losses), not to the shares: it
    was refused ("mixes a value reduced over rows")."""
    m = gc.Model("lrmixed")
    x, y, t = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64"), m.input("t", ("B", 2))
    W0, W1, W2 = m.param("W0", (5, 6)), m.param("W1", (6, 3)), m.param("W2", (6, 2))
    h = gc.tanh(x @ W0)
    m.minimize(gc.softmax_cross_entropy(h @ W1, y) + 0.1 * gc.square(h @ W2 - t).sum())
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(11)
    params = {k: rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(6, 5)), "y": rng.integers(0, 3, 6), "t": rng.normal(size=(6, 2))}
    assert_mean_converges(graph, params, inputs, seeds=8)


def test_an_input_whose_later_axis_equals_a_literal_batch_is_shared():
    """Found by review: x (8, 5) and a projection P (5, 8) given as an input. A literal batch of 8 is the
    batch on axis 0 only (where rows go); P's 8 is a column count, so P is shared, as before the rule that
    finds a named batch on any axis (targets (T, B))."""
    m = gc.Model("lrliteral")
    x, y, P = m.input("x", (8, 5)), m.input("y", (8,), dtype="int64"), m.input("P", (5, 8))
    m.minimize(gc.softmax_cross_entropy(gc.tanh(x @ P) @ m.param("W", (8, 3)), y))
    lr = build_training_graph(m, "float64", order=1).lr
    assert lr["why"] is None and "P" not in lr["tiled"] and lr["tiled"]["x"] == (None, 0), lr


def test_a_batch_bound_to_the_size_of_its_features_is_not_an_adjacency():
    """Found by a new-user trial: x (B, 5) with --bind B=5 is (5, 5) and read only as a left factor, like a
    GCN's adjacency; lr_grad was left out of the build ("rows on axis None"). The declared shape tells them apart."""
    m, params, inputs = problem("mlp", np.random.default_rng(0))
    inputs = {"x": inputs["x"][:5], "y": inputs["y"][:5]}
    bound, free = (build_training_graph(m, "float64", dims, order=1) for dims in ({"B": 5}, {}))
    assert bound.lr["why"] is None and bound.lr["per_row"]
    est_bound, true = interpret_lr(bound, params, inputs, 8, 1e-3, seed=3)
    est_free, _ = interpret_lr(free, params, inputs, 8, 1e-3, seed=3)
    np.testing.assert_allclose(est_bound, est_free, rtol=1e-12, atol=1e-12)


def reads_only_leaves_of_the_forward(graph):
    """The estimate reads no value of the forward but leaves (inputs, params, counts): its clean values are
    its own, so the forward's products keep their only readers and fuse as in a build without lr_grad."""
    estimate = estimate_nodes(graph)
    read = {u for n in estimate for u in graph.operands(n) if u not in estimate}
    return all(not graph.operands(u) for u in read)


def test_values_no_noise_reaches_are_computed_once():
    """The first layer's product reads the input alone: one product on B rows, its K copies a broadcast,
    and the site's weight gradient sums the copies' cotangents first. A GCN's A @ X likewise runs once;
    only the A @ H after the noise runs per sample (and makes the pairing per sample)."""
    def on_stacked_rows(graph, op):
        return [n for n in estimate_nodes(graph) if graph.op(n) == op and graph.shape(n)[:1] == (KB,)]

    graph = build_training_graph(mlp(), "float64", order=1)
    assert len(on_stacked_rows(graph, "matmul")) == 1        # the second layer's; the first runs on B rows
    assert reads_only_leaves_of_the_forward(graph)
    m, _, _ = problem("gcn", np.random.default_rng(0))
    graph = build_training_graph(m, "float64", order=1)
    assert reads_only_leaves_of_the_forward(graph)
    assert len([n for n in estimate_nodes(graph) if graph.op(n) == "batch_matmul"]) == 1
    assert len(graph.lr["mixing"]) == 1


@pytest.mark.parametrize("mode", [dict(antithetic=False), dict(layerwise=True), dict(antithetic=False, layerwise=True)])
def test_every_mode_is_unbiased(mode):
    m, params, inputs = problem("mlp", np.random.default_rng(1))
    graph = build_training_graph(m, "float64", order=1)
    runs = [interpret_lr(graph, params, inputs, 128, 0.05 if not mode.get("antithetic", True) else 1e-3, seed, **mode)
            for seed in range(16)]
    true = runs[0][1]
    mean = np.mean([e for e, _ in runs], axis=0)
    assert np.linalg.norm(mean - true) / np.linalg.norm(true) < 0.1


def test_antithetic_pairs_and_the_baseline_lower_the_variance():
    m, params, inputs = problem("mlp", np.random.default_rng(2))
    graph = build_training_graph(m, "float64", order=1)

    def spread(**mode):
        runs = [interpret_lr(graph, params, inputs, 32, 0.01, seed, **mode) for seed in range(12)]
        true = runs[0][1]
        return np.mean([np.sum((e - true) ** 2) for e, _ in runs])

    plain = spread(antithetic=False, baseline=False)
    assert spread(antithetic=True) < plain / 20
    assert spread(antithetic=False, baseline=True) < plain / 20


def test_weight_decay_is_exact():
    """With decay on W0 and W1 only, the estimate's difference between two decays is exactly wd * W."""
    rng = np.random.default_rng(3)
    _, params, inputs = problem("mlp", rng)
    a = interpret_lr(build_training_graph(mlp(0.0), "float64", order=1), params, inputs, 4, 1e-3, 5)[0]
    b = interpret_lr(build_training_graph(mlp(0.5), "float64", order=1), params, inputs, 4, 1e-3, 5)[0]
    decay = np.concatenate([0.5 * params["W0"].ravel(), np.zeros(7), 0.5 * params["W1"].ravel(), np.zeros(3)])
    np.testing.assert_allclose(b - a, decay, rtol=1e-12, atol=1e-12)


def test_bad_arguments_are_refused_by_name():
    graph = build_training_graph(mlp(), "float64", order=1)
    lr = LikelihoodRatio("lrmlp", np.float32, lr_info(graph))
    good = dict(samples=4, sigma=0.1, seed=0, antithetic=True, layerwise=False, baseline=True)
    for bad, match in [(dict(samples=0), "samples must be an int >= 1"), (dict(samples=2.0), "samples must be an int"),
                       (dict(sigma=0.0), "sigma must be a finite number > 0"), (dict(sigma=-1), "sigma"),
                       (dict(sigma=float("nan")), "sigma"), (dict(sigma=1e-30), "out of float32's range"),
                       (dict(sigma=1e-20), "out of float32's range"),   # (sigma**2 subnormal: nan estimates, trial U)
                       (dict(sigma=1e19), "out of float32's range"),    # (1 / sigma**2 subnormal)
                       (dict(samples=5), "samples=5 is odd"), (dict(seed=1.5), "seed must be an int"),
                       (dict(seed=2**63), r"seed must be an int in int64's range"), (dict(seed=-2**63 - 1), "range"),
                       (dict(layerwise="yes"), "layerwise must be True or False")]:
        with pytest.raises(ValueError, match=match):
            lr.check(**(good | bad))
    assert lr.check(**(good | dict(samples=5, antithetic=False)))[0] == 5
    assert lr.check(**(good | dict(seed=2**63 - 1)))[2] == 2**63 - 1
    assert lr.check(**(good | dict(sigma=1.1e-19)))[1] == 1.1e-19   # sigma**2 just above float32's tiny
    # 0-d arrays are their numbers, as numpy scalars are (trial U); a 0-d bool is no number
    assert lr.check(**(good | dict(samples=np.array(6), sigma=np.array(0.01), seed=np.array(3))))[:3] == (6, 0.01, 3)
    with pytest.raises(ValueError, match="sigma must be a finite number"):
        lr.check(**(good | dict(sigma=np.array(True))))
    wide = LikelihoodRatio("lrmlp", np.float64, lr_info(graph))
    with pytest.raises(ValueError, match="out of float64's range"):
        wide.check(**(good | dict(sigma=1e-160)))


def test_an_input_named_as_an_option_is_named(tmp_path):
    """Found by a new-user trial: an input named sigma made every call of lr_grad fail on something else
    (sigma=array was checked as the option, or the input was missing). The Trainer takes such an input."""
    m = gc.Model("lr_named")
    x, target = m.input("x", ("B", 3)), m.input("sigma", ("B", 1))
    m.minimize(gc.mse(x @ m.param("W", (3, 1), init="normal"), target))
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=1, warm=False)
    rng = np.random.default_rng(0)
    inputs, params = {"x": rng.standard_normal((4, 3)), "sigma": rng.standard_normal((4, 1))}, mod.init_params(0)
    for call in (lambda: mod.lr_grad(params, **inputs), lambda: mod.lr_grad(params, sigma=1e-2, x=inputs["x"])):
        with pytest.raises(ValueError, match=r"lr_named.lr_grad: the model has input\(s\) named 'sigma', as lr_grad's "
                                             r"option\(s\), so a call cannot give both: rename"):
            call()
    tr = mod.Trainer(params, optimizer="sgd", lr=0.1, gradient="lr", samples=4, sigma=1e-2)
    assert np.isfinite(tr.step(**inputs)) and tr.steps == 1


def _dropout_mlp():
    m = gc.Model("lr_dropout")
    # (an input named seed could not be given beside lr_grad's option seed: the README says rename it)
    x, y, seed = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64"), m.input("draw", (), dtype="int64")
    h = gc.dropout(gc.tanh(gc.gaussian_noise(x, 0.1, seed) @ m.param("W0", (5, 7))), 0.3, seed)
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W1", (7, 3)), y))
    return m


def test_dropout_and_noise_are_the_same_in_every_copy(build_dir):
    """The model's own random ops draw from the seed input, once, and every perturbed copy reads those
    draws: the estimate is of loss_and_grad's gradient for that seed (a dropout was refused; before that,
    found by a new-user trial, it failed on an internal shape error)."""
    graph = build_training_graph(_dropout_mlp(), "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(13)
    params = {k: rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(6, 5)), "y": rng.integers(0, 3, 6), "draw": np.array(11)}
    assert_mean_converges(graph, params, inputs, seeds=8)
    other = interpret_lr(graph, params, dict(inputs, draw=np.array(12)), 4, 1e-3, 0)[1]
    assert np.abs(other - interpret_lr(graph, params, inputs, 4, 1e-3, 0)[1]).max() > 0.1   # another seed, another mask
    mod = gc.compile(_dropout_mlp(), out=build_dir, dtype="float64", order=1, warm_cache=False)
    _, grads = mod.lr_grad(params, samples=4, sigma=1e-2, seed=5, **inputs)
    est, _ = interpret_lr(graph, params, inputs, 4, 1e-2, 5)
    np.testing.assert_allclose(np.concatenate([grads[p].ravel() for p in mod.TRAINABLE]), est, rtol=1e-9, atol=1e-12)


def test_dropout_on_a_sequence_is_drawn_once():
    """gc.dropout of a scan's sequence (T, B, D): the mask has its rows on axis 1."""
    m = gc.Model("lr_dropout_seq")
    x, y, seed = m.input("x", ("T", "B", 2)), m.input("y", ("B",), dtype="int64"), m.input("seed", (), dtype="int64")
    W, U, V = m.param("W", (3, 3)), m.param("U", (2, 3)), m.param("V", (3, 4))
    hT, _ = gc.scan(lambda h, xt: (gc.tanh(h @ W + xt @ U), None), m.input("h0", ("B", 3)), gc.dropout(x, 0.2, seed))
    m.minimize(gc.softmax_cross_entropy(gc.dropout(hT, 0.3, seed) @ V, y))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(14)
    params = {k: rng.normal(size=graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(4, 6, 2)), "y": rng.integers(0, 4, 6), "seed": np.array(3),
              "h0": rng.normal(size=(6, 3))}
    assert_mean_converges(graph, params, inputs, seeds=8)


def test_compiled_lr_grad_and_trainer(build_dir):
    m = mlp()
    mod = gc.compile(m, out=build_dir, dtype="float64", order=1, warm_cache=False)
    rng = np.random.default_rng(4)
    params = mod.init_params(0)
    inputs = {"x": rng.normal(size=(8, 5)), "y": rng.integers(0, 3, 8)}
    graph = build_training_graph(m, "float64", order=1)
    for mode in (dict(), dict(antithetic=False, layerwise=True)):
        loss, grads = mod.lr_grad(params, samples=6, sigma=1e-2, seed=7, **inputs, **mode)
        est, _ = interpret_lr(graph, params, inputs, 6, 1e-2, 7, **mode)
        np.testing.assert_allclose(np.concatenate([grads[p].ravel() for p in mod.TRAINABLE]), est, rtol=1e-9,
                                   atol=1e-9)
        assert loss == mod.loss_and_grad(params, **inputs)[0]   # the unperturbed objective
    # a sweep over batch sizes: the host module keeps the leaves of the last few, and a size seen again
    # (made anew) gives the same estimate
    first = mod.lr_grad(params, samples=4, seed=3, **inputs)[1]
    for rows in range(1, 13):
        mod.lr_grad(params, samples=4, seed=3, x=rng.normal(size=(rows, 5)), y=rng.integers(0, 3, rows))
    assert len(mod._LR._kept) == KEPT_HOST_SETS
    again = mod.lr_grad(params, samples=4, seed=3, **inputs)[1]
    assert all(np.array_equal(first[k], again[k]) for k in first)
    with pytest.raises(ValueError, match="odd"):
        mod.lr_grad(params, samples=3, **inputs)
    with pytest.raises(ValueError, match="sigma"):
        mod.lr_grad(params, sigma=0, **inputs)
    with pytest.raises(ValueError, match=r"unknown input 'sample' \(inputs are 'x', 'y'; lr_grad's options are "
                                         r"samples, sigma, .*\): did you mean 'samples'\?"):
        mod.lr_grad(params, sample=8, **inputs)
    # its plan is forward memory only: every step is a forward node, nothing of a backward
    plan = json.load(open(os.path.join(build_dir, "lrmlp.memplan.json")))["entries"]["lr_grad"]
    phases = {n["phase"] for n in json.load(open(os.path.join(build_dir, "lrmlp.graph.json")))["nodes"]
              if n["id"] in set(plan["schedule"])}
    assert phases == {"forward"}
    # Trainer(gradient="lr"): the same optimizer, driven by the estimate, learns a separable problem
    X = rng.normal(size=(64, 5))
    Y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0)
    tr = mod.Trainer(params, optimizer="adam", lr=0.05, gradient="lr", samples=16, sigma=1e-2)
    first = tr.step(x=X, y=Y)
    for _ in range(80):
        last = tr.step(x=X, y=Y)
    assert last < 0.6 * first
    with pytest.raises(ValueError, match="gradient must be"):
        mod.Trainer(params, gradient="evolution")
    with pytest.raises(AttributeError):   # a backprop trainer turned "lr" had no options to step with
        mod.Trainer(params).gradient = "lr"
    assert tr.gradient == "lr"
    # (at their defaults too: a trial's Trainer(..., samples=64) forgot gradient="lr" and got backprop)
    for option in (dict(samples=8), dict(sigma=0.5), dict(layerwise=True), dict(antithetic=False), dict(seed=3),
                   dict(samples=64), dict(seed=0), dict(antithetic=True)):
        with pytest.raises(ValueError, match=r"option\(s\) of gradient='lr'"):   # backprop would ignore it
            mod.Trainer(params, **option)
    with pytest.raises(ValueError, match="odd"):
        mod.Trainer(params, gradient="lr", samples=7)
    # step t draws from seed + t, wrapping around in int64 (a trial's run failed on its third step)
    sgd = dict(optimizer="sgd", lr=0.1, gradient="lr", samples=4)
    late = mod.Trainer(params, seed=2**63 - 1, **sgd)
    late.step(x=X, y=Y)
    late.step(x=X, y=Y)
    _, g = mod.lr_grad(params, samples=4, seed=2**63 - 1, x=X, y=Y)
    after_one = {k: params[k] - 0.1 * g[k] for k in params}
    _, g2 = mod.lr_grad(after_one, samples=4, seed=-2**63, x=X, y=Y)
    for k in params:
        np.testing.assert_allclose(late.params[k], after_one[k] - 0.1 * g2[k], rtol=1e-12, atol=1e-14, err_msg=k)
    _check_lr_checkpoints(mod, tr, X, Y, build_dir)


def staged_mlp():
    """The MLP with its last layer pinned to stage 1: each of two stages owns params."""
    m = gc.Model("lrstaged")
    x = m.input("x", ("B", 5))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (5, 7)) + m.param("b0", (7,), init="normal"))
    with m.stage(1):
        h = h @ m.param("W1", (7, 3)) + m.param("b1", (3,), init="normal")
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=1e-2)
    return m


def test_lr_grad_runs_whole_in_pipeline_builds(tmp_path):
    """A --microbatches or --devices build splits loss_and_grad into stages; lr_grad runs whole and
    gives the one-device build's estimate, alone, in a Trainer and in a data-parallel Trainer (which
    once ran backprop here). The cut's plan neither costs nor lists the estimate's nodes."""
    m = staged_mlp()
    rng = np.random.default_rng(2)
    inputs = {"x": rng.normal(size=(12, 5)), "y": rng.integers(0, 3, 12)}
    options = dict(dtype="float64", order=1, warm_cache=False)
    whole = gc.compile(m, out=str(tmp_path / "whole"), **options)
    params = whole.init_params(0)
    ref_loss, ref = whole.lr_grad(params, samples=8, sigma=1e-2, seed=3, **inputs)
    trainer = dict(optimizer="adam", lr=0.05, gradient="lr", samples=4)
    expected = whole.Trainer(params, **trainer)
    for _ in range(2):
        expected.step(**inputs)
    builds = {"microbatches": dict(microbatches=3),
              "devices": dict(devices=2, bind={"B": 12}),
              "devices and microbatches": dict(devices=2, microbatches=2, schedule="1f1b", bind={"B": 12})}
    for label, build in builds.items():
        mod = gc.compile(m, out=str(tmp_path / label.replace(" ", "_")), **options, **build)
        loss, grads = mod.lr_grad(params, samples=8, sigma=1e-2, seed=3, **inputs)
        assert loss == pytest.approx(ref_loss, rel=1e-12), label
        for p in whole.TRAINABLE:
            np.testing.assert_allclose(grads[p], ref[p], rtol=1e-10, atol=1e-12, err_msg=f"{label}: {p}")
        for parallel in (None, "data"):
            tr = mod.Trainer(params, **trainer, parallel=parallel)
            for _ in range(2):
                tr.step(**inputs)
            for p in whole.TRAINABLE:
                np.testing.assert_allclose(tr.params[p], expected.params[p], rtol=1e-10, atol=1e-12,
                                           err_msg=f"{label}, parallel={parallel}: {p}")
        if "devices" in label:
            assert all(s["params"] for s in mod.PARTITION["stage"])   # each stage owns params
            with open(tmp_path / label.replace(" ", "_") / "lrstaged.graph.json") as f:
                dump = json.load(f)
            readers = {}
            for link in dump["links"]:
                readers.setdefault(link["source"], []).append(link["target"])
            # the estimate's nodes: what its own leaves (noise masks, tiled inputs, ...) reach
            estimate = [n["id"] for n in dump["nodes"] if n["op"] == "input" and n["name"] not in mod.INPUTS]
            seen = set()
            while estimate:
                n = estimate.pop()
                if n not in seen:
                    seen.add(n)
                    estimate += readers.get(n, [])
            ops = {n["id"]: n["op"] for n in dump["nodes"]}
            grown = True
            while grown:   # and what only the estimate reads (the transfers made for it)
                fed = {n for n, rs in readers.items() if n not in seen and ops[n] not in ("input", "param")
                       and set(rs) <= seen}
                seen |= fed
                grown = bool(fed)
            staged = {n for s in mod.PARTITION["stage"] for n in s["nodes"]}
            moved = {t["value"] for t in mod.PARTITION["transfers"]} | {t["node"] for t in mod.PARTITION["transfers"]}
            assert len(seen) > 20 and staged and not (staged | moved) & seen


def _check_lr_checkpoints(mod, tr, X, Y, build_dir):
    """The gradient mode is training state: a checkpoint restores gradient="lr", its options and its
    seed, so the resumed run takes the very steps the first one would have."""
    path = os.path.join(build_dir, "lr.npz")
    tr.save(path)
    back = mod.Trainer.load(path)
    assert back.gradient == "lr" and back.lr_options == tr.lr_options and back.lr_seed == tr.lr_seed
    assert back.steps == tr.steps
    # the options are chosen when the trainer is made: set later, they were ignored without a word
    with pytest.raises(AttributeError, match=r"Trainer has no setting 'sigma': adam sets lr, betas, eps or clip_norm"):
        back.sigma = 1.0
    with pytest.raises(TypeError):
        back.lr_options["samples"] = 3
    with pytest.raises(AttributeError):
        back.lr_options = {"samples": 3}
    for _ in range(2):
        assert back.step(x=X, y=Y) == tr.step(x=X, y=Y)
    for p in mod.TRAINABLE:
        np.testing.assert_array_equal(back.params[p], tr.params[p])
    bp = mod.Trainer(mod.init_params(0), optimizer="adam")
    bp.save(path)
    assert mod.Trainer.load(path).gradient == "backprop"
    arrays = dict(np.load(path))
    meta = json.loads(str(arrays["meta"]))
    for bad in ({"gradient": "lr"}, {"gradient": "evolution"}, {"gradient": "lr", "lr_options": {"samples": 4}}):
        arrays["meta"] = np.array(json.dumps(meta | bad))
        np.savez(path, **arrays)
        with pytest.raises(ValueError, match=r"lr.npz: meta 'gradient'") as e:
            mod.Trainer.load(path)
        assert str(e.value).count("lr.npz") == 1
    del meta["gradient"]   # written before gradient modes were recorded: backprop
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    assert mod.Trainer.load(path).gradient == "backprop"
