"""Matrix products: matmul (2-D, with transpose flags so adjoints need no transpose copy) and
gemm, a matmul with its elementwise neighbours fused in (made for the CUDA target)."""
import numpy as np

from . import Op, register
from .elementwise import FLAT, X, evaluate_expression, numpy_function
from ..errors import ShapeError
from ..shapes import fmt, size


def _float_only(op, dtypes):
    for d in dtypes:
        if not d.startswith("float"):
            raise ShapeError(f"operand of dtype {d}: {op} takes float operands")


def _matmul_infer(attrs, shapes, dtypes):
    _float_only("matmul", dtypes)
    a, b = shapes
    if len(a) != 2 or len(b) != 2:
        raise ShapeError(f"operands must have rank 1 or 2, got {fmt(a)} and {fmt(b)}")
    m, k = a[::-1] if attrs.get("transpose_a") else a
    k2, n = b[::-1] if attrs.get("transpose_b") else b
    if k != k2:
        raise ShapeError(f"inner dims differ: {fmt(a)} @ {fmt(b)} ({k} != {k2})")
    return (m, n), dtypes[0]


def _matmul_vjp(ctx, n, g):
    """C = op(A) op(B): each adjoint is one more matmul with transpose flags, never a transpose copy."""
    a, b = ctx.graph.operands(n)
    ta, tb = ctx.graph.attrs(n).get("transpose_a", False), ctx.graph.attrs(n).get("transpose_b", False)
    da = db = None
    if ctx.needs(0):
        da = (ctx.emit("matmul", [b, g], transpose_a=tb, transpose_b=True) if ta
              else ctx.emit("matmul", [g, b], transpose_a=False, transpose_b=not tb))
    if ctx.needs(1):
        db = (ctx.emit("matmul", [g, a], transpose_a=True, transpose_b=ta) if tb
              else ctx.emit("matmul", [a, g], transpose_a=not ta, transpose_b=False))
    return [da, db]


def _matmul_evaluate(attrs, values, out_shape, dims):
    a, b = values
    return (a.T if attrs.get("transpose_a") else a) @ (b.T if attrs.get("transpose_b") else b)


def _matmul_flops(attrs, in_shapes, out_shape):
    a = in_shapes[0]
    k = a[0] if attrs.get("transpose_a") else a[1]
    return 2 * size(out_shape) * size((k,))


def _matmul_rows(graph, n, ins, fail):
    """Rows pass through when only the left operand has them as its rows (or only the right one
    as its columns); a product along the batch dim sums over rows."""
    (a, b), attrs = ins, graph.attrs(n)
    if a is not None and b is None and a == (1 if attrs.get("transpose_a") else 0):
        return 0
    if b is not None and a is None and b == (0 if attrs.get("transpose_b") else 1):
        return 1
    fail("multiplies along the batch dim (it sums over rows)")


def _matmul_cpu(s):
    """gradc's runtime `matmul_into` in a plain-Python entry, `matmul_in_kernel` in compiled code (a scan's
    step, a small hvp block): both compiled once per install, not per model (gradc/runtime/blas.py says
    why), where a Numba kernel around np.dot cost a cold build about 0.9 s of compile; all products run
    on one BLAS with the kernels'. Only an entry's sets BLAS's thread count for a small product."""
    ta, tb = bool(s.attrs.get("transpose_a")), bool(s.attrs.get("transpose_b"))
    product = "matmul_in_kernel" if s.compiled else "matmul_into"
    return [s.alloc(), f"{product}({', '.join(list(s.args) + [str(ta), str(tb), s.out])}){s.note}"]


def _gemm_cuda(s):
    """The tiled GEMM kernels of codegen/cuda.py; which one runs is chosen per call, by size.
    A gemm's A and B prologues and its epilogue (passes/gemm_fusion.py) are fused into it."""
    ta, tb = bool(s.attrs.get("transpose_a")), bool(s.attrs.get("transpose_b"))
    if s.op == "matmul":
        fused, args = (X[0], X[0], X[0], ()), s.args
    else:
        na, nb = s.attrs["a_count"], s.attrs["b_count"]
        epilogue, rest = s.fold(s.attrs["epilogue"], [None] + s.operands[na + nb:])
        patterns = tuple(() if s.graph.shape(u) == () else s.pattern(u) for u in rest[1:])
        fused, args = (s.attrs["a_expr"], s.attrs["b_expr"], epilogue, patterns), s.args[:na + nb] + [s.var(u) for u in rest[1:]]
    site = s.kernels.gemm_site(ta, tb, *fused)
    return [s.alloc(), f"{site}(stream, {', '.join(args + [s.out])}){s.note}"]


