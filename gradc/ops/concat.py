"""`concat`: operands joined along attrs["axis"]. Shapes agree exactly on every other axis (no
broadcast; a symbolic dim matches only itself); the joined axis has int dims, so the output's is
their sum. Its VJP slices the adjoint back into one piece per operand (`slice`, gradc/ops/index.py).
`gc.stack` is a reshape of each operand (a new axis of 1) and a concat.
"""
import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import fmt


def _concat_infer(attrs, shapes, dtypes):
    if not shapes:
        raise ShapeError("needs at least one operand")
    axis = attrs["axis"]
    first = shapes[0]
    if not 0 <= axis < len(first):
        raise ShapeError(f"axis {axis} is out of range for rank {len(first)}")
    if len(set(dtypes)) > 1:
        raise ShapeError(f"operands have different dtypes {', '.join(dtypes)}")
    total = 0
    for j, s in enumerate(shapes):
        if len(s) != len(first):
            raise ShapeError(f"operand {j} has rank {len(s)} ({fmt(s)}), operand 0 has rank {len(first)} ({fmt(first)})")
        for a, (d, d0) in enumerate(zip(s, first)):
            if a != axis and d != d0:
                raise ShapeError(f"operand {j} has shape {fmt(s)}, operand 0 {fmt(first)}: they differ on axis {a} "
                                 f"({d} != {d0}), and only the joined axis {axis} may differ")
        if isinstance(s[axis], str):
            raise ShapeError(f"operand {j} has the symbolic dim {s[axis]} on the joined axis {axis}; "
                             f"the joined axis needs int dims")
        total += s[axis]
    return first[:axis] + (total,) + first[axis + 1:], dtypes[0]


def _concat_vjp(ctx, n, g):
    axis = ctx.graph.attrs(n)["axis"]
    out, offset = [], 0
    for j, u in enumerate(ctx.graph.operands(n)):
        shape = ctx.graph.shape(u)
        if ctx.needs(j):
            index = tuple((offset, offset + shape[axis], 1) if a == axis else None for a in range(len(shape)))
            out.append(ctx.emit("slice", [g], index=index))
        else:
            out.append(None)
        offset += shape[axis]
    return out


def concat_rows(graph, n, ins, fail):
    axis = graph.attrs(n)["axis"]
    at = {a for a in ins if a is not None}
    if len(at) > 1 or (at and None in ins):
        fail("joins values whose batch rows lie on different axes")
    a = at.pop() if at else None
    if a == axis:
        fail("joins along the batch dim")
    return a


register(Op("concat", "layout", _concat_infer,
            lambda attrs, values, out_shape, dims: np.concatenate(values, axis=attrs["axis"]),
            lambda attrs, in_shapes, out_shape: 0, vjp=_concat_vjp, arity=None,
            doc="operands joined along attrs axis"))
