"""Bad input: one clear error naming the user's file:line, the op, and the names and shapes involved."""
import os

import numpy as np
import pytest
import sympy as sp

import gradc as gc
from gradc import GradcError
from gradc.runtime import arena, host_memory

HERE = os.path.basename(__file__)


def _line_of(marker):
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def test_shape_mismatch_names_file_line_op_and_shapes():
    m = gc.Model("e1")
    x = m.input("x", ("B", 64))
    w = m.param("W", (32, 10))
    with pytest.raises(GradcError) as e:
        x @ w   # MARK-matmul
    msg = str(e.value)
    assert f"{HERE}:{_line_of('MARK-matmul')}" in msg and "matmul" in msg and "(B, 64)" in msg and "(32, 10)" in msg
    with pytest.raises(GradcError, match=r"add: shapes \(B, 64\) and \(63,\) do not broadcast.*'x'"):
        x + m.param("b", (63,))
    with pytest.raises(GradcError, match="do not broadcast"):
        x + m.input("z", ("C", 64))          # a symbolic dim only matches the same name
    with pytest.raises(GradcError, match="do not broadcast"):
        x * m.input("q", (5, 64))            # ... and never equals an int


@pytest.mark.parametrize("build,match", [
    (lambda m, x: x.sum(axis=2), "sum: axis 2 is out of range"),
    (lambda m, x: x.mean(axis=(0, 0)), "repeats an axis"),
    (lambda m, x: x.sum(axis=1.0), r"sum: axis 1.0 is not an int or a tuple of ints \(operand shape \(B, 4\)\)"),
    (lambda m, x: gc.transpose(x, (0, 0)), "not a permutation"),
    (lambda m, x: x.reshape((5, 7)), "cannot reshape"),
    (lambda m, x: gc.softmax(x, axis=3), "softmax: axis 3 is out of range"),
    (lambda m, x: gc.mse(x, m.input("t", ("B", 3))), r"mse: pred \(B, 4\) and target \(B, 3\)"),
    (lambda m, x: gc.softmax_cross_entropy(x, m.input("y", ("C",), dtype="int64")), r"logits \(B, 4\) need labels of shape \(B,\), got \(C,\)"),
    (lambda m, x: gc.softmax_cross_entropy(x, m.input("y3", ("B", 4), dtype="int64")),
     r"needs logits \(N, C\) and labels \(N,\), or \(\.\.\., C\) and \(\.\.\.\), got \(B, 4\) and \(B, 4\)"),
    (lambda m, x: gc.softmax_cross_entropy(x, m.input("y2", ("B",))), "labels must be an int input"),
    # float targets shaped like the logits: one-hot or soft labels, which take log_softmax (trial P)
    (lambda m, x: gc.softmax_cross_entropy(x, m.input("t4", ("B", 4))),
     r"got \(B, 4\) and \(B, 4\); labels are int class indices .* gc\.log_softmax\(logits, axis=-1\)"),
    (lambda m, x: gc.exp(m.input("i", ("B",), dtype="int64")), "elementwise ops take float operands"),
    (lambda m, x: gc.matmul(m.input("x3", ("B", 2, 4)), m.param("w3", (3, 4, 2))), r"batch dims \(B,\) and \(3,\)"),
    (lambda m, x: x + "text", "cannot use a str as a tensor"),
    # an index of a named value is named as written, not "%5 (reshape)"
    (lambda m, x: gc.exp(m.input("ii", ("B", 2), dtype="int64")[:, 1]), r"\(operands: %\d+ ii\[:, 1\] \(B,\) int64\)"),
    (lambda m, x: x[:, 0:3] @ x[..., ::2], r"\(operands: %\d+ x\[:, 0:3\] \(B, 3\) float, %\d+ x\[..., ::2\] \(B, 2\)"),
    (lambda m, x: x + gc.Model("other").input("x", (4,)), "'x' is a tensor of model 'other', used in model 'e2'"),
])
def test_op_errors(build, match):
    m = gc.Model("e2")
    x = m.input("x", ("B", 4))
    with pytest.raises(GradcError, match=match) as e:
        build(m, x)
    assert os.path.basename(e.value.src).startswith(HERE + ":")


def test_unknown_op_is_refused():
    from gradc.ir import Graph
    with pytest.raises(GradcError, match="unknown op 'conv9d'"):
        Graph("g").apply("conv9d", [])


def test_declaration_errors():
    m = gc.Model("e3")
    m.input("x", (3,))
    with pytest.raises(GradcError, match="duplicate name 'x'"):
        m.param("x", (3,))
    with pytest.raises(GradcError, match="unknown dtype 'float16'"):
        m.input("h", (3,), dtype="float16")
    with pytest.raises(GradcError, match="unknown init 'xavier'"):
        m.param("w", (3, 3), init="xavier")
    with pytest.raises(GradcError, match="init array has shape"):
        m.param("w", (3, 3), init=np.zeros((2, 2)))
    with pytest.raises(GradcError, match="symbolic dim"):
        m.param("w", ("B", 3))
    with pytest.raises(GradcError, match="not a Python identifier"):
        m.input("bad name", (3,))
    with pytest.raises(GradcError, match="not a Python identifier"):
        gc.Model("1model")
    with pytest.raises(GradcError, match="param name 'class' is a Python keyword: pick another name"):
        m.param("class", (3,))
    assert m.graph.op(abs(m.input("a", (3,))).node) == "abs"   # Python's abs() is gc.abs
    with pytest.raises(GradcError, match=r"test_errors.py:\d+: log takes one operand, got 2: for a log to base b "
                                         r"write gc.log\(x\) / math.log\(b\)"):
        gc.log(m.input("l", (3,)), 2)   # (math.log's base: trial V)
    t3 = m.input("t3", (2, 3, 4))   # PyTorch's spellings name gradc's (trial X)
    with pytest.raises(GradcError, match=r"test_errors.py:\d+: a Tensor has no .transpose \(PyTorch's\): write "
                                         r"gc.transpose\(x, axes\), every axis in its new place"):
        t3.transpose((0, 2, 1))
    with pytest.raises(GradcError, match=r"sum\(\) got an unexpected keyword 'keepdim': write keepdims="):
        t3.sum(axis=1, keepdim=True)
    with pytest.raises(GradcError, match=r"mean\(\) got an unexpected keyword 'out' \(it takes axis, keepdims\)$"):
        t3.mean(out=None)
    with pytest.raises(GradcError, match=r"softmax\(\) got an unexpected keyword 'dim': write axis="):
        gc.softmax(t3, dim=1)
    with pytest.raises(GradcError, match=r"a Tensor has no .amax \(PyTorch's\): write x.max\(axis, keepdims\)"):
        t3.amax(1)
    with pytest.raises(GradcError, match=r"test_errors.py:\d+: param\(\) got an unexpected keyword 'decays': "
                                         r"did you mean 'decay'\?"):
        m.param("pd", (3,), decays=False)
    with pytest.raises(GradcError, match=r"minimize\(\) got an unexpected keyword 'weightdecay': did you mean "
                                         r"'weight_decay'\?"):
        m.minimize(t3.sum(), weightdecay=0.1)
    with pytest.raises(GradcError, match=r"input\(\) got an unexpected keyword 'shape2' \(it takes dtype\)"):
        m.input("i2", (3,), shape2=(3,))
    assert not hasattr(t3, "size") and not hasattr(t3, "exp")   # (probes see an AttributeError)
    t = m.input("t", (3,))
    m.output("o", t)
    with pytest.raises(GradcError, match="duplicate output name 'o'"):
        m.output("o", t)
    with pytest.raises(GradcError, match="reserved"):
        m.output("loss", t)
    for constant in (3.0, np.ones(3)):   # an output that could never change is a slip
        with pytest.raises(GradcError, match=r"output 'c': got a (float|ndarray), not a Tensor of the model"):
            m.output("c", constant)
    assert "c" not in m.graph.outputs


