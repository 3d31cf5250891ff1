"""Issue #36, trial 36 (a masked LM with a ``(sum of masked CE, masked count)`` loss on data=2,fsdp=2): three
leads the step's own numbers contradicted or left unread, on a small MLP of the same loss form whose shards'
mask counts differ along 'fsdp' only (3, 5, 3, 5 of 16).

1. Gradients psum-ed over ('data', 'fsdp'), then divided by each shard's OWN mask count: every device's copy is
   the same all-reduced gradient times 1 over its shard's count, so the copies are exactly proportional (x1, x0.6,
   x1, x0.6); led ``local_normalization`` with the weights and the factor 16/3, never "not reduced over 'fsdp'"
   (whose fix was already in the step). A psum over 'data' only keeps ``wrong_axis_reduction``.
2. The loss itself x2 at equal parameters, its gradients x2 too: read as the loss's (``scaled``: a factor in the
   loss, or a psum of the loss and gradients alike), no gradient-only sum (trial 42); a gradient-only double sum
   (loss matching) keeps ``summed``.
3. A decay by hand under an optax schedule: the decay form says c itself (the schedule's learning rate at that
   step read from the task's optimizer), not "c*lr (the learning rate unknown)".
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.diagnosis.replica_form import copy_scales
from shardcheck.parity.harness.optimizer_rerun import known_lr
from shardcheck.steps import Candidate
from shardcheck.steps._core import params_value_and_grad

MESH = {"data": 2, "fsdp": 2}
AXES = ("data", "fsdp")
# masked entries per row: shards of 2 rows each (data, fsdp) = (0, 0), (0, 1), (1, 0), (1, 1) -> 3, 5, 3, 5
MASKED = (1, 2, 2, 3, 1, 2, 2, 3)


class _Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _loss(model, batch):
    """(sum of the masked squared errors, the masked count)."""
    err = (model(batch["x"]) - batch["y"]) ** 2
    mask = jax.lax.stop_gradient(batch["mask"])
    return jnp.sum(err * mask), jnp.sum(mask)


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(3)[None, :] < np.asarray(MASKED)[:, None]).astype(np.float32)
    return {
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "y": rng.normal(size=(8, 3)).astype(np.float32),
        "mask": mask,
    }


@functools.cache
def _task(tx=None) -> Task:
    return Task(
        model=lambda: _Mlp(nnx.Rngs(0)),
        optimizer=tx if tx is not None else optax.sgd(0.1),
        loss_fn=_loss,
        batches=[_batch()],
        name="masked-mlp",
    )


def _step(fault: str) -> Candidate:
    """A shard_map step over data=2 x fsdp=2 (the batch split over both): ``local`` divides the all-reduced
    gradients by the shard's own count, ``data_only`` psums them over 'data' only, ``loss_x2`` doubles the loss
    (its gradients with it), ``grads_x2`` psums the gradients over 'fsdp' once more (the loss as it is), ``""``
    is right."""
    mesh = make_mesh(MESH)

    def step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, batch):
            scale = 2.0 if fault == "loss_x2" else 1.0
            total, count, grads = params_value_and_grad(
                lambda m, b: tuple(v * w for v, w in zip(_loss(m, b), (scale, 1.0), strict=True)),
                graphdef,
                params,
                rest,
                batch,
            )
            weight = jax.lax.psum(count, AXES)
            if fault == "local":
                grads = jax.tree.map(lambda g: jax.lax.psum(g, AXES) / count, grads)
            elif fault == "data_only":
                grads = jax.tree.map(lambda g: jax.lax.psum(g, "data") / weight, grads)
            elif fault == "grads_x2":
                grads = jax.tree.map(lambda g: jax.lax.psum(jax.lax.psum(g, AXES), "fsdp") / weight, grads)
            else:
                grads = jax.tree.map(lambda g: jax.lax.psum(g, AXES) / weight, grads)
            return jax.lax.psum(total, AXES) / weight, grads

        loss, grads = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(AXES)), out_specs=(P(), P()), check_vma=False
        )(params, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return Candidate(fault or "right", nnx.jit(step), num_shards=4)


@functools.cache
def _check(fault: str):
    return check_parity(_step(fault), _task(), mesh=make_mesh(MESH))


def _message(report, code: str) -> str:
    return next(d.message for d in report.diagnoses if d.code == code)


# ------------------------------------------------------------- 1. a local divisor after a right all-reduce


@require_devices(4)
def test_a_local_count_after_the_all_reduce_leads_with_its_weights_not_a_missed_axis():
    report = _check("local")
    assert report.codes[0] == "local_normalization", report.codes
    assert "wrong_axis_reduction" not in report.codes and "scaled" not in report.codes
    record = report.steps[0]
    assert record.replica_scales == pytest.approx((1.0, 0.6, 1.0, 0.6), rel=1e-5)
    assert record.shard_weights == (3.0, 5.0, 3.0, 5.0)
    message = _message(report, "local_normalization")
    assert message.startswith(
        "After step 0 every device's copy of the returned gradients is one same gradient times a constant of its "
        "own: the copies differ along 'fsdp' and are exactly proportional on every leaf (x1, x0.6, x1, x0.6 of "
        "the first device's, device by device), the ratios of 1 over the shards' own loss weights (3, 5, 3, 5; "
        "the batch's weight 16): the gradients were all-reduced, then each device divided them by its own "
        "shard's weight"
    ), message
    assert "The returned gradients are x5.333 = 16/3: the global weight over shard 0's own." in message
    assert "jax.lax.psum(count, ('data', 'fsdp'))" in message
    assert "not reduced over" not in report.diagnosis and "not a shard count" not in report.diagnosis


@require_devices(4)
def test_a_psum_over_data_only_keeps_the_missed_axis_and_the_right_step_passes():
    report = _check("data_only")
    assert report.codes[0] == "wrong_axis_reduction", report.codes
    assert "local_normalization" not in report.codes
    assert report.steps[0].replica_scales is None  # partial sums: no constant maps the copies onto each other
    missed = _message(report, "wrong_axis_reduction")
    assert "were not reduced over 'fsdp' (reduced over 'data' only" in missed
    right = _check("")
    assert right.ok, right.diagnosis


def test_copy_scales_reads_a_constant_per_device_and_nothing_else():
    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    g = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)

    def replicated(copies):
        sharding = NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)), P())
        arrays = [jax.device_put(c, d) for c, d in zip(copies, devices, strict=True)]
        return jax.make_array_from_single_device_arrays(g.shape, sharding, arrays)

    scaled = replicated([g / 3, g / 5, g / 3, g / 5])
    assert copy_scales({"w": scaled}) == pytest.approx((1.0, 0.6, 1.0, 0.6), rel=1e-6)
    partial = replicated([g, g[::-1], g, g[::-1]])  # partial sums: no one constant
    assert copy_scales({"w": scaled, "v": partial}) is None
    assert copy_scales({"w": replicated([g, g, g, g])}) is None  # the same copies: nothing to scale


# ---------------------------------------------------------------- 2. the loss itself scaled, gradients with it


@require_devices(4)
def test_a_doubled_loss_leads_with_the_loss_and_names_no_gradient_only_sum():
    report = _check("loss_x2")
    assert report.codes[0] == "scaled" and "summed" not in report.codes, report.codes
    message = _message(report, "scaled")
    assert message.startswith(
        "At step 0 the loss the step returns at equal parameters is 2 x the reference's ("
    ), message
    # both readings of the loss's own factor, never a reduction of the gradients alone (trial 42: it leaves the
    # loss as it is, so a loss 2 x the reference's rules it out)
    assert (
        "and gradients are 2 x too: the loss itself is scaled, its gradients with it: either a factor of 2 in the "
        "step's own loss (a sum over 2 terms where their mean was meant, such as an ensemble's members or "
        "micro-batches; a term counted twice, another count or divisor, a loss scale not undone), or the loss and "
        "its gradients alike psum-ed over 'data' or 'fsdp' where a pmean was meant. The factor alone does not tell "
        "the two apart; a reduction of the gradients alone would leave the returned loss as it is."
    ) in message, message
    assert "once too often" not in message


@require_devices(4)
def test_a_gradient_only_double_sum_keeps_summed():
    report = _check("grads_x2")
    assert "summed" in report.codes, report.codes
    message = _message(report, "summed")
    assert "gradients are 2 x the reference's: x2, the size of mesh axes 'data' or 'fsdp' (each)" in message
    assert "once too often" in message and "the loss itself is scaled" not in message


# ----------------------------------------------------------------- 3. a decay's c under the task's schedule

SCHEDULE = optax.linear_schedule(1e-2, 0.0, 10)  # lr(0) = 0.01, lr(1) = 0.009
WD = 0.05


def _kernels_of_a(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: "a" in jax.tree_util.keystr(p)[:5], params)


def _decay_step(decay_b: bool):
    """The task's optimizer step, then (``decay_b``) b.kernel decayed by hand by the schedule's lr x WD, which
    the task's mask leaves out."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: _loss(m, batch)[0] / _loss(m, batch)[1])(model)
        optimizer.update(model, grads)
        if decay_b:
            lr = SCHEDULE(optimizer.step[...] - 1)
            model.b.kernel[...] = model.b.kernel[...] * (1 - lr * WD)
        return {"loss": loss, "grads": grads}

    return step


