"""A check against a strategy on the candidate's mesh (``reference="gspmd"``): split leaves are compared where
their blocks live (``_device_stats.split_stats``), field for field as the float64 host comparison; no program of
the check gathers a split leaf whole (no "Involuntary full rematerialization" from XLA's partitioner); no device
holds more of a state leaf than its placement gives it; and the report gives the measured peak per device."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck.parity.comparison import _device_stats
from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import LeafInput, leaf_error, leaf_errors
from shardcheck.parity.harness import footprint
from shardcheck.parity.report import ParityReport

SHAPE = (8, 16)
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3e38, -3e38]
# the update ratio is a median of float32 quotients: within 3 float32 rounding units of float64's (compare.py)
RATIO_RTOL = 3 * 2.0**-24
# the largest per-device footprint of the check on the test task, over the larger side's own state per device;
# the measured value and what makes it up: docs/parity.md, "A check on the same mesh"
FOOTPRINT_BOUND = 8.0


def _leaves(special: bool):
    values = st.floats(-4, 4, width=32) | (st.sampled_from(SPECIAL) if special else st.just(1.0))
    return hnp.arrays(np.float32, SHAPE, elements=values)


def _meshes():
    devices = np.array(jax.devices()[:8])
    return Mesh(devices, ("fsdp",)), Mesh(devices.reshape(2, 4), ("data", "fsdp"))


def _fields(e):
    return dataclasses.astuple(dataclasses.replace(e, ratio=None, spread=None))


def _compared(items, median: bool):
    """``leaf_errors`` of ``items`` on the devices, and which of them went through the split path."""
    split = []
    original = compare._split_stats

    def spy(items_, members):
        split.extend(members)
        return original(items_, members)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compare, "_split_stats", spy)
        patch.setattr(compare, "DEVICE_STATS", True)
        patch.setattr(compare, "DEVICE_MEDIAN", median)
        return leaf_errors(items), split


@require_devices(8)
@settings(max_examples=6, deadline=None)
@given(
    r=_leaves(special=False),
    noise=hnp.arrays(np.float32, SHAPE, elements=st.sampled_from([0.0, 1.0, -1.0, 2.0, 1e-3, 0.5])),
    r0=_leaves(special=True),
    special=_leaves(special=True),
    where=st.integers(0, SHAPE[0] * SHAPE[1] - 1),
    shift=st.sampled_from([-2, -1, 0, 1, 2]),
)
@example(  # found by hypothesis: a ratio's percentiles at -inf and inf on both sides (changes of 0 and inf)
    r=np.pad(np.array([[1.0, 1.0, -1.0]], np.float32), ((0, SHAPE[0] - 1), (0, SHAPE[1] - 3))),
    noise=np.zeros(SHAPE, np.float32),
    r0=np.zeros(SHAPE, np.float32),
    special=np.where(np.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE) == 0, 0.0, np.inf).astype(np.float32),
    where=0,
    shift=-2,
)
def test_split_leaves_give_the_float64_fields(r, noise, r0, special, where, shift):
    """Leaves split over ``fsdp=8`` and ``data=2,fsdp=4`` (by rows, by columns, over both axes, over ``fsdp``
    with a copy on each ``data`` row; a replicated reference beside a split candidate): every field of
    ``leaf_errors`` equals the host ``leaf_error``'s float64 one, with an allowance that puts one element at its
    threshold, a few float32 ulps either side, a before-state, and NaN / inf / subnormal elements (settled on the
    host); the ratio exactly with the host's median, to float32's rounding with the device's."""
    rtol, atol = 1e-6, 1e-7
    c = (r + noise * np.float32(1e-6) * np.abs(r)).astype(np.float32)
    diff = np.abs(c.astype(np.float64) - r.astype(np.float64))
    base = atol + rtol * float(np.max(np.abs(r.astype(np.float64))))
    extra = np.full(SHAPE, np.float32(max(float(diff.flat[where]) - base, 0.0)), np.float32)
    extra = np.nextafter(extra, np.float32(np.inf * np.sign(shift))) if shift else extra
    extra = np.abs(extra * np.float32(1 + 1e-7 * abs(shift))).astype(np.float32)
    flat, grid = _meshes()
    rows, cols = NamedSharding(flat, P("fsdp")), NamedSharding(grid, P(None, ("data", "fsdp")))
    both, whole = NamedSharding(grid, P("data", "fsdp")), NamedSharding(flat, P())
    fsdp = NamedSharding(grid, P("fsdp"))  # split over fsdp, a copy on each of the 2 data rows: counted once

    def on(sharding, *arrays):
        return [jax.device_put(a, sharding) for a in arrays]

    items = [
        LeafInput(0, "param", "w", *on(rows, r, c), rtol, atol, *on(rows, r0, r0, extra)),
        LeafInput(0, "param", "w", *on(cols, r, c), rtol, atol, *on(cols, r0, c - r + r0)),
        LeafInput(0, "grad", "w", *on(both, r, c), rtol, atol, allowance=on(both, extra)[0]),
        LeafInput(0, "opt_state", "w", *on(fsdp, r, c), rtol, atol, *on(fsdp, r0, r0 + c - r, extra)),
        LeafInput(0, "grad", "w", *on(rows, r, special), rtol, atol),
        LeafInput(0, "opt_state", "w", *on(cols, special, c), rtol, atol, *on(cols, r0, r, extra)),
        # the reference whole on every device, the candidate split: compared in the candidate's placement
        LeafInput(0, "param", "w", *on(whole, r), *on(both, c), rtol, atol, *on(whole, r0, r0, extra)),
        LeafInput(
            0,
            "param",
            "w",
            *on(rows, r, c),
            rtol,
            atol,
            *on(rows, r0, r0),
            on(rows, extra.astype(jnp.bfloat16))[0],
        ),
    ]
    host = [leaf_error(*compare._host_args(i)) for i in items]
    for median in (False, True):
        device, split = _compared(items, median)
        assert sorted(split) == list(range(len(items)))  # every one of them through the split path
        for d, h in zip(device, host, strict=True):
            np.testing.assert_equal(_fields(d), _fields(h))
            if median and d.ratio is not None and h.ratio is not None and math.isfinite(h.ratio):
                assert abs(d.ratio - h.ratio) <= RATIO_RTOL * abs(h.ratio) + 1e-37, (d.ratio, h.ratio)
                # the ratio's 10th/90th percentiles: order statistics of the same quotients, to float32's rounding
                for a, b in zip(d.spread, h.spread, strict=True):
                    if not math.isfinite(b):  # a quotient over a tiny change: the same infinity on both sides
                        assert a == b, (d.spread, h.spread)
                        continue
                    assert abs(a - b) <= RATIO_RTOL * abs(b) + 1e-37, (d.spread, h.spread)
            else:
                np.testing.assert_equal(d.ratio, h.ratio)
                np.testing.assert_equal(d.spread, h.spread)


