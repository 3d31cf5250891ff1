"""Normalization, sum and weight-count causes told apart (issue #36, trials 16 and 17).

Trial 17's psum of per-shard means (its gradients S x the mean of per-shard means, a binding global-norm clip
erasing the x S from the update) was said as "each shard divided its loss sum by its own weight ... before the
shards were averaged": the hypothesis read the parameters and optimizer state only. Now, where the step returns
its gradients, they must be one factor c of the per-shard means' gradient, said with it (c = S: summed, not
averaged). Trial 16's gradients divided by the row count (16) where the loss's weight sum (8, padding rows of
weight 0) was due read "averaged twice" at a step where 8/16 = 1/S, and "a constant factor that is not a shard
count" at another: now the factor W/N is named as such, and where it coincides with 1/S another step run from the
reference's state decides (live), or both are named (a replay). Trial 16's mean of per-shard weighted means was
named by ``check_parity`` but not through the command line's codegen: the hypothesis is now compared within its
own rounding (``hypotheses.hypothesis_rounding``).

A small MLP with a weighted MSE ``(loss_sum, weight)`` on batches of 8 rows, some of weight 0, S = 2 simulated
shards (rows 0..3 and 4..7 of unequal weight); the faulty steps return their gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.parity.diagnosis.hypotheses import fitted_factor, hypothesis_rounding, weight_count
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps import Candidate

S, N = 2, 8
# the batches' weights: W = 4 (= N / S: 4/8 is 1/S), 5 and 6; the two shards of each weigh unequally
WEIGHTS = ((1, 1, 1, 0, 1, 0, 0, 0), (1, 1, 1, 1, 1, 0, 0, 0), (1, 1, 0, 0, 1, 1, 1, 1))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))[:, 0]


def _loss(model, batch):
    err = (model(batch["x"]) - batch["y"]) ** 2
    return jnp.sum(batch["w"] * err), jnp.sum(batch["w"])


def _batches(order):
    rng = np.random.default_rng(0)
    out = [
        {
            "x": rng.normal(size=(N, 3)).astype(np.float32),
            "y": rng.normal(size=(N,)).astype(np.float32),
            "w": np.asarray(w, np.float32),
        }
        for w in WEIGHTS
    ]
    return [out[i] for i in order]


@functools.cache
def _task(order=(0, 1, 2), clip: float | None = None) -> Task:
    """The batches in ``order`` (the first weighs 4 of 8 rows: 1/S); ``clip``: a global-norm clip before Adam
    (trial 17's optimizer; small enough to bind)."""
    tx = optax.adam(1e-2) if clip is None else optax.chain(optax.clip_by_global_norm(clip), optax.adam(1e-2))
    return Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=_batches(order), name="padded"
    )


