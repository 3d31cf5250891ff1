"""``shardcheck.memory``: exact per-device bytes, worked by hand, and the estimate against the compiled step.

Hand counts used below (float32 = 4 B, bfloat16 = 2 B, the int32 Adam count and the uint32 NNX step = 4 B each):

Linear(8, 6), S=4: kernel (8, 6) = 192 B splits on D to (2, 6) = 48 B; bias (6,) = 24 B does not divide by 4
and stays whole. Parameters: 216 B whole, 48 + 24 = 72 B sharded. Adam: 4 + 2 * 216 = 436 B whole,
4 + 2 * 72 = 148 B sharded. Momentum: one trace, 216 / 72 B. The seed's even split: (8 + 1) * 6 / 4 * 4 B = 54 B.

MLP 4 -> 8 -> 3, S=4: hidden kernel (4, 8) = 128 B -> (1, 8) = 32 B; hidden bias (8,) = 32 B -> 8 B;
out kernel (8, 3) = 96 B -> (2, 3) = 24 B; out bias (3,) = 12 B whole. Parameters 268 B whole, 76 B sharded.
"""

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import estimate_memory, measure_memory
from shardcheck.memory import DeepMLP, make_memory_model
from shardcheck.models import make_model
from shardcheck.partitioning import STRATEGIES

STEP = 4  # nnx.Optimizer.step, uint32, on every device

# (params, grads, optimizer) bytes per device, Linear(8, 6), S=4, float32.
LINEAR_8_6_S4 = {
    "sgd": {
        "replicated": (216, 216, 0),
        "dp": (216, 216, 0),
        "zero1": (216, 216, 0),
        "zero2": (216, 72, 0),
        "fsdp": (72, 72, 0),
    },
    "momentum": {
        "replicated": (216, 216, 216),
        "dp": (216, 216, 216),
        "zero1": (216, 216, 72),
        "zero2": (216, 72, 72),
        "fsdp": (72, 72, 72),
    },
    "adam": {
        "replicated": (216, 216, 436),
        "dp": (216, 216, 436),
        "zero1": (216, 216, 148),
        "zero2": (216, 72, 148),
        "fsdp": (72, 72, 148),
    },
}

# MLP 4 -> 8 -> 3, S=4, float32: optimizer whole 0 / 268 / 4 + 536 = 540; sharded 0 / 76 / 4 + 152 = 156.
MLP_4_8_3_S4 = {
    "sgd": {
        "replicated": (268, 268, 0),
        "dp": (268, 268, 0),
        "zero1": (268, 268, 0),
        "zero2": (268, 76, 0),
        "fsdp": (76, 76, 0),
    },
    "momentum": {
        "replicated": (268, 268, 268),
        "dp": (268, 268, 268),
        "zero1": (268, 268, 76),
        "zero2": (268, 76, 76),
        "fsdp": (76, 76, 76),
    },
    "adam": {
        "replicated": (268, 268, 540),
        "dp": (268, 268, 540),
        "zero1": (268, 268, 156),
        "zero2": (268, 76, 156),
        "fsdp": (76, 76, 156),
    },
}


def abstract(kind, d, k, **kw):
    return nnx.eval_shape(lambda: make_model(kind, d, k, **kw))


def check(est, params, grads, opt):
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes, est.step_bytes) == (
        params,
        grads,
        opt,
        STEP,
    )
    assert est.persistent_bytes == params + opt + STEP
    assert est.total_bytes == params + grads + opt + STEP
    assert est.total_bytes == sum(leaf.per_device_bytes for leaf in est.leaves)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_linear_exact_bytes(strategy, optimizer):
    est = estimate_memory(abstract("linear", 8, 6), optimizer, num_shards=4, strategy=strategy)
    check(est, *LINEAR_8_6_S4[optimizer][strategy])
    assert est.num_devices == (1 if strategy == "replicated" else 4)
    assert est.param_count == 54
    assert est.unsharded_total_bytes == LINEAR_8_6_S4[optimizer]["replicated"][0] * 2 + (
        LINEAR_8_6_S4[optimizer]["replicated"][2] + STEP
    )


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mlp_exact_bytes(strategy, optimizer):
    est = estimate_memory(abstract("mlp", 4, 3, hidden=8), optimizer, num_shards=4, strategy=strategy)
    check(est, *MLP_4_8_3_S4[optimizer][strategy])
    assert est.param_count == 67


