"""Fuzz gradc against PyTorch autograd on random graphs (the generator is tests/fuzz_graphs.py).

    python bench/fuzz.py --n 1000 [--seed0 S] [--compiled K] [--per-model 3] [--pipelined P [--budget]] [--lr L]
                         [--lr-general G]

Every seed S0 .. S0+N-1 goes through gradc's numpy interpreter: loss, gradients and H v against
torch in float64 (dense ops, conv2d and pools, indexing, concat/stack, take, batched matmul and
seeded dropout / Gaussian noise). The first K seeds also go through the compiled module (small programs,
--per-model of them per compiled model, as tests/test_fuzz.py does), and the first P with --devices 2
and --microbatches 2 (a scan placed whole on a stage, its rows split; --devices 2 alone where the rows
check refuses microbatches). With --lr, L row-wise programs (tests/fuzz_lr.py) check that lr_grad
takes them and that the mean of its estimates is loss_and_grad's gradient within their standard error
(the interpreter); with --lr-general, G of the general programs, which mix rows (lr_grad runs such ops
once per perturbed copy): those it estimates must be unbiased, and its refusals are counted by reason.
Failures print with their
programs; the last lines are the summary `N graphs: X passed, Y failed` and how often each op
variant and graph feature was generated.
"""
import argparse
import os
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import fuzz_graphs  # noqa: E402
import fuzz_lr  # noqa: E402


def run(label, check):
    """(passed, message): an AssertionError is a finding; any other exception is one too, from the generator."""
    try:
        check()
        return True, ""
    except Exception as e:
        kind = "" if isinstance(e, AssertionError) else f"{type(e).__name__} in the fuzzer: "
        return False, f"FAIL {label}: {kind}{e}"


def interpreted(seed, coverage):
    case = fuzz_graphs.random_case(seed)
    coverage.update(case.coverage())
    fuzz_graphs.check_interpreted(case)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="seeds through the interpreter check")
    ap.add_argument("--seed0", type=int, default=0, help="first seed")
    ap.add_argument("--compiled", type=int, default=0, help="seeds (from seed0) also through the compiled module")
    ap.add_argument("--per-model", type=int, default=3, help="small programs per compiled model")
    ap.add_argument("--pipelined", type=int, default=0,
                    help="seeds (from seed0) also compiled with --devices 2 --microbatches 2, one program each")
    ap.add_argument("--budget", action="store_true",
                    help="compile the --pipelined seeds under the least --memory-budget their stages fit")
    ap.add_argument("--lr", type=int, default=0, help="row-wise programs (from seed0) through lr_grad's bias check")
    ap.add_argument("--lr-general", type=int, default=0,
                    help="the general programs (from seed0), which mix rows, through lr_grad's bias check")
    args = ap.parse_args()

    coverage = Counter()
    ran = failed = 0          # graphs: one per seed and check; a failed compiled model fails all its seeds
    t0 = time.perf_counter()
    for seed in range(args.seed0, args.seed0 + args.n):
        ok, msg = run(f"seed {seed} (interpreter)", lambda: interpreted(seed, coverage))
        ran += 1
        if not ok:
            failed += 1
            print(msg, flush=True)
    print(f"interpreter: {args.n} graphs in {time.perf_counter() - t0:.1f} s", flush=True)

    compiled = list(range(args.seed0, args.seed0 + args.compiled))
    t0 = time.perf_counter()
    for i in range(0, len(compiled), args.per_model):
        seeds = compiled[i:i + args.per_model]
        with tempfile.TemporaryDirectory() as out:
            ok, msg = run(f"seeds {seeds} (compiled float64)",
                          lambda: fuzz_graphs.check_compiled(fuzz_graphs.combined_case(seeds), out))
        ran += len(seeds)
        if not ok:
            failed += len(seeds)
            print(msg, flush=True)
        print(f"compiled {seeds}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s so far)", flush=True)

    t0 = time.perf_counter()
    for seed in range(args.seed0, args.seed0 + args.pipelined):
        with tempfile.TemporaryDirectory() as out:
            ran_with = {}
            ok, msg = run(f"seed {seed} (compiled on 2 devices)", lambda: ran_with.update(
                fuzz_graphs.check_pipelined(fuzz_graphs.random_case(seed, small=True), out,
                                            ("gpipe", "1f1b", "sequential")[seed % 3], args.budget)))
        ran += 1
        if not ok:
            failed += 1
            print(msg, flush=True)
        print(f"2 devices {seed}: {'ok ' + str(ran_with) if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s so far)",
              flush=True)

    t0 = time.perf_counter()
    for seed in range(args.seed0, args.seed0 + args.lr):
        ok, msg = run(f"seed {seed} (lr_grad, row-wise program)", lambda: fuzz_lr.check_lr(fuzz_lr.lr_case(seed)))
        ran += 1
        if not ok:
            failed += 1
            print(msg, flush=True)
    if args.lr:
        print(f"lr_grad: {args.lr} row-wise graphs in {time.perf_counter() - t0:.1f} s", flush=True)

    t0, refused = time.perf_counter(), Counter()
    for seed in range(args.seed0, args.seed0 + args.lr_general):
        why = []
        ok, msg = run(f"seed {seed} (lr_grad, general program)",
                      lambda: why.append(fuzz_lr.check_lr_general(fuzz_graphs.random_case(seed))))
        ran += 1
        if not ok:
            failed += 1
            print(msg, flush=True)
        elif why[0]:
            refused[why[0].split(": ", 2)[-1][:100]] += 1
    if args.lr_general:
        print(f"lr_grad: {args.lr_general} general graphs in {time.perf_counter() - t0:.1f} s, "
              f"{sum(refused.values())} refused:", flush=True)
        for why, count in refused.most_common():
            print(f"  {count:5d}  {why}")

    print("\ncoverage (interpreter seeds; op variants count steps, features count programs):")
    for name, count in sorted(coverage.items()):
        print(f"  {count:7d}  {name}")
    print(f"\n{ran} graphs: {ran - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
