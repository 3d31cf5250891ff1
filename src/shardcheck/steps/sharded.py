"""Data-parallel and FSDP steps of any task on a device mesh: one ``jax.shard_map`` inside one ``jax.jit``.

Data parallel (DP): the batch is split over the mesh axis, parameters and optimizer state are replicated. Each
device differentiates its shard's ``loss_sum``; the sums, the weights and the gradients are ``psum``-ed and
divided once by the total weight (for a scalar loss the weight is 1 per shard: a ``pmean``).

Fully sharded (FSDP): every parameter and optimizer-state leaf is split over the mesh axis along the dimension
chosen by :func:`~shardcheck.partitioning.fsdp_partition_spec` (leaves with no divisible dimension stay
replicated). Inside the map each sharded parameter is ``all_gather``-ed (tiled) for the forward and backward
pass, its gradient is ``psum_scatter``-ed (tiled) and divided by the total weight, so every device receives the
gradient of its own shard only, and the optimizer update runs on the local shards (ZeRO-3 / FSDP: Rajbhandari et
al., "ZeRO", 2020; Zhao et al., "PyTorch FSDP", 2023).

The trap of ``docs/reduction_cases.md`` C2: under ``jax.shard_map`` with ``check_vma=True`` a replicated input is
implicitly broadcast to every device, and the transpose of that broadcast is a ``psum``: the gradient of a local
loss with respect to a replicated parameter comes back *already summed*, and a further reduction leaves an update
S times too large. The parameters are therefore cast to device-varying first (``lax.pcast(..., to="varying")``, a
no-op at run time), so each gradient is the local one and is reduced exactly once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardcheck.partitioning import fsdp_partition_spec
from shardcheck.steps._core import params_value_and_grad
from shardcheck.task import Batch, LossFn, divide

MESH_STRATEGIES = ("dp", "fsdp")


def _split_dim(spec: PartitionSpec, axis_name: str) -> int | None:
    """The dimension ``spec`` splits over ``axis_name``, or None if the leaf is replicated over it."""
    for i, entry in enumerate(spec):
        if entry == axis_name or (isinstance(entry, tuple) and axis_name in entry):
            return i
    return None


def _total_weight(weight, axis_name):
    """The batch's total weight: ``psum(weight)``, or the axis size S (a constant) for a scalar loss."""
    return jax.lax.axis_size(axis_name) if weight is None else jax.lax.psum(weight, axis_name)


