"""lr_grad through gc.scan (passes/likelihood_ratio.py, DESIGN.md §1.9): noise on the pre-activation
at every step.

A product in a scan's step with a trainable param as a factor (h @ W + b, the param closed over), and
an elementwise op on rows that reads one (a gain h * g, a bias), is a
noise site like one outside: at step t its output z_t gets sigma * eps_t. For the estimate

    dL/dW ~ sum_t h_t^T (c * eps_t) / sigma,        dL/db ~ the same summed over the rows,

the perturbed copy of the scan (every value with rows stacked K times, as outside) gets per site one
more sequence, the noise of every step (T, KB_lr, ...), drawn outside the loop by the `random` op
(rows first, so its antithetic half is the second half of the rows), and one more closed-over value,
the site's mask; its step adds eps_t * mask to z_t and returns the product's row operand h_t as one
more y. After the loop the site's part of the estimate is the product's own VJP over the stacked
steps: the same product with h's stack (T, KB_lr, ...) as its row operand (a batch_matmul, whose VJP
sums over the steps; a conv of each step, a scan of its own whose VJP sums the steps' kernel gradients;
an elementwise op of its operands' stacks), with cotangent c * eps * mask / sigma^2.
Nothing flows back through the loop, so the estimate stays a forward graph; it keeps each site's h_t and noise
for every step, as the estimate outside a scan keeps each site's h and noise.

A loss made in the step (a batch mean of the step's rows) is kept per row there, as outside
(passes/lr_shares.py): the copy's y is each row's share, and a mean's count of rows, which the step
cannot know (its rows are K * B), comes in as a closed-over scalar.

A scan in a step (a Level of its own, whose graph is the enclosing step) is copied the same way inside
the enclosing step's copy: its sites' noise is drawn outside every loop with one axis per enclosing
scan, (T_outer, T_inner, KB_lr, ...), and comes in through each scan as one more sequence; their masks
and counts come in as closed-over values; their row operands go out as ys of each scan, stacked
(T_outer, T_inner, KB_lr, ...), so the site's VJP sums over every step of both.
"""
import copy

from gradc.errors import GradcError
from gradc.ir import Graph
from gradc.ops.scan import ScanRows, body_rows, result
from gradc.ops.scan_layout import YS, index_of, kind_of, parts

from .lr_shares import share_rows, shares
from .lr_sites import KB, LAYOUT, LOOKUPS, Unsupported, chains, is_product, misuses, row_operand
from .simplify import eliminate_dead


class StepSite:
    """A noise site in a scan's step, at any depth: its nodes in that step (the noised one last), the
    step's Level and where its values have their rows, the Site, its noise (T..., KB_lr, ...) and mask in
    the estimate's graph, and {(op of the site, operand index): value} for its row operands in the graph
    of the copy being built (a value of the step's copy, then each enclosing copy's stacked y)."""

    def __init__(self, level, tree, where, site, noise, mask, rows):
        self.level, self.tree, self.where, self.site = level, tree, where, site
        self.noise, self.mask, self.rows = noise, mask, rows


class ScanNoise:
    """The scans of one estimate: their sites, the checks of their params, their perturbed copies."""

    def __init__(self, builder):
        self.b = builder

    def sites(self, n):
        """The noise sites of scan n's step (lr_sites.chains)."""
        return Level(self.b, self.b.g, n).sites()

    def misuses(self, n):
        """Level.misuses of scan n of the estimate's graph."""
        return Level(self.b, self.b.g, n).misuses()

    def copy(self, n, ins, operands, fail):
        """The perturbed copy of scan n (its operands' stacked copies `operands`, their rows at `ins`) and
        where the rows lie in scan n's results (its rows rule); its sites, and those of scans nested in its
        step, are added to the builder's, each with its part's copies over the stacked steps."""
        b, g = self.b, self.b.g
        src = g.node(n)["src"]
        emit = lambda op, inputs, **a: b.apply(op, inputs, src, **a)

        def feed(kind, shape, item):   # what the copy takes beyond the model's operands: made here
            if kind == "count":
                return b.apply("count", [], src, dims=item[0], dtype=item[1])
            return item.noise if kind == "eps" else item.mask
        scan, rows, pending = Level(b, g, n).copy(ins, operands, fail, emit, feed, g)
        for p in pending:
            p.site.pert = emit("mul", [p.noise, p.mask])
            p.site.copies = p.level.over_steps(p.tree, p.rows, emit, p.where)
        return scan, rows


