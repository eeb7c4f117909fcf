"""Robustness of what users touch: the CLI's one-line errors, signals, the output folder, leftovers of
killed processes, checkpoints, symlinks planted in a build folder, and inspect not running a build's code."""
import ast
import inspect
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest

import gradc as gc
from gradc import GradcError
from gradc import compiler, sizes
from gradc.files import ELSEWHERE_STALE_SECONDS, pid_namespace
from test_cli import MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(path_prefix=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env.get('PATH', '')}"
    return env


def gradc(*args, cwd, path_prefix=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "gradc.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env(path_prefix))


def one_error_line(r, code=2):
    """The CLI's rule for a user error: exit `code`, one line on stderr, no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def fake_dot(tmp_path, body):
    """A `dot` on PATH that runs `body` (sh); returns its folder."""
    folder = tmp_path / "fakebin"
    folder.mkdir()
    script = folder / "dot"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(folder)


def leftovers(out, name="tiny"):
    """Entries of OUT (and of its hidden build store) that are not part of the current build."""
    if not os.path.isdir(out):
        return []
    current = os.path.dirname(os.path.realpath(os.path.join(out, f"{name}.py")))
    extra = []
    for entry in os.listdir(out):
        path = os.path.join(out, entry)
        if entry == "__pycache__" or entry.startswith(f"{name}."):
            continue
        if entry == ".gradc" and os.path.isdir(path) and not os.path.islink(path):
            for sub in os.listdir(path):
                p = os.path.join(path, sub)
                if not (sub == name and os.path.islink(p)) and os.path.realpath(p) != current:
                    extra.append(os.path.join(entry, sub))
            continue
        extra.append(entry)
    return extra


def spawn_and_signal(args, cwd, marker, sig, path_prefix=None):
    """Start `gradc ARGS`, wait for `marker` to appear, send `sig`; the finished process."""
    # SIGINT as at a terminal, even where the suite itself runs as a background job (which ignores it)
    p = subprocess.Popen([sys.executable, "-m", "gradc.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(path_prefix),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not os.path.exists(marker):
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline, "the marker never appeared"
        time.sleep(0.05)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# ---- 1. sizes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "NaN", "infinity", "1e400", "-1", "-0.5KiB", "1e30GiB",
                                  2**80, -3, float("inf"), "12 apples", "0.5", "0.0001KiB"])
def test_parse_size_refuses_non_finite_negative_and_huge(text):
    with pytest.raises(ValueError, match="is not a size"):
        sizes.parse_size(text)


def test_parse_size_accepts_sizes():
    assert sizes.parse_size("1.5GiB") == 3 * 2**29 and sizes.parse_size("200MB") == 200 * 10**6
    assert sizes.parse_size(0) == 0 and sizes.parse_size("auto") == "auto" and sizes.parse_size("1e3") == 1000
    assert sizes.parse_size("1.3KiB") == 1331   # 1331.2: whole bytes, rounded down
    # as messages print them (trial W): any case of auto, a count with its commas, and "bytes"
    assert sizes.parse_size(" AUTO ") == "auto" and sizes.parse_size("1,130,816 bytes") == 1130816
    assert sizes.parse_size("1,048,576") == 2**20 and sizes.parse_size("1 byte") == 1 and sizes.format_size(1) == "1 byte"
    for slip in ("1,13", "12,3456", "0,001", "2KiB bytes", "bytes"):
        with pytest.raises(ValueError, match="is not a size"):
            sizes.parse_size(slip)
    assert sizes.parse_size(1000.0) == sizes.parse_size("1000B") == 1000
    for fraction in ("1000.7", 1000.7, "12.5B"):   # a count of bytes with a fraction is a slip (trial H), never floored
        with pytest.raises(ValueError, match="a count of bytes is a whole number"):
            sizes.parse_size(fraction)


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-5"])
def test_memory_budget_inf_is_a_one_line_error(tmp_path, value):
    (tmp_path / "model.py").write_text(MODEL)
    line = one_error_line(gradc("compile", "model.py", "-o", "out", "--memory-budget", value, "--bind", "B=4",
                                cwd=tmp_path))
    assert line.startswith("gradc: error:") and "is not a size" in line
    assert not (tmp_path / "out").exists()


# ---- 2. -o -------------------------------------------------------------------------------------------
def test_out_that_is_a_file_or_under_a_file(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "somefile").write_text("keep me")
    line = one_error_line(gradc("compile", "model.py", "-o", "somefile", "--no-warm", cwd=tmp_path))
    assert line == "gradc: error: -o somefile: is a file, not a folder", line
    line = one_error_line(gradc("compile", "model.py", "-o", "somefile/sub", "--no-warm", cwd=tmp_path))
    assert line == "gradc: error: -o somefile/sub: somefile is a file, not a folder", line
    assert (tmp_path / "somefile").read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder: the case below covers root")
def test_out_unwritable_folder(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        for out in ("ro", "ro/sub"):
            line = one_error_line(gradc("compile", "model.py", "-o", out, "--no-warm", cwd=tmp_path))
            assert line.startswith(f"gradc: error: -o {out}: cannot ") and "Permission denied" in line, line
        assert os.listdir(tmp_path / "ro") == []
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_out_where_even_root_cannot_write(tmp_path):
    """sysfs refuses new folders to root too (the chmod case cannot test root)."""
    target = "/sys/gradc-robustness-test"
    try:
        os.mkdir(target)
    except OSError:
        pass
    else:
        os.rmdir(target)
        pytest.skip("this system lets us create folders in /sys")
    (tmp_path / "model.py").write_text(MODEL)
    for out in (target, "/sys"):
        line = one_error_line(gradc("compile", "model.py", "-o", out, "--no-warm", cwd=tmp_path))
        assert line.startswith(f"gradc: error: -o {out}: cannot "), line


# ---- 3. the model file raises ---------------------------------------------------------------------------
@pytest.mark.parametrize("source,expected", [
    ("import gradc as gc\nm = gc.Model('s')\nx = (1,\n", r"model\.py:3: SyntaxError: .+"),
    ("import gradc as gc\nm = gc.Model('s')\ny = gc.conv9d(m.input('x', (3,)))\n",
     r"model\.py:3: AttributeError: module 'gradc' has no attribute 'conv9d': did you mean gc\.conv2d\?"),
    ("import gradc\n\ndef build():\n    raise KeyError('oops')\n\nbuild()\n", r"model\.py:4: KeyError: 'oops'"),
    ("import json\n\njson.loads('{')\n", r"model\.py:3: JSONDecodeError: Expecting property name.*"),
])
def test_model_file_errors_are_one_line_with_file_and_line(tmp_path, source, expected):
    (tmp_path / "model.py").write_text(source)
    line = one_error_line(gradc("compile", "model.py", "-o", "out", cwd=tmp_path))
    assert re.fullmatch(r"gradc: error: " + expected, line), line
    assert not (tmp_path / "out").exists()
    r = gradc("--debug", "compile", "model.py", "-o", "out", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr and 'model.py", line' in r.stderr, r.stderr


# ---- 4 and 6. signals ------------------------------------------------------------------------------------
def test_ctrl_c_in_the_model_file(tmp_path):
    marker = tmp_path / "started"
    (tmp_path / "model.py").write_text(f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(60)\n")
    r = spawn_and_signal(["compile", "model.py", "-o", "out"], tmp_path, marker, signal.SIGINT)
    assert one_error_line(r, 130) == "gradc: interrupted"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 130, "gradc: interrupted"),
                                           (signal.SIGTERM, 143, "gradc: terminated")])
def test_signal_while_writing_leaves_nothing(tmp_path, sig, code, line):
    """The signal arrives while the build is half-written (a slow `dot` runs in the temp folder)."""
    (tmp_path / "model.py").write_text(MODEL)
    marker = tmp_path / "dot-started"
    path = fake_dot(tmp_path, f"touch {marker}\nsleep 30")
    r = spawn_and_signal(["compile", "model.py", "-o", "out", "--no-warm", "--order", "1"], tmp_path, marker, sig,
                         path_prefix=path)
    assert one_error_line(r, code) == line
    assert not (tmp_path / "out").exists(), os.listdir(tmp_path / "out")
    # into an existing build: the old build stays whole, and nothing else is left
    assert gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path).returncode == 0
    before = (tmp_path / "out" / "tiny.py").read_text()
    os.unlink(marker)
    r = spawn_and_signal(["compile", "model.py", "-o", "out", "--no-warm"], tmp_path, marker, sig, path_prefix=path)
    assert one_error_line(r, code) == line
    assert (tmp_path / "out" / "tiny.py").read_text() == before
    assert leftovers(str(tmp_path / "out")) == []


def test_ctrl_c_after_the_switch_names_the_new_build(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the last moments of a compile (the new build's import, after it replaced the old one)
    said "interrupted", as if the old build were still there (a new user's trial, 1 run in 4)."""
    from gradc import cli
    (tmp_path / "model.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)

    def interrupted(path, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(compiler, "import_file", interrupted)
    assert cli.main(["compile", "model.py", "-o", "out", "--no-warm", "--order", "1"]) == 130
    out = os.path.join("out", "tiny.py")
    assert capsys.readouterr().err == f"gradc: interrupted after the new build was in place ({out} is it)\n"
    assert "def loss_and_grad(" in (tmp_path / "out" / "tiny.py").read_text()


KILL_AT_REPLACE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, os.getcwd())
    import gradc as gc
    from model import m
    calls = [0]
    real = os.replace
    def replace(*a, **k):
        calls[0] += 1
        if calls[0] == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    os.replace = replace
    gc.compile(m, out="out", order=1, warm_cache=False)
""")


def test_sigkill_during_compile_keeps_a_whole_build_and_the_next_compile_cleans_up(tmp_path):
    """Killed at each os.replace of a compile in turn: NAME.py and NAME.graph.json always come from the
    same build, and the next compile leaves nothing of the killed one behind."""
    (tmp_path / "model.py").write_text(MODEL)
    assert gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path).returncode == 0
    (tmp_path / "model.py").write_text(MODEL.replace("16", "17"))
    (tmp_path / "kill.py").write_text(KILL_AT_REPLACE)
    out = tmp_path / "out"
    for k in range(1, 15):
        r = subprocess.run([sys.executable, "kill.py", str(k)], cwd=tmp_path, capture_output=True, text=True,
                           env=_env(), timeout=120)
        module = (out / "tiny.py").read_text()
        graph = json.loads((out / "tiny.graph.json").read_text())
        w0 = tuple(graph["graph"]["params"]["W0"]["shape"])
        assert f"'W0': {w0}" in module, (k, w0)   # the module and its dump are of one build
        if r.returncode == 0:
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
    else:
        raise AssertionError("the compile never finished")
    assert w0 == (6, 17) and k > 1
    assert leftovers(str(out)) == []
    # a killed compile's leftovers go with the next compile
    r = subprocess.run([sys.executable, "kill.py", "1"], cwd=tmp_path, capture_output=True, env=_env(), timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path).returncode == 0
    assert leftovers(str(out)) == []


def test_compile_keeps_the_temp_folder_of_a_live_compile(tmp_path):
    """Only leftovers of dead processes are removed: a concurrent compile's folder stays."""
    (tmp_path / "model.py").write_text(MODEL)
    live = subprocess.Popen(["sleep", "60"])
    try:
        store = tmp_path / "out" / ".gradc"
        store.mkdir(parents=True)
        busy = store / f"tiny.{live.pid}-0a1b"
        busy.mkdir()
        assert gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path).returncode == 0
        assert busy.is_dir()
        assert leftovers(str(tmp_path / "out")) == [os.path.join(".gradc", busy.name)]
    finally:
        live.kill()
        live.wait()


def test_build_files_switch_together(tmp_path):
    """The contract's names are links into one build folder; a new build replaces them all at once."""
    (tmp_path / "model.py").write_text(MODEL)
    out = tmp_path / "out"
    assert gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path).returncode == 0
    names = ["tiny.py", "tiny.graph.json", "tiny.graph.dot", "tiny.memplan.json"]
    first = {os.path.dirname(os.path.realpath(out / n)) for n in names}
    assert len(first) == 1
    assert gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path).returncode == 0
    second = {os.path.dirname(os.path.realpath(out / n)) for n in names}
    assert len(second) == 1 and second != first and not os.path.exists(first.pop())
    assert leftovers(str(out)) == []
    code = "import sys; sys.path.insert(0, 'out'); import tiny; print(tiny.MODEL_NAME, tiny.__file__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=_env())
    assert r.stdout.split() == ["tiny", str(out / "tiny.py")], r.stderr   # imported by the contract's name


