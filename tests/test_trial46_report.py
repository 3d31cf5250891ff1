"""Issue #36, trial 46 (a GPipe pipeline step): the report's per-kind rows and its first failing leaf.

1. A step the check re-ran from the reference's pre-step state after an earlier step had failed (the step loop's
   re-check of a failure at t > 0) is not the candidate's trajectory: the trial's table read ``param head.bias 1
   0.00153 FAIL`` (Adam given the reference's moments and a x 4 gradient) beside "applied parameters: matches",
   while the replay, which re-runs nothing, read the parameters PASS. The rows preferred the other steps and said
   which step was re-run; the step loop now re-runs no step after an earlier failure, so every record is the
   trajectory's (a report built of such records still marks them).
2. The first failing leaf follows the stage order at the first failing step (the localization's stage): the trial
   read ``grad head.kernel (step 0)`` beside a localization at the forward pass, whose loss failed at step 0.
3. An error raised by shardcheck's own built-in step is not "the candidate step"'s.

The task: a 2-stage pipeline of 2 tanh(Linear(8, 8)) blocks stacked with ``nnx.vmap`` over 'stage', a replicated
head Linear(8 -> 2), MSE, Adam; the step's ``jax.shard_map`` runs 2 micro-batches per data shard on mesh data=2 x
stage=2 (4 fake CPU devices).
"""

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from rich.console import Console
from test_trial46_builtins import (
    Pipe as Pipeline,  # 2 annotated tanh(Linear(8, 8)) blocks over 'stage', a head
)
from test_trial46_builtins import loss_fn as _loss
from test_trial46_pipeline import _body as pipeline_body

import shardcheck
from shardcheck import check_parity, make_mesh, record_run
from shardcheck.cli.verify import render_report, render_summary
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.report import ParityReport

H, D_OUT, STAGES, MICRO = 8, 2, 2, 2


def _task():
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, H)).astype(np.float32), "y": rng.normal(size=(8, D_OUT)).astype(np.float32)}
        for _ in range(3)
    ]
    return shardcheck.Task(
        model=lambda: Pipeline(nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=_loss,
        batches=batches,
        name="pipeline",
    )


def _body(fault):
    """The shard_map body of trial 46 pipeline's GPipe step (its faults, and ``"loss_summed"``)."""
    return pipeline_body(fault)[0]


def make_step(fault=""):
    """The user's GPipe step; ``fault``: ``"loss_summed"`` (the micro-batches' losses summed, x 2),
    ``"perm_reversed"`` (the activations sent from the last stage to the first)."""

    def step(model, optimizer, batch, mesh):
        specs = (P("stage"), P("stage"), P(), P(), P("data"), P("data"))
        out_specs = (P(), P("stage"), P("stage"), P(), P())
        fn = jax.jit(jax.shard_map(_body(fault), mesh=mesh, in_specs=specs, out_specs=out_specs))
        blk = model.blocks.linear
        loss, gw, gb, ghk, ghb = fn(
            blk.kernel[...], blk.bias[...], model.head.kernel[...], model.head.bias[...],
            jnp.asarray(batch["x"]), jnp.asarray(batch["y"]),
        )  # fmt: skip
        grads = jax.tree.map(lambda a: a, nnx.state(model, nnx.Param))
        grads.replace_by_pure_dict(
            {"blocks": {"linear": {"kernel": gw, "bias": gb}}, "head": {"kernel": ghk, "bias": ghb}}
        )
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    step.__name__ = f"gpipe_{fault or 'good'}"
    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "stage": 2})


@pytest.fixture(scope="module")
def loss_summed(mesh):
    return check_parity(make_step("loss_summed"), _task(), mesh=mesh)


def test_correct_pipeline_passes_with_no_rerun_rows(mesh):
    report = check_parity(make_step(), _task(), mesh=mesh)
    assert report.verdict == "PASS"
    assert report.rerun_after_failure == ()
    assert report.first_failing_leaf is None
    assert "re-run" not in str(report)
    assert all(e.ok for e in report.worst_by_kind().values())


def test_rows_are_the_trajectory_not_the_rerun_step(loss_summed):
    report = loss_summed
    assert report.verdict == "FAIL"
    # step 0 failed, so no later step is re-run from the reference's state: every record is the candidate's own
    # (the trial's step 1 was one, given the reference's moments and a x 2 gradient: 'param head.bias 1 0.00153')
    assert [r.synchronized for r in report.steps] == [False, False, False]
    assert report.rerun_after_failure == () and report.diverged_at is None
    # Adam normalizes a constant factor away: the trajectory's parameters match at every step
    assert all(e.ok for r in report.steps for e in r.leaves if e.kind == "param")
    rows = report.worst_by_kind()
    assert rows["param"].ok
    assert not rows["loss"].ok and rows["loss"].step == 0
    assert not rows["grad"].ok and rows["grad"].step == 0
    assert not rows["opt_state"].ok
    assert report.localization.status("parameters") == "differs"  # the optimizer state differs, 0 parameters
    assert "0 of 4 parameters" in report.localization.text()
    assert "re-run" not in str(report)
    assert report.to_dict()["worst_by_kind"]["param"]["ok"] is True


def _rows(table) -> list[list[str]]:
    """The table's body rows as rendered, each a list of its cells' text."""
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(table)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in lines]


def _caption(table) -> str:
    out = io.StringIO()
    Console(file=out, width=3000, color_system=None).print(table)
    return out.getvalue()


