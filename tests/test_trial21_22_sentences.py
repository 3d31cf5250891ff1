"""Issue #36, trials 21 (LoRA fine-tuning of a tiny LM, data=2 x fsdp=2) and 22 (a CLIP-style dual encoder, data=4):
sentences that the records contradicted, each checked here on both sides.

- A temperature held by a saturated clamp has a gradient of exactly 0 while Adam's moments still move it; a step
  that skipped its update there PASSed, and the report called the gradient "rounding noise" (trial 22). The update
  check now fails it, and the sentence says the gradient is 0.
- "raise the learning rate" was said of a frozen leaf (an ``optax.set_to_zero`` group), whose reference update is
  exactly 0 at every step (trial 21).
- A x2 on the LoRA B factors only (alpha / rank applied twice) read as a psum over 'data' or 'fsdp' once too often,
  as a fact (trial 21): a factor on a subset of the leaves now names the per-module multiplier beside it.
- A gradient of zeros on both sides (a LoRA factor A while B is 0) counted as a matching leaf that would have shown
  a factor (trial 21).
- A replay's step whose pre-step state was bitwise the recording's read "(run from the reference's pre-step state)",
  where a replay re-runs nothing from the reference's state (trial 22).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.parity.comparison.live import leaf_error
from shardcheck.parity.diagnosis.evidence import LeafError, start_words, would_show
from shardcheck.parity.harness.recorded import record_run


class _Clamped(nnx.Module):
    """A linear map scaled by a temperature clamped to [0, 1], started at 0.9: Adam moves it past 1 at step 0,
    where the clamp holds its gradient at exactly 0 while its moments keep moving it."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 2, rngs=rngs)
        self.t = nnx.Param(jnp.asarray(0.9, jnp.float32))

    def __call__(self, x):
        return self.dense(x) * jnp.clip(self.t[...], 0.0, 1.0)


def _clamped_loss(model, batch):
    """Lowered by raising the temperature while the clamp lets it (its gradient is negative below 1)."""
    return jnp.mean((model(batch["x"]) - 2.0 * model.dense(batch["x"])) ** 2 + 0.1 * batch["y"].sum())


def _clamped_task() -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(3)
    ]
    return Task(
        model=lambda: _Clamped(nnx.Rngs(0)),
        optimizer=optax.adam(0.2),
        loss_fn=_clamped_loss,
        batches=batches,
        name="clamped_temperature",
    )


@nnx.jit
def _clamped_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: _clamped_loss(m, batch))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def clamped_correct(model, optimizer, batch):
    return _clamped_step(model, optimizer, batch)


def freeze_clamped(model, optimizer, batch):
    """The temperature's update skipped where its gradient is 0 (the clamp holds it)."""
    before = jnp.array(model.t[...])
    out = _clamped_step(model, optimizer, batch)
    model.t[...] = jnp.where(out["grads"]["t"][...] == 0.0, before, model.t[...])
    return out


@require_devices(2)
def test_a_gradient_of_exactly_0_is_said_so_and_a_skipped_update_there_fails():
    good = check_parity(clamped_correct, _clamped_task(), num_shards=2)
    assert good.ok, str(good)
    zero = [r for r in good.steps if "param t" in r.unresolved]
    assert zero, [r.unresolved for r in good.steps]  # the clamp holds it: allowed lr-sized, as rounding noise
    grad_t = next(e for e in zero[0].leaves if e.name == "grad t")
    assert grad_t.max_abs_err == 0.0 and grad_t.ratio is None  # zeros on both sides
    said = next(d.message for d in good.diagnoses if d.code == "rounding_level")
    assert "a gradient of exactly 0 on both sides" in said and "rounding noise" not in said
    bad = check_parity(freeze_clamped, _clamped_task(), num_shards=2)
    assert not bad.ok
    assert bad.codes[0] == "update_rerun", bad.codes
    assert bad.localization.stage == "optimizer"
    assert {e.path for e in bad.steps[bad.localization.step].update_only} == {"t"}


def _frozen_task() -> Task:
    """A linear regression whose bias is frozen by the optimizer (``optax.set_to_zero`` in ``multi_transform``)."""
    rng = np.random.default_rng(1)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(2)
    ]
    labels = lambda params: jax.tree.map(lambda p: "train" if p.ndim == 2 else "frozen", params)  # noqa: E731
    tx = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    return Task(
        model=lambda: nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
        optimizer=tx,
        loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
        batches=batches,
        name="frozen_bias",
    )


@nnx.jit
def _frozen_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def frozen_correct(model, optimizer, batch):
    return _frozen_step(model, optimizer, batch)


def frozen_trained(model, optimizer, batch):
    """The frozen bias trained by SGD beside the optimizer (the base weights trained)."""
    out = _frozen_step(model, optimizer, batch)
    model.bias[...] = model.bias[...] - 1e-4 * out["grads"]["bias"][...]
    return out