def data_parallel_value_and_grad(loss_fn: LossFn, model: nnx.Module, batch: Batch, axis_name: str):
    """Inside ``shard_map``: the full-batch loss and gradients over ``axis_name``, each reduced once.

    Args:
        loss_fn: the task's loss.
        model: the replicated model (device-invariant ``nnx.Param`` leaves).
        batch: this device's shard of the batch.
        axis_name: the mapped mesh axis.

    Returns:
        ``(loss, grads)``: ``psum(loss_sum) / psum(weight)`` and ``psum(grads) / psum(weight)``, identical
        (invariant) on every device.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # C2: differentiate with respect to a device-varying copy, so the gradient is this shard's own.
    params = jax.lax.pcast(params, axis_name, to="varying")
    total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
    weight = _total_weight(weight, axis_name)
    grads = divide(jax.lax.psum(grads, axis_name), weight)
    return jax.lax.psum(total, axis_name) / weight, grads


def fsdp_value_and_grad(
    loss_fn: LossFn,
    model: nnx.Module,
    batch: Batch,
    axis_name: str,
    param_specs: tuple[PartitionSpec, ...],
):
    """Inside ``shard_map``: gather the parameters, differentiate the local loss, reduce-scatter the gradients.

    Args:
        loss_fn: the task's loss.
        model: the model holding this device's shards (``param_specs`` give the split of each ``nnx.Param``
            leaf, in ``jax.tree.leaves(nnx.state(model, nnx.Param))`` order).
        batch: this device's shard of the batch.
        axis_name: the mapped mesh axis.
        param_specs: one ``PartitionSpec`` per parameter leaf.

    Returns:
        ``(loss, grads)``: the full-batch loss and an ``nnx.State`` of gradient *shards*: for a sharded leaf this
        device's slice (``psum_scatter(g, tiled=True) / psum(weight)``), for a replicated leaf the whole
        gradient (``psum(g) / psum(weight)``).
    """
    graphdef, local, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(local)
    dims = [_split_dim(spec, axis_name) for spec in param_specs]
    # Both branches give device-varying values, so differentiating with respect to them inserts no implicit psum
    # (C2): the gradient of each gathered leaf is this shard's own, reduced once below.
    full = [
        jax.lax.pcast(a, axis_name, to="varying")
        if d is None
        else jax.lax.all_gather(a, axis_name, axis=d, tiled=True)
        for a, d in zip(leaves, dims, strict=True)
    ]
    total, weight, grads = params_value_and_grad(
        loss_fn, graphdef, jax.tree.unflatten(treedef, full), rest, batch
    )
    weight = _total_weight(weight, axis_name)
    grads = [
        jax.lax.psum(g, axis_name)
        if d is None
        else jax.lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True)
        for g, d in zip(jax.tree.leaves(grads), dims, strict=True)
    ]
    grads = divide(grads, weight)
    return jax.lax.psum(total, axis_name) / weight, jax.tree.unflatten(treedef, grads)


@functools.lru_cache(maxsize=64)
def compiled_step(strategy, loss_fn, graphdef, treedef, specs, param_specs, mesh, axis_name):
    """The jitted step for one (strategy, loss, structure, placement, mesh); jit caches shapes itself.

    The gradients are computed and reduced inside one ``jax.shard_map`` with explicit collectives (above); the
    optimizer update then runs on the global, placed arrays under the same ``jax.jit``, so that XLA partitions
    it: elementwise transformations stay local to each shard, and one that needs the whole tree (a global-norm
    clip) gets its reduction inserted by the compiler, exactly. The state keeps its placement (``out_shardings``).
    Signature of the result: ``(state_leaves, batch) -> (loss, state_leaves)``; the state leaves are donated.
    """
    model, _ = nnx.merge(graphdef, jax.tree.unflatten(treedef, [jnp.zeros(()) for _ in specs]))
    num_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    grad_specs = list(param_specs) if param_specs is not None else [PartitionSpec()] * num_params

    def grads_body(leaves, batch):
        model, _ = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        if strategy == "dp":
            loss, grads = data_parallel_value_and_grad(loss_fn, model, batch, axis_name)
        else:
            loss, grads = fsdp_value_and_grad(loss_fn, model, batch, axis_name, param_specs)
        return loss, jax.tree.leaves(grads)

    mapped = jax.shard_map(
        grads_body,
        mesh=mesh,
        in_specs=(list(specs), PartitionSpec(axis_name)),
        out_specs=(PartitionSpec(), grad_specs),
        check_vma=True,  # the default, stated: the C2 formulation above is right with it on or off
    )

    def step(leaves, batch):
        loss, grad_leaves = mapped(leaves, batch)
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        params = nnx.state(model, nnx.Param)
        optimizer.update(model, jax.tree.unflatten(jax.tree.structure(params), grad_leaves))
        return loss, jax.tree.leaves(nnx.state((model, optimizer)))

    shardings = (NamedSharding(mesh, PartitionSpec()), [NamedSharding(mesh, spec) for spec in specs])
    return jax.jit(step, donate_argnums=0, out_shardings=shardings)


def state_specs(strategy: str, model, optimizer, num_shards: int, axis_name: str, min_size: int = 0):
    """``(specs of every (model, optimizer) state leaf, specs of the parameter leaves)`` of ``strategy``."""
    graphdef, state = nnx.split((model, optimizer))
    leaves = jax.tree.leaves(state)
    if strategy == "dp":
        return (PartitionSpec(),) * len(leaves), None
    spec = functools.partial(
        fsdp_partition_spec, num_shards=num_shards, axis_name=axis_name, min_size=min_size
    )
    return (
        tuple(spec(np.shape(a)) for a in leaves),
        tuple(spec(np.shape(a)) for a in jax.tree.leaves(nnx.state(model, nnx.Param))),
    )


def place_state(leaves, specs, mesh: Mesh) -> list:
    """Each leaf on ``mesh`` with its spec, copied unless already placed there (the step donates its inputs).

    Arrays not yet in the step's placement (a model's first step) are copied first, so the caller's arrays
    survive even when a clone shares them (``nnx.clone`` does not copy arrays) or the mesh is the array's own
    single device. Arrays already placed (the outputs of the previous step) are passed through and donated; a
    buffer shared by two leaves is copied once.
    """
    placed, seen = [], set()
    for a, spec in zip(leaves, specs, strict=True):
        target = NamedSharding(mesh, spec)
        placed_already = isinstance(a.sharding, NamedSharding) and a.sharding.is_equivalent_to(target, a.ndim)
        shared = id(a) in seen
        seen.add(id(a))
        if not placed_already or shared:
            a = jax.numpy.copy(
                a
            )  # device_put alone may alias the input buffer into a replicated output's shard
        placed.append(jax.device_put(a, target))
    return placed


def prepare(strategy, loss_fn, model, optimizer, batch, mesh, axis_name, min_size=0):
    """The compiled step, its placed arguments and the state treedef (nothing is changed)."""
    num_shards = int(mesh.shape[axis_name])
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    specs, param_specs = state_specs(strategy, model, optimizer, num_shards, axis_name, min_size)
    step = compiled_step(strategy, loss_fn, graphdef, treedef, specs, param_specs, mesh, axis_name)
    placed_batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(axis_name)))
    return step, (place_state(leaves, specs, mesh), placed_batch), treedef


def mesh_step(
    strategy: str,
    loss_fn: LossFn,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: Batch,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    min_size: int = 0,
) -> jax.Array:
    """One DP or FSDP step of a task on ``mesh``, in place; returns the 0-d pre-update loss.

    The caller validates: ``axis_name`` in ``mesh``, the batch divisible by its size, a model without batch
    statistics, an elementwise optimizer for FSDP.
    """
    step, args, treedef = prepare(strategy, loss_fn, model, optimizer, batch, mesh, axis_name, min_size)
    loss, leaves = step(*args)
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
    return loss
