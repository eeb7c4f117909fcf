"""Random models that lr_grad estimates (DESIGN.md §1.9), for fuzzing it (no tests here: see test_fuzz.py).

tests/fuzz_graphs.py's programs read params elementwise and mix the batch's rows (x.T, reductions and
softmaxes over any axis), which the likelihood-ratio estimate refuses. These programs are grown by the
same generator with its moves kept to what the estimate takes: a row meets another row before the loss
only through a graph convolution's A @ H (A a sparse normalised adjacency input (B, B)) and batch norm's
statistics over the rows (one per perturbed copy), and a trainable param is a product's factor (matmul,
conv2d; or a weight made of params: a low-rank product plus a param, a param times a gate of another), a
table of take, a bias added to a product, a gain read elementwise by a row value (mul, add, maximum;
maybe through sigmoid, exp or tanh; in a scan's step too), in an L2 penalty added to the loss (with a
constant), or a learned weight of a loss term (t * exp(-s) + s). Besides those: elementwise ops of row
values and constants (user ops too), reshapes and transposes that keep the rows an axis, sums, means and
maxes and softmaxes over other axes, indexing, concatenations and stacks, images, pools, embeddings of
int inputs (tokens (T, B) too: noise on axis 1), scans of random recurrent cells (gates, two carries, ys
made by a product in the step; a scan nested in the step) and of convolutional cells (an image carry,
convs in the step), dropout and Gaussian noise drawn from an int input (the same draws in every
perturbed copy), biases added to any row value, frozen params read elementwise, and a loss of per-row
terms: cross-entropy over (B, C) or (B, k, C) logits plus sums, means and squared errors over whole
values, means weighted by an input mask over its count, weighted, added and subtracted, maybe through
softplus or sqrt(l^2 + 1), with weight decay.

`check_lr_general(case)` runs the same bias check on the general fuzzer's programs, which lr_grad runs
per perturbed copy where their ops mix rows.

`lr_case(seed)` gives a fuzz_graphs.Case; `check_lr_compiled(case, out)` that the generated module's
lr_grad is the interpreter's; `check_lr(case)` asserts that lr_grad builds for it (a refusal is a
finding: the program is one the estimate should take) and that the estimate is unbiased: over `seeds`
estimates, each coordinate's mean is within what its standard error allows of loss_and_grad's gradient
(the same interpreted graph's, compared with torch autograd first). Mean squared z-scores near 1 say
unbiased; a biased or missing part gives thousands.
"""
import numpy as np

import gradc as gc

import torch

from fuzz_graphs import (BATCH, BINARY, LIMIT, MAX_PARAMS, USER_OPS, _RUN, Case, Cell, Const, Step, _Generator,
                         _Reject, check_interpreted)
from gradc.passes.pipeline import build_training_graph
from test_lr_grad import interpret_lr


BROADCASTING = set(BINARY) | {"maximum"} | set(USER_OPS)
ADJACENCY = "adj"   # a graph's normalised adjacency (B, B): read only as the left factor of A @ H


