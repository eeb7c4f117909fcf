"""Train a small LeNet-style conv net on scikit-learn's bundled digits (1,797 8x8 images; nothing is
downloaded).

    python examples/lenet_digits.py             # compile with gradc, train, print test accuracy
    python examples/lenet_digits.py --quick     # a few epochs (what the tests run)

The rows come in as (B, 64) and the model views them as (B, 1, 8, 8) images. The model below is also
a model file for the command line:

    gradc compile examples/lenet_digits.py -o build && gradc inspect build/digits_lenet
"""
import argparse
import os
import sys
import time

import numpy as np

import gradc as gc

model = gc.Model("digits_lenet")
x = model.input("x", ("B", 64))
y = model.input("y", ("B",), dtype="int64")
h = x.reshape(("B", 1, 8, 8))
h = gc.relu(gc.conv2d(h, model.param("c1", (16, 1, 3, 3), init="he_normal"), model.param("c1b", (16,)), padding=1))
h = gc.max_pool2d(h, 2)                                                                   # (B, 16, 4, 4)
h = gc.relu(gc.conv2d(h, model.param("c2", (32, 16, 3, 3), init="he_normal"), model.param("c2b", (32,)), padding=1))
h = gc.max_pool2d(h, 2)                                                                   # (B, 32, 2, 2)
h = gc.relu(h.reshape(("B", -1)) @ model.param("W3", (128, 64), init="he_normal") + model.param("b3", (64,)))
logits = h @ model.param("W4", (64, 10)) + model.param("b4", (10,))
model.output("logits", logits)
model.minimize(gc.softmax_cross_entropy(logits, y), weight_decay=1e-4)


def load_data(seed=0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(X, digits.target.astype(np.int64), test_size=0.25,
                                                        random_state=seed, stratify=digits.target)
    mean, std = X_train.mean(), X_train.std()        # one scale for every pixel: images stay images
    return (X_train - mean) / std, (X_test - mean) / std, y_train, y_test


def main(argv=None):
    from tqdm import tqdm
    ap = argparse.ArgumentParser(description="Train a small conv net on the digits data set with gradc.")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--out", default=os.path.join("build", "examples"))
    ap.add_argument("--quick", action="store_true", help="8 epochs")
    args = ap.parse_args(argv)
    epochs = 8 if args.quick else args.epochs

    X_train, X_test, y_train, y_test = load_data()
    t = time.perf_counter()
    net = gc.compile(model, out=args.out)
    print(f"compiled {net.__file__} in {time.perf_counter() - t:.1f}s")

    rng = np.random.default_rng(0)
    trainer = net.Trainer(net.init_params(seed=0), optimizer="sgd", lr=args.lr, momentum=0.9)
    t = time.perf_counter()
    for epoch in (bar := tqdm(range(epochs), desc="training", unit="epoch")):
        order = rng.permutation(len(X_train))
        losses = [trainer.step(x=X_train[idx], y=y_train[idx])
                  for idx in np.array_split(order, max(1, len(order) // args.batch))]
        bar.set_postfix(loss=f"{np.mean(losses):.4f}")
    train_s = time.perf_counter() - t
    predicted = net.forward(trainer.params, x=X_test)["logits"].argmax(axis=1)
    accuracy = float(np.mean(predicted == y_test))
    print(f"trained {epochs} epochs in {train_s:.1f}s; test accuracy {accuracy:.2%} on {len(y_test)} images")
    return accuracy


if __name__ == "__main__":
    sys.exit(0 if main() >= 0.97 else 1)
