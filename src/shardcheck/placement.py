"""Where each parameter and optimizer-state leaf lives: its spec, global shape, and each device's shard.

Reads the arrays' actual shardings (``jax.Array.sharding``), so it reports what a step left behind, not what a
rule predicts: after :func:`~shardcheck.seeds.fsdp_sgd_step` the split leaves show ``1/S`` shards, after
:func:`~shardcheck.data_parallel_sgd_step` every leaf is replicated, before any step the arrays sit on one device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardcheck._tree import path_str
from shardcheck.partitioning import fsdp_partition_spec


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """The placement of one parameter or optimizer-state leaf.

    Attributes:
        path: dotted path of the leaf: ``"kernel"``, ``"hidden.bias"`` for parameters;
            ``"opt_state.0.mu.kernel"``, ``"step"`` for optimizer state.
        kind: ``"param"`` (an ``nnx.Param`` of the model) or ``"opt_state"`` (a leaf of the optimizer).
        partition_spec: the ``PartitionSpec`` of the array's ``NamedSharding``; ``PartitionSpec()`` for an array
            that is replicated or not placed on a mesh.
        global_shape: the leaf's logical shape.
        shard_shape: the shape of each device's addressable shard (equal on every device).
        shard_bytes: bytes of one device's shard: ``prod(shard_shape) * itemsize``.
        replicated: True if every device holding the array holds all of it.
        reason: why the leaf is split or replicated, in words.
        axes: for each axis of the array's mesh, in mesh order, the dimension split over it, or ``None`` where
            the leaf is replicated over that axis (``{"data": None, "fsdp": 1}``: a hybrid-sharded kernel);
            empty for an array not placed on a mesh.
    """

    path: str
    kind: Literal["param", "opt_state"]
    partition_spec: PartitionSpec
    global_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    shard_bytes: int
    replicated: bool
    reason: str
    axes: dict[str, int | None] = dataclasses.field(default_factory=dict)


def _leaves(model: nnx.Module, optimizer: nnx.Optimizer):
    for kind, state in (("param", nnx.state(model, nnx.Param)), ("opt_state", nnx.state(optimizer))):
        for path, var in nnx.to_flat_state(state):
            yield kind, path_str(path), var[...]


def _reason(array: jax.Array, spec: PartitionSpec, axis_name: str | None) -> str:
    sharding = array.sharding
    shape = tuple(array.shape)
    if not isinstance(sharding, NamedSharding):
        devices = sorted(sharding.device_set, key=lambda d: d.id)
        where = str(devices[0]) if len(devices) == 1 else f"{len(devices)} devices"
        return f"not placed on a mesh: the whole array lives on {where}"
    mesh = sharding.mesh
    if not sharding.is_fully_replicated:
        parts = [
            f"dimension {i} over mesh axis {entry!r} ({math.prod(mesh.shape[a] for a in _names(entry))} devices)"
            for i, entry in enumerate(spec)
            if entry is not None
        ]
        split = {a for entry in spec if entry is not None for a in _names(entry)}
        rest = [f"{a!r} ({mesh.shape[a]})" for a in mesh.axis_names if a not in split and mesh.shape[a] > 1]
        return "split along " + ", ".join(parts) + (f"; replicated over {', '.join(rest)}" if rest else "")
    if axis_name not in mesh.axis_names:  # the mesh's FSDP axis where it has one, else its only axis
        axis_name = "fsdp" if "fsdp" in mesh.axis_names else mesh.axis_names[-1]
    size, devices = int(mesh.shape[axis_name]), int(mesh.size)
    if devices == 1:
        return "replicated: the mesh has 1 device"
    if not shape:
        return f"replicated on all {devices} devices: a scalar has no dimension to split"
    axis = "" if len(mesh.axis_names) == 1 else f" (the size of mesh axis {axis_name!r})"
    if size > 1 and fsdp_partition_spec(shape, size, axis_name) == PartitionSpec():
        return (
            f"replicated on all {devices} devices: no dimension of shape {shape} is divisible by {size}{axis}"
        )
    return (
        f"replicated on all {devices} devices although a dimension of {shape} splits {size} ways{axis} "
        "(data-parallel placement, or kept whole by an FSDP size threshold)"
    )


def _names(entry) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def _axes(sharding, spec: PartitionSpec) -> dict[str, int | None]:
    """Each mesh axis -> the dimension ``spec`` splits over it (None: replicated over it)."""
    if not isinstance(sharding, NamedSharding):
        return {}
    dims = {a: i for i, entry in enumerate(spec) if entry is not None for a in _names(entry)}
    return {a: dims.get(a) for a in sharding.mesh.axis_names}


def placement_report(
    model: nnx.Module, optimizer: nnx.Optimizer, *, axis_name: str | None = None
) -> list[LeafPlacement]:
    """For each parameter and optimizer-state leaf: its ``PartitionSpec``, global shape, and per-device shard.

    Args:
        model: an ``nnx.Module``; its ``nnx.Param`` leaves are reported (kind ``"param"``).
        optimizer: its ``nnx.Optimizer``; every state leaf, step counters included, is reported
            (kind ``"opt_state"``).
        axis_name: the mesh axis whose size explains a replicated leaf in ``reason`` (default: ``"fsdp"`` where
            the mesh has that axis, else its last axis).

    Returns:
        One :class:`LeafPlacement` per leaf, parameters first, each group in ``nnx`` path order.

    Raises:
        TypeError: if ``model`` is not an ``nnx.Module`` or ``optimizer`` not an ``nnx.Optimizer``.

    Example::

        >>> from flax import nnx
        >>> import optax
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> [(p.path, p.shard_shape, p.shard_bytes) for p in placement_report(model, optimizer)]
        [('bias', (1,), 4), ('kernel', (2, 1), 8), ('step', (), 4)]
    """
    _check_types("placement_report", model, optimizer)
    report = []
    for kind, path, array in _leaves(model, optimizer):
        array = jax.numpy.asarray(array)
        sharding = array.sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        shard_shape = tuple(array.addressable_shards[0].data.shape) if array.addressable_shards else ()
        report.append(
            LeafPlacement(
                path=path,
                kind=kind,
                partition_spec=spec,
                global_shape=tuple(array.shape),
                shard_shape=shard_shape,
                shard_bytes=math.prod(shard_shape) * np.dtype(array.dtype).itemsize,
                replicated=bool(sharding.is_fully_replicated),
                reason=_reason(array, spec, axis_name),
                axes=_axes(sharding, spec),
            )
        )
    return report


def placement_summary(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, int]:
    """Bytes of parameters and optimizer state held by one device, beside the unsharded totals.

    Counted from each array's addressable shards; "per device" is the most loaded device (all devices of a
    mesh hold the same amount under the DP and FSDP placements). The totals are the bytes of one full,
    unsharded copy.

    Args:
        model: an ``nnx.Module`` (its ``nnx.Param`` leaves are counted).
        optimizer: its ``nnx.Optimizer`` (every state leaf, step counters included).

    Returns:
        ``{"params_bytes", "optimizer_bytes"}`` (per device), ``{"params_total_bytes",
        "optimizer_total_bytes"}`` (one unsharded copy) and ``"num_devices"`` (devices holding any of it).

    Raises:
        TypeError: if ``model`` is not an ``nnx.Module`` or ``optimizer`` not an ``nnx.Optimizer``.
    """
    _check_types("placement_summary", model, optimizer)
    per_device = {"param": collections.Counter(), "opt_state": collections.Counter()}
    totals = {"param": 0, "opt_state": 0}
    devices = set()
    for kind, _, array in _leaves(model, optimizer):
        array = jax.numpy.asarray(array)
        totals[kind] += int(array.nbytes)
        for shard in array.addressable_shards:
            per_device[kind][shard.device] += int(shard.data.nbytes)
        devices.update(array.sharding.device_set)  # every process's devices, not only this one's
    return {
        "params_bytes": max(per_device["param"].values(), default=0),
        "optimizer_bytes": max(per_device["opt_state"].values(), default=0),
        "params_total_bytes": totals["param"],
        "optimizer_total_bytes": totals["opt_state"],
        "num_devices": len(devices),
    }


def _check_types(fn: str, model, optimizer) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{fn}: model must be an nnx.Module, got {type(model).__name__}")
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"{fn}: optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}; build it with "
            "nnx.Optimizer(model, tx, wrt=nnx.Param)"
        )
