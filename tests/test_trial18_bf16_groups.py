"""A loss that differs as a whole is not called one term of it where the gradients split only at their tolerances
(issue #36, trial 18).

Under bfloat16 compute, a ViT whose loss each shard divided by its own token count (the mean of per-shard means)
moved 31 of its 32 gradients 1.13 to 3.3 x their tolerances and the 32nd (blocks.1.ln2.scale) 0.90 x its own.
The group read "the loss's difference reaches the gradients of ... only (31 of 32 ...): a term of the loss whose
gradient reaches only these parameters (an auxiliary term ...)" and the form "one term of the loss differs", while
the same report named the normalization. Its replay, at 4 x looser tolerances, left 1 of 32 failing at 1.11 x (the
next at 0.98 x) and said the same of that one leaf. The group now says the split is the tolerance's and names the
matching leaves as within it; a term that reaches some parameters only (a regularization of one module, far
beyond the others' rounding) is still named so. Hand-built records, then a small bfloat16 model live.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.localization import forward_group, localize, tolerance_split
from shardcheck.parity.harness.recorded import record_run

TOL = 1e-2


def _grad(path, share, ratio=1.0):
    """A gradient leaf of reference size 1 whose error is ``share`` x its tolerance ``TOL`` (fails above 1)."""
    err = share * TOL
    ok = err <= TOL
    return LeafError(0, "grad", path, err, err, TOL, ok, ratio, None, (ratio - 0.2, ratio + 0.2), (4,))


def _loss(factor):
    err = abs(factor - 1) * 2.5
    return LeafError(0, "loss", "loss", err, err / 2.5, err / 2, False, factor, None, (factor, factor), ())


def _record(loss, grads):
    leaves = (loss, *grads, LeafError(0, "counter", "step", 0.0, 0.0, 0.0, True))
    return StepRecord(0, 1e-5, 1e-6, 2.5, 2.5 * loss.ratio, leaves, 1, 1)


def test_a_split_at_the_tolerances_is_not_one_term_of_the_loss():
    """Trial 18 live: 31 of 32 gradients 1.13 to 3.33 x their tolerances, the 32nd 0.896 x: the matching one is
    named as within its tolerance, and neither the group nor the form says a term of the loss."""
    shares = np.linspace(1.13, 3.33, 31)
    grads = [_grad(f"blocks.{i % 2}.m{i}.kernel", s) for i, s in enumerate(shares)]
    grads.append(_grad("blocks.1.ln2.scale", 0.896))
    worst, closest = tolerance_split(grads)
    assert round(worst, 2) == 3.33 and closest.path == "blocks.1.ln2.scale"
    group = forward_group(grads, {})
    assert "(31 of 32 gradient leaves differ, by at most 3.33 x their tolerances)" in group
    assert "the other 1 (blocks.1.ln2.scale) is within its tolerance, at 0.896 x it" in group
    assert "so the split is the tolerance's, not a term of the loss" in group
    assert "auxiliary" not in group and " only (" not in group
    loc = localize([_record(_loss(1.004), grads)])
    assert loc.stage == "forward" and loc.group == group
    assert "one term of the loss differs" not in loc.form.sentence
    assert loc.form.sentence.endswith(
        "the loss at equal parameters is 1.004 x the reference's; the gradients that differ and those that match "
        "lie within a few tolerances of each other (the group): no one term of the loss is told apart; the loss "
        "may differ as a whole"
    )


def test_one_leaf_just_beyond_a_replays_looser_tolerance_is_not_an_auxiliary_term():
    """Trial 18 replay: 1 of 32 failing at 1.11 x its tolerance, the closest matching one at 0.981 x."""
    grads = [_grad("blocks.0.ln1.scale", 1.11)] + [
        _grad(f"m{i}.kernel", s) for i, s in enumerate(np.linspace(0.1, 0.981, 31))
    ]
    group = forward_group(grads, {})
    assert group.startswith(
        "the loss's difference reaches the gradients of blocks.0.ln1.scale (1 of 32 gradient leaves differs, by "
        "1.11 x its tolerance); the other 31 (m0.kernel, m1.kernel, m10.kernel, m11.kernel, ...) are within their "
        "tolerances, up to 0.981 x (m30.kernel)"
    )
    assert "auxiliary" not in group and "only 1 of 32" not in group
    # the loss's ratio prints as 1 (a nudge, not a scale): its reading of the gradients says the same
    loc = localize([_record(_loss(1.0002), grads)])
    assert "one term of the loss differs" not in loc.form.sentence
    assert "no one term of the loss is told apart" in loc.form.sentence


def test_a_term_far_beyond_the_others_rounding_is_still_named_an_auxiliary_term():
    """The other side: the failing leaves 9 to 40 x their tolerances against matching ones at most 0.9 x (a
    clear gap, more than SPLIT_GAP = 8): a term of the loss reaches them only; one failing leaf no further than
    8 x the closest matching one's share is no gap."""
    grads = [_grad("router.kernel", 40.0, 3.0), _grad("router.bias", 9.0, 3.0)] + [
        _grad(f"expert{i}.kernel", 0.9) for i in range(6)
    ]
    assert tolerance_split(grads) is None
    group = forward_group(grads, {})
    assert group.startswith("the loss's difference reaches the gradients of router.* only (2 of 8")
    assert "an auxiliary term such as a load-balancing or regularization loss" in group
    loc = localize([_record(_loss(1.3), grads)])
    assert loc.form.sentence.endswith("only some gradients differ: one term of the loss differs (the group)")
    near = [_grad("router.kernel", 7.0)] + [_grad(f"expert{i}.kernel", 0.9) for i in range(6)]
    assert tolerance_split(near) is not None and "auxiliary" not in forward_group(near, {})
    # matching leaves at rounding level (a true gradient of 0) are no evidence of a split either way
    tiny = LeafError(0, "grad", "k.bias", TOL / 2, 1.0, TOL, True, None, None, None, (4,))
    assert tolerance_split([_grad("router.kernel", 2.0), tiny]) is None