def test_leaf_that_does_not_divide_stays_whole():
    est = estimate_memory(abstract("linear", 8, 6), "adam", num_shards=4, strategy="fsdp")
    leaves = {(leaf.category, leaf.path): leaf for leaf in est.leaves}
    kernel, bias = leaves["params", "kernel"], leaves["params", "bias"]
    assert kernel.sharded and kernel.shard_shape == (2, 6) and kernel.per_device_bytes == 48
    assert kernel.global_bytes == 192 and kernel.spec == repr(jax.sharding.PartitionSpec("fsdp"))
    assert not bias.sharded and bias.shard_shape == (6,) and bias.per_device_bytes == 24
    assert bias.replicated_reason == "no dimension of (6,) divides by S=4"
    assert all(leaf.padded_bytes == 0 for leaf in est.leaves)  # the rule replicates, it never pads
    assert leaves["optimizer", "0.count"].replicated_reason == "scalar"
    assert leaves["optimizer", "0.mu.bias"].per_device_bytes == 24
    assert leaves["optimizer", "0.nu.kernel"].per_device_bytes == 48
    assert leaves["step", "step"].dtype == "uint32" and leaves["step", "step"].per_device_bytes == 4
    zero1 = estimate_memory(abstract("linear", 8, 6), "adam", num_shards=4, strategy="zero1")
    assert {leaf.replicated_reason for leaf in zero1.leaves if leaf.category == "params"} == {
        "zero1 replicates params"
    }
    one = estimate_memory(abstract("linear", 8, 6), "adam", num_shards=4, strategy="replicated")
    assert {leaf.replicated_reason for leaf in one.leaves} == {"one device"}


def test_even_split_of_seed_001_beside_the_real_layout():
    est = estimate_memory(abstract("linear", 8, 6), "sgd", num_shards=4, strategy="fsdp")
    assert est.even_split_params_bytes == 54.0  # (8 + 1) * 6 / 4 * 4 B
    assert est.even_split_formula == "(8 + 1) * 6 / 4 * 4 B"
    assert est.params_bytes - est.even_split_params_bytes == 18  # the bias: 24 B whole, 6 B if it divided
    assert "18 B per device above the even split" in est.even_split_note
    assert "bias (6,) replicated" in est.even_split_note
    # the largest replicated leaves first, before "and N more" (trial 54: an 8 KiB embedding left out of the four)
    from shardcheck.memory.estimate import LeafMemory, _above_even_split

    def leaf(path, shape, reason):
        size = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        return LeafMemory(path, "params", shape, "float32", "P()", shape, False, reason, size, size)

    leaves = [leaf(f"ln{i}.scale", (24,), "not divisible") for i in range(5)]
    leaves.insert(3, leaf("embed.embedding", (64, 32), "tied"))
    assert _above_even_split(leaves, 4)[0].startswith("embed.embedding (64, 32) replicated (tied): +6,144 B")
    even = estimate_memory(abstract("linear", 8, 8), "sgd", num_shards=4, strategy="fsdp")
    assert even.params_bytes == even.even_split_params_bytes == 72
    assert even.even_split_note.startswith("equal to the even split")
    dp = estimate_memory(abstract("linear", 8, 6), "sgd", num_shards=4, strategy="dp")
    assert dp.even_split_params_bytes == 54.0 and dp.params_bytes == 216
    assert "by design" in dp.even_split_note
    # A parameter count that S does not divide: the even split is fractional.
    odd = estimate_memory(abstract("linear", 2, 1), "sgd", num_shards=2, strategy="fsdp")
    assert odd.even_split_params_bytes == 6.0 and odd.params_bytes == 8  # kernel (1, 1) / 2 B, bias 4 B
    frac = estimate_memory(abstract("linear", 4, 1), "sgd", num_shards=8, strategy="fsdp")
    assert frac.even_split_params_bytes == 2.5 and frac.params_bytes == 20  # nothing divides by 8
    mlp = estimate_memory(abstract("mlp", 4, 3, hidden=8), "sgd", num_shards=4, strategy="fsdp")
    assert mlp.even_split_formula == "67 / 4 * 4 B" and mlp.even_split_params_bytes == 67.0


