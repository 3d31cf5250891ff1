"""A replay's notes and loss weight, said only where its records support them (issue #36, a user's trial).

A late first failure (step t > 0) "may be rounding divergence through a non-smooth op": said where the records
leave it open (the gradients off by no simple form), not where they refute it (an optimizer rerun from equal
inputs that differs; every gradient off by one factor). A replayed ``(loss_sum, weight)`` loss names a gradient
factor equal to the failing batch's total weight as that weight, as a live check does; a mean loss names none.
A replay of another step than the recorded one says so, naming both, and passes or fails on its values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.losses import mse_batch_loss, regression_batch_loss
from shardcheck.parity.comparison.digest import DIVERGENCE, _candidate_note
from shardcheck.parity.diagnosis.evidence import percentiles
from shardcheck.parity.harness.recorded import record_run
from shardcheck.parity.harness.replay import check_against_recording, loss_weight
from shardcheck.task import task_batch_weight

# each batch's weights: 5 rows of 8 count at step 0, 6 at step 1 (at least one in each half: 2 shards)
MASKS = ([1, 1, 1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 1, 1, 0, 1])


def _task(weighted: bool, clip: bool = False) -> Task:
    rng = np.random.default_rng(0)
    batches = []
    for mask in MASKS:
        x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)
        batches.append((x, y, np.asarray(mask, np.float32)) if weighted else (x, y))
    return Task(
        model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
        # a global-norm clip that binds: the update is blind to the gradient's scale
        optimizer=optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1)) if clip else optax.sgd(0.1),
        loss_fn=regression_batch_loss if weighted else mse_batch_loss,
        batches=batches,
        name="weighted" if weighted else "mean",
    )


def _pattern(a):
    """A fixed pattern of a leaf's shape: an offset of no simple form (no factor, decay or sign flip)."""
    return jnp.sin(jnp.arange(a.size, dtype=a.dtype) * 1.7 + 0.3).reshape(a.shape)


def _step(fault: str | None = None):
    """The reference's step (the gradient of the task's mean loss, then SGD) until step 1, then ``fault``:
    ``nodiv`` the loss sum not divided by its weight, ``times5`` the gradient times 5, ``noisy_grads`` the
    gradient plus an offset (applied and returned), its parameters nudged by 1e-7 at step 0 (within tolerance,
    not bitwise: its step 1 does not start from the recorded state exactly), ``noisy_update`` the update plus an
    offset (the gradient right), ``reports5`` the right update with 5 x its gradient returned."""

    def step(model, optimizer, batch):
        late = int(optimizer.step[...]) >= 1

        def loss(m):  # (what the step differentiates, the mean loss it reports)
            total, weight = (
                regression_batch_loss(m, batch) if len(batch) == 3 else (mse_batch_loss(m, batch), 1)
            )
            return (total if fault == "nodiv" and late else total / weight), total / weight

        (_, value), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        if late and fault == "times5":
            grads = jax.tree.map(lambda g: 5.0 * g, grads)
        if late and fault == "noisy_grads":
            grads = jax.tree.map(lambda g: g + 0.05 * _pattern(g), grads)
        optimizer.update(model, grads)
        if late and fault == "reports5":  # the right update; the gradients returned are 5 x the applied ones
            grads = jax.tree.map(lambda g: 5.0 * g, grads)
        if not late and fault == "noisy_grads":
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p: p + 1e-7 * _pattern(p), params))
        if late and fault == "noisy_update":
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p: p + 0.01 * _pattern(p), params))
        return {"loss": value, "grads": grads}

    return step


@pytest.fixture(scope="module")
def replays():
    """``{fault: report}``: each faulty step (and the correct one) replayed against a recording of the correct
    step, on the weighted task (``times5``: the mean one; ``clipped times5``: the mean one under a binding
    global-norm clip), 2 shards."""
    out = {}
    runs = {
        (True, False): (None, "nodiv", "noisy_grads", "noisy_update", "reports5"),
        (False, False): ("times5",),
        (False, True): ("times5",),
    }
    for (weighted, clip), faults in runs.items():
        task = _task(weighted, clip)
        recording = record_run(task, _step(), num_shards=2, name="good")
        for fault in faults:
            key = f"clipped {fault}" if clip else fault
            out[key] = check_parity(
                _step(fault), task, num_shards=2, name=fault or "good", reference=recording
            )
    return out


def _divergence(report) -> list[str]:
    return [n for n in report.replay.notes if DIVERGENCE in n]


