"""Runs generated `--target cuda` modules under numba-cuda's simulator (tests/test_cuda_target.py).

    NUMBA_ENABLE_CUDASIM=1 python tests/cuda_target_runs.py models|trainer|bppsa BUILD_DIR

Prints one JSON line of errors (float64, same params and inputs): every entry point of each zoo
model's CUDA module against the interpreter (the reference the CPU target is tested against);
the MLP's CUDA module against its CPU target's, its gradients against finite differences, and
the CUDA Trainer against the CPU Trainer; lr_grad and Trainer(gradient="lr") against the CPU's;
device arrays in and out, refusals, pipelines, the cuBLAS path and the CUDA-graph path.
"""
import gc as python_gc
import json
import os
import sys
import time

import numpy as np

assert "1" in (os.environ.get("NUMBA_ENABLE_CUDASIM"), os.environ.get("GRADC_TEST_ON_GPU")), \
    "run under numba-cuda's simulator, or set GRADC_TEST_ON_GPU=1 on a GPU"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gradc as gc  # noqa: E402
import test_codegen as zoo  # noqa: E402
import test_lr_grad as lr_grads  # noqa: E402
import test_lr_graphs as lr_graphs  # noqa: E402
import test_lr_mixing as lr_mixing  # noqa: E402
import test_lr_params as lr_params  # noqa: E402
import test_lr_scan as lr_scans  # noqa: E402
import test_lr_statistics as lr_statistics  # noqa: E402
import test_scan as scans  # noqa: E402
from gradc.interpret import evaluate  # noqa: E402
from gradc.passes.pipeline import build_training_graph  # noqa: E402
from gradc.runtime.cuda import simulated  # noqa: E402

# the models the CUDA backend must run: softmax cross-entropy, max, user elementwise ops, shared
# weights, scalars, layout ops, broadcasting, frozen params, constant arrays, int32 labels
MODELS = [zoo.mlp_weight_decay, zoo.shared_weights, zoo.reductions_rank3, zoo.user_ops, zoo.scalars, zoo.layout_ops,
          zoo.broadcast_patterns, zoo.frozen_and_unused, zoo.constants_and_array_init, zoo.integer_labels_int32]
WITH_HVP = {"cg_mlp", "cg_shared", "cg_reduce3", "cg_scalars"}


def both(make, build, order=1):
    model = make()
    cpu = gc.compile(model, out=os.path.join(build, "cpu"), dtype="float64", order=order, warm_cache=False)
    dev = gc.compile(model, out=os.path.join(build, "cuda"), target="cuda", dtype="float64", order=order)
    return model, cpu, dev


def err(a, b):
    """Largest |a - b| relative to the largest |a| (at least 1), over dicts or arrays."""
    if isinstance(a, dict):
        assert set(a) == set(b), (sorted(a), sorted(b))
        return max([err(a[k], b[k]) for k in a], default=0.0)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b), initial=0.0) / max(1.0, float(np.max(np.abs(a), initial=0.0))))


def reference(model, params, inputs, order, tangents=None):
    """The interpreter's float64 values (the reference the CPU target is tested against in
    tests/test_codegen.py; comparing with it here spares compiling a CPU module per model)."""
    graph = build_training_graph(model, "float64", order=order)
    trainable = [p for p in graph.params if model.param_info[p]["trainable"]]
    roots = {"loss": graph.objective}
    roots |= {("grad", p): graph.grads[p] for p in trainable if graph.grads.get(p) is not None}
    roots |= {("input", i): n for i, n in graph.input_grads.items() if n is not None}
    roots |= {("out", o): n for o, n in graph.outputs.items()}
    if tangents is not None:
        roots |= {("hvp", p): graph.hvps[p] for p in trainable if graph.hvps.get(p) is not None}
    values = evaluate(graph, params, inputs, list(roots.values()), tangents=tangents)
    got = {k: values[n] for k, n in roots.items()}

    def table(kind, names, shape_of):
        return {k: got.get((kind, k), np.zeros(shape_of(k))) for k in names}
    float_inputs = [i for i, n in graph.inputs.items() if graph.dtype(n).startswith("float")]
    return {"loss": got["loss"], "grads": table("grad", trainable, lambda p: graph.shape(graph.params[p])),
            "input_grads": table("input", float_inputs, lambda i: np.shape(inputs[i])),
            "outputs": {o: got[("out", o)] for o in graph.outputs},
            "hvp": table("hvp", trainable, lambda p: graph.shape(graph.params[p])) if tangents is not None else None}


def run_models(build):
    rng = np.random.default_rng(0)
    errors = {}
    for make in MODELS:
        t0 = time.perf_counter()
        model = make()
        order = 2 if model.name in WITH_HVP else 1
        dev = gc.compile(model, out=os.path.join(build, "cuda"), target="cuda", dtype="float64", order=order)
        errors[model.name] = entry_errors(model, dev, dev.init_params(seed=3), zoo._inputs(dev, rng), order, rng)
        print(model.name, round(time.perf_counter() - t0, 1), file=sys.stderr)
    # gc.scan: a host loop calling the step's launches; gradients and HVPs go through reverse scans
    for make in (scans._rnn, scans._gru, scans._stacked, scans._nested, scans._seq_loss):
        t0 = time.perf_counter()
        model = make(f"cg_scan_{make.__name__[1:]}")
        dev = gc.compile(model, out=os.path.join(build, "cuda"), target="cuda", dtype="float64", order=2)
        params, inputs = scans._data(build_training_graph(model, "float64", order=2), rng, T=3, B=2)
        errors[model.name] = entry_errors(model, dev, params, inputs, 2, rng)
        print(model.name, round(time.perf_counter() - t0, 1), file=sys.stderr)
    errors["cg_mask"] = run_mask(build, rng)
    return errors


