"""The host function of one entry point on the CUDA target: its kernel launches in plan order.

The function is plain Python (a launch is a Python call either way); it is run once directly and
then, where the driver allows, captured into a CUDA graph and replayed (gradc/runtime/cuda_host.py).
Every value lives in device memory: the arena (a view per planned buffer), `scal` (one slot per
scalar the entry computes: a scalar is a one-element array, never a host number, so nothing waits
for the device mid-step), or a fresh array for a value it returns. Scalar constants are folded into
the elementwise kernels that read them.
"""
import numpy as np

from gradc.ops import get_op
from gradc.ops.elementwise import X, expr_of
from gradc.passes.fusion import distributes, literal

from .entry import BODY_CONST_LIMIT, BodyWriter, EntryWriter, array_source
from .statement import CudaStatement, dtype_src, shape_src as _shape_src


def _fold_constants(expr, operands, is_scalar_const, value_of):
    """expr over X[0..] with the scalar-constant operands substituted; the rest renumbered. A constant
    that sympy would multiply into a sum stays an operand (fusion's rule: passes/fusion.py)."""
    written = {j: literal(value_of(u)) for j, u in enumerate(operands) if u is not None and is_scalar_const(u)}
    while written and distributes(expr, {X[j]: v for j, v in written.items()}):
        written.pop(next((j for j, v in written.items() if distributes(expr, {X[j]: v})), next(iter(written))))
    kept, subs = [], {}
    for j, u in enumerate(operands):
        if j in written:
            subs[X[j]] = written[j]
        else:
            subs[X[j]] = X[len(kept)]
            kept.append(u)
    return expr.xreplace(subs), kept


def _device_view(array, start, shape, dims):
    """(source of the view of `shape` at `start` in the flat device array, its element count)."""
    count = " * ".join(dims[d] if isinstance(d, str) else str(d) for d in shape if d != 1) or "1"
    if all(isinstance(d, int) for d in shape):
        count = str(int(np.prod(shape)))
    view = f"{array}[{start}:{start} + {count}]"
    return (view if len(shape) == 1 else f"{view}.reshape({_shape_src(shape, dims)})"), count


class CudaEntryWriter(EntryWriter):
    decorator = None                     # a host function, not a compiled one
    tail_args = ("arena", "offs", "scal", "stream")
    target = "cuda"
    Statement = CudaStatement

    def entry_tail(self):
        return self.tail_args

    def _start_plan(self, plan):
        super()._start_plan(plan)
        self.scalar_slot = {}            # scalar node -> its index in `scal`

    def scalar_count(self):
        return len(self.scalar_slot)

    def var(self, n):
        g = self.graph
        if g.op(n) == "const":
            return f"c{n}"               # a one-element device array for a scalar const
        return self.names.get(n, f"t{n}")

    def const_argument(self, n, order):
        """Array constants, and the scalar ones a kernel reads as an array: any but an elementwise one, and
        an elementwise one that keeps it an operand (fold)."""
        g = self.graph
        return np.ndim(g.attrs(n)["value"]) > 0 or any(n in g.operands(m) and self.reads_const(m, n) for m in order)

    def reads_const(self, m, n):
        """Whether node m's kernel reads scalar constant n as an array, not as a literal written in."""
        g = self.graph
        return get_op(g.op(m)).kind != "elementwise" or n in self.fold(expr_of(g, m), g.operands(m))[1]

    def new_array(self, n, dims, step):
        if self.graph.shape(n) != ():
            return super().new_array(n, dims, step)
        if n in self.flat:
            self.placed.add(n)
            start, _ = self.flat[n]
            return f"grads[{start}:{start + 1}]"
        k = self.scalar_slot.setdefault(n, len(self.scalar_slot))
        return f"scal[{k}:{k + 1}]"

    def arena_view(self, k, shape, dims):
        """A view of the device arena (host code: slicing a device array costs no compile)."""
        return _device_view("arena", f"offs[{k}]", shape, dims)[0]

    def fresh_array(self, shape_src, dtype="FLOAT"):
        return f"temp_array({shape_src}, {dtype})"

    def fold(self, expr, operands):
        """expr with its scalar-constant operands written in; the operands left (None: not a node)."""
        g = self.graph
        return _fold_constants(expr, operands, lambda u: g.op(u) == "const" and np.ndim(g.attrs(u)["value"]) == 0,
                               lambda u: g.attrs(u)["value"])

    def launch(self, kernel, args):
        """`kernel[config](args)`: the launch configuration its grid (codegen/cuda.py) asks for."""
        grid = self.kernels.launch[kernel]
        if grid[0] == "flat":
            config = f"flat({args[grid[1]]}, stream)"
        elif grid[0] in ("rows", "folds"):
            config = f"{grid[0]}({args[grid[1]]}, {tuple(grid[2])!r}, stream)"
        else:
            config = "block(stream)"
        return f"{kernel}[{config}]({', '.join(args)})"

    def body_kernel(self, body, skip, doc):
        """A scan's step on CUDA: a host function step(leaves..., outputs..., work, scal, stream) that
        launches its kernels (CudaBodyWriter), one per distinct body and skip per module. Returns (its
        name, the sizes of its work buffers as source, the body's dim variables, its scalar slots)."""
        def make(name):
            writer = CudaBodyWriter(body, self.kernels)
            source, dims = writer.write_body(name, skip)
            return source, doc, (writer.sizes, dims, writer.scalar_count())

        return self.kernels.host_function(("scan_step", repr(body), tuple(skip)), "scan_step", make)

    def _fill_row(self, r, start, size):
        """A copy kernel into the flat buffer for a root no kernel wrote there; a fill for a zero root."""
        view = f"grads[{start}:{start + size}]"
        if r is None:
            return [self.launch(self.kernels.fill(), [view, "0.0"])]
        if r in self.placed and self.flat[r][0] == start:
            return []
        v = self.var(r)
        source = v if self.graph.shape(r) == () else f"{v}.reshape({size})"
        return [self.launch(self.kernels.elementwise(X[0], [(0,)], 1, "copy"), [source, view])]

    def returned(self, r, seen):
        """Every returned value is a device array; the caller copies it out before the next call."""
        return self.var(r)


