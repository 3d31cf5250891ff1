"""General rules that keep a diagnosis true to its records (issue #36, the public bug reports' lessons), each
tested both ways on synthetic records or arrays: the sentence appears where the records support it and not where
they contradict it.

- a zero update is said as one (a learning rate of 0 at this step), never as "no one factor";
- a factor claimed for the gradients is scoped to the group that has it where other gradients match;
- an update k x the reference's is k optimizer steps only where the counters do not match, and "the whole update"
  only where every update leaf fails; :func:`contradiction` catches both claims;
- a loss that differs at equal parameters while only some gradients do names the parameters its difference
  reaches;
- failing optimizer state is grouped by the parameters it belongs to, and the ``localized`` finding never says
  "share no ... module" where the localization's group names one; counts and articles read right.
"""

import dataclasses

import numpy as np
import pytest

from shardcheck.parity.diagnosis import rules
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form, fit_form, form_from_leaves
from shardcheck.parity.diagnosis.localization import checked_form, contradiction, forward_group, localize


def _leaf(kind, path, ok, ratio=None, spread=None, shape=(4, 4)):
    return LeafError(
        0, kind, path, 0.0 if ok else 1.0, 0.0 if ok else 1.0, 1e-3, ok, ratio, None, spread, shape
    )


def _record(leaves, forms=()):
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, tuple(leaves), 1, 1, forms=tuple(forms))


COUNTERS_MATCH = [_leaf("counter", "step", True, shape=())]
COUNTERS_DIFFER = [_leaf("counter", "step", False, 2.0, shape=())]

# ---------------------------------------------------------------------------------------------- a zero update


def test_a_zero_update_is_said_as_a_learning_rate_of_0_not_as_no_one_factor():
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(size=(4, 4)), "b": rng.normal(size=4)}
    ref = {k: v + 0.01 * rng.normal(size=v.shape) for k, v in before.items()}
    form = fit_form(before, ref, dict(before))
    assert form.kind == "zero" and form.factor == 0.0
    assert "learning rate of 0 at this step" in form.sentence
    # gradients (values, not an update) that are zero: no learning rate is blamed
    grads = fit_form({}, ref, {k: np.zeros_like(v) for k, v in ref.items()}, update=False)
    assert grads.kind == "zero" and "learning rate" not in grads.sentence
    # the catalog's stage sentence: every failing leaf's ratio 0 -> zero; a constant 2 -> no zero claimed
    zero = rules._stage_form(
        [_leaf("param", "w", False, 0.0, (0.0, 0.0)), _leaf("param", "b", False, 0.0, (0.0, 0.0))]
    )
    assert "update of these leaves is zero" in zero and "no one factor" not in zero
    two = rules._stage_form(
        [_leaf("param", "w", False, 2.0, (2.0, 2.0)), _leaf("param", "b", False, 2.0, (2.0, 2.0))]
    )
    assert two == "Their changes are 2 x the reference's, a constant factor on each."
    # trial 6 (bfloat16 all-reduce, replayed): a ratio whose spread holds 1 is no factor, and gradients are values
    near = rules._stage_form(
        [
            _leaf("grad", "w", False, 0.9997, (0.9927, 1.009)),
            _leaf("grad", "b", False, 0.9994, (0.995, 1.004)),
        ]
    )
    assert near == (
        "Their values lie around 1 x the reference's (elementwise 0.9927..1.009): each element differs by up to "
        "about 0.009 of its value, which no factor explains."
    )


def test_an_update_where_the_reference_makes_none_is_said_as_a_learning_rate_of_0_in_the_reference():
    """A warm-up from 0 read one step ahead by the candidate (a user's trial: "no simple form", "no one
    factor"): the reference does not move the leaves at step 0, the candidate does."""
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(size=(4, 4)), "b": rng.normal(size=4)}
    moved = {k: v + 0.01 * rng.normal(size=v.shape) for k, v in before.items()}
    form = fit_form(before, dict(before), moved)
    assert form.kind == "reference_zero"
    assert "the reference left these 2 leaves as they were (change at most 0)" in form.sentence
    assert "a learning rate of 0 at this step in the reference and not in the candidate" in form.sentence
    # the other way round stays the candidate's zero update; values (gradients) are not an update
    assert fit_form(before, moved, dict(before)).kind == "zero"
    assert fit_form({}, {k: np.zeros_like(v) for k, v in moved.items()}, moved, update=False).kind != (
        "reference_zero"
    )
    # from the records alone (a replay): every failing parameter's reference change is 0
    still = [dataclasses.replace(_leaf("param", p, False), reference_change=0.0) for p in ("w", "b")]
    assert form_from_leaves(still).kind == "reference_zero"
    assert form_from_leaves([dataclasses.replace(still[0], reference_change=0.1)]).kind != "reference_zero"
    assert "The reference did not move these leaves at this step and the candidate did" in rules._stage_form(
        still
    )


def test_a_decay_by_hand_where_the_reference_makes_no_update_is_said_as_a_decay_term():
    """Trial 53: a decay ``p - 5e-5 * p`` applied to every leaf after ``optimizer.update``, at a warm-up's lr-0
    first step, read only "a zero update in the reference alone ... parameters the task's optimizer freezes"; the
    candidate's change is -c*param with one c, and the form now says so, with c. A change of no such form (noise)
    is said as before."""
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(size=(4, 4)), "b": rng.normal(size=4)}
    decayed = {k: v - 5e-5 * v for k, v in before.items()}
    form = fit_form(before, dict(before), decayed)
    assert form.kind == "reference_zero"
    assert (
        "by -c*param with c = 5e-05 on every one of them: a decay term the candidate applies" in form.sentence
    )
    assert "else parameters the task's optimizer freezes" in form.sentence
    noise = {k: v + 0.01 * rng.normal(size=v.shape) for k, v in before.items()}
    assert "-c*param" not in fit_form(before, dict(before), noise).sentence
    grown = {k: v + 5e-5 * v for k, v in before.items()}  # c < 0: no decay
    assert "-c*param" not in fit_form(before, dict(before), grown).sentence


