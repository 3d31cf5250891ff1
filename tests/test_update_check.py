"""Issue #36, trial 20: a decoupled weight decay of 0.01 applied to the LayerNorm scales and biases (the optimizer's
mask leaves them out) PASSed a 3-step check of a GNN: each step moves a scale by lr * 0.01 * p = 3e-5, below the
parameter tolerance, which allows the gradients' rounding carried through Adam (9.8e-5 at step 2, where the
fault's sum reached 9.1e-5).

A passing step now gets the update check: the task's optimizer rerun on the candidate's own gradients and
pre-step state gives its update within the optimizer's own rounding (8 ulps of the leaf and 1e-4 of its change,
``tolerance.derive.UPDATE_ULPS`` / ``UPDATE_RTOL``), free of any drift; a step adding a term to its update fails
it at step 0 (``update_rerun``), live and replayed, with the stage, the group and the form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcheck import Task, check_parity
from shardcheck.parity.harness.recorded import record_run

LR, WD = 3e-3, 0.01
# the fault's decay: lr * 2e-3 * |p| = 6e-6 a step on the LayerNorm scale (|p| ~ 1), below the scale's tolerance
# against the reference here (1.4e-5 at step 0, 2.5e-5 at step 2), 4.6 x the update check's (1.3e-6)
FAULT_WD = 2e-3


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(6, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(nnx.relu(self.dense(x))))[:, 0]


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _kernels(params):
    return jax.tree.map(lambda p: p.ndim == 2, params)


def _task(tx=None, seed: int = 0, scale: float = 1.0) -> Task:
    rng = np.random.default_rng(seed)
    batches = [
        {
            "x": (scale * rng.normal(size=(8, 6))).astype(np.float32),
            "y": rng.normal(size=8).astype(np.float32),
        }
        for _ in range(3)
    ]
    tx = tx or optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=WD, mask=_kernels))
    return Task(model=lambda: _Net(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=batches, name="ln_net")


@nnx.jit
def _step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: _loss(m, batch))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def correct(model, optimizer, batch):
    return _step(model, optimizer, batch)


def decay_everywhere(model, optimizer, batch):
    """A decoupled decay applied to the 1-D leaves too (the LayerNorm scale and bias, the biases)."""
    out = _step(model, optimizer, batch)
    _, params = nnx.split(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p if p.ndim == 2 else p - LR * FAULT_WD * p, params))
    return out


def lr_off(model, optimizer, batch):
    """Every update 1.0002 x the optimizer's (a learning rate or schedule a little off)."""
    _, before = nnx.split(model, nnx.Param)
    before = jax.tree.map(jnp.copy, before)
    out = _step(model, optimizer, batch)
    _, after = nnx.split(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a, b: b + 1.0002 * (a - b), after, before))
    return out


@require_devices(2)
def test_a_correct_step_passes_the_update_check():
    report = check_parity(correct, _task(), num_shards=2)
    assert report.ok and report.verdict == "PASS", str(report)
    assert all(r.optimizer_rerun is None for r in report.steps)  # the check passed: nothing kept


@require_devices(2)
def test_a_weight_decay_on_the_norm_and_biases_fails_at_step_0_with_its_form():
    report = check_parity(decay_everywhere, _task(), num_shards=2, steps=2)
    assert not report.ok and report.verdict == "FAIL"
    # every compared leaf is within its tolerance at both steps: only the update check fails (at step 2 the
    # drift it left moves head.kernel's gradient past its tolerance)
    assert all(e.ok for r in report.steps for e in r.leaves)
    assert report.codes[0] == "update_rerun", report.codes
    where = report.localization
    assert (where.step, where.stage) == (0, "optimizer")
    assert where.form.kind == "decay"
    # c itself: the task's constant learning rate is read from its optimizer (trial 36), no longer c*lr
    assert where.form.coefficient == pytest.approx(FAULT_WD, rel=1e-2)
    failing = {e.path for e in report.steps[0].update_only}
    assert failing == {"norm.scale"}  # the biases are still 0 at step 0: a decay moves nothing there
    worst = report.worst
    assert worst.kind == "update" and worst.path == "norm.scale"
    assert worst.max_abs_err == pytest.approx(LR * FAULT_WD, rel=2e-2)  # |p| of the scale is 1 at init
    assert "update" in report.worst_by_kind() and not report.worst_by_kind()["update"].ok


@require_devices(2)
def test_an_update_off_by_0_02_percent_fails_the_update_check():
    """2e-4 of the update: twice the update check's relative allowance (1e-4), below the biases' tolerance against
    the reference (a bias's update 3e-3 off by 6e-7, its tolerance 8.7e-7)."""
    report = check_parity(lr_off, _task(), num_shards=2, steps=1)
    assert report.codes[0] == "update_rerun", report.codes
    record = report.steps[0]
    assert all(e.ok for e in record.leaves)
    worst = max(record.update_only, key=lambda e: e.badness)
    assert worst.ratio == pytest.approx(1.0002, rel=2e-5)
    # replayed, the update check's failure fails the replay (trial 29: FAIL with ok true and exit status 0)
    task = _task()
    replayed = check_parity(
        lr_off, task, reference=record_run(task, correct, num_shards=2, steps=1), num_shards=2
    )
    assert replayed.codes[0] == "update_rerun" and replayed.verdict == "FAIL"
    assert not replayed.ok and not replayed.replay.ok