@require_devices(2)
def test_a_late_failure_is_called_possible_divergence_only_where_the_records_leave_it_open(replays):
    # the gradients off by an offset of no simple form at step 1, its state before it not bitwise the
    # recording's: nothing refutes divergence (a state that hashed as the recording's would: trial 10)
    open_ = replays["noisy_grads"]
    assert open_.steps[0].ok and not open_.steps[1].identical_start
    assert (open_.localization.step, open_.localization.stage, open_.localization.form.kind) == (
        1,
        "gradients",
        "none",
    )
    assert _divergence(open_) == [
        "The first failure is at step 1 > 0: a recording cannot re-run that step from identical state (shardcheck "
        "verify against the reference can), so it may be rounding divergence through a non-smooth op rather than "
        "a faulty step."
    ]
    assert _divergence(open_) == [n for n in open_.replay.to_dict()["notes"] if DIVERGENCE in n]
    # the optimizer rerun from the candidate's own gradients and state differs: the step itself is faulty
    rerun = replays["noisy_update"]
    assert (rerun.localization.step, rerun.localization.stage, rerun.localization.form.kind) == (
        1,
        "optimizer",
        "none",
    )
    assert rerun.steps[1].optimizer_rerun is not None and _divergence(rerun) == []
    assert rerun.steps[1].identical_start  # its step 0 is the recorded step's, bit for bit
    # every gradient 6 x the reference's (the loss sum of 6 weights not divided): no divergence makes one factor
    factor = replays["nodiv"]
    assert (factor.localization.stage, factor.localization.form.kind) == ("gradients", "factor")
    assert factor.localization.form.factor == pytest.approx(6.0, rel=1e-4) and _divergence(factor) == []
    assert DIVERGENCE not in str(factor.replay) and not factor.ok


@require_devices(2)
def test_a_replayed_weighted_loss_names_the_batchs_weight_and_a_mean_loss_none(replays):
    weighted, mean = replays["nodiv"], replays["times5"]
    assert [r.loss_weight for r in weighted.steps] == [None, 6.0]  # the first failing step's, as live
    said = weighted.localization.form.sentence
    assert "6 is this batch's total loss weight (6: the count the (loss_sum, weight) loss returns" in said
    assert "6 is this batch's total loss weight" in weighted.replay.cause
    # a mean loss: the same kind of fault (x5 on every gradient) names no weight
    assert mean.localization.form.factor == pytest.approx(5.0, rel=1e-4)
    assert [r.loss_weight for r in mean.steps] == [None, None]
    assert "loss weight" not in mean.localization.form.sentence and "loss weight" not in mean.replay.cause
    assert loss_weight(_task(True), 0) == 5.0 and loss_weight(_task(False), 1) is None


@require_devices(2)
def test_a_replay_of_another_step_says_so_and_of_the_same_step_does_not(replays):
    same = replays[None]
    assert same.ok and same.replay.bitwise and not any("candidate" in n for n in same.replay.notes)
    other = replays["noisy_grads"]
    note = "The recording was made with candidate good; this replay runs noisy_grads: two steps compared"
    assert any(n.startswith(note) for n in other.replay.notes)
    assert any(n.startswith(note) for n in other.replay.to_dict()["notes"])


