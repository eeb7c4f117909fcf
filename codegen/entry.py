"""The function of one entry point on the CPU target: its kernels in plan order.

An entry point runs as plain Python that calls the compiled kernels, over views of the arena at
the memory plan's offsets (made once per shape and reused: gradc/runtime/arena.py). Numba links
and optimises again every kernel a compiled function calls, so one compiled function per entry
made each build optimise the same kernels four to six times, and deep graphs took time growing
faster than their size (README digits MLP: a Numba warm-up of 3.5 s against 0.3 s as plain Python, with
the kernels in the cache); as plain Python nothing but the kernels is compiled, and a call costs
about a microsecond a kernel. The exception is hvp's block function, which loops over the rows
of V: a small graph's is one compiled function (compiled on first use, and kept in the kernel cache
like the kernels it calls), so a Hessian of many rows pays no Python per row. codegen/cuda_entry.py
writes the CUDA target's host function by overriding how values are stored and computed.
"""
import re

import numpy as np

from gradc.ops import get_op
from gradc.passes.part_runs import is_view
from gradc.runtime import conv_cores

from .statement import Statement, dtype_src, shape_src as _shape_src
from .work_sizes import WorkSizes


COMPILED_ENTRY_MAX_STEPS = 120   # a larger hvp block function runs as plain Python too


def _assigns(line):
    """Whether a line of source binds a name (`t5 = ...`)."""
    return re.match(r"\s*[A-Za-z_]\w*\s*=[^=]", line) is not None


