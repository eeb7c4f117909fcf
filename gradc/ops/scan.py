"""gc.scan as an op with a body (DESIGN.md §1.8): `scan` runs a sub-graph once per step, `scan_out`
names one of its results.

A `scan` node is a region: attrs["body"] is a gradc.ir.Graph whose inputs (placeholder leaves, in
this order) are the K carries, the X per-step slices and the closed-over values, and whose outputs
are the K new carries, then the M per-step outputs y_t. The scan node's operands are the values
those leaves stand for: the K initial carries, the X stacked sequences (T, ...) and the closed-over
outer values, so the outer graph's edges stay complete. The node itself is a token of shape ();
its results are `scan_out` nodes (attrs index, shape, dtype), which the scan's statement writes:

    index 0..K-1          the final carries
    K..K+M-1              the ys, stacked on axis 0 (T, ...), ys[t] the output of step t
    K+M..2K+M-1           the carry stacks: stack[t] the carry step t reads
    2K+M..3K+M-1          the out stacks: ostack[t] the carry step t writes
    3K+M..4K+M-1          the checkpoints (with attrs checkpoint_every = k): checkpoint[c] the carry
                          the (c*k)-th step run reads, ceil(T/k) of them

A reverse scan runs t = T-1 .. 0 (as jax.lax.scan(reverse=True)); stacks are indexed by t either
way. Carries and ys have rank >= 1 (the DSL and the VJP wrap scalars as (1,)).

Carry checkpoints (passes/scan_checkpoint.py, under --memory-budget): a forward scan with
attrs["checkpoint_every"] = k can also write checkpoints, the carry every k-th step reads. Its
backward scan then has attrs["recompute_every"] = k and attrs["recompute_body"] (the forward's
body): its stack operands are those checkpoints, it has no operands for the out stacks, and its
loop runs the forward body again over each segment of k steps (from the segment's checkpoint)
before that segment's backward steps: ceil(T/k) + k + 1 carries instead of 2T, for one more
forward. The full stacks stay results of the forward scan for whatever else reads them (a
second-order scan in the hvp entry), so an entry that does not read them never writes them.

The VJP of a scan is a scan the other way round whose body is the step's VJP (built by
passes/autodiff.py on a copy of the body): its carries are the adjoints of the carries and the
running sums of the closed-over values' gradients, its slices the saved stacks, the slices, and
the adjoints of the ys and stacks. The backward body reads the carry each step wrote from the out
stack instead of computing it again. Since that body is built of registered ops too, its own VJP
is one more scan: HVPs go through scans.
"""
import copy

import numpy as np
import sympy as sp

from . import Op, get_op, register, rows_of
from ..errors import ShapeError
from ..shapes import bind_dims, fmt, size
from .scan_layout import (CHECKPOINT, FINAL, OSTACK, STACK, YS, checkpoints, forward_attrs, index_of,  # noqa: F401
                          kind_of, length_operand, operand_leaves, parts, recompute_leaves, vjp_of, _frozen)
from .scan_loop import lower_scan, lower_scan_cuda


def result_type(attrs, index, length):
    """(shape, dtype) of result `index` of a scan whose sequences have `length` steps."""
    body, leaves, outputs, K, _, _, _ = parts(attrs)
    kind, i = kind_of(attrs, index)
    node = outputs[K + i] if kind == YS else outputs[i]
    shape = tuple(body.shape(node))
    if kind == CHECKPOINT:
        length = checkpoints(length, attrs["checkpoint_every"])
    return (shape if kind == FINAL else (length,) + shape), body.dtype(node)


def steps(graph, n):
    """T of scan node n."""
    return graph.shape(graph.operands(n)[length_operand(graph.attrs(n))])[0]