def run_mask(build, rng):
    """x + (a - 1) * 1e9, attention's mask, against the CPU target where a = 1: the CUDA kernel wrote the
    1e9 in as a literal, sympy multiplied it into (a - 1), and x @ W came out rounded to 1e9's ulps."""
    def masked():
        m = gc.Model("cg_mask")
        x, a = m.input("x", ("N", 3)), m.input("a", ("N", 3))
        z = x @ m.param("W", (3, 3)) + (a - 1.0) * 1e9
        m.output("z", z)
        m.minimize((gc.softmax(z, axis=1) * x).sum())
        return m

    _, cpu, dev = both(masked, os.path.join(build, "mask"))
    params = {"W": rng.standard_normal((3, 3))}
    inputs = {"x": rng.standard_normal((4, 3)), "a": (np.arange(12).reshape(4, 3) % 4 != 1).astype(float)}
    kept = inputs["a"] == 1
    e = {"forward": err(cpu.forward(params, **inputs)["z"][kept], np.asarray(dev.forward(params, **inputs)["z"])[kept])}
    (loss, grads), (dev_loss, dev_grads) = cpu.loss_and_grad(params, **inputs), dev.loss_and_grad(params, **inputs)
    e["loss"], e["grads"] = err(loss, dev_loss), err(grads, dev_grads)
    e["input_grads"] = err(cpu.input_grads(params, **inputs), dev.input_grads(params, **inputs))
    return e


def run_bppsa(build):
    """--scan-backward bppsa on CUDA: every entry point against the interpreter (whose backward is the
    reverse scan): the vanilla RNN (structured Jacobians, with HVPs) at T = 1 and 5 (no level, and
    identity padding), a step that mixes its carry's rows (one dense map over all rows) at T = 4, a
    reverse scan over another scan's ys, and the GRU-style cell (dense Jacobians; two carries side
    by side). Small T and B: the dense Jacobians are a step call per basis vector, slow in the
    simulator."""
    rng = np.random.default_rng(4)
    errors, kernels = {}, {}
    for make, lengths in ((scans._rnn, (1, 5)), (scans._mixing, (4,)), (scans._stacked, (3,)), (scans._gru, (3,))):
        t0 = time.perf_counter()
        model = make(f"bp_{make.__name__[1:]}")
        order = 2 if make is scans._rnn else 1
        dev = gc.compile(model, out=os.path.join(build, "cuda"), target="cuda", dtype="float64", order=order,
                         scan_backward="bppsa")
        text = open(os.path.join(build, "cuda", f"{model.name}.py")).read()
        kernels[model.name] = sorted(w for w in ("bppsa_compose_pairs", "bppsa_push_adjoints", "bppsa_tanh_jacobians")
                                     if f"_{w}[" in text)
        for T in lengths:
            params, inputs = scans._data(build_training_graph(model, "float64", order=order), rng, T=T, B=2)
            errors[f"{model.name} T={T}"] = entry_errors(model, dev, params, inputs, order, rng)
        print(model.name, round(time.perf_counter() - t0, 1), file=sys.stderr)
    return {"errors": errors, "kernels": kernels}


def run_fuzz(build):
    """Random programs with scans (tests/fuzz_graphs.py, seeds 0 and 2: random cells, a reverse scan)
    through --target cuda, reverse and BPPSA backward, against torch autograd: the loss, outputs,
    gradients and HVPs (not the Hessian: one hvp per param element is slow in the simulator).
    Returns {backward: None, or the mismatches the fuzzer reports}. Without scans in scans' steps
    (seed 2 has one): the simulator would take many minutes over its launches; the zoo's nested
    model runs them."""
    from fuzz_graphs import combined_case, compare, gradc_compiled, torch_reference
    case = combined_case((0, 2), nested=False)
    ref = torch_reference(case)
    found = {}
    for backward in ("reverse", "bppsa"):
        t0 = time.perf_counter()
        try:
            got = gradc_compiled(case, os.path.join(build, backward), "float64", hessian=False, target="cuda",
                                 scan_backward=backward)
            compare(case, got, ref, where=f"cuda {backward}")
            found[backward] = None
        except AssertionError as e:
            found[backward] = str(e)[-3000:]
        print("fuzz", backward, round(time.perf_counter() - t0, 1), file=sys.stderr)
    return found


def entry_errors(model, dev, params, inputs, order, rng):
    """Every entry point of CUDA module `dev` against the interpreter."""
    tangents = {k: rng.standard_normal(np.shape(params[k])) for k in dev.TRAINABLE} if order == 2 else None
    ref = reference(model, params, inputs, order, tangents)
    e = {}
    e["forward"] = err(ref["outputs"] | {"loss": ref["loss"]}, dev.forward(params, **inputs))
    loss, grads = dev.loss_and_grad(params, **inputs)
    e["loss"], e["grads"] = err(ref["loss"], loss), err(ref["grads"], grads)
    e["input_grads"] = err(ref["input_grads"], dev.input_grads(params, **inputs))
    if order == 2:
        e["hvp"] = err(ref["hvp"], dev.hvp(params, tangents, **inputs))
    if model.name == "cg_scalars":   # every row of the Hessian is an hvp with a basis vector
        rows = []
        for p in dev.TRAINABLE:
            for i in range(int(np.prod(np.shape(params[p])))):
                basis = {q: np.zeros(np.shape(params[q])) for q in dev.TRAINABLE}
                basis[p].reshape(-1)[i] = 1.0
                hv = reference(model, params, inputs, 2, basis)["hvp"]
                rows.append(np.concatenate([np.reshape(hv[q], -1) for q in dev.TRAINABLE]))
        expected = np.array(rows)
        e["hessian"] = err((expected + expected.T) / 2, dev.hessian(params, **inputs))
    return e


