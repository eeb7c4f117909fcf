"""gc.scan (DESIGN.md §1.8): values, gradients and HVPs through scans against torch and float64
finite differences (through the interpreter), bad step functions, the per-row rule, and one
compiled build that runs T=10 and T=10,000."""
import numpy as np
import pytest
import torch

import gradc as gc
from gradc.errors import GradcError
from gradc.interpret import evaluate
from gradc.passes.pipeline import build_training_graph

from conftest import assert_grads_match_fd


def _rnn(name="rnn", H=4, D=3, C=2):
    m = gc.Model(name)
    x = m.input("x", ("T", "B", D))
    y = m.input("y", ("B",), dtype="int64")
    h0 = m.input("h0", ("B", H))
    W, U = m.param("W", (H, H)), m.param("U", (D, H))
    b, V = m.param("b", (H,), init="normal"), m.param("V", (H, C))

    def step(h, xt):
        h = gc.tanh(h @ W + xt @ U + b)
        return h, h

    hT, hs = gc.scan(step, h0, x)
    m.output("hs", hs)
    m.minimize(gc.softmax_cross_entropy(hT @ V, y) + (hs * hs).mean())
    return m


def _torch_rnn(tp, inputs):
    h, hs = torch.tensor(inputs["h0"]), []
    for t in range(inputs["x"].shape[0]):
        h = torch.tanh(h @ tp["W"] + torch.tensor(inputs["x"][t]) @ tp["U"] + tp["b"])
        hs.append(h)
    return torch.nn.functional.cross_entropy(h @ tp["V"], torch.tensor(inputs["y"])) + (torch.stack(hs) ** 2).mean()


def _gru(name="gru", H=3, D=2):
    """A GRU-style cell with two carries (h and a running sum), a tuple of ys, softmax and a reduction."""
    m = gc.Model(name)
    x = m.input("x", ("T", "B", D))
    h0 = m.input("h0", ("B", H))
    Wz, Uz, Wh, Uh = (m.param(n, s) for n, s in (("Wz", (H, H)), ("Uz", (D, H)), ("Wh", (H, H)), ("Uh", (D, H))))

    def step(carry, xt):
        h, acc = carry
        z = gc.sigmoid(h @ Wz + xt @ Uz)
        cand = gc.tanh((h * z) @ Wh + xt @ Uh)
        h = (1 - z) * h + z * cand
        p = gc.softmax(h, axis=-1)
        return (h, acc + p.sum(axis=1, keepdims=True) * h), (p, h.sum(axis=1))

    (hT, acc), (ps, sums) = gc.scan(step, (h0, h0 * 0.5), x)
    m.minimize((hT * hT).sum() + (acc * hT).mean() + (ps * ps).mean() + gc.sin(sums).sum())
    return m


def _torch_gru(tp, inputs):
    h = torch.tensor(inputs["h0"])
    acc, ps, sums = h * 0.5, [], []
    for t in range(inputs["x"].shape[0]):
        xt = torch.tensor(inputs["x"][t])
        z = torch.sigmoid(h @ tp["Wz"] + xt @ tp["Uz"])
        cand = torch.tanh((h * z) @ tp["Wh"] + xt @ tp["Uh"])
        h = (1 - z) * h + z * cand
        p = torch.softmax(h, -1)
        acc = acc + p.sum(1, keepdim=True) * h
        ps.append(p)
        sums.append(h.sum(1))
    return (h * h).sum() + (acc * h).mean() + (torch.stack(ps) ** 2).mean() + torch.sin(torch.stack(sums)).sum()


def _stacked(name="stacked", H=3, D=2):
    """A scan over the ys of another scan, the second one reversed, closing over a computed value."""
    m = gc.Model(name)
    x = m.input("x", ("T", "B", D))
    W1, U1, W2 = m.param("W1", (H, H)), m.param("U1", (D, H)), m.param("W2", (H, H))
    s = m.param("s", ())
    B0 = m.input("h0", ("B", H))
    _, hs = gc.scan(lambda h, xt: (gc.tanh(h @ W1 + xt @ U1), gc.tanh(h @ W1 + xt @ U1)), B0, x)
    W2s = W2 * s

    def second(h, ht):
        h = gc.tanh(h @ W2s + ht)
        return h, None

    h2, none = gc.scan(second, B0, hs, reverse=True)
    assert none is None
    m.minimize((h2 * h2).mean() + s * s)
    return m


def _torch_stacked(tp, inputs):
    h, hs = torch.tensor(inputs["h0"]), []
    for t in range(inputs["x"].shape[0]):
        h = torch.tanh(h @ tp["W1"] + torch.tensor(inputs["x"][t]) @ tp["U1"])
        hs.append(h)
    h2 = torch.tensor(inputs["h0"])
    for t in reversed(range(len(hs))):
        h2 = torch.tanh(h2 @ (tp["W2"] * tp["s"]) + hs[t])
    return (h2 * h2).mean() + tp["s"] * tp["s"]


def _nested(name="nested", H=3, D=2):
    """A scan in another scan's step: each outer step runs an inner scan over the whole sequence
    from the outer carry (the inner step closes over a param and the outer step's slice)."""
    m = gc.Model(name)
    x = m.input("x", ("T", "B", D))
    W, U, V = m.param("W", (H, H)), m.param("U", (D, H)), m.param("V", (D, H))
    h0 = m.input("h0", ("B", H))

    def outer(h, xt):
        drive = xt @ V

        def inner(g, xs):
            return gc.tanh(g @ W + xs @ U + drive), None

        g, _ = gc.scan(inner, h, x)
        return gc.tanh(g + xt @ U), g.sum(axis=1)

    hT, ys = gc.scan(outer, h0, x)
    m.minimize((hT * hT).mean() + (ys * ys).mean())
    return m


def _torch_nested(tp, inputs):
    x = torch.tensor(inputs["x"])
    h, ys = torch.tensor(inputs["h0"]), []
    for t in range(x.shape[0]):
        drive = x[t] @ tp["V"]
        g = h
        for s in range(x.shape[0]):
            g = torch.tanh(g @ tp["W"] + x[s] @ tp["U"] + drive)
        h = torch.tanh(g + x[t] @ tp["U"])
        ys.append(g.sum(dim=1))
    ys = torch.stack(ys)
    return (h * h).mean() + (ys * ys).mean()


