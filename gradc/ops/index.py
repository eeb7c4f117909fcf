"""Basic indexing: `slice` (static ranges per axis, numpy semantics) and its adjoint `slice_grad`,
a scatter into zeros. Each is the other's VJP, so second order goes through indexing too.

attrs["index"] holds one entry per axis of the operand: None (the whole axis, `:`) or a triple
(start, stop, step) as Python's `slice.indices(n)` gives it, so the axis keeps
len(range(start, stop, step)) elements. An int index is a slice of one element followed by a
reshape that drops the axis (gradc/dsl.py); a symbolic dim is only ever taken whole.
"""
import numpy as np

from . import Op, register
from .batched import unary
from ..errors import ShapeError
from ..shapes import fmt, size
from .kernel_text import index as kindex, unravel


def np_index(index):
    """The numpy index of attrs["index"] (a stop of -1 with a negative step runs to element 0)."""
    out = []
    for entry in index:
        if entry is None:
            out.append(slice(None))
        else:
            start, stop, step = entry
            if not len(range(start, stop, step)):
                out.append(slice(0, 0))
            else:
                out.append(slice(start, None if stop < 0 else stop, step))
    return tuple(out)


def sliced_shape(shape, index):
    if len(index) != len(shape):
        raise ShapeError(f"index has {len(index)} entries for the {len(shape)} axes of {fmt(shape)}")
    out = []
    for axis, (d, entry) in enumerate(zip(shape, index)):
        if entry is None:
            out.append(d)
            continue
        if isinstance(d, str):
            raise ShapeError(f"axis {axis} has the symbolic dim {d}: it can only be taken whole (`:`)")
        start, stop, step = entry
        r = range(start, stop, step) if step else None
        if r is None or (len(r) and not (0 <= r[0] < d and 0 <= r[-1] < d)) or (step > 0 and stop < 0):
            raise ShapeError(f"axis {axis}: range {start}:{stop}:{step} does not lie within a dim of {d}")
        out.append(len(r))
    return tuple(out)


def _slice_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    return sliced_shape(shape, tuple(attrs["index"])), dtypes[0]


def _slice_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    return [ctx.emit("slice_grad", [g], index=ctx.graph.attrs(n)["index"], shape=ctx.graph.shape(x))]


def _slice_evaluate(attrs, values, out_shape, dims):
    return np.array(values[0][np_index(attrs["index"])], copy=True)


def _slice_rows(graph, n, ins, fail):
    (a,) = ins
    if a is not None and graph.attrs(n)["index"][a] is not None:
        fail("slices the batch dim")
    return a


register(Op("slice", "layout", _slice_infer, _slice_evaluate,
            lambda attrs, in_shapes, out_shape: 0, vjp=_slice_vjp, arity=1, rows=_slice_rows,
            batched=unary(index=lambda index, k: (None,) + tuple(index)),
            cpu=lambda s: _slice_cpu(s), cuda=lambda s: _slice_cuda(s),
            doc="x[start:stop:step, ...] with static ranges per axis (attrs index); a copy"))


def _slice_grad_infer(attrs, shapes, dtypes):
    (g,) = shapes
    if not dtypes[0].startswith("float"):
        raise ShapeError(f"operand of dtype {dtypes[0]}: slice_grad takes a float adjoint")
    target = tuple(attrs["shape"])
    expected = sliced_shape(target, tuple(attrs["index"]))
    if tuple(g) != expected:
        raise ShapeError(f"adjoint has shape {fmt(g)}, expected {fmt(expected)}")
    return target, dtypes[0]


def _slice_grad_evaluate(attrs, values, out_shape, dims):
    (g,) = values
    out = np.zeros(out_shape, dtype=g.dtype)
    out[np_index(attrs["index"])] = g
    return out


def _slice_grad_vjp(ctx, n, g):
    return [ctx.emit("slice", [g], index=ctx.graph.attrs(n)["index"])]


register(Op("slice_grad", "layout", _slice_grad_infer, _slice_grad_evaluate,
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_slice_grad_vjp, arity=1, rows=_slice_rows,
            cpu=lambda s: _slice_grad_cpu(s), cuda=lambda s: _slice_grad_cuda(s),
            doc="zeros of attrs shape with g written at the slice attrs index: slice's adjoint"))


def _one_range(index):
    """(axis, start, stop) when the index takes a unit-step range of one axis and every other whole, else None."""
    ranged = [(a, e) for a, e in enumerate(index) if e is not None]
    if len(ranged) != 1 or ranged[0][1][2] != 1 or ranged[0][1][1] <= ranged[0][1][0]:
        return None   # (an empty range, 5:2 included, joins nothing)
    axis, (start, stop, _) = ranged[0]
    return axis, start, stop


