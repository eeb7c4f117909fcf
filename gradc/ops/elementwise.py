"""Elementwise ops: each is a sympy expression over its operand symbols X[0], X[1], ...

Derivatives are never written by hand: `derivative` asks sympy, and rewrites the op's own
value into the output symbol Y where it appears (tanh' = 1 - Y**2, exp' = Y), so a backward
kernel reads the saved output instead of recomputing it. One generic VJP rule serves every
elementwise op, built-in, fused or user-defined.
"""
import inspect
from functools import lru_cache, reduce

import numpy as np
import sympy as sp
from sympy.printing.numpy import NumPyPrinter

from . import Op, REGISTRY, register
from .batched import copies_dim, right_aligned
from .index import merge_adjacent_slice_grads
from .scalar import (AbsF, Max2, NUMPY_FUNCTIONS, Power, Relu, Sigmoid, Softplus, to_differentiable,
                     unsupported_parts)
from ..errors import ShapeError
from ..shapes import broadcast, size

X = sp.symbols("x0:64", real=True)
Y = sp.Symbol("y", real=True)          # the op's own output, inside derivative expressions
G = sp.Symbol("g", real=True)          # the incoming adjoint, inside VJP expressions
# inside a fused kernel's expression: the flat (C-order) index of the element it computes and the count
# of them (what a random draw recomputed there needs: gradc/ops/random.py's NormalDraw)
FLAT = sp.Symbol("flat", integer=True, nonnegative=True)
SIZE = sp.Symbol("size", integer=True, positive=True)


def expr_of(graph, n):
    """The sympy expression a node computes, over X[i] for its i-th operand."""
    record = REGISTRY[graph.op(n)]
    return graph.attrs(n)["expr"] if record.expr is None else record.expr


@lru_cache(maxsize=None)
def simplified(expr):
    """sympy's simplify of expr, or expr as it is where simplify fails (it raises on some Piecewise conditions
    over AbsF: "not comparable"): a test `simplified(e) != 0` then answers "not shown to be 0"."""
    try:
        return sp.simplify(expr)
    except (ValueError, TypeError):
        return expr


@lru_cache(maxsize=None)
def derivative(expr, i):
    """d expr / d X[i], with expr itself replaced by Y where it occurs as it is. Powers of one base are
    combined first, and Y only stands where expr occurs as it is: sympy writes d(x**n)/dx as n*x**n/x
    (and subs finds x**n in x**(n - 1) as well), which with Y for x**n is n*Y/x, 0/0 = NaN at x = 0 (a
    trial's (x - t)**2 had NaN gradients wherever x == t); n*x**(n - 1) is the derivative there too."""
    d = sp.powsimp(sp.diff(expr, X[i]), combine="exp")
    return d if expr.is_Symbol or d.is_Number else d.xreplace({expr: Y})


class ExactFloatPrinter(NumPyPrinter):
    """lambdify's printer, with each float written as Python does (sympy writes 15 digits)."""

    def _print_Float(self, expr):
        return repr(float(expr))

    # sympy writes a & b as logical_and.reduce((a, b)), which makes one array of the two: operands of
    # different shapes (an array's condition and a scalar param's) fail there; nested pairs broadcast
    def _print_And(self, expr):
        return reduce(lambda a, b: f"logical_and({a}, {b})", map(self._print, expr.args))

    def _print_Or(self, expr):
        return reduce(lambda a, b: f"logical_or({a}, {b})", map(self._print, expr.args))

    def _print_ImaginaryUnit(self, expr):   # NaN, as codegen's KernelPrinter says why
        return self._module_format("numpy.nan")


@lru_cache(maxsize=None)
def numpy_function(expr, nargs):
    """expr as a numpy function of its nargs operands (then FLAT and SIZE, where expr reads them)."""
    f = sp.lambdify(X[:nargs] + ((FLAT, SIZE) if expr.has(FLAT, SIZE) else ()), expr, modules=[NUMPY_FUNCTIONS, "numpy"],
                    printer=ExactFloatPrinter({"fully_qualified_modules": False, "inline": True,
                                               "allow_unknown_functions": True}))   # lambdify's own settings
    if not expr.has(sp.Piecewise):
        return f

    def quiet_clauses(*args):   # numpy.select evaluates the clauses not taken too: their warnings are not the op's
        with np.errstate(all="ignore"):
            return f(*args)
    return quiet_clauses