def _seq_loss(name="seq_loss", H=3, D=2, C=3):
    """A sequence's loss made outside the scan: softmax_cross_entropy of the stacked logits (T, B, C)
    against labels (T, B) (a log_softmax and a pick of rank 3: the fused kernels take (N, C))."""
    m = gc.Model(name)
    x, y = m.input("x", ("T", "B", D)), m.input("y", ("T", "B"), dtype="int64")
    W, U, V = m.param("W", (H, H)), m.param("U", (D, H)), m.param("V", (H, C))

    def step(h, xt):
        h = gc.tanh(h @ W + xt @ U)
        return h, h @ V

    _, logits = gc.scan(step, m.input("h0", ("B", H)), x)
    m.minimize(gc.softmax_cross_entropy(logits, y))
    return m


def _torch_seq_loss(tp, inputs):
    h, logits = torch.tensor(inputs["h0"]), []
    for xt in torch.tensor(inputs["x"]):
        h = torch.tanh(h @ tp["W"] + xt @ tp["U"])
        logits.append(h @ tp["V"])
    logits = torch.stack(logits)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(inputs["y"]).reshape(-1))


CASES = {"rnn": (_rnn, _torch_rnn, 3), "gru": (_gru, _torch_gru, 2), "stacked": (_stacked, _torch_stacked, 2),
         "nested": (_nested, _torch_nested, 2), "seq_loss": (_seq_loss, _torch_seq_loss, 2)}


def _data(graph, rng, T=4, B=2):
    params = {p: np.array(rng.normal(size=graph.shape(n)) * 0.7) for p, n in graph.params.items()}
    inputs = {}
    for name, n in graph.inputs.items():
        shape = tuple({"T": T, "B": B}.get(d, d) for d in graph.shape(n))
        inputs[name] = rng.integers(0, 2, size=shape) if graph.dtype(n).startswith("int") else rng.normal(size=shape)
    return params, inputs


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_and_hvps_match_torch(case):
    make, torch_loss, _ = CASES[case]
    m = make()
    g = build_training_graph(m, "float64", {}, order=2)
    rng = np.random.default_rng(1)
    params, inputs = _data(g, rng)
    _assert_interpreted_matches_torch(g, params, inputs, torch_loss, rng)


def _assert_interpreted_matches_torch(g, params, inputs, torch_loss, rng, what=""):
    """Loss, gradients and an HVP of graph g by the interpreter against torch autograd's."""
    names = list(g.grads)
    got = evaluate(g, params, inputs, [g.objective] + [g.grads[p] for p in names])
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    loss = torch_loss(tp, inputs)
    grads = torch.autograd.grad(loss, [tp[p] for p in names], create_graph=True)
    assert got[g.objective] == pytest.approx(float(loss.detach()), rel=1e-12)
    for p, gt in zip(names, grads):
        np.testing.assert_allclose(got[g.grads[p]], gt.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=what + p)
    v = {p: rng.normal(size=params[p].shape) for p in names}
    hv = evaluate(g, params, inputs, [g.hvps[p] for p in names], tangents=v)
    dot = sum((gt * torch.tensor(v[p])).sum() for p, gt in zip(names, grads))
    for p, ht in zip(names, torch.autograd.grad(dot, [tp[p] for p in names])):
        np.testing.assert_allclose(hv[g.hvps[p]], ht.numpy(), rtol=1e-8, atol=1e-11, err_msg=f"hvp {what}{p}")


@pytest.mark.parametrize("case", ["rnn", "stacked"])
def test_gradients_match_finite_differences(case):
    m = CASES[case][0]()
    g = build_training_graph(m, "float64", {}, order=1)
    params, inputs = _data(g, np.random.default_rng(2), T=3)
    assert_grads_match_fd(m, params, inputs)


def test_a_sequence_loss_made_outside_the_scan_compiles(tmp_path):
    """softmax_cross_entropy of (T, B, C) logits, compiled: torch's loss and gradients, the interpreter's
    lr_grad, and the labels checked element by element (the HVP: the slow test below)."""
    from test_lr_grad import interpret_lr
    g = build_training_graph(_seq_loss(), "float64", {}, order=2)
    rng = np.random.default_rng(4)
    params, inputs = _data(g, rng, T=5, B=4)
    inputs["y"] = rng.integers(0, 3, size=(5, 4))
    mod = gc.compile(_seq_loss("seq_loss_c"), out=str(tmp_path / "plain"), dtype="float64", order=1, warm=False)
    loss, grads = mod.loss_and_grad(params, **inputs)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tl = _torch_seq_loss(tp, inputs)
    assert loss == pytest.approx(float(tl.detach()), rel=1e-12)
    for p, gt in zip(grads, torch.autograd.grad(tl, [tp[p] for p in grads])):
        np.testing.assert_allclose(grads[p], gt.numpy(), rtol=1e-9, atol=1e-12, err_msg=p)
    _, est = mod.lr_grad(params, samples=4, sigma=1e-2, seed=2, **inputs)
    np.testing.assert_allclose(np.concatenate([est[p].ravel() for p in mod.TRAINABLE]),
                               interpret_lr(g, params, inputs, 4, 1e-2, 2)[0], rtol=1e-9, atol=1e-12)
    bad = inputs["y"].copy()
    bad[2, 1] = 3
    with pytest.raises(ValueError, match=r"input 'y' holds 3 at \[2, 1\], outside 0..2"):
        mod.loss_and_grad(params, **dict(inputs, y=bad))


