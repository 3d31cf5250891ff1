"""Issue #36, trial 41 (a decoder-only LM trained with optax.multi_transform(optax.contrib.muon for the blocks'
2-D kernels | adamw for the rest) on a warm-up cosine schedule, FSDP on data=2 x fsdp=2): omissions and a
near-miss.

- Every count of the optimizer bumped once more a step (Adam's bias-correction counts and the schedules') named
  only the worst, Adam's: "no schedule's: it sets no learning rate", while the schedules' counts were ahead too:
  the learning rate was the next step's as well. Each kind is now said with what it drives; the schedules'
  counts alone keep the schedule sentence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import said, train_candidate
from flax import nnx

from shardcheck import Candidate, Task, check_parity

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=8)


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _labels(params):
    # the hidden 2-D kernel to Muon, the rest (biases, the first and last layer) to AdamW
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if "l2" in _names(path) and "kernel" in _names(path) else "adam", params
    )


def _tx():
    return optax.multi_transform(
        {"muon": optax.contrib.muon(SCHEDULE), "adam": optax.adamw(SCHEDULE, weight_decay=0.1)}, _labels
    )


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 16, rngs=rngs)
        self.l3 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.gelu(self.l2(nnx.gelu(self.l1(x)))))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task(steps: int = 2) -> Task:
    rng = np.random.default_rng(41)
    batches = [
        {"x": rng.normal(size=(16, 6)).astype(np.float32), "y": rng.normal(size=(16, 2)).astype(np.float32)}
        for _ in range(steps)
    ]
    return Task(model=MLP, optimizer=_tx(), loss_fn=_loss, batches=batches, name="trial41-mlp")


def _schedule_count(names: list[str]) -> bool:
    # scale_by_learning_rate's ScaleByScheduleState: adamw's chain entry 2, muon's chain entry 3
    i = names.index("count")
    return names[i - 1] in ("2", "3")


def _bumping(which: str | None) -> Candidate:
    """The user's step; after the update it advances once more every count of the optimizer (``"all"``: Adam's
    and Muon's bias-correction counts and the schedules' counts) or the schedules' alone (``"schedules"``)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        if which is not None:
            state = nnx.state(optimizer)

            def bump(path, x):
                names = _names(path)
                if "count" not in names[-2:] or names[0] == "step":
                    return x
                return x + 1 if which == "all" or _schedule_count(names) else x

            nnx.update(optimizer, jax.tree_util.tree_map_with_path(bump, state))
        return loss, grads

    return train_candidate(f"bump-{which}", train)


def test_every_count_ahead_says_both_the_bias_correction_and_the_learning_rate():
    task = _task()
    assert check_parity(_bumping(None), task).ok  # the other side: the correct step passes
    report = check_parity(_bumping("all"), task)
    assert not report.ok and report.codes[0] == "step_counter", report.codes
    message = said(report, "step_counter")
    assert "of the optimizer's counters are each 2 after 1 step(s)" in message, message
    assert "inner_states.adam.inner_state.0.count is Adam's bias-correction count" in message
    assert (
        "inner_states.muon.inner_state.inner_states.muon.inner_state.0.count is the bias-correction count of a "
        "momentum alone" in message
    )
    assert "inner_states.adam.inner_state.2.count" in message and "beside no moments: a schedule's" in message
    assert "the moments' bias correction and the schedules' learning rate are both another step's" in message
    assert "it sets no learning rate" not in message


def test_the_schedules_counts_alone_keep_the_schedule_sentence():
    report = check_parity(_bumping("schedules"), _task())
    assert not report.ok and report.codes[0] == "step_counter", report.codes
    message = said(report, "step_counter")
    assert (
        "a schedule read one step ahead" in message
        and "the learning rate it gives is the next step's" in message
    )
    assert "bias-correction" not in message and "of the optimizer's counters" not in message


