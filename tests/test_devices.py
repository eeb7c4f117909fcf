"""--devices K: stages, placement and transfers in the graph, and the built module against one device."""
import json
import subprocess
import sys

import numpy as np
import pytest

import gradc as gc
from gradc.compiler import compile_model
from gradc.ops import get_op

from test_memory import _dag, _inputs, _mlp


def _load(out, name):
    with open(out / f"{name}.graph.json") as f:
        graph = json.load(f)
    with open(out / f"{name}.partition.json") as f:
        return graph, json.load(f)


def _check_placement(graph, plan, K):
    nodes = {n["id"]: n for n in graph["nodes"]}
    devices = {f"cpu:{k}" for k in range(K)}
    assert {n["device"] for n in nodes.values()} <= devices
    for link in graph["links"]:   # a value read on another device always arrives by a transfer node
        u, v = nodes[link["source"]], nodes[link["target"]]
        if v["op"] == "transfer":
            assert (u["device"], v["device"]) == (v["attrs"]["source"], v["attrs"]["target"]) != (u["device"],) * 2
        elif u["op"] not in ("input", "const") and u["device"] != v["device"]:
            raise AssertionError(f"%{u['id']} on {u['device']} is read by %{v['id']} on {v['device']}")
    transfers = [n for n in nodes.values() if n["op"] == "transfer"]
    assert transfers and all(n["phase"] == "transfer" for n in transfers)
    # lr_grad runs whole: the copies it makes for itself are listed apart from the stages' transfers
    assert {t["node"] for t in plan["transfers"]} | set(plan["lr_grad_transfers"]) == {n["id"] for n in transfers}
    assert not {t["node"] for t in plan["transfers"]} & set(plan["lr_grad_transfers"])
    for n in nodes.values():   # every derivative runs where the node it differentiates runs
        of = n.get("of")
        if n["phase"] in ("backward", "second") and n["op"] not in ("input", "const") and of in nodes \
                and nodes[of]["phase"] == "forward":
            assert n["device"] == nodes[of]["device"], (n, nodes[of])
    # the forward is cut into K non-empty contiguous stages of its order (a view of a param, made first,
    # goes with its readers: passes/placement.py)
    param_views = {link["target"] for link in graph["links"] if nodes[link["source"]]["op"] == "param"
                   and get_op(nodes[link["target"]]["op"]).view}
    stage_of = {n: s["stage"] for s in plan["stage"] for n in s["nodes"]}
    forward = [n for n in plan["order"] if n in stage_of and n not in param_views]
    stages = [stage_of[n] for n in forward]
    assert stages == sorted(stages) and set(stages) == set(range(K))


def _same_as_one_device(one, many, rng, seed, hvp, tol):
    """Loss, gradients, hvp (when built) and three Adam steps of a --devices build against one device's,
    on batch 8 of random inputs."""
    params = one.init_params(seed)
    inputs = _inputs(one, 8, rng)
    loss1, grads1 = one.loss_and_grad(params, **inputs)
    lossK, gradsK = many.loss_and_grad(params, **inputs)
    assert lossK == pytest.approx(loss1, abs=tol)
    for k in grads1:
        np.testing.assert_allclose(gradsK[k], grads1[k], rtol=0, atol=tol, err_msg=k)
    if hvp:
        v = {k: rng.standard_normal(p.shape) for k, p in params.items()}
        hv1, hvK = one.hvp(params, v, **inputs), many.hvp(params, v, **inputs)
        for k in hv1:
            np.testing.assert_allclose(hvK[k], hv1[k], rtol=0, atol=tol, err_msg=k)
    t1, tK = one.Trainer(params, optimizer="adam", lr=1e-2), many.Trainer(params, optimizer="adam", lr=1e-2)
    for _ in range(3):
        assert tK.step(**inputs) == pytest.approx(t1.step(**inputs), abs=tol)


@pytest.mark.slow
@pytest.mark.parametrize("make,K", [(_mlp, 2), (_dag, 3)], ids=["mlp-2", "dag-3"])
def test_devices_give_the_one_device_gradients(tmp_path, make, K):
    model = make()
    order = 2 if K == 3 else 1   # hvp through transfers once (it compiles slowly)
    one = compile_model(model, out=str(tmp_path / "one"), order=order, bind={"B": 8}, warm_cache=False, dtype="float64")
    many = compile_model(model, out=str(tmp_path / "many"), order=order, bind={"B": 8}, warm_cache=False,
                         dtype="float64", devices=K, schedule="1f1b")
    graph, plan = _load(tmp_path / "many", model.name)
    _check_placement(graph, plan, K)
    assert many.PARTITION == plan and one.PARTITION is None
    assert set(many.MEMORY_PLAN["arena_bytes"]) == {f"cpu:{k}" for k in range(K)}
    _same_as_one_device(one, many, np.random.default_rng(5), 2, order == 2, 1e-10)
    with pytest.raises(ValueError, match="batch dim bound"):   # a --microbatches 1 build cannot split batches
        many._PIPELINE.reschedule("gpipe", 2)
    stats = many.memory_stats()["arena_bytes"]
    assert set(stats) == {f"cpu:{k}" for k in range(K)} and all(b > 0 for b in stats.values())


