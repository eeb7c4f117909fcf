"""2-D max and average pooling in NCHW, with PyTorch's arithmetic (floor mode).

    max_pool2d(x)              the max of each window; padding never wins (it is -inf)
    max_pool2d_grad(x, g)      max_pool2d's adjoint: g[window] added at the window's first maximum of x
    max_pool2d_pick(x, u)      u at each window's first maximum of x (max_pool2d(x) = max_pool2d_pick(x, x))
    avg_pool2d(x)              the window's sum / (kh kw); padding counts as zeros (count_include_pad)
    avg_pool2d_grad(g)         avg_pool2d's adjoint: g / (kh kw) spread over each window

The max-pool backward reads the pool's input x (which the layer before keeps anyway: a ReLU's
output), not a saved mask or index array, so training keeps one value per layer. Its adjoint in g
is max_pool2d_pick and the other way round; in x both are piecewise constant (derivative zero),
so hvp and hessian go through pools with the same rules. avg_pool2d and its grad are each
other's adjoints.

attrs (pairs): kernel, stride, padding; the grads also take input_hw (H, W). "First" is the
window's row-major order, as PyTorch scans it.
"""
import numpy as np

from . import Op, register
from .batched import per_image
from ..errors import ShapeError
from ..shapes import bind_dims, fmt, size
from .conv import check_float, check_nchw, out_len
from ..runtime import conv_cores


def _attrs(attrs):
    return tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs["padding"])


def pool_out_hw(op, hw, kernel, stride, padding):
    if min(kernel) < 1 or min(stride) < 1 or min(padding) < 0:
        raise ShapeError(f"kernel_size {kernel}, stride {stride} and padding {padding}: sizes and strides must be "
                         f">= 1, padding >= 0")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise ShapeError(f"padding {padding} must be at most half of kernel_size {kernel}")
    out = tuple(out_len(n, k, s, p, 1) for n, k, s, p in zip(hw, kernel, stride, padding))
    if min(out) < 1:
        raise ShapeError(f"kernel_size {kernel} is larger than the padded input "
                         f"{hw[0] + 2 * padding[0]}x{hw[1] + 2 * padding[1]}")
    return out


def _pool_infer(op):
    def infer(attrs, shapes, dtypes):
        check_float(op, dtypes)
        (x,) = shapes
        check_nchw("the input", x)
        return tuple(x[:2]) + pool_out_hw(op, x[2:], *_attrs(attrs)), dtypes[0]
    return infer


def _grad_infer(op, first):
    """Ops whose operands are (x, g) [first=x] or (g,) [first=None]: out has x's shape (N, C) + input_hw."""
    def infer(attrs, shapes, dtypes):
        check_float(op, dtypes)
        g = shapes[-1]
        check_nchw("the output adjoint", g)
        h, w = attrs["input_hw"]
        out = tuple(g[:2]) + (h, w)
        if first is not None:
            check_nchw("the input", shapes[0])
            if tuple(shapes[0]) != out:
                raise ShapeError(f"the input {fmt(shapes[0])} and the output adjoint {fmt(g)} do not match "
                                 f"input_hw {(h, w)}")
        expect = pool_out_hw(op, (h, w), *_attrs(attrs))
        if tuple(g[2:]) != expect:
            raise ShapeError(f"the output adjoint {fmt(g)} does not match pooling a {h}x{w} input "
                             f"(expected {expect[0]}x{expect[1]})")
        return out, dtypes[-1]
    return infer


def _pick_infer(attrs, shapes, dtypes):
    check_float("max_pool2d_pick", dtypes)
    x, u = shapes
    if tuple(x) != tuple(u):
        raise ShapeError(f"the values {fmt(u)} must have the input's shape {fmt(x)}")
    return _pool_infer("max_pool2d_pick")(attrs, [x], dtypes[:1])


