"""What a check did with the model's floating state beside its parameters (``state model.<path>`` leaves,
:mod:`shardcheck.parity.comparison.model_state`), in the words a PASS says it: the leaves it did not compare (the
candidate's step writes them, the reference's does not, the loss does not read them; and the integer counters
the loss neither reads nor writes that the candidate's step keeps alone) and those both steps write, compared
coarsely on their change."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord


def family(path: str) -> str:
    """A leaf path with every integer component starred: ``model.ema.3`` -> ``model.ema.*``,
    ``model.layers.0.bn.mean`` -> ``model.layers.*.bn.mean`` (an ``nnx.List``'s items named by their container)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)


# more families than this are said by their containers (``model.ema.*``): trial 37's 16 EMA leaves, keyed
# ``layers/0/msg/kernel`` in an nnx.Dict, were listed one by one
MOST_FAMILIES = 3


def _family_counts(paths: set[str]) -> dict[str, int]:
    """``{family: leaves}``: :func:`family` of each path; where that leaves more than :data:`MOST_FAMILIES`, each
    container's leaves as one (``model.ema.head1/bias`` ... -> ``model.ema.*``)."""
    counts: dict[str, int] = {}
    for p in sorted(paths):
        counts[family(p)] = counts.get(family(p), 0) + 1
    if len(counts) <= MOST_FAMILIES:
        return counts
    grouped: dict[str, int] = {}
    for f, n in counts.items():
        parent = f"{f.rsplit('.', 1)[0]}.*" if "." in f else f
        grouped[parent] = grouped.get(parent, 0) + n
    return grouped


def _families(paths: set[str], kind: str = "state ") -> str:
    """``"state model.ema.* (11 leaves)"`` or ``"state model.bn.mean"``, each family once, joined by commas."""
    counts = _family_counts(paths)
    return ", ".join(f"{kind}{f}" + (f" ({n} leaves)" if n > 1 else "") for f, n in counts.items())


def families(paths: set[str]) -> str:
    """:func:`_families` without the ``state`` before each: ``"model.ema.* (16 leaves)"``."""
    return _families(paths, "")


def _is(paths: set[str]) -> str:
    """``"is"`` after :func:`_families` of ``paths`` where it names one family (``"The model's state
    model.ema.* (16 leaves) is"``), ``"are"`` where it names several."""
    return "is" if len(_family_counts(paths)) == 1 else "are"


def step_written(record: StepRecord, e: LeafError) -> bool:
    """Whether ``e``, a ``state`` leaf the reference's step writes, is written by the step and not by its forward
    pass: the task's loss run alone does not write it (``StepRecord.forward_writes``; ``False`` where that is not
    known); or ``e`` is a model counter (``counter model.<path>``) the task's loss neither reads nor writes
    (``StepRecord.loss_counters``: a step count the step keeps for a target network's sync)."""
    if e.kind == "counter" and e.path.startswith("model."):
        return record.loss_counters is not None and e.path not in record.loss_counters
    written = record.forward_writes
    return e.kind == "state" and bool(e.reference_change) and written is not None and e.path not in written


def state_notes(records: Sequence[StepRecord]) -> str:
    """The sentences (``""`` where there is nothing to say) naming the floating state the check did not compare
    and the state both steps write that it compared coarsely (tolerance ``inf`` and ``reference_change`` > 0
    leaves of the records, live or replayed)."""
    state = [e for r in records for e in r.leaves if e.kind == "state"]
    skipped = {e.path for e in state if math.isinf(e.tolerance)}
    coarse = {e.path for e in state if e.reference_change and not math.isinf(e.tolerance)} - skipped
    out = []
    if skipped and any(r.replayed for r in records):  # the recording may be of a step that writes it too
        out.append(
            f"The model's {_families(skipped)} {_is(skipped)} neither read nor written by the task's loss: not compared, as a "
            "live check leaves it (the task's reference step does not write it)."
        )
    elif skipped:
        out.append(
            f"The model's {_families(skipped)} {_is(skipped)} written by the candidate's step only and not read by the loss: "
            "not compared (the reference's step does not write it)."
        )
    counters = {e.path for r in records for e in r.leaves if e.kind == "counter" and math.isinf(e.tolerance)}
    if counters:  # a count only the candidate's step keeps (a target network's sync count)
        out.append(
            f"The model's {_families(counters, 'counter ')} {_is(counters)} written by the candidate's step only "
            "and neither read nor written by the loss: not compared (the reference's step does not write it; to "
            "compare it, pass a reference step that writes it: verify --reference FILE:FUNCTION, "
            "check_parity(reference=...))."
        )
    if coarse:
        out.append(
            f"{len(coarse)} {'leaf' if len(coarse) == 1 else 'leaves'} of floating state written by both steps "
            f"({_families(coarse)}) compared coarsely, on each step's change: a difference of more than half the "
            "reference's largest change fails (no rounding tolerance is derived for such state)."
        )
    return " ".join(out)


def not_compared(records: Sequence[StepRecord]) -> int:
    """How many leaves of the records' model state were not compared (tolerance ``inf``): floating state and
    counters only the candidate's step writes."""
    return len(
        {
            (e.kind, e.path)
            for r in records
            for e in r.leaves
            if e.kind in ("state", "counter") and math.isinf(e.tolerance)
        }
    )


__all__ = ["families", "family", "not_compared", "state_notes", "step_written"]


def sync_schedule(
    records: Sequence[StepRecord], paths: set[str]
) -> tuple[list[int], list[int], list[str]] | None:
    """A target network's sync read from the records (trial 39): ``(written, left, counters)`` where the
    reference's step never writes floating state ``paths`` (``state model.<path>``, ``reference_change`` 0 at
    every step), the candidate's step wrote them at the steps ``written`` and left them exactly as they were at
    the steps ``left`` (both nonempty: a schedule, not a weight trained at every step), each holds a parameter's
    shape where its shape is known (a copy of the parameters), and the run holds a counter only the candidate's
    step writes (``counters``: ``counter model.<path>`` not compared, tolerance inf); else ``None``."""
    counters = sorted(
        {e.path for r in records for e in r.leaves if e.kind == "counter" and math.isinf(e.tolerance)}
    )
    shapes = {e.shape for r in records for e in r.leaves if e.kind == "param" and e.shape is not None}
    leaves = [(r.step, e) for r in records for e in r.leaves if e.kind == "state" and e.path in paths]
    if not counters or not leaves or any(e.reference_change for _, e in leaves):
        return None
    if any(e.shape is not None and e.shape not in shapes for _, e in leaves):
        return None
    written = sorted({t for t, e in leaves if e.max_abs_err > 0})
    left = sorted({t for t, _ in leaves} - set(written))
    return (written, left, counters) if written and left else None


def written_factor(leaves: Sequence[LeafError]) -> int | None:
    """The whole k >= 2 that every one of ``leaves`` was written as, k times the reference's written value
    (``LeafError.value_factor``, the same on each within 1e-6), else ``None``."""
    ks = [e.value_factor for e in leaves]
    if not ks or any(k is None for k in ks):
        return None
    k = round(ks[0])
    return k if k >= 2 and all(abs(f - k) <= 1e-6 * k for f in ks) else None


def factor_read(replayed: bool) -> str:
    """Where a :func:`written_factor` was read: ``"at every element"`` (a live check's arrays), or, for a replay
    (``StepRecord.replayed``), what its digests hold of each leaf: its recorded samples, ``max|x|`` and L2 norm
    (:func:`~shardcheck.parity.comparison.state_digest.sampled_value_factor`), not every element."""
    if not replayed:
        return "at every element"
    return "at every sample the recording holds and in the largest magnitude and the L2 norm"
