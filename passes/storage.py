"""Which values own a buffer, and how many bytes it has (the bytes of DESIGN.md §1.5).

Params, inputs and constants belong to the caller; scalars are locals of the compiled code;
a value whose op record is a view (a reshape of an array) lives in its operand's buffer. Every
other value owns a buffer: a slot of the arena, or (an int value) one of its own.
"""
import numpy as np

from gradc.ops import get_op
from gradc.shapes import bind_dims, size

LEAVES = ("param", "input", "const")


def base(graph, n):
    """The value whose buffer n lives in: n itself, or the value a chain of reshapes views."""
    while get_op(graph.op(n)).view and graph.shape(n) != () and graph.shape(graph.operands(n)[0]) != ():
        n = graph.operands(n)[0]
    return n


def written_with_operand(graph, n):
    """Whether n is written by its operand's statement or lives in its buffer: a view, or a result
    of a multi-result op (kind "project": a scan writes its results). A layer of a memory plan, or a
    piece of its coarse graph, never starts at such a node: recomputing it means its operand's step."""
    return base(graph, n) != n or get_op(graph.op(n)).kind == "project"


def owns_buffer(graph, n):
    return graph.op(n) not in LEAVES and graph.shape(n) != () and base(graph, n) == n


def in_arena(graph, n):
    """Whether n's buffer is a slot of the arena, which holds the model's float dtype. An int value
    (a column of int labels, a transposed index array) owns a buffer of its own dtype, made by its
    statement; the plan counts it as workspace."""
    return owns_buffer(graph, n) and graph.dtype(n).startswith("float")


def value_bytes(graph, n, dims):
    """Bytes of n's value as an array of its own (a view's as a copy; a param's), with `dims` bound."""
    return int(np.prod(bind_dims(graph.shape(n), dims), dtype=np.int64)) * np.dtype(graph.dtype(n)).itemsize


def buffer_bytes(graph, n, dims=None):
    """Bytes of n's own buffer (0 when it has none); an int when every dim is bound or in `dims`."""
    if not owns_buffer(graph, n):
        return 0
    dims = dims or {}
    shape = bind_dims(graph.shape(n), dims)
    count = size(shape) * np.dtype(graph.dtype(n)).itemsize
    return int(count) if isinstance(count, int) or count.is_Integer else count
