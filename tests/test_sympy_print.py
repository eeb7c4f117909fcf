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


def test_float_constants_are_written_exactly():
    """sympy writes a Float with 15 digits: `x * (1/3)` ran with 0.333333333333333, 1 ulp off, in the kernels and
    the interpreter alike (found while testing Heaviside's value at 0)."""
    from gradc.ops.elementwise import numpy_function
    consts = (1 / 3, 0.12345678901234568, 2.0 ** -60 * 3, 1e300 / 7)
    expr = sum(sp.Float(c) * x for c, x in zip(consts, (x0, x1, x2))) + sp.Float(consts[3])
    lines, _ = print_block(expr, {X[j]: sp.Symbol(f"a{j}", real=True) for j in range(3)}, "out")
    for c in consts:
        assert repr(c) in lines[-1], (c, lines)
    args = (np.array([1.0]), np.array([0.0]), np.array([0.0]))
    assert numpy_function(expr, 3)(*args)[0] == consts[0] + consts[3]


def _compiled_helpers(names, single=False):
    """The scalar helpers `names` and those they call (HELPER_CALLS), compiled as a module's kernels are."""
    from numba import njit
    from gradc.codegen.sympy_print import HELPER_CALLS, helper_source
    scope = {"math": math, "np": np, "FLOAT": np.float32 if single else np.float64}
    for h in sorted(set(names) | {c for h in names for c in HELPER_CALLS.get(h, ())}):
        exec(helper_source(h, single=single), scope)
        scope[h] = njit(error_model="numpy")(scope[h])
    return scope


def _over(f, dtype=np.float64):
    """f of each element of an array, in a compiled loop (as a kernel calls a helper)."""
    from numba import njit

    @njit(error_model="numpy")
    def over(xs):
        out = np.empty(xs.size, dtype)
        for i in range(xs.size):
            out[i] = f(xs[i])
        return out
    return over


def test_written_out_tanh_helper_is_what_sympy_derives():
    from gradc.codegen.sympy_print import HELPERS, _rational_tanh_source
    assert HELPERS["_tanh"] == _rational_tanh_source()


def test_single_precision_wraps_float_literals_only():
    from gradc.codegen.sympy_print import single_precision
    src = 'def f(x, a):\n    y = a[0] + 1.5 * x ** 2 - 3e-7   # 2.5 in a comment\n    return "0.5", y * .25, 10\n'
    assert single_precision(src) == ('def f(x, a):\n    y = a[0] + FLOAT(1.5) * x ** 2 - FLOAT(3e-7)   # 2.5 in a comment\n'
                                     '    return "0.5", y * FLOAT(.25), 10\n')


@pytest.mark.parametrize("expr", [sp.tanh(x0 + x1), 1 - sp.tanh(x0) ** 2 * x1, x0 * (1 - x1) + x1 * sp.tanh(x2),
                                  x0 / (1 + sp.exp(-x1)), sp.log(1 + x0 ** 2) * 0.5,
                                  sp.diff(x0 * (1 + sp.erf(x0 / sp.sqrt(2))) / 2, x0) * x1], ids=str)
def test_float32_kernels_compute_in_float32_and_stay_accurate(expr):
    """A float32 build's elementwise kernels compute in float32 (a float64 literal would make Numba
    compute the expression in float64): the kernel's result type is float32 (but for tanh, evaluated in
    float64), and it is within a few float32 roundings of the float64 value."""
    from numba import njit
    from gradc.codegen.sympy_print import FLOAT64_HELPERS, helper_source
    names = {X[j]: sp.Symbol(f"a{j}", real=True) for j in range(3)}
    lines, helpers = print_block(expr, names, "out", single=True)
    scope = {"math": math, "np": np, "FLOAT": np.float32}
    for h in helpers:
        exec(helper_source(h, single=True), scope)
        scope[h] = njit(scope[h])
    exec("def kernel(a0, a1, a2):\n" + "".join(f"    {line}\n" for line in lines) + "    return out\n", scope)
    kernel = njit(scope["kernel"])
    rng = np.random.default_rng(1)
    for _ in range(20):
        a = [np.float32(v) for v in rng.uniform(-3.0, 3.0, 3)]
        got = kernel(*a)
        want = float(expr.subs({X[j]: float(a[j]) for j in range(3)}))
        assert abs(float(got) - want) <= 2e-6 * max(1.0, abs(want)), (lines, got, want)
    if not helpers & FLOAT64_HELPERS:   # tanh is evaluated in float64 (see FLOAT64_HELPERS)
        assert str(kernel.nopython_signatures[0].return_type) == "float32", (lines, kernel.nopython_signatures)


