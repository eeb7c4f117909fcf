"""Part runs (passes/part_runs.py): a plain CPU entry runs each chain of per-image kernels as one
function over parts of the batch. Which steps form a run and where one ends, the memory plan that
keeps what a run touches apart, and results against torch with every run cut into 3 parts of 7 images."""
import json
import os
import re

import numpy as np
import pytest

import gradc as gc
from gradc.inspect_build import memory_report
from gradc.ops import get_op
from gradc.passes.memory import keeps_the_peak, liveness, plan_memory
from gradc.passes.part_runs import part_runs
from gradc.passes.pipeline import build_training_graph
from gradc.passes.storage import base, buffer_bytes
from gradc.runtime import conv_cores

from conftest import split_every_conv

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _vgg_block(name="runs_vgg"):
    """Two 3x3 convs + relu, max pool, then three more at half the size, global average pool, dense."""
    m = gc.Model(name)
    h = m.input("x", ("B", 3, 16, 16))
    y = m.input("y", ("B",), dtype="int64")
    for i, (c_in, c_out) in enumerate([(3, 8), (8, 8), (8, 16), (16, 16), (16, 16)]):
        h = gc.relu(gc.conv2d(h, m.param(f"w{i}", (c_out, c_in, 3, 3)), m.param(f"b{i}", (c_out,)), padding=1))
        if i == 1:
            h = gc.max_pool2d(h, 2)
    h = gc.avg_pool2d(h, 8).reshape(("B", 16))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("w5", (16, 10)), y))
    return m


def _lenet(name="runs_lenet"):
    m = gc.Model(name)
    x = m.input("x", ("B", 1, 12, 12))
    y = m.input("y", ("B",), dtype="int64")
    w1, b1 = m.param("w1", (4, 1, 3, 3), init="he_normal"), m.param("b1", (4,), init="normal")
    w2, b2 = m.param("w2", (6, 4, 3, 3), init="he_normal"), m.param("b2", (6,), init="normal")
    w3, b3 = m.param("w3", (24, 10)), m.param("b3", (10,))
    h = gc.max_pool2d(gc.relu(gc.conv2d(x, w1, b1, padding=1)), 2)        # (B, 4, 6, 6)
    h = gc.max_pool2d(gc.relu(gc.conv2d(h, w2, b2)), 2)                   # (B, 6, 2, 2)
    m.minimize(gc.softmax_cross_entropy(h.reshape(("B", 24)) @ w3 + b3, y))
    return m


@pytest.fixture
def two_cores(monkeypatch):
    """Plans made here are for a machine with two cores (on one there are no runs), and split chains of
    any work (these small convs at a bound batch of 8 would run whole)."""
    monkeypatch.setattr(conv_cores, "cores", lambda: 2)
    monkeypatch.setattr(conv_cores, "PART_FLOPS", 1)


def test_a_conv_nets_chains_run_in_parts(two_cores):
    """LeNet's training forward (conv, bias + relu, pool, twice) is one run (its values are kept for
    the backward anyway); its conv backward runs in runs too, the weight and bias gradients summed in
    them; the dense layers run outside (BLAS)."""
    graph = build_training_graph(_lenet(), "float32", {}, order=1)
    plan = plan_memory(graph, {}, 1, None)["_loss_and_grad"]
    runs = plan["part_runs"]
    ops = [[graph.op(n) for n in r["nodes"]] for r in runs]
    assert ops[0] == ["conv2d", "fused", "max_pool2d"] * 2
    backward = [op for r in ops[1:] for op in r]
    assert backward.count("conv2d_weight_grad") == 2 and backward.count("conv2d_input_grad") == 1
    assert sorted(graph.op(n) for r in runs for n in r["summed"]) == ["conv2d_weight_grad"] * 2 + ["sum"] * 2
    assert not any("matmul" in r for r in ops)
    # the same steps make the same runs when asked again
    again = part_runs(graph, plan["steps"], {}, keeps_the_peak(graph, plan["steps"], liveness(
        graph, plan["steps"], set(plan["roots"]))[0], {}))
    assert [r["nodes"] for r in again] == [r["nodes"] for r in runs]


