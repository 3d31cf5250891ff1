"""Leaf-by-leaf comparison of a candidate's state against the reference's: float64 semantics, reduced on the device."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck._tree import copy_arrays, path_str
from shardcheck.distributed import gather_to_host
from shardcheck.parity.comparison import _device_stats
from shardcheck.parity.diagnosis.evidence import LeafError

PyTree = Any


def flatten_state(tree: PyTree) -> dict[str, Any]:
    """``{dotted path: leaf}`` of a pytree (``nnx.State`` included), e.g. ``{"hidden.kernel": Array}``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    try:
        paths = _PATHS.get(treedef)
    except (TypeError, ValueError):  # a node's data that does not hash or compare: its paths each time
        return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    if paths is None:
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        if len(_PATHS) >= _PATHS_KEPT:  # (one clear: safe beside another thread's flatten)
            _PATHS.clear()
        _PATHS[treedef] = paths
    return dict(zip(paths, leaves, strict=True))


# a tree structure's dotted paths (the structure fixes them), for up to _PATHS_KEPT structures: a check flattens
# the same few trees several times a step, and naming ~700 leaves a step took ~2 ms (issue #35)
_PATHS: dict = {}
_PATHS_KEPT = 256


def to_host(a) -> np.ndarray:
    """A leaf as a NumPy array; arrays spread over several processes are gathered first."""
    if isinstance(a, jax.Array) and a.is_fully_addressable:  # gather_to_host's own path, without its tree map
        return np.asarray(a)  # (a check reads about 300 leaves a step: 30 -> 12 us each, issue #35)
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
    seen: dict[tuple, np.ndarray] = {}
    for shard in shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        data = np.ascontiguousarray(shard.data).reshape(-1).view(np.uint8)  # the bytes, without a copy
        if key in seen and not np.array_equal(seen[key], data):
            return True
        seen.setdefault(key, data)
    return False


def _ratio(dr: np.ndarray, dc: np.ndarray, top: float | None = None) -> float | None:
    """The median elementwise ratio ``dc / dr`` over elements where ``|dr|`` is at least 1% of its largest
    (``top``: that largest, when already known)."""
    return _ratio_stats(dr, dc, top)[0]


def spread_ranks(n: int) -> tuple[int, int]:
    """The 0-based ranks of the update ratio's 10th and 90th percentile among its ``n >= 1`` sorted elements:
    ``floor(0.1 (n - 1))`` and ``ceil(0.9 (n - 1))`` (order statistics, no interpolation, so that the device's
    float32 quotients give the same elements)."""
    return (n - 1) // 10, -(-9 * (n - 1) // 10)


def _ratio_stats(
    dr: np.ndarray, dc: np.ndarray, top: float | None = None
) -> tuple[float | None, tuple[float, float] | None]:
    """``(median, (p10, p90))`` of the elementwise ratio ``dc / dr`` over the elements where ``|dr|`` is at least
    1% of its largest (``top``: that largest, when already known); ``(None, None)`` where ``dr`` is all 0. The
    percentiles are the order statistics of :func:`spread_ranks` (``LeafError.spread``)."""
    big = np.abs(dr)
    top = float(np.max(big, initial=0.0)) if top is None else top
    if top == 0:
        return None, None
    mask = big >= 0.01 * top
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = (dc[mask] / dr[mask]).ravel()
    if q.size == 0:
        return math.nan, None
    lo, hi = spread_ranks(q.size)
    ordered = np.partition(q, [lo, hi])  # NaN last, as in a sort
    return float(np.median(q)), (float(ordered[lo]), float(ordered[hi]))


def leaf_error(
    step, kind, path, ref, cand, rtol, atol, before_ref=None, before_cand=None, allowance=None
) -> LeafError:
    """Compare one leaf: passes when every ``|cand - ref| <= atol + rtol * max|ref| + allowance`` (elementwise).

    ``allowance``: an optional array of ``ref``'s shape (or a scalar) widening the tolerance element by element
    (the propagated sensitivity of a normalizing optimizer's update; ``shardcheck.parity.harness.check``).
    ``before_*``: the leaf before the step, to report the ratio of the changes rather than of the values.
    """
    if allowance is None and before_ref is None:
        zeros = _both_zeros(step, kind, path, ref, cand, rtol, atol)
        if zeros is not None:
            return zeros
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    scale = float(np.max(np.abs(r), initial=0.0))
    base = atol + rtol * scale
    if r.shape != c.shape:
        return LeafError(step, kind, path, math.inf, math.inf, base, False, shape=r.shape, cand_shape=c.shape)
    if allowance is None and before_ref is None and not r.any() and not c.any():
        # both all zeros (an accumulator emptied after its step): every field below, without its passes
        return LeafError(step, kind, path, 0.0, 0.0, base + 0.0, True, None, None, None, r.shape, zeros=True)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(c - r)
    nan = bool(np.isnan(diff).any())
    max_abs = math.nan if nan else float(np.max(diff, initial=0.0))
    rel = (max_abs / scale) if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if allowance is None:  # the rule with an allowance of zeros (base + 0 at every element), no array of them
        allowed = base + 0.0
        ok = (not nan) and bool(np.all(diff <= allowed))
        tol = base + 0.0
    else:
        extra = np.broadcast_to(np.asarray(allowance, np.float64), r.shape)
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
    ratio, spread = _ratio_stats(dr, dc)
    zeros = before_ref is None and scale == 0 and max_abs == 0  # both sides all zeros
    return LeafError(step, kind, path, max_abs, rel, tol, ok, ratio, change, spread, r.shape, zeros=zeros)


