"""The entry points of a generated module: one table that memory planning, codegen, the memplan
dump and the compile's warm-up all read (DESIGN.md §2).

Each row is one compiled function of the module: its name there, the public function that calls
it, the values it returns, and when a build has it. A new entry point (lr_grad, ...) is one row.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


@dataclass(frozen=True)
class Entry:
    fname: str                      # the compiled function in the module
    public: str                     # what a user calls (the memplan names plans by it)
    roots: Callable                 # graph -> the values it returns, None for a symbolic zero
    doc: str                        # the compiled function's docstring
    scalars: Callable = lambda g: []          # graph -> roots handed back as numbers
    flat: Optional[Callable] = None           # graph -> roots written into one flat `grads` buffer
    order: int = 1                            # built at --order >= order
    present: Callable = lambda g: True        # graph -> whether this build has it
    warm: str = "first"                       # compile's warm-up: "first" (default) or "second" (--warm all)
    tangent_rows: bool = False                # runs once per row of tangents V (what varies with them only)
    budgeted: bool = False                    # --memory-budget plans its retention (the training step)
    call: Callable = lambda mod, params, inputs: None   # how warm-up calls it through the public API


def _grads(g):
    return [g.grads[p] for p in g.grads]


def _lr_grads(g):
    return [g.lr_grads.get(p) for p in g.grads]


ENTRIES = (
    Entry("_forward", "forward", lambda g: list((g.forward_outputs or g.outputs).values()), "The declared outputs.",
          present=lambda g: bool(g.outputs),
          call=lambda mod, params, inputs: mod.OUTPUTS and mod.forward(
              params, **{k: v for k, v in inputs.items() if k in mod._OUTPUT_INPUTS})),
    Entry("_forward_loss", "forward_loss", lambda g: list(g.outputs.values()) + [g.objective],
          "The declared outputs and the objective.", scalars=lambda g: [g.objective],
          call=lambda mod, params, inputs: mod.forward(params, **inputs)),
    Entry("_loss_and_grad", "loss_and_grad", lambda g: [g.objective] + _grads(g),
          "The objective; the gradients of the trainable params go into `grads` (laid out as GRAD_SLICES).",
          scalars=lambda g: [g.objective], flat=_grads, budgeted=True,
          call=lambda mod, params, inputs: mod.loss_and_grad(params, **inputs)),
    Entry("_input_grads", "input_grads", lambda g: [v for v in g.input_grads.values() if v is not None],
          "Gradients of the objective for the float inputs.",
          present=lambda g: any(v is not None for v in g.input_grads.values()),
          call=lambda mod, params, inputs: mod.input_grads(params, **inputs)),
    Entry("_hvp_block", "hvp", lambda g: [g.hvps[p] for p in g.grads],
          "Hessian-vector products: OUT[r] = H V[r] for each row of V (rows laid out as GRAD_SLICES).",
          flat=lambda g: [g.hvps[p] for p in g.grads], order=2, warm="second",
          tangent_rows=True,   # hvp and hessian share their kernels: one call warms both
          call=lambda mod, params, inputs: mod.hvp(params, {k: np.ones_like(params[k]) for k in mod.TRAINABLE}, **inputs)),
    # passes/likelihood_ratio.py: a forward-only graph, its K noised copies stacked on the rows (DESIGN.md §1.9)
    Entry("_lr_grad", "lr_grad", lambda g: [g.objective] + _lr_grads(g),
          "The objective of the unperturbed forward; the likelihood-ratio estimate of the gradients goes into `grads` "
          "(laid out as GRAD_SLICES), from K noised copies of the forward stacked on the rows.",
          scalars=lambda g: [g.objective], flat=_lr_grads, warm="second",
          present=lambda g: bool(g.lr) and g.lr.get("why") is None,
          # a model lr_grad refuses (it says why when called) has nothing to warm
          call=lambda mod, params, inputs: not mod._LR.info.get("why") and mod.lr_grad(params, samples=2, **inputs)),
)


def entries(graph, order):
    """The rows a build of `graph` at `order` has."""
    return [e for e in ENTRIES if e.order <= order and e.present(graph)]


def by_fname(fname):
    return next(e for e in ENTRIES if e.fname == fname)
