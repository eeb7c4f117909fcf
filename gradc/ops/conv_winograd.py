"""CPU 3x3 convolutions by Winograd's minimal filtering F(2x2, 3x3) (Lavin and Gray, 2016): a conv2d
and its input gradient with unit strides and dilations, one group and enough channels.

Each 2x2 block of outputs (a tile) reads a 4x4 patch d of the zero-padded input. With the 4x4
transforms V = B^T d B of each patch and channel, and U = G g G^T of each 3x3 filter g, the tile's
outputs are A^T (sum over channels of U * V) A: the sum over channels is 16 matrix products, one per
transform element xi, of U[xi] (out channels x in channels) by V[xi] (in channels x tiles), run by
BLAS (np.dot inside Numba). That is 16 multiply-adds a tile and channel pair where the direct
convolution (im2col or by taps) makes 36: 2.25x fewer, for a few adds a patch and tile in the
transforms. In float32 its error is a few float32 ulps of the outputs' scale (tested against torch
in float64), as cuDNN's and oneDNN's Winograd convolutions.

The input gradient of a unit-stride 3x3 conv with padding p is the conv of g, padded by 2 - p, with
each filter turned 180 degrees and in and out channels swapped: the same kernel, with the weights
read so (so p <= 2). The weight gradient follows from the identity transposed: dW = G^T (sum over
tiles of (A g A^T) * V) G, the sum over tiles 16 products of (out channels x tiles) by (tiles x in
channels), accumulated over blocks and images.

The tiles run in blocks of whole tile rows of one image: as many as fit WINOGRAD_BLOCK values of V
and M (the products' outputs) together, which keeps both in the cache, but at least
WINOGRAD_MIN_TILES tiles (many channels would otherwise leave products of a few columns, near
matrix-vector ones); the block's input rows are copied once into a zero-padded band. The workspace
is the band, U, V and M of one block (`workspace_values`), never a transformed image.

Measured (one thread, float32, 2-4 images, against the path the conv took before: im2col, or by
taps at 56 x 56): 0.52-0.97x its time from 32 channels at 14 x 14 up to 512 at 28 x 28; 512
channels at 7 x 7 (16 tiles an image) took 1.29x, hence WINOGRAD_MIN_IMAGE_TILES.
"""

WINOGRAD_BLOCK = 1 << 15        # values of V and M together in a block of tile rows
WINOGRAD_MIN_TILES = 128        # tiles a block at least, so that the 16 products stay matrix products
WINOGRAD_MIN_CHANNELS = 32      # below, the transforms cost more than the products save
WINOGRAD_MIN_IMAGE_TILES = 36   # below (outputs under 11 x 11), products of few tiles: 512 channels at
                                # 7 x 7 ran 1.3x im2col's time
# V's and M's 16 planes lie this many values more than their size apart: at a power-of-two size (32-wide
# images) the planes' rows fell on the same cache sets, and the kernel ran 1.9x slower
PLANE_GAP = 16


