"""The forward stage's form is said of what it scales, never as an update (issue #36, from the FAIL audit,
``benchmarks/fail_audit.py``).

A loss at equal parameters k x the reference's was said "the update is k x the reference's, as k optimizer steps
instead of one produce" (a contradiction where the counters match: the zoo's conv ``count_pmeaned``, the summed
micro-gradient of ``tests/test_verdict.py``) or "one scale of the whole update" (``aux_loss_over_dp`` of the bug
reports); a forward pass run twice (the zoo's counter ``counted_twice``) read "another loss" while the loss
matched, and its replay PASSed (a recording kept no counter the forward pass writes). Hand-built records (no
JAX), then the counter model live and replayed.
"""

from __future__ import annotations

from pathlib import Path

from conftest import require_devices, zoo_module

from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.localization import contradiction, localize
from shardcheck.parity.harness.recorded import record_run

TOL = 1e-3


def _leaf(kind, path, ratio=None, *, ok=True, size=1.0):
    """A leaf of reference size ``size``: within tolerance, or off by ``ratio`` (a constant factor, spread 0)."""
    if ok:
        return LeafError(0, kind, path, TOL / 2, TOL / 2 / size, TOL, True, None, None, None, (4,))
    err = abs(ratio - 1) * size
    return LeafError(0, kind, path, err, err / size, TOL, False, ratio, None, (ratio, ratio), (4,))


def _record(loss, grads, counters=()):
    leaves = (loss, *grads, _leaf("param", "a.kernel"), _leaf("counter", "step"), *counters)
    return StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, leaves, 1, 1)


def _said(loc, records):
    text = loc.text()
    assert "optimizer steps instead of one" not in text and "update" not in loc.form.sentence
    assert contradiction(text, records) is None
    return text


def test_a_loss_scaled_with_every_gradient_that_can_show_it_is_the_whole_loss_scaled():
    """The loss x2 and 3 of 4 gradients x2; the 4th is rounding noise (size 1e-5: a factor 2 moves it 1e-5,
    below the tolerance 1e-3), so it is no evidence of a term."""
    grads = [_leaf("grad", f"{m}.kernel", 2.0, ok=False) for m in "abc"] + [
        _leaf("grad", "k.bias", size=1e-5)
    ]
    records = [_record(_leaf("loss", "loss", 2.0, ok=False), grads)]
    loc = localize(records)
    assert (loc.stage, loc.form.kind, loc.form.factor) == ("forward", "factor", 2.0)
    assert loc.group == (
        "the loss's difference reaches every gradient that can show it: 3 of 4 gradient leaves are 2 x the "
        "reference's; the other 1 (k.bias) is too small to show a factor 2 (rounding level)"
    )
    assert loc.form.sentence.endswith(
        ": the loss at equal parameters is 2 x the reference's; every gradient that can show it is 2 x too: the "
        "whole loss is scaled, its normalization differs (a sum for a mean, another count or divisor, a loss "
        "scale not undone)"
    )
    assert "the forward pass computes another loss at equal parameters" in _said(loc, records)


def test_a_loss_factor_with_some_gradients_matching_is_one_term_and_unseen_gradients_say_so():
    # a gradient of size 1 matches: it would have shown a factor 0.631 (0.369 > 1e-3); only router differs
    grads = [_leaf("grad", "router.kernel", 3.0, ok=False), _leaf("grad", "expert.kernel")]
    records = [_record(_leaf("loss", "loss", 0.631, ok=False), grads)]
    loc = localize(records)
    assert loc.group.startswith("the loss's difference reaches the gradients of router.* only (1 of 2")
    assert loc.form.sentence.endswith(
        ": the loss at equal parameters is 0.631 x the reference's; only some gradients differ: one term of the "
        "loss differs (the group); router.kernel: 3 x the reference's on every element (spread 3..3): where one "
        "term alone reaches these leaves, that term is this factor x the reference's (a term summed over the "
        "shards where a mean was due reads x S)"
    )
    assert "one scale of the whole update" not in _said(loc, records)
    # the candidate returned no gradients: nothing is told apart
    records = [_record(_leaf("loss", "loss", 4.0, ok=False), [])]
    loc = localize(records)
    assert loc.form.sentence.endswith(
        ": the loss at equal parameters is 4 x the reference's; its scale, its normalization or one of its terms "
        "differs (the gradients were not observed)"
    )
    assert (loc.group, loc.form.factor) == ("only loss differs", 4.0)
    _said(loc, records)


