"""The parity harness: every strategy passes, every planted bug fails with its own diagnosis, weighted mode.

Bugs are planted as the user-written steps engineers actually ship (sum instead of mean, a mean taken twice,
shards applied one after another, the optimizer stepped per shard, a loss that matches alone, replicas left
unsynchronised, the shard_map C2 trap); each must fail and be named. Weighted mode must reproduce the worked
values of ``docs/reduction_cases.md`` C4, C5 and C6 exactly.
"""

import json
import math
import re

import jax
import jax.numpy as jnp
import kinked
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import assert_step_parity, check_parity, make_model, make_tx, mse_loss, parity
from shardcheck.parity import ParityError, derive_tolerance, minibatches
from shardcheck.steps.reference import reference_step

LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}
# One optax transformation object per optimizer: the jitted steps cache on the optimizer's static structure,
# so sharing it lets every test reuse the compiled reference step.
TX = {name: make_tx(name, lr) for name, lr in LR.items()}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(160, 3)).astype(np.float32)
Y = (X @ RNG.normal(size=(3, 2)) + 0.3 * RNG.normal(size=(160, 2))).astype(np.float32)
BATCHES = [(X[i * 16 : (i + 1) * 16], Y[i * 16 : (i + 1) * 16]) for i in range(10)]


def fresh(kind="mlp", opt="sgd"):
    model = make_model(kind, 3, 2, hidden=8, seed=1)
    return model, nnx.Optimizer(model, TX[opt], wrt=nnx.Param)


def sizes(*values):
    return [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in values]


# ------------------------------------------------------------------------------------- every strategy passes


@pytest.mark.parametrize("num_shards", sizes(2, 4, 8))
@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("strategy", ["simulation", "dp", "fsdp", "accumulation"])
def test_every_strategy_passes_parity(strategy, kind, opt, num_shards):
    model, optimizer = fresh(kind, opt)
    report = check_parity(strategy, model, optimizer, BATCHES, num_shards=num_shards)
    assert report.ok, str(report)
    assert report.codes == ("parity",)
    assert len(report.steps) == 10 and report.steps[-1].step_count == 10
    assert report.steps[-1].candidate_step_count == 10
    # Rounding only: at least 8x under the tolerance, and an update ratio of 1 on every parameter leaf.
    assert report.worst.badness < 0.125, str(report)
    ratios = [e.ratio for e in report.steps[0].leaves if e.kind == "param"]
    assert ratios and all(abs(r - 1) < 1e-4 for r in ratios)
    kinds = {e.kind for e in report.steps[0].leaves}
    assert {"loss", "param", "counter"} <= kinds
    if strategy == "simulation":
        assert "grad" in kinds  # ReducedStep exposes its reduced gradients
    if opt != "sgd":
        assert "opt_state" in kinds


def test_the_user_state_is_left_unchanged():
    model, optimizer = fresh("mlp", "adam")
    before = jax.tree.map(np.array, nnx.state((model, optimizer)))
    check_parity("simulation", model, optimizer, BATCHES[:2], num_shards=2)
    after = nnx.state((model, optimizer))
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )


@settings(max_examples=6, deadline=None)
@given(
    d=st.integers(1, 4),
    k=st.integers(1, 3),
    num_shards=st.sampled_from([1, 2, 3, 4]),
    rows=st.integers(1, 4),
    opt=st.sampled_from(["sgd", "adam"]),
    seed=st.integers(0, 2**16),
)
def test_simulation_passes_parity_for_random_shapes(d, k, num_shards, rows, opt, seed):
    rng = np.random.default_rng(seed)
    b = num_shards * rows
    batches = [(rng.normal(size=(b, d)).astype(np.float32), rng.normal(size=(b, k)).astype(np.float32))] * 2
    model = nnx.Linear(d, k, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, TX[opt], wrt=nnx.Param)
    report = check_parity("simulation", model, optimizer, batches, num_shards=num_shards)
    assert report.ok, str(report)


# ------------------------------------------------------------------------------------- planted bugs, diagnosed


def shard_losses_and_grads(model, x, y, num_shards):
    """Each shard's loss and gradients at the model's current parameters (eager, as a user loop would)."""
    xs, ys = np.split(np.asarray(x), num_shards), np.split(np.asarray(y), num_shards)
    return [nnx.value_and_grad(mse_loss)(model, a, b) for a, b in zip(xs, ys, strict=True)]


def tree_sum(trees):
    return jax.tree.map(lambda *leaves: sum(leaves), *trees)


