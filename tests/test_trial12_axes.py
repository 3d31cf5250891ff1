"""A gradient left unreduced over ``data`` for one leaf, under a global-norm clip, on a data x model mesh (issue
#36, trial 12): every replicated leaf's copies part (each device clips by its own global norm), but only that
leaf's gradient was not reduced; ``wrong_axis_reduction`` and the replicas row name it as the unreduced one and
the others as having gradients within tolerance (their copies differ downstream of it, or by an unreduced gradient
too small to show: trial 14). A step that reduces no gradient still names every leaf, and where
the gradients are not observed the message is the one it was.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck._tree import path_str
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.topology import missed_axes_message, replicas_by_gradient
from shardcheck.steps import Candidate
from shardcheck.steps._core import params_value_and_grad

MESH = {"data": 2, "model": 2}
LEAVES = ("param a.bias", "param a.kernel", "param b.bias", "param b.kernel")


class _Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _loss(model, batch):
    err = model(batch["x"])[:, 0] - batch["y"]
    return jnp.sum(err**2), jnp.asarray(err.size, jnp.float32)


@functools.cache
def _task() -> Task:
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8,)).astype(np.float32)}
    # a clip that binds (the gradient's global norm is far above 1e-3): every update reads every gradient
    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))
    return Task(model=lambda: _Tiny(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=[batch], name="tiny")


def _step(unreduced) -> Candidate:
    """A data-parallel shard_map step whose gradients of the leaves ``unreduced(path)`` picks are not psum-ed
    over ``data`` (each device keeps its own shard's share); ``check_vma=False`` calls them replicated."""
    mesh = make_mesh(MESH)

    def step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, batch):
            total, weight, grads = params_value_and_grad(_loss, graphdef, params, rest, batch)
            weight = jax.lax.psum(weight, "data")
            grads = jax.tree_util.tree_map_with_path(
                lambda p, g: (g if unreduced(path_str(p)) else jax.lax.psum(g, "data")) / weight, grads
            )
            return jax.lax.psum(total, "data") / weight, grads

        loss, grads = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
        )(params, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return Candidate("unreduced", nnx.jit(step), num_shards=2)


def _check(unreduced):
    return check_parity(_step(unreduced), _task(), mesh=make_mesh(MESH))


def _finding(report):
    return next(d.message for d in report.diagnoses if d.code == "wrong_axis_reduction")


@require_devices(4)
def test_one_unreduced_gradient_under_a_global_norm_clip_names_that_leaf_and_the_others_downstream():
    report = _check(lambda p: p == "a.kernel")
    assert report.codes[:2] == ("wrong_axis_reduction", "replicas_differ"), report.codes
    grads = {e.path: e.ok for r in report.steps[:1] for e in r.leaves if e.kind == "grad"}
    assert grads == {"a.bias": True, "a.kernel": False, "b.bias": True, "b.kernel": True}
    message = _finding(report)
    assert message.startswith(
        "After step 0 the copies of param a.kernel differ along mesh axis 'data' and agree along 'model': the "
        "gradient of a.kernel was not reduced over 'data'"
    )
    assert (
        "The other 3 leaves whose copies differ have gradients within tolerance of the reference's" in message
    )
    assert (
        "their copies differ across 'data' downstream of it, through an update that reads every gradient"
        in message
    )
    assert message.endswith(
        "Not reduced: grad a.kernel; leaves whose copies differ with their parameter's gradient within "
        "tolerance, nearest its tolerance first: param b.kernel, param a.bias, param b.bias."
    )
    assert "Affected:" not in message
    # the replicas row and the localization's replicas stage name the unreduced leaf, the others downstream
    failure = report.replica_failure
    assert (failure.leaf, failure.leaves, failure.axes) == ("param a.kernel", 4, ("data",))
    assert failure.downstream == (
        "1 of them is the value of the parameter whose gradient differs; the other 3 have gradients within "
        "tolerance: their copies differ downstream of it through the task's optimizer's global-norm clip "
        "(optax.clip_by_global_norm(0.001)), where it binds: each device computes its coefficient from its own "
        "copies of every gradient, it among them, so every leaf's update is scaled by another coefficient on "
        "each device"
    )
    assert report.to_dict()["replica_failure"]["downstream"] == failure.downstream
    replicas = next(s for s in report.localization.stages if s.stage == "replicas")
    assert replicas.note == f"4 leaves along 'data', e.g. param a.kernel; {failure.downstream}"


@require_devices(4)
def test_a_step_that_reduces_no_gradient_names_every_leaf_and_a_correct_one_passes():
    report = _check(lambda p: True)
    assert report.codes[0] == "wrong_axis_reduction", report.codes
    assert all(not e.ok for e in report.steps[0].leaves if e.kind == "grad")
    message = _finding(report)
    assert ": the gradients were not reduced over 'data' (reduced over 'model' only" in message
    assert message.endswith(f"Affected: {', '.join(LEAVES)}.") and "downstream" not in message
    failure = report.replica_failure
    assert (failure.leaves, failure.downstream) == (4, "")
    # the other side: every gradient reduced, the same clip: PASS, no replica differs
    right = _check(lambda p: False)
    assert right.ok and right.replica_failure is None, right.diagnosis


def _record(grads: dict[str, bool]) -> StepRecord:
    leaves = tuple(LeafError(0, "grad", p, 0.0 if ok else 1.0, 0.0, 1e-6, ok) for p, ok in grads.items())
    return StepRecord(
        0, 1e-5, 1e-6, 1.0, 1.0, leaves, 1, 1, replica_mismatches=LEAVES, replica_axes=("data",)
    )


def test_the_split_reads_the_gradients_where_observed_and_keeps_the_wording_where_not():
    seen = _record({"a.bias": True, "a.kernel": False, "b.bias": True, "b.kernel": True})
    assert replicas_by_gradient(seen) == (
        ["a.kernel"],
        ["param a.kernel"],
        ["param a.bias", "param b.bias", "param b.kernel"],
    )
    # no gradient compared (a step that returns none): no leaf is named unreduced, the message is as it was
    unseen = _record({})
    assert replicas_by_gradient(unseen) == ([], [], list(LEAVES))
    plain = missed_axes_message(0, LEAVES, ("data",), MESH)
    assert plain == missed_axes_message(0, LEAVES, ("data",), MESH, unreduced=())
    assert plain.endswith(f"Affected: {', '.join(LEAVES)}.") and "downstream" not in plain
    # every leaf's own gradient failing: every leaf named, nothing downstream
    every = missed_axes_message(
        0, LEAVES, ("data",), MESH, unreduced=("a.bias", "a.kernel", "b.bias", "b.kernel")
    )
    assert every == plain
    split = missed_axes_message(
        0, ["param a.kernel", *LEAVES[:1], *LEAVES[2:]], ("data",), MESH, unreduced=["a.kernel"]
    )
    assert "the gradient of a.kernel was not reduced over 'data'" in split and "Affected:" not in split
    two = missed_axes_message(0, LEAVES, ("data",), MESH, unreduced=["a.bias", "a.kernel"])
    assert "the gradients of a.bias, a.kernel were not reduced over 'data'" in two
    assert "downstream of those" in two and two.endswith(
        "Not reduced: grad a.bias, grad a.kernel; leaves whose copies differ with their parameter's gradient "
        "within tolerance, nearest its tolerance first: param b.bias, param b.kernel."
    )


def test_after_the_gradients_the_message_blames_no_gradient():
    # the loss and every gradient matched: the copies parted after them, whatever unreduced says
    message = missed_axes_message(0, LEAVES, ("model",), MESH, True, unreduced=("a.kernel",))
    assert "the copies parted after the gradients" in message and message.endswith(
        f"Affected: {', '.join(LEAVES)}."
    )


def test_a_loss_that_differs_beside_unreduced_copies_names_the_reduction_before_the_mask():
    """Trial 58 C3: after ``wrong_axis_reduction``, the ``forward_differs`` paragraph put "a mask ..." first and
    the reduction last; it now names the reduction first (mend it first), the loss's inputs after. Without copies
    that differ, the inputs are said alone."""
    from shardcheck.parity.diagnosis.rules import _forward_sentence

    leaves = (LeafError(0, "loss", "loss", 1.0, 0.0, 1e-6, False),)
    parted = StepRecord(
        0, 1e-5, 1e-6, 1.0, 1.0, leaves, 1, 1, replica_mismatches=LEAVES, batch_keys=("mask",)
    )
    said = _forward_sentence(parted)
    first = said.index("first the loss and its gradients reduced another way across the shards")
    assert first < said.index("a mask (e.g. attention") and "the reduction named above; mend it first" in said
    alone = _forward_sentence(dataclasses.replace(parted, replica_mismatches=()))
    assert "reduced another way across the shards" not in alone
    assert "computed another way at equal parameters: a mask (e.g. attention" in alone
    assert alone.endswith(
        "the batch holds 'mask' beside its inputs and labels: check how the step's loss reads each."
    )
