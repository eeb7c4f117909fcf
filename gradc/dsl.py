"""The DSL: `Model` declares inputs, params, outputs and the loss; `Tensor` records ops.

Every call adds a node to the model's graph at once, so shape errors are raised on the
user's own line, and every node keeps that `file:line`.
"""
import contextlib
import difflib
import keyword
import numbers
import sys
import weakref

import numpy as np

from .errors import GradcError, ShapeError, src_of, user_src, user_warning
from .ir import FLOAT_DTYPES, INT_DTYPES, Graph
from .ops import get_op
from .ops.elementwise import ElementwiseDefinitionError, define_user_op
from .shapes import broadcast, check_shape, fmt, normalize_axes

INITS = ("zeros", "ones", "normal", "uniform", "glorot_uniform", "he_normal")
RESERVED_OUTPUTS = ("loss",)   # forward() reports the objective under this key


def _check_name(what, name, src):
    if not isinstance(name, str) or not name.isidentifier():
        raise GradcError(f"{what} name {name!r} is not a Python identifier", src)
    if keyword.iskeyword(name):
        raise GradcError(f"{what} name {name!r} is a Python keyword: pick another name", src)


class Model:
    def __init__(self, name):
        src = user_src()
        _check_name("model", name, src)
        self.name = name
        self.src = src
        self.graph = Graph(name)
        self.param_info = {}       # name -> {"init", "decay", "trainable"}
        self.weight_decay = 0.0
        self.loss_tensor = None
        self._minimize_src = None

    def __repr__(self):
        return f"<gradc.Model {self.name!r}: {len(self.graph.inputs)} inputs, {len(self.graph.params)} params>"

    # ---- declarations --------------------------------------------------------------------
    def _claim(self, what, name, src):
        _check_name(what, name, src)
        if name in self.graph.inputs or name in self.graph.params:
            raise GradcError(f"duplicate name {name!r}: already an input or param of model {self.name!r}", src)

    def input(self, name, shape, dtype=None, **unknown):
        _refuse_keywords("input", unknown, ("dtype",))
        src = user_src()
        self._claim("input", name, src)
        shape = _shape_or_fail("input", shape, src)
        if dtype is not None and dtype not in FLOAT_DTYPES + INT_DTYPES:
            raise GradcError(f"input {name!r}: unknown dtype {dtype!r} (use None, {', '.join(FLOAT_DTYPES + INT_DTYPES)})", src)
        n = self.graph.apply("input", attrs={"shape": shape, "dtype": dtype or "float"}, src=src, name=name)
        self.graph.inputs[name] = n
        return Tensor(self, n)

    def param(self, name, shape, init=None, decay=None, trainable=True, **unknown):
        _refuse_keywords("param", unknown, ("init", "decay", "trainable"))
        src = user_src()
        self._claim("param", name, src)
        shape = _shape_or_fail("param", shape, src)
        if any(isinstance(d, str) for d in shape):
            raise GradcError(f"param {name!r}: shape {fmt(shape)} has a symbolic dim; params need int dims", src)
        if 0 in shape:   # (trial S: it compiled, and the loss was nan with no word of why)
            raise GradcError(f"param {name!r}: shape {fmt(shape)} holds no element (a dim of 0); a param needs at "
                             f"least one", src)
        if init is None:
            init = "glorot_uniform" if len(shape) >= 2 else "zeros"
        if isinstance(init, np.ndarray):
            if init.shape != shape:
                raise GradcError(f"param {name!r}: init array has shape {init.shape}, expected {fmt(shape)}", src)
            if init.dtype.kind not in "biuf":
                raise GradcError(f"param {name!r}: init array has dtype {init.dtype}, expected a number type", src)
            init = np.array(init, dtype=np.float64)
        elif init not in INITS:
            raise GradcError(f"param {name!r}: unknown init {init!r} (use one of {', '.join(INITS)} or an ndarray)", src)
        if decay is not None and not isinstance(decay, bool):
            raise GradcError(f"param {name!r}: decay must be None, True or False, not {decay!r}", src)
        trainable = _flag(f"param {name!r}", "trainable", trainable, src)
        n = self.graph.apply("param", attrs={"shape": shape, "dtype": "float"}, src=src, name=name)
        self.graph.params[name] = n
        self.param_info[name] = {"init": init, "decay": len(shape) >= 2 if decay is None else decay,
                                 "trainable": trainable}
        return Tensor(self, n)

    def output(self, name, tensor):
        src = user_src()
        _check_name("output", name, src)
        if name in self.graph.outputs or name in RESERVED_OUTPUTS:
            raise GradcError(f"duplicate output name {name!r}" + (" (reserved for the objective)" if name in RESERVED_OUTPUTS else ""), src)
        if not isinstance(tensor, Tensor):   # (a number or array here is a slip: the output would never change)
            raise GradcError(f"output {name!r}: got a {type(tensor).__name__}, not a Tensor of the model (an output "
                             f"is a value the model computes from its inputs and params)", src)
        self.graph.outputs[name] = self._node(tensor, "output", src)

    def minimize(self, loss, weight_decay=0.0, **unknown):
        _refuse_keywords("minimize", unknown, ("weight_decay",))
        src = user_src()
        if self.loss_tensor is not None:
            raise GradcError(f"minimize() was already called for model {self.name!r} at {self._minimize_src}", src)
        n = self._node(loss, "minimize", src)
        if self.graph.shape(n) != ():
            raise GradcError(f"minimize: the loss must be a scalar, got shape {fmt(self.graph.shape(n))} "
                             f"(reduce it with .sum() or .mean())", src)
        if not self.graph.dtype(n).startswith("float"):
            raise GradcError(f"minimize: the loss must be a float, got {self.graph.dtype(n)}", src)
        if not isinstance(weight_decay, numbers.Real) or isinstance(weight_decay, bool) or not weight_decay >= 0:
            raise GradcError(f"minimize: weight_decay must be a number >= 0, got {weight_decay!r}", src)
        self.loss_tensor = Tensor(self, n)
        self.weight_decay = float(weight_decay)
        self._minimize_src = src
        self.graph.loss = n

    def stage(self, index):
        """Pin the ops made inside the block to pipeline stage `index` (--devices K); a param lives with
        the first op that reads it."""
        src = user_src()   # (checked here, not in the block's generator: there the caller is contextlib)
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or index < 0:
            raise GradcError(f"stage: the stage index must be an int >= 0, got {index!r}", src)
        return self._pinned(int(index), src)

    @contextlib.contextmanager
    def _pinned(self, index, src):
        outer = self.graph.pin
        self.graph.pin = (index, src)
        try:
            yield
        finally:
            self.graph.pin = outer

    # ---- building nodes -----------------------------------------------------------------
    def _node(self, value, op, src):
        """The node of a Tensor of this model, or a new const node for a number or array."""
        if isinstance(value, Tensor):
            if value.model is not self:
                raise GradcError(f"{op}: {value.model.graph.describe(value.node)} is a tensor of model "
                                 f"{value.model.name!r}, used in model {self.name!r}: a model's ops take its own "
                                 f"tensors, numbers and arrays", src)
            return value.node
        if isinstance(value, (bool, np.bool_)):
            raise GradcError(f"{op}: a bool ({value}) is not a tensor value: for a flag, branch in Python or write "
                             f"1.0 or 0.0 (t == u is a bool too: it compares the Tensor objects; a mask is a "
                             f"gc.elementwise op with a sympy Piecewise or Heaviside: README, user ops)", src)
        if isinstance(value, numbers.Real):
            return self.graph.apply("const", attrs={"value": float(value), "shape": (), "dtype": "float"}, src=src)
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "biuf":
                raise GradcError(f"{op}: constant array of dtype {value.dtype} is not numeric", src)
            return self.graph.apply("const", attrs={"value": np.array(value, dtype=np.float64),
                                                    "shape": value.shape, "dtype": "float"}, src=src)
        hint = ""
        if isinstance(value, (tuple, list)) and _TRACING:   # (trial Q: gc.scan(step, [h0], x))
            hint = ("; in a gc.scan step, a carry (or x_t) given as a tuple or list comes in as a tuple: unpack it "
                    "(`(h,) = carry`), or give one Tensor")
        raise GradcError(f"{op}: cannot use a {type(value).__name__} as a tensor{hint}", src)

    def _apply(self, op, operands, src, **attrs):
        nodes = [self._node(v, op, src) for v in operands]
        n = self.graph.apply(op, nodes, attrs, src=src)
        _warn_of_a_table(self.graph, op, nodes, n)
        return Tensor(self, n)


