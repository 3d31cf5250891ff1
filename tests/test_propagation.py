"""How a gradient's tolerance and scale carry through an optimizer (``shardcheck.parity.tolerance.propagation``), against
the closed forms of SGD and of global-norm clipping, in float64 NumPy."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardcheck.parity.tolerance.propagation import GRID, normalized_leaves, scale_change, update_sensitivity

G = {"w": jnp.asarray([[0.5, -2.0], [1.0, 0.25]], jnp.float32), "b": jnp.asarray([3.0, -1.0], jnp.float32)}
P = {k: jnp.ones_like(v) for k, v in G.items()}
LR = 0.5


def test_sgd_moves_by_lr_times_the_tolerance_and_the_scale():
    """SGD's update is ``-lr g``: within ``+- delta`` it moves by ``lr delta``; at ``c g`` by ``-lr (c - 1) g``."""
    tx = optax.sgd(LR)
    delta = {k: jnp.full_like(v, 0.125) for k, v in G.items()}
    updates, _, grad_max = update_sensitivity(tx, G, tx.init(P), P, delta)
    for k, g in G.items():
        np.testing.assert_array_equal(np.asarray(updates[k]), LR * 0.125)
        assert float(grad_max[k]) == np.max(np.abs(np.asarray(g, np.float64)))
    for c in (4.0, 0.25):
        update, _ = scale_change(tx, G, tx.init(P), P, c)
        for k, g in G.items():
            want = -LR * (c - 1) * np.asarray(g, np.float64)
            np.testing.assert_allclose(np.asarray(update[k], np.float64), want, rtol=2**-23)


@pytest.mark.parametrize(("max_norm", "hidden"), [(0.5, True), (1e3, False)])
def test_a_binding_clip_is_blind_to_the_gradients_scale(max_norm, hidden):
    """``clip_by_global_norm`` rescales ``g`` and ``c g`` to the same norm when it binds on both (|g| = 3.9 here, |g| / 4 = 0.98):
    the update and Adam's state do not change (but for float32 rounding); a loose clip passes the scale on."""
    tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(LR, momentum=0.9))
    state = tx.init(P)
    for c in (4.0, 0.25):
        update, new_state = scale_change(tx, G, state, P, c)
        change = max(float(np.max(np.abs(np.asarray(u)))) for u in update.values())
        trace = new_state[1][0].trace
        state_change = max(float(np.max(np.abs(np.asarray(u)))) for u in trace.values())
        if hidden:
            assert change <= 4 * 2**-24 * LR and state_change <= 4 * 2**-24
        else:
            assert change == pytest.approx(LR * abs(c - 1) * 3.0, rel=1e-6)  # the largest |g| is 3
            assert state_change == pytest.approx(abs(c - 1) * 3.0, rel=1e-6)


@pytest.mark.parametrize(
    ("name", "tx", "expected"),
    [
        ("sgd", optax.sgd(0.1), set()),
        ("momentum", optax.sgd(0.1, momentum=0.9), set()),
        ("decay then sgd", optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1)), set()),
        ("a binding global clip", optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1)), set()),
        ("adam", optax.adam(1e-3), {"a.kernel", "b"}),
        ("adamw", optax.adamw(1e-3, weight_decay=0.1), {"a.kernel", "b"}),
        ("lion", optax.lion(1e-4), {"a.kernel", "b"}),
        ("adam warmed up from 0", optax.adam(optax.linear_schedule(0.0, 1e-3, 10)), {"a.kernel", "b"}),
        (
            "adam on one leaf, sgd on the other",
            optax.multi_transform(
                {"x": optax.adam(1e-3), "y": optax.sgd(0.1)}, {"a": {"kernel": "x"}, "b": "y"}
            ),
            {"a.kernel"},
        ),
    ],
)
def test_normalized_leaves_are_those_whose_update_a_smaller_gradient_leaves_as_large(name, tx, expected):
    params = {"a": {"kernel": jnp.ones((3, 4))}, "b": jnp.ones(5)}
    assert set(normalized_leaves(tx, params)) == expected, name


def test_adams_peak_near_a_zero_gradient_is_inside_the_sensitivity():
    """A fused qkv bias's key third under bfloat16 compute (trial 7): a true gradient of 0 whose rounding noise is
    far below delta / 8. Adam's update peaks at gradients on the scale of the element's own second moment (here
    about lr at +3e-7, where it saturates at 0.74 lr beyond), which the grid of eighths missed (it allowed 1.24
    learning rates where two correct runs were 1.6 apart). The points toward 0 find the peak: the sensitivity
    holds the largest |f(x) - f(g)| of a dense scan of [g - delta, g + delta], and the grid alone does not."""
    import jax
    import optax

    tx = optax.adam(1.0)
    params = {"b": jnp.zeros(1, jnp.float32)}
    _, state = tx.update(
        {"b": jnp.asarray([3e-7], jnp.float32)}, tx.init(params), params
    )  # one step of noise
    g, delta = jnp.asarray([-3e-7], jnp.float32), jnp.asarray([1e-3], jnp.float32)
    updates, _, _ = update_sensitivity(tx, {"b": g}, state, params, {"b": delta})

    @jax.vmap
    def f(x):
        return tx.update({"b": x[None]}, state, params)[0]["b"][0]

    base = float(f(g)[0])
    xs = jnp.concatenate([jnp.linspace(-1e-3, 1e-3, 4001), jnp.geomspace(1e-9, 1e-3, 4000)])
    xs = jnp.concatenate([xs, -xs]).astype(jnp.float32)
    scan = float(jnp.max(jnp.abs(f(xs) - base)))
    assert scan > 1.0  # the peak near +3e-7 (about 1 lr) against the update at g (about -0.06 lr)
    assert float(updates["b"][0]) >= 0.97 * scan  # within a few percent, as the grid finds its points
    grid_only = float(jnp.max(jnp.abs(f(g + jnp.asarray(GRID, jnp.float32) * delta) - base)))
    assert grid_only < 0.85 * scan