class EntryWriter:
    """Writes the function of one entry point."""
    decorator = "@cached_kernel"     # a small hvp block function is one compiled Numba function, in the kernel cache
    tail_args = ("arena", "offs")    # what a compiled entry takes after its values
    compiled = True                  # whether the entry being written is compiled (set per entry)
    target = "cpu"                   # which lowering of each op record it writes
    run_steps = frozenset()          # the steps of the entry being written that are in a part run
    Statement = Statement

    def __init__(self, graph, kernels, names):
        self.graph = graph
        self.kernels = kernels
        self.names = names           # node -> variable name for leaves
        self.leaf_rank = {}          # leaf -> position in the argument list
        self.scalar_roots = set()    # roots returned as plain numbers
        self.flat = {}               # root -> (offset, size) in the flat `grads` buffer it is written to
        self.placed = set()          # flat roots whose kernel wrote straight into the buffer
        self.plain = set()           # entries written as plain Python (they take `buffers`, ready views)

    def var(self, n):
        g = self.graph
        if g.op(n) == "const":
            value = g.attrs(n)["value"]
            if np.ndim(value) == 0:
                return repr(float(value))
            return f"c{n}"
        if n in self.names:
            return self.names[n] if g.shape(n) != () else f"{self.names[n]}[0]"
        return f"t{n}"

    def write(self, fname, plan, doc, flat_roots=None, received=(), ready_names=None):
        """The entry's function (plain Python on the CPU), running `plan`'s steps; `flat_roots` are
        returned together as one flat `grads` buffer; intermediates are the arena's buffers, handed
        in ready-made as `buffers` (on CUDA, views of `arena` at the plan's offsets `offs`).
        `received`: values computed elsewhere (another stage) that come in as arguments r<id>.
        `ready_names` (one param name per flat root): the function also takes `ready` and calls
        ready(names) as soon as those params' gradients are final in `grads`, so a
        data-parallel Trainer can start reducing them while the rest of the backward runs (on CUDA:
        as soon as the kernels that write them are launched on `stream`, so ready orders its copy
        after them on that stream)."""
        g = self.graph
        layout, _ = self._layout(flat_roots or ())
        roots = plan["roots"]
        order = plan["steps"]
        self._start_plan(plan)
        self._set_compiled(fname, False)
        leaves, consts = self._arguments(order, exclude=(), received=received)
        args = [self.names[n] for n in leaves] + [self.names[n] for n in received] + [f"c{n}" for n in consts]
        args += (["grads"] if flat_roots is not None else []) + list(self.entry_tail())
        dims = self._dims(order, leaves)
        # (a value received from another stage may carry a dim no step here uses: a loss's mean of a (B,) value)
        body = [f"{dims[d]} = {src}" for d, src in self._dim_sources(order, list(leaves) + list(received)).items()
                if d in dims]
        final_at = {}   # node -> the layout rows (and param names) it makes final; None: final before any step
        if ready_names is not None:
            args.append("ready")
            computed = {n for n in order if g.op(n) not in ("param", "input", "const")}
            for (r, start, size), name in zip(layout, ready_names):
                final_at.setdefault(r if r in computed else None, []).append(((r, start, size), name))
            body += self._announce(final_at.pop(None, ()))
        runs = {r["first"]: r for r in plan.get("part_runs", ())} if self.target == "cpu" else {}
        self.run_steps = {t for r in runs.values() for t in range(r["first"], r["last"] + 1)}
        written = 0   # part runs so far: the k-th's function is images_k
        for step, n in enumerate(order):
            if step in runs:
                written += 1
                body += self._part_run(runs[step], written, dims, final_at)
            if g.op(n) in ("param", "input", "const") or step in self.run_steps:
                continue
            body += self.statement(n, dims, step)
            body += self._announce(final_at.get(n, ()))
        self.run_steps = frozenset()
        if ready_names is None:
            body += self._fill_flat(layout)
        returned, seen = [], set()
        if flat_roots is not None:
            roots = [r for r in roots if r not in {f for f, _ in flat_roots}]
        for r in roots:
            returned.append(self.returned(r, seen))
            seen.add(r)
        body.append(f"return {', '.join(returned)}{',' if len(returned) == 1 else ''}" if returned else "return ()")
        lines = self._def(fname, args, doc) + ["    " + b for b in body]
        return "\n".join(lines), leaves, consts

    def _part_run(self, run, k, dims, final_at):
        """A part run (passes/part_runs.py): its buffers and views, then a function of a part of the
        batch that calls its kernels, run over parts on every core at once (conv_cores.parts_on_cores);
        params whose gradients it sums are announced after the parts are added."""
        g, order = self.graph, self.plan_steps
        before, inside, announced = [], [], []
        for step in range(run["first"], run["last"] + 1):
            n = order[step]
            if g.op(n) in ("param", "input", "const"):
                continue
            s = self.Statement(self, n, dims, step)
            lines = get_op(g.op(n)).cpu(s)
            announced += final_at.get(n, [])   # a view's too: it may show a value the run sums
            if is_view(g, n):
                before += lines
                continue
            before += [line for line in lines if line in s.allocated]
            for line in lines:
                if line not in s.allocated:
                    if _assigns(line):
                        raise AssertionError(f"{g.describe(n)} is in a part run, but its lowering assigns a "
                                             f"variable the entry may read after the run: {line!r}")
                    inside.append(line)
        names = list(dict.fromkeys(self.var(u) for u in run["sliced"] + run["summed"]))
        batch = dims.get(run["dim"]) if isinstance(run["dim"], str) else None
        if batch and any(re.search(rf"\b{batch}\b", line) for line in inside):
            raise AssertionError(f"a kernel in a part run reads the batch size {batch}, which a part does not have: "
                                 f"{[line for line in inside if batch in line]}")
        fname = f"images_{k}"
        ops = [g.op(n) for n in run["nodes"]]
        sliced = ", ".join(self.var(u) for u in run["sliced"])
        summed = ", ".join(self.var(u) for u in run["summed"])
        return before + [
            f"def {fname}({', '.join(names)}):   # {ops[0]} .. {ops[-1]} ({len(ops)} kernels) on some of the images",
            *("    " + line for line in inside),
            f"parts_on_cores({fname}, ({sliced}{',' if len(run['sliced']) == 1 else ''}), "
            f"({summed}{',' if len(run['summed']) == 1 else ''}), image_work={run['image_work']}, "
            f"most={conv_cores.cores()})"] + self._announce(announced)

    def _set_compiled(self, fname, compiled):
        """Write `fname` as one compiled function or as plain Python (see the module docstring)."""
        self.compiled = compiled
        if not compiled:
            self.plain.add(fname)

    def entry_tail(self):
        """What the entry being written takes after its values: a plain one, its buffers as views."""
        return self.tail_args if self.compiled else ("buffers",)

    def _def(self, fname, args, doc):
        return ([self.decorator] if self.decorator and self.compiled else []) + [
            f"def {fname}({', '.join(args)}):", f'    """{doc}"""']

    def returned(self, r, seen):
        """How root r is handed back."""
        v = self.var(r)
        if self.graph.shape(r) == ():
            # the objective comes back as a number; other scalars as 1-element arrays
            return v if r in self.scalar_roots else f"np.full(1, {v}, FLOAT)"
        if get_op(self.graph.op(r)).view or self.graph.op(r) in ("param", "input", "const") or r in seen:
            return f"{v}.copy()"   # never hand out a view of another value
        return v

    def _layout(self, flat_roots):
        """Offsets of (root, shape) pairs in the flat buffer, one after another; resets placement."""
        self.flat, self.placed, offset, layout = {}, set(), 0, []
        for r, shape in flat_roots:
            size = int(np.prod(shape))
            layout.append((r, offset, size))
            if r is not None:
                self.flat.setdefault(r, (offset, size))
            offset += size
        return layout, offset

    def _arguments(self, order, exclude, received=()):
        """The leaves and constant arrays a compiled function takes, in argument order."""
        g = self.graph
        leaves = [n for n in order if g.op(n) in ("param", "input") and n not in exclude]
        # a dim the code needs but no argument carries (a value that depends on an input's shape
        # only): take the input that declares it as an argument too
        carried = {d for n in list(leaves) + list(received) for d in g.shape(n) if isinstance(d, str)}
        for d in sorted(set(self._dims(order, leaves)) - carried):
            leaves.append(next(n for n in g.inputs.values() if d in g.shape(n)))
            carried |= {x for x in g.shape(leaves[-1]) if isinstance(x, str)}
        leaves.sort(key=lambda n: self.leaf_rank[n])
        consts = [n for n in dict.fromkeys(order) if g.op(n) == "const" and self.const_argument(n, order)]
        return leaves, consts

    def const_argument(self, n, order):
        """Whether constant n comes in as an array argument (scalars are written into the code)."""
        return np.ndim(self.graph.attrs(n)["value"]) > 0

    def scalar_count(self):
        """Scalars the entry keeps in device memory (none here: they are locals of the compiled code)."""
        return 0

    def _fill_flat(self, layout):
        """Copies into the flat buffer for roots no kernel wrote there; zeros where a root is zero."""
        return [line for row in layout for line in self._fill_row(*row)]

    def _fill_row(self, r, start, size):
        if r is None:
            return [f"grads[{start}:{start + size}] = 0.0"]
        if r in self.placed and self.flat[r][0] == start:
            return []
        v = self.var(r)
        return [f"grads[{start}] = {v}" if self.graph.shape(r) == () else
                f"grads[{start}:{start + size}] = {v}.reshape({size})"]

    def _announce(self, rows):
        """A streamed entry's lines once `rows` of the flat buffer are final: fill them, call ready."""
        if not rows:
            return []
        lines = [line for row, _ in rows for line in self._fill_row(*row)]
        return lines + [f"ready({tuple(name for _, name in rows)!r})"]

    def write_hvp_block(self, fname, plan, flat_roots, tangents, doc):
        """H V[r] into OUT[r] for every row r of V: the forward and backward once, then per row only
        the nodes that depend on the tangents (v_* are views of V[r], laid out as GRAD_SLICES)."""
        g = self.graph
        layout, _ = self._layout(flat_roots)
        order, loop_from = plan["steps"], plan["loop_from"]
        self._start_plan(plan)
        self._set_compiled(fname, len(order) <= COMPILED_ENTRY_MAX_STEPS)
        tangent_nodes = set(tangents.values())
        leaves, consts = self._arguments(order, exclude=tangent_nodes)
        dims = self._dims(order, leaves)
        body = [f"{dims[d]} = {src}" for d, src in self._dim_sources(order, leaves).items()]
        for step, n in enumerate(order[:loop_from]):
            if g.op(n) not in ("param", "input", "const"):
                body += self.statement(n, dims, step)
        loop = ["tangent = V[row]", "grads = OUT[row]"]
        for p, v in tangents.items():
            start, size = self.tangent_slices[p]
            loop.append(f"{self.names[v]} = tangent[{start}:{start + size}]" +
                        (f".reshape({_shape_src(g.shape(v), dims)})" if g.shape(v) != () else ""))
        for step, n in enumerate(order[loop_from:], loop_from):
            if n not in tangent_nodes and g.op(n) not in ("param", "input", "const"):
                loop += self.statement(n, dims, step)
        loop += self._fill_flat(layout)
        body += ["for row in range(V.shape[0]):"] + ["    " + line for line in loop]
        args = [self.names[n] for n in leaves] + [f"c{n}" for n in consts] + ["V", "OUT", *self.entry_tail()]
        lines = self._def(fname, args, doc) + ["    " + b for b in body]
        return "\n".join(lines), leaves, consts

    def _start_plan(self, plan):
        """Which step creates which arena buffer (the k-th tensor of the plan reads offs[k]), and which
        steps write over their operand's buffer (passes/in_place.py)."""
        self.slot_of_step = {t.get("made", t["start"]): k for k, t in enumerate(plan["tensors"])}
        self.plan_steps = plan["steps"]
        self.over = {reader: operand for operand, reader in plan.get("in_place", ())}
        into = {operand: reader for operand, reader in plan.get("in_place", ())}
        self.last_reader = {}   # an operand's step -> the step of the last in-place reader of its chain
        for operand, reader in into.items():
            while reader in into:
                reader = into[reader]
            self.last_reader[operand] = reader

    def new_array(self, n, dims, step):
        """Where node n's kernel writes: its slot in `grads`, its arena buffer, or (a returned value) a new
        array; in place, its operand's buffer (and the operand writes where its last in-place reader's
        value goes: that reader's slot in `grads`, when it has one)."""
        shape = self.graph.shape(n)
        if step in self.over:
            return self.var(self.plan_steps[self.over[step]])
        last = self.plan_steps[self.last_reader[step]] if step in self.last_reader else n
        if last in self.flat and shape != ():
            self.placed.add(last)
            start, size = self.flat[last]
            return f"grads[{start}:{start + size}].reshape({_shape_src(shape, dims)})"
        k = self.slot_of_step.get(step)
        if k is not None:
            return self.arena_view(k, shape, dims)
        return self.fresh_array(_shape_src(shape, dims), dtype_src(self.graph.dtype(n)))

    def arena_view(self, k, shape, dims):
        """The k-th planned buffer: in a plain entry, its ready view; in a compiled one a call to
        gradc.runtime.views.view (slicing and reshaping inline for every buffer made deep models'
        functions slow to compile, about 1.6x)."""
        if not self.compiled:   # the planned buffer of the node that makes it: already this shape
            return f"buffers[{k}]"
        return f"view(arena, offs[{k}], {_shape_src(shape, dims)})"

    def fresh_array(self, shape_src, dtype="FLOAT"):
        return f"np.empty({shape_src}, {dtype})"

    def _dims(self, order, leaves):
        names = {}
        for n in order:
            shapes = [self.graph.shape(n)] + [self.graph.attrs(n).get(k, ()) for k in ("dims",)]
            for s in shapes:
                for d in s:
                    if isinstance(d, str):
                        names[d] = f"d_{d}"
            nc = self.graph.attrs(n).get("num_classes")
            if isinstance(nc, str):
                names[nc] = f"d_{nc}"
        return names

    def _dim_sources(self, order, leaves):
        sources = {}
        for n in leaves:
            for axis, d in enumerate(self.graph.shape(n)):
                if isinstance(d, str) and d not in sources:
                    sources[d] = f"{self.names[n]}.shape[{axis}]"
        missing = set(self._dims(order, leaves)) - set(sources)
        if missing:
            raise AssertionError(f"dims {missing} are not carried by any input of the entry point")
        return sources

    def body_kernel(self, body, skip, doc):
        """A sub-graph (a scan's step) as one kernel body(leaves..., outputs..., work), outputs in
        `skip` left unwritten; one per distinct body and skip per module. Returns (its name, the
        sizes of its work buffers as source, the body's dim variables)."""
        layouts = self.kernels.__dict__.setdefault("body_layouts", {})

        def make(name):
            writer = BodyWriter(body, self.kernels)
            source, dims = writer.write_body(name, skip)
            layouts[name] = (writer.sizes, dims)
            return source, doc

        name = self.kernels._get(("scan_body", repr(body), tuple(skip)), "scan_body", make)
        return (name,) + layouts[name]

    def body_inline(self, body, skip, optional=None):
        """A sub-graph (a scan's step) as lines a loop kernel runs in place of calling its body kernel:
        Numba compiles a kernel a loop calls on its own and then again inside the loop, so a step
        written in place compiles once (the LSTM of bench/compile_time.py: 1.8 s less of 11 s). The
        loop binds l0, l1, ... to the leaves and o0, o1, ... to the outputs it writes (those not in
        `skip`) before these lines; intermediates are views of its `work`. `optional`: {output: the
        flag that says whether this call of the loop wants it} (see BodyWriter.statements). Returns
        (the lines that read the body's dims off its leaves, the lines of the step, the sizes of its
        work buffers, the body's dim variables)."""
        writer = BodyWriter(body, self.kernels)
        dim_lines, lines, dims = writer.statements(skip, optional)
        return dim_lines, lines, writer.sizes, dims

    def statement(self, n, dims, step):
        """The lines computing node n: its record's lowering for this target (gradc/ops)."""
        record = get_op(self.graph.op(n))
        lower = getattr(record, self.target)
        if lower is None:
            raise NotImplementedError(f"{self.target} codegen: op {record.name!r} has no lowering on this target")
        return lower(self.Statement(self, n, dims, step))