def _warn_of_a_table(graph, op, nodes, n):
    """Warn where numpy's rule lines up operands of different ranks so that a dim (symbolic, or an int
    above 1) meets a 1 that is not the user's new axis (a matmul's (B, 1), a keepdims sum, a param
    declared (N, 1)) and the result holds that dim more often than any operand: (B, 1) - (B,) is (B, B),
    most often meant as (B,); so is (64, 1) - (64,). A 1 the user put there (x[:, None], a reshape) is
    meant: x[:, None] - x is a table of pairs."""
    shapes = [graph.shape(u) for u in nodes]
    if get_op(op).kind != "elementwise" or len({len(s) for s in shapes}) < 2:
        return
    out = graph.shape(n)
    grown = {d for d in out if (isinstance(d, str) or d > 1) and all(out.count(d) > s.count(d) for s in shapes)}
    met = sorted({out[axis] for axis in range(len(out)) if out[axis] in grown for u, s in zip(nodes, shapes)
                  if axis >= len(out) - len(s) and s[axis - len(out) + len(s)] == 1 and not _new_axes(graph, u)},
                 key=str)
    if met:
        user_warning(f"{op}: {' and '.join(fmt(s) for s in shapes)} broadcast to {fmt(out)} (numpy's rule lines "
                     f"them up from the right), which holds {', '.join(map(str, met))} on more axes than an operand: if one "
                     f"value per row was meant, reshape an operand to the other's rank (y[:, None]); if the table "
                     f"is meant, say so with a new axis (y[None, :]) and this warning goes")


def _caller_of_scipy_sparse():
    """'file:line' of the code that called scipy.sparse where it is on the stack (a sparse matrix's operator
    asked numpy for a Tensor's values), else None."""
    frame, seen = sys._getframe(1), False
    while frame is not None:
        inside = (frame.f_globals.get("__name__") or "").startswith("scipy.sparse")
        if seen and not inside:
            return src_of(frame)
        seen |= inside
        frame = frame.f_back
    return None


def _new_axes(graph, u):
    """Whether u's 1s are the user's: u a reshape (x[:, None]), or an elementwise op whose operands of its
    shape all have them (gc.exp(x[:, None]) * 2.0). (A loop, not recursion: a chain may be long.)"""
    known = _NEW_AXES.setdefault(graph, {})   # (a node's operands never change: each answer holds)
    stack, seen = [u], set()
    while stack:
        v = stack.pop()
        if v in seen or graph.op(v) == "reshape" or known.get(v):
            continue
        seen.add(v)
        same = [w for w in graph.operands(v) if graph.shape(w) == graph.shape(v)]
        if known.get(v) is False or get_op(graph.op(v)).kind != "elementwise" or not same:
            known[u] = False
            return False
        stack.extend(same)
    known.update(dict.fromkeys(seen, True))
    return True


_NEW_AXES = weakref.WeakKeyDictionary()   # graph -> {node: whether its 1s are the user's}


def _shape_or_fail(what, shape, src):
    try:
        return check_shape(shape)
    except ShapeError as e:
        raise GradcError(f"{what}: {e}", src) from None


def _model_of(op, values, src):
    """The model the op is recorded in: inside a scan's step, the step's body (the innermost model
    among the operands); values of the models around it are captured there as closed-over values."""
    found = None
    for v in values:
        if isinstance(v, Tensor) and (found is None or _depth(v.model) > _depth(found)):
            found = v.model
    if found is None:
        raise GradcError(f"{op}: needs at least one gradc Tensor operand", src)
    return found


def _depth(model):
    d = 0
    while getattr(model, "parent", None) is not None:
        model, d = model.parent, d + 1
    return d


def _op(op, *operands, src=None, **attrs):
    src = src or user_src()
    return _model_of(op, operands, src)._apply(op, operands, src, **attrs)


def _axes(op, x, axis, src):
    try:
        return normalize_axes(axis, len(x.shape))
    except ShapeError as e:
        raise GradcError(f"{op}: {e} (operand shape {fmt(x.shape)})", src) from None


# numpy's ufuncs for a Tensor's operators, and gradc's names for numpy's functions
_NUMPY_OPERATORS = {np.add: "add", np.subtract: "sub", np.multiply: "mul", np.true_divide: "div", np.power: "pow",
                    np.maximum: "maximum", np.matmul: "matmul"}
_NUMPY_NAMES = {"absolute": "abs"}
# what to write instead of numpy's functions (not ufuncs) that have no gc function of their name
_NUMPY_FUNCTIONS = {"dot": "a @ b", "concatenate": "gc.concat(...)", "amax": "gc.max(...)",
                    "where": "a gc.elementwise op with a sympy Piecewise (README, user ops)",
                    "clip": "a gc.elementwise op with sympy's Max and Min (README, user ops)",
                    "squeeze": "t.reshape(...)", "expand_dims": "t.reshape(...) or t[:, None]"}
# (one message for every comparison: Python runs `0 < t` as t > 0, numpy's scalars as np.less)
_COMPARISON = ("comparisons of Tensors (<, <=, >, >=) are not ops of the model: for a mask or a select write a "
               "gc.elementwise op with a sympy Piecewise or Heaviside (README, user ops); for the larger of two, "
               "gc.maximum(a, b)")
