"""What a check did with the model's floating state beside its parameters (``state model.<path>`` leaves,
:mod:`shardcheck.parity.comparison.model_state`), in the words a PASS says it: the leaves it did not compare (the
candidate's step writes them, the reference's does not, the loss does not read them) and those both steps write,
compared coarsely on their change."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from shardcheck.parity.diagnosis.evidence import StepRecord


def family(path: str) -> str:
    """A leaf path with every integer component starred: ``model.ema.3`` -> ``model.ema.*``,
    ``model.layers.0.bn.mean`` -> ``model.layers.*.bn.mean`` (an ``nnx.List``'s items named by their container)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)


def _families(paths: set[str]) -> str:
    """``"state model.ema.* (11 leaves)"`` or ``"state model.bn.mean"``, each family once, joined by commas."""
    counts: dict[str, int] = {}
    for p in sorted(paths):
        counts[family(p)] = counts.get(family(p), 0) + 1
    return ", ".join(f"state {f}" + (f" ({n} leaves)" if n > 1 else "") for f, n in counts.items())


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
            f"The model's {_families(skipped)} is neither read nor written by the task's loss: not compared, as a "
            "live check leaves it (the task's reference step does not write it)."
        )
    elif skipped:
        out.append(
            f"The model's {_families(skipped)} is written by the candidate's step only and not read by the loss: "
            "not compared (the reference's step does not write it)."
        )
    if coarse:
        out.append(
            f"{len(coarse)} {'leaf' if len(coarse) == 1 else 'leaves'} of floating state written by both steps "
            f"({_families(coarse)}) compared coarsely, on each step's change: a difference of more than half the "
            "reference's largest change fails (no rounding tolerance is derived for such state)."
        )
    return " ".join(out)


def not_compared(records: Sequence[StepRecord]) -> int:
    """How many leaves of the records' floating state were not compared (tolerance ``inf``)."""
    return len({e.path for r in records for e in r.leaves if e.kind == "state" and math.isinf(e.tolerance)})


__all__ = ["family", "not_compared", "state_notes"]