# ------------------------------------------------------------------------ a small bfloat16 model, live

B = 16
D, H, C = 8, 32, 5


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(D, H, dtype=jnp.bfloat16, rngs=rngs)
        self.norm = nnx.LayerNorm(H, dtype=jnp.bfloat16, rngs=rngs)
        self.fc2 = nnx.Linear(H, H, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(H, C, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        h = nnx.gelu(self.norm(self.fc1(x)))
        return self.head(nnx.gelu(self.fc2(h)))


def loss_fn(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(ce * batch["w"]), jnp.sum(batch["w"])


def _batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        w = np.ones(B, np.float32)
        w[[0, 1, 9]] = 0.0  # 6 rows in shard 0, 7 in shard 1: counts close enough to move the loss little
        out.append(
            {
                "x": rng.normal(size=(B, D)).astype(np.float32),
                "y": rng.integers(0, C, B).astype(np.int32),
                "w": w,
            }
        )
    return out


TASK = Task(
    model=lambda: MLP(nnx.Rngs(0)),
    optimizer=optax.adam(1e-3),
    loss_fn=loss_fn,
    batches=_batches(),
    name="bf16-mlp",
)


def _step(loss):
    @nnx.jit
    def jitted(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value, grads

    def step(model, optimizer, batch, mesh):
        value, grads = jitted(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))
        return {"loss": value, "grads": grads}

    return step


def _full(model, batch):
    total, weight = loss_fn(model, batch)
    return total / weight


def _head_regularized(model, batch):
    """The full loss plus a regularization of the head alone (a term whose gradient reaches head.* only)."""
    return _full(model, batch) + 0.5 * jnp.sum(model.head.kernel[...].astype(jnp.float32) ** 2)


def _per_shard_means(model, batch):
    """Each of 2 shards divides its loss sum by its own count, then the shards are averaged (C4)."""
    halves = [jax.tree.map(lambda a, i=i: a[i * B // 2 : (i + 1) * B // 2], batch) for i in range(2)]
    return sum(loss_fn(model, h)[0] / loss_fn(model, h)[1] for h in halves) / 2


@require_devices(2)
def test_bf16_live_a_normalization_is_no_term_and_a_head_regularization_is_one():
    """A bfloat16 MLP on 2 shards of 6 and 7 weighted rows: each shard's own mean (the normalization, named) is not
    called a term of the loss; a regularization of the head alone is (its gradient far beyond the others')."""
    mesh = make_mesh(2)
    assert check_parity(_step(_full), TASK, mesh=mesh).ok
    report = check_parity(_step(_per_shard_means), TASK, mesh=mesh)
    assert not report.ok and "normalization" in report.codes, str(report)
    # 7 of 8 gradients 1.07 to 1.91 x their tolerances, the 8th 0.90 x its own (before: "an auxiliary term")
    group = report.localization.group
    assert "(7 of 8 gradient leaves differ, by at most 1.9" in group
    assert re.search(r"the other 1 \(norm\.scale\) is within its tolerance, at 0\.\d+ x it", group), group
    assert "so the split is the tolerance's, not a term of the loss" in group
    assert "auxiliary" not in report.diagnosis and "one term of the loss differs" not in report.diagnosis
    report = check_parity(_step(_head_regularized), TASK, mesh=mesh)
    assert not report.ok and report.localization.stage == "forward", str(report)
    assert report.localization.group.startswith("the loss's difference reaches the gradients of head.")
    assert "an auxiliary term such as a load-balancing or regularization loss" in report.localization.group


@require_devices(2)
def test_bf16_replay_names_the_normalization_the_live_check_names():
    """Trial 18's replay said 'update_differs' where the live check named the normalization: its hypothesis was
    compared at the rerun's float32 tolerances (29 x off), not within the replay's bfloat16 compute allowance
    (0.06 x). Now within it, where the candidate lies 4 x closer to the per-shard means' step than the full batch's
    does; a head regularization replayed is no normalization, and a correct step replays PASS."""
    mesh = make_mesh(2)
    recording = record_run(TASK, _step(_full), mesh=mesh, name="full")
    assert check_parity(_step(_full), TASK, mesh=mesh, reference=recording, name="full").ok
    report = check_parity(_step(_per_shard_means), TASK, mesh=mesh, reference=recording, name="full")
    assert not report.ok and "normalization" in report.codes, str(report)
    assert "reproduces the mean of per-shard means" in report.diagnosis
    assert "auxiliary" not in report.diagnosis
    report = check_parity(_step(_head_regularized), TASK, mesh=mesh, reference=recording, name="full")
    assert not report.ok and "normalization" not in report.codes, str(report)
