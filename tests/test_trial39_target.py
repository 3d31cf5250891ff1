"""Trial 39 (a double-DQN Q-network with a target network held as weight copies in ``class
TargetParam(nnx.Variable)`` and a step counter ``class StepCount(nnx.Variable)``, synced from the online weights
every K=2 steps by the train step after the optimizer's update; a ``jax.shard_map`` step on data=4). Each rule
checked on both sides, on a tiny model of the same shape: a target copy of both kernels synced every 2 steps, an
int32 step counter, 4 steps on data=2.

1. a correct step was "PASS (per step)" (``diverged_trajectory``): the copy synced at step 1 differs by the
   parameters' own rounding (accepted by the coarse both-steps-write rule) and at step 2, where neither step writes
   it, was compared exactly on its value: the carried rounding failed it.
2. without a reference (the task's step never writes the counter) the correct step FAILed ``model_state`` on the
   step counter, "an nnx.Variable its forward pass writes": the loss never touches it. A counter only the step
   writes is not compared (said in the PASS note); a step run from the reference's state keeps the candidate's
   own count, so the sync the task's reference never makes is still seen at step 1.
3. with a reference writing the target at steps 1 and 3, a sync at every step read ``frozen_state`` ("A weight
   meant to stay frozen was trained ... Update nnx.Param only"): nothing was trained, the copy was written at a
   step where the reference's step leaves it (``state_step``); a weight the reference never changes keeps
   ``frozen_state``.
4. at bfloat16 compute a user reference's gradients had no measured tolerance (float32's: "grad l2.bias 0.000389
   > tolerance 2.74e-06", a correct step FAILed ``localized``): they are measured as the task's step's are, about
   its gradients or, where it returns its loss only, the task's loss's gradient at its pre-step state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.parity.comparison.model_state import floating_state, model_state_leaves

K = 2  # the target's sync period
# sizes whose data=2 batch sums round apart from the single device's: the carried difference of rule 1
HID, ROWS = 16, 16


class Target(nnx.Variable):
    """A frozen copy of an online kernel: the target network's."""


class Count(nnx.Variable):
    """Train steps taken, for the target's sync."""


class QNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
        self.l1 = nnx.Linear(6, HID, dtype=dtype, rngs=rngs)
        self.l2 = nnx.Linear(HID, 2, dtype=dtype, rngs=rngs)
        self.t1 = Target(self.l1.kernel[...])
        self.t2 = Target(self.l2.kernel[...])
        self.steps = Count(jnp.array(0, jnp.int32))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))

    def target(self, x):
        return nnx.relu(x @ self.t1[...] + self.l1.bias[...]) @ self.t2[...]


def loss_fn(model, batch):
    """A TD loss: the online net's value against a bootstrap from the target copies (never differentiated)."""
    y = batch["r"] + 0.9 * jax.lax.stop_gradient(model.target(batch["x2"]).max(-1))
    return jnp.mean((model(batch["x"])[:, 0].astype(jnp.float32) - y) ** 2)


def sync(model, fault: str = "") -> None:
    """Count the step; every K-th (every one for ``fault="every"``, never for ``"count_only"``) copy the online
    kernels into the target."""
    model.steps[...] = model.steps[...] + 1
    if fault == "count_only":
        return
    do = jnp.array(True) if fault == "every" else model.steps[...] % K == 0
    model.t1[...] = jnp.where(do, model.l1.kernel[...], model.t1[...])
    model.t2[...] = jnp.where(do, model.l2.kernel[...], model.t2[...])


_rng = np.random.default_rng(0)
BATCHES = [
    {
        "x": _rng.normal(size=(ROWS, 6)).astype(np.float32),
        "x2": _rng.normal(size=(ROWS, 6)).astype(np.float32),
        "r": _rng.normal(size=(ROWS,)).astype(np.float32),
    }
    for _ in range(4)
]
TASK = shardcheck.Task(
    model=lambda: QNet(nnx.Rngs(0)), optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=BATCHES
)


@nnx.jit
def ref_step(model, optimizer, batch):
    """The user's single-device reference: the task's step, then the sync."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    sync(model)
    return {"loss": loss, "grads": grads}


def make_step(fault: str = ""):
    """The user's data-parallel step: a shard_map over 'data', the gradients pmean-ed, then the sync."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))

        def body(state, batch):
            m, o = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(m, batch)
            reduce = jax.lax.psum if fault == "psum" else jax.lax.pmean  # psum: every gradient x2 on data=2
            grads, loss = reduce(grads, "data"), jax.lax.pmean(loss, "data")
            o.update(m, grads)
            sync(m, fault)
            return loss, grads, nnx.state((m, o))

        specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        loss, grads, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
        nnx.update((model, optimizer), state)
        return {"loss": loss, "grads": grads}

    return step


def _run(step, mesh=None, steps=2) -> QNet:
    model = TASK.model()
    optimizer = nnx.Optimizer(model, TASK.optimizer, wrt=nnx.Param)
    for batch in BATCHES[:steps]:
        if mesh is None:
            step(model, optimizer, batch)
        else:
            step(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))), mesh)
    return model


