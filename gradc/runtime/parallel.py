"""Data parallel training and an asynchronous parameter server over MPI (DESIGN.md §1.10).

`Trainer(params, ..., parallel="data")` under `mpiexec -n R`: every rank holds the same params and
steps on its own rows. Rank r's gradient (of its own objective: its rows' mean, or sum, plus the
weight decay term) is weighted by w_r = B_r / B for a mean loss and 1 for a sum, and the weighted
gradients are summed by `Allreduce` over flat buckets of the gradient buffer. The weight decay
term, which each rank's objective holds once, is then corrected to count once in all (for a mean
the weights add to 1 and nothing changes). So R ranks with shards of any sizes end each step with
the params of one process stepping on the concatenated batch, up to rounding: the clip norm is
the reduced gradient's, and a step is refused on every rank when it is refused anywhere.

Buckets follow the params in reverse order (the backward makes the last layer's gradients first).
A bucket's `Iallreduce` starts as soon as its gradients are final. A CPU build's module has
`_loss_and_grad_streamed`, the training step's kernels run from plain Python with a call after each
gradient is written, so the reduction of the last layers overlaps the backward of the earlier ones
(a CUDA build's copies each gradient to host memory after its kernels on the stream, and a bucket
starts once its copy is done, while the device runs the rest); with a pipeline build (--devices K, its
stages run in this process) a stage's buckets start when its last backward function has run. Each
such call ends with an MPI_Testall, which moves the pending reductions on. `overlap=False` runs
`_loss_and_grad` whole and reduces every bucket with a blocking `Allreduce` after it;
`tr.comm_seconds` adds up the time spent in MPI calls of the reduction (issuing, testing and
waiting), for benchmarks.

With a pipeline build of K stages under mpiexec -n R*K, ranks r*K .. r*K+K-1 run replica r's K
stages (one stage a rank, as a plain pipeline run does) and each stage's gradients are reduced over
the R ranks that run that stage (`stage_ranks=1` runs each replica's K stages in one process).

`parallel="ps"`: see ParameterServer.
"""
import contextlib
import math
import os
import time
import zlib

import numpy as np

from .optim import CHECK, CHECKED_WRITE, WRITE, adam_update, clip_scale, sgd_update, sum_squares
from .pipeline import differing_settings, mpi_world, recorded_axes

BUCKET_BYTES = 1 << 20   # PyTorch DDP takes 25 MiB; a smaller bucket starts sooner on small models
CALL_KEYS = 6   # the length of each call's first reduction: MPI pairs the ranks' collectives by their order alone


def no_one(names):
    """What a generated module's streamed _loss_and_grad tells when nobody is reducing gradients."""


def _import_mpi(tr, parallel):
    """mpi4py's MPI module, or an error that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(f"{tr.model_name}.Trainer(parallel={parallel!r}) needs mpi4py: "
                           f"pip install 'gradc[mpi]' (and an MPI library, e.g. Open MPI or MPICH)") from None
    return MPI


def world(comm, MPI, tr, parallel):
    """The communicator to run over: `comm` (an mpi4py Intracomm), or COMM_WORLD (also when it has one rank)."""
    if comm is not None:
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"{tr.model_name}.Trainer(parallel={parallel!r}): comm must be an mpi4py communicator "
                            f"(MPI.COMM_WORLD or one split from it), got {type(comm).__name__}")
        return comm
    comm = mpi_world()
    return MPI.COMM_WORLD if comm is None else comm


def _rows(tr, a):
    """This rank's rows: the batch dim of its inputs."""
    facts = tr.rows or {}
    for name, axis in recorded_axes(facts.get("batch_inputs", ())).items():
        if name in a:
            return int(a[name].shape[axis])
    raise ValueError(f"{tr.model_name}.Trainer(parallel=...): no input of Trainer.step has the batch dim "
                     f"{facts.get('batch')!r}, so ranks cannot be weighted by rows")


NO_KEY = -(1 << 62)   # what a rank that refused its inputs adds to the comparison of shapes (below any crc32)


def _beside_rows(tr, a):
    """The shapes of this rank's inputs without the batch axis (the whole shape of an input without it)."""
    axes = recorded_axes((tr.rows or {}).get("batch_inputs", ()))
    return tuple((k, tuple(d for i, d in enumerate(v.shape) if i != axes.get(k)) if k in axes else tuple(v.shape))
                 for k, v in sorted(a.items()))


def _differing_shapes(tr, every):
    """The error when the replicas' inputs differ in a dim other than the batch dim."""
    seen = "; ".join(f"rank {r}: " + ", ".join(f"{k} {shape}" for k, shape in shapes)
                     for r, shapes in enumerate(every) if shapes is not None)
    return ValueError(f"{tr.model_name}.Trainer.step {tr.steps + 1}: the ranks' inputs differ in a dim other than the "
                      f"batch dim {(tr.rows or {}).get('batch')!r} (shapes without the batch axis: {seen}); every "
                      f"rank's rows must be rows of one batch; this step changed nothing")


def _differing_settings(tr, every, where=None, outcome="this step changed nothing"):
    """The error when the ranks' trainers are set differently (tr.lr set on one rank only, say)."""
    return differing_settings(f"{tr.model_name}.{where or f'Trainer.step {tr.steps + 1}'}", every, outcome)


