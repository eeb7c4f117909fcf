"""Scalar functions sympy differentiates, with derivatives stated in stable primitives.

sympy's own Heaviside, sign, Abs and Max differentiate into DiracDelta, which has no value in
generated code. These replacements follow PyTorch at kinks: relu'(0) = 0, abs'(0) = 0, a tie in
`maximum` splits the gradient evenly; their own derivatives are 0 (second derivatives of
piecewise-linear ops are 0). Sigmoid and Softplus are primitives so they are evaluated in
stable forms, and Softplus' = Sigmoid keeps the chain rule stable too.
"""
import numpy as np
import sympy as sp


class _RealFunction(sp.Function):
    is_real = True


class Sigmoid(_RealFunction):
    nargs = 1

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)


class Softplus(_RealFunction):
    nargs = 1

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0])


class Step(_RealFunction):
    """1 where x > 0, else 0 (also at 0 and for NaN): the derivative of relu."""
    nargs = 1

    def fdiff(self, argindex=1):
        return sp.S.Zero


class Relu(_RealFunction):
    nargs = 1

    def fdiff(self, argindex=1):
        # Step(x) written as Step(relu(x)), the same value everywhere: derivative() reads it as
        # Step(y), so a backward reads relu's output, which the next layer's backward keeps anyway
        # (training keeps one value per layer, not the pre-activation too)
        return Step(Relu(self.args[0]))


class Power(_RealFunction):
    """base ** exponent where both vary. Its derivatives follow PyTorch at a zero base, where sympy's hold
    0 * inf: d/d base is 0 where the exponent is 0 (sympy's e * b**(e - 1) is 0 * inf at b = 0), and
    d/d exponent is 0 where the base is 0 and the exponent >= 0 (sympy's b**e * log(b) is 0 * -inf): a
    learned exponent on relu's outputs (GeM pooling) had NaN gradients wherever a unit was off. With a
    number for either, it is sympy's Pow (a constant exponent's derivative is finite at 0 as it is)."""
    nargs = 2

    @classmethod
    def eval(cls, base, exponent):
        if exponent.is_Number or (base.is_Number and base != 0):
            return base ** exponent

    def fdiff(self, argindex=1):
        b, e = self.args
        if argindex == 1:
            return sp.Piecewise((sp.S.Zero, sp.Eq(e, 0)), (e * Power(b, e - 1), True))
        return sp.Piecewise((sp.S.Zero, sp.Eq(b, 0) & (e >= 0)), (self * sp.log(b), True))


class Sign(_RealFunction):
    nargs = 1

    def fdiff(self, argindex=1):
        return sp.S.Zero


class AbsF(_RealFunction):
    nargs = 1

    def fdiff(self, argindex=1):
        return Sign(self.args[0])


class Tie(_RealFunction):
    """d max(a, b) / da: 1 where a > b, 1/2 where a == b, else 0."""
    nargs = 2

    def fdiff(self, argindex=1):
        return sp.S.Zero


class Max2(_RealFunction):
    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        return Tie(a, b) if argindex == 1 else Tie(b, a)


class Min2(_RealFunction):
    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        return Tie(b, a) if argindex == 1 else Tie(a, b)


def _np_sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _np_erf(x):
    from scipy.special import erf   # imported on first use: scipy.special takes 0.3 s to import
    return erf(x)


def _np_erfc(x):
    from scipy.special import erfc
    return erfc(x)


# numpy implementations for the interpreter (sympy.lambdify's namespace)
NUMPY_FUNCTIONS = {
    "erf": _np_erf,
    "erfc": _np_erfc,
    "Sigmoid": _np_sigmoid,
    "Softplus": lambda x: np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x))),
    "Step": lambda x: (np.asarray(x) > 0).astype(np.result_type(x, np.float32)),
    "Relu": lambda x: np.where(np.asarray(x) > 0, x, np.where(np.isnan(x), x, 0 * x)),
    "Power": np.power,
    "Sign": np.sign,
    "AbsF": np.abs,
    "Tie": lambda a, b: np.where(a > b, 1.0, np.where(a == b, 0.5, 0.0)),
    "Max2": np.maximum,
    "Min2": np.minimum,
}

GRADC_FUNCTIONS = (Sigmoid, Softplus, Step, Relu, Power, Sign, AbsF, Tie, Max2, Min2)
# sympy functions with a stable value and a derivative in this same set (plus the above)
SYMPY_FUNCTIONS = (sp.exp, sp.log, sp.tanh, sp.sin, sp.cos, sp.tan, sp.erf, sp.atan, sp.sinh, sp.cosh,
                   sp.asin, sp.acos, sp.asinh, sp.acosh, sp.atanh, sp.erfc)


def _heaviside(x, h0=sp.S.Half):
    """sympy's Heaviside(x, H0) (H0 = 1/2 unless given) as the Piecewise it is: exactly 1 above 0 whatever H0
    (a sum of Step and Tie weighted by H0 rounded to 1 - 1 ulp), its derivative 0 clause by clause."""
    return sp.Piecewise((sp.S.One, x > 0), (h0, sp.Eq(x, 0)), (sp.S.Zero, True))


def to_differentiable(expr):
    """Replace sympy functions whose derivatives hold DiracDelta by the ones above, with the values
    sympy gives them (Heaviside(0) is 1/2, as sympy's); and powers by Power, whose derivatives are
    finite at a zero base (it stays sympy's Pow where base or exponent is a number)."""
    return expr.replace(sp.Heaviside, _heaviside) \
               .replace(sp.Pow, Power) \
               .replace(sp.sign, Sign) \
               .replace(sp.Abs, AbsF) \
               .replace(sp.Max, lambda *a: _fold(Max2, a)) \
               .replace(sp.Min, lambda *a: _fold(Min2, a))


def _fold(f, args):
    out = args[0]
    for a in args[1:]:
        out = f(out, a)
    return out


def _unsupported_logic(cond):
    """Names of what a Piecewise condition holds beside comparisons, and, or, not, True and False (what
    prints as Python)."""
    if isinstance(cond, (sp.core.relational.Relational, sp.logic.boolalg.BooleanAtom)):
        return []
    if isinstance(cond, (sp.And, sp.Or, sp.Not)):
        return [name for c in cond.args for name in _unsupported_logic(c)]
    return [type(cond).__name__]


def unsupported_parts(expr):
    """Names of the parts of `expr` that gradc cannot evaluate or differentiate."""
    bad = []
    for f in expr.atoms(sp.Function, sp.Derivative, sp.Subs):
        if isinstance(f, (sp.Derivative, sp.Subs)):
            bad.append(str(f))
        elif isinstance(f, GRADC_FUNCTIONS) or f.func in SYMPY_FUNCTIONS:
            continue
        elif isinstance(f, sp.Piecewise):
            if f.args[-1].cond != sp.true:
                bad.append("Piecewise without a last (value, True) clause (undefined where no condition holds)")
            for _, cond in f.args:
                bad += [f"{name} in a Piecewise condition" for name in _unsupported_logic(cond)]
        else:
            bad.append(f.func.__name__)
    if expr.has(sp.DiracDelta):
        bad.append("DiracDelta")
    if expr.has(sp.zoo, sp.nan):
        bad.append("an undefined value (zoo/nan)")
    if expr.has(sp.I):
        bad.append("the imaginary unit I (gradc computes in real numbers)")
    return sorted(set(bad))