_NUMPY_COMPARISONS = (np.less, np.less_equal, np.greater, np.greater_equal)
_IN_PLACE = {np.add: "+", np.subtract: "-", np.multiply: "*", np.true_divide: "/", np.power: "**", np.matmul: "@"}


class TorchSpelling(GradcError, AttributeError):
    """A PyTorch method name on a Tensor: the error says gradc's spelling; hasattr() still answers False."""


_TORCH_METHODS = {"transpose": "gc.transpose(x, axes), every axis in its new place (x.T reverses them all)",
                  "permute": "gc.transpose(x, axes)",
                  "view": "x.reshape(shape)", "flatten": 'x.reshape(("B", -1))', "squeeze": "x.reshape(shape)",
                  "unsqueeze": "x[:, None] (None indexes a new axis)",
                  "exp": "gc.exp(x)", "log": "gc.log(x)", "tanh": "gc.tanh(x)", "sigmoid": "gc.sigmoid(x)",
                  "relu": "gc.relu(x)", "sqrt": "gc.sqrt(x)", "abs": "abs(x) or gc.abs(x)", "pow": "x ** p",
                  "matmul": "x @ y", "mm": "x @ y", "softmax": "gc.softmax(x, axis)",
                  "amax": "x.max(axis, keepdims)", "clamp": "gc.maximum(x, lo), and -gc.maximum(-x, -hi) for a top"}   # (not size or dim: libraries probe those)
_TORCH_KEYWORDS = {"keepdim": "keepdims", "dim": "axis"}


def _refuse_keywords(op, given, known):
    """A keyword the call does not take, at the user's line: PyTorch's name for one gradc takes (keepdim=),
    or the nearest it takes (m.minimize(weightdecay=): trial Y had Python's bare TypeError)."""
    for k in given:
        if k in _TORCH_KEYWORDS and _TORCH_KEYWORDS[k] in known:
            hint = f": write {_TORCH_KEYWORDS[k]}= (numpy's keywords)"
        else:
            close = difflib.get_close_matches(k, known, n=1)
            hint = f": did you mean {close[0]!r}?" if close else f" (it takes {', '.join(known)})"
        raise GradcError(f"{op}() got an unexpected keyword {k!r}{hint}", user_src())


class Tensor:
    """A value in a model's graph. Arithmetic records ops; numpy arrays and numbers are constants."""
    __slots__ = ("model", "node")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """numpy's operators between an array (or numpy number) and a Tensor record the op, as the Tensor's
        own operators do; any other ufunc (np.exp(t)) is refused naming gradc's op."""
        src = user_src()
        if method == "__call__" and not kwargs and len(inputs) == 2 and ufunc in _NUMPY_OPERATORS:
            if ufunc is np.matmul:
                return matmul(*inputs, src=src)
            return _op(_NUMPY_OPERATORS[ufunc], *inputs, src=src)
        if "out" in kwargs and ufunc in _NUMPY_OPERATORS:   # a += t: the Tensor cannot go into a's memory
            symbol = _IN_PLACE.get(ufunc)
            instead = f"a = a {symbol} t" if symbol else f"a = np.{ufunc.__name__}(a, t)"
            raise GradcError(f"numpy's {ufunc.__name__} into an array ({f'a {symbol}= t' if symbol else 'out='}) "
                             f"cannot hold a gradc Tensor: write {instead}", src)
        if ufunc in _NUMPY_COMPARISONS:   # np.float32(0.5) < t
            raise GradcError(_COMPARISON, src)
        name = _NUMPY_NAMES.get(ufunc.__name__, ufunc.__name__)
        use = f"gc.{name}(...)" if callable(globals().get(name)) else "gradc's ops (README, the DSL)"
        raise GradcError(f"numpy's {ufunc.__name__} cannot take a gradc Tensor: use {use}", src)

    def __array_function__(self, func, types, args, kwargs):
        """numpy's other functions (np.sum(t), np.stack([t, u])) are refused, naming what gradc has instead."""
        name = func.__name__
        use = _NUMPY_FUNCTIONS.get(name) or (f"gc.{name}(...)" if callable(globals().get(name)) else
                                             "gradc's ops (README, the DSL)")
        where = "np" + func.__module__[len("numpy"):] if func.__module__.startswith("numpy") else func.__module__
        raise GradcError(f"numpy's {where}.{name} cannot take a gradc Tensor: use {use}", user_src())

    def __float__(self):   # (trial V: math.exp(t) said only "must be real number, not Tensor")
        raise GradcError("a Tensor has no value while the model is being built: Python's math functions and float() "
                         "need a number; use gradc's ops (gc.exp, gc.log, gc.sqrt, ...; README, the DSL)", user_src())

    def __array__(self, dtype=None, copy=None):
        sparse_caller = _caller_of_scipy_sparse()   # (trial U: `csr @ t` named scipy's line, never said sparse)
        if sparse_caller:
            raise GradcError("a scipy sparse matrix cannot take a gradc Tensor: gradc's constants are dense arrays; "
                             "write A.toarray() @ t, or make the matrix an input of the model", sparse_caller)
        raise GradcError("a Tensor has no values while the model is being built: numpy cannot make an array of it "
                         "(np.asarray(t), np.array([t, u])); use gradc's ops (README, the DSL)", user_src())

    def __init__(self, model, node):
        self.model = model
        self.node = node

    @property
    def shape(self):
        self._check_usable()
        return self.model.graph.shape(self.node)

    @property
    def dtype(self):
        self._check_usable()
        return self.model.graph.dtype(self.node)

    def _check_usable(self):
        """A value of a scan's step that the scan did not return is gone once the step is traced:
        reading it (its shape, by any op) names the user's line, not a KeyError."""
        check = getattr(self.model, "_check_open", None)
        if check is not None:
            check(None, user_src())

    @property
    def ndim(self):
        return len(self.shape)

    def __repr__(self):
        g = self.model.graph
        return f"<Tensor {g.describe(self.node)} {fmt(self.shape)} {self.dtype}>"

    def __bool__(self):
        raise GradcError("a Tensor has no truth value while the model is being built", user_src())

    # (== and != keep Python's identity: graphs, sets and `in` compare Tensors as objects)
    def __lt__(self, o): raise GradcError(_COMPARISON, user_src())
    def __le__(self, o): raise GradcError(_COMPARISON, user_src())
    def __gt__(self, o): raise GradcError(_COMPARISON, user_src())
    def __ge__(self, o): raise GradcError(_COMPARISON, user_src())

    def __add__(self, o): return _op("add", self, o)
    def __radd__(self, o): return _op("add", o, self)
    def __sub__(self, o): return _op("sub", self, o)
    def __rsub__(self, o): return _op("sub", o, self)
    def __mul__(self, o): return _op("mul", self, o)
    def __rmul__(self, o): return _op("mul", o, self)
    def __truediv__(self, o): return _op("div", self, o)
    def __rtruediv__(self, o): return _op("div", o, self)
    def __pow__(self, o): return _op("pow", self, o)
    def __rpow__(self, o): return _op("pow", o, self)
    def __neg__(self): return _op("neg", self)
    def __abs__(self): return _op("abs", self)
    def __matmul__(self, o): return matmul(self, o, src=user_src())
    def __rmatmul__(self, o): return matmul(o, self, src=user_src())

    @property
    def T(self):
        return transpose(self, src=user_src())

    def sum(self, axis=None, keepdims=False, **torch_style):
        _refuse_keywords("sum", torch_style, ("axis", "keepdims"))
        return sum(self, axis, keepdims, src=user_src())

    def mean(self, axis=None, keepdims=False, **torch_style):
        _refuse_keywords("mean", torch_style, ("axis", "keepdims"))
        return mean(self, axis, keepdims, src=user_src())

    def max(self, axis=None, keepdims=False, **torch_style):
        _refuse_keywords("max", torch_style, ("axis", "keepdims"))
        return max(self, axis, keepdims, src=user_src())

    def __getattr__(self, name):
        """PyTorch's spellings say gradc's (trial X: x.transpose(...) was a bare AttributeError)."""
        if name in _TORCH_METHODS:
            raise TorchSpelling(f"a Tensor has no .{name} (PyTorch's): write {_TORCH_METHODS[name]}", user_src())
        raise AttributeError(f"'Tensor' object has no attribute {name!r}")

    def reshape(self, *shape):
        return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape,
                       src=user_src())

    def __getitem__(self, key):
        return _getitem(self, key, user_src())

    def __iter__(self):
        raise GradcError("a Tensor is not iterable while the model is being built (index it: x[i])", user_src())


