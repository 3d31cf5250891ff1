"""Trial 38 (issue #36): a step in JAX's explicit sharding mode (``jax.make_mesh(..., axis_types=(AxisType.Explicit,)
* 2)``, ``jax.set_mesh``, kernels split over 'model' with ``nnx.with_partitioning``, ``jnp.einsum(...,
out_sharding=...)``) checked live PASSed and FAILed as it should, but every replay of it against a recording
(``shardcheck verify --against``) died in shardcheck's own code and exited 1, the FAIL code:

- a step returning its gradients: the replay's peaks took samples of them with ``jnp.take`` (``ShardingTypeError``:
  a gather of ``float32[2048@model]`` has no output sharding to infer);
- a step returning its loss only: the replay ran the task's loss on the step's explicit-sharded state outside any
  mesh (``ShardingTypeError``: contracting dimensions are sharded).

shardcheck now reads such a state as ``Auto`` arrays (:func:`shardcheck.mesh.auto_typed`: the same buffers), as it
reads a GSPMD step's: the correct step's replay PASSes bitwise, a planted fault's replay FAILs with the live check's
cause. An exception of shardcheck's own in ``shardcheck verify`` now exits 2 with one "internal error" line, never
1; and ``measure_memory(step, task, mesh)`` on a mesh of other axis types names ``measure_memory`` (it named
``measure_step``) and says the meshes differ only in their axis types.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.mesh import auto_typed
from shardcheck.parity.harness.recorded import record_run

D, F, K, B = 8, 16, 4, 8


def spec(*names):
    """``P(*names)`` under an explicit mesh (the step's), ``None`` elsewhere (the reference's one device)."""
    am = jax.sharding.get_abstract_mesh()
    if am.empty or not all(t == AxisType.Explicit for t in am.axis_types):
        return None
    return P(*names)


class MLP(nnx.Module):
    """``D -> F -> K``: the first kernel split over 'model' by its columns, the second by its rows."""

    def __init__(self, rngs):
        normal = nnx.initializers.normal(0.3)
        self.up = nnx.Param(nnx.with_partitioning(normal, (None, "model"))(rngs.params(), (D, F)))
        self.up_b = nnx.Param(
            nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",))(rngs.params(), (F,))
        )
        self.down = nnx.Param(nnx.with_partitioning(normal, ("model", None))(rngs.params(), (F, K)))

    def __call__(self, x):
        h = jnp.einsum("bd,df->bf", x, self.up[...], out_sharding=spec("data", "model"))
        h = jax.nn.gelu(h + self.up_b[...])
        return jnp.einsum("bf,fk->bk", h, self.down[...], out_sharding=spec("data", None))


def loss_fn(model, batch):
    """``(loss_sum, weight)``: a masked squared error (the rows' weights differ per shard)."""
    err = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])


def _task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(B, D)).astype(np.float32),
            "y": rng.normal(size=(B, K)).astype(np.float32),
            "mask": np.r_[np.ones(B // 2 + 2), np.zeros(B // 2 - 2)].astype(np.float32),
        }
        for _ in range(3)
    ]
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=loss_fn,
        batches=batches,
        name="xmlp",
    )


def _step(fault: str | None = None, loss_only: bool = False):
    """The user's step: an explicit mesh of ``mesh``'s devices set around an ``nnx.jit`` step, the state placed
    by its annotations, the rows over 'data'. ``fault="grad_x_model"``: the gradients times the size of
    'model' (a psum over an axis that splits the model, of gradients it did not split)."""

    @nnx.jit
    def train_step(model, optimizer, batch):
        def mean_loss(model):
            if fault == "local_mean":  # each 'data' shard's own mean, averaged: uneven masks weigh rows apart
                err = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)

                def local(e, m):
                    return jax.lax.pmean(jnp.sum(e * m) / jnp.sum(m), "data")

                shards = (P("data"), P("data"))
                return jax.shard_map(local, in_specs=shards, out_specs=P(), axis_names={"data"})(
                    err, batch["mask"]
                )
            total, weight = loss_fn(model, batch)
            return total / weight

        loss, grads = nnx.value_and_grad(mean_loss)(model)
        if fault == "grad_x_model":
            grads = jax.tree.map(lambda g: g * 2, grads)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch, mesh):
        explicit = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(explicit):
            state = nnx.state((model, optimizer))
            nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, explicit)))
            batch = jax.device_put(batch, NamedSharding(explicit, P("data")))
            second = fault == "bias_twice" and int(optimizer.step[...]) == 1
            old = model.up_b[...]
            loss, grads = train_step(model, optimizer, batch)
            if second:  # the second step's update of up_b applied twice
                model.up_b[...] = 2 * model.up_b[...] - old
        return loss if loss_only else {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "model": 2})


