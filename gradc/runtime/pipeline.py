"""The pipeline executor of a module compiled with --devices K or --microbatches M.

loss_and_grad runs as each stage's forward and backward functions over M microbatches (the
batch split along its batch dim, sizes differing by at most one), in the schedule's order. A
transfer node gets the value of its source when the source's function has run. Gradients and
the loss add up over microbatches with weights B_m / B (a mean loss) or 1 (a sum); the weight
decay term, which every microbatch's objective holds, is then corrected to count once.
"""
import numpy as np

from .schedules import interleave


class Pipeline:
    """functions: (stage, "F"|"B") -> (compiled function, fname, argument spec, roots);
    an argument is ("p", param) | ("a", input) | ("v", node) | ("c", data key)."""

    def __init__(self, functions, transfers, objective, grad_nodes, grad_slices, *, stages, schedule, microbatches,
                 reduction, batch_inputs, weight_decay, decayed, arena, data):
        self.functions = functions
        self.sources = {}                     # (stage, kind) -> [(source node, transfer node)]
        for t, u, src, _, when in transfers:
            if when != "param":
                self.sources.setdefault((src, when), []).append((u, t))
        self.objective = objective
        self.grad_nodes = grad_nodes          # node -> param
        self.grad_slices = grad_slices
        self.K, self.schedule, self.M = stages, schedule, microbatches
        self.reduction = reduction
        self.batch_inputs = batch_inputs
        self.weight_decay, self.decayed = weight_decay, decayed
        self.arena, self.data = arena, data
        self.order = interleave(schedule, stages, microbatches)
        last = {}                             # value node -> the last function that reads it
        for key in sorted(functions, key=lambda key: (key[0], key[1] != "F")):
            for spec in functions[key][2]:
                if spec[0] == "v":
                    last[spec[1]] = key
        self.read = set(last)                 # values some function takes as an argument
        self.drop_after = {}
        for node, key in last.items():
            self.drop_after.setdefault(key, []).append(node)

    def reschedule(self, schedule, microbatches):
        """Run later calls under another schedule or microbatch count (the compiled stage functions
        depend on neither: the batch dim is symbolic in them)."""
        self.schedule, self.M = schedule, microbatches
        self.order = interleave(schedule, self.K, microbatches)

    def split(self, inputs):
        """M microbatches of the inputs, and their weights."""
        if self.M == 1:
            return [inputs], [1.0]
        rows = {len(inputs[name]) for name in self.batch_inputs if name in inputs}
        if len(rows) != 1:
            raise ValueError(f"the batch inputs {self.batch_inputs} must share their first dim, got {sorted(rows)}")
        B = rows.pop()
        if B < self.M:
            raise ValueError(f"a batch of {B} rows cannot make {self.M} microbatches")
        bounds = np.linspace(0, B, self.M + 1).round().astype(int)
        micro = [{k: (v[a:b] if k in self.batch_inputs else v) for k, v in inputs.items()}
                 for a, b in zip(bounds[:-1], bounds[1:])]
        weights = [(b - a) / B if self.reduction == "mean" else 1.0 for a, b in zip(bounds[:-1], bounds[1:])]
        return micro, weights

    def loss_and_grad(self, params, inputs, grads):
        """The objective; its gradients are added into the flat `grads` (zeroed here)."""
        micro, weights = self.split(inputs)
        grads[:] = 0.0
        values, loss = {}, 0.0
        for k, kind, m in self.order:
            fn, fname, spec, roots = self.functions[(k, kind)]
            args = []
            for what, key in spec:
                args.append(params[key] if what == "p" else micro[m][key] if what == "a" else
                            values[(key, m)] if what == "v" else self.data[key])
            results = fn(*args, *self.arena.get(fname, micro[m]))
            for node, value in zip(roots, results):
                if node == self.objective:
                    loss += weights[m] * float(value)
                elif node in self.grad_nodes:
                    a, b = self.grad_slices[self.grad_nodes[node]]
                    grads[a:b] += weights[m] * np.asarray(value).reshape(-1)
                values[(node, m)] = value
            for u, t in self.sources.get((k, kind), ()):
                if (u, m) in values:   # (transfers that only hvp or input_grads read are not made here)
                    values[(t, m)] = values[(u, m)]   # virtual devices: the transfer hands the array over
            for node in roots:
                if node not in self.read:
                    values.pop((node, m), None)
            for node in self.drop_after.get((k, kind), ()):
                values.pop((node, m), None)
        extra = 1.0 - sum(weights)   # every microbatch's objective held the weight decay term once
        if self.weight_decay and extra:
            for name in self.decayed:
                a, b = self.grad_slices[name]
                p = params[name].reshape(-1)
                grads[a:b] += extra * self.weight_decay * p
                loss += extra * 0.5 * self.weight_decay * float(p @ p)
        return loss
