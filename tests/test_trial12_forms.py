"""Two forms a new user's trial said falsely (issue #36, trial 12: a stateful diagonal-SSM LM, truncated BPTT, its
last hidden state kept in an ``nnx.Variable`` the forward pass writes), each side tested with values:

- a carry written back for data shard 0's rows only (rows 4..7 kept): live it read "by other amounts ... a
  running-average momentum"; it is now a write that covers part of the leaf (``state_partial``), live with the
  rows and replayed from the recorded samples (the replay had passed step 0); a momentum 0.99 in place of 0.9
  still reads as ``state_amount`` (tests/test_floating_state.py);
- a coupled weight decay (``add_decayed_weights`` before ``sgd`` with momentum) whose mask holds one parameter
  more, at a step whose learning rate is 0 (a warm-up from 0): the parameters match and the momentum trace differs
  by ``0.01 param``; live and replayed it read "no simple form"; it is now ``state_decay`` with ``c = 0.01``, and
  a gradient factor is no decay;
- a parameter update of some rows only is the ``partial`` form, on arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.parity.comparison.partial_write import partial_write
from shardcheck.parity.diagnosis.form import fit_form
from shardcheck.parity.harness.recorded import record_run


class Carry(nnx.Variable):
    """The last hidden state of each row, carried between batches."""


class Stateful(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.h = Carry(jnp.zeros((8, 3)))

    def __call__(self, x):
        # a batch of other rows (a per-shard hypothesis's): the carry's first n rows read, none written
        n = x.shape[0]
        h = 0.5 * jax.lax.stop_gradient(self.h[...][:n]) + jnp.tanh(self.lin(x))
        if n == self.h.shape[0]:
            self.h[...] = jax.lax.stop_gradient(h)
        return h


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches(n: int = 2):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(n)
    ]


def _carry_step(one_shard: bool):
    """A GSPMD step (state replicated, the batch over ``data``); ``one_shard``: the carry written back for rows
    0..3 only (data shard 0's), rows 4..7 kept."""

    @nnx.jit
    def train(model, optimizer, batch):
        old = model.h[...]
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        if one_shard:
            model.h[...] = jnp.where(jnp.arange(8)[:, None] < 4, model.h[...], old)
        optimizer.update(model, grads)
        return loss

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2})


def test_partial_write_on_arrays_both_sides():
    rng = np.random.default_rng(1)
    before, dr = rng.normal(size=(8, 16)), rng.normal(size=(8, 16))
    rows = np.arange(8)[:, None] < 4
    assert partial_write(before, before + dr, np.where(rows, before + dr, before)) == (
        64,
        128,
        "rows 4..7 of axis 0",
    )
    cols = np.arange(16)[None, :] == 5
    assert partial_write(before, before + dr, np.where(cols, before, before + dr)) == (
        8,
        128,
        "index 5 of axis 1",
    )
    scattered = np.zeros((8, 16), bool)
    scattered[[1, 6], [2, 9]] = True
    assert partial_write(before, before + dr, np.where(scattered, before, before + dr)) == (2, 128, "")
    assert partial_write(before[0], before[0] + dr[0], np.r_[before[0, :3], before[0, 3:] + dr[0, 3:]]) == (
        3,
        16,
        "elements 0..2",
    )
    # no partial write: a momentum of its own (every element by 0.1 of the change), all rows kept, others differ
    assert partial_write(before, before + dr, before + 0.1 * dr) is None
    assert partial_write(before, before + dr, before) is None
    assert partial_write(before, before + dr, np.where(rows, before + 1.1 * dr, before)) is None


@require_devices(2)
def test_a_carry_written_for_one_shards_rows_fails_live_and_replayed_as_a_partial_write(mesh):
    task = shardcheck.Task(model=Stateful, optimizer=optax.sgd(0.1), loss_fn=loss_fn, batches=_batches())
    recording = record_run(task, "gspmd", mesh=mesh)
    for reference in (None, recording):
        assert check_parity(_carry_step(False), task, mesh=mesh, reference=reference).ok
    live = check_parity(_carry_step(True), task, mesh=mesh)
    replayed = check_parity(_carry_step(True), task, mesh=mesh, reference=recording)
    for report, said in (
        (live, "12 of 24 elements of h (rows 4..7 of axis 0)"),
        (replayed, "4 of the 8 recorded"),
    ):
        assert not report.ok and report.codes[0] == "state_partial", report.codes
        assert report.localization.step == 0 and report.localization.form.kind == "state_partial"
        assert said in report.diagnoses[0].message
        assert "A write that covers part of the leaf only" in report.diagnoses[0].message
        assert "momentum" not in str(report.localization) and "momentum" not in report.diagnoses[0].message
    assert (
        "left part of this leaf of non-parameter state exactly as it was" in live.localization.form.sentence
    )
    assert "12 of 24 elements of model.h (rows 4..7 of axis 0); the other elements match" in (
        live.localization.form.sentence
    )


