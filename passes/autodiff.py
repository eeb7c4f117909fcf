"""Reverse mode over the whole DAG: adjoints become nodes of the same graph.

Walks the values between the differentiated leaves and the objective in reverse topological
order. A value used several times gets the sum of its contributions (fan-out); a contribution
to a broadcast operand is summed back to the operand's shape; zeros stay symbolic (absent).
"""

from gradc.ops import get_op
from gradc.ops.elementwise import G, X, Y
from gradc.shapes import broadcast_axes


class VJPContext:
    """What a VJP rule may do: emit nodes next to the node it differentiates."""

    def __init__(self, graph, node, active, phase):
        self.graph = graph
        self.node = node
        self.active = active
        self.phase = phase
        self.src = graph.node(node)["src"]

    def needs(self, i):
        return self.graph.operands(self.node)[i] in self.active

    def emit(self, op, inputs, **attrs):
        return self.graph.apply(op, inputs, attrs, phase=self.phase, src=self.src, of=self.node)

    def times(self, g, d, operands, y):
        """g * d as one fused node; d is over the operand symbols X[i] and the output symbol Y."""
        if d == 0:
            return None
        if d == 1:
            return g
        if d == -1:
            return self.emit("neg", [g])
        inputs, mapping = [g], {G: X[0]}
        for sym, node in [(X[j], u) for j, u in enumerate(operands)] + [(Y, y)]:
            if sym in d.free_symbols:
                if node not in inputs:
                    inputs.append(node)
                mapping[sym] = X[inputs.index(node)]
        return self.emit("fused", inputs, expr=(G * d).xreplace(mapping))

    def sum_to(self, c, shape):
        """Sum a contribution back over the axes its operand was broadcast along."""
        axes = broadcast_axes(shape, self.graph.shape(c))
        if axes:
            c = self.emit("sum", [c], axes=axes, keepdims=False)
        if self.graph.shape(c) != tuple(shape):
            c = self.emit("reshape", [c], shape=tuple(shape))
        return c


def accumulate(graph, contributions, phase, src, of=None):
    """Fan-out sum (of the adjoint of node `of`); fusion later turns the chain of adds into one loop."""
    total = contributions[0]
    for c in contributions[1:]:
        total = graph.apply("add", [total, c], phase=phase, src=src, of=of)
    return total


def differentiate(graph, objective, wrt, phase="backward", seeds=None):
    """Adjoint node of `objective` for each node in `wrt`; None where it is zero.

    seeds: instead of an objective, (node, adjoint) pairs to start from (a scan's backward body).
    A region with several results (a scan, gradc/ops/scan.py) gets the adjoint of each of its
    `project` nodes (by their attrs["index"]) in one dict."""
    wrt = set(wrt)
    if seeds is None:
        seeds = [(objective, graph.apply("const", attrs={"value": 1.0, "shape": (), "dtype": graph.dtype(objective)},
                                         phase=phase, src=graph.node(objective)["src"], of=objective))]
    needed = graph.ancestors([n for n, _ in seeds])
    active = set()
    for n in graph.topo_order(needed):
        if n in wrt or any(u in active for u in graph.operands(n)):
            active.add(n)
    adjoints = {}
    for n, a in seeds:
        adjoints.setdefault(n, []).append(a)
    projected = {}   # region -> {result index: adjoint}
    result = {}
    for n in reversed(graph.topo_order(active)):
        record = get_op(graph.op(n))
        contributions = adjoints.pop(n, None)
        src = graph.node(n)["src"]
        if record.kind == "region":
            g = projected.pop(n, None)
            if not g:
                continue
        else:
            if not contributions:
                continue
            g = accumulate(graph, contributions, phase, src, of=n)
        if n in wrt:
            result[n] = g
        if record.kind == "leaf":
            continue
        if record.kind == "project":
            projected.setdefault(graph.operands(n)[0], {})[graph.attrs(n)["index"]] = g
            continue
        if record.vjp is None:
            from gradc.errors import GradcError
            raise GradcError(f"op {record.name!r} has no derivative rule", src)
        grads = record.vjp(VJPContext(graph, n, active, phase), n, g)
        for u, gu in zip(graph.operands(n), grads):
            if gu is not None and u in active:
                adjoints.setdefault(u, []).append(gu)
    return {n: result.get(n) for n in wrt}


def build_backward(graph, trainable):
    """Gradients of the objective for the trainable params and the float inputs, phase `backward`."""
    params = {graph.params[name]: name for name in trainable}
    inputs = {n: name for name, n in graph.inputs.items() if graph.dtype(n).startswith("float")}
    adj = differentiate(graph, graph.objective, list(params) + list(inputs))
    graph.grads = {name: adj[n] for n, name in params.items()}
    graph.input_grads = {name: adj[n] for n, name in inputs.items()}