@pytest.fixture(scope="module")
def recording(mesh):
    """The correct step's recording (gradients returned), as ``shardcheck record`` keeps it."""
    return record_run(_task(), _step(), mesh=mesh)


@require_devices(4)
def test_auto_typed_keeps_the_buffers_and_drops_the_explicit_types(mesh):
    explicit = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(explicit, P(None, "model")))
    assert str(jax.typeof(x)) == "float32[4,8@model]"
    (y,) = auto_typed((x,))
    assert str(jax.typeof(y)) == "float32[4,8]" and y.sharding.spec == x.sharding.spec
    assert all(t == AxisType.Auto for t in y.sharding.mesh.axis_types)
    pointers = [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards] for a in (x, y)]
    assert pointers[0] == pointers[1]  # no copy
    # what raised ShardingTypeError on x (a gather with no out_sharding) runs on y
    assert np.asarray(jax.jit(lambda a: jnp.take(a.ravel(), jnp.array([1, 9]), mode="clip"))(y)).tolist() == [
        1.0,
        9.0,
    ]
    auto = jnp.ones(3)
    assert auto_typed(auto) is auto  # an Auto (or uncommitted) array as it is


@require_devices(4)
@pytest.mark.parametrize("loss_only", [False, True], ids=["grads", "loss_only"])
def test_the_correct_explicit_step_replays_bitwise_and_passes(mesh, recording, loss_only):
    """Its gradients returned (the peaks' samples raised ShardingTypeError) or its loss only (the task's true
    gradient on its explicit state raised): the replay PASSes, bitwise, as the live check does."""
    replayed = check_parity(_step(loss_only=loss_only), _task(), mesh=mesh, reference=recording)
    assert replayed.ok and replayed.verdict == "PASS", replayed.codes
    assert replayed.replay.bitwise and replayed.replay.hashes_matched == replayed.replay.hashes_compared > 0
    live = check_parity(_step(loss_only=loss_only), _task(), mesh=mesh)
    assert live.ok


@require_devices(4)
def test_a_planted_fault_replays_to_the_live_checks_cause(mesh, recording):
    """The gradients x2 (the size of 'model'): replayed and live, FAIL with the same cause at step 0."""
    replayed = check_parity(_step("grad_x_model"), _task(), mesh=mesh, reference=recording)
    live = check_parity(_step("grad_x_model"), _task(), mesh=mesh)
    for report in (replayed, live):
        assert not report.ok and report.verdict == "FAIL"
        assert report.localization.step == 0 and report.localization.stage == "gradients"
    assert replayed.codes[0] == live.codes[0]
    assert "gradients are 2 x the reference's" in replayed.diagnoses[0].message
    assert replayed.diagnoses[0].message == live.diagnoses[0].message


@require_devices(4)
def test_a_per_shard_mean_replays_to_the_live_checks_cause(mesh, recording):
    """Each 'data' shard divides by its own weight: the replay reruns the step and tests the per-shard-mean
    hypothesis on the explicit state (the task's loss per shard raised there too), as the live check does."""
    replayed = check_parity(_step("local_mean"), _task(), mesh=mesh, reference=recording)
    live = check_parity(_step("local_mean"), _task(), mesh=mesh)
    for report in (replayed, live):
        assert not report.ok and report.verdict == "FAIL"
        assert report.localization.step == 0 and report.localization.stage == "forward"
    assert replayed.codes[0] == live.codes[0], (replayed.codes, live.codes)
    assert "mean of per-shard means" in live.diagnoses[0].message
    assert "mean of per-shard means" in replayed.diagnoses[0].message


