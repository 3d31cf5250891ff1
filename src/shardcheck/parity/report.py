"""What :func:`~shardcheck.check_parity` returns, and the errors it raises."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from shardcheck.parity.diagnosis.evidence import KINDS, Diagnosis, LeafError, StepRecord
from shardcheck.parity.diagnosis.form import NO_SIMPLE_FORM
from shardcheck.parity.diagnosis.localization import Localization
from shardcheck.parity.diagnosis.topology import downstream_note, replicas_root


@dataclasses.dataclass(frozen=True)
class ReplicaFailure:
    """The first step whose replicated leaves hold different values on different devices
    (``StepRecord.replica_mismatches``): a failure no leaf's error shows, each device's copy may be within tolerance.

    Attributes:
        step: the 0-based step of the first record with a mismatch.
        leaf: the first mismatched leaf of that step, by ``LeafError.name`` (``"opt_state 1.0.mu.bias"``).
        leaves: how many leaves of that step mismatch.
        axes: the mesh axes along which their copies differ (``StepRecord.replica_axes``); ``()`` where unknown.
        downstream: ``""``, or where the gradients show which leaves were left unreduced, how many of the leaves
            belong to the parameters whose gradients differ and how many have gradients within tolerance
            (``topology.downstream_note``: ``"6 of them are the values and optimizer state of the 2 parameters
            whose gradients differ; the other 73 have gradients within tolerance: their copies differ downstream
            of those or by an unreduced gradient too small to show at this precision"``; ``leaf`` is then one
            whose gradient differs).
    """

    step: int
    leaf: str
    leaves: int
    axes: tuple[str, ...] = ()
    downstream: str = ""

    def text(self) -> str:
        """``"40 leaves along 'model'"`` (``"1 leaf"`` with no axes known)."""
        count = f"{self.leaves} leaf" if self.leaves == 1 else f"{self.leaves} leaves"
        return count + (f" along {', '.join(repr(a) for a in self.axes)}" if self.axes else "")

    def to_dict(self) -> dict:
        """``step``, ``leaf``, ``leaves``, ``axes`` (a list) and ``downstream``."""
        return {
            "step": self.step,
            "leaf": self.leaf,
            "leaves": self.leaves,
            "axes": list(self.axes),
            "downstream": self.downstream,
        }


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """The result of :func:`check_parity`.

    Which leaf it names: :attr:`worst_leaf` (:attr:`worst`) is the worst leaf over every step, by error over
    tolerance, which in a failing run may be a later step's consequence; :attr:`first_failing_leaf`
    (:attr:`first_worst`) is the worst failing leaf of the first failing step, where the localization points: the
    leaf the command line's summary row and ``verify --json``'s ``first_failing_leaf`` name, and the first line of
    ``str(report)`` for a failure.

    Attributes:
        strategy: the candidate's name.
        builtin: whether the candidate is one of shardcheck's built-in strategies (True) or the user's own step
            (False); ``None`` for a report not made by a live check (a replay).
        ok: parity holds: every leaf of every step within tolerance, replicas consistent.
        steps: one :class:`StepRecord` per step.
        diagnoses: the findings, most important first (``parity`` alone when ``ok`` and nothing to note).
        num_shards: S, when known (used to recognise ratios S and 1/S).
        tolerance_rule: how the tolerances were chosen (derived, or the user's ``rtol``/``atol``).
        diverged_at: the step t > 0 at which the trajectories first left tolerance while that step, re-run from the
            reference's pre-step state, matched (``diverged_trajectory``); ``steps`` from t on are then
            synchronized steps. ``None`` otherwise.
        diverged: the trajectory :class:`StepRecord` that failed at ``diverged_at`` (kept for the report).
        reference_diverged_at: the step at which the reference's loss or state became non-finite; the comparison
            stopped there (``reference_diverged``; ``steps`` holds the steps before it). ``None`` otherwise.
        cannot_verify: why no compared leaf could tell the step from one whose gradient is off by S or 1/S
            (verdict ``CANNOT VERIFY``, not ok), or ``None`` (also when the caller accepted a weak check).
        weak_accepted: the same cause when the caller accepted the weak check (``accept_weak=True``, or a user-set
            ``rtol``/``atol``): the report passes, as ``PASS (weak check accepted)``; else ``None``.
        scale_evidence: which leaves carried the evidence against a gradient off by S and by 1/S (the first step
            that showed each and its leaves: ``StepRecord.scale_evidence``), or ``None`` when none did.
        reference: what the candidate was compared with: ``"reference"`` (the task's single-device step), a
            registered strategy on the same mesh (``"gspmd on data=2,model=4"``), or ``"user reference"`` (a step
            passed as ``reference=``).
        peak_bytes_per_device: in a check against a strategy on the candidate's mesh, the most bytes any device
            held in the check's arrays (every live ``jax.Array``'s addressable shards, sampled after each
            reference step, candidate step and comparison, less what the device held when the check began:
            :mod:`shardcheck.parity.harness.footprint`); ``None`` otherwise.
        state_bytes_per_device: in that mode, the larger of the two sides' own states (parameters and optimizer
            state) on the device holding most of it: the yardstick of ``peak_bytes_per_device``; else ``None``.
        allocator_peak_bytes: in that mode, the largest ``peak_bytes_in_use`` of the devices'
            ``memory_stats()`` (GPU, TPU: the process's peak since it started, the compiled calls' temporaries
            included); ``None`` on CPU devices and in the other modes.
        matmul_precision: the precision of the steps' float32 matmuls the tolerances assumed (``"float32"``,
            ``"tf32"``, ``"bfloat16"``; ``shardcheck.parity.tolerance.matmul``).
        matmul_precision_source: how it was chosen: ``"set by the caller"``, or ``"the backend's (gpu) for this
            step"``.
        compute_dtype: the compute dtype the tolerances assumed (``Precision.compute_dtype``: the model's least
            precise layer ``dtype``, or the caller's), e.g. ``"bfloat16"``; ``""`` where not known (a replay).
        precision_recheck: on an accelerator, the outcome of re-checking a FAIL within a few tolerances with both
            sides at ``"highest"`` (``shardcheck.parity.tolerance.recheck``); ``None`` when there was none.
        localization: a failing run's localization by stage, group and form
            (:func:`~shardcheck.parity.diagnosis.localization.localize`), shown first in the diagnosis; ``None``
            when every step passed.
        devices: where each side ran, ``{"reference": "1 x gpu (NVIDIA H200)", "candidate": "8 x cpu"}``
            (:func:`shardcheck.devices.describe`); empty for a report not made by a check.
        replay: against a recording (``check_parity(..., reference=Recording)``, ``verify --against``), the
            digest comparison the records came from
            (:class:`~shardcheck.parity.comparison.digest.RunComparison`: each leaf's deciding digest, the
            hashes' agreement, what a recording cannot tell); ``None`` for a live check.
    """

    strategy: str
    ok: bool
    steps: tuple[StepRecord, ...]
    diagnoses: tuple[Diagnosis, ...]
    num_shards: int | None = None
    tolerance_rule: str = ""
    diverged_at: int | None = None
    diverged: StepRecord | None = None
    reference_diverged_at: int | None = None
    cannot_verify: str | None = None
    scale_evidence: str | None = None
    weak_accepted: str | None = None
    reference: str = "reference"
    peak_bytes_per_device: int | None = None
    state_bytes_per_device: int | None = None
    allocator_peak_bytes: int | None = None
    matmul_precision: str = "float32"
    matmul_precision_source: str = ""
    compute_dtype: str = ""
    precision_recheck: str | None = None
    devices: dict[str, str] = dataclasses.field(default_factory=dict)
    localization: Localization | None = None
    builtin: bool | None = None
    replay: Any = None

    @property
    def step_ok(self) -> bool:
        """Every step is correct: ``ok``, or the trajectories diverged (``diverged_trajectory``) and every step
        from there on matched the reference from the reference's own pre-step state."""
        return (
            self.reference_diverged_at is None
            and self.cannot_verify is None
            and bool(self.steps)
            and all(r.ok for r in self.steps)
        )

    @property
    def verdict(self) -> str:
        """``"PASS"`` (:attr:`ok`), ``"PASS (per step)"`` (trajectories diverged, every step correct from
        synchronized state), ``"NO VERDICT"`` (the reference diverged), ``"CANNOT VERIFY"`` (the tolerance
        cannot tell the update from a factor-S error) or ``"FAIL"``. A pass whose check could not have told a
        factor-S error apart, accepted by the caller (:attr:`weak_accepted`), says so: ``"PASS (weak check
        accepted)"``, ``"PASS (per step; weak check accepted)"``."""
        if self.reference_diverged_at is not None:
            return "NO VERDICT"
        if self.cannot_verify is not None:
            return "CANNOT VERIFY"
        if not self.step_ok:
            return "FAIL"
        weak = "" if self.weak_accepted is None else "weak check accepted"
        if self.ok:
            return f"PASS ({weak})" if weak else "PASS"
        return f"PASS (per step; {weak})" if weak else "PASS (per step)"

    @property
    def worst(self) -> LeafError | None:
        """The leaf error with the largest ``max_abs_err / tolerance`` over all steps (the first, on ties), a step
        re-run from the reference's state after an earlier failure (:attr:`rerun_after_failure`) only where no
        other step compared a leaf; where every compared leaf passes and the update check fails
        (:attr:`update_failure`), its worst leaf."""
        if self.update_failure is not None and all(leaf.ok for r in self.steps for leaf in r.leaves):
            return self.update_failure
        rerun = self.rerun_after_failure
        leaves = [leaf for record in self.steps for leaf in record.leaves]
        return max(leaves, key=lambda leaf: (leaf.step not in rerun, leaf.badness), default=None)

    @property
    def first_worst(self) -> LeafError | None:
        """The first failing leaf: at the first failing step, the worst failing leaf of the first stage that differs
        (the stage :attr:`localization` names; without one, the first of the forward pass (the loss), the
        gradients, the optimizer state and parameters, the counters that holds a failing leaf); the update
        check's leaf, :attr:`update_failure`, where that step failed it alone; :attr:`worst` where nothing fails:
        the summary's leaf (trial 27: the worst over all steps, a leaf the fault reached at step 2, sat beside a
        localization that said that leaf matched at step 0; trial 46: the worst of step 0 by error over
        tolerance, a gradient, sat beside a localization at the forward pass, whose loss failed at step 0 too)."""
        update = self.update_failure
        first = next((r for r in self.steps if any(not e.ok for e in r.leaves)), None)
        # an update check that failed at an earlier step than any leaf is the first failure (trial 33: a decayed
        # norm scale's update failed at step 0, its parameter at step 1, and the summary named step 1's)
        if update is not None and (first is None or update.step < first.step):
            return update
        if first is None:
            return self.worst
        return self._localized(first) or _first_by_stage(first)

    def _localized(self, first: StepRecord) -> LeafError | None:
        """The worst failing leaf of the stage the localization names at ``first`` (the first failing step), where
        it is one of that step's leaves; else ``None``."""
        loc = self.localization
        if loc is None or loc.step != first.step or loc.stage is None:
            return None
        worst = next(s.worst for s in loc.stages if s.stage == loc.stage)
        if worst is None:
            return None
        key = (worst.kind, worst.path, worst.step)
        return next((e for e in first.leaves if (e.kind, e.path, e.step) == key and not e.ok), None)

    @property
    def update_failure(self) -> LeafError | None:
        """The worst failing leaf of the first step whose only failure is the update check (the task's optimizer
        rerun on the candidate's own inputs, ``StepRecord.update_only``), as kind ``"update"``; else ``None``."""
        record = next((r for r in self.steps if r.update_only), None)
        if record is None:
            return None
        return dataclasses.replace(max(record.update_only, key=lambda e: e.badness), kind="update")

    @property
    def worst_leaf(self) -> str | None:
        """:attr:`worst`'s name, e.g. ``"param hidden.kernel"``: the leaf with the largest error over tolerance
        over every step, which in a failing run may be a later step's consequence of the first failure (trial 41:
        ``"grad pos"`` at step 2, downstream of a parameter that failed at step 1). The leaf the summary table,
        the localization and ``verify --json``'s ``first_failing_leaf`` name for a failure is
        :attr:`first_failing_leaf`."""
        return None if self.worst is None else self.worst.name

    @property
    def first_failing_leaf(self) -> str | None:
        """Where the report fails (not :attr:`ok`), :attr:`first_worst`'s name: the worst failing leaf of the
        first failing step, e.g. ``"param blocks.1.v.kernel"`` (the summary table's leaf and ``verify --json``'s
        ``first_failing_leaf``; its step is ``first_worst.step``); ``None`` where it passes, and where no leaf
        failed (CANNOT VERIFY, NO VERDICT: trial 60's loss-only step read "first failing leaf" of a leaf marked
        ok)."""
        first = None if self.ok else self.first_worst
        return None if first is None or first.ok else first.name  # CANNOT VERIFY: nothing failed (trial 60)

    @property
    def max_abs_err(self) -> float:
        """:attr:`worst`'s ``max_abs_err`` (errors of different leaves have different units: not a max of all)."""
        return 0.0 if self.worst is None else self.worst.max_abs_err

    @property
    def max_rel_err(self) -> float:
        """:attr:`worst`'s ``max_rel_err``."""
        return 0.0 if self.worst is None else self.worst.max_rel_err

    @property
    def codes(self) -> tuple[str, ...]:
        """The :attr:`Diagnosis.code` of every finding, in order."""
        return tuple(d.code for d in self.diagnoses)

    @property
    def findings(self) -> tuple[tuple[str, str], ...]:
        """``(tag, text)`` of what the report explains, in the order every rendering says it: the leading finding
        (the first of :attr:`diagnoses`, most important first, unless it is a note such as ``rounding_level``),
        then a failing run's localization (tag ``"localization"``), then the other findings. The cause comes
        first (trial 53: ``summed``'s "gradients are 4 x the reference's" was line 17 of a 22-line paragraph that
        opened with the localization). A finding that repeats the localization's form sentence says it once, in
        the localization (trial 47: a decay's form printed twice in a row); a localization whose form is "no simple
        form" below a leading finding that names the cause says that the finding names it (trial 53: "no simple
        form" below ``clip_per_shard``'s "a clip applied per shard")."""
        form = None if self.localization is None else self.localization.form
        said = f"Form: {form.sentence}." if form is not None else None
        messages = [
            (d.code, d.message.replace(said, "Form: the localization's.") if said else d.message)
            for d in self.diagnoses
        ]
        if self.localization is None:
            return tuple(messages)
        lead = 1 if messages and messages[0][0] not in NOTE_CODES else 0
        where = self.localization.text()
        if lead and form is not None and form.kind == "none" and messages[0][0] in FORM_NAMING:
            where = where.replace(  # trial 53: "no simple form" below a clip_per_shard that names the form
                f"Form: {NO_SIMPLE_FORM}:",
                f"Form: {NO_SIMPLE_FORM} that the fit reads ([{messages[0][0]}] names it):",
                1,
            )
        return (*messages[:lead], ("localization", where), *messages[lead:])

    @property
    def diagnosis(self) -> str:
        """:attr:`findings` joined into one paragraph, the localization's text after ``"Localization: "``
        (``verify --json``'s ``diagnosis``)."""
        return " ".join(
            f"Localization: {text}" if tag == "localization" else text for tag, text in self.findings
        )

    @property
    def diagnosis_lines(self) -> tuple[str, ...]:
        """:attr:`findings` one per line, each after its tag: ``"[summed] At step 0, gradients are 4 x ..."``,
        ``"[localization] First difference at step 0: ..."``: what the command line prints below its table and
        ``str(report)`` at its end."""
        return tuple(f"[{tag}] {text}" for tag, text in self.findings)

    @property
    def replica_failure(self) -> ReplicaFailure | None:
        """The first step whose replicas differ across devices (:class:`ReplicaFailure`), or ``None`` where every
        step's replicas agree (a replay compares every device's copy after each step where its run kept them,
        ``meta["replicas"]``; an older one, which did not, has none)."""
        record = next((r for r in self.steps if r.replica_mismatches), None)
        if record is None:
            return None
        mismatches = replicas_root(record)
        return ReplicaFailure(
            record.step, mismatches[0], len(mismatches), tuple(record.replica_axes), downstream_note(record)
        )

    @property
    def only_replicas_fail(self) -> bool:
        """The replicas' disagreement is the run's only failure: every compared leaf within its tolerance."""
        return self.replica_failure is not None and all(leaf.ok for r in self.steps for leaf in r.leaves)

    @property
    def rerun_after_failure(self) -> tuple[int, ...]:
        """The steps the check re-ran from the reference's pre-step state (``StepRecord.synchronized``) after an
        earlier step had already failed, while the steps before and after it are the candidate's own trajectory.
        The step loop's re-check of its first failure after step 0 stands for step t only where no step failed
        before it (else it is kept beside the trajectory's record, ``StepRecord.rerun``), so a live check's report
        holds none; a report built of records that hold one (by hand, or by an older step loop) has them set
        apart. Their leaves are not that trajectory's (trial 46: an Adam step whose loss is x 4 leaves its
        parameters as the reference's, but step 1, re-run with the reference's moments and a x 4 gradient, moved a
        bias 0.00153 off), so the tables rank them after every other step's (:meth:`worst_by_kind`,
        :attr:`worst`). ``()`` where no step failed before a re-run one, or the trajectories diverged
        (:attr:`diverged_at`: every step from there on is re-run)."""
        if self.diverged_at is not None:
            return ()
        out, failed = [], False
        for record in self.steps:
            if record.synchronized and failed:
                out.append(record.step)
            failed = failed or any(not e.ok for e in record.leaves)
        return tuple(out)

    def worst_by_kind(self) -> dict[str, LeafError]:
        """For each compared kind (``loss``, ``grad``, ...), its worst leaf error over all steps; ``state`` (the
        model's non-parameter state, after ``opt_state``) where one of its leaves fails, so that a failing state
        leaf (a frozen weight trained) has its own row beside the rows it moved downstream; ``update`` (after
        ``opt_state``) where the update check fails (:attr:`update_failure`). A step re-run from the reference's
        state after an earlier step failed (:attr:`rerun_after_failure`) is not the candidate's trajectory: its
        leaves are a kind's row only where no other step compared that kind."""
        out: dict[str, LeafError] = {}
        rerun = self.rerun_after_failure

        def rank(leaf: LeafError) -> tuple[bool, float]:
            return leaf.step not in rerun, leaf.badness

        for record in self.steps:
            for leaf in record.leaves:
                if leaf.kind not in out or rank(leaf) > rank(out[leaf.kind]):
                    out[leaf.kind] = leaf
        kinds = [*KINDS]
        if "state" in out and not out["state"].ok:
            kinds.insert(kinds.index("opt_state") + 1, "state")
        if self.update_failure is not None:  # below every tolerance against the reference: a row of its own
            out["update"] = self.update_failure
            kinds.insert(kinds.index("opt_state") + 1, "update")
        return {k: out[k] for k in kinds if k in out}

    def to_dict(self) -> dict:
        """A JSON-ready summary: ``ok``, ``worst_leaf`` (the worst leaf over every step, by error over tolerance)
        and ``first_failing_leaf`` / ``first_failing_step`` / ``first_failing_max_abs_err`` /
        ``first_failing_tolerance`` (:attr:`first_worst`: the worst of the first failing step, the leaf and numbers
        the summary table and the localization name; ``None`` on a PASS), ``max_abs_err``, ``max_rel_err``, ``tolerance``,
        ``diagnosis``, ``codes``, ``steps``, ``num_shards``, ``worst_by_kind``, ``per_step``, ``unresolved``,
        ``cannot_verify``, ``weak_accepted``, ``scale_evidence``, ``reference``, ``peak_bytes_per_device``,
        ``state_bytes_per_device``, ``allocator_peak_bytes``, ``matmul_precision``, ``matmul_precision_source``,
        ``precision_recheck``, ``devices``, ``localization``, ``replica_failure`` (:attr:`replica_failure`'s
        ``to_dict``, or ``None``: the first step whose replicas differ, beside ``replica_mismatches``, which lists
        every mismatched leaf of every step), ``replicas_compared`` (:meth:`_replicas_compared`: how many
        replicated leaves had their copies compared across how many devices, or ``None``). A replay against a recording (:attr:`replay`) has
        the same fields, read from its records, and its digest comparison's own beside them
        (:meth:`~shardcheck.parity.comparison.digest.RunComparison.report_dict`: ``run``, ``recorded_run``,
        ``first_failure``, ``cause``, ``evidence``, ``notes``, ``bitwise``, ``hashes_matched``,
        ``hashes_compared``, ``placement_changes``, ``pin_placement``, ``failures``, and each ``worst_by_kind``
        entry's digest evidence): one shape for ``verify --json`` live and ``verify --against --json``.
        """
        worst = self.worst
        first = (
            None if self.ok else self.first_worst
        )  # the summary table's row: the first failing step's worst
        record_last = self.steps[-1] if self.steps else None
        out = {
            "ok": self.ok,
            "verdict": self.verdict,
            "reference": self.reference,
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "state_bytes_per_device": self.state_bytes_per_device,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "matmul_precision": self.matmul_precision,
            "matmul_precision_source": self.matmul_precision_source,
            "precision_recheck": self.precision_recheck,
            "devices": dict(self.devices),
            "localization": None if self.localization is None else self.localization.to_dict(),
            "step_ok": self.step_ok,
            "diverged_at": self.diverged_at,
            "reference_diverged_at": self.reference_diverged_at,
            "cannot_verify": self.cannot_verify,
            "weak_accepted": self.weak_accepted,
            "scale_evidence": self.scale_evidence,
            "worst_leaf": self.worst_leaf,
            "worst_step": None if worst is None else worst.step,
            # the summary table's leaf: the worst of the first failing step, where the localization points
            "first_failing_leaf": None if first is None else first.name,
            "first_failing_step": None if first is None else first.step,
            "first_failing_max_abs_err": None if first is None else first.max_abs_err,
            "first_failing_tolerance": None if first is None else first.tolerance,
            "max_abs_err": self.max_abs_err,
            "max_rel_err": self.max_rel_err,
            "tolerance": None if worst is None else worst.tolerance,
            "diagnosis": self.diagnosis,
            "codes": list(self.codes),
            "steps": len(self.steps),
            "num_shards": self.num_shards,
            "tolerance_rule": self.tolerance_rule,
            "compute_dtype": self.compute_dtype or None,
            "step_count": None if record_last is None else record_last.step_count,
            "candidate_step_count": None if record_last is None else record_last.candidate_step_count,
            "replica_mismatches": sorted({p for r in self.steps for p in r.replica_mismatches}),
            "replica_failure": None if self.replica_failure is None else self.replica_failure.to_dict(),
            "replicas_compared": self._replicas_compared(),
            "unresolved": sorted({p for r in self.steps for p in r.unresolved}),
            "worst_by_kind": {
                kind: {
                    "leaf": e.name,
                    "step": e.step,
                    "max_abs_err": e.max_abs_err,
                    "max_rel_err": e.max_rel_err,
                    "tolerance": e.tolerance,
                    "ok": e.ok,
                    "reference_within_tolerance": e.reference_within_tolerance,
                }
                for kind, e in self.worst_by_kind().items()
            },
            "per_step": self._per_step(),
        }
        return out if self.replay is None else self.replay.report_dict(out)

    def _replicas_compared(self) -> dict | None:
        """``to_dict``'s ``replicas_compared``: ``{"leaves", "devices", "steps"}``, the most replicated leaves
        whose copies one step compared across its devices (a live check: the candidate's parameters and optimizer
        state after each step; a replay: the recorded ``meta["replicas"]``), over how many devices, at how many
        steps; ``None`` where no step compared any (one device, every leaf split without copies, or a recording
        made before the count was kept)."""
        counted = [r.replicas_compared for r in self.steps if r.replicas_compared is not None]
        if not counted:
            return None
        return {
            "leaves": max(n for n, _ in counted),
            "devices": max(d for _, d in counted),
            "steps": len(counted),
        }

    def _per_step(self) -> list[dict]:
        """``to_dict``'s ``per_step``: each step's verdict, losses, tolerances, worst leaf and whether the
        reference's optimizer skipped it (``skipped``: its loss or gradients not finite, its parameters and state
        finite; ``StepRecord.skipped``)."""
        return [
            {
                "step": r.step,
                "ok": r.ok,
                "synchronized": r.synchronized,
                "loss": r.loss,
                "candidate_loss": r.candidate_loss,
                "rtol": r.rtol,
                "atol": r.atol,
                "worst_leaf": max(r.leaves, key=lambda e: e.badness).name if r.leaves else None,
                "max_abs_err": max(r.leaves, key=lambda e: e.badness).max_abs_err if r.leaves else 0.0,
                "skipped": r.skipped,  # the reference's optimizer skipped the step (StepRecord.skipped)
            }
            for r in self.steps
        ]

    def __str__(self) -> str:
        verdict = self.verdict
        against = "" if self.reference == "reference" else f" against {self.reference}"
        kind = "step" if self.builtin is False else "strategy"  # a user's step named 'step' is not a strategy
        lines = [f"parity {verdict} for {kind} {self.strategy!r}{against} over {len(self.steps)} step(s)"]
        worst = self.worst
        first = None if self.ok else self.first_worst
        # nothing failed (CANNOT VERIFY, NO VERDICT): no failing leaf (trial 60)
        first = None if first is not None and first.ok else first
        marked = []  # the leaves said with ROUNDING_MARK

        def rel(e) -> str:
            marked.append(e.reference_within_tolerance)
            return f"{e.max_rel_err:.3g}{ROUNDING_MARK if marked[-1] else ''}"

        if first is not None:  # a failure's headline: where it is localized (the summary table's leaf)
            lines.append(
                f"  first failing leaf: {first.name} at step {first.step}: max abs err {first.max_abs_err:.3g}, "
                f"rel {rel(first)}, tolerance {first.tolerance:.3g}"
            )
        if worst is not None and (first is None or worst != first):
            lines.append(
                f"  worst leaf{' over every step' if first is not None else ''}: {worst.name} at step "
                f"{worst.step}: max abs err {worst.max_abs_err:.3g}, rel {rel(worst)}, tolerance "
                f"{worst.tolerance:.3g}"
            )
        rerun = self.rerun_after_failure
        for kind, e in self.worst_by_kind().items():
            lines.append(
                f"  {kind:<9} {e.path:<24} abs {e.max_abs_err:<10.3g} rel {rel(e):<10} "
                f"tol {e.tolerance:<10.3g} {'ok' if e.ok else 'FAIL'}{RERUN_MARK if e.step in rerun else ''}"
            )
        if any(marked):
            lines.append(f"  {ROUNDING_NOTE}")
        if rerun:
            lines.append(f"  rows: {rerun_note(rerun)}")
        replicas = self.replica_failure
        if replicas is not None:
            lines.append(f"  {'replicas':<9} {replicas.leaf} at step {replicas.step}: {replicas.text()} FAIL")
        lines += [f"  {line}" for line in self.diagnosis_lines]
        if self.weak_accepted is not None:
            lines.append(f"  weak check accepted: {self.weak_accepted}")
        if self.scale_evidence and all(r.ok for r in self.steps):  # a failing run has found its error
            lines.append(f"  evidence: {self.scale_evidence}")
        if self.tolerance_rule:
            lines.append(f"  tolerance: {self.tolerance_rule}")
        if self.replay is not None:
            lines += [f"  {note}" for note in self.replay.notes]
        source = f" ({self.matmul_precision_source})" if self.matmul_precision_source else ""
        lines.append(f"  matmul precision assumed: {self.matmul_precision}{source}")
        if self.precision_recheck is not None:
            lines.append(f"  precision re-check: {self.precision_recheck}")
        if len({_platforms(where) for where in self.devices.values()}) > 1:  # sides on different platforms
            lines.append("  ran on: " + ", ".join(f"{side} {where}" for side, where in self.devices.items()))
        if self.peak_bytes_per_device is not None:
            lines.append(f"  memory: {self.footprint_text()}")
        return "\n".join(lines)

    def footprint_text(self) -> str | None:
        """The measured footprint in words (``None`` outside a check on the candidate's mesh), e.g. ``"peak 1.2
        MiB per device (live arrays), 3.1 x the larger side's own state of 394 KiB per device"``."""
        if self.peak_bytes_per_device is None:
            return None
        text = f"peak {_size(self.peak_bytes_per_device)} per device (live arrays)"
        if self.state_bytes_per_device:
            ratio = self.peak_bytes_per_device / self.state_bytes_per_device
            text += f", {ratio:.2g} x the larger side's own state of {_size(self.state_bytes_per_device)} per device"
        if self.allocator_peak_bytes is not None:
            text += f"; allocator peak {_size(self.allocator_peak_bytes)}"
        return text


# a table row read from a step re-run from the reference's state after an earlier failure
RERUN_MARK = " (re-run)"

ROUNDING_MARK = " (|ref| <= allowed)"
"""Beside the relative error of a leaf whose reference is within its tolerance
(``LeafError.reference_within_tolerance``): in ``str(report)`` and the command line's tables."""

FORM_NAMING = frozenset(
    {
        "clip_per_shard",
        "local_clip_norm",
        "clip_norm",
        "clip_coefficient",
        "normalization",
        "local_normalization",
        "micro_batch_means",
        "weight_count",
        "low_precision_reduction",
    }
)
"""The codes of findings that name the computation a difference with no simple form comes from (a clip per
shard, another normalization, a reduction at low precision): a failing run's localization whose form is "no
simple form" says that the leading one names it (:attr:`ParityReport.findings`)."""

NOTE_CODES = frozenset({"rounding_level"})
"""The codes of findings that note how leaves were compared, not why a run failed: never said before a failing
run's localization (:attr:`ParityReport.findings`)."""

ROUNDING_NOTE = (
    f"rel err{ROUNDING_MARK}: the reference leaf's largest element is itself within the allowed abs err (a leaf at "
    "rounding level, or one whose elements at rounding level widen its allowance), so its relative error says "
    "nothing; its abs err against the allowed abs err decides"
)
"""The line said once below what shows :data:`ROUNDING_MARK`."""


def rerun_note(steps: tuple[int, ...]) -> str:
    """What the per-kind rows hold beside steps re-run from the reference's pre-step state after an earlier
    failure (:attr:`ParityReport.rerun_after_failure`): ``"step 1 was re-run from the reference's pre-step state
    after an earlier step had failed (how the check re-checks a failure after step 0): not the candidate's own
    trajectory, so each row is the worst of the other steps (a re-run step's only where no other step compared
    that kind, marked (re-run))"``."""
    words = ", ".join(str(t) for t in steps)
    return (
        f"step{'s' if len(steps) > 1 else ''} {words} {'were' if len(steps) > 1 else 'was'} re-run from the "
        "reference's pre-step state after an earlier step had failed (how the check re-checks a failure after step "
        "0): not the candidate's own trajectory, so each row is the worst of the other steps (a re-run step's only "
        f"where no other step compared that kind, marked{RERUN_MARK})"
    )


# the first failing leaf's stage order where no localization names one (its StageResult's kinds)
_STAGE_OF_KIND = {"loss": 0, "grad": 1, "opt_state": 3, "param": 4, "state": 4, "counter": 5}


def _first_by_stage(record: StepRecord) -> LeafError | None:
    """The worst failing leaf of ``record``'s first stage that holds one (:data:`_STAGE_OF_KIND`)."""
    bad = [e for e in record.leaves if not e.ok]
    if not bad:
        return None
    stage = min(_STAGE_OF_KIND.get(e.kind, 4) for e in bad)
    return max((e for e in bad if _STAGE_OF_KIND.get(e.kind, 4) == stage), key=lambda e: e.badness)


def _size(n: int) -> str:
    """Bytes in binary units, three significant digits: ``"394 KiB"``."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.3g} {unit}"


class CandidateError(RuntimeError):
    """The candidate step raised; the original exception is ``__cause__``, ``step`` the 0-based step and ``hint``
    a likely cause the harness can see (``""`` when none), also in the message, before the exception's text.

    Also raised, with no ``__cause__``, when the step ran but returned gradients that cannot be compared: leaves
    missing from, or not among, the model's parameters (the message names them; ``hint`` is the fix)."""

    def __init__(self, message: str, step: int, hint: str = ""):
        super().__init__(message)
        self.step = step
        self.hint = hint


class ParityError(AssertionError):
    """Raised by :func:`~shardcheck.assert_step_parity`; ``report`` holds the :class:`ParityReport`."""

    def __init__(self, report: ParityReport):
        super().__init__(str(report))
        self.report = report


def _platforms(where: str) -> frozenset[str]:
    """The platforms named in :func:`shardcheck.devices.describe`'s words (``"8 x cpu"`` -> ``{"cpu"}``)."""
    return frozenset(re.findall(r"\d+ x (\w+)", where))
