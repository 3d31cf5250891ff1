"""The comparison's cheap first pass: clear the leaves that are provably within tolerance, on the device.

Most leaves of a correct step are within their tolerance by orders of magnitude, and proving that needs four
numbers per leaf, each one reduction on the leaf's devices: ``max |c - r|``, ``max |r|``, ``max |r - r0|`` (the
reference's change, read by the rules) and ``min`` / ``max`` of the allowance. A leaf is cleared when

    (max_f32 |c - r| + TINY) * (1 + 2**-22)  <=  atol + rtol * max|r| + min(allowance)

which implies :func:`~shardcheck.parity.comparison.live.leaf_error`'s elementwise rule ``|c - r| <= atol + rtol * max|r| +
allowance`` in float64: the float32 difference of each element is within half an ulp (``2**-24`` relative) of the
exact one, ``max|r|`` of float32 elements is exact, every allowance element is at least its minimum, and ``TINY``
covers a difference that the device flushed to zero (XLA:CPU treats subnormal inputs as zero). A NaN or an
infinity anywhere clears nothing. The statistics, the float64 re-check of the largest elements and the update
ratio's median (:func:`~shardcheck.parity.comparison.live.leaf_errors`, the second pass) are computed only for the leaves
this pass cannot clear, and for every leaf of a step that fails.

A cleared leaf's :class:`~shardcheck.parity.diagnosis.evidence.LeafError` holds ``max_abs_err`` (the float32 maximum:
exact where the two sides' elements are within a factor 2, Sterbenz's lemma; 0 where the device flushed a
subnormal difference, below ``TINY``), ``tolerance`` (``atol + rtol *
max|r| + max(allowance)``: the widest the rule allows, where the second pass reports the one its worst element
used), ``ok=True``, ``ratio=None`` (read by the rules of failing steps only) and ``reference_change`` exactly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from shardcheck.parity.comparison import _device_stats
from shardcheck.parity.diagnosis.evidence import LeafError

# float32's rounding of one difference is at most 2**-24 relative; twice that leaves a margin for the comparison
_ROUNDING = 2.0**-22


# leaves below this many elements, each whole on every device it lives on, are stacked with the leaves of their
# shape and reduced together (one set of kernels per shape: XLA:CPU compiles each kernel for tens of
# milliseconds); larger ones, and split ones (a stack of split leaves would gather them whole), are reduced alone
_STACKED = 1 << 16


def _reduce(r, c, r0, extra, axis) -> dict:
    """The reductions over ``axis`` (``-1``: of ``(leaves, n)`` float32 stacks; ``None``: of one leaf, in place,
    keeping its sharding); ``r0``, ``extra``: or ``None``."""
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    out = {"diff": jnp.max(jnp.abs(f32(c) - f32(r)), axis=axis), "scale": jnp.max(jnp.abs(f32(r)), axis=axis)}
    if r0 is not None:
        out["change"] = jnp.max(jnp.abs(f32(r) - f32(r0)), axis=axis)
    if extra is not None:
        out["min_extra"], out["max_extra"] = jnp.min(f32(extra), axis=axis), jnp.max(f32(extra), axis=axis)
    return out


# the columns of :func:`_stats`'s matrix; a leaf without a before-state or an allowance has 0 in those columns
_FIELDS = ("diff", "scale", "change", "min_extra", "max_extra")


@functools.partial(jax.jit, static_argnums=4)
def _stats(r: list, c: list, r0: list, extra: list, groups: tuple) -> jax.Array:
    """The reductions of every leaf on one set of devices, in one compiled call: a ``(leaves, 5)`` float32 matrix
    (columns :data:`_FIELDS`), read back in one transfer; ``groups`` (static): the indices reduced as one stack,
    the others one by one (:func:`_groups`)."""
    out: list = [None] * len(r)
    for members in groups:
        if len(members) == 1:
            (i,) = members
            out[i] = _reduce(r[i], c[i], r0[i], extra[i], None)
            continue

        def stack(arrays, members=members):
            if arrays[members[0]] is None:
                return None
            return jnp.stack([arrays[i].astype(jnp.float32).reshape(-1) for i in members])

        reduced = _reduce(stack(r), stack(c), stack(r0), stack(extra), -1)
        for j, i in enumerate(members):
            out[i] = {k: v[j] for k, v in reduced.items()}
    zero = jnp.zeros((), jnp.float32)
    return jnp.stack([jnp.stack([st.get(k, zero) for k in _FIELDS]) for st in out])


def _groups(r: list, r0: list, extra: list) -> tuple[tuple[int, ...], ...]:
    """The leaves reduced together: small leaves of one shape, each fully replicated where it lives
    (:data:`_STACKED`); every other leaf alone."""
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(r):
        small = a.size < _STACKED and a.sharding.is_fully_replicated
        groups.setdefault((a.shape if small else i, r0[i] is None, extra[i] is None), []).append(i)
    return tuple(tuple(m) for m in groups.values())


def _eligible(item) -> bool:
    """Whether the first pass can read the item: float leaves of equal, non-empty shapes, on this process's
    devices, with an array allowance of the leaf's shape or none (everything else goes to the second pass)."""
    arrays = [item.ref, item.cand] + [a for a in (item.before_ref, item.allowance) if a is not None]
    return (
        all(isinstance(a, jax.Array) and a.is_fully_addressable for a in arrays)
        and all(a.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) for a in arrays)
        and item.ref.shape == item.cand.shape
        and item.ref.size > 0
        and (item.before_ref is None) == (item.before_cand is None)
        and (item.allowance is None or item.allowance.shape == item.ref.shape)
    )


