"""The functional form of a failing step's difference: what the candidate's change is, as a function of the
reference's.

:func:`fit_form` reads the arrays (float64, on the host) of the failing leaves of one stage at the first failing
step: the reference's value before and after the step and the candidate's after it (for gradients, ``before`` is
0). With ``dr = ref_after - before`` and ``dc = cand_after - before`` it tries, in order:

- ``reference_zero`` (an update): the reference did not move the leaves and the candidate did
  (``max |dr| <= ZERO_RTOL max |dc|``; a warm-up from a learning rate of 0 read one step ahead);
- ``zero``: the candidate did not move the leaves (``max |dc| <= ZERO_RTOL max |dr|``);
- ``sign_flip``: ``dc = -dr`` (within :data:`FIT_RTOL`);
- ``one_number``: the failing set is one leaf of one element (0-D, or shape ``(1,)``): its ratio, a decay term
  ``c*param`` and an offset all fit one number equally, so no form is claimed; each is said with its number
  (:func:`one_number_form`). Several such leaves that share one factor still read as a factor;
- ``moments`` (an update): Adam's moments from a gradient ``c`` times the reference's: every failing first
  moment ``c`` times the reference's change, every second moment ``c**2`` times, any other failing leaf a
  parameter whose update moved as the reference's (the normalized update cancels ``c`` but for ``eps``);
- ``factor``: ``dc = f dr`` with ``f`` constant across every leaf (its elementwise ratio's 10th-90th percentile
  within :data:`FIT_RTOL` of its median, or, given the leaves' tolerances, the residual ``|dc - f dr|`` within
  ``SPREAD_TOLS (1 + |f|) tol`` on every element: :func:`factor_within`; never one median alone) and one ``f`` over all the leaves (a factor
  that is an integer k >= 2 is also what k optimizer steps instead of one produce; below 1 on every leaf of an
  optimizer stage whose optimizer state shows it too, a clip coefficient, a common norm ratio), or ``per_group`` when the constant factors differ
  by group;
- ``decay``: ``dc - dr = a param`` (one coefficient ``a`` over the leaves, residual within :data:`FIT_RTOL`): a
  decoupled weight decay term ``c*lr*param`` applied or skipped, said with ``c = a / lr`` where the learning rate
  is known, else with ``c*lr = a``;
- ``partial``: an update of part of each leaf only: some elements left exactly as they were where the reference
  moved them, the others as the reference's (:func:`~shardcheck.parity.comparison.partial_write.partial_write`);
- ``reset``: some failing optimizer-state leaves hold exactly 0 in the candidate where the reference's hold
  values (a zero / reset accumulator: ``optax.MultiSteps``' ``acc_grads`` after a step that applied its update),
  every other failing leaf one the reference left as it was and the candidate moved (:func:`reset_form`);
- ``state_decay``: every failing leaf is optimizer state whose difference is ``c param`` (``state_params``: the
  matching parameter before the step), one ``c``: a coupled weight decay (``add_decayed_weights`` before the
  optimizer) applied on one side only, read where the parameters do not show it (a learning rate of 0);
- ``none``: no simple form (the worst leaf's ratio spread said).

A leaf whose candidate array is shaped otherwise than the reference's (an optimizer configured otherwise:
Adafactor's factored second moments against full ones) holds no elementwise change to fit: it is left out of the
fit, and where every failing leaf is one, the form is ``shape`` (:func:`shape_form`), never a number.

:func:`form_from_leaves` says what the per-leaf records alone allow (a replay, which holds no arrays): a constant
factor where every failing leaf's ratio is one factor across its recorded samples and they agree, else no simple
form (never a factor read from a whole leaf's norm ratio: a gradient of elements 0 or 2 x the reference's has one
too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from shardcheck.parity.diagnosis.evidence import (
    RATIO_RTOL,
    SPREAD_TOLS,
    WHOLE_NORM,
    WHOLE_RATIO,
    LeafError,
    one_factor_across,
    percentiles,
)
from shardcheck.parity.diagnosis.grouping import common_prefix, n_leaves, words_and

# an elementwise ratio, a sign flip or a decay term fits when its spread (10th-90th percentile) or residual is
# within this fraction of its size
FIT_RTOL = 0.02
# how a form of kind "none" opens where no elementwise form fits (ParityReport.findings points past it to a finding
# that names the computation)
NO_SIMPLE_FORM = "no simple form"
# a leaf "did not move" when its change is below this fraction of the reference's
ZERO_RTOL = 1e-3
# elements whose reference change is below this fraction of the leaf's largest carry no ratio
FLOOR = 0.01
# what a zero update means (fit_form's and form_from_leaves's ``zero``)
ZERO_MEANING = (
    "the candidate's update is zero: a learning rate of 0 at this step (a schedule read one step early), or an "
    "update computed and not applied"
)
# ... and where optimizer moments are among the leaves left as they were: no learning rate leaves a moment as it was
# (it is written from the gradient first), so the gradient was 0 or the step skipped these leaves (trial 50: a
# gradient zeroed for one bias read "a learning rate of 0 at this step" beside its unchanged Adam moments)
ZERO_STATE_MEANING = (
    "the optimizer's moments of these parameters were left as they were too, which no learning rate does (they "
    "are written from the gradient, before any learning rate): their gradient was 0 at this step (dropped, zeroed "
    "or never reduced into them), or the optimizer's step skipped them (a mask, optax.set_to_zero)"
)
# optax's state fields linear in the gradient (Adam's, Lion's mu; momentum's trace; an EMA's ema) and Adam's
# second moment nu (its square); any other field (Adafactor's factored v_row, v_col, v) reads no gradient factor
FIRST_MOMENTS = ("mu", "trace", "ema")
SECOND_MOMENTS = ("nu",)


def moment(path: str) -> str | None:
    """``"first"`` where an optimizer-state path names a field linear in the gradient (:data:`FIRST_MOMENTS`),
    ``"second"`` where it names Adam's ``nu``, else ``None``."""
    parts = set(path.split("."))
    if parts & set(SECOND_MOMENTS):
        return "second"
    return "first" if parts & set(FIRST_MOMENTS) else None


def zero_meaning(paths) -> str:
    """:data:`ZERO_STATE_MEANING` where some of ``paths`` names an optimizer moment (an optimizer-state path,
    ``"opt_state 0.mu.w"``, whose field :func:`moment` reads; a parameter path is never one, a VAE's ``mu`` layer
    included), else :data:`ZERO_MEANING`."""
    state = [str(p).removeprefix("opt_state ") for p in paths if str(p).startswith("opt_state ")]
    return ZERO_STATE_MEANING if any(moment(p) for p in state) else ZERO_MEANING


# what a zero on the copies compared means where the copies of a replicated leaf differ along some axes and the
# gradients differ or were not observed ({example}: ZERO_PIPELINE_EXAMPLE on a pipeline's stage axis, else "")
ZERO_ON_COPIES = (
    "on the copies compared (one device's copy of each leaf), while the copies of these leaves differ along "
    "{where}: the gradient is 0 on some devices and not on the others, not a learning rate of 0: a gradient "
    "computed on some devices only{example} and not psum-ed over {where}"
)
ZERO_PIPELINE_EXAMPLE = (
    " (a replicated leaf used on one pipeline stage: the loss's or the head's on the last, a shared embedding's on "
    "the first)"
)
# ... and where the gradients match: the update reached some devices' copies (or slices) only
ZERO_ON_COPIES_AFTER_GRADIENTS = (
    "on the copies compared (one device's copy of each leaf), while the copies of these leaves differ along "
    "{where} and the gradients match: the update was applied on some devices or slices only, not a learning rate "
    "of 0: with ZeRO (each device updating its own slice of the parameters), the updated slices not all-gathered "
    "over {where} (jax.lax.all_gather(new_slice, {axis}, tiled=True) after the update of each device's slice)"
)


def zero_on_copies_said(axes: Sequence[str], *, gradients_match: bool, pipeline: Sequence[str] = ()) -> str:
    """What a zero on the compared copies means where the copies differ along ``axes`` (non-empty): the
    gradient's (:data:`ZERO_ON_COPIES`, its pipeline example only where some of ``axes`` is in ``pipeline``,
    :func:`~shardcheck.parity.diagnosis.topology.pipeline_axes`), or, where ``gradients_match``, an update
    applied on some devices or slices only (:data:`ZERO_ON_COPIES_AFTER_GRADIENTS`)."""
    where = " and ".join(repr(a) for a in axes)
    if gradients_match:
        axis = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
        return ZERO_ON_COPIES_AFTER_GRADIENTS.format(where=where, axis=axis)
    example = ZERO_PIPELINE_EXAMPLE if any(a in pipeline for a in axes) else ""
    return ZERO_ON_COPIES.format(where=where, example=example)


# what a zero update of the reference's alone means (``reference_zero``)
REFERENCE_ZERO_MEANING = (
    "parameters the task's optimizer freezes (an optax.set_to_zero group of multi_transform, a mask, a LoRA base "
    "weight) that the candidate trains, a learning rate of 0 at this step in the reference and not in the "
    "candidate (a warm-up from 0 that the candidate's schedule reads one step ahead), or an update the reference "
    "skips at this step"
)
FORMS = (
    "zero",
    "reference_zero",
    "sign_flip",
    "one_number",
    "factor",
    "per_group",
    "moments",
    "clip",
    "extra_step",
    "decay",
    "partial",
    "state_decay",
    "replicas",
    "state_amount",
    "state_partial",
    "shape",
    "reset",
    "slices",
    "offset",
    "none",
)


@dataclasses.dataclass(frozen=True)
class Form:
    """The fitted form of a difference.

    Attributes:
        kind: one of :data:`FORMS`.
        sentence: the form in words, with its numbers.
        factor: the common factor (``factor``, ``clip``, ``extra_step``, ``sign_flip``: -1, ``zero``: 0;
            ``one_number``: the one number's ratio, said as one reading among others;
            ``replicas``: the mean of the copies' changes over the reference's, where one form holds on every
            leaf), else ``None``.
        spread: ``(lo, hi)``: the widest 10th-90th percentile of the per-leaf ratios (``factor``; ``replicas``:
            the copies' largest disagreement over the reference's largest change, least and most over the leaves;
            ``state_decay``: each leaf's own ``|c|``, least and most), else ``None``.
        coefficient: the decay coefficient (``decay``: ``a / lr``, or ``a`` where ``lr`` is unknown, as for
            ``one_number`` where the parameter is known;
            ``state_decay``: ``|c|``), else ``None``.
        groups: ``per_group``: ``((factor, (paths...)), ...)``, else ``()``.
        leaves: how many leaves the fit read.
        term: ``decay``: ``|c*lr|``, the fitted share of each parameter's value the difference is (a leaf whose
            ``term * max|param|`` is within its tolerance cannot show it, :func:`~shardcheck.parity.diagnosis.
            localization.decay_unseen`), else ``None``.
    """

    kind: str
    sentence: str
    factor: float | None = None
    spread: tuple[float, float] | None = None
    coefficient: float | None = None
    groups: tuple[tuple[float, tuple[str, ...]], ...] = ()
    leaves: int = 0
    term: float | None = None

    def to_dict(self) -> dict:
        """A JSON-ready dict of the fields."""
        out = dataclasses.asdict(self)
        out["groups"] = [[f, list(p)] for f, p in self.groups]
        return out


