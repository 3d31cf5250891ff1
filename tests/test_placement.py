"""Placement of parameters and optimizer state after the mesh steps, read from the arrays' shards."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import shardcheck
from shardcheck import data_parallel_sgd_step, make_mesh, make_model, placement, sgd_step
from shardcheck.partitioning import fsdp_partition_spec
from shardcheck.placement import LeafPlacement, placement_report, placement_summary
from shardcheck.seeds import fsdp_sgd_step

P = PartitionSpec
SPLIT = ("kernel", "opt_state.0.mu.kernel", "opt_state.0.nu.kernel")
WHOLE = ("bias", "opt_state.0.mu.bias", "opt_state.0.nu.bias", "opt_state.0.count", "step")


def linear_adam(d=8, k=3):
    model = make_model("linear", d, k, seed=0)
    return model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)


def batch(b=8, d=8, k=3):
    rng = np.random.default_rng(0)
    return rng.normal(size=(b, d)).astype(np.float32), rng.normal(size=(b, k)).astype(np.float32)


def arrays(model, optimizer):
    out = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out.update({".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(optimizer))})
    return out


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (2, 4, 8)]
)
def test_fsdp_each_device_holds_one_sth_and_bias_3_is_replicated(num_shards):
    """Linear(8, 3) + Adam: kernel (8, 3) and its moments split 8/S rows a device; bias (3,) stays whole."""
    model, optimizer = linear_adam()
    mesh = make_mesh(num_shards)
    fsdp_sgd_step(model, optimizer, *batch(), mesh)
    leaves = arrays(model, optimizer)
    for path in SPLIT:
        a = leaves[path]
        assert a.sharding.is_equivalent_to(
            NamedSharding(mesh, fsdp_partition_spec(a.shape, num_shards)), a.ndim
        )
        shards = a.addressable_shards
        assert len(shards) == num_shards
        assert len({s.device for s in shards}) == num_shards
        for s in shards:
            assert s.data.shape == (8 // num_shards, 3)
            assert s.data.size * num_shards == a.size
        # the shards tile the array: row blocks 0..S-1, each exactly once
        assert sorted(s.index[0].start for s in shards) == list(range(0, 8, 8 // num_shards))
    for path in WHOLE:
        a = leaves[path]
        assert a.sharding.is_fully_replicated, path
        assert all(s.data.shape == a.shape for s in a.addressable_shards), path

    report = {r.path: r for r in placement_report(model, optimizer)}
    assert list(report) == ["bias", "kernel", *sorted(p for p in report if p.startswith("opt_state")), "step"]
    assert {r.kind for p, r in report.items() if p in ("bias", "kernel")} == {"param"}
    assert {r.kind for p, r in report.items() if p not in ("bias", "kernel")} == {"opt_state"}
    for path in SPLIT:
        r = report[path]
        assert r.partition_spec == P("data") and r.global_shape == (8, 3)
        assert r.shard_shape == (8 // num_shards, 3) and r.shard_bytes == 96 // num_shards
        assert not r.replicated
        assert r.reason == f"split along dimension 0 over mesh axis 'data' ({num_shards} devices)"
    for path in ("bias", "opt_state.0.mu.bias", "opt_state.0.nu.bias"):
        r = report[path]
        assert r.replicated and r.partition_spec == P() and r.shard_shape == (3,) and r.shard_bytes == 12
        assert r.reason == (
            f"replicated on all {num_shards} devices: no dimension of shape (3,) is divisible by {num_shards}"
        )
    assert report["step"].replicated and report["step"].shard_bytes == 4
    assert "scalar" in report["step"].reason

    assert placement_summary(model, optimizer) == {
        "params_bytes": 96 // num_shards + 12,
        "optimizer_bytes": 2 * (96 // num_shards) + 2 * 12 + 4 + 4,  # mu, nu; count int32; step uint32
        "params_total_bytes": 96 + 12,
        "optimizer_total_bytes": 2 * 96 + 2 * 12 + 4 + 4,
        "num_devices": num_shards,
    }


@require_devices(4)
def test_dp_placement_is_replicated_everywhere():
    model, optimizer = linear_adam(8, 4)
    data_parallel_sgd_step(model, optimizer, *batch(k=4), make_mesh(4))
    report = placement_report(model, optimizer)
    assert all(r.replicated and r.partition_spec == P() for r in report)
    assert all(r.shard_shape == r.global_shape for r in report)
    kernel = next(r for r in report if r.path == "kernel")
    assert kernel.reason.startswith(
        "replicated on all 4 devices although a dimension of (8, 4) splits 4 ways"
    )
    summary = placement_summary(model, optimizer)
    assert summary["params_bytes"] == summary["params_total_bytes"] == (8 * 4 + 4) * 4
    assert summary["optimizer_bytes"] == summary["optimizer_total_bytes"] == 2 * (8 * 4 + 4) * 4 + 8
    assert summary["num_devices"] == 4


@require_devices(4)
@pytest.mark.parametrize("min_size,kernel_split", [(24, True), (25, False)])
def test_min_size_keeps_small_leaves_replicated_and_equal_to_baseline(min_size, kernel_split):
    x, y = batch()
    base_model, base_opt = linear_adam()
    sgd_step(base_model, base_opt, x, y)
    model, optimizer = linear_adam()
    fsdp_sgd_step(model, optimizer, x, y, make_mesh(4), min_size=min_size)
    report = {r.path: r for r in placement_report(model, optimizer)}
    assert report["kernel"].replicated is not kernel_split
    assert report["opt_state.0.mu.kernel"].replicated is not kernel_split
    if not kernel_split:
        assert "size threshold" in report["kernel"].reason
    np.testing.assert_allclose(model.kernel[...], base_model.kernel[...], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        optimizer.opt_state[0].nu["kernel"][...], base_opt.opt_state[0].nu["kernel"][...], rtol=1e-5
    )


def test_report_before_any_step_is_single_device():
    model, optimizer = linear_adam()
    report = placement_report(model, optimizer)
    assert all(isinstance(r, LeafPlacement) for r in report)
    assert all(r.replicated and r.shard_shape == r.global_shape for r in report)
    assert all(r.reason.startswith("not placed on a mesh: the whole array lives on") for r in report)
    summary = placement_summary(model, optimizer)
    assert summary["params_bytes"] == summary["params_total_bytes"] == 108
    assert summary["num_devices"] == 1


def test_report_single_device_doc_example():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    got = [(p.path, p.shard_shape, p.shard_bytes) for p in placement_report(model, optimizer)]
    assert got == [("bias", (1,), 4), ("kernel", (2, 1), 8), ("step", (), 4)]


@require_devices(2)
def test_mlp_momentum_paths():
    model = make_model("mlp", 4, 2, hidden=8)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    fsdp_sgd_step(model, optimizer, jnp.ones((4, 4)), jnp.zeros((4, 2)), make_mesh(2))
    report = {r.path: r for r in placement_report(model, optimizer)}
    params = ["hidden.bias", "hidden.kernel", "out.bias", "out.kernel"]
    assert [p for p, r in report.items() if r.kind == "param"] == params
    assert sorted(p for p, r in report.items() if r.kind == "opt_state") == sorted(
        [f"opt_state.0.trace.{p}" for p in params] + ["step"]
    )
    assert not any(report[p].replicated for p in params)  # every dimension here is even
    assert report["out.kernel"].shard_shape == (4, 2)


def test_type_errors_and_reexports():
    model, optimizer = linear_adam()
    with pytest.raises(TypeError, match="placement_report: optimizer must be an nnx.Optimizer"):
        placement_report(model, optax.adam(0.1))
    with pytest.raises(TypeError, match="placement_summary: model must be an nnx.Module, got dict"):
        placement_summary({}, optimizer)
    assert shardcheck.placement_summary is placement.placement_summary
    assert shardcheck.placement_report is placement.placement_report
    assert jax.tree.leaves(nnx.state(model))  # untouched


@require_devices(4)
def test_a_tasks_registered_fsdp_step_leaves_the_estimated_placement():
    """digits (MLP 64 -> 32 -> 10, Adam) after the registry's fsdp step: every leaf split by fsdp_partition_spec,
    out.bias (10,) whole, and the bytes per device those of the shape-only estimate of the task."""
    from shardcheck import estimate_memory
    from shardcheck.steps import STRATEGIES
    from shardcheck.tasks import digits_task

    task = digits_task(steps=1)
    model = task.new_model()
    optimizer = task.new_optimizer(model)
    mesh = make_mesh(4)
    STRATEGIES["fsdp"].build(task.loss_fn, 4, mesh).step(model, optimizer, task.batches[0])
    report = {r.path: r for r in placement_report(model, optimizer)}
    for r in report.values():
        assert r.partition_spec == fsdp_partition_spec(r.global_shape, 4), r.path
    assert report["hidden.kernel"].shard_shape == (16, 32) and report[
        "opt_state.0.nu.out.kernel"
    ].shard_shape == (8, 10)
    assert report["out.bias"].replicated and report["out.bias"].shard_bytes == 40
    est = estimate_memory(task, num_shards=4, strategy="fsdp")
    assert est.params_bytes == 2048 + 32 + 320 + 40
    assert placement_summary(model, optimizer) == {
        "params_bytes": est.params_bytes,
        "optimizer_bytes": est.optimizer_bytes + est.step_bytes,
        "params_total_bytes": 9640,
        "optimizer_total_bytes": 2 * 9640 + 4 + 4,
        "num_devices": 4,
    }
