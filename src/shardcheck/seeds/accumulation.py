"""Gradient accumulation over micro-batches with ``optax.MultiSteps``: the same update as one full-batch step.

``docs/reduction_cases.md`` C9. A batch of B rows is cut into k equal micro-batches; each micro-step computes that
micro-batch's mean loss and gradients at the current parameters and calls ``optimizer.update`` once, with an
optimizer built on ``optax.MultiSteps(tx, every_k_schedule=k)``. The first k-1 micro-steps only accumulate (the
parameters do not move: ``MultiSteps`` returns zero updates); the k-th applies the inner ``tx`` to the mean of the
k gradients. With equal micro-batches that mean is the full-batch gradient, so after k micro-steps the model and
the inner optimizer state equal one full-batch step of ``tx``, up to rounding.

Counters: ``MultiSteps`` keeps ``gradient_step`` (updates applied) and ``mini_step`` (position in the cycle), and
the NNX optimizer's own ``step`` counts every ``update`` call, that is micro-steps: k per full step. The parity
harness therefore compares ``gradient_step`` with the reference's ``step``, checks the NNX counter against
``k * steps`` and ``mini_step`` against 0 separately, compares the inner state (``inner_opt_state``) with the
reference's optimizer state, and checks that the accumulator (``acc_grads``, a parameter-sized float32 buffer that
memory accounting must count) is emptied after each full step.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate
from shardcheck.losses import mse_batch_loss
from shardcheck.steps.accumulation import accumulated_step
from shardcheck.steps.accumulation import make_accumulation_optimizer as make_accumulation_optimizer


def _check_k(fn: str, k) -> int:
    return _validate.check_int(fn, "num_micro_batches", k, example="num_micro_batches=2")


def _check_multisteps(fn: str, optimizer: nnx.Optimizer, k: int) -> None:
    state = optimizer.opt_state
    if not isinstance(state, optax.MultiStepsState):
        raise ValueError(
            f"{fn}: optimizer must wrap optax.MultiSteps (its state is {type(state).__name__}); build it with "
            "make_accumulation_optimizer(model, tx, num_micro_batches)"
        )
    # optax keeps the schedule privately (an int is wrapped in a constant function); read it when present.
    schedule = getattr(optimizer.tx, "_every_k_schedule", None)
    every = schedule(state.gradient_step[...]) if callable(schedule) else schedule
    if every is not None and int(every) != k:
        raise ValueError(
            f"{fn}: the optimizer accumulates every_k_schedule={int(every)} micro-steps but num_micro_batches={k}; "
            "they must be equal for one applied update per batch"
        )
    if int(np.asarray(state.mini_step)) != 0:
        raise ValueError(
            f"{fn}: the optimizer is in the middle of an accumulation cycle (mini_step={int(state.mini_step)}); "
            "a batch must start a fresh cycle"
        )


def accumulated_sgd_step(
    model: nnx.Module, optimizer: nnx.Optimizer, x, y, num_micro_batches: int
) -> jax.Array:
    """One full step as ``num_micro_batches`` accumulated micro-steps, in place.

    Cuts the batch into k equal contiguous micro-batches, and for each computes
    ``jnp.mean((model(x_i) - y_i) ** 2)`` and its gradients and calls ``optimizer.update(model, grads)``; the
    ``MultiSteps`` optimizer applies the inner update once, at the k-th micro-step, to the mean gradient.

    Args:
        model: an ``nnx.Module`` without batch statistics or RNG streams; updated in place.
        optimizer: from :func:`make_accumulation_optimizer` with the same k, at the start of a cycle.
        x: ``(B, D)`` float inputs, ``B % k == 0``.
        y: ``(B, K)`` float targets.
        num_micro_batches: k >= 1.

    Returns:
        The mean of the k pre-update micro-batch losses, 0-d float32 (the full-batch pre-update loss: every
        micro-batch loss is measured at the same parameters).

    Raises:
        TypeError: as :func:`~shardcheck.sgd_step`; ``num_micro_batches`` not an int.
        ValueError: as :func:`~shardcheck.sgd_step`; ``B % k != 0`` (equal micro-batches are required); an
            optimizer that does not wrap ``optax.MultiSteps``, accumulates a different k, or is mid-cycle.
            Nothing is changed when an error is raised.

    Example (``docs/reduction_cases.md`` C9, Fixture L)::

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
        >>> opt = make_accumulation_optimizer(model, optax.sgd(0.1), 2)
        >>> x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
        >>> y = jnp.array([[1.0], [2.0], [3.0], [4.0]])
        >>> accumulated_sgd_step(model, opt, x, y, 2)
        Array(7.5, dtype=float32)
        >>> model.bias[...]
        Array([0.5], dtype=float32)
    """
    fn = "accumulated_sgd_step"
    x, y = _validate.check_batch(fn, x, y)
    k = _check_k(fn, num_micro_batches)
    _validate.check_model(fn, model, x, y)
    _validate.check_optimizer(fn, optimizer, model)
    _validate.check_divisible(
        fn,
        x.shape[0],
        k,
        by=f"num_micro_batches={k}",
        counts="num_micro_batches",
        fix="equal micro-batches make the mean of their gradients the full-batch gradient",
    )
    _check_multisteps(fn, optimizer, k)
    return accumulated_step(mse_batch_loss, k, model, optimizer, (x, y))
