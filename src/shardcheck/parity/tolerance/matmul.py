"""The precision a backend's matmuls really use, and a step's gradient computed at another one.

A float32 model's matmuls and convolutions do not always compute in float32. On an NVIDIA GPU since Ampere, JAX's
default (and ``"high"``, ``"tensorfloat32"``) rounds each operand to TF32, a 10-bit mantissa; a TPU's default is
one bfloat16 pass, a 7-bit mantissa; ``"highest"`` (or ``"float32"``) computes in float32, as a CPU always does.
Measured on an H200 (``docs/parity.md``, "Precision"): a float32 2048^3 matmul's error against float64 is 2.94e-4
under the default and ``"high"``, 8.1e-7 under ``"highest"``; a CPU gives 4.1e-7, and
``lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)`` on both operands on a CPU gives 2.946e-4.

The policy of a check (:func:`step_policy`) is the coarsest of what its sides' matmuls use: per ``dot_general``
/ ``conv_general_dilated`` of the step's gradient, the ``precision`` it was traced with (set by the step itself,
or by ``jax.default_matmul_precision`` / ``jax_default_matmul_precision``, which JAX writes into that parameter)
on the platform of each side (:func:`backend_policy`). Its unit roundoff is ``2**-mantissa`` (:data:`MANTISSA`).

:func:`rounded_matmuls` computes a function with every matmul's operands rounded to a policy's mantissa (forward
and backward: a ``custom_vjp`` rounds the cotangent too) and the products taken at ``"highest"``: on a CPU it
emulates TF32 or one bfloat16 pass, which is how the harness measures the reference's own rounding under a
policy coarser than float32 (:func:`gradients_at`: its gradient and its loss), and how the tests build a TF32
candidate on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.extend import core

from shardcheck.task import loss_terms

MANTISSA = {"float32": 23, "tf32": 10, "bfloat16": 7}
"""Explicit mantissa bits of each matmul policy's operands (TF32: 10, a bfloat16 pass: 7)."""

POLICIES = tuple(MANTISSA)

EPS_DTYPE = {"float32": "float32", "tf32": "float16", "bfloat16": "bfloat16"}
"""The dtype whose eps is each policy's unit roundoff (TF32's 10 mantissa bits are float16's), for
:func:`~shardcheck.parity.tolerance.derive.derive_tolerance`."""

_MATMULS = ("dot_general", "conv_general_dilated")
# call-like primitives whose body runs once, as written: evaluated inline (a rounded matmul inside stays one). A
# custom_jvp / custom_vjp function with no matmul inside (jax.nn.relu, a user's rule) is bound as it was, its rule
# kept; one around a matmul runs its primal function's jaxpr, so its gradient is the primal's (JAX's own
# differentiation of those ops), its custom rule set aside: the rule's matmuls could not be rounded
_INLINE = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "checkpoint",
    "remat",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
)


class EmulationError(RuntimeError):
    """:func:`rounded_matmuls` could not evaluate an equation of the function it emulates: a limitation or a bug
    of shardcheck's matmul emulation, not of the function. ``primitive``: the equation's primitive name;
    ``policy``: the emulated policy; the original exception is ``__cause__``."""

    def __init__(self, primitive: str, policy: str | None, cause: BaseException):
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "").rstrip(".")
        super().__init__(
            f"shardcheck's {policy or 'float32'} matmul emulation (shardcheck.parity.tolerance.matmul.rounded_matmuls, "
            f"which recomputes the reference's gradient at that precision) could not evaluate a {primitive!r} "
            f"equation of the loss: {type(cause).__name__}: {first}. A limitation or a bug of shardcheck, not a "
            "fault of the step"
        )
        self.primitive = primitive
        self.policy = policy


def policy_eps(policy: str) -> float:
    """The unit roundoff of a policy's matmul operands, ``2**-mantissa`` (float32: 1.19e-7, tf32: 9.77e-4,
    bfloat16: 7.81e-3)."""
    return 2.0 ** -MANTISSA[policy]


def coarsest(*policies: str | None) -> str:
    """The coarsest of the named policies (``None`` is skipped); ``"float32"`` when none is named."""
    named = [p for p in policies if p is not None]
    return min(named, key=lambda p: MANTISSA[p]) if named else "float32"


