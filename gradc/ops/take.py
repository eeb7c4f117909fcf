"""Embedding lookup: `take(table, idx)` reads row idx[...] of a (V, D) float table, for an int idx of
any shape (out: idx.shape + (D,)). Its adjoint `take_grad` adds each adjoint row into the row it
was read from (a scatter-add into zeros); each is the other's VJP in the adjoint, so second order
goes through embeddings too.

An index outside 0..V-1 is an error, never a wrapped or a wild read: the interpreter raises
IndexError, a compiled module refuses such an input with ValueError before any kernel runs (as it
does labels), and the kernels check again (a CPU kernel raises IndexError; a CUDA kernel writes
NaN for the row instead of reading memory it does not own). Negative indices are errors too, as in
torch.nn.functional.embedding.
"""
import numpy as np

from . import Op, register
from ..errors import ShapeError
from ..shapes import fmt, size
from .kernel_text import dims_line, index, loops, unravel


def check_indices(idx, rows):
    idx = np.asarray(idx)
    if idx.size and (idx.min() < 0 or idx.max() >= rows):
        bad = idx.min() if idx.min() < 0 else idx.max()
        raise IndexError(f"take: index {int(bad)} is outside 0..{rows - 1} for a table of {rows} rows")
    return idx


def _take_infer(attrs, shapes, dtypes):
    (table, idx), (dt, di) = shapes, dtypes
    if not dt.startswith("float"):
        raise ShapeError(f"the table has dtype {dt}; it must be float")
    if not di.startswith("int"):
        raise ShapeError(f"the indices have dtype {di}; they must be an int tensor (e.g. an input with dtype='int64')")
    if len(table) != 2:
        raise ShapeError(f"the table must have shape (V, D), got {fmt(table)}")
    return tuple(idx) + (table[1],), dt


def _take_evaluate(attrs, values, out_shape, dims):
    table, idx = values
    return table[check_indices(idx, table.shape[0])]


def _take_vjp(ctx, n, g):
    table, idx = ctx.graph.operands(n)
    return [ctx.emit("take_grad", [g, idx], shape=ctx.graph.shape(table)), None]


def take_rows(graph, n, ins, fail):
    table, idx = ins
    if table is not None:
        fail("reads a table that holds batch rows")
    return idx


# ---- lowering: one kernel per rank of the indices (a rank-0 index is a number on the CPU) -------------
BAD_INDEX = 'raise IndexError("take: an index is outside the rows of the table")'


def _cpu_source(name, rank, grad):
    """take: out[i.., c] = table[idx[i..], c]; take_grad: out = 0, out[idx[i..], c] += g[i.., c]."""
    ivars = [f"i{a}" for a in range(rank)]
    head = (f"def {name}(g, idx, out):" if grad else f"def {name}(table, idx, out):")
    lines = [head, f"    rows, width = {'out' if grad else 'table'}.shape"]
    if grad:
        lines.append("    out[:] = 0.0")
    lines += dims_line("idx", rank) if rank else []
    at = "idx" if rank == 0 else f"idx[{index(ivars)}]"
    body = [f"j = {at}", "if j < 0 or j >= rows:", f"    {BAD_INDEX}", "for c in range(width):",
            f"    out[j, c] += g[{index(ivars + ['c'])}]" if grad else f"    out[{index(ivars + ['c'])}] = table[j, c]"]
    lines += loops(range(rank), body)
    return "\n".join(lines), ("out[idx[i], :] += g[i, :]" if grad else "out[i, :] = table[idx[i], :]")


def _cuda_take_source(name, rank):
    """One thread per output element; an index out of range (only device inputs reach here unchecked)
    gives NaN, never a read outside the table."""
    ivars = [f"i{a}" for a in range(rank)]
    lines = [f"def {name}(table, idx, out):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return"]
    lines += unravel(rank + 1)
    lines += [f"    j = idx[{index(ivars, '0')}]", f"    c = i{rank}",
              f"    out[{index(ivars + ['c'])}] = table[j, c] if 0 <= j < table.shape[0] else math.nan"]
    return "\n".join(lines), "out[i, :] = table[idx[i], :]", ("flat", -1)


def _cuda_take_grad_source(name, rank):
    """One thread per column c of the table: it walks every index in order and adds the adjoint rows
    that read its column, so no two threads write one element (no atomics; deterministic sums)."""
    ivars = [f"i{a}" for a in range(rank)]
    lines = [f"def {name}(g, idx, out):", "    c = cuda.grid(1)", "    if c >= out.shape[1]:", "        return",
             "    for r in range(out.shape[0]):", "        out[r, c] = 0.0"]
    body = [f"j = idx[{index(ivars, '0')}]", "if 0 <= j < out.shape[0]:", f"    out[j, c] += g[{index(ivars + ['c'])}]",
            "else:", "    out[0, c] = math.nan   # an index out of range poisons the gradient, never a wild write"]
    for a in range(rank):
        lines.append("    " * (a + 1) + f"for i{a} in range(idx.shape[{a}]):")
    lines += ["    " * (rank + 1) + b for b in body]
    return "\n".join(lines), "out[idx[i], :] += g[i, :]", ("rows", -1, (0,))


def _lower_cpu(grad):
    def lower(s):
        rank = len(s.operand_shape(1))
        key = ("take_grad" if grad else "take", rank)
        return s.into_out(s.kernel(key, key[0], lambda kname: _cpu_source(kname, rank, grad)))
    return lower


def _lower_cuda(grad):
    def lower(s):
        rank = len(s.operand_shape(1))
        key = ("take_grad" if grad else "take", rank)
        make = _cuda_take_grad_source if grad else _cuda_take_source
        return s.into_out(s.kernel(key, key[0], lambda kname: make(kname, rank)))
    return lower


def _take_batched(graph, n, operands, lifted, emit):
    """Each copy's indices read the one table (a table per copy is not taken)."""
    return None if lifted[0] else emit("take", operands, **graph.attrs(n))


register(Op("take", "nn", _take_infer, _take_evaluate,
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_take_vjp, arity=2, rows=take_rows,
            batched=_take_batched,
            cpu=_lower_cpu(False), cuda=_lower_cuda(False),
            indexes=lambda graph, n: (1, graph.shape(graph.operands(n)[0])[0]),
            doc="out[i..., :] = table[idx[i...], :]: an embedding lookup"))


def _take_grad_infer(attrs, shapes, dtypes):
    (g, idx), (dg, di) = shapes, dtypes
    target = tuple(attrs["shape"])
    if not dg.startswith("float") or not di.startswith("int"):
        raise ShapeError(f"needs a float adjoint and int indices, got {dg} and {di}")
    if len(target) != 2 or tuple(g) != tuple(idx) + (target[1],):
        raise ShapeError(f"adjoint {fmt(g)} does not match indices {fmt(idx)} and table {fmt(target)}")
    return target, dg


def _take_grad_evaluate(attrs, values, out_shape, dims):
    g, idx = values
    out = np.zeros(out_shape, dtype=g.dtype)
    np.add.at(out, check_indices(idx, out_shape[0]), g)
    return out


def _take_grad_vjp(ctx, n, u):
    _, idx = ctx.graph.operands(n)
    return [ctx.emit("take", [u, idx]), None]


register(Op("take_grad", "nn", _take_grad_infer, _take_grad_evaluate,
            lambda attrs, in_shapes, out_shape: size(in_shapes[0]), vjp=_take_grad_vjp, arity=2,
            cpu=_lower_cpu(True), cuda=_lower_cuda(True),
            doc="zeros of attrs shape (V, D) with out[idx[i...], :] += g[i..., :]: take's adjoint"))
