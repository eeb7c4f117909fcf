"""The CUDA target's kernels (codegen/cuda.py) under numba-cuda's simulator, against numpy.

The simulator must be switched on before numba is imported, so the kernels run in a subprocess.
Shapes are tiny (the simulator runs every thread in Python) but not multiples of the GEMM tile."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import sympy as sp

from codegen_cuda_cases import CASES, build_module

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
        grid, threads = launch_config(k.LAUNCH[case["kernel"]], args)
        fn[grid, threads](*args)
        errors[case["id"]] = float(np.max(np.abs(arrays["out"] - np.reshape(expected, case["out"]))))
    print(json.dumps(errors))
''')


@pytest.mark.slow
def test_cuda_kernels_match_numpy_under_the_simulator(tmp_path):
    (tmp_path / "cuda_kernels.py").write_text(build_module())
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    out = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path), str(tmp_path / "cases.json")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(errors) == {c["id"] for c in CASES}
    bad = {k: e for k, e in errors.items() if not e <= 1e-12}
    assert not bad, bad
