"""What a parity comparison found: per-leaf errors, per-step records, and the diagnosis of a failure.

:func:`diagnose` reads the records of :func:`~shardcheck.check_parity` and names the usual faults of a sharded
step: a sum where a mean was meant (update ratio S), a mean taken twice (1/S), replicas that disagree, an
optimizer stepped once per shard, an update that is not one reduced step, a loss that matches alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

KINDS = ("loss", "grad", "param", "opt_state", "counter")
# Two update ratios "agree" when within 2% of each other.
RATIO_RTOL = 0.02
# Above this rtol, a factor-2 error (a mean taken twice at S=2 is off by 50%) may hide in the tolerance.
LOOSE_RTOL = 0.1


@dataclasses.dataclass(frozen=True)
class LeafError:
    """The error of one leaf at one step.

    Attributes:
        step: the 0-based step index t.
        kind: ``"loss"``, ``"grad"``, ``"param"``, ``"opt_state"`` or ``"counter"`` (exact integer leaves: the
            NNX step counter, Adam's ``count``).
        path: the leaf's dotted path, e.g. ``"hidden.kernel"`` or ``"0.mu.bias"`` (``"loss"``, ``"step"``).
        max_abs_err: ``max |candidate - reference|`` over the leaf's elements (float64 arithmetic).
        max_rel_err: ``max_abs_err / max |reference|`` (normwise over the leaf: robust to elements that cancel
            to ~0); ``0`` when both are zero, ``inf`` when only the reference is.
        tolerance: the allowed ``max_abs_err``: ``atol + rtol * max |reference|`` (``0`` for counters).
        ok: ``max_abs_err <= tolerance`` (NaN fails).
        ratio: the median elementwise ratio candidate / reference of the leaf's change in this step (``param``
            and ``opt_state``: after minus before; ``grad`` and ``loss``: the values), over elements where the
            reference change is at least 1% of its largest; ``None`` when undefined (counters, no change).
        reference_change: ``param``/``opt_state``: ``max |reference after - reference before|``, the size of the
            reference's update of this leaf in this step; else ``None``.
    """

    step: int
    kind: str
    path: str
    max_abs_err: float
    max_rel_err: float
    tolerance: float
    ok: bool
    ratio: float | None = None
    reference_change: float | None = None

    @property
    def name(self) -> str:
        """``"<kind> <path>"``, e.g. ``"param hidden.kernel"``; ``"loss"`` for the loss."""
        return self.kind if self.kind == "loss" else f"{self.kind} {self.path}"

    @property
    def badness(self) -> float:
        """``max_abs_err / tolerance``: above 1 fails; used to rank leaves."""
        if math.isnan(self.max_abs_err):
            return math.inf
        if self.tolerance > 0:
            return self.max_abs_err / self.tolerance
        return 0.0 if self.max_abs_err == 0 else math.inf


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Everything compared at one step.

    Attributes:
        step: the 0-based step index t.
        rtol: the relative tolerance used at this step.
        atol: the absolute tolerance used at this step.
        loss: the reference's pre-update loss (float).
        candidate_loss: the candidate's returned loss, or ``None`` when it returned none.
        leaves: one :class:`LeafError` per compared leaf.
        step_count: the reference optimizer's step counter after the step.
        candidate_step_count: the candidate optimizer's update counter after the step (for gradient accumulation:
            the number of applied updates, ``MultiSteps.gradient_step``).
        replica_mismatches: paths of candidate leaves whose replicas hold different bytes on different devices.
        equal_weight_loss: weighted mode: the naive equal-weight mean of per-shard mean losses the candidate
            reported, else ``None``.
        equal_weight_loss_abs_err: ``|equal_weight_loss - reference loss|``, else ``None``.
        equal_weight_grad_abs_err: weighted mode: max over leaves of ``|naive equal-weight gradient - reference
            gradient|``, else ``None``.
        synchronized: the candidate ran this step from a copy of the reference's pre-step state (model and
            optimizer), not from its own trajectory (after a ``diverged_trajectory`` finding), and was compared
            at the step-0 tolerance.
    """

    step: int
    rtol: float
    atol: float
    loss: float
    candidate_loss: float | None
    leaves: tuple[LeafError, ...]
    step_count: int
    candidate_step_count: int
    replica_mismatches: tuple[str, ...] = ()
    equal_weight_loss: float | None = None
    equal_weight_loss_abs_err: float | None = None
    equal_weight_grad_abs_err: float | None = None
    synchronized: bool = False

    @property
    def ok(self) -> bool:
        """Every leaf within tolerance and every replica consistent."""
        return all(leaf.ok for leaf in self.leaves) and not self.replica_mismatches


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """One finding of the harness.

    Attributes:
        code: a stable identifier: ``parity``, ``summed``, ``averaged_twice``, ``scaled``, ``replicas_differ``,
            ``step_counter``, ``never_stepped``, ``loss_only``, ``loss_differs``, ``grads_differ``,
            ``update_differs``, ``drift``, ``diverged_trajectory``, ``reference_diverged``, ``weak_check`` or
            ``equal_weight``.
        message: the sentence shown to the user.
        leaf: the leaf the finding names, if any (``LeafError.name``).
    """

    code: str
    message: str
    leaf: str | None = None