def finite_differences(dev, params, inputs, rng, probes=4, h=1e-6):
    """The CUDA gradients against central differences of the CUDA forward's loss."""
    _, grads = dev.loss_and_grad(params, **inputs)
    worst = 0.0
    for name, g in grads.items():
        for _ in range(probes):
            i = tuple(int(rng.integers(0, n)) for n in g.shape)
            up, down = {k: v.copy() for k, v in params.items()}, {k: v.copy() for k, v in params.items()}
            up[name][i] += h
            down[name][i] -= h
            numeric = (dev.forward(up, **inputs)["loss"] - dev.forward(down, **inputs)["loss"]) / (2 * h)
            worst = max(worst, abs(numeric - g[i]) / max(1.0, abs(numeric)))
    return worst


def run_trainer(build):
    from numba import cuda
    rng = np.random.default_rng(1)
    model, cpu, dev = both(zoo.mlp_weight_decay, build)
    params, inputs = cpu.init_params(seed=5), zoo._inputs(cpu, rng, batch=6)
    out = {"fd": finite_differences(dev, params, inputs, rng)}
    for optimizer, options in (("sgd", dict(lr=0.2, momentum=0.9, clip_norm=0.3)), ("adam", dict(lr=0.05))):
        t1, t2 = cpu.Trainer(params, optimizer=optimizer, **options), dev.Trainer(params, optimizer=optimizer, **options)
        losses = [(t1.step(**inputs), t2.step(**inputs)) for _ in range(3)]
        out[f"{optimizer}_losses"] = max(abs(a - b) for a, b in losses)
        out[f"{optimizer}_params"] = err(t1.params, {k: v.copy_to_host() for k, v in t2.params.items()})
        # a checkpoint round trip continues the same trajectory
        path = os.path.join(build, f"{optimizer}.npz")
        t2.save(path)
        t3 = dev.Trainer.load(path)
        out[f"{optimizer}_resumed"] = abs(t1.step(**inputs) - t3.step(**inputs))
    # inputs already on the device are read there; results can stay there too
    device_inputs = {k: cuda.to_device(v) for k, v in inputs.items()}
    l1, g1 = dev.loss_and_grad(params, **inputs)
    l2, g2 = dev.loss_and_grad({k: cuda.to_device(v) for k, v in params.items()}, **device_inputs)
    out["device_inputs"] = max(abs(l1 - l2), err(g1, g2))
    dev.device_outputs(True)
    _, g3 = dev.loss_and_grad(params, **inputs)
    out["device_outputs_type"] = sorted({type(v).__name__ for v in g3.values()})
    out["device_outputs"] = err(g1, {k: v.copy_to_host() for k, v in g3.items()})
    dev.device_outputs(False)
    # a step whose loss is not finite raises and changes nothing
    tr = dev.Trainer(params, optimizer="adam", lr=0.1)
    before = {k: v.copy_to_host() for k, v in tr.params.items()}
    bad = dict(inputs, x=np.full_like(inputs["x"], np.nan))
    try:
        tr.step(**bad)
        out["nonfinite"] = "no error"
    except FloatingPointError as e:
        out["nonfinite"] = "raised" if "left as they were" in str(e) else str(e)
    out["nonfinite_unchanged"] = err(before, {k: v.copy_to_host() for k, v in tr.params.items()})
    out["nonfinite_steps"] = tr.steps
    # wrong shapes and labels on the device are refused by name, as on the host
    refusals = []
    for given in (dict(device_inputs, x=cuda.to_device(np.ones((6, 4)))), dict(device_inputs, y=cuda.to_device(
            np.full(6, 7, dtype=np.int64)))):
        try:
            dev.loss_and_grad(params, **given)
            refusals.append("accepted")
        except ValueError as e:
            refusals.append(str(e))
    tr = dev.Trainer(params, optimizer="sgd", lr=0.1)
    try:
        tr.step(**dict(device_inputs, y=cuda.to_device(np.full(6, -1, dtype=np.int64))))
        refusals.append("accepted")
    except ValueError as e:
        refusals.append(str(e))
    out["label_step_unchanged"] = err(before, {k: v.copy_to_host() for k, v in tr.params.items()})
    out["refusals"] = refusals
    # a wrong array assigned into tr.params, then a deleted one: refused, and the trainer's own array is back
    name = sorted(tr.params)[0]
    assigned = []
    for wrong in (np.zeros((1, 1), dtype=params[name].dtype), None):
        if wrong is None:
            del tr.params[name]
        else:
            tr.params[name] = wrong
        try:
            tr.save(os.path.join(build, "refused.npz"))
            assigned.append("accepted")
        except ValueError as e:
            assigned.append(str(e))
    tr.step(**inputs)   # works again without the user undoing anything
    out["assigned"] = assigned
    # a scalar param: the Trainer's device view, forward() of tr.params, a checkpoint round trip
    model, cpu_s, dev_s = both(zoo.scalars, os.path.join(build, "scalars"))
    params_s, inputs_s = cpu_s.init_params(seed=2), zoo._inputs(cpu_s, rng)
    t1, t2 = cpu_s.Trainer(params_s, optimizer="adam", lr=0.1), dev_s.Trainer(params_s, optimizer="adam", lr=0.1)
    worst = max(abs(t1.step(**inputs_s) - t2.step(**inputs_s)) for _ in range(2))
    worst = max(worst, err(cpu_s.forward(t1.params, **inputs_s), dev_s.forward(t2.params, **inputs_s)))
    path = os.path.join(build, "scalars.npz")
    t2.save(path)
    t3 = dev_s.Trainer.load(path)
    out["scalar_param"] = max(worst, abs(t1.step(**inputs_s) - t3.step(**inputs_s)))
    out["streamed"] = {"mlp": streamed_backward(dev, params, inputs), "scalars": streamed_backward(dev_s, params_s, inputs_s)}
    _, _, dev_w = both(zoo.shared_weights, os.path.join(build, "shared"))
    out["streamed"]["shared"] = streamed_backward(dev_w, dev_w.init_params(seed=4), zoo._inputs(dev_w, rng))
    return out


