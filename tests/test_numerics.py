"""Baseline and simulation against a float64 NumPy oracle, against each other, and the shared cases."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from oracle import linear_mse, sgd_oracle

import shardcheck

# docs/reduction_cases.md Fixture L
XL = np.array([[1, 0], [0, 1], [1, 1], [2, 0]], np.float32)
YL = np.array([[1], [2], [3], [4]], np.float32)


def zero_linear(d=2, k=1, tx=None):
    model = nnx.Linear(d, k, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((d, k))
    model.bias[...] = jnp.zeros((k,))
    return model, nnx.Optimizer(model, tx or optax.sgd(0.1), wrt=nnx.Param)


def random_problem(b, d, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, d)).astype(np.float32)
    y = rng.normal(size=(b, k)).astype(np.float32)
    kernel = rng.normal(size=(d, k)).astype(np.float32)
    bias = rng.normal(size=(k,)).astype(np.float32)
    return x, y, kernel, bias


def linear_with(kernel, bias, lr):
    model = nnx.Linear(*kernel.shape, rngs=nnx.Rngs(0))
    model.kernel[...] = kernel
    model.bias[...] = bias
    return model, nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)


CASES = [(8, 3, 2, 2, 0.1), (12, 5, 1, 3, 0.05), (16, 4, 4, 8, 0.5), (6, 1, 3, 6, 1.0), (64, 16, 4, 4, 0.01)]


@pytest.mark.parametrize("b,d,k,s,lr", CASES)
def test_against_float64_oracle(b, d, k, s, lr):
    x, y, kernel, bias = random_problem(b, d, k, seed=b + d + k)
    loss, k1, b1 = sgd_oracle(x, y, kernel, bias, lr)
    params = {"kernel": kernel, "bias": bias}
    np.testing.assert_allclose(shardcheck.fsdp_step(x, y, s, lr, params=params), loss, rtol=1e-6)
    np.testing.assert_allclose(
        shardcheck.simulated_data_parallel_step(x, y, s, lr, params=params), loss, rtol=1e-6
    )
    for step in ("sgd", "reduced"):
        model, optimizer = linear_with(kernel, bias, lr)
        if step == "sgd":
            got = shardcheck.sgd_step(model, optimizer, x, y)
        else:
            got = shardcheck.reduced_sgd_step(model, optimizer, x, y, s).loss
        np.testing.assert_allclose(got, loss, rtol=1e-6)
        np.testing.assert_allclose(model.kernel[...], k1, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(model.bias[...], b1, rtol=1e-5, atol=1e-6)


def _compare_simulation_to_baseline(x, y, s, lr, seed=0):
    ref, ref_opt = shardcheck.make_model("linear", x.shape[1], y.shape[1], seed=seed), None
    ref_opt = nnx.Optimizer(ref, optax.sgd(lr), wrt=nnx.Param)
    sim = nnx.clone(ref)
    sim_opt = nnx.Optimizer(sim, optax.sgd(lr), wrt=nnx.Param)
    before = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(ref, nnx.Param)).items()}
    full_grads = nnx.grad(shardcheck.mse_loss)(ref, x, y)
    ref_loss = shardcheck.sgd_step(ref, ref_opt, x, y)
    result = shardcheck.reduced_sgd_step(sim, sim_opt, x, y, s)
    np.testing.assert_allclose(result.loss, ref_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.mean(result.shard_losses), ref_loss, rtol=1e-6, atol=1e-7)
    for leaf in ("kernel", "bias"):
        np.testing.assert_allclose(result.grads[leaf][...], full_grads[leaf][...], rtol=1e-5, atol=1e-6)
        ref_after = np.asarray(getattr(ref, leaf)[...], np.float64)
        sim_after = np.asarray(getattr(sim, leaf)[...], np.float64)
        np.testing.assert_allclose(sim_after, ref_after, rtol=1e-6, atol=1e-6)
        # The update itself, not just the parameters: ratio 1, never S or 1/S.
        ref_update, sim_update = ref_after - before[leaf], sim_after - before[leaf]
        big = np.abs(ref_update) > 1e-4
        if big.any():
            np.testing.assert_allclose(sim_update[big] / ref_update[big], 1.0, rtol=1e-3)
    assert int(sim_opt.step[...]) == int(ref_opt.step[...]) == 1


@pytest.mark.parametrize("s", [1, 2, 4, 8])
def test_simulation_equals_baseline(s):
    x, y, _, _ = random_problem(32, 5, 3, seed=s)
    _compare_simulation_to_baseline(x, y, s, lr=0.1)


@given(
    per_shard=st.integers(1, 6),
    s=st.sampled_from([1, 2, 3, 4, 8]),
    d=st.integers(1, 6),
    k=st.integers(1, 4),
    lr=st.floats(1e-3, 1.0),
    seed=st.integers(0, 2**16),
)
def test_simulation_equals_baseline_property(per_shard, s, d, k, lr, seed):
    x, y, _, _ = random_problem(per_shard * s, d, k, seed)
    _compare_simulation_to_baseline(x, y, s, lr, seed=seed % 7)


@given(b=st.integers(1, 10), d=st.integers(1, 5), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fsdp_step_matches_oracle_property(b, d, k, seed):
    x, y, kernel, bias = random_problem(b, d, k, seed)
    loss, _, _ = linear_mse(x, y, kernel, bias)
    got = shardcheck.fsdp_step(x, y, 3, params={"kernel": kernel, "bias": bias})
    np.testing.assert_allclose(got, loss, rtol=2e-6, atol=1e-7)


def test_update_is_minus_lr_times_mean_gradient_and_leaves_are_not_mixed():
    """C8 and seed 000: the step changes parameters by exactly -lr * grad, per leaf, with a step counter of 1."""
    for s in (1, 2, 4):
        model, optimizer = zero_linear()
        result = shardcheck.reduced_sgd_step(model, optimizer, XL, YL, s)
        np.testing.assert_allclose(result.grads["kernel"][...], [[-6.0], [-2.5]], rtol=1e-6)
        np.testing.assert_allclose(result.grads["bias"][...], [-5.0], rtol=1e-6)
        np.testing.assert_allclose(model.kernel[...], -0.1 * np.array([[-6.0], [-2.5]]), rtol=1e-6)
        np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)
        assert int(optimizer.step[...]) == 1


class TestFixtureL:
    def test_full_batch(self):
        model, optimizer = zero_linear()
        grads = nnx.grad(shardcheck.mse_loss)(model, XL, YL)
        np.testing.assert_allclose(model(XL)[:, 0] - YL[:, 0], [-1, -2, -3, -4])
        np.testing.assert_allclose(grads["kernel"][...], [[-6.0], [-2.5]])
        np.testing.assert_allclose(grads["bias"][...], [-5.0])
        np.testing.assert_allclose(shardcheck.sgd_step(model, optimizer, XL, YL), 7.5)
        np.testing.assert_allclose(model.kernel[...], [[0.6], [0.25]], rtol=1e-6)
        np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)

    def test_two_shards(self):
        model, optimizer = zero_linear()
        r = shardcheck.reduced_sgd_step(model, optimizer, XL, YL, 2)
        np.testing.assert_allclose(r.shard_losses, [2.5, 12.5])
        np.testing.assert_allclose(r.shard_grads["kernel"][...][:, :, 0], [[-1, -2], [-11, -3]])
        np.testing.assert_allclose(r.shard_grads["bias"][...][:, 0], [-3, -7])
        np.testing.assert_allclose(r.loss, 7.5)

    def test_four_shards(self):
        model, optimizer = zero_linear()
        r = shardcheck.reduced_sgd_step(model, optimizer, XL, YL, 4)
        np.testing.assert_allclose(r.shard_losses, [1, 4, 9, 16])
        np.testing.assert_allclose(r.shard_grads["bias"][...][:, 0], [-2, -4, -6, -8])
        np.testing.assert_allclose(r.loss, 7.5)

    @pytest.mark.parametrize("s", [1, 2, 4])
    @pytest.mark.parametrize("keep", [True, False])
    def test_mean_of_shards_is_full_batch(self, s, keep):
        model, optimizer = zero_linear()
        r = shardcheck.reduced_sgd_step(model, optimizer, XL, YL, s, keep_shard_grads=keep)
        np.testing.assert_allclose(r.loss, 7.5, rtol=1e-6)
        np.testing.assert_allclose(r.grads["kernel"][...], [[-6.0], [-2.5]], rtol=1e-6)
        np.testing.assert_allclose(r.grads["bias"][...], [-5.0], rtol=1e-6)
        assert (r.shard_grads is None) == (not keep)


@pytest.mark.parametrize("s", [2, 4])
def test_c1_sum_reduction_would_be_s_times_the_baseline(s):
    """C1: the sum gives kernel [[1.2],[0.5]] at S=2 and [[2.4],[1.0]] at S=4; the mean gives the baseline."""
    model, optimizer = zero_linear()
    r = shardcheck.reduced_sgd_step(model, optimizer, XL, YL, s)
    summed = shardcheck.tree_sum(
        [{k: v[i] for k, v in nnx.to_pure_dict(r.shard_grads).items()} for i in range(s)]
    )
    np.testing.assert_allclose(-0.1 * summed["kernel"], 0.6 * s * np.array([[1.0], [0.25 / 0.6]]), rtol=1e-6)
    np.testing.assert_allclose(-0.1 * summed["bias"], [0.5 * s], rtol=1e-6)
    ratio_kernel = np.asarray(model.kernel[...]) / np.array([[0.6], [0.25]])
    np.testing.assert_allclose(ratio_kernel, 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]) / 0.5, 1.0, rtol=1e-6)


def fixture_z(b):
    return np.ones((b, 2), np.float32), np.arange(1, b + 1, dtype=np.float32)[:, None]


def test_c4_uneven_shards_weighted_mode():
    x, y = fixture_z(8)
    model, optimizer = zero_linear()
    r = shardcheck.reduced_sgd_step(model, optimizer, x, y, 2, weights=np.ones(8), shard_sizes=(3, 5))
    np.testing.assert_allclose(r.shard_losses, [14 / 3, 38], rtol=1e-6)
    np.testing.assert_allclose(r.loss, 25.5, rtol=1e-6)
    np.testing.assert_allclose(r.grads["bias"][...], [-9.0], rtol=1e-6)
    np.testing.assert_allclose(r.equal_weight_loss, 21.333333, rtol=1e-6)  # the wrong, naive value
    np.testing.assert_allclose(r.equal_weight_grads["bias"][...], [-8.0], rtol=1e-6)
    np.testing.assert_allclose(r.shard_grads["bias"][...][:, 0], [-4.0, -12.0], rtol=1e-6)
    model, optimizer = zero_linear()
    r = shardcheck.reduced_sgd_step(model, optimizer, x, y, 3, weights=np.ones(8), shard_sizes=(3, 3, 2))
    np.testing.assert_allclose(r.loss, 25.5, rtol=1e-6)
    np.testing.assert_allclose(r.grads["bias"][...], [-9.0], rtol=1e-6)
    np.testing.assert_allclose(r.equal_weight_loss, 28.944444, rtol=1e-6)
    np.testing.assert_allclose(r.equal_weight_grads["bias"][...], [-9.666667], rtol=1e-6)


@pytest.mark.parametrize("sizes", [(3, 5), (3, 3, 2)])
def test_c4_uneven_shards_refused_without_weights(sizes):
    x, y = fixture_z(8)
    model, optimizer = zero_linear()
    with pytest.raises(ValueError, match="equal weight"):
        shardcheck.reduced_sgd_step(model, optimizer, x, y, len(sizes), shard_sizes=sizes)
    with pytest.raises(ValueError, match="equal shards are required"):
        shardcheck.reduced_sgd_step(model, optimizer, x, y, 3)


def test_c5_masked_examples_psum_sums_and_counts():
    x, y = fixture_z(8)
    model, optimizer = zero_linear()
    mask = np.array([1, 0, 0, 0, 1, 1, 1, 0])
    r = shardcheck.reduced_sgd_step(model, optimizer, x, y, 2, weights=mask)
    np.testing.assert_allclose(r.shard_losses, [1.0, 110 / 3], rtol=1e-6)
    np.testing.assert_allclose(r.loss, 27.75, rtol=1e-6)
    np.testing.assert_allclose(r.grads["bias"][...], [-9.5], rtol=1e-6)
    np.testing.assert_allclose(r.equal_weight_loss, 18.833333, rtol=1e-6)
    np.testing.assert_allclose(r.equal_weight_grads["bias"][...], [-7.0], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [0.95], rtol=1e-6)


def test_c6_no_silent_padding():
    x, y = fixture_z(10)
    model, optimizer = zero_linear()
    with pytest.raises(ValueError, match="batch size 10 is not divisible by num_shards=4"):
        shardcheck.reduced_sgd_step(model, optimizer, x, y, 4)
    with pytest.raises(ValueError, match="not divisible"):
        shardcheck.simulated_data_parallel_step(x, y, 4)
    r = shardcheck.reduced_sgd_step(model, optimizer, x, y, 4, weights=np.ones(10))
    np.testing.assert_allclose(r.loss, 38.5, rtol=1e-6)
    np.testing.assert_allclose(r.grads["bias"][...], [-11.0], rtol=1e-6)
    # What padding by repeating the first two examples would have given (the wrong answer of C6).
    xp, yp = np.concatenate([x, x[:2]]), np.concatenate([y, y[:2]])
    model, optimizer = zero_linear()
    wrong = shardcheck.reduced_sgd_step(model, optimizer, xp, yp, 4)
    np.testing.assert_allclose(wrong.loss, 32.5, rtol=1e-6)
    np.testing.assert_allclose(wrong.grads["bias"][...], [-9.666667], rtol=1e-6)


def test_c8_current_optimizer_api():
    model, optimizer = zero_linear()
    before = np.asarray(model.kernel[...]).copy()
    grads = nnx.grad(shardcheck.mse_loss)(model, XL, YL)
    shardcheck.sgd_step(model, optimizer, XL, YL)
    np.testing.assert_allclose(np.asarray(model.kernel[...]) - before, -0.1 * grads["kernel"][...], rtol=1e-6)
    assert int(optimizer.step[...]) == 1


@pytest.mark.parametrize("tx", [optax.sgd(0.1, momentum=0.9), optax.adam(0.1)])
def test_simulation_with_stateful_optimizers_matches_baseline(tx):
    x, y, _, _ = random_problem(16, 3, 2, seed=9)
    ref = shardcheck.make_model("mlp", 3, 2, hidden=8, seed=1)
    sim = nnx.clone(ref)
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    sim_opt = nnx.Optimizer(sim, tx, wrt=nnx.Param)
    for _ in range(3):
        shardcheck.sgd_step(ref, ref_opt, x, y)
        shardcheck.reduced_sgd_step(sim, sim_opt, x, y, 4)
    ref_state = nnx.to_pure_dict(nnx.state((ref, ref_opt)))
    sim_state = nnx.to_pure_dict(nnx.state((sim, sim_opt)))
    import jax

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), ref_state, sim_state)
    assert int(sim_opt.step[...]) == 3
