"""copy_into (gradc/runtime/copy_into.py): the compiled kernels copy arrays by plain loops, never by
Numba's broadcasting assignment, whose shape-error message took seconds to compile per rank."""
import numpy as np
import pytest
from numba import njit
from numba.core import ir, types

import gradc as gc
from gradc.interpret import evaluate
from gradc.passes.pipeline import build_training_graph
from gradc.runtime import kernel_cache
from gradc.runtime.copy_into import copy_into


@njit
def _copy(out, x):
    copy_into(out, x)


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2, 3)])
def test_copies_every_rank_strided_or_contiguous(shape):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape)
    wide = rng.standard_normal(shape[:-1] + (2 * shape[-1],)) if shape else None
    sources = [x] + ([wide[..., ::2], np.moveaxis(x, 0, -1).copy().transpose((len(shape) - 1,) + tuple(range(len(shape) - 1)))]
                     if shape else [])
    for src in sources:
        out = np.full(shape, np.nan)
        _copy(out, src)
        np.testing.assert_array_equal(out, src)
        strided_out = np.full(shape[:-1] + (2 * shape[-1],), np.nan)[..., 1::2] if shape else np.full((), np.nan)
        _copy(strided_out, src)
        np.testing.assert_array_equal(strided_out, src)


def test_ints_a_number_and_plain_python():
    out = np.zeros((2, 3), np.int64)
    _copy(out, np.arange(6).reshape(2, 3))
    assert out.tolist() == [[0, 1, 2], [3, 4, 5]]
    _copy(out, 7)
    assert (out == 7).all()
    plain = np.zeros(3)
    copy_into(plain, np.array([1.0, 2.0, 3.0]))   # an entry that is not compiled calls it as Python
    assert plain.tolist() == [1.0, 2.0, 3.0]


def test_arrays_of_different_shapes_are_refused_not_read_past():
    with pytest.raises(ValueError, match="shapes differ"):
        _copy(np.zeros((3, 4)), np.ones((3, 5)))
    with pytest.raises(ValueError, match="shapes differ"):
        _copy(np.zeros((3, 4)), np.ones((4, 4)))


def _model():
    """A scan with a matrix and a scalar carry (stacks, final carries), slices, a concat and a transpose:
    every kind of statement that copies an array inside a compiled kernel."""
    m = gc.Model("copies")
    x = m.input("x", ("T", "B", 3))
    h0 = m.input("h0", ("B", 4))
    W, U = m.param("W", (3, 8)), m.param("U", (4, 8))
    s0 = (h0 * 0.0).sum()

    def step(carry, x_t):
        h, s = carry
        z = x_t @ W + h @ U
        a, b = z[:, 0:4], z[:, 4:8]
        h = gc.tanh(a) * gc.sigmoid(b)
        return (h, s + (h * h).sum() + gc.exp(a.T).sum()), gc.concat([h, a], axis=1)

    (h, s), ys = gc.scan(step, (h0, s0), x)
    m.minimize((ys * ys).mean() + s + (h.T @ h).sum())
    return m


def _array_assignments(dispatcher):
    """The statements of a compiled kernel that assign an array into an array by Numba's setitem."""
    found = []
    for cres in dispatcher.overloads.values():
        for inst, sig in cres.type_annotation.calltypes.items():
            if isinstance(inst, (ir.SetItem, ir.StaticSetItem)) and isinstance(sig.args[-1], types.Array):
                found.append(str(inst))
    return found


def test_a_builds_kernels_copy_no_array_by_numbas_assignment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADC_CACHE_DIR", str(tmp_path / "cache"))   # every kernel compiled here, with its typing
    model = _model()
    mod = gc.compile(model, out=str(tmp_path / "build"), dtype="float64", order=1)
    kernels = [(name, disp) for owner, name, disp, _ in kernel_cache.KERNELS if owner == "copies" and disp.overloads]
    assert len(kernels) > 10 and any("scan" in name for name, _ in kernels)
    assert {name: found for name, disp in kernels if (found := _array_assignments(disp))} == {}
    rng = np.random.default_rng(3)
    inputs = {"x": rng.standard_normal((5, 2, 3)), "h0": rng.standard_normal((2, 4))}
    params = mod.init_params(1)
    loss, grads = mod.loss_and_grad(params, **inputs)
    graph = build_training_graph(model, "float64")
    want = evaluate(graph, params, inputs, [graph.objective] + list(graph.grads.values()))
    assert loss == pytest.approx(float(want[graph.objective]), rel=1e-12)
    for name, node in graph.grads.items():
        np.testing.assert_allclose(grads[name], want[node], rtol=1e-10, atol=1e-12)
