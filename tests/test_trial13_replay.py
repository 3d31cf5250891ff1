"""A replay reads what a live check reads (issue #36, trial 13: a two-tower CLIP model on mesh data=4).

- A gradient off by x1/S (a pmean after a psum) or x S, applied through an optimizer blind to its scale (a
  global-norm clip that binds), leaves only the returned gradients differing: live, the hypotheses add
  ``scale_blind`` and the rules read the factor (``averaged_twice``, ``summed``); a replay now computes the same
  blindness from the candidate's pre-step state at the localized step, so its codes are the live ones. Where the
  optimizer is not blind (plain SGD) the gradients are not the ones applied, live and replayed (``grads_differ``).
- A run that goes NaN: ``record`` writes no recording of it (exit 2, the step and the leaves named, ``--steps``
  to record the finite steps before it); a replay against such a recording compares the steps before it and
  gives no verdict (``reference_diverged``, as a live check whose reference diverges), saying whether the
  replay went non-finite too; it never says the recording is finite there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Candidate, Task, check_parity
from shardcheck.cli import main
from shardcheck.parity.harness.non_finite import first_non_finite, refusal
from shardcheck.parity.harness.recorded import record_run

S = 4


class _Linear(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(3, 2, rngs=rngs)


def _loss(model, batch):  # a negative weight: NaN (a NaN input is refused by Task)
    return jnp.mean((model.fc(batch["x"]) - batch["y"]) ** 2 * jnp.sqrt(batch["w"]))


def _batches(nan_at=None):
    rng = np.random.default_rng(0)
    out = []
    for t in range(3):
        w = np.ones((8, 1), np.float32)
        if t == nan_at:
            w[2] = -1.0
        out.append(
            {
                "x": rng.normal(size=(8, 3)).astype(np.float32),
                "y": rng.normal(size=(8, 2)).astype(np.float32),
                "w": w,
            }
        )
    return out


def _task(tx, nan_at=None) -> Task:
    return Task(model=lambda: _Linear(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=_batches(nan_at))


BLIND = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))  # binds for g, S g and g / S
PLAIN = optax.sgd(0.1)


def _step(returned: float, applied: float, clean: bool = False) -> Candidate:
    """A user step that applies ``applied`` x its gradient and returns ``returned`` x it (``clean``: it
    reads a negative weight as its magnitude)."""

    def step(model, optimizer, batch):
        if clean:
            batch = {**batch, "w": jnp.abs(batch["w"])}
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, jax.tree.map(lambda g: g * applied, grads))
        return {"loss": loss, "grads": jax.tree.map(lambda g: g * returned, grads)}

    return Candidate(name="mine", step=step, num_shards=S)


@pytest.fixture(scope="module")
def blind_recording():
    return record_run(_task(BLIND), _step(1.0, 1.0), num_shards=S)


@require_devices(1)
@pytest.mark.parametrize(("factor", "code"), [(1 / S, "averaged_twice"), (S, "summed")])
def test_a_scaled_gradient_under_a_binding_clip_reads_alike_live_and_replayed(blind_recording, factor, code):
    task = _task(BLIND)
    live = check_parity(_step(factor, factor), task, num_shards=S)
    replay = check_parity(_step(factor, factor), task, reference=blind_recording)
    for report in (live, replay):
        assert report.verdict == "FAIL"
        assert code in report.codes and "grads_differ" not in report.codes
        first = next(r for r in report.steps if not r.ok)
        assert first.step == 0 and "scale_blind" in first.matches
        assert {e.kind for e in first.leaves if not e.ok} == {"grad"}
        found = next(d for d in report.diagnoses if d.code == code)
        assert f"gradients are {factor:.4g} x the reference's" in found.message
        assert "an optimizer blind to the gradient's scale (global-norm clipping that binds)" in found.message
    assert check_parity(_step(1.0, 1.0), task, reference=blind_recording).verdict == "PASS"


@require_devices(1)
def test_gradients_not_applied_under_an_optimizer_that_sees_their_scale_are_not_scale_blind():
    task = _task(PLAIN)
    recording = record_run(task, _step(1.0, 1.0), num_shards=S)
    candidate = _step(1 / S, 1.0)  # returns a quarter of the gradient it applies
    live = check_parity(candidate, task, num_shards=S)
    replay = check_parity(candidate, task, reference=recording)
    for report in (live, replay):
        first = next(r for r in report.steps if not r.ok)
        assert {e.kind for e in first.leaves if not e.ok} == {"grad"}
        assert "scale_blind" not in first.matches
        assert "grads_differ" in report.codes and "averaged_twice" not in report.codes


@pytest.fixture(scope="module")
def nan_recording():
    """The correct step on a task whose batch 1 holds a negative weight: loss NaN from step 1."""
    return record_run(_task(PLAIN, nan_at=1), _step(1.0, 1.0), num_shards=S)


@require_devices(1)
def test_the_first_non_finite_step_of_a_recording(nan_recording, blind_recording):
    found = first_non_finite(nan_recording)
    assert found.step == 1 and found.names[0] == "loss"
    assert found.leaves_text() == "loss, 2 grad leaves and 2 param leaves (5 leaves in all)"
    assert first_non_finite(nan_recording, steps=1) is None
    assert first_non_finite(blind_recording) is None
    assert refusal("shardcheck record", found, "run.npz").endswith("with --steps 1.")


@require_devices(1)
def test_saving_a_recording_that_went_non_finite_raises_as_record_refuses(nan_recording, tmp_path):
    """record_run kept the NaN run in memory and Recording.save wrote it silently (the command refused it)."""
    out = tmp_path / "run.npz"
    with pytest.raises(ValueError) as err:
        nan_recording.save(out)
    assert str(err.value).startswith(
        "Recording.save: the recorded run went non-finite (NaN or infinity) at step 1, in loss, 2 grad leaves and "
        f"2 param leaves (5 leaves in all), first loss; nothing was written to {out}"
    )
    assert str(err.value).endswith("before it with record_run(..., steps=1).") and not out.exists()
    finite = record_run(_task(PLAIN, nan_at=1), _step(1.0, 1.0), num_shards=S, steps=1)
    assert finite.save(out) > 0 and out.exists()


@require_devices(1)
def test_a_replay_bitwise_identical_to_a_nan_recording_is_no_verdict_as_live(nan_recording):
    task = _task(PLAIN, nan_at=1)
    live = check_parity(_step(1.0, 1.0), task, num_shards=S)
    replay = check_parity(_step(1.0, 1.0), task, reference=nan_recording)
    for report in (live, replay):
        assert (report.verdict, report.ok, report.reference_diverged_at) == ("NO VERDICT", False, 1)
        assert report.codes[0] == "reference_diverged"
        assert [r.step for r in report.steps] == [0] and report.steps[0].ok
        assert "where the reference's are finite" not in report.diagnosis
    text = replay.diagnoses[0].message
    assert text.startswith(
        "The recording went non-finite (NaN or infinity) at step 1, in loss, 2 grad leaves and 2 param leaves "
        "(5 leaves in all), first loss, and so did the replay, bitwise identical to it from there"
    )
    assert "steps 1 and later were not compared (step 0 was compared: it matches)" in text
    assert replay.replay.bitwise
    # the replay stays finite where the recording is not: no verdict either, and said so
    finite = check_parity(_step(1.0, 1.0, clean=True), task, reference=nan_recording)
    assert (finite.verdict, finite.reference_diverged_at) == ("NO VERDICT", 1)
    assert "first loss, while the replay stays finite there" in finite.diagnoses[0].message
    assert not finite.replay.bitwise


@require_devices(1)
def test_a_replay_that_goes_nan_against_a_finite_recording_still_fails():
    task = _task(PLAIN, nan_at=1)
    finite = record_run(task, _step(1.0, 1.0, clean=True), num_shards=S)
    report = check_parity(_step(1.0, 1.0), task, reference=finite)
    assert (report.verdict, report.reference_diverged_at) == ("FAIL", None)
    assert (
        "reference_diverged" not in report.codes and "The recording went non-finite" not in report.diagnosis
    )
    assert report.localization.step == 1 and not report.steps[1].ok


NAN_TASK = """
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
import shardcheck


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(3, 2, rngs=rngs)


