"""`gradc compile`: model -> passes -> generated module, written atomically into OUT and warmed."""
import copy
import difflib
import hashlib
import importlib.util
import numbers
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping

import networkx as nx
import numpy as np

from gradc.passes.analysis import index_inputs
from gradc.passes.entries import ENTRIES
from gradc.passes.forward_outputs import lean_scans
from gradc.passes.pipeline import unheld

from .errors import GradcError, user_warning
from .files import import_path, json_text, link_replacing, remove_stale, temp_name
from .ir import FLOAT_DTYPES
from .runtime.signature import index_limits
from .shapes import expr_text
from .version import __version__

TARGETS = ("cpu", "cuda")
DEVICE_OPTIONS = ("devices", "schedule", "device_memory", "microbatches", "batch_dim")
SCAN_BACKWARD = ("reverse", "bppsa")   # --scan-backward values built (DESIGN.md §1.8)
MAX_REPLANS = 8   # cuts tried again when the stages' memory plans need more than the cost model said
STORE = ".gradc"        # OUT/.gradc/: the builds, and a link per model to its current build (see write_outputs)
SVG_MAX_NODES = 3000    # graphviz takes minutes on larger graphs; NAME.graph.dot is written all the same
SVG_TIMEOUT_S = 5       # the SVG is a convenience: it may never hold up or fail a compile


COMPILE_OPTIONS = ("out", "target", "dtype", "order", "bind", "warm", "memory_budget", "scan_backward") + DEVICE_OPTIONS


def check_options(options, src):
    for key in options:
        near = difflib.get_close_matches(key, COMPILE_OPTIONS, n=1, cutoff=0.6)
        raise GradcError(f"compile: unknown option {key!r}" + (f": did you mean {near[0]!r}?" if near else
                                                               f" (options: {', '.join(COMPILE_OPTIONS)})"), src)


