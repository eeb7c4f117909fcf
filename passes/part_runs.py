"""Which steps of a plain CPU entry run over parts of the batch at once, as one function per part.

A conv net's entry is a chain of per-image kernels: convs, their bias and ReLU, pools, and in the
backward their gradients. Each conv used to hand parts of the batch to a thread and take them back
on its own (gradc/runtime/conv_cores.py): about 60 us of thread wake-ups per kernel on a 2-core
machine, and the elementwise kernels between the convs ran on one core. A part run is such a chain
written as one function of a part of the batch, run on every core at once: one hand-off for the
chain, and every kernel of it on every core.

A run is consecutive steps of CPU ops whose records say their kernels run on any part of the batch
(`parts`, gradc/ops/__init__.py), whose batch operands carry the rows on axis 0 (the records' `rows`
rules, as passes/rows.py follows them), and which hold an op worth a hand-off (`part_work`) and at
least one more kernel (a lone conv keeps its own hand-off), on a machine with more than one core and
where the batch would run in more than one part. Views between its steps read no data, so they are
made before it (a reshape to a number reads its value: it ends a run). A value summed over the images
(a weight gradient, a bias's gradient) is summed by each part into a buffer of its own and the parts
added after the run, so no step of the run may read it. The batch dim is the first input's leading
dim (bind records it before --bind makes it an int); without one, or with an image dim left unbound
(the work of an image is then unknown), there are no runs.

The memory plan keeps every value a run touches live over the whole run (`extend_over_runs`): the
parts go at their own pace, so one part may still read a value in the rows it owns while another
writes the buffer a plan without runs would reuse for a later value. A run ends where that would
raise the arena's peak (passes/memory.py, keeps_the_peak), at every batch size it checks. A run ends
before a step it already holds (a recomputed value: one variable may not name two buffers in it).
"""
from gradc.ops import get_op
from gradc.runtime import conv_cores

from .rows import RowsError, batch_dim
from .storage import base

UNKNOWN = "unknown"   # the rows are somewhere no rule follows


class _Mixes(Exception):
    pass


def _refuse(why):
    raise _Mixes(why)


def batch_rows(graph):
    """(the batch dim: its name, or the int --bind made it; the inputs that carry it on axis 0), as
    bind recorded it (passes/pipeline.py), else from the graph's symbolic dims; None without one."""
    if graph.batch_rows is not None:
        return graph.batch_rows
    try:
        dim = batch_dim(graph)
    except RowsError:
        return None
    return dim, {n for n in graph.inputs.values() if graph.shape(n)[:1] == (dim,)}


def batch_axes(graph, steps, dim, leaves):
    """node -> the axis of its batch rows: an int, None (no batch dim), ("reduced", op) after a sum
    or mean over them, or UNKNOWN. `leaves`: the inputs with the rows on axis 0."""
    where = {}
    for n in steps:
        if n not in where:
            where[n] = _axis(graph, n, dim, leaves, where)
    return where


def _operand_axes(graph, n, where):
    """Where the rows lie in n's operands, for cutting them: a value summed over the rows has none."""
    axes = [where.get(u, UNKNOWN) for u in graph.operands(n)]
    return [None if isinstance(a, tuple) else a for a in axes]


def _axis(graph, n, dim, leaves, where):
    shape, record = graph.shape(n), get_op(graph.op(n))
    if record.kind == "leaf":
        if n in leaves:
            return 0
        return UNKNOWN if isinstance(dim, str) and dim in shape else None
    ins = _operand_axes(graph, n, where)
    if all(w is None for w in ins):
        # made from no batch value (a mean's seed gradient 1/B): never in a run itself, but where the dim
        # has its name, a run may cut the rows of one with the dim on axis 0 as it cuts any batch value's
        if not isinstance(dim, str) or dim not in shape:   # (a bound batch's size may be a channel count)
            return None
        return 0 if shape[0] == dim and dim not in shape[1:] else UNKNOWN
    if UNKNOWN in ins or record.rows is None:
        return UNKNOWN
    try:
        return record.rows(graph, n, ins, _refuse)
    except _Mixes:
        return UNKNOWN


