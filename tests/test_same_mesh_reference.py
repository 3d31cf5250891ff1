"""A candidate checked against a strategy on the same mesh (``reference="gspmd"``), never whole on one device.

The reference is the plain step jitted over the model's annotations: XLA's partitioner keeps the single-device
semantics, so a correct step passes and each planted fault fails with the diagnosis it gets against the
single-device step. The state is created directly sharded (``steps/sharded_init.py``) and stays so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_tensor_parallel import TP_MESH, _megatron_task, megatron_step

from shardcheck import Task, check_parity, make_mesh
from shardcheck.steps.sharded import state_specs
from shardcheck.steps.sharded_init import sharded_training_state

FSDP_MESH = {"fsdp": 8}
D_IN, HIDDEN, D_OUT, ROWS = 16, 64, 8, 64


class FsdpMLP(nnx.Module):
    """Kernels and the hidden bias split over 'fsdp' along their first dimension, the output bias replicated."""

    def __init__(self, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.fc1 = nnx.Linear(
            D_IN,
            HIDDEN,
            kernel_init=nnx.with_partitioning(init, ("fsdp", None)),
            bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("fsdp",)),
            rngs=rngs,
        )
        self.fc2 = nnx.Linear(
            HIDDEN,
            D_OUT,
            kernel_init=nnx.with_partitioning(init, ("fsdp", None)),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))


def masked_loss(model, batch):
    """``(sum of the masked squared errors, the number of unmasked rows)``."""
    err = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])


def _fsdp_task(unequal_masks: bool = False) -> Task:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        mask = np.ones(ROWS, np.float32)
        if unequal_masks:  # the 8 shards hold 8, 7, ..., 1 unmasked rows: per-shard means are not the mean
            mask = np.concatenate([np.arange(8) < 8 - k for k in range(8)]).astype(np.float32)
        x = rng.normal(size=(ROWS, D_IN)).astype(np.float32)
        y = rng.normal(size=(ROWS, D_OUT)).astype(np.float32)
        batches.append({"x": x, "y": y, "mask": mask})
    return Task(
        model=lambda: FsdpMLP(nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=masked_loss,
        batches=batches,
        name="fsdp-mlp",
    )


def user_fsdp_step(fault=None):
    """A user's FSDP step in one ``jax.shard_map``: each device holds its slice of the split leaves and gathers
    them (``all_gather``, tiled; its transpose reduce-scatters the gradients), differentiates its shard's masked
    loss sum and divides by the global count. ``fault``: ``"summed"`` (each shard's mean loss differentiated, the
    shards' gradients summed), ``"normalization"`` (the same, divided by the 8 shards: the mean of per-shard
    means)."""

    def step(model, optimizer, batch, mesh):
        graphdef, params = nnx.split(model, nnx.Param)
        specs = nnx.get_partition_spec(params)
        params = jax.device_put(params, nnx.get_named_sharding(params, mesh))
        spec_of = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))

        def gather(p):
            leaves = [
                jax.lax.all_gather(a, "fsdp", axis=0, tiled=True) if s and s[0] == "fsdp" else a
                for a, s in zip(jax.tree.leaves(p), spec_of, strict=True)
            ]
            return jax.tree.unflatten(jax.tree.structure(p), leaves)

        def body(p, b):
            def local(p):
                total, count = masked_loss(nnx.merge(graphdef, gather(p)), b)
                return (total if fault is None else total / count), (total, count)

            # the gradients come back summed over the shards: all_gather's transpose reduce-scatters them, and
            # check_vma's implicit broadcast of a replicated leaf transposes to a psum
            (_, (total, count)), g = jax.value_and_grad(local, has_aux=True)(p)
            n = jax.lax.psum(count, "fsdp")
            scale = {None: n, "summed": 1.0, "normalization": 8.0}[fault]
            return jax.lax.psum(total, "fsdp") / n, jax.tree.map(lambda a: a / scale, g)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp")), out_specs=(P(), specs))
        loss, grads = jax.jit(mapped)(params, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


def _same_verdict(step, task, mesh_shape):
    mesh = make_mesh(mesh_shape)
    single = check_parity(step, task, mesh=mesh, steps=2)
    same_mesh = check_parity(step, task, mesh=mesh, steps=2, reference="gspmd")
    shape = ",".join(f"{k}={v}" for k, v in mesh_shape.items())
    assert same_mesh.reference == f"gspmd on {shape}" and single.reference == "reference"
    assert same_mesh.verdict == single.verdict, (str(single), str(same_mesh))
    # the finding, and for a failure its whole text (a passing check's caveats, such as a borderline weak_check,
    # read the reference's rounding, which a partitioned step orders differently)
    assert same_mesh.codes[0] == single.codes[0], (str(single), str(same_mesh))
    if not single.ok:
        assert same_mesh.diagnoses[0].message == single.diagnoses[0].message
    return single, same_mesh


@require_devices(8)
@pytest.mark.parametrize(
    "fault,verdict,code",
    [(None, "PASS", "parity"), ("summed", "FAIL", "summed"), ("normalization", "FAIL", "normalization")],
)
def test_a_users_fsdp_step_against_gspmd_on_fsdp8(fault, verdict, code):
    task = _fsdp_task(unequal_masks=fault == "normalization")
    _, same_mesh = _same_verdict(user_fsdp_step(fault), task, FSDP_MESH)
    assert same_mesh.verdict == verdict and same_mesh.codes[0] == code, str(same_mesh)
    assert "against gspmd on fsdp=8" in str(same_mesh)
    if fault == "summed":
        assert "x8" in same_mesh.diagnoses[0].message


@require_devices(8)
def test_a_megatron_step_against_gspmd_on_data2_model4():
    """The tensor-parallel step of tests/test_tensor_parallel.py without its psum over 'model' gets the diagnosis
    that file pins against the single-device step, word for word where it names the cause. (The correct Megatron
    step passing against gspmd on data=2,model=4 is the README's example, run by tests/test_docs_examples.py.)"""
    mesh = make_mesh(TP_MESH)
    report = check_parity(megatron_step("no_psum"), _megatron_task(), mesh=mesh, steps=2, reference="gspmd")
    assert report.reference == "gspmd on data=2,model=4", str(report)
    assert report.verdict == "FAIL" and report.codes[0] == "wrong_axis_reduction", str(report)
    message = report.diagnoses[0].message
    assert "differ along mesh axis 'model' and agree along 'data'" in message
    assert "the row-parallel layer's output was not psum-ed over 'model'" in message
    assert "block.down.bias" in message


@require_devices(8)
def test_the_state_is_created_sharded_and_stays_within_its_placement():
    """Every leaf of the initial state lives split as its annotation says: no addressable shard holds more than
    the leaf's bytes over the ways its spec splits it, read from the arrays' ``addressable_shards``."""
    task, mesh = _fsdp_task(), make_mesh(FSDP_MESH)
    model, optimizer = sharded_training_state("test", task, "gspmd", mesh)
    specs, _ = state_specs("gspmd", model, optimizer, mesh)
    leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    split = 0
    for a, spec in zip(leaves, specs, strict=True):
        ways = int(np.prod([mesh.shape[axis] for entry in spec if entry for axis in np.atleast_1d(entry)]))
        assert a.sharding.spec == spec
        assert max(s.data.nbytes for s in a.addressable_shards) == a.nbytes // ways
        split += ways > 1
    assert split == 9  # fc1 kernel and bias, fc2 kernel, and Adam's mu and nu of each
    reference = task.new_model()  # the same values, up to the rounding of a fused initializer
    ours, theirs = nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@require_devices(8)
def test_a_reference_strategy_is_checked_before_any_step():
    task, mesh = _fsdp_task(), make_mesh(FSDP_MESH)
    with pytest.raises(
        ValueError, match=r"check_parity: reference='accumulation' is not a strategy on a mesh"
    ):
        check_parity("dp", task, mesh=mesh, reference="accumulation")
    with pytest.raises(ValueError, match=r"check_parity: reference='tp' is unknown") as info:
        check_parity("dp", task, mesh=mesh, reference="tp")
    # the choices are the references: no candidate-only strategy among them
    assert "simulation" not in str(info.value) and "accumulation" not in str(info.value)
    with pytest.raises(
        ValueError, match=r"check_parity: reference='gspmd' runs on the candidate's mesh; pass mesh="
    ):
        check_parity(lambda m, o, b: None, task, reference="gspmd")


@require_devices(8)
def test_verify_reference_gspmd_on_the_megatron_example(tmp_path, capsys):
    import json
    from pathlib import Path

    from shardcheck.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "megatron_mlp.py"
    out = tmp_path / "verify.json"
    args = ["verify", "--task", f"{example}:task", "--mesh", "data=2,model=4", "--reference", "gspmd"]
    args += ["--strategies", "dp", "--candidate", f"{example}:step", "--steps", "2", "--json", str(out)]
    assert main(args) == 0
    assert "against gspmd on data=2,model=4" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["reference"] == "gspmd on data=2,model=4"
    assert {k: r["verdict"] for k, r in report["strategies"].items()} == {"dp": "PASS", "candidate": "PASS"}
    assert all(r["reference"] == "gspmd on data=2,model=4" for r in report["strategies"].values())


def test_verify_reference_leaves_itself_out_of_the_default_strategies():
    import argparse

    from shardcheck.cli import verify

    parser = argparse.ArgumentParser()
    verify.add_parser(parser.add_subparsers())
    for reference in ("gspmd", "fsdp"):
        args = parser.parse_args(["verify", "--task", "tiny-lm", "--devices", "4", "--reference", reference])
        strategies, _ = verify._check_args(args)
        defaults = verify.DEFAULT_STRATEGIES.split(",")
        assert strategies == [s for s in defaults if s != reference] and len(strategies) == len(defaults) - 1
    args = parser.parse_args(["verify", "--task", "tiny-lm", "--devices", "4", "--reference", "gspmd"])
    args.strategies = "gspmd,dp"  # asked for by name: refused, a step against itself proves nothing
    with pytest.raises(ValueError, match="--strategies gspmd,dp names --reference gspmd itself"):
        verify._check_args(args)


def test_verify_reference_is_checked_before_jax_runs(capsys):
    from shardcheck.cli import main

    assert main(["verify", "--reference", "gspmd", "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert "shardcheck verify: --reference gspmd needs --task" in err
    assert main(["verify", "--task", "tiny-lm", "--reference", "accumulation"]) == 2
    assert (
        "--reference accumulation is not a strategy on a mesh that steps the task's own optimizer (it runs on one "
        "device or wraps the optimizer); check it as a candidate (--strategies accumulation)"
    ) in " ".join(capsys.readouterr().err.split())


def test_size_names_a_tiny_lm_configuration_for_verify_and_record():
    """``--size small`` builds the tiny-lm task at that size (the state a ``--reference gspmd`` check creates
    sharded); another task with ``--size`` is refused."""
    import argparse

    from shardcheck.cli import record, verify
    from shardcheck.cli._task import task_from_args
    from shardcheck.tasks.sizes import size_config

    for module in (verify, record):
        parser = argparse.ArgumentParser()
        module.add_parser(parser.add_subparsers())
        name = module.__name__.rsplit(".", 1)[-1]
        required = ["--out", "run.npz"] if module is record else []
        args = parser.parse_args([name, "--size", "small", "--mesh", "fsdp=4", *required])
        task = task_from_args(args, default_optimizer="sgd", batch_size=None, steps=2)
        assert args.task == "tiny-lm" and len(task.batches) == 2
        model = task.new_model()
        config = size_config("small")
        assert model.blocks[0].fc1.kernel.shape == (config.d_model, config.mlp_dim) == (128, 512)
        assert task.batches[0]["tokens"].shape == (16, 128)
        args = parser.parse_args([name, "--size", "small", "--task", "digits", *required])
        with pytest.raises(
            ValueError, match="--size is a size of the tiny-lm task; drop --task digits or --size"
        ):
            task_from_args(args, default_optimizer="sgd", batch_size=None, steps=2)


@pytest.mark.multiprocess
def test_verify_reference_gspmd_under_launch(tmp_path):
    """2 processes x 4 devices on data=2,model=4: the state spans both processes (no process holds all of it);
    dp PASSes against gspmd, and a copy of the example's step without its psum over 'model' FAILs with the
    diagnosis it gets on one process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "megatron_mlp.py"
    text = example.read_text()
    faulty = text.replace('reduce=lambda y: jax.lax.psum(y, "model")', "reduce=lambda y: y")
    faulty = faulty.replace("out_specs=(P(), specs))", "out_specs=(P(), specs), check_vma=False)")
    assert faulty != text and "check_vma=False" in faulty
    (tmp_path / "no_psum.py").write_text(faulty)
    out = tmp_path / "verify.json"
    launch = [sys.executable, "-m", "shardcheck", "launch", "--processes", "2", "--devices-per-process", "4"]
    argv = ["verify", "--task", f"{example}:task", "--mesh", "data=2,model=4", "--reference", "gspmd"]
    argv += ["--strategies", "dp", "--candidate", f"{tmp_path / 'no_psum.py'}:step", "--steps", "2"]
    done = subprocess.run(
        [*launch, "--timeout", "200", "--", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["reference"] == "gspmd on data=2,model=4"
    runs = report["strategies"]
    assert runs["dp"]["verdict"] == "PASS"
    assert runs["candidate"]["verdict"] == "FAIL" and runs["candidate"]["codes"][0] == "wrong_axis_reduction"


class _TwoLayer(nnx.Module):
    """A body annotated over 'model' and an unannotated head (which a gspmd reference keeps whole, as the
    annotations alone place it, and an fsdp reference splits over 'data' by the FSDP rule)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.body = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.gelu(self.body(x)))


def _two_layer_task() -> Task:
    rng = np.random.default_rng(3)
    batches = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
        for _ in range(2)
    ]

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    return Task(lambda: _TwoLayer(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, batches, name="two-layer")


def _replicated_step(reduce_head: bool):
    """The user's shard_map step: parameters replicated, rows split over 'data', every gradient pmean-ed over
    'data' (the head's too, unless ``reduce_head`` is False), the update applied outside."""

    def step(model, optimizer, batch, mesh):
        graphdef, params = nnx.split(model, nnx.Param)

        def local(params, batch):
            loss, grads = jax.value_and_grad(
                lambda p: _two_layer_task().loss_fn(nnx.merge(graphdef, p), batch)
            )(params)
            grads = jax.tree_util.tree_map_with_path(
                lambda path, g: g if not reduce_head and path[0].key == "head" else jax.lax.pmean(g, "data"),
                grads,
            )
            return jax.lax.pmean(loss, "data"), grads

        specs = jax.tree.map(lambda _: P(), params)
        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs), check_vma=False
        )
        loss, grads = jax.jit(mapped)(params, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


HEAD_STATE = {
    "param head.bias",
    "param head.kernel",
    "opt_state 0.mu.head.bias",
    "opt_state 0.mu.head.kernel",
    "opt_state 0.nu.head.bias",
    "opt_state 0.nu.head.kernel",
}
"""The unannotated head's leaves whose copies differ along 'data' (the head left unreduced)."""


@require_devices(4)
@pytest.mark.parametrize(
    "reference,evidence",
    [("fsdp", {"grad head.bias", "grad head.kernel"}), ("gspmd", HEAD_STATE)],
)
def test_gradient_copies_that_differ_are_seen_against_a_same_mesh_reference(reference, evidence):
    """Trial 33: a head whose gradients were left unreduced over 'data' read "the replicas: agree" against a
    reference whose placement splits the head (then gspmd's, now fsdp's: the FSDP rule splits the unannotated head
    over 'data'), whose update mixes the devices' copies into one consistent parameter; the returned gradients'
    own copies differ, and are the replica evidence. gspmd keeps the unannotated head whole (the annotations
    alone, as the Flax NNX guide places it), as the step does, so the head's parameters and Adam moments keep
    the copies that differ and are the evidence themselves. A correct step passes against either."""
    import functools

    mesh = make_mesh({"data": 2, "model": 2})
    good = check_parity(
        functools.partial(_replicated_step(True), mesh=mesh),
        _two_layer_task(),
        mesh=mesh,
        reference=reference,
    )
    assert good.ok, good.summary()
    bad = check_parity(
        functools.partial(_replicated_step(False), mesh=mesh),
        _two_layer_task(),
        mesh=mesh,
        reference=reference,
    )
    first = bad.steps[0]
    assert not bad.ok and set(first.replica_mismatches) == evidence, first.replica_mismatches
    assert first.replica_axes == ("data",)
    assert bad.localization.status("replicas") == "differs"
    assert {"wrong_axis_reduction", "replicas_differ"} <= {d.code for d in bad.diagnoses}