def test_loss_errors():
    m = gc.Model("e4")
    x = m.input("x", ("B", 3))
    with pytest.raises(GradcError, match=r"the loss must be a scalar, got shape \(B, 3\)"):
        m.minimize(x * 2)
    with pytest.raises(GradcError, match="weight_decay"):
        m.minimize(x.sum(), weight_decay=-1)
    m.minimize(x.sum())
    with pytest.raises(GradcError, match="already called"):
        m.minimize(x.sum())


def test_model_without_minimize_is_refused(tmp_path):
    m = gc.Model("e5")
    m.output("o", m.input("x", (3,)) * 2)
    with pytest.raises(GradcError, match="has no minimize"):
        gc.compile(m, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_elementwise_definition_errors():
    with pytest.raises(GradcError, match="fixed number of positional operands"):
        gc.elementwise("e_var", lambda *u: u[0])
    with pytest.raises(GradcError, match="sympy cannot differentiate"):
        gc.elementwise("e_floor", lambda u: sp.floor(u))
    with pytest.raises(GradcError, match="sympy cannot differentiate"):
        gc.elementwise("e_undef", lambda u: sp.Function("f")(u))
    with pytest.raises(GradcError, match="not operands"):
        gc.elementwise("e_stray", lambda u: u * sp.Symbol("k"))
    with pytest.raises(GradcError, match="taken by a built-in op"):
        gc.elementwise("tanh", lambda u: u)
    with pytest.raises(GradcError, match="fn failed on sympy symbols"):
        gc.elementwise("e_fail", lambda u: 1 / 0)
    with pytest.raises(GradcError, match=r"test_errors\.py:\d+: .*'e_complex'.*the imaginary unit I"):
        gc.elementwise("e_complex", lambda u: sp.I * u + u ** 2)
    with pytest.raises(GradcError, match=r"'e_partial'.*Piecewise without a last \(value, True\) clause"):
        gc.elementwise("e_partial", lambda u: sp.Piecewise((u, u > 0)))
    with pytest.raises(GradcError, match=r"'e_contains'.*unsupported: Contains in a Piecewise condition"):
        gc.elementwise("e_contains", lambda u: sp.Piecewise((u, sp.Contains(u, sp.Interval(0, 1))), (0, True)))
    two = gc.elementwise("e_two", lambda a, b: a * b)
    m = gc.Model("e6")
    x = m.input("x", (3,))
    with pytest.raises(GradcError, match="e_two: takes 2 operands, got 1"):
        two(x)
    with pytest.raises(GradcError, match="another elementwise op"):
        gc.elementwise("e_two", lambda a, b: a + b)


def test_compile_option_errors(tmp_path):
    m = gc.Model("e7")
    x = m.input("x", ("B", 3))
    m.minimize(x.sum())
    out = str(tmp_path / "o")
    with pytest.raises(GradcError, match="--bind names dim N"):
        gc.compile(m, out=out, bind={"N": 4})
    with pytest.raises(GradcError, match="unknown dtype"):
        gc.compile(m, out=out, dtype="float16")
    with pytest.raises(GradcError, match="--order 3: use 1"):
        gc.compile(m, out=out, order=3)
    with pytest.raises(GradcError, match="--memory-budget"):
        gc.compile(m, out=out, memory_budget=1000)
    with pytest.raises(GradcError, match="--devices"):
        gc.compile(m, out=out, devices=2)
    assert not os.path.exists(out)


# ---- run time ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    m = gc.Model("e_small")
    x = m.input("x", ("B", 3))
    y = m.input("y", ("B",), dtype="int64")
    w = m.param("w", (3, 4))
    logits = gc.log(x) @ w           # NaN for negative x: lets a test provoke a NaN loss
    m.output("logits", logits)
    m.minimize(gc.softmax_cross_entropy(logits, y))
    return gc.compile(m, out=str(tmp_path_factory.mktemp("err")), warm_cache=False)


def _xy(n=4):
    return np.full((n, 3), 1.5, np.float32), np.arange(n) % 4


def test_runtime_input_errors(small):
    p = small.init_params(0)
    x, y = _xy()
    with pytest.raises(ValueError, match="missing input 'y'"):
        small.loss_and_grad(p, x=x)
    with pytest.raises(ValueError, match="unknown input 'z'"):
        small.loss_and_grad(p, x=x, y=y, z=x)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(4, 2\), expected \(B, 3\)"):
        small.loss_and_grad(p, x=x[:, :2].copy(), y=y)
    with pytest.raises(ValueError, match=r"input 'x' has dtype float64, expected float32 \(gradc never casts"):
        small.loss_and_grad(p, x=x.astype(np.float64), y=y)
    with pytest.raises(ValueError, match=r"has dtype float64, expected float32 \(a list becomes a float64 array: "
                                         r"pass np.asarray\(\.\.\., dtype=float32\)\)"):
        small.loss_and_grad(p, x=x.tolist(), y=y)
    with pytest.raises(ValueError, match="input 'y' has dtype int32, expected int64"):
        small.loss_and_grad(p, x=x, y=y.astype(np.int32))
    with pytest.raises(ValueError, match=r"input 'x' has shape \(0, 3\): dim B is 0; it must be at least 1"):
        small.loss_and_grad(p, x=x[:0], y=y[:0])
    with pytest.raises(ValueError, match="dim B is 0"):
        small.Trainer(p).step(x=x[:0], y=y[:0])
    with pytest.raises(ValueError, match=r"dim B is 4 in input 'x' \(4, 3\), declared \(B, 3\), and 3 in input 'y' "
                                         r"\(3,\), declared \(B,\): one of them has its axes in another order"):
        small.loss_and_grad(p, x=x, y=y[:3])
    with pytest.raises(ValueError, match=r"holds 4 at \[3\], outside 0..3"):
        small.loss_and_grad(p, x=x, y=np.array([0, 1, 2, 4]))
    with pytest.raises(ValueError, match=r"holds -1 at \[1\], outside 0..3"):
        small.forward(p, x=x, y=np.array([0, -1, 2, 3]))
    with pytest.raises(ValueError, match=r"params missing \['w'\]"):
        small.loss_and_grad({}, x=x, y=y)
    with pytest.raises(ValueError, match=r"param 'w' has shape \(4, 3\), expected \(3, 4\)"):
        small.loss_and_grad({"w": np.zeros((4, 3), np.float32)}, x=x, y=y)
    with pytest.raises(ValueError, match="param 'w' has dtype float64"):
        small.loss_and_grad({"w": np.zeros((3, 4))}, x=x, y=y)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        small.Trainer(p, lr=-1.0)
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        small.Trainer(p, optimizer="rmsprop")


def test_a_dim_twice_in_one_input_names_both_sizes(tmp_path):
    m = gc.Model("square_input")
    a = m.input("A", ("N", "N"))
    m.minimize((a @ a).sum() * m.param("s", ()))
    mod = gc.compile(m, out=str(tmp_path), order=1, warm_cache=False)
    with pytest.raises(ValueError, match=r"input 'A' has shape \(3, 2\), expected \(N, N\): dim N is 3 on one axis "
                                         r"and 2 on another"):
        mod.loss_and_grad(mod.init_params(0), A=np.ones((3, 2), np.float32))


def test_nan_loss_raises_with_step_number_and_keeps_params(small):
    tr = small.Trainer(small.init_params(0), optimizer="adam", lr=0.1)
    x, y = _xy()
    tr.step(x=x, y=y)
    tr.step(x=x, y=y)
    before = {k: v.copy() for k, v in tr.params.items()}
    state = {k: v.copy() for k, v in tr.state.items()}
    with pytest.raises(FloatingPointError, match=r"Trainer.step 3: the loss is nan"):
        tr.step(x=-x, y=y)
    assert tr.steps == 2
    for k in before:
        np.testing.assert_array_equal(tr.params[k], before[k])
    for k in state:
        np.testing.assert_array_equal(tr.state[k], state[k])
    tr.step(x=x, y=y)   # and training goes on
    bad = x.copy()   # a NaN in a batch is named (a trial's was named nowhere)
    bad[1, 0] = np.nan
    with pytest.raises(FloatingPointError, match=r"Trainer.step 4: the loss is nan \(input 'x' holds nan at \[1, 0\], "
                                                 r"1 non-finite value\(s\) in all\)"):
        tr.step(x=bad, y=y)
    assert tr.steps == 3


def test_a_param_assigned_into_the_trainer_is_adopted_and_a_wrong_one_refused(small, rng, tmp_path):
    """tr.params holds the trainer's own buffers; an array assigned there replaces their values (and a step
    trains from them), while a wrong array, a missing or an unknown name is refused, by a step and by
    save, before anything changes: the checkpoint on disk stays the good one, and tr.params holds the
    trainer's own array again, so the next call works."""
    tr = small.Trainer(small.init_params(0), lr=0.1)
    x, y = rng.uniform(0.5, 2.0, (4, 3)).astype(np.float32), rng.integers(0, 4, 4)
    mine = rng.standard_normal((3, 4)).astype(np.float32)
    tr.params["w"] = mine
    loss, grads = small.loss_and_grad({"w": mine}, x=x, y=y)
    assert tr.step(x=x, y=y) == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(tr.params["w"], mine - np.float32(0.1) * grads["w"], rtol=1e-6)
    assert tr.params["w"] is not mine and np.shares_memory(tr.params["w"], tr._flat)
    before = tr.params["w"].copy()
    path = tmp_path / "ckpt.npz"
    tr.save(path)
    saved = path.read_bytes()
    for wrong, message in ((np.zeros((4, 3), np.float32), r"params\['w'\] must stay a float32 array of shape \(3, 4\), "
                            r"got a float32 array of shape \(4, 3\)"),
                           (np.zeros((3, 4)), r"params\['w'\] must stay a float32 .* got a float64 array"),
                           ([[0.0] * 4] * 3, r"params\['w'\] must stay .* got a list"),
                           (None, r"params \['w'\] were missing \(they hold the trainer's own values again\)")):
        for call in (lambda: tr.step(x=x, y=y), lambda: tr.save(path)):   # a checkpoint is never written with it
            if wrong is None:
                del tr.params["w"]
            else:
                tr.params["w"] = wrong
            with pytest.raises(ValueError, match=message):
                call()
            assert np.shares_memory(tr.params["w"], tr._flat)   # the trainer's own array again, unchanged
            np.testing.assert_array_equal(tr.params["w"], before)
    for call in (lambda: tr.step(x=x, y=y), lambda: tr.save(path)):
        tr.params["v"] = np.zeros(3, np.float32)   # removed at the refusal, so the next call works (a new-user trial)
        with pytest.raises(ValueError, match=r"params \['v'\] are not the model's \(removed; its params are \['w'\]\)"):
            call()
        assert "v" not in tr.params
    with pytest.raises(AttributeError, match=r"assign into tr.params\[name\] .*, not tr.params itself"):
        tr.params = {}
    assert tr.steps == 1 and path.read_bytes() == saved
    np.testing.assert_array_equal(tr.params["w"], before)
    np.testing.assert_array_equal(small.Trainer.load(path).params["w"], before)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_update_that_overflows_changes_nothing(small, optimizer):
    """lr = 1e38 is a float32 number, but p - lr * g overflows: the step is refused as a whole."""
    tr = small.Trainer(small.init_params(0), optimizer=optimizer, lr=0.1)
    x, y = _xy()
    tr.step(x=x, y=y)
    tr.lr = 3e38   # a float32 number; lr times a step of more than about 1.2 is not
    if optimizer == "sgd":
        tr.momentum, tr.state["momentum"][...] = 0.9, 10.0
    else:   # Adam's step is about lr per value: a tiny second moment makes it larger
        tr.state["v"][...] = 0.0
        tr.eps = 1e-30
    before = {k: v.copy() for k, v in tr.params.items()}
    state = {k: v.copy() for k, v in tr.state.items()}
    with pytest.raises(FloatingPointError, match=r"Trainer.step 2: the update overflows float32 in \d+ value"):
        tr.step(x=x, y=y)
    assert tr.steps == 1
    for k in before:
        np.testing.assert_array_equal(tr.params[k], before[k])
        assert np.isfinite(tr.params[k]).all()
    for k in state:
        np.testing.assert_array_equal(tr.state[k], state[k])
    tr.lr, tr.eps = 0.1, 1e-8
    tr.step(x=x, y=y)   # and training goes on
    assert tr.steps == 2


def test_hyperparameters_the_dtype_cannot_hold_are_refused(small):
    p = small.init_params(0)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0 in float32, got 1e\\+39"):
        small.Trainer(p, lr=1e39)
    with pytest.raises(ValueError, match="eps must be a finite number > 0 in float32"):
        small.Trainer(p, optimizer="adam", eps=1e-50)   # 0 in float32
    with pytest.raises(ValueError, match=r"betas\[1\] must be a number in \[0, 1\) in float32, got 0.999999999, "
                                         r"which float32 rounds to 1$"):
        small.Trainer(p, optimizer="adam", betas=(0.9, 0.999999999))   # rounds to 1 in float32
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\) in float32, got 1.5$"):
        small.Trainer(p, momentum=1.5)
    tr = small.Trainer(p, lr=0.1)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        tr.lr = 1e39           # checked when set, not only at construction
    with pytest.raises(ValueError, match="clip_norm must be a finite number > 0"):
        tr.clip_norm = float("inf")
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\)"):
        tr.momentum = 1.0
    assert tr.lr == 0.1


