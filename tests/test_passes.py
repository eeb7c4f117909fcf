"""The IR and the graph passes: structure, dumps, CSE/DCE/folding, fusion, compile-time cost."""
import json
import time

import networkx as nx
import numpy as np

import gradc as gc
from gradc.ir import Graph
from gradc.passes.likelihood_ratio import estimate_nodes
from gradc.passes.pipeline import build_training_graph


def mlp(layers=2, width=8, name="p_mlp"):
    m = gc.Model(name)
    x = m.input("x", ("B", width))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(layers):
        h = gc.tanh(h @ m.param(f"W{i}", (width, width)) + m.param(f"b{i}", (width,)))
    m.output("h", h)
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=1e-4)
    return m


def test_graph_is_a_valid_multidigraph_with_operand_indices():
    m = gc.Model("p_sq")
    x = m.input("x", (3,))
    m.minimize((x * x).sum())
    g = m.graph
    assert isinstance(g.nx, nx.MultiDiGraph)
    (sq,) = [n for n in g.nx.nodes if g.op(n) == "mul"]
    assert sorted(k for _, _, k in g.nx.in_edges(sq, keys=True)) == [0, 1]    # x * x: two edges
    g.validate()
    assert all(g.node(n)["src"].startswith("tests/test_passes.py:") or "test_passes.py:" in g.node(n)["src"]
               for n in g.nx.nodes)


def test_backward_lives_in_the_same_graph_and_dumps():
    g = build_training_graph(mlp(), "float32")
    phases = {g.node(n)["phase"] for n in g.nx.nodes}
    assert phases == {"forward", "backward"}
    data = json.loads(g.to_json())
    rebuilt = nx.node_link_graph(data, edges="links")
    assert rebuilt.number_of_nodes() == len(g) and rebuilt.number_of_edges() == g.nx.number_of_edges()
    assert all(n["dtype"] in ("float32", "int64") for n in data["nodes"])
    dot = g.to_dot()
    assert dot.startswith('digraph "p_mlp"') and "#ffd8b0" in dot      # backward nodes coloured


def test_fusion_makes_one_loop_forward_and_backward():
    g = build_training_graph(mlp(layers=1), "float32")
    fused = {str(g.attrs(n)["expr"]) for n in g.nx.nodes if g.op(n) == "fused"}
    assert "tanh(x0 + x1)" in fused                       # bias add + activation
    assert any("1 - x1**2" in e or "1 - x0**2" in e for e in fused)   # g * (1 - y^2) reads the saved output
    estimate = estimate_nodes(g)   # lr_grad's own (its first layer's bias add, on B rows, feeds a broadcast)
    assert not any(g.op(n) in ("add", "tanh") for n in g.nx.nodes if g.node(n)["phase"] == "forward"
                   and g.shape(n) == ("B", 8) and n not in estimate)


def test_cse_dce_and_folding():
    m = gc.Model("p_simplify")
    x = m.input("x", (4,))
    a = gc.exp(x) * 2.0
    b = gc.exp(x) * 2.0                                   # same as a
    gc.sin(x)                                             # dead
    c = (np.ones(4) * 3.0 + 1.0)                          # a numpy constant
    m.minimize((a + b + x * c * 1.0 + 0.0).sum())
    g = build_training_graph(m, "float64")
    ops = [g.op(n) for n in g.nx.nodes]
    assert "sin" not in ops
    assert sum(1 for n in g.nx.nodes if g.op(n) == "fused" and "exp" in str(g.attrs(n)["expr"])
               and g.node(n)["phase"] == "forward") <= 1


def test_merge_records_never_loop():
    """`h * 1 * 0.5` at order 2 (a new user's `h * (i + 1) * 0.01` at i = 0): fusion recorded a producer it
    copied into a user as merged into it while it stayed for others, CSE then merged that user into it,
    and once both were gone `survivor` (the dumps' `of`) followed 51 -> 52 -> 51 forever: the compile hung."""
    m = gc.Model("p_merge_loop")
    x = m.input("x", ("B", 4))
    h = x * m.param("W", (4,))
    m.minimize((gc.tanh(h * 1 * 0.5) * h).sum())
    g = build_training_graph(m, "float64", order=2)
    for n in g.merged:
        seen = set()
        while n not in g.nx and n in g.merged:
            assert n not in seen, f"merge records loop through {n}"
            seen.add(n)
            n = g.merged[n]
    assert json.loads(g.to_json())["graph"]["loss"] is not None


def test_topological_order_is_iterative_on_a_long_chain():
    g = Graph("chain")
    n = g.apply("input", attrs={"shape": (2,), "dtype": "float"}, name="x")
    for _ in range(20000):
        n = g.apply("neg", [n])
    order = g.topo_order()
    assert len(order) == 20001 and order[0] == 0 and order[-1] == n
    assert len(g.ancestors([n])) == 20001


def test_passes_for_a_100_layer_mlp_take_under_2_seconds():
    model = mlp(layers=100, width=64, name="p_deep")
    timings = {}
    t = time.perf_counter()
    g = build_training_graph(model, "float32", timings=timings)
    elapsed = time.perf_counter() - t
    assert len(g.grads) == 200 and all(v is not None for v in g.grads.values())
    assert elapsed < 2.0, timings


def test_identities_on_the_op_records_remove_what_they_say_and_keep_the_values(rng):
    """Op.simplify (gradc/ops): x + 0, 0 + x, x - 0, x * 1, 1 * x, x / 1, --x, reshape(reshape(x)) to
    x's shape, transpose(transpose(x)) back to x, a reduction over no axes; values stay the same."""
    from gradc.interpret import evaluate
    from gradc.passes.simplify import simplify
    m = gc.Model("p_identities")
    x = m.input("x", (3, 4))
    v = m.input("v", (4,))
    a = ((x + 0.0) * 1.0 - 0.0) / 1.0
    b = 1.0 * (0.0 + (-(-a)))
    c = b.reshape(4, 3).reshape(3, 4)
    d = gc.transpose(gc.transpose(c, (1, 0)), (1, 0))
    e = gc.sum(d, axis=())
    kept = v + 0.0 * x.sum()        # not an identity: stays
    m.output("e", e)
    m.output("kept", kept)
    m.minimize((e * e).sum() + kept.sum())
    g = m.graph
    inputs = {"x": rng.normal(size=(3, 4)), "v": rng.normal(size=4)}
    before = evaluate(g, {}, inputs, list(g.outputs.values()))
    want = {o: before[n] for o, n in g.outputs.items()}
    simplify(g)
    ops = [g.op(n) for n in g.nx.nodes]
    assert not {"neg", "div", "reshape", "transpose"} & set(ops), ops
    assert g.outputs["e"] == g.inputs["x"]       # the whole chain is x
    after = evaluate(g, {}, inputs, list(g.outputs.values()))
    for o, n in g.outputs.items():
        np.testing.assert_array_equal(after[n], want[o])
