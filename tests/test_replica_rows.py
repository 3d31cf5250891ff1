"""A FAIL found only by the replicas check has a row of its own (issue #36, trial 6: a local clip under shard_map).

Every leaf within tolerance and the copies of 40 replicated leaves different along 'model': the per-strategy
table read PASS on every row under a FAIL title, and the summary's worst leaf was a leaf within tolerance. The
table now adds a ``replicas`` row (the first mismatched leaf, its step, the count and the axes, FAIL), the summary
names the replicas where they are the only failure, and ``to_dict`` adds ``replica_failure``; a run whose
replicas agree keeps its rows, and a run with a failing leaf keeps that leaf as its worst.
"""

from __future__ import annotations

import io

from rich.console import Console

from shardcheck.cli.verify import render_report, render_summary
from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord
from shardcheck.parity.report import ParityReport, ReplicaFailure


def _report(replicas: bool, failing_leaf: bool = False) -> ParityReport:
    """Two steps; the mismatch (2 leaves along 'model') at step 1; ``failing_leaf``: the gradient out of tolerance."""
    records = []
    for t in (0, 1):
        leaves = (
            LeafError(t, "loss", "loss", 2e-6, 1e-6, 1e-3, True),
            LeafError(t, "grad", "w", 3e-3 if failing_leaf else 3e-6, 1e-3, 1e-4, not failing_leaf),
            LeafError(t, "opt_state", "0.mu.w", 4.6e-6, 9e-5, 2.18e-5, True),
        )
        differ = ("opt_state 0.mu.b", "param b") if replicas and t == 1 else ()
        records.append(
            StepRecord(
                t, 1e-5, 1e-6, 1.0, 1.0, leaves, t + 1, t + 1, differ, replica_axes=("model",) * bool(differ)
            )
        )
    ok = not (replicas or failing_leaf)
    codes = ("parity",) if ok else ("replicas_differ",)
    return ParityReport("candidate", ok, tuple(records), tuple(Diagnosis(c, c) for c in codes))


def _rows(table) -> list[list[str]]:
    """The table's body rows as rendered, each a list of its cells' text."""
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(table)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in lines]


def test_a_replica_only_failure_has_its_own_row_and_is_the_summarys_worst():
    report = _report(replicas=True)
    assert report.verdict == "FAIL" and report.only_replicas_fail
    assert report.replica_failure == ReplicaFailure(1, "opt_state 0.mu.b", 2, ("model",))
    rows = _rows(render_report(report, "setup"))
    assert [r[-1] for r in rows] == ["PASS", "PASS", "PASS", "FAIL"]
    cell = "opt_state 0.mu.b (2 leaves along 'model' differ across devices)"
    assert rows[-1] == ["replicas", cell, "1", "-", "-", "-", "FAIL"]
    assert _rows(render_summary({"candidate": report}, "setup")) == [
        ["candidate", "FAIL", f"replicas: {cell}", "-", "-", "-", "replicas_differ"]
    ]
    d = report.to_dict()
    assert d["replica_failure"] == {
        "step": 1,
        "leaf": "opt_state 0.mu.b",
        "leaves": 2,
        "axes": ["model"],
        "downstream": "",
    }
    # the existing fields keep their meaning: the worst leaf by error / tolerance, every mismatched leaf
    assert d["worst_leaf"] == "opt_state 0.mu.w" and d["replica_mismatches"] == [
        "opt_state 0.mu.b",
        "param b",
    ]
    assert "  replicas  opt_state 0.mu.b at step 1: 2 leaves along 'model' FAIL" in str(report).splitlines()


def test_agreeing_replicas_add_no_row_and_a_failing_leaf_stays_the_worst():
    passing = _report(replicas=False)
    assert passing.replica_failure is None and passing.to_dict()["replica_failure"] is None
    assert [r[0] for r in _rows(render_report(passing, "setup"))] == ["loss", "grad", "opt_state"]
    assert _rows(render_summary({"candidate": passing}, "setup"))[0][:6] == [
        "candidate",
        "PASS",
        "opt_state 0.mu.w",
        "4.6e-06",
        "9e-05",
        "2.18e-05",
    ]
    both = _report(replicas=True, failing_leaf=True)
    assert (
        not both.only_replicas_fail and [r[0] for r in _rows(render_report(both, "setup"))][-1] == "replicas"
    )
    assert _rows(render_summary({"candidate": both}, "setup"))[0][:6] == [
        "candidate",
        "FAIL",
        "grad w (step 0)",
        "0.003",
        "0.001",
        "0.0001",
    ]
