"""What a `--target cuda` module runs its host functions with: device memory, CUDA graphs, copies.

`CudaRunner.run(fn, args, inputs)` runs one host function (codegen/cuda_entry.py) on the device:
- arguments: numpy arrays are copied to the device; device arrays (anything with
  `__cuda_array_interface__`: numba, torch, cupy) are read where they are, no host round trip;
- the arena is one device buffer per thread laid out by the memory plan (gradc/runtime/arena.py);
- with CUDA graphs (a real GPU, `cuda.core` importable), the first call with a new set of shapes
  runs the launches directly (compiling every kernel), then captures them into a graph through a
  `cuda.core` GraphBuilder; later calls copy their arguments into the buffers the graph was
  captured with and replay it (about 1 us a kernel instead of about 20). The numpy arguments go over
  in one transfer: the graph's buffers for them lie side by side in one device array, written from a
  page-locked host mirror (each copy call costs tens of microseconds of host time, more than a small
  step's kernels). Arrays the runner made
  itself (constants, a Trainer's params and state) are captured in place and never copied. Where
  capture is not available (the simulator, no `cuda.core`), every call launches directly; where one
  capture fails (a product large enough for cuBLAS, which CuPy will not call while capturing), the
  calls with that function and those shapes do, and `graph_error` says why. Temporaries a function
  makes while it is captured (`temp_array`) are held with its graph.
Results are the device arrays the host function returned; `host()` copies one out.
"""
import functools
import threading
import weakref

import numpy as np

from .arena import Arena
from .cuda import array_dtype, is_device_array, load_cuda, simulated
from .pipeline import local_rank


_capture = threading.local()   # .held: the temporaries allocated while a graph is being captured
_DIRECT = object()   # in CudaRunner._graphs: the capture of these launches failed; they run directly


def temp_array(shape, dtype):
    """A device array a host function makes for itself (a scan's carries and work space, BPPSA's
    matrices). One made while a CUDA graph is captured is held with the graph: the graph keeps writing
    to its address at every replay, so it must never be freed and handed to another array."""
    array = load_cuda().device_array(shape, dtype)
    held = getattr(_capture, "held", None)
    if held is not None:
        held.append(array)
    return array


def temp_array_like(x):
    return temp_array(x.shape, x.dtype)


