"""lr_grad's variance and cost (DESIGN.md §1.9): per model, the estimate's relative error and cosine to
loss_and_grad's gradient against the samples K (antithetic pairs or not, layer-wise or not), and the
time of one estimate against one loss_and_grad (medians, after a warm-up call). float64 builds, one
batch, the mean over seeds of each single estimate's error (not the error of a mean).

    python bench/lr.py [--quick] [--models "mlp B=64,bn conv B=32"]
"""
import argparse
import sys
import tempfile
import time

import numpy as np

import gradc as gc


def mlp(B):
    m = gc.Model("lr_bench_mlp")
    x = m.input("x", ("B", 64))
    y = m.input("y", ("B",), dtype="int64")
    h = x
    for i, (a, b) in enumerate([(64, 128), (128, 128), (128, 10)]):
        h = h @ m.param(f"W{i}", (a, b)) + m.param(f"b{i}", (b,), init="zeros")
        if i < 2:
            h = gc.tanh(h)
    m.minimize(gc.softmax_cross_entropy(h, y), weight_decay=1e-4)
    rng = np.random.default_rng(0)
    return m, {"x": rng.normal(size=(B, 64)), "y": rng.integers(0, 10, B)}


def convnet(B):
    m = gc.Model("lr_bench_conv")
    x = m.input("x", ("B", 1, 8, 8))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.relu(gc.conv2d(x, m.param("c1", (8, 1, 3, 3), init="he_normal"), padding=1)
                + m.param("cb1", (1, 8, 1, 1), init="zeros"))
    h = gc.max_pool2d(h, 2).reshape(("B", -1))
    h = h @ m.param("W", (128, 10)) + m.param("b", (10,), init="zeros")
    m.minimize(gc.softmax_cross_entropy(h, y))
    rng = np.random.default_rng(0)
    return m, {"x": rng.normal(size=(B, 1, 8, 8)), "y": rng.integers(0, 10, B)}


def bn_convnet(B):
    """convnet with batch norm (training mode) after the conv: a batch statistic per perturbed copy, so the
    conv's noise pairs with its copy's whole loss."""
    m = gc.Model("lr_bench_bnconv")
    x = m.input("x", ("B", 1, 8, 8))
    y = m.input("y", ("B",), dtype="int64")
    h = gc.conv2d(x, m.param("c1", (8, 1, 3, 3), init="he_normal"), padding=1)
    mu = h.mean(axis=(0, 2, 3), keepdims=True)
    var = gc.square(h - mu).mean(axis=(0, 2, 3), keepdims=True)
    h = (h - mu) / gc.sqrt(var + 1e-5) * m.param("g", (1, 8, 1, 1), init="ones") + m.param("cb1", (1, 8, 1, 1),
                                                                                          init="zeros")
    h = gc.max_pool2d(gc.relu(h), 2).reshape(("B", -1))
    m.minimize(gc.softmax_cross_entropy(h @ m.param("W", (128, 10)) + m.param("b", (10,), init="zeros"), y))
    rng = np.random.default_rng(0)
    return m, {"x": rng.normal(size=(B, 1, 8, 8)), "y": rng.integers(0, 10, B)}


def gcn(N):
    import networkx as nx
    G = nx.karate_club_graph()
    A = nx.to_numpy_array(G) + np.eye(34)
    d = 1 / np.sqrt(A.sum(1))
    A = d[:, None] * A * d[None, :]
    m = gc.Model("lr_bench_gcn")
    x = m.input("x", (34, 34))
    y = m.input("y", (34,), dtype="int64")
    h = gc.relu(A @ x @ m.param("W0", (34, 16)))
    m.minimize(gc.softmax_cross_entropy(A @ h @ m.param("W1", (16, 2)), y), weight_decay=5e-4)
    labels = np.array([G.nodes[i]["club"] == "Officer" for i in range(34)], dtype=np.int64)
    return m, {"x": np.eye(34), "y": labels}


def rnn(B, T=16):
    """An Elman RNN as a gc.scan: one noise site per step (x_t @ U + h @ W + b), T steps."""
    m = gc.Model("lr_bench_rnn")
    x = m.input("x", ("T", "B", 8))
    y = m.input("y", ("B",), dtype="int64")
    U, W, b = m.param("U", (8, 32)), m.param("W", (32, 32)), m.param("b", (32,), init="zeros")
    h, _ = gc.scan(lambda h, xt: (gc.tanh(xt @ U + h @ W + b), None), m.input("h0", ("B", 32)), x)
    m.minimize(gc.softmax_cross_entropy(h @ m.param("V", (32, 10)), y))
    rng = np.random.default_rng(0)
    return m, {"x": rng.normal(size=(T, B, 8)), "y": rng.integers(0, 10, B), "h0": np.zeros((B, 32))}