def test_a_counter_the_forward_pass_writes_twice_is_named_and_the_loss_is_not_said_to_differ():
    counter = _leaf("counter", "model.calls", 2.0, ok=False)
    records = [_record(_leaf("loss", "loss"), [_leaf("grad", "a.kernel")], (counter,))]
    loc = localize(records)
    assert (
        loc.stage == "forward"
        and loc.group == "only counter model.calls differs; every loss leaf of this stage matches"
    )
    assert loc.form.sentence == (
        "a factor 2: the forward pass's counter model.calls is 2 x the reference's: the forward pass ran 2 times "
        "a step"
    )
    text = _said(loc, records)
    assert "computes another loss" not in text
    assert (
        "First difference at step 0: the forward pass (loss) (the forward pass writes the model's state another "
        "way at equal parameters; the loss matches)." in text
    )
    # trial 35: the stage's count holds the counter too, and says so beside "the counters: matches" (now "the optimizer's counters")
    assert (
        "Stages: the forward pass (loss, and the model's state and RNG counts it writes): differs (0 of 1 loss leaf and 1 of 1 model-state counter"
        in text
    )


def _counter_zoo():
    return zoo_module(Path(__file__).resolve().parents[1] / "examples" / "zoo" / "counter.py")


@require_devices(4)
def test_a_forward_pass_run_twice_fails_replayed_as_live_on_its_counter():
    counter = _counter_zoo()
    mesh = make_mesh(counter.MESH)
    recording = record_run(counter.task, counter.step, mesh=mesh, steps=1)
    assert "counter model.calls" in recording.names
    live = check_parity(counter.counted_twice, counter.task, mesh=mesh, steps=1)
    replayed = check_parity(counter.counted_twice, counter.task, mesh=mesh, reference=recording)
    for report in (live, replayed):
        assert report.verdict == "FAIL" and report.codes[0] == "model_state", report.diagnosis
        calls = next(e for e in report.steps[0].leaves if e.name == "counter model.calls")
        assert (calls.ok, calls.max_abs_err, calls.ratio) == (False, 1.0, 2.0)  # 2 forward passes against 1
        assert report.localization.form.sentence == live.localization.form.sentence
        assert "the forward pass ran 2 times a step" in report.localization.form.sentence
    # the right step replayed against its own recording still passes
    assert check_parity(counter.step, counter.task, mesh=mesh, reference=recording).verdict == "PASS"


def test_a_loss_that_differs_in_every_gradient_but_the_rounding_level_ones_is_no_term_nor_an_update_scale():
    """The trial's tensor-parallel MLP whose output was not psum-ed over 'model': the loss 1.008 x and every
    gradient but the two attention key biases (rounding noise) differs, by several factors. It read "a term of
    the loss whose gradient reaches only these parameters (an auxiliary term ...)", and before 41dee08 "one scale
    of the whole update (a learning rate ...)"."""
    grads = [_leaf("grad", f"{m}.kernel", r, ok=False) for m, r in zip("abc", (1.5, 0.7, 2.2), strict=True)]
    quiet = [_leaf("grad", "k.bias", size=1e-5), _leaf("grad", "q.bias", size=1e-5)]
    records = [_record(_leaf("loss", "loss", 1.008, ok=False), grads + quiet)]
    loc = localize(records)
    assert loc.group == (
        "the loss's difference reaches every gradient but the rounding-level ones: 3 of 5 gradient leaves "
        "differ; the other 2 (k.bias, q.bias) are at rounding level (a true gradient of 0, such as an attention "
        "key bias's), too small to show a difference: the loss differs as a whole, not in a term that reaches "
        "only some parameters"
    )
    # no "a factor 1.008" head beside "not a scaled loss" (trial 31): the loss's ratio, no factor claimed
    assert loc.form.kind == "none" and loc.form.factor is None
    assert loc.form.sentence == (
        "the loss at equal parameters is 1.008 x the reference's; every gradient but the rounding-level ones "
        "differs, by no one factor: the forward pass computes another function of the parameters, not a scaled loss"
    )
    text = _said(loc, records)
    assert "auxiliary" not in text and "one term" not in text and "whole update" not in text
    # a matching gradient of size 1 would have shown the difference: then one term of the loss differs
    records = [_record(_leaf("loss", "loss", 1.008, ok=False), [*grads, _leaf("grad", "k.bias")])]
    loc = localize(records)
    assert "a term of the loss whose gradient reaches only these parameters" in loc.group
    assert (
        "only some gradients differ: one term of the loss differs (the group); b.kernel: 0.7 x the "
        "reference's on every element (spread 0.7..0.7); a.kernel: 1.5 x" in loc.form.sentence
    )


