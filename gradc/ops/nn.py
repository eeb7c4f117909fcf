"""Softmax family and label picking, computed in stable forms."""
import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import size


def _axis_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    if not dtypes[0].startswith("float"):
        raise ShapeError(f"operand of dtype {dtypes[0]} is not float")
    if not 0 <= attrs["axis"] < len(shape):
        raise ShapeError(f"axis {attrs['axis']} out of range for {shape}")
    return shape, dtypes[0]


def _np_log_softmax(x, axis):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _softmax_vjp(ctx, n, g):
    """y * (g - sum(g * y))."""
    axis = ctx.graph.attrs(n)["axis"]
    gy = ctx.emit("mul", [g, n])
    s = ctx.emit("sum", [gy], axes=(axis,), keepdims=True)
    return [ctx.emit("mul", [n, ctx.emit("sub", [g, s])])]


def _log_softmax_vjp(ctx, n, g):
    """g - exp(y) * sum(g)."""
    axis = ctx.graph.attrs(n)["axis"]
    s = ctx.emit("sum", [g], axes=(axis,), keepdims=True)
    return [ctx.emit("sub", [g, ctx.emit("mul", [ctx.emit("exp", [n]), s])])]


def _softmax_flops(attrs, in_shapes, out_shape):
    return 5 * size(out_shape)


register(Op("softmax", "nn", _axis_infer,
            lambda attrs, values, out_shape, dims: np.exp(_np_log_softmax(values[0], attrs["axis"])),
            _softmax_flops, vjp=_softmax_vjp, arity=1))
register(Op("log_softmax", "nn", _axis_infer,
            lambda attrs, values, out_shape, dims: _np_log_softmax(values[0], attrs["axis"]),
            _softmax_flops, vjp=_log_softmax_vjp, arity=1))


def _pick_infer(attrs, shapes, dtypes):
    (x, labels), (dx, dl) = shapes, dtypes
    if len(x) != 2 or len(labels) != 1:
        raise ShapeError(f"needs (N, C) values and (N,) labels, got {x} and {labels}")
    if not dl.startswith("int"):
        raise ShapeError(f"labels must be integers, got {dl}")
    if x[0] != labels[0]:
        raise ShapeError(f"{x[0]} rows of values but {labels[0]} labels")
    return (x[0],), dx


def _pick_vjp(ctx, n, g):
    x, labels = ctx.graph.operands(n)
    return [ctx.emit("pick_grad", [g, labels], num_classes=ctx.graph.shape(x)[1]), None]


register(Op("pick", "nn", _pick_infer,
            lambda attrs, values, out_shape, dims: np.take_along_axis(values[0], values[1][:, None], 1)[:, 0],
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_pick_vjp, arity=2,
            doc="out[i] = x[i, labels[i]]"))


def _pick_grad_infer(attrs, shapes, dtypes):
    (g, labels) = shapes
    return (g[0], attrs["num_classes"]), dtypes[0]


def _pick_grad_evaluate(attrs, values, out_shape, dims):
    g, labels = values
    out = np.zeros(out_shape, dtype=g.dtype)
    out[np.arange(len(labels)), labels] = g
    return out


def _pick_grad_vjp(ctx, n, g):
    _, labels = ctx.graph.operands(n)
    return [ctx.emit("pick", [g, labels]), None]


register(Op("pick_grad", "nn", _pick_grad_infer, _pick_grad_evaluate,
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_pick_grad_vjp, arity=2,
            doc="out[i, labels[i]] = g[i], zeros elsewhere"))


# ---- softmax cross-entropy: one op per direction, so each target runs one fused kernel ----------
def _xent_infer(attrs, shapes, dtypes):
    (x, labels), (dx, dl) = shapes[:2], dtypes[:2]
    _pick_infer(attrs, [x, labels], [dx, dl])
    if not dx.startswith("float"):
        raise ShapeError(f"logits of dtype {dx} are not float")
    return (x[0],), dx


def _xent_evaluate(attrs, values, out_shape, dims):
    x, labels = values
    shifted = x - np.max(x, axis=1, keepdims=True)
    logsumexp = np.log(np.sum(np.exp(shifted), axis=1)) + np.max(x, axis=1)
    return logsumexp - np.take_along_axis(x, labels[:, None], 1)[:, 0]


def _xent_vjp(ctx, n, g):
    x, labels = ctx.graph.operands(n)
    return [ctx.emit("softmax_xent_grad", [x, labels, g]), None]


register(Op("softmax_xent", "nn", _xent_infer, _xent_evaluate,
            lambda attrs, in_shapes, out_shape: 5 * size(in_shapes[0]), vjp=_xent_vjp, arity=2,
            doc="out[i] = logsumexp(x[i]) - x[i, labels[i]]: the rows' cross-entropy losses"))


def _xent_grad_infer(attrs, shapes, dtypes):
    x, labels, g = shapes
    _xent_infer(attrs, [x, labels], dtypes[:2])
    if tuple(g) != (x[0],):
        raise ShapeError(f"the rows' adjoint has shape {g}, expected ({x[0]},)")
    return tuple(x), dtypes[0]


def _xent_grad_evaluate(attrs, values, out_shape, dims):
    x, labels, g = values
    s = np.exp(_np_log_softmax(x, 1))
    s[np.arange(len(labels)), labels] -= 1.0
    return s * g[:, None]


def _xent_grad_vjp(ctx, n, u):
    """out = (s - onehot) g with s = softmax(x): dx = g s (u - sum(s u)), dg = sum(s u) - u[labels]."""
    x, labels, g = ctx.graph.operands(n)
    s = ctx.emit("softmax", [x], axis=1)
    su = ctx.emit("mul", [s, u])
    row = ctx.emit("sum", [su], axes=(1,), keepdims=True)
    dx = ctx.emit("mul", [ctx.emit("reshape", [g], shape=(ctx.graph.shape(g)[0], 1)),
                          ctx.emit("sub", [su, ctx.emit("mul", [s, row])])]) if ctx.needs(0) else None
    dg = ctx.emit("sub", [ctx.emit("sum", [su], axes=(1,), keepdims=False), ctx.emit("pick", [u, labels])]) \
        if ctx.needs(2) else None
    return [dx, None, dg]


register(Op("softmax_xent_grad", "nn", _xent_grad_infer, _xent_grad_evaluate,
            lambda attrs, in_shapes, out_shape: 6 * size(out_shape), vjp=_xent_grad_vjp, arity=3,
            doc="out[i] = (softmax(x[i]) - onehot(labels[i])) * g[i]: softmax_xent's adjoint"))