def loss_fn(model, batch):
    return jnp.mean((model.fc(batch["x"]) - batch["y"]) ** 2 * jnp.sqrt(batch["w"]))


rng = np.random.default_rng(0)
batches = [{"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32),
            "w": np.ones((8, 1), np.float32)} for _ in range(3)]
batches[1]["w"][2] = -1.0
task = shardcheck.Task(model=lambda: Linear(nnx.Rngs(0)), optimizer=optax.sgd(0.1), loss_fn=loss_fn,
                       batches=batches, name="nan-at-1")


def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}
"""


@require_devices(2)
def test_record_refuses_a_run_that_went_non_finite_and_records_the_steps_before_it(tmp_path, capsys):
    f = tmp_path / "nan_task.py"
    f.write_text(NAN_TASK)
    args = ["record", "--task", f"{f}:task", "--candidate", f"{f}:step", "--devices", "2"]
    out = tmp_path / "run.npz"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists()
    assert err.startswith(
        "error: shardcheck record: the recorded run went non-finite (NaN or infinity) at step 1, in loss, 2 grad "
        f"leaves and 2 param leaves (5 leaves in all), first loss; nothing was written to {out}"
    )
    assert err.rstrip().endswith("or record the 1 finite step(s) before it with --steps 1.")
    assert main([*args, "--steps", "1", "--out", str(out)]) == 0 and out.exists()
    assert main(["verify", "--task", f"{f}:task", "--candidate", f"{f}:step", "--against", str(out)]) == 0


@require_devices(1)
def test_a_candidate_that_goes_nan_against_a_finite_reference_is_non_finite_live_and_replayed(
    blind_recording,
):
    """A replay read the NaN parameters' error as inf (the digests' 'nan' evidence), so no leaf was NaN and the
    report said loss_only; it is non_finite, as live."""
    task = _task(BLIND)

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, jax.tree.map(lambda g: g * jnp.sqrt(-1.0 + 0 * g), grads))
        return loss

    candidate = Candidate(name="mine", step=step, num_shards=S)
    for report in (check_parity(candidate, task), check_parity(candidate, task, reference=blind_recording)):
        assert report.verdict == "FAIL" and report.codes == ("non_finite",)
        assert report.diagnoses[0].message.startswith(
            "The candidate's step produced non-finite values at step 0 where the reference's are finite: NaN or "
            "infinity, first in param fc.bias, param fc.kernel (2 leaves in all)."
        )
