"""The BPPSA paper's RNN setup (Wang, Bai, Pekhimenko, MLSys 2020), on the CPU: a vanilla tanh RNN,
input 1, hidden 20, batch 16, T = 100 ... 30,000, classifying the last hidden state. One training
step's forward + backward (loss and the gradients of every weight), side by side in one run:

    gradc reverse   gc.scan compiled once (gradc compile --scan-backward reverse, the default)
    reverse budget  the same under --memory-budget at a quarter of its store-all peak (T bound, one
                    build per T): carry checkpoints every ceil(sqrt(T)) steps, each segment recomputed
                    before its backward steps (the memory table after the times says what it keeps)
    gradc bppsa     the same model built with --scan-backward bppsa (Blelloch scan of the Jacobians):
                    the products of each sweep level on Numba's threads (every core)
    bppsa 1 thread  the same, with Numba held to one thread (what the threads buy)
    torch nn.RNN    torch.nn.RNN + Linear, loss.backward()
    torch loop      a Python loop of the cell under autograd

Each framework in its own worker process, rounds interleaved, medians (bench/harness.py); float32.
One gradc build serves every T (T and B stay symbolic).

    python bench/rnn.py                 # T = 100, 1000, 10000, 30000
    python bench/rnn.py --quick         # T = 100, 1000
    python bench/rnn.py --target cuda   # on a GPU: gradc --target cuda, reverse and bppsa, against
                                        # torch nn.RNN on cuDNN (inputs on the device, each call synchronized)
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import interleaved  # noqa: E402

H, I, B, CLASSES = 20, 1, 16, 2


def data(T, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2, size=(T, B, I)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=B).astype(np.int64)
    return x, y


def rnn_model(name="rnn_bench"):
    import gradc as gc
    m = gc.Model(name)
    x = m.input("x", ("T", "B", I))
    y = m.input("y", ("B",), dtype="int64")
    h0 = m.input("h0", ("B", H))
    W = m.param("W", (H, H))
    U = m.param("U", (I, H))
    b = m.param("b", (H,))
    V = m.param("V", (H, CLASSES))
    c = m.param("c", (CLASSES,))

    def step(h, xt):
        return gc.tanh(h @ W + xt @ U + b), None

    h, _ = gc.scan(step, h0, x)
    m.minimize(gc.softmax_cross_entropy(h @ V + c, y))
    return m


def build_gradc(Ts, scan_backward, numba_threads=None):
    import numba

    import gradc as gc
    if numba_threads:
        numba.set_num_threads(numba_threads)
    m = rnn_model(f"rnn_{scan_backward}")
    out = tempfile.mkdtemp(prefix="gradc_rnn_")
    t = time.perf_counter()
    options = {} if scan_backward == "reverse" else {"scan_backward": scan_backward}
    mod = gc.compile(m, out=out, order=1, warm=False, **options)
    params = mod.init_params(0)
    h0 = np.zeros((B, H), np.float32)
    tasks = {}
    for T in Ts:
        x, y = data(T)
        tasks[f"T={T}"] = lambda x=x, y=y: mod.loss_and_grad(params, x=x, y=y, h0=h0)
    for fn in tasks.values():
        fn()
    return tasks, {"build_s": round(time.perf_counter() - t, 2), "module_bytes": os.path.getsize(os.path.join(out, m.name + ".py")),
                   "numba_threads": numba.get_num_threads()}


def build_gradc_budgeted(Ts, share=0.25):
    """One build per T under --memory-budget at `share` of loss_and_grad's store-all peak."""
    import json

    import gradc as gc
    from gradc.passes.memory import plan_memory
    from gradc.passes.pipeline import build_training_graph
    tasks, memory, t = {}, {}, time.perf_counter()
    h0 = np.zeros((B, H), np.float32)
    for T in Ts:
        dims = {"T": T, "B": B}
        peak = plan_memory(build_training_graph(rnn_model(), "float32", dims, order=1), dims, 1)["_loss_and_grad"]["peak_bytes"]
        m = rnn_model(f"rnn_budget_{T}")
        out = tempfile.mkdtemp(prefix="gradc_rnn_")
        mod = gc.compile(m, out=out, order=1, warm=False, bind=dims, memory_budget=str(int(share * peak)))
        with open(os.path.join(out, m.name + ".memplan.json")) as f:
            plan = json.load(f)
        (ck,) = plan["scan_checkpoints"]
        memory[T] = {"store_all": plan["store_all_peak_bytes"], "peak": plan["peak_bytes"],
                     "workspace": plan["workspace_bytes"], "every": ck["every"]}
        params = mod.init_params(0)
        x, y = data(T)
        tasks[f"T={T}"] = lambda mod=mod, params=params, x=x, y=y: mod.loss_and_grad(params, x=x, y=y, h0=h0)
    for fn in tasks.values():
        fn()
    return tasks, {"build_s": round(time.perf_counter() - t, 2), "memory": memory}


