"""Trial 23 (issue #36): a DDPM denoiser keeps an EMA of its parameters as a non-Param ``nnx.Variable`` its step
writes after the optimizer's update and the loss never reads. Live, the EMA is not compared (the task's reference
step does not write it); a replay against a recording of the user's own step compared it coarsely (the recorded
step writes it), so a gradient fault replayed as ``state_amount`` at the forward pass (the EMA's difference only
follows the parameters'). A replay now takes the live rule: state the task's loss neither reads nor writes
(``meta["floating_read"]``, ``meta["floating_written"]``, ``model_state.loss_access``) is not compared; state the
loss reads is still compared on its change (``state_amount``).
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
from shardcheck.parity.comparison.model_state import loss_access
from shardcheck.parity.harness.recorded import record_run


class EMA(nnx.Variable):
    """The parameters' moving average, kept by the user's step after its update."""


class Net(nnx.Module):
    """Two layers and an EMA of their parameters; ``anchored``: the loss reads the EMA (a pull towards it)."""

    def __init__(self, anchored: bool = False):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)
        self.anchored = anchored
        self.ema = nnx.List([EMA(jnp.array(p)) for p in jax.tree.leaves(nnx.state(self, nnx.Param))])

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    if model.anchored:
        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        loss = loss + 0.1 * sum(jnp.sum((p - e[...]) ** 2) for p, e in zip(params, model.ema, strict=True))
    return loss


def _task(anchored: bool) -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: Net(anchored), optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=batches, name="ema"
    )


def _step(decay: float = 0.9, bias_factor: float = 1.0):
    """A user's GSPMD step (state replicated, the batch split over ``data``): the optimizer's update, then the
    EMA at ``decay``; ``bias_factor`` scales the biases' gradients (a fault on one group)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g * bias_factor if "bias" in jax.tree_util.keystr(path) else g, grads
        )
        optimizer.update(model, grads)
        for e, p in zip(model.ema, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
            e[...] = decay * e[...] + (1 - decay) * p
        return {"loss": loss, "grads": grads}

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


class Logged(nnx.Variable):
    """A value the forward pass stores and never reads."""


class Logging(Net):
    def __init__(self):
        super().__init__()
        self.last = Logged(jnp.zeros(3))

    def __call__(self, x):
        out = super().__call__(x)
        self.last[...] = out.mean(0)
        return out


def test_loss_access_reads_and_writes():
    """One trace: the EMA the loss never takes is neither read nor written; the anchored loss reads it; a value
    the forward pass stores is written, not read (the live reference step writes it: still compared)."""
    batch = _task(False).batches[0]
    assert loss_access(loss_fn, Net(), batch) == (frozenset(), frozenset())
    reads, writes = loss_access(loss_fn, Net(anchored=True), batch)
    assert reads == {f"ema.{i}" for i in range(4)} and writes == frozenset()
    assert loss_access(loss_fn, Logging(), batch) == (frozenset(), frozenset({"last"}))


@require_devices(2)
def test_a_replay_does_not_blame_an_ema_the_loss_does_not_read(mesh):
    task = _task(anchored=False)
    recording = record_run(task, _step(), mesh=mesh)
    assert recording.meta["floating_read"] == [] and recording.meta["floating_written"] == []
    said = "The model's state model.ema.* (4 leaves) is neither read nor written by the task's loss: not compared"
    right = check_parity(_step(), task, mesh=mesh, reference=recording)
    assert right.ok and right.codes == ("parity",) and said in right.diagnoses[0].message
    # the EMA at another decay is not compared, as live (the task's reference step does not write it)
    assert check_parity(_step(decay=0.5), task, mesh=mesh, reference=recording).ok
    assert check_parity(_step(decay=0.5), task, mesh=mesh).ok

    for report in (
        check_parity(_step(bias_factor=2.0), task, mesh=mesh, reference=recording),
        check_parity(_step(bias_factor=2.0), task, mesh=mesh),
    ):
        assert not report.ok
        assert not {"state_amount", "model_state", "frozen_state"} & set(report.codes), report.codes
        assert report.localization.step == 0 and report.localization.stage == "gradients"
        assert "by other amounts" not in str(report)
        ema = [e for r in report.steps for e in r.leaves if e.path.startswith("model.ema")]
        assert ema and all(e.ok and e.tolerance == np.inf for e in ema if e.step == 0)


@require_devices(2)
def test_a_replay_still_compares_an_ema_the_loss_reads(mesh):
    task = _task(anchored=True)
    recording = record_run(task, _step(), mesh=mesh)
    assert recording.meta["floating_read"] == [f"ema.{i}" for i in range(4)]
    assert check_parity(_step(), task, mesh=mesh, reference=recording).ok
    other = check_parity(_step(decay=0.5), task, mesh=mesh, reference=recording)
    assert not other.ok and "state_amount" in other.codes
    assert "by other amounts" in str(other)
    # the EMA's change at step 0: (1 - 0.5) / (1 - 0.9) = 5 times the recorded one
    first = [e for e in other.steps[0].leaves if e.path.startswith("model.ema") and not e.ok]
    assert first and all(e.ratio == pytest.approx(5.0, rel=1e-3) for e in first)
