"""A replay says what the live check says (issue #36: "A replay is diagnosed by the same code as a live check";
"the same faults must be named the same way through record / --against").

Each test records the correct step (``record_run``), then checks a faulty candidate live and against the
recording, and asserts both sides' codes and sentences:

- an L2 term added to the gradients (``g + wd * p``) is read as one by the replay as live, with the same numbers
  (the replay's records, ratios at 8 samples, read "no simple form"; the replay now fits the candidate's
  gradients against the task's own at its pre-step parameters, as live);

- a fault that begins at step 1 is named as live: the mean of 2 micro-batches' own means (``micro_batch_means``,
  was ``forward_differs`` replayed), the loss reading a dict batch otherwise (``forward_differs`` with the batch's
  keys, which the replay's record lacked), each shard's gradient clipped before the mean after a step 0 within
  rounding of the recording's (``clip_per_shard``, was ``drift`` replayed).

Small tasks: an MLP of 2 layers, 2 to 4 fake CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_trial40_readings import _weighted_task, micro_halves

import shardcheck
from shardcheck import Candidate, check_parity, make_mesh
from shardcheck.losses import mse_batch_loss
from shardcheck.parity.harness.recorded import record_run


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _live_and_replayed(candidate, task, correct, **where):
    """``(live, replayed)``: ``candidate`` checked live and against a recording of ``correct``."""
    recording = record_run(task, correct, **where)
    return check_parity(candidate, task, **where), check_parity(candidate, task, reference=recording, **where)


def _said(report, code: str) -> str:
    return next(d.message for d in report.diagnoses if d.code == code)


# ------------------------------------------------------------------------ a fault from step 1 on, named as live


def _accumulating(means_from: int):
    """2 micro-batches accumulated by hand under a ``(sum, count)`` loss: their sums over the total count, and from
    the optimizer's step ``means_from`` on their own means averaged (trial 40's fault)."""

    @nnx.jit
    def step(model, optimizer, batch):
        ((s0, c0), g0), ((s1, c1), g1) = micro_halves(model, batch)
        on = optimizer.step[...] >= means_from
        loss = jnp.where(on, (s0 / c0 + s1 / c1) / 2, (s0 + s1) / (c0 + c1))
        grads = jax.tree.map(lambda a, b: jnp.where(on, (a / c0 + b / c1) / 2, (a + b) / (c0 + c1)), g0, g1)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


@require_devices(4)
def test_micro_batch_means_from_step_1_are_named_so_replayed_as_live():
    """Before: live ``micro_batch_means``, replayed ``forward_differs`` (the replay never ran the hypothesis)."""
    live, replayed = _live_and_replayed(
        _accumulating(1), _weighted_task(7, 2, steps=2), _accumulating(99), mesh=make_mesh({"data": 4})
    )
    assert live.steps[0].ok and replayed.steps[0].ok and not live.ok and not replayed.ok
    assert live.codes[0] == replayed.codes[0] == "micro_batch_means", (live.codes, replayed.codes)
    said = "the mean of the 2 micro-batches' own means (the batch's rows in 2 blocks, loss weights 7, 2)"
    assert said in _said(live, "micro_batch_means") and said in _said(replayed, "micro_batch_means")
    assert replayed.steps[1].micro_means == live.steps[1].micro_means == (2, (7.0, 2.0), "blocks", 1.0)


def _weighted_mse(model, batch, masked: bool = True):
    """A squared error weighted by the batch's ``"weights"`` (``masked`` False: every row weighs 1)."""
    w = batch["weights"] if masked else jnp.ones_like(batch["weights"])
    per_row = jnp.mean((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(w * per_row) / jnp.sum(w)


def _dict_task() -> shardcheck.Task:
    rng = np.random.default_rng(1)
    batches = [
        {
            "x": rng.normal(size=(8, 4)).astype(np.float32),
            "y": rng.normal(size=(8, 2)).astype(np.float32),
            "weights": (rng.random(8) > 0.4).astype(np.float32),
        }
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=optax.sgd(0.1), loss_fn=_weighted_mse, batches=batches
    )


def _unmasked_from(start: int) -> Candidate:
    """The task's step, its loss reading no weights from the optimizer's step ``start`` on."""

    @nnx.jit(static_argnums=3)
    def train(model, optimizer, batch, masked):
        loss, grads = nnx.value_and_grad(lambda m: _weighted_mse(m, batch, masked))(model)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        loss, grads = train(model, optimizer, batch, int(optimizer.step[...]) < start)
        return {"loss": loss, "grads": grads}

    return Candidate(name=f"unmasked from {start}", step=step)


def test_a_forward_fault_from_step_1_names_the_batch_keys_replayed_as_live():
    """Before: the replay's ``forward_differs`` said no batch key (its record held none)."""
    live, replayed = _live_and_replayed(_unmasked_from(1), _dict_task(), _unmasked_from(99))
    assert live.steps[0].ok and replayed.steps[0].ok
    assert live.codes[0] == replayed.codes[0] == "forward_differs", (live.codes, replayed.codes)
    keys = "the batch holds 'weights' beside its inputs and labels: check how the step's loss reads each"
    assert keys in _said(live, "forward_differs") and keys in _said(replayed, "forward_differs")
    assert replayed.localization.step == live.localization.step == 1


CLIP = 0.3


def _clip_task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 4)).astype(np.float32), (s * rng.normal(size=(8, 2))).astype(np.float32))
        for s in (1.0, 3.0)
    ]
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2))
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=mse_batch_loss, batches=batches
    )