JAX_NAMES = {"highest": "float32", "tensorfloat32": "tf32"}
"""``jax_default_matmul_precision``'s names of the same precisions as a policy (its ``"bfloat16"`` and ``"float32"``
are the policies' own names); its ``"default"`` and ``"high"`` depend on the backend, so they name no policy."""


def check_policy(fn: str, value) -> str | None:
    """``value`` as a policy name (``None`` passes through): one of :data:`POLICIES`, or JAX's name of the same
    precision (:data:`JAX_NAMES`: ``"highest"`` -> ``"float32"``, ``"tensorfloat32"`` -> ``"tf32"``), any case.

    Raises:
        ValueError: ``value`` names none of these (``"default"`` and ``"high"`` included: they depend on the
            backend); the message lists what is accepted.
    """
    if value is None:
        return None
    key = value.lower() if isinstance(value, str) else None
    if key in JAX_NAMES:
        return JAX_NAMES[key]
    if key not in MANTISSA:
        jax_names = ", ".join(f"{name!r} ({policy})" for name, policy in JAX_NAMES.items())
        raise ValueError(
            f"{fn}: matmul_precision={value!r} is not a matmul precision; pass None (what the backend uses), "
            f"{', '.join(repr(p) for p in POLICIES)}, or JAX's {jax_names} ('default' and 'high' depend on the "
            "backend: pass None, or the precision it computes)"
        )
    return key


def _platform_family(platform: str) -> str:
    platform = platform.lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def backend_policy(platform: str, precision=None, *, compute_capability: str | None = None) -> str:
    """The policy of a float32 matmul traced with ``precision`` and run on ``platform``.

    ``precision``: a ``dot_general``'s ``precision`` parameter (``None``, a ``lax.Precision`` or a pair of them,
    a ``lax.DotAlgorithmPreset`` or its name) or a ``jax_default_matmul_precision`` value (``"default"``,
    ``"high"``, ``"highest"``, ``"tensorfloat32"``, ``"bfloat16"``, ``"float32"``). ``"highest"`` computes in
    float32 everywhere; a CPU always does. A GPU's default and ``"high"`` are TF32 (Ampere and later, compute
    capability >= 8; an older GPU computes in float32); a TPU's default is one bfloat16 pass and its ``"high"``
    three (``bf16_3x``, about float32's first 16 mantissa bits: taken as TF32, the next coarser policy). Source:
    ``jax.lax.Precision``'s documentation.
    """
    family = _platform_family(platform)
    level = _level(precision)
    if family == "cpu" or level == "highest":
        return "float32"
    if family == "gpu":
        if compute_capability is not None and float(compute_capability) < 8:
            return "float32"
        return "bfloat16" if level == "bfloat16" else "tf32"
    if family == "tpu":
        return "tf32" if level == "high" else "bfloat16"
    return "float32"


def _level(precision) -> str:
    """``"default"``, ``"high"``, ``"highest"`` or ``"bfloat16"`` of a precision parameter or config value."""
    if precision is None:
        return "default"
    if isinstance(precision, tuple | list):
        levels = [_level(p) for p in precision]
        order = ("bfloat16", "default", "high", "highest")  # coarsest first
        return min(levels, key=order.index)
    name = getattr(precision, "name", str(precision)).upper()
    if name in ("HIGHEST", "FLOAT32", "F32_F32_F32", "F64_F64_F64") or name.startswith("F32_F32"):
        return "highest"
    if name in ("HIGH", "TENSORFLOAT32", "BFLOAT16_3X") or "TF32" in name or "X3" in name or "X6" in name:
        return "high"
    if name.startswith("F16_F16"):  # float16 operands: float16's 10 mantissa bits, as TF32's
        return "high"
    if "BF16" in name or "F8" in name or name == "BFLOAT16":  # float8 operands: taken as the coarsest policy
        return "bfloat16"
    return "default"


def nested_jaxprs(params) -> list:
    """The jaxprs nested in an equation's ``params`` (a ``jit``'s, a ``shard_map``'s body, a ``scan``'s, a
    ``cond``'s branches), each as a ``Jaxpr``."""
    out = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, core.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                out.append(v)
    return out


