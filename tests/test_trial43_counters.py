"""Issue #36, trial 43 (a Perceiver classifier under optax.chain(adaptive_grad_clip, lion), FSDP on data=2 x
fsdp=2): a counter whose dtype the step changed.

- The user's step pmeaned the whole optimizer state, turning Lion's int32 ``count`` into float32. The live check
  compared the counts by value (equal) and said "the counters: matches"; the replay named the counter as
  "recorded but this run has none" (the float leaf went by another name). Both now fail the counter as converted:
  "1.0.count is float32 in the candidate, int32 in the reference: the step converted an integer counter".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices, train_candidate
from flax import nnx

from shardcheck import Candidate, Task, check_parity

CONVERTED = "the step converted an integer counter (e.g. a pmean/psum of the whole optimizer state"


class MLP(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.gelu(self.l1(x)))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task() -> Task:
    rng = np.random.default_rng(43)
    batches = [
        {"x": rng.normal(size=(16, 6)).astype(np.float32), "y": rng.normal(size=(16, 2)).astype(np.float32)}
        for _ in range(2)
    ]
    tx = optax.chain(optax.adaptive_grad_clip(0.01), optax.lion(1e-3, weight_decay=0.01))
    return Task(model=MLP, optimizer=tx, loss_fn=_loss, batches=batches, name="trial43-mlp")


def _step(convert: bool) -> Candidate:
    """The user's step; ``convert``: after the update its optimizer state's integer leaves become float32, as a
    pmean of the whole optimizer state leaves them."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        if convert:
            state = nnx.state(optimizer, nnx.optimizer.OptState)
            floats = jax.tree_util.tree_map(
                lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.integer) else x, state
            )
            nnx.update(optimizer, floats)
        return loss, grads

    return train_candidate(f"convert-{convert}", train)


def test_a_counter_converted_to_float_fails_live_named_as_converted():
    from shardcheck.cli.verify import error_cells

    task = _task()
    assert check_parity(_step(False), task).ok  # the other side: the correct step passes
    report = check_parity(_step(True), task)
    assert not report.ok
    text = str(report) + " ".join(d.message for d in report.diagnoses)
    assert "1.0.count is float32 in the candidate, int32 in the reference: " + CONVERTED in text, text
    assert "the counters: matches" not in text
    converted = [e for r in report.steps for e in r.leaves if e.dtypes is not None]
    assert converted and all(e.kind == "counter" and not e.ok for e in converted)
    assert {e.dtypes for e in converted} == {("int32", "float32")}
    assert error_cells(converted[0]) == ("float32, not int32", "-", "-")


def test_a_counter_converted_to_float_fails_replayed_named_as_converted():
    from shardcheck.parity.harness.recorded import record_run

    task = _task()
    recording = record_run(task, _step(False))
    assert check_parity(_step(False), task, reference=recording).ok  # the other side: the correct step passes
    report = check_parity(_step(True), task, reference=recording)
    assert not report.ok
    text = " ".join(d.message for d in report.diagnoses)
    assert "1.0.count is float32 in the candidate, int32 in the reference: " + CONVERTED in text, text
    assert "is recorded but this run has none" not in text


# ------------------------------------------------------- a bfloat16 all-reduce, live and replayed (findings 2, 3)