@pytest.mark.slow
def test_a_sequence_loss_made_outside_the_scan_splits_into_microbatches(tmp_path):
    """The batch rows of (T, B) targets are on axis 1: microbatches over two stages give one device's gradients;
    the compiled HVP (rank-3 pick_grad's own VJP) is the interpreter's."""
    g = build_training_graph(_seq_loss(), "float64", {}, order=2)
    rng = np.random.default_rng(4)
    params, inputs = _data(g, rng, T=5, B=4)
    inputs["y"] = rng.integers(0, 3, size=(5, 4))
    got = evaluate(g, params, inputs, [g.objective] + [g.grads[p] for p in g.grads])
    mod = gc.compile(_seq_loss("seq_loss_h"), out=str(tmp_path / "hvp"), dtype="float64", order=2, warm=False)
    v = {p: rng.normal(size=params[p].shape) for p in g.grads}
    ref = evaluate(g, params, inputs, [g.hvps[p] for p in g.grads], tangents=v)
    for p, hv in mod.hvp(params, v, **inputs).items():
        np.testing.assert_allclose(hv, ref[g.hvps[p]], rtol=1e-9, atol=1e-12, err_msg=f"hvp {p}")
    split = gc.compile(_seq_loss("seq_loss_m"), out=str(tmp_path / "split"), dtype="float64", order=1, warm=False,
                       bind={"T": 5, "B": 4}, devices=2, microbatches=2)
    loss, grads = split.loss_and_grad(params, **inputs)
    assert loss == pytest.approx(got[g.objective], rel=1e-12)
    for p in grads:
        np.testing.assert_allclose(grads[p], got[g.grads[p]], rtol=1e-9, atol=1e-12, err_msg=f"microbatches {p}")


def test_bad_step_functions_name_the_line():
    m = gc.Model("bad")
    x = m.input("x", ("T", "B", 3))
    h0 = m.input("h0", ("B", 4))
    W = m.param("W", (3, 5))
    with pytest.raises(GradcError, match=r"test_scan.py:\d+: scan: the step .*carry 0 as \(B, 5\).*init is \(B, 4\)"):
        gc.scan(lambda h, xt: (xt @ W, None), h0, x)
    with pytest.raises(GradcError, match=r"test_scan.py:\d+: scan: the step .* must return \(new_carry, y\)"):
        gc.scan(lambda h, xt: h, h0, x)
    with pytest.raises(GradcError, match=r"carry of 2 tensor\(s\) in a tuple for an init of 1"):
        gc.scan(lambda h, xt: ((h, h), None), h0, x)
    with pytest.raises(GradcError, match=r"sequences differ in length"):
        gc.scan(lambda h, xt: (h, None), h0, (x, m.input("z", ("S", 2))))
    with pytest.raises(GradcError, match=r"test_scan.py:\d+: matmul: inner dims differ"):
        gc.scan(lambda h, xt: (h @ W, None), h0, x)
    # an int y went unchecked where it was read as labels (a wild read for a label out of range)
    tok = m.input("tok", ("T", "B"), dtype="int64")
    with pytest.raises(GradcError, match=r"test_scan.py:\d+: scan: the step .* returns y 1 of dtype int64; a step's ys "
                                         r"must be float"):
        gc.scan(lambda h, xs: (h, (h, xs[1])), h0, (x, tok))
    leaked = []
    gc.scan(lambda h, xt: (leaked.append(h * 2) or h, None), h0, x)
    with pytest.raises(GradcError, match=r"computed inside the step of gc.scan .* is used outside it"):
        m.minimize((leaked[0] + h0).sum())
    for read in (gc.sum, lambda t: t.shape, lambda t: t.reshape((-1,)), lambda t: t[0]):   # ops that read its shape first
        with pytest.raises(GradcError, match=r"test_scan.py:\d+: (\w+: )?a value computed inside the step of gc.scan at "
                                             r".*test_scan.py:\d+ is used outside it"):
            read(leaked[0])


def _scan_rows(m, ins):
    from gradc.ops import get_op
    g = m.graph
    n = next(n for n in g.nx.nodes if g.op(n) == "scan")
    why = []
    out = get_op("scan").rows(g, n, ins, lambda w: why.append(w) or (_ for _ in ()).throw(ValueError(w)))
    return g, n, out


def test_rows_rule_keeps_a_scan_over_time_per_row():
    """xs (T, B, D) with the rows on axis 1 and carries (B, H) on axis 0: every result is per-row
    (final carries on axis 0, ys and stacks on axis 1); a step that mixes rows is named."""
    from gradc.ops import get_op
    m = _rnn("rows_ok")
    g, n, out = _scan_rows(m, [0, 1] + [None] * 4)   # h0, x, then W U b closed over
    ys = next(u for u in g.users(n) if g.op(u) == "scan_out" and g.attrs(u)["index"] == 1)
    final = next(u for u in g.users(n) if g.op(u) == "scan_out" and g.attrs(u)["index"] == 0)
    assert get_op("scan_out").rows(g, final, [out], None) == 0
    assert get_op("scan_out").rows(g, ys, [out], None) == 1
    with pytest.raises(ValueError, match="batch dim"):
        _scan_rows(m, [0, 0] + [None] * 4)
    bad = gc.Model("rows_bad")
    x = bad.input("x", ("T", "B", 3))
    h0 = bad.input("h0", ("B", 3))
    gc.scan(lambda h, xt: (h + h.mean(axis=0, keepdims=True) * xt, None), h0, x)
    with pytest.raises(ValueError, match="rows"):
        _scan_rows(bad, [0, 1])


@pytest.mark.slow
def test_compiled_scan_runs_any_length_from_one_build(tmp_path):
    m = _rnn("scan_any_T")
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=2, warm=False)
    g = build_training_graph(m, "float64", {}, order=2)
    rng = np.random.default_rng(3)
    params = mod.init_params(0)
    names = list(g.grads)
    for T in (10, 10_000):
        _, inputs = _data(g, rng, T=T)
        loss, grads = mod.loss_and_grad(params, **inputs)
        if T == 10:
            ref = evaluate(g, params, inputs, [g.objective] + [g.grads[p] for p in names])
            assert loss == pytest.approx(ref[g.objective], rel=1e-12)
            for p in names:
                np.testing.assert_allclose(grads[p], ref[g.grads[p]], rtol=1e-10, atol=1e-13)
            v = {p: rng.normal(size=params[p].shape) for p in names}
            hv = mod.hvp(params, v, **inputs)
            ref = evaluate(g, params, inputs, [g.hvps[p] for p in names], tangents=v)
            for p in names:
                np.testing.assert_allclose(hv[p], ref[g.hvps[p]], rtol=1e-9, atol=1e-12)
        assert np.isfinite(loss) and all(np.isfinite(grads[p]).all() for p in names)
        assert mod.forward(params, **inputs)["hs"].shape == (T, 2, 4)
    # one loop kernel per scan: the module's size does not depend on T, which stays symbolic
    assert mod.INPUTS["x"][0] == ("T", "B", 3)