def _pinned():
    """Pins out of order: no contiguous cut can honour them."""
    m = gc.Model("pinned")
    x = m.input("x", ("B", 4))
    with m.stage(1):
        h = gc.tanh(x @ m.param("W0", (4, 8)))
    h = gc.tanh(h @ m.param("W1", (8, 8)))
    with m.stage(0):
        h = gc.tanh(h @ m.param("W2", (8, 8)))
    m.minimize(gc.mean(h * h))
    return m


def test_pins_hold_and_bad_pins_are_refused(tmp_path):
    model = _pinned()
    with pytest.raises(gc.GradcError, match=r"no cut of the model into 2 contiguous stages keeps every pinned op "
                                            r"on its stage \(an op pinned to stage 0 comes after one pinned to stage 1 in the "
                                            r"model's order .*write stage 0's ops first; "
                                            r"%\d+ \(matmul\) \[tests/test_devices.py:\d+\] -> stage 1"):
        compile_model(model, out=str(tmp_path / "a"), order=1, bind={"B": 4}, warm_cache=False, devices=2)
    gap = gc.Model("gap")   # pins 0, 0, 2: stage 1 would be empty (a trial's refusal named stage 0's ops alone)
    h = gap.input("x", ("B", 4))
    for k in (0, 0, 2):
        with gap.stage(k):
            h = gc.tanh(h @ gap.param(f"W{len(gap.graph.params)}", (4, 4)))
    gap.minimize(gc.mean(h))
    with pytest.raises(gc.GradcError, match=r"stage 1 would hold no op: 0 op\(s\) lie between the ops pinned before and after it"):
        compile_model(gap, out=str(tmp_path / "c"), order=1, bind={"B": 4}, warm_cache=False, devices=3)
    m = gc.Model("late")
    x = m.input("x", ("B", 4))
    with m.stage(3):
        y = gc.tanh(x @ m.param("W", (4, 4)))
    m.minimize(gc.mean(y))
    with pytest.raises(gc.GradcError, match=r"pinned to stage 3 but --devices is 2 \(stages 0..1\)"):
        compile_model(m, out=str(tmp_path / "b"), order=1, bind={"B": 4}, warm_cache=False, devices=2)
    with pytest.raises(gc.GradcError, match=r"test_devices.py:\d+: stage: the stage index must be an int"):
        with m.stage(-1):   # (the user's line, not contextlib's)
            pass
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_pin_moves_the_cut(tmp_path):
    m = gc.Model("pin_cut")
    x = m.input("x", ("B", 16))
    h = x
    for i in range(6):
        if i == 1:
            with m.stage(1):
                h = gc.tanh(h @ m.param(f"W{i}", (16, 16)))
        else:
            h = gc.tanh(h @ m.param(f"W{i}", (16, 16)))
    m.minimize(gc.mean(h * h))
    compile_model(m, out=str(tmp_path), order=1, bind={"B": 8}, warm_cache=False, devices=2)
    graph, plan = _load(tmp_path, "pin_cut")
    assert "W1" in plan["stage"][1]["params"] and "W0" in plan["stage"][0]["params"]
    _check_placement(graph, plan, 2)


