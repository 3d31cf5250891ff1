"""One reference trajectory for the checks of one ``verify`` (``parity.reference_trajectory``): every report is the one
a check of its own gives, bit for bit, and the reference steps run once."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck.losses import mse_batch_loss
from shardcheck.models import MLP
from shardcheck.parity.harness import check as harness
from shardcheck.parity.harness import reference_trajectory
from shardcheck.parity.harness.reference_trajectory import shared_reference


def _task(seed=0, factory_seed=None):
    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))] * 4
    return shardcheck.Task(
        model=(lambda: MLP(4, 8, 2, rngs=nnx.Rngs(0))) if factory_seed is None else factory_seed,
        optimizer=optax.adam(1e-2),
        loss_fn=mse_batch_loss,
        batches=batches,
    )


def _summed_from_step_2(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: mse_batch_loss(m, batch))(model)
    if int(optimizer.step[...]) >= 2:
        grads = jax.tree.map(lambda g: 2 * g, grads)
    optimizer.update(model, grads)
    return loss


def _fields(report):
    return [[dataclasses.astuple(e) for e in r.leaves] for r in report.steps], report.codes, report.diagnosis


def _counted(monkeypatch):
    """The reference steps the harness runs: ``reference_step``, or ``stepped_in_place`` where both sides' steps
    update in place (the Variables found once)."""
    calls = [0]
    for name in ("reference_step", "stepped_in_place"):
        step = getattr(harness, name)

        def counted(*args, step=step):
            calls[0] += 1
            return step(*args)

        monkeypatch.setattr(harness, name, counted)
    return calls


@require_devices(2)
def test_shared_reports_are_the_checks_own_bit_for_bit(monkeypatch):
    task = _task()
    candidates = ["dp", "fsdp", _summed_from_step_2]
    alone = [shardcheck.check_parity(c, task, num_shards=2) for c in candidates]
    calls = _counted(monkeypatch)
    with shared_reference():
        shared = [shardcheck.check_parity(c, task, num_shards=2) for c in candidates]
    assert [r.verdict for r in shared] == ["PASS", "PASS", "FAIL"] and shared[2].codes[0] == "summed"
    for a, s in zip(alone, shared, strict=True):
        assert _fields(a) == _fields(s)
    # 4 steps once, then only the failing check's re-check of step 2 from the reference's state (a new tolerance)
    assert calls[0] == 4 + 1


def test_a_task_whose_factory_is_not_deterministic_is_not_shared(monkeypatch):
    import shardcheck.task

    seeds = iter(range(100))
    task = _task(factory_seed=lambda: MLP(4, 8, 2, rngs=nnx.Rngs(next(seeds))))
    calls = _counted(monkeypatch)
    # the task's initial state is built once and copied (Task.initial_state): every check starts from it, so the
    # reference's steps are the same and run once, whatever the factory gives on a second call
    with shared_reference():
        reports = [shardcheck.check_parity("simulation", task, num_shards=2) for _ in range(2)]
    assert calls[0] == 4 and all(r.verdict == "PASS" for r in reports)
    # a state past the cache's limit is built afresh each check: the factory's other values are not shared
    monkeypatch.setattr(shardcheck.task, "CACHED_STATE_BYTES", 0)
    task = _task(factory_seed=lambda: MLP(4, 8, 2, rngs=nnx.Rngs(next(seeds))))
    calls[0] = 0
    with shared_reference():
        reports = [shardcheck.check_parity("simulation", task, num_shards=2) for _ in range(2)]
    assert calls[0] == 8 and all(r.verdict == "PASS" for r in reports)


def test_outside_the_block_nothing_is_shared(monkeypatch):
    task = _task()
    calls = _counted(monkeypatch)
    for _ in range(2):
        assert shardcheck.check_parity("simulation", task, num_shards=2).verdict == "PASS"
    assert calls[0] == 8


def test_verify_checks_every_strategy_against_one_reference_run(monkeypatch, capsys):
    from shardcheck.cli import main

    calls = _counted(monkeypatch)
    code = main(
        ["verify", "--task", "digits", "--devices", "2", "--steps", "2", "--strategies", "simulation,dp"]
    )
    assert code == 0, capsys.readouterr()
    assert calls[0] == 2


@pytest.mark.parametrize("limit", [0])
def test_a_trajectory_past_its_byte_limit_is_not_stored(monkeypatch, limit):
    monkeypatch.setattr(reference_trajectory, "MAX_BYTES", limit)
    task = _task()
    calls = _counted(monkeypatch)
    with shared_reference():
        for _ in range(2):
            assert shardcheck.check_parity("simulation", task, num_shards=2).verdict == "PASS"
    assert calls[0] == 8


def test_starting_states_holding_prng_keys_are_compared_through_their_data():
    """Regression: a model holding RNG streams (``nnx.Dropout(rngs=...)``, the Flax tutorials' models) keeps typed
    PRNG keys in its state; the shared reference compared the starting states through NumPy and raised."""
    from shardcheck.parity.comparison import live as compare

    key = {"rngs.dropout.key": jax.random.key(1), "w": jax.numpy.ones(3)}
    assert compare.equal(key, {"rngs.dropout.key": jax.random.key(1), "w": jax.numpy.ones(3)})
    assert not compare.equal(key, {"rngs.dropout.key": jax.random.key(2), "w": jax.numpy.ones(3)})
    assert not compare.equal(key, {"rngs.dropout.key": jax.random.key(1), "w": jax.numpy.zeros(3)})
