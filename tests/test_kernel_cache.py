"""The kernel cache (gradc/runtime/kernel_cache.py): each distinct kernel compiles once, for every build.

Compile counts come from Numba's own statistics of each kernel's dispatcher (cache misses are
compiles), never from timings. Each compile that counts runs in a fresh process, as a user's would.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gradc as gc
from gradc.runtime import kernel_cache
from conftest import cuda_env

# the scripts' common start: imports and a tanh MLP of `layers` layers of `width`
PRELUDE = textwrap.dedent('''
    import json, os, sys
    import numpy as np
    import gradc as gc
    from gradc.runtime import kernel_cache as kc

    def mlp(name, layers, width=8):
        m = gc.Model(name)
        x = m.input("x", ("B", width))
        y = m.input("y", ("B",), dtype="int64")
        h = x
        for i in range(layers):
            h = gc.tanh(h @ m.param(f"W{i}", (width, width)) + m.param(f"b{i}", (width,)))
        m.minimize(gc.softmax_cross_entropy(h, y))
        return m
''')

RUN = PRELUDE + textwrap.dedent('''
    name, layers, out, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if how == "compile":
        mod = gc.compile(mlp(name, layers), out=out, order=1)
    else:   # import a build made before
        sys.path.insert(0, out)
        mod = __import__(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = rng.integers(0, 8, 5)
    loss, grads = mod.loss_and_grad(mod.init_params(0), x=x, y=y)
    print(json.dumps({"counts": kc.compile_counts(name), "stats": kc.STATS, "loss": loss}))
''')


def run(tmp_path, cache, *args, wait=True):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = dict(os.environ, GRADC_CACHE_DIR=str(cache))
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return finish(proc) if wait else proc


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def kernel_files(cache):
    folder = cache / "kernels"
    return sorted(f for f in os.listdir(folder) if f.endswith(".py")) if folder.is_dir() else []


def test_second_model_with_the_same_layers_compiles_no_kernel(tmp_path):
    cache = tmp_path / "cache"
    first = run(tmp_path, cache, "first_mlp", 2, tmp_path / "a", "compile")
    assert first["counts"]["compiled"] > 0 and first["counts"]["not_cached"] == 0
    files = kernel_files(cache)
    helpers = [f for f in files if "\ndef kernel(x):" in (cache / "kernels" / f).read_text()]
    assert len(helpers) == 1   # the scalar helper _tanh, in a file of its own that every caller loads
    assert len(files) - len(helpers) == first["counts"]["kernels"] and len(files) == first["stats"]["written"]
    second = run(tmp_path, cache, "second_mlp", 3, tmp_path / "b", "compile")   # another model, the same layers
    assert second["counts"]["kernels"] > 0
    assert second["counts"]["compiled"] == 0, second            # no Numba compile of any kernel
    # (a helper's code comes inside its callers', loaded without its own)
    assert second["counts"]["from_cache"] >= first["counts"]["compiled"] - len(helpers)
    assert second["stats"]["written"] == 0 and kernel_files(cache) == files   # nothing new in the cache
    # importing the build again later compiles nothing either
    again = run(tmp_path, cache, "second_mlp", 3, tmp_path / "b", "import")
    assert again["counts"]["compiled"] == 0 and again["loss"] == second["loss"]


@pytest.mark.slow
def test_concurrent_compiles_into_one_cache_both_succeed(tmp_path):
    cache = tmp_path / "cache"
    procs = [run(tmp_path, cache, f"same_{k}", 2, tmp_path / f"out{k}", "compile", wait=False) for k in range(2)]
    results = [finish(p) for p in procs]
    assert results[0]["loss"] == results[1]["loss"]
    assert all(r["counts"]["not_cached"] == 0 for r in results)
    assert not [f for f in os.listdir(cache / "kernels") if f.startswith(".tmp")]   # no temp file left
    # what they wrote is whole: a third build loads every kernel and compiles none
    third = run(tmp_path, cache, "same_2", 2, tmp_path / "out2", "compile")
    assert third["counts"]["compiled"] == 0 and third["stats"]["rewritten"] == 0


@pytest.mark.slow
def test_corrupted_cache_files_are_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    first = run(tmp_path, cache, "corrupt_mlp", 1, tmp_path / "a", "compile")
    files = kernel_files(cache)
    good = {f: (cache / "kernels" / f).read_text() for f in files}
    (cache / "kernels" / files[0]).write_text("def broken(:\n")             # not Python
    (cache / "kernels" / files[1]).write_text(good[files[1]].replace("def kernel(", "def kernel2("))   # wrong text
    (cache / "kernels" / files[1]).chmod(0o644)
    machine_code = [cache / "kernels" / "__pycache__" / f for f in os.listdir(cache / "kernels" / "__pycache__")
                    if f.endswith(".nbc")]
    for f in machine_code:   # Numba's data files cut in half: they no longer unpickle
        f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
    shutil.rmtree(tmp_path / "a" / "__pycache__")   # the build's compiled entry points: they load the kernels again
    again = run(tmp_path, cache, "corrupt_mlp", 1, tmp_path / "a", "import")
    assert again["loss"] == first["loss"]
    assert again["stats"]["rewritten"] == 2 and again["counts"]["not_cached"] == 0
    assert again["stats"]["bad_numba_cache"] >= 1 and again["counts"]["compiled"] > 0
    assert {f: (cache / "kernels" / f).read_text() for f in files} == good   # the files are whole again


@pytest.mark.slow
def test_damaged_numba_index_files_are_written_again(tmp_path):
    """A Numba index file (.nbi) cut short or emptied: the kernel compiles again and its index is
    written anew, in a new build and in a build made before (saving used to raise UnpicklingError)."""
    cache = tmp_path / "cache"
    first = run(tmp_path, cache, "index_mlp", 1, tmp_path / "a", "compile")
    indexes = sorted((cache / "kernels" / "__pycache__").glob("*.nbi"))
    assert indexes
    for k, f in enumerate(indexes):
        f.write_bytes(b"" if k % 2 else f.read_bytes()[:40])
    again = run(tmp_path, cache, "index_mlp", 1, tmp_path / "a", "import")
    second = run(tmp_path, cache, "index_mlp_two", 1, tmp_path / "b", "compile")
    assert again["loss"] == second["loss"] == first["loss"]
    assert again["counts"]["compiled"] > 0 and again["stats"]["bad_numba_cache"] >= 1
    third = run(tmp_path, cache, "index_mlp_three", 1, tmp_path / "c", "compile")   # the indexes are whole again
    assert third["counts"]["compiled"] == 0 and third["loss"] == first["loss"]


def test_unwritable_cache_still_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("GRADC_CACHE_DIR", str(blocker / "cache"))   # a folder under a file: never writable, even as root
    m = gc.Model("uncached_model")
    x = m.input("x", (3, 4))
    w = m.param("w", (4,))
    m.minimize(gc.sum(gc.tanh(x * w)))
    before = kernel_cache.STATS["fallback"]
    mod = gc.compile(m, out=str(tmp_path / "build"), order=1, warm=False)
    counts = kernel_cache.compile_counts("uncached_model")
    assert counts["kernels"] > 0 and counts["not_cached"] == counts["kernels"]
    assert len(counts["not_cached_why"]) == 1 and counts["not_cached_why"][0].startswith(
        "the cache folder could not be written or read"), counts
    assert kernel_cache.STATS["fallback"] - before >= counts["kernels"]
    xv = np.linspace(-1, 2, 12, dtype=np.float32).reshape(3, 4)   # (not symmetric: the sum is no zero)
    loss, grads = mod.loss_and_grad({"w": np.ones(4, np.float32)}, x=xv)
    assert np.isclose(loss, np.tanh(xv.astype(np.float64)).sum(), rtol=1e-5)
    assert not os.path.exists(blocker / "cache")


def test_module_keeps_kernel_sources_and_says_where_they_come_from(tmp_path):
    m = gc.Model("readable_kernels")
    x = m.input("x", ("B", 4))
    w = m.param("w", (4, 4))
    m.minimize(gc.mean(gc.tanh(x @ w)))
    gc.compile(m, out=str(tmp_path), order=1, warm=False)
    text = (tmp_path / "readable_kernels.py").read_text()
    assert "from gradc.runtime.kernel_cache import cached_kernel" in text
    assert "compiled once per content" in text and "GRADC_CACHE_DIR" in text
    kernels = [line for line in text.splitlines() if line.startswith("def k")]
    assert kernels and text.count("@cached_kernel\ndef k") == len(kernels)
    assert "_tanh(" in text and "@kernel\ndef _tanh" in text   # helpers stay written in the module


def _import_source(folder, name, src):
    """The module of that name made of `src`, imported as a generated module is (decorators run)."""
    (folder / f"{name}.py").write_text(src)
    sys.path.insert(0, str(folder))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)


def _run_a_kernel_that_calls_another(tmp_path, name, callee_decorator):
    """Import a module whose cached kernel k1_apply calls k0_scale (decorated `callee_decorator`), run
    it, and return compile_counts for it."""
    src = textwrap.dedent(f'''
        import numpy as np
        from numba import njit
        from gradc.runtime.kernel_cache import cached_kernel
        DTYPE = "float64"
        FLOAT = np.float64


        @{callee_decorator}
        def k0_scale(x0, out):
            for i in range(out.shape[0]):
                out[i] = 2.0 * x0[i]


        @cached_kernel
        def k1_apply(x0, out):
            k0_scale(x0, out)
    ''')
    mod = _import_source(tmp_path, name, src)
    out = np.zeros(2)
    mod.k1_apply(np.ones(2), out)
    assert out.tolist() == [2.0, 2.0]
    return kernel_cache.compile_counts(name)


def test_an_unwritable_cache_is_the_one_reason_given(tmp_path, monkeypatch):
    """Where the cache folder cannot be written, a kernel that calls another is left out because its
    callee is: the count says why once, by the folder, not also 'some call a kernel ...'."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("GRADC_CACHE_DIR", str(blocker / "cache"))
    counts = _run_a_kernel_that_calls_another(tmp_path, "unwritable_calls", "cached_kernel")
    assert counts["not_cached"] == 2 and len(counts["not_cached_why"]) == 1, counts
    assert counts["not_cached_why"][0].startswith("the cache folder could not be written or read"), counts