def test_hyperparameters_take_numpy_numbers_and_lr_zero_and_are_never_deleted(small):
    """A schedule may hand over np.float32 values and warm up from lr=0; a bool is a mistake; deleting a setting or
    the training state would lose it."""
    p = small.init_params(0)
    rng = np.random.default_rng(3)
    x, y = rng.uniform(0.5, 2.0, (5, 3)).astype(np.float32), rng.integers(0, 4, 5)
    tr = small.Trainer(p, optimizer="adam", lr=np.float32(0.0), betas=(np.float32(0.9), np.float64(0.999)),
                       eps=np.float32(1e-6))
    assert type(tr.lr) is float and tr.lr == 0.0 and tr.eps == float(np.float32(1e-6))
    tr.step(x=x, y=y)
    np.testing.assert_array_equal(tr.params["w"], p["w"])   # lr 0: the moments move, the params do not
    assert np.abs(tr.state["m"]).max() > 0
    tr.lr = np.float32(0.1)
    tr.step(x=x, y=y)
    assert np.abs(tr.params["w"] - p["w"]).max() > 0
    for bad in (True, np.bool_(True), "0.1", None, np.float64(-0.5), np.float32("nan")):
        with pytest.raises(ValueError, match=r"lr must be a finite number >= 0 in float32, got "):
            tr.lr = bad
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0 in float32, got 0.0"):
        tr.eps = 0.0
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\) in float32, got True"):
        small.Trainer(p, momentum=True)
    for name in ("lr", "eps", "params", "steps", "state"):
        with pytest.raises(AttributeError, match=f"e_small.Trainer: {name} cannot be deleted"):
            delattr(tr, name)
    assert tr.lr == float(np.float32(0.1)) and tr.steps == 2
    for bad in (-1, 2.0, True, "3", None):   # Adam's bias correction reads it
        with pytest.raises(ValueError, match=r"steps must be an int >= 0, got "):
            tr.steps = bad
    tr.step(x=x, y=y)
    tr.steps = np.int64(10)   # a resume by hand: the next step is Adam's 11th
    assert type(tr.steps) is int and tr.steps == 10
    tr.step(x=x, y=y)
    assert tr.steps == 11


