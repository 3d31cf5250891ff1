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
import math
import re
from collections.abc import Mapping, Sequence

from shardcheck.parity.diagnosis.evidence import (
    RATIO_RTOL,
    LeafError,
    StepRecord,
    converted_counter,
    start_words,
    would_show,
)
from shardcheck.parity.diagnosis.floating import (
    factor_read,
    families,
    step_written,
    sync_schedule,
    written_factor,
)
from shardcheck.parity.diagnosis.form import (
    Form,
    form_from_leaves,
    shape_form,
    weight_or_shards,
    weight_phrase,
    zero_on_copies,
)
from shardcheck.parity.diagnosis.grouping import (
    NO_PROPERTY,
    LeafFacts,
    along,
    common_prefix,
    n_leaves,
    param_path,
    rounding_params,
    shared_property,
    state_property,
    words_and,
)
from shardcheck.parity.diagnosis.module_outputs import ModuleFinding
from shardcheck.parity.diagnosis.topology import (
    PIPELINE_AXIS_NAMES,
    downstream_note,
    name_leaves,
    pipeline_axes,
    replicas_root,
)

STAGES = ("forward", "gradients", "replicas", "optimizer", "parameters", "counters")
DIFFERS, MATCHES, NOT_OBSERVED = "differs", "matches", "not observed"
# what a first difference at each stage means
MEANING = {
    "forward": "the forward pass computes another loss at equal parameters (the model or the loss, as sharded; "
    "or the loss returned was taken at other parameters)",
    "gradients": "the gradients were computed or reduced differently for these leaves (or the forward pass "
    "computes another function whose value at these parameters stays within the loss's tolerance: a clamp, a "
    "mask or a stop_gradient that moves the gradient more than the loss)",
    "replicas": "a replicated leaf's copies disagree across devices: a reduction missed an axis",
    "optimizer": "equal gradients give a different update or state: the mistake is in how the update was "
    "computed or applied, not in the gradients",
    "parameters": "the update was applied differently",
    "counters": "the optimizer was stepped another number of times",
}
# the optimizer or parameters stage where the optimizer state differed before step 0 (Localization.started)
STARTED = "the optimizer state started from other values, before the step's update"
# the optimizer stage where the candidate's gradients were not observed (its step returns none)
UNSEEN_GRADIENTS = (
    "the optimizer state",
    "the state the optimizer kept differs; the gradients it was given were not observed, so the mistake may be "
    "in them or in how the update was computed",
)
# the optimizer stage's note where no rerun on the candidate's gradients was made
NO_RERUN = "the optimizer state against the reference's"
# the forward stage where the loss matches and a counter the forward pass writes (``model.*``) differs
# a replay's forward stage: no module probe
NOT_PROBED = (
    "not probed (a replay has no live model to run module by module; a live check of this step runs the module "
    "probe, which looks for the first module whose output differs while its inputs match)"
)
FORWARD_STATE = "the forward pass writes the model's state another way at equal parameters; the loss matches"
NOUNS = {
    "forward": "the forward pass (loss)",
    "gradients": "the gradients",
    "replicas": "the replicas",
    "optimizer": "the optimizer's update from equal inputs",
    "parameters": "the applied parameters",
    # the optimizer's step counts (the model's own counters are counted in the stage that writes them, as
    # "model-state counters": trial 48 read "1 of 1 counter leaf" differ, then "the counters: matches")
    "counters": "the optimizer's counters",
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
        kinds: ``((kind, compared, failing), ...)`` per leaf kind where the stage holds several (the parameters
            and the optimizer state beside an optimizer rerun), else ``()``: the phrase counts each.
    """

    stage: str
    status: str
    compared: int = 0
    failing: int = 0
    worst: LeafError | None = None
    note: str = ""
    kinds: tuple[tuple[str, int, int], ...] = ()

    @property
    def noun(self) -> str:
        """The stage's name in words (:data:`NOUNS`): the optimizer stage without a rerun on the candidate's
        gradients is ``"the optimizer state"`` (no equal inputs were given to it), the parameters stage beside
        one, which also holds the optimizer state against the reference's, ``"the applied parameters and the
        optimizer state"``."""
        if self.stage == "optimizer" and self.note.startswith(NO_RERUN):
            return UNSEEN_GRADIENTS[0]
        if self.stage == "parameters" and any(k == "opt_state" for k, _, _ in self.kinds):
            return "the applied parameters and the optimizer state"
        return NOUNS[self.stage]

    def phrase(self) -> str:
        """``"the gradients differ (3 of 22 leaves; worst grad a.kernel: ...)"`` and the like; a stage of
        parameters and optimizer state counts each (``"3 of 22 parameters and 0 of 50 optimizer-state
        leaves"``)."""
        noun = self.noun
        if (
            self.stage == "forward" and self.compared > 1
        ):  # the loss and what the forward pass writes (trial 35:
            # an RNG count failing in the table read beside "the forward pass (loss)" and "the counters: matches")
            noun = "the forward pass (loss, and the model's state and RNG counts it writes)"
        if self.status == NOT_OBSERVED:
            return f"{noun}: not observed{f' ({self.note})' if self.note else ''}"
        if self.stage == "replicas":
            return f"{noun}: {'agree' if self.status == MATCHES else 'differ'}" + (
                f" ({self.note})" if self.note else ""
            )
        count = _count(self.compared, self.failing, "leaf", self.status == DIFFERS)
        if len(self.kinds) > 1:
            count = " and ".join(_count(n, bad, k, self.status == DIFFERS) for k, n, bad in self.kinds)
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
            "kinds": {k: {"compared": n, "failing": bad} for k, n, bad in self.kinds},
        }


# how a stage's count names the leaves of one kind: (one, several)
KIND_NOUNS = {
    "leaf": ("leaf", "leaves"),
    "param": ("parameter", "parameters"),
    "opt_state": ("optimizer-state leaf", "optimizer-state leaves"),
    "state": ("non-parameter state leaf", "non-parameter state leaves"),
    "counter": ("model-state counter", "model-state counters"),
}


def _count(n: int, failing: int, kind: str, differs: bool) -> str:
    """``"3 of 22 parameters"`` (``differs``) or ``"22 parameters"``; ``"1 leaf"``."""
    one, several = KIND_NOUNS.get(kind, (f"{kind} leaf", f"{kind} leaves"))
    noun = one if n == 1 else several
    return f"{failing} of {n} {noun}" if differs else f"{n} {noun}"