def test_canonical_text_names_the_content_not_the_module(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / "cache"))
    src = textwrap.dedent('''
        import math
        import numpy as np
        from numba import njit
        from gradc.runtime.kernel_cache import cached_kernel
        kernel = njit(cache=False)
        DTYPE = "float32"
        FLOAT = np.float32


        @kernel
        def _helper(x):
            return x * 2.0


        @cached_kernel
        def k0_double(x0, out):
            """out = 2 x0"""
            for i in range(out.shape[0]):
                out[i] = _helper(x0[i])


        @cached_kernel
        def k7_twice(x0, out):
            """out = 2 x0"""
            for i in range(out.shape[0]):
                out[i] = _helper(x0[i])
    ''')
    mod = _import_source(tmp_path, "two_names", src)
    assert mod.k0_double is mod.k7_twice                 # one content, one kernel, whatever its name
    texts = [(tmp_path / "cache" / "kernels" / f).read_text() for f in kernel_files(tmp_path / "cache")]
    (text,) = [t for t in texts if "def kernel(x0, out):" in t]
    (helper,) = [t for t in texts if "def kernel(x):" in t]   # the helper has a file of its own, by its content
    assert "float32" in text and "float32" in helper and "return x * 2.0" in helper
    stem = [f for f in kernel_files(tmp_path / "cache") if (tmp_path / "cache" / "kernels" / f).read_text() == helper][0]
    assert f"_helper = kernel_in_file(__file__, '{stem}')" in text   # bound to its name: the body reads as written
    import numpy as np
    out = np.zeros(3)
    mod.k0_double(np.arange(3.0), out)
    assert out.tolist() == [0.0, 2.0, 4.0]


