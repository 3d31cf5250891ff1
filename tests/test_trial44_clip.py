"""Trial 44's findings (a packed-sequence decoder LM with a token-weighted ``(sum, count)`` loss, optax.chain(
clip_by_global_norm, adamw), the user's shard_map step), each checked on both sides on a tiny MLP of the same
loss shape: a masked cross-entropy as ``(sum, count)`` with unequal counts per shard, clip + adam, 2 shards.

1. FAULT=clip_local: each shard clips its own token-weighted mean gradient to the global norm, then re-weights it
   by its token count before the psum: "no simple form", the clip never named. The ``clip_per_shard`` hypothesis
   tested the plain mean of the clipped shard gradients only; under a ``(sum, count)`` loss it now also tests
   their mean weighted by each shard's count over the total.
2. FAULT=embed_nopsum: the embedding's gradient never reduced; "the other 36 have gradients within tolerance:
   their copies differ downstream of it": the mechanism, the global-norm clip's coefficient computed per device
   from each device's own copies of every gradient, is now said where the task's optimizer clips so.
3. The command line's summary showed the first failing leaf at its first failing step under a "max abs err"
   header (the strategy's table showed a larger error for the same leaf at a later step): the headers now say
   what the row shows, and a caption line says it for a failing summary.
"""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.cli.verify import SUMMARY_CAPTION, render_summary

CLIP = 0.5  # binds on the full batch and on each shard at step 0


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.tanh(self.l1(x)))


def loss_fn(model, batch):
    """Token-weighted cross-entropy: ``(sum of the unmasked rows' losses, their count)``."""
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    m = batch["mask"]
    return jnp.sum(ce * m), jnp.sum(m)


_rng = np.random.default_rng(0)
# the first shard (rows 0-7) holds 7 tokens, the second (rows 8-15) 3: the shards' weights differ
_MASK = np.array([1, 1, 1, 1, 1, 1, 1, 0] + [1, 1, 1, 0, 0, 0, 0, 0], np.float32)
BATCHES = [
    {
        "x": (3.0 * _rng.normal(size=(16, 6))).astype(np.float32),
        "y": _rng.integers(0, 4, size=(16,)).astype(np.int32),
        "mask": _MASK,
    }
    for _ in range(2)
]


def _task() -> shardcheck.Task:
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2))
    return shardcheck.Task(model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=loss_fn, batches=BATCHES)


def make_step(fault: str = ""):
    """The user's data-parallel step over 'data': the loss sum's gradient and the count psum-ed, their quotient
    applied. ``"clip_local"``: each shard's own mean gradient clipped to ``CLIP``, re-weighted by its count, then
    psum-ed over the total count (trial 44); ``"clip_mean"``: each shard's clipped mean gradient pmean-ed."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))

        def body(state, batch):
            m, o = nnx.merge(graphdef, state)

            def mean(model):
                total, count = loss_fn(model, batch)
                return total / count, (total, count)

            (_, (total, count)), grads = nnx.value_and_grad(mean, has_aux=True)(m)
            n = jax.lax.psum(count, "data")
            if fault in ("clip_local", "clip_mean"):
                grads, _ = optax.clip_by_global_norm(CLIP).update(grads, optax.EmptyState())
            if fault == "clip_mean":
                grads = jax.lax.pmean(grads, "data")
            else:  # the shard's mean gradient times its count: its sum's gradient
                grads = jax.tree.map(lambda g: jax.lax.psum(g * count, "data") / n, grads)
            loss = jax.lax.psum(total, "data") / n
            o.update(m, grads)
            return loss, grads, nnx.state((m, o))

        specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        loss, grads, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
        nnx.update((model, optimizer), state)
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


def _summary(report) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(render_summary({"candidate": report}, "setup"))
    return [
        " ".join(line.replace("│", " ").replace("┃", " ").split()) for line in out.getvalue().splitlines()
    ]


@pytest.fixture(scope="module")
def clipped(mesh):
    """The correct step's report and the trial's clip_local step's, on the same task."""
    task = _task()
    return check_parity(make_step(), task, mesh=mesh), check_parity(make_step("clip_local"), task, mesh=mesh)