# ---- numpy reference ------------------------------------------------------------------------------
def _windows(xp, kernel, stride, out_hw):
    """(N, C, Ho, Wo, kh * kw) view of the windows of a padded input, taps in row-major order."""
    n, c, hp, wp = xp.shape
    s0, s1, s2, s3 = xp.strides
    view = np.lib.stride_tricks.as_strided(
        xp, (n, c) + tuple(out_hw) + tuple(kernel),
        (s0, s1, s2 * stride[0], s3 * stride[1], s2, s3), writeable=False)
    return view.reshape((n, c) + tuple(out_hw) + (kernel[0] * kernel[1],))


def _argmax_taps(x, kernel, stride, padding, out_hw):
    """Row and column, in padded coordinates, of each window's first maximum (padding is never chosen)."""
    ph, pw = padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    valid = np.pad(np.ones(x.shape[2:], bool), ((ph, ph), (pw, pw)))
    win = _windows(np.ascontiguousarray(xp), kernel, stride, out_hw)
    tap = np.argmax(win, axis=-1)
    # a window whose real values are all -inf: PyTorch keeps its first real element
    vwin = _windows(np.ascontiguousarray(np.broadcast_to(valid, xp.shape)), kernel, stride, out_hw)
    first_valid = np.argmax(vwin, axis=-1)
    stuck = np.take_along_axis(win, tap[..., None], -1)[..., 0] == -np.inf
    tap = np.where(stuck, first_valid, tap)
    ho = np.arange(out_hw[0])[:, None] * stride[0]
    wo = np.arange(out_hw[1])[None, :] * stride[1]
    return ho + tap // kernel[1], wo + tap % kernel[1]


def max_pool2d_np(x, kernel, stride, padding):
    out_hw = tuple(out_len(x.shape[2 + a], kernel[a], stride[a], padding[a], 1) for a in (0, 1))
    ph, pw = padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    return _windows(np.ascontiguousarray(xp), kernel, stride, out_hw).max(axis=-1)


def max_pool2d_pick_np(x, u, kernel, stride, padding):
    out_hw = tuple(out_len(x.shape[2 + a], kernel[a], stride[a], padding[a], 1) for a in (0, 1))
    rows, cols = _argmax_taps(x, kernel, stride, padding, out_hw)
    ph, pw = padding
    up = np.pad(u, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    n, c = x.shape[:2]
    return up[np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], rows, cols]


def max_pool2d_grad_np(x, g, kernel, stride, padding):
    rows, cols = _argmax_taps(x, kernel, stride, padding, g.shape[2:])
    ph, pw = padding
    n, c, h, w = x.shape
    out = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=g.dtype)
    np.add.at(out, (np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], rows, cols), g)
    return out[..., ph:ph + h, pw:pw + w]


def avg_pool2d_np(x, kernel, stride, padding):
    out_hw = tuple(out_len(x.shape[2 + a], kernel[a], stride[a], padding[a], 1) for a in (0, 1))
    ph, pw = padding
    xp = np.ascontiguousarray(np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))))
    return _windows(xp, kernel, stride, out_hw).sum(axis=-1) / (kernel[0] * kernel[1])


def avg_pool2d_grad_np(g, kernel, stride, padding, input_hw):
    (ph, pw), (h, w) = padding, input_hw
    out = np.zeros(g.shape[:2] + (h + 2 * ph, w + 2 * pw), dtype=g.dtype)
    ho, wo = g.shape[2:]
    scaled = g / (kernel[0] * kernel[1])
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            out[..., i:i + stride[0] * (ho - 1) + 1:stride[0], j:j + stride[1] * (wo - 1) + 1:stride[1]] += scaled
    return out[..., ph:ph + h, pw:pw + w]


# ---- VJPs -----------------------------------------------------------------------------------------
def _pool_attrs(ctx, n, with_hw=None):
    a = ctx.graph.attrs(n)
    out = {k: a[k] for k in ("kernel", "stride", "padding")}
    if with_hw is not None:
        out["input_hw"] = tuple(ctx.graph.shape(with_hw)[2:])
    return out


