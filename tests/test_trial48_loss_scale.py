"""Trial 48 (issue #36): float16 compute with dynamic loss scaling written by hand, against the user's own
reference step.

The trial's MLP (float16 layers, float32 parameters) kept its loss scale and a good-step counter in
``nnx.Variable`` s; an overflow (non-finite gradients, agreed across devices by a psum of the flags) skips the
step, halves the scale and resets the counter, under ``optax.sgd(momentum=0.9)``. Its correct ``shard_map`` step
FAILed at the skipped step against its own ``ref_step``: "max abs err 0 > tolerance nan": the task's optimizer
was propagated on the non-finite gradients (the allowance's sensitivity pass), and a NaN tolerance fails every
error. Now a step whose gradients are not finite adds no sensitivity: the allowance carries the earlier steps'.

The task here: an MLP 8 -> 16 -> 4 in float16 compute, float32 parameters, batch 1's shard-0 rows x1e5 (they
overflow float16), 3 steps on data=4. Planted faults: ``no_unscale`` (the scaled gradients applied),
``local_finite`` (each device's own finiteness, no psum: one device skips while the others step),
``skip_params_only`` (the skip restores the parameters, not the optimizer's momentum), ``counter_no_reset`` (the
good-step counter kept at an overflow).
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
from shardcheck.parity.comparison.digest import skipped_steps
from shardcheck.parity.harness.recorded import record_run

F16, F32 = jnp.float16, jnp.float32
S = 4
SKIPPED = 1  # the overflow batch's step


class Scale(nnx.Variable):
    """The loss scale and the good-step counter: state beside the parameters."""


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(8, 16, dtype=F16, param_dtype=F32, rngs=rngs)
        self.head = nnx.Linear(16, 4, dtype=F16, param_dtype=F32, rngs=rngs)
        self.loss_scale = Scale(jnp.asarray(2.0**10, F32))
        self.good_steps = Scale(jnp.asarray(0, jnp.int32))

    def __call__(self, x):
        return self.head(nnx.relu(self.l1(x.astype(F16)))).astype(F32)


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def _task() -> shardcheck.Task:
    rng = np.random.default_rng(0)
    batches = []
    for i in range(3):
        x = rng.normal(size=(8, 8)).astype(np.float32)
        if i == SKIPPED:
            x[0:2] *= 1e5  # shard 0's rows: float16 overflows (max 65504)
        batches.append({"x": x, "y": rng.integers(0, 4, size=8).astype(np.int32)})
    return shardcheck.Task(
        model=MLP, optimizer=optax.sgd(0.05, momentum=0.9), loss_fn=loss_fn, batches=batches
    )


def _finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


def _rescale(model, finite, reset: bool = True):
    """Double the scale after 2 good steps; halve it and reset the counter on an overflow (``reset=False``: the
    counter kept, a planted fault)."""
    good = jnp.where(finite, model.good_steps[...] + 1, 0 if reset else model.good_steps[...])
    grow = good >= 2
    scale = model.loss_scale[...]
    model.loss_scale[...] = jnp.where(finite, jnp.where(grow, scale * 2, scale), scale / 2)
    model.good_steps[...] = jnp.where(grow, 0, good)


def _scaled_grads(model, batch):
    scale = model.loss_scale[...]
    gdef, params, rest = nnx.split(model, nnx.Param, ...)

    def scaled(p):
        loss = loss_fn(nnx.merge(gdef, p, rest), batch)
        return loss * scale, loss

    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return loss, grads, scale


@nnx.jit
def ref_step(model, optimizer, batch):
    """The user's single-device reference: the same loss scaling, the step skipped on an overflow."""
    loss, grads, scale = _scaled_grads(model, batch)
    grads = jax.tree.map(lambda g: g / scale, grads)
    finite = _finite(grads)
    old = jax.tree.map(jnp.copy, nnx.state((model, optimizer)))
    optimizer.update(model, jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads))
    new = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.tree.map(lambda o, n: jnp.where(finite, n, o), old, new))
    _rescale(model, finite)
    return {"loss": loss, "grads": grads}