@require_devices(4)
def test_a_fault_at_the_second_step_replays_to_the_live_checks_cause(mesh, recording):
    """The second step's update of up_b applied twice: the replay reruns the first step, then tests its
    hypotheses (the task's loss per shard) on the state that step left, explicit-sharded (it raised there)."""
    replayed = check_parity(_step("bias_twice"), _task(), mesh=mesh, reference=recording)
    live = check_parity(_step("bias_twice"), _task(), mesh=mesh)
    for report in (replayed, live):
        assert not report.ok and report.verdict == "FAIL"
        assert report.localization.step == 1 and report.localization.stage == "optimizer"
    assert replayed.codes[0] == live.codes[0], (replayed.codes, live.codes)
    assert "Form: the update of up_b is 2 x the reference's" in replayed.diagnoses[0].message
    # the same sentence but for the tolerance (a digest's, the live comparison's)
    same = [re.sub(r"tolerance [0-9.e+-]+", "tolerance T", r.diagnoses[0].message) for r in (replayed, live)]
    assert same[0] == same[1]


@require_devices(4)
def test_the_loss_only_fault_replays_to_a_failure_of_the_applied_update(mesh, recording):
    """Its loss only: the replay takes the task's true gradient of the explicit state (it raised) and FAILs on
    the parameters, as the live check does."""
    replayed = check_parity(_step("grad_x_model", loss_only=True), _task(), mesh=mesh, reference=recording)
    live = check_parity(_step("grad_x_model", loss_only=True), _task(), mesh=mesh)
    for report in (replayed, live):
        assert not report.ok and report.verdict == "FAIL"
        assert report.localization.step == 0
    assert replayed.codes[0] == live.codes[0], (replayed.codes, live.codes)


def test_an_internal_error_in_verify_exits_2_with_one_line_not_1(monkeypatch, capsys):
    """shardcheck's own exception: exit 2 (bad input, ERROR), never 1 (FAIL), one line naming it and where it was
    raised; SHARDCHECK_TRACEBACK=1 adds the traceback."""
    from shardcheck.cli import main
    from shardcheck.cli import verify as cli_verify

    def broken(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli_verify, "_check_args", broken)
    monkeypatch.delenv("SHARDCHECK_TRACEBACK", raising=False)
    assert main(["verify", "--devices", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in err
    assert line.startswith("error: shardcheck verify: internal error: RuntimeError: boom (raised in ")
    assert "shardcheck/cli/verify.py line " in line and ", main, calling " in line and ", broken)" in line
    assert "not a verdict on your step (exit status 2, not FAIL's 1)" in line
    assert line.endswith("set SHARDCHECK_TRACEBACK=1 for the traceback, and please report it")

    monkeypatch.setenv("SHARDCHECK_TRACEBACK", "1")
    assert main(["verify", "--devices", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "the traceback follows, and please report it" in err
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err.splitlines()[-2]


@require_devices(4)
def test_measure_memory_names_itself_and_the_axis_types_the_step_sets(mesh):
    """On shardcheck.make_mesh's Auto axes the explicit step's mesh differs: the refusal names measure_memory, the
    function called (it named measure_step), and says how to build the step's mesh; on that mesh it measures."""
    with pytest.raises(ValueError) as caught:
        shardcheck.measure_memory(_step(), _task(), mesh)
    message = str(caught.value)
    assert message.startswith("measure_memory: the step sets the mesh ") and "measure_step" not in message
    assert message.endswith(
        "pass measure_memory the mesh the step runs on: the same devices and axes, typed (Explicit, Explicit) by "
        "the step: build it with jax.make_mesh(..., axis_types=(AxisType.Explicit,) * 2)"
    )
    with pytest.raises(
        ValueError, match=r"^measure_step: the step sets the mesh .* pass measure_step the mesh"
    ):
        shardcheck.measure_step(_step(), _task(), mesh)
    explicit = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * 2)
    measured = shardcheck.measure_memory(_step(), _task(), explicit)
    assert measured.accuracy_ratio == 1.0 and measured.state_bytes > 0