# ---- functions ---------------------------------------------------------------------------
def _unary(name):
    def f(x, *more):
        if more:   # (gc.log(x, 2): math.log's base is not an operand)
            hint = ": for a log to base b write gc.log(x) / math.log(b)" if name == "log" else ""
            raise GradcError(f"{name} takes one operand, got {1 + len(more)}{hint}", user_src())
        return _op(name, x)
    f.__name__ = f.__qualname__ = name   # (Python names a bad call by its qualname)
    f.__doc__ = f"Elementwise {name}; derivatives by sympy."
    return f


exp, log, tanh, sigmoid, relu, softplus, gelu, sin, cos, sqrt, square, abs = (
    _unary(n) for n in ("exp", "log", "tanh", "sigmoid", "relu", "softplus", "gelu", "sin", "cos",
                        "sqrt", "square", "abs"))


def maximum(a, b):
    """Elementwise max; a tie splits the gradient evenly."""
    return _op("maximum", a, b)


def matmul(a, b, src=None):
    """numpy's matmul: rank-1 operands are promoted and squeezed back; operands of rank >= 3 batch over
    their leading dims, which broadcast as in numpy (a symbolic dim matches only itself)."""
    src = src or user_src()
    model = _model_of("matmul", (a, b), src)
    a, b = (v if isinstance(v, Tensor) else Tensor(model, model._node(v, "matmul", src)) for v in (a, b))
    if a.ndim == 0 or b.ndim == 0:
        raise GradcError(f"matmul: operands must have rank >= 1, got {fmt(a.shape)} @ {fmt(b.shape)} "
                         f"(multiply by a scalar with *)", src)
    k_a, k_b = a.shape[-1], b.shape[0] if b.ndim == 1 else b.shape[-2]
    if k_a != k_b:   # named as the graph's shape errors name operands (a layer loop's shapes alone don't say which)
        operands = ", ".join(f"{t.model.graph.describe(t.node)} {fmt(t.shape)} {t.dtype}" for t in (a, b))
        raise GradcError(f"matmul: inner dims differ: {fmt(a.shape)} @ {fmt(b.shape)} ({k_a} != {k_b}) "
                         f"(operands: {operands})", src)
    a2 = a if a.ndim >= 2 else reshape(a, (1, a.shape[0]), src=src)
    b2 = b if b.ndim >= 2 else reshape(b, (b.shape[0], 1), src=src)
    if a2.ndim == 2 and b2.ndim == 2:
        out = model._apply("matmul", (a2, b2), src, transpose_a=False, transpose_b=False)
        final = a.shape[:-1] + b.shape[1:]
    else:
        try:
            batch = broadcast(a2.shape[:-2], b2.shape[:-2])
        except ShapeError:
            raise GradcError(f"matmul: batch dims {fmt(a2.shape[:-2])} and {fmt(b2.shape[:-2])} do not broadcast "
                             f"({fmt(a.shape)} @ {fmt(b.shape)})", src) from None
        out = model._apply("batch_matmul", (a2, b2), src, transpose_a=False, transpose_b=False, reduce_batch=False)
        final = batch + (a.shape[-2:-1] if a.ndim >= 2 else ()) + (b.shape[-1:] if b.ndim >= 2 else ())
    return out if final == out.shape else reshape(out, final, src=src)


def transpose(x, axes=None, src=None):
    src = src or user_src()
    rank = len(x.shape)
    axes = tuple(reversed(range(rank))) if axes is None else tuple(axes)
    if sorted(a % rank if isinstance(a, int) and -rank <= a < rank else a for a in axes) != list(range(rank)):
        raise GradcError(f"transpose: axes {axes} are not a permutation of the {rank} axes of {fmt(x.shape)}", src)
    return _op("transpose", x, src=src, axes=tuple(a % rank for a in axes))


def reshape(x, shape, src=None):
    src = src or user_src()
    if isinstance(shape, (int, str)):
        shape = (shape,)
    return _op("reshape", x, src=src, shape=tuple(shape))


def _flag(op, name, value, src):
    """A True/False option as a bool: a str such as "False" is refused (it is true), not taken."""
    if not isinstance(value, (bool, np.bool_)):
        raise GradcError(f"{op}: {name} must be True or False, got {value!r}", src)
    return bool(value)


def _reduction(name):
    def f(x, axis=None, keepdims=False, src=None):
        src = src or user_src()
        if not isinstance(x, Tensor):
            raise GradcError(f"{name}: needs a gradc Tensor", src)
        return _op(name, x, src=src, axes=_axes(name, x, axis, src), keepdims=_flag(name, "keepdims", keepdims, src))
    f.__name__ = f.__qualname__ = name   # (Python names a bad call by its qualname)
    return f


sum, mean, max = _reduction("sum"), _reduction("mean"), _reduction("max")