def _scan_infer(attrs, shapes, dtypes):
    body, leaves, outputs, K, X, C, M = parts(attrs)
    if X < 1:
        raise ShapeError("a scan needs at least one sequence to scan over")
    held = operand_leaves(attrs)
    if len(shapes) != len(held):
        raise ShapeError(f"the body has {len(held)} leaves with operands, the scan {len(shapes)} operands")
    kept = {j for (what, _), j in recompute_leaves(attrs).items() if what == STACK + "_in"}
    for o, (j, shape, dtype) in enumerate(zip(held, shapes, dtypes)):
        leaf = leaves[j]
        want = shape[1:] if K <= j < K + X else shape
        if tuple(body.shape(leaf)) != tuple(want) or body.dtype(leaf) != dtype:
            raise ShapeError(f"operand {o} {fmt(shape)} {dtype} does not match the body's leaf "
                             f"{fmt(body.shape(leaf))} {body.dtype(leaf)}")
    lengths = {shape[0] for j, shape in zip(held, shapes) if K <= j < K + X and j not in kept}
    if len(lengths) > 1:
        raise ShapeError(f"the scanned sequences differ in length: {', '.join(map(str, lengths))}")
    if kept:
        (T,) = lengths
        want = checkpoints(T, attrs["recompute_every"]) if isinstance(T, int) else None
        for j, shape in zip(held, shapes):
            if j in kept and want is not None and shape[0] != want:
                raise ShapeError(f"a stack of checkpoints has {shape[0]} carries; {T} steps kept every "
                                 f"{attrs['recompute_every']} need {want}")
    for k in range(K):
        out = outputs[k]
        if tuple(body.shape(out)) != tuple(shapes[k]) or body.dtype(out) != dtypes[k]:
            raise ShapeError(f"carry {k}: the step returns {fmt(body.shape(out))} {body.dtype(out)} for a carry of "
                             f"{fmt(shapes[k])} {dtypes[k]}")
    for o in outputs:
        if body.shape(o) == ():
            raise ShapeError("carries and per-step outputs of a scan node have rank >= 1")
    return (), dtypes[0]


def _scan_length(attrs, values):
    return np.shape(values[length_operand(attrs)])[0]


def run(attrs, values, dims=None):
    """The results of a scan (a tuple in result order), by the numpy interpreter, T times."""
    if attrs.get("recompute_every"):
        plain = {k: v for k, v in attrs.items() if k not in ("recompute_every", "recompute_body")}
        return run(plain, _recomputed(attrs, values, dims), dims)
    results = _run(attrs, values, dims)
    every = attrs.get("checkpoint_every")
    if not every:
        return results
    _, _, _, K, _, _, M = parts(attrs)
    T = _scan_length(attrs, values)
    runs = range(0, T, every)
    return results + tuple(r[[T - 1 - f for f in runs] if attrs.get("reverse") else list(runs)]
                           for r in results[K + M:2 * K + M])


def _recomputed(attrs, values, dims):
    """Every leaf value of a recomputing backward scan: its stacks and out stacks rebuilt from the
    checkpoints by the forward body, one segment of `every` steps at a time (as its loop does)."""
    _, leaves, _, _, _, _, _ = parts(attrs)
    rc, every = recompute_leaves(attrs), attrs["recompute_every"]
    full = [None] * len(leaves)
    for j, v in zip(operand_leaves(attrs), values):
        full[j] = np.asarray(v)
    fattrs = forward_attrs(attrs)
    _, _, _, KF, XF, CF, _ = parts(fattrs)
    xs = [full[rc[("x", j)]] for j in range(XF)]
    closed = [full[rc[("closed", j)]] for j in range(CF)]
    kept = [full[rc[(STACK + "_in", k)]] for k in range(KF)]
    T = len(xs[0])
    stacks = [np.zeros((T,) + c.shape[1:], c.dtype) for c in kept]
    ostacks = [np.zeros_like(s) for s in stacks]
    for c in range(checkpoints(T, every)):
        f0, f1 = c * every, min(T, (c + 1) * every)
        seg = slice(T - f1, T - f0) if fattrs["reverse"] else slice(f0, f1)
        got = _run(fattrs, [k[c] for k in kept] + [x[seg] for x in xs] + closed, dims)
        for k in range(KF):
            stacks[k][seg] = got[index_of(fattrs, STACK, k)]
            ostacks[k][seg] = got[index_of(fattrs, OSTACK, k)]
    for (what, k), j in rc.items():
        if what == STACK + "_in":
            full[j] = stacks[k]
        elif what == OSTACK + "_in":
            full[j] = ostacks[k]
    return full


