"""`gradc inspect --kernels` / `--ptx NAME`: the generated kernels, and what the driver says of them.

Every build lists its kernels with the computation each does and its source; a `--target cuda`
build also gives each kernel's launch grid and the host functions that launch it, all read from
the dumps. Registers, shared memory per block and PTX exist only once the driver has compiled a
kernel for its argument types: with --run-module, on a machine with a GPU, the module is imported
and every entry point run once on synthetic inputs, and the numbers come from numba-cuda's
dispatchers. Importing a build runs its code, so that needs the flag; without it the listing says
which flag gives them.
"""
import os
import re

from .errors import GradcError


RUN_FLAG = "--run-module (imports and runs the build's code: only for builds you trust)"


def _source(base):
    """The module's text, read as data (not imported)."""
    if not os.path.isfile(base + ".py"):
        return ""
    with open(base + ".py") as f:
        return f.read()


def _kernel_lines(k, source):
    lines = [f"  {k['name']}: {k['computes']}"]
    if "launch" in k:
        lines.append(f"      launch: {k['launch']}; from {', '.join(k['entries']) or 'Trainer.step'}")
    m = re.search(rf"^def {re.escape(k['name'])}\(.*?\n(?=\S|\Z)", source, re.S | re.M)
    if m:
        lines += ["      " + line for line in m.group(0).rstrip().splitlines()]
    return lines


def kernel_listing(base, kernels, run_module=False):
    source = _source(base)
    lines = [f"kernels ({len(kernels)}):"]
    for k in kernels:
        lines += _kernel_lines(k, source)
    if kernels and "launch" in kernels[0]:
        lines.append("")
        if run_module:
            lines += driver_report(base, kernels)
        else:
            lines.append(f"registers and shared memory: reported by the driver once a kernel is compiled on a GPU; "
                         f"give {RUN_FLAG}")
    return lines


def _compiled_module(base):
    """The module, imported and run once per entry point on a GPU; None (and why) without one."""
    from .runtime.cuda import load_cuda, simulated
    if simulated():
        return None, "numba-cuda's simulator is on (NUMBA_ENABLE_CUDASIM=1): no driver to ask"
    try:
        cuda = load_cuda()
        if not cuda.is_available():
            return None, "no CUDA GPU here"
    except ImportError as e:
        return None, str(e)
    from .compiler import import_file, warm
    module = import_file(base + ".py", os.path.basename(base))
    warm(module, {})
    return module, None


def driver_report(base, kernels):
    module, why = _compiled_module(base)
    if module is None:
        return [f"registers and shared memory: reported by the driver once a kernel is compiled on a GPU ({why})"]
    lines = ["registers per thread, shared memory per block (as compiled by the driver, per argument types):"]
    for k in kernels:
        dispatcher = getattr(module, k["name"])
        for sig in dispatcher.overloads:
            lines.append(f"  {k['name']}{sig}: {dispatcher.get_regs_per_thread(sig)} registers, "
                         f"{dispatcher.get_shared_mem_per_block(sig)} B shared")
    return lines


def ptx(base, name, kernels, run_module=False):
    """The PTX of kernel `name` for every argument type it was compiled for (with run_module; without
    it, the kernel's code from the dumps, and the flag that gives its PTX)."""
    names = [k["name"] for k in kernels]
    if kernels and "launch" not in kernels[0]:   # (said first: no name of a CPU build's has PTX)
        raise GradcError(f"--ptx {name}: this build is for --target cpu; PTX exists for --target cuda builds")
    if name not in names:
        raise GradcError(f"--ptx {name}: no kernel of that name (kernels: {', '.join(names)})")
    if not run_module:
        return "\n".join(_kernel_lines(kernels[names.index(name)], _source(base)) + [
            f"its PTX: compiled by the driver on a GPU; give {RUN_FLAG}"])
    module, why = _compiled_module(base)
    if module is None:
        raise GradcError(f"--ptx {name}: the driver compiles PTX for the GPU it runs on, and there is none ({why})")
    dispatcher = getattr(module, name)
    return "\n".join(f"// {name}{sig}\n{dispatcher.inspect_asm(sig)}" for sig in dispatcher.overloads)