def test_a_kernel_that_loops_with_prange_is_compiled_parallel(tmp_path, monkeypatch):
    """BPPSA's sweeps loop with prange: the cache file compiles that kernel with parallel=True (its
    helpers stay serial), and it gives the serial loop's result."""
    monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / "cache"))
    src = textwrap.dedent('''
        import numpy as np
        from numba import njit, prange
        from gradc.runtime.kernel_cache import cached_kernel
        kernel = njit(cache=False)
        DTYPE = "float64"
        FLOAT = np.float64


        @kernel
        def _square(x):
            return x * x


        @cached_kernel
        def k0_row_sums_of_squares(x0, out):
            """out[i] = sum_j x0[i, j]^2"""
            for i in prange(x0.shape[0]):
                s = 0.0
                for j in range(x0.shape[1]):
                    s += _square(x0[i, j])
                out[i] = s
    ''')
    mod = _import_source(tmp_path, "parallel_kernel", src)
    texts = [(tmp_path / "cache" / "kernels" / f).read_text() for f in kernel_files(tmp_path / "cache")]
    (text,) = [t for t in texts if "def kernel(x0, out):" in t]
    (helper,) = [t for t in texts if "def kernel(x):" in t]   # the helper, in a file of its own
    assert "from numba import njit, prange" in text and "@_njit_parallel\ndef kernel(x0, out):" in text
    assert "prange" not in helper and "@_njit\ndef kernel(x):" in helper
    import numpy as np
    x = np.random.default_rng(0).normal(size=(37, 5))
    out = np.zeros(37)
    mod.k0_row_sums_of_squares(x, out)
    np.testing.assert_allclose(out, (x * x).sum(axis=1), rtol=1e-14)
    assert mod.k0_row_sums_of_squares.targetoptions.get("parallel") is True


