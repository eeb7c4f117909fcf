"""The Trainer every generated module subclasses: optimizer state, steps, atomic checkpoints."""
import functools
import json
import math
import numbers
import os
import stat
import threading
from collections.abc import Mapping

import numpy as np

from ..files import read_npz, write_replacing
from .optim import CHECK, CHECKED_WRITE, WRITE, adam_update, clip_scale, sgd_update, sum_squares
from .parallel import agreed_on_every_rank, gather_stages, refused_on_every_rank, write_on_rank_0
from .signature import number_as_array

OPTIMIZERS = ("sgd", "adam")

DECAY_IS_THE_MODELS = ("weight decay is part of the model's objective: m.minimize(loss, weight_decay=...) (and "
                       "decay=False on a param), so every entry point and optimizer sees the same gradient")


def one_at_a_time(method):
    """A Trainer's steps and saves run one after another when threads share it: they read and write its
    params, state and gradient buffers (two steps at once lost updates)."""
    @functools.wraps(method)
    def serial(self, /, *args, **kwargs):
        with self._serial:
            return method(self, *args, **kwargs)
    return serial


SETTINGS = ("optimizer", "lr", "momentum", "betas", "eps", "clip_norm")   # what a checkpoint records and restores


# each optimizer's hyperparameters, and the others' values it runs with (what it ignores may only hold those)
OWN = {"sgd": ("lr", "momentum"), "adam": ("lr", "betas", "eps")}
IGNORED = {"sgd": {"betas": (0.9, 0.999), "eps": 1e-8}, "adam": {"momentum": 0.0}}


class Hyperparameter:
    """A Trainer attribute whose every assignment is checked by `check(trainer, value)`, and refused where the
    trainer's optimizer would ignore it."""

    def __init__(self, check):
        self.check = check

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, tr, owner=None):
        return self if tr is None else tr.__dict__[self.name]

    def __set__(self, tr, value):
        checked = self.check(tr, value)
        optimizer = tr.__dict__.get("_optimizer")
        ignored = IGNORED.get(optimizer, {})
        if self.name in ignored and checked != ignored[self.name]:
            raise ValueError(f"{tr.model_name}.Trainer: {self.name}={checked!r} is not a hyperparameter of {optimizer!r} "
                             f"({optimizer}: {', '.join(OWN[optimizer])})")
        tr.__dict__[self.name] = checked


class OptimizerState(Mapping):
    """tr.state: the optimizer's own buffers by slot, read-only as a mapping. The update loops run over the
    params' length with no bounds check, so a buffer of another size must never take a slot's place; its
    values may be written in place (tr.state["m"][...] = 0)."""

    def __init__(self, model_name, buffers):
        self._model_name, self._buffers = model_name, buffers

    def __getitem__(self, slot):
        return self._buffers[slot]

    def __iter__(self):
        return iter(self._buffers)

    def __len__(self):
        return len(self._buffers)

    def __setitem__(self, slot, value):
        raise TypeError(f"{self._model_name}.Trainer: tr.state[{slot!r}] is the optimizer's own buffer: write its "
                        f"values in place (tr.state[{slot!r}][...] = ...), do not replace it")

    def __delitem__(self, slot):
        raise TypeError(f"{self._model_name}.Trainer: tr.state[{slot!r}] cannot be deleted")

    def __repr__(self):
        return f"OptimizerState({self._buffers!r})"


