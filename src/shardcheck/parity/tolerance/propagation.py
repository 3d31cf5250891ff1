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

# Where in ``[g - delta, g + delta]`` the optimizer is evaluated, in units of delta. Adam's update is not monotone
# in g once it carries momentum (``(a + g) / sqrt(v + g^2)`` peaks at ``g = v / a``), so the endpoints alone can
# miss its largest change; a grid of eighth steps finds it to within a few percent.
GRID = tuple(k / 8 for k in range(-8, 9) if k)
# Where the range holds a gradient of 0 (an element whose true gradient is 0: a fused qkv bias's key third), Adam's
# update peaks at gradients far below delta / 8, on the scale of the element's own second moment: the grid misses
# it (a bfloat16-compute step's noise took two correct runs 1.6 learning rates apart where the grid allowed 1.24).
# Gradients of +-delta * 2**-j toward 0, and 0 itself, clipped into the range, find it.
NEAR_ZERO = (0.0, *(s * 2.0**-j for j in range(2, 22, 2) for s in (1.0, -1.0)))


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def as_param_dtypes(grads, params):
    """``grads`` with each floating leaf in its parameter's dtype, as ``jax.grad`` of the parameters returns it
    (a gradient computed in float32 for bfloat16 parameters, by the tolerance's float32 copy or a hypothesis):
    ``optax.apply_if_finite`` keeps its state in the parameters' dtype and raised "cond branches must have equal
    output types" on a float32 gradient of bfloat16 parameters (trial 29). ``grads`` and ``params``: trees alike."""

    def cast(g, p):
        return g.astype(p.dtype) if _inexact(g) and _inexact(p) and g.dtype != p.dtype else g

    return jax.tree.map(cast, grads, params)


@functools.partial(jax.jit, static_argnums=0)
def update_sensitivity(tx, grads, opt_state, params, delta):
    """Per element, how far the update and the optimizer state move when the gradient moves within ``+- delta``.

    The optimizer runs at ``g``, at ``g + k delta`` for every k in :data:`GRID` and, where ``[g - delta, g +
    delta]`` holds them, at the gradients of :data:`NEAR_ZERO` times ``delta``; the spread is the largest
    ``|f(x) - f(g)|`` over those points ``x``. Returns ``(update sensitivity, state sensitivity, max |g| per leaf)``; integer
    state (counters) gets 0.

    The points are one ``fori_loop`` keeping the running maxima: the optimizer is traced and compiled once for
    them all (beside its update at ``g``), and each point streams over the state once (a ``vmap`` over the points
    would materialize every point's update and state; unrolling them would compile one copy of the optimizer per
    point; a loop for the grid and one for the near-zero points compiled two copies, 1.4-1.6x the compile time
    on the tiny-lm under Adam, clipped AdamW and SGD with momentum, for the same values bit for bit).
    """

    def widen(base, moved, acc):
        def one(a, b, m):
            return jnp.maximum(m, jnp.abs(b - a)) if _inexact(a) else m

        return jax.tree.map(one, base, moved, acc)

    grads = as_param_dtypes(grads, params)
    base = tx.update(grads, opt_state, params)
    points = jnp.asarray(GRID + NEAR_ZERO, jnp.float32)

    def shifted(i, g, d):  # g + k delta at a grid point; a near-zero point clipped into [g - delta, g + delta]
        x, d_g = (points[i] * d).astype(g.dtype), d.astype(g.dtype)
        return jnp.where(i < len(GRID), g + x, jnp.clip(x, g - d_g, g + d_g))

    def at(i, acc):  # one point: the optimizer traced once for every point
        moved = tx.update(jax.tree.map(functools.partial(shifted, i), grads, delta), opt_state, params)
        return widen(base, moved, acc)

    zeros = jax.tree.map(jnp.zeros_like, base)
    updates, states = jax.lax.fori_loop(0, len(GRID) + len(NEAR_ZERO), at, zeros)
    return updates, states, jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads)


@jax.jit
def gradient_tolerance(grads, extra, rtol, atol):
    """The gradient's tolerance and what the sensitivity pass reads of it, in one compiled program: ``(delta,
    max |g| per leaf, allowance)``, trees like ``grads``.

    ``delta = grad_delta(grads, extra, rtol, atol, 1)``, the tolerance :func:`update_sensitivity` propagates (a
    float32 scalar per leaf, or per element where ``extra`` is per element); ``max |g|``: a 0-d array per leaf, in
    the gradient's dtype; ``allowance = delta - grad_delta(grads, None, rtol, atol, 0)``, the part of ``delta``
    that ``extra`` adds (``None`` when ``extra`` is ``None``). The sensitivity itself is a separate call, made only
    where a verdict reads it (``shardcheck.parity.tolerance.allowances``).
    """
    delta = grad_delta(grads, extra, rtol, atol, 1.0)
    grad_max = jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads)
    if extra is None:
        return delta, grad_max, None
    return delta, grad_max, jax.tree.map(jnp.subtract, delta, grad_delta(grads, None, rtol, atol, 0.0))


@functools.partial(jax.jit, static_argnums=0)
def scale_change(tx, grads, opt_state, params, factor):
    """``f(factor * g) - f(g)`` per element of the update and of the new optimizer state (0 for integer state):
    what a gradient off by ``factor`` (the shard count) changes, 0 where the optimizer is blind to the gradient's
    scale (global-norm clipping that binds, Adam's first step). Returns ``(update change, state change)``, trees
    like the update and the state; ``factor`` is traced (``S`` and ``1 / S`` share one compilation).
    """

    def change(a, b):
        return b - a if _inexact(a) else jnp.zeros_like(a)

    grads = as_param_dtypes(grads, params)
    base = tx.update(grads, opt_state, params)
    scaled = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
    return jax.tree.map(change, base, tx.update(scaled, opt_state, params))


