"""Numba CPU kernels: one source function per distinct computation, shared by every node that needs it.

A kernel is keyed by what its code depends on (expression, ranks, broadcast pattern, axes), so the
100 identical layers of a deep MLP share one kernel and Numba compiles it once. Kernels write into
an `out` array the caller allocates, or return a scalar.
"""
import sympy as sp

from gradc.ops.elementwise import X

from .kernel_lines import row_max_and_sum_exp, xent_grad_row
from .sympy_print import print_block

DECORATOR = "@kernel"


def _index(names):
    return ", ".join(names) if names else ""


def _loops(dims, body, indent=1):
    """Nested loops `for i{d} in range(n{d})` around body lines."""
    lines, pad = [], "    " * indent
    for depth, d in enumerate(dims):
        lines.append(f"{pad}{'    ' * depth}for i{d} in range(n{d}):")
    inner = pad + "    " * len(dims)
    lines += [inner + b for b in body]
    return lines


def _dims_line(array, rank, names=None):
    names = names or [f"n{d}" for d in range(rank)]
    if rank == 0:
        return []
    return [f"    {', '.join(names)}{',' if rank == 1 else ''} = {array}.shape"]


class Kernels:
    """Kernel sources for one module, deduplicated by key."""

    def __init__(self, fast_tanh=False):
        self.fast_tanh = fast_tanh   # float32 builds: tanh as a vectorisable rational function
        self._by_key = {}
        self.sources = []          # (name, source, doc) in creation order
        self.helpers = set()       # scalar helpers the kernels call

    def _get(self, key, hint, make):
        if key not in self._by_key:
            name = f"k{len(self.sources)}_{hint}"
            source, doc = make(name)
            self._by_key[key] = name
            self.sources.append((name, source, doc))
        return self._by_key[key]

    # ---- elementwise ----------------------------------------------------------------------
    def elementwise(self, expr, patterns, out_rank, hint):
        """patterns[j]: None for a scalar operand, else per operand dim the out dim it runs along
        (or -1 where the operand has size 1 and is broadcast)."""
        key = ("ew", sp.srepr(expr), tuple(patterns), out_rank)
        return self._get(key, hint, lambda name: self._elementwise_source(name, expr, patterns, out_rank))

    def _elementwise_source(self, name, expr, patterns, out_rank):
        args = [f"x{j}" for j in range(len(patterns))]
        loads, names = [], {}
        for j, pat in enumerate(patterns):
            if pat is None:
                names[X[j]] = sp.Symbol(f"x{j}", real=True)
            else:
                idx = _index(["0" if d < 0 else f"i{d}" for d in pat])
                loads.append(f"a{j} = x{j}[{idx}]" if pat else f"a{j} = x{j}[()]")
                names[X[j]] = sp.Symbol(f"a{j}", real=True)
        out_idx = _index([f"i{d}" for d in range(out_rank)])
        block, helpers = print_block(expr, names, f"out[{out_idx}]", self.fast_tanh)
        self.helpers |= helpers
        lines = [f"def {name}({', '.join(args + ['out'])}):"]
        lines += _dims_line("out", out_rank)
        lines += _loops(range(out_rank), loads + block)
        return "\n".join(lines), f"out = {expr}"

    def scalar_expression(self, expr, operand_names, result):
        """Lines of the entry function that compute a scalar elementwise value in place."""
        names = {X[j]: sp.Symbol(v, real=True) for j, v in enumerate(operand_names)}
        block, helpers = print_block(expr, names, result, self.fast_tanh)
        self.helpers |= helpers
        return block

    # ---- reductions -----------------------------------------------------------------------
    def reduction(self, op, rank, axes, keepdims):
        """sum / mean / max over `axes`; returns a scalar when every axis is reduced without keepdims."""
        key = ("reduce", op, rank, tuple(axes), keepdims)
        return self._get(key, op, lambda name: self._reduction_source(name, op, rank, axes, keepdims))

    def _reduction_source(self, name, op, rank, axes, keepdims):
        scalar = len(axes) == rank and not keepdims
        kept = [d for d in range(rank) if d not in axes]
        out_idx = _index(["0" if (d in axes) else f"i{d}" for d in range(rank)] if keepdims else [f"i{d}" for d in kept])
        count = " * ".join(f"n{d}" for d in axes) or "1"
        lines = [f"def {name}(x0{'' if scalar else ', out'}):"] + _dims_line("x0", rank)
        read = f"x0[{_index([f'i{d}' for d in range(rank)])}]" if rank else "x0[()]"
        if op in ("sum", "mean"):
            if scalar:
                lines.append("    acc = 0.0")
                lines += _loops(range(rank), [f"acc += {read}"])
                lines.append(f"    return acc{' / (' + count + ')' if op == 'mean' else ''}")
            else:
                # memory order: the innermost loop runs along contiguous data
                lines.append("    out[:] = 0.0")
                lines += _loops(range(rank), [f"out[{out_idx}] += {read}"])
                if op == "mean":
                    lines.append(f"    out *= 1.0 / ({count})")
            return "\n".join(lines), f"{op} over axes {tuple(axes)}"
        # max: kept dims outside, reduced dims inside; NaN wins, as in numpy and PyTorch
        update = [f"v = {read}", "if v > m or v != v:", "    m = v"]
        if scalar:
            lines.append("    m = -math.inf")
            lines += _loops(range(rank), update)
            lines.append("    return m")
        else:
            lines += _loops(kept, ["m = -math.inf"])
            lines += _loops(axes, update, indent=1 + len(kept))
            lines.append("    " * (1 + len(kept)) + f"out[{out_idx}] = m")
        return "\n".join(lines), f"max over axes {tuple(axes)}"

    def argmax_mask(self, rank, axes):
        key = ("argmax_mask", rank, tuple(axes))
        return self._get(key, "argmax_mask", lambda name: self._argmax_source(name, rank, axes))

    def _argmax_source(self, name, rank, axes):
        kept = [d for d in range(rank) if d not in axes]
        pad = "    " * (1 + len(kept))
        read = f"x0[{_index([f'i{d}' for d in range(rank)])}]"
        lines = [f"def {name}(x0, out):"] + _dims_line("x0", rank) + ["    out[:] = 0.0"]
        lines += _loops(kept, ["m = -math.inf", "found = False"] + [f"b{d} = 0" for d in axes])
        body = [f"v = {read}", "if not found or v > m:", "    m = v", "    found = True"] + \
               [f"    b{d} = i{d}" for d in axes]
        lines += _loops(axes, body, indent=1 + len(kept))
        lines.append(f"{pad}out[{_index([f'b{d}' if d in axes else f'i{d}' for d in range(rank)])}] = 1.0")
        return "\n".join(lines), f"1 at the first maximum over axes {tuple(axes)}"

    # ---- softmax family -------------------------------------------------------------------
    def softmax(self, op, rank, axis):
        key = (op, rank, axis)
        return self._get(key, op, lambda name: self._softmax_source(name, op, rank, axis))

    def _softmax_source(self, name, op, rank, axis):
        kept = [d for d in range(rank) if d != axis]
        pad = "    " * (1 + len(kept))
        idx = _index([f"i{d}" for d in range(rank)])
        lines = [f"def {name}(x0, out):"] + _dims_line("x0", rank)
        lines += _loops(kept, ["m = -math.inf"])
        lines += _loops([axis], [f"v = x0[{idx}]", "if v > m or v != v:", "    m = v"], indent=1 + len(kept))
        lines.append(f"{pad}total = 0.0")
        lines += _loops([axis], [f"total += math.exp(x0[{idx}] - m)"], indent=1 + len(kept))
        if op == "log_softmax":
            lines.append(f"{pad}shift = m + math.log(total)")
            lines += _loops([axis], [f"out[{idx}] = x0[{idx}] - shift"], indent=1 + len(kept))
        else:
            lines.append(f"{pad}scale = 1.0 / total")
            lines += _loops([axis], [f"out[{idx}] = math.exp(x0[{idx}] - m) * scale"], indent=1 + len(kept))
        return "\n".join(lines), f"{op} along axis {axis} (max subtracted first)"

    # ---- labels ---------------------------------------------------------------------------
    def pick(self):
        return self._get(("pick",), "pick", lambda name: (
            f"def {name}(x0, labels, out):\n"
            "    for i in range(out.shape[0]):\n"
            "        out[i] = x0[i, labels[i]]", "out[i] = x0[i, labels[i]]"))

    def softmax_xent_rows(self):
        return self._get(("xent_rows",), "xent_rows", lambda name: ("\n".join([
            f"def {name}(x0, labels, out):", "    for i in range(x0.shape[0]):", *row_max_and_sum_exp("        "),
            "        out[i] = m + math.log(total) - x0[i, labels[i]]"]), "out[i] = logsumexp(x[i]) - x[i, labels[i]]"))

    def softmax_xent_grad(self):
        return self._get(("xent_grad",), "xent_grad", lambda name: ("\n".join([
            f"def {name}(x0, labels, g, out):", "    for i in range(x0.shape[0]):", *row_max_and_sum_exp("        "),
            *xent_grad_row("        ")]), "out[i] = (softmax(x[i]) - onehot(labels[i])) * g[i]"))

    def pick_grad(self):
        return self._get(("pick_grad",), "pick_grad", lambda name: (
            f"def {name}(g, labels, out):\n"
            "    out[:] = 0.0\n"
            "    for i in range(out.shape[0]):\n"
            "        out[i, labels[i]] = g[i]", "out[i, labels[i]] = g[i], zeros elsewhere"))
