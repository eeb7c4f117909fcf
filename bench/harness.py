"""Side-by-side timing: each framework in its own worker process, rounds interleaved.

Thread pools of PyTorch, XLA and OpenBLAS spin-wait after work; on two cores one framework's
idle threads slow another's, so each runs in its own process and only one computes at a time, and
each timed batch starts SETTLE seconds after the last one ended. Without that pause, OpenBLAS's
threads in gradc's worker, still spinning from its batch (about 0.1 s by OpenBLAS's default
timeout), took a core from the framework timed next: PyTorch's conv steps measured 1.4-2x slower
than they run (bench/conv_step.py: LeNet 9.4 ms against 4.2, the VGG block 89 against 61).
Rounds interleave the frameworks so that machine noise hits them alike; medians are reported.
"""
import multiprocessing as mp
import statistics
import time


SETTLE = 0.5   # seconds: the spinning threads of the batch before have gone to sleep


def time_calls(fn, n):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def _worker(build, args, warmup, conn):
    try:
        tasks, info = build(*args)
    except ImportError as e:
        conn.send(("missing", str(e)))
        return
    for fn in tasks.values():
        for _ in range(warmup):
            fn()
    conn.send(("ready", (sorted(tasks), info)))
    while (request := conn.recv()) is not None:
        name, n = request
        conn.send(time_calls(tasks[name], n))


def interleaved(builders, rounds, calls, warmup=5, spread=None):
    """builders: framework -> (build, args); build(*args) -> ({task: fn}, info), run in a worker.
    calls: task -> calls per round. Returns ({framework: {task: median seconds}}, {framework: info});
    `spread`, a dict if given, gets {framework: {task: (fastest, slowest round)}} in seconds."""
    ctx = mp.get_context("spawn")
    workers, infos = {}, {}
    for name, (build, args) in builders.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(build, args, warmup, child), daemon=True)
        proc.start()
        status, value = parent.recv()        # one builds at a time
        if status == "missing":
            print(f"# {name} not available ({value}): pip install -e '.[bench]'")
            proc.join()
            continue
        tasks, infos[name] = value
        workers[name] = (proc, parent, tasks)
    samples = {name: {t: [] for t in tasks} for name, (_, _, tasks) in workers.items()}
    for _ in range(rounds):
        for name, (_, conn, tasks) in workers.items():
            for task in tasks:
                time.sleep(SETTLE)
                conn.send((task, calls.get(task, 1)))
                samples[name][task].append(conn.recv())
    for proc, conn, _ in workers.values():
        conn.send(None)
        proc.join()
    if spread is not None:
        spread.update({n: {t: (min(v), max(v)) for t, v in ts.items()} for n, ts in samples.items()})
    return {n: {t: statistics.median(v) for t, v in ts.items()} for n, ts in samples.items()}, infos
