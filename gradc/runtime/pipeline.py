"""The pipeline executor of a module compiled with --devices K or --microbatches M.

loss_and_grad runs as each stage's forward and backward functions over M microbatches (the
batch split along its batch dim, sizes differing by at most one), in the schedule's order. A
transfer node gets the value of its source when the source's function has run. Gradients and
the loss add up over microbatches with weights B_m / B (a mean loss) or 1 (a sum); the weight
decay term, which every microbatch's objective holds, is then corrected to count once.

In one process every stage runs here, interleaved. Under `mpiexec -n K`, rank r runs stage r in
its own order and exchanges transfers with mpi4py: an array goes as a small header (shape,
dtype) and then its buffer, unpickled. A --target cuda rank sends through host memory (it copies
a value off its GPU; the received copy goes to the device with the next call's arguments), or,
with GRADC_MPI_CUDA_AWARE=1 (an MPI built with CUDA support), sends and receives device buffers
where they are. A value goes out as soon as it is made, and is received when a function first
needs it. Messages of one transfer keep their order (MPI does not overtake between a pair of
ranks on one tag), so the tag is the transfer's index (and past those, a param's index when
lr_grad, which runs whole on every rank, gets the params their owners hold). Every rank gets the
loss; each rank's gradients are those of its own params.
"""
import os
import zlib

import numpy as np

from .optim import accumulate
from .schedules import interleave, stage_orders

MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def mpi_world():
    """COMM_WORLD under mpiexec with more than one process, else None."""
    if not any(k in os.environ for k in MPI_ENV):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError("this process runs under mpiexec, which needs mpi4py: pip install 'gradc[mpi]'") from None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


def local_rank():
    """This process's rank among the ranks on its node under mpiexec (which GPU it takes), else None."""
    for key in LOCAL_RANK_ENV:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


class HostMemory:
    """How the executor calls stage functions, moves values between stages and adds up their
    results on the CPU target (a --target cuda module passes gradc.runtime.cuda_stages.DeviceMemory,
    with the same methods). Virtual devices share this process's memory: nothing moves."""

    def __init__(self, arena, data):
        self.arena, self._data = arena, data

    def begin_step(self, stages, spread):
        pass

    def local(self, value, stage):
        return value

    def transfer(self, value, source, target):
        return value

    def data(self, key, stage=0):
        return self._data[key]

    def call(self, fn, fname, args, inputs, stage=0):
        return fn(*args, *self.arena.get(fname, inputs))

    def number(self, value, stage=0):
        return float(value)

    def outgoing(self, value):
        """What an MPI message carries: the array itself."""
        return value

    def incoming(self, shape, dtype):
        """Where an MPI message of an array lands."""
        return np.empty(shape, dtype)

    def zero(self, flat):
        flat[:] = 0.0

    def add(self, flat, start, stop, weight, value, stage=None):
        """flat[start:stop] += weight * value (flattened); `value` was made on `stage`."""
        accumulate(flat[start:stop], flat.dtype.type(weight), np.ascontiguousarray(value, flat.dtype).reshape(-1))

    def squares(self, value):
        value = np.asarray(value).reshape(-1)
        return float(value @ value)


def send(comm, value, dest, tag):
    """Start sending `value` to rank `dest`: an array as its shape and dtype, then its buffer as it
    is (a CUDA-aware MPI reads a device array in place); anything else pickled. Returns the
    requests to wait on (mpi4py's request keeps its buffer alive)."""
    if isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__"):
        data = np.ascontiguousarray(value) if isinstance(value, np.ndarray) else value
        return [comm.isend(("array", tuple(data.shape), np.dtype(data.dtype).str), dest=dest, tag=tag),
                comm.Isend(data, dest=dest, tag=tag)]
    return [comm.isend(("object", value), dest=dest, tag=tag)]


def receive(comm, memory, source, tag):
    """The next value `send` sent from rank `source` on `tag` (the two messages of an array keep
    their order: MPI does not overtake on one tag between two ranks)."""
    header = comm.recv(source=source, tag=tag)
    if header[0] == "object":
        return header[1]
    buffer = memory.incoming(header[1], np.dtype(header[2]))
    comm.Recv(buffer, source=source, tag=tag)
    return buffer


