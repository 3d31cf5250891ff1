"""Faults of a mesh's topology, read from the candidate's arrays and the per-leaf update ratios.

Three faults of sharded steps on meshes with several axes, or with a mix of split and replicated leaves, leave
signatures the generic rules cannot name:

* **A reduction over the wrong axes.** A hybrid step (batch over ``("data", "fsdp")``) that all-reduces the
  gradients over ``data`` only leaves copies of a "replicated" leaf that agree along ``data`` and differ along
  ``fsdp`` (:func:`mismatch_axes`): the axes along which they differ are the axes the reduction missed.
* **A replicated leaf reduced twice.** In ``jax.shard_map`` the gradient of a replicated (device-invariant)
  parameter comes back already ``psum``-ed over the axes it is replicated on (``docs/reduction_cases.md`` C2); a
  second, explicit ``psum`` multiplies exactly those leaves by the replica count while the split leaves stay
  right (:func:`leaf_factors` groups the leaves by their gradient factor).
* **A clipping norm counted once per replica.** ``sqrt(psum(sum of squares))`` over replicated gradients counts
  each leaf once per device, so the global norm is ``sqrt(R)`` too large and, whenever clipping is active, every
  gradient entering the optimizer is scaled by ``1/sqrt(R)`` (R the replica count: S for data parallel, the
  ``data`` axis's size for hybrid FSDP) (:func:`clip_factors`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding


def mismatch_axes(a) -> tuple[str, ...]:
    """The mesh axes along which this process's copies of the same slice of ``a`` hold different bytes.

    For each axis, the addressable shards are grouped by their slice and their mesh coordinates on the *other*
    axes; the axis is reported when a group holds two different buffers (copies that differ only by their
    position along that axis). Empty for consistent copies, an array on one device, or one not on a mesh.
    """
    if not isinstance(a, jax.Array) or not isinstance(a.sharding, NamedSharding):
        return ()
    mesh = a.sharding.mesh
    if len(a.addressable_shards) < 2:
        return ()
    coords = {d: tuple(int(i) for i in np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
    blocks = [
        (tuple((s.start, s.stop, s.step) for s in shard.index), coords[shard.device], shard.data)
        for shard in a.addressable_shards
    ]
    data = {id(b): np.asarray(b).tobytes() for _, _, b in blocks}
    varying = []
    for k, axis in enumerate(mesh.axis_names):
        groups: dict[tuple, set[bytes]] = {}
        for key, c, b in blocks:
            groups.setdefault((key, c[:k] + c[k + 1 :]), set()).add(data[id(b)])
        if any(len(g) > 1 for g in groups.values()):
            varying.append(axis)
    return tuple(varying)


def replica_counts(num_shards: int | None, mesh_shape: dict[str, int] | None) -> list[int]:
    """The replica counts a fault can involve: S, every axis size and product of axes (deduplicated, > 1)."""
    counts = set()
    if num_shards and num_shards > 1:
        counts.update(d for d in range(2, num_shards + 1) if num_shards % d == 0)
    for size in (mesh_shape or {}).values():
        if size > 1:
            counts.add(int(size))
    return sorted(counts, reverse=True)


def clip_factors(num_shards: int | None, mesh_shape: dict[str, int] | None) -> dict[float, int]:
    """``{1/sqrt(R): R}`` for the replica counts R of :func:`replica_counts` (R <= S, so never 1/S)."""
    return {1 / math.sqrt(r): r for r in replica_counts(num_shards, mesh_shape)}


def _param_of(path: str, params: Sequence[str]) -> str | None:
    """The parameter an optimizer-state path belongs to (``"0.mu.fc.kernel"`` -> ``"fc.kernel"``)."""
    best = None
    for p in params:
        if f".{path}".endswith(f".{p}") and (best is None or len(p) > len(best)):
            best = p
    return best


def leaf_factors(leaves, unresolved: Sequence[str] = ()) -> dict[str, float]:
    """Each parameter's gradient factor candidate / reference at one step, from the most direct evidence.

    Per parameter: its exposed gradient's ratio; else its first moment's or momentum trace's (proportional to
    the gradient); else the square root of its second moment's (``nu``); else its update's (proportional to
    the gradient under SGD). Leaves whose reference change is within tolerance, or whose gradient is at rounding
    level (``unresolved``), carry no factor.

    Args:
        leaves: the step's :class:`~shardcheck.parity.diagnosis.LeafError` records.
        unresolved: the record's ``unresolved`` names (``"param PATH"``).
    """
    noise = {u.split(" ", 1)[-1] for u in unresolved}
    params = [e.path for e in leaves if e.kind == "param" and e.path not in noise]
    seen = [e for e in leaves if e.reference_change is None or e.reference_change > e.tolerance]
    evidence: dict[str, dict[int, float]] = {p: {} for p in params}
    for e in seen:
        if e.ratio is None or not math.isfinite(e.ratio):
            continue
        if e.kind == "grad" and e.path in evidence:
            evidence[e.path][0] = e.ratio
        elif e.kind == "opt_state":
            p = _param_of(e.path, params)
            if p is None:
                continue
            if ".nu." in f".{e.path}.":
                if e.ratio > 0:
                    evidence[p].setdefault(2, math.sqrt(e.ratio))
            else:
                evidence[p].setdefault(1, e.ratio)
        elif e.kind == "param" and e.path in evidence:
            evidence[e.path][3] = e.ratio
    return {p: ev[min(ev)] for p, ev in evidence.items() if ev}
