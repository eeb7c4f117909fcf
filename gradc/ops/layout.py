"""The ops that only move data: transpose, reshape, transfer (a copy between devices)."""
import numpy as np

from . import Op, register
from .batched import shifted, unary
from .elementwise import X
from .kernel_text import index, unravel
from ..errors import ShapeError
from ..shapes import fmt, reshape_target, size


def _transpose_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    axes = tuple(attrs["axes"])
    if sorted(axes) != list(range(len(shape))):
        raise ShapeError(f"axes {axes} are not a permutation of the {len(shape)} axes of {fmt(shape)}")
    return tuple(shape[i] for i in axes), dtypes[0]


def _transpose_vjp(ctx, n, g):
    axes = ctx.graph.attrs(n)["axes"]
    return [ctx.emit("transpose", [g], axes=tuple(int(i) for i in np.argsort(axes)))]


def cuda_transpose_source(name, axes):
    """One thread per output element."""
    rank = len(axes)
    source = [f"def {name}(x0, out):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return"]
    source += unravel(rank)
    source.append(f"    out[{index([f'i{d}' for d in range(rank)], '0')}] = "
                  f"x0[{index([f'i{axes.index(d)}' for d in range(rank)], '0')}]")
    return "\n".join(source), f"out = x0.transpose{axes}", ("flat", -1)


def _transpose_cuda(s):
    axes = tuple(s.attrs["axes"])
    return s.into_out(s.kernel(("transpose", axes), "transpose", lambda kname: cuda_transpose_source(kname, axes)))


def _transpose_simplify(graph, n):
    """transpose(transpose(x)) -> one transpose of x; the identity permutation -> x; the transpose of a
    product only it reads -> the product the other way round, (A B)^T = B^T A^T, by transpose flags (the
    gradient of a weight used as W.T was a product, then a copy of the weight's size)."""
    (u,) = graph.operands(n)
    if graph.op(u) == "matmul" and tuple(graph.attrs(n)["axes"]) == (1, 0) and graph.users(u) == [n]:
        a, b = graph.operands(u)
        attrs = graph.attrs(u)
        node = graph.node(n)
        node["op"] = "matmul"
        node["attrs"] = {"transpose_a": not attrs.get("transpose_b", False),
                         "transpose_b": not attrs.get("transpose_a", False)}
        graph.set_operands(n, [b, a])
        return n
    rewritten = graph.op(u) == "transpose"
    if rewritten:
        inner, outer = graph.attrs(u)["axes"], graph.attrs(n)["axes"]
        graph.attrs(n)["axes"] = tuple(inner[i] for i in outer)
        graph.set_operands(n, graph.operands(u))
    if tuple(graph.attrs(n)["axes"]) == tuple(range(len(graph.shape(n)))):
        return graph.operands(n)[0]
    return n if rewritten else None


register(Op("transpose", "layout", _transpose_infer,
            lambda attrs, values, out_shape, dims: np.transpose(values[0], attrs["axes"]),
            lambda attrs, in_shapes, out_shape: 0, vjp=_transpose_vjp, arity=1,
            rows=lambda graph, n, ins, fail: list(graph.attrs(n)["axes"]).index(ins[0]),
            batched=unary(axes=lambda axes, k: (0,) + shifted(axes)),
            cpu=lambda s: [s.alloc(), s.copy(s.out, f"np.transpose({s.args[0]}, {tuple(s.attrs['axes'])})") + s.note],
            cuda=_transpose_cuda, simplify=_transpose_simplify))


def _reshape_infer(attrs, shapes, dtypes):
    (shape,) = shapes
    return reshape_target(shape, attrs["shape"]), dtypes[0]


def _reshape_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    return [ctx.emit("reshape", [g], shape=ctx.graph.shape(x))]