class TrainerBase:
    """Trains a copy of the parameters in place; `tr.params` is the live dict.

    Trainer(params, /, optimizer="sgd", lr=0.01, momentum=0.0, betas=(0.9, 0.999), eps=1e-8, clip_norm=None)
    tr.step(**inputs) -> loss (float); tr.save(path); Trainer.load(path).
    SGD: v = momentum*v + g; p -= lr*v. Adam: PyTorch's, bias-corrected. clip_norm scales the
    gradients when their global norm exceeds it. A step whose loss or gradient is not finite, or
    whose update would make any param or optimizer value non-finite, raises FloatingPointError and
    leaves parameters and optimizer state as they were. Hyperparameters are checked whenever they
    are set, in the params' dtype.
    """
    # set by the generated subclass
    signature = fingerprint = model_name = None
    param_order = loss_inputs = ()
    grad_slices = {}
    pipeline = None        # the pipeline executor of a --devices / --microbatches build
    rows = None            # the batch dim, the loss's reduction over it, the weight decay (parallel=...)
    _device = False        # params live on a GPU (CudaTrainerBase)
    _parallel = None       # DataParallel or ParameterServer (gradc/runtime/parallel.py)
    _adopted = ()          # the params the last _adopt took from tr.params (Pipeline.agree)
    _frozen_ids = None     # id() of each untrained param in tr.params at the last call (_replaced)

    # checked whenever they are set (tr.lr = ... between steps too), in the params' dtype
    lr = Hyperparameter(lambda tr, v: tr._positive("lr", v, zero=True))   # 0: a warmup's first steps, a frozen model
    eps = Hyperparameter(lambda tr, v: tr._positive("eps", v))
    clip_norm = Hyperparameter(lambda tr, v: None if v is None else tr._positive("clip_norm", v))
    momentum = Hyperparameter(lambda tr, v: tr._fraction("momentum", v))
    betas = Hyperparameter(lambda tr, v: tr._betas(v))
    # the steps taken: Adam's bias correction reads it, so setting it (a resume by hand) is checked too
    steps = Hyperparameter(lambda tr, v: tr._count("steps", v))

    def __init__(self, params, /, optimizer="sgd", lr=0.01, momentum=0.0, betas=(0.9, 0.999), eps=1e-8,
                 clip_norm=None, parallel=None, **parallel_options):
        with refused_on_every_rank(self, parallel, parallel_options):   # (the other ranks would wait for this one)
            if "weight_decay" in parallel_options:   # (PyTorch's optimizers take it: trial Y)
                raise ValueError(f"{self.model_name}.Trainer: {DECAY_IS_THE_MODELS}")
            if optimizer not in OPTIMIZERS:
                raise ValueError(f"{self.model_name}.Trainer: unknown optimizer {optimizer!r} (use 'sgd' or 'adam')")
            self._optimizer = optimizer   # first: the hyperparameters it ignores are refused (Hyperparameter)
            self._serial = threading.RLock()
            self.lr, self.momentum, self.betas, self.eps, self.clip_norm = lr, momentum, betas, eps, clip_norm
            checked = self.signature.params(params)
            self.steps = 0
            size = max((end for _, end in self.grad_slices.values()), default=0)
            slots = ("momentum",) if optimizer == "sgd" else ("m", "v")
            self._store(checked, size, slots)
            executor = self._parallel_executor(parallel, parallel_options) if parallel is not None or parallel_options \
                else None
        if executor is not None:
            self._parallel = executor(self, **parallel_options)
        self._made = True

    def __setattr__(self, name, value):
        # a setting the trainer does not have would be ignored without a word (tr.sigma = ..., a misspelt tr.l_r)
        if self.__dict__.get("_made") and name == "params":
            raise AttributeError(f"{self.model_name}.Trainer: assign into tr.params[name] (adopted at the next step or "
                                 f"save), not tr.params itself")
        if self.__dict__.get("_made") and name == "state":
            raise AttributeError(f"{self.model_name}.Trainer: tr.state holds the optimizer's own buffers: write their "
                                 f"values in place (tr.state['m'][...] = ...), not tr.state itself")
        if self.__dict__.get("_made") and name == "weight_decay":
            raise AttributeError(f"{self.model_name}.Trainer: {DECAY_IS_THE_MODELS}")
        if self.__dict__.get("_made") and not name.startswith("_") and name not in self.__dict__ \
                and not hasattr(type(self), name):
            settable = (*OWN[self._optimizer], "clip_norm")
            raise AttributeError(f"{self.model_name}.Trainer has no setting {name!r}: {self._optimizer} sets "
                                 f"{', '.join(settable[:-1])} or {settable[-1]}; the others (the samples, sigma, ... of "
                                 f"gradient='lr') are chosen when it is made")
        super().__setattr__(name, value)

    def __delattr__(self, name):
        # tr.params, tr.steps, tr.state ... are the training state: deleting one loses it
        if not name.startswith("_"):
            raise AttributeError(f"{self.model_name}.Trainer: {name} cannot be deleted")
        super().__delattr__(name)

    @property
    def optimizer(self):
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value):   # its state (momentum, or Adam's moments) is made for it
        raise AttributeError(f"{self.model_name}.Trainer: the optimizer is chosen when the Trainer is made "
                             f"(Trainer(params, optimizer={value!r}, ...)), not set after")

    def _parallel_executor(self, parallel, options):
        from . import parallel as par
        known = {"data": ("comm", "overlap", "bucket_bytes", "stage_ranks"),
                 "ps": ("comm", "servers", "staleness", "timeout")}
        if parallel is None:   # (the options of no parallel mode: most likely a misspelt keyword)
            raise TypeError(f"{self.model_name}.Trainer: unknown keyword argument(s) {', '.join(options)} (it takes "
                            f"optimizer, lr, momentum, betas, eps, clip_norm, gradient, samples, sigma, seed, "
                            f"antithetic, layerwise, baseline, parallel; parallel='data' also "
                            f"{', '.join(known['data'])}; parallel='ps' also {', '.join(known['ps'])})")
        if parallel not in known:
            raise ValueError(f"{self.model_name}.Trainer: parallel={parallel!r}: use None, 'data' (data parallel over "
                             f"MPI ranks) or 'ps' (a parameter server)")
        unknown = [k for k in options if k not in known[parallel]]
        if unknown:
            raise ValueError(f"{self.model_name}.Trainer(parallel={parallel!r}): unknown option(s) "
                             f"{', '.join(unknown)} (it takes {', '.join(known[parallel])})")
        return par.DataParallel if parallel == "data" else par.ParameterServer

    # parallel="ps": which rank does what, and how training ends (ParameterServer's doc)
    @property
    def is_worker(self):
        return self._parallel is None or getattr(self._parallel, "is_worker", True)

    @property
    def worker(self):
        """This rank's index among the ranks that step: 0..workers-1 (parallel="data": its replica)."""
        if self._parallel is None:
            return 0
        return getattr(self._parallel, "worker", getattr(self._parallel, "replica", 0))

    @property
    def workers(self):
        return getattr(self._parallel, "workers", None) or getattr(self._parallel, "replicas", 1) \
            if self._parallel is not None else 1

    @property
    def comm_seconds(self):
        """Seconds this rank spent in the MPI calls of its gradient reduction or pushes (parallel=...)."""
        return self._parallel.comm_seconds if self._parallel is not None else 0.0

    def finish(self):
        """parallel="ps": this rank is done (a server serves until every worker is); then every rank holds
        the final params. Anything else: nothing to do."""
        if hasattr(self._parallel, "finish"):
            self._parallel.finish()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if hasattr(self._parallel, "finish"):
            self._parallel.finish(failed=kind is not None)
        return False

    def _store(self, checked, size, slots):
        """The trained params live in one flat buffer (laid out as GRAD_SLICES), so that one loop
        updates them all; tr.params holds views of it, and copies of the other params."""
        self._flat = np.empty(size, dtype=self.signature.float)
        self._views = {}
        self.params = {}
        for k, shape in self.signature.param_shapes.items():
            if k in self.grad_slices:
                start, end = self.grad_slices[k]
                view = self._flat[start:end].reshape(shape)
                view[...] = checked[k].reshape(shape)
                self._views[k] = self.params[k] = view
            else:
                self.params[k] = np.array(checked[k], copy=True).reshape(shape)
        self._own_call_form = {k: v.reshape(1) if v.ndim == 0 else v for k, v in self._views.items()}
        self._replaced()   # (what later calls compare with)
        self._grads = np.empty(size, dtype=self.signature.float)   # reused by every step
        self.state = OptimizerState(self.model_name, {slot: np.zeros(size, dtype=self.signature.float)
                                                      for slot in slots})   # flat, like _flat

    def _host(self, array):
        """A numpy array of a param or state buffer (for checkpoints)."""
        return array

    def _restore(self, slot, saved):
        self.state[slot][...] = saved

    @property
    def clip(self):
        return math.inf if self.clip_norm is None else self.clip_norm

    def _checked_params(self):
        """_adopt, then the params in call form. When every param is trained, they are the trainer's own
        views, known good, and are not checked again (4 us of a small model's step)."""
        self._adopt()
        if self.params.keys() == self._own_call_form.keys():
            return self._own_call_form
        return self.signature.params(self.params, exact=True)

    def _adopt(self):
        """An array assigned into tr.params replaces the values, not the trainer's buffer (a () param's may be a
        number of its dtype). A wrong one (or a deleted name) is refused before any is adopted, and tr.params[k]
        is the trainer's own array again, its values unchanged: the next step or save works without the user
        having to undo it."""
        self._put_back()
        adopted = {}
        self._adopted = ()   # the names adopted by this call (Pipeline.agree)
        for k, view in self._views.items():
            given = self.params[k]
            if given is view:
                continue
            new = number_as_array(given) if view.ndim == 0 else given
            if not isinstance(new, np.ndarray) or new.shape != view.shape or new.dtype != view.dtype:
                what = (f"a {new.dtype} array of shape {new.shape}" if isinstance(new, np.ndarray)
                        else f"a {type(new).__name__}")
                self.params[k] = view
                raise ValueError(f"{self.model_name}.Trainer: params[{k!r}] must stay a {view.dtype} array of "
                                 f"shape {view.shape}, got {what}; it holds the trainer's own values again")
            adopted[k] = new
        for k, new in adopted.items():
            self._views[k][...] = new
            self.params[k] = self._views[k]
        self._adopted = tuple(adopted)

    def _put_back(self):
        """Trained params deleted from tr.params come back (the trainer's own arrays), names it does not have are
        removed; ValueError naming them, so that the next call works."""
        if self.params.keys() == self.signature.param_shapes.keys():   # (every step: the usual case, at C speed)
            return
        missing = [k for k in self._views if k not in self.params]
        unknown = [k for k in self.params if k not in self.signature.param_shapes]
        for k in missing:
            self.params[k] = self._views[k]
        for k in unknown:
            del self.params[k]
        if missing or unknown:
            raise ValueError(f"{self.model_name}.Trainer: " + "; ".join(
                ([f"params {missing} were missing (they hold the trainer's own values again)"] if missing else [])
                + ([f"params {unknown} are not the model's (removed; its params are {list(self.signature.param_shapes)})"]
                   if unknown else [])))

    @one_at_a_time
    def step(self, /, **inputs):
        if self._parallel is not None:
            return self._parallel.step(inputs)
        a, p = self._agreed(f"Trainer.step {self.steps + 1}", lambda: (
            self.signature.inputs(inputs, self.loss_inputs, "Trainer.step"), self._checked_params()))
        loss = self._gradients(p, a, self._grads)
        # under MPI each rank holds its own params' gradients: the norm and the overflow check are global
        sq = self._allreduce(sum_squares(self._grads))
        bad = 0
        if math.isfinite(loss) and math.isfinite(sq):
            scale = self.signature.float.type(clip_scale(sq, self.clip))
            if self.pipeline is None:   # a step that overflows changes nothing
                bad = self._update(scale, CHECKED_WRITE)
            else:   # under MPI every rank's count decides
                bad = self._allreduce(self._update(scale, CHECK))
                if not bad:
                    self._update(scale, WRITE)
        self._count_step(loss, sq, bad, a)
        return float(loss)

    # ---- what parallel="data" runs (gradc/runtime/parallel.py); CudaTrainerBase copies through the host
    def _dp_buffer(self):
        return self._grads

    def _dp_params(self):
        return self._flat

    def _dp_gradients(self, a, grads, final, streamed=True):
        """This rank's objective and gradients into `grads`, and how many times its objective holds the weight
        decay term; final(names) as soon as those params' gradients are final (with `streamed`, while the
        backward still runs: the module's _loss_and_grad_streamed, or the pipeline's stages)."""
        p = self.signature.params(self.params, exact=True)
        # the estimate runs whole, not in the pipeline's stages (codegen/lr_api.py)
        if self.pipeline is None or getattr(self, "gradient", "backprop") == "lr":
            if streamed and hasattr(self, "_gradients_streamed"):
                return self._gradients_streamed(p, a, grads, final), 1.0
            return self._gradients(p, a, grads), 1.0
        stage_of = self.pipeline.grad_stages
        loss = self.pipeline.loss_and_grad(p, a, grads, decay_once=False, on_ready=lambda k: final(
            [name for name in self.grad_slices if stage_of.get(name, 0) == k]))
        return loss, self.pipeline.weight_sum

    def _dp_update(self, loss, grads, dp, inputs=None):
        """The update with the reduced gradients; refused on every rank if on any."""
        sq = dp.pipe_sum(sum_squares(self._grads))
        ok = math.isfinite(loss) and math.isfinite(sq)
        bad = 0
        if ok:
            scale = self.signature.float.type(clip_scale(sq, self.clip))
            bad = dp.pipe_sum(self._update(scale, CHECK))
        refused, bad = dp.agree([not ok, bad])
        if refused and ok:
            sq = math.nan
        if not refused and not bad:
            self._update(scale, WRITE)
        self._count_step(loss, sq, bad, inputs)
        return float(loss)

    def _allreduce(self, x):
        return x if self.pipeline is None else self.pipeline.allreduce(x)

    def _agreed(self, what, check):
        """check() (the call's checks, with the params assigned into tr.params adopted); with a pipeline's
        stages on MPI ranks, raised on every rank when it fails on any, when the ranks' trainers are set
        apart or make different calls, or when a param was assigned only off the rank that holds it
        (Pipeline.agree)."""
        if self.pipeline is None:
            return check()
        return self.pipeline.agree(what, check, self._settings(), lambda: self._adopted + self._replaced())

    def _replaced(self):
        """The params not trained (copies in tr.params, not views) that were replaced since the last call
        (`tr.params["E"] = ...`): a pipeline's rank that does not hold one would use its value alone."""
        seen, self._frozen_ids = self._frozen_ids, {k: id(v) for k, v in self.params.items() if k not in self._views}
        return tuple(k for k, i in self._frozen_ids.items() if seen is not None and seen.get(k) != i)

    def _update(self, scale, mode):
        """The optimizer's update of every trained value with gradients times `scale`, as `mode` says
        (optim.py: CHECK, WRITE or CHECKED_WRITE); the count of values it would make non-finite."""
        f = self.signature.float.type   # hyperparameters in the params' dtype
        if self.optimizer == "sgd":
            return sgd_update(self._flat, self.state["momentum"], self._grads, f(self.lr), f(self.momentum), scale,
                              mode)
        t = self.steps + 1
        return adam_update(self._flat, self.state["m"], self.state["v"], self._grads, f(self.lr), f(self.betas[0]),
                           f(self.betas[1]), f(self.eps), f(1.0 - self.betas[0] ** t), f(1.0 - self.betas[1] ** t),
                           scale, mode)

    def _count_step(self, loss, sq, bad, inputs=None):
        """Count a finished step, or refuse one whose loss or |g|^2 is not finite, or whose update would
        make `bad` params or optimizer state values non-finite (such a step updated nothing); naming the
        params, and the float `inputs` of the step, that hold non-finite values."""
        if not (math.isfinite(loss) and math.isfinite(sq)) or bad:
            what = (f"the loss is {loss}" if not math.isfinite(loss) else "the gradient is not finite"
                    if not math.isfinite(sq) else f"the update overflows {np.dtype(self.signature.float).name} in "
                    f"{int(bad)} value(s) (lr {self.lr:g} too large?)")
            held = [k for k, v in self.params.items() if not np.isfinite(self._host(v)).all()]
            if held:   # no step can mend them: say so, rather than only that they were left as they were
                what += (f" (params {', '.join(map(repr, held))} hold non-finite values already: assign finite "
                         f"ones into tr.params, or load a checkpoint)")
            what += self._non_finite_inputs(inputs)
            raise FloatingPointError(f"{self.model_name}.Trainer.step {self.steps + 1}: {what}; parameters and "
                                     f"optimizer state are left as they were before this step")
        self.steps += 1

    def _non_finite_inputs(self, inputs):
        """' (input 'x' holds nan at [0, 2], ...)' for each float input of a refused step that holds a non-finite
        value, else '' (a trial's NaN in a batch was named nowhere)."""
        said = ""
        for name, value in (inputs or {}).items():
            value = self._host(value) if name in self.loss_inputs else None
            if value is not None and value.dtype.kind == "f" and not np.isfinite(value).all():
                where = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
                said += (f" (input {name!r} holds {value[where]} at {list(where)}, "
                         f"{int(np.count_nonzero(~np.isfinite(value)))} non-finite value(s) in all)")
        return said

    # ---- checkpoints ---------------------------------------------------------------------
    def _settings(self):
        """The training state besides the arrays: the hyperparameters, how gradients are made, the steps
        taken (what a checkpoint records, and what every data-parallel rank must hold alike)."""
        return {**{k: getattr(self, k) for k in SETTINGS}, "betas": list(self.betas), "steps": self.steps,
                **self._gradient_meta()}

    def _write(self, path):
        meta = {"model": self.model_name, "fingerprint": self.fingerprint, **self._settings()}
        arrays = {"meta": np.array(json.dumps(meta))}
        arrays |= {f"param/{k}": self._host(v) for k, v in self.params.items()}
        arrays |= {f"state/{slot}": self._host(v) for slot, v in self.state.items()}
        target = os.path.realpath(os.fspath(path))
        if not os.path.isdir(os.path.dirname(target)):
            raise FileNotFoundError(f"{os.fspath(path)}: the folder {os.path.dirname(target)} does not exist")
        if os.path.isdir(target):
            raise IsADirectoryError(f"{os.fspath(path)}: is a folder; save takes a file's path (e.g. "
                                    f"{os.path.join(os.fspath(path), 'ckpt.npz')})")
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = None
        try:
            write_replacing(target, lambda f: np.savez(f, **arrays), prefix=".ckpt-", suffix=".npz", mode=mode,
                            sync=True)
        except OSError as e:   # it named the temp file, which the user never sees
            why = f"{os.fspath(path)}: cannot write the checkpoint: {e.strerror or e}"
            raise (type(e)(e.errno, why) if e.errno is not None else type(e)(why)) from e

    @one_at_a_time
    def save(self, path):
        """Write params and optimizer state to `path` (.npz) atomically: a crash leaves the old file, and
        the next save into that folder removes the temp file of a killed one (gradc/files.py: one from
        another host or container sharing the folder, when a day old). The file keeps its
        permissions; a symlink stays one, and its target gets the new contents. With parallel=..., or
        with a pipeline's stages on MPI ranks (each rank updates its own stage's params), every rank
        calls it: the stages' params and state are gathered onto every rank, rank 0 writes the file,
        once, and every rank returns when it is written. Params assigned into tr.params are adopted
        first and their names, shapes and dtypes checked: a wrong one raises ValueError and the file is
        left as it was (with parallel=..., on the rank that holds it; with a pipeline's stages, on every
        rank, as are trainers the ranks set apart)."""
        def check():   # (on every rank, before a pipeline's stages send rank 0 their params)
            checked = self._checkpoint_path(path, "save")
            self._adopt()
            self.signature.params(self.params)
            return checked

        if self._parallel is not None:
            return self._parallel.save(check, self._write)
        path = self._agreed("Trainer.save", check)
        comm = self.pipeline.comm if self.pipeline is not None else None
        if comm is None:
            return self._write(path)
        rank = comm.Get_rank()
        gather_stages(self, comm, [name for name, stage in self.pipeline.grad_stages.items() if stage == rank])
        return write_on_rank_0(comm, path, self._write, self.model_name)

    @classmethod
    def _checkpoint_path(cls, path, what):
        """A checkpoint's path as a str (a str, bytes or os.PathLike; not a file object: the write is atomic
        by renaming a file beside it)."""
        try:
            path = os.fsdecode(path)
        except TypeError:
            raise TypeError(f"{cls.model_name}.Trainer.{what}: a checkpoint's path is a str or os.PathLike (e.g. "
                            f"ckpt.npz), got {type(path).__name__}") from None
        if not path:
            raise ValueError(f"{cls.model_name}.Trainer.{what}: the path is empty: give a file's path (e.g. ckpt.npz)")
        return path

    @classmethod
    def load(cls, path, /, **parallel_options):
        """A Trainer restored from `save`. Refuses a checkpoint of another model or gradc build, and raises
        ValueError naming the file for one that is damaged, incomplete or not a checkpoint. Every rank of
        a parallel run loads the same file: `Trainer.load(path, parallel="data")`."""
        path = cls._checkpoint_path(path, "load")
        settings = [k for k in parallel_options if k in SETTINGS or k in cls._gradient_option_names]
        if settings:
            verb = "comes" if len(settings) == 1 else "come"
            gradient = [k for k in settings if k in cls._gradient_option_names]
            others = [k for k in settings if k not in gradient]
            hints = [f"set {'them' if len(others) > 1 else 'it'} on the trainer it returns, e.g. tr.lr = ..."] \
                if others else []
            if gradient:   # (trial U: the hint said to set gradient= on the trainer, which has no setter for it)
                hints.append(f"for other gradient options a new Trainer starts from the loaded params: "
                             f"{cls.model_name}.Trainer(tr.params, {gradient[0]}=...)")
            how = "; ".join(hints)
            raise TypeError(f"{cls.model_name}.Trainer.load: {', '.join(settings)} {verb} from the checkpoint (load "
                            f"takes parallel= and its options); {how}")
        read = lambda: cls._read_checkpoint(path)
        # (parallel: a rank that cannot read its file would leave the others waiting in the constructor's collectives)
        arrays, meta = agreed_on_every_rank(cls, parallel_options, "Trainer.load", read) \
            if parallel_options.get("parallel") is not None else read()
        steps, betas = meta["steps"], meta["betas"]
        try:   # the constructor checks the hyperparameters and the params' shapes and dtypes
            own = (dict(momentum=meta["momentum"]) if meta["optimizer"] == "sgd"   # (the other's may be set, unused)
                   else dict(betas=tuple(betas), eps=meta["eps"]))
            tr = cls({k: arrays[f"param/{k}"] for k in cls.param_order}, optimizer=meta["optimizer"], lr=meta["lr"],
                     clip_norm=meta["clip_norm"], **own, **cls._gradient_options(meta), **parallel_options)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        saved_state = lambda: tr._saved_state(path, arrays)
        state = agreed_on_every_rank(cls, parallel_options, "Trainer.load", saved_state) if tr._parallel is not None \
            else saved_state()
        for slot, saved in state.items():
            tr._restore(slot, saved)
        tr.steps = steps
        return tr

    def _saved_state(self, path, arrays):
        """The optimizer's state in a checkpoint's arrays, each slot checked against this trainer's."""
        state = {}
        for slot, v in self.state.items():
            saved = arrays.get(f"state/{slot}")
            if saved is None:
                raise ValueError(f"{path}: the checkpoint lacks state/{slot} (optimizer {self.optimizer})")
            if saved.shape != v.shape or saved.dtype != self.signature.float:
                raise ValueError(f"{path}: optimizer state {slot!r} is {saved.dtype} of shape {saved.shape}, expected "
                                 f"{self.signature.float} of shape {v.shape}")
            state[slot] = saved
        return state

    @classmethod
    def _read_checkpoint(cls, path):
        """(arrays, meta) of the checkpoint at `path`, checked against this model: ValueError naming the file
        for another model's, or one damaged, incomplete or not a checkpoint."""
        arrays = read_npz(path)
        meta = arrays.get("meta")
        if meta is None:
            raise ValueError(f"{path}: not a gradc checkpoint (no meta record)")
        if meta.shape != () or meta.dtype.kind != "U":
            raise ValueError(f"{path}: the meta record is not a JSON string")
        try:
            meta = json.loads(str(meta))
        except ValueError as e:
            raise ValueError(f"{path}: the meta record is not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: the meta record is not a JSON object")
        saved_dtypes = {a.dtype.name for k, a in arrays.items() if k.startswith("param/")}
        ours = np.dtype(cls.signature.float).name
        if meta.get("fingerprint") != cls.fingerprint and meta.get("model") == cls.model_name and saved_dtypes \
                and ours not in saved_dtypes:
            raise ValueError(f"{path}: checkpoint of a {'/'.join(sorted(saved_dtypes))} build of model "
                             f"{cls.model_name!r}, and this build is {ours}: load it into a build compiled with "
                             f"--dtype {sorted(saved_dtypes)[0]} (of the same model, if it has not changed)")
        if meta.get("fingerprint") != cls.fingerprint:
            raise ValueError(f"{path}: checkpoint of model {meta.get('model')!r} (fingerprint "
                             f"{str(meta.get('fingerprint'))[:12]}) does not match model {cls.model_name!r} "
                             f"(fingerprint {cls.fingerprint[:12]}): it was written by another model or gradc version"
                             f"; {cls._params_compared(arrays)}")
        missing = [k for k in SETTINGS + ("steps",) if k not in meta]
        missing += [f"param/{k}" for k in cls.param_order if f"param/{k}" not in arrays]
        if missing:
            raise ValueError(f"{path}: the checkpoint lacks {', '.join(missing)}")
        steps, betas = meta["steps"], meta["betas"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{path}: meta 'steps' must be an int >= 0, got {steps!r}")
        if not (isinstance(betas, list) and len(betas) == 2):
            raise ValueError(f"{path}: meta 'betas' must be a pair, got {betas!r}")
        return arrays, meta

    _gradient_option_names = ()   # a subclass's gradient options (load takes them from the checkpoint)

    def _gradient_meta(self):
        """What the checkpoint records of how gradients are made (a subclass's gradient modes)."""
        return {}

    @classmethod
    def _gradient_options(cls, meta):
        """The constructor options that restore the recorded gradient mode (ValueError if it is not one)."""
        return {}

    # ---- hyperparameter checks -------------------------------------------------------------
    def _positive(self, name, value, zero=False):
        """A finite number > 0 (>= 0 with zero=True) that stays so in the params' dtype (1e39 overflows float32,
        1e-50 is 0 there). A numpy scalar is a number too (tr.lr = np.float32(0.1))."""
        held = self._in_dtype(value) if _is_number(value) and math.isfinite(value) else math.nan
        if not (math.isfinite(held) and (held > 0 or zero and value == 0)):
            dtype = np.dtype(self.signature.float).name
            held_as = f", which {dtype} rounds to {'0' if held == 0 else held}" if _is_number(value) and value > 0 \
                and math.isfinite(value) else ""
            raise ValueError(f"{self.model_name}.Trainer: {name} must be a finite number {'>=' if zero else '>'} 0 in "
                             f"{dtype}, got {value!r}{held_as}")
        return float(value)

    def _fraction(self, name, value):
        """A number in [0, 1) that stays below 1 in the params' dtype (float32 rounds 0.99999999 to 1)."""
        if not (_is_number(value) and 0 <= value < 1 and self._in_dtype(value) < 1):
            dtype = np.dtype(self.signature.float).name
            held_as = f", which {dtype} rounds to 1" if _is_number(value) and 0 <= value < 1 else ""
            raise ValueError(f"{self.model_name}.Trainer: {name} must be a number in [0, 1) in {dtype}, "
                             f"got {value!r}{held_as}")
        return float(value)

    @classmethod
    def _params_compared(cls, arrays):
        """What a checkpoint's params are to this model's: the same names, shapes and dtype (then a new
        Trainer may start from them), or which differ."""
        saved = {k[len("param/"):]: a for k, a in arrays.items() if k.startswith("param/")}
        ours = cls.signature.param_shapes
        differ = [f"{k} {tuple(saved[k].shape)} there, {tuple(ours[k])} here" for k in ours
                  if k in saved and tuple(saved[k].shape) != tuple(ours[k])]
        differ += [f"{k} only here" for k in ours if k not in saved] + [f"{k} only there" for k in saved if k not in ours]
        if not differ and all(a.dtype == cls.signature.float for a in saved.values()):
            return ("its params have this model's names, shapes and dtype: to start a new Trainer from them (without "
                    "the optimizer's state), read them with np.load, the arrays 'param/NAME'")
        return "its params differ: " + "; ".join(differ[:6] + (["..."] if len(differ) > 6 else [])) if differ else \
            "its params are of another dtype"

    def _count(self, name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{self.model_name}.Trainer: {name} must be an int >= 0, got {value!r}")
        return int(value)

    def _in_dtype(self, value):
        with np.errstate(over="ignore", under="ignore"):   # what overflows is refused by name, not warned about
            return self.signature.float.type(value)

    def _betas(self, value):
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise ValueError(f"{self.model_name}.Trainer: betas must be a pair, got {value!r}")
        return self._fraction("betas[0]", value[0]), self._fraction("betas[1]", value[1])


def _is_number(value):
    """A real number, Python's or numpy's, but not a bool (lr=True is a mistake, not 1.0)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
