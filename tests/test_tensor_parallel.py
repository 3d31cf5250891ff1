"""Tensor parallelism as a topology: a mesh axis that splits the model, not the batch.

On a ``data=2,model=4`` mesh the batch is split over ``data`` only (S = 2 shards) and replicated over ``model``;
parameters annotated the way the Flax NNX guide writes tensor parallelism (``nnx.with_partitioning`` kernels
``(None, "model")``, column-parallel, and ``("model", None)``, row-parallel) are split over ``model``. Every
built-in strategy runs such a task and PASSes.
"""

import json
import re
from pathlib import Path

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


class DenseMoE(nnx.Module):
    """Expert parallelism: 4 experts' weights split over mesh axis 'expert', a replicated softmax gate that
    weighs every expert (no routing, so the step is exact)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.gate = nnx.Linear(4, 4, kernel_init=nnx.with_partitioning(init, (None, None)), rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (4, 4, 8)), out_sharding=("expert", None, None))
        self.b_in = nnx.Param(jnp.full((4, 8), 0.1), out_sharding=("expert", None))
        self.w_out = nnx.Param(init(rngs.params(), (4, 8, 3)), out_sharding=("expert", None, None))

    def __call__(self, x):
        h = nnx.gelu(jnp.einsum("bd,edf->bef", x, self.w_in[...]) + self.b_in[...])
        y = jnp.einsum("bef,efo->beo", h, self.w_out[...])
        return jnp.einsum("be,beo->bo", jax.nn.softmax(self.gate(x)), y)


def _tp_mlp_task(optimizer, model=TPMLP):
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32))
        for _ in range(2)
    ]
    return Task(
        model=lambda: model(nnx.Rngs(0)),
        optimizer=optimizer,
        loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
        batches=batches,
        name=model.__name__,
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
@pytest.mark.parametrize(
    "model,mesh_shape", [(TPMLP, TP_MESH), (DenseMoE, {"data": 2, "expert": 4})], ids=["tensor", "expert"]
)
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "gspmd", "simulation", "accumulation"])
def test_every_builtin_strategy_passes_a_tensor_or_expert_parallel_task(strategy, model, mesh_shape):
    # a clip that never binds: accumulation returns no gradients, and binding clipping would hide their scale
    tx = optax.chain(optax.clip_by_global_norm(100.0), optax.adamw(1e-2, weight_decay=0.1))
    report = check_parity(strategy, _tp_mlp_task(tx, model), mesh=make_mesh(mesh_shape))
    assert report.num_shards == 2  # the batch is split over 'data' only
    assert report.ok and report.verdict == "PASS", str(report)


class MixedSplits(nnx.Module):
    """Leaves split over a batch axis and a model axis at once, over both in one dimension, or unannotated."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(4, 16, kernel_init=nnx.with_partitioning(init, ("fsdp", "model")), rngs=rngs)
        self.mid = nnx.Linear(
            16, 16, kernel_init=nnx.with_partitioning(init, (("model", "fsdp"), None)), rngs=rngs
        )
        self.down = nnx.Linear(16, 3, rngs=rngs)  # unannotated: the FSDP rule

    def __call__(self, x):
        return self.down(nnx.gelu(self.mid(nnx.gelu(self.up(x)))))


