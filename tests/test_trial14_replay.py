"""A bfloat16 replay of another correct step reads a gradient at rounding level as a live check does (issue #36,
trial 14: a top-2 MoE LM whose attention key biases have a true gradient of 0).

A bfloat16 step returns such a gradient as compute noise, some 40x ``atol_t``: the replay read it as an ordinary
gradient (``max|g| <= atol_t``), failed two correct steps of different placement on it and on the lr-sized Adam
updates that noise drives, while saying the leaf was at rounding level. Now the replay measures each gradient's
true gradient computed in float32 and its compute noise as a live check measures it
(``true_gradients.rounding_noise``): a gradient whose true gradient is within ``atol_t`` of 0 is at rounding level,
compared within twice that noise, and its parameter within both sides' update sizes. A real gradient off by x2
still fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Candidate, Task, check_parity
from shardcheck.parity.comparison.digest import compare_run
from shardcheck.parity.harness.recorded import record_run
from shardcheck.parity.harness.true_gradients import META_KEY
from shardcheck.parity.tolerance.derive import derive_tolerance

D, H, B, T = 8, 2, 8, 6


class _Attn(nnx.Module):
    def __init__(self, rngs):
        dt = jnp.bfloat16
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, dtype=dt, rngs=rngs)
        self.head = nnx.Linear(D, 4, dtype=dt, rngs=rngs)


def _loss(
    model, batch
):  # the key bias shifts every logit of a query alike: softmax drops it, its gradient is 0
    out = model.head(model.attn(batch["x"])).astype(jnp.float32)
    return jnp.mean((out - batch["y"]) ** 2)


def _task() -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(B, T, D)).astype(np.float32),
            "y": rng.normal(size=(B, T, 4)).astype(np.float32),
        }
        for _ in range(3)
    ]
    return Task(model=lambda: _Attn(nnx.Rngs(0)), optimizer=optax.adam(1e-3), loss_fn=_loss, batches=batches)


@nnx.jit(static_argnums=3)
def _train(model, optimizer, batch, factor):
    loss, grads = nnx.value_and_grad(_loss)(model, batch)
    grads["head"]["kernel"] = jax.tree.map(lambda g: g * factor, grads["head"]["kernel"])
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def _step(sharded: bool, factor: float = 1.0) -> Candidate:
    """The task's step, its batch whole on one device or (``sharded``) split over a data=2 mesh (GSPMD); the head's
    kernel gradient ``factor`` x (returned and applied)."""

    def step(model, optimizer, batch):
        if sharded:
            where = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), P("data"))
            batch = jax.device_put(batch, where)
        return _train(model, optimizer, batch, factor)

    return Candidate(name="sharded" if sharded else "whole", step=step, num_shards=2)


@pytest.fixture(scope="module")
def recording():
    return record_run(_task(), _step(False), num_shards=2)


@pytest.fixture(scope="module")
def replayed():
    """The sharded step's run as a replay records it (its float32-compute gradient and compute noise beside it)."""
    return record_run(_task(), _step(True), num_shards=2, true_gradients=True)


def _without_noise(run):
    """``run`` as the replay recorded it before the compute noise was kept (the trial's reading)."""
    held = {k: v for k, v in run.meta[META_KEY].items() if k not in ("true32", "noise")}
    return dataclasses.replace(run, meta={**run.meta, META_KEY: held})


@require_devices(2)
def test_only_the_key_bias_has_a_true_gradient_within_atol(replayed):
    held = replayed.meta[META_KEY]
    true, noise = held["true32"], held["noise"]
    atol = derive_tolerance("float32", batch_size=int(replayed.meta["terms"][0]), step=0).atol
    assert {p for p, per_step in true.items() if all(v <= atol for v in per_step)} == {"attn.key.bias"}
    assert min(min(per_step) for p, per_step in true.items() if p != "attn.key.bias") > 100 * atol
    assert _gmax(replayed, "attn.key.bias", 0) > 10 * atol  # the bfloat16 step's: its noise, far above atol
    assert all(_gmax(replayed, "attn.key.bias", t) <= n for t, n in enumerate(noise["attn.key.bias"]))


def _gmax(run, path, t):
    return float(run.steps.max[t, run.names.index("grad " + path)])


@require_devices(2)
def test_the_digest_comparison_reads_the_noise_and_without_it_is_the_trials_false_alarm(recording, replayed):
    assert compare_run(recording, replayed).ok
    old = compare_run(recording, _without_noise(replayed))
    assert not old.ok and old.first_failure.name == "grad attn.key.bias"
    assert {e.name for e in old.failures} >= {"grad attn.key.bias", "param attn.key.bias"}


@require_devices(2)
def test_two_correct_bfloat16_steps_pass_each_others_recording(recording):
    report = check_parity(_step(True), _task(), reference=recording)
    assert report.verdict == "PASS"
    assert {r.rounding_level for r in report.steps} == {("param attn.key.bias",)}
    said = next(d.message for d in report.diagnoses if d.code == "rounding_level")
    assert said.startswith("1 leaf has a gradient at rounding level (e.g. param attn.key.bias: ")
    assert not any("Even so" in d.message for d in report.diagnoses)
    grads = [e for r in report.steps for e in r.leaves if e.kind == "grad" and e.path == "attn.key.bias"]
    assert all(e.ok for e in grads) and max(e.max_abs_err for e in grads) > 1e-4  # the two runs' noise


@require_devices(2)
def test_a_real_gradient_x2_still_fails(recording):
    report = check_parity(_step(True, 2.0), _task(), reference=recording)
    assert report.verdict == "FAIL" and "summed" in report.codes
    first = next(r for r in report.steps if not r.ok)
    assert first.step == 0
    assert {e.path for e in first.leaves if e.kind == "grad" and not e.ok} == {"head.kernel"}
    found = next(d.message for d in report.diagnoses if d.code == "summed")
    assert (
        "the gradients of head.kernel (1 of 10 gradient leaves; every other gradient matches) are 2 x"
        in found
    )