def _infer(attrs, shapes, dtypes):
    drawn = "expr" in attrs and attrs["expr"].has(FLAT)   # a fused random draw reads an int seed (and flag)
    for d in dtypes:
        if not d.startswith("float") and not drawn:
            raise ShapeError(f"operand of dtype {d}: elementwise ops take float operands")
    shape = broadcast(*shapes)
    target = attrs.get("shape")
    if target is not None:
        target = tuple(target)
        if broadcast(shape, target) != target:
            raise ShapeError(f"cannot broadcast {shape} to {target}")
        shape = target
    return shape, next((d for d in dtypes if d.startswith("float")), "float")


def evaluate_expression(expr, values, out_shape):
    """expr over `values` (X[0], X[1], ...) by numpy, with each element's flat index in `out_shape` and
    their count where expr reads them (FLAT, SIZE: a draw computed in line)."""
    index = ()
    if expr.has(FLAT, SIZE):
        count = size(out_shape)
        index = (np.arange(count, dtype=np.int64).reshape(out_shape), count)
    return numpy_function(expr, len(values))(*values, *index)


def _evaluate_with(expr_getter):
    def evaluate(attrs, values, out_shape, dims):
        result = evaluate_expression(expr_getter(attrs), values, out_shape)
        floats = [v.dtype for v in values if hasattr(v, "dtype") and v.dtype.kind == "f"]   # (not a draw's seed)
        dtype = np.result_type(*floats or [np.float64])
        return np.broadcast_to(np.asarray(result, dtype=dtype), out_shape).copy()
    return evaluate


def _flops_with(expr_getter):
    def flops(attrs, in_shapes, out_shape):
        expr = expr_getter(attrs)
        dearer = sum(getattr(f, "flops", 1) - 1 for f in expr.atoms(sp.Function))   # (a draw in line: its op's 10)
        return size(out_shape) * max(1, sp.count_ops(expr) + dearer)
    return flops


def elementwise_vjp(ctx, n, g):
    graph = ctx.graph
    expr = expr_of(graph, n)
    operands = graph.operands(n)
    grads = []
    for i, u in enumerate(operands):
        if not ctx.needs(i):
            grads.append(None)
            continue
        contribution = ctx.times(g, derivative(expr, i), operands, n)
        grads.append(None if contribution is None else ctx.sum_to(contribution, graph.shape(u)))
    return grads


def expression_name(expr):
    """What an expression computes, for a kernel's name: its functions, or its arithmetic."""
    functions = sorted({type(f).__name__.lower() for f in expr.atoms(sp.Function)})
    arithmetic = [name for kind, name in ((sp.Mul, "mul"), (sp.Add, "add"), (sp.Pow, "pow")) if expr.atoms(kind)]
    return "_".join(functions[:2] or arithmetic) or "copy"


def kernel_name(graph, n):
    """What an elementwise kernel computes, for its name: the op, or a fused chain's expression_name,
    with `_grad` when it is part of a backward and `_hvp` of a second-order pass."""
    op = graph.op(n)
    if op == "fused":
        op = expression_name(graph.attrs(n)["expr"])
    return op + {"backward": "_grad", "second": "_hvp"}.get(graph.node(n)["phase"], "")


def lower(s):
    """Both targets: one kernel per distinct expression and broadcast pattern (codegen shares it
    between nodes); a scalar value on the CPU is a local of the entry, computed in line where the
    entry is compiled and by a scalar kernel where it is plain Python (numpy's inf and nan, not
    Python's exceptions)."""
    expr = expr_of(s.graph, s.n)
    if s.shape == () and s.scalars_in_locals:
        if not s.compiled:
            kernel = s.kernels.scalar(expr, len(s.args), kernel_name(s.graph, s.n))
            return [f"{s.out} = {s.call(kernel, s.args)}{s.note}"]
        lines = s.kernels.scalar_expression(expr, s.args, s.out)
        return lines[:-1] + [lines[-1] + s.note]
    kernel, args = s.elementwise(expr, s.operands, kernel_name(s.graph, s.n))
    return [s.alloc(), s.call(kernel, args + ([s.out] if s.written_over is None else [])) + s.note]


