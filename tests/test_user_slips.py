"""Slips a new user made in a trial from the README alone (session 29): each gets a clear answer.

An input named `self`, a parallel trainer without mpi4py, a bad seed, a constant float32 cannot hold,
a param or input nothing reads, a negative flag value, a model file named like its module, an edited dump,
and the simulator's warnings from the random hash."""
import copy
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import gradc as gc
from gradc.passes.pipeline import constants_in_dtype
from conftest import cuda_env
from test_robustness import gradc, one_error_line


@pytest.fixture(scope="module")
def self_named(tmp_path_factory):
    """A model whose inputs are named `self` and `params`: every entry takes them as keywords."""
    m = gc.Model("slip_self")
    x = m.input("self", ("B", 3))
    y = m.input("params", ("B", 2))
    w = m.param("W", (3, 2))
    m.minimize(gc.square(gc.tanh(x @ w) - y).mean())
    return gc.compile(m, out=str(tmp_path_factory.mktemp("self")), dtype="float64", warm=False)


def test_inputs_named_self_and_params_reach_every_entry(self_named):
    mod = self_named
    rng = np.random.default_rng(3)
    data = {"self": rng.normal(size=(5, 3)), "params": rng.normal(size=(5, 2))}
    p = mod.init_params(1)
    loss, grads = mod.loss_and_grad(p, **data)
    W = p["W"]
    expected = np.mean((np.tanh(data["self"] @ W) - data["params"]) ** 2)
    assert loss == pytest.approx(expected, rel=1e-12)
    assert mod.forward(p, **data)["loss"] == pytest.approx(expected, rel=1e-12)
    tr = mod.Trainer(p, optimizer="sgd", lr=0.1)
    assert tr.step(**data) == pytest.approx(expected, rel=1e-12)
    assert np.allclose(tr.params["W"], W - 0.1 * grads["W"], rtol=1e-12, atol=0)
    lr = mod.Trainer(mod.init_params(1), gradient="lr", samples=4, lr=0.1)
    assert lr.step(**data) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("parallel", ["data", "ps"])
def test_a_parallel_trainer_without_mpi4py_says_what_to_install(self_named, monkeypatch, parallel):
    monkeypatch.setitem(sys.modules, "mpi4py", None)   # (import mpi4py raises ImportError)
    with pytest.raises(RuntimeError, match=rf"slip_self.Trainer\(parallel='{parallel}'\) needs mpi4py: pip install "
                                           r"'gradc\[mpi\]'"):
        self_named.Trainer(self_named.init_params(0), parallel=parallel)


@pytest.mark.parametrize("seed", ["a", -1, True, 1.5, None])
def test_init_params_refuses_a_seed_that_is_not_an_int(self_named, seed):
    with pytest.raises(ValueError, match=rf"init_params: seed must be an int >= 0, got {seed!r}"):
        self_named.init_params(seed)


def test_init_params_takes_a_numpy_int(self_named):
    assert np.array_equal(self_named.init_params(np.int64(7))["W"], self_named.init_params(7)["W"])
    assert not np.array_equal(self_named.init_params(7)["W"], self_named.init_params(8)["W"])


def _constant_model(value, where):
    """A model with `value` as a scalar constant, an array constant's element, a param's init array's element (the
    arrays' other element is 0), or a constant in a scan's step."""
    m = gc.Model("slip_const")
    x = m.input("x", ("B", 2))
    w = m.param("w", (2,), init=np.array([0.0, value]) if where == "init" else None)
    h = x * w
    if where == "scalar":
        h = h * value
    elif where == "array":
        h = h + np.array([0.0, value])
    elif where == "scan":
        h = gc.scan(lambda c, xt: (c * value + xt, c), (h * 0).sum(1), gc.transpose(h))[0]
    m.minimize(h.sum())
    return m


@pytest.mark.parametrize("where", ["scalar", "array", "init", "scan"])
@pytest.mark.parametrize("value,held", [(1e40, "inf"), (-4e38, "-inf"), (3.402824e38, "inf"), (1e-50, "0")])
def test_a_constant_float32_cannot_hold_is_refused_at_its_line(tmp_path, where, value, held):
    m = _constant_model(value, where)
    with pytest.raises(gc.GradcError, match=rf"test_user_slips.py:\d+: .*{re.escape(repr(value))}, which float32 "
                                            rf"holds as {held}: compile with --dtype float64, or rescale"):
        gc.compile(m, out=str(tmp_path / "o"), warm=False)
    assert not (tmp_path / "o").exists()
    assert gc.compile(m, out=str(tmp_path / "o"), dtype="float64", warm=False).loss_and_grad


