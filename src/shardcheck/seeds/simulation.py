"""The data-parallel gradient-reduction simulation of seed ``000_f7b4ea9cf28c5420.txt``.

One model, one optimizer; the batch is cut into equal contiguous shards; every shard is evaluated at the same
initial parameters and its loss and gradients are saved; the saved gradient trees are summed leaf by leaf and each
summed leaf is divided by the shard count; exactly one optimizer update follows. No mesh, no collectives: this is
the arithmetic a data-parallel all-reduce (``lax.pmean``) must reproduce. Both entrypoints are adapters: they
validate ``x``/``y``, cut the shards and run the engine's ``simulation`` step
(:func:`shardcheck.steps.simulation.simulation_step`) of the seeds' loss.

The shards are visited by one ``lax.scan`` inside one jitted function, so the traced program does not grow with
``num_shards``. The scan carries the running leafwise sum, a left fold ``((0 + g_0) + g_1) + ...`` in shard order,
exactly the seed's ``sum(parts)``; with ``keep_shard_grads=True`` it also emits every shard's gradient tree as a
stacked output (as the seed describes), otherwise nothing of size S but the losses (memory flat in S).

Why a scan and not ``jax.vmap`` (measured in ``benchmarks/README.md``, "Findings"): the scan works on one
``(B/S, D)`` block at a time, which stays in cache, and the vmapped form's ``jnp.sum(stacked, axis=0)`` lowers
to a reduction over a short leading axis that XLA:CPU runs far slower than a fold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate
from shardcheck.losses import mse_batch_loss, regression_batch_loss
from shardcheck.seeds.reference import fresh_linear, validate_entrypoint
from shardcheck.steps.simulation import simulation_step

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ReducedStep:
    """What one simulated data-parallel step computed.

    Attributes:
        loss: 0-d float32, the reduced pre-update loss: the mean of ``shard_losses`` (equal shards), or the sum of
            weighted squared errors over all shards divided by the total weight (weighted mode).
        shard_losses: ``(S,)`` float32, each shard's pre-update loss.
        shard_grads: the S saved gradient trees stacked on a leading axis of size S (each leaf ``(S, *shape)``),
            the gradient of each shard's own loss; ``None`` in streaming mode.
        grads: the reduced gradient tree that was applied (leaves shaped like the parameters).
        equal_weight_loss: weighted mode only (else ``None``): the equal-weight mean of ``shard_losses`` that a
            naive reduction would return.
        equal_weight_grads: weighted mode with saved shard gradients only (else ``None``): the equal-weight mean
            of ``shard_grads``.
    """

    loss: jax.Array
    shard_losses: jax.Array
    shard_grads: PyTree | None
    grads: PyTree
    equal_weight_loss: jax.Array | None = None
    equal_weight_grads: PyTree | None = None


def apply_reduced_update(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    xs: jax.Array,
    ys: jax.Array,
    ws: jax.Array | None,
    keep_shard_grads: bool = True,
) -> ReducedStep:
    """Traceable body of :func:`reduced_sgd_step` over pre-split shards ``xs: (S, M, D)``, ``ys: (S, M, K)``.

    The engine's ``simulation`` step (:func:`shardcheck.steps.simulation.simulation_step`) of the seeds' loss
    (:func:`shardcheck.losses.regression_batch_loss`) on the S shards laid end to end. ``ws: (S, M)`` per-example
    weights switch on weighted mode (zero weight marks padding or a masked example): each shard gives its
    ``(weighted sum, weight total)`` and the step divides the summed sums by the summed weights once.
    """
    num_shards = xs.shape[0]
    rows = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731  (S, M, ...) -> (S * M, ...)
    batch = (rows(xs), rows(ys)) if ws is None else (rows(xs), rows(ys), rows(ws))
    out = simulation_step(
        regression_batch_loss, num_shards, model, optimizer, batch, keep_shard_grads=keep_shard_grads
    )
    if ws is None:
        return ReducedStep(out.loss, out.shard_losses, out.shard_grads, out.grads)
    counts = jnp.sum(ws, axis=1)  # a shard of weight 0 (all padding) has loss 0, not 0 / 0
    safe = jnp.where(counts > 0, counts, 1)
    shard_losses = jnp.where(counts > 0, out.shard_losses, 0.0)
    shard_grads = equal_weight_grads = None
    if out.shard_grads is not None:
        shape = lambda g: safe.reshape((-1,) + (1,) * (g.ndim - 1))  # noqa: E731
        shard_grads = jax.tree.map(lambda g: g / shape(g), out.shard_grads)
        equal_weight_grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), shard_grads)
    return ReducedStep(
        loss=out.loss,
        shard_losses=shard_losses,
        shard_grads=shard_grads,
        grads=out.grads,
        equal_weight_loss=jnp.mean(shard_losses),
        equal_weight_grads=equal_weight_grads,
    )


@functools.partial(jax.jit, static_argnums=(0, 5))
def _reduced_step_jit(graphdef, state, xs, ys, ws, keep_shard_grads):
    model, optimizer = nnx.merge(graphdef, state)
    result = apply_reduced_update(model, optimizer, xs, ys, ws, keep_shard_grads)
    return result, nnx.state((model, optimizer))


jax.tree_util.register_dataclass(
    ReducedStep,
    data_fields=["loss", "shard_losses", "shard_grads", "grads", "equal_weight_loss", "equal_weight_grads"],
    meta_fields=[],
)


def split_shards(
    fn: str,
    x: jax.Array,
    y: jax.Array,
    num_shards: int,
    weights=None,
    shard_sizes: Sequence[int] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Cut a validated batch into ``num_shards`` contiguous shards of equal length.

    Equal mode (``weights`` None): ``B % S == 0`` is required; returns ``(S, B/S, D)``, ``(S, B/S, K)``, None.
    Weighted mode: shards follow ``shard_sizes`` (default: ``np.array_split`` sizes), each padded with
    zero-weight rows to the longest, and ``(S, M)`` weights are returned.

    Raises:
        ValueError: uneven batch in equal mode, more shards than examples, bad ``weights`` or ``shard_sizes``.
    """
    batch = x.shape[0]
    if shard_sizes is not None and weights is None:
        raise ValueError(
            f"{fn}: shard_sizes={tuple(shard_sizes)} without weights= would average per-shard means with equal "
            "weight, which is wrong for uneven shards (docs/reduction_cases.md C4); pass weights=np.ones(B) to weight "
            "every example equally"
        )
    if weights is None:
        _validate.check_equal_shards(fn, batch, num_shards)
        return (
            x.reshape(num_shards, batch // num_shards, x.shape[1]),
            y.reshape(num_shards, batch // num_shards, y.shape[1]),
            None,
        )
    w = np.asarray(weights, dtype=np.float64) if not isinstance(weights, jax.Array) else np.asarray(weights)
    if w.shape != (batch,):
        raise ValueError(f"{fn}: weights must have shape (B,) = ({batch},), got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"{fn}: weights must be finite, >= 0 and not all zero; got sum {w.sum()}")
    if num_shards > batch:
        raise ValueError(f"{fn}: num_shards={num_shards} is more shards than examples (batch size {batch})")
    if shard_sizes is None:
        sizes = [len(a) for a in np.array_split(np.arange(batch), num_shards)]
    else:
        sizes = [int(s) for s in shard_sizes]
        if len(sizes) != num_shards or sum(sizes) != batch or min(sizes) < 1:
            raise ValueError(
                f"{fn}: shard_sizes={tuple(sizes)} must be {num_shards} positive sizes summing to the batch size "
                f"{batch}"
            )
    longest = max(sizes)
    starts = np.cumsum([0, *sizes[:-1]])
    offsets = np.arange(longest)
    valid = offsets[None, :] < np.asarray(sizes)[:, None]
    index = np.where(valid, starts[:, None] + offsets[None, :], 0)
    ws = np.where(valid, w[index], 0.0).astype(np.float32)
    return x[index], y[index], jnp.asarray(ws)


def reduced_sgd_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x,
    y,
    num_shards: int,
    *,
    weights=None,
    shard_sizes: Sequence[int] | None = None,
    keep_shard_grads: bool = True,
) -> ReducedStep:
    """The simulated data-parallel step of seed 000, in place: per-shard gradients, sum, divide, one update.

    The batch is split into ``num_shards`` equal contiguous shards. Each shard's loss
    ``jnp.mean((model(xs) - ys) ** 2)`` and gradient tree are computed at the same (initial) parameters and saved;
    the trees are summed leaf by leaf and every summed leaf divided by ``num_shards``; then
    ``optimizer.update(model, grads)`` runs exactly once. For equal shards this equals the full-batch
    :func:`~shardcheck.sgd_step` up to floating-point rounding.

    Weighted mode (``weights`` given; ``docs/reduction_cases.md`` C4-C6): uneven shards (``shard_sizes``, default
    ``np.array_split`` sizes) and masked examples are allowed; each shard contributes its weighted sum of squared
    errors and its total weight, and the reduction divides the summed sums by the summed weights once, which
    reproduces the full-batch weighted loss and gradients exactly. The naive equal-weight mean of the per-shard
    means is reported beside it (``equal_weight_loss``).

    Args:
        model: an ``nnx.Module`` without batch statistics or RNG streams; updated in place.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; updated in place (one step).
        x: ``(B, D)`` float inputs (integers converted to float32).
        y: ``(B, K)`` float targets.
        num_shards: S, a positive int; ``B % S == 0`` unless ``weights`` is given.
        weights: optional ``(B,)`` non-negative per-example weights (a 0/1 mask, or ones for count weighting).
        shard_sizes: optional S positive sizes summing to B (weighted mode only).
        keep_shard_grads: True keeps every shard's gradient tree (stacked, ``(S, *shape)`` a leaf); False
            keeps only the running sum, so memory does not grow with S. Both run the same ``lax.scan`` and
            return the same ``grads``, bit for bit.

    Returns:
        A :class:`ReducedStep` (``loss``, ``shard_losses (S,)``, ``shard_grads`` stacked ``(S, ...)``, ``grads``).

    Raises:
        TypeError: bad dtypes, ``num_shards`` not an int, wrong model / optimizer types.
        ValueError: the bad inputs of :func:`~shardcheck.sgd_step`; ``num_shards < 1``; more shards than
            examples; ``B % S != 0`` without weights (equal shards are required); bad weights or shard sizes.
            Nothing is changed when an error is raised.
    """
    fn = "reduced_sgd_step"
    x, y = _validate.check_batch(fn, x, y)
    num_shards = _validate.check_num_shards(fn, num_shards)
    _validate.check_model(fn, model, x, y)
    _validate.check_optimizer(fn, optimizer, model)
    xs, ys, ws = split_shards(fn, x, y, num_shards, weights, shard_sizes)
    graphdef, state = nnx.split((model, optimizer))
    result, state = _reduced_step_jit(graphdef, state, xs, ys, ws, bool(keep_shard_grads))
    nnx.update((model, optimizer), state)
    return result


@functools.partial(jax.jit, static_argnames="num_shards")
def _simulated_step_jit(seed, lr, x, y, params, *, num_shards):
    model = fresh_linear(seed, x.shape[1], y.shape[1], params)
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
    return simulation_step(mse_batch_loss, num_shards, model, optimizer, (x, y)).loss


def simulated_data_parallel_step(
    x, y, num_shards: int, lr: float = 0.1, *, seed: int = 0, params: Mapping | None = None
) -> jax.Array:
    """Seed ``000_f7b4ea9cf28c5420.txt``: the mean pre-update shard loss of one simulated data-parallel SGD step.

    Builds a fresh ``nnx.Linear(D, K, rngs=nnx.Rngs(seed))`` (``params`` overwrite kernel and bias when given) and
    ``nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)``, splits the batch into ``num_shards`` equal contiguous
    shards, saves each shard's loss and gradients at the same initial parameters, sums the gradient trees leaf by
    leaf and divides each summed leaf by ``num_shards``, applies exactly one SGD update to kernel and bias, and
    returns the mean of the saved pre-update losses (so ``lr`` does not change the returned value). The whole
    call is one jitted function: repeated calls with the same shapes do not re-trace.

    Args:
        x: ``(B, D)`` float inputs; integer arrays are converted to float32.
        y: ``(B, K)`` float targets.
        num_shards: S >= 1 dividing B.
        lr: learning rate, a finite positive number.
        seed: integer seed of ``nnx.Rngs``.
        params: optional ``{"kernel": (D, K), "bias": (K,)}`` initial weights.

    Returns:
        The mean pre-update shard loss, a 0-d float32 array (equal to the full-batch loss up to rounding).

    Raises:
        TypeError: as :func:`~shardcheck.fsdp_step`.
        ValueError: as :func:`~shardcheck.fsdp_step`, and when ``B % num_shards != 0`` (equal shards are
            required; the message lists the valid shard counts) or ``num_shards > B``.

    Example::

        >>> import jax.numpy as jnp
        >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
        >>> y = jnp.array([[1.0], [2.0], [3.0], [4.0]])
        >>> zeros = {"kernel": jnp.zeros((2, 1)), "bias": jnp.zeros((1,))}
        >>> simulated_data_parallel_step(x, y, num_shards=2, params=zeros)
        Array(7.5, dtype=float32)
    """
    fn = "simulated_data_parallel_step"
    x, y, num_shards, lr, seed, params = validate_entrypoint(fn, x, y, num_shards, lr, seed, params)
    split_shards(fn, x, y, num_shards)  # the equal-shards check, with reduced_sgd_step's wording
    return _simulated_step_jit(jnp.int32(seed), jnp.float32(lr), x, y, params, num_shards=num_shards)
