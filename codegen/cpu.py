"""Numba CPU kernels of one module: one source function per distinct computation, shared by every
node that needs it.

A kernel is keyed by what its code depends on (expression, ranks, broadcast pattern, axes), so the
100 identical layers of a deep MLP share one kernel and Numba compiles it once. Kernels write into
an `out` array the caller allocates, or return a scalar. The op records write their own kernels
(gradc/ops, through `_get`); this module writes the one kind every elementwise op shares.
"""
import sympy as sp

from gradc.ops.elementwise import X
from gradc.ops.kernel_text import dims_line, index, loops

from .sympy_print import print_block

DECORATOR = "@kernel"


class Kernels:
    """Kernel sources for one module, deduplicated by key."""

    def __init__(self, single=False):
        self.single = single   # float32 builds: float32 arithmetic, tanh as a vectorisable rational function
        self._by_key = {}
        self.sources = []          # (name, source, doc) in creation order
        self.helpers = set()       # scalar helpers the kernels call

    def _get(self, key, hint, make):
        if key not in self._by_key:
            # numbered by the keys seen: a scan body's `make` asks for its own kernels (a nested scan's
            # body too) before it returns, so the sources written so far do not count it yet
            name = f"k{len(self._by_key)}_{hint}"
            self._by_key[key] = name
            source, doc = make(name)
            self.sources.append((name, source, doc))
        return self._by_key[key]

    # ---- elementwise ----------------------------------------------------------------------
    def elementwise(self, expr, patterns, out_rank, hint, into=None):
        """patterns[j]: None for a scalar operand, else per operand dim the out dim it runs along
        (or -1 where the operand has size 1 and is broadcast). `into`: the operand j whose buffer the
        result is written over (passes/in_place.py); the kernel then takes no `out`, since an `out` that
        is an operand's own array fails LLVM's overlap check, and the loop runs without SIMD (5x slower)."""
        key = ("ew", expr, tuple(patterns), out_rank, into)   # sympy expressions hash and compare by structure
        name = hint if into is None else f"{hint}_in_place"
        return self._get(key, name, lambda kname: self._elementwise_source(kname, expr, patterns, out_rank, into))

    def _elementwise_source(self, name, expr, patterns, out_rank, into=None):
        args = [f"x{j}" for j in range(len(patterns))]
        out = "out" if into is None else f"x{into}"
        loads, names = [], {}
        for j, pat in enumerate(patterns):
            if pat is None:
                names[X[j]] = sp.Symbol(f"x{j}", real=True)
            else:
                idx = index(["0" if d < 0 else f"i{d}" for d in pat])
                loads.append(f"a{j} = x{j}[{idx}]" if pat else f"a{j} = x{j}[()]")
                names[X[j]] = sp.Symbol(f"a{j}", real=True)
        out_idx = index([f"i{d}" for d in range(out_rank)])
        block, helpers = print_block(expr, names, f"{out}[{out_idx}]", self.single)
        self.helpers |= helpers
        lines = [f"def {name}({', '.join(args + (['out'] if into is None else []))}):"]
        lines += dims_line(out, out_rank)
        lines += loops(range(out_rank), loads + block)
        return "\n".join(lines), f"{out} = {expr}"

    def scalar(self, expr, count, hint):
        """A kernel returning the scalar expr of its `count` scalar operands x0, x1, ...: a plain-Python
        entry computes scalars through it, so a log of 0, an overflowing exp or 0/0 give inf and nan
        as the kernels do (Python's math would raise)."""
        key = ("scalar", expr, count)
        return self._get(key, hint, lambda name: self._scalar_source(name, expr, count))

    def _scalar_source(self, name, expr, count):
        args = [f"x{j}" for j in range(count)]
        block = self.scalar_expression(expr, args, "out")
        lines = [f"def {name}({', '.join(args)}):"] + ["    " + b for b in block] + ["    return out"]
        return "\n".join(lines), f"returns {expr}"

    def scalar_expression(self, expr, operand_names, result):
        """Lines of the entry function that compute a scalar elementwise value in place."""
        names = {X[j]: sp.Symbol(v, real=True) for j, v in enumerate(operand_names)}
        block, helpers = print_block(expr, names, result, self.single)
        self.helpers |= helpers
        return block
