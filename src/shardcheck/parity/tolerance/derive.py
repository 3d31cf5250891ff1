"""The default parity tolerance: how far a correct sharded step may drift from the baseline, and why.

A correct sharded step computes every per-example value exactly as the full-batch step does and reorders only
the one reduction over the batch; the rule below bounds the rounding of that reordering (``docs/parity.md``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from shardcheck import _validate

SAFETY_FACTOR = 16.0
# Optimizer moments are compared at this multiple of the tolerance (second moments square the gradient).
MOMENT_FACTOR = 2.0

# An update recomputed from the same inputs agrees with the applied one within the optimizer's own rounding:
# UPDATE_ULPS units in the last place of the leaf's largest element (the addition p + u, elementwise ops fused
# another way), and a relative UPDATE_RTOL of each element's own change in the step (a global norm, or a mean
# over leaves, reduced in another order scales the update by a factor within a few ulps of 1); under a compute
# dtype coarser than float32, 4 of its units in place of UPDATE_RTOL (gradients cast on their way to the update).
UPDATE_ULPS = 8
UPDATE_RTOL = 1e-4
# Where the update check fails, it is decided again with the update's sensitivity to the gradient moving by this
# many units in the last place of its leaf's largest element (a gradient returned as computed in another order than
# the one applied: Adam amplifies an element at rounding level).
UPDATE_GRAD_ULPS = 16
# A low-precision parameter's optimizer computes its update in that precision (its state is initialized from the
# parameters: bfloat16 moments): each side rounds the moments' updates, the bias corrections, the square root and
# the division by up to about 2 of its units of the update, so two correct steps' updates differ by up to this many
# units of the parameter dtype times the update (trial 29: Adam on bfloat16 parameters, the built-in fsdp and
# accumulation steps 2 bfloat16 ulps from the reference where 1.8 were allowed).
LOW_PRECISION_UPDATE_ULPS = 4


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Tolerances of one step: a leaf passes when ``max|cand - ref| <= atol + rtol * max|ref|``.

    Attributes:
        rtol: relative (normwise) tolerance.
        atol: absolute floor, for leaves whose reference is ~0.
        rule: one line saying how they were obtained.
    """

    rtol: float
    atol: float
    rule: str


def derive_tolerance(dtype="float32", *, batch_size: int, out_features: int = 1, step: int = 0) -> Tolerance:
    """The default tolerance of step ``step`` (0-based) for a batch of ``batch_size`` examples and K outputs.

    Reasoning (``docs/parity.md``): a correct sharded step computes every per-example value exactly as the
    full-batch step does and differs only in the order of the one reduction over the batch (``n = B * K``
    squared errors in the loss, B per-example terms in each gradient element). Reordering a floating-point sum of
    n terms changes it by at most ``(n - 1) * eps * sum|terms|`` and typically by ``~sqrt(n) * eps`` relative
    (random-walk rounding model; N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002,
    ch. 4); the factor 16 covers the forward/backward matmuls whose blocking XLA may change with the shard shape
    and the optimizer's own arithmetic. Rounding errors of successive steps are independent and propagate through
    the parameters, so they grow like ``sqrt(t + 1)``. The absolute floor is the same sum's noise at unit scale
    without the safety factor: shardcheck data are standardized, so a leaf that cancels to ~0 carries about that
    much noise. Measured: float32, diabetes, B=64, S in {2, 4, 8}, 20 steps of sgd/momentum/Adam: worst normwise
    errors 1e-7 to 1e-6, at least 10x under this rule; a mean divided by S twice at S=2 is off by 50%.

    Args:
        dtype: the leaf dtype; ``eps`` is ``jnp.finfo(dtype).eps`` (float32: 1.19e-7, bfloat16: 7.8e-3).
        batch_size: B >= 1, examples in the step's batch.
        out_features: K >= 1, outputs averaged in the loss.
        step: t >= 0.

    Returns:
        A :class:`Tolerance`. Optimizer-state leaves are compared at twice these values (second moments square
        the gradient, doubling its relative error).

    Raises:
        TypeError: ``batch_size``, ``out_features`` or ``step`` not an int.
        ValueError: ``batch_size``, ``out_features`` < 1 or ``step`` < 0; ``dtype`` not a floating dtype.

    Example::

        >>> tol = derive_tolerance("float32", batch_size=64)
        >>> round(tol.rtol, 8), round(tol.atol, 9)
        (1.526e-05, 9.54e-07)
    """
    fn = "derive_tolerance"
    batch_size = _validate.check_int(fn, "batch_size", batch_size)
    out_features = _validate.check_int(fn, "out_features", out_features)
    step = _validate.check_int(fn, "step", step, minimum=0)
    try:
        eps = float(jnp.finfo(dtype).eps)
    except ValueError as err:
        raise ValueError(f"{fn}: dtype {dtype!r} is not a floating dtype; pass e.g. 'float32'") from err
    n = batch_size * out_features
    noise = eps * math.sqrt(n) * math.sqrt(step + 1)
    rule = (
        f"derived: rtol = {SAFETY_FACTOR:g} * eps * sqrt(B*K) * sqrt(t+1), atol = eps * sqrt(B*K) * sqrt(t+1) "
        f"(eps={eps:.3g}, B*K={n}); optimizer moments x{MOMENT_FACTOR:g}"
    )
    return Tolerance(rtol=SAFETY_FACTOR * noise, atol=noise, rule=rule)
