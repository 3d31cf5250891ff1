"""Sentences of live reports that leaked internals or said false things (issue #36, trials 16 and 17).

Trial 17 trained a GRU LM (an ``nnx.Dropout`` with its own ``rngs`` stream, the recurrent cell run by
``jax.lax.scan``, AdamW on a warm-up from learning rate 0) on a data mesh; trial 16 a DLRM whose item table's
Adagrad accumulator started from 0 instead of 0.1. Both sides of each:

- the module probe recorded the cell's calls inside the scan body, whose arrays escaped it, and the report said
  "module outputs could not be captured (UnexpectedTracerError)": a call made inside a transform of the forward is
  now left out (and named), the modules around it compared; a loss that runs the whole model inside
  ``jax.checkpoint`` is said in words with what to do (``tests/test_module_localization.py``);
- at step 0 a warm-up from 0 moves no parameter, so "the applied parameters match" was no evidence, and the report
  still guessed "shards applied one after another": it now says the learning rate at step 0 is 0 (no update to
  compare) and drops the guess, which a step with a learning rate above 0 keeps;
- the replicas' note listed optimizer-state leaves as "gradients within tolerance": now "leaves whose copies
  differ with their parameter's gradient within tolerance";
- a trained non-parameter state leaf (the GRU's initial hidden state) was the leading cause while the verdict
  table had no row for it: a failing state leaf now has its own ``state`` row, a passing one none;
- an optimizer state that started from other values (Adagrad's ``initial_accumulator_value``) was said "the
  update was applied differently" and "their changes lie around 1 x the reference's (elementwise 0.9999..1)"
  beside a table error of 0.1: its change matches the reference's while its values differ by more than the whole
  change, so the report now says the optimizer state started from other values; a candidate whose Adagrad has
  another learning rate (same state, other update) is still said applied differently.
"""

from __future__ import annotations

import argparse
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from shardcheck import Candidate, Task, check_parity, make_mesh
from shardcheck.cli._common import library_to_flags
from shardcheck.cli.verify import render_report
from shardcheck.parity.diagnosis.topology import missed_axes_message

V, D, H, T, B = 16, 8, 8, 6, 8
AX = "data"


class HiddenInit(nnx.Variable):
    """The GRU's initial hidden state: not a parameter."""


class Cell(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.wi = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, H)))
        self.wh = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (H, H)))

    def __call__(self, h, x):
        h = jnp.tanh(x @ self.wi[...] + h @ self.wh[...])
        return h, h


