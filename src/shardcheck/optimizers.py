"""Named optax optimizers for the CLI and the parity harness."""

from __future__ import annotations

import numbers

import optax

from shardcheck import _validate

OPTIMIZERS = ("sgd", "momentum", "adam")
# The learning rate of ``shardcheck train`` and ``shardcheck verify`` when none is given, per optimizer: a step
# size that moves every leaf well above the parity tolerance and converges in 30 epochs on standardized diabetes.
DEFAULT_LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}


def make_tx(name: str, lr: float = 0.1, *, momentum: float = 0.9) -> optax.GradientTransformation:
    """The optax transformation called ``name``.

    Args:
        name: ``"sgd"`` (``optax.sgd(lr)``, no state but a counter-free empty state), ``"momentum"``
            (``optax.sgd(lr, momentum=momentum)``, one parameter-sized trace) or ``"adam"``
            (``optax.adam(lr)``, two parameter-sized moments and a step count).
        lr: learning rate, a finite positive number.
        momentum: the momentum coefficient of ``"momentum"``.

    Returns:
        The ``optax.GradientTransformation``.

    Raises:
        ValueError: if ``name`` is unknown, ``lr`` is not a finite positive number, or ``momentum`` is not in
            ``[0, 1)``.
        TypeError: if ``lr`` or ``momentum`` is not a number.
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
    if name == "sgd":
        return optax.sgd(lr)
    if name == "momentum":
        return optax.sgd(lr, momentum=momentum)
    return optax.adam(lr)
