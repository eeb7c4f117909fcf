"""Batch statistics and other ops that mix rows in lr_grad's perturbed copies (passes/likelihood_ratio.py):
batch norm's mean and variance over the rows, read back by the rows (h - mu) / sqrt(var + eps); a
contrastive loss's za @ zb.T.

Each of the K copies is a batch of its own, so a statistic is taken over each copy's B rows: the
stacked value (..., KB_lr, ...) is seen as (..., K_lr, B, ...) and reduced over B, giving one statistic
per copy, (K_lr,) + its shape in the model. An elementwise op of statistics (and values without rows)
is one too; an elementwise op that reads a statistic and a value with rows reads the statistic
broadcast to the stacked rows (K_lr, B) seen as KB_lr, so each row reads its own copy's statistic. The
statistic carries each row's noise to every row of its copy, so a site whose value reaches one pairs
its noise with the whole copy's loss (likelihood_ratio.pairing: "sample"). A loss that is not affine in
its reduction over rows (sqrt of a mean squared error, the log of a mean) is such a statistic too: one
loss per copy, which every site's noise pairs with.

An op that mixes rows in any other way (za @ zb.T, a softmax over the batch axis, h.T @ h) or reads a
statistic other than elementwise runs once per copy (`lift`): by its record's `batched` rule, over the
copies' axis in front of each operand. Its result is a statistic, (K_lr,) + its shape, unless an axis of
it holds the batch's rows (za @ zb.T's two, a softmax over the rows' one): then that axis holds rows again
(each copy's values stacked on it), so the ops after it are stacked as any other; every site whose noise
reaches it pairs with its copy's whole loss.

Which reductions over the rows are statistics, and which the loss's (kept per row, lr_shares.py), is
seen where an op reads one together with batch rows: the builder is run again with those reductions
taken as statistics (`Statistic`).

A param applied to a statistic (gamma / sqrt(var + eps), h - s * mu) is a site whose value is a statistic:
its noise is drawn per copy, (K_lr,) + its shape, and pairs with the copy's whole loss ("copy"). Which
such values the rows read is known only once the forward is built, so they too are found by building
again (`Statistic.sites`); one the loss alone reads is differentiated exactly (exact_parts)."""
from gradc.ops import get_op, rows_of
from gradc.shapes import fmt

from .lr_shares import rows_first, share_rows
from .lr_sites import K, KB, Unsupported

STAT = "statistic"   # where a batch statistic has its rows: none of its own, one value per copy
REDUCTIONS = ("sum", "mean", "max")


class Statistic(Unsupported):
    """The reductions over the rows an op reads with batch rows, to be built again as statistics; or
    `sites`: values of statistics and params that the rows read (batch norm's folded scale
    gamma / sqrt(var + eps)), to be built again as sites with noise on each copy's value."""

    def __init__(self, nodes, why, sites=()):
        super().__init__(why)
        self.nodes, self.sites = set(nodes), set(sites)