def test_device_memory_is_checked_by_the_stage_functions_plans(tmp_path):
    """A stage's memory is its arena region (its functions' plans), its stash per microbatch in
    flight, and its params with their gradients; --device-memory bounds that, not the cost model."""
    model = _dag()
    build = lambda out, **o: compile_model(model, out=str(tmp_path / out), order=1, bind={"B": 64}, warm_cache=False,
                                           devices=2, schedule="gpipe", **o)
    halves, micro = build("m2", microbatches=2), build("m4", microbatches=4)
    for a, b in zip(halves.PARTITION["stage"], micro.PARTITION["stage"]):   # bytes held per microbatch: 32 rows, 16
        # (what has rows doubles; a scalar the backward takes, 4 bytes as the 1-element array it is passed, does not)
        assert a["params"] == b["params"] and a["stash_bytes_per_microbatch"] > b["stash_bytes_per_microbatch"] > 0
        assert 0 <= 2 * b["stash_bytes_per_microbatch"] - a["stash_bytes_per_microbatch"] <= 4 * 4
    micro.loss_and_grad(micro.init_params(0), **_inputs(micro, 64, np.random.default_rng(1)))
    held = micro.memory_stats()["arena_bytes"]
    for st in micro.PARTITION["stage"]:
        region = max(st["arena_bytes"].values())
        assert held[st["device"]] == region   # what the module really allocated for the stage
        params = sum(int(np.prod(micro.PARAM_SHAPES[p])) * 4 for p in st["params"])
        copies = sum(t["bytes"] for t in micro.PARTITION["transfers"] if t["carries"] == "param" and t["to"] == st["device"])
        assert st["memory_bytes"] == region + st["in_flight"] * st["stash_bytes_per_microbatch"] + 2 * params + copies
    need = max(st["memory_bytes"] for st in micro.PARTITION["stage"])
    fits = build("fits", microbatches=4, device_memory=need)
    assert max(st["memory_bytes"] for st in fits.PARTITION["stage"]) <= need
    # a limit the fastest cut meets by its plans keeps that cut (found by a new-user trial: the cost model, above the
    # plans, chose a slower cut, and named a least need above what the fastest cut held)
    assert [st["params"] for st in fits.PARTITION["stage"]] == [st["params"] for st in micro.PARTITION["stage"]]
    assert fits.PARTITION["replans"] == 0
    for limit in (need - 1, need - 2000):   # another cut that fits by the plans, or the error that says none does
        try:
            other = build("tight", microbatches=4, device_memory=limit)
        except gc.GradcError as e:
            assert "fits --device-memory" in str(e), e
            continue
        assert max(st["memory_bytes"] for st in other.PARTITION["stage"]) <= limit


def test_a_limit_the_fastest_cut_meets_keeps_that_cut(tmp_path):
    """Found by a new-user trial: the cost model puts this MLP's stages above their plans, so --device-memory at
    what the fastest cut holds was refused ("the least any cut needs (by the cost model) is 4.76 MiB", 4.33 held)."""
    build = lambda out, **o: compile_model(_mlp(8, 256), out=str(tmp_path / out), order=1, dtype="float64",
                                           bind={"B": 64}, warm_cache=False, devices=2, schedule="1f1b",
                                           microbatches=4, **o)
    free = build("free")
    need = max(st["memory_bytes"] for st in free.PARTITION["stage"])
    assert need < max(st["model_memory_bytes"] for st in free.PARTITION["stage"])   # the model is above the plans
    fits = build("fits", device_memory=need)
    assert [st["params"] for st in fits.PARTITION["stage"]] == [st["params"] for st in free.PARTITION["stage"]]
    assert fits.PARTITION["replans"] == 0 and fits.PARTITION["device_memory"] == need
    with pytest.raises(gc.GradcError, match=rf"the fastest cut is one whose stage [01] needs .*\({need:,} bytes\)$"):
        build("tight", device_memory=need - 1)


def test_device_option_errors(tmp_path):
    model = _mlp(layers=2, width=4)
    cases = [
        (dict(devices=2), r"--devices needs every symbolic dim bound with --bind \(unbound: B"),
        (dict(devices=2, bind={"B": 4}, device_memory=16), r"no cut of the model into 2 contiguous stages fits --device-memory 16 bytes per device under the "
         r"sequential schedule: the least any cut needs \(by the cost model, an estimate that can be above what the "
         r"stages' plans hold\) is \d+ bytes per device \(its stage [01].*; "
         r"the fastest cut is one whose stage [01] needs \d+ bytes$"),
        (dict(devices=500, bind={"B": 4}), r"--devices 500: the model has \d+ forward ops, fewer than 500 stages"),
        (dict(devices=2, bind={"B": 4}, schedule="zigzag"), r"--schedule 'zigzag': use one of sequential, gpipe, 1f1b"),
        (dict(devices=2, bind={"B": 4}, microbatches=0), r"--microbatches 0: give a whole number >= 1"),
        (dict(batch_dim="C"), r"^--batch-dim C: no input has that dim \(they have: B\)$"),
        (dict(microbatches=2, batch_dim="C"), r"--microbatches 2: --batch-dim C: no input has that dim"),
        (dict(devices=2, bind={"B": 4}, memory_budget="auto"), r"--memory-budget auto applies to one device: with --devices or --microbatches give a size"),
        (dict(schedule="gpipe"), r"--schedule applies to pipelines"),
        (dict(device_memory="1MiB"), r"--device-memory applies to --devices K with K > 1"),
    ]
    for options, message in cases:
        with pytest.raises(gc.GradcError, match=message):
            compile_model(model, out=str(tmp_path / "out"), order=1, warm_cache=False, **options)
        assert not (tmp_path / "out").exists()


