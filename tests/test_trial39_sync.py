"""Trial 39's open findings (a double DQN whose step syncs a target network every 2 steps on an int step counter
held in an ``nnx.Variable``, optax clip + adam, a ``jax.shard_map`` step on data=4), each rule checked on both
sides on a tiny model of the same shape: target copies of both kernels synced every 2 steps, 4 steps on data=2.

1. without a reference (the task's step never syncs) the correct step led with "a weight meant to stay frozen was
   trained": a copy of a parameter's shape that the step writes at some steps only, beside a counter only it
   keeps, is a target network's sync (``target_sync``), which only the user's own reference step checks.
2. the counter only the step writes, through a replay (``record``, then ``verify --against``): the correct step
   PASSes bitwise, the counter compared exactly and equal; a counter advanced twice a step FAILs on it.
3. a target written as the psum of its replicas (x2 on data=2) read "by 2 to ... times the reference's change ...
   a running-average momentum": it is said as the factor, the size of 'data'.
4. ``optax.clip_by_global_norm`` applied to each shard's gradient before the pmean: "no simple form", clipping
   never named; the harness now reruns that hypothesis (``clip_per_shard``).
5. a loss-only step psum-ing its loss and gradients under a binding clip read a clipped loss term (which keeps no
   exact factor) beside the clip hiding the gradients' scale: only the latter is said.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_trial39_target import QNet, loss_fn  # the Q-net, its target copies and TD loss

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.hypotheses import clip_norm_of
from shardcheck.parity.harness.recorded import record_run

K = 2  # the target's sync period


def sync(model, fault: str = "") -> None:
    """Count the step; every K-th copy the online kernels into the target. ``"count_twice"``: the count advances
    by 2 (a sync at every step); ``"target_psum"``: the copy is the psum of the replicas; ``"train_target"``: the
    target moves at every step (a frozen weight trained)."""
    model.steps[...] = model.steps[...] + (2 if fault == "count_twice" else 1)
    do = model.steps[...] % K == 0
    for t, online in ((model.t1, model.l1.kernel), (model.t2, model.l2.kernel)):
        value = jax.lax.psum(online[...], "data") if fault == "target_psum" else online[...]
        if fault == "train_target":
            t[...] = t[...] - 0.01 * jnp.sign(t[...])
        else:
            t[...] = jnp.where(do, value, t[...])


_rng = np.random.default_rng(0)
# a large first reward (the gradient's norm 2.95, clipped by 1.5) then small ones (1.26 at step 1: not clipped,
# while twice it is): a clip that binds on both sides at step 0 only
BATCHES = [
    {
        "x": _rng.normal(size=(16, 6)).astype(np.float32),
        "x2": _rng.normal(size=(16, 6)).astype(np.float32),
        "r": (scale * _rng.normal(size=(16,))).astype(np.float32),
    }
    for scale in (3.0, 0.3, 0.3, 0.3)
]
CLIP = 1.5


def _task(clip: float | None = None) -> shardcheck.Task:
    tx = optax.adam(1e-2) if clip is None else optax.chain(optax.clip_by_global_norm(clip), optax.adam(1e-2))
    return shardcheck.Task(model=lambda: QNet(nnx.Rngs(0)), optimizer=tx, loss_fn=loss_fn, batches=BATCHES)


@nnx.jit
def ref_step(model, optimizer, batch):
    """The user's single-device reference: the task's step, then the sync."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    sync(model)
    return {"loss": loss, "grads": grads}