def streamed_backward(dev, params, inputs):
    """What a data-parallel Trainer of a CUDA module overlaps its reductions with: the streamed
    backward's final(names) sees those params' gradients already copied into the host buffer (so
    ready came after the kernels that write them), every trainable param once, the last layer first."""
    loss, expected = dev.loss_and_grad(params, **inputs)
    tr = dev.Trainer(params)
    host = tr._dp_buffer()
    host[...] = np.nan
    announced, worst = [], [0.0]

    def final(names):
        for name in names:
            start, stop = dev.GRAD_SLICES[name]
            worst[0] = max(worst[0], err(expected[name], host[start:stop].reshape(dev.PARAM_SHAPES[name])))
        announced.extend(names)

    a = dev._SIGNATURE.inputs(inputs, dev._LOSS_INPUTS, "test", device_labels_later=True)
    got, weight = tr._dp_gradients(a, host, final)
    return {"error": max(worst[0], abs(got - loss)), "weight": weight, "once": sorted(announced) == sorted(dev.TRAINABLE),
            "last_first": announced.index(dev.TRAINABLE[-1]) <= announced.index(dev.TRAINABLE[0]),
            "host_type": type(host).__name__}


def run_lr(build):
    """lr_grad and Trainer(gradient="lr") on CUDA against the CPU target: the same noise (drawn in the
    kernels from the seed), so the same estimate; an MLP, an RNN as a gc.scan (device inputs too),
    language models with trained embeddings, an MLP with dropout, params read other than as a factor, a graph
    convolution, a convolutional RNN, a nested scan, batch statistics, ops that mix the batch's rows."""
    from numba import cuda
    rng = np.random.default_rng(2)
    out = {}
    model, cpu, dev = both(zoo.mlp_weight_decay, os.path.join(build, "mlp"))
    params, inputs = cpu.init_params(seed=5), zoo._inputs(cpu, rng, batch=6)
    for label, mode in (("antithetic", dict()), ("layerwise", dict(antithetic=False, layerwise=True))):
        l1, g1 = cpu.lr_grad(params, samples=4, seed=3, **inputs, **mode)
        l2, g2 = dev.lr_grad(params, samples=4, seed=3, **inputs, **mode)
        out[f"mlp_{label}"] = max(abs(l1 - l2), err(g1, g2))
    t1 = cpu.Trainer(params, optimizer="adam", lr=0.05, gradient="lr", samples=4)
    t2 = dev.Trainer(params, optimizer="adam", lr=0.05, gradient="lr", samples=4)
    worst = max(abs(t1.step(**inputs) - t2.step(**inputs)) for _ in range(3))
    out["trainer"] = max(worst, err(t1.params, {k: v.copy_to_host() for k, v in t2.params.items()}))
    path = os.path.join(build, "lr.npz")
    t2.save(path)
    t3 = dev.Trainer.load(path)
    out["trainer_resumed"] = abs(t1.step(**inputs) - t3.step(**inputs)) if t3.gradient == "lr" else "not lr"
    model, cpu, dev = both(lambda: scans._rnn("lr_scan_rnn"), os.path.join(build, "rnn"))
    params = cpu.init_params(seed=5)
    inputs = {"x": rng.normal(size=(3, 2, 3)), "y": rng.integers(0, 2, 2), "h0": rng.normal(size=(2, 4))}
    l1, g1 = cpu.lr_grad(params, samples=2, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=2, seed=3, **{k: cuda.to_device(v) for k, v in inputs.items()})
    out["scan_device_inputs"] = max(abs(l1 - l2), err(g1, g2))
    # a loss made in the step (a batch mean, kept per row; the count of rows a closed-over scalar)
    model, cpu, dev = both(lambda: lr_scans._language_model(False), os.path.join(build, "lm"))
    params = cpu.init_params(seed=5)
    inputs = {"tok": rng.integers(0, 5, (3, 2)), "tgt": rng.integers(0, 5, (3, 2)), "h0": rng.normal(size=(2, 4))}
    l1, g1 = cpu.lr_grad(params, samples=2, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=2, seed=3, **inputs)
    out["scan_step_loss"] = max(abs(l1 - l2), err(g1, g2))
    # trained embeddings: looked up before the scan (noise on rows on axis 1) and in the step (int ys)
    model, cpu, dev = both(lambda: lr_scans._embedded("both"), os.path.join(build, "embedded"))
    params = cpu.init_params(seed=5)
    inputs = {"tok": rng.integers(0, 5, (3, 2)), "tgt": rng.integers(0, 5, (3, 2)), "h0": rng.normal(size=(2, 4))}
    l1, g1 = cpu.lr_grad(params, samples=2, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=2, seed=3, **inputs)
    out["embeddings"] = max(abs(l1 - l2), err(g1, g2))
    # the model's own dropout and noise, drawn once and read by every copy
    model, cpu, dev = both(lr_grads._dropout_mlp, os.path.join(build, "dropout"))
    params = cpu.init_params(seed=5)
    inputs = {"x": rng.normal(size=(6, 5)), "y": rng.integers(0, 3, 6), "draw": np.array(9)}
    l1, g1 = cpu.lr_grad(params, samples=4, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=4, seed=3, **inputs)
    out["dropout"] = max(abs(l1 - l2), err(g1, g2))
    # params read other than as a factor: a layer norm's gain (a site of its own), a weight made of params
    # closed over by a step, a penalty added to the loss and factors scaling it (exact parts)
    for name in ("layer_norm", "scan_of_a_scaled_weight", "uncertainty_weighted"):
        model, cpu, dev = both(lr_params.MODELS[name], os.path.join(build, name))
        _, params, inputs = lr_params._problem(name, rng)
        l1, g1 = cpu.lr_grad(params, samples=4, seed=3, **inputs)
        l2, g2 = dev.lr_grad(params, samples=4, seed=3, **inputs)
        out[name] = max(abs(l1 - l2), err(g1, g2))
    # a graph convolution: the first layer's noise pairs with its neighbours' losses (A an input)
    model, cpu, dev = both(lambda: lr_graphs.gcn("input", None), os.path.join(build, "gcn"))
    _, params, inputs = lr_graphs._problem("input")
    l1, g1 = cpu.lr_grad(params, samples=4, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=4, seed=3, **inputs)
    out["gcn_neighbours"] = max(abs(l1 - l2), err(g1, g2))
    # convs in a scan's step: each site's part a scan of one conv VJP per step
    model, cpu, dev = both(lr_scans._conv_rnn, os.path.join(build, "convrnn"))
    _, params, inputs = lr_scans._conv_rnn_problem(rng, T=2, B=2)
    l1, g1 = cpu.lr_grad(params, samples=2, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=2, seed=3, **inputs)
    out["conv_rnn"] = max(abs(l1 - l2), err(g1, g2))
    # a scan nested in a step: the inner site's noise one slice per (outer, inner) step
    model, cpu, dev = both(lambda: scans._nested("lr_nested"), os.path.join(build, "nested"))
    _, params, inputs = lr_scans._nested_problem(rng, T=2, B=2)
    l1, g1 = cpu.lr_grad(params, samples=2, seed=3, **inputs)
    l2, g2 = dev.lr_grad(params, samples=2, seed=3, **inputs)
    out["nested_scan"] = max(abs(l1 - l2), err(g1, g2))
    # batch statistics, one per copy: batch norm in a conv net; a scan's results normalised per step
    # (sigma 0.1: an estimate paired with a copy's whole loss divides loss differences by sigma, so the GPU's
    # other rounding (FMA, libdevice) shows ~1e-12 at sigma 1e-2: review M's replays with params 1 ulp apart)
    for name in ("bn_conv", "time_major", "folded_conv"):   # folded_conv: noise on each copy's g / sqrt(var + eps)
        model, cpu, dev = both(lr_statistics.MODELS[name], os.path.join(build, name))
        _, params, inputs = lr_statistics._problem(name, rng, B=4)
        l1, g1 = cpu.lr_grad(params, samples=2, seed=3, sigma=0.1, **inputs)
        l2, g2 = dev.lr_grad(params, samples=2, seed=3, sigma=0.1, **inputs)
        out[name] = max(abs(l1 - l2), err(g1, g2))
    # ops that mix the batch's rows, run once per copy: CLIP's za @ zb.T (batch_matmul over the copies, a
    # softmax and picks per copy), and a conv of each copy's mean image
    for name in ("clip", "mean_image_conv"):
        model, cpu, dev = both(lr_mixing.MODELS[name], os.path.join(build, name))
        _, params, inputs = lr_mixing._problem(name, rng, B=4)
        l1, g1 = cpu.lr_grad(params, samples=2, seed=3, sigma=0.1, **inputs)
        l2, g2 = dev.lr_grad(params, samples=2, seed=3, sigma=0.1, **inputs)
        out[name] = max(abs(l1 - l2), err(g1, g2))
    return out