CLI_MODEL = '''
import gradc as gc
m = gc.Model("chain")
x = m.input("x", ("B", 8))
h = x
for i in range(4):
    h = gc.tanh(h @ m.param(f"W{i}", (8, 8)))
m.minimize(gc.mean(h * h))
'''


def test_cli_compile_with_devices_and_inspect_partition(tmp_path):
    (tmp_path / "model.py").write_text(CLI_MODEL)
    run = lambda *a: subprocess.run([sys.executable, "-m", "gradc.cli", *a], cwd=tmp_path, capture_output=True, text=True)
    r = run("compile", "model.py", "-o", "out", "--bind", "B=16", "--devices", "2", "--schedule", "gpipe",
            "--order", "1", "--no-warm")
    assert r.returncode == 0, r.stderr
    r = run("inspect", "out/chain", "--partition")
    assert r.returncode == 0, r.stderr
    for needle in ("partition: 2 stages on cpu, schedule gpipe", "stage 0 |", "stage 1 |", "transfers:", "W0", "W3"):
        assert needle in r.stdout, needle
    r = run("compile", "model.py", "-o", "out2", "--devices", "2", "--no-warm")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--bind" in r.stderr


def test_a_bad_flag_value_names_the_flag_not_the_model_file(tmp_path):
    """Nothing in the model file is wrong, so the error carries no file:line of it."""
    model = _mlp(layers=2, width=4)
    for options in (dict(devices=0), dict(microbatches=2, schedule="zigzag"), dict(order=3), dict(bind={"B": 0}),
                    dict(device_memory="1MiB"), dict(microbatches=8, bind={"B": 4})):
        with pytest.raises(gc.GradcError) as e:
            compile_model(model, out=str(tmp_path / "out"), warm_cache=False, **options)
        assert e.value.src is None and str(e.value).startswith("--"), (options, str(e.value))


def test_a_conv_net_with_biases_runs_on_two_devices(tmp_path):
    """A conv's bias is a view of its param (reshaped to (C, 1, 1)) that the schedule makes first: the
    view goes with the stage that reads it, so the param lives where its gradient is made (it was cut
    into stage 0 and the compile failed). Gradients and loss against one device, float64."""
    m = gc.Model("conv_two_devices")
    x = m.input("x", ("B", 3, 8, 8))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.relu(gc.conv2d(x, m.param("w0", (4, 3, 3, 3)), m.param("b0", (4,), init="normal"), padding=1))
    h = gc.tanh(gc.conv2d(h, m.param("w1", (4, 4, 3, 3)), m.param("b1", (4,), init="normal"), padding=1))
    h = gc.max_pool2d(gc.relu(gc.conv2d(h, m.param("w2", (4, 4, 3, 3)), padding=1)), 2)
    m.minimize(gc.softmax_cross_entropy(h.reshape(("B", 64)) @ m.param("wd", (64, 10)), y))
    one = compile_model(m, out=str(tmp_path / "one"), order=1, bind={"B": 7}, warm_cache=False, dtype="float64")
    two = compile_model(m, out=str(tmp_path / "two"), order=1, bind={"B": 7}, warm_cache=False, dtype="float64",
                        devices=2, schedule="1f1b")
    graph, plan = _load(tmp_path / "two", m.name)
    _check_placement(graph, plan, 2)
    rng = np.random.default_rng(3)
    params = one.init_params(1)
    X, Y = rng.standard_normal((7, 3, 8, 8)), rng.integers(0, 10, 7)
    loss1, grads1 = one.loss_and_grad(params, x=X, y=Y)
    loss2, grads2 = two.loss_and_grad(params, x=X, y=Y)
    assert loss2 == pytest.approx(loss1, abs=1e-12)
    for k in grads1:
        np.testing.assert_allclose(grads2[k], grads1[k], rtol=0, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("order", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_weight_decay_is_summed_where_each_param_lives(tmp_path, order):
    """Each stage squares its own params and sends the objective's stage one scalar each: the params
    themselves never travel (they did, every microbatch). Loss, gradients, Adam steps and (slow tier) hvp
    against one device, float64, with microbatches (whose objectives each hold the decay once)."""
    m = gc.Model("decay_on_devices")
    x = m.input("x", ("B", 6))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(4):
        h = gc.tanh(h @ m.param(f"W{i}", (6, 6)) + m.param(f"b{i}", (6,), init="normal", decay=i % 2 == 0))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("Wo", (6, 3)), y), weight_decay=0.07)
    one = compile_model(m, out=str(tmp_path / "one"), order=order, bind={"B": 8}, warm_cache=False, dtype="float64")
    many = compile_model(m, out=str(tmp_path / "many"), order=order, bind={"B": 8}, warm_cache=False, dtype="float64",
                         devices=3, schedule="gpipe", microbatches=2)
    graph, plan = _load(tmp_path / "many", m.name)
    _check_placement(graph, plan, 3)
    nodes = {n["id"]: n for n in graph["nodes"]}
    assert not [t for t in plan["transfers"] if t["carries"] == "param"], plan["transfers"]
    squares = 0
    for link in graph["links"]:   # ||p||^2 is computed on p's device
        u, v = nodes[link["source"]], nodes[link["target"]]
        if u["op"] == "param" and v["op"] == "fused_sum" and v["phase"] == "forward":   # (its square in its sum's loop)
            assert v["device"] == u["device"], (u, v)
            squares += 1   # W0..W3, Wo, b0 and b2
    assert squares == 5 + 2 and len({s["stage"] for s in plan["stage"] if s["params"]}) == 3
    _same_as_one_device(one, many, np.random.default_rng(11), 4, order == 2, 1e-12)


