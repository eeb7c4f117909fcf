"""Reductions over axes: sum, mean, max; and the helpers their VJPs build (argmax_mask, count)."""
import math

import numpy as np

from . import Op, register
from .batched import shifted, unary
from .kernel_text import block_sum, dims_line, index, kept_index, loops, unravel, unravel_dims
from ..runtime.cuda import THREADS
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


def reduce_rows(graph, n, ins, fail, op=None):
    """Reducing over the rows ends them (the loss's reduction); over other axes they stay. `op`: the
    reduction n is (a fused one's plain sum, mean or max), n's own op by default."""
    axes, (a,), op = tuple(graph.attrs(n)["axes"]), ins, op or graph.op(n)
    if a in axes:
        if op == "max":
            fail("takes a max over rows")
        return ("reduced", op)
    return a if graph.attrs(n).get("keepdims") else a - sum(1 for x in axes if x < a)


# ---- CPU: loops in memory order; a reduction of every axis returns a number. A sum into a number or
# over the last axis runs in float64 whatever the dtype: a float32 running sum loses digits in proportion
# to its length (1e-4 of a mean of 2e6 values), where torch's cascaded sums keep about 1e-7. A sum that
# keeps the last axis (a bias gradient) adds into out, in its dtype ----------------------------------
def cpu_reduction_source(name, op, rank, axes, keepdims):
    scalar = len(axes) == rank and not keepdims
    kept = [d for d in range(rank) if d not in axes]
    out_idx = index(["0" if (d in axes) else f"i{d}" for d in range(rank)] if keepdims else [f"i{d}" for d in kept])
    count = " * ".join(f"n{d}" for d in axes) or "1"
    lines = [f"def {name}(x0{'' if scalar else ', out'}):"] + dims_line("x0", rank)
    read = f"x0[{index([f'i{d}' for d in range(rank)])}]" if rank else "x0[()]"
    if op in ("sum", "mean"):
        last = rank - 1
        if last in axes and len(axes) >= 2:
            # the last axis and others reduced: each kept index sums its rows into a row of partial sums,
            # elementwise (it vectorises, where one running sum would not without reassociation; the
            # partial sums are shorter, so rounding is smaller too), then that row into one number
            outer = [d for d in axes if d != last]
            lines.append(f"    row = np.empty(n{last}, dtype=np.float64)")
            body = ["row[:] = 0.0"] + loops(outer + [last], [f"row[i{last}] += {read}"], indent=0)
            body += ["acc = 0.0", f"for i{last} in range(n{last}):", f"    acc += row[i{last}]"]
            result = f"acc{' / (' + count + ')' if op == 'mean' else ''}"
            lines += loops(kept, body + [f"return {result}" if scalar else f"out[{out_idx}] = {result}"])
            return "\n".join(lines), f"{op} over axes {tuple(axes)}"
        if scalar:   # a vector, or a () value
            lines += ["    " + line for line in (_lane_sum(0) if rank else ["acc = 0.0", f"acc += {read}"])]
            lines.append(f"    return acc{' / (' + count + ')' if op == 'mean' else ''}")
        elif tuple(axes) == (last,):   # one running sum per result
            lines += loops(kept, _lane_sum(last) + [f"out[{out_idx}] = acc{' / (' + count + ')' if op == 'mean' else ''}"])
        else:
            # memory order: the innermost loop runs along contiguous data, into out (float64 sums would
            # need an array of their own at each call: a step allocates nothing)
            lines.append("    out[:] = 0.0")
            lines += loops(range(rank), [f"out[{out_idx}] += {read}"])
            if op == "mean":
                lines.append(f"    out *= 1.0 / ({count})")
        return "\n".join(lines), f"{op} over axes {tuple(axes)}"
    # max: kept dims outside, reduced dims inside; NaN wins, as in numpy and PyTorch
    update = [f"v = {read}", "if v > m or v != v:", "    m = v"]
    if scalar:
        lines.append("    m = -math.inf")
        lines += loops(range(rank), update)
        lines.append("    return m")
    else:
        lines += loops(kept, ["m = -math.inf"])
        lines += loops(axes, update, indent=1 + len(kept))
        lines.append("    " * (1 + len(kept)) + f"out[{out_idx}] = m")
    return "\n".join(lines), f"max over axes {tuple(axes)}"


def _lane_sum(last):
    """Lines summing x0[i0, ..., :] along its last axis into acc, in four running sums: one would wait
    for each add before the next (a chain of float64 adds, ~3x slower on long rows)."""
    at = lambda k: f"x0[{index([f'i{d}' for d in range(last)] + [f'i{last} + {k}' if k else f'i{last}'])}]"
    return ["a0 = a1 = a2 = a3 = 0.0", f"stop = n{last} - n{last} % 4", f"for i{last} in range(0, stop, 4):",
            *[f"    a{k} += {at(k)}" for k in range(4)], f"for i{last} in range(stop, n{last}):", f"    a0 += {at(0)}",
            "acc = (a0 + a1) + (a2 + a3)"]


