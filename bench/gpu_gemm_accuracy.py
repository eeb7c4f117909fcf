"""How close each GEMM path of --target cuda comes to the float64 product, on a GPU: the 16x16-tile
kernel, the register-tiled kernel and cuBLAS through CuPy (gradc/runtime/cuda_gemm.py), every
transpose, float32 and float64, with depths that are and are not multiples of the kernels' slices.

    bash bench/gpu_check.sh ... or: python3 bench/gpu_gemm_accuracy.py [--small]

Prints one line per case: the largest |error| over the largest |product|, against the bound a
float32 (float64) dot product of that depth keeps to, and exits 1 if any path is past it.
Under the simulator (NUMBA_ENABLE_CUDASIM=1) use --small: the same cases, tiny shapes, no CuPy.
"""
import argparse
import importlib.util
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradc.codegen.cuda import CudaKernels  # noqa: E402
from gradc.codegen.sympy_print import HELPERS  # noqa: E402
from gradc.runtime.cuda import big_tiles, load_cuda, tiles  # noqa: E402
from gradc.runtime.cuda_gemm import library  # noqa: E402

SHAPES = [(1024, 4096, 10), (1024, 4096, 4096), (256, 1024, 784), (4096, 10, 1024), (300, 200, 37)]
SMALL = [(130, 140, 10), (40, 30, 37), (20, 10, 9)]


def kernels_module(dtype):
    """The generated plain GEMM kernels (both kinds, every transpose), written out and imported."""
    k = CudaKernels()
    names = {(kind, ta, tb): getattr(k, kind)(ta, tb) for kind in ("matmul", "matmul_tiled")
             for ta in (False, True) for tb in (False, True)}
    float_t = "float32" if dtype == np.float32 else "float64"
    source = ["import math", f"from numba import {float_t} as FLOAT_T, float64", "from gradc.runtime.cuda import load_cuda",
              "cuda = load_cuda()"] + [f"@cuda.jit(device=True)\n{HELPERS[h]}" for h in sorted(k.helpers)]
    source += [f"@cuda.jit\n{src}" for _, src, _ in k.sources]
    path = os.path.join(tempfile.mkdtemp(prefix="gradc-gemm-"), f"gemm_{float_t}.py")
    with open(path, "w") as f:
        f.write("\n\n".join(source) + "\n")
    spec = importlib.util.spec_from_file_location(f"gemm_{float_t}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {key: getattr(module, name) for key, name in names.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (for the simulator)")
    args = ap.parse_args()
    cuda = load_cuda()
    cupy = library()
    rng = np.random.default_rng(0)
    worst = []
    for dtype in (np.float32, np.float64):
        kernels = kernels_module(dtype)
        eps = np.finfo(dtype).eps
        for m, n, depth in SMALL if args.small else SHAPES:
            for ta in (False, True):
                for tb in (False, True):
                    a = rng.standard_normal((depth, m) if ta else (m, depth)).astype(dtype)
                    b = rng.standard_normal((n, depth) if tb else (depth, n)).astype(dtype)
                    a64, b64 = a.astype(np.float64), b.astype(np.float64)
                    ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
                    scale = np.max(np.abs(ref))
                    # the worst case of a dot product of this depth rounded at each step (Higham, 3.1), with margin
                    bound = 4 * eps * depth * np.max(np.abs(a64)) * np.max(np.abs(b64)) / scale
                    da, db = cuda.to_device(a), cuda.to_device(b)
                    errors = {}
                    for kind, config in (("matmul", tiles), ("matmul_tiled", big_tiles)):
                        out = cuda.device_array((m, n), dtype)
                        kernels[(kind, ta, tb)][config(out)](da, db, out)
                        errors["16x16" if kind == "matmul" else "tiled"] = np.max(np.abs(out.copy_to_host() - ref)) / scale
                    if cupy is not None:
                        A, B = cupy.asarray(a), cupy.asarray(b)
                        got = cupy.matmul(A.T if ta else A, B.T if tb else B).get()
                        errors["cuBLAS"] = np.max(np.abs(got - ref)) / scale
                    bad = {k: v for k, v in errors.items() if not v <= bound}
                    worst += [(np.dtype(dtype).name, m, n, depth, ta, tb, k) for k in bad]
                    print(f"{np.dtype(dtype).name} m={m} n={n} k={depth} ta={ta:d} tb={tb:d} bound {bound:.1e}: "
                          + "  ".join(f"{k} {v:.1e}{' PAST' if k in bad else ''}" for k, v in errors.items()), flush=True)
    if worst:
        sys.exit(f"past the bound: {worst}")


if __name__ == "__main__":
    main()
