"""Mixed precision: the policy, its derived tolerances, correct bf16 steps that pass and planted faults that fail.

Policies: float32 parameters with bfloat16 compute (master weights), and bfloat16 parameters (which compute in
bfloat16 too). The digits MLP and the tiny-lm each run the whole grid: both policies, S in {2, 8}, every strategy
PASS and the planted faults FAIL by name. The tiny-lm here is a one-block version of the built-in (same layers,
fewer of them) so that the checks compile quickly; its planted faults are ``tests/test_task_parity.py``'s
hand-written DP steps.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices, small_lm_config
from flax import nnx
from test_task_parity import per_shard_optimizer_step, reduce_in, user_dp_step

import shardcheck
from shardcheck import check_parity
from shardcheck.parity import shared_reference
from shardcheck.parity.tolerance.precision import (
    COMPUTE_SAFETY,
    Precision,
    compute_allowance,
    float32_compute,
    output_rounding,
)
from shardcheck.task import mean_loss
from shardcheck.tasks import digits_task, tiny_lm_task
from shardcheck.tasks.digits import digits_loss

EPS32 = 2.0**-23  # float32 eps
EPS_BF16 = 2.0**-7  # bfloat16 eps (8 significand bits)


@functools.cache
def lm(compute_dtype="bfloat16", param_dtype=None):
    """Adam at the task's default rate (0.01), B = 16 rows of T = 16 tokens, 2 steps."""
    return tiny_lm_task(
        config=small_lm_config(), steps=2, compute_dtype=compute_dtype, param_dtype=param_dtype
    )


# --------------------------------------------------------------------------------------- policy and arithmetic


def test_the_policy_is_read_from_the_layers_and_can_be_overridden():
    assert Precision.of(lm(None).model()).describe() == "params float32, compute float32"
    mixed = Precision.of(lm().model())
    assert mixed.describe() == "params float32, compute bfloat16"
    assert (mixed.compute_eps, mixed.param_eps) == (EPS_BF16, 0.0)
    low = Precision.of(
        lm(None, "bfloat16").model()
    )  # a layer without dtype computes in its parameters' dtype
    assert low.describe() == "params bfloat16, compute bfloat16" and low.param_eps == EPS_BF16
    assert Precision.of(lm(None).model(), compute_dtype="float16").compute_eps == 2.0**-10
    digits = digits_task(steps=1, compute_dtype="bfloat16", param_dtype="bfloat16").model()
    assert Precision.of(digits).describe() == "params bfloat16, compute bfloat16"
    assert digits.hidden.kernel[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="check_parity: compute_dtype='int8' is not a floating dtype"):
        Precision.of(digits, compute_dtype="int8")


def test_an_override_more_precise_than_the_model_is_refused():
    """A float32 policy on bfloat16 layers would derive float32 tolerances for bfloat16 rounding: a correct step
    would FAIL (as a bfloat16 all-reduce). Less precise overrides, and float32 compute on float32 layers over
    bfloat16 parameters, are the user's to make."""
    with pytest.raises(
        ValueError,
        match=r"compute_dtype='float32' is more precise than the model's own bfloat16 \(its layers or its loss's matmuls\).*omit compute_dtype or pass 'bfloat16'",
    ):
        Precision.of(lm().model(), compute_dtype="float32")
    with pytest.raises(
        ValueError,
        match=r"param_dtype='float32' is more precise than the model's own bfloat16 \(its parameters\)",
    ):
        Precision.of(lm(None, "bfloat16").model(), param_dtype="float32")
    with pytest.raises(ValueError, match="compute_dtype='float32' is more precise"):
        check_parity("simulation", lm(), num_shards=2, compute_dtype="float32")
    master = digits_task(steps=1, param_dtype="bfloat16").model()  # float32 layers on bfloat16 parameters
    assert Precision.of(master).describe() == "params bfloat16, compute bfloat16"  # conservative by default
    assert Precision.of(master, compute_dtype="float32").describe() == "params bfloat16, compute float32"
    assert Precision.of(lm(None).model(), compute_dtype="bfloat16").compute_eps == EPS_BF16


