"""The worked examples of both seed files, exactly as written, and the entrypoints' contracts."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardcheck
from shardcheck.seeds import reference as baseline
from shardcheck.seeds import simulation


def test_seed_001_worked_example_verbatim():
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.array([[1.0]])
    model.bias[...] = jnp.array([0.0])
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.array([[1.0], [2.0]])
    y = jnp.zeros((2, 1))

    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss = shardcheck.sgd_step(model, optimizer, x, y)
    np.testing.assert_allclose(loss, 2.5)
    np.testing.assert_allclose(model.kernel[...], [[0.5]])
    np.testing.assert_allclose(model.bias[...], [-0.3])
    np.testing.assert_allclose(loss_fn(model), 0.265, rtol=1e-5)
    assert int(optimizer.step[...]) == 1


def test_seed_001_entrypoint_returns_pre_update_loss():
    params = {"kernel": jnp.array([[1.0]]), "bias": jnp.array([0.0])}
    loss = shardcheck.fsdp_step(
        jnp.array([[1.0], [2.0]]), jnp.zeros((2, 1)), num_shards=2, lr=0.1, params=params
    )
    assert loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, 2.5)


def test_seed_000_reduction_example_verbatim():
    gradients = [
        {"kernel": jnp.array([[2.0, 4.0]]), "bias": jnp.array([1.0, 3.0])},
        {"kernel": jnp.array([[6.0, 8.0]]), "bias": jnp.array([5.0, 7.0])},
    ]
    summed = shardcheck.tree_sum(gradients)
    average = shardcheck.tree_mean(gradients)
    np.testing.assert_allclose(summed["kernel"], [[8.0, 12.0]])
    np.testing.assert_allclose(average["kernel"], [[4.0, 6.0]])
    np.testing.assert_allclose(average["bias"], [3.0, 5.0])
    # The seed's own expression gives the same tree.
    ref = jax.tree_util.tree_map(
        lambda array: array / 2, jax.tree_util.tree_map(lambda *p: sum(p), *gradients)
    )
    jax.tree.map(np.testing.assert_array_equal, average, ref)


@pytest.mark.parametrize("num_shards", [1, 2, 7, 1000])
def test_fsdp_step_num_shards_is_informational(num_shards):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)
    np.testing.assert_array_equal(shardcheck.fsdp_step(x, y, num_shards), shardcheck.fsdp_step(x, y, 1))


@pytest.mark.parametrize("entry", [shardcheck.fsdp_step, shardcheck.simulated_data_parallel_step])
def test_returned_loss_does_not_depend_on_lr(entry):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)
    losses = [float(entry(x, y, 4, lr)) for lr in (1e-4, 0.1, 3.0)]
    assert losses[0] == losses[1] == losses[2]


@pytest.mark.parametrize("entry", [shardcheck.fsdp_step, shardcheck.simulated_data_parallel_step])
def test_entrypoint_uses_fresh_linear_from_seed(entry):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(5))
    want = float(jnp.mean((model(x) - y) ** 2))
    np.testing.assert_allclose(entry(x, y, 2, seed=5), want, rtol=1e-6)
    # A fresh model every call: calling again gives the same value.
    np.testing.assert_allclose(entry(x, y, 2, seed=5), want, rtol=1e-6)
    assert float(entry(x, y, 2, seed=6)) != pytest.approx(want)


def test_entrypoints_accept_integer_data_as_float32():
    x = np.array([[1], [2]], dtype=np.int32)
    y = np.array([[0], [0]], dtype=np.int64)
    params = {"kernel": [[1.0]], "bias": [0.0]}
    np.testing.assert_allclose(shardcheck.fsdp_step(x, y, 1, params=params), 2.5)
    np.testing.assert_allclose(shardcheck.simulated_data_parallel_step(x, y, 2, params=params), 2.5)


def test_repeat_calls_do_not_retrace():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(64, 16)).astype(np.float32), rng.normal(size=(64, 4)).astype(np.float32)
    p = {"kernel": np.zeros((16, 4), np.float32), "bias": np.zeros(4, np.float32)}
    for entry, jitted in (
        (shardcheck.fsdp_step, baseline._fsdp_step_jit),
        (shardcheck.simulated_data_parallel_step, simulation._simulated_step_jit),
    ):
        entry(x, y, 4, 0.1, seed=0, params=p)
        size = jitted._cache_size()
        for i in range(5):
            entry(x, y, 4, 0.1 + i, seed=i, params=jax.tree.map(lambda a, i=i: a + i, p))
        assert jitted._cache_size() == size


def test_in_place_steps_do_not_retrace():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    shardcheck.sgd_step(model, optimizer, x, y)
    shardcheck.reduced_sgd_step(model, optimizer, x, y, 4)
    sizes = baseline._sgd_step_jit._cache_size(), simulation._reduced_step_jit._cache_size()
    for _ in range(3):
        shardcheck.sgd_step(model, optimizer, x + 1, y)
        shardcheck.reduced_sgd_step(model, optimizer, x, y - 1, 4)
    assert (baseline._sgd_step_jit._cache_size(), simulation._reduced_step_jit._cache_size()) == sizes
    assert int(optimizer.step[...]) == 8


def _count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _count_eqns(sub)
    return n


@pytest.mark.parametrize("keep", [True, False])
def test_simulation_trace_does_not_unroll_over_shards(keep):
    """One vmap/scan body whatever S: the traced program has the same size for S=2 and S=128."""

    def program(num_shards):
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))

        def f(state, xs, ys):
            m, o = nnx.merge(graphdef, state)
            return simulation.apply_reduced_update(m, o, xs, ys, None, keep).loss

        xs = jnp.zeros((num_shards, 2, 4))
        ys = jnp.zeros((num_shards, 2, 2))
        return jax.make_jaxpr(f)(state, xs, ys).jaxpr

    assert _count_eqns(program(2)) == _count_eqns(program(128))
