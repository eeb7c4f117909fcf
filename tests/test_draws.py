"""Where random draws are computed: on CUDA, normal draws in the kernels that read them (passes/fusion.py);
on the CPU, a plain entry's draws over parts of them on the cores (gradc/runtime/conv_cores.py).

A CUDA build's graph is checked through the numpy interpreter against the CPU build's (where each
draw is a `random` node of its own): the same values, so the generated kernels have the same thing to
compute; tests/test_cuda_kernels.py and tests/test_cuda_target.py run those kernels under the
simulator (slow tier). The CPU's parts are checked against the reference draws.
"""
import copy
import re

import numpy as np
import pytest

import gradc as gc
from gradc.interpret import evaluate
from gradc.ops.elementwise import FLAT, SIZE, evaluate_expression, expr_of
from gradc.ops.random import NormalDraw, draw, stream_key
from gradc.passes.fusion import fuse_elementwise
from gradc.passes.pipeline import build_training_graph
from gradc.passes.simplify import eliminate_dead
from conftest import split_every_conv
from test_lr_grad import interpret_lr, problem


def _draws(graph):
    """The nodes whose expression computes a draw, and the random nodes left."""
    drawn = [n for n in graph.nx.nodes if graph.op(n) in ("fused", "gemm")
             and (graph.attrs(n).get("expr") if graph.op(n) == "fused" else graph.attrs(n)["epilogue"]).has(FLAT)]
    return drawn, [n for n in graph.nx.nodes if graph.op(n) == "random"]


