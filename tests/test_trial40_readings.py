"""Trial 40 and 37's readings (issue #36): an accumulation's micro-batch means averaged under a ``(sum, count)``
loss, a returned loss off by one constant factor at every step, an EMA written from the parameters before the
update, and ``replicas_compared`` in ``verify --json`` live and replayed. Small tasks of their own, 2-4 fake
devices."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from test_record import LINEAR_TASK as RECORDED_TASK

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.cli import main
from shardcheck.losses import regression_batch_loss
from shardcheck.parity.harness.recorded import record_run


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(3, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))


def _weighted_task(first: int, second: int, steps: int = 3) -> shardcheck.Task:
    """An MLP under Adam with a ``(loss_sum, weight)`` loss over 16 rows: a 0/1 mask with ``first`` ones in the
    first 8 rows and ``second`` in the last 8 (uneven padding where they differ), ``steps`` batches."""
    rng = np.random.default_rng(0)
    mask = np.zeros(16, np.float32)
    mask[:first] = 1
    mask[8 : 8 + second] = 1
    batches = [
        (rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32), mask)
        for _ in range(steps)
    ]
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=regression_batch_loss,
        batches=batches,
    )


def micro_halves(model, batch):
    """``[((loss_sum, count), grads), ...]`` of the batch's two halves of 8 rows (traced, inside a step's jit)."""
    halves = [jax.tree.map(lambda a, i=i: a[8 * i : 8 * (i + 1)], batch) for i in range(2)]
    return [nnx.value_and_grad(regression_batch_loss, has_aux=True)(model, h) for h in halves]


def _accumulating(
    means: bool = False,
    first_only: bool = False,
    loss_factor: float = 1.0,
    after: bool = False,
    means_factor: float = 1.0,
):
    """A user step that accumulates 2 micro-batches (the batch's halves) by hand under the ``(sum, count)`` loss:
    the sums over the total count (correct), or ``means``: each micro-batch's mean, averaged (trial 40's fault),
    times ``means_factor`` (2: summed, 1/2: divided by k twice; trial 61); ``first_only``: the first
    micro-batch's mean alone; ``loss_factor``: the returned loss scaled; ``after``: the loss returned taken after
    the update."""

    @nnx.jit
    def step(model, optimizer, batch):
        ((s0, c0), g0), ((s1, c1), g1) = micro_halves(model, batch)
        if means:
            loss = (s0 / c0 + s1 / c1) / 2 * means_factor
            grads = jax.tree.map(lambda a, b: (a / c0 + b / c1) / 2 * means_factor, g0, g1)
        elif first_only:
            loss, grads = s0 / c0, jax.tree.map(lambda a: a / c0, g0)
        else:
            loss = (s0 + s1) / (c0 + c1)
            grads = jax.tree.map(lambda a, b: (a + b) / (c0 + c1), g0, g1)
        optimizer.update(model, grads)
        if after:
            s, c = regression_batch_loss(model, batch)
            loss = s / c
        return {"loss": loss * loss_factor, "grads": grads}

    return step


# test_record's task file (a Linear under sgd, mean_step and summed_step), with a step that places its state
LINEAR_TASK = RECORDED_TASK + textwrap.dedent(
    """

    def placed_step(model, optimizer, batch, mesh):
        # the mean step on state it places itself: every leaf replicated, or (SPLIT) the kernel's columns split
        # over the mesh's first axis
        from jax.sharding import NamedSharding, PartitionSpec as P

        def spec(x):
            return P(None, mesh.axis_names[0]) if SPLIT and x.ndim == 2 else P()

        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), state)))
        return _step(model, optimizer, batch, 1.0)


    SPLIT = False
    """
)


@require_devices(2)
def test_replicas_compared_is_in_the_json_live_and_replayed(tmp_path):
    """Each strategy's JSON entry says how many replicated leaves had their copies compared across how many
    devices: live, the candidate's parameters and optimizer state after each step (kernel and bias; sgd keeps no
    arrays); replayed, the leaves the replay's own run compared and recorded (``meta["replicas"]``: the counter
    too). Split state (the kernel's columns over the mesh, the update's bias following it) holds no copies, and one
    device none: nothing compared (``null``)."""
    path, split = tmp_path / "linear.py", tmp_path / "split.py"
    path.write_text(LINEAR_TASK)
    split.write_text(LINEAR_TASK.replace("SPLIT = False", "SPLIT = True"))
    task = ["--task", f"{path}:task", "--devices", "2"]
    recording, live, replay, one, cut = (
        tmp_path / n for n in ("mean.npz", "live.json", "replay.json", "one.json", "split.json")
    )
    placed = ["--candidate", f"{path}:placed_step"]
    assert main(["record", *task, *placed, "--out", str(recording)]) == 0
    assert main(["verify", *task, *placed, "--strategies", "none", "--json", str(live)]) == 0
    assert main(["verify", *task, *placed, "--against", str(recording), "--json", str(replay)]) == 0
    split_args = ["--task", f"{split}:task", "--devices", "2", "--candidate", f"{split}:placed_step"]
    assert main(["verify", *split_args, "--strategies", "none", "--json", str(cut)]) == 0
    one_args = ["--task", f"{path}:task", "--devices", "1", "--candidate", f"{path}:mean_step"]
    assert main(["verify", *one_args, "--strategies", "none", "--json", str(one)]) == 0
    a, b, c, d = (json.loads(p.read_text())["strategies"]["candidate"] for p in (live, replay, cut, one))
    assert a["replicas_compared"] == {"leaves": 2, "devices": 2, "steps": 1}
    assert b["replicas_compared"] == {"leaves": 3, "devices": 2, "steps": 1}
    assert c["replicas_compared"] is None  # nothing held copies to compare
    assert d["replicas_compared"] is None


@require_devices(4)
def test_micro_batch_means_averaged_are_named_where_their_counts_differ():
    """Trial 40: a step that averages its 2 micro-batches' means (7 and 2 rows counted) on 4 shards reproduces
    the step on the mean of the micro-batches' own means: named so, with their counts, not only "computed another
    way". Both sides: the sums over the total count PASS; the same means with equal counts (5 and 5) are the full
    batch's mean and PASS; the first micro-batch's mean alone is not that step and is not named so."""
    mesh = make_mesh({"data": 4})
    uneven = _weighted_task(7, 2)
    bad = check_parity(_accumulating(means=True), uneven, mesh=mesh)
    assert not bad.ok and bad.codes[0] == "micro_batch_means", bad.codes
    message = bad.diagnoses[0].message
    assert message.startswith(
        "At step 0 the step reproduces the micro-batches' means averaged (each normalized by its own count) where "
        "their sums over the total count were meant"
    ), message
    assert (
        "the mean of the 2 micro-batches' own means (the batch's rows in 2 blocks, loss weights 7, 2)"
        in message
    )
    assert check_parity(_accumulating(), uneven, mesh=mesh).ok
    assert check_parity(_accumulating(means=True), _weighted_task(5, 5), mesh=mesh).ok
    other = check_parity(_accumulating(first_only=True), uneven, mesh=mesh)
    assert not other.ok and "micro_batch_means" not in other.codes, other.codes
    assert "micro-batches' means averaged" not in str(other.diagnosis)


@require_devices(2)
def test_a_loss_off_by_one_constant_factor_at_every_step_drops_the_readings_that_cannot_give_it():
    """Trial 40: the returned loss 3 x the reference's at each of 3 steps, the update matching, is read as a scale
    of the returned loss, without a post-update loss, one shard's loss or an unweighted mean (none keeps one
    factor from step to step). Other side: a loss taken after the update (its own ratio at each step) keeps them."""
    mesh = make_mesh({"data": 2})
    task = _weighted_task(7, 2)
    scaled = check_parity(_accumulating(loss_factor=3.0), task, mesh=mesh)
    assert not scaled.ok and scaled.codes[0] == "loss_differs", scaled.codes
    message = scaled.diagnoses[0].message
    assert (
        "It is 3 x the reference's at every one of the 3 steps compared (within the loss's rounding)"
        in message
    )
    assert "the loss returned is scaled by 3 apart from the one differentiated" in message
    assert "a post-update loss, one shard's loss" not in message and "a later step tells" not in message
    late = check_parity(_accumulating(after=True), task, mesh=mesh)
    assert not late.ok and late.codes[0] == "loss_differs", late.codes
    assert "(a post-update loss, one shard's loss, or an unweighted mean?)" in late.diagnoses[0].message
    assert "at every one of" not in late.diagnoses[0].message


class EMA(nnx.Variable):
    """A mean teacher's copy of a parameter (not an nnx.Param: the optimizer leaves it)."""


