"""In-place elementwise steps: an elementwise kernel writes its result over the operand it alone reads.

An elementwise kernel reads element i of each full-shape operand and then writes element i of its
result, and no other element, so its result can live where such an operand lived when nothing reads
that operand afterwards. The operand's statement then writes straight into the reader's buffer: its
arena slot, or, when the reader is a value the entry returns, the array handed back (a weight's
gradient in `grads`, which the matmul writes before the weight decay's term is added to it in place).
A layer's pre-activation (a matmul's, a conv's) and its activation share one buffer, and a decayed
weight's gradient needs no temporary of the weight's size.

A pair (operand u made at step s, elementwise reader n at step t) shares a buffer when:
  both run on a CPU device (the CUDA target fuses a matmul's epilogue instead: passes/gemm_fusion.py);
  u owns its buffer and is written by its own statement (not a view, not a scan's result; a sum over a
  part run's images is added into it after the run, from the parts' own buffers: passes/part_runs.py);
  n has u's shape and dtype, reads u itself (not a view of it), and this computation of u is read
  at step t alone and not kept beyond it (a value made before an hvp block's loop and read in it is
  read on every row, and its interval reaches the end).
In a part run the reader writes the rows of its part over the same rows of u. The tensor both share
names u under "over", so a run that touches u keeps it live over the run as it would keep u's own.
A chain u -> n -> m (fusion left n and m apart: too many operands) is one buffer.
"""
from gradc.ops import get_op

from .storage import owns_buffer


def _may_share(graph, u, n):
    """The rules above that the graph alone decides: u's buffer may hold elementwise reader n's value."""
    on_cpu = lambda v: graph.node(v)["device"].startswith("cpu")
    return (on_cpu(u) and on_cpu(n) and owns_buffer(graph, u) and get_op(graph.op(u)).kind != "project"
            and get_op(graph.op(n)).kind == "elementwise"
            and graph.shape(n) == graph.shape(u) and graph.dtype(n) == graph.dtype(u))


def _writes_over(graph, steps, tensor, reads, loop_from):
    """The step of the elementwise reader that may write over `tensor` (a computation of u), or None."""
    if not reads:
        return None
    u, t = tensor["node"], reads[0][0]
    if any(step != t or operand != u for step, operand in reads) or tensor["end"] != t:
        return None
    if loop_from is not None and tensor["start"] < loop_from <= t:   # (read on every row; its interval reaches the
        return None                                                  # end, where a reader at the last step is)
    return t if _may_share(graph, u, steps[t]) else None


def written_into_results(graph, returned):
    """Values that, by the rules above, live in the array of a result the entry returns (a decayed weight's
    product, written into `grads`): the memory planners' byte models count them as the result (nothing),
    as liveness will. One per result (share_in_place takes one operand per reader), the rest are not
    guessed: a model may only overcount."""
    out = set()
    for r in returned:
        u = next((u for u in graph.operands(r) if graph.users(u) == [r] and u not in returned and _may_share(graph, u, r)),
                 None) if r in graph else None
        if u is not None:
            out.add(u)
    return out


def share_in_place(graph, steps, tensors, reads, returned, loop_from=None):
    """Merge each operand's tensor into its in-place reader's (`reads`: tensor index -> the (step,
    operand) pairs that read it; `loop_from`: an hvp block's first step run per tangent row). Returns the
    tensors left, in the order they are made, and the pairs (operand's step, reader's step); a reader
    the entry returns has no tensor, its operand none."""
    made = {tensor["made"]: i for i, tensor in enumerate(tensors)}
    own = [tensor["made"] for tensor in tensors]   # the step of each tensor's own node (a merge moves "made")
    gone, pairs, taken = set(), [], set()
    for i, tensor in enumerate(tensors):   # in the order they are made: a chain u -> n -> m folds into m
        t = _writes_over(graph, steps, tensor, reads.get(i, ()), loop_from)
        if t is None or t in taken:   # (one operand per reader: a sum's others are read as it writes)
            continue
        n = steps[t]
        j = made.get(t)
        if n not in returned and (j is None or tensors[j]["node"] != n):
            continue   # (n keeps no tensor of its own here: leave u's)
        taken.add(t)
        pairs.append((own[i], t))
        gone.add(i)
        if j is not None and n not in returned:
            reader = tensors[j]
            reader.update(start=tensor["start"], made=tensor["made"],
                          retained=reader["retained"] or tensor["retained"])
            reader["over"] = tensor.get("over", []) + [tensor["node"]]
    return [tensor for i, tensor in enumerate(tensors) if i not in gone], pairs
