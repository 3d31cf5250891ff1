"""A loss that couples the rows of a batch only at a later step, and train on a loss that couples them (trial 59).

A capacity-limited MoE router drops no token at the initial parameters and drops some once routing concentrates:
the probe of the first batch at the initial parameters saw no coupling, and the built-in per-shard strategies
read FAIL ``per_shard_loss`` at step 1, with advice addressed to a step the user did not write. They are now
refused at that step, as the probe refuses them at step 0; ``train`` refuses such a strategy as ``verify`` does
(it ran fsdp on a load-balancing loss over the whole batch and said "drift exceeded tolerance"). A task whose
loss does not couple the rows is neither refused nor changed.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.parity.harness.row_coupling import RowCouplingError
from shardcheck.training import train_task


class _Linear(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.l(x)[:, 0]


def _loss(model, batch):
    """MSE plus a term read from the whole batch's largest first feature above 10: zero on a batch whose first
    features stay below 10, and a coupling of the rows where one row's is above (as a capacity over the batch)."""
    pred = model(batch["x"])
    over = jnp.maximum(jnp.max(batch["x"][:, 0]) - 10.0, 0.0)
    return jnp.mean((pred - batch["y"]) ** 2) + 0.1 * over * jnp.mean(pred)


def _batch(rng, spike: bool):
    x = rng.normal(size=(8, 3)).astype(np.float32)
    if spike:
        x[1, 0] = 20.0  # in the first of two shards only
    return {"x": x, "y": rng.normal(size=(8,)).astype(np.float32)}


def _task(spikes) -> Task:
    rng = np.random.default_rng(0)
    batches = [_batch(rng, spike) for spike in spikes]
    return Task(model=lambda: _Linear(nnx.Rngs(0)), optimizer=optax.sgd(0.05), loss_fn=_loss, batches=batches)


def test_a_loss_that_couples_the_rows_from_step_1_refuses_a_per_shard_strategy_at_that_step():
    with pytest.raises(RowCouplingError) as raised:
        check_parity("simulation", _task((False, True)), num_shards=2)
    said = str(raised.value)
    assert said.startswith("simulation: cannot compute this task's loss: at step 1 the full-batch loss is ")
    assert "though it did not on the first batch at the initial ones" in said
    assert "an expert capacity over the whole batch's tokens that drops those past it" in said
    assert said.endswith("(check_parity, strategy 'simulation')")
    # no coupling at any step: a PASS, nothing refused
    assert check_parity("simulation", _task((False, False)), num_shards=2).verdict == "PASS"


def test_train_refuses_a_per_shard_strategy_on_a_loss_that_couples_the_rows_and_runs_the_rest():
    coupled = _task((True, True))
    with pytest.raises(
        RowCouplingError, match=r"^simulation: cannot compute this task's loss: on the first batch"
    ):
        train_task(coupled, "simulation", num_shards=2)
    report = train_task(_task((False, False)), "simulation", num_shards=2)
    assert len(report.steps) == 2
