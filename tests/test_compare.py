"""The on-device leaf statistics (``compare.leaf_errors``) against the float64 NumPy comparison (``leaf_error``)."""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import (
    LeafInput,
    leaf_error,
    leaf_errors,
    replica_mismatch,
    replica_mismatches,
)

SHAPE = (4, 16)
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3e38, -3e38]


def _leaves(special: bool):
    values = st.floats(-4, 4, width=32) | (st.sampled_from(SPECIAL) if special else st.just(1.0))
    return hnp.arrays(np.float32, SHAPE, elements=values)


# the update ratio is a median of float32 quotients: within 3 float32 rounding units of float64's (compare.py)
RATIO_RTOL = 3 * 2.0**-24


def _fields(e):
    return dataclasses.astuple(dataclasses.replace(e, ratio=None, spread=None))


def _same_ratio(d, h):
    if d is None or h is None or not math.isfinite(h):
        assert d == h or (d is not None and math.isnan(d) and math.isnan(h)), (d, h)
    else:
        assert abs(d - h) <= RATIO_RTOL * abs(h) + 1e-37, (d, h)


def _same_spread(d, h):
    """The ratio's 10th/90th percentiles: order statistics of the same quotients, each to float32's rounding."""
    assert (d is None) == (h is None), (d, h)
    for a, b in zip(d or (), h or (), strict=True):
        _same_ratio(a, b)


def _same(items):
    """``leaf_errors`` equals ``leaf_error`` on host copies of the same inputs, field for field (NaN == NaN): the
    ratio exactly with the host's median (CPU devices), to float32's rounding with the device's (accelerators)."""
    host = [leaf_error(*compare._host_args(i)) for i in items]
    compare.DEVICE_STATS = True  # the device's statistics, also on CPU devices
    try:
        device = leaf_errors(items)
    finally:
        compare.DEVICE_STATS = None
    for d, h in zip(device, host, strict=True):
        np.testing.assert_equal(dataclasses.astuple(d), dataclasses.astuple(h))
    compare.DEVICE_MEDIAN = compare.DEVICE_STATS = True
    try:
        on_device = leaf_errors(items)
    finally:
        compare.DEVICE_MEDIAN = compare.DEVICE_STATS = None
    for d, h in zip(on_device, host, strict=True):
        np.testing.assert_equal(_fields(d), _fields(h))
        _same_ratio(d.ratio, h.ratio)
        _same_spread(d.spread, h.spread)
    return device


@given(
    r=_leaves(special=False),
    noise=hnp.arrays(np.float32, SHAPE, elements=st.sampled_from([0.0, 1.0, -1.0, 2.0, 1e-3, 0.5])),
    r0=_leaves(special=True),
    special=_leaves(special=True),
    where=st.integers(0, SHAPE[0] * SHAPE[1] - 1),
    shift=st.sampled_from([-2, -1, 0, 1, 2]),
)
def test_device_statistics_equal_float64_numpy(r, noise, r0, special, where, shift):
    """Rounding-sized and large errors, NaN/inf/subnormal elements, and an allowance that puts one element
    exactly at its threshold, a few float32 ulps either side."""
    rtol, atol = 1e-6, 1e-7
    c = (r + noise * np.float32(1e-6) * np.abs(r)).astype(np.float32)
    diff = np.abs(c.astype(np.float64) - r.astype(np.float64))
    base = atol + rtol * float(np.max(np.abs(r.astype(np.float64))))
    extra = np.full(SHAPE, np.float32(max(float(diff.flat[where]) - base, 0.0)), np.float32)
    extra = np.nextafter(extra, np.float32(np.inf * np.sign(shift))) if shift else extra
    extra = np.abs(extra * np.float32(1 + 1e-7 * abs(shift))).astype(np.float32)
    dev = jnp.asarray
    items = [
        LeafInput(0, "param", "w", dev(r), dev(c), rtol, atol, dev(r0), dev(r0), dev(extra)),
        LeafInput(0, "param", "w", dev(r), dev(c), rtol, atol, dev(r0), dev(c - r + r0)),
        LeafInput(0, "grad", "w", dev(r), dev(c), rtol, atol, allowance=dev(extra)),
        LeafInput(0, "grad", "w", dev(r), dev(special), rtol, atol),
        LeafInput(0, "opt_state", "w", dev(special), dev(c), rtol, atol, dev(r0), dev(r), dev(extra)),
        # bfloat16 parameters' allowance is bfloat16 (widened exactly on the device)
        LeafInput(
            0, "param", "w", dev(r), dev(c), rtol, atol, dev(r0), dev(r0), jnp.asarray(extra, jnp.bfloat16)
        ),
    ]
    assert compare._on_device(items[-1])
    _same(items)