@require_devices(2)
def test_the_replay_names_the_fault_as_the_live_check():
    task = _task()
    recording = record_run(task, correct, num_shards=2, name="correct")
    report = check_parity(decay_everywhere, task, reference=recording, num_shards=2)
    assert not report.steps[2].update_only and not report.steps[2].ok  # the drift at step 2, as live
    assert report.codes[0] == "update_rerun", report.codes
    where = report.localization
    assert (where.step, where.stage) == (0, "optimizer")
    assert where.form.kind == "decay"
    assert where.form.coefficient == pytest.approx(LR * FAULT_WD, rel=1e-2)
    good = check_parity(correct, task, reference=recording, num_shards=2)
    assert good.ok, str(good)


@require_devices(2)
@settings(max_examples=6, deadline=None)
@given(
    optimizer=st.sampled_from(["sgd", "momentum", "adam", "adamw_clip", "adafactor"]),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 10.0),
)
def test_a_correct_step_passes_the_update_check_for_any_optimizer(optimizer, seed, scale):
    """No false alarm: the rerun agrees with the applied update within the optimizer's own rounding."""
    tx = {
        "sgd": optax.sgd(0.1),
        "momentum": optax.sgd(0.05, momentum=0.9, nesterov=True),
        "adam": optax.adam(1e-2),
        "adamw_clip": optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1)),
        "adafactor": optax.adafactor(1e-2),
    }[optimizer]
    report = check_parity(correct, _task(tx, seed, scale), num_shards=2, steps=2)
    assert report.ok, str(report)
    assert all(r.optimizer_rerun is None for r in report.steps)


def test_the_update_check_runs_at_step_0_and_at_later_steps_of_a_state_within_its_byte_limit(monkeypatch):
    """The check copies the state to the host: at every step of a state of at most UPDATE_CHECK_BYTES, at step 0
    alone above it."""
    from shardcheck.parity.harness import optimizer_rerun

    state = {"w": np.zeros(4, np.float32), "mu": {"w": np.zeros(4, np.float32)}}  # 32 bytes
    monkeypatch.setattr(optimizer_rerun, "UPDATE_CHECK_BYTES", 32)
    assert [optimizer_rerun.checks_step(t, state) for t in (0, 1, 5)] == [True, True, True]
    monkeypatch.setattr(optimizer_rerun, "UPDATE_CHECK_BYTES", 31)
    assert [optimizer_rerun.checks_step(t, state) for t in (0, 1, 5)] == [True, False, False]


@settings(max_examples=25, deadline=None)
@given(
    k=st.floats(0.0, 2.0),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    rel=st.sampled_from([1e-4, 0.03125]),
)
def test_the_devices_fast_path_clears_only_what_the_hosts_float64_rule_clears(k, seed, dtype, rel):
    """``_rerun_within_jit`` (the update check on the device, float32 with a margin) says ``True`` only where the
    host's float64 rule (``_within``) holds, and for a state off the rerun by ``k`` times its allowance it says
    ``True`` below 0.9 of it; above it both say ``False``."""
    from shardcheck.parity.harness import optimizer_rerun as o

    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(4, 6)), dtype), "b": jnp.asarray(rng.normal(size=6), dtype)}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    tx = optax.adam(1e-2)
    state = tx.init(params)
    new_params, new_state = o._rerun(tx, params, state, grads)
    ulps = o.UPDATE_ULPS * float(jnp.finfo(dtype).eps)

    def off(r, b):  # the candidate: the rerun moved by k times the rule's allowance, in the leaf's dtype
        r64, b64 = np.asarray(r, np.float64), np.asarray(b, np.float64)
        bound = ulps * np.max(np.abs(r64)) + rel * np.abs(r64 - b64)
        return jnp.asarray(r64 + k * bound * np.sign(rng.normal(size=r.shape)), r.dtype)

    after = jax.tree.map(off, new_params, params), new_state
    compute = jnp.float32 if rel == 1e-4 else jnp.bfloat16
    _, flag = o._rerun_within_jit(tx, params, state, grads, after, np.float32(o._update_rtol(compute)))
    flat = lambda pair: tuple(o.flatten_state(t) for t in pair)  # noqa: E731
    host = o._within((new_params, new_state), flat(after), flat((params, state)), compute)
    if bool(flag):
        assert host
    if k < 0.9 and dtype == jnp.float32:  # bfloat16 rounds the moved value: it may land on either side
        assert bool(flag)
    if k > 1.1 and dtype == jnp.float32:
        assert not host and not bool(flag)
