"""Kernels of codegen/cuda.py and the numpy each must match (tests/test_cuda_kernels.py)."""
import sympy as sp

from gradc.ops.elementwise import FLAT, SIZE, X
from gradc.ops import get_op
from gradc.ops.labels import CUDA_XENT_GRAD, CUDA_XENT_ROWS, cuda_pick_grad_source, cuda_pick_source
from gradc.ops.layout import cuda_transpose_source
from gradc.ops.random import NormalDraw, stream_key
from gradc.ops.reduce import cuda_argmax_source, cuda_reduction_source
from gradc.ops.softmax import cuda_softmax_source
from gradc.codegen.cuda import CudaKernels
from gradc.codegen.sympy_print import HELPERS

_K = CudaKernels()


def _record_kernel(key, make, *spec):
    """A kernel an op record writes (gradc/ops), defined in _K as its lowering would."""
    return _K._get(key, key[0], lambda name: make(name, *spec))
CASES = []


def _case(id, kernel, args, inputs, out, numpy, classes=None):
    CASES.append({"id": id, "kernel": kernel, "args": args, "inputs": inputs, "out": out, "numpy": numpy,
                  "classes": classes})


# GEMM with every transpose, sizes off the 16x16 tile
for ta in (False, True):
    for tb in (False, True):
        a = (33, 17) if ta else (17, 33)
        b = (5, 33) if tb else (33, 5)
        _case(f"gemm{int(ta)}{int(tb)}", _K.matmul(ta, tb), ["a", "b"], {"a": [a, "f"], "b": [b, "f"]}, [17, 5],
              f"{'a.T' if ta else 'a'} @ {'b.T' if tb else 'b'}")
# the register-tiled GEMM: two block rows (one partial), a partial block column, three K slices
for ta in (False, True):
    for tb in (False, True):
        a = (19, 130) if ta else (130, 19)
        b = (21, 19) if tb else (19, 21)
        _case(f"gemm_tiled{int(ta)}{int(tb)}", _K.matmul_tiled(ta, tb), ["a", "b"], {"a": [a, "f"], "b": [b, "f"]},
              [130, 21], f"{'a.T' if ta else 'a'} @ {'b.T' if tb else 'b'}")
_case("gemm_tiled_fused", _K.matmul_tiled(False, True, a_prologue=X[0] * (1 - sp.tanh(X[1]) ** 2),
                                          epilogue=sp.tanh(X[0] + X[1]), epilogue_patterns=[(-1, 1)]),
      ["g", "z", "w", "c"], {"g": [[130, 19], "f"], "z": [[130, 19], "f"], "w": [[21, 19], "f"], "c": [[1, 21], "f"]},
      [130, 21], "np.tanh((g * (1 - np.tanh(z) ** 2)) @ w.T + c)")
# the forward's GEMM with its bias and activation in the epilogue
_case("gemm_bias_tanh", _K.matmul(False, False, epilogue=sp.tanh(X[0] + X[1]), epilogue_patterns=[(-1, 1)]),
      ["x", "w", "b"], {"x": [[19, 18], "f"], "w": [[18, 21], "f"], "b": [[1, 21], "f"]}, [19, 21], "np.tanh(x @ w + b)")
# the backward's dX = (g * tanh'(z)) W^T and dW = X^T (g * tanh'(z)), the prologue in the tile load
prologue = X[0] * (1 - sp.tanh(X[1]) ** 2)
_case("gemm_dx_prologue", _K.matmul(False, True, a_prologue=prologue), ["g", "z", "w"],
      {"g": [[19, 21], "f"], "z": [[19, 21], "f"], "w": [[18, 21], "f"]}, [19, 18], "(g * (1 - np.tanh(z) ** 2)) @ w.T")
_case("gemm_dw_prologue", _K.matmul(True, False, b_prologue=prologue), ["x", "g", "z"],
      {"x": [[19, 18], "f"], "g": [[19, 21], "f"], "z": [[19, 21], "f"]}, [18, 21], "x.T @ (g * (1 - np.tanh(z) ** 2))")
# split-K: the slices' partial products (slice q takes tile steps [q s // S, (q + 1) s // S) of s), one slice
# empty when there are more slices than steps; then their sum with the epilogue
_SLICE = "np.stack([{a}[16 * (q * {s} // {S}):16 * ((q + 1) * {s} // {S})]{t} @ {b}[16 * (q * {s} // {S}):16 * ((q + 1) * {s} // {S})] for q in range({S})])"
_case("gemm_slices", _K.matmul_split(True, False, X[0], X[0]), ["a", "b"], {"a": [[75, 18], "f"], "b": [[75, 21], "f"]},
      [3, 18, 21], _SLICE.format(a="a", t=".T", b="b", s=5, S=3))
_case("gemm_slices_prologue", _K.matmul_split(True, False, X[0], prologue),
      ["x", "g", "z"], {"x": [[37, 18], "f"], "g": [[37, 21], "f"], "z": [[37, 21], "f"]}, [4, 18, 21],
      _SLICE.format(a="x", t=".T", b="(g * (1 - np.tanh(z) ** 2))", s=3, S=4))
