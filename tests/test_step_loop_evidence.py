"""Issue #36: what the step loop's records are evidence of (``shardcheck.parity.harness.check._run_steps``).

1. The re-check of a late failure (the step re-run from the reference's pre-step state) is for a FIRST failure at
   t > 0: it tells a step that differs by itself from trajectories that drifted apart. After step 0 has failed the
   loop re-ran step 1 too, and that re-run stood for step 1: under Adam a loss x 4 from step 0 on moved the
   re-run's parameters (the reference's moments, a x 4 gradient) while the trajectory's matched (trial 46), and a
   fault at step 0 alone re-ran step 1 as matching, so the report read ``diverged_at`` 1 and every later step as
   passing. Now no step is re-run after an earlier failure; a fault that starts at step 2 is still re-checked
   there and localized "from the reference's pre-step state".

The task: an MLP 8 -> 16 -> 4 (tanh), mean squared error, Adam(1e-2), 4 batches of 8 rows; the candidates are
user steps on one device whose loss is x 4 from a given step on (or at that step alone).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
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


def test_a_fault_from_step_0_is_not_re_run_at_a_later_step():
    report = check_parity(_scaled_from(0), _task())
    assert report.verdict == "FAIL" and "scaled" in report.codes
    # no step re-run from the reference's state: step 1 had been, and stood for the trajectory's step 1
    assert [r.synchronized for r in report.steps] == [False] * 4
    assert [r.ok for r in report.steps] == [False] * 4 and report.rerun_after_failure == ()
    # Adam normalizes the constant factor away along the candidate's own trajectory: its parameters match at
    # every step (the re-run, from the reference's moments with a x 4 gradient, moved them)
    assert all(e.ok for r in report.steps for e in _params(r))
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