def _run(attrs, values, dims=None):
    from ..interpret import evaluate
    body, leaves, outputs, K, X, C, M = parts(attrs)
    names = list(body.inputs)
    T = _scan_length(attrs, values)
    floats = [np.asarray(v).dtype for v in values if np.asarray(v).dtype.kind == "f"]
    dtype = floats[0] if floats else np.float64
    carries = [np.asarray(v) for v in values[:K]]
    xs, closed = values[K:K + X], values[K + X:]
    bound = dict(dims or {})
    for leaf, v in zip(leaves, values):
        for d, actual in zip(body.shape(leaf), np.shape(v)[1:] if leaves.index(leaf) in range(K, K + X) else np.shape(v)):
            if isinstance(d, str):
                bound[d] = actual
    shape_of = lambda n: tuple(bound.get(d, d) if isinstance(d, str) else d for d in body.shape(n))
    kept = lambda n: dtype if body.dtype(n).startswith("float") else np.dtype(body.dtype(n))   # int ys stay ints
    ys = [np.zeros((T,) + shape_of(outputs[K + m]), kept(outputs[K + m])) for m in range(M)]
    stacks = [np.zeros((T,) + c.shape, dtype) for c in carries]
    ostacks = [np.zeros((T,) + c.shape, dtype) for c in carries]
    for t in (range(T - 1, -1, -1) if attrs.get("reverse") else range(T)):
        inputs = dict(zip(names, carries + [np.asarray(x)[t] for x in xs] + list(closed)))
        got = evaluate(body, {}, inputs, list(dict.fromkeys(outputs)), dtype=dtype)
        for k in range(K):
            stacks[k][t] = carries[k]
        carries = [np.asarray(got[o], dtype=dtype).copy() for o in outputs[:K]]
        for k in range(K):
            ostacks[k][t] = carries[k]
        for m in range(M):
            ys[m][t] = got[outputs[K + m]]
    return tuple(carries + ys + stacks + ostacks)


def _scan_evaluate(attrs, values, out_shape, dims):
    token = np.empty((), dtype=object)
    token[()] = run(attrs, values, dims)
    return token


def body_flops(body, outputs=None):
    """One step's FLOPs: of the whole body, or only of what `outputs` need."""
    total = sp.Integer(0)
    for n in (body.nx.nodes if outputs is None else body.ancestors(outputs)):
        node = body.node(n)
        total += sp.sympify(get_op(node["op"]).flops(node["attrs"], [body.shape(u) for u in node["inputs"]],
                                                     node["shape"]))
    return total


def _scan_flops(attrs, in_shapes, out_shape):
    """T steps of the body, and on a recomputing backward scan T more of the forward's carries."""
    T = sp.sympify(size(in_shapes[length_operand(attrs)][:1]))
    total = T * body_flops(attrs["body"])
    if attrs.get("recompute_every"):
        total += T * recompute_step_flops(attrs)
    return total


def recompute_step_flops(attrs):
    """What a recomputing backward scan spends per step running its forward's carries again."""
    fbody, _, fouts, KF, _, _, _ = parts(forward_attrs(attrs))
    return body_flops(fbody, fouts[:KF])


# ---- results ---------------------------------------------------------------------------------
def _out_infer(attrs, shapes, dtypes):
    if shapes != [()]:
        raise ShapeError("scan_out reads one scan node")
    return tuple(attrs["shape"]), attrs["dtype"]


def _out_evaluate(attrs, values, out_shape, dims):
    return np.asarray(values[0][()][attrs["index"]])


def result(graph, n, kind, i, emit):
    """The scan_out node of result (kind, i) of scan n: the one there is, or a new one made by `emit`."""
    attrs = graph.attrs(n)
    index = index_of(attrs, kind, i)
    for u in graph.users(n):
        if graph.op(u) == "scan_out" and graph.attrs(u)["index"] == index:
            return u
    shape, dtype = result_type(attrs, index, steps(graph, n))
    return emit("scan_out", [n], index=index, shape=shape, dtype=dtype)


# ---- the VJP: a scan the other way round --------------------------------------------------------
def _placeholder(body, name, shape, dtype, src):
    n = body.apply("input", attrs={"shape": tuple(shape), "dtype": dtype}, src=src, name=name)
    body.inputs[name] = n
    return n


def _zeros(graph, shape, dtype, src, phase="forward"):
    z = graph.apply("const", attrs={"value": 0.0, "shape": (), "dtype": dtype}, src=src, phase=phase)
    return graph.apply("broadcast_to", [z], {"shape": tuple(shape)}, src=src, phase=phase) if shape else z