def _weighting(tr, what):
    """The loss's reduction over rows ("mean" or "sum"), or a ValueError saying why ranks cannot split it."""
    facts = tr.rows
    if facts is None:
        raise ValueError(f"{tr.model_name}.Trainer(parallel={what!r}): this module was compiled by an older gradc "
                         f"that does not record its batch dim; recompile it")
    if facts["reduction"] is None:
        raise ValueError(f"{tr.model_name}.Trainer(parallel={what!r}): ranks cannot split this model's batch: "
                         f"{facts['why']}")
    return facts["reduction"]


def ranks_per_replica(model_name, K, size, stage_ranks):
    """How many of `size` ranks run one replica of a K-stage build: K (one stage a rank), or 1 (a replica's
    stages in its rank) when asked for with stage_ranks=1 or in one process. A count of ranks that is not
    a multiple of K is refused unless stage_ranks=1 says so (it became one replica a rank unasked)."""
    if stage_ranks is None:
        stage_ranks = K if size > 1 else 1
    if stage_ranks not in (1, K):
        raise ValueError(f"{model_name}.Trainer: stage_ranks={stage_ranks!r}: " + (
            f"use 1 (each replica runs its {K} stages in one process) or {K} (one stage a rank)" if K > 1 else
            "this build has one stage: leave it None (or 1)"))
    if size % stage_ranks:
        raise ValueError(f"{model_name}.Trainer(parallel='data'): this build has {K} stages, one a rank, but "
                         f"mpiexec started {size} processes: run mpiexec -n R*{K} (R replicas), or pass "
                         f"stage_ranks=1 to run every stage of a replica in one process")
    return stage_ranks


