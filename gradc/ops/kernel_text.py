"""Source-text pieces the ops' kernels are written from (each record's lowering assembles its own).

CPU kernels loop over an array's dims (`loops`); CUDA kernels run one thread per element or per
kept index (`unravel`), or one block that folds every element (`block_sum`).
"""
from gradc.runtime.cuda import THREADS


def index(names, empty=""):
    """`i0, i1` for an index expression; `empty` when there are no dims (CUDA wants "0")."""
    return ", ".join(names) if names else empty


def loops(dims, body, indent=1):
    """Nested loops `for i{d} in range(n{d})` around body lines (CPU)."""
    lines, pad = [], "    " * indent
    for depth, d in enumerate(dims):
        lines.append(f"{pad}{'    ' * depth}for i{d} in range(n{d}):")
    inner = pad + "    " * len(dims)
    return lines + [inner + b for b in body]


def dims_line(array, rank):
    """`n0, n1 = array.shape` (CPU); nothing for a scalar."""
    if rank == 0:
        return []
    names = [f"n{d}" for d in range(rank)]
    return [f"    {', '.join(names)}{',' if rank == 1 else ''} = {array}.shape"]


def unravel_dims(dims, flat="i", shape="out.shape", pad="    "):
    """Lines that turn flat index `flat` into i{d} for the listed dims of `shape` (C order; CUDA)."""
    dims = list(dims)
    lines = [f"{pad}r = {flat}"]
    for d in reversed(dims):
        lines.append(f"{pad}i{d} = r % {shape}[{d}]")
        if d != dims[0]:
            lines.append(f"{pad}r //= {shape}[{d}]")
    return lines


def unravel(rank, flat="i", shape="out.shape", pad="    "):
    """Lines that turn a flat index into i0..i{rank-1} over `shape` (C order; CUDA)."""
    return unravel_dims(range(rank), flat, shape, pad)


def kept_index(kept, count_of="x0"):
    """CUDA: one thread per index over the `kept` dims of `count_of`; i{d} for each of them."""
    return ["    i = cuda.grid(1)", f"    count = {' * '.join(f'{count_of}.shape[{d}]' for d in kept) or '1'}",
            "    if i >= count:", "        return", *unravel_dims(kept, "i", f"{count_of}.shape")]


# CUDA: one thread per row i of x0
ROW_HEADER = ["    i = cuda.grid(1)", "    if i >= x0.shape[0]:", "        return"]


def block_sum(body, start="0.0", combine=None):
    """Lines of a one-block reduction over every element j of x0 (a power of two threads, at most
    THREADS: each a strided partial, then a tree in shared memory); the result is left in
    partial[0]. `body`: the loop's lines (unindented) that read element j and fold it into acc."""
    combine = combine or ["            partial[t] += partial[t + step]"]
    return [f"    partial = cuda.shared.array({THREADS}, float64)",
            "    t = cuda.threadIdx.x",
            f"    acc = {start}",
            "    for j in range(t, x0.size, cuda.blockDim.x):", *["        " + line for line in body],
            "    partial[t] = acc",
            "    cuda.syncthreads()",
            "    step = cuda.blockDim.x // 2",
            "    while step > 0:",
            "        if t < step:", *combine,
            "        cuda.syncthreads()",
            "        step //= 2"]


def row_max(pad):
    """For row i of x0 (N, C): its max m (NaN wins)."""
    return [pad + line for line in [
        "m = -math.inf",
        "for c in range(x0.shape[1]):",
        "    v = x0[i, c]",
        "    if v > m or v != v:",
        "        m = v"]]


def row_max_and_sum_exp(pad):
    """For row i of x0 (N, C): its max m (NaN wins) and total = sum_c exp(x0[i, c] - m)."""
    return row_max(pad) + [pad + line for line in [
        "total = 0.0",
        "for c in range(x0.shape[1]):",
        "    total += math.exp(x0[i, c] - m)"]]


def row_max_and_exp_into_out(pad):
    """For row i of x0 (N, C): its max m (NaN wins), out[i, c] = exp(x0[i, c] - m), their sum total,
    its label, and picked, the label's exp unrounded (CPU: one exp per element, where recomputing them in the next
    loop doubled a row's cost)."""
    return row_max(pad) + [pad + line for line in [
        "total = 0.0",
        "picked = 0.0",
        "label = labels[i]",
        "for c in range(x0.shape[1]):",
        "    e = math.exp(x0[i, c] - m)",
        "    out[i, c] = e",
        "    total += e",
        "    if c == label:",
        "        picked = e"]]


def xent_grad_row_from_out(pad):
    """out[i] = (softmax(x0[i]) - onehot(labels[i])) * g[i], after row_max_and_exp_into_out. The
    label's entry is made from its unrounded exp: p - 1 cancels when p nears 1, and the exp rounded
    into a float32 out would leave it with an error of a float32 ulp of 1."""
    return [pad + line for line in [
        "scale = g[i] / total",
        "for c in range(x0.shape[1]):",
        "    out[i, c] = out[i, c] * scale",
        "if 0 <= label < x0.shape[1]:   # never a wild write",
        "    out[i, label] = picked * scale - g[i]"]]


def xent_grad_row(pad):
    """out[i] = (softmax(x0[i]) - onehot(labels[i])) * g[i], after row_max_and_sum_exp."""
    return [pad + line for line in [
        "scale = g[i] / total",
        "for c in range(x0.shape[1]):",
        "    out[i, c] = math.exp(x0[i, c] - m) * scale - (g[i] if c == labels[i] else 0.0)"]]