def _axis_op(name):
    def f(x, axis=-1, **torch_style):
        _refuse_keywords(name, torch_style, ("axis",))
        src = user_src()
        if not isinstance(x, Tensor):
            raise GradcError(f"{name}: needs a gradc Tensor", src)
        if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
            raise GradcError(f"{name}: axis must be one int (the axis it normalises over), got {axis!r}", src)
        (a,) = _axes(name, x, axis, src)
        return _op(name, x, src=src, axis=a)
    f.__name__ = f.__qualname__ = name   # (Python names a bad call by its qualname)
    return f


softmax, log_softmax = _axis_op("softmax"), _axis_op("log_softmax")


def softmax_cross_entropy(logits, labels):
    """Mean over rows of -log softmax(logits)[row, label]: logits (N, C) and int labels (N,), or a
    sequence's logits (T, B, C) (any rank, classes last) and labels (T, B), averaged over every row."""
    src = user_src()
    if not isinstance(logits, Tensor) or not isinstance(labels, Tensor):
        raise GradcError("softmax_cross_entropy: logits and labels must be gradc Tensors", src)
    if logits.ndim < 2 or labels.ndim != logits.ndim - 1:
        hint = ("; labels are int class indices (an int input), one per row: for soft or one-hot targets write "
                "-(targets * gc.log_softmax(logits, axis=-1)).sum(axis=-1).mean()"
                if labels.ndim == logits.ndim and not labels.dtype.startswith("int") else "")
        raise GradcError(f"softmax_cross_entropy: needs logits (N, C) and labels (N,), or (..., C) and (...), got "
                         f"{fmt(logits.shape)} and {fmt(labels.shape)}{hint}", src)
    if not labels.dtype.startswith("int"):
        raise GradcError(f"softmax_cross_entropy: labels must be an int input, got dtype {labels.dtype}", src)
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise GradcError(f"softmax_cross_entropy: logits {fmt(logits.shape)} need labels of shape "
                         f"{fmt(logits.shape[:-1])}, got {fmt(labels.shape)}", src)
    if logits.ndim == 2:
        rows = _op("softmax_xent", logits, labels, src=src)   # one fused kernel each way
    else:   # the fused kernels take (N, C); a (T, B) of rows cannot be seen as T * B of them while T and B are symbols
        log_p = _op("log_softmax", logits, src=src, axis=logits.ndim - 1)
        rows = _op("neg", _op("pick", log_p, labels, src=src), src=src)
    return _op("mean", rows, src=src, axes=tuple(range(labels.ndim)), keepdims=False)


def mse(pred, target):
    """Mean over all elements of (pred - target)**2; shapes must match exactly."""
    src = user_src()
    model = _model_of("mse", (pred, target), src)
    shapes = [v.shape if isinstance(v, Tensor) else np.shape(v) for v in (pred, target)]
    if tuple(shapes[0]) != tuple(shapes[1]):
        raise GradcError(f"mse: pred {fmt(shapes[0])} and target {fmt(shapes[1])} must have the same shape", src)
    for what, v in (("pred", pred), ("target", target)):   # (trial S: the error named the `sub` inside)
        if isinstance(v, Tensor) and not v.dtype.startswith("float"):   # (a constant becomes a float one)
            raise GradcError(f"mse: {what} {fmt(shapes[0])} has dtype {v.dtype}; mse takes float values (declare "
                             f"the input with dtype float, the default: gradc never casts)", src)
    diff = model._apply("sub", (pred, target), src)
    sq = model._apply("square", (diff,), src)
    return model._apply("mean", (sq,), src, axes=tuple(range(len(shapes[0]))), keepdims=False)


# ---- convolution and pooling (NCHW; PyTorch's arithmetic and layouts) --------------------------
def _pair(op, what, value, src, minimum):
    """An int or a pair of ints, each >= minimum, as a pair."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < minimum
                             for v in pair):
        raise GradcError(f"{op}: {what} must be an int >= {minimum} or a pair of them, got {value!r}", src)
    return tuple(int(v) for v in pair)


def _image(op, x, src):
    if not isinstance(x, Tensor):
        raise GradcError(f"{op}: the input must be a gradc Tensor (N, C, H, W), got a {type(x).__name__}", src)
    if x.ndim != 4:
        raise GradcError(f"{op}: the input must have rank 4 (N, C, H, W), got {fmt(x.shape)}", src)
    return x.model


def conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """PyTorch's conv2d: x (N, C, H, W), w (O, C/groups, kh, kw), bias (O,) or None -> (N, O, Ho, Wo).
    stride, padding and dilation take an int or a pair."""
    src = user_src()
    model = _image("conv2d", x, src)
    attrs = {"stride": _pair("conv2d", "stride", stride, src, 1),
             "padding": _pair("conv2d", "padding", padding, src, 0),
             "dilation": _pair("conv2d", "dilation", dilation, src, 1)}
    if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, numbers.Integral) or groups < 1:
        raise GradcError(f"conv2d: groups must be an int >= 1, got {groups!r}", src)
    y = model._apply("conv2d", (x, w), src, groups=int(groups), **attrs)
    if bias is None:
        return y
    b = bias if isinstance(bias, Tensor) else Tensor(model, model._node(bias, "conv2d", src))
    out_channels = y.shape[1]
    if b.shape != (out_channels,):
        raise GradcError(f"conv2d: bias must have shape ({out_channels},) for the weight's {out_channels} output "
                         f"channels, got {fmt(b.shape)}", src)
    return model._apply("add", (y, reshape(b, (out_channels, 1, 1), src=src)), src)


def _pool(name):
    def f(x, kernel_size, stride=None, padding=0):
        src = user_src()
        model = _image(name, x, src)
        kernel = _pair(name, "kernel_size", kernel_size, src, 1)
        attrs = {"kernel": kernel, "stride": kernel if stride is None else _pair(name, "stride", stride, src, 1),
                 "padding": _pair(name, "padding", padding, src, 0)}
        return model._apply(name, (x,), src, **attrs)
    f.__name__ = f.__qualname__ = name   # (Python names a bad call by its qualname)
    return f


max_pool2d, avg_pool2d = _pool("max_pool2d"), _pool("avg_pool2d")
max_pool2d.__doc__ = ("PyTorch's max_pool2d(x, kernel_size, stride=None, padding=0): stride None is kernel_size; "
                      "padding never wins; the gradient goes to each window's first maximum.")
avg_pool2d.__doc__ = ("PyTorch's avg_pool2d(x, kernel_size, stride=None, padding=0): padding counts as zeros "
                      "(count_include_pad), the divisor is kh * kw.")


def elementwise(name, fn):
    """A user elementwise op: fn maps sympy symbols (one per operand) to a sympy expression.

    Its first and second derivatives come from sympy; the returned function applies the op.
    """
    src = user_src()
    try:
        record = define_user_op(name, fn)
    except ElementwiseDefinitionError as e:
        raise GradcError(str(e), src) from None

    def apply(*operands):
        call_src = user_src()
        if len(operands) != record.arity:
            raise GradcError(f"{name}: takes {record.arity} operand{'s' * (record.arity != 1)}, got {len(operands)}",
                             call_src)
        return _op(name, *operands, src=call_src)
    apply.__name__ = apply.__qualname__ = name
    apply.expr = record.expr
    return apply


# ---- indexing, joining, embeddings, random ops (DESIGN.md §1.7) --------------------------------
def _index_int(v):
    """An int of an index (Python or numpy ints), or None for anything else."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
        return None
    return int(v)


