"""The compute-sanitizer workload ``benchmarks/memcheck_asym.py`` runs (here on a tiny case, through the
interpreter on the CPU) and reports finite outputs and gradients for every gate and dtype it is given (the gated
ones also under strong gates)."""
import pytest

from benchmarks import memcheck_asym


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_memcheck_workload_runs(gate, monkeypatch, capsys):
    monkeypatch.setattr(memcheck_asym, "T", 9)
    monkeypatch.setattr(memcheck_asym, "CASES", [(16, 16, [0, 4, 9])])
    memcheck_asym.main([gate, "--dtypes", "bfloat16,float32"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == (2 if gate == "none" else 4) and all(line.endswith("non-finite []") for line in lines), lines
