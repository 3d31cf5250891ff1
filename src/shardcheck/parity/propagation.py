"""How a gradient's tolerance carries through an optimizer into the parameters and the optimizer state.

A correct step's gradient is known only to within its tolerance ``delta``; ``tx.update`` turns that into an
uncertainty of the update and of the new optimizer state, which :func:`update_sensitivity` measures by running
the optimizer at ``g`` and ``g +- delta`` from the same state. For SGD it is ``lr * delta``; for Adam it is tiny
on ordinary leaves and about ``lr`` where the gradient is rounding noise (``docs/parity.md``). The parity harness
and the training loop's drift check both widen their tolerances by it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnums=0)
def update_sensitivity(tx, grads, opt_state, params, delta):
    """Per element, how far the update and the optimizer state move when the gradient moves by ``+- delta``.

    Returns ``(update sensitivity, state sensitivity, max |g| per leaf)``; integer state (counters) gets 0.
    """

    def spread(f0, f1, f2):
        return jax.tree.map(
            lambda a, b, c: (
                jnp.maximum(jnp.abs(b - a), jnp.abs(c - a)) if jnp.issubdtype(a.dtype, jnp.inexact) else a * 0
            ),
            f0,
            f1,
            f2,
        )

    base = tx.update(grads, opt_state, params)
    up = tx.update(jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads, delta), opt_state, params)
    down = tx.update(jax.tree.map(lambda g, d: g - d.astype(g.dtype), grads, delta), opt_state, params)
    updates = spread(base[0], up[0], down[0])
    states = spread(base[1], up[1], down[1])
    return updates, states, jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads)


@jax.jit
def grad_delta(grads, magnitude, rtol, atol, compute):
    """The gradient's elementwise tolerance: ``atol + rtol max|g|`` plus the compute rounding ``compute * A``.

    Under low-precision compute a leaf whose whole gradient is below the compute noise floor (``compute`` times
    the median over leaves of ``max A``: a true gradient of 0, whose terms cancel inside each shard) is noise;
    another realization of it may be twice as large and of either sign, so its tolerance is ``2 max|g|`` more.
    """
    base = jax.tree.map(lambda g: atol + rtol * jnp.max(jnp.abs(g.astype(jnp.float32))), grads)
    if magnitude is None:
        return base
    floor = compute * jnp.median(jnp.stack([jnp.max(a) for a in jax.tree.leaves(magnitude)]))

    def one(b, a, g):
        top = jnp.max(jnp.abs(g.astype(jnp.float32)))
        return b + compute * a + jnp.where(top <= floor, 2.0 * top, 0.0)

    return jax.tree.map(one, base, magnitude, grads)