def device_options(options, model, dims, memory_budget, src, options_src=None):
    """--devices, --schedule, --device-memory, --microbatches, --batch-dim, checked: a dict with
    K, schedule, device_memory (bytes or None), M, batch (the batch dim when M > 1), reduction. A bad
    flag value is named by the flag alone, not the model's file:line (nothing in the file is wrong)."""
    from gradc.passes.rows import RowsError, batch_dim, loss_reduction, other_dims
    from gradc.runtime.schedules import SCHEDULES
    from .sizes import parse_size

    K = 1 if options.get("devices") is None else options["devices"]
    M = 1 if options.get("microbatches") is None else options["microbatches"]
    schedule = options.get("schedule") or "sequential"
    memory = options.get("device_memory")
    for flag, value in (("--devices", K), ("--microbatches", M)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GradcError(f"{flag} {value!r}: give a whole number >= 1")
    if schedule not in SCHEDULES:
        raise GradcError(f"--schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if memory is not None:
        try:
            memory = parse_size(memory)
        except ValueError as e:
            raise GradcError(f"--device-memory: {e}") from None
        if memory == "auto":
            raise GradcError("--device-memory takes a size (auto is for --memory-budget)")
    if K == 1 and memory is not None:
        raise GradcError("--device-memory applies to --devices K with K > 1")
    if K == 1 and M == 1 and schedule != "sequential":
        raise GradcError("--schedule applies to pipelines: --devices K > 1 or --microbatches M > 1")
    if K > 1:
        declared = {d for n in model.graph.nx.nodes for d in model.graph.shape(n) if isinstance(d, str)}
        unbound = sorted(declared - set(dims))
        if unbound:
            raise GradcError(f"--devices needs every symbolic dim bound with --bind (unbound: {', '.join(unbound)}; "
                             f"e.g. --bind {unbound[0]}=256, or bind={{{unbound[0]!r}: 256}} in gc.compile)", options_src)
    if (K > 1 or M > 1) and memory_budget == "auto":
        raise GradcError("--memory-budget auto applies to one device: with --devices or --microbatches give a size, "
                         "which bounds each stage's activations")
    batch = reduction = None
    named = options.get("batch_dim")
    if M > 1 or named is not None:   # (--batch-dim alone names the dim data-parallel ranks split)
        flag = f"--microbatches {M}: " if M > 1 else ""
        try:
            batch = batch_dim(model.graph, named)
        except RowsError as e:   # a --batch-dim no input has: the flag, not the model's line
            raise GradcError(f"{flag}{e}", e.src) from None
        try:
            if model.graph.loss is not None:
                reduction = loss_reduction(model.graph, batch)
        except RowsError as e:
            raise GradcError(f"{flag or f'--batch-dim {named}: '}{e}{'' if named else other_dims(model.graph, batch)}",
                             e.src or src) from None
    if M == 1:   # the code binds the batch dim like any other: only the data-parallel facts take it
        batch = reduction = None
    elif isinstance(dims.get(batch), int) and dims[batch] < M:
        raise GradcError(f"--microbatches {M}: the batch dim {batch} is bound to {dims[batch]} rows (--bind), "
                         f"fewer than {M} microbatches")
    return {"K": K, "M": M, "schedule": schedule, "device_memory": memory, "batch": batch, "reduction": reduction,
            "batch_dim": named}


def check_scans(model, scan_backward, target, memory_budget):
    """What a model with gc.scan can be compiled with today (DESIGN.md §1.8)."""
    if scan_backward not in ("reverse", "bppsa"):
        raise GradcError(f"--scan-backward {scan_backward!r}: use reverse or bppsa")
    g = model.graph
    scans = [n for n in g.nx.nodes if g.op(n) == "scan"]
    if not scans:
        return
    src = g.node(scans[0])["src"]
    if scan_backward not in SCAN_BACKWARD:
        raise GradcError(f"--scan-backward {scan_backward} is not built yet: compile with --scan-backward reverse", src)
    if target == "cuda" and memory_budget is not None:
        raise GradcError("gc.scan with --target cuda and --memory-budget is not built yet (carry checkpoints are "
                         "built for the CPU target)", src)


def check_constants(model, dtype):
    """Refuse, at its line, a constant of the model or a param's init array that the build's float type cannot
    hold: a float32 build would make 1e40 inf, or 1e-50 0, without a word. (Before the passes: fusion folds
    scalars into expressions.)"""
    g = model.graph
    for body in [g] + g.bodies():
        for n in body.topo_order():
            why = unheld(body.attrs(n)["value"], dtype) if body.op(n) == "const" else None
            if why:
                raise GradcError(f"a constant of this line is {why}", body.node(n)["src"])
    for name, info in model.param_info.items():
        init = info["init"]
        why = unheld(init, dtype) if isinstance(init, np.ndarray) else None
        if isinstance(init, np.ndarray) and not np.isfinite(init).all():   # (training would start from NaN)
            at = tuple(int(i) for i in np.argwhere(~np.isfinite(init))[0])
            why = f"{float(init[at])!r} at {at}, and a param starts finite"
        if why:
            raise GradcError(f"param {name!r}: its init array holds {why}", g.node(g.params[name])["src"])


def unreached_notes(model):
    """Params the loss does not read (their gradient is always 0, weight decay aside) and inputs nothing reads:
    most often a layer left out of the model by mistake. Read as the training graph reads them: a value only
    a scan's unused per-step output reads is not read (lean_scans)."""
    g = model.graph
    if any(g.op(n) == "scan" for n in g.nx.nodes):
        g = copy.deepcopy(g)
        lean_scans(g)
    loss_reads = nx.ancestors(g.nx, g.loss)
    read = loss_reads.union(*(nx.ancestors(g.nx, n) | {n} for n in g.outputs.values()))
    notes = [f"{g.node(n)['src']}: param {name!r} does not reach the loss: its gradient is always 0"
             + (" (weight decay aside)" if model.param_info[name]["decay"] and model.weight_decay else "")
             for name, n in g.params.items() if n not in loss_reads and model.param_info[name]["trainable"]]
    notes += [f"{g.node(n)['src']}: input {name!r} is read by neither the loss nor an output"
              for name, n in g.inputs.items() if n not in read]
    if not any(info["trainable"] for info in model.param_info.values()):   # (trial S: Trainer.step ran, changing nothing)
        notes.append(f"{model._minimize_src}: the model has no trainable param: loss_and_grad's grads are empty "
                     f"and a Trainer has nothing to update (input_grads still works)")
    return notes


def fingerprint(model, dtype):
    """Identifies the model's computation (not its source text) together with the gradc version: what a checkpoint
    must match. Its dims are left unbound: --bind and --devices change how a build runs, not its params, so a
    checkpoint of a pipeline build (which binds the batch) loads into a plain one."""
    h = hashlib.sha256()
    # ("[]" stands where the binds were hashed: an unbound build's checkpoints written before still load)
    h.update(f"{__version__}|{dtype}|[]|{model.weight_decay}".encode())
    g = model.graph
    for n in g.topo_order():
        d = g.node(n)
        attrs = {k: (v.tobytes().hex() if isinstance(v, np.ndarray) else v) for k, v in sorted(d["attrs"].items())}
        h.update(f"{n}|{d['op']}|{d['inputs']}|{d['shape']}|{d['dtype']}|{d.get('name')}|{attrs}".encode())
    for p, info in model.param_info.items():
        h.update(f"{p}|{info['trainable']}|{info['decay']}".encode())
    return h.hexdigest()


def _synthetic_inputs(module, dims):
    """Random inputs of the right types, to compile every entry point once."""
    rng = np.random.default_rng(0)
    values = {}
    for name, (shape, dtype) in module.INPUTS.items():
        concrete = tuple(dims.get(d, 3) if isinstance(d, str) else d for d in shape)
        if dtype.startswith("int"):
            n = min(dims.get(bound, 3) if isinstance(bound, str) else bound
                    for bound, _ in index_limits(module._INDEX_BOUNDS.get(name, 1)))
            values[name] = rng.integers(0, n, size=concrete).astype(dtype)
        else:
            values[name] = rng.uniform(0.5, 1.5, size=concrete).astype(dtype)
    return values


WARM = (True, False, "all")   # warm= : the first-order entry points, nothing, or hvp and hessian too
WARM_NAMES = {"first": True, "all": "all", "none": False}   # the same by the names of --warm


def _compiled_units(module, second_order):
    """The Numba functions of `module` that the warm-up compiles: what the public entry points it
    calls (and the Trainer's methods) reach through the module's globals."""
    import dis
    env = vars(module)
    publics = {e.public for e in ENTRIES if e.order <= module.ORDER and (e.warm == "first" or second_order)}
    todo = [env[f] for f in sorted(publics) if callable(env.get(f))]   # the rows warm() calls
    trainer = env.get("Trainer")
    todo += [f for f in vars(trainer).values() if callable(f)] if isinstance(trainer, type) else []
    seen, units = set(), []
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        py = getattr(f, "py_func", f)
        home = getattr(py, "__module__", None) or ""
        if py is not f and (home == module.__name__ or home.startswith("gradc_kernel_cache.")):
            units.append(f)   # a compiled entry point, a helper, or a kernel (of the kernel cache)
        if home != module.__name__ or not hasattr(py, "__code__"):
            continue
        todo += [env[i.argval] for i in dis.get_instructions(py)
                 if i.opname == "LOAD_GLOBAL" and i.argval in env and callable(env[i.argval])]
    return units


class _Progress:
    """`gradc compile`'s progress line over the warm-up (tqdm, on stderr, only on a terminal): what is
    compiling (an entry point, a kernel), and how many of the Numba functions it needs are done."""

    def __init__(self, module, second_order, enabled):
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
            from numba.core import event
        except ImportError:
            return
        self.units = _compiled_units(module, second_order)
        names = {id(v): k for k, v in vars(module).items()}
        self.bar = tqdm(total=len(self.units), desc="gradc: compiling", leave=False, file=sys.stderr,
                        bar_format="{desc}: {n}/{total} functions compiled or loaded [{elapsed}]")
        progress, units = self, {id(u) for u in self.units}

        class Listener(event.Listener):
            def on_start(self, ev):   # Numba's own functions (impl, <lambda>) keep the last name shown
                d = ev.data.get("dispatcher")
                progress.update(names.get(id(d)) if id(d) in units else None)

            def on_end(self, ev):
                progress.update()

        self._listening = event.install_listener("numba:compile", Listener())
        self._listening.__enter__()

    def update(self, what=None):
        if self.bar is None:
            return
        if what is not None:
            self.bar.set_description_str(f"gradc: compiling {what}", refresh=False)
        self.bar.n = sum(1 for u in self.units if u.signatures)
        self.bar.refresh()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self._listening.__exit__(None, None, None)
            self.bar.close()
            self.bar = None


def warm(module, dims, second_order=False):
    """Call the entry points once so that Numba compiles and caches them beside the module; hvp and
    hessian only with `second_order` (they compile on first use otherwise: pay for what is used)."""
    params = module.init_params(0)
    inputs = _synthetic_inputs(module, dims)
    for entry in ENTRIES:   # passes/entries.py: each call compiles the entry's function and kernels
        if entry.order <= module.ORDER and (entry.warm == "first" or second_order):
            entry.call(module, params, inputs)
    for opt in ("sgd", "adam"):
        try:
            module.Trainer(params, optimizer=opt, lr=1e-3).step(**inputs)
        except FloatingPointError:
            pass   # synthetic data may give a non-finite loss; the step is compiled all the same


def import_file(path, name):
    """Import a generated module under its own name.

    Numba's cache records the module name of each compiled function and imports it when the
    cache is loaded, so the module must be in sys.modules under the name a user imports it by.
    """
    check_module_name(name)
    return import_path(name, path)


def check_module_name(name, src=None):
    """A build imports under the model's name: no other imported module may hold it, and no installed
    package or standard module either (with the build first on sys.path, `import torch` would find the
    model, or the model's import the package: trial S). A module of the user's own folder may (a model
    file named as its model)."""
    current = sys.modules.get(name)
    if current is not None and not hasattr(current, "GRADC_VERSION"):
        raise GradcError(f"model name {name!r} is also the name of an imported module ({getattr(current, '__file__', current)}); "
                         f"give the Model another name", src)
    installed = _installed_module(name)
    if installed:
        raise GradcError(f"model name {name!r} is also the name of {installed}: with the build on sys.path, "
                         f"`import {name}` would find one or the other; give the Model another name", src)


def _installed_module(name):
    """Where `name` is a module of Python's or an installed package (its folder), else None."""
    if name in sys.builtin_module_names:
        return "a module built into Python"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin in ("built-in", "frozen"):
        return "a module built into Python"
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), None)   # (a namespace package: its folder)
    if not origin:
        return None
    where = os.path.realpath(origin)
    roots = {os.path.realpath(p) for key in ("stdlib", "platstdlib", "purelib", "platlib")
             if (p := sysconfig.get_paths().get(key))}
    roots |= {os.path.realpath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if any(where == root or where.startswith(root + os.sep) for root in roots):
        return f"an installed module ({where})"
    return None


def resolve_budget(graph, memory_budget, src, dims=()):
    """--memory-budget as bytes (None when not given); `auto`: what this machine has free. `dims`:
    those --bind gave (a pipeline's batch dim stays symbolic in the graph)."""
    from .runtime.host_memory import MEMORY_SHARE, available_bytes
    from .sizes import parse_size

    if memory_budget is None:
        return None
    try:
        budget = parse_size(memory_budget)
    except ValueError as e:
        raise GradcError(f"--memory-budget: {e}") from None
    from gradc.passes.likelihood_ratio import DIMS as LR_DIMS   # lr_grad's samples are chosen at call time
    unbound = sorted({d for n in graph.nx.nodes for d in graph.shape(n) if isinstance(d, str)} - set(LR_DIMS)
                     - set(dims))
    if unbound:
        raise GradcError(f"--memory-budget needs every symbolic dim bound with --bind (unbound: {', '.join(unbound)}; "
                         f"e.g. --bind {unbound[0]}=256, or bind={{{unbound[0]!r}: 256}} in gc.compile)", src)
    if budget == "auto":
        free = available_bytes()
        if free is None:
            raise GradcError("--memory-budget auto: this system does not report its free memory; give a size")
        held = sum(int(np.prod(graph.shape(n))) * np.dtype(graph.dtype(n)).itemsize
                   for n in list(graph.params.values()) + list(graph.inputs.values()))
        budget = max(0, int(MEMORY_SHARE * free) - 3 * held)   # params, their gradients, the optimizer state
    return budget


def microbatch_dims(dims, pipe):
    """dims with the batch dim bound to the largest microbatch's rows (what a stage holds per
    microbatch)."""
    batch = pipe["batch"]
    if batch is None or batch not in dims:
        return dims
    return dims | {batch: -(-dims[batch] // pipe["M"])}


def plan_stages(graph, dims, pipe, target, model, budget=None):
    """Cut the graph into K stages and place it (passes/devices.py), then split loss_and_grad into
    stage functions. With --device-memory, each stage's memory by its functions' own plans must
    fit: the cut is chosen under the cost model, and a cut whose plans do not fit is chosen again
    under a limit lowered by the excess (the graph placed afresh). `budget` (--memory-budget, bytes)
    bounds each stage's activations (plan_pipeline).
    Returns (graph, PARTITION or None, the executor's description or None, the stage plans)."""
    from gradc.passes.devices import DevicePlanError, plan_devices, stage_memory
    from gradc.passes.memory import entry_roots, representative_sizes, store_all_steps
    from .sizes import format_size

    memory_dims = microbatch_dims(dims, pipe)
    if pipe["K"] == 1:
        return (graph, None, *plan_pipeline(graph, memory_dims, pipe, model, budget))
    K, limit = pipe["K"], pipe["device_memory"]
    order = store_all_steps(graph, entry_roots(graph, 1)["_loss_and_grad"], representative_sizes(graph, dims))
    pristine = copy.deepcopy(graph) if limit is not None else None
    # the fastest cut is measured first: where its stages' plans fit a limit, no cut is faster, and the cost
    # model's memory (which can be above the plans') would have refused it
    model_limit, tried = None, []
    for attempt in range(MAX_REPLANS + 2):
        placed = graph if attempt == 0 else copy.deepcopy(pristine)
        try:
            doc = plan_devices(placed, order, dims, K, target, model_limit, pipe["schedule"], pipe["M"], memory_dims)
        except DevicePlanError as e:
            if len(tried) <= 1:   # no cut under the limit by the cost model: say what the fastest one needs
                raise GradcError(str(e) + "".join(f"; the fastest cut is {t}" for t in tried), model.src) from None
            break
        placed.validate()
        pipeline, plans = plan_pipeline(placed, memory_dims, pipe, model, budget)
        held = stage_memory(placed, doc, pipeline["functions"], plans, memory_dims)
        over = [k for k, h in enumerate(held) if limit is not None and h > limit]
        if not over:
            doc["replans"] = len(tried)
            doc["device_memory"] = limit   # (the fastest cut is planned with no limit)
            return placed, doc, pipeline, plans
        k = max(over, key=lambda k: held[k])
        tried.append(f"one whose stage {k} needs {format_size(held[k])}")
        if model_limit is None:   # the fastest cut does not fit: a cut under the limit by the cost model
            model_limit = limit
        else:   # assume the cost model falls short by as much elsewhere: this cut's stages over the limit no longer pass
            gap = max(held[k] - doc["stage"][k]["model_memory_bytes"] for k in over)
            model_limit = min(model_limit, limit - gap)
    raise GradcError(f"no cut of the model into {K} stages fits --device-memory {format_size(limit)} per device by the "
                     f"stages' memory plans under the {pipe['schedule']} schedule (cuts tried: " + "; ".join(tried[:3])
                     + ")", model.src)


def plan_pipeline(graph, dims, pipe, model, budget=None):
    """The stage functions of loss_and_grad and what the executor needs (None without a pipeline):
    (the executor's description, the stage functions' memory plans). Under a `budget` (bytes) each
    stage recomputes what it must for its activations to fit (passes/stage_retention.py)."""
    from gradc.passes.memory import entry_roots, representative_sizes, store_all_steps
    from gradc.passes.rows import batch_axes
    from gradc.passes.stage_retention import StageBudgetError, fit_stages, stage_plan
    from gradc.passes.stage_split import split_stages, transfers
    from gradc.runtime.schedules import in_flight
    from .sizes import format_size

    if pipe["K"] == 1 and pipe["M"] == 1:
        return None, {}
    trainable = [p for p in graph.params if model.param_info[p]["trainable"]]
    order = store_all_steps(graph, entry_roots(graph, 1)["_loss_and_grad"], representative_sizes(graph, dims))
    functions = split_stages(graph, order, pipe["K"], trainable)
    plans = {f["fname"]: stage_plan(graph, f, dims) for f in functions}
    retention = None
    if budget is not None:
        flights = in_flight(pipe["schedule"], pipe["K"], pipe["M"])
        try:
            functions, plans, retention = fit_stages(graph, order, pipe["K"], trainable, functions, plans, budget,
                                                     flights, dims)
        except StageBudgetError as e:
            raise GradcError(f"--memory-budget {format_size(budget)} is below the least stage {e.stage} can be "
                             f"planned to, {format_size(e.minimum)} (its forward's or backward's arena and its kernels' "
                             f"workspace, plus what its backward reads from the forward for each of the {e.flight} "
                             f"microbatch(es) it holds under the {pipe['schedule']} schedule; keeping every activation "
                             f"needs {format_size(e.store_all)})"
                             + (f"; the cut into {pipe['K']} stages is chosen for speed, with the stages' memory only "
                                f"under --device-memory, and `with m.stage(i):` moves it" if pipe["K"] > 1 else ""),
                             model.src) from None
    batch_inputs = batch_axes(graph, pipe["batch"]) if pipe["batch"] is not None else {}
    decayed = tuple(p for p in trainable if model.param_info[p]["decay"]) if model.weight_decay else ()
    return {"functions": functions, "transfers": transfers(graph), "schedule": pipe["schedule"],
            "stages": pipe["K"], "microbatches": pipe["M"], "reduction": pipe["reduction"] or "mean",
            "batch_inputs": batch_inputs, "weight_decay": model.weight_decay, "decayed": decayed,
            "retention": retention}, plans


def rows_facts(model, graph, pipe):
    """What a data-parallel Trainer needs to weight each rank's gradients (DESIGN.md §1.10): the batch
    dim, how the loss reduces it ("mean", "sum", or None with the reason), the inputs that carry it,
    and the weight decay term (which every rank's objective holds once)."""
    from gradc.passes.rows import RowsError, batch_axes, batch_dim, loss_reduction, other_dims

    trainable = [p for p in graph.params if model.param_info[p]["trainable"]]
    facts = {"batch": None, "reduction": None, "why": None, "batch_inputs": (),
             "weight_decay": model.weight_decay,
             "decayed": tuple(p for p in trainable if model.param_info[p]["decay"]) if model.weight_decay else ()}
    try:
        facts["batch"] = batch = pipe["batch"] or batch_dim(model.graph, pipe["batch_dim"])
        facts["reduction"] = pipe["reduction"] or loss_reduction(model.graph, batch)
    except RowsError as e:
        hint = "" if pipe["batch_dim"] or facts["batch"] is None else other_dims(model.graph, facts["batch"])
        facts["why"] = f"{e.src + ': ' if e.src else ''}{e}{hint}"
    if facts["batch"] is not None:
        facts["batch_inputs"] = batch_axes(model.graph, facts["batch"])   # (--bind makes the dim an int in `graph`)
    return facts


def compile_model(model, out="build", target="cpu", dtype="float32", order=2, bind=None, warm_cache=True,
                  timings=None, source=None, memory_budget=None, notes=None, progress=False, options_src=None,
                  **later_options):
    """Compile `model` into OUT/NAME.py (plus dumps) and return the imported module.
    `warm=` (what gradc.compile documents) is `warm_cache=`; `notes` collects remarks for the CLI to print;
    `progress`: a progress bar of the warm-up on stderr when it is a terminal; `options_src`: the file:line
    that gave the options (gradc.compile's call), which a bad option's error names (the CLI's name flags)."""
    from gradc.codegen.module import generate
    from gradc.passes.analysis import flops, nbytes, saved_for_backward
    from gradc.passes.checkpoint import BudgetError
    from gradc.passes.memory import memplan_document, plan_memory, stage_documents, summary
    from .sizes import format_size
    from gradc.passes.pipeline import build_training_graph, check_bound_dims
    from .dsl import Model

    if not isinstance(model, Model):
        raise GradcError(f"compile: expected a gradc.Model, got {type(model).__name__}")
    if not isinstance(out, (str, os.PathLike)) or isinstance(os.fspath(out), bytes):
        raise GradcError(f"compile: out={out!r}: give the output folder as a str or path (such as 'build', or '.' "
                         f"for this one)", options_src or model.src)
    out = os.fspath(out)
    devices = {k: later_options.pop(k, None) for k in DEVICE_OPTIONS}
    scan_backward = later_options.pop("scan_backward", "reverse")
    if "warm" in later_options:
        warm_cache = later_options.pop("warm")
    if isinstance(warm_cache, str) and warm_cache in WARM_NAMES:
        warm_cache = WARM_NAMES[warm_cache]
    if not any(warm_cache is w or warm_cache == w for w in WARM):
        raise GradcError(f"compile: warm={warm_cache!r}: use True or 'first' (the first-order entry points), "
                         f"False or 'none', or 'all'", options_src or model.src)
    check_options(later_options, options_src or model.src)
    if dtype not in FLOAT_DTYPES:
        raise GradcError(f"compile: unknown dtype {dtype!r} (use {' or '.join(FLOAT_DTYPES)})", options_src)
    if target not in TARGETS:
        raise GradcError(f"--target {target!r}: use one of {', '.join(TARGETS)}", options_src)
    if model.graph.loss is None:
        raise GradcError(f"model {model.name!r} has no minimize(loss): nothing to differentiate", model.src)
    check_module_name(model.name, model.src)   # before anything is written, at the line that named it
    is_int = isinstance(order, numbers.Integral) and not isinstance(order, bool)
    if not is_int or order not in (1, 2):
        kind = "" if is_int else f" ({type(order).__name__}, not an int)"
        raise GradcError(f"--order {order!r}{kind}: use 1 (gradients) or 2 (also hvp and hessian)", options_src)
    if bind is not None and not isinstance(bind, Mapping):
        raise GradcError(f"compile: bind must be a dict of dim names to ints (bind={{'B': 64}}), got {bind!r}",
                         options_src)
    dims = dict(bind or {})
    for d, v in dims.items():
        if not isinstance(d, str):
            raise GradcError(f"compile: bind's keys are dim names (bind={{'B': 64}}), got {d!r}", options_src)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise GradcError(f"--bind {d}={v!r}: a dim must be bound to an int >= 1", options_src)
        dims[d] = int(v)   # (a numpy int is an int)
    check_bound_dims(model.graph, dims, options_src or model.src)
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    check_scans(model, scan_backward, target, memory_budget)
    check_constants(model, dtype)
    pipe = device_options(devices, model, dims, memory_budget, model.src, options_src)
    pins = [model.graph.node(n)["src"] for n in model.graph.nx.nodes if model.graph.node(n).get("stage") is not None]
    model_notes = unreached_notes(model)
    if scan_backward == "bppsa" and not any(model.graph.op(n) == "scan" for n in model.graph.nx.nodes):
        model_notes.append(f"{model.src}: --scan-backward bppsa changes nothing: the model has no gc.scan")
    if pins and pipe["K"] == 1:
        model_notes.append(f"{pins[0]}: `with m.stage(i)` pins ops to pipeline stages, but this build has one "
                           f"device; the pins apply with --devices K")
    if notes is None:   # gc.compile: Python's warnings say them
        for note in model_notes:
            user_warning(f"gradc: {note}")
    else:
        notes.extend(model_notes)
    # microbatches run the code at other batch sizes: the batch dim stays symbolic in it (the plans bind it)
    code_dims = {d: v for d, v in dims.items() if d != pipe["batch"]}
    graph = build_training_graph(model, dtype, code_dims, timings, order=order, target=target)
    if scan_backward == "bppsa":
        from gradc.ops.scan import use_bppsa
        use_bppsa(graph)
    name = model.name
    info = {"name": name, "version": __version__, "dtype": dtype, "fingerprint": fingerprint(model, dtype),
            "param_info": model.param_info, "index_bounds": index_inputs(model.graph, code_dims), "order": order,
            "target": target, "source": source or model.src.rsplit(":", 1)[0]}
    budget = resolve_budget(graph, memory_budget, options_src or model.src, dims)
    pipelined = pipe["K"] > 1 or pipe["M"] > 1   # the budget is then each stage's (plan_pipeline)
    t = time.perf_counter()
    graph, partition, info["pipeline"], stage_plans = plan_stages(graph, dims, pipe, target, model,
                                                                  budget if pipelined else None)
    info["partition"] = partition
    info["rows"] = rows_facts(model, graph, pipe)
    timings["partition"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        plans = plan_memory(graph, dims, order, None if pipelined else budget)
    except BudgetError as e:
        work = (f", of which {format_size(e.workspace)} is kernel workspace"
                + (" (with --scan-backward bppsa that includes BPPSA's maps; reverse has none)" if scan_backward == "bppsa"
                   else "")
                if e.workspace else "")
        raise GradcError(f"budget {format_size(budget)} is below the minimum {format_size(e.minimum)} for this model "
                         f"(loss_and_grad, its arena and its kernels' workspace; keeping every activation needs "
                         f"{format_size(e.store_all)}{work})", options_src or model.src) from None
    timings["memory"] = time.perf_counter() - t
    memplan = memplan_document(graph, plans)
    info["memory_plan"] = summary(memplan)
    if info["pipeline"] is not None:
        memplan["stages"] = stage_documents(graph, stage_plans, info["pipeline"])
    plans.update(stage_plans)
    t = time.perf_counter()
    text, stored, meta = generate(graph, plans, info)
    timings["codegen"] = time.perf_counter() - t
    timings["passes_total"] = time.perf_counter() - t0

    lg_nodes = graph.ancestors(meta["entries"]["_loss_and_grad"]["roots"])
    fwd_nodes = graph.ancestors(meta["entries"]["_forward_loss"]["roots"])
    saved = saved_for_backward(graph, lg_nodes)
    # the nodes only lr_grad's estimate computes (its copies of the forward: phase "forward", in no other entry)
    others = set().union(*(graph.ancestors(e["roots"]) for f, e in meta["entries"].items() if f != "_lr_grad"))
    lr_only = graph.ancestors(meta["entries"]["_lr_grad"]["roots"]) - others if "_lr_grad" in meta["entries"] else set()
    extra = {"model": name, "dtype": dtype, "gradc_version": __version__, "source": info["source"],
             "params": {p: {"shape": list(graph.shape(n)), "trainable": model.param_info[p]["trainable"],
                            "decay": model.param_info[p]["decay"]} for p, n in graph.params.items()},
             "weight_decay": model.weight_decay,
             "flops": {"forward": expr_text(flops(graph, fwd_nodes)), "loss_and_grad": expr_text(flops(graph, lg_nodes))} | (
                 {"hvp": expr_text(flops(graph, graph.ancestors(meta["entries"]["_hvp_block"]["roots"])))} if order == 2 else {}),
             "kernels": meta["kernels"],
             "saved_for_backward": [{"node": n, "op": graph.op(n), "name": graph.node(n).get("name"),
                                     "shape": [str(d) for d in graph.shape(n)], "bytes": expr_text(nbytes(graph, n)), "src": graph.node(n)["src"]} for n in saved],
             "pass_seconds": {k: round(v, 4) for k, v in timings.items()},
             "lr_grad": {"why": (graph.lr or {"why": "not built"})["why"],
                         "sites": [f"{s['op']} at {s['src']}, pairs with: {s['pairs']}" for s in (graph.lr or {}).get("sites", ())],
                         "nodes": sorted(lr_only)}}
    files = {f"{name}.py": text, f"{name}.graph.json": graph.to_json(extra), f"{name}.graph.dot": graph.to_dot(),
             f"{name}.memplan.json": json_text(memplan)}
    if partition is not None:
        files[f"{name}.partition.json"] = json_text(partition)
    # a CUDA module compiles its kernels on the GPU, at its first call with each set of shapes
    # the warm-up's synthetic batch (3 rows where the batch dim is unbound) must split into M microbatches
    warm_dims = dims | ({pipe["batch"]: max(3, pipe["M"])} if pipe["batch"] is not None and pipe["batch"] not in dims
                        else {})
    return write_outputs(out, name, files, stored, warm_dims if warm_cache and target == "cpu" else None, timings,
                         [] if notes is None else notes, graph.nx.number_of_nodes(), warm_cache == "all", progress)


def render_svg(dot_file, nodes):
    """NAME.graph.svg beside `dot_file` where graphviz is installed; None, or a note why there is none.
    dot runs in a session of its own, so that a timeout or Ctrl-C kills it and anything it started."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    svg = dot_file[:-len(".dot")] + ".svg"
    name = os.path.basename(svg)
    if nodes > SVG_MAX_NODES:
        return (f"no {name}: the graph has {nodes} nodes (more than {SVG_MAX_NODES}); render "
                f"{os.path.basename(dot_file)} with graphviz if you need it")
    try:
        proc = subprocess.Popen([dot, "-Tsvg", "-o", svg, dot_file], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        return f"no {name}: dot did not start ({e.strerror})"
    try:
        code = proc.wait(timeout=SVG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
    if code == 0 and os.path.isfile(svg):
        return None
    if os.path.exists(svg):
        os.unlink(svg)   # what dot wrote before it failed
    return f"no {name}: " + (f"dot timed out after {SVG_TIMEOUT_S} s" if code is None else f"dot failed (exit {code})")


def make_out(out):
    """Create the folder OUT and its missing parents; the folders created, innermost first."""
    if not out:
        raise GradcError("-o '' (out=''): an empty path; give the output folder (such as build, or . for this one)")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise GradcError(f"-o {out}: is a file, not a folder" if os.path.isfile(out) else f"-o {out}: is not a folder")
    missing, parent = [], os.path.normpath(out)
    while parent and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise GradcError(f"-o {out}: {parent} is a file, not a folder")
    for i, folder in enumerate(reversed(missing)):
        try:
            os.mkdir(folder)
        except OSError as e:
            remove_empty(missing[len(missing) - i:])
            raise GradcError(f"-o {out}: cannot create the folder {folder}: {e.strerror}") from None
    return missing


def remove_empty(folders):
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            pass   # not empty: someone else's files, or a live build


def refuse_foreign_files(out, name, names):
    """GradcError when OUT holds a file, folder or link at one of the build's names that gradc did not
    write (`-o .` beside a model file NAME.py, say): a compile never replaces the user's data. gradc's
    links point into its store (OUT/NAME.py -> .gradc/NAME/NAME.py, .gradc/NAME -> NAME.<build>); a
    link elsewhere is the user's (a trial's link to its model file was replaced). Regular files are a
    build's of a gradc before the .gradc/ layout only when OUT/NAME.py is one."""
    module = os.path.join(out, f"{name}.py")
    old_layout = False
    if os.path.isfile(module) and not os.path.islink(module):
        with open(module, "rb") as f:
            old_layout = f.read(200).startswith(f'"""{name}: training code generated by gradc'.encode())
    store = os.path.join(STORE, name)
    for f in names:
        path = os.path.join(out, f)
        if os.path.islink(path):
            target = os.readlink(path)
            if target == os.path.join(store, f) or (f == store and os.sep not in target
                                                     and target.startswith(f"{name}.")):
                continue
            raise GradcError(f"-o {out}: {path} is a link to {target} that gradc did not make; move it away or give "
                             f"another -o (a compile never replaces a file of yours)")
        if os.path.lexists(path) and not (old_layout and os.path.isfile(path)):
            raise GradcError(f"-o {out}: {path} exists and was not written by gradc; move it away or give another "
                             f"-o (a compile never replaces a file of yours)")


def write_outputs(out, name, files, stored, warm_dims, timings, notes, graph_nodes, warm_second_order=False,
                  progress=False):
    """Write and warm a build in a folder of its own, then make it OUT's current build of NAME.

    A build's files switch together, with one rename. The build lives in
    OUT/.gradc/NAME.<pid>-<random>/; OUT/.gradc/NAME is a symlink to the current build, and the
    contract's names OUT/NAME.py, OUT/NAME.graph.json, ... are fixed symlinks through it
    (.gradc/NAME/NAME.py, ...). Renaming a new link onto OUT/.gradc/NAME switches them all at once:
    a reader sees the old build or the new one, never a new graph.json beside an old NAME.py.
    NAME.py keeps its path, so `import NAME` with OUT on sys.path works as before, and Numba keeps
    its cache in OUT/__pycache__ (it checks each entry against the module file's mtime and size,
    so an entry of another build is never used). The pid in a build folder's name lets the next
    compile remove the leftovers of a killed one and leave those of a live one alone.
    """
    made = make_out(out)
    refuse_foreign_files(out, name, list(files) + [f"{name}.{x}" for x in ("data.npz", "graph.svg", "partition.json")]
                         + [os.path.join(STORE, name)])   # the link to the current build
    store = os.path.join(out, STORE)
    current = os.path.join(store, name)
    build = os.path.join(store, temp_name(f"{name}."))
    created, switched = [], False
    try:
        try:
            os.makedirs(store, exist_ok=True)
            previous = os.readlink(current) if os.path.islink(current) else None
            remove_stale(store, f"{name}.", keep={previous})
            os.mkdir(build)
            for fname, text in files.items():
                with open(os.path.join(build, fname), "w") as f:
                    f.write(text)
            if stored:
                np.savez(os.path.join(build, f"{name}.data.npz"), **stored)
        except OSError as e:
            raise GradcError(f"-o {out}: cannot write into the folder: {e.strerror}"
                             + (f" ({e.filename})" if e.filename else "")) from None
        if note := render_svg(os.path.join(build, f"{name}.graph.dot"), graph_nodes):
            notes.append(note)
        if warm_dims is not None:
            t = time.perf_counter()
            module = import_file(os.path.join(build, f"{name}.py"), name)
            from .runtime.kernel_cache import compile_counts
            before = compile_counts(name)
            with _Progress(module, warm_second_order, progress and sys.stderr.isatty()):
                warm(module, warm_dims, warm_second_order)
            timings["numba_warm"] = time.perf_counter() - t
            # kernel signatures this warm-up compiled, and those it loaded from the kernel cache
            timings.update({f"kernels_{k}": v - before[k] if k in ("compiled", "from_cache") else v
                            for k, v in compile_counts(name).items()})
        made_files = sorted(f for f in os.listdir(build) if os.path.isfile(os.path.join(build, f)))
        _move_cache(os.path.join(build, "__pycache__"), os.path.join(out, "__pycache__"), name)
        for f in made_files:   # names the current build lacks: they appear with the switch
            if not os.path.lexists(os.path.join(out, f)):
                link_replacing(os.path.join(out, f), os.path.join(STORE, name, f), store, f"{name}.")
                created.append(os.path.join(out, f))
        link_replacing(current, os.path.basename(build), store, f"{name}.")
        switched = True
    except BaseException:
        if not switched:
            for path in created:
                os.unlink(path)
            shutil.rmtree(build, ignore_errors=True)
            remove_empty([store] + made)
        raise
    try:   # the new build is OUT's now: what stops the rest (Ctrl-C in the import) says so (e.written)
        if previous and previous != os.path.basename(build):
            shutil.rmtree(os.path.join(store, previous), ignore_errors=True)
        for f in os.listdir(out):
            path = os.path.join(out, f)
            if f in made_files:   # a file of a gradc before this layout, or a link planted there
                link_replacing(path, os.path.join(STORE, name, f), store, f"{name}.")
            elif os.path.islink(path) and os.readlink(path) == os.path.join(STORE, name, f):
                os.unlink(path)   # a file the old build had and this one has not
            elif f in (f"{name}.data.npz", f"{name}.graph.svg", f"{name}.partition.json") and os.path.isfile(path):
                os.unlink(path)   # the same, from a gradc before this layout
        return import_file(os.path.join(out, f"{name}.py"), name)
    except BaseException as e:
        e.written = os.path.join(out, f"{name}.py")
        raise


def _move_cache(src, dst, name):
    """Numba's cache and the .pyc of the warm-up replace those of NAME's earlier builds in OUT/__pycache__."""
    new = [f for f in os.listdir(src) if f.startswith(f"{name}.")] if os.path.isdir(src) else []
    if os.path.isdir(dst):
        for f in os.listdir(dst):
            if f.startswith(f"{name}.") and f not in new:
                os.unlink(os.path.join(dst, f))
    if new:
        os.makedirs(dst, exist_ok=True)
        for f in new:
            os.replace(os.path.join(src, f), os.path.join(dst, f))
