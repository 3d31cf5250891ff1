"""A recording is a kind of reference, and a replay is diagnosed by the live check's code (issue #36).

Planted in the small model of ``tests/test_localization.py`` on a data-parallel mesh of 2, each fault is checked
twice: live (``check_parity(step, task, mesh=...)``, against the task's single-device step) and replayed
(``check_parity(step, task, reference=recording)``, against a recording of the right step, which
``verify --against FILE`` runs). Both must give the same verdict and the same diagnosis codes:

- the right step PASSes both ways;
- a gradient summed over the shards instead of averaged: ``summed``, x S = 2, both ways;
- a doubled learning rate (the update applied twice: every parameter's update x2, gradients and Adam's moments
  right): the same codes both ways;
- a decoupled weight decay applied to the 1-D leaves too: ``localized``, the parameters stage and the 1-D group.
"""

import dataclasses

import jax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_localization import LR, WD, _loss, _task

from shardcheck import check_parity, make_mesh
from shardcheck.parity.harness.recorded import record_run

FAULTS = ("none", "summed", "lr2", "decay_1d")


def _step(fault: str):
    """A user's data-parallel AdamW step (per-device gradients in ``jax.shard_map``); ``fault``: ``"summed"``
    psums the gradients instead of pmean-ing them, ``"lr2"`` applies the optimizer's update twice (a doubled
    learning rate under Adam), ``"decay_1d"`` decays the 1-D leaves too, ``"none"`` is the right step."""

    def step(model, optimizer, batch, mesh):
        axis = mesh.axis_names[0]
        reduce = jax.lax.psum if fault == "summed" else jax.lax.pmean
        loss = _loss(model, batch)
        graphdef, params = nnx.split(model, nnx.Param)

        def body(params, b):
            g = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), b))(params)
            return jax.tree.map(lambda a: reduce(a, axis), g)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(), check_vma=False)
        grads = jax.jit(mapped)(params, batch)
        before = {k: v[...] for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        optimizer.update(model, grads)
        for key, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if fault == "lr2":
                p[...] = before[key] + 2 * (p[...] - before[key])
            if fault == "decay_1d" and p[...].ndim == 1:
                p[...] = p[...] - LR * WD * p[...]
        return {"loss": loss, "grads": grads}

    step.__name__ = f"dp_{fault}"
    return step


@pytest.fixture(scope="module")
def recording():
    """A recording of the right step on a mesh of 2 (what ``shardcheck record`` saves)."""
    require_devices(2)
    return record_run(_task(), _step("none"), mesh=make_mesh(2))


@require_devices(2)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_is_named_the_same_way_live_and_replayed(fault, recording, tmp_path):
    task, mesh = _task(), make_mesh(2)
    live = check_parity(_step(fault), task, mesh=mesh)
    path = tmp_path / "right.npz"
    recording.save(path)
    replayed = check_parity(_step(fault), task, mesh=mesh, reference=path)
    assert replayed.replay is not None and replayed.reference == "the recording of dp_none"
    assert (live.verdict, replayed.verdict) == (("PASS",) * 2 if fault == "none" else ("FAIL",) * 2)
    assert replayed.codes == live.codes, (live.diagnosis, replayed.diagnosis)
    # the same records: the failing leaves, by name, at the first step
    bad = [sorted(e.name for e in r.steps[0].leaves if not e.ok) for r in (live, replayed)]
    assert bad[0] == bad[1]
    # the same localization: the first stage at which the steps part (an update applied differently from equal
    # gradients: the optimizer's, where the replay reruns the task's optimizer on the candidate's own gradients
    # as the live check does), and the decay's group
    if fault == "none":
        assert live.localization is None and replayed.localization is None
    else:
        stages = {"summed": "gradients", "lr2": "optimizer", "decay_1d": "optimizer"}
        where = [(r.localization.step, r.localization.stage) for r in (live, replayed)]
        assert where == [(0, stages[fault])] * 2, (live.localization.text(), replayed.localization.text())
        assert (live.localization.group == replayed.localization.group) or fault != "decay_1d"
        # the form: the same kind both ways. The doubled rate is a factor 2, live and replayed; live, where the
        # arrays fit "2 optimizer steps instead of one", the counters match, so that is not said: "every update
        # is 2 x the reference's: a learning rate 2 x, or the update applied 2 times"
        forms = [r.localization.form for r in (live, replayed)]
        assert forms[0].kind == forms[1].kind, [f.sentence for f in forms]
        if fault == "lr2":
            assert [f.kind for f in forms] == ["factor", "factor"], [f.sentence for f in forms]
            assert [f.factor for f in forms] == [pytest.approx(2.0, rel=1e-3)] * 2
            assert "every update is 2 x the reference's" in forms[0].sentence
            assert "a learning rate 2 x, or the update applied 2 times" in forms[0].sentence
            assert "optimizer steps instead of one" not in live.diagnosis


@require_devices(2)
def test_a_summed_gradient_is_named_summed_x_s_both_ways(recording):
    task, mesh = _task(), make_mesh(2)
    for report in (
        check_parity(_step("summed"), task, mesh=mesh),
        check_parity(_step("summed"), task, mesh=mesh, reference=recording),
    ):
        assert report.codes[0] == "summed", report.diagnosis
        grads = [e for e in report.steps[0].leaves if e.kind == "grad"]
        assert all(e.ratio == pytest.approx(2.0, rel=1e-4) for e in grads)
        assert all(e.spread == pytest.approx((2.0, 2.0), rel=1e-4) for e in grads)
        where = report.localization
        assert (where.stage, where.form.kind) == ("gradients", "factor"), where.text()
        assert where.form.factor == pytest.approx(2.0, rel=1e-4)


@require_devices(2)
def test_a_doubled_learning_rate_is_an_update_of_2x_from_equal_gradients_both_ways(recording):
    task, mesh = _task(), make_mesh(2)
    live = check_parity(_step("lr2"), task, mesh=mesh)
    replayed = check_parity(_step("lr2"), task, mesh=mesh, reference=recording)
    for report in (live, replayed):
        step = report.steps[0]
        assert all(e.ok for e in step.leaves if e.kind in ("loss", "grad", "opt_state", "counter"))
        params = [e for e in step.leaves if e.kind == "param"]
        assert params and not any(e.ok for e in params)
        assert all(e.ratio == pytest.approx(2.0, rel=1e-3) for e in params), [e.ratio for e in params]
    assert replayed.codes == live.codes


@require_devices(2)
def test_a_weight_decay_of_the_1d_leaves_is_localized_the_same_way_replayed(recording):
    replayed = check_parity(_step("decay_1d"), _task(), mesh=make_mesh(2), reference=recording)
    assert replayed.codes[0] == "localized", replayed.diagnosis
    message = replayed.diagnoses[0].message
    assert "the update was applied differently" in message
    assert "Every failing leaf is 1-D (bias, scale); every leaf of ndim >= 2 matches." in message
    assert "Only the loss matches" not in replayed.diagnosis


@require_devices(2)
def test_a_recording_reference_refuses_options_it_cannot_honour(recording):
    with pytest.raises(ValueError, match=r"check_parity: leaf_tolerance cannot apply against a recording"):
        check_parity(_step("none"), _task(), reference=recording, leaf_tolerance={"loss": (0, 0)})
    with pytest.raises(ValueError, match=r"check_parity: reference 'missing.npz' does not exist"):
        check_parity(_step("none"), _task(), reference="missing.npz")


@require_devices(2)
def test_the_same_task_under_another_name_replays_and_too_few_batches_are_refused(recording):
    """A task's name is how it was spelled (``record --task dir/t.py:task`` against ``Task(name="task")``): the
    same task under another name replays and PASSes; asked for more steps than the task has batches (the command
    line asks for every recorded step), the replay is refused before any step, naming both counts and both names
    (a new user's 2-batch task against a 3-step recording raised IndexError)."""
    task = _task()
    renamed = dataclasses.replace(task, name="another spelling")
    assert check_parity(_step("none"), renamed, mesh=make_mesh(2), reference=recording).ok
    two = record_run(
        dataclasses.replace(task, batches=[*task.batches, *task.batches]), _step("none"), mesh=make_mesh(2)
    )
    with pytest.raises(ValueError) as err:
        check_parity(_step("none"), renamed, mesh=make_mesh(2), reference=two, steps=2)
    assert f"holds 2 step(s), but the task has {len(task.batches)} batch(es)" in str(err.value)
    assert f"(it records task {task.name!r}, this run's is 'another spelling'); pass steps=1 or fewer" in str(
        err.value
    )


@require_devices(2)
def test_an_optimizer_stepped_per_micro_batch_is_read_through_its_view_replayed_as_live():
    """A candidate with an optimizer of its own (``optax.apply_every`` stepping Adam on each of 2 micro-batches)
    is recorded through its ``view_optimizer``, as the live check reads it: replayed against a recording of the
    built-in accumulation, Adam's count is compared (2 against 1) and the step is localized to the optimizer
    state with the live check's code, not to the parameters with "Only the loss matches" (its state, named
    otherwise, was left out) nor with a changed counter dtype."""
    from test_verdict import adam_lm, apply_every_candidate

    task = adam_lm()
    cand = apply_every_candidate(task.loss_fn, 2, False)
    recording = record_run(task, "accumulation", num_shards=2)
    live = check_parity(cand, task)
    replayed = check_parity(cand, task, reference=recording)
    for report in (live, replayed):
        assert report.verdict == "FAIL" and report.codes[0] == "step_counter", report.diagnosis
        assert "stepped per micro-batch (k = 2)" in report.diagnosis
        count = next(e for e in report.steps[0].leaves if e.name == "counter 0.count")
        assert (count.ok, count.ratio) == (False, 2.0)
        assert report.localization.stage == "optimizer"
    assert not {"loss_only", "structure"} & set(replayed.codes), replayed.codes
    # a user's step with its own optimizer records its k, so a replay of it against a recording of another user
    # step (not the built-in accumulation) still reads its counter as per micro-batch (a user's trial: "once
    # per shard (S=2)")
    assert record_run(task, cand, num_shards=2).meta["micro_batches"] == 2
    assert (
        recording.meta["micro_batches"] == 2
        and record_run(task, "simulation", num_shards=2).meta["micro_batches"] is None
    )


def _stages(report):
    """``(noun, status, compared, failing, kinds)`` of each stage but the replicas (a replay does not observe
    them): what the localization counts, live or replayed."""
    return [
        (s.noun, s.status, s.compared, s.failing, s.kinds)
        for s in report.localization.stages
        if s.stage != "replicas"
    ]


@require_devices(2)
def test_a_summed_gradient_reads_the_same_stages_and_counts_live_and_replayed(recording):
    """A replay reruns the optimizer on the candidate's gradients at any localized stage, as a live check does:
    the trial's sum-for-mean read 'optimizer: matches; applied parameters: differs (0 of 35 parameters and 66 of
    70 optimizer-state leaves)' live and 'optimizer: differs (66 of 70); applied parameters: matches' replayed."""
    task, mesh = _task(), make_mesh(2)
    live = check_parity(_step("summed"), task, mesh=mesh)
    replayed = check_parity(_step("summed"), task, mesh=mesh, reference=recording)
    assert _stages(live) == _stages(replayed), (live.localization.text(), replayed.localization.text())
    stages = {s[0]: s for s in _stages(live)}
    assert stages["the optimizer's update from equal inputs"][1] == "matches"
    applied = stages["the applied parameters and the optimizer state"]
    assert applied[1] == "differs" and dict((k, bad) for k, _, bad in applied[4])["opt_state"] > 0


@require_devices(2)
def test_without_returned_gradients_the_optimizer_stage_is_the_optimizer_state_live_and_replayed(recording):
    """A step that returns only its loss: the optimizer stage had no equal inputs, so it is 'the optimizer state'
    in the head and in the stages' list, both ways (it was 'the optimizer's update from equal inputs' there)."""

    def loss_only(model, optimizer, batch, mesh):
        return _step("summed")(model, optimizer, batch, mesh)["loss"]

    task, mesh = _task(), make_mesh(2)
    reports = [
        check_parity(loss_only, task, mesh=mesh),
        check_parity(loss_only, task, mesh=mesh, reference=recording),
    ]
    assert _stages(reports[0]) == _stages(reports[1])
    for report in reports:
        text = report.localization.text()
        assert report.localization.stage == "optimizer", text
        assert text.startswith(
            "First difference at step 0: the optimizer state (the state the optimizer kept"
        )
        assert "; the optimizer state: differs (" in text and "from equal inputs" not in text
        assert "the gradients: not observed (the candidate returned no gradients)" in text