def test_optimizer_state_buffers_cannot_be_replaced(small, tmp_path):
    """tr.state["momentum"] = np.zeros(P - 1) was taken: the update loop read and wrote past its end, and
    the next save replaced a good checkpoint with one that load refuses. The buffers can only be written
    in place."""
    p = small.init_params(0)
    rng = np.random.default_rng(3)
    x, y = rng.uniform(0.5, 2.0, (5, 3)).astype(np.float32), rng.integers(0, 4, 5)
    for optimizer, slot in (("sgd", "momentum"), ("adam", "v")):
        tr = small.Trainer(p, optimizer=optimizer, lr=0.1, **({"momentum": 0.9} if optimizer == "sgd" else {}))
        tr.step(x=x, y=y)
        tr.save(str(tmp_path / "good.npz"))
        own = tr.state[slot]
        for bad in (np.zeros(own.size - 1, own.dtype), np.zeros(3), own.copy()):
            with pytest.raises(TypeError, match=rf"tr.state\['{slot}'\] is the optimizer's own buffer: write its "
                                                rf"values in place"):
                tr.state[slot] = bad
        with pytest.raises(TypeError, match="cannot be deleted"):
            del tr.state[slot]
        with pytest.raises(AttributeError, match="tr.state holds the optimizer's own buffers"):
            tr.state = {}
        assert tr.state[slot] is own and set(tr.state) == ({"momentum"} if optimizer == "sgd" else {"m", "v"})
        tr.state[slot][...] = 0.5   # in place: taken, and saved
        tr.save(str(tmp_path / "edited.npz"))
        back = small.Trainer.load(str(tmp_path / "edited.npz"))
        assert (back.state[slot] == 0.5).all() and back.steps == 1
        assert small.Trainer.load(str(tmp_path / "good.npz")).steps == 1


