"""Gradients without backpropagation: the likelihood-ratio estimate of lr_grad (DESIGN.md §1.9, seed 003).

Each product of the forward that has a trainable param as a factor (matmul, batch_matmul, conv2d;
with the bias added to it, when one is) is a noise site: its output z gets Gaussian noise,
z~ = z + sigma * eps. For z = h W (+ b), d/dz E[l(z~)] = E[l(z~) eps] / sigma, so

    dL/dW ~ mean over samples of  h~^T (c * eps) / sigma,    dL/db ~ the same with h~^T replaced by a row sum,

c being each row's loss minus a baseline. That is the matmul's (conv2d's) own VJP applied to the
cotangent c * eps / sigma: this pass builds exactly that with the ops' VJP rules, local to each
site (no value flows back from one layer to another), so the estimate is a forward graph.

The K perturbed copies run as one batched forward: every value that depends on a batch input is
copied with its rows stacked K times (dim KB_lr = K * B, sample-major), the inputs tiled by the
module. Values without rows (params, constants, a GCN's adjacency) are shared. The sites' noise
comes from the counter-based `random` op (one stream each), its second half repeating the first
for antithetic pairs; a per-site mask of shape (KB_lr, 1, ...) holds +-sigma or 0 per row, so
antithetic pairs, layer-wise injection (one site per block of samples) and sigma are chosen at
call time.

Which loss pairs with which noise: when no op mixes rows, row b's loss depends only on row b's
noise, and each row's loss term (its share of the objective: l_b / B for a mean) pairs with its
own noise (per row). When an op mixes rows (A @ H in a graph convolution: a row-mixing product
runs per sample, as a batch_matmul over (K, N, F)), every row of sample k pairs with the sample's
whole loss L_k (per sample). Both are unbiased for the noised objective; per row has far less
variance. The baseline (call time) is the mean over the samples of each row's (or sample's) loss,
made leave-one-out by the factor K/(K-1) the module folds into the scale; with antithetic pairs
no baseline is needed (the pair's difference removes any baseline).

Params the estimate cannot reach (used other than as a factor of a product or a bias added to
one), random ops, and ops that mix rows in ways not covered make lr_grad raise at call time with
the reason (graph.lr["why"]); compile never fails because of this pass.
"""
from gradc.errors import GradcError
from gradc.ops import get_op

from .autodiff import VJPContext, accumulate

PRODUCT_KINDS = ("matmul", "conv")   # the records whose outputs are pre-activations: noise goes there
LAYOUT = ("reshape", "transpose")
K, KB = "K_lr", "KB_lr"          # the samples, and the stacked rows K * B
DIMS = (K, KB)
STREAM = 1 << 20                 # noise streams, apart from the model's own random ops
PHASE = "forward"                # an estimate is forward work: nothing here is kept for a backward


class Unsupported(Exception):
    pass


def build_lr(graph, trainable, decayed=(), weight_decay=0.0):
    """graph.lr: the estimate's tables (grads, leaves, sites, ...), or {"why": reason} when it cannot be built."""
    try:
        graph.lr = _Builder(graph, trainable, decayed, weight_decay).build()
    except Unsupported as e:
        graph.lr = {"why": str(e)}   # the nodes made so far are dead code: simplify removes them


def drop_lr(graph, why):
    """No lr_grad in this build (e.g. a pipeline): its nodes die with the next DCE."""
    graph.lr = {"why": why}