class BodyWriter(EntryWriter):
    """Writes a scan body as one function body(l0, l1, ..., o0, o1, ..., work)."""
    decorator = None
    body_tail = ("work",)    # the arguments after the outputs

    def __init__(self, body, kernels):
        leaves, outputs = list(body.inputs.values()), list(body.outputs.values())
        super().__init__(body, kernels, {n: f"l{i}" for i, n in enumerate(leaves)})
        self.leaves, self.outputs = leaves, outputs
        self.leaf_rank = {n: i for i, n in enumerate(leaves)}
        self.sizes = WorkSizes()   # the work buffers laid out so far
        self.output_of = {}    # node -> the output argument it was written into
        self.skip = ()         # outputs left unwritten (the caller may hand any array for them)
        self.optional = {}     # output -> the flag saying whether the caller wants it (statements)
        self.guards = {}       # node -> the flags of the optional outputs that alone need it
        self.emitting = None   # the node whose statement is being written

    def var(self, n):
        if n in self.names and self.graph.shape(n) == ():
            return self.names[n]   # scalar leaves come in as numbers
        return super().var(n)

    def output_argument(self, n):
        """`o{k}` when n is output k of the body (and written there), else None."""
        for o, out in enumerate(self.outputs):
            if out == n and o not in self.output_of.values() and n not in self.output_of and o not in self.skip:
                if o in self.optional and self.guards.get(self.emitting) != {self.optional[o]}:
                    continue   # o{o} is bound only when its flag is set: a statement run on other flags copies n there
                self.output_of[n] = o
                return f"o{o}"
        return None

    def new_array(self, n, dims, step):
        shape = self.graph.shape(n)
        out = self.output_argument(n)
        if out is not None:
            return out
        if not self.graph.dtype(n).startswith("float"):   # the work array holds floats (storage.in_arena)
            return self.fresh_array(_shape_src(shape, dims), dtype_src(self.graph.dtype(n)))
        offset = self.sizes.source()
        self.sizes.add(shape, dims)
        return f"view(work, {offset}, {_shape_src(shape, dims)})"

    def write_body(self, fname, skip=()):
        """The body as a function; skip: outputs nobody reads at this call site (their statements are
        left out). Returns (its source, the body's dim variables)."""
        dim_lines, body, dims = self.statements(skip)
        args = [self.names[n] for n in self.leaves] + [f"o{o}" for o in range(len(self.outputs))] + list(self.body_tail)
        lines = [f"def {fname}({', '.join(args)}):"] + ["    " + b for b in dim_lines + body] + ["    return"]
        return "\n".join(lines), dims

    def statements(self, skip=(), optional=None):
        """(the lines reading the dims off the leaves l0, l1, ..., the lines computing the outputs not
        in `skip` into o0, o1, ..., the dim variables). `optional`: {output: a flag}: the lines that
        only such outputs need run under `if flag:` (`if f1 or f2:` for what two of them need), so that
        one loop kernel serves the entry points that want an output and those that do not."""
        g = self.graph
        self.skip, self.optional = tuple(skip), dict(optional or {})
        order = g.topo_order(g.ancestors([o for i, o in enumerate(self.outputs) if i not in skip]) | set(self.leaves))
        needed = g.ancestors([o for i, o in enumerate(self.outputs) if i not in skip and i not in self.optional])
        self.guards = {}
        for i, flag in self.optional.items():
            for n in g.ancestors([self.outputs[i]]) - needed - set(self.leaves):
                self.guards.setdefault(n, set()).add(flag)
        self.plan_steps = order
        self.slot_of_step = {t: None for t in range(len(order))}   # every value gets a buffer: none is fresh
        self.flat, self.placed = {}, set()
        self.compiled = True
        dims = self._dims(order, self.leaves)
        dim_lines = [f"{dims[d]} = {src}" for d, src in self._dim_sources(order, self.leaves).items()]
        body = [self.const_array(n) for n in order if g.op(n) == "const" and np.ndim(g.attrs(n)["value"]) > 0]
        for step, n in enumerate(order):
            if g.op(n) in ("param", "input", "const"):
                continue
            # (a nested scan's statement allocates its results, other nodes' values: they are written where
            # it runs, so output_argument asks this node's guards, not theirs)
            self.emitting = n
            body += _guarded(self.guards.get(n), self.statement(n, dims, step))
        for o, n in enumerate(self.outputs):
            if self.output_of.get(n) != o and o not in skip:
                body += _guarded({self.optional[o]} if o in self.optional else None, self.copy_into(f"o{o}", n))
        return dim_lines, body, dims

    def const_array(self, n):
        """The line making constant array n in the body (a body has no constant arguments: a user's
        constants are closed over, but the VJP of a scan nested in this step starts its accumulators
        from zeros): np.full when its values are all one value, else the values written in."""
        return f"c{n} = {array_source(self.graph.attrs(n)['value'], BODY_CONST_LIMIT)}"

    def copy_into(self, out, n):
        """Lines that copy value n into the output argument `out` (see gradc/runtime/copy_into.py)."""
        return [f"copy_into({out}, {self.var(n)})"]


