"""bfloat16-compute recordings and factors read within rounding (issue #36, trial 8).

- A recording stores the compute dtype read from the model's layers as a live check reads it; a correct
  bfloat16-compute step replayed against it PASSes, and a planted learning rate x4 FAILs at the optimizer stage
  with the factor 4, live and replayed.
- A factor fits a leaf when every element lies within the leaf's rounding of it (form.factor_within): a real
  factor under bfloat16 noise is named, a non-constant difference is not, and the rules claim no factor the
  form refutes.
- The rounding-level note is absent for SGD with nonzero true gradients.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest
from flax import nnx

from shardcheck import Candidate, check_parity
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form, factor_within, fit_form
from shardcheck.parity.diagnosis.rules import diagnose
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps.reference import reference_step
from shardcheck.tasks.digits import digits_task

LR = 0.05


def _task(steps: int = 2):
    return digits_task(
        hidden=8, optimizer=optax.sgd(LR), batch_size=16, steps=steps, compute_dtype="bfloat16"
    )


def _step_at(scale: float) -> Candidate:
    def make(model, optimizer):
        mine = nnx.Optimizer(model, optax.sgd(scale * LR), wrt=nnx.Param)
        nnx.update(mine, nnx.state(optimizer))
        return mine

    task = _task()

    def step(model, optimizer, batch):
        out = reference_step(task.loss_fn, model, optimizer, batch)
        return {"loss": out.loss, "grads": out.grads}

    return Candidate(name="mine", step=step, make_optimizer=make)


@pytest.fixture(scope="module")
def bf16_recording():
    return record_run(_task(), "dp", num_shards=2)


def test_a_recording_holds_the_compute_dtype_and_a_correct_bf16_replay_passes(bf16_recording):
    assert bf16_recording.meta["compute_dtype"] == "bfloat16"
    assert bf16_recording.meta["tolerance_dtype"] == "float32"
    report = check_parity("dp", _task(), reference=bf16_recording)
    assert report.ok, report
    assert any("low-precision compute rounding (recorded bfloat16" in n for n in report.replay.notes)


def test_an_lr_x4_fails_at_the_optimizer_stage_with_factor_4_live_and_replayed():
    mine = record_run(_task(3), _step_at(1.0), num_shards=1)  # a correct user step, recorded
    assert check_parity(_step_at(1.0), _task(3), reference=mine).ok
    for report in (
        check_parity(_step_at(4.0), _task(3), num_shards=1),
        check_parity(_step_at(4.0), _task(3), reference=mine),
    ):
        assert not report.ok
        where = report.localization
        assert (where.step, where.stage) == (0, "optimizer")
        assert where.form.kind == "factor"
        assert where.form.factor == pytest.approx(4.0, rel=0.02)
        # SGD, nonzero true gradients: the diverged candidate's parameter drift had made every leaf's gradient
        # "at rounding level" at step 2 (3 leaves, the drift term in the noise that tells it)
        assert "rounding_level" not in report.codes
        assert not any(r.unresolved for r in report.steps)


def test_a_factor_fits_within_the_leafs_rounding_and_a_non_factor_does_not():
    rng = np.random.default_rng(0)
    dr = rng.normal(size=400)
    tol = 0.02
    noisy = 4.0 * dr + rng.uniform(-tol, tol, 400) * 4 - rng.uniform(-tol, tol, 400)
    f, lo, hi = factor_within(dr, noisy, tol)
    assert f == pytest.approx(4.0, rel=0.01) and lo < 3.92 and hi > 4.08  # spread past FIT_RTOL, still 4
    assert factor_within(dr, noisy, None) is None  # without the tolerance: no factor
    form = fit_form({"w": np.zeros(400)}, {"w": dr}, {"w": noisy}, update=False, tol={"w": tol})
    assert (form.kind, round(form.factor, 1)) == ("factor", 4.0)
    # one shard's rows in place of the batch's: a difference of the values' own size, no factor at any rounding
    local = 0.14 * dr + rng.normal(scale=0.3, size=400)
    assert factor_within(dr, local, tol) is None
    assert fit_form({}, {"w": dr}, {"w": local}, update=False, tol={"w": tol}).kind == "none"
    # a leaf at rounding level (an attention key bias's gradient, its noise x S) fits any factor: the others name it
    key = rng.uniform(-tol, tol, 8)
    form = fit_form(
        {},
        {"w": dr, "key": key},
        {"w": noisy, "key": 4 * rng.uniform(-tol, tol, 8)},
        update=False,
        tol={"w": tol, "key": tol},
    )
    assert (form.kind, round(form.factor, 1), form.leaves) == ("factor", 4.0, 2)
    # a ratio around 1 within rounding is no factor
    assert factor_within(dr, dr + rng.uniform(-tol, tol, 400), tol) is None


def _grad_record(form: Form) -> StepRecord:
    # conv1's gradient: median ratio 0.1422 whose wide rounding tolerance would keep it "constant"
    bad = LeafError(0, "grad", "conv1.kernel", 0.31, 0.98, 0.0515, False, 0.1422, None, (-0.22, 0.57), (3, 3))
    good = LeafError(0, "grad", "head.kernel", 1e-4, 1e-3, 0.02, True, 1.0, None, (0.999, 1.001), (4, 10))
    params = [LeafError(0, "param", p, 0.0, 0.0, 1e-3, True, 1.0, 0.1, None, s) for p, s in
              (("conv1.kernel", (3, 3)), ("head.kernel", (4, 10)))]  # fmt: skip
    bad_p = LeafError(0, "param", "conv1.kernel", 0.02, 0.1, 1e-3, False, 0.1422, 0.1, None, (3, 3))
    return StepRecord(
        0, 1e-5, 1e-6, 2.0, 2.0, (bad, good, bad_p, params[1]), 1, 1, forms=(("gradients", form),)
    )


def test_the_scaled_rule_is_silent_where_the_form_finds_no_factor():
    none = Form("none", "no simple form")
    codes = {d.code for d in diagnose([_grad_record(none)], 4)}
    assert "scaled" not in codes
    factor = Form("factor", "a constant factor 0.1422", factor=0.1422, spread=(0.14, 0.145))
    found = [d for d in diagnose([_grad_record(factor)], 4) if d.code == "scaled"]
    assert found and "0.1422 x the reference's" in found[0].message


TASK_FILE = """
import optax
from shardcheck.tasks.digits import digits_task

