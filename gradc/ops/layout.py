"""Matmul and the ops that only move data: transpose, reshape."""
import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import fmt, reshape_target, size


def _float_only(op, dtypes):
    for d in dtypes:
        if not d.startswith("float"):
            raise ShapeError(f"operand of dtype {d}: {op} takes float operands")


def _matmul_infer(attrs, shapes, dtypes):
    _float_only("matmul", dtypes)
    a, b = shapes
    if len(a) != 2 or len(b) != 2:
        raise ShapeError(f"operands must have rank 1 or 2, got {fmt(a)} and {fmt(b)}")
    m, k = a[::-1] if attrs.get("transpose_a") else a
    k2, n = b[::-1] if attrs.get("transpose_b") else b
    if k != k2:
        raise ShapeError(f"inner dims differ: {fmt(a)} @ {fmt(b)} ({k} != {k2})")
    return (m, n), dtypes[0]


def _matmul_vjp(ctx, n, g):
    """C = op(A) op(B): each adjoint is one more matmul with transpose flags, never a transpose copy."""
    a, b = ctx.graph.operands(n)
    ta, tb = ctx.graph.attrs(n).get("transpose_a", False), ctx.graph.attrs(n).get("transpose_b", False)
    da = db = None
    if ctx.needs(0):
        da = (ctx.emit("matmul", [b, g], transpose_a=tb, transpose_b=True) if ta
              else ctx.emit("matmul", [g, b], transpose_a=False, transpose_b=not tb))
    if ctx.needs(1):
        db = (ctx.emit("matmul", [g, a], transpose_a=True, transpose_b=ta) if tb
              else ctx.emit("matmul", [a, g], transpose_a=not ta, transpose_b=False))
    return [da, db]


def _matmul_evaluate(attrs, values, out_shape, dims):
    a, b = values
    return (a.T if attrs.get("transpose_a") else a) @ (b.T if attrs.get("transpose_b") else b)


def _matmul_flops(attrs, in_shapes, out_shape):
    a = in_shapes[0]
    k = a[0] if attrs.get("transpose_a") else a[1]
    return 2 * size(out_shape) * size((k,))


register(Op("matmul", "matmul", _matmul_infer, _matmul_evaluate, _matmul_flops, vjp=_matmul_vjp, arity=2,
            doc="2-D matrix product; attrs transpose_a / transpose_b"))


def _gemm_split(attrs, items):
    """The A operands, B operands and epilogue operands of a gemm, from its flat operand list."""
    na, nb = attrs["a_count"], attrs["b_count"]
    return items[:na], items[na:na + nb], items[na + nb:]


def _gemm_infer(attrs, shapes, dtypes):
    _float_only("gemm", dtypes)
    a, b, _ = _gemm_split(attrs, shapes)
    return _matmul_infer(attrs, [a[0], b[0]], dtypes)


def _gemm_evaluate(attrs, values, out_shape, dims):
    from .elementwise import numpy_function
    a, b, rest = _gemm_split(attrs, values)
    a = numpy_function(attrs["a_expr"], len(a))(*a)
    b = numpy_function(attrs["b_expr"], len(b))(*b)
    product = _matmul_evaluate(attrs, [a, b], out_shape, dims)
    return np.broadcast_to(numpy_function(attrs["epilogue"], 1 + len(rest))(product, *rest), out_shape)


def _gemm_flops(attrs, in_shapes, out_shape):
    a, b, _ = _gemm_split(attrs, in_shapes)
    return _matmul_flops(attrs, [a[0], b[0]], out_shape)


# Made by passes/gemm_fusion.py for the CUDA target after differentiation, so it has no VJP.
register(Op("gemm", "matmul", _gemm_infer, _gemm_evaluate, _gemm_flops,
            doc="epilogue(op(a_expr(A...)) @ op(b_expr(B...)), E...): a matmul with its elementwise neighbours "
                "fused into the operand loads and the store; attrs transpose_a/b, a_count, b_count, a_expr, b_expr, "
                "epilogue (over x0 = the product, x1.. = E)"))


def _transpose_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    axes = tuple(attrs["axes"])
    if sorted(axes) != list(range(len(shape))):
        raise ShapeError(f"axes {axes} are not a permutation of the {len(shape)} axes of {fmt(shape)}")
    return tuple(shape[i] for i in axes), dtypes[0]


def _transpose_vjp(ctx, n, g):
    axes = ctx.graph.attrs(n)["axes"]
    return [ctx.emit("transpose", [g], axes=tuple(int(i) for i in np.argsort(axes)))]


register(Op("transpose", "layout", _transpose_infer,
            lambda attrs, values, out_shape, dims: np.transpose(values[0], attrs["axes"]),
            lambda attrs, in_shapes, out_shape: 0, vjp=_transpose_vjp, arity=1))


def _reshape_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    return reshape_target(shape, attrs["shape"]), dtypes[0]


def _reshape_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    return [ctx.emit("reshape", [g], shape=ctx.graph.shape(x))]


register(Op("reshape", "layout", _reshape_infer,
            lambda attrs, values, out_shape, dims: np.reshape(values[0], out_shape),
            lambda attrs, in_shapes, out_shape: 0, vjp=_reshape_vjp, arity=1))


def _transfer_vjp(ctx, n, g):
    attrs = ctx.graph.attrs(n)
    return [ctx.emit("transfer", [g], source=attrs["target"], target=attrs["source"])]


register(Op("transfer", "layout", lambda attrs, shapes, dtypes: (shapes[0], dtypes[0]),
            lambda attrs, values, out_shape, dims: np.array(values[0], copy=True),
            lambda attrs, in_shapes, out_shape: 0, vjp=_transfer_vjp, arity=1,
            doc="the operand's value copied from device `source` to device `target`"))
