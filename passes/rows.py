"""Is the loss a sum or a mean of per-row terms over the batch dim? (DESIGN.md §1.6)

Microbatches give the whole batch's gradients only when no op mixes rows before the loss's
last reduction. This walks the forward from the inputs and tracks where the batch dim is in
each value: an axis, nowhere (params, constants), or reduced away by a sum or a mean. After
that reduction only ops that are linear in it may follow (a scale, a sum of such terms), so the
loss of the whole batch is the weighted sum of the microbatches' losses: weights B_m / B for a
mean, 1 for a sum. Anything else names the op that mixes rows.
"""
import sympy as sp

from gradc.ops import get_op
from gradc.ops.elementwise import X, expr_of

NONE = None


class RowsError(Exception):
    def __init__(self, message, src):
        super().__init__(message)
        self.src = src


def batch_dim(graph, override=None):
    """The batch dim's name: `override` (--batch-dim), else the first input's leading symbolic dim."""
    declared = {d for n in graph.inputs.values() for d in graph.shape(n) if isinstance(d, str)}
    if override is not None:
        if override not in declared:
            raise RowsError(f"--batch-dim {override}: no input has that dim (they have: "
                            f"{', '.join(sorted(declared)) or 'none'})", None)
        return override
    for name, n in graph.inputs.items():
        shape = graph.shape(n)
        if shape and isinstance(shape[0], str):
            return shape[0]
        raise RowsError(f"microbatches split the batch dim, but the first input {name!r} has no symbolic leading "
                        f"dim (shape {shape}); declare it as e.g. ('B', ...) or name the dim with --batch-dim",
                        graph.node(n)["src"])
    raise RowsError("microbatches need an input with a batch dim", None)


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
    raise RowsError(f"{graph.describe(n)} {why}, so microbatches would not give the whole batch's gradients",
                    graph.node(n)["src"])


def _track(graph, n, dim, where):
    op, node = graph.op(n), graph.node(n)
    shape = node["shape"]
    if op in ("input", "param", "const"):
        if dim in shape[1:]:
            _fail(graph, n, f"has the batch dim {dim!r} on an axis other than the first")
        return 0 if shape and shape[0] == dim else NONE
    ins = [where[u] for u in graph.operands(n)]
    if all(w is NONE for w in ins):
        if any(d == dim for d in shape) or (op == "count" and dim in node["attrs"].get("dims", ())):
            _fail(graph, n, f"takes the batch size {dim!r} from no input row")
        return NONE
    record = get_op(op)
    if record.kind == "elementwise":
        return _elementwise(graph, n, ins, shape)
    if any(isinstance(w, tuple) for w in ins):
        _fail(graph, n, "uses the loss after its reduction over rows in a way that is not a sum of scaled terms")
    if op == "matmul":
        a, b = ins
        ta, tb = node["attrs"].get("transpose_a"), node["attrs"].get("transpose_b")
        if a is not NONE and b is NONE and a == (1 if ta else 0):
            return 0
        if b is not NONE and a is NONE and b == (0 if tb else 1):
            return 1
        _fail(graph, n, "multiplies along the batch dim (it sums over rows)")
    if op in ("transpose",):
        return list(node["attrs"]["axes"]).index(ins[0])
    if op in ("reshape", "transfer"):
        if op == "transfer" or (ins[0] == 0 and shape and shape[0] == dim):
            return ins[0]
        _fail(graph, n, "reshapes the batch dim away")
    if op in ("sum", "mean", "max", "argmax_mask"):
        axes = tuple(node["attrs"]["axes"])
        a = ins[0]
        if a in axes:
            if op == "max" or op == "argmax_mask":
                _fail(graph, n, "takes a max over rows")
            return ("reduced", op)
        if op == "argmax_mask" or node["attrs"].get("keepdims"):
            return a
        return a - sum(1 for x in axes if x < a)
    if op in ("softmax", "log_softmax"):
        if node["attrs"]["axis"] % len(shape) == ins[0]:
            _fail(graph, n, "normalises over rows")
        return ins[0]
    if op in ("pick", "softmax_xent"):   # row i reads row i of the values and label i
        x, labels = ins
        if x == 0 and labels in (0, NONE):
            return 0
        _fail(graph, n, "picks across rows")
    _fail(graph, n, "is an op gradc cannot follow the rows through")


def _elementwise(graph, n, ins, shape):
    """Broadcast: every operand with the batch dim has it on the same output axis. A reduced loss
    may only be scaled or added to others of the same kind: expr(t x) = t expr(x) in those x."""
    operands = graph.operands(n)
    reduced = [i for i, w in enumerate(ins) if isinstance(w, tuple)]
    if reduced:
        kinds = {ins[i] for i in reduced}
        if len(kinds) > 1 or any(w is not NONE and not isinstance(w, tuple) for w in ins):
            _fail(graph, n, "mixes a value reduced over rows with other batch values")
        t = sp.Symbol("t", positive=True)
        expr = expr_of(graph, n)
        scaled = expr.xreplace({X[i]: t * X[i] for i in reduced})
        if sp.simplify(scaled - t * expr) != 0:
            _fail(graph, n, f"is not linear in the loss reduced over rows ({expr})")
        return kinds.pop()
    out = None
    for u, w in zip(operands, ins):
        if w is NONE:
            continue
        at = w + len(shape) - len(graph.shape(u))
        if out is not None and at != out:
            _fail(graph, n, "broadcasts the batch dim of one operand against another axis")
        out = at
    return out
