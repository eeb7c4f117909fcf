"""`copy_into(out, x)`: out[...] = x for two arrays of one shape, in a compiled kernel.

Numba's own `out[...] = x` broadcasts, and compiling its shape-mismatch message (string
formatting) took 2-4 s for each rank a process met, in every cold build that compiles a kernel
copying an array (an LSTM's warm-up: 4.5 s of 21 s). Codegen copies only between arrays of one
shape, so plain loops do: they compile in a tenth of that and copy a strided view in half the
time, and Numba caches them beside this file (jit_options' cache), so each compiles once per
install, not in every process (an LSTM's warm-up compiled six of them, 0.9 s). Called from plain
Python (an entry that is not compiled), it is numpy's assignment.

It assumes what codegen gives it: `out` and `x` do not overlap (a copy always goes into a buffer
of its own, so an element is never read after it was written), and their shapes are equal (no
broadcast: a different shape is a codegen bug, and raises).
"""
from numba import types
from numba.extending import overload


def copy_into(out, x):
    out[...] = x


@overload(copy_into, jit_options={"nogil": True, "cache": True})
def _copy_into_loops(out, x):
    """A loop over the first axis, copying row into row (a rank lower); C-contiguous arrays as one row.
    A number fills `out` (a scan step's scalar value is a local)."""
    if isinstance(x, types.Number):
        def fill(out, x):
            out[...] = x
        return fill
    if not isinstance(x, types.Array) or out.ndim != x.ndim:
        return None
    if out.ndim == 0:
        def copy_scalar(out, x):
            out[()] = x[()]
        return copy_scalar
    if out.ndim == 1:
        def copy_vector(out, x):
            if x.shape != out.shape:
                raise ValueError("copy_into: the arrays' shapes differ")
            for i in range(out.shape[0]):
                out[i] = x[i]
        return copy_vector
    if out.layout == "C" and x.layout == "C":
        def copy_flat(out, x):
            if x.shape != out.shape:
                raise ValueError("copy_into: the arrays' shapes differ")
            copy_into(out.reshape(out.size), x.reshape(x.size))
        return copy_flat

    def copy_rows(out, x):
        if x.shape != out.shape:
            raise ValueError("copy_into: the arrays' shapes differ")
        for i in range(out.shape[0]):
            copy_into(out[i], x[i])
    return copy_rows
