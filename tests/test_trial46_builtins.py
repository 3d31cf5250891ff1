"""Issue #36, trial 46 (a GPipe pipeline: two blocks stacked by ``nnx.vmap`` with their leading axis annotated over
'stage' and run by a ``lax.scan``, a replicated head, the user's ``jax.shard_map`` step on a ``data=2,stage=2``
mesh).

- The built-in ``dp`` and ``fsdp`` steps raised on such a model ("scan body function carry input and carry output
  must have equal types ... float32[8,16]{V:data} ... float32[8,16]{V:(data,stage)}"): the batch, replicated over
  'stage', entered the scan's carry invariant over it, and the gathered parameters, varying over every axis, made
  the carry leave varying. The batch is now typed varying over the model axes before the loss (a ``pcast``, no
  reduction): both PASS against the single-device step, and a user's pipeline that psums the head's gradients
  over 'data' where it should pmean them still FAILs against each as the reference.
- A step that updated the optimizer once per micro-batch read "every gradient differs, by no one factor: the
  forward pass computes another function of the parameters": the function is the reference's, taken at the
  parameters the updates within the step left; said so where the optimizer's counters are k x the reference's.
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
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh

D, OUT, STAGES, MICRO, B = 8, 2, 2, 2, 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(
            D,
            D,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None)),
            bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), (None,)),
            rngs=rngs,
        )

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class Pipe(nnx.Module):
    """Two blocks stacked over 'stage' (kernel (2, 8, 8) annotated ('stage', None, None)), run by a scan whose
    carry is the batch itself, then a replicated head."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=STAGES)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "stage"})
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(D, OUT, rngs=rngs)

    def __call__(self, x):
        graphdef, state = nnx.split(self.blocks)
        x, _ = jax.lax.scan(lambda x, s: (nnx.merge(graphdef, s)(x), None), x, state)
        return self.head(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches(n: int = 2):
    rng = np.random.default_rng(46)
    return [
        {
            "x": rng.normal(size=(B, D)).astype(np.float32),
            "y": rng.normal(size=(B, OUT)).astype(np.float32),
        }
        for _ in range(n)
    ]


TASK = Task(
    model=lambda: Pipe(nnx.Rngs(0)),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=_batches(),
    name="trial46-pipe",
)


@functools.lru_cache(maxsize=8)
def _pipeline(mesh, fault: str):
    """The user's GPipe shard_map: MICRO micro-batches a data shard, ppermute from stage 0 to 1, the last stage's
    loss; stage gradients pmean-ed over 'data', the head's psum-ed over 'stage' and pmean-ed over 'data'
    (``fault == "psum_head"``: psum-ed over 'data', 2 x the reference's)."""

    def body(w, b, hk, hb, x, y):
        s = jax.lax.axis_index("stage")
        w, b = (jax.lax.pcast(a, "data", to="varying") for a in (w, b))
        hk, hb = (jax.lax.pcast(a, ("data", "stage"), to="varying") for a in (hk, hb))

        def local(w, b, hk, hb):
            xs, ys = x.reshape(MICRO, -1, D), y.reshape(MICRO, -1, OUT)
            state, total = jnp.zeros_like(xs[0]), 0.0
            for t in range(MICRO + STAGES - 1):
                inp = jnp.where(s == 0, xs[min(t, MICRO - 1)] * (t < MICRO), state)
                out = jnp.tanh(inp @ w[0] + b[0])
                if t >= STAGES - 1:
                    mb = jnp.mean((out @ hk + hb - ys[t - STAGES + 1]) ** 2)
                    total = total + jnp.where(s == STAGES - 1, mb, 0.0)
                state = jax.lax.ppermute(out, "stage", [(0, 1)])
            return total / MICRO

        loss, (gw, gb, ghk, ghb) = jax.value_and_grad(local, argnums=(0, 1, 2, 3))(w, b, hk, hb)
        head = jax.lax.psum if fault == "psum_head" else jax.lax.pmean
        gw, gb = jax.lax.pmean(gw, "data"), jax.lax.pmean(gb, "data")
        ghk, ghb = (head(jax.lax.psum(g, "stage"), "data") for g in (ghk, ghb))
        return jax.lax.pmean(jax.lax.psum(loss, "stage"), "data"), gw, gb, ghk, ghb

    specs = (P("stage"), P("stage"), P(), P(), P("data"), P("data"))
    out_specs = (P(), P("stage"), P("stage"), P(), P())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs))


