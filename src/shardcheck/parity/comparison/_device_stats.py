"""The compiled half of :func:`shardcheck.parity.comparison.live.leaf_errors`: every leaf's float32 reductions in one call.

Leaves of any sizes are laid into the rows of one ``(rows, width)`` float32 matrix (each leaf padded to whole
rows), reduced per row, then per leaf over its rows. The compiled function is one set of kernels whatever the
number and sizes of the leaves (a per-leaf graph compiles one kernel per leaf, which dominates a transformer's
check on XLA:CPU), and no statistic sorts (sorting is slow on XLA:CPU).

A leaf that its placement splits over a mesh is never laid into that matrix (flattening it into rows would gather
it whole on every device): :func:`split_stats` computes the same statistics inside one ``shard_map`` over the
mesh, each device laying its own blocks of the split leaves into rows of the same kind and ``pmax``/``pmin``/
``psum`` combining the devices' per-leaf results (:class:`_Blocks`). Both paths run one body,
:func:`_statistics`, over a reducer with the same methods, so they give the same numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# a float32 badness within this relative distance of the leaf's largest is re-checked in float64 on the host
NEAR = 1e-5
# below this (float32 subnormal territory) device arithmetic is not trusted: the leaf is compared on the host
TINY = 1e-30
# how many near-top elements of a leaf come to the host for the float64 re-check
CANDIDATES = 16
# a change within this relative distance of the update ratio's 1% threshold: float32 cannot tell which side
# float64 puts it on, so that leaf's ratio is computed on the host
BORDER = 1e-5
FIELDS = ("r", "c", "r0", "c0", "extra")


class Layout(NamedTuple):
    """Where each leaf's elements lie in the ``(rows, width)`` matrix: ``rows``, each leaf's row count."""

    width: int
    rows: tuple[int, ...]

    @staticmethod
    def of(sizes: Sequence[int]) -> Layout:
        """Rows of a power-of-two width near ``sqrt(total)`` (at least 64): few rows, little padding."""
        total = max(int(sum(sizes)), 1)
        width = max(64, 1 << math.ceil(math.log2(math.sqrt(total))))
        return Layout(width, tuple(max(1, -(-int(n) // width)) for n in sizes))

    def row_arrays(self, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(row_leaf, row_len)``: each row's leaf and its count of valid elements (the rest is padding)."""
        row_leaf = np.repeat(np.arange(len(sizes), dtype=np.int32), self.rows)
        row_len = np.concatenate(
            [
                np.minimum(self.width, int(n) - self.width * np.arange(k))
                for n, k in zip(sizes, self.rows, strict=True)
            ]
        ).astype(np.int32)
        return row_leaf, row_len


def two_diff(a, b):
    """``(s, e)`` with ``s = fl(a - b)`` and ``a - b == s + e`` exactly (Knuth's TwoSum, float32)."""
    s = a - b
    bv = s - a
    e = (a - (s - bv)) + (-b - bv)
    return s, e


def _order_key(x):
    """float32 -> uint32 preserving the order of the values (-inf < ... < -0.0 < +0.0 < ... < +inf)."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(b < 0, b ^ 0x7FFFFFFF, b) ^ jnp.int32(-(2**31)), jnp.uint32)


def _from_order_key(u):
    b = jax.lax.bitcast_convert_type(u, jnp.int32) ^ jnp.int32(-(2**31))
    return jax.lax.bitcast_convert_type(jnp.where(b < 0, b ^ 0x7FFFFFFF, b), jnp.float32)


def _tiny(x):
    """Nonzero but below :data:`TINY`, or subnormal (read from the bits: XLA:CPU treats subnormal inputs as zero)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0)
    return subnormal | ((x != 0) & (jnp.abs(x) < TINY))


