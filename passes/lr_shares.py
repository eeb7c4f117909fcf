"""The loss kept per row for lr_grad (passes/likelihood_ratio.py, passes/lr_scan.py).

The estimate pairs each stacked row's share of the loss with that row's noise, so the loss's reduction
over the batch rows (a mean or sum: the objective's, or a per-step loss made in a scan's step) is not
done: each row's share of it is kept. A value after that reduction (shape S in the model) is carried
as its shares, rows first: (KB_lr,) + S. The ops the model may apply to it (rows_of in gradc/ops: it
is only scaled, added, summed or moved) are applied to the shares with the rows axis put in front of
theirs: sums and means over axes of S, reshapes and transposes of S, slices, concatenations along S,
and elementwise ops (a lower-rank share gets 1s after its rows, so it broadcasts as S does). A per-step
loss stacked by a scan, (T, KB_lr) + S, is moved to (KB_lr, T) + S by `rows_first`.
"""
import sympy as sp

from gradc.ops import get_op, rows_of
from gradc.ops.elementwise import X, expr_of, simplified

from .lr_sites import KB, Unsupported

SHARES = ("reduced", "shares")   # where a value after the loss's reduction over rows has its rows


def share_rows(g, n, ins, fail):
    """rows_of, but a mean over rows may meet a sum over rows: their kinds matter to microbatches (the
    weights of their losses), not to the shares."""
    return rows_of(g, n, [SHARES if isinstance(w, tuple) else w for w in ins], fail)


def shares(g, n, ins, where, operands, emit, count):
    """n's shares, where n (of g) is the loss's reduction over rows (`where`, a tuple) or a value after it:
    `ins` says where each operand has its rows, `operands` are their stacked copies (or shares)."""
    if any(isinstance(w, tuple) for w in ins):
        return reduced_copy(g, n, ins, operands, emit)
    return row_shares(g, n, ins[0], where[1], operands[0], emit, count)


def row_shares(g, n, axis, kind, x, emit, count):
    """n (a sum or mean of g over axes that hold the rows, on `axis` of its operand)
    kept per row: each row's share, (KB_lr,) + n's shape, from x, the operand's stacked copy. count(dims,
    dtype) is the number of elements of those dims (in a scan's step, where the batch dim is not
    known, a value from outside)."""
    if g.op(n) not in ("sum", "mean"):
        raise Unsupported(f"{g.node(n)['src']}: the loss reduces the rows with {g.describe(n)}; lr_grad takes a "
                          f"sum or a mean")
    (operand,) = g.operands(n)
    axes, keepdims = tuple(g.attrs(n)["axes"]), bool(g.attrs(n).get("keepdims"))
    others = tuple(a for a in axes if a != axis)
    r = emit("sum", [x], axes=others, keepdims=keepdims) if others else x
    if keepdims:   # n's 1 on the rows' axis comes back after them
        r = rows_first(r, axis, len(g.shape(operand)), emit)
        r = emit("reshape", [r], shape=(KB,) + tuple(g.shape(n)))
    else:
        r = rows_first(r, axis - sum(a < axis for a in others), len(g.shape(n)) + 1, emit)
    if kind == "mean":
        r = emit("div", [r, count(tuple(g.shape(operand)[a] for a in axes), g.dtype(n))])
    return r


def offset_shares(g, n, ins, operands, emit):
    """n's shares where n adds values without rows to the loss after its reduction (loss + 0.5, an L2
    penalty written in the loss): an elementwise op affine in its reduced operands, which the microbatch
    rule refuses. The shares are its linear part: the rest is the same in every copy's loss, so it pairs
    with no noise (a param's part through it is exact: likelihood_ratio's exact_parts). None when n is
    not such an op. `operands` are the reduced operands' shares and the others' values."""
    reduced = [i for i, w in enumerate(ins) if isinstance(w, tuple)]
    if get_op(g.op(n)).kind != "elementwise" or not reduced or any(isinstance(w, int) for w in ins):
        return None
    expr = expr_of(g, n)
    linear = simplified(expr - expr.xreplace({X[i]: 0 for i in reduced}))
    t = sp.Symbol("t", positive=True)
    if simplified(linear.xreplace({X[i]: t * X[i] for i in reduced}) - t * linear) != 0:
        return None
    shape = tuple(g.shape(n))
    inputs, mapping = [], {}
    for i, (u, w, c) in enumerate(zip(g.operands(n), ins, operands)):
        if X[i] not in linear.free_symbols:
            continue
        lack = len(shape) - len(g.shape(u))
        if isinstance(w, tuple) and lack:   # 1s after its rows: it broadcasts as n's operand does
            c = emit("reshape", [c], shape=(KB,) + (1,) * lack + tuple(g.shape(u)))
        mapping[X[i]] = X[len(inputs)]
        inputs.append(c)
    return emit("fused", inputs, expr=linear.xreplace(mapping), shape=(KB,) + shape)


def rows_first(x, at, rank, emit):
    """x (of `rank` axes) with its rows, now on axis `at`, moved to the front."""
    if at == 0:
        return x
    return emit("transpose", [x], axes=(at,) + tuple(a for a in range(rank) if a != at))


def reduced_copy(g, n, ins, operands, emit):
    """n's shares, given its operands' (`operands`: shares where `ins` says an operand is reduced, the
    value itself where it has no rows)."""
    op, attrs, shape = g.op(n), dict(g.attrs(n)), g.shape(n)
    record = get_op(op)
    if record.kind == "elementwise":
        ready = []
        for u, w, c in zip(g.operands(n), ins, operands):
            lack = len(shape) - len(g.shape(u))
            if isinstance(w, tuple) and lack:
                c = emit("reshape", [c], shape=(KB,) + (1,) * lack + tuple(g.shape(u)))
            ready.append(c)
        if "shape" in attrs:
            attrs["shape"] = (KB,) + tuple(attrs["shape"])
        return emit(op, ready, **attrs)
    if op in ("sum", "mean"):
        return emit(op, operands, **dict(attrs, axes=tuple(a + 1 for a in attrs["axes"])))
    if op == "reshape":
        return emit(op, operands, shape=(KB,) + tuple(attrs["shape"]))
    if op == "transpose":
        return emit(op, operands, axes=(0,) + tuple(a + 1 for a in attrs["axes"]))
    if op == "slice":
        return emit(op, operands, index=(None,) + tuple(attrs["index"]))
    if op == "concat":
        return emit(op, operands, axis=attrs["axis"] + 1)
    raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} reads the loss after its reduction over rows; lr_grad "
                      f"follows it through scales, sums, means, reshapes, transposes, slices and concatenations")
