"""Graph -> the source of one generated module.

Layout of the module: contract constants; scalar helpers; kernels; one compiled function per
entry point that runs its kernels in schedule order (so a call crosses from Python into
machine code once); the Python entry points, which check their arguments and call it; the
Trainer, which gets the gradients in one flat buffer and updates every param in one loop
(gradc/runtime/optim.py). With --order 2, hvp and hessian share one compiled block function.
"""
import textwrap

import numpy as np
import sympy as sp

from gradc.ops import get_op
from gradc.ops.elementwise import expr_of
from gradc.passes.stage_split import stage_index

from .cpu import Kernels
from .sympy_print import HELPERS

INLINE_CONST_LIMIT = 256   # larger constant arrays go to NAME.data.npz beside the module


def _shape_src(shape, dims):
    parts = [dims[d] if isinstance(d, str) else str(d) for d in shape]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _pattern(operand_shape, out_shape):
    lead = len(out_shape) - len(operand_shape)
    return tuple(-1 if (d == 1 and out_shape[lead + j] != 1) else lead + j for j, d in enumerate(operand_shape))


class EntryWriter:
    """Writes the compiled function of one entry point."""

    def __init__(self, graph, kernels, names):
        self.graph = graph
        self.kernels = kernels
        self.names = names           # node -> variable name for leaves
        self.leaf_rank = {}          # leaf -> position in the argument list
        self.scalar_roots = set()    # roots returned as plain numbers
        self.flat = {}               # root -> (offset, size) in the flat `grads` buffer it is written to
        self.placed = set()          # flat roots whose kernel wrote straight into the buffer

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

    def write(self, fname, plan, doc, flat_roots=None, received=()):
        """The compiled function, running `plan`'s steps; `flat_roots` are returned together as one
        flat `grads` buffer; intermediates are views of `arena` at the plan's offsets `offs`.
        `received`: values computed elsewhere (another stage) that come in as arguments r<id>."""
        g = self.graph
        layout, _ = self._layout(flat_roots or ())
        roots = plan["roots"]
        order = plan["steps"]
        self._start_plan(plan)
        leaves, consts = self._arguments(order, exclude=(), received=received)
        args = [self.names[n] for n in leaves] + [self.names[n] for n in received] + [f"c{n}" for n in consts]
        args += (["grads"] if flat_roots is not None else []) + ["arena", "offs"]
        dims = self._dims(order, leaves)
        body = [f"{dims[d]} = {src}" for d, src in self._dim_sources(order, list(leaves) + list(received)).items()]
        for step, n in enumerate(order):
            if g.op(n) in ("param", "input", "const"):
                continue
            body += self.statement(n, dims, step)
        body += self._fill_flat(layout)
        returned, seen = [], set()
        if flat_roots is not None:
            roots = [r for r in roots if r not in {f for f, _ in flat_roots}]
        for r in roots:
            v = self.var(r)
            if g.shape(r) == ():
                # the objective comes back as a number; other scalars as 1-element arrays
                returned.append(v if r in self.scalar_roots else f"np.full(1, {v}, FLOAT)")
            elif g.op(r) in ("reshape", "param", "input", "const") or r in seen:
                returned.append(f"{v}.copy()")   # never hand out a view of another value
            else:
                returned.append(v)
            seen.add(r)
        body.append(f"return {', '.join(returned)}{',' if len(returned) == 1 else ''}" if returned else "return ()")
        lines = ["@kernel", f"def {fname}({', '.join(args)}):", f'    """{doc}"""']
        lines += ["    " + b for b in body]
        return "\n".join(lines), leaves, consts

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
        consts = [n for n in order if g.op(n) == "const" and np.ndim(g.attrs(n)["value"]) > 0]
        return leaves, consts

    def _fill_flat(self, layout):
        """Copies into the flat buffer for roots no kernel wrote there; zeros where a root is zero."""
        lines = []
        for r, start, size in layout:
            if r is None:
                lines.append(f"grads[{start}:{start + size}] = 0.0")
            elif not (r in self.placed and self.flat[r][0] == start):
                v = self.var(r)
                lines.append(f"grads[{start}] = {v}" if self.graph.shape(r) == () else
                             f"grads[{start}:{start + size}] = {v}.reshape({size})")
        return lines

    def write_hvp_block(self, fname, plan, flat_roots, tangents, doc):
        """H V[r] into OUT[r] for every row r of V: the forward and backward once, then per row only
        the nodes that depend on the tangents (v_* are views of V[r], laid out as GRAD_SLICES)."""
        g = self.graph
        layout, _ = self._layout(flat_roots)
        order, loop_from = plan["steps"], plan["loop_from"]
        self._start_plan(plan)
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
        args = [self.names[n] for n in leaves] + [f"c{n}" for n in consts] + ["V", "OUT", "arena", "offs"]
        lines = ["@kernel", f"def {fname}({', '.join(args)}):", f'    """{doc}"""'] + ["    " + b for b in body]
        return "\n".join(lines), leaves, consts

    def _start_plan(self, plan):
        """Which step creates which arena buffer (the k-th tensor of the plan reads offs[k])."""
        self.slot_of_step = {t["start"]: k for k, t in enumerate(plan["tensors"])}

    def new_array(self, n, dims, step):
        """Where node n's kernel writes: its slot in `grads`, its arena buffer, or (a returned value) a new array."""
        shape = self.graph.shape(n)
        if n in self.flat and shape != ():
            self.placed.add(n)
            start, size = self.flat[n]
            return f"grads[{start}:{start + size}].reshape({_shape_src(shape, dims)})"
        k = self.slot_of_step.get(step)
        if k is not None:
            count = " * ".join(dims[d] if isinstance(d, str) else str(d) for d in shape if d != 1) or "1"
            if all(isinstance(d, int) for d in shape):
                count = str(int(np.prod(shape)))
            view = f"arena[offs[{k}]:offs[{k}] + {count}]"
            return view if len(shape) == 1 else f"{view}.reshape({_shape_src(shape, dims)})"
        return f"np.empty({_shape_src(shape, dims)}, FLOAT)"

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

    def statement(self, n, dims, step):
        g = self.graph
        node = g.node(n)
        op, ins, attrs, shape = node["op"], node["inputs"], node["attrs"], node["shape"]
        kind = get_op(op).kind
        v, a = f"t{n}", [self.var(u) for u in ins]
        note = f"  # {op} {node['src']}"
        alloc = f"{v} = {self.new_array(n, dims, step)}"
        fresh = step not in self.slot_of_step and n not in self.flat   # a returned value: numpy allocates it
        if kind == "elementwise":
            expr = expr_of(g, n)
            if shape == ():
                block = self.kernels.scalar_expression(expr, a, v)
                return block[:-1] + [block[-1] + note]
            patterns = [None if g.shape(u) == () else _pattern(g.shape(u), shape) for u in ins]
            k = self.kernels.elementwise(expr, patterns, len(shape), _hint(g, n))
            return [alloc, f"{k}({', '.join(a + [v])}){note}"]
        if op == "matmul":
            ta = ".T" if attrs.get("transpose_a") else ""
            tb = ".T" if attrs.get("transpose_b") else ""
            if fresh or shape == ():
                return [f"{v} = np.dot({a[0]}{ta}, {a[1]}{tb}){note}"]
            return [alloc, f"np.dot({a[0]}{ta}, {a[1]}{tb}, {v}){note}"]
        if op == "transpose":
            return [alloc, f"{v}[:] = np.transpose({a[0]}, {tuple(attrs['axes'])}){note}"]
        if op == "transfer":   # devices are regions of one host arena: the copy is the transfer
            note = f"  # transfer {attrs['source']} -> {attrs['target']}, {node['src']}"
            return [f"{v} = {a[0]}{note}"] if shape == () else [alloc, f"{v}[:] = {a[0]}{note}"]
        if op == "reshape":
            if g.shape(ins[0]) == ():
                return [alloc, f"{v}[:] = {a[0]}{note}"]
            if shape == ():
                return [f"{v} = {a[0]}.reshape(-1)[0]{note}"]
            return [f"{v} = {a[0]}.reshape({_shape_src(shape, dims)}){note}"]
        if op in ("sum", "mean", "max"):
            k = self.kernels.reduction(op, len(g.shape(ins[0])), tuple(attrs["axes"]), attrs.get("keepdims", False))
            if shape == () :
                return [f"{v} = {k}({a[0]}){note}"]
            return [alloc, f"{k}({a[0]}, {v}){note}"]
        if op == "argmax_mask":
            k = self.kernels.argmax_mask(len(shape), tuple(attrs["axes"]))
            return [alloc, f"{k}({a[0]}, {v}){note}"]
        if op == "count":
            factors = [dims[d] if isinstance(d, str) else str(d) for d in attrs["dims"]]
            return [f"{v} = float({' * '.join(factors) or '1'}){note}"]
        if op in ("softmax", "log_softmax"):
            k = self.kernels.softmax(op, len(shape), attrs["axis"])
            return [alloc, f"{k}({a[0]}, {v}){note}"]
        if op == "pick":
            return [alloc, f"{self.kernels.pick()}({a[0]}, {a[1]}, {v}){note}"]
        if op == "pick_grad":
            if g.shape(ins[0]) == ():
                raise AssertionError("pick_grad of a scalar adjoint")
            return [alloc, f"{self.kernels.pick_grad()}({a[0]}, {a[1]}, {v}){note}"]
        raise NotImplementedError(f"cpu codegen has no rule for op {op!r}")


