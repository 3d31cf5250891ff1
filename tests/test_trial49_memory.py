"""Trial 49, the memory command: the largest-batch search is bounded (a cap on the rows searched, a time budget,
progress on stderr) and says when its answer is a lower bound, in words and in ``--json``; the named GPUs' memory
is the driver's figure (nvidia-smi's MiB), not a datasheet's GB read as GiB."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import require_devices

from shardcheck import ahead_of_time, device_memory
from shardcheck.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _replay(monkeypatch, peak_of, rounds: list, seconds_a_round: float = 0.0) -> None:
    """Compiles replaced by ``peak_of(batch_size)``; each round's sizes appended to ``rounds``, and the search's
    clock moved on by ``seconds_a_round`` a round."""
    clock = [0.0]
    monkeypatch.setattr(ahead_of_time.time, "monotonic", lambda: clock[0])

    def fake_compile_batch_sizes(task, mesh, sizes, *, strategy):
        rounds.append(list(sizes))
        clock[0] += seconds_a_round
        return {b: type("Compiled", (), {"peak_bytes": peak_of(b)})() for b in sizes}

    monkeypatch.setattr(ahead_of_time, "compile_batch_sizes", fake_compile_batch_sizes)


def test_a_tiny_model_on_a_large_device_stops_at_the_cap_and_says_at_least(monkeypatch):
    """Trial 49: 20 KB of state and 4 B a row on 16 GiB. The line through 1 and 2 rows crosses the limit at ~4.3e9
    rows, which the search compiled (XLA constant-folded per-row arrays for minutes); it now compiles the cap,
    65,536 rows a batch shard, once: it fits, so the answer is "at least" the cap, a lower bound."""
    rounds = []
    _replay(monkeypatch, lambda b: 20_000 + 4 * b, rounds)
    memory = 16 * 2**30
    found, peaks = ahead_of_time.largest_batch_that_fits(None, None, memory, strategy="replicated")
    cap = ahead_of_time.MAX_ROWS_PER_SHARD
    assert cap == 65_536 and rounds == [[1, 2], [cap]] and found == cap
    assert max(peaks) == cap  # before: 4,294,962,296 rows compiled
    bounds = ahead_of_time.search_bounds(found, peaks, memory, 1)
    assert bounds == {
        "largest_batch_size": cap,
        "largest_batch_is_lower_bound": True,
        "smallest_failing_batch_size": None,
    }
    rounds.clear()
    found, peaks = ahead_of_time.largest_batch_that_fits(
        None, None, memory, strategy="replicated", max_batch_size=101
    )
    assert found == 101 and rounds == [[1, 2], [101]]


def test_below_the_cap_the_search_is_unchanged_and_exact(monkeypatch):
    """A line that crosses the limit at 37 rows: 1 and 2, then 37 and 38 (38 fails): exact, not a bound."""
    rounds = []
    _replay(monkeypatch, lambda b: 1_000 + 10 * b, rounds)
    found, peaks = ahead_of_time.largest_batch_that_fits(None, None, 1_370, strategy="replicated")
    assert found == 37 and rounds == [[1, 2], [37, 38]]
    assert ahead_of_time.search_bounds(found, peaks, 1_370, 1) == {
        "largest_batch_size": 37,
        "largest_batch_is_lower_bound": False,
        "smallest_failing_batch_size": 38,
    }
    assert ahead_of_time.search_bounds(0, {1: 2_000}, 1_370, 1)["largest_batch_is_lower_bound"] is False


def test_the_time_budget_stops_the_search_between_rounds_and_the_answer_says_so(monkeypatch):
    """The 1b step's XLA:GPU peaks for an H100 (flattened by remat near the limit: the search needs 4 rounds),
    each round taking 30 s: with 60 s a third round would end past the budget, so the search stops after two
    with 4 rows fitting and 6 not (5 untried): "at least 4, fewer than 6". Progress names each round's sizes."""
    peaks_1b = {1: 33_676_253_908, 2: 55_672_464_340, 3: 63_032_404_940, 4: 64_346_264_524}
    peaks_1b.update({5: 71_712_857_804, 6: 91_129_112_268, 7: 99_000_000_000})
    memory = 80 * 2**30
    rounds, seen = [], []
    _replay(monkeypatch, peaks_1b.__getitem__, rounds, seconds_a_round=30.0)
    found, peaks = ahead_of_time.largest_batch_that_fits(
        None, None, memory, strategy="replicated", time_budget_s=None
    )
    assert found == 5 and rounds == [[1, 2], [3, 4], [5, 6]]  # unbounded: exact
    rounds.clear()
    found, peaks = ahead_of_time.largest_batch_that_fits(
        None,
        None,
        memory,
        strategy="replicated",
        time_budget_s=60.0,
        progress=lambda sizes, s: seen.append((sizes, s)),
    )
    assert rounds == [[1, 2], [3, 4]] and found == 4 and seen == [([1, 2], 0.0), ([3, 4], 30.0)]
    bounds = ahead_of_time.search_bounds(found, peaks, memory, 1)
    assert bounds["largest_batch_is_lower_bound"] is True and bounds["smallest_failing_batch_size"] is None
    from shardcheck.cli.memory import _largest_text

    text = _largest_text(found, peaks, memory)
    assert text.startswith("largest batch that fits: at least 4 (") and "budget ran out" in text
    between = _largest_text(4, {1: 1, 2: 2, 4: 4, 6: 99}, 10)
    assert between.startswith("largest batch that fits: at least 4, fewer than 6")
    assert _largest_text(5, {1: 1, 5: 5, 6: 99}, 10) == "largest batch that fits: 5"


