"""Gradients without backpropagation: the likelihood-ratio estimate of lr_grad (DESIGN.md §1.9, seed 003).

Each product of the forward that has a trainable param as a factor (matmul, batch_matmul, conv2d;
with the bias added to it, when one is), each lookup of rows in a trainable table (take: an
embedding, whose VJP adds each row's cotangent into the row it read), and each other elementwise op
on batch rows that reads a param (a bias added to a value no such product just made, logits + c; a
gain h * g) is a noise site: its output z gets Gaussian noise,
z~ = z + sigma * eps, on whichever axis z has the batch rows. For z = h W (+ b),
d/dz E[l(z~)] = E[l(z~) eps] / sigma, so

    dL/dW ~ mean over samples of  h~^T (c * eps) / sigma,    dL/db ~ the same with h~^T replaced by a row sum,

c being each row's loss minus a baseline. That is the matmul's (conv2d's) own VJP applied to the
cotangent c * eps / sigma: this pass builds exactly that with the ops' VJP rules, local to each
site (no value flows back from one layer to another), so the estimate is a forward graph.

A "param" there is any value made of trainable params without batch rows (W itself, W * s, U @ V, a
standardised kernel): the forward computes it once, and a site's part goes on through it by its exact
VJP (param-sized work, no rows). A term of such values added to the loss after its reduction over rows
(an L2 penalty written in the loss, loss + 0.5) pairs with no noise: the loss's shares keep its linear
part only, and the params' parts through the term are the exact VJP from the loss (exact_parts). A
factor of such values scaling the loss there (l1 * exp(-s1) + s1) scales each row's share, and its own
part is exact too: the VJP reads the reduced loss of the unperturbed forward.

The K perturbed copies run as one batched forward: every value that the noise reaches is copied with its
rows stacked K times (dim KB_lr = K * B, sample-major). A value with rows that no noise reaches (a float
input, the first layer's product, a GCN's A @ X) is "clean", the same in every copy: the estimate
computes it once, on B rows, and its copies are a broadcast of it where a noised value needs them; a
site whose chain is clean gets its noise on that broadcast, and its params' parts sum the copies'
cotangents first (K times less work). A clean value is the estimate's own node, never the forward's
(`distinct`, which CSE leaves apart): a second reader of the forward's product would keep its bias and
activation from fusing into it in every other entry. The model's own random ops (dropout, noise) are
clean too: drawn once from their seed input, as loss_and_grad draws them, so the estimate is of that
call's gradient. A sum over rows of clean values (a mask's count) is a constant of the estimate where
the loss is not linear in it. An int input's copies (labels) are tiled by the module. Values without
rows (params, constants, a GCN's adjacency) are shared. The sites' noise comes from the counter-based
`random` op (one stream each), its second half repeating the first for antithetic pairs; a per-site mask
of shape (KB_lr, 1, ...) holds +-sigma or 0 per row (a leaf of signs times the leaf sigma), so
antithetic pairs, layer-wise injection (one site per block of samples) and sigma are chosen at call
time.

Which loss pairs with which noise: when no op mixes rows, row b's loss depends only on row b's
noise, and each row's loss term (its share of the objective: l_b / B for a mean; passes/lr_shares.py
keeps the loss's reduction over rows per row) pairs with its own noise (per row). When an op mixes
rows (A @ H in a graph convolution: a row-mixing product runs per sample, as a batch_matmul over
(K, N, F)), a site's row j pairs with the rows its noise can reach (`pairing`): its own after the last
mixing, its neighbours (A[i, j] != 0) behind one, else the sample's whole loss L_k (per sample). All
are unbiased for the noised objective (a row's loss its noise cannot reach adds variance, not bias);
the fewer rows, the less variance. A batch statistic (batch norm's mean over the rows, read back by
them; passes/lr_statistics.py) is taken per copy, and a site whose noise reaches one pairs per sample;
a param applied to a statistic is a site on the statistic, its noise one draw per copy ("copy"). Any
other op that mixes rows (a contrastive za @ zb.T, a softmax over the batch, h.T @ h, attention across
the batch) runs once per copy, by its record's `batched` rule (lr_statistics.lift): its result is rows
again where it has an axis of the batch's size, a statistic otherwise, and a site whose noise reaches it
pairs per sample.
The baseline subtracted from each row's (or sample's) loss is the copies' losses weighted by a leaf
(K_lr, 1) set at call time: without antithetic pairs the mean over the samples, made leave-one-out by
the factor K/(K-1) the module folds into the scale; with pairs the loss of two copies without noise.
Pairs alone do not remove the loss: where a noised product reads a value the noise has already reached
(a second layer, the step after the first), the + and - copies read different values, and the loss
times their difference stays.

The batch dim is not declared: each dim that may be it is tried, the likeliest first (batch_choices);
any choice the rows rules accept gives an unbiased estimate. Params the estimate cannot reach (a
learned initial carry, a factor of a step's loss in the step),
batch statistics in a scan's step, and ops that mix rows without a per-copy form (a scan along the batch)
make lr_grad raise at call time with the reason (graph.lr["why"]); compile never fails because of this pass.
"""
import sympy as sp

from gradc.errors import GradcError
from gradc.ops import get_op
from gradc.ops.elementwise import X
from gradc.ops.scan_layout import index_of, kind_of, parts
from gradc.shapes import fmt