def test_float32_builds_tanh_is_float32_tanh_rounded_and_never_past_one():
    """A float32 build's tanh helper (evaluated in float64, FLOAT64_HELPERS) is within float32
    rounding of tanh, as a correctly rounded tanhf: evaluated in float32 it was 4e-7 off near +-1,
    which made 1 - y*y (its derivative) 10x less accurate than PyTorch's. Clamped to [-1, 1]."""
    over = _over(_compiled_helpers(["_tanh"], single=True)["_tanh"], np.float32)
    xs = np.concatenate([np.linspace(-12, 12, 2_000_001, dtype=np.float32), np.float32([-8.82, np.inf, -np.inf])])
    ys = over(xs)
    assert np.all(np.abs(ys) <= 1.0)
    assert np.max(np.abs(ys.astype(np.float64) - np.tanh(xs.astype(np.float64)))) < 6e-8
    assert np.isnan(over(np.float32([np.nan]))[0])


@pytest.mark.parametrize("helper", ["_sigmoid_poly", "_softplus_poly"])
def test_float32_builds_sigmoid_and_softplus_are_rounded_true_values(helper):
    """A float32 build's sigmoid and softplus (polynomial exp and log1p in float64, so that their loops
    vectorise: with math.exp they ran 4-7x slower than torch's) round to the float64 values: the float32
    nearest the true value almost everywhere, never a float32 step off, over the whole float32 range
    (down to the subnormals: sigmoid(-100) is 3.7e-44), with inf, -inf and NaN as the math module's."""
    from scipy.special import expit
    from gradc.codegen.sympy_print import helper_source
    over = _over(_compiled_helpers([helper], single=True)[helper], np.float32)
    xs = np.concatenate([np.linspace(-120, 120, 2_000_001, dtype=np.float32),
                         np.float32([0.0, -0.0, 1e-30, -1e-30, 88.7, -88.7, 103.9, -103.9, 1e30, -1e30])])
    exact = expit(xs.astype(np.float64)) if helper == "_sigmoid_poly" else np.logaddexp(0.0, xs.astype(np.float64))
    got = over(xs).astype(np.float64)
    step = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)   # float32's step at each value
    assert np.all(np.abs(got - exact) <= step), np.abs(got - exact).max()
    assert np.mean(got == exact.astype(np.float32)) > 0.9999
    specials = over(np.float32([np.inf, -np.inf, np.nan]))
    assert specials[0] == (1.0 if helper == "_sigmoid_poly" else np.inf) and specials[1] == 0.0
    assert np.isnan(specials[2])
    assert "math.exp(" not in helper_source("_exp_nonpositive") and "math.log1p(" not in helper_source("_log1p_unit")


def test_float32_builds_erfc_is_relatively_close_to_erfc():
    """A float32 build's erfc (gelu's: a polynomial and _exp_nonpositive in float64, so that gelu's loops
    vectorise; with math.erf gelu ran 4.3x torch's time) is within 1e-11 of math.erfc relatively up to
    10, where float32 reaches its least subnormal (and 0 where exp's argument is below -104); exp of what sympy shows is <= 0 (erfc's derivative) prints as
    _exp_nonpositive, never of a value that may be positive; erf stays libm's (1 - erfc would be only
    absolutely close: erf(0) came out 3.7e-12, a review)."""
    over = _over(_compiled_helpers(["_erfc_poly"], single=True)["_erfc_poly"])
    xs = np.concatenate([np.linspace(-12, 10, 450_001), [0.0, -0.0, 1e-300, -1e300]])
    got, exact = over(xs), np.array([math.erfc(x) for x in xs])
    assert np.max(np.abs(got / exact - 1)) < 1e-11
    beyond = np.linspace(10.0001, 30, 1001)   # erfc < 2.1e-45: float32 holds 1.4e-45 at the least
    assert np.all(over(beyond) <= 2.1e-45) and over(np.array([1e300]))[0] == 0.0
    specials = over(np.array([np.inf, -np.inf, np.nan]))
    assert specials[0] == 0.0 and specials[1] == 2.0 and np.isnan(specials[2])
    names = {X[0]: sp.Symbol("a0")}
    lines, helpers = print_block(sp.diff(x0 * sp.erfc(-x0 / sp.sqrt(2)) / 2, x0), names, "out", single=True)
    assert {"_erfc_poly", "_exp_nonpositive"} <= helpers and "math." not in "".join(lines).replace("math.sqrt", "")
    lines, helpers = print_block(sp.exp(x0) + sp.erf(x0), names, "out", single=True)
    assert sorted(lines[0][6:].split(" + ")) == ["math.erf(a0)", "math.exp(a0)"] and not helpers, lines
    lines, _ = print_block(sp.erfc(x0), names, "out")   # a float64 build keeps libm
    assert lines == ["out = math.erfc(a0)"]


