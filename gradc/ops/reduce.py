"""Reductions over axes: sum, mean, max; and the helpers their VJPs build (argmax_mask, count)."""
import math

import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import reduced, size


def _reduce_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    if not dtypes[0].startswith("float"):
        raise ShapeError(f"operand of dtype {dtypes[0]}: reductions take float operands")
    axes = tuple(attrs["axes"])
    if any(not 0 <= a < len(shape) for a in axes):
        raise ShapeError(f"axes {axes} out of range for {shape}")
    return reduced(shape, axes, attrs.get("keepdims", False)), dtypes[0]


def _spread(ctx, n, g):
    """The adjoint g of a reduction, reshaped to keepdims form so it broadcasts over the input."""
    (x,) = ctx.graph.operands(n)
    attrs = ctx.graph.attrs(n)
    kept = reduced(ctx.graph.shape(x), attrs["axes"], True)
    return g if ctx.graph.shape(g) == kept else ctx.emit("reshape", [g], shape=kept)


def _sum_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    return [ctx.emit("broadcast_to", [_spread(ctx, n, g)], shape=ctx.graph.shape(x))]


def _mean_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    axes = ctx.graph.attrs(n)["axes"]
    count = ctx.emit("count", [], dims=tuple(ctx.graph.shape(x)[a] for a in axes), dtype=ctx.graph.dtype(x))
    scaled = ctx.emit("div", [_spread(ctx, n, g), count])
    return [ctx.emit("broadcast_to", [scaled], shape=ctx.graph.shape(x))]


def _max_vjp(ctx, n, g):
    """The gradient goes to the first maximal element of each reduced slice (as PyTorch)."""
    (x,) = ctx.graph.operands(n)
    mask = ctx.emit("argmax_mask", [x], axes=ctx.graph.attrs(n)["axes"])
    return [ctx.emit("mul", [mask, _spread(ctx, n, g)])]


def _reduce_flops(attrs, in_shapes, out_shape):
    return size(in_shapes[0])


def _np_reduce(fn):
    return lambda attrs, values, out_shape, dims: np.asarray(
        fn(values[0], axis=tuple(attrs["axes"]), keepdims=attrs.get("keepdims", False)))


register(Op("sum", "reduce", _reduce_infer, _np_reduce(np.sum), _reduce_flops, vjp=_sum_vjp, arity=1))
register(Op("mean", "reduce", _reduce_infer, _np_reduce(np.mean), _reduce_flops, vjp=_mean_vjp, arity=1))
register(Op("max", "reduce", _reduce_infer, _np_reduce(np.max), _reduce_flops, vjp=_max_vjp, arity=1))


def first_max_mask(x, axes):
    """1.0 at the first maximal element of each slice over `axes` (C order), else 0.0."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = np.transpose(x, rest + list(axes))
    flat = moved.reshape(moved.shape[:len(rest)] + (-1,))
    hot = np.zeros_like(flat)
    idx = np.argmax(flat, axis=-1)
    np.put_along_axis(hot, idx[..., None], 1.0, axis=-1)
    return np.transpose(hot.reshape(moved.shape), np.argsort(rest + list(axes)))


def _mask_infer(attrs, shapes, dtypes):
    return shapes[0], dtypes[0]


register(Op("argmax_mask", "reduce", _mask_infer,
            lambda attrs, values, out_shape, dims: first_max_mask(values[0], tuple(attrs["axes"])),
            _reduce_flops, vjp=lambda ctx, n, g: [None], arity=1,
            doc="piecewise constant: its derivative is zero"))


def _count_infer(attrs, shapes, dtypes):
    return (), attrs.get("dtype", "float")


register(Op("count", "reduce", _count_infer,
            lambda attrs, values, out_shape, dims: np.asarray(
                float(math.prod(dims[d] if isinstance(d, str) else d for d in attrs["dims"]))),
            lambda attrs, in_shapes, out_shape: 0, vjp=lambda ctx, n, g: [], arity=0,
            doc="number of elements over attrs['dims'] (symbolic dims resolved at run time)"))