def _reshape_rows(graph, n, ins, fail):
    """Rows survive a reshape that keeps them an axis of their own with as many elements before it: a
    flatten of the dims after them, or a time step (1, B, H) of a time-major sequence seen as (B, H)."""
    (x,), shape = graph.operands(n), graph.shape(n)
    w, xs = ins[0], graph.shape(x)
    if isinstance(w, int):
        for j, d in enumerate(shape):
            if d == xs[w] and size(shape[:j]) == size(xs[:w]):
                return j
    fail("reshapes the batch dim away")


def _reshape_cpu(s):
    """A view where numpy gives one; a scalar becomes a local, and a local fills an array."""
    if s.operand_shape(0) == ():
        return [s.alloc(), f"{s.out}[:] = {s.args[0]}{s.note}"]
    if s.shape == ():
        return [f"{s.out} = {s.args[0]}.reshape(-1)[0]{s.note}"]
    return [f"{s.out} = {s.args[0]}.reshape({s.shape_src(s.shape)}){s.note}"]


def _reshape_cuda(s):
    """A view of the device array; a one-element array is copied into an array of its own shape."""
    if s.operand_shape(0) == ():
        return [s.alloc(), s.call(s.kernels.elementwise(X[0], [None], len(s.shape), "copy"), s.args + [s.out]) + s.note]
    if s.shape == ():
        return [f"{s.out} = {s.args[0]}.reshape(1){s.note}"]
    return [f"{s.out} = {s.args[0]}.reshape({s.shape_src(s.shape)}){s.note}"]


def _reshape_simplify(graph, n):
    """reshape(reshape(x)) -> reshape(x); a reshape to x's own shape -> x."""
    (u,) = graph.operands(n)
    rewritten = graph.op(u) == "reshape"
    if rewritten:
        graph.set_operands(n, graph.operands(u))
    (u,) = graph.operands(n)
    if graph.shape(u) == graph.shape(n):
        return u
    return n if rewritten else None


# a view of its operand's buffer (passes/storage.py), so never handed out as it is (a copy is)
register(Op("reshape", "layout", _reshape_infer,
            lambda attrs, values, out_shape, dims: np.reshape(values[0], out_shape),
            lambda attrs, in_shapes, out_shape: 0, vjp=_reshape_vjp, arity=1, rows=_reshape_rows,
            batched=unary(shape=lambda shape, k: (k,) + tuple(shape)),
            cpu=_reshape_cpu, cuda=_reshape_cuda, simplify=_reshape_simplify, view=True))


def _transfer_vjp(ctx, n, g):
    attrs = ctx.graph.attrs(n)
    return [ctx.emit("transfer", [g], source=attrs["target"], target=attrs["source"])]


def _transfer_note(s):
    return f"  # transfer {s.attrs['source']} -> {s.attrs['target']}, {s.graph.node(s.n)['src']}"


def _transfer_cpu(s):
    """Devices are regions of one host arena: the copy is the transfer."""
    if s.shape == ():
        return [f"{s.out} = {s.args[0]}{_transfer_note(s)}"]
    return [s.alloc(), s.copy(s.out, s.args[0]) + _transfer_note(s)]


def _transfer_cuda(s):
    """Virtual devices share one device's memory: the copy is the transfer."""
    pattern = [None] if s.shape == () else [tuple(range(len(s.shape)))]
    copy = s.kernels.elementwise(X[0], pattern, max(len(s.shape), 1), "copy")
    return [s.alloc(), s.call(copy, s.args + [s.out]) + _transfer_note(s)]


register(Op("transfer", "layout", lambda attrs, shapes, dtypes: (shapes[0], dtypes[0]),
            lambda attrs, values, out_shape, dims: np.array(values[0], copy=True),
            lambda attrs, in_shapes, out_shape: 0, vjp=_transfer_vjp, arity=1,
            rows=lambda graph, n, ins, fail: ins[0], cpu=_transfer_cpu, cuda=_transfer_cuda,
            doc="the operand's value copied from device `source` to device `target`"))
