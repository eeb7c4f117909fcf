"""The noise sites of lr_grad's estimate (passes/likelihood_ratio.py): which values get noise, and
which uses of a trainable param the estimate can attribute; shared by the graph and the steps of
its scans (passes/lr_scan.py)."""
from gradc.ops import get_op

PRODUCT_KINDS = ("matmul", "conv")   # the records whose outputs are pre-activations: noise goes there
LOOKUPS = ("take",)   # an embedding's rows read from a trainable table: noise there too (its VJP a scatter-add)
LAYOUT = ("reshape", "transpose")
K, KB = "K_lr", "KB_lr"          # the samples, and the stacked rows K * B
DIMS = (K, KB)


class Unsupported(Exception):
    pass


class Site:
    """One noise site as the estimate reads it: `copies`, the product and bias adds whose VJP gives the
    params' parts (their last one, z, gets the cotangent); `pert`, the noise added at z (times the mask);
    `rank`, the rank of the site's value in one step (the mask's rank). Outside a scan, copies are the
    chain's stacked copies and pert has that rank; for a site in a scan's step, copies are the same
    products over the stacked steps (T, KB_lr, ...) and pert is the stack of every step's noise."""

    def __init__(self, copies, pert, rank, doc):
        self.copies, self.pert, self.rank, self.doc = copies, pert, rank, doc
        self.clean = False   # outside a scan: no noise reaches the chain, so `copies` are the estimate's B-row nodes
        self.top = None      # outside a scan: the forward's value that gets the noise


def is_product(graph, n):
    """Does n's output get noise when a trainable param is one of its factors?"""
    return get_op(graph.op(n)).kind in PRODUCT_KINDS or graph.op(n) in LOOKUPS


def row_operand(graph, n):
    """The operand of product n that holds the batch rows: a lookup's indices, otherwise the left factor."""
    return 1 if graph.op(n) in LOOKUPS else 0


def site_op(graph, n):
    """Can n's output get the noise when it reads a param (a factor)? A product or lookup, or any
    elementwise op with a float result (a bias added to a value no product just made, a gain h * g, a
    slope), whose param part is its own VJP like a product's."""
    return is_product(graph, n) or get_op(graph.op(n)).kind == "elementwise" and graph.dtype(n).startswith("float")


def chains(graph, nodes, is_factor):
    """The noise sites among `nodes` (in topological order): each op site_op accepts that reads a
    factor made of trainable params (is_factor(value)), up through the adds of its sum while it is their
    only use and they keep its shape (x @ U + h @ W + b: the products meet at one pre-activation), and
    not past a value the graph returns (a step's carry or y: it must carry the noise itself).
    Returns each site as its nodes in topological order, the one that gets the noise last."""
    nodes = list(nodes)
    order = {n: i for i, n in enumerate(nodes)}
    returned = set(graph.outputs.values())
    trees, claimed = {}, set()
    for n in nodes:
        if n in claimed or not site_op(graph, n) or not any(is_factor(u) for u in graph.operands(n)):
            continue
        path = [n]
        while path[-1] not in returned:
            users = [u for u in graph.users(path[-1]) if u in order]
            if len(users) != 1 or graph.op(users[0]) != "add" or graph.shape(users[0]) != graph.shape(path[-1]):
                break
            path.append(users[0])
        trees.setdefault(path[-1], set()).update(path)
        claimed.update(path)
    return [sorted(tree, key=order.get) for tree in trees.values()]


def misuses(graph, starts, nodes, sites, is_factor, through, exact=lambda u: False):
    """(start, user) for each use of a start value (through the values `through` accepts: layout ops of
    it, or any value made of params alone) among `nodes` that is not as a factor of a site's product or a
    bias in its chain, nor by a value `exact` accepts (one whose VJP the estimate takes exactly)."""
    allowed = {(x, u) for chain in sites for x in chain for u in graph.operands(x) if is_factor(u)}
    bad = []
    for p in starts:
        stack, seen = [p], set()
        while stack:
            x = stack.pop()
            for u in graph.users(x):
                if u not in nodes or u in seen:
                    continue
                if through(u):
                    seen.add(u)
                    stack.append(u)
                elif (u, x) not in allowed and not exact(u):
                    bad.append((p, u))
    return bad