def on_its_gpu(method):
    """Run a runner's method with the runner's GPU current, when it was given one (a stage of a
    multi-GPU pipeline); the module's own runner uses the thread's current GPU."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.pinned is None:
            return method(self, *args, **kwargs)
        with load_cuda().gpus[self.pinned]:
            return method(self, *args, **kwargs)
    return wrapper


class CudaRunner:
    def __init__(self, model, dtype, tables, dim_sources, scalars, data, graphs=True, gpu=None, devices=()):
        self.model = model
        self.devices = tuple(devices)    # a pipeline's stages: memory_stats reports each, one with no arena as 0
        self.dtype = np.dtype(dtype)
        self.tables, self.dim_sources, self.scalars = tables, dim_sources, scalars
        self.host_data = data
        self.graphs_wanted = graphs
        self.use_graphs = graphs and not simulated()
        self.pinned = gpu                # the GPU this runner works on (None: the current one)
        self.outputs_on_device = False   # device_outputs(True): results stay on the device
        self.graph_error = None        # why graphs are off, or why the last capture failed (those calls: direct)
        self.siblings = []             # runners of this module on other GPUs (a multi-GPU pipeline's stages)
        self._ready = False
        self._lock = threading.RLock()

    def sibling(self, gpu):
        """A runner of the same module on GPU `gpu`, with its own arena, stream and graphs."""
        other = CudaRunner(self.model, self.dtype, self.tables, self.dim_sources, self.scalars, self.host_data,
                           self.graphs_wanted, gpu)
        self.siblings.append(other)
        return other

    # ---- set-up, on first use (importing the module needs no GPU) ------------------------
    @on_its_gpu
    def _start(self):
        if self._ready:
            return
        cuda = load_cuda()
        try:
            rank = local_rank()
            if self.pinned is None and rank is not None and len(cuda.gpus) > 1:   # one GPU per rank on a node
                cuda.select_device(rank % len(cuda.gpus))
            device = cuda.get_current_device()
        except Exception as e:
            raise RuntimeError(f"{self.model} was compiled with --target cuda and needs an NVIDIA GPU with a working "
                               f"driver ({type(e).__name__}: {e}); set NUMBA_ENABLE_CUDASIM=1 before importing "
                               f"numba to run it under numba-cuda's simulator, or compile with --target cpu") from None
        self.cuda = cuda
        self.gpu = getattr(device, "id", 0) if self.pinned is None else self.pinned
        self.arena = Arena(self.dtype, self.tables, self.dim_sources, device=f"cuda:{self.gpu}",
                           allocate=lambda n, dtype: cuda.device_array(n, dtype), devices=self.devices)
        self.stream = 0
        self._graphs = {}              # (fn, shapes, places) -> _Captured, or _DIRECT where capture failed
        self.calls = {"captured": 0, "replayed": 0, "direct": 0}   # how the calls with graphs on ran
        self._owned = set()            # device pointers of the arrays this runner allocated
        self._known = {}               # id(array) -> (weak reference, pointer) of the owned arrays themselves
        self._scal = {}
        if self.use_graphs:
            try:
                from cuda.core import Device
                self._device = Device(self.gpu)
                self._device.set_current()
                self.stream = self._device.create_stream()
            except Exception as e:     # no cuda.core: launch directly
                self.use_graphs, self.graph_error = False, f"cuda.core unavailable: {e}"
        self._ready = True
        self._data = {k: self.adopt(v.reshape(1) if v.ndim == 0 else v) for k, v in self.host_data.items()}

    def start(self):
        """Set up now (GPU, stream, arena), not at the first call; returns the runner."""
        self._start()
        return self

    @property
    def data(self):
        """The module's constant arrays, on the device (copied there once)."""
        self._start()
        return self._data

    # ---- device memory -------------------------------------------------------------------
    @on_its_gpu
    def empty(self, shape, dtype=None):
        """A device array the runner owns (captured in place by graphs). Not while another thread
        captures: an allocation then could break its capture."""
        self._start()
        with self._lock:
            a = self.cuda.device_array(shape, dtype or self.dtype)
            self._remember(a)
        return a

    def own(self, a):
        """Mark a view of an owned array as owned too (a Trainer's per-param views); returns it."""
        self._remember(a)
        return a

    def _remember(self, a):
        """An owned array: its pointer, and the array itself by id, so that `_place` knows it at the
        next call without asking numba for its pointer (each ask builds its __cuda_array_interface__)."""
        p, key = _pointer(a), id(a)
        self._owned.add(p)
        self._known[key] = (weakref.ref(a, lambda _: self._known.pop(key, None)), p)

    @on_its_gpu
    def adopt(self, host_array):
        """A device copy of a numpy array that the runner owns."""
        a = self.empty(host_array.shape, host_array.dtype)
        a.copy_to_device(np.ascontiguousarray(host_array), stream=self.stream)
        return a

    def buffer(self, name, shape):
        """An owned device array kept under `name` (the same one for every call with this shape)."""
        self._start()
        key = (name, tuple(shape))
        if key not in self._scal:
            self._scal[key] = self.empty(shape)
        return self._scal[key]

    @on_its_gpu
    def device(self, x):
        """x on the device: a device array as it is, a numpy array copied there."""
        self._start()
        if is_device_array(x):
            return x if type(x).__name__ in ("DeviceNDArray", "FakeCUDAArray") else self.cuda.as_cuda_array(x)
        return self.cuda.to_device(np.ascontiguousarray(x), stream=self.stream)

    @on_its_gpu
    def host(self, x):
        """A numpy copy of device array x, numba's or any other (waits for the work that writes it)."""
        out = self.device(x).copy_to_host(stream=self.stream)
        self.sync()
        return out

    @on_its_gpu
    def out(self, x, shape=None):
        """A result for the caller: a numpy copy, or a device copy with device_outputs(True)."""
        shape = tuple(x.shape) if shape is None else shape
        if not self.outputs_on_device:
            return self.host(x).reshape(shape)
        copy = self.copy(x)
        self.sync()
        return copy.reshape(shape) if shape != () else copy

    @on_its_gpu
    def unowned(self, shape, dtype):
        """A device array on this runner's GPU that it does not own (a graph copies it in rather
        than capturing its address)."""
        self._start()
        return self.cuda.device_array(tuple(shape), dtype)

    @on_its_gpu
    def copy(self, x):
        """An unowned copy of device array x on this runner's GPU, made on its stream (x may be on
        another GPU: a device-to-device copy)."""
        out = self.unowned(x.shape, x.dtype)
        out.copy_to_device(x, stream=self.stream)
        return out

    def scalar(self, x):
        """A one-element device array as a Python float."""
        return float(self.host(x)[0])

    @on_its_gpu
    def zeros_like(self, x):
        return self.out(self.cuda.to_device(np.zeros(tuple(x.shape), array_dtype(x))))

    @on_its_gpu
    def sync(self):
        if self.stream == 0:
            self.cuda.synchronize()
        else:
            self.stream.sync()

    def held_bytes(self):
        held = self.arena.held_by_device() if self._ready else {"cuda:0": 0}
        for other in self.siblings:   # a multi-GPU pipeline: each stage's GPU holds its own arena
            for device, n in other.held_bytes().items():
                held[device] = held.get(device, 0) + n
        return held

    # ---- running a host function ---------------------------------------------------------
    @on_its_gpu
    def run(self, fn, args, inputs, entry=None):
        """fn(*args, arena, offs, scal, stream) on the device; `inputs` (name -> array) give the dims
        the arena is laid out for; `entry` names the arena table (default: fn's name)."""
        self._start()
        entry = entry or fn.__name__
        with self._lock:
            arena, offs, scal = self._buffers(entry, inputs)
            if not self.use_graphs:
                return fn(*[self.device(a) for a in args], arena, offs, scal, self.stream)
            places = [self._place(a) for a in args]
            key = (fn, tuple((tuple(a.shape), array_dtype(a).str, p) for a, p in zip(args, places)))
            captured = self._graphs.get(key)
            if captured is None:
                return self._first_call(key, fn, args, places, arena, offs, scal)
            if captured is _DIRECT:   # its capture failed: these launches run directly, other calls keep theirs
                self.calls["direct"] += 1
                return fn(*[self.device(a) for a in args], arena, offs, scal, self.stream)
            self._copy_in(captured.buffers, captured.staging, captured.hosted, args, places)
            captured.graph.launch(self.stream)
            self.calls["replayed"] += 1
            return captured.results

    @on_its_gpu
    def launch(self, fn, args, inputs, entry, *tail):
        """fn(*args, arena, offs, scal, stream, *tail) launched directly, never captured in a graph: for
        a host function that calls back into host code as it goes (the streamed backward's `ready`)."""
        self._start()
        with self._lock:
            arena, offs, scal = self._buffers(entry, inputs)
            return fn(*[self.device(a) for a in args], arena, offs, scal, self.stream, *tail)

    def _buffers(self, entry, inputs):
        """The arena laid out for `inputs`, its offsets, and the entry's scalar slots."""
        arena, offs = self.arena.get(entry, inputs)
        return arena, offs.tolist(), self.buffer(f"{entry}/scalars", (max(1, self.scalars.get(entry, 0)),))

    @on_its_gpu
    def mark(self):
        """An event recorded on the stream now: its synchronize() waits for the work launched before it."""
        self._start()
        event = self.cuda.event()
        event.record(self.stream)
        return event

    @on_its_gpu
    def pinned_zeros(self, n):
        """A zeroed host array in page-locked memory, so that copies into it run asynchronously."""
        self._start()
        out = self.cuda.pinned_array(n, self.dtype)
        out[...] = 0
        return out

    def _copy_in(self, buffers, staging, hosted, args, places):
        """A call's arguments into a graph's `buffers`: the numpy ones at the positions `hosted` (laid out at
        capture) in one transfer through `staging`, then any other not used in place (`places`: None)."""
        sent = ()
        if staging is not None and all(not is_device_array(args[j]) for j in hosted):
            staging.send([args[j] for j in hosted], self)
            sent = hosted
        for j, (buffer, a, place) in enumerate(zip(buffers, args, places)):
            if place is None and buffer is not a and j not in sent:
                buffer.copy_to_device(a if not is_device_array(a) else self.device(a), stream=self.stream)

    def _place(self, a):
        """The pointer of an array the runner owns (used in place), else None (copied in)."""
        if isinstance(a, np.ndarray):
            return None
        known = self._known.get(id(a))
        if known is not None and known[0]() is a:   # (an id is reused once its array is gone: check it is this one)
            return known[1]
        if is_device_array(a):
            p = _pointer(a)
            if p in self._owned:
                return p
        return None

    def _first_call(self, key, fn, args, places, arena, offs, scal):
        hosted = [j for j, (a, p) in enumerate(zip(args, places)) if p is None and not is_device_array(a)]
        staging = _Staging(self, [(args[j].shape, array_dtype(args[j])) for j in hosted]) if hosted else None
        slots = dict(zip(hosted, staging.device_views)) if hosted else {}
        buffers = [a if p is not None else slots[j] if j in slots else self.empty(tuple(a.shape), array_dtype(a))
                   for j, (a, p) in enumerate(zip(args, places))]
        self._copy_in(buffers, staging, hosted, args, places)
        results = fn(*buffers, arena, offs, scal, self.stream)   # compiles every kernel first
        self.sync()
        _capture.held = held = []   # the temporaries fn makes: the graph writes to them at every replay
        try:
            # no frees while capturing: a free synchronises, which would break the capture
            with self.cuda.defer_cleanup():
                builder = self._device.create_graph_builder()
                builder.begin_building()
                try:
                    captured_results = fn(*buffers, arena, offs, scal, builder)
                finally:
                    built = builder.end_building()   # ends the capture even when a launch failed
                graph = built.complete()
        except Exception as e:   # e.g. cuBLAS through CuPy, which refuses a capture: this call launches directly
            self.graph_error = f"{fn.__name__}: {type(e).__name__}: {e}"
            self._graphs[key] = _DIRECT
            self.calls["direct"] += 1
            return results
        finally:
            _capture.held = None
        self._graphs[key] = _Captured(buffers, graph, captured_results, (arena, scal, held), staging, hosted)
        self.calls["captured"] += 1
        return results


