"""What an op's lowering sees of the node it writes: the statement's names, buffer and kernels.

An entry writer (codegen/entry.py, codegen/cuda_entry.py) makes one Statement per node and hands
it to the node's record (`record.cpu(s)` or `record.cuda(s)`, gradc/ops/__init__.py), which
returns the lines that compute the node. The record decides what runs; the statement knows where
values live and how a kernel is called on its target.
"""


def shape_src(shape, dims):
    """The source of a shape at run time: ints as written, symbolic dims by their variables."""
    parts = [dims[d] if isinstance(d, str) else str(d) for d in shape]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def dtype_src(dtype):
    """The source of a value's dtype: the module's FLOAT for a float value (a model has one float
    dtype), numpy's name for an int one."""
    return "FLOAT" if dtype.startswith("float") else f"np.{dtype}"


def broadcast_pattern(operand_shape, out_shape):
    """Per operand dim, the out dim it runs along, or -1 where it has size 1 and is broadcast."""
    lead = len(out_shape) - len(operand_shape)
    return tuple(-1 if (d == 1 and out_shape[lead + j] != 1) else lead + j for j, d in enumerate(operand_shape))


class Statement:
    """One node's statement on the CPU target: a kernel is a function called with its arguments,
    and a scalar value is a local of the entry function."""
    scalars_in_locals = True

    def __init__(self, writer, n, dims, step):
        g = writer.graph
        node = g.node(n)
        self.graph, self.n, self.op = g, n, node["op"]
        self.attrs, self.shape, self.operands = node["attrs"], node["shape"], node["inputs"]
        self.args = [writer.var(u) for u in self.operands]
        self.out = f"t{n}"
        self.note = f"  # {node['op']} {node['src']}"
        self.kernels = writer.kernels
        self.compiled = writer.compiled   # in one compiled function, or in a plain-Python entry
        # a plain entry's conv may cut the batch over the cores itself (gradc/runtime/conv_cores.py),
        # except in a part run, whose function already runs on a part of it (passes/part_runs.py)
        self.split_batch = not writer.compiled and step not in writer.run_steps
        self.allocated = []   # the lines alloc() gave: a part run makes the buffers before its function
        self._writer, self._dims, self._step = writer, dims, step
        # the operand whose buffer this node writes over (passes/in_place.py), or None
        over = getattr(writer, "over", {}).get(step)
        self.written_over = None if over is None else writer.plan_steps[over]

    def alloc(self):
        """`out = <its buffer>`: only a statement that writes a buffer asks (asking places a flat root)."""
        line = f"{self.out} = {self._writer.new_array(self.n, self._dims, self._step)}"
        self.allocated.append(line)
        return line

    def alloc_for(self, u):
        """`u = <its buffer>` for a value this statement writes besides its own (a scan's results),
        or None when the entry does not compute u (no step of the plan after this one is u)."""
        steps = self._writer.plan_steps
        for step in range(self._step + 1, len(steps)):
            if steps[step] == u:
                return f"{self.var(u)} = {self._writer.new_array(u, self._dims, step)}"
            if steps[step] == self.n:
                break
        return None

    def copy(self, dst, src):
        """`dst[...] = src` for arrays of one shape: numpy's assignment in a plain entry, copy_into's
        loops in a compiled function (gradc/runtime/copy_into.py: Numba's assignment compiles slowly)."""
        return f"copy_into({dst}, {src})" if self.compiled else f"{dst}[...] = {src}"

    def operand_shape(self, j):
        return self.graph.shape(self.operands[j])

    def var(self, u):
        """The variable holding value u."""
        return self._writer.var(u)

    def pattern(self, u):
        """How operand u broadcasts against this node's shape (see broadcast_pattern)."""
        return broadcast_pattern(self.graph.shape(u), self.shape)

    def dim(self, d):
        return self._dims[d] if isinstance(d, str) else str(d)

    def shape_src(self, shape):
        return shape_src(shape, self._dims)

    def kernel(self, key, name, make):
        return self.kernels._get(key, name, make)

    def call(self, kernel, args):
        return f"{kernel}({', '.join(args)})"

    def body_kernel(self, body, skip, doc):
        """A sub-graph as one kernel of the module: (name, work sizes, dims); see EntryWriter.body_kernel."""
        return self._writer.body_kernel(body, skip, doc)

    def guard_of(self, u):
        """The flags under which a scan step being written needs value u (BodyWriter.statements), or None."""
        return getattr(self._writer, "guards", {}).get(u)

    def body_inline(self, body, skip, optional=None):
        """A sub-graph as lines a loop kernel runs in place: see EntryWriter.body_inline."""
        return self._writer.body_inline(body, skip, optional)

    def into_out(self, kernel, args=None):
        """The node's buffer, then kernel(args..., out) writing it (args: the operands by default)."""
        return [self.alloc(), self.call(kernel, list(self.args if args is None else args) + [self.out]) + self.note]

    def elementwise(self, expr, operands, hint):
        """An elementwise kernel computing expr (over X[j] = operands[j]) into out, or over its operand
        `written_over`; (kernel, args: the out argument is the caller's to add, unless written over)."""
        patterns = [None if self.graph.shape(u) == () else self.pattern(u) for u in operands]
        into = None if self.written_over is None else list(operands).index(self.written_over)
        return (self.kernels.elementwise(expr, patterns, len(self.shape), hint, **({} if into is None else {"into": into})),
                [self.var(u) for u in operands])


class CudaStatement(Statement):
    """On CUDA a kernel is launched on the entry's stream, over the grid its definition asks for;
    scalar constants are folded into elementwise kernels instead of passed; a scalar value is a
    one-element device array."""
    scalars_in_locals = False

    def call(self, kernel, args):
        return self._writer.launch(kernel, list(args))

    def fold(self, expr, operands):
        """expr with its scalar-constant operands written in; the operands left (None: not a node)."""
        return self._writer.fold(expr, operands)

    def elementwise(self, expr, operands, hint):
        expr, operands = self.fold(expr, operands)
        return super().elementwise(expr, operands, hint)
