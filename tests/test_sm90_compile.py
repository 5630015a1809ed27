"""The kernel variants with the biggest tiles, and those of the benchmark shapes, compile for sm_90 (H100/H200) and
fit its shared memory.

No GPU needed: ``benchmarks/compile_sm90.py --largest`` records the launches of every op (forward and
backward, K = V = 256 and K = V = 128, bf16) under the interpreter and compiles each with Triton's own toolchain.
The interpreter alone cannot see shared-memory or register limits: a K = 256 variant of the reverse
recurrence that needed 368 KB of shared memory (the H200 gives a block 227 KB) once reached the GPU
unnoticed, and a compile error of a K = 128 variant of the channel gate's output kernel once passed it. It also
checks that precond_scan's serial chains and its output pass compile to software-pipelined loops (asynchronous
copies in their PTX), which the interpreter cannot see either.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_largest_variants_fit_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), "--largest"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert " 0 failed" in res.stdout, res.stdout[-4000:]
    # precond_scan's serial chains, its output pass, the two-level carries and the adjoint's segment offsets are
    # software-pipelined (their loads issued groups or segments ahead; 20-45% of those loops' time on the H200): a
    # branch inside the loop, or key rows of unknown alignment, would silently undo that
    lines = res.stdout.splitlines()
    pipelined = {name: [ln for ln in lines if f" {name} " in ln and cond in ln]
                 for name, cond in [("_chain_kernel", ""), ("_out_kernel", ""), ("_adjoint_kernel", "PARALLEL=True"),
                                    ("_segment_chain_kernel", ""), ("_segment_adjoint_kernel", ""),
                                    ("_segment_carry_kernel", ""), ("_segment_adjoint_carry_kernel", ""),
                                    ("_segment_map_kernel", "ADJOINT=True")]}
    for name, found in pipelined.items():
        assert found, (name, res.stdout[-4000:])
        for line in found:
            assert int(re.search(r"async copies +(\d+)", line).group(1)) > 0, line
