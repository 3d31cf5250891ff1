"""A reduction that left batch shards out, named (trial 57, C3).

Trial 57's "only shard 0's gradient" (a psum of a gradient masked to device 0) read "Only the loss matches ...
no constant factor", and "the last shard left out" (divided by S, or by S - 1) "no simple form". The harness now
tries, at the first failing step, the reference's optimizer step on every shard's gradient alone and on every
shard's but one, divided by S or by their own count, and says the one that the candidate reproduces first in the
leading generic finding; a catalog fault keeps its own finding, and a correct step passes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import replicated_step, require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.shard_subset import subset_clause, subsets
from shardcheck.tasks.digits import digits_loss, digits_task

AX = ("data",)
S = 4


def _reduce(fault, g):
    idx, n = jax.lax.axis_index(AX), jax.lax.psum(1, AX)
    if fault == "shard0":  # device 0's gradient broadcast in place of the all-reduce
        return jax.lax.psum(jnp.where(idx == 0, g, 0.0), AX)
    if fault == "drop_last":  # the last shard masked out, divided by S
        return jax.lax.psum(jnp.where(idx == n - 1, 0.0, g), AX) / n
    if fault == "drop_last_renorm":  # the last shard masked out, divided by S - 1
        return jax.lax.psum(jnp.where(idx == n - 1, 0.0, g), AX) / (n - 1)
    if fault == "summed":
        return jax.lax.psum(g, AX)
    return jax.lax.pmean(g, AX)


def _step(fault, returns_grads):
    @functools.partial(nnx.jit, static_argnums=3)
    def train(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            loss, g = jax.value_and_grad(lambda p: digits_loss(nnx.merge(graphdef, p, rest), batch))(params)
            return jax.lax.pmean(loss, AX), jax.tree.map(functools.partial(_reduce, fault), g)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=P(), check_vma=False)
        loss, grads = mapped(params, rest, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads} if returns_grads else loss

    return replicated_step(train)


def test_the_subsets_tried_are_each_shard_alone_and_each_left_out():
    assert subsets(3) == [(0,), (1,), (2,), (1, 2), (0, 2), (0, 1)]
    assert subsets(2) == [(0,), (1,)]  # each shard alone is the other left out


@pytest.mark.parametrize(
    ("subset", "weighted", "said"),
    [
        (
            ((0,), 4, "own", "shards"),
            False,
            "to shard 0's gradient alone (of 4 batch shards), in place of the mean over all 4:",
        ),
        (
            ((2,), 4, "full", "shards"),
            True,
            "to shard 2's gradient alone (of 4 batch shards), divided by the batch's total weight:",
        ),
        (
            ((0, 1, 2), 4, "full", "shards"),
            False,
            "to the gradient of shards 0, 1 and 2 of 4 only (shard 3 left out), divided by S = 4, as the full batch's:",
        ),
        (
            ((0, 2), 3, "own", "shards"),
            True,
            "to the gradient of shards 0 and 2 of 3 only (shard 1 left out), divided by those shards' own weight:",
        ),
        (
            ((0,), 4, "share", "shards"),
            True,
            "to shard 0's gradient alone (of 4 batch shards), divided by the batch's total weight and scaled x 4, "
            "as if it weighed its share of the batch:",
        ),
        (
            ((1, 2, 3), 4, "share", "shards"),
            True,
            "to the gradient of shards 1, 2 and 3 of 4 only (shard 0 left out), divided by the batch's total "
            "weight and scaled x 4/3, as if they weighed their share of the batch:",
        ),
    ],
)
def test_the_clause_says_which_shards_and_what_divided_them(subset, weighted, said):
    clause = subset_clause(subset, weighted)
    assert clause.startswith(
        f"the step applied the optimizer's update {said} a reduction that left shards out"
    )
    assert (
        "reduce every shard's gradient (jax.lax.pmean over every batch axis, or a psum of the loss sums and the "
        "weights, divided once)." in clause
    )
    # trial 59 A3: micro-batches of consecutive rows give the same numbers as shards
    assert clause.endswith(
        f"In a step that accumulates {subset[1]} micro-batches of consecutive rows the numbers are the same: there, "
        "the update took those micro-batches' gradient only (a loop that stops early, a gradient overwritten where "
        "it was to be added)."
    )


@pytest.fixture(scope="module")
def task():
    return digits_task(optimizer=optax.adam(1e-2), steps=2)


@require_devices(S)
@pytest.mark.parametrize("returns_grads", [True, False], ids=["grads", "loss only"])
@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("shard0", "shard 0's gradient alone (of 4 batch shards), in place of the mean over all 4"),
        (
            "drop_last",
            "the gradient of shards 0, 1 and 2 of 4 only (shard 3 left out), divided by S = 4, as the full batch's",
        ),
        (
            "drop_last_renorm",
            "the gradient of shards 0, 1 and 2 of 4 only (shard 3 left out), divided by their own count, 3",
        ),
    ],
)
def test_a_reduction_that_left_shards_out_is_named_first(task, fault, said, returns_grads):
    report = check_parity(_step(fault, returns_grads), task, mesh=make_mesh({"data": S}))
    assert report.verdict == "FAIL" and report.codes[0] in ("localized", "loss_only"), str(report)
    assert report.diagnoses[0].message.startswith(
        f"At step 0 the step applied the optimizer's update to {said}:"
    )
    assert report.steps[0].shard_subset is not None


@require_devices(S)
@pytest.mark.parametrize(("fault", "code"), [("correct", "parity"), ("summed", "summed")])
def test_a_correct_step_and_a_catalog_fault_are_not_read_so(task, fault, code):
    report = check_parity(_step(fault, True), task, mesh=make_mesh({"data": S}))
    assert report.codes[0] == code, str(report)
    assert "left shards out" not in str(report)


def _weighted_loss(model, batch):
    """The digits cross-entropy as ``(loss_sum, weight)``, digits 0, 3, 6 and 9 weighing 0: shards weigh
    unequally."""
    logits = model(batch["x"]).astype(jnp.float32)
    weight = (batch["label"] % 3 != 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return jnp.sum(ce * weight), jnp.sum(weight)


def _weighted_step(fault):
    """A shard_map step of the weighted loss: ``"correct"`` (psum the sums and the weights, divide once), or
    ``"share0"`` (device 0's gradient sum broadcast, x S over the total weight: trial 58 C1)."""

    @functools.partial(nnx.jit, static_argnums=3)
    def train(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            def total(p):
                return _weighted_loss(nnx.merge(graphdef, p, rest), batch)

            (value, weight), g = jax.value_and_grad(total, has_aux=True)(params)
            w = jax.lax.psum(weight, AX)
            idx, n = jax.lax.axis_index(AX), jax.lax.psum(1, AX)
            if fault == "share0":
                g = jax.tree.map(lambda x: jax.lax.psum(jnp.where(idx == 0, x, 0.0), AX) * n / w, g)
            else:
                g = jax.tree.map(lambda x: jax.lax.psum(x, AX) / w, g)
            return jax.lax.psum(value, AX) / w, g

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=P(), check_vma=False)
        loss, grads = mapped(params, rest, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return replicated_step(train)


@require_devices(S)
def test_one_shards_gradient_rescaled_to_its_share_of_a_weighted_batch_is_named(task):
    """Trial 58 C1: device 0's gradient sum x S over the batch's total weight read "no simple form"; it is named
    as shard 0's gradient scaled to its share, and the correct weighted step passes."""
    weighted = dataclasses.replace(task, loss_fn=_weighted_loss)
    mesh = make_mesh({"data": S})
    report = check_parity(_weighted_step("share0"), weighted, mesh=mesh)
    assert report.verdict == "FAIL" and report.steps[0].shard_subset == ((0,), S, "share", "shards"), str(report)
    assert report.diagnoses[0].message.startswith(
        "At step 0 the step applied the optimizer's update to shard 0's gradient alone (of 4 batch shards), "
        "divided by the batch's total weight and scaled x 4, as if it weighed its share of the batch:"
    )
    assert check_parity(_weighted_step("correct"), weighted, mesh=mesh).verdict == "PASS"