def test_the_compute_allowance_is_four_times_the_measured_split_noise_plus_the_drift():
    # noise of leaf "b": max |g_S - g| = 2^-7 (a bfloat16 ulp at 1); no drift: 4 * 2^-7 on every element
    split, grads = {"b": jnp.array([1.0, 2.0])}, {"b": jnp.array([1.0 + 2.0**-7, 2.0])}
    assert COMPUTE_SAFETY == 4.0
    np.testing.assert_array_equal(compute_allowance(split, grads)["b"], [2.0**-5, 2.0**-5])
    # the gradient at the candidate's parameters moved element 1 by 0.25: 4 * (2^-7 + 0.25) there
    drifted = {"b": jnp.array([1.0 + 2.0**-7, 2.25])}
    np.testing.assert_array_equal(
        compute_allowance(split, grads, drifted)["b"], [2.0**-5, 4 * (2.0**-7 + 0.25)]
    )


def test_the_output_rounding_is_eps_c_times_the_gradient_and_the_shard_magnitudes():
    """Each side rounds to the compute dtype once per product it outputs: the reference its full-batch gradient
    (half an ulp of |g|), a split each shard's (half an ulp of |g_s|) and, reduced in that dtype at S = 2, their
    sum (half an ulp of |g|): at most eps_c (|g| + A). Two shards of g_s = (+3, -1) and (+1, -1): g = (4, -2)
    over weight 1, A = (4, 2)."""
    g, a = {"b": jnp.array([4.0, -2.0])}, {"b": jnp.array([4.0, 2.0])}
    np.testing.assert_array_equal(output_rounding(g, a, EPS_BF16)["b"], [8 * 2.0**-7, 4 * 2.0**-7])
    np.testing.assert_array_equal(output_rounding(g, a, 0.0)["b"], [0.0, 0.0])  # float32 compute adds nothing
    # the bound holds for a real split rounded as the GSPMD step does: shards rounded to bfloat16, summed
    # in bfloat16, against the full sum rounded once, for random float32 partials
    rng = np.random.default_rng(0)
    parts = rng.normal(size=(2, 4096)).astype(np.float32)
    exact = parts.sum(axis=0, dtype=np.float64)
    reference = jnp.asarray(exact, jnp.bfloat16).astype(jnp.float32)
    split = jnp.sum(jnp.asarray(parts, jnp.bfloat16), axis=0, dtype=jnp.bfloat16).astype(jnp.float32)
    allowed = output_rounding({"b": reference}, {"b": jnp.sum(jnp.abs(jnp.asarray(parts)), axis=0)}, EPS_BF16)
    assert bool(jnp.all(jnp.abs(split - reference) <= allowed["b"]))


def test_the_float32_realization_is_the_same_model_computing_in_float32():
    """The reference's gradient without the compute dtype's rounding: every Flax layer below float32 (or unset,
    on bfloat16 parameters) computes in float32, the parameters untouched; None where nothing computes below."""
    model = nnx.Sequential(
        nnx.Linear(3, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
        nnx.LayerNorm(4, rngs=nnx.Rngs(0)),  # float32 already (dtype None on float32 parameters): kept
        nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)),  # computes in its bfloat16 parameters
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    wide = nnx.merge(float32_compute(graphdef, params, rest), params, rest)
    assert [m.dtype for m in wide.layers] == [jnp.float32, None, jnp.float32]
    assert [m.dtype for m in model.layers] == [jnp.bfloat16, None, None]  # the caller's model is unchanged
    assert wide.layers[2].kernel[...].dtype == jnp.bfloat16  # the parameters keep their dtype
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
    first = model.layers[0]
    np.testing.assert_array_equal(wide.layers[0](x), x @ first.kernel[...] + first.bias[...])
    assert first(x).dtype == jnp.bfloat16
    plain = nnx.split(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Param, ...)
    assert float32_compute(*plain) is None


