"""Where a recorded run went non-finite, and a replay against such a recording.

A recording whose loss, gradients, parameters or optimizer state hold a NaN or an infinity from step ``t`` on is
no reference from there: a live check whose reference goes non-finite stops comparing and gives no verdict
(``reference_diverged``), and a replay against the recording does the same (:func:`diverged_report`):
the steps before ``t`` are compared, the later ones are not, and the report says whether the replay went
non-finite there too (bitwise identical to the recording, or not). ``shardcheck record`` refuses to write such a
recording (:func:`refusal`). A step whose loss or gradients alone are not finite, its parameters exactly as they
were and its optimizer state finite, is one the recorded run's optimizer skipped (``optax.apply_if_finite``, a loss-scale check): it is
recorded, and a replay compares it by finiteness
(:func:`~shardcheck.parity.comparison.digest.skipped_steps`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardcheck.parity.comparison.digest import KEPT_KINDS, QUIET, skipped_steps
from shardcheck.parity.diagnosis.evidence import Diagnosis
from shardcheck.parity.harness.recorded import Digests, Recording

CHECKED = ("loss", "grad", "param", "opt_state")
"""The leaf kinds whose non-finite ``max|x|`` makes a recorded step non-finite (the live check's reference test
reads the loss, the parameters and the optimizer state; a NaN gradient is read too, since a replay would compare
it as if the recording's were finite). A floating model state may hold an infinity by design; a counter is an
integer."""


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first step of a recorded run whose digests hold a NaN or an infinity.

    Attributes:
        step: the step (0-based), after which the leaves below are non-finite.
        names: the recording's names of those leaves (``"loss"``, ``"grad <path>"``, ...), in recorded order.
    """

    step: int
    names: tuple[str, ...]

    def leaves_text(self) -> str:
        """``"loss, 10 grad, 10 param and 20 opt_state leaves (41 leaves in all)"``: the non-finite leaves by
        kind, in :data:`CHECKED` order."""
        kinds = [n.split(" ", 1)[0] for n in self.names]
        parts = []
        for kind in CHECKED:
            n = kinds.count(kind)
            if n:
                parts.append(
                    kind if kind == "loss" else f"{n} {kind} leaf" if n == 1 else f"{n} {kind} leaves"
                )
        text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        return f"{text} ({len(self.names)} leaves in all)" if len(parts) > 1 else text


def first_non_finite(recording: Recording, steps: int | None = None) -> NonFinite | None:
    """The first of the first ``steps`` recorded steps (default: all) where a leaf of :data:`CHECKED` kind that
    the step digested has a NaN or infinite ``max|x|`` (exact: non-finite exactly when an element is), or
    ``None`` where every one is finite. A step the recorded run's optimizer skipped (its loss or gradients not
    finite, every parameter and optimizer-state leaf finite: ``optax.apply_if_finite``;
    :func:`~shardcheck.parity.comparison.digest.skipped_steps`) is no divergence: it is recorded, and a replay
    compares its loss and gradients by finiteness. Where the first step that is no skip holds a non-finite loss
    or gradient beside finite parameters and optimizer state, the "skipped" steps just before it are the same
    non-finite loss or gradient whose parameters stood still for another reason, and the run went non-finite at
    the first of them (trial 60: a step returning a NaN loss beside a correct update, under a warm-up whose
    learning rate is 0 at step 0, read as a skip there; --steps 1 then recorded that NaN)."""
    kinds = np.array([n.split(" ", 1)[0] for n in recording.names])
    d = recording.steps
    bad = d.present & np.isin(kinds, CHECKED)[None, :] & ~np.isfinite(d.max)
    kept = np.isin(kinds, KEPT_KINDS)
    n = recording.num_steps if steps is None else min(steps, recording.num_steps)
    skipped = set(skipped_steps(recording))  # over every step: one after the first n may tell a skip apart
    for t in range(recording.num_steps):
        if bad[t].any() and t not in skipped:
            if not (bad[t] & kept).any():
                while t - 1 in skipped:
                    t -= 1
            if t >= n:
                return None
            return NonFinite(t, tuple(name for name, b in zip(recording.names, bad[t], strict=True) if b))
    return None


def truncated(recording: Recording, steps: int) -> Recording:
    """``recording`` with its first ``steps`` steps only (``meta["steps"]`` too)."""
    cut = Digests(*(getattr(recording.steps, f.name)[:steps] for f in dataclasses.fields(Digests)))
    return dataclasses.replace(recording, steps=cut, meta={**recording.meta, "steps": steps})


def identical_from(recording: Recording, replayed: Recording, t: int) -> bool:
    """Whether every leaf both runs hold has the same sha256 (and is present alike) at every step from ``t`` on:
    the replay is bitwise identical to the recording there."""
    n = min(recording.num_steps, replayed.num_steps)
    index = {name: i for i, name in enumerate(replayed.names)}
    for j, name in enumerate(recording.names):
        i = index.get(name)
        if i is None:
            continue
        a, b = recording.steps, replayed.steps
        if not np.array_equal(a.present[t:n, j], b.present[t:n, i]):
            return False
        if not np.array_equal(a.sha256[t:n, j], b.sha256[t:n, i]):
            return False
    return True


def diverged_finding(
    recorded: NonFinite, replayed: NonFinite | None, identical: bool, matched: bool = True
) -> Diagnosis:
    """``reference_diverged`` of a replay against a recording that went non-finite at ``recorded.step``: the
    recording's non-finite leaves, what the replay did there (``replayed``: its own first non-finite step, or
    ``None``; ``identical``: bitwise identical to the recording from that step on) and that the later steps
    were not compared (``matched``: whether the steps before it match): no verdict about the candidate."""
    t = recorded.step
    if identical:
        now = "and so did the replay, bitwise identical to it from there: it reproduces the recorded run, NaN included"
    elif replayed is not None and replayed.step == t:
        now = f"and so did the replay ({replayed.leaves_text()})"
    elif replayed is not None and replayed.step < t:
        now = f"the replay went non-finite before it, at step {replayed.step}"
    else:
        now = "while the replay stays finite there"
    verb = "match" if matched else "differ"
    before = (
        f"steps 0 to {t - 1} were compared: they {verb}"
        if t > 1
        else f"step 0 was compared: it {verb}{'es' if matched else 's'}"
        if t == 1
        else "no step is finite"
    )
    return Diagnosis(
        "reference_diverged",
        f"The recording went non-finite (NaN or infinity) at step {t}, in {recorded.leaves_text()}, first "
        f"{recorded.names[0]}, {now}. A recording that is not finite is no reference: steps {t} and later were "
        f"not compared ({before}), and this is no verdict about the candidate. Find the cause in the recorded run "
        "(jax.config.update('jax_debug_nans', True) stops at the operation that makes it), record a run that "
        f"stays finite" + (f", or replay the steps before it (--steps {t}, steps={t})." if t > 0 else "."),
        recorded.names[0],
    )


def diverged_report(report, recorded: NonFinite, recording: Recording, replayed: Recording):
    """``report`` (a :class:`~shardcheck.ParityReport` of the steps before ``recorded.step``) as a live check's
    whose reference diverged there: ``reference_diverged_at`` set (verdict ``NO VERDICT``, ``ok`` False), its
    findings with :func:`diverged_finding` first (no ``parity``), and its replay's ``bitwise`` true only where
    the compared steps and every later one are bitwise identical."""
    t = recorded.step
    identical = identical_from(recording, replayed, t)
    matched = all(r.ok for r in report.steps)
    found = diverged_finding(recorded, first_non_finite(replayed), identical, matched)
    diagnoses = (found, *(d for d in report.diagnoses if d.code != "parity"))
    replay = report.replay  # its own ok stays the compared steps' digests' agreement
    cause = " ".join(d.message for d in diagnoses if d.code not in QUIET)
    replay = dataclasses.replace(
        replay, diagnoses=diagnoses, cause=cause, bitwise=replay.bitwise and identical
    )
    return dataclasses.replace(report, ok=False, diagnoses=diagnoses, reference_diverged_at=t, replay=replay)


def refusal(fn: str, recorded: NonFinite, out: str, keep: str = "--steps {t}") -> str:
    """The one-line reason ``shardcheck record`` (or ``Recording.save``) writes no recording of a run that went
    non-finite: the step, its non-finite leaves, why a recording of it would be no reference and what to do.
    ``keep``: how the caller records the ``t`` finite steps before it (``"{t}"`` filled in)."""
    t = recorded.step
    fix = (
        f", or record the {t} finite step(s) before it with {keep.format(t=t)}"
        if t > 0
        else "; no finite step comes before it to record"
    )
    return (
        f"{fn}: the recorded run went non-finite (NaN or infinity) at step {t}, in {recorded.leaves_text()}, first "
        f"{recorded.names[0]}; nothing was written to {out}: a recording is a reference, and a replay against "
        f"it compares nothing from step {t} on (as verify gives no verdict when its reference diverges). Find the "
        "cause (jax.config.update('jax_debug_nans', True) stops at the operation that makes it: an index out of "
        f"an embedding's range, a log or a division of 0, a learning rate too high){fix}."
    )


__all__ = ["NonFinite", "diverged_report", "first_non_finite", "refusal", "truncated"]
