"""Seed 004's VGG-16 memory table from a compiled graph, without running it (issue 15)."""
import json
import runpy
import time
from pathlib import Path

import pytest

import gradc as gc
from gradc.inspect_build import _load, report
from gradc.inspect_layers import _size, layer_rows, layers_report
from gradc.sizes import format_size

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vgg16.py"
MIB = 2 ** 20


def test_vgg16_table_matches_the_lecture(tmp_path):
    model = runpy.run_path(str(EXAMPLE))["m"]
    start = time.perf_counter()
    gc.compile(model, out=str(tmp_path), bind={"B": 1}, order=1, warm=False)
    assert time.perf_counter() - start < 60   # passes and codegen in seconds, no kernel compiled
    base = str(tmp_path / "vgg16")
    rows = {label.split(",")[0]: (op, wb, ob) for label, op, _, wb, ob in layer_rows(_load(base)[1])}
    assert len(rows) == 21   # 13 convs, 5 pools, 3 fully connected
    # the (3x3x64)x128 conv's weights: 288 KiB (the lecture's table says 228 KB), plus its bias
    assert rows["conv2_1"][1] == 3 * 3 * 64 * 128 * 4 + 128 * 4
    assert rows["conv1_1"][2] == 64 * 224 * 224 * 4
    text = report(base, memory=True, layers=True)
    # inference frees each layer's input once read: the two largest adjacent activations
    assert "inference (forward) peak: 24.50 MiB" in text
    kept = float(text.split("kept for the backward: ")[-1].split(" MiB")[0])
    assert 57.0 < kept < 58.0   # every layer's output, one value per layer (~57.6 MiB at batch 1)
    peak = float(text.split("training (loss_and_grad) peak: ")[1].split(" MiB")[0])
    assert kept < peak < kept + 3   # plus little else


@pytest.mark.parametrize("cores", [1, 4])
def test_memory_plan_counts_the_conv_workspace_in_the_budget(tmp_path, monkeypatch, cores):
    """A conv's im2col tile is bounded (never a whole image's columns) and the plan sees it, in the
    budget too; on 4 cores these convs run in 4 parts, each with a tile of its own."""
    from gradc.passes.memory import plan_memory
    from gradc.passes.pipeline import build_training_graph
    from gradc.runtime import conv_cores
    monkeypatch.setattr(conv_cores, "cores", lambda: cores)

    m = gc.Model("convs")
    x = m.input("x", ("B", 3, 32, 32))
    h = gc.relu(gc.conv2d(x, m.param("w1", (16, 3, 3, 3)), padding=1))
    for i in range(2, 8):
        h = gc.tanh(gc.conv2d(h, m.param(f"w{i}", (16, 16, 3, 3)), padding=1))
    m.minimize(h.mean())
    graph = build_training_graph(m, "float32", {"B": 4})
    plan = plan_memory(graph, {"B": 4}, 1)["_loss_and_grad"]
    whole_image_columns = 4 * 16 * 9 * 32 * 32 * 4
    assert 0 < plan["workspace_bytes"] < whole_image_columns * (1 if cores == 1 else 2)
    if cores > 1:
        monkeypatch.setattr(conv_cores, "cores", lambda: 1)
        one_core = plan_memory(graph, {"B": 4}, 1)["_loss_and_grad"]["workspace_bytes"]
        assert plan["workspace_bytes"] > one_core   # four one-image tiles against one of three images
        monkeypatch.setattr(conv_cores, "cores", lambda: cores)
    tight = plan["peak_bytes"] + plan["workspace_bytes"]
    assert plan_memory(graph, {"B": 4}, 1, budget=tight)["_loss_and_grad"]["method"] == "store-all"
    assert bool(plan["part_runs"]) == (cores > 1)   # (passes/part_runs.py: none on one core)
    if cores > 1:   # a byte less: the part runs, which keep what they touch live over the run, go first
        plan = plan_memory(graph, {"B": 4}, 1, budget=tight - 1)["_loss_and_grad"]
        assert plan["method"] == "store-all" and not plan["part_runs"]
        assert plan["peak_bytes"] + plan["workspace_bytes"] <= tight - 1
        tight = plan["peak_bytes"] + plan["workspace_bytes"]
    # the same budget without room for the workspace: activations must be recomputed
    squeezed = plan_memory(graph, {"B": 4}, 1, budget=tight - 1)["_loss_and_grad"]
    assert squeezed["recompute_flops"] > 0
    assert squeezed["peak_bytes"] + squeezed["workspace_bytes"] <= tight - 1