def _close(a: float, b: float, rel: float = RATIO_RTOL) -> bool:
    return abs(a - b) <= rel * abs(b)


def _consensus(ratios: list[float]) -> float | None:
    """The common value of ``ratios`` when they agree to 2%, else ``None``."""
    ratios = [r for r in ratios if r is not None and math.isfinite(r)]
    if not ratios:
        return None
    mid = float(np.median(ratios))
    if mid == 0 or not all(_close(r, mid) for r in ratios):
        return None
    return mid


def _gradient_factor(record: StepRecord) -> tuple[float | None, str]:
    """The factor by which the candidate's gradient differs from the reference's at this step, and the evidence.

    Evidence in order of directness: exposed gradients; first moments / momentum traces (proportional to the
    gradient); second moments (``nu``: proportional to its square, so the square root is taken); parameter
    updates (proportional to the gradient for SGD and momentum, nearly scale-invariant for Adam).
    """
    grads = [e.ratio for e in record.leaves if e.kind == "grad"]
    f = _consensus(grads)
    if f is not None:
        return f, "gradients"
    first = [e.ratio for e in record.leaves if e.kind == "opt_state" and ".nu." not in f".{e.path}."]
    second = [e.ratio for e in record.leaves if e.kind == "opt_state" and ".nu." in f".{e.path}."]
    second = [math.sqrt(r) for r in second if r is not None and r > 0]
    moments = [r for r in first if r is not None] + second
    if moments:
        f = _consensus(moments)
        if f is not None:
            return f, "optimizer moments" if second else "momentum trace"
        return None, ""
    f = _consensus([e.ratio for e in record.leaves if e.kind == "param"])
    return (f, "parameter updates") if f is not None else (None, "")


def _name_factor(f: float, num_shards: int | None) -> tuple[str, str] | None:
    """``(code, phrase)`` for a gradient factor that is a power of S (or of an integer when S is unknown)."""
    candidates = [num_shards] if num_shards and num_shards > 1 else list(range(2, 65))
    for s in candidates:
        if _close(f, s):
            return (
                "summed",
                f"the gradient reduction summed instead of averaged (x{s}: a sum over {s} shards)",
            )
        if _close(f, 1 / s):
            return (
                "averaged_twice",
                f"the gradient was averaged twice (or divided by S={s} twice): x1/{s}",
            )
        if _close(f, s * s):
            return (
                "summed",
                f"the gradient was sum-reduced twice (x{s * s} = {s}^2; docs/reduction_cases.md C3)",
            )
        if _close(f, 1 / (s * s)):
            return "averaged_twice", f"the gradient was divided by S={s} three times (x1/{s * s})"
    return None


