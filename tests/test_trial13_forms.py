"""Forms a new user's trial said falsely (issue #36, trial 13: a two-tower CLIP model on mesh data=4, its
temperature ``logit_scale`` an ``nnx.Param`` of shape ()), each side tested with values:

- one number has no form: the candidate's AdamW mask decaying the 0-D temperature read "the update of
  logit_scale is 1.266 x ...: a learning rate 1.266 x for these leaves", and its gradient left unreduced read
  "0.2958 x ...: a per-module multiplier, or a loss term only they reach"; one leaf of one element is now
  ``one_number`` (its ratio, a decay term with its c and an offset, none claimed), live, replayed and in the
  rules, and several scalars that share one factor, or a larger leaf, still read as a factor;
- a factor on every gradient beside a loss that matches was "one scale of the whole loss: a loss sum not divided
  by its count"; it is now a scale of the gradients after the loss (a mean taken twice, a sum for a mean, a
  transpose that already summed), and stays a scale of the whole loss where the loss was not observed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import ONE_NUMBER, Form, fit_form, form_from_leaves
from shardcheck.parity.diagnosis.localization import checked_form, localize
from shardcheck.parity.diagnosis.rules import diagnose

TOL = 1e-4
PARAM = float(np.log(1 / 0.07))  # the CLIP temperature's init, 2.659
LR, WD = 5e-3, 0.1


def _decayed_update():
    """The 0-D temperature's arrays: before, the reference's update and the candidate's, decayed by lr wd param
    (trial 13: update ratio 1.266, error 0.00133)."""
    before = {"logit_scale": np.asarray(PARAM)}
    ref = {"logit_scale": np.asarray(PARAM - 0.005)}
    cand = {"logit_scale": np.asarray(PARAM - 0.005 - LR * WD * PARAM)}
    return before, ref, cand


def test_one_number_fits_every_form_and_several_or_larger_leaves_still_read_a_factor():
    before, ref, cand = _decayed_update()
    form = fit_form(before, ref, cand, optimizer_stage=True)
    assert form.kind == "one_number" and form.factor == pytest.approx(1.26593, rel=1e-4)
    assert form.coefficient == pytest.approx(LR * WD, rel=1e-9)
    assert form.sentence == (
        "one number differs (logit_scale, 0-D): its update is 1.266 x the reference's, or equally the reference's "
        "plus a decay term -c*lr*param with c*lr = 0.0005 (the learning rate unknown; a decay the candidate "
        "applies and the other does not), or an offset of -0.00133; " + ONE_NUMBER
    )
    known = fit_form(before, ref, cand, lr=LR, optimizer_stage=True)
    assert known.coefficient == pytest.approx(WD) and "with c = 0.1 (learning rate 0.005;" in known.sentence
    assert "learning rate 1.266" not in known.sentence
    one = fit_form({"b": np.zeros(1)}, {"b": np.full(1, 2.0)}, {"b": np.full(1, 3.0)}, update=False)
    assert one.kind == "one_number" and one.sentence.startswith(
        "one number differs (b, shape (1,)): its gradient is 1.5 x the reference's, or equally the reference's "
        "plus a term c*param (its c unread"
    )
    assert "or an offset of +1;" in one.sentence
    # a gradient's parameter at hand (the live check's): its term c*param with c, offset / param
    held = fit_form(
        {}, {"t": np.asarray(2.0)}, {"t": np.asarray(0.5)}, update=False, params={"t": np.asarray(3.0)}
    )
    assert held.kind == "one_number" and held.coefficient == pytest.approx(0.5)
    assert (
        "plus a term -c*param with c = 0.5 (a coupled weight decay on one side), or an offset of -1.5;"
        in (held.sentence)
    )
    # two scalars that share one factor, and a leaf of 4 elements: a factor, as before
    two = fit_form(
        {},
        {"a": np.asarray(2.0), "b": np.asarray(-1.0)},
        {"a": np.asarray(2.5), "b": np.asarray(-1.25)},
        update=False,
    )
    assert (two.kind, two.factor) == ("factor", 1.25)
    big = np.arange(1.0, 5.0)
    four = fit_form({"w": big}, {"w": 2 * big}, {"w": 2.266 * big}, optimizer_stage=True)
    assert four.kind == "factor" and four.factor == pytest.approx(1.266)
    # a one-number zero update is still said as one (its claim holds whatever the number)
    zero = fit_form(before, ref, before)
    assert zero.kind == "zero"


def _leaf(kind, path, ratio=None, shape=(4,), size=1.0):
    """A matching leaf, or one whose change (value) is ``ratio`` x the reference's ``size``."""
    if ratio is None:
        return LeafError(
            0, kind, path, 0.0, 0.0, TOL, True, 1.0, size if kind != "grad" else None, None, shape
        )
    err = abs(ratio - 1) * size
    change = size if kind != "grad" else None
    return LeafError(0, kind, path, err, err, TOL, False, ratio, change, (ratio, ratio), shape)