# ------------------------------------------------------------------------------------ a factor on some gradients


def test_a_gradient_factor_is_scoped_to_its_group_where_other_gradients_match():
    leaves = [
        _leaf("grad", "experts.w_in", False, 2.0, (2.0, 2.0)),
        _leaf("grad", "experts.w_out", False, 2.0, (2.0, 2.0)),
        _leaf("grad", "router.kernel", True),
        _leaf("grad", "head.kernel", True),
    ]
    assert rules.scoped_gradients(_record(leaves), "gradients", 2.0) == (
        "the gradients of experts.* (2 of 4 gradient leaves; every other gradient matches)"
    )
    # every gradient fails: "gradients" stands, and claiming it is true
    every = [_failing(e) for e in leaves]
    assert rules.scoped_gradients(_record(every), "gradients", 2.0) == "gradients"
    claim = "At step 0, gradients are 2 x the reference's: a constant factor."
    assert contradiction(claim, [_record(every)]) is None
    assert contradiction(claim, [_record(leaves)]) == "gradients are f x the reference's"
    # a matching gradient that is rounding noise (|reference| 1.4e-10, tolerance 1e-3) would match x2 too: no
    # evidence against the factor, so "gradients" stands and is no contradiction
    noise = LeafError(0, "grad", "attn.key.bias", 1e-9, 7.0, 1e-3, True, shape=(4,))
    assert rules.scoped_gradients(_record([*every, noise]), "gradients", 2.0) == "gradients"
    assert contradiction(claim, [_record([*every, noise])]) is None
    scoped = (
        f"At step 0, {rules.scoped_gradients(_record(leaves), 'gradients', 2.0)} are 2 x the reference's."
    )
    assert contradiction(scoped, [_record(leaves)]) is None


def _failing(e):
    return LeafError(e.step, e.kind, e.path, 1.0, 1.0, e.tolerance, False, 2.0, None, (2.0, 2.0), e.shape)


# ---------------------------------------------------------------------- k optimizer steps only where counters say so


def _extra_step(f=2.0):
    return Form("extra_step", f"... {int(f)} optimizer steps instead of one produce", f, (f, f), leaves=2)


def test_an_extra_optimizer_step_is_not_said_where_the_counters_match():
    params = [
        _leaf("param", "a.kernel", False, 2.0, (2.0, 2.0)),
        _leaf("param", "b.kernel", False, 2.0, (2.0, 2.0)),
    ]
    # the counters match: a learning rate 2 x, or the update applied twice
    form = checked_form(_extra_step(), "optimizer", params, params, _record(params + COUNTERS_MATCH))
    assert form.kind == "factor" and form.factor == 2.0
    assert form.sentence == (
        "every update is 2 x the reference's (spread 2..2): a learning rate 2 x, or the update applied 2 times "
        "(not an extra optimizer step: the counters match)"
    )
    assert contradiction("optimizer steps instead of one", [_record(params + COUNTERS_MATCH)]) is not None
    # the counters differ: the extra step stands, and is no contradiction
    kept = checked_form(_extra_step(), "optimizer", params, params, _record(params + COUNTERS_DIFFER))
    assert kept.kind == "extra_step"
    assert contradiction(kept.sentence, [_record(params + COUNTERS_DIFFER)]) is None


def test_a_factor_on_one_group_of_the_update_is_said_for_that_group():
    bad = [_leaf("param", "embed.embedding", False, 10.0, (10.0, 10.0))]
    leaves = bad + [_leaf("param", "head.kernel", True), _leaf("param", "hidden.kernel", True)]
    record = _record(leaves + COUNTERS_MATCH)
    form = checked_form(_extra_step(10.0), "parameters", bad, leaves, record)
    assert form.sentence.startswith(
        "the update of embed.embedding is 10 x the reference's (spread 10..10); every other update matches: a "
        "learning rate 10 x for these leaves (a parameter group's learning rate or multiplier)"
    )
    whole = Form(
        "factor",
        "a constant factor 0.5 on all 3 leaves: one scale of the whole update",
        0.5,
        (0.5, 0.5),
        leaves=1,
    )
    assert "whole update" not in checked_form(whole, "parameters", bad, leaves, record).sentence
    assert contradiction(whole.sentence, [record]) == "one scale of the whole update"
    # a matching parameter whose change is rounding noise (reference_change 1e-6 x |0.5 - 1| < tolerance 1e-3)
    # is no evidence against the factor: the whole update stands
    noise = LeafError(0, "param", "attn.key.bias", 0.0, 0.0, 1e-3, True, reference_change=1e-6, shape=(4,))
    every = [_failing(e) for e in leaves]
    assert checked_form(whole, "parameters", every, [*every, noise], _record([*every, noise])) is whole
    assert contradiction(whole.sentence, [_record([*every, noise, *COUNTERS_MATCH])]) is None
    # every parameter fails by the factor: "the whole update" is true and kept
    every = [_failing(e) for e in leaves]
    assert checked_form(whole, "parameters", every, every, _record(every + COUNTERS_MATCH)) is whole
    assert contradiction(whole.sentence, [_record(every + COUNTERS_MATCH)]) is None
    # gradients are not an update: a form there is left alone
    assert checked_form(_extra_step(), "gradients", bad, leaves, record).kind == "extra_step"


def test_localize_rewrites_a_harness_form_the_counters_contradict():
    params = [
        _leaf("param", "a.kernel", False, 2.0, (2.0, 2.0)),
        _leaf("param", "b.bias", False, 2.0, (2.0, 2.0), (4,)),
    ]
    leaves = [
        _leaf("loss", "loss", True, shape=()),
        _leaf("grad", "a.kernel", True),
        *params,
        *COUNTERS_MATCH,
    ]
    loc = localize([_record(leaves, forms=[("parameters", _extra_step())])])
    assert loc.stage == "optimizer" or loc.stage == "parameters"
    assert "optimizer steps instead of one" not in loc.text()
    assert "every update is 2 x the reference's" in loc.text()


