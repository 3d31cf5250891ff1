"""Issue #36, trial 26 (a seq2seq Transformer under optax.MultiSteps(chain(clip, adamw(warm-up from 0)), k=2)):
what the accumulation's counters say, said as read.

- A candidate's MultiSteps with every_k_schedule=1 against the task's 2 read "stepped 3 times per step: the
  counter gradient_step of its state is 3 after 1 step(s)" live and "2 times the reference's ... use
  optax.MultiSteps(tx, every_k_schedule=k)" replayed: each side's k is read from its counters, said with the
  steps they were read at, the same way in both modes.
- Its accumulator, emptied at every step, read "no simple form ... ratio runs from 0 to 0": the form ``reset``.
- A step at which the reference's MultiSteps only accumulated read "the learning rate at step 0 is 0".
- ``Task(optimizer=optax.MultiSteps(...))`` is told to pass ``.gradient_transformation()``.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import said
from flax import nnx

from shardcheck import Candidate, Task, check_parity
from shardcheck.parity.comparison.live import counter_error
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import form_from_leaves
from shardcheck.parity.diagnosis.rules import diagnose
from shardcheck.parity.harness.recorded import record_run


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _tx(every_k: int):
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=2, decay_steps=10)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.1))
    return optax.MultiSteps(inner, every_k_schedule=every_k).gradient_transformation()


def _task() -> Task:
    rng = np.random.default_rng(26)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(4)
    ]
    return Task(
        model=lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optimizer=_tx(2), loss_fn=_loss, batches=batches,
        name="multisteps",
    )  # fmt: skip


@nnx.jit
def _train(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_loss)(model, batch)
    optimizer.update(model, grads)
    return loss, grads


def step(model, optimizer, batch):
    loss, grads = _train(model, optimizer, batch)
    return {"loss": loss, "grads": grads}


def _own(every_k: int) -> Candidate:
    def make(model, optimizer):
        mine = nnx.Optimizer(model, _tx(every_k), wrt=nnx.Param)
        nnx.update(mine, nnx.state(optimizer))
        return mine

    return Candidate(name=f"every{every_k}", step=step, make_optimizer=make)


EVERY_STEP = (
    "The candidate's optax.MultiSteps applies an update at every step where the task's applies one every 2 steps: "
    "its counter gradient_step (updates applied) is "
)
CAUSE = (
    "Its update count (step) matches the reference's at every step, so optimizer.update runs once a step: the "
    "candidate's MultiSteps is built with every_k_schedule=1 against the task's every_k_schedule=2."
)


def _check_every_1(report, counters: str) -> None:
    assert not report.ok and report.codes[0] == "step_counter", report.codes
    message = said(report, "step_counter")
    assert message.startswith(EVERY_STEP + counters), message
    assert CAUSE in message
    assert "times per step" not in message and "times the reference's" not in message
    form = report.localization.form
    assert form.kind == "reset", form
    assert (
        "a reset accumulator: the candidate's opt_state acc_grads.* (2 leaves) hold exactly 0"
        in form.sentence
    )
    assert "the candidate applied an update at a step where the reference only accumulated" in form.sentence
    assert "no simple form" not in form.sentence and "from 0 to 0" not in form.sentence


def test_a_multisteps_applying_every_step_against_the_tasks_2_is_said_with_its_counters_live():
    task = _task()
    # the trajectory's own counters at every step (no step is re-run from the reference's state after step 0 failed)
    _check_every_1(
        check_parity(_own(1), task),
        "1, 2, 3 and 4 after steps 0, 1, 2 and 3, the reference's 0, 1, 1 and 2; its mini_step (steps accumulated "
        "since) is 0, 0, 0 and 0, the reference's 1, 0, 1 and 0.",
    )
    # the other side: the task's own every_k_schedule passes
    assert check_parity(_own(2), task).ok


def test_a_multisteps_applying_every_step_is_said_alike_against_a_recording():
    task = _task()
    recording = record_run(task, step)
    _check_every_1(
        check_parity(_own(1), task, reference=recording),
        "1, 2, 3 and 4 after steps 0, 1, 2 and 3, the reference's 0, 1, 1 and 2; its mini_step (steps accumulated "
        "since) is 0, 0, 0 and 0, the reference's 1, 0, 1 and 0.",
    )
    assert check_parity(step, task, reference=recording).ok


# ------------------------------------------------------------------------------ hand-built records, both sides


def _leaf(kind, path, ok=True, ratio=1.0, step=0, change=None, spread=None):
    err = 0.0 if ok else 1e-3
    return LeafError(step, kind, path, err, err, 1e-6, ok, ratio, change, spread or (ratio, ratio), (4,))


def _record(t: int, counters: list[LeafError], calls=None) -> StepRecord:
    leaves = (_leaf("loss", "loss", step=t), _leaf("param", "w", step=t, change=1e-3), *counters)
    n = calls or (t + 1, t + 1)
    leaves += (counter_error(t, "step", *n),)
    return StepRecord(t, 1e-5, 1e-7, 1.0, 1.0, leaves, *n)


def _multisteps(t: int, ref_k: int, cand_k: int, calls: int = 1) -> list[LeafError]:
    n = t + 1
    return [
        counter_error(t, "gradient_step", n // ref_k, calls * n // cand_k),
        counter_error(t, "mini_step", n % ref_k, calls * n % cand_k),
    ]


def test_the_counters_name_each_sides_every_k_and_the_micro_batch_form():
    # a candidate that calls update once per micro-batch (2 a step) on the task's MultiSteps(k=2)
    records = [_record(t, _multisteps(t, 2, 2, calls=2), calls=(t + 1, 2 * (t + 1))) for t in range(3)]
    said = {d.code: d.message for d in diagnose(records, 2)}["step_counter"]
    assert "applies an update at every step where the task's applies one every 2 steps" in said
    assert "optimizer.update runs 2 times a step: the candidate applies each micro-batch" in said
    # a candidate that accumulates 4 where the task accumulates 2: it lags, no counter is a whole factor ahead
    records = [_record(t, _multisteps(t, 2, 4)) for t in range(4)]
    said = {d.code: d.message for d in diagnose(records, 2)}["step_counter"]
    assert "applies an update every 4 steps where the task's applies one every 2 steps" in said
    assert "every_k_schedule=4 against the task's every_k_schedule=2" in said
    # the other side: equal every_k_schedule on both sides is no counter finding
    records = [_record(t, _multisteps(t, 2, 2)) for t in range(4)]
    assert "step_counter" not in {d.code for d in diagnose(records, 2)}


def _count_at_2(ref: int, cand: int) -> list[StepRecord]:
    moved = _leaf(
        "opt_state", "1.0.mu.w", ok=False, ratio=3.0, step=2
    )  # the moments moved on: not a lone count
    last = _record(2, [counter_error(2, "1.0.count", ref, cand)])
    return [_record(0, []), _record(1, []), dataclasses.replace(last, leaves=(*last.leaves, moved))]


def test_a_counter_ahead_is_said_with_the_step_it_was_read_at_and_the_references_value():
    # a count of 3 at step 2 where the reference's is 1 (not the step count): no "3 times per step", no "after 1"
    said = {d.code: d.message for d in diagnose(_count_at_2(1, 3), 4)}["step_counter"]
    assert "is 3 after 3 step(s) (the reference's is 1)" in said
    assert "times per step" not in said and "after 1 step(s)" not in said
    # the other side: a reference counting the steps reads k times per step
    said = {d.code: d.message for d in diagnose(_count_at_2(3, 6), 4)}["step_counter"]
    assert "stepped 2 times per step: the counter 1.0.count of its state is 6 after 3 step(s)" in said


def _unchanged_params(counters: list[LeafError]) -> StepRecord:
    """Step 0 of a faulty loss: the loss and the gradients differ (no one factor), every parameter matches and
    the reference moved none."""
    leaves = (
        _leaf("loss", "loss", ok=False, ratio=0.9),
        _leaf("grad", "w", ok=False, ratio=0.3, spread=(-1.0, 2.0)),
        _leaf("grad", "b", ok=False, ratio=0.5, spread=(-2.0, 1.0)),
        _leaf("param", "w", change=0.0),
        _leaf("param", "b", change=0.0),
        *counters,
        counter_error(0, "step", 1, 1),
    )
    return StepRecord(0, 1e-5, 1e-7, 1.0, 0.9, leaves, 1, 1)


@pytest.mark.parametrize(
    "counters, reason",
    [
        (
            [counter_error(0, "mini_step", 1, 1), counter_error(0, "gradient_step", 0, 0)],
            "the reference's own update is 0 at step 0 (the reference's optax.MultiSteps only accumulated the "
            "gradient at step 0: its mini_step is 1 after it, the steps accumulated since its last update, so it "
            "applied no update)",
        ),
        (
            [counter_error(0, "mini_step", 0, 0), counter_error(0, "gradient_step", 1, 1)],
            "(its optax.MultiSteps applied an update at step 0, and the learning rate at step 0 is 0, as a "
            "warm-up from 0 gives)",
        ),
        (
            [counter_error(0, "0.count", 1, 1)],
            "(the learning rate at step 0 is 0, as a warm-up from 0 gives)",
        ),
        (
            [],
            "(either the learning rate at step 0 is 0, as a warm-up from 0 gives, or the step only accumulates the "
            "gradient, as optax.MultiSteps does until its k-th step",
        ),
    ],
)
def test_why_the_reference_moved_no_parameter_is_read_from_its_counters(counters, reason):
    said = {d.code: d.message for d in diagnose([_unchanged_params(counters)], 2)}["update_differs"]
    assert "only because no update is compared there" in said and reason in said
    if counters and counters[0].path == "mini_step" and counters[0].counts[0]:
        assert "learning rate" not in said


def test_a_replayed_accumulator_of_zeros_is_a_reset_and_never_no_simple_form():
    zeroed = LeafError(0, "opt_state", "acc_grads.w", 0.2, 1.0, 1e-6, False, 0.0, None, (0.0, 0.0), (4,), 8)
    still = LeafError(
        0, "opt_state", "inner_opt_state.0.mu.w", 0.01, math.inf, 1e-6, False, shape=(4,), samples=0
    )
    form = form_from_leaves([dataclasses.replace(zeroed, cand_zeros=True), still], optimizer_stage=True)
    assert form.kind == "reset"
    assert (
        "the candidate's opt_state acc_grads.* (1 leaf) hold exactly 0 where the reference's hold values up to 0.2"
        in form.sentence
    )
    assert "the reference left opt_state inner_opt_state.0.mu.* (1 leaf) as they were" in form.sentence
    # the other side: a candidate that left the leaf as it was, holding values (not emptied), is no reset
    assert form_from_leaves([zeroed, still], optimizer_stage=True).kind != "reset"


def test_a_multisteps_object_as_the_tasks_optimizer_is_told_gradient_transformation():
    wrapped = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    base = _task()
    with pytest.raises(TypeError, match=r"got MultiSteps .*\.gradient_transformation\(\)"):
        Task(model=base.model, optimizer=wrapped, loss_fn=_loss, batches=base.batches)
    # the other side: its gradient_transformation() is a task's optimizer
    Task(model=base.model, optimizer=wrapped.gradient_transformation(), loss_fn=_loss, batches=base.batches)
