"""The op registry: one record per op.

A record holds everything the compiler knows about an op: its shape and dtype rule, its VJP
rule (which builds nodes of registered ops, so a backward graph can be differentiated again),
its cost, its numpy evaluation (the interpreter's reference), for elementwise ops the sympy
expression that all of its derivatives are derived from, where the batch rows go through it
(`rows`), and its lowering for each target (`cpu`, `cuda`). Codegen and passes read these
fields; nothing else dispatches on an op's name, so a new op is one module and its tests.

Lowering: `cpu(s)` and `cuda(s)` take the statement being written for one node and return the
lines of the entry function that compute it. `s` (codegen/statement.py) offers:
  s.graph, s.n, s.attrs, s.shape, s.operands (node ids), s.args (their variable names),
  s.out (the node's variable), s.note (a trailing comment naming the op and the user's line),
  s.alloc() (the line that gives s.out its planned buffer; only a statement that writes one asks),
  s.written_over (the operand whose buffer an elementwise node writes its result over, or None),
  s.dim(d), s.shape_src(shape) (the source of a dim and of a shape at run time),
  s.kernel(key, name, make) (one kernel per distinct key per module; make(kname) returns
  (source, doc) on the CPU and (source, doc, grid) on CUDA, grid as codegen/cuda.py describes),
  s.call(kernel, args) (a call, or a CUDA launch), s.into_out(kernel) ([alloc, kernel(args..., out)]),
  s.kernels (the target's shared kernels: elementwise, GEMM, fill),
  s.body_kernel(body, skip, doc) (a sub-graph as one function of its leaves, outputs and a work
  arena, a scan's step: (name, work sizes, dims) on the CPU, plus its scalar slots on CUDA),
  s.body_inline(body, skip, optional) (the same step as lines a CPU loop kernel runs in place of the
  call: (dim lines, lines, work sizes, dims); the loop binds l0, l1, ... and o0, o1, ... first;
  the lines only the outputs in `optional` need run under their flags).
Kernel text helpers shared by the records are in gradc/ops/kernel_text.py.

Rows: `rows(graph, n, ins, fail)` says on which axis of n the batch rows lie, given where they
lie in each operand (`ins`: an axis, None for no batch dim, or ("reduced", "sum"|"mean") after
the loss's reduction over rows); it calls fail(why) when n mixes rows (passes/rows.py).

Parts: a plain CPU entry runs a chain of per-image kernels over parts of the batch at once, one part
per core (passes/part_runs.py). `parts="rows"`: given its batch operands and output cut to the same
images, the CPU kernel computes those images' rows, where the `rows` rule keeps them on axis 0 (a sum
that reduces them away writes their sum); `parts="sums"`: it writes the sum over the images it is
given (a weight gradient). `part_work(graph, n, dims)`: what one image costs it, in conv flops; a
run needs an op with one (a run of elementwise kernels alone is not worth a hand-off).

Batched: `batched(graph, n, operands, lifted, emit)` builds n's op over a leading axis of independent
copies, with emit(op, inputs, **attrs): the operands `lifted` have that axis in front, the others are the
same for every copy, and the result has it in front (gradc/ops/batched.py). lr_grad runs an op that mixes
the batch's rows so, once per perturbed copy (passes/lr_statistics.py); an op without it is refused there.

Simplify: `simplify(graph, n)` gives the node n equals by one of the op's identities (x + 0 -> x,
reshape to the same shape -> x), or n itself after rewriting it in place into a simpler form
(transpose(transpose(x)) -> one transpose), or None; passes/simplify.py applies it to every node.
"""
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Optional

import sympy as sp


@dataclass(frozen=True)
class Op:
    name: str
    kind: str                 # leaf | elementwise | matmul | layout | reduce | nn | region | project
    infer: Callable           # (attrs, shapes, dtypes) -> (shape, dtype); raises ShapeError
    evaluate: Callable        # (attrs, values, out_shape) -> ndarray (numpy reference)
    flops: Callable           # (attrs, in_shapes, out_shape) -> int or sympy expression
    vjp: Optional[Callable] = None    # (ctx, node, g) -> one adjoint node or None per operand
    arity: Optional[int] = None       # None: any number of operands
    expr: Optional[sp.Expr] = None    # elementwise: over the operand symbols X[0..arity-1]
    rows: Optional[Callable] = None   # (graph, n, ins, fail) -> the batch axis of n (see above)
    cpu: Optional[Callable] = None    # (statement) -> source lines on the CPU target
    cuda: Optional[Callable] = None   # (statement) -> source lines on the CUDA target
    indexes: Optional[Callable] = None   # (graph, n) -> (operand j, bound): its ints index 0..bound-1
    workspace: Optional[Callable] = None   # (graph, n, dims[, parts]) -> bytes its CPU kernel allocates while it
                                           # runs (parts: for an op with `parts`, the part run's count of parts)
    simplify: Optional[Callable] = None    # (graph, n) -> the node n equals by an identity (n itself when
                                           # rewritten in place into a simpler form), or None (passes/simplify.py)
    view: bool = False                     # its value is a view of its operand's buffer, never a buffer of its own
    parts: Optional[str] = None            # "rows" | "sums": its CPU kernel runs on any part of the batch (see Parts)
    part_work: Optional[Callable] = None   # (graph, n, dims) -> its kernel's work for one image, in conv flops
    batched: Optional[Callable] = None     # (graph, n, operands, lifted, emit) -> n over copies (see Batched)
    doc: str = field(default="", compare=False)


REGISTRY = {}


def register(op):
    if op.name in REGISTRY and REGISTRY[op.name] != op:
        raise ValueError(f"op {op.name!r} is already registered with another definition")
    REGISTRY[op.name] = op
    return op


def get_op(name):
    try:
        return REGISTRY[name]
    except KeyError:
        from ..errors import GradcError
        raise GradcError(f"unknown op {name!r}") from None


def rows_of(graph, n, ins, fail):
    """Where the batch rows lie in n, from where they lie in its operands (`ins`), by its record's `rows`
    rule. A value reduced over the rows (a tuple: a loss term, a sum or mean of per-row terms) goes on
    through ops linear in it, all of whose operands are reduced alike (layout ops, sums and means: a
    per-step loss stacked by a scan and averaged over time); elementwise ops say for themselves."""
    record = get_op(graph.op(n))
    reduced = [w for w in ins if isinstance(w, tuple)]
    if reduced and record.kind != "elementwise":
        if (record.kind == "layout" or record.name in ("sum", "mean")) and len(reduced) == len(ins) \
                and len(set(reduced)) == 1:
            return reduced[0]
        fail("reads a sum or mean over the batch rows other than by scaling, adding, moving or summing it (the loss "
             "must be a sum or mean of per-row terms)")
    if record.rows is None:
        fail("is an op gradc cannot follow the rows through")
    return record.rows(graph, n, ins, fail)


# Registers the built-ins: every module of this package (helper modules too, so each must be safe
# to import alone) is imported when gradc is, so a new op's module needs no line here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
