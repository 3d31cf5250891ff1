"""Trial 50: a user's step that gives its optimizer the gradients x2 while it returns the right ones.

1. Under a clip that binds (``clip_by_global_norm``, then SGD with momentum), the rerun of the reference's optimizer
   on S g reproduced the candidate's state (any factor past the clip's threshold does), so the step read "the
   gradients ... are 2 x the reference's: the gradient reduction summed instead of averaged" on ``data=2`` and
   "4 x ... (x4: a sum over 4 shards)" on ``data=4``: a cause the matching gradients refute, and a factor that
   followed the mesh. Now the factor is read from the state, the same on both meshes, and no reduction is blamed.
2. Without a clip, the same step read "the clipping coefficient differing from the global norm's by 2 ... Clip by
   the norm of the whole gradient": advice about a clip the optimizer does not hold. Now ``applied_scale``, live
   and replayed.
3. Returning no gradients, "momentum trace are 2 x ... (a wrong loss normalization or learning rate?)" beside a
   form saying "not a learning rate": a trace is written from the gradients, before any learning rate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.diagnosis.localization import contradiction
from shardcheck.parity.harness.recorded import record_run


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(6, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))[:, 0]


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _task(clip: float | None) -> Task:
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 6)).astype(np.float32), 3 * rng.normal(size=(16,)).astype(np.float32))
        for _ in range(2)
    ]
    sgd = optax.sgd(0.05, momentum=0.9)
    tx = sgd if clip is None else optax.chain(optax.clip_by_global_norm(clip), sgd)
    return Task(lambda: MLP(nnx.Rngs(0)), tx, loss_fn, batches, name="mlp")


@nnx.jit
def _doubled(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, jax.tree.map(lambda g: 2.0 * g, grads))  # the user's "learning rate x2"
    return loss, grads


def doubled(model, optimizer, batch):
    loss, grads = _doubled(model, optimizer, batch)
    return {"loss": loss, "grads": grads}


def doubled_loss_only(model, optimizer, batch):
    return _doubled(model, optimizer, batch)[0]


def _text(report) -> str:
    return " ".join(report.diagnosis.split())


@require_devices(4)
def test_a_gradient_applied_x2_under_a_binding_clip_is_no_reduction_and_no_mesh_factor():
    plain = _task(clip=None)
    norm = float(optax.tree.norm(nnx.grad(loss_fn)(plain.model(), plain.batches[0])))
    # the trial's case: the clip binds on 2 g, not on g (on both, the update would be the same: a PASS); every
    # factor past 1.5 then gives one update, S's among them
    task = _task(clip=1.5 * norm)
    reports = [check_parity(doubled, task, mesh=make_mesh({"data": s}), steps=1) for s in (2, 4)]
    for report in reports:
        text = _text(report)
        assert report.verdict == "FAIL" and report.codes[0] == "clip_coefficient", text
        assert "summed" not in report.codes and "sum over" not in text
        assert "the exposed gradients match the reference's, but momentum traces are 1.5 x" in text
    assert _text(reports[0]) == _text(reports[1]).replace("data=4", "data=2")  # the mesh's size says nothing


@require_devices(4)
def test_a_gradient_applied_x2_without_a_clip_is_an_applied_scale_live_and_replayed():
    task = _task(clip=None)
    mesh = make_mesh({"data": 4})
    live = check_parity(doubled, task, mesh=mesh, steps=1)
    recording = record_run(task, "fsdp", mesh=mesh, steps=1)
    replayed = check_parity(doubled, task, mesh=mesh, reference=recording)
    for report in (live, replayed):
        text = _text(report)
        assert report.verdict == "FAIL" and report.codes[0] == "applied_scale", text
        assert (
            "the exposed gradients match the reference's, but momentum traces are 2 x the reference's on every "
            "leaf: the optimizer was given the gradients 2 x, scaled after the ones returned (the task's "
            "optimizer holds no clip)" in text
        )
        assert "clip" not in text.replace("holds no clip", "")
        assert contradiction(report.localization.text(), report.steps) is None
    # the other side: a clip that does not bind leaves the factor 2 the optimizer's and the clip is named
    clipped = check_parity(doubled, _task(clip=1e6), mesh=mesh, steps=1)
    assert clipped.codes[0] == "clip_coefficient" and "momentum traces are 2 x" in _text(clipped)


@require_devices(4)
@pytest.mark.parametrize("clip", [None, 1e6])
def test_a_factor_read_from_the_momentum_trace_is_not_said_to_be_a_learning_rate(clip):
    report = check_parity(doubled_loss_only, _task(clip), mesh=make_mesh({"data": 4}), steps=1)
    text = _text(report)
    assert report.verdict == "FAIL" and "scaled" in report.codes, text
    assert "momentum traces are 2 x the reference's" in text
    assert "(a wrong loss normalization, or the gradients scaled before the optimizer?)" in text
    assert "or learning rate?" not in text


# ------------------------------------------------------------------- 4. a psum of per-shard means, loss only


def masked_loss(model, batch):
    """The masked squared error's sum and its count: a ``(loss_sum, weight)`` loss (rows of weight 0 padding)."""
    err = (model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]
    return jnp.sum(err), jnp.sum(batch["mask"])