def within(ref, cand, rtol: float, atol: float, allowance=None) -> bool:
    """:func:`leaf_error`'s verdict (``LeafError.ok``) alone: one shape, no NaN, and every ``|cand - ref| <= atol +
    rtol * max|ref| + allowance``, in float64, without the record's statistics (a failing check's hypotheses
    compare a few hundred thousand leaves: ~0.1 ms each with them). ``allowance``: ``None``, a scalar or an array
    of ``ref``'s shape."""
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if r.shape != c.shape:
        return False
    allowed = atol + rtol * float(np.max(np.abs(r), initial=0.0))
    if allowance is not None:
        allowed = allowed + np.broadcast_to(np.asarray(allowance, np.float64), r.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.all(np.abs(c - r) <= allowed))  # a NaN difference compares False


def _both_zeros(step, kind, path, ref, cand, rtol, atol) -> LeafError | None:
    """:func:`leaf_error`'s record (without allowance or before-state) of two all-zero leaves of one shape, read
    in their own NumPy dtypes, without the float64 copies (an emptied accumulator, compared at every step of an
    accumulation check, issue #35); ``None`` otherwise, or where a dtype is not NumPy's bool, int or float."""
    r, c = np.asarray(ref), np.asarray(cand)
    if r.dtype.kind not in "biuf" or c.dtype.kind not in "biuf" or r.shape != c.shape or r.any() or c.any():
        return None
    base = atol + rtol * 0.0  # max |ref| of zeros
    return LeafError(step, kind, path, 0.0, 0.0, base + 0.0, True, None, None, None, r.shape, zeros=True)


def counter_error(step, path, ref, cand) -> LeafError:
    """Compare an integer counter exactly (``ref``, ``cand``: scalars, or arrays of one element). Where both
    carry a dtype and the two differ (the candidate's step converted the counter: a pmean of the whole optimizer
    state turns an int32 count into float32), the leaf fails whatever its value (``LeafError.dtypes``)."""
    dtypes = tuple(getattr(a, "dtype", None) for a in (ref, cand))
    if None not in dtypes and np.dtype(dtypes[0]) != np.dtype(dtypes[1]):
        names = (np.dtype(dtypes[0]).name, np.dtype(dtypes[1]).name)
        return LeafError(step, "counter", path, math.inf, math.inf, 0.0, False, dtypes=names)
    r, c = int(np.asarray(ref)), int(np.asarray(cand))
    err = float(abs(c - r))
    rel = (err / abs(r)) if r else (0.0 if err == 0 else math.inf)
    return LeafError(step, "counter", path, err, rel, 0.0, c == r, (c / r) if r else None, counts=(r, c))


def is_int(a) -> bool:
    """Whether ``a`` holds integers or booleans (compared exactly)."""
    # the dtype, not the value: an array spread over processes has no value on one of them
    dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    try:
        return np.dtype(dtype).kind in "iub"
    except TypeError:  # a PRNG key's dtype
        return False


# ------------------------------------------------------------------------------------- on-device statistics


DEVICE_STATS: bool | None = None
"""Where :func:`leaf_errors` compares: ``None`` (default) on accelerators on the devices, on CPU devices on the
host (their buffers are host memory: NumPy's float64 pass over them is faster than XLA:CPU's reductions, and
compiles nothing); ``True``/``False`` force one place. Both give the same :class:`LeafError`, field for field."""


def _device_stats_for(item) -> bool:
    """Whether :func:`leaf_errors` reduces ``item`` on its devices (:data:`DEVICE_STATS`, :func:`_on_device`)."""
    if not _on_device(item):
        return False
    if DEVICE_STATS is not None:
        return DEVICE_STATS
    return next(iter(item.ref.sharding.device_set)).platform != "cpu"


