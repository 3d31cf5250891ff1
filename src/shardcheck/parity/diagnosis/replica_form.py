"""The form of a replicas disagreement: how the copies of a replicated leaf differ, against the reference.

A leaf that should be replicated along a mesh axis but whose copies differ (``StepRecord.replica_mismatches``)
was stepped by each device from a part of what the reference's step reduced. :func:`fit_replicas` reads each
mismatched leaf's copies (float64, on the host) with the candidate's value before the step and the reference's
after it; with ``dc_k = copy_k - before`` (k over the ``n`` copies of one block) and ``dr = ref_after - before``
it fits, per leaf, the mean of the copies' changes to the reference's change:

- ``sum``: ``mean_k dc_k = dr / n``: the copies' changes sum to the reference's (each device kept its own shard's
  part of a sum: a ``psum`` over the axis missed, on a quantity linear in the gradient such as a first moment);
- ``mean``: ``mean_k dc_k = dr``: the copies average to the reference's (a ``pmean`` missed);
- ``factor``: another constant ratio ``f`` of the mean to ``dr``;
- otherwise no simple form (a normalizing update, a second moment: not linear in each shard's part).

Each within :data:`~shardcheck.parity.diagnosis.form.FIT_RTOL` (the 10th-90th percentile of the elementwise
ratio), with the copies' largest disagreement against the reference's change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from shardcheck.parity.diagnosis.form import FIT_RTOL, FLOOR, Form
from shardcheck.parity.diagnosis.grouping import n_leaves


def replica_blocks(a) -> list[tuple[tuple, list[np.ndarray]]]:
    """``[(index, [copy, ...]), ...]``: the addressable copies of each block of the ``jax.Array`` ``a`` (one
    block for a fully replicated leaf), in device order; ``[]`` for an array on one device or not a jax.Array."""
    if not isinstance(a, jax.Array) or len(a.addressable_shards) < 2:
        return []
    blocks: dict[tuple, tuple[tuple, list]] = {}
    for shard in sorted(a.addressable_shards, key=lambda s: s.device.id):
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        blocks.setdefault(key, (shard.index, []))[1].append(np.asarray(shard.data, np.float64))
    return [(index, copies) for index, copies in blocks.values() if len(copies) > 1]


def _distinct(copies: list[np.ndarray]) -> int:
    """The number of distinct copies where each is held by as many devices (copies that differ along one mesh axis
    and agree along the others: the size of that axis, the n a sum over it missed), else ``len(copies)``."""
    counts: dict[bytes, int] = {}
    for c in copies:
        counts[c.tobytes()] = counts.get(c.tobytes(), 0) + 1
    return len(counts) if len(set(counts.values())) == 1 else len(copies)


def _mean_ratio(blocks, before: np.ndarray, ref_after: np.ndarray) -> tuple[int, float, float, float, float]:
    """``(n, median, p10, p90, spread)`` (``n`` the distinct copies of a block: :func:`_distinct`) of
    ``mean_k dc_k / dr`` over the elements whose ``|dr|`` is at least
    :data:`FLOOR` of the largest, ``spread`` the copies' largest disagreement over ``max |dr|``."""
    means, refs, gap, n = [], [], 0.0, 0
    for index, copies in blocks:
        b, r = before[index], ref_after[index]
        n = _distinct(copies)
        means.append((np.mean(copies, axis=0) - b).ravel())
        refs.append((r - b).ravel())
        gap = max(gap, float(np.max(np.ptp(np.stack(copies), axis=0), initial=0.0)))
    mean, dr = np.concatenate(means), np.concatenate(refs)
    top = float(np.max(np.abs(dr), initial=0.0))
    if top == 0:
        return n, float("nan"), float("nan"), float("nan"), float("inf")
    keep = np.abs(dr) >= FLOOR * top
    ratio = mean[keep] / dr[keep]
    return n, float(np.median(ratio)), *np.percentile(ratio, [10, 90]).tolist(), gap / top


def _kind(n: int, median: float, lo: float, hi: float) -> str:
    if not np.isfinite(median) or hi - lo > FIT_RTOL * max(abs(median), 1e-30):
        return "none"
    if abs(median * n - 1) <= FIT_RTOL:
        return "sum"
    return "mean" if abs(median - 1) <= FIT_RTOL else "factor"