# ------------------------------------------------------------------------ a loss that differs, reaching some leaves


def test_a_differing_loss_names_the_parameters_its_difference_reaches():
    grads = [
        _leaf("grad", "router.kernel", False, 0.6, (0.2, 1.0)),
        _leaf("grad", "experts.w_in", True),
        _leaf("grad", "head.kernel", True),
    ]
    sentence = forward_group(grads, {})
    assert sentence.startswith(
        "the loss's difference reaches the gradients of router.* only (1 of 3 gradient leaves; every other "
        "gradient matches;"
    )
    assert "an auxiliary term" in sentence
    loc = localize([_record([_leaf("loss", "loss", False, 0.6, shape=()), *grads])])
    assert loc.stage == "forward" and loc.group == sentence
    # every gradient differs too (or none): no term is singled out
    every = forward_group([_failing(e) for e in grads], {})
    assert every == f"the loss's difference reaches every gradient: all {len(grads)} gradient leaves differ"
    assert forward_group([_leaf("grad", "a", True)], {}) == ""
    assert forward_group([], {}) == ""


# ------------------------------------------------------------- optimizer state grouped as the parameters it is of

PARAMS = (
    "blocks.0.attn.kernel",
    "blocks.0.mlp.down.bias",
    "blocks.1.mlp.down.bias",
    "blocks.1.mlp.down.kernel",
)


def _state_record(failing):
    """Every parameter matches; the optimizer state (Adam's mu, nu) of the parameters ``failing`` differs."""
    state = [_leaf("opt_state", f"0.{m}.{p}", p not in failing) for m in ("mu", "nu") for p in PARAMS]
    params = [_leaf("param", p, True) for p in PARAMS]
    return _record([_leaf("loss", "loss", True, shape=()), *params, *state, *COUNTERS_MATCH])


def test_failing_optimizer_state_is_grouped_by_its_parameters_as_the_localization_groups_it():
    """The trial's shard_map step that reduced blocks.1.mlp.down's gradients over 'data' only: the localization's
    group named blocks.1.mlp.down, the ``localized`` finding said its state leaves (all under ``0``, as every state
    leaf is) "share no ndim, name or module"."""
    record = _state_record({"blocks.1.mlp.down.bias", "blocks.1.mlp.down.kernel"})
    found = rules.localized(rules.DiagnosisContext.build([record]))
    group = "every failing leaf is under blocks.1.mlp.down; every other leaf matches"
    assert found.code == "localized" and f"{group[0].upper()}{group[1:]}." in found.message
    assert "share no" not in found.message and "the optimizer state differs (4 of 8 leaves)" in found.message
    assert localize([record]).group == group
    # parameters that share nothing either: the failing leaves are listed, as before
    record = _state_record({"blocks.0.mlp.down.bias", "blocks.1.mlp.down.kernel"})
    found = rules.localized(rules.DiagnosisContext.build([record]))
    assert "share no ndim, name or module that the matching ones lack" in found.message
    # the state of one parameter both fails and matches (nu of the bias): no parameter split; the localization's
    # group, read from the copies that disagree, names the module and the finding says it too
    leaves = [
        e if e.path != "0.nu.blocks.1.mlp.down.bias" else _leaf("opt_state", e.path, True)
        for e in _state_record({"blocks.1.mlp.down.bias", "blocks.1.mlp.down.kernel"}).leaves
    ]
    record = _record(leaves)
    assert "share no ndim" in rules.localized(rules.DiagnosisContext.build([record])).message
    differ = ("opt_state 0.mu.blocks.1.mlp.down.bias", "opt_state 0.mu.blocks.1.mlp.down.kernel")
    record = dataclasses.replace(record, replica_mismatches=differ, replica_axes=("data",))
    copies = (
        "every leaf whose copies differ is under blocks.1.mlp.down; every other leaf has copies that agree"
    )
    assert localize([record]).group == copies  # said of the copies (the replicas stage's group)
    found = rules.localized(rules.DiagnosisContext.build([record]))
    assert f"{copies[0].upper()}{copies[1:]}." in found.message and "share no" not in found.message
    # a property of the state's own paths is kept: only mu differs
    mu = [_leaf("opt_state", f"0.{m}.{p}", m == "nu") for m in ("mu", "nu") for p in PARAMS]
    record = _record([_leaf("loss", "loss", True, shape=()), *mu, *COUNTERS_MATCH])
    assert (
        "Every failing leaf is under 0.mu.blocks; every other leaf matches."
        in rules.localized(rules.DiagnosisContext.build([record])).message
    )


def test_wording_counts_leaves_and_articles():
    from shardcheck.parity.diagnosis.grouping import n_leaves, shared_property
    from shardcheck.parity.diagnosis.topology import name_leaves

    failing = {f"{name}.kernel": (4, 4) for name in ("up", "down", "gate", "proj", "out")}
    matching = {"k.bias": (4,), "q.bias": (4,)}
    # the two that match are counted with the rest: 7 leaves, 5 of them differ
    assert shared_property(failing, {**matching, "x.kernel": (4, 4)}).startswith("the failing leaves")
    # modules named alike but for a number (m0 ... m4) are a group (trial 37: head1, head2)
    numbered = {f"m{i}.kernel": (4, 4) for i in range(5)}
    assert shared_property(numbered, {**matching, "x.kernel": (4, 4)}) == (
        "every failing leaf is under m* (m0, m1, m2, m3, m4); every other leaf matches"
    )
    assert (
        shared_property({**failing, "z.bias": (4,)}, matching) == "all 8 leaves but k.bias and q.bias differ"
    )
    assert (
        shared_property({"embed.embedding": (8, 4)}, {"a.kernel": (4, 4)})
        == "every failing leaf is an embedding; every kernel matches"
    )
    assert (
        shared_property({"a.bias": (4,)}, {"a.kernel": (4,)})
        == "every failing leaf is a bias; every kernel matches"
    )
    assert (n_leaves(1), n_leaves(2)) == ("1 leaf", "2 leaves")
    state = [f"opt_state 0.mu.blocks.{i}.bias" for i in range(6)]
    assert name_leaves(state).startswith("the 6 leaves (opt_state 0.mu.blocks.0.bias,")
    assert name_leaves([f"param block.{i}.bias" for i in range(6)]).startswith("the 6 leaves under 'block' (")