def test_a_decay_by_hand_under_a_schedule_says_c_from_the_schedules_learning_rate():
    tx = optax.adamw(SCHEDULE, weight_decay=WD, mask=_kernels_of_a)
    task = _task(tx)
    report = check_parity(_decay_step(True), task, steps=1)
    assert not report.ok
    loc = report.localization
    assert loc.stage == "optimizer" and loc.form.kind == "decay", loc.text()
    assert loc.form.coefficient == pytest.approx(WD, rel=1e-3)
    assert "c*lr*param with c = 0.05 (learning rate 0.01 at this step) on the one failing leaf" in loc.text()
    assert "learning rate unknown" not in report.diagnosis
    assert check_parity(_decay_step(False), task, steps=1).ok


def test_known_lr_reads_one_schedule_or_one_constant_and_refuses_two():
    params = {"w": jnp.ones((2,))}
    for tx, want in (
        (optax.adamw(SCHEDULE, weight_decay=WD), (1e-2, 9e-3)),  # after steps 1 and 2: lr(0), lr(1)
        (optax.sgd(0.1), (0.1, 0.1)),
    ):
        state = tx.init(params)
        got = []
        for _ in range(2):
            _, state = tx.update({"w": jnp.ones((2,))}, state, params)
            got.append(known_lr(state, tx, params))
        assert got == pytest.approx(list(want), rel=1e-6), tx
    two = optax.chain(optax.scale(0.5), optax.sgd(0.1))  # two scales: which is the learning rate is not known
    assert known_lr(two.init(params), two, params) is None
    assert known_lr(optax.sgd(0.1).init(params)) is None  # no transformation given: unknown as before


def test_a_replayed_decay_by_hand_says_c_too():
    from shardcheck.parity.harness.recorded import record_run

    tx = optax.adamw(SCHEDULE, weight_decay=WD, mask=_kernels_of_a)
    task = _task(tx)
    recording = record_run(task, _decay_step(False), steps=1)
    report = check_parity(_decay_step(True), task, reference=recording)
    loc = report.localization
    assert loc.form.kind == "decay", loc.text()
    assert "c*lr*param with c = 0.05 (learning rate 0.01 at this step) on the one failing leaf" in loc.text()
    assert check_parity(_decay_step(False), task, reference=recording).ok