def test_bfloat16():
    """bf16 parameters, gradients and Adam moments are 2 B a value; the counters stay 4 B."""
    model = abstract("linear", 8, 6)
    fsdp = estimate_memory(model, "adam", num_shards=4, strategy="fsdp", param_dtype="bfloat16")
    check(fsdp, 36, 36, 76)  # kernel (2, 6) = 24 B + bias (6,) = 12 B; 4 + 2 * 36
    dp = estimate_memory(model, "adam", num_shards=4, strategy="dp", param_dtype=jnp.bfloat16)
    check(dp, 108, 108, 220)
    assert fsdp.even_split_formula == "(8 + 1) * 6 / 4 * 2 B" and fsdp.even_split_params_bytes == 27.0
    real = make_memory_model(8, 6, param_dtype="bfloat16", abstract=True)  # built in bf16: the same figures
    assert estimate_memory(real, "adam", num_shards=4, strategy="fsdp") == fsdp


def test_multisteps_accumulator_is_counted():
    """docs/reduction_cases.md C9: optax.MultiSteps keeps a parameter-sized float32 accumulator, even for bf16."""
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    model = abstract("linear", 8, 6)
    # mini_step + gradient_step (int32) + acc_grads (216 B whole, 72 B sharded).
    check(estimate_memory(model, tx, num_shards=4, strategy="dp"), 216, 216, 224)
    check(estimate_memory(model, tx, num_shards=4, strategy="fsdp"), 72, 72, 80)
    check(estimate_memory(model, tx, num_shards=4, strategy="fsdp", param_dtype="bfloat16"), 36, 36, 80)
    adam = optax.MultiSteps(optax.adam(0.1), every_k_schedule=4)
    check(estimate_memory(model, adam, num_shards=4, strategy="replicated"), 216, 216, 8 + 436 + 216)


def test_deep_mlp_splits_the_first_dimension_that_divides():
    """DeepMLP 4 -> 8 -> 8 -> 2, S=8: (4, 8) splits on its second dimension; bias (2,) stays whole."""
    model = make_memory_model(4, 2, hidden=8, layers=3, abstract=True)
    assert isinstance(model, DeepMLP) and len(model.layers) == 3
    est = estimate_memory(model, "sgd", num_shards=8, strategy="fsdp")
    leaves = {leaf.path: leaf for leaf in est.leaves if leaf.category == "params"}
    assert leaves["layers.0.kernel"].shard_shape == (4, 1)
    assert leaves["layers.0.kernel"].spec == repr(jax.sharding.PartitionSpec(None, "fsdp"))
    assert leaves["layers.1.kernel"].shard_shape == (1, 8)
    assert leaves["layers.2.kernel"].shard_shape == (1, 2)
    assert not leaves["layers.2.bias"].sharded
    # 16 + 4 + 32 + 4 + 8 + 8 B; the even split is 130 * 4 / 8 = 65 B, the whole bias (2,) adds 7 B.
    check(est, 72, 72, 0)
    assert est.even_split_params_bytes == 65.0 and est.param_count == 130


