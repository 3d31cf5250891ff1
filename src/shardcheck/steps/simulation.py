"""The gradient-reduction simulation of seed ``000_f7b4ea9cf28c5420.txt`` for any task, on one device.

The batch is cut into S equal contiguous shards; each shard's ``(loss_sum, weight)`` and gradient are computed at
the same pre-step parameters (one ``lax.scan``, so the program does not grow with S); sums, weights and
gradients are added over the shards and divided once; exactly one ``optimizer.update`` follows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from shardcheck.steps._core import StepResult, params_value_and_grad, run_in_place
from shardcheck.task import Batch, LossFn, divide, split_batch


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _simulation_jit(loss_fn, num_shards, keep_shard_grads, graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    zeros = jax.tree.map(jnp.zeros_like, params)

    def shard(acc, shard_batch):
        total, weight, grads = params_value_and_grad(loss_fn, gdef, params, rest, shard_batch)
        acc = jax.tree.map(
            jnp.add, acc, grads
        )  # kernel with kernel, bias with bias: a left fold in shard order
        return acc, (total, weight, grads if keep_shard_grads else None)

    summed, (totals, weights, shard_grads) = jax.lax.scan(shard, zeros, split_batch(batch, num_shards))
    weight = num_shards if weights is None else jnp.sum(weights)
    grads = divide(summed, weight)
    optimizer.update(model, grads)
    shard_losses = totals if weights is None else totals / weights
    result = StepResult(jnp.sum(totals) / weight, grads, shard_losses, shard_grads)
    return result, nnx.state((model, optimizer))


def simulation_step(
    loss_fn: LossFn,
    num_shards: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: Batch,
    *,
    keep_shard_grads: bool = False,
) -> StepResult:
    """One simulated data-parallel step over ``num_shards`` equal shards, in place.

    Args:
        loss_fn: the task's loss.
        num_shards: S >= 1, dividing the batch size (checked by the caller).
        model: updated in place.
        optimizer: updated in place, once.
        batch: a batch pytree of leading size B, B % S == 0.
        keep_shard_grads: also return every shard's gradient of its ``loss_sum`` (stacked, each leaf
            ``(S, *shape)``); the same scan, the same reduced gradients, bit for bit.

    Returns:
        :class:`~shardcheck.steps.StepResult` with the loss, the reduced gradients and the ``(S,)`` shard losses
        (and ``shard_grads`` with ``keep_shard_grads``).
    """
    static = (loss_fn, num_shards, bool(keep_shard_grads))
    return run_in_place(_simulation_jit, static, model, optimizer, batch)
