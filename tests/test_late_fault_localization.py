"""A fault first seen at a step t > 0 is localized as at step 0 (``shardcheck.parity.harness.check``'s re-check).

Under a warm-up whose step-0 learning rate is 0, a norm scale left out of the weight-decay mask moves nothing at
step 0 and first shows at step 1. The step loop re-checks that step from the reference's pre-step state; the
re-check carries its whole evidence (the optimizer rerun, the form, the hypotheses) into the record, so the
localization names the optimizer stage, the scales and the decay coefficient as a step-0 occurrence does, and
no ``drift`` ("state not carried between steps") is said of a step that is faulty on its own. A step that does
ignore its optimizer state stays ``drift`` (``tests/test_parity.py``); the correct step with the same schedule
PASSes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import check_parity
from shardcheck._tree import path_str
from shardcheck.parity.diagnosis.localization import STAGES
from shardcheck.parity.harness.candidates import as_candidate
from shardcheck.tasks import TinyLMConfig, load_task

CFG = TinyLMConfig(d_model=16, num_heads=2, num_layers=1, seq_len=16, mlp_dim=32)
LR, WD = 1e-2, 0.1


def _adamw(keep_scale: bool):
    """AdamW on a warm-up from a learning rate of 0 (``linear_schedule(0, LR, 5)``), decaying every leaf but the
    biases (and, ``keep_scale=False``, but the norm scales)."""
    ends = ("bias",) if keep_scale else ("bias", "scale")

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: not path_str(p).endswith(ends), params)

    warm_up = optax.linear_schedule(0.0, LR, 5)
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=warm_up, weight_decay=WD, mask=mask
    )


@functools.cache
def _task():
    return load_task("tiny-lm", config=CFG, batch_size=8, steps=2, optimizer=_adamw(keep_scale=True))


def _scales_left_out():
    """The dp step with its own AdamW, whose decay mask leaves out the norm scales too."""
    cand = as_candidate("t", "dp", _task(), 2, None, None)

    def make(model, optimizer):
        own = nnx.Optimizer(model, _adamw(keep_scale=False), wrt=nnx.Param)
        nnx.update(own, nnx.state(optimizer))
        return own

    return dataclasses.replace(cand, make_optimizer=make)


@require_devices(2)
def test_the_correct_step_under_the_warm_up_passes():
    report = check_parity("dp", _task(), num_shards=2)
    assert report.ok and report.verdict == "PASS" and report.localization is None
    assert "parity" in report.codes and not {"drift", "localized"} & set(report.codes)


@require_devices(2)
def test_a_decay_mask_fault_first_seen_at_step_1_is_localized_as_at_step_0():
    report = check_parity(_scales_left_out(), _task(), num_shards=2)
    assert report.steps[0].ok and not report.steps[1].ok  # the step-0 learning rate of 0 hides it
    loc = report.localization
    assert (loc.step, loc.stage, loc.synchronized) == (1, "optimizer", True)
    assert [loc.status(s) for s in STAGES[:3]] == ["matches", "matches", "matches"]
    assert loc.status("optimizer") == "differs"  # rerun on the candidate's gradients, not "matches"
    assert report.steps[1].optimizer_rerun is not None and report.steps[1].synchronized
    # the biases (near their zero init) match only because c*lr*max|p| is within their tolerance: no contrast
    # (issue #36, trial 47's "every bias, pos matches")
    assert loc.group.startswith("every failing leaf is 1-D (scale); every leaf of ndim >= 2 matches"), (
        loc.group
    )
    assert "bias and " in loc.group and "too small for the decay to show" in loc.group
    assert loc.form.kind == "decay" and loc.form.leaves == 3  # ln1, ln2, ln_f
    assert loc.form.coefficient == pytest.approx(WD, rel=1e-3)
    text = loc.text()
    assert text.startswith(
        "First difference at step 1 (run from the reference's pre-step state): the optimizer"
    )
    assert (
        "c = 0.1 (learning rate 0.002 at this step) on all 3 failing leaves" in text
        and "not rerun" not in text
    )
    assert "drift" not in report.codes and "localized" in report.codes
    assert "state not carried between steps" not in report.diagnosis


@require_devices(2)
def test_the_same_fault_replayed_against_a_recording_is_localized_not_drift():
    """A replay re-runs nothing from the reference's state, yet its optimizer rerun at step 1 differs: the step
    is faulty from equal inputs, so no "state not carried between steps" is said of it (a user's trial)."""
    from shardcheck.parity.harness.recorded import record_run

    recording = record_run(_task(), "dp", num_shards=2)
    report = check_parity(_scales_left_out(), _task(), num_shards=2, reference=recording)
    loc = report.localization
    assert (loc.step, loc.stage) == (1, "optimizer") and loc.form.kind == "decay"
    assert "drift" not in report.codes and "localized" in report.codes, report.codes
    assert "state not carried between steps" not in report.diagnosis
