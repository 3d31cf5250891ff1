"""Weighted mode: uneven shards and masked examples, reduced so that the result is the full-batch one.

``docs/reduction_cases.md`` C4-C6: when shards differ in size, or some examples are masked out or are padding, the mean
of per-shard means weights every shard equally and is wrong. The rule: each shard contributes the weighted sum
of its squared errors and its total weight; the sums and the weights are each added over the shards (``psum``)
and divided once. :func:`weighted_sgd_step` is the full-batch reference of that rule, and
:func:`weighted_data_parallel_sgd_step` is the data-parallel step on a mesh that reproduces it exactly; the
simulation's weighted mode is :func:`~shardcheck.reduced_sgd_step` with ``weights=``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardcheck import _validate
from shardcheck.losses import weighted_squared_error
from shardcheck.simulation import ReducedStep, split_shards


def weighted_mean_loss(model: nnx.Module, x, y, weights) -> jax.Array:
    """The full-batch weighted MSE ``sum_i w_i * mean_k err_ik**2 / sum_i w_i`` (all weights 1: ``mse_loss``)."""
    total, count = weighted_squared_error(model, x, y, weights)
    return total / count


def _check_weights(fn: str, weights, batch: int) -> jax.Array:
    if weights is None:
        raise ValueError(f"{fn}: weights= is required: (B,) = ({batch},) example weights or a 0/1 mask")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (batch,):
        raise ValueError(f"{fn}: weights must have shape (B,) = ({batch},), got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"{fn}: weights must be finite, >= 0 and not all zero; got sum {w.sum()}")
    return jnp.asarray(w, dtype=jnp.float32)


@jax.jit
def _weighted_step_jit(graphdef, state, x, y, w):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(weighted_mean_loss)(model, x, y, w)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))


def weighted_sgd_step(model: nnx.Module, optimizer: nnx.Optimizer, x, y, weights) -> jax.Array:
    """One full-batch optimizer step on the weighted MSE, in place: the reference of weighted mode.

    The loss is ``sum_i w_i * mean_k (model(x)_ik - y_ik)**2 / sum_i w_i``; with all weights 1 it is
    :func:`~shardcheck.mse_loss` and the step is :func:`~shardcheck.sgd_step`. A 0/1 mask drops examples
    (``docs/reduction_cases.md`` C5).

    Args:
        model: an ``nnx.Module`` without batch statistics or RNG streams; updated in place.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; updated in place (one step).
        x: ``(B, D)`` float inputs.
        y: ``(B, K)`` float targets.
        weights: ``(B,)`` finite non-negative weights, not all zero.

    Returns:
        The pre-update weighted loss, 0-d float32.

    Raises:
        TypeError: as :func:`~shardcheck.sgd_step`.
        ValueError: as :func:`~shardcheck.sgd_step`; ``weights`` of the wrong shape, negative, non-finite or all
            zero. Nothing is changed when an error is raised.
    """
    fn = "weighted_sgd_step"
    x, y = _validate.check_batch(fn, x, y)
    _validate.check_model(fn, model, x, y)
    _validate.check_optimizer(fn, optimizer, model)
    w = _check_weights(fn, weights, x.shape[0])
    graphdef, state = nnx.split((model, optimizer))
    loss, state = _weighted_step_jit(graphdef, state, x, y, w)
    nnx.update((model, optimizer), state)
    return loss


def weighted_data_parallel_value_and_grad(model: nnx.Module, x, y, w, axis_name: str):
    """Inside ``shard_map``: the weighted loss and gradients over ``axis_name``, and the naive equal-weight ones.

    Each device differentiates its shard's weighted *sum* of squared errors (with respect to a device-varying
    copy of the parameters, so no implicit ``psum`` is added: ``docs/reduction_cases.md`` C2); the sums, the weight
    totals and the gradient sums are each ``psum``-ed once, and divided once by the total weight.

    Args:
        model: the replicated model.
        x: this device's ``(M, D)`` rows.
        y: this device's ``(M, K)`` rows.
        w: this device's ``(M,)`` weights (zero for padding).
        axis_name: the mapped mesh axis.

    Returns:
        ``(loss, grads, equal_weight_loss, equal_weight_grads, shard_loss)``: the weighted full-batch loss (0-d)
        and gradients (invariant on every device), the equal-weight means of per-shard means a naive ``pmean``
        would give, and this device's own weighted mean loss (0 for a shard of zero weight).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.lax.pcast(params, axis_name, to="varying")

    def local(p):
        return weighted_squared_error(nnx.merge(graphdef, p, rest), x, y, w)

    (total, count), grads = jax.value_and_grad(local, has_aux=True)(params)
    all_total = jax.lax.psum(total, axis_name)
    all_count = jax.lax.psum(count, axis_name)
    loss = all_total / all_count
    grads_mean = jax.tree.map(lambda g: jax.lax.psum(g, axis_name) / all_count, grads)
    safe = jnp.where(count > 0, count, 1.0)
    shard_loss = jnp.where(count > 0, total / safe, 0.0)
    equal_loss = jax.lax.pmean(shard_loss, axis_name)
    equal_grads = jax.tree.map(lambda g: jax.lax.pmean(g / safe, axis_name), grads)
    return loss, grads_mean, equal_loss, equal_grads, shard_loss