def matmul_precisions(jaxpr) -> list:
    """The ``precision`` parameter of every ``dot_general`` / ``conv_general_dilated`` in ``jaxpr`` (a
    ``Jaxpr`` or ``ClosedJaxpr``), nested jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MATMULS:
            found.append(eqn.params.get("precision"))
        for sub in nested_jaxprs(eqn.params):
            found.extend(matmul_precisions(sub))
    return found


def matmul_operand_dtypes(jaxpr) -> list:
    """The dtype of every floating operand of every ``dot_general`` / ``conv_general_dilated`` in ``jaxpr`` (a
    ``Jaxpr`` or ``ClosedJaxpr``), nested jaxprs included: what the matmuls compute in, whatever the layers
    declare (a model that casts its weights with ``astype(jnp.bfloat16)`` in its own code)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MATMULS:
            found += [
                v.aval.dtype
                for v in eqn.invars
                if jnp.issubdtype(getattr(v.aval, "dtype", None), jnp.floating)
            ]
        for sub in nested_jaxprs(eqn.params):
            found.extend(matmul_operand_dtypes(sub))
    return found


def step_policy(fun, args, platforms) -> str:
    """The coarsest policy of ``fun(*args)``'s matmuls on any of ``platforms`` (device platform names, with an
    optional ``compute_capability`` as ``(platform, capability)`` pairs): ``"float32"`` when it has none."""
    precisions = matmul_precisions(jax.make_jaxpr(fun)(*args)) or []
    policies = []
    for platform in platforms:
        platform, capability = platform if isinstance(platform, tuple) else (platform, None)
        policies += [backend_policy(platform, p, compute_capability=capability) for p in precisions]
    return coarsest(*policies)


def device_platform(device) -> tuple[str, str | None]:
    """``(platform, compute capability or None)`` of a JAX device."""
    return device.platform, getattr(device, "compute_capability", None)


# ------------------------------------------------------------------------------------------- rounded matmuls


def _round(x, mantissa: int | None):
    if mantissa is None or not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).nmant <= mantissa:
        return x
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=mantissa)


def _rounded_matmul(primitive, params: dict, mantissa: int | None):
    """``primitive`` (a dot or a convolution) at ``"highest"`` on operands rounded to ``mantissa`` bits; its
    gradient's matmuls round their operands (the cotangent and the saved, rounded operands) the same way."""
    params = dict(params, precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST))

    def bind(a, b):
        return primitive.bind(a, b, **params)

    if mantissa is None:
        return bind

    @jax.custom_vjp
    def matmul(a, b):
        return bind(_round(a, mantissa), _round(b, mantissa))

    def forward(a, b):
        a, b = _round(a, mantissa), _round(b, mantissa)
        return bind(a, b), (a, b)

    def backward(saved, cotangent):
        return jax.vjp(bind, *saved)[1](_round(cotangent, mantissa))

    matmul.defvjp(forward, backward)
    return matmul


def _has_matmul(jaxpr) -> bool:
    return any(
        eqn.primitive.name in _MATMULS or any(_has_matmul(s) for s in nested_jaxprs(eqn.params))
        for eqn in jaxpr.eqns
    )


def _evaluate(jaxpr, consts, args, mantissa):
    env = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        try:
            outs = _apply(eqn, [read(v) for v in eqn.invars], mantissa)
        except EmulationError:
            raise
        except Exception as err:  # named, with its policy and primitive: never a bare JAX message
            policy = next((p for p, m in MANTISSA.items() if m == mantissa), None)
            raise EmulationError(eqn.primitive.name, policy, err) from err
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _apply(eqn, invals, mantissa):
    name = eqn.primitive.name
    floating = all(jnp.issubdtype(v.dtype, jnp.floating) for v in invals[:2])
    if name in _MATMULS and floating:
        return _rounded_matmul(eqn.primitive, eqn.params, mantissa)(*invals)
    subs = nested_jaxprs(eqn.params)
    if not any(_has_matmul(s) for s in subs):
        return _bind(eqn.primitive, invals, eqn.params)
    if name in _INLINE:
        body = next(
            v for k, v in eqn.params.items() if k in ("jaxpr", "call_jaxpr", "fun_jaxpr") and v is not None
        )
        consts = body.consts if isinstance(body, core.ClosedJaxpr) else ()
        outs = _evaluate(getattr(body, "jaxpr", body), consts, invals, mantissa)
        return outs if eqn.primitive.multiple_results else outs[0]
    # a loop or a branch: its bodies rewritten, the primitive bound as it was
    return _bind(eqn.primitive, invals, {k: _rewritten(v, mantissa) for k, v in eqn.params.items()})


