"""Memory on meshes of several axes: annotated placements by hand, the live bytes of a user's own step, the step
compiled ahead of time on abstract inputs against the same step compiled with real arrays, and device fits.

Hand count of :class:`Annotated2D` on the mesh data=2 x fsdp=4 (8 devices), float32 (4 B a value):

=========  =======  =========================  =======  ==========  ===========================
leaf       shape    annotation                 global   per device  why
=========  =======  =========================  =======  ==========  ===========================
w1         (8, 12)  ("fsdp", None)             384 B    96 B        dim 0 split 4
w2         (16, 6)  (("data", "fsdp"), None)   384 B    48 B        dim 0 split 2 x 4 = 8
e          (2, 8)   ("data", "fsdp")           64 B     8 B         (1, 2): split 2 and 4
b          (12,)    (None,)                    48 B     48 B        annotated replicated
scale      (6,)     none                       24 B     24 B        the rule: 6 does not divide by fsdp=4
v          (8,)     none                       32 B     8 B         the rule: split over fsdp
=========  =======  =========================  =======  ==========  ===========================

Parameters: 936 B whole, 232 B per device. Adam: an int32 count + mu + nu = 4 + 2 x params. clip_by_global_norm
keeps no state (EmptyState); adamw is scale_by_adam (count, mu, nu) + add_decayed_weights (no state) + the
learning rate (no state when constant; an int32 count under a schedule). The NNX step counter: 4 B. gspmd places
the annotations alone: ``v`` stays whole (32 B), 256 B of parameters per device.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, ahead_of_time, device_memory
from shardcheck.memory import estimate_memory, measure_memory

ROOT = Path(__file__).resolve().parents[1]

PARAMS_WHOLE, PARAMS_SPLIT = 936, 232
PER_LEAF = {"w1": (384, 96), "w2": (384, 48), "e": (64, 8), "b": (48, 48), "scale": (24, 24), "v": (32, 8)}


class Annotated2D(nnx.Module):
    def __init__(self):
        def param(shape, spec=None):
            kw = {} if spec is None else {"out_sharding": spec}
            return nnx.Param(jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape), **kw)

        self.w1 = param((8, 12), ("fsdp", None))
        self.w2 = param((16, 6), (("data", "fsdp"), None))
        self.e = param((2, 8), ("data", "fsdp"))
        self.b = param((12,), (None,))
        self.scale = param((6,))
        self.v = param((8,))

    def __call__(self, x):  # (B, 8) -> (B,)
        h = jnp.tanh(x @ self.w1[...] + self.b[...])  # (B, 12)
        z = h @ jnp.ones((12, 16)) @ self.w2[...] * self.scale[...]  # (B, 6)
        return z.sum(-1) + (x * self.v[...]).sum(-1) + self.e[...].sum()


def annotated_task(tx) -> Task:
    x = np.linspace(-1.0, 1.0, 16 * 8, dtype=np.float32).reshape(16, 8)
    return Task(
        model=Annotated2D,
        optimizer=tx,
        loss_fn=lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2),
        batches=[{"x": x, "y": np.cos(x.sum(-1))}],
    )


SCHEDULE = optax.linear_schedule(1e-3, 0.0, 10)
OPTIMIZERS = {  # optimizer state bytes (whole, per device under fsdp)
    "adam": (optax.adam(1e-3), 4 + 2 * PARAMS_WHOLE, 4 + 2 * PARAMS_SPLIT),
    "clip+adamw": (
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
        4 + 2 * PARAMS_WHOLE,
        4 + 2 * PARAMS_SPLIT,
    ),
    "clip+adamw(schedule)": (
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE, weight_decay=0.1)),
        8 + 2 * PARAMS_WHOLE,
        8 + 2 * PARAMS_SPLIT,
    ),
}


@pytest.fixture(scope="module")
def mesh_2x4():
    from shardcheck.mesh import make_mesh

    return make_mesh({"data": 2, "fsdp": 4})


@require_devices(8)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_annotated_2d_placement_exact_bytes(mesh_2x4, name):
    tx, opt_whole, opt_split = OPTIMIZERS[name]
    task = annotated_task(tx)
    expected = {  # (params, grads, optimizer) per device; the step counter adds 4 B everywhere
        "replicated": (PARAMS_WHOLE, PARAMS_WHOLE, opt_whole),
        "dp": (PARAMS_WHOLE, PARAMS_WHOLE, opt_whole),
        "zero1": (PARAMS_WHOLE, PARAMS_WHOLE, opt_split),
        "zero2": (PARAMS_WHOLE, PARAMS_SPLIT, opt_split),
        "fsdp": (PARAMS_SPLIT, PARAMS_SPLIT, opt_split),
        # the annotations alone (trial 43): v (unannotated) whole, 32 B where the rule keeps 8 B, and its moments
        "gspmd": (PARAMS_SPLIT + 24, PARAMS_SPLIT + 24, opt_split + 2 * 24),
    }
    live_before = {id(a) for a in jax.live_arrays()}
    for strategy, (params, grads, opt) in expected.items():
        est = estimate_memory(task, mesh=mesh_2x4, strategy=strategy)
        assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes, est.step_bytes) == (
            params,
            grads,
            opt,
            4,
        )
        assert est.persistent_bytes == params + opt + 4 and est.total_bytes == params + grads + opt + 4
        assert est.num_devices == (1 if strategy == "replicated" else 8)
        assert est.mesh_shape == (("data", 2), ("fsdp", 4)) and est.param_count == 234
    assert not {id(a) for a in jax.live_arrays()} - live_before  # abstract shapes only
    fsdp = estimate_memory(task, mesh=mesh_2x4, strategy="fsdp")
    leaves = {(leaf.category, leaf.path): leaf for leaf in fsdp.leaves}
    for path, (whole, split) in PER_LEAF.items():
        for category in ("params", "grads"):
            leaf = leaves[category, path]
            assert (leaf.global_bytes, leaf.per_device_bytes) == (whole, split), (category, path)
            assert leaf.sharded == (split < whole)
    assert leaves["params", "w2"].split_axes == ("data", "fsdp") and leaves["params", "w2"].shard_shape == (
        2,
        6,
    )
    assert leaves["params", "e"].split_axes == ("data", "fsdp") and leaves["params", "e"].shard_shape == (
        1,
        2,
    )
    assert leaves["params", "b"].replicated_reason == "annotated (None,): replicated"
    assert leaves["params", "scale"].replicated_reason == "no dimension of (6,) divides by fsdp=4"
    assert leaves["params", "v"].split_axes == ("fsdp",)
    moments = [leaf for leaf in fsdp.leaves if leaf.path.endswith("mu.w2")]
    assert (
        len(moments) == 1 and moments[0].per_device_bytes == 48
    )  # the optimizer state inherits the annotation
    assert leaves["step", "step"].replicated_reason == "scalar"


@require_devices(8)
def test_placed_state_is_read_from_its_shardings(mesh_2x4):
    """strategy='placed': the arrays' own shardings, here every leaf replicated by hand, then as annotated."""
    from jax.sharding import NamedSharding, PartitionSpec

    task = annotated_task(optax.adam(1e-3))
    model = task.new_model()
    optimizer = task.new_optimizer(model)
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh_2x4, PartitionSpec())))
    placed = estimate_memory(model, optimizer, mesh=mesh_2x4, strategy="placed")
    assert placed.persistent_bytes == PARAMS_WHOLE + 4 + 2 * PARAMS_WHOLE + 4
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh_2x4)))
    placed = estimate_memory(model, optimizer, mesh=mesh_2x4, strategy="placed")
    # nnx.get_named_sharding places only what is annotated: v (8,) stays whole (32 B, not the rule's 8 B) in the
    # parameter and both moments; every annotated leaf is as the estimate places it.
    fsdp = estimate_memory(task, mesh=mesh_2x4, strategy="fsdp")
    assert fsdp.persistent_bytes == PARAMS_SPLIT + 4 + 2 * PARAMS_SPLIT + 4
    assert placed.persistent_bytes == fsdp.persistent_bytes + 3 * (32 - 8)
    leaves = {(leaf.category, leaf.path): leaf for leaf in placed.leaves}
    assert leaves["params", "v"].replicated_reason == "placed replicated"
    assert leaves["params", "w2"].per_device_bytes == 48
    with pytest.raises(ValueError, match=r"estimate_memory: strategy='placed' needs real placed arrays"):
        estimate_memory(nnx.eval_shape(task.new_model), optimizer, mesh=mesh_2x4, strategy="placed")