@contextlib.contextmanager
def on_devices(active: bool = True):
    """Within this block (when ``active``), :func:`leaf_errors` compares on the devices and takes the update
    ratio's median there, and the harness's per-leaf scalars (:func:`max_abs`, :func:`max_abs_diff`, ...) reduce
    there (:data:`DEVICE_STATS`, :data:`DEVICE_MEDIAN`, :data:`DEVICE_SCALARS` forced ``True``) unless they were
    forced already: a check whose state lives sharded brings only per-leaf scalars to the host."""
    global DEVICE_STATS, DEVICE_MEDIAN, DEVICE_SCALARS
    saved = DEVICE_STATS, DEVICE_MEDIAN, DEVICE_SCALARS
    if active:
        DEVICE_STATS = True if DEVICE_STATS is None else DEVICE_STATS
        DEVICE_MEDIAN = True if DEVICE_MEDIAN is None else DEVICE_MEDIAN
        DEVICE_SCALARS = True if DEVICE_SCALARS is None else DEVICE_SCALARS
    try:
        yield
    finally:
        DEVICE_STATS, DEVICE_MEDIAN, DEVICE_SCALARS = saved


DEVICE_MEDIAN: bool | None = None
"""Where :func:`leaf_errors` takes the update ratio's median: ``None`` (default) on accelerators on the device, on
CPU devices (whose arrays are host memory) on the host, where NumPy's partition beats 32 counting passes;
``True``/``False`` force one place."""


class LeafInput(NamedTuple):
    """One leaf to compare: the arguments of :func:`leaf_error`."""

    step: int
    kind: str
    path: str
    ref: Any
    cand: Any
    rtol: float
    atol: float
    before_ref: Any = None
    before_cand: Any = None
    allowance: Any = None


def _on_device(item: LeafInput) -> bool:
    arrays = [item.ref, item.cand] + [a for a in (item.before_ref, item.before_cand) if a is not None]
    allowance = item.allowance
    return (
        all(isinstance(a, jax.Array) and a.is_fully_addressable for a in arrays)
        and all(a.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) for a in arrays)
        and item.ref.shape == item.cand.shape
        and item.ref.size > 0
        and (item.before_ref is None) == (item.before_cand is None)
        and (allowance is None or (np.ndim(allowance) > 0 and np.shape(allowance) == item.ref.shape))
        # a low-precision allowance (bfloat16 parameters' sensitivity) is widened to float32 exactly
        and (allowance is None or allowance.dtype in (jnp.float32, jnp.bfloat16, jnp.float16))
    )


def _devices(item: LeafInput) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in _device_stats.comparison_place(item.ref, item.cand).device_set))


def leaf_errors(items: Sequence[LeafInput]) -> list[LeafError]:
    """:func:`leaf_error` of every item, with one compiled call for all the leaves on one set of devices
    (``shardcheck.parity.comparison._device_stats``).

    On the device, in float32, per leaf: ``max |c - r|`` and ``max |r - r0|`` exactly (each element's float32
    difference and its rounding error, Knuth's TwoSum; the float64 value is their sum), ``max |r|``, and with an
    allowance the elementwise badness ``|c - r| / (atol + rtol * max|r| + allowance)``, whose largest elements are
    re-checked in float64 on the host when at most 16 lie within a relative ``1e-5`` of the largest. So every
    field but the ratio equals :func:`leaf_error`'s exactly. The update ratio, the median of ``dc / dr`` over the
    elements whose ``|dr|`` is at least 1% of its largest, is on accelerators (:data:`DEVICE_MEDIAN`) the median of
    the float32 quotients of the float32 differences: each quotient is within ``3 * 2**-24`` relative of its
    float64 value, and so is the median (an order statistic moves no more than its elements); the elements it is
    taken over are float64's (a leaf with an element within ``1e-5`` of the threshold gets its ratio on the host).
    The ratio's spread (``LeafError.spread``, its 10th and 90th percentile order statistics) comes from the same
    elements and quotients, two more bisections, to the same float32 rounding.
    On CPU devices it is NumPy's float64 median, exactly :func:`leaf_error`'s. Leaves the device cannot settle
    (non-finite or tiny values, many ties at the top, tiny allowances, other dtypes, arrays spread over
    processes) are compared on the host by :func:`leaf_error`, and so is every leaf on CPU devices
    (:data:`DEVICE_STATS`). On accelerators only per-leaf scalars come to the host.

    A leaf whose placement splits it over a mesh (``_device_stats.comparison_place``: the reference's, or the
    candidate's where the reference's leaf is whole on every device) is reduced where its blocks live, never
    gathered whole: each device lays its own blocks into rows, and collectives combine the devices' results
    (``_device_stats.split_stats``, one ``shard_map`` per mesh); the others are laid into one matrix
    (``_device_stats.device_stats``). Both give the same statistics.

    Returns:
        One :class:`LeafError` per item, in order.
    """
    packed: dict[tuple, list[int]] = {}
    split: dict[Any, list[int]] = {}  # by mesh: one shard_map over each
    for i, item in enumerate(items):
        if _device_stats_for(item):
            place = _device_stats.comparison_place(item.ref, item.cand)
            if _device_stats.split_axes(place) and _device_stats.blocks_even(item.ref.shape, place):
                split.setdefault(place.mesh, []).append(i)
            else:
                packed.setdefault(_devices(item), []).append(i)
    stats = {}
    for members in packed.values():
        stats.update(_packed_stats(items, members))
    for members in split.values():
        stats.update(_split_stats(items, members))
    return [
        _from_stats(item, stats[i]) if i in stats else leaf_error(*_host_args(item))
        for i, item in enumerate(items)
    ]