def planted(bug, num_shards, lr):
    """A wrong user step ``(model, optimizer, x, y) -> loss`` of the named kind."""
    s = num_shards

    def summed(model, optimizer, x, y):  # C1: a sum-reduction where a mean was meant
        pairs = shard_losses_and_grads(model, x, y, s)
        optimizer.update(model, tree_sum([g for _, g in pairs]))
        return np.mean([loss for loss, _ in pairs])

    def mean_twice(model, optimizer, x, y):  # divided by S twice
        pairs = shard_losses_and_grads(model, x, y, s)
        optimizer.update(model, jax.tree.map(lambda g: g / s / s, tree_sum([g for _, g in pairs])))
        return np.mean([loss for loss, _ in pairs])

    def per_shard_optimizer(model, optimizer, x, y):  # right gradients, but optimizer.update once per shard
        pairs = shard_losses_and_grads(model, x, y, s)
        for _, g in pairs:
            optimizer.update(model, jax.tree.map(lambda a: a / s, g))
        return np.mean([loss for loss, _ in pairs])

    def sequential(model, optimizer, x, y):  # each shard's gradient taken after the previous shard's update
        xs, ys = np.split(np.asarray(x), s), np.split(np.asarray(y), s)
        losses = []
        for i, (a, b) in enumerate(zip(xs, ys, strict=True)):
            loss, g = nnx.value_and_grad(mse_loss)(model, a, b)
            losses.append(loss)
            if i < s - 1:
                params = nnx.state(model, nnx.Param)
                nnx.update(model, jax.tree.map(lambda p, gg: p - lr * gg / s, params, g))
            else:
                optimizer.update(model, jax.tree.map(lambda a: a / s, g))
        return np.mean(losses)

    def loss_only(model, optimizer, x, y):  # the right loss; the update uses shard 0 only
        pairs = shard_losses_and_grads(model, x, y, s)
        optimizer.update(model, pairs[0][1])
        return np.mean([loss for loss, _ in pairs])

    def swallowed(model, optimizer, x, y):  # C8: the old one-argument update, its error swallowed
        loss, grads = nnx.value_and_grad(mse_loss)(model, x, y)
        try:
            optimizer.update(grads)
        except TypeError:
            pass
        return loss

    return locals()[bug]


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize(
    ("bug", "num_shards", "code", "phrase"),
    [
        ("summed", 2, "summed", "summed instead of averaged (x2"),
        ("summed", 4, "summed", "summed instead of averaged (x4"),
        ("mean_twice", 2, "averaged_twice", "averaged twice (or divided by S=2 twice)"),
        ("mean_twice", 4, "averaged_twice", "averaged twice (or divided by S=4 twice)"),
        ("per_shard_optimizer", 4, "step_counter", "stepped 4 times per step"),
        ("sequential", 4, "update_differs", "not a single reduced step"),
        ("loss_only", 2, "loss_only", "this is not parity"),
        ("swallowed", 2, "never_stepped", "never stepped"),
    ],
)
def test_planted_bug_fails_with_its_diagnosis(bug, num_shards, code, phrase, opt):
    model, optimizer = fresh("mlp", opt)
    report = check_parity(
        planted(bug, num_shards, LR[opt]), model, optimizer, BATCHES[:3], num_shards=num_shards
    )
    assert not report.ok
    if (bug, opt) == ("loss_only", "adam"):
        # Adam's first update is lr * sign(g): shard 0's gradient has the full batch's signs on out.bias, which
        # matches, so "only the loss matches" would be false; the first differing stage is named instead
        code, phrase = "localized", "At step 0 the loss matches; the optimizer state differs (8 of 8 leaves)"
        assert [e.name for e in report.steps[0].leaves if e.kind == "param" and e.ok] == ["param out.bias"]
    assert report.codes[0] == code, report.diagnosis
    assert phrase in report.diagnosis
    assert report.diagnoses[0].leaf is not None
    # the specific finding is not drowned in generic ones
    assert not {"update_differs", "loss_only"} & set(report.codes[1:]), report.codes


def test_adam_sum_is_seen_in_the_moments_not_the_update():
    """Adam's update is nearly invariant to the gradient's scale; its moments are not (mu x S, nu x S^2)."""
    model, optimizer = fresh("mlp", "adam")
    report = check_parity(planted("summed", 4, LR["adam"]), model, optimizer, BATCHES[:1], num_shards=4)
    first = report.steps[0]
    params = [e.ratio for e in first.leaves if e.kind == "param"]
    mu = [e.ratio for e in first.leaves if e.kind == "opt_state" and ".mu." in f".{e.path}."]
    nu = [e.ratio for e in first.leaves if e.kind == "opt_state" and ".nu." in f".{e.path}."]
    assert all(abs(r - 1) < 0.05 for r in params)
    np.testing.assert_allclose(mu, 4.0, rtol=1e-5)
    np.testing.assert_allclose(nu, 16.0, rtol=1e-5)
    assert "optimizer moments are 4 x" in report.diagnosis


def test_without_num_shards_an_integer_ratio_is_still_named():
    model, optimizer = fresh("linear", "sgd")
    report = check_parity(planted("summed", 4, 0.1), model, optimizer, BATCHES[:1])
    assert report.codes[0] == "summed" and "x4" in report.diagnosis