def test_mesh_form_bad_input(mesh_2x4):
    task = annotated_task(optax.adam(1e-3))
    with pytest.raises(
        ValueError, match=r"estimate_memory: strategy='zero3' is unknown; use one of replicated"
    ):
        estimate_memory(task, mesh=mesh_2x4, strategy="zero3")
    with pytest.raises(ValueError, match=r"num_shards=4 but the mesh has 8 devices"):
        estimate_memory(task, mesh=mesh_2x4, num_shards=4, strategy="fsdp")
    with pytest.raises(TypeError, match=r"estimate_memory: mesh must be a jax.sharding.Mesh"):
        estimate_memory(task, mesh="data=2,fsdp=4", strategy="fsdp")
    from shardcheck.mesh import make_mesh

    with pytest.raises(ValueError, match=r"leaf 'e' is annotated .* but the mesh has no axis 'data'"):
        estimate_memory(task, mesh=make_mesh({"fsdp": 4}), strategy="fsdp")


# ------------------------------------------------------------------------ the annotated user transformer


@pytest.fixture(scope="module")
def gspmd_measured(annotated_lm, mesh_2x4):
    return measure_memory(annotated_lm.task, strategy="gspmd", mesh=mesh_2x4)


@pytest.fixture(scope="module")
def user_step_measured(annotated_lm, mesh_2x4):
    return measure_memory(annotated_lm.step, annotated_lm.task, mesh_2x4)