def test_an_int_seed_of_the_wrong_kind_is_explained(tmp_path):
    """2**63 for an int64 seed was told to pass np.asarray(..., dtype=int64), which overflows; a numpy
    int32 was "an int32 that becomes an int32 array"."""
    m = gc.Model("e_seeded")
    x, s = m.input("x", ("B", 3)), m.input("seed", (), dtype="int64")
    m.minimize(gc.dropout(x @ m.param("W", (3, 2)), 0.5, s).mean())
    mod = gc.compile(m, out=str(tmp_path), warm_cache=False)
    p, x = mod.init_params(0), np.ones((2, 3), np.float32)
    for seed, why in ((2**63, r"has dtype uint64, expected int64 \(9223372036854775808 is outside int64's range\)"),
                      (np.int32(3), r"has dtype int32, expected int64 \(a numpy int32 scalar: pass np.asarray\("),
                      (np.uint64(3), r"has dtype uint64, expected int64 \(a numpy uint64 scalar"),
                      (True, r"has dtype bool, expected int64 \(a bool becomes a bool array"),   # (was "a numpy bool")
                      (np.bool_(True), r"has dtype bool, expected int64 \(a numpy bool scalar"),
                      (np.array(3, ">i8"), r"has dtype >i8, expected int64 \(the same type with its bytes in the other "
                                           r"order: pass np.asarray\(\.\.\., dtype=int64\)\)")):
        with pytest.raises(ValueError, match=rf"input 'seed' {why}"):
            mod.loss_and_grad(p, x=x, seed=seed)
    assert np.isfinite(mod.loss_and_grad(p, x=x, seed=2**63 - 1)[0])


def test_second_order_entries_check_the_inputs_when_the_hessian_reads_none(tmp_path):
    """The Hessian of (x @ W).mean() + ||W||^2 reads no input: hvp and hessian took no x at all, an int x of
    another shape, or a str, and answered. They check what loss_and_grad checks."""
    m = gc.Model("e_hconst")
    x, W = m.input("x", ("B", 3)), m.param("W", (3, 2))
    m.minimize((x @ W).mean() + (W * W).sum())
    mod = gc.compile(m, out=str(tmp_path), order=2, warm_cache=False)
    p = mod.init_params(0)
    v = {k: np.ones_like(a) for k, a in p.items()}
    for call, entry in ((lambda **a: mod.hvp(p, v, **a), "hvp"), (lambda **a: mod.hessian(p, **a), "hessian"),
                        (lambda **a: mod.hessian_rows(p, 0, 2, **a), "hessian_rows")):
        with pytest.raises(ValueError, match=rf"e_hconst.{entry}: missing input 'x'"):
            call()
        with pytest.raises(ValueError, match=rf"e_hconst.{entry}: input 'x' has dtype int64, expected float32"):
            call(x=np.ones((7, 9), np.int64))
        with pytest.raises(ValueError, match=rf"e_hconst.{entry}: input 'x' has shape \(7, 9\)"):
            call(x=np.ones((7, 9), np.float32))
    np.testing.assert_array_equal(mod.hvp(p, v, x=np.ones((2, 3), np.float32))["W"], 2 * v["W"])


def test_a_step_on_non_finite_params_says_they_are(small):
    """After tr.params["w"] = NaN every step said the params were "left as they were before this step"."""
    tr = small.Trainer(small.init_params(0))
    x, y = _xy()
    tr.params["w"] = np.full((3, 4), np.nan, np.float32)
    for _ in range(2):
        with pytest.raises(FloatingPointError, match=r"step 1: the loss is nan \(params 'w' hold non-finite "
                                                     r"values already: assign finite ones into tr.params, or load a "
                                                     r"checkpoint\); parameters and optimizer state are left as they"):
            tr.step(x=x, y=y)
    tr.params["w"] = np.ones((3, 4), np.float32)
    assert np.isfinite(tr.step(x=x, y=y)) and tr.steps == 1


def test_save_errors_name_the_users_path(small, tmp_path):
    """Saving to a folder's path raised IsADirectoryError about a temp file made in the parent; a folder
    that takes no files named the temp file, which the user never sees."""
    tr = small.Trainer(small.init_params(0))
    with pytest.raises(IsADirectoryError, match=f"{tmp_path}: is a folder; save takes a file's path"):
        tr.save(str(tmp_path))
    assert list(tmp_path.parent.glob(".ckpt-*")) == []
    with pytest.raises(OSError, match=r"/proc/ckpt.npz: cannot write the checkpoint: "):   # not even root may
        tr.save("/proc/ckpt.npz")


def test_a_strided_input_too_large_to_copy_names_itself(small, monkeypatch):
    """A strided view (here a broadcast) is copied to C order before the call; numpy's MemoryError for that copy
    named no input (a new user's (10**8, 64) broadcast)."""
    x, p = np.broadcast_to(np.float32([1.5, 2.0, 0.5]), (8, 3)), small.init_params(0)

    def refuse(a, *args, **kwargs):
        raise MemoryError("Unable to allocate")
    monkeypatch.setattr(np, "ascontiguousarray", refuse)
    with pytest.raises(MemoryError, match=r"e_small.loss_and_grad: input 'x' \(8, 3\) is a strided view \(a transpose, "
                                          r"a step, a broadcast\), copied to C order first, which needs 0\.00 GiB"):
        small.loss_and_grad(p, x=x, y=np.arange(8) % 4)


