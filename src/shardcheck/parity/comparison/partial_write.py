"""A write that covers part of a leaf only: the candidate's step left some elements exactly as they were where
the reference's step changed them, and changed the others as the reference did (issue #36, trial 12: a carry
of truncated BPTT written back for data shard 0's rows only, rows 4..7 of a (8, 16) state kept).

:func:`partial_write` reads one leaf's arrays (before the step, the reference's after it and the candidate's after
it, each side from its own state before) and returns ``(kept, size, where)``: how many elements the candidate left
bitwise as they were while the reference changed them, the leaf's size, and where they lie (``"rows 4..7 of axis
0"`` where they form one contiguous block along one axis and fill the others, else ``""``); ``None`` where the
leaf is not such a write. A running-average momentum of its own (0.99 in place of 0.9) changes every element by
another amount and leaves none exactly as it was: never a partial write.
"""

from __future__ import annotations

import numpy as np

MATCH_RTOL = 0.02
"""The elements the candidate did write match the reference's change where they differ by at most this fraction
of the reference's largest change (floating state carries no rounding tolerance: a coarse bound, far below the
half of it, :data:`~shardcheck.parity.comparison.model_state.COARSE`, that fails the leaf)."""


def _block(mask: np.ndarray) -> str:
    """``"rows 4..7 of axis 0"`` (``"indices 2..3 of axis 1"``; ``"elements 4..7"`` of a vector) where ``mask``'s
    true elements are one contiguous run of indices along one axis, all of the others, else ``""``."""
    for axis in range(mask.ndim):
        others = tuple(a for a in range(mask.ndim) if a != axis)
        line = np.any(mask, axis=others) if others else mask
        idx = np.flatnonzero(line)
        if idx.size == 0 or idx[-1] - idx[0] + 1 != idx.size:
            continue
        shape = [1] * mask.ndim
        shape[axis] = -1
        if not np.array_equal(mask, np.broadcast_to(line.reshape(shape), mask.shape)):
            continue
        lo, hi = int(idx[0]), int(idx[-1])
        span = str(lo) if lo == hi else f"{lo}..{hi}"
        if mask.ndim == 1:
            return f"element{'s' if lo != hi else ''} {span}"
        noun = "row" if axis == 0 else "index"
        plural = {"row": "rows", "index": "indices"}[noun] if lo != hi else noun
        return f"{plural} {span} of axis {axis}"
    return ""


def partial_write(
    before: np.ndarray,
    ref_after: np.ndarray,
    cand_after: np.ndarray,
    cand_before: np.ndarray | None = None,
    match: float | None = None,
) -> tuple[int, int, str] | None:
    """``(kept, size, where)`` where the candidate's step left ``kept`` of the leaf's ``size`` elements bitwise
    as they were while the reference's step changed them, and changed every other element as the reference did
    (within :data:`MATCH_RTOL` of the reference's largest change); ``None`` where it left none of them, all of
    them (a write dropped whole, said as such elsewhere), or the others differ too.

    Args:
        before: the leaf before the step (the reference's side), any float dtype and shape.
        ref_after, cand_after: the reference's and the candidate's leaf after the step, ``before``'s shape.
        cand_before: the candidate's own leaf before the step (default ``before``).
        match: the largest difference of the two changes on the written elements that still matches (a
            parameter's tolerance); default :data:`MATCH_RTOL` of the reference's largest change.

    Returns:
        ``(kept, size, where)``; ``where`` is ``"rows 4..7 of axis 0"`` where the kept elements form one contiguous
        block along one axis, else ``""`` (say the count).

    Raises:
        ValueError: the arrays' shapes differ.
    """
    c0 = before if cand_before is None else cand_before
    arrays = [np.asarray(a, np.float64) for a in (before, ref_after, cand_after, c0)]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(
            f"partial_write: the arrays' shapes differ ({[a.shape for a in arrays]}); pass one leaf's arrays"
        )
    b, r, c, cb = arrays
    with np.errstate(invalid="ignore", over="ignore"):
        dr, dc = r - b, c - cb
        left = (c == cb) & (dr != 0)
        top = float(np.max(np.abs(dr), initial=0.0))
        moved = ~left & ((dr != 0) | (dc != 0))
        if not left.any() or not moved.any() or not np.isfinite(top):
            return None
        if float(np.max(np.abs(dc - dr)[~left], initial=0.0)) > (
            MATCH_RTOL * top if match is None else match
        ):
            return None
    return int(left.sum()), int(left.size), _block(left)


SAMPLED = "sampled"
"""The ``where`` of a replay's ``kept`` (``LeafError.kept``): counted over the recorded samples, not every
element (:func:`~shardcheck.parity.comparison.state_digest.kept_samples`)."""


def said(path: str, kept: tuple[int, int, str]) -> str:
    """``"64 of 128 elements of model.blocks.0.ssm.h (rows 4..7 of axis 0)"``; a replay's (``where``
    :data:`SAMPLED`): ``"6 of its 8 recorded samples of model.blocks.0.ssm.h"``."""
    n, size, where = kept
    if where == SAMPLED:
        return f"{n} of the {size} recorded samples of {path}"
    return f"{n} of {size} elements of {path}" + (f" ({where})" if where else "")


__all__ = ["MATCH_RTOL", "SAMPLED", "partial_write", "said"]