class DataParallel:
    def __init__(self, tr, comm=None, overlap=True, bucket_bytes=BUCKET_BYTES, stage_ranks=None):
        self.MPI = _import_mpi(tr, "data")
        self.tr = tr
        self.reduction = _weighting(tr, "data")
        comm = world(comm, self.MPI, tr, "data")
        made_on_every_rank(comm, self.MPI, tr.model_name, "data")
        self.world = comm
        if not isinstance(overlap, bool):
            raise ValueError(f"{tr.model_name}.Trainer: overlap must be True or False, got {overlap!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"{tr.model_name}.Trainer: bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        self.overlap, self.bucket_bytes = overlap, bucket_bytes
        self.comm_seconds = 0.0
        pipe = tr.pipeline
        K = pipe.K if pipe is not None else 1
        size, rank = comm.Get_size(), comm.Get_rank()
        stage_ranks = ranks_per_replica(tr.model_name, K, size, stage_ranks)
        self.stage = rank % stage_ranks if stage_ranks > 1 else None
        replica = rank // stage_ranks
        if stage_ranks > 1:   # a replica group per stage, and a pipeline group per replica
            self.pipe_comm = comm.Split(color=replica, key=self.stage)
            self.comm = comm.Split(color=self.stage, key=replica)
            pipe.attach(self.pipe_comm)
        else:
            self.pipe_comm = None
            self.comm = comm
            if pipe is not None:
                pipe.attach(None)   # the stages run here, not over COMM_WORLD
        self.replicas, self.replica = self.comm.Get_size(), self.comm.Get_rank()
        # which params this rank answers for, and the groups whose gradients become final together
        slices = tr.grad_slices
        if pipe is not None and K > 1:
            groups = {}
            for name in slices:
                groups.setdefault(pipe.grad_stages.get(name, 0), []).append(name)
            if self.stage is not None:
                groups = {self.stage: groups.get(self.stage, [])}
        else:
            groups = {0: list(slices)}
        self.owned = [n for g in groups.values() for n in g]
        itemsize = np.dtype(tr.signature.float).itemsize
        self.buckets = []   # (start, stop, param names): runs of the flat buffer, later params first
        for g, names in groups.items():
            for name in sorted(names, key=lambda n: -slices[n][0]):
                a, b = slices[name]
                if b == a:
                    continue
                last = self.buckets[-1] if self.buckets else None
                if last and last[3] == g and last[0] == b and (last[1] - last[0]) * itemsize < bucket_bytes:
                    self.buckets[-1] = (a, last[1], last[2] + (name,), g)
                else:
                    self.buckets.append((a, b, (name,), g))
        self.buckets = [(a, b, names) for a, b, names, _ in self.buckets]
        self.bucket_of = {name: i for i, (_, _, names) in enumerate(self.buckets) for name in names}
        self._same_params()
        self._frozen = {k: v for k, v in tr.params.items() if k not in tr._views}   # their arrays (_assigned)
        self._unheard = False   # an assignment that no call has compared yet (_assigned)

    # ---- every replica starts from rank 0's params ---------------------------------------------
    def _same_params(self):
        tr = self.tr
        host = tr._host(tr._flat)
        flat = np.ascontiguousarray(host)
        self.comm.Bcast(flat, root=0)
        self._set_flat(flat)
        frozen = {k: tr._host(v) for k, v in tr.params.items() if k not in tr.grad_slices}
        if frozen:
            frozen = self.comm.bcast(frozen, root=0)
            for k, v in frozen.items():
                if isinstance(tr.params[k], np.ndarray) and tr.params[k].shape == np.shape(v):
                    tr.params[k][...] = v
                elif hasattr(tr.params[k], "copy_to_device"):
                    tr.params[k].copy_to_device(np.ascontiguousarray(v))
                else:   # a number or a list assigned on this rank: rank 0's array instead
                    tr.params[k] = np.array(v)

    def _set_flat(self, flat):
        tr = self.tr
        if isinstance(tr._flat, np.ndarray):
            tr._flat[...] = flat
        else:
            tr._flat.copy_to_device(flat)

    # ---- a step --------------------------------------------------------------------------------
    def step(self, inputs):
        tr, MPI = self.tr, self.MPI
        error, rows = None, 0
        assigned = self._assigned()
        try:   # an assignment into tr.params first: whatever the inputs, every rank's params are compared below
            tr._adopt()
            a = tr.signature.inputs(inputs, tr.loss_inputs, "Trainer.step")
            rows = _rows(tr, a)
            if tr.pipeline is not None and getattr(tr, "gradient", "backprop") == "backprop":
                tr.pipeline.rows(a)   # (its microbatches: a shard too small for them is refused with the rest)
        except ValueError as e:   # raised on every rank below; this one says why
            error, rows = ValueError(f"{e} (rank {self.world.Get_rank()}; step {tr.steps + 1} changes nothing on any "
                                     f"rank)"), 0
        # every rank learns the global batch, whether some rank refused its inputs, whether the replicas'
        # inputs differ beside the batch dim (then there is no one batch they are rows of), and whether their
        # settings differ (the replicas would drift apart, or their reductions not match); then all raise.
        # (Every rank reaches each collective below: the conditions are the same on every rank.)
        shapes = _beside_rows(tr, a) if error is None else None
        settings = self._settings()
        key = zlib.crc32(repr(shapes).encode()) if shapes is not None else NO_KEY
        same = zlib.crc32(repr(settings).encode())
        keys = same_call(self.world, self.MPI, tr.model_name, "Trainer.step",
                         [key, -key if shapes is not None else NO_KEY, same, -same])
        counts = np.array([rows, error is not None, assigned], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, counts)
        self._unheard = False
        found = []   # what differs between the ranks, in the order it is told
        if keys[0] != -keys[1]:
            found.append(_differing_shapes(tr, self.world.allgather(shapes)))
        if keys[2] != -keys[3]:
            found.append(_differing_settings(tr, self.world.allgather(settings)))
        if counts[2]:   # params assigned on some rank: do the replicas still hold one model?
            found.append(self._assigned_alike())
        found = [f for f in found if f is not None]
        differ = int(bool(found))
        error = error or (found[0] if found else None)
        if self.pipe_comm is not None:
            counts[1] = self.pipe_comm.allreduce(int(counts[1]) + differ)
        if counts[1] or differ:
            refused = [r for r, bad in enumerate(self.world.allgather(error is not None)) if bad]
            raise error or ValueError(f"{tr.model_name}.Trainer.step {tr.steps + 1}: the inputs of rank(s) "
                                      f"{', '.join(map(str, refused))} were refused; this step changed nothing")
        w = rows / int(counts[0]) if self.reduction == "mean" else 1.0
        grads, pending = tr._dp_buffer(), []
        waiting = [set(names) for _, _, names in self.buckets]   # each bucket's params not final yet

        def final(names):
            """Those params' gradients are final: start reducing every bucket they complete."""
            t = time.perf_counter()
            for name in names:
                i = self.bucket_of.get(name)
                if i is None or not waiting[i]:
                    continue
                waiting[i].discard(name)
                if not waiting[i]:
                    start, stop, _ = self.buckets[i]
                    if w != 1.0:
                        grads[start:stop] *= w
                    if self.overlap:
                        pending.append(self.comm.Iallreduce(MPI.IN_PLACE, grads[start:stop]))
            if pending:
                MPI.Request.Testall(pending)   # (progress for the reductions already started)
            self.comm_seconds += time.perf_counter() - t

        loss, weight_sum = tr._dp_gradients(a, grads, final, streamed=self.overlap)
        final(self.bucket_of)   # whatever the backward did not announce is final now
        t = time.perf_counter()
        if self.overlap:
            MPI.Request.Waitall(pending)
        else:
            for start, stop, _ in self.buckets:
                self.comm.Allreduce(MPI.IN_PLACE, grads[start:stop])
        tail = np.array([w * loss, w * weight_sum])
        self.comm.Allreduce(MPI.IN_PLACE, tail)
        self.comm_seconds += time.perf_counter() - t
        loss, total = float(tail[0]), float(tail[1])
        extra = 1.0 - total   # each rank's objective held the weight decay term `weight_sum` times
        facts = tr.rows
        if facts["weight_decay"] and abs(extra) > 0:
            squares = 0.0
            p = tr._dp_params()
            for name in facts["decayed"]:
                if name in self.owned:
                    start, stop = tr.grad_slices[name]
                    value = p[start:stop]
                    grads[start:stop] += (extra * facts["weight_decay"]) * value
                    squares += float(value @ value)
            if self.pipe_comm is not None:
                squares = self.pipe_comm.allreduce(squares)
            loss += extra * 0.5 * facts["weight_decay"] * squares
        return tr._dp_update(loss, grads, self, a)

    def _settings(self):
        """What every rank must train with alike: a rank with another lr, optimizer or clip norm drifts
        apart, one with other buckets or overlap waits for reductions no other rank starts."""
        return {**self.tr._settings(), "overlap": self.overlap, "bucket_bytes": self.bucket_bytes}

    def _assigned(self):
        """Whether tr.params[k] = ... was done since the last step: a trained param's array is not the trainer's
        own (adopted at this step), or a frozen param's is another object."""
        tr = self.tr
        frozen = {k: v for k, v in tr.params.items() if k not in tr._views}
        assigned = any(tr.params.get(k) is not view for k, view in tr._views.items()) or \
            frozen.keys() != self._frozen.keys() or any(v is not self._frozen[k] for k, v in frozen.items())
        self._frozen = frozen   # (held: an object's id is not reused while it is)
        # until the ranks have heard of it: a call refused before that (the ranks made different calls) has
        # adopted the arrays, and the next call must still compare them
        self._unheard = assigned = assigned or self._unheard
        return assigned

    def _assigned_alike(self, what=None, outcome="this step trained nothing"):
        """After tr.params[k] = ... on some rank: None when every replica still holds the same params; else
        every rank takes rank 0's params again and gets the ValueError that says so (`what` the call,
        `outcome` what it did not do)."""
        tr = self.tr
        held = [tr._flat] + [v for k, v in sorted(tr.params.items()) if k not in tr._views]
        mine = 0
        for array in held:
            mine = zlib.crc32(np.ascontiguousarray(tr._host(array)).tobytes(), mine)
        every = self.comm.allgather(mine)
        if len(set(every)) == 1:
            return None
        differ = [r for r, c in enumerate(every) if c != every[0]]
        self._same_params()
        return ValueError(f"{tr.model_name}.{what or f'Trainer.step {tr.steps + 1}'}: params assigned into tr.params "
                          f"differ between the replicas (rank(s) {', '.join(map(str, differ))} hold other values than "
                          f"rank 0): assign the same values on every rank; every rank now holds rank 0's params "
                          f"(with what rank 0 assigned, if it did), and {outcome}")

    def pipe_sum(self, x):
        """x summed over this replica's stages (each holds its own params' gradients)."""
        return x if self.pipe_comm is None else self.pipe_comm.allreduce(x)

    def agree(self, flags):
        """The largest of each int flag over every rank: a step refused anywhere is refused everywhere."""
        flags = np.array(flags, dtype=np.int64)
        self.world.Allreduce(self.MPI.IN_PLACE, flags, op=self.MPI.MAX)
        return flags

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, check, write):
        """check() (this rank's checks: the path to write), then rank 0 writes (a pipeline's stages first
        send it their params and state); every rank returns once the file is written, or raises the
        error rank 0 met. A check refused on any rank is raised on every rank before anything is
        written. Params assigned into tr.params since the last call are compared between the replicas, as
        a step compares them: if they differ, every rank takes rank 0's and nothing is written. Every
        replica gathers its stages, so that every rank holds every param current after a save, as one
        pipeline's do."""
        assigned = self._assigned()   # (before check() adopts what was assigned: the next step would not see it)
        path = checked_on_every_rank(self.world, self.MPI, self.tr.model_name, "Trainer.save", check)
        assigned = self.comm.allreduce(int(assigned), op=self.MPI.MAX)
        self._unheard = False
        differ = self._assigned_alike("Trainer.save", "nothing was written") if assigned else None
        if self.world.allreduce(int(differ is not None), op=self.MPI.MAX):
            raise differ or ValueError(f"{self.tr.model_name}.Trainer.save: params assigned into tr.params differ "
                                       f"between the replicas of another stage; nothing was written")
        if self.pipe_comm is not None:
            gather_stages(self.tr, self.pipe_comm, self.owned)
        write_on_rank_0(self.world, path, write, self.tr.model_name)