def _slice_there(update: bool, still: bool, factor: float | None = None) -> str:
    """What a slice form says of the slices that differ (live and replayed): the candidate's update (``update``)
    or gradient there is exactly 0 (``still``), ``factor`` x the reference's (a live check's fit), or differs."""
    what = "update" if update else "gradient"
    cause = "frozen, or its gradient zeroed" if update else "zeroed, or left out of the step's gradient"
    if still:
        return f"the candidate's {what} there is exactly 0 ({cause})"
    if factor is not None:
        return f"the candidate's {what} there is {factor:.4g} x the reference's"
    return f"the candidate's {what} there differs"


def _on_all(n: int, noun: str = "failing leaves") -> str:
    """``"on all 3 failing leaves"``; ``"on the one failing leaf"`` for one."""
    return f"on the one {noun[:-3]}f" if n == 1 else f"on all {n} {noun}"


def _ratio_stats(dr: np.ndarray, dc: np.ndarray) -> tuple[float, float, float] | None:
    """``(median, p10, p90)`` of ``dc / dr`` over the elements whose ``|dr|`` is at least :data:`FLOOR` of the
    largest, the percentiles the order statistics of ``LeafError.spread``
    (:func:`~shardcheck.parity.comparison.live.spread_ranks`: one leaf's range is said alike by the form and the
    findings); ``None`` where ``dr`` is all zero."""
    from shardcheck.parity.comparison.live import spread_ranks

    top = float(np.max(np.abs(dr), initial=0.0))
    if top == 0 or not math.isfinite(top):
        return None
    keep = np.abs(dr) >= FLOOR * top
    r = np.sort((dc[keep] / dr[keep]).ravel())
    lo, hi = spread_ranks(r.size)
    return float(np.median(r)), float(r[lo]), float(r[hi])


def _check(fn: str, arrays: Mapping, name: str, paths) -> None:
    missing = [p for p in paths if p not in arrays]
    if missing:
        raise ValueError(
            f"{fn}: {name} lacks the leaves {missing[:4]}; pass one array per failing leaf, keyed by its path"
        )


def fit_form(
    before: Mapping[str, np.ndarray],
    ref_after: Mapping[str, np.ndarray],
    cand_after: Mapping[str, np.ndarray],
    *,
    lr: float | None = None,
    optimizer_stage: bool = False,
    update: bool = True,
    tol: Mapping[str, float] | None = None,
    state_params: Mapping[str, np.ndarray] | None = None,
    params: Mapping[str, np.ndarray] | None = None,
    quiet: Mapping[str, np.ndarray] | None = None,
    source: str = "",
    task_decay: float | None = None,
) -> Form:
    """Fit the candidate's change to a functional form of the reference's (module docstring: the forms, in order).

    Args:
        before: ``{path: array}``, each leaf before the step (any float dtype, any shape; read as float64); for
            gradients, zeros (or empty: a missing leaf is taken as 0).
        ref_after: the reference's leaves after the step, same paths and shapes as ``cand_after``.
        cand_after: the candidate's leaves after the step (the failing leaves of one stage).
        lr: the learning rate of the step, where known: the decay coefficient is then ``a / lr``.
        task_decay: ``c*lr``, the decoupled weight decay the task's own optimizer applies (``optimizer_rerun.
            task_decay``), where known: a decay term the candidate adds of that size is said as the decay applied
            twice, not as one the reference lacks.
        optimizer_stage: the leaves are an optimizer's output from equal gradients: a common factor below 1 that
            optimizer-state leaves (paths ``"opt_state <path>"``) show too is then named as a clip coefficient.
        update: the leaves are a step's update (parameters, optimizer state), not values (gradients): an integer
            factor k >= 2 is then named as k optimizer steps instead of one.
        tol: ``{path: the leaf's tolerance}`` (its allowed absolute error, ``LeafError.tolerance``), where known:
            a factor then fits a leaf whose ratio spreads by no more than that tolerance's rounding allows
            (:func:`factor_within`); without it, only one whose 10th-90th percentile lies within
            :data:`FIT_RTOL`.
        state_params: ``{"opt_state <path>": the matching parameter's value before the step}`` for the
            optimizer-state leaves (same shape), where known: a difference ``c param`` on every failing leaf, one
            ``c``, is then read as a coupled weight decay (``state_decay``, :func:`state_decay`).
        params: ``{path: the parameter's value before the step}`` for gradient leaves (``update`` False), where
            known: one number's term ``c*param`` (``one_number``) is then said with its ``c``.
        quiet: ``{path: bool array of the leaf's shape}``, the elements whose reference gradient is at rounding
            level (within ``atol`` of 0: a fused qkv bias's key third), where known: a normalizing optimizer
            moves them by its noise, so their ratio is no factor's; they are left out of the zero, sign-flip
            and factor fits and of the ratio a form without one states (as elsewhere), and the form says so.
            A mask of another shape is ignored.
        source: what ``ref_after`` is, said beside the ratio a form without one states (``"the reference's
            update from equal inputs"``); ``""``: not said.

    Returns:
        The :class:`Form`.

    Raises:
        ValueError: ``cand_after`` empty, or ``ref_after`` lacking one of its leaves.

    A leaf whose arrays differ in shape (``before``, ``ref_after`` and ``cand_after``) is left out of the fit; where
    every leaf is, the form is ``shape`` (:func:`shape_form`).
    """
    fn = "fit_form"
    if not cand_after:
        raise ValueError(f"{fn}: cand_after is empty; pass the failing leaves' arrays, {{path: array}}")
    _check(fn, ref_after, "ref_after", cand_after)
    shapes = {p: (np.shape(ref_after[p]), np.shape(cand_after[p])) for p in sorted(cand_after)}
    other = {
        p: (r, c) for p, (r, c) in shapes.items() if r != c or (p in before and np.shape(before[p]) != c)
    }
    paths = [p for p in shapes if p not in other]
    if not paths:  # no elementwise change to fit: the leaves are shaped otherwise
        return shape_form(other)
    f64 = {}
    for p in paths:
        c = np.asarray(cand_after[p], np.float64)
        b = np.asarray(before[p], np.float64) if p in before else np.zeros_like(c)
        f64[p] = (b, np.asarray(ref_after[p], np.float64) - b, c - b)
    fit, aside = _without_quiet(f64, quiet or {})
    form = _zero_or_flip(fit, update, _quiet_at_zero(f64, quiet) if quiet else f64)
    form = form or _one_number(f64, {p: shapes[p][0] for p in paths}, lr, update, params or {})
    form = form or (_moments(fit, tol or {}) if update else None)
    form = form or _factor(fit, optimizer_stage, update, tol or {})
    if form is not None and form.kind == "none" and update:  # a ratio around 1: a small term, maybe a decay
        form = _decay_fitted(f64, quiet, lr, task_decay) or _offset(f64) or form
    if form is not None and aside and form.kind != "one_number":
        return _said_aside(form, aside)
    form = (
        form
        or (_reset(f64) if update else None)
        or _decay_fitted(f64, quiet, lr, task_decay)
        or _stacked_slices(f64, update)
        or (_partial(f64, tol or {}) if update else None)
        or state_decay(f64, state_params or {})
        or (None if update else _l2_term(f64, params or {}))
        or _offset(f64)
    )
    return form or _said_aside(_no_form(fit, source), aside)


# a slice of a stacked leaf differs where its largest difference is above this share of the leaf's; the others
# must lie below SLICE_QUIET of it (a clean split, not rounding spread over every slice)
SLICE_LOUD, SLICE_QUIET = 0.1, 1e-3


def _stacked_slices(f64: dict, update: bool) -> Form | None:
    """``slices``: the failing leaves (two or more, of ndim >= 2 and several shapes) have one leading size L >= 2
    (the layers nnx.scan / nnx.vmap stack) and
    differs in the same proper subset of its leading slices while the others match (a clean split:
    :data:`SLICE_LOUD`, :data:`SLICE_QUIET`), with what the candidate did there: nothing (its change exactly 0),
    else another change (trial 28: one layer of a scanned stack frozen read "no simple form: ... ratio runs from
    -0 to 1"). ``None`` otherwise."""
    # a stack: several leaves of ndim >= 2, one leading size, their trailing shapes not all one (a module's
    # kernels and biases stacked alike); one matrix's rows are not layers (partial: rows of one leaf)
    shapes = [np.shape(b) for b, _, _ in f64.values()]
    if len(shapes) < 2 or any(len(x) < 2 for x in shapes) or len({x[1:] for x in shapes}) < 2:
        return None
    leads = {x[0] for x in shapes}
    if len(leads) != 1 or next(iter(leads)) < 2:
        return None
    (size,) = leads
    rows = set()
    for _, dr, dc in f64.values():
        per = np.max(np.abs(dc - dr).reshape(size, -1), axis=1, initial=0.0)
        top = float(np.max(per, initial=0.0))
        loud = {int(i) for i in np.nonzero(per > SLICE_LOUD * top)[0]}
        if top == 0 or any(SLICE_QUIET * top < v <= SLICE_LOUD * top for v in per):
            return None
        if rows and loud != rows:
            return None
        rows = loud
    if not rows or len(rows) == size:
        return None
    idx = sorted(rows)
    still = all(not np.any(dc.reshape(size, -1)[idx]) for _, _, dc in f64.values())
    there = _slice_there(update, still, None if still else _slice_factor(f64, idx, size))
    if update and all(p.startswith("opt_state") for p in f64):  # the optimizer's state, not its update
        there = _state_slices(f64, idx, size, still) or there
    which = ", ".join(map(str, idx))
    return Form(
        "slices",
        f"only slice{'s' if len(idx) > 1 else ''} {which} of the leading axis (size {size}: layers stacked by "
        f"nnx.scan or nnx.vmap) differ{'' if len(idx) > 1 else 's'} {_on_all(len(f64))}{_shard_block(idx, size)}; "
        f"every other slice matches: {there}",
        leaves=len(f64),
    )


def _slice_factor(f64: dict, idx: list[int], size: int) -> float | None:
    """The one factor c with the candidate's change (gradient) = c x the reference's on the slices ``idx`` of
    every leaf (least squares, each element within 1e-3 of the largest), else ``None`` (trial 59: one model
    rank's experts' gradients x2 read "differs" without the x2)."""
    cand = np.concatenate([dc.reshape(size, -1)[idx].ravel() for _, _, dc in f64.values()])
    ref = np.concatenate([dr.reshape(size, -1)[idx].ravel() for _, dr, _ in f64.values()])
    den = float(ref @ ref)
    if den == 0.0:
        return None
    c = float(cand @ ref) / den
    return c if np.max(np.abs(cand - c * ref)) <= 1e-3 * np.max(np.abs(cand)) else None


def _shard_block(idx: list[int], size: int) -> str:
    """Where the slices ``idx`` of a leading axis of ``size`` are one aligned block of ``size / m`` (the part one
    shard holds where that axis is split m ways over a mesh axis: experts over ``'model'``; trial 59 read only
    "slices 2, 3 ... layers stacked by nnx.scan"), that in words; else ``""``. One slice is as much a layer or a
    member as a shard: not said."""
    n = len(idx)
    if n < 2 or n * 2 > size or size % n or idx != list(range(idx[0], idx[0] + n)) or idx[0] % n:
        return ""
    m = size // n
    return (
        f" (the block shard {idx[0] // n} of {m} holds where this axis is split {m} ways over a mesh axis, as "
        "experts over 'model' are: that device's slices)"
    )