def test_a_gradient_factor_names_no_learning_rate_and_an_update_factor_may():
    """A constant factor read from the exposed gradients is upstream of the optimizer (a loss normalization); one
    read from the update alone may also be a learning rate (a user's trial: 'a wrong loss normalization or
    learning rate?' was said of gradients 43 x the reference's)."""
    grads = [_leaf("grad", p, False, 3.0, (3.0, 3.0)) for p in ("w", "b")]
    params = [_leaf("param", p, False, 3.0, (3.0, 3.0)) for p in ("w", "b")]
    from_grads = rules.diagnose([_record([*grads, *params, *COUNTERS_MATCH])], 2)
    scaled = next(d for d in from_grads if d.code == "scaled")
    assert "(a wrong loss normalization?)" in scaled.message and "learning rate" not in scaled.message
    from_update = rules.diagnose([_record([*params, *COUNTERS_MATCH])], 2)
    scaled = next(d for d in from_update if d.code == "scaled")
    assert "(a wrong loss normalization or learning rate?)" in scaled.message


def test_rounding_level_leaves_are_said_checked_through_what_was_observed():
    """Where the candidate returned no gradients, the rounding-level note does not say those leaves were checked
    through their gradients (a user's trial: it did, beside 'the gradients: not observed')."""
    state = [
        _leaf("opt_state", "0.mu.w", False, 3.0, (3.0, 3.0)),
        _leaf("param", "w", False, 3.0, (3.0, 3.0)),
    ]
    grads = [_leaf("grad", "w", False, 3.0, (3.0, 3.0))]

    def note(leaves):
        record = dataclasses.replace(_record([*leaves, *COUNTERS_MATCH]), unresolved=("param key.bias",))
        return next(d for d in rules.diagnose([record], 2) if d.code == "rounding_level").message

    assert "checked through their optimizer state (no gradients returned)" in note(state)
    assert "checked through their gradients and optimizer state" in note([*grads, *state])


def test_rounding_level_leaves_that_fail_beyond_the_propagated_tolerance_are_said_to():
    """A rounding-level leaf's parameter compared within the propagated tolerance can still fail it (a learning
    rate of 0 in the reference, not in the candidate): the note then does not leave "cannot be compared" beside
    a group that counts it as failing (a user's trial)."""
    leaves = [_leaf("param", "w", False, 3.0, (3.0, 3.0)), _leaf("param", "key.bias", False)]

    def note(leaves):
        record = dataclasses.replace(_record([*leaves, *COUNTERS_MATCH]), unresolved=("param key.bias",))
        return next(d for d in rules.diagnose([record], 2) if d.code == "rounding_level").message

    failing = note(leaves)
    assert (
        "Even so, param key.bias differs beyond that tolerance (step 0, param key.bias: max abs err 1 > "
        in failing
    )
    assert "more than rounding noise, counted with the failing leaves" in failing
    assert "Even so" not in note([leaves[0], _leaf("param", "key.bias", True)])


def test_the_rounding_level_note_names_its_steps_where_not_every_step_had_them():
    """A reference at a learning rate of 0 resolves nothing at step 0 (every leaf compared, and failing where
    the candidate moved it): the note about later steps' rounding-level leaves says which steps it means."""
    leaves = [_leaf("param", "w", False, 3.0, (3.0, 3.0)), *COUNTERS_MATCH]
    quiet = ("param key.bias",)
    records = [
        _record(leaves),
        *(dataclasses.replace(_record(leaves), step=t, unresolved=quiet) for t in (1, 2)),
    ]
    note = next(d for d in rules.diagnose(records, 2) if d.code == "rounding_level").message
    assert note.startswith("1 leaf has a gradient at rounding level at steps 1 and 2 (e.g. param key.bias")
    every = [dataclasses.replace(r, unresolved=quiet) for r in records]
    note = next(d for d in rules.diagnose(every, 2) if d.code == "rounding_level").message
    assert note.startswith("1 leaf has a gradient at rounding level (e.g. param key.bias")


def test_a_factor_on_every_gradient_is_one_scale_of_the_loss_and_its_weight_is_named():
    """A loss sum not divided by its token count (a user's trial: factor 43, said as "a scale applied to these
    leaves only" although every gradient but the rounding-level ones had it): every gradient that can show the
    factor carries it, so it is one scale of the whole loss, and a factor equal to the batch's total loss weight
    is named as that weight."""
    bad = [_leaf("grad", p, False, 43.0, (43.0, 43.0)) for p in ("w", "b")]
    # a rounding-level gradient: its reference (|g| = 1e-9) could not show x43 beyond its tolerance
    quiet = LeafError(0, "grad", "key.bias", 1e-9, 1.0, 1e-3, True, 0.4, None, (-2.0, 5.0), (4,))
    form = Form("factor", "a constant factor 43 ...: these values scaled by one factor", 43.0, (43.0, 43.0))
    record = dataclasses.replace(_record([*bad, quiet, *COUNTERS_MATCH]), loss_weight=43.0)
    said = checked_form(form, "gradients", bad, [*bad, quiet], record).sentence
    assert said.startswith("every gradient but the 1 too small to show it (at rounding level) is 43 x")
    assert "43 is this batch's total loss weight (43: the count the (loss_sum, weight) loss returns" in said
    assert "the loss sum was not divided by its weight" in said
    unweighted = checked_form(form, "gradients", bad, [*bad, quiet], _record([*bad, quiet])).sentence
    assert "a loss sum not divided by its count" in unweighted and "total loss weight" not in unweighted
    # a gradient that would show the factor matches: the factor is these leaves' own, as fitted
    shows = _leaf("grad", "head.kernel", True)
    assert checked_form(form, "gradients", bad, [*bad, shows], record) is form
    # the catalog's sentence names it too, and a factor that is not the weight is not called it
    state = [_leaf("opt_state", f"0.mu.{p}", False, 43.0, (43.0, 43.0)) for p in ("w", "b")]
    stepped = dataclasses.replace(_record([*bad, quiet, *state, *COUNTERS_MATCH]), loss_weight=43.0)
    scaled = next(d for d in rules.diagnose([stepped], 2) if d.code == "scaled").message
    assert "43 is this batch's total loss weight" in scaled
    other = dataclasses.replace(stepped, loss_weight=40.0)
    assert "loss weight" not in next(d for d in rules.diagnose([other], 2) if d.code == "scaled").message


