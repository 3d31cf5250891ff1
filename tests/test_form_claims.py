"""Two Form sentences a user's trial found false (issue #36), each tested both ways on hand-built records (no JAX).

- Adam's b2 = 0.9 for 0.99 on the ``moe.*`` leaves: only ``opt_state 1.0.nu.moe.b_out`` failed at the optimizer
  stage (ratio 10), and the Form read "the update of 1.0.nu.moe.* is 10 x ...: a learning rate 10 x for these
  leaves ..., or the update applied 10 times": a learning rate never moves optimizer state, and ``1.0.nu.moe.*``
  contradicted the group ("only opt_state 1.0.nu.moe.b_out differs"). A factor on parameters still names a
  learning rate.
- A tensor-parallel output not psum-ed: the loss 1.000076 x the reference's read "a constant factor 1 ... the loss
  at equal parameters is 1 x the reference's" beside a loss that differs: a factor that prints as 1 is said by
  its relative difference, not as a scale.
"""

import dataclasses

import pytest

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form, form_from_leaves
from shardcheck.parity.diagnosis.localization import checked_form, contradiction, localize

TOL = 1e-3


def _leaf(kind, path, ratio=None):
    """A matching leaf (``ratio`` ``None``: its size unknown, so it would show any factor), or one off by the
    constant factor ``ratio`` on a reference change of size 1."""
    if ratio is None:
        return LeafError(0, kind, path, 0.0, 0.0, TOL, True, shape=(4,))
    err = abs(ratio - 1)
    return LeafError(0, kind, path, err, err, TOL, False, ratio, 1.0, (ratio, ratio), (4,))


def _record(leaves, rerun=None):
    counters = (_leaf("counter", "1.0.count"),)
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (*leaves, *counters), 1, 1, optimizer_rerun=rerun)


PARAMS = [_leaf("param", p) for p in ("moe.b_out", "moe.w_out", "attn.kernel")]
GRADS = [_leaf("grad", p) for p in ("moe.b_out", "moe.w_out", "attn.kernel")]


def _state(failing, ratio=10.0):
    paths = [f"1.0.{m}.{p}" for m in ("mu", "nu") for p in ("moe.b_out", "moe.w_out", "attn.kernel")]
    return [_leaf("opt_state", p, ratio if p in failing else None) for p in paths]


def test_a_factor_on_optimizer_state_alone_is_the_states_own_update_not_a_learning_rate():
    state = _state({"1.0.nu.moe.b_out"})
    leaves = [_leaf("loss", "loss"), *GRADS, *PARAMS, *state]
    records = [_record(leaves, rerun=(*PARAMS, *state))]
    loc = localize(records)
    assert (loc.stage, loc.form.kind, loc.form.factor) == ("optimizer", "factor", 10.0)
    assert loc.group.startswith("only opt_state 1.0.nu.moe.b_out differs")
    assert loc.form.sentence == (
        "the change of opt_state 1.0.nu.moe.b_out in this step is 10 x the reference's (spread 10..10); every "
        "other leaf matches: the optimizer state's own update differs for this leaf, not a learning rate (which "
        "scales the parameters' update and never moves the state): a decay rate such as Adam's b2 differing: "
        "the change of nu is (1 - b2)(g^2 - nu), 10 x where 1 - b2 is 10 x the reference's (b2 = 0.99 for 0.999, "
        "or 0.9 for 0.99) (not an extra optimizer step: the counters match)"
    )
    text = loc.text()
    assert "learning rate 10 x" not in text and "applied 10 times" not in text and "nu.moe.*" not in text
    assert contradiction(text, records) is None
    # mu: its own rate b1 (1 - 10 x 0.1 = 0 for 0.9); its 1 - b1 reads from Adam's common b1 values
    mu = _state({"1.0.mu.moe.b_out", "1.0.mu.moe.w_out"})
    loc = localize([_record([_leaf("loss", "loss"), *GRADS, *PARAMS, *mu], rerun=(*PARAMS, *mu))])
    assert loc.form.sentence.startswith(
        "the change of opt_state 1.0.mu.moe.* in this step is 10 x the reference's (spread 10..10); every other "
        "leaf matches: the optimizer state's own update differs for these leaves, not a learning rate"
    )
    assert (
        "Adam's b1 differing: the change of mu is (1 - b1)(g - mu), 10 x where 1 - b1 is 10 x the reference's (b1 "
        "= 0 for 0.9, or 0.5 for 0.95)" in loc.form.sentence
    )