def _cleared(item, st: dict) -> LeafError | None:
    """The leaf's record when the first pass proves it within tolerance, else ``None``."""
    values = [float(v) for v in st.values()]
    if not all(math.isfinite(v) for v in values):
        return None
    diff, scale = float(st["diff"]), float(st["scale"])
    base = item.atol + item.rtol * scale
    widest = base + float(st.get("max_extra", 0.0))
    if (diff + _device_stats.TINY) * (1 + _ROUNDING) > base + float(st.get("min_extra", 0.0)):
        return None
    rel = (diff / scale) if scale > 0 else (0.0 if diff == 0 else math.inf)
    change = float(st["change"]) if "change" in st else None
    shape = tuple(item.ref.shape)
    zeros = scale == 0 and diff == 0 and item.before_ref is None  # both sides all zeros
    return LeafError(
        item.step, item.kind, item.path, diff, rel, widest, True, None, change, None, shape, zeros=zeros
    )


def _moved(arrays: list, places: list) -> list:
    """``arrays`` (``None`` kept) each moved onto its place, in one call (a call per leaf costs more than the
    reduction); an array already there, committed or not, is passed as it is. An uncommitted one (the
    reference's state is, from ``task.model()`` on) joins the call on its own device, where the committed ones
    are: the same placement, and the statistics' program one per committedness pattern, which is a side's and
    field's own at every step (committing them took a ``device_put`` of about 500 arrays a step on tiny-lm)."""
    present = [j for j, a in enumerate(arrays) if a is not None and a.sharding != places[j]]
    out = list(arrays)
    moved = jax.device_put([arrays[j] for j in present], [places[j] for j in present])
    for j, a in zip(present, moved, strict=True):
        out[j] = a
    return out


def clear(items: Sequence) -> list[LeafError | None]:
    """The first pass over ``items`` (:class:`~shardcheck.parity.comparison.live.LeafInput`): per item, its cleared
    :class:`~shardcheck.parity.diagnosis.evidence.LeafError`, or ``None`` where the second pass must decide.

    Only per-leaf scalars come to the host; each leaf's arrays are moved onto the reference's placement first, or
    onto the candidate's where the reference's leaf is whole on every device and the candidate's is split
    (``_device_stats.comparison_place``: no device takes a whole copy of a leaf its placement splits).
    """
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        if _eligible(item):
            groups.setdefault(tuple(sorted(d.id for d in item.ref.sharding.device_set)), []).append(i)
    out: list[LeafError | None] = [None] * len(items)
    for members in groups.values():
        picked = [items[i] for i in members]
        # where each leaf is compared: the reference's placement, or the candidate's where only it splits the leaf
        places = [_device_stats.comparison_place(item.ref, item.cand) for item in picked]
        fields = {
            k: _moved([getattr(item, name) for item in picked], places)
            for k, name in (("r", "ref"), ("c", "cand"), ("r0", "before_ref"), ("extra", "allowance"))
        }
        r, c, r0, extra = fields["r"], fields["c"], fields["r0"], fields["extra"]
        stats = jax.device_get(_stats(r, c, r0, extra, _groups(r, r0, extra)))
        for j, i in enumerate(members):
            present = (True, True, r0[j] is not None, extra[j] is not None, extra[j] is not None)
            st = {k: v for k, v, here in zip(_FIELDS, stats[j], present, strict=True) if here}
            out[i] = _cleared(items[i], st)
    return out
