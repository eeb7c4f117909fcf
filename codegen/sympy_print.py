"""Scalar sympy expressions -> Python source that Numba compiles."""
import sympy as sp
from sympy.printing.pycode import PythonCodePrinter

# Stable scalar helpers the generated module defines when an expression uses them.
HELPERS = {
    "_sigmoid": '''def _sigmoid(x):
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)   # never exp of a large positive number
    return e / (1.0 + e)''',
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
}


class KernelPrinter(PythonCodePrinter):
    """Python source for one scalar expression; remembers which helpers it called."""

    def __init__(self):
        super().__init__({"fully_qualified_modules": True, "standard": "python3"})
        self.used_helpers = set()

    def _helper(self, name, expr):
        self.used_helpers.add(name)
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    def _print_Sigmoid(self, e): return self._helper("_sigmoid", e)
    def _print_Softplus(self, e): return self._helper("_softplus", e)
    def _print_Relu(self, e): return self._helper("_relu", e)
    def _print_Step(self, e): return self._helper("_step", e)
    def _print_Sign(self, e): return self._helper("_sign", e)
    def _print_Tie(self, e): return self._helper("_tie", e)
    def _print_Max2(self, e): return self._helper("_max2", e)
    def _print_Min2(self, e): return self._helper("_min2", e)

    def _print_AbsF(self, e):
        return f"math.fabs({self._print(e.args[0])})"

    def _print_Pow(self, expr, rational=False):
        base, exp = expr.args
        if exp == 2:
            b = self.parenthesize(base, sp.printing.precedence.PRECEDENCE["Mul"])
            return f"{b} * {b}"
        if exp == -1:
            return f"1.0 / {self.parenthesize(base, sp.printing.precedence.PRECEDENCE['Pow'])}"
        return super()._print_Pow(expr, rational=rational)

    def _print_Rational(self, expr):
        return repr(float(expr))

    def _print_Integer(self, expr):
        return f"{int(expr)}.0" if abs(int(expr)) < 2 ** 53 else repr(float(expr))


def print_block(expr, names, result):
    """Lines computing `expr` into `result`: sympy.cse pulls out repeated subexpressions.

    `names` maps the operand symbols to the source text that reads them.
    """
    printer = KernelPrinter()
    temps, (reduced,) = sp.cse(expr.xreplace(names), symbols=sp.numbered_symbols("s"))
    lines = [f"{sym} = {printer.doprint(sub)}" for sym, sub in temps]
    lines.append(f"{result} = {printer.doprint(reduced)}")
    return lines, printer.used_helpers