def test_a_constant_factor_that_is_no_shard_count_is_reported_as_scaled():
    def half_lr(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(mse_loss)(model, x, y)
        optimizer.update(model, jax.tree.map(lambda g: 0.7 * g, grads))
        return loss

    model, optimizer = fresh("linear", "sgd")
    report = check_parity(half_lr, model, optimizer, BATCHES[:1], num_shards=2)
    assert report.codes[0] == "scaled" and "0.7 x" in report.diagnosis


def _unsynced_step(mesh):
    """shard_map with check_vma=False and out_specs=P(): each device applies its own shard's gradient."""
    cache = {}

    def step(model, optimizer, x, y):
        graphdef, state = nnx.split((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)
        if graphdef not in cache:

            def body(leaves, x, y):
                m, o = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
                loss, grads = nnx.value_and_grad(mse_loss)(m, x, y)
                o.update(m, grads)  # no pmean: a missing all-reduce
                return jax.lax.pmean(loss, "data"), jax.tree.leaves(nnx.state((m, o)))

            specs = dict(in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()), check_vma=False)
            cache[graphdef] = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
        loss, leaves = cache[graphdef](leaves, x, y)
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
        return loss

    return step


@require_devices(4)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_replicas_that_differ_are_named(opt):
    from shardcheck import make_mesh

    model, optimizer = fresh("mlp", opt)
    report = check_parity(_unsynced_step(make_mesh(4)), model, optimizer, BATCHES[:2], num_shards=4)
    assert not report.ok
    assert report.codes[0] == "replicas_differ"
    assert report.diagnoses[0].leaf.startswith("param ")
    assert "holds different values on different devices" in report.diagnosis
    assert report.steps[0].replica_mismatches


def _c2_trap_step(mesh):
    """The docs/reduction_cases.md C2 trap: grad of a local loss w.r.t. replicated params under check_vma=True is already
    summed over the axis; a further pmean leaves it S times too large."""

    def body(leaves, x, y, graphdef, treedef):
        m, o = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        loss, grads = nnx.value_and_grad(mse_loss)(m, x, y)
        o.update(m, jax.lax.pmean(grads, "data"))
        return jax.lax.pmean(loss, "data"), jax.tree.leaves(nnx.state((m, o)))

    def step(model, optimizer, x, y):
        graphdef, state = nnx.split((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)
        f = jax.shard_map(
            lambda lv, a, b: body(lv, a, b, graphdef, treedef),
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P()),
        )
        loss, leaves = jax.jit(f)(leaves, x, y)
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
        return loss

    return step


@require_devices(4)
def test_shard_map_c2_trap_is_diagnosed_as_a_sum():
    from shardcheck import make_mesh

    model, optimizer = fresh("linear", "momentum")
    report = check_parity(_c2_trap_step(make_mesh(4)), model, optimizer, BATCHES[:2], num_shards=4)
    assert report.codes[0] == "summed" and "x4" in report.diagnosis
    # the cause, read from the step's own program: its pmean reduces a gradient autodiff already summed
    assert "a gradient that jax.grad had already summed over 'data'" in report.diagnoses[0].message


def test_only_a_wrong_loss_is_reported_as_such():
    def post_update_loss(model, optimizer, x, y):
        shardcheck.sgd_step(model, optimizer, x, y)
        return mse_loss(model, x, y)

    model, optimizer = fresh("linear", "sgd")
    report = check_parity(post_update_loss, model, optimizer, BATCHES[:2])
    assert report.codes == ("loss_differs",)
    assert report.worst_leaf == "loss"


def test_exposed_gradients_that_were_not_applied_are_reported():
    def wrong_grads(model, optimizer, x, y):
        result = shardcheck.reduced_sgd_step(model, optimizer, x, y, 2)
        return {"loss": result.loss, "grads": jax.tree.map(lambda g: 2 * g, result.grads)}

    model, optimizer = fresh("linear", "sgd")
    report = check_parity(wrong_grads, model, optimizer, BATCHES[:1], num_shards=2)
    # SGD sees the gradient's scale: the update it applied is right, so the reported gradients are not it
    assert report.codes[0] == "grads_differ" and "summed" not in report.codes, str(report)


def test_state_not_carried_between_steps_is_drift():
    def reset_momentum(model, optimizer, x, y):  # right first step; the trace is zeroed before every step
        optimizer.opt_state = jax.tree.map(jnp.zeros_like, optimizer.opt_state)
        return shardcheck.sgd_step(model, optimizer, x, y)

    model, optimizer = fresh("linear", "momentum")
    report = check_parity(reset_momentum, model, optimizer, BATCHES[:3])
    assert report.steps[0].ok and not report.steps[1].ok
    assert report.codes == ("drift",)


def test_assert_step_parity_raises_with_the_report():
    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(ParityError) as info:
        assert_step_parity(planted("summed", 2, 0.1), model, optimizer, BATCHES[:2], num_shards=2)
    assert isinstance(info.value, AssertionError)
    assert info.value.report.codes[0] == "summed"
    assert "parity FAIL" in str(info.value) and "summed instead of averaged" in str(info.value)
    report = assert_step_parity("simulation", model, optimizer, BATCHES[:2], num_shards=2)
    assert report.ok


# ---------------------------------------------------- a user's own shard_map step (the docs/parity.md example)


def make_user_dp_step(mesh):
    """A correct hand-written data-parallel step: local gradient of a device-varying copy, one pmean per leaf."""

    def step(model, optimizer, x, y):
        graphdef, state = nnx.split((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)

        def body(leaves, x, y):
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            gdef, params, rest = nnx.split(model, nnx.Param, ...)
            params = jax.lax.pcast(params, "data", to="varying")  # local gradients: no implicit psum (C2)
            loss, grads = jax.value_and_grad(lambda p: mse_loss(nnx.merge(gdef, p, rest), x, y))(params)
            optimizer.update(model, jax.lax.pmean(grads, "data"))
            return jax.lax.pmean(loss, "data"), jax.tree.leaves(nnx.state((model, optimizer)))

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
        loss, leaves = jax.jit(mapped)(leaves, x, y)
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
        return loss

    return step


@require_devices(4)
def test_users_own_shard_map_step_passes():
    from shardcheck import make_mesh

    mesh = make_mesh(4)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    report = assert_step_parity(make_user_dp_step(mesh), model, optimizer, BATCHES[:5], num_shards=4)
    assert report.ok and report.steps[-1].candidate_step_count == 5


@require_devices(4)
def test_mesh_is_passed_to_a_candidate_that_takes_it():
    from shardcheck import make_mesh

    mesh = make_mesh(4)
    seen = []

    def step(model, optimizer, x, y, mesh):
        seen.append(mesh)
        return shardcheck.data_parallel_sgd_step(model, optimizer, x, y, mesh)

    model, optimizer = fresh("linear", "sgd")
    assert check_parity(step, model, optimizer, BATCHES[:2], mesh=mesh).ok
    assert seen == [mesh, mesh]


# ------------------------------------------------------------------------------------------------ tolerances


def test_derived_tolerance_values_and_growth():
    eps = float(np.finfo(np.float32).eps)
    tol = derive_tolerance("float32", batch_size=64)
    assert tol.rtol == pytest.approx(16 * eps * 8) and tol.atol == pytest.approx(eps * 8)
    later = derive_tolerance("float32", batch_size=64, step=3)
    assert later.rtol == pytest.approx(2 * tol.rtol)  # sqrt(t + 1) growth
    wide = derive_tolerance("float32", batch_size=16, out_features=4)
    assert wide.rtol == pytest.approx(tol.rtol)  # n = B * K
    assert (
        derive_tolerance("bfloat16", batch_size=64).rtol
        > 1e4 * derive_tolerance("float64", batch_size=64).rtol
    )
    # never loose enough for a 1/S error at S=2 (a 50% error) even after 100 steps of a large batch
    assert derive_tolerance("float32", batch_size=4096, step=99).rtol < 0.01
    with pytest.raises(ValueError, match="derive_tolerance: batch_size"):
        derive_tolerance(batch_size=0)
    with pytest.raises(ValueError, match="not a floating dtype"):
        derive_tolerance("int32", batch_size=4)


def test_user_tolerances_override_the_derived_ones():
    model, optimizer = fresh("linear", "sgd")
    loose = check_parity(planted("mean_twice", 2, 0.1), model, optimizer, BATCHES[:1], rtol=1.0, atol=1.0)
    assert loose.ok and "rtol=1" in loose.tolerance_rule
    # tolerances this wide pass a mean taken twice: a user-set tolerance accepts the weak check, and says so
    assert loose.verdict == "PASS (weak check accepted)" and "a user-set rtol/atol" in loose.weak_accepted
    assert loose.steps[0].rtol == 1.0 and loose.steps[0].atol == 1.0
    with pytest.raises(ValueError, match="check_parity: rtol must be a number >= 0"):
        check_parity("simulation", model, optimizer, BATCHES[:1], num_shards=2, rtol=-1.0)


def _loss_only(model, optimizer, x, y):
    """The right single-device step, returning its loss and no gradients."""
    loss, grads = nnx.value_and_grad(mse_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _summed_loss_only(model, optimizer, x, y):
    """A sum for a mean over S = 2 shards that returns the mean's loss and no gradients: the update sees 2 g."""
    loss, grads = nnx.value_and_grad(lambda m: 2 * mse_loss(m, x, y))(model)
    optimizer.update(model, grads)
    return loss / 2


def test_tolerances_a_user_set_too_wide_are_said_as_theirs_not_as_the_precision():
    """Trial 49: ``--rtol 10 --atol 10`` on a sum for a mean (x2) passed as a weak check whose advice was "Run the
    check in float32" and "pass rtol=" (the run was float32 and rtol was passed). The weak check now names the
    tolerances set beside the derived ones and the fix, to lower them; derived tolerances keep the precision's
    advice (``test_a_too_small_update_cannot_be_verified_unless_accepted``)."""
    model = make_model("linear", 3, 2, seed=1)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    report = check_parity(_summed_loss_only, model, optimizer, BATCHES[:1], num_shards=2, rtol=10, atol=10)
    assert report.verdict == "PASS (weak check accepted)"
    weak = report.weak_accepted
    assert weak.startswith("Cannot verify with the tolerances set (rtol=10, atol=10; derived: rtol=")
    assert "Lower rtol/atol, or leave them derived" in weak and "float32" not in weak
    assert "lower it where you set it (rtol=, verify --rtol)" in report.diagnosis
    # the derived tolerance shows the same fault
    assert check_parity(_summed_loss_only, model, optimizer, BATCHES[:1], num_shards=2).codes[0] == "summed"


def test_a_sum_for_a_mean_under_a_binding_clip_passes_only_as_an_accepted_weak_check():
    """From the trial: under a global-norm clip that binds, g and 2 g give one update, so a loss-only step with a
    sum for a mean matches the reference in every parameter. CANNOT VERIFY; with accept_weak the report passes and
    its verdict, JSON and text say that the check was weak and accepted."""
    from shardcheck.parity.diagnosis.scale_evidence import ACCEPTED

    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))
    model = make_model("linear", 3, 2, seed=1)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    report = check_parity(_summed_loss_only, model, optimizer, BATCHES[:2], num_shards=2)
    assert report.verdict == "CANNOT VERIFY" and report.weak_accepted is None
    assert report.cannot_verify.startswith("Cannot verify the gradient's scale")
    # no leaf failed: none is named failing (trial 60: "first failing leaf: param ..." of a leaf marked ok)
    assert report.first_failing_leaf is None and "first failing leaf" not in str(report)
    accepted = check_parity(_summed_loss_only, model, optimizer, BATCHES[:2], num_shards=2, accept_weak=True)
    assert accepted.ok and accepted.step_ok and accepted.cannot_verify is None
    assert accepted.verdict == "PASS (weak check accepted)"
    assert accepted.weak_accepted == report.cannot_verify.replace(
        "pass accept_weak=True (verify --accept-weak) to accept the weak check.", ACCEPTED
    )
    summary = accepted.to_dict()
    assert (summary["verdict"], summary["weak_accepted"]) == (
        "PASS (weak check accepted)",
        accepted.weak_accepted,
    )
    text = str(accepted)
    assert text.startswith("parity PASS (weak check accepted) for step '_summed_loss_only'")
    assert f"weak check accepted: {accepted.weak_accepted}" in text
    # a check that can tell a factor S apart (the gradients are returned) is a plain PASS, accepted or not
    shown = check_parity("simulation", model, optimizer, BATCHES[:2], num_shards=2, accept_weak=True)
    assert (shown.verdict, shown.weak_accepted) == ("PASS", None)


def test_a_too_small_update_cannot_be_verified_unless_accepted():
    """At lr 1e-9 a gradient x2 moves the parameters by 1e-9 |g|, far below their tolerance: a step that returns no
    gradients cannot be told from a sum for a mean. The simulation returns its gradients, which show it (2 |g|
    against a tolerance of 1e-5 |g|): PASS, with the weak update noted."""
    model = make_model("linear", 3, 2, seed=1)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-9), wrt=nnx.Param)
    report = check_parity(_loss_only, model, optimizer, BATCHES[:1], num_shards=2)
    assert not report.ok and report.verdict == "CANNOT VERIFY" and report.codes[0] == "cannot_verify"
    assert "a x2 or x1/2 error (a sum for a mean, a mean taken twice)" in report.diagnosis
    assert "Cannot verify at this precision" in report.diagnosis and "accept_weak=True" in report.diagnosis
    assert report.steps[0].scale_evidence == ((), ()) and not report.steps[0].scale_blind
    accepted = check_parity(_loss_only, model, optimizer, BATCHES[:1], num_shards=2, accept_weak=True)
    assert accepted.ok and accepted.verdict == "PASS (weak check accepted)" and "weak_check" in accepted.codes
    assert accepted.weak_accepted.startswith("Cannot verify at this precision")
    shown = check_parity("simulation", model, optimizer, BATCHES[:1], num_shards=2)
    assert shown.verdict == "PASS" and "weak_check" in shown.codes, str(shown)
    assert shown.steps[0].scale_evidence == (("grad bias", "grad kernel"),) * 2
    assert (
        shown.scale_evidence
        == "a gradient x2 or x1/2 would have failed 2 leaves at step 0 (grad bias, grad kernel)."
    )