def _peak_kept(graph, tensors, first, last, nodes, size_of, live, peak):
    """keeps_the_peak's rule, counted afresh: every value the run's nodes touch held over first..last."""
    extra = np.zeros(last - first + 1, dtype=np.int64)
    for u in {base(graph, v) for n in nodes for v in list(graph.operands(n)) + [n]}:
        for t in tensors:
            if t["node"] == u and t["start"] <= last and t["end"] >= first:
                extra[:max(0, t["start"] - first)] += size_of[u]
                extra[t["end"] + 1 - first:] += size_of[u]
    return (live[first:last + 1] + extra).max() <= peak


def test_the_peak_check_grows_with_its_run_and_skips_models_without_convs(two_cores, monkeypatch):
    """keeps_the_peak's fits counted every value of the run again at each node part_runs added: quadratic in
    a run's length (a new user's model of 1000 params compiled in 42 s). It keeps what the run touched and
    answers as a fresh count does, on LeNet's runs; a model without a conv never asks it."""
    graph = build_training_graph(_lenet(), "float32", {"B": 8}, order=1)
    plan = plan_memory(graph, {"B": 8}, 1, None)["_loss_and_grad"]
    tensors, _ = liveness(graph, plan["steps"], set(plan["roots"]))
    fits = keeps_the_peak(graph, plan["steps"], tensors, {"B": 8})
    size_of = {t["node"]: buffer_bytes(graph, t["node"], {"B": 8}) for t in tensors}
    live = np.zeros(len(plan["steps"]), dtype=np.int64)
    for t in tensors:
        live[t["start"]:t["end"] + 1] += size_of[t["node"]]
    answers = []

    def checked(first, last, nodes):
        answers.append(fits(first, last, nodes))
        assert answers[-1] == _peak_kept(graph, tensors, first, last, nodes, size_of, live, live.max())
        return answers[-1]
    part_runs(graph, plan["steps"], {"B": 8}, checked)
    assert True in answers and False in answers
    dense = build_training_graph(_mlp_for_runs(), "float32", {}, order=1)
    steps = plan_memory(dense, {}, 1, None)["_loss_and_grad"]["steps"]
    assert part_runs(dense, steps, {}, lambda *a: pytest.fail("asked")) == []


def _mlp_for_runs():
    m = gc.Model("runs_dense")
    x, y = m.input("x", ("B", 8)), m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(4):
        h = gc.tanh(h @ m.param(f"W{i}", (8, 8)) + m.param(f"b{i}", (8,)))
    m.minimize(gc.softmax_cross_entropy(h, y))
    return m


@pytest.mark.parametrize("make", [_lenet, _vgg_block])
def test_runs_never_raise_a_plans_peak(make, monkeypatch):
    """Keeping what a run touches live over it would hold a whole chain's values where inference holds
    two layers': a run ends where it would raise the plan's peak, so every entry's peak is the one it
    has without runs (a plan for one core has none)."""
    dims = {"B": 8}
    graph = build_training_graph(make(), "float32", dims, order=1)
    monkeypatch.setattr(conv_cores, "PART_FLOPS", 1)   # (these small convs would run whole at a bound batch of 8)
    monkeypatch.setattr(conv_cores, "cores", lambda: 1)
    alone = plan_memory(graph, dims, 1, None)
    monkeypatch.setattr(conv_cores, "cores", lambda: 2)
    for fname, plan in plan_memory(graph, dims, 1, None).items():
        assert not alone[fname]["part_runs"]
        assert plan["peak_bytes"] == alone[fname]["peak_bytes"], fname
    assert plan_memory(graph, dims, 1, None)["_forward_loss"]["part_runs"]


