#!/usr/bin/env bash
# One GPU session's validation and benchmarks, each step time-boxed, results written as they come.
#   bash benchmarks/gpu_run.sh OUT_DIR [all|tests|bench] [seconds for the GPU tests]
# Steps: versions; "tests": every test that runs on CUDA when a GPU is present (Triton kernels vs the float64
# reference on the benchmark shapes and on the tiny shapes that CI runs through the interpreter, opcheck on
# CUDA, CUDA graphs, the property tests on real shapes (the asym kernels' also with random examples), the benchmark
# smoke tests, compute-sanitizer memcheck of the asym kernels where the machine has it) in parallel processes, each
# limited to the given seconds. ONLY=REGEX runs only the groups whose names match, SKIP=REGEX all but those. On a
# fresh 16-core machine all of it takes more than one ten-minute call: SKIP='small|other|api|bench|launch' about
# seven minutes, then ONLY='small|other|api|bench|launch' (the tiny-shape kernel tests compile a variant per
# shape: give them 400 seconds); "bench": precond_scan forms, the asym engine's stage breakdown, kept against
# recomputed chunk states (benchmarks/kept_states.py) and
# the comparison table with fla (python -m osdn_ops.bench) on S1 and S1-clamp, then S2 (about nine
# minutes on a fresh machine). A ten-minute call runs "bench", or one of the two splits of "tests" above.
# fla tunes its kernels on first call (minutes per shape on a fresh machine). Triton keeps each tuning
# result as a *.autotune.json in its cache; they are archived to OUT_DIR/autotune.tgz after every
# benchmark step, and AUTOTUNE_IN=path/to/autotune.tgz restores them (same GPU, torch, triton, fla).
set -u
out=${1:?usage: gpu_run.sh OUT_DIR [all|tests|bench] [test seconds]}
mode=${2:-all}
tests_s=${3:-420}
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
  # Separate pytest processes, run side by side: Triton compiles single-threaded per process (most of a
  # fresh machine's test time), and a GPU fault in one process cannot take the others' CUDA context down.
  # Each random-shape case runs in a process of its own, so that a fault names its case. Logs: OUT_DIR/tests/.
  mkdir -p "$out/tests"; pids=()
  job() { local name=$1; shift
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return; fi
    if [ -n "${SKIP:-}" ] && [[ $name =~ $SKIP ]]; then return; fi
    ( timeout "$tests_s" "$@" > "$out/tests/$name.log" 2>&1
      echo "$name exit $?" >> "$out/tests/summary.txt" ) & pids+=($!); }
  group() { local name=$1; shift; job "$name" python3 -m pytest -q -p no:cacheprovider --durations=5 "$@"; }
  # first, alone: the tensors of more than 2^31 elements need up to 100 GB of free GPU memory (else they skip)
  group over_2_31 -k "2_31 or int64" tests/test_triton_asym_bwd.py tests/test_triton_asym_fwd.py tests/test_triton_precond.py
  wait "${pids[@]}"; pids=()
  group precond -k "(gpu or cuda) and not 2_31" tests/test_triton_precond.py
  # the tiny-shape tests of the kernel files run on CUDA here (through the interpreter in CI)
  group precond_small -k "not gpu and not cuda and not 2_31" tests/test_triton_precond.py
  group forward_small -k "not gpu" tests/test_triton_asym_fwd.py
  # one process per gate mode: every tiny shape compiles its own variants (in one process they took over 320 s)
  for gate in none scalar channel; do group "backward_small_$gate" -k "not gpu and $gate" tests/test_triton_asym_bwd.py; done
  for gate in none scalar channel; do group "forward_shapes_$gate" -k "gpu_shapes and $gate" tests/test_triton_asym_fwd.py; done
  group forward_forms -k "gpu and not shapes and not int64" tests/test_triton_asym_fwd.py
  group opcheck -k cuda tests/test_opcheck.py
  group cuda_graphs tests/test_cuda_graphs.py
  group compile -k gpu tests/test_compile.py
  group backward_shapes -k "gpu and (bench_shapes or long_sequence)" tests/test_triton_asym_bwd.py
  group backward_varlen -k "gpu and (varlen or deterministic)" tests/test_triton_asym_bwd.py
  group backward_strong_decay -k "gpu and strong_decay" tests/test_triton_asym_bwd.py
  group backward_fp16 -k "gpu and fp16" tests/test_triton_asym_bwd.py
  group backward_channel_paths -k "gpu_channel_paths" tests/test_triton_asym_bwd.py
  group backward_narrow -k "gpu and narrow" tests/test_triton_asym_bwd.py
  group backward_launch_settings -k "gpu and launch_settings" tests/test_triton_asym_bwd.py
  group api -k gpu tests/test_api.py
  group bench_smoke benchmarks/test_ops_bench.py
  for c in $(seq 0 8); do group "random_$c" "tests/test_triton_asym_bwd.py::test_gpu_random_shapes[$c]"; done
  # property tests: every drawn shape compiles new kernel variants, so they run in several processes
  group property_precond -k precond property_tests/test_kernel_vs_reference.py
  group property_asym -k asym property_tests/test_kernel_vs_reference.py
  # random examples (the ci profile is derandomized), each one's sizes printed before it runs and launches
  # synchronous, so that a fault names its kernel and its example
  CUDA_LAUNCH_BLOCKING=1 HYPOTHESIS_PROFILE=dev group property_asym_random -k asym_triton \
    --hypothesis-verbosity=verbose -s property_tests/test_kernel_vs_reference.py
  # out-of-bounds accesses of the asym kernels on small grids (their narrowest V blocks), one gate and dtype a
  # process (the three dtypes of the channel gate took over 400 s in one)
  if command -v compute-sanitizer > /dev/null; then
    for gate in none scalar channel; do for dt in bfloat16 float16 float32; do
      job "memcheck_${gate}_$dt" compute-sanitizer --tool memcheck --error-exitcode 3 python3 benchmarks/memcheck_asym.py $gate --dtypes $dt
    done; done
  fi
  group property_reduction_fla -k fla property_tests/test_reduction.py
  group property_reduction_triton -k triton property_tests/test_reduction.py
  for prop in clamp composition descent right_preconditioning; do
    group "property_triton_other_$prop" -k triton "property_tests/test_$prop.py"; done
  wait "${pids[@]}"
  sort "$out/tests/summary.txt"; tail -qn1 "$out"/tests/*.log
fi
[ "$mode" = tests ] && exit 0
if [ -f benchmarks/bench_precond.py ]; then
  timeout 120 python3 benchmarks/bench_precond.py "$out/precond.md" > "$out/precond.log" 2>&1; tail -15 "$out/precond.log"
fi
timeout 45 python3 benchmarks/asym_stages.py --shapes S1 > "$out/stages.log" 2>&1; cat "$out/stages.log"
timeout 200 python3 benchmarks/kept_states.py --shapes S1,S3 --markdown "$out/kept.md" > "$out/kept.log" 2>&1
cat "$out/kept.md"
timeout 150 python3 -m osdn_ops.bench --shapes S1,S1-clamp --markdown "$out/bench_S1.md" > "$out/bench.log" 2>&1
save_tuning; cat "$out/bench_S1.md"
timeout 120 python3 -m osdn_ops.bench --shapes S2 --markdown "$out/bench_S2.md" >> "$out/bench.log" 2>&1
save_tuning; cat "$out/bench_S2.md"
