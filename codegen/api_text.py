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
    "    second_order_missing(MODEL_NAME)"]) + "\n"


def trainer_head(base):
    """The generated Trainer's first lines: the contract facts its base class reads."""
    return [f"class Trainer({base}):", f"    __doc__ = {base}.__doc__", "    signature = _SIGNATURE",
            "    fingerprint = FINGERPRINT", "    model_name = MODEL_NAME", "    param_order = PARAM_ORDER",
            "    loss_inputs = _LOSS_INPUTS", "    grad_slices = GRAD_SLICES"]