def _grads(fault: str, model, batch):
    """``(loss, grads)`` of the step ``fault``: ``none`` (the full batch's sum over its weight), ``summed`` (the
    shards' own means summed), ``means`` (averaged), ``rows`` (the sum over the row count), ``twice`` (the mean
    divided by S again)."""
    total, weight = _loss(model, batch)
    if fault in ("summed", "means", "means_twice"):
        shards = jax.tree.map(lambda a: a.reshape((S, N // S) + a.shape[1:]), batch)

        def shard_mean(m, i):
            t, w = _loss(m, jax.tree.map(lambda a: a[i], shards))
            return t / w

        parts = [nnx.grad(functools.partial(shard_mean, i=i))(model) for i in range(S)]
        k = {"summed": 1.0, "means": 1.0 / S, "means_twice": 1.0 / S**2}[fault]
        return total / weight, jax.tree.map(lambda *g: k * sum(g), *parts)
    grads = nnx.grad(lambda m: _loss(m, batch)[0])(model)
    div = {"none": weight, "rows": float(N), "twice": weight * S}[fault]
    return total / weight, jax.tree.map(lambda g: g / div, grads)


@functools.cache
def _step(fault: str) -> Candidate:
    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = _grads(fault, model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return Candidate(f"step_{fault}", step, num_shards=S)


def _first(report):
    return next(r for r in report.steps if not r.ok)


def test_a_correct_step_passes():
    for task in (_task(), _task(clip=1e-3)):
        report = check_parity(_step("none"), task)
        assert report.verdict == "PASS", str(report)
        assert report.codes[0] == "parity"


def test_summed_per_shard_means_are_named_summed_with_their_factor():
    """Trial 17: the returned gradients are 2 x the mean of per-shard means; the clip hides the x2 in the update."""
    report = check_parity(_step("summed"), _task(clip=1e-3))
    assert report.verdict == "FAIL" and report.codes[0] == "normalization", str(report)
    assert abs(_first(report).per_shard_factor - 2.0) < 1e-3
    said = report.diagnosis
    assert "the returned gradients are 2 x the mean of per-shard means" in said
    assert "summed (a psum where a pmean was due), not averaged: x2, a sum over S=2 shards" in said
    assert "before the shards were averaged" not in said
    # trial 58 C5: the second fault, the psum, under its own code beside the per-shard division
    assert report.codes[:2] == ("normalization", "summed"), report.codes
    assert (
        "a psum where a pmean was due): jax.lax.pmean them over the batch axes, or divide the psum by 2"
        in said
    )


def test_per_shard_means_averaged_then_divided_again_are_named_with_both_codes():
    """Trial 58 C5's other side: the per-shard means averaged and divided by S again read
    ``normalization`` and ``averaged_twice``, each fault with its own fix."""
    report = check_parity(_step("means_twice"), _task(clip=1e-3))
    assert report.codes[:2] == ("normalization", "averaged_twice"), str(report)
    assert abs(_first(report).per_shard_factor - 0.5) < 1e-3
    said = report.diagnosis
    assert "the shards' means were averaged and divided by S=2 again: x1/2" in said
    assert "the shards' mean was divided by S=2 again (x1/2): divide once" in said


def test_averaged_per_shard_means_are_still_named_averaged():
    report = check_parity(_step("means"), _task(clip=1e-3))
    assert report.codes[0] == "normalization", str(report)
    assert "summed" not in report.codes and "averaged_twice" not in report.codes, report.codes
    # trial 59 A3: S micro-batches of consecutive rows give the same numbers, said beside the shards' reading
    assert report.diagnoses[0].message.endswith(
        "In a step that accumulates 2 micro-batches of consecutive rows the numbers are the same: there, each "
        "micro-batch divided by its own count; accumulate the loss sums and the counts, then divide once."
    )
    assert _first(report).per_shard_factor is None
    assert (
        "each shard divided its loss sum by its own weight (token count) before the shards were averaged"
        in (report.diagnosis)
    )


def test_rows_for_weight_is_named_with_its_counts():
    """Trial 16 with its batches rotated: x0.625 = 5/8, said "not a shard count" before."""
    report = check_parity(_step("rows"), _task(order=(1, 2, 0)))
    assert report.codes[0] == "weight_count", str(report)
    first = _first(report)
    assert first.loss_weight == 5.0 and first.weight_count == (8, "rows")
    assert (
        "0.625 = 5/8: the gradient was divided by the number of rows (8) where the loss's weight sum is 5 (rows "
        "of weight 0: padding)" in report.diagnosis
    )
    assert "not a shard count" not in report.diagnosis


def test_rows_for_weight_where_it_is_one_over_S_is_decided_by_the_next_step():
    """Trial 16: 4/8 = 1/S at step 0; step 1, rerun from the reference's state, is 5/8, not 1/2 again."""
    report = check_parity(_step("rows"), _task())
    assert report.codes[0] == "weight_count" and "averaged_twice" not in report.codes, str(report)
    said = report.diagnosis
    assert "0.5 = 4/8: the gradient was divided by the number of rows (8)" in said
    assert "At step 1 (run from the reference's state) they are 0.625 x the reference's: 5/8" in said


def test_a_true_mean_taken_twice_is_still_averaged_twice():
    for order in ((0, 1, 2), (1, 2, 0)):  # x1/2 where 4/8 = 1/2 too (step 1 tells), and where 5/8 is not
        report = check_parity(_step("twice"), _task(order=order))
        assert "averaged_twice" in report.codes and "weight_count" not in report.codes, str(report)
        assert "averaged twice (or divided by S=2 twice): x1/2" in report.diagnosis


@functools.cache
def _recording(clip: float | None = None):
    return record_run(_task(clip=clip), _step("none"))


def test_a_replay_names_both_readings_where_they_coincide():
    """A replay reruns no later step from the recorded state: 4/8 = 1/2 is said both ways."""
    report = check_parity(_step("rows"), _task(), reference=_recording())
    assert report.codes[0] == "weight_count", str(report)
    said = report.diagnosis
    assert (
        "either the gradient was divided by the number of rows (8) where the loss's weight sum is 4" in said
    )
    assert "or it was averaged twice (or divided by S=2 twice): x1/2; at this step 4/8 = 0.5" in said


def test_a_replay_names_summed_per_shard_means():
    report = check_parity(_step("summed"), _task(clip=1e-3), reference=_recording(1e-3))
    assert report.codes[0] == "normalization", str(report)
    assert "the returned gradients are 2 x the mean of per-shard means" in report.diagnosis


def test_the_fitted_factor_both_sides():
    alt = {"a": np.array([1.0, -2.0, 0.5]), "b": np.array([[3.0]])}
    tol = {"a": 1e-6, "b": 1e-6}
    assert abs(fitted_factor({k: 4 * v for k, v in alt.items()}, alt, tol) - 4.0) < 1e-12
    assert fitted_factor({"a": alt["a"] * [1, 1, 2], "b": alt["b"]}, alt, tol) is None  # no one factor
    assert fitted_factor({k: 0 * v for k, v in alt.items()}, {k: 0 * v for k, v in alt.items()}, tol) is None


def test_the_hypothesis_rounding_covers_a_gradient_near_zero_under_adam():
    """Trial 16's CLI codegen: a gradient element near 0 moves Adam's first update by up to lr within the
    gradient's tolerance; an element far from 0 by far less."""
    tx = optax.adam(1e-2)
    params = {"p": jnp.zeros(2)}
    grads = {"p": jnp.array([1e-8, 1.0])}
    upd, _ = hypothesis_rounding(tx, grads, tx.init(params), params, 1e-6, 1e-6)
    moved, _ = tx.update({"p": grads["p"] + jnp.array([1.5e-6, 1.5e-6])}, tx.init(params), params)
    base, _ = tx.update(grads, tx.init(params), params)
    change = np.abs(np.asarray(moved["p"] - base["p"]))
    assert change[0] > 1e-3 and np.all(change <= upd["p"] + 1e-9)  # the near-zero element: covered
    assert upd["p"][1] < 1e-6  # the element far from 0: no lr-sized allowance


def test_the_weight_count():
    batch = _batches((0,))[0]
    assert weight_count(batch, 4.0) == (8, "rows")
    mask = {"tokens": np.zeros((2, 3), np.int32), "mask": np.array([[1, 1, 0], [1, 0, 0]], np.float32)}
    assert weight_count(mask, 3.0) == (6, "entries of batch['mask']")
    assert weight_count(batch, None) is None
    assert (
        weight_count({"x": np.ones((8, 2), np.float32)}, 8.0) is None
    )  # every row weighs 1: no count differs
