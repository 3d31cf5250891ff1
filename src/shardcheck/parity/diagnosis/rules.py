"""The catalog of rules that explain a failure, on top of its localization.

:func:`diagnose` reads the records (:mod:`~shardcheck.parity.diagnosis.evidence`) of :func:`~shardcheck.check_parity` and names the usual faults of a sharded
step. It builds one immutable :class:`DiagnosisContext` from the records, runs the rules of :data:`RULES` in
order (each a short function ``(ctx) -> list[Diagnosis] | Diagnosis | None`` that reads only the context) and
merges the findings that share a code. Adding a rule is one function and one entry of :data:`RULES`. The rules,
in order, with their codes:

- :func:`parity` (``parity``): every step within tolerance, neither run diverged.
- :func:`reference_diverged` (``reference_diverged``): the reference went non-finite; no verdict.
- :func:`local_normalization` (``local_normalization``): the returned gradients' copies are one gradient times a
  constant per device (a local count after the all-reduce).
- :func:`wrong_axis_reduction` (``wrong_axis_reduction``): copies differ along some mesh axes only.
- :func:`non_finite` (``non_finite``): the candidate's values are NaN or infinite at the first failing step.
- :func:`replicas_differ` (``replicas_differ``): a replicated leaf differs across devices.
- :func:`model_state` (``model_state``): a counter of the model's own state is not the reference's.
- :func:`frozen_state` (``frozen_state``, ``state_step``, ``target_sync``, ``state_partial``, ``state_amount``): a
  frozen non-parameter weight the candidate moved, state it wrote at a step where the reference's step writes none
  (and writes it at others), a copy of the parameters it writes on a counter's schedule the reference's step never
  writes (a target network's sync), or floating state both steps write, part of it left as it was or changed by
  other amounts.
- :func:`step_counter` (``never_stepped``, ``step_counter``): the update counter (or the optimizer's own, ahead
  by a whole factor) is not the step count.
- :func:`weight_count` (``weight_count``): the gradient factor is the batch's loss weight over its count of rows
  (or mask entries), or its inverse: a count divided by where the weight was due.
- :func:`shard_factor` (``summed``, ``averaged_twice``, ``unreduced``, ``clip_norm``): the gradient factor is S,
  S^2, 1/S, 1/S^2, or 1/sqrt(R) for a replica count R (a clipping norm counted once per replica); 1/S beside
  replicas that differ is a gradient never all-reduced (``unreduced``).
- :func:`replicated_reduced` (``replicated_reduced``): only some leaves (the replicated ones) are x R.
- :func:`clip_coefficient` (``clip_coefficient``, ``clip_norm``, ...): the exposed gradients match, the
  optimizer's state shows the gradient it was given scaled by one factor (a clip by a norm not the global one).
- :func:`local_clip_norm` (``local_clip_norm``): the exposed gradients match, the optimizer's factors differ by
  leaf group, all >= 1 (each shard clipped by its own local norm).
- :func:`normalization` (``normalization``, with ``summed`` / ``averaged_twice`` where it is S or 1/S times
  that): the update is the mean of per-shard means (C4-C6).
- :func:`per_shard_loss` (``per_shard_loss``): the same step while the shards carry equal weights: a term of the
  loss that couples the rows was computed per shard.
- :func:`scaled` (``scaled``): the gradient factor is another constant.
- :func:`update_rerun` (``update_rerun``): every compared leaf within tolerance, but the task's optimizer rerun
  on the candidate's own gradients and state gives another update (a fault below the tolerance that accumulates).
- :func:`loss_differs` (``loss_differs``): only the returned loss differs.
- :func:`grads_differ` (``grads_differ``): only the exposed gradients differ.
- :func:`drift` (``drift``): an unexplained failure after steps that agreed.
- :func:`loss_only` (``loss_only``): an unexplained failure at step 0 while the loss matches (seed 001) and no
  gradient and no optimizer-state leaf does.
- :func:`localized` (``localized``): an unexplained failure at step 0 while the loss and some gradient or
  optimizer-state leaves match: the first stage that differs, and what its failing leaves share.
- :func:`update_differs` (``update_differs``, ``forward_differs``): any other unexplained failure of the update;
  ``forward_differs`` where the forward pass differs first and the optimizer's update from equal inputs matches.
- :func:`loose_tolerance` (``weak_check``): rtol too loose to tell a x2 error from rounding.
- :func:`weak_update` (``weak_check``): a reference update not above its tolerance at any step.
- :func:`diverged_trajectory` (``diverged_trajectory``): the runs separated, the step itself matches.
- :func:`rounding_level` (``rounding_level``): informational, leaves whose update cannot be resolved.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from shardcheck.parity.diagnosis.evidence import (
    RATIO_RTOL,
    SPREAD_TOLS,
    Diagnosis,
    LeafError,
    StepRecord,
    constant_ratio,
    converted_counter,
    one_factor_across,
    ratio_label,
    spread_phrase,
    would_show,
)
from shardcheck.parity.diagnosis.floating import (
    factor_read,
    not_compared,
    state_notes,
    step_written,
    sync_schedule,
    written_factor,
)
from shardcheck.parity.diagnosis.form import (
    ONE_NUMBER,
    REFERENCE_ZERO_MEANING,
    cannot_tell,
    changes_differ,
    form_from_leaves,
    weight_phrase,
    zero_on_copies_said,
)
from shardcheck.parity.diagnosis.form import (
    moment as _moment,
)
from shardcheck.parity.diagnosis.grouping import (
    NO_PROPERTY,
    LeafFacts,
    along,
    common_prefix,
    n_leaves,
    rounding_params,
    state_property,
    words_and,
)
from shardcheck.parity.diagnosis.multisteps import every_k_differs, reference_mini_step
from shardcheck.parity.diagnosis.topology import (
    _param_of,
    added_before_psum,
    axis_roles,
    clip_coefficient_message,
    clip_factors,
    factor_groups,
    is_expert_axis,
    leaf_factors,
    local_clip_message,
    missed_axes_message,
    model_axes_of_size,
    model_axis_factor,
    pipeline_axes,
    replica_counts,
    replicas_by_gradient,
    replicas_root,
    replicated_reduced_message,
    sequence_axes,
    sequence_forward_hint,
)
from shardcheck.parity.tolerance.derive import UPDATE_RTOL, UPDATE_ULPS

# Update ratios are read from the leaves that moved by more than this many times their tolerance, where some did.
SHARP = 10.0
# An active clip scaled by a norm sqrt(R) too large is exactly 1/sqrt(R): named only within 0.1% (a factor 0.7
# that is a user's own constant is not 1/sqrt(2) = 0.7071).
CLIP_RTOL = 1e-3
# Above this rtol, a factor-2 error (a mean taken twice at S=2 is off by 50%) may hide in the tolerance.
LOOSE_RTOL = 0.1
# The faulty reductions of ``StepRecord.matches`` that have a rule of their own: a failing step whose update
# reproduces one of them is explained, and the generic ``scaled``/``drift``/``loss_only``/``update_differs``
# findings stay silent for it.
NAMED_REDUCTIONS = (
    "per_shard_mean",
    "per_shard_loss",
    "per_shard_loss_value",
    "per_shard_mean_value",
    "bf16_reduction",
    "clip_per_shard",
)
# The verdict findings: first in the list when nothing failed.
VERDICTS = ("parity", "diverged_trajectory")


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


def _spread_excludes(record: StepRecord | None, value: float | None) -> bool:
    """Whether the failing gradients' own ratios place their factor away from ``value`` (a named factor such as
    1/2): most of the well-resolved failing gradient leaves (``badness > SHARP``) have a 10th-90th percentile
    ratio (``LeafError.spread``) that misses ``value`` by more than a quarter of its width plus 0.1% of
    ``value``. :data:`RATIO_RTOL` reads a factor 2% from 1/2 as 1/2; a ratio measured to 4 digits says what it
    is (trial 26: a clip by each shard's own norm gave 0.4962 on every element, "spread 0.4962..0.4962", and read
    "x1/2: averaged twice")."""
    if record is None or value is None:
        return False
    spreads = [
        e.spread
        for e in record.leaves
        if e.kind == "grad"
        and not e.ok
        and e.badness > SHARP
        and e.spread is not None
        and all(math.isfinite(v) for v in e.spread)
    ]
    if not spreads:
        return False
    apart = [
        lo - pad > value or value > hi + pad
        for lo, hi in spreads
        for pad in [0.25 * (hi - lo) + 1e-3 * abs(value)]
    ]
    return sum(apart) > len(apart) / 2


def _within_tolerance_of_zero(e: LeafError) -> bool:
    """Whether the reference's leaf, ``max|ref| = max_abs_err / max_rel_err``, is within the leaf's tolerance of
    0: a gradient that is rounding noise (an attention key bias's under bfloat16 compute: the tolerance holds
    several times the reference's own rounding, ``shardcheck.parity.tolerance.precision``)."""
    if not (e.max_rel_err > 0 and math.isfinite(e.max_rel_err)):
        return False
    return e.max_abs_err / e.max_rel_err <= e.tolerance


def _ahead(e: LeafError) -> bool:
    """Whether a failing counter runs ahead of the reference's by a whole factor k >= 2 (``ratio``: candidate /
    reference)."""
    return e.ratio is not None and e.ratio >= 2 and abs(e.ratio - round(e.ratio)) < 1e-9


def _counts(ctx: DiagnosisContext, fail: LeafError) -> tuple[int, int]:
    """``(reference's, candidate's)`` value of the failing counter ``fail`` (its ``counts`` where recorded; else
    the step counter: the record's ``step_count`` and ``candidate_step_count``; another: read back from its error
    and ratio)."""
    if fail.counts is not None:
        return fail.counts
    if fail.path == "step":
        rec = ctx.records[fail.step]
        return rec.step_count, rec.candidate_step_count
    expected = round(fail.max_abs_err / (fail.ratio - 1))
    return expected, round(expected * fail.ratio)


def _counter_phrase(fail: LeafError) -> str:
    return "its counter" if fail.path == "step" else f"the counter {fail.path} of its state"


def _gradient_factor(record: StepRecord) -> tuple[float | None, str]:
    """The factor by which the candidate's gradient differs from the reference's at this step, and the evidence
    (:func:`_gradient_reading` without its provenance)."""
    f, evidence, _ = _gradient_reading(record)
    return f, evidence


def _gradient_reading(record: StepRecord) -> tuple[float | None, str, bool]:
    """``(factor, evidence, loss_led)``: the factor by which the candidate's gradient differs from the
    reference's at this step, the evidence, and whether the factor is the loss's own (:func:`_loss_led_factor`,
    read where the gradients' elements spread too far to read one).

    Evidence in order of directness: exposed gradients; first moments / momentum traces (proportional to the
    gradient); second moments (``nu``: proportional to its square, so the square root is taken); parameter
    updates (proportional to the gradient for SGD and momentum, nearly scale-invariant for Adam).
    """
    leaves = _voting(record)
    # a gradient leaf within its tolerance while others are off by a factor is near zero (an attention key
    # bias's rounding noise): its ratio is no evidence, so the failing leaves alone vote when any fail; nor is a
    # leaf's whose reference gradient lies within its tolerance of 0, even when it fails (that noise times S)
    grads = _voting_grads(leaves)
    failing = [e for e in grads if not e.ok]
    if not all(constant_ratio(e) for e in failing or grads):
        return None, "", False  # a leaf's ratio is no one factor: no factor is claimed (LeafError.spread)
    if not all(one_factor_across(e) for e in failing if e.badness > SHARP):
        # a leaf off by far more than rounding, its ratio spread past 2%: no factor either, unless the loss
        # itself carries one that every failing gradient's median shows (_loss_led_factor)
        f = _loss_led_factor(record, grads)
        return (f, "gradients", True) if f is not None else (None, "", False)
    return (*_factor_of_leaves(leaves, failing or grads), False)


def _factor_of_leaves(leaves: list[LeafError], grads: list[LeafError]) -> tuple[float | None, str]:
    """The factor the voting ``leaves`` show, read from the gradients ``grads`` first, then from the optimizer's
    moments, then from the parameters' updates (:func:`_gradient_reading`), and its evidence."""
    f = _consensus([e.ratio for e in grads])
    if f is not None:
        return f, "gradients"
    # a ratio's uncertainty is about tolerance / change: where some leaves moved by more than SHARP times their
    # tolerance, they alone vote (under bfloat16 compute a bias's first moment moved by 3.5 times its tolerance
    # and its ratio by 4% of a sum's x4, past RATIO_RTOL, while the well-resolved leaves agreed to 1%)
    # only state linear in the gradient (a first moment, a trace) or Adam's square of it (nu) reads a factor:
    # a factored or otherwise nonlinear statistic (Adafactor's v_row, v_col, v) moves by no gradient factor
    state = _sharp([e for e in leaves if e.kind == "opt_state" and _moment(e.path)])
    if not all(constant_ratio(e) for e in state if not e.ok):
        return None, ""
    first = [e.ratio for e in state if _moment(e.path) == "first"]
    second = [e.ratio for e in state if _moment(e.path) == "second"]
    second = [math.sqrt(r) for r in second if r is not None and r > 0]
    moments = [r for r in first if r is not None] + second
    if moments:
        f = _consensus(moments)
        if f is not None:
            adam = any(m in f".{e.path}." for e in state for m in (".mu.", ".nu."))
            return f, "optimizer moments" if second or adam else "momentum traces"
        return None, ""
    params = _sharp([e for e in leaves if e.kind == "param"])
    if not all(constant_ratio(e) for e in params if not e.ok):
        return None, ""
    f = _consensus([e.ratio for e in params])
    return (f, "parameter updates") if f is not None else (None, "")


def _voting(record: StepRecord) -> list[LeafError]:
    """The leaves whose ratio can read a factor: not rounding noise (``record.unresolved``) and, where known, a
    reference change above the tolerance (a key bias under SGD moves by lr * noise)."""
    noise = tuple("." + p.split(" ", 1)[-1] for p in record.unresolved)
    return [
        e
        for e in record.leaves
        if (not noise or not f".{e.path}".endswith(noise))
        and (e.reference_change is None or e.reference_change > e.tolerance)
    ]


def _voting_grads(leaves: list[LeafError]) -> list[LeafError]:
    """The gradient leaves of ``leaves`` (:func:`_voting`'s) whose reference is not within its tolerance of 0."""
    return [e for e in leaves if e.kind == "grad" and not _within_tolerance_of_zero(e)]


def _loss_led_factor(record: StepRecord, grads: list[LeafError]) -> float | None:
    """The loss's own ratio f where the loss the step returned at equal parameters (step 0, or a step run from
    the reference's state) fails as f x the reference's and every failing gradient's median ratio lies near f
    (:func:`~shardcheck.parity.diagnosis.localization.near_factor`, the localization's reading), though some
    leaf's elements spread past 2%: low-precision compute's rounding (trial 60: under bfloat16 compute, a loss
    and its gradients averaged over 'data' where their sum was due spread fc2.bias's ratios to 0.48..0.504 at 11
    x its tolerance, and the step read forward_differs, blaming the model's dropout, where float32 read
    ``scaled``); ``None`` otherwise."""
    from shardcheck.parity.diagnosis.localization import near_factor

    losses = [e for e in record.leaves if e.kind == "loss"]
    at_equal = record.step == 0 or record.from_reference_state
    if not at_equal or not losses or all(e.ok for e in losses) or not record.loss:
        return None
    if record.candidate_loss is None:
        return None
    f = record.candidate_loss / record.loss
    return f if near_factor(grads, f) is not None else None


def _as_fitted(
    record: StepRecord, f: float | None, evidence: str, loss_led: bool = False
) -> tuple[float | None, str]:
    """The gradient factor as the form fitted on the failing gradients' arrays says it, where one was fitted
    (``StepRecord.forms["gradients"]``, :func:`~shardcheck.parity.diagnosis.form.fit_form`: every element within
    its tolerance of one factor): its factor where it found one, none where it found none (a rule never claims a
    constant factor the form refutes); without arrays (a replay), none where the failing gradients' records allow
    no form of one factor (:func:`~shardcheck.parity.diagnosis.form.form_from_leaves`). A ``loss_led`` factor
    (:func:`_gradient_reading`: the loss's own, which every failing gradient's median shows) stands as read."""
    if f is not None and loss_led:
        return f, evidence
    form = dict(record.forms).get("gradients")
    noise = {
        u.split(" ", 1)[-1] for u in record.unresolved
    }  # as _gradient_factor: no rounding-level leaf votes
    bad = [
        e
        for e in record.leaves
        if e.kind == "grad" and not e.ok and e.path not in noise and not _within_tolerance_of_zero(e)
    ]
    if form is None and (f is None or not bad):
        return f, evidence
    # no arrays (a replay): the form its records allow, as the localization reads it; a factor read from the
    # moments stands only where the failing gradients allow one too (trial 16: gradients x1.333 and x2.667 by
    # group, said as "optimizer moments are 1.141 x": one factor of the dense group's clipped moments)
    if form is None:
        form = form_from_leaves(bad, update=False)
        return (f, evidence) if form.kind in _READ_FACTOR else (None, "")
    if form.kind in _READ_FACTOR and form.factor is not None:
        return form.factor, "gradients"
    return None, ""


# the forms a gradient factor is read from: one factor, or one number's ratio (which the rules then say as one
# number, never as a form: DiagnosisContext.one_number)
_READ_FACTOR = ("factor", "one_number")


def _model_axis_subset(record: StepRecord, f: float, mesh_shape) -> bool:
    """Whether the failing gradients' factor ``f`` is the size of a model axis (tensor, expert) and holds on a
    subset only: other, well-resolved gradients match (ratio 1). Then it is no factor of the whole gradient but
    those leaves' own, read per leaf by :func:`replicated_reduced` (a replicated bias added before the psum over
    'model'; experts not divided by their group: ``expert_scaling``)."""
    if not _close(f, round(f)) or not model_axes_of_size(mesh_shape, round(f)):
        return False
    return any(
        e.kind == "grad"
        and e.ok
        and e.ratio is not None
        and _close(e.ratio, 1.0)
        and not _within_tolerance_of_zero(e)
        for e in record.leaves
    )


def _sharp(leaves: list[LeafError]) -> list[LeafError]:
    """The leaves whose reference change exceeds :data:`SHARP` times their tolerance, or all of them when none
    does."""
    sharp = [e for e in leaves if e.reference_change is not None and e.reference_change > SHARP * e.tolerance]
    return sharp or leaves


def _axis_factor(
    f: float, num_shards: int | None, mesh_shape: dict[str, int] | None
) -> tuple[str, str] | None:
    """A factor that is the size of one mesh axis of several (not S itself): a sum over that axis once too often
    (trial 15: replicated biases psum-ed over 'fsdp' after their psum over 'data' and 'fsdp', x2 on data=2,fsdp=2,
    read "not a shard count"), or a mean over it once too often; ``None`` otherwise. One axis counts too where
    S is not its size (trial 55: ``num_shards=4`` on a ``data=2`` mesh, S counting micro-batches, and a psum for
    a pmean, x2, read "not a shard count")."""
    if not mesh_shape:
        return None
    for size in sorted(set(mesh_shape.values())):
        if size < 2 or size == num_shards:
            continue
        axes = [a for a, n in mesh_shape.items() if n == size]
        which = " or ".join(repr(a) for a in axes)
        named = (
            f"the size of mesh axis {which}" if len(axes) == 1 else f"the size of mesh axes {which} (each)"
        )
        if _close(f, size):
            return (
                "summed",
                f"x{size}, {named}: the gradient was summed over {which} once too often (a psum where the reduction "
                f"over that axis was already done, or where a mean was due), or scaled by another count of {size} "
                "of the step's own (a loss or gradient multiplied by a micro-batch count)",
            )
        if _close(f, 1 / size):
            return (
                "averaged_twice",
                f"x1/{size}, {named}: the gradient was averaged over {which} once too often (a pmean after its "
                f"reduction, or a division by its size twice), or divided twice by another count of {size} of the "
                "step's own (a micro-batch count)",
            )
    return None


def _name_factor(
    f: float, num_shards: int | None, mesh_shape: dict[str, int] | None = None
) -> tuple[str, str] | None:
    """``(code, phrase)`` for a gradient factor that is a power of S (or of an integer when S is unknown), or
    1/sqrt(R) for a replica count R (a clipping norm counted once per replica); first, the size of a model axis
    (a sum over an axis the batch is replicated on: :func:`~shardcheck.parity.diagnosis.topology.model_axis_factor`)."""
    on_model = model_axis_factor(f, num_shards, mesh_shape, _close)
    if on_model is not None:
        return on_model
    # one shard: no sum or mean over shards to get wrong; S unknown: any count
    candidates = [] if num_shards == 1 else [num_shards] if num_shards else list(range(2, 65))
    for s in candidates:
        if _close(f, s):
            return (
                "summed",
                f"the gradient reduction summed instead of averaged (x{s}: a sum over {s} shards)",
            )
        if _close(f, 1 / s):
            return (
                "averaged_twice",
                f"the gradient was averaged twice (or divided by S={s} twice): x1/{s}{_pmean_for_psum(s, mesh_shape)}",
            )
        # or a count of the step's own that happens to be S^2 (trial 59: 4 micro-batches summed, not averaged, on
        # data=2 read "sum-reduced twice" alone, in a step with no reduction at all)
        own = f"a count of {s * s} of the step's own, such as {s * s} micro-batches"
        if _close(f, s * s):
            return (
                "summed",
                f"the gradient was sum-reduced twice (x{s * s} = {s}^2; docs/reduction_cases.md C3), or scaled by "
                f"{own} summed where their mean was meant",
            )
        if _close(f, 1 / (s * s)):
            return (
                "averaged_twice",
                f"the gradient was divided by S={s} three times (x1/{s * s}), or divided once too often by {own} "
                "(their sum divided by the micro-batch count twice)",
            )
    on_axis = _axis_factor(f, num_shards, mesh_shape)
    if on_axis is not None:
        return on_axis
    for value, r in clip_factors(num_shards, mesh_shape).items():
        if _close(f, value, CLIP_RTOL):
            k = math.isqrt(r)
            other = (
                f"; without such a clip, x1/{k}: a gradient divided by {k} once too often (a micro-batch or shard "
                f"count applied twice), or a sum over 1/{k} of the shards divided by all of them"
                if k * k == r
                else ""
            )
            return (
                "clip_norm",
                f"x1/sqrt({r}): where the gradients are clipped by a global norm, that norm was sqrt({r}) too "
                f"large, counted once per replica ({r} copies of each replicated gradient in the psum of squared "
                "norms); sum the squares over the leaves each device owns, counting a replicated leaf once "
                f"(or let jit/GSPMD compute optax.clip_by_global_norm on the global arrays){other}",
            )
    return None


def _pmean_for_psum(s: int, mesh_shape: dict[str, int] | None) -> str:
    """The reading of x1/``s`` where a model axis has size ``s``: a pmean over it where a psum was due (trial 34:
    a sequence-parallel step's replicated leaves, their partial gradients averaged over 'model', read only
    "averaged twice")."""
    axes = model_axes_of_size(mesh_shape, s) if mesh_shape else ()
    if not axes:
        return ""
    m = ", ".join(repr(a) for a in axes)
    return (
        f"; or, {s} being the size of mesh axis {m}, a pmean over {m} where a psum was due (a step that splits the "
        f"tokens over {m}, as sequence parallelism does, sums the partial gradients of the leaves replicated over "
        "it)"
    )


def _count_before_clip(f: float) -> tuple[str, str] | None:
    """A factor 1/k = 1/sqrt(k^2) on the returned gradients themselves: a count applied twice before a global
    norm's clip (which acts inside the optimizer, after the gradients are returned, unless the step clips them
    itself), said first as ``averaged_twice`` (trial 28: a step dividing its accumulated gradient by its 2
    micro-batches twice, its optimizer clipping nothing, read ``clip_norm`` "where the gradients are clipped ...");
    ``None`` where 1/f is not an integer."""
    k = round(1 / f)
    if k < 2 or not _close(f, 1 / k):
        return None
    return (
        "averaged_twice",
        f"x1/{k}: a gradient divided by {k} once too often (a micro-batch or shard count applied twice), or a sum "
        f"over 1/{k} of the shards divided by all of them; or, where the step clips the gradients it returns by a "
        f"global norm, that norm was sqrt({k * k}) too large, counted once per replica (sum the squares over the "
        "leaves each device owns, counting a replicated leaf once)",
    )


def _applied_factors(
    first: StepRecord | None,
    bad: tuple[LeafError, ...],
    factor: float | None,
    reproduced: tuple[str, ...],
    counter_fail: LeafError | None,
) -> tuple[float | None, str, tuple[tuple[float, tuple[str, ...]], ...]]:
    """``(applied_factor, applied_evidence, applied_groups)`` of :class:`DiagnosisContext`: the factor(s) of the
    gradient the optimizer was given, read without the exposed gradients, where these were compared and all
    match while the update fails (``factor`` is then ``None``: the gradients' ratios are 1) and no counter, named
    reduction or gradient factor explains it."""
    if first is None or factor is not None or reproduced or counter_fail is not None:
        return None, "", ()
    grads = [e for e in first.leaves if e.kind == "grad"]
    if not grads or not all(e.ok for e in grads) or not {e.kind for e in bad} & {"param", "opt_state"}:
        return None, "", ()
    rest = dataclasses.replace(first, leaves=tuple(e for e in first.leaves if e.kind != "grad"))
    f, evidence = _gradient_factor(rest)
    if f is not None:
        if _close(f, 1.0):
            return None, "", ()
        first_moments = evidence == "optimizer moments" and any(".mu." in f".{e.path}." for e in rest.leaves)
        return f, "Adam's first moments" if first_moments else evidence, ()
    # a leaf split between two devices' slices (ZeRO's flat buffer) carries two factors: left out where the
    # others are constant and its ratios lie at or above 1 as theirs do (trial 47's clip by each slice's own norm)
    straddle = {id(e) for e in bad if not constant_ratio(e)}
    if straddle and (
        len(straddle) * 2 > len(bad)
        or any(e.spread is None or e.spread[0] < 1 - RATIO_RTOL for e in bad if id(e) in straddle)
    ):
        return None, "", ()
    kept = [e for e in rest.leaves if id(e) not in straddle]
    # a parameter whose moments straddle carries no factor: its update's ratio (Adam's, blind to the gradient's
    # scale) stood in for them, and a factor of 1 is no group (trial 47: "x1: blocks.1.down.kernel" live)
    split = {_param_of(e.path, [k.path for k in kept if k.kind == "param"]) for e in bad if id(e) in straddle}
    factors = {p: f for p, f in leaf_factors(kept, first.unresolved, grads=False).items() if p not in split}
    groups = [g for g in factor_groups(factors, RATIO_RTOL) if abs(g[0] - 1.0) > RATIO_RTOL]
    if len(groups) < 2 or groups[0][0] < 1 - RATIO_RTOL:
        return None, "", ()
    return None, "", tuple((f, tuple(paths)) for f, paths in groups)


@dataclasses.dataclass(frozen=True)
class DiagnosisContext:
    """What the rules read, computed once from the arguments of :func:`diagnose`.

    Attributes:
        records: the compared steps, in order.
        num_shards: S, when known.
        diverged: the trajectory record of the step after which the runs separated (see :func:`diagnose`).
        reference_diverged_at: the step at which the reference became non-finite, or ``None``.
        failing: the records that failed, in order.
        first: the first failing record, or ``None``.
        bad: ``first``'s leaves out of tolerance.
        factor: the gradient factor at ``first`` when update leaves (not only the loss or counters) fail and it
            is a constant other than 1, else ``None``.
        evidence: what ``factor`` was read from (``"gradients"``, ``"optimizer moments"``, ...), else ``""``.
        counter_fail: the first failing optimizer step counter leaf (path ``"step"``) over all records; else the
            first failing counter of the optimizer's own state (Adam's ``count``, a schedule's step) that runs
            ahead of the reference's by a whole factor (:func:`_ahead`).
        reproduced: the :data:`NAMED_REDUCTIONS` that ``first``'s update reproduces.
        mesh_shape: the candidate's mesh, ``{axis: size}``, when known.
        micro_batches: k, the micro-batches of a candidate that accumulates gradients (one with its own
            optimizer, ``Candidate.make_optimizer``), else ``None``.
        applied_factor: where ``first``'s exposed gradients were compared and all match while its update fails,
            the one factor (other than 1) of the gradient the optimizer was given, read from its state or
            updates without the gradients (a clip applied after them); else ``None``.
        applied_evidence: what ``applied_factor`` was read from, else ``""``.
        applied_groups: where the gradients match and no one factor explains the update, the per-leaf factors
            of the optimizer's gradient grouped (:func:`~shardcheck.parity.diagnosis.topology.factor_groups`), when there
            are at least two groups and every factor is >= 1 (a per-shard clip norm); else ``()``.
        facts: ``{parameter path: LeafFacts}`` (shape, dtype, the placement's mesh axes), where the caller knows
            them: the ``localized`` rule's group reads them as the localization's does (trial 34: "every failing
            leaf is replicated on every device" beside "share no ndim, name or module" in one report).
    """

    records: tuple[StepRecord, ...]
    num_shards: int | None
    diverged: StepRecord | None
    reference_diverged_at: int | None
    failing: tuple[StepRecord, ...]
    first: StepRecord | None
    bad: tuple[LeafError, ...]
    factor: float | None
    evidence: str
    counter_fail: LeafError | None
    reproduced: tuple[str, ...]
    mesh_shape: dict[str, int] | None = None
    micro_batches: int | None = None
    applied_factor: float | None = None
    applied_evidence: str = ""
    applied_groups: tuple[tuple[float, tuple[str, ...]], ...] = ()
    facts: Mapping[str, LeafFacts] | None = None

    @classmethod
    def build(
        cls,
        records: Sequence[StepRecord],
        num_shards: int | None = None,
        diverged: StepRecord | None = None,
        reference_diverged_at: int | None = None,
        mesh_shape: dict[str, int] | None = None,
        micro_batches: int | None = None,
    ) -> DiagnosisContext:
        records = tuple(records)
        failing = tuple(r for r in records if not r.ok)
        first = failing[0] if failing else None
        bad = () if first is None else tuple(e for e in first.leaves if not e.ok)
        factor, evidence = None, ""
        # only the exposed gradients fail: a factor read from them explains the step only where the optimizer is
        # blind to the gradient's scale (the harness's "scale_blind"); elsewhere they are not the ones applied
        grads_only = {e.kind for e in bad} == {"grad"} and "scale_blind" not in first.matches
        if {e.kind for e in bad} - {"loss", "counter"} and not grads_only:
            f, ev = _as_fitted(first, *_gradient_reading(first))
            if f is not None and not _close(f, 1.0) and not _model_axis_subset(first, f, mesh_shape):
                factor, evidence = f, ev
        # the trajectory's own counters: a synchronized re-check starts the candidate's counters (a MultiSteps'
        # own) from the reference's state, so its count is not the run's
        counters = [
            e
            for r in records
            if not r.synchronized
            for e in r.leaves
            if e.kind == "counter" and not e.ok and not _of_model(e)
        ]
        counter_fail = next((e for e in counters if e.path == "step"), None) or next(
            (e for e in counters if _ahead(e)), None
        )
        if counter_fail is None and counters and every_k_differs(records) is not None:
            # a MultiSteps that applies less often than the task's: its counters lag, no whole factor ahead
            counter_fail = next(
                (e for e in counters if e.path.rsplit(".", 1)[-1] in ("gradient_step", "mini_step")), None
            )
        matches = () if first is None else first.matches
        reproduced = tuple(m for m in (*NAMED_REDUCTIONS, *MICRO_REDUCTIONS) if m in matches)
        if first is not None and _reduction_refuted(first):
            reproduced = tuple(m for m in reproduced if m != "bf16_reduction")
        scaled = {"times_S": num_shards, "times_1/S": 1 / num_shards if num_shards else None}
        # where the exposed gradients all match, a factor applied after them is read from the state
        # (_applied_factors): the rerun on S g also reproduces any factor a binding clip maps to the same update
        # (trial 50: a gradient x2 under a clip that binds read "4 x ... summed" on data=4, "2 x" on data=2)
        exposed = [] if first is None else [e for e in first.leaves if e.kind == "grad"]
        if exposed and all(e.ok for e in exposed):
            scaled = {}
        for name, f in scaled.items():
            if name in matches and f:
                # the harness reran the reference's optimizer on the scaled gradient: the factor itself, where
                # the moments' ratio can be distorted (global-norm clipping)
                factor = float(f)
                evidence = (
                    "the gradients (the reference's optimizer rerun on them reproduces the candidate's state)"
                )

        applied_factor, applied_evidence, applied_groups = _applied_factors(
            first, bad, factor, reproduced, counter_fail
        )
        return cls(
            records, num_shards, diverged, reference_diverged_at, failing, first, bad, factor, evidence,
            counter_fail, reproduced, mesh_shape, micro_batches, applied_factor, applied_evidence,
            applied_groups,
        )  # fmt: skip

    @property
    def bad_kinds(self) -> frozenset[str]:
        """The kinds of :attr:`bad`."""
        return frozenset(e.kind for e in self.bad)

    @property
    def update_kinds(self) -> frozenset[str]:
        """The kinds of :attr:`bad` other than the loss and counters."""
        return self.bad_kinds - {"loss", "counter"}

    @property
    def worst(self) -> LeafError | None:
        """The worst of :attr:`bad` (the first, on ties)."""
        return max(self.bad, key=lambda e: e.badness) if self.bad else None

    @property
    def worst_name(self) -> str | None:
        return None if self.worst is None else self.worst.name

    @property
    def named_factor(self) -> tuple[str, str] | None:
        """:func:`_name_factor` of :attr:`factor`; where that was read from one number (:attr:`one_number`), only
        where the number is the named factor within its leaf's tolerance (:func:`_one_number_fits`)."""
        if self.factor is None:
            return None
        named = _name_factor(self.factor, self.num_shards, self.mesh_shape)
        one = self.one_number
        if named is not None and one is not None and not _one_number_fits(one, _named_value(self.factor)):
            return None
        if named is not None and _spread_excludes(self.first, self._named_target()):
            return None
        if named is not None and named[0] == "clip_norm" and self.evidence == "gradients":
            return _count_before_clip(self.factor) or named
        return named

    def _named_target(self) -> float:
        """The value :attr:`factor` is named as: the nearest (relatively) of its count, the inverse of one, and
        the clip factors 1/sqrt(R) of :func:`_name_factor`."""
        f = self.factor
        targets = [_named_value(f), *clip_factors(self.num_shards, self.mesh_shape)]
        return min(targets, key=lambda v: abs(f - v) / abs(v))

    @property
    def one_number(self) -> LeafError | None:
        """The failing leaf :attr:`factor` was read from where it is one leaf of one element (0-D or shape
        ``(1,)``: the only failing leaf of the evidence's kind), else ``None``: its ratio is at once a factor, a
        decay term and an offset, so the rules claim no factor of it (several such leaves sharing one factor
        still read as one)."""
        kind = _EVIDENCE_KINDS.get(self.evidence)
        if self.factor is None or kind is None:
            return None
        bad = [e for e in self.bad if e.kind == kind]
        if len(bad) != 1 or bad[0].shape is None or math.prod(bad[0].shape) != 1:
            return None
        return bad[0]

    @property
    def unexplained(self) -> bool:
        """Update leaves fail at :attr:`first` and no specific rule (factor, counter, named reduction, only
        the exposed gradients) explains it: one of the generic fallbacks applies."""
        return (
            bool(self.update_kinds)
            and self.bad_kinds != {"grad"}
            and self.factor is None
            and self.counter_fail is None
            and not self.reproduced
            and self.applied_factor is None
            and not self.applied_groups
        )

    @property
    def drifted(self) -> bool:
        """:attr:`first` is a later step of the candidate's own trajectory (not a synchronized re-run) whose own
        update is not shown faulty: where the reference's optimizer rerun on the candidate's own gradients and
        pre-step state differs from the candidate's (a replay's rerun at that step), the step computes another
        update from equal inputs, whatever the steps before it did."""
        first = self.first
        if first is None or first.step == 0 or first.from_reference_state:
            return False
        return all(e.ok for e in first.optimizer_rerun or ())

    @property
    def detail(self) -> str:
        """The worst leaf's error, for the fallback messages."""
        return _detail(self.worst)


# the leaves each evidence of DiagnosisContext.factor reads (a harness rerun that reproduces the candidate's
# state is no one number's reading)
_EVIDENCE_KINDS = {
    "gradients": "grad",
    "optimizer moments": "opt_state",
    "momentum traces": "opt_state",
    "parameter updates": "param",
}


def _named_value(f: float) -> float:
    """The count (or its inverse) a named factor ``f`` stands for: ``round(f)`` above 1, ``1 / round(1 / f)``
    below."""
    return float(round(f)) if f >= 1 else 1.0 / round(1.0 / f)


def _one_number_fits(e: LeafError, target: float) -> bool:
    """Whether one number ``e`` (ratio ``r`` to the reference's, off it by ``max_abs_err``) is ``target`` x the
    reference's within its tolerance: the reference's ``|x| = max_abs_err / |r - 1|`` and the residual
    ``|x| |r - target|`` within ``SPREAD_TOLS (1 + |target|) tolerance`` (:func:`~shardcheck.parity.diagnosis.
    form.factor_within`'s bound)."""
    if e.ratio is None or not math.isfinite(e.ratio) or e.ratio == 1:
        return False
    size = e.max_abs_err / abs(e.ratio - 1)
    return size * abs(e.ratio - target) <= SPREAD_TOLS * (1 + abs(target)) * e.tolerance


def _detail(worst: LeafError, ratio: bool = True) -> str:
    """A failing leaf's error and (``ratio``) its update ratio, or where that is no constant factor its spread; a
    leaf shaped otherwise in the candidate (``LeafError.cand_shape``), its two shapes; a leaf in one run only
    (``LeafError.missing``), that."""
    if worst.missing:
        return f"{worst.name}: in one run only"
    if worst.dtypes is not None:  # a counter the step converted (a pmean of the whole optimizer state)
        return f"{worst.name}: {converted_counter(worst)}"
    if worst.finite is not None:  # a skipped step's loss or gradient, compared by finiteness
        return f"{worst.name}: finite in the {'reference' if worst.finite[0] else 'candidate'}'s run only"
    if worst.cand_shape is not None:
        return f"{worst.name}: shaped otherwise ({worst.cand_shape} against the reference's {worst.shape})"
    ratio = (
        ""
        if worst.ratio is None or not ratio
        else _unexplaining_ratio(worst)
        if constant_ratio(worst) and _ratio_short(worst)
        else f", {ratio_label(worst)} {worst.ratio:.4g}"
        if constant_ratio(worst)
        else f", {spread_phrase(worst)}"
    )
    return f"{worst.name}: max abs err {worst.max_abs_err:.3g} > tolerance {worst.tolerance:.3g}{ratio}"


def _ratio_short(e: LeafError) -> bool:
    """Whether a failing gradient's or loss's ratio is no factor that explains its error: a factor r moves the
    leaf by ``|r - 1|`` of its largest value, and its measured error (``max_rel_err``, of that value) is over twice that (trial
    44: a gradient 50x past its tolerance, relative error 2.6e-3, printed "ratio 1")."""
    r, rel = e.ratio, e.max_rel_err
    return (
        not e.ok
        and e.kind in ("grad", "loss")  # a ratio of values, as max_rel_err is (not of an update's change)
        and e.samples != 0
        and r is not None
        and math.isfinite(r)
        and math.isfinite(rel)
        and rel > 0
        and abs(r - 1.0) < 0.5 * rel
    )


def _ratio_digits(r: float) -> str:
    """``r`` with the fewest digits (4 or more) that tell it from 1: ``0.99974`` where ``:.4g`` says ``1``."""
    for digits in range(4, 10):
        text = f"{r:.{digits}g}"
        if float(text) != 1.0 or r == 1.0:
            return text
    return f"{r:.10g}"


def _unexplaining_ratio(e: LeafError) -> str:
    """``", no constant factor: its ratio 0.99996 moves it by 4e-05 of its largest value, its error is 0.0026 of
    it"``: the ratio of a leaf that :func:`_ratio_short` finds explains too little of its error to be read as
    the leaf's factor."""
    r = e.ratio
    return (
        f", no constant factor: its {ratio_label(e)} {_ratio_digits(r)} moves it by {abs(r - 1.0):.2g} of its "
        f"largest value, its error is {e.max_rel_err:.2g} of it"
    )


Finding = list[Diagnosis] | Diagnosis | None
Rule = Callable[[DiagnosisContext], Finding]


def parity(ctx: DiagnosisContext) -> Finding:
    """``parity``: every step within tolerance (no trajectory divergence, the reference finite)."""
    if not ctx.records or ctx.failing or ctx.diverged is not None or ctx.reference_diverged_at is not None:
        return None
    n = len({(e.kind, e.path) for r in ctx.records for e in r.leaves}) - not_compared(ctx.records)
    state = state_notes(ctx.records)  # the floating model state not compared, or compared coarsely
    text = f"Parity holds: {n} leaves over {len(ctx.records)} step(s) within tolerance."
    if ctx.num_shards == 1 and math.prod((ctx.mesh_shape or {}).values()) <= 1:
        text += f" {ONE_DEVICE}"
    return Diagnosis("parity", f"{text} {state}" if state else text)


ONE_DEVICE = (
    "S=1 on one device: no all-reduce, all-gather or reduce-scatter ran, so a shard-count error (a sum for a "
    "mean: x S, here x1) cannot show; check on a mesh of 2 or more devices to prove the sharding."
)
"""What a passing check on one device says beside its parity (trial 57 D: ``check_parity`` on a 1-device mesh
passed without a word of it; ``verify`` says it in its own note)."""


def reference_diverged(ctx: DiagnosisContext) -> Finding:
    """``reference_diverged``: the reference went non-finite; the later steps were not compared."""
    t = ctx.reference_diverged_at
    if t is None:
        return None
    return Diagnosis(
        "reference_diverged",
        f"The reference run diverged (non-finite loss or parameters at step {t}): "
        f"steps {t} and later were not compared, and this is no verdict about the "
        "candidate. Lower the learning rate where its parameters grew step by step; where batch "
        f"{t} makes the loss non-finite from finite parameters (an index out of range, a log of 0, a count of 0), "
        "the batch is the cause: run that step with jax.config.update('jax_debug_nans', True) to name the "
        "operation.",
    )


def _non_finite(record: StepRecord | None) -> list[LeafError]:
    """The leaves of ``record`` whose error is NaN (NaN values: an infinite error may be a leaf missing or of
    another shape) where the candidate's loss is NaN or infinite, or some leaf's error is NaN; else ``[]`` (a
    reference that went non-finite stops the comparison: ``reference_diverged``)."""
    if record is None:
        return []
    nan = [e for e in record.leaves if not e.ok and math.isnan(e.max_abs_err)]
    loss = record.candidate_loss
    lost = loss is not None and not math.isfinite(loss)
    if not (nan or lost):
        return []
    return [
        e for e in record.leaves if not e.ok and (math.isnan(e.max_abs_err) or (lost and e.kind == "loss"))
    ]


def non_finite(ctx: DiagnosisContext) -> Finding:
    """``non_finite``: at the first failing step the candidate holds NaN or infinite values where the reference's
    are finite; said as such, with the first stage's leaves that show it (no factor, form or ratio is read from a
    NaN)."""
    bad = _non_finite(ctx.first)
    if not bad:
        return None
    t = ctx.first.step
    loss = ctx.first.candidate_loss
    head = (
        f"The candidate's loss is {loss} at step {t}, the reference's {ctx.first.loss:.6g}"
        if loss is not None and not math.isfinite(loss)
        else f"The candidate's step produced non-finite values at step {t} where the reference's are finite"
    )
    order = {"loss": 0, "counter": 1, "state": 1, "grad": 2, "opt_state": 3, "param": 4}
    earliest = min(order.get(e.kind, 5) for e in bad)
    first = sorted(e.name for e in bad if order.get(e.kind, 5) == earliest)
    shown = ", ".join(first[:4]) + (f" and {len(first) - 4} more" if len(first) > 4 else "")
    if ctx.first.skipped:  # the reference's loss is not finite too: its optimizer skipped the step
        return Diagnosis(
            "non_finite",
            f"At step {t} the reference's loss and gradients are not finite too, and its optimizer skipped the step "
            f"(its parameters as they were); the candidate's step applied them: NaN or infinity, first in {shown}"
            f"{_in_all(len(bad))}. Skip the update where the gradients are not finite, as the reference "
            "does (optax.apply_if_finite around the optimizer, or the loss-scale check of its step).",
            bad[0].name,
        )
    return Diagnosis(
        "non_finite",
        f"{head}: NaN or infinity, first in {shown}{_in_all(len(bad))}. The candidate's step computes a "
        "NaN or an infinity the reference's step does not (a log, a division or a square root of 0, an "
        "overflow in a lower precision, a softmax over a fully masked row, an uninitialized buffer); rerun the "
        "candidate's step with jax.config.update('jax_debug_nans', True) to stop at the operation that makes it.",
        bad[0].name,
    )


def replicas_differ(ctx: DiagnosisContext) -> Finding:
    """``replicas_differ``: the first step after which a replicated leaf differs across devices."""
    r = next((r for r in ctx.records if r.replica_mismatches), None)
    if r is None:
        return None
    leaf = replicas_root(r)[0]
    if all(name.startswith("state ") for name in r.replica_mismatches):  # the model's state alone
        return Diagnosis(
            "replicas_differ",
            f"Replicas differ across devices: the model's state {leaf.removeprefix('state ')} holds different "
            f"values on different devices after step {r.step} ({n_leaves(len(r.replica_mismatches))}), though its "
            "sharding says replicated, while every parameter's and optimizer-state leaf's copies agree: the step "
            "writes it from each device's own rows or values (a statistic or moving average of the batch not "
            "reduced over the batch axes: pmean it before writing; an average of the parameters, such as an EMA, "
            "taken of each device's own copies before they were synchronized) or on some devices only.",
            leaf,
        )
    return Diagnosis(
        "replicas_differ",
        f"Replicas differ across devices: {leaf} holds different values on different devices after "
        f"step {r.step} ({n_leaves(len(r.replica_mismatches))}), though its sharding replicates it"
        f"{along(r.replica_axes)}; "
        "a gradient or update was not all-reduced (missing psum/pmean, or shard_map with "
        "check_vma=False and out_specs=P()), or was scaled after its all-reduce by a quantity of each shard's own "
        "(a local count or norm), or the leaf was written on some devices only (an initialization or an in-place "
        "write done per device, such as a value set on one shard).",
        leaf,
    )


def _local_weights(r: StepRecord) -> tuple[float, ...] | None:
    """The shards' own loss weights (``StepRecord.shard_weights``) where the copies' constants
    (``StepRecord.replica_scales``) are their inverse ratios (``a_d = w_0 / w_d``, within 1e-4): each device divided
    the all-reduced gradient by its own shard's weight; ``None`` otherwise."""
    scales, weights = r.replica_scales, r.shard_weights
    if scales is None or weights is None or len(weights) != len(scales) or not all(w > 0 for w in weights):
        return None
    predicted = [weights[0] / w for w in weights]
    fits = all(abs(a - p) <= 1e-4 * abs(p) for a, p in zip(scales, predicted, strict=True))
    return weights if fits else None


def local_normalization(ctx: DiagnosisContext) -> Finding:
    """``local_normalization``: the returned gradients' copies differ across devices by one constant per device,
    the same on every leaf (``StepRecord.replica_scales``): the gradients were all-reduced, then scaled by a
    quantity of each device's own, a local count or norm (issue #36: ``psum(g) / local_count`` read "not reduced
    over 'fsdp'", its fix already in the step). Where the constants are the inverse ratios of the shards' own loss
    weights, said with those numbers, and the gradient factor as the global weight over shard 0's own."""
    r = next((r for r in ctx.records if r.replica_mismatches), None)
    if r is None or r.replica_scales is None:
        return None
    scales = ", ".join(f"x{a:.4g}" for a in r.replica_scales)
    axes = tuple((ctx.mesh_shape or {}).keys())
    psum_axes = repr(axes[0]) if len(axes) == 1 else repr(axes) if axes else "the batch axes"
    weights = _local_weights(r)
    head = (
        f"After step {r.step} every device's copy of the returned gradients is one same gradient times a constant "
        f"of its own: the copies differ{along(r.replica_axes)} and are exactly proportional on every leaf ({scales} "
        "of the first device's, device by device)"
    )
    if weights is not None:
        total = sum(weights)
        said = ", ".join(f"{w:g}" for w in weights)
        why = (
            f", the ratios of 1 over the shards' own loss weights ({said}; the batch's weight {total:g}): the "
            "gradients were "
            "all-reduced, then each device divided them by its own shard's weight (a local count, such as the "
            "shard's jnp.sum(mask)) where the global one was due"
        )
        f = ctx.factor
        own = next(
            (d for d, w in enumerate(weights) if f is not None and abs(f - total / w) <= RATIO_RTOL * f), None
        )
        if own is not None:
            why += (
                f". The returned gradients are x{f:.4g} = {total:g}/{weights[own]:g}: the global weight over shard "
                f"{own}'s own"
            )
    else:
        why = (
            ": the gradients were all-reduced, then scaled by a quantity of each device's own (a local count, "
            "weight or norm) where a global one was due"
            + (
                f" (not 1 over the shards' own loss weights, {', '.join(f'{w:g}' for w in r.shard_weights)})"
                if r.shard_weights is not None
                else ""
            )
        )
    return Diagnosis(
        "local_normalization",
        f"{head}{why}. Their reduction is not what differs: a reduction that missed an axis leaves partial sums, "
        "which no constant maps onto each other. Divide by the global quantity: psum the count or weight over "
        f"{psum_axes} (jax.lax.psum(count, {psum_axes})) and divide the all-reduced gradients by that.",
        ctx.worst_name or r.replica_mismatches[0],
    )


def wrong_axis_reduction(ctx: DiagnosisContext) -> Finding:
    """``wrong_axis_reduction``: replicas differ along some mesh axes and agree along the others (never where
    the returned gradients' copies are one gradient times a constant per device: :func:`local_normalization`)."""
    r = next((r for r in ctx.records if r.replica_mismatches and r.replica_axes), None)
    axes = tuple((ctx.mesh_shape or {}).keys())
    if r is None or len(axes) < 2 or set(r.replica_axes) >= set(axes) or r.replica_scales is not None:
        return None
    grads = [e for e in r.leaves if e.kind == "grad"]
    after = bool(grads) and all(e.ok for e in r.leaves if e.kind in ("loss", "grad"))
    unreduced, own, downstream = replicas_by_gradient(r)
    leaves = own + downstream
    return Diagnosis(
        "wrong_axis_reduction",
        missed_axes_message(r.step, leaves, r.replica_axes, ctx.mesh_shape, after, unreduced, ctx.facts),
        leaves[0],
    )


def replicated_reduced(ctx: DiagnosisContext) -> Finding:
    """``replicated_reduced``: some leaves' gradient factor is a replica count while the others match."""
    if ctx.first is None or ctx.factor is not None or not ctx.update_kinds:
        return None
    if not all(constant_ratio(e) for e in ctx.bad):
        return None
    factors = leaf_factors(ctx.first.leaves, ctx.first.unresolved)
    right = [p for p, f in factors.items() if _close(f, 1.0)]
    for r in replica_counts(ctx.num_shards, ctx.mesh_shape):
        off = sorted(p for p, f in factors.items() if _close(f, r))
        if off and right and len(off) + len(right) == len(factors):
            expert = any(is_expert_axis(a) for a in model_axes_of_size(ctx.mesh_shape, r))
            return Diagnosis(
                "expert_scaling" if expert else "replicated_reduced",
                replicated_reduced_message(ctx.first.step, off, len(right), r, ctx.mesh_shape),
                f"param {off[0]}",
            )
    return None


def _of_model(e: LeafError) -> bool:
    """A leaf of the model's non-parameter state (``parity.model_state``: path ``model.<path>``)."""
    return e.kind == "counter" and e.path.startswith("model.")


def model_state(ctx: DiagnosisContext) -> Finding:
    """``model_state``: an integer leaf of the model's own state (an ``nnx.Variable`` counter its forward pass
    writes) is not the single-device step's; one the task's loss neither reads nor writes (:func:`step_written`:
    a target network's sync count) is said as the step's own (:func:`_step_counter`)."""
    found = next(((r, e) for r in ctx.records for e in r.leaves if _of_model(e) and not e.ok), None)
    if found is None:
        return None
    record, fail = found
    if step_written(record, fail):
        return _step_counter(fail)
    path = fail.path.removeprefix("model.")
    head = (
        f"The model's state {path} (not a parameter: an nnx.Variable its forward pass writes) differs from the "
        f"single-device step's after {fail.step + 1} step(s) (max abs err {fail.max_abs_err:.6g})"
    )
    why = _count_reading(
        fail,
        times=": it is {k} times the reference's. The step runs the forward pass {k} times a step (an extra "
        "forward pass, such as a logging or evaluation one, or one per shard or micro-batch, writes it again); "
        "write it once per step.",
        left=": the step left it as it was: the forward pass's writes were dropped or undone (jax.grad of a "
        "function of nnx.split parts discards them, so return and nnx.update them or use nnx.value_and_grad; "
        "or the step resets it).",
        other="; the step must write it as one forward pass over the full batch does.",
    )
    return Diagnosis("model_state", head + why, fail.name)


def _count_reading(fail: LeafError, times: str, left: str, other: str) -> str:
    """What an integer state leaf's ratio to the reference's says: ``times`` (formatted with ``k``) where it is an
    integer ``k >= 2``, ``left`` where it is 0 (left as it was), ``other`` otherwise."""
    if fail.ratio is not None and fail.ratio >= 2 and abs(fail.ratio - round(fail.ratio)) < 1e-9:
        return times.format(k=round(fail.ratio))
    return left if fail.ratio == 0 else other


def _step_counter(fail: LeafError) -> Diagnosis:
    """``model_state`` of a counter the step advances itself, outside its forward pass (the task's loss neither
    reads nor writes it: a step count kept for a target network's sync; trial 39: a count advanced twice a step
    read "The step runs the forward pass 2 times a step")."""
    path = fail.path.removeprefix("model.")
    head = (
        f"The model's state {path} (not a parameter: an nnx.Variable counter the step advances itself; the task's "
        f"loss neither reads nor writes it) differs from the reference's step's after {fail.step + 1} step(s) "
        f"(max abs err {fail.max_abs_err:.6g})"
    )
    why = _count_reading(
        fail,
        times=": it is {k} times the reference's. The step advances it {k} times a step (an increment of {k}, or "
        "one made twice), not its forward pass; advance it once per step, as the reference's step does.",
        left=": the step left it as it was (its increment dropped, or undone); advance it as the reference's does.",
        other="; the step must advance it as the reference's step does.",
    )
    return Diagnosis("model_state", head + why, fail.name)


def frozen_state(ctx: DiagnosisContext) -> Finding:
    """``frozen_state``: floating model state that is not a parameter (``state model.<path>``,
    :mod:`shardcheck.parity.comparison.model_state`) moved where the reference's step leaves it as it was and
    the loss reads it (a weight meant to stay frozen, trained); ``state_step`` where the reference's step writes
    it at other steps of the run (:func:`_state_step`: a copy or sync made at another step); ``model_state``
    where the reference's step writes it and the candidate's left it exactly as it was (``ratio`` 0); ``state_partial`` where it left part of it
    so and wrote the rest as the reference does (``LeafError.kept``); ``state_amount`` where both steps write it
    and the changes differ by more than the coarse bound."""
    # the first failing step only: after a step that failed elsewhere (an lr x4), the running statistics of the
    # parameters it moved differ by more than rounding, a consequence and no cause
    record = ctx.first
    bad = [] if record is None else [e for e in record.leaves if e.kind == "state" and not e.ok]
    if not bad:
        return None
    trained = [e for e in bad if e.reference_change == 0]
    dropped = [e for e in bad if e.reference_change and e.ratio == 0]
    partial = [e for e in bad if e.reference_change and e.ratio != 0 and e.kept]
    amounts = [e for e in bad if e.reference_change and e.ratio != 0 and not e.kept]
    dropped, amounts = _left_within_rounding(record, dropped, amounts)
    out = []
    written = _reference_writes(ctx.records, {e.path for e in trained})
    elsewhere = [e for e in trained if written.get(e.path)]
    trained = [e for e in trained if not written.get(e.path)]
    if elsewhere:
        out.append(_state_step(record.step, elsewhere, written))
    schedule = sync_schedule(ctx.records, {e.path for e in trained}) if trained else None
    if schedule:
        out.append(_target_sync(trained, *schedule))
    elif trained:
        names = words_and(sorted(e.path.removeprefix("model.") for e in trained))
        worst = max(e.max_abs_err for e in trained)
        one = len(trained) == 1
        out.append(
            Diagnosis(
                "frozen_state",
                f"The candidate's step changed the model's state {names} at step {record.step} (max abs err "
                f"{worst:.6g}), which the reference's step leaves as it was and the loss reads: "
                f"{'it is' if one else 'they are'} not an nnx.Param (a Variable class of the model's own), and the "
                "task's optimizer updates wrt=nnx.Param only. A weight meant to stay frozen was trained: the step "
                "differentiates or updates more than the nnx.Param leaves (an argnums=nnx.DiffState(0, "
                "nnx.Any(nnx.Param, ...)) filter, an nnx.Optimizer with wrt=nnx.Variable, or an update written by "
                f"hand). Update nnx.Param only; a weight meant to train is an nnx.Param.{_own_count(ctx, one)}",
                trained[0].name,
            )
        )
    if dropped:
        out.append(_state_dropped(record, dropped))
    if partial:
        out.append(_state_partial(record.step, partial))
    if amounts:
        by_step = all(step_written(record, e) for e in amounts)
        out.append(_state_factor(record.step, amounts, ctx) or _state_amount(record.step, amounts, by_step))
    return out


def _reference_writes(records: Sequence[StepRecord], paths: set[str]) -> dict[str, list[int]]:
    """``{path: [step, ...]}``: the steps of ``records`` at which the reference's step wrote each of ``paths``
    (floating model state, ``state model.<path>``: a leaf compared on its change, ``reference_change`` > 0)."""
    out: dict[str, list[int]] = {}
    for r in records:
        for e in r.leaves:
            if e.kind == "state" and e.path in paths and e.reference_change:
                out.setdefault(e.path, []).append(r.step)
    return {p: sorted(set(steps)) for p, steps in out.items()}


def _steps_said(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {words_and([str(t) for t in steps])}"


def _state_step(step: int, leaves: list[LeafError], written: dict[str, list[int]]) -> Diagnosis:
    """``state_step``: floating state the candidate's step wrote at a step where the reference's step left it as
    it was, while the reference's step writes it at other steps of the run (``written``: the steps, by path): a
    copy or sync made on another schedule (a target network's), not a frozen weight trained (trial 39: a sync at
    every step, or one off by one, read "A weight meant to stay frozen was trained ... Update nnx.Param only")."""
    names = sorted(e.path.removeprefix("model.") for e in leaves)
    schedules = {tuple(written[e.path]) for e in leaves}
    one = len(leaves) == 1
    if len(schedules) == 1:
        when = f"{'it writes it' if one else 'it writes them'} at {_steps_said(written[leaves[0].path])}"
    else:
        when = "it writes " + words_and(
            [f"{e.path.removeprefix('model.')} at {_steps_said(written[e.path])}" for e in leaves]
        )
    worst = max(e.max_abs_err for e in leaves)
    return Diagnosis(
        "state_step",
        f"The candidate's step wrote the model's state {words_and(names)} at step {step} (max abs err {worst:.6g}), "
        f"where the reference's step left {'it as it was' if one else 'them as they were'} ({when}): a copy or "
        "sync at another step than the reference's, not a weight trained (a sync period or step count off by "
        "one, a count read before or after its increment, or a sync at every step). Write "
        f"{'it' if one else 'them'} at the steps the reference's step does.",
        leaves[0].name,
    )


def _target_sync(
    leaves: list[LeafError], written: list[int], left: list[int], counters: list[str]
) -> Diagnosis:
    """``target_sync``: floating state the reference's step never writes, which the candidate's step wrote at
    some steps (``written``) from values of a parameter's shape and left at the others (``left``), on the schedule
    of a counter only it keeps (``counters``): a target network's sync, which a reference step that never makes it
    cannot check (trial 39: without --reference the sync led with "a weight meant to stay frozen was trained")."""
    names = words_and(sorted(e.path.removeprefix("model.") for e in leaves))
    one = len(leaves) == 1
    it = "it" if one else "them"
    worst = max(e.max_abs_err for e in leaves)
    return Diagnosis(
        "target_sync",
        f"The candidate's step wrote the model's state {names} at {_steps_said(written)} (max abs err "
        f"{worst:.6g}) and left {it} as {'it was' if one else 'they were'} at {_steps_said(left)}, on the schedule "
        f"of a counter only it keeps ({words_and(counters)}, not compared), from values of a parameter's shape: a "
        f"target network's copy synced from the parameters. The reference's step does not write {it} (it makes no "
        "sync), so this run cannot tell a correct sync from a wrong one: pass your own reference step that makes "
        "the sync (verify --reference FILE:FUNCTION, check_parity(reference=...)) to check it. If "
        f"{'it is a weight' if one else 'they are weights'} meant to stay frozen instead, the step trained "
        f"{it}: update nnx.Param only.",
        leaves[0].name,
    )


def _own_count(ctx: DiagnosisContext, one: bool) -> str:
    """Where the run holds a counter only the candidate's step writes (``counter model.<path>`` not compared:
    tolerance inf), the other reading of a frozen weight moved: state the step copies on that count's schedule
    (a target network's sync) that the reference's step never makes; else ``""``."""
    counters = sorted(
        {e.path for r in ctx.records for e in r.leaves if e.kind == "counter" and math.isinf(e.tolerance)}
    )
    if not counters:
        return ""
    return (
        f" Or, since the candidate's step keeps a counter the reference's step does not write ({words_and(counters)},"
        f" not compared): if {'it is' if one else 'they are'} state the step copies or syncs on that count's "
        "schedule (a target network's copy of the weights), the reference's step never does so: pass a reference "
        "step that does (verify --reference FILE:FUNCTION, check_parity(reference=...))."
    )


# the most a step-written state leaf may move, over the reference's change, to read as left as it was up to rounding
LEFT_RATIO = 1e-3


def _left_within_rounding(
    record: StepRecord, dropped: list[LeafError], amounts: list[LeafError]
) -> tuple[list[LeafError], list[LeafError]]:
    """``(dropped, amounts)`` with the state leaves the step writes after its forward pass (:func:`step_written`:
    an EMA of the parameters) that the candidate's step moved by at most :data:`LEFT_RATIO` of the reference's
    change moved from ``amounts`` to ``dropped``, where every leaf of both lists is so written: an average taken
    from the parameters before the optimizer's update, equal to it at that step, gives back its value up to a few
    ulps (``d e + (1 - d) e``), and some leaves land exactly, others not (trial 37: one finding of the leaves left
    exactly and another of the same EMA's leaves "by other amounts", 1.47e-05 times the reference's change)."""
    near = [e for e in amounts if e.ratio is not None and abs(e.ratio) <= LEFT_RATIO]
    if not near or not all(step_written(record, e) for e in [*dropped, *amounts]):
        return dropped, amounts
    return [*dropped, *near], [e for e in amounts if e not in near]


def _state_dropped(record: StepRecord, dropped: list[LeafError]) -> Diagnosis:
    """``model_state``: floating state the reference's step writes, left exactly as it was by the candidate's.
    Where the forward pass writes it (or that is not known), its writes were dropped (jax.grad of nnx.split
    parts); where the task's loss writes none of it (:func:`step_written`: an EMA the step keeps after its
    update), the step's own write of it was dropped or wrote the value it held (trial 37: an EMA updated from the
    parameters before the optimizer's update, equal to them at step 0, read with the forward pass's advice)."""
    names = words_and(sorted(e.path.removeprefix("model.") for e in dropped))
    head = f"The candidate's step left the model's state {names} (not a parameter: floating state the reference's step writes"
    moved = [e for e in dropped if e.ratio]  # moved by rounding only (_left_within_rounding)
    if moved and all(step_written(record, e) for e in dropped):
        worst = max(moved, key=lambda e: abs(e.ratio) * e.reference_change)
        return Diagnosis(
            "model_state",
            f"{head}, after its forward pass: the task's loss does not write it) as it was at step {record.step}, "
            f"{len(dropped) - len(moved)} of {len(dropped)} leaves exactly and the others within rounding (their "
            f"largest change {abs(worst.ratio) * worst.reference_change:.3g}, {abs(worst.ratio):.3g} times the "
            f"reference's {worst.reference_change:.3g}, {worst.path.removeprefix('model.')}): written from the "
            "parameters before the update (an average of the parameters taken before the optimizer's update, at a "
            "step where it still equals them, gives back its value up to rounding), or the step's own write of it "
            "was dropped; write it where the reference's step does (for an average of the parameters, from their "
            "values after the update).",
            dropped[0].name,
        )
    if all(step_written(record, e) for e in dropped):
        return Diagnosis(
            "model_state",
            f"{head}, after its forward pass: the task's loss does not write it) exactly as it was at step "
            f"{record.step}: the step's own write of it was dropped, or wrote the value it held (an average of the "
            "parameters taken before the optimizer's update, at a step where it still equals them); write it where "
            "the reference's step does (for an average of the parameters, from their values after the update).",
            dropped[0].name,
        )
    return Diagnosis(
        "model_state",
        f"{head}) exactly as it was at step {record.step}: the step's writes were dropped (jax.grad of a function of "
        "nnx.split parts discards the forward pass's writes: return and nnx.update them, or use "
        "nnx.value_and_grad).",
        dropped[0].name,
    )


def _state_partial(step: int, partial: list[LeafError]) -> Diagnosis:
    """``state_partial``: floating state both steps write, part of it (``LeafError.kept``) left exactly as it
    was by the candidate's step while the rest matches: a write that covers part of the leaf only."""
    from shardcheck.parity.comparison.partial_write import MATCH_RTOL, SAMPLED, said

    parts = words_and([said(e.path.removeprefix("model."), e.kept) for e in partial])
    others = "recorded samples" if all(e.kept[2] == SAMPLED for e in partial) else "elements"
    return Diagnosis(
        "state_partial",
        f"The candidate's step left {parts} (not a parameter: floating state the reference's step writes) exactly "
        f"as they were at step {step}, where the reference's step changed them; it wrote the other {others} as "
        f"the reference did (within {MATCH_RTOL:g} of the reference's largest change). A write that covers part "
        "of the leaf only: one shard's rows written back and the others' dropped (a jnp.where that keeps the old "
        "rows, or a write of one device's local block); write the whole leaf as one forward pass over the full "
        "batch does.",
        partial[0].name,
    )


def axes_of_size(k: int, mesh_shape: Mapping[str, int] | None, num_shards: int | None) -> str:
    """``"the size of 'data'"`` (or ``"the size of 'data' x 'fsdp'"``, ``"S, the shard count"``) where ``k`` is
    a mesh axis's size (or the product of some), else ``""``."""
    axes = [(a, n) for a, n in (mesh_shape or {}).items() if n > 1]
    for a, n in axes:
        if n == k:
            return f"the size of '{a}'"
    for i, (a, n) in enumerate(axes):
        for b, m in axes[i + 1 :]:
            if n * m == k:
                return f"the size of '{a}' x '{b}'"
    return "S, the shard count" if num_shards == k else ""


def _state_factor(step: int, amounts: list[LeafError], ctx: DiagnosisContext) -> Diagnosis | None:
    """``state_amount``, said as a factor: floating state both steps write that the candidate's step wrote as
    exactly k times the reference's written value at every element (``LeafError.value_factor``), k a mesh axis's
    size: a psum of a replicated value where a pmean or no reduction was meant (trial 39: a target network synced
    from the psum of the replicas, x4 on data=4, read "by 4 to 1.05e+03 times the reference's change ... a
    running-average momentum"); ``None`` where no such k holds."""
    k = written_factor(amounts)
    size = axes_of_size(k, ctx.mesh_shape, ctx.num_shards) if k else ""
    if not size:
        return None
    names = words_and(sorted(e.path.removeprefix("model.") for e in amounts))
    one = len(amounts) == 1
    return Diagnosis(
        "state_amount",
        f"The candidate's step wrote the model's state {names} at step {step} as exactly {k} times the value the "
        f"reference's step wrote, {factor_read(ctx.first.replayed)} (written x{k} = {size}): a psum where a pmean "
        f"or no reduction was meant ({'it is' if one else 'they are'} replicated, so summing the devices' copies multiplies "
        f"{'it' if one else 'them'} by their count). Write the value as it is (or pmean it).",
        max(amounts, key=lambda e: e.max_abs_err).name,
    )


def _state_amount(step: int, amounts: list[LeafError], by_step: bool = False) -> Diagnosis:
    """``state_amount``: floating state both steps write (a running average), changed by other amounts;
    ``by_step``: state the task's loss does not write (:func:`step_written`: an EMA of the parameters the step
    keeps after its update), said as the step's write, not a forward pass's statistic."""
    names = words_and(sorted(e.path.removeprefix("model.") for e in amounts))
    worst = max(amounts, key=lambda e: e.max_abs_err)  # the leaf changes_differ names
    ratio = "" if worst.ratio is None else f" (its largest change {worst.ratio:.3g} times the reference's)"
    what = "such as BatchNorm's running averages"
    causes = (
        "A running-average momentum differs (0.99 in place of 0.9), or the statistic is computed another way (each "
        "shard's own batch statistics, not synced over the batch axes); or, for state kept per row of the batch "
        "(a carried hidden state), rows written from other rows (one shard's rows written to every shard) or "
        "from another step's values."
    )
    if by_step:
        what = "written by the step after its forward pass, which does not write it, such as an EMA of the parameters"
        causes = (
            "An average's decay differs (d and 1 - d swapped, or 0.99 in place of 0.9), or it was written from "
            "other values (the parameters before the optimizer's update, or one device's copies)."
        )
    return Diagnosis(
        "state_amount",
        f"The candidate's step wrote the model's state {names} (not a parameter: floating state both steps write, "
        f"{what}) by other amounts at step {step}{ratio}: {changes_differ(amounts)} (no rounding tolerance is "
        f"derived for such state, so only a difference no rounding makes is flagged). {causes}",
        worst.name,
    )


def step_counter(ctx: DiagnosisContext) -> Finding:
    """``never_stepped`` (counter 0) or ``step_counter`` (a multiple of, or otherwise not, the step count)."""
    fail = ctx.counter_fail
    if fail is None:
        return None
    accumulates = every_k_differs(ctx.records)  # MultiSteps' every_k_schedule: its counters, read per step
    if accumulates is not None:
        return Diagnosis("step_counter", accumulates, fail.name)
    expected, got = _counts(ctx, fail)
    steps = fail.step + 1  # the counters were read after step fail.step
    per_step = expected == steps  # the reference's counter counts the steps (else another rate: say both)
    if got == 0:
        return Diagnosis(
            "never_stepped",
            f"The optimizer was never stepped: its counter is 0 after {fail.step + 1} step(s) "
            "(an update that was skipped or swallowed, e.g. the old one-argument optimizer.update(grads); "
            "docs/reduction_cases.md C8).",
            fail.name,
        )
    alone = _counter_alone(ctx, fail)
    if alone is not None:
        return Diagnosis("step_counter", alone, fail.name)
    if per_step and got % expected == 0 and got // expected == ctx.micro_batches:
        k = got // expected
        return Diagnosis(
            "step_counter",
            f"The optimizer was stepped per micro-batch (k = {k}): {_counter_phrase(fail)} is {got} after "
            f"{steps} step(s), {k} times the reference's (the inner optimizer updated on every micro-batch, as "
            "optax.chain(tx, optax.apply_every(k)) does: its moments, count and schedule advance k times per "
            "step). Accumulate the gradients and apply tx once per batch: optax.MultiSteps(tx, "
            "every_k_schedule=k).",
            fail.name,
        )
    if per_step and got % expected == 0:
        k = got // expected
        where = (
            f"once per shard (S={ctx.num_shards}) instead of once after the reduction, or once per micro-batch of a "
            f"{k}-micro-batch accumulation loop instead of once on the accumulated gradient (optax.MultiSteps "
            "applies it once)"
            if k == ctx.num_shards  # trial 53: 2 micro-batches on S = 2 read "once per shard" alone
            else f"{k} times a step: once per micro-batch of an accumulation loop, or per shard of a group of {k}, "
            "instead of once on the accumulated, reduced gradient (optax.MultiSteps applies it once)"
        )
        return Diagnosis(
            "step_counter",
            f"The optimizer was stepped {k} times per step: {_counter_phrase(fail)} is {got} after {steps} "
            f"step(s) (optimizer.update called {where}).",
            fail.name,
        )
    must = "it must equal the number of steps" if per_step else "it must equal the reference's"
    return Diagnosis(
        "step_counter",
        f"The optimizer's {'step counter' if fail.path == 'step' else f'counter {fail.path}'} is {got} after "
        f"{steps} step(s){_reference_count(expected, steps)}; {must}.",
        fail.name,
    )


def _reference_count(expected: int, steps: int) -> str:
    """``" (the reference's is 1)"`` where the reference's counter is not the number of steps, else ``""``."""
    return "" if expected == steps else f" (the reference's is {expected})"


def _counter_alone(ctx: DiagnosisContext, fail: LeafError) -> str | None:
    """Where an optimizer-state counter (not the step counter) is ahead while the update's own state says one
    update was applied (the step counter matches, and every floating optimizer-state leaf of that step matches:
    a second update would move the moments), that in words: the counter advanced apart from the update, a
    schedule read one step ahead (trial 23: a cosine schedule's count +1 read "stepped 2 times per step", beside
    Adam's matching moments and an update 0.8536 x the reference's, lr(1)/lr(0)); or, where that counter is
    Adam's own (:func:`_adam_moments`: its state holds ``mu`` and ``nu`` beside it), its bias-correction count
    advanced apart from the moments (trial 40: ``opt_state[0].count`` bumped once more a step read "a schedule
    read one step ahead ... the learning rate it gives is the next step's" while the schedule's ``2.count`` was
    right and the learning rate unchanged); else ``None``."""
    if fail.path == "step" or fail.dtypes is not None:  # a converted counter: its dtype, not its count
        return None
    record = next((r for r in ctx.records if r.step == fail.step and not r.synchronized), None)
    if record is None:
        return None
    state = [e for e in record.leaves if e.kind == "opt_state"]
    step = [e for e in record.leaves if e.kind == "counter" and e.path == "step"]
    if not state or not all(e.ok for e in state) or not all(e.ok for e in step):
        return None
    expected, got = _counts(ctx, fail)
    matching = sorted(e.path for e in record.leaves if e.kind == "counter" and e.ok and not _of_model(e))
    others = (
        f" while {words_and(matching)} {'matches' if len(matching) == 1 else 'match'}" if matching else ""
    )
    steps = fail.step + 1
    head = (
        f"The optimizer's counter {fail.path} is {got} after {steps} step(s){_reference_count(expected, steps)}"
        f"{others}, and every optimizer-state "
        "leaf of that step matches: one update was applied (a second would move the moments too), and that "
        "counter advanced apart from it: "
    )
    moments = _adam_moments(ctx, fail.path)
    both = _counts_of_both_kinds(ctx, record, fail)  # trial 41: Adam's counts and the schedules' both ahead
    if both is not None:
        return both
    if moments is not None:
        return head + (
            f"it is Adam's bias-correction count (the count beside {words_and(list(moments))}: optax's "
            "ScaleByAdamState), no schedule's: it sets no learning rate, but the update divides the moments by "
            "1 - b1^count and 1 - b2^count, so its bias correction is another step's (a step of the "
            "moments counted twice: the Adam state's count advanced again by hand, or per micro-batch while the "
            "moments took one step). Advance it only through optimizer.update, once per step."
        )
    momentum = _moment_count(ctx, fail.path)
    if momentum is not None:
        return head + (
            f"it is a momentum's bias-correction count (the count beside {momentum[0]} and no second moment, as "
            "optax.contrib's MuonState), no schedule's: it sets no learning rate, but the update divides the "
            "momentum by 1 - beta^count, so its bias correction is another step's. Advance it only through "
            "optimizer.update, once per step."
        )
    return head + (
        "a schedule read one step ahead (its count incremented before the update, or a schedule's state of its "
        "own stepped twice); the learning rate it gives is the next step's."
    )


def _counts_of_both_kinds(ctx: DiagnosisContext, record: StepRecord, fail: LeafError) -> str | None:
    """Where the failing optimizer-state counters of ``fail``'s step (every optimizer-state leaf matching) are of
    both kinds, bias-correction counts (:func:`_moment_count`: beside moments) and schedules' counts (beside
    none), what each kind drives, in words (trial 41: every count of a multi_transform(muon | adamw) bumped once
    more a step named only the worst, Adam's ``inner_states.adam.inner_state.0.count``, "no schedule's: it sets
    no learning rate", while its schedules' ``...inner_state.2.count`` and ``...3.count`` were ahead too, so the
    learning rate was the next step's as well); ``None`` where the failing counters are all of one kind."""
    failing = [
        e for e in record.leaves if e.kind == "counter" and not e.ok and e.path != "step" and not _of_model(e)
    ]
    moment = [(e, _moment_count(ctx, e.path)) for e in failing]
    bias = [(e, m) for e, m in moment if m is not None]
    schedule = [e for e, m in moment if m is None]
    if not bias or not schedule:
        return None
    counts = [_counts(ctx, e) for e in failing]
    ahead = {got - expected for expected, got in counts}
    steps = fail.step + 1
    if len(ahead) == 1 and len({expected for expected, _ in counts}) == 1:
        expected, got = counts[0]
        value = f"each {got} after {steps} step(s){_reference_count(expected, steps)}"
    else:
        value = "; ".join(
            f"{e.path} {got} ({expected})" for e, (expected, got) in zip(failing, counts, strict=True)
        )
        value = f"after {steps} step(s) (candidate's (reference's)): {value}"
    adam = [e.path for e, m in bias if len(m) == 2]
    momentum = [(e.path, m[0]) for e, m in bias if len(m) == 1]
    kinds = []
    if adam:
        kinds.append(
            f"{words_and(adam)} {'is' if len(adam) == 1 else 'are'} Adam's bias-correction "
            f"count{'s' if len(adam) > 1 else ''} (beside the moments mu and nu: optax's ScaleByAdamState: the "
            "update divides the moments by 1 - b1^count and 1 - b2^count)"
        )
    if momentum:
        paths = [path for path, _ in momentum]
        kinds.append(
            f"{words_and(paths)} {'is' if len(paths) == 1 else 'are'} the bias-correction "
            f"count{'s' if len(paths) > 1 else ''} of a momentum alone (beside mu and no nu, as optax.contrib's "
            "MuonState: the update divides the momentum by 1 - beta^count)"
        )
    kinds.append(
        f"{words_and([e.path for e in schedule])} {'is a count' if len(schedule) == 1 else 'are counts'} beside "
        "no moments: a schedule's (as ScaleByScheduleState's: the learning rate is the schedule's value at that "
        "count), or a state's over no parameters (an empty group of a multi_transform: it drives nothing)"
    )
    return (
        f"{len(failing)} of the optimizer's counters are {value}, while every optimizer-state "
        "leaf of that step matches: one update was applied (a second would move the moments too), and those "
        f"counters advanced apart from it, of {('two', 'three')[len(kinds) - 2]} kinds: {'; '.join(kinds)}. So "
        "the moments' bias correction and the schedules' learning rate are both another step's (every count of "
        "the optimizer advanced again by hand, or per micro-batch while the moments took one step). Advance them "
        "only through optimizer.update, once per step."
    )


def _adam_moments(ctx: DiagnosisContext, path: str) -> tuple[str, str] | None:
    """``("0.mu", "0.nu")`` where the optimizer-state counter at ``path`` (``"0.count"``, ``"count"``) is the
    ``count`` of an Adam-like state (optax's ``ScaleByAdamState``: ``count`` beside the moments ``mu`` and
    ``nu``, read from the recorded optimizer-state leaves' paths, e.g. ``0.mu.<param>``): the count that drives
    the bias correction only, never a learning rate. ``None`` for any other counter (a schedule's
    ``ScaleByScheduleState.count``, ``inject_hyperparams``' ``count``: siblings of no moments)."""
    moments = _moment_count(ctx, path)
    return moments if moments is not None and len(moments) == 2 else None


def _moment_count(ctx: DiagnosisContext, path: str) -> tuple[str, ...] | None:
    """The moments beside the optimizer-state counter at ``path``: ``("0.mu", "0.nu")`` for an Adam-like state
    (:func:`_adam_moments`), ``("0.mu",)`` for a momentum's alone (optax.contrib's ``MuonState``: ``count`` beside
    ``mu``, its bias correction), read from the recorded optimizer-state leaves' paths; ``None`` for a counter
    beside no moments (a schedule's)."""
    if path != "count" and not path.endswith(".count"):
        return None
    prefix = path[: -len("count")]
    state = {e.path for r in ctx.records for e in r.leaves if e.kind == "opt_state"}
    names = tuple(prefix + m for m in ("mu", "nu"))
    present = tuple(n for n in names if any(p == n or p.startswith(n + ".") for p in state))
    if not present or present[0] != names[0]:
        return None
    return present


# a leaf whose change is at most this fraction of the reference's did not move (its ratio reads as 0)
ZERO_RATIO = 1e-3


def scoped_gradients(first: StepRecord, evidence: str, factor: float) -> str:
    """``evidence`` ("gradients ...") scoped to the failing gradient leaves where some gradient leaves match that
    would have shown ``factor`` (:func:`would_show`: not rounding noise): ``"the gradients of experts.* (2 of 5
    gradient leaves; every other gradient matches)"``; ``evidence`` unchanged otherwise."""
    grads = [e for e in first.leaves if e.kind == "grad"]
    bad = [e.path for e in grads if not e.ok]
    resolved = [e for e in grads if e.ok and would_show(e, factor)]
    if not evidence.startswith("gradients") or not bad or not resolved:
        return evidence
    prefix = common_prefix(bad)
    good = [e.path for e in grads if e.ok]
    if prefix and not any(p == prefix or p.startswith(prefix + ".") for p in good):
        which = f"{prefix}.*"
    else:
        which = ", ".join(sorted(bad)[:4]) + (", ..." if len(bad) > 4 else "")
    return (
        f"the gradients of {which} ({len(bad)} of {len(grads)} gradient leaves; every other gradient matches)"
    )


def _factor_finding(ctx: DiagnosisContext, code: str, phrase: str | None) -> Diagnosis:
    hidden = ""
    if ctx.bad_kinds == {"grad"}:
        hidden = " The parameters and optimizer state match at this step all the same" + (
            ": an optimizer blind to the gradient's scale (global-norm clipping that binds) hides the factor in "
            "the update."
            if "scale_blind" in ctx.first.matches
            else "."
        )
    one = ctx.one_number
    if one is not None:
        return Diagnosis(
            code, f"At step {ctx.first.step}, {_one_number_said(ctx, one, phrase)}.{hidden}", ctx.worst_name
        )
    scoped = scoped_gradients(ctx.first, ctx.evidence, ctx.factor)
    if (
        code in ("summed", "averaged_twice") and scoped != ctx.evidence
    ):  # a subset: a reduction of it, or a scale
        phrase += (
            f"; or a scale applied to these gradients only (a per-module multiplier of {ctx.factor:.4g}, such as "
            "a LoRA alpha / rank applied twice, or a loss term only they reach): the factor alone does not tell "
            "the two apart"
        )
    return Diagnosis(
        code,
        f"At step {ctx.first.step}, {scoped} are {ctx.factor:.4g} x the reference's{_squared_said(ctx, scoped)}: "
        f"{phrase}.{hidden}",
        ctx.worst_name,
    )


def _squared_said(ctx: DiagnosisContext, scoped: str) -> str:
    """``" (its second moments 16 x: the square)"`` where the factor was read from optimizer moments of which the
    second (Adam's ``nu``) fail: they carry the factor's square, which "optimizer moments are 4 x" did not say
    (trial 50); ``""`` otherwise."""
    if scoped != "optimizer moments" or not any(
        e.kind == "opt_state" and _moment(e.path) == "second" for e in ctx.bad
    ):
        return ""
    return f" (its second moments {ctx.factor**2:.4g} x: the square)"


def _one_number_said(ctx: DiagnosisContext, one: LeafError, phrase: str | None) -> str:
    """One number's factor (:attr:`DiagnosisContext.one_number`): with the named reading ``phrase`` where the
    number is that factor within its tolerance (``"the gradient of logit_scale (one number, 0-D; ...) is 0.25 x
    the reference's, 1/4 within its tolerance: ..."``), else (``phrase`` None) said with the readings it allows
    and no factor claimed."""
    dims = "0-D" if not one.shape else f"shape {tuple(one.shape)}"
    peers = [e for e in ctx.first.leaves if e.kind == one.kind and e is not one]
    others = f"; every other {_KIND_NOUN[one.kind]} matches" if peers and all(e.ok for e in peers) else ""
    noun = {"grad": "the gradient of", "param": "the update of", "opt_state": "the change of"}[one.kind]
    what = one.name if one.kind == "opt_state" else one.path
    head = f"{noun} {what} (one number, {dims}{others}) is {ctx.factor:.4g} x the reference's"
    if phrase is not None:
        target = _named_value(ctx.factor)
        count = f"{target:g}" if target >= 1 else f"1/{round(1 / target)}"
        return f"{head}, {count} within its tolerance: {phrase}"
    return f"{head}, or equally differs from it by {one.max_abs_err:.3g} (an offset, or a term c*param): {ONE_NUMBER}"


_KIND_NOUN = {"grad": "gradient", "param": "parameter", "opt_state": "optimizer-state leaf"}


def shard_factor(ctx: DiagnosisContext) -> Finding:
    """``summed`` (x S or x S^2) or ``averaged_twice`` (x 1/S or x 1/S^2) at the first failing step (never where
    the factor reads as a count in place of the loss's weight: :func:`weight_count`)."""
    named = ctx.named_factor
    if named is None or _weight_reading(ctx) is not None:
        return None
    weighed = _weight_or_shard_factor(ctx, named)
    if weighed is not None:
        return weighed
    if named[0] == "averaged_twice" and ctx.first.replica_mismatches and ctx.factor < 1:
        named = ("unreduced", _unreduced_phrase(ctx))
    first = ctx.first
    s = ctx.num_shards
    loss_scaled = (
        first.loss and first.candidate_loss is not None and _close(first.candidate_loss / first.loss, s or 0)
    )
    if named[0] in ("summed", "averaged_twice"):  # the loss itself x f at equal parameters (issue #36)
        led = _loss_led(ctx)
        if led is not None:
            return led
    if named[0] == "summed" and s and _close(ctx.factor, s) and loss_scaled:  # the loss itself is S x
        named = (
            named[0],
            f"{named[1]}; the returned loss is {s} x the reference's too ({first.candidate_loss:.7g} vs "
            f"{first.loss:.7g}): the loss was divided by 1/{s} of the global divisor and the shards' results "
            "summed: each shard's loss over a local count or weight (its own rows, or a pmean of the weight where "
            "a psum was due) where the global one was due; psum the loss sum and its count or weight, then divide",
        )
    return _factor_finding(ctx, *named)


def _weight_or_shard_factor(ctx: DiagnosisContext, named: tuple[str, str]) -> Diagnosis | None:
    """``scaled`` where the gradient factor is at once the batch's total loss weight (or 1 over it) of a
    ``(loss_sum, weight)`` loss and a shard count's factor (``named``): both readings, the weight's first (trial
    37: 16 rows on data=4, the psum of the loss sums never divided by the weight 16, read "sum-reduced twice
    (x16 = 4^2)" as a fact); only the weight's where another step run from the reference's state, whose batch
    weighs otherwise, shows that weight's factor there. ``None`` where the factor is not the weight, or where such
    a step shows the shard count's factor again (:func:`shard_factor` names it)."""
    f, first = ctx.factor, ctx.first
    weight = weight_phrase(f, first.loss_weight)
    if weight is None:
        return None
    for r in _from_reference_state(ctx.records):
        if r is first or r.step == first.step or r.loss_weight == first.loss_weight:
            continue
        g = _step_factor(r)
        if g is None:
            continue
        by_weight, by_shards = weight_phrase(g, r.loss_weight) is not None, _close(g, f)
        if by_weight and not by_shards:
            return _factor_finding(
                ctx,
                "scaled",
                f"{weight}; at step {r.step} (run from the reference's state, its batch's weight {r.loss_weight:g}) "
                f"they are {g:.4g} x the reference's, that weight again, not a shard count's factor",
            )
        if by_shards and not by_weight:
            return None
    shards = named[1].removeprefix("the gradient ")
    phrase = f"either {weight}; or the gradient {shards}{cannot_tell(f, first.loss_weight)}"
    return _factor_finding(ctx, "scaled", phrase)


def _loss_led(ctx: DiagnosisContext) -> Diagnosis | None:
    """``scaled`` where the loss the step returned at equal parameters (step 0, or a step run from the
    reference's state) is the same factor f of the reference's as its gradients: the loss itself is scaled, its
    gradients with it, by one of two readings the factor alone does not tell apart: a factor in the step's own
    loss (a sum over f terms where their mean was meant), or one reduction of the loss and its gradients alike
    over f shards (a psum where a pmean was meant). A reduction of the gradients alone, which leaves the loss as
    it is, is not said (trial 42: an ensemble's 4 members' losses summed on data=4 read "the gradient reduction
    summed instead of averaged" as a fact, and on data=2 x model=2 "the gradient was sum-reduced twice" beside
    a loss 4 x the reference's; issue #36: a jit step whose loss was 2 x read "summed over 'data' or 'fsdp'
    once too often"). ``None`` where the loss matches, or differs by another factor."""
    first, f = ctx.first, ctx.factor
    if not (first.step == 0 or first.from_reference_state) or not first.loss or first.candidate_loss is None:
        return None
    ratio = first.candidate_loss / first.loss
    if not _close(ratio, f):
        return None
    k = round(f) if f >= 1 else round(1 / f)
    which = _axes_sized(k, ctx.mesh_shape or {}, ctx.num_shards)
    local = (
        f" (or each shard's loss over its local count or weight, the {k} shards' results summed: psum the loss "
        "sum and its count or weight, then divide)"
        if f >= 1 and ctx.num_shards == k
        else ""
    )
    term = (
        f"a factor of {k} in the step's own loss (a sum over {k} terms where their mean was meant, such as an "
        "ensemble's members or micro-batches; a term counted twice, another count or divisor, a loss scale not "
        "undone)"
        if f >= 1
        else f"a factor of 1/{k} in the step's own loss (a mean over {k} terms where their sum was meant, another "
        "count or divisor)"
    )
    collective = (
        f"the loss and its gradients alike psum-ed over {which} where a pmean was meant{local}"
        if f >= 1
        else f"the loss and its gradients alike averaged over {which} (or divided by {k}) where a sum was due"
    )
    return Diagnosis(
        "scaled",
        f"At step {first.step}{first.start_said} the loss the step returns at equal parameters is {ratio:.4g} x "
        f"the reference's ({first.candidate_loss:.7g} vs {first.loss:.7g}), and {ctx.evidence} are {f:.4g} x "
        f"too: the loss itself is scaled, its gradients with it: either {term}, or {collective}. The factor alone "
        "does not tell the two apart; a reduction of the gradients alone would leave the returned loss as it is.",
        ctx.worst_name,
    )


def _axes_sized(k: int, sizes: Mapping[str, int], num_shards: int | None) -> str:
    """The mesh axes whose size is ``k`` (``"'data'"``, ``"'data' or 'fsdp'"``), else two whose sizes multiply
    to ``k`` (``"'data' and 'model'"``), else ``"the k shards"`` where ``k`` is the shard count, else ``"the
    batch axes"``."""
    axes = [a for a, n in sizes.items() if n == k]
    if axes:
        return " or ".join(repr(a) for a in axes)
    big = [(a, n) for a, n in sizes.items() if n > 1]
    for i, (a, n) in enumerate(big):
        for b, m in big[i + 1 :]:
            if n * m == k:
                return f"{a!r} and {b!r}"
    return f"the {k} shards" if num_shards == k else "the batch axes"


def _unreduced_phrase(ctx: DiagnosisContext) -> str:
    """``unreduced``: a factor 1/S beside replicas that differ after the same step: the gradient was likely never all-reduced
    (each device's own shard sum over the global count: trial 11's LayerNorm gradient left out of the psum),
    the returned one averaged over the devices only on its way out; a mean taken twice leaves the replicas
    equal."""
    k = round(1 / ctx.factor)
    return (
        f"x1/{k}, and replicated leaves differ across devices{along(ctx.first.replica_axes)} after this step: each device likely applied "
        f"its own shard's share of the gradient (a sum over its own shard divided by the global count, never "
        f"all-reduced), and the returned gradient, the average of those {k} shares, is 1/{k} of the full "
        f"one; psum the gradients before dividing (a gradient averaged twice, the other reading of x1/{k}, "
        f"would leave the replicas equal)"
    )


def clip_coefficient(ctx: DiagnosisContext) -> Finding:
    """``clip_coefficient``: the exposed gradients match, the gradient the optimizer was given is x f on every
    leaf, f neither 1 nor a shard count's power: a clip coefficient from a norm that was not the global one.
    Where f is 1/sqrt(R) (a norm counted once per replica) or a power of S, the finding is ``clip_norm`` or
    ``summed`` / ``averaged_twice``, as when the factor shows in the gradients themselves."""
    f = ctx.applied_factor
    if f is None:
        return None
    named = _name_factor(f, ctx.num_shards, ctx.mesh_shape)
    step = ctx.first.step
    if named is not None:
        code, phrase = named
        return Diagnosis(
            code,
            f"At step {step} the exposed gradients match the reference's, but {ctx.applied_evidence} are "
            f"{f:.4g} x the reference's: the gradient the optimizer was given is not the one returned: {phrase}; "
            f"or another factor {f:.4g} applied to the gradients after they were returned (a learning rate "
            "folded into them, a loss scale not undone).",
            ctx.worst_name,
        )
    # no clip in the task's optimizer: no clip coefficient to blame (a replay reads the clip with its optimizer
    # rerun, replay.with_optimizer_rerun; without that rerun it is not known, and the clip's reading stands)
    known = not ctx.first.replayed or ctx.first.optimizer_rerun is not None
    if ctx.first.global_clip is None and known:
        return Diagnosis(
            "applied_scale", applied_scale_message(step, f, ctx.applied_evidence), ctx.worst_name
        )
    return Diagnosis(
        "clip_coefficient", clip_coefficient_message(step, f, ctx.applied_evidence), ctx.worst_name
    )


def applied_scale_message(step: int, f: float, evidence: str) -> str:
    """The ``applied_scale`` message: the exposed gradients match, the optimizer's gradient is x ``f`` on every
    leaf, and the task's optimizer holds no global-norm clip (trial 50: a gradient applied x2 read "the clipping
    coefficient differing from the global norm's by 2" of an optimizer with no clip)."""
    return (
        f"At step {step} the exposed gradients match the reference's, but {evidence} are {f:.4g} x the reference's "
        f"on every leaf: the optimizer was given the gradients {f:.4g} x, scaled after the ones returned (the "
        "task's optimizer holds no clip): a factor applied between the gradients and optimizer.update, such as a "
        "learning rate folded into them, a loss scale not undone, or a second reduction of the returned "
        "gradients. Give the optimizer the gradients the step returns."
    )


def clip_per_shard(ctx: DiagnosisContext) -> Finding:
    """``clip_per_shard``: the returned gradients are the mean of each shard's own gradient clipped to the task's
    ``optax.clip_by_global_norm`` norm (the harness's ``clip_per_shard`` hypothesis, rerun from the reference's
    pre-step state; a replay's from its own, the recording's at step 0 or where hashed equal): the clip applied per
    shard, before the all-reduce (trial 39: the gradients failed with
    per-leaf ratios below 1 that vary, "no simple form", and the clip was never named); or each micro-batch's
    (``StepRecord.micro_clip``: :func:`_clip_per_micro_batch`)."""
    if "clip_per_shard" not in ctx.reproduced:
        return None
    grads = [e for e in ctx.bad if e.kind == "grad"]
    worst = max(grads, key=lambda e: e.badness) if grads else ctx.bad[0]
    if ctx.first.micro_clip is not None:
        return _clip_per_micro_batch(ctx.first, worst)
    spread = ""
    if worst.spread is not None:
        lo, hi = worst.spread
        of = f" of its {worst.samples} recorded samples" if worst.samples else ""  # a replay's digests
        spread = (
            f" ({worst.path}'s elementwise ratio runs from {lo:.3g} to {hi:.3g}, 10th-90th percentile{of})"
        )
    # a replay reruns it from its own pre-step state: the recording's at step 0 or where hashed equal, else the
    # candidate's own (its returned gradients are read at the parameters it computed them at)
    start = "the reference's pre-step state"
    if ctx.first.replayed:
        shared = ctx.first.step == 0 or ctx.first.identical_start
        start = (
            "the recording's pre-step state, the replay's own"
            if shared
            else "the replay's own pre-step state"
        )
    # a (loss_sum, weight) loss: each shard's own mean gradient clipped, then averaged plainly or by each shard's
    # weight over the batch's (trial 44: re-weighted by its token count before the psum); either fits the rule
    mean = (
        "the mean over the shards"
        if ctx.first.loss_weight is None
        else "the mean over the shards, plain or weighted by each shard's weight over the batch's"
    )
    return Diagnosis(
        "clip_per_shard",
        f"At step {ctx.first.step} the gradients differ{spread}: they are the mean of each shard's own gradient "
        f"clipped to {_clip_norm_said(ctx.first)} (rerun from {start}: each shard's local "
        f"gradient, {_clip_rule_said(ctx.first)}, then {mean}), not the full batch's "
        "gradient clipped: a clip applied per shard (before the all-reduce). Clip after the pmean, or leave the "
        "clip to the optimizer (optax.chain(optax.clip_by_global_norm(...), ...) on the all-reduced gradients).",
        worst.name,
    )


def _clip_per_micro_batch(first: StepRecord, worst: LeafError) -> Diagnosis:
    """``clip_per_shard`` of a step that clipped each of its k micro-batches' gradients before accumulating them
    (``StepRecord.micro_clip``, fitted; trial 61: a character LM's accumulation by hand read "no constant
    factor")."""
    m, k, layout, of = first.micro_clip
    rows = f"rows i::{k}, every {k}th row" if layout == "strided" else f"the batch's rows in {k} blocks"
    grad = {
        "sum": "its loss sum's gradient",
        "mean": "its mean loss's gradient",
        "either": "of its loss sum or its mean, which a clip that binds on each clips alike",
    }[of]
    task = "clips nothing" if first.global_clip is None else f"clips at {first.global_clip:.4g}"
    return Diagnosis(
        "clip_per_shard",
        f"At step {first.step} the gradients differ: they are the mean over {k} micro-batches ({rows}) of each "
        f"micro-batch's own gradient ({grad}) scaled by min(1, {m:.4g} / its global L2 norm) (fitted, rerun from "
        f"the reference's pre-step state; the task's optimizer {task}), not the full batch's gradient: a clip "
        "applied per micro-batch, before the accumulation. Add the micro-batches' gradients (their loss sums' "
        "gradients over the total weight), then clip once, or leave the clip to the optimizer "
        "(optax.chain(optax.clip_by_global_norm(...), ...) on the accumulated gradient).",
        worst.name,
    )


def _clip_norm_said(first: StepRecord) -> str:
    """The norm ``clip_per_shard`` names: the task's, or one the step chose (``StepRecord.shard_clip``, fitted:
    trial 58 C2), beside the task's clip norm or its lack of one."""
    if first.shard_clip is None:
        return "the task's global norm"
    task = "clips nothing" if first.global_clip is None else f"clips at {first.global_clip:.4g}"
    return f"a global norm of {first.shard_clip:.4g}, the step's own (fitted; the task's optimizer {task})"


def _clip_rule_said(first: StepRecord) -> str:
    return (
        "optax.clip_by_global_norm's norm"
        if first.shard_clip is None
        else f"scaled by min(1, {first.shard_clip:.4g} / its global L2 norm)"
    )


def local_clip_norm(ctx: DiagnosisContext) -> Finding:
    """``local_clip_norm``: the exposed gradients match, the optimizer's per-leaf factors differ by leaf group and
    are all >= 1: each shard's gradient was clipped by its own local norm (a coefficient c / norm(local) >= the
    global c / norm(global))."""
    if not ctx.applied_groups:
        return None
    groups = [(f, list(paths)) for f, paths in ctx.applied_groups]
    adam = any(".mu." in f".{e.path}." for e in ctx.first.leaves if e.kind == "opt_state")
    evidence = "Adam's first moments" if adam else "the optimizer's state and updates"
    worst = max(groups, key=lambda g: g[0])[1][0]
    return Diagnosis(
        "local_clip_norm", local_clip_message(ctx.first.step, groups, evidence), f"param {worst}"
    )


def normalization(ctx: DiagnosisContext) -> Finding:
    """``normalization``: the first failing step is the step of the mean of per-shard means (C4-C6); or
    (``per_shard_mean_value``) the loss it returned is the mean of a rows x tokens split's per-shard means."""
    if "per_shard_mean_value" in ctx.reproduced:
        return Diagnosis("normalization", _per_block_value(ctx.first), "loss")
    if "per_shard_mean" not in ctx.reproduced:
        return None
    c = ctx.first.per_shard_factor
    if c is not None:
        return [
            Diagnosis("normalization", _per_shard_scaled(ctx, c), ctx.worst_name),
            *_combined_code(ctx, c),
        ]
    return Diagnosis(
        "normalization",
        f"At step {ctx.first.step} the step reproduces the mean of per-shard means (parameters and optimizer "
        f"state): {_each_shard(ctx.first)} divided its loss "
        "sum by its own weight (token count) before the shards were averaged. With uneven token counts per "
        "shard that weighs the tokens of short shards more; psum the loss sums and the token counts across "
        "shards, then divide once (docs/reduction_cases.md C4-C6)." + _as_micro_batches(ctx),
        ctx.worst_name,
    )


def _as_micro_batches(ctx: DiagnosisContext) -> str:
    """The same reading of a step that accumulates S micro-batches of consecutive rows, which the numbers cannot
    tell from S shards (trial 59: a step averaging its 2 micro-batches' own means on data=2 read "each shard
    divided its loss sum by its own weight" alone); ``""`` over a rows x tokens split or one shard."""
    s = ctx.num_shards
    if ctx.first.token_split is not None or not s or s < 2:
        return ""
    return (
        f" In a step that accumulates {s} micro-batches of consecutive rows the numbers are the same: there, each "
        "micro-batch divided by its own count; accumulate the loss sums and the counts, then divide once."
    )


def _per_block_value(first: StepRecord) -> str:
    """``normalization``'s message where the loss returned is the mean of the per-shard means of a rows x tokens
    split (``per_shard_mean_value``, ``StepRecord.token_split``: a context-parallel step, trial 45)."""
    return (
        f"At step {first.step} the loss the step returns ({first.candidate_loss:.7g}) is the mean of the "
        f"{first.token_split.shards} shards' own means, where the full batch's is {first.loss:.7g}: "
        f"{_each_shard(first)} divided its loss sum by its own token count before the shards were averaged. "
        f"{_per_block_gradients(first.token_grads)} With uneven token counts per "
        "shard that weighs the tokens of short shards more; psum the loss sums and the token counts across "
        "every axis the tokens are split over, then divide once (docs/reduction_cases.md C4-C6)."
    )


# a gradient each device divides by its own count after the all-gather's transpose brought it other blocks' terms
_SENT_BACK = (
    "each device divided a gradient that holds the terms the other blocks' tokens send back (through the "
    "gathered keys and values, e.g.) by its own count"
)


def _per_block_gradients(token_grads: tuple[tuple[str, ...], tuple[str, ...]] | None) -> str:
    """What the returned gradients say of a per-block normalization named from the loss value
    (``StepRecord.token_grads``: the leaves that are the gradient of the mean of per-block means and those that
    are not; trial 45's were never checked, and the sentence said "its gradients too")."""
    if token_grads is None:
        return "That cause is read from the loss value alone (no gradient was compared with that mean's)."
    agree, differ = token_grads
    n = len(agree) + len(differ)
    if not differ:
        return (
            f"Its gradients bear it out: all {n} gradient leaves are that mean's gradient, within tolerance."
        )
    if not agree:
        return (
            f"That cause is read from the loss value alone: none of the {n} gradient leaves is the gradient of "
            f"that mean of per-block means (as where {_SENT_BACK}, which shardcheck does not rebuild)."
        )
    return (
        f"Its gradients bear it out on {len(agree)} of {n} leaves, that mean's gradient within tolerance "
        f"({_listed_names(agree)}); the other {len(differ)} ({_listed_names(differ)}) are not, as where "
        f"{_SENT_BACK} (the leaves those tokens reach)."
    )


def _each_shard(record: StepRecord) -> str:
    """Who divided by its own count: ``"each shard"``, or where the shards reproduced are a rows x tokens split
    (``StepRecord.token_split``, a context-parallel step) ``"each of the 4 shards (data x seq blocks of
    tokens)"``."""
    split = record.token_split
    return "each shard" if split is None else f"each of the {split.shards} shards ({split.words()})"


def _per_shard_scaled(ctx: DiagnosisContext, c: float) -> str:
    """``normalization``'s message where the returned gradients are ``c`` x the mean of per-shard means, c not 1
    (``StepRecord.per_shard_factor``): c = S, the per-shard means summed (a psum where a pmean was due); 1/S,
    averaged and divided by S again; another c, said as it is. Over a rows x tokens split (``token_split``), c
    the size of the token axes: the blocks' means summed over them, averaged over the batch axes."""
    how = _shards_combined(ctx, c)
    hidden = (
        f" The optimizer's update hides the x{c:.4g} (global-norm clipping that binds rescales the gradient): "
        "its state matches that step on the per-shard means all the same."
        if ctx.first.scale_blind
        else ""
    )
    returned = any(e.kind == "grad" for e in ctx.first.leaves)
    seen = (
        f"the returned gradients are {c:.4g} x the mean of per-shard means, and the parameters and optimizer "
        "state are the optimizer's step on them"
        if returned
        else f"the parameters and optimizer state are the optimizer's step on {c:.4g} x the mean of per-shard "
        "means (the step returned no gradients)"
    )
    return (
        f"At step {ctx.first.step} {seen}: {_each_shard(ctx.first)} divided its "
        f"loss sum by its own weight (token count), and {how}.{hidden} psum the loss sums and the token counts across shards, "
        "then divide once (docs/reduction_cases.md C4-C6)." + _as_micro_batches(ctx)
    )


def _combined_code(ctx: DiagnosisContext, c: float) -> list[Diagnosis]:
    """The second fault of a step that is ``c`` x the mean of per-shard means, under its own code: ``summed``
    where c = S (the shards' means psum-ed), ``averaged_twice`` where c = 1/S; none otherwise, or over a rows x
    tokens split (trial 58 C5: a psum of per-shard means was coded ``normalization`` alone, its text saying
    both)."""
    s = ctx.num_shards
    if ctx.first.token_split is not None or not s or s == 1:
        return []
    if _close(c, s):
        said = (
            f"Besides each shard's own division, the shards' means were summed where their mean was due (x{s}, "
            f"a psum where a pmean was due): jax.lax.pmean them over the batch axes, or divide the psum by {s}."
        )
        return [Diagnosis("summed", said, ctx.worst_name)]
    if _close(c, 1 / s):
        said = (
            f"Besides each shard's own division, the shards' mean was divided by S={s} again (x1/{s}): divide "
            "once, either the psum by the global count or nothing after the pmean."
        )
        return [Diagnosis("averaged_twice", said, ctx.worst_name)]
    return []


def _shards_combined(ctx: DiagnosisContext, c: float) -> str:
    """How the shards' means were combined where the step is ``c`` x their mean, c not 1: summed (c = S),
    averaged and divided again (1/S), summed over a rows x tokens split's token axes, or another factor."""
    s, split = ctx.num_shards, ctx.first.token_split
    if split is not None:
        s = split.shards
    if split is not None and _close(c, split.blocks):
        axes = " x ".join(repr(a) for a in split.token_axes)
        return (
            f"the per-block means were summed over {axes} (a psum) where their mean (or a sum divided by the "
            f"global count) was due: x{split.blocks}, the size of {axes}"
        )
    if s and _close(c, s):
        return (
            f"the shards' means were summed (a psum where a pmean was due), not averaged: x{s}, a sum over "
            f"S={s} shards"
        )
    if s and _close(c, 1 / s):
        return f"the shards' means were averaged and divided by S={s} again: x1/{s}"
    return f"the shards' means were combined with a factor {c:.4g}, not averaged"


def _weight_ratio(record: StepRecord, f: float) -> str | None:
    """``"divided"`` where the gradient factor ``f`` is ``record``'s loss weight W over its count N
    (``StepRecord.weight_count``: the rows, where some weigh 0), ``"multiplied"`` where it is N / W; ``None``
    otherwise (no weight or count known, or another factor)."""
    w, count = record.loss_weight, record.weight_count
    if not w or count is None or not count[0]:
        return None
    n = count[0]
    if _close(f, w / n):
        return "divided"
    if _close(f, n / w):
        return "multiplied"
    return None


def _step_factor(record: StepRecord) -> float | None:
    """The gradient factor of a failing ``record`` as the rules read it (:func:`_as_fitted` of
    :func:`_gradient_factor`), or ``None``."""
    if record.ok:
        return None
    f, _ = _as_fitted(record, *_gradient_reading(record))
    return f


def _from_reference_state(records) -> list[StepRecord]:
    """The steps of ``records`` run from the reference's pre-step state, in order: a re-check that stands for its
    step, a replay's step started from the recorded state, and a step re-run after an earlier failure beside the
    trajectory's record (``StepRecord.rerun``): evidence of the step from equal inputs at another batch, said as
    "run from the reference's state", never the trajectory's."""
    out = []
    for r in records:
        out += [x for x in (r.rerun, r) if x is not None and x.from_reference_state]
    return out


def _weight_reading(ctx: DiagnosisContext) -> tuple[str, str] | None:
    """``(reading, support)`` where the first failing step's gradient factor is its loss weight over its count
    (:func:`_weight_ratio`): ``reading`` ``"divided"`` or ``"multiplied"``, or ``"both"`` where the factor is
    also a shard count's (:attr:`DiagnosisContext.named_factor`, 8/16 = 1/2 at S = 2) and no other step tells
    them apart; ``support``: the other step that does (a step run from the reference's state, whose weight
    differs: trial 16's step 1, x0.625 = 10/16), else ``""``. ``None`` where the factor is no such ratio, or where
    such a step shows the shard count's factor instead (:func:`shard_factor` names it)."""
    f, first = ctx.factor, ctx.first
    if f is None or first is None or ctx.reproduced:
        return None
    reading = _weight_ratio(first, f)
    if reading is None:
        return None
    if ctx.named_factor is None:
        return reading, ""
    for r in _from_reference_state(ctx.records):
        if r is first or r.step == first.step:
            continue
        g = _step_factor(r)
        if g is None:
            continue
        by_weight, by_shards = _weight_ratio(r, g) == reading, _close(g, f)
        if by_weight and not by_shards:
            w, (n, noun) = r.loss_weight, r.weight_count
            return reading, (
                f" At step {r.step} (run from the reference's state) they are {g:.4g} x the reference's: "
                f"{w:g}/{n}, that batch's weight over its {n} {noun}, where a shard count would give {f:.4g} again."
            )
        if by_shards and not by_weight:
            return None
    return "both", ""


def weight_count(ctx: DiagnosisContext) -> Finding:
    """``weight_count``: the gradient factor is the batch's loss weight W over its count N (rows where some weigh
    0, mask entries; ``StepRecord.weight_count``), or N / W: a step that divided by the count where the weight
    the ``(loss_sum, weight)`` loss returns was due (trial 16: 16 rows, weight 8, x0.5). Where the factor is also
    a shard count's (W/N = 1/S at that step), named as both unless another step run from the reference's state
    tells them apart (:func:`_weight_reading`)."""
    found = _weight_reading(ctx)
    if found is None:
        return None
    reading, support = found
    first = ctx.first
    w, (n, noun) = first.loss_weight, first.weight_count
    padding = "rows of weight 0: padding" if noun == "rows" else "entries of weight 0: padding"
    if reading == "multiplied":
        how = f"the gradient was scaled by the number of {noun} ({n}) over the loss's weight sum {w:g} ({padding})"
        ratio = f"{n}/{w:g}"
    else:
        how = f"the gradient was divided by the number of {noun} ({n}) where the loss's weight sum is {w:g} ({padding})"
        ratio = f"{w:g}/{n}"
    fix = "divide the psum of the loss sums by the psum of the weights the loss returns"
    phrase = f"{ctx.factor:.4g} = {ratio}: {how}; {fix}"
    if reading == "both":
        shards = ctx.named_factor[1].removeprefix("the gradient ")
        phrase = (
            f"either {how}, or it {shards}; at this step {ratio} = {ctx.factor:.4g}, so the factor cannot tell "
            "them apart (a step whose batch weighs otherwise, run from the reference's state, would)"
        )
    return Diagnosis(
        "weight_count",
        _factor_finding(ctx, "weight_count", phrase).message + support,
        ctx.worst_name,
    )


def recording_differs(ctx: DiagnosisContext) -> Finding:
    """``recording_differs``: a replayed step run from the recording's state returned the task's full-batch loss
    there, and the recording holds another (``StepRecord.task_loss``): the recording is not of this task as it is
    now, or its own step returned another loss; the replayed step is not blamed."""
    first = ctx.first
    if first is None or first.task_loss is None:
        return None
    return Diagnosis(
        "recording_differs",
        f"At step {first.step}, run from the recording's state, the replayed step returns the task's full-batch "
        f"loss there ({first.candidate_loss:.7g}; the task's loss computed now: {first.task_loss:.7g}), while the "
        f"recording holds {first.loss:.7g}: the recording does not match the task as it is now. Either the task "
        "(its model, loss or data) changed since it was recorded, or the recorded step did not return the "
        "full-batch loss. Record again from this task (shardcheck record), or check the step live (verify "
        "--candidate without --against).",
        "loss",
    )


def per_shard_loss(ctx: DiagnosisContext) -> Finding:
    """``per_shard_loss``: the first failing step is the step of the mean of per-shard means while the shards
    carry equal weights: no count differs, so a term of the loss that couples the rows was computed per shard; or
    (``per_shard_loss_value``) the loss it returned from the reference's state is the task's loss computed over
    each shard's rows and combined, where the full batch's differs."""
    if "per_shard_loss_value" in ctx.reproduced:
        first = ctx.first
        s = f"{ctx.num_shards} shards" if ctx.num_shards else "the shards"
        return Diagnosis(
            "per_shard_loss",
            f"At step {first.step} the loss the step returns ({first.candidate_loss:.7g}) is the task's loss computed "
            f"over each shard's own rows and combined over {s}, where the full batch's is {first.loss:.7g}: a term "
            "of the loss that couples the rows of the batch (a contrastive loss scoring each row against the batch, "
            "a batch statistic, an auxiliary loss over the batch's routing) was computed per shard. Compute it over "
            "the whole batch: gather what it needs across the shards first (jax.lax.all_gather of the embeddings, "
            "psum of the counts).",
            "loss",
        )
    if "per_shard_loss" not in ctx.reproduced:
        return None
    c = ctx.first.per_shard_factor  # trial 55: the shards' losses summed too (a psum), read as averaged
    how = (
        "averaged (parameters and optimizer state), while"
        if c is None
        else f"combined at {c:.4g} x their mean (parameters and optimizer state): {_shards_combined(ctx, c)}; and"
    )
    return Diagnosis(
        "per_shard_loss",
        f"At step {ctx.first.step} the step reproduces the loss computed per shard and {how} the shards carry "
        "equal weights, so no normalization differs: a term of the loss that couples the rows of the batch was "
        "computed over each shard's rows (an auxiliary load-balancing loss over each shard's routing, a statistic "
        "or a contrastive term of the shard only). Compute it over the whole batch: psum what it needs across the "
        "shards (the routing counts, the embeddings) first.",
        ctx.worst_name,
    )


def low_precision_reduction(ctx: DiagnosisContext) -> Finding:
    """``low_precision_reduction``: a float32 model's update is off by bfloat16's rounding of the shard gradients
    (never where the records refute a reduction: :func:`_reduction_refuted`; nor where the localization fits the
    failing leaves a named form, such as a weight decay term c*param: a reduction's rounding has none, trial 25)."""
    if "bf16_reduction" not in ctx.reproduced or {"per_shard_mean", "per_shard_loss"} & set(ctx.reproduced):
        return None
    if _fitted_form(ctx.first, [e for e in ctx.first.leaves if not e.ok]) is not None:
        return None
    # the gradients where they are returned and differ (trial 43 said "the update differs" beside "the
    # optimizer's update from equal inputs: matches"); the update where it alone shows the difference
    grads = any(e.kind == "grad" and not e.ok for e in ctx.first.leaves)
    what = "the gradients differ" if grads else "the update differs"
    # a replay's other side is a recording: its run's matmuls may have rounded (trial 57: a GPU's TF32 run
    # recorded as float32 read as a bfloat16 all-reduce, the fix a live flag that changes nothing of the recording)
    matmuls = (
        "or a recording whose matmuls rounded their operands more than it says: a GPU's TF32 run recorded as "
        "float32, which record --matmul-precision tf32 (record_run(..., matmul_precision='tf32')) records so that "
        "a replay compares within TF32's rounding"
        if ctx.first.replayed
        else "or matmuls that round their operands more than the tolerance assumed: TF32 on a GPU, where the step "
        "runs so, is checked with --matmul-precision tf32, matmul_precision='tf32' in Python"
    )
    return Diagnosis(
        "low_precision_reduction",
        f"At step {ctx.first.step} {what} from the reference by about bfloat16's rounding of the "
        "shard gradients (within 2 eps_bf16 sqrt(S) sum_s |g_s|), not by a factor, while the model computes its "
        "gradients in float32: the gradients were likely all-reduced in bfloat16 (read from the error's size "
        f"alone: another change that small reads the same, such as a small term of the loss computed another way, "
        f"{matmuls}). A bfloat16 sum of many shards rounds small contributions away and depends on the reduction "
        "order; reduce in float32 (cast the gradients to float32 before the psum / reduce-scatter).",
        ctx.worst_name,
    )


def _in_all(n: int) -> str:
    """``" (3 leaves in all)"``; ``""`` of one leaf, which the list before it names alone (trial 50: "first in
    loss (1 leaves in all)")."""
    return "" if n == 1 else f" ({n} leaves in all)"


def _reduction_refuted(record: StepRecord) -> bool:
    """Whether the records refute a faulty gradient reduction at this step: the loss differs (a reduction of the
    gradients cannot change the forward pass: trial 10's token count taken per micro-batch read "all-reduced in
    bfloat16"), the returned gradients all match, or the reference's optimizer on the candidate's own gradients
    and state gives another update (the difference lies in the update, downstream of any reduction)."""
    if any(e.kind == "loss" and not e.ok for e in record.leaves):
        return True
    grads = [e for e in record.leaves if e.kind == "grad"]
    if grads and all(e.ok for e in grads):
        return True
    return bool(record.optimizer_rerun) and not all(e.ok for e in record.optimizer_rerun)


def scaled(ctx: DiagnosisContext) -> Finding:
    """``scaled``: a constant gradient factor that is not a shard count (and no named reduction matched)."""
    if ctx.factor is None or ctx.named_factor is not None or ctx.reproduced or _weight_reading(ctx):
        return None
    if ctx.first.replica_scales is not None:  # the factor of one device's copy: local_normalization says it
        return None
    if ctx.one_number is not None:  # one number: no factor is claimed (_factor_finding says its readings)
        return _factor_finding(ctx, "scaled", None)
    loss = [e for e in ctx.first.leaves if e.kind == "loss"]
    # a factor of the exposed gradients is upstream of the optimizer: no learning rate scales them
    # nor one of the optimizer's state: its moments and traces are written from the gradients, before any
    # learning rate (trial 50: "optimizer moments are 2 x ... (a wrong loss normalization or learning rate?)"
    # beside a form saying "not a learning rate")
    cause = (
        "a wrong loss normalization?"
        if ctx.evidence == "gradients"
        else "a wrong loss normalization or learning rate?"
        if ctx.evidence == "parameter updates"
        else "a wrong loss normalization, or the gradients scaled before the optimizer?"
    )
    if loss and all(e.ok for e in loss) and ctx.evidence == "gradients":  # downstream of a matching loss
        cause = "the loss matches: a scale of the gradients after it, in their reduction or applied to them?"
    if scoped_gradients(ctx.first, ctx.evidence, ctx.factor) != ctx.evidence:  # a subset: not the whole loss
        cause = (
            "a scale applied to these gradients only: a per-module multiplier, or a loss term only they reach"
        )
    phrase = weight_phrase(ctx.factor, ctx.first.loss_weight) or (
        f"a constant factor that is not a shard count ({cause}{_loss_scale_reading(ctx.factor)})"
    )
    return _factor_finding(ctx, "scaled", phrase)


def _loss_scale_reading(f: float) -> str:
    """``"; a factor this far from 1 (1/4440) is more like a mixed-precision loss scale ..."`` where ``f`` or
    ``1/f`` is at least 2**8: no count of shards, rows or micro-batches gives it as often as a loss scale (2**k)
    left applied, applied twice, or undone after a step that reads the gradients' size (a global-norm clip)
    does (trial 29: unscaling after the clip gave x0.0002252, read only as a count's mistake); else ``""``."""
    if not (f > 0 and math.isfinite(f)) or max(f, 1 / f) < 2**8:
        return ""
    big = max(f, 1 / f)
    k = math.log2(big)
    near = f" = 2^{round(k)}" if abs(k - round(k)) < 0.01 else ""
    shown = f"{big:.4g}{near}" if f > 1 else f"1/{big:.4g}{near}"
    return (
        f"; a factor this far from 1 ({shown}) is more like a mixed-precision loss scale (the loss times 2^k "
        "before jax.grad) left on the gradients, applied twice, or undone after a step that reads their size "
        "(a global-norm clip sees the scaled gradients)"
    )


# the reductions of ``StepRecord.matches`` over the step's own micro-batches, named by :func:`micro_batch_means`
MICRO_REDUCTIONS = ("per_micro_mean",)


def micro_batch_means(ctx: DiagnosisContext) -> Finding:
    """``micro_batch_means``: the first failing step reproduces the step whose gradient averages the means of its
    k micro-batches, of unequal loss weights (``StepRecord.micro_means``): an accumulation by hand under a
    ``(loss_sum, weight)`` loss that normalized each micro-batch by its own count (trial 40)."""
    first = ctx.first
    if first is None or "per_micro_mean" not in ctx.reproduced or first.micro_means is None:
        return None
    k, weights, layout, c = first.micro_means
    shown = ", ".join(f"{w:.6g}" for w in weights)
    rows = f"rows i::{k}, every {k}th row" if layout == "strided" else f"the batch's rows in {k} blocks"
    how, what, scale = _micro_reduction(k, c)
    return Diagnosis(
        "micro_batch_means",
        f"At step {first.step} the step reproduces the micro-batches' means {how} (each normalized by its own "
        f"count) where their sums over the total count were meant: its update is the optimizer's step on the "
        f"{what} of the {k} micro-batches' own means{scale} ({rows}, loss weights {shown}), not on the "
        "full batch's sum over its total weight. With uneven counts that weighs the rows of the lighter "
        "micro-batches more; add the micro-batches' loss sums and their counts, then divide once by the total "
        "count (docs/reduction_cases.md C4-C6).",
        ctx.worst_name,
    )


def _micro_reduction(k: int, c: float) -> tuple[str, str, str]:
    """How a step reduced the means of its k micro-batches, by the factor c on their mean
    (``StepRecord.micro_means``): ``(how, what, scale)`` as :func:`micro_batch_means` says them."""
    if abs(c - k) <= 1e-3 * k:
        return "summed", "sum", f" (k = {k} x their mean: a sum where the mean was meant)"
    if abs(c * k - 1.0) <= 1e-3:
        return "averaged", "mean", f" divided by k = {k} again (1/{k} x their mean: divided by k twice)"
    return "averaged", "mean", ""


def update_rerun(ctx: DiagnosisContext) -> Finding:
    """``update_rerun``: every compared leaf of the first failing step is within tolerance, but the task's
    optimizer rerun on the candidate's own gradients and pre-step state gives another update
    (``StepRecord.update_only``: the update check at the optimizer's own rounding)."""
    first = ctx.first
    bad = first.update_only if first is not None else ()
    if not bad:
        return None
    worst = max(bad, key=lambda e: e.badness)
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return Diagnosis(
        "update_rerun",
        f"At step {first.step} every compared leaf is within its tolerance, but the update is not the task's "
        f"optimizer's on the step's own gradients: rerun on the candidate's gradients and pre-step state, the "
        f"optimizer gives other values for {worst.name}{more} (max abs err {worst.max_abs_err:.3g} > "
        f"{worst.tolerance:.3g}, the optimizer's own rounding: {UPDATE_ULPS} ulps of the leaf and "
        f"{UPDATE_RTOL:g} of its change). The tolerance against the reference allows the gradients' rounding "
        "carried through the optimizer, which this difference stays below at one step while it adds up over the "
        "steps: a term the step adds to its update or leaves out (a weight decay or a mask applied to other "
        "leaves, a learning rate, schedule or optimizer setting not the task's) is the usual cause.",
        worst.name,
    )


def _later_update_failure(ctx: DiagnosisContext) -> LeafError | None:
    """The worst failing gradient, parameter or optimizer-state leaf of the first later step that has one, after a
    first failing step where only the loss differed; ``None`` where none does."""
    for r in ctx.records:
        if r.step <= ctx.first.step:
            continue
        bad = [e for e in r.leaves if e.kind in ("grad", "param", "opt_state") and not e.ok]
        if bad:
            return max(bad, key=lambda e: e.badness)
    return None


def _constant_loss_ratio(ctx: DiagnosisContext) -> tuple[float, int] | None:
    """``(f, steps)`` where the candidate's returned loss is one factor f of the reference's at every compared
    step, two or more (``|c_t - f r_t|`` within the step's loss tolerance times ``max(1, |f|)``, f the first
    failing step's ratio), the update matching at each: a scale of the returned loss, which a post-update loss,
    one shard's loss or an unweighted mean (each its own ratio at each step) does not give; else ``None``."""
    first = ctx.first
    if first.candidate_loss is None or not first.loss:
        return None
    f = first.candidate_loss / first.loss
    if not math.isfinite(f):
        return None
    steps = 0
    for r in ctx.records:
        if r.step < 0 or r.candidate_loss is None or not math.isfinite(r.loss):
            continue
        if any(not e.ok for e in r.leaves if e.kind != "loss"):
            return None
        tol = max((e.tolerance for e in r.leaves if e.kind == "loss"), default=None)
        if tol is None or not abs(r.candidate_loss - f * r.loss) <= tol * max(1.0, abs(f)):
            return None
        steps += 1
    return (f, steps) if steps >= 2 else None


def _inexact_shard_ratio(record: StepRecord, ratio: float, num_shards: int | None) -> str | None:
    """Where the returned loss is near 1/S or S x the reference's (``ratio``, within :data:`RATIO_RTOL`) but
    further from that exact multiple than the loss's tolerance, the cause a loss divided (or summed) over the
    shards once too often cannot be: one number off by a shard count is that count to the loss's rounding; near
    1/S it is one shard's part of the loss, not reduced over the batch shards. ``None`` where it is exact, or S
    is unknown or 1."""
    if not num_shards or num_shards < 2:
        return None
    loss = next((e for e in record.leaves if e.kind == "loss"), None)
    exact = min((num_shards, 1 / num_shards), key=lambda f: abs(ratio - f))
    if loss is None or abs(record.candidate_loss - exact * record.loss) <= loss.tolerance:
        return None
    what = f"1/{num_shards}" if exact < 1 else f"{num_shards}"
    reading = (
        f"one shard's part of the loss returned without its reduction over the batch shards (its own rows' sum "
        f"over the full batch's count, or its own mean over S={num_shards}: about 1/{num_shards} of the whole, "
        "exactly so only where the shards' losses are equal); psum (or pmean) the loss over the batch axes before "
        "returning it"
        if exact < 1
        else "a sum of the shards' losses that are not each the full batch's mean (another normalization per "
        "shard), or one shard's loss scaled by the shard count"
    )
    return (
        f"It is {ratio:.4g} x the reference's: near {what} but not {what} within the loss's tolerance "
        f"({abs(record.candidate_loss - exact * record.loss):.3g} > {loss.tolerance:.3g}), as a loss divided or "
        f"summed over the shards once too often would be: {reading}."
    )


def _loss_ratio(record: StepRecord, num_shards: int | None) -> tuple[float | None, tuple | None, str | None]:
    """``(ratio, named, near)`` of a returned loss against the reference's: their ratio (``None`` without a
    loss), the shard-count factor it names (:func:`_name_factor`), and :func:`_inexact_shard_ratio`'s reading
    where it is near a shard count's factor and not that factor to the loss's rounding (``named`` then ``None``:
    trial 54's 0.5081 x had read "averaged twice: x1/2")."""
    if record.candidate_loss is None or not record.loss:
        return None, None, None
    ratio = record.candidate_loss / record.loss
    named = _name_factor(ratio, num_shards)
    near = _inexact_shard_ratio(record, ratio, num_shards) if named is not None else None
    return ratio, None if near is not None else named, near


def loss_differs(ctx: DiagnosisContext) -> Finding:
    """``loss_differs``: only the returned loss is out of tolerance at the first failing step."""
    if ctx.bad_kinds != {"loss"}:
        return None
    first = ctx.first
    ratio, named, near = _loss_ratio(first, ctx.num_shards)
    cause = near or (
        "The candidate does not return the full-batch pre-update loss (a post-update loss, one shard's loss, or "
        "an unweighted mean?)."
    )
    if named is not None and named[0] in ("summed", "averaged_twice"):
        cause = f"It is {ratio:.4g} x the reference's: the loss {named[1].removeprefix('the gradient ')}."
    later = _later_update_failure(ctx)
    shard_count = named is not None and named[0] in ("summed", "averaged_twice")
    if later is not None and shard_count and first.scale_hidden:
        # a shard count's factor on the loss, the optimizer blind to the gradient's scale: the gradients off by
        # the same factor explain the later update; a clipped term keeps no exact factor (trial 39: both said)
        return Diagnosis(
            "loss_differs",
            f"The returned loss differs (step {first.step}: {first.candidate_loss:.7g} vs reference "
            f"{first.loss:.7g}) while the update matches at this step. {cause} At step {later.step} the update "
            f"differs too ({later.name}: max abs err {later.max_abs_err:.3g} > tolerance {later.tolerance:.3g}): "
            "the optimizer is blind to the gradient's scale here (a global-norm clip that binds rescales it), so "
            f"gradients off by the same factor (x{ratio:.4g}) give this step's update too and show once the clip "
            "no longer binds on both; return them from the step ({'loss': loss, 'grads': grads}) to check them.",
            "loss",
        )
    if later is not None:  # the loss differs as a function, not only as returned
        cause = (
            f"At step {later.step} the update differs too ({later.name}: max abs err {later.max_abs_err:.3g} > "
            f"tolerance {later.tolerance:.3g}): the loss differs where its gradient does not at step "
            f"{first.step}'s parameters (a clipped or thresholded term whose active rows agree there, such as "
            "PPO's clip epsilon or a hinge margin), not only the loss returned."
        )
    elif (
        near is None and named is None and not first.scale_hidden and (constant := _constant_loss_ratio(ctx))
    ):
        f, steps = constant
        cause = (
            f"It is {f:.4g} x the reference's at every one of the {steps} steps compared (within the loss's "
            "rounding): one constant factor, which neither a post-update loss nor one shard's loss nor an "
            "unweighted mean keeps from step to step, nor a clipped or thresholded term: the loss returned is "
            f"scaled by {f:.4g} apart from the one differentiated (multiplied by a count or a constant after "
            "jax.grad, or on a copy that is only returned)."
        )
    elif near is None and named is None:
        cause += (
            " Or the loss differs where its gradient does not at these parameters (a clipped or thresholded term "
            "whose active rows agree here, such as PPO's clip epsilon): a later step tells."
        )
    if first.scale_hidden:
        cause += (
            " This check cannot see the gradient's scale (the optimizer is blind to it: global-norm clipping that "
            "binds), so the gradients may be off by the same factor: return them from the step ({'loss': loss, "
            "'grads': grads}) to check them."
        )
    return Diagnosis(
        "loss_differs",
        f"Only the returned loss differs (step {first.step}: {first.candidate_loss:.7g} vs reference "
        f"{first.loss:.7g}); the update matches at this step. {cause}",
        "loss",
    )


def grads_differ(ctx: DiagnosisContext) -> Finding:
    """``grads_differ``: only the exposed gradients are out of tolerance at the first failing step, and not by a
    constant factor (which the factor rules name: an optimizer blind to the gradient's scale hides it)."""
    if ctx.bad_kinds != {"grad"} or ctx.factor is not None:
        return None
    rerun = ctx.first.optimizer_rerun
    if rerun and all(e.ok for e in rerun):  # the optimizer on the returned gradients gives the applied update
        return Diagnosis(
            "grads_differ",
            f"The exposed gradients differ ({ctx.worst_name}, step {ctx.first.step}) while the update matches, "
            "and the reference's optimizer run on these gradients gives the candidate's update: they are the "
            "ones applied, and the optimizer's update does not show their difference (a global-norm clip that "
            "binds rescales the gradient; a difference within the update's tolerance passes"
            f"{_first_step_hiders(ctx.first.step)}). It may show at a later "
            f"step; the gradients themselves differ.{_weight_factor(ctx)}",
            ctx.worst_name,
        )
    return Diagnosis(
        "grads_differ",
        f"The exposed gradients differ ({ctx.worst_name}, step {ctx.first.step}) while the update matches: "
        "the reported gradients are not the ones applied.",
        ctx.worst_name,
    )


def _first_step_hiders(step: int) -> str:
    """What else hides a gradient's difference at a run's first step (none later)."""
    if step:
        return ""
    return "; a normalizing optimizer's first step keeps only its sign; a warm-up's learning rate of 0"


def _weight_factor(ctx: DiagnosisContext) -> str:
    """``" They are 89 x the reference's: 89 is this batch's total loss weight ..."``, where every failing
    gradient is one factor across it and that factor is the batch's loss weight (or 1 over it); else ``""``."""
    bad = [e for e in ctx.first.leaves if e.kind == "grad" and not e.ok]
    if not bad or not all(e.ratio is not None and one_factor_across(e) for e in bad):
        return ""
    f = _consensus([e.ratio for e in bad])
    phrase = None if f is None else weight_phrase(f, ctx.first.loss_weight)
    return "" if phrase is None else f" They are {f:.4g} x the reference's: {phrase}."


def drift(ctx: DiagnosisContext) -> Finding:
    """``drift``: an unexplained failure at a step t > 0 of the candidate's own trajectory."""
    if not (ctx.unexplained and ctx.drifted):
        return None
    t = ctx.first.step
    if ctx.first.replayed:  # no rerun from the reference's state: which of the causes, a replay cannot tell
        return Diagnosis(
            "drift",
            f"The first {t} step(s) agree; step {t} does not ({ctx.detail}). A replay cannot rerun step {t} from "
            "the recorded run's state: a fault that starts at this step, state not carried between steps, or "
            "differences within tolerance at the earlier steps growing past it; a live check (verify without "
            "--against) reruns the step from the reference's pre-step state and tells them apart.",
            ctx.worst_name,
        )
    return Diagnosis(
        "drift",
        f"The first {t} step(s) agree; step {t} does not ({ctx.detail}): state not "
        "carried between steps correctly (optimizer state reset or shared?) or errors accumulating "
        "past rounding.",
        ctx.worst_name,
    )


def _loss_ok(ctx: DiagnosisContext) -> bool:
    loss = next((e for e in ctx.first.leaves if e.kind == "loss"), None)
    return loss is not None and loss.ok


def _some_match(ctx: DiagnosisContext) -> bool:
    """Some gradient, optimizer-state or parameter leaf of the first failing step matched (then "only the loss
    matches" is false: a warm-up's learning rate of 0 leaves every parameter matching while the gradients
    differ)."""
    return any(e.ok for e in ctx.first.leaves if e.kind in ("grad", "opt_state", "param"))


def loss_only(ctx: DiagnosisContext) -> Finding:
    """``loss_only``: an unexplained failure of the update at step 0 while the loss matches (seed 001) and no
    gradient and no optimizer-state leaf matches where compared (else :func:`localized` says which do)."""
    if not (ctx.unexplained and not ctx.drifted and _loss_ok(ctx)) or _some_match(ctx):
        return None
    return Diagnosis(
        "loss_only",
        f"Only the loss matches at step {ctx.first.step}: the pre-update loss agrees at step {ctx.first.step}"
        f"{ctx.first.start_said} but the update does not ({ctx.detail}). A matching loss does not verify the update, the optimizer state or the "
        "communication (seed 001): this is not parity.",
        ctx.worst_name,
    )


# the stages of an update, in order: (kind, plural noun, verb agreeing with it, what a first difference there means)
STAGES = (
    (
        "grad",
        "the gradients",
        "differ",
        "the gradients were computed or reduced differently for these leaves",
    ),
    (
        "opt_state",
        "the optimizer state",
        "differs",
        "the optimizer was given other gradients for these leaves, or updated its state differently",
    ),
    ("param", "the parameters", "differ", "the update was applied differently"),
)


def localized(ctx: DiagnosisContext) -> Finding:
    """``localized``: an unexplained failure at step 0 while the loss and some gradient or optimizer-state leaves
    match: names the first stage (gradients, optimizer state, parameters) with failing leaves, the earlier stages
    that match, and what the failing leaves of that stage share (:func:`state_property`: optimizer state read
    as its parameters where its own paths share nothing, as the localization's group reads it)."""
    if not (ctx.unexplained and not ctx.drifted and _loss_ok(ctx)) or not _some_match(ctx):
        return None
    leaves = ctx.first.leaves
    matched = []
    for kind, noun, verb, meaning in STAGES:
        of_kind = [e for e in leaves if e.kind == kind]
        bad = [e for e in of_kind if not e.ok]
        if not bad:
            if of_kind:
                matched.append(noun)
            continue
        worst = max(bad, key=lambda e: e.badness)
        good = {e.path: e.shape for e in of_kind if e.ok}
        params = {e.path: e.shape for e in leaves if e.kind == "param"}
        # optimizer state listed as the stage table lists it: "opt_state 0.mu.a"
        names = {e.path: e.name for e in of_kind if kind == "opt_state"}
        quiet = rounding_params((*ctx.first.rounding_level, *ctx.first.unresolved))
        group = state_property(
            {e.path: e.shape for e in bad}, good, params, ctx.facts, names=names, quiet=quiet
        )
        group = _as_localized(ctx.first, kind, group, ctx.facts)
        regroup = functools.partial(state_property, params=params, facts=ctx.facts, names=names, quiet=quiet)
        group = _decay_unseen(ctx.first, of_kind, group, regroup, quiet)
        agree = ["the loss", *matched]
        verb_ = "matches" if len(agree) == 1 else "match"
        agree = words_and(agree)
        head = f"At step {ctx.first.step} {agree} {verb_}"
        count = f"{len(bad)} of {len(of_kind)} {'leaf' if len(of_kind) == 1 else 'leaves'}"
        pipeline = pipeline_axes(ctx.mesh_shape, getattr(ctx, "facts", None)) if ctx.mesh_shape else ()
        copies = (ctx.first.replica_axes, "the gradients" in matched, pipeline)  # a zero on one copy
        form = _fitted_form(ctx.first, bad) or _stage_form([worst, *bad], *copies)
        # the gradients the optimizer was given are the reference's
        if kind == "opt_state" and "the gradients" in matched:
            meaning = "the optimizer updated its state differently from equal gradients"
        started = _started(ctx.first, kind)
        if started:  # its change matches: the state differed before the step, not in how it was updated
            meaning, form = "it started from other values", f"{started[0].upper()}{started[1:]}."
        if kind == "grad" and ctx.first.uses_left_out:
            form = f"{form} {_uses_said(*ctx.first.uses_left_out)}"
        return Diagnosis(
            "localized",
            f"{head}; {noun} {verb} ({count}): {meaning}. {group[0].upper()}{group[1:]}. {form} "
            f"({_detail(worst, ratio=constant_ratio(worst))}).",
            worst.name,
        )
    return None


def _uses_said(module: str, kept: tuple[str, ...], left_out: tuple[str, ...]) -> str:
    """What the gradients of a module read by several calls hold (``StepRecord.uses_left_out``)."""
    calls = len(kept) + len(left_out)
    return (
        f"{module}'s parameters are read by {calls} calls in the forward pass ({words_and([*kept, *left_out])}), "
        f"and the returned gradient is the term of {words_and(kept)} alone: the term of {words_and(left_out)} "
        "is missing (the same parameters used again, such as a tied embedding's output head: a "
        "jax.lax.stop_gradient on that use, or a copy of the parameters there, keeps its term out). Each use's "
        "term must reach the gradient."
    )


def _decay_unseen(record: StepRecord, of_kind: list[LeafError], group: str, regroup, quiet) -> str:
    """``group`` (the failing and matching leaves of one kind) with the matching parameters that the
    localization's decay form could not show no longer its contrast
    (:func:`~shardcheck.parity.diagnosis.localization.decay_said`; ``regroup(failing, matching)``, the
    :func:`state_property` that read ``group``, reads it again without them; ``quiet``: the rounding-level
    parameters, which it sets aside), as the localization's group says it (trial 47: "every bias, pos matches"
    of a decay too small on them to show)."""
    from shardcheck.parity.diagnosis.localization import TOO_SMALL, decay_said, decay_unseen, localize

    found = localize([record])
    unseen = decay_unseen(None if found is None else found.form, of_kind)
    if not unseen or TOO_SMALL in group:  # none, or the localization's group (_as_localized) says it
        return group
    failing = {e.path: e.shape for e in of_kind if not e.ok}
    good = {e.path: e.shape for e in of_kind if e.ok and e.path not in unseen}
    others = any(p not in quiet for p in good)
    return decay_said(group, unseen, others, lambda: regroup(failing, good))


# the localization's stages whose group may stand for the failing leaves of a kind (the replicas' group reads
# the leaves whose copies disagree as their parameters)
_GROUP_STAGES = {
    "grad": ("gradients", "replicas"),
    "opt_state": ("optimizer", "parameters", "replicas"),
    "param": ("optimizer", "parameters", "replicas"),
}


def _started(record: StepRecord, kind: str) -> str:
    """Where the step-0 optimizer state started from other values than the reference's
    (:func:`~shardcheck.parity.diagnosis.localization.started_otherwise`) and ``kind`` is the optimizer state or
    the parameters its update moved, that in words; else ``""``."""
    from shardcheck.parity.diagnosis.localization import started_otherwise, started_sentence

    started = started_otherwise(record) if kind in ("opt_state", "param") else []
    return started_sentence(started) if started else ""


def _as_localized(
    record: StepRecord, kind: str, group: str, facts: Mapping[str, LeafFacts] | None = None
) -> str:
    """``group``, or where it names nothing (:data:`NO_PROPERTY`) the localization's group of the same failing
    step where that names a property (``"every failing leaf is under blocks.0.attn"``) and its stage holds this
    kind's leaves or their replicas: one report never says both."""
    from shardcheck.parity.diagnosis.localization import localize

    if NO_PROPERTY not in group:
        return group
    found = localize([record], facts=facts)
    if (
        found is None
        or not found.group
        or NO_PROPERTY in found.group
        or found.stage not in _GROUP_STAGES[kind]
    ):
        return group
    return found.group


def _fitted_form(record: StepRecord, bad: list[LeafError]) -> str | None:
    """The localization's form of these failing leaves (``Form: a decoupled weight decay term c*lr*param with c =
    0.1 ...``), where the localization's first differing stage fails on exactly them and the form has a name (not
    "no simple form", which the rule's own sentence says with its leaf's spread): one sentence for both findings
    (a decay fitted on the arrays is not then called "no one factor" or a constant factor); else ``None``."""
    from shardcheck.parity.diagnosis.localization import localize, stage_leaves

    found = localize([record])
    if found is None or found.stage is None or found.form is None or found.form.kind == "none":
        return None
    failing = {e.name for e in stage_leaves(record)[found.stage] or [] if not e.ok}
    if failing != {e.name for e in bad}:
        return None
    return f"Form: {found.form.sentence}."


def _stage_form(
    bad: list[LeafError],
    replica_axes: Sequence[str] = (),
    gradients_match: bool = False,
    pipeline: Sequence[str] = (),
) -> str:
    """What the failing leaves' ratios say: one constant factor, per-leaf factors, or no constant factor (with
    the first non-constant leaf's spread). ``replica_axes``: the axes along which the step's replicated copies
    differ (``StepRecord.replica_axes``): a zero update is then said of the compared copies
    (:func:`~shardcheck.parity.diagnosis.form.zero_on_copies_said`: the gradient's, or where
    ``gradients_match`` an update applied on some devices or slices only; ``pipeline`` the pipeline axes)."""
    if all(e.kind == "param" and e.reference_change == 0 for e in bad):
        return f"The reference did not move these leaves at this step and the candidate did: {REFERENCE_ZERO_MEANING}."
    shaped = [e for e in bad if e.cand_shape is not None]
    if shaped:  # no ratio across shapes, and no NaN either
        return (
            f"{'They are' if len(shaped) == len(bad) else f'{len(shaped)} of them are'} shaped otherwise than the "
            f"reference's (e.g. "
            f"{_detail(shaped[0])}): no factor is read across shapes."
        )
    blurred = next((e for e in bad if e.ratio is not None and not one_factor_across(e)), None)
    if blurred is not None:
        return f"{blurred.name} has {spread_phrase(blurred)}."
    ratios = [e.ratio for e in bad if e.ratio is not None and math.isfinite(e.ratio)]
    if len(ratios) == len(bad) and all(abs(r) <= ZERO_RATIO for r in ratios):
        if replica_axes:
            said = zero_on_copies_said(replica_axes, gradients_match=gradients_match, pipeline=pipeline)
            return f"The candidate's update of these leaves is zero {said}."
        return (
            "The candidate's update of these leaves is zero (their change is 0 x the reference's): a learning "
            "rate of 0 at this step (a schedule read one step early), or an update computed and not applied."
        )
    noun = "values" if all(e.kind in ("grad", "loss") for e in bad) else "changes"
    spreads = [e.spread for e in bad if e.spread is not None]
    if ratios and len(spreads) == len(bad) and all(lo <= 1.0 <= hi for lo, hi in spreads):
        lo, hi = min(s[0] for s in spreads), max(s[1] for s in spreads)
        return (
            f"Their {noun} lie around 1 x the reference's (elementwise {lo:.4g}..{hi:.4g}): each element differs "
            f"by up to about {max(1.0 - lo, hi - 1.0):.2g} of its value, which no factor explains."
        )
    f = _consensus(ratios)
    if f is not None:
        return f"Their {noun} are {f:.4g} x the reference's, a constant factor on each."
    return f"Their {noun} differ from the reference's by no one factor."


def update_differs(ctx: DiagnosisContext) -> Finding:
    """``update_differs``: any other unexplained failure of the update (not one reduced step); ``forward_differs``
    where the forward pass differs first and the optimizer's update from equal inputs matches
    (:func:`_forward_only`): the loss computed another way at equal parameters."""
    if not (ctx.unexplained and not ctx.drifted and not _loss_ok(ctx)):
        return None
    first = ctx.first
    matched = _params_match(first)
    if _forward_only(first):
        return Diagnosis(
            "forward_differs",
            _bias_before_psum(ctx)
            + f"{_what_differs(first)} from the reference at step {first.step}"
            + first.start_said
            + f" ({ctx.detail}){matched}. "
            + _forward_sentence(first)
            + ("" if _module_found(first) else _forward_hint(ctx, _modules_cleared(first))),
            ctx.worst_name,
        )
    return Diagnosis(
        "update_differs",
        f"{_what_differs(first)} from the reference at step {first.step}"
        + first.start_said
        + f" ({ctx.detail}){matched}"
        + (". It is " if matched and _no_reference_update(first) else ": ")  # that clause ends a sentence
        + _not_one_step(first)
        + ("" if _module_found(first) else _forward_hint(ctx, _modules_cleared(first))),
        ctx.worst_name,
    )


BIAS_FACTOR_RTOL = 0.1
"""How far a replicated bias's median gradient ratio may sit from a model axis's size M for
:func:`_bias_before_psum` to read it as the bias added M times: the gradient is M x the one at the shifted output,
whose own difference from the reference's is that of the loss."""


def _bias_before_psum(ctx: DiagnosisContext) -> str:
    """The sentence that leads a ``forward_differs`` finding where a replicated bias of a module split over a model
    axis of size M has a gradient about M x the reference's (median within :data:`BIAS_FACTOR_RTOL`): added before
    the psum over that axis it counts M times, in the output (the loss differs, where the bias is not 0) and in
    its gradient (trial 54: with the biases at normal(0.02) the step read only a list of masks and positions;
    at zero init, whose loss matches, ``replicated_reduced`` names it); ``""`` where none, or the leaves' placements
    are not known (a replay)."""
    facts, shape = ctx.facts or {}, dict(ctx.mesh_shape or {})
    sizes = {a: int(shape[a]) for a in axis_roles(shape)[1] if int(shape[a]) > 1}
    for e in ctx.bad:
        fact, module = facts.get(e.path), e.path.rpartition(".")[0]
        if e.kind != "grad" or not e.path.endswith("bias") or fact is None or fact.axes or e.ratio is None:
            continue
        for axis, m in sizes.items():
            split = any(axis in f.axes for p, f in facts.items() if p.rpartition(".")[0] == module and f.axes)
            if split and _close(e.ratio, m, BIAS_FACTOR_RTOL):
                return (
                    f"The gradient of {e.path}, a bias replicated over {axis!r} in a module split over it "
                    f"({module or 'the model'}), is {e.ratio:.4g} x the reference's (median), about the size of "
                    f"mesh axis {axis!r} ({m}): {added_before_psum((axis,), m)}; so it counts {m} times in the "
                    "output (the loss differs) and in its gradient. "
                )
    return ""


def _forward_only(record: StepRecord) -> bool:
    """Whether the record's first differing stage is the forward pass while the optimizer's update from equal
    inputs matches (the reference's optimizer rerun on the candidate's own gradients and pre-step state gives its
    optimizer state and parameters) and the step wrote no parameter itself: the step is one reduced step whose
    loss is computed another way at equal parameters (trial 44: a cross-document mask dropped, RoPE from
    ``arange``, a z-loss coefficient scaled read "not a single reduced step (shards applied one after
    another)")."""
    rerun = record.optimizer_rerun or ()
    return bool(rerun) and all(e.ok for e in rerun) and _forward_first(record) and not _params_edited(record)


def _forward_sentence(record: StepRecord) -> str:
    """``forward_differs``' reading: the update from equal inputs matches, so the loss (and its gradients) is
    computed another way at equal parameters; where a module's output differs while its inputs match, from that
    module on; else what the loss reads (a mask, the positions, a term or its coefficient, weights), with the
    batch's keys beside its inputs and labels (``StepRecord.batch_keys``)."""
    head = (
        "The optimizer's update from equal inputs matches (the reference's optimizer rerun on the candidate's own "
        "gradients and pre-step state gives its update): the update is applied as the reference's, and "
    )
    if _module_found(record):
        return (
            head + f"the forward pass as sharded computes another loss at equal parameters, from "
            f"{record.module.module} on (the first module whose output differs while its inputs match)."
        )
    around = (
        " (every captured module's output matches at equal parameters as the task's loss calls it: the "
        "difference is in what the step does around them, or in modules as the step's own code calls them)"
        if _modules_cleared(record)
        else ""
    )
    keys = record.batch_keys
    batch = (
        f"; the batch holds {words_and([repr(k) for k in keys])} beside its inputs and labels: check how the "
        "step's loss reads each"
        if keys
        else ""
    )
    inputs = (
        "a mask (e.g. attention across segments or documents), the positions, a term of the loss or its "
        f"coefficient, its weights or labels, or another input the loss reads from the batch{batch}."
    )
    if record.replica_mismatches:  # trial 58 C3: the reduction named above first, the loss's inputs after it
        return (
            head + f"the loss it returns is computed another way at equal parameters{around}: first the loss "
            "and its gradients reduced another way across the shards (their copies differ across devices: the "
            "reduction named above; mend it first). Should a difference remain after that, the loss reads "
            "something another way: " + inputs
        )
    return head + f"the loss it returns is computed another way at equal parameters{around}: " + inputs


def _not_one_step(record: StepRecord) -> str:
    """What an unexplained update says: not a single reduced step, with its usual causes; where the module probe
    found a module whose output differs at equal parameters, the one cause it shows (the forward pass as sharded
    computes another function), since shards applied one after another or gradients taken at other parameters
    would leave every module's output at equal parameters as it is."""
    found = record.module
    if _module_found(record):
        return (
            f"a wrong loss: at equal parameters the forward pass as sharded computes another function, from "
            f"{found.module} on (the first module whose output differs while its inputs match)."
        )
    if _forward_first(record) and _params_edited(record):
        return _edited_sentence(record)
    if _forward_first(record):
        around = (
            " (no captured module's output differs while its inputs match, each module run as the task's loss "
            "calls it under the candidate's placement at equal parameters: the difference is in what the step "
            "does around them, or in modules as the step's own code calls them)"
            if _modules_cleared(record)
            else ""
        )
        itself = (
            ", or collectives the step runs around the modules itself, or the modules as the step's own code "
            "calls them (another aggregation, another mask)"
            if around
            else ""
        )
        if _no_reference_update(record):  # nothing moved them: every shard's loss was taken at the same ones
            return (
                f"not a single reduced step: the loss it returns is not the full-batch loss at its starting "
                f"parameters{around}: computed another way (the loss's terms, labels, weights or normalization"
                f"{itself})."
            )
        return (
            f"not a single reduced step: the loss it returns is not the full-batch loss at its starting "
            f"parameters{around}: computed another way (the loss's terms, labels, weights or normalization"
            f"{itself}), or taken at other parameters (shards applied one after another)."
        )
    if _no_reference_update(record):
        return "not a single reduced step: its gradients or its loss were computed otherwise (a wrong loss)."
    return (
        "not a single reduced step (shards applied one after another, gradients taken at different parameters, "
        "or a wrong loss)."
    )


def _params_edited(record: StepRecord) -> list[LeafError]:
    """The parameters the step changed apart from its optimizer's update: the reference's optimizer rerun on the
    candidate's own gradients and pre-step state (``StepRecord.optimizer_rerun``) gives every optimizer-state
    leaf of the candidate but not these parameters. With a loss that differs too, the step wrote them before
    its forward pass (trial 28: the stacked layers reversed in place). ``[]`` without that evidence."""
    rerun = record.optimizer_rerun or ()
    params = [e for e in rerun if e.kind == "param" and not e.ok]
    if not params or not all(e.ok for e in rerun if e.kind != "param"):
        return []
    return params


def _edited_sentence(record: StepRecord) -> str:
    """:func:`_params_edited`'s finding in words, with the worst leaf's numbers."""
    edited = _params_edited(record)
    rerun = record.optimizer_rerun or ()
    n_params = sum(e.kind == "param" for e in rerun)
    n_state = len(rerun) - n_params
    worst = max(edited, key=lambda e: e.badness)
    names = ", ".join(e.path for e in edited[:3]) + (
        f" and {len(edited) - 3} more" if len(edited) > 3 else ""
    )
    state = f"its optimizer state ({n_state} leaves match)" if n_state else "its update's state"
    return (
        f"the step changed {len(edited)} of {n_params} parameters itself ({names}): the reference's optimizer "
        f"rerun on the candidate's own gradients and pre-step state gives {state} but not these parameters "
        f"(worst {worst.path}: max abs err {worst.max_abs_err:.3g} > tolerance {worst.tolerance:.3g}), so its loss "
        "and gradients were taken at other parameters than the ones it started from: an in-place write, a "
        "permutation, a re-initialization or a cast of these parameters inside the step, before its forward pass."
    )


def _module_found(record: StepRecord) -> bool:
    """Whether the module probe named a module whose output differs while its inputs match (then the examples of
    :func:`_forward_hint` are no more than what it shows)."""
    return record.module is not None and getattr(record.module, "status", "") == "differs"


def _forward_first(record: StepRecord) -> bool:
    """Whether the record's first differing stage is the forward pass (the loss at equal parameters)."""
    from shardcheck.parity.diagnosis.localization import localize

    found = localize([record])
    return found is not None and found.stage == "forward"


def _modules_cleared(record: StepRecord) -> bool:
    """Whether the forward pass differs first while the module probe found no module whose output differs while
    its inputs match (every output matches, or every differing one got a different input): the difference is
    then in the step's own forward or loss, not inside a module as the probe ran it."""
    found = record.module
    status = getattr(found, "status", "")
    return found is not None and status in ("matches", "input differs") and _forward_first(record)


_KIND_NOUNS = {"loss": "the loss", "grad": "the gradients", "opt_state": "the optimizer state"}


def _what_differs(record: StepRecord) -> str:
    """``"The update differs"`` where a parameter fails at this step; else the kinds that do (``"The loss and the
    gradients differ"``): the update is not called different where every parameter matches."""
    bad = [e for e in record.leaves if not e.ok]
    if any(e.kind == "param" for e in bad):
        return "The update differs"
    kinds = [noun for kind, noun in _KIND_NOUNS.items() if any(e.kind == kind for e in bad)]
    if not kinds:
        return "The step differs"
    words = words_and(kinds)
    verb = "differ" if len(kinds) > 1 or kinds[0] == "the gradients" else "differs"
    return f"{words[0].upper()}{words[1:]} {verb}"


def _params_match(record: StepRecord) -> str:
    """``", though the applied parameters match at this step (35 leaves)"`` where every parameter leaf of the
    step is within tolerance (under Adam a first step moves each parameter by about the learning rate whatever the
    gradient's size), else ``""``; where the reference's own update moved no parameter at all
    (:func:`_no_reference_update`: a learning rate of 0 there), that the parameters match because there is no
    update to compare."""
    params = [e for e in record.leaves if e.kind == "param"]
    if not params or not all(e.ok for e in params):
        return ""
    if _no_reference_update(record):
        return (
            f", though the applied parameters match at this step ({n_leaves(len(params))}) only because no "
            f"update is compared there: the reference's own update is 0 at step {record.step} "
            f"({_why_no_update(record)})"
        )
    if record.replayed:  # a digest's 8 samples and norm, within the digest's tolerance (trial 35)
        return (
            f", though the applied parameters match at this step as far as the recorded digests show "
            f"({n_leaves(len(params))}: 8 samples, the norm and max|x| of each)"
        )
    return f", though the applied parameters match at this step ({n_leaves(len(params))})"


def _why_no_update(record: StepRecord) -> str:
    """Why the reference's step moved no parameter, as its optimizer state tells: an accumulation step where its
    ``optax.MultiSteps``' ``mini_step`` after the step is not 0 (no update applied); a learning rate of 0 where the
    MultiSteps applied one, or where the optimizer's own counters (Adam's ``count``) hold none of MultiSteps'; both
    where no counter of the optimizer's state was compared (trial 26: a MultiSteps(k=2)'s step 0, which only
    accumulates, read "the learning rate at step 0 is 0")."""
    lr_zero = f"the learning rate at step {record.step} is 0, as a warm-up from 0 gives"
    mini = reference_mini_step(record)
    if mini:
        return (
            f"the reference's optax.MultiSteps only accumulated the gradient at step {record.step}: its mini_step "
            f"is {mini} after it, the steps accumulated since its last update, so it applied no update"
        )
    if mini == 0:
        return f"its optax.MultiSteps applied an update at step {record.step}, and {lr_zero}"
    if any(e.kind == "counter" and e.path != "step" for e in record.leaves):
        return lr_zero  # the optimizer's own counters hold no MultiSteps' accumulation counter
    return (
        f"either {lr_zero}, or the step only accumulates the gradient, as optax.MultiSteps does until its k-th "
        "step (no counter of the optimizer state tells which)"
    )


def _no_reference_update(record: StepRecord) -> bool:
    """Whether the reference's step left every parameter exactly as it was (each ``param`` leaf's
    ``reference_change`` is 0: a learning rate of 0 at that step, as ``optax.warmup_cosine_decay_schedule(0.0,
    ...)`` gives at step 0): a candidate whose gradients differ then applies no different update either, so a
    matching parameter says nothing of how its shards were applied."""
    params = [e for e in record.leaves if e.kind == "param"]
    return bool(params) and all(e.reference_change == 0.0 for e in params)


def _forward_hint(ctx: DiagnosisContext, cleared: bool = False) -> str:
    """On a mesh with model axes, a loss that differs says the sharded forward pass computes something else.
    ``cleared``: the module probe found every module's output equal under the candidate's placement, so the
    examples hold only for a step whose own ``jax.shard_map`` the probe cannot see into."""
    from shardcheck.mesh import batch_axis_names

    shape = dict(ctx.mesh_shape or {})
    # an axis of size 1 splits nothing (trial 33: 'model=1' read "a replicated bias ... counts 1 times")
    model = [a for a in shape if a not in batch_axis_names(shape) and int(shape[a]) > 1]
    if not model:
        return ""
    axis = model[0]
    if cleared:
        head = (
            " If the step runs the model in a jax.shard_map of its own (which the module probe does not see into), "
            f"a loss that differs on a mesh that splits the model over {tuple(model)} says the sharded forward "
            "pass computes another function"
        )
    else:  # nothing probed the modules (a replay, a step the probe cannot run): one possible cause among others
        head = (
            f" On a mesh that splits the model over {tuple(model)}, a loss that differs may also come from the "
            "sharded forward pass computing another function"
        )
    piped = [a for a in model if a in pipeline_axes(shape, getattr(ctx, "facts", None))]
    if piped:  # a pipeline's stages: its readings, not a tensor-parallel layer's
        return (
            f"{head}: {piped[0]!r} holds the stages of a pipeline, e.g. the activations sent to the wrong stage "
            f"(the perm of a jax.lax.ppermute over {piped[0]!r}: stage i sends to stage i + 1, perm=[(i, i + 1) "
            "for i in range(S - 1)]), the bubble's steps not masked (a stage that holds no micro-batch yet, or "
            "no more, adds its output to the loss), a stage applying another stage's layers (each stage its own "
            "slice of the stacked parameters), or the loss taken on another stage than the last, or summed over the "
            "micro-batches where the reference averages."
        )
    sequence = [a for a in model if a in sequence_axes(shape)]
    if sequence:  # context parallelism: the tokens split, not the model (trial 45)
        return sequence_forward_hint(
            head.replace("splits the model over", "splits the tokens over"), sequence[0]
        )
    return (
        f"{head}, e.g. a loss sum each shard divides by its own count, a replicated bias "
        f"added on every shard before the psum over {axis!r} "
        f"(it counts {shape[axis]} times; add it after the psum), or a row-parallel output not psum-ed over "
        f"{axis!r}."
    )


def loose_tolerance(ctx: DiagnosisContext) -> Finding:
    """``weak_check``: the step-0 rtol is too loose to tell a x2 or x1/2 error from rounding (a passing report's
    caveat: a failing one has found its error)."""
    if ctx.failing or not ctx.records or ctx.records[0].rtol <= LOOSE_RTOL:
        return None
    return Diagnosis(
        "weak_check",
        f"The tolerance rtol={ctx.records[0].rtol:.3g} is too loose to tell a x2 or x1/2 error from rounding: "
        "lower it where you set it (rtol=, verify --rtol); where it was derived (a low-precision dtype or a huge "
        "batch), check the step in float32.",
    )


def weak_update(ctx: DiagnosisContext) -> Finding:
    """``weak_check``: a passing param leaf whose reference update is not above its tolerance at any step.

    One step's update below its tolerance says nothing of the check when the learning rate is 0 there: a linear
    warm-up from 0 (``optax.linear_schedule(0, lr, n)``, ``optax.warmup_cosine_decay_schedule(0.0, ...)``)
    makes the first update exactly 0. The check is blind to a leaf only when none of the run's steps moved it
    by more than its tolerance, and some step moved it: a leaf the reference never moves (frozen: an optimizer
    group of ``optax.set_to_zero``, a LoRA base weight) is compared as unchanged, which any update of it fails
    (issue #36, trial 21: "raise the learning rate" was said of a frozen bias). Leaves at rounding level at a step (``StepRecord.unresolved``) are left to
    :func:`rounding_level`; a leaf missing from a step's record counts as seen. A passing report's caveat
    only: a failing one has found its error.

    Where a leaf's tolerance is per element (a live check's propagated allowance), its update is compared
    element by element (``LeafError.update_seen``): a leaf's reported ``tolerance`` is one element's, and an
    element whose gradient is at rounding level has an allowance of ~2 lr under Adam, which says nothing of the
    others (trial 19: value.kernel's update 0.00094 against 0.00187 at one of its 1024 elements, 6.94e-05 at the
    rest: a doubled update failed). Elsewhere (a uniform tolerance, a replay) ``reference_change <= tolerance``.
    """
    if ctx.failing or not ctx.records:
        return None

    def below(record: StepRecord) -> set[str]:
        unresolved = set(record.unresolved)
        return {
            e.name
            for e in record.leaves
            if e.kind == "param"
            and e.name not in unresolved
            and e.ok
            and e.reference_change is not None
            and (not e.update_seen if e.update_seen is not None else e.reference_change <= e.tolerance)
        }

    weak = below(ctx.records[0])
    for record in ctx.records[1:]:
        weak &= below(record)
    # a leaf the reference never moves (frozen: a set_to_zero group, a LoRA base) is compared as unchanged, and a
    # larger learning rate would not move it either
    weak &= {e.name for r in ctx.records for e in r.leaves if e.kind == "param" and e.reference_change != 0.0}
    name = next((e.name for e in ctx.records[0].leaves if e.name in weak), None)
    if name is None:
        return None
    n = len(ctx.records)
    which = "first update" if n == 1 else f"update at every one of the run's {n} steps"
    more = f" (and of {len(weak) - 1} more: {_listed_names(weak - {name})})" if len(weak) > 1 else ""
    return Diagnosis(
        "weak_check",
        f"The reference's {which} of {name}{more} is not larger than the tolerance: a wrong update of that leaf "
        "could pass its own comparison unseen (its gradient and optimizer state are still compared). Where that "
        "tolerance is a low-precision compute's rounding carried through a normalizing optimizer (Adam's update "
        "is lr-sized whatever the gradient's size), it grows with the learning rate as the update does; "
        "otherwise raise the learning rate or lower rtol/atol."
        + (
            " The update check (the task's optimizer rerun on the step's own gradients and state, at the "
            "optimizer's own rounding) still compares its update, and passed."
            if all(r.update_checked for r in ctx.records)
            else ""
        ),
        name,
    )


def _listed_names(names, most: int = 4) -> str:
    """Up to ``most`` of ``names``, sorted, and how many more."""
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def diverged_trajectory(ctx: DiagnosisContext) -> Finding:
    """``diverged_trajectory``: the runs separated at step t, but the step re-run from identical state matched."""
    if ctx.diverged is None or not ctx.records:
        return None
    if any(not r.ok for r in ctx.records if r.step < ctx.diverged.step and not r.synchronized):
        return None  # an earlier step failed: "parity holds per step" would be false (a fifth user's trial)
    bad = [e for e in ctx.diverged.leaves if not e.ok]
    worst = max(bad, key=lambda e: e.badness) if bad else None
    t = ctx.diverged.step
    what = (
        ""
        if worst is None
        else f" ({worst.name}: max abs err {worst.max_abs_err:.3g} > tolerance {worst.tolerance:.3g})"
    )
    synced = [r for r in ctx.records if r.synchronized]
    verdict = (
        f"every step from {t} on ({len(synced)} step(s)), run from the reference's pre-step state, matched "
        "within the step-0 tolerance"
        if all(r.ok for r in synced)
        else f"step {t} run from the reference's pre-step state matched, but a later step did not (above)"
    )
    return Diagnosis(
        "diverged_trajectory",
        f"The trajectories diverged at step {t}{what}, but the candidate step reproduces the reference "
        f"step from identical state within tolerance: {verdict}. Two causes fit that: a rounding-level "
        "difference (the reordered batch sum) that flipped a non-smooth op (a ReLU, a max, a top-k) so that "
        "the runs then separate, a property of the model; or a difference smaller than each step's tolerance "
        "that accumulates over the steps (a weight decay applied to a few more leaves, a slightly different "
        f"coefficient){_nearest_synced(ctx, synced)}. Parity holds per step, not for the trajectory after step "
        f"{t}; to tell the two apart, compare fewer steps with a tighter rtol/atol, or a smooth model (no ReLU) "
        "over the same steps: only an accumulating difference separates it too.",
        None if worst is None else worst.name,
    )


def _nearest_synced(ctx: DiagnosisContext, synced: list[StepRecord]) -> str:
    """``"; from identical state, param pos_embed came nearest its tolerance (0.79 of it, step 3)"``: the
    parameter or optimizer-state leaf of the re-run steps nearest its tolerance, but those whose gradient is at
    rounding level (their update follows rounding noise); ``""`` where none has a finite tolerance."""
    best = None
    for r in synced:
        quiet = set(r.unresolved) | set(r.rounding_level)
        for e in r.leaves:
            if e.kind not in ("param", "opt_state") or e.name in quiet or not e.tolerance > 0:
                continue
            if not math.isfinite(e.tolerance) or not math.isfinite(e.max_abs_err):
                continue
            share = e.max_abs_err / e.tolerance
            if best is None or share > best[0]:
                best = (share, e.name, r.step)
    if best is None:
        return ""
    return (
        f"; from identical state, {best[1]} came nearest its tolerance ({best[0]:.2g} of it, step {best[2]})"
    )


def rounding_level(ctx: DiagnosisContext) -> Finding:
    """``rounding_level`` (informational): param leaves whose gradient is at rounding level, over all steps."""
    leaves = sorted({p for r in ctx.records for p in r.unresolved})
    if not leaves:
        return None
    first = leaves[0]
    # what they were checked through: the gradients only where the candidate returned them
    seen = any(e.kind == "grad" for r in ctx.records for e in r.leaves)
    through = (
        "their gradients and optimizer state" if seen else "their optimizer state (no gradients returned)"
    )
    at = [r.step for r in ctx.records if r.unresolved]
    when = "" if len(at) == len(ctx.records) else f" at step{'s' if len(at) > 1 else ''} {words_and(at)}"
    if _all_zero_gradients(ctx):  # no rounding noise: the update comes from the optimizer's state alone
        checked = (
            "that update was checked against the task's optimizer rerun on the candidate's own gradients and "
            f"state, and through {through}."
            if seen
            else f"it was checked through {through}."
        )
        return Diagnosis(
            "rounding_level",
            f"{n_leaves(len(leaves))} {'has' if len(leaves) == 1 else 'have'} a gradient of exactly 0 on both "
            f"sides{when} (e.g. {first}: a clamp that holds it, a stop_gradient or a parameter the loss does not "
            "read at that step): its update comes from the optimizer's state alone (Adam's moments), and its "
            f"tolerance there is the propagated one of a gradient at rounding level; {checked}"
            + _beyond_rounding(ctx),
            first,
        )
    return Diagnosis(
        "rounding_level",
        f"{n_leaves(len(leaves))} {'has' if len(leaves) == 1 else 'have'} a gradient at rounding level{when} (e.g. "
        f"{first}: elements whose gradient is at rounding level (near 0 at that step: a true gradient of 0, such "
        "as an attention key bias, the key third of a fused qkv bias or a LoRA factor A while its B is still 0, or "
        f"one small by chance)): the update of those elements follows that gradient's rounding noise ("
        f"{_noise_update(ctx)}) and cannot be compared element by element; they "
        f"were checked through {through}, with the parameter tolerance propagated through the update."
        + _beyond_rounding(ctx)
        + _at_allowance(ctx),
        first,
    )


# a passing parameter whose error is within this share of its tolerance reads as a near-fail unless said
NEAR_ALLOWANCE = 0.9


def _at_allowance(ctx: DiagnosisContext) -> str:
    """Beside the rounding-level note, where every step passes and some parameter leaves not at rounding level as a
    whole pass within
    :data:`NEAR_ALLOWANCE` of a tolerance at least their largest update (``reference_change``: an allowance that
    large is that of elements whose gradient lies within the gradient's tolerance of 0, whose update under a
    normalizing optimizer follows that gradient's noise, either sign, on each side), what their error at that
    allowance is (trial 47 in bfloat16: pos 0.00614 against 0.00617, 2x its largest update, said nowhere); else
    ``""``."""
    if ctx.failing:
        return ""
    near = [
        e
        for r in ctx.records
        for e in r.leaves
        if e.kind == "param"
        and e.ok
        and e.name not in r.unresolved
        and e.reference_change
        and e.tolerance >= e.reference_change
        and e.max_abs_err >= NEAR_ALLOWANCE * e.tolerance
    ]
    if not near:
        return ""
    e = max(near, key=lambda x: x.max_abs_err / x.tolerance)
    n = len({x.name for x in near})
    which = f"{n} parameter leaves pass" if n > 1 else "1 parameter leaf passes"
    return (
        f" {which} within {1 - NEAR_ALLOWANCE:.0%} of a tolerance at least their largest update (e.g. {e.name}: "
        f"max abs err {e.max_abs_err:.3g}, tolerance {e.tolerance:.3g} at step {e.step}, "
        f"{e.tolerance / e.reference_change:.2g}x its largest update {e.reference_change:.3g}): a tolerance that "
        "large is that of elements whose gradient lies within the gradient's tolerance of 0 (rounding level), "
        "whose update under a normalizing optimizer (Adam's g/sqrt(v)) follows that gradient's noise, of either "
        "sign on each side; an error near it is two such updates apart, not a near-fail."
    )


def _all_zero_gradients(ctx: DiagnosisContext) -> bool:
    """Whether every leaf at rounding level has, at each step it is, a compared gradient of zeros on both sides
    (``LeafError.zeros``): a gradient of exactly 0, not rounding noise."""
    found = False
    for r in ctx.records:
        grads = {e.path: e for e in r.leaves if e.kind == "grad"}
        for name in r.unresolved:
            e = grads.get(name.removeprefix("param "))
            if e is None or not e.zeros:
                return False
            found = True
    return found


def _noise_update(ctx: DiagnosisContext) -> str:
    """How large the update of a rounding-noise gradient is under the task's optimizer (``StepRecord.
    normalized``): lr-sized where it normalizes the update (Adam), noise-sized where it is linear in the
    gradient (SGD, momentum); both said where it is not known."""
    known = [r.normalized for r in ctx.records if r.unresolved and r.normalized is not None]
    if len(known) < sum(1 for r in ctx.records if r.unresolved):
        return "a normalizing optimizer such as Adam makes it lr-sized"
    if any(known):
        return "this optimizer normalizes the update (Adam's g/sqrt(v), Lion's sign): lr-sized"
    return "this optimizer is linear in the gradient, so the update is noise-sized"


def _beyond_rounding(ctx: DiagnosisContext) -> str:
    """Where a rounding-level leaf's parameter fails even the propagated tolerance (a learning rate that differs
    moves it where the reference's does not), the note says so rather than that it could not be compared."""
    bad = [
        e for r in ctx.records for e in r.leaves if e.kind == "param" and not e.ok and e.name in r.unresolved
    ]
    if not bad:
        return ""
    names = sorted({e.name for e in bad})
    return (
        f" Even so, {names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''} "
        f"{'differs' if len(names) == 1 else 'differ'} beyond that tolerance (step {bad[0].step}, {bad[0].name}: max abs err "
        f"{bad[0].max_abs_err:.3g} > tolerance {bad[0].tolerance:.3g}): more "
        "than rounding noise, counted with the failing leaves."
    )


# The rules in the order of their findings (before merging; when nothing failed, the VERDICTS come first).
# the findings that read ratios, factors or forms of the first failing step: not said where it holds NaN
NAN_BLIND = frozenset(
    {
        "update_differs",
        "forward_differs",
        "loss_only",
        "localized",
        "drift",
        "scaled",
        "grads_differ",
        "loss_differs",
        "weak_update",
    }
)

# causes named for a subset of the leaves whose factors the generic fallbacks (GENERIC) cannot read as one
NAMED_SUBSET = frozenset(
    {
        "replicated_reduced",
        "expert_scaling",
        "frozen_state",
        "state_step",
        "target_sync",
        "state_amount",
        "state_partial",
    }
)
GENERIC = frozenset({"localized", "update_differs", "forward_differs", "loss_only"})

RULES: tuple[Rule, ...] = (
    parity,
    reference_diverged,
    non_finite,
    recording_differs,
    local_normalization,
    wrong_axis_reduction,
    replicas_differ,
    model_state,
    frozen_state,
    step_counter,
    weight_count,
    shard_factor,
    replicated_reduced,
    clip_coefficient,
    clip_per_shard,
    local_clip_norm,
    normalization,
    per_shard_loss,
    low_precision_reduction,
    scaled,
    update_rerun,
    loss_differs,
    micro_batch_means,
    grads_differ,
    drift,
    loss_only,
    localized,
    update_differs,
    loose_tolerance,
    weak_update,
    diverged_trajectory,
    rounding_level,
)


def _as_list(found: Finding) -> list[Diagnosis]:
    if found is None:
        return []
    return [found] if isinstance(found, Diagnosis) else list(found)


def diagnose(
    records: Sequence[StepRecord],
    num_shards: int | None = None,
    *,
    diverged: StepRecord | None = None,
    reference_diverged_at: int | None = None,
    mesh_shape: dict[str, int] | None = None,
    micro_batches: int | None = None,
    facts: Mapping[str, LeafFacts] | None = None,
) -> list[Diagnosis]:
    """Explain a comparison: the findings of :class:`ParityReport`, most important first.

    Runs :data:`RULES` in order on one :class:`DiagnosisContext`; findings with the same code are merged, and
    when nothing failed the verdict (``parity`` or ``diverged_trajectory``) comes first. The rules:

    - ``parity``: every leaf of every step within tolerance (not after a divergence of either run).
    - ``reference_diverged``: the reference went non-finite at ``reference_diverged_at``; no ``parity``.
    - ``non_finite``: the first failing step holds NaN or infinite values where the reference's are finite
      (the catalog's findings that read ratios, :data:`NAN_BLIND`, are then not said).
    - ``recording_differs``: a replay whose step, run from the recording's state, returned the task's
      full-batch loss while the recording holds another (``StepRecord.task_loss``): every other finding dropped.
    - ``local_normalization``: the returned gradients' copies differ by one constant per device, the same on
      every leaf (``StepRecord.replica_scales``): all-reduced, then divided by each shard's own count or norm
      (named with the shards' loss weights where the constants are their inverse ratios); no
      ``wrong_axis_reduction`` nor ``scaled`` then.
    - ``wrong_axis_reduction``: replicated copies differ along some mesh axes and agree along the others
      (``mesh_shape``: the candidate's mesh): the gradient reduction missed those axes.
    - ``replicas_differ``: a replicated leaf holds different values on different devices (named leaf).
    - ``frozen_state``: floating non-parameter state the loss reads moved where the reference leaves it (a
      frozen weight trained); ``state_step`` where the reference's step writes it at other steps of the run (a
      copy or sync on another schedule); ``target_sync`` where the reference's step never writes it and the
      candidate's writes it at some steps only, from values of a parameter's shape, beside a counter only it keeps
      (a target network's sync, which only a reference step that makes it checks); ``model_state`` where the
      reference's step writes it and the candidate
      left it exactly as it was; ``state_partial`` where both write it and the candidate left part of it exactly as it
      was, the rest matching; ``state_amount`` where both write it, by amounts further apart than the coarse bound.
    - ``never_stepped`` / ``step_counter``: the update counter is 0, or not the step count (e.g. stepped S
      times per step); also the optimizer's own counter running a whole factor ahead, named "per micro-batch
      (k = ...)" when that factor is ``micro_batches`` (a gradient accumulation's k).
    - ``weight_count``: a gradient factor W/N (or N/W) at the first failing step, W its batch's loss weight and N
      the count of its rows or mask entries (``StepRecord.weight_count``); where W/N is also a shard count's
      factor, another step run from the reference's state decides, else both readings are named.
    - ``summed`` / ``averaged_twice``: a gradient factor of S (S^2) or 1/S (1/S^2) at the first failing step,
      read from the gradients, moments or updates; ``clip_norm``: a factor 1/sqrt(R), R a replica count.
    - ``replicated_reduced``: some leaves' factor is a replica count R while every other leaf matches.
    - ``applied_scale``: as ``clip_coefficient``, where the task's optimizer holds no global-norm clip: the
      gradients were scaled after they were returned, before the optimizer.
    - ``clip_coefficient``: the exposed gradients match while the optimizer's state shows the gradient it was
      given x f on every leaf, f not 1, a power of S or 1/sqrt(R) (named as above where it is): a clip
      coefficient from a norm that was not the global one (a mean of per-rank norms, a partial norm).
    - ``local_clip_norm``: the exposed gradients match while the optimizer's factors differ by leaf group, all
      >= 1: each shard clipped by its own local norm.
    - ``normalization``: the first failing step's update is the mean of per-shard means (``matches``), or the
      returned gradients c times it (``StepRecord.per_shard_factor``: c = S, the per-shard means summed, with
      ``summed`` beside it; c = 1/S with ``averaged_twice``).
    - ``scaled``: another constant gradient factor (unless ``normalization`` explains the step).
    - ``update_rerun``: every compared leaf of the first failing step within tolerance, while the task's
      optimizer rerun on the candidate's own gradients and state gives another update (``StepRecord.update_only``).
    - ``loss_differs``: only the returned loss differs.
    - ``grads_differ``: only the exposed gradients differ.
    - ``drift``: unexplained failure at a step t > 0 after steps that agreed.
    - ``loss_only``: unexplained failure at step 0 while the loss matches (not parity, seed 001) and no
      gradient and no optimizer-state leaf does.
    - ``localized``: as ``loss_only``, but some gradient or optimizer-state leaves match: the first stage with
      failing leaves (gradients, optimizer state, parameters) and what those leaves share (with ``facts``,
      ``{parameter path: LeafFacts}``, their dtype and placement too, as the localization reads them).
    - ``update_differs``: any other unexplained failure (not one reduced step); ``forward_differs`` where the
      forward pass differs first and the optimizer's update from equal inputs matches (the loss computed another
      way at equal parameters).
    - ``weak_check``: rtol too loose to tell x2 from rounding, or a reference update below tolerance at every
      step (passing reports only).
    - ``diverged_trajectory``: ``diverged`` is the trajectory record of the first failing step t > 0 whose
      step, re-run from the reference's pre-step state, matched (``records`` from t on are then synchronized).
    - ``rounding_level``: informational, param leaves whose gradient is at rounding level (``unresolved``);
      it does not make a passing report fail.
    """
    ctx = DiagnosisContext.build(
        records, num_shards, diverged, reference_diverged_at, mesh_shape, micro_batches
    )
    if (
        facts is not None
    ):  # the parameters' facts, a group read as the localization reads it (built when read)
        ctx = dataclasses.replace(ctx, facts=facts)
    found = [d for rule in RULES for d in _as_list(rule(ctx))]
    if any(d.code == "non_finite" for d in found):  # no ratio, factor or form is read from a NaN
        found = [d for d in found if d.code not in NAN_BLIND]
    if any(d.code == "recording_differs" for d in found):  # the recording, not the step: nothing else read
        found = [d for d in found if d.code in ("recording_differs", "rounding_level")]
    if any(d.code in NAMED_SUBSET for d in found):  # a cause named: the generic fallbacks add nothing true
        found = [d for d in found if d.code not in GENERIC]
    if not ctx.failing:
        found.sort(key=lambda d: d.code not in VERDICTS)
    return _merge(found)


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
