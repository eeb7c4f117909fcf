"""Argument checks of the generated entry points: names, shapes, dtypes, label ranges.

Nothing is broadcast or cast: a wrong value raises ValueError naming the input, what was
expected and what was given.
"""
from difflib import get_close_matches

import numpy as np
from numba import njit

from .cuda import array_dtype, is_device_array, to_numpy
from .lr import KEYWORDS


@njit(cache=True, nogil=True)
def _range_of(labels):
    """(min, max) in one compiled pass: numpy's min and max cost 2.4 us together on a batch's labels,
    a tenth of a small model's step overhead."""
    lo = hi = labels.flat[0]
    for v in labels.flat:
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


def as_array(v):
    """(v as a numpy array, the type it was given as when not an array): a list, number or numpy scalar
    becomes the array numpy makes of it (a Python float is float64), which is then checked, never cast."""
    if isinstance(v, np.ndarray):
        return v, None
    return np.asarray(v), given_type(v)


def given_type(v):
    """What a value not an array was given as, for messages: a numpy scalar says so (a numpy bool and
    Python's True both have the type name bool)."""
    return f"numpy {v.dtype.name}" if isinstance(v, np.generic) else type(v).__name__


def number_as_array(v):
    """A number or numpy scalar (not a bool) as a 0-d array of the dtype numpy gives it; anything else as it is."""
    if isinstance(v, (np.generic, int, float)) and not isinstance(v, (bool, np.bool_)):
        return np.asarray(v)
    return v


def index_limits(entry):
    """The (bound, ranges) pairs of one input's _INDEX_BOUNDS entry (passes/analysis.py index_inputs);
    ranges None where the bound limits every element."""
    return entry.items() if isinstance(entry, dict) else ((entry, None),)


def _with_article(word):
    return f"{'an' if str(word)[0] in 'aeio' else 'a'} {word}"   # (a uint64)


def dtype_hint(given_as, dtype, expected, value=None, what="inputs"):
    """Why a value of `dtype` is refused where `expected` is (`value`: the array numpy made of it)."""
    expected = np.dtype(expected)
    if np.dtype(dtype).newbyteorder("=") == expected:   # >f8 is float64 with big-endian bytes
        return f"the same type with its bytes in the other order: pass np.asarray(..., dtype={expected})"
    if not given_as:
        return f"gradc never casts {what}"
    if given_as == "int" and expected.kind == "i" and value is not None and value.size == 1 and not (
            np.iinfo(expected).min <= int(value.flat[0]) <= np.iinfo(expected).max):
        return f"{int(value.flat[0])} is outside {expected}'s range"
    if given_as.startswith("numpy "):
        return f"a {given_as} scalar: pass np.asarray(..., dtype={expected})"
    return f"{_with_article(given_as)} becomes {_with_article(dtype)} array: pass np.asarray(..., dtype={expected})"


def _unmasked(what, v):
    """The data of a masked array that masks nothing; one that masks an element is refused: the kernels
    would read its data and drop the mask silently (trial S)."""
    if not isinstance(v, np.ma.MaskedArray):
        return v
    if np.ma.is_masked(v):
        raise ValueError(f"{what} is a masked array with masked elements: the kernels would read its data and "
                         f"drop its mask; pass np.ma.filled(x, value) (the masked elements set to a value you "
                         f"choose) or x.data")
    return np.ma.getdata(v)


