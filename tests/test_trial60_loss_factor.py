"""Trial 60: a loss and its gradients averaged over 'data' where their sum was due, under bfloat16 compute.

In float32 the step read ``scaled`` ("the loss itself is scaled, its gradients with it"). Under bfloat16 compute
the rounding spread one bias's elementwise ratios to 0.48..0.504 at 11 x its tolerance, so no gradient factor was
read, and the leading finding was ``forward_differs`` blaming the model's dropout. The loss's own ratio (one
scalar, exact), shown by every failing gradient's median, is now the factor the rules read
(``rules._loss_led_factor``); the localization's form already read it so.
"""

from __future__ import annotations

import dataclasses

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import DiagnosisContext, diagnose

TOL = 1e-3


def _grad(path, ratio, spread, badness=11.0) -> LeafError:
    err = badness * TOL
    return LeafError(0, "grad", path, err, err / 0.02, TOL, False, ratio, None, spread)


def _record(*, step=0, loss_ratio=0.5, medians=(0.5, 0.5008), from_reference_state=False) -> StepRecord:
    """A failing step of a two-gradient model under low-precision compute: the loss ``loss_ratio`` x the
    reference's, gradient w's ratio ``medians[0]`` (spread within 2%), b's ``medians[1]`` spread 0.48..0.5036
    (past 2%, at 11 x its tolerance, as trial 60's fc2.bias)."""
    loss = LeafError(step, "loss", "loss", 0.5, 0.5, TOL, loss_ratio == 1.0, loss_ratio)
    grads = (_grad("w", medians[0], (0.4979, 0.5022)), _grad("b", medians[1], (0.48, 0.5036)))
    param = LeafError(step, "param", "w", 100 * TOL, 1.0, TOL, False, 0.5, 1.0)
    leaves = (loss, *(dataclasses.replace(g, step=step) for g in grads), param)
    return StepRecord(
        step,
        leaves=leaves,
        rtol=1e-5,
        atol=1e-6,
        loss=2.633,
        candidate_loss=2.633 * loss_ratio,
        synchronized=from_reference_state,
        step_count=step + 1,
        candidate_step_count=step + 1,
    )


def test_the_losss_factor_shown_by_every_gradients_median_is_read_past_a_rounding_spread():
    ctx = DiagnosisContext.build([_record()], 2, mesh_shape={"data": 2})
    assert ctx.factor == 0.5 and ctx.evidence == "gradients"
    findings = diagnose([_record()], 2, mesh_shape={"data": 2})
    assert findings[0].code == "scaled", [d.code for d in findings]
    said = findings[0].message
    assert "the loss itself is scaled, its gradients with it" in said
    assert "averaged over 'data' (or divided by 2) where a sum was due" in said
    # a step run from the reference's state reads it too: its loss is at equal parameters
    later = _record(step=3, from_reference_state=True)
    assert DiagnosisContext.build([later], 2, mesh_shape={"data": 2}).factor == 0.5


def test_no_factor_where_the_medians_disagree_the_loss_matches_or_parameters_differ():
    """The other side: a gradient whose median is not the loss's factor, a loss that matches, and a later step of
    the candidate's own trajectory (its loss taken at other parameters) read no factor."""
    for record in (
        _record(medians=(0.5, 0.7)),
        _record(loss_ratio=1.0),
        _record(step=2),
    ):
        ctx = DiagnosisContext.build([record], 2, mesh_shape={"data": 2})
        assert ctx.factor is None, record
        assert "scaled" not in [d.code for d in diagnose([record], 2, mesh_shape={"data": 2})]