def backward_body(attrs, needs, present, src):
    """The body of the VJP scan of a scan with `attrs`.

    needs: per operand of the scan, whether its adjoint is wanted; present: which adjoints of the
    results are given ({(kind, i)}). Returns (body, K', X', layout) where layout lists what each
    leaf of the new body stands for (("lam", k), ("acc", j), ("stack", k), ("ostack", k), ("x", j),
    (YS, m), (STACK, k), (OSTACK, k), ("closed", j)) and what each output is (("dcarry", k),
    ("dclosed", j), ("dx", j))."""
    from gradc.passes.autodiff import differentiate
    fbody, fleaves, fouts, K, X, C, M = parts(attrs)
    bw = copy.deepcopy(fbody)
    bw.name = fbody.name + "_vjp"
    old_inputs = list(bw.inputs.items())
    bw.inputs, bw.outputs = {}, {}
    carries_in = [n for _, n in old_inputs[:K]]
    x_in = [n for _, n in old_inputs[K:K + X]]
    closed_in = [n for _, n in old_inputs[K + X:]]
    out_carry, out_y = fouts[:K], fouts[K:]
    diff_closed = [j for j in range(C) if needs[K + X + j] and bw.dtype(closed_in[j]).startswith("float")]
    diff_x = [j for j in range(X) if needs[K + j] and bw.dtype(x_in[j]).startswith("float")]
    layout_in, layout_out = [], []
    # leaves, in the order of the new scan's operands: carries (lam, acc), slices, closed values
    lam = []
    for k in range(K):
        lam.append(_placeholder(bw, f"lam{k}", bw.shape(out_carry[k]), bw.dtype(out_carry[k]), src))
        layout_in.append(("lam", k))
    acc = {}
    for j in diff_closed:
        shape = bw.shape(closed_in[j]) or (1,)
        acc[j] = _placeholder(bw, f"acc{j}", shape, bw.dtype(closed_in[j]), src)
        layout_in.append(("acc", j))
    # the slices: each step's carry in and out (saved by the forward), its x, the given adjoints
    renamed = {}
    for k, n in enumerate(carries_in):
        bw.node(n)["name"] = f"c{k}"
        bw.inputs[f"c{k}"] = n
        layout_in.append((STACK + "_in", k))
    saved_out = {}
    for k in range(K):
        if bw.op(out_carry[k]) not in ("input", "param", "const"):
            saved_out[k] = _placeholder(bw, f"cn{k}", bw.shape(out_carry[k]), bw.dtype(out_carry[k]), src)
            layout_in.append((OSTACK + "_in", k))
    for j, n in enumerate(x_in):
        bw.node(n)["name"] = f"x{j}"
        bw.inputs[f"x{j}"] = n
        layout_in.append(("x", j))
    given = {}
    for kind, i in sorted(present):
        node = out_y[i] if kind == YS else out_carry[i]
        given[(kind, i)] = _placeholder(bw, f"g{kind}{i}", bw.shape(node), bw.dtype(node), src)
        layout_in.append((kind, i))
    for j, n in enumerate(closed_in):
        bw.node(n)["name"] = f"k{j}"
        bw.inputs[f"k{j}"] = n
        layout_in.append(("closed", j))
    del renamed
    # seeds: the adjoint of each new carry (lam, plus the out stack's adjoint) and of each y
    seeds = []
    for k in range(K):
        seeds.append((out_carry[k], lam[k]))
        if (OSTACK, k) in given:
            seeds.append((out_carry[k], given[(OSTACK, k)]))
    for m in range(M):
        if (YS, m) in given:
            seeds.append((out_y[m], given[(YS, m)]))
    wrt = carries_in + [x_in[j] for j in diff_x] + [closed_in[j] for j in diff_closed]
    before = set(bw.nx.nodes)
    adj = differentiate(bw, None, wrt, phase="forward", seeds=seeds)
    # the backward reads each carry the step wrote from the forward's out stack
    for k, cn in saved_out.items():
        for u in list(bw.users(out_carry[k])):
            if u not in before:
                bw.set_operands(u, [cn if v == out_carry[k] else v for v in bw.operands(u)])
    outs = []
    for k in range(K):
        d = adj.get(carries_in[k])
        if (STACK, k) in given:
            d = given[(STACK, k)] if d is None else bw.apply("add", [d, given[(STACK, k)]], src=src)
        outs.append(d if d is not None else _zeros(bw, bw.shape(carries_in[k]), bw.dtype(carries_in[k]), src))
        layout_out.append(("dcarry", k))
    for j in diff_closed:
        d = adj.get(closed_in[j])
        if d is not None:
            if bw.shape(d) != bw.shape(acc[j]):
                d = bw.apply("reshape", [d], {"shape": bw.shape(acc[j])}, src=src)
            d = bw.apply("add", [acc[j], d], src=src)
        outs.append(acc[j] if d is None else d)
        layout_out.append(("dclosed", j))
    for j in diff_x:
        d = adj.get(x_in[j])
        shape = bw.shape(x_in[j])
        d = d if d is not None else _zeros(bw, shape, bw.dtype(x_in[j]), src)
        if shape == ():
            d = bw.apply("reshape", [d], {"shape": (1,)}, src=src)
        outs.append(d)
        layout_out.append(("dx", j))
    for i, o in enumerate(outs):
        bw.outputs[f"o{i}"] = o
    from gradc.passes.simplify import eliminate_dead
    eliminate_dead(bw)
    return bw, K + len(diff_closed), layout_in, layout_out, diff_closed, diff_x