class TeacherMLP(MLP):
    def __init__(self, rngs):
        super().__init__(rngs)
        params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(self) if isinstance(v, nnx.Param)}
        self.ema = nnx.Dict({k: EMA(jnp.array(v[...])) for k, v in params.items()})


def _params(model) -> dict:
    return {"/".join(map(str, p)): v[...] for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def _ema_step(decay: float, before: bool = False):
    """A step that keeps ``ema = d ema + (1 - d) param`` after its update (the reference at d = 0.9), or
    (``before``) from the parameters before the update, written on the host in float32 (NumPy's rounding, as
    another backend's: ``0.9 e + 0.1 e`` gives back ``e`` up to an ulp, some elements exactly)."""

    @nnx.jit
    def update(model, optimizer, batch):
        def mean(m):
            s, c = regression_batch_loss(m, batch)
            return s / c

        loss, grads = nnx.value_and_grad(mean)(model)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        old = {k: np.asarray(v) for k, v in _params(model).items()}
        loss, grads = update(model, optimizer, batch)
        new = old if before else {k: np.asarray(v) for k, v in _params(model).items()}
        for k, e in model.ema.items():
            e[...] = jnp.asarray(np.float32(decay) * np.asarray(e[...]) + np.float32(1 - decay) * new[k])
        return {"loss": loss, "grads": grads}

    return step


@require_devices(2)
def test_an_ema_written_from_the_parameters_before_the_update_is_one_finding():
    """Trial 37: an EMA in a custom nnx.Variable written from the parameters before the update, equal to the EMA
    at step 0, gives its value back exactly in some leaves (the zero biases) and a few ulps off in others (the
    kernels): one finding naming all 4 EMA leaves and the reading, not one for the leaves left exactly and another
    "by other amounts". Both sides: the EMA after the update PASSes; a decay 0.99 for 0.9 (a change 1/10 of the
    reference's) stays "by other amounts"."""
    mesh = make_mesh({"data": 2})
    task = shardcheck.Task(
        model=lambda: TeacherMLP(nnx.Rngs(0)),
        optimizer=optax.sgd(0.05),
        loss_fn=regression_batch_loss,
        batches=_weighted_task(8, 8, steps=2).batches,
    )
    reference = _ema_step(0.9)
    bad = check_parity(_ema_step(0.9, before=True), task, mesh=mesh, reference=reference)
    assert not bad.ok and bad.codes == ("model_state",), bad.codes
    message = bad.diagnoses[0].message
    assert message.startswith(
        "The candidate's step left the model's state ema.fc1/bias, ema.fc1/kernel, ema.fc2/bias and ema.fc2/kernel "
        "(not a parameter: floating state the reference's step writes, after its forward pass: the task's loss does "
        "not write it) as it was at step 0, 2 of 4 leaves exactly and the others within rounding"
    ), message
    assert "written from the parameters before the update" in message
    assert check_parity(_ema_step(0.9), task, mesh=mesh, reference=reference).ok
    decay = check_parity(_ema_step(0.99), task, mesh=mesh, reference=reference)
    assert not decay.ok and decay.codes == ("state_amount",), decay.codes
    assert "before the update (" not in decay.diagnoses[0].message


@require_devices(4)
@pytest.mark.parametrize(
    ("factor", "said"),
    [
        (
            2.0,
            "the sum of the 2 micro-batches' own means (k = 2 x their mean: a sum where the mean was meant)",
        ),
        (
            0.5,
            "the mean of the 2 micro-batches' own means divided by k = 2 again (1/2 x their mean: divided by k "
            "twice)",
        ),
    ],
)
def test_micro_batch_means_summed_or_divided_twice_are_named(factor, said):
    """Trial 61: a character LM's accumulation by hand that summed its 2 micro-batches' own means (or divided
    their sum by k twice) read forward_differs, "a mask, the positions, a term of the loss ...": the loss and
    gradients were 2.001 x, not one factor (the micro-batches' token counts differ). Named as the micro-batches'
    means with their factor, live and replayed; a plain factor on the correct sums is no micro-batch reading."""
    mesh = make_mesh({"data": 4})
    uneven = _weighted_task(7, 2)
    live = check_parity(_accumulating(means=True, means_factor=factor), uneven, mesh=mesh)
    assert live.codes[0] == "micro_batch_means", live.codes
    assert said in live.diagnoses[0].message, live.diagnoses[0].message
    recording = record_run(uneven, _accumulating(), mesh=mesh)
    replay = check_parity(_accumulating(means=True, means_factor=factor), uneven, reference=recording)
    assert replay.codes[0] == "micro_batch_means", replay.codes
    assert said in replay.diagnoses[0].message
    plain = check_parity(_accumulating(loss_factor=factor), uneven, mesh=mesh)
    assert "micro_batch_means" not in plain.codes, plain.codes


def _clipping(max_norm: float, of: str, per_micro_batch: bool = True):
    """A user step that accumulates 2 micro-batches (the batch's halves) by hand under the ``(sum, count)`` loss
    and clips each micro-batch's gradient (of its loss sum, ``of="sum"``, or of its mean) to global norm
    ``max_norm`` before averaging them (trial 61's fault); ``per_micro_batch=False``: the correct sums over the
    total count, clipped once after the accumulation."""

    def clip(g):
        return optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())[0]

    @nnx.jit
    def step(model, optimizer, batch):
        ((s0, c0), g0), ((s1, c1), g1) = micro_halves(model, batch)
        if not per_micro_batch:
            grads = clip(jax.tree.map(lambda a, b: (a + b) / (c0 + c1), g0, g1))
        else:
            if of == "mean":
                g0, g1 = (jax.tree.map(lambda a, c=c: a / c, g) for g, c in ((g0, c0), (g1, c1)))
            grads = jax.tree.map(lambda a, b: (a + b) / 2, clip(g0), clip(g1))
        optimizer.update(model, grads)
        return {"loss": (s0 + s1) / (c0 + c1), "grads": grads}

    return step


