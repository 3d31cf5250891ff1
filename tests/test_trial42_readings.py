"""Issue #36, trial 42 (a deep ensemble of MLPs stacked by nnx.vmap, optax.MultiSteps over a multi_transform,
the user's shard_map steps on data=4 and data=2 x model=2): five sentences the same reports' records
contradicted, on a small stacked ensemble (2 or 4 members, a kernel (E, 4, 3) and a bias (E, 3)).

1. The members' losses summed where their mean was meant, x2 on data=2 (the loss and its gradients alike): both
   readings, a factor in the step's own loss or a psum of the loss and gradients where a pmean was meant, code
   ``scaled``; never "the gradient reduction summed instead of averaged" as a fact.
2. The same on data=2 x model=2 with 4 members (x4 = 2^2): never "the gradient was sum-reduced twice" beside a
   loss that is 4 x too (a reduction of the gradients alone leaves the loss as it is).
3. One member's SGD momentum trace zeroed after each update: the slice of the optimizer state was reset, never
   "the candidate's update there is exactly 0 (frozen, or its gradient zeroed)" beside matching parameters.
4. A candidate's multi_transform with other labels, replayed: "The first 1 step(s) agree" no more, where the
   optimizer state differs in structure from the initial state on (the localization's step 0).
5. optax.chain(tx, optax.apply_every(2)) in place of the task's optax.MultiSteps(tx, 2): said as another
   transformation (MultiSteps' state against apply_every's), live and replayed, never labels or a mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps import Candidate


class _Ensemble(nnx.Module):
    """``E`` linear members stacked on a leading axis (as nnx.vmap stacks them): logits ``(E, B, 3)``."""

    def __init__(self, e: int):
        key = jax.random.key(0)
        self.w = nnx.Param(jax.random.normal(key, (e, 4, 3)) * 0.5)
        self.b = nnx.Param(jnp.linspace(-0.2, 0.3, e * 3).reshape(e, 3))

    def __call__(self, x):
        return jnp.einsum("bi,eio->ebo", x, self.w[...]) + self.b[...][:, None, :]


def _member_losses(model, batch):
    """Each member's mean squared error, ``(E,)``."""
    return jnp.mean((model(batch["x"]) - batch["y"][None]) ** 2, axis=(1, 2))


def _loss(model, batch):
    return jnp.mean(_member_losses(model, batch))


def _batches(n: int = 1):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(n)
    ]


def _labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "first" if "'w'" in jax.tree_util.keystr(path) else "rest", params
    )


def _labels_swapped(params):
    return jax.tree.map(lambda _: "first", params)


def _inner(labels=_labels):
    return optax.multi_transform({"first": optax.sgd(0.05, momentum=0.9), "rest": optax.adam(1e-2)}, labels)


def _multi_steps(labels=_labels):
    return optax.MultiSteps(_inner(labels), every_k_schedule=2).gradient_transformation()


@functools.cache
def _task(e: int, tx: str = "sgd") -> Task:
    optimizer = _multi_steps() if tx == "multi_steps" else optax.sgd(0.1, momentum=0.9)
    return Task(
        model=lambda: _Ensemble(e),
        optimizer=optimizer,
        loss_fn=_loss,
        batches=_batches(2 if tx == "multi_steps" else 1),
        name=f"ensemble-{e}",
    )


def _step(mesh, fault: str = "", make_optimizer=None) -> Candidate:
    """A shard_map step, the batch over 'data' (replicated over any other axis), the loss and gradients
    pmean-ed over 'data': ``sum`` sums the members' losses where their mean is meant, ``momentum_reset`` zeroes
    member 1's momentum trace after each update."""

    def step(model, optimizer, batch):
        graphdef, params = nnx.split(model, nnx.Param)

        def body(params, batch):
            def lossf(p):
                losses = _member_losses(nnx.merge(graphdef, p), batch)
                return jnp.sum(losses) if fault == "sum" else jnp.mean(losses)

            loss, grads = jax.value_and_grad(lossf)(params)
            return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

        loss, grads = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
        )(params, batch)
        optimizer.update(model, grads)
        if fault == "momentum_reset":

            def zero(path, v):
                stacked = "trace" in jax.tree_util.keystr(path) and getattr(v, "ndim", 0) >= 2
                return v.at[1].set(0.0) if stacked else v

            nnx.update(optimizer, jax.tree_util.tree_map_with_path(zero, nnx.state(optimizer)))
        return {"loss": loss, "grads": grads}

    return Candidate(
        fault or "right", nnx.jit(step), num_shards=mesh.shape["data"], make_optimizer=make_optimizer
    )


def _message(report, code: str) -> str:
    return next(d.message for d in report.diagnoses if d.code == code)


def _own(tx):
    return lambda model, ref: nnx.Optimizer(model, tx, wrt=nnx.Param)


# ------------------------------------------------------ 1, 2. the loss itself scaled by a shard count's factor