def build_gradc_cuda(Ts, scan_backward):
    """The --target cuda build: inputs on the device once, params from the host each call (small)."""
    from numba import cuda

    import gradc as gc
    m = rnn_model(f"rnn_cuda_{scan_backward}")
    t = time.perf_counter()
    mod = gc.compile(m, out=tempfile.mkdtemp(prefix="gradc_rnn_"), order=1, target="cuda", warm=False,
                     scan_backward=scan_backward)
    params = mod.init_params(0)
    h0 = cuda.to_device(np.zeros((B, H), np.float32))
    tasks = {}
    for T in Ts:
        x, y = (cuda.to_device(a) for a in data(T))

        def run(x=x, y=y):
            mod.loss_and_grad(params, x=x, y=y, h0=h0)
            cuda.synchronize()
        tasks[f"T={T}"] = run
    for fn in tasks.values():
        fn()
    device = getattr(cuda.get_current_device(), "name", "the simulator")
    return tasks, {"build_s": round(time.perf_counter() - t, 2),
                   "device": device.decode() if isinstance(device, bytes) else str(device)}


def build_torch_rnn(Ts, threads=1, device="cpu"):
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise ImportError("this torch has no CUDA device")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rnn, head = torch.nn.RNN(I, H, nonlinearity="tanh").to(device), torch.nn.Linear(H, CLASSES).to(device)
    params = list(rnn.parameters()) + list(head.parameters())
    tasks = {}
    for T in Ts:
        x, y = (torch.from_numpy(a).to(device) for a in data(T))

        def run(x=x, y=y):
            for p in params:
                p.grad = None
            out, h = rnn(x)
            torch.nn.functional.cross_entropy(head(h[0]), y).backward()
            if device == "cuda":
                torch.cuda.synchronize()
        tasks[f"T={T}"] = run
    return tasks, {"threads": torch.get_num_threads(), "cudnn": device == "cuda" and torch.backends.cudnn.is_available()}


def build_torch_loop(Ts, threads=1):
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    W, U = torch.randn(H, H) * 0.3, torch.randn(I, H)
    b, V, c = torch.zeros(H), torch.randn(H, CLASSES) * 0.3, torch.zeros(CLASSES)
    params = [p.requires_grad_() for p in (W, U, b, V, c)]
    tasks = {}
    for T in Ts:
        x, y = (torch.from_numpy(a) for a in data(T))

        def run(x=x, y=y):
            h = torch.zeros(B, H)
            for t in range(x.shape[0]):
                h = torch.tanh(h @ W + x[t] @ U + b)
            loss = torch.nn.functional.cross_entropy(h @ V + c, y)
            torch.autograd.grad(loss, params)
        tasks[f"T={T}"] = run
    return tasks, {}


