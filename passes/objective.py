"""The objective: the user's loss plus weight_decay/2 * sum(||p||^2) over decayed trainable params.

The penalty's nodes read params alone, so they carry marks for the planners: `decay_term` on every one
(computed once before the forward's layers, never recomputed: passes/checkpoint.py) and `decay_of` on
each ||p||^2 (run on p's stage: passes/placement.py)."""


def add_objective(graph, decayed, weight_decay):
    loss = graph.loss
    src = graph.node(loss)["src"]
    if weight_decay == 0 or not decayed:
        graph.objective = loss
        return
    made = []
    terms = []
    for name in decayed:
        p = graph.params[name]
        square = graph.apply("square", [p], src=src)
        terms.append(graph.apply("sum", [square], {"axes": tuple(range(len(graph.shape(p)))), "keepdims": False},
                                 src=src))
        for n in (square, terms[-1]):
            graph.node(n)["decay_of"] = p
        made += [square, terms[-1]]
    total = terms[0]
    for t in terms[1:]:
        total = graph.apply("add", [total, t], src=src)
        made.append(total)
    half = graph.apply("const", attrs={"value": weight_decay / 2, "shape": (), "dtype": graph.dtype(loss)}, src=src)
    penalty = graph.apply("mul", [half, total], src=src)
    for n in made + [penalty]:
        graph.node(n)["decay_term"] = True
    graph.objective = graph.apply("add", [loss, penalty], src=src, name="objective")