@pytest.mark.parametrize("order", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_compiled_scan_nested_in_a_step_matches_torch(order, tmp_path):
    """A scan inside a scan's step: the two bodies are two functions (they once got one name, and the
    module did not run), gradients and (order 2: its kernels take a minute to compile) an HVP against torch."""
    m = _nested("nested_compiled")
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=order, warm=False)
    g = build_training_graph(m, "float64", {}, order=order)
    rng = np.random.default_rng(4)
    params, inputs = _data(g, rng, T=5, B=3)
    names = list(g.grads)
    loss, grads = mod.loss_and_grad(params, **inputs)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    expected = _torch_nested(tp, inputs)
    tg = torch.autograd.grad(expected, [tp[p] for p in names], create_graph=True)
    assert loss == pytest.approx(float(expected.detach()), rel=1e-12)
    for p, gt in zip(names, tg):
        np.testing.assert_allclose(grads[p], gt.detach().numpy(), rtol=1e-10, atol=1e-13, err_msg=p)
    if order == 1:
        return
    v = {p: rng.normal(size=params[p].shape) for p in names}
    hv = mod.hvp(params, v, **inputs)
    dot = sum((gt * torch.tensor(v[p])).sum() for p, gt in zip(names, tg))
    for p, ht in zip(names, torch.autograd.grad(dot, [tp[p] for p in names])):
        np.testing.assert_allclose(hv[p], ht.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"hvp {p}")


def test_compile_refuses_what_scans_do_not_support_yet(tmp_path):
    m = _rnn("scan_refusals")
    for options, message in (({"target": "cuda", "memory_budget": "1MiB", "bind": {"T": 4, "B": 2}},
                              "gc.scan with --target cuda and --memory-budget is not built yet"),
                             ({"memory_budget": "1KiB", "bind": {"T": 40, "B": 2}, "order": 1},
                              r"budget 1.00 KiB \(1,024 bytes\) is below the minimum .* for this model"),
                             ({"memory_budget": "1KiB", "bind": {"T": 40, "B": 2}, "order": 1, "scan_backward": "bppsa"},
                              r"needs .*, of which .* is kernel workspace \(with --scan-backward bppsa that includes BPPSA's maps"),
                             ({"scan_backward": "fast"}, "--scan-backward 'fast': use reverse or bppsa")):
        with pytest.raises(GradcError, match=message):
            gc.compile(m, out=str(tmp_path), warm=False, **options)
    assert not list(tmp_path.iterdir())


# ---- carry checkpoints under --memory-budget (passes/scan_checkpoint.py) ---------------------------
def _checkpointed(g, dims):
    import copy
    from gradc.passes.scan_checkpoint import checkpoint_scans
    g2 = copy.deepcopy(g)
    return g2, checkpoint_scans(g2, dims)


@pytest.mark.parametrize("case", sorted(CASES))
def test_carry_checkpoints_give_the_same_gradients_and_hvps(case):
    """The rewritten graph (forward scans write checkpoints every ceil(sqrt(T)) steps, backward scans
    recompute each segment's carries), through the interpreter: the loss, gradients and HVPs are
    torch's, at lengths that are and are not multiples of the segment (7, 17) and one too short to
    checkpoint. `stacked` has a reverse scan over another scan's ys."""
    make, torch_loss, _ = CASES[case]
    rng = np.random.default_rng(11)
    for T in (2, 7, 17):
        dims = {"T": T, "B": 3}
        g = build_training_graph(make(), "float64", dims, order=2)
        g2, done = _checkpointed(g, dims)
        scans = 2 if case == "stacked" else 1
        assert len(done) == (0 if T == 2 else 2 * scans)   # loss_and_grad's backward, and hvp's own
        assert all(d["every"] == int(np.ceil(np.sqrt(T))) for d in done)
        params, inputs = _data(g2, rng, T=T, B=3)
        _assert_interpreted_matches_torch(g2, params, inputs, torch_loss, rng, f"T={T} ")


def test_bppsa_scans_keep_their_stacks_and_their_maps_are_planned():
    """BPPSA reads every step's carry at once: no checkpoints; its (P, rows, H, H) maps are workspace."""
    from gradc.ops.scan import use_bppsa
    from gradc.passes.memory import plan_memory
    dims = {"T": 100, "B": 16}
    g = build_training_graph(_rnn("bp_plan", H=20), "float32", dims, order=1)
    use_bppsa(g)
    g2, done = _checkpointed(g, dims)
    assert done == []
    plan = plan_memory(g, dims, 1)["_loss_and_grad"]
    assert plan["workspace_bytes"] >= 128 * 16 * (20 * 20 + 20) * 4


def _check_budget_build(make, name, torch_loss, tmp_path, T, order, batch=3, fraction=0.75):
    """A build under `fraction` of the store-all peak and workspace: the plan keeps checkpoints and fits with
    its workspace; the loss, gradients (and HVPs) are torch's (the interpreter's on the plain graph). (Since
    the MILP's coarse graph keeps a scan's results with it, 75% fits two of the models without recomputing:
    they take a lower fraction.)"""
    import json
    from gradc.inspect_build import memory_report
    from gradc.passes.memory import plan_memory
    dims = {"T": T} | ({"B": batch} if batch else {})
    g = build_training_graph(make(), "float64", dims, order=order)
    store_all = plan_memory(g, dims, order)["_loss_and_grad"]
    peak, whole = store_all["peak_bytes"], store_all["peak_bytes"] + store_all["workspace_bytes"]
    ck = gc.compile(make(name), out=str(tmp_path), dtype="float64", order=order, warm=False, bind=dims,
                    memory_budget=str(int(fraction * whole)))
    plan = json.loads((tmp_path / f"{name}.memplan.json").read_text())
    assert plan["scan_checkpoints"] and "carry checkpoints" in plan["method"]
    every = int(np.ceil(np.sqrt(T)))
    assert f"keeps the carry every {every} steps" in "\n".join(memory_report(str(tmp_path / name)))
    assert plan["peak_bytes"] + plan["workspace_bytes"] <= plan["budget_bytes"] < whole
    assert plan["store_all_peak_bytes"] == peak
    assert plan["recompute_flops"] >= sum(d["recompute_flops"] for d in plan["scan_checkpoints"]) > 0
    params, inputs = _data(g, np.random.default_rng(13), T=T, B=3)
    loss, grads = ck.loss_and_grad(params, **inputs)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tl = torch_loss(tp, inputs)
    tg = dict(zip(grads, torch.autograd.grad(tl, [tp[p] for p in grads])))
    assert loss == pytest.approx(float(tl.detach()), rel=1e-12)
    for p in grads:
        np.testing.assert_allclose(grads[p], tg[p].numpy(), rtol=1e-9, atol=1e-12, err_msg=p)
    if order == 2:
        v = {p: np.random.default_rng(3).normal(size=params[p].shape) for p in grads}
        hv = ck.hvp(params, v, **inputs)
        ref = evaluate(g, params, inputs, [g.hvps[p] for p in grads], tangents=v)
        for p in grads:
            np.testing.assert_allclose(hv[p], ref[g.hvps[p]], rtol=1e-9, atol=1e-12, err_msg=f"hvp {p}")