def test_a_kernel_calling_gemm_strided_imports_it_and_names_its_version(tmp_path, monkeypatch):
    """A kernel may call gradc's gemm_strided (the conv kernels by taps do): its cache file imports it,
    and its header names a hash of gemm_strided's source, because Numba's cache of the kernel holds
    gemm_strided's machine code too (a changed helper must make a new file, not load the old code)."""
    monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / "cache"))
    src = textwrap.dedent('''
        import numpy as np
        from gradc.runtime.blas import gemm_strided
        from gradc.runtime.kernel_cache import cached_kernel
        DTYPE = "float64"
        FLOAT = np.float64


        @cached_kernel
        def k0_matmul_rows(a, b, out):
            """out = a @ b over flat row-major buffers"""
            gemm_strided(a, 0, 3, False, b, 0, 2, False, out, 0, 2, 4, 2, 3, 0.0)
    ''')
    mod = _import_source(tmp_path, "strided_kernel", src)
    (file,) = kernel_files(tmp_path / "cache")
    text = (tmp_path / "cache" / "kernels" / file).read_text()
    assert "from gradc.runtime.blas import gemm_strided" in text
    assert f"# gemm_strided: {kernel_cache.runtime_kernel_digest('gemm_strided')}" in text
    a, b, out = np.random.default_rng(0).normal(size=(4, 3)), np.random.default_rng(1).normal(size=(3, 2)), np.zeros(8)
    mod.k0_matmul_rows(a.ravel(), b.ravel(), out)
    np.testing.assert_allclose(out.reshape(4, 2), a @ b, rtol=1e-14)


