"""One placement rule: ``num_shards=S`` is the mesh ``{"fsdp": S}``, estimated and measured alike.

Hand counts (float32 = 4 B; Adam: an int32 count and two moments; the NNX step counter: a uint32, 4 B), S = 4:

Annotated (a model written as the Flax NNX sharding guide writes one): ``up`` = Linear(8, 16) with its kernel
annotated ``(None, "fsdp")`` and its bias ``(None,)``; ``down`` = Linear(16, 4), unannotated.

======================  =======  ==========================  =========  ===================================
leaf                    shape    placement                   whole      per device
======================  =======  ==========================  =========  ===================================
up.kernel               (8, 16)  annotated: dim 1 over fsdp  512 B      (8, 4) = 128 B (the shape rule: (2, 16))
up.bias                 (16,)    annotated replicated        64 B       64 B (the shape rule split it: 16 B)
down.kernel             (16, 4)  FSDP rule: dim 0            256 B      (4, 4) = 64 B
down.bias               (4,)     FSDP rule: dim 0            16 B       (1,) = 4 B
======================  =======  ==========================  =========  ===================================

Parameters 848 B whole, 260 B on each device under fsdp. Persistent (params + Adam + step): fsdp
260 + (4 + 2 * 260) + 4 = 788 B; gspmd places the annotations alone (trial 43: ``down`` is not annotated, so it
stays whole, 272 B): params 128 + 64 + 272 = 464 B, 464 + (4 + 2 * 464) + 4 = 1400 B; zero1 / zero2 848 + 524 + 4 = 1376 B; replicated / dp 848 + (4 + 2 * 848) + 4
= 2552 B.

Plain: Linear(8, 6), unannotated: kernel (8, 6) -> (2, 6) = 48 B, bias (6,) 24 B whole (6 does not divide by 4).
Persistent: fsdp 72 + 148 + 4 = 224 B; zero1 / zero2 216 + 148 + 4 = 368 B; replicated / dp 216 + 436 + 4 = 656 B.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, estimate_memory, measure_memory
from shardcheck.cli import main
from shardcheck.memory import measure_task_strategies
from shardcheck.mesh import make_mesh
from shardcheck.placement import placement_report
from shardcheck.steps.sharded import mesh_step

MEASURED = ("replicated", "dp", "zero1", "zero2", "fsdp", "gspmd")
ANNOTATED_PERSISTENT = {
    "replicated": 2552,
    "dp": 2552,
    "zero1": 1376,
    "zero2": 1376,
    "fsdp": 788,
    "gspmd": 1400,
}
PLAIN_PERSISTENT = {"replicated": 656, "dp": 656, "zero1": 368, "zero2": 368, "fsdp": 224, "gspmd": 224}


class Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.up = nnx.Linear(
            8,
            16,
            kernel_init=nnx.with_partitioning(init, (None, "fsdp")),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )
        self.down = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_task(annotated: bool) -> Task:
    rng = np.random.default_rng(0)
    k = 4 if annotated else 6
    batch = {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, k)).astype(np.float32)}
    model = (lambda: Annotated(nnx.Rngs(0))) if annotated else (lambda: nnx.Linear(8, 6, rngs=nnx.Rngs(0)))
    return Task(model=model, optimizer=optax.adam(1e-2), loss_fn=mse, batches=[batch], name="t")


TASKS = {"annotated": (True, ANNOTATED_PERSISTENT), "plain": (False, PLAIN_PERSISTENT)}


@pytest.mark.parametrize("kind", TASKS)
@pytest.mark.parametrize("strategy", MEASURED)
def test_num_shards_is_the_fsdp_mesh_leaf_by_leaf(kind, strategy):
    annotated, persistent = TASKS[kind]
    task = make_task(annotated)
    by_shards = estimate_memory(task, num_shards=4, strategy=strategy)
    assert by_shards == estimate_memory(task, mesh={"fsdp": 4}, strategy=strategy)  # every field, every leaf
    assert by_shards.persistent_bytes == persistent[strategy] and by_shards.mesh_shape == (("fsdp", 4),)


def test_annotations_are_honoured_by_the_num_shards_form():
    est = estimate_memory(make_task(True), num_shards=4, strategy="fsdp")
    leaves = {leaf.path: leaf for leaf in est.leaves if leaf.category == "params"}
    assert leaves["up.kernel"].shard_shape == (8, 4) and leaves["up.kernel"].split_axes == ("fsdp",)
    assert leaves["up.kernel"].spec == repr(jax.sharding.PartitionSpec(None, "fsdp"))
    assert not leaves["up.bias"].sharded and leaves["up.bias"].per_device_bytes == 64
    assert leaves["up.bias"].replicated_reason == "annotated (None,): replicated"
    assert leaves["down.kernel"].shard_shape == (4, 4) and leaves["down.bias"].shard_shape == (1,)
    assert (est.params_bytes, est.grads_bytes, est.optimizer_bytes, est.step_bytes) == (260, 260, 524, 4)
    opt = {leaf.path: leaf for leaf in est.leaves if leaf.category == "optimizer"}
    assert opt["0.mu.up.kernel"].shard_shape == (8, 4) and not opt["0.nu.up.bias"].sharded  # inherited


def test_an_abstract_mesh_needs_no_devices():
    """S = 16 on 8 (fake) devices: the annotated kernel's 16 columns split one a device; the rest stays whole."""
    est = estimate_memory(make_task(True), num_shards=16, strategy="fsdp")
    leaves = {leaf.path: leaf for leaf in est.leaves if leaf.category == "params"}
    assert leaves["up.kernel"].shard_shape == (8, 1) and leaves["down.kernel"].shard_shape == (1, 4)
    assert not leaves["down.bias"].sharded and leaves["down.bias"].replicated_reason == (
        "no dimension of (4,) divides by S=16"
    )
    assert est.params_bytes == 32 + 64 + 16 + 16 and est.num_devices == 16


