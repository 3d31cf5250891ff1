"""Localize a failing step by stage: the first stage of the update at which the two steps part, what its failing
leaves share, and the form of their difference.

A step passes through six stages; each is read from the first failing :class:`StepRecord` (a live check's or a
replay's alike, with the extra evidence of the harness where there is some):

1. ``forward``: the loss at equal parameters (step 0, a synchronized step, or a step after steps that matched),
   and a counter the forward pass writes (``model.*``);
2. ``gradients``: the exposed gradients, leaf by leaf ("not observed" where the candidate returned none: never
   claimed to match);
3. ``replicas``: the agreement of a replicated leaf's copies across devices, and along which mesh axes they differ
   (``StepRecord.replica_mismatches`` / ``replica_axes``);
4. ``optimizer``: the optimizer's update from equal inputs: the reference's optimizer rerun on the candidate's own
   gradients and pre-step state, compared with the candidate's state after the step
   (``StepRecord.optimizer_rerun``, :mod:`shardcheck.parity.harness.optimizer_rerun`); without that rerun, the
   optimizer state compared with the reference's;
5. ``parameters``: the applied parameters (and, beside a rerun, the optimizer state) against the reference's;
6. ``counters``: the update counters.

:func:`localize` names the first stage that differs. A later stage is never blamed when an earlier one already
differs; an earlier stage is never blamed when it matched; a stage that was not observed is said to be so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form, form_from_leaves
from shardcheck.parity.diagnosis.grouping import LeafFacts, shared_property

STAGES = ("forward", "gradients", "replicas", "optimizer", "parameters", "counters")
DIFFERS, MATCHES, NOT_OBSERVED = "differs", "matches", "not observed"
# what a first difference at each stage means
MEANING = {
    "forward": "the forward pass computes another loss at equal parameters (the model or the loss, as sharded)",
    "gradients": "the gradients were computed or reduced differently for these leaves",
    "replicas": "a replicated leaf's copies disagree across devices: a reduction missed an axis",
    "optimizer": "equal gradients give a different update or state: the mistake is in how the update was "
    "computed or applied, not in the gradients",
    "parameters": "the update was applied differently",
    "counters": "the optimizer was stepped another number of times",
}
NOUNS = {
    "forward": "the forward pass (loss)",
    "gradients": "the gradients",
    "replicas": "the replicas",
    "optimizer": "the optimizer's update from equal inputs",
    "parameters": "the applied parameters",
    "counters": "the counters",
}


@dataclasses.dataclass(frozen=True)
class StageResult:
    """One stage at the localized step.

    Attributes:
        stage: one of :data:`STAGES`.
        status: ``"differs"``, ``"matches"`` or ``"not observed"``.
        compared: the leaves compared at this stage (replicas: the mismatched leaves' count is ``failing``).
        failing: how many of them are out of tolerance.
        worst: the worst failing leaf, else ``None``.
        note: what else the stage showed (the axes replicas differ along; how the optimizer stage was read).
    """

    stage: str
    status: str
    compared: int = 0
    failing: int = 0
    worst: LeafError | None = None
    note: str = ""

    def phrase(self) -> str:
        """``"the gradients differ (3 of 22 leaves; worst grad a.kernel: ...)"`` and the like."""
        noun = NOUNS[self.stage]
        if self.status == NOT_OBSERVED:
            return f"{noun}: not observed{f' ({self.note})' if self.note else ''}"
        if self.stage == "replicas":
            return f"{noun}: {'agree' if self.status == MATCHES else 'differ'}" + (
                f" ({self.note})" if self.note else ""
            )
        n = self.compared
        count = f"{n} leaf" if n == 1 else f"{n} leaves"
        if self.status == DIFFERS:
            count = f"{self.failing} of {count}"
        worst = "" if self.worst is None else f"; worst {_detail(self.worst)}"
        note = f"; {self.note}" if self.note else ""
        return f"{noun}: {self.status} ({count}{worst}{note})"

    def to_dict(self) -> dict:
        """A JSON-ready dict (``worst``: the leaf's name)."""
        return {
            "stage": self.stage,
            "status": self.status,
            "compared": self.compared,
            "failing": self.failing,
            "worst": None if self.worst is None else self.worst.name,
            "note": self.note,
        }


def _detail(e: LeafError) -> str:
    return f"{e.name}: max abs err {e.max_abs_err:.3g} > tolerance {e.tolerance:.3g}"


@dataclasses.dataclass(frozen=True)
class Localization:
    """Where a failing step first parts from the reference.

    Attributes:
        step: the localized step (the first failing one).
        stage: the first stage that differs (:data:`STAGES`), or ``None`` where no stage shows the failure.
        stages: every stage's :class:`StageResult`, in order.
        group: what the failing leaves of ``stage`` share, and what the matching ones do (a sentence).
        form: the form of their difference (:class:`~shardcheck.parity.diagnosis.form.Form`), else ``None``.
        synchronized: the step ran from the reference's pre-step state.
    """

    step: int
    stage: str | None
    stages: tuple[StageResult, ...]
    group: str = ""
    form: Form | None = None
    synchronized: bool = False

    def status(self, stage: str) -> str:
        """The status of ``stage``."""
        return next(s.status for s in self.stages if s.stage == stage)

    @property
    def unobserved_before(self) -> tuple[str, ...]:
        """The stages before :attr:`stage` that were not observed (the difference may begin there)."""
        if self.stage is None:
            return ()
        earlier = self.stages[: STAGES.index(self.stage)]
        return tuple(s.stage for s in earlier if s.status == NOT_OBSERVED)

    def text(self) -> str:
        """The localization in words: the first stage that differs and its meaning, the group, the form, then
        every stage's status."""
        where = f"step {self.step}" + (
            " (run from the reference's pre-step state)" if self.synchronized else ""
        )
        if self.stage is None:
            head = f"At {where} no stage of the update shows the failure."
        else:
            before = [s for s in self.stages[: STAGES.index(self.stage)] if s.status == MATCHES]
            names = [NOUNS[s.stage] for s in before]
            agree = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)
            head = f"First difference at {where}: {NOUNS[self.stage]} ({MEANING[self.stage]})."
            if agree:
                head += f" Before it, {agree} {'match' if len(before) > 1 else 'matches'}."
            if self.unobserved_before:
                names = ", ".join(NOUNS[s] for s in self.unobserved_before)
                head += f" Not observed: {names}; the difference may begin there."
        parts = [head]
        if self.group:
            parts.append(f"Group: {self.group}.")
        if self.form is not None:
            parts.append(f"Form: {self.form.sentence}.")
        parts.append("Stages: " + "; ".join(s.phrase() for s in self.stages) + ".")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """A JSON-ready dict: ``step``, ``stage``, ``group``, ``form``, ``stages``, ``text``."""
        return {
            "step": self.step,
            "stage": self.stage,
            "group": self.group,
            "form": None if self.form is None else self.form.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "synchronized": self.synchronized,
            "text": self.text(),
        }


def stage_leaves(record: StepRecord) -> dict[str, list[LeafError] | None]:
    """The record's leaves by stage (``replicas``: ``[]``; its evidence is ``replica_mismatches``). With an
    optimizer rerun the ``optimizer`` stage holds its leaves and ``parameters`` the parameters and optimizer
    state against the reference's; without one, the optimizer state is the ``optimizer`` stage."""
    kinds: dict[str, list[LeafError]] = {k: [] for k in ("loss", "grad", "param", "opt_state", "counter")}
    model = []
    for e in record.leaves:
        (model if e.kind == "counter" and e.path.startswith("model.") else kinds[e.kind]).append(e)
    rerun = record.optimizer_rerun
    return {
        "forward": kinds["loss"] + model,
        "gradients": kinds["grad"],
        "replicas": [],
        "optimizer": list(rerun) if rerun is not None else kinds["opt_state"],
        "parameters": kinds["param"] + (kinds["opt_state"] if rerun is not None else []),
        "counters": kinds["counter"],
    }


def _stage_result(
    stage: str, leaves: list[LeafError], record: StepRecord, replicas_observed: bool
) -> StageResult:
    if stage == "replicas":
        if record.replica_mismatches:
            axes = f" along {', '.join(repr(a) for a in record.replica_axes)}" if record.replica_axes else ""
            first = record.replica_mismatches[0]
            note = f"{len(record.replica_mismatches)} leaves{axes}, e.g. {first}"
            return StageResult(stage, DIFFERS, failing=len(record.replica_mismatches), note=note)
        return StageResult(stage, MATCHES if replicas_observed else NOT_OBSERVED)
    if not leaves:
        note = "the candidate returned no gradients" if stage == "gradients" else ""
        if stage == "optimizer" and record.optimizer_rerun is None:
            note = "no optimizer state, and no rerun on the candidate's gradients"
        return StageResult(stage, NOT_OBSERVED, note=note)
    bad = [e for e in leaves if not e.ok]
    worst = max(bad, key=lambda e: e.badness) if bad else None
    note = ""
    if stage == "optimizer":
        note = (
            "the reference's optimizer rerun on the candidate's gradients and pre-step state"
            if record.optimizer_rerun is not None
            else "the optimizer state against the reference's; not rerun on the candidate's gradients"
        )
    return StageResult(stage, DIFFERS if bad else MATCHES, len(leaves), len(bad), worst, note)


def localize(
    records: Sequence[StepRecord],
    *,
    facts: Mapping[str, LeafFacts] | None = None,
    replicas_observed: bool = True,
) -> Localization | None:
    """Localize the first failing record of ``records`` by stage (module docstring).

    Args:
        records: the compared steps, in order (a live check's or a replay's).
        facts: ``{parameter path: LeafFacts}`` (shape, dtype, mesh axes of the placement, tied), where known:
            the grouping reads them (:func:`~shardcheck.parity.diagnosis.grouping.shared_property`).
        replicas_observed: whether the replicas' agreement was checked (``False`` for a replay, whose digests
            do not hold each device's copy).

    Returns:
        The :class:`Localization`, or ``None`` when every record passed.

    Raises:
        TypeError: ``records`` holds something that is not a :class:`StepRecord`.
    """
    for r in records:
        if not isinstance(r, StepRecord):
            raise TypeError(
                f"localize: records must be StepRecords (check_parity's report.steps), got {type(r).__name__}"
            )
    record = next((r for r in records if not r.ok), None)
    if record is None:
        return None
    by_stage = stage_leaves(record)
    results = tuple(_stage_result(s, by_stage[s], record, replicas_observed) for s in STAGES)
    first = next((s for s in results if s.status == DIFFERS), None)
    if first is None:
        return Localization(record.step, None, results, synchronized=record.synchronized)
    group, form = "", None
    leaves = by_stage[first.stage]
    if first.stage == "replicas":
        differ = set(record.replica_mismatches)
        named = [e for e in record.leaves if e.kind in ("param", "opt_state")]
        failing = {e.path: e.shape for e in named if e.name in differ}
        matching = {e.path: e.shape for e in named if e.name not in differ}
        group = shared_property(failing, matching, facts) if failing else ""
    else:
        bad = [e for e in leaves if not e.ok]
        group = _group(bad, leaves, facts or {})
        form = dict(record.forms).get(first.stage) or form_from_leaves(bad)
    return Localization(record.step, first.stage, results, group, form, record.synchronized)


def _group(bad: list[LeafError], leaves: list[LeafError], facts: Mapping[str, LeafFacts]) -> str:
    """What the failing leaves share among the stage's leaves of their own kinds, and whether the other kinds
    of the stage all match."""
    kinds = {e.kind for e in bad}
    same = [e for e in leaves if e.kind in kinds]
    failing = {e.path: e.shape for e in bad}
    matching = {e.path: e.shape for e in same if e.ok}
    sentence = shared_property(failing, matching, facts)
    others = sorted({e.kind for e in leaves} - kinds)
    if others and all(e.ok for e in leaves if e.kind not in kinds):
        words = {"opt_state": "optimizer-state", "param": "parameter", "grad": "gradient", "loss": "loss"}
        listed = " and ".join(words.get(k, k) for k in others)
        sentence += f"; every {listed} leaf of this stage matches"
    return sentence


def _kinds(record: StepRecord, ok: bool) -> set[str]:
    return {e.kind for e in record.leaves if e.ok is ok}


# sentences a finding may say, each with the test of the first failing record that contradicts it
CLAIMS: tuple[tuple[str, object], ...] = (
    ("only the loss matches", lambda r: bool(_kinds(r, True) & {"grad", "opt_state"})),
    ("only the returned loss differs", lambda r: bool(_kinds(r, False) - {"loss"})),
    ("the update matches", lambda r: "param" in _kinds(r, False)),
    ("the exposed gradients differ", lambda r: "grad" not in _kinds(r, False)),
    ("the exposed gradients match", lambda r: "grad" in _kinds(r, False)),
)


def contradiction(message: str, records: Sequence[StepRecord]) -> str | None:
    """The claim of ``message`` that the first failing record of ``records`` contradicts (e.g. "only the loss
    matches" while some gradient or optimizer-state leaf matches), else ``None`` (also when every record
    passed)."""
    record = next((r for r in records if not r.ok), None)
    if record is None:
        return None
    text = message.lower()
    return next((claim for claim, refuted in CLAIMS if claim in text and refuted(record)), None)


def consistent(findings: Sequence, records: Sequence[StepRecord]) -> list:
    """``findings`` (:class:`~shardcheck.parity.diagnosis.evidence.Diagnosis`) without those whose message the
    records contradict (:func:`contradiction`): checked before a report prints them."""
    return [d for d in findings if contradiction(d.message, records) is None]
