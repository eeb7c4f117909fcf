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
from .batched import right_aligned
from ..errors import ShapeError
from ..shapes import broadcast, fmt, size
from .elementwise import X
from .kernel_text import index, loops, unravel


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


# ---- lowering ----------------------------------------------------------------------------------------
def _batch_pattern(shape, batch):
    """Per batch dim of the product, the operand's index there: i{d}, 0 where it is broadcast, or
    nothing where the operand has fewer batch dims."""
    own = shape[:-2]
    lead = len(batch) - len(own)
    return [("0" if d == 1 and batch[lead + j] != 1 else f"i{lead + j}") for j, d in enumerate(own)]


def _plan(s):
    """What the kernel's code depends on: ranks, flags and broadcast patterns."""
    sa, sb = s.operand_shape(0), s.operand_shape(1)
    ta, tb, red = bool(s.attrs.get("transpose_a")), bool(s.attrs.get("transpose_b")), bool(s.attrs.get("reduce_batch"))
    batch = sa[:-2] if red else s.shape[:-2]
    return (ta, tb, red, len(batch), tuple(_batch_pattern(sa, batch)), tuple(_batch_pattern(sb, batch)),
            len(sb) == 2, len(sa))


def _cpu_source(name, ta, tb, red, nbatch, pa, pb, b_flat, rank_a):
    """BLAS through np.dot. Two shapes of product are one call over flattened rows (C order):
    A (..., m, k) @ B (k, n) as (rows, k) @ (k, n); and sum_b A[b]^T B[b] as (rows, k)^T @ (rows, n).
    Otherwise one np.dot per batch element (summed into out for reduce_batch)."""
    t = lambda flag: ".T" if flag else ""
    lines = [f"def {name}(a, b, out):"]
    if b_flat and not ta and not red:
        lines += ["    k = a.shape[-1]", "    n = out.shape[-1]",
                  f"    np.dot(a.reshape((a.size // k, k)), b{t(tb)}, out.reshape((out.size // n, n)))"]
        return "\n".join(lines), "out = A @ op(B) over A's flattened rows"
    if red and ta and not tb:
        lines += ["    ka, kb = a.shape[-1], b.shape[-1]",
                  "    np.dot(a.reshape((a.size // ka, ka)).T, b.reshape((b.size // kb, kb)), out)"]
        return "\n".join(lines), "out = sum over the batch of A[b]^T B[b], as one product of the flattened rows"
    ivars = [f"i{d}" for d in range(nbatch)]
    a_at = f"a[{index(list(pa))}]" if pa else "a"
    b_at = f"b[{index(list(pb))}]" if pb else "b"
    lines += [f"    {', '.join(f'n{d}' for d in range(nbatch))}{',' if nbatch == 1 else ''} = "
              f"{'a' if red else 'out'}.shape[:{nbatch}]"]
    if red:
        lines += ["    part = np.empty(out.shape, out.dtype)", "    out[:] = 0.0"]
        body = [f"np.dot({a_at}{t(ta)}, {b_at}{t(tb)}, part)", "out += part"]
    else:
        body = [f"np.dot({a_at}{t(ta)}, {b_at}{t(tb)}, out[{index(ivars)}])"]
    lines += loops(range(nbatch), body)
    return "\n".join(lines), f"out = op(A) @ op(B) per batch element{' summed' if red else ''}"


def _cuda_source(name, ta, tb, red, nbatch, pa, pb, b_flat, rank_a):
    """One thread per element of out; it sums over k (and over the batch for reduce_batch)."""
    mat_a = (lambda r, c: f"a[{index(list(pa) + ([c, r] if ta else [r, c]))}]")
    mat_b = (lambda r, c: f"b[{index(list(pb) + ([c, r] if tb else [r, c]))}]")
    lines = [f"def {name}(a, b, out):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return"]
    if red:
        lines += unravel(2, shape="out.shape")   # i0, i1: the row and column of out
        lines += ["    row, col = i0, i1", "    acc = 0.0", f"    k_count = a.shape[{rank_a - 2 if ta else rank_a - 1}]"]
        lines += [f"    n{d} = a.shape[{d}]" for d in range(nbatch)]
        body = ["for k in range(k_count):", f"    acc += {mat_a('row', 'k')} * {mat_b('k', 'col')}"]
        lines += loops(range(nbatch), body)
        lines.append("    out[row, col] = acc")
    else:
        lines += unravel(nbatch + 2, shape="out.shape")
        lines += [f"    row, col = i{nbatch}, i{nbatch + 1}", "    acc = 0.0",
                  f"    for k in range(a.shape[{rank_a - 2 if ta else rank_a - 1}]):",
                  f"        acc += {mat_a('row', 'k')} * {mat_b('k', 'col')}",
                  f"    out[{index([f'i{d}' for d in range(nbatch + 2)])}] = acc"]
    return "\n".join(lines), "out = op(A) @ op(B) over the batch", ("flat", -1)


def _lower(make):
    def lower(s):
        plan = _plan(s)
        return s.into_out(s.kernel(("batch_matmul",) + plan, "batch_matmul", lambda kname: make(kname, *plan)))
    return lower


def _cuda_lower(s):
    """sum_b A[b]^T B[b] (a weight's gradient over a stack of steps or samples) as one GEMM of the
    flattened rows, as on the CPU: the kernel above would give each output element a serial loop over
    every row of the batch. Other products: that kernel."""
    ta, tb, red = _plan(s)[:3]
    if not (red and ta and not tb):
        return _lower(_cuda_source)(s)
    site = s.kernels.gemm_site(True, False, X[0], X[0], X[0], ())
    # the last dim by its index: the simulator's arrays take no shape[-1]
    last = [f"{v}.shape[{len(s.operand_shape(i)) - 1}]" for i, v in enumerate(s.args)]
    rows = [f"{v}.reshape(({v}.size // {k}, {k}))" for v, k in zip(s.args, last)]
    return [s.alloc(), f"{site}(stream, {', '.join(rows + [s.out])}){s.note}"]


def _batched(graph, n, operands, lifted, emit):
    """The copies' axis is one more batch dim, in front of the broadcast batch dims (a shared operand
    broadcasts over it); a product summed over its batch is not taken per copy."""
    if graph.attrs(n).get("reduce_batch"):
        return None
    return emit("batch_matmul", right_aligned(graph, operands, lifted, len(graph.shape(n)), emit), **graph.attrs(n))


register(Op("batch_matmul", "matmul", _infer, _evaluate, _flops, vjp=_vjp, arity=2, rows=batch_matmul_rows,
            batched=_batched,
            cpu=_lower(_cpu_source), cuda=_cuda_lower,
            doc="op(A) @ op(B) over broadcast batch dims (numpy's matmul); attrs transpose_a / transpose_b, "
                "reduce_batch (sum over the batch too)"))