COUNTERS = (LeafError(0, "counter", "1.0.count", 0.0, 0.0, 0.0, True, 1.0),)
OTHERS = ("image.fc.kernel", "text.proj.kernel")


def _optimizer_record(shape, forms=()):
    """Trial 13's temp_decay: the loss, gradients and state match; the optimizer rerun from equal inputs and the
    parameters differ on ``logit_scale`` alone (update ratio 1.266)."""
    grads = [_leaf("grad", p) for p in ("logit_scale", *OTHERS)]
    params = [_leaf("param", "logit_scale", 1.266, shape, 0.005), *(_leaf("param", p) for p in OTHERS)]
    state = [_leaf("opt_state", f"1.0.mu.{p}") for p in ("logit_scale", *OTHERS)]
    leaves = (_leaf("loss", "loss", shape=()), *grads, *params, *state, *COUNTERS)
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, leaves, 1, 1, optimizer_rerun=(*params, *state), forms=forms)


def test_one_number_in_the_optimizer_stage_is_no_learning_rate_live_and_replayed():
    before, ref, cand = _decayed_update()
    fitted = fit_form(before, ref, cand, optimizer_stage=True)
    for forms in ((("optimizer", fitted),), ()):  # live (the fitted arrays) and replayed (the records alone)
        loc = localize([_optimizer_record((), forms)])
        assert (loc.stage, loc.form.kind) == ("optimizer", "one_number")
        assert loc.form.factor == pytest.approx(1.266, rel=1e-3)
        text = loc.text()
        assert "learning rate 1.266" not in text and "parameter group's learning rate" not in text
        assert "one number fits every form, so none is claimed" in text
    assert "an offset of 0.00133 in size" in localize([_optimizer_record(())]).form.sentence
    # the same factor on a leaf of 4 elements beside matching ones: a parameter group's learning rate
    loc = localize([_optimizer_record((4,))])
    assert (
        loc.form.kind == "factor"
        and (
            "the update of logit_scale is 1.266 x the reference's (spread 1.266..1.266); every other update matches: "
            "a learning rate 1.266 x for these leaves (a parameter group's learning rate or multiplier)"
        )
        in loc.form.sentence
    )


def _gradient_record(ratio, shape, replicas=()):
    """Trial 13's temp_unreduced: the gradient (and Adam's mu) of ``logit_scale`` alone is ``ratio`` x the
    reference's (reference gradient 2.0), every other gradient matches; ``replicas``: leaves whose copies
    differ."""
    grads = [_leaf("grad", "logit_scale", ratio, shape, 2.0), *(_leaf("grad", p) for p in OTHERS)]
    state = [_leaf("opt_state", "1.0.mu.logit_scale", ratio, shape, 0.2)]
    state += [_leaf("opt_state", f"1.0.mu.{p}") for p in OTHERS]
    leaves = (
        _leaf("loss", "loss", shape=()),
        *grads,
        *[_leaf("param", p) for p in OTHERS],
        *state,
        *COUNTERS,
    )
    return StepRecord(
        0,
        1e-5,
        1e-7,
        1.0,
        1.0,
        leaves,
        1,
        1,
        replica_mismatches=replicas,
        replica_axes=("data",) * bool(replicas),
    )


def _messages(record):
    return {d.code: d.message for d in diagnose([record], 4, mesh_shape={"data": 4})}


def test_one_numbers_gradient_names_no_factor_and_a_shard_count_only_within_its_tolerance():
    said = _messages(_gradient_record(0.2958, ()))
    assert said["scaled"] == (
        "At step 0, the gradient of logit_scale (one number, 0-D; every other gradient matches) is 0.2958 x the "
        "reference's, or equally differs from it by 1.41 (an offset, or a term c*param): " + ONE_NUMBER + "."
    )
    replayed = form_from_leaves([_gradient_record(0.2958, ()).leaves[1]], update=False)
    assert replayed.kind == "one_number" and replayed.sentence.startswith(
        "one number differs (logit_scale, 0-D): its gradient is 0.2958 x the reference's"
    )
    # a leaf of 4 elements with the same factor: a scale of these gradients only, as before
    assert (
        "a per-module multiplier, or a loss term only they reach"
        in _messages(_gradient_record(0.2958, (4,)))["scaled"]
    )
    # x1/4 beside replicas that differ: unreduced where the one number is 1/4 within its tolerance ...
    mismatched = ("opt_state 1.0.mu.logit_scale",)
    exact = _messages(_gradient_record(0.25, (), mismatched))
    assert (
        "unreduced" in exact
        and "is 0.25 x the reference's, 1/4 within its tolerance: x1/4" in exact["unreduced"]
    )
    # ... and not where it is 1% off (2% would name it on a leaf's ratio; one number is held to its tolerance)
    near = _messages(_gradient_record(0.2525, (), mismatched))
    assert not {"unreduced", "averaged_twice"} & set(near) and "none is claimed" in near["scaled"]
    # a leaf's ratio of 0.2525 on every element ("spread 0.2525..0.2525") is measured apart from 1/4: not named
    # (trial 26: 0.4962 on every element had read x1/2); a leaf whose ratios reach 1/4 is
    assert "unreduced" not in _messages(_gradient_record(0.2525, (4,), mismatched))
    reaching = _gradient_record(0.2525, (4,), mismatched)
    leaves = tuple(
        dataclasses.replace(e, spread=(0.2499, 0.2530)) if e.kind == "grad" and not e.ok else e
        for e in reaching.leaves
    )
    assert "unreduced" in _messages(dataclasses.replace(reaching, leaves=leaves))


