"""The Trainer every generated module subclasses: optimizer state, steps, atomic checkpoints."""
import json
import math
import os
import tempfile

import numpy as np

from .optim import adam_step, clip_scale, sgd_step, sum_squares

OPTIMIZERS = ("sgd", "adam")


class TrainerBase:
    """Trains a copy of the parameters in place; `tr.params` is the live dict.

    Trainer(params, /, optimizer="sgd", lr=0.01, momentum=0.0, betas=(0.9, 0.999), eps=1e-8, clip_norm=None)
    tr.step(**inputs) -> loss (float); tr.save(path); Trainer.load(path).
    SGD: v = momentum*v + g; p -= lr*v. Adam: PyTorch's, bias-corrected. clip_norm scales the
    gradients when their global norm exceeds it. A step whose loss or gradient is not finite
    raises FloatingPointError and leaves parameters and optimizer state as they were.
    """
    # set by the generated subclass
    signature = fingerprint = model_name = None
    param_order = loss_inputs = ()
    grad_slices = {}
    pipeline = None        # the pipeline executor of a --devices / --microbatches build

    def __init__(self, params, /, optimizer="sgd", lr=0.01, momentum=0.0, betas=(0.9, 0.999), eps=1e-8,
                 clip_norm=None):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{self.model_name}.Trainer: unknown optimizer {optimizer!r} (use 'sgd' or 'adam')")
        checked = self.signature.params(params)
        self.optimizer = optimizer
        self.lr = _positive("lr", lr, self.model_name)
        self.momentum = _fraction("momentum", momentum, self.model_name)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{self.model_name}.Trainer: betas must be a pair, got {betas!r}")
        self.betas = (_fraction("betas[0]", betas[0], self.model_name), _fraction("betas[1]", betas[1], self.model_name))
        self.eps = _positive("eps", eps, self.model_name)
        self.clip_norm = None if clip_norm is None else _positive("clip_norm", clip_norm, self.model_name)
        self.steps = 0
        size = max((end for _, end in self.grad_slices.values()), default=0)
        slots = ("momentum",) if optimizer == "sgd" else ("m", "v")
        self._store(checked, size, slots)

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
        self._grads = np.empty(size, dtype=self.signature.float)   # reused by every step
        self.state = {slot: np.zeros(size, dtype=self.signature.float) for slot in slots}   # flat, like _flat

    def _host(self, array):
        """A numpy array of a param or state buffer (for checkpoints)."""
        return array

    def _restore(self, slot, saved):
        self.state[slot][...] = saved

    @property
    def clip(self):
        return math.inf if self.clip_norm is None else self.clip_norm

    def _adopt(self):
        """An array assigned into tr.params replaces the values, not the trainer's buffer."""
        for k, view in self._views.items():
            new = self.params.get(k)
            if new is not view:
                if not isinstance(new, np.ndarray) or new.shape != view.shape or new.dtype != view.dtype:
                    raise ValueError(f"{self.model_name}.Trainer: params[{k!r}] must stay a {view.dtype} array of "
                                     f"shape {view.shape}")
                view[...] = new
                self.params[k] = view

    def step(self, **inputs):
        a = self.signature.inputs(inputs, self.loss_inputs, "Trainer.step")
        self._adopt()
        p = self.signature.params(self.params, exact=True)
        loss = self._gradients(p, a, self._grads)
        grads = self._grads
        clip = self.clip
        if self.pipeline is not None and self.pipeline.comm is not None:
            # each rank holds its own params' gradients: the norm (for clipping and the finite check) is global
            sq = self.pipeline.allreduce(sum_squares(grads))
            if not math.isfinite(sq):
                raise FloatingPointError(f"{self.model_name}.Trainer.step {self.steps + 1}: the gradient is not "
                                         f"finite; parameters and optimizer state are left as they were")
            grads *= grads.dtype.type(clip_scale(sq, clip))
            clip = math.inf
        f = self.signature.float.type   # hyperparameters in the params' dtype
        if self.optimizer == "sgd":
            sq = sgd_step(self._flat, self.state["momentum"], grads, loss, f(self.lr), f(self.momentum), clip)
        else:
            t = self.steps + 1
            sq = adam_step(self._flat, self.state["m"], self.state["v"], grads, loss, f(self.lr), f(self.betas[0]),
                           f(self.betas[1]), f(self.eps), f(1.0 - self.betas[0] ** t), f(1.0 - self.betas[1] ** t),
                           clip)
        self._count_step(loss, sq)
        return float(loss)

    def _count_step(self, loss, sq):
        """Count a finished step, or refuse one whose loss or |g|^2 is not finite (which updated nothing)."""
        if not (math.isfinite(loss) and math.isfinite(sq)):
            what = f"the loss is {loss}" if not math.isfinite(loss) else "the gradient is not finite"
            raise FloatingPointError(f"{self.model_name}.Trainer.step {self.steps + 1}: {what}; parameters and "
                                     f"optimizer state are left as they were before this step")
        self.steps += 1

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, path):
        """Write params and optimizer state to `path` (.npz) atomically: a crash leaves the old file."""
        meta = {"model": self.model_name, "fingerprint": self.fingerprint, "optimizer": self.optimizer,
                "lr": self.lr, "momentum": self.momentum, "betas": list(self.betas), "eps": self.eps,
                "clip_norm": self.clip_norm, "steps": self.steps}
        arrays = {"meta": np.array(json.dumps(meta))}
        arrays |= {f"param/{k}": self._host(v) for k, v in self.params.items()}
        arrays |= {f"state/{slot}": self._host(v) for slot, v in self.state.items()}
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ckpt-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path):
        """A Trainer restored from `save`; refuses a checkpoint of another model or gradc build."""
        with np.load(os.fspath(path), allow_pickle=False) as f:
            if "meta" not in f.files:
                raise ValueError(f"{path}: not a gradc checkpoint (no meta record)")
            meta = json.loads(str(f["meta"]))
            if meta.get("fingerprint") != cls.fingerprint:
                raise ValueError(f"{path}: checkpoint of model {meta.get('model')!r} (fingerprint "
                                 f"{str(meta.get('fingerprint'))[:12]}) does not match model {cls.model_name!r} "
                                 f"(fingerprint {cls.fingerprint[:12]}): it was written by another model or gradc version")
            params = {k: f[f"param/{k}"] for k in cls.param_order}
            tr = cls(params, optimizer=meta["optimizer"], lr=meta["lr"], momentum=meta["momentum"],
                     betas=tuple(meta["betas"]), eps=meta["eps"], clip_norm=meta["clip_norm"])
            for slot, v in tr.state.items():
                saved = f[f"state/{slot}"]
                if saved.shape != v.shape:
                    raise ValueError(f"{path}: optimizer state {slot!r} has {saved.size} values, expected {v.size}")
                tr._restore(slot, saved)
            tr.steps = meta["steps"]
        return tr


def _positive(name, value, model):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{model}.Trainer: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _fraction(name, value, model):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{model}.Trainer: {name} must be a number in [0, 1), got {value!r}")
    return float(value)