def _state_slices(f64: dict, idx: list[int], size: int, still: bool) -> str:
    """What the candidate did to slices ``idx`` of stacked optimizer-state leaves (``f64``: ``{"opt_state
    <path>": (before, reference change, candidate change)}``, leading size ``size``): they hold exactly 0 after
    the step (``"... holds exactly 0 there: that slice of the optimizer state was reset (zeroed) ..."``), or were
    left as they were (``still``); ``""`` otherwise. A gradient zeroed or a parameter frozen there would be a
    parameter's or a gradient's difference, which the leaves of optimizer state alone do not show (trial 42: a
    member's SGD momentum trace zeroed after each update read "the candidate's update there is exactly 0
    (frozen, or its gradient zeroed)" beside matching gradients and parameters)."""
    after = [(b + dc).reshape(size, -1)[idx] for b, _, dc in f64.values()]
    if all(not np.any(a) for a in after):
        return (
            "the candidate's optimizer state holds exactly 0 there after the step, where the reference's holds "
            "values: that slice of the optimizer state (a momentum trace, a moment) was reset (zeroed) by the "
            "step, not its gradient or parameters (only optimizer-state leaves differ)"
        )
    if still:
        return (
            "the candidate's optimizer state there is left as it was by the step, where the reference's moves: "
            "that slice of the optimizer state (a momentum trace, a moment) was not updated (restored or "
            "overwritten after the update), not its gradient or parameters (only optimizer-state leaves differ)"
        )
    return ""


RESET_MEANING = (
    "a zero / reset accumulator (optax.MultiSteps empties acc_grads at each step that applies its update: one that "
    "applies at every step, every_k_schedule=1, holds 0 after every step where the task's accumulates)"
)
"""What optimizer state the candidate holds at exactly 0 where the reference's holds values means (``reset``)."""


def _named(paths: Sequence[str]) -> str:
    """``"opt_state acc_grads.*"`` for the paths' common prefix, else the first three (and ``...``)."""
    prefix = common_prefix(list(paths))
    if prefix:
        return f"{prefix}.*"
    return ", ".join(sorted(paths)[:3]) + (", ..." if len(paths) > 3 else "")


def reset_form(zeroed: Sequence[str], top: float | None, still: Sequence[str], moved: float | None) -> Form:
    """The ``reset`` form: the candidate holds the optimizer-state leaves ``zeroed`` at exactly 0 where the
    reference's hold values (up to ``top``, where known): a zero or reset accumulator; and the reference left the
    leaves ``still`` as they were where the candidate moved them (by up to ``moved``, where known): an update the
    candidate applied at a step where the reference only accumulated. Never "no simple form" over a ratio of
    exactly 0 (trial 26: a candidate's MultiSteps(every_k_schedule=1) against the task's 2 read "no simple form
    ... ratio runs from 0 to 0").

    Args:
        zeroed: the paths (as the stage names them) the candidate holds at 0; at least one.
        top: the reference's largest value of them, or ``None``.
        still: the paths the reference left as they were and the candidate moved (may be empty).
        moved: the candidate's largest change of those, or ``None``.

    Raises:
        ValueError: ``zeroed`` is empty.
    """
    if not zeroed:
        raise ValueError("reset_form: zeroed is empty; pass the leaves the candidate holds at exactly 0")
    values = "" if top is None else f" up to {top:.3g}"
    sentence = (
        f"a reset accumulator: the candidate's {_named(zeroed)} ({n_leaves(len(zeroed))}) hold exactly 0 where the "
        f"reference's hold values{values}: {RESET_MEANING}"
    )
    if still:
        by = "" if moved is None else f" (by up to {moved:.3g})"
        sentence += (
            f"; and the reference left {_named(still)} ({n_leaves(len(still))}) as they were where the candidate "
            f"moved them{by}: the candidate applied an update at a step where the reference only accumulated"
        )
    return Form("reset", sentence, factor=0.0, leaves=len(zeroed) + len(still))


def _reset(f64: dict) -> Form | None:
    """:func:`reset_form` where some failing optimizer-state leaves hold exactly 0 in the candidate (and not in the
    reference) and every other failing leaf is one the reference left as it was and the candidate moved."""
    zeroed, still = [], []
    for p, (b, dr, dc) in f64.items():
        if p.startswith("opt_state ") and not np.any(b + dc) and np.any(b + dr):
            zeroed.append(p)
        elif not np.any(dr) and np.any(dc):
            still.append(p)
        else:
            return None
    if not zeroed:
        return None
    top = max(float(np.max(np.abs(f64[p][0] + f64[p][1]))) for p in zeroed)
    moved = max((float(np.max(np.abs(f64[p][2]))) for p in still), default=None)
    return reset_form(zeroed, top, still, moved)


def _without_quiet(f64: dict, quiet: Mapping[str, np.ndarray]) -> tuple[dict, dict[str, tuple[int, int]]]:
    """``f64`` with the change of each leaf's ``quiet`` elements (at rounding level) set to 0 on both sides (no
    ratio is read from an element the reference did not move; a leaf all of whose elements are quiet is kept
    whole: the fit then reads it as any other), and ``{path: (left out, size)}`` of the leaves it touched."""
    fit, aside = dict(f64), {}
    for p, (b, dr, dc) in f64.items():
        mask = quiet.get(p)
        if mask is None or np.shape(mask) != dr.shape:
            continue
        mask = np.asarray(mask, bool)
        n = int(mask.sum())
        if 0 < n < mask.size:
            fit[p] = (b, np.where(mask, 0.0, dr), np.where(mask, 0.0, dc))
            aside[p] = (n, int(mask.size))
    return fit, aside


def _decay_fitted(
    f64: dict, quiet: Mapping[str, np.ndarray] | None, lr: float | None, task_decay: float | None = None
) -> Form | None:
    """:func:`_decay` of every element, else of the elements not at rounding level (:func:`_quiet_at_zero`)."""
    fitted = _decay(f64, lr, task_decay)
    return fitted or (_decay(_quiet_at_zero(f64, quiet), lr, task_decay) if quiet else None)


def _quiet_at_zero(f64: dict, quiet: Mapping[str, np.ndarray]) -> dict:
    """``f64`` with each leaf's ``quiet`` elements (at rounding level: their update follows the gradient's noise,
    lr-sized under Adam) at 0 before and after the step on both sides: a term of the parameter (a decay) fitted on
    the other elements (trial 47: a decay applied twice read "no simple form" from 2 of 1024 such elements)."""
    out = dict(f64)
    for p, (b, dr, dc) in f64.items():
        mask = quiet.get(p)
        if mask is not None and np.shape(mask) == dr.shape and np.any(mask):
            mask = np.asarray(mask, bool)
            out[p] = (np.where(mask, 0.0, b), np.where(mask, 0.0, dr), np.where(mask, 0.0, dc))
    return out


def _said_aside(form: Form, aside: Mapping[str, tuple[int, int]]) -> Form:
    """``form`` with the elements left out of its fit said (:func:`_without_quiet`): ``"; left out of the fit:
    the elements whose reference gradient is at rounding level (32 of 96 of blocks.0.qkv.bias, ...), whose
    update follows that gradient's noise"``."""
    if not aside:
        return form
    listed = [f"{n} of {size} of {p}" for p, (n, size) in sorted(aside.items())]
    shown = ", ".join(listed[:3]) + (f" and {len(listed) - 3} more" if len(listed) > 3 else "")
    return dataclasses.replace(
        form,
        sentence=f"{form.sentence}; left out of the fit: the elements whose reference gradient is at rounding "
        f"level ({shown}), whose update follows that gradient's noise",
    )


ONE_NUMBER = (
    "one number fits every form, so none is claimed from it alone (a factor that is a shard count's is read "
    "against the mesh where a finding names it)"
)
"""Why a difference of one number (the ``one_number`` form) is said with no form."""


def one_number_form(
    name: str,
    shape: tuple[int, ...] | None,
    ratio: float,
    offset: float | None,
    *,
    noun: str = "update",
    param: float | None = None,
    lr: float | None = None,
    size: float | None = None,
) -> Form:
    """The ``one_number`` form: a failing set of one leaf of one element (0-D, or shape ``(1,)``), whose one
    number is at once a constant factor, a decay term ``c*param`` and an offset, so no form is claimed; each is
    said with its number, e.g. ``"one number differs (logit_scale, 0-D): its update is 1.266 x the reference's,
    or equally the reference's plus a decay term -c*lr*param with c*lr = 0.0005 (...), or an offset of -0.00133;
    one number fits every form, so none is claimed from it alone ..."``.

    Args:
        name: the leaf as its stage names it (``"logit_scale"``, ``"opt_state 1.0.mu.logit_scale"``).
        shape: its shape (``()`` or ``(1,)``), or ``None`` where unknown.
        ratio: the candidate's change (its value, for a gradient) over the reference's.
        offset: the candidate's change minus the reference's (signed, in the leaf's units), where known.
        noun: what the number is: ``"update"`` (a parameter's), ``"change"`` (optimizer state) or
            ``"gradient"``.
        param: the parameter's value before the step (an update), where known: the decay term's ``c*lr`` is then
            ``offset / param`` (a decoupled decay ``lr*c*param``).
        lr: the step's learning rate, where known: ``c`` itself is then said.
        size: ``|offset|`` where ``offset`` is not known (a record's ``max_abs_err``).

    Returns:
        ``Form("one_number", ..., factor=ratio, coefficient=|c| (or |c*lr|) where param is known)``.

    Raises:
        ValueError: ``ratio`` is not a finite number.
    """
    if not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
        raise ValueError(
            f"one_number_form: ratio must be a finite number, got {ratio!r}; pass the leaf's ratio"
        )
    dims = "0-D" if not shape else f"shape {tuple(shape)}"
    coef, decay = None, "a term c*param (its c unread: the parameter's value is not at hand)"
    if offset is not None and param:
        a = offset / param
        sign = "-" if a < 0 else "+"
        coef = abs(a / lr) if lr and noun == "update" else abs(a)
        if noun == "update":
            who = "the candidate" if a < 0 else "the reference"
            value = (
                f"c = {coef:.4g} (learning rate {lr:.4g}"
                if lr
                else f"c*lr = {coef:.4g} (the learning rate unknown"
            )
            decay = (
                f"a decay term {sign}c*lr*param with {value}; a decay {who} applies and the other does not)"
            )
        else:
            decay = f"a term {sign}c*param with c = {coef:.4g} (a coupled weight decay on one side)"
    shift = f"an offset of {offset:+.3g}" if offset is not None else f"an offset of {size or 0.0:.3g} in size"
    return Form(
        "one_number",
        f"one number differs ({name}, {dims}): its {noun} is {ratio:.4g} x the reference's, or equally the "
        f"reference's plus {decay}, or {shift}; {ONE_NUMBER}",
        factor=float(ratio),
        coefficient=coef,
        leaves=1,
    )


