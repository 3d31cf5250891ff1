"""Floating model state beside the parameters in a user's step (issue #36, trial 8: a ResNet with BatchNorm and
an EMA of its parameters): one rule live and replayed (``parity.comparison.model_state``,
``parity.comparison.state_digest``), each side tested with values on a tiny model.

- an EMA the user's step writes after its update, which the loss does not read: not compared, the PASS says so
  (it FAILed as ``frozen_state``); a frozen weight the loss reads still FAILs (tests/test_frozen_state.py);
- running averages both steps write: compared coarsely on their change; a momentum 0.99 in place of 0.9 FAILs
  as ``state_amount`` live and replayed (live PASSed it, the replay FAILed it as dropped writes);
- the grouping never names a leaf by a bare list index.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from conftest import said as said_of
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.parity.comparison.model_state import COARSE, floating_state, loss_reads, model_state_leaves
from shardcheck.parity.diagnosis.grouping import shared_property
from shardcheck.parity.harness.recorded import record_run


class EMA(nnx.Variable):
    """The parameters' moving average: model state the user's step writes, the loss never reads."""


class Frozen(nnx.Variable):
    """A weight the loss reads and nothing trains."""


class RunningStat(nnx.Variable):
    """A running average the forward pass writes (BatchNorm's, in a Variable class of one's own)."""


class Norm(nnx.Module):
    """``x - mean(x)`` over the batch, its running average kept at ``momentum``."""

    def __init__(self, n: int):
        self.mean = RunningStat(jnp.zeros(n))
        self.momentum = 0.9

    def __call__(self, x):
        mean = x.mean(0)
        self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
        return x - mean


class Net(nnx.Module):
    def __init__(self, norm: bool = False):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.base = Frozen(jnp.full((3,), 0.5))
        self.norm = Norm(3) if norm else None
        self.ema = nnx.List([EMA(p) for p in jax.tree.leaves(nnx.state(self, nnx.Param))])

    def __call__(self, x):
        h = self.lin(x) * self.base[...]
        return h if self.norm is None else self.norm(h)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task(norm: bool) -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: Net(norm), optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=batches
    )


def _step(momentum: float = 0.9):
    """A user's GSPMD step (every leaf replicated, the batch split over ``data``) that updates the EMA after the
    optimizer's update, the norm's running average at ``momentum``."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        for e, p in zip(
            getattr(model, "ema", ()), jax.tree.leaves(nnx.state(model, nnx.Param)), strict=False
        ):
            e[...] = 0.9 * e[...] + 0.1 * p
        return loss

    def step(model, optimizer, batch, mesh):
        if isinstance(getattr(model, "norm", None), Norm):
            model.norm.momentum = momentum
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


def test_loss_reads_the_frozen_weight_and_the_running_average_not_the_ema():
    """Traced once: the weight the forward pass multiplies by and the running average it updates from itself
    are read; the EMA list no equation takes is not."""
    assert loss_reads(loss_fn, Net(norm=True), _task(True).batches[0]) == {"base", "norm.mean"}
    assert loss_reads(loss_fn, Net(), _task(False).batches[0]) == {"base"}