def _placed_fields(items: Sequence[LeafInput], members: list[int]) -> tuple[dict, list]:
    """``({field: [arrays or None]}, places)`` of the members, every array moved onto its leaf's comparison
    place (``_device_stats.comparison_place``), in one call."""
    group: dict[str, list] = {k: [] for k in _device_stats.FIELDS}
    places: dict[str, list] = {k: [] for k in _device_stats.FIELDS}
    where = []
    for i in members:
        item = items[i]
        place = _device_stats.comparison_place(item.ref, item.cand)
        where.append(place)
        values = (item.ref, item.cand, item.before_ref, item.before_cand, item.allowance)
        for k, v in zip(_device_stats.FIELDS, values, strict=True):
            group[k].append(None if v is None else jnp.asarray(v))
            places[k].append(None if v is None else place)
    return jax.device_put(group, places), where


def _median_here(item: LeafInput) -> bool:
    platform = next(iter(item.ref.sharding.device_set)).platform
    return DEVICE_MEDIAN if DEVICE_MEDIAN is not None else platform != "cpu"


def _packed_stats(items: Sequence[LeafInput], members: list[int]) -> dict[int, dict]:
    """The device statistics of leaves whole on every device they live on, laid into one matrix."""
    group, _ = _placed_fields(items, members)
    sizes = [items[i].ref.size for i in members]
    layout = _device_stats.Layout.of(sizes)
    tol = np.array([[items[i].atol, items[i].rtol] for i in members], np.float32)
    median = _median_here(items[members[0]])
    out = _device_stats.device_stats(layout, group, *layout.row_arrays(sizes), tol, median)
    out = jax.device_get(out)
    return {i: {k: v[j] for k, v in out.items()} for j, i in enumerate(members)}


def _split_stats(items: Sequence[LeafInput], members: list[int]) -> dict[int, dict]:
    """The device statistics of leaves split over one mesh, each device reducing its own blocks
    (``_device_stats.split_stats``)."""
    group, places = _placed_fields(items, members)
    sizes = [
        items[i].ref.size // _device_stats.parts(place) for i, place in zip(members, places, strict=True)
    ]
    layout = _device_stats.Layout.of(sizes)
    tol = np.array([[items[i].atol, items[i].rtol] for i in members], np.float32)
    median = _median_here(items[members[0]])
    out = _device_stats.split_stats(tuple(places), layout, group, *layout.row_arrays(sizes), tol, median)
    out = jax.device_get(out)
    return {i: {k: v[j] for k, v in out.items()} for j, i in enumerate(members)}


def _host_args(item: LeafInput) -> tuple:
    before = [None if a is None else to_host(a) for a in (item.before_ref, item.before_cand)]
    allowance = (
        item.allowance if item.allowance is None or np.ndim(item.allowance) == 0 else to_host(item.allowance)
    )
    return (*item[:3], to_host(item.ref), to_host(item.cand), item.rtol, item.atol, *before, allowance)


def _exact(m, e) -> float:
    return float(np.float64(m) + np.float64(e)) if m > 0 else 0.0