class _Captured:
    """A captured graph with the buffers it reads and writes (kept alive while it may replay); its
    numpy arguments' buffers (those at positions `hosted`) are the views of `staging`."""

    def __init__(self, buffers, graph, results, keep, staging=None, hosted=()):
        self.buffers, self.graph, self.results, self.keep = buffers, graph, results, keep
        self.staging, self.hosted = staging, hosted


class _Staging:
    """Buffers for a graph's numpy arguments side by side in one device array, with a page-locked host
    mirror: a call writes its arguments into the mirror and copies it over in one asynchronous transfer."""
    ALIGN = 256

    def __init__(self, runner, layout):   # layout: [(shape, dtype)]
        starts, total = [], 0
        for shape, dtype in layout:
            starts.append(total)
            total += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // self.ALIGN) * self.ALIGN
        self.device = runner.empty((max(total, 1),), np.uint8)
        self.host = runner.cuda.pinned_array(max(total, 1), np.uint8)

        def views(array):
            return [array[start:start + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
                    for start, (shape, dtype) in zip(starts, layout)]
        self.device_views, self.host_views = views(self.device), views(self.host)
        self.sent = runner.cuda.event()   # recorded after each transfer: the mirror is free again once it has run
        self.pending = False

    def send(self, arrays, runner):
        """The arrays (numpy, as laid out) to the device views, in one transfer on the runner's stream."""
        if self.pending:
            self.sent.synchronize()
        for view, a in zip(self.host_views, arrays):
            view[...] = a
        self.device.copy_to_device(self.host, stream=runner.stream)
        self.sent.record(runner.stream)
        self.pending = True


def _pointer(a):
    if hasattr(a, "__cuda_array_interface__"):
        return a.__cuda_array_interface__["data"][0]
    return id(a._ary) if hasattr(a, "_ary") else id(a)   # the simulator's arrays