@require_devices(8)
def test_annotated_lm_persistent_estimate_equals_live_bytes(
    annotated_lm, mesh_2x4, gspmd_measured, user_step_measured
):
    """examples/annotated_lm.py (clip + AdamW on a schedule) on data=2 x fsdp=4: the registry's GSPMD step and
    the user's own jitted step hold exactly the estimated bytes on every device."""
    est = estimate_memory(annotated_lm.task, mesh=mesh_2x4, strategy="gspmd")
    # num_shards=4 is the one-axis mesh fsdp=4, placed by the same rule: the annotations (the biases and LayerNorm
    # scales the user annotated replicated stay whole), so each device holds what it holds on data=2 x fsdp=4.
    rule = estimate_memory(annotated_lm.task, num_shards=4, strategy="fsdp")
    assert rule.persistent_bytes == est.persistent_bytes
    assert [(leaf.path, leaf.shard_shape) for leaf in rule.leaves] == [
        (leaf.path, leaf.shard_shape) for leaf in est.leaves
    ]
    for m in (gspmd_measured, user_step_measured):
        assert m.state_bytes_per_device == (est.persistent_bytes,) * 8
        assert m.estimated_persistent_bytes == est.persistent_bytes and m.accuracy_ratio == 1.0
        # The batch: tokens, targets (int32) and mask (float32) of (16, 16), an eighth per device.
        assert m.data_argument_bytes == 3 * 16 * 16 * 4 // 8
    assert gspmd_measured.state_argument_bytes == est.persistent_bytes
    assert gspmd_measured.strategy == "gspmd"