def _from_stats(item: LeafInput, st: dict) -> LeafError:
    """The :class:`LeafError` of one leaf from its device statistics (or the host path where they cannot tell)."""
    if not st["finite"]:
        return leaf_error(*_host_args(item))
    max_abs, scale = _exact(st["diff"], st["diff_e"]), float(st["scale"])
    base = item.atol + item.rtol * scale
    rel = (max_abs / scale) if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if item.allowance is None:
        ok, tol = max_abs <= base, base
    else:
        tol = base + float(st["max_extra"])
        if max_abs == 0:
            ok = True
        elif (
            st["min_allowed"] < _device_stats.TINY
            or st["top"] < _device_stats.TINY
            or not 1 <= st["near"] <= _device_stats.CANDIDATES
            or (st["near"] > 1 and item.ref.size < _device_stats.CANDIDATES)
        ):
            return leaf_error(*_host_args(item))
        else:
            # the near-top elements in float64: every other element is below them by more than float32's error
            n = 1 if st["near"] == 1 else _device_stats.CANDIDATES
            s, e, extra = (np.asarray(st[k][:n], np.float64) for k in ("at_s", "at_e", "at_extra"))
            diff = np.abs(s + e)
            allowed = base + extra
            ok = bool(np.all(diff <= allowed))
            worst = float(np.max(diff / allowed))
            if worst > 0 and np.isfinite(worst):
                tol = max_abs / worst
    change = _exact(st["change"], st["change_e"]) if item.before_ref is not None else None
    top = scale if change is None else change
    if top == 0:
        ratio, spread = None, None
    elif "low" not in st or st["unsure"] or top < _device_stats.TINY:
        ratio, spread = _host_ratio(item, top)
    else:
        ratio = 0.5 * (float(st["low"]) + float(st["high"]))
        spread = (float(st["p10"]), float(st["p90"]))
    shape = tuple(item.ref.shape)
    zeros = scale == 0 and max_abs == 0 and item.before_ref is None  # both sides all zeros
    return LeafError(
        item.step,
        item.kind,
        item.path,
        max_abs,
        rel,
        tol,
        bool(ok),
        ratio,
        change,
        spread,
        shape,
        zeros=zeros,
    )


def _host_ratio(item: LeafInput, top: float) -> tuple[float | None, tuple[float, float] | None]:
    """:func:`_ratio_stats` from float64 host copies of the leaf (where float32 cannot settle the median's
    elements)."""
    r, c = to_host(item.ref).astype(np.float64), to_host(item.cand).astype(np.float64)
    if item.before_ref is None:
        return _ratio_stats(r, c, top)
    return _ratio_stats(r - to_host(item.before_ref), c - to_host(item.before_cand), top)


# ------------------------------------------------------------------------------------ per-leaf device scalars
# The harness's rules need a few numbers per leaf (a leaf's largest magnitude, its largest change, whether it is
# finite): each is one jitted reduction over all the leaves, so only the scalars come to the host.


DEVICE_SCALARS: bool | None = None
"""Where :func:`max_abs`, :func:`max_abs_diff`, :func:`abs_dot`, :func:`all_finite` and :func:`equal` reduce:
``None`` (default) on accelerators on the devices (no copy to the host), on CPU devices on the host (their
buffers are host memory: NumPy reads them in place, where XLA:CPU would compile a reduction per leaf);
``True``/``False`` force one place. Arrays spread over several processes reduce on the devices."""


def _array(a) -> jax.Array:
    """``a`` as a ``jax.Array``: itself where it is one (``jnp.asarray`` of one costs tens of microseconds, and
    the harness asks it of every leaf several times a step), else ``jnp.asarray(a)``."""
    return a if isinstance(a, jax.Array) else jnp.asarray(a)


def _on_devices(arrays: Mapping[str, Any]) -> dict[tuple, dict[str, Any]]:
    """``arrays`` grouped by the devices they live on (one jitted call per group: a call takes one device set).
    Arrays spread over several processes are grouped too: every process makes the same calls."""
    groups: dict[tuple, dict[str, Any]] = {}
    for name, a in arrays.items():
        a = _array(a)
        groups.setdefault(tuple(sorted(d.id for d in a.sharding.device_set)), {})[name] = a
    return groups


def _on_host(group: Mapping[str, Any]) -> bool:
    """Whether a group of :func:`_on_devices` reduces on the host (:data:`DEVICE_SCALARS`)."""
    if DEVICE_SCALARS is not None:
        return not DEVICE_SCALARS and all(a.is_fully_addressable for a in group.values())
    return all(a.is_fully_addressable and next(iter(a.devices())).platform == "cpu" for a in group.values())


def _beside(other: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
    """``other[name]`` moved onto the devices of ``group[name]``, for every name of ``group``."""
    return {k: jax.device_put(jnp.asarray(other[k]), v.sharding) for k, v in group.items()}


def _floats(reduced: dict) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(reduced).items()}


def _f64(a) -> np.ndarray:
    return to_host(a).astype(np.float64)


def _tiny(a) -> jax.Array:
    """Whether ``a`` (traced) holds an element the device may flush to zero (float32 subnormal territory,
    ``_device_stats.TINY``; XLA:CPU treats subnormal inputs as zero): that leaf reduces on the host."""
    return jnp.any(_device_stats._tiny(a.astype(jnp.float32)))


@jax.jit
def _max_abs(arrays: dict) -> dict:
    return {k: (jnp.max(jnp.abs(a), initial=0.0).astype(jnp.float32), _tiny(a)) for k, a in arrays.items()}