@require_devices(2)
def test_a_frozen_leaf_is_not_called_weak_and_training_it_fails():
    good = check_parity(frozen_correct, _frozen_task(), num_shards=2)
    assert good.ok, str(good)
    bias = [e for r in good.steps for e in r.leaves if e.name == "param bias"]
    assert all(e.reference_change == 0.0 for e in bias)  # frozen: the reference never moves it
    assert "weak_check" not in good.codes, good.diagnosis
    bad = check_parity(frozen_trained, _frozen_task(), num_shards=2)
    assert not bad.ok
    where = bad.localization
    assert where.form.kind == "reference_zero"
    assert "freezes" in where.form.sentence  # the frozen group first among its readings


def test_a_gradient_of_zeros_on_both_sides_shows_no_factor():
    """``LeafError.zeros`` (both sides all zeros, as ``leaf_error`` and the first pass record it) shows no factor;
    equal values whose size is unknown still may."""
    zeros = LeafError(0, "grad", "a.lora_a", 0.0, 0.0, 1e-6, True, None, None, None, (4, 8), zeros=True)
    equal = LeafError(0, "grad", "a.kernel", 0.0, 0.0, 1e-6, True, None, None, None, (4, 8))
    moved = LeafError(0, "grad", "a.bias", 1e-7, 1e-7, 1e-6, True, 1.0, None, (1.0, 1.0), (8,))
    assert not would_show(zeros, 2.0)  # nothing in it could show a factor
    assert would_show(equal, 2.0)  # equal values of unknown size (a first-pass record: no ratio)
    assert would_show(moved, 2.0)  # |g| = 1: a x2 moves it by 1 > 1e-6
    assert leaf_error(0, "grad", "g", np.zeros(3), np.zeros(3), 1e-5, 1e-7).zeros
    assert not leaf_error(0, "grad", "g", np.ones(3), np.ones(3), 1e-5, 1e-7).zeros


class _TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.base = nnx.Linear(4, 6, rngs=rngs)
        self.adapter = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        return self.adapter(nnx.relu(self.base(x)))


def _two_layer_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _two_layer_task() -> Task:
    rng = np.random.default_rng(2)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(2)
    ]
    return Task(
        model=lambda: _TwoLayers(nnx.Rngs(0)),
        optimizer=optax.sgd(0.05),
        loss_fn=_two_layer_loss,
        batches=batches,
        name="two_layers",
    )


@nnx.jit
def _adapter_twice(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: _two_layer_loss(m, batch))(model)
    grads["adapter"] = jax.tree.map(lambda g: 2.0 * g, grads["adapter"])
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def adapter_twice(model, optimizer, batch, mesh):
    """The adapter's gradients x2 (its scale applied twice), on a data x fsdp mesh of axes of size 2."""
    return _adapter_twice(model, optimizer, batch)


@require_devices(4)
def test_a_factor_on_some_leaves_that_is_an_axis_size_names_the_module_multiplier_too():
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    report = check_parity(adapter_twice, _two_layer_task(), mesh=mesh)
    assert not report.ok
    found = next(d for d in report.diagnoses if d.code == "summed")
    assert "once too often" in found.message  # the reduction reading stays
    assert "per-module multiplier of 2" in found.message  # beside the module's own scale


@require_devices(2)
def test_a_replay_says_its_step_started_bitwise_from_the_recording_not_run_from_the_reference():
    task = _two_layer_task()
    recording = record_run(task, _plain, num_shards=2, name="plain")
    second = np.asarray(task.batches[1]["x"])

    def late(model, optimizer, batch):
        """Correct at step 0; on the second batch the adapter's gradients x2."""
        faulty = np.array_equal(np.asarray(batch["x"]), second)
        return (_adapter_twice if faulty else _plain_step)(model, optimizer, batch)

    report = check_parity(late, task, reference=recording, num_shards=2)
    where = report.localization
    assert where.step == 1 and where.synchronized  # its state before step 1 was the recording's, bitwise
    text = where.text()
    assert start_words(False) in text
    assert start_words(True) not in text


@nnx.jit
def _plain_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: _two_layer_loss(m, batch))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def _plain(model, optimizer, batch):
    return _plain_step(model, optimizer, batch)


def test_start_words_name_where_a_step_started():
    assert start_words(True) == " (run from the reference's pre-step state)"
    assert start_words(False) == " (from a pre-step state bitwise the recording's)"


def test_a_loss_4x_whose_gradients_spread_around_4_is_not_called_another_function():
    """Trial 22 under bfloat16: the loss divided by the local count (x4 at equal parameters), every gradient about
    4 x, their elements' ratios spread by the compute's rounding: "a scaled loss", not "another function"; a
    factor of 1.004 is no scale read this way, and medians far from the loss's factor are not either."""
    from shardcheck.parity.diagnosis.form import Form
    from shardcheck.parity.diagnosis.localization import forward_form

    loss = LeafError(0, "loss", "loss", 3.0, 3.0, 1e-3, False, 4.0, None, (4.0, 4.0), ())
    grads = [
        LeafError(0, "grad", f"m{i}.kernel", 3.0 * r, 3.0, 1e-3, False, r, None, (r - 2.0, r + 2.0), (4, 4))
        for i, r in enumerate((3.9, 4.05, 4.2))
    ]
    said = forward_form(Form("factor", "a factor 4", factor=4.0), [loss], grads).sentence
    assert "every failing gradient's median ratio is near 4 (3.9..4.2)" in said
    assert "the whole loss is likely scaled" in said and "not a scaled loss" not in said
    far = [dataclasses.replace(g, ratio=r) for g, r in zip(grads, (2.0, 4.0, 6.0), strict=True)]
    assert "not a scaled loss" in forward_form(Form("factor", "a factor 4", factor=4.0), [loss], far).sentence