def _scan_vjp(ctx, n, gs):
    """gs: result index -> its adjoint node. Returns the adjoint of each operand."""
    g = ctx.graph
    attrs = g.attrs(n)
    fbody, fleaves, fouts, K, X, C, M = parts(attrs)
    if attrs.get("recompute_every") or attrs.get("checkpoint_every"):
        raise AssertionError("carry checkpoints are planned after every VJP is built (passes/scan_checkpoint.py)")
    operands = g.operands(n)
    needs = [ctx.needs(i) for i in range(len(operands))]
    present = {kind_of(attrs, i) for i, a in gs.items() if a is not None and kind_of(attrs, i)[0] != FINAL}
    bw, K2, layout_in, layout_out, diff_closed, diff_x = backward_body(attrs, needs, present, ctx.src)
    emit = ctx.emit
    ops = []
    for what, i in layout_in:
        if what == "lam":
            a = gs.get(index_of(attrs, FINAL, i))
            ops.append(a if a is not None else _zeros(g, g.shape(operands[i]), g.dtype(operands[i]), ctx.src, ctx.phase))
        elif what == "acc":
            u = operands[K + X + i]
            ops.append(_zeros(g, g.shape(u) or (1,), g.dtype(u), ctx.src, ctx.phase))
        elif what == STACK + "_in":
            ops.append(result(g, n, STACK, i, emit))
        elif what == OSTACK + "_in":
            ops.append(result(g, n, OSTACK, i, emit))
        elif what == "x":
            ops.append(operands[K + i])
        elif what in (YS, STACK, OSTACK):
            ops.append(gs[index_of(attrs, what, i)])
        else:
            ops.append(operands[K + X + i])
    X2 = len(ops) - K2 - C
    node = emit("scan", ops, body=bw, carries=K2, xs=X2, reverse=not attrs.get("reverse", False),
                vjp=vjp_info(attrs, layout_in))
    grads = [None] * len(operands)
    battrs = g.attrs(node)
    for o, (what, i) in enumerate(layout_out):
        if what == "dcarry" and needs[i]:
            grads[i] = result(g, node, FINAL, o, emit)
        elif what == "dclosed":
            u = operands[K + X + i]
            r = result(g, node, FINAL, o, emit)
            grads[K + X + i] = r if g.shape(r) == g.shape(u) else emit("reshape", [r], shape=g.shape(u))
        elif what == "dx":
            u = operands[K + i]
            r = result(g, node, YS, o - K2, emit)
            grads[K + i] = r if g.shape(r) == g.shape(u) else emit("reshape", [r], shape=g.shape(u))
    del battrs
    return grads


# ---- BPPSA (DESIGN.md §1.8): what the backward scan's loop needs to scan the adjoints in parallel --
class _NotPerRow(Exception):
    pass


def _carry_per_row(body, leaves, outputs, K):
    """Whether row b of the new carries depends on row b of the old carries only (rows on axis 0 of
    every carry, all of one length): the rows rule run with only the carries' rows marked."""
    def fail(why):
        raise _NotPerRow(why)
    if any(len(body.shape(leaves[k])) < 1 for k in range(K)) or len({body.shape(leaves[k])[0] for k in range(K)}) > 1:
        return False
    try:
        where = _follow_rows(body, {leaf: (0 if j < K else None) for j, leaf in enumerate(leaves)}, fail)
    except _NotPerRow:
        return False
    return all(where.get(outputs[k]) == 0 for k in range(K))