def _kind(graph, n, dim, where):
    """"rows" or "sums" where step n can run on a part of the batch, else None."""
    record, shape = get_op(graph.op(n)), graph.shape(n)
    if record.parts is None or not graph.node(n)["device"].startswith("cpu"):
        return None
    operands = graph.operands(n)
    axes = _operand_axes(graph, n, where)
    if 0 not in axes or any(a is not None and a != 0 for a in axes):
        return None
    if any(graph.shape(u)[0] != dim for u, a in zip(operands, axes) if a == 0):
        return None
    if record.kind == "elementwise" and any(a is None and len(graph.shape(u)) == len(shape) and graph.shape(u)[0] != 1
                                            for u, a in zip(operands, axes)):
        return None   # read whole, it would be indexed by the part's rows (a bound batch's size met by chance)
    if record.parts == "sums":
        return "sums" if shape != () else None
    if where[n] == 0 and shape and shape[0] == dim:
        return "rows"
    if where[n] == ("reduced", "sum") and shape != ():
        return "sums"
    return None


def part_runs(graph, steps, dims, fits=None):
    """The runs of `steps` (a plain entry's, in order): [{"first", "last" (step indices), "nodes",
    "sliced" (values cut by images: the function's arguments), "summed" (values summed over the
    images), "dim" (the batch dim), "image_work" (conv flops one image costs the run)}].
    fits(first, last, nodes): whether a run may hold those nodes (the memory plan's peak,
    passes/memory.py keeps_the_peak); a run that may not ends before the step that would not fit."""
    rows = batch_rows(graph)
    if rows is None or conv_cores.cores() < 2:   # (on one core a run is a whole batch's call)
        return []
    if not any(get_op(graph.op(n)).part_work for n in steps):   # no run would be worth a hand-off
        return []
    dim, leaves = rows
    where = batch_axes(graph, steps, dim, leaves)
    runs, run = [], None
    for t, n in enumerate(steps):
        record = get_op(graph.op(n))
        if record.kind == "leaf" or is_view(graph, n):
            continue   # not a statement of the function, or a view: made before the run
        kind = _kind(graph, n, dim, where)
        if run is not None and (kind is None or any(base(graph, u) in run["summed"] for u in graph.operands(n))
                                or n in run["nodes"]   # recomputed: one variable may not name two buffers in a run
                                or (fits is not None and not fits(run["first"], t, run["nodes"] + [n]))):
            runs.append(run)
            run = None
        if kind is None:
            continue
        if run is None:
            run = {"first": t, "nodes": [], "sliced": [], "summed": [], "dim": dim}
        run["last"] = t
        run["nodes"].append(n)
        for u in list(graph.operands(n)) + [n]:
            if where.get(u) == 0 and u not in run["sliced"]:
                run["sliced"].append(u)
        if kind == "sums":
            run["summed"].append(n)
    if run is not None:
        runs.append(run)
    for r in runs:
        r["image_work"] = image_work(graph, r["nodes"], dims)
    return [r for r in runs if _worth_a_hand_off(graph, r, dims)]


def is_view(graph, n):
    """A view made before a run: it reads no data (a reshape to a number reads its one value)."""
    return get_op(graph.op(n)).view and base(graph, n) != n


def image_work(graph, nodes, dims):
    """The conv flops one image costs `nodes` (their records' part_work), or None where unknown."""
    each = [get_op(graph.op(n)).part_work(graph, n, dims) for n in nodes if get_op(graph.op(n)).part_work]
    return sum(each) if each and all(isinstance(e, int) for e in each) else None


def _worth_a_hand_off(graph, run, dims):
    """Whether a run is more than a lone kernel, holds an op worth a hand-off whose work per image is
    known, and (a bound batch) would run in more than one part."""
    if len(run["nodes"]) < 2 or run["image_work"] is None:
        return False
    n_img = run["dim"] if isinstance(run["dim"], int) else dims.get(run["dim"])
    return n_img is None or conv_cores.planned_parts(n_img, n_img * run["image_work"], conv_cores.cores()) > 1


def extend_over_runs(graph, tensors, runs):
    """Each tensor a run reads or writes lives from the run's first step to its last at least."""
    for run in runs:
        touched = {base(graph, u) for n in run["nodes"] for u in list(graph.operands(n)) + [n]}
        for t in tensors:
            # (a tensor an in-place reader shares with its operands holds them too: passes/in_place.py)
            if touched & {t["node"], *t.get("over", ())} and t["start"] <= run["last"] and t["end"] >= run["first"]:
                t["start"], t["end"] = min(t["start"], run["first"]), max(t["end"], run["last"])