def test_state_rules_on_arrays_both_sides():
    ref, cand = Net(norm=True), Net(norm=True)
    before = floating_state(ref)
    read = frozenset({"base", "norm.mean"})

    def leaves(c, ref_mean, cand_mean):
        ref.norm.mean[...], c.norm.mean[...] = ref_mean, cand_mean
        out = model_state_leaves(0, ref, c, None, before, floating_state(Net(norm=True)), read)
        return {e.path: e for e in out}

    cand.ema[0][...] = cand.ema[0][...] + 0.25  # written by the candidate only, read by nothing
    got = leaves(cand, jnp.array([0.1, 0.2, 0.4]), jnp.array([0.1, 0.2, 0.4]) * (1 + 2**-20))
    ema = got["model.ema.0"]
    assert ema.ok and ema.tolerance == np.inf and ema.max_abs_err == pytest.approx(0.25)
    mean = got["model.norm.mean"]  # rounded another way: within half of the reference's change
    assert (
        mean.ok
        and mean.reference_change == pytest.approx(0.4)
        and mean.tolerance == pytest.approx(COARSE * 0.4)
    )
    assert mean.ratio == pytest.approx(1.0)
    # a tenth of the reference's change (momentum 0.99 for 0.9): 0.36 > 0.2
    tenth = leaves(cand, jnp.array([0.1, 0.2, 0.4]), jnp.array([0.01, 0.02, 0.04]))["model.norm.mean"]
    assert not tenth.ok and tenth.max_abs_err == pytest.approx(0.36) and tenth.ratio == pytest.approx(0.1)
    dropped = leaves(cand, jnp.array([0.1, 0.2, 0.4]), jnp.zeros(3))["model.norm.mean"]
    assert not dropped.ok and dropped.ratio == 0.0 and dropped.tolerance == 0.0
    # a weight the loss reads is compared exactly however it moved
    cand.base[...] = cand.base[...] + 1e-3
    base = leaves(cand, jnp.zeros(3), jnp.zeros(3))["model.base"]
    assert not base.ok and base.reference_change == 0.0 and base.max_abs_err == pytest.approx(1e-3, rel=1e-4)


def test_a_write_at_rounding_level_is_no_write_told_apart_from_none_live_and_replayed():
    """Trial 15: an EMA ``d * e + (1 - d) * p`` of parameters a step at learning rate 0 left as they were moved
    by one ulp in the reference's step; a correct rewrite ``e + (1 - d) * (p - e)`` left it exactly as it was,
    and both the live rule and the replay said its writes were dropped. A change within ROUNDING_ULPS units in
    the last place of the leaf's magnitude is rounding on either side; one above it left as it was is still a
    dropped write, and a candidate's change beyond it still FAILs."""
    from shardcheck.parity.comparison.digest import SAMPLES, _Leaf
    from shardcheck.parity.comparison.model_state import ROUNDING_ULPS, rounding_floor
    from shardcheck.parity.comparison.state_digest import state_evidence

    eps = float(np.finfo(np.float32).eps)
    assert rounding_floor("float32", 0.5) == ROUNDING_ULPS * eps * 0.5 and rounding_floor("int32", 0.5) == 0.0
    ref, cand = Net(norm=True), Net(norm=True)
    start = jnp.array([0.1, 0.2, 0.5])
    ref.norm.mean[...], cand.norm.mean[...] = start, start
    before = floating_state(ref)

    def mean_leaf(ref_mean, cand_mean):
        ref.norm.mean[...], cand.norm.mean[...] = ref_mean, cand_mean
        out = model_state_leaves(0, ref, cand, None, before, before, frozenset({"base", "norm.mean"}))
        return next(e for e in out if e.path == "model.norm.mean")

    one_ulp = start.at[2].set(np.nextafter(np.float32(0.5), np.float32(1)))
    assert mean_leaf(one_ulp, start).ok  # the reference moved by 1 ulp, the candidate by 0
    dropped = mean_leaf(start + 1e-3, start)
    assert not dropped.ok and dropped.ratio == 0.0
    moved = mean_leaf(one_ulp, start + 1e-3)  # beyond rounding where the reference's change is rounding
    assert not moved.ok and moved.max_abs_err == pytest.approx(1e-3, rel=1e-3)

    def leaf(mx, update, samples):
        return _Leaf(True, (3,), "float32", "", mx, mx, update, samples, b"", np.arange(SAMPLES) < 3)

    s0 = np.full(SAMPLES, np.nan)
    s0[:3] = [0.1, 0.2, 0.5]
    was = (leaf(0.5, 0.0, s0), leaf(0.5, 0.0, s0))
    s1 = s0.copy()
    s1[2] = float(one_ulp[2])
    ulp = float(one_ulp[2]) - 0.5
    rounding = state_evidence("state model.norm.mean", (leaf(0.5, ulp, s1), leaf(0.5, 0.0, s0)), was, None)
    assert rounding[5] and rounding[4] == pytest.approx(ROUNDING_ULPS * eps * 0.5)
    s2 = s0.copy()
    s2[:3] += 1e-3
    real = state_evidence("state model.norm.mean", (leaf(0.501, 1e-3, s2), leaf(0.5, 0.0, s0)), was, None)
    assert not real[5] and real[6] == 0.0


