"""The single-device SGD baseline of seed ``001_a85d1499a1a85057.txt``, as adapters over the Task engine.

``sgd_step`` is the in-place NNX step every sharded step is checked against; ``fsdp_step`` is the seed's
entrypoint (a historical name: it does not shard anything). Both validate ``x``/``y`` and run the engine's
reference step (:func:`shardcheck.steps.reference.reference_step`) on the seeds' regression task: the loss
:func:`shardcheck.losses.mse_batch_loss` of the ``(x, y)`` batch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardcheck import _validate
from shardcheck.losses import mse_batch_loss
from shardcheck.steps.reference import reference_step


@functools.partial(jax.jit, static_argnums=0)
def _sgd_step_jit(graphdef, state, x, y):
    """The engine's reference step of the regression task, ``(graphdef, state, x, y) -> (loss, state)``."""
    model, optimizer = nnx.merge(graphdef, state)
    loss = reference_step(mse_batch_loss, model, optimizer, (x, y)).loss
    return loss, nnx.state((model, optimizer))


def sgd_step(model: nnx.Module, optimizer: nnx.Optimizer, x, y) -> jax.Array:
    """One ordinary optimizer step on the whole batch, in place: the baseline of seed 001.

    Computes ``loss = jnp.mean((model(x) - y) ** 2)`` and its gradients with respect to every ``nnx.Param`` at the
    current parameters, then calls ``optimizer.update(model, grads)`` once. With ``optax.sgd(lr)`` that is
    ``param <- param - lr * grad`` for kernel and bias alike; any optax transformation works (momentum, Adam).
    The step is jitted once per model structure and batch shape; new values do not re-compile.

    Args:
        model: an ``nnx.Module`` without batch statistics or RNG streams; updated in place.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; its state and step counter are updated in place.
        x: ``(B, D)`` float inputs (integer arrays are converted to float32).
        y: ``(B, K)`` float targets.

    Returns:
        The pre-update loss, a 0-d float32 array.

    Raises:
        TypeError: non-numeric ``x``/``y``; ``model`` not an ``nnx.Module``; ``optimizer`` not an
            ``nnx.Optimizer``.
        ValueError: ``x``/``y`` not 2-D, batch sizes differ or are zero, NaN/inf in the data, ``model`` holds
            batch statistics or RNG streams. Nothing is changed when an error is raised.
    """
    fn = "sgd_step"
    x, y = _validate.check_batch(fn, x, y)
    _validate.check_model(fn, model, x, y)
    _validate.check_optimizer(fn, optimizer, model)
    graphdef, state = nnx.split((model, optimizer))
    loss, state = _sgd_step_jit(graphdef, state, x, y)
    nnx.update((model, optimizer), state)
    return loss


def fresh_linear(seed: jax.Array, in_features: int, out_features: int, params) -> nnx.Linear:
    """``nnx.Linear(D, K, rngs=nnx.Rngs(seed))``, optionally overwritten with ``params``; traceable."""
    model = nnx.Linear(in_features, out_features, rngs=nnx.Rngs(jax.random.key(seed)))
    if params is not None:
        model.kernel[...] = params["kernel"]
        model.bias[...] = params["bias"]
    return model


def validate_entrypoint(fn: str, x, y, num_shards, lr, seed, params):
    """The bad-input checks common to both seed entrypoints; returns the cleaned arguments."""
    x, y = _validate.check_batch(fn, x, y)
    num_shards = _validate.check_num_shards(fn, num_shards)
    lr = _validate.check_lr(fn, lr)
    seed = _validate.check_seed(fn, seed)
    params = _validate.check_params(fn, params, x.shape[1], y.shape[1])
    return x, y, num_shards, lr, seed, params


@jax.jit
def _fsdp_step_jit(seed, lr, x, y, params):
    model = fresh_linear(seed, x.shape[1], y.shape[1], params)
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
    return reference_step(mse_batch_loss, model, optimizer, (x, y)).loss


def fsdp_step(
    x, y, num_shards: int, lr: float = 0.1, *, seed: int = 0, params: Mapping | None = None
) -> jax.Array:
    """Seed ``001_a85d1499a1a85057.txt``: one ordinary SGD step of a fresh ``nnx.Linear``; the pre-update loss.

    Builds ``nnx.Linear(D, K, rngs=nnx.Rngs(seed))`` (``params``, when given, overwrite its kernel and bias, as in
    the seed's worked example) and ``nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)``, computes
    ``jnp.mean((model(x) - y) ** 2)`` and its gradients on the whole batch, applies one update, and returns the
    loss measured before the update. Despite the historical name nothing is sharded: ``num_shards`` is validated
    and otherwise informational. The model is fresh on every call and is not returned.

    The whole call (model construction included) runs as one jitted function, so repeated calls with the same
    shapes do not re-trace, also when ``lr``, ``seed`` or ``params`` change.

    Args:
        x: ``(B, D)`` float inputs; integer arrays are converted to float32.
        y: ``(B, K)`` float targets; integer arrays are converted to float32.
        num_shards: a positive int; informational only.
        lr: learning rate, a finite positive number.
        seed: integer seed of ``nnx.Rngs``.
        params: optional ``{"kernel": (D, K), "bias": (K,)}`` initial weights.

    Returns:
        The pre-update loss, a 0-d float32 array.

    Raises:
        TypeError: non-numeric data, ``num_shards`` not an int (float, bool, None), ``lr`` not a number,
            ``params`` not a mapping.
        ValueError: ``x``/``y`` not 2-D, batch sizes differ or are zero, NaN/inf, ``num_shards < 1``, ``lr`` not
            finite and positive, ``params`` with wrong keys or shapes.

    Example (the seed's worked example)::

        >>> import jax.numpy as jnp
        >>> fsdp_step(jnp.array([[1.0], [2.0]]), jnp.zeros((2, 1)), num_shards=2, lr=0.1,
        ...           params={"kernel": jnp.array([[1.0]]), "bias": jnp.array([0.0])})
        Array(2.5, dtype=float32)
    """
    x, y, _, lr, seed, params = validate_entrypoint("fsdp_step", x, y, num_shards, lr, seed, params)
    return _fsdp_step_jit(jnp.int32(seed), jnp.float32(lr), x, y, params)
