"""Trial 27 (issue #36): an MoE task whose capacity factor changed after its recording, replayed with a correct
step, read "not a single reduced step: the loss it returns is not the full-batch loss at its starting
parameters" (the live check of that step PASSes). A replayed step run from the recording's state that returns
the task's full-batch loss there, while the recording holds another, is ``recording_differs``: the recording,
not the step. A replay's hint of a sharded forward pass is one possible cause, not a fact (the trial's doubled
z-loss coefficient read "says the sharded forward pass computes another function").
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
from shardcheck.parity.harness.recorded import record_run


class Net(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _loss(coef: float):
    def loss_fn(model, batch):  # a mean loss and an auxiliary term at coefficient coef
        out = model(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2) + coef * jnp.mean(out**2)

    return loss_fn


def _task(coef: float) -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=Net, optimizer=optax.adam(1e-2), loss_fn=_loss(coef), batches=batches, name="aux"
    )


def _step(coef: float, loss_factor: float = 1.0):
    """A user's GSPMD step on ``_loss(coef)``; ``loss_factor`` scales the loss it trains on (a fault)."""
    loss_fn = _loss(coef)

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m, b: loss_factor * loss_fn(m, b))(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


@require_devices(2)
def test_a_recording_of_the_task_before_a_change_is_named_not_the_step(mesh):
    recording = record_run(_task(0.01), _step(0.01), mesh=mesh)
    changed = _task(0.02)  # the auxiliary coefficient changed after the recording
    assert check_parity(_step(0.02), changed, mesh=mesh).ok  # the step is correct for the task as it is
    report = check_parity(_step(0.02), changed, mesh=mesh, reference=recording)
    assert not report.ok and report.codes == ("recording_differs",), report.codes
    first = next(r for r in report.steps if not r.ok)
    message = report.diagnoses[0].message
    assert first.step == 0 and first.task_loss == pytest.approx(first.candidate_loss, rel=1e-5)
    assert f"the recording holds {first.loss:.7g}" in message
    assert "changed since it was recorded" in message and "not a single reduced step" not in str(report)


@require_devices(2)
def test_a_faulty_step_against_a_recording_of_this_task_is_still_the_steps(mesh):
    recording = record_run(_task(0.01), _step(0.01), mesh=mesh)
    report = check_parity(_step(0.01, loss_factor=1.01), _task(0.01), mesh=mesh, reference=recording)
    assert not report.ok and "recording_differs" not in report.codes, report.codes
    assert all(r.task_loss is None for r in report.steps)
    assert report.localization.step == 0 and report.localization.stage == "forward"


@require_devices(2)
def test_the_summary_names_the_worst_leaf_of_the_first_failing_step(mesh):
    """Trial 27: the summary's worst leaf was the worst over all steps (a leaf the fault reached at step 2) beside
    a localization that said that leaf matched at step 0."""
    from shardcheck.cli.verify import _worst_cells

    report = check_parity(_step(0.01, loss_factor=1.01), _task(0.01), mesh=mesh, steps=2)
    first = next(r for r in report.steps if not r.ok)
    bad = [e for e in first.leaves if not e.ok]
    worst = max(bad, key=lambda e: e.badness)
    assert report.first_worst == worst and first.step == 0
    cells = _worst_cells(report)
    assert cells[0] == f"{worst.name} (step 0)" and cells[1] == f"{worst.max_abs_err:.3g}"
    assert check_parity(_step(0.01), _task(0.01), mesh=mesh, steps=1).first_worst is not None