def test_low_precision_parameters_add_their_rounding_and_say_so():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    report = check_parity("simulation", model, optimizer, BATCHES[:2], num_shards=4)
    eps32 = float(jnp.finfo(jnp.float32).eps)
    # float32 accumulation, plus one bfloat16 rounding of the stored parameters per step
    assert report.steps[0].rtol == pytest.approx(16 * eps32 * math.sqrt(32))
    assert "params bfloat16: +eps_p * max|p| per step" in report.tolerance_rule
    assert report.verdict == "PASS", str(report)

    def summed(model, optimizer, x, y):
        grads = nnx.grad(lambda m: 4 * mse_loss(m, x, y))(model)
        optimizer.update(model, grads)

    bad = check_parity(summed, model, optimizer, BATCHES[:2], num_shards=4)
    assert bad.verdict == "FAIL" and "summed" in bad.codes, str(bad)


def test_per_leaf_tolerances_override_the_rule():
    model, optimizer = fresh("linear", "sgd")

    def off(model, optimizer, x, y):
        loss = shardcheck.sgd_step(model, optimizer, x, y)
        model.bias[...] = model.bias[...] + 1e-3
        return loss

    assert not check_parity(off, model, optimizer, BATCHES[:1]).ok
    report = check_parity(off, model, optimizer, BATCHES[:1], leaf_tolerance={"param bias": (0.0, 2e-3)})
    assert report.ok, str(report)
    report = check_parity(off, model, optimizer, BATCHES[:1], leaf_tolerance=lambda name: None)
    assert not report.ok
    with pytest.raises(ValueError, match=r"leaf_tolerance\['bias'\] must be a pair"):
        check_parity(off, model, optimizer, BATCHES[:1], leaf_tolerance={"bias": 1e-3})
    # the callable form is called once per leaf name before the run: the same override by name
    wide = lambda name: (0.0, 2e-3) if name == "param bias" else None  # noqa: E731
    assert check_parity(off, model, optimizer, BATCHES[:1], leaf_tolerance=wide).ok