def test_a_replays_ratio_range_says_it_was_read_from_its_recorded_samples():
    """A replay reads a leaf's ratio over its few recorded samples, a live check over every element: the range
    says which (a user's trial: one leaf's range differed between the two reports, unsaid)."""
    live = _leaf("opt_state", "0.mu.w", False, 2.3, (-3.0, 7.5))
    replayed = dataclasses.replace(live, samples=8)
    assert "(10th-90th percentile), median 2.3" in rules._stage_form([live])
    assert "(10th-90th percentile of its 8 recorded samples), median 2.3" in rules._stage_form([replayed])
    assert "of its 8 recorded samples" in form_from_leaves([replayed]).sentence
    factor = [dataclasses.replace(_leaf("param", p, False, 2.0, (2.0, 2.0)), samples=8) for p in ("w", "b")]
    assert "2..2, 10th-90th percentile of its 8 recorded samples)" in form_from_leaves(factor).sentence
    assert (
        "recorded samples"
        not in form_from_leaves([dataclasses.replace(f, samples=None) for f in factor]).sentence
    )


# ------------------------------------------------------------------- a third user's trial: sentences the records refute


def _codes_of(records, **kw):
    return {d.code: d.message for d in rules.diagnose(records, 2, **kw)}


def test_a_bfloat16_reduction_is_not_said_where_the_gradients_match_or_the_update_is_computed_otherwise():
    """A weight decay applied to norm scales moved them by less than bfloat16's rounding bound: the hypothesis
    matched, yet the gradients all match (a reduction's rounding would show there) -- a user's trial read
    'the gradients were all-reduced in bfloat16' beside 'the gradients: matches'."""
    params = [_leaf("param", "ln.scale", False, 1.1, (0.9, 1.3)), _leaf("param", "w", True)]
    grads_ok = [_leaf("grad", "ln.scale", True), _leaf("grad", "w", True)]
    refuted = dataclasses.replace(_record([*grads_ok, *params, *COUNTERS_MATCH]), matches=("bf16_reduction",))
    assert "low_precision_reduction" not in _codes_of([refuted])
    grads_off = [_leaf("grad", "ln.scale", False, 1.001, (0.99, 1.01)), _leaf("grad", "w", True)]
    shown = dataclasses.replace(_record([*grads_off, *params, *COUNTERS_MATCH]), matches=("bf16_reduction",))
    assert "low_precision_reduction" in _codes_of([shown])
    # the optimizer on the candidate's own gradients gives another update: downstream of any reduction
    rerun = (_leaf("param", "ln.scale", False),)
    assert "low_precision_reduction" not in _codes_of([dataclasses.replace(shown, optimizer_rerun=rerun)])


def test_gradients_that_differ_under_a_matching_update_are_the_applied_ones_where_the_optimizer_rerun_says_so():
    """A replay with a clip that binds (a user's trial): 'the reported gradients are not the ones applied' is
    false where the reference's optimizer on those gradients gives the candidate's update."""
    grads = [_leaf("grad", "router", False, 0.8, (-0.1, 1.6)), _leaf("grad", "w", True)]
    record = _record([*grads, _leaf("param", "router", True), *COUNTERS_MATCH])
    assert "are not the ones applied" in _codes_of([record])["grads_differ"]
    applied = dataclasses.replace(record, optimizer_rerun=(_leaf("param", "router", True),))
    said = _codes_of([applied])["grads_differ"]
    assert "they are the ones applied, and the optimizer's update does not show their difference" in said
    assert "not the ones applied" not in said and "loss weight" not in said
    # gradients one factor across that is the batch's loss weight: the cause is named (a replay of a sum for a mean)
    summed = [
        _leaf("grad", "router", False, 89.0, (89.0, 89.0)),
        _leaf("grad", "w", False, 89.0, (89.0, 89.0)),
    ]
    weighted = dataclasses.replace(applied, leaves=(*summed, *applied.leaves[2:]), loss_weight=89.0)
    said = _codes_of([weighted])["grads_differ"]
    assert "They are 89 x the reference's: 89 is this batch's total loss weight" in said


def test_a_factor_is_not_claimed_for_a_gradient_whose_ratio_is_not_constant_across_it():
    """A psum over one of two batch axes for one module: its gradient's median ratio 0.78 runs -0.07..1.62
    (a user's trial read '0.7833 x the reference's: a constant factor')."""
    spread = [_leaf("grad", "router", False, 0.7833, (-0.07, 1.62)), _leaf("grad", "w", True)]
    state = [_leaf("opt_state", "0.mu.router", False, 0.78, (-0.07, 1.62))]
    codes = _codes_of([_record([*spread, *state, *COUNTERS_MATCH])])
    assert "scaled" not in codes and not any("0.7833 x" in m for m in codes.values())