_case("gemm_slices_sum", _K.split_sum(sp.tanh(X[0] + X[1]), [(-1, 1)]), ["parts", "c"],
      {"parts": [[5, 19, 21], "f"], "c": [[1, 21], "f"]}, [19, 21], "np.tanh(parts.sum(0) + c)")
# softmax cross-entropy, fused: per-row losses and the gradient of their mean
_case("xent_rows", _K._get(("xent_rows",), "xent_rows", CUDA_XENT_ROWS), ["x", "y"], {"x": [[6, 5], "f"], "y": [[6], "labels"]}, [6],
      "np.log(np.exp(x).sum(1)) - x[np.arange(6), y]", classes=5)
_case("xent_grad", _K._get(("xent_grad",), "xent_grad", CUDA_XENT_GRAD), ["x", "y", "g"], {"x": [[6, 5], "f"], "y": [[6], "labels"], "g": [[6], "f"]},
      [6, 5], "(np.exp(x) / np.exp(x).sum(1, keepdims=True) - np.eye(5)[y]) * g[:, None]", classes=5)
# fused elementwise: a derived backward prologue g * tanh'(z) with a broadcast bias, and a scalar operand
expr = X[0] * (1 - sp.tanh(X[1] + X[2]) ** 2) * X[3]
_case("fused_tanh_grad", _K.elementwise(expr, [(0, 1), (0, 1), (-1, 1), None], 2, "tanh_grad"),
      ["g", "z", "b", "s"], {"g": [[6, 7], "f"], "z": [[6, 7], "f"], "b": [[1, 7], "f"], "s": [[1], "f"]}, [6, 7],
      "g * (1 - np.tanh(z + b) ** 2) * s[0]")
sig = get_op("sigmoid").expr
_case("sigmoid_rank1", _K.elementwise(sig, [(0,)], 1, "sigmoid"), ["x"], {"x": [[9], "f"]}, [9],
      "1 / (1 + np.exp(-x))")
# reductions over various axes
_case("sum_rows", _record_kernel(("reduce", "sum", 2, (0,), False), cuda_reduction_source, "sum", 2, (0,), False), ["x"], {"x": [[7, 5], "f"]}, [5], "x.sum(0)")
_case("mean_keep", _record_kernel(("reduce", "mean", 3, (1, 2), True), cuda_reduction_source, "mean", 3, (1, 2), True), ["x"], {"x": [[3, 4, 5], "f"]}, [3, 1, 1],
      "x.mean((1, 2), keepdims=True)")
_case("max_all", _record_kernel(("reduce", "max", 2, (0, 1), False), cuda_reduction_source, "max", 2, (0, 1), False), ["x"], {"x": [[4, 6], "f"]}, [1], "x.max()")
# long reductions with few kept indices: fold lanes that stride (warps along the kept axis, or along the
# reduced last axis), then a tree; sizes off every power of two
_case("sum_long_rows", _record_kernel(("reduce", "sum", 2, (0,), False), cuda_reduction_source, "sum", 2, (0,), False), ["x"], {"x": [[301, 3], "f"]}, [3], "x.sum(0)")
_case("mean_last", _record_kernel(("reduce", "mean", 2, (1,), False), cuda_reduction_source, "mean", 2, (1,), False), ["x"], {"x": [[5, 67], "f"]}, [5], "x.mean(1)")
_case("max_outer_inner_keep", _record_kernel(("reduce", "max", 3, (0, 2), True), cuda_reduction_source, "max", 3, (0, 2), True), ["x"], {"x": [[9, 3, 13], "f"]}, [1, 3, 1],
      "x.max((0, 2), keepdims=True)")
# several kept lanes a block: 4 kept indices x 2 fold lanes (along memory: fold lanes when the last axis is reduced)
_case("sum_last_short", _record_kernel(("reduce", "sum", 2, (1,), False), cuda_reduction_source, "sum", 2, (1,), False), ["x"], {"x": [[9, 2], "f"]}, [9], "x.sum(1)")
_case("max_first_short", _record_kernel(("reduce", "max", 2, (0,), False), cuda_reduction_source, "max", 2, (0,), False), ["x"], {"x": [[2, 9], "f"]}, [9], "x.max(0)")
_case("sum_middle", _record_kernel(("reduce", "sum", 3, (1,), False), cuda_reduction_source, "sum", 3, (1,), False), ["x"], {"x": [[3, 41, 11], "f"]}, [3, 11], "x.sum(1)")
_case("argmax_cols", _record_kernel(("argmax_mask", 2, (1,)), cuda_argmax_source, 2, (1,)), ["x"], {"x": [[5, 4], "f"]}, [5, 4],
      "(np.arange(4)[None, :] == x.argmax(1)[:, None]).astype(float)")
# softmax family along the last and the first axis
_case("log_softmax", _record_kernel(("log_softmax", 2, 1), cuda_softmax_source, "log_softmax", 2, 1), ["x"], {"x": [[5, 7], "f"]}, [5, 7],
      "x - x.max(1, keepdims=True) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))")