@pytest.mark.parametrize(
    ("leaf_tolerance", "error", "message"),
    [
        (
            {"param bais": (0.0, 1.0)},
            ValueError,
            r"leaf_tolerance key 'param bais' names no leaf of the task.*e.g. 'loss', 'param bias', 'param kernel'",
        ),
        ({3: (0.0, 1.0)}, ValueError, r"leaf_tolerance key 3 names no leaf"),
        ({"bias": (True, 1.0)}, ValueError, r"leaf_tolerance\['bias'\] must be a pair"),
        (
            lambda name: "loose",
            ValueError,
            r"leaf_tolerance\('loss'\) must be a pair \(rtol, atol\).*got 'loose'",
        ),
        (
            lambda name: 1 / 0,
            ValueError,
            r"leaf_tolerance\('loss'\) raised ZeroDivisionError: division by zero",
        ),
        (lambda: None, ValueError, r"leaf_tolerance\('loss'\) raised TypeError: .*called with one leaf name"),
        (0.1, TypeError, r"leaf_tolerance must be a mapping"),
    ],
)
def test_a_malformed_per_leaf_tolerance_is_refused_before_the_run(leaf_tolerance, error, message):
    """A key that names no leaf (a typo would quietly do nothing), a value that is not a pair, a callable that
    raises or returns something else: an error naming leaf_tolerance and the leaf, before any step runs."""
    model, optimizer = fresh("linear", "sgd")
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    with pytest.raises(error, match=message):
        check_parity("simulation", model, optimizer, BATCHES[:1], num_shards=2, leaf_tolerance=leaf_tolerance)
    after = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    jax.tree.map(np.testing.assert_array_equal, before, after)  # nothing was touched


def test_accept_weak_must_be_a_bool():
    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(TypeError, match=r"check_parity: accept_weak must be True or False, got 'yes'"):
        check_parity("simulation", model, optimizer, BATCHES[:1], num_shards=2, accept_weak="yes")


# ------------------------------------------------------------------------------------- the report, validation


def test_report_fields_and_json():
    model, optimizer = fresh("mlp", "adam")
    report = check_parity("simulation", model, optimizer, BATCHES[:2], num_shards=2, name="mine")
    d = report.to_dict()
    json.dumps(d)  # JSON-ready
    assert d["ok"] is True and d["steps"] == 2 and d["num_shards"] == 2
    assert d["worst_leaf"] == report.worst_leaf and d["max_abs_err"] == report.max_abs_err
    assert set(d["worst_by_kind"]) == {"loss", "grad", "param", "opt_state", "counter"}
    assert report.strategy == "mine" and str(report).startswith("parity PASS for strategy 'mine'")
    assert report.builtin is True
    paths = {e.path for e in report.steps[0].leaves}
    assert {"hidden.kernel", "out.bias", "0.mu.hidden.kernel", "0.nu.out.bias", "0.count", "step"} <= paths
    for e in report.steps[0].leaves:
        assert e.ok and e.max_abs_err <= e.tolerance and math.isfinite(e.max_rel_err)


def test_bad_arguments_raise_before_any_step():
    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(ValueError, match="steps=5 but batches holds only 2"):
        check_parity("simulation", model, optimizer, BATCHES[:2], num_shards=2, steps=5)
    with pytest.raises(TypeError, match="check_parity: candidate must be"):
        check_parity(42, model, optimizer, BATCHES[:1])
    with pytest.raises(ValueError, match="needs num_shards"):
        check_parity("dp", model, optimizer, BATCHES[:1])
    with pytest.raises(ValueError, match="strategy 'zero' is unknown"):
        check_parity("zero", model, optimizer, BATCHES[:1], num_shards=2)
    with pytest.raises(TypeError, match="takes no weights= argument"):
        check_parity(lambda m, o, x, y: None, model, optimizer, [(X[:4], Y[:4], np.ones(4))])
    with pytest.raises(ValueError, match="'multiprocess' needs several JAX processes"):
        check_parity("multiprocess", model, optimizer, BATCHES[:1], num_shards=2)
    with pytest.raises(ValueError, match="batches is empty"):
        check_parity("simulation", model, optimizer, [], num_shards=2)


def test_one_batch_repeated_for_steps():
    model, optimizer = fresh("linear", "momentum")
    report = check_parity("simulation", model, optimizer, BATCHES[0], steps=3, num_shards=4)
    assert report.ok and len(report.steps) == 3 and report.steps[-1].step_count == 3


def test_minibatches_reshuffle_every_epoch():
    x = np.arange(10, dtype=np.float32)[:, None]
    batches = minibatches(x, x, 4, 5, seed=3)
    assert [b[0].shape for b in batches] == [(4, 1)] * 5
    first_epoch = np.concatenate([b[0][:, 0] for b in batches[:2]])
    assert len(set(first_epoch.tolist())) == 8  # no row twice within an epoch; 2 rows skipped
    assert not np.array_equal(batches[0][0], batches[2][0])  # a new permutation in epoch 2
    assert all(
        np.array_equal(a[0], b[0]) for a, b in zip(batches, minibatches(x, x, 4, 5, seed=3), strict=True)
    )
    with pytest.raises(ValueError, match="batch_size must be an int in \\[1, 10\\]"):
        minibatches(x, x, 11, 1)


# ------------------------------------------------- batch-dependent models (C7): checked where a step can be right


class BatchNormNet(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(x))


class DropoutNet(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.lin(x))


