"""Scalar sympy expressions -> Python source that Numba compiles."""
import io
import math
import tokenize

import numpy as np
import sympy as sp
from numpy.polynomial import chebyshev
from sympy.printing.pycode import PythonCodePrinter

from gradc.ops.random import normal_draw_source

# Stable scalar helpers the generated module defines when an expression uses them.
HELPERS = {
    "_sigmoid": '''def _sigmoid(x):
    e = math.exp(-math.fabs(x))   # never exp of a large positive number
    r = 1.0 / (1.0 + e)
    return r if x >= 0.0 else e * r   # (a select, not a branch: random signs mispredicted half the time)''',
    "_softplus": '''def _softplus(x):
    return (x if x > 0.0 else 0.0) + math.log1p(math.exp(-math.fabs(x)))''',
    "_relu": '''def _relu(x):
    return 0.0 if x <= 0.0 else x   # NaN passes through''',
    "_step": '''def _step(x):
    return 1.0 if x > 0.0 else 0.0   # relu'(0) = 0''',
    "_sign": '''def _sign(x):
    return 1.0 if x > 0.0 else (-1.0 if x < 0.0 else 0.0 * x)   # abs'(0) = 0; NaN stays NaN''',
    "_tie": '''def _tie(a, b):
    return 1.0 if a > b else (0.5 if a == b else 0.0)   # a tie splits the gradient evenly''',
    "_max2": '''def _max2(a, b):
    return a if (a > b or a != a) else b   # NaN propagates, as np.maximum''',
    "_min2": '''def _min2(a, b):
    return a if (a < b or a != a) else b''',
    "_normal_draw": normal_draw_source(),
}


TANH_CLAMP = 9.5   # tanh(9.5) rounds to 1.0 in float32


def _rational_tanh_source(depth=12):
    """A float32 tanh that LLVM can vectorise (libm's tanhf is a call per element).

    Lambert's continued fraction of tanh, cut at `depth`, is a Pade approximant p(x)/q(x);
    sympy expands it. At depth 12 (degree 13/12) its relative error on |x| <= 9.5 is below
    1e-7 when evaluated in float64 (float32 builds do too: FLOAT64_HELPERS), under float32's
    resolution; beyond 9.5 tanh is +-1. Its value is clamped to [-1, 1], so that 1 - tanh(x)^2
    never goes negative (evaluated in float32 it reached 1.0000004).
    """
    x, z = sp.symbols("x z")
    t = sp.Integer(2 * depth + 1)
    for k in range(depth, 0, -1):
        t = (2 * k - 1) + x ** 2 / t
    num, den = sp.fraction(sp.cancel(x / t))
    odd = sp.Poly(sp.expand(num / x).subs(x ** 2, z), z).all_coeffs()    # num = x * odd(x*x)
    even = sp.Poly(sp.expand(den).subs(x ** 2, z), z).all_coeffs()       # den = even(x*x)
    scale = even[-1]

    def horner(coeffs):   # highest power first -> "c0 + z * (c1 + z * (...))"
        text = repr(float(coeffs[0] / scale))
        for c in coeffs[1:]:
            text = f"{float(c / scale)!r} + z * ({text})"
        return text
    return f'''def _tanh(x):
    # a Pade approximant of tanh (see codegen/sympy_print.py): it vectorises, unlike math.tanh
    c = {TANH_CLAMP} if x > {TANH_CLAMP} else (-{TANH_CLAMP} if x < -{TANH_CLAMP} else x)   # NaN passes through
    z = c * c
    t = c * ({horner(odd)}) / ({horner(even)})
    return 1.0 if t > 1.0 else (-1.0 if t < -1.0 else t)   # rounding may pass 1 by an ulp or two'''


# _rational_tanh_source()'s text, written out: sympy takes about 0.35 s to derive it, on every
# compile (tests/test_sympy_print.py checks that the two agree)
HELPERS["_tanh"] = """\
def _tanh(x):
    # a Pade approximant of tanh (see codegen/sympy_print.py): it vectorises, unlike math.tanh
    c = 9.5 if x > 9.5 else (-9.5 if x < -9.5 else x)   # NaN passes through
    z = c * c
    t = c * (1.0 + z * (0.14666666666666667 + z * (0.0052173913043478265 + z * (6.625258799171843e-05 + z * (3.2286836253274086e-07 + z * (5.179706350792634e-10 + z * (1.264885555749117e-13))))))) / (1.0 + z * (0.48 + z * (0.03188405797101449 + z * (0.0006625258799171842 + z * (5.230467473030402e-06 + z * (1.5193805295658393e-08 + z * (1.1510458557316966e-11)))))))
    return 1.0 if t > 1.0 else (-1.0 if t < -1.0 else t)   # rounding may pass 1 by an ulp or two"""


