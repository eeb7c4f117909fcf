"""`gradc inspect --kernels` / `--ptx NAME`: the generated kernels, and what the driver says of them.

Every build lists its kernels with the computation each does and its source; a `--target cuda`
build also gives each kernel's launch grid and the host functions that launch it. Registers and
shared memory per block exist only once the driver has compiled a kernel for its argument types,
so on a machine with a GPU the module is imported and every entry point run once on synthetic
inputs, and the numbers come from numba-cuda's dispatchers; elsewhere the listing says so.
"""
import os
import re

from .errors import GradcError


def kernel_listing(base, kernels):
    source = ""
    if os.path.isfile(base + ".py"):
        with open(base + ".py") as f:
            source = f.read()
    lines = [f"kernels ({len(kernels)}):"]
    for k in kernels:
        lines.append(f"  {k['name']}: {k['computes']}")
        if "launch" in k:
            lines.append(f"      launch: {k['launch']}; from {', '.join(k['entries']) or 'Trainer.step'}")
        m = re.search(rf"^def {re.escape(k['name'])}\(.*?\n(?=\S|\Z)", source, re.S | re.M)
        if m:
            lines += ["      " + line for line in m.group(0).rstrip().splitlines()]
    if kernels and "launch" in kernels[0]:
        lines.append("")
        lines += driver_report(base, kernels)
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


def ptx(base, name, kernels):
    """The PTX of kernel `name` for every argument type it was compiled for."""
    names = [k["name"] for k in kernels]
    if name not in names:
        raise GradcError(f"--ptx {name}: no kernel of that name (kernels: {', '.join(names)})")
    if "launch" not in kernels[0]:
        raise GradcError(f"--ptx {name}: this build is for --target cpu; PTX exists for --target cuda builds")
    module, why = _compiled_module(base)
    if module is None:
        raise GradcError(f"--ptx {name}: the driver compiles PTX for the GPU it runs on, and there is none ({why})")
    dispatcher = getattr(module, name)
    return "\n".join(f"// {name}{sig}\n{dispatcher.inspect_asm(sig)}" for sig in dispatcher.overloads)