def _masked_task() -> Task:
    rng = np.random.default_rng(1)
    mask = np.ones(16, np.float32)
    mask[[1, 2, 3, 6, 9]] = 0  # the 4 shards of 4 rows hold 1, 3, 3 and 4 rows that count
    batch = {
        "x": rng.normal(size=(16, 6)).astype(np.float32),
        "y": rng.normal(size=(16,)).astype(np.float32),
        "mask": mask,
    }
    return Task(lambda: MLP(nnx.Rngs(0)), optax.adam(1e-2), masked_loss, [batch], name="masked")


def _psum_of_means(returns_grads: bool):
    from jax.sharding import PartitionSpec as P

    def step(model, optimizer, batch, mesh):
        graphdef, params = nnx.split(model, nnx.Param)

        def body(p, b):
            p = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
            (total, count), g = jax.value_and_grad(
                lambda p: masked_loss(nnx.merge(graphdef, p), b), has_aux=True
            )(p)
            g = jax.tree.map(lambda x: jax.lax.psum(x / count, "data"), g)  # each shard's mean, summed
            return jax.lax.pmean(total / count, "data"), g

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
        loss, grads = jax.jit(mapped)(params, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads} if returns_grads else loss

    return step


@require_devices(4)
def test_a_psum_of_per_shard_means_is_named_with_or_without_the_gradients_returned():
    """Trial 50: with its gradients the step was named ``normalization`` (x4, a sum over S=4 shards); returning
    only its loss it read "not a single reduced step ... computed another way". Now named both ways, and the
    sentence of the loss-only step does not speak of returned gradients."""
    mesh, task = make_mesh({"data": 4}), _masked_task()
    with_grads = check_parity(_psum_of_means(True), task, mesh=mesh, steps=1)
    loss_only = check_parity(_psum_of_means(False), task, mesh=mesh, steps=1)
    for report in (with_grads, loss_only):
        text = _text(report)
        assert report.verdict == "FAIL" and report.codes[0] == "normalization", text
        assert "the shards' means were summed (a psum where a pmean was due), not averaged: x4" in text
        assert report.codes[:2] == ("normalization", "summed"), report.codes  # trial 58 C5
    assert "At step 0 the returned gradients are 4 x the mean of per-shard means" in _text(with_grads)
    assert (
        "At step 0 the parameters and optimizer state are the optimizer's step on 4 x the mean of per-shard means "
        "(the step returned no gradients)" in _text(loss_only)
    )


# ------------------------------------------------------------------- 5. gradients returned under another name


def test_gradients_returned_under_another_key_are_refused_naming_it_and_metrics_are_not():
    """Trial 50: ``{"loss": loss, "gradients": grads}`` was read as a step returning no gradients (CANNOT VERIFY,
    "Return the gradients from the step"); now refused naming the key. A metric beside the loss is still fine."""
    from shardcheck.parity.harness.candidates import unpack

    loss, grads = jnp.float32(1.0), {"w": jnp.ones(2)}
    with pytest.raises(
        TypeError,
        match=r"returned a mapping with 'gradients' but no 'grads' at step 3: .*"
        r"return them as \{'loss': loss, 'grads': grads\}",
    ):
        unpack({"loss": loss, "gradients": grads}, step=3)
    assert unpack({"loss": loss, "accuracy": jnp.float32(0.5)}) == (loss, None)
    assert unpack({"loss": loss, "grads": grads, "grad": grads})[1] is grads


# ------------------------------------------------------------------- 6. a gradient zeroed for one leaf


def _zeroed_bias(model, optimizer, batch):
    loss, grads = _zeroed_bias_step(model, optimizer, batch)
    return loss


@nnx.jit
def _zeroed_bias_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    grads["linear2"]["bias"][...] = jnp.zeros_like(
        grads["linear2"]["bias"][...]
    )  # the user's dropped gradient
    optimizer.update(model, grads)
    return loss, grads


def test_a_zeroed_gradient_whose_moments_stayed_is_not_said_to_be_a_learning_rate_of_0():
    """Trial 50: one bias's gradient zeroed under Adam (no gradients returned): "a zero update ... a learning rate of
    0 at this step (a schedule read one step early)" beside Adam's moments of that bias left at 0, which no
    learning rate does. Now the gradient of 0 (or a step that skipped the leaf) is the reading; the other side, a
    parameter alone left as it was while its moments moved, keeps the learning rate's reading
    (tests/test_trial47_zero.py)."""
    task = Task(lambda: MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, _task(None).batches, name="mlp")
    report = check_parity(_zeroed_bias, task, num_shards=2, steps=1)
    form = report.localization.form
    assert report.verdict == "FAIL" and form.kind == "zero", report.diagnosis
    assert (
        "the optimizer's moments of these parameters were left as they were too, which no learning rate does"
        in (form.sentence)
    )
    assert "their gradient was 0 at this step (dropped, zeroed or never reduced into them)" in form.sentence
    assert "a learning rate of 0" not in form.sentence
    assert contradiction(report.localization.text(), report.steps) is None
    # only an optimizer-state path is a moment: a parameter named mu (a VAE's mean layer) keeps the learning rate
    from shardcheck.parity.diagnosis.form import ZERO_MEANING, ZERO_STATE_MEANING, zero_meaning

    assert zero_meaning(["mu.kernel", "encoder.nu.bias"]) == ZERO_MEANING
    assert zero_meaning(["mu.kernel", "opt_state 0.mu.mu.kernel"]) == ZERO_STATE_MEANING