@pytest.mark.parametrize("value", [3.4028235e38, -3.4028235e38, 1e-44, 0.0, float("inf")])
def test_float32_constants_it_holds_compile(tmp_path, value):
    """float32's max as numpy prints it (it rounds to the max), a subnormal, and an inf written on purpose."""
    for where in ("scalar", "array"):
        assert gc.compile(_constant_model(value, where), out=str(tmp_path / "o"), warm=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_param_whose_init_array_is_not_finite_is_refused_at_its_line(tmp_path, value):
    """A NaN in an init array compiled, and training started from NaN (trial I); an inf constant is still taken
    (a mask written on purpose, above), an inf init is not."""
    with pytest.raises(gc.GradcError, match=rf"test_user_slips.py:\d+: param 'w': its init array holds "
                                            rf"{re.escape(repr(value))} at \(1,\), and a param starts finite"):
        gc.compile(_constant_model(value, "init"), out=str(tmp_path / "o"), dtype="float64", warm=False)
    assert not (tmp_path / "o").exists()


def test_an_array_whose_tail_underflows_compiles(tmp_path):
    """A Gaussian window's tail is 0 in float32, as in every float32 framework: only a value that would be 0
    everywhere it is not 0 is refused."""
    m = gc.Model("slip_window")
    x = m.input("x", ("B", 64))
    window = np.exp(-np.arange(64.0) ** 2 / 8)
    assert window[-1] < float(np.finfo(np.float32).smallest_subnormal)
    m.minimize((x * window).sum() + (x * 0.5 ** np.arange(64.0) * 1e-30).sum())
    mod = gc.compile(m, out=str(tmp_path), warm=False)
    X = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    assert mod.loss_and_grad({}, x=X)[0] == pytest.approx(float((X * window).sum()), rel=1e-5)


def test_a_param_or_input_nothing_reads_gets_a_note(tmp_path):
    (tmp_path / "unread.py").write_text(textwrap.dedent("""\
        import gradc as gc
        m = gc.Model("slip_unread")
        x = m.input("x", ("B", 3))
        z = m.input("z", ("B", 3))
        b = m.param("b", (2,))
        frozen = m.param("f", (2,), trainable=False)
        m.output("shown", z.sum())
        extra = m.input("extra", ("B",))
        m.minimize((x @ m.param("W", (3, 2))).sum())
        """))
    r = gradc("compile", "unread.py", "-o", "out", "--warm", "none", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    path = str(tmp_path / "unread.py")
    assert r.stderr.splitlines()[:2] == [
        "gradc: note: unread.py:5: param 'b' does not reach the loss: its gradient is always 0",
        "gradc: note: unread.py:8: input 'extra' is read by neither the loss nor an output"]
    assert len(r.stderr.splitlines()) == 2 and len(r.stdout.splitlines()) == 1   # (z is read by an output; f is frozen)
    namespace = {}
    exec(compile((tmp_path / "unread.py").read_text(), path, "exec"), namespace)
    notes = r"gradc: \S*unread.py:(5: param 'b' does not reach the loss|8: input 'extra' is read by)"
    with pytest.warns(UserWarning, match=notes) as caught:
        gc.compile(namespace["m"], out=str(tmp_path / "py"), warm=False)
    assert len(caught) == 2 and all(w.filename == __file__ for w in caught)


def test_every_param_and_input_read_warns_nothing(tmp_path):
    m = gc.Model("slip_read")
    x = m.input("x", ("B", 3))
    m.minimize((x @ m.param("W", (3, 2))).sum(), weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gc.compile(m, out=str(tmp_path), warm=False)


def test_a_flag_value_that_starts_with_a_dash(tmp_path):
    (tmp_path / "model.py").write_text("import gradc as gc\nm = gc.Model('slip_flag')\n"
                                       "m.minimize(m.input('x', ('B',)).sum())\n")
    r = gradc("compile", "model.py", "--bind", "B=4", "--memory-budget", "-5MiB", cwd=tmp_path)
    assert one_error_line(r) == ("gradc: error: argument --memory-budget: expected one argument (a value that "
                                 "starts with '-' is written --memory-budget=VALUE) (gradc compile --help for usage)")
    r = gradc("compile", "model.py", "--bind", "B=4", "--memory-budget=-5MiB", cwd=tmp_path)
    assert "'-5MiB' is not a size: it is negative" in one_error_line(r)
    r = gradc("compile", "model.py", "-o", "-x", cwd=tmp_path)
    assert "is written --out=VALUE" in one_error_line(r)
    r = gradc("compile", "model.py", "--bind", cwd=tmp_path)   # no value at all: no hint about '-'
    assert one_error_line(r) == ("gradc: error: argument --bind: expected one argument (gradc compile --help for "
                                 "usage)")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]


def test_a_model_file_named_like_its_module_gets_a_note(tmp_path):
    (tmp_path / "slip_same.py").write_text("import gradc as gc\nm = gc.Model('slip_same')\n"
                                           "m.minimize(m.input('x', ('B',)).sum())\n")
    r = gradc("compile", "slip_same.py", "-o", "build", "--warm", "none", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[-1] == (
        "gradc: note: slip_same.py has the module's name: a script in its folder that runs `import slip_same` "
        "imports the model file unless build comes first on sys.path (sys.path.insert(0, 'build')); or rename "
        "one of them")
    (tmp_path / "other.py").write_text("import gradc as gc\nm = gc.Model('slip_other_name')\n"
                                       "m.minimize(m.input('x', ('B',)).sum())\n")
    r = gradc("compile", "other.py", "-o", "build", "--warm", "none", cwd=tmp_path)
    assert r.stdout.splitlines() == ["gradc: wrote build/slip_other_name.py (passes "
                                     + r.stdout.split("(passes ")[1].strip()]


def test_inspect_refuses_a_dump_whose_shape_was_edited(tmp_path):
    (tmp_path / "model.py").write_text("import gradc as gc\nm = gc.Model('slip_dump')\n"
                                       "m.minimize(m.input('x', ('B', 3)).sum())\n")
    assert gradc("compile", "model.py", "-o", "build", "--warm", "none", cwd=tmp_path).returncode == 0
    assert gradc("inspect", "build/slip_dump", cwd=tmp_path).returncode == 0
    path = tmp_path / "build" / "slip_dump.graph.json"
    original = path.read_text()
    for shape in ("oops", [-1], [""], [2.5], [[2]], None):
        doc = json.loads(original)
        doc["nodes"][0]["shape"] = shape
        path.write_text(json.dumps(doc))
        line = one_error_line(gradc("inspect", "build/slip_dump", cwd=tmp_path))
        assert line.startswith("gradc: error: build/slip_dump: a dump of this build lacks what gradc") and \
            f"a shape is {shape!r}, not a list of sizes" in line, line


@pytest.mark.slow
def test_inspect_refuses_a_partition_dump_that_was_edited(tmp_path):
    """A partition.json edited to schedule "zigzag" and -3 microbatches was printed as it was (a trial)."""
    (tmp_path / "model.py").write_text("import gradc as gc\nm = gc.Model('slip_part')\nh = m.input('x', ('B', 3))\n"
                                       "for i in range(2):\n    h = gc.tanh(h @ m.param(f'W{i}', (3, 3)))\n"
                                       "m.minimize(h.sum())\n")
    assert gradc("compile", "model.py", "-o", "build", "--warm", "none", "--devices", "2", "--bind", "B=4",
                 cwd=tmp_path).returncode == 0
    assert gradc("inspect", "build/slip_part", "--partition", cwd=tmp_path).returncode == 0
    path = tmp_path / "build" / "slip_part.partition.json"
    original = path.read_text()
    for key, value in (("schedule", "zigzag"), ("microbatches", -3), ("stages", 3), ("stages", True)):
        doc = json.loads(original)
        doc[key] = value
        path.write_text(json.dumps(doc))
        line = one_error_line(gradc("inspect", "build/slip_part", "--partition", cwd=tmp_path))
        assert line.startswith("gradc: error: build/slip_part: a dump of this build lacks what gradc") and \
            "not a pipeline gradc makes" in line, line


def test_the_simulator_runs_the_random_hash_without_warnings(tmp_path):
    """numpy scalars warn where the hash's uint64 arithmetic wraps; gradc's kernels mean it to."""
    pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
    script = tmp_path / "draws.py"
    script.write_text(textwrap.dedent(f"""\
        import numpy as np
        import gradc as gc
        m = gc.Model("slip_sim")
        x = m.input("x", ("B", 4))
        y = m.input("y", ("B",), dtype="int64")
        seed = m.input("noise_seed", (), dtype="int64")
        h = gc.dropout(gc.tanh(x @ m.param("W", (4, 3))), 0.25, seed)
        m.minimize(gc.softmax_cross_entropy(h, y))
        mod = gc.compile(m, out={str(tmp_path / "b")!r}, target="cuda", warm=False)
        p = mod.init_params(0)
        X = np.random.default_rng(0).normal(size=(5, 4)).astype("f4")
        Y = np.array([0, 1, 2, 0, 1])
        loss, g = mod.lr_grad(p, samples=4, x=X, y=Y, noise_seed=np.int64(3))
        assert np.isfinite(loss) and np.isfinite(g["W"]).all() and np.abs(g["W"]).max() > 0
        assert np.isfinite(mod.loss_and_grad(p, x=X, y=Y, noise_seed=np.int64(3))[0])
        print("ok")
        """))
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(script)], env=cuda_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert "RuntimeWarning" not in r.stderr


def test_the_late_cast_refuses_an_array_beyond_the_dtype_and_lets_one_underflow():
    """constants_in_dtype casts the arrays left after folding (which may make new ones, beyond what the user
    wrote and compile_model checked): inf is refused at the array's line, a value that underflows to 0 is kept.
    Called directly on a graph, with the arrays such a fold would leave."""
    m = gc.Model("slip_late")
    x = m.input("x", ("B", 2))
    m.minimize((x * np.array([1e40, 1e-50])).sum())
    g = copy.deepcopy(m.graph)
    with pytest.raises(gc.GradcError, match=r"test_user_slips.py:\d+: a constant array \(2,\) computed from this "
                                            r"line holds 1e\+40, which float32 holds as inf"):
        constants_in_dtype(g, "float32")
    (n,) = [n for n in m.graph.nx.nodes if m.graph.op(n) == "const"]
    m.graph.attrs(n)["value"] = np.array([3.0, 1e-50])
    constants_in_dtype(m.graph, "float32")
    assert m.graph.attrs(n)["value"].dtype == np.float32 and list(m.graph.attrs(n)["value"]) == [3.0, 0.0]


def test_a_broadcast_that_makes_a_table_of_one_dim_warns_at_the_users_line():
    """(B, 1) - (B,) is (B, B) by numpy's rule: a squared error over it is silently a table (a new user's
    slip). A bias (B, 3) + (3,), a row-wise (B, 1) - (B, 1) and a table asked for with equal ranks do not warn."""
    m = gc.Model("slip_table")
    x, t = m.input("x", ("B", 3)), m.input("t", ("B",))
    p = x @ m.param("W", (3, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = [x + m.param("b", (3,)), p - t[:, None], p - t[None, :], gc.maximum(p, 0.0) * x,
                 x[:, None] - x, x[:, None, :] - x]   # (pairs: the user's new axis says a table is meant)
    assert [q.shape for q in quiet] == [("B", 3), ("B", 1), ("B", "B"), ("B", 3), ("B", "B", 3), ("B", "B", 3)]
    line = inspect.currentframe().f_lineno + 2
    with pytest.warns(UserWarning, match=r"sub: \(B, 1\) and \(B,\) broadcast to \(B, B\) .* holds B on more axes") as w:
        d = (p - t) ** 2
    assert d.shape == ("B", "B")
    assert [(os.path.basename(r.filename), r.lineno) for r in w] == [("test_user_slips.py", line)]
    with pytest.warns(UserWarning, match=r"sub: \(B, 1\) and \(B,\) broadcast to \(B, B\)"):
        x.sum(1, keepdims=True) - t
    with warnings.catch_warnings():   # the user's new axis through elementwise ops is still theirs (review finding)
        warnings.simplefilter("error")
        assert (t[:, None] * 2.0 - t).shape == (gc.exp(t[:, None]) - t).shape == ("B", "B")
    with pytest.warns(UserWarning, match=r"mul: \(B, 1\) and \(B,\) broadcast"):   # not when a product's 1 meets it
        p * t[:, None] * t


def test_a_broadcast_that_makes_a_table_of_an_int_dim_warns_too():
    """Trial S: (64, 1) - (64,) with int dims is (64, 64) as silently as with B; so is a param declared
    (8, 1) minus one of (8,). A bias, a square matrix's row, the user's new axis and dims of 1 stay quiet."""
    m = gc.Model("slip_int_table")
    x, t = m.input("x", (64, 8)), m.input("t", (64,))
    p = x @ m.param("W", (8, 1))
    u, v = m.param("u", (8, 1)), m.param("v", (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sq = m.input("sq", (64, 64))
        quiet = [x + m.param("b", (8,)), sq + t, p - t[:, None], p - t[None, :], x[:, None] - x,
                 m.param("c", (5, 1)) * m.param("d", (3,)), u - m.param("one", (1,))]
    assert [q.shape for q in quiet] == [(64, 8), (64, 64), (64, 1), (64, 64), (64, 64, 8), (5, 3), (8, 1)]
    with pytest.warns(UserWarning, match=r"sub: \(64, 1\) and \(64,\) broadcast to \(64, 64\) .* holds 64 on more axes"):
        assert (p - t).shape == (64, 64)
    with pytest.warns(UserWarning, match=r"sub: \(8, 1\) and \(8,\) broadcast to \(8, 8\)"):
        u - v


def test_call_time_dtype_messages_name_what_is_never_cast(self_named):
    p = self_named.init_params(0)
    data = {"self": np.ones((2, 3)), "params": np.ones((2, 2))}
    with pytest.raises(ValueError, match=r"param 'W' has dtype float32, expected float64 \(gradc never casts params\)"):
        self_named.loss_and_grad({"W": p["W"].astype(np.float32)}, **data)
    with pytest.raises(ValueError, match=r"v\['W'\] has dtype float32, expected float64 \(gradc never casts tangents\)"):
        self_named.hvp(p, {"W": p["W"].astype(np.float32)}, **data)


def test_bind_with_a_comma_says_one_flag_per_dim(tmp_path):
    (tmp_path / "model.py").write_text("import gradc as gc\nm = gc.Model('slip_bind')\n"
                                       "m.minimize(m.input('x', ('T', 'B')).sum())\n")
    line = one_error_line(gradc("compile", "model.py", "--bind", "T=16,B=3", cwd=tmp_path))
    assert line == ("gradc: error: --bind 'T=16,B=3': '16,B=3' is not an int written in decimal digits; give one "
                    "--bind per dim: --bind T=16 --bind B=3")


def test_numpy_operators_record_ops_and_other_ufuncs_name_gradcs():
    """ndarray (or numpy number) op Tensor records the op as Tensor op ndarray does; np.exp(t) says gc.exp."""
    m = gc.Model("slip_numpy")
    x = m.input("x", ("B", 3))
    a = np.array([1.0, -2.0, 0.5])
    made = [a + x, a - x, a * x, a / x, np.float64(2.0) ** x, np.maximum(a, x), np.ones((4, 3)) @ gc.transpose(x)]
    assert [m.graph.op(t.node) for t in made] == ["add", "sub", "mul", "div", "pow", "maximum", "matmul"]
    assert [t.shape for t in made] == [("B", 3)] * 6 + [(4, "B")]
    sub = made[1]
    (c,) = [u for u in m.graph.operands(sub.node) if m.graph.op(u) == "const"]
    assert m.graph.operands(sub.node)[0] == c and np.array_equal(m.graph.attrs(c)["value"], a)   # a - x, not x - a
    line = inspect.currentframe().f_lineno + 3
    with pytest.raises(gc.GradcError, match=rf"test_user_slips.py:{line}: numpy's exp cannot take a gradc Tensor: "
                                            r"use gc.exp\(\.\.\.\)"):
        np.exp(x)
    with pytest.raises(gc.GradcError, match=r"numpy's absolute cannot take a gradc Tensor: use gc.abs"):
        np.abs(x)
    with pytest.raises(gc.GradcError, match=r"numpy's floor cannot take a gradc Tensor: use gradc's ops"):
        np.floor(x)
    b = np.zeros(3)
    with pytest.raises(gc.GradcError, match=r"numpy's add into an array \(a \+= t\) cannot hold a gradc "
                                            r"Tensor: write a = a \+ t"):
        b += x
    with pytest.raises(gc.GradcError, match=r"numpy's subtract into an array \(a -= t\) .*: write a = a - t"):
        b -= x


def test_numpy_functions_comparisons_and_arrays_of_tensors_are_refused_naming_what_to_write():
    """np.sum(t) failed deep in numpy (Tensor.sum() got an unexpected keyword argument 'out'), np.dot(x, W)
    blamed mul, np.asarray(t) and np.transpose(t) made object arrays and compiled, x > 0 gave Python's
    TypeError and x == W a bool (a trial's findings)."""
    m = gc.Model("slip_numpy_functions")
    x, W = m.input("x", ("B", 3)), m.param("W", (3, 3))
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(gc.GradcError, match=rf"test_user_slips.py:{line}: numpy's np.sum cannot take a gradc Tensor: use gc.sum"):
        np.sum(x)
    for call, use in [(lambda: np.mean(x), r"gc.mean"), (lambda: np.dot(x, W), r"a @ b"),
                      (lambda: np.stack([x, x]), r"gc.stack"), (lambda: np.concatenate([x, x]), r"gc.concat"),
                      (lambda: np.transpose(x), r"gc.transpose"), (lambda: np.where(x, x, x), r"Piecewise"),
                      (lambda: np.clip(x, 0, 1), r"Max and Min"), (lambda: np.cumsum(x), r"gradc's ops")]:
        with pytest.raises(gc.GradcError, match=rf"numpy's np.\w+ cannot take a gradc Tensor: use .*{use}"):
            call()
    for call in (lambda: np.asarray(x), lambda: np.array([x, x]), lambda: np.ones(3) + [x, x, x]):
        with pytest.raises(gc.GradcError, match=r"a Tensor has no values while the model is being built"):
            call()
    for call in (lambda: x > 0, lambda: 0 < x, lambda: x <= W, lambda: max(x, W), lambda: np.float32(0.5) < x,
                 lambda: np.ones(3) >= x):
        with pytest.raises(gc.GradcError, match=r"comparisons of Tensors \(<, <=, >, >=\) are not ops .*gc.maximum"):
            call()
    with pytest.raises(gc.GradcError, match=r"numpy's np.linalg.norm cannot take a gradc Tensor"):
        np.linalg.norm(x)
    with pytest.raises(gc.GradcError, match=r"mul: a bool \(False\) is not a tensor value: for a flag, branch in Python "
                                            r"or write 1.0 or 0.0 \(t == u is a bool too"):
        (x == W) * x
    with pytest.raises(gc.GradcError, match=r"mul: a bool \(True\) is not a tensor value"):
        x * True
    other = gc.Model("slip_other")
    with pytest.raises(gc.GradcError, match=r"matmul: 'W' is a tensor of model 'slip_numpy_functions', used in model "
                                            r"'slip_other'"):
        other.input("z", ("B", 3)) @ W


def test_numbers_fusion_folds_beyond_float32_are_refused(tmp_path):
    """x * 1e20 * 1e20: each constant fits, the fused expression's 1e40 does not (it would be written into the
    kernel as inf)."""
    m = gc.Model("slip_folded")
    x = m.input("x", ("B", 3))
    m.minimize((x * 1e20 * 1e20).sum())
    with pytest.raises(gc.GradcError, match=r"test_user_slips.py:\d+: the expression of this line folds to the "
                                            r"number 1e\+40, which float32 holds as inf"):
        gc.compile(m, out=str(tmp_path / "f32"), warm=False)
    assert gc.compile(m, out=str(tmp_path / "f64"), dtype="float64", warm=False)


def test_numbers_fusion_folds_beyond_float64_are_refused_and_tiny_ones_are_not(tmp_path):
    """1e600 folded from two numbers float64 holds was written into the kernel as `inf` (a NameError in
    Numba's compile: review finding). A folded number that underflows is let be: an hvp squares a user's
    1e-23 inside tanh, whose product (about 1e-69) is 0 in float32 anyway (review finding on the first fix)."""
    m = gc.Model("slip_folded_far")
    x = m.input("x", ("B", 3))
    m.minimize((x * m.param("w", (3,)) * 1e300 * 1e300).sum())
    with pytest.raises(gc.GradcError, match=r"test_user_slips.py:\d+: the expression of this line folds to the "
                                            r"number 1\.00e\+600, beyond float64"):
        gc.compile(m, out=str(tmp_path / "far"), dtype="float64", warm=False)
    m = gc.Model("slip_folded_tiny")
    x = m.input("x", ("B", 3))
    w = m.param("w", (3, 3))
    m.minimize(gc.tanh((x @ w) * 1e-23).sum())
    mod = gc.compile(m, out=str(tmp_path / "tiny"), order=2, warm=False)
    p = {"w": np.ones((3, 3), np.float32)}
    assert np.all(np.isfinite(mod.hvp(p, p, x=np.ones((2, 3), np.float32))["w"]))


def test_inspect_layers_of_a_model_with_a_user_op(tmp_path):
    """inspect reads the dumps in a process where the model's gc.elementwise op was never registered: it
    failed with `unknown op 'mish'` (a new user's trial of the README's mish)."""
    (tmp_path / "model.py").write_text(textwrap.dedent("""\
        import gradc as gc, sympy as sp
        m = gc.Model("slip_mish")
        x = m.input("x", ("B", 4))
        mish = gc.elementwise("mish", lambda u: u * sp.tanh(sp.log(1 + sp.exp(u))))
        m.minimize(mish(x @ m.param("W", (4, 3))).mean())
        """))
    assert gradc("compile", "model.py", "-o", "build", "--bind", "B=4", "--warm", "none", cwd=tmp_path).returncode == 0
    r = gradc("inspect", "build/slip_mish", "--layers", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^  W +matmul +\(4, 3\) +48 bytes +48 bytes$", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("axis", [(0, 1), None, 1.0, True])
def test_softmax_takes_one_int_axis(axis):
    m = gc.Model("slip_softmax")
    x = m.input("x", ("B", 3))
    for op in (gc.softmax, gc.log_softmax):
        with pytest.raises(gc.GradcError, match=rf"test_user_slips.py:\d+: {op.__name__}: axis must be one int \(the "
                                                rf"axis it normalises over\), got {re.escape(repr(axis))}"):
            op(x, axis=axis)
    assert gc.softmax(x, axis=np.int64(0)).shape == ("B", 3)


def test_a_checkpoint_loads_into_a_build_with_other_binds(tmp_path):
    """--bind (which --devices needs) changed the fingerprint a checkpoint must match, so training on a
    pipeline build and resuming on a plain one was refused as "another model" (a new user's trial). The
    binds are left out of it now; another model is still refused."""
    def make(width=3):
        m = gc.Model("slip_ckpt")
        x, y = m.input("x", ("B", 3)), m.input("y", ("B", 2))
        m.minimize(gc.mse(gc.tanh(x @ m.param("W", (3, width))) @ m.param("V", (width, 2)), y))
        return m
    bound = gc.compile(make(), out=str(tmp_path / "bound"), dtype="float64", warm=False, bind={"B": 4})
    plain = gc.compile(make(), out=str(tmp_path / "plain"), dtype="float64", warm=False)
    rng = np.random.default_rng(5)
    data = {"x": rng.normal(size=(4, 3)), "y": rng.normal(size=(4, 2))}
    tr = bound.Trainer(bound.init_params(1), optimizer="adam", lr=0.01)
    tr.step(**data)
    tr.save(str(tmp_path / "ck.npz"))
    resumed = plain.Trainer.load(str(tmp_path / "ck.npz"))
    assert all(np.array_equal(resumed.params[k], tr.params[k]) for k in tr.params)
    assert resumed.step(**data) == tr.step(**data)
    assert all(np.array_equal(resumed.params[k], tr.params[k]) for k in tr.params)
    other = gc.compile(make(width=4), out=str(tmp_path / "other"), dtype="float64", warm=False)
    with pytest.raises(ValueError, match="it was written by another model or gradc version"):
        other.Trainer.load(str(tmp_path / "ck.npz"))


def test_second_trial_messages(self_named, tmp_path):
    """A new user's trial: a misspelt Trainer setting listed momentum to an Adam trainer; gc.take of a float
    Tensor spoke of numpy arrays; gc.tanhh named no op; --scan-backward bppsa on a model without a scan said
    nothing."""
    tr = self_named.Trainer(self_named.init_params(0), optimizer="adam")
    with pytest.raises(AttributeError, match=r"has no setting 'l_r': adam sets lr, betas, eps or clip_norm;"):
        tr.l_r = 3
    tr = self_named.Trainer(self_named.init_params(0), optimizer="sgd")
    with pytest.raises(AttributeError, match=r"has no setting 'l_r': sgd sets lr, momentum or clip_norm;"):
        tr.l_r = 3
    m = gc.Model("slip_take")
    x = m.input("x", ("B", 3))
    with pytest.raises(gc.GradcError, match=r"made from one\), got 'x' of dtype float"):
        gc.take(m.param("E", (5, 2)), x)
    with pytest.raises(gc.GradcError, match=r"made from one; a numpy array of positions is no index: declare them as "
                                            r"an int input, m.input\('idx', \(K,\), dtype='int64'\), and pass"):
        gc.take(m.param("F", (5, 2)), np.arange(3))
    with pytest.raises(AttributeError, match=r"no attribute 'tanhh': did you mean gc.tanh\?"):
        gc.tanhh(x)
    with pytest.raises(AttributeError, match=r"no attribute 'tan': write tan as a sympy expression with gc.elementwise"):
        gc.tan(x)   # (not gc.tanh: other maths)
    with pytest.raises(AttributeError, match=r"no attribute 'Trainer': the Trainer is the compiled module's"):
        gc.Trainer
    m.minimize(gc.tanh(x @ m.param("W", (3, 2))).sum())
    with pytest.warns(UserWarning, match=r"--scan-backward bppsa changes nothing: the model has no gc.scan"):
        gc.compile(m, out=str(tmp_path), scan_backward="bppsa", warm=False)


def test_a_trainer_stepped_from_two_threads_takes_every_step(self_named):
    """Two threads stepping one Trainer raced on its buffers: steps == 200 but the params were 0.8% off 200
    serial steps (a new user's trial). Steps on one batch: any order of whole steps gives the same params."""
    import threading
    rng = np.random.default_rng(5)
    data = {"self": rng.normal(size=(20000, 3)), "params": rng.normal(size=(20000, 2))}   # kernels long enough to overlap
    serial = self_named.Trainer(self_named.init_params(2), optimizer="sgd", lr=0.05)
    for _ in range(60):
        serial.step(**data)
    shared = self_named.Trainer(self_named.init_params(2), optimizer="sgd", lr=0.05)
    threads = [threading.Thread(target=lambda: [shared.step(**data) for _ in range(30)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert shared.steps == 60 and np.array_equal(shared.params["W"], serial.params["W"])


def test_a_dsl_function_called_with_a_keyword_it_lacks_is_named_as_the_user_wrote_it():
    """gc.max_pool2d(x, 2, dilation=2) said `_pool.<locals>.f() got an unexpected keyword argument` (trial H)."""
    m = gc.Model("kwslip")
    x = m.input("x", ("B", 1, 6, 6))
    with pytest.raises(TypeError, match=r"^max_pool2d\(\) got an unexpected keyword argument 'dilation'"):
        gc.max_pool2d(x, 2, dilation=2)
    with pytest.raises(TypeError, match=r"^avg_pool2d\(\) got an unexpected keyword argument 'groups'"):
        gc.avg_pool2d(x, 2, groups=1)


def test_a_true_or_false_option_refuses_a_string_or_a_number():
    """scan(..., reverse="False") ran the scan in reverse (a str is true; trial N), as keepdims="no" kept the
    dims and trainable="no" trained the param."""
    m = gc.Model("flags")
    x, h0 = m.input("x", ("T", "B", 2)), m.input("h0", ("B", 2))
    here = f"test_user_slips.py:{inspect.currentframe().f_lineno + 2}"
    with pytest.raises(gc.GradcError, match=re.escape(f"{here}: scan: reverse must be True or False, got 'False'")):
        gc.scan(lambda h, x_t: (h * 0.5 + x_t, None), h0, x, reverse="False")
    with pytest.raises(gc.GradcError, match="sum: keepdims must be True or False, got 'no'"):
        x.sum(axis=0, keepdims="no")
    with pytest.raises(gc.GradcError, match="mean: keepdims must be True or False, got 1"):
        gc.mean(x, axis=0, keepdims=1)
    with pytest.raises(gc.GradcError, match="param 'W': trainable must be True or False, got 'no'"):
        m.param("W", (2, 2), trainable="no")
    assert m.param("V", (2, 2), trainable=np.bool_(False)).shape == (2, 2)   # numpy's bool is a bool
    hT, _ = gc.scan(lambda h, x_t: (h * 0.5 + x_t, None), h0, x, reverse=np.False_)
    assert hT.shape == ("B", 2)


def test_a_carry_given_as_a_list_is_named_when_the_step_uses_it_as_a_tensor():
    """gc.scan(step, [h0], x) hands the step a tuple; `h @ W` then said only 'cannot use a tuple as a
    tensor' (trial Q). Inside a step the message says how the carry comes in; outside, it stays short."""
    m = gc.Model("list_carry")
    x, h0, W = m.input("x", ("T", "B", 2)), m.input("h0", ("B", 2)), m.param("W", (2, 2))
    with pytest.raises(gc.GradcError, match=r"matmul: cannot use a tuple as a tensor; in a gc\.scan step, a carry "
                                            r"\(or x_t\) given as a tuple or list comes in as a tuple: unpack it"):
        gc.scan(lambda h, x_t: (gc.tanh(h @ W + x_t), None), [h0], x)
    with pytest.raises(gc.GradcError, match=r"matmul: cannot use a tuple as a tensor$"):
        gc.matmul((h0,), W)
    (hT,), _ = gc.scan(lambda c, x_t: ((gc.tanh(c[0] @ W + x_t),), None), [h0], x)   # unpacked, it builds
    assert hT.shape == ("B", 2)


def test_a_division_by_the_constant_zero_is_refused_at_the_users_line(tmp_path):
    """Trial S: x / 0 folded to sympy's zoo, written as nan: every element nan, where numpy gives inf,
    -inf or nan by x's sign. gradc refuses it (and log of a constant 0) at the user's line."""
    (tmp_path / "div0.py").write_text("import gradc as gc\nm = gc.Model('div0')\nx = m.input('x', ('B', 3))\n"
                                      "h = x @ m.param('W', (3, 3))\nm.minimize(gc.mean(h / 0))\n")
    line = one_error_line(gradc("compile", "div0.py", "-o", "out", cwd=tmp_path))
    assert line.startswith("gradc: error: div0.py:5: the expression of this line divides by the constant 0"), line
    assert not (tmp_path / "out").exists()


def test_a_param_of_no_elements_is_refused():
    """Trial S: m.param("W", (8, 0)) compiled; loss_and_grad gave nan and Trainer.step said only so."""
    m = gc.Model("slip_empty_param")
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(gc.GradcError, match=r"param 'W': shape \(8, 0\) holds no element") as e:
        m.param("W", (8, 0))
    assert f"test_user_slips.py:{line}" in str(e.value)


def test_a_masked_array_is_refused_not_read_without_its_mask(self_named):
    """Trial S: x=np.ma.masked_array(X, mask=X > 1) gave the loss of X itself: the mask was dropped."""
    p = self_named.init_params(0)
    x, y = np.random.default_rng(5).normal(size=(4, 3)), np.ones((4, 2))
    with pytest.raises(ValueError, match=r"input 'self' is a masked array with masked elements: .* np\.ma\.filled"):
        self_named.loss_and_grad(p, **{"self": np.ma.masked_array(x, mask=x > 1), "params": y})
    W = p["W"]
    with pytest.raises(ValueError, match=r"param 'W' is a masked array with masked elements"):
        self_named.loss_and_grad({"W": np.ma.masked_array(W, mask=W > 0)}, **{"self": x, "params": y})
    # one that masks nothing is its data (review): the same numbers as the plain arrays
    plain = self_named.loss_and_grad(p, **{"self": x, "params": y})
    masked = self_named.loss_and_grad({"W": np.ma.masked_array(W)}, **{"self": np.ma.masked_array(x), "params": y})
    assert plain[0] == masked[0] and np.array_equal(plain[1]["W"], masked[1]["W"])


def test_mse_of_an_int_target_names_mse_not_its_inner_sub():
    """Trial S: gc.mse(pred, y) with an int y said `sub: operand of dtype int64 ... %5 (reshape)`."""
    m = gc.Model("slip_mse_int")
    x, y = m.input("x", ("B", 3)), m.input("y", ("B",), dtype="int64")
    with pytest.raises(gc.GradcError, match=r"mse: target \(B,\) has dtype int64; mse takes float values"):
        gc.mse((x @ m.param("W", (3, 2)))[:, 0], y)
    m2 = gc.Model("slip_mse_const")   # an int constant becomes a float one, as before (review)
    z = m2.input("z", (5, 3)) @ m2.param("U", (3, 1))
    assert gc.mse(z[:, 0], np.array([1, 0, 1, 1, 0])).shape == gc.mse(z[0, 0], 0).shape == ()


def test_a_model_with_no_trainable_param_gets_a_note(tmp_path):
    """Trial S: every param frozen (or none declared) compiled silently, and Trainer.step changed nothing."""
    m = gc.Model("slip_frozen")
    x = m.input("x", ("B", 3))
    m.minimize(gc.mean(gc.tanh(x @ m.param("W", (3, 2), trainable=False))))
    with pytest.warns(UserWarning, match=r"test_user_slips.py:\d+: the model has no trainable param"):
        gc.compile(m, out=str(tmp_path), order=1, warm=False)


def test_a_budget_below_the_minimum_names_the_gc_compile_line(tmp_path):
    """Trial S: gc.compile(..., memory_budget=...) too small named the gc.Model line; the budget is the call's."""
    m = gc.Model("slip_budget_line")
    x = m.input("x", ("B", 8))
    m.minimize(gc.mean(gc.tanh(x @ m.param("W", (8, 8)))))
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(gc.GradcError, match=r"budget 64 bytes is below the minimum") as e:
        gc.compile(m, out=str(tmp_path), bind={"B": 4}, memory_budget=64, warm=False)
    assert f"test_user_slips.py:{line}:" in str(e.value)


def test_a_scipy_sparse_constant_is_named_at_the_users_line():
    """Trial U: csr_matrix(A) @ X named a line of scipy's and said nothing of sparse matrices."""
    sps = pytest.importorskip("scipy.sparse")
    m = gc.Model("slip_sparse")
    X = m.input("X", (4, 3))
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(gc.GradcError, match=r"a scipy sparse matrix cannot take a gradc Tensor: .* A\.toarray\(\)") as e:
        sps.csr_matrix(np.eye(4)) @ X
    assert str(e.value).startswith(f"{os.path.relpath(__file__)}:{line}:") or f"test_user_slips.py:{line}:" in str(e.value)


def test_a_zero_factor_keeps_numpys_nan(tmp_path):
    """Trial V: log(x) * 0.0 fused to `out = 0` (sympy's 0 * anything is 0): the nan of log(-1) and the
    inf * 0 of exp(1000) were lost from the value and the gradient; numpy and torch give nan."""
    torch = pytest.importorskip("torch")
    m = gc.Model("slip_zero_factor")
    x, w = m.input("x", (4,)), m.param("w", (4,))
    m.minimize(gc.sum(gc.log(x * w) * 0.0 + 0 * gc.exp(x) + x * w))
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=1, warm=False)
    xv = np.array([-1.0, 0.5, 1000.0, np.inf])
    loss, grads = mod.loss_and_grad({"w": np.ones(4)}, x=xv)
    tx, tw = torch.tensor(xv), torch.ones(4, dtype=torch.float64, requires_grad=True)
    tl = (torch.log(tx * tw) * 0.0 + 0 * torch.exp(tx) + tx * tw).sum()
    tl.backward()
    assert np.isnan(loss) and np.isnan(tl.item())
    np.testing.assert_array_equal(grads["w"], tw.grad.numpy())   # nan where torch's is, the same numbers elsewhere


def test_a_symbolic_constant_float32_cannot_hold_is_refused(tmp_path):
    """Trial V: u * sp.exp(100) in a user op compiled in float32 (inf, a nan loss): only numbers were checked."""
    import sympy as sp
    m = gc.Model("slip_symbolic_constant")
    u = m.input("u", (3,))
    big = gc.elementwise("times_e100", lambda t: t * sp.exp(100))
    m.minimize(gc.sum(big(u) * m.param("p", (3,))))
    with pytest.raises(gc.GradcError, match=r"folds to the number 2.688\d*e\+43, which float32 holds as inf"):
        gc.compile(m, out=str(tmp_path), order=1, warm=False)


def test_math_functions_of_a_tensor_name_gradcs():
    import math
    m = gc.Model("slip_math_exp")
    x = m.input("x", (3,))
    with pytest.raises(gc.GradcError, match=r"Python's math functions and float\(\) need a number; use gradc's ops \(gc.exp"):
        math.exp(x)


def test_a_user_op_written_with_math_or_an_if_says_what_to_write():
    """Trial V: math.exp or an `if` inside a user op said only "Cannot convert expression to float" or
    "cannot determine truth value of Relational"."""
    import math
    with pytest.raises(gc.GradcError, match=r"fn failed on sympy symbols: .*; write sympy's functions \(sp.exp"):
        gc.elementwise("slip_math_op", lambda u: math.exp(u))
    with pytest.raises(gc.GradcError, match=r"truth value of Relational.*; a branch \(`if`, `max`, `min`\) is a sympy "
                                            r"Piecewise"):
        gc.elementwise("slip_if_op", lambda u: u if u > 0 else 0)


def test_inspect_calls_a_frozen_param_undecayed(tmp_path):
    """A frozen 2-D param keeps decay=True from its rank's default, but nothing decays it: inspect said
    `frozen, decay` (trial Y)."""
    (tmp_path / "model.py").write_text(textwrap.dedent("""\
        import gradc as gc
        m = gc.Model("slip_frozen")
        x = m.input("x", ("B", 4))
        h = x @ m.param("F", (4, 4), trainable=False) @ m.param("W", (4, 3))
        m.minimize(h.mean(), weight_decay=0.1)
        """))
    assert gradc("compile", "model.py", "-o", "build", "--bind", "B=4", "--warm", "none", "--order", "1",
                 cwd=tmp_path).returncode == 0
    r = gradc("inspect", "build/slip_frozen", cwd=tmp_path)
    assert re.search(r"^  F +\(4, 4\) +frozen$", r.stdout, re.M) and re.search(r"^  W .* trainable, decay$", r.stdout, re.M), r.stdout
