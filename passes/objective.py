"""The objective: the user's loss plus weight_decay/2 * sum(||p||^2) over decayed trainable params."""


def add_objective(graph, decayed, weight_decay):
    loss = graph.loss
    src = graph.node(loss)["src"]
    if weight_decay == 0 or not decayed:
        graph.objective = loss
        return
    terms = []
    for name in decayed:
        p = graph.params[name]
        square = graph.apply("square", [p], src=src)
        terms.append(graph.apply("sum", [square], {"axes": tuple(range(len(graph.shape(p)))), "keepdims": False},
                                 src=src))
        for n in (square, terms[-1]):   # placed with the param (passes/placement.py): a scalar travels, not p
            graph.node(n)["decay_of"] = p
    total = terms[0]
    for t in terms[1:]:
        total = graph.apply("add", [total, t], src=src)
    half = graph.apply("const", attrs={"value": weight_decay / 2, "shape": (), "dtype": graph.dtype(loss)}, src=src)
    graph.objective = graph.apply("add", [loss, graph.apply("mul", [half, total], src=src)], src=src, name="objective")