class FakeGraphs:
    """Stream capture as the driver does it, for the simulator: launches whose stream is a builder
    being built are recorded (arrays by reference, numbers by value) and replayed by launch()."""

    def __init__(self):
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        self.captures = self.replays = 0
        original_getitem, original_call = FakeCUDAKernel.__getitem__, FakeCUDAKernel.__call__
        fakes = self

        def getitem(kernel, configuration):
            kernel._gradc_config = configuration
            return original_getitem(kernel, configuration)

        def call(kernel, *args):
            config = kernel._gradc_config
            if len(config) > 2 and isinstance(config[2], Builder) and config[2].building:
                config[2].launches.append((kernel, config[:2], args))
                return None      # captured, not run
            return original_call(kernel, *args)

        class Builder:
            def __init__(self):
                self.launches, self.building = [], False

            def begin_building(self):
                self.building = True

            def end_building(self):
                self.building = False
                return self

            def complete(self):
                fakes.captures += 1
                return Graph(self.launches)

        class Graph:
            def __init__(self, launches):
                self.launches = launches

            def launch(self, stream):
                fakes.replays += 1
                for kernel, config, args in self.launches:
                    kernel[config](*args)

        FakeCUDAKernel.__getitem__, FakeCUDAKernel.__call__ = getitem, call
        self.Builder = Builder

    def create_graph_builder(self):
        return self.Builder()


