"""Each batch shard's own gradient: the one engine of the hypotheses that read the shards one by one.

The mean of per-shard means (``normalization``, C4-C6), a micro-batch's own mean (``per_micro_mean``), some shards'
gradient only (:mod:`~shardcheck.parity.diagnosis.shard_subset`) and a clip at a norm of the step's own
(:mod:`~shardcheck.parity.diagnosis.shard_clip`) all start from the S shards' gradients of their loss sums and
their weights, at the reference's pre-step state: :func:`shard_terms` computes them in one compiled program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.task import loss_terms, shards_with_state


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _stacked(loss_fn, num_shards, graphdef, per_row, params, rest, batch):
    """Each of the S shards' gradient of its loss sum (a mean loss: of its own mean) and its weight (1 for a mean
    loss), stacked along a leading axis of S."""
    xs, at = shards_with_state(batch, rest, num_shards, per_row)

    def shard(x):
        part, rest_s = at(x)

        def total(p):
            # new Variables (copy=True): merged from ``rest`` as it is, the model's Variables would belong to the
            # outer jit's trace, and an nnx transform inside the model (nnx.scan over stacked layers holding an
            # RNG count) would raise "Cannot extract graph node from different trace level" (issue #34)
            value, weight = loss_terms(loss_fn, nnx.merge(graphdef, p, rest_s, copy=True), part)
            return value, jnp.asarray(1.0 if weight is None else weight, jnp.float32)

        return jax.grad(total, has_aux=True)(params)

    return jax.lax.map(shard, xs)


def shard_terms(loss_fn, num_shards: int, graphdef, params, rest, batch):
    """``(stack, weights)``: each of the ``num_shards`` shards of ``batch`` (its rows in order) its gradient of
    ``loss_fn``'s loss sum at ``(graphdef, params, rest)`` (a tree like ``params``, each leaf ``[S, ...]``, the
    parameters' dtype) and its weight (``[S]`` float64; 1 each for a mean loss, whose "sum" is the shard's own
    mean). Each shard with the whole non-parameter state ``rest``, or where the model does not trace so (a per-row
    carried state) its rows of it (:func:`~shardcheck.task.shards_with_state`); ``None`` where it traces neither
    way."""
    for per_row in (False, True):
        try:
            stack, weights = _stacked(loss_fn, num_shards, graphdef, per_row, params, rest, batch)
        except (TypeError, ValueError):  # a shape error at trace time: a state shaped by the full batch
            continue
        return stack, np.asarray(weights, np.float64)
    return None


@jax.jit
def _mean_of_means(stack, weights):
    def mean(g):
        w = weights.reshape((-1,) + (1,) * (g.ndim - 1))
        return jnp.mean(g.astype(jnp.float32) / w, axis=0).astype(g.dtype)

    return jax.tree.map(mean, stack)


def per_shard_mean_grads(loss_fn, num_shards: int, graphdef, params, rest, batch):
    """The gradient of the mean of per-shard means (each of the ``num_shards`` shards of ``batch`` divides its
    ``loss_sum`` by its own weight; the S quotients' gradients averaged, in float32), a tree like ``params``, from
    :func:`shard_terms`; ``None`` where that does not trace."""
    terms = shard_terms(loss_fn, num_shards, graphdef, params, rest, batch)
    if terms is None:
        return None
    stack, weights = terms
    return _mean_of_means(stack, jnp.asarray(weights, jnp.float32))
