"""CPU direct convolutions for few channels: a conv2d and its input and weight gradients with unit
strides, which make few channels a group (DIRECT_MAX_CHANNELS), summed tap by tap in vector registers.

im2col turns such a conv into a skinny product (LeNet's 6 or 16 output channels) and first copies
every input value once per tap; by taps (conv.py), products with an inner dim of a few channels.
Both run far below the core's peak. Here nothing is copied but the input, once, into a zero-padded
band per image and group, and each output is summed where it is made:

    out[n, d, y, x] = sum over source channel s of the group and taps (i, j) of
                      W[d, s, i, j] * band[s, y + i dh, x + j dw]

The band's rows are wb = w_dst + (kw - 1) dw wide, so output position (y, x) lies at y wb + x and tap
(s, i, j) shifts it by tap = s hb wb + i dh wb + j dw: consecutive positions read consecutive band
values for every tap. tap_sums (gradc/runtime/simd.py) sums them for a block of output channels
(out_block) at once, the accumulators in vector registers; the last wb - w_dst positions of a row
are computed and dropped.

The input gradient is the conv of g, its band padded by (k - 1) d - p (cropped where that is
negative), by the filters turned 180 degrees with in and out channels swapped, per group. The weight
gradient (tap_dots) lays g's rows out at the band's pitch, zero between them, and sums band times g
over the positions of a chunk of images, for a block of taps and output channels at once.

Measured (one thread, float32, against im2col and torch's conv on one thread): the README's table
(Convolutions), from bench/conv_kernels.py.
"""
from gradc.runtime.simd import ACCUMULATORS, VECTOR_BYTES

CHUNK = 1 << 14   # values of the weight gradient's bands and g's rows for a chunk of images

DIRECT_MAX_CHANNELS = 64   # channels a group the kernel makes at most: beyond, BLAS's products win
WEIGHT_GRAD_MAX_TAPS = 31       # the weight gradient runs directly for at most these taps a group (channels
WEIGHT_GRAD_MAX_CHANNELS = 16   # times kernel), or at most these output channels a group


def direct(attrs, w_shape, input_grad=False, weight_grad=False):
    """Whether the CPU runs this conv2d (w_shape: its weight) or its input or weight gradient
    directly: unit strides, a kernel larger than 1x1 (a 1x1 conv is one product, which BLAS runs
    best), and at most DIRECT_MAX_CHANNELS channels made a group. The input gradient's products (by
    taps or im2col) have the conv's output channels as their inner dim: from 16 of them they run it as
    well, unless it makes 16 channels or more itself (4 images, 32 -> 32 at 56 x 56, 5x5: direct 6.6
    ms, by taps 10.4, im2col 8.9). The weight gradient's sums over positions reload g's rows for every
    block of taps: they beat im2col's product where that product is skinny, for few output channels
    (its rows) or few taps (its columns: a first layer's one to three channels)."""
    c_out, cg, kh, kw = w_shape
    og = c_out // attrs.get("groups", 1)
    if tuple(attrs["stride"]) != (1, 1) or kh * kw == 1:
        return False
    if input_grad:
        return cg <= DIRECT_MAX_CHANNELS and (og < 16 or cg >= 16)
    if weight_grad:
        return og <= DIRECT_MAX_CHANNELS and (og <= WEIGHT_GRAD_MAX_CHANNELS or cg * kh * kw <= WEIGHT_GRAD_MAX_TAPS)
    return og <= DIRECT_MAX_CHANNELS


def band_positions(h_dst, w_dst, kw, dw):
    """Positions a call of the kernel covers for one image: the rows of its output at the band's pitch."""
    return (h_dst - 1) * (w_dst + (kw - 1) * dw) + w_dst