def _split_and_packed(shardings, fields, tol):
    """``(split_stats, device_stats)`` of the same leaves: split as ``shardings`` place them (one mesh), and
    whole on one device."""
    sizes = [np.size(a) for a in fields["r"]]
    blocks = _device_stats.Layout.of(
        [n // _device_stats.parts(s) for n, s in zip(sizes, shardings, strict=True)]
    )
    places = {
        k: [None if a is None else s for a, s in zip(v, shardings, strict=True)] for k, v in fields.items()
    }
    split = _device_stats.split_stats(
        tuple(shardings),
        blocks,
        jax.device_put(fields, places),
        *blocks.row_arrays([n // _device_stats.parts(s) for n, s in zip(sizes, shardings, strict=True)]),
        tol,
        True,
    )
    layout = _device_stats.Layout.of(sizes)
    packed = _device_stats.device_stats(layout, fields, *layout.row_arrays(sizes), tol, True)
    return jax.device_get((split, packed))


@require_devices(8)
def test_split_statistics_are_the_packed_ones():
    """The split path's raw statistics, counts included, equal those of the same leaves laid whole into one
    matrix: leaves split by rows, by columns, over both axes and over ``fsdp`` with a copy on each ``data`` row
    (counted once: the copies' rows are masked), and a leaf of 8 elements over 8 devices (blocks of one, padded
    to the 16 candidates)."""
    rng = np.random.default_rng(0)
    _, grid = _meshes()
    specs = [P("fsdp"), P(None, "fsdp"), P("data", "fsdp"), P(None, ("data", "fsdp")), P("fsdp")]
    shapes = [(8, 16), (8, 16), (8, 16), (8, 16), (8,)]
    r = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    c = [(a + rng.normal(size=a.shape) * 1e-3).astype(np.float32) for a in r]
    r0 = [(a + rng.normal(size=a.shape)).astype(np.float32) for a in r]
    c0 = [(a + rng.normal(size=a.shape) * 1e-4).astype(np.float32) for a in r0]
    extra = [np.abs(rng.normal(size=a.shape) * 1e-3).astype(np.float32) for a in r]
    # every element at the top: integers moved by a quarter, exactly (a count of 128 near ones)
    r[1] = rng.integers(-8, 8, size=shapes[1]).astype(np.float32)
    c[1], extra[1] = r[1] + np.float32(0.25), np.full(shapes[1], np.float32(1e-3))
    fields = {"r": r, "c": c, "r0": r0, "c0": c0, "extra": extra}
    fields["r0"][2] = fields["c0"][2] = None  # no before-state: the change is the value
    shardings = [NamedSharding(grid, spec) for spec in specs[:4]] + [NamedSharding(_meshes()[0], specs[4])]
    tol = np.array([[1e-7, 1e-6]] * 4, np.float32)
    on_grid = {k: v[:4] for k, v in fields.items()}
    on_flat = {k: v[4:] for k, v in fields.items()}
    near = []
    for group, places, t in ((on_grid, shardings[:4], tol), (on_flat, shardings[4:], tol[:1])):
        split, packed = _split_and_packed(places, group, t)
        assert set(split) == set(packed) and np.all(split["finite"])
        for k, v in packed.items():
            if k.startswith("at_"):  # the candidates in order of badness: the leaf's elements (no ties here)
                n = min(16, min(np.size(a) for a in group["r"]))
                np.testing.assert_array_equal(split[k][:, :n], v[:, :n], err_msg=k)
            else:
                np.testing.assert_array_equal(split[k], v, err_msg=k)
        near += list(split["near"])
    assert near[1] == 128 and near[4] == 1


@require_devices(8)
def test_device_bytes_count_every_shard_on_its_device():
    """A leaf split 8 ways holds 1/8 of its bytes on each device; a replicated one all of them on each."""
    flat, _ = _meshes()
    a = jax.device_put(np.zeros((8, 16), np.float32), NamedSharding(flat, P("fsdp")))
    b = jax.device_put(np.zeros((4,), np.float32), NamedSharding(flat, P()))
    held = footprint.device_bytes([a, b, "not an array"])
    assert set(held) == set(flat.devices.flat)
    assert set(held.values()) == {8 * 16 * 4 // 8 + 16}
    assert footprint.state_bytes({"a": a, "b": b}) == 80


def test_the_report_states_the_footprint():
    """``to_dict`` and ``str`` carry the footprint in this mode; ``None`` and no line otherwise."""
    report = ParityReport("fsdp", True, (), (), peak_bytes_per_device=3 * 2**20, state_bytes_per_device=2**20)
    assert report.to_dict()["peak_bytes_per_device"] == 3 * 2**20
    assert report.to_dict()["state_bytes_per_device"] == 2**20
    assert report.to_dict()["allocator_peak_bytes"] is None
    assert "memory: peak 3 MiB per device (live arrays), 3 x the larger side's own state of 1 MiB" in str(
        report
    )
    plain = ParityReport("fsdp", True, (), ())
    assert plain.to_dict()["peak_bytes_per_device"] is None and "memory:" not in str(plain)


# ------------------------------------------------------------------------------ a whole check, in a subprocess

SCRIPT = textwrap.dedent(
    """
    import json, math, os, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    cache = os.environ.get("SHARDCHECK_TEST_XLA_CACHE", "off")
    if cache != "off":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from flax import nnx
    import shardcheck
    from shardcheck.parity.harness import check as harness
    from shardcheck.parity.comparison._device_stats import split_axes
    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.tasks.tiny_lm import TinyLMConfig, tiny_lm_task

    axes, candidate, sizes = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    runs, run_steps = [], harness._run_steps

    def kept(run, data, tolerances):
        runs.append(run)
        return run_steps(run, data, tolerances)

    harness._run_steps = kept
    mesh = shardcheck.make_mesh(axes)
    start = time.perf_counter()
    task = tiny_lm_task(config=TinyLMConfig(**sizes))
    report = shardcheck.check_parity(candidate, task, mesh=mesh, reference="gspmd", steps=2)
    seconds = time.perf_counter() - start
    leaves = []
    for side in ((runs[0].ref_model, runs[0].ref_opt), (runs[0].cand_model, runs[0].cand_opt)):
        for path, a in flatten_state(nnx.state(side)).items():
            if isinstance(a, jax.Array):
                parts = math.prod(a.sharding.mesh.shape[ax] for ax in split_axes(a.sharding))
                largest = max(s.data.nbytes for s in a.addressable_shards)
                leaves.append([path, a.nbytes, parts, largest])
    out = report.to_dict()
    out.update(leaves=leaves, seconds=seconds, text=str(report))
    print(json.dumps(out))
    """
)

# One transformer block (the check compiles half as much). On data=2,fsdp=4 the embedding table has 80 rows, which
# its FSDP placement splits 4 ways: with the corpus's 77 it is split along its 32 features instead, and XLA's
# partitioning of the gspmd step's own lookup (the strategy's program, not the check's: checking gspmd against the
# single-device step shows it too) replicates an activation.
CASES = [
    ({"fsdp": 8}, "fsdp", {"num_layers": 1}),
    ({"data": 2, "fsdp": 4}, "dp", {"num_layers": 1, "vocab_size": 80}),
]


@pytest.fixture(scope="module", params=CASES, ids=["fsdp=8:fsdp", "data=2,fsdp=4:dp"])
def checked(request):
    """One check per mesh in a fresh process (8 fake CPU devices): its report's fields, every state leaf's
    ``[path, nbytes, parts its placement splits it into, largest addressable shard bytes]``, and XLA's log."""
    axes, candidate, sizes = request.param
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(axes), candidate, json.dumps(sizes)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@require_devices(8)
def test_the_check_passes_and_gathers_no_split_leaf(checked):
    """The check passes against gspmd on the same mesh, and XLA's partitioner never had to replicate a tensor."""
    report, log = checked
    assert report["verdict"] == "PASS" and report["reference"].startswith("gspmd on ")
    assert "Involuntary full rematerialization" not in log, log[-3000:]


@require_devices(8)
def test_no_device_holds_more_than_its_placement(checked):
    """Every state leaf of both sides after the check: each addressable shard holds at most the leaf's bytes over
    the parts its spec splits it into; the state is larger than one device's share (some leaf is split)."""
    report, _ = checked
    leaves = report["leaves"]
    assert any(parts > 1 for _, _, parts, _ in leaves)
    for path, nbytes, parts, largest in leaves:
        assert largest <= nbytes // parts, (path, nbytes, parts, largest)


@require_devices(8)
def test_the_peak_per_device_is_reported_and_bounded(checked):
    """The report gives the check's peak per device and the larger side's own state per device (on CPU devices
    no allocator peak); the peak holds at least that state and stays within :data:`FOOTPRINT_BOUND` of it."""
    report, _ = checked
    peak, state = report["peak_bytes_per_device"], report["state_bytes_per_device"]
    assert state > 0 and report["allocator_peak_bytes"] is None
    assert state <= peak <= FOOTPRINT_BOUND * state, (peak, state, peak / state)
    assert "memory: peak " in report["text"]
    print(
        f"peak {peak} B, own state {state} B per device: {peak / state:.2f} x; check {report['seconds']:.1f} s"
    )
