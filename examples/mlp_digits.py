"""Train a tanh MLP on scikit-learn's bundled digits (1,797 8x8 images; nothing is downloaded).

    python examples/mlp_digits.py             # compile with gradc, train, print test accuracy
    python examples/mlp_digits.py --quick     # a few epochs (what the tests run)

The model below is also a model file for the command line:

    gradc compile examples/mlp_digits.py -o build && gradc inspect build/digits_mlp
"""
import argparse
import os
import sys
import time

import numpy as np

import gradc as gc

HIDDEN = 128

model = gc.Model("digits_mlp")
x = model.input("x", ("B", 64))
y = model.input("y", ("B",), dtype="int64")
h = gc.tanh(x @ model.param("W0", (64, HIDDEN)) + model.param("b0", (HIDDEN,)))
h = gc.tanh(h @ model.param("W1", (HIDDEN, HIDDEN)) + model.param("b1", (HIDDEN,)))
logits = h @ model.param("W2", (HIDDEN, 10)) + model.param("b2", (10,))
model.output("logits", logits)
model.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-4)


def load_data(seed=0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, digits.target.astype(np.int64), test_size=0.25,
                                                        random_state=seed, stratify=digits.target)
    mean, std = X_train.mean(0), X_train.std(0) + 1e-3
    return (X_train - mean) / std, (X_test - mean) / std, y_train, y_test


def main(argv=None):
    from tqdm import tqdm
    ap = argparse.ArgumentParser(description="Train an MLP on the digits data set with gradc.")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--quick", action="store_true", help="8 epochs")
    args = ap.parse_args(argv)
    epochs = 8 if args.quick else args.epochs

    X_train, X_test, y_train, y_test = load_data()
    t = time.perf_counter()
    mlp = gc.compile(model, out=args.out)
    print(f"compiled {mlp.__file__} in {time.perf_counter() - t:.1f}s")

    rng = np.random.default_rng(0)
    trainer = mlp.Trainer(mlp.init_params(seed=0), optimizer="sgd", lr=args.lr, momentum=0.9)
    t = time.perf_counter()
    for epoch in (bar := tqdm(range(epochs), desc="training", unit="epoch")):
        order = rng.permutation(len(X_train))
        losses = [trainer.step(x=X_train[idx], y=y_train[idx])
                  for idx in np.array_split(order, max(1, len(order) // args.batch))]
        bar.set_postfix(loss=f"{np.mean(losses):.4f}")
    train_s = time.perf_counter() - t
    predicted = mlp.forward(trainer.params, x=X_test)["logits"].argmax(axis=1)
    accuracy = float(np.mean(predicted == y_test))
    print(f"trained {epochs} epochs in {train_s:.1f}s; test accuracy {accuracy:.2%} on {len(y_test)} images")
    return accuracy


if __name__ == "__main__":
    sys.exit(0 if main() >= 0.95 else 1)