@require_devices(8)
def test_a_mesh_given_as_axis_sizes_equals_the_device_mesh():
    task = make_task(True)
    for strategy in ("zero2", "fsdp"):
        abstract = estimate_memory(task, mesh={"data": 2, "fsdp": 4}, strategy=strategy)
        assert abstract == estimate_memory(task, mesh=make_mesh({"data": 2, "fsdp": 4}), strategy=strategy)
        assert abstract.mesh_shape == (("data", 2), ("fsdp", 4)) and abstract.num_devices == 8
    # The shards of data=2 x fsdp=4 are those of fsdp=4 (replicated over data): the same bytes per device.
    assert abstract.persistent_bytes == ANNOTATED_PERSISTENT["fsdp"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(mesh="fsdp"),
            TypeError,
            r"estimate_memory: mesh must be a jax.sharding.Mesh, a jax.sharding.Abs",
        ),
        (
            dict(mesh={"fsdp": 0}),
            ValueError,
            r"estimate_memory: the size of axis 'fsdp' must be a positive int",
        ),
        (dict(mesh={"fsdp": 2}, num_shards=4), ValueError, r"num_shards=4 but the mesh has 2 devices"),
        (dict(mesh={"data": 4}), ValueError, r"leaf 'up.kernel' is annotated .* the mesh has no axis 'fsdp'"),
        (
            dict(),
            TypeError,
            r"estimate_memory: pass mesh= .* or num_shards=S \(one axis 'fsdp' of S devices\)",
        ),
    ],
)
def test_mesh_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        estimate_memory(make_task(True), strategy="fsdp", **kwargs)


