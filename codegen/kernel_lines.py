"""Source lines the CPU and CUDA kernels share (each target wraps them in its own loop or grid)."""


def row_max_and_sum_exp(pad):
    """For row i of x0 (N, C): its max m (NaN wins) and total = sum_c exp(x0[i, c] - m)."""
    return [pad + line for line in [
        "m = -math.inf",
        "for c in range(x0.shape[1]):",
        "    v = x0[i, c]",
        "    if v > m or v != v:",
        "        m = v",
        "total = 0.0",
        "for c in range(x0.shape[1]):",
        "    total += math.exp(x0[i, c] - m)"]]


def xent_grad_row(pad):
    """out[i] = (softmax(x0[i]) - onehot(labels[i])) * g[i], after row_max_and_sum_exp."""
    return [pad + line for line in [
        "scale = g[i] / total",
        "for c in range(x0.shape[1]):",
        "    out[i, c] = math.exp(x0[i, c] - m) * scale - (g[i] if c == labels[i] else 0.0)"]]