SAY = {
    "sum": "the copies' changes sum to the reference's (their mean is 1/{n} of it, within {lo:.4g}..{hi:.4g}): "
    "each device kept its own shard's part, a sum over {axes} missed",
    "mean": "the copies' changes average to the reference's (within {lo:.4g}..{hi:.4g}): a mean over {axes} "
    "missed",
    "factor": "the mean of the copies' changes is {median:.4g} x the reference's (within {lo:.4g}..{hi:.4g})",
}
# where the loss and every returned gradient match: no reduction of the gradients was missed
SAY_AFTER_GRADIENTS = SAY | {
    "sum": "the copies' changes sum to the reference's (their mean is 1/{n} of it, within {lo:.4g}..{hi:.4g}): "
    "each device kept its own shard's part: the gradients match, so not a gradient's sum over {axes} but the "
    "update's: with ZeRO (each device updating its own slice of the parameters), the updated slices not "
    "all-gathered over {axes} (jax.lax.all_gather(new_slice, {axis}, tiled=True) after the update of each "
    "device's slice)",
    "mean": "the copies' changes average to the reference's (within {lo:.4g}..{hi:.4g}): each copy moved by its "
    "own amount around it, from gradients that match (a scale each device computed for itself, such as a clip by "
    "its local norm), not a mean of the gradients missed",
}


def fit_replicas(
    leaves: Mapping[str, tuple[Sequence, np.ndarray, np.ndarray]],
    axes: Sequence[str] = (),
    gradients_match: bool = False,
) -> Form:
    """Fit each mismatched leaf's copies against the reference (module docstring).

    Args:
        leaves: ``{name: (blocks, before, ref_after)}``: the leaf's :func:`replica_blocks` (each block's copies),
            the candidate's value before the step and the reference's after it (global arrays, any float dtype).
        axes: the mesh axes along which the copies differ (``StepRecord.replica_axes``), for the sentence.
        gradients_match: the loss and every gradient the step returns matched the reference's, so the copies
            parted after the gradients: a ``mean`` is said as copies moved around the reference's, not as a mean
            of the gradients missed.

    Returns:
        A ``replicas`` :class:`~shardcheck.parity.diagnosis.form.Form`: its sentence names, per form, the leaves
        and numbers; ``factor`` the mean's ratio where one form holds on every leaf, ``spread`` the copies'
        largest disagreement over the reference's largest change (min, max over the leaves).

    Raises:
        ValueError: ``leaves`` is empty or a leaf has no two copies of a block.
    """
    if not leaves:
        raise ValueError("fit_replicas: leaves is empty; pass {name: (replica_blocks(a), before, ref_after)}")
    where = " and ".join(repr(a) for a in axes) or "the replicated axes"
    axis = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))  # all_gather's axis_name
    fits: dict[str, list] = {}
    gaps, unchanged = [], []
    for name, (blocks, before, ref_after) in sorted(leaves.items()):
        if not blocks:
            raise ValueError(
                f"fit_replicas: leaf {name!r} has no two copies of a block; pass replica_blocks(a)"
            )
        b, r = np.asarray(before, np.float64), np.asarray(ref_after, np.float64)
        n, median, lo, hi, gap = _mean_ratio(blocks, b, r)
        if np.isinf(gap):  # the reference left the leaf unchanged (a step it skipped): no ratio to read
            unchanged.append((name, _copies_gap(blocks)))
            continue
        gaps.append(gap)
        fits.setdefault(_kind(n, median, lo, hi), []).append((name, n, median, lo, hi))
    parts = [_unchanged_clause(unchanged)] if unchanged else []
    for kind, found in fits.items():
        names = ", ".join(f[0] for f in found[:3]) + (", ..." if len(found) > 3 else "")
        if kind == "none":
            worst = max(found, key=lambda f: f[4] - f[3])
            parts.append(
                f"on {names} ({n_leaves(len(found))}) no simple form (the mean of the copies' changes against the "
                f"reference's runs from {worst[3]:.4g} to {worst[4]:.4g} on {worst[0]}, 10th-90th percentile)"
            )
            continue
        name, n, median, lo, hi = found[0]
        lo, hi = min(f[3] for f in found), max(f[4] for f in found)
        said = (SAY_AFTER_GRADIENTS if gradients_match else SAY)[kind].format(
            n=n, lo=lo, hi=hi, median=median, axes=where, axis=axis
        )
        parts.append(f"on {names} ({n_leaves(len(found))}) {said}")
    by = f" by up to {max(gaps):.3g} of the reference's largest change" if gaps else ""
    head = f"the copies along {where} differ{by}; " + "; ".join(parts)
    (only,) = fits if len(fits) == 1 else (None,)
    factor = None if only in (None, "none") or unchanged else float(np.median([f[2] for f in fits[only]]))
    spread = (min(gaps), max(gaps)) if gaps else (float("inf"), float("inf"))
    return Form("replicas", head, factor=factor, spread=spread, leaves=len(leaves))


