"""A learning-rate schedule that counts micro-steps (trial 60 C5).

The task accumulates 2 micro-batches a step with ``optax.MultiSteps(adam(schedule), every_k_schedule=2)`` under a
linear warm-up. A candidate whose optimizer reads the schedule at twice its count (``schedule(2 * c)``: the
micro-step count) applies, once the warm-up is past 0, an update 2 x the reference's from equal gradients, its
counters matching. It read "a learning rate 2 x, or the update applied 2 times", the micro-steps unnamed; now the
localization's form says the schedule read at the micro-step count too, live and replayed. A learning rate
doubled on a constant schedule is not told so (no schedule to read), nor is a factor the schedule does not give.
"""

import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.harness.optimizer_rerun import schedule_at_micro_steps
from shardcheck.parity.harness.recorded import record_run

S, K = 2, 2
WARM_UP = optax.linear_schedule(0.0, 1e-2, transition_steps=8)


def _model():
    return nnx.Linear(4, 2, rngs=nnx.Rngs(0))


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _task(schedule) -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(4)
    ]
    tx = optax.MultiSteps(optax.adam(schedule), every_k_schedule=K).gradient_transformation()
    return shardcheck.Task(_model, tx, _loss, batches, name="micro-steps")


def _candidate(schedule) -> shardcheck.Candidate:
    tx = optax.MultiSteps(optax.adam(schedule), every_k_schedule=K).gradient_transformation()

    def make_optimizer(model, optimizer):
        mine = nnx.Optimizer(model, tx, wrt=nnx.Param)
        nnx.update(mine, nnx.state(optimizer))
        return mine

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return shardcheck.Candidate(name="mine", step=step, num_shards=S, make_optimizer=make_optimizer)


def test_the_schedule_at_micro_step_counts():
    """The ratios read from a MultiSteps' inner schedule: at the count c = 1 the step read, lr(2) / lr(1) = 2 and
    lr(3) / lr(1) = 3 for k = 2 (the counts k c and k c + k - 1), and so on; none from a constant learning rate."""
    params = {"w": np.zeros(3, np.float32)}
    tx = optax.MultiSteps(optax.adam(WARM_UP), every_k_schedule=K).gradient_transformation()
    state = tx.init(params)
    for _ in range(2 * K):  # two updates: the inner count is 2 after them, the second read count 1
        _, state = tx.update(params, state, params)
    read = schedule_at_micro_steps(tx, params, state)
    assert read[:2] == ((2, 1, 2, pytest.approx(2.0)), (2, 1, 3, pytest.approx(3.0)))
    assert {(k, m) for k, _, m, _ in read} == {(k, m) for k in range(2, 9) for m in (k, 2 * k - 1)}
    constant = optax.adam(1e-2)
    assert schedule_at_micro_steps(constant, params, constant.init(params)) == ()


@require_devices(S)
def test_a_schedule_counting_micro_steps_is_read_as_such_live_and_replayed():
    task = _task(WARM_UP)
    fast = _candidate(lambda c: WARM_UP(K * c))
    said = (
        "every update is 2 x the reference's (spread 2..2): a learning rate 2 x, or the update applied 2 times, "
        "or the task's schedule read at count 2 where the step's count is 1 (lr(2) / lr(1) = 2: a schedule "
        "counting 2 micro-steps a step, where the task's counts optimizer steps) (not an extra optimizer step: "
        "the counters match)"
    )
    live = check_parity(fast, task, num_shards=S)
    recording = record_run(task, "simulation", num_shards=S)
    replay = check_parity(fast, task, reference=recording)
    for report in (live, replay):
        assert report.verdict == "FAIL"
        where = report.localization
        assert (where.step, where.stage) == (3, "optimizer")  # the first update past lr(0) = 0 both ways
        assert said in where.form.sentence, where.form.sentence
    assert check_parity(_candidate(WARM_UP), task, num_shards=S).verdict == "PASS"


@require_devices(S)
def test_a_doubled_constant_learning_rate_is_not_read_as_micro_steps():
    task = _task(1e-2)
    report = check_parity(_candidate(2e-2), task, num_shards=S)
    assert report.verdict == "FAIL"
    sentence = report.localization.form.sentence
    assert "a learning rate 2 x, or the update applied 2 times" in sentence
    assert "micro-steps" not in sentence