def _one_number(
    f64: dict, shapes: Mapping[str, tuple], lr: float | None, update: bool, params: Mapping[str, np.ndarray]
) -> Form | None:
    """:func:`one_number_form` where ``f64`` is one leaf of one element whose reference change is not 0 (the
    parameter: ``before`` for an update, ``params`` for a gradient)."""
    if len(f64) != 1:
        return None
    ((path, (b, dr, dc)),) = f64.items()
    if dr.size != 1:
        return None
    r, c = float(dr.reshape(-1)[0]), float(dc.reshape(-1)[0])
    if r == 0 or not math.isfinite(c / r):
        return None
    state = path.startswith("opt_state ")
    noun = "change" if state else "update" if update else "gradient"
    held = params.get(path) if not update else None
    param = float(b.reshape(-1)[0]) if update and not state else None
    if held is not None and np.size(held) == 1:
        param = float(np.asarray(held, np.float64).reshape(-1)[0])
    return one_number_form(path, shapes[path], c / r, c - r, noun=noun, param=param, lr=lr)


def _one_number_record(bad: list[LeafError]) -> Form | None:
    """:func:`one_number_form` of the records alone (a replay: no offset's sign, no parameter value) where
    ``bad`` is one gradient, parameter or optimizer-state leaf of one element with a ratio other than 0."""
    if len(bad) != 1:
        return None
    e = bad[0]
    if e.kind not in ("grad", "param", "opt_state") or e.shape is None or math.prod(e.shape) != 1:
        return None
    if e.ratio is None or not math.isfinite(e.ratio) or e.ratio == 0:
        return None
    noun = {"grad": "gradient", "param": "update", "opt_state": "change"}[e.kind]
    name = e.name if e.kind == "opt_state" else e.path
    return one_number_form(name, e.shape, e.ratio, None, noun=noun, size=e.max_abs_err)


# the state of an optax wrapper, by the leaves it holds whatever its inner optimizer's labels or masks: its own
# (top-level) fields, and the field of a chain's entry
_WRAPPERS = (
    ("optax.MultiSteps'", ("acc_grads", "gradient_step", "mini_step"), "top"),
    ("optax.apply_every's", ("grad_acc",), "entry"),
)


def optimizer_layout(paths) -> str:
    """The optax wrappers whose own state ``paths`` (optimizer-state leaf paths without ``"opt_state "``,
    e.g. ``"acc_grads.a.kernel"``, ``"1.grad_acc.a.kernel"``) hold: ``"optax.MultiSteps' state (acc_grads,
    gradient_step, mini_step)"``, ``"optax.apply_every's state (grad_acc)"``, joined by ``" and "``; ``""`` where
    they hold none (a multi_transform's inner states, which its labels lay out)."""
    parts = [str(p).split(".") for p in paths]
    found = []
    for name, fields, where in _WRAPPERS:
        if where == "top":
            seen = sorted({q[0] for q in parts if q and q[0] in fields})
        else:
            seen = sorted({q[1] for q in parts if len(q) > 1 and q[0].isdigit() and q[1] in fields})
        if seen:
            found.append(f"{name} state ({', '.join(seen)})")
    return " and ".join(found)


def shape_form(shapes: Mapping[str, tuple[tuple, tuple]], missing: Sequence[str] = ()) -> Form:
    """The ``shape`` form: the failing leaves are shaped otherwise in the candidate, or in one run only (a
    replay's ``missing`` evidence), so no elementwise form exists.

    Args:
        shapes: ``{path: (reference shape, candidate shape)}`` of the leaves whose shapes differ (paths as the
            stage names them, ``"opt_state <path>"`` for optimizer state).
        missing: the names of the failing leaves one run lacks, read where ``shapes`` is empty.

    Returns:
        ``Form("shape", ...)``: e.g. ``"the optimizer state is shaped otherwise: 111 leaves differ in shape, e.g.
        opt_state 0.v.k.kernel (32, 32) against the reference's (1,): ..."``, or ``"the optimizer state holds
        other leaves: 4 leaves are in one run only, e.g. opt_state 0.mu.head.bias: ..."``.

    Raises:
        ValueError: both ``shapes`` and ``missing`` are empty.
    """
    names = list(shapes) or list(missing)
    if not names:
        raise ValueError(
            "shape_form: shapes and missing are empty; pass the failing leaves of another layout"
        )
    n, state = len(names), all(p.startswith("opt_state") for p in names)
    if shapes:
        path, (ref, cand) = next(iter(shapes.items()))
        what = "the optimizer state is shaped otherwise" if state else "the leaves are shaped otherwise"
        said = f"{n_leaves(n)} differ{'s' if n == 1 else ''} in shape, e.g. {path} {tuple(cand)} against the reference's {tuple(ref)}"
        why = (
            "another optimizer configuration (Adafactor's factored=False against factored second moments, another "
            "min_dim_size_to_factor, or another optimizer) or state not carried over"
        )
    else:
        what = "the optimizer state holds other leaves" if state else "the runs hold other leaves"
        said = f"{n_leaves(n)} {'is' if n == 1 else 'are'} in one run only, e.g. {names[0]}"
        layout = optimizer_layout(p.removeprefix("opt_state").strip() for p in names) if state else ""
        why = (
            f"another transformation in the candidate's optimizer: the leaves of {layout} are in one run only, "
            "which a wrapper of one run's optimizer holds and the other's lacks (e.g. optax.MultiSteps against "
            "optax.chain(tx, optax.apply_every(k)), whose states are laid out otherwise), not a multi_transform's "
            "labels or a mask"
            if layout
            else "another optimizer configuration (a multi_transform's labels or a mask sending these parameters "
            "to another inner optimizer) or state not carried over"
        )
    why = why if state else "another model or optimizer configuration"
    return Form(
        "shape", f"{what}: {said}: {why}, not a numerical difference (no elementwise form is read)", leaves=n
    )


def _zero_or_flip(f64: dict, update: bool = True, whole: dict | None = None) -> Form | None:
    """A zero update on one side (``reference_zero``, ``zero``) or a sign flip of ``f64``'s changes; ``whole``:
    every element with those at rounding level zeroed before and after (:func:`_quiet_at_zero`), where a decay
    term of the candidate alone is fitted (``f64`` itself where not given)."""
    n = len(f64)
    top_r = max(float(np.max(np.abs(dr), initial=0.0)) for _, dr, _ in f64.values())
    top_c = max(float(np.max(np.abs(dc), initial=0.0)) for _, _, dc in f64.values())
    if update and top_c > 0 and top_r <= ZERO_RTOL * top_c:
        fitted = _decay_fit(f64 if whole is None else whole, after=False)  # dc - dr = a * param, dr ~ 0
        return _reference_zero(n, top_r, top_c, -fitted[0] if fitted is not None and fitted[0] < 0 else None)
    if top_r == 0:
        return None
    if update and top_c <= ZERO_RTOL * top_r:
        return Form(
            "zero",
            f"a zero update: the candidate left these {n} leaves as they were (change at most {top_c:.3g}; the "
            f"reference moved them by up to {top_r:.3g}): {zero_meaning(f64)}",
            factor=0.0,
            leaves=n,
        )
    if not update and top_c == 0:  # values (gradients): zero only where they are, not where they are small
        return Form(
            "zero",
            f"zero values: the candidate's {n_leaves(n)} {'is' if n == 1 else 'are'} 0 (the reference's up to "
            f"{top_r:.3g}): these values are zero",
            factor=0.0,
            leaves=n,
        )
    flip = max(float(np.max(np.abs(dc + dr), initial=0.0)) for _, dr, dc in f64.values())
    if flip <= FIT_RTOL * top_r:
        return Form(
            "sign_flip",
            f"a sign flip: the candidate's change is minus the reference's {_on_all(n, 'leaves')} (|dc + dr| at most "
            f"{flip / top_r:.2g} of the largest change): a gradient ascended, or an update subtracted twice",
            factor=-1.0,
            leaves=n,
        )
    return None


def _reference_zero(n: int, top_r: float, top_c: float | None, decay: float | None = None) -> Form:
    moved = "" if top_c is None else f" by up to {top_c:.3g}"
    meaning = REFERENCE_ZERO_MEANING
    if decay is not None:  # trial 53: a decay by hand after optimizer.update, at a warm-up's lr-0 first step
        moved += (
            f", by -c*param with c = {decay:.4g} on every one of them: a decay term the candidate applies where "
            "the reference's update is 0 (a weight decay applied outside the task's optimizer, by hand after "
            "optimizer.update, or to leaves its mask leaves out)"
        )
        meaning = f"else {meaning}"
    return Form(
        "reference_zero",
        f"a zero update in the reference alone: the reference left these {n_leaves(n)} as they were (change at "
        f"most {top_r:.3g}) and the candidate moved them{moved}: {meaning}",
        leaves=n,
    )


def _state_form(bad: list[LeafError]) -> Form:
    """The form of failing non-parameter floating state (``state model.<path>``,
    :mod:`shardcheck.parity.comparison.model_state`): moved where the reference's step leaves it (a frozen weight
    trained); left exactly as it was where the reference's step writes it (``ratio`` 0: the writes dropped);
    part of it left exactly as it was and the rest written as the reference does (``state_partial``); written by
    both steps, by amounts further apart than the coarse bound (``state_amount``)."""
    n, top = len(bad), max(e.max_abs_err for e in bad)
    what, it, they = ("this leaf", "it", "it") if n == 1 else (f"these {n} leaves", "them", "they")
    was = "was" if n == 1 else "were"
    if all(e.reference_change == 0 for e in bad):
        return Form(
            "reference_zero",
            f"a change where the reference makes none: the reference's step leaves {what} of non-parameter state "
            f"as {they} {was} (a Variable that is not an nnx.Param and that the loss reads: the task's optimizer "
            f"updates wrt=nnx.Param only) and the candidate's step moved {it} by up to {top:.3g}: a weight meant "
            "to stay frozen was trained",
            leaves=n,
        )
    wrote = max((e.reference_change or 0.0) for e in bad)
    if all(e.reference_change and e.ratio == 0 for e in bad):
        return Form(
            "zero",
            f"a zero update: the candidate's step left {what} of non-parameter state exactly as {they} {was} while "
            f"the reference's step wrote {it} (by up to {wrote:.3g}): the step's writes were dropped",
            factor=0.0,
            leaves=n,
        )
    if all(e.kept for e in bad):
        return _state_partial(bad)
    if all(e.reference_change and e.ratio for e in bad):
        lo, hi = min(e.ratio for e in bad), max(e.ratio for e in bad)
        size = f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g} to {hi:.3g}"
        return Form(
            "state_amount",
            f"written by both steps, by other amounts: the candidate's step changed {what} of non-parameter state "
            f"by {size} times the reference's change (largest elementwise change over the reference's; "
            f"{changes_differ(bad)}, which no rounding makes): a running-average momentum or a statistic computed "
            "another way",
            spread=(lo, hi),
            leaves=n,
        )
    return Form(
        "none", f"{NO_SIMPLE_FORM}: {what} of non-parameter state differ (max abs err {top:.3g})", leaves=n
    )