# ------------------------------------------------------------------- 1. state neither step writes at a step


class _Held(nnx.Module):
    def __init__(self, value):
        self.t = Target(jnp.asarray(value, jnp.float32))


def test_state_neither_step_writes_is_judged_on_its_change_not_on_a_carried_difference():
    """Unit: a copy that differs by a rounding an earlier step accepted (2.33e-10), left as it was by both steps,
    matches (error 0); a candidate that writes it where the reference does not still FAILs exactly, on its
    change."""
    ref_value = np.linspace(-0.002, 0.002, 8, dtype=np.float32)
    carried = ref_value.copy()
    carried[0] = np.nextafter(ref_value[0], np.float32(1))  # one ulp: 2.33e-10 at 0.002
    assert 2e-10 < abs(float(carried[0]) - float(ref_value[0])) < 3e-10
    ref, cand = _Held(ref_value), _Held(carried)
    before, cand_before = floating_state(ref), floating_state(cand)
    (leaf,) = model_state_leaves(2, ref, cand, None, before, cand_before, read=frozenset({"t"}))
    assert leaf.ok and leaf.max_abs_err == 0 and leaf.tolerance == 0 and leaf.reference_change == 0
    cand.t[...] = cand.t[...] + 0.01  # the candidate's step writes it, the reference's does not
    (leaf,) = model_state_leaves(2, ref, cand, None, before, cand_before, read=frozenset({"t"}))
    assert not leaf.ok and leaf.tolerance == 0 and leaf.reference_change == 0
    assert abs(leaf.max_abs_err - 0.01) < 1e-6


@require_devices(2)
def test_a_correct_step_with_a_target_synced_every_2_steps_passes_plainly():
    """Live, data=2, 4 steps, the user's reference writing the target: the copy synced at step 1 differs by the
    parameters' rounding, and the correct step is a plain PASS (was "PASS (per step)", ``diverged_trajectory``:
    "state model.t1 step 2 tol 0 FAIL"); syncing at every step FAILs at step 0."""
    mesh = make_mesh({"data": 2})
    ref, cand = _run(ref_step), _run(make_step(), mesh)
    carried = float(jnp.max(jnp.abs(ref.t1[...] - cand.t1[...])))
    assert 0 < carried < 1e-6  # the precondition: a rounding-level difference carried into step 2
    report = check_parity(make_step(), TASK, mesh=mesh, reference=ref_step)
    assert report.ok and report.codes == ("parity",)
    assert report.diverged_at is None
    bad = check_parity(make_step("every"), TASK, mesh=mesh, reference=ref_step)
    assert not bad.ok
    first = next(e for e in bad.steps[0].leaves if e.path == "model.t1")
    assert not first.ok and first.step == 0 and first.max_abs_err > 1e-3


# ------------------------------------------------------------------- 2. a counter only the candidate's step keeps


def test_a_counter_the_loss_never_touches_is_not_compared_one_it_touches_is():
    """Unit: a counter the reference's step left and the loss neither reads nor writes is not compared (tolerance
    inf, ok) where the candidate's differs; one the loss touches (a count its forward pass writes) is compared
    exactly; one the reference's step wrote is compared exactly."""

    class _Counted(nnx.Module):
        def __init__(self, n):
            self.steps = Count(jnp.array(n, jnp.int32))

    ref, cand = _Counted(0), _Counted(1)
    before = {"steps": np.array(0, np.int32)}
    (leaf,) = model_state_leaves(0, ref, cand, counters=(before, frozenset()))
    assert leaf.ok and leaf.tolerance == float("inf") and leaf.max_abs_err == 1
    (leaf,) = model_state_leaves(0, ref, cand, counters=(before, frozenset({"steps"})))
    assert not leaf.ok and leaf.tolerance == 0
    (leaf,) = model_state_leaves(0, ref, cand, counters=({"steps": np.array(-1, np.int32)}, frozenset()))
    assert not leaf.ok and leaf.tolerance == 0
    (leaf,) = model_state_leaves(0, ref, cand)  # no before: exact, as before
    assert not leaf.ok


