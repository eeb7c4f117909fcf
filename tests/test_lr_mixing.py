"""lr_grad on models whose ops mix the batch's rows (passes/lr_statistics.py's `lift`, the records' `batched`
rules, DESIGN.md §1.9): contrastive losses over the batch (CLIP's za @ zb.T, pairwise distances), attention
across the batch, a cross-correlation of two views (Barlow Twins), a softmax over the batch axis, a conv of
the batch's mean image. Each copy is a batch of its own, so such an op runs once per perturbed copy, and a
site whose noise reaches it pairs with its copy's whole loss. Each estimate is checked for bias per param
through the interpreter (fuzz_lr.assert_unbiased); compiled modules against the interpreter; what is refused."""
from types import SimpleNamespace

import numpy as np
import pytest

import gradc as gc
from gradc.inspect_build import report
from gradc.passes.pipeline import build_training_graph

from fuzz_lr import assert_unbiased, check_lr_compiled


def _towers(m):
    """Two inputs (B, 5) and (B, 4), each through a layer of its own to (B, 6)."""
    xa, xb = m.input("xa", ("B", 5)), m.input("xb", ("B", 4))
    return gc.tanh(xa @ m.param("Wa", (5, 6))), gc.tanh(xb @ m.param("Wb", (4, 6)))


def _clip():
    """CLIP's symmetric contrastive loss with a learned temperature: row i of za @ zb.T matches column i."""
    m = gc.Model("lrclip")
    za, zb = _towers(m)
    y = m.input("y", ("B",), dtype="int64")
    logits = za @ zb.T * gc.exp(m.param("t", (), init="zeros"))
    m.minimize(0.5 * (gc.softmax_cross_entropy(logits, y) + gc.softmax_cross_entropy(logits.T, y)))
    return m


def _pairwise_distances():
    """Each row's squared distances to every row of the other view, (B, B, 6) summed: a softmax over them."""
    m = gc.Model("lrpairwise")
    za, zb = _towers(m)
    y = m.input("y", ("B",), dtype="int64")
    d = gc.square(za.reshape(("B", 1, 6)) - zb.reshape((1, "B", 6))).sum(axis=2)
    m.minimize(gc.softmax_cross_entropy(-d, y))
    return m


def _batch_attention():
    """Each row attends to every row of its batch (a set transformer's self-attention over the batch),
    then a classifier: the classifier's noise reaches its own row's loss only."""
    m = gc.Model("lrbatchattention")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    q, k, v = (x @ m.param(f"W{c}", (5, 4)) for c in "qkv")
    a = gc.softmax(q @ k.T * 0.5, axis=1)
    m.minimize(gc.softmax_cross_entropy(gc.tanh(a @ v + x @ m.param("Ws", (5, 4))) @ m.param("Wo", (4, 3)), y))
    return m


def _barlow_twins():
    """Two views through one encoder, standardised over the batch, their cross-correlation (6, 6) over the
    batch pushed to the identity: a loss of the whole batch, one per copy."""
    m = gc.Model("lrbarlow")
    xa, xb = m.input("xa", ("B", 5)), m.input("xb", ("B", 5))
    W, V = m.param("W", (5, 6)), m.param("V", (6, 6))
    za, zb = (gc.tanh(x @ W) @ V for x in (xa, xb))
    za, zb = ((z - z.mean(axis=0)) / gc.sqrt(gc.square(z - z.mean(axis=0)).mean(axis=0) + 1e-5) for z in (za, zb))
    c = za.T @ zb * (1.0 / 7)
    eye = np.eye(6)
    m.minimize((gc.square(c - eye) * (eye + 0.05 * (1 - eye))).sum())
    return m


def _softmax_over_the_batch():
    m = gc.Model("lrbatchsoftmax")
    x, t = m.input("x", ("B", 5)), m.input("t", ("B", 3))
    h = gc.softmax(x @ m.param("W0", (5, 6)), axis=0)
    m.minimize(gc.mse(h @ m.param("W1", (6, 3)), t))
    return m


def _mean_image_conv():
    """A prototype: the batch's mean feature map after a conv, convolved again and compared with each row's."""
    m = gc.Model("lrmeanimage")
    x = m.input("x", ("B", 1, 6, 6))
    h = gc.relu(gc.conv2d(x, m.param("K0", (2, 1, 3, 3))))
    proto = gc.conv2d(h.mean(axis=0, keepdims=True), m.param("K1", (2, 2, 1, 1)))
    m.minimize(gc.square(h - proto).mean())
    return m


_SHIFTED = gc.elementwise("lr_shifted_by", lambda a, b, g: a * g - b)


