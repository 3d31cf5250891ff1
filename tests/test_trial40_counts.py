"""Issue #36, trial 40 (a linear-recurrence LM under optax.adamw on a warm-up-from-0 cosine schedule, data=2 x
fsdp=2, two micro-batches accumulated by hand): a cause the records contradicted, and a form its own ratios did.

- Adam's own count (``opt_state[0].count``, a ScaleByAdamState beside ``0.mu`` and ``0.nu``) advanced twice a
  step read "a schedule read one step ahead ...; the learning rate it gives is the next step's", though the
  schedule's count was right: that count drives Adam's bias correction only. A schedule's count advanced twice
  keeps the schedule sentence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import Candidate, Task, check_parity

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=1, decay_steps=4, end_value=1e-3)


def _no_bias(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "bias" not in jax.tree_util.keystr(path), params)


def _tx():
    # chain(scale_by_adam: 0, masked add_decayed_weights: 1, scale_by_learning_rate(schedule): 2)
    return optax.adamw(SCHEDULE, weight_decay=0.1, mask=_no_bias)


class MLP(nnx.Module):
    def __init__(self, dtype=None):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(6, 16, dtype=dtype, rngs=rngs)
        self.l2 = nnx.Linear(16, 16, dtype=dtype, rngs=rngs)
        self.l3 = nnx.Linear(16, 2, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.gelu(self.l2(nnx.gelu(self.l1(x))))).astype(jnp.float32)


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task(dtype=None) -> Task:
    rng = np.random.default_rng(40)
    batches = [
        {"x": rng.normal(size=(16, 6)).astype(np.float32), "y": rng.normal(size=(16, 2)).astype(np.float32)}
        for _ in range(3)
    ]
    return Task(model=lambda: MLP(dtype), optimizer=_tx(), loss_fn=_loss, batches=batches, name="trial40-mlp")


def _counting(bump: int | None) -> Candidate:
    """The user's step; ``bump``: the opt_state entry whose count is advanced once more a step before the update
    (0: Adam's ScaleByAdamState, 2: the schedule's ScaleByScheduleState), as a count stepped per micro-batch."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        if bump is not None:
            state = optimizer.opt_state[bump]
            state.count[...] = state.count[...] + 1
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        loss, grads = train(model, optimizer, batch)
        return {"loss": loss, "grads": grads}

    return Candidate(name=f"bump{bump}", step=step)


def _said(report, code: str) -> str:
    return next(d.message for d in report.diagnoses if d.code == code)


def test_adams_own_count_ahead_is_its_bias_correction_not_a_schedule_read_ahead():
    task = _task()
    assert check_parity(_counting(None), task).ok  # the other side: the correct step passes
    report = check_parity(_counting(0), task)
    assert not report.ok and report.codes[0] == "step_counter", report.codes
    message = _said(report, "step_counter")
    assert "The optimizer's counter 0.count is 2 after 1 step(s) while 2.count and step match" in message
    assert (
        "it is Adam's bias-correction count (the count beside 0.mu and 0.nu: optax's ScaleByAdamState)"
        in message
    )
    assert "1 - b1^count and 1 - b2^count, so its bias correction is another step's" in message
    assert "read one step ahead" not in message and "the learning rate it gives" not in message


def test_a_schedules_count_ahead_keeps_the_schedule_sentence():
    report = check_parity(_counting(2), _task())
    assert not report.ok and report.codes[0] == "step_counter", report.codes
    message = _said(report, "step_counter")
    assert "The optimizer's counter 2.count is 2 after 1 step(s) while 0.count and step match" in message
    assert (
        "a schedule read one step ahead" in message
        and "the learning rate it gives is the next step's" in message
    )
    assert "bias-correction" not in message
