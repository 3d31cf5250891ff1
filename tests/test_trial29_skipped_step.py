"""Trial 29 (issue #36): a step skipped by ``optax.apply_if_finite`` is no divergence of the reference.

A mixed-precision user's overflow batch gives a non-finite loss and gradients; ``apply_if_finite`` leaves the
parameters and the optimizer state as they were and counts the step (``notfinite_count``). ``verify`` stopped
there: "the reference run diverged (non-finite loss or parameters at step 2) ... no verdict ... lower --lr", and
``shardcheck record`` refused the run. Now such a step is a skipped step (``StepRecord.skipped``): the loss and
the gradients are compared by finiteness (both not finite matches, ``LeafError.finite``), the parameters, the
optimizer state and the counters as always, live and replayed; the report says it once (``skipped_step``). A
reference whose parameters go non-finite is still ``reference_diverged``.

The task: a float32 MLP under ``apply_if_finite(adam)``, 3 batches, a row of 3e38 in batch 1 (its logits
overflow to inf, the loss and every gradient are NaN).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.comparison.digest import skipped_steps
from shardcheck.parity.harness.non_finite import first_non_finite
from shardcheck.parity.harness.recorded import record_run

S = 2
SKIPPED = 1  # the overflow batch's step


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _task(skips: bool = True) -> shardcheck.Task:
    """The overflow task; ``skips``: its adam wrapped in ``apply_if_finite`` (else plain adam, whose parameters go
    NaN at the overflow step)."""
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.integers(0, 4, size=8).astype(np.int32)}
        for _ in range(3)
    ]
    x = batches[SKIPPED]["x"].copy()
    x[0, :] = 3.0e38  # the float32 logits overflow: loss and gradients NaN
    batches[SKIPPED]["x"] = x
    tx = optax.adam(1e-2)
    if skips:
        tx = optax.apply_if_finite(tx, max_consecutive_errors=3)
    return shardcheck.Task(model=MLP, optimizer=tx, loss_fn=loss_fn, batches=batches, name="overflow-mlp")


@nnx.jit
def _zeroed(model, optimizer, batch):
    """A faulty step: its non-finite gradients zeroed, so the optimizer applies an update (Adam's moments move it)
    where the reference's skips the step."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def _by_kind(record, kind):
    return [e for e in record.leaves if e.kind == kind]


@pytest.fixture(scope="module")
def task():
    return _task()


@require_devices(S)
def test_the_correct_step_passes_a_skipped_step_and_the_report_says_so(task):
    report = check_parity("dp", task, num_shards=S)
    assert report.verdict == "PASS" and report.ok and report.reference_diverged_at is None
    assert [r.skipped for r in report.steps] == [False, True, False]
    skipped = report.steps[SKIPPED]
    assert np.isnan(skipped.loss) and np.isnan(skipped.candidate_loss)
    by_finiteness = [e for e in skipped.leaves if e.finite is not None]
    assert {e.name for e in by_finiteness} == {"loss", *(f"grad {e.path}" for e in _by_kind(skipped, "grad"))}
    assert all(e.finite == (False, False) and e.ok and e.max_abs_err == 0 for e in by_finiteness)
    # the parameters, the optimizer state and the counters compared as always: the reference left them as they were
    assert all(e.reference_change == 0 for e in _by_kind(skipped, "param"))
    assert report.codes == ("parity", "skipped_step")
    note = report.diagnoses[1].message
    assert note == (
        "Step 1: the reference's loss and gradients are not finite and its optimizer left the parameters as they "
        "were (a step skipped by optax.apply_if_finite or a loss-scale check; no divergence); the candidate's loss "
        "and gradients are not finite there too and its update matches (the parameters, the optimizer state and "
        "the counters)."
    )
    assert "NaN in the candidate" not in report.diagnosis and "diverged" not in report.diagnosis
    out = report.to_dict()
    assert [s["skipped"] for s in out["per_step"]] == [False, True, False]
    assert out["codes"] == ["parity", "skipped_step"] and note in out["diagnosis"]


@require_devices(1)
def test_a_step_that_applies_its_update_where_the_reference_skipped_fails_at_the_parameters(task):
    report = check_parity(_zeroed, task, num_shards=S)
    assert report.verdict == "FAIL" and report.reference_diverged_at is None
    assert report.steps[0].ok and not report.steps[SKIPPED].ok
    first = report.steps[SKIPPED]
    assert first.skipped
    # its loss is not finite as the reference's (a match); its zeroed gradients are finite (a FAIL, said so)
    (loss,) = _by_kind(first, "loss")
    assert loss.finite == (False, False) and loss.ok
    grads = _by_kind(first, "grad")
    assert grads and all(e.finite == (False, True) and not e.ok for e in grads)
    params = _by_kind(first, "param")
    assert params and all(not e.ok and np.isfinite(e.max_abs_err) for e in params)
    assert all(e.reference_change == 0 and e.max_abs_err > 0 for e in params)
    counters = {e.path: e for e in _by_kind(first, "counter")}
    assert not counters["notfinite_count"].ok and counters["notfinite_count"].counts == (1, 0)
    assert "non_finite" not in report.codes and "skipped_step" in report.codes
    note = next(d for d in report.diagnoses if d.code == "skipped_step").message
    assert note.startswith(
        "Step 1: the reference's loss and gradients are not finite and its optimizer left the parameters as they "
        "were (a step skipped by optax.apply_if_finite or a loss-scale check; no divergence); the candidate's loss "
        "is not finite there too; its gradients are finite there, where the reference's are not; it applied an "
        "update where the reference skipped one: 4 of 4 parameters,"
    )
    assert "counter notfinite_count" in note
    assert report.localization.step == SKIPPED
    assert "grad head.bias: finite in the candidate's run only" in report.localization.text()
    assert "max abs err inf" not in report.diagnosis and "NaN" not in report.diagnosis


@require_devices(1)
def test_a_reference_whose_parameters_go_non_finite_is_still_no_verdict_and_not_recorded():
    plain = _task(skips=False)
    report = check_parity("simulation", plain, num_shards=S)
    assert report.reference_diverged_at == SKIPPED and report.verdict == "NO VERDICT"
    assert report.codes == ("reference_diverged",) and len(report.steps) == SKIPPED
    recording = record_run(plain, "simulation", num_shards=S)
    found = first_non_finite(recording)
    assert found is not None and found.step == SKIPPED and any(n.startswith("param ") for n in found.names)
    assert skipped_steps(recording) == ()


@require_devices(S)
def test_a_skipped_step_is_recorded_and_replayed_by_finiteness(task, tmp_path):
    recording = record_run(task, "dp", num_shards=S)
    assert skipped_steps(recording) == (SKIPPED,) and first_non_finite(recording) is None
    assert recording.save(tmp_path / "run.npz") > 0  # no longer refused
    passed = check_parity("dp", task, reference=recording)
    assert passed.verdict == "PASS" and passed.reference_diverged_at is None
    assert [r.skipped for r in passed.steps if r.step >= 0] == [False, True, False]
    note = next(d for d in passed.diagnoses if d.code == "skipped_step").message
    assert note.startswith("Step 1: the recording's loss and gradients are not finite and its optimizer left")
    assert "the candidate's loss and gradients are not finite there too and its update matches" in note
    failed = check_parity(_zeroed, task, reference=recording)
    assert failed.verdict == "FAIL" and failed.reference_diverged_at is None
    first = next(r for r in failed.steps if not r.ok)
    assert first.step == SKIPPED and first.skipped
    assert all(e.finite == (False, True) and not e.ok for e in _by_kind(first, "grad"))
    assert any(not e.ok for e in _by_kind(first, "param"))
    note = next(d for d in failed.diagnoses if d.code == "skipped_step").message
    assert "it applied an update where the recorded run skipped one" in note


@nnx.jit
def _applies_nan(model, optimizer, batch):
    """A faulty step: its optimizer skips the overflow step as the reference's does, but the step then writes the
    non-finite gradients into the parameters itself (only where they are not finite)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: jnp.where(finite, p, p - g), params, grads))
    return {"loss": loss, "grads": grads}


@require_devices(S)
def test_a_candidate_that_goes_non_finite_at_a_skipped_step_is_told_to_skip_it(task):
    """The helper's note: such a candidate read "the reference's nan ... The candidate's step computes a NaN or an
    infinity the reference's step does not", false where the reference computed one too and skipped the step."""
    report = check_parity(_applies_nan, task, num_shards=S)
    assert report.verdict == "FAIL" and report.steps[0].ok and report.steps[SKIPPED].skipped
    said = next(d for d in report.diagnoses if d.code == "non_finite").message
    assert said.startswith(
        "At step 1 the reference's loss and gradients are not finite too, and its optimizer skipped the step"
    )
    assert "Skip the update where the gradients are not finite, as the reference does" in said
    assert "the reference's step does not" not in said