def flops(T):
    """FLOPs of one step's backward (loss_and_grad's backward through the scan): the reverse scan's,
    and BPPSA's as the generated loop does them (gradc.ops.bppsa.bppsa_flops): this RNN's Jacobians
    take the structured form f'(h_t) * W^T; `dense` is what a step that does not match would cost."""
    from gradc.ops.bppsa import bppsa_flops
    step = B * (2 * H * H + 2 * H * H + 2 * I * H + 4 * H)     # dh W^T, h^T dh, x^T dh, tanh'
    return T * step, bppsa_flops(T, B, H, step, dense=False), bppsa_flops(T, B, H, step, dense=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--T", type=int, nargs="*")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads (default 1: gradc runs on one core; on a shared 2-core "
                             "machine torch's second thread spin-waits and made nn.RNN 4x slower)")
    parser.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    Ts = args.T or ([100, 1000] if args.quick else [100, 1000, 10000, 30000])
    if args.target == "cuda":
        return gpu_table(Ts, 3 if args.quick else 5)
    builders = {"gradc reverse": (build_gradc, (Ts, "reverse")),
                "reverse budget": (build_gradc_budgeted, (Ts,)),
                "torch nn.RNN": (build_torch_rnn, (Ts, args.torch_threads)),
                "torch loop": (build_torch_loop, (Ts, args.torch_threads))}
    try:
        from gradc.compiler import SCAN_BACKWARD
        if "bppsa" in SCAN_BACKWARD:
            builders = {"gradc reverse": builders["gradc reverse"], "reverse budget": builders["reverse budget"],
                        "gradc bppsa": (build_gradc, (Ts, "bppsa")),
                        "bppsa 1 thread": (build_gradc, (Ts, "bppsa", 1)),
                        **{k: v for k, v in builders.items() if k != "gradc reverse"}}
    except ImportError:
        pass
    calls = {f"T={T}": max(1, 2000 // T) for T in Ts}
    rounds = 3 if args.quick else 5
    times, infos = interleaved(builders, rounds, calls, warmup=1)
    print(f"# vanilla tanh RNN, input {I}, hidden {H}, batch {B}; forward + backward of one step, float32, "
          f"median of {rounds} rounds; ms")
    print("# builds:", infos)
    names = list(times)
    bp = "gradc bppsa" in times
    print(f"{'T':>7} " + " ".join(f"{n:>15}" for n in names) + "   gradc/nn.RNN" + ("  bppsa/reverse" if bp else ""))
    for T in Ts:
        row = [times[n][f"T={T}"] * 1e3 for n in names]
        ratio = times["gradc reverse"][f"T={T}"] / times["torch nn.RNN"][f"T={T}"] if "torch nn.RNN" in times else float("nan")
        extra = f"  {times['gradc bppsa'][f'T={T}'] / times['gradc reverse'][f'T={T}']:>13.3f}" if bp else ""
        print(f"{T:>7} " + " ".join(f"{v:>15.3f}" for v in row) + f"   {ratio:>11.3f}" + extra)
    memory = infos["reverse budget"]["memory"]
    print("# loss_and_grad's planned peak (arena, plus the workspace of the recomputed segment), bytes:")
    for T in Ts:
        mm = memory[T]
        print(f"{T:>7} store-all {mm['store_all']:>11,}  under the budget {mm['peak'] + mm['workspace']:>9,} "
              f"({(mm['peak'] + mm['workspace']) / mm['store_all']:.3f}x; checkpoints every {mm['every']} steps)")
    print("# backward FLOPs, reverse scan vs BPPSA as built (structured Jacobians f'(h_t) W^T here; dense: a step that")
    print("# does not match, H VJPs per step). BPPSA does more work in ~2 log2 T sequential levels instead of T steps")
    for T in Ts:
        r, p, d = flops(T)
        print(f"{T:>7} reverse {r:.3e}  bppsa {p:.3e} ({p / r:.1f}x)  bppsa dense {d:.3e} ({d / r:.1f}x)")


def gpu_table(Ts, rounds):
    """gradc --target cuda (reverse, and BPPSA's sweeps as kernels) against torch nn.RNN on cuDNN."""
    builders = {"cuda reverse": (build_gradc_cuda, (Ts, "reverse")), "cuda bppsa": (build_gradc_cuda, (Ts, "bppsa")),
                "torch cuDNN": (build_torch_rnn, (Ts, 1, "cuda"))}
    times, infos = interleaved(builders, rounds, {f"T={T}": max(1, 2000 // T) for T in Ts}, warmup=1)
    print(f"# vanilla tanh RNN on the GPU, input {I}, hidden {H}, batch {B}; forward + backward of one step, "
          f"float32, median of {rounds} rounds; ms")
    print("# builds:", infos)
    names = list(times)
    print(f"{'T':>7} " + " ".join(f"{n:>14}" for n in names) + ("   bppsa/cuDNN  bppsa/reverse" if len(names) == 3 else ""))
    for T in Ts:
        row = [times[n][f"T={T}"] * 1e3 for n in names]
        ratios = ""
        if len(names) == 3:
            bp = times["cuda bppsa"][f"T={T}"]
            ratios = f"   {bp / times['torch cuDNN'][f'T={T}']:>11.3f}  {bp / times['cuda reverse'][f'T={T}']:>13.3f}"
        print(f"{T:>7} " + " ".join(f"{v:>14.3f}" for v in row) + ratios)


if __name__ == "__main__":
    main()