def test_a_factor_on_some_gradients_is_not_blamed_on_the_loss_and_blindness_needs_its_evidence():
    """A factor on one module's gradients: not 'a wrong loss normalization?' (every other gradient matches);
    'an optimizer blind to the gradient's scale' only where the harness's rerun showed it (scale_blind)."""
    grads = [
        _leaf("grad", "head.kernel", False, 3.0, (3.0, 3.0)),
        LeafError(0, "grad", "w", 0.0, 0.0, 1e-3, True, 1.0, None, (1.0, 1.0), (4, 4)),
    ]
    grads[1] = dataclasses.replace(grads[1], max_rel_err=1e-6, max_abs_err=1e-6)  # |ref| = 1: would show x3
    state = [_leaf("opt_state", "0.mu.head.kernel", False, 3.0, (3.0, 3.0))]
    scaled = _codes_of([_record([*grads, *state, *COUNTERS_MATCH])])["scaled"]
    assert "a scale applied to these gradients only" in scaled and "loss normalization" not in scaled
    blind = dataclasses.replace(_record([*grads, *COUNTERS_MATCH]), matches=("scale_blind",))
    assert "an optimizer blind to the gradient's scale" in _codes_of([blind])["scaled"]


def test_an_optimizer_stepped_k_times_for_k_other_than_the_shard_count_is_not_said_once_per_shard():
    """Stepped per micro-batch (k = 2) on S = 4 shards: 'once per shard' would be false (a user's trial)."""
    record = _record([_leaf("param", "w", False, 2.0, (2.0, 2.0)), *COUNTERS_DIFFER])
    record = dataclasses.replace(record, candidate_step_count=2)
    said = {d.code: d.message for d in rules.diagnose([record], 4)}["step_counter"]
    assert "stepped 2 times per step" in said and "once per micro-batch of an accumulation loop" in said
    assert "once per shard (S=" not in said
    four = dataclasses.replace(record, candidate_step_count=4)
    said = {d.code: d.message for d in rules.diagnose([four], 4)}["step_counter"]
    assert (
        "once per shard (S=4) instead of once after the reduction, or once per micro-batch of a 4-micro-batch"
        in (said)
    )  # trial 53: 2 micro-batches on S = 2 read "once per shard" alone


def test_small_gradients_are_not_called_zero_and_matching_parameters_are_not_only_the_loss():
    """A fourth user's trial (each shard's gradient clipped to a tiny norm before the psum, a warm-up's lr 0 at
    step 0): gradients 7e-4 x the reference's were called 'a zero update ... these values are zero', and 'Only
    the loss matches' was said beside 12 of 12 matching parameters."""
    rng = np.random.default_rng(1)
    ref = {"w": rng.normal(size=(4, 4)), "b": rng.normal(size=4)}
    small = {k: 7e-4 * v * (1 + 0.3 * rng.normal(size=v.shape)) for k, v in ref.items()}
    form = fit_form({}, ref, small, update=False)
    assert form.kind == "none" and "these values are zero" not in form.sentence
    assert fit_form({}, ref, {k: np.zeros_like(v) for k, v in ref.items()}, update=False).kind == "zero"
    # an update that small is still a zero update (the candidate did not move the parameters)
    before = {k: v + 1.0 for k, v in ref.items()}
    moved = {k: before[k] + 1e-2 * v for k, v in ref.items()}
    assert fit_form(before, moved, {k: before[k] + 1e-6 * v for k, v in ref.items()}).kind == "zero"
    # the gradients and the optimizer state differ, every parameter matches: not "only the loss matches"
    leaves = [
        _leaf("loss", "loss", True, shape=()),
        _leaf("grad", "w", False, 7e-4, (4e-4, 1e-3)),
        _leaf("opt_state", "0.mu.w", False, 7e-4, (4e-4, 1e-3)),
        _leaf("param", "w", True),
        *COUNTERS_MATCH,
    ]
    codes = _codes_of([_record(leaves)])
    assert "loss_only" not in codes and "the gradients differ (1 of 1 leaf" in codes["localized"]
    every = [_failing(e) if e.kind == "param" else e for e in leaves]
    assert "Only the loss matches" in _codes_of([_record(every)])["loss_only"]


def test_an_unexplained_update_names_the_forward_pass_where_the_module_probe_found_a_module():
    """A tensor-parallel output not psum-ed (a fourth user's trial): 'shards applied one after another,
    gradients taken at different parameters' is false where a module's output already differs at equal
    parameters; the finding says the forward pass as sharded, from that module on."""
    from shardcheck.parity.diagnosis.module_outputs import ModuleFinding

    leaves = [
        _leaf("loss", "loss", False, 1.01, (1.01, 1.01), shape=()),
        _leaf("grad", "w", False, 0.9, (-0.5, 2.0)),
        _leaf("param", "w", False, 0.9, (-0.5, 2.0)),
        *COUNTERS_MATCH,
    ]
    plain = _codes_of([_record(leaves)])["update_differs"]
    assert "shards applied one after another" in plain
    found = ModuleFinding("differs", "blocks.0.mlp.__call__", 2.3, 4e-5, 9, 13, "mesh data=2 x model=2")
    probed = _codes_of([dataclasses.replace(_record(leaves), module=found)])["update_differs"]
    assert (
        "a wrong loss: at equal parameters the forward pass as sharded computes another function, from "
        in probed
    )
    assert "blocks.0.mlp.__call__" in probed and "shards applied one after another" not in probed


def test_a_decay_form_says_it_cannot_show_on_leaves_of_zeros():
    """A decay applied to biases and norm scales after a warm-up step at lr 0 (a fourth user's trial): the
    biases are still 0, so only the scales differ, and 'every bias matches' must not read as 'not decayed'."""
    rng = np.random.default_rng(2)
    before = {"scale": 1 + 0.1 * rng.normal(size=8)}
    ref = {"scale": before["scale"] + 1e-3 * rng.normal(size=8)}
    cand = {"scale": ref["scale"] - 5e-4 * before["scale"]}
    form = fit_form(before, ref, cand, lr=5e-3)
    assert form.kind == "decay" and form.coefficient == pytest.approx(0.1, rel=1e-6)
    assert "a decay moves no leaf whose value is 0" in form.sentence