def _max_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    return [ctx.emit("max_pool2d_grad", [x, g], **_pool_attrs(ctx, n, x))]


def _max_grad_vjp(ctx, n, u):
    """Linear in g (a scatter at fixed places), piecewise constant in x."""
    x, _ = ctx.graph.operands(n)
    return [None, ctx.emit("max_pool2d_pick", [x, u], **_pool_attrs(ctx, n)) if ctx.needs(1) else None]


def _max_pick_vjp(ctx, n, g):
    x, _ = ctx.graph.operands(n)
    return [None, ctx.emit("max_pool2d_grad", [x, g], **_pool_attrs(ctx, n, x)) if ctx.needs(1) else None]


def _avg_vjp(ctx, n, g):
    (x,) = ctx.graph.operands(n)
    return [ctx.emit("avg_pool2d_grad", [g], **_pool_attrs(ctx, n, x))]


def _avg_grad_vjp(ctx, n, u):
    return [ctx.emit("avg_pool2d", [u], **_pool_attrs(ctx, n))]


def _window_flops(attrs, in_shapes, out_shape):
    """One compare or add per tap of every window."""
    kernel = tuple(attrs["kernel"])
    windows = out_shape if "input_hw" not in attrs else in_shapes[-1]
    return size(windows) * kernel[0] * kernel[1]


# ---- lowering ---------------------------------------------------------------------------------------
# Direct loops, one kernel per op per module (kernel, stride, padding are arguments). A window is clipped
# to the input, so padding is never read: a max over the clipped window is the max with -inf padding,
# and an average over it divided by kh kw counts the padding as zeros. The first maximum of a window in
# row-major order wins (a NaN wins over numbers, the first NaN over later ones), in every kernel alike,
# so the backward sends each gradient where the forward took its value. On the CPU the loops run over
# the images and channels outside and the window inside; on CUDA one thread computes one output
# element (the grads: one input element, gathering the windows that hold it; no atomics).
_ARGS = "kh, kw, sh, sw, ph, pw"

_CPU_WINDOWS = [
    "    for b in range({src}.shape[0]):",
    "        for c in range({src}.shape[1]):",
    "            for ho in range({win}.shape[2]):",
    "                h0 = ho * sh - ph",
    "                i_lo, i_hi = max(0, -h0), min(kh, {full}.shape[2] - h0)",
    "                for wo in range({win}.shape[3]):",
    "                    w0 = wo * sw - pw",
    "                    j_lo, j_hi = max(0, -w0), min(kw, {full}.shape[3] - w0)",
]


def _cpu_argmax(pad):
    """bi, bj: the window's first maximum of xc = x[b, c] (NaN wins), inside the clipped window. A window
    inside the input (nearly every one) takes loops of kh x kw fixed in the text, which unroll: the
    max-pool kernels run about 1.6x as fast so."""
    def search(i_lo, i_hi, j_lo, j_hi):
        first = "xc[h0, w0]" if (i_lo, j_lo) == (0, 0) else f"xc[h0 + {i_lo}, w0 + {j_lo}]"
        return [f"m = {first}",
                f"bi, bj = {i_lo}, {j_lo}",
                f"for i in range({i_hi if i_lo == 0 else f'{i_lo}, {i_hi}'}):",
                f"    for j in range({j_hi if j_lo == 0 else f'{j_lo}, {j_hi}'}):",
                "        v = xc[h0 + i, w0 + j]",
                "        take = (v > m) | ((v != v) & (m == m))   # no branch: a random window's order is unpredictable",
                "        m = v if take else m",
                "        bi = i if take else bi",
                "        bj = j if take else bj"]
    return [pad + line for line in ["if i_lo == 0 and i_hi == kh and j_lo == 0 and j_hi == kw:",
                                    *("    " + t for t in search(0, "kh", 0, "kw")),
                                    "else:",
                                    *("    " + t for t in search("i_lo", "i_hi", "j_lo", "j_hi"))]]