def _detail(e: LeafError) -> str:
    if e.missing:
        return f"{e.name}: in one run only"
    if e.dtypes is not None:  # a counter the step converted (a pmean of the whole optimizer state)
        return f"{e.name}: {converted_counter(e)}"
    if e.cand_shape is not None:
        return f"{e.name}: shaped otherwise ({tuple(e.cand_shape)} against the reference's {tuple(e.shape or ())})"
    if e.finite is not None:  # a skipped step's loss or gradient, compared by finiteness
        return f"{e.name}: finite in the {'reference' if e.finite[0] else 'candidate'}'s run only"
    if not math.isfinite(e.max_abs_err):
        return f"{e.name}: not finite (max abs err {e.max_abs_err:.3g})"
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
        module: where ``stage`` is the forward pass, the first module whose output differs while its inputs match, at equal parameters
            under the candidate's placement, or that none does (:class:`ModuleFinding`, a live check's); else
            ``None``.
        live: a live check's (``False``: a replay's, which has no live model to probe module by module nor
            each device's copy of a replica: the text says so where the forward pass differs).
        started: at step 0, optimizer-state leaves changed as the reference's did while their values differ by
            more than that change (:func:`started_otherwise`): the optimizer state started from other values, so
            the first difference is not said to be how the update was applied.
        step_state: where every failing leaf of the parameters stage is model state the step writes after its
            forward pass (the task's loss does not write it: :func:`step_written`), those leaves in short
            (``"model.ema.* (16 leaves)"``); ``""`` otherwise.
    """

    step: int
    stage: str | None
    stages: tuple[StageResult, ...]
    group: str = ""
    form: Form | None = None
    synchronized: bool = False
    module: ModuleFinding | None = None
    live: bool = True
    started: bool = False
    step_state: str = ""

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
        """The localization in words: the first stage that differs and its meaning, the first module whose output
        differs (a forward stage's, where probed), the group, the form, then every stage's status."""
        where = f"step {self.step}" + (start_words(self.live) if self.synchronized else "")
        if self.stage is None:
            head = f"At {where} no stage of the update shows the failure."
        else:
            before = [s for s in self.stages[: STAGES.index(self.stage)] if s.status == MATCHES]
            names = [s.noun for s in before]
            agree = words_and(names)
            noun, meaning = self._first().noun, MEANING[self.stage]
            if self.stage == "optimizer" and self.status("gradients") == NOT_OBSERVED:
                noun, meaning = UNSEEN_GRADIENTS  # no equal inputs were seen: the gradients are not cleared
            if self.stage == "forward" and self._loss_matches():
                meaning = FORWARD_STATE  # only a counter the forward pass writes differs: not "another loss"
            if self.started:
                meaning = STARTED
            if self.stage == "parameters" and self.step_state:
                meaning = self._step_state_meaning()
            head = f"First difference at {where}: {noun} ({meaning})."
            if agree:
                head += f" Before it, {agree} {'match' if len(before) > 1 else 'matches'}."
            if self.unobserved_before:
                names = ", ".join(s.noun for s in self.stages if s.stage in self.unobserved_before)
                head += f" Not observed: {names}; the difference may begin there."
        parts = [head]
        if self.module is not None:
            parts.append(f"Module: {self.module.text()}.")
        elif self.stage == "forward" and not self.live:
            parts.append(f"Module: {NOT_PROBED}.")
        if self.group:
            parts.append(f"Group: {self.group}.")
        if self.form is not None:
            parts.append(f"Form: {self.form.sentence}.")
        parts.append("Stages: " + "; ".join(s.phrase() for s in self.stages) + ".")
        return " ".join(parts)

    def _first(self) -> StageResult:
        return next(s for s in self.stages if s.stage == self.stage)

    def _step_state_meaning(self) -> str:
        """The parameters stage's meaning where every failing leaf there is model state the step writes after its
        forward pass (:attr:`step_state`), with what matches before it: ``"the step writes the model's state
        model.ema.* (16 leaves) another way (the task's loss does not write it: the step does, after the forward
        pass); the loss, gradients and parameters match"``."""
        matching = []
        if self.status("forward") == MATCHES:
            matching.append("loss")
        if self.status("gradients") == MATCHES:
            matching.append("gradients")
        params = next((k for k in self._first().kinds if k[0] == "param"), None)
        if params is not None and params[2] == 0:
            matching.append("parameters")
        said = (
            f"; the {words_and(matching)} match"
            if len(matching) > 1
            else (
                f"; the {matching[0]} {'match' if matching[0].endswith('s') else 'matches'}"
                if matching
                else ""
            )
        )
        return (
            f"the step writes the model's state {self.step_state} another way (the task's loss does not write it: "
            f"the step does, after the forward pass){said}"
        )

    def _loss_matches(self) -> bool:
        """Whether the forward stage's loss leaf matches (its failing leaves are model-state counters)."""
        forward = next(s for s in self.stages if s.stage == "forward")
        return any(k == "loss" and bad == 0 for k, _, bad in forward.kinds)

    def to_dict(self) -> dict:
        """A JSON-ready dict: ``step``, ``stage``, ``group``, ``form``, ``stages``, ``synchronized``,
        ``started``, ``module`` (:meth:`ModuleFinding.to_dict`, or ``None``), ``text``."""
        return {
            "step": self.step,
            "stage": self.stage,
            "group": self.group,
            "form": None if self.form is None else self.form.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "synchronized": self.synchronized,
            "started": self.started,
            "step_state": self.step_state,
            "module": None if self.module is None else self.module.to_dict(),
            "text": self.text(),
        }


def stage_leaves(record: StepRecord) -> dict[str, list[LeafError] | None]:
    """The record's leaves by stage (``replicas``: ``[]``; its evidence is ``replica_mismatches``). With an
    optimizer rerun the ``optimizer`` stage holds its leaves and ``parameters`` the parameters and optimizer
    state against the reference's; without one, the optimizer state is the ``optimizer`` stage."""
    kinds: dict[str, list[LeafError]] = {
        k: [] for k in ("loss", "grad", "param", "opt_state", "counter", "state")
    }
    model, stepped = [], []  # the model's counters: the forward pass's, and those only the step advances
    for e in record.leaves:
        if e.kind == "counter" and e.path.startswith("model."):
            (stepped if step_written(record, e) else model).append(e)
        else:
            kinds[e.kind].append(e)
    rerun = record.optimizer_rerun
    # floating model state the reference left as it was is written by an update, not by the forward pass; so is
    # state the task's loss does not write (an EMA the step keeps after its update: trial 37), and a counter it
    # neither reads nor writes (a target network's sync count)
    updated = stepped + [e for e in kinds["state"] if e.reference_change == 0.0 or step_written(record, e)]
    model += [e for e in kinds["state"] if e not in updated]
    return {
        "forward": kinds["loss"] + model,
        "gradients": kinds["grad"],
        "replicas": [],
        "optimizer": list(rerun) if rerun is not None else kinds["opt_state"],
        "parameters": kinds["param"] + (kinds["opt_state"] if rerun is not None else []) + updated,
        "counters": kinds["counter"],
    }


def step_state(bad: Sequence[LeafError], record: StepRecord) -> str:
    """Where every failing leaf of the parameters stage is state the step writes after its forward pass
    (:func:`step_written`), those leaves in short (``"model.ema.* (16 leaves)"``); ``""`` otherwise. Beside a
    counter only the step advances, state the task's loss does not write counts as the step's too (a target
    network's copy synced on that counter)."""
    counted = any(e.kind == "counter" for e in bad)
    if not bad or not all(step_written(record, e) or (counted and _not_loss_written(record, e)) for e in bad):
        return ""
    return families({e.path for e in bad})


def _not_loss_written(record: StepRecord, e: LeafError) -> bool:
    """``e`` is floating state the task's loss does not write (``StepRecord.forward_writes`` known)."""
    return e.kind == "state" and record.forward_writes is not None and e.path not in record.forward_writes


def _state_form(
    bad: list[LeafError], record: StepRecord, records: Sequence[StepRecord], num_shards: int | None
) -> Form | None:
    """The form of failing model state the records read (:func:`_step_counter_form`, :func:`_state_step_form`,
    :func:`_state_factor_form`, the first that holds), else ``None``."""
    return (
        _step_counter_form(bad, record)
        or _state_step_form(bad, records)
        or _state_factor_form(bad, num_shards, record.replayed)
    )


def _step_counter_form(bad: list[LeafError], record: StepRecord) -> Form | None:
    """The form of a counter the step advances itself (:func:`step_written`: the task's loss neither reads nor
    writes it) that is a whole k >= 2 times the reference's: ``"a factor 2: the step's own counter model.steps is
    2 x the reference's: the step advanced it 2 times a step"`` (trial 39: read as the forward pass's, "the
    forward pass ran 2 times a step"), with the state written at other steps beside it; ``None`` otherwise."""
    counters = [e for e in bad if e.kind == "counter" and step_written(record, e)]
    if not counters or counters[0].ratio is None:
        return None
    f = counters[0].ratio
    k = round(f)
    if k < 2 or abs(f - k) > 1e-9:
        return None
    names = ", ".join(sorted(e.path for e in counters))
    state = sorted(e.path for e in bad if e.kind == "state")
    were = "was" if len(state) == 1 else "were"
    beside = (
        f"; the state {families(set(state))} {were} written at other steps, on its schedule" if state else ""
    )
    return Form(
        "factor",
        f"a factor {k}: the step's own counter {names} (the task's loss neither reads nor writes it) is {k} x the "
        f"reference's: the step advanced it {k} times a step{beside}",
        factor=float(k),
        leaves=len(bad),
    )


def _step_written_form(form: Form | None) -> Form | None:
    """The form of state the step writes after its forward pass that the candidate's step left exactly as it was
    (a ``zero`` form): its write dropped, or a write of the value it held (trial 37: an EMA of the parameters
    updated before the optimizer's update, which at step 0 still equals them, read "the step's writes were
    dropped" beside advice about the forward pass's writes, which write none of it)."""
    if form is None or form.kind != "zero":
        return form
    head = form.sentence.split(": the step's writes were dropped")[0]
    return dataclasses.replace(
        form,
        sentence=f"{head}: the step's own write of them (its forward pass writes none) was dropped, or wrote the "
        "values they held (an average of the parameters taken before the optimizer's update, at a step where it "
        "still equals them)",
    )


# a leaf whose change at step 0 is the reference's to within this (its 10th-90th percentile ratios) while its
# values differ by more than that whole change started from other values
STARTED_RATIO = 0.02


def started_otherwise(record: StepRecord) -> list[LeafError]:
    """The failing optimizer-state leaves of a step-0 record (not run from the reference's state) whose change in
    the step is the reference's (median and 10th-90th percentile ratios within :data:`STARTED_RATIO` of 1) while
    their values differ by more than the reference's whole change (``reference_change``) and their tolerance: the
    difference was there before the step, in the candidate's initial optimizer state (adagrad's
    ``initial_accumulator_value``, or an optimizer built otherwise), not in its update. ``[]`` otherwise."""
    if record.step != 0 or record.from_reference_state:
        return []
    out = []
    for e in record.leaves:
        if e.kind != "opt_state" or e.ok or e.reference_change is None or e.ratio is None or e.spread is None:
            continue
        lo, hi = e.spread
        agree = max(abs(e.ratio - 1.0), 1.0 - lo, hi - 1.0) <= STARTED_RATIO
        if agree and e.max_abs_err > max(e.reference_change, e.tolerance):
            out.append(e)
    return out


def started_sentence(started: Sequence[LeafError]) -> str:
    """``started_otherwise``'s leaves in words: the optimizer state started from other values, with the worst
    leaf's numbers."""
    e = max(started, key=lambda e: e.badness)
    lo, hi = e.spread
    more = f" (and {len(started) - 1} more leaves)" if len(started) > 1 else ""
    return (
        f"the optimizer state started from other values than the reference's: {e.name}{more} changes at this step "
        f"as the reference's does (elementwise {lo:.4g}..{hi:.4g} x its change) while its values differ by up to "
        f"{e.max_abs_err:.3g}, more than the reference's whole change ({e.reference_change:.3g}): the difference "
        "was there before the step, in the candidate's initial optimizer state (an initial value of the "
        "optimizer's own, such as optax.adagrad's initial_accumulator_value, or an optimizer built with other "
        "settings), and the updates that read it differ from there"
    )


def _stage_result(
    stage: str, leaves: list[LeafError], record: StepRecord, replicas_observed: bool
) -> StageResult:
    if stage == "replicas":
        if record.replica_mismatches:
            axes = along(record.replica_axes)
            first = replicas_root(record)[0]
            downstream = downstream_note(record)
            count = len(record.replica_mismatches)
            shown = f"{n_leaves(count)}{axes}, e.g. {first}" if count > 1 else f"1 leaf{axes}: {first}"
            note = shown + (f"; {downstream}" if downstream else "")
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
            else f"{NO_RERUN}; not rerun on the candidate's gradients"
        )
        if record.update_only:
            note += ", at the optimizer's own rounding"
        elif record.replayed and record.optimizer_rerun is not None:
            # the rerun sees every element, as live, and allows each the gradient's tolerance propagated through
            # the update; the digests' row below does not add it (trial 47: 3.52e-06 and 3.02e-06 for one leaf)
            note += (
                ", every element, allowed as live the gradient's tolerance propagated through the update "
                "(the recorded digests' tolerance does not add it)"
            )
    elif stage == "parameters" and record.update_only:
        note = (
            "within the step's tolerance against the reference, which the difference stays below at one step"
        )
    elif stage == "parameters" and bad and any(e.samples is not None for e in bad):
        # a replay's: its error is the digests', beside the rerun's over every element (trial 43 printed both,
        # 7.18e-05 and 2.79e-05 for one leaf, unlabeled)
        note = "read from the recorded digests (max, norm and samples), not every element"
    kinds = tuple(
        (k, sum(e.kind == k for e in leaves), sum(e.kind == k for e in bad))
        for k in dict.fromkeys(e.kind for e in leaves)
    )
    kinds = kinds if len(kinds) > 1 else ()
    return StageResult(stage, DIFFERS if bad else MATCHES, len(leaves), len(bad), worst, note, kinds)


def _unreadable_form(bad: Sequence[LeafError]) -> Form | None:
    """The form of failing leaves no elementwise form can be read from, else ``None``: of other shapes (said
    as shaped otherwise, never as not finite), missing from one run, or not finite (no form is read from a
    NaN)."""
    shaped = {e.name: (e.shape or (), e.cand_shape) for e in bad if e.cand_shape is not None}
    absent = [e.name for e in bad if e.missing]
    converted = [e for e in bad if e.dtypes is not None]
    blind = [
        e
        for e in bad
        if not math.isfinite(e.max_abs_err) and e.cand_shape is None and not e.missing and e.dtypes is None
    ]
    if shaped:
        return shape_form(shaped)
    if converted and len(converted) == len(bad):
        return Form("none", f"{converted_counter(converted[0])}: no form is read")
    if absent:
        return shape_form({}, absent)
    if blind and all(e.finite is not None for e in blind):  # a skipped step's, compared by finiteness
        return Form("none", f"finite in one run only in {n_of(len(blind), len(bad))}: no form is read")
    if blind:
        return Form("none", f"not finite (NaN or infinity) in {n_of(len(blind), len(bad))}: no form is read")
    return None


def localize(
    records: Sequence[StepRecord],
    *,
    facts: Mapping[str, LeafFacts] | None = None,
    replicas_observed: bool = True,
    num_shards: int | None = None,
    mesh_shape: Mapping[str, int] | None = None,
) -> Localization | None:
    """Localize the first failing record of ``records`` by stage (module docstring).

    Args:
        records: the compared steps, in order (a live check's or a replay's).
        facts: ``{parameter path: LeafFacts}`` (shape, dtype, mesh axes of the placement, tied), where known:
            the grouping reads them (:func:`~shardcheck.parity.diagnosis.grouping.shared_property`).
        replicas_observed: whether the replicas' agreement was checked (``False`` for a replay, whose digests
            do not hold each device's copy).
        num_shards: the candidate's shard count S, where known: a gradient factor that is both the batch's loss
            weight and a power of S is said with both readings (:func:`~shardcheck.parity.diagnosis.form.weight_or_shards`).
        mesh_shape: ``{axis: size}`` of the candidate's mesh, where known: the pipeline axes
            (:func:`~shardcheck.parity.diagnosis.topology.pipeline_axes`; without it, the axes named so) for
            what a zero on the compared copies means (:func:`~shardcheck.parity.diagnosis.form.zero_on_copies`).

    Returns:
        The :class:`Localization`, or ``None`` when every record passed.

    Raises:
        TypeError: ``records`` holds something that is not a :class:`StepRecord`.
    """
    _check_records(records)
    record = next((r for r in records if not r.ok), None)
    if record is None:
        return None
    by_stage = stage_leaves(record)
    results = tuple(_stage_result(s, by_stage[s], record, replicas_observed) for s in STAGES)
    first = next((s for s in results if s.status == DIFFERS), None)
    if first is None:
        return Localization(
            record.step, None, results, synchronized=record.from_reference_state, live=replicas_observed
        )
    group, form = "", None
    leaves = by_stage[first.stage]
    if first.stage == "replicas":
        group = _replicas_group(record, facts)
        form = dict(record.forms).get("replicas") or _digested_replicas_form(record)
    else:
        bad = [e for e in leaves if not e.ok]
        group = _stage_group(bad, leaves, record, facts or {})
        later = [
            e for e in record.leaves if not e.ok and e.kind in ("param", "opt_state", "counter", "state")
        ]
        later = [e for e in later if e not in bad]  # the failing leaves of the stages after the forward pass
        if first.stage == "forward":
            group = (
                forward_group(by_stage["gradients"] or [], facts or {}) or _loss_alone(bad, later) or group
            )
        update = first.stage not in ("forward", "gradients")  # a loss and a gradient are values, not updates
        fitted = None if all(e.kind == "state" for e in bad) else dict(record.forms).get(first.stage)
        form = fitted or form_from_leaves(bad, update=update, optimizer_stage=first.stage == "optimizer")
        form = checked_form(form, first.stage, bad, leaves, record, num_shards)
        if first.stage == "forward":
            form = forward_form(
                form, bad, by_stage["gradients"], reduced=_forward_reading(record), later=later
            )
        form = _unreadable_form(bad) or _state_form(bad, record, records, num_shards) or form
        group = _decay_group(group, form, bad, leaves, record, facts or {})
    form = _zero_on_copies(form, record, by_stage, facts, mesh_shape)  # one copy's zero
    form = _bias_correction_factor(form, record)
    written = step_state(bad, record) if first.stage == "parameters" else ""
    form = _step_written_form(form) if written else form
    module = record.module if first.stage == "forward" else None
    live = replicas_observed
    started = started_otherwise(record) if first.stage in ("optimizer", "parameters") else []
    if started:  # the state differed before the step: no form of its update is read
        form = Form("none", started_sentence(started))
    synchronized = record.from_reference_state
    return Localization(
        record.step, first.stage, results, group, form, synchronized, module, live, bool(started), written
    )


TOO_SMALL = "too small for the decay to show"
"""What the group says of matching parameters a fitted decay term could not move beyond their tolerance."""


def decay_unseen(form: Form | None, leaves: Sequence[LeafError]) -> list[str]:
    """The matching parameter leaves of ``leaves`` that a ``decay`` ``form`` could not show: its term applied to
    the leaf, ``form.term * max|param|`` (``max|param|`` the reference's, ``max_abs_err / max_rel_err``), is within
    the leaf's tolerance, so that their matching is no evidence that the decay spares them (trial 47: "every
    bias, pos matches" of a decay applied twice, c*lr = 3e-05, to biases of some 3e-03 and a pos of some 0.06).
    ``[]`` for another form; a leaf whose error is 0 (its size unknown) is kept as evidence."""
    if form is None or form.kind != "decay" or not form.term:
        return []
    out = []
    for e in leaves:
        if e.kind != "param" or not e.ok or not e.max_abs_err > 0 or not 0 < e.max_rel_err < math.inf:
            continue
        if form.term * e.max_abs_err / e.max_rel_err <= e.tolerance:
            out.append(e.path)
    return sorted(out)


def _stage_group(bad: list[LeafError], leaves: list[LeafError], record: StepRecord, facts) -> str:
    """:func:`_group` of a stage's failing leaves ``bad`` among its ``leaves``, with ``record``'s parameters,
    its rounding-level ones and those that differ in the applied update."""
    params = {e.path: e.shape for e in record.leaves if e.kind == "param"}
    quiet = rounding_params((*record.rounding_level, *record.unresolved))
    applied = {e.path for e in record.leaves if e.kind == "param" and not e.ok}
    return _group(bad, leaves, facts, params, quiet, applied)


def _decay_group(group: str, form, bad, leaves, record: StepRecord, facts) -> str:
    """``group`` with the matching parameters a decay ``form`` could not show (:func:`decay_unseen`) no longer
    its contrast (:func:`decay_said`, the group read again without them by :func:`_stage_group`)."""
    unseen = decay_unseen(form, leaves)
    rest = [e for e in leaves if not (e.kind == "param" and e.path in unseen)]
    quiet = rounding_params((*record.rounding_level, *record.unresolved))  # set aside by the group's reading
    others = any(e.kind == "param" and e.ok and e.path not in quiet for e in rest)
    return decay_said(group, unseen, others, lambda: _stage_group(bad, rest, record, facts))


def decay_said(group: str, unseen: Sequence[str], others: bool, regroup) -> str:
    """A group sentence ``group`` whose matching parameters ``unseen`` a decay could not show
    (:func:`decay_unseen`): where other parameters still match (``others``), the group read without them
    (``regroup()``) and they named as too small for it to show; where they are every matching parameter, the
    group's own contrast (``"every bias, pos matches"``) said to be too small for it to show. ``group`` where
    ``unseen`` is empty."""
    if not unseen:
        return group
    why = f"{TOO_SMALL} (c*lr*max|param| within tolerance: no evidence either way)"
    parts = group.split("; ")
    contrast = next(
        (i for i, p in enumerate(parts[1:], 1) if p.endswith(" matches") and "of this stage" not in p), None
    )
    if others or contrast is None:
        return f"{regroup()}; {name_leaves(unseen)}: {why}"
    parts[contrast] = f"{parts[contrast]} but is {why}"
    return "; ".join(parts)


def _zero_on_copies(form, record: StepRecord, by_stage, facts, mesh_shape) -> Form | None:
    """:func:`~shardcheck.parity.diagnosis.form.zero_on_copies` of ``form`` where the step's copies differ:
    the gradients' agreement read from ``by_stage`` (:func:`stage_leaves`), the pipeline axes from
    ``mesh_shape`` and ``facts`` (or, without a mesh, the axes named as a pipeline's)."""
    axes = tuple(record.replica_axes) if record.replica_mismatches else ()
    grads = by_stage.get("gradients") or []
    loss = by_stage.get("forward") or []
    matched = bool(grads) and all(e.ok for e in (*grads, *loss))
    if mesh_shape:
        pipeline = pipeline_axes(mesh_shape, facts)
    else:
        pipeline = tuple(a for a in axes if str(a).lower() in PIPELINE_AXIS_NAMES)
    return zero_on_copies(form, axes, gradients_match=matched, pipeline=pipeline)


# a factor's learning-rate reading (form.py's "factor" of an update)
LR_READINGS = (
    "from equal gradients (a learning rate or its schedule",
    "(a learning rate or its schedule, a loss scale)",
)


def _bias_correction_factor(form: Form | None, record: StepRecord) -> Form | None:
    """``form`` where it is no update factor said as a learning rate's, or no Adam count (a counter ``<p>.count``
    beside optimizer state ``<p>.mu`` / ``<p>.nu``) differs; else its reading as Adam's bias correction at another
    count (trial 47: the count stepped twice read "a learning rate or its schedule" beside "it sets no learning
    rate")."""
    if form is None or form.kind != "factor" or not any(r in form.sentence for r in LR_READINGS):
        return form
    state = {e.path for e in record.leaves if e.kind == "opt_state"}
    counts = [
        e.path
        for e in record.leaves
        if e.kind == "counter"
        and not e.ok
        and e.path.rsplit(".", 1)[-1] == "count"
        and any(p.startswith(e.path[: -len("count")] + m) for p in state for m in ("mu", "nu"))
    ]
    if not counts:
        return form
    head = form.sentence.split(": one scale of the whole update", 1)[0]
    tail = form.sentence.split("; left out of the fit", 1)[1:]
    said = (
        f"{head}: one scale of the whole update from Adam's bias correction at another count (its count "
        f"{counts[0]} differs: the update divides the moments by 1 - b1^count and 1 - b2^count), not a learning "
        "rate"
    )
    return dataclasses.replace(form, sentence=said + "".join(f"; left out of the fit{t}" for t in tail))


def _check_records(records) -> None:
    """Raises TypeError where ``records`` holds something that is not a :class:`StepRecord`."""
    for r in records:
        if not isinstance(r, StepRecord):
            raise TypeError(
                f"localize: records must be StepRecords (check_parity's report.steps), got {type(r).__name__}"
            )


def _state_step_form(bad: list[LeafError], records: Sequence[StepRecord]) -> Form | None:
    """The form of floating state the candidate's step wrote where the reference's step left it as it was
    (``reference_change`` 0), while the reference's step writes it at other steps of ``records``: a copy or sync
    at another step (trial 39: a target network synced at every step read "a weight meant to stay frozen was
    trained" beside the finding ``state_step``); ``None`` otherwise (a frozen weight: the state form stands)."""
    if not bad or not all(e.kind == "state" and e.reference_change == 0 for e in bad):
        return None
    paths = {e.path for e in bad}
    steps = sorted(
        {
            r.step
            for r in records
            for e in r.leaves
            if e.kind == "state" and e.path in paths and e.reference_change
        }
    )
    n, top = len(bad), max(e.max_abs_err for e in bad)
    what, it = ("this leaf", "it") if n == 1 else (f"these {n} leaves", "them")
    schedule = None if steps else sync_schedule(records, paths)
    if schedule:
        written, left, counters = schedule
        return Form(
            "reference_zero",
            f"a copy on a counter's schedule: the reference's step never writes {what} of non-parameter state, "
            f"and the candidate's step wrote {it} at {_steps(written)} and left {it} at {_steps(left)} beside a "
            f"counter only it keeps ({', '.join(counters)}): a target network's sync, which only a reference step "
            "that makes it checks",
            leaves=n,
        )
    if not steps:
        return None
    at = f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps[:-1]))}"
    at = f"{at} and {steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    return Form(
        "reference_zero",
        f"a write where the reference makes none at this step: the reference's step leaves {what} of "
        f"non-parameter state as {'it was' if n == 1 else 'they were'} here and writes {it} at {at}, and the "
        f"candidate's step moved {it} by up to {top:.3g}: a copy or sync at another step",
        leaves=n,
    )