# ------------------------------------------------------------------------------------------- non-finite values


def test_a_nan_in_the_candidate_is_said_as_nan_and_no_ratio_or_form_is_read_from_it():
    nan = LeafError(
        0, "loss", "loss", float("nan"), float("nan"), 3e-5, False, float("nan"), None, (np.nan, np.nan)
    )
    grad = LeafError(0, "grad", "h.bias", float("nan"), float("nan"), 6e-6, False, shape=(4,))
    param = LeafError(0, "param", "h.bias", float("inf"), float("inf"), 1e-6, False, shape=(4,))
    record = StepRecord(0, 1e-5, 1e-7, 1.5, float("nan"), (nan, grad, param, *COUNTERS_MATCH), 1, 1)
    found = rules.diagnose([record])
    codes = [d.code for d in found]
    assert codes[0] == "non_finite" and not set(codes) & rules.NAN_BLIND, codes
    assert found[0].message.startswith("The candidate's loss is nan at step 0, the reference's 1.5: NaN or ")
    assert "first in loss (2 leaves in all)" in found[0].message and "jax_debug_nans" in found[0].message
    where = localize([record])
    assert where.form.sentence == "not finite (NaN or infinity) in the one failing leaf: no form is read"
    assert "loss: not finite (max abs err nan)" in where.text() and "tolerance nan" not in where.text()
    # the same step with finite errors: no non_finite, and the catalog reads it as before
    finite = dataclasses.replace(
        record,
        candidate_loss=1.6,
        leaves=tuple(
            dataclasses.replace(e, max_abs_err=1.0, ratio=None, spread=None) if not e.ok else e
            for e in record.leaves
        ),
    )
    assert "non_finite" not in [d.code for d in rules.diagnose([finite])]
    assert "not finite" not in localize([finite]).text()


# ------------------------------------------------------------------- causes the forward stage already rules out


def test_a_loss_that_differs_first_is_said_as_a_loss_computed_another_way_or_at_other_parameters():
    """Trial 6 (label smoothing dropped in the sharded step): "First difference ...: the forward pass" and "every
    module's output matches", then the catalog's generic "(shards applied one after another, gradients taken at
    different parameters, or a wrong loss)" read as if it ignored them. The loss a step returns can still differ
    because it was taken at other parameters (tests/test_parity.py's sequential step: each shard after the
    previous one's update), so that stays a cause; what the records show is said first, and where every module
    matched, that the difference lies around the modules."""
    from shardcheck.parity.diagnosis.module_outputs import ModuleFinding

    def leaf(kind, path, ok, ratio=None, spread=None):
        err = 0.0 if ok else 1e-3
        return LeafError(0, kind, path, err, err, 1e-5, ok, ratio, None, spread, (4, 4))

    grads = [leaf("grad", f"l{i}.kernel", False, 1.02, (0.91, 1.09)) for i in range(4)]
    params = [leaf("param", f"l{i}.kernel", True) for i in range(4)]
    moments = [leaf("opt_state", f"0.mu.l{i}.kernel", False, 1.02, (0.9, 1.1)) for i in range(4)]
    loss = leaf("loss", "loss", False, 0.9969, (0.9969, 0.9969))
    record = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (loss, *grads, *params, *moments, *COUNTERS_MATCH), 1, 1)
    mesh = {"data": 2, "model": 2}
    cleared = ModuleFinding(
        status="matches", max_abs_err=1e-6, tolerance=1e-4, matched_before=26, compared=26
    )
    said = {}
    for name, module in (("cleared", cleared), ("unprobed", None)):
        found = rules.diagnose([dataclasses.replace(record, module=module)], mesh_shape=mesh)
        said[name] = next(d.message for d in found if d.code == "update_differs")
        assert "the loss it returns is not the full-batch loss at its starting parameters" in said[name], name
        assert "or taken at other parameters (shards applied one after another)" in said[name], name
        assert "gradients taken at different parameters" not in said[name], name
    assert "no captured module's output differs while its inputs match" in said["cleared"]
    assert "collectives the step runs around the modules itself" in said["cleared"]
    # trial 11: a segment_max in the step's own call of a module, which the probe (the task's loss) never runs
    assert "or in modules as the step's own code calls them)" in said["cleared"]
    assert "captured module" not in said["unprobed"]
    # the loss matching (a later stage first): not said as a loss that differs
    later = dataclasses.replace(record, leaves=(leaf("loss", "loss", True), *grads, *params, *moments))
    assert "the loss it returns" not in " ".join(d.message for d in rules.diagnose([later]))


def test_a_replays_late_failure_is_not_said_as_state_not_carried():
    """Trial 6 (a decay-mask fault replayed): "drift: state not carried between steps correctly (optimizer state
    reset or shared?)" of a replay, which cannot rerun the step from the reference's state to tell that from a
    fault starting there or from differences within tolerance growing past it; the live check's drift keeps its
    words."""

    def leaf(kind, path, ok):  # a failing update of no one factor (its ratio runs 0.5..1.2)
        if ok:
            return LeafError(2, kind, path, 0.0, 0.0, 1.6e-4, True, shape=(4,))
        return LeafError(2, kind, path, 2e-4, 2e-4, 1.6e-4, False, 0.93, 1.0, (0.5, 1.2), (4,))

    leaves = (leaf("loss", "loss", True), leaf("grad", "ln.scale", True), leaf("param", "ln.scale", False))
    rerun = (leaf("param", "ln.scale", True),)
    live = StepRecord(2, 1e-5, 1e-7, 1.0, 1.0, leaves, 3, 3, optimizer_rerun=rerun)
    earlier = [StepRecord(t, 1e-5, 1e-7, 1.0, 1.0, (), t + 1, t + 1) for t in range(2)]
    said = {}
    for replayed in (False, True):
        records = [*earlier, dataclasses.replace(live, replayed=replayed)]
        said[replayed] = next(d.message for d in rules.diagnose(records) if d.code == "drift")
    assert "state not carried between steps correctly (optimizer state reset or shared?)" in said[False]
    assert (
        "reset" not in said[True]
        and "A replay cannot rerun step 2 from the recorded run's state" in said[True]
    )
    assert "a live check (verify without --against) reruns the step" in said[True]


