"""The replay's rule for the model's floating state (``state model.<path>``), from the digests: the live rule of
:mod:`shardcheck.parity.comparison.model_state`, read from what a recording keeps of a leaf at each step (its
update size ``max|x_t - x_{t-1}|`` and its fixed-index samples).

- The recorded step left it as it was (update size 0) and the task's loss reads it (``meta["floating_read"]``,
  :func:`~shardcheck.parity.comparison.model_state.loss_reads` at record time): compared on its value, as before
  (a frozen weight trained FAILs as ``frozen_state``); :func:`state_evidence` returns ``None``.
- The recorded step left it as it was, the loss does not read it and the replayed value differs: not compared
  (``allowed`` inf): the recorded run's step does not write it (an EMA the user's step keeps).
- The loss neither reads it nor writes it (``meta["floating_written"]``,
  :func:`~shardcheck.parity.comparison.model_state.loss_access` at record time: the task's reference step leaves
  it as it was), whatever the recorded step did: not compared (``allowed`` inf), as the live check does not
  compare it. An EMA of the parameters a recorded user's step writes after its update is no cause of a replayed
  FAIL (its difference only follows the parameters'), and one written before the update or with another decay
  passes, as live.
- The recorded step wrote it: its change compared coarsely (the update sizes, and the change at each sample),
  within :data:`~shardcheck.parity.comparison.model_state.COARSE` of the recorded update size; a replayed
  update size of exactly 0 is the writes dropped (ratio 0), unless the recorded one is itself at rounding level
  (:func:`~shardcheck.parity.comparison.model_state.rounding_floor`, allowed beside the coarse fraction); some recorded samples left exactly as they were and
  the others changed as recorded is a write of part of the leaf (:func:`kept_samples`), a FAIL however small.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from shardcheck.parity.comparison.model_state import COARSE, PREFIX, rounding_floor
from shardcheck.parity.comparison.partial_write import MATCH_RTOL


def read_paths(*metas: Mapping) -> frozenset[str] | None:
    """The floating state the task's loss reads, as the first of ``metas`` that kept it (``"floating_read"``:
    dotted paths under the model); ``None`` (every leaf counts as read) where none did (an older recording)."""
    for meta in metas:
        found = meta.get("floating_read")
        if found is not None:
            return frozenset(found)
    return None


def written_paths(*metas: Mapping) -> frozenset[str] | None:
    """The floating state the task's forward pass writes, as the first of ``metas`` that kept it
    (``"floating_written"``: dotted paths under the model); ``None`` (every leaf counts as written) where none
    did."""
    for meta in metas:
        found = meta.get("floating_written")
        if found is not None:
            return frozenset(found)
    return None


def state_evidence(
    name: str, now: tuple, was: tuple, read: frozenset[str] | None, written: frozenset[str] | None = None
) -> tuple | None:
    """``(evidence, recorded, replayed, err, allowed, ok, ratio)`` of a ``state`` leaf at a step, or ``None``
    where its value is compared as any leaf's (module docstring). ``now``: the recorded and replayed digests
    (``_Leaf``) at the step; ``was``: at the point before it (the initial state before step 0). ``read``,
    ``written``: the dotted paths the task's loss reads and writes (:func:`read_paths`, :func:`written_paths`;
    ``None``: every leaf counts as read, or as written)."""
    (r, c), (r0, c0) = now, was
    if not (math.isfinite(r.update) and math.isfinite(c.update)):
        return None
    path = name.removeprefix("state ").removeprefix(PREFIX)
    unread = read is not None and path not in read
    if unread and r.update != 0 and written is not None and path not in written:
        # the task's reference step leaves it as it was: the live check does not compare it
        return ("not compared", r.max, c.max, abs(c.max - r.max), math.inf, True, None)
    if r.update == 0:
        differs = c.update != 0 or c.max != r.max or c.norm != r.norm
        return (
            ("not compared", r.max, c.max, abs(c.max - r.max), math.inf, True, None)
            if unread and differs
            else None
        )
    floor = rounding_floor(r.dtype, max(r.max, r0.max)) if r.dtype else 0.0
    allowed, ratio = max(COARSE * r.update, floor), c.update / r.update
    if c.update == 0 and r.update > floor:  # left exactly as it was: the writes dropped
        return ("update", r.update, 0.0, r.update, allowed, False, 0.0)
    kept = (
        kept_samples(now, was) if r.update > floor else None
    )  # part of it left exactly as it was (a recorded change, replayed 0)
    if kept is not None:
        return (PART_EVIDENCE, kept[2], 0.0, kept[2], MATCH_RTOL * r.update, False, ratio)
    err, evidence, rec, rep = abs(c.update - r.update), "update", r.update, c.update
    both = r.sampled & r0.sampled & np.isfinite(r.samples - r0.samples) & np.isfinite(c.samples - c0.samples)
    if both.any():
        diff = np.abs((c.samples - c0.samples) - (r.samples - r0.samples))
        i = int(np.argmax(np.where(both, diff, -1.0)))
        if diff[i] > err:
            err, evidence = float(diff[i]), "change at a sample"
            rec, rep = float(r.samples[i] - r0.samples[i]), float(c.samples[i] - c0.samples[i])
    return (evidence, rec, rep, err, allowed, bool(err <= allowed), ratio)


def sampled_value_factor(now: tuple) -> float | None:
    """The one constant k (not 1) with ``c = k r`` in every piece of a state leaf's digests a replay reads at a
    step (``now``: the recorded and replayed ``_Leaf``, as :func:`state_evidence`'s): each recorded sample whose
    ``|r|`` is at least 1% of the recorded ``max|x|`` (2 or more of them) within 8 float32 ulps of k, as the live
    :func:`~shardcheck.parity.comparison.model_state.value_factor` reads every element, and ``max|x|`` and the L2
    norm (float32 sums) within ``1e-5`` of k; ``None`` otherwise (fewer usable samples, a value not finite, no
    recorded value). A replicated value psum-ed over the devices: exactly x their count."""
    r, c = now
    if not (r.present and c.present) or r.shape != c.shape or not (r.max > 0 and math.isfinite(c.max)):
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        usable = (
            r.sampled & np.isfinite(r.samples) & np.isfinite(c.samples) & (np.abs(r.samples) >= 0.01 * r.max)
        )
        q = c.samples[usable] / r.samples[usable]
    if q.size < 2:
        return None
    k = float(np.median(q))
    if abs(k - 1) < 1e-3 or float(np.max(np.abs(q - k))) > 8 * 2.0**-23 * abs(k):
        return None
    whole = [(c.max, r.max), (c.norm, r.norm)]
    if any(not math.isfinite(a) or abs(a - abs(k) * b) > 1e-5 * abs(k) * b for a, b in whole):
        return None
    return k


PART_EVIDENCE = "part left as it was"
"""The evidence of a state leaf whose replayed step left some recorded samples exactly as they were
(:func:`kept_samples`)."""


def kept_samples(now: tuple, was: tuple) -> tuple[int, int, float] | None:
    """``(kept, usable, change)`` where the replayed step left ``kept`` of the leaf's ``usable`` recorded samples
    bitwise as they were while the recorded step changed them by more than
    :data:`~shardcheck.parity.comparison.partial_write.MATCH_RTOL` of its update size (``change``: the largest
    such recorded change), and changed the other samples as recorded (within that fraction), with a nonzero
    update size: a write that covers part of the leaf only (one shard's rows), as the live
    :func:`~shardcheck.parity.comparison.partial_write.partial_write` reads it from every element; ``None``
    otherwise. ``now``, ``was``: as :func:`state_evidence`'s."""
    (r, c), (r0, c0) = now, was
    if not (c.update > 0 and r.update > 0):
        return None
    with np.errstate(invalid="ignore"):
        dr, dc = r.samples - r0.samples, c.samples - c0.samples
        usable = r.sampled & r0.sampled & np.isfinite(dr) & np.isfinite(dc)
        left = usable & (c.samples == c0.samples) & (np.abs(dr) > MATCH_RTOL * r.update)
        rest = usable & ~left
    if not left.any() or not (rest & (dc != 0)).any():
        return None
    if float(np.max(np.abs(dc - dr)[rest], initial=0.0)) > MATCH_RTOL * r.update:
        return None
    return int(left.sum()), int(usable.sum()), float(np.max(np.abs(dr[left])))


__all__ = [
    "PART_EVIDENCE",
    "kept_samples",
    "read_paths",
    "sampled_value_factor",
    "state_evidence",
    "written_paths",
]