def _site_on_a_mixing_op():
    """A param read by the op that mixes the rows (a user op of (B, 1, 6), (1, B, 6) and a gain): its
    noise goes on that op's copy, rows again, so the site's VJP goes back through the view to the copies."""
    m = gc.Model("lrmixingsite")
    za, zb = _towers(m)
    y = m.input("y", ("B",), dtype="int64")
    d = gc.square(_SHIFTED(za.reshape(("B", 1, 6)), zb.reshape((1, "B", 6)), m.param("g", (6,), init="ones")))
    m.minimize(gc.softmax_cross_entropy(-d.sum(axis=2), y))
    return m


def _learned_mixing_of_seven_rows():
    """A learned (B, B) mixing of a batch of 7 rows, A @ (X @ W) with A a param: a product per copy whose
    own factor is trained (the trial's model gave an internal reshape error)."""
    m = gc.Model("lrlearnedmix")
    x, y = m.input("x", (7, 5)), m.input("y", (7,), dtype="int64")
    m.minimize(gc.softmax_cross_entropy(m.param("A", (7, 7)) @ gc.tanh(x @ m.param("W", (5, 3))), y))
    return m


def _softmax_over_the_batch_then_a_scan():
    """A scan's initial carry normalised over the batch: rows again after the softmax (a statistic, which a
    scan cannot read, when the batch was told by its size only and bound)."""
    m = gc.Model("lrbatchsoftmaxscan")
    x, xs, y = m.input("x", ("B", 5)), m.input("xs", (3, "B", 4)), m.input("y", ("B",), dtype="int64")
    W, U = m.param("W", (4, 4)), m.param("U", (4, 4))
    h0 = gc.softmax(x @ m.param("W0", (5, 4)), axis=0)
    hT, _ = gc.scan(lambda h, x_t: (gc.tanh(h @ W + x_t @ U), None), h0, xs)
    m.minimize(gc.softmax_cross_entropy(hT, y))
    return m


def _pooled_by_a_param():
    """P (3, 6) pools the 6 rows of an input (made once: no noise reaches x) and of a hidden layer: P @ x is a
    site without rows, noised per copy (review: its part was left out, a biased P)."""
    m = gc.Model("lrpooled")
    x, t = m.input("x", (6, 5)), m.input("t", (6, 3))
    P, V = m.param("P", (3, 6)), m.param("V", (5, 5))
    h = gc.tanh(x @ V)
    m.minimize(gc.mse(h @ (P @ x).T + h @ gc.tanh(P @ h).T, t))
    return m


MODELS = {"clip": _clip, "pairwise_distances": _pairwise_distances, "batch_attention": _batch_attention,
          "barlow_twins": _barlow_twins, "softmax_over_the_batch": _softmax_over_the_batch,
          "mean_image_conv": _mean_image_conv, "site_on_a_mixing_op": _site_on_a_mixing_op,
          "learned_mixing_of_seven_rows": _learned_mixing_of_seven_rows, "pooled_by_a_param": _pooled_by_a_param,
          "softmax_over_the_batch_then_a_scan": _softmax_over_the_batch_then_a_scan}


