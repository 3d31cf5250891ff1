"""A loss that couples the rows of a batch, found before a strategy that computes it per shard is run.

The per-shard strategies (``simulation``, ``dp``, ``fsdp``, ``accumulation``, ``multiprocess``) take each shard's
loss on its own rows and combine them once, ``sum_s loss_sum_s / sum_s weight_s`` (C4-C6,
``docs/parity.md`` "One reduction"). That equals the full batch's loss only where the loss is a sum over rows
divided by a count. A contrastive loss that scores every row against every other row of the batch (CLIP,
SigLIP), a normalization over the batch, or a scalar mean over unequal masks is not: each shard's loss over its
own rows is another function, and such a strategy FAILs against the single-device step for a reason of the
task's, not of the strategy's code. :func:`coupled_rows` evaluates the loss once on the first batch and once per
shard at the initial parameters and compares the two; :func:`check_rows_separable` refuses the strategy with
the reason and what works (a GSPMD step computes the full batch's loss however the rows are split).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state
from shardcheck.parity.tolerance.derive import SAFETY_FACTOR, derive_tolerance
from shardcheck.task import LossFn, loss_terms, shards_with_state


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _full_and_combined(loss_fn: LossFn, num_shards: int, graphdef, per_row: bool, params, rest, batch):
    """``(full, combined, gaps, sizes, magnitudes)``: the full-batch loss, the shards' combined loss ``sum_s
    loss_sum_s / sum_s weight_s``, and per parameter leaf ``max |g_full - g_combined|``, the scale its sum
    reorders, ``max(max |g_full|, max sum_s |g_s| / W)``, and ``max |g_full|`` (traced once per loss, S and
    model); ``per_row``: each shard with its rows of a per-row state (:func:`~shardcheck.task.shards_with_state`)."""

    def terms(p, b, r):
        total, weight = loss_terms(loss_fn, nnx.merge(graphdef, p, r, copy=True), b)
        return total, jnp.ones_like(total) if weight is None else weight

    def with_grad(b, r):  # ((loss_sum, weight), d loss_sum / d params): the weight is a count, no gradient
        return jax.value_and_grad(lambda p: terms(p, b, r), has_aux=True)(params)

    (total, weight), g_total = with_grad(batch, rest)
    g_full = jax.tree.map(lambda g: g / weight, g_total)
    xs, at = shards_with_state(batch, rest, num_shards, per_row)
    (totals, weights), g_sums = jax.lax.map(lambda x: with_grad(*at(x)), xs)
    w = jnp.sum(weights)
    g_comb = jax.tree.map(lambda g: jnp.sum(g, axis=0) / w, g_sums)
    gaps = jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y), initial=0.0), g_full, g_comb)
    # the scale of the terms a sharded sum reorders: sum_s |g_s| / W (a gradient of 0 made of shard gradients that
    # cancel, such as an attention key bias's, is reordered at their size, not at its own), at least max |g|
    sizes = jax.tree.map(
        lambda g, parts: jnp.maximum(
            jnp.max(jnp.abs(g), initial=0.0),
            jnp.max(jnp.sum(jnp.abs(parts.astype(jnp.float32)), axis=0) / w, initial=0.0),
        ),
        g_full,
        g_sums,
    )
    magnitudes = jax.tree.map(lambda g: jnp.max(jnp.abs(g), initial=0.0), g_full)
    return total / weight, jnp.sum(totals) / w, gaps, sizes, magnitudes


def float32_model(model: nnx.Module, graphdef32) -> nnx.Module:
    """The probe's model: ``model`` computing in float32 (``graphdef32``, its float32-compute graph from
    :func:`~shardcheck.parity.tolerance.precision.float32_compute`), where a lower compute precision would hide a
    weak coupling in its rounding; ``model`` itself where ``graphdef32`` is ``None`` (nothing computes below
    float32). The model's own Variables are not changed."""
    if graphdef32 is None:
        return model
    return nnx.merge(graphdef32, *nnx.split(model, nnx.Param, ...)[1:])


# how far beyond its tolerance a gradient's difference must lie to show a coupling (coupled_rows): any gradient's,
# and a gradient's that the difference moves by less than SYSTEMATIC_FRACTION of its own largest element (a
# systematic change of a gradient well above rounding level, not the noise of one at rounding level, whose
# difference was 0.15 to 0.88 of it on tiny-lm's attention key biases at 1.2 to 3.4 times its tolerance; trial
# 55's load-balancing loss of weight 0.05 moved its router's kernel gradient by 0.0085 of it, 20.7 times)
GRADIENT_MARGIN = 64.0
SYSTEMATIC_MARGIN = 8.0
SYSTEMATIC_FRACTION = 0.05


class RowCouplingError(ValueError):
    """A strategy that computes the loss per shard refused a task whose loss couples the rows of a batch
    (:func:`check_rows_separable`): a limitation of that strategy on this task, said as such."""


