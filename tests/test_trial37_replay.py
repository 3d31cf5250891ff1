"""Trial 37 (issue #36): a model keeps a mean-teacher EMA of its parameters in a Variable of its own, and the
user's ``jax.shard_map`` step (data=2 here) writes it after SGD with Nesterov momentum.

- A step that writes the EMA on device 0 only (``check_vma=False``: the other devices keep stale copies) FAILed
  live (``replicas_differ``) while its replay against a correct recording printed "PASS (bitwise identical)":
  a digest hashes one copy of each slice. A recording (and so a replay) now compares each step's replicated
  copies across the devices, and the replay FAILs with ``replicas_differ`` as the live check does.
- The replay's evidence said "the digests of 66 leaves" beside "Parity holds: 50 leaves" (16 EMA leaves not
  compared): it now says how many were recorded and how many compared.
- A replay of an SGD recording with Adam said only "leaf 'opt_state 0.trace...' is recorded but not in this run":
  it now says what each optimizer keeps and that the optimizer differs.
- ``measure_memory`` of the step named only the parameters whose placement differs from the estimate's layout
  (336 B of a 5664 B gap): it now names the optimizer state and the model's other state too, with their bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.parity.harness.recorded import optimizer_difference, record_run

DECAY = 0.9


class EMA(nnx.Variable):
    """The mean teacher: a moving average of a parameter (no Param: the optimizer leaves it alone)."""


class Net(nnx.Module):
    """Two dense layers (``din -> hidden -> 3``) and the EMA of each parameter."""

    def __init__(self, din: int = 4, hidden: int = 8):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, 3, rngs=rngs)
        self.ema = nnx.List([EMA(jnp.array(p)) for p in jax.tree.leaves(nnx.state(self, nnx.Param))])

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def loss_fn(model, batch):
    """``(sum of squared errors, rows)``: the sum and the weight, so that a sharded step can psum both."""
    return jnp.sum((model(batch["x"]) - batch["y"]) ** 2), jnp.float32(batch["x"].shape[0])


def _task(optimizer=None, din: int = 4, hidden: int = 8) -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(8, din)).astype(np.float32),
            "y": rng.normal(size=(8, 3)).astype(np.float32),
        }
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: Net(din, hidden),
        optimizer=optimizer or optax.sgd(0.05, momentum=0.9, nesterov=True),
        loss_fn=loss_fn,
        batches=batches,
        name="trial37",
    )


def _update_ema(model) -> None:
    for e, p in zip(model.ema, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
        e[...] = DECAY * e[...] + (1 - DECAY) * p[...]


def _step(on_first_device_only: bool = False):
    """The user's shard_map step: the gradient's sum and the rows psum-ed over ``data``, the optimizer's update,
    then the EMA; ``on_first_device_only`` writes the EMA on device 0 only (the others keep their stale copies),
    under ``check_vma=False``, which lets ``out_specs=P()`` say replicated."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)

        def body(leaves, batch):
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            gdef, params, rest = nnx.split(model, nnx.Param, ...)
            params = jax.lax.pcast(params, "data", to="varying")
            (s, w), g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(gdef, p, rest), batch), has_aux=True)(
                params
            )
            w = jax.lax.psum(w, "data")
            g = jax.tree.map(lambda x: jax.lax.psum(x, "data") / w, g)
            optimizer.update(model, g)
            old = [e[...] for e in model.ema]
            _update_ema(model)
            if on_first_device_only:
                first = jax.lax.axis_index("data") == 0
                for e, o in zip(model.ema, old, strict=True):
                    e[...] = jnp.where(first, e[...], o)
            return jax.lax.psum(s, "data") / w, g, jax.tree.leaves(nnx.state((model, optimizer)))

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=(P(), P(), P()),
            check_vma=not on_first_device_only,
        )
        loss, grads, leaves = jax.jit(mapped)(leaves, batch)
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


@pytest.fixture(scope="module")
def recording(mesh):
    """The correct step's recording (SGD with Nesterov momentum), as ``shardcheck record`` keeps it."""
    return record_run(_task(), _step(), mesh=mesh)


@require_devices(2)
def test_a_replay_compares_the_replicas_and_fails_an_ema_written_on_one_device_as_live(mesh, recording):
    assert [r["leaves"] for r in recording.meta["replicas"]] == [[], []]
    right = check_parity(_step(), _task(), mesh=mesh, reference=recording)
    assert right.ok and right.replay.bitwise and right.replay.replicas_compared
    assert right.replica_failure is None
    assert (
        "every replicated leaf's copies in the replay agreed across the devices after each step): every hash "
        in right.replay.evidence
    )
    assert not any("the replicas' agreement was not compared" in n for n in right.replay.notes)

    fault = _step(on_first_device_only=True)
    replayed = check_parity(fault, _task(), mesh=mesh, reference=recording)
    live = check_parity(fault, _task(), mesh=mesh)
    for report in (replayed, live):
        assert not report.ok and report.codes[:1] == ("replicas_differ",), report.codes
        assert report.localization.step == 0 and report.localization.stage == "replicas"
        failure = report.replica_failure
        assert (failure.step, failure.leaf, failure.leaves) == (0, "state model.ema.0", 4)
        assert all(e.ok for r in report.steps for e in r.leaves)  # each device 0 copy is right
    assert replayed.diagnoses[0].message == live.diagnoses[0].message
    # the hashes of device 0's copies all match; the replay says it is not bitwise identical, and why
    r = replayed.replay
    assert r.hashes_matched == r.hashes_compared > 0 and not r.bitwise and not r.ok
    assert r.evidence.endswith(
        "each hashes one device's copy of each slice), but the replay's copies of 4 leaves differ across devices "
        "after step 0 (e.g. state model.ema.0): not bitwise identical"
    )
    assert "bitwise identical)" not in str(replayed)


