"""The kernel cache: each distinct kernel is compiled once, for every build of a user.

A generated module writes its kernels out in full, each decorated `@cached_kernel`. At import,
`cached_kernel` takes the kernel's source from the module file, gives the function a canonical
name (`kernel`), and names the result by a hash of its content together with the build's dtype,
the gradc and Numba versions and the CPU. That
text goes once into `<cache>/kernels/k_<hash>.py`, and the kernel is loaded from there with
Numba's `cache=True`: Numba keeps the machine code beside it, in `<cache>/kernels/__pycache__`.
The 30 identical layers of one model, and the same layers in the next model, are one file and one
compile. A kernel may call gradc's own compiled helpers (RUNTIME_KERNELS, e.g. `gemm_strided`, `tap_sums`): its
file imports them, and its header names a hash of the source that defines each, since Numba's
cache of the kernel holds their machine code too. A kernel may call other cached kernels (a scan's
loop calls the step's kernels) and the module's scalar helpers (`_tanh`, ...): its file loads each
from that one's own cache file, named by its hash, so a changed callee is a new caller file too,
and a helper that forty kernels call compiles once (CUDA kernels keep their helpers' source in
their own file).
A kernel that loops with `prange` (BPPSA's sweeps) is compiled with `parallel=True`: those loops'
iterations run on Numba's threads (NUMBA_NUM_THREADS, every core by default).
A `--target cuda` module's kernels (`@cached_cuda_kernel`) go the same way: their file imports
CUDA through gradc's shim and decorates them `cuda.jit(cache=True)` (device functions with
device=True), so numba-cuda keeps the compiled code beside it, per GPU architecture; the header
names the CUDA package and its version instead of the CPU.

    <cache> = $GRADC_CACHE_DIR, else $XDG_CACHE_HOME/gradc, else ~/.cache/gradc

Concurrent compiles are safe: a file is written to a temp name and renamed into place, two
writers of one hash write the same bytes, and Numba writes its index and data files the same way.
A cache file whose text is not what its hash says (a corrupted file) is written again; a Numba
cache entry that does not load is compiled again, and a damaged Numba index is written anew; where the cache cannot be written (a read-only
home, a full disk) the kernel is compiled from the module's own source as before (Numba's cache
beside the module, or in memory). Nothing here raises for a cache problem.
"""
import builtins
import dis
import hashlib
import importlib.metadata
import inspect
import io
import os
import re
import sys
import tempfile
import threading
import tokenize
import weakref

import numba
from numba import njit
from numba.core.caching import FunctionCache

from gradc.files import import_path
from gradc.runtime.blas import gemm_strided, matmul_in_kernel
from gradc.runtime.copy_into import copy_into
from gradc.runtime.cuda import load_cuda, simulated
from gradc.runtime.simd import tap_dots, tap_sums
from gradc.runtime.views import view
from gradc.version import __version__

ENV = "GRADC_CACHE_DIR"
OPTIONS = {"error_model": "numpy", "nogil": True, "no_cfunc_wrapper": True}   # as the module's own `kernel` decorator
FORMAT = 1   # bump when the layout of a cache file changes

STATS = {"loaded": 0, "written": 0, "rewritten": 0, "fallback": 0, "bad_numba_cache": 0}
KERNELS = []   # (module name, kernel name, dispatcher, cache file or None), in load order
NOT_CACHED = {}   # (module name, kernel name) -> why it compiled outside the cache
_LOCK = threading.Lock()
_LINES = {}    # (path, inode, mtime_ns, size) -> the file's lines
RUNTIME_KERNELS = {"copy_into": copy_into, "gemm_strided": gemm_strided, "matmul_in_kernel": matmul_in_kernel,
                   "tap_dots": tap_dots, "tap_sums": tap_sums, "view": view}   # gradc's compiled helpers a kernel may call by name (copy_into: an overload, no dispatcher)
_FUNC_OF = {}  # id(dispatcher) -> the module's function its cache file was made from (the dispatchers live in KERNELS)
_INNER = weakref.WeakKeyDictionary()   # function -> {kernel folder: the stem of its inner file} (_inner_file)


