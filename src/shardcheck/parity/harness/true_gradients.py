"""The task's true gradient beside a recorded run whose step returns none.

A live check reads which parameters' gradients are at rounding level (a true gradient of 0, such as an attention
key bias's: ``StepRecord.unresolved``) from the reference's gradients, whatever the candidate returns. A
recorded run has no reference: where its step returns no gradients, :func:`true_gradient_digest` takes the
task's own gradient of the loss at the run's state before the step, on the step's batch (the reference step's
``value_and_grad``, divided by the loss's weight), and keeps only its ``max|g|`` and L2 norm per parameter, what
the digest comparison reads of a gradient to decide it (:mod:`shardcheck.parity.comparison.digest`).

A leaf may be at rounding level only in part: a fused attention projection's bias (``(3D,)``, q, k and v) has a
key third whose true gradient is 0 while the q and v thirds' are not, so its ``max|g|`` tells nothing. A live
check allows such elements one by one; a digest cannot, so a replay keeps, per parameter and step, the least over
the elements of each element's largest ``|g|`` so far, 0 left out (:class:`Peaks`: an element at rounding level
at every step up to t, as Adam's moments of a true gradient of 0 are, shows as a least within ``atol_t``; one
element small at one step by chance does not), read from the gradients the step returns, else from the task's.

At a compute dtype coarser than float32 a true gradient of 0 comes back as compute noise far above ``atol_t``: a
replay also keeps, per parameter and step, that noise as a live check measures it (:func:`rounding_noise`: a
correct split's gradient against the full batch's), against which the digest comparison reads such a gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.mesh import auto_typed
from shardcheck.parity.comparison.leaf_digest import sample_indices
from shardcheck.parity.comparison.live import flatten_state
from shardcheck.steps._core import params_value_and_grad
from shardcheck.task import divide

META_KEY = "true_gradients"
"""The metadata field of a :class:`~shardcheck.parity.harness.recorded.Recording` that holds the true gradients'
digests: ``{"max": {path: [per step]}, "norm": {path: [per step]}}`` (``None`` at a step whose step returned
gradients) and ``"least": {path: [per step]}`` (:class:`Peaks`; absent from a recording made before it was kept)."""


@functools.partial(jax.jit, static_argnums=(0, 1))
def _stats(loss_fn, graphdef, params, rest, batch):
    _, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
    if weight is not None:
        grads = divide(grads, weight)
    flat = flatten_state(grads)
    as32 = {p: g.astype(jnp.float32) for p, g in flat.items()}
    stats = {p: (jnp.max(jnp.abs(g), initial=0.0), jnp.sqrt(jnp.sum(g * g))) for p, g in as32.items()}
    return stats, as32


def true_gradient_digest(
    loss_fn, model: nnx.Module, batch, peaks: Peaks | None = None
) -> dict[str, tuple[float, float]]:
    """``{parameter path: (max|g|, ||g||_2)}`` of the task's gradient of ``loss_fn`` at ``model``'s state on
    ``batch`` (the mean loss's: a ``(loss_sum, weight)`` loss divided by its weight), in float32, computed
    where the parameters lie (one jitted program; nothing but two scalars per leaf comes back). ``model`` is
    not changed (what the forward pass writes to its state is dropped). ``peaks``: also raised by this
    gradient (:meth:`Peaks.raise_by`, on the devices). A state in JAX's explicit sharding mode is read as
    ``Auto`` arrays (:func:`~shardcheck.mesh.auto_typed`: the same buffers; the task's loss is the reference's,
    written for no mesh, as a GSPMD candidate's state is read)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest, batch = auto_typed((params, rest, batch))
    out, grads = _stats(loss_fn, graphdef, params, rest, batch)
    if peaks is not None:
        peaks.raise_by(grads)
    return {p: (float(m), float(n)) for p, (m, n) in jax.device_get(out).items()}


def rounding_noise(loss_fn, model: nnx.Module, batch, compute_dtype) -> dict[str, tuple[float, float]]:
    """``{parameter path: (max|g_32|, N)}`` at ``model``'s state on ``batch`` under a low-precision
    ``compute_dtype`` (coarser than float32): ``g_32`` the task's gradient with every layer computing in float32
    (:func:`~shardcheck.parity.tolerance.precision.float32_compute`: the true gradient without the compute
    dtype's rounding; an attention key bias's is 0 to float32 rounding), and ``N`` the largest element of the
    compute noise of the task's gradient ``g`` as a live check measures it (:func:`~shardcheck.parity.tolerance.
    precision.measured_noise` + ``output_rounding``, :func:`~shardcheck.parity.tolerance.allowances.
    step_bounds`): ``COMPUTE_SAFETY`` times the largest difference of ``g_32`` and of ``g`` rounded to
    ``compute_dtype`` from ``g``, plus ``eps_c (|g| + A)``; no split of the batch (a loss that couples the rows
    computes another function per shard). ``{}`` where no layer computes below float32 (the rounding is then a
    cast in the model's own code, which no float32 graph removes). ``model`` is not changed; host floats."""
    from shardcheck.parity.tolerance.allowances import _grads_at, _shard_magnitude
    from shardcheck.parity.tolerance.precision import float32_compute, measured_noise, output_rounding

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest, batch = auto_typed((params, rest, batch))  # an explicit-mode state: as true_gradient_digest
    graphdef32 = float32_compute(graphdef, params, rest)
    if graphdef32 is None:
        return {}
    _, grads = _stats(loss_fn, graphdef, params, rest, batch)
    magnitude, _, low = (
        flatten_state(x) for x in _shard_magnitude(loss_fn, 1, graphdef, params, rest, batch, compute_dtype)
    )
    true = flatten_state(_grads_at(loss_fn, graphdef32, params, rest, batch))
    eps = float(jnp.finfo(compute_dtype).eps)
    noise = jax.tree.map(
        jnp.add, measured_noise([true, low], grads, grads), output_rounding(grads, magnitude, eps)
    )
    tops = {p: (jnp.max(jnp.abs(true[p]), initial=0.0), jnp.max(a, initial=0.0)) for p, a in noise.items()}
    return {p: (float(a), float(b)) for p, (a, b) in jax.device_get(tops).items()}


@jax.jit
def _raised(peaks, grads, where):
    up = {p: jnp.abs(g.astype(jnp.float32)) for p, g in grads.items() if jnp.issubdtype(g.dtype, jnp.inexact)}
    up = {p: jnp.maximum(peaks[p], a) if p in peaks else a for p, a in up.items()}
    least = {p: jnp.min(jnp.where(a > 0, a, jnp.inf), initial=jnp.inf) for p, a in up.items()}
    return up, least, {p: jnp.take(a.ravel(), where[p], mode="clip") for p, a in up.items()}


class Peaks:
    """Each parameter's elementwise largest ``|g|`` over the gradients seen so far (float32 device arrays, where
    the gradients lie) and, after each, its least positive element: ``least[path]`` is at most ``atol_t`` where
    some element has been at rounding level throughout, ``inf`` where none is positive; ``sampled[path]``: the
    peaks at the parameter's digest samples (:func:`~shardcheck.parity.comparison.leaf_digest.sample_indices` of
    ``"param <path>"``; ``None`` past its size), which tell the samples at rounding level from the others. An element whose gradient
    has been exactly 0 at every step (an embedding row no batch used) is left out: Adam's update of it is exactly
    0 in any run, nothing to allow."""

    def __init__(self):
        self._peaks: dict = {}
        self._where: dict[str, np.ndarray] = {}
        self.least: dict[str, float] = {}
        self.sampled: dict[str, list[float | None]] = {}

    def raise_by(self, grads) -> dict[str, float]:
        """Raise the peaks by ``grads`` (``{dotted path: array}``, :func:`flatten_state` of a gradient tree;
        non-float leaves skipped) and return ``{path: least positive element of its peaks}`` (floats, one scalar
        per leaf to the host). Gradients in JAX's explicit sharding mode are read as ``Auto`` arrays
        (:func:`~shardcheck.mesh.auto_typed`: a gather of a sharded array has no output sharding to infer)."""
        grads = auto_typed({p: g for p, g in grads.items() if jnp.issubdtype(g.dtype, jnp.inexact)})
        for p, g in grads.items():
            if p not in self._where:
                self._where[p] = sample_indices(f"param {p}", tuple(g.shape))
        where = {p: np.maximum(self._where[p], 0) for p in grads}
        self._peaks, least, sampled = _raised(self._peaks, grads, where)
        self.least = {p: float(v) for p, v in jax.device_get(least).items()}
        self.sampled = {
            p: [float(v) if i >= 0 else None for v, i in zip(np.asarray(values), self._where[p], strict=True)]
            for p, values in jax.device_get(sampled).items()
        }
        return self.least


def keep(meta: dict, t: int, steps: int, digest: dict[str, tuple[float, float]]) -> None:
    """Store step ``t``'s :func:`true_gradient_digest` in ``meta[META_KEY]`` (of ``steps`` steps; a value that is
    not finite as ``None``, which tells nothing: the metadata is strict JSON)."""
    held = meta.setdefault(META_KEY, {"max": {}, "norm": {}})
    held.setdefault("max", {})
    held.setdefault("norm", {})
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


def keep_least(meta: dict, t: int, steps: int, least: dict[str, float], sampled=None) -> None:
    """Store step ``t``'s :attr:`Peaks.least` in ``meta[META_KEY]["least"]`` and its :attr:`Peaks.sampled` in
    ``meta[META_KEY]["sampled"]`` (of ``steps`` steps; a value that is not finite as ``None``)."""
    held = meta.setdefault(META_KEY, {"max": {}, "norm": {}})
    for path, value in least.items():
        held.setdefault("least", {}).setdefault(path, [None] * steps)[t] = (
            value if math.isfinite(value) else None
        )
    for path, values in (sampled or {}).items():
        finite = [v if v is not None and math.isfinite(v) else None for v in values]
        held.setdefault("sampled", {}).setdefault(path, [None] * steps)[t] = finite


def read_least(meta, t: int, path: str) -> float | None:
    """Parameter ``path``'s :attr:`Peaks.least` at step ``t`` from a recording's metadata, ``None`` where it holds
    none (a recording made before it was kept, or without ``true_gradients``)."""
    held = meta.get(META_KEY) if isinstance(meta, dict) else None
    values = held.get("least", {}).get(path) if isinstance(held, dict) else None
    if not values or t >= len(values) or values[t] is None:
        return None
    return float(values[t])


def read_sampled(meta, t: int, path: str) -> list[float | None] | None:
    """Parameter ``path``'s :attr:`Peaks.sampled` at step ``t`` from a recording's metadata (one value or ``None``
    per digest sample), ``None`` where it holds none."""
    held = meta.get(META_KEY) if isinstance(meta, dict) else None
    values = held.get("sampled", {}).get(path) if isinstance(held, dict) else None
    if not values or t >= len(values) or values[t] is None:
        return None
    return list(values[t])


def keep_noise(meta: dict, t: int, steps: int, noise: dict[str, tuple[float, float]]) -> None:
    """Store step ``t``'s :func:`rounding_noise` in ``meta[META_KEY]["true32"]`` and ``["noise"]`` (of ``steps``
    steps; a value that is not finite as ``None``)."""
    held = meta.setdefault(META_KEY, {"max": {}, "norm": {}})
    for path, pair in noise.items():
        for field, value in zip(("true32", "noise"), pair, strict=True):
            held.setdefault(field, {}).setdefault(path, [None] * steps)[t] = (
                value if math.isfinite(value) else None
            )


def read_noise(meta, t: int, path: str) -> tuple[float, float] | None:
    """Parameter ``path``'s :func:`rounding_noise` ``(max|g_32|, N)`` at step ``t`` from a recording's metadata,
    ``None`` where it holds none (float32 compute, a recording made before it was kept, or without
    ``true_gradients``)."""
    held = meta.get(META_KEY) if isinstance(meta, dict) else None
    if not isinstance(held, dict):
        return None
    values = [held.get(f, {}).get(path) for f in ("true32", "noise")]
    if any(not v or t >= len(v) or v[t] is None for v in values):
        return None
    return float(values[0][t]), float(values[1][t])
