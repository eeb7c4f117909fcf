"""The Python text of lr_grad in a generated module (DESIGN.md §1.9); the graph is passes/likelihood_ratio.py's,
the argument work gradc/runtime/lr.py's."""
from .api_text import checked_call


def lr_info(g):
    """What the module's LikelihoodRatio needs to know (written into the module)."""
    lr = g.lr or {"why": "not built"}
    if lr.get("why"):
        return {"why": lr["why"], "tiled": {}, "masks": [], "per_row": False, "sites": []}
    return {"why": None, "tiled": dict(lr["tiled"]),
            "masks": [(s["mask"], s["rank"], s["per_copy"]) for s in lr["sites"]], "per_row": lr["per_row"],
            "sites": [f"{s['op']} at {s['src']}, pairs with: {s['pairs']}" for s in lr["sites"]]}


def lr_api_source(g, built, run_src, views_src, cuda=False, pipeline=False):
    """`lr_grad` and `_lr_into` (what Trainer(gradient="lr") calls). run_src: the compiled entry's call
    (None when the build has none); views_src: the gradient dict over the flat buffer `grads`. On CUDA
    the estimate goes into a device buffer, copied out as the caller's gradients. With `pipeline` (a
    --devices / --microbatches build) the estimate still runs whole: under mpiexec on every rank, with
    the params their owners hold, each rank keeping its own params' gradients, as loss_and_grad does."""
    lines = ["from gradc.runtime.lr import LikelihoodRatio, LRTrainer, SAMPLES as LR_SAMPLES, SIGMA as LR_SIGMA", "",
             f"_LR = LikelihoodRatio(MODEL_NAME, FLOAT, {lr_info(g)!r}, INPUTS)", "", "",
             "def lr_grad(params, /, *, samples=LR_SAMPLES, sigma=LR_SIGMA, seed=0, antithetic=True, layerwise=False,",
             "            baseline=True, **inputs):",
             '    """The objective and a likelihood-ratio estimate of its gradients, from forward passes only:',
             "    Gaussian noise of std sigma on every matmul and conv output (the pre-activations), the `samples`",
             "    perturbed copies stacked on the rows of one forward. antithetic: each draw used as eps and -eps",
             "    (samples even); layerwise: `samples` copies per noise site, each perturbing that site only;",
             "    baseline: subtract a baseline from each row's loss (with pairs the loss of two noise-free copies,",
             "    without them the leave-one-out mean). Weight decay is exact.",
             '    Returns (objective of the unperturbed forward, dict of estimated gradients)."""',
             *checked_call(["_LR.check(samples, sigma, seed, antithetic, layerwise, baseline)",
                            "_SIGNATURE.params(params)", '_SIGNATURE.inputs(inputs, _LOSS_INPUTS, "lr_grad")'],
                           ["options", "p", "a"], "lr_grad", pipeline)]
    estimate = ["    try:",
                "        loss = _lr_into(p, a, grads, *options)",
                "    except MemoryError as e:   # the copies' rows are what grows",
                '        if str(e).startswith(f"{MODEL_NAME}.lr_grad:"):   # _LR.leaves said it, naming samples',
                "            raise",
                '        raise MemoryError(f"{MODEL_NAME}.lr_grad: samples={samples} runs {_LR.copies(samples, layerwise)} '
                'perturbed copies of the batch at once, which do not fit in memory ({e}): give fewer samples") from None']
    if cuda:
        lines += ['    grads = _CUDA.buffer("lr_grads", (max(GRAD_SIZE, 1),))', *estimate,
                  "    grads = _CUDA.out(grads)"]
    else:
        lines += ["    grads = np.empty(GRAD_SIZE, FLOAT)", *estimate]
    owned = "_PIPELINE.owned({{\n        {}\n    }})" if pipeline else "{{\n        {}\n    }}"
    lines += [f"    return float(loss), {owned.format(views_src + ',')}" if views_src else "    return float(loss), {}",
              "", "",
              "def _lr_into(p, a, grads, samples, sigma, seed, antithetic, layerwise, baseline):",
              '    """The estimate into the flat buffer `grads` (laid out as GRAD_SLICES); the objective."""']
    from_owners = ["    p = _PIPELINE.params_from_owners(p)"] if pipeline else []
    keep_owned = ["    _PIPELINE.keep_owned(grads)"] if pipeline else []
    if built and cuda:
        lines += ["    a = _LR.leaves(a, samples, sigma, seed, antithetic, layerwise, baseline, adopt=_CUDA.adopt,",
                  "                  host=_CUDA.host)",
                  *from_owners, f"    (loss,) = {run_src}", *keep_owned,
                  '    return _loss_value(loss, a, "lr_grad")']
    elif built:
        lines += ["    a = _LR.leaves(a, samples, sigma, seed, antithetic, layerwise, baseline)",
                  *from_owners, f"    (loss,) = {run_src}", *keep_owned,
                  "    return loss"]
    else:
        lines += ["    _LR.refuse()"]
    return "\n".join(lines) + "\n"
