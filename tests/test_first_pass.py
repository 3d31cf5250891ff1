"""The comparison's cheap first pass (``parity.first_pass``): it clears only what the float64 rule passes, and a
check run with it gives the verdicts and diagnoses of a check that compares every leaf in full."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, scaled_from
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shardcheck
from shardcheck.losses import mse_batch_loss
from shardcheck.models import MLP
from shardcheck.parity.comparison import _device_stats, first_pass
from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import LeafInput, leaf_error
from shardcheck.parity.harness import check as harness

SHAPE = (4, 16)
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3e38]


def _leaves(special: bool):
    values = st.floats(-4, 4, width=32) | (st.sampled_from(SPECIAL) if special else st.just(1.0))
    return hnp.arrays(np.float32, SHAPE, elements=values)


@settings(max_examples=200, deadline=None)
@given(
    r=_leaves(special=False),
    noise=hnp.arrays(np.float32, SHAPE, elements=st.sampled_from([0.0, 1.0, -1.0, 2.0, 1e-3, 0.5, 8.0])),
    r0=_leaves(special=True),
    special=_leaves(special=True),
    scale=st.sampled_from([0.0, 1e-7, 1e-6, 4e-6, 1e-3]),
    where=st.integers(0, SHAPE[0] * SHAPE[1] - 1),
    shift=st.sampled_from([-2, -1, 0, 1, 2]),
)
def test_a_cleared_leaf_passes_the_float64_rule(r, noise, r0, special, scale, where, shift):
    """Errors around the tolerance (an allowance that puts one element at its threshold, a few ulps either
    side), NaN / inf / subnormal elements: every leaf the first pass clears passes ``leaf_error``'s float64 rule,
    its error is float64's to float32 rounding and its tolerance is the widest the rule allows."""
    rtol, atol = 1e-6, 1e-7
    c = (r + noise * np.float32(scale) * np.abs(r)).astype(np.float32)
    diff = np.abs(c.astype(np.float64) - r.astype(np.float64))
    base = atol + rtol * float(np.max(np.abs(r.astype(np.float64))))
    extra = np.full(SHAPE, np.float32(max(float(diff.flat[where]) - base, 0.0)), np.float32)
    extra = np.nextafter(extra, np.float32(np.inf * np.sign(shift))) if shift else extra
    extra = np.abs(extra).astype(np.float32)
    dev = jnp.asarray
    items = [
        LeafInput(1, "param", "w", dev(r), dev(c), rtol, atol, dev(r0), dev(r0), dev(extra)),
        LeafInput(1, "grad", "w", dev(r), dev(c), rtol, atol),
        LeafInput(1, "grad", "w", dev(r), dev(special), rtol, atol),
        LeafInput(1, "opt_state", "w", dev(special), dev(c), rtol, atol, dev(r0), dev(r), dev(extra)),
        LeafInput(
            1, "param", "w", dev(r), dev(c), rtol, atol, dev(r0), dev(r0), jnp.asarray(extra, jnp.bfloat16)
        ),
    ]
    for item, quick in zip(items, first_pass.clear(items), strict=True):
        full = leaf_error(*compare._host_args(item))
        if quick is None:
            continue
        assert full.ok and quick.ok, (full, quick)
        assert _same_maximum(quick.max_abs_err, full.max_abs_err)
        assert quick.tolerance >= full.tolerance * (1 - 1e-12)
        if full.reference_change is not None:
            assert _same_maximum(quick.reference_change, full.reference_change)


def _same_maximum(quick: float, full: float) -> bool:
    """The first pass's maximum is float64's to float32 rounding, or 0 where float64's is below
    ``_device_stats.TINY``: a subnormal difference the device flushed to zero (the module docstring)."""
    return abs(quick - full) <= 2.0**-23 * full or (quick == 0.0 and full < _device_stats.TINY)


def test_a_difference_the_device_flushes_is_cleared_and_reads_zero():
    """Found by the property above: two normal float32 leaves one subnormal ulp apart (1.4e-45). XLA:CPU flushes
    their difference to 0; the leaf is cleared (its tolerance covers TINY), its error read as 0."""
    r = np.full(SHAPE, np.finfo(np.float32).tiny, np.float32)
    c = np.nextafter(r, np.float32(1.0))
    item = LeafInput(1, "grad", "w", jnp.asarray(r), jnp.asarray(c), 1e-6, 1e-7)
    (quick,) = first_pass.clear([item])
    full = leaf_error(*compare._host_args(item))
    assert full.ok and full.max_abs_err == float(c[0, 0]) - float(r[0, 0]) > 0.0
    assert quick is not None and quick.ok and _same_maximum(quick.max_abs_err, full.max_abs_err)


@require_devices(2)
def test_arrays_at_their_place_are_passed_as_they_are_committed_or_not():
    """#35: an uncommitted leaf already at its place (the reference's state, from ``task.model()`` on) is not
    committed by a ``device_put`` at every step; a leaf elsewhere is moved. The records are those of committed
    inputs, bit for bit."""
    import jax

    r = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(SHAPE)
    c = (r * np.float32(1 + 2e-7)).astype(np.float32)
    loose = jnp.asarray(r)
    here, there = jax.devices()[0], jax.devices()[1]
    assert not loose.committed and loose.sharding.device_set == {here}
    elsewhere = jax.device_put(c, there)
    out = first_pass._moved([loose, elsewhere, None], [loose.sharding] * 3)
    assert out[0] is loose and out[2] is None
    assert out[1].committed and out[1].sharding.device_set == {here}
    np.testing.assert_array_equal(np.asarray(out[1]), c)

    def items(put):
        return [LeafInput(1, "param", "w", put(r), put(c), 1e-6, 1e-7, put(r), put(r), put(np.abs(c - r)))]

    uncommitted = first_pass.clear(items(jnp.asarray))
    committed = first_pass.clear(items(lambda a: jax.device_put(a, here)))
    assert uncommitted == committed and uncommitted[0] is not None and uncommitted[0].ok