@require_devices(2)
def test_a_clip_of_each_shards_weighted_mean_is_named(clipped):
    """Each shard's token-weighted mean gradient clipped, re-weighted by its count: ``clip_per_shard`` (was
    ``localized``: "grad l2.kernel has no constant factor"); the correct step PASSes."""
    good, local = clipped
    assert good.ok, good.codes
    assert not local.ok and local.codes[0] == "clip_per_shard", local.codes
    msg = local.diagnoses[0].message
    assert msg.startswith("At step 0 the gradients differ (")
    assert "then the mean over the shards, plain or weighted by each shard's weight over the batch's" in msg


@require_devices(2)
def test_the_plain_mean_of_clipped_shards_is_still_named_under_a_weighted_loss(mesh):
    """Each shard's clipped mean gradient pmean-ed (no re-weighting by its count): ``clip_per_shard``, the first
    form the hypothesis tests."""
    plain = check_parity(make_step("clip_mean"), _task(), mesh=mesh)
    assert not plain.ok and plain.codes[0] == "clip_per_shard", plain.codes


def make_unreduced_step(fault: str = "nopsum"):
    """The user's step with ``l1.bias``'s gradient never reduced (``"nopsum"``, check_vma=False: each device
    applies its own shard's), the others psum-ed over the total count; ``""``: every gradient reduced."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))

        def body(state, batch):
            m, o = nnx.merge(graphdef, state)
            total_of = lambda model: loss_fn(model, batch)[0]  # noqa: E731
            total, grads = nnx.value_and_grad(total_of)(m)
            n = jax.lax.psum(loss_fn(m, batch)[1], "data")
            flat = nnx.to_flat_state(grads)
            for path, v in flat:
                local = fault == "nopsum" and path == ("l1", "bias")
                v.set_value(v[...] * 2 / n if local else jax.lax.psum(v[...], "data") / n)
            grads = nnx.from_flat_state(flat)
            o.update(m, grads)
            return jax.lax.psum(total, "data") / n, grads, nnx.state((m, o))

        specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
        loss, grads, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
        nnx.update((model, optimizer), state)
        return {"loss": loss, "grads": grads}

    return step


@require_devices(2)
def test_copies_that_differ_downstream_of_an_unreduced_gradient_name_the_global_norm_clip(mesh):
    """``l1.bias``'s gradient never reduced under clip + adam: the leaves whose gradients match but whose copies
    differ are said to differ through the clip's coefficient, which each device computes from its own copies of
    every gradient (was "downstream of it or by an unreduced gradient too small to show at this precision")."""
    report = check_parity(make_unreduced_step(), _task(), mesh=mesh)
    assert not report.ok and "replicas_differ" in report.codes, report.codes
    note = report.replica_failure.downstream
    assert note.endswith(
        "have gradients within tolerance: their copies differ downstream of it through the task's optimizer's "
        "global-norm clip (optax.clip_by_global_norm(0.5)), where it binds: each device computes its coefficient "
        "from its own copies of every gradient, it among them, so every leaf's update is scaled by another "
        "coefficient on each device"
    ), note


@require_devices(2)
def test_without_a_clip_no_clip_is_named_and_the_reduced_step_passes(mesh):
    """The same unreduced gradient under adam alone: no global-norm clip is named; every gradient reduced
    (under clip + adam) PASSes."""
    tx = optax.adam(1e-2)
    plain = shardcheck.Task(model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=loss_fn, batches=BATCHES)
    unclipped = check_parity(make_unreduced_step(), plain, mesh=mesh)
    assert not unclipped.ok and "clip_by_global_norm" not in str(unclipped), unclipped.codes
    assert check_parity(make_unreduced_step(""), _task(), mesh=mesh).ok


@require_devices(2)
def test_the_summary_says_its_leaf_is_the_first_failing_one(clipped):
    """The failing summary's leaf column is the first failing leaf at its step, with that leaf's errors there,
    under headers that say so and a caption line; a passing summary keeps the headers, without the caption."""
    good, local = clipped
    lines = _summary(local)
    header = (
        "strategy verdict first failing / worst leaf its abs err its rel err its allowed abs err diagnosis"
    )
    assert header in lines
    first = local.first_worst
    assert first.step == 0 and local.first_failing_leaf == first.name
    row = next(line for line in lines if line.startswith("candidate FAIL"))
    assert row.startswith(f"candidate FAIL {first.name} (step 0) {first.max_abs_err:.3g} ")
    assert " ".join(SUMMARY_CAPTION.split()) in " ".join(lines)
    passing = _summary(good)
    assert header in passing and "first failing step" not in " ".join(passing)
