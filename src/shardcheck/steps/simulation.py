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


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _simulation_jit(loss_fn, num_shards, graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    zeros = jax.tree.map(jnp.zeros_like, params)

    def shard(acc, shard_batch):
        total, weight, grads = params_value_and_grad(loss_fn, gdef, params, rest, shard_batch)
        acc = jax.tree.map(jnp.add, acc, grads)
        return acc, (total, weight)

    summed, (totals, weights) = jax.lax.scan(shard, zeros, split_batch(batch, num_shards))
    weight = num_shards if weights is None else jnp.sum(weights)
    grads = divide(summed, weight)
    optimizer.update(model, grads)
    shard_losses = totals if weights is None else totals / weights
    return StepResult(jnp.sum(totals) / weight, grads, shard_losses), nnx.state((model, optimizer))


def simulation_step(
    loss_fn: LossFn, num_shards: int, model: nnx.Module, optimizer: nnx.Optimizer, batch: Batch
) -> StepResult:
    """One simulated data-parallel step over ``num_shards`` equal shards, in place.

    Args:
        loss_fn: the task's loss.
        num_shards: S >= 1, dividing the batch size (checked by the caller).
        model: updated in place.
        optimizer: updated in place, once.
        batch: a batch pytree of leading size B, B % S == 0.

    Returns:
        :class:`~shardcheck.steps.StepResult` with the loss, the reduced gradients and the ``(S,)`` shard losses.
    """
    return run_in_place(_simulation_jit, (loss_fn, num_shards), model, optimizer, batch)
