"""The reference: the task's single-device step, ``value_and_grad(loss)`` then ``optimizer.update``.

Seed ``001_a85d1499a1a85057.txt`` is this step for a fresh ``nnx.Linear`` under MSE and SGD; for any task it is
the update every sharded strategy must reproduce.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardcheck.steps._core import StepResult, run_in_place, shard_value_and_grad
from shardcheck.task import Batch, LossFn, divide


@functools.partial(jax.jit, static_argnums=(0, 1))
def _reference_jit(loss_fn, graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    total, weight, grads = shard_value_and_grad(loss_fn, model, batch, update_state=True)
    if weight is not None:
        total, grads = total / weight, divide(grads, weight)
    optimizer.update(model, grads)
    return StepResult(total, grads), nnx.state((model, optimizer))


def reference_jit_step(loss_fn: LossFn, graphdef, treedef, specs, mesh):
    """The reference step as one jitted program of the state's leaves, ``(leaves, batch) -> (loss, leaves)``.

    The body of :func:`reference_step` (``_reference_jit``, inlined), with the state placed by ``specs`` on
    ``mesh`` in and out and donated, so that it lowers as the registry's sharded steps do
    (:attr:`shardcheck.steps.registry.Strategy.jit_step`); on a one-device mesh it is the single-device step.
    """

    def step(leaves, batch):
        result, state = _reference_jit(loss_fn, graphdef, jax.tree.unflatten(treedef, leaves), batch)
        return result.loss, jax.tree.leaves(state)

    state = [NamedSharding(mesh, spec) for spec in specs]
    return jax.jit(step, donate_argnums=0, out_shardings=(NamedSharding(mesh, PartitionSpec()), state))


def reference_step(loss_fn: LossFn, model: nnx.Module, optimizer: nnx.Optimizer, batch: Batch) -> StepResult:
    """One full-batch optimizer step of the task on one device, in place.

    Args:
        loss_fn: the task's ``loss_fn(model, batch)`` (scalar mean, or ``(loss_sum, weight)``).
        model: the ``nnx.Module``; its ``nnx.Param`` leaves are updated in place.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; updated in place.
        batch: a batch pytree (leading axis B on every leaf).

    Returns:
        :class:`~shardcheck.steps.StepResult` with the pre-update loss ``loss_sum / weight`` (0-d) and the
        gradients applied.
    """
    return run_in_place(_reference_jit, (loss_fn,), model, optimizer, batch)
