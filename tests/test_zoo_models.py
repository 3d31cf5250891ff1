"""The bugs the zoo's MoE, conv and counter models found in shardcheck, one test each (issue #34).

The zoo itself runs through every command in ``tests/test_zoo.py``; these pin the fixes with values.
"""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import check_parity, make_mesh
from shardcheck.cli import main
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import diagnose
from shardcheck.steps.reference import reference_step
from shardcheck.task import check_model

ZOO = Path(__file__).resolve().parents[1] / "examples" / "zoo"


@require_devices(8)
def test_train_on_a_mesh_with_an_expert_axis_splits_the_batch_over_the_data_axis_only(capsys):
    """``train --mesh data=2,expert=4`` exited 2 ("has 8 devices but ... num_shards=8"): --mesh set S to the
    mesh's 8 devices, where the batch is split over 'data' only (S=2, as verify and record count it)."""
    argv = ["train", "--task", f"{ZOO / 'moe.py'}:task", "--mesh", "data=2,expert=4", "--epochs", "1"]
    assert main([*argv, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_shards"] == 2
    assert report["strategy"] == "fsdp"
    assert len(report["steps"]) == 3  # the task's 3 batches, one epoch
    assert report["loss_curves_agree"] is True
    assert report["first_exceeded_step"] is None
    assert not any(s["drift_exceeded"] for s in report["steps"])


def _zoo(name: str):
    """The zoo file ``examples/zoo/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", ZOO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _calls(model) -> int:
    return int(model.calls[...])


def test_the_reference_step_writes_what_the_forward_pass_writes_once_a_step():
    """The single-device step of a model whose ``__call__`` increments an ``nnx.Variable`` counter raised
    "Cannot mutate Count from a different trace level" (the loss was differentiated on a merge of the outer
    trace's Variables); it now writes the count back, as ``nnx.value_and_grad`` does: 1 per step."""
    counter = _zoo("counter")
    model = counter.task.new_model()
    optimizer = counter.task.new_optimizer(model)
    for t, batch in enumerate(counter.task.batches):
        reference_step(counter.task.loss_fn, model, optimizer, batch)
        assert _calls(model) == t + 1
    assert int(optimizer.step[...]) == 3


def test_check_model_names_the_state_the_forward_pass_writes_and_nothing_else():
    counter, conv = _zoo("counter"), _zoo("conv")
    written: list[str] = []
    check_model("f", counter.task.new_model(), counter.task.loss_fn, counter.task.batches[0], updated=written)
    assert written == ["calls"]
    written = []  # GroupNorm's parameters only: nothing written
    check_model("f", conv.task.new_model(), conv.task.loss_fn, conv.task.batches[0], updated=written)
    assert written == []


@require_devices(4)
def test_a_counter_the_step_writes_is_compared_exactly_with_the_reference():
    """The user's step (nnx.value_and_grad under jit, state placed on the mesh) PASSes with the counter compared
    at every step (3 == 3); one that runs a second forward pass a step FAILs on it: model_state, x2."""
    counter = _zoo("counter")
    mesh = make_mesh(counter.MESH)
    good = check_parity(counter.step, counter.task, mesh=mesh)
    assert good.ok and good.codes[0] == "parity"
    compared = [e for r in good.steps for e in r.leaves if e.name == "counter model.calls"]
    assert [(e.step, e.max_abs_err, e.ratio) for e in compared] == [
        (0, 0.0, 1.0),
        (1, 0.0, 1.0),
        (2, 0.0, 1.0),
    ]

    bad = check_parity(counter.counted_twice, counter.task, mesh=mesh)
    assert not bad.ok
    assert bad.codes[0] == "model_state"
    assert bad.worst_leaf == "counter model.calls"
    first = next(e for e in bad.steps[0].leaves if e.name == "counter model.calls")
    assert (first.max_abs_err, first.ratio) == (1.0, 2.0)  # 2 forward passes against 1
    assert "2 times the reference's" in bad.diagnoses[0].message


@require_devices(4)
def test_gspmd_carries_the_forward_pass_writes_and_the_other_builtins_refuse_the_model_naming_why():
    counter = _zoo("counter")
    mesh = make_mesh(counter.MESH)
    report = check_parity("gspmd", counter.task, mesh=mesh)
    assert report.ok
    assert [e.ok for r in report.steps for e in r.leaves if e.name == "counter model.calls"] == [True] * 3
    for name, why in (
        ("dp", "in jax.shard_map"),
        ("fsdp", "in jax.shard_map"),
        ("simulation", "once per shard"),
        ("accumulation", "once per micro-batch"),
    ):
        with pytest.raises(ValueError, match=rf"^{name}: cannot run this model.*\(calls\).*{why}"):
            check_parity(name, counter.task, mesh=mesh if name in ("dp", "fsdp") else None, num_shards=4)


def _model_counter_record(ratio, err):
    leaves = (
        LeafError(0, "loss", "loss", 0.0, 0.0, 1e-3, True, None),
        LeafError(0, "param", "w", 0.0, 0.0, 1e-3, True, 1.0, 1.0),
        LeafError(0, "counter", "step", 0.0, 0.0, 0.0, True, 1.0),
        LeafError(0, "counter", "model.calls", err, err, 0.0, err == 0, ratio),
    )
    return StepRecord(
        0,
        rtol=1e-5,
        atol=1e-6,
        loss=1.0,
        candidate_loss=1.0,
        step_count=1,
        candidate_step_count=1,
        leaves=leaves,
    )


@pytest.mark.parametrize(
    "ratio,err,phrase",
    [(2.0, 1.0, "2 times the reference's"), (0.0, 1.0, "left it as it was"), (1.0, 0.0, None)],
    ids=["twice", "dropped", "equal"],
)
def test_the_model_state_rule_names_a_model_counter_and_not_the_optimizer(ratio, err, phrase):
    found = diagnose([_model_counter_record(ratio, err)], 4)
    codes = [d.code for d in found]
    if phrase is None:
        assert codes[0] == "parity" and "model_state" not in codes
        return
    assert codes[0] == "model_state" and "step_counter" not in codes  # not the optimizer's counter
    assert phrase in found[0].message
    assert found[0].leaf == "counter model.calls"


def test_check_model_reads_a_prng_key_the_forward_pass_writes_through_its_raw_data():
    """A key kept in a plain ``nnx.Variable`` and split in ``__call__`` is named (NumPy cannot hold a key)."""

    class KeyHolder(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            self.key = nnx.Variable(jax.random.key(1))
            self.fixed = nnx.Variable(jax.random.key(2))

        def __call__(self, x):
            self.key[...] = jax.random.split(self.key[...])[0]
            return self.linear(x)

    written: list[str] = []
    check_model("f", KeyHolder(), lambda m, b: jnp.mean(m(b) ** 2), jnp.ones((4, 2)), updated=written)
    assert written == ["key"]
