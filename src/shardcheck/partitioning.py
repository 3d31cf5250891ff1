"""Where each leaf lives under each strategy: the one rule shared by the FSDP step and the memory estimate."""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import PartitionSpec

STRATEGIES = ("replicated", "dp", "zero1", "zero2", "fsdp")


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
    size = 1
    for d in shape:
        size *= d
    if num_shards == 1 or size < max(min_size, 1):
        return PartitionSpec()
    for i, d in enumerate(shape):
        if d % num_shards == 0 and d >= num_shards:
            return PartitionSpec(*([None] * i), axis_name)
    return PartitionSpec()
