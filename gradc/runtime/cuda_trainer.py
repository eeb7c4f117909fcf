"""The Trainer of a `--target cuda` module: params, gradients and optimizer state stay on the device.

One step is one launch sequence (captured once in a CUDA graph where graphs work): the entry's
kernels write the gradients into a flat device buffer, a one-block kernel sums their squares, and
the fused update kernel reads the loss and that sum from device memory, so clipping and the
"not finite: change nothing" rule need no host round trip mid-step. The host reads the loss and the
squared norm (two numbers) after the step, as the CPU Trainer does. Hyperparameters go to the
device in a small array before each step, so changing `tr.lr` between steps needs no recapture.
"""
import numpy as np

from .cuda import array_dtype, block, flat, is_device_array
from .signature import number_as_array
from .trainer import OptimizerState, TrainerBase, one_at_a_time


class CudaTrainerBase(TrainerBase):
    __doc__ = TrainerBase.__doc__.replace("`tr.params` is the live dict.",
                                          "`tr.params` is the live dict of device arrays.")
    _device = True
    runner = None            # the module's CudaRunner
    kernels = {}             # "sgd", "sgd_check", "adam", "adam_check", "sum_squares", "copy" -> the module's kernels
    entry = None             # the host function of loss_and_grad
    streamed_entry = None    # loss_and_grad's, calling ready(names) as it goes (parallel="data"; not in pipelines)
    lr_entry = None          # the host function of lr_grad (gradient="lr")

    def loss_args(self, p, a):
        """The entry's arguments before `grads` (set by the generated subclass)."""
        raise NotImplementedError

    def lr_args(self, p, a):
        """lr_grad's arguments before `grads`, `a` with its lr leaves (set by the generated subclass)."""
        raise NotImplementedError

    def _entry_args(self, p, a):
        """(the entry's arena name, its arguments before `grads`, the inputs the arena is laid out for):
        loss_and_grad's, or with gradient="lr" lr_grad's, step t's noise drawn from seed + t."""
        if getattr(self, "gradient", "backprop") != "lr":
            return "_loss_and_grad", self.loss_args(p, a), a
        a = self._lr.leaves(a, *self._step_options(), adopt=self.runner.adopt, host=self.runner.host)
        return "_lr_grad", self.lr_args(p, a), a

    def _store(self, checked, size, slots):
        run = self.runner
        self._flat = run.empty((max(size, 1),))
        self._views, self.params = {}, {}
        for k, shape in self.signature.param_shapes.items():
            if k in self.grad_slices:
                start, end = self.grad_slices[k]
                view = self._flat[start:end].reshape(shape if shape else (1,))
                view.copy_to_device(np.ascontiguousarray(checked[k]).reshape(view.shape), stream=run.stream)
                self._views[k] = self.params[k] = run.own(view)
            else:
                self.params[k] = run.adopt(checked[k])
        self._replaced()   # (what later calls compare with)
        self._grads = run.empty((max(size, 1),))
        zeros = np.zeros(max(size, 1), dtype=self.signature.float)
        self.state = OptimizerState(self.model_name, {slot: run.adopt(zeros) for slot in slots})
        self._hyper = run.empty((7,))
        self._status = run.empty((3,))            # the loss, |g|^2, values the update would make non-finite
        self._launch = self._launch_step          # one bound method: the captured graph's key
        if getattr(self, "gradient", "backprop") == "lr":
            self.entry = self.lr_entry            # the steps launch lr_grad's kernels instead
        run.sync()

    def _host(self, array):
        host = self.runner.host(array)
        for k, view in self.params.items():   # a scalar param's view is a one-element array
            if view is array:
                return host.reshape(self.signature.param_shapes[k])
        return host

    def _restore(self, slot, saved):
        self.state[slot].copy_to_device(np.ascontiguousarray(saved, dtype=self.signature.float),
                                        stream=self.runner.stream)
        self.runner.sync()

    def _adopt(self):
        """An array assigned into tr.params replaces the values, not the trainer's buffer (a () param's may be a
        number of its dtype); a wrong one (or a deleted name) is refused before any is adopted, and tr.params[k]
        is the trainer's own array again (as on the CPU)."""
        self._put_back()
        adopted = {}
        self._adopted = ()   # the names adopted by this call (Pipeline.agree)
        for k, view in self._views.items():
            given = self.params[k]   # (_put_back: every name is there)
            if given is view:
                continue
            shape = self.signature.param_shapes[k]
            new = number_as_array(given) if shape == () else given
            if not (isinstance(new, np.ndarray) or is_device_array(new)) or array_dtype(new) != self.signature.float \
                    or tuple(new.shape) not in (tuple(shape), (1,) if shape == () else tuple(shape)):
                what = (f"a {array_dtype(new)} array of shape {tuple(new.shape)}"
                        if isinstance(new, np.ndarray) or is_device_array(new) else f"a {type(new).__name__}")
                self.params[k] = view
                raise ValueError(f"{self.model_name}.Trainer: params[{k!r}] must stay a {self.signature.float} array "
                                 f"of shape {tuple(shape)}, got {what}; it holds the trainer's own values again")
            adopted[k] = new
        for k, new in adopted.items():
            view = self._views[k]
            source = new if not isinstance(new, np.ndarray) else np.ascontiguousarray(new)
            view.copy_to_device(self.runner.device(source).reshape(view.shape) if not isinstance(new, np.ndarray)
                                else source.reshape(view.shape), stream=self.runner.stream)
            self.params[k] = view
        self._adopted = tuple(adopted)

    def _launch_step(self, *args):
        """The whole step's launches: gradients, their squared norm, the update."""
        *loss_args, grads, params, s1, s2, hyper, status, arena, offs, scal, stream = args
        (loss,) = self.entry(*loss_args, grads, arena, offs, scal, stream)
        self.kernels["copy"][flat(loss, stream)](loss, status[0:1])
        self._launch_update(grads, params, s1, s2, hyper, status, stream)
        return ()

    def _launch_update(self, grads, params, s1, s2, hyper, status, stream):
        """|g|^2 into status[1], then the update (which reads the loss from status[0])."""
        self.kernels["sum_squares"][block(stream)](grads, status[1:2])
        self._launch_optimizer(grads, params, s1, s2, hyper, status, stream)

    def _launch_optimizer(self, grads, params, s1, s2, hyper, status, stream):
        """The check, then the fused update: clips by, and refuses a non-finite, loss status[0] or |g|^2
        status[1], or an update that would make any value non-finite (status[2] > 0)."""
        self._launch_check(grads, params, s1, s2, hyper, status, stream)
        self._launch_apply(grads, params, s1, s2, hyper, status, stream)

    def _optimizer_args(self, grads, params, s1, s2, hyper, status):
        state = (s1,) if self.optimizer == "sgd" else (s1, s2)
        return (params, *state, grads, hyper, status)

    def _launch_check(self, grads, params, s1, s2, hyper, status, stream):
        self.kernels[self.optimizer + "_check"][block(stream)](*self._optimizer_args(grads, params, s1, s2, hyper, status))

    def _launch_apply(self, grads, params, s1, s2, hyper, status, stream):
        self.kernels[self.optimizer][flat(params, stream)](*self._optimizer_args(grads, params, s1, s2, hyper, status))

    def _hyper_state(self):
        """The hyperparameters of this step to the device; the optimizer's two state buffers."""
        t = self.steps + 1
        if self.optimizer == "sgd":
            hyper = [self.lr, self.momentum, self.clip, 0, 0, 0, 0]
            state = [self.state["momentum"], self.state["momentum"]]
        else:
            b1, b2 = self.betas
            hyper = [self.lr, b1, b2, self.eps, 1.0 - b1 ** t, 1.0 - b2 ** t, self.clip]
            state = [self.state["m"], self.state["v"]]
        self._hyper.copy_to_device(np.array(hyper, dtype=self.signature.float), stream=self.runner.stream)
        return state

    # ---- parallel="data": the gradients go through host memory for the reduction -----------------
    def _dp_buffer(self):
        if getattr(self, "_host_grads", None) is None:
            self._host_grads = self.runner.pinned_zeros(self._grads.shape[0])
        return self._host_grads

    def _dp_params(self):
        return self.runner.host(self._flat)

    def _launch_gradients(self, *args):
        """The entry's launches only: the gradients, and the loss into status[0]."""
        *loss_args, grads, status, arena, offs, scal, stream = args
        (loss,) = self.entry(*loss_args, grads, arena, offs, scal, stream)
        self.kernels["copy"][flat(loss, stream)](loss, status[0:1])
        return ()

    def _whole_lr(self):
        """gradient="lr" in a pipeline build: the estimate runs whole, not in the stages (codegen/lr_api.py)."""
        return self.pipeline is not None and getattr(self, "gradient", "backprop") == "lr"

    def _gradients_launch(self):
        if getattr(self, "_launch_g", None) is None:
            self._launch_g = self._launch_gradients   # one bound method: the captured graph's key
        return self._launch_g

    def _lr_gradients(self, p, a):
        """The estimate of a pipeline build into self._grads; on several stages with the params their
        owners hold, each rank keeping its own params' gradients (under mpiexec; in one process, all);
        the loss."""
        several = self.pipeline.K > 1
        entry, head, a = self._entry_args(self.pipeline.params_from_owners(p) if several else p, a)
        self.runner.run(self._gradients_launch(), head + [self._grads, self._status], a, entry=entry)
        if several:
            self.pipeline.keep_owned(self._grads)
        return float(self.runner.host(self._status)[0])

    def _dp_gradients(self, a, grads, final, streamed=True):
        run = self.runner
        p = dict(self.params)
        if self._whole_lr():
            loss, weight = self._lr_gradients(p, a), 1.0
        elif self.pipeline is None:
            entry, head, a = self._entry_args(p, a)
            if streamed and self.streamed_entry is not None and entry == "_loss_and_grad":
                return self._streamed_gradients(head, a, grads, final), 1.0
            run.run(self._gradients_launch(), head + [self._grads, self._status], a, entry=entry)
            loss, weight = float(run.host(self._status)[0]), 1.0
        else:
            loss = self.pipeline.loss_and_grad(p, a, self._grads, decay_once=False)
            weight = self.pipeline.weight_sum
        grads[...] = run.host(self._grads)
        return loss, weight   # (the reduction starts every bucket now)

    def _streamed_gradients(self, head, a, grads, final):
        """The backward launched directly; after the kernels of each group of gradients, their copy into
        the host buffer `grads` and an event, on the stream. Then, in launch order, final(names) as soon
        as that group's event has passed: its bucket is reduced while the device runs the rest."""
        run, device = self.runner, self._grads
        copied = []   # (event, names): what the backward has made so far

        def ready(names):
            for name in names:
                start, stop = self.grad_slices[name]
                if stop > start:
                    device[start:stop].copy_to_host(grads[start:stop], stream=run.stream)
            copied.append((run.mark(), names))

        (loss,) = run.launch(self.streamed_entry, head + [device], a, "_loss_and_grad", ready)
        self.kernels["copy"][flat(loss, run.stream)](loss, self._status[0:1])
        for event, names in copied:
            event.synchronize()
            final(names)
        return float(run.host(self._status)[0])

    def _dp_update(self, loss, grads, dp, inputs=None):
        import math
        from .optim import sum_squares
        run = self.runner
        self._grads.copy_to_device(grads, stream=run.stream)
        state = self._hyper_state()
        sq = dp.pipe_sum(float(sum_squares(grads)))
        ok = math.isfinite(loss) and math.isfinite(sq)
        bad = 0
        if ok:
            self._status.copy_to_device(np.array([loss, sq, 0.0], dtype=self.signature.float), stream=run.stream)
            self._launch_check(self._grads, self._flat, *state, self._hyper, self._status, run.stream)
            bad = dp.pipe_sum(int(run.host(self._status)[2]))
        refused, bad = dp.agree([not ok, bad])
        if refused and ok:
            sq = math.nan
        if not refused and not bad:
            self._status.copy_to_device(np.array([loss, sq, 0.0], dtype=self.signature.float), stream=run.stream)
            self._launch_apply(self._grads, self._flat, *state, self._hyper, self._status, run.stream)
            run.sync()
        self._count_step(loss, sq, bad, inputs)
        return float(loss)

    @one_at_a_time
    def step(self, /, **inputs):
        if self._parallel is not None:
            return self._parallel.step(inputs)
        run = self.runner

        def check():
            checked = self.signature.inputs(inputs, self.loss_inputs, "Trainer.step", device_labels_later=True)
            self._adopt()
            return checked
        a = self._agreed(f"Trainer.step {self.steps + 1}", check)
        state = self._hyper_state()
        p = dict(self.params)
        if self.pipeline is None:
            entry, head, given = self._entry_args(p, a)
            run.run(self._launch, head + [self._grads, self._flat, *state, self._hyper, self._status], given, entry=entry)
        else:   # stage functions over microbatches (or the whole estimate), then the update launched directly
            loss = self._lr_gradients(p, a) if self._whole_lr() else \
                self.pipeline.loss_and_grad(p, a, self._grads)   # p: device views, scalars as one-element arrays
            self._status.copy_to_device(np.array([loss, 0.0, 0.0], dtype=self.signature.float), stream=run.stream)
            if self.pipeline.comm is None:
                self._launch_update(self._grads, self._flat, *state, self._hyper, self._status, run.stream)
            else:   # each rank holds its own params' gradients: clip by, and check, the global norm and overflow
                self.kernels["sum_squares"][block(run.stream)](self._grads, self._status[1:2])
                sq = self.pipeline.allreduce(float(run.host(self._status)[1]))
                self._status.copy_to_device(np.array([loss, sq, 0.0], dtype=self.signature.float), stream=run.stream)
                self._launch_check(self._grads, self._flat, *state, self._hyper, self._status, run.stream)
                bad = self.pipeline.allreduce(float(run.host(self._status)[2]))
                self._status.copy_to_device(np.array([loss, sq, bad], dtype=self.signature.float), stream=run.stream)
                self._launch_apply(self._grads, self._flat, *state, self._hyper, self._status, run.stream)
        loss, sq, bad = (float(x) for x in run.host(self._status))
        if loss != loss:   # a device label out of range gives NaN: name it (nothing was updated)
            self.signature.check_indices(a, "Trainer.step")
        self._count_step(loss, sq, bad, a)
        return loss