CUDA_RUN = PRELUDE + textwrap.dedent('''
    name, layers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dev = gc.compile(mlp(name, layers, 6), out=os.path.join(out, "cuda"), target="cuda", dtype="float64", order=1)
    cpu = gc.compile(mlp(name + "_cpu", layers, 6), out=os.path.join(out, "cpu"), dtype="float64", order=1,
                     warm_cache=False)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((3, 6)), rng.integers(0, 6, 3)
    params = cpu.init_params(2)
    loss, grads = dev.loss_and_grad(params, x=x, y=y)
    want, want_grads = cpu.loss_and_grad(params, x=x, y=y)
    err = max([abs(loss - want) / abs(want)] +
              [float(np.max(np.abs(grads[k] - want_grads[k])) / np.max(np.abs(want_grads[k]))) for k in grads])
    files = sorted({os.path.basename(path) for mod, _, _, path in kc.KERNELS if mod == name and path})
    text = open(os.path.join(kc.kernel_dir(), files[0])).read()
    print(json.dumps({"counts": kc.compile_counts(name), "stats": kc.STATS, "err": err, "files": files,
                      "header": text.splitlines()[0], "jit": "cuda.jit(cache=True)" in text}))
''')


@pytest.mark.slow
def test_cuda_kernels_come_from_the_cache_too(tmp_path):
    """--target cuda under numba-cuda's simulator: every kernel is loaded from its cache file, the
    second model shares the first one's kernels, and the results are the CPU target's."""
    pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
    script, cache = tmp_path / "cuda_run.py", tmp_path / "cache"
    script.write_text(CUDA_RUN)
    env = cuda_env(GRADC_CACHE_DIR=str(cache))
    runs = []
    for name, layers in (("cuda_two", 2), ("cuda_three", 3)):
        proc = subprocess.run([sys.executable, str(script), name, str(layers), str(tmp_path / name)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    for run_ in runs:
        assert run_["err"] < 1e-12, run_
        assert run_["counts"]["kernels"] > 0 and run_["counts"]["not_cached"] == 0, run_
        on_gpu = os.environ.get("GRADC_TEST_ON_GPU") == "1"
        assert run_["jit"] and re.search(r"numba-cuda \d" if on_gpu else "numba-cuda simulator", run_["header"]), run_
    assert set(first["files"]) <= set(second["files"])                  # the same layers: the same kernels
    cuda_files = [f for f in kernel_files(cache) if "numba-cuda" in (cache / "kernels" / f).read_text().splitlines()[0]]
    assert sorted(cuda_files) == sorted(set(first["files"]) | set(second["files"]))
    assert second["stats"]["written"] < second["counts"]["kernels"]      # most of them were there already


SCAN_RUN = PRELUDE + textwrap.dedent('''
    name, out = sys.argv[1], sys.argv[2]
    m = gc.Model(name)
    x, h0 = m.input("x", ("T", "B", 3)), m.input("h0", ("B", 4))
    W, U, V = m.param("W", (4, 4)), m.param("U", (3, 4)), m.param("V", (4, 2))

    def step(h, xt):
        h = gc.tanh(h @ W + xt @ U)
        return h, h

    hT, hs = gc.scan(step, h0, x)
    m.minimize((hT @ V).sum() + (hs * hs).mean())
    mod = gc.compile(m, out=out, dtype="float64", order=1)
    rng = np.random.default_rng(0)
    loss, grads = mod.loss_and_grad(mod.init_params(0), x=rng.standard_normal((5, 2, 3)), h0=rng.standard_normal((2, 4)))
    callers = [p for _, _, _, p in kc.KERNELS if p and "kernel_in_file" in open(p).read()]
    print(json.dumps({"counts": kc.compile_counts(name), "stats": kc.STATS, "loss": loss, "callers": callers,
                      "grads": {k: v.tolist() for k, v in grads.items()}}))
''')


def test_a_scans_kernels_that_call_kernels_come_from_the_cache_too(tmp_path):
    """A scan's step calls the step's kernels, and its loop calls the step: their cache files load
    each callee from its own file, so a second model with the same scan compiles no kernel at all."""
    script, cache = tmp_path / "scan_run.py", tmp_path / "cache"
    script.write_text(SCAN_RUN)
    env = dict(os.environ, GRADC_CACHE_DIR=str(cache))
    runs = []
    for name in ("scan_first", "scan_second"):
        proc = subprocess.run([sys.executable, str(script), name, str(tmp_path / name)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["counts"]["not_cached"] == 0 and first["counts"]["compiled"] > 0, first
    assert first["callers"], "no cache file calls another kernel: the scan's step was not cached"
    assert second["counts"]["compiled"] == 0 and second["stats"]["written"] == 0, second
    assert second["loss"] == first["loss"] and second["grads"] == first["grads"]


def test_a_caller_names_its_callee_by_content(tmp_path, monkeypatch):
    """A kernel that calls another cached kernel loads it from the callee's file, named by its hash, in
    place of the module's name for it: the same callee under another name is the same caller file, and
    a changed callee is a new caller file (Numba's cache of the caller holds the callee's code too)."""
    monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / "cache"))
    template = textwrap.dedent('''
        import numpy as np
        from gradc.runtime.kernel_cache import cached_kernel
        DTYPE = "float64"
        FLOAT = np.float64


        @cached_kernel
        def {callee}(x0, out):
            """out = {factor} x0"""
            for i in range(out.shape[0]):
                out[i] = {factor} * x0[i]


        @cached_kernel
        def k9_twice(x0, work, out):
            """out = callee(callee(x0))"""
            {callee}(x0, work)  # a comment that names a file:line is not content
            {callee}(work, out)
    ''')
    texts = {}
    for module, callee, factor in (("calls_a", "k0_scale", 2.0), ("calls_b", "k3_scale", 2.0), ("calls_c", "k0_scale", 3.0)):
        mod = _import_source(tmp_path, module, template.format(callee=callee, factor=factor))
        out, work = np.zeros(3), np.zeros(3)
        mod.k9_twice(np.arange(3.0), work, out)
        np.testing.assert_allclose(out, factor * factor * np.arange(3.0))
        (path,) = [p for m, name, _, p in kernel_cache.KERNELS if m == module and name == "k9_twice"]
        (callee_path,) = [p for m, name, _, p in kernel_cache.KERNELS if m == module and name == callee]
        texts[module] = path
        text = open(path).read()
        (stem,) = re.findall(r"^(k_\w+) = kernel_in_file\(__file__, '\1\.py'\)$", text, re.M)
        assert f"    {stem}(x0, work)\n" in text and callee not in text and "comment" not in text
        # the callee's file as compiled code calls it: the module's kernel without its Python entry
        inner = open(os.path.join(os.path.dirname(path), stem + ".py")).read()
        assert inner == open(callee_path).read().replace("njit(cache=True, ", "njit(cache=True, no_cpython_wrapper=True, ")
        getattr(mod, callee)(np.arange(3.0), work)   # the module's own kernel is still Python's to call
        np.testing.assert_allclose(work, factor * np.arange(3.0))
    assert texts["calls_a"] == texts["calls_b"] != texts["calls_c"]


def test_a_kernel_that_calls_an_uncached_kernel_is_not_cached_and_says_so(tmp_path, monkeypatch):
    """A kernel whose callee is not in the cache (here a plain Numba function) compiles from the module,
    and the reason recorded (printed by `gradc compile`) says so, not a folder problem."""
    monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / "cache"))
    counts = _run_a_kernel_that_calls_another(tmp_path, "calls_uncached", "njit")
    assert counts["not_cached"] == 1 and counts["not_cached_why"] == ["some read a global that is not a cached kernel"]