def out_block(made, positions, itemsize):
    """Output channels tap_sums sums at once, for `made` channels a group over `positions` band positions
    an image (band_positions): the block (1, 2, 4 or 8 channels, by 8, 4, 2 or 1 vectors of positions)
    that needs the fewest calls, counting the idle channels of the last block and the idle positions of
    the last call. A block of one channel loads eight position vectors a step and ran about 1.4x slower
    a sum; blocks of equal calls ran alike (4 by a little). Measured on one core over 1 to 32 channels
    at 8x8 to 32x32 (LeNet's first conv, 6 channels at 28x28: 0.26 ms by 2 against 0.41 by 8, the
    block of the smallest power of two that held them)."""
    lanes = VECTOR_BYTES // itemsize

    def cost(block):
        calls = -(-made // block) * -(-positions // (ACCUMULATORS // block * lanes))
        return calls * (1.4 if block == 1 else 1.0)
    return min((4, 2, 8, 1), key=cost)   # ties: 4, then 2 (6 loads per 8 multiply-adds), then 8 (9)


def weight_grad_block(made):
    """Output channels tap_dots sums at once in the weight gradient: the smallest power of two that holds
    them, at most 4 (with 2 taps), since its g rows are loaded for every block of taps: 4 x 2 loads 6
    vectors for 8 multiply-adds, 8 x 1 loads 9 (LeNet's 6 -> 16 5x5 gradient: 0.68 ms against 0.84 on
    one thread)."""
    return min(1 << (max(1, made) - 1).bit_length(), 4)


def kernel_block(made, h_dst, w_dst, kw, dw, itemsize, weight_grad=False):
    """The block of output channels a direct kernel is written with, for `made` channels a group of an
    h_dst x w_dst image (the lowering's and the memory plan's one rule)."""
    if weight_grad:
        return weight_grad_block(made)
    return out_block(made, band_positions(h_dst, w_dst, kw, dw), itemsize)


def workspace_bytes(src_channels, made_channels, h_dst, w_dst, kh, kw, dh, dw, itemsize, groups=1, n_img=1,
                    weight_grad=False):
    """Bytes the kernel allocates for one call: the band, the blocked weights, the accumulators and
    the tap table (the kernel's head); the weight gradient's: a chunk of bands and of g's rows, the
    partial sums and the tap table."""
    if weight_grad:
        ob, lanes = kernel_block(made_channels, h_dst, w_dst, kw, dw, itemsize, True), VECTOR_BYTES // itemsize
        kb = ACCUMULATORS // ob
        wb, hb = w_dst + (kw - 1) * dw, h_dst + (kh - 1) * dh
        n_pos = -(-band_positions(h_dst, w_dst, kw, dw) // lanes) * lanes
        rows = -(-made_channels // ob) * ob
        n_taps = -(-(src_channels * kh * kw) // kb) * kb
        per_image = src_channels * hb * wb + lanes + rows * n_pos
        chunk = max(1, min(n_img, CHUNK // per_image))
        return (chunk * per_image + n_taps * rows * lanes) * itemsize + 8 * n_taps
    ob = kernel_block(made_channels, h_dst, w_dst, kw, dw, itemsize)
    step = ACCUMULATORS // ob * (VECTOR_BYTES // itemsize)
    wb, hb = w_dst + (kw - 1) * dw, h_dst + (kh - 1) * dh
    n_taps = src_channels * kh * kw
    blocks = -(-made_channels // ob)
    positions = -(-band_positions(h_dst, w_dst, kw, dw) // step) * step
    values = src_channels * hb * wb + step + groups * blocks * n_taps * ob + ob * positions
    return values * itemsize + 8 * n_taps


def _tap_table(size):
    """tap[(s kh + i) kw + j]: tap (s, i, j)'s shift in the band; `size` entries (spare ones read shift 0)."""
    return [f"    tap = np.zeros({size}, dtype=np.int64)",
            "    for s in range(src):",
            "        for i in range(kh):",
            "            for j in range(kw):",
            "                tap[(s * kh + i) * kw + j] = s * plane + i * dh * wb + j * dw"]


def _fill_band(pad, image, band):
    """The group's source channels of `image` (an (n, channel) index prefix) into `band`'s rows; the band's
    padding is never written, so it stays zero."""
    return [pad + line for line in ["for s in range(src):",
                                    "    for h in range(h_lo, h_hi):",
                                    "        at = s * plane + (h + top) * wb + left",
                                    f"        row = {image}, g * src + s, h]",
                                    "        for c in range(c_lo, c_hi):",
                                    f"            {band}[at + c] = row[c]"]]


def _source(name, first, input_grad, ob):
    if input_grad:   # w: (c_out, cg, kh, kw) of the conv; the gradient's sources are the conv's outputs
        channels = ["    made, src = w.shape[1], w.shape[0] // groups",
                    "    top, left = (kh - 1) * dh - ph, (kw - 1) * dw - pw"]
        weight = "w[g * src + s, d, kh - 1 - i, kw - 1 - j]"
    else:
        channels = ["    made, src = w.shape[0] // groups, w.shape[1]",
                    "    top, left = ph, pw"]
        weight = "w[g * made + d, s, i, j]"
    lines = [
        f"def {name}({first}, w, sh, sw, ph, pw, dh, dw, groups, out):",
        f"    n_img, h_src, w_src = {first}.shape[0], {first}.shape[2], {first}.shape[3]",
        "    h_dst, w_dst = out.shape[2], out.shape[3]",
        "    kh, kw = w.shape[2], w.shape[3]",
        *channels,
        f"    ob = {ob}   # output channels summed at once",
        f"    step = {ACCUMULATORS // ob} * {VECTOR_BYTES} // out.itemsize   # positions summed at once",
        "    wb, hb = w_dst + (kw - 1) * dw, h_dst + (kh - 1) * dh   # the band",
        "    plane = hb * wb",
        "    n_pos = -(-((h_dst - 1) * wb + w_dst) // step) * step",
        "    n_taps = src * kh * kw",
        "    blocks = -(-made // ob)",
        *_tap_table("n_taps"),
        "    wt = np.zeros((groups, blocks, n_taps, ob), dtype=out.dtype)   # zero past the last channel",
        "    for g in range(groups):",
        "        for d in range(made):",
        "            for s in range(src):",
        "                for i in range(kh):",
        "                    for j in range(kw):",
        f"                        wt[g, d // ob, (s * kh + i) * kw + j, d % ob] = {weight}",
        "    band = np.zeros(src * plane + step, dtype=out.dtype)   # its padding stays zero: only inputs are written",
        "    acc = np.empty((ob, n_pos), dtype=out.dtype)",
        "    h_lo, h_hi = max(0, -top), min(h_src, hb - top)",
        "    c_lo, c_hi = max(0, -left), min(w_src, wb - left)",
        "    for n in range(n_img):",
        "        for g in range(groups):",
        *_fill_band(" " * 12, f"{first}[n", "band"),
        "            for b in range(blocks):",
        "                w_block = wt[g, b]",
        "                for q0 in range(0, n_pos, step):",
        "                    tap_sums(band, q0, w_block, tap, acc, ob)",
        "                for u in range(min(ob, made - b * ob)):",
        "                    d = g * made + b * ob + u",
        "                    for y in range(h_dst):",
        "                        row, sums = out[n, d, y], acc[u, y * wb:y * wb + w_dst]",
        "                        for c in range(w_dst):",
        "                            row[c] = sums[c]",
    ]
    return "\n".join(lines)


def cpu_conv2d_direct_source(name, ob):
    return (_source(name, "x", False, ob),
            "conv2d, unit strides, few output channels: sums over taps in vector registers (tap_sums)")


def cpu_input_grad_direct_source(name, ob):
    return (_source(name, "gy", True, ob),
            "conv2d_input_grad, unit strides, few input channels: the conv of g by the turned filters, "
            "summed over taps in vector registers (tap_sums)")


def cpu_weight_grad_direct_source(name, ob):
    lines = [
        f"def {name}(x, gy, sh, sw, ph, pw, dh, dw, groups, out):",
        "    n_img, h_src, w_src = x.shape[0], x.shape[2], x.shape[3]",
        "    h_out, w_out = gy.shape[2], gy.shape[3]",
        "    c_out, src, kh, kw = out.shape",
        "    made = c_out // groups",
        f"    ob, kb = {ob}, {ACCUMULATORS // ob}   # output channels and taps summed at once",
        f"    lanes = {VECTOR_BYTES} // out.itemsize",
        "    top, left = ph, pw",
        "    wb, hb = w_out + (kw - 1) * dw, h_out + (kh - 1) * dh   # the band",
        "    plane = hb * wb",
        "    n_pos = -(-((h_out - 1) * wb + w_out) // lanes) * lanes",
        "    n_taps = src * kh * kw",
        "    blocks = -(-made // ob)",
        *_tap_table("-(-n_taps // kb) * kb"),   # the last block's spare taps read shift 0
        f"    chunk = max(1, min(n_img, {CHUNK} // (src * plane + lanes + blocks * ob * n_pos)))",
        "    band = np.zeros((chunk, src * plane + lanes), dtype=out.dtype)   # padding stays zero",
        "    gp = np.zeros((chunk, blocks * ob, n_pos), dtype=out.dtype)   # g's rows at the band's pitch; the rest zero",
        "    sums = np.empty((tap.size, blocks * ob, lanes), dtype=out.dtype)",
        "    h_lo, h_hi = max(0, -top), min(h_src, hb - top)",
        "    c_lo, c_hi = max(0, -left), min(w_src, wb - left)",
        "    for g in range(groups):",
        "        sums[:] = 0.0",
        "        for n0 in range(0, n_img, chunk):",
        "            images = min(chunk, n_img - n0)",
        "            for t in range(images):",
        "                band_t = band[t]",
        *_fill_band(" " * 16, "x[n0 + t", "band_t"),
        "                for d in range(made):",
        "                    for y in range(h_out):",
        "                        row, dst = gy[n0 + t, g * made + d, y], gp[t, d, y * wb:y * wb + w_out]",
        "                        for c in range(w_out):",
        "                            dst[c] = row[c]",
        "            for b in range(blocks):",
        "                for k0 in range(0, tap.size, kb):",
        "                    tap_dots(band, gp, tap, k0, b * ob, images, sums, ob)",
        "        for d in range(made):",
        "            for s in range(src):",
        "                for i in range(kh):",
        "                    for j in range(kw):",
        "                        out[g * made + d, s, i, j] = sums[(s * kh + i) * kw + j, d].sum()",
    ]
    return ("\n".join(lines),
            "conv2d_weight_grad, unit strides, few output channels: band times g summed over positions in vector "
            "registers (tap_dots)")
