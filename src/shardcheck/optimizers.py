"""Named optax optimizers for the CLI and the parity harness, with the options LLM training uses.

``make_tx("adamw", 3e-4, clip_norm=1.0, warmup_steps=100, schedule="cosine", decay_steps=10_000)`` is
``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-4, 100,
10_000), weight_decay=1e-4))``: the optimizer of most public LLM recipes (Loshchilov & Hutter, "Decoupled
Weight Decay Regularization", 2019; the schedule of Loshchilov & Hutter, "SGDR", 2017, with a linear warm-up).
"""

from __future__ import annotations

import numbers

import optax

from shardcheck import _validate
from shardcheck._catalog import OPTIMIZERS as OPTIMIZERS
from shardcheck._catalog import SCHEDULES as SCHEDULES

# The learning rate of ``shardcheck train`` and ``shardcheck verify`` when none is given, per optimizer: a step
# size that moves every leaf well above the parity tolerance and converges in 30 epochs on standardized diabetes.
DEFAULT_LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01, "adamw": 0.01}
# optax.adamw's own default decay.
DEFAULT_WEIGHT_DECAY = 1e-4


def _check_number(name: str, value, low: float, example: str, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"make_tx: {name} must be a number, got {value!r}; pass e.g. {example}")
    if not (value > low if open_low else value >= low) or value != value or value == float("inf"):
        rule = f"> {low}" if open_low else f">= {low}"
        raise ValueError(
            f"make_tx: {name} must be a finite number {rule}, got {value!r}; pass e.g. {example}"
        )
    return float(value)


def make_schedule(
    lr: float, *, schedule: str = "constant", warmup_steps: int = 0, decay_steps: int | None = None
) -> optax.Schedule | float:
    """The learning rate ``lr`` as a float, or an optax schedule with a linear warm-up from 0.

    Args:
        lr: the peak learning rate.
        schedule: ``"constant"`` (``lr`` after the warm-up; ``optax.warmup_constant_schedule``) or
            ``"cosine"`` (``optax.warmup_cosine_decay_schedule(0, lr, warmup_steps, decay_steps)``, to 0).
        warmup_steps: steps of the linear warm-up (0: none).
        decay_steps: the cosine schedule's total length in steps (default ``warmup_steps + 100``).

    Raises:
        ValueError: an unknown schedule, a negative warm-up, ``decay_steps <= warmup_steps``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"make_tx: schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    warmup_steps = _validate.check_int("make_tx", "warmup_steps", warmup_steps, minimum=0, example="10")
    if schedule == "constant":
        return lr if warmup_steps == 0 else optax.warmup_constant_schedule(0.0, lr, warmup_steps)
    decay_steps = warmup_steps + 100 if decay_steps is None else decay_steps
    decay_steps = _validate.check_int("make_tx", "decay_steps", decay_steps, example="1000")
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"make_tx: decay_steps={decay_steps} must exceed warmup_steps={warmup_steps} (it is the schedule's "
            "total length); pass a longer decay"
        )
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, decay_steps)


def make_tx(
    name: str,
    lr: float = 0.1,
    *,
    momentum: float = 0.9,
    weight_decay: float | None = None,
    clip_norm: float | None = None,
    schedule: str = "constant",
    warmup_steps: int = 0,
    decay_steps: int | None = None,
) -> optax.GradientTransformation:
    """The optax transformation called ``name``, optionally clipped and on a schedule.

    Args:
        name: ``"sgd"`` (``optax.sgd``), ``"momentum"`` (``optax.sgd(..., momentum=momentum)``, one
            parameter-sized trace), ``"adam"`` (``optax.adam``: a count and two parameter-sized moments) or
            ``"adamw"`` (``optax.adamw(..., weight_decay=weight_decay)``, the same state).
        lr: the (peak) learning rate, a finite positive number.
        momentum: the momentum coefficient of ``"momentum"``, in ``[0, 1)``.
        weight_decay: ``"adamw"``'s decoupled decay (default 1e-4, optax's); refused for other optimizers.
        clip_norm: clip the gradients to this global L2 norm first (``optax.clip_by_global_norm``); None: no clip.
        schedule, warmup_steps, decay_steps: the learning-rate schedule (:func:`make_schedule`).

    Returns:
        The ``optax.GradientTransformation``.

    Raises:
        ValueError: an unknown ``name`` or schedule; ``lr``, ``clip_norm`` or ``weight_decay`` out of range;
            ``momentum`` not in ``[0, 1)``; ``weight_decay`` for an optimizer other than adamw.
        TypeError: a number of the wrong type.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"make_tx: optimizer {name!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    lr = _validate.check_lr("make_tx", lr)
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError(
            f"make_tx: momentum must be a number in [0, 1), got {momentum!r}; pass e.g. momentum=0.9"
        )
    if not 0 <= momentum < 1:
        raise ValueError(f"make_tx: momentum must be in [0, 1), got {momentum!r}; pass e.g. momentum=0.9")
    if weight_decay is not None and name != "adamw":
        raise ValueError(
            f"make_tx: weight_decay={weight_decay!r} applies to adamw only, not {name!r}; use optimizer 'adamw'"
        )
    if clip_norm is not None:
        clip_norm = _check_number("clip_norm", clip_norm, 0.0, "clip_norm=1.0", open_low=True)
    rate = make_schedule(lr, schedule=schedule, warmup_steps=warmup_steps, decay_steps=decay_steps)
    if name == "sgd":
        tx = optax.sgd(rate)
    elif name == "momentum":
        tx = optax.sgd(rate, momentum=momentum)
    elif name == "adam":
        tx = optax.adam(rate)
    else:
        decay = DEFAULT_WEIGHT_DECAY if weight_decay is None else weight_decay
        tx = optax.adamw(rate, weight_decay=_check_number("weight_decay", decay, 0.0, "weight_decay=0.1"))
    return tx if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), tx)