class CountedGraphs:
    """On a real GPU the driver captures: the runner's own counts of its captures (first calls with
    new shapes) and its replays (calls that found a captured graph)."""

    def __init__(self, runner):
        self.runner = runner

    @property
    def captures(self):
        return self.runner.calls["captured"]

    @property
    def replays(self):
        return self.runner.calls["replayed"]


def run_graphs(build):
    """The runner's CUDA-graph path (capture once per shapes, copy arguments into the captured
    buffers, replay), with the driver's capture simulated by FakeGraphs."""
    from numba import cuda
    rng = np.random.default_rng(2)
    model, cpu, dev = both(zoo.mlp_weight_decay, build)
    dev._CUDA._start()
    if simulated():
        fakes = FakeGraphs()
        dev._CUDA.use_graphs, dev._CUDA._device = True, fakes
    else:   # a real GPU: the driver captures and replays
        fakes = CountedGraphs(dev._CUDA)
    params = cpu.init_params(seed=7)
    out, worst = {}, 0.0
    # a new batch size is a new capture; the same one replays, its numpy inputs sent in one transfer, or
    # (on_device) as device arrays, each copied on the device into its place in that transfer's buffer
    for batch, on_device in ((6, False), (6, False), (6, False), (4, False), (6, False), (6, True), (6, False)):
        inputs = zoo._inputs(cpu, rng, batch=batch)
        l1, g1 = cpu.loss_and_grad(params, **inputs)
        given = {k: cuda.to_device(v) for k, v in inputs.items()} if on_device else inputs
        l2, g2 = dev.loss_and_grad(params, **given)
        worst = max(worst, abs(l1 - l2), err(g1, g2))
    out["loss_and_grad"], out["captures"], out["replays"] = worst, fakes.captures, fakes.replays
    inputs = zoo._inputs(cpu, rng, batch=6)
    t1 = cpu.Trainer(params, optimizer="adam", lr=0.05, clip_norm=0.5)
    t2 = dev.Trainer(params, optimizer="adam", lr=0.05, clip_norm=0.5)
    before = fakes.replays
    losses = []
    for step in range(4):
        if step == 2:   # hyperparameters reach the captured step without a new capture
            t1.lr = t2.lr = 0.01
        batch = zoo._inputs(cpu, rng, batch=6)
        losses.append(abs(t1.step(**batch) - t2.step(**batch)))
    out["trainer_losses"], out["trainer_replays"] = max(losses), fakes.replays - before
    out["trainer_params"] = err(t1.params, {k: v.copy_to_host() for k, v in t2.params.items()})
    out["graph_error"] = dev._CUDA.graph_error
    out |= run_refused_capture(cpu, dev, params, rng)
    return out | run_graph_temporaries(os.path.join(build, "scan"), fakes if simulated() else None)


class RefusingDevice:
    """The runner's device, whose captures fail while `refuse` is set (as CuPy refuses cuBLAS)."""

    def __init__(self, device):
        self.device, self.refuse = device, False

    def create_graph_builder(self):
        if self.refuse:
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        return self.device.create_graph_builder()

    def __getattr__(self, name):
        return getattr(self.device, name)


def run_refused_capture(cpu, dev, params, rng):
    """One capture refused: the calls with those shapes launch directly from then on; the others keep
    replaying their graphs, and a new shape is still captured."""
    from gradc.runtime.cuda_host import _DIRECT
    runner = dev._CUDA
    refusing = runner._device = RefusingDevice(runner._device)
    refusing.refuse = True
    worst = 0.0
    for batch in (3, 3, 6, 5, 3, 6, 5):
        inputs = zoo._inputs(cpu, rng, batch=batch)
        l1, g1 = cpu.loss_and_grad(params, **inputs)
        l2, g2 = dev.loss_and_grad(params, **inputs)
        worst = max(worst, abs(l1 - l2), err(g1, g2))
        refusing.refuse = False
    direct = sum(v is _DIRECT for v in runner._graphs.values())
    runner._device = refusing.device
    return {"refused": worst, "refused_direct": direct, "refused_error": runner.graph_error,
            "refused_captured": sum(v is not _DIRECT for v in runner._graphs.values()), "still_on": runner.use_graphs}


def run_graph_temporaries(build, fakes):
    """A scan's carries and work space are temporaries its host function makes while the graph is
    captured; the graph writes to them at every replay, so the runner must hold them: freed, their
    memory would go to the next arrays made (here: many, filled with 7, after numba's pending frees
    are flushed), and the replays would write into those. Under the simulator FakeGraphs keeps the
    recorded launches' arrays alive itself, so there only the count of held temporaries can fail."""
    from numba import cuda
    rng = np.random.default_rng(4)
    model, cpu, dev = both(lambda: scans._rnn("graph_scan_rnn"), build)
    runner = dev._CUDA
    runner._start()
    if fakes is not None:
        runner.use_graphs, runner._device = True, fakes
    else:
        CountedGraphs(runner)
    params = cpu.init_params(seed=5)
    inputs = {"x": rng.normal(size=(3, 2, 3)), "y": rng.integers(0, 2, 2), "h0": rng.normal(size=(2, 4))}
    dev.loss_and_grad(params, **inputs)   # the first call captures
    (captured,) = runner._graphs.values()
    held = captured.keep[2]
    del captured
    python_gc.collect()
    if fakes is None:   # a real GPU: what numba would free later, freed now
        cuda.current_context().deallocations.clear()
    others = [cuda.to_device(np.full(a.shape, 7.0)) for a in held for _ in range(4)]
    worst = 0.0
    for _ in range(3):
        l1, g1 = cpu.loss_and_grad(params, **inputs)
        l2, g2 = dev.loss_and_grad(params, **inputs)
        worst = max(worst, abs(l1 - l2), err(g1, g2))
    untouched = all(bool((o.copy_to_host() == 7.0).all()) for o in others)
    return {"scan_temporaries_held": len(held), "scan_replays": worst, "others_untouched": untouched}