def _guarded(flags, lines):
    """`lines` under `if flag1 or flag2 ...:`; as they are without flags."""
    if not flags or not lines:
        return lines
    return [f"if {' or '.join(sorted(flags))}:"] + ["    " + line for line in lines]


BODY_CONST_LIMIT = 256   # the most values a non-uniform constant array in a scan body may have (written in)


def array_source(value, most=None):
    """Source of a float array equal to `value`, on the module's FLOAT (inf and nan written as math's);
    NotImplementedError beyond `most` distinct values."""
    def number(v):
        return repr(float(v)) if np.isfinite(v) else "math.nan" if np.isnan(v) else ("-math.inf" if v < 0 else "math.inf")

    value = np.asarray(value, dtype=float)
    flat = value.ravel()
    bits = flat.view(np.uint64)   # equal bits: -0.0 is not 0.0 (1 / x tells them apart), and a nan is itself
    if flat.size and (bits == bits[0]).all():
        return f"np.full({value.shape!r}, {number(flat[0])}, FLOAT)"
    if most is not None and flat.size > most:
        raise NotImplementedError(f"codegen: a constant array of {flat.size} distinct values made inside a scan body")
    return f"np.array([{', '.join(number(v) for v in flat)}], FLOAT).reshape({value.shape!r})"