def _follow_rows(body, seeds, fail, rows=rows_of):
    """Where the batch rows lie in every value of the body, from where they lie in its leaves
    (`seeds`), by each op's rows rule (`rows`; a step's op that fails is named with its own line)."""
    where = dict(seeds)
    for m in body.topo_order():
        if m in where:
            continue
        mins = [where[u] for u in body.operands(m)]
        if all(w is None for w in mins):
            where[m] = None
        else:
            where[m] = rows(body, m, mins, lambda why, m=m: fail(
                f"runs {body.op(m)} (at {body.node(m)['src']}) in its step, which {why}"))
    return where


def _structured(body, leaves, outputs, K, X):
    """new = f(carry @ W + rest) with W closed over, f tanh, sigmoid or none, and the carry read
    nowhere else on the way to the new carry: (f, j) with j the closed value W, else None."""
    out, carry = outputs[0], leaves[0]
    f = body.op(out) if body.op(out) in ("tanh", "sigmoid") else None
    pre = body.operands(out)[0] if f else out
    terms, todo = [], [pre]
    while todo:
        m = todo.pop()
        if body.op(m) == "add" and len(body.shape(m)) == 2:
            todo += body.operands(m)
        else:
            terms.append(m)
    hits = [m for m in terms if carry in body.ancestors([m]) or m == carry]
    if len(hits) != 1 or body.op(hits[0]) != "matmul":
        return None
    a, w = body.operands(hits[0])
    attrs = body.attrs(hits[0])
    if a != carry or attrs.get("transpose_a") or attrs.get("transpose_b") or w not in leaves[K + X:]:
        return None
    shape = body.shape(carry)
    if len(shape) != 2 or tuple(body.shape(w)) != (shape[1], shape[1]) or body.shape(out) != shape:
        return None
    return f, leaves.index(w) - K - X


def vjp_info(attrs, layout_in):
    """Recorded on a backward scan: what each of its leaves stands for (`layout`, as backward_body
    returns it), which are the given adjoints (zero when the loop takes Jacobians), whether the
    carry's Jacobian is per row, and the structured form if it has one."""
    body, leaves, outputs, K, X, C, M = parts(attrs)
    info = {"carries": K, "layout": list(layout_in),
            "zero": [j for j, (what, _) in enumerate(layout_in) if what in (YS, STACK, OSTACK)],
            "per_row": False, "structured": None, "second_order": attrs.get("vjp") is not None}
    if not all(body.dtype(leaves[k]).startswith("float") for k in range(K)):
        return _frozen(info)
    info["per_row"] = _carry_per_row(body, leaves, outputs, K)
    found = _structured(body, leaves, outputs, K, X) if K == 1 else None
    if found and info["per_row"] and (OSTACK + "_in", 0) in layout_in:
        f, j = found
        info["structured"] = {"f": f, "W": layout_in.index(("closed", j)), "cn": layout_in.index((OSTACK + "_in", 0))}
    return _frozen(info)


def use_bppsa(graph):
    """--scan-backward bppsa: every backward scan of a forward scan runs as BPPSA.
    Returns the number of scans marked. The second-order scans (VJPs of backward scans) stay reverse
    scans: their carries include the running sums of the weights' gradients, whose dense Jacobians
    would be (weights x weights) per step."""
    marked = 0
    for n in graph.nx.nodes:
        if graph.op(n) == "scan":
            info = vjp_of(graph.attrs(n))
            if info and not info["second_order"]:   # carries are float (the DSL refuses others)
                graph.attrs(n)["backward"] = "bppsa"
                marked += 1
    return marked


def _scan_rows(graph, n, ins, fail):
    """Per-row when each step is: the batch rows of the carries stay on their axis through the body,
    and the sequences carry them on an axis other than the time axis 0."""
    _, _, outputs, K, _, _, _ = parts(graph.attrs(n))
    where = body_rows(graph, n, ins, fail)
    return ScanRows(tuple(where[o] for o in outputs), K)