@require_devices(2)
def test_the_candidate_note_names_the_command_lines_specs(tmp_path, monkeypatch):
    """The ``--candidate`` specs the settings keep name the steps: another file of the same function is named, a
    relative and an absolute path to one file are the same step, a replay passes with the note."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")

    def meta(spec, run="step", kind="candidate"):
        return {"run": run, "run_kind": kind, "settings": {"candidate": spec}}

    assert _candidate_note(meta("mine.py:step"), meta("theirs.py:step")) == [
        "The recording was made with candidate mine.py:step; this replay runs theirs.py:step: two steps compared "
        "(the verdict says whether this one reproduces the recorded run)."
    ]
    assert _candidate_note(meta("mine.py:step"), meta(f"{tmp_path}/mine.py:step")) == []
    assert _candidate_note(meta("./mine.py:step"), meta("mine.py:step")) == []
    assert _candidate_note(meta("mine.py:step"), meta("mine.py:other", run="other")) != []
    # a strategy on either side: the runs' names are noted elsewhere
    assert _candidate_note(meta(None, run="fsdp", kind="strategy"), meta("mine.py:step")) == []
    task = _task(True)
    recording = record_run(task, _step(), num_shards=2, name="step", settings={"candidate": "mine.py:step"})
    report = check_against_recording(
        _step(), task, recording, num_shards=2, name="step", settings={"candidate": "copy.py:step"}
    )
    assert report.ok and any(
        n.startswith("The recording was made with candidate mine.py:step; this replay runs copy.py:step")
        for n in report.replay.notes
    )


class _Concrete(nnx.Module):
    """A model whose factory reads a concrete value as it builds (it cannot be traced inside a jit)."""

    def __init__(self):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.total = float(np.asarray(self.lin.kernel[...]).sum())

    def __call__(self, x):
        return self.lin(x)


def test_the_batch_weight_is_read_without_the_model_and_from_a_factory_that_needs_values():
    weighted = _task(True)
    assert [task_batch_weight(weighted, b) for b in weighted.batches] == [5.0, 6.0]
    assert task_batch_weight(_task(False), _task(False).batches[0]) is None
    batch = weighted.batches[1]
    concrete = Task(model=_Concrete, optimizer=optax.sgd(0.1), loss_fn=regression_batch_loss, batches=[batch])
    assert task_batch_weight(concrete, batch) == 6.0


@require_devices(2)
def test_gradients_alone_off_are_called_applied_or_not_by_the_replays_optimizer_rerun(replays):
    """Only the returned gradients differ (x5 at step 1) while the update matches: under a binding clip the
    optimizer rerun on them gives the candidate's update and the task's optimizer is blind to their scale (they
    were applied, the clip hid them: ``scale_blind``, and the factor is read from them, ``scaled``, as a live
    check reads it); without one the rerun differs (they are not the ones applied). The replay reads the rerun as
    a live check does."""
    hidden, reported = replays["clipped times5"], replays["reports5"]
    for report in (hidden, reported):
        assert report.localization.stage == "gradients"
    assert hidden.codes[0] == "scaled" and "scale_blind" in hidden.steps[1].matches
    assert all(e.ok for e in hidden.steps[1].optimizer_rerun)
    assert "At step 1, gradients are 5 x the reference's" in hidden.replay.cause
    assert (
        "an optimizer blind to the gradient's scale (global-norm clipping that binds)" in hidden.replay.cause
    )
    assert "not the ones applied" not in hidden.replay.cause
    assert reported.codes[0] == "grads_differ" and "scale_blind" not in reported.steps[1].matches
    assert not all(e.ok for e in reported.steps[1].optimizer_rerun)
    assert (
        "while the update matches: the reported gradients are not the ones applied" in reported.replay.cause
    )


@require_devices(2)
def test_a_replays_leaf_ratios_say_how_many_recorded_samples_they_were_read_from(replays):
    """A replay reads a leaf's ratio at its fixed-index samples: each failing LeafError carries their count, and a
    spread it quotes says so (a live check's spread is over every element)."""
    open_ = replays["noisy_grads"]
    failing = [e for r in open_.steps for e in r.leaves if not e.ok and e.spread is not None]
    assert failing and all(e.samples is not None and 1 <= e.samples <= 8 for e in failing)
    assert f"of its {failing[0].samples} recorded samples" in percentiles(failing[0])


def test_a_replays_placement_facts_are_read_after_the_first_step():
    """Trial 6: a shard_map step that places the state itself (inside the step) recorded every leaf unplaced
    before step 0, so the replay's group read "share no ndim, name or module" where the live check's said
    "every failing leaf is replicated on every device; every leaf split over ('model',) matches"."""
    from types import SimpleNamespace

    import numpy as np

    from shardcheck.parity.comparison.digest import _facts

    names = ("param a.kernel", "param a.bias", "loss")
    initial = SimpleNamespace(sharding=np.array([["", "", ""]], dtype=object))
    placed = np.array([["P(None, 'model')", "P()", ""], ["P(None, 'model')", "P()", ""]], dtype=object)
    recording = SimpleNamespace(
        names=names,
        shapes=((4, 8), (8,), ()),
        dtypes=("float32", "float32", "float32"),
        initial=initial,
        steps=SimpleNamespace(sharding=placed),
    )
    facts = dict(_facts(recording))
    assert facts["a.kernel"].axes == ("model",) and facts["a.bias"].axes == ()
    before = dict(
        _facts(SimpleNamespace(**{**vars(recording), "steps": SimpleNamespace(sharding=placed[:0])}))
    )
    assert before["a.kernel"].axes == ()  # no step recorded: the initial placement, as before
