"""2-D convolution in NCHW, with PyTorch's arithmetic: conv2d and its two adjoints.

    y = conv2d(x, w)                 x (N, C, H, W), w (O, C/groups, kh, kw) -> (N, O, Ho, Wo)
    dx = conv2d_input_grad(g, w)     the transposed convolution: (N, O, Ho, Wo) -> (N, C, H, W)
    dw = conv2d_weight_grad(x, g)    the correlation of x with g: -> (O, C/groups, kh, kw)

with Ho = (H + 2 ph - dh (kh - 1) - 1) // sh + 1 (likewise Wo). All three are bilinear, and the
adjoint of each is one of the three, so backward graphs of convolutions are convolutions again
and differentiate once more (hvp, hessian) through the same rules:

    <u, conv2d_input_grad(g, w)>  = <conv2d(u, w), g>
    <u, conv2d_weight_grad(x, g)> = <conv2d(x, u), g>

attrs (ints or pairs normalised to pairs by the DSL): stride, padding, dilation, groups; the input
grad also takes input_hw (H, W: a strided convolution may not read the last rows, so H is not a
function of Ho), the weight grad kernel (kh, kw). The batch dim N may be symbolic; C, H, W are ints.
A bias is not part of the op: the DSL adds it as a broadcast (O, 1, 1) operand, which fuses into
the next elementwise kernel.
"""
import numpy as np

from . import Op, register
from .batched import per_image
from .conv_direct import (cpu_conv2d_direct_source, cpu_input_grad_direct_source, cpu_weight_grad_direct_source,
                          direct, kernel_block)
from .conv_direct import workspace_bytes as direct_workspace_bytes
from .conv_winograd import (cpu_conv2d_winograd_source, cpu_input_grad_winograd_source,
                            cpu_weight_grad_winograd_source, winograd, workspace_values as winograd_values)
from ..errors import ShapeError
from ..shapes import bind_dims, fmt, size
from ..runtime import conv_cores


def out_len(n, k, s, p, d):
    """Output length of a window of k taps, dilation d, stride s over n + 2p values (PyTorch's floor)."""
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def check_float(op, dtypes):
    for d in dtypes:
        if not d.startswith("float"):
            raise ShapeError(f"operand of dtype {d}: {op} takes float operands")


def check_nchw(what, shape, rest_int=True):
    """A rank-4 NCHW shape whose C, H, W are ints (N may be a symbolic dim)."""
    if len(shape) != 4:
        raise ShapeError(f"{what} must have rank 4 (N, C, H, W), got {fmt(shape)}")
    if rest_int and any(isinstance(d, str) for d in shape[1:]):
        raise ShapeError(f"{what} {fmt(shape)}: C, H and W must be ints (only the batch dim N may be symbolic)")


def _attrs(attrs):
    return (tuple(attrs["stride"]), tuple(attrs["padding"]), tuple(attrs.get("dilation", (1, 1))),
            int(attrs.get("groups", 1)))


def _out_hw(what, hw, kernel, stride, padding, dilation):
    out = tuple(out_len(n, k, s, p, d) for n, k, s, p, d in zip(hw, kernel, stride, padding, dilation))
    if min(out) < 1:
        span = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
        raise ShapeError(f"the {what} (effective size {span[0]}x{span[1]}) is larger than the padded input "
                         f"{hw[0] + 2 * padding[0]}x{hw[1] + 2 * padding[1]}")
    return out


def _check_weight(x_c, w, groups):
    """w (O, C/groups, kh, kw) against C input channels."""
    if len(w) != 4 or any(isinstance(d, str) for d in w):
        raise ShapeError(f"the weight must be (O, C/groups, kh, kw) with int dims, got {fmt(w)}")
    o, cg = w[0], w[1]
    if x_c % groups:
        raise ShapeError(f"{x_c} input channels do not divide into groups={groups}")
    if o % groups:
        raise ShapeError(f"{o} output channels (weight {fmt(w)}) do not divide into groups={groups}")
    if cg * groups != x_c:
        raise ShapeError(f"the weight {fmt(w)} takes {cg} channel{'s' * (cg != 1)}{' per group' * (groups != 1)}, "
                         "but the input has "
                         + (f"{x_c} channel{'s' * (x_c != 1)}" if groups == 1 else
                            f"{x_c} channels in {groups} groups ({x_c // groups} per group)"))
    if min(w) < 1:
        raise ShapeError(f"the weight {fmt(w)} has an empty dim")


def _conv_infer(attrs, shapes, dtypes):
    check_float("conv2d", dtypes)
    x, w = shapes
    check_nchw("the input", x)
    stride, padding, dilation, groups = _attrs(attrs)
    _check_weight(x[1], w, groups)
    ho, wo = _out_hw("kernel", x[2:], w[2:], stride, padding, dilation)
    return (x[0], w[0], ho, wo), dtypes[0]


def _input_grad_infer(attrs, shapes, dtypes):
    check_float("conv2d_input_grad", dtypes)
    g, w = shapes
    check_nchw("the output adjoint", g)
    stride, padding, dilation, groups = _attrs(attrs)
    h, wd = attrs["input_hw"]
    c = w[1] * groups
    _check_weight(c, w, groups)
    expect = _out_hw("kernel", (h, wd), w[2:], stride, padding, dilation)
    if tuple(g[1:]) != (w[0],) + expect:
        raise ShapeError(f"the output adjoint {fmt(g)} does not match a convolution of a {h}x{wd} input by "
                         f"{fmt(w)} (expected (N, {w[0]}, {expect[0]}, {expect[1]}))")
    return (g[0], c, h, wd), dtypes[0]