@require_devices(4)
@pytest.mark.parametrize("kind", TASKS)
def test_estimate_equals_the_live_bytes_measured(kind):
    annotated, persistent = TASKS[kind]
    task = make_task(annotated)
    measured = measure_task_strategies(task, num_shards=4, strategies=MEASURED)
    for strategy, m in measured.items():
        n = 1 if strategy == "replicated" else 4
        est = estimate_memory(task, num_shards=4, strategy=strategy)
        assert m.state_bytes_per_device == (est.persistent_bytes,) * n == (persistent[strategy],) * n, (
            strategy
        )
        assert m.estimated_persistent_bytes == est.persistent_bytes and m.accuracy_ratio == 1.0
        assert m.state_argument_bytes == est.persistent_bytes  # the compiled step's state arguments too
        assert m.data_argument_bytes == 8 * (8 + (4 if annotated else 6)) * 4 // n
    # measure_memory's task form defaults to every device on one axis "fsdp" (the annotations name it).
    default = measure_memory(task, strategy="fsdp")
    every = estimate_memory(task, num_shards=len(jax.devices()), strategy="fsdp")
    assert default.state_bytes == default.estimated_persistent_bytes == every.persistent_bytes


@require_devices(4)
@pytest.mark.parametrize("kind", TASKS)
def test_each_leaf_lives_where_the_estimate_places_it(kind):
    """The registry's fsdp step on fsdp=4, then every live array's shard shape and bytes: the estimate's."""
    task = make_task(TASKS[kind][0])
    model = task.new_model()
    optimizer = task.new_optimizer(model)
    mesh_step("fsdp", task.loss_fn, model, optimizer, task.batches[0], make_mesh(4, "fsdp"))
    live = {r.path: (r.shard_shape, r.shard_bytes) for r in placement_report(model, optimizer)}
    names = {"params": "{}", "optimizer": "opt_state.{}", "step": "{}"}
    est = estimate_memory(task, num_shards=4, strategy="fsdp")
    estimated = {
        names[leaf.category].format(leaf.path): (leaf.shard_shape, leaf.per_device_bytes)
        for leaf in est.leaves
        if leaf.category in names
    }
    assert live == estimated


@require_devices(4)
def test_cli_task_file_measures_without_mesh_as_annotated(annotated_lm, capsys):
    """``shardcheck memory --task FILE --measure`` (no --mesh): on fsdp=4, as ``estimate_memory(task, mesh=
    {"fsdp": 4})`` places it: the example's annotations name the axis "fsdp", which that mesh has."""
    spec = f"{Path(__file__).parents[1] / 'examples' / 'annotated_lm.py'}:task"
    args = ["memory", "--task", spec, "--shards", "4", "--devices", "4", "--measure", "--json", "-"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["strategies"]) == ["replicated", "dp", "zero1", "zero2", "fsdp"]
    for name, s in report["strategies"].items():
        est = estimate_memory(annotated_lm.task, mesh={"fsdp": 4}, strategy=name)
        leaves = json.loads(json.dumps([dataclasses.asdict(leaf) for leaf in est.leaves]))
        assert s["leaves"] == leaves and s["persistent_bytes"] == est.persistent_bytes, name
        n = 1 if name == "replicated" else 4
        assert s["measured"]["state_bytes_per_device"] == [est.persistent_bytes] * n, name
        assert s["measured"]["accuracy_ratio"] == 1.0


def test_param_dtype_casts_a_task_and_its_optimizer_state():
    """Linear(8, 6) in bfloat16 on fsdp=4: kernel (2, 6) = 24 B + bias (6,) 12 B; Adam 4 + 2 * 36 B (as in
    tests/test_memory.py), the annotated task's kernels keep their annotated split."""
    plain = estimate_memory(make_task(False), num_shards=4, strategy="fsdp", param_dtype="bfloat16")
    assert (plain.params_bytes, plain.optimizer_bytes, plain.step_bytes) == (36, 76, 4)
    assert {leaf.dtype for leaf in plain.leaves if leaf.category != "step"} == {"bfloat16", "int32"}
    annotated = estimate_memory(make_task(True), mesh={"fsdp": 4}, strategy="fsdp", param_dtype="bfloat16")
    leaves = {leaf.path: leaf for leaf in annotated.leaves if leaf.category == "params"}
    assert leaves["up.kernel"].shard_shape == (8, 4) and annotated.params_bytes == 260 // 2