def changes_differ(bad: Sequence[LeafError]) -> str:
    """How far apart the two steps' changes of failing both-written state are (``state_amount``), each number
    of one named leaf: ``"the two changes differ by up to 0.117 (ema.head2/kernel: the reference's step changed it
    by up to 0.0146, the candidate's by up to 0.132), more than half of the reference's largest change in each of
    these 16 leaves"``
    (trial 37: the Form said the largest difference of one leaf beside the bound of another, the finding
    another leaf's pair: 0.117 against 0.00793). The bound is :data:`COARSE` of each leaf's own largest
    reference change (``tolerance / reference_change``)."""
    top = max(bad, key=lambda e: e.max_abs_err)
    bound = top.tolerance / top.reference_change if top.reference_change else 0.0
    half = "half" if abs(bound - 0.5) < 1e-9 else f"{bound:g}"
    each = "there" if len(bad) == 1 else f"in each of these {len(bad)} leaves"
    moved = "" if top.ratio is None else f", the candidate's by up to {top.ratio * top.reference_change:.3g}"
    return (
        f"the two changes differ by up to {top.max_abs_err:.3g} ({top.path.removeprefix('model.')}: the "
        f"reference's step changed it by up to {top.reference_change:.3g}{moved}), more than {half} of the "
        f"reference's largest change {each}"
    )


PARTIAL_MEANING = (
    "a write that covers part of the leaf only (one shard's rows written back, the others' dropped: a jnp.where "
    "that keeps the old rows, or a write of one device's local block)"
)
"""What a write of part of a leaf means (``state_partial``, ``LeafError.kept``)."""


def _state_partial(bad: list[LeafError]) -> Form:
    """``state_partial``: the candidate left part of each leaf exactly as it was (``LeafError.kept``) where the
    reference's step changed it, and wrote the rest as the reference did."""
    from shardcheck.parity.comparison.partial_write import MATCH_RTOL, SAMPLED, said

    n = len(bad)
    others = "recorded samples" if all(e.kept[2] == SAMPLED for e in bad) else "elements"
    what = "this leaf" if n == 1 else f"these {n} leaves"
    parts = words_and([said(e.path, e.kept) for e in bad])
    return Form(
        "state_partial",
        f"part of the leaf left as it was: the candidate's step left part of {what} of non-parameter state "
        f"exactly as it was where the reference's step changed it, {parts}; the other {others} match (within "
        f"{MATCH_RTOL:g} of the reference's largest change): {PARTIAL_MEANING}",
        leaves=n,
    )


# how the spread of a factor fitted within rounding is said (factor_within)
RESOLVED_BASIS = "10th-90th percentile; every element within its rounding of that factor"
# a factor fitted within a leaf's rounding (factor_within with a tolerance) still needs the elementwise ratio's
# 10th-90th percentile within this fraction of it: rounding widens FIT_RTOL's 2% (measured, trial 40, bfloat16
# compute: a real x2 on one group's gradients spread by at most 0.09 of it), never to a ratio across 0
ROUNDED_FIT_RTOL = 0.25


def factor_within(dr: np.ndarray, dc: np.ndarray, tol: float | None) -> tuple[float, float, float] | None:
    """``(f, p10, p90)`` where one factor ``f`` fits the leaf's change ``dc = f dr`` across every element, or
    ``None`` where none does.

    Without a tolerance (``tol`` None or 0): the elementwise ratio's 10th-90th percentile (over the elements of
    ``|dr|`` at least :data:`FLOOR` of the largest) lies within :data:`FIT_RTOL` of its median ``f``.

    With the leaf's tolerance ``tol`` (a correct step's largest difference from the reference, e.g. a bfloat16
    compute's rounding), where the percentiles spread wider: each side may sit up to ``tol`` (the candidate's
    values, ``f`` times larger, up to ``|f| tol``) from the exact change, so a true ``dc = f dr`` leaves a
    residual ``|dc - f dr| <= (1 + |f|) tol`` on every element, and an element's ratio sits up to
    ``(1 + |f|) tol / |dr|`` from ``f``: its spread says nothing where ``|dr|`` is a few ``tol``. The median ``f``
    fits when (1) ``max |dc - f dr| <= SPREAD_TOLS (1 + |f|) tol`` (the rules' constancy margin,
    :data:`~shardcheck.parity.diagnosis.evidence.SPREAD_TOLS`), (2) the factor is told from 1 by more than
    that, ``|f - 1| max|dr| > SPREAD_TOLS (1 + |f|) tol``, or by its elements: the 10th-90th percentile lies
    farther from 1 than it is wide (trial 40: a real x2 on a bias's gradient, ratio 1.955..2.065, where the
    tolerance was 12% of its largest change), and (3) the ratio is still constant across the leaf
    within the precision's allowance: its 10th-90th percentile within :data:`ROUNDED_FIT_RTOL` of ``f`` (the
    float32 rule's :data:`FIT_RTOL`, widened for rounding). The percentiles are returned as measured (said with
    the factor). A difference that is no factor (a gradient of one shard's rows where the full batch's is
    expected) leaves a residual of the size of the values themselves and fails (1) however wide the rounding.
    Measured (trial 8, bfloat16 compute): an lr x4 update, residual 0.16 of the bound's (1 + f) tol; a loss
    weight x6.75, 1.9; one module's unreduced gradient (ratio -0.22..0.57), 7.0. Where the tolerance is a large
    share of the leaf's change (trial 40: a correct step's bfloat16 differences 5-14% of a decay parameter's
    largest gradient), (1) and (2) pass a gradient reduced over one mesh axis of two (ratio -0.16..1.74 about
    0.71, "a constant factor per group" beside float32's "no simple form"); (3) refuses it.
    """
    stats = _ratio_stats(dr, dc)
    if stats is None:
        return None
    m, lo, hi = stats
    if hi - lo <= FIT_RTOL * max(abs(m), 1e-30):
        return stats
    if not tol or not math.isfinite(m) or not math.isfinite(tol):
        return None
    bound = SPREAD_TOLS * (1 + abs(m)) * tol
    if float(np.max(np.abs(dc - m * dr), initial=0.0)) > bound:
        return None
    if max(m - lo, hi - m) > ROUNDED_FIT_RTOL * abs(m):
        return None  # the ratio varies across the leaf by more than rounding spreads a factor
    if abs(m - 1) * float(np.max(np.abs(dr))) <= bound and min(abs(lo - 1), abs(hi - 1)) <= hi - lo:
        return None  # within rounding of no factor at all
    return stats


def _resolved(f64: dict, tol: Mapping[str, float]) -> dict:
    """The leaves whose reference change is told from rounding (``max|dr| > SPREAD_TOLS tol``; every leaf without
    a tolerance), or all of them where none is: a leaf at rounding level (an attention key bias's gradient, its
    noise x S) fits any factor and is checked against the others' (:func:`_factor`)."""
    told = {p: v for p, v in f64.items() if not tol.get(p) or np.max(np.abs(v[1])) > SPREAD_TOLS * tol[p]}
    return told or f64


def _factor(f64: dict, optimizer_stage: bool, update: bool, tol: Mapping[str, float]) -> Form | None:
    fit = _resolved(f64, tol)
    stats = {p: factor_within(dr, dc, tol.get(p)) for p, (_, dr, dc) in fit.items()}
    if any(s is None for s in stats.values()):
        return None  # some leaf's ratio is not one factor across it, even within its tolerance
    plain = all(hi - lo <= FIT_RTOL * max(abs(m), 1e-30) for m, lo, hi in stats.values())
    # else some leaf's factor was fitted within its rounding (factor_within's tolerance)
    basis = "10th-90th percentile" if plain else RESOLVED_BASIS
    common = float(np.median([m for m, _, _ in stats.values()]))
    for p, (_, dr, dc) in f64.items():  # the rounding-level leaves: within their rounding of that factor
        if p not in fit and np.max(np.abs(dc - common * dr)) > SPREAD_TOLS * (1 + abs(common)) * tol[p]:
            return None
    factors = {p: m for p, (m, _, _) in stats.items()}
    lo = min(s[1] for s in stats.values())
    hi = max(s[2] for s in stats.values())
    mid = float(np.median(list(factors.values())))
    n = len(f64)
    if all(abs(f - mid) <= RATIO_RTOL * abs(mid) for f in factors.values()):
        state = any(p.startswith("opt_state ") for p in f64)
        return _one_factor(mid, (lo, hi), n, optimizer_stage, state, update, basis)
    return _per_group(factors, stats, n, basis)


# a normalized update "moved as the reference's" where its ratio's median lies within this of 1 (Adam's eps term)
NORMALIZED_RTOL = 0.1


def _moments(f64: dict, tol: Mapping[str, float]) -> Form | None:
    """Adam's moments from a gradient ``c`` times the reference's (``moments``, :func:`_moments_form`), read from
    the arrays: each moment's factor within its tolerance (:func:`factor_within`), each other leaf's median
    update ratio; ``None`` where some moment holds no one factor or another leaf is optimizer state.

    Trial 56: a sum for a mean of the gradients (not returned) under Adam read "no simple form ... x4 (19
    leaves), x16 (19 leaves)" where the rules said x4 and a divide-twice step read "a constant factor per group"."""
    state = {p: m for p in f64 if p.startswith("opt_state ") and (m := moment(p)) is not None}
    rest = [p for p in f64 if p not in state]
    if any(p.startswith("opt_state ") for p in rest):
        return None
    stats = {p: factor_within(f64[p][1], f64[p][2], tol.get(p)) for p in state}
    moved = [_ratio_stats(f64[p][1], f64[p][2]) for p in rest]
    if any(s is None for s in [*stats.values(), *moved]):
        return None
    return _moments_form({p: (state[p], stats[p]) for p in state}, [m for m, _, _ in moved], len(f64))


def _moments_form(moments: Mapping[str, tuple[str, tuple]], moved: Sequence[float], n: int) -> Form | None:
    """``moments``: ``{path: ("first" | "second", (factor, p10, p90))}`` of the failing optimizer moments;
    ``moved``: the other failing leaves' (parameters') median update ratios. The form where every first moment's
    factor is one ``c`` told from 1, every second moment's ``c**2`` (the square) and every parameter's update moved
    as the reference's within :data:`NORMALIZED_RTOL` (Adam's ``mu / (sqrt(nu) + eps)`` cancels ``c`` but for
    ``eps``); else ``None``."""
    first = [s for m, s in moments.values() if m == "first"]
    second = [s for m, s in moments.values() if m == "second"]
    if not first or not second:
        return None
    c = float(np.median([f for f, _, _ in first]))
    if abs(c - 1) <= RATIO_RTOL or not all(abs(f - c) <= RATIO_RTOL * abs(c) for f, _, _ in first):
        return None
    if not all(abs(f - c * c) <= 2 * RATIO_RTOL * c * c for f, _, _ in second):
        return None
    if any(abs(m - 1) > NORMALIZED_RTOL for m in moved):
        return None
    ratios = sorted({f"{m:.4g}" for m in moved}, key=float)
    params = (
        f"; the parameters that differ ({n_leaves(len(moved))}) moved as the reference's (median update ratio "
        f"{ratios[0] if len(ratios) == 1 else f'{ratios[0]}..{ratios[-1]}'}): Adam's update mu / (sqrt(nu) + "
        "eps) cancels a gradient's scale but for eps"
        if moved
        else ""
    )
    spreads = [s for _, s in moments.values()]
    return Form(
        "moments",
        f"the optimizer's first moments are {c:.4g} x the reference's ({n_leaves(len(first))}) and its second "
        f"moments {c * c:.4g} x ({n_leaves(len(second))}, the square): the gradient the optimizer read was "
        f"{c:.4g} x the reference's{params}",
        c,
        (min(s[1] for s in spreads), max(s[2] for s in spreads)),
        leaves=n,
    )