@require_devices(8)
def test_a_user_step_that_places_otherwise_than_annotated_is_said_so(
    annotated_lm, mesh_2x4, user_step_measured
):
    """Trial 27: a step that replicated every leaf beside annotations that split them read as an estimate 26%
    off (accuracy_ratio 0.74); the measurement now names each parameter whose placement holds other bytes than
    the estimate's layout."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert user_step_measured.placement_differs == ()

    def replicating(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        return annotated_lm._train_step(model, optimizer, batch)

    m = measure_memory(replicating, annotated_lm.task, mesh_2x4)
    est = estimate_memory(annotated_lm.task, mesh=mesh_2x4, strategy="gspmd")
    split = [leaf for leaf in est.leaves if leaf.category == "params" and leaf.sharded]
    params = [
        d for d in m.placement_differs if not d.startswith(("optimizer state ", "model state ", "step "))
    ]
    assert split and len(params) == len(split) and m.accuracy_ratio < 1
    first = split[0]
    assert m.placement_differs[0] == (
        f"{first.path}: P() holds {first.global_bytes} B a device (the estimate's {first.spec}: "
        f"{first.per_device_bytes} B)"
    )
    # the optimizer state replicated too is named after the parameters, and every named leaf adds up to the gap
    moved = [leaf for leaf in est.leaves if leaf.sharded and leaf.category in ("params", "optimizer")]
    assert len(m.placement_differs) == len(moved) > len(split)
    assert m.placement_bytes == sum(leaf.global_bytes - leaf.per_device_bytes for leaf in moved)
    assert m.placement_bytes == m.state_bytes - m.estimated_persistent_bytes


def mesh_setting_step(annotated_lm, mesh, idiom: str):
    """examples/annotated_lm.py's user step written with the mesh set by the step itself: ``with
    jax.set_mesh(mesh):`` as the Flax NNX sharding guide writes it (the batch placed by a bare PartitionSpec,
    which only the mesh set makes whole), or the older ``with mesh:``."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def step(model, optimizer, batch):
        with jax.set_mesh(mesh) if idiom == "set_mesh" else mesh:
            state = nnx.state((model, optimizer))
            nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
            spec = P(tuple(mesh.axis_names))
            batch = jax.device_put(batch, spec if idiom == "set_mesh" else NamedSharding(mesh, spec))
            return annotated_lm._train_step(model, optimizer, batch)

    return step


@require_devices(8)
@pytest.mark.filterwarnings("ignore:.with mesh.. context manager has been deprecated:DeprecationWarning")
@pytest.mark.parametrize("idiom", ["set_mesh", "with mesh"])
def test_a_step_that_sets_its_mesh_is_measured(annotated_lm, mesh_2x4, user_step_measured, idiom):
    """measure_step traces the whole step under one jax.jit; jax.set_mesh raises inside a trace, so a step that
    sets its own mesh once raised "set_mesh can only be used outside of jax.jit" (issue #34). Measured now: the
    live bytes equal the estimate's persistent bytes on every device, and XLA's figures are those of the same
    step placing its state without setting the mesh."""
    est = estimate_memory(annotated_lm.task, mesh=mesh_2x4, strategy="gspmd")
    m = measure_memory(mesh_setting_step(annotated_lm, mesh_2x4, idiom), annotated_lm.task, mesh_2x4)
    assert m.state_bytes_per_device == (est.persistent_bytes,) * 8
    assert m.estimated_persistent_bytes == est.persistent_bytes and m.accuracy_ratio == 1.0
    assert m.data_argument_bytes == 3 * 16 * 16 * 4 // 8
    for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        assert getattr(m, field) == getattr(user_step_measured, field), field
    with jax.set_mesh(
        mesh_2x4
    ):  # JAX's own rule holds again after the measurement: set_mesh refused in a trace
        with pytest.raises(ValueError, match="set_mesh"):
            jax.jit(lambda x: jax.set_mesh(mesh_2x4) and x)(1.0)


@require_devices(8)
def test_a_step_that_sets_another_mesh_is_refused_naming_both():
    from shardcheck.mesh import make_mesh

    task, given, other = linear_task(), make_mesh({"fsdp": 8}), make_mesh({"data": 8})

    def step(model, optimizer, batch):
        with jax.set_mesh(other):
            loss, grads = nnx.value_and_grad(lambda m: task.loss_fn(m, batch))(model)
            optimizer.update(model, grads)
            return loss

    with pytest.raises(
        ValueError,
        match=r"measure_memory: the step sets the mesh .*'data'.* with jax.set_mesh, but "
        r"mesh=.*'fsdp'.*; pass measure_memory the mesh the step runs on",  # the function called (trial 38)
    ):
        measure_memory(step, task, given)


