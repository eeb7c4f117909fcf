"""Numba CUDA kernels for `--target cuda`: one source per distinct computation, as codegen/cpu.py.

The kernels every op shares live here: elementwise (and copies), the GEMM, fills, and the
optimizer updates; the op records write the rest (gradc/ops). Every kernel writes into an `out`
device array. Elementwise kernels run one thread per output element (the flat index unravelled
over `out`'s shape); the GEMM runs a 16x16 thread block per 16x16 tile of
`out`, staging both operands through shared memory, with the transposes read in place (the
backward's dX = dZ W^T and dW = X^T dZ need no copy). A scalar value is a one-element array.
`launch` says each kernel's grid, over one of its arguments (by position; -1 is `out`):
("flat", arg) covers that array's elements; ("rows", arg, axes) its index over the axes not
reduced, one thread each; ("folds", arg, axes) that index with several threads folding each one's
reduced elements (a reduction); ("tiles", -1) the GEMM's tiles of `out`.

codegen/cuda_entry.py writes the host code that launches them in the memory plan's order.
"""
import sympy as sp

from gradc.ops.elementwise import FLAT, SIZE, X
from gradc.ops.kernel_text import block_sum, index, unravel
from gradc.runtime.cuda import BIG, BK, PER, TILE

from .sympy_print import print_block


def _element_index(flat):
    """The names of a kernel's element index and their count (FLAT, SIZE: what a draw computed in line
    reads, passes/fusion.py), `flat` the source of the flat index of out's element."""
    return {FLAT: sp.Symbol(flat), SIZE: sp.Symbol("out.size")}


def _arity(expr):
    """How many operands X[0..] an expression reads (the highest one it names, plus one)."""
    used = [j for j in range(len(X)) if X[j] in expr.free_symbols]
    return max(used) + 1 if used else 1


def _gemm_def(name, a_expr, b_expr, epilogue):
    """A GEMM kernel's def line: A's operands a0.., B's b0.., the epilogue's e1.., then out."""
    na, nb, ne = _arity(a_expr), _arity(b_expr), _arity(epilogue) - 1
    args = [f"a{j}" for j in range(na)] + [f"b{j}" for j in range(nb)] + [f"e{j + 1}" for j in range(ne)] + ["out"]
    return f"def {name}({', '.join(args)}):"


