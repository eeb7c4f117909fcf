"""Second order: Hessian-vector products as nodes of the same graph, by reverse over reverse.

With g_p the gradient nodes, H v = d/dtheta sum_p <g_p, v_p>. So one more reverse pass over
the forward and backward nodes, seeded at that scalar, gives every HVP: the VJP rules already
build nodes of registered ops, so the backward graph is differentiated by the same pass, and
the second derivatives of elementwise ops come from sympy the same way as the first.

Why reverse over reverse rather than forward over reverse: it needs no second rule per op
(no JVP table), and it costs about two more passes of the size of the backward (HVP ~ 3x a
gradient). Its extra memory is the backward's values, which the gradient keeps anyway.
"""
from .autodiff import accumulate, differentiate


def build_hvp(graph, trainable):
    """Tangent leaves v_p (phase `second`) and the HVP nodes graph.hvps[p] (None where zero)."""
    with_grad = [p for p in trainable if graph.grads.get(p) is not None]
    terms = []
    for p in with_grad:
        node = graph.params[p]
        src = graph.node(node)["src"]
        v = graph.apply("input", attrs={"shape": graph.shape(node), "dtype": graph.dtype(node)}, phase="second",
                        src=src, name=f"v[{p}]", of=node)
        graph.tangents[p] = v
        prod = graph.apply("mul", [graph.grads[p], v], phase="second", src=src, of=node)
        terms.append(graph.apply("sum", [prod], {"axes": tuple(range(len(graph.shape(node)))), "keepdims": False},
                                 phase="second", src=src, of=node))
    graph.hvps = {p: None for p in trainable}
    if not terms:
        return
    seed = accumulate(graph, terms, "second", graph.node(graph.objective)["src"], of=graph.objective)
    adj = differentiate(graph, seed, [graph.params[p] for p in trainable], phase="second")
    graph.hvps = {p: adj[graph.params[p]] for p in trainable}