@dataclasses.dataclass(frozen=True)
class Coupling:
    """How the loss couples the rows of a batch (:func:`coupled_rows`).

    Attributes:
        full, combined: the full-batch loss and the shards' combined one.
        leaf: the parameter whose gradient differs most beyond its tolerance, or ``None`` where only the loss
            tells (its path, e.g. ``"blocks.0.moe.router.kernel"``).
        err, tol: that gradient's largest elementwise difference and its tolerance (0 where ``leaf`` is None).
    """

    full: float
    combined: float
    leaf: str | None = None
    err: float = 0.0
    tol: float = 0.0


def _measured(loss_fn, num_shards: int, model, batch):
    """:func:`_full_and_combined` with the whole state in every shard, else with per-row state cut by shard, on
    the host: ``(full, combined, {path: (gap, size, eps)})`` (``eps``: the gradient's storage rounding beyond
    float32's, :func:`_eps`); ``None`` where the model runs on a shard neither way."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    for per_row in (False, True):
        try:
            out = _full_and_combined(loss_fn, num_shards, graphdef, per_row, params, rest, batch)
        except (TypeError, ValueError):  # a shape error at trace time: a state shaped by the full batch
            continue
        full, combined, gaps, sizes, magnitudes = jax.device_get(out)
        sizes, gaps, magnitudes = flatten_state(sizes), flatten_state(gaps), flatten_state(magnitudes)
        # each gradient's own storage rounding: bfloat16 parameters have bfloat16 gradients (1 ulp = 2**-8 of them)
        eps = {k: _eps(v) for k, v in flatten_state(nnx.as_pure(params)).items()}
        return (
            float(full),
            float(combined),
            {k: (float(v), float(sizes[k]), eps.get(k, 0.0), float(magnitudes[k])) for k, v in gaps.items()},
        )
    return None


def _eps(a) -> float:
    """The machine epsilon of an array's dtype where coarser than float32's, else 0."""
    eps = float(jnp.finfo(a.dtype).eps)
    return eps if eps > float(jnp.finfo(jnp.float32).eps) else 0.0


def coupled_rows(
    loss_fn: LossFn,
    model: nnx.Module,
    batch,
    num_shards: int,
    compute_eps: float = 0.0,
    terms: int | None = None,
) -> Coupling | None:
    """How the loss on ``batch`` and the combination of its losses on ``num_shards`` equal shards differ, where
    the losses or some parameter's gradients differ by more than their own tolerance; ``None`` where they
    agree, the batch does not split into equal shards (refused elsewhere, by its own message), or the model does
    not run on a shard.

    The tolerances are the live check's at step 0 for ``terms`` per-term losses
    (:func:`~shardcheck.parity.tolerance.derive.derive_tolerance`: ``atol + rtol max|x|`` for the loss and each
    gradient; a sum over rows regrouped by shard moves them by no more: it is a reordering of that sum), plus
    at low-precision compute ``SAFETY_FACTOR eps_c |loss| / sqrt(terms)`` for the loss, and for each gradient
    ``SAFETY_FACTOR (eps_c + eps_g)`` of its size, ``eps_g`` its own dtype's rounding where coarser than float32
    (bfloat16 parameters), a gradient counting only beyond ``GRADIENT_MARGIN`` times its tolerance (a
    rounding-level gradient's noise can exceed it a few times). A strategy whose combined loss or gradients lie
    beyond them would FAIL anyway; refused here, it says why. The gradients show a weak coupling the loss hides (trial 14: a load-balancing loss of
    weight 0.01 over the whole batch's routing, in the routers' gradients).

    Args:
        loss_fn: the task's ``loss_fn(model, batch)``, a scalar mean or ``(loss_sum, weight)``.
        model: the model at its initial parameters (not changed: the forward pass runs on a copy).
        batch: one batch, every leaf ``(B, ...)``.
        num_shards: S >= 2.
        compute_eps: the unit roundoff of the model's compute dtype (0 for float32).
        terms: the batch's per-term losses (``Task.terms``); default: its row count.
    """
    rows = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(batch)}
    if num_shards < 2 or len(rows) != 1 or None in rows or next(iter(rows)) % num_shards:
        return None
    measured = _measured(loss_fn, num_shards, model, batch)
    if measured is None:
        return None
    full, combined, gaps = measured
    n = max(int(terms or next(iter(rows))), 1)
    tol = derive_tolerance("float32", batch_size=n)
    if not (np.isfinite(full) and np.isfinite(combined)):
        return None
    allowed = tol.atol + tol.rtol * abs(full) + SAFETY_FACTOR * compute_eps * abs(full) / math.sqrt(n)
    # a gradient tells only beyond its tolerance: a reordering moves it by no more than that, and a gradient at
    # rounding level (an attention key bias's: its true gradient is 0) by noise a few times it; a coupled term
    # moves it systematically (trial 14's load-balancing loss: 477x; trial 55's: 20.7x, 0.0085 of the gradient)
    allowed_by_leaf = {
        p: (gap, tol.atol + (tol.rtol + SAFETY_FACTOR * (compute_eps + eps)) * size, magnitude)
        for p, (gap, size, eps, magnitude) in gaps.items()
    }
    shown = [
        (p, gap, t)
        for p, (gap, t, magnitude) in allowed_by_leaf.items()
        if _shows_coupling(gap, t, magnitude)
    ]
    leaf = max(shown, key=lambda x: x[1] / x[2] if x[2] > 0 else math.inf, default=None)
    if abs(full - combined) <= allowed and leaf is None:
        return None
    return Coupling(full, combined, *(leaf if leaf else (None, 0.0, 0.0)))


def _shows_coupling(gap: float, tol: float, magnitude: float) -> bool:
    """Whether a gradient's difference ``gap`` between the full batch's and the shards' combined loss shows a
    coupling: beyond ``GRADIENT_MARGIN`` times its tolerance ``tol``, or beyond ``SYSTEMATIC_MARGIN`` times it
    while less than ``SYSTEMATIC_FRACTION`` of the gradient's largest element ``magnitude`` (a systematic change
    of a gradient above rounding level)."""
    if not np.isfinite(gap):
        return False
    return gap > GRADIENT_MARGIN * tol or SYSTEMATIC_MARGIN * tol < gap < SYSTEMATIC_FRACTION * magnitude


def check_rows_separable(
    fn: str, strategy: str, coupling: Coupling | None, num_shards: int, in_float32: bool = False
) -> None:
    """Refuse ``strategy`` (a built-in that computes the loss per shard) where :func:`coupled_rows` found the
    task's loss coupling the rows of a batch (``None``: nothing to refuse). ``in_float32``: the coupling was
    measured on the float32 probe of a model that computes in a lower precision (the message says so).

    Raises:
        RowCouplingError: (a ValueError) named by the strategy (a limitation of the strategy on this task, not bad
            input to the whole run), with both losses (and the gradient that shows it) and what works.
    """
    if coupling is None:
        return
    # the probe of a model that computes in a lower precision runs it in float32 (trial 33: a bfloat16 model's
    # refusal quoted the float32 loss as "the full-batch loss")
    computed = (
        " (computed in float32, where the model's low-precision rounding would hide a coupling)"
        if in_float32
        else ""
    )
    grad = (
        ""
        if coupling.leaf is None
        else f" (and the gradient of {coupling.leaf} by {coupling.err:.3g}, beyond its tolerance {coupling.tol:.3g})"
    )
    raise RowCouplingError(
        f"{strategy}: cannot compute this task's loss: on the first batch the full-batch loss{computed} is "
        f"{coupling.full:.7g}, and its {num_shards} shards' losses combined (each shard's loss over its own rows, "
        f"sum_s loss_sum_s / sum_s weight_s) give {coupling.combined:.7g}{grad}: the loss couples the rows of a "
        f"batch ({COUPLINGS}) or is a scalar mean over unequal masks (return (loss_sum, weight) instead), so a "
        f"step that computes it per shard computes another loss. {CHECK_IT_SO} ({fn}, strategy {strategy!r})"
    )


COUPLINGS = (
    "a contrastive loss that scores each row against the whole batch, an auxiliary loss over the whole batch's "
    "routing, an expert capacity over the whole batch's tokens that drops those past it, a normalization over "
    "the batch"
)
"""The losses that couple the rows of a batch, as the refusals name them (trial 59: a capacity-limited router
was not among them)."""

CHECK_IT_SO = (
    "Check it with a GSPMD step (strategy gspmd, or your own step jitted over sharded inputs: it computes the full "
    "batch's loss however the rows are split), or with a step of your own that gathers what the loss needs "
    "(jax.lax.all_gather of the embeddings, psum of the routing counts)"
)
"""What checks a task whose loss couples the rows, as the refusals say it."""


def refuse_late_coupling(fn: str, strategy: str, report, num_shards: int | None) -> None:
    """Refuse ``strategy`` (a built-in that computes the loss per shard) where its check ``report`` (a
    :class:`~shardcheck.ParityReport`) FAILs as ``per_shard_loss`` first: the loss couples the rows at a later
    step, at that step's parameters or batch, where the probe of the first batch at the initial parameters found
    none (trial 59: a capacity-limited MoE router that drops no token at first read FAIL for simulation, dp,
    fsdp and accumulation at step 1, the advice addressed to a step the user did not write).

    Raises:
        RowCouplingError: naming the step, both losses and what works.
    """
    if not report.codes or report.codes[0] != "per_shard_loss":
        return
    first = next(r for r in report.steps if not r.ok)
    combined = (
        ""
        if first.candidate_loss is None
        else f", and its shards' losses combined give {first.candidate_loss:.7g}"
    )
    raise RowCouplingError(
        f"{strategy}: cannot compute this task's loss: at step {first.step} the full-batch loss is "
        f"{first.loss:.7g}{combined} ({num_shards or 'S'} shards, each its loss over its own rows): the loss couples "
        f"the rows of a batch at that step's parameters or batch, though it did not on the first batch at the "
        f"initial ones ({COUPLINGS}), so a step that computes it per shard computes another loss. {CHECK_IT_SO} "
        f"({fn}, strategy {strategy!r})"
    )