def body_rows(graph, n, ins, fail, rows=rows_of):
    """Where the batch rows lie in every value of scan n's body ({body node: axis or None}), from
    where they lie in its operands (`ins`), by the ops' rows rules (`rows`: lr_grad's lets a mean over
    rows be added to a sum); `fail(why)` when a step does not keep them per row."""
    attrs = graph.attrs(n)
    body, leaves, outputs, K, X, C, M = parts(attrs)
    seeds, at = {}, dict(zip(operand_leaves(attrs), ins))
    for (what, k), j in recompute_leaves(attrs).items():
        if what == OSTACK + "_in":   # filled by the loop from the stack of checkpoints: rows where those are
            at[j] = at[recompute_leaves(attrs)[(STACK + "_in", k)]]
    for j, leaf in enumerate(leaves):
        w = at[j]
        if isinstance(w, tuple):
            fail("reads the loss after its reduction over rows")
        if K <= j < K + X and w is not None:
            if w == 0:
                fail("scans along the batch dim")
            w -= 1
        seeds[leaf] = w
    for _ in range(2):   # the carries' rows after one step must be where they were before it
        where = _follow_rows(body, seeds, fail, rows)
        changed = False
        for k in range(K):
            if where[outputs[k]] != seeds[leaves[k]]:
                if seeds[leaves[k]] is not None:
                    fail("moves the batch rows of a carry to another axis")
                seeds[leaves[k]] = where[outputs[k]]
                changed = True
        if not changed:
            break
    return where


class ScanRows:
    """Where the rows lie in each result of a scan (the token is no array: its results say)."""

    def __init__(self, axes, K):
        self.axes, self.K = axes, K

    def of(self, index, M):
        K = self.K
        if index < K:
            return self.axes[index]
        if index < K + M:
            w = self.axes[index]
        else:
            w = self.axes[(index - K - M) % K]
        return w if w is None or isinstance(w, tuple) else w + 1   # (a loss term per step: reduced alike)


def _out_rows(graph, n, ins, fail):
    (w,) = ins
    scan = graph.operands(n)[0]
    _, _, _, K, _, _, M = parts(graph.attrs(scan))
    return w.of(graph.attrs(n)["index"], M) if isinstance(w, ScanRows) else w


def _scan_workspace(graph, n, dims):
    """Bytes the loop allocates beyond its results while it runs: the two buffers of each carry, a
    buffer per value of the step (its work arena; outputs counted too, an upper bound), and a
    recomputing backward's segment of carries (every + 1 of each) with the forward step's work, or
    BPPSA's affine maps ((P, rows, H, H) and (P, rows, H), P = T rounded up to a power of two);
    None while a dim is unbound."""
    attrs = graph.attrs(n)
    body, leaves, _, K, _, _, _ = parts(attrs)
    bound = lambda shape: bind_dims(shape, dims)
    shapes = [bound(body.shape(leaf)) for leaf in leaves]
    T = bound((steps(graph, n),))[0]
    step_values = [_step_values(b, bound) for b in [body] + ([attrs["recompute_body"]] if "recompute_body" in attrs else [])]
    if any(isinstance(d, str) for shape in shapes for d in shape) or isinstance(T, str) or None in step_values:
        return None
    values = 2 * sum(int(np.prod(shapes[k])) for k in range(K)) + sum(step_values)
    values += sum((attrs["recompute_every"] + 1) * int(np.prod(shapes[j]))
                  for (what, _), j in recompute_leaves(attrs).items() if what == STACK + "_in")
    if attrs.get("backward") == "bppsa":
        info = vjp_of(attrs)
        rows = shapes[0][0] if info["per_row"] else 1
        H = sum(int(np.prod(shapes[k])) for k in range(info["carries"])) // rows
        P = 1 << max(T - 1, 0).bit_length()
        values += P * rows * (H * H + H)
    return values * np.dtype(graph.dtype(n)).itemsize


def _step_values(body, bound):
    """How many values one step of `body` computes (every one gets a buffer in the loop's work arena)."""
    total = 0
    for m in body.nx.nodes:
        if body.op(m) not in ("param", "input", "const"):
            shape = bound(body.shape(m))
            if any(isinstance(d, str) for d in shape):
                return None
            total += int(np.prod(shape))
    return total


def _out_cpu(s):
    return []   # the scan's statement wrote it


register(Op("scan", "region", _scan_infer, _scan_evaluate, _scan_flops, vjp=_scan_vjp, rows=_scan_rows,
            cpu=lower_scan, cuda=lower_scan_cuda, workspace=_scan_workspace,
            doc="runs attrs['body'] once per step over axis 0 of the sequences; results are scan_out nodes"))
register(Op("scan_out", "project", _out_infer, _out_evaluate, lambda a, i, o: 0, arity=1, rows=_out_rows,
            cpu=_out_cpu, cuda=_out_cpu, doc="one result of a scan (attrs index, shape, dtype): see gradc/ops/scan.py"))
