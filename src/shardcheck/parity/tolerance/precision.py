"""The precision policy of a step: the parameters' dtype, the compute dtype, and what each means for tolerance.

Large models keep float32 parameters (master weights) and compute in bfloat16, or hold bfloat16 parameters too.
A correct sharded step then differs from the single-device one by more than float32 rounding: each shard's
gradient is a bfloat16-rounded partial sum, and the full batch's is one rounded total. The policy is read from the
model (every Flax layer's ``dtype`` and ``param_dtype``) and can be overridden; the reference runs the same model,
so it runs the same policy on one device.

The rules (``docs/parity.md``, "Precision"):

* **Accumulation** (as today): reordering an n-term float32 sum: ``rtol = 16 eps32 sqrt(n) sqrt(t+1)``,
  ``atol = eps32 sqrt(n) sqrt(t+1)`` (:func:`~shardcheck.parity.tolerance.derive.derive_tolerance`).
* **Compute rounding** (compute dtype less precise than float32): measured, not derived from the reduction
  length. Every gradient element may differ by the largest of three realizations of :func:`compute_allowance`,
  ``COMPUTE_SAFETY * (max|g_r - g| + |g(p_cand) - g|)``, plus :func:`output_rounding`,
  ``eps_c (|g| + sum_s |g_s|)``. The realizations ``g_r``, each computed by the harness at the reference's
  pre-step parameters: a correct S-shard split in the model's own precision, its shard sum in the gradients'
  dtype (how ``shard_map`` steps reduce) and in the compute dtype (how a GSPMD-partitioned backward pass may),
  and the same model computing in float32 (:func:`float32_compute`: the reference's own rounding). ``g(p_cand)``
  is the reference's gradient at the candidate's pre-step parameters. A split computes each row as the
  reference does, so its rounding is correlated with the reference's; a GSPMD step also partitions the feature
  contractions and rounds independently, which the float32 realization covers. The measurements behind these
  choices (and the bound they replaced): ``docs/parity.md``, "Precision".
* **Matmul precision** (a backend whose float32 matmuls round their operands: TF32 on a GPU, one bfloat16 pass
  on a TPU; ``shardcheck.parity.tolerance.matmul``): the compute eps is the coarser of the compute dtype's and the matmul
  precision's, and where the matmuls round more than the compute dtype the rule above takes one more
  realization, ``g_M``: the reference's gradient with its matmuls at the other precision (operands rounded by
  ``lax.reduce_precision`` where the reference's backend computes float32, else at ``"highest"``).
* **Parameter rounding** (parameters less precise than float32): each side rounds the stored parameter once, by
  at most ``eps_p |p| / 2``; together ``eps_p max|p|`` per step.
* **Propagation**: the gradient's tolerance is carried through ``tx.update`` (the update's and the optimizer
  state's change at ``g +- delta``) into the parameters' and the optimizer state's tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.tolerance.matmul import matmul_operand_dtypes, policy_eps

ACCUMULATION_DTYPE = jnp.dtype(jnp.float32)
# The measured noise is one realization: another split's maximum over a leaf was up to 0.96 of it on tiny-lm
# (below), and XLA's GSPMD partitioning (the feature contractions of annotated or FSDP-placed parameters rounded
# in another order than any batch split) reached 2.53 of it on tiny-lm at S = 8 (Adam's first moment of a query
# kernel): keep a factor 4.
COMPUTE_SAFETY = 4.0


def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def traced_compute_dtype(loss_fn, model: nnx.Module, batch) -> np.dtype | None:
    """The least precise floating operand of the matmuls (``dot_general``, ``conv_general_dilated``) of
    ``loss_fn(model, batch)``, read from its jaxpr as a function of the parameters (traced, not compiled;
    :func:`~shardcheck.parity.tolerance.matmul.matmul_operand_dtypes`); ``None`` where it has none, or the loss
    cannot be traced alone (a sharding constraint that needs the step's mesh)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch)

    try:
        dtypes = matmul_operand_dtypes(jax.make_jaxpr(loss)(params))
    except Exception:  # noqa: BLE001  (a loss that cannot be traced alone: nothing read, the layers decide)
        return None
    return _least_precise(dtypes)


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
        raise ValueError(
            f"{fn}: {name}={value!r} is not a floating dtype; pass 'float32', 'bfloat16' or 'float16'"
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class Precision:
    """The precision policy of a step.

    Attributes:
        param_dtype: the least precise floating dtype among the ``nnx.Param`` leaves.
        compute_dtype: the least precise compute dtype of the model's layers (a Flax layer's ``dtype``; a layer
            without one computes in its parameters' dtype).
        matmul: the precision the step's matmuls and convolutions use on float32 operands
            (``shardcheck.parity.tolerance.matmul``: ``"float32"``, ``"tf32"``, ``"bfloat16"``).
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    matmul: str = "float32"

    @staticmethod
    def of(
        model: nnx.Module,
        *,
        compute_dtype=None,
        param_dtype=None,
        matmul: str = "float32",
        fn: str = "check_parity",
        traced=None,
    ) -> Precision:
        """The policy of ``model``, with ``compute_dtype`` / ``param_dtype`` overriding what is read from it.

        Read from the model: the parameters' least precise dtype, and as the compute dtype the least precise of
        the layers' ``dtype``, the parameters' and ``traced`` (:func:`traced_compute_dtype`: the least precise
        operand of the loss's matmuls, where the model casts in its own code; trial 38: a correct step of a model
        casting its weights to bfloat16 FAILed as a bfloat16 all-reduce "while the model computes in float32")
        (conservative: a layer with ``dtype=float32`` on bfloat16
        parameters computes in float32; pass ``compute_dtype="float32"`` to say so). An override may name a less
        precise dtype than the model's own (a rounding the layers do not show, such as a custom layer's bfloat16
        matmul), not a more precise one than its parameters or its layers' declared ``dtype``: the tolerance would
        be tighter than the model's rounding, and a correct step would FAIL.

        Raises:
            TypeError, ValueError: an override that is not a floating dtype.
            ValueError: an override more precise than what the model's parameters or layers use.
        """
        compute = _check_dtype(fn, "compute_dtype", compute_dtype)
        params = _check_dtype(fn, "param_dtype", param_dtype)
        leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
        stored = _least_precise(jnp.asarray(v[...]).dtype for _, v in leaves) or ACCUMULATION_DTYPE
        # the layers' own compute dtypes, and what the loss's matmuls take where it casts in its own code
        layer = [getattr(m, "dtype", None) for _, m in nnx.iter_modules(model)] + [traced]
        declared = _least_precise(layer) or ACCUMULATION_DTYPE
        for name, override, read in (("param_dtype", params, stored), ("compute_dtype", compute, declared)):
            if override is not None and _eps(override) < _eps(read):
                whose = "its parameters" if name == "param_dtype" else "its layers or its loss's matmuls"
                raise ValueError(
                    f"{fn}: {name}={jnp.dtype(override).name!r} is more precise than the model's own "
                    f"{jnp.dtype(read).name} ({whose}): the tolerance would be tighter than the model's rounding "
                    f"and a correct step would FAIL; omit {name} or pass {jnp.dtype(read).name!r}"
                )
        params = stored if params is None else params
        if compute is None:
            compute = _least_precise([*layer, params]) or params
        return Precision(jnp.dtype(params), jnp.dtype(compute), matmul)

    @property
    def compute_eps(self) -> float:
        """eps of the compute rounding beyond float32 accumulation: the coarser of the compute dtype's and the
        matmul precision's (``2**-10`` for TF32 matmuls on float32 compute); 0 when both are float32 or finer."""
        eps = max(_eps(self.compute_dtype), policy_eps(self.matmul))
        return eps if eps > _eps(ACCUMULATION_DTYPE) else 0.0

    @property
    def matmul_coarser(self) -> bool:
        """The matmul precision rounds more than the compute dtype does (TF32 or a bfloat16 pass on float32
        compute): its rounding is measured by a realization of its own (``shardcheck.parity.tolerance.matmul``)."""
        return policy_eps(self.matmul) > max(_eps(self.compute_dtype), _eps(ACCUMULATION_DTYPE))

    @property
    def param_eps(self) -> float:
        """eps of the parameters' rounding beyond float32 (0 for float32 parameters)."""
        return _eps(self.param_dtype) if _eps(self.param_dtype) > _eps(ACCUMULATION_DTYPE) else 0.0

    @property
    def low(self) -> bool:
        """Compute or parameters less precise than float32."""
        return self.compute_eps > 0 or self.param_eps > 0

    def describe(self) -> str:
        """``"params float32, compute bfloat16"``; ``", matmuls tf32"`` added under a matmul precision other than
        float32."""
        matmul = "" if self.matmul == "float32" else f", matmuls {self.matmul}"
        return f"params {self.param_dtype.name}, compute {self.compute_dtype.name}{matmul}"


def float32_compute(graphdef, params, rest):
    """The graph of the same model computing in float32, or ``None`` when no layer computes below it.

    Every Flax layer (``Linear``, ``Embed``, ``LayerNorm``, ``MultiHeadAttention``, ...: a ``dtype`` and a
    ``param_dtype``) whose ``dtype`` is less precise than float32, or unset on parameters less precise than
    float32 (it computes in its parameters' dtype), gets ``dtype=float32``; the parameters keep their dtype.
    The gradient of that model is the reference's gradient without the compute dtype's rounding, so its
    difference from the reference's measures that rounding (:func:`compute_allowance`). A cast written into a
    layer's own code (``x.astype(jnp.bfloat16)``) stays: that rounding is then measured only by the split's
    realizations and bounded by :func:`output_rounding`. The caller's model is not changed (``nnx.merge``
    builds new modules). Raises nothing.

    Args:
        graphdef, params, rest: ``nnx.split(model, nnx.Param, ...)`` of the model.

    Returns:
        A graphdef for ``nnx.merge(graphdef, params, rest)``, or ``None``.
    """
    model = nnx.merge(graphdef, params, rest)
    changed = False
    for _, module in nnx.iter_modules(model):
        if not hasattr(module, "dtype") or not hasattr(module, "param_dtype"):
            continue  # not a Flax layer's dtype / param_dtype pair
        computes = module.param_dtype if module.dtype is None else module.dtype
        if jnp.issubdtype(jnp.dtype(computes), jnp.floating) and _eps(computes) > _eps(ACCUMULATION_DTYPE):
            module.dtype = ACCUMULATION_DTYPE
            changed = True
    return nnx.split(model, nnx.Param, ...)[0] if changed else None


def loss_compute_allowance(precision: Precision, loss: float, terms: int, realizations=()) -> float:
    """The loss's allowance under a low-precision compute dtype or a coarse matmul precision:
    ``eps_c * |loss| / sqrt(n) + COMPUTE_SAFETY * max_r |loss_r - loss|``; 0 in float32.

    A correct step that partitions the model's feature dimensions (GSPMD, or a user's jitted step on annotated
    parameters) rounds the forward contractions in another order than the single-device step, so each of the n
    per-term losses (tokens, rows: ``Task.terms``) may differ by about ``eps_c`` relative, and their mean by
    ``eps_c |loss| / sqrt(n)`` (independent roundings, Higham 2002 ch. 4). Measured on the tiny-lm task (bfloat16
    compute, S = 8, n = 512, gspmd): 0.26 of it. A wrong loss (post-update, one shard's, an unweighted mean) is
    off by far more.

    That term assumes the per-term roundings independent, which a coarse matmul precision's are not: TF32 rounds
    each weight once for every row, so the rows' errors share a sign. The second term is measured, as the
    gradients' is (:func:`compute_allowance`): ``loss_r`` is the reference's loss recomputed with its matmuls at
    the other precision (``shardcheck.parity.tolerance.matmul.gradients_at``, the forward pass of the gradient's
    realization ``g_M``), and a correct candidate computing its matmuls there differs from the reference's loss by
    about ``|loss_r - loss|``. Measured on the ReLU MLP (diabetes, hidden 32, B = 64, TF32 emulated, dp at
    S = 2, step 0): a correct candidate's loss differed by 3.17e-4, 1.19 times the first term plus the float32
    rule's (2.66e-4), and ``|loss_r - loss|`` was 3.17e-4 too: the error used 0.21 of the new tolerance.

    At a compute dtype coarser than float32 the first term's independence fails too where each per-term loss is
    itself a low-precision reduction (a per-example squared error summed over 64 pixels in bfloat16, n the
    batch's 2048 elements): ``loss_r`` is then also the reference's loss with every layer in float32
    (:func:`float32_compute`). Measured on issue #36 trial 15 (a bfloat16 conv U-Net, loss ~85, mesh data=2 x
    fsdp=2): a correct GSPMD step's loss differed by 0.0522 against 0.0216 derived (a false FAIL); with the
    float32 realization it is allowed 0.203, and a loss 5% off (4.25) or a per-pixel mean still FAILs.

    Args:
        precision: the check's policy.
        loss: the reference's loss (a float).
        terms: n, the batch's per-term losses (``Task.terms``).
        realizations: the reference's loss in each measured realization (floats: with every layer in float32 at a
            coarser compute dtype, with the matmuls at the other precision under a coarse matmul precision).
    """
    if precision.compute_eps <= 0 or not math.isfinite(loss):
        return 0.0
    derived = precision.compute_eps * abs(loss) / math.sqrt(max(int(terms), 1))
    measured = [abs(float(r) - loss) for r in realizations]
    if not all(math.isfinite(m) for m in measured):
        return derived  # a non-finite realization measures nothing (the reference's own loss is finite)
    return derived + COMPUTE_SAFETY * max(measured, default=0.0)


@jax.jit
def compute_allowance(split, grads, drifted=None):
    """The compute-rounding allowance of each gradient element under a low-precision compute dtype.

    ``COMPUTE_SAFETY * (max|g_S - g| + |g(p_cand) - g|)``: per leaf, the largest difference between the gradient
    of a correct S-shard split ``g_S`` (computed in the model's own precision) and the full batch's ``g``: one
    measured realization of the rounding a reordered, low-precision backward pass adds; plus, elementwise, the
    reference's gradient at the candidate's pre-step parameters ``g(p_cand)`` minus ``g``: how far the parameter
    difference the check accepted in earlier steps moves the gradient (also a low-precision difference, hence
    inside the safety factor).

    Args:
        split: ``g_S``, a tree of float32 arrays.
        grads: ``g``, the same tree (any float dtype).
        drifted: ``g(p_cand)`` like ``grads``, or ``None`` (the candidate's parameters are the reference's).

    Returns:
        A float32 tree like ``grads``.

    Example::

        >>> import jax.numpy as jnp
        >>> out = compute_allowance({"b": jnp.array([1.0, 2.0])}, {"b": jnp.array([1.0078125, 2.0])})
        >>> [float(v) for v in out["b"]]
        [0.015625, 0.015625]
    """
    if drifted is None:
        drifted = grads

    def one(s, g, d):
        g = g.astype(jnp.float32)
        noise = jnp.max(jnp.abs(s.astype(jnp.float32) - g))
        return COMPUTE_SAFETY * (noise + jnp.abs(d.astype(jnp.float32) - g))

    return jax.tree.map(one, split, grads, drifted)


@jax.jit
def measured_noise(realizations: list, grads, drifted):
    """The largest :func:`compute_allowance` over the realizations, element by element, in one compiled program.

    Args:
        realizations: the measured gradients ``g_r``, a non-empty list of trees of float arrays like ``grads``.
        grads: ``g``, the reference's gradient.
        drifted: ``g(p_cand)`` like ``grads`` (``grads`` itself where the candidate's parameters are the
            reference's: the same values as ``None``, and the same program as a drifted step's).

    Returns:
        A float32 tree like ``grads``: ``max_r compute_allowance(g_r, g, g(p_cand))`` (maxima are exact, so it
        equals the separate calls' bit for bit).

    Raises:
        ValueError: ``realizations`` is empty.
    """
    if not realizations:
        raise ValueError("measured_noise: realizations is empty; pass at least one measured gradient tree")
    allowances = [compute_allowance(g, grads, drifted) for g in realizations]
    return functools.reduce(lambda a, b: jax.tree.map(jnp.maximum, a, b), allowances)


@jax.jit
def output_rounding(grads, magnitude, eps):
    """The compute dtype's output roundings of a correct split: ``eps_c * (|g| + A)`` on each gradient element.

    Under a low-precision compute dtype each side rounds its gradient to that dtype: the reference once (the
    full batch's product, at most half an ulp, ``eps_c |g| / 2``), a sharded step once per shard's partial
    gradient (``eps_c |g_s| / 2`` each) and, reducing in the compute dtype, once per addition (S = 2: one,
    ``eps_c |g| / 2``). Their sum is at most ``eps_c (|g| + A)``, ``A = sum_s |g_s| / W`` the shard magnitudes
    (the Higham 2002 ch. 2 model of one rounding, ``|fl(x) - x| <= eps |x| / 2``, summed). The measured
    split noise (:func:`compute_allowance`) is one realization of these roundings, which can fall well below
    this sum: on the one-block tiny-lm (bfloat16 compute, S = 2) a GSPMD step's query / key kernel gradients
    differed from the reference's by 1.1x of 4 times the split's noise, 1.6 bfloat16 ulps of the leaf's
    largest element.

    Args:
        grads: ``g``, a tree of float arrays.
        magnitude: ``A`` like ``grads`` (float32), from the same split.
        eps: ``eps_c``, the compute dtype's eps (0 in float32: a zero tree).

    Returns:
        A float32 tree like ``grads``.
    """
    return jax.tree.map(
        lambda g, a: eps * (jnp.abs(g.astype(jnp.float32)) + a.astype(jnp.float32)), grads, magnitude
    )