def run_library(build):
    """The cuBLAS path of gradc/runtime/cuda_gemm.py, with CuPy simulated: the product from the
    library, then the site's epilogue kernel in place (bias, activation, weight decay)."""
    import gradc.runtime.cuda_gemm as sites
    calls = []

    class View:
        def __init__(self, array, transposed=False):
            self.array, self.transposed = array, transposed

        @property
        def T(self):
            return View(self.array, not self.transposed)

        def host(self):
            a = self.array.copy_to_host()
            return a.T if self.transposed else a

    class ExternalStream:
        def __init__(self, pointer):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class FakeCupy:
        cuda = type("cuda", (), {"ExternalStream": ExternalStream})

        @staticmethod
        def asarray(x):   # x: an array as cuda_gemm hands it to CuPy (_StreamlessInterface)
            return View(x.array)

        @staticmethod
        def matmul(a, b, out):
            calls.append((a.transposed, b.transposed))
            out.array.copy_to_device(np.ascontiguousarray(a.host() @ b.host()))

    rng = np.random.default_rng(5)
    model, cpu, dev = both(zoo.mlp_weight_decay, build)
    params, inputs = cpu.init_params(seed=6), zoo._inputs(cpu, rng, batch=6)
    library = FakeCupy
    if not simulated():   # a real GPU: CuPy's cuBLAS itself where CuPy is installed, its products counted
        try:
            import cupy

            class CountedCupy:
                cuda = cupy.cuda
                asarray = staticmethod(cupy.asarray)

                @staticmethod
                def matmul(a, b, out):
                    calls.append((not a.flags.c_contiguous, not b.flags.c_contiguous))
                    return cupy.matmul(a, b, out=out)
            library = CountedCupy
        except ImportError:
            pass
    saved = sites._CUPY[:], sites.LIBRARY_MIN_FLOP
    sites._CUPY[:], sites.LIBRARY_MIN_FLOP = [library], 0
    try:
        l1, g1 = cpu.loss_and_grad(params, **inputs)
        l2, g2 = dev.loss_and_grad(params, **inputs)
    finally:
        sites._CUPY[:], sites.LIBRARY_MIN_FLOP = saved
    return {"error": max(abs(l1 - l2), err(g1, g2)), "calls": len(calls),
            "transposes": sorted({str(c) for c in calls})}


def run_split(build):
    """The split-K path of gradc/runtime/cuda_gemm.py (few output tiles, a long K dim), made to run at
    the simulator's sizes by asking it for 64 multiprocessors and 16-deep slices: the MLP's gradients
    over 40 rows and its lr_grad over 8 x 40, and an RNN's (gc.scan) lr_grad, whose weight gradients
    sum over every step's rows, against the CPU target. "splits": each part's slice counts."""
    import gradc.runtime.cuda_gemm as sites
    counts = []
    split = sites.Gemm._split

    def counted(self, stream, count, args):
        counts.append(count)
        return split(self, stream, count, args)

    rng = np.random.default_rng(8)
    saved = sites._SM_COUNT[:], sites.SLICE_MIN_DEPTH
    sites._SM_COUNT[:], sites.SLICE_MIN_DEPTH, sites.Gemm._split = [64], 16, counted
    out, splits = {}, {}
    try:
        model, cpu, dev = both(zoo.mlp_weight_decay, os.path.join(build, "mlp"))
        params, inputs = cpu.init_params(seed=4), zoo._inputs(cpu, rng, batch=40)
        model, cpu_rnn, dev_rnn = both(lambda: scans._rnn("split_scan_rnn"), os.path.join(build, "rnn"))
        rnn_params = cpu_rnn.init_params(seed=5)
        rnn_inputs = {"x": rng.normal(size=(6, 8, 3)), "y": rng.integers(0, 2, 8), "h0": rng.normal(size=(8, 4))}
        for part, (a, b, p, x, options) in {
                "mlp": (cpu.loss_and_grad, dev.loss_and_grad, params, inputs, {}),
                "mlp_lr": (cpu.lr_grad, dev.lr_grad, params, inputs, dict(samples=8, seed=3)),
                "rnn_lr": (cpu_rnn.lr_grad, dev_rnn.lr_grad, rnn_params, rnn_inputs, dict(samples=4, seed=3))}.items():
            counts.clear()
            l1, g1 = a(p, **x, **options)
            l2, g2 = b(p, **x, **options)
            out[part], splits[part] = max(abs(l1 - l2), err(g1, g2)), counts[:]
    finally:
        sites._SM_COUNT[:], sites.SLICE_MIN_DEPTH, sites.Gemm._split = (*saved, split)
    return out | {"splits": splits}