def _matmul_batched(graph, n, operands, lifted, emit):
    """A product per copy: a batch_matmul over the copies' axis (a shared factor is broadcast by it)."""
    attrs = graph.attrs(n)
    return emit("batch_matmul", operands, transpose_a=bool(attrs.get("transpose_a")),
                transpose_b=bool(attrs.get("transpose_b")), reduce_batch=False)


def _transposes_as_flags(graph, n):
    """matmul(x.T, y) -> x with its transpose flag flipped, and so for y: PyTorch's (out, in) weights
    (`h @ W.T`) and a tied decoder's W.T made a transposed copy of the weight at every step (trial Y)."""
    operands, rewritten = list(graph.operands(n)), False
    for j, flag in ((0, "transpose_a"), (1, "transpose_b")):
        u = operands[j]
        if graph.op(u) == "transpose" and tuple(graph.attrs(u)["axes"]) == (1, 0):
            operands[j] = graph.operands(u)[0]
            graph.attrs(n)[flag] = not graph.attrs(n).get(flag, False)
            rewritten = True
    if rewritten:
        graph.set_operands(n, operands)
    return n if rewritten else None


register(Op("matmul", "matmul", _matmul_infer, _matmul_evaluate, _matmul_flops, vjp=_matmul_vjp, arity=2,
            rows=_matmul_rows, batched=_matmul_batched, cpu=_matmul_cpu, cuda=_gemm_cuda, simplify=_transposes_as_flags,
            doc="2-D matrix product; attrs transpose_a / transpose_b"))


def _gemm_split(attrs, items):
    """The A operands, B operands and epilogue operands of a gemm, from its flat operand list."""
    na, nb = attrs["a_count"], attrs["b_count"]
    return items[:na], items[na:na + nb], items[na + nb:]


def _gemm_infer(attrs, shapes, dtypes):
    a_types, b_types, rest = _gemm_split(attrs, dtypes)
    # (an epilogue that computes a draw in line reads its int seed: passes/fusion.py)
    _float_only("gemm", a_types + b_types + ([] if attrs["epilogue"].has(FLAT) else rest))
    a, b, _ = _gemm_split(attrs, shapes)
    return _matmul_infer(attrs, [a[0], b[0]], dtypes)


def _gemm_evaluate(attrs, values, out_shape, dims):
    a, b, rest = _gemm_split(attrs, values)
    # (a prologue that simplified to a constant gives a number: the operand's shape back)
    a = np.broadcast_to(numpy_function(attrs["a_expr"], len(a))(*a), np.shape(a[0]))
    b = np.broadcast_to(numpy_function(attrs["b_expr"], len(b))(*b), np.shape(b[0]))
    product = _matmul_evaluate(attrs, [a, b], out_shape, dims)
    return np.broadcast_to(evaluate_expression(attrs["epilogue"], [product, *rest], out_shape), out_shape)


def _gemm_flops(attrs, in_shapes, out_shape):
    a, b, _ = _gemm_split(attrs, in_shapes)
    return _matmul_flops(attrs, [a[0], b[0]], out_shape)


# Made by passes/gemm_fusion.py for the CUDA target after differentiation, so it has no VJP.
register(Op("gemm", "matmul", _gemm_infer, _gemm_evaluate, _gemm_flops, cuda=_gemm_cuda,
            doc="epilogue(op(a_expr(A...)) @ op(b_expr(B...)), E...): a matmul with its elementwise neighbours "
                "fused into the operand loads and the store; attrs transpose_a/b, a_count, b_count, a_expr, b_expr, "
                "epilogue (over x0 = the product, x1.. = E)"))