def test_budget_planning_of_a_conv_net_with_a_bias():
    """The MILP's coarse graph skips a view of a param (a conv bias reshaped to broadcast): budgets
    are planned or refused with the minimum, never a crash (found by trying it as a new user)."""
    import pytest
    from gradc.passes.checkpoint import BudgetError
    from gradc.passes.memory import plan_memory
    from gradc.passes.pipeline import build_training_graph

    m = gc.Model("biased")
    x = m.input("x", ("B", 1, 8, 8))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.max_pool2d(gc.relu(gc.conv2d(x, m.param("w1", (8, 1, 3, 3)), bias=m.param("b1", (8,)), padding=1)), 2)
    h = gc.max_pool2d(gc.relu(gc.conv2d(h, m.param("w2", (16, 8, 3, 3)), padding=1)), 2)
    logits = h.reshape(("B", -1)) @ m.param("W", (64, 10)) + m.param("b", (10,))
    m.minimize(gc.softmax_cross_entropy(logits, y))
    graph = build_training_graph(m, "float32", {"B": 64})
    full = plan_memory(graph, {"B": 64}, 1)["_loss_and_grad"]
    with pytest.raises(BudgetError) as refused:
        plan_memory(graph, {"B": 64}, 1, budget=1024)
    assert refused.value.minimum > full["workspace_bytes"]
    enough = full["peak_bytes"] + full["workspace_bytes"]
    assert plan_memory(graph, {"B": 64}, 1, budget=enough)["_loss_and_grad"]["peak_bytes"] <= full["peak_bytes"]


def test_a_pipeline_builds_layers_keep_the_bias_added_on_the_next_stage(tmp_path):
    """A layer's product on one stage whose bias is added on the next (the product is sent between them)
    lost its bias in the table, and the weights' total with it."""
    m = gc.Model("layers_two_stages")
    h = m.input("x", ("B", 8))
    for i in range(6):
        with m.stage(0 if i < 3 else 1):
            z = h @ m.param(f"W{i}", (8, 8))
        with m.stage(1 if i == 2 else (0 if i < 3 else 1)):
            h = gc.tanh(z + m.param(f"b{i}", (8,)))
    m.minimize(h.mean())
    one = tmp_path / "one"
    gc.compile(m, out=str(one), bind={"B": 4}, order=1, warm=False)
    gc.compile(m, out=str(tmp_path / "two"), bind={"B": 4}, order=1, warm=False, devices=2)
    graph = _load(str(tmp_path / "two" / m.name))[1]
    assert any(n["op"] == "transfer" for n in graph["nodes"])
    rows = lambda out: [(label, wb) for label, _, _, wb, _ in layer_rows(_load(str(out / m.name))[1])]
    assert rows(tmp_path / "two") == rows(one) == [(f"W{i}, b{i}", (64 + 8) * 4) for i in range(6)]


def test_a_bias_summed_with_two_layers_products_counts_once(tmp_path):
    """conv(x, wa) + conv(x, wb, bb) is one fused sum reading both products and bb: both rows listed bb,
    and the weights' total counted it twice (trial P). It goes to the later layer, whose call named it."""
    m = gc.Model("layers_two_products")
    x = m.input("x", ("N", 4, 8, 8))
    wa, wb, bb = m.param("wa", (8, 4, 3, 3)), m.param("wb", (8, 4, 1, 1)), m.param("bb", (8,), init="zeros")
    h = gc.conv2d(x, wa, padding=1) + gc.conv2d(x, wb, bb)
    m.minimize((h * h).mean())
    gc.compile(m, out=str(tmp_path), bind={"N": 2}, order=1, warm=False)
    base = str(tmp_path / m.name)
    rows = layer_rows(_load(base)[1])
    assert [(label, wb_) for label, _, _, wb_, _ in rows] == [("wa", 8 * 4 * 9 * 4), ("wb, bb", (8 * 4 + 8) * 4)]
    total = next(line for line in layers_report(base, _load(base)[1]) if line.strip().startswith("total"))
    assert _size((8 * 4 * 9 + 8 * 4 + 8) * 4) in total, total


def test_a_scan_is_a_layer_with_the_weights_its_steps_read(tmp_path):
    """An RNN's scan was left out of the table, and its weights out of the total."""
    m = gc.Model("layers_rnn")
    x, y, h0 = m.input("x", ("T", "B", 3)), m.input("y", ("B",), dtype="int64"), m.input("h0", ("B", 4))
    W, U, b = m.param("W", (3, 4)), m.param("U", (4, 4)), m.param("b", (4,))
    hT, hs = gc.scan(lambda h, xt: (gc.tanh(xt @ W + h @ U + b), h), gc.tanh(h0), x)
    m.output("states", hs)
    m.minimize(gc.softmax_cross_entropy(hT @ m.param("V", (4, 2)), y))
    gc.compile(m, out=str(tmp_path), bind={"B": 5, "T": 7}, order=1, warm=False)
    rows = layer_rows(_load(str(tmp_path / m.name))[1])
    # the scan's output: the final carry (B, 4) and the states (T, B, 4) the model reads
    assert [(label, op, wb, ob) for label, op, _, wb, ob in rows] == [
        ("W, U, b", "scan", (12 + 16 + 4) * 4, (5 * 4 + 7 * 5 * 4) * 4), ("V", "matmul", 8 * 4, 5 * 2 * 4)]
    # dims left symbolic: the scan's two results are shown (a lone () read as a scalar; the report crashed)
    gc.compile(m, out=str(tmp_path / "free"), order=1, warm=False)
    text = "\n".join(layers_report(str(tmp_path / "free" / m.name), _load(str(tmp_path / "free" / m.name))[1]))
    assert "(B, 4) + (T, B, 4)" in text and "dims B, T are symbolic" in text, text


