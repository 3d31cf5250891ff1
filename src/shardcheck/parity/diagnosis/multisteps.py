"""What ``optax.MultiSteps``' counters say of a step: how many steps each side accumulates per update, and
whether the reference's step only accumulated.

``optax.MultiSteps(tx, every_k_schedule=k)`` keeps two counters in its state: ``mini_step`` (the steps
accumulated since its last update, ``(t + 1) % k`` after step t from a fresh state) and ``gradient_step`` (the
updates applied, ``(t + 1) // k``). Read from each step's counter records (``LeafError.counts``: the reference's
and the candidate's values), they give each side's k, and the step at which the reference applied no update
because it only accumulated (issue #36, trial 26: a candidate's ``every_k_schedule=1`` against the task's 2 read
"stepped 3 times per step ... after 1 step(s)", and a step that only accumulated read "the learning rate at
step 0 is 0").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.grouping import words_and

MINI, APPLIED = "mini_step", "gradient_step"


def _leaf(record: StepRecord, name: str) -> LeafError | None:
    """The counter ``name`` of ``record`` with its values (a MultiSteps' also as ``<prefix>.name``, nested in a
    chain)."""
    nested = name in (MINI, APPLIED)
    for e in record.leaves:
        if (
            e.kind == "counter"
            and e.counts is not None
            and (e.path == name or (nested and e.path.endswith("." + name)))
        ):
            return e
    return None


@dataclasses.dataclass(frozen=True)
class Series:
    """One MultiSteps counter over the steps of a run, each side's value after each step.

    Attributes:
        path: the counter's path (``"gradient_step"``).
        steps: the 0-based steps it was read at (the trajectory's own: a step re-run from the reference's
            state is left out, its counters started from the reference's).
        reference: the reference's values, one per step.
        candidate: the candidate's values, one per step.
    """

    path: str
    steps: tuple[int, ...]
    reference: tuple[int, ...]
    candidate: tuple[int, ...]

    def said(self, what: str = "", at: bool = True) -> str:
        """``"gradient_step (what) is 1, 3 and 4 after steps 0, 2 and 3, the reference's 0, 1 and 2"`` (without
        the steps where ``at`` is False: said once before)."""
        values = words_and([str(v) for v in self.candidate])
        steps = f" after step{'s' if len(self.steps) > 1 else ''} {words_and([str(t) for t in self.steps])}"
        return (
            f"{self.path}{f' ({what})' if what else ''} is {values}{steps if at else ''}, the reference's "
            f"{words_and([str(v) for v in self.reference])}"
        )


def series(records: Sequence[StepRecord], name: str) -> Series | None:
    """The counter ``name`` over the trajectory's records (not ``synchronized``), ``None`` where no record
    holds it with its values."""
    got = [(r.step, _leaf(r, name)) for r in records if not r.synchronized and r.step >= 0]
    got = [(t, e) for t, e in got if e is not None]
    if not got:
        return None
    return Series(
        got[0][1].path,
        tuple(t for t, _ in got),
        tuple(e.counts[0] for _, e in got),
        tuple(e.counts[1] for _, e in got),
    )


def every_k(steps: Sequence[int], applied: Sequence[int], mini: Sequence[int] | None) -> int | None:
    """The one k with ``applied == (t + 1) // k`` (and ``mini == (t + 1) % k``, where given) at every step t of
    ``steps``: a MultiSteps(every_k_schedule=k) from a fresh state; ``None`` where none or several fit (a
    schedule of k, too few steps to tell)."""
    fits = [  # k up to the last step's count: a larger one applied nothing in the run, any such k fits
        k
        for k in range(1, max(steps) + 2)
        if all(a == (t + 1) // k for t, a in zip(steps, applied, strict=True))
        and (mini is None or all(m == (t + 1) % k for t, m in zip(steps, mini, strict=True)))
    ]
    return fits[0] if len(fits) == 1 else None


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """Both sides' MultiSteps counters read over a run.

    Attributes:
        applied: the ``gradient_step`` series.
        mini: the ``mini_step`` series over the same steps, where recorded.
        reference_k: the reference's every_k_schedule (:func:`every_k`), or ``None`` where not one k.
        candidate_k: the candidate's, or ``None``.
    """

    applied: Series
    mini: Series | None
    reference_k: int | None
    candidate_k: int | None


def read(records: Sequence[StepRecord]) -> Accumulation | None:
    """:class:`Accumulation` of ``records`` where they hold a MultiSteps ``gradient_step`` counter with its
    values (``LeafError.counts``), else ``None``."""
    applied = series(records, APPLIED)
    if applied is None:
        return None
    mini = series(records, MINI)
    if mini is not None and mini.steps != applied.steps:
        mini = None
    ks = [
        every_k(applied.steps, getattr(applied, side), None if mini is None else getattr(mini, side))
        for side in ("reference", "candidate")
    ]
    return Accumulation(applied, mini, *ks)


def every_k_differs(records: Sequence[StepRecord]) -> str | None:
    """Where both sides' MultiSteps counters fit one every_k_schedule each and they differ, that in words, with the
    counters as read at each step and the fix; else ``None``.

    ``step`` (the NNX optimizer's update count) tells the two ways a candidate's MultiSteps applies at another
    rate: it matches the reference's at every step (one ``optimizer.update`` a step: the candidate's
    every_k_schedule is another), or it is m times the reference's (``optimizer.update`` called m times a step,
    once per micro-batch, on a MultiSteps that accumulates as the task's)."""
    acc = read(records)
    if (
        acc is None
        or acc.reference_k is None
        or acc.candidate_k is None
        or acc.reference_k == acc.candidate_k
    ):
        return None
    kr, kc = acc.reference_k, acc.candidate_k
    counters = acc.applied.said("updates applied") + (
        "" if acc.mini is None else f"; its {acc.mini.said('steps accumulated since', at=False)}"
    )
    rate = "at every step" if kc == 1 else f"every {kc} steps"
    head = (
        f"The candidate's optax.MultiSteps applies an update {rate} where the task's applies one every {kr} "
        f"steps: its counter {counters}."
    )
    calls = series(records, "step")
    ratios = (
        set()
        if calls is None
        else {c / r for r, c in zip(calls.reference, calls.candidate, strict=True) if r}
    )
    if ratios == {1.0}:
        return (
            f"{head} Its update count (step) matches the reference's at every step, so optimizer.update runs once "
            f"a step: the candidate's MultiSteps is built with every_k_schedule={kc} against the task's "
            f"every_k_schedule={kr}. Build the candidate's optimizer as the task's (optax.MultiSteps(tx, "
            f"every_k_schedule={kr})), or let it use the task's optimizer."
        )
    m = ratios.pop() if len(ratios) == 1 else None
    if m is not None and m == round(m) and m >= 2:
        return (
            f"{head} Its update count (step) is {int(m)} times the reference's, so optimizer.update runs {int(m)} "
            f"times a step: the candidate applies each micro-batch (one update call per micro-batch) on a "
            f"MultiSteps that accumulates {kr} steps, where the task's takes one update call a step; call "
            "optimizer.update once a step on the batch's reduced gradient."
        )
    return (
        f"{head} Either the candidate's MultiSteps is built with every_k_schedule={kc} against the task's "
        f"every_k_schedule={kr}, or the candidate applies each micro-batch (optimizer.update called once per "
        "micro-batch); build it as the task's and call optimizer.update once a step."
    )


def reference_mini_step(record: StepRecord) -> int | None:
    """The reference's MultiSteps ``mini_step`` after ``record``'s step: not 0 where it only accumulated there (no
    update applied), 0 where it applied one; ``None`` where the record holds no MultiSteps counter with its values
    (it cannot tell)."""
    mini = _leaf(record, MINI)
    return None if mini is None else mini.counts[0]