def same_batch(comm, inputs):
    """Under mpiexec every rank passes the whole batch, and each stage reads its part of it: ranks given
    different ones would be silently combined (stage 0's x with the last stage's labels). The ranks
    compare each input's shape, dtype and (on the host) a checksum of its bytes; all raise if any differ."""
    mine = {k: (tuple(np.shape(v)), str(getattr(v, "dtype", type(v).__name__)),
                None if hasattr(v, "copy_to_host") else zlib.crc32(np.ascontiguousarray(v).tobytes()))
            for k, v in inputs.items()}
    every = comm.allgather(mine)
    differ = sorted(k for k in set().union(*every) if len({str(seen.get(k)) for seen in every}) > 1)
    if differ:
        what = []
        for k in differ:
            kinds = [f"{seen[k][0]} {seen[k][1]}" if k in seen else "none" for seen in every]
            what.append(f"{k}: its values" if len(set(kinds)) == 1 else
                        f"{k}: " + ", ".join(f"rank {r} {kind}" for r, kind in enumerate(kinds)))
        raise ValueError(f"the ranks running this pipeline's stages were given different batches ({'; '.join(what)}): "
                         f"every rank passes the same whole batch, and each stage reads its part; nothing ran")


def differing_settings(where, every, outcome):
    """The error when the ranks' trainers are set differently (tr.lr set on one rank only, say): `every`, each
    rank's Trainer._settings()."""
    names = [k for k in every[0] if any(repr(e.get(k)) != repr(every[0][k]) for e in every)]
    seen = "; ".join(f"{k}: " + ", ".join(f"{e.get(k)!r} on rank {r}" for r, e in enumerate(every)) for k in names)
    return ValueError(f"{where}: the ranks' trainers differ ({seen}); every rank must make its Trainer with the same "
                      f"settings and set them alike; {outcome}")


def _rows(v, axis, a, b):
    """Rows a:b of v on its batch axis (copied when that is not axis 0: the kernels read C order)."""
    return np.ascontiguousarray(v[(slice(None),) * axis + (slice(a, b),)])


def recorded_axes(batch_inputs):
    """{input name: the axis of its batch rows}, from what a module records (one compiled before the
    axes were recorded lists names: axis 0)."""
    return dict(batch_inputs) if isinstance(batch_inputs, dict) else dict.fromkeys(batch_inputs, 0)


