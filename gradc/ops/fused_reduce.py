"""A sum, mean or max of an elementwise expression, in one loop: `fused_sum`, `fused_mean`, `fused_max`.

passes/fusion.py folds an elementwise value that only a reduction reads into that reduction (CPU builds):
the weight decay's sum of squares of a weight, a loss's mean of (y - t)**2, read each element of their
operands once and keep no buffer of the operand's size (a decayed 4096 x 4096 weight's square was a
64 MiB temporary). attrs: `expr` over X[0..k-1], the operands, which all have the reduced value's shape,
and the reduction's `axes` and `keepdims`. They are made after differentiation, lr_grad's copies and
simplification, on the CPU only, so they have no VJP, `batched`, `simplify` or CUDA lowering; nor `parts`:
a part run of a conv net ends before one (the plain sum it replaced could run inside).

A sum into a number or over the last axis runs in float64, as the plain reductions' do
(gradc/ops/reduce.py); the expression is computed in the build's float type, as its elementwise kernel
computed it.
"""
import numpy as np

from . import Op, register
from .elementwise import evaluate_expression, expression_name
from .reduce import reduce_rows
from .kernel_text import dims_line, index, loops
from ..errors import ShapeError
from ..shapes import reduced, size

BASE = {"fused_sum": "sum", "fused_mean": "mean", "fused_max": "max"}


def _infer(attrs, shapes, dtypes):
    shape = shapes[0]
    if any(s != shape for s in shapes) or any(not d.startswith("float") for d in dtypes):
        raise ShapeError(f"operands of shapes {shapes} and dtypes {dtypes}: a fused reduction reads float "
                         f"operands of one shape")
    axes = tuple(attrs["axes"])
    if not axes or any(not 0 <= a < len(shape) for a in axes):
        raise ShapeError(f"axes {axes} out of range for {shape}")
    return reduced(shape, axes, attrs.get("keepdims", False)), dtypes[0]


def _evaluate_of(name):
    fn = {"sum": np.sum, "mean": np.mean, "max": np.max}[BASE[name]]

    def evaluate(attrs, values, out_shape, dims):
        shape = np.shape(values[0])
        element = np.broadcast_to(evaluate_expression(attrs["expr"], values, shape), shape).astype(values[0].dtype)
        return np.asarray(fn(element, axis=tuple(attrs["axes"]), keepdims=attrs.get("keepdims", False)))
    return evaluate


def _flops(attrs, in_shapes, out_shape):
    return size(in_shapes[0]) * (1 + len(attrs["expr"].free_symbols))


def _rows(graph, n, ins, fail):
    """As the plain reduction's: every operand has the reduced value's shape, so its rows are theirs."""
    batch = {a for a in ins if a is not None}
    if len(batch) > 1:
        fail("reads operands whose rows lie on different axes")
    return reduce_rows(graph, n, (batch.pop(),), fail, BASE[graph.op(n)]) if batch else None


def cpu_source(name, op, rank, axes, keepdims, element):
    """The kernel x0, x1, ... -> out (or a returned number: every axis reduced); `element(idx)`: the lines
    computing `v`, the element at index text idx. The sums take the plain reductions' paths: the last axis
    and others reduced, into a float64 row of partial sums (it vectorises); the last alone, in four running
    sums (one would wait for each add); the last axis kept, into out in memory order."""
    scalar = len(axes) == rank and not keepdims
    kept = [d for d in range(rank) if d not in axes]
    last = rank - 1
    count = " * ".join(f"n{d}" for d in axes)
    arity = element.arity
    lines = [f"def {name}({', '.join([f'x{j}' for j in range(arity)] + ([] if scalar else ['out']))}):"]
    lines += dims_line("x0", rank)
    at = lambda shift="": element(index([f"i{d}" for d in range(last)] + [f"i{last}{shift}"]))
    out_idx = index(["0" if d in axes else f"i{d}" for d in range(rank)] if keepdims else [f"i{d}" for d in kept])
    mean = f" / ({count})" if op == "mean" else ""
    if op == "max":   # NaN wins, as in numpy and PyTorch
        update = at() + ["if v > m or v != v:", "    m = v"]
        if scalar:
            return "\n".join(lines + ["    m = -math.inf"] + loops(range(rank), update) + ["    return m"])
        lines += loops(kept, ["m = -math.inf"])
        lines += loops(sorted(axes), update, indent=1 + len(kept))
        return "\n".join(lines + ["    " * (1 + len(kept)) + f"out[{out_idx}] = m"])
    if last not in axes:   # memory order, into out (a float64 buffer would be an allocation per call)
        lines.append("    out[:] = 0.0")
        lines += loops(range(rank), at() + [f"out[{out_idx}] += v"])
        if op == "mean":
            lines.append(f"    out *= 1.0 / ({count})")
        return "\n".join(lines)
    if len(axes) >= 2:
        outer = sorted(d for d in axes if d != last)
        lines.append(f"    row = np.empty(n{last}, dtype=np.float64)")
        body = ["row[:] = 0.0"] + loops(outer + [last], at() + [f"row[i{last}] += v"], indent=0)
        body += ["acc = 0.0", f"for i{last} in range(n{last}):", f"    acc += row[i{last}]"]
    else:
        # (lanes named apart from the element's loads a0, a1, ... and its shared terms s0, s1, ...)
        body = ["sum0 = sum1 = sum2 = sum3 = 0.0", f"stop = n{last} - n{last} % 4", f"for i{last} in range(0, stop, 4):"]
        for k in range(4):
            body += ["    " + b for b in at(f" + {k}" if k else "") + [f"sum{k} += v"]]
        body += [f"for i{last} in range(stop, n{last}):", *("    " + b for b in at() + ["sum0 += v"]),
                 "acc = (sum0 + sum1) + (sum2 + sum3)"]
    if scalar:
        return "\n".join(lines + ["    " + b for b in body] + [f"    return acc{mean}"])
    return "\n".join(lines + loops(kept, body + [f"out[{out_idx}] = acc{mean}"]))


def _cpu(s):
    expr, rank = s.attrs["expr"], len(s.operand_shape(0))
    axes, keepdims, op = tuple(s.attrs["axes"]), s.attrs.get("keepdims", False), BASE[s.op]
    arity = len(s.operands)

    def make(kname):
        def element(idx):
            loads = [f"a{j} = x{j}[{idx}]" if idx else f"a{j} = x{j}[()]" for j in range(arity)]
            return loads + s.kernels.scalar_expression(expr, [f"a{j}" for j in range(arity)], "v")
        element.arity = arity
        return cpu_source(kname, op, rank, axes, keepdims, element), f"{op} over axes {axes} of {expr}"

    key = ("fused_reduce", op, rank, axes, keepdims, expr, arity)
    kernel = s.kernel(key, f"{op}_of_{expression_name(expr)}", make)   # (sum_of_pow: a sum of squares)
    if s.shape == ():
        return [f"{s.out} = {s.call(kernel, s.args)}{s.note}"]
    return s.into_out(kernel)


for _name in BASE:
    register(Op(_name, "reduce", _infer, _evaluate_of(_name), _flops, rows=_rows, cpu=_cpu,
                doc=f"{BASE[_name]} of an elementwise expression of same-shape operands, one loop (CPU)"))