def _bind(primitive, invals, params):
    # as ``jax.core.eval_jaxpr`` binds an equation: a call-like primitive's bind parameters carry its functions
    # (``subfuns``: a custom_jvp_call's primal and rule) in place of its jaxprs, which ``bind`` does not take
    return primitive.bind(*invals, **primitive.get_bind_params(params))


def _rewritten(value, mantissa):
    if isinstance(value, tuple | list):
        return type(value)(_rewritten(v, mantissa) for v in value)
    if not isinstance(value, core.ClosedJaxpr) or not _has_matmul(value.jaxpr):
        return value
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in value.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: _evaluate(value.jaxpr, value.consts, a, mantissa))(*avals)


def rounded_matmuls(fun, policy: str | None):
    """``fun`` with every floating ``dot_general`` / ``conv_general_dilated`` computed at ``"highest"`` on
    operands rounded to ``policy``'s mantissa (``lax.reduce_precision(x, exponent_bits=8, mantissa_bits=m)``), in
    its gradient too; ``policy`` ``None`` or ``"float32"`` computes them at ``"highest"`` unrounded. A
    ``jax.custom_jvp`` / ``jax.custom_vjp`` function without a matmul inside keeps its rule (``jax.nn.relu``'s
    gradient is JAX's own, exactly); one around a matmul is differentiated through its primal function.

    On a CPU it emulates a GPU's TF32 matmuls (``"tf32"``: reproduces the H200's float32 2048^3 matmul error,
    2.946e-4 against 2.94e-4) or a TPU's one bfloat16 pass (``"bfloat16"``). Traceable; ``fun``'s arguments and
    result are pytrees of arrays. Operands of an integer matmul are left alone.

    Raises:
        EmulationError: an equation of ``fun`` could not be evaluated (its primitive and cause named).

    Example::

        >>> import jax.numpy as jnp
        >>> a = jnp.array([[1.0 + 2.0**-12]])
        >>> float(rounded_matmuls(jnp.matmul, "tf32")(a, a)[0, 0])
        1.0
    """
    mantissa = None if policy in (None, "float32") else MANTISSA[policy]

    def wrapped(*args):
        leaves, treedef = jax.tree.flatten(args)
        flat = jax.make_jaxpr(lambda *a: fun(*jax.tree.unflatten(treedef, a)), return_shape=True)
        closed, shapes = flat(*leaves)
        outs = _evaluate(closed.jaxpr, closed.consts, leaves, mantissa)
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return wrapped


@functools.cache  # one function per (loss, policy): the jitted steps that take it as a static argument reuse it
def rounded_loss(loss_fn, policy: str | None):
    """``loss_fn(model, batch)`` with its matmuls rounded to ``policy`` (:func:`rounded_matmuls`): a task's
    loss as a TF32 GPU (``"tf32"``) or a TPU (``"bfloat16"``) computes it, on any backend."""

    def rounded(model, batch):
        graphdef, state = nnx.split(model)
        return rounded_matmuls(lambda s, b: loss_fn(nnx.merge(graphdef, s), b), policy)(state, batch)

    return rounded


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def gradients_at(loss_fn, graphdef, params, rest, batch, policy: str | None):
    """``(loss, grads)``: the task's mean loss (0-d) and its gradient (a tree like ``params``) at ``params`` with
    every matmul at ``policy`` (:func:`rounded_matmuls`): a realization of the reference's loss and gradient
    under another matmul precision, in one program (the loss is the forward pass the gradient runs anyway)."""

    def terms(p):
        return loss_terms(rounded_loss(loss_fn, policy), nnx.merge(graphdef, p, rest, copy=True), batch)

    (total, weight), grads = jax.value_and_grad(terms, has_aux=True)(params)
    if weight is None:
        return total, grads
    return total / weight, jax.tree.map(lambda g: g / weight, grads)


