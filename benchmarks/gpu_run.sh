#!/usr/bin/env bash
# One GPU session's validation and benchmarks, each step time-boxed, results written as they come.
#   bash benchmarks/gpu_run.sh OUT_DIR [seconds for the GPU tests]
# Steps: versions; every GPU test (Triton kernels vs the float64 reference, opcheck on CUDA,
# property tests on real shapes); precond_scan forms; the asym engine's stage breakdown; the
# comparison table with fla (python -m osdn_ops.bench) on S1 and S1-clamp, then S2.
set -u
out=${1:?usage: gpu_run.sh OUT_DIR [test seconds]}
tests_s=${2:-200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import fla; print('fla-core', fla.__version__)" 2>&1 | tail -1
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
timeout "$tests_s" python3 -m pytest -q -p no:cacheprovider -k "gpu or cuda" tests property_tests \
  --durations=15 > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -5 "$out/gpu_tests.log"
if [ -f benchmarks/bench_precond.py ]; then
  timeout 90 python3 benchmarks/bench_precond.py "$out/precond.md" > "$out/precond.log" 2>&1; tail -15 "$out/precond.log"
fi
timeout 60 python3 benchmarks/asym_stages.py --shapes S1 > "$out/stages.log" 2>&1; cat "$out/stages.log"
timeout 150 python3 -m osdn_ops.bench --shapes S1,S1-clamp --markdown "$out/bench_S1.md" > "$out/bench.log" 2>&1
tail -20 "$out/bench.log"
timeout 120 python3 -m osdn_ops.bench --shapes S2 --markdown "$out/bench_S2.md" >> "$out/bench.log" 2>&1
tail -8 "$out/bench.log"
