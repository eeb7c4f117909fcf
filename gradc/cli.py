"""The `gradc` command: compile a model file; inspect what a compile wrote."""
import argparse
import difflib
import os
import re
import runpy
import signal
import sys
import traceback
import warnings

from . import sizes
from .errors import GradcError, _short
from .version import __version__


class UsageError(Exception):
    """A bad command line or model file: one line on stderr, exit 2."""


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that a compile cleans up as on Ctrl-C.
    A BaseException, like KeyboardInterrupt: `except Exception` in a model file does not swallow it."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """A warning as one line on stderr, as errors and notes are (Python's own adds the source line)."""
    where, text = f"{_short(filename)}:{lineno}: ", str(message)
    text = text[len("gradc: "):] if text.startswith("gradc: ") else text
    kind = "" if category is UserWarning else f"{category.__name__}: "
    print(f"gradc: warning: {'' if text.startswith(where) else where}{kind}{text}", file=file or sys.stderr)


def parse_size(text):
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_bind(items):
    dims = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--bind {item!r}: expected DIM=INT, e.g. --bind B=256")
        if name in dims:
            raise UsageError(f"--bind {item!r}: {name} is bound twice")
        digits = value[1:] if value.startswith("-") else value
        if not (digits.isascii() and digits.isdigit()):   # int() would take "+4", " 4", "4_000" and other scripts' digits
            several = "; give one --bind per dim: --bind T=16 --bind B=3" if "," in value else ""
            raise UsageError(f"--bind {item!r}: {value!r} is not an int written in decimal digits{several}")
        dims[name] = int(value)
        if dims[name] < 1:
            raise UsageError(f"--bind {item!r}: a dim must be >= 1")
    return dims


def load_models(path):
    """Run the model file and return its module-level gradc.Model objects by name."""
    from .dsl import Model
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a directory; give the model's .py file")
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file")
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        namespace = runpy.run_path(path, run_name="__gradc_model__")
    except GradcError as e:
        called_from = _user_line(path, e)   # the error's line is in a helper the model file calls: name the call too
        if called_from != path and e.src and os.path.abspath(e.src.rsplit(":", 1)[0]) != os.path.abspath(path):
            raise GradcError(f"{e.message} (called from {called_from})", e.src) from e
        raise
    except SystemExit as e:
        raise UsageError(f"{path}: the model file called exit({e.code})") from e
    except SyntaxError as e:   # also one in a module the model file imports: its own file and line
        where = f"{_short(e.filename)}:{e.lineno}" if e.filename else path
        raise UsageError(f"{where}: {type(e).__name__}: {e.msg}") from e
    except Exception as e:
        raise UsageError(f"{_user_line(path, e)}: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    models = {}
    for value in namespace.values():
        if isinstance(value, Model):
            other = models.setdefault(value.name, value)
            if other is not value:   # (one model under two variable names is one model)
                raise UsageError(f"{path}: defines two models named {value.name!r} ({other.src} and {value.src}); "
                                 f"give each its own name, gc.Model(NAME)")
    return models


def _user_line(path, error):
    """'path:line' of the innermost frame of the traceback that runs in the model file itself."""
    where = path
    for frame in traceback.extract_tb(error.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(path):
            where = f"{path}:{frame.lineno}"
    return where


def cmd_compile(args):
    from .compiler import compile_model
    models = load_models(args.model_file)
    if not models:
        raise UsageError(f"{args.model_file}: defines no gradc.Model at module level")
    if args.model is not None:
        if args.model not in models:
            raise UsageError(f"{args.model_file}: no model named {args.model!r} (models: {', '.join(sorted(models))})")
        model = models[args.model]
    elif len(models) > 1:
        raise UsageError(f"{args.model_file}: defines models {', '.join(sorted(models))}; pick one with --model")
    else:
        (model,) = models.values()
    if args.no_warm and args.warm not in (None, "none"):
        raise UsageError(f"--no-warm and --warm {args.warm} ask for opposite things: give one")
    timings, notes = {}, []
    warm = "none" if args.no_warm else args.warm or "first"   # compile_model takes --warm's names
    compile_model(model, out=args.out, target=args.target, dtype=args.dtype, order=args.order,
                  bind=parse_bind(args.bind), warm=warm, timings=timings, notes=notes, source=args.model_file, memory_budget=args.memory_budget, devices=args.devices, schedule=args.schedule,
                  microbatches=args.microbatches, device_memory=args.device_memory, batch_dim=args.batch_dim,
                  scan_backward=args.scan_backward, progress=True)   # progress: a line on stderr, when a terminal
    secs = f"passes {timings.get('passes_total', 0):.2f}s" + (
        f", warm-up {timings['numba_warm']:.1f}s (kernels, and a first call of each entry warmed)"
        if "numba_warm" in timings else "")
    if timings.get("kernels_kernels"):   # kernel signatures compiled by Numba vs loaded from the kernel cache
        secs += (f"; kernel signatures: {timings['kernels_compiled']} compiled, {timings['kernels_from_cache']} from "
                 f"the cache ({timings['kernels_cache']})")
        if timings.get("kernels_not_cached"):   # they compile again in the next build
            secs += (f"; {timings['kernels_not_cached']} kernels not cached (every build compiles them again): "
                     + "; ".join(timings.get("kernels_not_cached_why") or ["why was not recorded"]))
    model_folder, model_file = os.path.split(os.path.abspath(args.model_file))
    if os.path.splitext(model_file)[0] == model.name and os.path.abspath(args.out) != model_folder:
        notes.append(f"{args.model_file} has the module's name: a script in its folder that runs `import "
                     f"{model.name}` imports the model file unless {args.out} comes first on sys.path "
                     f"(sys.path.insert(0, {args.out!r})); or rename one of them")
    for note in notes:   # (diagnostics, as errors are: stdout has only what was written)
        print(f"gradc: note: {note}", file=sys.stderr)
    print(f"gradc: wrote {os.path.join(args.out, model.name + '.py')} ({secs})")
    return 0


def cmd_inspect(args):
    from .files import NotJSON
    from .inspect_build import report
    dumps_only = not (args.run_module or args.ptx)   # (else the build's own code runs: its errors are its own)
    try:
        text = report(args.build, graph=args.graph, memory=args.memory, partition=args.partition,
                      kernels=args.kernels, ptx_of=args.ptx, run_module=args.run_module, layers=args.layers)
    except NotJSON as e:   # (read_json names the file)
        raise GradcError(f"{e}; compile the model again") from e
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:   # JSON, but not what this gradc writes
        if not dumps_only:
            raise
        raise GradcError(f"{args.build}: a dump of this build lacks what gradc {__version__} writes "
                         f"({type(e).__name__}: {e}; --debug shows where): it was edited, or written by another "
                         f"gradc; compile the model again") from e
    print(text)
    return 0


class _Parser(argparse.ArgumentParser):
    argv = ()    # the command line being parsed (main sets it): what error() reads a flag's value from
    flags = {}   # each command's flags (build_parser sets it): what error() suggests for a misspelt one

    def error(self, message):
        """A bad command line: one line and exit 2, like every other user error."""
        flag = re.fullmatch(r"argument (\S+?)(?:/(\S+))?: expected one argument", message)
        argv = list(_Parser.argv)
        if flag and any(a in flag.groups() and b.startswith("-") for a, b in zip(argv, argv[1:])):
            # argparse read the value, -5MiB, as another flag
            message += f" (a value that starts with '-' is written {flag.group(2) or flag.group(1)}=VALUE)"
        command = next((a for a in argv if a in _Parser.flags), None)
        known = _Parser.flags.get(command, ())
        unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in known]
        if command and unknown and not message.startswith("argument "):
            # (a missing model file is reported when a flag was misspelt: `gradc compile --bogus`)
            near = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.75)
            message = f"unrecognized argument {unknown[0]}" + (f": did you mean {near[0]}?" if near else "")
        prog = f"gradc {command}" if command else self.prog
        self.exit(2, f"gradc: error: {message} ({prog} --help for usage)\n")


def build_parser():
    ap = _Parser(prog="gradc", description="Symbolic graph compiler for training code.", allow_abbrev=False)
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    ap.add_argument("--version", action="version", version=f"gradc {__version__}")
    # no abbreviations: `--dtyp` is a typo to report, not an option to guess
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("compile", help="compile a model file into a Python module", allow_abbrev=False)
    c.add_argument("model_file", help="a Python file that defines gc.Model objects at module level")
    c.add_argument("-o", "--out", default="build", help="output folder (default: build)")
    c.add_argument("--model", help="which Model of the file (when it defines several)")
    c.add_argument("--target", choices=["cpu", "cuda"], default="cpu", help="Numba CPU (default) or CUDA kernels")
    c.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="the float type of params, inputs and kernels (default float32)")
    c.add_argument("--order", type=int, choices=[1, 2], default=2,
                   help="1: gradients only; 2 (default): also hvp and hessian")
    c.add_argument("--bind", action="append", metavar="DIM=INT", help="bind a symbolic dim at compile time (one "
                   "--bind per dim)")
    c.add_argument("--memory-budget", type=parse_size, metavar="SIZE|auto",
                   help="activation bytes loss_and_grad may hold (e.g. 64MiB, 1.5GB; auto: a share of free "
                        "memory); values are recomputed to fit; needs every dim bound with --bind")
    c.add_argument("--devices", type=int, metavar="K", help="cut the model into K pipeline stages (needs --bind)")
    c.add_argument("--schedule", choices=["sequential", "gpipe", "1f1b"],
                   help="how the stages run the microbatches (default sequential)")
    c.add_argument("--microbatches", type=int, metavar="M", help="split each batch into M microbatches")
    c.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                   help="memory per device; the stages are cut so that each fits")
    c.add_argument("--batch-dim", metavar="NAME",
                   help="the dim microbatches and data-parallel ranks split (default: the first of the inputs' "
                        "leading symbolic dims the loss is a mean or sum over)")
    c.add_argument("--scan-backward", choices=["reverse", "bppsa"], default="reverse",
                   help="the backward of each gc.scan: a reverse scan (default), or bppsa: a Blelloch scan "
                        "of the transposed Jacobians (DESIGN.md §1.8)")
    c.add_argument("--warm", choices=("first", "all", "none"), default=None,   # (None: not given, so first)
                   help="compile now: the first-order entry points (default), also hvp, hessian and lr_grad (all), or "
                        "nothing (none); what is not compiled now compiles on its first call")
    c.add_argument("--no-warm", action="store_true", help="the same as --warm none")
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    i = sub.add_parser("inspect", help="summarise what `compile` wrote for OUT/NAME", allow_abbrev=False)
    i.add_argument("build", metavar="OUT/NAME")
    i.add_argument("--graph", action="store_true", help="every node, by phase")
    i.add_argument("--memory", action="store_true", help="values kept for the backward, with bytes")
    i.add_argument("--layers", action="store_true", help="each layer's weight and output bytes beside the inference "
                   "and training peaks (bind the dims at compile time for bytes)")
    i.add_argument("--partition", action="store_true", help="stages, transfers and the pipeline schedule (with --devices K)")
    i.add_argument("--kernels", action="store_true", help="the generated kernels (CUDA: launch grids; registers and "
                   "shared memory with --run-module on a GPU)")
    i.add_argument("--ptx", metavar="KERNEL", help="one kernel's code; its PTX with --run-module (a --target cuda "
                   "build, on a GPU)")
    i.add_argument("--run-module", action="store_true", help="for --kernels/--ptx on a GPU: imports and runs the "
                   "build's code: only for builds you trust (otherwise inspect reads only the dumps)")
    i.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    _Parser.flags = {name: [f for action in p._actions for f in action.option_strings if f.startswith("--")]
                     for name, p in (("compile", c), ("inspect", i))}
    return ap


