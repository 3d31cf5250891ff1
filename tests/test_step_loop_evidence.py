"""Issue #36: what the step loop's records are evidence of (``shardcheck.parity.harness.check._run_steps``).

1. The re-check of a late failure (the step re-run from the reference's pre-step state) is for a FIRST failure at
   t > 0: it tells a step that differs by itself from trajectories that drifted apart. After step 0 has failed the
   loop re-ran step 1 too, and that re-run stood for step 1: under Adam a loss x 4 from step 0 on moved the
   re-run's parameters (the reference's moments, a x 4 gradient) while the trajectory's matched (trial 46), and a
   fault at step 0 alone re-ran step 1 as matching, so the report read ``diverged_at`` 1 and every later step as
   passing. Now the trajectory's record stands for every step after an earlier failure; the re-run is kept beside
   it (``StepRecord.rerun``), evidence of the step from equal inputs only (trial 16's factor at another batch's
   weight, said "run from the reference's state"). A fault that starts at step 2 is still re-checked there and
   localized "from the reference's pre-step state".
2. ``optax.apply_if_finite``'s skip (its ``notfinite_count`` and ``total_notfinite`` count the step, its inner
   state and the parameters as they were) is the candidate's own at the update check, as a loss-scale check's
   skip (every leaf as it was) is since trial 48: it was not (``skipped_by_candidate`` False) and passed only
   because the task's optimizer, rerun on the NaN gradients, skipped again. At a step the reference skipped the
   optimizer is no longer rerun; a step that updates where the reference skipped still FAILs with the skip named.
3. A context-parallel step that divides each device's loss and gradient by its own block's token count is named
   ``normalization`` from the loss value (trial 45); the sentence said "its gradients too" without a check. The
   returned gradients are now compared with the gradient of the mean of per-block means, leaf by leaf, and the
   sentence says which bear the cause out (trial 45's own task: ``tests/test_trial45_context.py``).

The task: an MLP 8 -> 16 -> 4 (tanh), mean squared error, Adam(1e-2), 4 batches of 8 rows; the candidates are
user steps on one device whose loss is x 4 from a given step on (or at that step alone). For 2: the MLP with a
ReLU under ``apply_if_finite(adam)``, 3 of those batches, a row of 3e38 in batch 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity

FACTOR = 4.0


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.tanh(self.l1(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@functools.cache
def _task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
        for _ in range(4)
    ]
    return shardcheck.Task(
        model=MLP, optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=batches, name="mlp"
    )


def _scaled_from(start: int, only: bool = False):
    """A user step whose loss is x 4 from step ``start`` on (``only``: at that step alone)."""

    @nnx.jit
    def step(model, optimizer, batch):
        t = optimizer.step[...]
        factor = jnp.where((t == start) if only else (t >= start), FACTOR, 1.0)
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch) * factor)(model)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


def _params(record):
    return [e for e in record.leaves if e.kind == "param"]


def test_the_correct_step_passes_with_every_record_its_own():
    report = check_parity(_scaled_from(99), _task())  # x 4 from a step it never reaches
    assert report.verdict == "PASS" and report.ok
    assert [r.synchronized for r in report.steps] == [False] * 4 and report.diverged_at is None


def test_a_fault_from_step_0_keeps_the_trajectory_s_record_at_a_later_step():
    report = check_parity(_scaled_from(0), _task())
    assert report.verdict == "FAIL" and "scaled" in report.codes
    # every record is the trajectory's: step 1, re-run from the reference's state, had stood for step 1
    assert [r.synchronized for r in report.steps] == [False] * 4
    assert [r.ok for r in report.steps] == [False] * 4 and report.rerun_after_failure == ()
    # Adam normalizes the constant factor away along the candidate's own trajectory: its parameters match at
    # every step; the re-run, from the reference's moments with a x 4 gradient, moved them, and is kept beside
    assert all(e.ok for r in report.steps for e in _params(r))
    rerun = report.steps[1].rerun
    assert rerun.synchronized and rerun.step == 1 and any(not e.ok for e in _params(rerun))
    assert [r.rerun is None for r in report.steps] == [True, False, True, True]
    loc = report.localization
    assert (loc.step, loc.stage, loc.synchronized) == (0, "forward", False)
    assert loc.form is not None and loc.form.factor == pytest.approx(FACTOR, rel=1e-3)
    assert "(run from the reference's pre-step state)" not in report.diagnosis
    assert "re-run" not in str(report)


def test_a_fault_at_step_0_alone_reads_the_later_steps_from_the_trajectory():
    report = check_parity(_scaled_from(0, only=True), _task())
    assert report.verdict == "FAIL" and report.localization.step == 0
    # the re-run of step 1 matched (its step is correct) and the loop read the trajectories as diverged there,
    # every later step from the reference's state and passing; the candidate's own parameters differ after step 0
    assert report.diverged_at is None and "diverged_trajectory" not in report.codes
    assert [r.synchronized for r in report.steps] == [False] * 4
    assert all(e.ok for e in _params(report.steps[0]))  # the moments took the factor; the update did not yet
    assert report.steps[
        1
    ].rerun.ok  # from equal inputs its step 1 is the reference's: kept beside, not for it
    assert all(any(not e.ok for e in _params(r)) for r in report.steps[1:])
    assert report.worst_by_kind()["param"].step > 0 and not report.worst_by_kind()["param"].ok


def test_a_fault_from_step_2_is_re_checked_there_and_localized_from_the_reference_state():
    report = check_parity(_scaled_from(2), _task())
    assert report.verdict == "FAIL" and "scaled" in report.codes
    assert [r.ok for r in report.steps] == [True, True, False, False]
    # the first failure is re-run from the reference's pre-step state and stands for step 2; step 3 is the
    # trajectory's own
    assert [r.synchronized for r in report.steps] == [False, False, True, False]
    assert report.rerun_after_failure == () and report.diverged_at is None
    loc = report.localization
    assert (loc.step, loc.stage, loc.synchronized) == (2, "forward", True)
    assert loc.text().startswith("First difference at step 2 (run from the reference's pre-step state)")
    assert loc.form is not None and loc.form.factor == pytest.approx(FACTOR, rel=1e-3)


# 2. optax.apply_if_finite's skip at the update check

SKIPPED = 1  # the step whose batch holds a label of inf: the loss and every gradient not finite


class ReluMLP(MLP):
    def __call__(self, x):
        return self.head(nnx.relu(self.l1(x)))


@functools.cache
def _overflow_task() -> shardcheck.Task:
    """A ReLU MLP under ``apply_if_finite(adam)``, 3 batches, a row of 3e38 in batch 1: its hidden units overflow
    to inf, its outputs are NaN (inf - inf), so are the loss and every gradient; the reference skips the step."""
    batches = [dict(b) for b in _task().batches[:3]]
    x = batches[SKIPPED]["x"].copy()
    x[0, :] = 3.0e38
    batches[SKIPPED]["x"] = x
    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
    return shardcheck.Task(model=ReluMLP, optimizer=tx, loss_fn=loss_fn, batches=batches, name="overflow-mlp")


@nnx.jit
def _plain(model, optimizer, batch):
    """The correct step: the task's optimizer (apply_if_finite) skips the step itself."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