@given(
    r=_leaves(special=True),
    c=_leaves(special=True),
    near=st.booleans(),
    allowance=st.sampled_from(["none", "scalar", "array"]),
    where=st.integers(0, SHAPE[0] * SHAPE[1] - 1),
    shift=st.sampled_from([-1, 0, 1]),
)
def test_within_is_leaf_errors_verdict(r, c, near, allowance, where, shift):
    """``within`` (the hypotheses' comparison) decides as ``leaf_error(...).ok``: NaN, inf, subnormal elements,
    all zeros, and an allowance that puts one element at its threshold, one float64 ulp either side."""
    rtol, atol = 1e-6, 1e-7
    c = (r + np.float32(1e-6) * c).astype(np.float32) if near else c
    diff = np.abs(c.astype(np.float64) - r.astype(np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        edge = float(diff.flat[where]) - (atol + rtol * float(np.max(np.abs(r.astype(np.float64)))))
    edge = max(np.nextafter(edge, np.inf * shift) if shift else edge, 0.0) if math.isfinite(edge) else 0.0
    extra = {"none": None, "scalar": edge, "array": np.full(SHAPE, edge)}[allowance]
    for ref, cand in ((r, c), (c, r), (r, r), (np.zeros(SHAPE), np.zeros(SHAPE))):
        expected = leaf_error(0, "param", "w", ref, cand, rtol, atol, allowance=extra).ok
        assert compare.within(ref, cand, rtol, atol, extra) == expected
    assert not compare.within(r, c[:2], rtol, atol)  # shapes that differ fail, as leaf_error's


def test_the_threshold_is_decided_in_float64():
    """An error a few float64 ulps either side of its float32-rounded threshold: the verdict is float64's."""
    r = np.linspace(-1, 1, 64, dtype=np.float32).reshape(SHAPE)
    c = r.copy()
    c.flat[5] += np.float32(3e-7)
    diff = abs(float(c.flat[5]) - float(r.flat[5]))
    scale = float(np.max(np.abs(r)))
    for atol in (diff, np.nextafter(diff, 0), np.nextafter(diff, 1)):
        (out,) = _same([LeafInput(0, "param", "w", jnp.asarray(r), jnp.asarray(c), 0.0, atol)])
        assert out.ok == (diff <= atol)
        extra = jnp.asarray(np.zeros(SHAPE, np.float32))
        (out,) = _same(
            [LeafInput(0, "param", "w", jnp.asarray(r), jnp.asarray(c), 1e-9, atol, allowance=extra)]
        )
        assert out.ok == (diff <= atol + 1e-9 * scale)


@require_devices(2)
def test_replica_agreement_is_bitwise_on_the_device():
    devices = jax.devices()[:2]
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices), ("data",)), jax.sharding.PartitionSpec()
    )
    x = np.arange(8, dtype=np.float32)
    nan_a = np.full(8, np.nan, np.float32)
    nan_b = nan_a.view(np.uint32).copy()
    nan_b[3] += 1  # another NaN payload: equal as values never, different as bits
    cases = {
        "same": (x, x),
        "one_ulp": (x, np.nextafter(x, np.float32(9))),
        "zero_signs": (np.zeros(8, np.float32), -np.zeros(8, np.float32)),
        "nan_payload": (nan_a, nan_b.view(np.float32)),
        "same_nan": (nan_a, nan_a),
    }
    arrays = {
        k: jax.make_array_from_single_device_arrays(
            (8,), sharding, [jax.device_put(v, d) for v, d in zip(pair, devices, strict=True)]
        )
        for k, pair in cases.items()
    }
    expected = {"one_ulp", "zero_signs", "nan_payload"}
    assert replica_mismatches(arrays) == {k for k, a in arrays.items() if replica_mismatch(a)} == expected
    # the all-reduce used on accelerators (on CPU the buffers are compared in place)
    names = list(arrays)
    layouts = tuple((sharding.mesh, sharding.spec, ("data",)) for _ in names)
    differ = np.asarray(compare._replicas_differ(layouts, [arrays[k] for k in names]))
    assert {k for k, d in zip(names, differ, strict=True) if d} == expected


