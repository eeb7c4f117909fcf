"""Leaves: the values a graph starts from."""
import numpy as np

from . import Op, register


def _leaf_infer(attrs, shapes, dtypes):
    return tuple(attrs["shape"]), attrs["dtype"]


def _no_evaluate(attrs, values, out_shape, dims):
    raise RuntimeError("inputs and params are bound by the caller")


def _zero_flops(attrs, in_shapes, out_shape):
    return 0


register(Op("input", "leaf", _leaf_infer, _no_evaluate, _zero_flops, arity=0, doc="a value the caller passes"))
register(Op("param", "leaf", _leaf_infer, _no_evaluate, _zero_flops, arity=0, doc="a trained (or frozen) weight"))
register(Op("const", "leaf", _leaf_infer, lambda attrs, values, out_shape, dims: np.asarray(attrs["value"]),
            _zero_flops, arity=0, doc="a python scalar or numpy array in the model"))