def cache_dir():
    """The user's gradc cache folder (not created here)."""
    if os.environ.get(ENV):
        return os.path.abspath(os.path.expanduser(os.environ[ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gradc")


def kernel_dir():
    return os.path.join(cache_dir(), "kernels")


_HOST = []


def host():
    """What the machine code depends on besides the source: Numba's version and the CPU it targets."""
    if not _HOST:
        from numba.core import config
        import llvmlite.binding as ll
        cpu = config.CPU_NAME or ll.get_host_cpu_name()
        features = config.CPU_FEATURES if config.CPU_FEATURES is not None else ll.get_host_cpu_features().flatten()
        _HOST.append(f"numba {numba.__version__}, cpu {cpu}, features {hashlib.sha256(features.encode()).hexdigest()[:12]}")
    return _HOST[0]


# ---- the source of a kernel, as the module file has it ------------------------------------------
def _lines(path):
    st = os.stat(path)
    key = (path, st.st_ino, st.st_mtime_ns, st.st_size)
    if key not in _LINES:
        with open(path) as f:
            _LINES[key] = f.read().splitlines(keepends=True)
    return _LINES[key]


def _source(func):
    """The function's def (its decorators left out), read from its file."""
    code = func.__code__
    block = inspect.getblock(_lines(code.co_filename)[code.co_firstlineno - 1:])
    while block and block[0].lstrip().startswith("@"):
        block = block[1:]
    text = "".join(block).rstrip() + "\n"
    if not text.startswith(f"def {func.__name__}("):
        raise ValueError(f"{func.__name__}: its source does not start with its def")
    return text


def _without_comments(text):
    """The code without its comments (a scan's step notes each op's file:line, which is not content)."""
    lines = text.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col].rstrip() + "\n"
    return "".join(lines)


_GLOBALS = {}   # (bytecode, names) -> the global names it reads: a module imported again reads no bytecode twice


def _globals(func):
    """The global names the function reads."""
    code = func.__code__
    key = (code.co_code, code.co_names)
    if key not in _GLOBALS:
        _GLOBALS[key] = {ins.argval for ins in dis.get_instructions(func) if ins.opname == "LOAD_GLOBAL"}
    return _GLOBALS[key]


CALLS_UNCACHED = "some call a kernel that is not in the cache"   # for the callee's own reason


class CallsOtherKernels(ValueError):
    """A kernel reads a global its cache file cannot define; `reason`: what the compile summary says."""

    def __init__(self, message, reason):
        super().__init__(message)
        self.reason = reason


def canonical_text(func, target="cpu", inner=False):
    """The cache file of a kernel: a header naming what the machine code depends on, the kernels and
    scalar helpers it calls (loaded from their own files; CUDA: the helpers' source written in), and
    the kernel itself as `kernel`. Raises ValueError for a function that
    reads a global this file cannot define. `inner`: the variant that compiled code calls (a scan's
    loop, a caller's helper), compiled without the Python entry that calling it from Python needs:
    that entry is 30-40% of a small kernel's compile, and such a variant is reached only through the
    cache file of its caller."""
    env = func.__globals__
    dtype = env.get("DTYPE") or np_name(env.get("FLOAT"))
    helpers, todo, uses_float, parallel, imports, callees = {}, [func], False, False, [], {}
    free = ("math", "np") + (("cuda", "FLOAT_T", "float64") if target == "cuda" else ())
    while todo:
        f = todo.pop()
        for name in sorted(_globals(f)):
            value = env.get(name)
            if name in free:
                continue
            if name == "prange" and target == "cpu":   # a kernel whose independent iterations run on Numba's threads
                if f is not func:
                    raise ValueError(f"{func.__name__}: a helper it calls loops with prange")
                parallel = True
            elif name == "FLOAT":
                uses_float = True
            elif name in RUNTIME_KERNELS and target == "cpu" and value is RUNTIME_KERNELS[name]:
                if name not in imports:   # gradc's own compiled helpers: the file imports them
                    imports.append(name)
            elif name in helpers or name in callees or (name not in env and hasattr(builtins, name)):
                continue
            elif target == "cpu" and id(value) in _FUNC_OF:   # another cached kernel: loaded from its file
                callees[name] = _inner_file(_FUNC_OF[id(value)])
            elif hasattr(value, "py_func") and name.startswith("_") and target == "cpu":
                if "prange" in _globals(value.py_func):
                    raise ValueError(f"{func.__name__}: a helper it calls loops with prange")
                callees[name] = _inner_file(value.py_func)   # a scalar helper keeps its name, bound to its file
            elif hasattr(value, "py_func") and name.startswith("_"):
                helpers[name] = _source(value.py_func)
                todo.append(value.py_func)
            elif any(disp is value for _, _, disp, path in KERNELS if path is None):   # its callee's reason says why
                raise CallsOtherKernels(f"{func.__name__} calls {name!r}, a kernel not in the cache", CALLS_UNCACHED)
            else:
                raise CallsOtherKernels(f"{func.__name__} reads the global {name!r}, not a cached kernel",
                                        "some read a global that is not a cached kernel")
    body = _without_comments(_source(func)).replace(f"def {func.__name__}(", "def kernel(", 1)
    for name, stem in list(callees.items()):   # a kernel goes by its file's name: the module's numbering is not content
        if not name.startswith("_"):   # (a helper keeps its name, which is content)
            body = re.sub(rf"\b{re.escape(name)}\b", stem, body)
            callees[stem] = callees.pop(name)
    inner_flag = "no_cpython_wrapper=True, " if inner else ""   # (Python cannot call it: only its callers' files load it)
    if target == "cuda":
        parts = [f"# gradc kernel cache (format {FORMAT}): gradc {__version__}, {cuda_host()}, {dtype}\n"
                 "# Written by gradc/runtime/kernel_cache.py; numba-cuda's cache of it is in __pycache__ beside it.\n"
                 f"import math\n\nimport numpy as np\nfrom numba import {dtype} as FLOAT_T, float64\n\n"
                 "from gradc.runtime.cuda import load_cuda\n\n"
                 "cuda = load_cuda()\n_device = cuda.jit(device=True, cache=True)\n_kernel = cuda.jit(cache=True)\n"]
        helper_decorator, decorator = "_device", "_kernel"
    else:
        parts = [f"# gradc kernel cache (format {FORMAT}): gradc {__version__}, {host()}, {dtype}\n"
                 "# Written by gradc/runtime/kernel_cache.py; Numba's cache of it is in __pycache__ beside it.\n"
                 f"import math\n\nimport numpy as np\nfrom numba import njit{', prange' if parallel else ''}\n\n"
                 + "".join(f"# {name}: {runtime_kernel_digest(name)}\n" for name in sorted(imports))
                 + "".join(f"from {_python_function(name).__module__} import {name}\n" for name in sorted(imports))
                 + ("from gradc.runtime.kernel_cache import kernel_in_file\n" if callees else "")
                 + ("\n" if imports or callees else "")
                 + "".join(f"{name} = kernel_in_file(__file__, '{stem}.py')\n" for name, stem in sorted(callees.items()))
                 + ("\n" if callees else "")
                 + f"_njit = njit(cache=True, {inner_flag}**{OPTIONS!r})\n"]
        if parallel:
            parts.append(f"_njit_parallel = njit(cache=True, parallel=True, {inner_flag}**{OPTIONS!r})\n")
        helper_decorator, decorator = "_njit", "_njit_parallel" if parallel else "_njit"
    if uses_float:
        parts.append(f"FLOAT = np.{dtype}\n")
    parts += [f"\n\n@{helper_decorator}\n{helpers[h]}" for h in sorted(helpers)]
    parts.append(f"\n\n@{decorator}\n{body}")
    return "".join(parts)


def _inner_file(func):
    """The stem of the cache file of a kernel or scalar helper (`_tanh`, ...) as compiled code calls
    it (canonical_text's `inner`), written if missing. A helper in a file of its own compiles once
    for all its callers, where a copy in each caller's file compiled once per caller (an LSTM's
    warm-up: 10 compiles of 3 helpers, 1.2 s). Made once per function and cache folder: forty
    kernels call one helper, and making its text each time took half of a module's import."""
    made = _INNER.setdefault(func, {})
    folder = kernel_dir()
    if folder not in made:
        made[folder] = os.path.basename(ensure_file(canonical_text(func, inner=True)))[:-3]
    return made[folder]


_DIGESTS = {}


def _python_function(name):
    """The Python function behind gradc's compiled helper `name` (a dispatcher's, or the function an overload compiles)."""
    helper = RUNTIME_KERNELS[name]
    return getattr(helper, "py_func", helper)


def runtime_kernel_digest(name):
    """A hash of the source of the module that defines gradc's compiled helper `name` (the helper and
    what it calls): Numba's cache of a kernel holds the helper's machine code too, so a cache file
    names the helper's version in its header (a changed helper is a new file, compiled anew)."""
    if name not in _DIGESTS:
        module = inspect.getmodule(_python_function(name))
        _DIGESTS[name] = hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16]
    return _DIGESTS[name]


_CUDA_HOST = []


def cuda_host():
    """What a CUDA kernel's compiled code depends on besides its source: the CUDA package and its
    version (numba-cuda keys its own cache by the GPU's architecture)."""
    if not _CUDA_HOST:
        module = load_cuda().__name__.split(".")[0]
        package = "numba-cuda" if module == "numba" else module.replace("_", "-")   # numba.cuda is numba-cuda's
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        _CUDA_HOST.append("numba-cuda simulator" if simulated() else f"{package} {version}")
    return _CUDA_HOST[0]


def np_name(dtype):
    return None if dtype is None else getattr(dtype, "__name__", str(dtype))


# ---- the cache file ---------------------------------------------------------------------------
def _write(path, text):
    """Write `text` to `path` by a rename, so that no reader sees half a file."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".py", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def ensure_file(text):
    """The path of the cache file holding `text`, written if it is missing or not `text`
    (raises OSError where the cache cannot be written)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    path = os.path.join(kernel_dir(), f"k_{digest}.py")
    try:
        with open(path, "rb") as f:
            if f.read() == text.encode():
                return path
        existed = True    # corrupted, or cut short by a full disk: write it again
    except OSError:
        existed = False
    _write(path, text)
    STATS["rewritten" if existed else "written"] += 1
    return path


class _TolerantCache(FunctionCache):
    """Numba's per-function cache, where an entry that does not load (a corrupted index or data
    file) is a miss: the kernel is compiled again and the entry written anew."""

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception:
            STATS["bad_numba_cache"] += 1
            return None

    def save_overload(self, sig, data):
        """Numba reads the index before adding to it: a damaged index is started again (the entries
        it named compile again when asked for); where even that fails, the code stays in memory."""
        try:
            super().save_overload(sig, data)
        except Exception:
            STATS["bad_numba_cache"] += 1
            try:
                os.unlink(self._cache_file._index_path)
                super().save_overload(sig, data)
            except Exception:
                pass


def _load(path):
    """The `kernel` of the cache file at `path`, imported as a module of its own (Numba's cache
    finds a function's globals through sys.modules)."""
    name = "gradc_kernel_cache." + os.path.basename(path)[:-3]
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != path:
        module = import_path(name, path)
        for disp in [getattr(module, n) for n in dir(module) if n == "kernel" or n.startswith("_")]:
            if hasattr(disp, "py_func") and type(getattr(disp, "_cache", None)) is FunctionCache:
                disp._cache = _TolerantCache(disp.py_func)
    return module.kernel


def kernel_in_file(caller, filename):
    """The kernel of the cache file `filename` in the folder of the cache file `caller` (a cache
    file that calls another cached kernel loads it by this)."""
    path = os.path.join(os.path.dirname(caller), filename)
    if not os.path.exists(path):   # removed since the caller was written: the caller compiles from its module
        raise CallsOtherKernels(f"{os.path.basename(caller)} calls {filename}, which is not in the cache",
                                "a kernel they call was removed from the cache")
    return _load(path)


def _fallback(func, target):
    """The module's own function, compiled by Numba with its cache beside the module where it can be
    written, else in memory (CUDA: by cuda.jit, which compiles at the first launch)."""
    STATS["fallback"] += 1
    if target == "cuda":
        return load_cuda().jit(func)
    options = dict(OPTIONS, parallel="prange" in _globals(func))
    try:
        return njit(cache=True, **options)(func)
    except Exception:
        return njit(**options)(func)


def _cached(func, target):
    path = None
    with _LOCK:
        try:
            path = ensure_file(canonical_text(func, target))   # a corrupted file is written again here
            disp = _load(path)
            _FUNC_OF[id(disp)] = func
            STATS["loaded"] += 1
        except Exception as e:   # compile it here, and say why
            NOT_CACHED[(func.__module__, func.__name__)] = _why_not_cached(e)
            path = None
            disp = _fallback(func, target)
        KERNELS.append((func.__module__, func.__name__, disp, path))
    return disp


def _why_not_cached(e):
    if isinstance(e, OSError):
        return f"the cache folder could not be written or read ({e.strerror or e})"
    if isinstance(e, CallsOtherKernels):
        return e.reason
    return f"{type(e).__name__} while loading from the cache: {e}"


def cached_kernel(func):
    """Decorator of a generated module's kernels: the Numba dispatcher of the kernel's cache file
    (see the module docstring), or of the function itself where the cache cannot be used."""
    return _cached(func, "cpu")


def cached_cuda_kernel(func):
    """The same for a --target cuda module's kernels: numba-cuda's dispatcher of the cache file."""
    return _cached(func, "cuda")


def any_parallel():
    """Whether a kernel loaded so far loops with prange (compiled with parallel=True)."""
    return any(getattr(disp, "targetoptions", {}).get("parallel") for _, _, disp, _ in KERNELS)


def _with_callees(disps):
    """{id: dispatcher} of `disps` and the kernels and helpers their cache files load (canonical_text's
    inner variants), recursively: a scan's step compiles through its loop's file."""
    todo, seen = list(disps.values()), {}
    while todo:
        disp = todo.pop()
        if id(disp) in seen:
            continue
        seen[id(disp)] = disp
        module = sys.modules.get(getattr(getattr(disp, "py_func", None), "__module__", None) or "")
        if module is not None and module.__name__.startswith("gradc_kernel_cache."):
            todo += [v for k, v in vars(module).items() if k != "kernel" and hasattr(v, "py_func")
                     and (getattr(v.py_func, "__module__", None) or "").startswith("gradc_kernel_cache.")]
    return seen


def compile_counts(module_name=None):
    """{"kernels": distinct kernels, "compiled": signatures Numba compiled for them (cache misses),
    "from_cache": signatures loaded from a cache (both counting the kernels and helpers their cache files
    load), "not_cached": kernels compiled outside the kernel cache, "not_cached_why": the reasons (a caller's of an uncached kernel only where no other is given),
    "cache": the folder} over the kernels loaded so far (of the module of that name)."""
    names, disps, uncached = set(), {}, {}
    for mod, name, disp, path in KERNELS:
        if module_name is None or mod == module_name:
            names.add((mod, name))
            disps[id(disp)] = disp
            if path is None:
                uncached[(mod, name)] = NOT_CACHED.get((mod, name), "not recorded")
    stats = [d.stats for d in _with_callees(disps).values() if hasattr(d, "stats")]   # CUDA dispatchers keep none
    why = set(uncached.values())
    if len(why) > 1:   # a caller is left out because its callee is: the callee's own reason says why
        why.discard(CALLS_UNCACHED)
    return {"kernels": len(names), "compiled": sum(sum(st.cache_misses.values()) for st in stats),
            "from_cache": sum(sum(st.cache_hits.values()) for st in stats),
            "not_cached": len(uncached), "not_cached_why": sorted(why), "cache": kernel_dir()}