def _cpu_max_windows(win, planes):
    """_CPU_WINDOWS of a max-pool kernel, with 2-D views of this image and channel: xc, and `planes`
    (name -> array) beside it."""
    lines = [line.format(src="out", win=win, full="x") for line in _CPU_WINDOWS]
    views = [f"            {v} = {a}[b, c]" for v, a in {"xc": "x", **planes}.items()]
    return lines[:2] + views + lines[2:]


PAD = " " * 20


def _cpu_def(name, operands, window):
    """The def line; with `window` (kh, kw, sh, sw, ph, pw) the six ints are written in, not arguments."""
    if window is None:
        return [f"def {name}({operands}, {_ARGS}, out):"]
    return [f"def {name}({operands}, out):", f"    {_ARGS} = {', '.join(map(str, window))}   # this pool's window"]


INSIDE_MAX_TAPS = 16   # a max pool with a window of at most this many taps reads inner windows row by row


def _inside_rows_max(kh, kw):
    """A max pool's row of windows that lie inside the input (columns wa..wb-1), read through one 1-D
    view per window row starting at the first window's column: loops from zero over contiguous views,
    which Numba vectorises (LeNet's 2x2 pools: 3x faster than window by window), in the same row-major
    order and with the same NaN rule as _cpu_argmax."""
    lines = [f"r{i} = xc[h0{f' + {i}' if i else ''}, left:]" for i in range(kh)] + ["orow = oc[ho, wa:wb]",
                                                                "for k in range(wb - wa):",
                                                                "    w0 = k * sw",
                                                                "    m = r0[w0]"]
    for i in range(kh):
        for j in range(kw):
            if i or j:
                lines += [f"    v = r{i}[w0 + {j}]" if j else f"    v = r{i}[w0]",
                          "    m = v if (v > m) | ((v != v) & (m == m)) else m"]
    return lines + ["    orow[k] = m"]


def _inside_range(lo, hi, axis, note):
    """Lines setting lo..hi-1: the windows along `axis` (2: rows, 3: columns) that lie inside the input."""
    n, k, st, p = {2: ("h_out", "kh", "sh", "ph"), 3: ("w_out", "kw", "sw", "pw")}[axis]
    return [f"    {lo} = min({n}, ({p} + {st} - 1) // {st})   # {note}",
            f"    {hi} = max({lo}, min({n}, (x.shape[{axis}] + {p} - {k}) // {st} + 1))"]


def _clipped_window(store):
    """Window (ho, wo) of a row whose i_lo, i_hi are set, clipped to the input's columns: its first
    maximum m at (bi, bj), then `store`."""
    return ["w0 = wo * sw - pw", "j_lo, j_hi = max(0, -w0), min(kw, x.shape[3] - w0)",
            *(line[len(PAD):] for line in _cpu_argmax(PAD)), store]


def cpu_max_pool_source(name, window=None):
    lines = _cpu_def(name, "x", window)
    if window is None or window[0] * window[1] > INSIDE_MAX_TAPS:
        lines += _cpu_max_windows("out", {"oc": "out"}) + _cpu_argmax(PAD) + [PAD + "oc[ho, wo] = m"]
        return "\n".join(lines), "max over each window (clipped to the input: padding never wins)"
    lines += ["    h_out, w_out = out.shape[2], out.shape[3]",
              *_inside_range("wa", "wb", 3, "the windows wa..wb-1 lie inside the input's columns"),
              "    left = wa * sw - pw",
              "    for b in range(out.shape[0]):",
              "        for c in range(out.shape[1]):",
              "            xc, oc = x[b, c], out[b, c]",
              "            for ho in range(h_out):",
              "                h0 = ho * sh - ph",
              "                i_lo, i_hi = max(0, -h0), min(kh, x.shape[2] - h0)",
              "                inside = i_lo == 0 and i_hi == kh",
              "                if inside:",
              *("                    " + line for line in _inside_rows_max(window[0], window[1])),
              "                skip = wb - wa if inside else 0",
              "                for e in range(w_out - skip):   # the other windows, clipped",
              "                    wo = e if e < wa else e + skip",
              *("                    " + line for line in _clipped_window("oc[ho, wo] = m"))]
    return "\n".join(lines), "max over each window (clipped to the input: padding never wins)"


