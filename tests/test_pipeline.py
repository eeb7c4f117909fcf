"""Pipelines: every schedule and microbatch count gives the one-device gradients; the loss must be a
sum or mean of per-row terms for microbatches, and a loss that mixes rows is refused by name."""
import numpy as np
import pytest

import gradc as gc
from gradc.compiler import compile_model
from gradc.runtime.schedules import SCHEDULES, interleave, stage_orders

from test_memory import _dag, _inputs, _mlp


def _sum_loss_model():
    """A sum over rows (weights 1 per microbatch) with weight decay (to be counted once)."""
    m = gc.Model("sum_loss")
    x = m.input("x", ("B", 5))
    h = gc.tanh(x @ m.param("W0", (5, 7)) + m.param("b0", (7,)))
    h = gc.sigmoid(h @ m.param("W1", (7, 7)))
    m.minimize(0.5 * gc.sum(h * h) + 0.1 * gc.sum(gc.log(1 + h)), weight_decay=0.03)
    return m


@pytest.mark.slow
@pytest.mark.parametrize("make,K", [(_mlp, 2), (_dag, 3), (_sum_loss_model, 2)], ids=["mlp-2", "dag-3", "sum-2"])
def test_every_schedule_and_microbatch_count_gives_the_one_device_gradients(tmp_path, make, K):
    model = make()
    batch = 7   # divides into no microbatch count above 1: the microbatches differ in size
    one = compile_model(model, out=str(tmp_path / "one"), order=1, bind={"B": batch}, warm_cache=False, dtype="float64")
    pipe = compile_model(model, out=str(tmp_path / "pipe"), order=1, bind={"B": batch}, warm_cache=False,
                         dtype="float64", devices=K, schedule="1f1b", microbatches=2)
    assert pipe.INPUTS[next(iter(pipe.INPUTS))][0][0] == "B"   # the code keeps the batch dim symbolic
    rng = np.random.default_rng(11)
    params = one.init_params(3)
    inputs = _inputs(one, batch, rng)
    loss1, grads1 = one.loss_and_grad(params, **inputs)
    for schedule in SCHEDULES:
        for M in (1, 2, 3, 4):
            pipe._PIPELINE.reschedule(schedule, M)
            loss, grads = pipe.loss_and_grad(params, **inputs)
            assert loss == pytest.approx(loss1, rel=0, abs=1e-10), (schedule, M)
            for k in grads1:
                np.testing.assert_allclose(grads[k], grads1[k], rtol=0, atol=1e-10, err_msg=f"{schedule} M={M} {k}")
    pipe._PIPELINE.reschedule("gpipe", 3)
    t1, tp = one.Trainer(params, optimizer="sgd", lr=0.05, momentum=0.9), pipe.Trainer(params, optimizer="sgd", lr=0.05,
                                                                                        momentum=0.9)
    for _ in range(3):
        assert tp.step(**inputs) == pytest.approx(t1.step(**inputs), abs=1e-10)
    for k in params:
        np.testing.assert_allclose(tp.params[k], t1.params[k], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match=f"^{pipe.MODEL_NAME}: a batch of 2 rows cannot make 3 microbatches"):
        pipe.loss_and_grad(params, **{k: v[:2] for k, v in inputs.items()})


def test_schedule_orders_keep_dependencies_and_1f1b_bounds_what_is_in_flight():
    for schedule in SCHEDULES:
        for K in (1, 2, 3, 4):
            for M in (1, 2, 5):
                order = interleave(schedule, K, M)
                assert sorted(order) == sorted((k, op, m) for k in range(K) for op in "FB" for m in range(M))
                done = set()
                for k, op, m in order:
                    if op == "F":
                        assert k == 0 or ("F", k - 1, m) in done
                    else:
                        assert ("F", k, m) in done and (k == K - 1 or ("B", k + 1, m) in done)
                    done.add((op, k, m))
    for k, ops in enumerate(stage_orders("1f1b", 4, 8)):
        held = peak = 0
        for op, _ in ops:
            held += 1 if op == "F" else -1
            peak = max(peak, held)
        assert peak == min(4 - k, 8)


def _rows_model(kind):
    m = gc.Model(f"rows_{kind}")
    x = m.input("x", ("B", 4))
    h = gc.tanh(x @ m.param("W", (4, 4)))
    if kind == "max":
        loss = gc.sum(gc.max(h, axis=0))
    elif kind == "gram":
        loss = gc.mean(h.T @ h)
    elif kind == "square":
        loss = gc.mean(h) * gc.mean(h)
    elif kind == "penalty":   # an L2 term added by hand: it has no rows
        loss = gc.mean(h) + gc.sum(m.param("W2", (4, 4)) ** 2)
    elif kind == "mean_and_sum":
        loss = gc.mean(h) + 0.1 * gc.sum(h * h)
    else:
        loss = gc.mean(h - gc.mean(h, axis=0, keepdims=True))
    m.minimize(loss)
    return m


@pytest.mark.parametrize("kind,why", [("max", "takes a max over rows"), ("gram", "multiplies along the batch dim"),
                                      ("square", "not linear in the loss reduced over rows"),
                                      ("penalty", "combines the loss reduced over rows with a value without batch "
                                                  r"rows .* \(an L2 penalty goes in minimize\(..., weight_decay=\)"),
                                      ("center", "mixes a value reduced over rows with other batch values"),
                                      ("mean_and_sum", "adds a mean over the batch rows to a sum over them: .*\\(write "
                                                       "both terms as means or both as sums")])
def test_a_loss_that_mixes_rows_is_refused_for_microbatches(tmp_path, kind, why):
    model = _rows_model(kind)
    with pytest.raises(gc.GradcError, match=rf"--microbatches 2: .*({why}).*microbatches \(or data-parallel shards\) would not give") as e:
        compile_model(model, out=str(tmp_path / "out"), order=1, warm_cache=False, microbatches=2)
    assert "test_pipeline.py:" in str(e.value)
    assert not (tmp_path / "out").exists()
    compile_model(model, out=str(tmp_path / "one"), order=1, warm_cache=False)   # one batch is fine


def test_more_microbatches_than_the_warm_up_rows_compile_and_a_bound_batch_too_small_is_refused(tmp_path):
    """The warm-up's synthetic batch splits into M microbatches whatever M is (it had 3 rows, so
    --microbatches 4 failed to compile); a batch dim bound to fewer rows than M is refused by name."""
    m = _mlp()
    mod = compile_model(m, out=str(tmp_path / "m8"), order=1, dtype="float64", microbatches=8)
    one = compile_model(m, out=str(tmp_path / "one"), order=1, dtype="float64", warm_cache=False)
    params = one.init_params(0)
    inputs = _inputs(one, 11, np.random.default_rng(1))
    loss, grads = mod.loss_and_grad(params, **inputs)
    loss1, grads1 = one.loss_and_grad(params, **inputs)
    assert loss == pytest.approx(loss1, abs=1e-10)
    for k in grads1:
        np.testing.assert_allclose(grads[k], grads1[k], rtol=0, atol=1e-10)
    with pytest.raises(gc.GradcError, match=r"--microbatches 8: the batch dim B is bound to 4 rows"):
        compile_model(m, out=str(tmp_path / "bad"), order=1, microbatches=8, bind={"B": 4})
    assert not (tmp_path / "bad").exists()
