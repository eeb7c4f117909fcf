"""VGG-16 (configuration D) on 224x224 RGB images, for its memory table (seed 004):

    gradc compile examples/vgg16.py -o build --bind B=1 --order 1 --warm none
    gradc inspect build/vgg16 --memory --layers

prints each layer's weight and output bytes beside the inference and training peaks from the
memory plan, without running the model (--warm none compiles no kernel).
"""
import gradc as gc

BLOCKS = [(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)]   # (conv layers, channels) before each max-pool

m = gc.Model("vgg16")
x = m.input("x", ("B", 3, 224, 224))
y = m.input("y", ("B",), dtype="int64")
h, channels = x, 3
for block, (layers, width) in enumerate(BLOCKS, 1):
    for layer in range(1, layers + 1):
        w = m.param(f"conv{block}_{layer}", (width, channels, 3, 3), init="he_normal")
        b = m.param(f"conv{block}_{layer}_b", (width,), init="zeros")
        h = gc.relu(gc.conv2d(h, w, bias=b, padding=1))
        channels = width
    h = gc.max_pool2d(h, 2)
h = h.reshape(("B", -1))
for i, (n_in, n_out) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)], 1):
    h = h @ m.param(f"fc{i}", (n_in, n_out), init="he_normal") + m.param(f"fc{i}_b", (n_out,), init="zeros")
    if i < 3:
        h = gc.relu(h)
m.output("logits", h)
m.minimize(gc.softmax_cross_entropy(h, y))
