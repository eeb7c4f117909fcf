"""conv2d, max_pool2d, avg_pool2d: values, gradients and HVPs against torch.nn.functional (float64
double backward) and central finite differences, through the numpy interpreter; bad arguments."""
import json
import os
import re

import numpy as np
import pytest

import gradc as gc
from gradc.interpret import evaluate
from gradc.ops import conv as C, conv_direct
from gradc.passes.pipeline import build_training_graph

from conftest import assert_grads_match_fd, cuda_script, split_every_conv

torch = pytest.importorskip("torch")
F = torch.nn.functional

HERE = os.path.basename(__file__)

# (C, O, groups, kernel, stride, padding, dilation, H, W)
CONV_CASES = [
    (3, 4, 1, 3, 1, 0, 1, 6, 6),
    (4, 6, 2, (3, 2), (2, 1), (1, 2), (1, 2), 7, 9),
    (4, 4, 4, (2, 3), (3, 2), (1, 0), (2, 1), 8, 7),      # depthwise, strides that skip the last rows
    (2, 3, 1, 1, 2, 1, 1, 5, 4),                          # 1x1 kernel, padding only
    (6, 4, 2, 3, 2, 2, 2, 9, 10),
]


def _interp(model, params, inputs, order=1, tangents=None):
    graph = build_training_graph(model, "float64", order=order)
    nodes = {("obj", None): graph.objective}
    nodes |= {("grad", k): v for k, v in graph.grads.items() if v is not None}
    nodes |= {("igrad", k): v for k, v in graph.input_grads.items() if v is not None}
    if order == 2:
        nodes |= {("hvp", k): v for k, v in graph.hvps.items() if v is not None}
    out = evaluate(graph, params, inputs, list(nodes.values()), tangents=tangents)
    return {key: out[n] for key, n in nodes.items()}


def _t(a):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


