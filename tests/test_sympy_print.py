"""codegen/sympy_print.py: the printed Python computes what the sympy expression says."""
import math

import numpy as np
import pytest
import sympy as sp

from gradc.codegen.sympy_print import print_block
from gradc.ops.elementwise import X

x0, x1, x2 = X[0], X[1], X[2]


@pytest.mark.parametrize("expr", [
    x0 / x1 ** 2, x0 * x1 ** 2, x0 * x2 / x1 ** 2, x0 ** 2 / (x1 ** 2 * x2), 1 / x1, x0 / x1, -x0 / x1 ** 2,
    (x0 + x1) ** 2 / x2 ** 2, x0 ** 3 / x1 ** 2, x0 * x1 ** -1 * x2 ** -2, sp.tanh(x0) ** 2 / x1,
    x0 / (1 + x1 ** 2), sp.exp(-x0 ** 2) / x2 ** 2, x0 ** sp.Rational(1, 2) / x1 ** 2,
], ids=str)
def test_printed_expression_evaluates_like_sympy(expr):
    names = {X[j]: sp.Symbol(f"a{j}", real=True) for j in range(3)}
    lines, helpers = print_block(expr, names, "out")
    assert not helpers
    rng = np.random.default_rng(0)
    for _ in range(5):
        values = {f"a{j}": float(rng.uniform(0.3, 2.0)) for j in range(3)}
        scope = {"math": math, **values}
        exec("\n".join(lines), scope)
        expected = float(expr.subs({X[j]: values[f"a{j}"] for j in range(3)}))
        assert scope["out"] == pytest.approx(expected, rel=1e-12), lines


def test_written_out_tanh_helper_is_what_sympy_derives():
    from gradc.codegen.sympy_print import HELPERS, _rational_tanh_source
    assert HELPERS["_tanh"] == _rational_tanh_source()