def _copies_gap(blocks) -> float:
    """The copies' largest elementwise disagreement over ``blocks`` (:func:`replica_blocks`), absolute."""
    return max(float(np.max(np.ptp(np.stack(copies), axis=0), initial=0.0)) for _, copies in blocks)


def _unchanged_clause(unchanged: Sequence[tuple[str, float]]) -> str:
    """The leaves whose copies differ where the reference left them unchanged (``[(name, the copies' largest
    disagreement)]``): some devices stepped where others did not (issue #36 trial 48: a loss-scale step's overflow
    check local to each device read "differ by up to inf of the reference's largest change ... runs from nan to
    nan")."""
    names = ", ".join(u[0] for u in unchanged[:3]) + (", ..." if len(unchanged) > 3 else "")
    top = max(u[1] for u in unchanged)
    return (
        f"on {names} ({n_leaves(len(unchanged))}) the reference left the leaf unchanged (a step it skipped) while "
        f"the copies differ by up to {top:.3g}: some devices stepped, others did not"
    )


# copies of one array that differ by a per-device constant agree with it to this share of their largest element
# (a float32 product or quotient of the same all-reduced value rounds each element by ~1e-7 of it)
SCALE_RTOL = 1e-5


def copy_scales(arrays: Mapping[str, object]) -> tuple[float, ...] | None:
    """The per-device constants ``a_d`` with every device's copy of every fully replicated array of ``arrays``
    equal to ``a_d`` times the first device's copy (device order; ``a_0 = 1``), or ``None`` where they are not.

    The copies of a gradient that was all-reduced and then scaled by a quantity of each device's own (its shard's
    own count, weight or norm: issue #36's ``psum(g) / local_count``) are one array times a constant per device,
    the same constant on every leaf; a reduction that missed an axis leaves partial sums, which no constant maps
    onto each other. ``a_d`` is the least-squares fit over all arrays (float64); each copy must match
    ``a_d x`` the first within :data:`SCALE_RTOL` of the first copy's largest element, on every array.

    Args:
        arrays: ``{name: jax.Array}``; arrays not replicated on every one of their devices (or on one device, or
            not ``jax.Array``) are skipped, as are copies of all zeros.

    Returns:
        ``(a_0, a_1, ...)`` floats, one per device of the arrays, where some ``a_d`` is not 1 (within
        :data:`SCALE_RTOL`) and every copy fits; ``None`` where no array has copies, the arrays' devices differ,
        or some copy is not a constant times the first.
    """
    pairs: list[list[np.ndarray]] = []
    devices = None
    for a in arrays.values():
        if not isinstance(a, jax.Array) or len(a.addressable_shards) < 2:
            continue
        shards = sorted(a.addressable_shards, key=lambda s: s.device.id)
        if any(s.data.shape != a.shape for s in shards):  # sharded: not a copy of the whole on every device
            continue
        ids = tuple(s.device.id for s in shards)
        if devices is not None and ids != devices:
            return None
        devices = ids
        copies = [np.asarray(s.data, np.float64).ravel() for s in shards]
        if np.max(np.abs(copies[0]), initial=0.0) > 0:
            pairs.append(copies)
        elif any(np.any(c) for c in copies):  # zeros on the first device only: no constant maps it
            return None
    if not pairs:
        return None
    den = sum(float(np.vdot(c[0], c[0])) for c in pairs)
    scales = tuple(sum(float(np.vdot(c[k], c[0])) for c in pairs) / den for k in range(len(pairs[0])))
    for c in pairs:
        top = float(np.max(np.abs(c[0])))
        if any(float(np.max(np.abs(c[k] - a * c[0]))) > SCALE_RTOL * top for k, a in enumerate(scales)):
            return None
    if all(abs(a - 1.0) <= SCALE_RTOL for a in scales):
        return None
    return scales