@pytest.mark.parametrize("case", CONV_CASES, ids=[str(i) for i in range(len(CONV_CASES))])
def test_conv2d_value_and_gradients_match_torch(case, rng):
    c, o, groups, k, s, p, d, h, w = case
    kk = (k, k) if isinstance(k, int) else k
    m = gc.Model("conv")
    x = m.input("x", ("B", c, h, w))
    wt = m.param("w", (o, c // groups) + kk)
    b = m.param("b", (o,))
    y = gc.conv2d(x, wt, b, stride=s, padding=p, dilation=d, groups=groups)
    r = rng.standard_normal((1,) + y.shape[1:])
    m.minimize(gc.sum(gc.tanh(y) * r))
    xv, wv, bv = rng.standard_normal((2, c, h, w)), rng.standard_normal(wt.shape), rng.standard_normal(o)
    got = _interp(m, {"w": wv, "b": bv}, {"x": xv})

    xt, wtt, bt = _t(xv), _t(wv), _t(bv)
    yt = F.conv2d(xt, wtt, bt, stride=s, padding=p, dilation=d, groups=groups)
    assert tuple(yt.shape[1:]) == y.shape[1:]
    loss = (torch.tanh(yt) * torch.tensor(r)).sum()
    gx, gw, gb = torch.autograd.grad(loss, (xt, wtt, bt))
    np.testing.assert_allclose(got[("obj", None)], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got[("grad", "w")], gw.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[("grad", "b")], gb.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[("igrad", "x")], gx.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [CONV_CASES[1], CONV_CASES[2]], ids=["groups2", "depthwise"])
def test_conv2d_gradients_match_finite_differences(case, rng):
    c, o, groups, k, s, p, d, h, w = case
    kk = (k, k) if isinstance(k, int) else k
    m = gc.Model("conv_fd")
    x = m.input("x", (1, c, h, w))
    wt = m.param("w", (o, c // groups) + kk)
    y = gc.conv2d(x, wt, stride=s, padding=p, dilation=d, groups=groups)
    m.minimize(gc.sum(gc.sin(y) * rng.standard_normal(y.shape)))
    assert_grads_match_fd(m, {"w": rng.standard_normal(wt.shape)}, {"x": rng.standard_normal((1, c, h, w))})


# (kernel, stride, padding, H, W)
POOL_CASES = [
    (2, None, 0, 6, 6),
    (3, 2, 1, 7, 8),
    ((2, 3), (1, 2), (1, 0), 5, 6),
    ((3, 2), (3, 1), (0, 1), 9, 4),
    (3, 1, 1, 4, 5),              # overlapping windows: gradients add up
]


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
@pytest.mark.parametrize("case", POOL_CASES, ids=[str(i) for i in range(len(POOL_CASES))])
@pytest.mark.parametrize("ties", [False, True])
def test_pools_match_torch(pool, case, ties, rng):
    k, s, p, h, w = case
    m = gc.Model("pool")
    x = m.input("x", ("B", 3, h, w))
    sc = m.param("sc", (3, 1, 1))
    y = getattr(gc, pool)(x * sc, k, stride=s, padding=p)
    r = rng.standard_normal((1,) + y.shape[1:])
    m.minimize(gc.sum(y * r))
    # ties: small integers, so that many windows hold their maximum twice (the first one wins)
    xv = rng.integers(-2, 3, (2, 3, h, w)).astype(np.float64) if ties else rng.standard_normal((2, 3, h, w))
    scv = rng.uniform(0.5, 1.5, (3, 1, 1)) if not ties else np.ones((3, 1, 1))
    got = _interp(m, {"sc": scv}, {"x": xv})
    xt, st = _t(xv), _t(scv)
    yt = getattr(F, pool)(xt * st, k, stride=s, padding=p)
    assert tuple(yt.shape[1:]) == y.shape[1:]
    loss = (yt * torch.tensor(r)).sum()
    gx, gs = torch.autograd.grad(loss, (xt, st))
    np.testing.assert_allclose(got[("obj", None)], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got[("igrad", "x")], gx.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got[("grad", "sc")], gs.numpy(), rtol=1e-10, atol=1e-12)


def test_max_pool_of_an_all_minus_inf_window_sends_the_gradient_where_torch_does():
    m = gc.Model("pool_inf")
    x = m.input("x", (1, 1, 3, 3))
    m.minimize(gc.sum(gc.max_pool2d(x, 2, stride=1, padding=1)))
    xv = np.full((1, 1, 3, 3), -np.inf)
    xv[0, 0, 2, 2] = 1.0
    got = _interp(m, {}, {"x": xv})
    xt = _t(xv)
    (gx,) = torch.autograd.grad(F.max_pool2d(xt, 2, stride=1, padding=1).sum(), xt)
    np.testing.assert_array_equal(got[("igrad", "x")], gx.numpy())


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
def test_pool_gradients_match_finite_differences(pool, rng):
    m = gc.Model("pool_fd")
    x = m.input("x", (2, 2, 5, 7))
    y = getattr(gc, pool)(gc.tanh(x), (3, 2), stride=(2, 1), padding=1)
    m.minimize(gc.sum(gc.square(y) * rng.standard_normal(y.shape)))
    assert_grads_match_fd(m, {}, {"x": rng.standard_normal((2, 2, 5, 7))})


# ---- second order: HVPs against torch's double backward --------------------------------------------
def _hvp_net(name, groups):
    m = gc.Model(name)
    x = m.input("x", ("B", 2, 9, 8))
    y = m.input("y", ("B",), dtype="int64")
    p = {"w1": m.param("w1", (4, 2, 3, 3)), "b1": m.param("b1", (4,)),
         "w2": m.param("w2", (6, 4 // groups, 2, 3)), "w3": m.param("w3", (6 * 3 * 2, 3))}

    def forward(lib, x, p):
        conv, tanh, softplus = (gc.conv2d, gc.tanh, gc.softplus) if lib == "gc" else (F.conv2d, torch.tanh, F.softplus)
        mp, ap = (gc.max_pool2d, gc.avg_pool2d) if lib == "gc" else (F.max_pool2d, F.avg_pool2d)
        h = tanh(conv(x, p["w1"], p["b1"], padding=1))                        # (B, 4, 9, 8)
        h = mp(h, (2, 3), stride=(2, 1), padding=(1, 1))                      # (B, 4, 5, 8)
        h = softplus(conv(h, p["w2"], stride=(1, 2), dilation=(2, 1), groups=groups))   # (B, 6, 3, 3)
        h = ap(h, 2, stride=1, padding=1)                                     # (B, 6, 4, 4)
        h = ap(h, (2, 3), stride=(1, 2), padding=(0, 1))                      # (B, 6, 3, 2)
        return h.reshape(("B", -1)) if lib == "gc" else h.reshape(h.shape[0], -1)

    h = forward("gc", x, p)
    m.minimize(gc.softmax_cross_entropy(h @ p["w3"], y), weight_decay=0.1)
    return m, forward


@pytest.mark.parametrize("groups", [1, 2])
def test_hvp_through_convs_and_pools_matches_torch_double_backward(groups, rng):
    m, forward = _hvp_net(f"conv_hvp{groups}", groups)
    shapes = {"w1": (4, 2, 3, 3), "b1": (4,), "w2": (6, 4 // groups, 2, 3), "w3": (36, 3)}
    params = {k: rng.standard_normal(s) * 0.7 for k, s in shapes.items()}
    v = {k: rng.standard_normal(s) for k, s in shapes.items()}
    xv, yv = rng.standard_normal((3, 2, 9, 8)), rng.integers(0, 3, 3)
    got = _interp(m, params, {"x": xv, "y": yv}, order=2, tangents=v)

    pt = {k: _t(a) for k, a in params.items()}
    logits = forward("torch", torch.tensor(xv), pt) @ pt["w3"]
    decay = sum((pt[k] ** 2).sum() for k in ("w1", "w2", "w3"))
    loss = F.cross_entropy(logits, torch.tensor(yv)) + 0.05 * decay
    grads = torch.autograd.grad(loss, list(pt.values()), create_graph=True)
    dot = sum((g * torch.tensor(v[k])).sum() for k, g in zip(pt, grads))
    hv = torch.autograd.grad(dot, list(pt.values()))
    np.testing.assert_allclose(got[("obj", None)], loss.item(), rtol=1e-12)
    for k, g, h in zip(pt, grads, hv):
        np.testing.assert_allclose(got[("grad", k)], g.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(got[("hvp", k)], h.numpy(), rtol=1e-8, atol=1e-11, err_msg=k)


# ---- the adjoint ops, each with its own VJP, straight from the graph API ---------------------------
ADJOINTS = [
    # op, operand shapes, attrs
    ("conv2d_input_grad", [(2, 4, 3, 5), (4, 3, 3, 2)],
     dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=1, input_hw=(6, 5))),
    ("conv2d_input_grad", [(1, 4, 4, 3), (4, 1, 2, 2)],
     dict(stride=(1, 2), padding=(0, 1), dilation=(1, 1), groups=2, input_hw=(5, 4))),
    ("conv2d_weight_grad", [(2, 3, 6, 5), (2, 4, 3, 5)],
     dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=1, kernel=(3, 2))),
    ("conv2d_weight_grad", [(1, 4, 5, 4), (1, 6, 4, 3)],
     dict(stride=(1, 2), padding=(0, 1), dilation=(1, 1), groups=2, kernel=(2, 2))),
    ("max_pool2d_grad", [(2, 2, 5, 6), (2, 2, 3, 4)], dict(kernel=(3, 2), stride=(2, 2), padding=(1, 1), input_hw=(5, 6))),
    ("max_pool2d_pick", [(2, 2, 5, 6), (2, 2, 5, 6)], dict(kernel=(3, 2), stride=(2, 2), padding=(1, 1))),
    ("avg_pool2d_grad", [(2, 2, 3, 4)], dict(kernel=(3, 2), stride=(2, 2), padding=(1, 1), input_hw=(5, 6))),
]


def _adjoint_model(op, shapes, attrs, seed):
    m = gc.Model(op)
    ins = [m.input(f"a{i}", s) for i, s in enumerate(shapes)]
    ps = [m.param(f"p{i}", s) for i, s in enumerate(shapes)]
    node = m.graph.apply(op, [(a * p).node for a, p in zip(ins, ps)], attrs)
    out = gc.Tensor(m, node)
    r = np.random.default_rng(seed).standard_normal(out.shape)
    m.minimize(gc.sum(gc.tanh(out) * r))
    return m


@pytest.mark.parametrize("i", range(len(ADJOINTS)), ids=[f"{a[0]}{i}" for i, a in enumerate(ADJOINTS)])
def test_adjoint_ops_gradients_and_hvps_match_finite_differences(i, rng):
    from test_second_order import assert_hvp_matches_fd
    op, shapes, attrs = ADJOINTS[i]
    m = _adjoint_model(op, shapes, attrs, i)
    params = {f"p{j}": rng.uniform(0.5, 1.5, s) for j, s in enumerate(shapes)}
    inputs = {f"a{j}": rng.standard_normal(s) for j, s in enumerate(shapes)}
    assert_grads_match_fd(m, params, inputs)
    assert_hvp_matches_fd(m, params, inputs, rng)


# ---- mistakes: one GradcError naming the user's line, the op and the shapes -------------------------
def _model(xshape=("B", 3, 8, 8), dtype=None):
    m = gc.Model("bad")
    return m, m.input("x", xshape, dtype=dtype)


CONV_ERRORS = [
    (dict(w=(4, 2, 3, 3)), r"conv2d: the weight \(4, 2, 3, 3\) takes 2 channels, but the input has 3 "
                           r"channels \(operands: 'x' \(B, 3, 8, 8\)"),
    (dict(w=(4, 1, 3, 3), groups=2, x=("B", 4, 8, 8)), r"conv2d: the weight \(4, 1, 3, 3\) takes 1 channel per group, "
                                                     r"but the input has 4 channels in 2 groups \(2 per group\)"),
    (dict(w=(4, 1, 3, 3), groups=2), r"conv2d: 3 input channels do not divide into groups=2"),
    (dict(w=(3, 2, 3, 3), groups=2, x=("B", 4, 8, 8)), r"conv2d: 3 output channels .* do not divide into groups=2"),
    (dict(w=(4, 3, 9, 9)), r"conv2d: the kernel \(effective size 9x9\) is larger than the padded input 8x8"),
    (dict(w=(4, 3, 3, 3), dilation=4), r"effective size 9x9\) is larger than the padded input 8x8"),
    (dict(w=(4, 3, 3)), r"conv2d: the weight must be \(O, C/groups, kh, kw\) with int dims, got \(4, 3, 3\)"),
    (dict(w=(4, 3, 3, 3), x=("B", 3, 8)), r"conv2d: the input must have rank 4 \(N, C, H, W\), got \(B, 3, 8\)"),
    (dict(w=(4, 3, 3, 3), x=("B", "C", 8, 8)), r"C, H and W must be ints \(only the batch dim N may be symbolic\)"),
    (dict(w=(4, 3, 3, 3), stride=0), r"conv2d: stride must be an int >= 1 or a pair of them, got 0"),
    (dict(w=(4, 3, 3, 3), stride=(1, 2, 3)), r"stride must be an int >= 1 or a pair of them, got \(1, 2, 3\)"),
    (dict(w=(4, 3, 3, 3), padding=-1), r"padding must be an int >= 0 or a pair of them, got -1"),
    (dict(w=(4, 3, 3, 3), padding=1.5), r"padding must be an int >= 0"),
    (dict(w=(4, 3, 3, 3), dilation=(1, True)), r"dilation must be an int >= 1"),
    (dict(w=(4, 3, 3, 3), groups=0), r"conv2d: groups must be an int >= 1, got 0"),
    (dict(w=(4, 3, 3, 3), bias=(3,)), r"conv2d: bias must have shape \(4,\) for the weight's 4 output channels, "
                                      r"got \(3,\)"),
    (dict(w=(4, 3, 3, 3), dtype="int64"), r"conv2d: operand of dtype int64: conv2d takes float operands"),
]


@pytest.mark.parametrize("i", range(len(CONV_ERRORS)))
def test_conv2d_mistakes_name_the_line_op_and_shapes(i):
    spec, pattern = CONV_ERRORS[i]
    spec = dict(spec)
    m, x = _model(spec.pop("x", ("B", 3, 8, 8)), spec.pop("dtype", None))
    w = m.param("w", spec.pop("w"))
    if "bias" in spec:
        spec["bias"] = m.param("b", spec["bias"])
    with pytest.raises(gc.GradcError, match=pattern) as e:
        gc.conv2d(x, w, **spec)
    assert os.path.basename(e.value.src.split(":")[0]) == HERE, e.value.src


POOL_ERRORS = [
    (dict(kernel_size=9), r"kernel_size \(9, 9\) is larger than the padded input 8x8"),
    (dict(kernel_size=3, padding=2), r"padding \(2, 2\) must be at most half of kernel_size \(3, 3\)"),
    (dict(kernel_size=0), r"kernel_size must be an int >= 1 or a pair of them, got 0"),
    (dict(kernel_size=(2, 2), stride=(0, 1)), r"stride must be an int >= 1 or a pair of them, got \(0, 1\)"),
    (dict(kernel_size="2"), r"kernel_size must be an int >= 1 or a pair of them, got '2'"),
    (dict(kernel_size=2, x=(3, 8, 8)), r"the input must have rank 4 \(N, C, H, W\), got \(3, 8, 8\)"),
    (dict(kernel_size=2, x=("B", 3, "H", 8)), r"C, H and W must be ints"),
]


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
@pytest.mark.parametrize("i", range(len(POOL_ERRORS)))
def test_pool_mistakes_name_the_line_op_and_shapes(pool, i):
    spec, pattern = POOL_ERRORS[i]
    spec = dict(spec)
    m, x = _model(spec.pop("x", ("B", 3, 8, 8)))
    with pytest.raises(gc.GradcError, match=f"{pool}: .*{pattern}") as e:
        getattr(gc, pool)(x, **spec)
    assert os.path.basename(e.value.src.split(":")[0]) == HERE, e.value.src


def test_pool_and_conv_need_a_tensor():
    with pytest.raises(gc.GradcError, match="max_pool2d: the input must be a gradc Tensor"):
        gc.max_pool2d(np.ones((1, 1, 4, 4)), 2)
    m, x = _model()
    with pytest.raises(gc.GradcError, match="conv2d: the input must be a gradc Tensor"):
        gc.conv2d(np.ones((1, 3, 8, 8)), m.param("w", (4, 3, 3, 3)))


def test_conv2d_takes_a_numpy_weight_and_bias_as_constants(rng):
    m, x = _model(("B", 3, 6, 6))
    wv, bv = rng.standard_normal((2, 3, 3, 3)), rng.standard_normal(2)
    y = gc.conv2d(x, wv, bv, padding=1)
    assert y.shape == ("B", 2, 6, 6)
    m.minimize(gc.sum(y * y))
    xv = rng.standard_normal((2, 3, 6, 6))
    got = _interp(m, {}, {"x": xv})
    ref = F.conv2d(torch.tensor(xv), torch.tensor(wv), torch.tensor(bv), padding=1)
    np.testing.assert_allclose(got[("obj", None)], float((ref ** 2).sum()), rtol=1e-12)


# ---- the kernels (gradc/ops/conv.py, pool.py) and a compiled conv net -------------------------------
# each family compiles its own kernels: the default tier takes one block size of the direct kernels and
# the common pooling windows (a few seconds a kernel), the slow tier the rest
KERNEL_FAMILIES = ["conv", "taps", "winograd", "direct8", "pool"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("direct1", "direct2", "direct4", "pool_windows", "pool_windows_more")]


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_cpu_kernels_match_numpy(family):
    from conv_kernel_cases import FAMILIES, worst_error
    assert family in FAMILIES
    assert worst_error("cpu", (family,)) <= 1e-12


def test_cuda_kernels_match_numpy_under_the_simulator():
    last = cuda_script(os.path.join(os.path.dirname(os.path.abspath(__file__)), "conv_kernel_cases.py"), "cuda",
                       timeout=600)
    assert float(last.split()[-1]) <= 1e-12, last


def _conv_net(name, batch="B"):
    """conv+relu, max pool, grouped conv+tanh, avg pool with padding, dense, cross-entropy: every op and
    adjoint of the family runs in loss_and_grad or hvp."""
    m = gc.Model(name)
    x = m.input("x", (batch, 1, 8, 8))
    y = m.input("y", (batch,), dtype="int64")
    p = {"w1": m.param("w1", (6, 1, 3, 3), init="he_normal"), "b1": m.param("b1", (6,), init="normal"),
         "w2": m.param("w2", (8, 3, 3, 3), init="he_normal"), "b2": m.param("b2", (8,), init="normal"),
         "w3": m.param("w3", (32, 10)), "b3": m.param("b3", (10,))}

    def forward(lib, x, p):
        conv, relu, tanh = (gc.conv2d, gc.relu, gc.tanh) if lib is gc else (F.conv2d, torch.relu, torch.tanh)
        mp, ap = (gc.max_pool2d, gc.avg_pool2d) if lib is gc else (F.max_pool2d, F.avg_pool2d)
        h = relu(conv(x, p["w1"], p["b1"], padding=1))                      # (B, 6, 8, 8)
        h = mp(h, 2)                                                       # (B, 6, 4, 4)
        h = tanh(conv(h, p["w2"], p["b2"], padding=(1, 2), dilation=(1, 2), groups=2))   # (B, 8, 4, 4)
        h = ap(h, 3, stride=2, padding=1)                                  # (B, 8, 2, 2)
        flat = h.reshape((x.shape[0], -1)) if lib is gc else h.reshape(h.shape[0], -1)
        return flat @ p["w3"] + p["b3"]

    logits = forward(gc, x, p)
    m.output("logits", logits)
    m.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-3)
    return m, forward


@pytest.mark.slow
def test_compiled_conv_net_matches_torch(build_dir, rng):
    m, forward = _conv_net("conv_net")
    mod = gc.compile(m, out=build_dir, dtype="float64", warm=False)
    params = mod.init_params(3)
    X, Y = rng.standard_normal((5, 1, 8, 8)), rng.integers(0, 10, 5)
    loss, grads = mod.loss_and_grad(params, x=X, y=Y)
    v = {k: rng.standard_normal(params[k].shape) for k in mod.TRAINABLE}
    hv = mod.hvp(params, v, x=X, y=Y)

    pt = {k: _t(a) for k, a in params.items()}
    logits = forward(torch, torch.tensor(X), pt)
    ref = F.cross_entropy(logits, torch.tensor(Y)) + 0.5e-3 * sum((pt[k] ** 2).sum() for k in ("w1", "w2", "w3"))
    tg = torch.autograd.grad(ref, list(pt.values()), create_graph=True)
    thv = torch.autograd.grad(sum((g * torch.tensor(v[k])).sum() for k, g in zip(pt, tg)), list(pt.values()))
    np.testing.assert_allclose(mod.forward(params, x=X)["logits"], logits.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    for k, g, h in zip(pt, tg, thv):
        np.testing.assert_allclose(grads[k], g.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(hv[k], h.numpy(), rtol=1e-8, atol=1e-11, err_msg=k)


@pytest.mark.parametrize("hvp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["grads", "hvp"])
def test_convs_by_taps_match_torch_in_a_compiled_net(hvp, build_dir, rng, monkeypatch):
    """Unit-stride convs of >= TAPS_MIN_CHANNELS channels a group and enough output positions run
    tap by tap on the band (no im2col), and so do their input gradients: loss, gradients (and with hvp an hvp)
    of a net of them (padding, dilation, groups, a 1x1) against torch, float64. The positions'
    threshold is lowered so that the images stay small; a conv below it runs by im2col. The direct
    path (which would take most of these) is turned off."""
    monkeypatch.setattr(C, "TAPS_MIN_POSITIONS", 40)
    monkeypatch.setattr(conv_direct, "DIRECT_MAX_CHANNELS", 0)
    m = gc.Model("taps_net")
    x = m.input("x", ("B", 32, 7, 6))
    p = {"w1": m.param("w1", (64, 32, 3, 3), init="he_normal"), "b1": m.param("b1", (64,), init="normal"),
         "w2": m.param("w2", (6, 32, 3, 2), init="he_normal"), "w3": m.param("w3", (32, 6, 1, 1), init="he_normal"),
         "w4": m.param("w4", (8, 32, 1, 1), init="he_normal")}

    def forward(lib, x, p):
        conv, tanh = (gc.conv2d, gc.tanh) if lib is gc else (F.conv2d, torch.tanh)
        h = tanh(conv(x, p["w1"], p["b1"], padding=1))                                # (B, 64, 7, 6): 7 x 8 positions
        h = tanh(conv(h, p["w2"], padding=(2, 0), dilation=(2, 1), groups=2))          # (B, 6, 7, 5): 7 x 6
        h = conv(h, p["w3"])                                                          # (B, 32, 7, 5): 6 channels, im2col
        return conv(h[:, :, :2, :], p["w4"])                                          # 2 x 5 positions: im2col
    y = forward(gc, x, p)
    m.minimize(gc.mean(y * y))
    mod = gc.compile(m, out=build_dir, dtype="float64", order=2 if hvp else 1, warm=False)
    source = open(mod.__file__).read()
    for kernel in ("conv2d_by_taps", "conv2d_input_grad_by_taps", "conv2d", "conv2d_input_grad"):
        assert re.search(rf"def k\d+_{kernel}\(", source), kernel
    assert C.TAPS_MIN_CHANNELS <= 32 and "weight_grad_by_taps" not in source
    params = mod.init_params(1)
    X = rng.standard_normal((3, 32, 7, 6))
    loss, grads = mod.loss_and_grad(params, x=X)
    pt = {k: _t(a) for k, a in params.items()}
    ref = (forward(torch, torch.tensor(X), pt) ** 2).mean()
    tg = torch.autograd.grad(ref, list(pt.values()), create_graph=True)
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    for k, g in zip(pt, tg):
        np.testing.assert_allclose(grads[k], g.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=k)
    if hvp:
        v = {k: rng.standard_normal(params[k].shape) for k in mod.TRAINABLE}
        hv = mod.hvp(params, v, x=X)
        thv = torch.autograd.grad(sum((g * torch.tensor(v[k])).sum() for k, g in zip(pt, tg)), list(pt.values()))
        for k, h in zip(pt, thv):
            np.testing.assert_allclose(hv[k], h.numpy(), rtol=1e-8, atol=1e-11, err_msg=k)


# a float64 build's loss and gradients, a float32 build's, and (slow: its kernels compile on the first call)
# a float64 build's hvp
NET_CHECKS = [pytest.param("float64", False, id="float64"), pytest.param("float32", False, id="float32"),
              pytest.param("float64", True, id="float64-hvp", marks=pytest.mark.slow)]


def _check_net_against_torch(mod, forward, params, X, dtype, rng, input_grad=False, hvp=False):
    """A compiled net's loss and gradients (the input's too if input_grad) against torch's, float64 params
    and input; a float32 build within float32's precision; in float64 an hvp too if hvp."""
    cast = (lambda a: a.astype(np.float32)) if dtype == "float32" else (lambda a: a)
    loss, grads = mod.loss_and_grad({k: cast(v) for k, v in params.items()}, x=cast(X))
    got = [grads[k] for k in params]
    if input_grad:
        got += list(mod.input_grads({k: cast(v) for k, v in params.items()}, x=cast(X)).values())
    pt = {k: _t(a) for k, a in params.items()}
    xt = _t(X)
    ref = (forward(torch, xt, pt) ** 2).mean()
    tg = torch.autograd.grad(ref, list(pt.values()) + [xt], create_graph=True)
    tight = dtype == "float64"
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12 if tight else 2e-5)
    for k, mine, g in zip(list(pt) + ["x"], got, tg):
        scale = float(np.abs(g.detach().numpy()).max())
        np.testing.assert_allclose(mine, g.detach().numpy(), rtol=1e-9 if tight else 0,
                                   atol=1e-12 if tight else 2e-5 * scale, err_msg=k)
    if tight and hvp:
        v = {k: rng.standard_normal(params[k].shape) for k in mod.TRAINABLE}
        hv = mod.hvp(params, v, x=X)
        thv = torch.autograd.grad(sum((g * torch.tensor(v[k])).sum() for k, g in zip(pt, tg)), list(pt.values()))
        for k, h in zip(pt, thv):
            np.testing.assert_allclose(hv[k], h.numpy(), rtol=1e-8, atol=1e-11, err_msg=k)


@pytest.mark.parametrize("dtype, hvp", [NET_CHECKS[0], pytest.param("float32", False, id="float32", marks=pytest.mark.slow),
                                        NET_CHECKS[2]])
def test_convs_by_winograd_match_torch_in_a_compiled_net(dtype, hvp, build_dir, rng, monkeypatch):
    """3x3 unit-stride convs of >= WINOGRAD_MIN_CHANNELS channels run by Winograd F(2x2, 3x3), and so do
    their weight gradients, and their input gradients while the padding is at most 2 (padding 3's runs
    by another path): loss,
    gradients and an hvp of a net of them against torch in float64; a float32 build within float32's
    precision of it. The images' threshold is lowered so that they stay small."""
    from gradc.ops import conv_winograd
    monkeypatch.setattr(conv_winograd, "WINOGRAD_MIN_IMAGE_TILES", 1)
    m = gc.Model("winograd_net")
    x = m.input("x", ("B", 32, 9, 7))
    p = {f"w{i}": m.param(f"w{i}", (32, 32, 3, 3), init="he_normal") for i in range(4)}
    p["b0"] = m.param("b0", (32,), init="normal")

    def forward(lib, x, p):
        conv, tanh = (gc.conv2d, gc.tanh) if lib is gc else (F.conv2d, torch.tanh)
        h = tanh(conv(x, p["w0"], p["b0"], padding=1))    # (B, 32, 9, 7)
        h = tanh(conv(h, p["w1"], padding=0))             # (B, 32, 7, 5)
        h = tanh(conv(h, p["w2"], padding=2))             # (B, 32, 9, 7)
        return conv(h, p["w3"], padding=3)                # (B, 32, 13, 11): its input gradient not by Winograd
    y = forward(gc, x, p)
    m.minimize(gc.mean(y * y))
    mod = gc.compile(m, out=build_dir, dtype=dtype, order=2 if hvp else 1, warm=False)
    source = open(mod.__file__).read()
    for kernel in ("conv2d_winograd", "conv2d_input_grad_winograd", "conv2d_weight_grad_winograd"):
        assert re.search(rf"def k\d+_{kernel}\(", source), kernel
    assert re.search(r"def k\d+_conv2d_input_grad(_by_taps|_direct)?\(", source)   # padding 3's: another path
    params = {k: v.astype(np.float64) for k, v in mod.init_params(1).items()}
    _check_net_against_torch(mod, forward, params, rng.standard_normal((3, 32, 9, 7)), dtype, rng, hvp=hvp)


def test_which_convs_run_by_winograd():
    """3x3, unit strides and dilations, one group, >= 32 channels in and out, and outputs of >= 36 tiles
    (11 x 11); the input gradient also needs a padding <= 2. Measured (one thread, 4 images): 0.6-0.8x
    im2col's or taps' time from 32 channels at 14 x 14 to 512 at 28 x 28; 512 channels at 7 x 7 took 1.3x."""
    from gradc.ops.conv_winograd import winograd
    conv = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    assert winograd(conv, (64, 64, 3, 3), (56, 56)) and winograd(conv, (512, 512, 3, 3), (14, 14))
    assert winograd(conv, (32, 64, 3, 3), (12, 12), input_grad=True)
    assert not winograd(conv, (512, 512, 3, 3), (7, 7))                  # too few tiles
    assert not winograd(conv, (16, 64, 3, 3), (56, 56))                  # too few channels
    assert not winograd(conv, (64, 64, 5, 5), (56, 56))
    assert not winograd(conv | {"stride": (2, 2)}, (64, 64, 3, 3), (28, 28))
    assert not winograd(conv | {"dilation": (2, 1)}, (64, 64, 3, 3), (52, 54))
    assert not winograd(conv | {"groups": 2}, (64, 32, 3, 3), (56, 56))
    assert winograd(conv | {"padding": (3, 1)}, (64, 64, 3, 3), (60, 56))
    assert not winograd(conv | {"padding": (3, 1)}, (64, 64, 3, 3), (56, 56), input_grad=True)


@pytest.mark.parametrize("dtype, hvp", [NET_CHECKS[0], pytest.param("float32", False, id="float32", marks=pytest.mark.slow),
                                        NET_CHECKS[2]])
def test_convs_by_direct_sums_match_torch_in_a_compiled_net(dtype, hvp, build_dir, rng):
    """Unit-stride convs that make few channels a group run directly (gradc/ops/conv_direct.py), each
    output's taps summed in vector registers (gradc/runtime/simd.py), and so do input gradients with
    few source or many made channels, and weight gradients of few taps: a 5x5 conv of one channel
    (LeNet's first), a grouped and dilated one, one of 17 channels (blocks of 2, the last one short)
    whose input gradient (6 made from 17, by taps) has a padding that exceeds k - 1, a stride-2 conv
    (im2col) and a 1x1 (im2col). Loss, gradients (the input's too) and an hvp against torch in float64;
    a float32 build within float32's precision of it."""
    m = gc.Model("direct_net")
    x = m.input("x", ("B", 1, 11, 9))
    shapes = {"w0": (6, 1, 5, 5), "w1": (6, 3, 3, 2), "w2": (17, 6, 3, 3), "w3": (4, 17, 2, 2), "w4": (5, 4, 1, 1)}
    p = {k: m.param(k, s, init="he_normal") for k, s in shapes.items()}
    p["b0"] = m.param("b0", (6,), init="normal")

    def forward(lib, x, p):
        conv, tanh = (gc.conv2d, gc.tanh) if lib is gc else (F.conv2d, torch.tanh)
        h = tanh(conv(x, p["w0"], p["b0"], padding=2))                      # (B, 6, 11, 9)
        h = tanh(conv(h, p["w1"], padding=(2, 1), dilation=(2, 1), groups=2))   # (B, 6, 11, 10)
        h = tanh(conv(h, p["w2"], padding=3))                               # (B, 17, 15, 14): padding > k - 1
        h = tanh(conv(h, p["w3"], stride=2))                                # (B, 4, 7, 7): im2col
        return conv(h, p["w4"])                                             # 1x1: im2col
    y = forward(gc, x, p)
    m.minimize(gc.mean(y * y))
    mod = gc.compile(m, out=build_dir, dtype=dtype, order=2 if hvp else 1, warm=False)
    source = open(mod.__file__).read()
    for kernel in ("conv2d_direct", "conv2d_input_grad_direct", "conv2d_weight_grad_direct", "conv2d_weight_grad",
                   "conv2d_input_grad_by_taps"):
        assert re.search(rf"def k\d+_{kernel}\(", source), kernel
    assert re.search(r"def k\d+_conv2d\(", source)
    params = {k: v.astype(np.float64) for k, v in mod.init_params(1).items()}
    _check_net_against_torch(mod, forward, params, rng.standard_normal((3, 1, 11, 9)), dtype, rng, input_grad=True,
                             hvp=hvp)


def test_direct_blocks_are_chosen_for_the_image_each_kernel_makes(build_dir):
    """The lowering sizes a direct kernel's block of channels by the image it makes (a conv's output,
    an input gradient's input) and the kernel's horizontal dilation: here each gives a block of 2
    channels, where the other image or the vertical dilation would give 8 or 4."""
    from gradc.ops.conv_direct import band_positions, out_block
    assert out_block(5, band_positions(6, 6, 3, 1), 4) == 2 and out_block(5, band_positions(8, 8, 3, 1), 4) == 8
    assert out_block(5, band_positions(6, 8, 3, 1), 4) == 2 and out_block(5, band_positions(6, 8, 3, 2), 4) == 8
    assert out_block(5, band_positions(4, 4, 3, 1), 4) == 4   # the input gradient's g
    m = gc.Model("direct_blocks")
    x, x2 = m.input("x", ("B", 1, 8, 8)), m.input("x2", ("B", 1, 10, 10))
    w0, w1, w2 = m.param("w0", (5, 1, 3, 3)), m.param("w1", (5, 1, 3, 3)), m.param("w2", (3, 5, 3, 3))
    h = gc.conv2d(x, w0)                                   # (B, 5, 6, 6) from 8 x 8
    y = gc.conv2d(h, w2)                                   # (B, 3, 4, 4): its input gradient makes 6 x 6
    z = gc.conv2d(x2, w1, dilation=(2, 1))                 # (B, 5, 6, 8)
    m.minimize(gc.mean(y * y) + gc.mean(z * z))
    mod = gc.compile(m, out=build_dir, dtype="float32", order=1, warm=False)
    source = open(mod.__file__).read()
    blocks = {}   # kernel kind -> the blocks of its direct kernels (one kernel per block)
    for kind, ob in re.findall(r"def k\d+_(conv2d|conv2d_input_grad)_direct\(.*\n(?:.*\n)*?    ob = (\d+)   #", source):
        blocks.setdefault(kind, set()).add(int(ob))
    assert blocks["conv2d"] == {2, 4}               # w0 and w1 (5 channels): 2; w2 (3 at 4 x 4): 4
    assert blocks["conv2d_input_grad"] == {2, 1}    # w2's (5 channels at 6 x 6): 2; input_grads' (1 channel): 1


def test_which_convs_run_directly():
    """Unit strides, a kernel larger than 1x1, at most 64 channels made a group; an input gradient
    also needs fewer than 16 source channels a group (the conv's outputs) or 16 or more of its own (else
    it runs by taps from 16 sources), a weight gradient at most 16 output channels or at most 31 taps a
    group (channels times kernel)."""
    from gradc.ops.conv_direct import band_positions, direct, out_block, weight_grad_block
    conv = {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    assert direct(conv, (6, 1, 5, 5)) and direct(conv, (64, 3, 3, 3)) and direct(conv | {"groups": 4}, (256, 8, 3, 3))
    assert not direct(conv, (65, 3, 3, 3)) and not direct(conv, (8, 8, 1, 1))
    assert not direct(conv | {"stride": (2, 1)}, (8, 8, 3, 3))
    assert direct(conv, (6, 1, 5, 5), input_grad=True)            # 6 sources
    assert not direct(conv, (16, 6, 5, 5), input_grad=True)       # 16 sources, 6 made: by taps
    assert direct(conv, (64, 16, 3, 3), input_grad=True) and direct(conv, (8, 64, 3, 3), input_grad=True)
    # an input gradient making fewer than 32 channels from 16 or more: by taps at any size
    assert C.by_taps(conv, (16, 6, 5, 5), 10, 14, input_grad=True)            # LeNet's second conv's
    assert C.by_taps(conv, (64, 3, 3, 3), 1, 3, input_grad=True)
    assert not C.by_taps(conv, (8, 6, 3, 3), 9, 9, input_grad=True)           # 8 sources: im2col, if not direct
    assert not C.by_taps(conv, (16, 6, 1, 1), 9, 9, input_grad=True)          # 1x1: one product, im2col
    assert not C.by_taps(conv | {"groups": 2}, (24, 6, 3, 3), 9, 9, input_grad=True)   # 12 sources a group
    assert not C.by_taps(conv | {"stride": (2, 2)}, (32, 6, 3, 3), 9, 9, input_grad=True)
    # making 32 or more: as a conv, by taps only for many positions
    assert not C.by_taps(conv, (64, 32, 3, 3), 9, 9, input_grad=True)
    assert C.by_taps(conv, (64, 32, 3, 3), 64, 64, input_grad=True)
    assert not direct(conv, (8, 65, 3, 3), input_grad=True)
    assert direct(conv, (6, 1, 5, 5), weight_grad=True) and direct(conv | {"groups": 2}, (6, 3, 3, 3), weight_grad=True)
    assert direct(conv, (16, 6, 5, 5), weight_grad=True) and direct(conv, (8, 64, 3, 3), weight_grad=True)
    assert not direct(conv, (32, 16, 3, 3), weight_grad=True)     # 32 channels of 144 taps: im2col
    assert direct(conv, (64, 3, 3, 3), weight_grad=True) and not direct(conv, (65, 1, 3, 3), weight_grad=True)
    # the block of output channels with the fewest calls (the fastest measured, bench/conv_kernels.py):
    # 28x28 outputs of a 5x5 kernel give 892 band positions an image, 8x8 ones of a 3x3 kernel 78
    wide, small = band_positions(28, 28, 5, 1), band_positions(8, 8, 3, 1)
    assert (wide, small) == (27 * 32 + 28, 7 * 10 + 8)
    made = (1, 2, 3, 5, 6, 8, 10, 12, 16, 32)
    assert [out_block(c, wide, 4) for c in made] == [1, 2, 4, 2, 2, 4, 2, 4, 4, 4]
    assert [out_block(c, small, 4) for c in made] == [1, 2, 4, 8, 8, 8, 4, 4, 8, 8]
    assert [out_block(c, small, 8) for c in (6, 16)] == [2, 4]   # float64: half the lanes a vector
    assert [weight_grad_block(c) for c in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 4, 4, 4]


def _entry_source(source, fname):
    return source[source.index(f"def {fname}("):].split("\n\n\n")[0]


@pytest.mark.parametrize("path", ["_direct", ""], ids=["direct", "im2col"])
@pytest.mark.parametrize("batch", ["B", 7], ids=["part_runs", "per_kernel"])
def test_convs_over_parts_of_the_batch_match_torch(path, batch, build_dir, rng, monkeypatch):
    """A plain entry runs each conv, input gradient, weight gradient and pool gradient over parts of the
    batch at once (gradc/runtime/conv_cores.py): 7 images in 3 parts of 2, 2 and 3, the weight gradients
    and the biases' summed over the parts; loss and gradients against torch, float64, and BLAS's thread
    count given back. With a symbolic batch dim loss_and_grad has part runs (passes/part_runs.py): each
    kernel of the family runs in one of their functions or, where a run would raise the memory plan's
    peak, over parts on its own; with a batch of 7 written into the model each runs over parts on its own. The convs and the input
    gradient run directly, then (the direct path turned off) by im2col."""
    ran, set_to = split_every_conv(monkeypatch)
    if not path:
        monkeypatch.setattr(conv_direct, "DIRECT_MAX_CHANNELS", 0)
    m, forward = _conv_net(f"conv_parts{path}_{batch}", batch)
    mod = gc.compile(m, out=build_dir, dtype="float64", order=1, warm=False)
    source = open(mod.__file__).read()
    kernels = [f"conv2d{path}", f"conv2d_input_grad{path}", f"conv2d_weight_grad{path}", "max_pool2d_grad",
               "avg_pool2d_grad"]
    if batch == "B":
        entry = _entry_source(source, "_loss_and_grad")
        assert len(re.findall(r"\n    parts_on_cores\(images_\d, \(.*\), \(.*\), image_work=\d+, most=3\)", entry)) >= 2
        for k in kernels:   # called in a part run's function on its part of the images, or over parts alone
            assert re.search(rf"\n        k\d+_{k}\(", entry) or re.search(rf"_on_cores\(k\d+_{k}, ", entry), k
        assert re.search(r"\n        k\d+_conv2d_weight_grad", entry)   # a sum over the images in a run
    else:
        assert "parts_on_cores(" not in source
        assert len(re.findall(rf"conv_on_cores\(k\d+_conv2d{path}, .*most=3\)", source)) >= 2
        assert re.search(rf"conv_on_cores\(k\d+_conv2d_input_grad{path}, .*most=3\)", source)
        assert re.search(rf"conv_weight_grad_on_cores\(k\d+_conv2d_weight_grad{path}, .*most=3\)", source)
        for pool in ("max_pool2d_grad", "avg_pool2d_grad"):   # the pools' gradients too (images_on_cores)
            assert re.search(rf"images_on_cores\(k\d+_{pool}, .*most=3\)", source), pool
    params = mod.init_params(2)
    X, Y = rng.standard_normal((7, 1, 8, 8)), rng.integers(0, 10, 7)
    loss, grads = mod.loss_and_grad(params, x=X, y=Y)
    assert len(ran) >= (2 if batch == "B" else 5) and set(ran) == {3} and set_to == [1, 3] * len(ran)
    pt = {k: _t(a) for k, a in params.items()}
    ref = F.cross_entropy(forward(torch, torch.tensor(X), pt), torch.tensor(Y))
    ref = ref + 0.5e-3 * sum((pt[k] ** 2).sum() for k in ("w1", "w2", "w3"))
    tg = torch.autograd.grad(ref, list(pt.values()))
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    for k, g in zip(pt, tg):
        np.testing.assert_allclose(grads[k], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)
    if batch == "B":
        ran.clear()
        loss1, grads1 = mod.loss_and_grad(params, x=X[:1], y=Y[:1])   # one image: one part, no thread
        ref1 = F.cross_entropy(forward(torch, torch.tensor(X[:1]), pt), torch.tensor(Y[:1]))
        ref1 = ref1 + 0.5e-3 * sum((pt[k] ** 2).sum() for k in ("w1", "w2", "w3"))
        assert not ran
        np.testing.assert_allclose(loss1, ref1.item(), rtol=1e-12)
        for k, g in zip(pt, torch.autograd.grad(ref1, list(pt.values()))):
            np.testing.assert_allclose(grads1[k], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


def _add_kernel(done):
    """A stand-in conv kernel: out = a + w, failing on a part whose first value is negative."""
    def kernel(a, w, out):
        if a[0, 0] < 0:
            raise ValueError("part failed")
        out[...] = a + w
        done.append(a.shape[0])
    return kernel


@pytest.mark.parametrize("failing", [0, 2], ids=["this_threads_part", "a_worker_threads_part"])
def test_a_failing_part_ends_every_part_and_gives_blas_its_threads_back(monkeypatch, failing):
    from gradc.runtime import conv_cores
    _, set_to = split_every_conv(monkeypatch, cores=2)
    done = []
    a = np.arange(8.0).reshape(4, 2)
    a[failing] = -1.0
    with pytest.raises(ValueError, match="part failed"):
        conv_cores.conv_on_cores(_add_kernel(done), a, np.ones(2), np.empty((4, 2)), most=2)
    assert done == [2] and set_to == [1, 2]
    out = np.empty((4, 2))
    conv_cores.conv_on_cores(_add_kernel(done), np.abs(a), np.ones(2), out, most=2)
    np.testing.assert_array_equal(out, np.abs(a) + 1)


def test_a_conv_called_while_another_runs_in_parts_runs_whole(monkeypatch):
    from gradc.runtime import conv_cores
    ran, set_to = split_every_conv(monkeypatch, cores=2)
    done, out = [], np.empty((4, 2))
    with conv_cores._splitting:   # as while another thread's conv runs in parts
        conv_cores.conv_on_cores(_add_kernel(done), np.ones((4, 2)), np.ones(2), out, most=2)
    assert done == [4] and not ran and not set_to and (out == 2).all()


def test_a_forked_child_runs_convs_in_parts_of_its_own(monkeypatch):
    """A fork copies no threads: the child makes its own, and gets the parts' results."""
    from gradc.runtime import conv_cores
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    ran, _ = split_every_conv(monkeypatch, cores=2)
    out = np.empty((4, 2))
    conv_cores.conv_on_cores(_add_kernel([]), np.ones((4, 2)), np.ones(2), out, most=2)   # the parent's threads start
    assert ran == [2]
    pid = os.fork()
    if pid == 0:   # the child: exit 0 only if its conv ran in parts and right
        try:
            child_out = np.empty((6, 2))
            conv_cores.conv_on_cores(_add_kernel([]), np.full((6, 2), 2.0), np.ones(2), child_out, most=2)
            os._exit(0 if ran == [2, 2] and (child_out == 3).all() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_memory_plan_counts_a_conv_workspace_per_part(monkeypatch):
    from gradc.passes.memory import workspace_bytes
    from gradc.runtime import conv_cores
    m, _ = _conv_net("conv_parts_plan")
    g = build_training_graph(m, order=1)
    steps = g.topo_order()
    plans = {}
    for cores in (1, 2, 4):
        monkeypatch.setattr(conv_cores, "cores", lambda: cores)
        plans[cores] = [workspace_bytes(g, steps, {"B": b, "KB_lr": b}) for b in (1, 16)]
    assert plans[1] == plans[2] == plans[4]   # these small convs run whole: under PART_FLOPS a part
    monkeypatch.setattr(conv_cores, "PART_FLOPS", 1)
    for cores in (1, 2, 4):
        monkeypatch.setattr(conv_cores, "cores", lambda: cores)
        plans[cores] = [workspace_bytes(g, steps, {"B": b, "KB_lr": b}) for b in (1, 16)]
    assert plans[1][0] == plans[2][0] == plans[4][0]          # one image: one part
    assert plans[1][1] < plans[2][1] < plans[4][1]


@pytest.mark.slow
def test_cuda_target_conv_net_matches_the_interpreter(tmp_path):
    """forward, loss_and_grad, input_grads and hvp of the conv net compiled for CUDA, under the simulator."""
    errors = json.loads(cuda_script(os.path.join(os.path.dirname(os.path.abspath(__file__)), "conv_cuda_runs.py"),
                                    tmp_path))
    assert set(errors) == {"forward", "loss", "grads", "input_grads", "hvp"}
    assert max(errors.values()) <= 1e-12, errors


def test_convs_and_pools_are_per_row_for_microbatches():
    from gradc.passes.rows import batch_dim, loss_reduction
    m, _ = _conv_net("conv_rows")
    assert loss_reduction(m.graph, batch_dim(m.graph)) == "mean"


def test_conv_weights_are_initialised_with_torchs_fans():
    """he_normal and glorot_uniform count a conv weight's fans as torch.nn.init does (in/groups x kh x kw
    in, out x kh x kw out), so a deep ReLU conv stack keeps its scale at init; a matrix keeps (in, out)."""
    from gradc.runtime.init import draw
    rng = np.random.default_rng(0)
    w = draw("he_normal", (64, 32, 3, 3), rng)
    assert abs(w.std() / np.sqrt(2.0 / (32 * 9)) - 1) < 0.02
    limit = np.sqrt(6.0 / (32 * 9 + 64 * 9))
    g = draw("glorot_uniform", (64, 32, 3, 3), rng)
    assert g.max() <= limit and g.max() > 0.99 * limit
    assert abs(draw("he_normal", (300, 10), rng).std() / np.sqrt(2.0 / 300) - 1) < 0.05
    x = torch.tensor(rng.standard_normal((2, 16, 12, 12)))
    for _ in range(10):   # ten relu(conv) layers: the activations neither vanish nor blow up
        x = torch.relu(F.conv2d(x, torch.tensor(draw("he_normal", (16, 16, 3, 3), rng)), padding=1))
    assert 0.2 < float(x.std()) < 5