def test_what_the_first_pass_clears_and_what_it_leaves():
    """Values: a leaf at rounding level is cleared, one 2 ulps over a zero-allowance tolerance is not, one within
    its allowance only is cleared by the allowance's minimum, and NaN, inf and a missing allowance shape are not."""
    r = np.linspace(-1, 1, 64, dtype=np.float32).reshape(SHAPE)
    dev = jnp.asarray
    rtol, atol = 0.0, 1e-6
    near = r.copy()
    near.flat[3] += np.float32(2e-6)  # 2 atol
    allowance = np.full(SHAPE, np.float32(1.5e-6))
    nan = r.copy()
    nan.flat[0] = np.nan
    items = [
        LeafInput(1, "grad", "a", dev(r), dev(r), rtol, atol),
        LeafInput(1, "grad", "b", dev(r), dev(near), rtol, atol),
        LeafInput(1, "param", "c", dev(r), dev(near), rtol, atol, dev(r), dev(r), dev(allowance)),
        LeafInput(1, "grad", "d", dev(r), dev(nan), rtol, atol),
        LeafInput(1, "grad", "e", dev(r), dev(np.where(r > 0, np.inf, r)), rtol, atol),
        LeafInput(1, "grad", "f", dev(r), dev(r), rtol, atol, allowance=1e-3),
    ]
    a, b, c, d, e, f = first_pass.clear(items)
    assert a.ok and a.max_abs_err == 0.0 and a.tolerance == atol and a.ratio is None
    assert b is None and d is None and e is None and f is None
    assert c.ok and c.max_abs_err == float(near.flat[3]) - float(r.flat[3])  # exact: Sterbenz
    assert c.tolerance == atol + float(allowance.flat[0])
    assert c.reference_change == 0.0


def _task(lr: float, seed: int, steps: int = 4) -> shardcheck.Task:
    rng = np.random.default_rng(seed)
    batches = [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))
    ] * steps
    return shardcheck.Task(
        model=lambda: MLP(4, 8, 2, rngs=nnx.Rngs(seed)),
        optimizer=optax.adam(lr),
        loss_fn=mse_batch_loss,
        batches=batches,
    )


def _scaled_from(step: int, factor: float):
    """The reference's step until ``step``, then one applying ``factor`` times the gradient."""
    return scaled_from(mse_batch_loss, step, factor)


def _both(candidate, task, **kwargs):
    on = shardcheck.check_parity(candidate, task, **kwargs)
    harness.FIRST_PASS = False
    try:
        off = shardcheck.check_parity(candidate, task, **kwargs)
    finally:
        harness.FIRST_PASS = True
    return on, off


def _same_verdicts(on, off):
    assert (on.verdict, on.codes, on.diagnosis) == (off.verdict, off.codes, off.diagnosis)
    assert on.diverged_at == off.diverged_at and on.cannot_verify == off.cannot_verify
    for a, b in zip(on.steps, off.steps, strict=True):
        assert [(e.name, e.ok) for e in a.leaves] == [(e.name, e.ok) for e in b.leaves]
        assert (a.ok, a.unresolved, a.scale_evidence, a.matches) == (
            b.ok,
            b.unresolved,
            b.scale_evidence,
            b.matches,
        )
        for x, y in zip(a.leaves, b.leaves, strict=True):
            assert x.max_abs_err == pytest.approx(y.max_abs_err, rel=2.0**-23, abs=0.0)
            assert x.tolerance >= y.tolerance * (1 - 1e-12)
    assert [(e.name, e.ok, e.ratio) for e in on.steps[0].leaves] == [
        (e.name, e.ok, e.ratio) for e in off.steps[0].leaves
    ]


@settings(max_examples=6, deadline=None)
@given(
    lr=st.sampled_from([1e-3, 1e-2]),
    seed=st.integers(0, 3),
    fault=st.sampled_from([None, (2, 2.0), (1, 0.5), (3, 1.0 + 1e-3)]),
)
def test_two_pass_verdicts_are_the_full_ones_on_random_steps(lr, seed, fault):
    """Correct steps and faults planted at a later step (a sum for a mean, a mean taken twice, a 0.1% scale):
    the same verdicts, diagnoses, leaf-by-leaf oks and step-0 ratios with and without the first pass."""
    task = _task(lr, seed)
    candidate = _scaled_from(*fault) if fault else _scaled_from(10**9, 1.0)
    on, off = _both(candidate, task, num_shards=2)
    _same_verdicts(on, off)
    assert on.ok == (fault is None)


@require_devices(4)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_two_pass_verdicts_are_the_full_ones_for_the_strategies(strategy):
    on, off = _both(strategy, _task(1e-2, 0, steps=5), num_shards=4)
    _same_verdicts(on, off)
    assert on.verdict == "PASS"