class RNNLM(nnx.Module):
    """embed -> dropout -> a cell scanned over time from ``h0`` -> head (trial 17's GRU LM, smaller)."""

    def __init__(self, rngs: nnx.Rngs, rate: float):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.cell = Cell(rngs)
        self.h0 = HiddenInit(jax.random.normal(jax.random.key(7), (H,)) * 0.1)
        self.head = nnx.Linear(H, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.drop(self.embed(tokens))
        h = jnp.zeros((tokens.shape[0], 1)) * x[:, 0, :1] + self.h0[...]
        _, ys = jax.lax.scan(self.cell, h, jnp.swapaxes(x, 0, 1))
        return self.head(jnp.swapaxes(ys, 0, 1))


def lm_loss(model, batch):
    """``(sum of the masked token losses, token count)``."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"]), batch["targets"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])


def _batches(n: int = 2) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        toks = rng.integers(1, V, size=(B, T + 1)).astype(np.int32)
        mask = (np.arange(T)[None, :] < rng.integers(2, T + 1, size=B)[:, None]).astype(np.float32)
        out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": mask})
    return out


@functools.cache
def _task(rate: float, warmup: bool) -> Task:
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10) if warmup else 1e-2
    return Task(
        model=lambda: RNNLM(nnx.Rngs(0, dropout=1), rate),
        optimizer=optax.adamw(lr, weight_decay=0.1),
        loss_fn=lm_loss,
        batches=_batches(),
        name=f"rnn-lm-{rate}-{warmup}",
    )


def reversed_inputs(model, optimizer, batch, mesh):
    """:func:`sm_step` on each row's inputs reversed in time: a loss the model computes otherwise, not a reduction
    the harness reproduces."""
    return sm_step(model, optimizer, {**batch, "inputs": batch["inputs"][:, ::-1]}, mesh)


def sm_step(model, optimizer, batch, mesh):
    """A shard_map data-parallel step, loss sums and counts psum-ed then divided once (correct), the model's
    state (its dropout key too) replicated: with dropout on, every shard draws the same mask from the same key."""
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)

    def body(leaves, batch):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        _, params, _ = nnx.split(model, nnx.Param, ...)
        p_leaves, p_def = jax.tree.flatten(params)
        nnx.update(model, jax.lax.pcast(params, AX, to="varying"))
        (s, c), g = nnx.value_and_grad(lambda m: lm_loss(m, batch), has_aux=True)(model)
        nnx.update(model, jax.tree.unflatten(p_def, p_leaves))  # back to the replicated values
        total = jax.lax.psum(c, AX)
        g = jax.tree.map(lambda x: jax.lax.psum(x, AX) / total, g)
        optimizer.update(model, g)
        return jax.lax.psum(s, AX) / total, jax.tree.leaves(nnx.state((model, optimizer))), g

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX)), out_specs=(P(), P(), P()))
    loss, leaves, g = jax.jit(mapped)(leaves, batch)
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
    return {"loss": loss, "grads": g}


def _mean_loss(model, batch):
    s, c = lm_loss(model, batch)
    return s / c


@nnx.jit(static_argnums=(3,))
def _train(model, optimizer, batch, train_h0):
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, HiddenInit)) if train_h0 else nnx.DiffState(0, nnx.Param)
    loss, grads = nnx.value_and_grad(_mean_loss, argnums=diff)(model, batch)
    optimizer.update(model, nnx.state(grads, nnx.Param))
    if train_h0:  # trial 17's FAULT=h0_param: the initial hidden state trained too
        model.h0[...] = model.h0[...] - 1e-2 * nnx.state(grads, HiddenInit)["h0"][...]
    return loss, nnx.state(grads, nnx.Param)


def _gspmd(train_h0: bool):
    def gspmd_step(model, optimizer, batch, mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P(AX)))
        loss, grads = _train(model, optimizer, batch, train_h0)
        return {"loss": loss, "grads": grads}

    return gspmd_step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({AX: 2})


# ------------------------------------------------------- the module probe and a learning rate of 0 at step 0


@require_devices(2)
def test_a_correct_shard_map_step_of_the_scanned_rnn_passes(mesh):
    report = check_parity(sm_step, _task(0.0, True), mesh=mesh)
    assert report.ok and report.localization is None


@require_devices(2)
def test_same_dropout_key_on_every_shard_probes_the_modules_around_the_scan(mesh):
    report = check_parity(sm_step, _task(0.1, True), mesh=mesh)
    assert not report.ok and report.localization.stage == "forward"
    found = report.localization.module
    # the cell's calls inside lax.scan are left out and named; the modules around it are compared
    assert (found.status, found.error, found.inside_transforms) == ("matches", "", ("Cell.__call__",))
    assert found.compared == 4 and found.max_abs_err <= found.tolerance
    text = report.localization.text()
    assert (
        "; Cell.__call__ runs inside a transform of the forward (a jax.lax.scan body or the like): not compared on "
        "its own, the module that runs that transform stands for it."
    ) in text
    assert "Error" not in text and "could not be captured" not in text


@require_devices(2)
def test_at_a_learning_rate_of_0_matching_parameters_are_said_no_update_and_no_shard_order_is_guessed(mesh):
    report = check_parity(reversed_inputs, _task(0.0, True), mesh=mesh)
    assert not report.ok and report.localization.stage == "forward"
    # the warm-up starts at 0: the parameters match because nothing moved them
    params = [e for e in report.steps[0].leaves if e.kind == "param"]
    assert len(params) == 5 and all(e.ok and e.reference_change == 0.0 for e in params)
    # trial 44: the forward pass differs first and the update from equal inputs matches: forward_differs
    assert "update_differs" not in report.codes
    message = next(d.message for d in report.diagnoses if d.code == "forward_differs")
    assert (
        "though the applied parameters match at this step (5 leaves) only because no update is compared there: "
        "the reference's own update is 0 at step 0 (the learning rate at step 0 is 0, as a warm-up from 0 gives). "
        "The optimizer's update from equal inputs matches"
    ) in message
    assert "shards applied one after another" not in message and "not a single reduced step" not in message
    assert "the loss it returns is computed another way at equal parameters" in message


@require_devices(2)
def test_with_a_learning_rate_above_0_the_step_0_update_is_compared_and_no_lr_0_is_said(mesh):
    report = check_parity(reversed_inputs, _task(0.0, False), mesh=mesh)
    assert not report.ok
    params = [e for e in report.steps[0].leaves if e.kind == "param"]
    assert all(e.reference_change > 0 for e in params) and not all(e.ok for e in params)
    text = " ".join(d.message for d in report.diagnoses)
    assert "learning rate at step 0 is 0" not in text and "though the applied parameters match" not in text


# -------------------------------------------------------------------------- a trained state leaf's table row


def _rows(report) -> dict[str, str]:
    """The verdict table's rows, ``{compared: the row's line}``."""
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(render_report(report, "setup"))
    cells = [line.split("│") for line in console.export_text().splitlines() if line.startswith("│")]
    return {c[1].strip(): "│".join(c) for c in cells if c[1].strip()}


@require_devices(2)
def test_a_trained_hidden_state_has_its_own_failing_state_row_and_a_correct_step_none(mesh):
    report = check_parity(_gspmd(train_h0=True), _task(0.0, False), mesh=mesh)
    assert not report.ok
    rows = report.worst_by_kind()
    assert list(rows) == ["loss", "grad", "param", "opt_state", "state", "counter"]
    state = rows["state"]
    assert (state.path, state.step, state.ok, state.tolerance) == ("model.h0", 0, False, 0.0)
    assert state.max_abs_err > 1e-5
    rows = _rows(report)
    assert list(rows) == ["loss", "grad", "param", "opt_state", "state", "counter"]
    assert "model.h0" in rows["state"] and "FAIL" in rows["state"]
    assert report.to_dict()["worst_by_kind"]["state"]["ok"] is False

    correct = check_parity(_gspmd(train_h0=False), _task(0.0, False), mesh=mesh)
    assert correct.ok and "state" not in correct.worst_by_kind()
    assert list(_rows(correct)) == ["loss", "grad", "param", "opt_state", "counter"]


# ------------------------------------------------------------------- an optimizer state that started otherwise


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(32, 4, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.emb(ids))[:, 0]


def _tiny_loss(model, batch):
    return jnp.mean((model(batch["ids"]) - batch["y"]) ** 2)


def _tiny_task() -> Task:
    rng = np.random.default_rng(1)
    batches = [
        {"ids": rng.integers(0, 32, 8).astype(np.int32), "y": rng.normal(size=8).astype(np.float32)}
        for _ in range(2)
    ]
    return Task(
        model=lambda: Tiny(nnx.Rngs(0)),
        optimizer=optax.adagrad(0.05, initial_accumulator_value=0.1),
        loss_fn=_tiny_loss,
        batches=batches,
        name="tiny-adagrad",
    )


@nnx.jit
def _tiny_train(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_tiny_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def _own_adagrad(lr: float, initial: float) -> Candidate:
    def step(model, optimizer, batch, mesh):
        return _tiny_train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P(AX))))

    def make(model, optimizer):
        return nnx.Optimizer(model, optax.adagrad(lr, initial_accumulator_value=initial), wrt=nnx.Param)

    return Candidate(name=f"adagrad-{lr}-{initial}", step=step, pass_mesh=True, make_optimizer=make)


@require_devices(2)
def test_an_adagrad_accumulator_started_from_0_is_said_started_otherwise(mesh):
    report = check_parity(_own_adagrad(0.05, 0.0), _tiny_task(), mesh=mesh)
    assert not report.ok
    loc = report.localization
    assert loc.step == 0 and loc.started and loc.stage in ("optimizer", "parameters")
    worst = max((e for e in report.steps[0].leaves if e.kind == "opt_state"), key=lambda e: e.badness)
    assert abs(worst.max_abs_err - 0.1) < 1e-6 and abs(worst.ratio - 1.0) < 1e-3
    text = " ".join([loc.text(), *(d.message for d in report.diagnoses)])
    assert "(the optimizer state started from other values, before the step's update)" in loc.text()
    assert "optax.adagrad's initial_accumulator_value" in text
    assert (
        f"while its values differ by up to {worst.max_abs_err:.3g}, more than the reference's whole change"
        in text
    )
    assert "applied differently" not in text and "lie around 1 x" not in text
    assert report.to_dict()["localization"]["started"] is True


@require_devices(2)
def test_an_adagrad_with_another_learning_rate_is_not_said_started_otherwise(mesh):
    report = check_parity(_own_adagrad(0.1, 0.1), _tiny_task(), mesh=mesh)
    assert not report.ok
    loc = report.localization
    assert loc.step == 0 and not loc.started
    text = " ".join([loc.text(), *(d.message for d in report.diagnoses)])
    assert "started from other values" not in text and "initial_accumulator_value" not in text


# ---------------------------------------------------------------------------------------- two wordings


def test_the_replicas_note_lists_optimizer_state_as_leaves_not_as_gradients():
    leaves = ["opt_state 0.mu.cell.wh", "opt_state 0.mu.head.kernel", "opt_state 0.nu.head.kernel"]
    message = missed_axes_message(0, leaves, ("fsdp",), {"data": 2, "fsdp": 2}, unreduced=["cell.wh"])
    assert message.endswith(
        "Not reduced: grad cell.wh; leaves whose copies differ with their parameter's gradient within tolerance, "
        "nearest its tolerance first: opt_state 0.mu.head.kernel, opt_state 0.nu.head.kernel."
    )
    assert "gradients within tolerance, nearest" not in message


def test_mesh_shard_counts_name_the_batch_axes_data_and_fsdp():
    args = argparse.Namespace(mesh={"data": 3, "fsdp": 2})
    message = library_to_flags(
        "check_parity: batch size 16 is not divisible by num_shards=6; equal shards are required (valid "
        "num_shards for this batch: 1, 2, 4, 8, 16; pad the batch)",
        "verify",
        args=args,
    )
    assert message == (
        "shardcheck verify: batch size 16 is not divisible by the 6 devices of --mesh data=3,fsdp=2; equal shards "
        "are required (valid batch-shard counts (the product of the sizes of --mesh's batch axes, data and fsdp) "
        "for this batch: 1, 2, 4, 8, 16; pad the batch)"
    )


def test_a_probe_that_raised_is_said_in_words_and_its_exception_is_kept_in_the_json():
    from shardcheck.parity.diagnosis.module_outputs import ModuleFinding

    found = ModuleFinding("not captured", error="UnexpectedTracerError")
    assert found.text() == (
        "the module probe could not run the task's forward with its module outputs recorded (it raised; the JSON "
        "report's module.error names the exception); the localization stays at the forward stage"
    )
    assert found.to_dict()["error"] == "UnexpectedTracerError" and found.to_dict()["inside_transforms"] == []