def test_the_cli_table_reads_the_trajectory(loss_summed):
    table = render_report(loss_summed, "setup")
    rows = {r[0]: r for r in _rows(table)}
    assert rows["param"][2] in ("0", "2") and rows["param"][-1] == "PASS"  # trial 46: "1 | 0.00153 | FAIL"
    assert rows["loss"][2] == "0" and rows["loss"][-1] == "FAIL"
    assert not any("(re-run)" in r[2] for r in rows.values())  # no step re-run after the failure at step 0
    assert "re-run" not in _caption(table)
    summary = _rows(render_summary({"candidate": loss_summed}, "setup"))
    assert summary[0][2] == "loss (step 0)"


def _leaf(kind, path, err, tol=1.0, step=0):
    return LeafError(step, kind, path, err, err, tol, err <= tol)


def _record(*leaves):
    return StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, tuple(leaves), 1, 1)


def test_a_kind_only_a_rerun_step_compared_is_marked():
    step0 = _record(_leaf("loss", "loss", 3.0))
    step1 = dataclasses.replace(
        _record(_leaf("loss", "loss", 5.0, step=1), _leaf("param", "w", 4.0, step=1)),
        step=1,
        synchronized=True,
    )
    report = ParityReport("s", False, (step0, step1), (), num_shards=2)
    assert report.rerun_after_failure == (1,)
    assert report.worst_by_kind()["loss"].step == 0  # the trajectory's, though the re-run's error is larger
    rows = {r[0]: r for r in _rows(render_report(report, "setup"))}
    assert rows["loss"][2] == "0"
    assert rows["param"][2] == "1 (re-run)" and rows["param"][-1] == "FAIL"
    assert "param     w                        abs 4" in str(report) and "FAIL (re-run)" in str(report)
    # a re-check that is the first failure (step 0 passed) stands for its step: not set apart
    clean = dataclasses.replace(step0, leaves=(_leaf("loss", "loss", 0.5),))
    first = ParityReport("s", False, (clean, step1), (), num_shards=2)
    assert first.rerun_after_failure == ()
    assert first.worst_by_kind()["loss"].step == 1
    assert "re-run" not in str(first)


def test_first_failing_leaf_follows_the_stage_order(mesh, loss_summed):
    report = check_parity(make_step("perm_reversed"), _task(), mesh=mesh)
    assert report.verdict == "FAIL"
    assert report.localization.step == 0 and report.localization.stage == "forward"
    first_step = report.steps[0]
    grad = max((e for e in first_step.leaves if e.kind == "grad" and not e.ok), key=lambda e: e.badness)
    loss = next(e for e in first_step.leaves if e.kind == "loss")
    assert not loss.ok and grad.badness > loss.badness  # by error over tolerance alone, a gradient would lead
    assert report.first_failing_leaf == "loss"
    assert report.first_worst.step == 0
    summary = _rows(render_summary({"candidate": report}, "setup"))
    assert summary[0][2] == "loss (step 0)"  # trial 46: "grad head.kernel (step 0)"
    assert "first failing leaf: loss at step 0" in str(report)
    assert report.to_dict()["first_failing_leaf"] == "loss"
    assert loss_summed.first_failing_leaf == "loss"


def _report(record):
    return ParityReport("s", record.ok, (record,), (), num_shards=2)


def test_first_failing_leaf_without_a_localization_takes_the_earliest_stage():
    report = _report(_record(_leaf("loss", "loss", 0.5), _leaf("grad", "w", 3.0), _leaf("param", "w", 9.0)))
    assert report.first_failing_leaf == "grad w"  # the loss passes; the gradients come before the parameters
    assert report.worst_leaf == "param w"  # the largest error over tolerance stays the worst leaf
    report = _report(_record(_leaf("loss", "loss", 2.0), _leaf("grad", "w", 30.0)))
    assert report.first_failing_leaf == "loss"
    assert _report(_record(_leaf("loss", "loss", 0.5), _leaf("param", "w", 0.1))).first_failing_leaf is None


def _raising(model, optimizer, batch):
    raise TypeError("planted failure")


def test_builtin_step_error_is_shardcheck_s_not_the_candidate_s(monkeypatch):
    from shardcheck.parity import CandidateError
    from shardcheck.parity.harness import candidates

    real = candidates._as_candidate

    def broken(*args):  # the built-in dp step, made to raise
        cand = real(*args)
        return dataclasses.replace(cand, step=_raising, program=None) if cand.builtin else cand

    monkeypatch.setattr(candidates, "_as_candidate", broken)
    task = _task()
    with pytest.raises(CandidateError) as err:
        check_parity("dp", task, num_shards=2, steps=1)
    text = str(err.value)
    assert text.startswith(
        "check_parity: shardcheck's built-in step 'dp' raised TypeError at step 0 (a limitation"
    )
    assert (
        "a limitation or a bug of shardcheck's dp step, not a fault of your model or step): planted" in text
    )
    assert "the candidate step" not in text
    with pytest.raises(CandidateError) as recorded:  # shardcheck record says what record_run raises
        record_run(task, "dp", num_shards=2, steps=1)
    assert str(recorded.value).startswith(
        "record_run: shardcheck's built-in step 'dp' raised TypeError at step 0"
    )
    with pytest.raises(CandidateError) as user:
        check_parity(_raising, task, num_shards=2, steps=1)
    assert str(user.value).startswith(
        "check_parity: the candidate step '_raising' raised TypeError at step 0"
    )
    assert "built-in" not in str(user.value)
