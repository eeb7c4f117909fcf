"""A conv net's `--target cuda` module under numba-cuda's simulator (tests/test_conv.py).

    NUMBA_ENABLE_CUDASIM=1 python tests/conv_cuda_runs.py BUILD_DIR

Prints one JSON line of errors (float64): forward, loss_and_grad, input_grads and hvp against the
interpreter, for the conv net of tests/test_conv.py (conv with bias, groups, dilation; both pools)."""
import json
import os
import sys

import numpy as np

assert "1" in (os.environ.get("NUMBA_ENABLE_CUDASIM"), os.environ.get("GRADC_TEST_ON_GPU")), \
    "run under numba-cuda's simulator, or set GRADC_TEST_ON_GPU=1 on a GPU"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gradc as gc  # noqa: E402
from cuda_target_runs import err, reference  # noqa: E402
from test_conv import _conv_net  # noqa: E402


def main(build):
    rng = np.random.default_rng(0)
    model, _ = _conv_net("conv_net_cuda")
    dev = gc.compile(model, out=build, target="cuda", dtype="float64", order=2)
    params = dev.init_params(seed=3)
    inputs = {"x": rng.standard_normal((2, 1, 8, 8)), "y": rng.integers(0, 10, 2)}
    tangents = {k: rng.standard_normal(np.shape(params[k])) for k in dev.TRAINABLE}
    ref = reference(model, params, inputs, 2, tangents)
    loss, grads = dev.loss_and_grad(params, **inputs)
    errors = {"forward": err(ref["outputs"] | {"loss": ref["loss"]}, dev.forward(params, **inputs)),
              "loss": err(ref["loss"], loss), "grads": err(ref["grads"], grads),
              "input_grads": err(ref["input_grads"], dev.input_grads(params, **inputs)),
              "hvp": err(ref["hvp"], dev.hvp(params, tangents, **inputs))}
    print(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1])
