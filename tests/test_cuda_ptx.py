"""Generated CUDA kernels through numba-cuda's real compiler (NVVM) and ptxas, without a GPU.

The simulator runs kernels as Python, so it cannot tell whether Numba's CUDA compiler accepts
them. tests/cuda_ptx_runs.py runs three modules under the simulator, notes the argument types of
every launch, then compiles each (kernel, types) to PTX for sm_90 and assembles it with ptxas,
in two processes. It needs NVVM and ptxas: the nvidia-cuda-nvcc-cu12 and nvidia-cuda-nvrtc-cu12
wheels of the test extra."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
pytest.importorskip("nvidia.cuda_nvcc", reason="NVVM (nvidia-cuda-nvcc-cu12, the test extra) is not installed")
pytestmark = pytest.mark.slow

RUNS = os.path.join(os.path.dirname(__file__), "cuda_ptx_runs.py")


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, RUNS, "record", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"} | {"NUMBA_FORCE_CUDA_CC": "9.0"}
    procs = [subprocess.Popen([sys.executable, RUNS, "compile", str(tmp_path), f"{i}/2"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    kernels, failures = {}, []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        kernels |= result["kernels"]
        failures += result["failures"]
    assert not failures, failures
    compiled = {k: v for k, v in kernels.items() if "skipped" not in v}
    assert len(compiled) >= 60 and len(kernels) - len(compiled) <= 6
    assert any("gemm_tiled" in k for k in compiled) and any("xent" in k for k in compiled)
    assert any("sgd" in k for k in compiled) and any("adam" in k for k in compiled)
    for key, v in compiled.items():
        assert " 0 bytes spill stores" in v["ptxas"], (key, v["ptxas"])
