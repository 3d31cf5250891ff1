"""The diagnosis of a failing step on a scan-over-layers model whose layers hold RNG state (issue #34).

A Flax-docs-style model: each Block holds ``nnx.Dropout(0.0, rngs=rngs)`` (an RNG count) and
``nnx.MultiHeadAttention``; the layers are built by ``nnx.split_rngs`` + ``nnx.vmap`` and applied with
``nnx.scan``. A correct step PASSed, but every faulty one raised "Cannot extract graph node from different trace
level" in the diagnosis's re-checks: they merged the model from the outer jit's RNG state inside an inner
transform (``jax.lax.map`` / ``jax.grad``), so nnx.scan found Variables of another trace.
"""

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
from shardcheck.parity import shared_reference

V, D, T, L, S = 32, 16, 8, 2, 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
        self.drop = nnx.Dropout(0.0, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.drop(self.attn(self.norm(x)))
        return x + self.drop(nnx.relu(self.mlp(x)))


class ScanModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, scan: bool = True):
        self.scan = scan
        self.embed = nnx.Embed(V, D, rngs=rngs)
        if scan:

            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.head = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            x = body(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x.mean(axis=1))


def loss_fn(model, batch):
    """``(loss_sum, weight)``: the cross entropy summed over the rows the mask keeps, and their count."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["label"])
    return jnp.sum(ce * batch["w"]), jnp.sum(batch["w"])


def _task(scan: bool) -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {
            "tokens": rng.integers(0, V, (16, T)).astype(np.int32),
            "label": rng.integers(0, 4, (16,)).astype(np.int32),
            "w": (rng.random(16) < 0.7).astype(np.float32),
        }
        for _ in range(2)
    ]
    return Task(
        model=lambda: ScanModel(nnx.Rngs(params=0, dropout=1), scan=scan),
        optimizer=optax.adamw(1e-2),
        loss_fn=loss_fn,
        batches=batches,
        name="scan_rng" if scan else "loop_rng",
    )


@functools.partial(nnx.jit, static_argnums=3)
def _train(model, optimizer, batch, grad_factor):
    def mean_loss(m):
        total, weight = loss_fn(m, batch)
        return total / weight

    loss, grads = nnx.value_and_grad(mean_loss)(model)
    grads = jax.tree.map(lambda g: g * grad_factor, grads)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def _gspmd(model, optimizer, batch, mesh, grad_factor=1.0, loss_factor=1.0):
    """The plain step jitted on replicated state and a batch split over every mesh axis; ``grad_factor``: its
    gradients multiplied (S: a sum where a mean belongs); ``loss_factor``: its reported loss multiplied."""
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
    batch = jax.device_put(batch, NamedSharding(mesh, P(mesh.axis_names)))
    out = _train(model, optimizer, batch, grad_factor)
    return {"loss": out["loss"] * loss_factor, "grads": out["grads"]}


def correct(model, optimizer, batch, mesh):
    return _gspmd(model, optimizer, batch, mesh)


def summed(model, optimizer, batch, mesh):
    return _gspmd(model, optimizer, batch, mesh, grad_factor=float(S))


def loss_off_1pct(model, optimizer, batch, mesh):
    return _gspmd(model, optimizer, batch, mesh, loss_factor=1.01)


@pytest.fixture(scope="module")
def reports():
    require_devices(S)
    mesh = make_mesh(S)
    runs = [(True, correct), (True, summed), (True, loss_off_1pct), (False, loss_off_1pct)]
    tasks = {scan: _task(scan) for scan in (True, False)}
    with shared_reference():  # one reference run per model: each report is its own check's, bit for bit
        return {
            (scan, step.__name__): check_parity(step, tasks[scan], mesh=mesh, num_shards=S)
            for scan, step in runs
        }


def test_a_correct_step_on_the_scanned_rng_model_passes(reports):
    report = reports[True, "correct"]
    assert report.ok and report.verdict == "PASS" and report.codes[0] == "parity", str(report)


def test_a_summed_step_on_the_scanned_rng_model_fails_as_summed_at_s(reports):
    report = reports[True, "summed"]
    assert report.verdict == "FAIL" and report.codes[0] == "summed", str(report)
    assert f"x{S}" in report.diagnosis


def test_a_wrong_reported_loss_on_the_scanned_rng_model_fails_as_on_the_plain_model(reports):
    scanned, plain = reports[True, "loss_off_1pct"], reports[False, "loss_off_1pct"]
    assert scanned.verdict == "FAIL" and plain.verdict == "FAIL", (str(scanned), str(plain))
    assert scanned.codes == plain.codes and scanned.codes[0] == "loss_differs", (scanned.codes, plain.codes)