def test_a_lone_loss_factor_is_a_factor_where_the_later_moments_carry_it_or_its_square():
    """The zoo conv's ``count_pmeaned`` (a user's shard_map step, no gradients returned): the loss x4, Adam's first
    moments x4 and second moments x16, its update normalized (the parameters match). The later stages carry the
    factor, the second moments its square: a factor 4 (was "no factor is read from it", the nu leaves' 16 read as
    not carrying 4). Where a moment carries neither, no factor is claimed and the widest spread is said."""
    loss = _leaf("loss", "loss", 4.0, ok=False)
    moments = [
        _leaf("opt_state", "0.mu.a.kernel", 4.0, ok=False),
        _leaf("opt_state", "0.nu.a.kernel", 16.0, ok=False),
    ]
    records = [_record(loss, [], moments)]
    loc = localize(records)
    assert (loc.stage, loc.form.kind, loc.form.factor) == ("forward", "factor", 4.0)
    assert loc.form.sentence.endswith(
        "(the gradients were not observed); the 2 leaves of the later stages that differ carry it (1 x 4, 1 x 16: "
        "a second moment carries its square)"
    )
    _said(loc, records)
    spread = LeafError(0, "opt_state", "0.nu.a.kernel", 2.0, 2.0, TOL, False, 3.0, None, (0.5, 7.0), (4,))
    records = [_record(loss, [], [moments[0], spread])]
    loc = localize(records)
    assert (loc.form.kind, loc.form.factor) == ("none", None)
    assert loc.form.sentence.endswith(
        "; of the later stages, 0.nu.a.kernel has no constant factor: its elementwise ratio runs from 0.5 to 7 "
        "(10th-90th percentile), median 3"
    )
    _said(loc, records)


def test_moments_carrying_the_loss_factor_under_a_normalized_update_are_a_factor_the_parameters_excused():
    """Trial 49: a sum for a mean (x16) in a user's step under Adam (``eps=1e-2``, no gradients returned): the
    moments x16 and x256, the parameters off by no factor (Adam's update moves only through its epsilon). It read
    "the later stages that differ do not carry 16" beside "optimizer moments are 16 x the reference's"; now a
    factor 16 whose moments carry it and whose parameters are said as a normalized update's. Without a second
    moment (momentum's update is the moment's scale) the same parameters are no excuse: no factor is claimed."""
    loss = _leaf("loss", "loss", 16.0, ok=False)
    mu = _leaf("opt_state", "0.mu.a.kernel", 16.0, ok=False)
    nu = LeafError(
        0, "opt_state", "0.nu.a.kernel", 255.0, 255.0, TOL, False, 256.0, None, (255.9, 256.1), (4,)
    )
    param = LeafError(0, "param", "b.kernel", 0.2, 0.2, TOL, False, 1.1, None, (1.03, 2.2), (4,))
    records = [_record(loss, [], [mu, nu, param])]
    loc = localize(records)
    assert (loc.stage, loc.form.kind, loc.form.factor) == ("forward", "factor", 16.0)
    assert loc.form.sentence.endswith(
        "; the 2 optimizer-state leaves that differ carry it (1 x 16, 1 x 256: a second moment carries its "
        "square): by them the gradients were 16 x too; the 1 parameter leaf that differs carries no factor 16, as "
        "Adam's step, normalized by its second moment, is not scaled by the gradients' factor and moves only "
        "through its epsilon"
    )
    assert "do not carry" not in loc.text()
    _said(loc, records)
    # momentum (no second moment): its update is the moment's scale, so a parameter off by no factor is not excused
    records = [_record(loss, [], [mu, param])]
    loc = localize(records)
    assert (loc.form.kind, loc.form.factor) == ("none", None)
    assert "(the gradients were not observed, and 1 of the 2 later leaves that differ does not carry 16)" in (
        loc.form.sentence
    )
    # the widest spread said is the leaf that does not carry it, never the second moment (256 to 256 read as "no
    # constant factor" by its absolute width)
    assert loc.form.sentence.endswith(
        "; of the later stages, b.kernel has no constant factor: its elementwise ratio runs from 1.03 to 2.2 "
        "(10th-90th percentile), median 1.1"
    )
    _said(loc, records)


