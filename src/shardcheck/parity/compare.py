"""Leaf-by-leaf comparison of a candidate's state against the reference's, on the host in float64."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from shardcheck._tree import path_str
from shardcheck.distributed import gather_to_host
from shardcheck.parity.diagnosis import LeafError

PyTree = Any


def flatten_state(tree: PyTree) -> dict[str, Any]:
    """``{dotted path: leaf}`` of a pytree (``nnx.State`` included), e.g. ``{"hidden.kernel": Array}``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(p): leaf for p, leaf in leaves}


def to_host(a) -> np.ndarray:
    """A leaf as a NumPy array; arrays spread over several processes are gathered first."""
    return np.asarray(gather_to_host(a))


def host_tree(tree: PyTree) -> dict[str, np.ndarray]:
    """:func:`flatten_state` with every leaf on the host."""
    return {k: to_host(v) for k, v in flatten_state(tree).items()}


def replica_mismatch(a) -> bool:
    """True when two of this process's devices hold different bytes for the same slice of ``a``.

    A replicated (or partially replicated) ``jax.Array`` keeps one buffer per device; JAX trusts that they are
    equal (``shard_map`` with ``check_vma=False`` and ``out_specs=P()`` does not check). Compared bitwise.
    """
    if not isinstance(a, jax.Array):
        return False
    shards = a.addressable_shards
    if len(shards) < 2:
        return False
    seen: dict[tuple, bytes] = {}
    for shard in shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        data = np.asarray(shard.data).tobytes()
        if key in seen and seen[key] != data:
            return True
        seen.setdefault(key, data)
    return False


def _ratio(dr: np.ndarray, dc: np.ndarray) -> float | None:
    """The median elementwise ratio ``dc / dr`` over elements where ``|dr|`` is at least 1% of its largest."""
    big = np.abs(dr)
    top = float(np.max(big, initial=0.0))
    if top == 0:
        return None
    mask = big >= 0.01 * top
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.median(dc[mask] / dr[mask]))


def leaf_error(
    step, kind, path, ref, cand, rtol, atol, before_ref=None, before_cand=None, allowance=None
) -> LeafError:
    """Compare one leaf: passes when every ``|cand - ref| <= atol + rtol * max|ref| + allowance`` (elementwise).

    ``allowance``: an optional array of ``ref``'s shape (or a scalar) widening the tolerance element by element
    (the propagated sensitivity of a normalizing optimizer's update; ``shardcheck.parity.harness``).
    ``before_*``: the leaf before the step, to report the ratio of the changes rather than of the values.
    """
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    scale = float(np.max(np.abs(r), initial=0.0))
    base = atol + rtol * scale
    if r.shape != c.shape:
        return LeafError(step, kind, path, math.inf, math.inf, base, False)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(c - r)
    nan = bool(np.isnan(diff).any())
    max_abs = math.nan if nan else float(np.max(diff, initial=0.0))
    rel = (max_abs / scale) if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    extra = (
        np.zeros_like(r) if allowance is None else np.broadcast_to(np.asarray(allowance, np.float64), r.shape)
    )
    allowed = base + extra
    ok = (not nan) and bool(np.all(diff <= allowed))
    tol = base + float(np.max(extra, initial=0.0))
    if not nan and allowance is not None and diff.size:
        # report the tolerance the verdict used: max_abs_err / worst elementwise badness (err > tol <=> FAIL)
        with np.errstate(divide="ignore", invalid="ignore"):
            worst = float(np.max(np.where(allowed > 0, diff / allowed, np.where(diff > 0, np.inf, 0.0))))
        if worst > 0 and np.isfinite(worst):
            tol = max_abs / worst
    if before_ref is not None:
        dr, dc = r - np.asarray(before_ref, np.float64), c - np.asarray(before_cand, np.float64)
        change = float(np.max(np.abs(dr), initial=0.0))
    else:
        dr, dc, change = r, c, None
    return LeafError(step, kind, path, max_abs, rel, tol, ok, _ratio(dr, dc), change)


def counter_error(step, path, ref, cand) -> LeafError:
    """Compare an integer counter exactly."""
    r, c = int(np.asarray(ref)), int(np.asarray(cand))
    err = float(abs(c - r))
    rel = (err / abs(r)) if r else (0.0 if err == 0 else math.inf)
    return LeafError(step, "counter", path, err, rel, 0.0, c == r, (c / r) if r else None)


def is_int(a) -> bool:
    """Whether ``a`` holds integers or booleans (compared exactly)."""
    return np.dtype(np.asarray(a).dtype).kind in "iub"