def test_the_setup_line_names_a_bfloat16_model_s_compute_dtype():
    """Trial 21: a bfloat16 model's check never said bfloat16 (the setup line named the matmul precision only)."""
    from types import SimpleNamespace

    from shardcheck.cli.verify import _model_dtype_text

    said = _model_dtype_text(SimpleNamespace(compute_dtype="bfloat16"))
    assert said == ", compute dtype bfloat16 (the model's layers: the tolerances' policy)"
    assert _model_dtype_text(SimpleNamespace(compute_dtype="float32")) == ""
    assert _model_dtype_text(SimpleNamespace(compute_dtype="")) == ""  # a replay: not known


def test_the_uneven_split_fix_warns_a_row_coupled_loss_of_padding():
    """Trial 22: ``--mesh data=3`` on a contrastive task was told to pad with weight-0 rows, which a loss scoring
    each row against the batch still sees."""
    from shardcheck.task import check_divisible

    batch = {"x": np.zeros((16, 2), np.float32)}
    for weighted in (True, False):
        with pytest.raises(ValueError, match="not divisible by num_shards=3") as err:
            check_divisible("check_parity", batch, 3, weighted=weighted)
        assert "give it a batch size divisible by S instead" in str(err.value)
        said = str(err.value)  # trial 58 D: one level of parentheses, closed once
        assert (
            said.endswith("divisible by S instead)")
            and "))" not in said
            and said.count("(") == said.count(")")
        )
    check_divisible("check_parity", batch, 4, weighted=False)  # 16 rows split in 4: no error


def _contrastive_loss(model, batch):
    """InfoNCE of two views of each row, every other row of the batch a negative: couples the rows."""
    a, b = model(batch["x"]), model(batch["y"])
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    logits = 5.0 * a @ b.T
    return -jnp.mean(jax.nn.log_softmax(logits, axis=-1).diagonal())


def _contrastive_task() -> Task:
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(2):
        x = rng.normal(size=(8, 6)).astype(np.float32)
        batches.append({"x": x, "y": (x + 0.1 * rng.normal(size=x.shape)).astype(np.float32)})
    return Task(
        model=lambda: nnx.Linear(6, 4, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=_contrastive_loss,
        batches=batches,
        name="contrastive",
    )


def _local_negatives_loss(model, batch):
    """Each of 2 shards scores its rows against its own rows only, the shards' losses averaged."""
    halves = [jax.tree.map(lambda a, i=i: a[4 * i : 4 * i + 4], batch) for i in range(2)]
    return sum(_contrastive_loss(model, h) for h in halves) / 2


@nnx.jit
def _local_negatives(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: _local_negatives_loss(m, batch))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def local_negatives(model, optimizer, batch):
    return _local_negatives(model, optimizer, batch)


@require_devices(2)
def test_a_contrastive_loss_computed_per_shard_is_named_from_its_loss_live_and_replayed():
    """Trial 22: negatives from the local shard only read update_differs; the loss the step returns is the task's
    loss computed per shard and combined, which names it (per_shard_loss), live and replayed."""
    task = _contrastive_task()
    live = check_parity(local_negatives, task, num_shards=2)
    assert live.codes[0] == "per_shard_loss", live.codes
    said = next(d.message for d in live.diagnoses if d.code == "per_shard_loss")
    first = live.steps[0]
    assert f"the loss the step returns ({first.candidate_loss:.7g})" in said and "all_gather" in said
    recording = record_run(task, _contrastive_correct, num_shards=2, name="full")
    replayed = check_parity(local_negatives, task, reference=recording, num_shards=2)
    assert replayed.codes[0] == "per_shard_loss", replayed.codes


@nnx.jit
def _contrastive_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: _contrastive_loss(m, batch))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def _contrastive_correct(model, optimizer, batch):
    return _contrastive_step(model, optimizer, batch)


@require_devices(2)
def test_a_correct_contrastive_step_passes_and_a_scaled_loss_is_not_called_per_shard():
    task = _contrastive_task()
    assert check_parity(_contrastive_correct, task, num_shards=2).ok
    doubled = check_parity(_doubled_contrastive, task, num_shards=2)
    assert not doubled.ok and "per_shard_loss" not in doubled.codes, doubled.codes


@nnx.jit
def _doubled_step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(lambda m: 2.0 * _contrastive_loss(m, batch))(model)
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def _doubled_contrastive(model, optimizer, batch):
    return _doubled_step(model, optimizer, batch)