def _pipeline_step(fault: str = ""):
    def step(model, optimizer, batch, mesh):
        blk = model.blocks.linear
        loss, gw, gb, ghk, ghb = _pipeline(mesh, fault)(
            blk.kernel[...],
            blk.bias[...],
            model.head.kernel[...],
            model.head.bias[...],
            jnp.asarray(batch["x"]),
            jnp.asarray(batch["y"]),
        )
        grads = jax.tree.map(lambda a: a, nnx.state(model, nnx.Param))  # a copy, the parameters' structure
        nnx.replace_by_pure_dict(
            grads, {"blocks": {"linear": {"kernel": gw, "bias": gb}}, "head": {"kernel": ghk, "bias": ghb}}
        )
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module")
def mesh():
    require_devices(4)
    return make_mesh({"data": 2, "stage": 2})


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_the_builtin_step_runs_a_stacked_pipeline_model_and_passes(mesh, strategy):
    report = check_parity(strategy, TASK, mesh=mesh)
    assert report.verdict == "PASS" and report.codes[0] == "parity", str(report)
    assert all(abs(record.candidate_loss - record.loss) < 1e-5 for record in report.steps)
    grads = [e for record in report.steps for e in record.leaves if e.kind == "grad"]
    assert len(grads) == 2 * 4 and all(e.ok for e in grads), grads  # 4 parameter leaves a step, 2 steps


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_the_users_pipeline_passes_against_the_builtin(mesh, strategy):
    report = check_parity(_pipeline_step(), TASK, mesh=mesh, reference=strategy)
    assert report.verdict == "PASS", str(report)


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_a_psum_for_a_pmean_fails_against_the_builtin(mesh, strategy):
    report = check_parity(_pipeline_step("psum_head"), TASK, mesh=mesh, reference=strategy)
    assert report.verdict == "FAIL", str(report)
    grads = {e.path: e for e in report.steps[0].leaves if e.kind == "grad"}
    assert not grads["head.kernel"].ok and grads["head.kernel"].ratio == pytest.approx(2.0, rel=1e-4)
    assert grads["blocks.linear.kernel"].ok, grads


@nnx.jit
def _micro_train(model, optimizer, batch):
    """The optimizer updated on each of 2 micro-batches; the mean loss and gradient of the two."""
    losses, grads = [], []
    for m in range(MICRO):
        part = {k: v[m * B // MICRO : (m + 1) * B // MICRO] for k, v in batch.items()}
        loss, g = nnx.value_and_grad(functools.partial(loss_fn, batch=part))(model)
        optimizer.update(model, g)
        losses.append(loss)
        grads.append(g)
    return sum(losses) / MICRO, jax.tree.map(lambda *g: sum(g) / MICRO, *grads)


def _micro_step(model, optimizer, batch, loss_only=False):
    """:func:`_micro_train` as a step (``loss_only``: it returns the loss alone)."""
    loss, grads = _micro_train(model, optimizer, batch)
    return {"loss": loss} if loss_only else {"loss": loss, "grads": grads}


STEPPED = "the optimizer was stepped 2 times within the step (its counters are 2 x the reference's)"


def test_an_optimizer_stepped_per_micro_batch_is_said_as_the_loss_taken_at_other_parameters():
    report = check_parity(_micro_step, TASK)
    assert "step_counter" in report.codes, report.codes
    loc = report.localization
    assert loc.stage == "forward" and loc.step == 0, loc
    sentence = loc.form.sentence
    assert "another function of the parameters" not in sentence, sentence
    assert f"every gradient differs, by no one factor: {STEPPED}" in sentence, sentence
    assert (
        "the loss and gradients it returns are the reference's function taken at other parameters" in sentence
    )
    assert loc.form.factor is None


def test_the_correct_step_says_no_stepping_within_it():
    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch):
        loss, grads = train(model, optimizer, batch)
        return {"loss": loss, "grads": grads}

    report = check_parity(step, TASK)
    assert report.ok and report.localization is None, str(report)
    assert "stepped" not in str(report), str(report)


def test_a_loss_only_step_stepped_per_micro_batch_says_the_loss_alone_at_other_parameters():
    report = check_parity(functools.partial(_micro_step, loss_only=True), TASK)
    loc = report.localization
    assert loc.stage == "forward" and loc.form.factor is None, loc
    sentence = loc.form.sentence
    assert "the ratio of one scalar: no factor is read from it" in sentence, sentence
    assert f"{STEPPED}: the loss it returns is the reference's function taken at other parameters" in sentence
    assert "gradients it returns" not in sentence, sentence