class Pipeline:
    """functions: (stage, "F"|"B") -> (compiled function, fname, argument spec, roots);
    an argument is ("p", param) | ("a", input) | ("v", node) | ("c", data key)."""

    def __init__(self, functions, transfers, objective, grad_nodes, grad_slices, *, stages, schedule, microbatches,
                 reduction, batch_inputs, weight_decay, decayed, memory, param_names, objective_stage,
                 grad_stages, model="model"):
        self.model = model                    # the model's name, which errors start with
        self.functions = functions
        self.transfers = transfers            # (transfer node, source, from stage, to stage, when made)
        self.sources = {}                     # (stage, kind) -> [(source node, transfer node)]
        for t, u, src, _, when in transfers:
            if when != "param":
                self.sources.setdefault((src, when), []).append((u, t))
        self.route = {t: (src, dst, i + 1) for i, (t, _, src, dst, _) in enumerate(transfers)}   # tag = index + 1
        self.param_names = param_names        # param node -> name
        self.objective_stage = objective_stage
        self.grad_stages = grad_stages        # param -> the stage its gradient is made on
        self._comm = False                    # not looked up yet
        self.objective = objective
        self.grad_nodes = grad_nodes          # node -> param
        self.grad_slices = grad_slices
        self.K, self.schedule, self.M = stages, schedule, microbatches
        self.reduction = reduction
        self.batch_inputs = recorded_axes(batch_inputs)
        self.weight_decay, self.decayed = weight_decay, decayed
        self.memory = memory                  # HostMemory, or a CUDA module's DeviceMemory
        self.order = interleave(schedule, stages, microbatches)
        last = {}                             # value node -> the last function that reads it
        for key in sorted(functions, key=lambda key: (key[0], key[1] != "F")):
            for spec in functions[key][2]:
                if spec[0] == "v":
                    last[spec[1]] = key
        self.read = set(last)                 # values some function takes as an argument
        # the stage whose rank holds each param as used: a trained one's owner, another's sender (or reader)
        self.homes = {name: k for (k, _), (_, _, spec, _) in functions.items() for what, name in spec if what == "p"}
        self.homes |= {param_names[u]: src for _, u, src, _, when in transfers if when == "param"}
        self.homes |= dict(grad_stages)
        self.drop_after = {}
        for node, key in last.items():
            self.drop_after.setdefault(key, []).append(node)

    @property
    def comm(self):
        """mpi4py's COMM_WORLD when this process is one rank of a pipeline run, else None."""
        if self._comm is False:
            comm = mpi_world()
            if comm is not None and comm.Get_size() != self.K:
                raise RuntimeError(f"this module was compiled for {self.K} stages, but mpiexec started "
                                   f"{comm.Get_size()} processes; run mpiexec -n {self.K}")
            self._comm = comm
        return self._comm

    def attach(self, comm):
        """Run the stages over `comm` (one stage a rank), or in this process (None): a data-parallel
        Trainer gives each replica's pipeline a communicator of its own."""
        if comm is not None and comm.Get_size() != self.K:
            raise RuntimeError(f"this module was compiled for {self.K} stages, but its pipeline group has "
                               f"{comm.Get_size()} ranks")
        self._comm = comm

    def owned(self, grads):
        """The gradients this process answers for: all of them, or under MPI its own params'."""
        comm = self.comm
        if comm is None:
            return grads
        return {k: v for k, v in grads.items() if self.grad_stages.get(k, 0) == comm.Get_rank()}

    def allreduce(self, x):
        comm = self.comm
        return x if comm is None else comm.allreduce(x)

    def agree(self, what, check, settings=None, assigned=lambda: ()):
        """check() (this rank's checks of a call's arguments), and under MPI whether every rank passed them.
        The ranks run the stages together: a call one rank refused alone left the others waiting in the
        stages' exchanges, and paired its next call with their last (a trial's pipeline hung two calls
        later). So a refusal on any rank is raised on every rank before anything runs; so are trainers set
        apart (`settings`, each rank's Trainer._settings(): an lr set on one rank only, a checkpoint loaded
        on one), ranks making different calls (`what`: one steps while another saves), and params assigned
        into tr.params only on ranks that do not hold them (`assigned()`, the names this rank took: the
        holder's stage uses a param, so the value would be lost).
        Returns check()'s result."""
        comm = self.comm
        if comm is None:
            return check()
        try:
            result, error = check(), None
        except Exception as e:   # raised on every rank below; this one says why
            result, error = None, e
        told = None if error is None else str(error)
        if told is not None and not told.startswith(f"{self.model}."):   # (gradc's own say whose call it was)
            told = f"{type(error).__name__}: {told}"
        mine = (what.split(" ")[0], told, settings, sorted(assigned()))
        # one reduction of a checksum when the ranks agree (every step); what each holds only when they do not
        from mpi4py import MPI
        key = zlib.crc32(repr(mine).encode())
        keys = np.array([key, -key], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, keys, op=MPI.MAX)
        if keys[0] == -keys[1]:   # the same on every rank: all passed (or all refused alike)
            if error is not None:
                raise error
            return result
        every = comm.allgather(mine)
        where = f"{self.model}.{what}"
        calls = [call for call, _, _, _ in every]
        if len(set(calls)) > 1:   # (rank 0 steps while rank 1 saves: each would wait for the other)
            made = ", ".join(f"{c} on rank {r}" for r, c in enumerate(calls))
            raise ValueError(f"{where}: the ranks made different calls ({made}): every rank makes the same calls in "
                             f"the same order; nothing ran on any rank")
        if error is not None:
            raise error
        refused = [r for r, (_, e, _, _) in enumerate(every) if e is not None]
        if refused:
            raise ValueError(f"{where}: nothing ran on any rank: rank(s) {', '.join(map(str, refused))} refused the "
                             f"call ({every[refused[0]][1]})")
        if settings is not None and any(repr(s) != repr(settings) for _, _, s, _ in every):
            raise differing_settings(where, [s for _, _, s, _ in every], "nothing ran on any rank")
        for rank, (_, _, _, names) in enumerate(every):
            for name in names:
                home = self.homes.get(name, 0)
                if name not in every[home][3]:
                    raise ValueError(f"{where}: params[{name!r}] was assigned on rank {rank}, but rank {home} runs the "
                                     f"stage that holds it, and did not assign it: assign it on every rank (the value "
                                     f"rank {home} gets is the one used); nothing ran on any rank")
        return result

    def params_from_owners(self, params):
        """`params` with each trained param as the rank that owns (and updates) it holds it: an entry
        that runs whole on every rank (lr_grad) reads them all. In one process, `params` itself."""
        comm = self.comm
        if comm is None:
            return params
        rank, params, sent = comm.Get_rank(), dict(params), []
        first_tag = len(self.transfers) + 1   # past the transfers' tags
        for i, name in enumerate(sorted(self.grad_stages)):
            owner = self.grad_stages[name]
            if owner == rank:
                for dest in range(self.K):
                    if dest != rank:
                        sent += send(comm, self.memory.outgoing(params[name]), dest, first_tag + i)
            else:
                params[name] = receive(comm, self.memory, owner, first_tag + i)
        for request in sent:
            request.wait()
        return params

    def keep_owned(self, grads):
        """Zero, in the flat `grads`, the gradients of params another rank owns: under MPI each rank
        answers for its own params' gradients (as loss_and_grad's stages leave them)."""
        comm = self.comm
        if comm is None:
            return
        for name, (start, stop) in self.grad_slices.items():
            if self.grad_stages.get(name, 0) != comm.Get_rank():
                self.memory.zero(grads[start:stop])

    def reschedule(self, schedule, microbatches):
        """Run later calls under another schedule or microbatch count (the compiled stage functions
        depend on neither when the batch dim is symbolic in them: a --microbatches build)."""
        if microbatches > 1 and not self.batch_inputs:
            raise ValueError("this build's code has its batch dim bound (it was compiled with --microbatches 1): "
                             "recompile with --microbatches M > 1 to split batches")
        self.schedule, self.M = schedule, microbatches
        self.order = interleave(schedule, self.K, microbatches)

    def rows(self, inputs):
        """The batch's rows, when the inputs make M microbatches (None with one); ValueError otherwise. A
        data-parallel replica asks before its ranks agree on a step: one replica refusing alone would leave
        the others waiting."""
        if self.M == 1:
            return None
        axes = self.batch_inputs
        rows = {np.shape(inputs[name])[axis] for name, axis in axes.items() if name in inputs}
        if len(rows) != 1:
            raise ValueError(f"{self.model}: the batch inputs {', '.join(f'{k} (axis {a})' for k, a in axes.items())} "
                             f"must have the same number of rows, got {sorted(rows)}")
        B = rows.pop()
        if B < self.M:
            raise ValueError(f"{self.model}: a batch of {B} row{'s' if B != 1 else ''} cannot make {self.M} "
                             f"microbatches (this build's --microbatches): give at least {self.M} rows")
        return B

    def split(self, inputs):
        """M microbatches of the inputs, and their weights."""
        B = self.rows(inputs)
        if B is None:
            return [inputs], [1.0]
        axes = self.batch_inputs
        bounds = np.linspace(0, B, self.M + 1).round().astype(int)
        micro = [{k: (_rows(v, axes[k], a, b) if k in axes else v) for k, v in inputs.items()}
                 for a, b in zip(bounds[:-1], bounds[1:])]
        weights = [(b - a) / B if self.reduction == "mean" else 1.0 for a, b in zip(bounds[:-1], bounds[1:])]
        return micro, weights

    def loss_and_grad(self, params, inputs, grads, decay_once=True, on_ready=None):
        """The objective; its gradients are added into the flat `grads` (zeroed here). Without
        `decay_once` the weight decay term stays counted `self.weight_sum` times (a data-parallel
        Trainer corrects it once for all ranks); on_ready(stage) is called when the gradients of a
        stage's params are final (here, or under MPI on this rank's stage)."""
        comm = self.comm
        if comm is not None:   # first: the ranks' batches the same, a batch that cannot be split is so on every rank
            same_batch(comm, inputs)
        micro, weights = self.split(inputs)
        self.weight_sum = float(sum(weights))
        self.memory.begin_step(self.K, spread=comm is None)
        self.memory.zero(grads)
        if comm is None:
            loss = self._run(self.order, params, micro, weights, grads, None, on_ready)
        else:
            rank = comm.Get_rank()
            params, sent = self._exchange_params(comm, rank, params)
            order = [(rank, op, m) for op, m in stage_orders(self.schedule, self.K, self.M)[rank]]
            loss = self._run(order, params, micro, weights, grads, comm, on_ready)
            loss = comm.bcast(loss, root=self.objective_stage)
            for request in sent:
                request.wait()
        return loss + self._decay_once(params, weights, grads) if decay_once else loss

    def _exchange_params(self, comm, rank, params):
        """Params read on other stages go there from the stage that owns (and updates) them."""
        params, sent = dict(params), []
        for t, u, src, dst, when in self.transfers:
            if when == "param":
                name, tag = self.param_names[u], self.route[t][2]
                if src == rank:
                    sent += send(comm, self.memory.outgoing(params[name]), dst, tag)
                elif dst == rank:
                    params[name] = receive(comm, self.memory, src, tag)
        return params, sent

    def _decay_once(self, params, weights, grads):
        """Every microbatch's objective held the weight decay term: leave it counted once."""
        extra = 1.0 - sum(weights)
        if not (self.weight_decay and extra):
            return 0.0
        comm = self.comm
        mine = [n for n in self.decayed if comm is None or self.grad_stages.get(n, 0) == comm.Get_rank()]
        squares = 0.0
        for name in mine:
            a, b = self.grad_slices[name]
            self.memory.add(grads, a, b, extra * self.weight_decay, params[name])
            squares += self.memory.squares(params[name])
        return extra * 0.5 * self.weight_decay * self.allreduce(squares)

    def _run(self, order, params, micro, weights, grads, comm, on_ready=None):
        """Run `order`'s (stage, op, microbatch) and return this process's share of the loss."""
        values, loss, sent = {}, 0.0, []
        last_backward = {k: i for i, (k, kind, _) in enumerate(order) if kind == "B"}
        for i, (k, kind, m) in enumerate(order):
            fn, fname, spec, roots = self.functions[(k, kind)]
            args = []
            for what, key in spec:
                if what == "v" and (key, m) not in values:   # only under MPI: a transfer from another rank
                    src, _, tag = self.route[key]
                    values[(key, m)] = receive(comm, self.memory, src, tag)
                args.append(self.memory.local(params[key], k) if what == "p" else
                            self.memory.local(micro[m][key], k) if what == "a" else
                            values[(key, m)] if what == "v" else self.memory.data(key, k))
            results = self.memory.call(fn, fname, args, micro[m], k)
            for node, value in zip(roots, results):
                if node == self.objective:
                    loss += weights[m] * self.memory.number(value, k)
                elif node in self.grad_nodes:
                    a, b = self.grad_slices[self.grad_nodes[node]]
                    self.memory.add(grads, a, b, weights[m], value, k)
                values[(node, m)] = value
            for u, t in self.sources.get((k, kind), ()):
                if (u, m) not in values:
                    continue   # (transfers that only hvp or input_grads read are not made here)
                if comm is None:   # a copy to the GPU of its stage, or (virtual devices) the array itself
                    values[(t, m)] = self.memory.transfer(values[(u, m)], k, self.route[t][1])
                else:
                    _, dst, tag = self.route[t]
                    sent += send(comm, self.memory.outgoing(values[(u, m)]), dst, tag)
            for node in roots:
                if node not in self.read:
                    values.pop((node, m), None)
            for node in self.drop_after.get((k, kind), ()):
                values.pop((node, m), None)
            if on_ready is not None and last_backward.get(k) == i:
                on_ready(k)
        for request in sent:
            request.wait()
        return loss