def _reduce_in(dtype):
    """The user's shard_map step on a ``data`` mesh: each shard's gradient of its rows' share of the batch mean,
    gathered and summed in ``dtype`` (bfloat16: an all-reduce in bfloat16)."""
    from jax.sharding import PartitionSpec as P

    def step(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
        def loss_and_grads(params, batch):
            params = jax.lax.pcast(params, "data", to="varying")
            rows = jax.lax.psum(batch["x"].shape[0], "data")

            def local(p):
                out = nnx.merge(graphdef, p, rest)(batch["x"])
                return jnp.sum((out - batch["y"]) ** 2) / (rows * 2)

            loss, grads = jax.value_and_grad(local)(params)

            def reduce(g):
                parts = jax.lax.all_gather(g.astype(dtype), "data")
                total = parts[0]
                for i in range(1, parts.shape[0]):
                    total = (total + parts[i]).astype(dtype)
                return total.astype(g.dtype)[None]

            return jax.lax.psum(loss, "data"), jax.tree.map(reduce, grads)

        batch = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
        loss, stacked = loss_and_grads(params, batch)
        grads = jax.tree.map(lambda a: a[0], stacked)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


def _adam_task() -> Task:
    rng = np.random.default_rng(7)
    batches = [
        {"x": rng.normal(size=(32, 6)).astype(np.float32), "y": rng.normal(size=(32, 2)).astype(np.float32)}
        for _ in range(2)
    ]
    return Task(model=MLP, optimizer=optax.adam(1e-3), loss_fn=_loss, batches=batches, name="trial43-bf16")


@require_devices(4)
def test_a_bf16_all_reduce_says_the_gradients_differ_not_the_update():
    import shardcheck

    mesh = shardcheck.make_mesh(4)
    task = _adam_task()
    assert check_parity(_reduce_in(jnp.float32), task, mesh=mesh, num_shards=4).ok  # the other side
    bad = check_parity(_reduce_in(jnp.bfloat16), task, mesh=mesh, num_shards=4)
    assert not bad.ok and "low_precision_reduction" in bad.codes, str(bad)
    said = next(d.message for d in bad.diagnoses if d.code == "low_precision_reduction")
    assert said.startswith(
        "At step 0 the gradients differ from the reference by about bfloat16's rounding"
    ), said


@require_devices(4)
def test_a_bf16_all_reduce_is_named_replayed_as_live():
    import shardcheck
    from shardcheck.parity.harness.recorded import record_run

    mesh = shardcheck.make_mesh(4)
    task = _adam_task()
    recording = record_run(task, _reduce_in(jnp.float32), mesh=mesh, num_shards=4)
    good = check_parity(_reduce_in(jnp.float32), task, mesh=mesh, num_shards=4, reference=recording)
    assert good.ok and "low_precision_reduction" not in good.codes  # the other side
    bad = check_parity(_reduce_in(jnp.bfloat16), task, mesh=mesh, num_shards=4, reference=recording)
    assert not bad.ok and "low_precision_reduction" in bad.codes, str(bad)
    said = next(d.message for d in bad.diagnoses if d.code == "low_precision_reduction")
    assert said.startswith(
        "At step 0 the gradients differ from the reference by about bfloat16's rounding"
    ), said


# ------------------------------------------------------------------------ a bitwise replay (finding 6)


class Attend(nnx.Module):
    """Self-attention whose key bias has a gradient at rounding level (a constant shift of each query's scores)."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.attn(x).mean(axis=1))


def _attend_task() -> Task:
    rng = np.random.default_rng(5)
    batches = [
        {"x": rng.normal(size=(8, 4, 8)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(2)
    ]
    return Task(model=Attend, optimizer=optax.adam(1e-3), loss_fn=_loss, batches=batches, name="trial43-attn")


def test_a_bitwise_replay_does_not_say_its_leaves_cannot_be_compared():
    from shardcheck.parity.harness.recorded import record_run

    task = _attend_task()
    live = check_parity(_step(False), task)
    # the other side: a live check (no hashes) keeps the note on the key bias
    assert live.ok and "rounding_level" in live.codes, live.codes
    recording = record_run(task, _step(False))
    replayed = check_parity(_step(False), task, reference=recording)
    assert replayed.ok and replayed.replay.bitwise, str(replayed)
    assert "rounding_level" not in replayed.codes
    assert "cannot be compared element by element" not in str(replayed)


# ------------------------------------------------------- two ratios of one leaf, each with its source (finding 4)

RERUN = "over every element, against the reference's update from equal inputs"


def _stretched(stretch: float) -> Candidate:
    """The user's step; its update of each parameter element stretched by ``1 + stretch |p|`` (no factor, no
    decay term: a ratio that runs across the leaf)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        before = nnx.state(model, nnx.Param)
        before = jax.tree.map(jnp.copy, before)
        optimizer.update(model, grads)
        after = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda b, a: b + (a - b) * (1 + stretch * jnp.abs(b)), before, after))
        return loss, grads

    return train_candidate(f"stretch-{stretch}", train)


def test_a_ratio_read_against_the_rerun_says_so_live_and_replayed():
    from shardcheck.parity.harness.recorded import record_run

    task = _adam_task()
    assert check_parity(_stretched(0.0), task).ok  # the other side
    live = check_parity(_stretched(5.0), task)
    assert not live.ok and RERUN in live.localization.text(), live.localization.text()
    recording = record_run(task, _stretched(0.0))
    replayed = check_parity(_stretched(5.0), task, reference=recording)
    where = replayed.localization.text()
    assert not replayed.ok and RERUN in where, where
    # the digests' error is said as theirs where the rerun's is beside it
    assert "read from the recorded digests (max, norm and samples), not every element" in where, where