@pytest.mark.parametrize("single", [True, False], ids=["float32", "float64"])
def test_gelu_and_a_users_erf_form_keep_their_digits_far_into_the_left_tail(single):
    """sympy writes gelu's x erfc(-x/sqrt(2)) / 2 as x (2 - erfc(x/sqrt(2))) / 2, and its derivative with
    1 - erfc(u)/2: both were 0 for x < -8.3 (2 - erfc is 2 - 2), where gelu is -8e-17 and float32 holds
    it (a new user's trial; 7% off at -8). The printer writes such sums back as erfc(-u), and a user's
    1 + erf(u) as erfc(-u): gelu and its derivative are then relatively close to the true values
    wherever the dtype holds them (mpmath's, to 40 digits)."""
    import mpmath
    from numba import njit
    from gradc.ops.elementwise import BUILTINS
    gelu = BUILTINS["gelu"][0]
    users = [x0 * (1 + sp.erf(x0 / sp.sqrt(2))) / 2, 0.5 * x0 * (1 + sp.erf(x0 / math.sqrt(2))),   # floats too (a review)
             x0 * (1.0 + sp.erf(x0 / sp.sqrt(2))) / 2]
    dtype = np.float32 if single else np.float64
    xs = np.concatenate([np.linspace(-12.5 if single else -37.0, 4.0, 301), [-8.5, -6.0, 0.0]]).astype(dtype)
    mpmath.mp.dps = 40
    true = {"value": [float(x * mpmath.erfc(-x / mpmath.sqrt(2)) / 2) for x in map(mpmath.mpf, xs.tolist())],
            "slope": [float(mpmath.erfc(-x / mpmath.sqrt(2)) / 2 + x * mpmath.npdf(x)) for x in map(mpmath.mpf, xs.tolist())]}
    # the argument rounds to the dtype before erfc sees it (and 1/sqrt(2) once more, written as a float):
    # erfc's relative error grows as 2 z^2 eps
    tolerance = (3e-6 if single else 3e-14) * (1 + xs.astype(np.float64) ** 2)
    for form in [gelu] + users:
        for what, expr in (("value", form), ("slope", sp.diff(form, x0))):
            lines, helpers = print_block(expr, {X[0]: sp.Symbol("a0", real=True)}, "out", single=single)
            assert "2.0) - " not in "".join(lines) and "math.erf(" not in "".join(lines), lines
            scope = _compiled_helpers(helpers, single=single)
            scope["FLOAT"] = dtype
            exec("def kernel(a0):\n" + "".join(f"    {line}\n" for line in lines) + "    return out\n", scope)
            got = _over(njit(error_model="numpy")(scope["kernel"]), dtype)(xs).astype(np.float64)
            want = np.array(true[what])
            assert np.all(np.abs(got - want) <= tolerance * np.abs(want) + 1e-45), (str(form), what, lines)


def test_float32_helpers_vanish_where_float32s_exp_does():
    """Below -104 _exp_nonpositive is 0, as float32's exp: it was exp(-104), and the kernel goes on in float64,
    so x * softplus(x)'s gradient at x = -3e38 came out 6e31 (a review; torch: -0)."""
    from numba import njit
    from gradc.ops.scalar import Softplus
    names = {X[0]: sp.Symbol("a0")}
    lines, helpers = print_block(sp.diff(x0 * Softplus(x0), x0), names, "out", single=True)
    scope = _compiled_helpers(helpers, single=True)
    exec("def kernel(a0):\n" + "".join(f"    {line}\n" for line in lines) + "    return np.float32(out)\n", scope)
    kernel = njit(error_model="numpy")(scope["kernel"])
    for x in (-1e20, -1e30, -3e38, -105.0):
        assert kernel(np.float32(x)) == 0.0, (x, kernel(np.float32(x)))
    assert scope["_exp_nonpositive"](-np.inf) == 0.0 and np.isnan(scope["_exp_nonpositive"](np.nan))


def test_float64_sigmoid_is_within_3_ulps_and_branch_free():
    """The float64 (and CUDA) sigmoid picks its two forms by a select, not a branch (random signs
    mispredicted half the time: 1.12x torch's time, 0.62x since); within 3 ulps of the true value."""
    from scipy.special import expit
    from gradc.codegen.sympy_print import helper_source
    over = _over(_compiled_helpers(["_sigmoid"])["_sigmoid"])
    assert "if x" not in helper_source("_sigmoid").split("return")[0]   # no branch before the select
    xs = np.concatenate([np.linspace(-700, 40, 1_000_001), [0.0, -0.0, 1e-300, -1e-300]])   # (scipy's expit is 0
    got, exact = over(xs), expit(xs)                                                          # below -708)
    assert np.all(np.abs(got - exact) <= 3 * np.spacing(exact))
    specials = over(np.array([np.inf, -np.inf, np.nan]))
    assert specials[0] == 1.0 and specials[1] == 0.0 and np.isnan(specials[2])
