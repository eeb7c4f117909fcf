"""A GRU reads each 8x8 digit of scikit-learn's bundled digits as a sequence of 8 rows of 8 pixels
(nothing is downloaded). The recurrence is one gc.scan: its step is traced once and compiled as
one loop, whatever the sequence length.

    python examples/rnn_digits.py             # compile, train, print test accuracy
    python examples/rnn_digits.py --quick     # a few epochs

    gradc compile examples/rnn_digits.py -o build && gradc inspect build/digits_gru
"""
import argparse
import os
import sys
import time

import numpy as np

import gradc as gc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_digits import load_data  # noqa: E402

H = 64

model = gc.Model("digits_gru")
x = model.input("x", ("B", 64))
y = model.input("y", ("B",), dtype="int64")
rows = gc.transpose(x.reshape(("B", 8, 8)), (1, 0, 2))     # (8, B, 8): time is the image's rows
Wz, Uz, bz = model.param("Wz", (H, H)), model.param("Uz", (8, H)), model.param("bz", (H,))
Wr, Ur, br = model.param("Wr", (H, H)), model.param("Ur", (8, H)), model.param("br", (H,))
Wh, Uh, bh = model.param("Wh", (H, H)), model.param("Uh", (8, H)), model.param("bh", (H,))


def gru_step(h, row):
    z = gc.sigmoid(h @ Wz + row @ Uz + bz)
    r = gc.sigmoid(h @ Wr + row @ Ur + br)
    cand = gc.tanh((r * h) @ Wh + row @ Uh + bh)
    return (1 - z) * h + z * cand, None


h0 = rows[0] @ np.zeros((8, H))                              # a zero state with the batch's rows
h, _ = gc.scan(gru_step, h0, rows)
logits = h @ model.param("V", (H, 10)) + model.param("c", (10,))
model.output("logits", logits)
model.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-5)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train a GRU on the digits data set (rows as a sequence) with gradc.")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--quick", action="store_true", help="5 epochs")
    args = ap.parse_args(argv)
    epochs = 5 if args.quick else args.epochs

    X_train, X_test, y_train, y_test = load_data()
    t = time.perf_counter()
    gru = gc.compile(model, out=args.out, order=1)
    print(f"compiled {gru.__file__} in {time.perf_counter() - t:.1f}s")
    rng = np.random.default_rng(0)
    trainer = gru.Trainer(gru.init_params(seed=0), optimizer="adam", lr=args.lr)
    t = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(len(X_train))
        losses = [trainer.step(x=X_train[idx], y=y_train[idx])
                  for idx in np.array_split(order, max(1, len(order) // args.batch))]
        print(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}")
    train_s = time.perf_counter() - t
    predicted = gru.forward(trainer.params, x=X_test)["logits"].argmax(axis=1)
    accuracy = float(np.mean(predicted == y_test))
    print(f"trained {epochs} epochs in {train_s:.1f}s; test accuracy {accuracy:.2%} on {len(y_test)} images")
    return accuracy


if __name__ == "__main__":
    main()
