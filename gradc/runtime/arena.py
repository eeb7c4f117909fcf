"""One arena per device: every intermediate of an entry point is a view at a planned offset.

`best_fit` places buffers with known live intervals, largest first, each into the smallest gap
left by the buffers it overlaps in time (as XLA's heap simulator does). The compiler uses it to
write the plan; the generated module uses the same function when a dim was left symbolic, so a
bound build and a module laid out at run time agree offset for offset.
"""
import math
import threading

import numpy as np

from .host_memory import available_bytes

ALIGN_BYTES = 64   # a cache line: every buffer starts on one
# what a user calls for the compiled functions whose names differ (passes/entries.py: forward runs
# _forward_loss when given the loss's inputs; hvp and hessian run _hvp_block)
CALLED_AS = {"_forward_loss": "forward (with the loss)", "_hvp_block": "hvp/hessian"}


def best_fit(sizes, intervals, align=1):
    """Offsets for buffers of `sizes` (elements) live over inclusive [start, end] `intervals`.

    Returns (offsets, total). Two buffers whose intervals intersect never overlap in memory.
    Like XLA's heap simulator, it places the buffers in a few orders (largest first, longest
    lived first, earliest first) and keeps the smallest arena."""
    sizes = [-(-s // align) * align for s in sizes]
    orders = [lambda i: (-sizes[i], intervals[i][0], i),
              lambda i: (intervals[i][0] - intervals[i][1], -sizes[i], i),
              lambda i: (intervals[i][0], -sizes[i], i)]
    best = None
    for key in orders:
        offsets, total = _place(sorted(range(len(sizes)), key=key), sizes, intervals)
        if best is None or total < best[1]:
            best = (offsets, total)
    return best


def layout_by_device(sizes, intervals, devices, align=1):
    """best_fit per device, each device's buffers in a region of its own after the previous
    device's (virtual devices share one host buffer). Returns (offsets, {device: region size})."""
    offsets, regions, base = [0] * len(sizes), {}, 0
    for device in sorted(set(devices)):
        idx = [i for i, d in enumerate(devices) if d == device]
        offs, total = best_fit([sizes[i] for i in idx], [intervals[i] for i in idx], align)
        for i, o in zip(idx, offs):
            offsets[i] = base + o
        regions[device] = total
        base += total
    return offsets, regions


def _place(order, sizes, intervals):
    """Each buffer in `order` goes into the smallest gap among the buffers it overlaps in time."""
    offsets = [0] * len(sizes)
    placed = []   # (offset, size, start, end)
    total = 0
    for i in order:
        size = sizes[i]
        start, end = intervals[i]
        busy = sorted((o, s) for o, s, a, b in placed if a <= end and start <= b)
        best, cursor = None, 0
        for o, s in busy:
            gap = o - cursor
            if gap >= size and (best is None or gap < best[1]):
                best = (cursor, gap)
            cursor = max(cursor, o + s)
        offset = best[0] if best is not None else cursor
        offsets[i] = offset
        placed.append((offset, size, start, end))
        total = max(total, offset + size)
    return offsets, total


def elements(shape, dims):
    """Number of elements of a planned shape whose symbolic entries are looked up in `dims`."""
    count = 1
    for d in shape:
        count *= dims[d] if isinstance(d, str) else d
    return count


class Arena:
    """The arena of one device for a generated module.

    tables: entry -> tuple of (shape, start, end) or (shape, start, end, device), one per buffer,
    in the order the entry reads them; with devices, each has its own region. Offsets are computed once per entry and shape (cached); the
    buffer grows to the largest entry seen and is then reused by every call. Each thread has its
    own buffer, so concurrent calls (Hessian blocks) never share one.

    A compiled entry takes (buffer, offsets) and makes its views in machine code; an entry that runs
    as plain Python (those named in `plain`) takes one tuple of ready views instead, made once per
    entry, shape and buffer and then reused, so a call makes no views at all.
    """

    def __init__(self, dtype, tables, dim_sources, device="cpu", allocate=None, plain=(), devices=()):
        self.dtype = np.dtype(dtype)
        self.align = max(1, ALIGN_BYTES // self.dtype.itemsize)
        self.tables = tables
        # the dims each entry's sizes depend on: the cache key of its layout (computed once, not per call)
        self._dims_used = {e: sorted({d for row in t for d in row[0] if isinstance(d, str)}) for e, t in tables.items()}
        self.dim_sources = dim_sources   # dim -> [(input name, axis) that carry it]
        self.device = device
        self.plain = frozenset(plain)    # entries that take their buffers as ready views
        self.allocate = allocate         # (elements, dtype) -> a device's flat buffer; None: host memory, checked
        self._layouts = {}
        self._regions = {}               # device -> the largest region any layout gave it
        self.devices = tuple(devices)    # a pipeline's stages: each is reported, one with no arena as 0
        self._local = threading.local()
        self._buffers = {}               # thread id -> buffer, for memory_stats
        self._lock = threading.Lock()

    def dims_of(self, inputs):
        dims = {}
        for d, sources in self.dim_sources.items():
            for name, axis in sources:
                if name in inputs:
                    dims[d] = inputs[name].shape[axis]
                    break
        return dims

    def layout(self, entry, dims):
        """(offsets as an int64 array, elements needed) for `entry` at these dims."""
        key = (entry, tuple(dims[d] for d in self._dims_used[entry]))
        found = self._layouts.get(key)
        if found is None:
            table = self.tables[entry]
            sizes = [elements(row[0], dims) for row in table]
            devices = [row[3] if len(row) > 3 else self.device for row in table]
            offsets, regions = layout_by_device(sizes, [row[1:3] for row in table], devices, self.align)
            for device, size in regions.items():
                self._regions[device] = max(self._regions.get(device, 0), size)
            found = self._layouts[key] = (np.array(offsets, dtype=np.int64), sum(regions.values()))
        return found

    def get(self, entry, inputs):
        """What `entry` takes after its values: this thread's buffer (grown if needed) and the offsets
        of `entry` for these inputs; for a plain entry, the tuple of its buffers' views there."""
        dims = self.dims_of(inputs)
        offsets, total = self.layout(entry, dims)
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.size < total:
            buffer = self._allocate(entry, dims, max(total, 1))
            self._local.buffer = buffer
            self._local.views = {}
            with self._lock:
                self._forget_finished_threads()
                self._buffers[threading.get_ident()] = buffer
        if entry not in self.plain:
            return buffer, offsets
        key = (entry, id(offsets))   # one offsets array per layout, kept for good by layout()
        views = self._local.views.get(key)
        if views is None:            # views of this thread's buffer, for this layout
            shapes = [tuple(dims[d] if isinstance(d, str) else d for d in row[0]) for row in self.tables[entry]]
            views = self._local.views[key] = tuple(
                buffer[o:o + math.prod(s)].reshape(s) for o, s in zip(offsets.tolist(), shapes))
        return views,

    def _allocate(self, entry, dims, count):
        if self.allocate is not None:
            return self.allocate(count, self.dtype)
        # a buffer the system cannot hold gets the OOM killer when it is touched, not a MemoryError here
        need, free = count * self.dtype.itemsize, available_bytes()
        if free is not None and need > free:
            at = ", ".join(f"{d}={n}" for d, n in sorted(dims.items()))
            raise MemoryError(f"{CALLED_AS.get(entry, entry.lstrip('_'))}'s intermediates{' at ' + at if at else ''} need "
                              f"{need / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB of memory is available")
        return np.empty(count, self.dtype)

    def _forget_finished_threads(self):
        alive = {t.ident for t in threading.enumerate()}
        for ident in [i for i in self._buffers if i not in alive]:
            del self._buffers[ident]

    def held_bytes(self):
        """Bytes of the buffers held for live threads (those of finished threads are released)."""
        with self._lock:
            self._forget_finished_threads()
            return sum(b.nbytes for b in self._buffers.values())

    def held_by_device(self):
        """{device: bytes}: with one device, what held_bytes says; with several, each device's
        largest region times the buffers held."""
        regions = dict.fromkeys(self.devices, 0) | self._regions
        if len(regions) <= 1:
            return {self.device if not regions else next(iter(regions)): self.held_bytes()}
        with self._lock:
            self._forget_finished_threads()
            buffers = len(self._buffers)
        return {d: r * self.dtype.itemsize * buffers for d, r in sorted(regions.items())}