def _state_factor_form(bad: list[LeafError], num_shards: int | None, replayed: bool = False) -> Form | None:
    """The form of floating state both steps write that the candidate's step wrote as exactly k times the
    reference's written value at every element (:func:`~shardcheck.parity.diagnosis.floating.written_factor`;
    ``replayed``: at every piece of its digests, :func:`~shardcheck.parity.diagnosis.floating.factor_read`):
    said with the shard count where k is it (a psum of a replicated value); ``None`` otherwise."""
    if not bad or not all(e.kind == "state" for e in bad):
        return None
    k = written_factor(bad)
    if k is None:
        return None
    n = len(bad)
    what = "this leaf" if n == 1 else f"these {n} leaves"
    size = (
        f" (x{k} = S, the shard count: a psum where a pmean or no reduction was meant)"
        if k == num_shards
        else ""
    )
    return Form(
        "state_amount",
        f"written x{k}: the candidate's step wrote {what} of non-parameter state as exactly {k} times the value the "
        f"reference's step wrote, {factor_read(replayed)}{size}",
        factor=float(k),
        leaves=n,
    )


def _steps(steps: list[int]) -> str:
    """``"step 1"``, ``"steps 1 and 3"``, ``"steps 0, 2 and 3"``."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {', '.join(map(str, steps[:-1]))} and {steps[-1]}"


def n_of(k: int, n: int) -> str:
    """``"the one failing leaf"``, ``"all 4 failing leaves"``, ``"2 of its 4 failing leaves"``."""
    if n == 1:
        return "the one failing leaf"
    return f"all {n} failing leaves" if k == n else f"{k} of its {n} failing leaves"


def _digested_replicas_form(record: StepRecord) -> Form | None:
    """A replay's ``replicas`` form, where it compared its copies by their digests (``StepRecord.replayed``): which
    copies differ and along which axes, with no factor (a digest holds no values to fit, as the live check's
    :func:`~shardcheck.parity.diagnosis.replica_form.fit_replicas` does); ``None`` for a live record."""
    if not record.replayed or not record.replica_mismatches:
        return None
    where = " and ".join(repr(a) for a in record.replica_axes) or "the replicated axes"
    n = len(record.replica_mismatches)
    return Form(
        "replicas",
        f"the copies of {n_leaves(n)} differ along {where} (a replay holds a digest of each device's copy, not "
        "its values: no factor between them is read; the live check fits them)",
        leaves=n,
    )


def _replicas_group(record: StepRecord, facts: Mapping[str, LeafFacts] | None) -> str:
    """What the parameters whose copies disagree share (an optimizer-state leaf read as the parameter it ends
    in: ``inner_state.0.mu.a.kernel`` is ``a.kernel``'s), and what the others do; ``""`` where none is named."""
    differ = set(record.replica_mismatches)
    params = {e.path: e.shape for e in record.leaves if e.kind == "param"}
    named = [e for e in record.leaves if e.kind in ("param", "opt_state")]
    failing = {
        param_path(e.path, params): params.get(param_path(e.path, params), e.shape)
        for e in named
        if e.name in differ
    }
    matching = {p: shape for p, shape in params.items() if p not in failing}
    if not failing:
        return ""
    # said of copies: a leaf of another stage (a row-parallel kernel's moments) may still differ
    group = shared_property(failing, matching, facts).replace(
        "every failing leaf", "every leaf whose copies differ"
    )
    # counted by parameter: "all 6 leaves differ" beside the optimizer state's "9 of 12 leaves" read as a
    # contradiction (trial 51)
    group = re.sub(r"^all (\d+) leaves differ$", r"the copies of all \1 parameters' leaves differ", group)
    return re.sub(
        r"\bmatch(es)?\b",
        lambda m: "has copies that agree" if m.group(1) else "have copies that agree",
        group,
    )


# how the grouping names a kind of leaf
GROUP_WORDS = {
    "opt_state": "optimizer-state",
    "param": "parameter",
    "grad": "gradient",
    "loss": "loss",
    "state": "non-parameter state",
}


def _group(
    bad: list[LeafError],
    leaves: list[LeafError],
    facts: Mapping[str, LeafFacts],
    params: Mapping | None = None,
    quiet: frozenset[str] = frozenset(),
    applied: frozenset[str] | set[str] = frozenset(),
) -> str:
    """What the failing leaves share among the stage's leaves of their own kinds (optimizer state read as its
    parameters, ``params``: ``{path: shape}``, where its own paths share nothing: :func:`state_property`; the
    matching leaves of the rounding-level parameters ``quiet`` set aside where only they contradict a property,
    said to differ where their parameters do in the applied update, ``applied``: parameter paths),
    and whether the other kinds of the stage all match; optimizer-state leaves listed by name, as the stage table
    lists them (``"opt_state 0.mu.a.kernel"``). Where the failing leaves are of several kinds and share nothing
    together, what the failing leaves of each kind share among that kind (``"optimizer-state leaves: every failing
    leaf is under 1.0.mu; every other leaf matches; and parameter leaves: only hidden.kernel differs; every other
    leaf matches"``)."""
    kinds = {e.kind for e in bad}
    same = [e for e in leaves if e.kind in kinds]
    failing = {e.path: e.shape for e in bad}
    matching = {e.path: e.shape for e in same if e.ok}
    names = {e.path: e.name for e in same if e.kind == "opt_state"}  # "opt_state 0.mu.a", as the stage table
    sentence = state_property(failing, matching, params or {}, facts, names, quiet, applied)
    if len(bad) == 1 and not matching:  # one leaf of its kind: named ("all 1 leaves differ" said nothing)
        sentence = f"only {bad[0].name} differs"
    if len(kinds) == 1:  # counted as leaves of their kind (trial 51: "all 6 leaves differ" of the parameters,
        (kind,) = kinds  # beside "the optimizer state differs (9 of 12 leaves)", read as a contradiction)
        sentence = re.sub(r"^all (\d+) leaves\b", rf"all \1 {GROUP_WORDS.get(kind, kind)} leaves", sentence)
    if len(kinds) > 1 and NO_PROPERTY in sentence:  # mixed kinds: what each kind's failing leaves share
        sentence = "; and ".join(
            f"{GROUP_WORDS[k]} leaves: "
            f"{_group([e for e in bad if e.kind == k], same, facts, params, quiet, applied)}"
            for k in sorted(kinds)
        )
    others = sorted({e.kind for e in leaves} - kinds)
    if others and all(e.ok for e in leaves if e.kind not in kinds):
        listed = " and ".join(GROUP_WORDS.get(k, k) for k in others)
        sentence += f"; every {listed} leaf of this stage matches"
    return sentence


def forward_group(grads: list[LeafError], facts: Mapping[str, LeafFacts]) -> str:
    """Where the loss differs at equal parameters and only some gradient leaves differ: which parameters the
    differing part of the loss reaches ("the loss's difference reaches the gradients of router.kernel only (1 of
    5 ...): a term of the loss whose gradient reaches only these parameters ..."); where the matching gradients
    are all at rounding level (:func:`at_rounding`), that it reaches every other one (the loss differs as a
    whole), and where every gradient differs, that too (``"the loss's difference reaches every gradient: all 12
    gradient leaves differ"``); where the failing and the matching gradients lie within a few tolerances of each
    other (:func:`tolerance_split`), that the split is the tolerance's, the matching ones named as within it, never
    a term of the loss; ``""`` where none does, or none was observed."""
    bad = [e for e in grads if not e.ok]
    if not bad:
        return ""
    if len(bad) == len(grads):
        return f"the loss's difference reaches every gradient: all {len(grads)} gradient leaves differ"
    scaled = whole_loss_factor(grads)
    if scaled is not None:
        quiet = sorted(e.path for e in grads if e.ok)
        listed = ", ".join(quiet[:4]) + (", ..." if len(quiet) > 4 else "")
        return (
            f"the loss's difference reaches every gradient that can show it: {len(bad)} of {len(grads)} gradient "
            f"leaves are {scaled:.4g} x the reference's; the other {len(quiet)} ({listed}) {_are(quiet)} too small to show "
            f"a factor {scaled:.4g} (rounding level)"
        )
    quiet = sorted(e.path for e in grads if e.ok)
    if all(at_rounding(e) for e in grads if e.ok):
        listed = ", ".join(quiet[:4]) + (", ..." if len(quiet) > 4 else "")
        return (
            f"the loss's difference reaches every gradient but the rounding-level ones: {len(bad)} of "
            f"{len(grads)} gradient leaves differ; the other {len(quiet)} ({listed}) {_are(quiet)} at rounding level (a "
            "true gradient of 0, such as an attention key bias's), too small to show a difference: the loss "
            "differs as a whole, not in a term that reaches only some parameters"
        )
    split = tolerance_split(grads)
    if split is not None:
        return _split_sentence(grads, split)
    which = common_prefix([e.path for e in bad])
    good = [e.path for e in grads if e.ok]
    if which and not any(p == which or p.startswith(which + ".") for p in good):
        which += ".*"
    else:
        which = ", ".join(sorted(e.path for e in bad)[:4]) + (", ..." if len(bad) > 4 else "")
    shared = shared_property({e.path: e.shape for e in bad}, {e.path: e.shape for e in grads if e.ok}, facts)
    return (
        f"the loss's difference reaches the gradients of {which} only ({len(bad)} of {len(grads)} gradient "
        f"leaves; every other gradient matches; {shared}): a term of the loss whose gradient reaches only these "
        "parameters (an auxiliary term such as a load-balancing or regularization loss, or their module's output) "
        "is computed differently"
    )


# how far beyond its tolerance (as a share of it) the worst failing gradient must lie, against the largest share a
# matching one uses, for the failing ones to be a group the loss's difference reaches apart from the others
SPLIT_GAP = 8.0


def _share(e: LeafError) -> float:
    """``max_abs_err / tolerance`` of ``e`` (inf at a tolerance of 0)."""
    return e.max_abs_err / e.tolerance if e.tolerance > 0 else math.inf


def tolerance_split(grads: Sequence[LeafError]) -> tuple[float, LeafError] | None:
    """Where the gradient leaves that fail and those that match are not told apart by their errors:
    ``(worst, closest)``, the worst failing leaf's error as a share of its tolerance and the matching leaf (not at
    rounding level: :func:`at_rounding`) that uses the largest share of its own, where the worst is within
    :data:`SPLIT_GAP` x that share; ``None`` otherwise (a clear gap, no failing or no such matching leaf, an error
    not finite). Then the split follows the tolerance, not a term of the loss: under bfloat16 compute a loss
    normalized otherwise moved 31 of 32 gradients 1.13 to 3.3 x their tolerances and the 32nd 0.90 x its own
    (issue #36, trial 18), and a replay's 4 x looser tolerances left 1 of 32 failing at 1.11 x, the next at 0.98 x;
    a term of the loss that reaches some parameters only moves them far beyond what the others' rounding uses."""
    bad = [e for e in grads if not e.ok]
    near = [e for e in grads if e.ok and not at_rounding(e)]
    if not bad or not near:
        return None
    worst = max(_share(e) for e in bad)
    closest = max(near, key=_share)
    if not math.isfinite(worst) or worst > SPLIT_GAP * _share(closest):
        return None
    return worst, closest


def _split_sentence(grads: Sequence[LeafError], split: tuple[float, LeafError]) -> str:
    """The group sentence of :func:`tolerance_split`: the failing gradients and how far, the matching ones named
    as within tolerance, and that no term is told apart."""
    worst, closest = split
    bad = sorted(e.path for e in grads if not e.ok)
    good = sorted(e.path for e in grads if e.ok)
    failing = ", ".join(bad[:4]) + (", ..." if len(bad) > 4 else "")
    matching = ", ".join(good[:4]) + (", ..." if len(good) > 4 else "")
    if len(bad) == 1:
        differ = f"1 of {len(grads)} gradient leaves differs, by {worst:.3g} x its tolerance"
    else:
        differ = (
            f"{len(bad)} of {len(grads)} gradient leaves differ, by at most {worst:.3g} x their tolerances"
        )
    if len(good) == 1:
        within = f"is within its tolerance, at {_share(closest):.3g} x it"
    else:
        within = f"are within their tolerances, up to {_share(closest):.3g} x ({closest.path})"
    return (
        f"the loss's difference reaches the gradients of {failing} ({differ}); the other {len(good)} ({matching}) "
        f"{within}: the failing and the matching gradients lie within a few tolerances of each other, so the "
        "split is the tolerance's, not a term of the loss that reaches only some parameters (the loss may differ "
        "as a whole)"
    )


def at_rounding(e: LeafError) -> bool:
    """Whether the matching gradient leaf ``e`` is at rounding level: the reference's largest element lies within
    the leaf's tolerance (a true gradient of 0, such as an attention key bias's), so that it would match under
    any difference of the loss (it would not show even a factor 2:
    :func:`~shardcheck.parity.diagnosis.evidence.would_show`)."""
    return not would_show(e, 2.0)


def whole_loss_factor(grads: list[LeafError]) -> float | None:
    """The one constant factor of every failing gradient leaf where no matching gradient leaf could have shown it
    (:func:`~shardcheck.parity.diagnosis.evidence.would_show`: a rounding-level gradient matches under any
    factor), as a scale of the whole loss gives; ``None`` otherwise (no gradient fails, or the factor is not
    one, or a matching gradient would show it: a term of the loss differs)."""
    bad = [e for e in grads if not e.ok]
    if not bad:
        return None
    form = form_from_leaves(bad, update=False)
    if form.kind != "factor" or any(would_show(e, form.factor) for e in grads if e.ok):
        return None
    return form.factor


# a forward form's reading of the gradients where tolerance_split holds
SPLIT_WHY = (
    "the gradients that differ and those that match lie within a few tolerances of each other (the group): no "
    "one term of the loss is told apart; the loss may differ as a whole"
)


# the faulty reductions of StepRecord.matches that normalize the loss another way (the same function of the
# parameters, weighed otherwise across the shards or micro-batches)
NORMALIZED_AS = (
    "per_shard_mean",
    "per_shard_loss",
    "per_shard_loss_value",
    "per_shard_mean_value",
    "per_micro_mean",
)


PER_SHARD_LOSS = frozenset({"per_shard_loss", "per_shard_loss_value"})
"""The hypotheses of :data:`NORMALIZED_AS` that reproduce a loss computed per shard on shards of equal weight: no
normalization, a loss whose rows are coupled (``per_shard_loss`` finding)."""


def reduced_reading(record: StepRecord) -> str:
    """What a forward stage whose gradients differ by no one factor is, where the record names a reduction:
    ``"the loss is normalized another way across the shards (the normalization named below)"`` where the step
    reproduces a per-shard or per-micro-batch normalization (``matches``, ``per_shard_factor``, ``micro_means``);
    ``"the loss or its gradients are reduced another way across the shards (the reduction named below)"`` where
    replicated copies differ; ``""`` otherwise (trial 44: a loss 0.9985 x the reference's through a per-shard
    normalization read "the forward pass computes another function of the parameters")."""
    matched = set(record.matches) & set(NORMALIZED_AS)
    if matched and matched <= PER_SHARD_LOSS and not record.per_shard_factor and not record.micro_means:
        # shards of equal weight: no normalization differs, the loss of each shard's rows alone does (batch
        # statistics or dropout draws per shard; trial 50 read "the normalization named below" beside it)
        return "the loss is computed on each shard's rows alone and averaged (the per-shard loss named below)"
    if matched or record.per_shard_factor or record.micro_means:
        return "the loss is normalized another way across the shards (the normalization named below)"
    if record.replica_mismatches:
        return (
            "the loss or its gradients are reduced another way across the shards (the reduction named below)"
        )
    return ""


def stepped_within(record: StepRecord) -> int | None:
    """k >= 2 where the candidate's optimizer was stepped k times within each step: its update counter is k x
    the reference's (``candidate_step_count``, ``step_count``) and every failing counter of the optimizer's state
    whose values are known (``LeafError.counts``: Adam's ``count``, a schedule's) is k x the reference's too;
    ``None`` otherwise (counters that agree, or another ratio)."""
    ref, cand = record.step_count, record.candidate_step_count
    if ref <= 0 or cand % ref or cand // ref < 2:
        return None
    k = cand // ref
    counters = [
        e for e in record.leaves if e.kind == "counter" and not e.ok and not e.path.startswith("model.")
    ]
    if any(e.counts is not None and e.counts[1] != k * e.counts[0] for e in counters):
        return None
    return k


def stepped_reading(record: StepRecord, grads_observed: bool = True) -> str:
    """What a forward stage whose loss or gradients differ is where the optimizer was stepped k times within the
    step (:func:`stepped_within`): ``"the optimizer was stepped 4 times within the step (its counters are 4 x the
    reference's): the loss and gradients it returns are the reference's function taken at other parameters (the
    states those updates left)"`` (``grads_observed`` False: "the loss it returns is"); ``""`` otherwise (trial
    46: a GPipe step that updated once per micro-batch read "the forward pass computes another function of the
    parameters", while its function was the reference's, taken at 4 successive parameter states)."""
    k = stepped_within(record)
    if k is None:
        return ""
    returned = "the loss and gradients it returns are" if grads_observed else "the loss it returns is"
    return (
        f"the optimizer was stepped {k} times within the step (its counters are {k} x the reference's): "
        f"{returned} the reference's function taken at other parameters (the states those updates left)"
    )


def _forward_reading(record: StepRecord) -> str:
    """What a forward stage whose loss differs by no one factor is read as, where the record says:
    :func:`stepped_reading` (the optimizer stepped k times within the step; the gradients observed where the
    record holds them), else :func:`reduced_reading`."""
    grads = any(e.kind == "grad" for e in record.leaves)
    return stepped_reading(record, grads) or reduced_reading(record)


def _loss_alone(bad: list[LeafError], later: list[LeafError]) -> str:
    """The forward stage's group where its one failing leaf is the loss, no gradient was observed, and leaves of
    later stages fail too: the loss named as this stage's, never "only loss differs" beside a Stages list whose
    optimizer state, parameters or counters differ (trial 44: an optimizer stepped per micro-batch); ``""``
    otherwise."""
    if len(bad) != 1 or bad[0].kind != "loss" or not later:
        return ""
    kinds = words_and(sorted({GROUP_WORDS.get(e.kind, e.kind) for e in later}))
    return (
        f"the loss, the forward stage's one leaf, differs (the gradients were not observed); {kinds} leaves of the "
        "later stages differ too (the Stages list)"
    )


def _carries(f: float, e: LeafError) -> bool:
    """Whether the failing later leaf ``e`` carries the loss's factor ``f``, one factor across its elements: ``f``
    x the reference's, or ``f**2`` for an optimizer-state leaf (a second moment, Adam's ``nu``, is a running mean
    of squared gradients: a loss x4 writes it x16)."""
    from shardcheck.parity.diagnosis.evidence import RATIO_RTOL, one_factor_across

    factors = (f, f * f) if e.kind == "opt_state" else (f,)
    return (
        e.ratio is not None
        and one_factor_across(e)
        and any(abs(e.ratio - k) <= RATIO_RTOL * abs(k) for k in factors)
    )


def _squared(f: float, e: LeafError) -> bool:
    """Whether ``e``, a leaf that :func:`_carries` ``f``, carries its square (a second moment)."""
    return e.kind == "opt_state" and abs(e.ratio - f) > abs(e.ratio - f * f)


def _normalized(f: float, later: list[LeafError]) -> bool:
    """Whether the failing later leaves are those of an update normalized by its second moment, under gradients
    ``f`` x the reference's: every failing optimizer-state leaf carries ``f`` or its square, one of them the
    square (Adam's ``nu``), and the rest are parameters. Such an update, ``mu / (sqrt(nu) + eps)``, is not scaled
    by the gradients' factor: it moves only through its epsilon, by no one factor (trial 49: a sum for a mean
    under Adam, ``eps=1e-2``, read "the later stages that differ do not carry 16" beside "optimizer moments are
    16 x the reference's")."""
    moments = [e for e in later if e.kind == "opt_state"]
    return (
        bool(moments)
        and all(_carries(f, e) for e in moments)
        and any(_squared(f, e) for e in moments)
        and all(e.kind in ("opt_state", "param") for e in later)
    )


def _later_agree(f: float, later: list[LeafError]) -> bool:
    """Whether the failing leaves of the stages after the forward pass carry the loss's factor ``f`` (a loss factor
    with no gradient observed is then more than one scalar's ratio): every one of them :func:`_carries` it, or
    the optimizer state carries it and only the parameters of an update normalized by it do not
    (:func:`_normalized`); ``True`` where none fails."""
    return all(_carries(f, e) for e in later) or _normalized(f, later)


def _later_carry(f: float, later: list[LeafError]) -> str:
    """``"; the 4 leaves of the later stages that differ carry it (2 x 4, 2 x 16: a second moment carries its
    square)"``: what the failing later leaves, which :func:`_later_agree` found to carry the loss's factor ``f``,
    show of it, and the parameters of a normalized update that do not (:func:`_normalized`); ``""`` where none
    fails."""
    carrying = [e for e in later if _carries(f, e)]
    if not carrying:
        return ""
    squared = sum(1 for e in carrying if _squared(f, e))
    carried = f"{len(carrying) - squared} x {f:.4g}" + (f", {squared} x {f * f:.4g}" if squared else "")
    square = ": a second moment carries its square" if squared else ""
    if len(carrying) == len(later):
        return f"; the {len(later)} leaves of the later stages that differ carry it ({carried}{square})"
    params = len(later) - len(carrying)
    leaves = (
        "1 parameter leaf that differs carries"
        if params == 1
        else f"{params} parameter leaves that differ carry"
    )
    return (
        f"; the {len(carrying)} optimizer-state leaves that differ carry it ({carried}{square}): by them the gradients "
        f"were {f:.4g} x too; the {leaves} no factor {f:.4g}, as Adam's step, "
        "normalized by its second moment, is not scaled by the gradients' factor and moves only through "
        "its epsilon"
    )


def _not_carried(f: float, later: list[LeafError]) -> str:
    """``"3 of the 7 later leaves that differ do not carry 16"`` (``"none of the 4 later leaves that differ
    carries 16"``): the later leaves that, against :func:`_later_agree`, do not carry the loss's factor ``f``; of
    an ``f`` within ``RATIO_RTOL`` of 1 (a loss 1.001 x), that no leaf can show it (a leaf "carrying" 1.001 within
    the 2% a factor is read to is one that matches: counting such leaves said nothing)."""
    from shardcheck.parity.diagnosis.evidence import RATIO_RTOL

    if abs(f - 1) <= RATIO_RTOL:  # within a factor's own width of 1: a leaf "carrying" it is one that matches
        return f"no later leaf can show a factor this close to 1 ({f:.4g})"
    missing = sum(1 for e in later if not _carries(f, e))
    if missing == len(later):
        return (
            f"the later leaf that differs does not carry {f:.4g}"
            if missing == 1
            else (f"none of the {missing} later leaves that differ carries {f:.4g}")
        )
    return f"{missing} of the {len(later)} later leaves that differ " + (
        f"does not carry {f:.4g}" if missing == 1 else f"do not carry {f:.4g}"
    )


def _widest_later(f: float, later: list[LeafError]) -> str:
    """``"; of the later stages, 0.mu.kernel has no constant factor: its elementwise ratio runs from 0.8 to 1.3
    (10th-90th percentile), median 1.02"``: of the failing later leaves that do not carry the loss's factor ``f``
    (:func:`_carries`), the one whose ratio spreads widest relative to its median, what a loss read as one
    scalar's ratio leaves to be read (:func:`forward_form`); of one whose ratio is one factor across it, that
    factor (``"0.mu.kernel is 3 x the reference's on every element"``); ``""`` where none has a ratio."""
    from shardcheck.parity.diagnosis.evidence import one_factor_across, spread_phrase

    seen = [e for e in later if e.ratio is not None and not _carries(f, e)]
    spread = [e for e in seen if e.spread is not None and not one_factor_across(e)]
    if spread:
        widest = max(spread, key=lambda e: (e.spread[1] - e.spread[0]) / max(abs(e.ratio), 1e-30))
        return f"; of the later stages, {widest.path} has {spread_phrase(widest)}"
    if seen:
        return (
            f"; of the later stages, {seen[0].path} is {seen[0].ratio:.4g} x the reference's on every element"
        )
    return ""


def forward_form(
    form: Form | None,
    bad: list[LeafError],
    grads: list[LeafError] | None = None,
    reduced: str = "",
    later: list[LeafError] | None = None,
) -> Form | None:
    """A forward stage's constant factor said of what it scales, never of an update (no optimizer step, no
    learning rate): the loss at equal parameters (``"... : the loss at equal parameters is 4 x the reference's"``
    and what the gradients show of it: the whole loss scaled where every gradient that can show it carries the same
    factor, one term of it where only some gradients differ, a loss computed apart from the one differentiated
    where every gradient matches, else unknown), or a counter the forward pass writes (``"... : the forward pass's
    counter model.calls is 2 x the reference's: the forward pass ran 2 times a step"``; one left as it was: its
    writes dropped, never a learning rate of 0). A loss factor that prints
    as 1 is no scale: said by the loss's relative difference (:func:`_loss_nudged`). Any other form is returned
    as it is.

    Args:
        form: the forward stage's form (fitted with ``update=False``), or ``None``.
        bad: the forward stage's failing leaves (the loss, ``counter model.*``).
        grads: the gradient leaves of the step (``None`` or empty: not observed).
        reduced: :func:`stepped_reading` or :func:`reduced_reading` of the step: where set, gradients that
            differ by no one factor are said as it, not as "another function of the parameters" (the function is
            the same, taken at other parameters or weighed otherwise).
        later: the failing leaves of the stages after the forward pass: with no gradient observed, the loss's
            ratio (one scalar) is said as a factor only where they all carry it too (:func:`_later_agree`).
    """
    if form is not None and form.kind == "zero" and bad and all(e.kind == "counter" for e in bad):
        names = ", ".join(sorted(e.path for e in bad))
        return dataclasses.replace(
            form,
            sentence=f"a zero change: the candidate left the forward pass's counter {names} as it was while the "
            "reference's step advanced it: the step dropped what its forward pass writes (no learning rate or "
            "update is involved; an RNG stream's count left as it was draws this step's numbers again at the next)",
        )
    if form is None or form.kind != "factor" or len({e.kind for e in bad}) != 1:
        return form
    # a scalar (the loss, a counter) has no elements to be constant across: its factor is said as a number
    f, head = form.factor, f"a factor {form.factor:.4g}"
    if bad[0].kind != "loss":
        k = round(f)
        ran = f"ran {k} times" if k >= 2 and abs(f - k) <= 0.02 * k else "ran another number of times"
        names = ", ".join(sorted(e.path for e in bad))
        meaning = (
            f"the forward pass's counter {names} is {f:.4g} x the reference's: the forward pass {ran} a step"
        )
        return dataclasses.replace(form, sentence=f"{head}: {meaning}")
    scaled = whole_loss_factor(grads or [])
    if f"{f:.4g}" == "1":  # a factor that prints as 1 is no scale: the loss's relative difference is said
        return _loss_nudged(form, f, grads or [], reduced)
    if not grads and not _later_agree(
        f, later or []
    ):  # one scalar's ratio, which the later stages do not carry
        return dataclasses.replace(
            form,
            kind="none",
            sentence=f"the loss at equal parameters is {f:.4g} x the reference's, the ratio of one scalar: no "
            f"factor is read from it (the gradients were not observed, and {_not_carried(f, later or [])}); "
            + (
                reduced
                or "its scale, its normalization or one of its terms differs, or it is combined another "
                "way (a mean of micro-batch or shard means)"
            )
            + _widest_later(f, later or []),
            factor=None,
            spread=None,
        )
    why = _loss_factor_why(f, grads or [], scaled, reduced) + ("" if grads else _later_carry(f, later or []))
    meaning = f"the loss at equal parameters is {f:.4g} x the reference's; {why}"
    if why.endswith("not a scaled loss"):  # no factor to claim: said as the loss's ratio alone (trial 31)
        return dataclasses.replace(form, kind="none", sentence=meaning, factor=None, spread=None)
    return dataclasses.replace(form, sentence=f"{head}: {meaning}")


def _loss_factor_why(f: float, grads: list[LeafError], scaled: float | None, reduced: str) -> str:
    """What the gradients ``grads`` of a step say of the loss's factor ``f`` at equal parameters
    (:func:`forward_form`): ``scaled`` is :func:`whole_loss_factor` of them, ``reduced``
    :func:`reduced_reading`'s sentence."""
    if not grads:
        why = "its scale, its normalization or one of its terms differs (the gradients were not observed)"
    elif all(e.ok for e in grads):
        why = (
            "every gradient matches at this step: the loss returned is computed apart from the one differentiated, "
            "or it differs where its gradient does not at these parameters (a clipped or thresholded term whose "
            "active rows agree here, such as PPO's clip epsilon)"
        )
    elif scaled is not None and abs(scaled - f) <= 0.02 * abs(f):
        why = (
            f"every gradient that can show it is {scaled:.4g} x too: the whole loss is scaled, its normalization "
            "differs (a sum for a mean, another count or divisor, a loss scale not undone)"
        )
    elif scaled is None and near_factor(grads, f) is not None:
        lo, hi = near_factor(grads, f)
        why = (
            f"every failing gradient's median ratio is near {f:.4g} ({lo:.4g}..{hi:.4g}), though not constant "
            "across its elements (the compute's rounding spreads them): the whole loss is likely scaled, its "
            "normalization differs (a sum for a mean, another count or divisor, a loss scale not undone)"
        )
    elif scaled is None and all(at_rounding(e) for e in grads if e.ok):
        function = reduced or "the forward pass computes another function of the parameters"
        why = f"{_every_gradient(grads)} differs, by no one factor: {function}, not a scaled loss"
    elif scaled is None and tolerance_split(grads) is not None:
        why = SPLIT_WHY
    elif scaled is None:
        why = "only some gradients differ: one term of the loss differs (the group)" + _term_factors(grads)
    else:
        why = f"the gradients are {scaled:.4g} x the reference's: the loss and its gradients are scaled apart"
    return why


# how near the loss's factor f every failing gradient's median ratio lies (a share of |f - 1|), where no one factor
# fits their elements; a factor within MIN_SCALE of 1 is no scale to read this way
NEAR_FACTOR = 0.1
MIN_SCALE = 0.25


def near_factor(grads: list[LeafError], f: float) -> tuple[float, float] | None:
    """``(least, most)`` median ratio of the failing gradient leaves where every one lies within :data:`NEAR_FACTOR`
    x ``|f - 1|`` of the loss's factor ``f`` (at least :data:`MIN_SCALE` from 1) and no matching one would show ``f``
    (:func:`~shardcheck.parity.diagnosis.evidence.would_show`); else ``None``. Under bfloat16 compute a loss
    divided by the local count (x4) moved every gradient by about x4 while their elements' ratios spread too far
    for one factor (issue #36, trial 22), and the sentence had said "not a scaled loss"."""
    bad = [e for e in grads if not e.ok]
    ratios = [e.ratio for e in bad if e.ratio is not None and math.isfinite(e.ratio)]
    if abs(f - 1.0) < MIN_SCALE or not bad or len(ratios) < len(bad):
        return None
    if any(would_show(e, f) for e in grads if e.ok) or any(
        abs(r - f) > NEAR_FACTOR * abs(f - 1.0) for r in ratios
    ):
        return None
    return min(ratios), max(ratios)


def _loss_nudged(form: Form, f: float, grads: list[LeafError], reduced: str = "") -> Form:
    """A loss at equal parameters whose ratio to the reference's prints as 1 to 4 digits (``|f - 1| < 5e-4``):
    said by its relative difference (``"the loss at equal parameters differs by 7.6e-05 of its value (above the
    reference's): not a scale of the loss; ..."``) and what the gradients show, never as "1 x the reference's";
    a ``none`` form (no factor)."""
    side = "above" if f > 1 else "below"
    head = (
        f"the loss at equal parameters differs by {abs(f - 1):.2g} of its value ({side} the reference's): not "
        "a scale of the loss"
    )
    if not grads:
        why = "the loss is computed another way (the gradients were not observed)"
    elif all(e.ok for e in grads):
        why = (
            "every gradient matches at this step: the loss returned is computed apart from the one differentiated, "
            "or it differs where its gradient does not at these parameters (a clipped or thresholded term whose "
            "active rows agree here, such as PPO's clip epsilon)"
        )
    elif all(at_rounding(e) for e in grads if e.ok):
        function = reduced or "the forward pass computes another function of the parameters"
        why = f"{_every_gradient(grads)} differs: {function}"
    elif tolerance_split(grads) is not None:
        why = SPLIT_WHY
    else:
        why = "only some gradients differ: one term of the loss differs (the group)" + _term_factors(grads)
    return dataclasses.replace(form, kind="none", sentence=f"{head}; {why}", factor=None, spread=None)


def _term_factors(grads: list[LeafError]) -> str:
    """``"; value.bias, value.kernel: 4 x the reference's on every element (spread 4..4), the leaves that term
    alone may reach"`` for the failing gradient leaves whose ratio is one factor across the leaf
    (:func:`~shardcheck.parity.diagnosis.evidence.one_factor_across`), grouped by factor; ``""`` where none is
    (trial 24: a value loss summed over 4 shards, x4 on the value head alone, had no number said)."""
    from shardcheck.parity.diagnosis.evidence import RATIO_RTOL, one_factor_across
    from shardcheck.parity.diagnosis.topology import factor_groups

    factors = {
        e.path: e.ratio
        for e in grads
        if not e.ok
        and e.ratio is not None
        and math.isfinite(e.ratio)
        and e.ratio != 0
        and one_factor_across(e)
    }
    groups = [(f, paths) for f, paths in factor_groups(factors, RATIO_RTOL) if abs(f - 1) > RATIO_RTOL]
    if not groups:
        return ""
    spread = {e.path: e.spread for e in grads if e.path in factors}
    said = []
    for f, paths in groups:
        lo = min((spread[p] or (factors[p],) * 2)[0] for p in paths)
        hi = max((spread[p] or (factors[p],) * 2)[1] for p in paths)
        said.append(
            f"{', '.join(paths)}: {f:.4g} x the reference's on every element (spread {lo:.4g}..{hi:.4g})"
        )
    return (
        "; "
        + "; ".join(said)
        + ": where one term alone reaches these leaves, that term is this factor x the "
        "reference's (a term summed over the shards where a mean was due reads x S)"
    )


def _every_gradient(grads: list[LeafError]) -> str:
    """``"every gradient"`` where every gradient leaf differs, ``"every gradient but the rounding-level ones"``
    where some match (each at rounding level: :func:`at_rounding`, the caller's condition)."""
    return "every gradient but the rounding-level ones" if any(e.ok for e in grads) else "every gradient"


def _kinds(record: StepRecord, ok: bool) -> set[str]:
    return {e.kind for e in record.leaves if e.ok is ok}


def _counters_match(record: StepRecord) -> bool:
    counters = [e for e in record.leaves if e.kind == "counter" and not e.path.startswith("model.")]
    return bool(counters) and all(e.ok for e in counters)


def _whole_update_refuted(record: StepRecord, text: str) -> bool:
    """ "one scale of the whole update" (of "a constant factor F") while some parameter matches that would have
    shown F (:func:`~shardcheck.parity.diagnosis.evidence.would_show`)."""
    said = re.search(r"constant factor (-?[\d.]+(?:e-?\d+)?)", text)
    f = float(said.group(1)) if said else math.inf
    params = [e for e in record.leaves if e.kind == "param"]
    return any(not e.ok for e in params) and any(e.ok and would_show(e, f) for e in params)


def _gradient_factor(
    form: Form,
    bad: list[LeafError],
    leaves: list[LeafError],
    record: StepRecord,
    num_shards: int | None = None,
) -> Form:
    """A factor on the gradients that every gradient able to show it has (the rest too small: at rounding
    level) is one scale of the loss, named by the batch's loss weight where it is that, where the loss differs
    too or was not observed; where the loss was observed and matches, one scale of the gradients after the loss
    (:func:`gradients_after_loss`: their reduction, never a loss sum not divided by its count); a factor that
    some gradients that would show it lack stays a scale of these leaves only. A factor that is the weight and a
    power of ``num_shards`` at once is said as both (:func:`~shardcheck.parity.diagnosis.form.weight_or_shards`)."""
    f = form.factor
    grads = [e for e in leaves if e.kind == "grad"]
    if any(e.ok and would_show(e, f) for e in grads):
        return form
    spread = "" if form.spread is None else f" (spread {form.spread[0]:.4g}..{form.spread[1]:.4g})"
    quiet = sum(e.ok for e in grads)
    but = f" but the {quiet} too small to show it (at rounding level)" if quiet else ""
    head = f"every gradient{but} is {f:.4g} x the reference's{spread}"
    loss = [e for e in record.leaves if e.kind == "loss"]
    weight = weight_or_shards(f, record.loss_weight, num_shards) or weight_phrase(f, record.loss_weight)
    if loss and all(e.ok for e in loss):  # the loss was observed and matches: the factor is downstream of it
        # the batch's weight itself: the gradients of the sum, the loss returned divided (a count is no reduction)
        said = (
            f"the loss matches, the gradients carry the factor: {weight}"
            if weight
            else gradients_after_loss(f)
        )
        return dataclasses.replace(form, sentence=f"{head}: {said}")
    cause = (
        weight or "a loss sum not divided by its count, or divided by another count (a wrong normalization)"
    )
    return dataclasses.replace(form, sentence=f"{head}: one scale of the whole loss: {cause}")


def gradients_after_loss(f: float) -> str:
    """How a factor ``f`` on every gradient is said where the loss was observed and matches
    (:func:`_gradient_factor`): a scale of the gradients after the loss, with the reductions that give a factor
    on its side of 1 (trial 24: a x0.25 had been offered "a sum in place of a mean")."""
    causes = (
        "a mean taken twice, a pmean after a reduction already done, a division by a count twice"
        if f < 1
        else "a sum in place of a mean, a transpose that already summed before a psum"
    )
    return (
        "the returned loss matches, so the factor comes after it: one scale of the gradients after the loss (their "
        f"reduction or a factor applied to them: {causes}), or of the loss the gradients were taken of but not of "
        "the one returned (a loss multiplied by a count, such as the micro-batch count, inside jax.grad only); not "
        "the loss's normalization (which would move the returned loss too)"
    )


def _are(items) -> str:
    return "is" if len(items) == 1 else "are"


def _counters_factor(form: Form, bad: list[LeafError]) -> Form:
    """A factor on the counters alone (every parameter and optimizer-state leaf matches: the localization's
    first stage is the counters): said of the counters, never as "the update is k x" (trials 28 and 29: a
    schedule's count advanced twice a step read "as 2 optimizer steps instead of one produce" beside "every
    optimizer-state leaf of that step matches: one update was applied")."""
    names = ", ".join(sorted(e.path for e in bad))
    k = round(form.factor)
    times = f"{k} times" if k >= 2 and abs(form.factor - k) <= 0.02 * k else f"{form.factor:.4g} x as far"
    return dataclasses.replace(
        form,
        kind="factor",
        sentence=f"a factor {form.factor:.4g} on the counters ({names}) alone: every parameter and optimizer-state "
        f"leaf matches, so one update was applied while the counter advanced {times} (a schedule's or the "
        "optimizer's count stepped per micro-batch, or stepped again outside optimizer.update)",
    )


def checked_form(
    form: Form | None,
    stage: str,
    bad: list[LeafError],
    leaves: list[LeafError],
    record: StepRecord,
    num_shards: int | None = None,
) -> Form | None:
    """``form`` with no claim that ``record`` contradicts: an update that is k x the reference's is said to be
    k optimizer steps only where the counters do not match, and to be "the whole update" only where every
    update leaf of its kinds fails. Otherwise it is said as a factor on the failing group ("every update is
    2.000 x the reference's (spread ...): a learning rate 2 x, or the update applied 2 times"), scoped to the
    group where some update leaves match, the group named as the grouping names it (one leaf by itself). A
    factor on failing optimizer-state leaves alone is never a learning rate (which does not move the state): it
    is said as the state's own update differing (:func:`_state_factor`: a moment decay rate such as Adam's b2).

    Args:
        form: the stage's fitted form, or ``None``.
        stage: the stage the form describes (:data:`STAGES`); only ``optimizer`` and ``parameters`` are read.
        bad: the stage's failing leaves; ``leaves``: all of the stage's leaves.
        record: the first failing step's record (its counters are read).
        num_shards: the candidate's shard count, where known (a gradient factor's readings).

    Returns:
        ``form`` itself, or a ``factor`` form whose sentence the record does not contradict.
    """
    if form is not None and form.kind == "factor" and stage == "gradients":
        return _gradient_factor(form, bad, leaves, record, num_shards)
    if form is not None and stage == "counters" and form.kind in ("extra_step", "factor"):
        return _counters_factor(form, bad)
    if form is None or form.kind not in ("extra_step", "factor") or stage not in ("optimizer", "parameters"):
        return form
    kinds = {e.kind for e in bad}
    subset = any(e.ok and would_show(e, form.factor) for e in leaves if e.kind in kinds)
    state = kinds == {"opt_state"}
    if state and form.kind == "extra_step" and not _counters_match(record):
        return form  # k optimizer steps, as the counters say: they move the state too
    if not (subset or state) and not (form.kind == "extra_step" and _counters_match(record)):
        return form
    f = form.factor
    spread = "" if form.spread is None else f" (spread {form.spread[0]:.4g}..{form.spread[1]:.4g})"
    k = round(f)
    twice = f", or the update applied {k} times" if k >= 2 and abs(f - k) <= 0.02 * k else ""
    twice += _micro_step_schedule(f, record)
    steps = " (not an extra optimizer step: the counters match)" if _counters_match(record) else ""
    if state:  # a learning rate never moves optimizer state
        sentence = _state_factor(f, spread, bad, leaves, record) + steps
    elif subset:
        sentence = (
            f"the update of {_which(bad, leaves)} is {f:.4g} x the reference's{spread}; every other update "
            f"matches: a learning rate {f:.4g} x for these leaves (a parameter group's learning rate or "
            f"multiplier){twice}{steps}"
        )
    else:
        sentence = (
            f"every update is {f:.4g} x the reference's{spread}: a learning rate {f:.4g} x{twice}{steps}"
        )
    return dataclasses.replace(form, kind="factor", sentence=sentence)


def _micro_step_schedule(f: float, record: StepRecord) -> str:
    """Where the task's learning-rate schedule read at a count of micro-steps gives the update factor ``f``
    (``StepRecord.micro_step_lr``, within :data:`RATIO_RTOL`; the fewest micro-steps first), that reading: ``",
    or the task's schedule read at count 2 where the step's count is 1 (lr(2) / lr(1) = 2: a schedule counting 2
    micro-steps a step, where the task's counts optimizer steps)"``; ``""`` otherwise."""
    for k, c, m, ratio in record.micro_step_lr:
        if abs(ratio - f) <= RATIO_RTOL * abs(f):
            return (
                f", or the task's schedule read at count {m} where the step's count is {c} (lr({m}) / lr({c}) = "
                f"{ratio:.4g}: a schedule counting {k} micro-steps a step, where the task's counts optimizer steps)"
            )
    return ""


def _which(bad: list[LeafError], leaves: list[LeafError]) -> str:
    """The failing leaves as the group names them: one by itself (``"opt_state 1.0.nu.moe.b_out"``, a parameter
    by its path), several as their common module (``"moe.*"``) where no matching leaf of the stage lies under it,
    else listed (4 at most)."""

    def name(e: LeafError) -> str:
        return e.name if e.kind == "opt_state" else e.path

    if len(bad) == 1:
        return name(bad[0])
    prefix = common_prefix([e.path for e in bad])
    under = [e for e in leaves if e.ok and (e.path == prefix or e.path.startswith(prefix + "."))]
    if prefix and not under:
        return f"{'opt_state ' if all(e.kind == 'opt_state' for e in bad) else ''}{prefix}.*"
    return ", ".join(sorted(name(e) for e in bad)[:4]) + (", ..." if len(bad) > 4 else "")


# a moment of the optimizer state, the decay rate of its update, and common reference values of that rate
_MOMENTS = {"mu": ("(1 - b1)(g - mu)", "b1", (0.9, 0.95)), "nu": ("(1 - b2)(g^2 - nu)", "b2", (0.999, 0.99))}


def _state_factor(
    f: float, spread: str, bad: list[LeafError], leaves: list[LeafError], record: StepRecord
) -> str:
    """Failing optimizer-state leaves alone whose change is ``f`` x the reference's: the state's own update
    differs (a learning rate scales the parameters' update, never the state's); a moment (``mu``, ``nu`` in the
    paths) named with its update and the decay rates that give ``f``, e.g. ``nu``'s ``(1 - b2)(g^2 - nu)``: a b2
    of 0.9 for 0.99 is 10 x."""
    every = all(not e.ok for e in leaves if e.kind == "opt_state")
    head = f"the change of {'every optimizer-state leaf' if every else _which(bad, leaves)} in this step is "
    head += f"{f:.4g} x the reference's{spread}" + ("" if every else "; every other leaf matches")
    one = "this leaf" if len(bad) == 1 else "these leaves"
    cause = (
        f"the optimizer state's own update differs for {one}, not a learning rate (which scales the "
        f"parameters' update and never moves the state)"
    )
    moments = {m for e in bad for m in _MOMENTS if m in e.path.split(".")}
    if len(moments) == 1:
        m = moments.pop()
        update, rate, refs = _MOMENTS[m]
        pairs = [(round(1 - f * (1 - b), 6), b) for b in refs]
        said = [f"{c:.4g} for {b:.4g}" for c, b in pairs if 0 <= c < 1 and f"{c:.4g}" != f"{b:.4g}"]
        example = f" ({rate} = {', or '.join(said)})" if said else ""
        cause += (
            f": a decay rate such as Adam's {rate} differing: the change of {m} is {update}, {f:.4g} x where "
            f"1 - {rate} is {f:.4g} x the reference's{example}"
        )
    else:
        cause += ": a decay rate of the state (such as Adam's b1 or b2) or the term it accumulates differs"
    if not any(e.kind == "grad" for e in record.leaves):
        cause += "; or the gradients it was given differ (they were not observed)"
    return f"{head}: {cause}"


_SCALED_GRADIENTS = re.compile(r"\bgradients are (-?[\d.]+(?:e-?\d+)?) x the reference")


# sentences a finding may say, each with the test of the first failing record that contradicts it
CLAIMS: tuple[tuple[str, object], ...] = (
    ("only the loss matches", lambda r: bool(_kinds(r, True) & {"grad", "opt_state"})),
    ("only the returned loss differs", lambda r: bool(_kinds(r, False) - {"loss"})),
    ("the update matches", lambda r: "param" in _kinds(r, False)),
    ("the exposed gradients differ", lambda r: "grad" not in _kinds(r, False)),
    ("the exposed gradients match", lambda r: "grad" in _kinds(r, False)),
    ("optimizer steps instead of one", _counters_match),
)


def contradiction(message: str, records: Sequence[StepRecord]) -> str | None:
    """The claim of ``message`` that the first failing record of ``records`` contradicts (e.g. "only the loss
    matches" while some gradient or optimizer-state leaf matches), else ``None`` (also when every record
    passed)."""
    record = next((r for r in records if not r.ok), None)
    if record is None:
        return None
    text = message.lower()
    found = next((claim for claim, refuted in CLAIMS if claim in text and refuted(record)), None)
    if found is None and "one scale of the whole update" in text and _whole_update_refuted(record, text):
        found = "one scale of the whole update"
    return found or _scaled_gradients_refuted(text, record)


def _scaled_gradients_refuted(text: str, record: StepRecord) -> str | None:
    """ "gradients are f x the reference's" (every gradient) while some gradient leaf matches that would have
    shown the factor f (:func:`~shardcheck.parity.diagnosis.evidence.would_show`)."""
    said = _SCALED_GRADIENTS.search(text)
    if said is None:
        return None
    f = float(said.group(1))
    refuted = any(e.ok and would_show(e, f) for e in record.leaves if e.kind == "grad")
    return "gradients are f x the reference's" if refuted else None


def consistent(findings: Sequence, records: Sequence[StepRecord]) -> list:
    """``findings`` (:class:`~shardcheck.parity.diagnosis.evidence.Diagnosis`) without those whose message the
    records contradict (:func:`contradiction`): checked before a report prints them."""
    return [d for d in findings if contradiction(d.message, records) is None]