class _RowGenerator(_Generator):
    """The generator with every move kept to row-wise values (see the module's docstring)."""

    SEED_INPUT = "draw"   # an input named seed could not be given to lr_grad beside its option seed
    STEP_GAINS = 0.3

    def floats(self, pred=lambda s: True, leaves=True):
        """Values with the batch's rows only: params (and what only params make) are never an operand of
        an elementwise op, a reduction or a join; the product moves add their own weights."""
        return [n for n in super().floats(pred, leaves) if BATCH in self.shapes[n] and n != ADJACENCY]

    def emit(self, op, args, result, tag=None, bounded=True, **kw):
        """A broadcast must keep the rows on one axis: (B, 1) against (B,) would pair every row with every other."""
        if op in BROADCASTING:
            ranked = [self.shape_of(a) for a in args]
            at = {len(result) - len(s) + s.index(BATCH) for s in ranked if BATCH in s}
            if len(at) > 1 or list(result).count(BATCH) > 1:
                raise _Reject("rows against another axis")
        return super().emit(op, args, result, tag, bounded, **kw)

    def matmul(self, a=None, b=None):
        """A row value (B, F) times a new weight or a constant (a rank-1 left factor would sum over rows)."""
        if a is None:
            a = self.pick(self.floats(lambda s: len(s) == 2 and s[0] == BATCH))
        if self.shapes[a][0] != BATCH or len(self.shapes[a]) != 2:
            raise _Reject("not rows")
        if b is None:   # never a row value: (B, F) @ (F, B) would sum over rows
            F, rng = self.shapes[a][1], self.rng
            shared = [p for p, (s, trainable, _) in self.prog.params.items()
                      if trainable and len(s) == 2 and s[0] == F and p not in self.single_use]
            if shared and rng.random() < 0.3:   # a weight two products share: both sites' parts
                b = shared[rng.integers(len(shared))]
            elif rng.random() < 0.1:
                b = self.const((F, int(rng.integers(2, 6))))
            elif rng.random() < 0.15:
                b = self.made_of_params((F, int(rng.choice([self.N, self.M, self.C]))))
            else:
                b = self.add_param((F, int(rng.choice([self.N, self.M, self.C]))) if rng.random() < 0.8 else (F,))
        return super().matmul(a, b)

    def made_of_params(self, shape):
        """A weight made of trainable params (a low-rank product plus a param, or a param times a gate of
        another, per column): its parts through them exact."""
        rng = self.rng
        if rng.random() < 0.5:
            u, v = self.add_param((shape[0], 2), scale=0.5), self.add_param((2, shape[1]), scale=0.5)
            low = self.emit("matmul", [u, v], shape, tag="matmul[params]", form="op")
            return self.emit("add", [low, self.add_param(shape)], shape, tag="add[params]")
        gate = self.emit(str(rng.choice(["sigmoid", "exp", "tanh"])), [self.add_param((1, shape[1]), scale=0.5)],
                         (1, shape[1]), tag="unary[param]")
        return self.emit("mul", [self.add_param(shape), gate], shape, tag="mul[params]")

    def gain(self):
        """A row value scaled, shifted or clipped elementwise by a trainable param (or a function of one): an
        elementwise site of its own."""
        rng = self.rng
        v = self.pick(self.floats(lambda s: len(s) >= 2 and isinstance(s[-1], int)))
        s = self.shapes[v]
        p = self.add_param((s[-1],), scale=0.5)
        if rng.random() < 0.4:
            p = self.emit(str(rng.choice(["sigmoid", "exp", "tanh"])), [p], (s[-1],), tag="unary[param]")
        op = str(rng.choice(["mul", "add", "maximum"], p=[0.6, 0.2, 0.2]))
        return self.emit(op, [v, p], s, tag=f"{op}[gain]")

    def penalty(self, loss):
        """loss plus a term of trainable params alone (an L2 penalty written in the loss, maybe a constant):
        differentiated exactly."""
        rng = self.rng
        params = [p for p, (_, trainable, _) in self.prog.params.items() if trainable and self.uses[p]]
        if not params:
            raise _Reject("no param")
        p = params[rng.integers(len(params))]
        square = self.emit("mul", [p, p], self.shapes[p], tag="mul[param, param]", bounded=False)
        total = self.emit(str(rng.choice(["sum", "mean"])), [square], (), tag="reduce[param]", axis=None,
                          keepdims=False, form="fn", bounded=False)
        term = self.emit("mul", [total, Const(float(np.round(rng.uniform(0.05, 0.5), 3)))], (), tag="mul[const]",
                         bounded=False)
        loss = self.emit("add", [loss, term], (), tag="add[penalty]", bounded=False)
        if rng.random() < 0.5:
            loss = self.emit("sub", [loss, Const(float(np.round(rng.uniform(-1, 1), 3)))], (), tag="sub[const]",
                             bounded=False)
        return loss

    def weighted(self, term):
        """A loss term scaled by a factor of a new trainable scalar (exp(-s), sigmoid(s), or s itself), with s
        added too (a learned task weight): the factor's part reads the term after its reduction, exactly."""
        rng = self.rng
        s = self.add_param((), scale=0.5)
        f = s if rng.random() < 0.3 else self.emit(str(rng.choice(["exp", "sigmoid"])), [s], (), tag="unary[param]",
                                                   bounded=False)
        scaled = self.emit(str(rng.choice(["mul", "div"])) if f != s else "mul", [term, f], (), tag="mul[weight]",
                           bounded=False)
        return self.emit("add", [scaled, s], (), tag="add[penalty]", bounded=False)

    def batch_norm(self):
        """A row value (B, F) or image (B, C, H, W) normalised by its batch's mean and variance over the rows
        (and the image's positions), maybe centred only: batch statistics, one per perturbed copy."""
        rng = self.rng
        v = self.pick(self.floats(lambda s: len(s) in (2, 4) and s[0] == BATCH and all(
            isinstance(d, int) for d in s[1:])))
        s = self.shapes[v]
        axes = (0,) if len(s) == 2 else (0, 2, 3)
        stat = tuple(1 if a in axes else d for a, d in enumerate(s)) if len(s) == 4 else s[1:]
        kw = dict(axis=axes, keepdims=len(s) == 4, form="method", bounded=False)
        mu = self.emit("mean", [v], stat, tag="mean[batch statistic]", **kw)
        on_stat = rng.random() < 0.3   # a param applied to the statistic: a site with noise per copy
        if on_stat and rng.random() < 0.5:   # h - mu * s
            mu = self.emit("mul", [mu, self.add_param(stat, scale=0.5)], stat, tag="mul[param, statistic]",
                           bounded=False)
            return self.emit("sub", [v, mu], s, tag="sub[batch statistic]")
        centred = self.emit("sub", [v, mu], s, tag="sub[batch statistic]")
        if rng.random() < 0.3:
            return centred
        var = self.emit("mean", [self.emit("mul", [centred, centred], s, bounded=False)], stat,
                        tag="mean[batch statistic]", **kw)
        sd = self.emit("sqrt", [self.emit("add", [var, Const(0.1)], stat, bounded=False)], stat, bounded=False)
        if on_stat:   # batch norm's scale folded: (h - mu) * (g / sd)
            scale = self.emit("div", [self.add_param(stat, scale=0.5), sd], stat, tag="div[param, statistic]",
                              bounded=False)
            return self.emit("mul", [centred, scale], s, tag="mul[batch statistic]")
        return self.emit("div", [centred, sd], s, tag="div[batch statistic]")

    def propagate(self):
        """A graph convolution's A @ H: the adjacency input (B, B) of a random sparse directed graph with
        self-loops, normalised D^-1 A (each row the mean over its in-neighbours), mixing the rows of a row
        value (B, F). Its copies run per sample, and each site's noise pairs with the rows it reaches (its
        own, its neighbours', or the sample's)."""
        v = self.pick(self.floats(lambda s: len(s) == 2 and s[0] == BATCH))
        if ADJACENCY not in self.prog.inputs:
            self.add_input(ADJACENCY, (BATCH, BATCH))
            n = self.data[ADJACENCY].shape[0]   # directed edges: A is not symmetric, so A and A^T differ
            linked = (self.rng.random((n, n)) < 0.4) | np.eye(n, dtype=bool)
            self.data[ADJACENCY] = linked / linked.sum(axis=1, keepdims=True)   # the mean over in-neighbours
            self.values[ADJACENCY] = torch.as_tensor(self.data[ADJACENCY])
        return self.emit("matmul", [ADJACENCY, v], self.shapes[v], tag="matmul[adjacency]", form="op")

    def conv_scan(self):
        """A convolutional RNN: gc.scan over images (T, B, C', H, W) whose carry is an image (B, C, H, W),
        h' = f(conv(h, Wh) + conv(x_t, Wx) (+ b)), both convs "same" (odd kernels, stride 1), maybe
        returning h' or conv(h', Wy) as a y (T, B, ., H, W): convs in a step, each step's noise on their sum."""
        rng = self.rng
        if len(self.prog.params) + 4 > MAX_PARAMS:
            raise _Reject("params")
        h0 = self.pick(self.images())
        _, C, H, W = self.shapes[h0]
        T, Cx = int(rng.integers(2, 5)), int(rng.integers(1, 3))
        xs = self.add_input(f"s{len(self.prog.inputs)}", (T, BATCH, Cx, H, W))
        steps, closed = [], []

        def op(name, args, **kw):
            closed.extend(u for u in args if isinstance(u, str) and u in self.shapes and u not in closed)
            steps.append(Step(f"u{len(steps)}", name, tuple(args), kw, name))
            return steps[-1].out

        def conv(v, c_in, c_out):
            k = int(rng.choice([1, 3]))
            w = self.add_param((c_out, c_in, k, k), scale=0.8 / np.sqrt(c_in * k * k))
            return op("conv2d", [v, w], **({"padding": k // 2} if k > 1 else {}))

        pre = op("add", [conv("ch", C, C), conv("cx", Cx, C)])   # (names no outer value has)
        if rng.random() < 0.5:
            pre = op("add", [pre, self.add_param((C, 1, 1), scale=0.5)])
        new = op(str(rng.choice(["tanh", "sigmoid"])), [pre])
        ys = [[lambda: new, lambda: conv(new, C, 2)][int(rng.integers(2))]()] if rng.random() < 0.6 else []
        cell = Cell(f"cell{len(self.prog.steps)}", ("ch",), ("cx",), tuple(closed), steps, (new,), tuple(ys))
        args = [h0, xs] + closed
        kw = {"cell": cell, "reverse": bool(rng.random() < 0.3)}
        out = _RUN["torch"]["scan"]([self.values[u] for u in args], kw, self.prog.dims)
        if not all(torch.isfinite(o).all() and o.abs().max() <= LIMIT for o in out):
            raise _Reject("large")
        name = f"v{len(self.prog.steps)}"
        self.prog.steps.append(Step(name, "scan", tuple(args), kw, f"scan[convs, {len(ys)} ys]"))
        self.uses.update(args)
        self.values[name] = out
        self.emit("item", [name], (BATCH, C, H, W), tag="scan result", i=0, path=(0,))
        if ys:
            self.emit("item", [name], (T, BATCH) + tuple(out[1].shape[2:]), tag="scan result", i=1, path=(1,))
        return name

    def layout(self, v=None):
        """A transpose of the axes other than the rows', or a reshape that keeps the rows an axis."""
        v = v or self.pick(self.floats(lambda s: len(s) >= 2))
        s, rng = self.shapes[v], self.rng
        others = [i for i in range(len(s)) if s[i] != BATCH]
        if len(others) >= 2 and rng.random() < 0.5:
            moved = [others[i] for i in rng.permutation(len(others))]
            if moved == others:
                moved = moved[1:] + moved[:1]
            it = iter(moved)
            axes = tuple(i if s[i] == BATCH else next(it) for i in range(len(s)))
            return self.emit("transpose", [v], tuple(s[i] for i in axes), tag=f"transpose[{len(s)}d, rows kept]",
                             form="axes", axes=axes)
        target = self.reshape_target(s)
        if target == s[::-1] and len(s) == 2:
            raise _Reject("moves the rows")
        return self.emit("reshape", [v], target, tag="reshape", form=str(rng.choice(["method", "fn"])),
                         shape=tuple(target))

    def reduce(self, v=None):
        """A sum, mean or max over axes other than the rows'."""
        v = v or self.pick(self.floats(lambda s: len(s) >= 2))
        s, rng = self.shapes[v], self.rng
        others = [i for i in range(len(s)) if s[i] != BATCH]
        if not others:
            raise _Reject("only rows")
        axis = others[rng.integers(len(others))] if len(others) == 1 or rng.random() < 0.6 else \
            tuple(sorted(int(i) for i in rng.choice(others, 2, replace=False)))
        op, keepdims = str(rng.choice(["sum", "mean", "max"])), bool(rng.random() < 0.4)
        return self.emit(op, [v], _reduced(s, axis, keepdims), tag=f"{op}[axes{', keepdims' if keepdims else ''}]",
                         axis=axis, keepdims=keepdims, form=str(rng.choice(["method", "fn"])))

    def softmax(self, v=None):
        v = v or self.pick(self.floats(lambda s: len(s) >= 2))
        s = self.shapes[v]
        axis = int(self.rng.choice([i for i in range(len(s)) if s[i] != BATCH]))
        return self.emit(str(self.rng.choice(["softmax", "log_softmax"])), [v], s, axis=axis)

    def embed_sequence(self):
        """Tokens (T, B) looked up in a trainable table: a sequence for a scan, its rows on axis 1 (the site's
        noise there too)."""
        rng = self.rng
        name = f"tokens{len(self.prog.inputs)}"
        self.add_input(name, (int(rng.integers(2, 5)), BATCH), "int64", high=int(rng.integers(3, 8)))
        rows = self.int_high.pop(name)   # no other take reads them: its index moves take rows on axis 0
        table = self.add_param((rows, int(rng.choice([self.N, self.M]))))
        return self.emit("take", [table, name], self.shapes[name] + (self.shapes[table][1],),
                         tag="take[param, tokens (T, B)]")

    def bias(self):
        """A trainable bias added to a row value no product just made: a site of its own."""
        v = self.pick(self.floats(lambda s: len(s) >= 2 and isinstance(s[-1], int)))
        return self.emit("add", [v, self.add_param((self.shapes[v][-1],), scale=0.5)], self.shapes[v], tag="add[bias]")

    def masked_term(self, v):
        """v's rows weighted by a mask over the mask's count: sum(per_row(v) * w) / sum(w), w a positive
        input (B,): a sum over rows no noise reaches, a constant of the estimate."""
        if self.shapes[v][0] != BATCH:
            raise _Reject("not rows first")
        if "w" not in self.prog.inputs:
            self.add_input("w", (BATCH,))
            self.data["w"] = np.abs(self.data["w"]) + 0.5
            self.values["w"] = self.values["w"].abs() + 0.5
        s = self.shapes[v]
        rows = self.emit("sum", [v], (BATCH,), tag="sum[axes]", axis=tuple(range(1, len(s))), keepdims=False,
                         form="method", bounded=False) if len(s) > 1 else v
        weighted = self.emit("mul", [rows, "w"], (BATCH,), bounded=False)
        total = self.emit("sum", [weighted], (), tag="sum[all]", axis=None, keepdims=False, form="fn", bounded=False)
        count = self.emit("sum", ["w"], (), tag="sum[all]", axis=None, keepdims=False, form="fn", bounded=False)
        return self.emit("div", [total, count], (), tag="div[by a mask's count]", bounded=False)


def _reduced(shape, axis, keepdims):
    axes = {axis} if isinstance(axis, int) else set(axis)
    return tuple(1 if i in axes else d for i, d in enumerate(shape) if keepdims or i not in axes)


def _generate_rows(seed):
    g = _RowGenerator(seed)
    rng = g.rng
    x = g.add_input("x", (BATCH, g.N))
    if rng.random() < 0.3:   # a frozen gain read elementwise: the estimate needs nothing from it
        gain = g.add_param((g.N,), trainable=False)
        x = g.emit("mul", [x, gain], (BATCH, g.N), tag="mul[frozen param]")
    xent = rng.random() < 0.7
    if xent:
        g.add_input("y", (BATCH,), dtype="int64")
    if rng.random() < 0.3:
        g.add_input("img", (BATCH, int(rng.integers(1, 4)), int(rng.integers(3, 8)), int(rng.integers(3, 8))))
    g.attempt(lambda: g.matmul(x, g.add_param((g.N, g.M))))
    moves = [g.unary, g.binary, g.matmul, g.layout, g.reduce, g.softmax, g.rank3, g.conv, g.pool, g.index, g.join,
             g.take, g.scan, g.random, g.bias, g.embed_sequence, g.gain, g.conv_scan, g.propagate, g.batch_norm]
    weights = np.array([0.2, 0.2, 0.2, 0.08, 0.08, 0.05, 0.04, 0.08, 0.05, 0.05, 0.05, 0.1, 0.12, 0.04, 0.05, 0.04,
                        0.05, 0.04, 0.06, 0.05])
    g.nest_rng, g.nest_chance = np.random.default_rng([seed, 11]), 0.2   # a scan in a step (its own draws)
    for _ in range(int(rng.integers(5, 12))):
        g.attempt(moves[rng.choice(len(moves), p=weights / weights.sum())])
    terms = []
    if xent:
        k = int(rng.integers(2, 4)) if rng.random() < 0.25 else None
        labels = "y" if k is None else g.add_input("yk", (BATCH, k), dtype="int64")
        logits = g.attempt(g.logits if k is None else lambda: g.logits_per_position(k))
        if logits:
            terms.append(g.emit("xent", [logits, labels], (), bounded=False))
    for v in [n for n in g.floats(leaves=False) if not g.uses[n] and n not in terms]:
        t = g.attempt(g.masked_term if rng.random() < 0.15 else g.term, v)
        if t:
            terms.append(t)
    terms = [g.attempt(g.weighted, t) or t if rng.random() < 0.08 else t for t in terms]
    loss = terms[0]
    for t in terms[1:]:
        w = g.emit("mul", [t, Const(float(np.round(rng.uniform(0.3, 1.5), 3)))], (), tag="mul[const]", bounded=False)
        loss = g.emit(str(rng.choice(["add", "sub"])), [loss, w], (), bounded=False)
    if rng.random() < 0.2:
        loss = g.attempt(g.penalty, loss) or loss
    if rng.random() < 0.1:   # not affine in its reduction over rows: one loss per perturbed copy
        loss = g.attempt(lambda: g.emit("softplus", [loss], (), tag="unary[loss]", bounded=False)) or g.emit(
            "sqrt", [g.emit("add", [g.emit("mul", [loss, loss], (), bounded=False), Const(1.0)], (), bounded=False)],
            (), tag="unary[loss]", bounded=False)   # (softplus of a loss over 3 is refused as large)
    g.prog.loss = loss
    g.prog.weight_decay = float(rng.choice([0.0, 0.01, 0.1]))
    return g.prog, g.data


def lr_case(seed):
    prog, data = _generate_rows(seed)
    return Case([prog], [data], f"lrfuzz{seed}")


def check_lr(case, samples=256, seeds=16, sigma=1e-3):
    """lr_grad builds for the case and its estimate is unbiased (assert_unbiased), the gradient first
    checked against torch autograd (check_interpreted). Returns the largest per-param mean."""
    check_interpreted(case)
    graph = build_training_graph(case.model, "float64", order=1)
    assert graph.lr["why"] is None, f"lr_grad refused lrfuzz seed {case.seeds}: {graph.lr['why']}\n{case.text()}"
    return assert_unbiased(graph, case.params, case.inputs, f"lrfuzz seed {case.seeds}", case.text(),
                           [p for p in case.trainable], samples, seeds, sigma)


def check_lr_general(case, samples=256, seeds=16, sigma=1e-3):
    """lr_grad on a program of the general fuzzer (tests/fuzz_graphs.py), which mixes rows freely (x.T,
    softmaxes and products over the batch): where it builds, its estimate is unbiased (assert_unbiased);
    where it refuses, the reason is returned (some such programs have no estimate: a scan along the batch
    dim). Returns None when it built."""
    graph = build_training_graph(case.model, "float64", order=1)
    if graph.lr["why"] is not None:
        return graph.lr["why"]
    assert_unbiased(graph, case.params, case.inputs, f"general fuzz seed {case.seeds}", case.text(),
                    [p for p in case.trainable], samples, seeds, sigma)
    return None


def assert_unbiased(graph, params, inputs, what, text, trainable=None, samples=256, seeds=16, sigma=1e-3, mode=None):
    """Every trainable param (of `trainable`, default all the graph's) that reaches the loss has a part,
    and the mean of `seeds` estimates is loss_and_grad's gradient within its standard error: for each
    param, the mean squared z-score over its coordinates is below 2 + 6 sqrt(2 / size) (about 1 when
    unbiased; a bias confined to one small param shows on its own). A param above it is checked again with
    4x, then 16x the seeds: a bias grows with them, a chance excursion of heavy-tailed estimates does not.
    Coordinates no noise reaches (weight decay, a penalty's part) must equal the gradient. Returns the
    largest per-param mean; `what` and `text` name the model in a failure. `mode`: lr_grad's antithetic,
    layerwise and baseline options (default: its own)."""
    trainable = list(graph.params) if trainable is None else trainable
    reached = [p for p in trainable if graph.grads.get(p) is not None]
    missing = [p for p in reached if graph.lr_grads.get(p) is None]
    assert not missing, f"{what}: no estimate for {missing}\n{text}"
    sizes = [params[p].size for p in reached]
    limits = np.repeat([2 + 6 * np.sqrt(2 / n) for n in sizes], sizes)
    runs = []
    for count in (seeds, 4 * seeds, 16 * seeds):
        runs += [interpret_lr(graph, params, inputs, samples, sigma, seed, **(mode or {}))
                 for seed in range(len(runs), count)]
        true = runs[0][1]
        assert true.size == sum(sizes)   # interpret_lr's coordinates: the reached params', in that order
        estimates = np.array([est for est, _ in runs])
        mean, se = estimates.mean(axis=0), estimates.std(axis=0, ddof=1) / np.sqrt(count)
        off, scale = np.abs(mean - true), 1e-9 * (1.0 + np.abs(true))
        # no noise reaches it (weight decay alone, a table row no one reads): the same bits in every estimate
        # (an estimated part of 1e-9 is still noise: seed 516's carry of small batch-normed values)
        exact = se < 1e-3 * scale
        assert np.all(off[exact] < scale[exact]), f"{what}: an exact part that is not the gradient"
        # the estimate is of the noised objective's gradient, O(sigma^2) away: seen where the gradient is ~0
        off = np.maximum(off - 10 * sigma ** 2 * (1.0 + np.abs(true).max()), 0.0)
        z2 = np.where(exact, 0.0, off / np.where(exact, 1.0, se)) ** 2
        per_param = np.array([z.mean() for z in np.split(z2, np.cumsum(sizes)[:-1])])
        if np.all(per_param < limits[np.cumsum(sizes) - 1]):
            return float(per_param.max())
    worst = int(np.argmax(per_param / limits[np.cumsum(sizes) - 1]))
    raise AssertionError(f"{what}: mean squared z-score {per_param[worst]:.3g} over the "
                         f"{sizes[worst]} coordinates of {reached[worst]} with {count} seeds\n{text}")


def check_lr_compiled(case, out):
    """The module gc.compile writes computes the interpreter's estimate: the same noise from the same seed
    (pairs with the baseline, and plain layer-wise draws)."""
    graph = build_training_graph(case.model, "float64", order=1)
    mod = gc.compile(case.model, out=out, dtype="float64", order=1, warm_cache=False)
    for mode in (dict(), dict(antithetic=False, layerwise=True)):
        _, grads = mod.lr_grad(case.params, samples=4, sigma=1e-2, seed=7, **case.inputs, **mode)
        want, _ = interpret_lr(graph, case.params, case.inputs, 4, 1e-2, 7, **mode)
        got = np.concatenate([grads[p].ravel() for p in case.params if graph.lr_grads.get(p) is not None])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12,
                                   err_msg=f"lrfuzz seed {case.seeds}, {mode}\n{case.text()}")
