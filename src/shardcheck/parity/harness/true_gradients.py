"""The task's true gradient beside a recorded run whose step returns none.

A live check reads which parameters' gradients are at rounding level (a true gradient of 0, such as an attention
key bias's: ``StepRecord.unresolved``) from the reference's gradients, whatever the candidate returns. A
recorded run has no reference: where its step returns no gradients, :func:`true_gradient_digest` takes the
task's own gradient of the loss at the run's state before the step, on the step's batch (the reference step's
``value_and_grad``, divided by the loss's weight), and keeps only its ``max|g|`` and L2 norm per parameter, what
the digest comparison reads of a gradient to decide it (:mod:`shardcheck.parity.comparison.digest`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state
from shardcheck.steps._core import params_value_and_grad
from shardcheck.task import divide

META_KEY = "true_gradients"
"""The metadata field of a :class:`~shardcheck.parity.harness.recorded.Recording` that holds the true gradients'
digests: ``{"max": {path: [per step]}, "norm": {path: [per step]}}`` (``None`` at a step whose step returned
gradients)."""


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stats(loss_fn, graphdef, params, rest, batch):
    _, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
    if weight is not None:
        grads = divide(grads, weight)
    flat = flatten_state(grads)
    as32 = {p: g.astype(jnp.float32) for p, g in flat.items()}
    return {p: (jnp.max(jnp.abs(g), initial=0.0), jnp.sqrt(jnp.sum(g * g))) for p, g in as32.items()}


def true_gradient_digest(loss_fn, model: nnx.Module, batch) -> dict[str, tuple[float, float]]:
    """``{parameter path: (max|g|, ||g||_2)}`` of the task's gradient of ``loss_fn`` at ``model``'s state on
    ``batch`` (the mean loss's: a ``(loss_sum, weight)`` loss divided by its weight), in float32, computed
    where the parameters lie (one jitted program; nothing but two scalars per leaf comes back). ``model`` is
    not changed (what the forward pass writes to its state is dropped)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = _stats(loss_fn, graphdef, params, rest, batch)
    return {p: (float(m), float(n)) for p, (m, n) in jax.device_get(out).items()}


def keep(meta: dict, t: int, steps: int, digest: dict[str, tuple[float, float]]) -> None:
    """Store step ``t``'s :func:`true_gradient_digest` in ``meta[META_KEY]`` (of ``steps`` steps; a value that is
    not finite as ``None``, which tells nothing: the metadata is strict JSON)."""
    held = meta.setdefault(META_KEY, {"max": {}, "norm": {}})
    for path, (top, norm) in digest.items():
        for field, value in (("max", top), ("norm", norm)):
            held[field].setdefault(path, [None] * steps)[t] = value if math.isfinite(value) else None


def read(meta, t: int, path: str) -> tuple[float, float] | None:
    """``(max|g|, ||g||_2)`` of parameter ``path``'s true gradient at step ``t`` from a recording's metadata,
    ``None`` where it holds none (an older recording, a step that returned gradients)."""
    held = meta.get(META_KEY) if isinstance(meta, dict) else None
    if not held:
        return None
    top, norm = (held.get(f, {}).get(path) for f in ("max", "norm"))
    if top is None or norm is None or t >= len(top) or top[t] is None or norm[t] is None:
        return None
    return float(top[t]), float(norm[t])