def test_memory_budget_checkpoints_a_compiled_rnn(tmp_path):
    """--memory-budget at 75% of the store-all peak, T = 50: segments of 8, the last one short."""
    _check_budget_build(_rnn, "ck_rnn", _torch_rnn, tmp_path, 50, 1)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gru", "stacked"])
def test_memory_budget_checkpoints_compiled_scans_with_hvp(case, tmp_path):
    """Two carries with ys of their own (gru), and a reverse scan over a scan's ys (stacked), order 2:
    hvp reads the full stacks, which loss_and_grad under the budget never writes."""
    make, torch_loss, _ = CASES[case]
    _check_budget_build(make, f"ck_{case}", torch_loss, tmp_path, 23, 2, fraction=0.55 if case == "stacked" else 0.75)


def _scalar_rnn(name="scalar_rnn", H=3):
    """Scalar slices (x is (T,)) and a scalar closed-over param, one carry with no batch dim."""
    m = gc.Model(name)
    x = m.input("x", ("T",))
    h0 = m.input("h0", (H,))
    W, s = m.param("W", (H, H)), m.param("s", ())
    hT, hs = gc.scan(lambda h, xt: (gc.tanh(h @ W + xt * s), h * s), h0, x)
    m.minimize((hT * hT).sum() + (hs * hs).mean())
    return m


def _torch_scalar_rnn(tp, inputs):
    h, hs = torch.tensor(inputs["h0"]), []
    for t in range(len(inputs["x"])):
        hs.append(h * tp["s"])
        h = torch.tanh(h @ tp["W"] + float(inputs["x"][t]) * tp["s"])
    return (h * h).sum() + (torch.stack(hs) ** 2).mean()


@pytest.mark.slow
def test_memory_budget_checkpoints_scalar_slices_and_params(tmp_path):
    """Checkpoints where each step reads a scalar slice and a scalar param, T = 30 (segments of 6)."""
    _check_budget_build(_scalar_rnn, "ck_scalar", _torch_scalar_rnn, tmp_path, 30, 1, batch=None)


def _chained_scans(name="chained"):
    """Two scans, the second from the first's final carry, both stacked ys unused: the memory plans
    once read a scan's results apart from the scan (a KeyError, found by a new-user trial)."""
    m = gc.Model(name)
    xs, h0 = m.input("xs", ("T", "B", 3)), m.input("h0", ("B", 4))
    W, U = m.param("W", (4, 4)), m.param("U", (3, 4))

    def step(h, x_t):
        h = gc.tanh(h @ W + x_t @ U)
        return h, h
    hT, _ = gc.scan(step, h0, xs)
    gT, _ = gc.scan(step, hT, xs)
    m.minimize((gT * hT).sum())
    return m


def _torch_chained_scans(tp, inputs):
    xs, h = torch.tensor(inputs["xs"]), torch.tensor(inputs["h0"])
    for t in range(len(xs)):
        h = torch.tanh(h @ tp["W"] + xs[t] @ tp["U"])
    hT = h
    for t in range(len(xs)):
        h = torch.tanh(h @ tp["W"] + xs[t] @ tp["U"])
    return (h * hT).sum()


@pytest.mark.slow
def test_memory_budget_checkpoints_compiled_chained_scans(tmp_path):
    _check_budget_build(_chained_scans, "ck_chained", _torch_chained_scans, tmp_path, 16, 2, fraction=0.55)


def test_memory_budgets_keep_a_scans_results_with_the_scan():
    """Every budget from far below the least peak to the store-all peak is planned or refused with the
    minimum; in every plan each scan_out runs right after its scan (or another result of it), so no
    plan recomputes a result without running the scan that writes it."""
    import copy
    from collections import Counter
    from gradc.passes.analysis import node_flops
    from gradc.passes.checkpoint import BudgetError
    from gradc.passes.memory import plan_memory
    dims = {"T": 16, "B": 3}
    g = build_training_graph(_chained_scans(), "float64", dims, order=2)
    full = plan_memory(copy.deepcopy(g), dims, 2)["_loss_and_grad"]
    whole = full["peak_bytes"] + full["workspace_bytes"]
    planned = refused = scans_again = 0
    for budget in np.linspace(0.1 * whole, whole, 19).astype(int):
        g2 = copy.deepcopy(g)
        try:
            plans = plan_memory(g2, dims, 2, budget=int(budget))
        except BudgetError as e:
            assert e.minimum > budget
            refused += 1
            continue
        planned += 1
        # what the plan says it recomputes: every computation its schedule runs again (a scan run twice
        # was left out: its results are scan_outs, of no FLOPs of their own), and the scans' segments
        plan = plans["_loss_and_grad"]
        again = [(n, k - 1) for n, k in Counter(plan["steps"]).items() if k > 1]
        scans_again += any(g2.op(n) == "scan" for n, _ in again)
        assert plan["recompute_flops"] == sum(node_flops(g2, n, dims) * k for n, k in again) + sum(
            d["recompute_flops"] for d in plan.get("scan_checkpoints", [])), budget
        for fname, plan in plans.items():
            steps = plan["steps"]
            for t, n in enumerate(steps):
                if g2.op(n) == "scan_out":
                    before = steps[t - 1]
                    assert before == g2.operands(n)[0] or (g2.op(before) == "scan_out" and
                                                           g2.operands(before) == g2.operands(n)), (fname, budget, t)
    assert planned >= 5 and refused >= 3 and scans_again