# ------------------------------------------------------------------- 7. "no simple form" that names "1 to 1"


def test_no_simple_form_names_the_leaves_factors_where_each_leaf_is_one_factor():
    """Trial 50 (a missing pcast, loss only): "no simple form ...; head.bias's elementwise ratio runs from 1 to 1"
    named the leaf of the widest absolute spread, itself constant. The spread is now read relative to the ratio's
    size; where every leaf is one factor across it, the leaves' factors are said. A leaf whose ratio spreads is
    still named with its range."""
    from shardcheck.parity.diagnosis.form import _no_form

    rng = np.random.default_rng(0)
    dr = {p: rng.normal(size=64) for p in ("mu.a", "nu.a", "b")}
    zero = np.zeros(64)
    f64 = {"mu.a": (zero, dr["mu.a"], 4 * dr["mu.a"]), "nu.a": (zero, dr["nu.a"], 16 * dr["nu.a"])}
    f64["b"] = (zero, dr["b"], dr["b"] * (1 + 1e-5 * rng.normal(size=64)))
    form = _no_form(f64)
    assert form.sentence.endswith(
        "fits the 3 leaves; each leaf's ratio is one factor across it, the leaves' factors differ: x4 (1 leaf), "
        "x16 (1 leaf), x1 (1 leaf)"
    )
    f64["b"] = (zero, dr["b"], dr["b"] * rng.uniform(0.5, 2.0, size=64))
    assert "; b's elementwise ratio runs from 0." in _no_form(f64).sentence


# ------------------------------------------------------------------- 8. the command line's words


def test_a_class_given_as_the_candidate_is_refused_as_a_class_and_record_help_names_no_reference(
    tmp_path, capsys
):
    """Trial 50: ``--candidate FILE:MLP`` (the model's class) ran and failed as "candidate step raised TypeError:
    MLP.__init__() got an unexpected keyword argument 'mesh'"; ``record --help`` said "with --reference gspmd",
    a flag record does not have."""
    from shardcheck.cli import main

    f = tmp_path / "user.py"
    f.write_text("class MLP:\n    def __init__(self, rngs):\n        pass\n")
    assert main(["verify", "--task", "diabetes", "--devices", "2", "--candidate", f"{f}:MLP"]) == 2
    assert f"'{f}:MLP' names the class MLP, not a step; a step is a function" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["record", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--reference" not in text
        and "with a mesh strategy (--strategy, default fsdp) its state is created" in text
    )


def test_a_loss_computed_per_shard_on_equal_shards_is_no_normalization():
    """Trial 50: per-shard batch statistics (BatchNorm in a shard_map step) read "the loss is normalized another way
    across the shards (the normalization named below)" beside the ``per_shard_loss`` finding; a per-shard mean of
    unequal shards keeps the normalization's words."""
    from shardcheck.parity.diagnosis.evidence import StepRecord
    from shardcheck.parity.diagnosis.localization import reduced_reading

    def record(*matches):
        return StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, (), 1, 1, matches=matches)

    assert reduced_reading(record("per_shard_loss")) == (
        "the loss is computed on each shard's rows alone and averaged (the per-shard loss named below)"
    )
    assert reduced_reading(record("per_shard_mean")) == (
        "the loss is normalized another way across the shards (the normalization named below)"
    )


@require_devices(4)
def test_a_replay_on_another_mesh_names_the_mesh_alone(tmp_path):
    """Trial 50: a replay on another mesh said "(it records task '/tmp/.../tblock.py:task', this run's is 'task')",
    the same task spelled otherwise, beside the mesh that was the cause; a missing file named ``Recording.save``,
    which the README never shows."""
    import dataclasses

    task = _task(None)
    path = tmp_path / "run.npz"
    record_run(task, "dp", mesh=make_mesh({"data": 4}), steps=1).save(path)
    renamed = dataclasses.replace(task, name="renamed")
    with pytest.raises(ValueError) as err:
        check_parity(doubled, renamed, mesh=make_mesh({"data": 2}), reference=str(path))
    assert "was recorded on mesh data=4 (S=4), not data=2 (S=2); replay it with" in str(err.value)
    assert "renamed" not in str(err.value)
    with pytest.raises(
        ValueError, match=r"pass the \.npz file shardcheck record --out or record_run\(\.\.\.\)\.save"
    ):
        check_parity(doubled, task, mesh=make_mesh({"data": 2}), reference=str(tmp_path / "nope.npz"))