def _decay_tx(decay_bias: bool):
    sched = optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=2, decay_steps=8)

    def mask(params):
        return jax.tree.map_with_path(
            lambda k, _: decay_bias or "bias" not in jax.tree_util.keystr(k), params
        )

    return optax.chain(optax.add_decayed_weights(1e-2, mask=mask), optax.sgd(sched, momentum=0.9))


def _tx_step(tx, grad_factor: float = 1.0):
    """A step that updates with its own transformation ``tx`` (the gradients times ``grad_factor`` given to it)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        g = jax.tree.map(lambda x: x * grad_factor, nnx.as_pure(nnx.state(grads, nnx.Param)))
        updates, new = tx.update(g, nnx.as_pure(optimizer.opt_state), params)
        nnx.update(model, optax.apply_updates(params, updates))
        nnx.update(optimizer.opt_state, nnx.state(new))
        optimizer.step[...] += 1
        return {"loss": loss, "grads": grads}

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    return step


@require_devices(2)
def test_a_coupled_decay_on_one_more_leaf_at_a_zero_learning_rate_is_said_as_a_decay_and_a_grad_factor_is_not(
    mesh,
):
    model = lambda: nnx.Linear(4, 3, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))  # noqa: E731
    task = shardcheck.Task(model=model, optimizer=_decay_tx(False), loss_fn=loss_fn, batches=_batches())
    assert check_parity(_tx_step(_decay_tx(False)), task, mesh=mesh).ok
    recording = record_run(task, "gspmd", mesh=mesh)
    live = check_parity(_tx_step(_decay_tx(True)), task, mesh=mesh)
    replayed = check_parity(_tx_step(_decay_tx(True)), task, mesh=mesh, reference=recording)
    for decayed in (live, replayed):
        form = decayed.localization.form
        assert not decayed.ok and decayed.localization.step == 0 and decayed.localization.stage == "optimizer"
        assert form.kind == "state_decay" and form.coefficient == pytest.approx(0.01, rel=1e-4)
        assert (
            "differs from the reference's by +c*param with c = 0.01 on the one failing leaf" in form.sentence
        )
        assert "the candidate applies it where the reference does not" in form.sentence
    scaled = check_parity(_tx_step(_decay_tx(False), grad_factor=2.0), task, mesh=mesh)
    assert not scaled.ok and scaled.localization.form.kind != "state_decay"
    assert "weight decay" not in scaled.localization.form.sentence


def test_state_decay_fit_both_sides_on_arrays():
    rng = np.random.default_rng(2)
    param, g = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    before = {"opt_state 1.trace.w": np.zeros((3, 4))}
    ref = {"opt_state 1.trace.w": g}
    params = {"opt_state 1.trace.w": param}
    form = fit_form(before, ref, {"opt_state 1.trace.w": g - 0.05 * param}, state_params=params)
    assert form.kind == "state_decay" and form.coefficient == pytest.approx(0.05)
    assert (
        "-c*param" in form.sentence
        and "the reference applies it where the candidate skips it" in form.sentence
    )
    # another difference (a term in the gradient, not the parameter): no decay
    other = fit_form(
        before, ref, {"opt_state 1.trace.w": g + 0.05 * rng.normal(size=(3, 4))}, state_params=params
    )
    assert other.kind == "none"


def test_a_parameter_update_of_some_rows_only_is_a_partial_form_and_a_scaled_one_is_not():
    rng = np.random.default_rng(3)
    before, dr = {"w": rng.normal(size=(4, 6))}, rng.normal(size=(4, 6))
    ref = {"w": before["w"] + dr}
    rows = np.arange(4)[:, None] < 2
    partial = fit_form(before, ref, {"w": np.where(rows, ref["w"], before["w"])}, tol={"w": 1e-6})
    assert partial.kind == "partial"
    assert (
        "the candidate left 12 of 24 elements of w (rows 2..3 of axis 0) exactly as they were"
        in partial.sentence
    )
    assert fit_form(before, ref, {"w": before["w"] + 2 * dr}, tol={"w": 1e-6}).kind == "extra_step"
    # the written rows off by more than the tolerance: no partial form
    off = np.where(rows, ref["w"] + 1e-3, before["w"])
    assert fit_form(before, ref, {"w": off}, tol={"w": 1e-6}).kind == "none"
