"""The models ``shardcheck memory`` sizes without a task: a Linear, or an MLP of any depth."""

from __future__ import annotations

import jax
from flax import nnx

from shardcheck import _validate
from shardcheck.memory.state import check_param_dtype


class DeepMLP(nnx.Module):
    """``layers`` ``nnx.Linear`` layers with ReLU between: ``(B, D) -> (B, H) -> ... -> (B, H) -> (B, K)``.

    The shared :class:`shardcheck.models.MLP` has two layers; this one has any depth, for sizing deep models.

    Args:
        in_features: D.
        hidden: H, the width of every hidden layer.
        out_features: K.
        layers: L >= 2 Linear layers: one ``(D, H)``, ``L - 2`` of ``(H, H)``, one ``(H, K)``, all biased.
        param_dtype: dtype of every kernel and bias.
        rngs: the ``nnx.Rngs`` for the initializers.
    """

    def __init__(
        self, in_features: int, hidden: int, out_features: int, *, layers: int, param_dtype, rngs: nnx.Rngs
    ):
        widths = [in_features] + [hidden] * (layers - 1) + [out_features]
        self.layers = nnx.List(
            [
                nnx.Linear(a, b, param_dtype=param_dtype, rngs=rngs)
                for a, b in zip(widths[:-1], widths[1:], strict=True)
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


def make_memory_model(
    in_features: int,
    out_features: int,
    *,
    hidden: int | None = None,
    layers: int | None = None,
    param_dtype="float32",
    seed: int = 0,
    abstract: bool = False,
) -> nnx.Module:
    """The model ``shardcheck memory`` sizes: a Linear, or a :class:`DeepMLP` when ``hidden`` is given.

    Args:
        in_features: D >= 1.
        out_features: K >= 1.
        hidden: H >= 1, or None for a single ``nnx.Linear(D, K)``.
        layers: L >= 1 Linear layers; default 1 without ``hidden`` and 2 with it. L >= 2 needs ``hidden``;
            L = 1 is the plain Linear (then ``hidden`` must be None).
        param_dtype: a floating dtype for every parameter (``"float32"``, ``"bfloat16"``).
        seed: integer seed of ``nnx.Rngs``.
        abstract: build it under ``nnx.eval_shape``: every parameter is a ``jax.ShapeDtypeStruct`` and nothing
            is allocated, so a model far larger than the machine can be estimated.

    Returns:
        The module.

    Raises:
        ValueError: a width or ``layers`` < 1 (or not an int), ``layers >= 2`` without ``hidden`` or
            ``layers == 1`` with it, ``param_dtype`` not floating.
    """
    fn = "make_memory_model"
    for name, value in (("in_features", in_features), ("out_features", out_features), ("hidden", hidden)):
        if value is None and name == "hidden":
            continue
        _validate.check_int(fn, name, value, example=f"{name}=512 (a layer width)")
    if layers is None:
        layers = 1 if hidden is None else 2
    _validate.check_int(fn, "layers", layers, example="layers=2 (the number of Linear layers)")
    if layers >= 2 and hidden is None:
        raise ValueError(f"{fn}: layers={layers} needs a hidden width; pass hidden=H (e.g. --hidden 4096)")
    if layers == 1 and hidden is not None:
        raise ValueError(
            f"{fn}: layers=1 is a single Linear(D, K) and has no hidden width, got hidden={hidden}; "
            "drop hidden, or use layers >= 2"
        )
    dtype = check_param_dtype(fn, param_dtype)

    def build():
        rngs = nnx.Rngs(seed)
        if layers == 1:
            return nnx.Linear(int(in_features), int(out_features), param_dtype=dtype, rngs=rngs)
        return DeepMLP(
            int(in_features), int(hidden), int(out_features), layers=int(layers), param_dtype=dtype, rngs=rngs
        )

    return nnx.eval_shape(build) if abstract else build()
