"""Issue #36, trial 44 (a packed-sequence decoder LM: segment ids and per-document positions in a dict batch, a
token-weighted loss with a z-loss term, clip + adamw on a warm-up cosine schedule, the user's own step): codes and
sentences the report's own stages contradicted.

- A step whose loss reads its batch otherwise (the mask dropped, positions from ``arange``, a loss term's
  coefficient scaled) read ``update_differs``, "not a single reduced step (shards applied one after another)",
  while the same report's stages said the forward pass differs first and the optimizer's update from equal inputs
  matches: it is ``forward_differs``, the loss computed another way at equal parameters, with the batch's keys
  beside its inputs and labels.
- A gradient 50x past its tolerance (relative error 2.6e-3) whose median ratio rounds to 1 read "ratio 1": its
  ratio is said with the digits that tell it from 1, and as no constant factor.
- A loss normalized per shard (a mean of per-shard means) read "the forward pass computes another function of the
  parameters" beside the normalization finding that names it: the same function, normalized another way.
- An optimizer stepped per micro-batch (only the loss returned) read "Group: only loss differs" beside stages whose
  optimizer state, parameters and counters differ, and "Form: a factor 0.9966" from the one scalar loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Candidate, Task, check_parity, make_mesh
from shardcheck.parity.diagnosis.evidence import LeafError, batch_keys
from shardcheck.parity.diagnosis.rules import _detail

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=1, decay_steps=4, end_value=1e-3)


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, pos):
        h = jnp.concatenate([x, jnp.sin(pos[:, None] * jnp.array([0.5, 1.0]))], axis=-1)
        return self.l2(nnx.gelu(self.l1(h)))


def _loss(model, batch, fault="", zcoef=1e-2):
    pos = jnp.arange(batch["x"].shape[0], dtype=jnp.float32) if fault == "arange" else batch["positions"]
    logits = model(batch["x"], pos)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    z = jax.nn.logsumexp(logits, axis=-1) ** 2
    w = jnp.ones_like(batch["weights"]) if fault == "nomask" else batch["weights"]
    coef = zcoef * 4 if fault == "zloss" else zcoef
    return jnp.sum((ce + coef * z) * w) / jnp.sum(w)


def _task() -> Task:
    rng = np.random.default_rng(44)
    batches = [
        {
            "x": rng.normal(size=(16, 4)).astype(np.float32),
            "targets": rng.integers(0, 3, size=16).astype(np.int32),
            "positions": rng.integers(0, 6, size=16).astype(np.float32),
            "weights": (rng.random(16) > 0.3).astype(np.float32),
        }
        for _ in range(2)
    ]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE, weight_decay=0.1))
    return Task(model=MLP, optimizer=tx, loss_fn=_loss, batches=batches, name="trial44-mlp")


def _step(fault: str) -> Candidate:
    @nnx.jit(static_argnums=3)
    def train(model, optimizer, batch, fault):
        loss, grads = nnx.value_and_grad(lambda m: _loss(m, batch, fault))(model)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        loss, grads = train(model, optimizer, batch, fault)
        return {"loss": loss, "grads": grads}

    return Candidate(name=fault or "correct", step=step)


def test_the_correct_step_passes():
    assert check_parity(_step(""), _task()).ok


@pytest.mark.parametrize("fault", ["nomask", "arange", "zloss"])
def test_a_loss_that_reads_its_batch_otherwise_is_read_as_the_forward_pass_not_as_shards_applied_in_turn(
    fault,
):
    report = check_parity(_step(fault), _task())
    assert not report.ok and report.localization.stage == "forward", report.localization
    said = {d.code: d.message for d in report.diagnoses}
    assert "forward_differs" in said and "update_differs" not in said, said
    text = said["forward_differs"]
    assert "not a single reduced step" not in text and "one after another" not in text, text
    assert "The optimizer's update from equal inputs matches" in text, text
    assert "computed another way at equal parameters" in text, text
    assert "the batch holds 'positions' and 'weights' beside its inputs and labels" in text, text


def test_batch_keys_leave_out_the_inputs_and_labels():
    batch = {"tokens": 0, "targets": 0, "segment_ids": 0, "positions": 0, "weights": 0}
    assert batch_keys(batch) == ("segment_ids", "positions", "weights")
    assert batch_keys((np.zeros(2), np.zeros(2))) == () and batch_keys(np.zeros(3)) == ()


def _grad(ratio: float, rel: float, kind: str = "grad") -> LeafError:
    return LeafError(
        step=0,
        kind=kind,
        path="head.kernel",
        max_abs_err=0.000233,
        max_rel_err=rel,
        tolerance=4.64e-06,
        ok=False,
        ratio=ratio,
        spread=(ratio, ratio),
    )


def test_a_ratio_that_explains_too_little_of_the_error_is_said_with_its_digits_as_no_constant_factor():
    said = _detail(_grad(0.99996, 0.00261))  # trial 44: "(... > tolerance 4.64e-06, ratio 1)"
    assert "ratio 1," not in said and not said.endswith("ratio 1"), said
    assert "no constant factor: its ratio 0.99996 moves it by 4e-05 of its largest value" in said, said
    assert "its error is 0.0026 of it" in said, said
    # the other side: a ratio that is the error's own factor keeps its plain reading
    assert _detail(_grad(0.5, 0.5)).endswith("ratio 0.5"), _detail(_grad(0.5, 0.5))
    assert _detail(_grad(0.9974, 0.00261)).endswith("ratio 0.9974")


# --------------------------------------------- a (loss_sum, weight) loss on a user's shard_map step over 2 shards


def _weighted(model, batch):
    logits = model(batch["x"], batch["positions"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["weights"]), jnp.sum(batch["weights"])


def _weighted_task() -> Task:
    rng = np.random.default_rng(4)
    batches = []
    for _ in range(2):
        weights = np.ones(16, np.float32)
        weights[:5] = 0.0  # uneven counts: 3 of 8 rows on the first shard, 8 of 8 on the second
        batches.append(
            {
                "x": rng.normal(size=(16, 4)).astype(np.float32),
                "targets": rng.integers(0, 3, size=16).astype(np.int32),
                "positions": rng.integers(0, 6, size=16).astype(np.float32),
                "weights": weights,
            }
        )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE, weight_decay=0.1))
    return Task(model=MLP, optimizer=tx, loss_fn=_weighted, batches=batches, name="trial44-weighted")


def _shard_map_step(fault: str):
    """The user's step: parameters replicated, rows split over 'data'; ``fault``: ``"local_norm"`` (each shard
    divides by its own count, then the means are averaged), ``"micro_sched"`` (2 micro-batches, the optimizer
    stepped on each: only the loss returned)."""

    def step(model, optimizer, batch, mesh):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        def body(p, b, graphdef):
            p = jax.lax.pcast(p, ("data",), to="varying")
            (s, c), g = jax.value_and_grad(lambda p: _weighted(nnx.merge(graphdef, p), b), has_aux=True)(p)
            if fault == "local_norm":
                return jax.lax.pmean(s / c, "data"), jax.tree.map(lambda x: jax.lax.pmean(x / c, "data"), g)
            ct = jax.lax.psum(c, "data")
            return jax.lax.psum(s, "data") / ct, jax.tree.map(lambda x: jax.lax.psum(x, "data") / ct, g)

        def run(b):
            graphdef, params = nnx.split(model, nnx.Param)
            params = jax.device_put(params, NamedSharding(mesh, P()))
            mapped = jax.shard_map(
                lambda p, b: body(p, b, graphdef), mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
            )
            loss, grads = jax.jit(mapped)(params, b)
            optimizer.update(model, grads)
            return loss, grads

        if fault == "micro_sched":
            half = len(batch["x"]) // 2
            losses = [run({k: v[m * half : (m + 1) * half] for k, v in batch.items()})[0] for m in range(2)]
            return {"loss": sum(losses) / 2}
        loss, grads = run(batch)
        return {"loss": loss, "grads": grads}

    return step


@require_devices(2)
def test_the_correct_shard_map_step_passes():
    assert check_parity(_shard_map_step(""), _weighted_task(), mesh=make_mesh({"data": 2})).ok


@require_devices(2)
def test_a_per_shard_normalization_is_said_as_the_same_function_normalized_otherwise():
    report = check_parity(_shard_map_step("local_norm"), _weighted_task(), mesh=make_mesh({"data": 2}))
    assert "normalization" in report.codes, report.codes
    form = report.localization.form.sentence
    assert "another function of the parameters" not in form, form
    assert "the loss is normalized another way across the shards (the normalization named below)" in form, (
        form
    )


@require_devices(2)
def test_an_optimizer_stepped_per_micro_batch_claims_no_loss_factor_nor_only_the_loss():
    report = check_parity(_shard_map_step("micro_sched"), _weighted_task(), mesh=make_mesh({"data": 2}))
    assert "step_counter" in report.codes, report.codes
    loc = report.localization
    assert loc.stage == "forward" and "only loss differs" not in loc.group, loc.group
    assert loc.group.startswith(
        "the loss, the forward stage's one leaf, differs (the gradients were not observed)"
    )
    assert "parameter leaves of the later stages differ too" in loc.group, loc.group
    assert loc.form.factor is None and not loc.form.sentence.startswith("a factor"), loc.form
    assert "the ratio of one scalar: no factor is read from it" in loc.form.sentence, loc.form