class Level:
    """Scan n of graph g (the estimate's graph, or the step of the scan `parent`) as lr_grad copies it."""

    def __init__(self, builder, g, n, parent=None):
        self.b, self.g, self.n, self.parent = builder, g, n, parent
        self.body, leaves, _, K, X, _, _ = parts(g.attrs(n))
        self.outer = dict(zip(leaves[K + X:], g.operands(n)[K + X:]))   # closed-over leaf -> the value of g
        self.steps = (parent.steps if parent else ()) + (g.shape(g.operands(n)[K])[0],)   # outermost first

    def up(self, v):
        """Value v of g as the value made of trainable params of the estimate's graph that it is, or None."""
        if self.parent is None:
            return v if v in self.b.free else None
        return self.parent.param(v)

    def param(self, m):
        """The value made of trainable params (of the estimate's graph: a param, W * s) that a value of the
        step is, through reshapes and transposes of a closed-over leaf, or None."""
        while self.body.op(m) in LAYOUT:
            m = self.body.operands(m)[0]
        return self.up(self.outer[m]) if m in self.outer else None

    def lift(self, m, emit):
        """A value of the step without rows (a param, through layout ops; a constant) in the estimate's graph."""
        body = self.body
        if m in self.outer:
            return self.outer[m] if self.parent is None else self.parent.lift(self.outer[m], emit)
        if body.op(m) == "const":
            return emit("const", [], **body.attrs(m))
        return emit(body.op(m), [self.lift(body.operands(m)[0], emit)], **body.attrs(m))

    def sites(self):
        """The noise sites of the step (lr_sites.chains)."""
        return chains(self.body, self.body.topo_order(), lambda m: self.param(m) is not None)

    def misuses(self):
        """[(the value made of params, the node reading it, its graph)] for each use of such a value by the
        scan other than as a factor of a site's product or a bias in its sum, in the step or in the steps of
        scans nested in it; and as a carry or sequence of the scan."""
        g, body = self.g, self.body
        _, leaves, _, K, X, _, _ = parts(g.attrs(self.n))
        closed = [leaf for leaf in leaves[K + X:] if self.param(leaf) is not None]
        bad = misuses(body, closed, set(body.topo_order()), self.sites(), lambda m: self.param(m) is not None,
                      lambda m: body.op(m) in LAYOUT, lambda m: body.op(m) == "scan")   # (nested: below)
        found = [(self.param(leaf), u, body) for leaf, u in bad]
        for u in body.topo_order():
            if body.op(u) == "scan":
                found += Level(self.b, body, u, self).misuses()
        # a param as an initial carry (a learned h0) or a sequence gets no noise of its own either
        return [(self.up(u), self.n, g) for u in g.operands(self.n)[:K + X] if self.up(u) is not None] + found

    def step_fail(self, why, fail):
        """fail(why) for the step, naming what lr_grad takes outside scans only rather than the loss's
        rule: a batch statistic read back by the step's rows (batch norm in the step), a penalty added to a
        step's loss."""
        g, n = self.g, self.n
        if "combines the loss reduced over rows with a value without batch rows" in why:
            raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} {why}; lr_grad does not split a term without "
                              f"rows added to a step's loss (a penalty) over the rows' shares in a step: add it "
                              f"to the loss after the scan, where lr_grad differentiates it exactly; or train this "
                              f"model with loss_and_grad")
        if "mixes a value reduced over rows with other batch values" not in why:
            fail(why)
        raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} {why}: a batch statistic (a sum or mean over the "
                          f"rows that the rows read back, as batch norm in a step) is taken per perturbed copy "
                          f"outside a scan, not in its step (normalise before or after the scan, or train this "
                          f"model with loss_and_grad)")

    def copy(self, ins, operands, fail, emit, feed, holder):
        """The perturbed copy of the scan, made by `emit` in graph `holder` (the estimate's, or the enclosing
        step's copy) from its operands' copies `operands` (their rows at `ins`); feed(kind, shape, item): the
        value of `holder` a site's noise ("eps", over this scan's steps), mask ("mask") or a count of rows
        ("count") comes in as. Returns the copy, where the rows lie in its results (ScanRows), and the
        StepSites of its step and of scans nested in it, their rows now the copy's stacked ys."""
        b, g, n, body = self.b, self.g, self.n, self.body
        attrs = g.attrs(n)
        _, leaves, outputs, K, X, C, M = parts(attrs)
        where = body_rows(g, n, ins, lambda why: self.step_fail(why, fail), share_rows)
        tops = {chain[-1]: chain for chain in self.sites()}
        new = copy.deepcopy(body)
        new.name = body.name + "_lr"
        names = list(body.inputs)
        copies = {}

        def placeholder(name, shape, dtype, src):   # new.inputs is laid out once every leaf is made
            return new.add_node("input", [], {"shape": tuple(shape), "dtype": dtype}, shape, dtype, src=src, name=name)

        for j, leaf in enumerate(leaves):
            if where[leaf] is None:
                continue
            if ins[j] is None:
                fail(f"has a carry ({names[j]}) whose rows come from the step while its initial value has none")
            shape = list(body.shape(leaf))
            shape[where[leaf]] = KB
            copies[leaf] = placeholder(names[j], shape, body.dtype(leaf), body.node(leaf)["src"])

        def apply(op, inputs, attrs, src):
            try:
                return new.apply(op, inputs, attrs, src=src)
            except GradcError as e:
                raise Unsupported(f"{src}: {e}") from None

        extra = {"eps": [], "closed": []}   # (leaf, kind, item): what the copy takes beyond the model's operands

        def take(kind, shape, item, src=g.node(n)["src"]):   # a leaf of the step's copy standing for it
            group = extra["eps" if kind == "eps" else "closed"]
            leaf = placeholder(f"lr_{kind}{sum(k == kind for _, k, _ in group)}", shape,
                               item[1] if kind == "count" else b.float, src)
            group.append((leaf, kind, item))
            return leaf

        counts = {}   # (dims, dtype) -> a closed-over leaf: the step does not know B

        def count(dims, dtype):
            if (dims, dtype) not in counts:
                counts[dims, dtype] = take("count", (), (dims, dtype))
            return counts[dims, dtype]

        pending = []   # StepSite
        for m in body.topo_order():
            w = where[m]
            if m in leaves or w is None:
                continue
            src = body.node(m)["src"]
            if isinstance(w, tuple):   # a per-step loss (a batch mean): kept per row, returned as (KB_lr, ...)
                emit_new = lambda kind, inputs, **attrs: apply(kind, inputs, attrs, src)
                copies[m] = shares(body, m, [where[u] for u in body.operands(m)], w,
                                   [copies.get(u, u) for u in body.operands(m)], emit_new, count)
                continue
            op, a = body.op(m), dict(body.attrs(m))
            if op == "scan":   # a scan in the step: copied in the step's copy, its sites' values through it
                inner = Level(b, body, m, self)
                copies[m], _, nested = inner.copy([where[u] for u in body.operands(m)],
                                                  [copies.get(u, u) for u in body.operands(m)], fail,
                                                  lambda kind, inputs, **at: apply(kind, inputs, at, src), take, new)
                pending += nested
                continue
            if op == "scan_out":   # the copy's results are laid out for its own ys
                scan = body.operands(m)[0]
                a["index"] = index_of(new.attrs(copies[scan]), *kind_of(body.attrs(scan), a["index"]))
            if "shape" in a:
                target = list(a["shape"])
                target[w] = KB
                a["shape"] = tuple(target)
            copies[m] = apply(op, [copies.get(u, u) for u in body.operands(m)], a, src)
            if m in tops:
                if w != 0:
                    raise Unsupported(f"{src}: {body.describe(m)} has its batch rows on axis {w}, not the first: "
                                      f"the estimate perturbs products of rows")
                shape = new.shape(copies[m])
                noise, mask = b.noise(shape, src, body.op(tops[m][0]), steps=self.steps)
                site = StepSite(self, tops[m], where, b.sites[-1], noise, mask,
                                self.row_operands(tops[m], where, copies))
                eps, scale = take("eps", shape, site, src), take("mask", b.g.shape(mask), site, src)
                copies[m] = apply("add", [copies[m], apply("mul", [eps, scale], {}, src)], {}, src)
                pending.append(site)
        for top in tops.keys() - {s.tree[-1] for s in pending if s.level is self}:
            if isinstance(where[top], tuple):   # the step's loss after its reduction over rows
                raise Unsupported(f"{body.node(top)['src']}: {body.describe(top)} combines the step's loss with a "
                                  f"value made of params in a scan's step, which lr_grad does not differentiate "
                                  f"there (scale or add to the loss after the scan)")
            raise Unsupported(f"{body.node(top)['src']}: {body.describe(top)} computes a value without batch rows "
                              f"from a trainable param in a scan's step, where lr_grad perturbs ops on batch rows "
                              f"(compute it before the scan: the step may close over a value made of params)")
        inputs = list(zip(names, [copies.get(leaf, leaf) for leaf in leaves]))
        new.inputs = dict(inputs[:K + X] + [(new.node(leaf)["name"], leaf) for leaf, _, _ in extra["eps"]]
                          + inputs[K + X:] + [(new.node(leaf)["name"], leaf) for leaf, _, _ in extra["closed"]])
        new.outputs = {name: copies.get(o, o) for name, o in body.outputs.items()}
        ys = [(site, key, row) for site in pending for key, row in site.rows.items()]
        new.outputs |= {f"lr_rows{i}": row for i, (_, _, row) in enumerate(ys)}
        eliminate_dead(new)
        steps = self.steps[-1]
        ops = operands[:K + X] + [feed(kind, (steps,) + tuple(new.shape(leaf)), item)
                                  for leaf, kind, item in extra["eps"]] \
            + operands[K + X:] + [feed(kind, new.shape(leaf), item) for leaf, kind, item in extra["closed"]]
        scan = emit("scan", ops, **dict(attrs, body=new, xs=X + len(extra["eps"])))
        for i, (site, key, _) in enumerate(ys):
            site.rows[key] = result(holder, scan, YS, M + i, emit)
        return scan, ScanRows(tuple(where[o] for o in outputs), K), pending

    def row_operands(self, tree, where, copies):
        """{(op of the site, operand index): that operand's copy in the step}, returned as ys: what the
        site's VJP over the stacked steps reads. A product's (a lookup's) row operand; every operand with
        rows of an elementwise op other than an add (a gain's h) that is not the site's own; an add's VJP
        reads none."""
        body, param, closed = self.body, self.param, self.outer
        rows = {}
        for x in tree:
            operands = body.operands(x)
            if is_product(body, x):
                r = row_operand(body, x)
                if where[operands[r]] is None or any(where[u] is not None for u in operands[:r] + operands[r + 1:]):
                    raise Unsupported(f"{body.node(x)['src']}: {body.describe(x)} has its rows in its right factor; "
                                      f"lr_grad perturbs products whose left factor has them")
                rows[x, r] = copies[operands[r]]
                continue
            if "shape" in body.attrs(x):
                raise Unsupported(f"{body.node(x)['src']}: lr_grad does not perturb {body.describe(x)} in a scan's "
                                  f"step (it broadcasts to a shape of its own)")
            for i, u in enumerate(operands):
                if u in tree or param(u) is not None:
                    continue
                if where[u] is None and u not in closed and body.op(u) != "const":
                    raise Unsupported(f"{body.node(x)['src']}: {body.describe(x)} reads a trainable param and "
                                      f"{body.describe(u)}, a value the step makes without batch rows; lr_grad "
                                      f"perturbs such an op in a step when its other operands have rows or are "
                                      f"closed over")
                if where[u] is not None and body.op(x) != "add":
                    rows[x, i] = copies[u]
        return rows

    def over_steps(self, tree, stacked, emit, where):
        """A site's ops again in the estimate's graph, over the stacked steps (T..., KB_lr, ...: one axis per
        enclosing scan): each product's
        row operand's stack from `stacked` and the closed-over params (through the step's reshapes and
        transposes) as its factors (a batch_matmul: its VJP sums over the steps; a lookup of every step's
        indices at once: its VJP adds them all into the table); an elementwise op of its operands' stacks,
        params and closed-over values; an add of the params and the site's own terms, broadcast to the
        stacked shape (its VJP reads no operand, so a term with rows is left out)."""
        body, param, steps = self.body, self.param, self.steps
        lift = lambda m: self.lift(m, emit)
        copies = {}
        for x in tree:
            operands = body.operands(x)
            if is_product(body, x):
                r = row_operand(body, x)
                if body.op(x) in LOOKUPS:   # the rows read at every step: (T, KB_lr, D)
                    copies[x] = emit(body.op(x), [lift(operands[0]), stacked[x, r]], **body.attrs(x))
                    continue
                if body.op(x) == "conv2d":   # one conv per step: a scan of its own, over (T, KB_lr, C, H, W)
                    copies[x] = self.conv_over_steps(x, stacked[x, r], lift(operands[1]), emit)
                    continue
                if body.op(x) not in ("matmul", "batch_matmul"):
                    raise Unsupported(f"{body.node(x)['src']}: lr_grad perturbs matmuls, convs and lookups in a "
                                      f"scan's step, not {body.describe(x)}")
                a = body.attrs(x)
                copies[x] = emit("batch_matmul", [stacked[x, r], lift(operands[1])],
                                 transpose_a=bool(a.get("transpose_a")), transpose_b=bool(a.get("transpose_b")),
                                 reduce_batch=False)
                continue
            if body.op(x) != "add":
                copies[x] = emit(body.op(x), [copies[u] if u in copies else stacked[x, i] if (x, i) in stacked
                                              else lift(u) for i, u in enumerate(operands)], **body.attrs(x))
                continue
            terms = [copies[u] if u in copies else lift(u) for u in operands
                     if u in copies or param(u) is not None]
            shape = list(body.shape(x))
            shape[where[x]] = KB
            total = terms[0] if len(terms) == 1 else emit("add", terms)
            copies[x] = total if tuple(self.b.g.shape(total)) == (*steps, *shape) else \
                emit("broadcast_to", [total], shape=(*steps, *shape))
        return [copies[x] for x in tree]

    def conv_over_steps(self, x, rows, kernel, emit):
        """Conv x of a step over the stacked steps: its row operand's stack `rows` (T, KB_lr, C, H, W) and
        the kernel from outside, one conv per step (a conv takes one batch axis, and T * KB_lr is no dim
        the shapes can name), so a scan of its own whose step is that conv alone. Its VJP, a scan too,
        sums the steps' kernel gradients: each step's conv VJP, no value flowing from step to step."""
        body, src = self.body, self.body.node(x)["src"]
        if len(self.steps) > 1:
            raise Unsupported(f"{src}: lr_grad perturbs {body.describe(x)} in a scan's step, not in the step of a "
                              f"scan nested in another's (train this model with loss_and_grad)")
        step = Graph(f"{body.name}_lr_{body.op(x)}{x}")
        h = step.apply("input", attrs={"shape": tuple(self.b.g.shape(rows))[1:], "dtype": self.b.float}, src=src,
                       name="h_t")
        w = step.apply("input", attrs={"shape": tuple(self.b.g.shape(kernel)), "dtype": self.b.float}, src=src,
                       name="kernel")
        step.inputs = {"h_t": h, "kernel": w}
        step.outputs = {"z_t": step.apply(body.op(x), [h, w], body.attrs(x), src=src)}
        scan = emit("scan", [rows, kernel], body=step, carries=0, xs=1, reverse=False)
        return result(self.b.g, scan, YS, 0, emit)
