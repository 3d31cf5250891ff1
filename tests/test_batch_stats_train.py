"""A BatchNorm model through ``train`` and ``run --task`` (trial 52): a GSPMD step computes the full batch's
statistics, so ``gspmd`` trains and runs beside the reference; the strategies that run the forward pass per shard
or per micro-batch are refused by name, as ``verify`` refuses them. Both commands used to refuse the whole model
("each shard would normalise with its own batch statistics; use LayerNorm"), gspmd included."""

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, make_mesh
from shardcheck.runner import run_task
from shardcheck.training import train_task

X = np.linspace(-1.0, 1.0, 2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
Y = np.cos(X[..., :3] * 2.0)


class Normed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


TASK = Task(
    model=lambda: Normed(nnx.Rngs(0)),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=[{"x": X[i], "y": Y[i]} for i in range(2)],
)
WRITES = "cannot run this model: its forward pass writes non-parameter state (bn.mean, bn.var)"


@require_devices(2)
def test_gspmd_trains_and_runs_a_batchnorm_model_and_the_per_shard_strategies_are_refused_by_name():
    trained = train_task(TASK, "gspmd", num_shards=2, epochs=2)
    assert trained.loss_curves_agree and trained.first_exceeded_step is None
    assert len(trained.steps) == 4 and all(not s.drift_exceeded for s in trained.steps)
    # the Linear's bias feeds the BatchNorm: its gradient is 0 up to rounding, and Adam moves it by ~lr on the noise
    assert [s.rounding_level_elements for s in trained.steps] == [3, 3, 3, 3]
    assert trained.max_abs_param_diff > 1e-3 and max(s.held_param_diff for s in trained.steps) < 1e-4
    with pytest.raises(ValueError, match=f"^dp: {re.escape(WRITES)}"):
        train_task(TASK, "dp", num_shards=2)
    ran = run_task(TASK, num_shards=2, mesh=make_mesh(2))
    assert set(ran.outcomes) == {"reference", "gspmd"}
    diffs = ran.outcomes["gspmd"].max_abs_param_diff_by_leaf
    assert max(diffs["lin.kernel"], diffs["bn.scale"], diffs["bn.bias"]) < 1e-6, diffs
    assert diffs["lin.bias"] <= 2 * 1e-2, diffs  # a true gradient of 0 (before the BatchNorm): Adam's noise
    assert set(ran.skipped) == {"simulation", "dp", "fsdp", "accumulation", "multiprocess"}
    for name, reason in ran.skipped.items():
        assert reason.startswith(f"{name}: {WRITES}") and "batch statistics (nnx.BatchStat" in reason, name


def test_run_says_a_reason_the_skipped_strategies_share_once():
    from shardcheck.cli.run import skipped_lines

    stats = "its batch statistics would be computed over part of the batch; check it with gspmd"
    how = {
        "simulation": "once per shard",
        "dp": "per device",
        "fsdp": "per device",
        "accumulation": "once per micro",
    }
    skipped = {
        name: f"{name}: cannot run this model, and {name} runs the forward pass {runs}, so {stats} (run_task, "
        f"strategy {name!r})"
        for name, runs in how.items()
    }
    assert skipped_lines(skipped) == [  # the head they share once too (as verify says its refusals)
        "skipped simulation, dp, fsdp and accumulation: cannot run this model, and",
        "  - simulation: it runs the forward pass once per shard",
        "  - dp and fsdp: it runs the forward pass per device",
        "  - accumulation: it runs the forward pass once per micro",
        f"for all of them: {stats}",
    ]
    assert skipped_lines({"dp": f"dp: dp cannot, so {stats} (run_task, strategy 'dp')"}) == [
        f"skipped dp: it cannot, so {stats}"
    ]