def max_abs(arrays: Mapping[str, Any]) -> dict[str, float]:
    """``{name: max |a|}`` (0 for an empty array, NaN when ``a`` holds one), reduced where
    :data:`DEVICE_SCALARS` says.

    Exact: the largest magnitude of float32 (or bfloat16, float16) elements is one of them, which a Python float
    holds exactly, so it equals ``float(np.max(np.abs(a.astype(np.float64))))``.
    """
    out: dict[str, float] = {}
    for group in _on_devices(arrays).values():
        reduced = {} if _on_host(group) else jax.device_get(_max_abs(group))
        for k, a in group.items():
            m, tiny = reduced.get(k, (None, True))
            out[k] = float(np.max(np.abs(to_host(a)), initial=0.0)) if tiny else float(m)
    return out


@jax.jit
def _max_abs_diff(a: dict, b: dict) -> dict:
    out = {}
    for k in a:
        # not ravelled: a leaf split over a mesh keeps its sharding (a flattened one is gathered whole)
        x, y = a[k].astype(jnp.float32), b[k].astype(jnp.float32)
        s, e = _device_stats.two_diff(x, y)
        mag = jnp.abs(s)
        m = jnp.max(mag, initial=0.0)
        e_m = jnp.max(jnp.where(mag == m, jnp.where(s >= 0, e, -e), -jnp.inf), initial=-jnp.inf)
        out[k] = (m, e_m, _tiny(x) | _tiny(y))
    return out


def max_abs_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float]:
    """``{name: max |a - b|}`` of float arrays of equal shapes, exactly as float64 computes it. On the devices
    (:data:`DEVICE_SCALARS`), each element's float32 difference and its rounding error (Knuth's TwoSum,
    ``shardcheck.parity.comparison._device_stats.two_diff``) are reduced there and their sum taken in float64 on the host
    (a leaf whose float32 difference overflows or holds NaN, or with an element below ``_device_stats.TINY``,
    is taken on the host). ``b[name]`` is moved onto
    ``a[name]``'s devices."""
    out: dict[str, float] = {}
    for group in _on_devices(a).values():
        reduced = {} if _on_host(group) else jax.device_get(_max_abs_diff(group, _beside(b, group)))
        for k, x in group.items():
            m, e, tiny = reduced.get(k, (None, None, True))
            # on the host: a difference beyond float32's range (3e38 - -3e38) or NaN, or a tiny element
            host = tiny or not np.isfinite(m)
            out[k] = float(np.max(np.abs(_f64(x) - _f64(b[k])), initial=0.0)) if host else _exact(m, e)
    return out


@jax.jit
def _abs_dot(weights: dict, arrays: dict) -> dict:
    return {
        k: jnp.sum(jnp.abs(weights[k].astype(jnp.float32)) * a.astype(jnp.float32)) for k, a in arrays.items()
    }


def abs_dot(weights: Mapping[str, Any], arrays: Mapping[str, Any]) -> float:
    """``sum over names of sum(|weights[name]| * arrays[name])``: in float64 on the host, or on the devices
    (:data:`DEVICE_SCALARS`) each name's sum in float32 (the float64 sum of its exact products to about ``1e-6``
    relative: XLA's reductions add in a tree; products below float32's normal range may flush to zero) and the
    names' sums in float64 on the host. ``weights[name]`` is
    moved onto ``arrays[name]``'s devices."""
    total = 0.0
    for group in _on_devices(arrays).values():
        if _on_host(group):
            total += sum(float(np.sum(np.abs(_f64(weights[k])) * _f64(a))) for k, a in group.items())
            continue
        w = _beside(weights, group)
        total += sum(_floats(_abs_dot(w, group)).values())
    return total


@jax.jit
def _exceeds(changes: dict, refs: dict, allowances: dict, tols: dict, scale, before: dict) -> dict:
    out = {}
    for k, c in changes.items():
        allowed = tols[k][1] + tols[k][0] * jnp.max(jnp.abs(refs[k].astype(jnp.float32)), initial=0.0)
        allowed = allowed + (jnp.asarray(allowances[k], jnp.float32) if k in allowances else 0.0)
        c = c.astype(jnp.float32) - (before[k].astype(jnp.float32) if k in before else 0.0)
        moved = jnp.abs(scale * c)
        out[k] = jnp.any(moved > allowed) | jnp.any(jnp.isnan(moved))
    return out


