"""Execution order of an entry point: a topological order that keeps live memory low.

List scheduling: among the nodes whose operands are ready, run first a node that shrinks what
is live (its output is smaller than the operands it is the last reader of), the one that frees
most first; views cost nothing and run at once. Otherwise the lowest node id runs, which is the
order the passes built the graph in (forward first, then the backward from the loss down), so a
value is made close to where it is needed rather than as soon as it could be.
"""
import heapq
import math

from .storage import base, buffer_bytes, written_with_operand


def memory_order(graph, nodes, keep=(), sizes=None):
    """Order `nodes` (their operands outside `nodes` count as ready); `keep` are never freed.

    sizes: node -> bytes as an int (symbolic dims evaluated at a representative value)."""
    nodes = set(nodes)
    sizes = sizes if sizes is not None else {n: buffer_bytes(graph, n) for n in nodes}
    readers = {}      # storage base -> nodes in `nodes` still to run that read it
    waiting = {}
    users = {}
    for n in nodes:
        ins = set(graph.operands(n))
        waiting[n] = len(ins & nodes)
        for u in ins:
            if u in nodes:
                users.setdefault(u, []).append(n)
            if not is_view_node(graph, n):
                readers.setdefault(base(graph, u), set()).add(n)
    keep = {base(graph, k) for k in keep}

    def key(n):
        if written_with_operand(graph, n):   # a view, or a scan's result: right after its operand, before
            return (-math.inf, n)           # any node that frees bytes (the planners keep them together)
        freed = sum(sizes.get(s, 0) for s in {base(graph, u) for u in graph.operands(n)}
                    if s not in keep and readers.get(s) == {n})
        return (min(sizes.get(n, 0) - freed, 0), n)

    version = dict.fromkeys(nodes, 0)
    heap = [(key(n), n, 0) for n, k in waiting.items() if k == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, n, v = heapq.heappop(heap)
        if v != version[n]:
            continue   # a stale entry, or already run
        version[n] = -1
        order.append(n)
        if not is_view_node(graph, n):
            for s in {base(graph, u) for u in graph.operands(n)}:
                left = readers.get(s)
                if left is not None:
                    left.discard(n)
                    if len(left) == 1:   # its last reader now frees it: a better key if it is ready
                        (last,) = left
                        if waiting.get(last) == 0 and version[last] >= 0:
                            version[last] += 1
                            heapq.heappush(heap, (key(last), last, version[last]))
        for m in users.get(n, ()):
            waiting[m] -= 1
            if waiting[m] == 0:
                heapq.heappush(heap, (key(m), m, version[m]))
    if len(order) != len(nodes):
        raise AssertionError("graph has a cycle")
    return order


def is_view_node(graph, n):
    return base(graph, n) != n


def float_to_readers(graph, sequence, forward):
    """`sequence` (a forward, then a backward) with each node of `forward` that reads nothing of
    `forward` (a row count, a param's square, the first op on a value received from another stage)
    moved to just before its first reader, or to the end of the forward when only the backward reads
    it. Moving such a node keeps no other value live longer. A stage's order comes from the whole
    model's, where such a node can run long before its reader: the chain of layers
    (passes/checkpoint.py) would make one layer of everything in between."""
    position = {n: i for i, n in enumerate(sequence)}
    floats = {n for n in sequence if n in forward and not any(u in forward for u in graph.operands(n))}
    out = [n for n in sequence if n not in floats]
    for n in sorted(floats, key=position.get, reverse=True):   # a reader that floats is placed first
        readers = set(graph.users(n))
        out.insert(next((i for i, m in enumerate(out) if m in readers or m not in forward), len(out)), n)
    return out
