"""Gradient accumulation with optax.MultiSteps (``docs/reduction_cases.md`` C9) against the full-batch step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardcheck
from shardcheck import make_model, make_tx, mse_loss
from shardcheck.accumulation import accumulated_sgd_step, make_accumulation_optimizer
from shardcheck.losses import mse_batch_loss
from shardcheck.parity import check_parity
from shardcheck.steps.accumulation import accumulation_candidate

# Fixture L: full batch loss 7.5; after one SGD(0.1) step from zero: kernel [[0.6], [0.25]], bias [0.5].
XL = np.array([[1, 0], [0, 1], [1, 1], [2, 0]], np.float32)
YL = np.array([[1], [2], [3], [4]], np.float32)
RNG = np.random.default_rng(3)
X = RNG.normal(size=(48, 3)).astype(np.float32)
Y = RNG.normal(size=(48, 2)).astype(np.float32)
BATCHES = [(X[i * 12 : (i + 1) * 12], Y[i * 12 : (i + 1) * 12]) for i in range(4)]
TX = {"sgd": make_tx("sgd", 0.1), "momentum": make_tx("momentum", 0.05), "adam": make_tx("adam", 0.01)}


def zero_linear():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((2, 1))
    model.bias[...] = jnp.zeros((1,))
    return model


def test_c9_two_micro_steps_give_the_baseline():
    """The two S=2 shard gradients of Fixture L fed as micro-steps: no move, then exactly the baseline step."""
    model = zero_linear()
    optimizer = make_accumulation_optimizer(model, optax.sgd(0.1), 2)
    for i, (a, b) in enumerate(((0, 2), (2, 4))):
        loss, grads = nnx.value_and_grad(mse_loss)(model, XL[a:b], YL[a:b])
        np.testing.assert_allclose(loss, [2.5, 12.5][i])
        optimizer.update(model, grads)
        if i == 0:
            np.testing.assert_array_equal(model.kernel[...], [[0.0], [0.0]])
            np.testing.assert_array_equal(model.bias[...], [0.0])
    np.testing.assert_allclose(model.kernel[...], [[0.6], [0.25]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)
    assert int(optimizer.step[...]) == 2  # NNX counts micro-steps
    assert int(optimizer.opt_state.gradient_step[...]) == 1  # MultiSteps counts applied updates


def test_c9_a_sum_instead_of_a_mean_doubles_the_step():
    model = zero_linear()
    optimizer = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), 2, use_grad_mean=False), wrt=nnx.Param)
    for a, b in ((0, 2), (2, 4)):
        optimizer.update(model, nnx.grad(mse_loss)(model, XL[a:b], YL[a:b]))
    np.testing.assert_allclose(model.kernel[...], [[1.2], [0.5]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [1.0], rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulated_step_matches_the_full_batch_step_on_fixture_l(k):
    model = zero_linear()
    optimizer = make_accumulation_optimizer(model, optax.sgd(0.1), k)
    loss = accumulated_sgd_step(model, optimizer, XL, YL, k)
    np.testing.assert_allclose(loss, 7.5, rtol=1e-6)
    np.testing.assert_allclose(model.kernel[...], [[0.6], [0.25]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)
    assert int(optimizer.step[...]) == k and int(optimizer.opt_state.mini_step[...]) == 0


def test_the_accumulator_is_a_parameter_sized_float32_buffer_emptied_after_each_update():
    model = make_model("mlp", 3, 2, hidden=8)
    optimizer = make_accumulation_optimizer(model, optax.adam(0.01), 3)
    acc = optimizer.opt_state.acc_grads
    params = nnx.state(model, nnx.Param)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), acc) == jax.tree.map(
        lambda a: (a.shape, jnp.dtype(jnp.float32)), params
    )
    accumulated_sgd_step(model, optimizer, X[:12], Y[:12], 3)
    assert all(float(jnp.max(jnp.abs(a))) == 0.0 for a in jax.tree.leaves(optimizer.opt_state.acc_grads))


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_accumulation_candidate_passes_parity_and_checks_its_counters(opt):
    model = make_model("mlp", 3, 2, hidden=8, seed=2)
    optimizer = nnx.Optimizer(model, TX[opt], wrt=nnx.Param)
    report = check_parity(accumulation_candidate(mse_batch_loss, 4), model, optimizer, BATCHES)
    assert report.ok, str(report)
    last = report.steps[-1]
    assert last.step_count == 4 and last.candidate_step_count == 4  # gradient_step vs the reference's step
    extra = {e.path: e for e in last.leaves if e.path in ("step (NNX micro-steps)", "mini_step")}
    assert extra["step (NNX micro-steps)"].ok and extra["mini_step"].ok
    assert any(e.path.startswith("acc_grads.") for e in last.leaves)
    if opt == "adam":  # the inner Adam state is compared with the reference's
        assert {"0.mu.out.kernel", "0.nu.out.kernel", "0.count"} <= {e.path for e in last.leaves}


def test_accumulation_from_a_trained_optimizer_state():
    model = make_model("linear", 3, 2, seed=2)
    optimizer = nnx.Optimizer(model, TX["adam"], wrt=nnx.Param)
    for x, y in BATCHES[:2]:
        shardcheck.sgd_step(model, optimizer, x, y)
    report = check_parity("accumulation", model, optimizer, BATCHES[2:], num_shards=2)
    assert report.ok, str(report)
    assert report.steps[-1].step_count == 4 and report.steps[-1].candidate_step_count == 4


def test_summing_accumulator_is_diagnosed():
    def make_summing(model, optimizer):
        return nnx.Optimizer(model, optax.MultiSteps(optimizer.tx, 4, use_grad_mean=False), wrt=nnx.Param)

    candidate = dataclasses.replace(accumulation_candidate(mse_batch_loss, 4), make_optimizer=make_summing)
    model = make_model("linear", 3, 2, seed=2)
    optimizer = nnx.Optimizer(model, TX["momentum"], wrt=nnx.Param)
    report = check_parity(candidate, model, optimizer, BATCHES[:2])
    assert report.codes[0] == "summed" and "x4" in report.diagnosis


def test_bad_accumulation_inputs_are_refused_before_any_change():
    model = zero_linear()
    plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="accumulated_sgd_step: optimizer must wrap optax.MultiSteps"):
        accumulated_sgd_step(model, plain, XL, YL, 2)
    two = make_accumulation_optimizer(model, optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match="every_k_schedule=2 micro-steps but num_micro_batches=4"):
        accumulated_sgd_step(model, two, XL, YL, 4)
    with pytest.raises(ValueError, match="batch size 4 is not divisible by num_micro_batches=3"):
        accumulated_sgd_step(model, make_accumulation_optimizer(model, optax.sgd(0.1), 3), XL, YL, 3)
    two.update(model, nnx.grad(mse_loss)(model, XL[:2], YL[:2]))  # now mid-cycle
    with pytest.raises(ValueError, match="in the middle of an accumulation cycle"):
        accumulated_sgd_step(model, two, XL, YL, 2)
    with pytest.raises(TypeError, match="num_micro_batches must be a positive int"):
        make_accumulation_optimizer(model, optax.sgd(0.1), 2.0)
    np.testing.assert_array_equal(model.bias[...], [0.0])