def _reduction_key(s):
    rank, axes, keepdims = len(s.operand_shape(0)), tuple(s.attrs["axes"]), s.attrs.get("keepdims", False)
    return ("reduce", s.op, rank, axes, keepdims), f"{s.op}_over_{'_'.join(map(str, axes))}", (s.op, rank, axes, keepdims)


def _reduction_cpu(s):
    key, name, spec = _reduction_key(s)
    kernel = s.kernel(key, name, lambda kname: cpu_reduction_source(kname, *spec))
    if s.shape == ():
        return [f"{s.out} = {s.call(kernel, s.args)}{s.note}"]
    return s.into_out(kernel)


# ---- CUDA: each kept index folded by several threads; every axis reduced (a loss) is one block ------
def cuda_reduction_source(name, op, rank, axes, keepdims):
    """Launched as ("folds", 0, axes) (gradc/runtime/cuda.py's `folds`): the block's fold lanes share
    each kept index's reduced elements (strided), then fold their partials as a tree in shared memory.
    One thread per kept index left a few long sums (a bias gradient over K*B rows) to a few threads."""
    kept = [d for d in range(rank) if d not in axes]
    if not kept:
        return _cuda_full_reduction_source(name, op, rank, keepdims)
    fold_x = rank - 1 in axes   # warps along memory: fold lanes in x when the last axis is reduced
    fold_dim, kept_dim = ("x", "y") if fold_x else ("y", "x")
    lines = [f"def {name}(x0, out):", f"    partial = cuda.shared.array({THREADS}, float64)",
             f"    kept_lane = cuda.threadIdx.{kept_dim}", f"    fold_lane = cuda.threadIdx.{fold_dim}",
             f"    fold_lanes = cuda.blockDim.{fold_dim}",
             f"    i = cuda.blockIdx.x * cuda.blockDim.{kept_dim} + kept_lane",
             f"    count = {' * '.join(f'x0.shape[{d}]' for d in kept)}",
             "    if count == 0:   # (every thread of every block: none is left at a barrier)",
             "        return",
             f"    acc = {'-math.inf' if op == 'max' else '0.0'}", *unravel_dims(kept, "i", "x0.shape"),
             "    if i < count:",
             f"        for j in range(fold_lane, {' * '.join(f'x0.shape[{d}]' for d in axes) or '1'}, fold_lanes):",
             *unravel_dims(axes, "j", "x0.shape", "            ")]
    read = f"x0[{index([f'i{d}' for d in range(rank)], '0')}]"
    if op == "max":   # NaN wins, as in numpy
        lines += [f"            v = {read}", "            if v > acc or v != v:", "                acc = v"]
        combine = ["            b = partial[t + step]", "            if b > partial[t] or b != b:",
                   "                partial[t] = b"]
    else:
        lines.append(f"            acc += {read}")
        combine = ["            partial[t] += partial[t + step]"]
    lines += ["    t = kept_lane * fold_lanes + fold_lane   # one kept index's partials side by side",
              "    partial[t] = acc", "    cuda.syncthreads()", "    step = fold_lanes // 2", "    while step > 0:",
              "        if fold_lane < step:", *combine, "        cuda.syncthreads()", "        step //= 2"]
    result = "partial[t]" + (f" / ({' * '.join(f'x0.shape[{d}]' for d in axes) or '1'})" if op == "mean" else "")
    target = index(["0" if d in axes else f"i{d}" for d in range(rank)] if keepdims else [f"i{d}" for d in kept], "0")
    lines += ["    if fold_lane == 0 and i < count:", f"        out[{target}] = {result}"]
    return "\n".join(lines), f"{op} over axes {tuple(axes)}", ("folds", 0, tuple(axes))


def _cuda_full_reduction_source(name, op, rank, keepdims):
    if rank > 1:
        load = unravel(rank, "j", "x0.shape", "") + [f"xi = x0[{index([f'i{d}' for d in range(rank)])}]"]
    else:
        load = ["xi = x0[j]" if rank else "xi = x0[0]"]
    if op == "max":   # NaN wins, as in numpy
        lines = block_sum(load + ["if xi > acc or xi != xi:", "    acc = xi"], "-math.inf",
                          ["            b = partial[t + step]", "            if b > partial[t] or b != b:",
                           "                partial[t] = b"])
    else:
        lines = block_sum(load + ["acc += xi"])
    result = "partial[0]" + (" / x0.size" if op == "mean" else "")
    lines = [f"def {name}(x0, out):"] + lines + ["    if t == 0:", f"        out[{index(['0'] * rank, '0') if keepdims else '0'}] = {result}"]
    return "\n".join(lines), f"{op} of every element (one block)", ("block",)


def _reduction_cuda(s):
    key, name, spec = _reduction_key(s)
    return s.into_out(s.kernel(key, name, lambda kname: cuda_reduction_source(kname, *spec)))


def _over_no_axes(graph, n):
    """A reduction over no axes is its operand."""
    return graph.operands(n)[0] if not graph.attrs(n)["axes"] else None


