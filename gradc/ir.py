"""The IR: one graph of values over networkx.MultiDiGraph.

A node is one value with attributes `op`, `inputs` (ordered operand ids), `attrs`, `shape`,
`dtype`, `phase`, `device`, `src`, and `of`: for a derivative node, the node whose derivative
it helps build (it runs on that node's device). Each operand is also an edge whose key and `index` are the
operand position, so `x * x` is two edges. The forward, backward and update parts of a model
all live in the same graph; `phase` tells them apart.
"""
import hashlib
import heapq

import networkx as nx
import numpy as np
import sympy as sp

from .errors import GradcError, ShapeError
from .files import json_text
from .shapes import expr_text, fmt

PHASES = ("forward", "backward", "second", "transfer", "update")
FLOAT_DTYPES = ("float32", "float64")
INT_DTYPES = ("int32", "int64")


class Graph:
    def __init__(self, name):
        self.name = name
        self.nx = nx.MultiDiGraph(name=name)
        self._next_id = 0
        self.inputs = {}        # name -> node
        self.params = {}        # name -> node
        self.outputs = {}       # name -> node
        self.forward_outputs = {}   # name -> the `forward` entry's lean copy, where it has one
                                    # (passes/forward_outputs.py); {}: the outputs themselves
        self.loss = None        # the user's loss node
        self.objective = None   # loss plus weight decay: what is minimised
        self.weight_decay = 0.0
        self.grads = {}         # trainable param name -> adjoint node, None when it is zero
        self.input_grads = {}   # float input name -> adjoint node, None when it is zero
        self.tangents = {}      # trainable param name -> its tangent leaf v_p (second order)
        self.hvps = {}          # trainable param name -> (H v)_p node, None when it is zero
        self.lr = None          # the likelihood-ratio estimate (passes/likelihood_ratio.py): its tables, or why not
        self.pin = None         # (stage, src) the DSL's `with m.stage(i):` gives the nodes it makes
        self.merged = {}        # node -> the node that took its value over (CSE, fusion): where its `of` lands
        self.batch_rows = None  # (the batch dim: its name, or the int --bind made it; the inputs with it on
                                # axis 0), recorded before binding (passes/part_runs.py)
        self.declared_shapes = {}   # the model's node -> its shape as the model declared it, before --bind
                                    # made dims ints (two dims bound to one size are still told apart)

    # ---- building -------------------------------------------------------------------------
    def apply(self, op, inputs=(), attrs=None, *, phase="forward", src=None, name=None, of=None, distinct=False):
        """Add a node of registered op `op`; its shape rule checks the operands. distinct: CSE never merges
        it with an equal node (an entry's own copy of a value another entry computes too)."""
        from .ops import get_op

        record = get_op(op)
        attrs = dict(attrs or {})
        inputs = list(inputs)
        shapes = [self.shape(i) for i in inputs]
        dtypes = [self.dtype(i) for i in inputs]
        if record.arity is not None and len(inputs) != record.arity:
            raise GradcError(f"{op}: takes {record.arity} operands, got {len(inputs)}", src)
        try:
            shape, dtype = record.infer(attrs, shapes, dtypes)
        except ShapeError as e:
            operands = ", ".join(f"{self.describe(i)} {fmt(s)} {d}" for i, s, d in zip(inputs, shapes, dtypes))
            raise GradcError(f"{op}: {e}" + (f" (operands: {operands})" if inputs else ""), src) from None
        return self.add_node(op, inputs, attrs, shape, dtype, phase=phase, src=src, name=name, of=of, distinct=distinct)

    def add_node(self, op, inputs, attrs, shape, dtype, *, phase="forward", src=None, name=None, of=None,
                 distinct=False):
        assert phase in PHASES, phase
        n = self._next_id
        self._next_id += 1
        self.nx.add_node(n, op=op, inputs=list(inputs), attrs=dict(attrs), shape=tuple(shape), dtype=dtype,
                         phase=phase, device="cpu", src=src or "<gradc>", name=name, of=of, distinct=distinct,
                         stage=self.pin[0] if self.pin and phase == "forward" else None)
        for index, u in enumerate(inputs):
            self.nx.add_edge(u, n, key=index, index=index)
        return n

    def set_operands(self, n, inputs):
        """Rewire node n to new operands (keeps its id, so roots that name it stay valid)."""
        for u in set(self.nx.nodes[n]["inputs"]):
            while self.nx.has_edge(u, n):
                self.nx.remove_edge(u, n)
        self.nx.nodes[n]["inputs"] = list(inputs)
        for index, u in enumerate(inputs):
            self.nx.add_edge(u, n, key=index, index=index)

    def merge_into(self, old, new):
        """Record that `new` took `old`'s value over. `new` is in the graph, so a record of its own from
        before (a fused producer that stayed for other users, then took over a node merged into it) is
        stale and goes: with it, the records could loop and `survivor` would never return."""
        self.merged[old] = new
        self.merged.pop(new, None)

    def replace_uses(self, old, new):
        """Every consumer of `old` (and every root) reads `new` instead."""
        self.merge_into(old, new)
        for user in list(self.users(old)):
            self.set_operands(user, [new if u == old else u for u in self.operands(user)])
        for table in (self.outputs, self.forward_outputs, self.grads, self.input_grads, self.hvps, self.lr_grads):
            for k, v in table.items():
                if v == old:
                    table[k] = new
        if self.objective == old:
            self.objective = new
        if self.loss == old:
            self.loss = new

    def remove(self, nodes):
        self.nx.remove_nodes_from(list(nodes))

    def survivor(self, n):
        """n, or the node that took its value over when n was merged away (None if it just died)."""
        while n not in self.nx and n in self.merged:
            n = self.merged[n]
        return n if n in self.nx else None

    def __repr__(self):
        """Content, not identity (a body in a node's attrs is part of the model's fingerprint)."""
        h = hashlib.sha256()
        for n in self.topo_order():
            d = self.nx.nodes[n]
            h.update(f"{n}|{d['op']}|{d['inputs']}|{d['shape']}|{d['dtype']}|{d.get('name')}|{sorted(d['attrs'].items(), key=str)}".encode())
        h.update(f"{list(self.inputs.items())}|{list(self.outputs.items())}".encode())
        return f"<Graph {self.name}: {len(self)} nodes {h.hexdigest()[:16]}>"

    def bodies(self):
        """The sub-graphs in node attrs (scan bodies), nested ones too, innermost first."""
        found = []
        for _, attrs in self.nx.nodes(data="attrs"):   # (in the order nodes were made: no sort needed)
            for v in attrs.values():
                if isinstance(v, Graph):
                    found += v.bodies() + [v]
        return found

    # ---- reading --------------------------------------------------------------------------
    def __contains__(self, n):
        return n in self.nx

    def __len__(self):
        return self.nx.number_of_nodes()

    def node(self, n):
        return self.nx.nodes[n]

    def op(self, n):
        return self.nx.nodes[n]["op"]

    def shape(self, n):
        return self.nx.nodes[n]["shape"]

    def dtype(self, n):
        return self.nx.nodes[n]["dtype"]

    def attrs(self, n):
        return self.nx.nodes[n]["attrs"]

    def operands(self, n):
        return self.nx.nodes[n]["inputs"]

    def users(self, n):
        """Distinct consumers of n."""
        return list(dict.fromkeys(self.nx.successors(n)))

    def describe(self, n):
        """How an error names a value: the user's name, or the op and node id."""
        node = self.nx.nodes[n]
        if node.get("shown"):   # an index of a named value, or a step's slice of a sequence, as the user wrote it
            return f"%{n} {node['shown']}"
        if node.get("name"):
            return repr(node["name"])
        if node["op"] == "random":   # the DSL function that made it
            return f"%{n} (gc.{'dropout' if node['attrs']['dist'] == 'dropout' else 'gaussian_noise'})"
        return f"%{n} ({node['op']})"

    def roots(self):
        """Values some entry point returns: outputs, loss, objective, gradients."""
        out = list(self.outputs.values()) + list(self.forward_outputs.values())
        out += [r for r in (self.loss, self.objective) if r is not None]
        out += [v for v in self.grads.values() if v is not None]
        out += [v for v in self.input_grads.values() if v is not None]
        out += [v for v in self.hvps.values() if v is not None]
        out += [v for v in self.lr_grads.values() if v is not None]
        return list(dict.fromkeys(out))

    @property
    def lr_grads(self):
        """trainable param name -> the node of its likelihood-ratio estimate ({} when not built)."""
        return self.lr["grads"] if self.lr and "grads" in self.lr else {}

    def topo_order(self, nodes=None):
        """Iterative topological order (no recursion limit), ties broken by node id."""
        if nodes is None:   # the whole graph: one pass over networkx's node data, not a lookup per node
            operands = dict(self.nx.nodes(data="inputs"))
            nodes = set(operands)
        else:
            nodes = set(nodes)
            operands = {n: self.nx.nodes[n]["inputs"] for n in nodes}
        waiting = {}
        users = {}
        for n in nodes:
            ins = {u for u in operands[n] if u in nodes}
            waiting[n] = len(ins)
            for u in ins:
                users.setdefault(u, []).append(n)
        ready = [n for n, k in waiting.items() if k == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            n = heapq.heappop(ready)
            order.append(n)
            for v in users.get(n, ()):
                waiting[v] -= 1
                if waiting[v] == 0:
                    heapq.heappush(ready, v)
        if len(order) != len(nodes):
            raise AssertionError("graph has a cycle")
        return order

    def ancestors(self, roots):
        """`roots` and everything they depend on."""
        seen = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(self.nx.nodes[n]["inputs"])
        return seen

    def validate(self):
        """Structural checks every pass must keep true."""
        if not nx.is_directed_acyclic_graph(self.nx):
            raise AssertionError("graph has a cycle")
        for n, d in self.nx.nodes(data=True):
            edges = sorted((k, u) for u, _, k in self.nx.in_edges(n, keys=True))
            if [u for _, u in edges] != d["inputs"] or [k for k, _ in edges] != list(range(len(d["inputs"]))):
                raise AssertionError(f"node {n}: edges {edges} disagree with inputs {d['inputs']}")
            if d["phase"] not in PHASES:
                raise AssertionError(f"node {n}: unknown phase {d['phase']}")

    # ---- dumps ----------------------------------------------------------------------------
    def to_json(self, extra=None):
        """networkx node-link JSON; sympy expressions and arrays are written as text."""
        g = nx.MultiDiGraph(name=self.name)
        for n, d in self.nx.nodes(data=True):
            g.add_node(n, op=d["op"], shape=[str(s) if isinstance(s, str) else s for s in d["shape"]],
                       dtype=d["dtype"], phase=d["phase"], device=d["device"], src=d["src"],
                       name=d.get("name"), of=self.survivor(d["of"]) if d.get("of") is not None else None,
                       stage=d.get("stage"), attrs={k: _jsonable(v) for k, v in d["attrs"].items()})
        g.add_edges_from(self.nx.edges(keys=True, data=True))
        data = nx.node_link_data(g, edges="links")
        data["graph"] = {"name": self.name, "inputs": self.inputs, "params": self.params,
                         "outputs": self.outputs, "forward_outputs": self.forward_outputs or self.outputs,
                         "loss": self.loss, "objective": self.objective,
                         "grads": self.grads, "input_grads": self.input_grads, "tangents": self.tangents,
                         "hvps": self.hvps, **(extra or {})}
        return json_text(data, default=_jsonable)

    def to_dot(self):
        colors = {"forward": "#cfe2ff", "backward": "#ffd8b0", "second": "#e3c8ff",
                  "transfer": "#d0f0c0", "update": "#f8d0d0"}
        lines = [f'digraph "{self.name}" {{', "  rankdir=TB;", '  node [shape=box, style=filled, fontname="monospace"];']
        for n in self.topo_order():
            d = self.nx.nodes[n]
            label = f"%{n} {d['op']}" + (f" {d['name']}" if d.get("name") else "") + f"\\n{fmt(d['shape'])} {d['dtype']}"
            if "expr" in d["attrs"]:
                label += "\\n" + expr_text(d["attrs"]["expr"]).replace('"', "'")
            lines.append(f'  n{n} [label="{label}", fillcolor="{colors[d["phase"]]}", tooltip="{d["src"]}"];')
        for u, v, k in self.nx.edges(keys=True):
            many = len(self.nx.nodes[v]["inputs"]) > 1
            lines.append(f"  n{u} -> n{v}" + (f' [label="{k}"]' if many else "") + ";")
        lines.append("}")
        return "\n".join(lines) + "\n"


def _jsonable(v):
    if isinstance(v, np.ndarray):
        return {"array_shape": list(v.shape), "dtype": str(v.dtype)}
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return expr_text(v) if isinstance(v, sp.Basic) else str(v)