def devices_of(model, mesh) -> set:
    """The devices a check's sides run on: where the model's arrays are, and the candidate's mesh (without one,
    the first device of the preferred platform, :func:`shardcheck.devices.preferred_platform`: the default
    device's, which the command line moves to ``cpu:0`` under ``--platform cpu`` on a GPU host)."""
    from shardcheck.devices import preferred_platform

    found = {
        d for leaf in jax.tree.leaves(nnx.state(model)) if isinstance(leaf, jax.Array) for d in leaf.devices()
    }
    found |= set(mesh.devices.flat) if mesh is not None else {jax.devices(preferred_platform())[0]}
    return found


def platforms_of(devices) -> set:
    """``{(platform, compute capability or None)}`` of ``devices``."""
    return {device_platform(d) for d in devices}


def backend_default(loss_fn, model, batch, platforms) -> str:
    """The coarsest policy of the task's gradient on ``platforms`` (:func:`step_policy`); on CPUs alone
    ``"float32"`` without tracing it."""
    if all(_platform_family(p) == "cpu" for p, _ in platforms):
        return "float32"
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grads(p):
        return jax.grad(lambda q: loss_terms(loss_fn, nnx.merge(graphdef, q, rest, copy=True), batch)[0])(p)

    return step_policy(grads, (params,), platforms)


def resolve(fn: str, requested, loss_fn, model, batch, mesh) -> tuple[str, str, str]:
    """A check's matmul policy, how it was chosen, and the policy of its reference's own realization.

    Returns ``(policy, source, realization)``: ``requested`` (validated) or the coarsest that the backends of the
    two sides use for the task's gradient (:func:`backend_default`); ``source``, ``"set by the caller"`` or
    ``"the backend's (gpu) for this step"``; ``realization``, the policy at which the harness recomputes the reference's
    gradient to measure the rounding (``shardcheck.parity.tolerance.allowances.step_bounds``): ``"float32"``
    (``"highest"``) where the reference's own backend already rounds at ``policy``, else ``policy`` (emulated by
    :func:`rounded_matmuls`).

    Raises:
        ValueError: ``requested`` names no policy (:func:`check_policy`).
    """
    requested = check_policy(fn, requested)
    ref_devices = devices_of(model, None)
    # without a mesh the candidate's devices are the reference's (the model's graph traversed once, #35)
    platforms = ref_platforms = platforms_of(ref_devices)
    if mesh is not None:
        platforms = ref_platforms | platforms_of(devices_of(model, mesh))
    ref_policy = backend_default(loss_fn, model, batch, ref_platforms)
    if requested is None:
        policy = backend_default(loss_fn, model, batch, platforms)
        names = "/".join(sorted({_platform_family(p) for p, _ in platforms}))
        source = f"the backend's ({names}) for this step"
    else:
        policy, source = requested, "set by the caller"
        if (
            MANTISSA[requested] < MANTISSA[ref_policy]
        ):  # trial 49: tf32 on a CPU loosened the tolerances silently
            own = (
                ref_policy
                if platforms == ref_platforms
                else backend_default(loss_fn, model, batch, platforms)
            )
            if MANTISSA[requested] < MANTISSA[own]:
                source = coarser_source(requested, own, platforms)
    return policy, source, "float32" if ref_policy == policy else policy


def coarser_source(requested: str, own: str, platforms) -> str:
    """The source of a stated policy coarser than the backends' own (``"set by the caller; coarser than the
    backend's own (float32 on cpu): the tolerances are tf32's"``): the report's and ``--json``'s words for why the
    tolerances are wider than the backend's computation needs. ``platforms``: ``{(platform, capability)}``."""
    names = "/".join(sorted({_platform_family(p) for p, _ in platforms}))
    return f"set by the caller; coarser than the backend's own ({own} on {names}): the tolerances are {requested}'s"