def run_pipelines(build):
    """--target cuda with --devices K and --microbatches M (virtual devices on one GPU) against the
    one-device CPU build: batch 7, so the microbatches differ in size; weight decay counts once."""
    rng = np.random.default_rng(3)
    model = zoo.mlp_weight_decay()
    cpu = gc.compile(model, out=os.path.join(build, "cpu"), dtype="float64", order=1, warm_cache=False)
    params, inputs = cpu.init_params(seed=4), zoo._inputs(cpu, rng, batch=7)
    l1, g1 = cpu.loss_and_grad(params, **inputs)
    out = {}
    for K, schedule, M in ((2, "gpipe", 3), (2, "1f1b", 2), (3, "sequential", 2)):
        dev = gc.compile(model, out=os.path.join(build, f"k{K}{schedule}"), target="cuda", dtype="float64", order=1,
                         devices=K, schedule=schedule, microbatches=M, bind={"B": 7})
        l2, g2 = dev.loss_and_grad(params, **inputs)
        key = f"K{K} {schedule} M{M}"
        out[key] = max(abs(l1 - l2), err(g1, g2))
        out[key + " devices"] = sorted(dev.memory_stats()["arena_bytes"])
    t1, t2 = cpu.Trainer(params, optimizer="sgd", lr=0.1, momentum=0.9), dev.Trainer(params, optimizer="sgd", lr=0.1,
                                                                                       momentum=0.9)
    out["trainer"] = max(abs(t1.step(**inputs) - t2.step(**inputs)) for _ in range(2))
    out["trainer_params"] = err(t1.params, {k: v.copy_to_host() for k, v in t2.params.items()})
    # lr_grad runs whole, not in the stages: the CPU build's estimate, alone and driving a Trainer
    l1, g1 = cpu.lr_grad(params, samples=4, sigma=1e-2, seed=2, **inputs)
    l2, g2 = dev.lr_grad(params, samples=4, sigma=1e-2, seed=2, **inputs)
    out["lr_grad"] = max(abs(l1 - l2), err(g1, g2))
    for key, parallel in (("lr_trainer", None), ("lr_trainer_data_parallel", "data")):
        t1, t2 = (mod.Trainer(params, optimizer="sgd", lr=0.1, gradient="lr", samples=4, parallel=p)
                  for mod, p in ((cpu, None), (dev, parallel)))
        out[key] = max(abs(t1.step(**inputs) - t2.step(**inputs)), err(
            t1.params, {k: v.copy_to_host() for k, v in t2.params.items()}))
    # the simulator is given 3 GPUs; a real machine's own GPUs are not faked
    out["gpus"] = run_stage_gpus(os.path.join(build, "gpus")) if simulated() else None
    return out


def run_stage_gpus(build):
    """One stage per GPU in one process, with the simulator given 3 GPUs (they share its memory,
    so this checks the runners, the copies and the event order, not real peer copies). The model
    has skips and a weight shared across the cut, so values cross both ways."""
    from numba import cuda
    from numba.cuda.simulator.cudadrv import devices
    from gradc.runtime.cuda_stages import stage_gpus
    from test_memory import _inputs, _pinned_dag

    model = _pinned_dag()
    cpu = gc.compile(model, out=os.path.join(build, "cpu"), dtype="float64", order=1, warm_cache=False)
    params, inputs = cpu.init_params(seed=4), _inputs(cpu, 7, np.random.default_rng(8))

    current, log = [0], []   # the stack of current GPUs

    class Context(devices.FakeCUDAContext):   # a GPU whose `with` makes it current
        def __enter__(self):
            current.append(self.id)

        def __exit__(self, *exc):
            current.pop()

    class Event:
        def record(self, stream=0):
            log.append(("record", current[-1]))

        def wait(self, stream=0):
            log.append(("wait", current[-1]))

    saved = cuda.gpus.lst, cuda.event
    cuda.gpus.lst, cuda.event = tuple(Context(i) for i in range(3)), Event
    try:
        dev = gc.compile(model, out=os.path.join(build, "cuda"), target="cuda", dtype="float64", order=1,
                         devices=2, schedule="1f1b", microbatches=2, bind={"B": 7})
        l1, g1 = cpu.loss_and_grad(params, **inputs)
        l2, g2 = dev.loss_and_grad(params, **inputs)
        t1, t2 = cpu.Trainer(params, optimizer="adam", lr=0.01), dev.Trainer(params, optimizer="adam", lr=0.01)
        steps = max(abs(t1.step(**inputs) - t2.step(**inputs)) for _ in range(2))
        runners = [(r.gpu, r is dev._CUDA) for r in dev._PIPELINE.memory.runners]
        chosen = {}
        for spec in ("virtual", "1,0", "0,5", "0"):   # GRADC_STAGE_GPUS: each stage's GPU, named
            os.environ["GRADC_STAGE_GPUS"] = spec
            try:
                chosen[spec] = stage_gpus(dev._CUDA, 2)
            except ValueError as e:
                chosen[spec] = str(e)
        del os.environ["GRADC_STAGE_GPUS"]
        pairs = [(a[1], b[1]) for a, b in zip(log, log[1:]) if a[0] == "record" and b[0] == "wait"]
        return {"error": max(abs(l1 - l2), err(g1, g2), steps, err(t1.params, {k: v.copy_to_host() for k, v in
                                                                               t2.params.items()})),
                "runners": runners, "held": sorted(dev.memory_stats()["arena_bytes"]),
                "events": len(log), "crossings": sorted(set(pairs)), "chosen": chosen}
    finally:
        cuda.gpus.lst, cuda.event = saved


if __name__ == "__main__":
    what, build = sys.argv[1], sys.argv[2]
    if what == "models":   # (with the pipelines: the two processes then take about as long)
        result = {"zoo": run_models(build), "pipelines": run_pipelines(os.path.join(build, "pipelines"))}
    elif what == "bppsa":
        result = run_bppsa(build) | {"fuzz": run_fuzz(os.path.join(build, "fuzz"))}
    else:   # the Trainer, device arrays, refusals; then the graph path (it patches the simulator)
        result = run_trainer(build) | {"lr": run_lr(os.path.join(build, "lr")),
                                       "library": run_library(os.path.join(build, "library")),
                                       "split": run_split(os.path.join(build, "split")),
                                       "graphs": run_graphs(os.path.join(build, "graphs"))}
    print(json.dumps(result))
