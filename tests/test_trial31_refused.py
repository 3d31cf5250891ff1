"""Trial 31 (issue #36): a GRU whose forward pass writes its carried hidden state. The built-in strategies that
run the forward pass per shard refuse such a model (docs/parity.md); they were ERROR rows, and a passing candidate
beside them exited 2. They are REFUSED rows, as a loss coupling the rows is (trial 27): said once, left out of the
exit status.
"""

import textwrap

import pytest
from conftest import require_devices

from shardcheck.cli import main

TASK = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import shardcheck


    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.norm(nnx.relu(self.l1(x))))


    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(2)
    ]
    task = shardcheck.Task(model=Net, optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=batches, name="bn")


    @nnx.jit
    def _train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}


    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return _train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    """
)


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "bn31.py"
    path.write_text(TASK)
    return path


@require_devices(2)
def test_builtins_refusing_a_model_that_writes_its_state_leave_a_passing_candidate_at_exit_0(
    task_file, capsys
):
    argv = ["verify", "--task", f"{task_file}:task", "--mesh", "data=2", "--strategies", "simulation,dp"]
    assert main([*argv, "--candidate", f"{task_file}:step"]) == 0
    out, err = capsys.readouterr()
    flat_out, flat_err = (" ".join(t.replace("│", " ").split()) for t in (out, err))
    assert flat_out.count("refused: the forward pass writes model state (below)") == 2
    assert "candidate PASS" in flat_out and "ERROR" not in flat_out
    assert flat_err.count("note: ") == 1 and "error:" not in flat_err
    assert "writes non-parameter state" in flat_err