def exceeds(
    changes: Mapping[str, Any],
    refs: Mapping[str, Any],
    tols: Mapping[str, tuple[float, float]],
    allowances: Mapping[str, Any] | None = None,
    scale: float = 1.0,
    before: Mapping[str, Any] | None = None,
) -> dict[str, bool]:
    """``{name: whether some element of |scale * changes[name]| exceeds rtol * max|refs[name]| + atol +
    allowances[name]}``, with ``(rtol, atol) = tols[name]`` (a NaN change exceeds): whether a leaf moved by
    ``changes`` from ``refs`` would leave the tolerance :func:`leaf_error` gives it. ``allowances`` (optional,
    per name: a scalar or an array of the leaf's shape) widen it element by element. ``before`` (optional, per
    name: an array of the leaf's shape): the change is ``changes[name] - before[name]`` (a leaf's step, taken
    inside the reduction: no program per leaf). Reduced where :data:`DEVICE_SCALARS` says (float32 on the
    devices, float64 on the host); ``refs``, ``allowances`` and ``before`` are moved onto ``changes[name]``'s
    devices."""
    allowances = {} if allowances is None else allowances
    before = {} if before is None else before
    out: dict[str, bool] = {}
    for group in _on_devices(changes).values():
        if _on_host(group):
            for k, c in group.items():
                allowed = tols[k][1] + tols[k][0] * float(np.max(np.abs(_f64(refs[k])), initial=0.0))
                extra = np.asarray(to_host(allowances[k]), np.float64) if k in allowances else 0.0
                with np.errstate(invalid="ignore", over="ignore"):
                    moved = np.abs(scale * (_f64(c) - (_f64(before[k]) if k in before else 0.0)))
                out[k] = bool(np.any(moved > allowed + extra) or np.isnan(moved).any())
            continue
        extra = {
            k: float(to_host(allowances[k])) if np.ndim(allowances[k]) == 0 else allowances[k]
            for k in group
            if k in allowances
        }
        extra = {k: v if isinstance(v, float) else _beside(extra, {k: group[k]})[k] for k, v in extra.items()}
        tol = {k: tuple(float(t) for t in tols[k]) for k in group}
        olds = _beside(before, {k: v for k, v in group.items() if k in before})
        reduced = jax.device_get(_exceeds(group, _beside(refs, group), extra, tol, float(scale), olds))
        out.update({k: bool(v) for k, v in reduced.items()})
    return out


@jax.jit
def _all_finite(arrays: list) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))


def all_finite(arrays: Sequence[Any]) -> bool:
    """Whether every element of every floating array is finite (integer arrays are), where
    :data:`DEVICE_SCALARS` says."""
    floats = {str(i): a for i, a in enumerate(arrays) if jnp.issubdtype(_array(a).dtype, jnp.inexact)}
    for group in _on_devices(floats).values():
        if _on_host(group):
            if not all(np.all(np.isfinite(to_host(a))) for a in group.values()):
                return False
        elif not bool(_all_finite(list(group.values()))):
            return False
    return True


def equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether ``b`` holds every name of ``a`` with the same shape and the same values (``array_equal``: NaN is
    not equal to itself), compared on ``a``'s devices or on the host (:data:`DEVICE_SCALARS`). PRNG keys (the
    streams of ``nnx.Rngs``, ``nnx.Dropout``) are compared through their raw ``uint32`` data."""
    if any(k not in b or np.shape(b[k]) != np.shape(v) for k, v in a.items()):
        return False
    a, b = _raw_keys(a), _raw_keys(b)
    for group in _on_devices(a).values():
        if _on_host(group):
            if not all(np.array_equal(to_host(x), to_host(b[k])) for k, x in group.items()):
                return False
            continue
        other = _beside(b, group)
        if not bool(_equal(group, other)):
            return False
    return True


def _raw_keys(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with each typed PRNG key array replaced by its raw data (``jax.random.key_data``): NumPy and
    ``jnp.array_equal`` cannot read a key."""
    return {k: jax.random.key_data(v) if _is_key(v) else v for k, v in tree.items()}


def _is_key(a) -> bool:
    return isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def _same_values(x, y) -> jax.Array:
    """``array_equal`` read from the bits where floats are (a device that flushes subnormals to zero would call
    1e-40 equal to 0): equal bits or +0 against -0, and no NaN. (Not ``bits & ~sign == 0``: XLA rewrites that
    into a float comparison with zero, which flushes.)"""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype != y.dtype:
        return jnp.array_equal(x, y)
    bx, by = _bits(x), _bits(y)
    zeros = (bx | by) == jnp.asarray(1 << (8 * bx.dtype.itemsize - 1), bx.dtype)
    return jnp.all(((bx == by) | zeros) & ~jnp.isnan(x) & ~jnp.isnan(y))


@jax.jit
def _equal(a: dict, b: dict) -> jax.Array:
    return jnp.all(jnp.stack([_same_values(a[k], b[k]) for k in a]))


# ------------------------------------------------------------------------------------------ replica agreement


