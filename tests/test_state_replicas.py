"""Trial 23 (issue #36): floating model state the task's loss neither reads nor writes (an EMA of the parameters
kept by the user's step) is not compared with the reference's, which does not write it; its copies on the devices
were not checked either, so an EMA each device wrote from its own shard of the batch (replicated by its sharding,
different on every device) passed. The copies of every floating state leaf are now compared across devices, as
the parameters' and the optimizer state's are: a step writing them per device FAILs with ``replicas_differ``
naming the leaf; the same EMA written alike on every device PASSes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh


class EMA(nnx.Variable):
    """A moving average the user's step keeps; the loss never reads it."""


class Net(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)
        self.ema = EMA(jnp.zeros(4))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(model=Net, optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=batches, name="ema")


def _step(per_device: bool):
    """A shard_map step: the gradients psum-ed over 'data', the update applied, and an EMA of the inputs' mean,
    from the global batch (``pmean``) or from each device's own rows (``per_device``: the copies differ)."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))

        def body(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            grads = jax.lax.pmean(grads, "data")
            optimizer.update(model, grads)
            mean = jnp.mean(batch["x"], axis=0)
            mean = mean if per_device else jax.lax.pmean(mean, "data")
            model.ema[...] = 0.9 * model.ema[...] + 0.1 * mean
            return jax.lax.pmean(loss, "data"), grads, nnx.state((model, optimizer))

        run = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False
        )
        state = jax.device_put(state, NamedSharding(mesh, P()))
        loss, grads, state = jax.jit(run)(state, batch)
        nnx.update((model, optimizer), state)
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


@require_devices(2)
def test_an_ema_written_per_device_fails_on_its_copies(mesh):
    task = _task()
    assert check_parity(_step(per_device=False), task, mesh=mesh).ok
    report = check_parity(_step(per_device=True), task, mesh=mesh)
    assert not report.ok and "replicas_differ" in report.codes, report.codes
    first = next(r for r in report.steps if not r.ok)
    assert first.step == 0 and first.replica_mismatches == ("state model.ema",)
    said = next(d.message for d in report.diagnoses if d.code == "replicas_differ")
    assert "model.ema" in said
    assert said.startswith(
        "Replicas differ across devices: the model's state model.ema holds different values on different devices "
        "after step 0 (1 leaf), though its sharding says replicated, while every parameter's and optimizer-state "
        "leaf's copies agree: the step writes it from each device's own rows"
    )
    assert report.localization.stage == "replicas"
    assert "the replicas: differ (1 leaf: state model.ema)" in report.localization.text()


def test_the_replicas_sentence_says_the_axes_a_leaf_is_replicated_along():
    """Trial 32: an embedding table split over 'model' and left unreduced over 'data' read "though its sharding
    says replicated"; its copies differ along 'data', over which its sharding replicates it."""
    from shardcheck.parity.diagnosis.grouping import along as _along

    assert _along(("data",)) == " along 'data'" and _along(()) == ""