def test_abstract_4096_by_8_layers_without_allocating():
    gc.collect()  # earlier tests' garbage holding arrays, freed now rather than by a collection in between
    live_before = len(jax.live_arrays())
    model = make_memory_model(4096, 4096, hidden=4096, layers=8, abstract=True)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(nnx.state(model)))
    per_layer = 4096 * 4096 + 4096  # 16,781,312 values
    whole = 8 * per_layer * 4  # 537,001,984 B
    fsdp = estimate_memory(model, "adam", num_shards=8, strategy="fsdp")
    check(fsdp, whole // 8, whole // 8, 4 + 2 * whole // 8)
    assert fsdp.total_bytes == 268_501_000 and fsdp.param_count == 8 * per_layer
    one = estimate_memory(model, "adam", num_shards=8, strategy="replicated")
    assert one.total_bytes == 4 * whole + 8 == 2_148_007_944
    gc.collect()
    assert len(jax.live_arrays()) == live_before


def test_accepts_real_models_states_and_pytrees():
    model = make_model("linear", 8, 6)
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    expected = estimate_memory(abstract("linear", 8, 6), "adam", num_shards=4, strategy="zero2")
    assert estimate_memory(model, opt, num_shards=4, strategy="zero2") == expected
    assert estimate_memory(model, optax.adam(0.1), num_shards=4, strategy="zero2") == expected
    assert estimate_memory(nnx.state(model, nnx.Param), "adam", num_shards=4, strategy="zero2") == expected
    tree = {"kernel": jax.ShapeDtypeStruct((8, 6), jnp.float32), "bias": np.zeros(6, np.float32)}
    assert estimate_memory(tree, "adam", num_shards=4, strategy="zero2") == expected


def test_one_shard_is_one_device():
    for strategy in STRATEGIES:
        est = estimate_memory(abstract("linear", 8, 6), "adam", num_shards=1, strategy=strategy)
        check(est, 216, 216, 436)
        assert est.even_split_params_bytes == 216.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(strategy="zero3"),
            ValueError,
            r"estimate_memory: strategy='zero3' is unknown; use one of replicated",
        ),
        (dict(optimizer="lamb"), ValueError, r"estimate_memory: optimizer='lamb' is unknown; use one of sgd"),
        (dict(optimizer=42), TypeError, r"estimate_memory: optimizer must be a name"),
        (dict(param_dtype="int32"), ValueError, r"param_dtype='int32' is not a floating dtype"),
        (dict(param_dtype="float33"), ValueError, r"param_dtype='float33' is not a dtype"),
        (dict(num_shards=0), ValueError, r"estimate_memory: num_shards must be a positive int, got 0"),
        (dict(num_shards=-2), ValueError, r"num_shards must be a positive int, got -2"),
        (dict(num_shards=2.0), TypeError, r"num_shards must be a positive int, got 2.0"),
        (dict(num_shards=True), TypeError, r"num_shards must be a positive int"),
        (dict(model="linear"), TypeError, r"model_or_abstract_state must be an nnx.Module"),
        (dict(model={}), ValueError, r"model_or_abstract_state has no parameters"),
        (dict(model={"w": "abc"}), TypeError, r"leaf w is str, not an array"),
    ],
)
def test_estimate_bad_input(kwargs, error, match):
    args = dict(model=abstract("linear", 8, 6), optimizer="sgd", num_shards=4, strategy="fsdp")
    args.update(kwargs)
    model, optimizer = args.pop("model"), args.pop("optimizer")
    with pytest.raises(error, match=match):
        estimate_memory(model, optimizer, **args)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 3), {}, r"make_memory_model: in_features must be a positive int, got 0"),
        ((4, -1), {}, r"out_features must be a positive int, got -1"),
        ((4, 3), dict(hidden=0), r"hidden must be a positive int, got 0"),
        ((4, 3), dict(hidden=8, layers=0), r"layers must be a positive int, got 0"),
        ((4, 3), dict(layers=3), r"layers=3 needs a hidden width"),
        ((4, 3), dict(hidden=8, layers=1), r"layers=1 is a single Linear"),
        ((4, 3), dict(param_dtype="int8"), r"param_dtype='int8' is not a floating dtype"),
        ((4.0, 3), {}, r"in_features must be a positive int, got 4.0"),
    ],
)
def test_model_bad_input(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_memory_model(*args, abstract=True, **kwargs)


# ------------------------------------------------------------------------------------------- measured

# Linear(16, 6) with Adam, S=4: kernel 384 B -> (4, 6) = 96 B; bias (6,) 24 B whole. Persistent per device:
# whole 408 + (4 + 816) + 4 = 1232 B; zero1/zero2 408 + (4 + 240) + 4 = 656 B; fsdp 120 + 244 + 4 = 368 B.
PERSISTENT_16_6_ADAM = {"replicated": 1232, "dp": 1232, "zero1": 656, "zero2": 656, "fsdp": 368}


@pytest.fixture(scope="module")
def mesh4():
    from shardcheck import make_mesh

    return make_mesh(4)


def batch(d=16, k=6, b=8):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (b, d)), jax.random.normal(ky, (b, k))