def test_state_leaves_of_both_moments_or_unobserved_gradients_name_no_one_rate_and_say_what_is_unseen():
    both = _state({"1.0.mu.moe.b_out", "1.0.nu.moe.b_out"}, 2.0)
    bad = [e for e in both if not e.ok]
    record = _record([_leaf("loss", "loss"), *PARAMS, *both])  # no gradients returned, no rerun
    form = Form("extra_step", "... 2 optimizer steps instead of one produce", 2.0, (2.0, 2.0), leaves=2)
    said = checked_form(form, "optimizer", bad, both, record).sentence
    assert said.startswith(
        "the change of opt_state 1.0.mu.moe.b_out, opt_state 1.0.nu.moe.b_out in this step is 2 x the reference's"
    )
    assert said.endswith(
        "never moves the state): a decay rate of the state (such as Adam's b1 or b2) or the term it accumulates "
        "differs; or the gradients it was given differ (they were not observed) (not an extra optimizer step: "
        "the counters match)"
    )
    # the counters differ: the extra optimizer step stands, on the state as on the parameters
    stepped = StepRecord(
        0, 1e-5, 1e-7, 1.0, 1.0, (*record.leaves[:-1], _leaf("counter", "1.0.count", 2.0)), 1, 2
    )
    assert checked_form(form, "optimizer", bad, both, stepped) is form


def test_a_factor_on_a_parameter_group_still_names_a_learning_rate_and_its_leaves_as_the_group_does():
    moe = [_leaf("param", "moe.b_out", 10.0), _leaf("param", "moe.w_out", 10.0)]
    leaves = [*moe, _leaf("param", "attn.kernel")]
    form = Form("extra_step", "... 10 optimizer steps instead of one produce", 10.0, (10.0, 10.0), leaves=2)
    said = checked_form(form, "parameters", moe, leaves, _record(leaves)).sentence
    assert said == (
        "the update of moe.* is 10 x the reference's (spread 10..10); every other update matches: a learning rate "
        "10 x for these leaves (a parameter group's learning rate or multiplier), or the update applied 10 times "
        "(not an extra optimizer step: the counters match)"
    )
    # a matching leaf under moe: "moe.*" would contradict it, so the failing leaves are listed; one is named
    under = [*leaves, _leaf("param", "moe.router")]
    assert (
        "the update of moe.b_out, moe.w_out is 10 x"
        in checked_form(form, "parameters", moe, under, _record(under)).sentence
    )
    one = checked_form(form, "parameters", moe[:1], under, _record(under)).sentence
    assert one.startswith("the update of moe.b_out is 10 x")


def _loss_record(ratio, grads):
    return [StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (_leaf("loss", "loss", ratio), *grads, *PARAMS), 1, 1)]


def test_a_loss_factor_that_prints_as_1_is_said_by_its_relative_difference_not_as_a_scale():
    grads = [_leaf("grad", "a.kernel", 1.5), _leaf("grad", "b.kernel", 0.7)]
    records = _loss_record(1.0000762, grads)
    loc = localize(records)
    assert loc.stage == "forward" and (loc.form.kind, loc.form.factor) == ("none", None)
    assert loc.form.sentence == (
        "the loss at equal parameters differs by 7.6e-05 of its value (above the reference's): not a scale of the "
        "loss; every gradient differs: the forward pass computes another function of "
        "the parameters"
    )
    assert "constant factor 1 " not in loc.text() and "1 x the reference's" not in loc.text()
    below = localize(_loss_record(1 - 4.1e-5, [_leaf("grad", "a.kernel")]))
    assert below.form.sentence.startswith(
        "the loss at equal parameters differs by 4.1e-05 of its value (below the reference's): not a scale of "
        "the loss; every gradient matches"
    )
    # 1.0006 prints as 1.001: said as the loss's ratio; its gradients by no one factor, no factor is claimed
    # (trial 31: "a factor 0.9917: ... not a scaled loss")
    scaled = localize(_loss_record(1.0006, grads))
    assert scaled.form.kind == "none" and scaled.form.sentence.startswith(
        "the loss at equal parameters is 1.001 x the reference's; "
    )


def test_a_ratio_whose_spread_holds_1_is_no_factor_and_never_a_normalization():
    """A new user's trial 6 (gradients all-reduced in bfloat16; a replay of a decay-mask fault): "every gradient
    is 1 x the reference's (spread 0.9958..1.005): one scale of the whole loss ... a wrong normalization". A ratio
    whose spread holds 1 scales nothing; a factor whose spread lies off 1, however close, is still one."""
    near = [
        LeafError(0, "grad", f"l{i}.kernel", 1e-3, 1e-3, 1e-5, False, 0.9998, None, (0.9922, 1.002), (4, 4))
        for i in range(4)
    ]
    form = form_from_leaves(near, update=False)
    assert form.kind == "none" and form.factor is None
    assert form.sentence.startswith("no factor: the elementwise ratio on all 4 failing leaves lies around 1 ")
    assert "0.9922..1.002" in form.sentence and "about 0.0078 of its value" in form.sentence
    assert "normalization" not in form.sentence and "scale of the whole" not in form.sentence
    off = [dataclasses.replace(e, ratio=0.9, spread=(0.899, 0.901)) for e in near]
    scaled = form_from_leaves(off, update=False)
    assert scaled.kind == "factor" and scaled.factor == pytest.approx(0.9)