def _weight_grad_infer(attrs, shapes, dtypes):
    check_float("conv2d_weight_grad", dtypes)
    x, g = shapes
    check_nchw("the input", x)
    check_nchw("the output adjoint", g)
    stride, padding, dilation, groups = _attrs(attrs)
    kh, kw = attrs["kernel"]
    w = (g[1], x[1] // groups, kh, kw)
    _check_weight(x[1], w, groups)
    expect = _out_hw("kernel", x[2:], (kh, kw), stride, padding, dilation)
    if g[0] != x[0] or tuple(g[2:]) != expect:
        raise ShapeError(f"the output adjoint {fmt(g)} does not match a convolution of {fmt(x)} by a "
                         f"{kh}x{kw} kernel (expected ({x[0]}, {g[1]}, {expect[0]}, {expect[1]}))")
    return w, dtypes[0]


# ---- numpy reference: one einsum per kernel tap over strided views ------------------------------
def _tap(i, j, out_hw, stride, dilation):
    """The slice of the padded input that kernel tap (i, j) reads for every output position."""
    (ho, wo), (sh, sw), (dh, dw) = out_hw, stride, dilation
    return (Ellipsis, slice(i * dh, i * dh + sh * (ho - 1) + 1, sh), slice(j * dw, j * dw + sw * (wo - 1) + 1, sw))


def _grouped(a, groups):
    """(N, C, H, W) -> (N, G, C/G, H, W)."""
    return a.reshape(a.shape[0], groups, a.shape[1] // groups, *a.shape[2:])


def _pad(x, padding):
    ph, pw = padding
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x


def conv2d_np(x, w, stride, padding, dilation, groups):
    n, o, (kh, kw) = x.shape[0], w.shape[0], w.shape[2:]
    out_hw = tuple(out_len(x.shape[2 + a], w.shape[2 + a], stride[a], padding[a], dilation[a]) for a in (0, 1))
    xg = _grouped(_pad(x, padding), groups)
    wg = w.reshape(groups, o // groups, *w.shape[1:])
    out = np.zeros((n, groups, o // groups) + out_hw, dtype=np.result_type(x, w))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("ngchw,goc->ngohw", xg[_tap(i, j, out_hw, stride, dilation)], wg[..., i, j])
    return out.reshape((n, o) + out_hw)


def conv2d_input_grad_np(g, w, stride, padding, dilation, groups, input_hw):
    n, o, (kh, kw) = g.shape[0], w.shape[0], w.shape[2:]
    (ph, pw), (h, wd) = padding, input_hw
    c = w.shape[1] * groups
    out_hw = g.shape[2:]
    dxp = np.zeros((n, groups, c // groups, h + 2 * ph, wd + 2 * pw), dtype=np.result_type(g, w))
    gg = _grouped(g, groups)
    wg = w.reshape(groups, o // groups, *w.shape[1:])
    for i in range(kh):
        for j in range(kw):
            dxp[_tap(i, j, out_hw, stride, dilation)] += np.einsum("ngohw,goc->ngchw", gg, wg[..., i, j])
    return dxp[..., ph:ph + h, pw:pw + wd].reshape(n, c, h, wd)


def conv2d_weight_grad_np(x, g, stride, padding, dilation, groups, kernel):
    o, c = g.shape[1], x.shape[1]
    out_hw = g.shape[2:]
    xg = _grouped(_pad(x, padding), groups)
    gg = _grouped(g, groups)
    dw = np.zeros((groups, o // groups, c // groups) + tuple(kernel), dtype=np.result_type(x, g))
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            dw[..., i, j] = np.einsum("ngchw,ngohw->goc", xg[_tap(i, j, out_hw, stride, dilation)], gg)
    return dw.reshape((o, c // groups) + tuple(kernel))


def _conv_evaluate(attrs, values, out_shape, dims):
    return conv2d_np(*values, *_attrs(attrs))


def _input_grad_evaluate(attrs, values, out_shape, dims):
    return conv2d_input_grad_np(*values, *_attrs(attrs), tuple(attrs["input_hw"]))


def _weight_grad_evaluate(attrs, values, out_shape, dims):
    return conv2d_weight_grad_np(*values, *_attrs(attrs), tuple(attrs["kernel"]))


# ---- VJPs: each adjoint is one of the three ops ---------------------------------------------------
def _common(ctx, n):
    a = ctx.graph.attrs(n)
    return {k: a[k] for k in ("stride", "padding", "dilation", "groups")}


def _conv_vjp(ctx, n, g):
    x, w = ctx.graph.operands(n)
    common = _common(ctx, n)
    dx = ctx.emit("conv2d_input_grad", [g, w], input_hw=tuple(ctx.graph.shape(x)[2:]), **common) \
        if ctx.needs(0) else None
    dw = ctx.emit("conv2d_weight_grad", [x, g], kernel=tuple(ctx.graph.shape(w)[2:]), **common) \
        if ctx.needs(1) else None
    return [dx, dw]


def _input_grad_vjp(ctx, n, u):
    """dx = IG(g, w): <u, IG(g, w)> = <conv2d(u, w), g>."""
    g, w = ctx.graph.operands(n)
    common = _common(ctx, n)
    dg = ctx.emit("conv2d", [u, w], **common) if ctx.needs(0) else None
    dw = ctx.emit("conv2d_weight_grad", [u, g], kernel=tuple(ctx.graph.shape(w)[2:]), **common) \
        if ctx.needs(1) else None
    return [dg, dw]


def _weight_grad_vjp(ctx, n, u):
    """dw = WG(x, g): <u, WG(x, g)> = <conv2d(x, u), g>."""
    x, g = ctx.graph.operands(n)
    common = _common(ctx, n)
    dx = ctx.emit("conv2d_input_grad", [g, u], input_hw=tuple(ctx.graph.shape(x)[2:]), **common) \
        if ctx.needs(0) else None
    dg = ctx.emit("conv2d", [x, u], **common) if ctx.needs(1) else None
    return [dx, dg]


# ---- cost: 2 flops per multiply-add; every op does N O Ho Wo (C/groups) kh kw of them -------------
def _conv_flops(attrs, in_shapes, out_shape):
    _, w = in_shapes
    return 2 * size(out_shape) * w[1] * w[2] * w[3]


def _input_grad_flops(attrs, in_shapes, out_shape):
    g, w = in_shapes
    return 2 * size(g) * w[1] * w[2] * w[3]


def _weight_grad_flops(attrs, in_shapes, out_shape):
    x, g = in_shapes
    return 2 * size(g) * out_shape[1] * out_shape[2] * out_shape[3]


# ---- lowering ---------------------------------------------------------------------------------------
# CPU: tiles of im2col times the weight through BLAS (np.dot), never a whole-image column buffer. A tile
# is either whole images (as many as fit TILE column values) or a band of output rows of one image
# (as many rows as fit, at least one). For each tile, the input rows the tile reads are copied once into
# a zero-padded band, and tap k's columns are read from the band at offset tap[k] (a small offset
# table: no bounds tests, no divisions). With unit strides a tile's rows are whole band rows (its pitch
# is the padded width wp, not w_out): tap k's columns for an image are then one contiguous run of the
# band, a copy that vectorises (and so is the col2im add of the input gradient), for wp - w_out
# columns a row that are computed and dropped (g's tile is zero there, so they add nothing to the
# gradients). Other strides take the columns row by row. TILE is 2^19 column values (2 MB in float32):
# a GEMM of 2^17 ran on both cores no faster than on one (the threads' hand-off between tiles cost what
# the second core gained), and one of 2^19 runs 1.7x as fast; 2^21 spills the cache. A 64-channel 3x3
# conv 224 wide (VGG-16's conv1_2 shape) takes 4 output rows per tile, 576 x 904 column values, where a
# whole image's im2col would need 115 MB. The workspace is allocated once per call and is bounded by
# TILE values, g's tile and one band. Stride, padding, dilation and groups are arguments, so every conv
# of a module shares one kernel per op and path (im2col here, or by taps below).
TILE = 1 << 19

_CPU_HEAD = [
    "    n_img, c_in, h_in, w_in = {x}.shape",
    "    c_out, cg, kh, kw = {w}.shape",
    "    h_out, w_out = {g}.shape[2], {g}.shape[3]",
    "    og = c_out // groups",
    "    k_len = cg * kh * kw",
    "    wp = w_in + 2 * pw",
    "    unit = sh == 1 and sw == 1",
    "    pitch = wp if unit else w_out",
    f"    rows = max(1, min(h_out, {TILE} // max(1, k_len * pitch)))",
    f"    nb = min(n_img, max(1, {TILE} // max(1, k_len * h_out * pitch))) if rows == h_out else 1",
    "    band = (rows - 1) * sh + (kh - 1) * dh + 1",
    "    slack = (kw - 1) * dw",
    "    col_buf = np.empty(k_len * nb * rows * pitch, dtype=out.dtype)",
    "    res_buf = np.empty(og * nb * rows * pitch, dtype=out.dtype)",
    "    xp = np.zeros(nb * cg * band * wp + slack, dtype=out.dtype)",
    "    tap = np.empty(k_len, dtype=np.int64)",
    "    for c in range(cg):",
    "        for i in range(kh):",
    "            for j in range(kw):",
    "                tap[(c * kh + i) * kw + j] = (c * band + i * dh) * wp + j * dw",
]

_TILE_LOOP = [
    "        for b0 in range(0, n_img, nb):",
    "            b1 = min(n_img, b0 + nb)",
    "            for r0 in range(0, h_out, rows):",
    "                r1 = min(h_out, r0 + rows)",
    "                p_img = (r1 - r0) * pitch",
    "                p = (b1 - b0) * p_img",
    "                top = r0 * sh - ph",
    "                col = col_buf[:k_len * p].reshape(k_len, p)",
    "                res = res_buf[:og * p].reshape(og, p)",
]


def _band_rows(body):
    """For each image t of the tile, channel c of the group and row hb of the band: the input row h and
    the band row brow (a view of xp); body runs where the row is inside the input."""
    return ["                for t in range(b1 - b0):",
            "                    for c in range(cg):",
            "                        for hb in range(band):",
            "                            h = top + hb",
            "                            row0 = ((t * cg + c) * band + hb) * wp",
            "                            brow = xp[row0:row0 + wp]",
            ] + ["                            " + line for line in body]


_FILL_BAND = _band_rows([
    "if 0 <= h < h_in:",
    "    xrow = x[b0 + t, g * cg + c, h]",
    "    for ww in range(pw):",
    "        brow[ww] = 0.0",
    "    for ww in range(w_in):",
    "        brow[pw + ww] = xrow[ww]",
    "    for ww in range(pw + w_in, wp):",
    "        brow[ww] = 0.0",
    "else:",
    "    for ww in range(wp):",
    "        brow[ww] = 0.0",
])


def _columns(unit_move, strided_move):
    """The tile's columns col[k, t p_img + r pitch + wo] <-> xp[t cg band wp + tap[k] + r sh wp + wo sw]:
    with unit strides one run of p_img values per image and tap (the pitch is the band's width, so the
    rows follow each other; the last wp - w_out columns of a row are computed and dropped), else per
    output row, strided. unit_move / strided_move: the line that moves one value (run/band_run, or col/xp)."""
    return ["                for t in range(b1 - b0):",
            "                    for k in range(k_len):",
            "                        src = t * cg * band * wp + tap[k]",
            "                        dst = t * p_img",
            "                        if unit:",
            "                            run = col[k, dst:dst + p_img]",
            "                            band_run = xp[src:src + p_img]",
            "                            for q in range(p_img):",
            f"                                {unit_move}",
            "                        else:",
            "                            for r in range(r1 - r0):",
            "                                for wo in range(w_out):",
            f"                                    {strided_move}"]


_FILL_COLUMNS = _FILL_BAND + _columns("run[q] = band_run[q]",
                                      "col[k, dst + r * w_out + wo] = xp[src + r * sh * wp + wo * sw]")


def _tile_rows(body):
    """For each image t of the tile, output channel o of the group and output row r: the tile's row
    trow (a view of res: pitch values, the first w_out of them an output row's); then body."""
    return ["                for t in range(b1 - b0):",
            "                    for o in range(og):",
            "                        for r in range(r1 - r0):",
            "                            trow = res[o, t * p_img + r * pitch:t * p_img + (r + 1) * pitch]",
            ] + ["                            " + line for line in body]


_GATHER_G = _tile_rows([   # g's rows into the tile; the dropped columns zero, so they add nothing
    "grow = gy[b0 + t, g * og + o, r0 + r]",
    "for wo in range(w_out):",
    "    trow[wo] = grow[wo]",
    "for wo in range(w_out, pitch):",
    "    trow[wo] = 0.0",
])


_SCATTER_OUT = _tile_rows([   # the tile's rows into the output, the dropped columns left out
    "orow = out[b0 + t, g * og + o, r0 + r]",
    "for wo in range(w_out):",
    "    orow[wo] = trow[wo]",
])

_BAND_INTO_INPUT = _band_rows([   # col2im's last step: the band's real columns added into the input gradient
    "if 0 <= h < h_in:",
    "    xrow = out[b0 + t, g * cg + c, h]",
    "    for ww in range(w_in):",
    "        xrow[ww] += brow[pw + ww]",
])


def _weight_matrix(target, index):
    return ["        for o in range(og):",
            "            for c in range(cg):",
            "                for i in range(kh):",
            "                    for j in range(kw):",
            f"                        {target}[{index}] = w[g * og + o, c, i, j]"]


def cpu_conv2d_source(name):
    lines = [f"def {name}(x, w, sh, sw, ph, pw, dh, dw, groups, out):"]
    lines += [line.format(x="x", w="w", g="out") for line in _CPU_HEAD]
    lines += ["    wg = np.empty((og, k_len), dtype=out.dtype)", "    for g in range(groups):"]
    lines += _weight_matrix("wg", "o, (c * kh + i) * kw + j")
    lines += _TILE_LOOP + _FILL_COLUMNS
    lines += ["                np.dot(wg, col, res)"]
    lines += _SCATTER_OUT
    return "\n".join(lines), "conv2d: per group, tiles of im2col columns times the weight matrix (BLAS)"


def cpu_input_grad_source(name):
    lines = [f"def {name}(gy, w, sh, sw, ph, pw, dh, dw, groups, out):"]
    lines += [line.format(x="out", w="w", g="gy") for line in _CPU_HEAD]
    lines += ["    wt = np.empty((k_len, og), dtype=out.dtype)", "    out[:] = 0.0", "    for g in range(groups):"]
    lines += _weight_matrix("wt", "(c * kh + i) * kw + j, o")
    lines += _TILE_LOOP + _GATHER_G
    lines += ["                np.dot(wt, res, col)",
              "                xp[:(b1 - b0) * cg * band * wp + slack] = 0.0"]
    lines += _columns("band_run[q] += run[q]", "xp[src + r * sh * wp + wo * sw] += col[k, dst + r * w_out + wo]")
    lines += _BAND_INTO_INPUT
    return "\n".join(lines), ("conv2d_input_grad: per group, the weight matrix transposed times tiles of g, "
                              "the columns added into a padded band and the band into the input's rows (col2im)")


def cpu_weight_grad_source(name):
    lines = [f"def {name}(x, gy, sh, sw, ph, pw, dh, dw, groups, out):"]
    lines += [line.format(x="x", w="out", g="gy") for line in _CPU_HEAD]
    # acc[k og + o]: the group's gradient, transposed: BLAS accumulates columns times g's tile
    # transposed straight into it (beta = 1), which ran 1.3x (VGG's 64 x 576 blocks) to 2.4x (LeNet's
    # 16 x 150) as fast as g's tile times the columns transposed into a (og, k_len) part added to acc
    lines += ["    acc = np.empty(k_len * og, dtype=out.dtype)",
              "    for g in range(groups):",
              "        acc[:] = 0.0"]
    lines += _TILE_LOOP + _FILL_COLUMNS + _GATHER_G
    lines += ["                gemm_strided(col_buf, 0, p, False, res_buf, 0, p, True, acc, 0, og, k_len, og, p, 1.0)",
              "        for o in range(og):",
              "            for c in range(cg):",
              "                for i in range(kh):",
              "                    for j in range(kw):",
              "                        out[g * og + o, c, i, j] = acc[((c * kh + i) * kw + j) * og + o]"]
    return "\n".join(lines), "conv2d_weight_grad: per group, the sum over tiles of im2col columns times g transposed (BLAS)"


# CPU, by taps: a conv or its input gradient with unit strides, at least TAPS_MIN_CHANNELS channels
# a group and at least TAPS_MIN_POSITIONS output positions an image makes no columns at all. Tap
# (i, j)'s columns are the band itself, shifted by i dh wp + j dw: a (cg, rows wp) window whose rows
# are one band-channel (band wp values) apart, which BLAS takes as it is through its leading dimension
# (gemm_strided, gradc/runtime/blas.py). So the product is kh kw GEMMs with an inner dim of cg,
# accumulated with beta = 1 (the input gradient's into the band, in place, for col2im), and nothing
# is copied but the band and g's tile. A tile is rows of one image: as many as keep the tile and one
# band-channel's rows within TILE / max(cg, og) values each (VGG's 56-wide 64-channel convs take a
# whole image). Measured on this 2-core machine, 3x3 convs, float32, time by taps / im2col (forward,
# input gradient, weight gradient): 64 channels at 56 x 56, 0.58, 0.58, 1.03; at 112 x 112, 0.83,
# 0.90, 1.04; 32 channels at 56 x 56, 0.83, 0.87, 1.09; 64 at 28 x 28, 1.00, 1.03, 1.17; 128 at
# 14 x 14, 1.12, 1.17, 1.13; with 8 channels a tap's GEMM (inner dim 8) ran at half im2col's speed.
# So the weight gradient always runs by im2col (its tap GEMMs are (og, cg) outputs over a long inner
# dim, which BLAS splits poorly), and small images do too.
TAPS_MIN_CHANNELS = 32
TAPS_MIN_POSITIONS = 2048   # h_out times the padded width
TAPS_MIN_GRAD_INNER = 16   # the input gradient's: the conv's output channels a group (by_taps)

_TAPS_HEAD = [
    "    n_img, c_in, h_in, w_in = {x}.shape",
    "    c_out, cg, kh, kw = {w}.shape",
    "    h_out, w_out = {g}.shape[2], {g}.shape[3]",
    "    og = c_out // groups",
    "    block = og * cg",
    "    wp = w_in + 2 * pw",
    "    pitch = wp",
    "    rows = max(1, min(h_out, {tile} // max(1, max(cg, og) * wp)))",
    "    band = rows + (kh - 1) * dh",
    "    ld_band = band * wp",
    "    slack = (kw - 1) * dw",
    "    xp = np.zeros(cg * ld_band + slack, dtype=out.dtype)",
    "    res_buf = np.empty(og * rows * wp, dtype=out.dtype)",
    "    wt = np.empty(kh * kw * block, dtype=out.dtype)",
]

_TAPS_LOOP = [   # tiles of one image (b0) and `rows` output rows; res: g's or the output's tile
    "        for b0 in range(n_img):",
    "            b1 = b0 + 1",
    "            for r0 in range(0, h_out, rows):",
    "                r1 = min(h_out, r0 + rows)",
    "                p_img = (r1 - r0) * wp",
    "                top = r0 - ph",
    "                res = res_buf[:og * p_img].reshape(og, p_img)",
]


def _each_tap(call):
    """`call` once per tap, with t its index and off its shift in the band."""
    return ["                for i in range(kh):",
            "                    for j in range(kw):",
            "                        t = i * kw + j",
            "                        off = i * dh * wp + j * dw",
            "                        " + call]


# wt[t block + o cg + c] = w[g og + o, c, i, j]: tap t's (og, cg) weight matrix, row-major
_TAP_WEIGHTS = ["        for o in range(og):",
                "            for c in range(cg):",
                "                for i in range(kh):",
                "                    for j in range(kw):",
                "                        wt[(i * kw + j) * block + o * cg + c] = w[g * og + o, c, i, j]"]


def _taps_head(head, tile):
    return [line.format(tile=tile, **head) for line in _TAPS_HEAD]


def cpu_conv2d_by_taps_source(name, tile=TILE):
    lines = [f"def {name}(x, w, sh, sw, ph, pw, dh, dw, groups, out):"]
    lines += _taps_head(dict(x="x", w="w", g="out"), tile)
    lines += ["    for g in range(groups):"] + _TAP_WEIGHTS + _TAPS_LOOP + _FILL_BAND
    lines += _each_tap("gemm_strided(wt, t * block, cg, False, xp, off, ld_band, False, res_buf, 0, p_img, "
                       "og, p_img, cg, 0.0 if t == 0 else 1.0)")
    lines += _SCATTER_OUT
    return "\n".join(lines), "conv2d, unit strides: per group and tap, the weight times a shifted window of the input's band (BLAS)"


def cpu_input_grad_by_taps_source(name, tile=TILE):
    lines = [f"def {name}(gy, w, sh, sw, ph, pw, dh, dw, groups, out):"]
    lines += _taps_head(dict(x="out", w="w", g="gy"), tile)
    lines += ["    out[:] = 0.0", "    for g in range(groups):"] + _TAP_WEIGHTS + _TAPS_LOOP + _GATHER_G
    lines += ["                xp[:] = 0.0"]
    lines += _each_tap("gemm_strided(wt, t * block, cg, True, res_buf, 0, p_img, False, xp, off, ld_band, "
                       "cg, p_img, og, 1.0)")
    lines += _BAND_INTO_INPUT
    return "\n".join(lines), ("conv2d_input_grad, unit strides: per group and tap, the weight transposed times "
                              "g's tile, added into a shifted window of a padded band, the band into the input's rows")


# CUDA: one thread per output element, each summing its own products (no atomics, deterministic).
def cuda_conv2d_source(name):
    from .kernel_text import unravel
    return "\n".join([
        f"def {name}(x, w, sh, sw, ph, pw, dh, dw, groups, out):",
        "    i = cuda.grid(1)",
        "    if i >= out.size:",
        "        return",
        *unravel(4),
        "    cg = w.shape[1]",
        "    g = i1 // (out.shape[1] // groups)",
        "    acc = 0.0",
        "    for c in range(cg):",
        "        for p in range(w.shape[2]):",
        "            row = i2 * sh - ph + p * dh",
        "            if 0 <= row < x.shape[2]:",
        "                for q in range(w.shape[3]):",
        "                    at = i3 * sw - pw + q * dw",
        "                    if 0 <= at < x.shape[3]:",
        "                        acc += x[i0, g * cg + c, row, at] * w[i1, c, p, q]",
        "    out[i0, i1, i2, i3] = acc",
    ]), "conv2d: one thread per output element", ("flat", -1)


def cuda_input_grad_source(name):
    from .kernel_text import unravel
    return "\n".join([
        f"def {name}(gy, w, sh, sw, ph, pw, dh, dw, groups, out):",
        "    i = cuda.grid(1)",
        "    if i >= out.size:",
        "        return",
        *unravel(4),
        "    cg = w.shape[1]",
        "    og = w.shape[0] // groups",
        "    g = i1 // cg",
        "    c = i1 - g * cg",
        "    acc = 0.0",
        "    for p in range(w.shape[2]):",
        "        t = i2 + ph - p * dh",
        "        if t >= 0 and t % sh == 0 and t // sh < gy.shape[2]:",
        "            ho = t // sh",
        "            for q in range(w.shape[3]):",
        "                s = i3 + pw - q * dw",
        "                if s >= 0 and s % sw == 0 and s // sw < gy.shape[3]:",
        "                    wo = s // sw",
        "                    for o in range(g * og, (g + 1) * og):",
        "                        acc += gy[i0, o, ho, wo] * w[o, c, p, q]",
        "    out[i0, i1, i2, i3] = acc",
    ]), "conv2d_input_grad: one thread per input element, gathering the outputs that read it", ("flat", -1)


def cuda_weight_grad_source(name):
    from .kernel_text import unravel
    return "\n".join([
        f"def {name}(x, gy, sh, sw, ph, pw, dh, dw, groups, out):",
        "    i = cuda.grid(1)",
        "    if i >= out.size:",
        "        return",
        *unravel(4),
        "    c = (i0 // (out.shape[0] // groups)) * out.shape[1] + i1",
        "    acc = 0.0",
        "    for b in range(gy.shape[0]):",
        "        for ho in range(gy.shape[2]):",
        "            row = ho * sh - ph + i2 * dh",
        "            if 0 <= row < x.shape[2]:",
        "                for wo in range(gy.shape[3]):",
        "                    at = wo * sw - pw + i3 * dw",
        "                    if 0 <= at < x.shape[3]:",
        "                        acc += gy[b, i0, ho, wo] * x[b, c, row, at]",
        "    out[i0, i1, i2, i3] = acc",
    ]), "conv2d_weight_grad: one thread per weight, summing over images and output pixels", ("flat", -1)


def by_taps(attrs, w_shape, h_out, w_in, input_grad=False):
    """Whether the CPU runs a conv or its input gradient (weight w_shape, h_out output rows, input
    width w_in) tap by tap rather than by im2col. A tap's product has the conv's channels a group as its
    inner dim, the input gradient's the conv's outputs a group: an input gradient that makes fewer than
    TAPS_MIN_CHANNELS channels from at least TAPS_MIN_GRAD_INNER, by a kernel larger than 1x1, runs by
    taps at any size, where it does not run directly (one core, float32, 3 or 6 made from 16 to 64
    at 14x14 and 28x28, 3x3 and 5x5 kernels: 0.69-0.99x of im2col's time in 23 of 24 shapes, 1.12x
    in one; LeNet's second conv's: 0.72 against 0.90 ms)."""
    if tuple(attrs["stride"]) != (1, 1):
        return False
    if (input_grad and w_shape[1] < TAPS_MIN_CHANNELS and w_shape[0] // attrs.get("groups", 1) >= TAPS_MIN_GRAD_INNER
            and w_shape[2] * w_shape[3] > 1):   # (a 1x1 kernel, one product, was not measured)
        return True
    return w_shape[1] >= TAPS_MIN_CHANNELS and h_out * (w_in + 2 * attrs["padding"][1]) >= TAPS_MIN_POSITIONS


def _workspace(x_at, w_at, g_at, taps=False, summed=False, input_grad=False):
    """The bytes a CPU kernel allocates for one call (its head's buffers, and for im2col its one
    (og, k_len) weight matrix), given where x, w and g are among the operands and the output (index
    2), and whether the op has paths by taps and by Winograd (taps; input_grad: it is the input
    gradient, whose Winograd path reads g): memory planning counts them at the conv's step. A
    plain entry runs the kernel over up to planned_parts parts of the batch at once (conv_on_cores),
    or over a part run's parts (`parts`), each with a workspace of its own; `summed`: the parts'
    outputs are summed (the weight gradient), all but the first in buffers of their own."""
    def workspace(graph, n, dims, parts=None):
        shapes = [graph.shape(u) for u in graph.operands(n)] + [graph.shape(n)]
        shapes = [bind_dims(s, dims) for s in shapes]
        x, w, g = shapes[x_at], shapes[w_at], shapes[g_at]
        if any(isinstance(d, str) for d in x + w + g):
            return None
        a = graph.attrs(n)
        (sh, sw), (_, pw), (dh, dw) = a["stride"], a["padding"], a.get("dilation", (1, 1))
        w_in = x[3]
        c_out, cg, kh, kw = w
        h_out, w_out = g[2], g[3]
        og, k_len, wp = c_out // a.get("groups", 1), cg * kh * kw, w_in + 2 * pw
        itemsize = np.dtype(graph.dtype(n)).itemsize

        def one_call(n_img):
            made, c_src, c_dst = (x, c_out, cg) if input_grad else (g, cg, c_out)
            # the paths in _lower's order
            if (taps or summed) and winograd(a, w, made[2:], input_grad):   # conv_winograd.py: U (or the sums), one
                # block's V and M, its band; + its (4, 3) float64 scratch of the weights' transform
                return winograd_values(made[2], made[3], c_src, c_dst) * itemsize + 12 * 8
            if summed and direct(a, w, weight_grad=True):   # conv_direct.py: a chunk's bands and g's rows, the sums
                return direct_workspace_bytes(cg, og, h_out, w_out, kh, kw, dh, dw, itemsize, a.get("groups", 1),
                                              n_img, weight_grad=True)
            if taps and direct(a, w, input_grad):   # conv_direct.py: the band, the blocked weights, the sums
                src, made_ch = (og, cg) if input_grad else (cg, og)
                return direct_workspace_bytes(src, made_ch, made[2], made[3], kh, kw, dh, dw, itemsize,
                                              a.get("groups", 1))
            if taps and by_taps(a, w, h_out, w_in, input_grad):   # _TAPS_HEAD: the band, one tile, the taps' weights
                rows = max(1, min(h_out, TILE // max(1, max(cg, og) * wp)))
                values = cg * (rows + (kh - 1) * dh) * wp + (kw - 1) * dw + og * rows * wp + kh * kw * og * cg
                return values * itemsize
            pitch = wp if (sh, sw) == (1, 1) else w_out
            rows = max(1, min(h_out, TILE // max(1, k_len * pitch)))
            nb = min(n_img, max(1, TILE // max(1, k_len * h_out * pitch))) if rows == h_out else 1
            band = (rows - 1) * sh + (kh - 1) * dh + 1
            values = (k_len + og) * nb * rows * pitch + nb * cg * band * wp + (kw - 1) * dw + og * k_len
            return values * itemsize + k_len * 8   # + the offset table

        flops = conv_cores.conv_flops(size(x), size(g), k_len, weight_grad=summed)
        own_sums = summed and parts is None   # (in a part run, memory.workspace_bytes counts the run's sums)
        if parts is None:   # run alone (in a part run, the run's count)
            parts = conv_cores.planned_parts(x[0], flops, conv_cores.cores())
        at_once = parts * one_call(-(-x[0] // parts)) + (parts - 1) * size(shapes[2]) * itemsize * own_sums
        return max(one_call(x[0]), at_once)
    return workspace


def _lower(hint, make, make_by_taps=None, x_at=0, w_at=1, g_at=2, on_cores=None, make_winograd=None,
           input_grad=False, make_direct=None, weight_grad=False):
    """One kernel per module and target for each op and path (stride, padding, dilation, groups are
    arguments; the paths, in this order: Winograd, direct, by taps, im2col); x_at, w_at, g_at: where x,
    w and g are among the operands and the output (index 2); input_grad, weight_grad: the op is the
    input or weight gradient (for the rules). A direct kernel also has its block of output channels
    written in (conv_direct.kernel_block), so there is one per block size.
    on_cores: the runtime function (gradc/runtime/conv_cores.py) through which a plain-Python entry
    calls the CPU kernel, over parts of the batch at once; a compiled function calls it directly."""
    def lower(s):
        a = s.attrs
        shapes = [s.operand_shape(j) for j in range(len(s.operands))] + [s.shape]
        x, w, g = shapes[x_at], shapes[w_at], shapes[g_at]
        ints = [*a["stride"], *a["padding"], *a.get("dilation", (1, 1)), a.get("groups", 1)]
        if make_winograd is not None and winograd(a, w, (x if input_grad else g)[2:], input_grad):
            kernel = s.kernel((hint, "winograd"), f"{hint}_winograd", make_winograd)
        elif make_direct is not None and direct(a, w, input_grad, weight_grad):
            made = w[1] if input_grad else w[0] // a.get("groups", 1)
            ob = kernel_block(made, *(x if input_grad else g)[2:], w[3], a.get("dilation", (1, 1))[1],
                              np.dtype(s.graph.dtype(s.n)).itemsize, weight_grad)
            kernel = s.kernel((hint, "direct", ob), f"{hint}_direct", lambda name: make_direct(name, ob))
        elif make_by_taps is not None and by_taps(a, w, g[2], x[3], input_grad):
            kernel = s.kernel((hint, "by_taps"), f"{hint}_by_taps", make_by_taps)
        else:
            kernel = s.kernel((hint,), hint, make)
        args = list(s.args) + [str(int(v)) for v in ints]
        if on_cores is None or not s.split_batch:
            return s.into_out(kernel, args)
        return [s.alloc(), f"{on_cores}({kernel}, {', '.join(args + [s.out])}, most={conv_cores.cores()}){s.note}"]
    return lower


def _rows_of_first(graph, n, ins, fail):
    """Row b of the output reads row b of the first operand only (the weight has no batch dim)."""
    if ins[0] == 0 and ins[1] is None:
        return 0
    fail("convolves across rows" if ins[0] not in (0, None) else "has the batch dim in its weight")


def _image_work(x_at, w_at, g_at, weight_grad=False):
    """part_work: one image's conv flops as conv_cores counts them (x, w, g placed as for _workspace)."""
    def work(graph, n, dims):
        shapes = [graph.shape(u) for u in graph.operands(n)] + [graph.shape(n)]
        x, w, g = (bind_dims(shapes[k], dims) for k in (x_at, w_at, g_at))
        if any(isinstance(d, str) for d in x[1:] + w + g[1:]):
            return None
        return conv_cores.conv_flops(size(x[1:]), size(g[1:]), size(w) // w[0], weight_grad)
    return work


def _rows_summed(graph, n, ins, fail):
    fail("sums over rows (a weight gradient)")


register(Op("conv2d", "conv", _conv_infer, _conv_evaluate, _conv_flops, vjp=_conv_vjp, arity=2,
            rows=_rows_of_first, workspace=_workspace(0, 1, 2, taps=True), parts="rows", part_work=_image_work(0, 1, 2),
            batched=per_image,
            cpu=_lower("conv2d", cpu_conv2d_source, cpu_conv2d_by_taps_source, 0, 1, 2, "conv_on_cores",
                       cpu_conv2d_winograd_source, make_direct=cpu_conv2d_direct_source),
            cuda=_lower("conv2d", cuda_conv2d_source),
            doc="y[n, o] = sum over c in o's group, taps (i, j) of w[o, c, i, j] * x_pad[n, c, h s + i d, w s + j d]; "
                "attrs stride, padding, dilation (pairs), groups"))
register(Op("conv2d_input_grad", "conv", _input_grad_infer, _input_grad_evaluate, _input_grad_flops,
            vjp=_input_grad_vjp, arity=2, rows=_rows_of_first,
            workspace=_workspace(2, 1, 0, taps=True, input_grad=True), parts="rows", part_work=_image_work(2, 1, 0),
            cpu=_lower("conv2d_input_grad", cpu_input_grad_source, cpu_input_grad_by_taps_source, 2, 1, 0,
                       "conv_on_cores", cpu_input_grad_winograd_source, input_grad=True,
                       make_direct=cpu_input_grad_direct_source),
            cuda=_lower("conv2d_input_grad", cuda_input_grad_source),
            doc="the transposed convolution of g by w: conv2d's adjoint for x; attrs as conv2d's plus input_hw"))
register(Op("conv2d_weight_grad", "conv", _weight_grad_infer, _weight_grad_evaluate, _weight_grad_flops,
            vjp=_weight_grad_vjp, arity=2, rows=_rows_summed, workspace=_workspace(0, 2, 1, summed=True),
            parts="sums", part_work=_image_work(0, 2, 1, weight_grad=True),
            cpu=_lower("conv2d_weight_grad", cpu_weight_grad_source, x_at=0, w_at=2, g_at=1,
                       on_cores="conv_weight_grad_on_cores", make_winograd=cpu_weight_grad_winograd_source,
                       make_direct=cpu_weight_grad_direct_source, weight_grad=True),
            cuda=_lower("conv2d_weight_grad", cuda_weight_grad_source),
            doc="dw[o, c, i, j] = sum over n, h, w of g[n, o, h, w] x_pad[n, c, h s + i d, w s + j d]: conv2d's adjoint "
                "for w; attrs as conv2d's plus kernel"))
