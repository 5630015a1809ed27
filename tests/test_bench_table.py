"""The benchmark table (``python -m osdn_ops.bench``): columns, and ratios to the best fla peer."""
import math

from osdn_ops.bench import Row, main, table


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_table_has_kernel_time_and_its_ratio():
    rows = [Row("chunk_delta_asym", "osdn", "S1", fwd=1.0, fwd_bwd=3.0, gpu_fwd_bwd=2.0, err=1e-3),
            Row("chunk_delta_rule", "fla", "S1", fwd=2.0, fwd_bwd=2.0, gpu_fwd_bwd=1.0, err=1e-3)]
    lines = table(rows).splitlines()
    head = _cells(lines[0])
    assert len(lines) == 4 and all(len(_cells(x)) == len(head) for x in lines[2:])
    ours = dict(zip(head, _cells(lines[2])))
    assert ours["fwd+bwd kernel ms"] == "2.000"
    assert ours["kernel ms / best peer"] == "2.00"
    assert ours["fwd+bwd / best peer"] == "1.50"
    assert ours["fwd / best peer"] == "0.50"


def test_table_leaves_unmeasured_kernel_time_empty():
    """On the CPU (no profiler kernel times) the kernel columns stay empty rather than showing nan."""
    line = table([Row("chunk_delta_asym", "osdn", "S1", fwd=1.0, fwd_bwd=3.0)]).splitlines()[2]
    assert "nan" not in line
    head = _cells(table([]).splitlines()[0])
    assert dict(zip(head, _cells(line)))["fwd+bwd kernel ms"] == ""


def test_cli_runs_fp32_inputs_on_the_cpu(tmp_path):
    """``--dtype fp32``: the rows are timed and checked against the float64 reference in that dtype."""
    md = tmp_path / "t.md"
    rows = main(["--ops", "chunk_delta_asym", "--shapes", "S1", "--impls", "osdn", "--dtype", "fp32",
                 "--device", "cpu", "--markdown", str(md)])
    assert len(rows) == 1 and rows[0].note == ""
    assert rows[0].fwd > 0 and rows[0].fwd_bwd > 0
    assert math.isfinite(rows[0].err) and rows[0].err < 1e-5      # fp32 kernels: far below bf16's ~1e-2
    assert "chunk_delta_asym" in md.read_text()
