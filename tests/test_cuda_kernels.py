"""The CUDA target's kernels (codegen/cuda.py) under numba-cuda's simulator, against numpy.

The simulator must be switched on before numba is imported, so the kernels run in a subprocess.
Shapes are tiny (the simulator runs every thread in Python) but not multiples of the GEMM tile."""
import json
import subprocess
import sys
import textwrap

import pytest

from codegen_cuda_cases import CASES, UPDATES, build_module
from conftest import cuda_env

pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")


RUNNER = textwrap.dedent('''
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import cuda_kernels as k
    from gradc.ops.random import draw
    from gradc.runtime.cuda import launch_config
    cases = json.loads(open(sys.argv[2]).read())
    rng = np.random.default_rng(0)
    errors = {}
    for case in cases:
        arrays = {}
        for name, (shape, kind, *value) in case["inputs"].items():
            if kind == "labels":
                arrays[name] = rng.integers(0, case["classes"], size=shape)
            elif kind == "int":   # a given int (a draw's seed or flag)
                arrays[name] = np.full(shape, value[0], dtype=np.int64)
            else:
                arrays[name] = rng.standard_normal(shape)
        expected = eval(case["numpy"], {"np": np, "draw": draw, **arrays})
        arrays["out"] = np.full(case["out"], np.nan)
        fn = getattr(k, case["kernel"])
        args = [arrays[a] for a in case["args"]] + [arrays["out"]]
        fn[launch_config(k.LAUNCH[case["kernel"]], args)](*args)
        errors[case["id"]] = float(np.max(np.abs(arrays["out"] - np.reshape(expected, case["out"]))))
    # the optimizer updates against the CPU target's (gradc/runtime/optim.py), a clip scale of 0.7
    from gradc.runtime.optim import CHECK, WRITE, adam_update, clip_scale, sgd_update
    names = json.loads(sys.argv[3])
    p, g = rng.standard_normal(37), rng.standard_normal(37)
    state = [rng.standard_normal(37), np.abs(rng.standard_normal(37))]
    sq = float(g @ g)
    clip = 0.7 * np.sqrt(sq) + 0.7e-6   # clip_scale: clip / (norm + 1e-6) = 0.7
    scale = clip_scale(sq, clip)
    sgd_hyper = np.array([0.1, 0.9, clip])
    adam_hyper = np.array([1e-2, 0.9, 0.999, 1e-8, 1 - 0.9 ** 3, 1 - 0.999 ** 3, clip])
    sgd, adam = getattr(k, names["sgd"]), getattr(k, names["adam"])
    sgd_check, adam_check = getattr(k, names["sgd_check"]), getattr(k, names["adam_check"])

    def status():   # the loss, |g|^2 and a stale overflow count, as the step leaves them before the check
        return np.array([1.0, sq, 5.0])

    p_cpu, v_cpu, p_dev, v_dev = p.copy(), state[0].copy(), p.copy(), state[0].copy()
    sgd_update(p_cpu, v_cpu, g, 0.1, 0.9, scale, WRITE)
    st = status()
    sgd_check[1, 64](p_dev, v_dev, g, sgd_hyper, st)
    sgd[1, 64](p_dev, v_dev, g, sgd_hyper, st)
    errors["sgd"] = float(max(np.abs(p_cpu - p_dev).max(), np.abs(v_cpu - v_dev).max(), st[2]))
    p_cpu, m_cpu, w_cpu = p.copy(), state[0].copy(), state[1].copy()
    p_dev, m_dev, w_dev = p.copy(), state[0].copy(), state[1].copy()
    adam_update(p_cpu, m_cpu, w_cpu, g, 1e-2, 0.9, 0.999, 1e-8, 1 - 0.9 ** 3, 1 - 0.999 ** 3, scale, WRITE)
    st = status()
    adam_check[1, 64](p_dev, m_dev, w_dev, g, adam_hyper, st)
    adam[1, 64](p_dev, m_dev, w_dev, g, adam_hyper, st)
    errors["adam"] = float(max(np.abs(p_cpu - p_dev).max(), np.abs(m_cpu - m_dev).max(), np.abs(w_cpu - w_dev).max(),
                               st[2]))
    # a loss or norm that is not finite, or an update that overflows, changes nothing
    changed = 0.0
    for bad in ([np.nan, sq, 0.0], [1.0, np.inf, 0.0], [1.0, sq, 1.0]):
        p_dev, v_dev = p.copy(), state[0].copy()
        sgd[1, 64](p_dev, v_dev, g, sgd_hyper, np.array(bad))
        adam[1, 64](p_dev, v_dev, v_dev.copy(), g, adam_hyper, np.array(bad))
        changed = max(changed, float(np.abs(p_dev - p).max()), float(np.abs(v_dev - state[0]).max()))
    # the checks count the values a step makes infinite (a large momentum buffer times lr), as the CPU's do
    big = state[0].copy()
    big[:5] = 1e308
    for name, check, hyper, cpu in (
            ("sgd", sgd_check, [10.0, 0.9, clip], lambda *a: sgd_update(*a, 10.0, 0.9, scale, CHECK)),
            ("adam", adam_check, [1e300, *adam_hyper[1:]],
             lambda *a: adam_update(*a, 1e300, 0.9, 0.999, 1e-8, 1 - 0.9 ** 3, 1 - 0.999 ** 3, scale, CHECK))):
        arrays = [p.copy(), big.copy()] + ([state[1].copy()] if name == "adam" else []) + [g]
        st = status()
        check[1, 64](*arrays, np.array(hyper), st)
        expected = cpu(*arrays)
        changed = max(changed, abs(st[2] - expected), 0.0 if expected >= 5 else 1.0)
    errors["nonfinite_unchanged"] = changed
    print(json.dumps(errors))
''')


@pytest.mark.slow
def test_cuda_kernels_match_numpy_under_the_simulator(tmp_path):
    (tmp_path / "cuda_kernels.py").write_text(build_module())
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = cuda_env()
    out = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path), str(tmp_path / "cases.json"),
                          json.dumps(UPDATES)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(errors) == {c["id"] for c in CASES} | {"sgd", "adam", "nonfinite_unchanged"}
    bad = {k: e for k, e in errors.items() if not e <= 1e-12}
    assert not bad, bad
