"""A model whose BatchNorm normalizes with the batch's statistics, named where a failure reads as a loss computed
per shard (trial 52: a shard_map step whose BatchNorm normalized each shard with its own rows' statistics read
only "a term of the loss that couples the rows ... was computed per shard", with no word of the BatchNorm)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardcheck.parity.diagnosis.draws import measured_and_coupled
from shardcheck.parity.diagnosis.rules import Diagnosis


def per_shard_batch_stats(stats: Sequence[str], finding: str) -> str:
    """The message of a ``per_shard_loss`` finding (``finding``: its own) where the forward pass writes batch
    statistics (``stats``: ``nnx.BatchStat`` paths): what was measured, then the BatchNorm as its likely cause and
    its fixes, then the row-coupling reading for a loss that couples the rows itself."""
    said, coupled = measured_and_coupled(finding)
    return (
        f"The model's BatchNorm normalizes with the batch's own statistics ({', '.join(stats)}: nnx.BatchStat, "
        f"training mode), and {said}: what a BatchNorm run per shard computes, each shard normalizing with its own "
        "rows' mean and variance, not the full batch's (docs/reduction_cases.md C7). Inside jax.shard_map give the "
        "BatchNorm the batch axes (nnx.BatchNorm(..., axis_name='data'), or the tuple of the mesh's batch axes), "
        "so that it averages them over the shards, or run the step as GSPMD (jax.jit over the sharded batch, no "
        "shard_map), which computes the full batch's."
        + (f" Otherwise {coupled[0].lower()}{coupled[1:]}" if coupled else "")
    )


def with_batch_stats(findings: Sequence[Diagnosis], stats: Sequence[str]) -> list[Diagnosis]:
    """``findings`` with a ``per_shard_loss`` finding's message naming the BatchNorm
    (:func:`per_shard_batch_stats`) where the forward pass writes batch statistics (``stats``, non-empty); else as
    they are."""
    if not stats:
        return list(findings)
    return [
        dataclasses.replace(d, message=per_shard_batch_stats(stats, d.message))
        if d.code == "per_shard_loss"
        else d
        for d in findings
    ]