def test_runs_never_raise_a_plans_peak_at_any_batch_size(monkeypatch):
    """With the batch dim unbound the plan holds for every batch: a value of fixed size (a param's sum)
    read at a run's first kernel, kept over the run, costs the most at a small batch, where a dense
    layer outside the run no longer holds the peak (found by review: the runs were checked at one
    representative batch size)."""
    m = gc.Model("runs_small_batch")
    x = m.input("x", ("B", 1, 16, 16))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.relu(gc.conv2d(x, m.param("w1", (1, 1, 3, 3)), padding=1) + gc.sum(m.param("wp", (3, 1, 16, 16)), axis=0))
    h = gc.tanh(gc.conv2d(h, m.param("w2", (8, 1, 3, 3)), padding=1))
    z = h.reshape(("B", 2048)) @ m.param("wz", (2048, 2688))
    m.minimize(gc.softmax_cross_entropy(z @ m.param("wo", (2688, 10)), y))
    graph = build_training_graph(m, "float32", {}, order=1)
    monkeypatch.setattr(conv_cores, "PART_FLOPS", 1)
    plans = {}
    for cores in (1, 2):
        monkeypatch.setattr(conv_cores, "cores", lambda: cores)
        plans[cores] = plan_memory(graph, {}, 1, None)

    def peak(plan, b):
        live = np.zeros(len(plan["steps"]), dtype=np.int64)
        for t in plan["tensors"]:
            live[t["start"]:t["end"] + 1] += buffer_bytes(graph, t["node"], {"B": b})
        return live.max()
    assert plans[2]["_loss_and_grad"]["part_runs"]
    for fname in ("_forward_loss", "_loss_and_grad", "_input_grads"):
        for b in (1, 2, 3, 64, 1000):
            assert peak(plans[2][fname], b) == peak(plans[1][fname], b), (fname, b)


def test_what_a_run_touches_never_shares_arena_bytes_during_it(two_cores):
    """The parts go at their own pace: every buffer a run reads or writes lives over the whole run,
    so no two of them share bytes (a plan without runs reuses conv1's output for conv2's)."""
    dims = {"B": 8}   # bound, so the plan has offsets (and the runs know the batch from bind)
    graph = build_training_graph(_lenet(), "float32", dims, order=1)
    plans = plan_memory(graph, dims, 1, None)
    for fname in ("_forward_loss", "_loss_and_grad", "_input_grads"):
        plan = plans[fname]
        assert plan["part_runs"], fname
        for run in plan["part_runs"]:
            touched = {base(graph, u) for n in run["nodes"] for u in list(graph.operands(n)) + [n]}
            held = [t for t in plan["tensors"] if t["node"] in touched
                    and t["start"] <= run["last"] and t["end"] >= run["first"]]
            for t in held:
                assert t["start"] <= run["first"] and t["end"] >= run["last"], (fname, t)
            spans = sorted((t["offset"], t["offset"] + t["bytes"]) for t in held)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (fname, spans)


def _sums_then_reads(batch_norm):
    """conv + tanh, then h times its sum over images and positions (a value a run sums), a second conv,
    relu, avg pool, dense: the sum must be whole before anything reads it. Or (not batch_norm) a conv
    with no bias straight into the dense layer."""
    m = gc.Model("runs_sum_read" if batch_norm else "runs_lone_conv")
    x = m.input("x", ("B", 2, 6, 6))
    y = m.input("y", ("B",), dtype="int64")
    p = {"w1": m.param("w1", (3, 2, 3, 3), init="he_normal"), "w3": m.param("w3", (4 if batch_norm else 108, 10))}
    if batch_norm:
        p |= {"b1": m.param("b1", (3,), init="normal"), "w2": m.param("w2", (4, 3, 3, 3), init="he_normal")}

    def forward(lib, x, p):
        conv, tanh, relu = (gc.conv2d, gc.tanh, gc.relu) if lib is gc else (F.conv2d, torch.tanh, torch.relu)
        if not batch_norm:   # the conv's neighbours are views and products: no kernel to chain it with
            h = conv(x, p["w1"], padding=1)
            return (h.reshape(("B", 108)) if lib is gc else h.reshape(-1, 108)) @ p["w3"]
        h = tanh(conv(x, p["w1"], p["b1"], padding=1))
        s = gc.sum(h, axis=(0, 2, 3), keepdims=True) if lib is gc else h.sum(dim=(0, 2, 3), keepdim=True)
        h = relu(conv(h * (s * 0.01), p["w2"], padding=1))
        h = gc.avg_pool2d(h, 6) if lib is gc else F.avg_pool2d(h, 6)
        return (h.reshape(("B", 4)) if lib is gc else h.reshape(-1, 4)) @ p["w3"]

    m.minimize(gc.softmax_cross_entropy(forward(gc, x, p), y))
    return m, forward