from .autodiff import VJPContext, accumulate
from .lr_scan import ScanNoise
from .lr_shares import SHARES, offset_shares, rows_first, share_rows, shares
from .lr_sites import DIMS, K, KB, LAYOUT, Site, Unsupported, chains, misuses  # noqa: F401 (DIMS: for importers)
from .lr_statistics import STAT, BatchStatistics, Statistic

STREAM = 1 << 20                 # noise streams, apart from the model's own random ops
PHASE = "forward"                # an estimate is forward work: nothing here is kept for a backward


def build_lr(graph, trainable, decayed=(), weight_decay=0.0):
    """graph.lr: the estimate's tables (grads, leaves, sites, ...), or {"why": reason} when it cannot be built.
    Each dim that may be the batch's is tried, the likeliest first (batch_choices); the reason given is that
    of the one that got furthest through the forward (the likeliest first among equals), with the other
    named dims' after it. Any choice that builds is a valid estimate: the rows
    rules refuse whatever mixes its rows."""
    why = {}
    for batch, axes, declared in batch_choices(graph, graph.ancestors([graph.loss])):
        statistics = set()   # reductions over the rows that the rows read back (batch norm's): found as it goes
        stat_sites = set()   # statistics with params that the rows read (gamma / sqrt(var + eps)): sites
        while True:
            builder = _Builder(graph, trainable, decayed, weight_decay, batch, axes, declared, statistics, stat_sites)
            try:
                graph.lr = builder.build()
                return
            except Statistic as e:   # built again, with those taken per copy
                statistics |= e.nodes
                stat_sites |= e.sites
                continue
            except Unsupported as e:   # the nodes made so far are dead code: simplify removes them
                why[batch] = (len(builder.where), str(e))   # how far it got: the furthest names the likeliest cause
            except GradcError as e:   # a rule this pass leans on refused what it built: lr_grad says so, and
                why[batch] = (len(builder.where), f"lr_grad cannot build its estimate of this model: {e}")
            break                     # the rest of the module (loss_and_grad, ...) is built as ever
    if not why:
        graph.lr = {"why": "the model has no input with rows to perturb"}
        return
    (batch, first), *others = [(d, w) for d, (_, w) in sorted(why.items(), key=lambda kv: -kv[1][0])]
    named = [f"with {d!r}: {w.split('; ')[0]}" for d, w in others   # their reasons, not advice (none twice)
             if isinstance(d, str) and w.split('; ')[0] not in first]
    rest = f" (that is with {batch!r} as the batch dim; " + "; ".join(named) + ")" if named else ""
    graph.lr = {"why": first + rest}


def batch_choices(g, fwd):
    """(the batch dim, {input: the axis it has the rows on, None: shared}, the dim as declared) for each dim
    that may be the batch's, the likeliest first. An input scanned as it is has time on axis 0, so its rows on
    axis 1; the likeliest batch dim is axis 0 of the first input that is not, unless that is the time of one
    that is (labels (T, B) read outside the scan); then axis 1 of a scanned input; then the named dims, then
    any other dim some input has where rows go (axis 0, or 1 of an input that reaches a scan: tokens (T, B)
    looked up before the scan). Dims are compared as declared (T and B bound to one size are still two dims);
    a named batch dim is the batch on any axis, a literal size only where rows go."""
    sequences, scanned = set(), set()   # inputs that reach a scan's sequences; those that are one
    for n in fwd:
        if g.op(n) == "scan":
            _, _, _, K, X, _, _ = parts(g.attrs(n))
            sequences |= g.ancestors(g.operands(n)[K:K + X])
            scanned |= set(g.operands(n)[K:K + X])
    shapes = {n: g.declared_shapes.get(n, g.shape(n)) for n in g.inputs.values() if n in fwd}
    shaped = [(n, (1, 0) if n in scanned else (0, 1) if n in sequences else (0,)) for n in shapes]
    times = {shapes[n][0] for n in scanned if n in shapes and shapes[n]}
    plain = [shapes[n][0] for n in shapes if n not in sequences and shapes[n] and shapes[n][0] not in times]
    likely = [shapes[n][1] for n in scanned if n in shapes and len(shapes[n]) > 1]
    others = [shapes[n][a] for n, order in shaped for a in order if len(shapes[n]) > a]
    named = [d for d in others if isinstance(d, str)]
    for batch in dict.fromkeys(plain[:1] + likely[:1] + named + others):
        anywhere = lambda n: tuple(range(len(shapes[n]))) if isinstance(batch, str) else ()
        axes = {n: next((a for a in order + anywhere(n) if len(shapes[n]) > a and shapes[n][a] == batch), None)
                for n, order in shaped}
        n, axis = next((n, a) for n, a in axes.items() if a is not None)
        yield g.shape(n)[axis], axes, batch   # the dim as the graph has it (bound, where --bind bound it), as declared


def estimate_nodes(graph):
    """The estimate's own nodes: what only lr_grad computes. It is not split into stages: a pipeline
    build (--devices, --microbatches) runs it whole, in one process or on every rank (codegen/lr_api.py),
    so the cut neither costs nor lists them (their K * B rows are chosen at call time), and the
    pipeline executor moves no value for them (their transfers are copies inside lr_grad)."""
    lr_grads = set(graph.lr_grads.values())
    return set(graph.nx.nodes) - graph.ancestors(r for r in graph.roots() if r not in lr_grads)