@require_devices(4)
@pytest.mark.parametrize("of", ["sum", "mean"])
def test_a_clip_per_micro_batch_is_named_with_its_norm(of):
    """Trial 61: an accumulation by hand that clipped each micro-batch's gradient before adding them read
    "localized ... no constant factor". Named as a clip per micro-batch with its fitted norm (0.05, the task
    clipping nothing), of the micro-batch's loss sum or mean; one clip of the accumulated gradient is not."""
    mesh = make_mesh({"data": 4})
    uneven = _weighted_task(7, 2)
    report = check_parity(_clipping(0.05, of), uneven, mesh=mesh)
    assert report.codes[0] == "clip_per_shard", report.codes
    # a clip that binds on both micro-batches clips their sums and their means alike
    grad = "of its loss sum or its mean, which a clip that binds on each clips alike"
    assert report.diagnoses[0].message.startswith(
        "At step 0 the gradients differ: they are the mean over 2 micro-batches (the batch's rows in 2 blocks) of "
        f"each micro-batch's own gradient ({grad}) scaled by min(1, 0.05 / its global L2 norm) (fitted, rerun "
        "from the reference's pre-step state; the task's optimizer clips nothing)"
    ), report.diagnoses[0].message
    once = check_parity(_clipping(0.05, of, per_micro_batch=False), uneven, mesh=mesh)
    assert not once.ok and "clip applied per micro-batch" not in str(once.diagnosis)