def _infer_of(name):
    """The shape rule; a mean or max over no element (an axis of 0, an empty slice's) is refused: the one
    is nan whatever the model's values, the other has no value (a sum over nothing is 0)."""
    def infer(attrs, shapes, dtypes):
        out = _reduce_infer(attrs, shapes, dtypes)
        if name != "sum" and any(shapes[0][a] == 0 for a in attrs["axes"]):
            raise ShapeError(f"axes {tuple(attrs['axes'])} of the operand hold no element (a dim of 0): a {name} "
                             f"over nothing is {'nan' if name == 'mean' else 'undefined'}")
        return out
    return infer


def _reduction(name, fn, vjp):
    return Op(name, "reduce", _infer_of(name), _np_reduce(fn), _reduce_flops, vjp=vjp, arity=1, rows=reduce_rows, parts="rows",
              simplify=_over_no_axes, batched=unary(axes=lambda axes, k: shifted(axes)),
              cpu=_reduction_cpu, cuda=_reduction_cuda)


register(_reduction("sum", np.sum, _sum_vjp))
register(_reduction("mean", np.mean, _mean_vjp))
register(_reduction("max", np.max, _max_vjp))


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


def _mask_rows(graph, n, ins, fail):
    if ins[0] in tuple(graph.attrs(n)["axes"]):
        fail("takes a max over rows")
    return ins[0]


def cpu_argmax_source(name, rank, axes):
    kept = [d for d in range(rank) if d not in axes]
    pad = "    " * (1 + len(kept))
    read = f"x0[{index([f'i{d}' for d in range(rank)])}]"
    lines = [f"def {name}(x0, out):"] + dims_line("x0", rank) + ["    out[:] = 0.0"]
    lines += loops(kept, ["m = -math.inf", "found = False"] + [f"b{d} = 0" for d in axes])
    body = [f"v = {read}", "if not found or v > m:", "    m = v", "    found = True"] + [f"    b{d} = i{d}" for d in axes]
    lines += loops(axes, body, indent=1 + len(kept))
    lines.append(f"{pad}out[{index([f'b{d}' if d in axes else f'i{d}' for d in range(rank)])}] = 1.0")
    return "\n".join(lines), f"1 at the first maximum over axes {tuple(axes)}"


def cuda_argmax_source(name, rank, axes):
    kept = [d for d in range(rank) if d not in axes]
    idx = index([f"i{d}" for d in range(rank)], "0")
    src = [f"def {name}(x0, out):"] + kept_index(kept) + ["    m = -math.inf", "    found = False"] + [
        f"    b{d} = 0" for d in axes]
    src += [("    " * (1 + k)) + f"for i{d} in range(x0.shape[{d}]):" for k, d in enumerate(axes)]
    inner = "    " * (1 + len(axes))
    src += [f"{inner}out[{idx}] = 0.0", f"{inner}v = x0[{idx}]", f"{inner}if not found or v > m:",
            f"{inner}    m = v", f"{inner}    found = True"] + [f"{inner}    b{d} = i{d}" for d in axes]
    src.append(f"    out[{index([f'b{d}' if d in axes else f'i{d}' for d in range(rank)], '0')}] = 1.0")
    return "\n".join(src), f"1 at the first maximum over axes {tuple(axes)}", ("rows", 0, tuple(axes))


def _argmax_lowering(source):
    def lower(s):
        rank, axes = len(s.shape), tuple(s.attrs["axes"])
        name = f"first_max_over_{'_'.join(map(str, axes))}"
        return s.into_out(s.kernel(("argmax_mask", rank, axes), name, lambda kname: source(kname, rank, axes)))
    return lower


register(Op("argmax_mask", "reduce", _mask_infer,
            lambda attrs, values, out_shape, dims: first_max_mask(values[0], tuple(attrs["axes"])),
            _reduce_flops, vjp=lambda ctx, n, g: [None], arity=1, rows=_mask_rows,
            batched=unary(axes=lambda axes, k: shifted(axes)),
            cpu=_argmax_lowering(cpu_argmax_source), cuda=_argmax_lowering(cuda_argmax_source),
            doc="piecewise constant: its derivative is zero"))


def _count_infer(attrs, shapes, dtypes):
    return (), attrs.get("dtype", "float")


def _count_value(s):
    return f"float({' * '.join(s.dim(d) for d in s.attrs['dims']) or '1'})"


register(Op("count", "reduce", _count_infer,
            lambda attrs, values, out_shape, dims: np.asarray(
                float(math.prod(dims[d] if isinstance(d, str) else d for d in attrs["dims"]))),
            lambda attrs, in_shapes, out_shape: 0, vjp=lambda ctx, n, g: [], arity=0,
            cpu=lambda s: [f"{s.out} = {_count_value(s)}{s.note}"],
            cuda=lambda s: [s.alloc(), s.call(s.kernels.fill(), [s.out, _count_value(s)]) + s.note],
            doc="number of elements over attrs['dims'] (symbolic dims resolved at run time)"))