# ---- --scan-backward bppsa (DESIGN.md §1.8) ---------------------------------------------------------
def _gru1(name="gru1", H=4, D=3):
    """A GRU-like cell with one carry: the carry is read three times, so BPPSA takes its Jacobian densely."""
    m = gc.Model(name)
    x = m.input("x", ("T", "B", D))
    h0 = m.input("h0", ("B", H))
    Wz, Uz, Wh, Uh = (m.param(n, s) for n, s in (("Wz", (H, H)), ("Uz", (D, H)), ("Wh", (H, H)), ("Uh", (D, H))))

    def step(h, xt):
        z = gc.sigmoid(h @ Wz + xt @ Uz)
        cand = gc.tanh((h * z) @ Wh + xt @ Uh)
        h = (1 - z) * h + z * cand
        return h, h

    hT, hs = gc.scan(step, h0, x)
    m.minimize((hT * hT).sum() + gc.sin(hs).mean())
    return m


def _torch_gru1(tp, inputs):
    h, hs = torch.tensor(inputs["h0"]), []
    for t in range(inputs["x"].shape[0]):
        xt = torch.tensor(inputs["x"][t])
        z = torch.sigmoid(h @ tp["Wz"] + xt @ tp["Uz"])
        cand = torch.tanh((h * z) @ tp["Wh"] + xt @ tp["Uh"])
        h = (1 - z) * h + z * cand
        hs.append(h)
    return (h * h).sum() + torch.sin(torch.stack(hs)).mean()


def _mixing(name="mixing"):
    """A step that mixes the batch rows of its carry: one dense Jacobian over the whole carry."""
    m = gc.Model(name)
    x = m.input("x", ("T", "B", 3))
    h0 = m.input("h0", ("B", 3))
    W = m.param("W", (3, 3))
    hT, hs = gc.scan(lambda h, xt: (gc.tanh(h @ W + h.mean(axis=0, keepdims=True) * xt), h), h0, x)
    m.minimize((hT * hT).sum() + (hs * hs).mean())
    return m


def _torch_mixing(tp, inputs):
    h, hs = torch.tensor(inputs["h0"]), []
    for t in range(inputs["x"].shape[0]):
        hs.append(h)
        h = torch.tanh(h @ tp["W"] + h.mean(0, keepdim=True) * torch.tensor(inputs["x"][t]))
    return (h * h).sum() + (torch.stack(hs) ** 2).mean()


def _backward_infos(m):
    from gradc.ops.scan import vjp_of
    g = build_training_graph(m, "float64", {}, order=1)
    return [vjp_of(g.attrs(n)) for n in g.nx.nodes if g.op(n) == "scan" and vjp_of(g.attrs(n))]


def test_bppsa_picks_the_structured_jacobian_only_for_f_of_carry_matmul_w():
    (rnn,) = _backward_infos(_rnn("bp_info_rnn"))
    assert rnn["structured"]["f"] == "tanh" and rnn["per_row"] and rnn["carries"] == 1
    (gru,) = _backward_infos(_gru1("bp_info_gru"))
    assert gru["structured"] is None and gru["per_row"]
    (mix,) = _backward_infos(_mixing("bp_info_mix"))
    assert not mix["per_row"] and mix["structured"] is None   # one dense Jacobian over the whole carry
    (two,) = _backward_infos(_gru("bp_info_two"))
    assert two["carries"] == 2 and two["per_row"] and two["structured"] is None


@pytest.mark.slow
@pytest.mark.parametrize("case", ["rnn", "gru1", "gru", "stacked", "mixing"])
def test_bppsa_gradients_match_reverse_and_torch(case, tmp_path):
    """float64, T = 1, 5 and 11 (not powers of two): BPPSA's loss and gradients are the reverse scan's
    to rounding and torch's; the vanilla RNN's Jacobians are the structured W^T diag(1 - h^2), the
    GRU-like cell's are taken densely (the step's VJP on the H basis vectors); `gru` has two carries
    (one map over both, side by side) and ys of its own; `stacked` has a
    reverse=True scan (its backward runs forward) over another scan's ys; `mixing` a step that
    mixes its carry's rows (one dense Jacobian over the whole carry)."""
    make, torch_loss = {"rnn": (_rnn, _torch_rnn), "gru1": (_gru1, _torch_gru1), "gru": (_gru, _torch_gru),
                        "stacked": (_stacked, _torch_stacked), "mixing": (_mixing, _torch_mixing)}[case]
    order = 2 if case == "rnn" else 1
    rev = gc.compile(make(f"bp_{case}_rev"), out=str(tmp_path / "rev"), dtype="float64", order=order, warm=False)
    bp = gc.compile(make(f"bp_{case}"), out=str(tmp_path / "bp"), dtype="float64", order=order, warm=False,
                    scan_backward="bppsa")
    text = (tmp_path / "bp" / f"bp_{case}.py").read_text()
    assert "_bppsa(" in text and ("dv = 1.0 - y * y" in text) == (case in ("rnn", "stacked"))
    assert ("nR = 1\n" in text) == (case == "mixing")
    g = build_training_graph(make(), "float64", {}, order=1)
    rng = np.random.default_rng(5)
    params = {p: np.asarray(rng.normal(size=g.shape(n)) * 0.7) for p, n in g.params.items()}
    for T in (1, 5, 11):
        _, inputs = _data(g, rng, T=T, B=3)
        l_rev, g_rev = rev.loss_and_grad(params, **inputs)
        l_bp, g_bp = bp.loss_and_grad(params, **inputs)
        tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
        loss = torch_loss(tp, inputs)
        grads = dict(zip(g_rev, torch.autograd.grad(loss, [tp[p] for p in g_rev])))
        assert l_bp == pytest.approx(l_rev, rel=1e-13) and l_bp == pytest.approx(float(loss.detach()), rel=1e-12)
        for p in g_rev:
            np.testing.assert_allclose(g_bp[p], g_rev[p], rtol=1e-11, atol=1e-13, err_msg=f"T={T} {p}")
            np.testing.assert_allclose(g_bp[p], grads[p].numpy(), rtol=1e-10, atol=1e-12, err_msg=f"T={T} {p}")
        if order == 2:
            v = {p: rng.normal(size=params[p].shape) for p in g_rev}
            h_rev, h_bp = rev.hvp(params, v, **inputs), bp.hvp(params, v, **inputs)
            for p in g_rev:
                np.testing.assert_allclose(h_bp[p], h_rev[p], rtol=1e-10, atol=1e-12, err_msg=f"hvp T={T} {p}")


