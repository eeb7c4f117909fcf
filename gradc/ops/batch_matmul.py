"""Matrix products over leading batch dims, as numpy's matmul: `batch_matmul`.

The 2-D `matmul` (gradc/ops/layout.py) stays as it is; an operand of rank >= 3 makes a
`batch_matmul`. Both operands have rank >= 2: the last two dims are the matrix (transpose_a /
transpose_b swap them, as in `matmul`), the dims before are batch dims that broadcast as in numpy
(a symbolic dim matches only itself). With reduce_batch the product is also summed over the batch
(both operands then share one batch shape): out = sum_b op(A[b]) op(B[b]). That is the adjoint of a
2-D operand broadcast over the batch (x @ W with x (B, T, K): dW = sum_b x[b]^T g[b]), one
product over the flattened rows instead of B products and a sum.

The VJPs are products again, `matmul` where both factors are 2-D, so second order follows.
"""
import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import broadcast, fmt, size


def _float_only(dtypes):
    for d in dtypes:
        if not d.startswith("float"):
            raise ShapeError(f"operand of dtype {d}: batch_matmul takes float operands")


def matrix(shape, transposed):
    rows, cols = shape[-2:]
    return (cols, rows) if transposed else (rows, cols)


def _infer(attrs, shapes, dtypes):
    _float_only(dtypes)
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise ShapeError(f"operands must have rank >= 2, got {fmt(a)} and {fmt(b)}")
    m, k = matrix(a, attrs.get("transpose_a"))
    k2, n = matrix(b, attrs.get("transpose_b"))
    if k != k2:
        raise ShapeError(f"inner dims differ: {fmt(a)} @ {fmt(b)} ({k} != {k2})")
    if attrs.get("reduce_batch"):
        if a[:-2] != b[:-2] or not a[:-2]:
            raise ShapeError(f"reduce_batch needs one batch shape on both operands, got {fmt(a)} and {fmt(b)}")
        return (m, n), dtypes[0]
    try:
        batch = broadcast(a[:-2], b[:-2])
    except ShapeError:
        raise ShapeError(f"batch dims {fmt(a[:-2])} and {fmt(b[:-2])} do not broadcast "
                         f"({fmt(a)} @ {fmt(b)})") from None
    return batch + (m, n), dtypes[0]


def _op_of(x, transposed):
    return np.swapaxes(x, -1, -2) if transposed else x


def _evaluate(attrs, values, out_shape, dims):
    a, b = values
    out = np.matmul(_op_of(a, attrs.get("transpose_a")), _op_of(b, attrs.get("transpose_b")))
    if attrs.get("reduce_batch"):
        out = out.reshape((-1,) + out.shape[-2:]).sum(axis=0)
    return out


def _flops(attrs, in_shapes, out_shape):
    a, b = in_shapes
    _, k = matrix(a, attrs.get("transpose_a"))
    batch = a[:-2] if attrs.get("reduce_batch") else out_shape[:-2]
    return 2 * size(batch) * size(out_shape[-2:]) * size((k,))


def product(ctx, x, y, transpose_a, transpose_b):
    """op(x) @ op(y) for the adjoint of a product: `matmul` for two 2-D factors, else `batch_matmul`."""
    sx, sy = ctx.graph.shape(x), ctx.graph.shape(y)
    if len(sx) == 2 and len(sy) == 2:
        return ctx.emit("matmul", [x, y], transpose_a=transpose_a, transpose_b=transpose_b)
    return ctx.emit("batch_matmul", [x, y], transpose_a=transpose_a, transpose_b=transpose_b, reduce_batch=False)


def _to_operand(ctx, x, y, transpose_a, transpose_b, shape):
    """op(x) @ op(y) summed back to an operand's `shape`: one reduce_batch product where the operand
    is 2-D and both factors carry the whole batch, else the batched product and a sum over the axes
    the operand was broadcast along."""
    sx, sy = ctx.graph.shape(x), ctx.graph.shape(y)
    if len(shape) == 2 and len(sx) > 2 and sx[:-2] == sy[:-2]:
        return ctx.emit("batch_matmul", [x, y], transpose_a=transpose_a, transpose_b=transpose_b, reduce_batch=True)
    return ctx.sum_to(product(ctx, x, y, transpose_a, transpose_b), shape)


def _vjp(ctx, n, g):
    """The rules of the 2-D matmul, per batch element; g is 2-D when the product was summed over the
    batch (reduce_batch), and then broadcasts against the other factor's batch."""
    a, b = ctx.graph.operands(n)
    attrs = ctx.graph.attrs(n)
    ta, tb = attrs.get("transpose_a", False), attrs.get("transpose_b", False)
    da = db = None
    if ctx.needs(0):
        da = (_to_operand(ctx, b, g, tb, True, ctx.graph.shape(a)) if ta
              else _to_operand(ctx, g, b, False, not tb, ctx.graph.shape(a)))
    if ctx.needs(1):
        db = (_to_operand(ctx, g, a, True, ta, ctx.graph.shape(b)) if tb
              else _to_operand(ctx, a, g, not ta, False, ctx.graph.shape(b)))
    return [da, db]


def batch_matmul_rows(graph, n, ins, fail):
    """Rows on a batch axis stay on it; rows of A's matrix rows stay the product's rows."""
    a, b = ins
    sa, sb = graph.shape(graph.operands(n)[0]), graph.shape(graph.operands(n)[1])
    attrs, out = graph.attrs(n), graph.shape(n)
    if attrs.get("reduce_batch"):
        fail("sums products over the batch")
    at = set()
    for w, s in ((a, sa), (b, sb)):
        if w is None:
            continue
        if w < len(s) - 2:
            at.add(w + len(out) - len(s))
        elif s is sa and w == len(s) - (1 if attrs.get("transpose_a") else 2) and b is None:
            at.add(len(out) - 2)
        else:
            fail("multiplies along the batch dim (it sums over rows)")
    if len(at) > 1:
        fail("multiplies rows of one operand with other rows of the other")
    return at.pop()


register(Op("batch_matmul", "matmul", _infer, _evaluate, _flops, vjp=_vjp, arity=2,
            doc="op(A) @ op(B) over broadcast batch dims (numpy's matmul); attrs transpose_a / transpose_b, "
                "reduce_batch (sum over the batch too)"))
