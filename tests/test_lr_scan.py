"""lr_grad through gc.scan (passes/lr_scan.py, DESIGN.md §1.9): noise on the pre-activation at every
step. Statistics through the numpy interpreter in float64 (the mean over seeds converges to
loss_and_grad's gradient like 1/sqrt(K)); one compiled module against the interpreter; refusals."""
import numpy as np
import pytest

import gradc as gc
from gradc.passes.pipeline import build_training_graph

from fuzz_lr import assert_unbiased
from test_lr_grad import assert_mean_converges, interpret_lr
from test_scan import _rnn, _seq_loss


def _gru(H=3, D=2):
    """A GRU-style cell: two carries (h and a running mean), gates, the candidate's row operand h * z."""
    m = gc.Model("lrgru")
    x = m.input("x", ("T", "B", D))
    h0 = m.input("h0", ("B", H))
    y = m.input("y", ("B",), dtype="int64")
    Wz, Uz, Wh, Uh = (m.param(n, s) for n, s in (("Wz", (H, H)), ("Uz", (D, H)), ("Wh", (H, H)), ("Uh", (D, H))))
    bz = m.param("bz", (H,), init="zeros")

    def step(carry, xt):
        h, acc = carry
        z = gc.sigmoid(h @ Wz + xt @ Uz + bz)
        h = (1 - z) * h + z * gc.tanh((h * z) @ Wh + xt @ Uh)
        return (h, 0.5 * acc + 0.5 * h), None

    (hT, acc), _ = gc.scan(step, (h0, h0 * 0.5), x)
    m.minimize(gc.softmax_cross_entropy(hT + acc, y))
    return m


def _stacked_reverse(H=3, D=2):
    """A reverse scan over the ys of another scan (rows on axis 1 of the sequence), each closing over its
    own weights, the first step's pre-activation a sum of two products and a bias."""
    m = gc.Model("lrstacked")
    x = m.input("x", ("T", "B", D))
    h0 = m.input("h0", ("B", H))
    y = m.input("y", ("B",), dtype="int64")
    W1, U1, b1, W2 = m.param("W1", (H, H)), m.param("U1", (D, H)), m.param("b1", (H,)), m.param("W2", (H, H))
    _, hs = gc.scan(lambda h, xt: (gc.tanh(xt @ U1 + h @ W1 + b1),) * 2, h0, x)
    h2, _ = gc.scan(lambda h, ht: (gc.tanh(h @ W2 + ht), None), h0, hs, reverse=True)
    m.minimize(gc.softmax_cross_entropy(h2, y))
    return m


def _conv_rnn(name="lrconvrnn"):
    """A convolutional RNN: an image carry (B, 2, 5, 5), h' = tanh(conv(x_t, Wx) + conv(h, Wh) + b) with
    "same" 3x3 convs, and a 1x1 conv of each step's h' returned as a y whose mean over the steps is read
    too. Convs in a step are sites (one per step, the sum's noise on it); each site's part is its conv's
    VJP over the stacked steps, a scan of its own (lr_scan.conv_over_steps)."""
    m = gc.Model(name)
    x, h0, y = m.input("x", ("T", "B", 1, 5, 5)), m.input("h0", ("B", 2, 5, 5)), m.input("y", ("B",), dtype="int64")
    Wx, Wh, b = m.param("Wx", (2, 1, 3, 3)), m.param("Wh", (2, 2, 3, 3)), m.param("b", (1, 2, 1, 1))
    Wy, V = m.param("Wy", (1, 2, 1, 1)), m.param("V", (75, 3))

    def step(h, xt):
        h = gc.tanh(gc.conv2d(xt, Wx, padding=1) + gc.conv2d(h, Wh, padding=1) + b)
        return h, gc.conv2d(h, Wy)
    hT, ys = gc.scan(step, h0, x)
    features = gc.concat([hT, gc.tanh(ys.mean(axis=0))], axis=1).reshape(("B", -1))
    m.minimize(gc.softmax_cross_entropy(features @ V, y))
    return m


def _conv_rnn_problem(rng, T=3, B=4):
    graph = build_training_graph(_conv_rnn(), "float64", order=1)
    params = {p: 0.5 * rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(T, B, 1, 5, 5)), "h0": rng.normal(size=(B, 2, 5, 5)), "y": rng.integers(0, 3, B)}
    return graph, params, inputs