@require_devices(8)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_leaves_split_over_batch_and_model_axes_at_once_pass(strategy):
    """data=2 x fsdp=2 x model=2: each gradient is summed over ('data', 'fsdp') and sliced row-major over an
    entry's axes, as a tiled all_gather concatenates them."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "model": 2})
    report = check_parity(strategy, _tp_mlp_task(optax.adam(1e-2), MixedSplits), mesh=mesh)
    assert report.num_shards == 4
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
def test_verify_tiny_lm_on_a_tensor_parallel_mesh_passes_every_strategy(tmp_path, capsys):
    from shardcheck.cli import main

    out = tmp_path / "verify.json"
    args = ["verify", "--task", "tiny-lm", "--mesh", "data=2,model=4", "--steps", "2", "--json", str(out)]
    assert main(args) == 0
    assert (
        "S=2 on mesh data=2 x model=4 (batch over data; model annotated over model)"
        in capsys.readouterr().out
    )
    report = json.loads(out.read_text())
    assert report["mesh"] == TP_MESH and report["num_shards"] == 2
    assert set(report["strategies"]) == {"simulation", "dp", "fsdp", "gspmd", "accumulation"}
    assert all(r["ok"] for r in report["strategies"].values())


@require_devices(8)
def test_verify_the_megatron_example_and_its_step(tmp_path):
    from shardcheck.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "megatron_mlp.py"
    out = tmp_path / "verify.json"
    args = [
        "verify",
        "--task",
        f"{example}:task",
        "--mesh",
        "data=2,model=4",
        "--candidate",
        f"{example}:step",
    ]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_shards"] == 2
    assert set(report["strategies"]) == {"simulation", "dp", "fsdp", "gspmd", "accumulation", "candidate"}
    assert all(r["verdict"] == "PASS" for r in report["strategies"].values()), report["strategies"]


# ------------------------------------------------------------- a user's Megatron-style step, and its faults

D, HEADS, HEAD_DIM, MLP, SEQ = 16, 4, 4, 32, 8


def _param(rngs, shape, spec, init=None):
    init = nnx.initializers.lecun_normal() if init is None else init
    return nnx.Param(init(rngs.params(), shape), out_sharding=spec)


def _annotated(init, spec):
    return nnx.with_partitioning(init, spec)


ZEROS, ONES = nnx.initializers.zeros_init(), nnx.initializers.ones_init()


def _layer_norm(rngs):
    return nnx.LayerNorm(
        D, scale_init=_annotated(ONES, (None,)), bias_init=_annotated(ZEROS, (None,)), rngs=rngs
    )


class MegatronBlock(nnx.Module):
    """Pre-LayerNorm attention with biases, heads split over 'model', and an MLP, column- then row-parallel
    (Shoeybi et al., "Megatron-LM", 2019, section 3). ``reduce`` is the psum over 'model' of a row-parallel
    partial sum (the identity on one device); ``bias_first`` plants the bias added before it."""

    def __init__(self, rngs):
        self.ln1 = _layer_norm(rngs)
        self.qkv = _param(rngs, (3, D, HEADS, HEAD_DIM), (None, None, "model", None))
        self.qkv_bias = _param(rngs, (3, HEADS, HEAD_DIM), (None, "model", None), ZEROS)
        self.out = _param(rngs, (HEADS, HEAD_DIM, D), ("model", None, None))
        self.out_bias = _param(rngs, (D,), (None,), ZEROS)
        self.ln2 = _layer_norm(rngs)
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            D,
            MLP,
            kernel_init=_annotated(init, (None, "model")),
            bias_init=_annotated(ZEROS, ("model",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            MLP,
            D,
            kernel_init=_annotated(init, ("model", None)),
            bias_init=_annotated(ZEROS, (None,)),
            rngs=rngs,
        )

    def _row_parallel(self, partial, bias, reduce, bias_first):
        return reduce(partial + bias) if bias_first else reduce(partial) + bias

    def __call__(self, x, mask, reduce, bias_first=False):
        h = self.ln1(x)
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, self.qkv[i]) + self.qkv_bias[i] for i in range(3))
        scores = jnp.where(mask, jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HEAD_DIM), -1e9)
        o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)
        attn = jnp.einsum("bthk,hkd->btd", o, self.out[...])
        x = x + self._row_parallel(attn, self.out_bias[...], reduce, bias_first)
        h = nnx.gelu(self.ln2(x) @ self.up.kernel[...] + self.up.bias[...])
        return x + self._row_parallel(h @ self.down.kernel[...], self.down.bias[...], reduce, bias_first)


class MegatronLM(nnx.Module):
    def __init__(self, rngs):
        from shardcheck.tasks.tiny_lm import vocab_size

        replicated = _annotated(nnx.initializers.normal(0.02), (None, None))
        self.embed = nnx.Embed(vocab_size(), D, embedding_init=replicated, rngs=rngs)
        self.pos = nnx.Embed(SEQ, D, embedding_init=replicated, rngs=rngs)
        self.block = MegatronBlock(rngs)
        self.ln_f = _layer_norm(rngs)
        self.head = nnx.Linear(
            D, vocab_size(), kernel_init=replicated, bias_init=_annotated(ZEROS, (None,)), rngs=rngs
        )

    def __call__(self, tokens, mask, reduce=lambda y: y, bias_first=False):
        valid = mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        return self.head(self.ln_f(self.block(x, attn_mask, reduce, bias_first)))


def masked_loss(model, batch, **kw):
    """``(sum of the cross-entropy over the unmasked tokens, their count)``."""
    logits = model(batch["tokens"], batch["mask"], **kw)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])


def _megatron_task():
    from shardcheck.tasks.tiny_lm import lm_batches

    return Task(
        model=lambda: MegatronLM(nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=masked_loss,
        batches=lm_batches(16, 3, seq_len=SEQ),
        name="megatron-lm",
    )


def _grad_reduction(fault, g, spec, count):
    if fault == "pmean_as_psum":  # each shard's mean over its share of the tokens, psum-ed for a pmean: x2
        return jax.lax.psum(g / (count / 2), "data")
    if fault == "replicated_over_model" and not any(spec):
        # all-reduced over every device, as on a data-parallel mesh; the batch is replicated over 'model': x4
        return jax.lax.psum(jax.lax.pcast(g, "model", to="varying"), ("data", "model")) / count
    return jax.lax.psum(g, "data") / count


def megatron_step(fault=None, grads_returned=False):
    """A user's tensor-parallel step: the state placed by its annotations, one jax.shard_map in which each
    device holds its slice of the split leaves, the row-parallel partial sums psum-ed over 'model' (check_vma
    inserts the all-reduce of the column-parallel inputs' gradients), the gradients psum-ed over 'data' and
    divided by the token count. ``fault``: "no_psum" (the row-parallel outputs not psum-ed; the user turned
    check_vma off to make the step trace), "psum_data" (psum-ed over 'data' in place of 'model', check_vma off),
    "bias_first" (the replicated biases added before the psum), "pmean_as_psum", "replicated_over_model".
    ``grads_returned``: the step returns its gradients beside the loss."""

    def step(model, optimizer, batch, mesh):
        graphdef, params = nnx.split(model, nnx.Param)
        specs = nnx.get_partition_spec(params)
        params = jax.device_put(params, nnx.get_named_sharding(params, mesh))
        axis = {"no_psum": None, "psum_data": "data"}.get(fault, "model")  # psum_data: over the wrong axis
        reduce = (lambda y: y) if axis is None else (lambda y: jax.lax.psum(y, axis))

        def body(p, b):
            p = jax.tree.map(
                lambda a: jax.lax.pcast(a, "data", to="varying"), p
            )  # no implicit psum over data

            def local(p):
                return masked_loss(nnx.merge(graphdef, p), b, reduce=reduce, bias_first=fault == "bias_first")

            (total, count), g = jax.value_and_grad(local, has_aux=True)(p)
            count = jax.lax.psum(count, "data")
            leaves = jax.tree.leaves(g)
            spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
            reduced = [_grad_reduction(fault, a, s, count) for a, s in zip(leaves, spec_leaves, strict=True)]
            return jax.lax.psum(total, "data") / count, jax.tree.unflatten(jax.tree.structure(g), reduced)

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P("data")),
            out_specs=(P(), specs),
            check_vma=fault not in ("no_psum", "psum_data"),
        )
        loss, grads = jax.jit(mapped)(params, batch)
        optimizer.update(model, grads)
        if grads_returned:
            return {"loss": loss, "grads": grads}
        return loss  # only its loss: the harness reads the update from the state

    return step


@require_devices(8)
def test_a_megatron_style_step_passes():
    report = check_parity(megatron_step(), _megatron_task(), mesh=make_mesh(TP_MESH))
    assert report.num_shards == 2
    assert report.ok and report.verdict == "PASS", str(report)


@require_devices(8)
@pytest.mark.parametrize("fault", ["no_psum", "psum_data"])
def test_a_missing_psum_over_model_is_named_with_the_affected_leaves(fault):
    """The row-parallel outputs not psum-ed, or psum-ed over 'data' in place of 'model' (trial 54: that one read
    word for word the missing psum, never naming a psum over the wrong axis)."""
    report = check_parity(megatron_step(fault), _megatron_task(), mesh=make_mesh(TP_MESH))
    assert report.verdict == "FAIL"
    assert report.codes[0] == "wrong_axis_reduction", report.diagnoses
    message = report.diagnoses[0].message
    assert "differ along mesh axis 'model' and agree along 'data'" in message
    assert "by its name 'model' splits the model, not the batch" in message
    assert (
        "the row-parallel layer's output was not psum-ed over 'model' (Megatron's g: y = jax.lax.psum(h @ w, "
        "'model') + b), or was psum-ed over 'data' in its place (a psum over a batch axis adds other rows' partial "
        "results)" in message
    )
    assert "Affected: the " in message and "block.down.bias" in message
    assert "though the batch is split over every axis" not in message


@require_devices(8)
def test_a_replicated_bias_added_before_the_psum_is_named_per_leaf():
    """Each of the 4 model shards adds the zero-initialized row-parallel biases: the loss of step 0 matches, their
    gradients (and Adam's moments) are x4, every other leaf matches."""
    report = check_parity(megatron_step("bias_first"), _megatron_task(), mesh=make_mesh(TP_MESH))
    assert report.verdict == "FAIL"
    assert report.codes[0] == "replicated_reduced", report.diagnoses
    message = report.diagnoses[0].message
    assert "2 leaves (block.down.bias, block.out_bias) is x4 the reference's" in message
    assert "x4 is the size of mesh axis 'model'" in message
    assert "added before the psum over 'model' counts once per shard" in message
    ratios = {e.path: e.ratio for e in report.steps[0].leaves if e.kind == "opt_state" and ".mu." in e.path}
    np.testing.assert_allclose(ratios["0.mu.block.down.bias"], 4.0, rtol=1e-4)
    np.testing.assert_allclose(ratios["0.mu.block.up.bias"], 1.0, rtol=1e-4)


def _nonzero_bias_task():
    """The Megatron task with its row-parallel biases away from 0, as a check started from a checkpoint has them."""

    def model():
        m = MegatronLM(nnx.Rngs(0))
        m.block.out_bias[...] = jnp.linspace(-0.05, 0.05, D)
        m.block.down.bias[...] = jnp.linspace(0.05, -0.05, D)
        return m

    task = _megatron_task()
    return Task(
        model=model, optimizer=task.optimizer, loss_fn=task.loss_fn, batches=task.batches, name=task.name
    )


@require_devices(8)
def test_a_replicated_bias_added_before_the_psum_is_named_where_it_is_not_zero():
    """Trial 54: with the biases away from 0 the bias added before the psum moves the loss (the forward stage
    differs first, no factor on the whole), and the finding read only a list of masks and positions; a replicated
    bias of a module split over 'model' whose gradient is about 4 x (the axis's size) now leads it. The correct
    step still passes."""
    task = _nonzero_bias_task()
    assert check_parity(megatron_step(), task, mesh=make_mesh(TP_MESH)).ok
    report = check_parity(megatron_step("bias_first", grads_returned=True), task, mesh=make_mesh(TP_MESH))
    assert report.verdict == "FAIL" and report.localization.stage == "forward", str(report)
    lead = report.diagnoses[0]
    assert lead.code == "forward_differs", report.codes
    assert re.match(
        r"The gradient of block\.(out_bias|down\.bias), a bias replicated over 'model' in a module split over it "
        r"\(block(\.down)?\), is [34]\.\d+ x the reference's \(median\), about the size of mesh axis 'model' \(4\): "
        r"a parameter added before the psum over 'model' counts once per shard: each of the 4 shards adds it to "
        r"its partial sum \(a row-parallel layer's replicated bias: add it after the reduction, y = "
        r"jax\.lax\.psum\(h @ w, 'model'\) \+ b\); so it counts 4 times in the output \(the loss differs\)",
        lead.message,
    ), lead.message


@require_devices(8)
def test_replicated_gradients_psummed_over_model_are_named_by_the_axis():
    report = check_parity(megatron_step("replicated_over_model"), _megatron_task(), mesh=make_mesh(TP_MESH))
    assert report.verdict == "FAIL"
    assert report.codes[0] == "replicated_reduced", report.diagnoses
    message = report.diagnoses[0].message
    assert "x4 is the size of mesh axis 'model'" in message and "under 'block'" not in message
    assert "block.down.bias" in message and "add it after the reduction" in message
    # trial 34: a sequence-parallel step needs one psum over 'model' for its replicated leaves: never "drop it"
    # as a fact, and the double reduction (shard_map's own psum plus an explicit one) is said first
    assert (
        "these gradients were reduced over 'model' once too often. Either their gradient was psum-ed"
        in message
    )
    assert "as sequence parallelism does, needs exactly one" in message


@require_devices(8)
def test_a_psum_over_data_for_a_pmean_is_summed_over_the_data_shards():
    report = check_parity(megatron_step("pmean_as_psum"), _megatron_task(), mesh=make_mesh(TP_MESH))
    assert report.verdict == "FAIL"
    assert report.codes[0] == "summed", report.diagnoses
    assert "x2: a sum over 2 shards" in report.diagnoses[0].message


def test_a_uniform_factor_of_a_model_axis_size_names_the_axis():
    from shardcheck.parity.diagnosis.rules import _name_factor
    from shardcheck.parity.diagnosis.topology import name_leaves

    code, phrase = _name_factor(4.0, 2, TP_MESH)
    assert code == "summed" and phrase.startswith("x4: the size of mesh axis 'model', which splits the model")
    assert "reduce the gradients over the batch axes 'data' only" in phrase
    code, phrase = _name_factor(2.0, 2, {"data": 2, "model": 2})  # S = 2 = the model axis: both causes
    assert code == "summed" and phrase.startswith(
        "x2: a sum over the 2 batch shards for their mean; or, 2 being"
    )
    # no model axis: the factors of S, as before
    assert _name_factor(4.0, 2, {"data": 2}) == _name_factor(4.0, 2, None)
    assert "sum-reduced twice" in _name_factor(4.0, 2, {"data": 2})[1]
    assert name_leaves(["param a.x", "param a.y"]) == "param a.x, param a.y"
    many = [f"param block.{k}.bias" for k in "abcdef"]
    assert name_leaves(many) == (
        "the 6 leaves under 'block' (param block.a.bias, param block.b.bias, param block.c.bias, "
        "param block.d.bias and 2 more)"
    )


def test_the_wrong_axis_message_follows_which_axes_split_the_batch():
    from shardcheck.parity.diagnosis.topology import missed_axes_message

    leaves = ["param ln.scale", "opt_state 0.mu.ln.scale"]
    hybrid = missed_axes_message(0, leaves, ("fsdp",), {"data": 2, "fsdp": 4})
    assert "the gradients were not reduced over 'fsdp' (reduced over 'data' only" in hybrid
    assert "though the batch is split over every axis" in hybrid
    assert hybrid.endswith("Affected: param ln.scale, opt_state 0.mu.ln.scale.")
    mesh = {"data": 2, "fsdp": 2, "model": 2}
    on_batch = missed_axes_message(0, leaves, ("fsdp",), mesh)
    assert "though the batch is split over 'data', 'fsdp' (and replicated over 'model')" in on_batch
    on_model = missed_axes_message(0, leaves, ("model",), mesh)
    assert (
        "by its name 'model' splits the model, not the batch (the batch is split over 'data', 'fsdp'"
        in on_model
    )
    assert "sequence parallelism" in on_model and "every axis" not in on_model
    # trial 6: a clip by each device's local norm (shard_map, check_vma=False) while the loss and the gradients
    # the step returns match: no forward psum (Megatron's g) nor backward one (f) is blamed
    after = missed_axes_message(0, leaves, ("model",), mesh, after_gradients=True)
    assert (
        "while the loss and every gradient the step returns match the reference's: the copies parted after"
        in (after)
    )
    assert "a clip by the norm of its local gradients" in after and "Megatron" not in after
    assert after.endswith("Affected: param ln.scale, opt_state 0.mu.ln.scale.")


def test_the_wrong_axis_finding_blames_no_gradient_reduction_where_the_gradients_match():
    from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
    from shardcheck.parity.diagnosis.rules import diagnose

    def leaf(kind, path, ok):
        return LeafError(0, kind, path, 0.0 if ok else 1e-3, 0.0, 1e-5, ok, shape=(4,))

    mismatch = {"replica_mismatches": ("opt_state 0.mu.ln.scale",), "replica_axes": ("model",)}
    mesh = {"data": 2, "model": 2}
    for grads_ok in (True, False):
        leaves = (
            leaf("loss", "loss", True),
            leaf("grad", "ln.scale", grads_ok),
            leaf("param", "ln.scale", True),
        )
        record = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, leaves, 1, 1, **mismatch)
        found = next(d for d in diagnose([record], mesh_shape=mesh) if d.code == "wrong_axis_reduction")
        assert ("the copies parted after the gradients" in found.message) is grads_ok
        assert ("Megatron's g" in found.message) is not grads_ok


def test_a_replica_count_that_is_also_s_names_the_model_axis_alone_beside_matching_leaves():
    """Trial 6: x2 on the replicated leaves of a data=2,model=2 mesh was also offered as "the number of batch
    shards S: a second psum over the batch axes", which would have doubled the matching (model-split) leaves too;
    and "(their gradients and optimizer moments)" was said of leaves whose moments a binding clip had moved by
    another factor. Neither is said; the leaves are named once."""
    from shardcheck.parity.diagnosis.topology import replicated_reduced_message

    both = replicated_reduced_message(0, ["b.bias"], 3, 2, {"data": 2, "model": 2})
    assert "x2 is the size of mesh axis 'model'" in both and "batch shards S" not in both
    assert "optimizer moments" not in both
    assert both.startswith(
        "At step 0 the gradient of 1 leaf (b.bias) is x2 the reference's while the other 3 match"
    )
    many = replicated_reduced_message(0, [f"l{i}.bias" for i in range(6)], 3, 4, TP_MESH)
    assert (
        many.startswith("At step 0 the gradient of the 6 leaves (l0.bias, ") and "leaves (the 6" not in many
    )
    no_model = replicated_reduced_message(0, ["bias"], 1, 4, {"fsdp": 4})
    assert no_model.startswith(
        "At step 0 the gradient of 1 leaf (bias) is x4 the reference's while the other 1 match: those leaves were "
        "reduced twice"
    )


@require_devices(8)
def test_num_shards_on_a_tensor_parallel_mesh_is_the_batch_shards(capsys):
    from shardcheck.cli import main

    task = _tp_mlp_task(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"has 8 devices but num_shards=8; the batch is split over its axes"):
        check_parity("dp", task, num_shards=8, mesh=make_mesh(TP_MESH))
    code = main(
        ["verify", "--task", "tiny-lm", "--mesh", "data=3,model=2", "--batch-size", "16", "--steps", "1"]
    )
    assert code == 2
    message = " ".join(capsys.readouterr().err.split())
    # the one wording of the batch-divisibility rule (_validate.check_divisible), with the mesh's batch shards
    assert "batch size 16 is not divisible by the 3 batch shards of --mesh data=3,model=2" in message
    assert "pass --batch-size with a multiple of 3, e.g. --batch-size 18" in message


@require_devices(8)
def test_a_bias_added_before_the_psum_that_changes_the_loss_is_explained(tmp_path):
    """From the new-user trial: examples/megatron_mlp.py with its row-parallel bias added before the psum over
    'model' (the bias is not zero at init, so the loss differs too): the diagnosis names the forward pass, the
    bias counted once per model shard, and the fix."""
    from shardcheck.tasks import load_task
    from shardcheck.tasks.loading import import_attr

    source = (Path(__file__).resolve().parents[1] / "examples" / "megatron_mlp.py").read_text()
    right = "return reduce(h @ self.down.kernel[...]) + self.down.bias[...]"
    assert right in source
    path = tmp_path / "bias_before.py"
    path.write_text(source.replace(right, "return reduce(h @ self.down.kernel[...] + self.down.bias[...])"))
    task = load_task(f"{path}:task")
    step = import_attr("test", f"{path}:step", "FUNC")
    report = check_parity(step, task, mesh=make_mesh(TP_MESH))
    assert report.verdict == "FAIL" and "update_differs" in report.codes
    assert "a replicated bias added on every shard before the psum over 'model' (it counts 4 times" in (
        report.diagnosis
    )
