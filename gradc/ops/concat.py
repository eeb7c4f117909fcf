"""`concat`: operands joined along attrs["axis"]. Shapes agree exactly on every other axis (no
broadcast; a symbolic dim matches only itself); the joined axis has int dims, so the output's is
their sum. Its VJP slices the adjoint back into one piece per operand (`slice`, gradc/ops/index.py).
`gc.stack` is a reshape of each operand (a new axis of 1) and a concat.
"""
import numpy as np

from . import Op, register
from .batched import every_copy
from ..errors import ShapeError
from ..shapes import fmt
from .kernel_text import index, unravel


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


def _parts(s):
    """(operand variable, index expression of its part of the output) per operand."""
    axis, rank, offset, out = s.attrs["axis"], len(s.shape), 0, []
    for j, u in enumerate(s.operands):
        width = s.graph.shape(u)[axis]
        out.append((s.args[j], ", ".join(f"{offset}:{offset + width}" if a == axis else ":" for a in range(rank)),
                    offset))
        offset += width
    return out


def _concat_cpu(s):
    """Each operand copied into its part of its buffer (an int value's is its own: passes/storage.in_arena)."""
    return [s.alloc()] + [s.copy(f"{s.out}[{where}]", arg) + s.note for arg, where, _ in _parts(s)]


def _cuda_part_source(name, rank, axis):
    """One thread per element of one operand, written at `offset` along the joined axis."""
    dst = [f"i{a} + offset" if a == axis else f"i{a}" for a in range(rank)]
    lines = [f"def {name}(x0, offset, out):", "    i = cuda.grid(1)", "    if i >= x0.size:", "        return"]
    lines += unravel(rank, shape="x0.shape")
    lines.append(f"    out[{index(dst, '0')}] = x0[{index([f'i{a}' for a in range(rank)], '0')}]")
    return "\n".join(lines), f"out[..., offset + i, ...] = x0 along axis {axis}", ("flat", 0)


def _concat_cuda(s):
    rank, axis = len(s.shape), s.attrs["axis"]
    kernel = s.kernel(("concat_part", rank, axis), "concat_part", lambda kname: _cuda_part_source(kname, rank, axis))
    return [s.alloc()] + [s.call(kernel, [arg, str(offset), s.out]) + s.note for arg, _, offset in _parts(s)]


def _concat_batched(graph, n, operands, lifted, emit):
    return emit("concat", every_copy(graph, operands, lifted, emit), axis=graph.attrs(n)["axis"] + 1)


def _concat_simplify(graph, n):
    """A concat of one operand is that operand; an operand that is a concat along the same axis, read only
    here, gives its operands in its place (one copy of each piece, not two)."""
    ins, axis = graph.operands(n), graph.attrs(n)["axis"]
    if len(ins) == 1:
        return ins[0]
    inner = [graph.op(u) == "concat" and graph.attrs(u)["axis"] == axis and len(graph.users(u)) == 1 for u in ins]
    if not any(inner):
        return None
    graph.set_operands(n, [w for u, flat in zip(ins, inner) for w in (graph.operands(u) if flat else [u])])
    return n


register(Op("concat", "layout", _concat_infer,
            lambda attrs, values, out_shape, dims: np.concatenate(values, axis=attrs["axis"]),
            lambda attrs, in_shapes, out_shape: 0, vjp=_concat_vjp, arity=None, rows=concat_rows,
            cpu=_concat_cpu, cuda=_concat_cuda, batched=_concat_batched, simplify=_concat_simplify,
            doc="operands joined along attrs axis"))
