"""What a scan node's attrs, operands and results mean (gradc/ops/scan.py has the whole story):
the pieces the op record (scan.py) and its lowerings (scan_loop.py) both read."""


FINAL, YS, STACK, OSTACK, CHECKPOINT = "final", "ys", "stack", "ostack", "checkpoint"


def parts(attrs):
    """(body, leaves, outputs, K, X, C, M): the body, its placeholder leaves and outputs in order."""
    body = attrs["body"]
    leaves, outputs = list(body.inputs.values()), list(body.outputs.values())
    K, X = attrs["carries"], attrs["xs"]
    return body, leaves, outputs, K, X, len(leaves) - K - X, len(outputs) - K


def index_of(attrs, kind, i):
    _, _, _, K, _, _, M = parts(attrs)
    return {FINAL: 0, YS: K, STACK: K + M, OSTACK: 2 * K + M, CHECKPOINT: 3 * K + M}[kind] + i


def kind_of(attrs, index):
    _, _, _, K, _, _, M = parts(attrs)
    for kind, start, count in ((FINAL, 0, K), (YS, K, M), (STACK, K + M, K), (OSTACK, 2 * K + M, K),
                               (CHECKPOINT, 3 * K + M, K)):
        if start <= index < start + count:
            return kind, index - start
    raise ValueError(f"scan has no result {index}")


def checkpoints(length, every):
    """How many carries a forward scan of `length` steps keeps when it keeps every `every`-th."""
    return -(-length // every)


def recompute_leaves(attrs):
    """On a backward scan that recomputes its forward's carries: {("stack_in" | "ostack_in" | "x" |
    "closed", i): leaf index} from its layout; {} on other scans."""
    if not attrs.get("recompute_every"):
        return {}
    return {what: j for j, what in enumerate(vjp_of(attrs)["layout"])}


def operand_leaves(attrs):
    """The body leaves the scan's operands stand for, in operand order: all of them, except the out
    stacks of a backward scan that recomputes them (its loop fills those leaves itself)."""
    _, leaves, _, _, _, _, _ = parts(attrs)
    filled = {j for (what, _), j in recompute_leaves(attrs).items() if what == OSTACK + "_in"}
    return [j for j in range(len(leaves)) if j not in filled]


def length_operand(attrs):
    """The operand whose axis 0 has the scan's T steps (a sequence; not a stack of checkpoints)."""
    _, _, _, K, _, _, _ = parts(attrs)
    rc = recompute_leaves(attrs)
    return operand_leaves(attrs).index(rc[("x", 0)]) if rc else K


def forward_attrs(attrs):
    """The attrs of the forward scan a recomputing backward scan runs again (no checkpoints)."""
    rc = recompute_leaves(attrs)
    count = lambda kind: sum(1 for what, _ in rc if what == kind)
    return {"body": attrs["recompute_body"], "carries": count(STACK + "_in"), "xs": count("x"),
            "reverse": not attrs.get("reverse", False)}


DERIVATIVE_FROM_OUTPUT = {"tanh": "1.0 - y * y", "sigmoid": "y * (1.0 - y)", None: "1.0"}


def _frozen(info):
    """attrs are hashable (common-subexpression elimination keys on them): dicts as sorted pairs."""
    return tuple(sorted((k, _frozen(v) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v)
                        for k, v in info.items()))


def vjp_of(attrs):
    """The vjp_info of a backward scan as a dict (None for other scans)."""
    info = attrs.get("vjp")
    if info is None:
        return None
    info = dict(info)
    if info["structured"] is not None:
        info["structured"] = dict(info["structured"])
    return info