@require_devices(2)
def test_batch_statistics_pass_under_gspmd_and_are_refused_per_shard():
    """BatchNorm in training mode (issue #36, trial 8): the gspmd step computes the full batch's statistics, so it
    passes, its running averages compared coarsely on their change (2 leaves, both steps write them); simulation
    and dp compute them over part of the batch: refused per strategy, naming the batch statistics and what
    works (was: every check of such a model refused)."""
    model = BatchNormNet()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    report = check_parity("gspmd", model, optimizer, BATCHES[:2], num_shards=2)
    assert report.ok and report.codes[0] == "parity", str(report)
    stats = [e for r in report.steps for e in r.leaves if e.kind == "state"]
    assert sorted({e.path for e in stats}) == ["model.bn.mean", "model.bn.var"]
    assert all(e.reference_change > 0 and e.tolerance == 0.5 * e.reference_change for e in stats)
    assert "2 leaves of floating state written by both steps" in report.diagnoses[0].message
    for strategy, how in (("simulation", "once per shard"), ("dp", "per device in jax.shard_map")):
        with pytest.raises(ValueError) as info:
            check_parity(strategy, model, optimizer, BATCHES[:1], num_shards=2)
        text = str(info.value)
        assert text.startswith(
            f"{strategy}: cannot run this model: its forward pass writes non-parameter state (bn.mean, bn.var)"
        ), text
        assert f"{strategy} runs the forward pass {how}" in text
        assert (
            "its batch statistics (nnx.BatchStat: BatchNorm) would be computed over part of the batch" in text
        )


@require_devices(2)
def test_dropout_at_a_nonzero_rate_passes_under_gspmd_and_is_refused_per_shard():
    """Dropout(0.5) draws a mask in its forward pass: the gspmd step draws the full batch's mask however the batch
    is split (parity over 2 steps, the mask drawn anew at each); simulation and dp run the forward pass per shard,
    every shard drawing with the same key: refused, naming the strategy, why, and the GSPMD step that works."""
    model = DropoutNet()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    report = check_parity("gspmd", model, optimizer, BATCHES[:2], num_shards=2)
    assert report.ok and report.codes[0] == "parity", str(report)
    counts = [e for r in report.steps for e in r.leaves if e.name == "counter model.drop.rngs.count"]
    assert [(e.step, e.ok) for e in counts] == [(0, True), (1, True)]  # both sides drew once a step
    for strategy, how in (("simulation", "once per shard"), ("dp", "per device in jax.shard_map")):
        with pytest.raises(ValueError) as info:
            check_parity(strategy, model, optimizer, BATCHES[:1], num_shards=2)
        text = str(info.value)
        assert text.startswith(
            f"{strategy}: cannot run this model: model DropoutNet draws random numbers in its forward pass (RNG "
            f"stream(s) drop.rngs), and {strategy} runs the forward pass {how}, every shard drawing with the same key"
        ), text
        assert "Check it with a GSPMD step (strategy gspmd" in text


class DeterministicDropoutNet(nnx.Module):
    """The tutorials' shape: a Dropout holding an RNG stream, made deterministic by its rate or by eval()."""

    def __init__(self, rate):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.lin(x))


@pytest.mark.parametrize("rate, eval_mode", [(0.0, False), (0.5, True)], ids=["rate0", "eval"])
def test_a_deterministic_model_holding_rng_streams_is_accepted(rate, eval_mode):
    model = DeterministicDropoutNet(rate)
    if eval_mode:
        model.eval()
    optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    report = check_parity("dp", model, optimizer, BATCHES[:3], num_shards=2)
    assert report.ok and report.codes[0] == "parity", str(report)


# ------------------------------------------------ (loss_sum, weight) losses: uneven and masked shards (C4, C5, C6)


def zero_linear():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((2, 1))
    model.bias[...] = jnp.zeros((1,))
    return model


