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
"""
import copy
from collections import namedtuple

from gradc.errors import GradcError
from gradc.ir import Graph
from gradc.ops.scan import ScanRows, body_rows, result
from gradc.ops.scan_layout import YS, parts

from .lr_shares import share_rows, shares
from .lr_sites import KB, LAYOUT, LOOKUPS, Unsupported, chains, is_product, misuses, row_operand
from .simplify import eliminate_dead


# a site in a step: its nodes (the noised one last), its noise and mask leaves in the step, each product's
# row operand there (returned as a y), and the outer noise sequence and mask leaf those leaves stand for
StepSite = namedtuple("StepSite", "tree eps mask_leaf rows noise mask")


class ScanNoise:
    """The scans of one estimate: their sites, the checks of their params, their perturbed copies."""

    def __init__(self, builder):
        self.b = builder

    def closed(self, n):
        """{closed-over leaf of scan n's step: the outer value it stands for}."""
        g = self.b.g
        _, leaves, _, K, X, _, _ = parts(g.attrs(n))
        return dict(zip(leaves[K + X:], g.operands(n)[K + X:]))

    def param_of(self, n):
        """A function: the value made of trainable params (of the outer graph: a param, W * s) that a value
        of scan n's step is, through reshapes and transposes of a closed-over leaf, or None."""
        body, outer = self.b.g.attrs(n)["body"], self.closed(n)

        def param(m):
            while body.op(m) in LAYOUT:
                m = body.operands(m)[0]
            return outer[m] if m in outer and outer[m] in self.b.free else None
        return param

    def sites(self, n):
        """The noise sites of scan n's step (lr_sites.chains)."""
        body = self.b.g.attrs(n)["body"]
        param = self.param_of(n)
        return chains(body, body.topo_order(), lambda m: param(m) is not None)

    def misuses(self, n):
        """[(the outer value made of params, the node reading it, its graph)] for each use of such a value
        by scan n other than as a factor of a site's product or a bias in its sum, in the step."""
        g = self.b.g
        body, leaves, _, K, X, _, _ = parts(g.attrs(n))
        param = self.param_of(n)
        closed = [leaf for leaf in leaves[K + X:] if param(leaf) is not None]
        bad = misuses(body, closed, set(body.topo_order()), self.sites(n), lambda m: param(m) is not None,
                      lambda m: body.op(m) in LAYOUT)
        for _, u in bad:
            if body.op(u) == "scan":   # the params it reads may well be factors there: say what is missing
                raise Unsupported(f"{body.node(u)['src']}: lr_grad does not follow a scan nested in another scan's "
                                  f"step (train this model with loss_and_grad)")
        # a param as an initial carry (a learned h0) or a sequence gets no noise of its own either
        entering = [u for u in g.operands(n)[:K + X] if u in self.b.free]
        return [(u, n, g) for u in entering] + [(param(leaf), u, body) for leaf, u in bad]

    def copy(self, n, ins, operands, fail):
        """The perturbed copy of scan n (its operands' stacked copies `operands`, their rows at `ins`) and
        where the rows lie in scan n's results (its rows rule); its sites are added to the builder's."""
        b, g = self.b, self.b.g
        attrs = g.attrs(n)
        body, leaves, outputs, K, X, C, M = parts(attrs)
        where = body_rows(g, n, ins, lambda why: self.step_fail(n, why, fail), share_rows)
        tops = {chain[-1]: chain for chain in self.sites(n)}
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

        counts = {}   # (dims, dtype) -> (a closed-over leaf, the outer count): the step does not know B

        def count(dims, dtype):
            if (dims, dtype) not in counts:
                outer = b.apply("count", [], g.node(n)["src"], dims=dims, dtype=dtype)
                counts[dims, dtype] = (placeholder(f"lr_count{len(counts)}", (), dtype, g.node(n)["src"]), outer)
            return counts[dims, dtype][0]

        sites = []   # StepSite
        for m in body.topo_order():
            w = where[m]
            if m in leaves or w is None:
                continue
            src = body.node(m)["src"]
            if isinstance(w, tuple):   # a per-step loss (a batch mean): kept per row, returned as (KB_lr, ...)
                emit = lambda kind, inputs, **attrs: apply(kind, inputs, attrs, src)
                copies[m] = shares(body, m, [where[u] for u in body.operands(m)], w,
                                   [copies.get(u, u) for u in body.operands(m)], emit, count)
                continue
            op, a = body.op(m), dict(body.attrs(m))
            if op == "scan":
                raise Unsupported(f"{src}: lr_grad does not follow a scan nested in another scan's step (train this "
                                  f"model with loss_and_grad)")
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
                noise, mask = b.noise(shape, src, body.op(tops[m][0]), steps=g.shape(operands[K])[0])
                eps = placeholder(f"lr_eps{len(sites)}", shape, b.float, src)
                scale = placeholder(f"lr_mask{len(sites)}", g.shape(mask), b.float, src)
                copies[m] = apply("add", [copies[m], apply("mul", [eps, scale], {}, src)], {}, src)
                rows = self.row_operands(n, body, tops[m], where, copies)
                sites.append(StepSite(tops[m], eps, scale, rows, noise, mask))
        for top in tops.keys() - {s.tree[-1] for s in sites}:
            if isinstance(where[top], tuple):   # the step's loss after its reduction over rows
                raise Unsupported(f"{body.node(top)['src']}: {body.describe(top)} combines the step's loss with a "
                                  f"value made of params in a scan's step, which lr_grad does not differentiate "
                                  f"there (scale or add to the loss after the scan)")
            raise Unsupported(f"{body.node(top)['src']}: {body.describe(top)} computes a value without batch rows "
                              f"from a trainable param in a scan's step, where lr_grad perturbs ops on batch rows "
                              f"(compute it before the scan: the step may close over a value made of params)")
        inputs = list(zip(names, [copies.get(leaf, leaf) for leaf in leaves]))
        new.inputs = dict(inputs[:K + X] + [(new.node(s.eps)["name"], s.eps) for s in sites] + inputs[K + X:]
                          + [(new.node(s.mask_leaf)["name"], s.mask_leaf) for s in sites]
                          + [(new.node(leaf)["name"], leaf) for leaf, _ in counts.values()])
        new.outputs = {name: copies.get(o, o) for name, o in body.outputs.items()}
        ys = [(key, row) for site in sites for key, row in site.rows.items()]
        new.outputs |= {f"lr_rows{i}": row for i, (_, row) in enumerate(ys)}
        eliminate_dead(new)
        ops = operands[:K + X] + [s.noise for s in sites] + operands[K + X:] + [s.mask for s in sites] \
            + [outer for _, outer in counts.values()]
        scan = b.apply("scan", ops, g.node(n)["src"], **dict(attrs, body=new, xs=X + len(sites)))
        emit = lambda op, inputs, **a: b.apply(op, inputs, g.node(n)["src"], **a)
        stacked = {key: result(g, scan, YS, M + i, emit) for i, (key, _) in enumerate(ys)}
        steps = g.shape(operands[K])[0]
        for site, step_site in zip(b.sites[len(b.sites) - len(sites):], sites):
            site.pert = emit("mul", [step_site.noise, step_site.mask])
            site.copies = self.over_steps(n, body, step_site.tree, stacked, emit, where, steps)
        return scan, ScanRows(tuple(where[o] for o in outputs), K)

    def step_fail(self, n, why, fail):
        """fail(why) for scan n's step, naming what lr_grad takes outside scans only rather than the loss's
        rule: a batch statistic read back by the step's rows (batch norm in the step), a penalty added to a
        step's loss."""
        g = self.b.g
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

    def row_operands(self, n, body, tree, where, copies):
        """{(op of the site, operand index): that operand's copy in the step}, returned as ys: what the
        site's VJP over the stacked steps reads. A product's (a lookup's) row operand; every operand with
        rows of an elementwise op other than an add (a gain's h) that is not the site's own; an add's VJP
        reads none."""
        param, closed = self.param_of(n), self.closed(n)
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

    def over_steps(self, n, body, tree, stacked, emit, where, steps):
        """A site's ops again in the outer graph, over the stacked steps (T, KB_lr, ...): each product's
        row operand's stack from `stacked` and the closed-over params (through the step's reshapes and
        transposes) as its factors (a batch_matmul: its VJP sums over the steps; a lookup of every step's
        indices at once: its VJP adds them all into the table); an elementwise op of its operands' stacks,
        params and closed-over values; an add of the params and the site's own terms, broadcast to the
        stacked shape (its VJP reads no operand, so a term with rows is left out)."""
        outer, param = self.closed(n), self.param_of(n)

        def lift(m):   # a value without rows in the step (a param, through layout ops; a constant), outside
            if m in outer:
                return outer[m]
            if body.op(m) == "const":
                return emit("const", [], **body.attrs(m))
            return emit(body.op(m), [lift(body.operands(m)[0])], **body.attrs(m))

        copies = {}
        for x in tree:
            operands = body.operands(x)
            if is_product(body, x):
                r = row_operand(body, x)
                if body.op(x) in LOOKUPS:   # the rows read at every step: (T, KB_lr, D)
                    copies[x] = emit(body.op(x), [lift(operands[0]), stacked[x, r]], **body.attrs(x))
                    continue
                if body.op(x) == "conv2d":   # one conv per step: a scan of its own, over (T, KB_lr, C, H, W)
                    copies[x] = self.conv_over_steps(body, x, stacked[x, r], lift(operands[1]), emit)
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
            copies[x] = total if tuple(self.b.g.shape(total)) == (steps, *shape) else \
                emit("broadcast_to", [total], shape=(steps, *shape))
        return [copies[x] for x in tree]

    def conv_over_steps(self, body, x, rows, kernel, emit):
        """Conv x of a step over the stacked steps: its row operand's stack `rows` (T, KB_lr, C, H, W) and
        the kernel from outside, one conv per step (a conv takes one batch axis, and T * KB_lr is no dim
        the shapes can name), so a scan of its own whose step is that conv alone. Its VJP, a scan too,
        sums the steps' kernel gradients: each step's conv VJP, no value flowing from step to step."""
        src = body.node(x)["src"]
        step = Graph(f"{body.name}_lr_{body.op(x)}{x}")
        h = step.apply("input", attrs={"shape": tuple(self.b.g.shape(rows))[1:], "dtype": self.b.float}, src=src,
                       name="h_t")
        w = step.apply("input", attrs={"shape": tuple(self.b.g.shape(kernel)), "dtype": self.b.float}, src=src,
                       name="kernel")
        step.inputs = {"h_t": h, "kernel": w}
        step.outputs = {"z_t": step.apply(body.op(x), [h, w], body.attrs(x), src=src)}
        scan = emit("scan", [rows, kernel], body=step, carries=0, xs=1, reverse=False)
        return result(self.b.g, scan, YS, 0, emit)