class _Builder:
    def __init__(self, g, trainable, decayed, weight_decay):
        self.g = g
        self.trainable = {g.params[p]: p for p in trainable}
        self.decayed, self.wd = set(decayed), weight_decay
        self.fwd = g.ancestors([g.loss])
        self.float = g.dtype(g.loss)
        self.src = g.node(g.loss)["src"]
        self.leaves, self.tiled, self.copy, self.where = {}, {}, {}, {}
        self.mixing = []

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

    def param_of(self, n):
        """The trainable param n is (through reshapes and transposes), or None."""
        while self.g.op(n) in LAYOUT:
            n = self.g.operands(n)[0]
        return n if n in self.trainable else None

    # ---- the pass --------------------------------------------------------------------------
    def build(self):
        g = self.g
        self.batch = self.batch_dim()
        sites = self.find_sites()
        self.check_params(sites)
        tops = {chain[-1]: chain for chain in sites}
        seed = self.leaf("seed", (), "int64")
        half = self.leaf("half", (), "int64")
        rows = self.leaf("rows", (K, self.batch), self.float)   # each (sample, row)'s weight (ones); carries K_lr, B
        scale = self.leaf("scale", (), self.float)
        baseline = self.leaf("baseline", (), self.float)
        perturbed = {}
        for n in g.topo_order(self.fwd):
            self.where[n] = self.track(n)
            if n in tops:
                if self.where[n] != 0:
                    raise Unsupported(f"{g.node(n)['src']}: {g.describe(n)} has its batch rows on axis "
                                      f"{self.where[n]}, not the first: the estimate perturbs products of rows")
                i = len(perturbed)
                z = self.copy[n]
                shape = g.shape(z)
                noise = self.apply("random", [seed, half], g.node(n)["src"], dist="normal", p=0.0, stream=STREAM + i,
                                   shape=shape, dtype=self.float)
                mask = self.leaf(f"mask{i}", (KB,) + (1,) * (len(shape) - 1), self.float)
                pert = self.apply("mul", [noise, mask], g.node(n)["src"])
                self.copy[n] = self.apply("add", [z, pert], g.node(n)["src"])
                perturbed[n] = (z, pert, f"mask{i}")
        if not isinstance(self.where[g.loss], tuple):
            raise Unsupported(f"{self.src}: the loss does not reduce over the batch rows ({self.batch!r}), so there "
                              f"is no loss per row or per sample to pair with the noise")
        coef = self.coefficients(self.copy[g.loss], baseline, rows)
        contributions = {p: [] for p in self.trainable}
        for top, (z, pert, _) in perturbed.items():
            rank = len(g.shape(pert))
            c = self.view(coef, (KB,) + (1,) * (rank - 1)) if rank > 1 else coef
            cot = self.apply("mul", [self.apply("mul", [c, pert]), scale])
            for p, gp in self.local_vjp(tops[top], z, cot).items():
                contributions[p].append(gp)
        grads = {}
        for p, name in self.trainable.items():
            parts = contributions[p]
            total = accumulate(g, parts, PHASE, self.src) if parts else None
            if name in self.decayed and self.wd and p in self.fwd:   # the objective's decay, exactly
                wd = self.apply("const", [], value=float(self.wd), shape=(), dtype=self.float)
                term = self.apply("mul", [wd, p])
                total = term if total is None else self.apply("add", [total, term])
            grads[name] = total
        sites_doc = [{"node": top, "op": g.op(tops[top][0]), "shape": [str(d) for d in g.shape(top)],
                      "src": g.node(top)["src"], "mask": key} for top, (_, _, key) in perturbed.items()]
        return {"why": None, "grads": grads, "leaves": self.leaves, "tiled": self.tiled, "sites": sites_doc,
                "per_row": not self.mixing, "batch": self.batch,
                "mixing": [g.node(n)["src"] for n in self.mixing]}

    def batch_dim(self):
        for name, n in self.g.inputs.items():
            if self.g.shape(n):
                return self.g.shape(n)[0]
        raise Unsupported("the model has no input with rows to perturb")

    def find_sites(self):
        """Chains [product, bias add, ...] whose last node gets the noise."""
        g, sites = self.g, []
        for n in g.topo_order(self.fwd):
            if get_op(g.op(n)).kind not in PRODUCT_KINDS or not any(self.param_of(u) is not None for u in g.operands(n)):
                continue
            chain = [n]
            while True:
                users = [u for u in g.users(chain[-1]) if u in self.fwd]
                if len(users) != 1 or g.op(users[0]) != "add" or g.shape(users[0]) != g.shape(chain[-1]):
                    break
                other = [u for u in g.operands(users[0]) if u != chain[-1]]
                if len(other) != 1 or self.param_of(other[0]) is None:
                    break
                chain.append(users[0])
            sites.append(chain)
        return sites

    def check_params(self, sites):
        """Every use of a trainable param must be a factor of a site's product or a bias in its chain."""
        g = self.g
        allowed = {(x, u) for chain in sites for x in chain for u in g.operands(x) if self.param_of(u) is not None}
        bad = []
        for p, name in self.trainable.items():
            if p not in self.fwd:
                continue
            stack = [p]
            while stack:
                x = stack.pop()
                for u in g.users(x):
                    if u not in self.fwd:
                        continue
                    if g.op(u) in LAYOUT:
                        stack.append(u)
                    elif (u, x) not in allowed:
                        bad.append((name, u))
        scans = [u for _, u in bad if g.op(u) == "scan"]
        if scans:
            raise Unsupported(f"{g.node(scans[0])['src']}: lr_grad does not cover gc.scan yet (its params are read "
                              f"inside the scan's body, where no noise site is built); unroll the recurrence in Python "
                              f"to train it with lr_grad, or use loss_and_grad")
        if bad:
            names = ", ".join(dict.fromkeys(repr(n) for n, _ in bad))
            name, u = bad[0]
            raise Unsupported(f"param {names} reach(es) the loss other than as a factor of a matmul or conv2d (or a "
                              f"bias added to one): {name!r} is read by {g.describe(u)} at {g.node(u)['src']}. The "
                              f"likelihood-ratio estimate perturbs only the products' outputs, so it has nothing to "
                              f"attribute to such a param (it would not be zero, and lr_grad will not pretend it is): "
                              f"declare it trainable=False, or train with loss_and_grad")

    def track(self, n):
        """Where n's batch rows lie (an axis, None when it has none, ("reduced", kind) after the loss's
        reduction over rows), building n's stacked copy when it has rows."""
        g = self.g
        op, node = g.op(n), g.node(n)
        shape = node["shape"]
        if op == "input":
            # an adjacency (N, N) read only as the left factor of products is the same for every sample
            adjacency = len(shape) == 2 and shape[0] == shape[1] and all(
                g.op(u) == "matmul" and g.operands(u)[0] == n and n not in g.operands(u)[1:]
                and not g.attrs(u).get("transpose_a") for u in g.users(n) if u in self.fwd)
            if not shape or shape[0] != self.batch or adjacency:
                return None
            name = node["name"]
            self.tiled[name] = f"tile:{name}"
            self.copy[n] = self.leaf(f"tile:{name}", (KB,) + tuple(shape[1:]), node["dtype"])
            return 0
        if op in ("param", "const"):
            return None
        ins = [self.where[u] for u in g.operands(n)]
        if all(w is None for w in ins):
            return None
        operands = [self.copy.get(u, u) for u in g.operands(n)]
        attrs = dict(node["attrs"])
        src = node["src"]

        def fail(why):
            raise Unsupported(f"{src}: {g.describe(n)} {why}; lr_grad stacks the K perturbed copies on the rows")

        if op == "matmul" and ins[0] is None and ins[1] == 0 and not attrs.get("transpose_a") \
                and not attrs.get("transpose_b") and g.shape(g.operands(n)[0]) == (self.batch, self.batch):
            # A @ H with A (N, N) mixing the rows of H: once per sample, as a batch_matmul over (K, N, F)
            a, h = operands
            h3 = self.view(h, (K, self.batch) + tuple(g.shape(h)[1:]))
            prod = self.apply("batch_matmul", [a, h3], src, transpose_a=False, transpose_b=False, reduce_batch=False)
            self.copy[n] = self.view(prod, (KB,) + tuple(shape[1:]))
            self.mixing.append(n)
            return 0
        record = get_op(op)
        if record.kind != "elementwise" and any(isinstance(w, tuple) for w in ins):
            fail("uses the loss after its reduction over rows in a way that is not a sum of scaled terms")
        if record.rows is None:
            fail("is an op gradc cannot follow the rows through")
        where = record.rows(g, n, ins, fail)
        if isinstance(where, tuple) and not any(isinstance(w, tuple) for w in ins):
            self.copy[n] = self.per_row(n, ins[0], where[1])
            return where
        if isinstance(where, tuple):   # a scale or sum of reduced terms: the same on each row's share
            self.copy[n] = self.apply(op, operands, src, **attrs)
            return where
        for key in ("shape",):
            if key in attrs:
                target = list(attrs[key])
                target[where] = KB
                attrs[key] = tuple(target)
        self.copy[n] = self.apply(op, operands, src, **attrs)
        return where

    def per_row(self, n, axis, kind):
        """The loss's reduction over rows, keeping the rows: each row's share of it, shape (KB_lr,)."""
        g = self.g
        (x,) = g.operands(n)
        if g.op(n) not in ("sum", "mean") or g.attrs(n).get("keepdims"):
            raise Unsupported(f"{g.node(n)['src']}: the loss reduces the rows with {g.describe(n)}; lr_grad takes a "
                              f"sum or a mean (without keepdims)")
        xc = self.copy[x]
        axes = tuple(a for a in g.attrs(n)["axes"] if a != axis)
        r = self.apply("sum", [xc], g.node(n)["src"], axes=axes, keepdims=False) if axes else xc
        if tuple(g.shape(r)) != (KB,):
            r = self.view(r, (KB,))
        if kind == "mean":
            dims = tuple(g.shape(x)[a] for a in g.attrs(n)["axes"])
            count = self.apply("count", [], g.node(n)["src"], dims=dims, dtype=self.float)
            r = self.apply("div", [r, count], g.node(n)["src"])
        return r

    def coefficients(self, r, baseline, rows):
        """Each stacked row's weight c: its share of the loss (per row) or its sample's loss (per sample),
        less `baseline` times the mean over the samples, times the row's weight; shape (KB_lr,)."""
        r2 = self.view(r, (K, self.batch))
        if self.mixing:
            total = self.apply("sum", [r2], axes=(1,), keepdims=True)
            r2 = self.apply("broadcast_to", [total], shape=(K, self.batch))
        mean = self.apply("mean", [r2], axes=(0,), keepdims=True)
        c2 = self.apply("mul", [self.apply("sub", [r2, self.apply("mul", [baseline, mean])]), rows])
        return self.view(c2, (KB,))

    def local_vjp(self, chain, z, cot):
        """The params' parts of the estimate at one site: the VJPs of the chain's copies (product, bias adds)
        and of the layout ops between them and the params, with cotangent `cot` at the chain's output z."""
        g = self.g
        copies = [self.copy_of_chain(x) for x in chain[:-1]] + [z]
        active = set(copies)
        for x in copies:
            for u in g.operands(x):
                if self.param_of(u) is not None:
                    while u not in active:
                        active.add(u)
                        if g.op(u) in LAYOUT:
                            u = g.operands(u)[0]
        adjoints = {z: [cot]}
        result = {}
        for n in reversed(g.topo_order(active)):
            parts = adjoints.pop(n, None)
            if not parts:
                continue
            gn = accumulate(g, parts, PHASE, self.src)
            if n in self.trainable:
                result[n] = gn
                continue
            grads = get_op(g.op(n)).vjp(VJPContext(g, n, active, PHASE), n, gn)
            for u, gu in zip(g.operands(n), grads):
                if gu is not None and u in active:
                    adjoints.setdefault(u, []).append(gu)
        return result

    def copy_of_chain(self, x):
        return self.copy[x]