@pytest.mark.parametrize("batch_norm, bind", [(True, {}), (True, {"B": 7}), (False, {})],
                         ids=["sum_read_after", "sum_read_after_bound_batch", "lone_conv"])
def test_runs_cut_into_parts_match_torch(batch_norm, bind, build_dir, rng, monkeypatch):
    """Every run in 3 parts of 7 images (2, 2, 3), float64, against torch: a sum over the images that a
    later kernel reads ends its run (the sum is whole first), with the batch dim a name or bound to 7
    (--bind: the runs know the batch from before binding); a conv alone in its chain runs over parts on
    its own."""
    ran, _ = split_every_conv(monkeypatch)
    m, forward = _sums_then_reads(batch_norm)
    mod = gc.compile(m, out=build_dir, dtype="float64", order=1, warm=False, bind=bind)
    source = open(mod.__file__).read()
    entry = source[source.index("def _loss_and_grad("):].split("\n\n\n")[0]
    if batch_norm:
        graph = build_training_graph(m, "float64", bind, order=1)
        plan = plan_memory(graph, bind, 1, None)["_loss_and_grad"]
        summed = {n for r in plan["part_runs"] for n in r["summed"]}
        assert any(graph.op(n) == "sum" and graph.node(n)["phase"] == "forward" for n in summed)
        for r in plan["part_runs"]:   # nothing in a run reads what the run sums
            assert not {base(graph, u) for n in r["nodes"] for u in graph.operands(n)} & set(r["summed"])
        assert len(re.findall(r"\n    parts_on_cores\(images_\d+", entry)) >= 3
    else:
        assert "parts_on_cores(" not in entry
        assert re.search(r"\n    conv_on_cores\(k\d+_conv2d", entry)
    params = mod.init_params(1)
    X, Y = rng.standard_normal((7, 2, 6, 6)), rng.integers(0, 10, 7)
    loss, grads = mod.loss_and_grad(params, x=X, y=Y)
    assert ran and set(ran) == {3}
    pt = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    ref = F.cross_entropy(forward(torch, torch.tensor(X), pt), torch.tensor(Y))
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    for k, g in zip(pt, torch.autograd.grad(ref, list(pt.values()))):
        np.testing.assert_allclose(grads[k], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


def test_a_gradient_a_run_sums_and_a_view_shapes_reaches_the_caller(build_dir, rng, monkeypatch):
    """A bias of shape (C, 1, 1) added to a conv's output: its gradient is a sum over images and
    positions in the backward's run, reshaped by a view; the view is made before the run and the
    gradient copied out after the parts are added (loss_and_grad and a Trainer's step, float64, the
    batch bound to 7). memplan.json and `gradc inspect --memory` list the runs."""
    split_every_conv(monkeypatch)
    m = gc.Model("runs_view_grad")
    x = m.input("x", ("B", 2, 5, 5))
    y = m.input("y", ("B",), dtype="int64")
    w1, b1 = m.param("w1", (3, 2, 3, 3), init="he_normal"), m.param("b1", (3, 1, 1), init="normal")
    w2 = m.param("w2", (27, 10))
    h = gc.max_pool2d(gc.tanh(gc.conv2d(x, w1) + b1), 1)
    m.minimize(gc.softmax_cross_entropy(h.reshape(("B", 27)) @ w2, y))
    mod = gc.compile(m, out=build_dir, dtype="float64", order=1, warm=False, bind={"B": 7})
    with open(os.path.join(build_dir, "runs_view_grad.memplan.json")) as f:   # the runs, for inspect --memory
        runs = json.load(f)["part_runs"]
    assert [len(r["summed"]) for r in runs] == [0, 2]
    report = "\n".join(memory_report(os.path.join(build_dir, "runs_view_grad")))
    assert (f"part run: steps {runs[1]['first']}..{runs[1]['last']} ({len(runs[1]['nodes'])} kernels, "
            f"2 sums over the images)") in report
    params = mod.init_params(3)
    X, Y = rng.standard_normal((7, 2, 5, 5)), rng.integers(0, 10, 7)
    pt = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    hp = torch.tanh(F.conv2d(torch.tensor(X), pt["w1"]) + pt["b1"])
    ref = F.cross_entropy(hp.reshape(7, 27) @ pt["w2"], torch.tensor(Y))
    want = dict(zip(pt, (g.numpy() for g in torch.autograd.grad(ref, list(pt.values())))))
    loss, grads = mod.loss_and_grad(params, x=X, y=Y)
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)
    trainer = mod.Trainer(params, optimizer="sgd", lr=1.0)
    trainer.step(x=X, y=Y)
    np.testing.assert_allclose(trainer.params["b1"], params["b1"] - want["b1"], rtol=1e-10, atol=1e-12)


