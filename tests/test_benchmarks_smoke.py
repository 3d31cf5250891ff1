"""Smoke run of ``benchmarks/run.py`` at tiny sizes, so the benchmark cannot rot.

It checks that the script runs, prints the ratio table and writes every field as a finite number. It never
asserts a time: timings belong to the benchmark's own table, not to the test suite.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run.py"

RATIOS = (
    "sim_stream_over_full",
    "sim_saved_over_full",
    "full_over_matmul",
    "compile_s128_over_s1",
    "stream_temp_s128_over_s8",
    "fsdp_temp_over_dp_temp",
    "repeat_call_ms",
    "compile_s128_over_s2",
    "parity_over_steps_dp",
    "parity_over_steps_fsdp",
    "parity_over_steps_tiny_lm",
    "parity_over_steps_tiny_lm_accumulation",
    "cli_run_s",
    "cli_verify_s",
    "cli_help_s",
    "cold_verify_tiny_lm_s",
    "cold_verify_tiny_lm_over_bare",
    "cold_verify_bf16_s",
)
NOT_QUICK = (  # minutes of compiling: full runs only
    "parity_over_steps_tiny_lm",
    "parity_over_steps_tiny_lm_accumulation",
    "cli_run_s",
    "cli_verify_s",
    "cold_verify_tiny_lm_s",
    "cold_verify_tiny_lm_over_bare",
    "cold_verify_bf16_s",
)
TIMED_ROWS = ("full", "sim_saved", "sim_stream", "matmul_bound", "naive_eager", "dp", "fsdp")
MEMORY_ROWS = ("full", "sim_saved", "sim_stream", "matmul_bound", "dp", "fsdp")
MEMORY_FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def test_benchmark_quick_run_writes_every_field(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a performance assertion
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())

    assert set(r["ratios"]) == set(RATIOS)
    for key, value in r["ratios"].items():
        assert value is None if key in NOT_QUICK else _finite(value), (key, value)
        assert key in proc.stdout  # printed beside its target
    for key in RATIOS:
        t = r["targets"][key]
        assert _finite(t["target"])
        if key in NOT_QUICK:
            assert t["value"] is None and t["met"] is None and t["why_not"]
            continue
        assert _finite(t["value"]) and isinstance(t["met"], bool)
        assert t["met"] or t["why_not"]  # a missed target says why
    for strategy in ("dp", "fsdp"):
        row = r["harness"]["rows"][strategy]
        assert row["ok"] and _finite(row["check_parity_s"]) and _finite(row["bare_steps_s"])
    assert all(_finite(v) for v in r["harness"]["profile_dp"]["cumulative_s"].values())
    assert r["cli"]["help"]["returncode"] == 0

    for row in TIMED_ROWS:
        t = r["timing"][row]
        assert t["what"]
        assert all(_finite(t[f]) for f in ("median_s", "min_s", "p25_s", "p75_s")), (row, t)
        assert t["repeats"] >= 1
    for row in ("full", "sim_saved", "dp", "fsdp"):
        assert _finite(r["timing"][f"{row}_public"]["host_overhead_s"])
    for row in MEMORY_ROWS:
        assert all(isinstance(r["memory"][row][f], int) for f in MEMORY_FIELDS), row
    for mode in ("saved", "stream"):
        for stats in r["sim_memory_by_shards"][mode].values():
            assert all(isinstance(stats[f], int) for f in MEMORY_FIELDS)
        for stats in r["compile"][mode].values():
            assert all(_finite(stats[f]) for f in ("trace_lower_s", "xla_compile_s", "total_s"))
    for strategy in ("dp", "fsdp"):
        assert isinstance(r["fsdp_vs_dp_memory"][strategy]["temp_bytes"], int)
    assert _finite(r["latency"]["seed000_numpy_ms"]) and _finite(r["latency"]["seed001_numpy_ms"])
    assert all(_finite(v) for v in r["other_ratios"].values())
    assert all(
        v < 1e-4 for v in r["checks"].values()
    )  # the simulation and the naive loop match the full batch
    m = r["machine"]
    assert m["cpu_count"] >= 1 and m["jax_version"] and m["backend"]
