"""Files gradc writes and reads back: written so that a reader sees the old file or the whole new
one, never through a link planted at the name, and without leaving a killed writer's temp files
for long; .npz archives read back with one clear error when they are damaged.

Temp files and folders carry their writer's pid and where that pid means something
(`PREFIX<pid>.<where>-<random>`, `where` from the host, its boot and the pid namespace): the next
writer into the same folder removes those of processes of its own namespace that are gone, and
leaves those of live (concurrent) writers alone. A pid reused by an unrelated process only delays
the removal. One written from elsewhere (another container or host on shared storage, whose pids
this process cannot see) is removed only when a day old.
"""
import functools
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time

import numpy as np


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    return True


ELSEWHERE_STALE_SECONDS = 24 * 3600   # a temp entry from another pid namespace is removed at this age


@functools.cache
def pid_namespace():
    """8 hex digits naming where this process's pids mean something: the host, its boot, the pid namespace."""
    where = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            where.append(f.read().strip())
        where.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:   # not Linux: the host alone
        pass
    return hashlib.sha256("|".join(where).encode()).hexdigest()[:8]


def temp_name(prefix, suffix=""):
    """A name no other writer picks, that says which process wrote it, and where."""
    return f"{prefix}{os.getpid()}.{pid_namespace()}-{secrets.token_hex(4)}{suffix}"


def remove_stale(folder, prefix, keep=()):
    """Remove the entries `prefix<pid>.<where>-...` of `folder` (files, links or folders) whose writer
    is gone, except the names in `keep`. Our own pid is left alone: this process may be writing them.
    One from another pid namespace goes only when a day old; one without `<where>` (an older gradc's)
    is taken as this namespace's."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)(?:\.([0-9a-f]{8}))?-")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or entry.name in keep:
            continue
        if m.group(2) not in (None, pid_namespace()):
            try:
                if time.time() - entry.stat(follow_symlinks=False).st_mtime < ELSEWHERE_STALE_SECONDS:
                    continue
            except FileNotFoundError:
                continue
        elif int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass   # another writer removed it first


def write_replacing(path, write, prefix=".gradc-tmp-", suffix="", mode=None, sync=False):
    """Call write(f) on a new temp file beside `path`, then rename it onto `path`.

    The rename replaces whatever has that name, a symlink included, instead of writing through it.
    `mode`: the file's permissions (default: 0o666 less the umask, as open() gives)."""
    folder = os.path.dirname(os.path.abspath(path))
    remove_stale(folder, prefix)
    tmp = os.path.join(folder, temp_name(prefix, suffix))
    # O_EXCL: never opens an existing file or a link someone planted at the temp name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)   # the umask may have narrowed it
            write(f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def link_replacing(path, target, tmp_folder, prefix):
    """Make `path` a symlink to `target`, replacing what is there by one rename (never writing through it);
    the temp link is made in `tmp_folder` (on the same file system)."""
    if os.path.islink(path) and os.readlink(path) == target:
        return
    tmp = os.path.join(tmp_folder, temp_name(prefix, ".link"))
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_beside_dumps(base, suffix, write):
    """Write OUT/NAME<suffix> (a picture `gradc inspect` draws of a build) by write(f). In a build of the
    .gradc/ layout the file goes into the build's own folder and OUT/NAME<suffix> is a link through
    OUT/.gradc/NAME, like the dumps': the next compile's switch takes it away with its build, so a
    picture of an old build never sits beside a new one. Returns the path the user reads."""
    path = base + suffix
    dump = base + ".graph.json"
    if not os.path.islink(dump):   # a build from a gradc before the .gradc/ layout
        write_replacing(path, write)
        return path
    out, name = os.path.split(base)
    current = os.path.dirname(os.readlink(dump))           # .gradc/NAME
    folder = os.path.realpath(os.path.join(out, current))  # that build's own folder
    write_replacing(os.path.join(folder, name + suffix), write)
    link_replacing(path, os.path.join(current, name + suffix), folder, f"{name}.")
    return path


def read_npz(path):
    """Every array of the .npz at `path`, read in full (so a damaged member shows here); ValueError
    naming the file when it is not a readable .npz. A missing or unreadable file raises OSError."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":   # what every .npz (a zip archive) starts with
            raise ValueError(f"{path}: not an .npz archive" + (" (the file is empty)" if f.tell() == 0 else ""))
        f.seek(0)
        try:
            with np.load(f, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except Exception as e:   # BadZipFile, EOFError, zlib or format errors: numpy raises many kinds
            raise ValueError(f"{path}: a damaged .npz archive ({type(e).__name__}: {e})") from e


class NotJSON(ValueError):
    """A dump that is not JSON (cut short, another program's file), named by its path."""


def read_json(path):
    """The JSON dump at `path`; NotJSON naming the file when it is not JSON. A missing or unreadable file
    raises OSError."""
    with open(path, "rb") as f:
        try:
            return json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NotJSON(f"{path}: not a JSON dump ({e})") from e


def import_path(name, path):
    """Import the Python file at `path` as module `name`, registered in sys.modules (Numba's
    cache finds a compiled function's globals through its module's name); nothing is left
    registered when the file fails to run."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def json_text(data, default=None, pad=""):
    """`data` as JSON a person can read and Python writes fast: a dict one key a line, a list of dicts
    or lists one item a line, and anything inside those items (or a list of numbers) on one line, by
    json's C encoder (json.dumps with `indent` runs in Python: seconds for a deep model's dumps)."""
    inner = pad + " "
    if isinstance(data, dict) and data:
        rows = [f"{inner}{json.dumps(str(k))}: {json_text(v, default, inner)}" for k, v in data.items()]
    elif isinstance(data, (list, tuple)) and data and isinstance(data[0], (dict, list, tuple)):
        rows = [inner + json.dumps(x, default=default) for x in data]
    else:
        return json.dumps(data, default=default)
    brackets = "{}" if isinstance(data, dict) else "[]"
    return brackets[0] + "\n" + ",\n".join(rows) + "\n" + pad + brackets[1]