@require_devices(8)
def test_ahead_of_time_equals_the_real_array_compile(annotated_lm, mesh_2x4, gspmd_measured):
    live_before = {id(a) for a in jax.live_arrays()}
    aot = ahead_of_time.compile_ahead_of_time(annotated_lm.task, mesh_2x4, strategy="gspmd")
    assert not {id(a) for a in jax.live_arrays()} - live_before  # abstract state and batch: nothing allocated
    for field in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        assert getattr(aot, field) == getattr(gspmd_measured, field), field
    assert aot.data_argument_bytes == gspmd_measured.data_argument_bytes
    assert aot.state_argument_bytes == aot.persistent_bytes == gspmd_measured.state_bytes
    assert sum(aot.breakdown().values()) == aot.peak_bytes and aot.breakdown()["other_state"] == 0
    assert aot.batch_size == 16 and aot.backend.startswith("cpu") and "XLA:CPU" in aot.backend_note
    with pytest.raises(ValueError, match=r"batch_size=12 does not split into the mesh's 8 batch shards"):
        ahead_of_time.compile_ahead_of_time(annotated_lm.task, mesh_2x4, batch_size=12)


def linear_task():
    return Task(
        model=lambda: nnx.Linear(16, 4, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(1e-3),
        loss_fn=lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2),
        batches=[{"x": np.ones((8, 16), np.float32), "y": np.zeros((8, 4), np.float32)}],
    )


@require_devices(4)
def test_largest_batch_that_fits_by_compiling():
    from shardcheck.mesh import make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 2})
    task = linear_task()
    small = ahead_of_time.compile_ahead_of_time(task, mesh, batch_size=4)
    big = ahead_of_time.compile_ahead_of_time(task, mesh, batch_size=64)
    assert big.data_argument_bytes == 64 * (16 + 4) * 4 // 4 and big.peak_bytes > small.peak_bytes
    budget = (small.peak_bytes + big.peak_bytes) // 2
    largest, peaks = ahead_of_time.largest_batch_that_fits(task, mesh, budget, max_compiles=12)
    assert largest % 4 == 0 and 4 <= largest < 64
    assert peaks[largest] <= budget and peaks[largest + 4] > budget  # the next multiple of 4 was compiled
    assert all((p <= budget) == (b <= largest) for b, p in peaks.items())
    verdict = device_memory.fit_verdict(big, budget, "half")
    assert not verdict.fits and verdict.headroom_bytes == budget - big.peak_bytes
    assert verdict.largest[0] == max(big.breakdown().items(), key=lambda kv: kv[1])
    assert ahead_of_time.largest_batch_that_fits(task, mesh, 16)[0] == 0  # not even the state fits in 16 B


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("16e9", 16 * 10**9),
        ("1.5 gib", 3 * 2**29),
        ("512B", 512),
        ("1048576", 2**20),
        ("h100", 81_559 * 2**20),  # nvidia-smi memory.total, MiB (trial 49: not 80 GiB)
        ("H200", 143_771 * 2**20),
        ("a100-40gb", 40 * 2**30),
        ("tpu-v5e", 16 * 2**30),
    ],
)
def test_device_memory_sizes_and_kinds(text, expected):
    assert device_memory.parse_device_memory(text)[0] == expected


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "80XB",
            r"--device-memory '80XB' is neither a size nor a known device kind; use a size such as 80GiB",
        ),
        ("a100", r"did you mean a100-40gb or a100-80gb\?"),
        ("h900", r"device kind: h100, h200, a100-40gb"),
        ("0.1", r"less than one byte"),
        # trial 49: a bare 80 meant 80 GB, read as 80 B; refused with the unit to add
        (
            "80",
            r"'80' is a bare number, read as 80 bytes: .*give its unit: --device-memory 80GiB or 80GB \(or 80B",
        ),
        ("1048575", r"read as 1,048,575 bytes"),
        ("", r"is neither a size nor a known device kind"),
        # trial 54: 1e400 (infinite as a float) raised OverflowError; 1e30 was taken; -5GB read as no size
        (
            "1e400",
            r"'1e400' is more than any device holds \(the most accepted is 1 PiB, 1,125,899,906,842,624 B\)",
        ),
        ("1e30", r"'1e30' is more than any device holds"),
        ("2PiB", r"neither a size"),  # no PiB unit: said as before
        ("-5GB", r"'-5GB' is negative: a device's memory is a positive size; use a size such as 80GiB"),
    ],
)
def test_device_memory_refused_with_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        device_memory.parse_device_memory(text)


