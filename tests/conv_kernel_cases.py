"""The conv and pool kernels (gradc/ops/conv.py, pool.py) against their numpy references, on one target.

`python conv_kernel_cases.py cpu|cuda` prints the largest difference; for cuda, run it with
NUMBA_ENABLE_CUDASIM=1 (set before numba is imported, hence a subprocess). Shapes are tiny but cover
strides, padding, dilation, groups, ties, NaN and all -inf windows."""
import math
import sys
from functools import partial

import numpy as np

TAPS_TILE = 1000   # a few output rows a band at 32 channels
WINOGRAD_TEST_BLOCK = 2000   # a few tile rows a block at 3 + 4 channels: several blocks an image, the last short


def difference(got, ref):
    """The largest |got - ref|; inf where got has a NaN (an output left unwritten: the kernels' outputs
    start as NaN), which max() would pass over."""
    return float(np.abs(got - ref).max()) if not np.isnan(got).any() else math.inf


FAMILIES = ("conv", "taps", "winograd", "direct1", "direct2", "direct4", "direct8", "pool", "pool_windows",
            "pool_windows_more")
# the windows nets use most: 2x2 stride 2 with and without padding, 3x3 stride 2 padding 1
COMMON_WINDOWS = {(2, 2, 2, 2, 0, 0), (2, 2, 2, 2, 1, 1), (3, 3, 2, 2, 1, 1)}


