"""lr_grad on graph convolutions (passes/likelihood_ratio.py `pairing`): a row's noise pairs with the
losses of the rows it can reach. Behind one row-mixing product A @ H those are the rows i with
A[i, j] != 0; after the last one, the row itself; otherwise the whole sample. Each choice is checked
for bias per param (fuzz_lr.assert_unbiased), and the neighbourhood's error against the sample's.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import gradc as gc
from gradc.passes import likelihood_ratio
from gradc.passes.pipeline import build_training_graph

from fuzz_lr import assert_unbiased, check_lr_compiled
from test_lr_grad import interpret_lr

N = 12


def sparse_adjacency(rng, degree=2):
    """A ring with `degree` random chords per node, self-loops, rows normalised: sparse, not symmetric
    after normalising."""
    A = np.eye(N) + np.roll(np.eye(N), 1, axis=1) + np.roll(np.eye(N), -1, axis=1)
    for i in range(N):
        A[i, rng.choice(N, degree, replace=False)] = 1.0
    return A / A.sum(axis=1, keepdims=True)


def gcn(kind, A):
    """Two layers (A X W0, then A H W1), three, or two with a residual path around the second A."""
    m = gc.Model(f"lrgcn_{kind}")
    x, y = m.input("x", (N, 4)), m.input("y", (N,), dtype="int64")
    adjacency = m.input("A", (N, N)) if kind == "input" else A
    W0, W1 = m.param("W0", (4, 5)), m.param("W1", (5, 3))
    h = gc.tanh(adjacency @ x @ W0 + m.param("b0", (5,), init="normal"))
    if kind == "three":
        h = gc.tanh(adjacency @ h @ m.param("W2", (5, 5)))
    out = adjacency @ h @ W1
    if kind == "residual":
        out = out + h @ m.param("R", (5, 3))
    m.minimize(gc.softmax_cross_entropy(out, y), weight_decay=1e-2)
    return m


PAIRS = {"two": ["neighbours", "row"], "input": ["neighbours", "row"], "three": ["sample", "neighbours", "row"],
         "residual": ["sample", "row"]}   # (A h W1 + h R: one site, where the products meet)


def _problem(kind, seed=0):
    rng = np.random.default_rng(seed)
    A = sparse_adjacency(rng)
    graph = build_training_graph(gcn(kind, A), "float64", order=1)
    params = {p: rng.normal(size=graph.shape(n)) for p, n in graph.params.items()}
    inputs = {"x": rng.normal(size=(N, 4)), "y": rng.integers(0, 3, N)} | ({"A": A} if kind == "input" else {})
    return graph, params, inputs


@pytest.mark.parametrize("kind", list(PAIRS))
def test_each_site_pairs_with_the_rows_its_noise_reaches_without_bias(kind):
    graph, params, inputs = _problem(kind)
    assert graph.lr["why"] is None, graph.lr["why"]
    assert [s["pairs"] for s in graph.lr["sites"]] == PAIRS[kind], graph.lr["sites"]
    assert_unbiased(graph, params, inputs, kind, "")


def test_pairing_by_neighbourhood_has_less_error_than_by_sample(monkeypatch):
    """The first layer's noise reaches 3 to 5 of the 12 rows' losses: pairing it with those alone (and the
    last layer's with its own row) gives a smaller error of one estimate than pairing every row with the
    sample's whole loss, as before."""
    def error(graph, params, inputs):
        runs = [interpret_lr(graph, params, inputs, 32, 1e-3, seed) for seed in range(24)]
        return np.mean([np.linalg.norm(est - true) / np.linalg.norm(true) for est, true in runs])

    graph, params, inputs = _problem("two")
    neighbours = error(graph, params, inputs)
    monkeypatch.setattr(likelihood_ratio._Builder, "pairing", lambda self, site: "sample")
    graph, params, inputs = _problem("two")
    assert [s["pairs"] for s in graph.lr["sites"]] == ["sample", "sample"]
    sample = error(graph, params, inputs)
    assert neighbours < 0.7 * sample, (neighbours, sample)


@pytest.mark.parametrize("kind", ["two", "input"])
def test_the_compiled_estimate_is_the_interpreters(kind, tmp_path):
    graph, params, inputs = _problem(kind)
    model = gcn(kind, sparse_adjacency(np.random.default_rng(0)))
    check_lr_compiled(SimpleNamespace(model=model, params=params, inputs=inputs, seeds=kind, text=lambda: kind),
                      str(tmp_path))