def _getitem(x, key, src):
    """Basic indexing with ints, slices, `...` and None, with numpy's semantics and static bounds:
    a `slice` node (when any axis is cut) and a reshape that drops int axes and adds None axes."""
    items = key if isinstance(key, tuple) else (key,)
    shape = x.shape
    for item in items:
        ok = item is None or item is Ellipsis or isinstance(item, slice) or _index_int(item) is not None
        if not ok:
            what = "a gradc Tensor" if isinstance(item, Tensor) else repr(item) if not isinstance(item, np.ndarray) \
                else f"an array of dtype {item.dtype}"
            raise GradcError(f"index: {what} is not an int, a slice, ... or None; gradc indexes with static "
                             f"ints and slices only (gather rows of a table with gc.take)", src)
        if isinstance(item, slice):
            for part in ("start", "stop", "step"):
                v = getattr(item, part)
                if v is not None and _index_int(v) is None:
                    raise GradcError(f"index: slice {part} {v!r} is not an int; slice bounds are static ints", src)
    if len([item for item in items if item is Ellipsis]) > 1:
        raise GradcError("index: an index can only have a single ellipsis ('...')", src)
    consuming = len([item for item in items if item is not None and item is not Ellipsis])
    if consuming > len(shape):
        raise GradcError(f"index: too many indices for shape {fmt(shape)}: {consuming} given, rank {len(shape)}", src)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - consuming) + items[at + 1:]
    else:
        items = items + (slice(None),) * (len(shape) - consuming)
    index, final, axis = [], [], 0
    for item in items:
        if item is None:
            final.append(1)
            continue
        d = shape[axis]
        i = _index_int(item)
        if i is not None:
            if isinstance(d, str):
                raise GradcError(f"index: axis {axis} has the symbolic dim {d}; it can only be taken whole with ':' "
                                 f"(shape {fmt(shape)})", src)
            if not -d <= i < d:
                raise GradcError(f"index: {i} is out of range for axis {axis} of size {d} (shape {fmt(shape)})", src)
            i %= d
            index.append((i, i + 1, 1))
        else:
            start, stop, step = (None if v is None else _index_int(v) for v in (item.start, item.stop, item.step))
            if step == 0:
                raise GradcError(f"index: slice step cannot be zero (axis {axis})", src)
            if isinstance(d, str):
                if start not in (None, 0) or stop is not None or step not in (None, 1):
                    raise GradcError(f"index: axis {axis} has the symbolic dim {d}; it can only be taken whole with "
                                     f"':' (a slice of it would have no static bounds; shape {fmt(shape)})", src)
                index.append(None)
                final.append(d)
            else:
                bounds = slice(start, stop, step).indices(d)
                r = range(*bounds)
                index.append(None if bounds == (0, d, 1) else bounds)
                final.append(len(r))
        axis += 1
    out = x
    if any(e is not None for e in index):
        out = _op("slice", x, src=src, index=tuple(index))
    out = out if tuple(final) == out.shape else reshape(out, tuple(final), src=src)
    base = x.model.graph.node(x.node)
    base = base.get("shown") or base.get("name")   # (a step's slice: the user's sequence, 'tok'[t])
    if out is not x and base:   # errors name it as the user wrote it: ii[:, 1], not "%5 (reshape)"
        key_items = key if isinstance(key, tuple) else (key,)
        out.model.graph.node(out.node)["shown"] = f"{base}[{', '.join(map(_index_text, key_items))}]"
    return out


def _index_text(item):
    if isinstance(item, slice):
        parts = ["" if v is None else str(_index_int(v)) for v in (item.start, item.stop, item.step)]
        return ":".join(parts[:2] if not parts[2] else parts)
    return "..." if item is Ellipsis else "None" if item is None else str(_index_int(item))


def _tensor_list(op, tensors, src):
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)) or not tensors:
        raise GradcError(f"{op}: needs a non-empty list of tensors, got {type(tensors).__name__}", src)
    model = _model_of(op, tensors, src)
    return [v if isinstance(v, Tensor) else Tensor(model, model._node(v, op, src)) for v in tensors], model


def _join_axis(op, axis, rank, src, shape):
    if _index_int(axis) is None:
        raise GradcError(f"{op}: axis {axis!r} is not an int", src)
    if not -rank <= axis < rank:
        raise GradcError(f"{op}: axis {axis} is out of range for rank {rank} (shape {fmt(shape)})", src)
    return int(axis) % rank


def concat(tensors, axis=0):
    """Join tensors along `axis` (negative counts from the end). The shapes must agree exactly on every
    other axis (nothing is broadcast), and the joined axis must have int dims."""
    src = user_src()
    tensors, model = _tensor_list("concat", tensors, src)
    first = tensors[0].shape
    for j, t in enumerate(tensors):
        if t.ndim != len(first):
            raise GradcError(f"concat: operand {j} has shape {fmt(t.shape)} and operand 0 {fmt(first)}: "
                             f"ranks differ", src)
    a = _join_axis("concat", axis, len(first), src, first)
    if len(tensors) == 1:
        return tensors[0]
    return model._apply("concat", tensors, src, axis=a)


def stack(tensors, axis=0):
    """Stack tensors of one shape along a new axis `axis` (in -(rank+1)..rank, as numpy)."""
    src = user_src()
    tensors, model = _tensor_list("stack", tensors, src)
    first = tensors[0].shape
    for j, t in enumerate(tensors):
        if t.shape != first:
            raise GradcError(f"stack: operand {j} has shape {fmt(t.shape)} and operand 0 {fmt(first)}: "
                             f"stacked tensors must have the same shape", src)
    a = _join_axis("stack", axis, len(first) + 1, src, first)
    expanded = [reshape(t, first[:a] + (1,) + first[a:], src=src) for t in tensors]
    return expanded[0] if len(expanded) == 1 else model._apply("concat", expanded, src, axis=a)


