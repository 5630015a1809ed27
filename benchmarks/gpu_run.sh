#!/usr/bin/env bash
# One GPU session's validation and benchmarks, each step time-boxed, results written as they come.
#   bash benchmarks/gpu_run.sh OUT_DIR [all|tests|bench] [seconds for the GPU tests]
# Steps: versions; "tests": every GPU test (Triton kernels vs the float64 reference, opcheck on CUDA,
# property tests on real shapes); "bench": precond_scan forms, the asym engine's stage breakdown and
# the comparison table with fla (python -m osdn_ops.bench) on S1 and S1-clamp, then S2. On a fresh
# machine each half takes about nine minutes (the tests mostly compiling kernels), so a ten-minute
# call runs one half.
# fla tunes its kernels on first call (minutes per shape on a fresh machine). Triton keeps each tuning
# result as a *.autotune.json in its cache; they are archived to OUT_DIR/autotune.tgz after every
# benchmark step, and AUTOTUNE_IN=path/to/autotune.tgz restores them (same GPU, torch, triton, fla).
set -u
out=${1:?usage: gpu_run.sh OUT_DIR [all|tests|bench] [test seconds]}
mode=${2:-all}
tests_s=${3:-500}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/osdn-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -n "${AUTOTUNE_IN:-}" ] && [ -f "$AUTOTUNE_IN" ]; then tar xzf "$AUTOTUNE_IN" -C "$TRITON_CACHE_DIR"; fi
save_tuning() { (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$out/autotune.tgz" -T -); }
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import fla; print('fla-core', fla.__version__)" 2>&1 | tail -1
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if [ "$mode" != bench ]; then
  # separate pytest processes, so that a GPU fault in one cannot take the others' CUDA context down;
  # the time limits cover first-call compilation on a fresh machine (most of each step's time)
  timeout $((tests_s * 3 / 10)) python3 -m pytest -q -p no:cacheprovider -k "gpu or cuda" tests/test_triton_precond.py \
    tests/test_triton_asym_fwd.py tests/test_opcheck.py --durations=10 > "$out/gpu_tests.log" 2>&1
  echo "gpu tests (precond, asym forward, opcheck) exit $?"; tail -4 "$out/gpu_tests.log"
  timeout $((tests_s * 4 / 10)) python3 -m pytest -q -p no:cacheprovider -k "gpu and not random_shapes" \
    tests/test_triton_asym_bwd.py --durations=10 >> "$out/gpu_tests.log" 2>&1
  echo "gpu tests (asym backward) exit $?"; tail -4 "$out/gpu_tests.log"
  for c in $(seq 0 8); do        # one process per random shape: a fault names its case and spares the others
    timeout $((tests_s / 12)) python3 -m pytest -q -p no:cacheprovider \
      "tests/test_triton_asym_bwd.py::test_gpu_random_shapes[$c]" >> "$out/gpu_random.log" 2>&1
    echo "random shape case $c exit $?"
  done | tee -a "$out/gpu_tests.log"
  timeout $((tests_s / 10)) python3 -m pytest -q -p no:cacheprovider property_tests/test_kernel_vs_reference.py \
    property_tests/test_reduction.py >> "$out/gpu_tests.log" 2>&1
  echo "property tests on the GPU exit $?"; tail -4 "$out/gpu_tests.log"
fi
[ "$mode" = tests ] && exit 0
if [ -f benchmarks/bench_precond.py ]; then
  timeout 120 python3 benchmarks/bench_precond.py "$out/precond.md" > "$out/precond.log" 2>&1; tail -15 "$out/precond.log"
fi
timeout 45 python3 benchmarks/asym_stages.py --shapes S1 > "$out/stages.log" 2>&1; cat "$out/stages.log"
timeout 150 python3 -m osdn_ops.bench --shapes S1,S1-clamp --markdown "$out/bench_S1.md" > "$out/bench.log" 2>&1
save_tuning; cat "$out/bench_S1.md"
timeout 120 python3 -m osdn_ops.bench --shapes S2 --markdown "$out/bench_S2.md" >> "$out/bench.log" 2>&1
save_tuning; cat "$out/bench_S2.md"