def test_the_loss_allowance_is_eps_c_times_the_loss_over_sqrt_n():
    from shardcheck.parity.tolerance.precision import loss_compute_allowance

    bf16 = Precision.of(nnx.Linear(2, 1, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert loss_compute_allowance(bf16, 4.0, 256) == pytest.approx(2.0**-7 * 4.0 / 16)  # 2^-7 * 4 / sqrt(256)
    assert loss_compute_allowance(Precision.of(nnx.Linear(2, 1, rngs=nnx.Rngs(0))), 4.0, 256) == 0.0


def assert_derived(report, *, params_bf16: bool):
    """The tolerance a policy derives, pinned: float32 accumulation over n = B * T = 256 tokens for both
    policies (rtol = 16 eps32 sqrt(n) = 3.05e-5, atol = eps32 sqrt(n) at t = 0), the measured compute allowance,
    and for bfloat16 parameters one eps_p max|p| per step (two half-ulp roundings, one per side)."""
    step = report.steps[0]
    assert step.rtol == pytest.approx(16 * EPS32 * math.sqrt(256)) == pytest.approx(3.0518e-5, rel=1e-4)
    assert step.atol == pytest.approx(EPS32 * 16)
    assert "compute bfloat16: gradients + 4 * (max|g_S - g| + |g(p_cand) - g|)" in report.tolerance_rule
    assert "+ eps_c * (|g| + sum_s|g_s|) (its output roundings; eps_c=0.00781)" in report.tolerance_rule
    assert ("params bfloat16: +eps_p * max|p| per step" in report.tolerance_rule) == params_bf16


# ----------------------------------------------------------------------------------- correct steps pass


@require_devices(2)
def test_bf16_parameters_pass_on_the_mlp():
    task = digits_task(steps=2, batch_size=32, param_dtype="bfloat16")
    report = check_parity("simulation", task, num_shards=2)
    assert report.verdict == "PASS", str(report)
    assert "params bfloat16: +eps_p * max|p| per step" in report.tolerance_rule


# ------------------------------------------------------------------------------------- planted faults fail


@require_devices(2)
def test_sum_for_mean_fails_with_bf16_parameters_on_the_mlp():
    task = digits_task(steps=2, batch_size=32, param_dtype="bfloat16")

    def summed(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: 2 * task.loss_fn(m, batch))(model)
        optimizer.update(model, grads)
        return loss / 2

    report = check_parity(summed, task, num_shards=2)
    assert report.verdict == "FAIL" and "summed" in report.codes, str(report)


# ------------------------------------------------------------------ the MLP under both policies, S in {2, 8}

POLICIES = {"bf16_compute": {"compute_dtype": "bfloat16"}, "bf16_params": {"param_dtype": "bfloat16"}}
EVERY_STRATEGY = ("simulation", "dp", "fsdp", "accumulation", "gspmd")


@functools.cache
def digits(policy):
    """The digits MLP (64 -> 32 -> 10, Adam) under a low-precision policy: 2 steps of B = 32."""
    return digits_task(steps=2, batch_size=32, **POLICIES[policy])


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _shard_losses_and_grads(loss_fn, graphdef, num_shards, params, rest, batch):
    """Each shard's mean loss and its gradient, stacked ``(S, ...)``, in the model's own precision."""
    shards = jax.tree.map(lambda a: a.reshape(num_shards, -1, *a.shape[1:]), batch)

    def one(shard):
        return jax.value_and_grad(lambda p: mean_loss(loss_fn, nnx.merge(graphdef, p, rest), shard))(params)

    return jax.lax.map(one, shards)


def planted(fault, num_shards):
    """A user's data-parallel step, simulated shard by shard, with a reduction fault: ``sum`` (the shards'
    gradients summed, not averaged), ``mean_twice`` (averaged, then divided by S again) or ``stepped`` (the
    optimizer stepped once per shard)."""

    def step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        losses, grads = _shard_losses_and_grads(digits_loss, graphdef, num_shards, params, rest, batch)
        if fault == "stepped":
            for i in range(num_shards):
                optimizer.update(model, jax.tree.map(lambda g, i=i: g[i], grads))
        else:
            total = jax.tree.map(lambda g: jnp.sum(g, axis=0), grads)
            scale = 1 if fault == "sum" else num_shards * num_shards
            optimizer.update(model, jax.tree.map(lambda g: g / scale, total))
        return jnp.mean(losses)

    return step


@require_devices(8)
@pytest.mark.parametrize("num_shards", [2, 8])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_mlp_passes_every_strategy_under_both_policies(policy, num_shards):
    with shared_reference():  # one reference run for every strategy, as one verify runs them
        reports = {s: check_parity(s, digits(policy), num_shards=num_shards) for s in EVERY_STRATEGY}
    for strategy, report in reports.items():
        assert report.verdict == "PASS", (strategy, str(report))
        assert report.cannot_verify is None


@require_devices(8)
@pytest.mark.parametrize("num_shards", [2, 8])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_planted_faults_fail_on_the_mlp_under_both_policies(policy, num_shards):
    expected = {
        "sum": ("summed", f"summed instead of averaged (x{num_shards}"),
        "mean_twice": ("averaged_twice", "averaged twice"),
        "stepped": ("step_counter", f"stepped {num_shards} times per step"),
    }
    with shared_reference():  # one reference run for every fault: each report is its own check's, bit for bit
        reports = {
            f: check_parity(planted(f, num_shards), digits(policy), num_shards=num_shards) for f in expected
        }
    for fault, (code, phrase) in expected.items():
        report = reports[fault]
        assert report.verdict == "FAIL", (fault, str(report))
        assert code in report.codes, (fault, str(report))
        assert phrase in " ".join(report.diagnosis.split()), (fault, report.diagnosis)


# ------------------------------------------------------------- the tiny-lm under both policies, S = 2 and 8


@functools.cache
def lm_under(policy):
    return lm(**{"compute_dtype": None, **POLICIES[policy]})


GRID = [(policy, s) for policy in POLICIES for s in (2, 8)]
# the suite's time (~13 s a cell): each policy at both shard counts, one of them for the passing steps and the other
# for the planted faults (the MLP above runs the whole grid both ways)
PASS_GRID = [("bf16_compute", 8), ("bf16_params", 2)]
FAULT_GRID = [cell for cell in GRID if cell not in PASS_GRID]


@require_devices(8)
@pytest.mark.parametrize(("policy", "num_shards"), PASS_GRID)
def test_the_tiny_lm_passes_every_strategy_under_both_policies(policy, num_shards):
    with shared_reference():
        reports = {s: check_parity(s, lm_under(policy), num_shards=num_shards) for s in EVERY_STRATEGY}
    for strategy, report in reports.items():
        assert report.verdict == "PASS", (strategy, str(report))
        assert report.cannot_verify is None
        if strategy == "dp":
            assert_derived(report, params_bf16=policy == "bf16_params")


@require_devices(8)
@pytest.mark.parametrize(("policy", "num_shards"), FAULT_GRID)
def test_planted_faults_fail_on_the_tiny_lm_under_both_policies(policy, num_shards):
    """The hand-written DP steps of tests/test_task_parity.py: sum for mean, mean twice, each shard normalized by
    its own token count, and the optimizer stepped once per shard."""
    expected = {
        user_dp_step("sum"): ("summed", f"summed instead of averaged (x{num_shards}"),
        user_dp_step("mean_twice"): ("averaged_twice", "averaged twice"),
        user_dp_step("per_shard_mean"): ("normalization", "own weight (token count)"),
        per_shard_optimizer_step: ("step_counter", f"stepped {num_shards} times per step"),
    }
    mesh = shardcheck.make_mesh(num_shards)
    with shared_reference():
        reports = {s: check_parity(s, lm_under(policy), mesh=mesh, num_shards=num_shards) for s in expected}
    for step, (code, phrase) in expected.items():
        report = reports[step]
        assert report.verdict == "FAIL", (code, str(report))
        assert code in report.codes, (code, str(report))
        assert phrase in " ".join(report.diagnosis.split()), (code, report.diagnosis)


@require_devices(8)
def test_a_bf16_all_reduce_under_bf16_compute_is_not_told_apart():
    """Under bfloat16 compute a split's shard sum in bfloat16 is one of the realizations the allowance measures
    (a GSPMD-partitioned backward pass reduces so): the user's step that all-reduces its gradients in bfloat16,
    named as a fault in a float32-compute model (tests/test_task_parity.py), PASSes here, in either shard
    order (docs/parity.md, "A bfloat16 gradient all-reduce")."""
    mesh = shardcheck.make_mesh(8)
    with shared_reference():
        reports = [
            check_parity(reduce_in(jnp.bfloat16, r), lm_under("bf16_compute"), mesh=mesh, num_shards=8)
            for r in (False, True)
        ]
    for report in reports:
        assert report.verdict == "PASS" and "low_precision_reduction" not in report.codes, str(report)


def test_a_low_precision_stored_leaf_allows_one_rounding_of_its_own():
    """Each side stores a bfloat16 optimizer moment rounded by at most half an ulp: eps * max|s| per step (the
    parameters' rule, for the optimizer state)."""
    from shardcheck.parity.harness.check import storage_rounding

    x = jnp.array([0.5, -3.0, 1.0])
    assert storage_rounding(x.astype(jnp.bfloat16)) == EPS_BF16 * 3.0
    assert storage_rounding(x.astype(jnp.float16)) == 2.0**-10 * 3.0
    assert storage_rounding(x) == 0.0 and storage_rounding(jnp.arange(3)) == 0.0
