"""Source text both targets' Python entry points share (codegen/module.py, codegen/cuda_api.py)."""
import textwrap

INIT_PARAMS = textwrap.dedent('''\
    def init_params(seed=0):
        """Fresh parameters (dict name -> numpy array), drawn in PARAM_ORDER from numpy's default_rng(seed)."""
        return init_from(_INITS, PARAM_SHAPES, FLOAT, seed, DATA)
    ''')

HESSIAN = "\n".join([
    "def hessian(params, /, **inputs):",
    '    """The symmetric (P, P) Hessian of the objective (a numpy array); rows and columns are the trainable',
    '    params in PARAM_ORDER, each flattened in C order (GRAD_SLICES). Refuses when P*P does not fit in memory."""',
    '    _SIGNATURE.inputs(inputs, _HVP_INPUTS, "hessian")   # (errors named by what was called)',
    "    H = hessian_rows(params, 0, GRAD_SIZE, **inputs)",
    "    symmetrize(H)",
    "    return H"])

ORDER_1_STUBS = "\n".join([
    "def hvp(params, v, /, **inputs):",
    '    """Not in this build: it was compiled with --order 1."""',
    "    second_order_missing(MODEL_NAME)",
    "",
    "",
    "def hessian(params, /, **inputs):",
    '    """Not in this build: it was compiled with --order 1."""',
    "    second_order_missing(MODEL_NAME)",
    "",
    "",
    "def hessian_rows(params, start, stop, /, **inputs):",
    '    """Not in this build: it was compiled with --order 1."""',
    "    second_order_missing(MODEL_NAME)"]) + "\n"


def trainer_head(base):
    """The generated Trainer's first lines: the contract facts its base class reads."""
    return [f"class Trainer({base}):", f"    __doc__ = {base}.__doc__", "    signature = _SIGNATURE",
            "    fingerprint = FINGERPRINT", "    model_name = MODEL_NAME", "    param_order = PARAM_ORDER",
            "    loss_inputs = _LOSS_INPUTS", "    grad_slices = GRAD_SLICES", "    rows = _ROWS"]


def input_grads_source(g, input_grads, call_src, result, zeros):
    """`def input_grads`: call_src runs the entry (when some input has a gradient); result(name) and zeros(name) give what is
    returned for an input with and without a gradient (numpy on the CPU, a copy out on CUDA)."""
    float_inputs = [i for i, n in g.inputs.items() if g.dtype(n).startswith("float")]
    returned = ", ".join(f'"{i}": {result(i) if i in input_grads else zeros(i)}' for i in float_inputs)
    lines = ["def input_grads(params, /, **inputs):",
             '    """Gradients of the objective for the float inputs (dict)."""',
             "    p = _SIGNATURE.params(params)",
             # every float input, also one the objective does not read: its (zero) gradient takes its shape
             f'    a = _SIGNATURE.inputs(inputs, _LOSS_INPUTS + {tuple(float_inputs)!r}, "input_grads")']
    if input_grads:
        lines.append(f"    {', '.join('gi_' + i for i in input_grads)}{',' if len(input_grads) == 1 else ''} = {call_src}")
    lines.append(f"    return {{{returned}}}")
    return "\n".join(lines) + "\n"


def checked_call(checks, names, what, pipeline):
    """The lines of an entry point that check its arguments (`checks`, expressions whose values are `names`).
    In a pipeline build every rank learns whether any rank refused them (Pipeline.agree): one rank refusing a
    call alone would leave the others waiting in the stages' exchanges."""
    if not pipeline:
        return [f"    {name} = {check}" for name, check in zip(names, checks)]
    return [f"    {', '.join(names)} = _PIPELINE.agree({what!r}, lambda: (",
            *[f"        {check}," for check in checks], "    ))"]
