"""Issue #36, trial 19: a PASS said of a leaf "the reference's update at every one of the run's 3 steps of param
block.attn.value.kernel is not larger than the tolerance: a wrong update of that leaf could pass its own comparison
unseen", while a step applying that leaf's update twice FAILed at step 0 (abs 0.000938 against 6.94e-05).

The leaf's reported tolerance (0.00187) was one element's: the one element of 1024 whose gradient was at rounding
level, whose Adam update follows that noise and is allowed ~2 lr. ``weak_update`` now compares the reference's update
with each element's own tolerance (``LeafError.update_seen``): a leaf is weak only where a wrong update of it passes.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity

LR = 1e-2


def _task(lr: float) -> Task:
    """A linear regression whose input feature 0 is ~1e-7 of the others: the kernel's row 0 (4 of its 32
    elements) has a gradient at rounding level, the other 28 a large one. Adam: every element's first update is
    ~lr, and the 4 rounding-level elements are allowed ~lr each."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        x = rng.normal(size=(8, 8)).astype(np.float32)
        x[:, 0] *= 1e-7
        batches.append({"x": x, "y": rng.normal(size=(8, 4)).astype(np.float32)})
    return Task(
        model=lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(lr),
        loss_fn=lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2),
        batches=batches,
        name="linear_rounding_row",
    )


@nnx.jit
def _step(model, optimizer, batch):
    def loss(m):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def correct(model, optimizer, batch):
    return _step(model, optimizer, batch)


def kernel_twice(model, optimizer, batch):
    """The kernel's update applied twice (every other leaf as the reference's)."""
    old = jnp.array(model.kernel[...])
    out = _step(model, optimizer, batch)
    model.kernel[...] = old + 2.0 * (model.kernel[...] - old)
    return out


def _kernel(report, step=0):
    return next(e for e in report.steps[step].leaves if e.name == "param kernel")


@require_devices(2)
def test_a_leaf_with_a_few_rounding_level_elements_is_not_called_weak():
    """The kernel's tolerance as reported is its rounding-level elements' (~lr, not below its update ~lr): the
    per-leaf comparison called it weak. Its other 28 elements are allowed far less than their update, so a
    doubled update FAILs, and the PASS no longer says weak_check."""
    good = check_parity(correct, _task(LR), num_shards=2)
    assert good.ok and good.verdict == "PASS", str(good)
    kernel = _kernel(good)
    # the per-leaf numbers alone would say weak (what the rule read before): the update is not above them
    assert kernel.reference_change == pytest.approx(LR, rel=1e-3)
    assert kernel.reference_change <= kernel.tolerance
    # element by element, the update is seen (at step 0; a later step compared against the allowances' lower
    # bound measures nothing: None)
    assert _kernel(good).update_seen is True
    assert all(_kernel(good, t).update_seen in (True, None) for t in range(3))
    assert "weak_check" not in good.codes, str(good)
    assert "could pass its own comparison unseen" not in str(good)

    bad = check_parity(kernel_twice, _task(LR), num_shards=2)
    assert not bad.ok and bad.verdict == "FAIL", str(bad)
    failed = _kernel(bad)
    assert not failed.ok and failed.step == 0
    # off by its whole update (~lr) against the tolerance of the elements that carry it, far below lr
    assert failed.max_abs_err == pytest.approx(LR, rel=1e-3)
    assert failed.tolerance < 0.1 * LR


@require_devices(2)
def test_a_leaf_whose_whole_update_is_below_tolerance_is_still_weak():
    """lr 1e-6: every element's update (~1e-6) is below its tolerance (~1e-5), at every step: weak_check says so,
    and the doubled update indeed passes its comparison against the reference (the claim is true); the update
    check (the task's optimizer rerun on the step's own gradients, at the optimizer's own rounding) fails it."""
    good = check_parity(correct, _task(1e-6), num_shards=2)
    assert good.ok and good.verdict == "PASS", str(good)
    kernel = _kernel(good)
    assert 0.0 < kernel.reference_change < kernel.tolerance and kernel.update_seen is False
    assert all(_kernel(good, t).update_seen in (False, None) for t in range(3))
    assert "weak_check" in good.codes, str(good)
    assert "update at every one of the run's 3 steps of param " in str(good)

    twice = check_parity(kernel_twice, _task(1e-6), num_shards=2)
    assert all(e.ok for r in twice.steps for e in r.leaves)  # every leaf within its tolerance
    assert not twice.ok and twice.codes[0] == "update_rerun", twice.codes
    assert {e.path for e in twice.steps[0].update_only} == {"kernel"}


def test_update_seen_defaults_to_unmeasured():
    """A hand-built or replayed leaf has no elementwise measure: ``weak_update`` reads ``reference_change <=
    tolerance`` there."""
    from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
    from shardcheck.parity.diagnosis.rules import diagnose

    def record(seen):
        leaf = LeafError(0, "param", "w", 0.0, 0.0, 2e-3, True, 1.0, 1e-3, shape=(4,), update_seen=seen)
        return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (leaf,), 1, 1)

    codes = [[d.code for d in diagnose([record(seen)])] for seen in (None, True, False)]
    assert ["weak_check" in c for c in codes] == [True, False, True]


@require_devices(2)
@pytest.mark.parametrize("on_device", [True, False])
def test_update_seen_is_the_same_on_the_devices_and_on_the_host(monkeypatch, on_device):
    """``compare.exceeds`` of the update (``before``: taken inside its reduction) on the devices (float32) and on
    the host (float64): the bias's update (~lr) exceeds its tolerance, the kernel's (lr 1e-6) does not."""
    from shardcheck.parity.comparison import live

    monkeypatch.setattr(live, "DEVICE_SCALARS", on_device)
    seen = {lr: check_parity(correct, _task(lr), num_shards=2) for lr in (LR, 1e-6)}
    first = {
        lr: {e.path: e.update_seen for e in r.steps[0].leaves if e.kind == "param"} for lr, r in seen.items()
    }
    assert first == {LR: {"bias": True, "kernel": True}, 1e-6: {"bias": True, "kernel": False}}
