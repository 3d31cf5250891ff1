"""A model that casts to bfloat16 in its own code (``w[...].astype(jnp.bfloat16)``, no layer ``dtype``): the
compute dtype is read from the loss's traced matmul operands (trial 38: a correct step FAILed as "the gradients
were likely all-reduced in bfloat16 ... while the model computes its gradients in float32", and with
``--compute-dtype bfloat16`` the built-in strategies were refused as "the loss couples the rows", at float32's
tolerance)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck.parity.tolerance.precision import Precision, traced_compute_dtype


class CastingMLP(nnx.Module):
    """A 2-layer MLP whose matmuls take bfloat16 operands cast in ``__call__`` (parameters stay float32)."""

    def __init__(self, dtype=jnp.bfloat16):
        rngs = nnx.Rngs(0)
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (8, 32)) / 3)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (32, 4)) / 6)
        self.dtype = None  # no layer dtype: only the code's casts say bfloat16
        self.cast = dtype

    def __call__(self, x):
        h = jax.nn.gelu(x.astype(self.cast) @ self.w1[...].astype(self.cast))
        return (h @ self.w2[...].astype(self.cast)).astype(jnp.float32)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task(dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: CastingMLP(dtype), optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=batches
    )


def test_the_compute_dtype_is_read_from_the_losss_matmuls():
    task = _task()
    model = task.new_model()
    assert traced_compute_dtype(loss_fn, model, task.batches[0]) == jnp.bfloat16
    assert Precision.of(model).compute_dtype == jnp.float32  # the layers alone say float32
    traced = traced_compute_dtype(loss_fn, model, task.batches[0])
    assert Precision.of(model, traced=traced).compute_dtype == jnp.bfloat16
    f32 = _task(jnp.float32)
    assert traced_compute_dtype(loss_fn, f32.new_model(), f32.batches[0]) == jnp.float32


@require_devices(2)
def test_a_correct_step_passes_and_a_sum_for_a_mean_fails():
    task = _task()
    for strategy in (
        "dp",
        "accumulation",
    ):  # not refused as coupling the rows, and within bfloat16's rounding
        report = shardcheck.check_parity(strategy, task, num_shards=2)
        assert report.verdict == "PASS" and report.compute_dtype == "bfloat16", str(report)

    def summed(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: 2 * loss_fn(m, batch))(model)  # 2 shards' means summed
        optimizer.update(model, grads)
        return {"loss": loss / 2, "grads": grads}

    report = shardcheck.check_parity(summed, task, num_shards=2)
    assert report.verdict == "FAIL" and report.codes[0] == "summed", str(report)