@require_devices(4)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_measured_state_equals_estimate(strategy, mesh4):
    model = make_model("linear", 16, 6)
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    kernel_before = np.asarray(model.kernel[...])
    x, y = batch()
    m = measure_memory(model, opt, x, y, strategy=strategy, mesh=mesh4)
    n = 1 if strategy == "replicated" else 4
    expected = PERSISTENT_16_6_ADAM[strategy]
    assert m.num_devices == n
    assert m.estimated_persistent_bytes == expected
    assert m.state_bytes_per_device == (expected,) * n  # the live arrays' addressable shards, every device
    assert m.state_bytes == expected and m.accuracy_ratio == 1.0
    # The data: x (8, 16) and y (8, 6) float32, split in 4 on the batch (whole on one device).
    assert m.data_argument_bytes == (8 * 16 + 8 * 6) * 4 // n
    assert m.argument_bytes - m.data_argument_bytes == m.state_argument_bytes == expected
    assert m.peak_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes
    assert m.output_bytes >= expected
    # The caller's model and optimizer are untouched (the step ran on a copy).
    np.testing.assert_array_equal(model.kernel[...], kernel_before)
    assert int(opt.step[...]) == 0


@require_devices(4)
def test_measured_bfloat16_and_multisteps(mesh4):
    x, y = batch()
    model = make_memory_model(16, 6, param_dtype="bfloat16")
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    m = measure_memory(model, opt, x, y, strategy="fsdp", mesh=mesh4)
    # kernel (4, 6) bf16 = 48 B + bias 12 B; Adam 4 + 2 * 60; step 4.
    assert m.state_bytes_per_device == (188,) * 4 == (m.estimated_persistent_bytes,) * 4
    model = make_model("linear", 16, 6)
    opt = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), wrt=nnx.Param)
    for strategy, expected in (("dp", 408 + 8 + 408 + 4), ("fsdp", 120 + 8 + 120 + 4)):
        m = measure_memory(model, opt, x, y, strategy=strategy, mesh=mesh4)
        assert m.state_bytes_per_device == (expected,) * 4 == (m.state_argument_bytes,) * 4
        assert m.accuracy_ratio == 1.0


@require_devices(4)
def test_measure_bad_input(mesh4):
    model = make_model("linear", 16, 6)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = batch()
    with pytest.raises(ValueError, match=r"measure_memory: strategy='zero9' is unknown"):
        measure_memory(model, opt, x, y, strategy="zero9", mesh=mesh4)
    with pytest.raises(ValueError, match=r"measure_memory: batch size 6 is not divisible"):
        measure_memory(model, opt, x[:6], y[:6], strategy="dp", mesh=mesh4)
    with pytest.raises(TypeError, match=r"measure_memory: mesh must be a jax.sharding.Mesh"):
        measure_memory(model, opt, x, y, strategy="dp", mesh="data")
    with pytest.raises(TypeError, match=r"measure_memory: optimizer must be an nnx.Optimizer"):
        measure_memory(model, optax.sgd(0.1), x, y, strategy="dp", mesh=mesh4)
    assert math.isclose(float(opt.step[...]), 0.0)


# ------------------------------------------------------------------------------------------------ task form

# shardcheck.tasks.tiny_lm_task() by hand: TinyLMConfig() has V = 77 ids, d = 32, 2 heads of 16, MLP 128, T = 32,
# 2 blocks. Per block: ln1, ln2 scale + bias (32,) x 4; query/key/value kernels (32, 2, 16) and biases (2, 16);
# out kernel (2, 16, 32) and bias (32,); fc1 (32, 128) + (128,); fc2 (128, 32) + (32,). Then embed (77, 32),
# pos_embed (32, 32), ln_f (32,) x 2, lm_head (32, 77) + (77,).
TINY_LM_BLOCK = [(32,)] * 4 + [(32, 2, 16)] * 3 + [(2, 16)] * 3 + [(2, 16, 32), (32,)]
TINY_LM_BLOCK += [(32, 128), (128,), (128, 32), (32,)]
TINY_LM_SHAPES = TINY_LM_BLOCK * 2 + [(77, 32), (32, 32), (32,), (32,), (32, 77), (77,)]