def _moments_record(bad: list[LeafError]) -> Form | None:
    """:func:`_moments_form` from the records alone (a replay): each moment's ratio constant across its samples
    (``one_factor_across``), each parameter's ratio as recorded."""
    state = {e.path: moment(f"opt_state {e.path}") for e in bad if e.kind == "opt_state"}
    rest = [e for e in bad if e.kind != "opt_state"]
    if None in state.values() or any(e.kind != "param" or e.ratio is None for e in rest):
        return None
    moments = [e for e in bad if e.kind == "opt_state"]
    if not all(e.ratio is not None and one_factor_across(e) for e in moments):
        return None
    stats = {e.path: (state[e.path], (e.ratio, *(e.spread or (e.ratio, e.ratio)))) for e in moments}
    return _moments_form(stats, [e.ratio for e in rest], len(bad))


def _around_one(f: float, spread: tuple[float, float], n: int, basis: str) -> Form:
    """A ratio whose spread holds 1 (``0.9958..1.005``): no factor, a difference of each element by up to the
    spread's distance from 1 (a reduction rounded another way, or a slightly different computation), never a
    scale of the loss or a learning rate."""
    lo, hi = spread
    worst = max(1.0 - lo, hi - 1.0)
    return Form(
        "none",
        f"no factor: the elementwise ratio {_on_all(n)} lies around 1 ({lo:.4g}..{hi:.4g}, {basis}; median "
        f"{f:.4g}): each element differs by up to about {worst:.2g} of its value, which no scale explains (the "
        "values rounded another way, such as a sum in a lower precision or in another order, or computed slightly "
        "differently: a small term added or left out, such as a weight decay of a few tolerances)",
        spread=spread,
        leaves=n,
    )


def _one_factor(
    f: float,
    spread: tuple[float, float],
    n: int,
    optimizer_stage: bool,
    state: bool,
    update: bool,
    basis: str = "10th-90th percentile",
) -> Form:
    lo, hi = spread
    if lo <= 1.0 <= hi:  # a "factor" whose own spread holds 1 scales nothing
        return _around_one(f, spread, n, basis)
    head = f"a constant factor {f:.4g} {_on_all(n)} (each leaf's elementwise ratio within {lo:.4g}..{hi:.4g}, {basis})"
    k = round(f)
    if update and k >= 2 and abs(f - k) <= RATIO_RTOL * k:
        return Form(
            "extra_step",
            f"{head}: the update is {k} x the reference's, as {k} optimizer steps instead of one produce (an extra "
            "step, or the update applied twice)",
            f,
            spread,
            leaves=n,
        )
    if optimizer_stage and 0 < f < 1 and state:
        return Form(
            "clip",
            f"{head}: a clip coefficient {f:.4g}, one norm ratio on every leaf (the gradient scaled by a norm "
            "other than the global one)",
            f,
            spread,
            leaves=n,
        )
    if update and optimizer_stage:  # from equal gradients: no loss scale
        what = f"one scale of the whole update from equal gradients (a learning rate or its schedule{_nesterov(f)})"
    elif update:
        what = "one scale of the whole update (a learning rate or its schedule, a loss scale)"
    else:
        what = "these values scaled by one factor (a scale applied to these leaves only)"
    return Form(
        "factor",
        f"{head}: {what}",
        f,
        spread,
        leaves=n,
    )


MOMENTA = (0.5, 0.8, 0.9, 0.95, 0.99)
"""Momentum coefficients ``mu`` common enough to name in a factor ``1 + mu`` or ``1 / (1 + mu)``."""

NESTEROV_RTOL = 1e-3
"""How close a factor must be to ``1 + mu`` (or its inverse) to be read as one: tighter than :data:`RATIO_RTOL`, so
that a factor 2 or 0.5 (within 0.5% of 1 + 0.99 and its inverse) is not."""


def _nesterov(f: float) -> str:
    """``"; 0.5263 = 1/(1 + 0.9): ..."``: Nesterov momentum on one side only, where ``f`` is ``1 + mu`` or its
    inverse for a common ``mu`` (a first step's Nesterov update is ``1 + mu`` times plain momentum's,
    ``optax.sgd(..., nesterov=True)``), else ``""``."""
    for mu in MOMENTA:
        for k, text in ((1 + mu, f"1 + {mu:g}"), (1 / (1 + mu), f"1/(1 + {mu:g})")):
            if abs(f - k) <= NESTEROV_RTOL * k:
                return (
                    f"; or, as {f:.4g} = {text}, Nesterov momentum {mu:g} on one side only, whose first update is "
                    "1 + mu times plain momentum's"
                )
    return ""


def _per_group(factors: dict[str, float], stats: dict, n: int, basis: str = "10th-90th percentile") -> Form:
    groups: list[tuple[float, list[str]]] = []
    for p, f in sorted(factors.items(), key=lambda kv: kv[1]):
        if groups and abs(f - groups[-1][0]) <= RATIO_RTOL * abs(groups[-1][0]):
            groups[-1][1].append(p)
        else:
            groups.append((f, [p]))
    parts = "; ".join(
        f"x{f:.4g} on {', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''} ({n_leaves(len(ps))})"
        for f, ps in groups
    )
    lo = min(s[1] for s in stats.values())
    hi = max(s[2] for s in stats.values())
    return Form(
        "per_group",
        f"a constant factor per group, each constant across its leaves (ratios within {lo:.4g}..{hi:.4g}, "
        f"{basis} per leaf): {parts}",
        spread=(lo, hi),
        groups=tuple((f, tuple(ps)) for f, ps in groups),
        leaves=n,
    )


def _offset(f64: dict) -> Form | None:
    """``offset``: every element of every failing leaf differs from the reference's by one constant ``k`` (each
    leaf's own least-squares ``k`` within :data:`FIT_RTOL` of it, residuals within it of the difference): a
    value added, or a state started at another value (trial 32: Adagrad's accumulator initialized at 0.01 for
    0.1, -0.09 on every element, read "no simple form ... ratio from -1820 to -41.4")."""
    state = {k: v for k, v in f64.items() if k.startswith("opt_state ")}
    pool = state or f64  # where state fails, the parameters' difference may only follow from it
    diffs = [dc - dr for _, dr, dc in pool.values()]
    if not diffs or any(d.size == 0 for d in diffs):
        return None
    own = [float(np.mean(d)) for d in diffs]
    k = float(np.mean(own))
    size = max(float(np.max(np.abs(d), initial=0.0)) for d in diffs)
    resid = max(float(np.max(np.abs(d - k), initial=0.0)) for d in diffs)
    if k == 0 or size == 0 or resid > FIT_RTOL * size or any(abs(a - k) > FIT_RTOL * abs(k) for a in own):
        return None
    which = _on_all(len(pool))
    if len(pool) < len(f64):
        which = f"{_on_all(len(pool), 'failing optimizer-state leaves')} (the parameters' difference may follow from it)"
    return Form(
        "offset",
        f"a constant offset {k:+.4g} on every element {which} (residual {resid / size:.2g} of it): a value "
        "added, or a state started at another value (an optimizer's initial accumulator, such as "
        "optax.adagrad's initial_accumulator_value, or an initial scale)",
        coefficient=k,
        leaves=len(pool),
    )


def _l2_term(f64: dict, params: Mapping[str, np.ndarray]) -> Form | None:
    """``offset`` read as an L2 term: every failing gradient differs from the reference's by ``c * param``
    elementwise (one least-squares ``c`` over every element, residual within :data:`FIT_RTOL` of the difference),
    ``params`` the parameters before the step; said first, with the constant offset it also is where the
    parameters are one value (trial 45: ``g + 0.1 * p`` on RMSNorm scales of 1 read only "a constant offset
    +0.1 ... an optimizer's initial accumulator"). ``None`` where a leaf's parameter is unknown or shaped
    otherwise, or ``c * param`` does not fit."""
    if not f64 or any(p not in params or np.shape(params[p]) != np.shape(f64[p][2]) for p in f64):
        return None
    bases = {p: np.asarray(params[p], np.float64) for p in f64}
    num = sum(float(np.sum((dc - dr) * bases[p])) for p, (_, dr, dc) in f64.items())
    den = sum(float(np.sum(x * x)) for x in bases.values())
    size = max(float(np.max(np.abs(dc - dr), initial=0.0)) for _, dr, dc in f64.values())
    if den == 0 or size == 0 or num == 0:
        return None
    c = num / den
    resid = max(float(np.max(np.abs(dc - dr - c * bases[p]), initial=0.0)) for p, (_, dr, dc) in f64.items())
    if resid > FIT_RTOL * size:
        return None
    offset = _offset(f64)
    also = (
        f"; the parameters being one value here, it is also {offset.sentence}" if offset is not None else ""
    )
    return Form(
        "offset",
        f"an L2 / weight-decay term c x the parameter added to the gradients, c = {c:.4g} (the difference is "
        f"{c:.4g} x the parameter on every element {_on_all(len(f64))}, residual {resid / size:.2g} of it): "
        "a decay written into the gradients (g + c * p) of leaves the task's optimizer does not decay (those its "
        f"decay mask leaves out: norm scales, biases), or an L2 penalty the task's loss does not hold{also}",
        coefficient=c,
        leaves=len(f64),
    )


def _decay_fit(f64: dict, after: bool) -> tuple[float, float, float] | None:
    """``(a, residual, size)`` of the least-squares ``dc - dr = a * base`` over every element, ``base`` the
    parameter before the step (``after``: the reference's after it), where ``a`` fits within :data:`FIT_RTOL`;
    else ``None``."""
    bases = [b + dr if after else b for b, dr, _ in f64.values()]
    num = sum(float(np.sum((dc - dr) * x)) for x, (_, dr, dc) in zip(bases, f64.values(), strict=True))
    den = sum(float(np.sum(x * x)) for x in bases)
    if den == 0:
        return None
    a = num / den
    size = max(float(np.max(np.abs(dc - dr), initial=0.0)) for _, dr, dc in f64.values())
    resid = max(
        float(np.max(np.abs(dc - dr - a * x), initial=0.0))
        for x, (_, dr, dc) in zip(bases, f64.values(), strict=True)
    )
    if a == 0 or size == 0 or resid > FIT_RTOL * size:
        return None
    return a, resid, size


def _decay(f64: dict, lr: float | None, task_decay: float | None = None) -> Form | None:
    """``decay``: the difference is ``c*lr*param`` on every element, the parameter before the step (AdamW's
    decoupled decay) or, where that does not fit, after the reference's update (a decay applied after the
    optimizer's update: trial 32's embedding tables decayed by 5e-4 of their new value read "no simple form")."""
    if any(k.startswith("opt_state ") for k in f64):  # parameters' decay: optimizer state has its own forms
        return None
    fitted, after = _decay_fit(f64, after=False), False
    if fitted is None and any(np.any(b) for b, _, _ in f64.values()):  # parameters, not gradients (before 0)
        fitted, after = _decay_fit(f64, after=True), True
        # a decay takes a small share of the value: a coefficient near -1 is a candidate near 0 (a zero form's)
        fitted = fitted if fitted is not None and abs(fitted[0]) <= 0.5 else None
    if fitted is None:
        return None
    a, resid, size = fitted
    n = len(f64)
    coef = a / lr if lr else a
    which = (
        "the reference applies it and the candidate skipped it"
        if a > 0
        else "the candidate applies it and the reference does not"
    )
    if a < 0 and task_decay and abs(-a - task_decay) <= FIT_RTOL * task_decay:  # the optimizer's own decay
        own = f"{task_decay / lr:.4g}" if lr else f"c*lr = {task_decay:.4g}"
        which = (
            f"the candidate applies it twice (c = the task's own weight decay, {own}): once in the optimizer, as "
            "the reference does, and once more (a decay added after the update, or a second add_decayed_weights)"
        )
    value = (
        f"c = {abs(coef):.4g} (learning rate {lr:.4g} at this step)"
        if lr
        else f"c*lr = {abs(a):.4g} (the learning rate unknown)"
    )
    where = " (param after the update: a decay applied after the optimizer's update)" if after else ""
    return Form(
        "decay",
        f"a decoupled weight decay term c*lr*param with {value} {_on_all(n)} (the difference is "
        f"{'+' if a > 0 else '-'}c*lr*param{where}, residual {resid / size:.2g} of it): {which} (a decay moves no "
        "leaf whose value is 0, such as a bias still at its zero init: matching leaves of zeros may be decayed "
        "too)",
        coefficient=abs(coef),
        leaves=n,
        term=abs(a),
    )