def cpu_max_pick_source(name, window=None):
    lines = _cpu_def(name, "x, u", window) + _cpu_max_windows("out", {"uc": "u", "oc": "out"})
    lines += _cpu_argmax(PAD) + [PAD + "oc[ho, wo] = uc[h0 + bi, w0 + bj]"]
    return "\n".join(lines), "u at each window's first maximum of x"


def _inside_rows_grad(kh, kw):
    """A max pool's gradient over a row of windows that lie inside the input and do not overlap (stride =
    kernel), through 1-D views: each window's max m, then each input in row-major order gets g if it is
    the first to equal m (with a NaN in the window: the first NaN), else 0. Bitwise masks and selects
    (no branch, no chain of indices) and the stores side by side at the end: so Numba vectorises it
    (LeNet's pools, one core: about 1.5x as fast as the window-by-window gradient, which zeroes the
    output and adds g at each argmax)."""
    taps = [(i, j) for i in range(kh) for j in range(kw)]
    names = [f"a{i}_{j}" for i, j in taps]
    lines = [f"r{i} = xc[h0{f' + {i}' if i else ''}]" for i in range(kh)]
    lines += [f"o{i} = oc[h0{f' + {i}' if i else ''}]" for i in range(kh)]
    lines += ["grow = gc[ho]", "for wo in range(wa, wb):", "    w0 = wo * sw - pw"]
    lines += [f"    {a} = r{i}[w0{f' + {j}' if j else ''}]" for (i, j), a in zip(taps, names)]
    lines.append(f"    m = {names[0]}")
    lines += [f"    m = max(m, {a})" for a in names[1:]]
    lines += ["    nan = " + " | ".join(f"({a} != {a})" for a in names), "    number = nan == False", "    gv = grow[wo]"]
    # first{n}: input n is the window's first maximum; taken{n}: one of inputs 0..n is
    for n, a in enumerate(names):
        hit = f"((({a} != {a}) & nan) | (({a} == m) & number))"
        if n == 0:
            lines += [f"    first0 = {hit}", "    taken0 = first0"]
        elif n < len(names) - 1:
            lines += [f"    first{n} = {hit} & ~taken{n - 1}", f"    taken{n} = taken{n - 1} | first{n}"]
        else:   # the last: the winner when no earlier input is
            lines.append(f"    first{n} = ~taken{n - 1}")
    # the stores last, side by side (stores among the selects keep Numba from vectorising the loop)
    lines += [f"    o{i}[w0{f' + {j}' if j else ''}] = gv if first{n} else zero" for n, (i, j) in enumerate(taps)]
    return lines


