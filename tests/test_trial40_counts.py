"""Issue #36, trial 40 (a linear-recurrence LM under optax.adamw on a warm-up-from-0 cosine schedule, data=2 x
fsdp=2, two micro-batches accumulated by hand): a cause the records contradicted, and a form its own ratios did.

- Adam's own count (``opt_state[0].count``, a ScaleByAdamState beside ``0.mu`` and ``0.nu``) advanced twice a
  step read "a schedule read one step ahead ...; the learning rate it gives is the next step's", though the
  schedule's count was right: that count drives Adam's bias correction only. A schedule's count advanced twice
  keeps the schedule sentence.
- Under bfloat16 compute a gradient reduced over one mesh axis of two read "a constant factor per group, each
  constant across its leaves (ratios within -0.1649..1.738 ...)": the tolerance-aware fit
  (``form.factor_within``) now also holds the ratio's spread to the precision's allowance, while a real x2 on
  one group under bfloat16 is still named.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import said, train_candidate
from flax import nnx

from shardcheck import Candidate, Task, check_parity
from shardcheck.parity.diagnosis.form import factor_within, fit_form

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

    return train_candidate(f"bump{bump}", train)


def test_adams_own_count_ahead_is_its_bias_correction_not_a_schedule_read_ahead():
    task = _task()
    assert check_parity(_counting(None), task).ok  # the other side: the correct step passes
    report = check_parity(_counting(0), task)
    assert not report.ok and report.codes[0] == "step_counter", report.codes
    message = said(report, "step_counter")
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
    message = said(report, "step_counter")
    assert "The optimizer's counter 2.count is 2 after 1 step(s) while 0.count and step match" in message
    assert (
        "a schedule read one step ahead" in message
        and "the learning rate it gives is the next step's" in message
    )
    assert "bias-correction" not in message


# trial 40's decay gradients under bfloat16 compute (reduced over 'data' only, of data=2 x fsdp=2), x 1e4: the
# reference's (DR) and the candidate's (DC) at step 0, with a correct step's tolerance (TOL)
DR = {
    "blocks.0.decay": [0.86, 2.43, 7.05, -3.04, 2.92, 9.24, 22.32, 30.86, -7.05, 7.4, -22.37, 4.38, 3.6, -7.33, -41.1, 4.02],
    "blocks.1.decay": [0.22, -5.13, -6.72, -3.48, 5.71, 2.06, 1.91, -7.68, 3.69, 16.26, 30.31, 4.76, 19.8, 8.76, 11.74, -24.55],
}  # fmt: skip
DC = {
    "blocks.0.decay": [3.28, 0.01, 2.25, -2.59, 3.11, 7.62, 15.49, 23.23, 1.16, 5.03, -17.13, 1.22, 6.26, -3.47, -29.99, -1.35],
    "blocks.1.decay": [-1.22, 1.91, -2.65, -0.56, -0.19, 1.99, 5.73, -4.28, 0.89, -2.48, 9.45, 1.07, 3.19, 12.41, 3.87, -16.47],
}  # fmt: skip
TOL = {"blocks.0.decay": 0.000212, "blocks.1.decay": 0.000417}


def test_trial40s_partial_reduction_is_no_factor_within_bfloat16_rounding_and_a_real_x2_is():
    dr = {p: 1e-4 * np.array(v) for p, v in DR.items()}
    dc = {p: 1e-4 * np.array(v) for p, v in DC.items()}
    for p in dr:  # each leaf's ratio spreads across 0 (-0.16..1.74 about 0.71; -0.15..1.42 about 0.31)
        assert factor_within(dr[p], dc[p], TOL[p]) is None, p
    form = fit_form({}, dr, dc, update=False, tol=TOL)
    assert form.kind == "none", form
    assert form.sentence.startswith("no simple form") and "factor per group" not in form.sentence
    assert (
        "blocks.0.decay's elementwise ratio runs from -0.1645 to 1.739 (10th-90th percentile)"
        in form.sentence
    )
    # the other side: x2 within the same rounding is a factor, spread and all, even where the tolerance is too
    # wide a share of the change to tell it from 1 by the residual bound (max|dr| < SPREAD_TOLS (1 + 2) tol)
    rng = np.random.default_rng(0)
    x2 = {p: 2 * v + rng.uniform(-1e-4, 1e-4, v.shape) for p, v in dr.items()}
    wide = {p: 0.0012 for p in dr}
    f, lo, hi = factor_within(dr["blocks.1.decay"], x2["blocks.1.decay"], wide["blocks.1.decay"])
    assert f == pytest.approx(2.0, rel=0.02) and hi - lo > 0.04
    form = fit_form({}, dr, x2, update=False, tol=wide)
    assert (form.kind, round(form.factor, 1)) == ("factor", 2.0), form
    assert "every element within its rounding of that factor" in form.sentence


def _one_group(fault: str) -> Candidate:
    """A user step that applies the gradient with l2's leaves changed: ``x2`` (a real factor) or ``half`` (the
    gradient of the batch's first half: no factor, each element's ratio its own)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        if fault == "x2":
            other = jax.tree.map(lambda g: 2 * g, grads)
        else:
            other = nnx.grad(_loss)(model, jax.tree.map(lambda v: v[:8], batch))
        grads = nnx.State({**dict(grads), "l2": other["l2"]})
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        loss, grads = train(model, optimizer, batch)
        return {"loss": loss, "grads": grads}

    return Candidate(name=fault, step=step)


def test_bfloat16_compute_names_a_real_x2_on_one_group_and_no_factor_for_half_the_rows():
    task = _task(jnp.bfloat16)
    x2 = check_parity(_one_group("x2"), task, compute_dtype="bfloat16")
    assert not x2.ok
    where = x2.localization
    assert (where.step, where.stage) == (0, "gradients"), where
    assert where.form.kind == "factor" and where.form.factor == pytest.approx(2.0, rel=0.02), where.form
    half = check_parity(_one_group("half"), task, compute_dtype="bfloat16")
    assert not half.ok
    form = half.localization.form
    assert form.kind not in ("factor", "per_group", "extra_step"), form
    assert "constant factor" not in form.sentence.split(":")[0], form