# ---- 5. graphviz -------------------------------------------------------------------------------------
def test_slow_dot_does_not_fail_or_stall_the_compile(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    path = fake_dot(tmp_path, "sleep 60")
    t = time.time()
    r = gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path, path_prefix=path,
              timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.time() - t < 30
    assert not (tmp_path / "out" / "tiny.graph.svg").exists()
    assert "tiny.graph.svg" in r.stderr and "timed out" in r.stderr


def test_failing_dot_leaves_no_svg(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    # writes half an SVG, then fails
    path = fake_dot(tmp_path, 'while [ $# -gt 1 ]; do [ "$1" = -o ] && echo "<svg" > "$2"; shift; done\nexit 3')
    r = gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", cwd=tmp_path, path_prefix=path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "out" / "tiny.graph.svg").exists()
    assert "dot failed" in r.stderr


def test_large_graph_skips_the_svg(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", fake_dot(tmp_path, f"echo x >> {calls}") + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(compiler, "SVG_MAX_NODES", 3)
    m = _tiny_model("svgskip")
    notes = []
    compiler.compile_model(m, out=str(tmp_path / "out"), order=1, warm=False, notes=notes)
    assert not calls.exists() and not (tmp_path / "out" / "svgskip.graph.svg").exists()
    assert any("svgskip.graph.svg" in n and "nodes" in n for n in notes), notes


# ---- 7. checkpoints --------------------------------------------------------------------------------------
def _tiny_model(name):
    m = gc.Model(name)
    x = m.input("x", ("B", 3))
    y = m.input("y", ("B",), dtype="int64")
    m.minimize(gc.softmax_cross_entropy(x @ m.param("w", (3, 4)), y))
    return m


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return gc.compile(_tiny_model("r_small"), out=str(tmp_path_factory.mktemp("rob")), warm_cache=False, order=1)


def _rewrite(src, dst, change):
    with np.load(src) as f:
        arrays = {k: f[k] for k in f.files}
    change(arrays)
    np.savez(dst, **arrays)


def _meta(**changes):
    def change(arrays):
        meta = json.loads(str(arrays["meta"]))
        meta.update(changes)
        arrays["meta"] = np.array(json.dumps(meta))
    return change


@pytest.mark.parametrize("damage,what", [
    (lambda p, good: open(p, "wb").close(), "empty"),
    (lambda p, good: open(p, "wb").write(open(good, "rb").read()[:300]), "truncated"),
    (lambda p, good: open(p, "wb").write(open(good, "rb").read()[:-30]), "truncated"),
    (lambda p, good: open(p, "w").write("junk, not a checkpoint\n" * 20), "junk"),
    (lambda p, good: np.save(p, np.zeros(3)) or os.replace(p + ".npy", p), "npy"),
    (lambda p, good: _rewrite(good, p, lambda a: a.pop("param/w")), "missing param"),
    (lambda p, good: _rewrite(good, p, lambda a: a.pop("state/momentum")), "missing state"),
    (lambda p, good: _rewrite(good, p, lambda a: a.update({"param/w": np.zeros((4, 3), np.float32)})), "shape"),
    (lambda p, good: _rewrite(good, p, lambda a: a.update({"param/w": np.zeros((3, 4))})), "dtype"),
    (lambda p, good: _rewrite(good, p, lambda a: a.update({"state/momentum": np.zeros(12)})), "state dtype"),
    (lambda p, good: _rewrite(good, p, lambda a: a.update({"meta": np.array("{not json")})), "meta json"),
    (lambda p, good: _rewrite(good, p, lambda a: a.update({"meta": np.array([1, 2])})), "meta array"),
    (lambda p, good: _rewrite(good, p, lambda a: a.update({"meta": np.array("[1, 2]")})), "meta list"),
    (lambda p, good: _rewrite(good, p, _meta(lr=float("nan"))), "meta nan"),
    (lambda p, good: _rewrite(good, p, _meta(lr="fast")), "meta str"),
    (lambda p, good: _rewrite(good, p, _meta(steps=-1)), "meta steps"),
    (lambda p, good: _rewrite(good, p, _meta(steps=1.5)), "meta steps float"),
    (lambda p, good: _rewrite(good, p, _meta(betas=[0.9])), "meta betas"),
    (lambda p, good: _rewrite(good, p, _meta(optimizer="rmsprop")), "meta optimizer"),
    (lambda p, good: _rewrite(good, p, lambda a: json.loads(str(a["meta"])) and a.update(
        {"meta": np.array(json.dumps({k: v for k, v in json.loads(str(a["meta"])).items() if k != "eps"}))})),
     "meta key"),
])
def test_bad_checkpoints_raise_value_error_naming_the_file(small, tmp_path, damage, what):
    good = str(tmp_path / "good.npz")
    tr = small.Trainer(small.init_params(0), optimizer="sgd", lr=0.1, momentum=0.5)
    tr.save(good)
    small.Trainer.load(good)
    bad = str(tmp_path / "bad.npz")
    damage(bad, good)
    with pytest.raises(ValueError) as e:
        small.Trainer.load(bad)
    assert str(e.value).startswith(f"{bad}: "), (what, str(e.value))


def test_corrupted_member_is_caught(small, tmp_path):
    path = str(tmp_path / "c.npz")
    small.Trainer(small.init_params(0)).save(path)
    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("param/w.npy")
    at = info.header_offset + 30 + len(info.filename) + info.compress_size - 8   # inside w's values
    data[at:at + 4] = b"\xff\xff\xff\x7f"
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=re.escape(path) + ": "):
        small.Trainer.load(path)


def test_missing_checkpoint_is_file_not_found(small, tmp_path):
    with pytest.raises(FileNotFoundError):
        small.Trainer.load(str(tmp_path / "nope.npz"))


def test_save_keeps_mode_and_writes_through_a_symlink(small, tmp_path):
    tr = small.Trainer(small.init_params(0))
    path = tmp_path / "ck.npz"
    tr.save(str(path))
    path.chmod(0o640)
    tr.steps = 3
    tr.save(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert small.Trainer.load(str(path)).steps == 3
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "target.npz"
    target.write_bytes(b"old")
    target.chmod(0o604)
    link = tmp_path / "link.npz"
    link.symlink_to(target)
    tr.save(str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o604
    assert small.Trainer.load(str(target)).steps == 3
    assert os.listdir(tmp_path / "real") == ["target.npz"]


KILL_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import r_small
    tr = r_small.Trainer(r_small.init_params(0))
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    tr.save(sys.argv[2])
""")


def test_sigkill_during_save_leaves_a_temp_that_the_next_save_removes(small, tmp_path):
    path = tmp_path / "ck.npz"
    (tmp_path / "kill.py").write_text(KILL_IN_SAVE)
    r = subprocess.run([sys.executable, str(tmp_path / "kill.py"), os.path.dirname(small.__file__), str(path)],
                       capture_output=True, env=_env(), timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = [f for f in os.listdir(tmp_path) if f.startswith(".ckpt-")]
    assert left and not path.exists()
    live = subprocess.Popen(["sleep", "60"])
    try:
        busy = tmp_path / f".ckpt-{live.pid}-0a1b.npz"   # a live process's temp is not touched
        busy.write_bytes(b"x")
        small.Trainer(small.init_params(0)).save(str(path))
        assert sorted(f for f in os.listdir(tmp_path) if f.startswith(".ckpt-")) == [busy.name]
    finally:
        live.kill()
        live.wait()


def test_a_save_leaves_the_temps_of_writers_in_other_pid_namespaces(small, tmp_path):
    """A writer in another container or on another host sharing the folder has pids this process cannot see:
    its temp file was taken for a dead process's and removed mid-save (each of its saves then failed). Such a
    temp is now removed only when a day old."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    ours = tmp_path / f".ckpt-{gone.pid}.{pid_namespace()}-0a1b.npz"
    other = "0" * 8 if pid_namespace() != "0" * 8 else "1" * 8
    elsewhere, old = (tmp_path / f".ckpt-{gone.pid}.{other}-{t}.npz" for t in ("0a1c", "0a1d"))
    for f in (ours, elsewhere, old):
        f.write_bytes(b"x")
    os.utime(old, (time.time() - 2 * ELSEWHERE_STALE_SECONDS,) * 2)
    small.Trainer(small.init_params(0)).save(str(tmp_path / "ck.npz"))
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith(".ckpt-")) == [elsewhere.name]


# ---- 8. planted symlinks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,png,args", [pytest.param("--memory", "memory.png", ["--bind", "B=4"], marks=pytest.mark.slow),
                                          ("--partition", "partition.png", ["--bind", "B=4", "--devices", "2"])])
def test_inspect_png_replaces_a_planted_symlink_and_goes_with_its_build(tmp_path, flag, png, args):
    pytest.importorskip("matplotlib")
    (tmp_path / "model.py").write_text(MODEL)
    r = gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out" / f"tiny.{png}").symlink_to(victim)
    r = gradc("inspect", "out/tiny", flag, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious"
    written = tmp_path / "out" / f"tiny.{png}"   # in the build's folder, linked as the dumps are
    assert os.readlink(written) == f".gradc/tiny/tiny.{png}" and written.read_bytes().startswith(b"\x89PNG")
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith(".") and f != ".gradc"]
    # the next compile takes the picture away with the build it was drawn of (it stayed, stale, beside the new one)
    r = gradc("compile", "model.py", "-o", "out", "--no-warm", "--order", "1", "--bind", "B=5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not os.path.lexists(written) and victim.read_text() == "precious"


# ---- 9. inspect does not run a build's code ---------------------------------------------------------------
@pytest.fixture
def cuda_build(tmp_path):
    m = gc.Model("r_cuda")
    x = m.input("x", ("B", 6))
    y = m.input("y", ("B",), dtype="int64")
    m.minimize(gc.softmax_cross_entropy(x @ m.param("w", (6, 3)), y))
    compiler.compile_model(m, out=str(tmp_path / "out"), target="cuda", order=1, warm_cache=False)
    return str(tmp_path / "out" / "r_cuda")


@pytest.fixture
def gpu_here(monkeypatch):
    """Pretend a GPU is present, and record every import of a build."""
    import gradc.runtime.cuda as rc

    class FakeCuda:
        @staticmethod
        def is_available():
            return True

    imports = []

    def fake_import(path, name):
        imports.append(path)
        raise RuntimeError("the build's code ran")

    monkeypatch.setattr(rc, "simulated", lambda: False)
    monkeypatch.setattr(rc, "load_cuda", lambda: FakeCuda)
    monkeypatch.setattr(compiler, "import_file", fake_import)
    return imports


def test_inspect_kernels_and_ptx_read_only_dumps(cuda_build, gpu_here):
    from gradc.inspect_build import report
    text = report(cuda_build, kernels=True)
    assert "--run-module" in text and "def g0_gemm" in text
    with open(cuda_build + ".graph.json") as f:
        kernel = json.load(f)["graph"]["kernels"][0]["name"]
    text = report(cuda_build, ptx_of=kernel)
    assert "--run-module" in text
    assert gpu_here == []
    with pytest.raises(RuntimeError, match="the build's code ran"):
        report(cuda_build, kernels=True, run_module=True)
    assert gpu_here == [cuda_build + ".py"]


def test_inspect_help_documents_the_run_flag():
    r = subprocess.run([sys.executable, "-m", "gradc.cli", "inspect", "--help"], capture_output=True, text=True,
                       env=_env())
    text = " ".join(r.stdout.split())
    assert "--run-module" in text and "imports and runs the build's code: only for builds you trust" in text


# ---- 10. gc.compile's documented options -----------------------------------------------------------------
def test_compile_documented_warm_keyword(tmp_path):
    mod = gc.compile(_tiny_model("r_warm"), out=str(tmp_path), warm=False, order=1)
    assert mod.MODEL_NAME == "r_warm" and not os.path.isdir(tmp_path / "__pycache__" / "r_warm")
    with pytest.raises(GradcError, match="unknown option 'warmth': did you mean 'warm'"):
        gc.compile(_tiny_model("r_warm2"), out=str(tmp_path), warmth=False)
    with pytest.raises(GradcError, match="unknown option 'bnd': did you mean 'bind'"):
        gc.compile(_tiny_model("r_warm2"), out=str(tmp_path), bnd={"B": 2})
    with pytest.raises(GradcError, match=r"unknown option 'zzz' \(options: out, target, dtype, order, bind, warm, "):
        gc.compile(_tiny_model("r_warm2"), out=str(tmp_path), zzz=1)


def test_compile_docstring_matches_the_code():
    """Every option gc.compile documents is accepted, with the default it documents."""
    doc = inspect.getdoc(gc.compile).split("Options")[1]
    documented = dict(re.findall(r"\b(\w+)=(\"\w*\"|\w+)", doc))
    params = inspect.signature(compiler.compile_model).parameters
    assert set(documented) >= {"out", "target", "dtype", "order", "bind", "warm", "memory_budget", "devices"}
    for key, default in documented.items():
        name = "warm_cache" if key == "warm" else key
        actual = params[name].default if name in params else None   # the device options default to None
        assert ast.literal_eval(default) == actual, (key, default, actual)


# ---- found by trying gradc as a new user -----------------------------------------------------------------
def test_compile_never_replaces_a_file_it_did_not_write(tmp_path):
    """`gradc compile tiny.py -o .` once replaced the model file tiny.py with a link to the module."""
    (tmp_path / "tiny.py").write_text(MODEL)
    line = one_error_line(gradc("compile", "tiny.py", "-o", ".", "--warm", "none", cwd=tmp_path))
    assert "tiny.py exists and was not written by gradc" in line, line
    assert (tmp_path / "tiny.py").read_text() == MODEL and not (tmp_path / ".gradc").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tiny.graph.json").write_text("mine")
    line = one_error_line(gradc("compile", "tiny.py", "-o", "out", "--warm", "none", cwd=tmp_path))
    assert "tiny.graph.json exists and was not written by gradc" in line
    assert (tmp_path / "out" / "tiny.graph.json").read_text() == "mine"
    (tmp_path / "out" / "tiny.graph.json").unlink()
    (tmp_path / "out" / ".gradc").mkdir()   # the store's link to the current build, as a file of the user's
    (tmp_path / "out" / ".gradc" / "tiny").write_text("mine")
    line = one_error_line(gradc("compile", "tiny.py", "-o", "out", "--warm", "none", cwd=tmp_path))
    assert ".gradc/tiny exists and was not written by gradc" in line, line
    assert (tmp_path / "out" / ".gradc" / "tiny").read_text() == "mine"
    assert sorted(os.listdir(tmp_path / "out")) == [".gradc"] and os.listdir(tmp_path / "out" / ".gradc") == ["tiny"]
    # a link of the user's is theirs too (a trial's out/tiny.py -> ../tiny.py was replaced by gradc's own)
    (tmp_path / "out" / ".gradc" / "tiny").unlink()
    (tmp_path / "out" / "tiny.py").symlink_to("../tiny.py")
    line = one_error_line(gradc("compile", "tiny.py", "-o", "out", "--warm", "none", cwd=tmp_path))
    assert "tiny.py is a link to ../tiny.py that gradc did not make" in line, line
    assert os.readlink(tmp_path / "out" / "tiny.py") == "../tiny.py" and (tmp_path / "tiny.py").read_text() == MODEL
    (tmp_path / "out" / "tiny.py").unlink()   # gone, a compile goes through; the next one replaces its own links
    for _ in range(2):
        assert gradc("compile", "tiny.py", "-o", "out", "--warm", "none", cwd=tmp_path).returncode == 0
    assert os.readlink(tmp_path / "out" / "tiny.py") == os.path.join(".gradc", "tiny", "tiny.py")


def test_command_line_slips(tmp_path):
    (tmp_path / "tiny.py").write_text(MODEL)
    line = one_error_line(gradc("compile", "tiny.py", "--bind", "B=4", "--bind", "B=5", cwd=tmp_path))
    assert "B is bound twice" in line
    line = one_error_line(gradc("--bogus", cwd=tmp_path))
    assert line.endswith("(gradc --help for usage)"), line
    assert one_error_line(gradc("compile", cwd=tmp_path)).endswith("(gradc compile --help for usage)")
    # a misspelt flag is named, with the flag it was likely meant to be (a fresh user's trial: `--dtyp float64` was
    # 'unrecognized arguments', `compile --bogus` said the model file was missing)
    for argv, said in ((["compile", "tiny.py", "--dtyp", "float64"], "unrecognized argument --dtyp: did you mean "
                                                                      "--dtype? (gradc compile --help for usage)"),
                       (["compile", "--bogus"], "unrecognized argument --bogus (gradc compile --help for usage)"),
                       (["inspect", "out/tiny", "--kernal"], "unrecognized argument --kernal: did you mean --kernels? "
                                                             "(gradc inspect --help for usage)")):
        assert one_error_line(gradc(*argv, cwd=tmp_path)) == f"gradc: error: {said}", argv
    for flags in (["--warm", "all", "--no-warm"], ["--no-warm", "--warm", "first"]):   # (both were taken: none warmed)
        line = one_error_line(gradc("compile", "tiny.py", "-o", "out", *flags, cwd=tmp_path))
        assert line == f"gradc: error: --no-warm and --warm {flags[flags.index('--warm') + 1]} ask for opposite " \
                       "things: give one", line
    line = one_error_line(gradc("compile", "tiny.py", "-o", "", "--no-warm", cwd=tmp_path))   # (was this folder)
    assert line.startswith("gradc: error: -o '' (out=''): an empty path"), line
    assert sorted(os.listdir(tmp_path)) == ["tiny.py"]


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path):
    (tmp_path / "tiny.py").write_text(MODEL)
    assert gradc("compile", "tiny.py", "-o", "out", "--warm", "none", cwd=tmp_path).returncode == 0
    r = subprocess.run(f"{sys.executable} -m gradc.cli inspect out/tiny --graph | head -1", shell=True, cwd=tmp_path,
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.stdout.startswith("model tiny") and r.stderr == "", r.stderr


def test_order_1_build_refuses_every_second_order_entry(small):
    p = small.init_params(0)
    x, y = np.ones((2, 3), np.float32), np.array([0, 1])
    for call in (lambda: small.hvp(p, p, x=x, y=y), lambda: small.hessian(p, x=x, y=y),
                 lambda: small.hessian_rows(p, 0, 1, x=x, y=y)):
        with pytest.raises(RuntimeError, match="--order 2"):
            call()


def test_save_names_the_path_the_user_gave_and_bad_lr_warns_nothing(small, tmp_path, recwarn):
    tr = small.Trainer(small.init_params(0))
    with pytest.raises(FileNotFoundError, match=r"nowhere/ckpt.npz: the folder .*nowhere does not exist"):
        tr.save(str(tmp_path / "nowhere" / "ckpt.npz"))
    with pytest.raises(ValueError, match="lr must be a finite number >= 0 in float32"):
        small.Trainer(small.init_params(0), lr=1e39)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_inspect_and_compile_path_slips(tmp_path):
    """A trial's slips: `inspect build/tiny/` (a shell's completion) read build/tiny/.graph.json; a folder of
    builds said only "not found"; a removed memory plan printed a line and exited 0; --ptx of a name a CPU
    build lacks listed its kernels, which have no PTX either; gc.compile(out=None) spoke of out=''."""
    from gradc.inspect_build import report
    gc.compile(_tiny_model("r_paths"), out=str(tmp_path / "b"), warm=False, order=1)
    assert report(str(tmp_path / "b" / "r_paths") + os.sep).startswith("model r_paths")
    with pytest.raises(GradcError, match=r"b is a folder of builds: .*b/r_paths\)"):
        report(str(tmp_path / "b"))
    with pytest.raises(GradcError, match="this build is for --target cpu"):
        report(str(tmp_path / "b" / "r_paths"), ptx_of="no_such_kernel")
    os.unlink(tmp_path / "b" / "r_paths.memplan.json")
    line = one_error_line(gradc("inspect", "b/r_paths", "--memory", cwd=tmp_path))
    assert "r_paths.memplan.json: not found" in line, line
    for out in (None, 5):
        with pytest.raises(GradcError, match=f"out={out}: give the output folder as a str or path"):
            gc.compile(_tiny_model("r_paths"), out=out, warm=False)