def make_step(fault: str = "", clip: float | None = None, loss_only: bool = False):
    """The user's data-parallel step: a shard_map over 'data', the gradients pmean-ed (``"psum"``: psum-ed, the
    loss too; ``"clip_per_shard"``: each shard's gradient clipped to ``clip`` first), then the sync."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))

        def body(state, batch):
            m, o = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(m, batch)
            if fault == "clip_per_shard":
                grads, _ = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())
            reduce = jax.lax.psum if fault == "psum" else jax.lax.pmean
            grads, loss = reduce(grads, "data"), reduce(loss, "data")
            o.update(m, grads)
            sync(m, fault)
            return loss, grads, nnx.state((m, o))

        specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        loss, grads, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
        nnx.update((model, optimizer), state)
        return loss if loss_only else {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


# ------------------------------------------------------------------- 1. a sync the task's reference never makes


@require_devices(2)
def test_without_a_reference_a_copy_synced_on_a_counter_reads_as_a_target_sync(mesh):
    """The task's own reference (no sync): the correct step FAILs (the copies are written where the reference
    leaves them) and leads with ``target_sync`` (was ``frozen_state``, "A weight meant to stay frozen was
    trained"): written at steps 1 and 3, left at 0 and 2, beside the counter; says the reference does not write
    them and that the user's reference checks them. A target moved at every step is still a frozen weight
    trained."""
    task = _task()
    report = check_parity(make_step(), task, mesh=mesh)
    assert not report.ok and report.codes[0] == "target_sync", report.codes
    assert "frozen_state" not in report.codes
    msg = report.diagnoses[0].message
    assert msg.startswith(
        "The candidate's step wrote the model's state t1 and t2 at steps 1 and 3 (max abs err "
    )
    assert (
        "and left them as they were at steps 0 and 2, on the schedule of a counter only it keeps (model.steps, not "
        "compared), from values of a parameter's shape: a target network's copy synced from the parameters. The "
        "reference's step does not write them (it makes no sync)" in msg
    )
    assert "pass your own reference step that makes the sync (verify --reference FILE:FUNCTION" in msg
    assert not msg.startswith("A weight meant to stay frozen")
    form = report.localization.form.sentence
    assert form.startswith("a copy on a counter's schedule:") and "a weight meant to stay frozen" not in form
    assert "wrote them at steps 1 and 3 and left them at steps 0 and 2" in form
    # with the user's reference the same step PASSes
    assert check_parity(make_step(), task, mesh=mesh, reference=ref_step).ok
    # the other side: moved at every step, no schedule: a frozen weight trained
    trained = check_parity(make_step("train_target"), task, mesh=mesh)
    assert trained.codes[0] == "frozen_state" and "target_sync" not in trained.codes
    assert "A weight meant to stay frozen was trained" in trained.diagnoses[0].message


# ------------------------------------------------------------------- 2. the counter through a replay


@require_devices(2)
def test_a_replay_of_the_step_with_its_own_counter_passes_and_a_double_count_fails(mesh):
    """``record`` the correct step, replay it: PASS (the counter compared exactly, equal at every step, never
    blamed); a count advanced twice a step (a sync at every step) FAILs on ``counter model.steps`` at step 0."""
    task = _task()
    recording = record_run(task, make_step(), mesh=mesh)
    right = check_parity(make_step(), task, mesh=mesh, reference=recording)
    assert right.ok and right.codes == ("parity",), right.codes
    counters = [e for r in right.steps for e in r.leaves if e.path == "model.steps"]
    assert len(counters) == 4 and all(e.ok and e.max_abs_err == 0 for e in counters)
    bad = check_parity(make_step("count_twice"), task, mesh=mesh, reference=recording)
    assert not bad.ok and bad.localization.step == 0
    first = next(e for e in bad.steps[0].leaves if e.path == "model.steps")
    assert not first.ok and first.max_abs_err == 1 and first.tolerance == 0


# ------------------------------------------------------------------- 3. a target written x the device count


@require_devices(2)
def test_a_target_written_as_the_psum_of_its_replicas_is_said_as_the_axis_size(mesh):
    """The user's reference: the copy written as the psum of its 2 replicas FAILs at step 1 as exactly x2 = the
    size of 'data' (was "by 2 to ... times the reference's change ... a running-average momentum"), in the
    finding and the Form; a copy written otherwise (moved at every step) is never said as a factor."""
    task = _task()
    report = check_parity(make_step("target_psum"), task, mesh=mesh, reference=ref_step)
    assert not report.ok and report.codes[0] == "state_amount", report.codes
    msg = report.diagnoses[0].message
    assert (
        "The candidate's step wrote the model's state t1 and t2 at step 1 as exactly 2 times the value the "
        "reference's step wrote, at every element (written x2 = the size of 'data'): a psum where a pmean or no "
        "reduction was meant" in msg
    )
    assert "running-average momentum" not in msg
    form = report.localization.form.sentence
    assert form.startswith("written x2:") and "x2 = S, the shard count: a psum" in form
    other = check_parity(make_step("train_target"), task, mesh=mesh, reference=ref_step)
    assert not other.ok and "written x" not in str(other)


# ------------------------------------------------------------------- 4. a clip applied per shard


def test_the_clip_norm_is_read_from_the_optimizer():
    """Unit: the norm of an ``optax.clip_by_global_norm`` chained or alone; ``None`` without one."""
    assert clip_norm_of(optax.chain(optax.clip_by_global_norm(2.5), optax.adam(1e-3))) == 2.5
    assert clip_norm_of(optax.clip_by_global_norm(0.5)) == 0.5
    assert clip_norm_of(optax.adam(1e-3)) is None
    assert clip_norm_of(optax.chain(optax.clip(1.0), optax.sgd(0.1))) is None


@require_devices(2)
def test_a_clip_applied_to_each_shards_gradient_is_named(mesh):
    """Each shard's gradient clipped to the task's norm (0.5) before the pmean: FAILs at step 0 as
    ``clip_per_shard`` (was ``localized``, "no simple form", no clip named); the same clip left to the task's
    optimizer PASSes; gradients psum-ed (no clip per shard) are not said so."""
    task = _task(clip=0.5)
    report = check_parity(make_step("clip_per_shard", clip=0.5), task, mesh=mesh, reference=ref_step)
    assert not report.ok and report.codes[0] == "clip_per_shard", report.codes
    assert "localized" not in report.codes
    msg = report.diagnoses[0].message
    assert msg.startswith("At step 0 the gradients differ (")
    assert "a clip applied per shard (before the all-reduce)" in msg
    assert (
        report.localization.form.kind == "none"
    )  # trial 53: "no simple form" below the finding that names it
    (where,) = [text for tag, text in report.findings if tag == "localization"]
    assert "Form: no simple form that the fit reads ([clip_per_shard] names it): no zero update" in where
    assert report.diagnosis_lines[0].startswith("[clip_per_shard] At step 0 the gradients differ")
    assert check_parity(make_step(), task, mesh=mesh, reference=ref_step).ok
    summed = check_parity(make_step("psum"), task, mesh=mesh, reference=ref_step)
    assert not summed.ok and "clip_per_shard" not in summed.codes


# ------------------------------------------------------------------- 5. a loss-only step under a binding clip


@require_devices(2)
def test_a_loss_only_step_under_a_binding_clip_reads_only_what_its_records_allow(mesh):
    """Loss and gradients psum-ed (x2), the step returning its loss only, the clip (1.5) binding on both sides at
    step 0 only: ``loss_differs`` names the x2 and the clip hiding the gradients' same factor until step 1, and
    no clipped loss term (an exact factor contradicts it); the correct loss-only step PASSes."""
    task = _task(clip=CLIP)
    report = check_parity(make_step("psum", loss_only=True), task, mesh=mesh, reference=ref_step)
    assert not report.ok and report.codes[0] == "loss_differs", report.codes
    msg = report.diagnoses[0].message
    assert "It is 2 x the reference's: the loss reduction summed instead of averaged (x2" in msg
    assert "At step 1 the update differs too" in msg
    assert "gradients off by the same factor (x2) give this step's update too" in msg
    assert "clipped or thresholded term" not in msg and "PPO" not in msg
    assert check_parity(make_step(loss_only=True), task, mesh=mesh, reference=ref_step).ok
