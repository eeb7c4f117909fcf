"""Shapes with symbolic dims: ints broadcast as in numpy; a str dim matches only the same name."""
import functools

import numpy as np
import sympy as sp

from .errors import ShapeError


def fmt(shape):
    """(B, 64) as the user wrote it, without quotes around symbolic dims."""
    inner = ", ".join(str(d) for d in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


@functools.lru_cache(maxsize=4096)
def expr_text(expr):
    """str(expr) for a sympy expression, remembered: sympy prints slowly (about 0.3 ms), and a deep
    model's dumps and plans print the same few expressions (sizes, fused layers) hundreds of times."""
    return str(expr)


def check_shape(shape):
    if isinstance(shape, (int, str)):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise ShapeError(f"a shape must be a tuple of ints and dim names, not {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, str)):
            raise ShapeError(f"dim {d!r} in shape {tuple(shape)!r} is neither an int nor a dim name")
        if isinstance(d, int) and d < 0:
            raise ShapeError(f"dim {d} in shape {tuple(shape)!r} is negative")
        if isinstance(d, str) and not d.isidentifier():
            raise ShapeError(f"dim name {d!r} is not an identifier")
        out.append(d)
    return tuple(out)


def broadcast(*shapes):
    """numpy broadcasting; a symbolic dim is never stretched and never equals an int other than 1."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        dims = [s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0]
        dim = 1
        for d in dims:
            if d == 1 or d == dim:
                continue
            if dim == 1:
                dim = d
            else:
                raise ShapeError("shapes " + " and ".join(fmt(s) for s in shapes) + " do not broadcast")
        out.append(dim)
    return tuple(out)


def broadcast_axes(shape, target):
    """Axes of `target` that a value of `shape` is stretched along (for summing a gradient back)."""
    lead = len(target) - len(shape)
    axes = list(range(lead))
    axes += [lead + i for i, d in enumerate(shape) if d == 1 and target[lead + i] != 1]
    return tuple(axes)


def normalize_axes(axis, rank):
    """axis=None -> all axes; ints may be negative; duplicates and out-of-range are errors."""
    if axis is None:
        return tuple(range(rank))
    if isinstance(axis, (int, np.integer)):
        axes = (axis,)
    elif isinstance(axis, (list, tuple, range)):
        axes = tuple(axis)
    else:
        raise ShapeError(f"axis {axis!r} is not an int or a tuple of ints")
    axes = tuple(int(a) if isinstance(a, np.integer) else a for a in axes)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, int):
            raise ShapeError(f"axis {a!r} is not an int")
        if not -rank <= a < rank:
            raise ShapeError(f"axis {a} is out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise ShapeError(f"axis {axis!r} repeats an axis")
    return tuple(sorted(out))


def reduced(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def bind_dims(shape, dims):
    """shape with the symbolic dims that `dims` binds replaced by their ints."""
    return tuple(dims.get(d, d) if isinstance(d, str) else d for d in shape)


def size(shape):
    """Element count: an int, or a sympy expression when dims are symbolic."""
    n = 1
    for d in shape:
        n = n * (sp.Symbol(d, positive=True, integer=True) if isinstance(d, str) else d)
    return n


def reshape_target(src, new):
    """Resolve one -1 in `new` so that it holds as many elements as `src`, or raise."""
    new = list(new)
    holes = [i for i, d in enumerate(new) if d == -1]
    if len(holes) > 1:
        raise ShapeError(f"reshape {tuple(new)}: only one dim may be -1")
    for d in new:
        if not (d == -1 or isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)):
            raise ShapeError(f"reshape: dim {d!r} in {tuple(new)} is invalid")
    src_size = size(src)
    if holes:
        rest = size([d for d in new if d != -1])
        fill = sp.sympify(src_size) / rest if rest != 0 else None
        if fill is None or not (fill.is_Integer and fill >= 0):
            why = f": the -1 would be {fill}, not an int" if fill is not None and not fill.is_Integer else ""
            raise ShapeError(f"cannot reshape {fmt(src)} to {fmt(tuple(new))}{why} (a dim is an int or one dim name)")
        new[holes[0]] = int(fill)
    if sp.expand(size(new) - src_size) != 0:
        raise ShapeError(f"cannot reshape {fmt(src)} to {fmt(tuple(new))}: element counts differ")
    return tuple(new)
