"""A convolution kernel run over parts of its batch on several cores at once.

The CPU conv kernels (gradc/ops/conv.py) copy bands of input rows between BLAS calls. On one core
those copies run serially while BLAS waits, and BLAS runs the skinny products of small-channel
convs (LeNet's 6 and 16 output channels) on two threads barely faster than on one. A plain-Python
entry therefore calls a conv through conv_on_cores: the batch is cut into parts, one per core, and
each part runs the same kernel on its own thread (the kernels release the GIL) with BLAS on one
thread, so copies and products both run on every core. The weight gradient sums the parts'.

Measured on a 2-core machine, one run of bench/conv_step.py's models with this build and the same
build with the parts turned off side by side (float32 training steps): LeNet 5.56 ms against 6.55,
the VGG block 68.1 ms against 78.2.

How many parts: at most `most` (the cores of the machine that compiled the module: its memory plan
counts a kernel workspace per part), BLAS's thread count now (a limit the user set with threadpoolctl
or OPENBLAS_NUM_THREADS holds here too; 1 where gradc cannot read it), the batch, and one part per
PART_FLOPS of work: handing a part to a thread and back costs about 50 us here, a conv of 2^22 flops
takes about that long on one core.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gradc.runtime import blas

PART_FLOPS = 1 << 22


def cores():
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_pool = {"pid": None, "executor": None}
_pool_lock = threading.Lock()


def _executor():
    """The worker threads, made again in a forked child (a fork copies no threads)."""
    with _pool_lock:
        if _pool["pid"] != os.getpid():
            _pool["executor"] = ThreadPoolExecutor(max(1, cores() - 1), thread_name_prefix="gradc-conv")
            _pool["pid"] = os.getpid()
        return _pool["executor"]


def parts_for(n_img, flops, most):
    return max(1, min(most, blas.threads_now(), n_img, flops // PART_FLOPS))


def _cuts(n_img, parts):
    bounds = [n_img * k // parts for k in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _run_at_once(calls):
    """Each (kernel, args) of `calls` on its own thread, the first on this one; BLAS on one thread meanwhile."""
    threads = blas.threads_now()
    if threads > 1:   # (1: another thread has BLAS on one now and gives it back; this one leaves it be)
        blas.set_threads(1)
    try:
        futures = [_executor().submit(kernel, *args) for kernel, args in calls[1:]]
        try:
            calls[0][0](*calls[0][1])
        finally:
            for f in futures:   # every part has ended before BLAS gets its threads back, or an error is raised
                f.exception()
        for f in futures:
            f.result()
    finally:
        if threads > 1:
            blas.set_threads(threads)


def conv_on_cores(kernel, a, w, *args, most):
    """kernel(a, w, *ints, out) (a conv2d or its input gradient: a and out have the batch on axis 0),
    over parts of the batch at once."""
    *ints, out = args
    flops = 2 * max(a.size, out.size) * (w.size // max(1, w.shape[0]))
    parts = parts_for(a.shape[0], flops, most)
    if parts == 1:
        return kernel(a, w, *args)
    _run_at_once([(kernel, (a[s], w, *ints, out[s])) for s in _cuts(a.shape[0], parts)])


def conv_weight_grad_on_cores(kernel, x, g, *args, most):
    """kernel(x, g, *ints, out), the weight gradient (a sum over the batch), over parts of the batch at
    once: the first part's goes into out, the others' into buffers of their own, added to it after."""
    *ints, out = args
    flops = 2 * g.size * (out.size // max(1, out.shape[0]))
    parts = parts_for(x.shape[0], flops, most)
    if parts == 1:
        return kernel(x, g, *args)
    sums = [out] + [np.empty_like(out) for _ in range(parts - 1)]
    _run_at_once([(kernel, (x[s], g[s], *ints, part)) for s, part in zip(_cuts(x.shape[0], parts), sums)])
    for part in sums[1:]:
        out += part
