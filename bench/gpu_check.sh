#!/usr/bin/env bash
# On a lent GPU machine, in one call: the CUDA tests on the real driver (GRADC_TEST_ON_GPU=1: the
# same tests CI runs under numba-cuda's simulator), bench/gpu_gemm_accuracy.py, bench/gpu_step.py, then
# bench/lr_table.py --target cuda (backprop against likelihood-ratio training, torch beside them).
# Logs go under $OUT.
#
#   here, once:   ../shared/device/fetch-wheels.sh          (numba-cuda and numpy wheels into .whl/)
#   device tool:  run(command="bash bench/gpu_check.sh [--quick] [pytest -k EXPR]", carry=[".whl"])
#   (TEST_SECONDS, GEMM_SECONDS, BENCH_SECONDS, LR_SECONDS: time limits, 0 skips that step; GPU_STEP_ARGS: more
#   flags for gpu_step.py, such as --check-only; SANITIZE=1 adds compute-sanitizer runs)
#
# --quick: the default test tier and gpu_step.py --quick; otherwise every CUDA test, slow ones too.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
quick=0; [ "${1:-}" = "--quick" ] && { quick=1; shift; }
select=${1:-"cuda or simulator"}

# The machine's own numba-cuda fails to initialise against its numpy 2.5: install the carried wheels
# (../shared/device/prelude.sh does the same; ../shared does not travel with the working tree).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# pyproject.toml maps gradc.passes and gradc.codegen onto top-level folders; uninstalled, links do it
for sub in passes codegen; do [ -e gradc/$sub ] || ln -s ../$sub gradc/$sub; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import numba, numpy; from numba import cuda; print('numba', numba.__version__, 'numpy', numpy.__version__, 'gpu', cuda.get_current_device().name)" || exit 1

export GRADC_TEST_ON_GPU=1 GRADC_CACHE_DIR=/tmp/gradc-cache PYTHONUNBUFFERED=1
tier=(-m "slow or not slow"); [ $quick = 1 ] && tier=()
# loadfile: a module's fixture (test_cuda_target's three runs) is made once, on one worker
[ "${TEST_SECONDS:-300}" != 0 ] && timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider -n 6 --dist loadfile "${tier[@]}" -k "$select" \
    -rf --tb=short tests/test_cuda_target.py tests/test_cuda_kernels.py tests/test_conv.py tests/test_indexing_compiled.py \
    tests/test_kernel_cache.py tests/test_data_parallel.py tests/test_mpi.py 2>&1 | tee "$OUT/tests.log"
[ "${GEMM_SECONDS:-120}" != 0 ] && timeout "${GEMM_SECONDS:-120}" python3 bench/gpu_gemm_accuracy.py 2>&1 | tee "$OUT/gemm_accuracy.log"
quick_flag=(); [ $quick = 1 ] && quick_flag=(--quick)
[ "${BENCH_SECONDS:-150}" != 0 ] && timeout "${BENCH_SECONDS:-150}" python3 bench/gpu_step.py "${quick_flag[@]}" ${GPU_STEP_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/gpu_step.log"
[ "${LR_SECONDS:-300}" != 0 ] && timeout "${LR_SECONDS:-300}" python3 bench/lr_table.py --target cuda "${quick_flag[@]}" 2>&1 | tee "$OUT/lr_table.log"
# SANITIZE=1: the two smaller models' gradient checks under compute-sanitizer (out-of-bounds and races)
if [ "${SANITIZE:-0}" = 1 ]; then
    for tool in memcheck racecheck; do
        timeout "${SANITIZE_SECONDS:-120}" compute-sanitizer --tool $tool --print-limit 20 \
            python3 bench/gpu_step.py --quick --check-only --out "$OUT" 2>&1 | grep -v "Warning" | tail -40 | tee "$OUT/$tool.log"
    done
fi