def rows(graph, n, ins, fail):
    """Operands broadcast: those with the batch dim have it on one output axis. After the loss's
    reduction over rows a value may only be scaled or added to others of its kind (then the
    loss of a batch is the weighted sum of its microbatches' losses): expr(t x) = t expr(x)."""
    shape = graph.shape(n)
    reduced = [i for i, w in enumerate(ins) if isinstance(w, tuple)]
    if reduced:
        kinds = {ins[i] for i in reduced}
        if any(w is not None and not isinstance(w, tuple) for w in ins):
            fail("mixes a value reduced over rows with other batch values")
        if len(kinds) > 1:   # a batch's loss is its parts' weighted by their rows for a mean, by 1 for a sum
            fail("adds a mean over the batch rows to a sum over them: a batch's mean is its parts' means weighted "
                 "by their rows, its sum their sums, and no one weight gives both (write both terms as means or both "
                 "as sums: a sum over the rows is their mean times the batch size, a number once it is bound)")
        t = sp.Symbol("t", positive=True)
        expr = expr_of(graph, n)
        if simplified(expr.xreplace({X[i]: t * X[i] for i in reduced}) - t * expr) != 0:
            if any(w is None for w in ins):
                fail(f"combines the loss reduced over rows with a value without batch rows ({expr}): a batch's loss "
                     f"would not be the weighted sum of its parts' (an L2 penalty goes in minimize(..., "
                     f"weight_decay=); a loss summed in a scan's carry: return it as the step's y)")
            fail(f"is not linear in the loss reduced over rows ({expr})")
        return kinds.pop()
    out = None
    for u, w in zip(graph.operands(n), ins):
        if w is None:
            continue
        at = w + len(shape) - len(graph.shape(u))
        if out is not None and at != out:
            fail("broadcasts the batch dim of one operand against another axis")
        out = at
    return out


def batched(graph, n, operands, lifted, emit):
    """Per copy: the lifted operands right-aligned as their shapes broadcast (a stretch's shape, too, gets
    the copies' dim in front)."""
    attrs = dict(graph.attrs(n))
    if "shape" in attrs:
        attrs["shape"] = (copies_dim(graph, operands, lifted),) + tuple(attrs["shape"])
    return emit(graph.op(n), right_aligned(graph, operands, lifted, len(graph.shape(n)), emit), **attrs)


def make(name, expr, arity, doc="", simplify=None):
    return Op(name=name, kind="elementwise", infer=_infer, parts="rows", evaluate=_evaluate_with(lambda a: expr),
              flops=_flops_with(lambda a: expr), vjp=elementwise_vjp, arity=arity, expr=expr, doc=doc,
              rows=rows, cpu=lower, cuda=lower, simplify=simplify, batched=batched)


def _is_scalar_const(graph, n, value):
    if graph.op(n) != "const":
        return False
    v = graph.attrs(n)["value"]
    return np.ndim(v) == 0 and float(v) == value


def _units(*units):
    """The identity of a binary op with a unit: (operand j, value) pairs; n equals the other operand
    when operand j is that scalar constant and the other already has n's shape (no broadcast lost)."""
    def simplify(graph, n):
        ins = graph.operands(n)
        for j, value in units:
            other = ins[1 - j]
            if _is_scalar_const(graph, ins[j], value) and graph.shape(other) == graph.shape(n):
                return other
        return None
    return simplify


def _same_shape_operand(graph, n):
    """The operand itself, when n only passes it through unchanged (its shape too)."""
    (u,) = graph.operands(n)
    return u if graph.shape(u) == graph.shape(n) else None


def _double_negation(graph, n):
    (u,) = graph.operands(n)
    return graph.operands(u)[0] if graph.op(u) == "neg" else None


def _fused_identity(graph, n):
    ins = graph.operands(n)
    return ins[0] if graph.attrs(n)["expr"] == X[0] and graph.shape(ins[0]) == graph.shape(n) else None


x0, x1 = X[0], X[1]
# (gelu's 1 + erf written erfc(-z): a float32 build's erfc vectorises, codegen/sympy_print.py)
BUILTINS = {
    "neg": (-x0, 1), "add": (x0 + x1, 2), "sub": (x0 - x1, 2), "mul": (x0 * x1, 2), "div": (x0 / x1, 2),
    "pow": (Power(x0, x1), 2), "exp": (sp.exp(x0), 1), "log": (sp.log(x0), 1), "tanh": (sp.tanh(x0), 1),
    "sigmoid": (Sigmoid(x0), 1), "relu": (Relu(x0), 1), "softplus": (Softplus(x0), 1),
    "gelu": (x0 * sp.erfc(-x0 / sp.sqrt(2)) / 2, 1), "sin": (sp.sin(x0), 1), "cos": (sp.cos(x0), 1),
    "sqrt": (sp.sqrt(x0), 1), "square": (x0 ** 2, 1), "abs": (AbsF(x0), 1), "maximum": (Max2(x0, x1), 2),
}
_plus_zero = _units((1, 0.0), (0, 0.0))