def take(table, idx):
    """Embedding lookup: rows of a (V, D) float table at an int tensor idx of any shape -> idx.shape + (D,).
    An index outside 0..V-1 is an error (the module refuses such an input with ValueError)."""
    src = user_src()
    if not isinstance(idx, Tensor) or not idx.dtype.startswith("int"):
        got = (f"{idx.model.graph.describe(idx.node)} of dtype {idx.dtype}" if isinstance(idx, Tensor)
               else type(idx).__name__)
        hint = ("; a numpy array of positions is no index: declare them as an int input, "
                "m.input('idx', (K,), dtype='int64'), and pass the array at each call"
                if isinstance(idx, np.ndarray) else "")
        raise GradcError(f"take: the indices must be an int gradc Tensor (an input with dtype='int64' or an int "
                         f"value made from one{hint}), got {got}", src)
    if not isinstance(table, (Tensor, np.ndarray)):
        raise GradcError(f"take: the table must be a gradc Tensor or a numpy array (V, D), got "
                         f"{type(table).__name__}", src)
    if table.ndim != 2:
        raise GradcError(f"take: the table must have shape (V, D), got {fmt(table.shape)}", src)
    if table.shape[0] == 0:
        raise GradcError(f"take: the table {fmt(table.shape)} has no rows: no index would be valid", src)
    if isinstance(table, np.ndarray):   # a constant table, as numpy arrays are constants everywhere
        if table.dtype.kind != "f":     # (as a Tensor table must be float: no silent cast)
            raise GradcError(f"take: the table has dtype {table.dtype}; it must be float", src)
        table = Tensor(idx.model, idx.model._node(table, "take", src))
    return _op("take", table, idx, src=src)


def _seed_and_model(op, x, seed, src):
    if not isinstance(x, Tensor):
        raise GradcError(f"{op}: needs a gradc Tensor, got {type(x).__name__}", src)
    if not isinstance(seed, Tensor) or not seed.dtype.startswith("int") or seed.shape != ():
        got = f"shape {fmt(seed.shape)} dtype {seed.dtype}" if isinstance(seed, Tensor) else type(seed).__name__
        raise GradcError(f"{op}: the seed must be an int gradc Tensor of shape () "
                         f"(m.input('seed', (), dtype='int64')), got {got}", src)
    if not x.dtype.startswith("float"):
        raise GradcError(f"{op}: the operand has dtype {x.dtype}; it must be float", src)
    if isinstance(x.model, _Body) or isinstance(seed.model, _Body):
        raise GradcError(f"{op}: random ops inside the step of gc.scan are not supported (each step would need its "
                         f"own draws); apply {op} to the scan's sequences or results, outside the step", src)
    if seed.model is not x.model:
        raise GradcError(f"{op}: the seed belongs to model {seed.model.name!r}, the operand to {x.model.name!r}", src)
    graph = x.model.graph
    graph.random_streams = getattr(graph, "random_streams", 0) + 1   # each random op draws its own stream
    return graph.random_streams - 1


def dropout(x, p, seed):
    """Inverted dropout: each element is kept with probability 1 - p and scaled by 1/(1-p), else 0.
    The mask is drawn from `seed` (an int tensor of shape ()) by a counter-based generator: the same
    seed gives the same mask in every pass (backward, hvp, recompute)."""
    src = user_src()
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real) or not 0 <= p < 1:
        raise GradcError(f"dropout: p must be a number in [0, 1), got {p!r}", src)
    stream = _seed_and_model("dropout", x, seed, src)
    if p == 0:
        return x
    mask = x.model._apply("random", (seed,), src, dist="dropout", p=float(p), stream=stream, shape=x.shape,
                          dtype="float")
    return x.model._apply("mul", (x, mask), src)


def gaussian_noise(x, std, seed):
    """x + std * N(0, 1) noise, drawn from `seed` (an int tensor of shape ()) by a counter-based
    generator: the same seed gives the same noise in every pass."""
    src = user_src()
    if isinstance(std, (bool, np.bool_)) or not isinstance(std, numbers.Real) or not 0 <= std < float("inf"):
        raise GradcError(f"gaussian_noise: std must be a finite number >= 0, got {std!r}", src)
    stream = _seed_and_model("gaussian_noise", x, seed, src)
    if std == 0:
        return x
    noise = x.model._apply("random", (seed,), src, dist="normal", p=0.0, stream=stream, shape=x.shape,
                           dtype="float")
    return x.model._apply("add", (x, x.model._apply("mul", (noise, float(std)), src)), src)


# ---- recurrence: gc.scan (DESIGN.md §1.8) ------------------------------------------------------
_TRACING = []   # the bodies of the gc.scan steps being traced, innermost last


class _Body(Model):
    """The model a scan's step is traced in: a sub-graph whose leaves are the carries, the slices
    and the values of the models around it that the step reads (captured on first use)."""

    def __init__(self, parent, name, src):
        self.name = name
        self.src = src
        self.parent = parent
        self.graph = Graph(name)
        self.param_info = {}
        self.captured = {}     # node of the parent model -> placeholder here
        self.closed_over = []  # parent nodes, in the order of their placeholders
        self.done = False

    def _check_open(self, op, src):
        if self.done:
            raise GradcError(f"{op + ': ' if op else ''}a value computed inside the step of gc.scan at {self.src} is "
                             f"used outside it (return it as part of the carry or of y)", src)

    def _node(self, value, op, src):
        self._check_open(op, src)
        if isinstance(value, Tensor) and value.model is not self:
            outer, m = value.model, self.parent
            while m is not None and m is not outer:
                m = getattr(m, "parent", None)
            if m is None:
                raise GradcError(f"{op}: a tensor of model {value.model.name!r} is used in the step of a scan of "
                                 f"model {self.parent.name!r}", src)
            return self._capture(self.parent._node(value, op, src))
        if isinstance(value, np.ndarray):   # constant arrays live outside the loop, closed over
            return self._capture(self.parent._node(value, op, src))
        return super()._node(value, op, src)

    def _apply(self, op, operands, src, **attrs):
        self._check_open(op, src)
        return super()._apply(op, operands, src, **attrs)

    def _capture(self, outer):
        if outer not in self.captured:
            g = self.parent.graph
            name = f"k{len(self.closed_over)}"
            leaf = self.graph.apply("input", attrs={"shape": g.shape(outer), "dtype": g.dtype(outer)},
                                    src=g.node(outer)["src"], name=name)
            self.graph.inputs[name] = leaf
            self.captured[outer] = leaf
            self.closed_over.append(outer)
        return self.captured[outer]

    def input(self, *a, **k):
        raise GradcError("declare inputs on the model, not inside a scan's step", user_src())

    param = output = minimize = input


def _tensors(what, value, model_hint, src):
    """A Tensor or a tuple/list of them (numbers and arrays become constants): (list, was_tuple)."""
    if isinstance(value, (tuple, list)):
        items, many = list(value), True
    else:
        items, many = [value], False
    if not items:
        raise GradcError(f"scan: {what} is an empty tuple", src)
    return items, many


