"""The compiled half of :func:`shardcheck.parity.compare.leaf_errors`: every leaf's float32 reductions in one call.

Leaves of any sizes are laid into the rows of one ``(rows, width)`` float32 matrix (each leaf padded to whole
rows), reduced per row, then per leaf over its rows. The compiled function is one set of kernels whatever the
number and sizes of the leaves (a per-leaf graph compiles one kernel per leaf, which dominates a transformer's
check on XLA:CPU), and no statistic sorts (sorting is slow on XLA:CPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


class _Rows(NamedTuple):
    """Per-row reductions, then per leaf over its rows (``segment_*`` over the few rows, not the elements)."""

    leaf: jax.Array
    valid: jax.Array
    count: int

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
        """``(m, e_m)`` per leaf: ``max |a - b| == m + e_m`` exactly, from :func:`two_diff`'s pairs."""
        mag = jnp.abs(s)
        m = self.max(mag, fill=0.0)
        return m, self.max(jnp.where(mag == self.each(m), jnp.where(s >= 0, e, -e), -jnp.inf))

    def middle(self, x, k):
        """Per leaf, the two middle values of its ``k`` smallest valid elements (``sort(x)[(k - 1) // 2]`` and
        ``sort(x)[k // 2]``) exactly: the first by bisection over the 2**32 float32 order keys (32 counting
        passes), the second from it (one pass)."""
        key = _order_key(x)
        rank = jnp.maximum(k - 1, 0) // 2

        def halve(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            enough = self.count_true(key <= self.each(mid)) >= rank + 1
            return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

        start = (jnp.zeros_like(rank, jnp.uint32), jnp.full_like(rank, 0xFFFFFFFF, jnp.uint32))
        low, _ = jax.lax.fori_loop(0, 32, halve, start)
        # the next order statistic: the same key when enough elements share it, else the smallest key above
        repeated = self.count_true(key <= self.each(low)) >= k // 2 + 1
        above = self.min(jnp.where(key > self.each(low), x, jnp.inf))
        low_value = _from_order_key(low)
        return low_value, jnp.where(repeated, low_value, above)

    def largest(self, key, values, layout_rows):
        """``values`` at each leaf's :data:`CANDIDATES` valid elements of largest ``key``: ``(leaves,
        CANDIDATES)`` each (a leaf with fewer valid elements repeats padding there: never read)."""
        k = min(CANDIDATES, key.shape[1])
        top, at = jax.lax.top_k(jnp.where(self.valid, key, -jnp.inf), k)  # per row
        picked = [jnp.take_along_axis(v, at, axis=1) for v in values]
        # per leaf over its rows' candidates: a sort of rows x CANDIDATES elements, not of the leaf
        leaf = jnp.broadcast_to(self.leaf[:, None], top.shape).ravel()
        _, _, *ordered = jax.lax.sort((leaf, -top.ravel(), *(p.ravel() for p in picked)), num_keys=2)
        first = np.concatenate([[0], np.cumsum(layout_rows)[:-1]]) * k
        at = np.minimum(first[:, None] + np.arange(CANDIDATES)[None, :], leaf.shape[0] - 1)
        return [o[at] for o in ordered]


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
        float32 quotients) and ``unsure`` (float32 cannot settle that ratio), with ``median`` only; the
        badness statistics ``top``, ``near``, ``max_extra``, ``min_allowed`` and ``at_s``/``at_e``/``at_extra``
        ``(leaves, CANDIDATES)``; and ``finite`` (every input finite and not tiny, every float32 difference
        finite).
    """
    rows = _Rows(row_leaf, jnp.arange(layout.width)[None, :] < row_len[:, None], len(layout.rows))
    flat = {k: _lay(group[k], layout) for k in FIELDS}
    r, c, r0, c0, extra = (flat[k] for k in FIELDS)
    s, e = two_diff(c, r)
    change, change_e = two_diff(r, r0)
    dc = c - c0
    out = {"scale": rows.max(jnp.abs(r), fill=0.0)}
    out["diff"], out["diff_e"] = rows.max_exact(s, e)
    out["change"], out["change_e"] = rows.max_exact(change, change_e)
    if median:  # the update ratio: the median of dc / dr over the elements with |dr| >= 1% of its largest
        threshold = 0.01 * rows.each(out["change"])
        mag = jnp.abs(change)
        used = mag >= threshold
        q = dc / change
        unsure = (jnp.abs(mag - threshold) <= BORDER * threshold) | (used & ~jnp.isfinite(q))
        out["unsure"] = rows.count_true(unsure) > 0
        out["low"], out["high"] = rows.middle(jnp.where(used, q, jnp.inf), rows.count_true(used))
    # the elementwise badness against the allowance
    allowed = rows.each(tol[:, 0]) + rows.each(tol[:, 1]) * rows.each(out["scale"]) + extra
    bad = jnp.abs(s) / allowed
    out["top"] = rows.max(bad)
    out["near"] = rows.count_true(bad >= rows.each(out["top"]) * (1 - NEAR))
    out["max_extra"], out["min_allowed"] = rows.max(extra, fill=0.0), rows.min(allowed)
    out["at_s"], out["at_e"], out["at_extra"] = rows.largest(bad, (s, e, extra), layout.rows)
    # settled on the device: the inputs and the float32 differences finite (3e38 - -3e38 overflows), none tiny
    settled = jnp.isfinite(s) & jnp.isfinite(change) & jnp.isfinite(dc)
    for x in flat.values():
        settled &= jnp.isfinite(x) & ~_tiny(x)
    out["finite"] = rows.count_true(~settled) == 0
    return out