EXP_SQUARINGS, EXP_DEGREE, LOG1P_TERMS = 8, 11, 10


def _exp_nonpositive_source():
    """exp(t) for t <= 0 without a libm call, so that a loop of it vectorises (Numba has no vector math
    library here: math.exp is a call per element, and a float32 sigmoid ran 7 ns an element, 16x torch's).
    exp(t) = exp(t / 256) ** 256: the Taylor polynomial of degree 11 at |t / 256| <= 0.41, squared 8
    times, in float64: within 1e-11 of exp, under float32's rounding. Below -104, where float32's exp is
    0, it is 0 (not exp(-104): the kernel goes on in float64, and a review's x * softplus(x) at x = -3e38
    multiplied that back up to 6e31)."""
    coeffs = [1.0 / math.factorial(k) for k in range(EXP_DEGREE, -1, -1)]
    text = repr(coeffs[0])
    for c in coeffs[1:]:
        text = f"{c!r} + y * ({text})"
    squares = "\n".join(["    p = p * p"] * EXP_SQUARINGS)
    return f'''def _exp_nonpositive(t):
    # a polynomial, squared (see codegen/sympy_print.py): it vectorises, unlike math.exp
    c = -104.0 if t < -104.0 else t   # (the polynomial's range; NaN passes through)
    y = c * {1.0 / 2 ** EXP_SQUARINGS!r}
    p = {text}
{squares}
    return 0.0 if t < -104.0 else p'''


def _log1p_unit_source():
    """log(1 + u) for 0 <= u <= 1 without a libm call: 2 atanh(s), s = u / (2 + u) <= 1/3, by its series
    to s**21 (within 2e-11)."""
    text = repr(1.0 / (2 * LOG1P_TERMS + 1))
    for k in range(LOG1P_TERMS - 1, -1, -1):
        text = f"{1.0 / (2 * k + 1)!r} + z * ({text})"
    return f'''def _log1p_unit(u):
    # a series (see codegen/sympy_print.py): it vectorises, unlike math.log1p
    s = u / (2.0 + u)
    z = s * s
    return 2.0 * s * ({text})'''


ERFC_DEGREE, ERFC_FIT_UP_TO = 16, 10.5


def _erfc_source():
    """erfc(z) without a libm call: erfc(|z|) = t exp(P(t) - z^2), t = 2 / (2 + |z|), with P the polynomial of
    degree 16 interpolating log(erfc(z) / t) + z^2 at Chebyshev points of t over |z| <= 10.5: within 2e-12
    of erfc, relative, up to z = 10.14, and 0 past it (_exp_nonpositive's 0 below -104: erfc < 1e-46 there,
    under float32's least subnormal); erfc(-|z|) = 2 - erfc(|z|).
    gelu is x erfc(-x / sqrt(2)) / 2 (gradc/ops/elementwise.py; sympy writes it x (2 - erfc(x / sqrt(2))) / 2,
    as close as torch's x (1 + erf) / 2). erf itself stays libm's: 1 - erfc is only absolutely close, and
    erf near 0 is not (a review: erf(0) came out 3.7e-12)."""
    lo = 2.0 / (2.0 + ERFC_FIT_UP_TO)   # t at the largest |z| fitted

    def log_ratio(s):   # log(erfc(z) / t) + z^2 at s in [-1, 1], t = lo + (1 - lo) (s + 1) / 2
        t = lo + (1.0 - lo) * (s + 1.0) / 2.0
        z = 2.0 / t - 2.0
        return np.array([math.log(math.erfc(zz) / tt) + zz * zz for zz, tt in zip(z, t)])
    coeffs = chebyshev.cheb2poly(chebyshev.chebinterpolate(log_ratio, ERFC_DEGREE))[::-1]
    text = repr(float(coeffs[0]))
    for c in coeffs[1:]:
        text = f"{float(c)!r} + s * ({text})"
    return f'''def _erfc_poly(z):
    # erfc by a polynomial and _exp_nonpositive (see codegen/sympy_print.py): it vectorises, unlike math.erfc
    a = math.fabs(z)
    c = {ERFC_FIT_UP_TO!r} if a > {ERFC_FIT_UP_TO!r} else a   # (the fit's range; NaN passes through)
    t = 2.0 / (2.0 + c)
    s = (t - {lo!r}) * {2.0 / (1.0 - lo)!r} - 1.0
    e = t * _exp_nonpositive(({text}) - a * a)   # erfc(|z|)
    return e if z >= 0.0 else 2.0 - e'''