def scan(step, init, xs, reverse=False):
    """carry, ys = gc.scan(step, init, xs), as jax.lax.scan: step(carry, x_t) -> (new_carry, y_t).

    init: a Tensor or a tuple of them (float); xs: a Tensor or tuple scanned along axis 0 (their
    length may be symbolic); y_t a Tensor, a tuple of them, or None; ys stacks the y_t on axis 0.
    Params and other tensors of the model are closed over. The step is traced once into a body
    sub-graph: code size and compile time do not grow with the length. reverse=True runs the
    steps from the last to the first (ys[t] is still step t's output)."""
    src = user_src()
    if not callable(step):
        raise GradcError(f"scan: step must be a function step(carry, x) -> (carry, y), got {type(step).__name__}", src)
    reverse = _flag("scan", "reverse", reverse, src)
    inits, init_many = _tensors("init", init, None, src)
    seqs, xs_many = _tensors("xs", xs, None, src)
    model = _model_of("scan", inits + seqs, src)
    inits = [v if isinstance(v, Tensor) else Tensor(model, model._node(v, "scan", src)) for v in inits]
    seqs = [v if isinstance(v, Tensor) else Tensor(model, model._node(v, "scan", src)) for v in seqs]
    g = model.graph
    for j, c in enumerate(inits):
        if c.model is not model:
            c = Tensor(model, model._node(c, "scan", src))
            inits[j] = c
        if not c.dtype.startswith("float"):
            raise GradcError(f"scan: init carry {j} has dtype {c.dtype}; carries must be float", src)
    length = None
    for j, x in enumerate(seqs):
        if x.model is not model:
            seqs[j] = x = Tensor(model, model._node(x, "scan", src))
        if x.ndim < 1:
            raise GradcError(f"scan: xs {j} is a scalar; sequences are scanned along axis 0", src)
        if length is None:
            length = x.shape[0]
        elif x.shape[0] != length:
            raise GradcError(f"scan: the sequences differ in length along axis 0: {fmt(seqs[0].shape)} and "
                             f"{fmt(x.shape)}", src)
    where = getattr(step, "__code__", None)
    step_src = f"{where.co_filename.rsplit('/', 1)[-1]}:{where.co_firstlineno}" if where else src
    body = _Body(model, f"{model.name}_scan{len([n for n in g.nx.nodes if g.op(n) == 'scan'])}", src)
    bg = body.graph
    carry_args = []
    for k, c in enumerate(inits):
        leaf = bg.apply("input", attrs={"shape": c.shape or (1,), "dtype": c.dtype}, src=src, name=f"c{k}")
        bg.inputs[f"c{k}"] = leaf
        t = Tensor(body, leaf)
        carry_args.append(t if c.shape else Tensor(body, bg.apply("reshape", [leaf], {"shape": ()}, src=src)))
    x_args = []
    for j, x in enumerate(seqs):
        leaf = bg.apply("input", attrs={"shape": x.shape[1:], "dtype": x.dtype}, src=src, name=f"x{j}")
        outer = g.node(x.node).get("shown") or (repr(g.node(x.node)["name"]) if g.node(x.node).get("name") else None)
        bg.node(leaf)["shown"] = f"{outer}[t]" if outer else f"(the step's slice of the scan's sequence {j})"   # not x{j}
        bg.inputs[f"x{j}"] = leaf
        x_args.append(Tensor(body, leaf))
    _TRACING.append(body)
    try:
        out = step(tuple(carry_args) if init_many else carry_args[0], tuple(x_args) if xs_many else x_args[0])
    finally:
        _TRACING.pop()
        body.done = True
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise GradcError(f"scan: the step ({step_src}) must return "
                         f"(new_carry, y), got {type(out).__name__}" +
                         (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""), src)
    new, ys = out
    news = list(new) if isinstance(new, (tuple, list)) else [new]
    if isinstance(new, (tuple, list)) != init_many or len(news) != len(inits):
        raise GradcError(f"scan: the step ({step_src}) returns a carry of {len(news)} tensor(s)"
                         f"{' in a tuple' if isinstance(new, (tuple, list)) else ''} for an init of {len(inits)}"
                         f"{' in a tuple' if init_many else ''}; the carry must keep its structure", src)
    body.done = False
    outputs = []
    try:
        for k, (c, v) in enumerate(zip(inits, news)):
            if not isinstance(v, Tensor):
                raise GradcError(f"scan: the step ({step_src}) returns a {type(v).__name__} as carry {k}; "
                                 f"return a tensor", src)
            node = body._node(v, "scan", src)
            if bg.shape(node) != c.shape or bg.dtype(node) != c.dtype:
                raise GradcError(f"scan: the step ({step_src}) returns carry {k} as {fmt(bg.shape(node))} "
                                 f"{bg.dtype(node)}, but init is {fmt(c.shape)} {c.dtype}; a carry keeps its "
                                 f"shape and dtype", src)
            outputs.append(node if c.shape else bg.apply("reshape", [node], {"shape": (1,)}, src=src))
        y_items = [] if ys is None else (list(ys) if isinstance(ys, (tuple, list)) else [ys])
        y_shapes = []
        for m, y in enumerate(y_items):
            if not isinstance(y, Tensor):
                raise GradcError(f"scan: the step ({step_src}) returns a {type(y).__name__} as y {m}; return "
                                 f"a tensor, a tuple of them or None", src)
            node = body._node(y, "scan", src)
            if not bg.dtype(node).startswith("float"):   # (its range checks follow inputs, not a scan's results)
                raise GradcError(f"scan: the step ({step_src}) returns y {m} of dtype {bg.dtype(node)}; a step's ys "
                                 f"must be float: an int y only rearranges int values the step reads (a sequence or a "
                                 f"closed-over value), so index those outside the scan", src)
            y_shapes.append(bg.shape(node))
            outputs.append(node if bg.shape(node) else bg.apply("reshape", [node], {"shape": (1,)}, src=src))
    finally:
        body.done = True
    for i, o in enumerate(outputs):
        bg.outputs[f"o{i}"] = o
    from gradc.passes.simplify import eliminate_dead
    eliminate_dead(bg)
    # a scalar carry is (1,) in the loop (its leaf and result above): its init too
    operands = ([c.node if c.shape else g.apply("reshape", [c.node], {"shape": (1,)}, src=src) for c in inits]
                + [x.node for x in seqs] + list(body.closed_over))
    token = g.apply("scan", operands, {"body": bg, "carries": len(inits), "xs": len(seqs), "reverse": reverse},
                    src=src)
    from .ops.scan import FINAL, YS, result

    def emit(op, inputs, **attrs):
        return g.apply(op, inputs, attrs, src=src)

    finals = []
    for k, c in enumerate(inits):
        r = result(g, token, FINAL, k, emit)
        finals.append(Tensor(model, r if c.shape else emit("reshape", [r], shape=())))
    stacked = []
    for m, shape in enumerate(y_shapes):
        r = result(g, token, YS, m, emit)
        stacked.append(Tensor(model, r if shape else emit("reshape", [r], shape=(length,))))
    carry_out = tuple(finals) if init_many else finals[0]
    ys_out = None if ys is None else tuple(stacked) if isinstance(ys, (tuple, list)) else stacked[0]
    return carry_out, ys_out