@require_devices(2)
def test_without_a_reference_the_step_counter_is_not_compared_and_the_sync_is_still_seen():
    """Live, the task's own reference (never writes the counter nor the target): a step that only counts PASSes
    with the note; the correct step (it syncs at step 1, which the task's step never does) FAILs at step 1 on
    the target, never ``model_state`` on the counter (was "The model's state steps (not a parameter: an
    nnx.Variable its forward pass writes) differs ... after 1 step(s)"), and the re-check of step 1 from the
    reference's state keeps the candidate's count (2: the sync is made), so it is not read as a diverged
    trajectory."""
    mesh = make_mesh({"data": 2})
    counting = check_parity(make_step("count_only"), TASK, mesh=mesh)
    assert counting.ok and counting.codes == ("parity",)  # 22 leaves, the counter not counted
    note = counting.diagnoses[0].message
    assert "Parity holds: 21 leaves over 4 step(s) within tolerance." in note
    assert (
        "The model's counter model.steps is written by the candidate's step only and neither read nor written "
        "by the loss: not compared (the reference's step does not write it; to compare it, pass a reference "
        "step that writes it" in note
    )
    report = check_parity(make_step(), TASK, mesh=mesh)
    assert not report.ok and "model_state" not in report.codes and report.diverged_at is None
    assert report.codes[0] == "target_sync"  # a copy on the counter's schedule (tests/test_trial39_sync.py)
    counters = [e for r in report.steps for e in r.leaves if e.path == "model.steps"]
    assert len(counters) == 4 and all(e.ok and e.tolerance == float("inf") for e in counters)
    first = next(r for r in report.steps if not r.ok)
    assert first.step == 1 and first.synchronized
    assert {e.path for e in first.leaves if not e.ok} == {"model.t1", "model.t2"}


# ------------------------------------------------------------------- 3. a write at another step, not a training


@require_devices(2)
def test_a_sync_at_another_step_than_the_references_is_state_step_not_a_frozen_weight_trained():
    """Live, data=2, the user's reference syncing at steps 1 and 3: a sync at every step FAILs at step 0 as
    ``state_step`` (the finding and the Form name the reference's steps), never "A weight meant to stay frozen
    was trained"; without a reference (the task's step never writes the target) it reads ``target_sync``: a copy
    written at some steps beside the counter the candidate's step keeps alone (tests/test_trial39_sync.py)."""
    mesh = make_mesh({"data": 2})
    report = check_parity(make_step("every"), TASK, mesh=mesh, reference=ref_step)
    assert not report.ok and report.codes[0] == "state_step" and "frozen_state" not in report.codes
    msg = report.diagnoses[0].message
    assert msg.startswith("The candidate's step wrote the model's state t1 and t2 at step 0 (max abs err ")
    assert (
        "where the reference's step left them as they were (it writes them at steps 1 and 3): a copy or sync at "
        "another step than the reference's, not a weight trained" in msg
    )
    assert "frozen" not in msg and "nnx.Param" not in msg
    form = report.localization.form.sentence
    assert "writes them at steps 1 and 3" in form and "a copy or sync at another step" in form
    assert "meant to stay frozen" not in form
    # the other side: the task's reference never writes the target: a weight it leaves at every step
    alone = check_parity(make_step(), TASK, mesh=mesh)
    assert alone.codes[0] == "target_sync" and "frozen_state" not in alone.codes
    msg = alone.diagnoses[0].message
    assert "at steps 1 and 3" in msg and "The reference's step does not write them (it makes no sync)" in msg
    assert "a target network's sync" in alone.localization.form.sentence


# ------------------------------------------------------------------- 4. bfloat16 compute with a user reference

TASK_BF16 = shardcheck.Task(
    model=lambda: QNet(nnx.Rngs(0), jnp.bfloat16),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=BATCHES,
)


@require_devices(2)
def test_a_user_reference_at_bfloat16_compute_gets_measured_gradient_tolerances():
    """Live, data=2, the model computing in bfloat16, the user's reference: the correct step PASSes (its
    gradients' tolerance measured at the compute dtype, as the task's step's; was float32's, and the step FAILed
    ``localized``); gradients psum-ed in place of pmean-ed (x2) still FAIL at step 0."""
    mesh = make_mesh({"data": 2})
    kw = dict(mesh=mesh, reference=ref_step, compute_dtype=jnp.bfloat16)
    report = check_parity(make_step(), TASK_BF16, **kw)
    assert report.ok, report.codes
    grads = [e for e in report.steps[0].leaves if e.kind == "grad"]
    assert grads and max(e.tolerance for e in grads) > 1e-4  # bfloat16's rounding, not float32's ~1e-6
    bad = check_parity(make_step("psum"), TASK_BF16, **kw)
    assert not bad.ok and bad.localization.step == 0
    assert bad.codes[0] in ("summed", "scaled"), bad.codes


@require_devices(2)
def test_a_loss_only_user_reference_at_bfloat16_compute_is_held_to_the_measured_tolerances():
    """The user's reference returning its loss only: the tolerances are measured about the task's loss's gradient
    at the reference's pre-step state (was float32's: the correct step FAILed ``localized`` on Adam's moments);
    the x2 fault still FAILs at step 0."""

    def ref_loss_only(model, optimizer, batch):
        return ref_step(model, optimizer, batch)["loss"]

    mesh = make_mesh({"data": 2})
    kw = dict(mesh=mesh, reference=ref_loss_only, compute_dtype=jnp.bfloat16)
    report = check_parity(make_step(), TASK_BF16, **kw)
    assert report.ok and report.codes == ("parity",), report.codes
    bad = check_parity(make_step("psum"), TASK_BF16, **kw)
    assert not bad.ok and bad.localization.step == 0
