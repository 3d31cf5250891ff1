"""Each batch shard's own gradient: the one engine of the hypotheses that read the shards one by one.

The mean of per-shard means (``normalization``, C4-C6) and a micro-batch's own mean (``per_micro_mean``) differentiate
each shard's loss over its weight (:func:`per_shard_mean_grads`: the quotient's gradient, as the steps they stand for
compute it); some shards' gradient only (:mod:`~shardcheck.parity.diagnosis.shard_subset`), some micro-batches'
(:mod:`~shardcheck.parity.diagnosis.micro_subset`) and a clip at a norm of the step's own
(:mod:`~shardcheck.parity.diagnosis.shard_clip`) read the shards' (or rows') gradients of their loss sums and their
weights (:func:`shard_terms`). Both map one shard function over the shards, at the reference's pre-step state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.task import loss_terms, shards_with_state


def _map_shards(loss_fn, num_shards, graphdef, per_row, params, rest, batch, divided: bool):
    """Each of the S shards' gradient of its loss sum (``divided``: of its loss sum over its weight, the quotient
    differentiated, as a step that divides per shard computes it) and its weight (1 for a mean loss, whose "sum"
    is the shard's own mean), stacked along a leading axis of S; traced inside the jitted callers."""
    xs, at = shards_with_state(batch, rest, num_shards, per_row)

    def shard(x):
        part, rest_s = at(x)

        def total(p):
            # new Variables (copy=True): merged from ``rest`` as it is, the model's Variables would belong to the
            # outer jit's trace, and an nnx transform inside the model (nnx.scan over stacked layers holding an
            # RNG count) would raise "Cannot extract graph node from different trace level" (issue #34)
            value, weight = loss_terms(loss_fn, nnx.merge(graphdef, p, rest_s, copy=True), part)
            value = value if weight is None or not divided else value / weight
            return value, jnp.asarray(1.0 if weight is None else weight, jnp.float32)

        return jax.grad(total, has_aux=True)(params)

    return jax.lax.map(shard, xs)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _stacked(loss_fn, num_shards, graphdef, per_row, params, rest, batch):
    return _map_shards(loss_fn, num_shards, graphdef, per_row, params, rest, batch, False)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _mean_of_means(loss_fn, num_shards, graphdef, per_row, params, rest, batch):
    """The S shards' own mean gradients (each the gradient of its loss sum over its weight), averaged: the
    division inside the gradient, as the steps whose normalization it stands for compute it (a low-precision
    model's hypothesis is compared within its own rounding: divided after the gradient, trial 18's bfloat16
    normalization was no longer reproduced)."""
    grads, _ = _map_shards(loss_fn, num_shards, graphdef, per_row, params, rest, batch, True)
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)


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


def per_shard_mean_grads(loss_fn, num_shards: int, graphdef, params, rest, batch):
    """The gradient of the mean of per-shard means (each of the ``num_shards`` shards of ``batch`` divides its
    ``loss_sum`` by its own weight; the S quotients' gradients averaged), a tree like ``params``; each shard with
    the whole non-parameter state ``rest``, or where the model does not trace so (a per-row carried state) its rows
    of it; ``None`` where it traces neither way."""
    for per_row in (False, True):
        try:
            return _mean_of_means(loss_fn, num_shards, graphdef, per_row, params, rest, batch)
        except (TypeError, ValueError):  # a shape error at trace time: a state shaped by the full batch
            continue
    return None