def test_checkpoint_paths_a_user_may_give(small, tmp_path):
    """bytes paths work like str ones; an empty path and a file object get gradc's message (they gave a regex
    TypeError, an IsADirectoryError for '', and os.fspath's TypeError)."""
    import io
    tr = small.Trainer(small.init_params(0))
    tr.save(os.fsencode(tmp_path / "b.npz"))
    assert small.Trainer.load(os.fsencode(tmp_path / "b.npz")).steps == 0
    with pytest.raises(ValueError, match=r"e_small.Trainer.save: the path is empty"):
        tr.save("")
    with pytest.raises(TypeError, match=r"e_small.Trainer.load: a checkpoint's path is a str or os.PathLike .* got "
                                        r"BytesIO"):
        small.Trainer.load(io.BytesIO())


def test_intermediates_larger_than_the_free_memory_raise_memory_error_before_allocating(small, monkeypatch):
    """Linux hands out more than it has and the OOM killer ends the process when the pages are touched: the
    arena compares what an entry needs with what the system has first."""
    rng = np.random.default_rng(5)
    x, y = rng.uniform(0.5, 2.0, (20000, 3)).astype(np.float32), rng.integers(0, 4, 20000)
    p = small.init_params(0)
    monkeypatch.setattr(arena, "available_bytes", lambda: 2**16)   # 64 KiB free
    with pytest.raises(MemoryError, match=r"loss_and_grad's intermediates at B=20000 need 0\.\d\d GiB, but only "
                                          r"0\.00 GiB of memory is available"):
        small.loss_and_grad(p, x=x, y=y)
    with pytest.raises(MemoryError, match=r"e_small.lr_grad: samples=64 runs 64 perturbed copies of the batch at "
                                          r"once, which do not fit in memory \(lr_grad's intermediates at B=20000, "
                                          r".*\): give fewer samples"):
        small.lr_grad(p, samples=64, x=x, y=y)
    with pytest.raises(MemoryError, match=r"^forward \(with the loss\)'s intermediates at B=20000"):
        small.forward(p, x=x, y=y)   # (its compiled function is _forward_loss: the message named that)
    monkeypatch.setattr(arena, "available_bytes", lambda: None)      # a system that does not say: no check
    loss, _ = small.loss_and_grad(p, x=x, y=y)
    assert np.isfinite(loss)
    # the copies' own leaves (a sign per copy and row) come before the arena: they are checked first (a new-user
    # trial's samples=10**9 was killed by the OOM killer); in the Trainer too, which had numpy's bare error
    huge = r"e_small.lr_grad: samples=1000000000000 runs 1000000000000 perturbed copies of the batch at once, " \
           r"whose noise signs alone need [\d.]+ GiB, but only [\d.]+ GiB of memory is available: give fewer samples$"
    with pytest.raises(MemoryError, match=huge):
        small.lr_grad(p, samples=10**12, x=x[:5], y=y[:5])
    with pytest.raises(MemoryError, match=huge):
        small.Trainer(p, gradient="lr", samples=10**12).step(x=x[:5], y=y[:5])


def test_available_memory_is_the_smaller_of_the_systems_and_the_cgroups(tmp_path, monkeypatch):
    free = host_memory.available_bytes()
    assert free is None or 0 < free < 2**50
    limit, usage, stat = tmp_path / "limit", tmp_path / "usage", tmp_path / "stat"
    usage.write_text("300\n")
    for written, headroom in (("max\n", None), (f"{2**63 - 4096}\n", None), ("1000\n", 700), ("200\n", 0)):
        limit.write_text(written)
        assert host_memory._cgroup_headroom(limit, usage, stat, "inactive_file") == headroom   # (no stat file)
    assert host_memory._cgroup_headroom(tmp_path / "absent", usage, stat, "inactive_file") is None
    limit.write_text("1000\n")
    stat.write_text("active_file 50\ninactive_file 120\nanon 100\n")   # the cache it gives back is not used
    assert host_memory._cgroup_headroom(limit, usage, stat, "inactive_file") == 820
    monkeypatch.setattr(host_memory, "CGROUP_LIMITS", ((limit, usage, stat, "inactive_file"),))
    assert host_memory.available_bytes() == 820


def test_a_hyperparameter_the_optimizer_does_not_use_is_refused(small):
    """Adam has no momentum and SGD no betas or eps: given, they would be ignored without a word."""
    p = small.init_params(0)
    with pytest.raises(ValueError, match=r"Trainer: momentum=0.9 is not a hyperparameter of 'adam' \(adam: lr, betas, eps\)"):
        small.Trainer(p, optimizer="adam", lr=0.01, momentum=0.9)
    with pytest.raises(ValueError, match=r"Trainer: betas=\(0.5, 0.9\) is not a hyperparameter of 'sgd'"):
        small.Trainer(p, optimizer="sgd", betas=[0.5, 0.9])
    with pytest.raises(ValueError, match=r"Trainer: eps=0.001 is not a hyperparameter of 'sgd'"):
        small.Trainer(p, eps=1e-3)
    small.Trainer(p, optimizer="adam", lr=0.01, betas=(0.5, 0.9), eps=1e-6)   # each optimizer's own are fine
    tr = small.Trainer(p, optimizer="sgd", lr=0.01, momentum=0.9)
    with pytest.raises(ValueError, match=r"Trainer: eps=0.001 is not a hyperparameter of 'sgd' \(sgd: lr, momentum\)"):
        tr.eps = 1e-3   # set later too
    adam = small.Trainer(p, optimizer="adam")
    with pytest.raises(ValueError, match=r"Trainer: momentum=0.9 is not a hyperparameter of 'adam'"):
        adam.momentum = 0.9
    adam.momentum = 0.0   # the value it runs with
    with pytest.raises(AttributeError, match=r"Trainer: the optimizer is chosen when the Trainer is made"):
        adam.optimizer = "sgd"
    assert (tr.eps, adam.momentum, adam.optimizer) == (1e-8, 0.0, "adam")
    # PyTorch's optimizers take a weight decay: gradc's is the model's (trial Y)
    with pytest.raises(ValueError, match=r"Trainer: weight decay is part of the model's objective: m.minimize\(loss, "
                                         r"weight_decay=...\)"):
        small.Trainer(p, weight_decay=1e-4)
    with pytest.raises(AttributeError, match=r"Trainer: weight decay is part of the model's objective"):
        tr.weight_decay = 1e-4