def _fmt(shape):
    inner = ", ".join(str(d) for d in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


class Signature:
    def __init__(self, model_name, param_shapes, inputs, float_dtype, index_bounds, devices=False, declared=None,
                 stages=None):
        self.model = model_name
        self.devices = devices    # a --target cuda module: CUDA arrays are accepted where they are
        self.param_shapes = param_shapes
        self.inputs_spec = inputs
        self.float = np.dtype(float_dtype)
        self.index_bounds = index_bounds   # int inputs -> what their values index (passes/analysis.py index_inputs)
        self.declared = declared or {}   # input -> its declared shape, where --bind made a dim an int
        self.stages = stages             # a --devices build's (its dims stay bound): (the batch dim, microbatches)

    def _bound_hint(self, name, shape, given):
        """Why an int of the expected shape differs from the model's: the dims --bind fixed at compile time."""
        declared = self.declared.get(name, ())
        fixed = [(d, e, a) for d, e, a in zip(declared, shape, given) if isinstance(d, str) and not isinstance(e, str)
                 and e != a]
        if not fixed:
            return ""
        bound = ", ".join(f"{d}={e}" for d, e, _ in fixed)
        if self.stages is None:
            return f" ({bound} was bound when the module was compiled (--bind); compile without it for any size)"
        batch, microbatches = self.stages   # a --devices build needs its dims bound
        again = " ".join(f"--bind {d}={a}" for d, _, a in fixed)
        other = (f", or for any batch size with --microbatches M > 1 (its code keeps {batch} symbolic)"
                 if microbatches == 1 and any(d == batch for d, _, _ in fixed) else "")
        return f" ({bound} was bound when this --devices build was compiled: compile it again with {again}{other})"

    def params(self, params, exact=False):
        """Checked params, in call form (0-d arrays as 1-element views)."""
        if not isinstance(params, dict):
            raise ValueError(f"{self.model}: params must be a dict name -> array, got {type(params).__name__}")
        missing = [k for k in self.param_shapes if k not in params]
        unknown = [k for k in params if k not in self.param_shapes]
        if missing or unknown:
            raise ValueError(f"{self.model}: params " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])) +
                f" (expected {list(self.param_shapes)})")
        out = {}
        for name, shape in self.param_shapes.items():
            v = self._float_array(f"{self.model}: param {name!r}", params[name], shape)
            if self._on_device(v):
                out[name] = v.reshape(1) if len(shape) == 0 else v
                continue
            if not v.flags.c_contiguous:
                if exact:
                    raise ValueError(f"{self.model}: param {name!r} is not C-contiguous; the Trainer updates it in place")
                v = np.ascontiguousarray(v)
            out[name] = v.reshape(1) if v.ndim == 0 else v
        return out

    def tangents(self, v, trainable):
        """hvp's v: exactly the trainable params' names, shapes and dtype; in call form."""
        if not isinstance(v, dict):
            raise ValueError(f"{self.model}.hvp: v must be a dict name -> array, got {type(v).__name__}")
        missing = [k for k in trainable if k not in v]
        unknown = [k for k in v if k not in trainable]
        if missing or unknown:
            raise ValueError(f"{self.model}.hvp: v " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"unknown or not trainable {unknown}"] if unknown else [])) +
                f" (v has one array per trainable param: {list(trainable)})")
        out = {}
        for name in trainable:
            t = self._float_array(f"{self.model}.hvp: v[{name!r}]", v[name], self.param_shapes[name], "tangents")
            t = np.ascontiguousarray(to_numpy(t) if self._on_device(t) else t)
            out[name] = t.reshape(1) if t.ndim == 0 else t
        return out

    def _on_device(self, v):
        if not (self.devices and is_device_array(v)):
            return False
        strides = getattr(v, "__cuda_array_interface__", {}).get("strides")
        if strides is not None and strides != _c_strides(v.shape, array_dtype(v).itemsize):
            raise ValueError(f"{self.model}: a CUDA array argument must be C-contiguous (got strides {strides} "
                             f"for shape {_fmt(tuple(v.shape))})")
        return True

    def _float_array(self, what, v, shape, kind="params"):
        if self._on_device(v):
            # a scalar on the device is a one-element array (a CUDA Trainer's tr.params holds those)
            if tuple(v.shape) != tuple(shape) and not (shape == () and tuple(v.shape) == (1,)):
                raise ValueError(f"{what} has shape {_fmt(tuple(v.shape))}, expected {_fmt(shape)}")
            if array_dtype(v) != self.float:
                raise ValueError(f"{what} has dtype {array_dtype(v)}, expected {self.float}")
            return v
        given_as = None
        if not isinstance(v, np.ndarray):
            given_as, v = given_type(v), number_as_array(v)
            if not isinstance(v, np.ndarray):
                raise ValueError(f"{what} must be a numpy array{' or a CUDA array' if self.devices else ''}, "
                                 f"got {given_as}")
        v = _unmasked(what, v)
        if v.shape != shape:
            raise ValueError(f"{what} has shape {_fmt(v.shape)}, expected {_fmt(shape)}")
        if v.dtype != self.float:
            hint = dtype_hint(given_as, v.dtype, self.float, what=kind)
            raise ValueError(f"{what} has dtype {v.dtype}, expected {self.float} ({hint})")
        return v

    def wants_loss(self, given, loss_inputs, output_reads):
        """forward(): the objective is computed when every input it needs is given, or one the outputs do not
        read (then the loss's missing inputs are named); `output_reads` counts those of a scan the outputs
        share with the loss, though their own copy of it may not read them (passes/forward_outputs.py)."""
        return all(k in given for k in loss_inputs) or any(k not in output_reads for k in given)

    def inputs(self, given, needed, entry, device_labels_later=False):
        """Checked inputs for `entry`, in call form; symbolic dims must agree across inputs.

        device_labels_later: labels already on a device are not copied to the host here; the
        kernels turn a label out of range into a NaN loss, and the caller runs check_indices then."""
        unknown = [k for k in given if k not in self.inputs_spec]
        if unknown:
            options = KEYWORDS if entry == "lr_grad" else ()   # a misspelt option lands here too
            known = list(self.inputs_spec) + list(options)
            open_names = [k for k in known if k not in given]   # not one the call already gave
            lower = {k.lower(): k for k in open_names}
            near = [lower[m] for k in unknown for m in get_close_matches(k.lower(), list(lower), n=1)]
            raise ValueError(f"{self.model}.{entry}: unknown input {', '.join(map(repr, unknown))} "
                             f"(inputs are {', '.join(map(repr, self.inputs_spec))}"
                             + (f"; lr_grad's options are {', '.join(options)}" if options else "") + ")"
                             + (f": did you mean {', '.join(map(repr, near))}?" if near else ""))
        missing = [k for k in dict.fromkeys(needed) if k not in given]
        if missing:
            raise ValueError(f"{self.model}.{entry}: missing input {', '.join(map(repr, missing))}")
        dims, out = {}, {}
        for name in dict.fromkeys(needed):
            shape, dtype = self.inputs_spec[name]
            v = given[name]
            device = self._on_device(v)
            given_as = None
            if not device:
                v, given_as = as_array(v)
                v = _unmasked(f"{self.model}.{entry}: input {name!r}", v)
            if array_dtype(v) != np.dtype(dtype):
                raise ValueError(f"{self.model}.{entry}: input {name!r} has dtype {array_dtype(v)}, expected {dtype} "
                                 f"({dtype_hint(given_as, array_dtype(v), dtype, v)})")
            if len(v.shape) != len(shape):
                raise ValueError(f"{self.model}.{entry}: input {name!r} has shape {_fmt(v.shape)}, expected {_fmt(shape)}")
            for d, actual in zip(shape, v.shape):
                if isinstance(d, str):
                    if actual == 0:   # a mean over no rows is 0/0: refuse it rather than return NaN
                        raise ValueError(f"{self.model}.{entry}: input {name!r} has shape {_fmt(v.shape)}: dim {d} is "
                                         f"0; it must be at least 1")
                    seen = dims.setdefault(d, (actual, name))
                    if seen[0] != actual and seen[1] == name:
                        raise ValueError(f"{self.model}.{entry}: input {name!r} has shape {_fmt(v.shape)}, expected "
                                         f"{_fmt(shape)}: dim {d} is {seen[0]} on one axis and {actual} on another")
                    if seen[0] != actual:   # (either may be the wrong one: a trial's batch-major x blamed h0)
                        first = seen[1]
                        raise ValueError(f"{self.model}.{entry}: dim {d} is {seen[0]} in input {first!r} "
                                         f"{_fmt(out[first].shape)}, declared {_fmt(self.inputs_spec[first][0])}, and "
                                         f"{actual} in input {name!r} {_fmt(v.shape)}, declared {_fmt(shape)}: one of "
                                         f"them has its axes in another order, or other rows")
                elif d != actual:
                    raise ValueError(f"{self.model}.{entry}: input {name!r} has shape {_fmt(v.shape)}, expected "
                                     f"{_fmt(shape)}{self._bound_hint(name, shape, v.shape)}")
            if not device and not v.flags.c_contiguous:
                try:
                    v = np.ascontiguousarray(v)
                except MemoryError:   # (numpy's own message names no input)
                    raise MemoryError(f"{self.model}.{entry}: input {name!r} {_fmt(v.shape)} is a strided view (a "
                                      f"transpose, a step, a broadcast), copied to C order first, which needs "
                                      f"{v.size * v.itemsize / 2**30:.2f} GiB: pass a contiguous array, or fewer rows") from None
            out[name] = v.reshape(1) if len(shape) == 0 else v
        self.check_indices(out, entry, skip_device=device_labels_later)
        return out

    def check_indices(self, inputs, entry, skip_device=False):
        """ValueError naming the first int input that holds a label or table row out of range, and where
        (passes/analysis.py `index_inputs` says what self.index_bounds holds: a bound per input, or bounds
        per position)."""
        for name, limits in self.index_bounds.items():
            v = inputs.get(name)
            if v is None or not v.size or (skip_device and self._on_device(v)):
                continue
            v = to_numpy(v) if self._on_device(v) else v
            shape = self.declared.get(name, self.inputs_spec[name][0])   # (positions are over the declared fixed axes)
            for bound, ranges in index_limits(limits):
                n = bound if not isinstance(bound, str) else self._dim_of(inputs, bound)
                if n is None:   # the dim's carrier is not given: what reads this bound is not computed
                    continue
                lo, hi = (int(end) for end in _range_of(v if ranges is None else _at(v, shape, ranges)))
                if lo < 0 or hi >= n:
                    bad = (v < 0) | (v >= n)
                    if ranges is not None:
                        bad &= _mask(v, shape, ranges)
                    at = tuple(int(i) for i in np.argwhere(bad)[0])
                    where = f" at {list(at)}" if shape else ""   # (a () input is held as (1,))
                    raise ValueError(f"{self.model}.{entry}: input {name!r} holds {v[at]}{where}, outside "
                                     f"0..{n - 1}: {'its values' if ranges is None else 'the values there'} index {n} "
                                     f"classes or table rows")

    def _dim_of(self, inputs, dim):
        """The size of symbolic dim `dim` in the given inputs; None when none carries it."""
        for name, v in inputs.items():
            shape = self.inputs_spec[name][0]
            if dim in shape:
                return v.shape[shape.index(dim)]
        return None


def _mask(v, shape, ranges):
    """Which elements of `v` lie at the flat positions `ranges` over the fixed axes of its `shape`."""
    fixed = tuple(d for d in shape if not isinstance(d, str))
    at = np.zeros(int(np.prod(fixed)), bool)
    for start, stop in ranges:
        at[start:stop] = True
    at = at.reshape(fixed)
    return np.broadcast_to(np.expand_dims(at, tuple(i for i, d in enumerate(shape) if isinstance(d, str))), v.shape)


def _at(v, shape, ranges):
    """The elements of `v` at those positions, flat."""
    return v[_mask(v, shape, ranges)]


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