@require_devices(2)
def test_an_ema_only_the_users_step_writes_passes_live_and_replayed_saying_it_was_not_compared(mesh):
    task = _task(norm=False)
    said = "The model's state model.ema.* (2 leaves) is written by the candidate's step only and not read by the loss"
    live = check_parity(_step(), task, mesh=mesh)
    assert live.ok and live.codes == ("parity",)
    assert said in live.diagnoses[0].message and "Parity holds: 5 leaves" in live.diagnoses[0].message
    recording = record_run(task, "gspmd", mesh=mesh)
    assert recording.meta["floating_read"] == ["base"]
    replayed = check_parity(_step(), task, mesh=mesh, reference=recording)
    # a replay says what it knows: the task's loss neither reads nor writes it (the recording's step may write it)
    replay_said = "The model's state model.ema.* (2 leaves) is neither read nor written by the task's loss"
    assert replayed.ok and replay_said in replayed.diagnoses[0].message


@require_devices(2)
def test_a_running_average_momentum_of_its_own_fails_live_and_replayed_as_state_amount(mesh):
    task = _task(norm=True)
    right = check_parity(_step(), task, mesh=mesh)
    assert right.ok and "1 leaf of floating state written by both steps (state model.norm.mean)" in str(right)
    live = check_parity(_step(momentum=0.99), task, mesh=mesh)
    recording = record_run(task, "gspmd", mesh=mesh)
    assert check_parity(_step(), task, mesh=mesh, reference=recording).ok
    replayed = check_parity(_step(momentum=0.99), task, mesh=mesh, reference=recording)
    for report in (live, replayed):
        assert not report.ok and report.codes[0] == "state_amount"
        assert "(its largest change 0.1 times the reference's)" in report.diagnoses[0].message
        # trial 31: per-row state written from other rows is one reading too (a GRU carry, shard 0's rows copied)
        assert (
            "rows written from other rows (one shard's rows written to every shard)"
            in report.diagnoses[0].message
        )
        assert report.localization.form.kind == "state_amount"
        assert "written by both steps, by other amounts" in report.localization.form.sentence
        assert (
            "left" not in report.localization.form.sentence and "dropped" not in report.diagnoses[0].message
        )


class BatchNormed(nnx.Module):
    """nnx.BatchNorm in training mode: its running averages are nnx.BatchStat the forward pass writes."""

    def __init__(self):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(x))


def _unsynced_step(model, optimizer, batch, mesh):
    """A shard_map step that averages the gradients and the loss over ``data`` but leaves BatchNorm's
    ``axis_name`` unset: each shard normalizes with its own batch's statistics."""
    graphdef, state = nnx.split((model, optimizer))

    def body(state, batch):
        m, o = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(m, batch)
        o.update(m, jax.lax.pmean(grads, "data"))
        return jax.lax.pmean(loss, "data"), nnx.state((m, o))

    specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False)
    loss, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
    nnx.update((model, optimizer), state)
    return loss


@require_devices(2)
def test_batchnorm_passes_under_a_gspmd_step_live_and_replayed_and_fails_unsynced_in_shard_map(mesh):
    """nnx.BatchStat is accepted for a user's step (it was refused): a GSPMD step computes the full batch's
    statistics; a shard_map step that does not sync them computes another loss, found at the forward stage."""
    task = shardcheck.Task(
        model=BatchNormed, optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=_task(False).batches
    )
    live = check_parity(_step(), task, mesh=mesh)
    assert live.ok and "2 leaves of floating state written by both steps" in live.diagnoses[0].message
    recording = record_run(task, "gspmd", mesh=mesh)
    assert check_parity(_step(), task, mesh=mesh, reference=recording).ok
    unsynced = check_parity(_unsynced_step, task, mesh=mesh)
    assert not unsynced.ok and unsynced.localization.stage == "forward"
    assert not next(e for e in unsynced.steps[0].leaves if e.kind == "loss").ok
    # trial 52: the finding of a loss computed per shard names the BatchNorm first, and how to sync it
    said = said_of(unsynced, "per_shard_loss")
    assert said.startswith(
        "The model's BatchNorm normalizes with the batch's own statistics (bn.mean, bn.var: nnx.BatchStat, "
        "training mode), and at step 0 the loss the step returns ("
    ), said
    assert (
        "nnx.BatchNorm(..., axis_name='data')" in said and "Otherwise a term of the loss that couples" in said
    )


