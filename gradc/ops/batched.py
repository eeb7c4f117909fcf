"""Helpers for the records' `batched` rules (gradc/ops/__init__.py): an op run over a leading axis of
independent copies. lr_grad runs an op that mixes the batch's rows once per perturbed copy
(passes/lr_statistics.py): the operands `lifted` have the copies' axis in front, the others are the
same for every copy, and the result has the copies' axis in front."""


def copies_dim(graph, operands, lifted):
    """The copies' dim: the leading dim of a lifted operand."""
    return next(graph.shape(x)[0] for x, up in zip(operands, lifted) if up)


def right_aligned(graph, operands, lifted, rank, emit):
    """Each lifted operand (K,) + s seen as (K,) + 1s + s, so that it broadcasts against the others, and
    against a result of `rank` axes, as s does, the copies' axis in front of every other."""
    out = []
    for x, up in zip(operands, lifted):
        s = tuple(graph.shape(x))[1:] if up else None
        out.append(emit("reshape", [x], shape=(graph.shape(x)[0],) + (1,) * (rank - len(s)) + s)
                   if up and len(s) < rank else x)
    return out


def every_copy(graph, operands, lifted, emit):
    """Every operand with the copies' axis: a shared one broadcast to each copy."""
    k = copies_dim(graph, operands, lifted)
    out = []
    for x, up in zip(operands, lifted):
        if not up:
            s = tuple(graph.shape(x))
            x = emit("broadcast_to", [emit("reshape", [x], shape=(1,) + s)], shape=(k,) + s)
        out.append(x)
    return out


def shifted(axes):
    """Axes of one copy as axes of the lifted value."""
    return tuple(a + 1 for a in axes)


def unary(**attrs_of):
    """The batched rule of a one-operand op whose attrs name its axes: attrs_of maps an attr to how it
    changes (shifted axes, a shape with the copies' dim in front)."""
    def batched(graph, n, operands, lifted, emit):
        (x,) = operands
        attrs = dict(graph.attrs(n))
        for key, change in attrs_of.items():
            attrs[key] = change(attrs[key], graph.shape(x)[0])
        return emit(graph.op(n), [x], **attrs)
    return batched


def per_image(graph, n, operands, lifted, emit):
    """An op on images (N, C, H, W) with shared weights: each copy's single image (N = 1, a statistic: the
    batch's mean image) is one image of a batch of the copies'."""
    x, *rest = operands
    if not lifted[0] or any(lifted[1:]) or graph.shape(x)[1] != 1:
        return None
    k = graph.shape(x)[0]
    out = emit(graph.op(n), [emit("reshape", [x], shape=(k,) + tuple(graph.shape(x))[2:])] + rest, **graph.attrs(n))
    return emit("reshape", [out], shape=(k,) + tuple(graph.shape(n)))