def cpu_max_grad_source(name, window=None):
    doc = "g of each window added at the window's first maximum of x"
    if window is None or window[0] * window[1] > INSIDE_MAX_TAPS or window[2:4] != window[0:2]:
        lines = _cpu_def(name, "x, g", window) + ["    out[:] = 0.0"] + _cpu_max_windows("g", {"gc": "g", "oc": "out"})
        lines += _cpu_argmax(PAD) + [PAD + "oc[h0 + bi, w0 + bj] += gc[ho, wo]"]
        return "\n".join(lines), doc
    # windows that do not overlap: those inside the input are written whole, rows ha..hb-1 and columns
    # wa..wb-1 of them; the clipped ones at the edges add into the zeroed output as above
    pad, clipped = " " * 20, _clipped_window("oc[h0 + bi, w0 + bj] += gc[ho, wo]")
    lines = _cpu_def(name, "x, g", window) + [
        "    h_out, w_out = g.shape[2], g.shape[3]",
        "    zero = np.zeros(1, out.dtype)[0]   # (a 0.0 literal would make the selects float64)",
        "    if not (ph == 0 and pw == 0 and x.shape[2] == h_out * kh and x.shape[3] == w_out * kw):",
        "        out[:] = 0.0   # inputs no window holds, and the clipped windows' adds",
        *_inside_range("ha", "hb", 2, "the windows ha..hb-1 lie inside the input's rows"),
        *_inside_range("wa", "wb", 3, "wa..wb-1 inside its columns"),
        "    for b in range(g.shape[0]):",
        "        for c in range(g.shape[1]):",
        "            xc, gc, oc = x[b, c], g[b, c], out[b, c]",
        "            for ho in range(ha, hb):",
        "                h0 = ho * sh - ph",
        *(pad[4:] + line for line in _inside_rows_grad(window[0], window[1])),
        "            for ho in range(ha, hb):",
        "                h0 = ho * sh - ph",
        "                i_lo, i_hi = 0, kh",
        "                for e in range(w_out - (wb - wa)):   # these rows' clipped windows",
        "                    wo = e if e < wa else e + wb - wa",
        *(pad + line for line in clipped),
        "            for e in range(h_out - (hb - ha)):   # the rows of clipped windows",
        "                ho = e if e < ha else e + hb - ha",
        "                h0 = ho * sh - ph",
        "                i_lo, i_hi = max(0, -h0), min(kh, x.shape[2] - h0)",
        "                for wo in range(w_out):",
        *(pad + line for line in clipped)]
    return "\n".join(lines), doc


def cpu_avg_pool_source(name, window=None):
    lines = _cpu_def(name, "x", window) + ["    scale = 1.0 / (kh * kw)"]
    lines += [l.format(src="out", win="out", full="x") for l in _CPU_WINDOWS]
    lines += [PAD + line for line in ["acc = 0.0", "for i in range(i_lo, i_hi):", "    for j in range(j_lo, j_hi):",
                                      "        acc += x[b, c, h0 + i, w0 + j]", "out[b, c, ho, wo] = acc * scale"]]
    return "\n".join(lines), "the window's sum / (kh kw): padding counts as zeros"


def cpu_avg_grad_source(name, window=None):
    lines = _cpu_def(name, "g", window) + ["    scale = 1.0 / (kh * kw)", "    out[:] = 0.0"]
    lines += [l.format(src="out", win="g", full="out") for l in _CPU_WINDOWS]
    lines += [PAD + line for line in ["v = g[b, c, ho, wo] * scale", "for i in range(i_lo, i_hi):",
                                      "    for j in range(j_lo, j_hi):", "        out[b, c, h0 + i, w0 + j] += v"]]
    return "\n".join(lines), "g / (kh kw) added over each window"


def _cuda_window(out_var="out"):
    from .kernel_text import unravel
    return ["    i = cuda.grid(1)", f"    if i >= {out_var}.size:", "        return", *unravel(4),
            "    h0 = i2 * sh - ph", "    w0 = i3 * sw - pw",
            "    i_lo, i_hi = max(0, -h0), min(kh, x.shape[2] - h0)",
            "    j_lo, j_hi = max(0, -w0), min(kw, x.shape[3] - w0)"]


def _cuda_argmax(pad, b="i0", c="i1"):
    return [pad + line for line in [
        f"m = x[{b}, {c}, h0 + i_lo, w0 + j_lo]",
        "bi, bj = i_lo, j_lo",
        "for p in range(i_lo, i_hi):",
        "    for q in range(j_lo, j_hi):",
        f"        v = x[{b}, {c}, h0 + p, w0 + q]",
        "        if v > m or (v != v and m == m):",
        "            m = v",
        "            bi, bj = p, q"]]


def cuda_max_pool_source(name):
    return "\n".join([f"def {name}(x, {_ARGS}, out):", *_cuda_window(), *_cuda_argmax("    "),
                      "    out[i0, i1, i2, i3] = m"]), "max over each window: one thread per output", ("flat", -1)


