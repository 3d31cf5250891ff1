"""A table row whose reference leaf lies within its allowed error of 0 marks its relative error (trial 50).

A passing row read "grad blocks.linear.bias | 2.09e-07 | 1.08 | 1.35e-06 | PASS" (a bias before a BatchNorm,
whose true gradient is 0): a relative error of 108% beside PASS. Such a leaf's relative error says nothing; the
row now reads ``1.08 (|ref| <= allowed)`` and one line says why, in the strategy's table, the summary and
``str(report)``; ``--json``'s ``worst_by_kind`` entries say it as ``reference_within_tolerance``.
"""

import io
import math

import pytest
from rich.console import Console

from shardcheck.cli.verify import render_report, render_summary
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.report import ROUNDING_MARK, ROUNDING_NOTE, ParityReport


def _leaf(kind, path, abs_err, rel, tol, **fields):
    return LeafError(0, kind, path, abs_err, rel, tol, abs_err <= tol, **fields)


def _report(*leaves, ok=True):
    return ParityReport(
        "dp", ok, (StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, tuple(leaves), 1, 1),), (), num_shards=2
    )


def _text(table) -> str:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    return out.getvalue()


@pytest.mark.parametrize(
    ("abs_err", "rel", "tol", "marked"),
    [
        (2.09e-7, 1.08, 1.35e-6, True),  # the trial's row: max |ref| 1.94e-7 <= 1.35e-6
        (1e-7, math.inf, 1e-6, True),  # the reference all 0
        (1e-6, 1.0, 1e-6, True),  # max |ref| == the allowed error
        (2.09e-7, 1e-3, 1.35e-6, False),  # max |ref| 2.09e-4: a leaf of its own size
        (5e-6, 3.0, 1e-6, False),  # a FAIL whose reference (1.67e-6) is larger than its allowed error
        (0.0, 0.0, 1e-6, False),  # nothing differs: no relative error to explain
        (0.0, 0.0, 0.0, False),  # a counter: exact
        (math.inf, math.inf, 0.0, False),  # a leaf in one run only (below)
    ],
)
def test_a_relative_error_is_marked_where_the_reference_is_within_its_allowed_error_of_0(
    abs_err, rel, tol, marked
):
    assert _leaf("grad", "b", abs_err, rel, tol).reference_within_tolerance is marked


def test_a_leaf_with_no_difference_of_its_own_is_not_marked():
    assert not _leaf("opt_state", "0.mu.b", math.inf, math.inf, 1e-6, missing=True).reference_within_tolerance
    assert not _leaf("param", "b", math.inf, math.inf, 1e-6, cand_shape=(3,)).reference_within_tolerance
    assert not _leaf("counter", "step", 1.0, 1.0, 1.0, dtypes=("int32", "float32")).reference_within_tolerance


def test_the_tables_mark_the_row_and_say_why_once():
    bias = _leaf("grad", "blocks.linear.bias", 2.09e-7, 1.08, 1.35e-6)
    kernel = _leaf("param", "blocks.linear.kernel", 2e-8, 6e-8, 1e-5)
    report = _report(bias, kernel)
    text = " ".join(_text(render_report(report, "setup")).split())
    assert f"│ grad │ blocks.linear.bias │ 0 │ 2.09e-07 │ 1.08{ROUNDING_MARK} │ 1.35e-06 │ PASS │" in text
    assert "│ param │ blocks.linear.kernel │ 0 │ 2e-08 │ 6e-08 │ 1e-05 │ PASS │" in text
    assert text.count(ROUNDING_MARK) == 2 and " ".join(ROUNDING_NOTE.split()) in text  # the row and the note
    summary = " ".join(_text(render_summary({"dp": report}, "setup")).split())
    assert (
        f"│ 2.09e-07 │ 1.08{ROUNDING_MARK} │ 1.35e-06 │" in summary
        and " ".join(ROUNDING_NOTE.split()) in summary
    )
    # a table with no such row says nothing of it
    plain = _report(kernel)
    assert ROUNDING_MARK not in _text(render_report(plain, "setup"))
    assert ROUNDING_MARK not in _text(render_summary({"dp": plain}, "setup"))


def test_the_reports_text_and_json_say_it_too():
    bias = _leaf("grad", "blocks.linear.bias", 2.09e-7, 1.08, 1.35e-6)
    kernel = _leaf("param", "blocks.linear.kernel", 2e-8, 6e-8, 1e-5)
    text = str(_report(bias, kernel))
    assert (
        f"worst leaf: grad blocks.linear.bias at step 0: max abs err 2.09e-07, rel 1.08{ROUNDING_MARK},"
        in text
    )
    assert f"rel 1.08{ROUNDING_MARK} tol 1.35e-06" in " ".join(text.split())
    assert text.count(ROUNDING_NOTE) == 1 and ROUNDING_MARK not in text.split("param")[1].split("\n")[0]
    kinds = _report(bias, kernel).to_dict()["worst_by_kind"]
    assert kinds["grad"]["reference_within_tolerance"] is True
    assert kinds["param"]["reference_within_tolerance"] is False
    assert ROUNDING_NOTE not in str(_report(kernel))


def test_a_long_note_a_run_said_for_an_earlier_strategy_is_said_once():
    # tiny-lm's 6-line rounding_level note and the 3-line footnote had been printed in full under every strategy
    import dataclasses

    bias = _leaf("grad", "blocks.linear.bias", 2.09e-7, 1.08, 1.35e-6)
    dp = _report(bias)
    fsdp = dataclasses.replace(dp, strategy="fsdp")
    said: dict[str, str] = {}
    first = " ".join(_text(render_report(dp, "setup", said=said)).split())
    second = " ".join(_text(render_report(fsdp, "setup", said=said)).split())
    assert " ".join(ROUNDING_NOTE.split()) in first
    assert f"rel err{ROUNDING_MARK}: the same as for dp, above" in second
    assert " ".join(ROUNDING_NOTE.split()) not in second
    assert second.count("setup") == 1  # the setup line, short, is said under every table
    alone = " ".join(_text(render_report(fsdp, "setup")).split())  # without a run's record: all of it
    assert " ".join(ROUNDING_NOTE.split()) in alone