def test_a_batch_of_another_size_is_told_how_a_devices_build_takes_any(tmp_path):
    """A --devices build needs its dims bound: "compile without --bind for any size" (a trial) was no way out."""
    m = gc.Model("two_stage_rows")
    h = m.input("x", ("B", 4))
    for i in range(2):
        h = gc.tanh(h @ m.param(f"W{i}", (4, 4)))
    m.minimize(gc.mean(h * h))
    mod = compile_model(m, out=str(tmp_path / "a"), order=1, bind={"B": 4}, warm_cache=False, devices=2)
    with pytest.raises(ValueError, match=r"B=4 was bound when this --devices build was compiled: compile it again "
                                         r"with --bind B=5, or for any batch size with --microbatches M > 1"):
        mod.loss_and_grad(mod.init_params(0), x=np.ones((5, 4), np.float32))


def test_partition_counts_a_training_steps_traffic_and_the_chart_shows_every_op(tmp_path):
    """Trial T: an --order 2 build's partition dump counted hvp's transfers in each stage's sent and
    received bytes, the per-step total and the modelled schedule (241 KiB where --order 1 said 96 KiB);
    and the Gantt chart let one op's mark overwrite another's in a column, and put stage 10 a column right."""
    from gradc.inspect_partition import gantt, partition_report
    (tmp_path / "model.py").write_text(CLI_MODEL)
    run = lambda *a: subprocess.run([sys.executable, "-m", "gradc.cli", *a], cwd=tmp_path, capture_output=True, text=True)
    docs = {}
    for order in ("1", "2"):
        r = run("compile", "model.py", "-o", f"o{order}", "--bind", "B=16", "--devices", "2", "--schedule", "1f1b",
                "--microbatches", "4", "--order", order, "--no-warm")
        assert r.returncode == 0, r.stderr
        docs[order] = json.loads((tmp_path / f"o{order}" / "chain.partition.json").read_text())
    one, two = docs["1"], docs["2"]
    assert any(t["carries"] == "second" for t in two["transfers"])
    for key in ("sent_bytes", "received_bytes"):
        assert [s[key] for s in two["stage"]] == [s[key] for s in one["stage"]], key
    np.testing.assert_allclose(two["makespan_s"], one["makespan_s"], rtol=0.01)
    graph = json.loads((tmp_path / "o2" / "chain.graph.json").read_text())
    line = next(x for x in partition_report(str(tmp_path / "o2" / "chain"), graph) if "transfers:" in x)
    assert "hvp's own:" in line and line.split("transfers: ")[1].split(" per step")[0] == \
        next(x for x in partition_report(str(tmp_path / "o1" / "chain"), graph) if "transfers:" in x) \
        .split("transfers: ")[1].split(" per step")[0]
    # a fast stage's ops share columns: '*' says so; 11 stages' rows line up
    rows = [{"stage": 10, "op": "F", "microbatch": 0, "start": 0.0, "end": 1e-9},
            {"stage": 10, "op": "B", "microbatch": 0, "start": 1e-9, "end": 2e-9},
            {"stage": 0, "op": "F", "microbatch": 1, "start": 0.0, "end": 1.0}]
    chart = gantt(rows, 11, 1.0)
    assert chart[10].startswith("stage 10 |*") and chart[0].startswith("stage  0 |1111")
    assert len({len(r) for r in chart}) == 1
