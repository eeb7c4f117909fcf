"""The synthetic task of the BPPSA paper (Wang, Bai, Pekhimenko, MLSys 2020; their `bernoulli<T>_10`
data): each sample is a stream of T bits, each 1 with probability 0.05 + 0.1 k, and its class is k
(10 classes). A vanilla tanh RNN (input 1, hidden 20, as in the paper) reads the stream through one
gc.scan and classifies its last state. The data is drawn here with numpy.

No classifier can be right every time: streams of neighbouring classes overlap. The best possible
rule (Bayes) picks the k whose probability makes the stream's count of ones likeliest; the script
prints its test accuracy beside the RNN's.

    python examples/bitstream_rnn.py                          # T = 100, the reverse-scan backward
    python examples/bitstream_rnn.py --scan-backward bppsa    # the same training, BPPSA's backward
    python examples/bitstream_rnn.py --quick

    gradc compile examples/bitstream_rnn.py -o build --scan-backward bppsa && gradc inspect build/bitstream_rnn
"""
import argparse
import os
import time

import numpy as np

import gradc as gc

H, CLASSES = 20, 10
P_ONE = 0.05 + 0.1 * np.arange(CLASSES)   # P(bit = 1) in class k

model = gc.Model("bitstream_rnn")
bits = model.input("bits", ("T", "B", 1))
label = model.input("label", ("B",), dtype="int64")
W, U, b = model.param("W", (H, H)), model.param("U", (1, H)), model.param("b", (H,))


def rnn_step(h, bit):
    return gc.tanh(h @ W + bit @ U + b), None


h0 = bits.sum(axis=0) @ np.zeros((1, H))   # a zero state with the batch's rows (T is symbolic: no bits[0])
h, _ = gc.scan(rnn_step, h0, bits)
logits = h @ model.param("V", (H, CLASSES)) + model.param("c", (CLASSES,))
model.output("logits", logits)
model.minimize(gc.softmax_cross_entropy(logits, label))


def make_data(n, T, rng):
    """n streams of T bits (time first, as the scan reads them) and their classes."""
    k = rng.integers(0, CLASSES, n)
    streams = (rng.random((T, n, 1)) < P_ONE[k][None, :, None]).astype(np.float32)
    return streams, k


def bayes_accuracy(streams, k):
    """The accuracy of the best possible rule: the class whose P(1) makes the count likeliest."""
    T = streams.shape[0]
    ones = streams.sum(axis=(0, 2))[:, None]
    loglik = ones * np.log(P_ONE) + (T - ones) * np.log1p(-P_ONE)
    return float(np.mean(loglik.argmax(axis=1) == k))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train a vanilla RNN on BPPSA's bitstream task with gradc.")
    ap.add_argument("--T", type=int, default=100, help="bits per stream")
    ap.add_argument("--train", type=int, default=4000, help="training streams")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="as in the paper")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--scan-backward", choices=["reverse", "bppsa"], default="reverse")
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--quick", action="store_true", help="T = 50, 1000 streams, 5 epochs")
    args = ap.parse_args(argv)
    T, n_train, epochs = (50, 1000, 5) if args.quick else (args.T, args.train, args.epochs)

    rng = np.random.default_rng(0)
    X_train, y_train = make_data(n_train, T, rng)
    X_test, y_test = make_data(2000, T, rng)
    t = time.perf_counter()
    rnn = gc.compile(model, out=args.out, order=1, scan_backward=args.scan_backward)
    print(f"compiled {rnn.__file__} ({args.scan_backward} backward) in {time.perf_counter() - t:.1f}s")
    trainer = rnn.Trainer(rnn.init_params(seed=0), optimizer="adam", lr=args.lr, clip_norm=1.0)
    t = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(n_train)
        losses = [trainer.step(bits=X_train[:, idx], label=y_train[idx])
                  for idx in np.array_split(order, max(1, n_train // args.batch))]
        print(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}")
    train_s = time.perf_counter() - t
    predicted = rnn.forward(trainer.params, bits=X_test)["logits"].argmax(axis=1)
    accuracy = float(np.mean(predicted == y_test))
    print(f"T = {T}: trained {epochs} epochs in {train_s:.1f}s; test accuracy {accuracy:.2%} on {len(y_test)} "
          f"streams (the best possible rule: {bayes_accuracy(X_test, y_test):.2%}; chance: {1 / CLASSES:.0%})")
    return accuracy, bayes_accuracy(X_test, y_test)


if __name__ == "__main__":
    main()