def _decaying(rate: float) -> Candidate:
    """The user's step; after the update it shrinks the hidden kernel by ``1 - rate`` (a decay on the wrong leaf):
    the parameter fails at step 0, and the gradients it moves fail at step 2 by more over their tighter
    tolerance (1e-4: 4.8 x the kernel's tolerance at step 0, 11 x grad l3.kernel's at step 2)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        model.l2.kernel[...] = model.l2.kernel[...] * (1.0 - rate)
        return loss, grads

    return train_candidate(f"decay-{rate}", train)


def test_the_python_report_names_the_first_failing_leaf_the_command_line_names():
    from shardcheck.cli.verify import _worst_cells

    task = _task(3)
    passing = check_parity(_decaying(0.0), task)
    assert passing.ok and passing.first_failing_leaf is None
    assert "first failing leaf" not in str(passing) and f"worst leaf: {passing.worst_leaf} at step" in str(
        passing
    )
    report = check_parity(_decaying(1e-4), task)
    assert not report.ok
    # the worst over every step is a later step's consequence; the failure's headline is step 0's parameter
    assert report.worst.step > 0 and report.worst_leaf.startswith("grad "), report.worst_leaf
    assert report.first_failing_leaf == "param l2.kernel" and report.first_worst.step == 0
    assert _worst_cells(report)[0] == "param l2.kernel (step 0)"  # the command line's summary row
    assert report.to_dict()["first_failing_leaf"] == report.first_failing_leaf
    lines = str(report).splitlines()
    assert lines[1].startswith("  first failing leaf: param l2.kernel at step 0: max abs err"), lines[1]
    assert lines[2].startswith(
        f"  worst leaf over every step: {report.worst_leaf} at step {report.worst.step}"
    ), lines[2]


def _group_labels(params):
    # Muon for the first two kernels, AdamW for the biases and the last kernel: the Muon group shares no ndim,
    # name or module that the matching leaves lack, only its optimizer group
    def label(path, _):
        names = _names(path)
        return "muon" if "kernel" in names and "l3" not in names else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def _group_tx(ns_steps: int = 5):
    return optax.multi_transform(
        {"muon": optax.contrib.muon(1e-2, ns_steps=ns_steps), "adam": optax.adamw(1e-2)}, _group_labels
    )


def _group_task() -> Task:
    task = _task(1)  # the first difference is at step 0 (a constant learning rate)
    return Task(model=MLP, optimizer=_group_tx(), loss_fn=_loss, batches=task.batches, name="trial41-groups")


def _ns_step(ns_steps: int) -> Candidate:
    """The user's step with its own optimizer: Muon's Newton-Schulz iterations ``ns_steps`` (the task's: 5)."""
    tx = _group_tx(ns_steps)

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        optimizer.tx = tx  # the same state layout: only the transformation differs
        loss, grads = train(model, optimizer, batch)
        return {"loss": loss, "grads": grads}

    return Candidate(name=f"ns{ns_steps}", step=step)


def test_a_replay_names_the_optimizer_group_once_and_never_shares_no_property_beside_it(tmp_path):
    from shardcheck.parity.diagnosis.grouping import NO_PROPERTY
    from shardcheck.parity.harness.recorded import record_run

    task = _group_task()
    recording = record_run(task, _ns_step(5))
    assert check_parity(_ns_step(5), task, reference=recording).ok  # the other side: the correct step passes
    group = "every failing leaf is in the optimizer's parameter group 'muon'"
    # the replay read the findings with the recording's facts alone (no optimizer group), the localization with
    # the task's: "Group: every failing leaf is in the optimizer's parameter group 'muon'" beside "The failing
    # leaves (l1.kernel, l2.kernel) share no ndim, name or module that the matching ones lack"; a live check
    # reads both with the task's
    report = check_parity(_ns_step(3), task, reference=recording)
    assert not report.ok and report.localization is not None
    assert group in report.localization.text(), report.localization.text()
    assert NO_PROPERTY not in report.diagnosis, report.diagnosis
    localized = said(report, "localized")
    assert "Every failing leaf is in the optimizer's parameter group 'muon'" in localized, localized