def test_a_forward_scans_stacks_are_kept_for_the_backward(tmp_path):
    """An RNN's carry stacks (results autodiff adds to the forward scan, in the backward phase) were called
    'temporary' by --memory, and left out of 'kept for the backward' (trial R)."""
    m = gc.Model("layers_rnn_kept")
    x, y, h0 = m.input("x", ("T", "B", 3)), m.input("y", ("B",), dtype="int64"), m.input("h0", ("B", 4))
    W, U = m.param("input_weights", (3, 4)), m.param("hidden_weights", (4, 4))
    hT, _ = gc.scan(lambda h, xt: (gc.tanh(xt @ W + h @ U), None), h0, x)
    m.minimize(gc.softmax_cross_entropy(hT @ m.param("V", (4, 2)), y))
    gc.compile(m, out=str(tmp_path), bind={"B": 5, "T": 7}, order=1, warm=False)
    plan = json.loads((tmp_path / f"{m.name}.memplan.json").read_text())
    stacks = [t for t in plan["tensors"] if t["op"] == "scan_out" and t["shape"] == [7, 5, 4]]
    assert stacks and all(t["retained"] for t in stacks), stacks
    # a layer of many weights names them all (a GRU's nine lost three to the column's 22 characters)
    text = "\n".join(layers_report(str(tmp_path / m.name), _load(str(tmp_path / m.name))[1]))
    assert "\n  input_weights, hidden_weights\n" in text, text


def test_the_peaks_name_the_kernel_workspace_beside_the_arena(tmp_path):
    """An RNN's forward keeps nothing in the plan's arena (its step buffers are the scan kernel's own):
    --layers said 'inference (forward) peak: 0 bytes' (trial N). The peaks now name the workspace too."""
    import json
    m = gc.Model("ws_rnn")
    x, h0 = m.input("x", ("T", "B", 4)), m.input("h0", ("B", 8))
    W, U, V = m.param("W", (4, 8)), m.param("U", (8, 8)), m.param("V", (8, 3))
    _, logits = gc.scan(lambda h, x_t: (gc.tanh(x_t @ W + h @ U), gc.tanh(x_t @ W + h @ U) @ V), h0, x)
    m.output("logits", logits)
    m.minimize(gc.softmax_cross_entropy(logits, m.input("y", ("T", "B"), dtype="int64")))
    gc.compile(m, out=str(tmp_path), bind={"T": 6, "B": 5}, order=1, warm=False)
    base = str(tmp_path / "ws_rnn")
    entries = json.loads((tmp_path / "ws_rnn.memplan.json").read_text())["entries"]
    forward, train = entries["forward"]["workspace_bytes"], entries["loss_and_grad"]["workspace_bytes"]
    assert forward > 0 and train > 0
    text = report(base, memory=True, layers=True)
    assert f"inference (forward) peak: {_size(entries['forward']['peak_bytes'])} + kernel workspace {_size(forward)}" \
        in text, text
    assert f"training (loss_and_grad) peak: {_size(entries['loss_and_grad']['peak_bytes'])} + kernel workspace " \
           f"{_size(train)}" in text, text
    assert f"forward peak {format_size(entries['forward']['peak_bytes'])} + {format_size(forward)}" in text, text


def test_a_tied_weight_is_counted_once(tmp_path):
    """Trial S: an autoencoder whose decoder reads the encoder's W transposed listed W in both rows, and
    the weights' total counted it twice. The second row marks it tied and counts only its own bias."""
    m = gc.Model("layers_tied")
    x = m.input("x", ("B", 64))
    W, b1, b2 = m.param("W", (64, 16)), m.param("b1", (16,)), m.param("b2", (64,))
    h = gc.tanh(x @ W + b1)
    m.minimize(gc.mse(gc.sigmoid(h @ W.T + b2), x))
    gc.compile(m, out=str(tmp_path), bind={"B": 100}, order=1, warm=False)
    base = str(tmp_path / m.name)
    rows = layer_rows(_load(base)[1])
    assert [(label, wb_) for label, _, _, wb_, _ in rows] == [("W, b1", (64 * 16 + 16) * 4), ("W (tied), b2", 64 * 4)]
    total = next(line for line in layers_report(base, _load(base)[1]) if line.strip().startswith("total"))
    assert _size((64 * 16 + 16 + 64) * 4) in total, total