# A float32 build's sigmoid and softplus, on the helpers above, in float64 (FLOAT64_HELPERS): within
# float32 rounding of the true values, and vectorised (6.3x and 4.2x faster than with math.exp)
HELPERS["_sigmoid_poly"] = '''def _sigmoid_poly(x):
    e = _exp_nonpositive(-math.fabs(x))
    r = 1.0 / (1.0 + e)
    return r if x >= 0.0 else e * r   # (a select, not a branch: the loop vectorises)'''
HELPERS["_softplus_poly"] = '''def _softplus_poly(x):
    return (x if x > 0.0 else 0.0) + _log1p_unit(_exp_nonpositive(-math.fabs(x)))'''
# (made from their series when this module loads: no sympy, a few microseconds)
HELPERS["_exp_nonpositive"] = _exp_nonpositive_source()
HELPERS["_log1p_unit"] = _log1p_unit_source()
HELPERS["_erfc_poly"] = _erfc_source()
HELPER_CALLS = {"_sigmoid_poly": ("_exp_nonpositive",), "_softplus_poly": ("_exp_nonpositive", "_log1p_unit"),
                "_erfc_poly": ("_exp_nonpositive",)}


def single_precision(source):
    """`source` with each float literal written FLOAT(literal): in a float32 build's kernels a bare
    literal is a float64, and Numba would compute the whole expression in float64 (half the vector
    lanes, and conversions): a float32 tanh layer ran 8.6 us against 3.7 in float32 (64 x 128)."""
    lines = source.splitlines(keepends=True)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for tok in reversed(tokens):   # right to left: an edit leaves the columns before it as they were
        text = tok.string.lower()
        if tok.type == tokenize.NUMBER and not text.startswith(("0x", "0o", "0b")) and not text.endswith("j") \
                and any(c in text for c in ".e"):
            (row, start), (_, end) = tok.start, tok.end
            line = lines[row - 1]
            lines[row - 1] = f"{line[:start]}FLOAT({tok.string}){line[end:]}"
    return "".join(lines)


# Helpers a float32 build still evaluates in float64. The rational tanh evaluated in float32 was 2.3x
# faster but only within 4e-7 of tanh near +-1 (7 float32 steps), so 1 - y*y, tanh's derivative at
# |x| = 6, came out 1% off where PyTorch's is 0.1% off; in float64 it is within 1e-7 before rounding.
FLOAT64_HELPERS = {"_tanh", "_exp_nonpositive", "_log1p_unit", "_sigmoid_poly", "_softplus_poly", "_erfc_poly"}


def helper_source(name, single=False):
    """The source of scalar helper `name`; with `single` (a float32 CPU build), in float32 arithmetic
    unless it is one of FLOAT64_HELPERS."""
    text = HELPERS[name]
    return single_precision(text) if single and name not in FLOAT64_HELPERS else text


class ExpNonpositive(sp.Function):
    """exp of an argument sympy shows is <= 0 (erfc's derivative: exp(-x**2)): a float32 build's
    _exp_nonpositive, which vectorises."""
    nargs = 1


class ErfcAsWritten(sp.Function):
    """erfc of its argument as written: sympy turns erfc(-u) into 2 - erfc(u), which is 0 where
    erfc(-u) is below 2's ulp (gelu's x erfc(-x/sqrt(2)) / 2 gave 0 for x < -8.3, where its value
    is some 1e-17). _complements writes it back."""
    nargs = 1


def _complements(expr):
    """expr with each sum k + c erfc(u), k = -2c, written -c erfc(-u), and k + c erf(u), k = +-c,
    written c erfc(-u) or -c erfc(u): the same values, without the cancellation (gelu's 2 - erfc(u)
    lost all its digits for u < -5.9; a user's 0.5 + 0.5 erf(u) as much). k and c may be floats."""
    def complement(add):
        k = next(a for a in add.args if a.is_Number)   # (sympy folds a sum's numbers into one)
        terms = [a for a in add.args if a is not k]
        for term in terms:
            c, f = term.as_coeff_Mul()
            rest = sp.Add(*(t for t in terms if t is not term))
            if isinstance(f, sp.erfc) and (k + 2 * c).is_zero:
                return rest - c * ErfcAsWritten(-f.args[0])
            if isinstance(f, sp.erf) and (k - c).is_zero:
                return rest + c * ErfcAsWritten(-f.args[0])
            if isinstance(f, sp.erf) and (k + c).is_zero:
                return rest - c * ErfcAsWritten(f.args[0])
        return add
    return expr.replace(lambda e: isinstance(e, sp.Add) and any(a.is_Number for a in e.args), complement)


