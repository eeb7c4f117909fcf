"""Runs tests/test_indexing_compiled.py's model on `--target cuda` under numba-cuda's simulator.

    NUMBA_ENABLE_CUDASIM=1 python tests/indexing_cuda_runs.py BUILD_DIR

Prints one JSON line: the largest relative error of each entry point against the interpreter."""
import json
import os
import sys

import numpy as np

assert "1" in (os.environ.get("NUMBA_ENABLE_CUDASIM"), os.environ.get("GRADC_TEST_ON_GPU")), \
    "run under numba-cuda's simulator, or set GRADC_TEST_ON_GPU=1 on a GPU"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gradc as gc  # noqa: E402
from gradc.interpret import evaluate  # noqa: E402
from gradc.passes.pipeline import build_training_graph  # noqa: E402
from test_indexing_compiled import every_new_op, inputs_for  # noqa: E402


def err(a, b):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b), initial=0.0) / max(1.0, float(np.max(np.abs(b), initial=0.0))))


m = every_new_op()
mod = gc.compile(m, out=sys.argv[1], target="cuda", dtype="float64", order=2)
params, inputs = mod.init_params(0), inputs_for(2)
graph = build_training_graph(m, "float64", order=2)
rng = np.random.default_rng(1)
v = {p: rng.standard_normal(params[p].shape) for p in params}
ref = evaluate(graph, params, inputs, [graph.objective, graph.outputs["h"]] + [graph.grads[p] for p in params] +
               [graph.hvps[p] for p in params], tangents=v)
loss, grads = mod.loss_and_grad(params, **inputs)
hv = mod.hvp(params, v, **inputs)
errors = {"loss": err(loss, ref[graph.objective]), "h": err(mod.forward(params, **inputs)["h"], ref[graph.outputs["h"]])}
for p in params:
    errors[f"grad_{p}"] = err(grads[p], ref[graph.grads[p]])
    errors[f"hvp_{p}"] = err(hv[p], ref[graph.hvps[p]])
print(json.dumps(errors))