def worst_error(target, families=FAMILIES):
    """The largest difference over the kernels of `families` (inf when they compared nothing) (a conv family is its kernel and both
    gradients; "directN" the direct kernels summing N output channels at once; "pool" the kernels that take
    the window as arguments, "pool_windows" the CPU's with the window written into their text, on
    COMMON_WINDOWS, and "pool_windows_more" on the other windows; cuda has conv and pool)."""
    from gradc.ops import conv as C, conv_direct as CD, conv_winograd as CW, pool as P
    if target == "cuda":
        from numba import cuda
        from gradc.runtime.cuda import launch_config
        deco = cuda.jit
    else:
        from numba import njit
        from gradc.runtime.kernel_cache import RUNTIME_KERNELS
        deco = njit(cache=False, error_model="numpy", nogil=True)
    ns = {"np": np, "math": math}
    if target == "cuda":
        ns["cuda"] = cuda
    makers = {"conv": C.cpu_conv2d_source, "dx": C.cpu_input_grad_source, "dw": C.cpu_weight_grad_source,
              "mp": P.cpu_max_pool_source, "mpick": P.cpu_max_pick_source, "mgrad": P.cpu_max_grad_source,
              "ap": P.cpu_avg_pool_source, "agrad": P.cpu_avg_grad_source}
    if target == "cuda":
        makers = {"conv": C.cuda_conv2d_source, "dx": C.cuda_input_grad_source, "dw": C.cuda_weight_grad_source,
                  "mp": P.cuda_max_pool_source, "mpick": P.cuda_max_pick_source, "mgrad": P.cuda_max_grad_source,
                  "ap": P.cuda_avg_pool_source, "agrad": P.cuda_avg_grad_source}
    else:   # the CPU's path by taps (unit strides, >= TAPS_MIN_CHANNELS channels a group), with a small
        # tile so that a few output rows make a band: several bands a image, the last one short
        ns.update(RUNTIME_KERNELS)   # gemm_strided, tap_sums, copy_into, ...: what the kernels call
        for ob in (1, 2, 4, 8):   # the direct kernels, for every block of output channels
            makers[f"conv_d{ob}"] = partial(CD.cpu_conv2d_direct_source, ob=ob)
            makers[f"dx_d{ob}"] = partial(CD.cpu_input_grad_direct_source, ob=ob)
            makers[f"dw_d{ob}"] = partial(CD.cpu_weight_grad_direct_source, ob=ob)
        makers.update({"conv_t": partial(C.cpu_conv2d_by_taps_source, tile=TAPS_TILE),
                       "dx_t": partial(C.cpu_input_grad_by_taps_source, tile=TAPS_TILE),
                       "conv_w": partial(CW.cpu_conv2d_winograd_source, block=WINOGRAD_TEST_BLOCK),
                       "dx_w": partial(CW.cpu_input_grad_winograd_source, block=WINOGRAD_TEST_BLOCK),
                       "dw_w": partial(CW.cpu_weight_grad_winograd_source, block=WINOGRAD_TEST_BLOCK)})
    family_of = {"conv": "conv", "dx": "conv", "dw": "conv", "conv_t": "taps", "dx_t": "taps",
                 "conv_w": "winograd", "dx_w": "winograd", "dw_w": "winograd"}
    wanted = lambda nm: family_of.get(nm, f"direct{nm.split('_d')[-1]}" if "_d" in nm else "pool") in families
    grids = {}
    for nm, make in makers.items():
        if not wanted(nm):
            continue
        made = make(nm)
        exec(made[0], ns)
        ns[nm] = deco(ns[nm])
        grids[nm] = made[2] if len(made) > 2 else None

    def run(nm, args, shape):
        out = np.full(shape, np.nan)
        args = list(args) + [out]
        if target == "cuda":
            ns[nm][launch_config(grids[nm], args)](*args)
        else:
            ns[nm](*args)
        return out

    rng = np.random.default_rng(1)
    worst, checked = 0.0, 0   # checked: the kernel results compared (none: the families ran nothing)
    # (channels, outputs, groups, kernel, stride, padding, dilation, H, W[, images]); unit strides take one run
    # of the band per tap: with padding and dilation, several bands of rows (the last one short), and
    # tiles of several whole images (the last tile short)
    conv_cases = [(3, 4, 1, (3, 3), (1, 1), (0, 0), (1, 1), 6, 6), (4, 6, 2, (3, 2), (2, 1), (1, 2), (1, 2), 7, 9),
                  (4, 4, 4, (2, 3), (3, 2), (1, 0), (2, 1), 8, 7), (2, 3, 1, (1, 1), (2, 2), (1, 1), (1, 1), 5, 4),
                  (64, 3, 1, (3, 3), (1, 1), (1, 2), (1, 2), 32, 30), (8, 6, 2, (3, 2), (1, 1), (1, 0), (2, 1), 10, 9, 20)]
    if target == "cuda":   # (the simulator runs a thread in Python: the CPU's tiling cases would take minutes)
        conv_cases = conv_cases[:4]
    for (c, o, G, k, s, p, d, h, w, *n) in conv_cases * ("conv" in families):
        x = rng.standard_normal((n[0] if n else 2, c, h, w)); wt = rng.standard_normal((o, c // G) + k)
        y = C.conv2d_np(x, wt, s, p, d, G); g = rng.standard_normal(y.shape)
        ints = [*s, *p, *d, G]
        for got, ref in [(run("conv", [x, wt, *ints], y.shape), y),
                         (run("dx", [g, wt, *ints], x.shape), C.conv2d_input_grad_np(g, wt, s, p, d, G, (h, w))),
                         (run("dw", [x, g, *ints], wt.shape), C.conv2d_weight_grad_np(x, g, s, p, d, G, k))]:
            worst = max(worst, difference(got, ref))
            checked += 1
    if target == "cpu":
        # (channels, outputs, groups, kernel, padding, dilation, H, W, images), unit strides
        for (c, o, G, k, p, d, h, w, n) in [(32, 8, 1, (3, 3), (1, 1), (1, 1), 9, 7, 2), (64, 6, 2, (3, 2), (1, 2), (2, 1), 10, 9, 3),
                                            (32, 32, 1, (1, 1), (0, 0), (1, 1), 5, 6, 2),
                                            (32, 40, 1, (5, 3), (2, 0), (1, 2), 13, 11, 1)] * ("taps" in families):
            assert c // G >= C.TAPS_MIN_CHANNELS
            x = rng.standard_normal((n, c, h, w)); wt = rng.standard_normal((o, c // G) + k)
            y = C.conv2d_np(x, wt, (1, 1), p, d, G); g = rng.standard_normal(y.shape)
            ints = [1, 1, *p, *d, G]
            for got, ref in [(run("conv_t", [x, wt, *ints], y.shape), y),
                             (run("dx_t", [g, wt, *ints], x.shape), C.conv2d_input_grad_np(g, wt, (1, 1), p, d, G, (h, w)))]:
                worst = max(worst, difference(got, ref))
                checked += 1
        # Winograd F(2x2, 3x3) (the conv and both gradients): 3x3, unit strides and dilations, one group; every padding its input gradient
        # takes (0..2), odd and even sizes (tiles cut at the bottom and right), one pixel, and blocks of a
        # few tile rows (the last one short). The kernels do not depend on the channel threshold.
        for (c, o, p, h, w, n) in [(3, 4, (1, 1), 6, 6, 2), (5, 2, (0, 0), 7, 9, 1), (4, 3, (2, 1), 5, 8, 2),
                                   (3, 3, (1, 1), 1, 1, 1), (3, 4, (1, 2), 29, 13, 2),
                                   (2, 5, (2, 2), 12, 3, 1)] * ("winograd" in families):
            x = rng.standard_normal((n, c, h, w)); wt = rng.standard_normal((o, c, 3, 3))
            y = C.conv2d_np(x, wt, (1, 1), p, (1, 1), 1); g = rng.standard_normal(y.shape)
            ints = [1, 1, *p, 1, 1, 1]
            for got, ref in [(run("conv_w", [x, wt, *ints], y.shape), y),
                             (run("dx_w", [g, wt, *ints], x.shape), C.conv2d_input_grad_np(g, wt, (1, 1), p, (1, 1), 1, (h, w))),
                             (run("dw_w", [x, g, *ints], wt.shape), C.conv2d_weight_grad_np(x, g, (1, 1), p, (1, 1), 1, (3, 3)))]:
                worst = max(worst, difference(got, ref))
                checked += 1
        # Direct (conv_direct.py): unit strides, any kernel, padding (the input gradient's band cropped where
        # the padding exceeds (k - 1) d), dilation and groups; channels made a group not a multiple of the
        # block, a one-pixel output, rows of positions wider than a call's, each block size on each case; the
        # weight gradient also over chunks of images (the last one short)
        for (c, o, G, k, p, d, h, w, n) in [(1, 6, 1, (5, 5), (2, 2), (1, 1), 9, 7, 3), (4, 6, 2, (3, 2), (0, 3), (2, 1), 8, 9, 2),
                                            (3, 17, 1, (2, 3), (1, 2), (1, 2), 6, 6, 2), (2, 3, 1, (3, 3), (3, 2), (1, 1), 7, 5, 2),
                                            (6, 2, 2, (3, 3), (1, 1), (1, 1), 1, 1, 2), (16, 5, 1, (5, 5), (4, 4), (1, 1), 10, 10, 1),
                                            (2, 9, 1, (3, 3), (1, 1), (1, 1), 4, 70, 1), (1, 3, 1, (3, 3), (1, 1), (1, 1), 20, 18, 12)
                                            ] * any(f"direct{ob}" in families for ob in (1, 2, 4, 8)):
            x = rng.standard_normal((n, c, h, w)); wt = rng.standard_normal((o, c // G) + k)
            y = C.conv2d_np(x, wt, (1, 1), p, d, G); g = rng.standard_normal(y.shape)
            ints = [1, 1, *p, *d, G]
            dx, dw = C.conv2d_input_grad_np(g, wt, (1, 1), p, d, G, (h, w)), C.conv2d_weight_grad_np(x, g, (1, 1), p, d, G, k)
            for ob in [ob for ob in (1, 2, 4, 8) if f"direct{ob}" in families]:
                for got, ref in [(run(f"conv_d{ob}", [x, wt, *ints], y.shape), y), (run(f"dx_d{ob}", [g, wt, *ints], x.shape), dx),
                                 (run(f"dw_d{ob}", [x, g, *ints], wt.shape), dw)]:
                    worst = max(worst, difference(got, ref))
                    checked += 1
    pool_cases = [((2, 2), (2, 2), (0, 0), 6, 6), ((3, 3), (2, 2), (1, 1), 7, 8), ((2, 3), (1, 2), (1, 0), 5, 6),
                  ((3, 2), (3, 1), (0, 1), 9, 4), ((3, 3), (1, 1), (1, 1), 4, 5), ((2, 2), (2, 2), (1, 1), 7, 3),
                  ((5, 4), (2, 3), (2, 1), 11, 10), ((2, 2), (2, 2), (0, 0), 7, 5), ((3, 3), (3, 3), (0, 0), 9, 6),
                  ((2, 3), (2, 3), (1, 0), 7, 8), ((2, 2), (2, 2), (1, 1), 6, 6), ((3, 3), (3, 3), (1, 1), 6, 6),
                  ((2, 2), (2, 2), (1, 1), 6, 1), ((1, 1), (1, 1), (0, 0), 3, 4)]
    # (windows that do not overlap, written whole where inside: clipped at the top and left, at the bottom
    # and right, padding that alone decides the zeroing, no inside column, one tap)
    for ties in (False, True):
        for (k, s, p, h, w) in pool_cases:
            x = rng.integers(-2, 3, (2, 3, h, w)).astype(float) if ties else rng.standard_normal((2, 3, h, w))
            if ties:
                x[0, 0, 0, :] = -np.inf
                x[0, 0, 1, min(1, w - 1)] = np.nan
                x[0, 0, 1, 0] = np.nan   # two NaNs in one window: the first wins
                if h > 3 and w > 3:
                    x[0, 2, 3, 3] = np.inf
            y = P.max_pool2d_np(x, k, s, p); g = rng.standard_normal(y.shape); u = rng.standard_normal(x.shape)
            if ties:   # an infinite gradient stays where its window's maximum is, zeros elsewhere
                g[0, 1, 0, 0] = np.inf
            ints = [*k, *s, *p]
            common = tuple(ints) in COMMON_WINDOWS
            if target == "cpu" and ("pool_windows" if common else "pool_windows_more") in families:
                # the window written into the kernel's text: windows inside the input row by row
                nm = f"mp_{'_'.join(map(str, ints))}"
                if nm not in ns:
                    exec(P.cpu_max_pool_source(nm, tuple(ints))[0], ns)
                    ns[nm] = deco(ns[nm])
                out = np.full(y.shape, np.nan)
                ns[nm](x, out)
                assert (np.isnan(out) == np.isnan(y)).all() and (out[~np.isnan(y)] == y[~np.isnan(y)]).all(), (k, s, p)
                # its gradient likewise (windows that do not overlap: written whole, NaN left where none wrote)
                if "g" + nm not in ns:
                    exec(P.cpu_max_grad_source("g" + nm, tuple(ints))[0], ns)
                    ns["g" + nm] = deco(ns["g" + nm])
                dx, ref = np.full(x.shape, np.nan), P.max_pool2d_grad_np(x, g, k, s, p)
                ns["g" + nm](x, g, dx)
                fin = np.isfinite(ref)
                assert (dx[~fin] == ref[~fin]).all() and np.abs(dx[fin] - ref[fin]).max(initial=0.0) <= 1e-12, \
                    (k, s, p)
                assert not np.isnan(dx).any(), (k, s, p)   # every input written
                checked += 1
                dx32 = np.full(x.shape, np.nan, np.float32)   # float32 too (the selects in out's dtype)
                ns["g" + nm](x.astype(np.float32), g.astype(np.float32), dx32)
                assert (dx32[~fin] == ref[~fin]).all() and np.abs(dx32[fin] - ref[fin]).max(initial=0.0) <= 1e-5, (k, s, p)
            if "pool" not in families:
                continue
            for got, ref in [(run("mp", [x, *ints], y.shape), y),
                             (run("mpick", [x, u, *ints], y.shape), P.max_pool2d_pick_np(x, u, k, s, p)),
                             (run("mgrad", [x, g, *ints], x.shape), P.max_pool2d_grad_np(x, g, k, s, p)),
                             (run("ap", [x, *ints], y.shape), P.avg_pool2d_np(x, k, s, p)),
                             (run("agrad", [g, *ints], x.shape), P.avg_pool2d_grad_np(g, k, s, p, (h, w)))]:
                same_nan = np.isnan(got) == np.isnan(ref)
                assert same_nan.all(), (k, s, p)
                fin = np.isfinite(ref)
                assert (got[~fin & ~np.isnan(ref)] == ref[~fin & ~np.isnan(ref)]).all()
                worst = max(worst, float(np.abs(got[fin] - ref[fin]).max()) if fin.any() else 0.0)
                checked += 1
    return worst if checked else math.inf


if __name__ == "__main__":
    print("worst", worst_error(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else FAMILIES))