def language_model(B, T=8, V=16):
    """A trained embedding looked up before the scan (noise on its rows, axis 1 of (T, B, D)) and the
    next token's cross-entropy made in the step."""
    m = gc.Model("lr_bench_lm")
    tok, tgt = m.input("tok", ("T", "B"), dtype="int64"), m.input("tgt", ("T", "B"), dtype="int64")
    E, W, O = m.param("E", (V, 16), init="normal"), m.param("W", (16, 16)), m.param("O", (16, V))

    def step(h, xs):
        h = gc.tanh(xs[0] + h @ W)
        return h, gc.softmax_cross_entropy(h @ O, xs[1])

    _, losses = gc.scan(step, m.input("h0", ("B", 16)), (gc.take(E, tok), tgt))
    m.minimize(losses.mean())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (T + 1, B))
    return m, {"tok": tokens[:-1], "tgt": tokens[1:], "h0": np.zeros((B, 16))}


def contrastive(B):
    """CLIP's symmetric loss over the batch (za @ zb.T, a learned temperature): the product mixes the rows, so
    it runs once per perturbed copy and the towers' noise pairs with its copy's whole loss."""
    m = gc.Model("lr_bench_clip")
    xa, xb = m.input("xa", ("B", 32)), m.input("xb", ("B", 16))
    y = m.input("y", ("B",), dtype="int64")
    za = gc.tanh(xa @ m.param("Wa", (32, 24)))
    zb = gc.tanh(xb @ m.param("Wb", (16, 24)))
    logits = za @ zb.T * gc.exp(m.param("t", (), init="zeros"))
    m.minimize(0.5 * (gc.softmax_cross_entropy(logits, y) + gc.softmax_cross_entropy(logits.T, y)))
    rng = np.random.default_rng(0)
    return m, {"xa": rng.normal(size=(B, 32)), "xb": rng.normal(size=(B, 16)), "y": np.arange(B)}


MODELS = {"mlp B=64": (mlp, 64), "conv B=32": (convnet, 32), "bn conv B=32": (bn_convnet, 32),
          "gcn karate": (gcn, 34), "rnn scan T=16 B=32": (rnn, 32), "lm embedding T=8 B=32": (language_model, 32),
          "clip B=32": (contrastive, 32)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names of MODELS")
    args = ap.parse_args()
    unknown = [name for name in args.models.split(",") if name not in MODELS]
    if unknown:
        ap.error(f"--models: no model {unknown[0]!r} (the models: {', '.join(MODELS)})")
    Ks = (8, 32, 128) if args.quick else (8, 32, 128, 512)
    seeds = 4 if args.quick else 8
    modes = {"antithetic": dict(antithetic=True), "plain+baseline": dict(antithetic=False),
             "antithetic layer-wise": dict(antithetic=True, layerwise=True)}
    out = tempfile.mkdtemp(prefix="gradc-lr-bench-")
    print(f"{'model':<22} {'mode':<22} {'K':>5} {'rel.err':>8} {'cosine':>7} {'ms/est':>8} {'ms/l&g':>7} {'ratio':>6}")
    for label in args.models.split(","):
        make, B = MODELS[label]
        m, inputs = make(B)
        mod = gc.compile(m, out=out, dtype="float64", order=1, warm_cache=False)
        params = mod.init_params(0)
        _, true = mod.loss_and_grad(params, **inputs)
        t = np.concatenate([true[p].ravel() for p in mod.TRAINABLE])
        times = []
        for _ in range(21):   # the first call warms up
            start = time.perf_counter()
            mod.loss_and_grad(params, **inputs)
            times.append(time.perf_counter() - start)
        t_bp = float(np.median(times[1:]))
        for mode, opts in modes.items():
            for K in Ks:
                mod.lr_grad(params, samples=K, seed=0, **opts, **inputs)   # compile / lay out the arena
                errs, coss, times = [], [], []
                for s in range(seeds):
                    start = time.perf_counter()
                    _, est = mod.lr_grad(params, samples=K, sigma=1e-2, seed=s + 1, **opts, **inputs)
                    times.append(time.perf_counter() - start)
                    e = np.concatenate([est[p].ravel() for p in mod.TRAINABLE])
                    errs.append(np.linalg.norm(e - t) / np.linalg.norm(t))
                    coss.append(e @ t / (np.linalg.norm(e) * np.linalg.norm(t)))
                t_lr = float(np.median(times))
                print(f"{label:<22} {mode:<22} {K:>5} {np.mean(errs):>8.3f} {np.mean(coss):>7.3f} "
                      f"{1e3 * t_lr:>8.2f} {1e3 * t_bp:>7.3f} {t_lr / t_bp:>6.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