def _problem(name, rng, B=7, bind=False):
    if name == "pooled_by_a_param":
        B = 6
    graph = build_training_graph(MODELS[name](), "float64", order=1, dims={"B": B} if bind else None)
    params = {p: 0.7 * rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    draws = {"xa": (B, 5), "xb": (B, 5 if name == "barlow_twins" else 4), "x": (B, 5), "t": (B, 3), "xs": (3, B, 4)}
    if name == "mean_image_conv":
        draws["x"] = (B, 1, 6, 6)
    inputs = {k: rng.normal(size=s) for k, s in draws.items() if k in graph.inputs}
    if "y" in graph.inputs:
        inputs["y"] = rng.permutation(B) % (4 if name.endswith("scan") else 3) \
            if name in ("batch_attention", "learned_mixing_of_seven_rows", "softmax_over_the_batch_then_a_scan") \
            else rng.permutation(B)
    return graph, params, inputs


@pytest.mark.parametrize("name", list(MODELS))
def test_ops_that_mix_the_batchs_rows_are_estimated_without_bias(name):
    graph, params, inputs = _problem(name, np.random.default_rng(1))
    assert graph.lr["why"] is None, graph.lr["why"]
    assert_unbiased(graph, params, inputs, name, "")


@pytest.mark.parametrize("name, B", [("barlow_twins", 6), ("mean_image_conv", 4), ("clip", 6),
                                     ("softmax_over_the_batch_then_a_scan", 4)])
def test_a_batch_bound_to_another_dims_size_is_estimated_as_when_symbolic(name, B):
    """With B bound to 6, Barlow Twins' (6, 6) cross-correlation was taken for rows (by its size) and refused;
    with B bound to 4, the prototype's 4x4 map was. The batch's axes are told by the shapes as declared."""
    graph, params, inputs = _problem(name, np.random.default_rng(3), B=B, bind=True)
    assert graph.lr["why"] is None, graph.lr["why"]
    assert_unbiased(graph, params, inputs, f"{name} B={B}", "")


def test_noise_before_the_mixing_pairs_with_the_copys_loss_and_after_it_with_its_row():
    """Attention across the batch: q, k and v's noise reaches every row of its copy ("sample"); the skip's
    and the classifier's reach their own row ("row": the skip joins the attention after its mixing)."""
    graph, _, _ = _problem("batch_attention", np.random.default_rng(1))
    assert [s["pairs"] for s in graph.lr["sites"]] == ["sample", "sample", "sample", "row", "row"], graph.lr["sites"]
    assert not graph.lr["per_row"]


@pytest.mark.parametrize("name", ["clip"] + [pytest.param(name, marks=pytest.mark.slow)
                                              for name in ("barlow_twins", "mean_image_conv")])
def test_the_compiled_estimate_is_the_interpreters(name, tmp_path):
    _, params, inputs = _problem(name, np.random.default_rng(2))
    model = MODELS[name]()
    check_lr_compiled(SimpleNamespace(model=model, params=params, inputs=inputs, seeds=name,
                                      text=lambda: name), str(tmp_path))
    summary = report(str(tmp_path / model.name))   # gradc inspect lists the sites and their pairing
    assert "lr_grad: " in summary and "pairs with: sample" in summary, summary


def test_the_bias_check_finds_mixed_rows_paired_per_row(monkeypatch):
    """The check can fail: with every site paired with its own row's loss (the coupling through za @ zb.T
    left out), CLIP's estimate is biased."""
    from gradc.passes import likelihood_ratio
    graph, params, inputs = _problem("clip", np.random.default_rng(0))
    monkeypatch.setattr(likelihood_ratio._Builder, "pairing", lambda self, site: "row")
    graph = build_training_graph(_clip(), "float64", order=1)
    with pytest.raises(AssertionError, match="mean squared z-score"):
        assert_unbiased(graph, params, inputs, "clip paired per row", "")


def test_an_op_that_mixes_rows_and_cannot_run_per_copy_is_refused_by_name(tmp_path):
    """A scan along the batch dim (each row's carry the previous row's) has no per-copy form here."""
    m = gc.Model("lrscanbatch")
    x, t = m.input("x", ("B", 3)), m.input("t", ("B", 2))
    W = m.param("W", (3, 2))
    def step(h, x_t):
        h = gc.tanh(h + (x_t.reshape((1, 3)) @ W).reshape((2,)))
        return h, h
    _, hs = gc.scan(step, m.input("h0", (2,)), x)
    m.minimize(gc.mse(hs, t))
    why = build_training_graph(m, "float64", order=1).lr["why"]
    assert why is not None and "scans along the batch dim" in why and "test_lr_mixing.py" in why, why
    gc.compile(m, out=str(tmp_path), warm=False)   # gradc inspect says so before any call (trial I)
    assert "lr_grad: refuses this model: " in report(str(tmp_path / "lrscanbatch"))


def test_rows_mixed_before_any_noise_are_mixed_once_for_every_copy():
    """A similarity of the inputs (a graph built from features, softmax(x @ x.T)) is the same in every copy:
    made once on B rows, not K times; the estimate through it is unbiased."""
    m = gc.Model("lrsimilarity")
    x, y = m.input("x", ("B", 5)), m.input("y", ("B",), dtype="int64")
    a = gc.softmax(x @ x.T, axis=1)
    m.minimize(gc.softmax_cross_entropy(a @ gc.tanh(x @ m.param("W0", (5, 6))) @ m.param("W1", (6, 3)), y))
    graph = build_training_graph(m, "float64", order=1)
    assert graph.lr["why"] is None, graph.lr["why"]
    estimate = graph.ancestors(graph.lr_grads.values()) - graph.ancestors([graph.loss] + list(graph.grads.values()))
    softmaxes = [n for n in estimate if graph.op(n) == "softmax"]
    assert softmaxes and all("K_lr" not in graph.shape(n) and "KB_lr" not in graph.shape(n) for n in softmaxes)
    rng = np.random.default_rng(4)
    params = {p: 0.7 * rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    assert_unbiased(graph, params, {"x": rng.normal(size=(7, 5)), "y": rng.integers(0, 3, 7)}, "similarity", "")