def test_a_reshape_to_a_number_ends_a_run(build_dir, rng, monkeypatch):
    """A reshape to () reads its one value (it is no view), so it is not made before the run: a sum of a
    run's values reshaped to a number and read by the next conv's chain gives torch's loss and gradients
    (found by review: made before the run, it read the sum before any part had written it)."""
    split_every_conv(monkeypatch)
    m = gc.Model("runs_scalar_reshape")
    x = m.input("x", ("B", 2, 6, 6))
    y = m.input("y", ("B",), dtype="int64")
    w1, w2 = m.param("w1", (3, 2, 3, 3), init="he_normal"), m.param("w2", (4, 3, 3, 3), init="he_normal")
    w3 = m.param("w3", (144, 10))
    h = gc.tanh(gc.conv2d(x, w1, padding=1))
    s = gc.sum(h, axis=(0, 1, 2, 3), keepdims=True).reshape(())
    m.minimize(gc.softmax_cross_entropy(gc.relu(gc.conv2d(h, w2, padding=1) * s).reshape(("B", 144)) @ w3, y))
    mod = gc.compile(m, out=build_dir, dtype="float64", order=1, warm=False)
    params = mod.init_params(0)
    X, Y = rng.standard_normal((7, 2, 6, 6)), rng.integers(0, 10, 7)
    pt = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    ht = torch.tanh(F.conv2d(torch.tensor(X), pt["w1"], padding=1))
    logits = torch.relu(F.conv2d(ht, pt["w2"], padding=1) * ht.sum()).reshape(7, 144) @ pt["w3"]
    ref = F.cross_entropy(logits, torch.tensor(Y))
    loss, grads = mod.loss_and_grad(params, x=X, y=Y)
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    for k, g in zip(pt, torch.autograd.grad(ref, list(pt.values()))):
        np.testing.assert_allclose(grads[k], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


def test_a_runs_workspace_counts_its_parts(monkeypatch):
    """A run cuts the batch by the whole chain's work, so its convs may run in more parts than each
    would alone: the plan's workspace counts them at the run's parts (4 cores, 8 images of 8 channels at
    16 x 16: each conv alone would run in fewer parts than the run does)."""
    monkeypatch.setattr(conv_cores, "cores", lambda: 4)
    m = gc.Model("runs_workspace")
    h = m.input("x", ("B", 8, 16, 16))
    y = m.input("y", ("B",), dtype="int64")
    for i in range(6):
        h = gc.relu(gc.conv2d(h, m.param(f"w{i}", (8, 8, 3, 3)), padding=1))
    m.minimize(gc.softmax_cross_entropy(h.reshape(("B", 2048)) @ m.param("wd", (2048, 10)), y))
    dims = {"B": 8}
    graph = build_training_graph(m, "float32", dims, order=1)
    plan = plan_memory(graph, dims, 1, None)["_loss_and_grad"]
    steps, runs = plan["steps"], plan["part_runs"]
    fewer = 0   # convs that alone would run in fewer parts than their run does (the case this test is about)
    for run in runs:
        parts = conv_cores.planned_parts(8, 8 * run["image_work"], 4)
        for n in (steps[t] for t in range(run["first"], run["last"] + 1)):
            record = get_op(graph.op(n))
            if record.workspace is not None:
                fewer += conv_cores.planned_parts(8, 8 * record.part_work(graph, n, dims), 4) < parts
                assert plan["workspace_bytes"] >= record.workspace(graph, n, dims, parts=parts) > 0
    assert fewer
