"""What a generated module's lr_grad hands its compiled function besides params and inputs
(passes/likelihood_ratio.py builds the graph; DESIGN.md §1.9): a mask of signs per noise site (+-1
where the site is perturbed in that sample, 0 where not), the seed, sigma, the antithetic flag, each
copy's weight in the baseline, the estimate's scale before its 1 / sigma**2, and int inputs tiled K times on the
rows. Also the Trainer's gradient="lr" options, checked when the Trainer is made.
"""
import math
import numbers
import threading
from collections import OrderedDict
from types import MappingProxyType

import numpy as np

from .host_memory import available_bytes
from .parallel import refused_on_every_rank

SIGMA = 1e-2      # lr_grad's default noise std: small enough for little bias, large enough for float32 losses
SAMPLES = 64
KEPT_HOST_SETS = 8   # sets of lasting leaves (one per options and batch size) a host module keeps
KEYWORDS = ("samples", "sigma", "seed", "antithetic", "layerwise", "baseline")   # lr_grad's, beside **inputs


class LikelihoodRatio:
    """info: {"why": None or the reason lr_grad is not built, "tiled": {input: (its leaf key or None when the
    graph makes its copies, its rows' axis)},
    "masks": [(key, rank, one per copy: a statistic's site)],
    "per_row": bool, "sites": [...]} (written into the module)."""

    def __init__(self, model_name, float_type, info, inputs=()):
        self.model_name = model_name
        self.float = np.dtype(float_type)
        self.info = info
        self.taken = [k for k in KEYWORDS if k in inputs]   # inputs a call of lr_grad could not give
        self._kept = OrderedDict()   # (options, rows, adopt) -> the leaves calls share (LikelihoodRatio.leaves)
        self._kept_lock = threading.Lock()

    def refuse(self, what="lr_grad"):
        if self.info.get("why"):
            raise ValueError(f"{self.model_name}.{what}: no likelihood-ratio estimate for this model: {self.info['why']}")

    def check(self, samples, sigma, seed, antithetic, layerwise, baseline, what="lr_grad"):
        """The options, checked; raises ValueError naming the bad one."""
        self.refuse(what)
        name = f"{self.model_name}.{what}"
        if what == "lr_grad" and self.taken:
            raise ValueError(f"{name}: the model has input(s) named {', '.join(map(repr, self.taken))}, as lr_grad's "
                             f"option(s), so a call cannot give both: rename the input(s) in the model "
                             f"(Trainer(gradient='lr') takes them: its options are given to the Trainer)")
        # a 0-d array (np.array(0.01)) is its number, as a numpy scalar is
        samples, sigma, seed = (v.item() if isinstance(v, np.ndarray) and v.shape == () and v.dtype.kind in "iuf"
                                else v for v in (samples, sigma, seed))
        if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 1:
            raise ValueError(f"{name}: samples must be an int >= 1, got {samples!r}")
        if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(sigma) or sigma <= 0:
            raise ValueError(f"{name}: sigma must be a finite number > 0, got {sigma!r}")
        with np.errstate(over="ignore", under="ignore"):
            s = self.float.type(sigma)
            # (a subnormal sigma**2 passed, and 1 / sigma**2 made every gradient nan, or 0: trial U)
            tiny = np.finfo(self.float).tiny
            if not (0 < s < math.inf and tiny <= s * s < math.inf and tiny <= 1 / (s * s) < math.inf):
                raise ValueError(f"{name}: sigma {sigma!r} is out of {np.dtype(self.float).name}'s range (sigma**2 "
                                 f"and 1 / sigma**2 must be normal finite numbers there: sigma from "
                                 f"{float(np.sqrt(tiny)):.2g} to {float(1 / np.sqrt(tiny)):.2g})")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**63 <= seed < 2**63:
            raise ValueError(f"{name}: seed must be an int in int64's range [-2**63, 2**63), got {seed!r}")
        for flag, value in (("antithetic", antithetic), ("layerwise", layerwise), ("baseline", baseline)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}: {flag} must be True or False, got {value!r}")
        if antithetic and samples % 2:
            raise ValueError(f"{name}: samples={samples} is odd, but antithetic pairs use each draw as eps and -eps: "
                             f"give an even number of samples, or antithetic=False")
        return int(samples), float(sigma), int(seed), bool(antithetic), bool(layerwise), bool(baseline)

    def copies(self, samples, layerwise):
        """The perturbed copies one call runs: samples, or samples per site layer-wise."""
        return samples * (len(self.info["masks"]) if layerwise else 1)

    def total(self, samples, antithetic, layerwise, baseline):
        """The copies of the batch one call runs: the perturbed ones, and with antithetic pairs and the
        baseline two without noise (the last of each half), whose loss is the baseline."""
        return self.copies(samples, layerwise) + (2 if antithetic and baseline else 0)

    def leaves(self, a, samples, sigma, seed, antithetic, layerwise, baseline, adopt=None, host=None):
        """`a` (the checked inputs) with the lr leaves added under their "lr:" keys. Those that depend only on
        the options other than sigma and seed, and on the batch size (the masks' signs, the flags, the rows),
        are made once for each such set and kept: with `adopt` (a CUDA module's: an owned device copy) on
        the device, where a replayed CUDA graph reads them in place. Only seed and sigma are new each
        call, and the int inputs' K copies (labels, tiled here; `host` copies a device array to numpy);
        the float inputs' copies are made in the graph."""
        rows = next((a[name].shape[axis] for name, (_, axis) in self.info["tiled"].items() if name in a), None)
        if rows is None:
            raise ValueError(f"{self.model_name}.lr_grad: no batch input given")
        options = (samples, antithetic, layerwise, baseline, rows, adopt)
        total = self.total(samples, antithetic, layerwise, baseline)
        with self._kept_lock:   # one set per options, also when threads call at once
            kept = self._kept.get(options)
            if kept is None:   # (checked when first made: not at every call of a training loop)
                self._refuse_beyond_memory(samples, layerwise, total, rows)
                kept = self._kept[options] = self._lasting(samples, antithetic, layerwise, baseline, rows, adopt)
                # host sets beyond the last few used go (a sweep over batch sizes made one each, for good); a
                # device set stays: a captured CUDA graph reads it in place
                on_host = [key for key in self._kept if key[-1] is None]
                for key in on_host[:max(len(on_host) - KEPT_HOST_SETS, 0)]:
                    del self._kept[key]
            self._kept.move_to_end(options)
        out = {**a, **kept, "lr:seed": np.array([seed], dtype=np.int64),
               "lr:sigma": np.array([sigma], dtype=self.float)}
        for name, (leaf, axis) in self.info["tiled"].items():   # int inputs: copies sample-major along the rows' axis
            if leaf is not None:
                x = a[name] if isinstance(a[name], np.ndarray) else host(a[name])
                out[f"lr:{leaf}"] = np.tile(x, tuple(total if d == axis else 1 for d in range(x.ndim)))
        return out

    def _refuse_beyond_memory(self, samples, layerwise, total, rows):
        """MemoryError naming `samples` before the leaves of `total` copies are made, when their rows alone (a
        sign per copy and row for each site, one per copy for a statistic's site, the copies' row flags, the int
        inputs' copies: 8 bytes a value at most) would not fit in the memory available; the arena's own check
        comes after (gradc/runtime/arena.py)."""
        copies = self.copies(samples, layerwise)
        per_copy = sum(1 for _, _, *flag in self.info["masks"] if flag and flag[0])
        per_row = len(self.info["masks"]) - per_copy
        need = 8 * total * (rows * (per_row + 1 + len(self.info["tiled"])) + per_copy + 4)
        free = available_bytes()
        if free is not None and need > free:
            raise MemoryError(f"{self.model_name}.lr_grad: samples={samples} runs {copies} perturbed copies of the "
                              f"batch at once, whose noise signs alone need {need / 2**30:.2f} GiB, but only "
                              f"{free / 2**30:.2f} GiB of memory is available: give fewer samples")

    def _lasting(self, samples, antithetic, layerwise, baseline, rows, adopt):
        """The leaves a call with these options and `rows` batch rows shares with every other such call."""
        F = self.float
        total = self.total(samples, antithetic, layerwise, baseline)
        out = {}
        # sample k perturbs site s with sign: copies are sample-major; with antithetic pairs the second half of
        # the copies mirrors the first (the noise kernel repeats its draws there) with the opposite sign, and
        # with the baseline the last copy of each half has no noise
        half = total // 2 if antithetic else total
        noisy = self.copies(samples, layerwise) // (2 if antithetic else 1)   # perturbed copies in a half
        k = np.arange(total)
        within = k % half
        clean = within >= noisy   # the noise-free copies of the pairs' baseline (none otherwise)
        sign = np.where(clean, 0.0, np.where(k < half, 1.0, -1.0))
        per_site = samples // 2 if antithetic else samples
        for s, (key, rank, *per_copy) in enumerate(self.info["masks"]):   # (a module from before: 2 values)
            active = (within // per_site == s) if layerwise else np.ones(total, dtype=bool)
            m = np.where(active, sign, 0.0).astype(F)
            m = m if per_copy and per_copy[0] else np.repeat(m, rows)   # a statistic's site: one per copy
            out[f"lr:{key}"] = m.reshape((len(m),) + (1,) * (rank - 1))
        # each copy's weight in the baseline every row's loss is taken from: with pairs the noise-free copies'
        # loss (a pair's + and - copies read different perturbed values, so their difference alone leaves the
        # loss times that difference in the estimate); without, the leave-one-out mean. Both are unbiased.
        loo = baseline and not antithetic and total > 1
        if antithetic and baseline:
            weights = np.where(clean, 0.5, 0.0)
        else:
            weights = np.full(total, 1.0 / total if loo else 0.0)
        out["lr:baseline"] = weights.astype(F).reshape(total, 1)
        # the scale before its 1 / sigma**2, which the graph applies (times K / (K - 1): the leave-one-out mean)
        out["lr:scale"] = np.array([1.0 / samples * (total / (total - 1) if loo else 1.0)], dtype=F)
        out["lr:half"] = np.array([1 if antithetic else 0], dtype=np.int64)
        out["lr:rows"] = np.ones((total, rows), dtype=F)
        return out if adopt is None else {k: adopt(v) for k, v in out.items()}


class _Unset:
    """An lr option the caller did not name (a backprop Trainer refuses one named, even at its default)."""

    def __repr__(self):
        return "<its default>"


_UNSET = _Unset()
DEFAULTS = {"samples": SAMPLES, "sigma": SIGMA, "seed": 0, "antithetic": True, "layerwise": False, "baseline": True}


class LRTrainer:
    """Trainer(..., gradient="lr", samples=64, sigma=1e-2, seed=0, antithetic=True, layerwise=False, baseline=True):
    the same optimizers and checks, driven by lr_grad's estimate; step t draws its noise from seed + t.
    gradient="backprop" (the default) uses loss_and_grad."""
    _lr = None   # the module's LikelihoodRatio
    _gradient_option_names = ("gradient", "samples", "sigma", "seed", "antithetic", "layerwise", "baseline")

    def __init__(self, params, /, *args, gradient="backprop", samples=_UNSET, sigma=_UNSET, seed=_UNSET,
                 antithetic=_UNSET, layerwise=_UNSET, baseline=_UNSET, **kwargs):
        with refused_on_every_rank(self, kwargs.get("parallel"), kwargs):   # (the other ranks would wait for this one)
            if gradient not in ("backprop", "lr"):
                raise ValueError(f"{self.model_name}.Trainer: gradient must be 'backprop' or 'lr', got {gradient!r}")
            self._gradient = gradient
            self._lr_options = self._lr_seed = None
            given = {"samples": samples, "sigma": sigma, "seed": seed, "antithetic": antithetic,
                     "layerwise": layerwise, "baseline": baseline}
            named = [f"{k}={v!r}" for k, v in given.items() if v is not _UNSET]
            if gradient == "backprop" and named:   # they would be ignored, even at their defaults (gradient="lr" forgotten)
                raise ValueError(f"{self.model_name}.Trainer: {', '.join(named)}: option(s) of gradient='lr' (the "
                                 f"likelihood-ratio estimate), which a backprop trainer would ignore")
            samples, sigma, seed, antithetic, layerwise, baseline = (
                DEFAULTS[k] if v is _UNSET else v for k, v in given.items())
            if gradient == "lr":
                samples, sigma, seed, antithetic, layerwise, baseline = self._lr.check(
                    samples, sigma, seed, antithetic, layerwise, baseline, what="Trainer")
                self._lr_seed = seed
                self._lr_options = MappingProxyType({"samples": samples, "sigma": sigma, "antithetic": antithetic,
                                                     "layerwise": layerwise, "baseline": baseline})
        super().__init__(params, *args, **kwargs)

    # chosen when the trainer is made (a changed sigma would not be the run its checkpoint resumes): read-only
    gradient = property(lambda self: self._gradient, doc="'backprop' (loss_and_grad) or 'lr' (lr_grad's estimate)")
    lr_options = property(lambda self: self._lr_options, doc="the options of gradient='lr' (None for backprop)")
    lr_seed = property(lambda self: self._lr_seed, doc="the seed step 0 draws its noise from (step t: seed + t)")

    def _step_options(self):
        """lr_grad's options for this step, in LikelihoodRatio.leaves' order: step t draws from seed + t
        (wrapping around in int64, as the seed is one)."""
        o = self.lr_options
        seed = (self.lr_seed + self.steps + 2**63) % 2**64 - 2**63
        return (o["samples"], o["sigma"], seed, o["antithetic"], o["layerwise"], o["baseline"])

    def _gradient_meta(self):
        """gradient="lr" and its options are training state: a resumed run draws step t's noise from seed + t."""
        if self.gradient == "backprop":
            return {"gradient": "backprop"}
        return {"gradient": "lr", "lr_options": dict(self.lr_options, seed=self.lr_seed)}

    @classmethod
    def _gradient_options(cls, meta):
        gradient = meta.get("gradient", "backprop")   # checkpoints from before gradient modes were recorded
        if gradient == "backprop":
            return {}
        options = meta.get("lr_options")
        known = {"samples", "sigma", "seed", "antithetic", "layerwise", "baseline"}
        if gradient != "lr" or not isinstance(options, dict) or set(options) != known:
            raise ValueError(f"meta 'gradient' {gradient!r} with options {options!r} is not a gradient mode "
                             f"this module has (backprop, or lr with {', '.join(sorted(known))})")
        return {"gradient": "lr", **options}