def _clipped_from(start: int):
    """A shard_map step over 'data' whose pmean-ed gradients are scaled by 1 + 2^-21 (within rounding: the state
    after step 0 is not the recording's bit for bit), each shard's gradient clipped to ``CLIP`` before the pmean
    from the optimizer's step ``start`` on."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))
        clip = int(optimizer.step[...]) >= start

        def body(state, batch):
            m, o = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(mse_batch_loss)(m, batch)
            if clip:
                grads, _ = optax.clip_by_global_norm(CLIP).update(grads, optax.EmptyState())
            grads, loss = jax.lax.pmean(grads, "data"), jax.lax.pmean(loss, "data")
            o.update(m, jax.tree.map(lambda g: g * (1 + 2**-21), grads))
            return loss, grads, nnx.state((m, o))

        specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        loss, grads, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
        nnx.update((model, optimizer), state)
        return {"loss": loss, "grads": grads}

    return step


@require_devices(2)
def test_a_clip_per_shard_from_step_1_after_a_step_within_rounding_is_named_replayed_as_live():
    """Before: replayed ``drift`` (the hypothesis ran only from a state hashed equal to the recording's); now
    ``clip_per_shard`` from the replay's own pre-step state, said so. The correct step replays as a PASS."""
    mesh = make_mesh({"data": 2})
    task = _clip_task()
    recording = record_run(task, "dp", num_shards=2)
    live = check_parity(_clipped_from(1), task, mesh=mesh)
    replayed = check_parity(_clipped_from(1), task, reference=recording, mesh=mesh)
    assert not replayed.steps[1].identical_start  # step 0 within rounding, not bit for bit
    assert live.codes[0] == replayed.codes[0] == "clip_per_shard", (live.codes, replayed.codes)
    assert "drift" not in replayed.codes
    said = _said(replayed, "clip_per_shard")
    assert said.startswith("At step 1 the gradients differ (") and "a clip applied per shard" in said
    assert "rerun from the replay's own pre-step state: each shard's local gradient" in said
    assert "rerun from the reference's pre-step state" in _said(live, "clip_per_shard")
    assert check_parity(_clipped_from(99), task, reference=recording, mesh=mesh).ok


# ------------------------------------------------------------------------ an L2 term added to the gradients

WD = 0.05


def _mlp_task(opt) -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=opt, loss_fn=mse_batch_loss, batches=batches
    )


def _l2_step(wd: float):
    """The task's step, ``wd * param`` added to every gradient before the update."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(mse_batch_loss)(model, batch)
        grads = jax.tree.map(lambda g, p: g + wd * p, grads, nnx.state(model, nnx.Param))
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def l2_runs():
    """``(correct replayed, live, replayed)``: under plain SGD, the correct step replayed against its recording,
    then ``g + 0.05 p`` checked live and replayed."""
    task = _mlp_task(optax.sgd(0.1))
    recording = record_run(task, _l2_step(0.0))
    correct = check_parity(_l2_step(0.0), task, reference=recording)
    return correct, check_parity(_l2_step(WD), task), check_parity(_l2_step(WD), task, reference=recording)


def test_an_l2_term_in_the_gradients_is_read_as_one_replayed_as_live(l2_runs):
    """Before: live "an L2 / weight-decay term ... c = 0.05", replayed "no simple form read from the records of the 2
    failing leaves; grad l1.kernel's elementwise ratio runs from -2.926 to 3.127". The correct step replays as a
    PASS."""
    correct, live, replayed = l2_runs
    assert correct.ok and correct.verdict == "PASS"
    forms = [r.localization.form for r in (live, replayed)]
    assert [(r.localization.step, r.localization.stage) for r in (live, replayed)] == [(0, "gradients")] * 2
    assert forms[0].kind == forms[1].kind == "offset" and forms[1].sentence == forms[0].sentence
    assert forms[0].coefficient == pytest.approx(WD, rel=1e-4) and forms[1].coefficient == pytest.approx(
        forms[0].coefficient, rel=1e-6
    )
    assert forms[1].sentence.startswith(
        "an L2 / weight-decay term c x the parameter added to the gradients, c = 0.05 (the difference is 0.05 x "
        "the parameter on every element on all 2 failing leaves"
    )  # the kernels: the biases start at 0
    assert live.codes[0] == replayed.codes[0], (live.codes, replayed.codes)


def _loss_tolerance(report, t: int) -> float:
    return next(e.tolerance for e in report.steps[t].leaves if e.kind == "loss")


def test_the_loss_allowance_after_the_first_failing_step_is_the_live_checks(l2_runs):
    """After the L2 term failed step 0, the loss's tolerance at step 1 is the live check's rule on both sides: the
    derived tolerance plus the parameters' allowance (the gradient's tolerance propagated through the optimizer,
    accumulated) times ``|g|``. Before, the replay's lacked the propagated part: 1.78e-05 where live allowed
    2.72e-05 (0.66 x), so a loss error between them passed live and failed the replay. Now the replay's is the
    live one within 3% (its own gradients, the L2 term's among them, and a norm bound of ``sum |g| a``), never
    below it; at step 0 both are the derived tolerance alone."""
    correct, live, replayed = l2_runs
    assert _loss_tolerance(replayed, 0) == pytest.approx(_loss_tolerance(live, 0), rel=1e-9)
    live_1, replayed_1 = _loss_tolerance(live, 1), _loss_tolerance(replayed, 1)
    assert live_1 <= replayed_1 <= 1.03 * live_1, (live_1, replayed_1)
    step = replayed.steps[1]
    derived = step.atol + step.rtol * abs(step.loss)  # the replay's whole tolerance before: 1.78e-05
    assert replayed_1 > 1.5 * derived and live_1 > 1.5 * derived  # the propagated part (SGD: lr x delta)
    assert _loss_tolerance(correct, 1) == pytest.approx(live_1, rel=0.03)