def merge_adjacent_slice_grads(graph, n):
    """In a sum of adjoints (a tree of adds read once each, n its root), slice_grads whose unit-step ranges
    of one axis touch join into one slice_grad of their concat, or the concat itself where they cover the
    axis: the adjoint of the slices an LSTM takes of its gates' pre-activation, z[:, 0:H] ... z[:, 3H:4H],
    was four zeroed (B, 4H) buffers summed, and is one concat now, in whatever order the sum adds them.
    n is rewritten in place (or the one value it sums to returned); None where nothing joins."""
    shape, users = graph.shape(n), graph.users(n)
    if len(users) == 1 and graph.op(users[0]) == "add" and graph.shape(users[0]) == shape:
        return None   # not the root: the root's visit joins the whole tree
    leaves, stack = [], list(reversed(graph.operands(n)))
    while stack:
        v = stack.pop()
        if graph.op(v) == "add" and graph.shape(v) == shape and len(graph.users(v)) == 1:
            stack.extend(reversed(graph.operands(v)))
        else:
            leaves.append(v)
    ranges = {}   # axis -> [(start, stop, slice_grad)]
    for v in leaves:
        r = (_one_range(tuple(graph.attrs(v)["index"])) if graph.op(v) == "slice_grad" and graph.shape(v) == shape
             and graph.dtype(v) == graph.dtype(n) and leaves.count(v) == 1 and len(graph.users(v)) == 1 else None)
        if r is not None:
            ranges.setdefault(r[0], []).append((r[1], r[2], v))
    runs = []   # (axis, [(start, stop, slice_grad), ...]) of two or more touching ranges
    for axis, pieces in ranges.items():
        pieces.sort(key=lambda p: p[:2])
        run = [pieces[0]]
        for piece in pieces[1:]:
            if piece[0] == run[-1][1]:
                run.append(piece)
                continue
            runs += [(axis, run)] if len(run) > 1 else []
            run = [piece]
        runs += [(axis, run)] if len(run) > 1 else []
    if not runs:
        return None
    node = graph.node(n)
    made = lambda op, ins, attrs: graph.apply(op, ins, attrs, phase=node["phase"], src=node["src"], of=node.get("of"))
    joined = {v for _, run in runs for *_, v in run}
    terms = [v for v in leaves if v not in joined]
    for axis, run in runs:
        whole = made("concat", [graph.operands(v)[0] for *_, v in run], {"axis": axis})
        start, stop = run[0][0], run[-1][1]
        if (start, stop) != (0, shape[axis]):
            index = tuple((start, stop, 1) if k == axis else None for k in range(len(shape)))
            whole = made("slice_grad", [whole], {"index": index, "shape": tuple(shape)})
        terms.append(whole)
    if len(terms) == 1:
        return terms[0]
    total = terms[0]
    for v in terms[1:-1]:
        total = made("add", [total, v], {})
    graph.set_operands(n, [total, terms[-1]])
    return n


# ---- lowering -------------------------------------------------------------------------------------
def index_src(index):
    """The index expression of attrs["index"] in generated code (numpy's slicing, which Numba compiles)."""
    parts = []
    for entry in index:
        if entry is None:
            parts.append(":")
            continue
        start, stop, step = entry
        if not len(range(start, stop, step)):
            parts.append("0:0")
        elif stop < 0:
            parts.append(f"{start}::{step}")
        else:
            parts.append(f"{start}:{stop}:{step}")
    return ", ".join(parts)


def _slice_cpu(s):
    """A copy of the slice into its buffer (an int value's is its own: passes/storage.in_arena)."""
    return [s.alloc(), s.copy(s.out, f"{s.args[0]}[{index_src(s.attrs['index'])}]") + s.note]


def _slice_grad_cpu(s):
    return [s.alloc(), f"{s.out}[:] = 0.0", s.copy(f"{s.out}[{index_src(s.attrs['index'])}]", s.args[0]) + s.note]


def _cuda_slice_source(name, index):
    """One thread per output element, reading the element it copies."""
    rank = len(index)
    src = [f"i{a}" if e is None else f"{e[0]} + i{a} * {e[2]}" for a, e in enumerate(index)]
    lines = [f"def {name}(x0, out):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return"]
    lines += unravel(rank)
    lines.append(f"    out[{kindex([f'i{a}' for a in range(rank)], '0')}] = x0[{kindex(src, '0')}]")
    return "\n".join(lines), f"out = x0[{index_src(index)}]", ("flat", -1)


def _cuda_slice_grad_source(name, index):
    """One thread per output element: g's element where the slice took it, else 0."""
    rank = len(index)
    lines = [f"def {name}(g, out):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return"]
    lines += unravel(rank)
    conds, src = [], []
    for a, e in enumerate(index):
        if e is None:
            src.append(f"i{a}")
            continue
        start, stop, step = e
        count = len(range(start, stop, step))
        d = f"(i{a} - {start})" if step > 0 else f"({start} - i{a})"
        conds.append(f"{d} >= 0 and {d} % {abs(step)} == 0 and {d} // {abs(step)} < {count}")
        src.append(f"{d} // {abs(step)}")
    out = f"out[{kindex([f'i{a}' for a in range(rank)], '0')}]"
    lines.append(f"    if {' and '.join(conds) or 'True'}:")
    lines.append(f"        {out} = g[{kindex(src, '0')}]")
    lines += ["    else:", f"        {out} = 0.0"]
    return "\n".join(lines), f"out = zeros; out[{index_src(index)}] = g", ("flat", -1)


def _slice_cuda(s):
    index = tuple(s.attrs["index"])
    return s.into_out(s.kernel(("slice", index), "slice", lambda kname: _cuda_slice_source(kname, index)))


def _slice_grad_cuda(s):
    index = tuple(s.attrs["index"])
    return s.into_out(s.kernel(("slice_grad", index), "slice_grad", lambda kname: _cuda_slice_grad_source(kname, index)))
