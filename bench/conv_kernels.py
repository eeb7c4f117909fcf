"""One CPU conv kernel at a time, on one thread: the path gradc picks against im2col (the path every
conv took before the faster ones) and torch's own conv on one thread (oneDNN), float32.

For each shape (images, in channels, size, out channels, kernel, padding; unit strides) and each of
the conv, its input gradient and its weight gradient: the best of `--repeat` calls, in ms.

    python bench/conv_kernels.py            # the shapes below
    python bench/conv_kernels.py --repeat 3
"""
import argparse
import os
import sys
import time

import numpy as np
from numba import njit

from gradc.ops import conv as C, conv_direct as CD, conv_winograd as CW
from gradc.runtime import blas
from gradc.runtime.blas import gemm_strided
from gradc.runtime.simd import tap_dots, tap_sums

# (images, in channels, height = width, out channels, kernel, padding)
SHAPES = [(64, 1, 28, 6, 5, 2), (64, 6, 14, 16, 5, 0), (64, 16, 14, 32, 3, 1), (16, 3, 56, 16, 3, 1),
          (8, 64, 28, 8, 3, 1), (4, 32, 56, 32, 5, 2), (8, 64, 56, 64, 3, 1), (2, 256, 14, 256, 3, 1)]
OPS = ("conv", "input grad", "weight grad")


def compiled(source):
    ns = {"np": np, "gemm_strided": gemm_strided, "tap_sums": tap_sums, "tap_dots": tap_dots}
    exec(source[0], ns)
    return njit(error_model="numpy", nogil=True)(ns["k"])


def picked(op, attrs, w_shape, out_hw, g_rows, w_in):
    """The kernel source gradc's lowering picks for this op (conv.py's _lower, in its order), and its path
    (out_hw: the height and width of the image the op makes; g_rows, w_in: the conv's output rows and
    input width, as the lowering gives by_taps; float32)."""
    input_grad, weight_grad = op == "input grad", op == "weight grad"
    winograd = {"conv": CW.cpu_conv2d_winograd_source, "input grad": CW.cpu_input_grad_winograd_source,
                "weight grad": CW.cpu_weight_grad_winograd_source}[op]
    direct = {"conv": CD.cpu_conv2d_direct_source, "input grad": CD.cpu_input_grad_direct_source,
              "weight grad": CD.cpu_weight_grad_direct_source}[op]
    if CW.winograd(attrs, w_shape, out_hw, input_grad):
        return winograd("k"), "winograd"
    if CD.direct(attrs, w_shape, input_grad, weight_grad):
        made = w_shape[1] if input_grad else w_shape[0]
        if weight_grad:
            return direct("k", CD.weight_grad_block(made)), "direct"
        return direct("k", CD.out_block(made, CD.band_positions(*out_hw, w_shape[3], 1), 4)), "direct"
    if not weight_grad and C.by_taps(attrs, w_shape, g_rows, w_in, input_grad):
        return (C.cpu_input_grad_by_taps_source if input_grad else C.cpu_conv2d_by_taps_source)("k"), "taps"
    return None, "im2col"


def best(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    blas.set_threads(1)
    im2col = {"conv": compiled(C.cpu_conv2d_source("k")), "input grad": compiled(C.cpu_input_grad_source("k")),
              "weight grad": compiled(C.cpu_weight_grad_source("k"))}
    print(f"# conv_kernels: one thread, float32, numpy {np.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores; best of {args.repeat}, ms")
    print("\n| images, in -> out channels, size, kernel | op | gradc path | gradc | im2col | torch | gradc / torch |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for n, c, hw, o, k, p in SHAPES:
        x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
        w = rng.standard_normal((o, c, k, k)).astype(np.float32)
        xt, wt = torch.from_numpy(x), torch.from_numpy(w)
        y = torch.nn.functional.conv2d(xt, wt, padding=p)
        g = rng.standard_normal(tuple(y.shape)).astype(np.float32)
        gt = torch.from_numpy(g)
        attrs = {"stride": (1, 1), "padding": (p, p), "dilation": (1, 1), "groups": 1}
        ints = (1, 1, p, p, 1, 1, 1)
        calls = {"conv": ((x, w), np.empty(y.shape, np.float32), lambda: torch.nn.functional.conv2d(xt, wt, padding=p)),
                 "input grad": ((g, w), np.empty(x.shape, np.float32),
                                lambda: torch.ops.aten.convolution_backward(gt, xt, wt, None, [1, 1], [p, p], [1, 1], False,
                                                                            [0, 0], 1, [True, False, False])),
                 "weight grad": ((x, g), np.empty(w.shape, np.float32),
                                 lambda: torch.ops.aten.convolution_backward(gt, xt, wt, None, [1, 1], [p, p], [1, 1],
                                                                             False, [0, 0], 1, [False, True, False]))}
        for op in OPS:
            operands, out, torch_call = calls[op]
            made_hw = (x if op == "input grad" else y).shape[2:]
            source, path = picked(op, attrs, w.shape, made_hw, y.shape[2], x.shape[3])
            kernel = im2col[op] if source is None else compiled(source)
            t_gradc = best(lambda: kernel(*operands, *ints, out), args.repeat)
            t_im2col = t_gradc if source is None else best(lambda: im2col[op](*operands, *ints, out), args.repeat)
            t_torch = best(torch_call, args.repeat)
            print(f"| {n}, {c} -> {o}, {hw} x {hw}, {k} x {k} | {op} | {path} | {t_gradc:.2f} | {t_im2col:.2f} | "
                  f"{t_torch:.2f} | {t_gradc / t_torch:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