def _hint(graph, n):
    """A short name for an elementwise kernel: the functions it applies, or the op."""
    if graph.op(n) != "fused":
        return graph.op(n)
    funcs = sorted({type(f).__name__.lower() for f in graph.attrs(n)["expr"].atoms(sp.Function)})
    return "_".join(funcs[:3]) or "arith"


# ---- the whole module ------------------------------------------------------------------------
HEADER = '''"""{name}: training code generated by gradc {version} from {source}.

Do not edit: change the model and run `gradc compile` again.

    params = init_params(seed=0)
    loss, grads = loss_and_grad(params, {example})
    trainer = Trainer(params, optimizer="sgd", lr=0.1, momentum=0.9); trainer.step({example})

Kernels are Numba functions compiled once and cached beside this file; each entry point is one
compiled function that runs its kernels in order. Float values are {dtype}.
"""
import math

import numpy as np
from numba import njit

from gradc.runtime import Signature, TrainerBase, init_from, load_data
from gradc.runtime.arena import Arena
from gradc.runtime.hessian import hessian_buffer, in_blocks, second_order_missing, symmetrize
from gradc.runtime.pipeline import Pipeline

# float errors give inf/nan as in numpy, never raise; nogil lets Hessian blocks run on every core
kernel = njit(cache=True, error_model="numpy", nogil=True)
FLOAT = np.{dtype}
'''


