"""Label ops: picking each row's label (pick), its adjoint (pick_grad), and softmax cross-entropy
as one op per direction (softmax_xent, softmax_xent_grad), so each target runs one fused kernel.
On CUDA a label out of range gives NaN, never a read outside the row."""
import numpy as np

from . import Op, register
from .batched import every_copy
from .kernel_text import (ROW_HEADER, dims_line, index, kept_index, loops, row_max_and_exp_into_out,
                          row_max_and_sum_exp, unravel, xent_grad_row, xent_grad_row_from_out)
from .softmax import _np_log_softmax
from ..errors import ShapeError
from ..shapes import size


def _row_wise(graph, n, ins, fail):
    """Element i of the labels picks from row i of the values' last axis: the rows go through on any
    other axis the two share."""
    x, labels = ins[:2]
    if x is not None and x < len(graph.shape(graph.operands(n)[0])) - 1 and labels in (x, None):
        return x
    fail("picks across rows")


def _row_wise_grad(graph, n, ins, fail):
    """Row i of the result reads element i of the labels and of g (and row i of the values)."""
    axes = {w for w in ins if w is not None}
    if len(axes) == 1 and next(iter(axes)) < len(graph.shape(n)) - 1:
        return axes.pop()
    fail("picks across rows")


def _label_bound(graph, n):
    """The labels (operand 1) pick one of the values' last axis."""
    return 1, graph.shape(graph.operands(n)[0])[-1]


def _lowering(key, source):
    """One kernel per module (it takes every shape), writing the node's buffer."""
    def lower(s):
        return s.into_out(s.kernel((key,), key, source))
    return lower


def _rank_lowering(key, source, values_shape):
    """One kernel per rank of the values (values_shape(statement): pick's operand, pick_grad's result),
    writing the node's buffer."""
    def lower(s):
        rank = len(values_shape(s))
        return s.into_out(s.kernel((key, rank), key, lambda name: source(name, rank)))
    return lower


_operand_shape = lambda s: s.operand_shape(0)
_result_shape = lambda s: s.shape


# the module checks labels at call time; the kernels still never read or write outside a row (a NaN loss)
def cpu_pick_source(name, rank):
    """out[i...] = x0[i..., labels[i...]] over every axis of the labels (the values' but the last)."""
    lead = [f"i{d}" for d in range(rank - 1)]
    body = [f"label = labels[{index(lead)}]",
            f"out[{index(lead)}] = x0[{index(lead + ['label'])}] if 0 <= label < x0.shape[{rank - 1}] else math.nan"]
    return ("\n".join([f"def {name}(x0, labels, out):"] + dims_line("labels", rank - 1) + loops(range(rank - 1), body)),
            "out[i] = x0[i, labels[i]]")


def cuda_pick_source(name, rank):
    lead = [f"i{d}" for d in range(rank - 1)]
    return ("\n".join([f"def {name}(x0, labels, out):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return",
                       *unravel(rank - 1), f"    label = labels[{index(lead)}]",
                       f"    out[{index(lead)}] = x0[{index(lead + ['label'])}] if 0 <= label < x0.shape[{rank - 1}] "
                       f"else math.nan   # never a wild read"]),
            "out[i] = x0[i, labels[i]]", ("flat", -1))


def cpu_pick_grad_source(name, rank):
    """Every element written (zeros off the label), none outside a row."""
    lead = [f"i{d}" for d in range(rank - 1)]
    body = [f"label = labels[{index(lead)}]", f"for c in range(out.shape[{rank - 1}]):",
            f"    out[{index(lead + ['c'])}] = g[{index(lead)}] if c == label else 0.0"]
    return ("\n".join([f"def {name}(g, labels, out):"] + dims_line("labels", rank - 1) + loops(range(rank - 1), body)),
            "out[i, labels[i]] = g[i], zeros elsewhere")


def cuda_pick_grad_source(name, rank):
    lead = [f"i{d}" for d in range(rank - 1)]
    return ("\n".join([f"def {name}(g, labels, out):", *kept_index(range(rank - 1), "out"),
                       f"    label = labels[{index(lead)}]", f"    for c in range(out.shape[{rank - 1}]):",
                       f"        out[{index(lead + ['c'])}] = g[{index(lead)}] if c == label else 0.0"]),
            "out[i, labels[i]] = g[i], zeros elsewhere", ("rows", -1, (rank - 1,)))


CPU_XENT_ROWS = lambda name: ("\n".join([
    f"def {name}(x0, labels, out):", "    for i in range(x0.shape[0]):", *row_max_and_sum_exp("        "),
    "        label = labels[i]",
    "        out[i] = (m - x0[i, label]) + math.log(total) if 0 <= label < x0.shape[1] else math.nan"]),
    "out[i] = logsumexp(x[i]) - x[i, labels[i]]")
CUDA_XENT_ROWS = lambda name: ("\n".join([
    f"def {name}(x0, labels, out):", *ROW_HEADER, *row_max_and_sum_exp("    "),
    "    label = labels[i]",
    "    # a label out of range (only device labels reach here unchecked) gives NaN, never a wild read",
    "    out[i] = (m - x0[i, label]) + math.log(total) if 0 <= label < x0.shape[1] else math.nan"]),
    "out[i] = logsumexp(x[i]) - x[i, labels[i]]", ("flat", -1))
