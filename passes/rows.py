"""Is the loss a sum or a mean of per-row terms over the batch dim? (DESIGN.md §1.6)

Microbatches give the whole batch's gradients only when no op mixes rows before the loss's
last reduction. This walks the forward from the inputs and tracks where the batch dim is in
each value: an axis, nowhere (params, constants), or reduced away by a sum or a mean. After
that reduction only ops that are linear in it may follow (a scale, a sum of such terms), so the
loss of the whole batch is the weighted sum of the microbatches' losses: weights B_m / B for a
mean, 1 for a sum. Anything else names the op that mixes rows.
"""
from gradc.ops import get_op, rows_of

NONE = None


class RowsError(Exception):
    def __init__(self, message, src):
        super().__init__(message)
        self.src = src


def batch_dim(graph, override=None):
    """The batch dim's name: `override` (--batch-dim); else the first of the inputs' leading symbolic
    dims over which the loss is a sum or mean of per-row terms (so an RNN with a time-major sequence
    (T, B, ...) and labels (B,) gets B), or, when no input leads with a symbolic dim, the first such dim
    of any axis. A dim no input leads with is never chosen over one that does: a model that mixes the
    rows of its leading dim (a batch statistic) is refused, never split along another dim. Without a
    dim that qualifies, the first candidate, whose check then says what mixes its rows."""
    declared = list(dict.fromkeys(d for n in graph.inputs.values() for d in graph.shape(n) if isinstance(d, str)))
    if override is not None:
        if override not in declared:
            raise RowsError(f"--batch-dim {override}: no input has that dim (they have: "
                            f"{', '.join(sorted(declared)) or 'none'})", None)
        return override
    leading = list(dict.fromkeys(graph.shape(n)[0] for n in graph.inputs.values()
                                 if graph.shape(n) and isinstance(graph.shape(n)[0], str)))
    candidates = leading or declared
    if not candidates:
        raise RowsError("microbatches and data-parallel shards split a batch dim, but no input has a symbolic dim; "
                        "declare the batch dim by name, e.g. ('B', ...)", None)
    if graph.loss is not None:
        for dim in candidates:
            try:
                loss_reduction(graph, dim)
                return dim
            except RowsError:
                continue
    return candidates[0]


def other_dims(graph, dim):
    """What an error about the batch dim `dim`, taken by default, adds when the inputs have other
    symbolic dims: that --batch-dim names another, and why each other input's leading dim failed too."""
    others = list(dict.fromkeys(d for n in graph.inputs.values() for d in graph.shape(n)
                                if isinstance(d, str) and d != dim))
    if not others:
        return ""
    leading = {graph.shape(n)[0] for n in graph.inputs.values() if graph.shape(n)}
    why = []
    for d in others:
        if d in leading and graph.loss is not None:
            try:
                loss_reduction(graph, d)
            except RowsError as e:
                why.append(f"with {d!r}: {e.src + ': ' if e.src else ''}{e}")
    return (f" (the batch dim taken is {dim!r}; the inputs also have {', '.join(map(repr, others))}: --batch-dim "
            f"names the batch dim{'; ' + '; '.join(why) if why else ''})")


def batch_axes(graph, dim):
    """{input name: the axis it has the batch dim `dim` on}, for the inputs that have it."""
    return {name: graph.shape(n).index(dim) for name, n in graph.inputs.items() if dim in graph.shape(n)}


def loss_reduction(graph, dim):
    """"mean" or "sum": how the loss reduces the rows over `dim`; raises RowsError naming the op."""
    where = {}
    for n in graph.topo_order(graph.ancestors([graph.loss])):
        where[n] = _track(graph, n, dim, where)
    kind = where[graph.loss]
    if not isinstance(kind, tuple):
        raise RowsError(f"the loss does not reduce over the batch dim {dim!r}, so microbatches cannot split it",
                        graph.node(graph.loss)["src"])
    return kind[1]


def _fail(graph, n, why):
    raise RowsError(f"{graph.describe(n)} {why}, so microbatches (or data-parallel shards) would not give the "
                    f"whole batch's gradients",
                    graph.node(n)["src"])


def _track(graph, n, dim, where):
    """Where the batch rows lie in n: leaves declare them; every other op says by its record's
    `rows` rule (gradc/ops), given where they lie in its operands."""
    op, node = graph.op(n), graph.node(n)
    shape, record = node["shape"], get_op(graph.op(n))
    if record.kind == "leaf":   # an input may have its rows on any one axis: a sequence (T, B, ...) on 1
        if list(shape).count(dim) > 1:
            _fail(graph, n, f"has the batch dim {dim!r} on more than one axis")
        return shape.index(dim) if dim in shape else NONE
    ins = [where[u] for u in graph.operands(n)]
    if op == "random" and dim in shape:
        _fail(graph, n, "draws each value from its seed and the element's index in the whole batch, and a "
                        "microbatch would draw others")
    if all(w is NONE for w in ins):
        if any(d == dim for d in shape) or (op == "count" and dim in node["attrs"].get("dims", ())):
            _fail(graph, n, f"takes the batch size {dim!r} from no input row")
        return NONE
    return rows_of(graph, n, ins, lambda why: _fail(graph, n, why))
