"""The built-in ``fsdp`` step on a scan-over-layers model whose layers hold RNG state (issue #36).

The model is written as the Flax guide writes a scan over layers: the blocks are built by ``nnx.split_rngs`` +
``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: None})`` and applied with ``nnx.scan``; each block holds
``nnx.Dropout(0.0, rngs=rngs)``, so the stacked model carries an RNG key and count of shape ``(L,)``, and its
linear layers are annotated for a ``data x model`` mesh (a bias ``("model",)``, ``(None, "model")`` once stacked).
Those unannotated ``(L,)`` leaves are split over ``data`` by the FSDP rule; the fsdp step's ``shard_map`` gave
the forward pass their shards (``L / 2`` keys beside ``L`` layers), and every check of the model raised "scan got
values with different leading axis sizes: 2, 2, 1, 1, ...". The step now gathers the model's non-parameter state
whole, as it gathers the parameters: fsdp PASSes against the single-device step, and a step that sums the loss
where it should average it still FAILs against fsdp as the reference.
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

from shardcheck import Task, check_parity, make_mesh
from shardcheck.steps.sharded import state_specs

V, D, T, L, B = 16, 8, 4, 2, 8
MESH = {"data": 2, "model": 2}
LEAVES = 23  # compared a step: the loss, 5 params, their gradients, Adam mu and nu, the step and Adam count
KERNEL, ZEROS = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(
            D,
            2 * D,
            kernel_init=nnx.with_partitioning(KERNEL, (None, "model")),
            bias_init=nnx.with_partitioning(ZEROS, ("model",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            2 * D, D, kernel_init=nnx.with_partitioning(KERNEL, ("model", None)), rngs=rngs
        )
        self.drop = nnx.Dropout(0.0, rngs=rngs)  # an RNG stream per layer: a key and a count

    def __call__(self, x):
        return x + self.drop(self.down(nnx.gelu(self.up(x))))


class ScanLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None})
        def run(x, block):
            return block(x)

        return self.embed.attend(run(self.embed(tokens), self.blocks))


def loss_fn(model, batch):
    """``(loss_sum, weight)``: the cross entropy summed over the tokens the mask keeps, and their count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["targets"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])


def _batches():
    rng = np.random.default_rng(36)
    return [
        {
            "tokens": rng.integers(0, V, (B, T)).astype(np.int32),
            "targets": rng.integers(0, V, (B, T)).astype(np.int32),
            "mask": (rng.random((B, T)) < 0.75).astype(np.float32),
        }
        for _ in range(2)
    ]


TASK = Task(
    model=lambda: ScanLM(nnx.Rngs(params=0, dropout=1)),
    optimizer=optax.adamw(1e-2),
    loss_fn=loss_fn,
    batches=_batches(),
    name="scan-rng-lm",
)


@nnx.jit
def _train(model, optimizer, batch):
    def summed_loss(m):  # the fault: the loss sum where its mean belongs
        return loss_fn(m, batch)[0]

    loss, grads = nnx.value_and_grad(summed_loss)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def summed(model, optimizer, batch, mesh):
    """The user's GSPMD step with one mistake: it differentiates the masked token count's sum, not its mean."""
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    with jax.set_mesh(mesh):
        return _train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))


@pytest.fixture(scope="module")
def mesh():
    require_devices(4)
    return make_mesh(MESH)


def test_the_stacked_rng_state_is_split_and_the_annotated_leaves_keep_their_layer_axis_whole(mesh):
    with nnx.use_eager_sharding(False):
        model = TASK.model()
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    specs, _ = state_specs("fsdp", model, optimizer, mesh)
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    placed = {".".join(map(str, path)): spec for (path, _), spec in zip(flat, specs, strict=True)}
    assert placed["0.blocks.up.bias"] == P(None, "model") and placed["0.blocks.up.kernel"] == P(
        None, None, "model"
    )
    # unannotated (L,) = (2,) RNG leaves: the FSDP rule splits them over data (the forward gathers them whole)
    assert placed["0.blocks.drop.rngs.key"] == P("data") and placed["0.blocks.drop.rngs.count"] == P("data")


def test_fsdp_passes_on_the_scanned_model_with_per_layer_rng_state(mesh):
    report = check_parity("fsdp", TASK, mesh=mesh, num_shards=2)
    assert report.verdict == "PASS" and report.codes[0] == "parity", str(report)
    assert [len(record.leaves) for record in report.steps] == [LEAVES, LEAVES]
    assert all(abs(record.candidate_loss - record.loss) < 1e-5 for record in report.steps)


def test_a_summed_loss_fails_against_fsdp_as_the_reference(mesh):
    weight = float(np.sum(TASK.batches[0]["mask"]))  # 25 of the 32 tokens kept
    report = check_parity(summed, TASK, mesh=mesh, num_shards=2, reference="fsdp")
    assert report.verdict == "FAIL" and report.codes[0] == "scaled", str(report)
    assert f"gradients are {weight:g} x the reference's: {weight:g} is this batch's total loss weight" in str(
        report.diagnosis
    ), report.diagnosis
