"""`gradc compile` / `gradc inspect` end to end, in subprocesses, as a user runs them."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from gradc.version import __version__

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gradc(*args, cwd):
    return subprocess.run([sys.executable, "-m", "gradc.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


MODEL = textwrap.dedent("""
    import gradc as gc
    m = gc.Model("tiny")
    x = m.input("x", ("B", 6))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.tanh(x @ m.param("W0", (6, 16)) + m.param("b0", (16,)))
    logits = h @ m.param("W1", (16, 3)) + m.param("b1", (3,))
    m.output("logits", logits)
    m.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-3)
""")

TRAIN = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, sys.argv[1])
    import tiny
    assert tiny.MODEL_NAME == "tiny" and tiny.DTYPE == "float32" and tiny.TARGET == "cpu"
    assert tiny.PARAM_ORDER == ("W0", "b0", "W1", "b1") and tiny.OUTPUTS == ("logits",)
    assert tiny.INPUTS == {"x": (("B", 6), "float32"), "y": (("B",), "int64")}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1).astype(np.int64)
    own = dict(momentum=0.9) if sys.argv[2] == "sgd" else dict(betas=(0.8, 0.99))
    tr = tiny.Trainer(tiny.init_params(seed=0), optimizer=sys.argv[2], lr=0.05, **own)
    losses = [tr.step(x=x, y=y) for _ in range(20)]
    assert losses[-1] < 0.8 * losses[0], losses
    tr.save(sys.argv[3])
    more = [tr.step(x=x, y=y) for _ in range(5)]
    back = tiny.Trainer.load(sys.argv[3])
    again = [back.step(x=x, y=y) for _ in range(5)]
    assert more == again, (more, again)                       # resumes exactly
    for k in tr.params:
        assert np.array_equal(tr.params[k], back.params[k]), k
    print("ok", losses[0], losses[-1])
""")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    work = tmp_path_factory.mktemp("cli")
    (work / "model.py").write_text(MODEL)
    r = gradc("compile", "model.py", "-o", "out", cwd=work)
    assert r.returncode == 0, r.stderr
    (work / "compile.out").write_text(r.stdout + r.stderr)
    return work