class CudaKernels:
    """CUDA kernel sources for one module, deduplicated by key; `launch[name]` is its grid."""

    def __init__(self):
        self._by_key = {}
        self.sources = []     # (name, source, doc)
        self.helpers = set()  # scalar helpers (device functions) the kernels call
        self.launch = {}
        self.sites = []       # (name, source): the GEMM sites (gradc/runtime/cuda_gemm.py), after the kernels
        self._site_by_key = {}
        self.host_functions = []   # (name, source, doc): scans' steps, host code that launches kernels
        self._host_by_key = {}     # key -> (name, facts)

    def _get(self, key, hint, make):
        if key not in self._by_key:
            name = f"g{len(self._by_key)}_{hint}"   # (numbered by the keys seen, as codegen/cpu.py's)
            self._by_key[key] = name
            source, doc, grid = make(name)
            self.sources.append((name, source, doc))
            self.launch[name] = grid
        return self._by_key[key]

    def host_function(self, key, hint, make):
        """A host function of the module (not a kernel), once per key: make(name) -> (source, doc, facts);
        returns (name,) + facts."""
        if key not in self._host_by_key:
            name = f"h{len(self._host_by_key)}_{hint}"   # (a nested scan's step is made inside its parent's)
            self._host_by_key[key] = (name, None)
            source, doc, facts = make(name)
            self.host_functions.append((name, source, doc))
            self._host_by_key[key] = (name, facts)
        name, facts = self._host_by_key[key]
        return (name,) + tuple(facts)

    # ---- elementwise ----------------------------------------------------------------------
    def elementwise(self, expr, patterns, out_rank, hint):
        """patterns[j]: None for a scalar operand (a one-element array), else per operand dim the
        out dim it runs along (-1 where the operand has size 1 and is broadcast)."""
        key = ("ew", expr, tuple(patterns), out_rank)   # sympy expressions hash and compare by structure
        return self._get(key, hint, lambda name: self._elementwise_source(name, expr, patterns, out_rank))

    def _elementwise_source(self, name, expr, patterns, out_rank):
        args = [f"x{j}" for j in range(len(patterns))]
        loads, names = [], {}
        for j, pat in enumerate(patterns):
            if pat is None or not pat:
                loads.append(f"    a{j} = x{j}[0]" if pat is None else f"    a{j} = x{j}[()]")
            else:
                loads.append(f"    a{j} = x{j}[{index(['0' if d < 0 else f'i{d}' for d in pat])}]")
            names[X[j]] = sp.Symbol(f"a{j}", real=True)
        names.update(_element_index("i"))
        target = f"out[{index([f'i{d}' for d in range(out_rank)])}]" if out_rank else "out[0]"
        block, helpers = print_block(expr, names, target)
        self.helpers |= helpers
        lines = [f"def {name}({', '.join(args + ['out'])}):", "    i = cuda.grid(1)", "    if i >= out.size:",
                 "        return"]
        lines += unravel(out_rank) if out_rank else []
        lines += loads + ["    " + b for b in block]
        return "\n".join(lines), f"out = {expr}", ("flat", -1)

    # ---- matmul ---------------------------------------------------------------------------
    def matmul(self, transpose_a, transpose_b, a_prologue=None, b_prologue=None, epilogue=None, epilogue_patterns=()):
        """out = epilogue(op(A) @ op(B), e1, ...), op a transpose where asked, read in place.

        A (likewise B) is one array, or with a prologue an elementwise expression over X[0..] of
        several arrays of A's shape, computed as the tile is loaded: the backward's g * f'(z) fused
        into dX = (g * f'(z)) W^T. The epilogue is an expression over X[0] (the product) and X[1..]
        (arrays broadcast against `out` by `epilogue_patterns`): a bias and an activation fused into
        the forward's store."""
        a_prologue = a_prologue if a_prologue is not None else X[0]
        b_prologue = b_prologue if b_prologue is not None else X[0]
        epilogue = epilogue if epilogue is not None else X[0]
        key = ("matmul", transpose_a, transpose_b, sp.srepr(a_prologue), sp.srepr(b_prologue), sp.srepr(epilogue),
               tuple(epilogue_patterns))
        hint = "gemm" if (a_prologue, b_prologue, epilogue) == (X[0], X[0], X[0]) else "gemm_fused"
        return self._get(key, hint, lambda name: self._matmul_source(name, transpose_a, transpose_b, a_prologue,
                                                                     b_prologue, epilogue, epilogue_patterns))

    def _operand_load(self, expr, prefix, at, keep, tile, result):
        """Lines that load operand `prefix` (an expression over arrays prefix0, prefix1, ... at `at`)
        into the shared tile, zero outside the matrix."""
        count = _arity(expr)
        names = {X[j]: sp.Symbol(f"l{prefix}{j}", real=True) for j in range(count)}
        block, helpers = print_block(expr, names, result)
        self.helpers |= helpers
        pad = " " * 12
        return ([f"        if {keep}:"] + [f"{pad}l{prefix}{j} = {prefix}{j}[{at}]" for j in range(count)]
                + [pad + b for b in block] + [f"{pad}{tile} = {result}", "        else:", f"{pad}{tile} = 0.0"])

    def _matmul_source(self, name, ta, tb, a_expr, b_expr, epilogue, patterns, split=False):
        """The 16x16-tile kernel; with `split`, the kernel of one slice of the K dim per blockIdx.z, its
        raw partial product into out[z] (out: (slices, m, n)), no epilogue (`split_sum` adds them)."""
        def_line = _gemm_def(name, a_expr, b_expr, X[0] if split else epilogue)
        lines = [
            def_line,
            f"    sa = cuda.shared.array(({TILE}, {TILE}), FLOAT_T)",
            f"    sb = cuda.shared.array(({TILE}, {TILE}), FLOAT_T)",   # its own line: the simulator keys shared arrays by line
            "    tx = cuda.threadIdx.x",
            "    ty = cuda.threadIdx.y",
            f"    row = cuda.blockIdx.y * {TILE} + ty",
            f"    col = cuda.blockIdx.x * {TILE} + tx",
            f"    m = out.shape[{1 if split else 0}]",
            f"    n = out.shape[{2 if split else 1}]",
            f"    depth = a0.shape[{0 if ta else 1}]",
            "    acc = 0.0"]
        if split:   # slice z takes tile steps [first, last): the steps shared out evenly
            lines += [f"    steps = (depth + {TILE - 1}) // {TILE}", "    z = cuda.blockIdx.z",
                      "    first = z * steps // cuda.gridDim.z", "    last = (z + 1) * steps // cuda.gridDim.z",
                      "    for t in range(first, last):"]
        else:
            lines.append(f"    for t in range((depth + {TILE - 1}) // {TILE}):")
        lines.append(f"        k = t * {TILE} + tx")
        lines += self._operand_load(a_expr, "a", "k, row" if ta else "row, k", "row < m and k < depth", "sa[ty, tx]", "va")
        lines.append(f"        k = t * {TILE} + ty")
        lines += self._operand_load(b_expr, "b", "col, k" if tb else "k, col", "k < depth and col < n", "sb[ty, tx]", "vb")
        lines += ["        cuda.syncthreads()", f"        for j in range({TILE}):", "            acc += sa[ty, j] * sb[j, tx]",
                  "        cuda.syncthreads()", "    if row < m and col < n:"]
        product = f"A @ B, A = {a_expr}{'^T' if ta else ''}, B = {b_expr}{'^T' if tb else ''}"
        if split:
            lines.append("        out[z, row, col] = acc")
            return "\n".join(lines), f"out[z] = slice z of the K dim of {product} ({TILE}x{TILE} tiles)", ("slices", -1)
        lines += ["        " + x for x in self._epilogue_store(epilogue, patterns)]
        doc = f"out = {epilogue} with x0 = {product} ({TILE}x{TILE} tiles through shared memory)"
        return "\n".join(lines), doc, ("tiles", -1)

    def matmul_split(self, transpose_a, transpose_b, a_prologue, b_prologue):
        """The partial products of a split-K GEMM (see `_matmul_source`)."""
        key = ("matmul_split", transpose_a, transpose_b, sp.srepr(a_prologue), sp.srepr(b_prologue))
        return self._get(key, "gemm_slices", lambda name: self._matmul_source(
            name, transpose_a, transpose_b, a_prologue, b_prologue, X[0], (), split=True))

    def split_sum(self, epilogue, patterns):
        """out = epilogue(sum over z of parts[z], e1, ...): a split-K GEMM's slices added, then its epilogue."""
        key = ("split_sum", sp.srepr(epilogue), tuple(patterns))

        def make(name):
            args = ["parts"] + [f"e{j}" for j in range(1, _arity(epilogue))] + ["out"]
            lines = [f"def {name}({', '.join(args)}):", "    i = cuda.grid(1)", "    if i >= out.size:", "        return",
                     "    row = i // out.shape[1]", "    col = i % out.shape[1]", "    acc = 0.0",
                     "    for z in range(parts.shape[0]):", "        acc += parts[z, row, col]"]
            lines += ["    " + x for x in self._epilogue_store(epilogue, patterns)]
            return "\n".join(lines), f"out = {epilogue} with x0 = the sum of a split product's slices", ("flat", -1)
        return self._get(key, "gemm_slices_sum", make)

    def _epilogue_store(self, epilogue, patterns):
        """Lines (unindented) that store out[row, col] = epilogue(acc, e1[...], ...)."""
        names, loads = {X[0]: sp.Symbol("acc", real=True), **_element_index("row * out.shape[1] + col")}, []
        for j, pat in enumerate(patterns, start=1):
            idx = index(["0" if d < 0 else ("row", "col")[d] for d in pat]) if pat else "0"
            loads.append(f"l{j} = e{j}[{idx}]")
            names[X[j]] = sp.Symbol(f"l{j}", real=True)
        block, helpers = print_block(epilogue, names, "out[row, col]")
        self.helpers |= helpers
        return loads + block

    def gemm_site(self, transpose_a, transpose_b, a_prologue=None, b_prologue=None, epilogue=None,
                  epilogue_patterns=()):
        """A `Gemm` object that picks, per call, the 16x16 kernel, the register-tiled one, the 16x16
        one over slices of K (few output tiles, a long K dim: a weight's gradient over many rows), or
        (no prologue) cuBLAS followed by the epilogue as an elementwise kernel in place."""
        args = (transpose_a, transpose_b, a_prologue, b_prologue, epilogue, tuple(epilogue_patterns))
        key = (transpose_a, transpose_b) + tuple(sp.srepr(x) if x is not None else None for x in args[2:5]) + args[5:]
        if key not in self._site_by_key:
            small, large = self.matmul(*args), self.matmul_tiled(*args)
            a_expr = a_prologue if a_prologue is not None else X[0]
            b_expr = b_prologue if b_prologue is not None else X[0]
            slices = self.matmul_split(transpose_a, transpose_b, a_expr, b_expr)
            added = self.split_sum(epilogue if epilogue is not None else X[0], epilogue_patterns)
            split = f", split=({slices}, {added}, {_arity(a_expr) + _arity(b_expr)})"
            cublas = ""
            if (a_prologue in (None, X[0])) and (b_prologue in (None, X[0])):
                after = None
                if epilogue not in (None, X[0]):
                    # (an epilogue's scalar, pattern (), is a one-element array here too: read as such)
                    scalars = [None if pattern == () else pattern for pattern in epilogue_patterns]
                    after = self.elementwise(epilogue, [(0, 1)] + scalars, 2, "epilogue")
                cublas = f", cublas=({transpose_a}, {transpose_b}, {after})"
            name = f"gemm{len(self.sites)}"
            self.sites.append((name, f"{name} = Gemm({small}, {large}, transpose_a={transpose_a}{split}{cublas})"))
            self._site_by_key[key] = name
        return self._site_by_key[key]

    # ---- register-tiled GEMM (large products) ----------------------------------------------
    def matmul_tiled(self, transpose_a, transpose_b, a_prologue=None, b_prologue=None, epilogue=None,
                     epilogue_patterns=()):
        """The same product as `matmul`, for large outputs: a BIG x BIG block tile, each of the
        16x16 threads keeps a PER x PER tile of `out` in scalar locals (registers; a local array
        would spill), and the K dim goes through two shared buffers, so loading the next slice
        overlaps computing on this one (one barrier per slice)."""
        a_prologue = a_prologue if a_prologue is not None else X[0]
        b_prologue = b_prologue if b_prologue is not None else X[0]
        epilogue = epilogue if epilogue is not None else X[0]
        key = ("matmul_tiled", transpose_a, transpose_b, sp.srepr(a_prologue), sp.srepr(b_prologue),
               sp.srepr(epilogue), tuple(epilogue_patterns))
        hint = "gemm_tiled" if (a_prologue, b_prologue, epilogue) == (X[0], X[0], X[0]) else "gemm_tiled_fused"
        return self._get(key, hint, lambda name: self._matmul_tiled_source(
            name, transpose_a, transpose_b, a_prologue, b_prologue, epilogue, epilogue_patterns))

    def _tiled_load(self, expr, prefix, transposed, side):
        """Lines that load this thread's share of operand `prefix`'s next BK-deep slice into
        shared buffer `nxt`, zero outside the matrix, reading consecutive memory in consecutive threads."""
        count = _arity(expr)
        names = {X[j]: sp.Symbol(f"l{prefix}{j}", real=True) for j in range(count)}
        block, helpers = print_block(expr, names, "v")
        self.helpers |= helpers
        edge, extent = ("row", "m") if side == "a" else ("col", "n")
        # A is (m, k), or (k, m) when transposed; B is (k, n), or (n, k) when transposed
        along_k = (side == "a" and not transposed) or (side == "b" and transposed)
        if along_k:   # memory runs along k: threads sweep k fastest
            place = [f"            kk = l % {BK}", f"            {edge} = base_{side} + l // {BK}"]
        else:         # memory runs along m (or n)
            place = [f"            kk = l // {BIG}", f"            {edge} = base_{side} + l % {BIG}"]
        at = f"{edge}, k0 + kk" if along_k else f"k0 + kk, {edge}"
        lines = [f"        for q in range({BIG * BK // (TILE * TILE)}):", f"            l = tid + {TILE * TILE} * q"] + place
        lines += [f"            if {edge} < {extent} and k0 + kk < depth:"]
        lines += [f"                l{prefix}{j} = {prefix}{j}[{at}]" for j in range(count)]
        lines += ["                " + b for b in block]
        lines += ["            else:", "                v = 0.0", f"            s{side}[nxt, kk, {edge} - base_{side}] = v"]
        return lines

    def _matmul_tiled_source(self, name, ta, tb, a_expr, b_expr, epilogue, patterns):
        lines = [
            _gemm_def(name, a_expr, b_expr, epilogue),
            f"    sa = cuda.shared.array((2, {BK}, {BIG}), FLOAT_T)",
            f"    sb = cuda.shared.array((2, {BK}, {BIG}), FLOAT_T)",   # its own line: the simulator keys shared arrays by line
            "    tx = cuda.threadIdx.x",
            "    ty = cuda.threadIdx.y",
            f"    tid = ty * {TILE} + tx",
            f"    base_a = cuda.blockIdx.y * {BIG}",
            f"    base_b = cuda.blockIdx.x * {BIG}",
            "    m = out.shape[0]",
            "    n = out.shape[1]",
            f"    depth = a0.shape[{0 if ta else 1}]",
            f"    slices = (depth + {BK - 1}) // {BK}"]
        lines += [f"    c{i}{j} = 0.0" for i in range(PER) for j in range(PER)]
        load = (["    for t in range(slices + 1):", f"        k0 = t * {BK}", "        nxt = t % 2",
                 "        if t < slices:   # the next slice, into the buffer nobody reads now"]
                + ["    " + x for x in self._tiled_load(a_expr, "a", ta, "a")]
                + ["    " + x for x in self._tiled_load(b_expr, "b", tb, "b")])
        lines += load
        lines += ["        if t > 0:   # this slice, loaded in the step before", "            cur = (t - 1) % 2",
                  f"            for kk in range({BK}):"]
        lines += [f"                x{i} = sa[cur, kk, ty + {TILE * i}]" for i in range(PER)]
        lines += [f"                y{j} = sb[cur, kk, tx + {TILE * j}]" for j in range(PER)]
        lines += [f"                c{i}{j} += x{i} * y{j}" for i in range(PER) for j in range(PER)]
        lines.append("        cuda.syncthreads()")
        # the store: thread (ty, tx) owns rows ty + 16 i and columns tx + 16 j of the block tile
        store = self._epilogue_store(epilogue, patterns)
        for i in range(PER):
            lines += [f"    row = base_a + ty + {TILE * i}", "    if row < m:"]
            for j in range(PER):
                lines += [f"        col = base_b + tx + {TILE * j}", "        if col < n:", f"            acc = c{i}{j}"]
                lines += ["            " + x for x in store]
        doc = (f"out = {epilogue} with x0 = A @ B, A = {a_expr}{'^T' if ta else ''}, B = {b_expr}{'^T' if tb else ''} "
               f"({BIG}x{BIG} block tiles, {PER}x{PER} per thread in registers, {BK}-deep slices double-buffered)")
        return "\n".join(lines), doc, ("big_tiles", -1)

    # ---- optimizer updates ----------------------------------------------------------------
    # They read the loss and the gradient's squared norm from device memory and the
    # hyperparameters from a small device array the Trainer refreshes before each step, so one
    # captured CUDA graph serves every step. status = (loss, |g|^2, values the update would make
    # non-finite): a one-block check counts the last before the update runs, and a step with any
    # of them not finite or non-zero changes nothing.
    OPTIMIZERS = {   # args, hyper names, the update of element i, the values it writes
        "sgd": ("p, v, g", ("lr", "momentum", "clip"),
                ["vi = momentum * v[i] + scale * g[i]", "pi = p[i] - lr * vi"], {"v": "vi", "p": "pi"}),
        "adam": ("p, m, v, g", ("lr", "beta1", "beta2", "eps", "bias1", "bias2", "clip"),
                 ["gi = scale * g[i]", "mi = beta1 * m[i] + (1.0 - beta1) * gi",
                  "vi = beta2 * v[i] + (1.0 - beta2) * gi * gi",
                  "pi = p[i] - (lr / bias1) * mi / (math.sqrt(vi) / math.sqrt(bias2) + eps)"],
                 {"m": "mi", "v": "vi", "p": "pi"}),
    }
    DOCS = {"sgd": "SGD with momentum (PyTorch's)", "adam": "Adam with bias correction (PyTorch's)"}

    @staticmethod
    def _step_scale(indent):
        return [f"{indent}scale = clip / (math.sqrt(status[1]) + 1e-6)   # clip_grad_norm_'s coefficient, at most 1",
                f"{indent}if not scale < 1.0:", f"{indent}    scale = 1.0"]

    def optimizer_update(self, optimizer):
        """One thread per element: the update, unless status says the step is refused."""
        args, hyper, update, writes = self.OPTIMIZERS[optimizer]
        return self._get((optimizer,), optimizer, lambda name: ("\n".join([
            f"def {name}({args}, hyper, status):",
            *[f"    {h} = hyper[{k}]" for k, h in enumerate(hyper)],
            "    i = cuda.grid(1)",
            "    if i >= p.size:",
            "        return",
            "    if not (math.isfinite(status[0]) and math.isfinite(status[1])) or status[2] != 0.0:",
            "        return",
            *self._step_scale("    "), *["    " + line for line in update],
            *[f"    {array}[i] = {value}" for array, value in writes.items()]]), self.DOCS[optimizer], ("flat", 0)))

    def optimizer_check(self, optimizer):
        """status[2] = how many values the update would make non-finite (one block)."""
        args, hyper, update, writes = self.OPTIMIZERS[optimizer]
        finite = " and ".join(f"math.isfinite({value})" for value in writes.values())
        return self._get((optimizer, "check"), f"{optimizer}_check", lambda name: ("\n".join([
            f"def {name}({args}, hyper, status):",
            *[f"    {h} = hyper[{k}]" for k, h in enumerate(hyper)], *self._step_scale("    "), "    x0 = p",
            *block_sum(["i = j", *update, f"if not ({finite}):", "    acc += 1.0"]),
            "    if t == 0:", "        status[2] = partial[0]"]),
            f"status[2] = values the {optimizer} update would make non-finite", ("block",)))

    def sum_squares(self):
        """out[0] = sum of x*x over a flat array, in one block (float64 partial sums in shared memory)."""
        return self._get(("sum_squares",), "sum_squares", lambda name: ("\n".join([
            f"def {name}(x0, out):", *block_sum(["xi = float64(x0[j])", "acc += xi * xi"]),
            "    if t == 0:", "        out[0] = partial[0]"]), "out[0] = sum(x * x)", ("block",)))

    def axpy(self):
        """out += a x over flat arrays, a a number the host passes (microbatch gradients adding up)."""
        return self._get(("axpy",), "axpy", lambda name: ("\n".join([
            f"def {name}(x0, a, out):", "    i = cuda.grid(1)", "    if i < out.size:", "        out[i] += a * x0[i]"]),
            "out += a * x0 (flat arrays)", ("flat", -1)))

    # ---- copies ---------------------------------------------------------------------------
    def fill(self):
        """out[...] = value (a number the host passes)."""
        return self._get(("fill",), "fill", lambda name: ("\n".join([
            f"def {name}(out, value):", "    i = cuda.grid(1)", "    if i < out.size:", "        out[i] = value"]),
            "out = value (a flat array)", ("flat", 0)))