def _with_doc(source, doc):
    """Put a one-line docstring under the def line."""
    head, _, rest = source.partition("):\n")
    doc = doc.replace("\\", "\\\\").replace('"', "'")
    return f'{head}):\n    """{doc}"""\n{rest}'


def _literal_array(value):
    return f"np.array({np.asarray(value).tolist()!r}, dtype=FLOAT)"


def generate(graph, plans, info):
    """Source of the module, the arrays for NAME.data.npz, and facts for the dumps and `inspect`.

    plans: fname -> memory plan of that entry point (passes/memory.py), whose steps the entry runs.
    info: name, source, dtype, version, fingerprint, param_info, memory_plan (the summary).
    """
    g = graph
    kernels = Kernels(fast_tanh=info["dtype"] == "float32")
    names = {n: f"p_{p}" for p, n in g.params.items()} | {n: f"in_{i}" for i, n in g.inputs.items()}
    names |= {n: f"v_{p}" for p, n in g.tangents.items()}
    writer = EntryWriter(g, kernels, names)
    leaves_in_order = list(g.params.values()) + list(g.inputs.values()) + list(g.tangents.values())
    writer.leaf_rank = {n: i for i, n in enumerate(leaves_in_order)}
    leaf_name = {n: p for p, n in g.params.items()} | {n: i for i, n in g.inputs.items()}
    leaf_name |= {n: p for p, n in g.tangents.items()}
    param_info = info["param_info"]
    order = info.get("order", 1)
    trainable = [p for p in g.params if param_info[p]["trainable"]]
    input_grads = [i for i, v in g.input_grads.items() if v is not None]
    outputs = list(g.outputs)

    # every trainable param has a slot in the flat gradient (and HVP) buffer; unreached ones hold zeros
    grad_slices, offset = {}, 0
    for p in trainable:
        size = int(np.prod(g.shape(g.params[p])))
        grad_slices[p] = (offset, offset + size)
        offset += size
    writer.tangent_slices = {p: (a, b - a) for p, (a, b) in grad_slices.items()}
    shapes = {p: g.shape(g.params[p]) for p in trainable}

    entries = {}   # fname -> (roots, source, leaves, consts)

    def entry(fname, roots, doc, scalar_roots=(), flat_roots=None):
        writer.scalar_roots = set(scalar_roots)
        if plans[fname]["roots"] != [r for r in roots if r is not None]:
            raise AssertionError(f"{fname}: the memory plan was made for other roots")
        source, leaves, consts = writer.write(fname, plans[fname], doc, flat_roots)
        entries[fname] = (roots, source, leaves, consts)

    if outputs:
        entry("_forward", [g.outputs[o] for o in outputs], "The declared outputs.")
    entry("_forward_loss", [g.outputs[o] for o in outputs] + [g.objective],
          "The declared outputs and the objective.", [g.objective])
    entry("_loss_and_grad", [g.objective] + [g.grads[p] for p in trainable],
          "The objective; the gradients of the trainable params go into `grads` (laid out as GRAD_SLICES).",
          [g.objective], [(g.grads[p], shapes[p]) for p in trainable])
    if input_grads:
        entry("_input_grads", [g.input_grads[i] for i in input_grads], "Gradients of the objective for the float inputs.")
    if order == 2:
        source, leaves, consts = writer.write_hvp_block(
            "_hvp_block", plans["_hvp_block"], [(g.hvps[p], shapes[p]) for p in trainable], g.tangents,
            "Hessian-vector products: OUT[r] = H V[r] for each row of V (rows laid out as GRAD_SLICES).")
        entries["_hvp_block"] = ([g.hvps[p] for p in trainable], source, leaves, consts)

    pipeline = info.get("pipeline")
    stage_specs = {}   # (stage, kind) -> (fname, argument spec, roots)
    for f in (pipeline or {}).get("functions", ()):
        for r in f["received"]:
            writer.names[r] = f"r{r}"
        writer.scalar_roots = {f["objective"]} if f["objective"] is not None else set()
        what = "forward" if f["kind"] == "F" else "backward"
        doc = (f"Stage {f['stage']}'s {what} of one microbatch: returns " +
               ", ".join(f"%{r}" for r in f["roots"]) + " (the objective, values other stages read, "
               "the gradients here, and what this stage's backward reads).")
        source, leaves, consts = writer.write(f["fname"], plans[f["fname"]], doc, None, f["received"])
        for r in f["received"]:
            del writer.names[r]
        entries[f["fname"]] = (f["roots"], source, leaves, consts)
        spec = [("p", leaf_name[n]) if g.op(n) == "param" else ("a", leaf_name[n]) for n in leaves]
        for r in f["received"]:
            u = g.operands(r)[0] if g.op(r) == "transfer" else None
            spec.append(("p", leaf_name[u]) if u is not None and g.op(u) == "param" else ("v", r))
        spec += [("c", f"c{n}") for n in consts]
        stage_specs[(f["stage"], f["kind"])] = (f["fname"], tuple(spec), tuple(f["roots"]))

    data = {}
    for fname, (_, _, _, consts) in entries.items():
        for n in consts:
            data[f"c{n}"] = np.asarray(g.attrs(n)["value"])
    inits = {}
    for p in g.params:
        init = param_info[p]["init"]
        if isinstance(init, np.ndarray):
            data[f"init_{p}"] = init
            inits[p] = f"data:init_{p}"
        else:
            inits[p] = init
    inline = {k: v for k, v in data.items() if v.size <= INLINE_CONST_LIMIT}
    stored = {k: v for k, v in data.items() if v.size > INLINE_CONST_LIMIT}

    tangent_nodes = set(g.tangents.values())

    def call(fname):
        roots, _, leaves, consts = entries[fname]
        args = [f'{"t" if n in tangent_nodes else "p" if g.op(n) == "param" else "a"}["{leaf_name[n]}"]'
                for n in leaves]
        return args + [f'DATA["c{n}"]' for n in consts]

    def arena(fname):
        return f'*_ARENA.get("{fname}", a)'

    def inputs_of(fname):
        return tuple(leaf_name[n] for n in entries[fname][2] if g.op(n) == "input" and n not in tangent_nodes)

    def zero_or(value_src, shape):
        return f"{value_src}.reshape(())" if shape == () else value_src

    out = [HEADER.format(name=info["name"], version=info["version"], source=info["source"], dtype=info["dtype"],
                         example=", ".join(f"{i}={i.upper()}" for i in g.inputs))]
    out.append(f'MODEL_NAME = {info["name"]!r}')
    out.append(f'GRADC_VERSION = {info["version"]!r}')
    out.append('TARGET = "cpu"')
    out.append(f'DTYPE = {info["dtype"]!r}')
    out.append(f"PARAM_ORDER = {tuple(g.params)!r}")
    out.append(f"PARAM_SHAPES = {{{', '.join(f'{p!r}: {tuple(g.shape(n))!r}' for p, n in g.params.items())}}}")
    out.append(f"TRAINABLE = {tuple(trainable)!r}")
    out.append(f"ORDER = {order}   # 2: hvp and hessian are built")
    out.append(f"GRAD_SLICES = {grad_slices!r}   # where each gradient lies in the flat buffer _loss_and_grad fills")
    out.append(f"GRAD_SIZE = {offset}")
    out.append("INPUTS = {" + ", ".join(f"{i!r}: ({tuple(g.shape(n))!r}, {g.dtype(n)!r})" for i, n in g.inputs.items()) + "}")
    out.append(f"OUTPUTS = {tuple(outputs)!r}")
    out.append(f"MEMORY_PLAN = {info['memory_plan']!r}")
    out.append(f"PARTITION = {info.get('partition')!r}")
    out.append(f'FINGERPRINT = {info["fingerprint"]!r}')
    out.append("")
    out.append(f"DATA = load_data(__file__, {sorted(stored)!r})")
    for k, v in inline.items():
        out.append(f'DATA["{k}"] = {_literal_array(v)}.reshape({v.shape!r})')
    out.append(f"_INITS = {inits!r}")
    out.append(f"_LABELS = {info['labels']!r}   # int inputs used as class labels -> number of classes")
    out.append("_SIGNATURE = Signature(MODEL_NAME, PARAM_SHAPES, INPUTS, FLOAT, _LABELS)")
    several = len({t["device"] for plan in plans.values() for t in plan["tensors"]}) > 1
    out.append("# the arena buffers of each compiled entry point, in the order of its `offs`: (shape, first step, last step"
               + (", device)" if several else ")"))
    out.append("_ARENA = Arena(FLOAT, {")
    for fname, plan in plans.items():
        rows = [f"({tuple(g.shape(t['node']))!r}, {t['start']}, {t['end']}" + (f", {t['device']!r})" if several else ")")
                for t in plan["tensors"]]
        out.append(f'    "{fname}": (' + "".join(f"\n        {r}," for r in rows) + ("\n    )," if rows else "),"))
    dim_sources = {}
    for i, n in g.inputs.items():
        for axis, d in enumerate(g.shape(n)):
            if isinstance(d, str):
                dim_sources.setdefault(d, []).append((i, axis))
    out.append(f"}}, dim_sources={dim_sources!r})")
    out.append(f"_LOSS_INPUTS = {inputs_of('_forward_loss')!r}")
    out.append(f"_OUTPUT_INPUTS = {inputs_of('_forward') if outputs else ()!r}")
    if order == 2:
        out.append(f"_HVP_INPUTS = {inputs_of('_hvp_block')!r}")

    helper_src = [f"@kernel\n{HELPERS[h]}" for h in sorted(kernels.helpers)]
    kernel_src = [_with_doc(f"@kernel\n{src}", doc) for name, src, doc in kernels.sources]
    body = [source for _, source, _, _ in entries.values()]

    api = []
    api.append(textwrap.dedent('''\
        def init_params(seed=0):
            """Fresh parameters (dict name -> array), drawn in PARAM_ORDER from numpy's default_rng(seed)."""
            return init_from(_INITS, PARAM_SHAPES, FLOAT, seed, DATA)
        '''))
    fwd_out = ", ".join(f"o_{o}" for o in outputs)
    fwd_dict = ", ".join(f'"{o}": {zero_or("o_" + o, g.shape(g.outputs[o]))}' for o in outputs)
    lines = ["def forward(params, /, **inputs):",
             '    """The outputs (dict); with every input the objective needs, also "loss": the objective."""',
             "    p = _SIGNATURE.params(params)",
             "    if _SIGNATURE.wants_loss(inputs, _LOSS_INPUTS, _OUTPUT_INPUTS):",
             '        a = _SIGNATURE.inputs(inputs, _LOSS_INPUTS + _OUTPUT_INPUTS, "forward")',
             f"        {fwd_out + ', ' if outputs else ''}loss{'' if outputs else ','} = _forward_loss({', '.join(call('_forward_loss') + [arena('_forward_loss')])})",
             f"        return {{{fwd_dict + ', ' if outputs else ''}\"loss\": float(loss)}}"]
    if outputs:
        lines += ['    a = _SIGNATURE.inputs(inputs, _OUTPUT_INPUTS, "forward")',
                  f"    {fwd_out}{',' if len(outputs) == 1 else ''} = _forward({', '.join(call('_forward') + [arena('_forward')])})",
                  f"    return {{{fwd_dict}}}"]
    else:
        lines += ['    _SIGNATURE.inputs(inputs, (), "forward")', "    return {}"]
    api.append("\n".join(lines) + "\n")

    def views(buffer):
        """Source of a dict of one view per trainable param into a flat buffer laid out as GRAD_SLICES."""
        return ",\n        ".join(f'"{p}": {buffer}[{a}:{b}].reshape({shapes[p]!r})' for p, (a, b) in grad_slices.items())

    gdict = views("grads")
    run_loss_and_grad = f"(loss,) = _loss_and_grad({', '.join(call('_loss_and_grad') + ['grads', arena('_loss_and_grad')])})"
    if pipeline:
        run_loss_and_grad = "loss = _PIPELINE.loss_and_grad(p, a, grads)"
        functions = ",\n    ".join(f"({k}, {kind!r}): ({fname}, {fname!r}, {spec!r}, {roots!r})"
                                    for (k, kind), (fname, spec, roots) in sorted(stage_specs.items()))
        grad_nodes = {g.grads[p]: p for p in trainable if g.grads.get(p) is not None}
        api.append("\n".join([
            f"# loss_and_grad runs as {pipeline['stages']} stage(s) x (forward, backward) over {pipeline['microbatches']} "
            f"microbatch(es), {pipeline['schedule']} schedule",
            "_PIPELINE = Pipeline({",
            f"    {functions},",
            "}, transfers=" + repr(tuple(pipeline["transfers"])) + ",",
            f"    objective={g.objective}, grad_nodes={grad_nodes!r}, grad_slices=GRAD_SLICES,",
            f"    stages={pipeline['stages']}, schedule={pipeline['schedule']!r}, microbatches={pipeline['microbatches']},",
            f"    reduction={pipeline['reduction']!r}, batch_inputs={pipeline['batch_inputs']!r},",
            f"    weight_decay={pipeline['weight_decay']!r}, decayed={pipeline['decayed']!r}, arena=_ARENA, data=DATA,",
            f"    param_names={ {n: p for p, n in g.params.items()}!r}, objective_stage={stage_index(g, g.objective)},",
            f"    grad_stages={ {p: stage_index(g, n) for n, p in grad_nodes.items()}!r})"])
            + "\n")
    api.append("\n".join([
        "def loss_and_grad(params, /, **inputs):",
        '    """The objective (float) and its gradients for the trainable params (dict of views of one buffer)."""',
        "    p = _SIGNATURE.params(params)",
        '    a = _SIGNATURE.inputs(inputs, _LOSS_INPUTS, "loss_and_grad")',
        "    grads = np.empty(GRAD_SIZE, FLOAT)",
        f"    {run_loss_and_grad}",
        (f"    return float(loss), _PIPELINE.owned({{\n        {gdict},\n    }})" if pipeline else
         f"    return float(loss), {{\n        {gdict},\n    }}") if gdict else "    return float(loss), {}"]) + "\n")

    float_inputs = [i for i, n in g.inputs.items() if g.dtype(n).startswith("float")]
    idict = ", ".join([f'"{i}": {zero_or("gi_" + i, g.shape(g.inputs[i]))}' if i in input_grads
                       else f'"{i}": np.zeros_like(a["{i}"])' for i in float_inputs])
    lines = ["def input_grads(params, /, **inputs):",
             '    """Gradients of the objective for the float inputs (dict)."""',
             "    p = _SIGNATURE.params(params)",
             '    a = _SIGNATURE.inputs(inputs, _LOSS_INPUTS, "input_grads")']
    if input_grads:
        lines.append(f"    {', '.join('gi_' + i for i in input_grads)}{',' if len(input_grads) == 1 else ''} = "
                     f"_input_grads({', '.join(call('_input_grads') + [arena('_input_grads')])})")
    lines.append(f"    return {{{idict}}}")
    api.append("\n".join(lines) + "\n")

    if order == 2:
        hdict = views("out[0]")
        api.append("\n".join([
            "def hvp(params, v, /, **inputs):",
            '    """Hessian-vector product of the objective: H v, with v and the result dicts shaped like the trainable params."""',
            "    p = _SIGNATURE.params(params)",
            "    t = _SIGNATURE.tangents(v, TRAINABLE)",
            '    a = _SIGNATURE.inputs(inputs, _HVP_INPUTS, "hvp")',
            "    V = np.empty((1, GRAD_SIZE), FLOAT)",
            "    for name, (start, stop) in GRAD_SLICES.items():",
            "        V[0, start:stop] = t[name].reshape(-1)",
            "    out = np.empty((1, GRAD_SIZE), FLOAT)",
            f"    _hvp_block({', '.join(call('_hvp_block') + ['V', 'out', arena('_hvp_block')])})",
            f"    return {{\n        {hdict},\n    }}" if hdict else "    return {}"]) + "\n")
        api.append("\n".join([
            "def hessian_rows(params, start, stop, /, **inputs):",
            '    """Rows start..stop of the Hessian as a (stop - start, GRAD_SIZE) array: blocks of basis vectors,',
            '    each block one compiled call, the blocks spread over the cores."""',
            "    if not 0 <= start <= stop <= GRAD_SIZE:",
            '        raise ValueError(f"{MODEL_NAME}.hessian_rows: rows {start}..{stop} are outside 0..{GRAD_SIZE}")',
            "    p = _SIGNATURE.params(params)",
            '    a = _SIGNATURE.inputs(inputs, _HVP_INPUTS, "hessian")',
            "    H = hessian_buffer(MODEL_NAME, stop - start, GRAD_SIZE, FLOAT)",
            f"    in_blocks(lambda V, rows: _hvp_block({', '.join(call('_hvp_block') + ['V', 'rows', arena('_hvp_block')])}), H, start)",
            "    return H",
            "",
            "",
            "def hessian(params, /, **inputs):",
            '    """The symmetric (P, P) Hessian of the objective; rows and columns are the trainable params in',
            '    PARAM_ORDER, each flattened in C order (GRAD_SLICES). Refuses when P*P does not fit in memory."""',
            "    H = hessian_rows(params, 0, GRAD_SIZE, **inputs)",
            "    symmetrize(H)",
            "    return H"]) + "\n")
    else:
        api.append("\n".join([
            "def hvp(params, v, /, **inputs):",
            '    """Not in this build: it was compiled with --order 1."""',
            "    second_order_missing(MODEL_NAME)",
            "",
            "",
            "def hessian(params, /, **inputs):",
            '    """Not in this build: it was compiled with --order 1."""',
            "    second_order_missing(MODEL_NAME)"]) + "\n")

    api.append("\n".join([
        "def memory_stats():",
        '    """Bytes the arena holds between calls (one buffer per thread that ran an entry point), per device."""',
        '    return {"arena_bytes": _ARENA.held_by_device()}']) + "\n")

    api.append("\n".join([
        "class Trainer(TrainerBase):",
        "    __doc__ = TrainerBase.__doc__",
        "    signature = _SIGNATURE",
        "    fingerprint = FINGERPRINT",
        "    model_name = MODEL_NAME",
        "    param_order = PARAM_ORDER",
        "    loss_inputs = _LOSS_INPUTS",
        "",
        "    grad_slices = GRAD_SLICES",
        f"    pipeline = {'_PIPELINE' if pipeline else 'None'}",
        "",
        "    def _gradients(self, p, a, grads):",
        f"        {run_loss_and_grad}",
        "        return loss"]) + "\n")

    sections = ["\n".join(out)] + (["# ---- scalar helpers " + "-" * 70, *helper_src] if helper_src else []) + [
                "# ---- kernels " + "-" * 77, *kernel_src,
                "# ---- compiled entry points " + "-" * 63, *body,
                "# ---- Python entry points " + "-" * 65, *api]
    source = "\n\n\n".join(s.rstrip("\n") for s in sections) + "\n"
    meta = {"kernels": [{"name": name, "computes": doc} for name, _, doc in kernels.sources],
            "entries": {f: {"roots": [n for n in r if n is not None], "nodes": len(g.ancestors([n for n in r if n is not None]))}
                        for f, (r, _, _, _) in entries.items()}}
    return source, stored, meta
