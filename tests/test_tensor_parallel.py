"""Tensor parallelism as a topology: a mesh axis that splits the model, not the batch.

On a ``data=2,model=4`` mesh the batch is split over ``data`` only (S = 2 shards) and replicated over ``model``;
parameters annotated the way the Flax NNX guide writes tensor parallelism (``nnx.with_partitioning`` kernels
``(None, "model")``, column-parallel, and ``("model", None)``, row-parallel) are split over ``model``. Every
built-in strategy runs such a task and PASSes.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.mesh import batch_axes, data_shards, fsdp_axis, model_axes
from shardcheck.placement import placement_report
from shardcheck.steps.sharded import mesh_step, place_batch
from shardcheck.tasks import TinyLM, TinyLMConfig, tiny_lm_task

TP_MESH = {"data": 2, "model": 4}


# ------------------------------------------------------------------------------------------------ mesh roles


@require_devices(8)
@pytest.mark.parametrize(
    "shape,batch,model,shards",
    [
        ({"data": 8}, ("data",), (), 8),
        ({"model": 4}, ("model",), (), 4),  # a mesh with neither batch name: the batch spans every axis
        ({"x": 2, "y": 4}, ("x", "y"), (), 8),
        ({"data": 2, "fsdp": 4}, ("data", "fsdp"), (), 8),
        ({"data": 2, "model": 4}, ("data",), ("model",), 2),
        ({"data": 2, "fsdp": 2, "tensor": 2}, ("data", "fsdp"), ("tensor",), 4),
        ({"expert": 2, "fsdp": 4}, ("fsdp",), ("expert",), 4),
    ],
)
def test_batch_axes_are_the_data_axes_and_the_rest_split_the_model(shape, batch, model, shards):
    mesh = make_mesh(shape)
    assert batch_axes(mesh) == batch and model_axes(mesh) == model
    assert data_shards(mesh) == data_shards(shape) == shards


@require_devices(8)
def test_the_batch_is_replicated_over_the_model_axis():
    mesh = make_mesh(TP_MESH)
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    placed = place_batch({"x": x}, mesh)["x"]
    assert placed.sharding.spec == P("data")
    assert {s.data.shape for s in placed.addressable_shards} == {(8, 3)}  # B / 2 rows on each of 8 devices
    assert fsdp_axis(mesh) == "data"  # FSDP shards the unannotated state over the data axis


# ------------------------------------------------------------------------------------------ a TP MLP block


class TPMLP(nnx.Module):
    """An MLP block as the Flax NNX guide shards it: column-parallel ``up``, row-parallel ``down``."""

    def __init__(self, rngs: nnx.Rngs):
        init, bias = nnx.initializers.lecun_normal(), nnx.initializers.normal(0.1)
        self.up = nnx.Linear(
            4,
            16,
            kernel_init=nnx.with_partitioning(init, (None, "model")),
            bias_init=nnx.with_partitioning(bias, ("model",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            16,
            3,
            kernel_init=nnx.with_partitioning(init, ("model", None)),
            bias_init=nnx.with_partitioning(bias, (None,)),
            rngs=rngs,
        )

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def _tp_mlp_task(optimizer):
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32))
        for _ in range(2)
    ]
    return Task(
        model=lambda: TPMLP(nnx.Rngs(0)),
        optimizer=optimizer,
        loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
        batches=batches,
        name="tp-mlp",
    )


@require_devices(8)
def test_the_annotations_split_the_model_over_model_and_nothing_over_data():
    task = _tp_mlp_task(optax.adam(1e-2))
    model = task.new_model()
    optimizer = task.new_optimizer(model)
    mesh_step("fsdp", task.loss_fn, model, optimizer, task.batches[0], make_mesh(TP_MESH))
    shards = {p.path: (p.shard_shape, p.axes) for p in placement_report(model, optimizer)}
    assert shards["up.kernel"] == ((4, 4), {"data": None, "model": 1})
    assert shards["up.bias"] == ((4,), {"data": None, "model": 0})
    assert shards["down.kernel"] == ((4, 3), {"data": None, "model": 0})
    assert shards["down.bias"] == ((3,), {"data": None, "model": None})
    assert shards["step"][0] == ()  # the optimizer's counter: unannotated, a scalar, whole on any mesh


@require_devices(8)
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "gspmd", "simulation", "accumulation"])
def test_every_builtin_strategy_passes_a_tensor_parallel_task(strategy):
    # a clip that never binds: accumulation returns no gradients, and binding clipping would hide their scale
    task = _tp_mlp_task(optax.chain(optax.clip_by_global_norm(100.0), optax.adamw(1e-2, weight_decay=0.1)))
    report = check_parity(strategy, task, mesh=make_mesh(TP_MESH))
    assert report.num_shards == 2  # the batch is split over 'data' only
    assert report.ok and report.verdict == "PASS", str(report)


# ------------------------------------------------------------------------------------------- tiny-lm, TP


def test_tiny_lm_tensor_parallel_configuration_changes_no_value():
    plain = TinyLM(TinyLMConfig(num_heads=4), rngs=nnx.Rngs(0))
    with nnx.use_eager_sharding(False):  # as Task.new_model builds it: no mesh in context
        tp = TinyLM(TinyLMConfig(num_heads=4), tensor_axis="model", rngs=nnx.Rngs(0))
    for a, b in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(nnx.state(tp)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    specs = {
        ".".join(map(str, path)): tuple(nnx.get_partition_spec(v).get_value())
        for path, v in nnx.to_flat_state(nnx.state(tp, nnx.Param))
    }
    block = "blocks.0"
    assert specs[f"{block}.fc1.kernel"] == (None, "model") and specs[f"{block}.fc1.bias"] == ("model",)
    assert specs[f"{block}.fc2.kernel"] == ("model", None) and specs[f"{block}.fc2.bias"] == (None,)
    assert specs[f"{block}.attn.query.kernel"] == (None, "model", None)
    assert specs[f"{block}.attn.query.bias"] == ("model", None)
    assert specs[f"{block}.attn.out.kernel"] == ("model", None, None)
    assert specs[f"{block}.attn.out.bias"] == (None,)
    assert specs["embed.embedding"] == (None, None) and specs["ln_f.scale"] == (None,)
    assert tiny_lm_task(tensor_parallel={"model": 4}, steps=1).new_model().config.num_heads == 4
    with pytest.raises(ValueError, match=r"tiny-lm: the tensor-parallel axis 'model' of size 3 must divide"):
        tiny_lm_task(tensor_parallel={"model": 3}, steps=1)
    with pytest.raises(ValueError, match=r"tiny-lm: tensor_parallel must name one mesh axis"):
        tiny_lm_task(tensor_parallel={"model": 2, "expert": 2}, steps=1)


@require_devices(8)
def test_verify_tiny_lm_on_a_tensor_parallel_mesh_passes_every_strategy(tmp_path):
    from shardcheck.cli import main

    out = tmp_path / "verify.json"
    args = ["verify", "--task", "tiny-lm", "--mesh", "data=2,model=4", "--steps", "2", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["mesh"] == TP_MESH and report["num_shards"] == 2
    assert set(report["strategies"]) == {"simulation", "dp", "fsdp", "gspmd", "accumulation"}
    assert all(r["ok"] for r in report["strategies"].values())

