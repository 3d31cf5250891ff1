"""The models shardcheck steps: the seeds' ``nnx.Linear`` and a two-layer MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardcheck import _validate

MODEL_KINDS = ("linear", "mlp")


class MLP(nnx.Module):
    """Two ``nnx.Linear`` layers with a ReLU between: ``(B, D) -> (B, H) -> (B, K)``.

    Args:
        in_features: D.
        hidden: H.
        out_features: K.
        dtype: the computation dtype of both layers (default float32).
        param_dtype: the parameters' dtype (default float32).
        rngs: the ``nnx.Rngs`` for the initializers (``lecun_normal`` kernels, zero biases).
    """

    def __init__(
        self,
        in_features: int,
        hidden: int,
        out_features: int,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.hidden = nnx.Linear(in_features, hidden, **kw)
        self.out = nnx.Linear(hidden, out_features, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


def make_model(
    kind: str, in_features: int, out_features: int, *, hidden: int = 32, seed: int = 0
) -> nnx.Module:
    """A fresh model of the given kind, initialised from ``nnx.Rngs(seed)``.

    Args:
        kind: ``"linear"`` (``nnx.Linear(D, K)``) or ``"mlp"`` (:class:`MLP` with ``hidden`` units).
        in_features: D >= 1.
        out_features: K >= 1.
        hidden: H >= 1, used by ``"mlp"`` only.
        seed: integer seed of ``nnx.Rngs``.

    Returns:
        The module; its parameters are float32.

    Raises:
        ValueError: if ``kind`` is unknown or a width is < 1.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"make_model: kind={kind!r} is unknown; use one of {', '.join(MODEL_KINDS)}")
    for name, value in (("in_features", in_features), ("out_features", out_features), ("hidden", hidden)):
        _validate.check_int("make_model", name, value)
    rngs = nnx.Rngs(seed)
    if kind == "linear":
        return nnx.Linear(in_features, out_features, rngs=rngs)
    return MLP(in_features, hidden, out_features, rngs=rngs)
