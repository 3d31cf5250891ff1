"""What a failing run came to after its first failing step: the candidate's values going non-finite, said once
after the findings (trial 52: a per-shard normalization named at step 0 went on to NaN at step 2, every table
row showed ``nan`` there, and no sentence said so)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardcheck.parity.diagnosis.evidence import Diagnosis, StepRecord
from shardcheck.parity.diagnosis.rules import _non_finite


def later_non_finite(records: Sequence[StepRecord]) -> Diagnosis | None:
    """A ``non_finite`` note for the first step after the first failing one where the candidate's loss or values
    are NaN or infinite while the reference's are finite; ``None`` where none is, or the first failing step is
    itself the non-finite one (its own finding says so)."""
    first = next((r for r in records if not r.ok), None)
    if first is None or _non_finite(first):
        return None
    later = next((r for r in records if r.step > first.step and _non_finite(r)), None)
    if later is None:
        return None
    loss = later.candidate_loss
    what = (
        f"the candidate's loss is {loss}"
        if loss is not None and not math.isfinite(loss)
        else "the candidate holds NaN or infinite values"
    )
    bad = _non_finite(later)
    return Diagnosis(
        "non_finite",
        f"From step {later.step} {what} (first in {bad[0].name}), where the reference's are finite: what the "
        f"failure at step {first.step} led to, or another fault of the step; fix the first failure first.",
        bad[0].name,
    )


def with_later_non_finite(findings: Sequence[Diagnosis], records: Sequence[StepRecord]) -> list[Diagnosis]:
    """``findings`` with :func:`later_non_finite`'s note last, where there is one."""
    note = later_non_finite(records)
    return list(findings) if note is None else [*findings, note]