def cuda_max_pick_source(name):
    return "\n".join([f"def {name}(x, u, {_ARGS}, out):", *_cuda_window(), *_cuda_argmax("    "),
                      "    out[i0, i1, i2, i3] = u[i0, i1, h0 + bi, w0 + bj]"]), \
        "u at each window's first maximum of x: one thread per output", ("flat", -1)


def _cuda_windows_holding(body):
    """One thread per input element (i0, i1, i2, i3); body runs for every window (ho, wo) that holds it."""
    from .kernel_text import unravel
    return ["    i = cuda.grid(1)", "    if i >= out.size:", "        return", *unravel(4), "    acc = 0.0",
            "    ho_lo = max(0, (i2 + ph - kh + sh) // sh)", "    ho_hi = min(g.shape[2], (i2 + ph) // sh + 1)",
            "    wo_lo = max(0, (i3 + pw - kw + sw) // sw)", "    wo_hi = min(g.shape[3], (i3 + pw) // sw + 1)",
            "    for ho in range(ho_lo, ho_hi):", "        for wo in range(wo_lo, wo_hi):",
            *["            " + line for line in body], "    out[i0, i1, i2, i3] = acc"]


def cuda_max_grad_source(name):
    body = ["h0 = ho * sh - ph", "w0 = wo * sw - pw",
            "i_lo, i_hi = max(0, -h0), min(kh, x.shape[2] - h0)",
            "j_lo, j_hi = max(0, -w0), min(kw, x.shape[3] - w0)",
            *_cuda_argmax(""),
            "if h0 + bi == i2 and w0 + bj == i3:", "    acc += g[i0, i1, ho, wo]"]
    return "\n".join([f"def {name}(x, g, {_ARGS}, out):", *_cuda_windows_holding(body)]), \
        "the g of every window whose first maximum is this element: one thread per input element", ("flat", -1)


def cuda_avg_pool_source(name):
    return "\n".join([f"def {name}(x, {_ARGS}, out):", *_cuda_window(), "    acc = 0.0",
                      "    for p in range(i_lo, i_hi):", "        for q in range(j_lo, j_hi):",
                      "            acc += x[i0, i1, h0 + p, w0 + q]",
                      "    out[i0, i1, i2, i3] = acc / (kh * kw)"]), \
        "the window's sum / (kh kw): one thread per output", ("flat", -1)


def cuda_avg_grad_source(name):
    return "\n".join([f"def {name}(g, {_ARGS}, out):", *_cuda_windows_holding(["acc += g[i0, i1, ho, wo]"])]
                     ).replace("    out[i0, i1, i2, i3] = acc", "    out[i0, i1, i2, i3] = acc / (kh * kw)"), \
        "the sum of g over the windows that hold this element / (kh kw): one thread per input element", ("flat", -1)


def _lower_cpu(hint, make, on_cores=False):
    """CPU: one kernel per window (kernel, stride, padding), those six ints written into its text: the
    window loops then have constant trip counts that Numba unrolls (LeNet's 2x2 pools: about 1.4x
    faster than with them as arguments), and a module has one kernel per distinct pool, a handful.
    on_cores (the gradients, which scatter into a zeroed output: about 1.6 ns an element against the
    forward's 0.3): a plain entry runs it over parts of the batch at once, as a conv (images_on_cores,
    gradc/runtime/conv_cores.py; LeNet's two max-pool gradients: 0.55 ms against 0.67 on 2 cores); a
    compiled function calls it directly."""
    def lower(s):
        window = tuple(int(v) for v in (*s.attrs["kernel"], *s.attrs["stride"], *s.attrs["padding"]))
        kernel = s.kernel((hint, window), hint, lambda name: make(name, window))
        if not (on_cores and s.split_batch):
            return s.into_out(kernel)
        return [s.alloc(), f"images_on_cores({kernel}, {', '.join(list(s.args) + [s.out])}, most={conv_cores.cores()}){s.note}"]
    return lower