def _max_exact(red, s, e):
    """``(m, e_m)`` per leaf: ``max |a - b| == m + e_m`` exactly, from :func:`two_diff`'s pairs (``red``: a
    :class:`_Rows` or :class:`_Blocks`)."""
    mag = jnp.abs(s)
    m = red.max(mag, fill=0.0)
    return m, red.max(jnp.where(mag == red.each(m), jnp.where(s >= 0, e, -e), -jnp.inf))


def _order_stat(red, key, rank):
    """Per leaf, the order key of its valid element of 0-based ``rank`` in sorted order, exactly: bisection over
    the 2**32 float32 order keys (32 counting passes). ``red``: a :class:`_Rows` or :class:`_Blocks`."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = red.count_true(key <= red.each(mid)) >= rank + 1
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    start = (jnp.zeros_like(rank, jnp.uint32), jnp.full_like(rank, 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, start)[0]


def _middle(red, x, k):
    """Per leaf, the two middle values of its ``k`` smallest valid elements (``sort(x)[(k - 1) // 2]`` and
    ``sort(x)[k // 2]``) exactly: the first by :func:`_order_stat`, the second from it (one pass). ``red``: a
    :class:`_Rows` or :class:`_Blocks`."""
    key = _order_key(x)
    low = _order_stat(red, key, jnp.maximum(k - 1, 0) // 2)
    # the next order statistic: the same key when enough elements share it, else the smallest key above
    repeated = red.count_true(key <= red.each(low)) >= k // 2 + 1
    above = red.min(jnp.where(key > red.each(low), x, jnp.inf))
    low_value = _from_order_key(low)
    return low_value, jnp.where(repeated, low_value, above)


def _spread(red, x, k):
    """Per leaf, the 10th and 90th percentile of its ``k`` smallest valid elements as order statistics
    (``sort(x)[(k - 1) // 10]`` and ``sort(x)[ceil(9 (k - 1) / 10)]``, ``compare.spread_ranks``), exactly."""
    key = _order_key(x)
    n = jnp.maximum(k - 1, 0)
    low = _order_stat(red, key, n // 10)
    high = _order_stat(red, key, (9 * n + 9) // 10)
    return _from_order_key(low), _from_order_key(high)


class _Rows(NamedTuple):
    """Per-row reductions, then per leaf over its rows (``segment_*`` over the few rows, not the elements);
    ``rows``: each leaf's row count (:attr:`Layout.rows`, read by :meth:`largest`)."""

    leaf: jax.Array
    valid: jax.Array
    count: int
    rows: tuple[int, ...] = ()

    def max(self, x, fill=-jnp.inf):
        rowwise = jnp.max(jnp.where(self.valid, x, fill), axis=1)
        return jax.ops.segment_max(rowwise, self.leaf, num_segments=self.count, indices_are_sorted=True)

    def min(self, x):
        rowwise = jnp.min(jnp.where(self.valid, x, jnp.inf), axis=1)
        return jax.ops.segment_min(rowwise, self.leaf, num_segments=self.count, indices_are_sorted=True)

    def count_true(self, x):
        rowwise = jnp.sum(self.valid & x, axis=1, dtype=jnp.int32)
        return jax.ops.segment_sum(rowwise, self.leaf, num_segments=self.count, indices_are_sorted=True)

    def each(self, per_leaf):
        """A per-leaf value broadcast to its rows' elements."""
        return per_leaf[self.leaf][:, None]

    def max_exact(self, s, e):
        return _max_exact(self, s, e)

    def middle(self, x, k):
        return _middle(self, x, k)

    def spread(self, x, k):
        return _spread(self, x, k)

    def largest(self, key, values):
        """``values`` at each leaf's :data:`CANDIDATES` valid elements of largest ``key``: ``(leaves,
        CANDIDATES)`` each (a leaf with fewer valid elements repeats padding there: never read)."""
        return self.top(key, values)[1]

    def top(self, key, values):
        """``(keys, values)``: each leaf's :data:`CANDIDATES` largest valid ``key`` (``-inf`` for padding), in
        decreasing order, and ``values`` there, ``(leaves, CANDIDATES)`` each."""
        k = min(CANDIDATES, key.shape[1])
        top, at = jax.lax.top_k(jnp.where(self.valid, key, -jnp.inf), k)  # per row
        picked = [jnp.take_along_axis(v, at, axis=1) for v in values]
        # per leaf over its rows' candidates: a sort of rows x CANDIDATES elements, not of the leaf
        leaf = jnp.broadcast_to(self.leaf[:, None], top.shape).ravel()
        _, neg, *ordered = jax.lax.sort((leaf, -top.ravel(), *(p.ravel() for p in picked)), num_keys=2)
        first = np.concatenate([[0], np.cumsum(self.rows)[:-1]]) * k
        at = np.minimum(first[:, None] + np.arange(CANDIDATES)[None, :], leaf.shape[0] - 1)
        return -neg[at], [o[at] for o in ordered]


def _lay(arrays, layout: Layout):
    """The leaves (``None``: zeros) as the padded rows of one float32 matrix."""
    pieces = []
    for a, rows in zip(arrays, layout.rows, strict=True):
        if a is None:
            pieces.append(jnp.zeros((rows, layout.width), jnp.float32))
            continue
        flat = a.astype(jnp.float32).ravel()
        pieces.append(jnp.pad(flat, (0, rows * layout.width - flat.size)).reshape(rows, layout.width))
    return jnp.concatenate(pieces)


@functools.partial(jax.jit, static_argnums=(0, 5))
def device_stats(layout: Layout, group: dict, row_leaf, row_len, tol, median: bool = True) -> dict:
    """Per leaf, the float32 reductions from which ``compare.leaf_errors`` rebuilds the float64 statistics.

    Args:
        layout: the leaves' :class:`Layout` (static: its row counts shape the matrix).
        group: ``{field: [leaf arrays]}`` for the fields ``r``, ``c`` (every leaf) and ``r0``, ``c0``,
            ``extra`` (zeros where a leaf has none: the statistics of the missing ones are not read).
        row_leaf, row_len: ``layout.row_arrays(sizes)``, as arguments (constants would be folded by XLA).
        tol: ``(leaves, 2)`` float32 ``(atol, rtol)``.
        median: compute the update ratio's median here (32 counting passes over the leaves: on XLA:CPU, whose
            arrays are host memory already, NumPy's partition on the host is cheaper, so there it is left out).

    Returns:
        ``{name: (leaves,) array}``: ``scale`` (max|r|), ``diff``/``diff_e`` and ``change``/``change_e`` (the
        exact max |c - r| and |r - r0| as float32 pairs), ``low``/``high`` (the median update ratio's two middle
        float32 quotients), ``p10``/``p90`` (its 10th and 90th percentile quotients) and ``unsure`` (float32
        cannot settle that ratio), with ``median`` only; the
        badness statistics ``top``, ``near``, ``max_extra``, ``min_allowed`` and ``at_s``/``at_e``/``at_extra``
        ``(leaves, CANDIDATES)``; and ``finite`` (every input finite and not tiny, every float32 difference
        finite).
    """
    valid = jnp.arange(layout.width)[None, :] < row_len[:, None]
    rows = _Rows(row_leaf, valid, len(layout.rows), layout.rows)
    return _statistics(rows, {k: _lay(group[k], layout) for k in FIELDS}, tol, median)


def _statistics(red, flat: dict, tol, median: bool) -> dict:
    """:func:`device_stats`'s statistics of the float32 fields ``flat`` (``{field: elements}``, as ``red``
    lays them: a :class:`_Rows` matrix, or each device's rows of :class:`_Blocks`), one body for both paths."""
    r, c, r0, c0, extra = (flat[k] for k in FIELDS)
    s, e = two_diff(c, r)
    change, change_e = two_diff(r, r0)
    dc = c - c0
    out = {"scale": red.max(jnp.abs(r), fill=0.0)}
    out["diff"], out["diff_e"] = red.max_exact(s, e)
    out["change"], out["change_e"] = red.max_exact(change, change_e)
    if median:  # the update ratio: the median of dc / dr over the elements with |dr| >= 1% of its largest
        threshold = 0.01 * red.each(out["change"])
        mag = jnp.abs(change)
        used = mag >= threshold
        q = dc / change
        unsure = (jnp.abs(mag - threshold) <= BORDER * threshold) | (used & ~jnp.isfinite(q))
        out["unsure"] = red.count_true(unsure) > 0
        used_q, count = jnp.where(used, q, jnp.inf), red.count_true(used)
        out["low"], out["high"] = red.middle(used_q, count)
        out["p10"], out["p90"] = red.spread(used_q, count)
    # the elementwise badness against the allowance
    allowed = red.each(tol[:, 0]) + red.each(tol[:, 1]) * red.each(out["scale"]) + extra
    bad = jnp.abs(s) / allowed
    out["top"] = red.max(bad)
    out["near"] = red.count_true(bad >= red.each(out["top"]) * (1 - NEAR))
    out["max_extra"], out["min_allowed"] = red.max(extra, fill=0.0), red.min(allowed)
    out["at_s"], out["at_e"], out["at_extra"] = red.largest(bad, (s, e, extra))
    # settled on the device: the inputs and the float32 differences finite (3e38 - -3e38 overflows), none tiny
    settled = jnp.isfinite(s) & jnp.isfinite(change) & jnp.isfinite(dc)
    for x in flat.values():
        settled &= jnp.isfinite(x) & ~_tiny(x)
    out["finite"] = red.count_true(~settled) == 0
    return out


# ------------------------------------------------------------------------------------------- split leaves


def split_axes(sharding) -> tuple[str, ...] | None:
    """The mesh axes (of size > 1) that a ``NamedSharding`` splits its array over, in mesh order (``()``: the
    array is whole on every device); ``None`` for another sharding."""
    if not isinstance(sharding, NamedSharding):
        return None
    mesh, used = sharding.mesh, []
    for entry in sharding.spec:
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        used += [n for n in names if isinstance(n, str)]
    return tuple(ax for ax in mesh.axis_names if ax in used and mesh.shape[ax] > 1)


def comparison_place(ref, cand):
    """Where a leaf's two sides (and its before-state and allowance) are compared: the reference's sharding, or
    the candidate's where the reference's leaf is whole on every device of the same set and the candidate's
    placement splits it (moving the candidate onto the reference's sharding would gather it whole on every
    device)."""
    place = ref.sharding
    other = getattr(cand, "sharding", None)
    if (
        place.is_fully_replicated
        and other is not None
        and not other.is_fully_replicated
        and other.device_set == place.device_set
        and cand.shape == ref.shape
    ):
        return other
    return place


def parts(sharding: NamedSharding) -> int:
    """How many blocks a ``NamedSharding`` splits its array into (the product of the sizes of :func:`split_axes`)."""
    return math.prod(sharding.mesh.shape[ax] for ax in split_axes(sharding) or ())


def blocks_even(shape: tuple[int, ...], sharding: NamedSharding) -> bool:
    """Whether every dimension of ``shape`` splits into equal blocks over the axes its spec names."""
    for size, entry in zip(shape, sharding.spec, strict=False):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if size % math.prod(sharding.mesh.shape[n] for n in names):
            return False
    return True


class _Blocks(NamedTuple):
    """Inside one ``shard_map`` over a mesh, each device's blocks of the split leaves laid into its own rows
    (``rows``, a :class:`_Rows`); every per-leaf reduction is the device's, combined over all the mesh's
    ``axes`` (``pmax``, ``pmin``, ``psum``). A device whose block of a leaf is a copy of another device's (along
    an axis that replicates the leaf) has that leaf's rows masked out, so every element counts once."""

    rows: _Rows
    axes: tuple[str, ...]

    def max(self, x, fill=-jnp.inf):
        return jax.lax.pmax(self.rows.max(x, fill), self.axes)

    def min(self, x):
        return jax.lax.pmin(self.rows.min(x), self.axes)

    def count_true(self, x):
        return jax.lax.psum(self.rows.count_true(x), self.axes)

    def each(self, per_leaf):
        return self.rows.each(per_leaf)

    def max_exact(self, s, e):
        return _max_exact(self, s, e)

    def middle(self, x, k):
        return _middle(self, x, k)

    def spread(self, x, k):
        return _spread(self, x, k)

    def largest(self, key, values):
        """``values`` at each leaf's :data:`CANDIDATES` elements of largest ``key``, ``(leaves, CANDIDATES)``
        each: every device's own candidates (:meth:`_Rows.top`), gathered over the axes (a few numbers per leaf
        and device), then the largest of those."""
        top, picked = self.rows.top(key, values)
        top = jax.lax.all_gather(top, self.axes, axis=1, tiled=True)  # (leaves, devices x CANDIDATES)
        picked = [jax.lax.all_gather(p, self.axes, axis=1, tiled=True) for p in picked]
        _, at = jax.lax.top_k(top, CANDIDATES)
        return [jnp.take_along_axis(p, at, axis=1) for p in picked]


def _primary(mesh, sharding) -> jax.Array:
    """Inside a ``shard_map`` over ``mesh``: whether this device's block of a leaf placed by ``sharding`` is the
    one that counts (index 0 along every axis that replicates the leaf)."""
    split = split_axes(sharding) or ()
    first = [jax.lax.axis_index(ax) == 0 for ax in mesh.axis_names if ax not in split and mesh.shape[ax] > 1]
    return functools.reduce(jnp.logical_and, first, jnp.bool_(True))


@functools.partial(jax.jit, static_argnums=(0, 1, 6))
def split_stats(
    places: tuple, layout: Layout, group: dict, row_leaf, row_len, tol, median: bool = True
) -> dict:
    """:func:`device_stats` of leaves that their placement splits over one mesh, each device reducing its own
    blocks (one ``shard_map`` over the mesh, :class:`_Blocks`): no leaf is gathered, no device holds more of one
    than its block.

    Args:
        places: per leaf, its ``NamedSharding`` on the one mesh (static), every field of the leaf placed in it,
            splitting it into equal blocks (:func:`split_axes`, :func:`blocks_even`).
        layout: the :class:`Layout` of one device's blocks (each leaf's size over the parts it is split into).
        group: ``{field: [leaf arrays or None]}`` as :func:`device_stats` takes it.
        row_leaf, row_len: ``layout.row_arrays(block sizes)``.
        tol: ``(leaves, 2)`` float32 ``(atol, rtol)``.
        median: as :func:`device_stats`.

    Returns:
        :func:`device_stats`'s ``{name: (leaves,) array}``, equal to what it gives for the same leaves: the same
        body (:func:`_statistics`) over exact reductions.
    """
    mesh = places[0].mesh
    present = {k: tuple(j for j, a in enumerate(group[k]) if a is not None) for k in FIELDS}

    def local(arrays, row_leaf, row_len, tol):
        blocks = {k: [None] * len(places) for k in FIELDS}
        for k in FIELDS:
            for j, a in zip(present[k], arrays[k], strict=True):
                blocks[k][j] = a
        primary = jnp.stack([_primary(mesh, s) for s in places])
        valid = (jnp.arange(layout.width)[None, :] < row_len[:, None]) & primary[row_leaf][:, None]
        rows = _Rows(row_leaf, valid, len(layout.rows), layout.rows)
        flat = {k: _lay(blocks[k], layout) for k in FIELDS}
        return _statistics(_Blocks(rows, tuple(mesh.axis_names)), flat, tol, median)

    arrays = {k: [group[k][j] for j in present[k]] for k in FIELDS}
    specs = {k: [places[j].spec for j in present[k]] for k in FIELDS}
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=P(), check_vma=False)
    return mapped(arrays, row_leaf, row_len, tol)
