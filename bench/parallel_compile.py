"""Does compiling independent kernels in a pool of 2 processes help a cold compile? (issue 14)

A build's kernels are compiled once in a fresh process to learn their signatures; then, each time
into an empty kernel cache holding only the kernel sources: (1) one process compiles every
signature; (2) two processes compile half each, at once, writing into the cache, and a fresh
process then loads them all from it (what a parallel warm-up would cost). Wall times include each
process's start (imports), as a warm-up would pay them.

    python bench/parallel_compile.py 30 256     # layers, width of the tanh MLP (bench/compile_time.py)
"""
import os, pickle, shutil, subprocess, sys, time, json, tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)

def record(out, name, cache, sigfile):
    # warm everything in a fresh process; save kernel file -> signatures
    os.environ["GRADC_CACHE_DIR"] = cache
    from gradc.compiler import import_file, warm
    from gradc.runtime import kernel_cache as kc
    mod = import_file(os.path.join(out, name + ".py"), name)
    t = time.perf_counter()
    warm(mod, {}, True)
    print("serial in-process warm (all) %.2f s" % (time.perf_counter() - t), kc.compile_counts(name))
    sigs = {}
    for m, n, d, path in kc.KERNELS:
        if m == name and path:
            sigs[path] = list(d.signatures)
    pickle.dump(sigs, open(sigfile, "wb"))

def compile_some(cache, sigfile, part, parts):
    os.environ["GRADC_CACHE_DIR"] = cache
    from gradc.runtime import kernel_cache as kc
    sigs = pickle.load(open(sigfile, "rb"))
    items = sorted(sigs.items())[part::parts]
    t = time.perf_counter()
    n = 0
    for path, ss in items:
        d = kc._load(os.path.join(cache, "kernels", os.path.basename(path)))
        for s in ss:
            d.compile(s); n += 1
    print(json.dumps({"compile": time.perf_counter() - t, "n": n}))

def fresh_cache(src, dst):
    os.makedirs(os.path.join(dst, "kernels"))
    for f in os.listdir(os.path.join(src, "kernels")):
        if f.endswith(".py"):
            shutil.copy(os.path.join(src, "kernels", f), os.path.join(dst, "kernels", f))

def main():
    import gradc as gc
    from compile_time import mlp
    layers, width = int(sys.argv[1]), int(sys.argv[2])
    tmp = tempfile.mkdtemp()
    name = f"par_{layers}x{width}"
    cache0 = os.path.join(tmp, "c0")
    os.environ["GRADC_CACHE_DIR"] = cache0
    gc.compile(mlp(name, layers, width), out=os.path.join(tmp, "out"), warm=False)
    sigfile = os.path.join(tmp, "sigs.pkl")
    subprocess.run([sys.executable, HERE, "record", os.path.join(tmp, "out"), name, cache0, sigfile], check=True)
    n = sum(len(v) for v in pickle.load(open(sigfile, "rb")).values())
    print(f"{name}: {n} kernel signatures")
    for trial in range(2):
        c1 = os.path.join(tmp, f"serial{trial}"); fresh_cache(cache0, c1)
        t = time.perf_counter()
        p = subprocess.run([sys.executable, HERE, "some", c1, sigfile, "0", "1"], check=True, capture_output=True, text=True)
        serial = time.perf_counter() - t
        c2 = os.path.join(tmp, f"par{trial}"); fresh_cache(cache0, c2)
        t = time.perf_counter()
        ps = [subprocess.Popen([sys.executable, HERE, "some", c2, sigfile, str(k), "2"], stdout=subprocess.PIPE, text=True) for k in range(2)]
        outs = [q.communicate()[0] for q in ps]
        par = time.perf_counter() - t
        t = time.perf_counter()
        q = subprocess.run([sys.executable, HERE, "some", c2, sigfile, "0", "1"], check=True, capture_output=True, text=True)
        load = time.perf_counter() - t
        print(f"trial {trial}: serial 1 process {serial:.2f} s (compile {json.loads(p.stdout)['compile']:.2f}); "
              f"pool of 2 {par:.2f} s (compile {[round(json.loads(o)['compile'], 2) for o in outs]}); "
              f"then loading all from the cache in a fresh process {load:.2f} s (load {json.loads(q.stdout)['compile']:.2f})")
    shutil.rmtree(tmp, ignore_errors=True)

if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(*sys.argv[2:])
    elif sys.argv[1] == "some":
        compile_some(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
