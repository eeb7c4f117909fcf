"""GEMM fusion for the CUDA target: a matmul absorbs its elementwise neighbours into one kernel.

After differentiation and elementwise fusion, a forward layer is `fused(matmul(X, W), b)` (say
tanh(z + b)) and a backward one is `matmul(fused(g, y), W^T)` (say g * (1 - y^2)). Here both
become one `gemm` node: the elementwise expression that only the matmul reads is computed as the
GEMM loads its tile (the prologue), and the elementwise node that is the matmul's only reader is
computed as the GEMM stores (the epilogue). The matmul's own output then never exists in memory.

Rules: a value an entry point returns is never absorbed (it must exist); a prologue's operands
all have the operand's own shape (the kernel reads them at the tile's index); an epilogue's
node has the product's shape, and its other operands broadcast against it.
"""
from gradc.ops import get_op
from gradc.ops.elementwise import FLAT, X, expr_of

MAX_OPERANDS = 8   # per side: more kernel arguments than this reads badly and gains little


def _elementwise(graph, n):
    return get_op(graph.op(n)).kind == "elementwise"


def _absorbable_prologue(graph, u, reader, roots):
    if not _elementwise(graph, u) or u in roots or graph.users(u) != [reader] or expr_of(graph, u).has(FLAT):
        return False   # (a draw's element is the one at its flat index, which a tile's load does not follow)
    operands = graph.operands(u)
    return 0 < len(operands) <= MAX_OPERANDS and all(graph.shape(v) == graph.shape(u) for v in operands)


def _epilogue_of(graph, n, roots):
    """The elementwise node that is n's only reader and can be its epilogue, or None."""
    users = graph.users(n)
    if n in roots or len(users) != 1:
        return None
    e = users[0]
    if not _elementwise(graph, e) or graph.shape(e) != graph.shape(n) or len(graph.operands(e)) > MAX_OPERANDS:
        return None
    rank = len(graph.shape(e))
    for v in graph.operands(e):
        shape = graph.shape(v)
        if v != n and (len(shape) > rank or any(d not in (1, graph.shape(e)[rank - len(shape) + j])
                                                for j, d in enumerate(shape))):
            return None
    return e


def fuse_gemms(graph):
    """Rewrite every matmul with fusable neighbours into a `gemm` node; returns how many."""
    roots = set(graph.roots())
    count = 0
    for n in graph.topo_order():
        if n not in graph or graph.op(n) != "matmul":
            continue
        a, b = graph.operands(n)
        sides = []
        for u in (a, b):
            if _absorbable_prologue(graph, u, n, roots):
                sides.append((expr_of(graph, u), list(graph.operands(u)), u))
            else:
                sides.append((X[0], [u], None))
        e = _epilogue_of(graph, n, roots)
        if e is None and sides[0][2] is None and sides[1][2] is None:
            continue
        attrs = dict(graph.attrs(n))
        attrs.update(a_expr=sides[0][0], b_expr=sides[1][0], a_count=len(sides[0][1]), b_count=len(sides[1][1]),
                     epilogue=X[0])
        inputs = sides[0][1] + sides[1][1]
        target = n
        if e is not None:
            expr, others = expr_of(graph, e), []
            renumber = {}
            for j, v in enumerate(graph.operands(e)):
                if v == n:
                    renumber[X[j]] = X[0]
                else:
                    others.append(v)
                    renumber[X[j]] = X[len(others)]
            attrs["epilogue"] = expr.xreplace(renumber)
            inputs += others
            graph.merge_into(n, e)   # the product now lives inside e's kernel
            target = e
        node = graph.node(target)
        node["op"] = "gemm"
        node["attrs"] = attrs
        graph.set_operands(target, inputs)
        absorbed = [u for _, _, u in sides if u is not None]
        for u in absorbed:
            graph.merge_into(u, target)
        graph.remove(absorbed + ([n] if e is not None else []))
        count += 1
    return count