@pytest.mark.parametrize("name", ["mlp", "conv", "gcn"])
def test_lr_noise_is_drawn_in_its_readers_and_the_estimate_is_the_same(name):
    m, params, inputs = problem(name, np.random.default_rng(0))
    cpu = build_training_graph(m, "float64", order=1)
    cuda = build_training_graph(m, "float64", order=1, target="cuda")
    drawn, left = _draws(cuda)
    sites = len(cpu.lr["sites"])
    assert not left and len(_draws(cpu)[1]) == sites
    # each site's noise: in its perturbed copy and in its cotangent, never stored on its own
    assert len(drawn) >= 2 * sites
    assert not [n for n in drawn if cuda.op(n) == "fused" and expr_of(cuda, n).func == NormalDraw]
    for mode in (dict(), dict(antithetic=False, layerwise=True), dict(antithetic=False, baseline=False)):
        e1, t1 = interpret_lr(cpu, params, inputs, 4, 1e-2, 3, **mode)
        e2, t2 = interpret_lr(cuda, params, inputs, 4, 1e-2, 3, **mode)
        assert np.linalg.norm(e1) > 0.1
        np.testing.assert_allclose(e2, e1, rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(t2, t1)


def _noisy_model():
    """A model's own noise: on a param (H,) that rows read broadcast, and on a batch of products."""
    m = gc.Model("noisy")
    x = m.input("x", ("B", 6))
    seed = m.input("seed", (), dtype="int64")
    W, v = m.param("W", (6, 6)), m.param("v", (6,))
    h = gc.tanh(x * gc.gaussian_noise(v, 0.5, seed))   # (B, 6) reads a (6,) draw: its element i1, not i0 * 6 + i1
    h = gc.gaussian_noise(h @ W, 0.3, seed)
    m.minimize(gc.square(h).mean())
    return m


def test_a_draw_read_broadcast_keeps_its_own_kernel_and_the_values_stay():
    cpu = build_training_graph(_noisy_model(), "float64", order=1)
    cuda = build_training_graph(_noisy_model(), "float64", order=1, target="cuda")
    drawn, left = _draws(cuda)
    assert not left
    # the (6,) draw plus 0.5 times it is computed once, in a node of its shape: no (B, 6) reader recomputes it
    assert [cuda.shape(n) for n in drawn if cuda.shape(n) == (6,)] == [(6,)]
    rng = np.random.default_rng(1)
    params = {"W": rng.normal(size=(6, 6)), "v": rng.normal(size=6)}
    inputs = {"x": rng.normal(size=(5, 6)), "seed": np.array(11)}

    def values(g):
        nodes = [g.objective] + [g.grads[p] for p in params]
        out = evaluate(g, params, inputs, nodes)
        return [out[n] for n in nodes]
    for a, b in zip(values(cpu), values(cuda)):
        np.testing.assert_allclose(b, a, rtol=1e-12)


def test_a_draw_goes_only_into_readers_of_its_shape():
    """A (6,) draw read once, broadcast over (B, 6): its element in the reader is i1, not the reader's own
    flat index, so it stays a kernel of its shape; one read in its own shape is computed in the reader."""
    m = gc.Model("broadcast_draw")
    x, v = m.input("x", (5, 6)), m.input("v", (6,))
    seed = m.input("seed", (), dtype="int64")
    m.output("broadcast", x * gc.gaussian_noise(v, 0.5, seed))
    m.output("same_shape", gc.tanh(gc.gaussian_noise(x, 0.5, seed)))
    graph = copy.deepcopy(m.graph)
    fuse_elementwise(graph, draws=True)
    eliminate_dead(graph)   # (the producers inlined)
    kept = {graph.shape(n) for n in _draws(graph)[0]}
    assert kept == {(6,), (5, 6)} and len(_draws(graph)[0]) == 2 and not _draws(graph)[1]
    rng = np.random.default_rng(2)
    inputs = {"x": rng.normal(size=(5, 6)), "v": rng.normal(size=6), "seed": np.array(7)}
    outs = list(m.graph.outputs.values())
    want = evaluate(m.graph, {}, inputs, outs)
    got = evaluate(graph, {}, inputs, list(graph.outputs.values()))
    for a, b in zip(outs, graph.outputs.values()):
        np.testing.assert_array_equal(got[b], want[a])


@pytest.mark.parametrize("half", [0, 1])
def test_normal_draw_by_numpy_is_the_random_nodes_values(half):
    """NormalDraw's numpy values (the interpreter's) are `draw`'s, the reference the kernels reproduce, also
    for an odd count, whose second half (one longer) repeats the first's draws from its start."""
    shape, stream, seed = (7, 9), 5, -3
    got = evaluate_expression(NormalDraw(seed, half, stream_key(stream), FLAT, SIZE), [], shape)
    np.testing.assert_array_equal(got, draw("normal", 0.0, seed, stream, shape, half))
    assert abs(got.mean()) < 0.5 and 0.5 < got.std() < 1.5
    if half:
        np.testing.assert_array_equal(got.ravel()[31:62], got.ravel()[:31])


def test_a_plain_entry_draws_over_parts(monkeypatch, build_dir):
    """The generated module: forward (a plain entry) calls draws_on_cores for its dropout and noise; the
    values are the interpreter's. (The kernel's ranges and the parts: tests/test_indexing.py.)"""
    ran, _ = split_every_conv(monkeypatch)
    m = gc.Model("cpu_draws")
    x, seed = m.input("x", ("B", 5)), m.input("seed", (), dtype="int64")
    W = m.param("W", (5, 5))
    h = gc.dropout(gc.tanh(gc.gaussian_noise(x, 0.5, seed) @ W), 0.3, seed)
    m.output("h", h)
    m.minimize(gc.square(h).mean())
    mod = gc.compile(m, out=build_dir, dtype="float64", order=1, warm=False)
    entry = open(mod.__file__).read().split("\ndef _forward(")[1].split("\ndef ")[0]
    assert len(re.findall(r"draws_on_cores\(k\d+_random_(normal|dropout), .*most=3\)", entry)) == 2, entry
    rng = np.random.default_rng(3)
    params, inputs = {"W": rng.normal(size=(5, 5))}, {"x": rng.normal(size=(7, 5)), "seed": np.array(9)}
    got = mod.forward(params, **inputs)["h"]
    assert ran == [3, 3]
    want = evaluate(m.graph, params, inputs, [m.graph.outputs["h"]])[m.graph.outputs["h"]]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_cuda_module_reads_an_epilogues_scalars_as_one_element_arrays(build_dir):
    """Review: a draw in a GEMM's epilogue reads the seed (and lr_grad's flag and sigma); the epilogue
    kernel that follows a cuBLAS product read those scalars as x[()], which Numba does not type on a
    one-element device array (the simulator's numpy did not mind)."""
    m, _, _ = problem("mlp", np.random.default_rng(0))
    source = open(gc.compile(m, out=build_dir, target="cuda", order=1, warm_cache=False).__file__).read()
    epilogues = re.findall(r"\ndef (g\d+_epilogue)\(", source)
    assert epilogues and "NormalDraw" in source
    assert "[()]" not in source