def test_the_batch_statistics_clause_goes_to_the_per_shard_loss_finding_alone():
    from shardcheck.parity.diagnosis.batch_stats import with_batch_stats
    from shardcheck.parity.diagnosis.rules import Diagnosis

    coupled = (
        "At step 0 the loss is the shards': a term of the loss that couples the rows was computed per shard."
    )
    findings = [
        Diagnosis("replicas_differ", "copies differ", "x"),
        Diagnosis("per_shard_loss", coupled, "loss"),
    ]
    assert with_batch_stats(findings, ()) == findings
    first, second = with_batch_stats(findings, ("bn.mean",))
    assert first == findings[0]
    assert second.message.startswith(
        "The model's BatchNorm normalizes with the batch's own statistics (bn.mean: nnx.BatchStat, training mode), "
        "and at step 0 the loss is the shards': what a BatchNorm run per shard computes"
    )
    assert second.message.endswith(
        " Otherwise a term of the loss that couples the rows was computed per shard."
    )


@require_devices(2)
def test_memory_measures_a_batchnorm_users_step(mesh):
    """memory --measure refused a model holding nnx.BatchStat: it measures it now, the running averages counted
    as model state. The step replicates everything: on each device 21 parameters (84 B), the mean and variance
    (6 floats, 24 B) and the step counter (4 B)."""
    from shardcheck.memory.measure import measure_step

    task = shardcheck.Task(
        model=BatchNormed, optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=_task(False).batches
    )
    assert measure_step(_step(), task, mesh).state_bytes_per_device == (112, 112)


def test_running_averages_that_differ_after_a_step_that_failed_elsewhere_are_no_cause():
    """An lr x4 in a BatchNorm model (trial 8): step 0 fails on the parameters, and from step 1 the running
    averages of the moved parameters differ by more than the coarse bound; they are a consequence, so no
    state_amount finding (it had been the report's leading code, 'a momentum differs'); where they are the first
    failure, it is."""
    from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
    from shardcheck.parity.diagnosis.rules import diagnose

    def record(t, param_ok, state_ok):
        loss = LeafError(t, "loss", "loss", 0.0, 0.0, 1e-6, True)
        param = LeafError(
            t, "param", "w", 0.0 if param_ok else 0.3, 0.1, 1e-6, param_ok, 4.0, 0.1, shape=(3,)
        )
        err = 0.0 if state_ok else 0.36
        state = LeafError(t, "state", "model.bn.mean", err, err / 0.4, 0.2, state_ok, 0.1, 0.4, shape=(3,))
        return StepRecord(t, 1e-5, 1e-7, 1.0, 1.0, (loss, param, state), t + 1, t + 1)

    later = [d.code for d in diagnose([record(0, False, True), record(1, False, False)])]
    assert "state_amount" not in later
    first = diagnose([record(0, True, False)])
    assert first[0].code == "state_amount" and "at step 0 (its largest change 0.1 times" in first[0].message


def test_a_group_sentence_never_names_a_leaf_by_a_bare_index():
    ema = {f"model.ema.{i}": (3,) for i in (0, 1, 10, 3)}
    said = shared_property(ema, {"model.lin.kernel": (4, 3), "model.lin.bias": (3,)})
    assert said == "every failing leaf is an ema item; every bias, kernel matches"
    mixed = shared_property(
        {"model.ema.0": (3,), "model.ema.1": (3,)}, {"model.ema.2": (3,), "model.ema.4": (3,)}
    )
    assert " a 0" not in mixed and "every 2" not in mixed and "model.ema.0, model.ema.1" in mixed
    layers = shared_property({"layers.0.kernel": (3, 3)}, {"layers.0.bias": (3,), "layers.1.bias": (3,)})
    assert layers == "every failing leaf is 2-D (kernel); every leaf of ndim <= 1 matches"