def same_call(comm, MPI, model_name, what, keys=()):
    """The first collective of every call the ranks make together (a data-parallel or parameter-server
    Trainer, its step, save, Trainer.load): the MAX over every rank
    of [call, -call, *keys], keys returned. A rank that saved while another stepped waited in a
    collective the other never reached (a trial's two ranks hung); now every rank raises, and nothing
    ran on any."""
    code = zlib.crc32(what.encode())
    reduced = np.zeros(CALL_KEYS, dtype=np.int64)
    reduced[:2 + len(keys)] = [code, -code, *keys]
    comm.Allreduce(MPI.IN_PLACE, reduced, op=MPI.MAX)
    if reduced[0] != -reduced[1]:
        made = ", ".join(f"{call} on rank {r}" for r, call in enumerate(comm.allgather(what)))
        raise ValueError(f"{model_name}.{what}: the ranks made different calls ({made}): every rank makes the same "
                         f"calls in the same order; nothing ran on any rank")
    return reduced[2:2 + len(keys)]


def checked_on_every_rank(comm, MPI, model_name, what, check):
    """check() on every rank (a call's own checks, e.g. a checkpoint's path), then same_call with whether it
    passed: a refusal on any rank is raised on every rank, before any collective of the call (the others
    would wait for it)."""
    try:
        result, error = check(), None
    except Exception as e:   # raised on every rank below; this one says why
        result, error = None, e
    if same_call(comm, MPI, model_name, what, [error is not None])[0]:
        refused = [r for r, bad in enumerate(comm.allgather(error is not None)) if bad]
        if error is not None:
            raise error
        raise ValueError(f"{model_name}.{what}: rank(s) {', '.join(map(str, refused))} refused the call; nothing "
                         f"ran on any rank")
    return result