def _partial(f64: dict, tol: Mapping[str, float]) -> Form | None:
    """``partial``: on every failing leaf the candidate left some elements exactly as they were where the
    reference moved them, and moved the others as the reference did (within the leaf's tolerance, else
    :data:`~shardcheck.parity.comparison.partial_write.MATCH_RTOL` of its largest change): an update applied to
    part of the leaf only (:func:`~shardcheck.parity.comparison.partial_write.partial_write`)."""
    from shardcheck.parity.comparison.partial_write import partial_write, said

    kept = {p: partial_write(b, b + dr, b + dc, match=tol.get(p) or None) for p, (b, dr, dc) in f64.items()}
    if any(k is None for k in kept.values()):
        return None
    n = len(f64)
    return Form(
        "partial",
        f"part of the update left out: the candidate left {words_and([said(p, k) for p, k in kept.items()])} "
        "exactly as they were where the reference moved them; the other elements match (within their "
        "tolerance): an update that covers part of the leaf only (one shard's rows applied, the others' "
        "dropped)",
        leaves=n,
    )


def state_decay(f64: Mapping[str, tuple], params: Mapping[str, np.ndarray]) -> Form | None:
    """``state_decay``: every failing leaf is optimizer state (a momentum trace, Adam's ``mu``) whose difference
    from the reference's is ``c param`` (the matching parameter before the step), one ``c`` across the leaves
    (least squares; every leaf's residual within :data:`FIT_RTOL` of the largest difference, and each leaf's own
    coefficient within :data:`FIT_RTOL` of ``c``): a coupled weight decay (``optax.add_decayed_weights`` before
    the optimizer: its gradient ``g + wd param`` enters the state) applied on one side only. ``c`` is ``wd`` for
    a momentum trace and ``(1 - b1) wd`` for Adam's ``mu``. ``None`` where a leaf has no parameter of its shape
    in ``params`` or no such ``c`` fits.

    Args:
        f64: ``{key: (before, dr, dc)}`` (float64, as :func:`fit_form` builds them).
        params: ``{key: the matching parameter's value before the step}``.
    """
    if not f64 or any(not k.startswith("opt_state ") or k not in params for k in f64):
        return None
    pairs = {k: (np.asarray(params[k], np.float64), dc - dr) for k, (_, dr, dc) in f64.items()}
    if any(p.shape != d.shape for p, d in pairs.values()):
        return None
    den = sum(float(np.sum(p * p)) for p, _ in pairs.values())
    size = max(float(np.max(np.abs(d), initial=0.0)) for _, d in pairs.values())
    if den == 0 or size == 0 or not math.isfinite(size):
        return None
    c = sum(float(np.sum(p * d)) for p, d in pairs.values()) / den
    resid = max(float(np.max(np.abs(d - c * p), initial=0.0)) for p, d in pairs.values())
    own = [float(np.sum(p * d)) / float(np.sum(p * p)) for p, d in pairs.values() if np.any(p)]
    if c == 0 or resid > FIT_RTOL * size or any(abs(a - c) > FIT_RTOL * abs(c) for a in own):
        return None
    n = len(f64)
    which = (
        "the candidate applies it where the reference does not"
        if c > 0
        else "the reference applies it where the candidate skips it, or applies it elsewhere in its chain (after "
        "the momentum, as a decoupled decay on the update: its state then holds no decay)"
    )
    lo, hi = (min(map(abs, own)), max(map(abs, own))) if own else (abs(c), abs(c))
    return Form(
        "state_decay",
        f"a coupled weight decay in the optimizer state: the candidate's state differs from the reference's by "
        f"{'+' if c > 0 else '-'}c*param with c = {abs(c):.4g} {_on_all(n)} (the matching parameter before the "
        f"step; each leaf's own c within {lo:.4g}..{hi:.4g}, residual {resid / size:.2g} of the "
        f"difference): a weight decay added to the gradient before the optimizer (optax.add_decayed_weights; c "
        f"is wd for a momentum trace, (1 - b1) wd for Adam's mu), and {which} (another decay mask or weight decay)",
        coefficient=abs(c),
        spread=(lo, hi),
        leaves=n,
    )


def _no_form(f64: dict, source: str = "") -> Form:
    """No simple form, naming the leaf of the widest elementwise ratio spread; ``source``: what the ratio is
    read against, said beside its percentiles (``"the reference's update from equal inputs"``: a
    replay's report also gives a ratio read over its recorded samples, trial 43)."""
    stats = {p: s for p, (_, dr, dc) in f64.items() if (s := _ratio_stats(dr, dc)) is not None}

    def width(s):  # relative to the ratio's size: 255.9..256.1 is one factor, 0.9..1.1 is not (trial 49)
        return (s[2] - s[1]) / max(abs(s[0]), abs(s[1]), abs(s[2]), 1e-30)

    # the widest of the leaves whose ratio is no one factor (a constant leaf's 255.9..256.1 is no spread to show)
    spread = [p for p in stats if width(stats[p]) > FIT_RTOL] or list(stats)
    worst = max(spread, key=lambda p: stats[p][2] - stats[p][1], default=None)
    worst_stats = None if worst is None else stats[worst]
    if worst is None:
        tail = ""
    elif worst_stats == (0.0, 0.0, 0.0):  # no spread: a leaf left exactly as it was, no range to say
        tail = f"; {worst} was left exactly as it was by the candidate (its change 0 on every element)"
    elif width(worst_stats) <= FIT_RTOL:  # every leaf one factor, the factors apart (trial 50: "1 to 1")
        tail = f"; each leaf's ratio is one factor across it, the leaves' factors differ: {_factor_counts(stats)}"
    else:
        tail = (
            f"; {worst}'s elementwise ratio runs from {worst_stats[1]:.4g} to {worst_stats[2]:.4g} (10th-90th "
            f"percentile{f' over every element, against {source}' if source else ''}), median {worst_stats[0]:.4g}"
        )
    return Form(
        "none",
        f"{NO_SIMPLE_FORM}: no zero update, sign flip, constant factor or decay term fits the {n_leaves(len(f64))}{tail}",
        leaves=len(f64),
    )