@functools.partial(jax.jit, static_argnums=0)
def shadow_spread(tx, grads, opt_state, params, moved_grads, moved_state, moved_params):
    """``|f(moved) - f(reference)|`` per element of the update and of the new optimizer state: how far the
    optimizer's output moves when its inputs move from the reference's (gradient, state, parameters) to the
    candidate-side ones (the reference's computation from the candidate's pre-step state)."""

    def spread(a, b):
        return jnp.abs(b - a) if jnp.issubdtype(a.dtype, jnp.inexact) else a * 0

    base = tx.update(as_param_dtypes(grads, params), opt_state, params)
    moved = tx.update(as_param_dtypes(moved_grads, moved_params), moved_state, moved_params)
    return jax.tree.map(spread, base[0], moved[0]), jax.tree.map(spread, base[1], moved[1])


@jax.jit
def grad_delta(grads, extra, rtol, atol, scale):
    """The gradient's elementwise tolerance: ``atol + rtol max|g|`` (per leaf) plus ``scale * extra``.

    ``extra``: ``None`` or a tree like ``grads`` of per-element or per-leaf allowances (the measured compute
    noise of ``shardcheck.parity.tolerance.precision``; a bfloat16 all-reduce's bound).
    """
    base = jax.tree.map(lambda g: atol + rtol * jnp.max(jnp.abs(g.astype(jnp.float32))), grads)
    if extra is None:
        return base
    return jax.tree.map(lambda b, e: b + scale * e, base, extra)


# the probe's gradient and its scale-down (both far above Adam's eps 1e-8, so eps does not decide the answer)
PROBE_GRADIENT, PROBE_SCALE = 1e-2, 1e-3


def update_signature(tx, params) -> dict[str, float]:
    """What a recording keeps of its optimizer: per parameter (dotted paths, as ``flatten_state`` names them), the
    size of ``tx``'s update of the probe gradient (:func:`normalized_leaves`'s ``+-PROBE_GRADIENT``, less the
    update at 0) from ``tx.init(params)``, or from the state after the first of up to :data:`PROBE_ADVANCES`
    zero-gradient updates where one moves (a warm-up's learning rate of 0 at step 0), that count under
    ``"advances"``. Another learning rate, schedule or transformation gives other sizes (trial 52: a replay of a
    task whose lr had doubled FAILed with "the optimizer's update from equal inputs: matches").
    """
    from shardcheck.parity.comparison.live import flatten_state

    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for k in range(PROBE_ADVANCES + 1):
        full = {p: float(v) for p, v in flatten_state(_probe(tx, params, state)[0]).items()}
        if any(v > 0 for v in full.values()) or k == PROBE_ADVANCES:
            return {"advances": float(k), **full}
        state = _advance(tx, zeros, state, params)
    raise AssertionError("unreachable")


def normalized_leaves(tx, params) -> frozenset[str]:
    """The parameters (dotted paths, as ``flatten_state`` names them) whose update ``tx`` normalizes: scaling the
    gradient down by :data:`PROBE_SCALE` leaves the update's gradient-driven part at least a tenth as large (Adam,
    Lion, Adafactor: ``g / sqrt(v)`` or ``sign(g)``), where a linear optimizer (SGD, momentum, a clip by a global
    norm) scales it down too.

    One step from ``tx.init(params)`` at a gradient of ``+-PROBE_GRADIENT`` per element (alternating signs), at
    that gradient x ``PROBE_SCALE``, and at 0 (whose update, a weight decay ``-lr * wd * p``, is subtracted from
    both); where a leaf's update is 0 there (a learning rate of 0 at step 0: a warm-up), from the state after up
    to :data:`PROBE_ADVANCES` updates at a zero gradient. What it tells: a leaf whose gradient is rounding noise in
    some elements gets an lr-sized update of those elements under a normalizing optimizer and a noise-sized one
    under a linear optimizer (``shardcheck.parity.comparison.digest``). ``params``: a pytree of float arrays
    (``nnx.State`` included).
    """
    from shardcheck.parity.comparison.live import flatten_state

    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    found, seen = set(), set()
    for _ in range(PROBE_ADVANCES + 1):
        full, small = (flatten_state(t) for t in _probe(tx, params, state))
        for p, f in full.items():
            if p not in seen and float(f) > 0:
                seen.add(p)
                if float(small[p]) >= 0.1 * float(f):
                    found.add(p)
        if len(seen) == len(full):
            break
        state = _advance(tx, zeros, state, params)
    return frozenset(found)


PROBE_ADVANCES = 3


@functools.partial(jax.jit, static_argnums=0)
def _advance(tx, zeros, state, params):
    return tx.update(zeros, state, params)[1]


@functools.partial(jax.jit, static_argnums=0)
def _probe(tx, params, state):
    """``(max |u(g) - u(0)|, max |u(g * PROBE_SCALE) - u(0)|)`` per leaf, from ``state``."""

    def signs(p):
        pattern = jnp.where(jnp.arange(p.size) % 2 == 0, 1.0, -1.0).reshape(p.shape)
        return (PROBE_GRADIENT * pattern).astype(p.dtype) if _inexact(p) else p

    def size(u, z):
        return jnp.max(jnp.abs(u.astype(jnp.float32) - z.astype(jnp.float32)), initial=0.0)

    g = jax.tree.map(signs, params)
    zero = tx.update(jax.tree.map(jnp.zeros_like, g), state, params)[0]
    full = tx.update(g, state, params)[0]
    small = tx.update(jax.tree.map(lambda a: a * PROBE_SCALE, g), state, params)[0]
    return jax.tree.map(size, full, zero), jax.tree.map(size, small, zero)