def _add_simplify(graph, n):
    """x + 0 is x; adjacent slices' adjoints join (index.merge_adjacent_slice_grads)."""
    target = _plus_zero(graph, n)
    return target if target is not None else merge_adjacent_slice_grads(graph, n)


SIMPLIFY = {"neg": _double_negation, "add": _add_simplify, "sub": _units((1, 0.0)),
            "mul": _units((1, 1.0), (0, 1.0)), "div": _units((1, 1.0))}
for _name, (_expr, _arity) in BUILTINS.items():
    register(make(_name, _expr, _arity, simplify=SIMPLIFY.get(_name)))

# broadcast_to(x, shape): the identity, stretched to attrs["shape"].
register(make("broadcast_to", x0, 1, doc="stretch to attrs['shape']", simplify=_same_shape_operand))

# A fused chain of elementwise ops: attrs["expr"] over its operands (attrs["shape"] optional).
register(Op(name="fused", kind="elementwise", infer=_infer, parts="rows", evaluate=_evaluate_with(lambda a: a["expr"]),
            flops=_flops_with(lambda a: a["expr"]), vjp=elementwise_vjp, arity=None, expr=None,
            rows=rows, cpu=lower, cuda=lower, simplify=_fused_identity, batched=batched))


class ElementwiseDefinitionError(Exception):
    pass


def define_user_op(name, fn):
    """Register `gc.elementwise(name, fn)`: fn maps one sympy symbol per operand to an expression."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ElementwiseDefinitionError(f"elementwise: name {name!r} is not an identifier")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise ElementwiseDefinitionError(f"elementwise {name!r}: fn must be a function of sympy symbols") from None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        raise ElementwiseDefinitionError(f"elementwise {name!r}: fn must take a fixed number of positional operands")
    arity = len(params)
    if not 1 <= arity <= 8:
        raise ElementwiseDefinitionError(f"elementwise {name!r}: fn takes {arity} operands; 1 to 8 are supported")
    try:
        expr = sp.sympify(fn(*X[:arity]))
    except Exception as e:   # (trial V: what to write instead, for the two slips a new user makes)
        text = str(e)
        hint = ("; a branch (`if`, `max`, `min`) is a sympy Piecewise(...), Max or Min of the operands"
                if "truth value of Relational" in text else
                "; write sympy's functions (sp.exp, sp.log, ...), not math's or numpy's"
                if "convert expression to float" in text or "ufunc" in text else "")
        raise ElementwiseDefinitionError(f"elementwise {name!r}: fn failed on sympy symbols: {e}{hint}") from None
    if not isinstance(expr, sp.Expr):
        raise ElementwiseDefinitionError(f"elementwise {name!r}: fn returned {type(expr).__name__}, not a sympy expression")
    expr = to_differentiable(expr)
    stray = expr.free_symbols - set(X[:arity])
    if stray:
        raise ElementwiseDefinitionError(f"elementwise {name!r}: expression uses symbols {sorted(map(str, stray))} that are not operands")
    first = [sp.diff(expr, X[i]) for i in range(arity)]
    second = [sp.diff(d, X[j]) for d in first for j in range(arity)]
    bad = sorted(set().union(*(unsupported_parts(e) for e in [expr, *first, *second])))
    if bad:
        raise ElementwiseDefinitionError(
            f"elementwise {name!r}: sympy cannot differentiate {expr} into code gradc can run (unsupported: {', '.join(bad)})")
    existing = REGISTRY.get(name)
    if existing is not None:
        if existing.expr == expr and existing.doc == "user":
            return existing
        what = "a built-in op" if existing.doc != "user" else f"another elementwise op ({existing.expr})"
        raise ElementwiseDefinitionError(f"elementwise {name!r}: the name is taken by {what}")
    return register(make(name, expr, arity, doc="user"))
