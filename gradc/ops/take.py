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


register(Op("take", "nn", _take_infer, _take_evaluate,
            lambda attrs, in_shapes, out_shape: size(out_shape), vjp=_take_vjp, arity=2,
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
            doc="zeros of attrs shape (V, D) with out[idx[i...], :] += g[i..., :]: take's adjoint"))
