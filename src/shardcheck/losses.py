"""The one loss of shardcheck: mean squared error, and its weighted (sum, count) form.

Every step in the package (baseline, simulation, data parallel, FSDP) differentiates these functions; the loss is
defined here once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def mse_loss(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error ``jnp.mean((model(x) - y) ** 2)``, the loss of both seed files.

    For B examples and K output features this divides by ``B * K``
    (seed ``000_f7b4ea9cf28c5420.txt``).

    Args:
        model: a module mapping ``(B, D)`` to ``(B, K)``.
        x: ``(B, D)`` float inputs.
        y: ``(B, K)`` float targets.

    Returns:
        0-d array of the input dtype.
    """
    return jnp.mean((model(x) - y) ** 2)


def weighted_squared_error(
    model: nnx.Module, x: jax.Array, y: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Numerator and denominator of a weighted MSE: ``(sum_i w_i * mean_k err_ik**2, sum_i w_i)``.

    Reducing a loss over uneven or masked shards must add these two numbers across shards and divide once
    (``docs/reduction_cases.md`` C4-C6: "psum the weighted sums and psum the counts, then divide"). With all weights 1
    the ratio is exactly :func:`mse_loss`.

    Args:
        model: a module mapping ``(B, D)`` to ``(B, K)``.
        x: ``(B, D)`` float inputs.
        y: ``(B, K)`` float targets.
        weights: ``(B,)`` float per-example weights (a 0/1 mask, or example counts).

    Returns:
        ``(weighted_sum, weight_total)``, two 0-d arrays.
    """
    per_example = jnp.mean((model(x) - y) ** 2, axis=-1)
    return jnp.sum(weights * per_example), jnp.sum(weights)


def mse_batch_loss(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """:func:`mse_loss` as a task loss ``loss_fn(model, batch)`` of an ``(x, y)`` batch (the seeds' task)."""
    x, y = batch
    return mse_loss(model, x, y)


def regression_batch_loss(model: nnx.Module, batch: tuple) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The seeds' task loss of an ``(x, y)`` batch (:func:`mse_batch_loss`) or of an ``(x, y, weights)`` batch
    (:func:`weighted_squared_error`'s ``(weighted sum, weight total)``, ``docs/reduction_cases.md`` C4-C6)."""
    if len(batch) == 3:
        return weighted_squared_error(model, *batch)
    return mse_batch_loss(model, batch)
