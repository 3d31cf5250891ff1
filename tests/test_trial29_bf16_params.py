"""Trial 29 (issue #36): a model whose parameters are stored in bfloat16 (``param_dtype=bfloat16``) trained by
``optax.apply_if_finite(adamw)``:

- the harness's own optimizer reruns (the tolerance's sensitivity, the hypotheses, the update check) gave the
  optimizer float32 gradients of bfloat16 parameters; ``apply_if_finite`` keeps its state in the parameters'
  dtype and raised "cond branches must have equal output types" (verify exited 2 on a correct step);
- Adam computes its update in the parameters' precision (bfloat16 moments): the built-in fsdp and accumulation
  steps, correct, landed 2 bfloat16 ulps from the reference where 1.8 were allowed (a false FAIL).
"""

import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck import check_parity, make_mesh


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.l1 = nnx.Linear(16, 32, **kw)
        self.head = nnx.Linear(32, 4, **kw)

    def __call__(self, x):
        return self.head(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.integers(0, 4, size=16).astype(np.int32)}
        for _ in range(3)
    ]
    tx = optax.apply_if_finite(optax.adamw(3e-3, weight_decay=0.01), max_consecutive_errors=3)
    return shardcheck.Task(model=MLP, optimizer=tx, loss_fn=loss_fn, batches=batches, name="bf16-mlp")


@nnx.jit
def _decayed(model, optimizer, batch):
    """The task's step, then a decay of the biases too (a fault of the update)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    for layer in (model.l1, model.head):
        layer.bias[...] = layer.bias[...] * jnp.bfloat16(0.9)
    return {"loss": loss, "grads": grads}


@require_devices(4)
def test_bfloat16_parameters_under_apply_if_finite_pass_the_built_ins_and_fail_a_fault():
    task = _task()
    mesh = make_mesh({"data": 2, "fsdp": 2})
    for strategy in ("fsdp", "gspmd"):
        report = check_parity(strategy, task, mesh=mesh)
        assert report.ok, (strategy, str(report))
    assert check_parity("accumulation", task, num_shards=4).ok
    faulty = check_parity(_decayed, task, num_shards=2)
    assert not faulty.ok and faulty.verdict == "FAIL"
    assert faulty.localization.step == 0
