"""Trial 30 (issue #36): knowledge distillation with a frozen teacher (an ``optax.multi_transform`` group
``set_to_zero``, its logits under ``stop_gradient``: its gradient exactly 0). A candidate whose step also decayed
the teacher and returned no gradients PASSed a replay: the teacher's gradient read as rounding noise, and the
candidate's own update was added to the teacher's allowance as noise's (the live check FAILs). A gradient exactly
0 in both runs is compared as it is.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.harness.recorded import record_run


class Distill(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.teacher = nnx.Linear(6, 4, rngs=rngs)
        self.student = nnx.Linear(6, 4, rngs=rngs)

    def __call__(self, x):
        return self.student(x), jax.lax.stop_gradient(self.teacher(x))


def loss_fn(model, batch):
    student, teacher = model(batch["x"])
    return jnp.mean((student - teacher) ** 2)


def _task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(8, 6)).astype(np.float32)} for _ in range(3)]

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if "teacher" in jax.tree_util.keystr(path) else "train", params
        )

    tx = optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels)
    return shardcheck.Task(model=Distill, optimizer=tx, loss_fn=loss_fn, batches=batches, name="distill")


def _step(decay_teacher: bool, grads_out: bool):
    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        if decay_teacher:  # the teacher in the decayed group: it moves though its gradient is 0
            model.teacher.kernel[...] = model.teacher.kernel[...] * (1 - 1e-4)
        return {"loss": loss, "grads": grads} if grads_out else {"loss": loss}

    return step


@require_devices(2)
@pytest.mark.parametrize("grads_out", [False, True])
def test_a_frozen_teacher_moved_by_the_step_fails_the_replay_as_live(grads_out):
    task = _task()
    recording = record_run(task, _step(False, True), num_shards=2)
    assert check_parity(_step(False, grads_out), task, reference=recording, num_shards=2).ok
    assert not check_parity(_step(True, grads_out), task, num_shards=2).ok
    replayed = check_parity(_step(True, grads_out), task, reference=recording, num_shards=2)
    assert not replayed.ok and replayed.verdict == "FAIL"
    assert "param teacher.kernel" in {e.name for r in replayed.steps for e in r.leaves if not e.ok}