@contextlib.contextmanager
def refused_on_every_rank(trainer, parallel, options):
    """Around a Trainer(parallel=...)'s own checks: one that fails on this rank joins the ranks' first
    collective (made_on_every_rank), saying so, before it raises here; the other ranks raise there. Without
    it they waited for this rank in DataParallel's or ParameterServer's first collective."""
    try:
        yield
    except Exception:
        if parallel in ("data", "ps"):
            try:
                MPI = _import_mpi(trainer, parallel)
                comm = world(options.get("comm"), MPI, trainer, parallel)
            except Exception:   # (no MPI or a bad comm: the error raised here says enough)
                comm = None
            if comm is not None:
                made_on_every_rank(comm, MPI, trainer.model_name, parallel, refused=True)
        raise


def made_on_every_rank(comm, MPI, model_name, parallel, refused=False):
    """The first collective of a Trainer(parallel=...): every rank says whether its own checks refused the
    trainer; if any did, every other rank raises too (nothing is made)."""
    what = f"Trainer(parallel={parallel!r})"
    if same_call(comm, MPI, model_name, what, [int(refused)])[0]:
        ranks = [r for r, bad in enumerate(comm.allgather(refused)) if bad]
        if not refused:
            raise ValueError(f"{model_name}.{what}: rank(s) {', '.join(map(str, ranks))} refused their Trainer (their "
                             f"error says why); no rank made one")


def agreed_on_every_rank(trainer_class, options, what, check):
    """checked_on_every_rank over the communicator a Trainer(**options) would run over, before it is made
    (Trainer.load: a rank whose file is missing raises, and so does every other)."""
    parallel = options.get("parallel")
    MPI = _import_mpi(trainer_class, parallel)
    comm = world(options.get("comm"), MPI, trainer_class, parallel)
    return checked_on_every_rank(comm, MPI, trainer_class.model_name, what, check)


def gather_stages(tr, comm, owned):
    """Every param and optimizer value onto each rank of `comm`, a pipeline's stages, one a rank: each
    rank updated only its own stage's (`owned`, param names)."""
    from mpi4py import MPI
    mask = np.zeros(tr._dp_params().size, dtype=bool)
    for name in owned:
        start, stop = tr.grad_slices[name]
        mask[start:stop] = True
    for array in [tr._flat, *tr.state.values()]:
        host = np.where(mask, tr._host(array), 0)
        comm.Allreduce(MPI.IN_PLACE, host)
        if isinstance(array, np.ndarray):
            array[...] = host
        else:
            array.copy_to_device(host)


def write_on_rank_0(comm, path, write, model_name):
    """Rank 0 runs write(path); every rank returns once the file is written, or raises the error rank
    0 met (every rank raises: none waits for a file that is not there). Every rank must name the same
    path: a rank that named its own would return as if its file were written."""
    paths = comm.allgather(os.fspath(path))
    if len(set(paths)) > 1:
        raise ValueError(f"{model_name}.Trainer.save: the ranks name different paths "
                         f"({'; '.join(f'rank {r}: {p}' for r, p in enumerate(paths))}); rank 0 writes the one "
                         f"checkpoint of every rank's training: give every rank the same path")
    error = None
    if comm.Get_rank() == 0:
        try:
            write(path)
        except Exception as e:
            error = e
    message = comm.bcast(None if error is None else f"{type(error).__name__}: {error}", root=0)
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"{model_name}.Trainer.save: rank 0 could not write {path}: {message}")


# ---- the parameter server ------------------------------------------------------------------------
TAG_PUSH, TAG_GRAD, TAG_REPLY, TAG_PARAMS, TAG_DONE = 71, 72, 73, 74, 75