def test_checkpoint_of_another_model_is_refused(small, tmp_path):
    m = gc.Model("e_other")
    x = m.input("x", ("B", 3))
    m.param("w", (3, 4))
    m.minimize((x @ m.param("v", (3, 1))).sum())
    other = gc.compile(m, out=str(tmp_path), warm_cache=False)
    path = str(tmp_path / "ckpt.npz")
    other.Trainer(other.init_params(0)).save(path)
    with pytest.raises(ValueError, match=r"checkpoint of model 'e_other'.*does not match model 'e_small'.*; its params "
                                         r"differ: v only there$"):
        small.Trainer.load(path)
    # the same model edited (tanh for log): its params still fit, and the error says how to start from them
    m = gc.Model("e_small")
    x, y = m.input("x", ("B", 3)), m.input("y", ("B",), dtype="int64")
    m.minimize(gc.softmax_cross_entropy(gc.tanh(x) @ m.param("w", (3, 4)), y))
    edited = gc.compile(m, out=str(tmp_path / "edited"), warm_cache=False)
    edited.Trainer(edited.init_params(0)).save(path)
    with pytest.raises(ValueError, match=r"its params have this model's names, shapes and dtype: to start a new "
                                         r"Trainer from them .* read them with np.load, the arrays 'param/NAME'"):
        small.Trainer.load(path)
    np.savez(str(tmp_path / "junk.npz"), a=np.zeros(3))
    with pytest.raises(ValueError, match="not a gradc checkpoint"):
        small.Trainer.load(str(tmp_path / "junk.npz"))


def test_checkpoint_of_the_same_model_in_another_dtype_says_so(tmp_path):
    """Found by a new-user trial: the message said "another model or gradc version"."""
    def make():
        m = gc.Model("e_dtype")
        x = m.input("x", ("B", 3))
        m.minimize((x @ m.param("w", (3, 2))).sum())
        return m
    b64 = gc.compile(make(), out=str(tmp_path / "a"), dtype="float64", warm=False)
    path = str(tmp_path / "ckpt.npz")
    b64.Trainer(b64.init_params(0)).save(path)
    b32 = gc.compile(make(), out=str(tmp_path / "b"), dtype="float32", warm=False)
    with pytest.raises(ValueError, match=r"checkpoint of a float64 build of model 'e_dtype', and this build is "
                                         r"float32: load it into a build compiled with --dtype float64"):
        b32.Trainer.load(path)


def test_bad_compile_options_name_the_compile_call(tmp_path):
    """A bad option names the line of the gradc.compile call, not the model's (found by a new-user
    trial), and warm= takes --warm's names too."""
    import inspect
    m = gc.Model("e_options")
    x = m.input("x", ("B", 3))
    m.minimize((x @ m.param("w", (3, 2))).sum())
    here = f"{os.path.basename(__file__)}:{inspect.currentframe().f_lineno + 2}"
    with pytest.raises(gc.GradcError, match=rf"{here}: compile: unknown dtype 'float16'"):
        gc.compile(m, out=str(tmp_path), dtype="float16")
    with pytest.raises(gc.GradcError, match=r"warm='later': use True or 'first'"):
        gc.compile(m, out=str(tmp_path), warm="later")
    for bad, message in ((dict(order=3), "--order 3"), (dict(order="2"), r"--order '2' \(str, not an int\): use 1"),
                         (dict(order=True), r"--order True \(bool, not an int\): use 1"), (dict(target="tpu"), "--target 'tpu'"),
                         (dict(bind={"B": 0}), "--bind B=0"), (dict(bind={"N": 4}), "--bind names dim N"),
                         (dict(bind={"B": 8.0}), "--bind B=8.0: a dim must be bound to an int"),
                         (dict(bind="B=8"), "compile: bind must be a dict of dim names to ints .*got 'B=8'"),
                         (dict(bind={4: 4}), r"compile: bind's keys are dim names \(bind=\{'B': 64\}\), got 4"),
                         (dict(bind={"B": 2**62}), r"--bind B=4611686018427387904: 'x' would be of shape "
                                                   r"\(4611686018427387904, 3\), more elements than numpy can hold"),
                         (dict(devices=2), r"--devices needs every symbolic dim bound with --bind \(unbound: B"),
                         (dict(scan_backward="forward"), "--scan-backward 'forward': use reverse or bppsa")):
        call = f"{os.path.basename(__file__)}:{inspect.currentframe().f_lineno + 2}"
        with pytest.raises(gc.GradcError, match=rf"{call}: {message}"):
            gc.compile(m, out=str(tmp_path), **bad)
    assert not list(tmp_path.iterdir())
    assert gc.compile(m, out=str(tmp_path), warm="none").loss_and_grad
    bound = gc.compile(m, out=str(tmp_path), warm="none", bind={"B": np.int64(5)})
    assert bound.INPUTS["x"][0] == (5, 3)
    # a batch of another size: the message says the dim was bound (a last partial batch meets it)
    p = bound.init_params(0)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(4, 3\), expected \(5, 3\) \(B=5 was bound when the "
                                         r"module was compiled \(--bind\); compile without it for any size\)$"):
        bound.loss_and_grad(p, x=np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"input 'x' has shape \(5, 4\), expected \(5, 3\)$"):
        bound.loss_and_grad(p, x=np.ones((5, 4), np.float32))
    # a microbatch build keeps its batch dim symbolic in the code: only the other bound dims are named
    m = gc.Model("e_micro")
    x = m.input("x", ("B", "D"))
    m.minimize((x * x).sum())
    micro = gc.compile(m, out=str(tmp_path / "micro"), warm="none", bind={"B": 4, "D": 3}, microbatches=2)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(4, 5\), expected \(B, 3\) \(D=3 was bound when"):
        micro.loss_and_grad({}, x=np.ones((4, 5), np.float32))


def test_cuda_arrays_are_checked_from_their_interface():
    """A CUDA array whose dtype is not a numpy dtype (torch's) is read from __cuda_array_interface__."""
    from gradc.runtime import Signature

    class TorchLike:
        dtype = "torch.float32"   # not a numpy dtype

        def __init__(self, shape, typestr="<f4", strides=None):
            self.shape = shape
            self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                             "data": (0, False), "version": 3}

    sig = Signature("m", {"w": (2, 3)}, {"x": (("B", 3), "float32")}, "float32", {}, devices=True)
    assert sig.params({"w": TorchLike((2, 3))})["w"].shape == (2, 3)
    assert sig.inputs({"x": TorchLike((5, 3))}, ("x",), "forward")["x"].shape == (5, 3)
    with pytest.raises(ValueError, match=r"param 'w' has dtype float64, expected float32"):
        sig.params({"w": TorchLike((2, 3), "<f8")})
    with pytest.raises(ValueError, match=r"input 'x' has shape \(5, 4\), expected \(B, 3\)"):
        sig.inputs({"x": TorchLike((5, 4))}, ("x",), "forward")
    with pytest.raises(ValueError, match="must be C-contiguous"):
        sig.inputs({"x": TorchLike((5, 3), strides=(4, 20))}, ("x",), "forward")
    cpu = Signature("m", {"w": (2, 3)}, {}, "float32", {})
    with pytest.raises(ValueError, match="param 'w' must be a numpy array, got TorchLike"):
        cpu.params({"w": TorchLike((2, 3))})


