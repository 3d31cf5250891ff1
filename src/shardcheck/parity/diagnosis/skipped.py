"""Steps the reference's optimizer skipped, said once in a report (``skipped_step``).

A mixed-precision step whose batch overflows gives a loss and gradients that are not finite; an optimizer wrapped
in ``optax.apply_if_finite`` (or a loss-scale check) then leaves the parameters and the optimizer state as they
were and counts the step (``notfinite_count``). That is no divergence of the reference: the check goes on, the
loss and gradients of such a step are compared by finiteness (both not finite matches; one side only fails), the
parameters, the optimizer state and the counters as always (``StepRecord.skipped``, ``LeafError.finite``). A
reference whose parameters or optimizer state go non-finite still stops the check (``reference_diverged``).
:func:`skipped_note` says what the reference did at its first skipped step and what the candidate did there.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord

UPDATE_KINDS = ("param", "opt_state", "counter")
"""The leaves a skipped step's update shows in: the parameters, the optimizer state and the counters."""

NOUNS = {"param": "parameters", "opt_state": "optimizer-state leaves", "counter": "counters"}


def _which(leaves: Sequence[LeafError], side: int, finite: bool) -> str:
    """``"loss and gradients"``, ``"loss"``, ``"gradients"`` or ``""``: the kinds among ``leaves`` compared by
    finiteness whose ``side`` (0: the reference's, 1: the candidate's) is finite (``finite``) or not."""
    kinds = [k for k in ("loss", "grad") if any(e.kind == k and e.finite[side] is finite for e in leaves)]
    words = {"loss": "loss", "grad": "gradients"}
    return " and ".join(words[k] for k in kinds)


def _listed(names: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _reference_clause(record: StepRecord) -> str:
    """What the reference did at its skipped step: which of its loss and gradients are not finite, and that its
    optimizer left the parameters as they were (a skipped step's are exactly as before it)."""
    by_finiteness = [e for e in record.leaves if e.finite is not None]
    what = _which(by_finiteness, 0, False) or "loss or gradients"
    verb = "is" if what == "loss" else "are"
    return (
        f"{_whose(record)} {what} {verb} not finite and its optimizer left the parameters as they were (a step "
        "skipped by optax.apply_if_finite or a loss-scale check; no divergence)"
    )


def _whose(record: StepRecord) -> str:
    """Whose run the candidate is compared with: ``"the reference's"`` live, ``"the recording's"`` in a replay."""
    return "the recording's" if record.replayed else "the reference's"


def _candidate_clause(record: StepRecord, earlier: bool = False) -> str:
    """What the candidate did at the reference's skipped step: its loss and gradients by finiteness, then its
    update (the parameters, optimizer state and counters, compared as always), or its copies differing across
    devices (:func:`_copies_clause`; ``earlier``: they differed before this step)."""
    by_finiteness = [e for e in record.leaves if e.finite is not None]
    finite_there = _which(by_finiteness, 1, True)
    not_finite = _which(by_finiteness, 1, False)
    parts = []
    if not_finite:
        verb = "is" if not_finite == "loss" else "are"
        parts.append(f"the candidate's {not_finite} {verb} not finite there too")
    if finite_there:
        verb = "is" if finite_there == "loss" else "are"
        whose = "its" if parts else "the candidate's"
        parts.append(f"{whose} {finite_there} {verb} finite there, where {_whose(record)} {verb} not")
    update = [e for e in record.leaves if e.kind in UPDATE_KINDS]
    copies = _copies_clause(record, earlier)
    if all(e.ok for e in update) and copies:
        return "; ".join([*parts, copies])
    if all(e.ok for e in update):
        said = "its update matches (the parameters, the optimizer state and the counters)"
        return "; ".join(parts) + (" and " if parts else "") + said
    params = [e for e in update if e.kind == "param"]
    bad = {k: [e.name for e in update if e.kind == k and not e.ok] for k in UPDATE_KINDS}
    bad["counter"].sort(key=lambda name: "finite" not in name)  # apply_if_finite's own counters first
    shown = [f"{len(v)} of {sum(e.kind == k for e in update)} {NOUNS[k]}" for k, v in bad.items() if v]
    counters = f" ({_listed(bad['counter'])})" if bad["counter"] else ""
    what = (
        f"it applied an update where {'the recorded run' if record.replayed else 'the reference'} skipped one"
        if any(not e.ok for e in params)
        else "its update differs"
    )
    return "; ".join([*parts, f"{what}: {', '.join(shown)} differ{counters}"])


def _copies_clause(record: StepRecord, earlier: bool = False) -> str:
    """Where a replicated leaf's copies differ across devices at the skipped step (``StepRecord.
    replica_mismatches``): that some devices stepped while others skipped (issue #36 trial 48: each device's own
    finiteness check, not agreed by a psum, read "its update matches" beside 14 leaves whose copies differ: the
    copy compared is one device's); ``""`` where they agree. ``earlier``: copies differed at an earlier step
    already (then the skip is not named as their cause)."""
    names = list(record.replica_mismatches)
    if not names:
        return ""
    said = f"its copies of {len(names)} replicated leaves ({_listed(names)}) differ across devices"
    if earlier:
        return said + " (as at an earlier step)"
    return (
        f"{said} at a step {'the recorded run' if record.replayed else 'the reference'} skipped: some devices "
        "stepped where others skipped "
        "(a finiteness check not agreed across the devices, e.g. without a psum of the flags)"
    )


def skipped_note(records: Sequence[StepRecord]) -> Diagnosis | None:
    """``skipped_step``: the first step the reference's optimizer skipped (``StepRecord.skipped``), in plain words,
    with the later ones counted; ``None`` where the reference skipped none. E.g. "Step 2: the reference's loss and
    gradients are not finite and its optimizer left the parameters as they were (a step skipped by
    optax.apply_if_finite or a loss-scale check; no divergence); the candidate's loss and gradients are not
    finite there too and its update matches (the parameters, the optimizer state and the counters)."."""
    skipped = [r for r in records if r.skipped]
    if not skipped:
        return None
    first = skipped[0]
    more = [str(r.step) for r in skipped[1:]]
    who = "The recorded run" if first.replayed else "The reference"
    also = f" {who} skipped step{'s' if len(more) > 1 else ''} {', '.join(more)} too." if more else ""
    failing = next((e for e in first.leaves if not e.ok), None)
    earlier = any(r.replica_mismatches for r in records if r.step < first.step)
    message = f"Step {first.step}: {_reference_clause(first)}; {_candidate_clause(first, earlier)}.{also}"
    return Diagnosis("skipped_step", message, None if failing is None else failing.name)


def with_skipped(findings: Sequence[Diagnosis], records: Sequence[StepRecord]) -> list[Diagnosis]:
    """``findings`` with :func:`skipped_note` added once: second where the first failing step is a skipped one
    (after the leading finding, which stays the report's cause; the reader needs it to read the rest), else last;
    as they are where no step was skipped."""
    note = skipped_note(records)
    if note is None:
        return list(findings)
    first = next((r for r in records if not r.ok), None)
    if first is not None and first.skipped:
        return [*findings[:1], note, *findings[1:]]
    return [*findings, note]


__all__ = ["skipped_note", "with_skipped"]