@require_devices(2)
def test_members_summed_on_data_2_say_both_readings_and_claim_no_reduction():
    mesh = make_mesh({"data": 2})
    report = check_parity(_step(mesh, "sum"), _task(2), mesh=mesh)
    assert report.codes[0] == "scaled" and "summed" not in report.codes, report.codes
    message = _message(report, "scaled")
    assert message.startswith(
        "At step 0 the loss the step returns at equal parameters is 2 x the reference's ("
    ), message
    assert (
        "and gradients are 2 x too: the loss itself is scaled, its gradients with it: either a factor of 2 in the "
        "step's own loss (a sum over 2 terms where their mean was meant, such as an ensemble's members or "
        "micro-batches; a term counted twice, another count or divisor, a loss scale not undone), or the loss and "
        "its gradients alike psum-ed over 'data' where a pmean was meant (or each shard's loss over its local "
        "count or weight, the 2 shards' results summed"
    ) in message, message
    assert "The factor alone does not tell the two apart" in message
    assert "summed instead of averaged" not in report.diagnosis and "Second, since" not in report.diagnosis
    right = check_parity(_step(mesh), _task(2), mesh=mesh)
    assert right.ok, right.diagnosis


@require_devices(4)
def test_four_members_summed_on_data_2_model_2_never_read_a_double_sum():
    mesh = make_mesh({"data": 2, "model": 2})
    report = check_parity(_step(mesh, "sum"), _task(4), mesh=mesh)
    assert report.codes[0] == "scaled", report.codes
    message = _message(report, "scaled")
    assert "the loss the step returns at equal parameters is 4 x the reference's" in message, message
    assert (
        "either a factor of 4 in the step's own loss (a sum over 4 terms where their mean was meant"
        in message
    )
    assert (
        "or the loss and its gradients alike psum-ed over 'data' and 'model' where a pmean was meant."
        in message
    )
    assert "sum-reduced twice" not in report.diagnosis and "Second, since" not in report.diagnosis
    right = check_parity(_step(mesh), _task(4), mesh=mesh)
    assert right.ok, right.diagnosis


# ------------------------------------------------------------------- 3. a slice of the momentum trace zeroed


@require_devices(2)
def test_a_zeroed_momentum_slice_is_said_as_optimizer_state_reset_not_a_frozen_update():
    mesh = make_mesh({"data": 2})
    report = check_parity(_step(mesh, "momentum_reset"), _task(2), mesh=mesh)
    assert not report.ok
    loc = report.localization
    assert loc.stage == "optimizer" and loc.form.kind == "slices", loc.text()
    assert all(e.ok for e in report.steps[0].leaves if e.kind in ("grad", "param")), report.steps[0]
    assert (
        "only slice 1 of the leading axis (size 2: layers stacked by nnx.scan or nnx.vmap) differs on all 2 failing "
        "leaves; every other slice matches: the candidate's optimizer state holds exactly 0 there after the step, "
        "where the reference's holds values: that slice of the optimizer state (a momentum trace, a moment) was "
        "reset (zeroed) by the step, not its gradient or parameters"
    ) in loc.form.sentence, loc.form.sentence
    assert "frozen, or its gradient zeroed" not in loc.text() + report.diagnosis


# --------------------------------------------------- 4, 5. another optimizer's state, replayed and live


@functools.cache
def _recording():
    mesh = make_mesh({"data": 2})
    return mesh, record_run(_task(2, "multi_steps"), _step(mesh), mesh=mesh)


@require_devices(2)
def test_labels_swapped_replayed_say_the_structure_differs_before_the_first_value_step():
    mesh, rec = _recording()
    cand = _step(mesh, make_optimizer=_own(_multi_steps(_labels_swapped)))
    report = check_parity(cand, _task(2, "multi_steps"), mesh=mesh, reference=rec)
    assert not report.ok and report.localization.step == 0, report.localization.text()
    assert "The first 1 step(s) agree" not in report.diagnosis, report.diagnosis
    drift = _message(report, "drift")
    assert drift.startswith(
        "The runs differ from the initial state on: 2 leaves are in one run only (e.g. opt_state "
        "inner_opt_state.inner_states.rest.inner_state.0.mu.b), a difference of structure that no value comparison "
        "shows. The values both runs hold agree for the first 1 step(s); at step 1 they do not ("
    ), drift
    assert "The structure that differs from the initial state on is the likelier cause" in drift
    # the labels' reading stays where the wrapper's state is in both runs
    assert "a multi_transform's labels or a mask" in report.localization.form.sentence
    assert check_parity(_step(mesh), _task(2, "multi_steps"), mesh=mesh, reference=rec).ok


@require_devices(2)
def test_apply_every_in_place_of_multi_steps_is_another_transformation_live_and_replayed():
    mesh, rec = _recording()
    tx = optax.chain(_inner(), optax.apply_every(2))
    with pytest.raises(TypeError) as caught:
        check_parity(_step(mesh, make_optimizer=_own(tx)), _task(2, "multi_steps"), mesh=mesh)
    said = str(caught.value)
    assert (
        "the candidate's optimizer is another transformation than the task's (the task's holds optax.MultiSteps' "
        "state (acc_grads, gradient_step, mini_step); the candidate's holds optax.apply_every's state (grad_acc), "
        "which the other lacks), not the task's with other labels or a mask, so its state and update count cannot "
        "be compared: build the candidate's optimizer as the task's is built"
    ) in said, said
    replayed = check_parity(
        _step(mesh, make_optimizer=_own(tx)), _task(2, "multi_steps"), mesh=mesh, reference=rec
    )
    form = replayed.localization.form.sentence
    assert replayed.localization.form.kind == "shape", form
    assert (
        "another transformation in the candidate's optimizer: the leaves of optax.MultiSteps' state (acc_grads) "
        "are in one run only"
    ) in form, form
    assert "not a multi_transform's labels or a mask" in form and "labels or a mask sending" not in form