def _all_gradients(loss_ok):
    """Trial 13's pmean: every gradient 0.25 x the reference's; the loss matches (``loss_ok``), differs
    (``False``) or was not observed (``None``)."""
    grads = [_leaf("grad", p, 0.25) for p in ("logit_scale", *OTHERS)]
    loss = () if loss_ok is None else (_leaf("loss", "loss", None if loss_ok else 0.25, ()),)
    record = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (*loss, *grads, *COUNTERS), 1, 1)
    form = Form("factor", "a constant factor 0.25 ...: these values scaled by one factor", 0.25, (0.25, 0.25))
    return checked_form(form, "gradients", grads, grads, record).sentence


def test_a_factor_on_every_gradient_beside_a_matching_loss_is_after_the_loss():
    after = _all_gradients(True)
    assert after.startswith(
        "every gradient is 0.25 x the reference's (spread 0.25..0.25): the returned loss matches, so"
    )
    assert "one scale of the gradients after the loss" in after and "a mean taken twice" in after
    assert "a sum in place of a mean" not in after  # a x0.25 is no sum (trial 24)
    assert "loss sum not divided" not in after and "whole loss" not in after
    for loss_ok in (False, None):  # the loss carries it too, or was not observed: one scale of the whole loss
        whole = _all_gradients(loss_ok)
        assert "one scale of the whole loss: a loss sum not divided by its count" in whole
    # the rules' scaled: a factor that is no shard count beside a matching loss is not a loss normalization
    grads = [_leaf("grad", p, 3.0) for p in ("logit_scale", *OTHERS)]
    state = [_leaf("opt_state", f"1.0.mu.{p}", 3.0) for p in ("logit_scale", *OTHERS)]
    for loss, cause in (
        ((_leaf("loss", "loss", shape=()),), "the loss matches: a scale of the gradients after it"),
        ((), "a wrong loss normalization?"),
    ):
        record = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (*loss, *grads, *state, *COUNTERS), 1, 1)
        assert cause in _messages(record)["scaled"]


def _temperature_task(decay_temperature):
    class Tower(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.logit_scale = nnx.Param(jnp.asarray(PARAM, jnp.float32))

    def loss_fn(model, batch):
        return jnp.mean((jnp.exp(model.logit_scale[...]) * model.lin(batch["x"]) - batch["y"]) ** 2)

    def tx(decay):
        def mask(params):  # the kernel decayed, the bias not; the temperature where ``decay``
            name = lambda k: jax.tree_util.keystr(k)  # noqa: E731
            return jax.tree.map_with_path(
                lambda k, _: "kernel" in name(k) or (decay and "logit" in name(k)), params
            )

        return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=LR, weight_decay=WD, mask=mask
        )

    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(4, 3)).astype(np.float32), "y": rng.normal(size=(4, 2)).astype(np.float32)}
    ]
    task = shardcheck.Task(model=Tower, optimizer=tx(False), loss_fn=loss_fn, batches=batches)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    def make(model, optimizer):
        own = nnx.Optimizer(model, tx(decay_temperature), wrt=nnx.Param)
        nnx.update(own, nnx.state(optimizer))
        return own

    return task, shardcheck.Candidate("own", step, num_shards=1, make_optimizer=make)


def test_a_decayed_temperature_fails_live_as_one_number_with_its_decay():
    task, good = _temperature_task(False)
    assert check_parity(good, task).ok
    _, decayed = _temperature_task(True)
    report = check_parity(decayed, task)
    form = report.localization.form
    assert not report.ok and (report.localization.step, report.localization.stage) == (0, "optimizer")
    assert form.kind == "one_number" and form.coefficient == pytest.approx(WD, rel=1e-3)
    assert "a decay term -c*lr*param with c = 0.09998 (learning rate 0.005;" in form.sentence  # float32's 0.1
    assert "an offset of -0.00133;" in form.sentence
    assert "learning rate" not in report.localization.text().replace("(learning rate 0.005;", "")