_case("softmax_axis0", _record_kernel(("softmax", 2, 0), cuda_softmax_source, "softmax", 2, 0), ["x"], {"x": [[4, 3], "f"]}, [4, 3],
      "np.exp(x - x.max(0)) / np.exp(x - x.max(0)).sum(0)")
# labels
_case("pick", _record_kernel(("pick", 2), cuda_pick_source, 2), ["x", "y"], {"x": [[6, 4], "f"], "y": [[6], "labels"]}, [6],
      "x[np.arange(6), y]", classes=4)
_case("pick_grad", _record_kernel(("pick_grad", 2), cuda_pick_grad_source, 2), ["g", "y"], {"g": [[6], "f"], "y": [[6], "labels"]},
      [6, 4], "np.eye(4)[y] * g[:, None]", classes=4)
# a sequence's labels (T, B): rank 3
_case("pick_rank3", _record_kernel(("pick", 3), cuda_pick_source, 3), ["x", "y"], {"x": [[3, 5, 4], "f"], "y": [[3, 5], "labels"]},
      [3, 5], "np.take_along_axis(x, y[..., None], -1)[..., 0]", classes=4)
_case("pick_grad_rank3", _record_kernel(("pick_grad", 3), cuda_pick_grad_source, 3), ["g", "y"],
      {"g": [[3, 5], "f"], "y": [[3, 5], "labels"]}, [3, 5, 4], "np.eye(4)[y] * g[..., None]", classes=4)
# every axis reduced (a loss): one block, more elements than threads, so both the strided loop and the tree run
_case("sum_all", _record_kernel(("reduce", "sum", 2, (0, 1), False), cuda_reduction_source, "sum", 2, (0, 1), False), ["x"], {"x": [[23, 29], "f"]}, [1], "x.sum()")
_case("mean_all_keep", _record_kernel(("reduce", "mean", 2, (0, 1), True), cuda_reduction_source, "mean", 2, (0, 1), True), ["x"], {"x": [[23, 29], "f"]}, [1, 1], "x.mean()")
_case("max_all", _record_kernel(("reduce", "max", 1, (0,), False), cuda_reduction_source, "max", 1, (0,), False), ["x"], {"x": [[301], "f"]}, [1], "x.max()")
_case("sum_squares", _K.sum_squares(), ["x"], {"x": [[517], "f"]}, [1], "(x * x).sum()")
# normal draws computed in the kernels that read them (passes/fusion.py): paired halves of an odd count, in an
# elementwise kernel and in each GEMM's epilogue (its element: row * n + col)
_SEEDS = {"seed": [[1], "int", -3], "half": [[1], "int", 1]}
_DRAW = "draw('normal', 0.0, -3, 5, {shape}, 1)"
drawn = NormalDraw(X[0], X[1], stream_key(5), FLAT, SIZE)
_case("normal_draw", _K.elementwise(X[2] * drawn, [None, None, (0, 1)], 2, "normaldraw"), ["seed", "half", "z"],
      {**_SEEDS, "z": [[7, 9], "f"]}, [7, 9], "z * " + _DRAW.format(shape=(7, 9)))
epilogue = X[0] + NormalDraw(X[1], X[2], stream_key(5), FLAT, SIZE)
_case("gemm_draw", _K.matmul(False, False, epilogue=epilogue, epilogue_patterns=[(), ()]), ["x", "w", "seed", "half"],
      {"x": [[19, 18], "f"], "w": [[18, 21], "f"], **_SEEDS}, [19, 21], "x @ w + " + _DRAW.format(shape=(19, 21)))
_case("gemm_tiled_draw", _K.matmul_tiled(False, False, epilogue=epilogue, epilogue_patterns=[(), ()]),
      ["x", "w", "seed", "half"], {"x": [[130, 19], "f"], "w": [[19, 21], "f"], **_SEEDS}, [130, 21],
      "x @ w + " + _DRAW.format(shape=(130, 21)))
_case("gemm_slices_sum_draw", _K.split_sum(epilogue, [(), ()]), ["parts", "seed", "half"],
      {"parts": [[3, 19, 21], "f"], **_SEEDS}, [19, 21], "parts.sum(0) + " + _DRAW.format(shape=(19, 21)))
_case("transpose", _record_kernel(("transpose", (1, 0, 2)), cuda_transpose_source, (1, 0, 2)), ["x"], {"x": [[2, 3, 4], "f"]}, [3, 2, 4], "x.transpose(1, 0, 2)")


UPDATES = {opt + part: make(opt) for opt in ("sgd", "adam")
           for part, make in (("", _K.optimizer_update), ("_check", _K.optimizer_check))}


def build_module():
    """The kernels as a module, as the CUDA target will write them (float64 shared tiles)."""
    lines = ["import math", "import numpy as np", "from numba import float64 as FLOAT_T, float64", "from gradc.runtime.cuda import load_cuda",
             "cuda = load_cuda()", ""]
    for h in sorted(_K.helpers):
        lines += ["@cuda.jit(device=True)", HELPERS[h], ""]
    for name, source, _ in _K.sources:
        lines += ["@cuda.jit", source, ""]
    lines.append(f"LAUNCH = {_K.launch!r}")
    return "\n".join(lines) + "\n"