def diagnose(
    records: Sequence[StepRecord],
    num_shards: int | None = None,
    *,
    diverged: StepRecord | None = None,
    reference_diverged_at: int | None = None,
) -> list[Diagnosis]:
    """Explain a comparison: the findings of :class:`ParityReport`, most important first.

    Rules: replicas that differ across devices (named leaf); an update counter that is not the step count
    (``never_stepped``; ``step_counter`` with the multiple, e.g. stepped S times per step); a gradient factor of
    S or 1/S, read from the gradients, moments or updates at the first failing step (``summed``,
    ``averaged_twice``; another constant factor is ``scaled``); a loss that matches while the update does not
    (``loss_only``: not parity, seed 001); only the loss differing (``loss_differs``); only the exposed gradients
    differing (``grads_differ``); otherwise ``update_differs`` (not one reduced step) at the first failing step,
    or ``drift`` when the first steps agree and errors grow past tolerance later. ``weak_check`` warns when a
    reference update is below tolerance (the comparison cannot see it); ``equal_weight`` reports the naive
    equal-weight mean's error in weighted mode.

    ``diverged``: the trajectory record of the first failing step t > 0 whose step, re-run from the reference's
    pre-step state, matched (``records`` from t on are then synchronized steps): ``diverged_trajectory``.
    ``reference_diverged_at``: the step at which the reference's loss or state became non-finite (the comparison
    stopped there): ``reference_diverged``, and no ``parity`` finding. Findings with the same code are merged.
    """
    out: list[Diagnosis] = []
    if reference_diverged_at is not None:
        out.append(
            Diagnosis(
                "reference_diverged",
                f"The reference run diverged (non-finite loss or parameters at step {reference_diverged_at}): "
                f"steps {reference_diverged_at} and later were not compared, and this is no verdict about the "
                "candidate. Lower the learning rate.",
            )
        )
    if not records:
        return out
    all_leaves = [e for r in records for e in r.leaves]
    failing = [r for r in records if not r.ok]

    for r in records:
        if r.replica_mismatches:
            leaf = r.replica_mismatches[0]
            out.append(
                Diagnosis(
                    "replicas_differ",
                    f"Replicas differ across devices: {leaf} holds different values on different devices after "
                    f"step {r.step} ({len(r.replica_mismatches)} leaf/leaves), though its sharding says replicated; "
                    "a gradient or update was not all-reduced (missing psum/pmean, or shard_map with "
                    "check_vma=False and out_specs=P()).",
                    leaf,
                )
            )
            break

    counter_fail = next(
        (e for e in all_leaves if e.kind == "counter" and e.path == "step" and not e.ok), None
    )
    if counter_fail is not None:
        rec = records[counter_fail.step]
        expected, got = rec.step_count, rec.candidate_step_count
        if got == 0:
            out.append(
                Diagnosis(
                    "never_stepped",
                    f"The optimizer was never stepped: its counter is 0 after {counter_fail.step + 1} step(s) "
                    "(an update that was skipped or swallowed, e.g. the old one-argument optimizer.update(grads); "
                    "docs/reduction_cases.md C8).",
                    counter_fail.name,
                )
            )
        elif expected and got % expected == 0:
            k = got // expected
            out.append(
                Diagnosis(
                    "step_counter",
                    f"The optimizer was stepped {k} times per step: its counter is {got} after {expected} step(s) "
                    f"(optimizer.update called once per shard{' (S=' + str(num_shards) + ')' if k == num_shards else ''}"
                    " instead of once after the reduction).",
                    counter_fail.name,
                )
            )
        else:
            out.append(
                Diagnosis(
                    "step_counter",
                    f"The optimizer step counter is {got} after {expected} step(s); it must equal the number of "
                    "steps.",
                    counter_fail.name,
                )
            )

    if failing:
        first = failing[0]
        bad = [e for e in first.leaves if not e.ok]
        bad_kinds = {e.kind for e in bad}
        update_kinds = bad_kinds - {"loss", "counter"}
        worst = max(bad, key=lambda e: e.badness) if bad else None
        worst_name = worst.name if worst else None
        factor_named = False
        if update_kinds:
            f, evidence = _gradient_factor(first)
            if f is not None and not _close(f, 1.0):
                named = _name_factor(f, num_shards)
                code, phrase = named or (
                    "scaled",
                    "a constant factor that is not a shard count (a wrong loss normalization or learning rate?)",
                )
                out.append(
                    Diagnosis(
                        code,
                        f"At step {first.step}, {evidence} are {f:.4g} x the reference's: {phrase}.",
                        worst_name,
                    )
                )
                factor_named = True
        loss_leaf = next((e for e in first.leaves if e.kind == "loss"), None)
        if bad_kinds == {"loss"}:
            out.append(
                Diagnosis(
                    "loss_differs",
                    f"Only the returned loss differs (step {first.step}: {first.candidate_loss:.7g} vs reference "
                    f"{first.loss:.7g}); the update matches. The candidate does not return the full-batch "
                    "pre-update loss (a post-update loss, one shard's loss, or an unweighted mean?).",
                    "loss",
                )
            )
        elif bad_kinds == {"grad"}:
            out.append(
                Diagnosis(
                    "grads_differ",
                    f"The exposed gradients differ ({worst_name}, step {first.step}) while the update matches: "
                    "the reported gradients are not the ones applied.",
                    worst_name,
                )
            )
        elif update_kinds and not factor_named and counter_fail is None:
            detail = (
                f"{worst_name}: max abs err {worst.max_abs_err:.3g} > tolerance {worst.tolerance:.3g}"
                + ("" if worst.ratio is None else f", update ratio {worst.ratio:.4g}")
            )
            if first.step > 0 and not first.synchronized:
                out.append(
                    Diagnosis(
                        "drift",
                        f"The first {first.step} step(s) agree; step {first.step} does not ({detail}): state not "
                        "carried between steps correctly (optimizer state reset or shared?) or errors accumulating "
                        "past rounding.",
                        worst_name,
                    )
                )
            elif loss_leaf is not None and loss_leaf.ok:
                out.append(
                    Diagnosis(
                        "loss_only",
                        f"Only the loss matches: the pre-update loss agrees at step 0 but the update does not "
                        f"({detail}). A matching loss does not verify the update, the optimizer state or the "
                        "communication (seed 001): this is not parity.",
                        worst_name,
                    )
                )
            else:
                out.append(
                    Diagnosis(
                        "update_differs",
                        f"The update differs from the reference at step {first.step}"
                        + (" (run from the reference's pre-step state)" if first.synchronized else "")
                        + f" ({detail}): not a single reduced step "
                        "(shards applied one after another, gradients taken at different parameters, or a wrong "
                        "loss).",
                        worst_name,
                    )
                )

    weak = [
        e
        for e in records[0].leaves
        if e.kind == "param" and e.ok and e.reference_change is not None and e.reference_change <= e.tolerance
    ]
    if records[0].rtol > LOOSE_RTOL:
        out.append(
            Diagnosis(
                "weak_check",
                f"The tolerance rtol={records[0].rtol:.3g} is too loose to tell a x2 or x1/2 error from rounding (a "
                "low-precision dtype or a huge batch); pass rtol=, or check the step in float32.",
            )
        )
    if weak:
        out.append(
            Diagnosis(
                "weak_check",
                f"The reference's first update of {weak[0].name} is not larger than the tolerance: a wrong update of "
                "that leaf could pass unseen. Raise the learning rate or lower rtol/atol.",
                weak[0].name,
            )
        )

    ew = [r for r in records if r.equal_weight_loss_abs_err is not None]
    if ew:
        worst_ew = max(ew, key=lambda r: r.equal_weight_loss_abs_err)
        grad = (
            ""
            if worst_ew.equal_weight_grad_abs_err is None
            else (f" and gradients off by up to {worst_ew.equal_weight_grad_abs_err:.4g}")
        )
        out.append(
            Diagnosis(
                "equal_weight",
                f"Weighted mode: the naive equal-weight mean of per-shard means would give loss "
                f"{worst_ew.equal_weight_loss:.6g} at step {worst_ew.step} instead of {worst_ew.loss:.6g} (off by "
                f"{worst_ew.equal_weight_loss_abs_err:.4g}){grad}; the weighted reduction (psum of weighted sums / "
                "psum of counts) is the one checked.",
            )
        )
    if diverged is not None:
        bad = [e for e in diverged.leaves if not e.ok]
        worst = max(bad, key=lambda e: e.badness) if bad else None
        t = diverged.step
        what = (
            ""
            if worst is None
            else (f" ({worst.name}: max abs err {worst.max_abs_err:.3g} > tolerance {worst.tolerance:.3g})")
        )
        synced = [r for r in records if r.synchronized]
        verdict = (
            f"every step from {t} on ({len(synced)} step(s)), run from the reference's pre-step state, matched "
            "within the step-0 tolerance"
            if all(r.ok for r in synced)
            else f"step {t} run from the reference's pre-step state matched, but a later step did not (above)"
        )
        out.insert(
            0 if not failing else len(out),
            Diagnosis(
                "diverged_trajectory",
                f"The trajectories diverged at step {t}{what}, but the candidate step reproduces the reference "
                f"step from identical state: {verdict}. A rounding-level difference (the reordered batch sum) "
                "flipped a non-smooth op such as ReLU, and the two runs then separate: a property of the model, "
                f"not a bug in the step. Parity holds per step, not for the trajectory after step {t}; compare "
                "fewer steps or use a smooth activation to check longer runs.",
                None if worst is None else worst.name,
            ),
        )
    elif not failing and reference_diverged_at is None:
        n = len({(e.kind, e.path) for e in all_leaves})
        out.insert(
            0, Diagnosis("parity", f"Parity holds: {n} leaves over {len(records)} step(s) within tolerance.")
        )
    return _merge(out)


def _merge(findings: list[Diagnosis]) -> list[Diagnosis]:
    """One finding per code, in first-seen order; the messages of repeated codes are joined."""
    merged: dict[str, Diagnosis] = {}
    for d in findings:
        if d.code in merged:
            prev = merged[d.code]
            merged[d.code] = Diagnosis(d.code, f"{prev.message} {d.message}", prev.leaf or d.leaf)
        else:
            merged[d.code] = d
    return list(merged.values())