def _mlp_task():
    import optax
    from flax import nnx

    import shardcheck
    from shardcheck.losses import mse_batch_loss
    from shardcheck.models import MLP

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))] * 2
    return shardcheck.Task(
        model=lambda: MLP(4, 8, 2, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=mse_batch_loss,
        batches=batches,
    )


@require_devices(2)
@pytest.mark.parametrize("strategy", ["dp"])
def test_a_parity_report_is_the_float64_one(strategy, monkeypatch):
    """check_parity with the device comparison and with the host one: equal reports, leaf for leaf."""
    import shardcheck
    from shardcheck.parity.harness import check as harness

    task = _mlp_task()
    monkeypatch.setattr(compare, "DEVICE_STATS", True)  # the device's statistics, also on CPU devices
    monkeypatch.setattr(harness, "FIRST_PASS", False)  # every leaf through leaf_errors
    device = shardcheck.check_parity(strategy, task, num_shards=2)
    host_path = [0]

    def on_host(items):
        host_path[0] += len(items)
        return [leaf_error(*compare._host_args(i)) for i in items]

    monkeypatch.setattr(harness, "leaf_errors", on_host)
    monkeypatch.setattr(
        harness, "replica_mismatches", lambda a: {k for k, v in a.items() if replica_mismatch(v)}
    )
    host = shardcheck.check_parity(strategy, task, num_shards=2)
    assert host_path[0] > 0 and device.ok and host.ok and device.codes == host.codes
    for d, h in zip(device.steps, host.steps, strict=True):
        np.testing.assert_equal([_fields(e) for e in d.leaves], [_fields(e) for e in h.leaves])
        for de, he in zip(d.leaves, h.leaves, strict=True):
            _same_ratio(de.ratio, he.ratio)
            _same_spread(de.spread, he.spread)
        assert d.replica_mismatches == h.replica_mismatches


@given(
    leaves=st.lists(
        hnp.arrays(
            np.float32,
            st.integers(1, 150),
            elements=st.sampled_from([-3e38, -2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 1.5, 3.0, np.inf]),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_the_two_middle_values_are_the_sorted_ones(leaves):
    """The bisection that replaces a sort: ties, infinities and even and odd counts, several leaves and rows."""
    from shardcheck.parity.comparison import _device_stats as ds

    sizes = [a.size for a in leaves]
    layout = ds.Layout.of(sizes)
    row_leaf, row_len = layout.row_arrays(sizes)
    rows = ds._Rows(
        jnp.asarray(row_leaf), jnp.arange(layout.width)[None, :] < jnp.asarray(row_len)[:, None], len(sizes)
    )
    x = ds._lay([jnp.asarray(a) for a in leaves], layout)
    k = jnp.asarray(sizes)
    low, high = jax.jit(rows.middle)(x, k)
    for a, lo, hi in zip(leaves, np.asarray(low), np.asarray(high), strict=True):
        ordered = np.sort(a)
        assert lo == ordered[(a.size - 1) // 2] and hi == ordered[a.size // 2]


# ----------------------------------------------------------------------------- the harness's per-leaf scalars

SCALAR = st.floats(-4, 4, width=32) | st.sampled_from([0.0, -0.0, 3e38, -3e38, 1e-38, 1.5e-45])


PLACES = pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])


@contextlib.contextmanager
def _reduced(on_device: bool):
    """The scalars reduced on the devices (as on accelerators) or on the host (CPU devices' default)."""
    compare.DEVICE_SCALARS = on_device
    try:
        yield
    finally:
        compare.DEVICE_SCALARS = None


@PLACES
@given(
    a=hnp.arrays(np.float32, SHAPE, elements=SCALAR),
    b=hnp.arrays(np.float32, SHAPE, elements=SCALAR),
    w=hnp.arrays(np.float32, SHAPE, elements=st.floats(-4, 4, width=32)),
)
def test_the_per_leaf_scalars_are_float64_numpys(on_device, a, b, w):
    """max |a| and max |a - b| exactly (3e38 - -3e38 overflows float32: TwoSum carries it), sum |w| * a within
    XLA's float32 tree sum of the float64 one, and a bfloat16 leaf's max |a| as the float64 of its elements."""
    with _reduced(on_device):
        _scalars_are_float64_numpys(a, b, w)


def _scalars_are_float64_numpys(a, b, w):
    a64, b64, w64 = (x.astype(np.float64) for x in (a, b, w))
    arrays = {"x": jnp.asarray(a), "y": jnp.asarray(b), "z": jnp.asarray(a[:0])}
    assert compare.max_abs(arrays) == {"x": np.max(np.abs(a64)), "y": np.max(np.abs(b64)), "z": 0.0}
    low = jnp.asarray(a, jnp.bfloat16)
    assert compare.max_abs({"x": low})["x"] == np.max(np.abs(np.asarray(low, np.float64)))
    assert compare.max_abs_diff({"x": arrays["x"]}, {"x": arrays["y"]}) == {"x": np.max(np.abs(a64 - b64))}
    bounded = np.clip(a, -4, 4)
    want = float(np.sum(np.abs(w64) * bounded.astype(np.float64)))
    got = compare.abs_dot({"x": jnp.asarray(w)}, {"x": jnp.asarray(bounded)})
    assert abs(got - want) <= 1e-6 * float(np.sum(np.abs(w64 * bounded))) + 1e-30


@PLACES
def test_finite_and_equal_are_decided_where_the_scalars_reduce(on_device):
    with _reduced(on_device):
        _finite_and_equal()


def _finite_and_equal():
    x = jnp.arange(6.0).reshape(2, 3)
    assert compare.all_finite([x, jnp.arange(3), jnp.asarray(x, jnp.bfloat16)])
    assert not compare.all_finite([x, x.at[1, 2].set(jnp.inf)]) and not compare.all_finite(
        [x.at[0, 0].set(jnp.nan)]
    )
    assert compare.all_finite([jnp.arange(3)])  # integers are finite
    assert compare.equal({"a": x, "n": jnp.arange(3)}, {"a": x + 0.0, "n": jnp.arange(3), "extra": x})
    assert not compare.equal({"a": x}, {"a": x.at[0, 1].set(7.0)}) and not compare.equal({"a": x}, {})
    assert not compare.equal({"a": x}, {"a": x.ravel()})  # another shape
    assert not compare.equal({"a": x.at[0, 0].set(jnp.nan)}, {"a": x.at[0, 0].set(jnp.nan)})  # as array_equal
    tiny, zero = jnp.asarray([1e-40, 0.0], jnp.float32), jnp.asarray([0.0, -0.0], jnp.float32)
    assert not compare.equal({"a": tiny}, {"a": zero})  # a subnormal is not zero (XLA:CPU flushes it)
    assert compare.equal({"a": zero}, {"a": -zero})  # signed zeros are equal, as array_equal


@require_devices(2)
@PLACES
def test_the_scalars_of_arrays_on_other_devices_are_reduced_where_each_lives(on_device):
    with _reduced(on_device):
        _on_two_devices()


def _on_two_devices():
    d0, d1 = jax.devices()[:2]
    a, b = jax.device_put(jnp.arange(4.0), d0), jax.device_put(-jnp.arange(4.0) * 2, d1)
    assert compare.max_abs({"a": a, "b": b}) == {"a": 3.0, "b": 6.0}
    assert compare.max_abs_diff({"a": a}, {"a": b}) == {"a": 9.0}  # b moved onto a's device
    assert compare.abs_dot({"a": b, "b": a}, {"a": a, "b": -b}) == 28.0 + 28.0  # sum 2i * i, sum i * 2i
    assert compare.all_finite([a, b])