task = digits_task(hidden=8, optimizer=optax.sgd(0.05), batch_size=16, steps=1, compute_dtype={dtype!r})
"""


def test_record_reads_a_task_files_compute_dtype_and_takes_compute_dtype_as_its_tolerance(tmp_path, capsys):
    import json

    from shardcheck.cli import main

    def meta(path):
        return json.loads(str(np.load(path)["meta"]))

    bf16, f32 = tmp_path / "bf16.py", tmp_path / "f32.py"
    bf16.write_text(TASK_FILE.format(dtype="bfloat16"))
    f32.write_text(TASK_FILE.format(dtype=None))
    base = ["record", "--strategy", "dp", "--devices", "2"]
    assert main([*base, "--task", f"{bf16}:task", "--out", str(tmp_path / "a.npz")]) == 0
    assert meta(tmp_path / "a.npz")["compute_dtype"] == "bfloat16"  # read from the layers, as live
    assert main([*base, "--task", f"{f32}:task", "--out", str(tmp_path / "b.npz")]) == 0
    assert meta(tmp_path / "b.npz")["compute_dtype"] == "float32"
    out = tmp_path / "c.npz"
    assert main([*base, "--task", f"{f32}:task", "--compute-dtype", "bfloat16", "--out", str(out)]) == 0
    assert meta(out)["compute_dtype"] == "bfloat16"  # a less precise tolerance policy, as verify's
    capsys.readouterr()
    assert main([*base, "--task", f"{bf16}:task", "--compute-dtype", "float32", "--out", str(out)]) == 2
    assert "is more precise than the model's own bfloat16" in capsys.readouterr().err
    assert main([*base, "--task", f"{f32}:task", "--param-dtype", "bfloat16", "--out", str(out)]) == 2
    assert "--param-dtype bfloat16 does not apply to a task file" in capsys.readouterr().err


def test_the_rounding_level_note_says_the_adam_clause_only_where_the_optimizer_normalizes():
    noise = LeafError(2, "param", "k.bias", 1e-3, 1.0, 1e-2, True, None, 1e-4, None, (4,))
    base = StepRecord(2, 1e-5, 1e-6, 2.0, 2.0, (noise,), 3, 3, unresolved=("param k.bias",))
    said = {}
    for normalized in (None, (), ("param k.bias",)):
        record = dataclasses.replace(base, normalized=normalized)
        said[normalized] = next(d.message for d in diagnose([record], 2) if d.code == "rounding_level")
    assert "(this optimizer is linear in the gradient, so the update is noise-sized)" in said[()]
    assert "Adam" not in said[()]
    assert (
        "(this optimizer normalizes the update (Adam's g/sqrt(v), Lion's sign): lr-sized)"
        in said[("param k.bias",)]
    )
    assert "(a normalizing optimizer such as Adam makes it lr-sized)" in said[None]  # not known: both said


def test_a_loss_off_by_5_percent_fails_a_bf16_replay_at_the_forward_stage(bf16_recording):
    """Trials 12 and 13: the replay allowed the loss 16 eps_c of its size (12.5% in bfloat16), so a token count
    that dropped the mask (x0.88) PASSed replayed, and a contrastive loss 3-10% off was 'matched' while the
    gradients were blamed. The loss now gets the live check's derivation, 16 eps_c |loss| / sqrt(n): a loss x1.05
    FAILs at step 0, at the forward stage, and the correct step still PASSes."""
    task = _task()

    def scaled_loss(model, batch):
        return 1.05 * task.loss_fn(model, batch)

    def step(model, optimizer, batch):
        out = reference_step(scaled_loss, model, optimizer, batch)
        return {"loss": out.loss, "grads": out.grads}

    report = check_parity(Candidate(name="mine", step=step), task, reference=bf16_recording, num_shards=2)
    assert not report.ok and report.localization.stage == "forward", str(report)
    loss = next(e for e in report.steps[0].leaves if e.kind == "loss")
    assert not loss.ok and loss.ratio == pytest.approx(1.05, rel=1e-2)