@require_devices(2)
def test_a_correct_step_replayed_against_a_recording_whose_copies_differed_is_not_called_bitwise(mesh):
    """The fault recorded, the correct step replayed: device 0's copies hash alike, the verdict is the digests'
    (PASS), and neither run is said bitwise identical to the other; a note says the recording is of a faulty step."""
    faulty = record_run(_task(), _step(on_first_device_only=True), mesh=mesh)
    assert [r["leaves"] for r in faulty.meta["replicas"]][0] == [f"state model.ema.{i}" for i in range(4)]
    report = check_parity(_step(), _task(), mesh=mesh, reference=faulty)
    r = report.replay
    assert report.ok and r.hashes_matched == r.hashes_compared > 0 and not r.bitwise
    assert r.evidence.endswith("but the recorded run's copies did not (below): not bitwise identical")
    assert (
        "The recorded run's own copies of 4 leaves differed across its devices after step 0 (e.g. state "
        "model.ema.0): it was recorded from a faulty step; record the correct step again."
    ) in r.notes


@require_devices(2)
def test_a_replay_counts_the_leaves_it_compared_beside_those_it_recorded(mesh, recording):
    """18 leaves recorded (loss, 4 gradients, 4 parameters, 4 momenta, the step counter, 4 EMA leaves); the EMA,
    which the task's loss neither reads nor writes, is not compared: 14, as the verdict counts them."""
    right = check_parity(_step(), _task(), mesh=mesh, reference=recording)
    assert len(recording.names) == 18
    assert right.replay.evidence.startswith(
        "evidence: the digests of 18 leaves recorded, 14 compared (4 model-state leaves not compared, e.g. state "
        "model.ema.0: the task's loss does not read them, as a live check leaves them) at 2 step(s)"
    )
    assert right.diagnoses[0].message.startswith("Parity holds: 14 leaves over 2 step(s)")


@require_devices(2)
def test_a_replay_under_another_optimizer_says_what_each_optimizer_keeps(mesh, recording):
    with pytest.raises(ValueError) as caught:
        check_parity(_step(), _task(optax.adam(1e-2)), mesh=mesh, reference=recording)
    assert str(caught.value) == (
        "check_parity: the recording records another optimizer state: the recording's optimizer keeps 0.trace "
        "(momentum, 4 leaves), this run's keeps 0.count (step count, 1 leaf), 0.mu (first moment, 4 leaves) and "
        "0.nu (second moment, 4 leaves): another optimizer or another optax chain than the recorded run's (the "
        "4 parameters alike); replay with the recorded run's optimizer (the same transformation and optax chain), "
        "or record this task again with this one"
    )


def test_another_model_is_no_optimizer_difference():
    """The optimizer is named only where the parameters are alike: another model keeps the generic refusal."""
    was = [
        ["param w", [4], "float32"],
        ["opt_state 0.trace.w", [4], "float32"],
        ["counter step", [], "int32"],
    ]
    adam = [
        ["param w", [4], "float32"],
        ["opt_state 0.mu.w", [4], "float32"],
        ["opt_state 0.nu.w", [4], "float32"],
    ]
    assert optimizer_difference(was, adam + [["counter step", [], "int32"]]).startswith(
        "the recording's optimizer keeps 0.trace (momentum, 1 leaf), this run's keeps 0.mu (first moment, 1 leaf) "
        "and 0.nu (second moment, 1 leaf)"
    )
    other = [["param w", [5], "float32"], ["opt_state 0.mu.w", [5], "float32"]]
    assert optimizer_difference(was, other) is None
    assert optimizer_difference(was, was) is None


@require_devices(2)
def test_measure_memory_names_the_model_state_and_optimizer_state_placed_otherwise(mesh):
    """The step replicates every leaf. Even widths: the estimate splits the biases, their momenta and the EMA
    over data=2, and the named leaves account for the whole gap. Odd widths, which no rule splits over 2
    devices: the step places them as the estimate does, and nothing is named."""
    m = shardcheck.measure_memory(_step(), _task(din=4, hidden=8), mesh)
    named = {d.split(":")[0] for d in m.placement_differs}
    assert {"optimizer state 0.trace.l1.bias", "model state ema.0"} <= named, m.placement_differs
    assert m.placement_bytes == m.state_bytes - m.estimated_persistent_bytes > 0
    kinds = [d.split(" ", 2)[:2] for d in m.placement_differs]
    assert ["model", "state"] in kinds and ["optimizer", "state"] in kinds
    assert m.placement_note.endswith(
        f"of the {m.placement_bytes} B between the live state ({m.state_bytes} B) and the estimate "
        f"({m.estimated_persistent_bytes} B)"
    )
    odd = shardcheck.measure_memory(_step(), _task(din=3, hidden=5), mesh)
    assert odd.placement_differs == () and odd.placement_bytes == 0 and odd.placement_note == ""
    assert odd.state_bytes == odd.estimated_persistent_bytes