def test_a_scalar_param_may_be_a_number_of_its_dtype():
    """Found by a new-user trial: a () param given as np.float64(2.0) was refused ("must be a numpy array")
    where a () input took it. Numbers are taken as numpy makes them, and their dtype checked, never cast."""
    from gradc.runtime import Signature
    sig = Signature("m", {"s": (), "w": (2,)}, {}, "float64", {})
    w = np.ones(2)
    assert sig.params({"s": np.float64(2.0), "w": w})["s"].tolist() == [2.0]
    assert sig.params({"s": 2.5, "w": w})["s"].tolist() == [2.5]
    with pytest.raises(ValueError, match=r"param 'w' has shape \(\), expected \(2,\)"):
        sig.params({"s": 2.5, "w": 1.0})
    single = Signature("m", {"s": ()}, {}, "float32", {})
    with pytest.raises(ValueError, match=r"param 's' has dtype float64, expected float32 \(a float becomes a float64 "
                                         r"array: pass np.asarray\(..., dtype=float32\)\)"):
        single.params({"s": 2.5})
    assert single.params({"s": np.float32(2.5)})["s"].dtype == np.float32
    with pytest.raises(ValueError, match="param 's' must be a numpy array, got bool"):
        single.params({"s": True})


def test_a_trainer_adopts_a_number_assigned_to_a_scalar_param_and_nothing_beside_a_wrong_one(tmp_path):
    m = gc.Model("e_scalar_param")
    x = m.input("x", ("B",))
    s = m.param("s", (), init="ones")
    w = m.param("w", (2,), init="ones")
    m.minimize(((x * s - 1.0) ** 2).mean() + (w * w).sum() * 0.0)
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=1, warm=False)
    tr = mod.Trainer(mod.init_params(0), lr=0.1)
    own_s, own_w = tr.params["s"], tr.params["w"]
    X = np.array([1.0, 2.0])
    tr.params["w"] = np.array([5.0, 6.0])
    tr.params["s"] = np.float32(3.0)   # another dtype: refused, and w not adopted either
    with pytest.raises(ValueError, match=r"params\['s'\] must stay a float64 array of shape \(\), got a float32 array"):
        tr.step(x=X)
    assert tr.params["s"] is own_s and float(own_s) == 1.0 and own_w.tolist() == [1.0, 1.0]
    for given in (np.float64(3.0), 3.0):
        tr.params["s"] = given
        own_s[...] = 0.0
        tr.step(x=X)   # d/ds mean((x s - 1)^2) = mean(2 x (x s - 1)) = 2 (2 + 10) / 2 = 12 at s = 3
        assert tr.params["s"] is own_s and float(own_s) == pytest.approx(3.0 - 0.1 * 12.0, rel=1e-14)
    assert tr.params["w"] is own_w and own_w.tolist() == [5.0, 6.0]   # adopted at the first step that ran


def test_load_takes_settings_from_the_checkpoint_and_says_so(small, tmp_path):
    """Found by a new-user trial: Trainer.load(path, lr=0.5) raised "got multiple values for keyword 'lr'"."""
    path = str(tmp_path / "ckpt.npz")
    small.Trainer(small.init_params(0), lr=0.1).save(path)
    with pytest.raises(TypeError, match=r"Trainer.load: lr, optimizer come from the checkpoint \(load takes "
                                        r"parallel= and its options\); set them on the trainer it returns, e.g. tr.lr = ...$"):
        small.Trainer.load(path, lr=0.5, optimizer="adam")
    with pytest.raises(TypeError, match=r"Trainer.load: lr, seed come from the checkpoint \(load takes parallel= "
                                        r"and its options\); set it on the trainer it returns, e.g. tr.lr = ...; for "
                                        r"other gradient options a new Trainer starts from the loaded params"):
        small.Trainer.load(path, lr=0.5, seed=3)
    with pytest.raises(TypeError, match=r"Trainer.load: lr comes from the checkpoint"):
        small.Trainer.load(path, lr=0.5)
    tr = small.Trainer.load(path)
    tr.lr = 0.5
    assert tr.lr == 0.5
    # (trial U: the hint said to set gradient= on the trainer, which cannot be set)
    with pytest.raises(TypeError, match=r"gradient comes from the checkpoint \(load takes parallel= and its options\); "
                                        r"for other gradient options a new Trainer starts from the loaded params: "
                                        r"\w+\.Trainer\(tr\.params, gradient=\.\.\.\)$"):
        small.Trainer.load(path, gradient="lr")


def test_cli_refuses_an_abbreviated_option(capsys):
    """`--dtyp` is a typo, not --dtype: argparse's prefix matching is off."""
    from gradc.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["compile", "model.py", "--dtyp", "float64"])
    assert e.value.code == 2
    assert "--dtyp" in capsys.readouterr().err