def hand_bytes(shapes, s):
    """float32 bytes per device: a leaf with a dimension divisible by S holds 1/S of it, else all of it."""
    return sum(math.prod(shape) * 4 // (s if any(d % s == 0 for d in shape) else 1) for shape in shapes)


def test_tiny_lm_task_estimate_by_hand():
    from shardcheck.tasks import tiny_lm_task

    task = tiny_lm_task()
    abstract_model = nnx.eval_shape(task.model)
    shapes = sorted(tuple(v.shape) for v in jax.tree.leaves(nnx.state(abstract_model, nnx.Param)))
    assert shapes == sorted(TINY_LM_SHAPES)
    whole, split = hand_bytes(TINY_LM_SHAPES, 1), hand_bytes(TINY_LM_SHAPES, 4)
    assert (whole, split) == (126_004, 31_732)  # 31,501 parameters; only lm_head's bias (77,) stays whole
    adam_whole, adam_split = 4 + 2 * whole, 4 + 2 * split  # the int32 count + mu + nu
    expected = {  # (params, grads, optimizer) per device, S = 4; the NNX step counter adds 4 B
        "replicated": (whole, whole, adam_whole),
        "dp": (whole, whole, adam_whole),
        "zero1": (whole, whole, adam_split),
        "zero2": (whole, split, adam_split),
        "fsdp": (split, split, adam_split),
    }
    gc.collect()  # earlier tests' garbage holding arrays, freed now rather than by a collection in between
    live_before = len(jax.live_arrays())
    for strategy in STRATEGIES:
        est = estimate_memory(task, num_shards=4, strategy=strategy)
        check(est, *expected[strategy])
        assert est.param_count == 31_501 and est.model_state_bytes == 0
        assert est.num_devices == (1 if strategy == "replicated" else 4)
    gc.collect()
    assert len(jax.live_arrays()) == live_before  # shapes only: the model was never allocated
    fsdp = estimate_memory(task, num_shards=4, strategy="fsdp")
    leaves = {(leaf.category, leaf.path): leaf for leaf in fsdp.leaves}
    assert leaves["params", "lm_head.bias"].replicated_reason == "no dimension of (77,) divides by S=4"
    assert leaves["params", "embed.embedding"].shard_shape == (77, 8)  # 77 does not divide: the width does
    assert leaves["optimizer", "0.nu.blocks.1.attn.out.kernel"].shard_shape == (2, 4, 32)
    # The same figures as the (abstract model, optimizer) form.
    assert fsdp == estimate_memory(abstract_model, task.optimizer, num_shards=4, strategy="fsdp")


@pytest.fixture(scope="module")
def tiny_lm():
    from shardcheck.tasks import tiny_lm_task

    return tiny_lm_task(steps=1)


@require_devices(4)
@pytest.mark.parametrize("strategy, persistent", [("dp", 126_004 * 3 + 8), ("fsdp", 31_732 * 3 + 8)])
def test_tiny_lm_task_persistent_estimate_equals_live_bytes(tiny_lm, mesh4, strategy, persistent):
    m = measure_memory(tiny_lm, strategy=strategy, mesh=mesh4)
    assert m.estimated_persistent_bytes == persistent  # params + Adam (2 x params + count) + step
    assert m.state_bytes_per_device == (persistent,) * 4 and m.accuracy_ratio == 1.0
    # The batch: tokens, targets (int32) and mask (float32), (16, 32) each, a quarter per device.
    assert m.data_argument_bytes == 3 * 16 * 32 * 4 // 4
    assert m.state_argument_bytes == persistent
    assert m.peak_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes


@require_devices(4)
def test_model_state_is_counted_and_measured(mesh4):
    """A model's RNG stream (Dropout at rate 0 draws nothing) is state too: a uint32 count and an 8-byte key."""
    from shardcheck import Task

    class Dropped(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.0, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.drop(self.linear(x))

    x, y = batch(8, 4, 16)
    task = Task(
        model=Dropped,
        optimizer=optax.sgd(0.1, momentum=0.9),
        loss_fn=lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2),
        batches=[{"x": x, "y": y}],
    )
    # kernel (8, 4) = 128 B -> 32 B, bias (4,) = 16 B -> 4 B; one momentum trace; step; count 4 B + key 8 B.
    est = estimate_memory(task, num_shards=4, strategy="fsdp")
    assert (est.params_bytes, est.model_state_bytes, est.optimizer_bytes) == (36, 12, 36)
    assert est.persistent_bytes == 36 + 12 + 36 + 4
    assert {leaf.dtype for leaf in est.leaves if leaf.category == "model_state"} == {"uint32", "key<fry>"}
    for strategy in ("dp", "fsdp", "zero2"):
        m = measure_memory(task, strategy=strategy, mesh=mesh4)
        assert m.state_bytes_per_device == (m.estimated_persistent_bytes,) * 4, strategy


def test_layouts_come_from_the_registry():
    from shardcheck import partitioning
    from shardcheck.steps import STRATEGIES as REGISTRY

    assert STRATEGIES == ("replicated", "dp", "zero1", "zero2", "fsdp")
    runnable = {n: layout.strategy for n, layout in partitioning.LAYOUTS.items() if layout.strategy}
    assert runnable == {"replicated": "reference", "dp": "dp", "fsdp": "fsdp"}
    for name, strategy in runnable.items():
        assert partitioning.LAYOUTS[name].placement == REGISTRY[strategy].placement
    assert set(STRATEGIES) - set(runnable) == set(partitioning.MEMORY_ONLY) == {"zero1", "zero2"}


def test_task_form_bad_input():
    from shardcheck.tasks import digits_task

    task = digits_task(steps=1)
    with pytest.raises(TypeError, match=r"estimate_memory: with a Task pass no optimizer"):
        estimate_memory(task, "adam", num_shards=4, strategy="fsdp")
    with pytest.raises(TypeError, match=r"estimate_memory: optimizer is missing"):
        estimate_memory(abstract("linear", 8, 6), num_shards=4, strategy="fsdp")
    with pytest.raises(TypeError, match=r"measure_memory: with a Task pass no optimizer, x or y"):
        measure_memory(task, None, np.ones((4, 64)), strategy="dp")
    with pytest.raises(ValueError, match=r"measure_memory: strategy='zero3' is unknown"):
        measure_memory(task, strategy="zero3")
    from shardcheck import make_mesh

    with pytest.raises(
        ValueError, match=r"measure_memory: batch size 64 \(batch leaf 'label'\) is not divisible"
    ):
        measure_memory(task, strategy="dp", mesh=make_mesh(3))


@require_devices(8)
def test_even_split_on_a_2d_mesh_names_the_replicated_shards():
    """On data=2 x fsdp=4 a split leaf holds a quarter per device, not an eighth: its shards are replicated over
    'data'. tiny-lm, by hand from its shapes: each leaf with a dimension 4 divides adds global/4 - global/8."""
    from shardcheck import make_mesh
    from shardcheck.tasks import load_task

    task = load_task("tiny-lm", steps=1)
    est = estimate_memory(task, mesh=make_mesh({"data": 2, "fsdp": 4}), strategy="fsdp")
    params = [leaf for leaf in est.leaves if leaf.category == "params"]
    split = [leaf for leaf in params if any(d % 4 == 0 for d in leaf.shape)]
    copies = sum(4 * math.prod(leaf.shape) / 4 - 4 * math.prod(leaf.shape) / 8 for leaf in split)
    whole = [leaf for leaf in params if leaf not in split]
    assert [leaf.path for leaf in whole] == ["lm_head.bias"]  # 77 ids: no dimension 4 divides
    assert copies == 15_712 and est.params_bytes - est.even_split_params_bytes == copies + 77 * 4 * 7 / 8
    assert (
        "split leaves' shards replicated over the mesh axes they are not split over: +15,712 B"
        in est.even_split_note
    )
    assert "lm_head.bias (77,) replicated" in est.even_split_note
