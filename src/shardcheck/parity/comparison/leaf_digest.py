"""The digest of one array leaf: what a recorded run keeps of it instead of its values.

A digest holds the leaf's shape, dtype and sharding (its ``PartitionSpec``), its L2 norm and ``max|x|`` and, for a
parameter, ``max|x_t - x_{t-1}|`` (the update size), all reduced where the leaf lives (on its devices in float32,
one small jitted call per leaf, only scalars coming to the host; on CPU devices, whose memory is the host's, in
float64 from the shards the hash reads), :data:`SAMPLES` elements at fixed indices, each read from the
addressable shard that holds it, and a sha256 over the addressable shards' bytes in index order (each distinct
slice once). Nothing is gathered whole.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

SAMPLES = 8
"""Elements sampled per leaf, at indices fixed by the leaf's name and shape (:func:`sample_indices`)."""

HASH_BYTES = 32
"""sha256 digest size."""


class LeafDigest(NamedTuple):
    """One leaf's digest at one step.

    Attributes:
        sharding: ``"P('fsdp', None)"`` for a ``NamedSharding`` (trailing ``None`` entries dropped, so a
            replicated leaf reads ``P()``), ``"single device"`` for a leaf on one device, else the sharding's text.
        norm: the L2 norm, float32 arithmetic on the devices (as a Python float).
        max: ``max|x|`` (exact: it is one of the elements).
        update: ``max|x - x_before|`` (float32 arithmetic), NaN where no earlier value was given.
        samples: ``(SAMPLES,)`` float64, the elements at :func:`sample_indices` (NaN where the leaf has fewer
            elements, or where this process holds no shard with the element).
        sha256: ``(HASH_BYTES,)`` uint8.
    """

    sharding: str
    norm: float
    max: float
    update: float
    samples: np.ndarray
    sha256: np.ndarray