def test_convs_in_a_step_are_estimated_without_bias():
    graph, params, inputs = _conv_rnn_problem(np.random.default_rng(0))
    assert graph.lr["why"] is None, graph.lr["why"]
    assert [s["op"] for s in graph.lr["sites"]].count("conv2d") == 2   # the step's sum, the y's conv
    assert_unbiased(graph, params, inputs, "conv rnn", "")


@pytest.mark.slow   # (about 50 s: Numba compiles the conv kernels of two step bodies and their VJPs)
def test_compiled_lr_grad_of_convs_in_a_step_matches_the_interpreter(build_dir):
    graph, params, inputs = _conv_rnn_problem(np.random.default_rng(1))
    mod = gc.compile(_conv_rnn("lrconvrnn_c"), out=build_dir, dtype="float64", order=1, warm_cache=False)
    _assert_compiled_is_interpreted(mod, graph, params, inputs)


def _nested_problem(rng, T=3, B=4):
    """test_scan's nested scan: each outer step runs an inner scan over the whole sequence from the outer
    carry, the inner step closing over a param and a product of the outer step's slice."""
    from test_scan import _nested
    graph = build_training_graph(_nested("lrnested"), "float64", order=1)
    params = {p: 0.6 * rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    return graph, params, {"x": rng.normal(size=(T, B, 2)), "h0": rng.normal(size=(B, 3))}


def test_a_scan_nested_in_a_step_is_estimated_without_bias():
    """The inner step's site gets noise (T_outer, T_inner, KB_lr, H), drawn outside both loops, and its part
    sums over every step of both."""
    graph, params, inputs = _nested_problem(np.random.default_rng(0))
    assert graph.lr["why"] is None, graph.lr["why"]
    noise = [graph.shape(n) for n in graph.nx.nodes if graph.op(n) == "random"]
    assert ("KB_lr", "T", "T", 3) in noise, noise   # drawn rows first: the inner site's, one per (outer, inner) step
    assert_unbiased(graph, params, inputs, "nested scan", "")


@pytest.mark.slow   # (about 30 s: Numba compiles both steps and their copies)
def test_compiled_lr_grad_of_a_nested_scan_matches_the_interpreter(build_dir):
    from test_scan import _nested
    graph, params, inputs = _nested_problem(np.random.default_rng(1))
    mod = gc.compile(_nested("lrnested_c"), out=build_dir, dtype="float64", order=1, warm_cache=False)
    _assert_compiled_is_interpreted(mod, graph, params, inputs)


def _problem(name, rng, T=5, B=6):
    model = {"rnn": _rnn, "gru": _gru, "stacked": _stacked_reverse}[name]()
    graph = build_training_graph(model, "float64", order=1)
    params = {p: 0.6 * rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    D = graph.shape(graph.inputs["x"])[2]
    H = graph.shape(graph.inputs["h0"])[1]
    inputs = {"x": rng.normal(size=(T, B, D)), "h0": rng.normal(size=(B, H))}
    classes = graph.shape(graph.params["V"])[1] if "V" in params else H
    inputs["y"] = rng.integers(0, classes, B)
    return graph, params, inputs


@pytest.mark.parametrize("name", ["rnn", "gru", "stacked"])
def test_mean_over_seeds_converges_to_the_gradient_through_scans(name):
    graph, params, inputs = _problem(name, np.random.default_rng(0))
    assert graph.lr["why"] is None, graph.lr["why"]
    assert graph.lr["tiled"]["x"] == (None, 1)   # the sequence has its rows on axis 1 (stacked in the graph)
    assert_mean_converges(graph, params, inputs, seeds=12)


def test_layerwise_and_plain_noise_through_a_scan_are_unbiased():
    graph, params, inputs = _problem("rnn", np.random.default_rng(1))
    for mode in (dict(antithetic=False), dict(layerwise=True)):
        runs = [interpret_lr(graph, params, inputs, 128, 0.05 if mode.get("antithetic") is False else 1e-3, seed,
                             **mode) for seed in range(24)]
        true = runs[0][1]
        mean = np.mean([e for e, _ in runs], axis=0)
        assert np.linalg.norm(mean - true) / np.linalg.norm(true) < 0.15, mode


def test_every_step_has_its_own_noise():
    """Sites in a step draw a sequence of noise, one slice per step: with the noise of one step only the
    estimate is far from the gradient, so the test above would catch a step reusing another's noise."""
    graph, _, _ = _problem("gru", np.random.default_rng(2))
    sites = graph.lr["sites"]
    assert len(sites) == 2 and all(s["shape"][0] == "KB_lr" for s in sites)   # the gate and the candidate
    noise = [n for n in graph.nx.nodes if graph.op(n) == "random"]
    assert sorted(graph.shape(n)[:2] for n in noise) == [("KB_lr", "T")] * 2   # drawn rows first, all T steps


def _assert_compiled_is_interpreted(mod, graph, params, inputs):
    """The compiled lr_grad is the interpreter's estimate (pairs; plain and layer-wise), its loss loss_and_grad's."""
    for mode in (dict(), dict(antithetic=False, layerwise=True)):
        loss, grads = mod.lr_grad(params, samples=6, sigma=1e-2, seed=5, **inputs, **mode)
        est, _ = interpret_lr(graph, params, inputs, 6, 1e-2, 5, **mode)
        np.testing.assert_allclose(np.concatenate([grads[p].ravel() for p in mod.TRAINABLE]), est, rtol=1e-9,
                                   atol=1e-12)
        assert loss == mod.loss_and_grad(params, **inputs)[0]


@pytest.mark.slow
def test_compiled_lr_grad_through_a_scan_matches_the_interpreter(build_dir):
    model = _rnn("lrscan")
    mod = gc.compile(model, out=build_dir, dtype="float64", order=1, warm_cache=False)
    graph, params, inputs = _problem("rnn", np.random.default_rng(3), T=7, B=4)
    _assert_compiled_is_interpreted(mod, graph, params, inputs)


@pytest.mark.slow
def test_trainer_with_lr_gradients_trains_a_recurrence(build_dir):
    mod = gc.compile(_rnn("lrscan_train"), out=build_dir, dtype="float64", order=1, warm_cache=False)
    rng = np.random.default_rng(4)
    X = rng.normal(size=(6, 32, 3))
    Y = (X.sum(axis=(0, 2)) > 0).astype(np.int64)
    tr = mod.Trainer(mod.init_params(0), optimizer="adam", lr=0.03, gradient="lr", samples=32, sigma=1e-2)
    first = tr.step(x=X, y=Y, h0=np.zeros((32, 4)))
    for _ in range(60):
        last = tr.step(x=X, y=Y, h0=np.zeros((32, 4)))
    assert last < 0.8 * first


def test_a_learned_initial_state_is_named():
    m = gc.Model("learned_h0")
    x = m.input("x", ("T", 8, 3))
    W, h0 = m.param("W", (3, 6)), m.param("h0", (8, 6))
    hT, _ = gc.scan(lambda h, xt: (gc.tanh(xt @ W + h), None), h0, x)
    m.minimize((hT * hT).mean())
    why = build_training_graph(m, "float64", order=1).lr["why"]
    assert "'h0'" in why and "scan" in why
    assert why.count("reach(es) the loss") == 1, why   # another batch candidate's same reason is not repeated


def _language_model(per_row):
    """A step that makes its loss: a batch mean (softmax_cross_entropy), or per-row cross-entropies from a
    numpy one-hot table, reduced outside the scan."""
    m = gc.Model("lm_rows" if per_row else "lm_mean")
    tok, tgt = m.input("tok", ("T", "B"), dtype="int64"), m.input("tgt", ("T", "B"), dtype="int64")
    E = m.param("E", (5, 4), init="normal", trainable=False)
    W, O = m.param("W", (4, 4)), m.param("O", (4, 5))

    def step(h, xs):
        h = gc.tanh(h @ W + gc.take(E, xs[0]))
        logits = h @ O
        if per_row:
            return h, -(gc.log_softmax(logits, axis=-1) * gc.take(np.eye(5), xs[1])).sum(axis=1)
        return h, gc.softmax_cross_entropy(logits, xs[1])

    _, losses = gc.scan(step, m.input("h0", ("B", 4)), (tok, tgt))
    m.minimize(losses.mean())
    return m


def _lm_problem(rng, T=3, B=4):
    graphs = [build_training_graph(_language_model(per_row), "float64", order=1) for per_row in (False, True)]
    params = {k: rng.standard_normal(graphs[0].shape(n)) for k, n in graphs[0].params.items()}
    inputs = {"tok": rng.integers(0, 5, (T, B)), "tgt": rng.integers(0, 5, (T, B)), "h0": rng.standard_normal((B, 4))}
    return graphs, params, inputs


def test_a_loss_made_in_a_step_is_estimated_per_row():
    """softmax_cross_entropy in the step (a batch mean) is kept per row in the perturbed copy: the estimate
    is the one of per-row losses reduced outside the scan (the same noise, so the same numbers), and it
    converges to the gradient like 1/sqrt(K). Found by a new-user trial: it was refused."""
    (graph, per_row), params, inputs = _lm_problem(np.random.default_rng(5))
    assert graph.lr["why"] is None and per_row.lr["why"] is None
    for seed in range(3):
        np.testing.assert_allclose(interpret_lr(graph, params, inputs, 8, 1e-2, seed)[0],
                                   interpret_lr(per_row, params, inputs, 8, 1e-2, seed)[0], rtol=1e-10, atol=1e-12)
    assert_mean_converges(graph, params, inputs, seeds=12)


@pytest.mark.slow
def test_compiled_lr_grad_of_a_loss_made_in_a_step_matches_the_interpreter(build_dir):
    """(The default run compiles a loss made in steps in the test after this one's.)"""
    (graph, _), params, inputs = _lm_problem(np.random.default_rng(5))
    mod = gc.compile(_language_model(False), out=build_dir, dtype="float64", order=1, warm_cache=False)
    _assert_compiled_is_interpreted(mod, graph, params, inputs)


def _two_step_losses(T):
    """Two losses per step, both batch means (one over rows and features), weighted, sliced, joined and
    added to a mean over the steps outside the scan."""
    m = gc.Model("lm_two")
    tok, tgt = m.input("tok", (T, "B"), dtype="int64"), m.input("tgt", (T, "B"), dtype="int64")
    E = m.param("E", (5, 4), init="normal", trainable=False)
    W, O = m.param("W", (4, 4)), m.param("O", (4, 5))

    def step(h, xs):
        h = gc.tanh(h @ W + gc.take(E, xs[0]))
        return h, (gc.softmax_cross_entropy(h @ O, xs[1]), 0.5 * (h * h).mean())

    _, (xent, energy) = gc.scan(step, m.input("h0", ("B", 4)), (tok, tgt))
    weights = np.linspace(0.5, 1.5, T)
    m.minimize((xent * weights).sum() + gc.concat([energy[1:], xent[:1]]).mean() + (energy + xent.mean()).sum())
    return m


def test_a_loss_made_in_steps_is_followed_through_scales_slices_and_joins(build_dir):
    T, B = 4, 3
    graph = build_training_graph(_two_step_losses(T), "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(8)
    params = {k: 0.7 * rng.standard_normal(graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"tok": rng.integers(0, 5, (T, B)), "tgt": rng.integers(0, 5, (T, B)), "h0": rng.standard_normal((B, 4))}
    assert_mean_converges(graph, params, inputs, seeds=12)
    mod = gc.compile(_two_step_losses(T), out=build_dir, dtype="float64", order=1, warm_cache=False)
    _, grads = mod.lr_grad(params, samples=4, sigma=1e-2, seed=3, **inputs)
    est, _ = interpret_lr(graph, params, inputs, 4, 1e-2, 3)
    np.testing.assert_allclose(np.concatenate([grads[p].ravel() for p in mod.TRAINABLE]), est, rtol=1e-9, atol=1e-12)


def test_a_sequence_loss_made_outside_the_scan_is_estimated():
    """Labels (T, B) read only outside the scan lead with the sequences' time, not the batch: lr_grad took T
    for the batch dim and refused ("scans along the batch dim"). Rows on axis 1, tiled there."""
    graph = build_training_graph(_seq_loss(), "float64", {}, order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    assert graph.lr["tiled"]["y"] == ("tile:y", 1) and graph.lr["batch"] == "B"
    rng = np.random.default_rng(4)
    params = {p: 0.7 * rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(5, 4, 2)), "h0": rng.normal(size=(4, 3)), "y": rng.integers(0, 3, size=(5, 4))}
    assert_mean_converges(graph, params, inputs, seeds=12)


def test_antithetic_pairs_subtract_the_loss_of_noise_free_copies():
    """Found by a new-user trial: in a scan (or any second layer) a pair's + and - copies read different
    noised values, so the pair's difference leaves the loss times their difference in the estimate; pairs
    had 10x the error of plain draws on this model. With the baseline, two noise-free copies' loss is
    subtracted: pairs give half as many independent directions, so about sqrt(2) x plain's error."""
    (graph, _), params, inputs = _lm_problem(np.random.default_rng(5), T=7)
    params = {k: 0.5 * v for k, v in params.items()}

    def error(**mode):
        runs = [interpret_lr(graph, params, inputs, 64, 1e-3, seed, **mode) for seed in range(12)]
        return np.mean([np.linalg.norm(est - true) / np.linalg.norm(true) for est, true in runs])

    pairs, plain, bare = error(), error(antithetic=False), error(baseline=False)
    assert pairs < 2 * plain, (pairs, plain)
    assert bare > 3 * pairs, (bare, pairs)   # the pairs alone: what the default was


def test_an_input_read_as_a_sequence_through_a_reshape_keeps_its_rows_first():
    """x (B, 6) seen as 3 steps of 2 pixels, (3, B, 2): its axis 0 is the batch, not a sequence's time (the
    first version of the rule above took the batch dim for time and refused this model)."""
    m = gc.Model("lrpixels")
    x, y = m.input("x", ("B", 6)), m.input("y", ("B",), dtype="int64")
    W, U, V = m.param("W", (3, 3)), m.param("U", (2, 3)), m.param("V", (3, 4))
    rows = gc.transpose(x.reshape(("B", 3, 2)), (1, 0, 2))
    h, _ = gc.scan(lambda h, xt: (gc.tanh(xt @ U + h @ W), None), x[:, :3] * 0.0, rows)
    m.minimize(gc.softmax_cross_entropy(h @ V, y))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None and graph.lr["batch"] == "B" and graph.lr["tiled"]["x"] == (None, 0)
    rng = np.random.default_rng(6)
    params = {p: rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(5, 6)), "y": rng.integers(0, 4, 5)}
    runs = [interpret_lr(graph, params, inputs, 256, 1e-3, seed) for seed in range(12)]
    mean, true = np.mean([est for est, _ in runs], axis=0), runs[0][1]
    assert np.linalg.norm(mean - true) / np.linalg.norm(true) < 0.4


def test_refusals_name_the_reason_and_what_to_do():
    """From a new-user trial: refusals of a loss that mixes rows said what was wrong but not what to do."""
    m = gc.Model("lrcarry")
    x, y = m.input("x", ("T", "B", 2)), m.input("y", ("T", "B"), dtype="int64")
    W, V = m.param("W", (2, 3)), m.param("V", (3, 4))

    def step(total, xs):
        return total + gc.softmax_cross_entropy(gc.tanh(xs[0] @ W) @ V, xs[1]), None

    total, _ = gc.scan(step, m.input("zero", ()), (x, y))
    m.minimize(total)
    why = build_training_graph(m, "float64", order=1).lr["why"]
    assert "return it as the step's y" in why and "train this model with loss_and_grad" in why, why

    # batch norm in a step; a penalty added to a step's loss in the step: each names what to do instead
    for kind in ("norm", "penalty"):
        m = gc.Model(f"lrstep{kind}")
        x, y, h0 = m.input("x", ("T", "B", 3)), m.input("y", ("T", "B"), dtype="int64"), m.input("h0", ("B", 3))
        W = m.param("W", (3, 3))

        def step(h, xs):
            z = xs[0] @ W + h
            h = gc.tanh(z - z.mean(axis=0) if kind == "norm" else z)
            return h, gc.softmax_cross_entropy(h, xs[1]) + (0.1 * gc.square(W).sum() if kind == "penalty" else 0.0)
        _, losses = gc.scan(step, h0, (x, y))
        m.minimize(losses.mean())
        why = build_training_graph(m, "float64", order=1).lr["why"]
        assert "test_lr_scan.py" in why, why
        assert ("as batch norm in a step" in why and "normalise before or after the scan" in why if kind == "norm"
                else "add it to the loss after the scan" in why), why


def _closing_over_a_mean(of):
    """A scan whose step reads a mean over the batch rows: of an input (the same in every perturbed copy),
    or of a product the noise reaches (a batch statistic)."""
    m = gc.Model(f"lr_scan_mean_{of}")
    x, x0, y = m.input("x", ("T", "B", 4)), m.input("x0", ("B", 4)), m.input("y", ("B",), dtype="int64")
    W, U, V = m.param("W", (4, 5)), m.param("U", (5, 5)), m.param("V", (5, 3))
    mu = {"input": x0.mean(axis=0), "input_max": x0.max(axis=0), "product": (x0 @ W).mean(axis=0)}[of]
    centred = (lambda xt: xt @ W - mu) if of == "product" else (lambda xt: (xt - mu) @ W)
    h, _ = gc.scan(lambda h, xt: (gc.tanh(centred(xt) + h @ U), None), x0 @ W, x)
    m.minimize(gc.softmax_cross_entropy(h @ V, y))
    return m


def test_a_scan_closing_over_a_mean_over_rows():
    """Review M: a step reading an input's batch mean was refused as if it read the loss. That mean (or max)
    is the same in every perturbed copy: the step reads it as a value without rows, and the estimate is
    unbiased. A mean the noise reaches (a batch statistic) is refused as one."""
    rng = np.random.default_rng(4)
    params = {"W": rng.normal(size=(4, 5)), "U": 0.5 * rng.normal(size=(5, 5)), "V": rng.normal(size=(5, 3))}
    inputs = {"x": rng.normal(size=(3, 6, 4)), "x0": rng.normal(size=(6, 4)) + 1.0, "y": rng.integers(0, 3, 6)}
    for of in ("input", "input_max"):
        graph = build_training_graph(_closing_over_a_mean(of), "float64", order=1)
        assert graph.lr["why"] is None, graph.lr["why"]
        for mode in (None, dict(antithetic=False, layerwise=True)):
            assert_unbiased(graph, params, inputs, f"scan over an input's {of} {mode}", "", mode=mode)
    why = build_training_graph(_closing_over_a_mean("product"), "float64", order=1).lr["why"]
    assert "a batch statistic" in why and "test_lr_scan.py" in why and "outside a scan" in why, why
    assert "per-row terms" not in why, why   # (not the loss's rule)


def _embedded(where, named=True):
    """A language model with a trained embedding table E: looked up in the step, before the scan on
    tokens (T, B) (or both, with a second table), or on tokens (B, T) moved to (T, B, D) (every input then
    reaches the scan as a sequence: the batch is no input's axis 0 after the moves); the logits a product of the stacked
    results outside the scan, (T, B, H) @ V + c, rows on axis 1, where tokens are (T, B)."""
    m = gc.Model(f"lremb_{where}")
    B, T = ("B", "T") if named else (4, 3)
    tok = m.input("tok", (B, T) if where == "bt" else (T, B), dtype="int64")
    tgt = m.input("tgt", (B, T) if where == "bt" else (T, B), dtype="int64")
    E, W, V, c = m.param("E", (5, 4), init="normal"), m.param("W", (4, 4)), m.param("V", (4, 5)), m.param("c", (5,))
    if where == "step":
        _, hs = gc.scan(lambda h, t: (gc.tanh(h @ W + gc.take(E, t)),) * 2, m.input("h0", (B, 4)), tok)
        m.minimize(gc.softmax_cross_entropy(hs @ V + c, tgt))
    elif where == "before":
        _, hs = gc.scan(lambda h, e: (gc.tanh(h @ W + e),) * 2, m.input("h0", (B, 4)), gc.take(E, tok))
        m.minimize(gc.softmax_cross_entropy(hs @ V + c, tgt))
    elif where == "both":   # a second table F looked up in the step, its rows added to the sum h @ W + e_t
        F = m.param("F", (5, 4), init="normal")
        step = lambda h, xs: (gc.tanh(h @ W + xs[0] + gc.take(F, xs[1])),) * 2
        _, hs = gc.scan(step, m.input("h0", (B, 4)), (gc.take(E, tok), tok))
        m.minimize(gc.softmax_cross_entropy(hs @ V + c, tgt))
    else:
        e = gc.take(E, tok)
        step = lambda h, xs: (lambda h: (h, gc.softmax_cross_entropy(h @ V + c, xs[1])))(gc.tanh(h @ W + xs[0]))
        _, losses = gc.scan(step, gc.tanh(e.mean(axis=1)), (gc.transpose(e, (1, 0, 2)), gc.transpose(tgt, (1, 0))))
        m.minimize(losses.mean())
    return m


def _embedded_problem(where, rng, named=True, T=3, B=4):
    graph = build_training_graph(_embedded(where, named), "float64", order=1)
    params = {k: 0.7 * rng.standard_normal(graph.shape(n)) for k, n in graph.params.items()}
    shape = (B, T) if where == "bt" else (T, B)
    inputs = {"tok": rng.integers(0, 5, shape), "tgt": rng.integers(0, 5, shape)}
    if where != "bt":
        inputs["h0"] = rng.standard_normal((B, 4))
    return graph, params, inputs


@pytest.mark.parametrize("where,named", [("step", True), ("before", True), ("bt", True), ("bt", False)])
def test_a_trained_embedding_is_estimated_wherever_it_is_read(where, named):
    """An embedding's rows (take) get noise like a product's output: the table's part is take's VJP (a
    scatter-add of c * eps / sigma into the rows read). Before, lr_grad refused a trained table. With rows
    on axis 1 (the lookup of tokens (T, B), the logits (T, B, C) of the stacked results) the noise is drawn
    rows first; tokens (B, T) were taken as a batch of T and refused."""
    graph, params, inputs = _embedded_problem(where, np.random.default_rng(9), named)
    assert graph.lr["why"] is None, graph.lr["why"]
    assert all(graph.lr_grads.get(p) is not None for p in params)   # E's part too (the test below sums all)
    ops = [s["op"] for s in graph.lr["sites"]]   # a site is named after its first product (x @ W + take(E, t))
    assert ("take" in ops) == (where != "step") and ("batch_matmul" in ops) == (where != "bt"), ops
    assert graph.lr["tiled"]["tok"] == ("tile:tok", 0 if where == "bt" else 1)
    assert_mean_converges(graph, params, inputs, seeds=12)


def test_compiled_lr_grad_of_embeddings_matches_the_interpreter(build_dir):
    """The noise drawn rows first and moved to axis 1, the lookup's scatter-add, the step's indices
    returned as a y (ints) and looked up over every step at once, in generated code."""
    graph, params, inputs = _embedded_problem("both", np.random.default_rng(10))
    assert graph.lr["why"] is None, graph.lr["why"]
    mod = gc.compile(_embedded("both"), out=build_dir, dtype="float64", order=1, warm_cache=False)
    _assert_compiled_is_interpreted(mod, graph, params, inputs)


def _masked_or_mixed(kind):
    """From a new-user trial: a padded sequence's loss, the masked sum over positions divided by the
    mask's count (an input: a constant of the estimate), and a step's loss adding a batch mean to a batch
    sum. Both were refused (the second "mixes a value reduced over rows with other batch values"; the
    first named the reason of the wrong candidate batch dim, T)."""
    m = gc.Model(f"lr_{kind}")
    tok, y = m.input("tok", ("T", "B"), dtype="int64"), m.input("y", ("T", "B"), dtype="int64")
    E, W, V = m.param("E", (5, 4), init="normal"), m.param("W", (4, 4)), m.param("V", (4, 5))
    if kind == "masked":
        mask = m.input("mask", ("T", "B"))
        _, logits = gc.scan(lambda h, e: (lambda h: (h, h @ V))(gc.tanh(e + h @ W)), m.input("h0", ("B", 4)),
                            gc.take(E, tok))
        nll = -(gc.log_softmax(logits, axis=-1) * gc.take(np.eye(5), y)).sum(axis=-1)
        m.minimize((nll * mask).sum() / mask.sum())
    else:
        z, R = m.input("z", ("T", "B", 2)), m.param("R", (4, 2))

        def step(h, xs):
            h = gc.tanh(xs[0] + h @ W)
            return h, gc.softmax_cross_entropy(h @ V, xs[1]) + 0.1 * gc.square(h @ R - xs[2]).sum()

        _, losses = gc.scan(step, m.input("h0", ("B", 4)), (gc.take(E, tok), y, z))
        m.minimize(losses.mean())
    return m


@pytest.mark.parametrize("kind", ["masked", "mixed"])
def test_a_masked_loss_and_a_step_loss_of_mixed_kinds_are_estimated(kind):
    graph = build_training_graph(_masked_or_mixed(kind), "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    rng = np.random.default_rng(15)
    T, B = 4, 5
    params = {k: 0.7 * rng.standard_normal(graph.shape(n)) for k, n in graph.params.items()}
    inputs = {"tok": rng.integers(0, 5, (T, B)), "y": rng.integers(0, 5, (T, B)), "h0": rng.standard_normal((B, 4))}
    inputs |= {"mask": (rng.uniform(size=(T, B)) < 0.7).astype(float)} if kind == "masked" else \
        {"z": rng.standard_normal((T, B, 2))}
    assert_mean_converges(graph, params, inputs, seeds=12)