def test_compile_writes_the_contract_files(compiled):
    out = compiled / "out"
    for name in ("tiny.py", "tiny.graph.json", "tiny.graph.dot"):
        assert (out / name).is_file(), name
    assert not [f for f in os.listdir(out) if f.startswith(".gradc-")], "temp dir left behind"
    warmed = re.search(r"kernel signatures: (\d+) compiled, (\d+) from the cache", (compiled / "compile.out").read_text())
    assert warmed and int(warmed[1]) + int(warmed[2]) > 0, "the kernels were not compiled"
    data = json.loads((out / "tiny.graph.json").read_text())
    for node in data["nodes"]:
        for key in ("op", "shape", "dtype", "phase", "device", "src"):
            assert key in node
    phases = {n["phase"] for n in data["nodes"]}
    assert {"forward", "backward"} <= phases
    assert any(n["src"].startswith("model.py:") for n in data["nodes"])
    assert "digraph" in (out / "tiny.graph.dot").read_text()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_import_train_checkpoint_resume(compiled, optimizer):
    script = compiled / "train.py"
    script.write_text(TRAIN)
    r = subprocess.run([sys.executable, str(script), str(compiled / "out"), optimizer, str(compiled / f"c_{optimizer}.npz")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok")


def test_inspect(compiled):
    r = gradc("inspect", "out/tiny", "--graph", "--memory", "--kernels", "--partition", cwd=compiled)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for needle in ("model tiny", "nodes per phase: forward", "W0", "(6, 16)", "FLOPs per call", "forward values the backward reads",
                   "model.py:", "kernels (", "def k0_", "backward (", "partition: one device",
                   "memory plan of loss_and_grad: dims are symbolic"):
        assert needle in text, needle
    # lr_grad's copies of the forward are counted apart from the model's forward (a 12-op GCN said forward 73)
    dump = json.loads((compiled / "out" / "tiny.graph.json").read_text())
    lr_only = set(dump["graph"]["lr_grad"]["nodes"])
    schedules = json.loads((compiled / "out" / "tiny.memplan.json").read_text())["entries"]
    assert lr_only and not lr_only & set(schedules["forward_loss"]["schedule"] + schedules["loss_and_grad"]["schedule"])
    forward = sum(n["phase"] == "forward" and n["id"] not in lr_only for n in dump["nodes"])
    assert f"nodes per phase: forward {forward}, " in text and f"; lr_grad's estimate {len(lr_only)} more" in text, text
    # --graph's headings count as that line does, lr_grad's nodes under their own (they were the forward's: trial P)
    assert f"\nforward ({forward} nodes):" in text and f"\nlr_grad's estimate ({len(lr_only)} nodes" in text, text


def test_inspect_of_a_damaged_dump_exits_2_naming_it(compiled, tmp_path):
    """A truncated or edited dump gave `internal error: JSONDecodeError` (or KeyError) and exit 1."""
    shutil.copytree(compiled / "out", tmp_path / "out")
    plan = tmp_path / "out" / "tiny.memplan.json"
    edited = json.loads(plan.read_text()) | {"peak_bytes": 5, "peak_step": 0, "arena_bytes": None}
    for text, message in ((plan.read_text()[:40], "out/tiny.memplan.json: not a JSON dump ("),
                          ("{}", "out/tiny: a dump of this build lacks what gradc"),
                          (json.dumps(edited), "out/tiny: a dump of this build lacks what gradc")):
        plan.write_text(text)
        r = gradc("inspect", "out/tiny", "--memory", cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
        assert "compile the model again" in lines[0], r.stderr


@pytest.mark.parametrize("source,args,message", [
    ("import gradc as gc\nm = gc.Model('b1')\nx = m.input('x', ('B', 3))\nm.minimize((x @ m.param('w', (4, 2))).sum())\n",
     [], "model.py:4: matmul: inner dims differ: (B, 3) @ (4, 2) (3 != 4) (operands: 'x' (B, 3)"),
    ("import gradc as gc\nm = gc.Model('numpy')\nm.minimize(m.input('x', ('B',)).sum())\n", [],
     "model.py:2: model name 'numpy' is also the name of an imported module"),
    ("import gradc as gc\nm = gc.Model('torch')\nm.minimize(m.input('x', ('B',)).sum())\n", [],
     "model.py:2: model name 'torch' is also the name of an installed module ("),   # (not imported: trial S)
    ("import gradc as gc\nm = gc.Model('json')\nm.minimize(m.input('x', ('B',)).sum())\n", [],
     "model.py:2: model name 'json' is also the name of "),
    ("import gradc as gc\nm = gc.Model('b2')\nx = m.input('x', ('B', 3))\nm.minimize(x * 2)\n",
     [], "model.py:4: minimize: the loss must be a scalar"),
    ("import gradc as gc\nm = gc.Model('b3')\nm.output('o', m.input('x', (3,)) * 2)\n", [], "has no minimize"),
    ("x = 1\n", [], "defines no gradc.Model"),
    ("import gradc as gc\nm = gc.Model('b4')\nn = gc.Model('b5')\n", [], "pick one with --model"),
    ("import gradc as gc\nm = gc.Model('b4')\nn = gc.Model('b4')\n", ["--model", "b4"],
     "model.py: defines two models named 'b4' (model.py:2 and model.py:3); give each its own name"),
    ("import gradc as gc\nm = gc.Model('b6')\nm.minimize(m.input('x', ('B',)).sum())\n", ["--bind", "N=3"], "--bind names dim N"),
    ("import gradc as gc\nm = gc.Model('b7')\nm.minimize(m.input('x', ('B',)).sum())\n",
     ["--target", "tpu"], "invalid choice: 'tpu'"),
    ("import gradc as gc\nm = gc.Model('b8')\nm.minimize(m.input('x', ('B',)).sum())\n", ["--order", "3"], "invalid choice: 3"),
    ("import gradc as gc\nm = gc.Model('b9')\nm.minimize(m.input('x', ('B',)).sum())\n", ["--bind", "B"], "expected DIM=INT"),
    ("import gradc as gc\nm = gc.Model('b10')\nm.minimize(m.input('x', ('B',)).sum())\n", ["--bind", "B=+4"],
     "--bind 'B=+4': '+4' is not an int written in decimal digits"),
    ("import gradc as gc\nm = gc.Model('b11')\nm.minimize(m.input('x', ('B',)).sum())\n", ["--bind", "B=-1"],
     "--bind 'B=-1': a dim must be >= 1"),
    (MODEL, ["--memory-budget", "1KiB"], "--memory-budget needs every symbolic dim bound with --bind (unbound: B"),
    (MODEL, ["--memory-budget", "100", "--bind", "B=64"], "model.py:3: budget 100 bytes is below the minimum"),
    (MODEL, ["--memory-budget", "lots"], "'lots' is not a size"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, source, args, message):
    (tmp_path / "model.py").write_text(source)
    r = gradc("compile", "model.py", "-o", "out", *args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path,message", [("models", "models: is a directory; give the model's .py file"),
                                          ("nothing.py", "nothing.py: no such file")])
def test_a_model_path_that_is_no_file_exits_2(tmp_path, path, message):
    (tmp_path / "models").mkdir()
    r = gradc("compile", path, "-o", "out", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == f"gradc: error: {message}", r.stderr
    assert not (tmp_path / "out").exists()


def test_an_error_in_a_helper_names_the_model_files_call_too(tmp_path):
    """A layer built by a helper module: the error's line is the helper's, and the model file's call is named."""
    (tmp_path / "layers.py").write_text("def dense(m, h, a, b, name):\n    return h @ m.param(name, (a, b))\n")
    (tmp_path / "model.py").write_text("import gradc as gc\nfrom layers import dense\nm = gc.Model('hm')\n"
                                       "h = m.input('x', ('B', 5))\nh = dense(m, h, 4, 2, 'W2')\n")
    r = gradc("compile", "model.py", "-o", "out", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("gradc: error: layers.py:2: matmul: inner dims differ"), r.stderr
    assert r.stderr.strip().endswith("(called from model.py:5)"), r.stderr
    assert not (tmp_path / "out").exists()


def test_model_file_that_raises_names_its_line(tmp_path):
    (tmp_path / "model.py").write_text("import gradc\n\ndef build():\n    raise KeyError('oops')\n\nbuild()\n")
    r = gradc("compile", "model.py", "-o", "out", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr   # the traceback only with --debug
    assert r.stderr.strip() == "gradc: error: model.py:4: KeyError: 'oops'"
    assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "model.py").write_text("x = 1\n")
    r = gradc("--debug", "compile", "model.py", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" in r.stderr   # the same status as without --debug
    assert r.stderr.rstrip().splitlines()[-1].startswith("gradc: error: ")


def test_compile_float64_with_bind(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    r = gradc("compile", "model.py", "-o", "out", "--dtype", "float64", "--bind", "B=8", "--no-warm", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    code = "import sys; sys.path.insert(0, 'out'); import tiny; print(tiny.DTYPE, tiny.INPUTS['x'])"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.stdout.strip() == "float64 ((8, 6), 'float64')", r.stderr


def test_stage_pins_in_a_one_device_build_are_noted(tmp_path):
    """`with m.stage(i)` without --devices was ignored without a word."""
    (tmp_path / "model.py").write_text(textwrap.dedent("""
        import gradc as gc
        m = gc.Model("pinned")
        x = m.input("x", ("B", 3))
        with m.stage(0):
            h = gc.tanh(x @ m.param("W", (3, 2)))
        with m.stage(1):
            m.minimize((h @ m.param("V", (2, 2))).mean())
        """))
    r = gradc("compile", "model.py", "-o", "out", "--no-warm", cwd=tmp_path)
    assert r.returncode == 0 and "gradc: note: model.py:6: `with m.stage(i)` pins ops to pipeline stages, but this " \
        "build has one device; the pins apply with --devices K" in r.stderr, r.stdout + r.stderr
    r = gradc("compile", "model.py", "-o", "out2", "--no-warm", "--devices", "2", "--bind", "B=4", cwd=tmp_path)
    assert r.returncode == 0 and "pins" not in r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_budgeted_compile_and_memory_report(tmp_path):
    deep = MODEL.replace('h = gc.tanh(x @ m.param("W0", (6, 16)) + m.param("b0", (16,)))',
                         'h = gc.tanh(x @ m.param("W0", (6, 16)) + m.param("b0", (16,)))\n'
                         'for i in range(6):\n    h = gc.tanh(h @ m.param(f"V{i}", (16, 16)))')
    (tmp_path / "model.py").write_text(deep)
    r = gradc("compile", "model.py", "-o", "out", "--bind", "B=32", "--memory-budget", "12KiB", "--order", "1",
              "--no-warm", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "out" / "tiny.memplan.json").read_text())
    for key in ("entry", "schedule", "peak_bytes", "store_all_peak_bytes", "lower_bound_bytes", "budget_bytes",
                "recompute_flops", "method", "arena_bytes", "tensors"):
        assert key in plan, key
    assert plan["budget_bytes"] == 12 * 1024 and plan["peak_bytes"] <= 12 * 1024 < plan["store_all_peak_bytes"]
    assert set(plan["tensors"][0]) >= {"node", "bytes", "start", "end", "device", "offset", "retained", "recomputed"}
    r = gradc("inspect", "out/tiny", "--memory", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for needle in (f"memory plan of loss_and_grad ({plan['method']})", "peak ", "at step", "budget 12.00 KiB", "recomputed",
                   "largest values live at the peak", "kept for the backward:"):
        assert needle in r.stdout, needle


def test_cuda_build_compiles_and_inspects_without_a_gpu(tmp_path):
    """--target cuda writes the module without touching a GPU; inspect lists each kernel's launch."""
    (tmp_path / "model.py").write_text(MODEL)
    r = gradc("compile", "model.py", "-o", "out", "--target", "cuda", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    name = next(p.stem for p in (tmp_path / "out").glob("*.py"))
    text = (tmp_path / "out" / f"{name}.py").read_text()
    assert "TARGET = 'cuda'" in text and "@cached_cuda_kernel\ndef g0_gemm" in text and "_CUDA = CudaRunner(" in text
    graph = json.loads((tmp_path / "out" / f"{name}.graph.json").read_text())
    assert {n["device"] for n in graph["nodes"]} == {"cuda:0"}
    r = gradc("inspect", f"out/{name}", "--kernels", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "launch: one 16x16 block per 16x16 tile of the output; from _forward" in r.stdout
    assert "registers and shared memory: reported by the driver" in r.stdout
    r = gradc("inspect", f"out/{name}", "--ptx", "no_such_kernel", cwd=tmp_path)
    assert r.returncode == 2 and "--ptx no_such_kernel: no kernel of that name" in r.stderr


@pytest.mark.slow
def test_second_order_entries_compile_on_first_use_unless_warm_all(tmp_path, monkeypatch):
    """Pay for what is used: the default warm-up leaves hvp's block function out; --warm all compiles
    it, into the kernel cache (a second build of the same model then compiles nothing)."""
    def hvp_compiled(cache):   # whether Numba compiled the hvp block function's cache file
        files = [f for f in (cache / "kernels").glob("k_*.py") if "Hessian-vector products" in f.read_text()]
        assert len(files) == 1, files
        return any((cache / "kernels" / "__pycache__").glob(files[0].stem + ".kernel-*.nbi"))

    (tmp_path / "model.py").write_text(MODEL)
    for warm, cache in (("first", "cache_default"), ("all", "cache_all")):
        monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / cache))
        r = gradc("compile", "model.py", "-o", f"out_{warm}", "--warm", warm, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert hvp_compiled(tmp_path / cache) == (warm == "all"), r.stdout
    r = gradc("compile", "model.py", "-o", "again", "--warm", "all", cwd=tmp_path)
    assert r.returncode == 0 and "kernel signatures: 0 compiled" in r.stdout, r.stdout
    r = gradc("compile", "model.py", "-o", "none", "--warm", "none", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not list((tmp_path / "none").rglob("*.nbi"))   # nothing compiled beside the module either


def test_compile_says_when_its_kernels_could_not_be_cached(tmp_path):
    """An unwritable cache folder: the build still works, and the summary says its kernels were not
    cached (they compile again next time) instead of only "0 from the cache"."""
    (tmp_path / "tiny.py").write_text(MODEL)
    (tmp_path / "a_file").write_text("")
    env = dict(os.environ, GRADC_CACHE_DIR=str(tmp_path / "a_file" / "cache"))   # under a file: never writable
    r = subprocess.run([sys.executable, "-m", "gradc.cli", "compile", "tiny.py", "-o", "out", "--order", "1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"; \d+ kernels not cached \(every build compiles them again\): the cache folder could not be written or read \(", r.stdout), r.stdout


def test_a_warning_is_one_line_as_errors_and_notes_are(tmp_path):
    """Python showed the broadcast warning as two lines (the message, then the source line); the CLI's
    diagnostics are one line each."""
    (tmp_path / "warned_model.py").write_text(textwrap.dedent("""
        import gradc as gc
        m = gc.Model("warned")
        x, t = m.input("x", ("B", 3)), m.input("t", ("B",))
        m.minimize(((x @ m.param("W", (3, 1)) - t) ** 2).mean())
    """))
    r = gradc("compile", "warned_model.py", "-o", "out", "--order", "1", "--warm", "none", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("gradc: warning: warned_model.py:5: sub: (B, 1) and (B,) broadcast to (B, B)"), r.stderr


def test_version_flag(tmp_path):
    """Trial S: `gradc --version` said a command is required."""
    r = gradc("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"gradc {__version__}", (r.stdout, r.stderr)