def _lower(hint, make):
    """CUDA: one kernel per op, the window as arguments."""
    def lower(s):
        ints = [*s.attrs["kernel"], *s.attrs["stride"], *s.attrs["padding"]]
        return s.into_out(s.kernel((hint,), hint, make), list(s.args) + [str(int(v)) for v in ints])
    return lower


def _image_work(graph, n, dims):
    """part_work of a pool's gradient: its largest array's elements in one image, at what an element
    costs it in conv flops (conv_cores.images_on_cores)."""
    shapes = [graph.shape(u) for u in graph.operands(n)] + [graph.shape(n)]
    counts = [size(bind_dims(s, dims)[1:]) for s in shapes]
    if any(not isinstance(c, int) for c in counts):
        return None
    return conv_cores.POOL_ELEMENT_FLOPS * max(counts)


def _rows_per_image(graph, n, ins, fail):
    """Image b of the output reads image b of every operand."""
    if all(w in (0, None) for w in ins) and 0 in ins:
        return 0
    fail("pools across rows")


register(Op("max_pool2d", "pool", _pool_infer("max_pool2d"),
            lambda attrs, values, out_shape, dims: max_pool2d_np(values[0], *_attrs(attrs)),
            _window_flops, vjp=_max_vjp, arity=1, rows=_rows_per_image, parts="rows", batched=per_image,
            cpu=_lower_cpu("max_pool2d", cpu_max_pool_source), cuda=_lower("max_pool2d", cuda_max_pool_source),
            doc="max over each kernel window (padding is -inf); attrs kernel, stride, padding (pairs)"))
register(Op("max_pool2d_grad", "pool", _grad_infer("max_pool2d_grad", first=0),
            lambda attrs, values, out_shape, dims: max_pool2d_grad_np(*values, *_attrs(attrs)),
            _window_flops, vjp=_max_grad_vjp, arity=2, rows=_rows_per_image, parts="rows", part_work=_image_work,
            cpu=_lower_cpu("max_pool2d_grad", cpu_max_grad_source, on_cores=True), cuda=_lower("max_pool2d_grad", cuda_max_grad_source),
            doc="max_pool2d's adjoint: g of each window added at the window's first maximum of x; attrs as "
                "max_pool2d's plus input_hw"))
register(Op("max_pool2d_pick", "pool", _pick_infer,
            lambda attrs, values, out_shape, dims: max_pool2d_pick_np(*values, *_attrs(attrs)),
            _window_flops, vjp=_max_pick_vjp, arity=2, rows=_rows_per_image, parts="rows",
            cpu=_lower_cpu("max_pool2d_pick", cpu_max_pick_source), cuda=_lower("max_pool2d_pick", cuda_max_pick_source),
            doc="u at each window's first maximum of x: max_pool2d_grad's adjoint in g"))
register(Op("avg_pool2d", "pool", _pool_infer("avg_pool2d"),
            lambda attrs, values, out_shape, dims: avg_pool2d_np(values[0], *_attrs(attrs)),
            _window_flops, vjp=_avg_vjp, arity=1, rows=_rows_per_image, parts="rows", batched=per_image,
            cpu=_lower_cpu("avg_pool2d", cpu_avg_pool_source), cuda=_lower("avg_pool2d", cuda_avg_pool_source),
            doc="mean over each kernel window, padding counted as zeros (divisor kh kw); attrs kernel, stride, padding"))
register(Op("avg_pool2d_grad", "pool", _grad_infer("avg_pool2d_grad", first=None),
            lambda attrs, values, out_shape, dims: avg_pool2d_grad_np(values[0], *_attrs(attrs),
                                                                      tuple(attrs["input_hw"])),
            _window_flops, vjp=_avg_grad_vjp, arity=1, rows=_rows_per_image, parts="rows", part_work=_image_work,
            cpu=_lower_cpu("avg_pool2d_grad", cpu_avg_grad_source, on_cores=True), cuda=_lower("avg_pool2d_grad", cuda_avg_grad_source),
            doc="avg_pool2d's adjoint: g / (kh kw) added over each window; attrs as avg_pool2d's plus input_hw"))
