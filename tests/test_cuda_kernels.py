"""The CUDA target's kernels (codegen/cuda.py) under numba-cuda's simulator, against numpy.

The simulator must be switched on before numba is imported, so the kernels run in a subprocess.
Shapes are tiny (the simulator runs every thread in Python) but not multiples of the GEMM tile."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from codegen_cuda_cases import CASES, UPDATES, build_module

pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")


RUNNER = textwrap.dedent('''
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import cuda_kernels as k
    from gradc.runtime.cuda import launch_config
    cases = json.loads(open(sys.argv[2]).read())
    rng = np.random.default_rng(0)
    errors = {}
    for case in cases:
        arrays = {}
        for name, (shape, kind) in case["inputs"].items():
            if kind == "labels":
                arrays[name] = rng.integers(0, case["classes"], size=shape)
            else:
                arrays[name] = rng.standard_normal(shape)
        expected = eval(case["numpy"], {"np": np, **arrays})
        arrays["out"] = np.full(case["out"], np.nan)
        fn = getattr(k, case["kernel"])
        args = [arrays[a] for a in case["args"]] + [arrays["out"]]
        fn[launch_config(k.LAUNCH[case["kernel"]], args)](*args)
        errors[case["id"]] = float(np.max(np.abs(arrays["out"] - np.reshape(expected, case["out"]))))
    # the optimizer updates against the CPU target's (gradc/runtime/optim.py), a clip scale of 0.7
    from gradc.runtime.optim import adam_step, sgd_step
    names = json.loads(sys.argv[3])
    p, g = rng.standard_normal(37), rng.standard_normal(37)
    state = [rng.standard_normal(37), np.abs(rng.standard_normal(37))]
    sq = float(g @ g)
    clip = 0.7 * np.sqrt(sq) + 0.7e-6   # clip_scale: clip / (norm + 1e-6) = 0.7
    status = np.array([1.0, sq])   # the loss and |g|^2, as the Trainer's step leaves them on the device
    p_cpu, v_cpu, p_dev, v_dev = p.copy(), state[0].copy(), p.copy(), state[0].copy()
    sgd_step(p_cpu, v_cpu, g, 1.0, 0.1, 0.9, clip)
    sgd = getattr(k, names["sgd"])
    sgd[1, 64](p_dev, v_dev, g, np.array([0.1, 0.9, clip]), status)
    errors["sgd"] = float(max(np.abs(p_cpu - p_dev).max(), np.abs(v_cpu - v_dev).max()))
    p_cpu, m_cpu, w_cpu = p.copy(), state[0].copy(), state[1].copy()
    p_dev, m_dev, w_dev = p.copy(), state[0].copy(), state[1].copy()
    adam_step(p_cpu, m_cpu, w_cpu, g, 1.0, 1e-2, 0.9, 0.999, 1e-8, 1 - 0.9 ** 3, 1 - 0.999 ** 3, clip)
    adam = getattr(k, names["adam"])
    adam[1, 64](p_dev, m_dev, w_dev, g, np.array([1e-2, 0.9, 0.999, 1e-8, 1 - 0.9 ** 3, 1 - 0.999 ** 3, clip]), status)
    errors["adam"] = float(max(np.abs(p_cpu - p_dev).max(), np.abs(m_cpu - m_dev).max(), np.abs(w_cpu - w_dev).max()))
    # a loss or norm that is not finite changes nothing
    changed = 0.0
    for bad in ([np.nan, sq], [1.0, np.inf]):
        p_dev, v_dev = p.copy(), state[0].copy()
        sgd[1, 64](p_dev, v_dev, g, np.array([0.1, 0.9, clip]), np.array(bad))
        adam[1, 64](p_dev, v_dev, v_dev.copy(), g, np.array([1e-2, 0.9, 0.999, 1e-8, 0.1, 0.001, clip]), np.array(bad))
        changed = max(changed, float(np.abs(p_dev - p).max()), float(np.abs(v_dev - state[0]).max()))
    errors["nonfinite_unchanged"] = changed
    print(json.dumps(errors))
''')


@pytest.mark.slow
def test_cuda_kernels_match_numpy_under_the_simulator(tmp_path):
    (tmp_path / "cuda_kernels.py").write_text(build_module())
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    out = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path), str(tmp_path / "cases.json"),
                          json.dumps(UPDATES)],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(errors) == {c["id"] for c in CASES} | {"sgd", "adam", "nonfinite_unchanged"}
    bad = {k: e for k, e in errors.items() if not e <= 1e-12}
    assert not bad, bad