@nnx.jit
def _zeroed(model, optimizer, batch):
    """Its gradients that are not finite zeroed: apply_if_finite sees finite ones and Adam steps where the
    reference skipped."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def _skip_states():
    """apply_if_finite(adam)'s flat ``(params, opt_state)`` before and after a step on gradients that are not
    finite, the gradients, and the state a step that applied zeroed gradients leaves."""
    from shardcheck.parity.comparison.live import flatten_state

    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
    params = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.nan, 2.0]), "b": jnp.ones(2)}
    _, skipped = tx.update(grads, state, params)
    zero = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)
    _, stepped = tx.update(zero, state, params)
    flat = flatten_state(params)
    return grads, (flat, flatten_state(state)), (flat, flatten_state(skipped)), (flat, flatten_state(stepped))


def test_apply_if_finite_s_skip_is_the_candidate_s_own():
    from shardcheck.parity.harness.optimizer_rerun import skipped_by_candidate

    grads, before, skipped, stepped = _skip_states()
    assert int(skipped[1]["notfinite_count"]) == 1 and not bool(skipped[1]["last_finite"])
    # its counters count the skip, its inner state and the parameters are as they were: a skip (was False)
    assert skipped_by_candidate(grads, skipped, before)
    assert skipped_by_candidate(grads, before, before)  # a loss-scale check's skip: every leaf as it was
    # Adam stepped on zeroed gradients (its moments and count moved), a count of two, its inner count moved
    assert not skipped_by_candidate(grads, stepped, before)
    twice = (skipped[0], {**skipped[1], "notfinite_count": skipped[1]["notfinite_count"] + 1})
    assert not skipped_by_candidate(grads, twice, before)
    moved = (skipped[0], {**skipped[1], "inner_state.0.count": stepped[1]["inner_state.0.count"]})
    assert not skipped_by_candidate(grads, moved, before)
    assert not skipped_by_candidate(jax.tree.map(jnp.nan_to_num, grads), skipped, before)  # finite gradients


def test_a_step_apply_if_finite_skipped_passes_without_the_optimizer_rerun(monkeypatch):
    from shardcheck.parity.harness import optimizer_rerun

    reruns = []
    rerun_within = optimizer_rerun._rerun_within
    monkeypatch.setattr(optimizer_rerun, "_rerun_within", lambda *a: reruns.append(a) or rerun_within(*a))
    report = check_parity(_plain, _overflow_task())
    assert report.verdict == "PASS" and report.ok, report.diagnosis
    assert [r.skipped for r in report.steps] == [False, True, False]
    assert [r.update_checked for r in report.steps] == [True, True, True]
    assert len(reruns) == 2  # steps 0 and 2: the skipped step is the candidate's own, not rerun
    assert report.codes == ("parity", "skipped_step")


def test_a_step_that_updates_where_the_reference_skipped_fails_with_the_skip_named():
    report = check_parity(_zeroed, _overflow_task())
    assert report.verdict == "FAIL" and report.steps[0].ok and not report.steps[SKIPPED].ok
    counters = {e.path: e for e in report.steps[SKIPPED].leaves if e.kind == "counter"}
    assert not counters["notfinite_count"].ok and counters["notfinite_count"].counts == (1, 0)
    note = next(d for d in report.diagnoses if d.code == "skipped_step").message
    assert "it applied an update where the reference skipped one" in note
    assert report.localization.step == SKIPPED


# 3. a per-block token normalization named from the loss value: what its gradients say (trial 45)


@pytest.fixture(scope="module")
def cp_mesh():
    from shardcheck import make_mesh

    return make_mesh({"data": 2, "seq": 2})


@require_devices(4)
def test_a_per_block_normalization_says_which_gradients_bear_it_out(cp_mesh):
    """Trial 45's context-parallel LM (``tests/test_trial45_context.py``): each device divides its gradient and
    its loss by its own block's token count. The loss names the cause; the sentence said "its gradients too",
    never checked. Now the leaves only a device's own block's tokens reach (the head, the queries' kernel) are
    the gradient of the mean of per-block means; those the other blocks' tokens reach through the gathered keys
    and values are not."""
    from test_trial45_context import _task as cp_task
    from test_trial45_context import make_step as cp_step

    report = check_parity(cp_step("per_shard_mean"), cp_task(), mesh=cp_mesh, steps=1)
    first = report.steps[0]
    assert first.matches == ("per_shard_mean_value",)
    agree, differ = first.token_grads
    assert agree == ("head.bias", "head.kernel", "q.kernel")
    assert differ == ("embed.embedding", "k.kernel", "pos", "v.kernel")
    said = next(d.message for d in report.diagnoses if d.code == "normalization")
    assert (
        "divided its loss sum by its own token count before the shards were averaged. Its gradients bear it out "
        "on 3 of 7 leaves, that mean's gradient within tolerance (head.bias, head.kernel, q.kernel); the other 4 "
        "(embed.embedding, k.kernel, pos, v.kernel) are not, as where each device divided a gradient that holds "
        "the terms the other blocks' tokens send back" in said
    )
    assert "its gradients too" not in said
    # the loss divided before the gradient: the whole step reproduced, no reading from the loss value
    whole = check_parity(cp_step("loss_divided"), cp_task(), mesh=cp_mesh, steps=1)
    assert whole.steps[0].matches == ("per_shard_mean",) and whole.steps[0].token_grads is None
    said = next(d.message for d in whole.diagnoses if d.code == "normalization")
    assert said.startswith(
        "At step 0 the step reproduces the mean of per-shard means (parameters and optimizer"
    )


def test_the_per_block_sentence_says_what_the_gradients_show():
    from shardcheck.parity.diagnosis.rules import _per_block_gradients

    assert _per_block_gradients(None) == (
        "That cause is read from the loss value alone (no gradient was compared with that mean's)."
    )
    assert _per_block_gradients((("a", "b"), ())) == (
        "Its gradients bear it out: all 2 gradient leaves are that mean's gradient, within tolerance."
    )
    none = _per_block_gradients(((), ("a", "b", "c")))
    assert none.startswith(
        "That cause is read from the loss value alone: none of the 3 gradient leaves is the gradient of that "
        "mean of per-block means"
    )
