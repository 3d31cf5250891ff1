"""Issue #36, trials 23 (a DDPM denoiser with an EMA, data=2 x fsdp=2) and 24 (a PPO policy/value step, data=4):
findings that the records contradicted, each checked on both sides with hand-built records.

- A cosine schedule's count one ahead (Adam's count, the step counter and every moment matching) read "The
  optimizer was stepped 2 times per step" (trial 23): one update was applied, and the counter advanced apart from
  it.
- A PPO clip epsilon of 0.3 for 0.2 read "Only the returned loss differs ... the update matches ... the candidate
  does not return the full-batch pre-update loss", while step 2's gradients and parameters failed (trial 24).
- weak_check named one leaf where two qualified (trial 24).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity
from shardcheck.parity.comparison.live import counter_error
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import diagnose


def _leaf(kind, path, ok=True, ratio=1.0, step=0, change=None, tol=1e-6):
    err = 0.0 if ok else 10 * tol
    return LeafError(step, kind, path, err, err, tol, ok, ratio, change, (ratio, ratio), (4,))


def _counters(step: int, schedule: int, adam: int) -> list:
    return [
        counter_error(0, "step", 1, step),
        counter_error(0, "1.0.count", 1, adam),
        counter_error(0, "1.2.count", 1, schedule),
    ]


def _schedule_record(moments_ok: bool) -> StepRecord:
    leaves = [
        _leaf("loss", "loss"),
        _leaf("grad", "w"),
        _leaf("param", "w", ok=False, ratio=0.8536, change=1e-3),
        _leaf("opt_state", "1.0.mu.w", ok=moments_ok, ratio=1.0 if moments_ok else 1.9),
        _leaf("opt_state", "1.0.nu.w", ok=moments_ok, ratio=1.0 if moments_ok else 1.9),
        *_counters(step=1, schedule=2, adam=1 if moments_ok else 2),
    ]
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, tuple(leaves), 1, 1)


def test_a_schedule_count_ahead_beside_matching_moments_is_not_a_second_update():
    said = {d.code: d.message for d in diagnose([_schedule_record(moments_ok=True)], 4)}
    message = said["step_counter"]
    assert "1.2.count is 2 after 1 step(s) while 1.0.count and step match" in message
    assert "one update was applied" in message and "a schedule read one step ahead" in message
    assert "stepped 2 times" not in message
    # the other side: moments that moved twice as far are a second update
    said = {d.code: d.message for d in diagnose([_schedule_record(moments_ok=False)], 4)}
    assert "stepped 2 times per step" in said["step_counter"]


def _loss_only(step: int, later_fails: bool) -> StepRecord:
    grad_ok = step == 0 or not later_fails
    leaves = [
        _leaf("loss", "loss", ok=step > 0, ratio=0.9784, step=step),
        _leaf("grad", "policy.bias", ok=grad_ok, ratio=1.0 if grad_ok else 1.3, step=step),
        _leaf("param", "policy.bias", ok=grad_ok, ratio=1.0 if grad_ok else 1.3, step=step, change=1e-3),
        counter_error(step, "step", step + 1, step + 1),
    ]
    return StepRecord(
        step, 1e-5, 1e-7, 0.8724249, 0.8535916 if step == 0 else 0.9, tuple(leaves), step + 1, step + 1
    )


def test_a_loss_differing_at_step_0_whose_update_fails_later_is_not_called_a_reporting_bug():
    records = [_loss_only(0, True), _loss_only(1, True), _loss_only(2, True)]
    message = {d.code: d.message for d in diagnose(records, 4)}["loss_differs"]
    assert "the update matches at this step" in message
    assert "At step 1 the update differs too (grad policy.bias" in message
    assert "does not return the full-batch pre-update loss" not in message
    # the other side: the update matches at every step: the loss returned is the reading, with the other one
    records = [_loss_only(0, False), _loss_only(1, False)]
    message = {d.code: d.message for d in diagnose(records, 4)}["loss_differs"]
    assert "does not return the full-batch pre-update loss" in message and "a later step tells" in message


def test_weak_check_names_every_leaf_it_holds_for():
    def record(t):
        leaves = [
            _leaf("param", p, step=t, change=1e-7, tol=1e-6)
            for p in ("trunk1.kernel", "trunk2.kernel", "head.kernel")
        ]
        leaves[2] = _leaf("param", "head.kernel", step=t, change=1e-3, tol=1e-6)  # moved: seen
        return StepRecord(t, 1e-5, 1e-7, 1.0, 1.0, tuple(leaves), t + 1, t + 1)

    message = {d.code: d.message for d in diagnose([record(0), record(1)], 4)}["weak_check"]
    assert (
        "of param trunk1.kernel (and of 1 more: param trunk2.kernel) is not larger than the tolerance"
        in message
    )
    assert "head.kernel" not in message


class _Bf16Net(nnx.Module):
    def __init__(self, rngs):
        self.trunk = nnx.Linear(12, 32, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(32, 4, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.trunk(x))).astype(jnp.float32)


def _bf16_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _bf16_task() -> Task:
    rng = np.random.default_rng(4)
    batches = [
        {"x": rng.normal(size=(16, 12)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
        for _ in range(2)
    ]
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-4))
    return Task(
        model=lambda: _Bf16Net(nnx.Rngs(0)), optimizer=tx, loss_fn=_bf16_loss, batches=batches, name="bf16"
    )


@nnx.jit
def _quartered(model, optimizer, batch):
    shards = [jax.tree.map(lambda a, i=i: a[4 * i : 4 * i + 4], batch) for i in range(4)]
    parts = [nnx.value_and_grad(lambda m, b=b: _bf16_loss(m, b))(model) for b in shards]
    value = sum(v for v, _ in parts) / 4
    # each shard's gradient summed over the 4 shards (their own roundings), then a mean taken twice (/ 4 / 4)
    grads = jax.tree.map(lambda *g: sum(g) / 16, *[g for _, g in parts])
    optimizer.update(model, grads)
    return {"loss": value, "grads": grads}


def quartered(model, optimizer, batch):
    return _quartered(model, optimizer, batch)


@require_devices(4)
def test_a_gradient_quartered_under_bfloat16_is_named_with_its_factor():
    """Trial 24: under bfloat16 compute every gradient 1/4 (= 1/S) read "no simple form" (grads_differ): the
    gradient stage's fit read each leaf's parameter tolerance (a gradient and its parameter share a path)."""
    report = check_parity(quartered, _bf16_task(), num_shards=4)
    assert report.codes[0] == "averaged_twice", report.codes
    form = report.localization.form
    assert form.kind == "factor" and abs(form.factor - 0.25) < 0.01
    assert "a mean taken twice" in form.sentence and "a sum in place of a mean" not in form.sentence


def test_a_step_raising_on_a_batch_shaped_otherwise_names_the_batch_and_the_leaf():
    """Trial 24: batch 1's observations had 11 columns for 12, and the check raised "dot_general requires
    contracting dimensions to have the same shape", naming no batch or leaf."""
    import pytest

    from shardcheck.task import batch_shape_hint

    rng = np.random.default_rng(5)
    good = {"x": rng.normal(size=(8, 12)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
    odd = {"x": rng.normal(size=(8, 11)).astype(np.float32), "y": good["y"]}
    assert batch_shape_hint([good, odd]) == "batch 1's leaf 'x' is shaped (8, 11) where batch 0's is (8, 12)"
    assert batch_shape_hint([good, dict(good)]) == ""  # the same shapes: no hint
    assert batch_shape_hint([good, {"x": good["x"][:4], "y": good["y"][:4]}]) == ""  # a leading size: allowed
    task = Task(
        model=lambda: nnx.Linear(12, 4, rngs=nnx.Rngs(0)),
        optimizer=optax.sgd(0.1),
        loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
        batches=[good, odd],
        name="odd_batch",
    )
    with pytest.raises((TypeError, ValueError, RuntimeError), match="batch 1's leaf 'x' is shaped") as raised:
        check_parity("simulation", task, num_shards=2)
    # trial 29: which step raised and what to change
    said = str(raised.value)
    assert "give every batch the shapes of batch 0" in said and "check_parity: the task's loss raised" in said


def test_a_first_failure_at_step_1_is_said_at_step_1_and_a_decay_is_no_bfloat16_reduction():
    """Trial 25: a schedule boundary one step early read "the pre-update loss agrees at step 0 but the update does
    not" beside a localization at step 1; a weight decay on BatchNorm's parameters (c = 0.0005, fitted by the
    localization) read low_precision_reduction ("all-reduced in bfloat16") in a float32 model."""
    from shardcheck.parity.diagnosis.form import Form

    ok0 = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (_leaf("loss", "loss"), _leaf("grad", "w")), 1, 1)
    failing = tuple(  # no one factor: elementwise ratios from -1 to 2
        LeafError(1, kind, path, 1e-4, 0.5, 1e-6, False, 0.3, change, (-1.0, 2.0), (4,))
        for kind, path, change in (
            ("grad", "w", None),
            ("opt_state", "0.trace.w", 1e-3),
            ("param", "w", 1e-3),
        )
    )
    # step 1 re-run from the reference's state (the step loop's re-check of a late failure)
    bad1 = StepRecord(
        1, 1e-5, 1e-7, 1.0, 1.0, (_leaf("loss", "loss", step=1), *failing), 2, 2, synchronized=True
    )
    said = {d.code: d.message for d in diagnose([ok0, bad1], 4)}
    assert said["loss_only"].startswith(
        "Only the loss matches at step 1: the pre-update loss agrees at step 1 (run from the reference's pre-step "
        "state) but the update does not"
    ), said

    params = tuple(
        LeafError(0, "param", p, 5e-4, 5e-4, 2e-5, False, 0.9, 1e-3, (0.5, 1.2), (16,))
        for p in ("bn.scale", "bn.bias")
    )
    decay = Form("decay", "a decoupled weight decay term c*lr*param with c*lr = 0.0005 ...", coefficient=5e-4)

    def record(forms):
        leaves = (_leaf("loss", "loss"), _leaf("opt_state", "0.trace.w"), *params)
        return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, leaves, 1, 1, matches=("bf16_reduction",), forms=forms)

    assert "low_precision_reduction" not in {d.code for d in diagnose([record((("parameters", decay),))], 4)}
    assert "low_precision_reduction" in {
        d.code for d in diagnose([record(())], 4)
    }  # no named form: the rule stays


@require_devices(2)
def test_a_steps_own_lookup_of_a_missing_mesh_axis_is_told_the_fix():
    """Trial 25: --mesh dta=4 for a step that reads mesh.shape['data'] read "raised KeyError: 'data' ... fix the
    step"; a KeyError of another key, or of an axis the mesh has, gets no such hint."""
    from shardcheck import make_mesh
    from shardcheck.parity.harness.candidates import _mesh_axis_hint

    mesh = make_mesh({"dta": 2})
    hint = _mesh_axis_hint(KeyError("data"), mesh)
    assert hint.startswith(
        "the step names mesh axis 'data', and the mesh has ('dta',): give the mesh that axis"
    )
    assert _mesh_axis_hint(KeyError("dta"), mesh) == ""  # the mesh has it: some other lookup failed
    assert _mesh_axis_hint(KeyError(3), mesh) == "" and _mesh_axis_hint(KeyError("a b"), mesh) == ""
