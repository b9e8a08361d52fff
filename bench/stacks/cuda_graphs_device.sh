#!/usr/bin/env bash
# Issue #45 in one device call: the CUDA tests of syncless inside CUDA graphs, then
# bench/stacks/cuda_graphs.py (what graphs buy; the stack and the alarm inside graphs).
#
# Before the call, on the development machine (the device image has no torchtitan and
# no network): the wheels bench/stacks/cuda_graphs.py's docstring lists, unpacked into
# .wheels/site (git-ignored), e.g.
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .wheels \
#       torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 spmd_types==0.2.3 typeguard==4.6.1 \
#       nvidia-ml-py   # NVML for the straggler test's GPU sensors (syncless[gpu])
#   for w in .wheels/*.whl; do python -m zipfile -e "$w" .wheels/site; done
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_27_x86_64 -d .wheels duckdb==2.0.1   # installed, not unpacked
# The call (device tool): carry [".wheels"], about 9.5 minutes:
#   SYNCLESS_COMMIT=<sha> bash bench/stacks/cuda_graphs_device.sh 200 --max-seconds 50 --rounds 3
# Arguments: the seconds the tests may take, then bench/stacks/cuda_graphs.py's arguments for
# each case (none: no bench; --max-seconds is per case); CASES= picks the cases, TESTS=
# the test files. Logs, the RESULTS lines and the raw JSON land in $OUT; append the lines to
# bench/RESULTS.md here.
set -o pipefail
export PYTHONPATH=$PWD/.wheels/site:$PWD PYTHONUNBUFFERED=1
export SYNCLESS_COMMIT=${SYNCLESS_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
seconds=${1:-300}
shift || true
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# the image has no duckdb (the run store's reader): its wheel travels in .wheels too
python -c "import duckdb" 2>/dev/null || pip install -q --no-deps .wheels/duckdb-*.whl
python -c "import torch, triton, transformers, duckdb, pyarrow; print(torch.__version__, triton.__version__, transformers.__version__, duckdb.__version__)"
start=$(date +%s)
files=""
for f in ${TESTS:-tests/monitors/test_graphs_cuda.py tests/integrations/test_torchtitan_graphs_cuda.py \
  tests/profile/test_graph_sections_cuda.py tests/profile/test_profile_cuda.py \
  tests/kernels/test_kernels_cuda.py tests/kernels/test_alarm_kernels_cuda.py tests/metrics/test_metric_set_cuda.py \
  tests/monitors/test_budget.py tests/monitors/test_nonfinite_alarm.py \
  tests/capture/test_engine_cuda.py tests/guard/test_cuda.py tests/profile/test_stragglers_cuda.py}; do
  [ -e "$f" ] && files="$files $f"
done
# shellcheck disable=SC2086
timeout "$seconds" python -m pytest -q -p no:cacheprovider -m cuda -rf $files 2>&1 |
  tee "$OUT/tests.log" | tail -c 6000
echo "tests took $(($(date +%s) - start)) s"
# One process per case: in one process the MoE cases ran out of memory that the
# earlier cases still held (H100, 2026-12-07). --max-seconds is then per case.
if [ "$#" -gt 0 ]; then
  for case in ${CASES:-torchtitan-moe:B1xL1024 torchtitan-llama3:B4xL2048 llama-1b:B4xL2048 \
    torchtitan-llama3:B1xL1024 llama-1b:B1xL1024 torchtitan-moe:B4xL4096}; do
    SYNCLESS_RESULTS=$OUT/results.md python -m bench.stacks cuda_graphs --cases "$case" \
      --json "$OUT/bench-${case//:/-}.json" "$@" 2>&1 | tee -a "$OUT/bench.log" | tail -c 1500
  done
fi