CPU_XENT_GRAD = lambda name: ("\n".join([
    f"def {name}(x0, labels, g, out):", "    for i in range(x0.shape[0]):", *row_max_and_exp_into_out("        "),
    *xent_grad_row_from_out("        ")]), "out[i] = (softmax(x[i]) - onehot(labels[i])) * g[i]")
CUDA_XENT_GRAD = lambda name: ("\n".join([
    f"def {name}(x0, labels, g, out):", *ROW_HEADER, *row_max_and_sum_exp("    "), *xent_grad_row("    ")]),
    "out[i] = (softmax(x[i]) - onehot(labels[i])) * g[i]", ("rows", 0, (1,)))


def _pick_infer(attrs, shapes, dtypes):
    (x, labels), (dx, dl) = shapes, dtypes
    if len(x) < 2 or len(labels) != len(x) - 1:
        raise ShapeError(f"needs (..., C) values and (...) labels, got {x} and {labels}")
    if not dl.startswith("int"):
        raise ShapeError(f"labels must be integers, got {dl}")
    if tuple(x[:-1]) != tuple(labels):
        raise ShapeError(f"values {x} need labels of shape {tuple(x[:-1])}, got {labels}")
    return tuple(labels), dx


def _pick_vjp(ctx, n, g):
    x, labels = ctx.graph.operands(n)
    return [ctx.emit("pick_grad", [g, labels], num_classes=ctx.graph.shape(x)[-1]), None]


def _pick_batched(graph, n, operands, lifted, emit):
    """Each copy's values pick with its own labels (a shared operand is given to each copy)."""
    return emit("pick", every_copy(graph, operands, lifted, emit), **graph.attrs(n))


def _xent_batched(graph, n, operands, lifted, emit):
    """Its kernels take (N, C): per copy, the log_softmax and the pick it stands for."""
    x, labels = every_copy(graph, operands, lifted, emit)
    return emit("neg", [emit("pick", [emit("log_softmax", [x], axis=2), labels])])


register(Op("pick", "nn", _pick_infer,
            lambda attrs, values, out_shape, dims: np.take_along_axis(values[0], values[1][..., None], -1)[..., 0],
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_pick_vjp, arity=2, rows=_row_wise,
            batched=_pick_batched,
            cpu=_rank_lowering("pick", cpu_pick_source, _operand_shape),
            cuda=_rank_lowering("pick", cuda_pick_source, _operand_shape),
            indexes=_label_bound,
            doc="out[i] = x[i, labels[i]]"))


def _pick_grad_infer(attrs, shapes, dtypes):
    (g, labels) = shapes
    return tuple(g) + (attrs["num_classes"],), dtypes[0]


def _pick_grad_evaluate(attrs, values, out_shape, dims):
    g, labels = values
    out = np.zeros(out_shape, dtype=g.dtype)
    np.put_along_axis(out, labels[..., None], g[..., None], -1)
    return out


def _pick_grad_vjp(ctx, n, g):
    _, labels = ctx.graph.operands(n)
    return [ctx.emit("pick", [g, labels]), None]


register(Op("pick_grad", "nn", _pick_grad_infer, _pick_grad_evaluate,
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_pick_grad_vjp, arity=2, rows=_row_wise_grad,
            cpu=_rank_lowering("pick_grad", cpu_pick_grad_source, _result_shape),
            cuda=_rank_lowering("pick_grad", cuda_pick_grad_source, _result_shape),
            doc="out[i, labels[i]] = g[i], zeros elsewhere"))


# ---- softmax cross-entropy ------------------------------------------------------------------
def _xent_infer(attrs, shapes, dtypes):
    (x, labels), (dx, dl) = shapes[:2], dtypes[:2]
    if len(x) != 2:   # its kernels take rows; softmax_cross_entropy makes higher ranks of pick and log_softmax
        raise ShapeError(f"needs (N, C) logits, got {x}")
    _pick_infer(attrs, [x, labels], [dx, dl])
    if not dx.startswith("float"):
        raise ShapeError(f"logits of dtype {dx} are not float")
    return (x[0],), dx


def _xent_evaluate(attrs, values, out_shape, dims):
    x, labels = values
    m = np.max(x, axis=1, keepdims=True)   # (m - x[label]) + log(sum): m + log(sum) would round off
    return (m - np.take_along_axis(x, labels[:, None], 1))[:, 0] + np.log(np.sum(np.exp(x - m), axis=1))


def _xent_vjp(ctx, n, g):
    x, labels = ctx.graph.operands(n)
    return [ctx.emit("softmax_xent_grad", [x, labels, g]), None]


register(Op("softmax_xent", "nn", _xent_infer, _xent_evaluate,
            lambda attrs, in_shapes, out_shape: 5 * size(in_shapes[0]), vjp=_xent_vjp, arity=2, rows=_row_wise,
            batched=_xent_batched,
            cpu=_lowering("xent_rows", CPU_XENT_ROWS), cuda=_lowering("xent_rows", CUDA_XENT_ROWS), indexes=_label_bound,
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
            lambda attrs, in_shapes, out_shape: 6 * size(out_shape), vjp=_xent_grad_vjp, arity=3, rows=_row_wise_grad,
            cpu=_lowering("xent_grad", CPU_XENT_GRAD), cuda=_lowering("xent_grad", CUDA_XENT_GRAD), indexes=_label_bound,
            doc="out[i] = (softmax(x[i]) - onehot(labels[i])) * g[i]: softmax_xent's adjoint"))