def weighted_mse(model, batch):
    """The weighted MSE a user writes for masked or padded rows: (sum of weighted squared errors, sum of weights)."""
    err = jnp.mean((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(batch["w"] * err), jnp.sum(batch["w"])


def padded_batch(b, shard_sizes, weights=None):
    """Fixture Z (x = 1, y = 1..b) cut into shards of the given sizes, each padded with weight-0 rows to the
    largest, so the S shards of the padded batch hold exactly those rows."""
    w_rows = np.ones(b, np.float32) if weights is None else np.asarray(weights, np.float32)
    width = max(shard_sizes)
    x, y, w, start = [], [], [], 0
    for size in shard_sizes:
        rows = np.arange(start, start + size)
        start += size
        x += [np.ones(2, np.float32)] * width
        y += [[float(r + 1)] for r in rows] + [[0.0]] * (width - size)
        w += list(w_rows[rows]) + [0.0] * (width - size)
    return {"x": np.stack(x), "y": np.asarray(y, np.float32), "w": np.asarray(w, np.float32)}


C4_C6 = [
    # (case, B, shard sizes, weights, right loss, right bias grad, mean of per-shard means: loss, bias grad)
    ("C4-3|5", 8, (3, 5), None, 25.5, -9.0, 21.0 + 1 / 3, -8.0),
    ("C4-3|3|2", 8, (3, 3, 2), None, 25.5, -9.0, 28.944444, -9.666667),
    ("C5-mask", 8, (4, 4), [1, 0, 0, 0, 1, 1, 1, 0], 27.75, -9.5, 18.833333, -7.0),
    ("C6-10/4", 10, (3, 3, 2, 2), None, 38.5, -11.0, 133 / 3, -12.0),
]


def weighted_task(b, sizes, weights, steps=1):
    return shardcheck.Task(
        model=zero_linear,
        optimizer=optax.sgd(0.1),
        loss_fn=weighted_mse,
        batches=[padded_batch(b, sizes, weights)] * steps,
    )


@pytest.mark.parametrize("strategy", ["simulation", "accumulation", "dp", "fsdp"])
@pytest.mark.parametrize(("case", "b", "sizes", "weights", "loss", "bias", "naive", "naive_bias"), C4_C6)
def test_weighted_loss_reproduces_the_full_batch_values(
    strategy, case, b, sizes, weights, loss, bias, naive, naive_bias
):
    task = weighted_task(b, sizes, weights, steps=2)
    report = check_parity(strategy, task, num_shards=len(sizes))
    assert report.ok, str(report)
    np.testing.assert_allclose(report.steps[0].loss, loss, rtol=1e-6)
    np.testing.assert_allclose(report.steps[0].candidate_loss, loss, rtol=1e-6)
    model = zero_linear()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    result = reference_step(weighted_mse, model, optimizer, task.batches[0])
    np.testing.assert_allclose(result.loss, loss, rtol=1e-6)
    np.testing.assert_allclose(result.grads["bias"][...], [bias], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [-0.1 * bias], rtol=1e-6)  # exactly one SGD step


@pytest.mark.parametrize(("case", "b", "sizes", "weights", "loss", "bias", "naive", "naive_bias"), C4_C6)
def test_the_mean_of_per_shard_means_fails_and_is_named(
    case, b, sizes, weights, loss, bias, naive, naive_bias
):
    """The planted fault: each shard divides by its own weight, then the shard losses are averaged."""
    from shardcheck.steps.simulation import simulation_step

    def per_shard_mean(model, batch):
        total, weight = weighted_mse(model, batch)
        return total / weight

    def naive_step(model, optimizer, batch):
        return simulation_step(per_shard_mean, len(sizes), model, optimizer, batch)

    report = check_parity(naive_step, weighted_task(b, sizes, weights), num_shards=len(sizes))
    assert not report.ok and report.codes[0] == "normalization", str(report)
    assert "mean of per-shard means" in report.diagnosis and "token count" in report.diagnosis
    np.testing.assert_allclose(report.steps[0].candidate_loss, naive, rtol=1e-5)


def test_the_regression_form_takes_weighted_batches():
    x, y = np.ones((8, 2), np.float32), np.arange(1, 9, dtype=np.float32)[:, None]
    model = zero_linear()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    report = check_parity(
        "dp", model, optimizer, [(x, y, np.array([1, 0, 0, 0, 1, 1, 1, 0]))] * 2, num_shards=2
    )
    assert report.ok, str(report)
    np.testing.assert_allclose(report.steps[0].loss, 27.75, rtol=1e-6)


@pytest.mark.parametrize("strategy", ["simulation", "dp", "fsdp"])
def test_a_scalar_loss_with_uneven_shards_is_refused(strategy):
    x, y = np.ones((10, 2), np.float32), np.arange(1, 11, dtype=np.float32)[:, None]
    model = zero_linear()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=r"batch size 10 \(batch leaf '0'\) is not divisible by num_shards=4.*return \(loss_sum, weight\)",
    ):
        check_parity(strategy, model, optimizer, [(x, y)], num_shards=4)


def test_one_registry_names_every_strategy():
    from shardcheck.cli import verify
    from shardcheck.steps import CANDIDATES, STRATEGIES

    assert tuple(STRATEGIES) == (
        "reference", "simulation", "dp", "fsdp", "gspmd", "accumulation", "multiprocess",
    )  # fmt: skip
    assert CANDIDATES == ("simulation", "dp", "fsdp", "gspmd", "accumulation")
    assert verify.STRATEGY_NAMES == (*CANDIDATES, "multiprocess")
    assert verify.DEFAULT_STRATEGIES == "simulation,dp,fsdp,gspmd,accumulation"
    assert {s.placement for s in STRATEGIES.values()} == {"single", "replicated", "fsdp"}
    assert sorted(n for n in shardcheck.__all__ if not hasattr(shardcheck, n)) == []


# ------------------------------------------- trajectories that diverge, references that diverge, bad candidates


def diabetes_mlp(steps, opt="momentum", lr=0.05):
    from shardcheck import datasets

    data = datasets.load_dataset("diabetes")
    model = make_model("mlp", data.x.shape[1], data.y.shape[1], hidden=32, seed=0)
    tx = TX[opt] if lr == LR[opt] else make_tx(opt, lr)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param), minibatches(data.x, data.y, 64, steps, seed=0)


def test_a_relu_flip_is_a_diverged_trajectory_not_a_failure():
    """A rounding-level difference that lands a ReLU on the other side of its kink separates the runs; every step
    still matches from the reference's own state (``tests/kinked.py``: the step it splits at is fixed by exact
    arithmetic, not by a compiler's rounding)."""
    report = check_parity(kinked.rounded_step, kinked.task, num_shards=2)
    t, n = kinked.DIVERGES_AT, kinked.STEPS
    assert report.diverged_at == t and report.diverged.step == t and not report.diverged.ok
    (split,) = [e for e in report.diverged.leaves if not e.ok]
    assert split.name == "param b" and split.max_abs_err == pytest.approx(
        0.5, abs=1e-5
    )  # a step the ref skips
    assert not report.ok and report.step_ok and report.verdict == "PASS (per step)"
    assert report.codes == ("diverged_trajectory",)
    assert [r.synchronized for r in report.steps] == [False] * t + [True] * (n - t)
    assert all(r.ok for r in report.steps) and report.worst.badness < 0.5
    msg = report.diagnosis
    assert f"diverged at step {t}" in msg and "ReLU" in msg and "from identical state" in msg
    assert f"every step from {t} on ({n - t} step(s))" in msg and "compare fewer steps" in msg
    assert report.diagnoses[0].leaf == "param b"
    assert str(report).startswith(f"parity PASS (per step) for step 'rounded_step' over {n} step(s)")
    d = report.to_dict()
    assert (
        d["verdict"] == "PASS (per step)" and d["diverged_at"] == t and d["per_step"][n - 1]["synchronized"]
    )
    assert assert_step_parity(kinked.rounded_step, kinked.task, num_shards=2).verdict == "PASS (per step)"
    # the exact step, from the same state, never separates
    assert check_parity("simulation", kinked.task, num_shards=2).verdict == "PASS"