def test_a_random_op_in_a_step_is_refused_by_name():
    m = gc.Model("noisy_step")
    x, h0 = m.input("x", ("T", "B", 3)), m.input("h0", ("B", 3))
    seed = m.input("seed", (), dtype="int64")
    with pytest.raises(GradcError, match=r"test_scan.py:\d+: gaussian_noise: random ops inside the step of gc.scan"):
        gc.scan(lambda h, xt: (gc.gaussian_noise(h + xt, 0.1, seed), None), h0, x)


@pytest.mark.slow
def test_a_scalar_carry_matches_torch(tmp_path):
    """A carry of shape () (the loop holds it as (1,)): its init was passed as () and the scan refused it."""
    m = gc.Model("scalar_carry")
    xs = m.input("xs", ("T", 3))
    a, W = m.param("a", ()), m.param("W", (3,))
    c, ys = gc.scan(lambda c, x: (gc.tanh(c + (x * W).sum()), c * 2.0), a * 1.0, xs)
    m.minimize(c + ys.sum())
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", order=2, warm=False)
    rng = np.random.default_rng(0)
    params, X = {"a": np.array(0.3), "W": rng.standard_normal(3)}, rng.standard_normal((4, 3))
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    c, total = tp["a"] * 1.0, 0.0
    for t in range(4):
        total, c = total + c * 2.0, torch.tanh(c + (torch.tensor(X[t]) * tp["W"]).sum())
    expected = c + total
    loss, grads = mod.loss_and_grad(params, xs=X)
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    tg = torch.autograd.grad(expected, list(tp.values()), create_graph=True)
    for k, gt in zip(tp, tg):
        np.testing.assert_allclose(grads[k], gt.detach().numpy(), rtol=1e-10, atol=1e-13, err_msg=k)
    v = {"a": np.array(0.7), "W": rng.standard_normal(3)}
    hv = mod.hvp(params, v, xs=X)
    dot = sum((gt * torch.tensor(v[k])).sum() for k, gt in zip(tp, tg))
    for k, ht in zip(tp, torch.autograd.grad(dot, list(tp.values()))):
        np.testing.assert_allclose(hv[k], ht.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"hvp {k}")


def test_labels_and_table_rows_read_in_a_step_are_checked_at_call_time(tmp_path):
    """A step's labels (a slice of a scanned (T, B) input, or a (B,) input it closes over) and a step's
    embedding rows were never range-checked: a label of 9 for 4 classes read memory it does not own (a
    wrong loss, a segfault at 10**7). They are checked as outside a scan, naming the input."""
    m = gc.Model("step_labels")
    tok, tgt = m.input("tok", ("T", "B"), dtype="int64"), m.input("tgt", ("T", "B"), dtype="int64")
    last = m.input("last", ("B",), dtype="int64")
    h0 = m.input("h0", ("B", 3))
    E, W, O = m.param("E", (5, 3)), m.param("W", (3, 3)), m.param("O", (3, 4))

    def step(h, xs):
        tok_t, tgt_t = xs
        h = gc.tanh(h @ W + gc.take(E, tok_t))
        return h, gc.softmax_cross_entropy(h @ O, tgt_t) + gc.softmax_cross_entropy(h @ O, last)

    _, losses = gc.scan(step, h0, (tok, tgt))
    m.minimize(losses.mean())
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm_cache=False)
    assert mod._INDEX_BOUNDS == {"tok": 5, "tgt": 4, "last": 4}
    rng = np.random.default_rng(4)
    T, B = 3, 2
    good = {"tok": rng.integers(0, 5, (T, B)), "tgt": rng.integers(0, 4, (T, B)), "last": rng.integers(0, 4, B),
            "h0": rng.standard_normal((B, 3))}
    p = mod.init_params(0)
    loss, _ = mod.loss_and_grad(p, **good)
    assert np.isfinite(loss)
    tr = mod.Trainer(p, optimizer="sgd", lr=0.1)
    for name, value, shown in (("tgt", 4, r"4 at \[2, 1\], outside 0..3"), ("last", 9, r"9 at \[1\], outside 0..3"),
                               ("tok", 5, r"5 at \[2, 1\], outside 0..4"), ("tgt", 10**7, r"10000000 at \[2, 1\], outside 0..3"),
                               ("tok", -1, r"-1 at \[2, 1\], outside 0..4")):
        bad = dict(good, **{name: good[name].copy()})
        bad[name].flat[-1] = value
        for call in (lambda: mod.loss_and_grad(p, **bad), lambda: mod.forward(p, **bad), lambda: tr.step(**bad),
                     lambda: mod.input_grads(p, **bad), lambda: mod.hvp(p, p, **bad)):
            with pytest.raises(ValueError, match=f"input '{name}' holds {shown}"):
                call()
    np.testing.assert_array_equal(tr.params["W"], p["W"])   # no step ran


def _tagger(teacher_forcing=False, weighted=False):
    """A sequence tagger whose step returns its logits and its loss (the loss reads the labels); inside
    an outer scan over sentences, so that the lean copy goes through a nested scan too."""
    m = gc.Model("tagger_tf" if teacher_forcing else "tagger_wt" if weighted else "tagger")
    x = m.input("x", ("S", "T", "B", 3))
    y = m.input("y", ("S", "T", "B"), dtype="int64")
    h0 = m.input("h0", ("B", 4))
    W, U, O, E = m.param("W", (3, 4)), m.param("U", (4, 4)), m.param("O", (4, 5)), m.param("E", (5, 4))

    def word(h, xs):
        xt, yt = xs
        h = gc.tanh(xt @ W + h @ U + (gc.take(E, yt) if teacher_forcing else 0.0))
        return h, (h @ O, gc.softmax_cross_entropy(h @ O, yt))

    def sentence(h, xs):
        h, (logits, losses) = gc.scan(word, h, xs)
        return h, (logits, losses.mean())

    hS, (logits, losses) = gc.scan(sentence, h0, (x, y))
    m.output("logits", logits)
    m.output("last", hS)
    m.minimize((losses * m.input("wt", ("S",))).mean() if weighted else losses.mean())
    return m