@functools.lru_cache(maxsize=32)
def _compiled(graphdef, treedef, mesh, axis_name):
    def body(leaves, x, y, w):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        loss, grads, eq_loss, eq_grads, shard_loss = weighted_data_parallel_value_and_grad(
            model, x, y, w, axis_name
        )
        optimizer.update(model, grads)
        return (
            loss,
            grads,
            eq_loss,
            eq_grads,
            shard_loss[None],
            jax.tree.leaves(nnx.state((model, optimizer))),
        )

    rep, batch = PartitionSpec(), PartitionSpec(axis_name)
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rep, batch, batch, batch),
        out_specs=(rep, rep, rep, rep, batch, rep),
    )
    return jax.jit(mapped)


def weighted_data_parallel_sgd_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x,
    y,
    mesh: Mesh,
    *,
    weights,
    shard_sizes: Sequence[int] | None = None,
    axis_name: str = "data",
) -> ReducedStep:
    """One data-parallel step on a mesh with uneven shards or masked examples, equal to the full-batch step.

    The batch is cut into S contiguous shards (``shard_sizes``, default ``np.array_split`` sizes, so ``B`` need
    not be divisible by S), each padded with zero-weight rows to the longest and placed one per device. Inside
    one ``jax.shard_map``: psum of the weighted sums of squared errors, psum of the weights, psum of the gradient
    sums, one division; every replica applies the same ``optimizer.update``. The result equals
    :func:`weighted_sgd_step` on the whole batch (``docs/reduction_cases.md`` C4: 25.5 / -9; C5: 27.75 / -9.5; C6: 38.5 /
    -11). Parameters and optimizer state are replicated.

    Args:
        model: an ``nnx.Module`` holding only ``nnx.Param`` variables; updated in place.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; updated in place (one step).
        x: ``(B, D)`` float inputs.
        y: ``(B, K)`` float targets.
        mesh: a ``Mesh`` with axis ``axis_name`` of size S <= B.
        weights: ``(B,)`` finite non-negative example weights (ones: count weighting; a 0/1 mask).
        shard_sizes: S positive sizes summing to B.
        axis_name: the mesh axis.

    Returns:
        A :class:`~shardcheck.ReducedStep`: ``loss`` (weighted full-batch, 0-d), ``grads``, ``shard_losses``
        ``(S,)`` (each shard's weighted mean), ``equal_weight_loss`` and ``equal_weight_grads`` (what the naive
        mean of per-shard means gives); ``shard_grads`` is ``None``.

    Raises:
        TypeError: as :func:`~shardcheck.sgd_step`; ``mesh`` not a ``Mesh``.
        ValueError: as :func:`~shardcheck.sgd_step`; bad ``weights`` or ``shard_sizes``; more devices than
            examples; a mesh without ``axis_name``. Nothing is changed when an error is raised.
    """
    from shardcheck import spmd

    fn = "weighted_data_parallel_sgd_step"
    x, y = _validate.check_batch(fn, x, y)
    _validate.check_model(fn, model, x, y)
    _validate.check_optimizer(fn, optimizer, model)
    num_shards = spmd.check_mesh(fn, mesh, axis_name)
    w = _check_weights(fn, weights, x.shape[0])
    xs, ys, ws = split_shards(fn, x, y, num_shards, np.asarray(w), shard_sizes)
    s, m = ws.shape
    xs, ys, ws = xs.reshape(s * m, -1), ys.reshape(s * m, -1), ws.reshape(s * m)

    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    step = _compiled(graphdef, treedef, mesh, axis_name)
    rep = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, PartitionSpec(axis_name))
    leaves = jax.device_put(leaves, rep)
    loss, grads, eq_loss, eq_grads, shard_losses, leaves = step(
        leaves, jax.device_put(xs, batch), jax.device_put(ys, batch), jax.device_put(ws, batch)
    )
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
    return ReducedStep(
        loss=loss,
        shard_losses=shard_losses,
        shard_grads=None,
        grads=grads,
        equal_weight_loss=eq_loss,
        equal_weight_grads=eq_grads,
    )