def make_step(fault: str = ""):
    """The user's ``shard_map`` step on ``data``; ``fault`` plants one of the module's faults."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)

        def body(leaves, batch):
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            loss, grads, scale = _scaled_grads(model, batch)
            if fault != "no_unscale":
                grads = jax.tree.map(lambda g: g / scale, grads)
            local = _finite(grads)
            finite = jax.lax.psum(1 - local.astype(jnp.int32), "data") == 0
            if fault == "local_finite":
                finite = local
            returned = jax.lax.pmean(grads, "data")
            grads = jax.lax.pmean(jax.tree.map(lambda g: jnp.where(local, g, 0.0), grads), "data")
            old = jax.tree.map(jnp.copy, nnx.state((model, optimizer)))
            old_params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
            optimizer.update(model, grads)
            if fault == "skip_params_only":
                params = nnx.state(model, nnx.Param)
                nnx.update(model, jax.tree.map(lambda o, n: jnp.where(finite, n, o), old_params, params))
            else:
                new = nnx.state((model, optimizer))
                nnx.update((model, optimizer), jax.tree.map(lambda o, n: jnp.where(finite, n, o), old, new))
            _rescale(model, finite, reset=fault != "counter_no_reset")
            return jax.lax.pmean(loss, "data"), returned, jax.tree.leaves(nnx.state((model, optimizer)))

        specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        loss, grads, leaves = jax.jit(jax.shard_map(body, **specs))(leaves, batch)
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": S})


def _said(report, code: str) -> str:
    return next(d for d in report.diagnoses if d.code == code).message


@require_devices(S)
def test_the_correct_loss_scale_step_passes_its_skipped_step_live(mesh):
    report = check_parity(make_step(), _task(), mesh=mesh, reference=ref_step)
    assert report.verdict == "PASS", report.diagnosis
    assert [r.skipped for r in report.steps] == [False, True, False]
    skipped = report.steps[SKIPPED]
    tolerances = [e.tolerance for e in skipped.leaves if e.kind in ("param", "opt_state")]
    assert tolerances and all(np.isfinite(t) and t > 0 for t in tolerances)  # the earlier steps' allowance
    assert all(e.reference_change == 0 for e in skipped.leaves if e.kind == "param")
    assert "skipped_step" in report.codes
    assert "the candidate's loss and gradients are not finite there too and its update matches" in _said(
        report, "skipped_step"
    )
    assert "nan" not in report.diagnosis


@require_devices(S)
@pytest.mark.parametrize("fault", ["no_unscale", "local_finite", "skip_params_only", "counter_no_reset"])
def test_a_planted_loss_scale_fault_fails(mesh, fault):
    report = check_parity(make_step(fault), _task(), mesh=mesh, reference=ref_step)
    assert report.verdict == "FAIL"
    first = next(r for r in report.steps if not r.ok)
    if fault == "no_unscale":  # the gradients x1024 from the first step
        assert first.step == 0 and any(not e.ok for e in first.leaves if e.kind == "grad")
    elif fault == "local_finite":  # shard 0 skips while the others step: their copies differ
        assert first.step == SKIPPED and first.replica_mismatches
        said = _said(report, "skipped_step")
        assert (
            "differ across devices at a step the reference skipped: some devices stepped where others" in said
        )
        assert "its update matches" not in said
        text = report.localization.text()
        assert (
            "the reference left the leaf unchanged (a step it skipped) while the copies differ by up to"
            in text
        )
        assert "inf of the reference's largest change" not in text and "nan to nan" not in text
    elif fault == "counter_no_reset":  # the model's counter differs; the optimizer's count matches
        assert first.step == SKIPPED
        assert [e.name for e in first.leaves if not e.ok] == ["counter model.good_steps"]
        text = report.localization.text()
        assert "the applied parameters: differs (0 of 4 parameters and 1 of 1 model-state counter" in text
        assert "the optimizer's counters: matches (1 leaf)" in text and "the counters: matches" not in text
    else:  # the momentum moved where the reference's stayed
        assert first.step == SKIPPED
        assert {e.kind for e in first.leaves if not e.ok} == {"opt_state", "counter"}  # momentum, count
        said = _said(
            report, "skipped_step"
        )  # the parameters were restored: only the momentum and the count moved
        assert said.endswith(
            "its update differs: 4 of 4 optimizer-state leaves, 1 of 2 counters differ (counter step)."
        )
        assert (
            "parameters," not in said and "it applied an update where the reference skipped one" not in said
        )


@require_devices(S)
def test_the_correct_step_replays_its_skipped_step_and_a_fault_fails_against_it(mesh, tmp_path):
    """The replay reran the task's plain optimizer on the skipped step's NaN gradients: "FAIL (bitwise
    identical)", "the optimizer gives other values for param head.bias and 11 more (max abs err nan > nan"."""
    task = _task()
    recording = record_run(task, make_step(), mesh=mesh)
    assert skipped_steps(recording) == (SKIPPED,)
    recording.save(tmp_path / "run.npz")
    replayed = check_parity(make_step(), task, mesh=mesh, reference=str(tmp_path / "run.npz"))
    assert replayed.verdict == "PASS", replayed.diagnosis
    assert "skipped_step" in replayed.codes and "nan" not in replayed.diagnosis
    assert "its update matches" in _said(replayed, "skipped_step")
    failed = check_parity(make_step("local_finite"), task, mesh=mesh, reference=recording)
    assert failed.verdict == "FAIL"
    assert next(r for r in failed.steps if r.step >= 0 and not r.ok).step == SKIPPED
    said = _said(failed, "skipped_step")  # it read "its update matches" beside 14 leaves whose copies differ
    assert "differ across devices at a step the recorded run skipped: some devices stepped" in said
    assert "its update matches" not in said