@require_devices(4)
def test_json_says_the_largest_batch_is_a_lower_bound(capsys, monkeypatch):
    """digits on fsdp=4 with 1 GiB: the cap (here 16 rows a shard: 64) fits, so the text says "at least 64, the
    largest searched" and --json carries largest_batch_is_lower_bound: true (before: only largest_batch_size,
    the "at least" lost); the search's progress goes to stderr."""
    monkeypatch.setattr(ahead_of_time, "MAX_ROWS_PER_SHARD", 16)
    args = ["--task", "digits", "--mesh", "fsdp=4", "--device-memory", "1GiB", "--batch-size", "16"]
    assert main(["memory", *args, "--json", "-"]) == 0
    out = capsys.readouterr()
    fit = json.loads(out.out)["strategies"]["fsdp"]["device_memory"]
    assert fit["largest_batch_size"] == 64 and fit["largest_batch_is_lower_bound"] is True
    assert fit["smallest_failing_batch_size"] is None
    assert list(fit["peak_bytes_by_batch_size"]) == ["4", "8", "64"]  # the probes, then the cap
    err = " ".join(out.err.split())
    assert "largest batch that fits: at least 64, the largest searched" in err
    assert "largest-batch search compiling batch 64" in err
    # trial 49: "does not fit" exited 0 like "fits" (above, 0); now 1, the JSON written all the same
    assert main(["memory", *args[:-2], "--device-memory", "7KiB", "--json", "-"]) == 1
    fit = json.loads(capsys.readouterr().out)["strategies"]["fsdp"]["device_memory"]
    assert fit["largest_batch_size"] == 0 and fit["largest_batch_is_lower_bound"] is False


@pytest.mark.parametrize(
    "kind, mib",
    [("h100", 81_559), ("h200", 143_771), ("a100-40gb", 40_960), ("a100-80gb", 81_920), ("l4", 23_034)],
)
def test_a_gpus_memory_is_its_drivers_mib_and_its_label_says_that_figure(kind, mib):
    """Before: h100 80 GiB (85,899,345,920 B, more than the card's 81,559 MiB), l4 24 GiB (more than the card
    holds), h200 141e9 B, labelled "80 GB" / "24 GB" / "141 GB" in a mix of GB and GiB."""
    size, label = device_memory.parse_device_memory(kind)
    assert size == mib * 2**20
    assert f"{mib:,} MiB" in label and "nvidia-smi" in label
    assert not re.search(r"\b\d+ GB\b,", label)  # no datasheet GB given as the figure used
    target = (ROOT / "src" / "shardcheck" / "gpu_targets" / f"{kind}.txtpb").read_text()
    assert f"device_memory_size: {size}\n" in target


def test_the_h200_figure_is_the_one_recorded_on_the_measured_h200():
    measured = json.loads((ROOT / "benchmarks" / "gpu_results.json").read_text())["measured"]
    assert "143771 MiB" in measured
    assert device_memory.DEVICE_KINDS["h200"].memory_bytes == 143_771 * 2**20 == 150_754_820_096
    assert device_memory.DEVICE_KINDS["l4"].memory_bytes == 24_152_899_584 < 24 * 2**30
    assert device_memory.DEVICE_KINDS["h100"].memory_bytes == 85_520_809_984 < 80 * 2**30