class KernelPrinter(PythonCodePrinter):
    """Python source for one scalar expression; remembers which helpers it called.

    With `single` (float32 builds) tanh prints as the vectorisable helper `_tanh`, and the caller
    writes literals as float32 (single_precision).
    """

    def __init__(self, single=False):
        super().__init__({"fully_qualified_modules": True, "standard": "python3"})
        self.used_helpers = set()
        self.single = single

    # math.pi and math.e are float64s, which would make a float32 kernel compute in float64
    def _print_Pi(self, e): return repr(float(e)) if self.single else super()._print_Pi(e)
    def _print_Exp1(self, e): return repr(float(e)) if self.single else super()._print_Exp1(e)

    def _print_tanh(self, e):
        if self.single:
            return self._helper("_tanh", e)
        return f"math.tanh({self._print(e.args[0])})"

    def _helper(self, name, expr):
        self.used_helpers |= {name, *HELPER_CALLS.get(name, ())}
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    # a float32 build's erfc (gelu's), and exp of what sympy shows is <= 0 (print_block), vectorise
    def _print_erfc(self, e):
        return self._helper("_erfc_poly", e) if self.single else f"math.erfc({self._print(e.args[0])})"

    _print_ErfcAsWritten = _print_erfc

    def _print_ExpNonpositive(self, e):
        return self._helper("_exp_nonpositive", e)

    def _print_Sigmoid(self, e): return self._helper("_sigmoid_poly" if self.single else "_sigmoid", e)
    def _print_Softplus(self, e): return self._helper("_softplus_poly" if self.single else "_softplus", e)
    def _print_Relu(self, e): return self._helper("_relu", e)
    def _print_Step(self, e): return self._helper("_step", e)
    def _print_Sign(self, e): return self._helper("_sign", e)
    def _print_Tie(self, e): return self._helper("_tie", e)
    def _print_Max2(self, e): return self._helper("_max2", e)
    def _print_Min2(self, e): return self._helper("_min2", e)

    def _print_NormalDraw(self, e):
        # the stream's key: a uint64 literal (an int, not a float); flat and count: the kernel's names for its
        # element's flat index and their count, which each kernel that may hold a draw maps FLAT and SIZE to
        seed, half, key, flat, count = e.args
        self.used_helpers.add("_normal_draw")
        return f"_normal_draw({self._print(seed)}, {self._print(half)}, np.uint64({int(key)}), {flat}, {count})"

    def _print_Power(self, e):
        return self._print_Pow(sp.Pow(*e.args, evaluate=False))

    # a real expression holds I only where sympy evaluated a function outside its real domain
    # (d/dp (-2)**p has log(-2) = log(2) + I pi): the real value there is NaN, as numpy's and torch's
    def _print_ImaginaryUnit(self, e):
        return "math.nan"

    def _print_AbsF(self, e):
        return f"math.fabs({self._print(e.args[0])})"

    def _print_Pow(self, expr, rational=False):
        base, exp = expr.args
        # parenthesised: sympy prints a/x**2 as a/<this>, and a/x * x would be a
        if exp == 2:
            b = self.parenthesize(base, sp.printing.precedence.PRECEDENCE["Mul"])
            return f"({b} * {b})"
        if exp == -1:
            return f"(1.0 / {self.parenthesize(base, sp.printing.precedence.PRECEDENCE['Pow'])})"
        return super()._print_Pow(expr, rational=rational)

    def _print_Rational(self, expr):
        return repr(float(expr))

    def _print_Float(self, expr):   # sympy writes 15 digits: 1/3 came out 1 ulp off, 0.1234567890123457 9 ulps
        return repr(float(expr))

    def _print_Integer(self, expr):
        return f"{int(expr)}.0" if abs(int(expr)) < 2 ** 53 else repr(float(expr))


def print_block(expr, names, result, single=False):
    """Lines computing `expr` into `result`: sympy.cse pulls out repeated subexpressions.

    `names` maps the operand symbols to the source text that reads them. `single`: float32
    arithmetic (a float32 build's CPU kernels).
    """
    printer = KernelPrinter(single)
    expr = _complements(expr)
    if single:   # (asked of the operands' real symbols, before they become the kernel's names)
        expr = expr.replace(lambda e: isinstance(e, sp.exp) and e.args[0].is_nonpositive,
                            lambda e: ExpNonpositive(e.args[0]))
    temps, (reduced,) = sp.cse(expr.xreplace(names), symbols=sp.numbered_symbols("s"))
    lines = [f"{sym} = {printer.doprint(sub)}" for sym, sub in temps]
    lines.append(f"{result} = {printer.doprint(reduced)}")
    if single:
        lines = [single_precision(line) for line in lines]
    return lines, printer.used_helpers
