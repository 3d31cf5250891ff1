"""An accumulation that left micro-batches out, named (trial 59).

A step that accumulates k micro-batches by hand and overwrites its accumulator (``acc = g``: the last
micro-batch's gradient alone) or stops a micro-batch early read "no constant factor ... ratio runs from 0 to 1",
or a generic ``forward_differs`` where its micro-batches were strided (rows i::k). Where no shard subset fits, the
harness sums each row's gradient into the micro-batches of k in (2, 4, 8), as blocks of consecutive rows and as
rows i::k, and names the subset the candidate reproduces; a correct accumulation passes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from shardcheck import check_parity
from shardcheck.parity.diagnosis.micro_subset import members, micro_clause
from shardcheck.tasks.digits import digits_loss, digits_task

K = 4


def _micro(batch, i, layout):
    if layout == "blocks":
        return jax.tree.map(lambda a: a.reshape(K, a.shape[0] // K, *a.shape[1:])[i], batch)
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // K, K, *a.shape[1:])[:, i], batch)


@functools.cache
def _step(fault, layout, returns_grads=True):
    """k = 4 micro-batches of ``layout`` accumulated on one device: ``"correct"``, ``"overwrite"`` (the
    accumulator overwritten: the last micro-batch's gradient alone, divided by k) or ``"stop_early"`` (three of
    the four summed, divided by k)."""

    @nnx.jit
    def step(model, optimizer, batch):
        acc, loss = None, 0.0
        for i in range(K - 1 if fault == "stop_early" else K):
            value, g = nnx.value_and_grad(digits_loss)(model, _micro(batch, i, layout))
            loss += value / K
            acc = g if acc is None or fault == "overwrite" else jax.tree.map(lambda a, b: a + b, acc, g)
        grads = jax.tree.map(lambda a: a / K, acc)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads} if returns_grads else loss

    return step


@pytest.fixture(scope="module")
def task():
    return digits_task(optimizer=optax.adam(1e-2), batch_size=16, steps=2)


def test_the_micro_batches_of_each_layout():
    np.testing.assert_array_equal(members(8, 4, "blocks")[1], [0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(members(8, 4, "strided")[1], [0, 1, 0, 0, 0, 1, 0, 0])
    assert micro_clause(((3,), 4, "full", "strided"), False).startswith(
        "the step applied the optimizer's update to micro-batch 3's gradient alone (of 4 micro-batches of rows "
        "i::4, every 4th row), divided by k = 4, as the accumulated sum is: an accumulation that left "
        "micro-batches out"
    )


@pytest.mark.parametrize("layout", ["blocks", "strided"])
@pytest.mark.parametrize("returns_grads", [True, False], ids=["grads", "loss only"])
@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("overwrite", "micro-batch 3's gradient alone (of 4 micro-batches of {rows}), divided by k = 4"),
        (
            "stop_early",
            "the gradient of micro-batches 0, 1 and 2 of 4 only (micro-batch 3 left out; micro-batches of {rows}), "
            "divided by k = 4, as the full accumulation's",
        ),
    ],
)
def test_an_accumulation_that_left_micro_batches_out_is_named(task, layout, returns_grads, fault, said):
    rows = "consecutive rows" if layout == "blocks" else "rows i::4, every 4th row"
    report = check_parity(_step(fault, layout, returns_grads), task)
    assert report.verdict == "FAIL", str(report)
    first = next(r for r in report.steps if not r.ok)
    assert first.shard_subset is not None, str(report)
    assert first.shard_subset[1] == K and first.shard_subset[3] == layout, first.shard_subset
    assert report.diagnoses[0].message.startswith(
        f"At step 0 the step applied the optimizer's update to {said.format(rows=rows)}"
    ), report.diagnoses[0].message


@pytest.mark.parametrize("layout", ["blocks", "strided"])
def test_a_correct_accumulation_passes(task, layout):
    assert check_parity(_step("correct", layout), task).verdict == "PASS"


def _weighted_loss(model, batch):
    """The digits cross-entropy as ``(loss_sum, weight)``, digits 0, 3, 6 and 9 weighing 0."""
    logits = model(batch["x"])
    weight = (batch["label"] % 3 != 0).astype(logits.dtype)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return (ce * weight).sum(), weight.sum()


@functools.cache
def _means_step(layout):
    """The mean of the 4 micro-batches' own means (each its loss sum over its own weight), micro-batches of
    ``layout``: trial 59's strided accumulation read forward_differs."""

    @nnx.jit
    def step(model, optimizer, batch):
        def mean(m, mb):
            total, weight = _weighted_loss(m, mb)
            return total / weight

        parts = [nnx.value_and_grad(mean)(model, _micro(batch, i, layout)) for i in range(K)]
        loss = sum(v for v, _ in parts) / K
        grads = jax.tree.map(lambda *g: sum(g) / K, *[g for _, g in parts])
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


@pytest.mark.parametrize("layout", ["blocks", "strided"])
def test_micro_batch_means_are_named_with_their_layout(task, layout):
    import dataclasses

    weighted = dataclasses.replace(task, loss_fn=_weighted_loss)
    report = check_parity(_means_step(layout), weighted)
    assert report.codes[0] == "micro_batch_means", str(report)
    first = next(r for r in report.steps if not r.ok)
    assert first.micro_means[0] == K and first.micro_means[2] == layout
    rows = "the batch's rows in 4 blocks" if layout == "blocks" else "rows i::4, every 4th row"
    assert f"the mean of the 4 micro-batches' own means ({rows}, loss weights " in report.diagnoses[0].message


def test_the_micro_batch_subsets_tried_are_the_ends():
    from shardcheck.parity.diagnosis.micro_subset import ends

    assert ends(4) == [(3,), (0,), (0, 1, 2), (1, 2, 3)]
    assert ends(2) == [(1,), (0,)]  # all but one of two: the other alone