class _ViewsVJP(VJPContext):
    """A site's VJP may go back through the views between the stacked rows (KB_lr, ...) and the copies
    (K_lr, B, ...) (an op run per copy, A @ H): its reshapes are views too, whose dims the shape rule
    cannot compare."""

    def emit(self, op, inputs, **attrs):
        if op != "reshape":
            return super().emit(op, inputs, **attrs)
        shape = tuple(attrs["shape"])
        return self.graph.add_node("reshape", inputs, {"shape": shape}, shape, self.graph.dtype(inputs[0]),
                                   phase=self.phase, src=self.src, of=self.node)


class _Builder:
    def __init__(self, g, trainable, decayed, weight_decay, batch, axes, declared, statistics=(), stat_sites=()):
        self.g = g
        self.batch, self.axes, self.declared = batch, axes, declared
        self.trainable = {g.params[p]: p for p in trainable}
        self.decayed, self.wd = set(decayed), weight_decay
        self.fwd = g.ancestors([g.loss])
        self.float = g.dtype(g.loss)
        self.src = g.node(g.loss)["src"]
        self.leaves, self.tiled, self.copy, self.where = {}, {}, {}, {}
        self.clean = set()         # values with rows that no noise reaches: the same in every copy, made once
        self.constants = set()     # their sums and means over the rows: constants of the estimate where needed
        self.owned = {}            # a clean value -> the estimate's own node of it (B rows)
        self.inner = set()
        self.tops = set()          # the values that get a site's noise (the last of each chain)
        self.mixing = []
        self.sites = []            # Site, in the order of their masks and noise streams
        self.scans = ScanNoise(self)
        self.statistics = BatchStatistics(self, statistics)
        self.stat_sites = set(stat_sites)   # sites whose value is a statistic: noise per copy
        self.covered = set()       # values a site's or the loss's exact VJP goes through (see uncovered)

    # ---- small builders ----------------------------------------------------------------
    def leaf(self, key, shape, dtype):
        n = self.g.add_node("input", [], {"shape": tuple(shape), "dtype": dtype}, tuple(shape), dtype,
                            phase=PHASE, src=self.src, name=key)
        self.leaves[key] = n
        return n

    def apply(self, op, inputs, src=None, **attrs):
        try:
            return self.g.apply(op, inputs, attrs, phase=PHASE, src=src or self.src)
        except GradcError as e:
            raise Unsupported(f"{src or self.src}: {e}") from None

    def view(self, x, shape):
        """A reshape whose dims the shape rule cannot compare (KB_lr against K_lr * B): a view at run time."""
        return self.g.add_node("reshape", [x], {"shape": tuple(shape)}, tuple(shape), self.g.dtype(x), phase=PHASE,
                               src=self.src)

    # ---- the pass --------------------------------------------------------------------------
    def build(self):
        g = self.g
        self.free = self.param_values()
        order = g.topo_order(self.fwd)
        sites = chains(g, [n for n in order if n not in self.free], self.free.__contains__)
        tops = {chain[-1]: chain for chain in sites}
        self.tops = set(tops)
        self.check_scans()
        self.inner = {x for chain in sites for x in chain[:-1]}   # a chain's products and adds below its top
        self.seed = self.leaf("seed", (), "int64")
        self.half = self.leaf("half", (), "int64")
        self.rows = self.leaf("rows", (K, self.batch), self.float)   # each (sample, row)'s weight (ones)
        self.sigma = self.leaf("sigma", (), self.float)
        # 1 / (samples * sigma**2), the part before sigma a leaf (times K / (K - 1) for a leave-one-out baseline)
        scale = self.apply("div", [self.leaf("scale", (), self.float), self.apply("mul", [self.sigma, self.sigma])])
        baseline = self.leaf("baseline", (K, 1), self.float)   # each copy's weight in the baseline
        built = []
        for n in order:
            self.where[n] = self.track(n)
            per_copy = self.where[n] == STAT and n in self.stat_sites   # a param applied to a statistic the rows read
            if n in tops and (per_copy or not isinstance(self.where[n], tuple) and self.where[n] != STAT):
                # (a term added to the loss, a factor of it, a statistic no rows read: exact below)
                if self.where[n] is None:
                    raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} reads a trainable param but has no batch "
                                      f"rows: the estimate perturbs products of rows (declare its params "
                                      f"trainable=False, or train this model with loss_and_grad)")
                clean = n in self.clean
                z = self.stacked(n)
                noise, mask = self.noise(g.shape(z), g.node(n)["src"], g.op(tops[n][0]),
                                         axis=0 if per_copy else self.where[n], per_copy=per_copy)
                pert = self.apply("mul", [noise, mask], g.node(n)["src"])
                self.copy[n] = self.apply("add", [z, pert], g.node(n)["src"])
                self.clean.discard(n)
                site = self.sites[-1]
                # a clean site's chain is one for every copy: the estimate's own, on B rows
                # (an op of it run per copy: the nodes of its copy too, so the VJP goes through them)
                made = self.statistics.made
                site.copies = [self.own(x) for x in tops[n]] if clean else [
                    c for x in tops[n][:-1] for c in made.get(x, []) + [self.copy[x]]] + made.get(n, []) + [z]
                site.pert, site.clean, site.top = pert, clean, n
                built.append(tops[n])
        # the loss after its reduction over rows: its shares, and statistics no rows read back (sqrt(mse))
        rowful = {n for n, w in self.where.items() if isinstance(w, int)}
        self.sites_on_statistics(tops, rowful)
        self.tail = {n for n, w in self.where.items() if isinstance(w, tuple)
                     or w == STAT and not self.reach([n]) & rowful}
        self.check_params(built)
        if self.where[g.loss] == STAT:   # not affine in its reduction over rows: one loss per copy
            shares = self.statistics.loss_shares(g.loss)
        elif isinstance(self.where[g.loss], tuple):
            shares = self.stacked(g.loss)
        else:
            raise Unsupported(f"{self.src}: the loss does not reduce over the batch rows ({self.batch!r}), so there "
                              f"is no loss per row or per sample to pair with the noise")
        deviations = self.deviations(shares, baseline)
        coefficients = {}
        contributions = {p: [] for p in self.trainable}
        for site in self.sites:
            pairs = self.pairing(site)
            site.doc["pairs"] = pairs if isinstance(pairs, str) else "neighbours"
            if pairs not in coefficients:
                coefficients[pairs] = self.coefficient(deviations, pairs)
            coef = coefficients[pairs]
            rows = K if site.doc["per_copy"] else KB
            c = self.view(coef, (rows,) + (1,) * (site.rank - 1)) if site.rank > 1 else coef
            cot = self.apply("mul", [self.apply("mul", [c, site.pert]), scale])
            if site.clean:   # one chain for every copy: sum the copies' cotangents first (K times less work)
                shape = tuple(g.shape(site.copies[-1]))
                a = len(shape) - site.rank   # the rows' axis
                cot = self.apply("sum", [self.view(cot, shape[:a] + (K,) + shape[a:])], axes=(a,), keepdims=False)
            for p, gp in self.local_vjp(site.copies, cot).items():
                contributions[p].append(gp)
        for p, gp in self.exact_parts().items():
            contributions[p].append(gp)
        self.uncovered()
        grads = {}
        for p, name in self.trainable.items():
            parts = contributions[p]
            total = accumulate(g, parts, PHASE, self.src) if parts else None
            if name in self.decayed and self.wd:   # the objective's decay, exactly (a param the loss never reads too)
                wd = self.apply("const", [], value=float(self.wd), shape=(), dtype=self.float)
                term = self.apply("mul", [wd, p])
                total = term if total is None else self.apply("add", [total, term])
            grads[name] = total
        return {"why": None, "grads": grads, "leaves": self.leaves, "tiled": self.tiled,
                "sites": [site.doc for site in self.sites],
                "per_row": not self.mixing and not self.statistics.used, "batch": self.batch,
                "mixing": [g.node(n)["src"] for n in self.mixing]}

    def sites_on_statistics(self, tops, rowful):
        """Raise Statistic to build again with the chain tops whose value is a param applied to a statistic
        the rows read as sites on it (noise on each copy's value); a param applied to a sum over rows no
        noise reaches (the folded batch norm of an input) with that sum a statistic too."""
        g = self.g
        read = {n for n in tops if self.where[n] == STAT and n not in self.stat_sites and self.reach([n]) & rowful}
        if read:
            raise Statistic((), "a param applied to a batch statistic", sites=read)
        for n in tops:
            if n in self.constants and self.reach([n]) & rowful:
                why = (f"{g.node(n)['src']}: {g.describe(n)} applies a param to a sum over the rows that lr_grad "
                       f"cannot take per copy; or train this model with loss_and_grad")
                self.statistics.origins(n, [self.where[u] for u in g.operands(n)], why, sites={n})
                raise Unsupported(why)   # (origins found no reduction to take per copy)

    def uncovered(self):
        """A safety net: refuse a trainable param the loss reads that neither a site's VJP nor the loss's exact
        VJP goes through (check_params refuses each use it knows the estimate cannot take). A param they go
        through may still get no part: its VJP there is zero (a sign of it), as loss_and_grad's is."""
        for p, name in self.trainable.items():
            if p in self.fwd and p not in self.covered:
                raise Unsupported(f"param {name!r} {fmt(self.g.shape(p))} reaches the loss, but the estimate has no "
                                  f"part for it: train this model with loss_and_grad")

    def noise(self, shape, src, what, steps=None, axis=0, per_copy=False):
        """A new site's noise (`shape`, its rows on `axis`; or one such per step of each enclosing scan,
        stacked on new axes in front, when `steps` (outermost first) is given) and its mask leaf
        (KB_lr, 1, ...), which broadcasts from the rows' axis on; per_copy: a statistic's noise, one
        value per copy on axis 0, and a mask (K_lr, 1, ...). The Site is appended to self.sites, to be
        completed."""
        i = len(self.sites)
        full, at = (tuple(steps) + tuple(shape), axis + len(steps)) if steps else (tuple(shape), axis)
        drawn = (full[at],) + full[:at] + full[at + 1:]
        noise = self.apply("random", [self.seed, self.half], src, dist="normal", p=0.0, stream=STREAM + i,
                           shape=drawn, dtype=self.float)
        if at:   # drawn rows first, so the antithetic half is the second half of the rows
            noise = self.apply("transpose", [noise], src, axes=tuple(range(1, at + 1)) + (0,)
                               + tuple(range(at + 1, len(drawn))))
        # the mask: +-sigma or 0 per row, from a leaf of signs (+-1, 0) that stays the same from call to call
        rank = len(shape) - axis
        signs = self.leaf(f"mask{i}", (K if per_copy else KB,) + (1,) * (rank - 1), self.float)
        mask = self.apply("mul", [signs, self.sigma], src)
        self.sites.append(Site(None, None, rank, {"op": what, "shape": [str(d) for d in shape], "src": src,
                                                   "mask": f"mask{i}", "rank": rank, "per_copy": per_copy}))
        return noise, mask

    def param_values(self):
        """The forward's values made of trainable params without batch rows (a param, W * s, U @ V, an L2
        penalty): computed once, as the forward computes them, and differentiated exactly where the
        estimate's parts go through them (nothing in them has rows, so their VJP is cheap). A scan is
        never one (lr_grad refuses a scan without rows that reads params)."""
        g = self.g
        rowful, free = set(), set()
        for n in g.topo_order(self.fwd):
            op = g.op(n)
            if op == "input" and self.input_axis(n) is not None or op == "random" and self.draw_axes(n) \
                    or any(u in rowful for u in g.operands(n)):
                rowful.add(n)
            elif n in self.trainable or op != "scan" and any(u in free for u in g.operands(n)):
                free.add(n)
        return free

    def draw_axes(self, n):
        """The axes of the model's random op n that have the batch dim, by its shape as declared (a draw the
        shape of a weight (5, 6), DropConnect, has none, also with B bound to 6)."""
        shape = self.g.declared_shapes.get(n, self.g.shape(n))
        batch = self.declared if isinstance(self.declared, str) else self.batch
        return [a for a, d in enumerate(shape) if d == batch]

    def names(self, v):
        """The names of the trainable params value v is made of."""
        g = self.g
        return [self.trainable[a] for a in g.topo_order(g.ancestors([v])) if a in self.trainable]

    def check_params(self, sites):
        """Every use of a value made of trainable params must be a factor of a site (`sites`, the chains
        that got noise) or a term of the loss after its reduction over rows (differentiated exactly)."""
        g = self.g
        bad = []
        for p, u in misuses(g, [p for p in self.trainable if p in self.fwd], self.fwd, sites, self.free.__contains__,
                            self.free.__contains__, self.tail.__contains__):
            if g.op(u) != "scan":   # (check_scans did those)
                bad.append((p, u, g))
        if bad:
            self.refuse_params(bad)

    def check_scans(self):
        """A scan's step must read values made of params only as a factor or bias, like the graph, and a
        scan must not take one as a carry or sequence (checked before the copies: a learned initial
        state would be refused as a carry without rows)."""
        g = self.g
        bad = [b for n in g.topo_order(self.fwd) if g.op(n) == "scan" and any(u in self.free for u in g.operands(n))
               for b in self.scans.misuses(n)]
        if bad:
            self.refuse_params(bad)

    def refuse_params(self, bad):
        """bad: [(a value made of params, in the graph; the node that reads it; the graph it is in)], not empty."""
        names = ", ".join(dict.fromkeys(f"{n!r} {fmt(self.g.shape(self.g.params[n]))}"
                                        for v, _, _ in bad for n in self.names(v)))
        v, u, g = bad[0]
        shape = f" {fmt(g.shape(u))}" if g.shape(u) else ""   # (a scan's results have no one shape)
        raise Unsupported(f"param {names} reach(es) the loss through an op the estimate cannot perturb: "
                          f"{self.names(v)[0]!r} is read by {g.describe(u)}{shape} "
                          f"at {g.node(u)['src']}. "
                          f"The likelihood-ratio estimate perturbs the outputs of products, lookups and elementwise "
                          f"ops on batch rows and differentiates terms of params alone added to the loss, so it has "
                          f"nothing to attribute to such a use (it would not be zero, and lr_grad will not pretend "
                          f"it is): declare it trainable=False, or train with loss_and_grad")

    def input_axis(self, n):
        """The axis input n has the batch rows on, or None: none, or an adjacency (N, N) read only as the
        left factor of products, the same for every sample (N, N as declared: a batch x (B, 12) with B bound
        to 12 is not one)."""
        g = self.g
        declared = g.declared_shapes.get(n, g.shape(n))
        adjacency = len(declared) == 2 and declared[0] == declared[1] and all(
            g.op(u) == "matmul" and g.operands(u)[0] == n and n not in g.operands(u)[1:]
            and not g.attrs(u).get("transpose_a") for u in g.users(n) if u in self.fwd)
        return None if adjacency else self.axes.get(n)

    def track(self, n):
        """Where n's batch rows lie (an axis, None when it has none, ("reduced", kind) after the loss's
        reduction over rows), building n's stacked copy when it has rows."""
        g = self.g
        op, node = g.op(n), g.node(n)
        shape = node["shape"]
        if op == "input":
            axis = self.input_axis(n)
            if axis is None:
                return None
            name = node["name"]
            if node["dtype"].startswith("float"):   # clean: its copies, where needed, a broadcast in the graph
                self.tiled[name] = (None, axis)
                self.clean.add(n)
            else:   # int labels (which no elementwise op copies): tiled by the module, a leaf
                self.tiled[name] = (f"tile:{name}", axis)
                stacked = list(shape)
                stacked[axis] = KB
                self.copy[n] = self.leaf(f"tile:{name}", stacked, node["dtype"])
            return axis
        if op in ("param", "const"):
            return None
        ins = [self.where[u] for u in g.operands(n)]
        src = node["src"]

        def fail(why):
            loss = ""
            if op == "scan" or any(isinstance(w, tuple) for w in ins):   # about the loss after its reduction
                # (a loss summed in a scan's carry: the rows rule's reason already says to return it as the step's y)
                loss = (" and pairs each row's share of the loss with its noise, so the loss must be a sum or mean "
                        "over rows of per-row terms, then only scaled, added, summed or moved")
            error = Unsupported(f"{src}: {g.describe(n)} {why}; lr_grad stacks the K perturbed copies on the rows"
                                f"{loss}; or train this model with loss_and_grad")
            error.reason = f"{src}: {g.describe(n)} {why}"   # (without the advice: lift says what it tried)
            raise error

        if op == "random":   # the model's own draws (dropout, noise): the same in every copy, as loss_and_grad
            return self.model_draws(n)   # draws them from the seed given, so the estimate is of that call's gradient
        if n in self.statistics.nodes:   # batch norm's mean: one per copy
            return self.statistics.reduce(n)
        held = [False] * len(ins)
        if op == "scan":   # it may close over a sum over rows no noise reaches (x0.mean(0)): the same in every copy
            held = self.closed_over_sums(n, ins)
            ins = [None if h else w for h, w in zip(held, ins)]
        if STAT in ins:
            return self.statistics.apply(n, ins)
        if all(w is None for w in ins):
            if op == "scan" and self.scans.sites(n):
                fail("reads trainable params in its step but has no batch rows (the estimate perturbs products "
                     "of rows)")
            return None
        clean = all(u in self.clean for u, w in zip(g.operands(n), ins) if w is not None)
        if op == "scan":
            operands = [u if h else self.stacked(u) for u, h in zip(g.operands(n), held)]
            self.copy[n], where = self.scans.copy(n, ins, operands, fail)
            return where
        operands = [self.stacked(u) for u in g.operands(n)] if not clean else list(g.operands(n))
        attrs = dict(node["attrs"])
        if op == "scan_out":   # the copy's results are laid out for its own ys
            old, new = g.operands(n)[0], operands[0]
            attrs["index"] = index_of(g.attrs(new), *kind_of(g.attrs(old), attrs["index"]))

        if op == "matmul" and ins[0] is None and ins[1] == 0 and not attrs.get("transpose_a") \
                and not attrs.get("transpose_b") and g.shape(g.operands(n)[0]) == (self.batch, self.batch):
            # A @ H with A (N, N) mixing the rows of H: once per sample, as a batch_matmul over (K, N, F)
            if clean:   # before any noise: the rows it mixes are the same in every copy
                self.clean.add(n)
                return 0
            a, h = operands
            h3 = self.view(h, (K, self.batch) + tuple(g.shape(h)[1:]))
            prod = self.apply("batch_matmul", [a, h3], src, transpose_a=False, transpose_b=False, reduce_batch=False)
            self.copy[n] = self.view(prod, (KB,) + tuple(shape[1:]))
            self.statistics.made[n] = [prod, self.copy[n]]   # (A a trainable param: a site's VJP goes through them)
            self.mixing.append(n)
            return 0
        emit = lambda kind, inputs, **a: self.apply(kind, inputs, src, **a)
        try:
            where = share_rows(g, n, ins, fail)
        except Unsupported as e:   # it mixes rows, unless through a sum over rows no noise reaches (a mask's
            self.statistics.refused(n, ins, str(e))   # count, x.mean(0)): the same in every copy; a max over
            held = [u in self.constants for u in g.operands(n)]   # the rows is a batch statistic
            if not any(held):
                # or it adds a value without rows to the loss (loss + 0.5, an L2 penalty): its linear part
                offset = offset_shares(g, n, ins, [self.stacked(u) for u in g.operands(n)], emit)
                if offset is None:
                    self.statistics.origins(n, ins, str(e))   # or it reads a batch statistic back (batch norm)
                    if any(isinstance(w, tuple) for w in ins):
                        raise
                    return self.statistics.lift(n, ins, getattr(e, "reason", str(e)))   # or it mixes rows: per copy
                self.copy[n] = offset
                return SHARES
            ins = [None if h else w for h, w in zip(held, ins)]
            try:   # (a function of such sums alone has no rows: a constant too, below)
                where = share_rows(g, n, ins, fail) if any(w is not None for w in ins) else None
            except Unsupported as e:
                self.statistics.origins(n, ins, str(e))
                raise
            if where is None:   # a function of such sums alone: a constant too, its shares an even split
                self.constants.add(n)
                self.copy[n] = self.split(n)
                return SHARES
            clean = all(u in self.clean for u, w in zip(g.operands(n), ins) if w is not None)
            operands = [u if w is None or clean else self.stacked(u) for u, w in zip(g.operands(n), ins)]
        if isinstance(where, tuple):   # the loss's reduction over rows, or a value after it: kept per row
            if clean and not any(isinstance(w, tuple) for w in ins):
                self.constants.add(n)
            if op == "scan_out":   # a per-step loss, stacked (T, KB_lr, ...)
                attrs["shape"] = tuple(shape[:1]) + (KB,) + tuple(shape[1:])
                self.copy[n] = rows_first(self.apply(op, operands, src, **attrs), 1, len(shape) + 1, emit)
            else:
                count = lambda dims, dtype: self.apply("count", [], src, dims=dims, dtype=dtype)
                values = [u if w is None else self.stacked(u) for u, w in zip(g.operands(n), ins)]
                self.copy[n] = shares(g, n, ins, where, values, emit, count)
            return where
        if clean:
            self.clean.add(n)
            return where
        self.copy[n] = self.restacked(n, operands, where, attrs)
        return where

    def closed_over_sums(self, n, ins):
        """Which operands of scan n are sums (means, maxes) over the batch rows of values no noise reaches,
        read as values without rows (the same in every copy); one that the noise reaches (a batch statistic)
        is refused by name."""
        g = self.g
        held = []
        for u, w in zip(g.operands(n), ins):
            # (a max over rows is taken as a statistic first: then it is held when no noised value leads to it)
            held.append(isinstance(w, tuple) and u in self.constants or w == STAT and not self.noised(u))
            if (isinstance(w, tuple) or w == STAT) and not held[-1]:
                raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} reads {g.describe(u)}, a sum, mean or max "
                                  f"over the batch rows that the noise reaches (a batch statistic, or the loss); "
                                  f"lr_grad takes batch statistics per perturbed copy outside a scan only; compute "
                                  f"it from the inputs alone, or train this model with loss_and_grad")
        return held

    def noised(self, u):
        """Whether the noise reaches value u: it depends on a value with rows that is not clean."""
        return any(isinstance(self.where.get(a), int) and a not in self.clean for a in self.g.ancestors([u]))

    def split(self, n):
        """Shares of n, a constant of the estimate (the same in every copy): n / B for each row, (KB_lr,) + its
        shape. Any split would do: a constant in each copy's loss moves no estimate but its variance."""
        g = self.g
        shape = tuple(g.shape(n))
        count = self.apply("count", [], g.node(n)["src"], dims=(self.batch,), dtype=g.dtype(n))
        ones = self.view(self.rows, (KB,) + (1,) * len(shape))
        return self.apply("mul", [ones, self.apply("div", [n, count])])

    def model_draws(self, n):
        """Where the rows lie in the model's random op n (a dropout mask or noise the shape of a value):
        on the axis its shape has the batch dim; it is clean, drawn once and broadcast to the copies."""
        g = self.g
        axes = self.draw_axes(n)
        if len(axes) > 1:
            raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} {fmt(g.shape(n))} has the batch size "
                              f"{self.batch} on more than one axis, so lr_grad cannot tell which holds the rows")
        if any(self.where[u] is not None for u in g.operands(n)):
            raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} draws from a seed with batch rows")
        if not axes:
            return None   # noise the shape of a weight: the same for every row too
        self.clean.add(n)
        return axes[0]

    def restacked(self, n, operands, where, attrs=None):
        """n's op (with `attrs`, default its own) applied to stacked operands: its copy, rows on axis
        `where` stacked K times."""
        attrs = dict(self.g.attrs(n) if attrs is None else attrs)
        if "shape" in attrs:
            target = list(attrs["shape"])
            target[where] = KB
            attrs["shape"] = tuple(target)
        return self.apply(self.g.op(n), operands, self.g.node(n)["src"], **attrs)

    def stacked(self, n):
        """n's K copies stacked on its rows (n itself when it has no rows). A clean value's copies are made
        here, once: a broadcast of it, except in a site's chain below its top, where they must be the
        chain's own ops (the site's VJP goes through them to the params)."""
        if n in self.copy or n not in self.clean:
            return self.copy.get(n, n)
        if n in self.inner:
            self.copy[n] = self.restacked(n, [self.stacked(u) for u in self.g.operands(n)], self.where[n])
        else:
            self.copy[n] = self.stacked_input(self.own(n), tuple(self.g.shape(n)), self.where[n])
        return self.copy[n]

    def own(self, n):
        """Clean value n computed by the estimate, on B rows: an input is itself; any other value is a
        node of the estimate's own (distinct, so CSE never merges it into the forward's n: a second
        reader of the forward's product would keep its bias and activation from fusing into it)."""
        g = self.g
        if g.op(n) == "input":
            return n
        if n not in self.owned:
            operands = [self.own(u) if self.where[u] is not None else u for u in g.operands(n)]
            self.owned[n] = g.apply(g.op(n), operands, g.attrs(n), phase=PHASE, src=g.node(n)["src"], distinct=True)
        return self.owned[n]

    def stacked_input(self, n, shape, axis):
        """A clean value's (a float input's) K copies stacked on its rows' axis, sample-major, made from n
        itself (a broadcast over a new samples axis, seen as KB_lr rows)."""
        before, after = shape[:axis], shape[axis:]
        spread = self.apply("broadcast_to", [self.view(n, before + (1,) + after)], shape=before + (K,) + after)
        return self.view(spread, before + (KB,) + after[1:])

    def deviations(self, r, baseline):
        """Each stacked row's share of the loss less the baseline (the copies' shares weighted by `baseline`,
        (K_lr, 1)); shape (K_lr, B)."""
        r2 = self.view(r, (K, self.batch))
        base = self.apply("sum", [self.apply("mul", [r2, baseline])], axes=(0,), keepdims=True)
        return self.apply("sub", [r2, base])

    def coefficient(self, deviations, pairs):
        """Each stacked row's weight c (KB_lr,), times the row's weight (the leaf rows): its own deviation
        ("row"), its sample's total ("sample"), or the total over the rows whose loss its noise can reach
        through one row-mixing product A @ H: row j's c is the sum over rows i with A[i, j] != 0
        (("neighbours", A)); for a site on a statistic, each copy's total, (K_lr,) ("copy")."""
        c2 = deviations
        if pairs == "copy":   # a statistic's site: one value per copy, (K_lr,) (the rows' weights are ones)
            return self.view(self.apply("sum", [c2], axes=(1,), keepdims=True), (K,))
        if pairs == "sample":
            total = self.apply("sum", [c2], axes=(1,), keepdims=True)
            c2 = self.apply("broadcast_to", [total], shape=(K, self.batch))
        elif pairs != "row":
            linked = self.apply("fused", [pairs[1]], expr=sp.sign(X[0]) ** 2)   # 1 where A[i, j] != 0
            c2 = self.apply("matmul", [c2, linked])
        return self.view(self.apply("mul", [c2, self.rows]), (KB,))

    def pairing(self, site):
        """Which rows' losses a site's noise pairs with (see coefficient). When no row-mixing product
        (A @ H) lies between the site and the loss, row j's noise reaches row j's loss alone: "row". When
        one A mixes them once, and every path from the site to the loss goes through it, row j's noise
        reaches the rows i with A[i, j] != 0: ("neighbours", A). Otherwise (two mixings in a row, a path
        around one, a site in a scan's step) the whole sample's: "sample". Leaving out rows the noise
        cannot reach removes their variance and keeps the estimate unbiased (their loss is independent of
        that noise)."""
        if site.doc["per_copy"]:   # noise on a statistic: every row of its copy reads it
            return "copy"
        if not self.mixing and not self.statistics.used:
            return "row"
        if site.top is None:
            return "sample"
        after = self.reach([site.top])
        if after & set(self.statistics.used):   # its noise reaches every row of its copy
            return "sample"
        hops = [m for m in self.mixing if m in after]
        if not hops:
            return "row"
        adjacency = {self.g.operands(m)[0] for m in hops}
        if len(adjacency) > 1 or any(self.reach([m]) & set(hops) for m in hops) \
                or self.reach([site.top], stop=set(hops)) & self.tail:
            return "sample"
        return ("neighbours", adjacency.pop())

    def reach(self, starts, stop=frozenset()):
        """The forward's values that depend on `starts` (not the starts themselves), not going on through
        the values in `stop`."""
        seen, stack = set(), list(starts)
        while stack:
            for u in self.g.users(stack.pop()):
                if u in self.fwd and u not in seen:
                    seen.add(u)
                    if u not in stop:
                        stack.append(u)
        return seen

    def local_vjp(self, copies, cot):
        """The params' parts of the estimate at one site: the VJPs of its copies (products, adds; a
        scan of one conv per step, lr_scan.conv_over_steps) and of the values made of params they read
        (through the layout ops a scan's site lifts them with), with cotangent `cot` at the last copy z."""
        g = self.g
        active = set(copies)
        for x in copies:
            if g.op(x) == "scan_out":   # a conv over a step's stacked rows: its VJP is that scan's
                x = g.operands(x)[0]
                active.add(x)
            for u in g.operands(x):
                lifted = []
                while u not in self.free and g.op(u) in LAYOUT:
                    lifted.append(u)
                    u = g.operands(u)[0]
                if u in self.free:
                    active |= set(lifted) | (g.ancestors([u]) & self.free)
        self.covered |= active
        return self.vjp(active, copies[-1], cot)

    def exact_parts(self):
        """The params' parts through values made of params that the loss reads after its reduction over
        rows, differentiated exactly: a term added to it (an L2 penalty written in the loss) and a factor
        that scales it (loss * exp(-s) + s, a learned temperature), whose VJP reads the loss there, the
        unperturbed forward's (lr_grad computes it for the objective). The exact VJP goes from the loss
        down to those values through the loss's ops after its reduction, which read no value with rows
        (the rows rules refuse such an op; offset_shares one not affine in the reduced loss)."""
        g = self.g
        reads = g.topo_order([n for n in self.tail if any(u in self.free for u in g.operands(n))])
        if not reads:
            return {}
        between = (set(reads) | self.reach(reads, stop=self.fwd - self.tail)) & self.tail   # the loss's ops after them
        active = self.free | between
        linked = [n for n in reads if n == g.loss or g.loss in self.reach([n], stop=self.fwd - self.tail)]
        self.covered |= g.ancestors(linked) & self.free   # (the loss's VJP reaches these through the tail alone)
        one = self.apply("const", [], value=1.0, shape=tuple(g.shape(g.loss)), dtype=self.float)
        return self.vjp(active, g.loss, one)

    def vjp(self, active, z, cot):
        """{trainable param: its part}: the VJPs of the `active` nodes, from cotangent `cot` at z."""
        g = self.g
        adjoints = {z: [cot]}
        projected = {}   # a scan (a conv over a step's stacked rows) -> {result index: adjoint}
        result = {}
        for n in reversed(g.topo_order(active)):
            record = get_op(g.op(n))
            if record.kind == "region":
                gn = projected.pop(n, None)
                if not gn:
                    continue
            else:
                parts = adjoints.pop(n, None)
                if not parts:
                    continue
                gn = accumulate(g, parts, PHASE, self.src)
            if n in self.trainable:
                result[n] = gn
                continue
            if record.kind == "project":
                projected.setdefault(g.operands(n)[0], {})[g.attrs(n)["index"]] = gn
                continue
            grads = record.vjp(_ViewsVJP(g, n, active, PHASE), n, gn)
            for u, gu in zip(g.operands(n), grads):
                if gu is not None and u in active:
                    adjoints.setdefault(u, []).append(gu)
        return result