def test_named_sizes_of_tiny_lm():
    from shardcheck.tasks import sizes

    config = sizes.size_config("1b")
    assert (config.num_layers, config.d_model, config.num_heads, config.mlp_dim) == (16, 2048, 32, 8192)
    assert (config.vocab_size, config.seq_len) == (32_000, 2048)
    assert sizes.param_count(config) == 941_034_752
    assert (
        sizes.param_count(sizes.size_config("tiny")) == 31_501
    )  # the default TinyLMConfig, by hand in test_memory
    task = sizes.size_task("1b")
    est = estimate_memory(task, num_shards=64, strategy="fsdp")  # nnx.eval_shape: nothing allocated
    assert est.param_count == 941_034_752 and est.params_bytes == 941_034_752 * 4 // 64
    with pytest.raises(ValueError, match=r"--size '2b' is not a tiny-lm size; use one of tiny, small, 125m"):
        sizes.size_config("2b")


@require_devices(8)
def test_a_tensor_parallel_batch_is_split_over_the_data_axes_only():
    """On data=2 x model=4 the batch is split over 'data' and replicated over 'model': each device's data
    argument is B/2 rows, the compiled state equals the estimate, and the batch size must split into 2."""
    import importlib.util

    from shardcheck.mesh import make_mesh

    spec = importlib.util.spec_from_file_location("megatron_mlp", ROOT / "examples" / "megatron_mlp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mesh = make_mesh({"data": 2, "model": 4})
    aot = ahead_of_time.compile_ahead_of_time(example.task, mesh, strategy="fsdp")
    batch = example.task.batches[0]
    row_bytes = sum(a[0].size * a.dtype.itemsize for a in batch.values())
    assert aot.data_argument_bytes == 16 // 2 * row_bytes
    assert aot.state_argument_bytes == aot.persistent_bytes
    assert (
        ahead_of_time.compile_ahead_of_time(example.task, mesh, strategy="fsdp", batch_size=6).batch_size == 6
    )
    with pytest.raises(ValueError, match=r"batch_size=5 does not split into the mesh's 2 batch shards"):
        ahead_of_time.compile_ahead_of_time(example.task, mesh, strategy="fsdp", batch_size=5)


def _replay(monkeypatch, peak_of, rounds=None) -> list[int]:
    """Replace the compiles with recorded peaks, ``peak_of(batch_size)``; returns the sizes compiled, in order
    (and appends each round's sizes to ``rounds``)."""
    calls = []

    def fake_compile_batch_sizes(task, mesh, sizes, *, strategy):
        sizes = list(dict.fromkeys(sizes))
        calls.extend(sizes)
        if rounds is not None:
            rounds.append(list(sizes))
        return {b: type("Compiled", (), {"peak_bytes": peak_of(b)})() for b in sizes}

    monkeypatch.setattr(ahead_of_time, "compile_batch_sizes", fake_compile_batch_sizes)
    return calls


@pytest.mark.parametrize(
    "state, per_row, memory, largest, compiled",
    [
        # the line through the 1b step's peaks for an H100 at one and two rows (33,676,253,908 B, 55,672,464,340 B)
        (11_679_843_476, 21_996_210_432, 80 * 2**30, 3, [1, 2, 3, 4]),
        (1_000, 10, 1_000 + 10 * 37, 37, [1, 2, 37, 38]),  # exactly on the line: 1_370 fits at 37 rows
        (1_000, 10, 999, 0, [1, 2]),  # the state alone does not fit (2 rows compiled beside 1, at once)
    ],
)
def test_largest_batch_search_follows_the_line_through_two_peaks(
    monkeypatch, state, per_row, memory, largest, compiled
):
    """A peak linear in the batch: two compiles for the line, two for its crossing and the size above it."""
    calls = _replay(monkeypatch, lambda b: state + per_row * b)
    found, peaks = ahead_of_time.largest_batch_that_fits(None, None, memory, strategy="replicated")
    assert found == largest and sorted(calls) == compiled and set(peaks) <= set(calls)
    assert all((p <= memory) == (b <= largest) for b, p in peaks.items())


def test_largest_batch_search_on_the_1b_steps_peaks_for_an_h100(monkeypatch):
    """The peaks XLA:GPU gave for the 1b step (tiny-lm, Adam, one device) compiled for an H100 without one
    (jax 0.10.2, shardcheck's h100 target): it rematerializes as the step nears 80 GiB, so the peaks flatten
    (3 rows: 63.0 GB, 4: 64.3 GB) before 6 rows exceed it. The search, given the report's compile at 1 row,
    compiles 2, then 3 and 4, then 5 and 6: 5 rows fit."""
    peaks_1b = {1: 33_676_253_908, 2: 55_672_464_340, 3: 63_032_404_940, 4: 64_346_264_524}
    peaks_1b.update({5: 71_712_857_804, 6: 91_129_112_268})
    calls = _replay(monkeypatch, peaks_1b.__getitem__)
    found, peaks = ahead_of_time.largest_batch_that_fits(
        None, None, 80 * 2**30, strategy="replicated", known={1: peaks_1b[1]}
    )
    assert found == 5 and calls == [2, 3, 4, 5, 6] and peaks == peaks_1b


@require_devices(4)
def test_compile_batch_sizes_traces_the_state_once_with_the_same_figures(monkeypatch):
    """Every size of one call shares one abstract state and estimate; each size's figures equal its own compile."""
    from shardcheck.mesh import make_mesh

    mesh, task = make_mesh({"data": 2, "fsdp": 2}), linear_task()
    alone = {b: ahead_of_time.compile_ahead_of_time(task, mesh, batch_size=b) for b in (4, 8, 12)}
    prepared = []
    real_prepare = ahead_of_time._prepare
    monkeypatch.setattr(ahead_of_time, "_prepare", lambda *a: prepared.append(a[-1]) or real_prepare(*a))
    together = ahead_of_time.compile_batch_sizes(task, mesh, [4, 8, 4, 12])
    assert prepared == ["fsdp"] and list(together) == [4, 8, 12]
    assert together == alone  # every field, peak bytes included
    assert ahead_of_time.first_probe_sizes(mesh) == [4, 8]
    assert ahead_of_time.first_probe_sizes(mesh, "replicated") == [1, 2]


# XLA:GPU's peaks of the 1b step (tiny-lm, Adam) with fsdp=8, compiled for an H100 without one (jax 0.10.2,
# shardcheck's h100 target): remat holds 24-40 rows near its 60.87 GiB limit, 48 rows fit at 77.2 GB, 56 don't.
PEAKS_1B_FSDP8_H100 = {
    8: 28_086_999_516,
    16: 52_362_871_516,
    24: 64_931_637_980,
    32: 65_215_820_508,
    40: 65_854_200_540,
    48: 77_205_103_580,
    56: 93_730_204_636,
    64: 116_546_655_196,
}


def test_largest_batch_for_the_1b_fsdp8_step_on_an_h100_from_its_replayed_peaks(monkeypatch):
    """The CLI's rounds: the report's 8 rows with the first probes 8 and 16 (one compile pair), then the search's
    two pairs and 56 alone (64 would only confirm 56's failure); 48 rows is exact: every size compiled up to it fits and 56 was compiled and does not."""
    rounds = []
    _replay(monkeypatch, PEAKS_1B_FSDP8_H100.__getitem__, rounds)
    monkeypatch.setattr(ahead_of_time, "data_shards", lambda mesh: 8)  # the fsdp=8 mesh's batch shards
    memory = 80 * 2**30
    first = ahead_of_time.compile_batch_sizes(
        None, None, [8, *ahead_of_time.first_probe_sizes(None)], strategy="fsdp"
    )
    found, peaks = ahead_of_time.largest_batch_that_fits(
        None, None, memory, strategy="fsdp", known={b: m.peak_bytes for b, m in first.items()}
    )
    assert rounds == [[8, 16], [24, 32], [40, 48], [56]]  # 40 -> 48 rose 1.42 GB a row: 56 would not fit
    assert found == 48 and peaks == {b: p for b, p in PEAKS_1B_FSDP8_H100.items() if b <= 56}
    assert all(p <= memory for b, p in peaks.items() if b <= found) and peaks[found + 8] > memory
