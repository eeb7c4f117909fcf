"""Every kernel of generated --target cuda modules through numba-cuda's real compiler, to PTX (and
through ptxas for registers and spills), on a machine without a GPU (tests/test_cuda_ptx.py).

    NUMBA_ENABLE_CUDASIM=1 python tests/cuda_ptx_runs.py record BUILD   # run the modules, note each launch's types
    NUMBA_FORCE_CUDA_CC=9.0 python tests/cuda_ptx_runs.py compile BUILD [PART/PARTS]   # compile them for sm_90

The simulator runs Python, so it cannot tell whether Numba's CUDA compiler accepts a kernel (its
types, its shared arrays, its calls to device functions); this does, for the argument types the
kernels really get.
"""
import glob
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CC = (9, 0)   # an H100


def record(build):
    import gradc as gc
    import gradc.runtime.cuda_gemm as sites
    import test_codegen as zoo
    from gradc.runtime import kernel_cache
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    launches = {}
    original = FakeCUDAKernel.__call__

    def call(kernel, *args):
        if kernel._device:   # a device function: compiled inside the kernels that call it
            return original(kernel, *args)
        types = []
        for a in args:
            a = getattr(a, "_ary", a)
            if isinstance(a, np.ndarray):
                layout = "C" if a.flags.c_contiguous else ("F" if a.flags.f_contiguous else "A")
                types.append(["array", a.dtype.name, a.ndim, layout])
            else:
                types.append(["float" if isinstance(a, float) else "int"])
        module, name = module_and_name(kernel)
        launches.setdefault(module, {}).setdefault(name, [])
        if types not in launches[module][name]:
            launches[module][name].append(types)
        return original(kernel, *args)

    def module_and_name(kernel, prefer=None):
        """The module file and name of a kernel: loaded from the kernel cache, its function is `kernel`
        in the cache file, so the first module that loaded it (or `prefer`, where that one did too)
        names it; builds of one model share their name, not their file."""
        found = [(sys.modules[module].__file__, name) for module, name, loaded, _ in kernel_cache.KERNELS
                 if loaded is kernel]
        return next((f for f in found if f[0] == prefer), found[0])
    FakeCUDAKernel.__call__ = call

    rng = np.random.default_rng(0)
    builds = [(zoo.mlp_weight_decay, "float32", {}), (zoo.reductions_rank3, "float64", {}), (zoo.user_ops, "float32", {})]
    paths = {}
    for i, (make, dtype, options) in enumerate(builds):
        model = make()
        out = os.path.join(build, f"m{i}")
        dev = gc.compile(model, out=out, target="cuda", dtype=dtype, order=1, **options)   # hvp: the same kernel kinds
        paths[f"m{i}"] = dev.__file__
        params, inputs = dev.init_params(seed=1), zoo._inputs(dev, rng, batch=6)
        inputs = {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in inputs.items()}
        dev.forward(params, **inputs)
        dev.loss_and_grad(params, **inputs)
        dev.input_grads(params, **inputs)
        for optimizer in ("sgd", "adam"):
            dev.Trainer(params, optimizer=optimizer, lr=0.01).step(**inputs)
        # split-K (few output tiles, a long K) is chosen by the GPU's size: asked for 64 multiprocessors and
        # 2-deep slices, every product of 4 or more deep runs it, so its two kernels are noted too
        saved = sites._SM_COUNT[:], sites.SLICE_MIN_DEPTH
        sites._SM_COUNT[:], sites.SLICE_MIN_DEPTH = [64], 2
        try:
            dev.loss_and_grad(params, **inputs)
        finally:
            sites._SM_COUNT[:], sites.SLICE_MIN_DEPTH = saved
        # the register-tiled GEMM and the cuBLAS epilogues are chosen by size on a GPU: note their types
        # too (those of the 16x16 kernel at the same site, and of an in-place epilogue)
        for site in [v for k, v in vars(dev).items() if type(v).__name__ == "Gemm"]:
            small = launches.get(dev.__file__, {}).get(module_and_name(site.small, dev.__file__)[1], [])
            large = module_and_name(site.large, dev.__file__)[1]
            for types in small:
                launches[dev.__file__].setdefault(large, [])
                if types not in launches[dev.__file__][large]:
                    launches[dev.__file__][large].append(types)
    return {"paths": paths, "launches": launches}


def compile_all(build, part=0, parts=1):
    """Compile every recorded (kernel, types); this process takes every parts-th one from `part`."""
    import importlib.util
    import numba
    from numba import cuda
    from gradc.codegen.sympy_print import HELPERS
    with open(os.path.join(build, "launches.json")) as f:
        recorded = json.load(f)
    ptxas = glob.glob(os.path.join(os.path.dirname(sys.executable), "..", "lib", "python*", "site-packages",
                                   "nvidia", "cuda_nvcc", "bin", "ptxas"))
    results, failures, count = {}, [], -1
    for name, path in recorded["paths"].items():
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        for kernel, signatures in recorded["launches"].get(path, {}).items():
            for types in signatures:
                count += 1
                if count % parts != part:
                    continue
                sig = tuple(numba.types.Array(numba.from_dtype(np.dtype(t[1])), t[2], t[3]) if t[0] == "array"
                            else (numba.float64 if t[0] == "float" else numba.int64) for t in types)
                key = f"{name}.{kernel}{tuple(str(s) for s in sig)}"
                try:
                    ptx, _ = cuda.compile_ptx(getattr(module, kernel).py_func, sig, cc=CC)
                except Exception as e:
                    # a call to a device function (a helper such as _max2) makes numba-cuda ask the
                    # driver for the device, so without one those kernels cannot be compiled here
                    helper = any(f"{h}(" in getattr(module, kernel).py_func.__code__.co_names.__repr__()
                                 or h in getattr(module, kernel).py_func.__code__.co_names for h in HELPERS)
                    if helper and "driver" in str(e).lower():
                        results[key] = {"skipped": "calls a device function: needs a driver to compile"}
                        continue
                    failures.append(f"{key}: {type(e).__name__}: {str(e)[:400]}")
                    continue
                entry = {"ptx_lines": ptx.count("\n")}
                if ptxas:
                    with open(os.path.join(build, f"k{part}.ptx"), "w") as f:
                        f.write(ptx)
                    r = subprocess.run([ptxas[0], "-v", f"-arch=sm_{CC[0]}{CC[1]}", "-o", os.path.join(build, f"k{part}.cubin"),
                                        os.path.join(build, f"k{part}.ptx")], capture_output=True, text=True)
                    entry["ptxas"] = " ".join(line.split("ptxas info    : ")[-1] for line in r.stderr.splitlines()
                                              if "registers" in line or "spill" in line)
                    if r.returncode != 0:
                        failures.append(f"{key}: ptxas: {r.stderr[-400:]}")
                results[key] = entry
    return {"compiled": len(results), "failures": failures, "kernels": results}


if __name__ == "__main__":
    what, build = sys.argv[1], sys.argv[2]
    if what == "record":
        with open(os.path.join(build, "launches.json"), "w") as f:
            json.dump(record(build), f)
        print(json.dumps({"recorded": True}))
    else:
        part, parts = (int(x) for x in sys.argv[3].split("/")) if len(sys.argv) > 3 else (0, 1)
        print(json.dumps(compile_all(build, part, parts)))
