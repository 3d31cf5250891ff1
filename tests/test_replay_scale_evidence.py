"""A replay's verdict reads the scale evidence from the digests (trial 57, A1).

A TF32 run (emulated: every matmul's operands rounded to a 10-bit mantissa) recorded, then a step that sums its
gradients where a mean was due replayed against it in float32: the comparison assumes TF32's rounding on every
term of the derived rule (rtol 1.41 on the trial's 1280-term MLP), under which no factor can show, and both a
sum for a mean and a mean taken twice replayed as PASS with a note. Now such a replay is CANNOT VERIFY (exit 1),
as a live check whose tolerance cannot tell a factor S is; a float32 recording, whose digests show the factors,
still FAILs the faulty steps by name and PASSes the right one.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.diagnosis.scale_evidence import scale_shown
from shardcheck.parity.harness.recorded import record_run
from shardcheck.parity.tolerance.matmul import rounded_loss
from shardcheck.steps import Candidate
from shardcheck.steps.sharded import mesh_step
from shardcheck.tasks.digits import load_digits

S = 4


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 256, rngs=rngs)
        self.l2 = nnx.Linear(256, 256, rngs=rngs)
        self.l3 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def loss_fn(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.fixture(scope="module")
def task():
    x, y = load_digits()
    batches = [(x[i : i + 128], y[i : i + 128]) for i in range(0, 2 * 128, 128)]
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=optax.adam(1e-3), loss_fn=loss_fn, batches=batches
    )


def candidate(mesh, policy="float32", factor=1.0):
    """The dp step with its matmuls rounded to ``policy`` and its gradient x ``factor`` (S: a sum for a mean)."""
    rounded = rounded_loss(loss_fn, None if policy == "float32" else policy)

    def step(model, optimizer, batch):
        return mesh_step(
            "dp", lambda m, b: factor * rounded(m, b), model, optimizer, batch, mesh, with_grads=True
        )

    return Candidate(f"dp at {policy} x{factor:g}", step, S)


@pytest.fixture(scope="module")
def mesh():
    return shardcheck.make_mesh(S)


@require_devices(S)
@pytest.mark.parametrize("factor", [S, 1 / S, 1.0])
def test_against_a_tf32_recording_no_step_passes_unless_the_weak_check_is_accepted(task, mesh, factor):
    """The right step (x1) is CANNOT VERIFY, its text the cause and the fixes; a loss and gradient x4 or x1/4
    FAIL (the loss shows them) or are CANNOT VERIFY, never PASS; accept_weak passes the right one, saying so."""
    recording = record_run(task, candidate(mesh, "tf32"), mesh=mesh, matmul_precision="tf32")
    report = check_parity(candidate(mesh, factor=factor), task, reference=recording, mesh=mesh)
    assert report.matmul_precision == "tf32" and not report.ok
    if factor != 1.0:
        assert report.verdict in ("FAIL", "CANNOT VERIFY"), str(report)
        return
    assert report.verdict == "CANNOT VERIFY" and report.codes[0] == "cannot_verify", str(report)
    assert scale_shown(report.steps) == (False, False)
    assert report.cannot_verify.startswith(
        "Cannot verify against this recording: in no replayed step would a x4 or x1/4 error (a sum for a mean, a "
        "mean taken twice) move a recorded leaf beyond its tolerance, so such an error would pass: its tolerance "
        "assumes tf32 matmul rounding"
    )
    accepted = check_parity(candidate(mesh), task, reference=recording, mesh=mesh, accept_weak=True)
    assert accepted.verdict == "PASS (weak check accepted)" and accepted.weak_accepted.startswith(
        "Cannot verify"
    )


@require_devices(S)
@pytest.mark.parametrize(("factor", "code"), [(S, "scaled"), (1 / S, "scaled"), (1.0, None)])
def test_against_a_float32_recording_the_digests_show_both_factors(task, mesh, factor, code):
    recording = record_run(task, candidate(mesh), mesh=mesh)
    report = check_parity(candidate(mesh, factor=factor), task, reference=recording, mesh=mesh)
    if code is None:
        assert report.verdict.startswith("PASS") and report.cannot_verify is None, str(report)
        assert scale_shown(report.steps) == (True, True)
        return
    assert report.verdict == "FAIL" and report.codes[0] == code, str(report)


@require_devices(S)
def test_a_tf32_run_recorded_as_float32_names_the_recordings_precision(task, mesh):
    """Trial 57 B4: a TF32 run recorded without --matmul-precision, replayed with the right float32 step, FAILs
    (the recording claims float32) as a bfloat16 all-reduce, its other reading a live flag that changes nothing
    of a recording. The reading now names the recording's own precision and how to record it."""
    recording = record_run(task, candidate(mesh, "tf32"), mesh=mesh)  # claims float32
    report = check_parity(candidate(mesh), task, reference=recording, mesh=mesh)
    assert report.verdict == "FAIL" and report.codes[0] == "low_precision_reduction", str(report)
    said = report.diagnoses[0].message
    assert (
        "a recording whose matmuls rounded their operands more than it says: a GPU's TF32 run recorded as float32"
        in said
    )
    assert "record --matmul-precision tf32" in said and "is checked with --matmul-precision tf32" not in said