def sample_indices(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``(SAMPLES,)`` int64 flat (row-major) indices of the elements a digest samples, ``-1`` past the leaf's size.

    A deterministic function of the leaf's name and shape (a NumPy generator seeded with their sha256), so a
    recording and its replay sample the same elements on any machine: distinct indices, sorted.
    """
    size = int(np.prod(shape, dtype=np.int64))
    seed = int.from_bytes(hashlib.sha256(f"{name}|{tuple(shape)}".encode()).digest()[:8], "little")
    picked = np.sort(np.random.default_rng(seed).choice(size, min(SAMPLES, size), replace=False))
    return np.concatenate([picked, np.full(SAMPLES - picked.size, -1)]).astype(np.int64)


def spec_text(a) -> str:
    """The sharding of ``a`` as text (see :class:`LeafDigest`)."""
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding):
        entries = list(sharding.spec)
        while entries and entries[-1] is None:
            entries.pop()
        return str(PartitionSpec(*entries))
    if sharding is None or len(sharding.device_set) == 1:
        return "single device"
    return str(sharding)


def as_array(a) -> jax.Array:
    """A leaf as a numeric ``jax.Array``: PRNG keys as their raw ``uint32`` data, host values on the default
    device."""
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(a)
    return a if isinstance(a, jax.Array) else jnp.asarray(a)


@jax.jit
def _reductions(x, before) -> jax.Array:
    """``(3,)`` float32: the L2 norm of ``x`` (scaled by its max, so no square overflows), ``max|x|`` and
    ``max|x - before|`` (``-1`` when ``before`` is None), reduced over every axis where ``x`` lives (no reshape, so
    a leaf split along any dimension stays split). Compiled once per shape, dtype and sharding."""
    x = x.astype(jnp.float32)
    top = jnp.where(jnp.any(jnp.isnan(x)), jnp.nan, jnp.max(jnp.abs(x), initial=0.0))  # NaN stays NaN
    scale = jnp.where(top > 0, top, 1.0)
    norm = scale * jnp.sqrt(jnp.sum(jnp.square(x / scale)))
    if before is None:
        return jnp.stack([norm, top, jnp.float32(-1.0)])
    change = jnp.abs(x - before.astype(jnp.float32))
    update = jnp.where(jnp.any(jnp.isnan(change)), jnp.nan, jnp.max(change, initial=0.0))
    return jnp.stack([norm, top, update])


def _device_set(a) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in a.sharding.device_set))


def on_host(a: jax.Array) -> bool:
    """Whether ``a`` is reduced on the host: every shard in this process, on CPU devices (whose memory is the
    host's: NumPy's float64 pass over the shards the hash reads anyway compiles nothing, as
    :mod:`shardcheck.parity.comparison.live` does on CPU)."""
    return a.is_fully_addressable and all(d.platform == "cpu" for d in a.sharding.device_set)


def device_scalars(a: jax.Array, before) -> tuple[float, float, float]:
    """``(norm, max, update)`` of one leaf, reduced on its devices in float32 (update NaN without ``before``; a
    ``before`` on other devices, a step that moved the leaf, is moved to them first)."""
    if before is not None:
        before = as_array(before)
        before = before if _device_set(before) == _device_set(a) else jax.device_put(before, a.sharding)
    row = np.asarray(_reductions(a, before).addressable_data(0), dtype=np.float64)
    return float(row[0]), float(row[1]), float(row[2]) if before is not None else float("nan")


def _local_shards(a: jax.Array) -> list:
    """This process's shards of ``a``, each distinct slice once, in index order."""
    unique = {}
    for shard in a.addressable_shards:
        key = tuple((s.start or 0, s.stop, s.step) for s in shard.index)
        unique.setdefault(key, shard)
    return [unique[k] for k in sorted(unique, key=lambda k: tuple((s, e or 0) for s, e, _ in k))]


def _max(a: float, b: float) -> float:
    """The larger, NaN when either is (as ``jnp.max`` on the devices)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def host_parts(a: jax.Array, indices: np.ndarray, before=None, *, scalars: bool = False) -> dict:
    """What this process's shards of ``a`` give, one shard on the host at a time.

    Returns ``{"sha256": (HASH_BYTES,) uint8, "samples": (SAMPLES,) float64}``: the hash over each distinct
    shard's bytes (C order) in index order, and the element at each flat index of ``indices`` read from the shard
    holding it (NaN for ``-1`` or an element no local shard holds). With ``scalars`` (a leaf :func:`on_host`),
    also ``"norm"``, ``"max"`` and ``"update"`` (``max|a - before|``, NaN without ``before``) in float64 over the
    shards.
    """
    shape = a.shape
    wanted = {int(i): np.unravel_index(int(i), shape) for i in indices if i >= 0}
    found: dict[int, float] = {}
    h = hashlib.sha256()
    squares, top, update = 0.0, 0.0, 0.0
    previous = None if before is None or not scalars else np.asarray(as_array(before))
    for shard in _local_shards(a):
        data = np.asarray(shard.data)
        h.update(data.tobytes())  # C order
        if scalars and data.size:
            x = data.astype(np.float64)
            squares, top = squares + float(np.sum(x * x)), _max(top, float(np.max(np.abs(x))))
            if previous is not None:
                update = _max(update, float(np.max(np.abs(x - previous[shard.index]))))
        starts = [s.start or 0 for s in shard.index]
        stops = [dim if s.stop is None else s.stop for s, dim in zip(shard.index, shape, strict=True)]
        for i, at in wanted.items():
            if i not in found and all(lo <= j < hi for j, lo, hi in zip(at, starts, stops, strict=True)):
                found[i] = float(np.asarray(data[tuple(j - lo for j, lo in zip(at, starts, strict=True))]))
    out = {
        "sha256": np.frombuffer(h.digest(), dtype=np.uint8).copy(),
        "samples": np.array([found.get(int(i), np.nan) for i in indices], dtype=np.float64),
    }
    if scalars:
        out.update(norm=math.sqrt(squares), max=top, update=update if before is not None else math.nan)
    return out


def digest_leaves(
    leaves: Mapping[str, Any], before: Mapping[str, Any], indices: Mapping[str, np.ndarray]
) -> dict[str, LeafDigest]:
    """``{name: LeafDigest}`` of every leaf of ``leaves``.

    The norm, max and update size are reduced where the leaf lives: on its devices in float32
    (:func:`device_scalars`), or for a leaf held whole by CPU devices on the host in float64, from the shard
    reads the hash makes anyway (:func:`on_host`).

    Args:
        leaves: ``{name: array}`` (``jax.Array``, NumPy or Python scalars; PRNG keys digest as their raw data).
        before: ``{name: array}`` the same leaves' values before the step, for those whose update size is kept.
        indices: ``{name: (SAMPLES,) int64}`` the sampled flat indices (:func:`sample_indices`).

    Returns:
        The digests, in ``leaves``' order.
    """
    out = {}
    for name, leaf in leaves.items():
        a = as_array(leaf)
        host = on_host(a)
        parts = host_parts(a, indices[name], before.get(name), scalars=host)
        if host:
            norm, top, update = parts["norm"], parts["max"], parts["update"]
        elif a.size:
            norm, top, update = device_scalars(a, before.get(name))
        else:
            norm, top, update = 0.0, 0.0, 0.0 if name in before else math.nan
        out[name] = LeafDigest(spec_text(a), norm, top, update, parts["samples"], parts["sha256"])
    return out
