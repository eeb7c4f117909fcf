"""softmax and log_softmax along one axis, computed with the max subtracted first."""
import numpy as np

from . import Op, register
from .batched import unary
from .kernel_text import index, kept_index, loops, dims_line
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


def _softmax_rows(graph, n, ins, fail):
    if graph.attrs(n)["axis"] % len(graph.shape(n)) == ins[0]:
        fail("normalises over rows")
    return ins[0]


def cpu_softmax_source(name, op, rank, axis):
    kept = [d for d in range(rank) if d != axis]
    pad = "    " * (1 + len(kept))
    idx = index([f"i{d}" for d in range(rank)])
    lines = [f"def {name}(x0, out):"] + dims_line("x0", rank)
    lines += loops(kept, ["m = -math.inf"])
    lines += loops([axis], [f"v = x0[{idx}]", "if v > m or v != v:", "    m = v"], indent=1 + len(kept))
    lines.append(f"{pad}total = 0.0")
    if op == "log_softmax":
        lines += loops([axis], [f"total += math.exp(x0[{idx}] - m)"], indent=1 + len(kept))
        lines.append(f"{pad}log_total = math.log(total)")   # (x - m) - log_total: m + log_total would round off
        lines += loops([axis], [f"out[{idx}] = (x0[{idx}] - m) - log_total"], indent=1 + len(kept))
    else:   # one exp per element, kept in out until the total is known
        lines += loops([axis], [f"e = math.exp(x0[{idx}] - m)", f"out[{idx}] = e", "total += e"], indent=1 + len(kept))
        lines.append(f"{pad}scale = 1.0 / total")
        lines += loops([axis], [f"out[{idx}] = out[{idx}] * scale"], indent=1 + len(kept))
    return "\n".join(lines), f"{op} along axis {axis} (max subtracted first)"


def cuda_softmax_source(name, op, rank, axis):
    """One thread per index over the other axes."""
    kept = [d for d in range(rank) if d != axis]
    idx = index([f"i{d}" for d in range(rank)], "0")
    lines = [f"def {name}(x0, out):"] + kept_index(kept)
    lines += ["    m = -math.inf", f"    for i{axis} in range(x0.shape[{axis}]):", f"        v = x0[{idx}]",
              "        if v > m or v != v:", "            m = v", "    total = 0.0",
              f"    for i{axis} in range(x0.shape[{axis}]):", f"        total += math.exp(x0[{idx}] - m)"]
    if op == "log_softmax":
        lines += ["    log_total = math.log(total)", f"    for i{axis} in range(x0.shape[{axis}]):",
                  f"        out[{idx}] = (x0[{idx}] - m) - log_total"]
    else:
        lines += ["    scale = 1.0 / total", f"    for i{axis} in range(x0.shape[{axis}]):",
                  f"        out[{idx}] = math.exp(x0[{idx}] - m) * scale"]
    return "\n".join(lines), f"{op} along axis {axis} (max subtracted first)", ("rows", 0, (axis,))


def _lowering(source):
    def lower(s):
        rank, axis = len(s.shape), s.attrs["axis"]
        return s.into_out(s.kernel((s.op, rank, axis), f"{s.op}_along_{axis}",
                                   lambda kname: source(kname, s.op, rank, axis)))
    return lower


def _softmax_op(name, evaluate, vjp):
    return Op(name, "nn", _axis_infer, evaluate, _softmax_flops, vjp=vjp, arity=1, rows=_softmax_rows,
              batched=unary(axis=lambda axis, k: axis + 1),
              cpu=_lowering(cpu_softmax_source), cuda=_lowering(cuda_softmax_source))


register(_softmax_op("softmax", lambda attrs, values, out_shape, dims: np.exp(_np_log_softmax(values[0], attrs["axis"])),
                     _softmax_vjp))
register(_softmax_op("log_softmax", lambda attrs, values, out_shape, dims: _np_log_softmax(values[0], attrs["axis"]),
                     _log_softmax_vjp))
