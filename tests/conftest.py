"""Shared helpers: float64 central finite differences through the IR interpreter."""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from gradc.interpret import evaluate
from gradc.passes.pipeline import build_training_graph
from gradc.runtime import conv_cores

EPS = 1e-6


def objective(graph, params, inputs):
    return float(evaluate(graph, params, inputs, [graph.objective])[graph.objective])


def numeric_grad(graph, params, inputs, which, name):
    """Central differences of the objective for one param or input, element by element."""
    source = params if which == "param" else inputs
    base = source[name]
    grad = np.zeros_like(base, dtype=np.float64)
    for idx in itertools.product(*(range(d) for d in base.shape)):
        old = base[idx]
        base[idx] = old + EPS
        up = objective(graph, params, inputs)
        base[idx] = old - EPS
        down = objective(graph, params, inputs)
        base[idx] = old
        grad[idx] = (up - down) / (2 * EPS)
    return grad


def assert_grads_match_fd(model, params, inputs, rtol=1e-5, atol=1e-7):
    """Symbolic gradients (interpreter, float64) of every trainable param and float input vs FD."""
    graph = build_training_graph(model, "float64")
    roots = [n for n in list(graph.grads.values()) + list(graph.input_grads.values()) if n is not None]
    values = evaluate(graph, params, inputs, roots) if roots else {}
    checked = 0
    for which, table in (("param", graph.grads), ("input", graph.input_grads)):
        for name, node in table.items():
            source = params if which == "param" else inputs
            fd = numeric_grad(graph, params, inputs, which, name)
            got = values[node] if node is not None else np.zeros_like(fd)
            np.testing.assert_allclose(got, fd, rtol=rtol, atol=atol, err_msg=f"gradient of {which} {name!r}")
            assert np.shape(got) == np.shape(source[name])
            checked += 1
    assert checked, "nothing was differentiated"
    return graph


def cuda_env(**extra):
    """The environment of a subprocess that runs generated CUDA code: numba-cuda's simulator, or
    the real driver when GRADC_TEST_ON_GPU=1 (on a lent GPU machine; README, "Tests")."""
    env = dict(os.environ, **extra)
    if os.environ.get("GRADC_TEST_ON_GPU") == "1":
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    else:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return env


def cuda_script(path, *args, timeout=900):
    """Run `path` (a script that builds --target cuda code) in a process of its own, under cuda_env (the
    simulator is chosen at import); the last line it printed. Skips without numba-cuda."""
    pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
    proc = subprocess.run([sys.executable, "-W", "ignore", str(path), *map(str, args)], env=cuda_env(),
                          cwd=os.path.dirname(os.path.abspath(path)), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def split_every_conv(monkeypatch, cores=3):
    """Builds and runs from here split every conv and part run over up to `cores` parts of its batch,
    with BLAS seen as having that many threads (the thread counts set are recorded, not set); returns
    the list of part counts the calls ran with and the thread counts set."""
    monkeypatch.setattr(conv_cores, "cores", lambda: cores)
    monkeypatch.setattr(conv_cores, "PART_FLOPS", 1)
    monkeypatch.setattr(conv_cores.blas, "threads_now", lambda: cores)
    set_to, ran = [], []
    monkeypatch.setattr(conv_cores.blas, "set_threads", set_to.append)
    cuts = conv_cores._cuts
    monkeypatch.setattr(conv_cores, "_cuts", lambda n_img, parts: (ran.append(parts), cuts(n_img, parts))[1])
    return ran, set_to


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory):
    """The suite's kernel cache (GRADC_CACHE_DIR, inherited by the subprocesses tests start): a
    folder of its own, shared by the whole run, never the user's ~/.cache/gradc."""
    path = str(tmp_path_factory.mktemp("gradc-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRADC_CACHE_DIR", path)
        yield path