class ParameterServer:
    """`Trainer(params, ..., parallel="ps", servers=S, staleness=s, timeout=60.0)` under mpiexec -n N.

    Ranks 0..S-1 are servers, each holding a contiguous shard of the flat params and its optimizer
    state; ranks S..N-1 are workers (`tr.is_worker`, `tr.worker` in 0..W-1, `tr.workers`), each
    with a full copy of the params. One script runs on every rank:

        with mod.Trainer(params, optimizer="sgd", lr=0.1, parallel="ps", servers=1, staleness=4) as tr:
            if tr.is_worker:
                for batch in my_batches(tr.worker, tr.workers):
                    loss = tr.step(**batch)
        tr.save("final.npz")   # rank 0 writes the gathered params; every rank has them in tr.params

    A worker's step computes its gradients on its copy, pushes each server its shard of them
    (with its rows, loss and squared gradient norm), and pulls the params back. A server applies
    what it receives with the optimizer. Staleness s bounds how far a worker may run ahead: the
    params it gets back after its n-th push include every worker's first n - s pushes.

    - staleness=0 is synchronous: a server waits for the round's push of every worker, sums them
      weighted by rows (B_w/B for a mean loss, 1 for a sum; weight decay counted once), clips by the
      norm of that sum over every shard, and makes one optimizer step: the params of
      parallel="data" (and of one process on the concatenated batch). step returns the round's loss.
    - staleness>0 is asynchronous (Downpour SGD): each push is one optimizer step on the server's
      shard, with that worker's gradient clipped by its own norm; step returns the worker's own loss.
      A worker that has finished no longer holds the others back.

    Training ends when every rank leaves the `with` block (or calls `tr.finish()`): servers serve
    there until every worker has finished, then the shards (params and optimizer state) are
    gathered, so that afterwards every rank's `tr.params` holds the final params, `tr.save` writes
    them once from rank 0 (a checkpoint that a serial Trainer loads), and no rank may step again.

    Failure: every wait has a deadline (`timeout` seconds without a message it needs): a server
    whose worker stops sending, or a worker whose server stops answering, raises RuntimeError
    naming the rank, and a worker that leaves the block by an exception tells the servers so, and
    they raise. (mpiexec ends the whole job when a rank exits with an error or is killed.)
    A step that is not finite or that would overflow raises FloatingPointError on the worker(s)
    whose step it was (every worker, at staleness 0) and changes no param.
    """

    def __init__(self, tr, comm=None, servers=1, staleness=0, timeout=60.0):
        self.MPI, self.tr = _import_mpi(tr, "ps"), tr
        self.reduction = _weighting(tr, "ps")
        comm = world(comm, self.MPI, tr, "ps")
        if tr._device:
            raise ValueError(f"{tr.model_name}.Trainer(parallel='ps') runs on CPU builds (servers hold numpy "
                             f"shards); use parallel='data' for a --target cuda module")
        if tr.pipeline is not None and tr.pipeline.K > 1:
            raise ValueError(f"{tr.model_name}.Trainer(parallel='ps') takes a build with one stage")
        if tr.pipeline is not None:
            tr.pipeline.attach(None)
        size = comm.Get_size()
        made_on_every_rank(comm, self.MPI, tr.model_name, "ps")
        # first, before a check that one rank could fail alone: every rank is made alike (servers that differ
        # ran the protocol on different shards until the timeout; a worker's own lr went unused)
        mine = {"servers": servers, "staleness": staleness, "timeout": timeout, **tr._settings()}
        every = comm.allgather(mine)
        if any(repr(e) != repr(mine) for e in every):   # (repr: a nan timeout equals itself)
            raise _differing_settings(tr, every, "Trainer(parallel='ps')", "no rank made one")
        for name, value, low in (("servers", servers, 1), ("staleness", staleness, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{tr.model_name}.Trainer: {name} must be an int >= {low}, got {value!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"{tr.model_name}.Trainer: timeout must be a number of seconds > 0, got {timeout!r}")
        if size <= servers:
            raise ValueError(f"{tr.model_name}.Trainer(parallel='ps', servers={servers}): mpiexec started {size} "
                             f"process(es); run at least {servers + 1} (servers, then workers)")
        self.comm, self.S, self.staleness, self.timeout = comm, servers, staleness, float(timeout)
        self.rank = comm.Get_rank()
        self.workers = size - servers
        self.is_worker = self.rank >= servers
        self.worker = self.rank - servers if self.is_worker else None
        self.finished = False
        self.comm_seconds = 0.0
        n = tr._flat.size
        bounds = np.linspace(0, n, servers + 1).round().astype(int)
        self.shards = list(zip(bounds[:-1], bounds[1:]))
        self.servers_comm = comm.Split(color=0 if not self.is_worker else 1, key=self.rank)
        comm.Bcast(tr._flat, root=0)   # every rank starts from rank 0's params
        self.pushes = 0
        if not self.is_worker:
            a, b = self.shards[self.rank]
            self.lo, self.hi = a, b
            decay = np.zeros(n, dtype=bool)
            for name in (tr.rows["decayed"] if tr.rows["weight_decay"] else ()):
                s, e = tr.grad_slices[name]
                decay[s:e] = True
            self.decay = decay[a:b]

    # ---- workers ---------------------------------------------------------------------------------
    def step(self, inputs):
        tr = self.tr
        if not self.is_worker:
            raise RuntimeError(f"{tr.model_name}.Trainer.step: rank {self.rank} is a parameter server; only workers "
                               f"step (if tr.is_worker: ...)")
        if self.finished:
            raise RuntimeError(f"{tr.model_name}.Trainer.step: training has finished (tr.finish() was called)")
        a = tr.signature.inputs(inputs, tr.loss_inputs, "Trainer.step")
        rows = _rows(tr, a)
        tr._adopt()
        p = tr.signature.params(tr.params, exact=True)
        loss = tr._gradients(p, a, tr._grads)
        sq = sum_squares(tr._grads)
        self.pushes += 1
        t = time.perf_counter()
        header = np.array([self.pushes, rows, loss, sq], dtype=np.float64)
        sent = []
        for s, (lo, hi) in enumerate(self.shards):
            sent.append(self.comm.Isend(header, dest=s, tag=TAG_PUSH))
            sent.append(self.comm.Isend(tr._grads[lo:hi], dest=s, tag=TAG_GRAD))
        replies = [np.empty(4, dtype=np.float64) for _ in self.shards]
        requests = [self.comm.Irecv(replies[s], source=s, tag=TAG_REPLY) for s in range(self.S)]
        requests += [self.comm.Irecv(tr._flat[lo:hi], source=s, tag=TAG_PARAMS) for s, (lo, hi) in enumerate(self.shards)]
        self._wait(requests + sent, lambda: f"worker {self.worker} (rank {self.rank}) got no params back from the "
                                            f"servers for {self.timeout:g} s after its push {self.pushes} (a server "
                                            f"died or hangs, or holds the reply back while another worker is more "
                                            f"than staleness={self.staleness} pushes behind)")
        self.comm_seconds += time.perf_counter() - t
        status = max(int(r[0]) for r in replies)
        if status:
            what = {1: f"the loss is {loss}" if not math.isfinite(loss) else "the gradient is not finite",
                    2: "the update overflows (lr too large?)"}[status] if status in (1, 2) else "the step was refused"
            if self.staleness == 0 and status == 1 and math.isfinite(loss) and math.isfinite(sq):
                what = "another worker's loss or gradient is not finite"
            raise FloatingPointError(f"{tr.model_name}.Trainer.step {self.pushes} (worker {self.worker}): {what}"
                                     f"{tr._non_finite_inputs(a)}; the servers changed no parameter for it")
        tr.steps = self.pushes
        return float(replies[0][1]) if self.staleness == 0 else float(loss)

    def _wait(self, requests, why):
        """Wait for all `requests`, at most `timeout` seconds; else RuntimeError(why())."""
        MPI = self.MPI
        deadline = time.monotonic() + self.timeout
        pause = 1e-5
        while not MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.tr.model_name} parameter server: {why()}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # ---- servers ---------------------------------------------------------------------------------
    def serve(self):
        """Apply every worker's pushes until each has finished."""
        tr, MPI, comm = self.tr, self.MPI, self.comm
        lo, hi = self.lo, self.hi
        W = self.workers
        clock = [0] * W              # pushes applied, per worker
        done = [False] * W
        last_seen = [time.monotonic()] * W
        waiting = []                 # (worker, its push count): replies held back by the staleness bound
        round_ = {}                  # staleness 0: worker -> (header, gradient) of this round
        status = MPI.Status()
        pause = 1e-5
        while not all(done):
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                pause = 1e-5
                source, tag = status.Get_source(), status.Get_tag()
                w = source - self.S
                last_seen[w] = time.monotonic()
                if tag == TAG_DONE:
                    failed = np.empty(1, dtype=np.int64)
                    comm.Recv(failed, source=source, tag=TAG_DONE)
                    if failed[0]:
                        raise RuntimeError(f"{tr.model_name} parameter server (rank {self.rank}): worker {w} (rank "
                                           f"{source}) stopped with an error; training cannot go on")
                    done[w] = True
                elif tag == TAG_PUSH:
                    header = np.empty(4, dtype=np.float64)
                    comm.Recv(header, source=source, tag=TAG_PUSH)
                    grad = np.empty(hi - lo, dtype=tr._flat.dtype)
                    self._recv(grad, source, TAG_GRAD)
                    if self.staleness == 0:
                        round_[w] = (header, grad)
                    else:
                        code = self._apply_async(header, grad)
                        clock[w] += 1
                        waiting.append((w, int(header[0]), code, 0.0))
                else:
                    raise RuntimeError(f"parameter server: unexpected message tag {tag} from rank {source}")
            else:
                now = time.monotonic()
                held = {w for w, *_ in waiting} | set(round_)   # these wait for us, not we for them
                stalled = [w for w in range(W) if not done[w] and w not in held and now - last_seen[w] > self.timeout]
                if stalled:
                    w = min(stalled, key=lambda v: last_seen[v])   # the one silent longest
                    raise RuntimeError(f"{tr.model_name} parameter server (rank {self.rank}): worker {w} (rank "
                                       f"{w + self.S}) sent nothing for {self.timeout:g} s (it died or hangs; a "
                                       f"worker must push or finish at least every `timeout` seconds)")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
            if self.staleness == 0 and round_ and all(done[w] or w in round_ for w in range(W)):
                if any(done[w] for w in range(W)):
                    raise RuntimeError(f"{tr.model_name} parameter server: at staleness 0 every worker must make the "
                                       f"same number of steps (worker(s) {[w for w in range(W) if done[w]]} finished "
                                       f"while others pushed step {int(next(iter(round_.values()))[0][0])})")
                code, loss = self._apply_round(round_)
                for w in sorted(round_):
                    self._reply(w, code, loss)
                round_ = {}
            if self.staleness > 0 and waiting:
                keep = []
                for w, n, code, loss in waiting:
                    if self._may_go(n, clock, done):
                        self._reply(w, code, loss)
                    else:
                        keep.append((w, n, code, loss))
                waiting = keep

    def _may_go(self, n, clock, done):
        """After its n-th push a worker may go on once every unfinished worker has pushed n - s times."""
        return all(d or c >= n - self.staleness for c, d in zip(clock, done))

    def _recv(self, buffer, source, tag):
        request = self.comm.Irecv(buffer, source=source, tag=tag)
        self._wait([request], lambda: f"rank {source} sent a push header but not its gradient")

    def _reply(self, w, code, loss):
        lo, hi = self.lo, self.hi
        rank = w + self.S
        self.comm.Send(np.array([code, loss, 0.0, 0.0]), dest=rank, tag=TAG_REPLY)
        self.comm.Send(self.tr._flat[lo:hi], dest=rank, tag=TAG_PARAMS)

    def _update(self, g, scale, mode):
        tr = self.tr
        lo, hi = self.lo, self.hi
        f = tr.signature.float.type
        if tr.optimizer == "sgd":
            return sgd_update(tr._flat[lo:hi], tr.state["momentum"][lo:hi], g, f(tr.lr), f(tr.momentum), scale, mode)
        t = tr.steps + 1
        return adam_update(tr._flat[lo:hi], tr.state["m"][lo:hi], tr.state["v"][lo:hi], g, f(tr.lr), f(tr.betas[0]),
                           f(tr.betas[1]), f(tr.eps), f(1.0 - tr.betas[0] ** t), f(1.0 - tr.betas[1] ** t), scale, mode)

    def _apply_async(self, header, g):
        """One optimizer step on this shard with one worker's gradient: 0 done, 1 not finite, 2 overflow."""
        tr = self.tr
        _, _, loss, sq = header
        if not (math.isfinite(loss) and math.isfinite(sq)):
            return 1
        scale = tr.signature.float.type(clip_scale(sq, tr.clip))
        if self._update(g, scale, CHECKED_WRITE):
            return 2
        tr.steps += 1
        return 0

    def _apply_round(self, round_):
        """Staleness 0: one optimizer step with the round's gradients weighted by rows, as parallel='data'."""
        tr, MPI = self.tr, self.MPI
        B = sum(int(h[1]) for h, _ in round_.values())
        g = np.zeros(self.hi - self.lo, dtype=tr._flat.dtype)
        loss = 0.0
        total = 0.0
        for w in sorted(round_):
            header, grad = round_[w]
            weight = header[1] / B if self.reduction == "mean" else 1.0
            g += g.dtype.type(weight) * grad
            loss += weight * header[2]
            total += weight
        extra = 1.0 - total
        wd = tr.rows["weight_decay"]
        p = tr._flat[self.lo:self.hi]
        squares = 0.0
        if wd and extra:
            g[self.decay] += (extra * wd) * p[self.decay]
            squares = float(p[self.decay] @ p[self.decay])
        sums = np.array([sum_squares(g), squares])
        self.servers_comm.Allreduce(MPI.IN_PLACE, sums)
        sq = float(sums[0])
        loss += extra * 0.5 * wd * float(sums[1]) if wd and extra else 0.0
        code = 0
        if not (math.isfinite(loss) and math.isfinite(sq)):
            code = 1
        else:
            scale = tr.signature.float.type(clip_scale(sq, tr.clip))
            if self.servers_comm.allreduce(self._update(g, scale, CHECK), op=MPI.SUM):
                code = 2
            else:
                self._update(g, scale, WRITE)
                tr.steps += 1
        return code, loss

    # ---- the end ---------------------------------------------------------------------------------
    def finish(self, failed=False):
        """Workers: tell the servers this worker is done. Servers: serve until every worker is done.
        Then every rank gets the final params and optimizer state (rank 0 writes checkpoints)."""
        tr = self.tr
        if self.finished:
            return
        self.finished = True
        if self.is_worker:
            for s in range(self.S):
                self.comm.Send(np.array([int(failed)], dtype=np.int64), dest=s, tag=TAG_DONE)
            if failed:
                return
        else:
            self.serve()
        # the shards, params and optimizer state, gathered onto every rank
        counts = [hi - lo for lo, hi in self.shards] + [0] * self.workers
        displs = [lo for lo, _ in self.shards] + [0] * self.workers
        for array in [tr._flat, *tr.state.values()]:
            mine = array[self.lo:self.hi].copy() if not self.is_worker else np.empty(0, array.dtype)
            self.comm.Allgatherv(mine, [array, (counts, displs)])
        tr.steps = self.comm.bcast(tr.steps, root=0)

    def save(self, check, write):
        if not self.finished:
            raise RuntimeError(f"{self.tr.model_name}.Trainer.save (parallel='ps'): call tr.finish() (or leave the "
                               f"with block) first: the params live in the servers' shards until then")
        path = checked_on_every_rank(self.comm, self.MPI, self.tr.model_name, "Trainer.save", check)
        write_on_rank_0(self.comm, path, write, self.tr.model_name)