class CudaBodyWriter(BodyWriter, CudaEntryWriter):
    """A scan's step as a host function on CUDA: intermediates are slices of the device array `work`,
    scalars slots of `scal` (one-element arrays, as in an entry), and a scalar constant that a kernel
    reads as an array is made on the device by the function itself."""
    body_tail = ("work", "scal", "stream")

    def __init__(self, body, kernels):
        super().__init__(body, kernels)
        self.scalar_slot = {}

    def const_argument(self, n, order):
        return False      # arrays are made by const_array; scalars folded into kernels, or made by `statement`

    def const_array(self, n):
        return f"c{n} = cuda.to_device({array_source(self.graph.attrs(n)['value'], BODY_CONST_LIMIT)}, stream=stream)"

    def new_array(self, n, dims, step):
        shape = self.graph.shape(n)
        out = self.output_argument(n)
        if out is not None:
            return out
        if shape == ():
            k = self.scalar_slot.setdefault(n, len(self.scalar_slot))
            return f"scal[{k}:{k + 1}]"
        if not self.graph.dtype(n).startswith("float"):   # the work array holds floats (storage.in_arena)
            return self.fresh_array(_shape_src(shape, dims), dtype_src(self.graph.dtype(n)))
        view, _ = _device_view("work", f"({self.sizes.source()})", shape, dims)
        self.sizes.add(shape, dims)
        return view

    def statement(self, n, dims, step):
        g = self.graph
        made = [u for u in g.operands(n) if g.op(u) == "const" and np.ndim(g.attrs(u)["value"]) == 0
                and self.reads_const(n, u) and u not in self.placed_consts]
        self.placed_consts |= set(made)
        return [f"c{u} = cuda.to_device(np.full(1, {float(g.attrs(u)['value'])!r}, FLOAT), stream=stream)"
                for u in made] + super().statement(n, dims, step)

    def write_body(self, fname, skip=()):
        self.placed_consts = set()
        return super().write_body(fname, skip)

    def copy_into(self, out, n):
        rank = len(self.graph.shape(n))
        copy = self.kernels.elementwise(X[0], [tuple(range(rank))], rank, "copy")
        return [self.launch(copy, [self.var(n), out])]
