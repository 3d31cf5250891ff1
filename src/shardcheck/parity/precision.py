"""The precision policy of a step: the parameters' dtype, the compute dtype, and what each means for tolerance.

Large models keep float32 parameters (master weights) and compute in bfloat16, or hold bfloat16 parameters too.
A correct sharded step then differs from the single-device one by more than float32 rounding: each shard's
gradient is a bfloat16-rounded partial sum, and the full batch's is one rounded total. The policy is read from the
model (every Flax layer's ``dtype`` and ``param_dtype``) and can be overridden; the reference runs the same model,
so it runs the same policy on one device.

The rules (``docs/parity.md``, "Precision"):

* **Accumulation** (as today): reordering an n-term float32 sum: ``rtol = 16 eps32 sqrt(n) sqrt(t+1)``,
  ``atol = eps32 sqrt(n) sqrt(t+1)`` (:func:`~shardcheck.parity.tolerance.derive_tolerance`).
* **Compute rounding** (compute dtype less precise than float32): every gradient element may differ by
  ``2 eps_c sqrt(n) A``, with ``A = sum_s |g_s| / W`` the sum of the S shard gradients' magnitudes (computed by
  the harness at the reference's pre-step parameters). A bfloat16 reduction of n terms inside a shard rounds
  ``~sqrt(n)`` times relative to the terms' magnitudes (Higham 2002, ch. 4, the random-walk model), and ``A``
  (not ``|g|``) is the scale of the terms when shards cancel. Measured on the tiny-lm task (float32 and bfloat16
  parameters, bfloat16 compute, S = 2 and 8): the worst element used 0.97 of ``eps_c sqrt(n) A``.
* **Parameter rounding** (parameters less precise than float32): the stored parameter after an update is
  rounded once, so the two sides may differ by one unit in the last place: ``eps_p max|p|`` per step.
* **Propagation**: the gradient's tolerance is carried through ``tx.update`` (the update's and the optimizer
  state's change at ``g +- delta``) into the parameters' and the optimizer state's tolerance.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

ACCUMULATION_DTYPE = jnp.dtype(jnp.float32)
# A compute-rounding bound of ``eps_c sqrt(n) A`` was used up to 0.97 on the tiny-lm task: keep a factor 2.
COMPUTE_SAFETY = 2.0


def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def _least_precise(dtypes) -> np.dtype | None:
    floats = [jnp.dtype(d) for d in dtypes if d is not None and jnp.issubdtype(jnp.dtype(d), jnp.floating)]
    return max(floats, key=_eps) if floats else None


def _check_dtype(fn: str, name: str, value) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as err:
        raise TypeError(f"{fn}: {name}={value!r} is not a dtype; pass e.g. {name}='bfloat16'") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn}: {name}={value!r} is not a floating dtype; pass 'float32' or 'bfloat16'")
    return dtype


@dataclasses.dataclass(frozen=True)
class Precision:
    """The precision policy of a step.

    Attributes:
        param_dtype: the least precise floating dtype among the ``nnx.Param`` leaves.
        compute_dtype: the least precise compute dtype of the model's layers (a Flax layer's ``dtype``; a layer
            without one computes in its parameters' dtype).
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype

    @staticmethod
    def of(model: nnx.Module, *, compute_dtype=None, param_dtype=None, fn: str = "check_parity") -> Precision:
        """The policy of ``model``, with ``compute_dtype`` / ``param_dtype`` overriding what is read from it.

        Raises:
            TypeError, ValueError: an override that is not a floating dtype.
        """
        compute = _check_dtype(fn, "compute_dtype", compute_dtype)
        params = _check_dtype(fn, "param_dtype", param_dtype)
        if params is None:
            leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
            params = _least_precise(np.asarray(v[...]).dtype for _, v in leaves) or ACCUMULATION_DTYPE
        if compute is None:
            layer = [getattr(m, "dtype", None) for _, m in nnx.iter_modules(model)]
            compute = _least_precise([*layer, params]) or params
        return Precision(jnp.dtype(params), jnp.dtype(compute))

    @property
    def compute_eps(self) -> float:
        """eps of the compute rounding beyond float32 accumulation (0 when the compute dtype is float32+)."""
        return _eps(self.compute_dtype) if _eps(self.compute_dtype) > _eps(ACCUMULATION_DTYPE) else 0.0

    @property
    def param_eps(self) -> float:
        """eps of the parameters' rounding beyond float32 (0 for float32 parameters)."""
        return _eps(self.param_dtype) if _eps(self.param_dtype) > _eps(ACCUMULATION_DTYPE) else 0.0

    @property
    def low(self) -> bool:
        """Compute or parameters less precise than float32."""
        return self.compute_eps > 0 or self.param_eps > 0

    def describe(self) -> str:
        """``"params float32, compute bfloat16"``."""
        return f"params {self.param_dtype.name}, compute {self.compute_dtype.name}"
