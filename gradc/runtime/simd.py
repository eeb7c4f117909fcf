"""The inner loops of the direct convolutions (gradc/ops/conv_direct.py), with their accumulators
held in vector registers: written in LLVM IR through Numba's `intrinsic`.

    tap_sums: acc[u, q0 + p] = sum over taps k of wb[k, u] * xp[tap[k] + q0 + p]
              (a conv, or its input gradient: a block of output channels u at consecutive positions p
              of a zero-padded band, every tap k a channel and kernel offset, tap[k] its shift)
    tap_dots: sums[k, u, :] += sum over images and positions p of band[tap[k] + p] * gp[u, p]
              (a weight gradient: g's rows laid out at the band's pitch, summed into LANES partial sums)

Each call keeps eight accumulator vectors of LANES values (64 bytes: 16 float32, 8 float64; one
AVX-512 register, two AVX2 ones, which LLVM splits them into) as out_block channels times
8 // out_block vectors of positions (or taps), and makes per step one vector load per position
vector (or tap), one broadcast weight (or g vector) per channel, and eight fused multiply-adds.
Numba cannot: its loop vectoriser vectorises the innermost loop, and with the sum over taps outside
it each multiply-add also loads and stores its accumulator (the store port then bounds it: about
30 GF/s on one core here, against about 90 in registers); LLVM's SLP vectoriser, which could pack
scalar accumulators, Numba turns off (miscompilations, numba#8852). Fused multiply-adds round once
where a multiply and an add round twice, as BLAS's do.

The callers guarantee the bounds (nothing here checks them): every vector read lies inside its array
(the kernels pad the band by a call's positions), all arrays C-contiguous.
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

ACCUMULATORS = 8    # vectors a call sums into: out_block channels of 8 // out_block vectors of positions
VECTOR_BYTES = 64   # LANES = VECTOR_BYTES // itemsize


def lanes(itemsize):
    """Values of one accumulator vector (LANES)."""
    return VECTOR_BYTES // itemsize


def _vectors(context, builder, dtype, count):
    """The vector type of LANES values of dtype, LLVM's fused multiply-add on it, and `count` accumulator
    vectors set to zero (allocas of the entry block, which LLVM promotes to registers)."""
    fty = context.get_value_type(dtype)
    n = lanes(context.get_abi_sizeof(fty))
    vty = ir.VectorType(fty, n)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty, vty, vty]),
                                         f"llvm.fma.v{n}f{64 if dtype == types.float64 else 32}")
    zero = ir.Constant(vty, [ir.Constant(fty, 0.0)] * n)
    return vty, n, fma, [cgutils.alloca_once_value(builder, zero) for _ in range(count)]


@intrinsic(prefer_literal=True)
def _tap_sums(typingctx, xp, q0, wb, tap, acc, out_block, pos_block):
    floats = ((xp, 1), (wb, 2), (acc, 2))
    if not (all(isinstance(a, types.Array) and a.layout == "C" and a.ndim == nd and a.dtype == xp.dtype
                for a, nd in floats) and xp.dtype in (types.float32, types.float64)
            and isinstance(tap, types.Array) and tap.layout == "C" and tap.dtype == types.int64
            and isinstance(q0, types.Integer) and isinstance(out_block, types.IntegerLiteral)
            and isinstance(pos_block, types.IntegerLiteral)):
        raise TypingError("tap_sums takes C-contiguous float32 or float64 arrays xp (1-D), wb and acc (2-D), "
                          "int64 taps, an integer q0 and constant blocks")
    n_out, n_vec = out_block.literal_value, pos_block.literal_value
    sig = types.void(xp, q0, wb, tap, acc, out_block, pos_block)

    def codegen(context, builder, sig, args):
        xp_v, q0_v, wb_v, tap_v, acc_v = args[:5]
        q0_v = context.cast(builder, q0_v, sig.args[1], types.int64)
        vty, n, fma, flat = _vectors(context, builder, sig.args[0].dtype, n_out * n_vec)
        sums = [flat[u * n_vec:(u + 1) * n_vec] for u in range(n_out)]
        i64 = ir.IntType(64)
        band, weights, taps, out = (context.make_array(t)(context, builder, v)
                                    for t, v in zip((sig.args[0], sig.args[2], sig.args[3], sig.args[4]),
                                                    (xp_v, wb_v, tap_v, acc_v)))
        zero_mask = ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n)
        with cgutils.for_range(builder, builder.extract_value(taps.shape, 0)) as loop:
            k = loop.index
            at = builder.add(builder.load(builder.gep(taps.data, [k])), q0_v)
            xs = [builder.load(builder.bitcast(builder.gep(band.data, [builder.add(at, ir.Constant(i64, p * n))]),
                                               vty.as_pointer()), align=1) for p in range(n_vec)]
            row = builder.mul(k, ir.Constant(i64, n_out))
            for u in range(n_out):
                w = builder.load(builder.gep(weights.data, [builder.add(row, ir.Constant(i64, u))]))
                w = builder.insert_element(ir.Constant(vty, ir.Undefined), w, ir.Constant(ir.IntType(32), 0))
                w = builder.shuffle_vector(w, ir.Constant(vty, ir.Undefined), zero_mask)
                for p, x in enumerate(xs):
                    builder.store(builder.call(fma, [w, x, builder.load(sums[u][p])]), sums[u][p])
        pitch = builder.extract_value(out.shape, 1)
        for u in range(n_out):
            for p in range(n_vec):
                at = builder.add(builder.mul(pitch, ir.Constant(i64, u)), builder.add(q0_v, ir.Constant(i64, p * n)))
                builder.store(builder.load(sums[u][p]), builder.bitcast(builder.gep(out.data, [at]), vty.as_pointer()),
                              align=1)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def tap_sums(xp, q0, wb, tap, acc, out_block):
    """acc[u, q0:q0 + 8 // out_block * LANES] = the sum over k of wb[k, u] * xp[tap[k] + q0:][:...] for
    u < out_block (1, 2, 4 or 8), see the module: eight accumulator vectors, as out_block channels of
    8 // out_block vectors of positions each."""
    if out_block == 8:
        _tap_sums(xp, q0, wb, tap, acc, 8, 1)
    elif out_block == 4:
        _tap_sums(xp, q0, wb, tap, acc, 4, 2)
    elif out_block == 2:
        _tap_sums(xp, q0, wb, tap, acc, 2, 4)
    else:
        _tap_sums(xp, q0, wb, tap, acc, 1, 8)


@intrinsic(prefer_literal=True)
def _tap_dots(typingctx, band, gp, tap, k0, o0, images, sums, tap_block, out_block):
    shapes = ((band, 2), (gp, 3), (sums, 3))
    if not (all(isinstance(a, types.Array) and a.layout == "C" and a.ndim == nd and a.dtype == band.dtype
                for a, nd in shapes) and band.dtype in (types.float32, types.float64)
            and isinstance(tap, types.Array) and tap.layout == "C" and tap.dtype == types.int64
            and all(isinstance(i, types.Integer) for i in (k0, o0, images))
            and isinstance(tap_block, types.IntegerLiteral) and isinstance(out_block, types.IntegerLiteral)):
        raise TypingError("tap_dots takes C-contiguous float32 or float64 arrays band (2-D), gp and sums (3-D), "
                          "int64 taps, integer k0, o0 and images, and constant blocks")
    n_tap, n_out = tap_block.literal_value, out_block.literal_value
    sig = types.void(band, gp, tap, k0, o0, images, sums, tap_block, out_block)

    def codegen(context, builder, sig, args):
        k0_v, o0_v, images_v = (context.cast(builder, v, t, types.int64) for v, t in zip(args[3:6], sig.args[3:6]))
        vty, n, fma, flat = _vectors(context, builder, sig.args[0].dtype, n_tap * n_out)
        sums = [flat[t * n_out:(t + 1) * n_out] for t in range(n_tap)]
        i64 = ir.IntType(64)
        const = lambda v: ir.Constant(i64, v)
        bands, grads, taps, out = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 1, 2, 6))
        band_len = builder.extract_value(bands.shape, 1)
        rows, n_pos = builder.extract_value(grads.shape, 1), builder.extract_value(grads.shape, 2)
        offsets = [builder.load(builder.gep(taps.data, [builder.add(k0_v, const(t))])) for t in range(n_tap)]
        with cgutils.for_range(builder, images_v) as image:
            band0 = builder.mul(image.index, band_len)
            grad0 = builder.mul(image.index, builder.mul(rows, n_pos))
            x_at = [builder.add(band0, off) for off in offsets]
            g_at = [builder.add(grad0, builder.mul(builder.add(o0_v, const(u)), n_pos)) for u in range(n_out)]
            with cgutils.for_range(builder, builder.udiv(n_pos, const(n))) as step:
                p = builder.mul(step.index, const(n))
                load = lambda arr, at: builder.load(builder.bitcast(builder.gep(arr.data, [builder.add(at, p)]),
                                                                    vty.as_pointer()), align=1)
                xs = [load(bands, at) for at in x_at]
                gs = [load(grads, at) for at in g_at]
                for t, x in enumerate(xs):
                    for u, g in enumerate(gs):
                        builder.store(builder.call(fma, [x, g, builder.load(sums[t][u])]), sums[t][u])
        width = builder.extract_value(out.shape, 1)
        for t in range(n_tap):
            for u in range(n_out):
                at = builder.mul(builder.add(builder.mul(builder.add(k0_v, const(t)), width),
                                             builder.add(o0_v, const(u))), const(n))
                ptr = builder.bitcast(builder.gep(out.data, [at]), vty.as_pointer())
                builder.store(builder.fadd(builder.load(ptr, align=1), builder.load(sums[t][u])), ptr, align=1)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def tap_dots(band, gp, tap, k0, o0, images, sums, out_block):
    """sums[k0 + t, o0 + u, :] += the sum over images i < `images` and positions p of
    band[i, tap[k0 + t] + p] * gp[i, o0 + u, p], as LANES partial sums (see the module): eight
    accumulator vectors, as 8 // out_block taps of out_block (1, 2, 4 or 8) channels each."""
    if out_block == 8:
        _tap_dots(band, gp, tap, k0, o0, images, sums, 1, 8)
    elif out_block == 4:
        _tap_dots(band, gp, tap, k0, o0, images, sums, 2, 4)
    elif out_block == 2:
        _tap_dots(band, gp, tap, k0, o0, images, sums, 4, 2)
    else:
        _tap_dots(band, gp, tap, k0, o0, images, sums, 8, 1)
