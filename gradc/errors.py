"""User-facing errors: one line that names the user's file:line, the op and the values involved."""
import os
import sys
import warnings

_PACKAGE_DIRS = None


def _package_dirs():
    # gradc.passes and gradc.codegen live outside gradc/ in a source checkout (package_dir).
    global _PACKAGE_DIRS
    if _PACKAGE_DIRS is None:
        import gradc.passes
        import gradc.codegen
        mods = (sys.modules["gradc"], gradc.passes, gradc.codegen)
        _PACKAGE_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in mods)
    return _PACKAGE_DIRS


def _user_frame():
    """The innermost frame outside gradc (of the user's model source, or the script that calls gradc), or None."""
    dirs = _package_dirs()
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame = frame.f_back
    return frame


def user_src():
    """'file:line' of the innermost frame outside gradc: the line of the user's model source."""
    frame = _user_frame()
    return "<gradc>" if frame is None else src_of(frame)


def src_of(frame):
    """'file:line' of a frame (the file relative to the working folder where it lies below it)."""
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"


def user_warning(message):
    """A UserWarning shown at the user's line (user_src's)."""
    frame = _user_frame()
    if frame is None:
        warnings.warn(message, stacklevel=2)
    else:
        warnings.warn_explicit(message, UserWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__"),
                               registry=frame.f_globals.setdefault("__warningregistry__", {}))


def _short(path):
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


class GradcError(Exception):
    """A mistake in the user's model or call; `src` is the user's file:line when known."""

    def __init__(self, message, src=None):
        self.src = src
        self.message = message
        super().__init__(f"{src}: {message}" if src else message)


class ShapeError(Exception):
    """Raised by an op's shape rule; the graph adds the op name and the user's source line."""
