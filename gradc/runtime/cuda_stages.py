"""Where the stages of a `--target cuda` pipeline run, and how values move between them.

`DeviceMemory` gives the pipeline executor (gradc/runtime/pipeline.py) the operations HostMemory
gives it on the CPU target, on GPUs:
- one GPU: the K stages are virtual devices, regions of the module runner's one arena;
- in one process with at least K GPUs: stage k runs on GPU k, through a runner of its own (its
  arena, stream and CUDA graphs on that GPU). A value that crosses GPUs (an activation forward, a
  gradient backward, a param read on another stage) is copied device to device on the receiving
  GPU's stream, after that stream waits for the sending one (an event: no host wait). The
  trained params, their gradients and the optimizer state stay on the module's GPU, where the
  Trainer updates them; stage k reads a copy of its params made once per step.
  `GRADC_STAGE_GPUS=0,1,...` names each stage's GPU instead (`GRADC_STAGE_GPUS=virtual`: one GPU);
- under mpiexec, each rank runs its one stage on the module runner's GPU, and a value goes to
  another rank through host memory, or with GRADC_MPI_CUDA_AWARE=1 as a device buffer
  (`outgoing`, `incoming`).
A stage function's results are copied out at once, because the next call (a graph replay, or the
next scalar in `scal`) writes the same buffers.
"""
import os

import numpy as np

from .cuda import block, flat, is_device_array


class DeviceMemory:
    def __init__(self, runner, kernels):
        self.runner, self.kernels = runner, kernels
        self.runners = None            # per stage, chosen at the first step
        self._copies = {}              # this step's copies of params and inputs: (id, stage) -> (array, copy)

    # ---- placement ------------------------------------------------------------------------
    def begin_step(self, stages, spread):
        """Before a step of `stages` stages; `spread`: this process runs every stage (no MPI)."""
        if self.runners is None or len(self.runners) != stages:
            gpus = stage_gpus(self.runner, stages) if spread else None
            by_gpu = {}
            self.runners = [self.runner] * stages if gpus is None else \
                [by_gpu.setdefault(g, self.runner if g == self.runner.gpu else self.runner.sibling(g)) for g in gpus]
        self._copies = {}

    def local(self, value, stage):
        """A param or input as stage `stage` reads it: on its GPU (copied once a step)."""
        run = self.runners[stage]
        if run is self.runner or not is_device_array(value):
            return value                  # (numpy arrays go to the device with the call's arguments)
        key = (id(value), stage)
        if key not in self._copies:
            self._copies[key] = (value, self._cross(value, self.runner, run))
        return self._copies[key][1]

    def transfer(self, value, source, target):
        """The value of a transfer node: `value`, made on stage `source`, where stage `target` reads it."""
        return self._cross(value, self.runners[source], self.runners[target])

    def _cross(self, value, src, dst):
        """`value` (on src's GPU) copied to dst's GPU, on dst's stream once that has waited for src's."""
        if src is dst:
            return value
        _order(src.start(), dst.start())
        return dst.copy(value)

    # ---- HostMemory's operations ----------------------------------------------------------
    def data(self, key, stage=0):
        return self.runners[stage].data[key]

    def call(self, fn, fname, args, inputs, stage=0):
        run = self.runners[stage]
        return [run.copy(r) for r in run.run(fn, args, inputs, entry=fname)]

    def number(self, value, stage=0):
        return self.runners[stage].scalar(value)

    def outgoing(self, value):
        """What goes to another rank: a host copy, or with a CUDA-aware MPI the device array
        itself once the work that writes it is done."""
        if not is_device_array(value):
            return value
        if not cuda_aware_mpi():
            return self.runner.host(value)
        self.runner.sync()
        return value

    def incoming(self, shape, dtype):
        """Where a value from another rank lands: host memory, or with a CUDA-aware MPI the device."""
        if not cuda_aware_mpi():
            return np.empty(shape, dtype)
        return self.runner.unowned(shape, dtype)

    def zero(self, flat_array):
        self.kernels["fill"][flat(flat_array, self.runner.stream)](flat_array, 0.0)

    def add(self, flat_array, start, stop, weight, value, stage=None):
        """flat_array[start:stop] += weight * value; the gradients live on the module's GPU."""
        if stage is not None and is_device_array(value):
            value = self._cross(value, self.runners[stage], self.runner)
        view = flat_array[start:stop]
        self.kernels["axpy"][flat(view, self.runner.stream)](self.runner.device(value).reshape(stop - start),
                                                             float(weight), view)

    def squares(self, value):
        total = self.runner.buffer("pipeline/squares", (1,))
        self.kernels["sum_squares"][block(self.runner.stream)](self.runner.device(value).reshape(value.size), total)
        return self.runner.scalar(total)


def cuda_aware_mpi():
    """GRADC_MPI_CUDA_AWARE=1: the MPI reads and writes device memory (built with CUDA support;
    mpi4py passes it device arrays through __cuda_array_interface__)."""
    return os.environ.get("GRADC_MPI_CUDA_AWARE", "") == "1"


def stage_gpus(runner, stages):
    """The GPU of each stage: GRADC_STAGE_GPUS, else GPU k for stage k when there are enough, else
    the module's GPU for all."""
    count = len(runner.start().cuda.gpus)
    spec = os.environ.get("GRADC_STAGE_GPUS", "").strip()
    if spec == "virtual":
        return [runner.gpu] * stages
    if spec:
        gpus = [int(g) for g in spec.split(",") if g.strip().isdigit()]
        if len(gpus) != stages or len(gpus) != len(spec.split(",")) or max(gpus) >= count:
            raise ValueError(f"GRADC_STAGE_GPUS={spec!r}: give {stages} GPU numbers below {count}, one per stage "
                             f"(or 'virtual')")
        return gpus
    return list(range(stages)) if stages > 1 and count >= stages else [runner.gpu] * stages


def _order(src, dst):
    """dst's stream waits for the work queued so far on src's stream."""
    if hasattr(src.stream, "record") != hasattr(dst.stream, "record"):   # a cuda.core stream and numba's default
        src.sync()
        return
    cuda = src.cuda
    with cuda.gpus[src.gpu]:   # an event belongs to the context of the stream it is recorded on
        if hasattr(src.stream, "record"):   # a cuda.core stream (the graph path)
            event = src.stream.record()
        else:
            event = cuda.event()
            event.record(src.stream)
    with cuda.gpus[dst.gpu]:
        if hasattr(dst.stream, "record"):
            dst.stream.wait(event)
        else:
            event.wait(dst.stream)