def test_a_later_leaf_off_by_another_constant_factor_is_said_as_that_factor_not_as_no_constant_factor():
    """A later leaf that does not carry the loss's factor but is one factor across (x3 against a loss x16) is said as
    its factor; "none of" where no later leaf carries it."""
    loss = _leaf("loss", "loss", 16.0, ok=False)
    records = [_record(loss, [], [_leaf("opt_state", "0.mu.a.kernel", 3.0, ok=False)])]
    loc = localize(records)
    assert (loc.form.kind, loc.form.factor) == ("none", None)
    assert "(the gradients were not observed, and the later leaf that differs does not carry 16)" in (
        loc.form.sentence
    )
    assert loc.form.sentence.endswith(
        "; of the later stages, 0.mu.a.kernel is 3 x the reference's on every element"
    )
    _said(loc, records)


def _mlp_sum_task():
    """Trial 49's user: an MLP under Adam (``eps=1e-2``) and a step that sums its squared errors where the task's loss
    takes their mean (B = 16), returning only the loss."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from shardcheck import Task

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(8, 16, rngs=rngs)
            self.linear2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.linear2(nnx.relu(self.linear1(x)))

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x)[:, 0] - y) ** 2)

    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32))
    task = Task(lambda: MLP(nnx.Rngs(0)), optax.adam(1e-2, eps=1e-2), loss_fn, [batch], name="mlp")

    @nnx.jit
    def summed(model, optimizer, batch):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum((m(x)[:, 0] - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return task, lambda model, optimizer, batch: summed(model, optimizer, batch)


@require_devices(2)
def test_a_sum_for_a_mean_under_adam_with_no_gradients_returned_is_a_factor_its_moments_carry():
    """Live, the trial's step: FAIL, a factor 16 whose moments carry it (16, 256) and whose parameters, moved by
    Adam's epsilon only, are said so; no sentence says the later stages do not carry it."""
    task, step = _mlp_sum_task()
    report = check_parity(step, task, num_shards=2, steps=1)
    loc = report.localization
    assert report.verdict == "FAIL" and (loc.stage, loc.form.kind, loc.form.factor) == (
        "forward",
        "factor",
        16.0,
    )
    assert (
        "the 8 optimizer-state leaves that differ carry it (4 x 16, 4 x 256: a second moment carries its square): by "
        "them the gradients were 16 x too; the 4 parameter leaves that differ carry no factor 16"
        in loc.form.sentence
    )
    assert "do not carry" not in report.diagnosis and "no constant factor" not in report.diagnosis
    assert contradiction(loc.text(), report.steps) is None


def test_a_loss_factor_within_a_factors_width_of_one_is_not_counted_as_carried_by_the_later_leaves():
    """The FAIL audit's zoo conv (a loss 1.001 x, no gradients returned): "12 of the 16 later leaves that differ do
    not carry 1.001" counted as carrying it the leaves whose ratio is within 2% of 1, i.e. that match; now said as
    what it is."""
    loss = _leaf("loss", "loss", 1.001, ok=False)
    near = _leaf("opt_state", "0.mu.a.kernel", 1.0005, ok=False)
    spread = LeafError(0, "opt_state", "0.nu.a.kernel", 2.0, 2.0, TOL, False, 0.9, None, (0.5, 1.8), (4,))
    records = [_record(loss, [], [near, spread])]
    loc = localize(records)
    assert (loc.form.kind, loc.form.factor) == ("none", None)
    assert (
        "(the gradients were not observed, and no later leaf can show a factor this close to 1 (1.001))"
        in (loc.form.sentence)
    )
    _said(loc, records)