def test_a_stage_whose_only_matching_leaves_are_at_rounding_level_says_so():
    """Trial 6 (a schedule read one step ahead, replayed): "the failing leaves (...) share no ndim, name or module
    that the matching ones lack", where the matching ones were the 7 leaves allowed their rounding noise."""
    from shardcheck.parity.diagnosis.grouping import state_property

    failing = {"a.kernel": (4, 4), "b.bias": (4,), "c.scale": (4,), "d.kernel": (4, 4)}
    matching = {"q.bias": (4,), "up.kernel": (4, 4)}
    params = {**failing, **matching}
    said = state_property(failing, matching, params, quiet={"q.bias", "up.kernel"})
    assert said == (
        "every leaf differs but those with elements whose gradient is at rounding level (near 0 at that step: a "
        "true gradient of 0, such as an attention key bias's, or one small by chance), allowed their noise: "
        "q.bias, up.kernel"
    )
    # one matching leaf that is not at rounding level: not said
    assert "every leaf differs" not in state_property(failing, matching, params, quiet={"q.bias"})


def test_an_infinite_error_of_a_missing_leaf_is_not_called_a_nan():
    """Trial 7: a candidate's optimizer state laid out otherwise (no view_optimizer) gave every task state leaf an
    infinite error (missing), and the report said "The candidate's step produced non-finite values ... NaN or
    infinity": a NaN is read from a NaN error or a non-finite candidate loss only."""
    missing = LeafError(0, "opt_state", "0.count", float("inf"), float("inf"), 0.0, False, shape=())
    loss = LeafError(0, "loss", "loss", 0.0, 0.0, 1e-5, True)
    record = StepRecord(0, 1e-5, 1e-7, 1.5, 1.5, (loss, missing, *COUNTERS_MATCH), 1, 1)
    assert "non_finite" not in [d.code for d in rules.diagnose([record])]
    nan = dataclasses.replace(missing, max_abs_err=float("nan"))
    assert rules.diagnose([dataclasses.replace(record, leaves=(loss, nan))])[0].code == "non_finite"
    lost = dataclasses.replace(
        record,
        candidate_loss=float("inf"),
        leaves=(dataclasses.replace(loss, max_abs_err=float("inf"), ok=False), missing),
    )
    found = rules.diagnose([lost])[0]
    assert (
        found.code == "non_finite"
        and "first in loss. " in found.message
        and "leaves in all" not in found.message
    )


def test_copies_of_every_parameter_are_counted_as_parameters_leaves():
    """Trial 51: a replay whose every parameter's copies differed said "Group: all 6 leaves differ" and, after "the
    optimizer state differs (9 of 12 leaves)", "All 6 leaves differ": read as a contradiction. The replicas stage
    counts parameters (a state leaf read as its parameter's), and now says so."""
    shape = {p: (4,) if p.endswith("bias") else (4, 4) for p in PARAMS}  # 1-D and 2-D: no shared ndim
    params = [_leaf("param", p, False, shape=shape[p]) for p in PARAMS]
    state = [
        _leaf("opt_state", f"0.{m}.{p}", m == "nu", shape=shape[p]) for m in ("mu", "nu") for p in PARAMS
    ]
    record = _record([_leaf("loss", "loss", True, shape=()), *params, *state])
    differ = tuple(f"param {p}" for p in PARAMS) + tuple(f"opt_state 0.mu.{p}" for p in PARAMS)
    record = dataclasses.replace(record, replica_mismatches=differ, replica_axes=("fsdp",))
    assert localize([record]).group == f"the copies of all {len(PARAMS)} parameters' leaves differ"
    # a stage's group of one kind names the kind: "all 4 parameter leaves differ", not "all 4 leaves"
    only_params = _record([_leaf("loss", "loss", True, shape=()), *params])
    assert localize([only_params]).group.startswith(f"all {len(PARAMS)} parameter leaves differ")


def test_a_loss_near_one_over_s_but_not_within_its_tolerance_is_one_shards_unreduced_loss():
    """Trial 54: a tensor-parallel step returned shard 0's ``local_sum / global_count`` (never psum-ed over
    ``data``), 4.2027 against 8.2717 (0.5081 x), and read "the loss was averaged twice (or divided by S=2 twice):
    x1/2". One number divided by S once too often is 1/S to its rounding; 0.5081 is not, and is now said as one
    shard's part of the loss. An exact 1/2 is still a loss averaged twice."""
    loss = LeafError(0, "loss", "loss", 4.069, 0.492, 1e-5, False, None, None, None, ())
    grads = _leaf("grad", "w", True)
    for candidate, said in (
        (4.202737, "near 1/2 but not 1/2 within the loss's tolerance (0.0669 > 1e-05)"),
        (8.271729 / 2, "the loss was averaged twice (or divided by S=2 twice): x1/2"),
    ):
        record = StepRecord(0, 1e-5, 1e-7, 8.271729, candidate, (loss, grads, *COUNTERS_MATCH), 1, 1)
        message = {d.code: d.message for d in rules.diagnose([record], 2)}["loss_differs"]
        assert said in message, message
    near = {
        d.code: d.message for d in rules.diagnose([dataclasses.replace(record, candidate_loss=4.202737)], 2)
    }
    assert (
        "one shard's part of the loss returned without its reduction over the batch shards"
        in near["loss_differs"]
    )
    assert "averaged twice" not in near["loss_differs"]