def test_forward_needs_only_the_inputs_its_outputs_read(tmp_path):
    """A step that returns its logits and its loss: `forward` for the logits once asked for the labels
    (and computed the loss at every step). Its scans are now copies that compute what the outputs read."""
    mod = gc.compile(_tagger(), out=str(tmp_path / "tagger"), dtype="float64", warm=False)
    assert mod._OUTPUT_INPUTS == ("x", "h0")
    rng = np.random.default_rng(7)
    S, T, B = 2, 3, 2
    params = {k: rng.standard_normal(s) * 0.5 for k, s in mod.PARAM_SHAPES.items()}
    inputs = {"x": rng.standard_normal((S, T, B, 3)), "y": rng.integers(0, 5, (S, T, B)),
              "h0": rng.standard_normal((B, 4))}
    tp = {k: torch.tensor(v) for k, v in params.items()}
    h, logits, losses = torch.tensor(inputs["h0"]), [], []
    for s in range(S):
        per_word = []
        for t in range(T):
            h = torch.tanh(torch.tensor(inputs["x"][s, t]) @ tp["W"] + h @ tp["U"])
            logits.append(h @ tp["O"])
            per_word.append(torch.nn.functional.cross_entropy(logits[-1], torch.tensor(inputs["y"][s, t])))
        losses.append(torch.stack(per_word).mean())
    expected = torch.stack(logits).reshape(S, T, B, 5).numpy()
    out = mod.forward(params, x=inputs["x"], h0=inputs["h0"])
    assert set(out) == {"logits", "last"}
    np.testing.assert_allclose(out["logits"], expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out["last"], h.numpy(), rtol=1e-12, atol=1e-14)
    with_loss = mod.forward(params, **inputs)   # the labels given: the loss too, from the one full scan
    np.testing.assert_allclose(with_loss["logits"], expected, rtol=1e-12, atol=1e-14)
    assert with_loss["loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-12)
    source = (tmp_path / "tagger" / "tagger.py").read_text()
    forward = source[source.index("def _forward("):source.index("def _forward_loss(")]
    assert "in_y" not in forward and "xent" not in forward, forward
    # the labels given without the rest of what the loss reads: the outputs alone, as before the lean copy
    weighted = gc.compile(_tagger(weighted=True), out=str(tmp_path / "wt"), dtype="float64", warm=False)
    assert weighted._OUTPUT_INPUTS == ("x", "h0") and weighted._OUTPUT_READS == ("x", "y", "h0")
    assert set(weighted.forward(params, **inputs)) == {"logits", "last"}
    assert set(weighted.forward(params, **inputs, wt=np.ones(S))) == {"logits", "last", "loss"}
    # a step whose carry reads the labels needs them for the outputs too
    teacher = gc.compile(_tagger(teacher_forcing=True), out=str(tmp_path / "tf"), dtype="float64", warm=False)
    assert teacher._OUTPUT_INPUTS == ("x", "y", "h0")
    with pytest.raises(ValueError, match="missing input 'y'"):
        teacher.forward(params, x=inputs["x"], h0=inputs["h0"])


def test_forward_does_not_ask_for_a_sequence_no_step_reads(tmp_path):
    """A step that unpacks (tok, tags) and never reads tags made forward ask for the tags."""
    m = gc.Model("ignored_seq")
    tok, tags = m.input("tok", ("T", "B"), dtype="int64"), m.input("tags", ("T", "B"), dtype="int64")
    E = m.param("E", (6, 3), init="normal")
    hT, hs = gc.scan(lambda h, xs: (gc.tanh(h + gc.take(E, xs[0])), h), m.input("h0", ("B", 3)), (tok, tags))
    m.output("states", hs)
    m.minimize((hT * hT).mean())
    mod = gc.compile(m, out=str(tmp_path), dtype="float64", warm=False)
    assert mod._OUTPUT_INPUTS == ("tok", "h0")
    rng = np.random.default_rng(2)
    p, tok, h0 = mod.init_params(0), rng.integers(0, 6, (4, 2)), rng.standard_normal((2, 3))
    expected, h = [], h0
    for t in range(4):
        expected.append(h)
        h = np.tanh(h + p["E"][tok[t]])
    np.testing.assert_allclose(mod.forward(p, tok=tok, h0=h0)["states"], np.stack(expected), rtol=1e-12)


def _unused_y(returns_y):
    m = gc.Model("unused_y" if returns_y else "no_y")
    x, h0 = m.input("x", ("T", "B", 4)), m.input("h0", ("B", 6))
    W, U, V = m.param("W", (6, 6)), m.param("U", (4, 6)), m.param("V", (6, 3))

    def step(h, x_t):
        h = gc.tanh(h @ W + x_t @ U)
        return h, (h @ V if returns_y else None)
    hT, _ = gc.scan(step, h0, x)
    m.minimize((hT * hT).mean())
    return m


def test_a_per_step_output_nothing_reads_is_not_computed_and_its_param_gets_the_note(tmp_path):
    """A step returns h @ V and the model never reads those ys: the scan computed them at every step (and its
    VJP V's zero gradient), and V got no note. The training graph's scan now leaves them out."""
    graph = build_training_graph(_unused_y(True), "float64", order=2)
    V = graph.params["V"]
    assert V not in graph.ancestors([graph.loss] + [g for g in graph.grads.values() if g is not None]
                                    + [h for h in graph.hvps.values() if h is not None])
    with pytest.warns(UserWarning, match=r"param 'V' does not reach the loss"):
        mod = gc.compile(_unused_y(True), out=str(tmp_path / "y"), dtype="float64", order=2, warm=False)
    plain = gc.compile(_unused_y(False), out=str(tmp_path / "plain"), dtype="float64", order=2, warm=False)
    rng = np.random.default_rng(3)
    params = {k: 0.5 * rng.standard_normal(s) for k, s in mod.PARAM_SHAPES.items()}
    inputs = {"x": rng.standard_normal((5, 2, 4)), "h0": rng.standard_normal((2, 6))}
    loss, grads = mod.loss_and_grad(params, **inputs)
    want_loss, want = plain.loss_and_grad(params, **inputs)
    assert loss == want_loss and np.all(grads["V"] == 0.0)
    for k in ("W", "U"):
        np.testing.assert_array_equal(grads[k], want[k])