def _factor_counts(stats: Mapping[str, tuple[float, float, float]], listed: int = 4) -> str:
    """``"x4 (18 leaves), x16 (18 leaves), x1 (1 leaf)"``: the leaves' median ratios (``stats``: ``{path: (median,
    p10, p90)}``) by their 4-digit value, most leaves first, the first ``listed``."""
    counts: dict[str, int] = {}
    for m, _, _ in stats.values():
        counts[f"{m + 0.0:.4g}"] = counts.get(f"{m + 0.0:.4g}", 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    said = ", ".join(f"x{k} ({n_leaves(n)})" for k, n in ranked[:listed])
    return said + (f" and {len(ranked) - listed} more factors" if len(ranked) > listed else "")


def zero_on_copies(
    form: Form | None, axes: Sequence[str], *, gradients_match: bool = False, pipeline: Sequence[str] = ()
) -> Form | None:
    """``form`` where it is not a ``zero`` one or ``axes`` is empty; else the zero said of the copies compared
    (:func:`zero_on_copies_said`): where the copies of a replicated leaf differ along ``axes`` (``StepRecord.
    replica_axes``), a zero on the compared device's copy is the gradient's there (or, where
    ``gradients_match``, an update applied on some devices or slices only), not a learning rate's."""
    if form is None or form.kind != "zero" or not axes:
        return form
    what = "zero values" if form.sentence.startswith("zero values") else "a zero update"
    said = zero_on_copies_said(axes, gradients_match=gradients_match, pipeline=pipeline)
    return dataclasses.replace(form, sentence=f"{what} {said}")


def form_from_leaves(bad: list[LeafError], *, update: bool = True, optimizer_stage: bool = False) -> Form:
    """The form the records alone allow (no arrays: a replay, or a step the harness fitted nothing for), said as
    :func:`fit_form` says it, from each leaf's ratio and 10th-90th percentile spread (``LeafError.ratio`` /
    ``spread``; a replay's, over its samples): a zero update where every ratio is 0; a constant factor where
    every failing leaf's ratio is constant across it (``one_factor_across``) and they agree within ``RATIO_RTOL``
    (an integer k >= 2 of an ``update``: k optimizer steps, as live); a constant factor per group where they
    are constant but differ (every group listed, as live); else no simple form, naming the leaf of the widest
    spread. A replay's leaf whose recorded samples showed no ratio (``samples == 0``, a sparse gradient's) shows
    no factor: the form is then none, said with its whole-leaf ratio and the other leaves' factors
    (:func:`_unsampled_form`), except a whole-leaf ratio of 0 (its largest update or norm 0: a zero update).
    ``optimizer_stage``: as :func:`fit_form`'s (a factor from equal gradients names no loss scale). One
    gradient, parameter or optimizer-state leaf of one element is ``one_number`` (:func:`one_number_form`: no
    form is told from one number; a loss or a counter is left to the forward stage's reading).

    Raises:
        ValueError: ``bad`` is empty.
    """
    if not bad:
        raise ValueError("form_from_leaves: bad is empty; pass the failing LeafErrors of one stage")
    if all(e.kind == "state" for e in bad):
        return _state_form(bad)
    if update and all(e.reference_change == 0 for e in bad):
        return _reference_zero(len(bad), 0.0, None)
    reset = _reset_record(bad) if update else None
    if reset is not None:
        return reset
    one = _one_number_record(bad)
    if one is not None:  # one number: no form (a loss or a counter is read by the forward stage)
        return one
    if update and (moments := _moments_record(bad)) is not None:
        return moments
    ratios = [e for e in bad if e.ratio is not None and math.isfinite(e.ratio)]
    n = len(bad)
    unsampled = [e for e in ratios if e.samples == 0]
    if unsampled and not (  # a whole leaf's ratio of 0 (its largest update, its norm) is 0 on every element
        len(ratios) == n and all(e.ratio == 0 and (e.samples == 0 or one_factor_across(e)) for e in ratios)
    ):
        return _unsampled_form(ratios, unsampled, n)
    if len(ratios) < n or not all(e.samples == 0 or one_factor_across(e) for e in ratios):
        located = _sampled_slices(bad, update)
        if located is not None:
            return located
        spread = [e for e in ratios if e.spread is not None]
        widest = max(spread, key=lambda e: e.spread[1] - e.spread[0], default=None)
        tail = (
            ""
            if widest is None
            else f"; {widest.name}'s elementwise ratio runs from {widest.spread[0] + 0.0:.4g} to "
            f"{widest.spread[1] + 0.0:.4g} ({percentiles(widest)}), median {widest.ratio + 0.0:.4g}"
        )
        return Form(
            "none",
            f"no simple form read from the records of {'the one failing leaf' if n == 1 else f'the {n} failing leaves'}"
            f"{tail}{_unlocated_slices(bad)}",
            leaves=n,
        )
    if all(e.ratio == 0 for e in ratios):
        said = (
            f"a zero update: the candidate left these {n} leaves as they were: "
            f"{zero_meaning(e.path if e.kind != 'opt_state' else f'opt_state {e.path}' for e in ratios)}"
            if update
            else f"zero values: the candidate's {n_leaves(n)} {'is' if n == 1 else 'are'} 0 at the compared samples: these "
            "values are zero"
        )
        return Form("zero", said, factor=0.0, leaves=n)
    stats = {e.path: (e.ratio, *(e.spread or (e.ratio, e.ratio))) for e in ratios}
    factors = {p: m for p, (m, _, _) in stats.items()}
    mid = float(np.median(list(factors.values())))
    if mid != 0 and all(abs(f - mid) <= RATIO_RTOL * abs(mid) for f in factors.values()):
        lo, hi = min(s[1] for s in stats.values()), max(s[2] for s in stats.values())
        return _one_factor(mid, (lo, hi), n, optimizer_stage, False, update, percentiles(ratios[0]))
    return _per_group(factors, stats, n, percentiles(ratios[0]))


def _stack_size(bad: list[LeafError]) -> int | None:
    """The one leading size L >= 2 of failing leaves stacked as :func:`_stacked_slices` reads them (two or more
    leaves of ndim >= 2, their trailing shapes not all one), else ``None``."""
    shapes = [e.shape for e in bad]
    if len(shapes) < 2 or any(x is None or len(x) < 2 for x in shapes) or len({x[1:] for x in shapes}) < 2:
        return None
    leads = {x[0] for x in shapes}
    return next(iter(leads)) if len(leads) == 1 and next(iter(leads)) >= 2 else None


def _sampled_slices(bad: list[LeafError], update: bool) -> Form | None:
    """A replay's ``slices`` (:func:`_stacked_slices` read from the recorded samples, ``LeafError.slices``): every
    failing leaf is stacked along one leading size and the samples differ in the same proper subset of the slices
    (:data:`SLICE_LOUD` of a leaf's largest sampled difference) while every other slice's match (:data:`SLICE_QUIET`
    of it, or within the leaf's tolerance): a leaf whose samples miss a slice says nothing of it, so each slice of
    the subset must differ at some leaf's samples, each other slice match at some leaf's; ``None`` otherwise."""
    size = _stack_size(bad)
    if size is None or any(e.slices is None or len(e.slices) != size for e in bad):
        return None
    loud, quiet = set(), set()
    for e in bad:
        top = max(gap for _, gap, _ in e.slices)
        calm = max(SLICE_QUIET * top, e.tolerance)
        for i, (k, gap, _) in enumerate(e.slices):
            if k and gap > SLICE_LOUD * top and top > 0:
                loud.add(i)
            elif k and gap <= calm:
                quiet.add(i)
            elif k:  # between: rounding spread over the slices, not a clean split
                return None
    if not loud or loud & quiet or len(loud | quiet) < size or len(loud) == size:
        return None
    idx = sorted(loud)
    still = all(e.slices[i][2] for e in bad for i in idx if e.slices[i][0])
    there = _slice_there(update, still)
    which = ", ".join(map(str, idx))
    return Form(
        "slices",
        f"only slice{'s' if len(idx) > 1 else ''} {which} of the leading axis (size {size}: layers stacked by "
        f"nnx.scan or nnx.vmap) differ{'' if len(idx) > 1 else 's'} {_on_all(len(bad))} at their recorded samples "
        f"({sum(k for e in bad for k, _, _ in e.slices)} in all); every other slice's samples match: {there}",
        leaves=len(bad),
    )


def _unlocated_slices(bad: list[LeafError]) -> str:
    """Where the failing leaves of a replay are stacked (:func:`_stack_size`) and :func:`_sampled_slices` located
    no slice: that the recorded samples cannot, and that the live check reads each slice; else ``""``."""
    size = _stack_size(bad)
    if size is None or all(
        e.samples is None for e in bad
    ):  # a live record's forms are fitted from the arrays
        return ""
    return (
        f"; the failing leaves are stacked along a leading axis of size {size} (layers stacked by nnx.scan or "
        "nnx.vmap: a pipeline's stages), where a difference in some slices only has no constant factor, and the "
        "replay's recorded samples cannot locate a slice here: the live check (verify without --against) reads "
        "each slice"
    )


def _reset_record(bad: list[LeafError]) -> Form | None:
    """:func:`reset_form` of the records alone (a replay): some failing optimizer-state leaves the candidate holds
    at exactly 0 where the recording's hold values (``LeafError.cand_zeros``), every other one unchanged by the
    reference (``reference_change`` 0, or no recorded sample of it changed: ``samples`` 0 with no ratio)."""
    zeroed = [e for e in bad if e.cand_zeros]
    still = [
        e for e in bad if not e.cand_zeros and (e.reference_change == 0 or (e.samples == 0 and not e.ratio))
    ]
    if not zeroed or len(zeroed) + len(still) != len(bad):
        return None
    top = max(e.max_abs_err for e in zeroed)  # |0 - reference|: the reference's largest value
    return reset_form([e.name for e in zeroed], top, [e.name for e in still], None)


def _unsampled_form(ratios: list[LeafError], unsampled: list[LeafError], n: int) -> Form:
    """No simple form, where some failing leaves of a replay showed no ratio at their recorded samples
    (``LeafError.samples == 0``: a sparse gradient's samples are all 0): what was seen, said as seen: those leaves'
    whole-leaf ratios (:data:`~shardcheck.parity.diagnosis.evidence.WHOLE_RATIO`, no factor across a leaf), and
    the other leaves' factors or spread across their samples."""
    parts = []
    for kind in sorted({e.kind for e in unsampled}):
        group = [e for e in unsampled if e.kind == kind]
        names = ", ".join(e.name if kind == "opt_state" else e.path for e in group[:3])
        names += ", ..." if len(group) > 3 else ""
        lo, hi = min(e.ratio for e in group), max(e.ratio for e in group)
        whole = WHOLE_RATIO.get(kind, WHOLE_NORM)
        what = "value" if kind in ("grad", "loss") else "change"
        one = len(group) == 1
        size = f"{lo:.4g}" if f"{lo:.4g}" == f"{hi:.4g}" else f"{lo:.4g}..{hi:.4g}"
        parts.append(
            f"none of the recorded samples of {names} ({n_leaves(len(group))}) holds a nonzero {what} in the "
            f"recording, so no elementwise ratio was read there; {'its' if one else 'their'} {whole}"
            f"{'' if one else 's'} {'is' if one else 'are'} {size} x the reference's (a whole-leaf ratio: no "
            "factor across a leaf is read from it)"
        )
    sampled = [e for e in ratios if e.samples != 0]
    if sampled and all(one_factor_across(e) for e in sampled):
        groups: list[tuple[float, list[str]]] = []
        for e in sorted(sampled, key=lambda e: e.ratio):
            if groups and abs(e.ratio - groups[-1][0]) <= RATIO_RTOL * abs(groups[-1][0]):
                groups[-1][1].append(e.path)
            else:
                groups.append((e.ratio, [e.path]))
        said = "; ".join(
            f"x{f:.4g} on {', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''} ({n_leaves(len(ps))})"
            for f, ps in groups
        )
        parts.append(f"the other leaves' ratios are constant across their recorded samples: {said}")
    elif sampled:
        widest = max(
            (e for e in sampled if e.spread is not None),
            key=lambda e: e.spread[1] - e.spread[0],
            default=None,
        )
        if widest is not None:
            parts.append(
                f"{widest.name}'s elementwise ratio runs from {widest.spread[0]:.4g} to {widest.spread[1]:.4g} "
                f"({percentiles(widest)}), median {widest.ratio:.4g}"
            )
    return Form(
        "none",
        f"no simple form read from the records of {'the one failing leaf' if n == 1 else f'the {n} failing leaves'}: "
        + "; ".join(parts),
        leaves=n,
    )


def shard_reading(factor: float, num_shards: int | None) -> str | None:
    """The reduction a gradient factor reads as where it is a power of the shard count S (x S, x S^2, x 1/S,
    x 1/S^2), in words; ``None`` otherwise (S unknown or 1, or another factor)."""
    s = num_shards
    if not s or s < 2:
        return None
    readings = {
        s: f"a sum over the {s} shards where a mean was due (x{s})",
        s * s: f"the gradient sum-reduced twice (x{s * s} = {s}^2; docs/reduction_cases.md C3)",
        1 / s: f"the gradient averaged twice (x1/{s})",
        1 / (s * s): f"the gradient divided by S={s} three times (x1/{s * s})",
    }
    return next((said for value, said in readings.items() if abs(factor - value) <= RATIO_RTOL * value), None)


def weight_or_shards(factor: float, weight: float | None, num_shards: int | None) -> str | None:
    """Where a gradient factor is at once the batch's total loss weight (or 1 over it: :func:`weight_phrase`)
    and a power of the shard count (:func:`shard_reading`), both readings, the weight's first (trial 37: 16
    rows on data=4, the psum of the loss sums never divided by the weight 16 = 4^2, read "sum-reduced twice"
    beside a Form that said the weight): the records of one step cannot tell them apart; ``None`` where the
    factor is not both."""
    weight_said, shards = weight_phrase(factor, weight), shard_reading(factor, num_shards)
    if weight_said is None or shards is None:
        return None
    return f"either {weight_said}; or {shards}{cannot_tell(factor, weight)}"


def cannot_tell(factor: float, weight: float) -> str:
    """The end of a sentence giving a gradient factor both a loss weight's reading and a shard count's
    (:func:`weight_or_shards`): why the records cannot tell them apart."""
    is_ = "that factor" if factor >= 1 else "1 over that factor"
    return (
        f": this batch's weight {weight:g} is {is_} too, so the factor cannot tell them apart (a step whose batch "
        "weighs otherwise, run from the reference's state, would)"
    )


def weight_phrase(factor: float, weight: float | None) -> str | None:
    """A gradient factor that is the batch's total loss weight W (or 1/W) of a ``(loss_sum, weight)`` loss, said
    as such (``StepRecord.loss_weight``); else ``None`` (no weight known, W = 1, or another factor)."""
    if not weight or weight == 1:
        return None
    if abs(factor - weight) <= RATIO_RTOL * weight:
        return (
            f"{factor:.4g} is this batch's total loss weight ({weight:.4g}: the count the (loss_sum, weight) loss "
            "returns, e.g. its unmasked tokens): the loss sum was not divided by its weight (divide the psum of "
            "the sums by the psum of the weights)"
        )
    if abs(factor * weight - 1) <= RATIO_RTOL:
        return (
            f"{factor:.4g} is 1 over this batch's total loss weight ({weight:.4g}): the mean loss was divided by "
            "its weight once more"
        )
    return None