def main(argv=None):
    ap = build_parser()
    _Parser.argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:   # not the main thread: SIGTERM keeps its handler
        previous = None
    try:
        with warnings.catch_warnings():   # (restores Python's way of showing them on the way out)
            warnings.showwarning = _warning_line
            return cmd_compile(args) if args.command == "compile" else cmd_inspect(args)
    except (GradcError, UsageError) as e:
        if args.debug:   # the traceback, then the same line and exit status as without --debug
            traceback.print_exc()
        print(f"gradc: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        # the compile has removed what it had written, unless the new build was already in place (then the
        # message names it); 128 + the signal's number, as a shell reports it
        if args.debug:
            traceback.print_exc()
        interrupted = isinstance(e, KeyboardInterrupt)
        written = f" after the new build was in place ({e.written} is it)" if getattr(e, "written", None) else ""
        print(f"gradc: {'interrupted' if interrupted else 'terminated'}{written}", file=sys.stderr)
        status = 128 + (signal.SIGINT if interrupted else signal.SIGTERM)
        checkmate = sys.modules.get("gradc.passes.checkmate")
        if checkmate is not None and checkmate.solves_running():   # exit now, past C++'s statics (checkmate.py)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    except BrokenPipeError:   # `gradc inspect ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if args.debug:
            raise
        print(f"gradc: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
