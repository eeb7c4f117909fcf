"""A training step on one GPU: gradc --target cuda against PyTorch eager and PyTorch with its whole
step captured in a CUDA graph (torch.cuda.graph), in one run; and the generated GEMM against cuBLAS.

    bash bench/gpu_check.sh (the device tool), or, with numba-cuda working:
    python3 bench/gpu_step.py [--quick] [--only N] [--check-only] [--out DIR]

MLPs (ReLU hidden layers, softmax cross-entropy, SGD with momentum 0.9, float32, TF32 off):
784-256-256-10 at batch 64, 784-1024-1024-10 at 256, 1024-4096-4096-4096-10 at 1024. Every
variant starts from the same parameters and batch. Before anything is timed, gradc's float64 CUDA
build must match torch's float64 autograd to rounding, and its float32 CUDA and CPU builds to an L2
bound (see step_table for why not to rounding); the first losses of gradc and torch must agree. Each variant is warmed up, then
timed in interleaved rounds of steps with CUDA events; the step includes reading the loss back, as
a training loop that logs it does. Medians; ratios against the gradc column. Needs a GPU and torch.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = [((784, 256, 256, 10), 64), ((784, 1024, 1024, 10), 256), ((1024, 4096, 4096, 4096, 10), 1024)]
LR, MOMENTUM = 0.01, 0.9


def gradc_model(widths, batch):
    import gradc as gc
    m = gc.Model(f"mlp_{'_'.join(map(str, widths))}")
    x = m.input("x", ("B", widths[0]))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        h = h @ m.param(f"W{i}", (a, b)) + m.param(f"b{i}", (b,))
        if i < len(widths) - 2:
            h = gc.relu(h)
    m.minimize(gc.softmax_cross_entropy(h, y))
    return m


def torch_model(widths, params):
    import torch
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        lin = torch.nn.Linear(a, b).cuda()
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(params[f"W{i}"].T.copy()))
            lin.bias.copy_(torch.from_numpy(params[f"b{i}"]))
        layers.append(lin)
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def reference(widths, params, x, y):
    """The loss and gradients from torch's autograd in float64 on the CPU."""
    import torch
    ps = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    h = torch.tensor(x, dtype=torch.float64)
    for i in range(len(widths) - 1):
        h = h @ ps[f"W{i}"] + ps[f"b{i}"]
        if i < len(widths) - 2:
            h = torch.relu(h)
    loss = torch.nn.functional.cross_entropy(h, torch.from_numpy(y))
    loss.backward()
    return loss.item(), {k: p.grad.numpy() for k, p in ps.items()}


def timed(step, rounds, steps):
    """Per-step milliseconds of each round (CUDA events around `steps` calls)."""
    import torch
    out = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            step()
        stop.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(stop) / steps)
    return out


def step_table(quick, details, wrong, check_only=False, only=None):
    import torch
    import gradc as gc
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for widths, batch in [MODELS[only]] if only is not None else MODELS[:2] if quick else MODELS:
        model = gradc_model(widths, batch)
        build = tempfile.mkdtemp(prefix="gradc-gpu-")
        dev = gc.compile(model, out=build, target="cuda", order=1)
        cpu = gc.compile(model, out=os.path.join(build, "cpu"), order=1, warm_cache=False)
        params = dev.init_params(seed=0)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, widths[0])).astype(np.float32)
        y = rng.integers(0, widths[-1], batch)
        # Correctness first, against torch's float64 autograd on the CPU. The float64 CUDA build runs the
        # same generated code and must agree to rounding. A float32 build may flip a ReLU's mask where a
        # pre-activation lies within float32 rounding of 0, and each flip moves a whole row of the
        # gradients below it: on the 4096-wide MLP, cuBLAS's float32 products (error ~2e-6 of the
        # largest entry) flip a few masks and give 1e-2 max-relative error on the GPU, and flips from
        # noise of that size in a float64 numpy model give 4e-3 to 7e-3 L2-relative (against ~1e-7
        # with none). So float32 builds are held to an L2 bound that catches a wrong kernel, not to
        # rounding; bench/gpu_gemm_accuracy.py holds each GEMM path to rounding.
        l_ref, g_ref = reference(widths, params, x, y)
        dev64 = gc.compile(model, out=os.path.join(build, "f64"), target="cuda", order=1, dtype="float64", warm=False)
        errors = {}
        for label, build_, dtype in (("cuda float64", dev64, np.float64), ("cpu", cpu, np.float32), ("cuda", dev, np.float32)):
            for call in range(1, 4):   # the first call runs the launches; later ones replay its CUDA graph
                l_got, g_got = build_.loss_and_grad({k: v.astype(dtype) for k, v in params.items()}, x=x.astype(dtype), y=y)
                errors[f"{label} call {call}"] = {"loss": abs(l_got - l_ref) / max(1.0, abs(l_ref))} | {
                    k: float(np.linalg.norm(g_got[k] - g_ref[k]) / (np.linalg.norm(g_ref[k]) + 1e-30)) for k in g_ref}
        f64_err = max(max(e.values()) for k, e in errors.items() if k.startswith("cuda float64"))
        grad_err = max(max(e.values()) for k, e in errors.items() if not k.startswith("cuda float64"))
        if f64_err > 1e-10 or grad_err > 5e-2:   # not timed (a wrong kernel gives errors of order 1)
            print(f"WRONG: {'-'.join(map(str, widths))}: off torch's float64 gradients (L2-relative): {json.dumps(errors)}",
                  flush=True)
            wrong.append(widths)
            continue
        if check_only:
            continue
        xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
        net = torch_model(widths, params)
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        loss_fn = torch.nn.CrossEntropyLoss()

        def eager():
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(net(xt), yt)
            loss.backward()
            opt.step()
            return loss.item()

        first_torch = eager()
        tr = dev.Trainer(params, optimizer="sgd", lr=LR, momentum=MOMENTUM)
        first_gradc = tr.step(x=xt, y=yt)      # torch tensors in: read on the device, no copy to host
        assert abs(first_torch - first_gradc) <= 1e-4 * max(1.0, abs(first_torch)), (first_torch, first_gradc)

        # torch with the whole step in one CUDA graph (the recipe of torch.cuda.graph's docs)
        net_g = torch_model(widths, params)
        opt_g = torch.optim.SGD(net_g.parameters(), lr=LR, momentum=MOMENTUM)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt_g.zero_grad(set_to_none=True)
                loss_fn(net_g(xt), yt).backward()
                opt_g.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt_g.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = loss_fn(net_g(xt), yt)
            static_loss.backward()
            opt_g.step()

        def graphed():
            graph.replay()
            return static_loss.item()

        variants = {"gradc": lambda: tr.step(x=xt, y=yt), "torch eager": eager, "torch graph": graphed}
        for f in variants.values():   # warm-up
            for _ in range(20):
                f()
        rounds, steps = (3, 20) if quick else (7, 50)
        times = {k: [] for k in variants}
        for _ in range(rounds):      # interleaved, so drift hits every variant alike
            for k, f in variants.items():
                times[k] += timed(f, 1, steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": "-".join(map(str, widths)), "batch": batch, **{k: round(v, 4) for k, v in med.items()},
               "eager / gradc": round(med["torch eager"] / med["gradc"], 2),
               "graph / gradc": round(med["torch graph"] / med["gradc"], 2),
               "graph calls": dict(dev._CUDA.calls), "graph error": dev._CUDA.graph_error,
               "float32 grad err (L2) vs torch f64": grad_err, "float64 grad err": f64_err}
        rows.append(row)
        details.append({"row": row, "times": times})
    return rows


