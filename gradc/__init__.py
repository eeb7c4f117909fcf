"""gradc: a symbolic graph compiler that derives backward passes and writes readable Numba code.

    import gradc as gc
    m = gc.Model("mlp"); x = m.input("x", ("B", 64)); ...
    mod = gc.compile(m)          # or: gradc compile model.py
"""
import difflib

import numpy as np

from .version import __version__
from .errors import GradcError
from .dsl import (Model, Tensor, exp, log, tanh, sigmoid, relu, softplus, gelu, sin, cos, sqrt, square,
                  abs, maximum, matmul, sum, mean, max, reshape, transpose, softmax, log_softmax,
                  softmax_cross_entropy, mse, elementwise, conv2d, max_pool2d, avg_pool2d)
from .dsl import concat, stack, take, dropout, gaussian_noise, scan


def compile(model, **options):
    """Compile a Model like `gradc compile` does and return the imported generated module.

    Options (defaults shown): out="build", target="cpu", dtype="float32", order=2, bind=None (a dict such
    as {"B": 64}), memory_budget=None (bytes, a size such as "64MiB", or "auto"), devices=None,
    schedule=None, microbatches=None, device_memory=None, batch_dim=None, warm=True (or "first": compile
    the kernels of forward, loss_and_grad, input_grads and the Trainer now, so that Numba's cache makes
    their first call fast; "all": hvp and hessian too, which otherwise compile on first use; False or
    "none": none; warm_cache= is the same option).
    A mistake in the model or the options raises GradcError; a compile that fails leaves OUT as it was.
    """
    from .compiler import compile_model
    from .errors import user_src
    src = user_src()
    try:
        return compile_model(model, options_src=src, **options)
    except GradcError as e:
        if e.src is None:   # an option's mistake (a flag's, on the command line): the call's line
            raise GradcError(e.message, src) from None
        raise


__all__ = ["Model", "Tensor", "GradcError", "compile", "exp", "log", "tanh", "sigmoid", "relu", "softplus",
           "gelu", "sin", "cos", "sqrt", "square", "abs", "maximum", "matmul", "sum", "mean", "max", "reshape",
           "transpose", "softmax", "log_softmax", "softmax_cross_entropy", "mse", "elementwise", "conv2d", "max_pool2d", "avg_pool2d",
           "concat", "stack", "take", "dropout", "gaussian_noise", "scan", "__version__"]


def __getattr__(name):
    """gc.tanhh: the error names the op meant (a model file's AttributeError is one line on the command line).
    A function of numpy's that gradc lacks (gc.tan, gc.log1p) is not matched to a near name of other maths."""
    hint = ""
    if name == "Trainer":
        hint = ": the Trainer is the compiled module's (mod = gc.compile(m); mod.Trainer(params, ...))"
    elif isinstance(getattr(np, name, None), np.ufunc):   # an elementwise function gradc lacks
        hint = f": write {name} as a sympy expression with gc.elementwise (README, the DSL)"
    elif not name.startswith("__"):
        close = difflib.get_close_matches(name, __all__, n=1, cutoff=0.75)
        hint = f": did you mean gc.{close[0]}?" if close else ""
    raise AttributeError(f"module 'gradc' has no attribute {name!r}{hint}")