def test_a_bug_that_starts_later_still_fails():
    def summed_from_step_10(model, optimizer, x, y):  # correct for 10 steps, then a sum over 2 shards
        if int(optimizer.step[...]) < 10:
            return shardcheck.sgd_step(model, optimizer, x, y)
        loss, grads = nnx.value_and_grad(mse_loss)(model, x, y)
        optimizer.update(model, jax.tree.map(lambda g: 2 * g, grads))
        return loss

    model, optimizer, batches = diabetes_mlp(14)
    report = check_parity(summed_from_step_10, model, optimizer, batches, num_shards=2)
    assert report.verdict == "FAIL" and not report.ok and not report.step_ok
    assert report.diverged_at is None and "diverged_trajectory" not in report.codes
    assert all(r.ok for r in report.steps[:10]) and not report.steps[10].ok
    # step 10 is its re-check from the reference's pre-step state (it fails there too: the step itself is
    # faulty), with that re-check's whole evidence; the steps after it run on the candidate's own trajectory
    assert [r.synchronized for r in report.steps] == [False] * 10 + [True] + [False] * 3
    # its momentum trace mixes ten correct steps with one summed one (a ratio that is not 2): the harness names
    # the sum by rerunning the reference's optimizer on twice the gradient from step 10's state
    assert report.codes[0] == "summed" and report.steps[10].matches == ("times_S",)
    assert (
        "At step 10, the gradients" in report.diagnosis
        and "summed instead of averaged (x2" in report.diagnosis
    )
    with pytest.raises(ParityError):
        assert_step_parity(summed_from_step_10, model, optimizer, batches, num_shards=2)


def test_a_reference_that_diverges_is_no_verdict():
    model, optimizer, batches = diabetes_mlp(30, "sgd", 2.0)
    report = check_parity("simulation", model, optimizer, batches, num_shards=2)
    t = report.reference_diverged_at
    assert t is not None and 0 < t < 30 and len(report.steps) == t
    assert all(r.ok for r in report.steps)  # every finite step matched; the rest is not compared
    assert report.codes == ("reference_diverged",) and report.verdict == "NO VERDICT"
    assert not report.ok and not report.step_ok
    assert f"non-finite loss or parameters at step {t}" in report.diagnosis
    assert "Lower the learning rate" in report.diagnosis
    # trial 13: a token id past the vocabulary made the loss NaN from finite parameters, and only the learning
    # rate was blamed: the batch is named as the other cause
    assert f"where batch {t} makes the loss non-finite from finite parameters" in report.diagnosis


def test_a_candidate_that_raises_is_reported_with_its_step():
    def raises_at_2(model, optimizer, x, y):
        if int(optimizer.step[...]) == 2:
            raise ZeroDivisionError("planted")
        return shardcheck.sgd_step(model, optimizer, x, y)

    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(
        parity.CandidateError,
        match="candidate step 'raises_at_2' raised ZeroDivisionError at step 2: planted",
    ) as info:
        check_parity(raises_at_2, model, optimizer, BATCHES[:4])
    assert info.value.step == 2 and isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("returned", "msg"),
    [
        ("garbage", "returned str at step 0; it must return the scalar pre-update loss, None, or an object"),
        (np.zeros(3), "returned ndarray of shape (3,) at step 0"),
        ({"grads": None}, "returned a mapping without 'loss'"),
        ({"loss": "x"}, "returned loss of type str"),
    ],
)
def test_a_candidate_returning_garbage_is_refused(returned, msg):
    def step(model, optimizer, x, y):
        shardcheck.sgd_step(model, optimizer, x, y)
        return returned

    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(TypeError, match=re.escape(msg)):
        check_parity(step, model, optimizer, BATCHES[:1])


@pytest.mark.parametrize(
    ("shape_grads", "named"),
    [
        (lambda g: (g["kernel"], g["bias"]), "missing 'bias', 'kernel'; extra '0', '1'"),
        (lambda g: {"kernel": g["kernel"]}, "missing 'bias';"),
        (lambda g: {**g, "scale": g["bias"]}, "extra 'scale';"),
    ],
    ids=["tuple", "missing", "extra"],
)
def test_gradients_of_another_structure_are_refused_naming_the_leaves(shape_grads, named):
    """From the trial: gradients whose tree is not the parameters' were a grads_differ failure with an infinite
    error; the refusal names the missing and extra leaf paths and the fix."""

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(mse_loss)(model, x, y)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": shape_grads(dict(nnx.to_pure_dict(grads)))}

    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(parity.CandidateError) as info:
        check_parity(step, model, optimizer, BATCHES[:2])
    message = str(info.value)
    assert message.startswith(
        "check_parity: the candidate step 'step' returned grads whose structure differs from the model's "
        f"parameters at step 0 ({named}"
    ), message
    assert message.endswith(
        "the parameters' leaves are 'bias', 'kernel'): return grads with the structure of "
        "nnx.state(model, nnx.Param), e.g. nnx.grad(loss)(model) or jax.grad of a function of "
        "nnx.state(model, nnx.Param)"
    ), message
    assert info.value.step == 0 and info.value.__cause__ is None
    assert info.value.hint.startswith("return grads with the structure of nnx.state(model, nnx.Param)")


def test_reference_and_candidate_must_be_steps():
    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(TypeError, match="check_parity: reference must be None .* got int 3"):
        check_parity("simulation", model, optimizer, BATCHES[:1], num_shards=2, reference=3)

    def three(model, optimizer, x):
        return None

    with pytest.raises(
        TypeError, match=re.escape("check_parity: candidate three(model, optimizer, x) cannot be")
    ):
        check_parity(three, model, optimizer, BATCHES[:1])
    with pytest.raises(
        TypeError, match="check_parity: reference three.* it must take \\(model, optimizer, x, y\\)"
    ):
        check_parity("simulation", model, optimizer, BATCHES[:1], num_shards=2, reference=three)


@pytest.mark.parametrize(
    ("weights", "msg"),
    [
        (-np.ones(16), "batch 0 weights must be >= 0, got 16 negative value(s) (min -1)"),
        (np.ones(5), "batch 0 weights must have shape (16,) (one weight per row of x), got shape (5,)"),
        (np.full(16, np.nan), "batch 0 weights must be finite, got 16 non-finite value(s)"),
        (np.zeros(16), "batch 0 weights must not be all zero"),
    ],
)
def test_bad_weights_name_the_rule_they_break(weights, msg):
    model, optimizer = fresh("linear", "sgd")
    with pytest.raises(ValueError, match=re.escape(msg)):
        check_parity("simulation", model, optimizer, [(*BATCHES[0], weights)], num_shards=2)


def test_repeated_findings_are_merged():
    model, optimizer = fresh("linear", "sgd")
    report = check_parity("simulation", model, optimizer, BATCHES[:2], num_shards=2, rtol=1e9)
    assert report.codes == ("parity", "weak_check")
    weak = report.diagnoses[1].message
    assert "too loose" in weak and "is not larger than the tolerance" in weak
