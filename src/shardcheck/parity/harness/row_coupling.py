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

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.tolerance.derive import SAFETY_FACTOR, derive_tolerance
from shardcheck.task import LossFn, loss_terms, shards_with_state


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _full_and_combined(loss_fn: LossFn, num_shards: int, graphdef, per_row: bool, params, rest, batch):
    """``(full-batch loss, the shards' combined loss)`` (traced once per loss, S and model); ``per_row``: each
    shard with its rows of a per-row state (:func:`~shardcheck.task.shards_with_state`)."""

    def terms(b, r):
        total, weight = loss_terms(loss_fn, nnx.merge(graphdef, params, r, copy=True), b)
        return total, jnp.ones_like(total) if weight is None else weight

    total, weight = terms(batch, rest)
    xs, at = shards_with_state(batch, rest, num_shards, per_row)
    totals, weights = jax.lax.map(lambda x: terms(*at(x)), xs)
    return total / weight, jnp.sum(totals) / jnp.sum(weights)


def _losses(loss_fn, num_shards: int, model, batch) -> tuple[float, float] | None:
    """:func:`_full_and_combined` with the whole state in every shard, else with per-row state cut by shard;
    ``None`` where the model runs on a shard neither way."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    for per_row in (False, True):
        try:
            out = _full_and_combined(loss_fn, num_shards, graphdef, per_row, params, rest, batch)
        except (TypeError, ValueError):  # a shape error at trace time: a state shaped by the full batch
            continue
        return tuple(float(v) for v in out)
    return None


def coupled_rows(
    loss_fn: LossFn,
    model: nnx.Module,
    batch,
    num_shards: int,
    compute_eps: float = 0.0,
    terms: int | None = None,
) -> tuple[float, float] | None:
    """``(full, combined)`` where the loss on ``batch`` and the combination of its losses on ``num_shards`` equal
    shards differ by more than the loss's own tolerance; ``None`` where they agree, the batch does not split into
    equal shards (refused elsewhere, by its own message), or the model does not run on a shard.

    The tolerance is the live check's for the loss at step 0: ``atol + rtol |full|`` of
    :func:`~shardcheck.parity.tolerance.derive.derive_tolerance` for ``terms`` per-term losses (a sum over rows
    regrouped by shard moves the loss by no more: it is a reordering of that sum), plus at low-precision
    compute ``SAFETY_FACTOR eps_c |full| / sqrt(terms)``. A strategy whose combined loss lies beyond it would
    FAIL on the loss anyway; refused here, it says why.

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
    losses = _losses(loss_fn, num_shards, model, batch)
    if losses is None:
        return None
    full, combined = losses
    n = max(int(terms or next(iter(rows))), 1)
    tol = derive_tolerance("float32", batch_size=n)
    allowed = tol.atol + tol.rtol * abs(full) + SAFETY_FACTOR * compute_eps * abs(full) / math.sqrt(n)
    if not (np.isfinite(full) and np.isfinite(combined)) or abs(full - combined) <= allowed:
        return None
    return full, combined


def check_rows_separable(fn: str, strategy: str, loss: tuple[float, float] | None, num_shards: int) -> None:
    """Refuse ``strategy`` (a built-in that computes the loss per shard) where :func:`coupled_rows` found the
    task's loss coupling the rows of a batch (``loss``: its ``(full, combined)``; ``None``: nothing to refuse).

    Raises:
        ValueError: named by the strategy (a limitation of the strategy on this task, not bad input to the
            whole run), with both losses and what works.
    """
    if loss is None:
        return
    full, combined = loss
    raise ValueError(
        f"{strategy}: cannot compute this task's loss: on the first batch the full-batch loss is {full:.7g}, and "
        f"its {num_shards} shards' losses combined (each shard's loss over its own rows, sum_s loss_sum_s / "
        f"sum_s weight_s) give {combined:.7g}: the loss couples the rows of a batch (a contrastive loss that "
        "scores each row against the whole batch, a normalization over the batch) or is a scalar mean over "
        "unequal masks (return (loss_sum, weight) instead), so a step that computes it per shard computes "
        "another loss. Check it with a GSPMD step (strategy gspmd, or your own step jitted over sharded inputs: "
        "it computes the full batch's loss however the rows are split), or with a step of your own that gathers "
        f"what the loss needs (jax.lax.all_gather of the embeddings) ({fn}, strategy {strategy!r})"
    )