def winograd(attrs, w_shape, out_hw, input_grad=False):
    """Whether the CPU runs this conv (or its input gradient: w_shape is the conv's weight, out_hw the
    size of the image the kernel writes; or its weight gradient: out_hw the conv's output size) by
    Winograd."""
    c_out, cg, kh, kw = w_shape
    tiles = ((out_hw[0] + 1) // 2) * ((out_hw[1] + 1) // 2)
    return (tuple(attrs["stride"]) == (1, 1) and tuple(attrs.get("dilation", (1, 1))) == (1, 1)
            and attrs.get("groups", 1) == 1 and (kh, kw) == (3, 3)
            and min(c_out, cg) >= WINOGRAD_MIN_CHANNELS and tiles >= WINOGRAD_MIN_IMAGE_TILES
            and (not input_grad or max(attrs["padding"]) <= 2))


def workspace_values(h_out, w_out, c_src, c_dst):
    """Values the kernel allocates for one call: U (the weight gradient: its 16 sums, as many), one
    block's V and M, and its input band (`rows` as the kernel's head computes it)."""
    th, tw = (h_out + 1) // 2, (w_out + 1) // 2
    rows = min(th, max(-(-WINOGRAD_MIN_TILES // tw), WINOGRAD_BLOCK // max(1, 16 * tw * (c_src + c_dst))))
    band = c_src * (2 * rows + 2) * (2 * tw + 2)
    return 16 * c_dst * c_src + 16 * ((c_src + c_dst) * rows * tw + 2 * PLANE_GAP) + band


def _weight_transform(flipped):
    """U[xi, d, s] = (G g G^T)[xi], g the filter from source channel s to destination d: w[d, s] for
    the conv, w[s, d] turned 180 degrees for its input gradient."""
    pick = "w[s, d, 2 - i, 2 - j]" if flipped else "w[d, s, i, j]"
    return [
        "    u = np.empty((16, c_dst, c_src), dtype=out.dtype)",
        "    t = np.empty((4, 3), dtype=np.float64)",
        "    for d in range(c_dst):",
        "        for s in range(c_src):",
        "            for j in range(3):",
        f"                g0, g1, g2 = {pick.replace('i', '0')}, {pick.replace('i', '1')}, {pick.replace('i', '2')}",
        "                t[0, j] = g0",
        "                t[1, j] = 0.5 * (g0 + g1 + g2)",
        "                t[2, j] = 0.5 * (g0 - g1 + g2)",
        "                t[3, j] = g2",
        "            for i in range(4):",
        "                u[4 * i, d, s] = t[i, 0]",
        "                u[4 * i + 1, d, s] = 0.5 * (t[i, 0] + t[i, 1] + t[i, 2])",
        "                u[4 * i + 2, d, s] = 0.5 * (t[i, 0] - t[i, 1] + t[i, 2])",
        "                u[4 * i + 3, d, s] = t[i, 2]",
    ]


# the 4x4 patch of tile (ty, tx) in band rows 2 (ty - r0) .. + 3, transformed: v = B^T d B
_INPUT_TILES = [
    "            for s in range(c_src):",
    "                for ty in range(r1 - r0):",
    "                    y0 = 2 * ty",
    "                    for tx in range(tw):",
    "                        x0 = 2 * tx",
    "                        p = ty * tw + tx",
    *[f"                        a{r}{c} = band[s, y0 + {r}, x0 + {c}]" for r in range(4) for c in range(4)],
    *[f"                        b0{c} = a0{c} - a2{c}\n"
      f"                        b1{c} = a1{c} + a2{c}\n"
      f"                        b2{c} = a2{c} - a1{c}\n"
      f"                        b3{c} = a1{c} - a3{c}" for c in range(4)],
    "                        at = s * tiles + p",
    *[f"                        v_buf[{4 * r} * vs + at] = b{r}0 - b{r}2\n"
      f"                        v_buf[{4 * r + 1} * vs + at] = b{r}1 + b{r}2\n"
      f"                        v_buf[{4 * r + 2} * vs + at] = b{r}2 - b{r}1\n"
      f"                        v_buf[{4 * r + 3} * vs + at] = b{r}1 - b{r}3" for r in range(4)],
]

# the tile's outputs A^T m A from its 16 summed products m = M[:, d, p], clipped at the bottom and right
_OUTPUT_TILES = [
    "            for d in range(c_dst):",
    "                for ty in range(r1 - r0):",
    "                    yy = 2 * (r0 + ty)",
    "                    for tx in range(tw):",
    "                        p = ty * tw + tx",
    "                        at = d * tiles + p",
    *[f"                        t0{c} = m_buf[{c} * ms + at] + m_buf[{4 + c} * ms + at] + m_buf[{8 + c} * ms + at]\n"
      f"                        t1{c} = m_buf[{4 + c} * ms + at] - m_buf[{8 + c} * ms + at] - m_buf[{12 + c} * ms + at]"
      for c in range(4)],
    "                        xx = 2 * tx",
    "                        out[n, d, yy, xx] = t00 + t01 + t02",
    "                        if xx + 1 < w_out:",
    "                            out[n, d, yy, xx + 1] = t01 - t02 - t03",
    "                        if yy + 1 < h_out:",
    "                            out[n, d, yy + 1, xx] = t10 + t11 + t12",
    "                            if xx + 1 < w_out:",
    "                                out[n, d, yy + 1, xx + 1] = t11 - t12 - t13",
]


def _blocks_of_tiles(first):
    """The buffers of one block (V, M, the band), then the loop over images and blocks of tile rows of
    `first` (the image read: x, or g for the input gradient), each block's band filled and its V made."""
    return [
        f"    v_buf = np.empty(16 * (c_src * rows * tw + {PLANE_GAP}), dtype=out.dtype)",
        f"    m_buf = np.empty(16 * (c_dst * rows * tw + {PLANE_GAP}), dtype=out.dtype)",
        "    band = np.empty((c_src, 2 * rows + 2, 2 * tw + 2), dtype=out.dtype)",
        "    for n in range(n_img):",
        "        for r0 in range(0, th, rows):",
        "            r1 = min(th, r0 + rows)",
        "            tiles = (r1 - r0) * tw",
        f"            vs, ms = c_src * tiles + {PLANE_GAP}, c_dst * tiles + {PLANE_GAP}   # planes apart",
        "            band[:] = 0.0",
        "            for s in range(c_src):",
        "                for r in range(2 * (r1 - r0) + 2):",
        "                    h = 2 * r0 + r - top",
        "                    if 0 <= h < h_in:",
        "                        lo, hi = max(0, left), min(2 * tw + 2, w_in + left)",
        f"                        copy_into(band[s, r, lo:hi], {first}[n, s, h, lo - left:hi - left])",
        *_INPUT_TILES,
    ]


def _source(name, first, flipped, pads, block):
    lines = [
        f"def {name}({first}, w, sh, sw, ph, pw, dh, dw, groups, out):",
        f"    n_img, c_src, h_in, w_in = {first}.shape",
        "    c_dst, h_out, w_out = out.shape[1], out.shape[2], out.shape[3]",
        f"    top, left = {pads}",
        "    th, tw = (h_out + 1) // 2, (w_out + 1) // 2",
        f"    rows = min(th, max(-(-{WINOGRAD_MIN_TILES} // tw), {block} // max(1, 16 * tw * (c_src + c_dst))))",
        *_weight_transform(flipped),
        *_blocks_of_tiles(first),
        "            for xi in range(16):",
        "                np.dot(u[xi], v_buf[xi * vs:xi * vs + c_src * tiles].reshape(c_src, tiles),",
        "                       m_buf[xi * ms:xi * ms + c_dst * tiles].reshape(c_dst, tiles))",
        *_OUTPUT_TILES,
    ]
    return "\n".join(lines)


def cpu_conv2d_winograd_source(name, block=WINOGRAD_BLOCK):
    return (_source(name, "x", False, "ph, pw", block),
            "conv2d 3x3, unit strides: Winograd F(2x2, 3x3), 16 products (BLAS) per block of tile rows")


def cpu_input_grad_winograd_source(name, block=WINOGRAD_BLOCK):
    return (_source(name, "gy", True, "2 - ph, 2 - pw", block),
            "conv2d_input_grad 3x3, unit strides: Winograd F(2x2, 3x3) of g by the filters turned 180 degrees")


# the weight gradient's g tiles: each 2x2 block of g (zero past the output's edge) transformed to A g A^T,
# A = [[1, 0], [1, 1], [1, -1], [0, -1]], into m_buf in the planes' layout of V
_GRAD_TILES = [
    "            for d in range(c_dst):",
    "                for ty in range(r1 - r0):",
    "                    yy = 2 * (r0 + ty)",
    "                    for tx in range(tw):",
    "                        xx = 2 * tx",
    "                        g00 = gy[n, d, yy, xx]",
    "                        g01 = gy[n, d, yy, xx + 1] if xx + 1 < w_out else 0.0",
    "                        g10 = gy[n, d, yy + 1, xx] if yy + 1 < h_out else 0.0",
    "                        g11 = gy[n, d, yy + 1, xx + 1] if yy + 1 < h_out and xx + 1 < w_out else 0.0",
    "                        at = d * tiles + ty * tw + tx",
    *[f"                        a, b = {a}, {b}\n"
      f"                        m_buf[{4 * r} * ms + at] = a\n"
      f"                        m_buf[{4 * r + 1} * ms + at] = a + b\n"
      f"                        m_buf[{4 * r + 2} * ms + at] = a - b\n"
      f"                        m_buf[{4 * r + 3} * ms + at] = -b"
      for r, (a, b) in enumerate([("g00", "g01"), ("g00 + g10", "g01 + g11"), ("g00 - g10", "g01 - g11"),
                                   ("-g10", "-g11")])],
]

# dW[d, s] = G^T S G from the 4x4 sums S[xi] = acc[xi, d, s], G = [[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]]
_WEIGHTS_FROM_SUMS = [
    "    t = np.empty((3, 4), dtype=np.float64)",
    "    for d in range(c_dst):",
    "        for s in range(c_src):",
    "            for j in range(4):",
    "                s0, s1, s2, s3 = acc[j, d, s], acc[4 + j, d, s], acc[8 + j, d, s], acc[12 + j, d, s]",
    "                t[0, j] = s0 + 0.5 * (s1 + s2)",
    "                t[1, j] = 0.5 * (s1 - s2)",
    "                t[2, j] = 0.5 * (s1 + s2) + s3",
    "            for i in range(3):",
    "                out[d, s, i, 0] = t[i, 0] + 0.5 * (t[i, 1] + t[i, 2])",
    "                out[d, s, i, 1] = 0.5 * (t[i, 1] - t[i, 2])",
    "                out[d, s, i, 2] = 0.5 * (t[i, 1] + t[i, 2]) + t[i, 3]",
]


def cpu_weight_grad_winograd_source(name, block=WINOGRAD_BLOCK):
    """The weight gradient by the transposed identity: with y = A^T (U * V) A per tile and U = G w G^T,
    dW = G^T (sum over tiles of (A g A^T) * V) G, the sum over tiles for each of the 16 transform
    elements one product (out channels x tiles) by (tiles x in channels), accumulated (BLAS, beta 1)."""
    lines = [
        f"def {name}(x, gy, sh, sw, ph, pw, dh, dw, groups, out):",
        "    n_img, c_src, h_in, w_in = x.shape",
        "    c_dst, h_out, w_out = gy.shape[1], gy.shape[2], gy.shape[3]",
        "    top, left = ph, pw",
        "    th, tw = (h_out + 1) // 2, (w_out + 1) // 2",
        f"    rows = min(th, max(-(-{WINOGRAD_MIN_TILES} // tw), {block} // max(1, 16 * tw * (c_src + c_dst))))",
        "    acc = np.zeros((16, c_dst, c_src), dtype=out.dtype)",
        "    acc_flat = acc.reshape(16 * c_dst * c_src)",
        *_blocks_of_tiles("x"),
        *_GRAD_TILES,
        "            for xi in range(16):   # acc[xi] += M[xi] (c_dst x tiles) V[xi]^T (tiles x c_src)",
        "                gemm_strided(m_buf, xi * ms, tiles, False, v_buf, xi * vs, tiles, True, acc_flat, xi * c_dst * c_src,",
        "                             c_src, c_dst, c_src, tiles, 1.0)",
        *_WEIGHTS_FROM_SUMS,
    ]
    return ("\n".join(lines),
            "conv2d_weight_grad 3x3, unit strides: Winograd F(2x2, 3x3) transposed, 16 products (BLAS) summed over "
            "blocks of tile rows")
