"""Per-image kernels run over parts of the batch on several cores at once: a part run's function (a
chain of them, passes/part_runs.py: parts_on_cores), or one convolution kernel or pool gradient that
is in no run (conv_on_cores, conv_weight_grad_on_cores, images_on_cores); and a random op's draws over
parts of its values (draws_on_cores: lr_grad's noise is most of its CPU time).

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
counts a kernel workspace per part, see planned_parts), BLAS's thread count now (a limit the user
set with threadpoolctl or OPENBLAS_NUM_THREADS holds here too; 1 where gradc cannot read it), the
batch, and one part per PART_FLOPS of work: handing a part to a thread and back costs about 50 us
here, a conv of 2^22 flops takes about that long on one core. One conv runs in parts at a time: a
conv called meanwhile from another thread (hvp's blocks run on every core) runs whole, so threads
never outnumber the cores by more than the parts of one conv, and only one caller sets BLAS's
thread count to 1 and back.

Why Python threads and not Numba's (tried on 2026-11-27): a parallel=True driver calling the kernel
per part through its compiled entry started a part in about 3 us against about 60, and LeNet's step
took 3.65 ms against 4.58. But Numba's threads are GNU OpenMP's, which spin while they wait, as do
OpenBLAS's after a multi-threaded product: a woken part then waited a scheduler slice behind a
spinning thread on its core. A conv net with an 800 x 1024 dense layer took 58-62 ms a step against
35-37 with Python threads. With OMP_WAIT_POLICY=PASSIVE the cliff went, and the gain with it.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gradc.runtime import blas

PART_FLOPS = 1 << 22
POOL_ELEMENT_FLOPS = 100   # see images_on_cores
PAIR_FLOPS = {"normal": 1000, "dropout": 300}   # see draws_on_cores


def cores():
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_pool = {"executor": None}
_pool_lock = threading.Lock()
_splitting = threading.Lock()   # held by the one conv running in parts
_blas_threads = {"before": None}   # BLAS's thread count while a conv runs in parts, to give back


def _executor():
    with _pool_lock:
        if _pool["executor"] is None:
            _pool["executor"] = ThreadPoolExecutor(max(1, cores() - 1), thread_name_prefix="gradc-conv")
        return _pool["executor"]


def _after_fork_in_child():
    """A fork copies no threads, and a lock held by a thread of the parent stays held: start anew, and
    give BLAS back the threads a conv running in parts at the fork had taken."""
    global _pool_lock, _splitting
    _pool_lock, _splitting = threading.Lock(), threading.Lock()
    _pool["executor"] = None
    if _blas_threads["before"] is not None:
        blas.set_threads(_blas_threads["before"])
        _blas_threads["before"] = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def planned_parts(n_img, flops, most):
    """The most parts a conv of n_img images and `flops` runs in (memory planning counts a workspace
    for each); at run time BLAS's thread count bounds them too."""
    return max(1, min(most, n_img, flops // PART_FLOPS))


def conv_flops(x_size, g_size, taps, weight_grad):
    """A conv's flops as conv_on_cores counts them: x and g hold the input and the output side (either
    order), taps = C/groups kh kw; a weight gradient's are over g's elements."""
    return 2 * (g_size if weight_grad else max(x_size, g_size)) * taps


def _cuts(n_img, parts):
    bounds = [n_img * k // parts for k in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _in_parts(n_img, flops, most, calls):
    """Run calls(cuts) -> [(kernel, args)], one per part, each on its own thread (the first on this
    one), BLAS on one thread meanwhile; False (nothing run) where the conv is to run whole."""
    threads = blas.threads_now()
    parts = min(planned_parts(n_img, flops, most), threads)
    if parts == 1 or not _splitting.acquire(blocking=False):
        return False
    try:
        _blas_threads["before"] = threads
        blas.set_threads(1)
        work = calls(_cuts(n_img, parts))
        futures = [_executor().submit(kernel, *args) for kernel, args in work[1:]]
        try:
            work[0][0](*work[0][1])
        finally:
            for f in futures:   # every part has ended before BLAS gets its threads back, or an error is raised
                f.exception()
        for f in futures:
            f.result()
    finally:
        if _blas_threads["before"] is not None:
            blas.set_threads(threads)
            _blas_threads["before"] = None
        _splitting.release()
    return True


def conv_on_cores(kernel, a, w, *args, most):
    """kernel(a, w, *ints, out) (a conv2d or its input gradient: a and out have the batch on axis 0),
    over parts of the batch at once."""
    *ints, out = args
    flops = conv_flops(a.size, out.size, w.size // max(1, w.shape[0]), weight_grad=False)
    if not _in_parts(a.shape[0], flops, most, lambda cuts: [(kernel, (a[s], w, *ints, out[s])) for s in cuts]):
        kernel(a, w, *args)


def images_on_cores(kernel, *arrays, most):
    """kernel(*arrays), every array with the batch on axis 0 (a pool or its adjoint: the last array is
    its output), over parts of the batch at once. A pool has few flops but reads and writes its
    images: one element costs about what POOL_ELEMENT_FLOPS of a conv do (a 2x2 max pool's gradient
    on LeNet's first layer: 1.6 ns an element on one core, a conv about 0.017 ns a flop)."""
    work = POOL_ELEMENT_FLOPS * max(a.size for a in arrays)
    if not _in_parts(arrays[0].shape[0], work, most, lambda cuts: [(kernel, tuple(a[s] for a in arrays)) for s in cuts]):
        kernel(*arrays)


def parts_on_cores(run, sliced, summed, image_work, most):
    """run(*sliced, *summed), a part run's function (passes/part_runs.py), over parts of the batch at
    once: each part gets the images of every sliced array (batch on axis 0) and buffers of its own
    for the summed values (the first part's are the values themselves), which are added up after."""
    n_img = sliced[0].shape[0]
    sums = []

    def calls(cuts):
        sums[:] = [summed] + [tuple(np.empty_like(v) for v in summed) for _ in cuts[1:]]
        return [(run, tuple(a[s] for a in sliced) + part) for s, part in zip(cuts, sums)]
    if not _in_parts(n_img, image_work * n_img, most, calls):
        return run(*sliced, *summed)
    for part in sums[1:]:
        for value, partial in zip(summed, part):
            value += partial


def conv_weight_grad_on_cores(kernel, x, g, *args, most):
    """kernel(x, g, *ints, out), the weight gradient (a sum over the batch), over parts of the batch at
    once: the first part's goes into out, the others' into buffers of their own, added to it after."""
    *ints, out = args
    flops = conv_flops(x.size, g.size, out.size // max(1, out.shape[0]), weight_grad=True)
    sums = []

    def calls(cuts):
        sums[:] = [out] + [np.empty_like(out) for _ in cuts[1:]]
        return [(kernel, (x[s], g[s], *ints, part)) for s, part in zip(cuts, sums)]
    if not _in_parts(x.shape[0], flops, most, calls):
        return kernel(x, g, *args)
    for part in sums[1:]:
        out += part


def draws_on_cores(kernel, *args, dist, most):
    """kernel(seed, [half,] stream_key, p, scale, out, first, last), a `random` op's draws of elements
    [first, last) (gradc/ops/random.py), over parts of them at once, cut between pairs; then, with half
    != 0, the second half copied from the first. A pair of draws costs about what PAIR_FLOPS of a conv
    do (two normals by Box-Muller about 17 ns on one core; two dropout flags about 5)."""
    *head, out = args
    half = len(head) == 5 and head[1] != 0
    mid = out.size // 2
    n = out.size - mid if half else out.size   # the distinct draws
    pairs = (n + 1) // 2

    def calls(cuts):
        return [(kernel, (*head, out, 2 * s.start, min(2 * s.stop, n))) for s in cuts]
    if not _in_parts(pairs, PAIR_FLOPS[dist] * pairs, most, calls):
        return kernel(*head, out, 0, out.size)
    if half:   # (numpy copies overlapping slices as from a copy: element 2 mid of an odd count gets element mid's)
        flat = out.reshape(out.size)
        flat[mid:] = flat[:out.size - mid]
