"""passes/gemm_fusion.py: matmuls absorb their elementwise neighbours (CUDA target), same values."""
import numpy as np
import pytest

import gradc as gc
from gradc.interpret import evaluate
from gradc.passes.gemm_fusion import fuse_gemms
from gradc.passes.pipeline import build_training_graph

import test_codegen as zoo


def _roots(graph):
    return [graph.objective] + [n for n in graph.grads.values() if n is not None] + \
        [n for n in graph.input_grads.values() if n is not None] + list(graph.outputs.values()) + \
        [n for n in graph.hvps.values() if n is not None]


@pytest.mark.parametrize("make", [zoo.mlp_weight_decay, zoo.shared_weights, zoo.residual, zoo.deep_chain,
                                  zoo.reductions_and_attention, zoo.frozen_and_unused],
                         ids=lambda f: f.__name__)
def test_fused_graph_computes_the_same_values(make, rng):
    model = make()
    graph = build_training_graph(model, "float64", order=2)
    fused = build_training_graph(model, "float64", order=2)
    count = fuse_gemms(fused)
    assert count > 0
    fused.validate()
    assert sum(fused.op(n) == "gemm" for n in fused.nx.nodes) == count
    assert sum(fused.op(n) in ("gemm", "matmul") for n in fused.nx.nodes) <= \
        sum(graph.op(n) == "matmul" for n in graph.nx.nodes)
    params = {k: rng.standard_normal(graph.shape(n)) for k, n in graph.params.items()}
    inputs = {}
    for k, n in graph.inputs.items():
        shape = tuple(5 if isinstance(d, str) else d for d in graph.shape(n))
        inputs[k] = rng.integers(0, 3, shape) if graph.dtype(n).startswith("int") else rng.standard_normal(shape)
    tangents = {k: rng.standard_normal(graph.shape(n)) for k, n in graph.params.items()}
    want, got = (evaluate(g, params, inputs, _roots(g), tangents=tangents) for g in (graph, fused))
    for a, b in zip(_roots(graph), _roots(fused)):
        np.testing.assert_allclose(got[b], want[a], rtol=1e-12, atol=1e-12)


def test_forward_layer_and_weight_decay_fuse_into_the_gemm():
    graph = build_training_graph(zoo.mlp_weight_decay(), "float64")
    fuse_gemms(graph)
    epilogues = [str(graph.attrs(n)["epilogue"]) for n in graph.nx.nodes if graph.op(n) == "gemm"]
    assert "tanh(x0 + x1)" in epilogues           # tanh(x @ W0 + b0): bias and activation in the store
    assert any("x0 +" in e and "*" in e for e in epilogues)   # dW + 2 * decay * W


def test_returned_values_are_never_absorbed():
    m = gc.Model("gf_out")
    x = m.input("x", ("B", 3))
    z = x @ m.param("W", (3, 4))
    m.output("z", z)                  # the product itself is returned: it must exist
    m.minimize(gc.mean(gc.tanh(z)))
    graph = build_training_graph(m, "float64")
    z_node = graph.outputs["z"]
    fuse_gemms(graph)
    assert z_node in graph and graph.outputs["z"] == z_node
    assert graph.op(z_node) in ("matmul", "gemm")
    if graph.op(z_node) == "gemm":
        assert str(graph.attrs(z_node)["epilogue"]) == "x0"


def test_a_prologue_that_simplified_to_a_constant_is_interpreted():
    """Review: random program 295's hvp graph has a GEMM whose prologue is the constant 0 (a second
    derivative that vanished); the interpreter's matmul got a number for that operand and raised."""
    from fuzz_graphs import random_case
    case = random_case(295)
    values = []
    for target in ("cpu", "cuda"):
        g = build_training_graph(case.model, "float64", order=2, target=target)
        roots = [g.objective] + [n for n in g.hvps.values() if n is not None]
        out = evaluate(g, case.params, case.inputs, roots, tangents=case.tangents)
        values.append([out[n] for n in roots])
    assert any(np.abs(v).max() > 0 for v in values[0][1:])
    for a, b in zip(*values):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15)