def gemm_table(quick):
    """The generated register-tiled GEMM (and the 16x16 one) against cuBLAS fp32, TF32 off."""
    import torch
    from gpu_gemm_accuracy import kernels_module
    from gradc.runtime.cuda import big_tiles, load_cuda, tiles
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = load_cuda()
    kernels = kernels_module(np.float32)
    names = {"tiled": kernels[("matmul_tiled", False, False)], "16x16": kernels[("matmul", False, False)]}
    rows = []
    for m, n, depth in ([(1024, 4096, 4096)] if quick else [(1024, 4096, 4096), (4096, 4096, 4096), (256, 1024, 784)]):
        a = torch.randn(m, depth, device="cuda")
        b = torch.randn(depth, n, device="cuda")
        out = torch.empty(m, n, device="cuda")
        ref = a @ b
        ours = {}
        for label, fn in names.items():
            config = big_tiles if label == "tiled" else tiles
            da, db, dout = (cuda.as_cuda_array(t) for t in (a, b, out))

            def launch(fn=fn, config=config):
                fn[config(dout)](da, db, dout)
            launch()
            torch.cuda.synchronize()
            assert torch.allclose(out, ref, rtol=1e-3, atol=1e-2 * depth ** 0.5), label
            for _ in range(3):
                launch()
            ours[label] = statistics.median(timed(launch, 5 if quick else 11, 5))
        cublas = statistics.median(timed(lambda: torch.matmul(a, b, out=out), 5 if quick else 11, 5))
        flop = 2.0 * m * n * depth
        tf = {k: flop / (v * 1e-3) / 1e12 for k, v in ours.items()}
        rows.append({"m,n,k": f"{m},{n},{depth}", "gradc tiled TFLOP/s": round(tf["tiled"], 2),
                     "gradc 16x16 TFLOP/s": round(tf["16x16"], 2), "cuBLAS TFLOP/s": round(flop / (cublas * 1e-3) / 1e12, 2),
                     "tiled / cuBLAS": round(tf["tiled"] / (flop / (cublas * 1e-3) / 1e12), 3)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the two smaller models, one GEMM size, fewer rounds")
    ap.add_argument("--only", type=int, help="only this model (0, 1, 2)")
    ap.add_argument("--check-only", action="store_true", help="only the gradient checks, nothing timed")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_step.json goes")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_step.py needs a CUDA GPU (and torch with CUDA); none here")
    details, wrong = [], []
    steps = step_table(args.quick, details, wrong, args.check_only, args.only)
    if args.check_only:   # (under compute-sanitizer, say)
        sys.exit(f"wrong gradients: {wrong}" if wrong else 0)
    gemms = gemm_table(args.quick)
    with open(os.path.join(args.out, "gpu_step.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "steps": steps, "gemm": gemms, "details": details}, f, indent=1)
    print(f"device: {torch.cuda.get_device_name()}")
    print("| model | batch | gradc ms | torch eager ms | torch graph ms | eager/gradc | graph/gradc | graphs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['model']} | {r['batch']} | {r['gradc']:.3f} | {r['torch eager']:.3f} | {r['torch graph']:.3f} | "
              f"{r['eager / gradc']} | {r['graph / gradc']} | {r['graph calls']['replayed']} replayed, "
              f"{r['graph calls']['direct']} direct |")
    print("| m,n,k | gradc tiled TFLOP/s | gradc 16x16 TFLOP/s | cuBLAS TFLOP/s | tiled/cuBLAS |")
    print("|---|---|---|---|---|")
    for r in gemms:
        print(f"| {r['m,n,k']} | {r['gradc tiled TFLOP/s']} | {r['gradc 16x16 TFLOP/s']} | {r['cuBLAS TFLOP/s']} | "
              f"{r['tiled / cuBLAS']} |")
    if wrong:
        sys.exit(f"not timed, wrong gradients: {wrong}")


if __name__ == "__main__":
    main()
