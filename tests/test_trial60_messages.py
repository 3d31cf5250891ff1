"""Trial 60's messages: advice that could not work, and wording that named another thing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_devices

import shardcheck
from shardcheck.parity.harness.candidates import _batch_key_hint, _mesh_axis_hint


def _raised(fn):
    try:
        fn()
    except KeyError as err:
        return err
    raise AssertionError("no KeyError")


BATCH = {"x": np.zeros((4, 2)), "label": np.zeros(4), "mask": np.ones(4)}


@require_devices(2)
def test_a_mistyped_batch_key_is_told_the_batchs_keys_not_a_mesh_axis():
    """Trial 60 D1: ``batch["image"]`` on a batch of x, label, mask read "the step names mesh axis 'image' ...
    give the mesh that axis (--mesh image=2"; a lookup of the mesh's shape keeps the mesh's hint (trial 25)."""
    mesh = shardcheck.make_mesh({"data": 2})
    typo = _raised(lambda: BATCH["image"])
    assert _batch_key_hint(typo, BATCH) == (
        "the step reads key 'image', which the batch lacks (its keys: 'label', 'mask', 'x'): read the batch by the "
        "keys the task's batches hold, or give them that key"
    )
    axis = _raised(lambda: mesh.shape["fsdp"])  # the step's own mesh.shape['fsdp']
    assert _batch_key_hint(axis, BATCH) == ""
    assert _mesh_axis_hint(axis, mesh).startswith("the step names mesh axis 'fsdp'")
    assert _batch_key_hint(_raised(lambda: {}["x"]), BATCH) == ""  # a key the batch holds
    assert _batch_key_hint(_raised(lambda: {}[3]), BATCH) == ""


@require_devices(2)
def test_a_step_reading_a_key_its_batch_lacks_is_refused_with_the_batchs_keys():
    import optax
    from flax import nnx

    def make_model():
        return nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return ((model(batch["x"])[:, 0] - batch["label"]) ** 2).mean()

    task = shardcheck.Task(make_model, optax.sgd(0.1), loss_fn, [BATCH], name="typo")

    def step(model, optimizer, batch):
        return loss_fn(model, {"x": batch["image"], "label": batch["label"]})

    with pytest.raises(shardcheck.CandidateError) as raised:
        shardcheck.check_parity(step, task, mesh=shardcheck.make_mesh({"data": 2}))
    said = str(raised.value)
    assert "the step reads key 'image', which the batch lacks (its keys: 'label', 'mask', 'x')" in said
    assert "mesh axis" not in said


def test_a_task_model_whose_batchnorm_names_a_mesh_axis_is_told_where_the_axis_belongs():
    """Trial 60 C2: nnx.BatchNorm(..., axis_name="data") built into the task's model read "the task's loss_fn
    raised NameError ... fix the loss function (a batch key or a model attribute it names?)"."""
    import optax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(2, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, axis_name="data", rngs=rngs)

        def __call__(self, x):
            return self.bn(self.fc(x))

    def loss_fn(model, batch):
        return (model(batch["x"]) ** 2).mean()

    task = shardcheck.Task(lambda: Net(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, [BATCH], name="bn")
    with pytest.raises(ValueError) as raised:
        shardcheck.check_parity("gspmd", task, num_shards=1)
    said = str(raised.value)
    assert "a layer of the model names mesh axis 'data' (e.g. nnx.BatchNorm(..., axis_name='data'))" in said
    assert "build the task's model without axis_name, and set it in your own step" in said
    assert "fix the loss function" not in said


def test_a_function_with_a_required_keyword_of_its_own_is_not_suggested_as_a_step():
    """Trial 60 C7: --candidate file.py:NOT_CALLABLE suggested kw_only(model, optimizer, batch, *, mesh, extra),
    which cannot be called as a step; a keyword-only mesh is one the harness passes."""
    from shardcheck.cli.verify import _takes_step_arguments

    def kw_only(model, optimizer, batch, *, mesh, extra):
        return 0.0

    def mesh_by_keyword(model, optimizer, batch, *, mesh):
        return 0.0

    def extra_with_default(model, optimizer, batch, *, scale=1.0):
        return 0.0

    assert not _takes_step_arguments(kw_only, task_form=True)
    assert _takes_step_arguments(mesh_by_keyword, task_form=True)
    assert _takes_step_arguments(extra_with_default, task_form=True)


def test_replicas_of_a_parameter_average_are_said_as_such():
    """Trial 60 C7: an EMA of the parameters taken of each device's copies read only "a statistic or moving
    average of the batch"."""
    from shardcheck.parity.diagnosis.evidence import StepRecord
    from shardcheck.parity.diagnosis.rules import DiagnosisContext, replicas_differ

    record = StepRecord(
        0, leaves=(), rtol=1e-5, atol=1e-6, loss=1.0, candidate_loss=1.0, step_count=1, candidate_step_count=1,
        replica_mismatches=("state ema_fc2.kernel",),
    )  # fmt: skip
    said = replicas_differ(DiagnosisContext.build([record], 2)).message
    assert "an average of the parameters, such as an EMA, taken of each device's own copies" in said


@require_devices(2)
def test_a_nan_loss_beside_a_correct_update_under_a_zero_warm_up_is_non_finite_from_step_0():
    """Trial 60 D2: a step returning a NaN loss beside a correct update, under a warm-up whose learning rate is 0
    at step 0. Step 0 (the parameters stood still) read as a step ``apply_if_finite`` skipped, so ``record``
    refused the run at step 1 and advised ``--steps 1``, whose recording held that NaN loss. The run went
    non-finite at step 0, with no step before it to record; a genuine skip stays recorded
    (tests/test_trial29_skipped_step.py)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from shardcheck.parity.comparison.digest import skipped_steps
    from shardcheck.parity.harness.non_finite import first_non_finite, refusal
    from shardcheck.parity.harness.recorded import record_run

    def make_model():
        return nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return ((model(batch["x"])[:, 0] - batch["label"]) ** 2).mean()

    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(4, 2)).astype(np.float32), "label": rng.normal(size=4)} for _ in range(3)
    ]
    warm_up = optax.linear_schedule(0.0, 0.1, transition_steps=2)  # lr 0 at step 0
    task = shardcheck.Task(make_model, optax.adam(warm_up), loss_fn, batches, name="warm-up")

    @nnx.jit
    def nan_loss(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return jnp.float32(jnp.nan) + 0 * loss

    step = shardcheck.Candidate(name="nan_loss", step=nan_loss, num_shards=2)
    recording = record_run(task, step, num_shards=2)
    # read alone, step 0 looks like a skip: the parameters stood still
    assert skipped_steps(recording) == (0,)
    found = first_non_finite(recording)
    assert (found.step, found.names) == (0, ("loss",))
    assert first_non_finite(recording, steps=1) == found  # a replay of step 0 alone is told so too
    said = refusal("shardcheck record", found, "run.npz")
    assert said.startswith(
        "shardcheck record: the recorded run went non-finite (NaN or infinity) at step 0, in loss"
    )
    assert said.endswith("a learning rate too high); no finite step comes before it to record.")


def test_a_device_put_refused_across_processes_is_told_place_host_tree(monkeypatch):
    """Trial 61: under ``shardcheck launch`` (2 processes), a step that placed its model's state with
    ``jax.device_put`` (its nnx.Rngs keys) was refused "a Sharding which represents addressable devices", and the
    command said "fix the step". In one process the same text gets no such hint."""
    import jax

    from shardcheck.parity.harness.candidates import _process_hint

    err = ValueError(
        "device_put's second argument must be a Device or a Sharding which represents addressable devices, but "
        "got NamedSharding(mesh=Mesh('data': 2, 'fsdp': 2), spec=P())"
    )
    assert _process_hint(err) == ""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    said = _process_hint(err)
    assert said.startswith(
        "the step places arrays with jax.device_put on a mesh that spans several processes"
    )
    assert "shardcheck.distributed.place_host_tree(tree, shardings)" in said
    assert _process_hint(ValueError("another error")) == ""
