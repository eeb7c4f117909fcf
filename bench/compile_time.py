"""Compile time: `gradc compile` vs JAX's trace + XLA compile of the same train step, in one run.

The train step is the loss and gradient of a tanh MLP (softmax cross-entropy, `layers` layers of
`width`) and an SGD update. gradc compiles with its defaults (float32, --order 2, the first-order
entry points warmed) into a fresh folder; JAX times `jax.jit(step).lower(...).compile()`. Every
measurement runs in a fresh subprocess (Numba's and JAX's in-process caches would lie) and times
the compile call only, after the imports, with Python's .pyc files written as usual (one untimed
compile of a tiny model first); the kernel cache is pointed at a temp folder
(GRADC_CACHE_DIR), empty unless the case says what warmed it. gradc's own compiled runtime
(matmul_into, copy_into, view, ...) is not a model's: Numba caches it beside the installed package,
once per install and machine, as JAX's XLA ships compiled, so the cases load it (the first run
after an install compiles it once too). Cases:

  (a) 30-layer width-256 MLP, empty kernel cache             goal: at most 5x JAX
  (b) the same, the cache warm from a 20-layer width-256 MLP  goal: at most 2x JAX
  (c) 100-layer width-64 MLP, --order 2, empty kernel cache   goal: under 20 s
      and its first `hvp` call, in a fresh process that imports the build   goal: under 10 s
      (JAX: jit of the HVP, forward-over-reverse)
  (d) an LSTM read over T steps (input 32, hidden 128, gc.scan; JAX: lax.scan), its last state
      classified, empty kernel cache                            goal: at most 5x JAX

    python bench/compile_time.py            # medians of 3 fresh runs per cell
    python bench/compile_time.py --quick    # one run per cell
    python bench/compile_time.py --cases d  # only the LSTM
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BATCH = 64
LR = 0.05


# ---- workers: each runs in a subprocess of its own -----------------------------------------------
def mlp(name, layers, width):
    import gradc as gc
    m = gc.Model(name)
    x = m.input("x", ("B", width))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i in range(layers):
        h = gc.tanh(h @ m.param(f"W{i}", (width, width)) + m.param(f"b{i}", (width,)))
    m.minimize(gc.softmax_cross_entropy(h, y))
    return m


LSTM_D, LSTM_H, LSTM_C, LSTM_T = 32, 128, 10, 50


def lstm(name):
    import gradc as gc
    m = gc.Model(name)
    x = m.input("x", ("T", "B", LSTM_D))
    y = m.input("y", ("B",), dtype="int64")
    h0 = m.input("h0", ("B", LSTM_H))
    Wx, Wh = m.param("Wx", (LSTM_D, 4 * LSTM_H)), m.param("Wh", (LSTM_H, 4 * LSTM_H))
    b, V = m.param("b", (4 * LSTM_H,)), m.param("V", (LSTM_H, LSTM_C))

    def step(carry, x_t):
        h, c = carry
        z = x_t @ Wx + h @ Wh + b
        i, f, o = (gc.sigmoid(z[:, k * LSTM_H:(k + 1) * LSTM_H]) for k in range(3))
        c = f * c + i * gc.tanh(z[:, 3 * LSTM_H:])
        return (o * gc.tanh(c), c), None

    (h, _), _ = gc.scan(step, (h0, h0), x)
    m.minimize(gc.softmax_cross_entropy(h @ V, y))
    return m


def worker_gradc(name, layers, width, out):
    import gradc as gc
    model = lstm(name) if layers == "lstm" else mlp(name, layers, width)
    timings = {}
    t = time.perf_counter()
    gc.compile(model, out=out, timings=timings)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "passes": timings.get("passes_total"), "warm": timings.get("numba_warm"),
            "compiled": timings.get("kernels_compiled"), "from_cache": timings.get("kernels_from_cache")}


def worker_hvp(name, out):
    import numpy as np
    sys.path.insert(0, out)
    mod = __import__(name)
    params = mod.init_params(0)
    (_, width), _ = mod.INPUTS["x"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, width)).astype(np.float32)
    y = rng.integers(0, width, BATCH)
    v = {k: np.ones_like(params[k]) for k in mod.TRAINABLE}
    t = time.perf_counter()
    mod.hvp(params, v, x=x, y=y)
    return {"seconds": time.perf_counter() - t}


def worker_jax(layers, width, what):
    import jax
    import jax.numpy as jnp
    import numpy as np

    def mlp_loss(p, x, y):
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ p[f"W{i}"] + p[f"b{i}"])
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def lstm_loss(p, x, y):
        def step(carry, x_t):
            h, c = carry
            z = x_t @ p["Wx"] + h @ p["Wh"] + p["b"]
            i, f, o = (jax.nn.sigmoid(z[:, k * LSTM_H:(k + 1) * LSTM_H]) for k in range(3))
            c = f * c + i * jnp.tanh(z[:, 3 * LSTM_H:])
            return (o * jnp.tanh(c), c), None

        h0 = jnp.zeros((x.shape[1], LSTM_H), x.dtype)
        (h, _), _ = jax.lax.scan(step, (h0, h0), x)
        logp = jax.nn.log_softmax(h @ p["V"])
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    loss_fn = lstm_loss if layers == "lstm" else mlp_loss

    def step(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree.map(lambda a, b: a - LR * b, p, g), loss

    def hvp(p, v, x, y):
        return jax.jvp(lambda q: jax.grad(loss_fn)(q, x, y), (p,), (v,))[1]

    rng = np.random.default_rng(0)
    if layers == "lstm":
        shapes = {"Wx": (LSTM_D, 4 * LSTM_H), "Wh": (LSTM_H, 4 * LSTM_H), "b": (4 * LSTM_H,), "V": (LSTM_H, LSTM_C)}
        p = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
        x = rng.standard_normal((LSTM_T, BATCH, LSTM_D)).astype(np.float32)
        y = rng.integers(0, LSTM_C, BATCH).astype(np.int32)
    else:
        p = {}
        for i in range(layers):
            p[f"W{i}"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            p[f"b{i}"] = np.zeros(width, np.float32)
        x = rng.standard_normal((BATCH, width)).astype(np.float32)
        y = rng.integers(0, width, BATCH).astype(np.int32)
    t = time.perf_counter()
    if what == "step":
        jax.jit(step).lower(p, x, y).compile()
    else:
        jax.jit(hvp).lower(p, p, x, y).compile()
    return {"seconds": time.perf_counter() - t}


# ---- the driver ----------------------------------------------------------------------------------
def run_worker(args, cache=None):
    # Python writes .pyc files as it does for a user (a sandbox may set PYTHONDONTWRITEBYTECODE, and
    # then every module gradc and Numba import lazily is compiled from source inside the timed call)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if cache is not None:
        env["GRADC_CACHE_DIR"] = cache
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(args)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - t
    return result


def gradc_case(layers, width, warm_from=None, hvp=False):
    """One fresh kernel cache and build folder: (compile result, hvp result or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        if warm_from is not None:
            run_worker(["gradc", f"warm_{warm_from[0]}x{warm_from[1]}", *warm_from, os.path.join(tmp, "w")], cache)
        name = "lstm" if layers == "lstm" else f"mlp_{layers}x{width}"
        out = os.path.join(tmp, "out")
        result = run_worker(["gradc", name, layers, width, out], cache)
        return result, (run_worker(["hvp", name, out], cache) if hvp else None)


def median(results, key="seconds"):
    return statistics.median(r[key] for r in results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run per cell instead of the median of 3")
    ap.add_argument("--cases", default="abcd", help="the cases to run, e.g. 'ad' (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = json.loads(args.worker)
        fn = {"gradc": worker_gradc, "hvp": worker_hvp, "jax": worker_jax}[w[0]]
        print(json.dumps(fn(*w[1:])))
        return 0
    import jax
    import numba

    from gradc.version import __version__
    repeats = 1 if args.quick else 3
    print(f"# compile_time: {os.cpu_count()} cores, gradc {__version__}, numba {numba.__version__}, "
          f"jax {jax.__version__}, float32, batch {BATCH} (JAX), {repeats} fresh run(s) per cell, median")
    rows, notes = [], []

    def jax_seconds(layers, width, what="step"):
        return median([run_worker(["jax", layers, width, what]) for _ in range(repeats)])

    gradc_case(2, 8)   # untimed: the .pyc files of gradc's and Numba's lazily imported modules
    if "a" in args.cases or "b" in args.cases:
        j30 = jax_seconds(30, 256)
    if "a" in args.cases:
        cold = [gradc_case(30, 256)[0] for _ in range(repeats)]
        rows.append(("(a) 30x256 MLP, empty kernel cache", median(cold), j30, "<= 5x JAX", median(cold) <= 5 * j30))
        notes.append(("(a)", cold))
    if "b" in args.cases:
        warm = [gradc_case(30, 256, warm_from=(20, 256))[0] for _ in range(repeats)]
        rows.append(("(b) 30x256 MLP, cache warm from a 20x256 MLP", median(warm), j30, "<= 2x JAX",
                     median(warm) <= 2 * j30))
        notes.append(("(b)", warm))
    if "c" in args.cases:
        deep = [gradc_case(100, 64, hvp=True) for _ in range(repeats)]
        compiles, hvps = [d[0] for d in deep], [d[1] for d in deep]
        j100, j100h = jax_seconds(100, 64), jax_seconds(100, 64, "hvp")
        rows.append(("(c) 100x64 MLP --order 2, empty kernel cache", median(compiles), j100, "< 20 s",
                     median(compiles) < 20))
        rows.append(("(c) first hvp call (fresh process; JAX: jit of hvp)", median(hvps), j100h, "< 10 s", median(hvps) < 10))
        notes.append(("(c)", compiles))
    if "d" in args.cases:
        lstms = [gradc_case("lstm", 0)[0] for _ in range(repeats)]
        jl = jax_seconds("lstm", 0)
        rows.append((f"(d) LSTM {LSTM_D}->{LSTM_H}, T={LSTM_T} (JAX), empty kernel cache", median(lstms), jl, "<= 5x JAX",
                     median(lstms) <= 5 * jl))
        notes.append(("(d)", lstms))

    print("\n| case | gradc s | JAX s | ratio | goal | met |")
    print("|---|---|---|---|---|---|")
    for case, g, j, goal, met in rows:
        print(f"| {case} | {g:.2f} | {j:.2f} | {g / j:.1f}x | {goal} | {'yes' if met else 'no'} |")
    print()
    for label, results in notes:
        r = min(results, key=lambda r: abs(r["seconds"] - median(results)))
        print(f"# {label} median run: passes {r['passes']:.2f} s, Numba warm-up {r['warm']:.2f} s, "
              f"kernel signatures compiled {r['compiled']}, loaded from the cache {r['from_cache']}; "
              f"the whole subprocess (imports included) {r['process']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