class BatchStatistics:
    def __init__(self, builder, nodes):
        self.b = builder
        self.nodes = set(nodes)   # the reductions over the rows that are statistics
        self.used = []            # those built, and the ops run per copy (lift)
        self.made = {}            # an op run per copy -> the nodes of its copy, in order

    def origins(self, n, ins, why, sites=()):
        """Raise Statistic when op n, which cannot read a reduction over the rows as the loss's (kept per
        row), reads one not yet taken as a statistic: batch norm's rows read it back, or the loss is not
        affine in it (sqrt(mse)). `why` is the reason n gives; `sites`, values to build as sites on them."""
        b, g = self.b, self.b.g
        found, stack, seen = set(), [u for u, w in zip(g.operands(n), ins) if isinstance(w, tuple)], set()
        while stack:
            u = stack.pop()
            if u in seen or not isinstance(b.where.get(u), tuple):
                continue
            seen.add(u)
            operands = g.operands(u)
            if g.op(u) in REDUCTIONS and isinstance(b.where.get(operands[0]), int):
                found.add(u)
            else:
                stack.extend(operands)
        if found - self.nodes:
            raise Statistic(found, why, sites)

    def refused(self, n, ins, why):
        """Raise Statistic when n is a reduction over the rows that the loss's rule refuses (a max over the
        rows: max-scaling, h - h.max(0)), not yet taken as a statistic."""
        g = self.b.g
        if g.op(n) in REDUCTIONS and isinstance(ins[0], int) and ins[0] in g.attrs(n)["axes"] \
                and n not in self.nodes:
            raise Statistic({n}, why)

    def reduce(self, n):
        """n, a reduction over axes that hold the rows, as one statistic per copy: (K_lr,) + n's shape."""
        b, g = self.b, self.b.g
        (u,) = g.operands(n)
        a, shape, src = b.where[u], tuple(g.shape(u)), g.node(n)["src"]
        view = b.view(b.stacked(u), shape[:a] + (K, b.batch) + shape[a + 1:])
        axes, keepdims = tuple(g.attrs(n)["axes"]), bool(g.attrs(n).get("keepdims"))
        r = b.apply(g.op(n), [view], src, axes=tuple(x + (x >= a) for x in axes), keepdims=keepdims)
        at = a if keepdims else a - sum(x < a for x in axes)   # where the copies' axis is now: to the front
        if at:
            r = b.apply("transpose", [r], src, axes=(at,) + tuple(x for x in range(len(g.shape(r))) if x != at))
        b.copy[n] = b.view(r, (K,) + tuple(g.shape(n)))
        self.used.append(n)
        return STAT

    def apply(self, n, ins):
        """Elementwise op n reading a statistic: a statistic itself when no operand has rows, else rows
        (on the axis n has them) that read their own copy's statistic."""
        b, g = self.b, self.b.g
        src, shape, op, attrs = g.node(n)["src"], tuple(g.shape(n)), g.op(n), dict(g.attrs(n))
        why = (f"{src}: {g.describe(n)} reads a batch statistic (a sum, mean or max over the rows that the rows "
               f"read back, as batch norm's, or a loss not affine in its reduction over rows)")
        if any(isinstance(w, tuple) for w in ins):   # another reduction over the rows: a statistic too
            self.origins(n, ins, why)
            raise Unsupported(f"{why} and the loss's per-row shares; or train this model with loss_and_grad")
        if get_op(op).kind != "elementwise" or "shape" in attrs or not any(isinstance(w, int) for w in ins):
            return self.lift(n, ins, why)   # of statistics (and shared values) alone, or not elementwise

        def fail(why):
            raise Unsupported(f"{src}: {g.describe(n)} {why}")
        try:
            r = share_rows(g, n, [None if w == STAT else w for w in ins], fail)
            ops = [self.spread(u, len(shape), r) if w == STAT else b.stacked(u) for u, w in zip(g.operands(n), ins)]
        except Unsupported as e:   # the rows meet each other, or a statistic on an axis of theirs that is not 1
            return self.lift(n, ins, str(e))
        b.copy[n] = b.apply(op, ops, src, **attrs)   # an op like any other on the stacked rows (a site's sum
        return r                                      # may go on through it: its VJP is the op's own)

    def lift(self, n, ins, why):
        """n run once per copy (each copy is a batch of its own), by its record's `batched` rule: an operand
        with rows seen as (K_lr,) + its shape, a statistic as it is, the others shared. The result is a
        statistic, unless an axis of it holds rows again (rows_axis): then it is rows on that axis (each
        copy's values stacked there, as any value with rows; an op after it that mixes them is run per
        copy in turn). Every site whose noise reaches n pairs with its copy's whole loss (`used`).
        An op of values no noise reaches is the same in every copy: made once, on the batch's B rows, as the
        model makes it. `why`: what n does to the rows, for the refusal of an op without the rule."""
        b, g = self.b, self.b.g
        src, shape = g.node(n)["src"], tuple(g.shape(n))
        axis = self.rows_axis(n, ins)
        if STAT not in ins and all(u in b.clean for u, w in zip(g.operands(n), ins) if w is not None) \
                and n not in b.inner and (axis is not None or n not in b.tops):
            # no noise reaches it (inputs alone): the same in every copy, made once (a site without rows is
            # run per copy below, so that its VJP reaches its params)
            if axis is not None:
                b.clean.add(n)
                return axis
            once = b.view(b.own(n), (1,) + shape)
            b.copy[n] = b.apply("broadcast_to", [once], src, shape=(K,) + shape)
            return STAT
        operands = [b.stacked(u) if w == STAT else self.per_copy(u) if isinstance(w, int) else u
                    for u, w in zip(g.operands(n), ins)]
        batched, made = get_op(g.op(n)).batched, []   # made: the nodes of n's copy, for a site's VJP through them
        emit = lambda kind, inputs, **attrs: made.append(b.apply(kind, inputs, src, **attrs)) or made[-1]
        out = batched(g, n, operands, [w is not None for w in ins], emit) if batched else None
        if out is None:
            copied = ", ".join(g.describe(u) for u, w in zip(g.operands(n), ins) if w is not None)
            raise Unsupported(f"{why}; lr_grad runs an op that mixes the batch's rows once per perturbed copy, but "
                              f"{g.op(n)} has no form for a copy of each of {copied}; or train this model with "
                              f"loss_and_grad")
        self.used.append(n)
        self.made[n] = made
        if axis is None:
            b.copy[n] = out
            return STAT
        if axis:   # the copies' axis moved to just before it
            out = emit("transpose", [out], axes=tuple(range(1, axis + 1)) + (0,)
                       + tuple(range(axis + 1, len(shape) + 1)))
        b.copy[n] = b.view(out, shape[:axis] + (KB,) + shape[axis + 1:])
        made.append(b.copy[n])
        return axis

    def rows_axis(self, n, ins):
        """The axis of lifted op n's result that holds rows again, or None: where the rows of one operand go
        through n by its record's rule, taken alone (za @ zb.T: za's on axis 0, zb's on 1; a reduction or
        product over them: none), the first such axis of the batch's size. Else any axis that has the batch
        dim as the model declared it (a softmax over the rows keeps them on their axis): told apart from
        another dim that --bind gave the same size (Barlow Twins' (6, 6) with the batch bound to 6 stays a
        statistic)."""
        b, g = self.b, self.b.g
        shape = tuple(g.shape(n))

        def fail(why):
            raise Unsupported(why)
        found = []
        for i, w in enumerate(ins):
            if isinstance(w, int):
                try:
                    a = rows_of(g, n, [w if j == i else None for j in range(len(ins))], fail)
                except Unsupported:
                    continue
                if isinstance(a, int) and shape[a] == b.batch:
                    found.append(a)
        if found:
            return min(found)
        declared = g.declared_shapes.get(n)   # (the model's nodes: as the model declared them, before --bind)
        if isinstance(b.declared, str) and declared is not None:
            return next((a for a, d in enumerate(declared) if d == b.declared), None)
        return next((a for a, d in enumerate(shape) if d == b.batch), None) if isinstance(b.batch, str) else None

    def per_copy(self, u):
        """Value u, which has rows, as (K_lr,) + its shape: each copy's rows on their axis."""
        b, g = self.b, self.b.g
        a, shape = b.where[u], tuple(g.shape(u))
        x = b.view(b.stacked(u), shape[:a] + (K, b.batch) + shape[a + 1:])
        emit = lambda kind, inputs, **attrs: b.apply(kind, inputs, g.node(u)["src"], **attrs)
        return rows_first(x, a, len(shape) + 1, emit)   # (the copies' axis in front)

    def loss_shares(self, loss):
        """A loss that is itself a statistic (not affine in its reduction over rows: sqrt of an mse) as
        shares (KB_lr,): each copy's loss split evenly over its rows (its noise pairs with the copy's
        whole loss anyway)."""
        b, g = self.b, self.b.g
        count = b.apply("count", [], g.node(loss)["src"], dims=(b.batch,), dtype=g.dtype(loss))
        per_copy = b.apply("div", [b.view(b.stacked(loss), (K, 1)), count])
        return b.view(b.apply("broadcast_to", [per_copy], shape=(K, b.batch)), (KB,))

    def spread(self, u, rank, r):
        """Statistic u read by an op of `rank` whose rows are on axis r: broadcast to the stacked rows, each
        row its own copy's value, laid out as u is read there (its shape right-aligned; KB_lr on the rows'
        axis where u's shape reaches it, in front where it does not)."""
        b, g = self.b, self.b.g
        s, src = tuple(g.shape(u)), g.node(u)["src"]
        i = r - (rank - len(s))   # the rows' axis in u's own shape (< 0: u's shape does not reach it)
        if i < 0:
            split = b.view(b.stacked(u), (K, 1) + (1,) * (-i - 1) + s)   # (K_lr, B=1, 1..., s)
            i = 0
        elif s[i] != 1:
            raise Unsupported(f"{src}: {g.describe(u)} {fmt(s)}, a batch statistic, is read by rows on its axis {i}, "
                              f"which is not 1")
        elif i == 0:
            split = b.stacked(u)   # (K_lr,) + s: s[0], the 1 the rows read it on, after the copies' axis
        else:   # K_lr moved to axis i, before the 1 the rows read it on
            split = b.apply("transpose", [b.stacked(u)], src,
                            axes=tuple(range(1, i + 1)) + (0,) + tuple(range(i + 1, len(s) + 1)))
        shape = list(g.shape(split))
        shape[i + 1] = b.batch
        full = b.apply("broadcast_to", [split], src, shape=tuple(shape))
        return b.view(full, tuple(shape[:i]) + (KB,) + tuple(shape[i + 2:]))
