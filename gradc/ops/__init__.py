"""The op registry: one record per op.

A record holds everything the compiler knows about an op: its shape and dtype rule, its VJP
rule (which builds nodes of registered ops, so a backward graph can be differentiated again),
its cost, its numpy evaluation (the interpreter's reference) and, for elementwise ops, the sympy
expression that all of its derivatives are derived from.
"""
from dataclasses import dataclass, field
from typing import Callable, Optional

import sympy as sp


@dataclass(frozen=True)
class Op:
    name: str
    kind: str                 # leaf | elementwise | matmul | layout | reduce | nn
    infer: Callable           # (attrs, shapes, dtypes) -> (shape, dtype); raises ShapeError
    evaluate: Callable        # (attrs, values, out_shape) -> ndarray (numpy reference)
    flops: Callable           # (attrs, in_shapes, out_shape) -> int or sympy expression
    vjp: Optional[Callable] = None    # (ctx, node, g) -> one adjoint node or None per operand
    arity: Optional[int] = None       # None: any number of operands
    expr: Optional[sp.Expr] = None    # elementwise: over the operand symbols X[0..arity-1]
    doc: str = field(default="", compare=False)


REGISTRY = {}


def register(op):
    if op.name in REGISTRY and REGISTRY[op.name] != op:
        raise ValueError(f"op {op.name!r} is already registered with another definition")
    REGISTRY[op.name] = op
    return op


def get_op(name):
    try:
        return REGISTRY[name]
    except KeyError:
        from ..errors import GradcError
        raise GradcError(f"unknown op {name!r}") from None


from . import leaf, elementwise, layout, reduce, nn, conv, pool, index, concat, take, batch_matmul, random  # noqa: E402,F401  (registers the built-ins)