def gradient_scaled(mesh, factor):
    """A loss-only dp step whose gradient is ``factor`` x the reference's while its loss is the reference's
    (``loss + (factor - 1) (loss - stop_gradient(loss))``): a sum for a mean that a binding clip hides."""

    def scaled(m, b):
        value = loss_fn(m, b)
        return value + (factor - 1.0) * (value - jax.lax.stop_gradient(value))

    def step(model, optimizer, batch):
        return mesh_step("dp", scaled, model, optimizer, batch, mesh, with_grads=False)

    return Candidate(f"dp x{factor:g} loss only", step, S)


@require_devices(S)
@pytest.mark.parametrize("clip", [1e-3, None], ids=["binding clip", "no clip"])
def test_a_binding_clip_hides_a_sum_for_a_mean_from_a_replay_as_from_a_live_check(task, mesh, clip):
    """Trial 58: under a clip that binds at every step a loss-only step x4 replayed as a PASS (exit 0), where the
    live check is CANNOT VERIFY. The replay reads what the optimizer takes of x4 at its own gradient norm (1, both
    clipped): CANNOT VERIFY, the clip named with the fix; without the clip the x4 FAILs both ways."""
    tx = optax.adam(1e-3) if clip is None else optax.chain(optax.clip_by_global_norm(clip), optax.adam(1e-3))
    clipped = dataclasses.replace(task, optimizer=tx)
    recording = record_run(clipped, gradient_scaled(mesh, 1.0), mesh=mesh)
    assert recording.meta["global_clip"] == clip
    live = check_parity(gradient_scaled(mesh, S), clipped, mesh=mesh)
    replayed = check_parity(gradient_scaled(mesh, S), clipped, reference=recording, mesh=mesh)
    if clip is None:
        assert live.verdict == replayed.verdict == "FAIL", (str(live), str(replayed))
        return
    assert live.verdict == replayed.verdict == "CANNOT VERIFY", (str(live), str(replayed))
    assert "the task's optimizer clips the gradient's global norm to 0.001, which, where it binds" in (
        replayed.cannot_verify
    )


@require_devices(S)
def test_tolerances_the_user_set_accept_a_weak_replay_as_live(task, mesh):
    """Trial 58: --rtol 10 read "PASS (weak check accepted)" live and a plain "PASS" replayed; both accept it."""
    recording = record_run(task, candidate(mesh), mesh=mesh)
    live, replayed = (
        check_parity(candidate(mesh, factor=S), task, mesh=mesh, rtol=10.0, **r)
        for r in ({}, {"reference": recording})
    )
    assert live.verdict == replayed.verdict == "PASS (weak check accepted)", (str(live), str(replayed))
    assert "the tolerances set (rtol=10) are wider than a factor's change" in replayed.weak_accepted
