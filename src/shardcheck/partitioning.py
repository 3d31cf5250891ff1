"""Where each leaf lives under each strategy: the one rule shared by the FSDP step and the memory estimate.

The memory layouts (:data:`STRATEGIES`) come from the registry of strategies
(:data:`shardcheck.steps.STRATEGIES`): one layout per registered placement (``"single"``, ``"replicated"``,
``"fsdp"``), run by the first registered strategy with that placement, plus the ZeRO stages 1 and 2
(:data:`MEMORY_ONLY`), which are estimated and measured but have no registered step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a spec is built, so that `shardcheck memory --help` needs no JAX
    from jax.sharding import PartitionSpec

ALL_CATEGORIES = frozenset({"params", "model_state", "grads", "optimizer", "step"})
"""The state categories of the memory estimate: parameters, the model's other variables (RNG keys and counts),
gradients, optax state, NNX's optimizer step counter."""

PLACEMENT_SPLITS: dict[str, frozenset[str]] = {
    "single": frozenset(),
    "replicated": frozenset(),
    "fsdp": ALL_CATEGORIES,
}
"""Which categories each registry placement (``Strategy.placement``) splits over the mesh axis: nothing on one
device (``"single"``) or on every device (``"replicated"``, data parallel), everything under ``"fsdp"`` (ZeRO-3;
the steps split every leaf of ``(model, optimizer)`` with :func:`fsdp_partition_spec`)."""

MEMORY_ONLY: dict[str, frozenset[str]] = {
    "zero1": frozenset({"optimizer", "step"}),
    "zero2": frozenset({"optimizer", "step", "grads"}),
}
"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): memory layouts with no registered step; their measured step is
``jax.jit`` over the layout's ``NamedSharding`` placement, partitioned by GSPMD
(:func:`shardcheck.memory.layouts.zero_step`, where every layout is described)."""

ONE_DEVICE = "replicated"
"""The memory layout name of the registry's ``"single"`` placement: the whole state on one device (the name
``shardcheck memory`` has always used for that row)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One memory layout: what it splits, on how many devices, and which registered strategy runs it.

    Attributes:
        name: the layout's name (a key of :data:`STRATEGIES`).
        placement: the registry placement it stands for (``"single"``, ``"replicated"``, ``"fsdp"``), or the
            layout's own name for a memory-only ZeRO stage.
        splits: the categories split over the mesh axis.
        one_device: the layout uses one device whatever S is.
        strategy: the registered strategy whose step is measured for it, or ``None`` (memory-only).
    """

    name: str
    placement: str
    splits: frozenset[str]
    one_device: bool
    strategy: str | None


def placement_strategies() -> dict[str, str]:
    """``{placement: the first registered strategy with that placement}``, in registry order.

    For the registry of :mod:`shardcheck.steps.registry`: ``{"single": "reference", "replicated": "dp",
    "fsdp": "fsdp"}`` (``simulation`` and ``accumulation`` also run on one device, ``multiprocess`` is data
    parallel too: the first of each placement stands for it).
    """
    from shardcheck._catalog import STRATEGY_SPECS as REGISTRY

    out: dict[str, str] = {}
    for name, strategy in REGISTRY.items():
        out.setdefault(strategy.placement, name)
    return out


def _layouts() -> dict[str, Layout]:
    layouts = []
    for placement, strategy in placement_strategies().items():
        one = placement == "single"
        layouts.append(
            Layout(ONE_DEVICE if one else strategy, placement, PLACEMENT_SPLITS[placement], one, strategy)
        )
    layouts += [Layout(name, name, splits, False, None) for name, splits in MEMORY_ONLY.items()]
    # From the least split to the most: one device, then S devices by the number of categories split.
    layouts.sort(key=lambda layout: (not layout.one_device, len(layout.splits)))
    return {layout.name: layout for layout in layouts}


LAYOUTS: dict[str, Layout] = _layouts()
"""Every memory layout by name: ``replicated`` (one device), ``dp``, ``zero1``, ``zero2``, ``fsdp``."""

STRATEGIES = tuple(LAYOUTS)
"""The memory layouts' names, from the least to the most split: ``("replicated", "dp", "zero1", "zero2",
"fsdp")``."""


def fsdp_partition_spec(
    shape: Sequence[int], num_shards: int, axis_name: str = "data", *, min_size: int = 0
) -> PartitionSpec:
    """The FSDP ``PartitionSpec`` of one leaf: split its first dimension that ``num_shards`` divides.

    A leaf with no such dimension (a bias of length 3 on 4 devices, a scalar counter) stays replicated
    (``PartitionSpec()``), as does any leaf with fewer than ``min_size`` elements (off by default). Splitting the
    first divisible dimension (the kernel's input dimension D for ``(D, K)``) follows ZeRO-3 / FSDP practice of
    flat, even parameter shards (Rajbhandari et al., "ZeRO", 2020).

    Args:
        shape: the leaf's global shape.
        num_shards: S >= 1, the size of the mesh axis.
        axis_name: the mesh axis to split over.
        min_size: leaves with fewer elements than this stay replicated.

    Returns:
        ``PartitionSpec`` with ``axis_name`` at the split dimension, or ``PartitionSpec()`` (replicated).
    """
    from jax.sharding import PartitionSpec

    size = 1
    for d in shape:
        size *= d
    if num_shards == 1 or size < max(min_size, 1):
        return PartitionSpec()
    for i, d in enumerate(shape):
        if d % num_shards == 0 and d >= num_shards:
            return PartitionSpec(*([None] * i), axis_name)
    return PartitionSpec()