def _bits(x):
    """``x``'s elements as unsigned integers of the same width (floats bitwise: NaN payloads, signed zeros)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x


@functools.partial(jax.jit, static_argnums=0)
def _replicas_differ(layouts: tuple, arrays: list) -> jax.Array:
    """Per array: whether its copies over the replicated mesh axes differ bitwise (``pmax != pmin`` of the bits)."""
    out = []
    for (mesh, spec, axes), a in zip(layouts, arrays, strict=True):

        def local(x, axes=axes, mesh=mesh):
            u = _bits(x)
            differ = jnp.any(jax.lax.pmax(u, axes) != jax.lax.pmin(u, axes)).astype(jnp.int32)
            return jax.lax.pmax(differ, mesh.axis_names)

        out.append(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)(a))
    return jnp.stack(out)


def _replicated_axes(a) -> tuple[str, ...] | None:
    """The mesh axes over which a ``NamedSharding`` array is replicated; ``None`` for other shardings."""
    sharding = a.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    used = {
        n
        for entry in sharding.spec
        if entry is not None
        for n in (entry if isinstance(entry, tuple) else (entry,))
    }
    return tuple(ax for ax in sharding.mesh.axis_names if ax not in used and sharding.mesh.shape[ax] > 1)


def replica_mismatches(arrays: Mapping[str, Any]) -> set[str]:
    """The names in ``arrays`` whose copies of one slice differ between this process's devices.

    :func:`replica_mismatch` for many arrays at once, compared on the devices in one jitted call: per array
    replicated over mesh axes, the elementwise max and min of its bits over those axes (an all-reduce) must
    agree. Arrays on CPU devices (their buffers are host memory: an in-place byte comparison is several times
    faster than XLA:CPU's all-reduce), arrays spread over several processes, and shardings other than
    ``NamedSharding`` are compared by :func:`replica_mismatch` (this process's shards, on the host).
    """
    names, layouts, device = [], [], []
    out = set()
    for name, a in arrays.items():
        if not isinstance(a, jax.Array) or len(a.addressable_shards) < 2:
            continue
        # host memory already on the CPU backend: the buffers are compared in place there (no all-reduce)
        on_cpu = next(iter(a.devices())).platform == "cpu"
        axes = _replicated_axes(a) if a.is_fully_addressable and not on_cpu else None
        if axes is None:
            if replica_mismatch(a):
                out.add(name)
        elif axes:
            names.append(name)
            layouts.append((a.sharding.mesh, a.sharding.spec, axes))
            device.append(a)
    if device:
        differ = np.asarray(_replicas_differ(tuple(layouts), device))
        out |= {name for name, d in zip(names, differ, strict=True) if d}
    return out


def replicated_leaves(arrays: Mapping[str, Any]) -> tuple[int, int]:
    """``(leaves, devices)``: how many of ``arrays`` hold a slice on two or more of this process's devices (the
    replicated or partially replicated leaves whose copies :func:`replica_mismatches` compares), and over how many
    devices those copies lie; ``(0, 0)`` where none does (one device, or every leaf split without copies).
    Reads the shards' indices only, no bytes."""
    count, devices = 0, set()
    for a in arrays.values():
        if not isinstance(a, jax.Array) or len(a.addressable_shards) < 2:
            continue
        shards = a.addressable_shards
        keys = {tuple((s.start, s.stop, s.step) for s in shard.index) for shard in shards}
        if len(keys) < len(shards):
            count += 1
            devices |= {shard.device for shard in shards}
    return count, len(devices)


def device_snapshot(tree: PyTree) -> dict[str, Any]:
    """:func:`flatten_state` with every array leaf copied on its own devices (a later step may donate it), in one
    jitted call: one program per tree and placement, whose warm call costs a quarter of a runtime copy's
    (:func:`shardcheck._tree.copy_arrays`: 1.3 ms against 5 ms for the tiny-lm's 116 leaves)."""
    return device_snapshots(tree)[0]


def device_snapshots(*trees: PyTree, once: bool = False) -> tuple[dict[str, Any], ...]:
    """:func:`device_snapshot` of each tree, all copied in one jitted call: the trees copied together at every
    step (a candidate's parameters and optimizer state) compile one program, not one per tree. ``once``: a copy
    made once per check (the state before its first step, whose placement the candidate's step may change) is
    made by the runtime (:func:`shardcheck._tree.copy_arrays`), which compiles nothing."""
    flats = [flatten_state(tree) for tree in trees]
    arrays = [{k: v for k, v in flat.items() if isinstance(v, jax.Array)} for flat in flats]
    copies = copy_arrays(arrays) if once else _copy(arrays) if any(arrays) else arrays
    return tuple({**flat, **copy} for flat, copy in zip(flats, copies, strict=True))


@jax.jit
def _copy(arrays: list) -> list:
    return jax.tree.map(jnp.copy, arrays)
