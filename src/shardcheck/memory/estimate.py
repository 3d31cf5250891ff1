"""The memory estimate: bytes per device of every leaf of the training state, from shapes alone.

Every leaf is placed by the one rule of :mod:`shardcheck.memory.layouts` (the model's annotations, else the FSDP
rule, over the layout's categories) on a mesh: ``num_shards=S`` is the one-axis mesh ``{"fsdp": S}``, built as a
``jax.sharding.AbstractMesh`` (no devices). Its bytes per device are ``prod(shard_shape) * itemsize``.

Seed ``001_a85d1499a1a85057.txt`` gives the parameter-storage figure of a biased Linear, ``(D + 1) * K / S``
values times bytes per value, and warns that it is neither a peak-memory formula nor proof that a model fits:
it omits gradients, activations, optimizer buffers, gathered parameters and communication buffers. The estimate
reports that "even split" beside the real per-device layout, with the reason for any difference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from shardcheck.memory.layouts import (
    SHARDED_CATEGORIES,
    category_and_path,
    check_strategy,
    layout_shardings,
    one_device,
    placement_mesh,
)
from shardcheck.memory.state import CATEGORIES, _abstract, dtype_name, itemsize, training_state


@dataclasses.dataclass(frozen=True)
class LeafMemory:
    """Where one leaf of the training state lives, and what it costs on each device.

    Attributes:
        path: the path inside its category, spelled as every report spells a leaf (``"."``-joined,
            :func:`shardcheck._tree.path_str`), e.g. ``"kernel"``, ``"layers.0.bias"``, ``"0.mu.kernel"``.
        category: one of :data:`~shardcheck.memory.CATEGORIES`.
        shape: global shape.
        dtype: dtype name, e.g. ``"float32"``.
        spec: the ``PartitionSpec`` as text, ``"PartitionSpec()"`` when whole on every device.
        shard_shape: shape of the block one device holds (the global shape when replicated).
        sharded: whether the leaf is split over the devices.
        replicated_reason: why it is whole on every device (``""`` when sharded): one device, the layout
            replicates its category, an annotation says so, a scalar, or no dimension divides by the FSDP axis
            (``"no dimension of (6,) divides by S=4"`` on one axis of 4, ``"... by fsdp=4"`` on several axes).
        global_bytes: bytes of the whole leaf.
        per_device_bytes: ``prod(shard_shape) * itemsize``, bytes on each device.
        padded_bytes: padding bytes per device; always 0, because the placement rule replicates a leaf that
            does not divide rather than padding it (kept so padded layouts such as PyTorch FSDP's flat
            parameters can be compared).
        split_axes: the mesh axes the leaf is split over, in dimension order (``("fsdp",)``; ``()`` when whole).
            Its per-device bytes are the global bytes divided by the product of those axes' sizes.
    """

    path: str
    category: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    shard_shape: tuple[int, ...]
    sharded: bool
    replicated_reason: str
    global_bytes: int
    per_device_bytes: int
    padded_bytes: int = 0
    split_axes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of the training state under one strategy, by category, from shapes alone.

    Attributes:
        strategy: one of :data:`~shardcheck.memory.MESH_STRATEGIES`.
        num_shards: S, the number of devices of the mesh.
        num_devices: devices the strategy uses: 1 for ``"replicated"``, else S.
        param_count: number of parameter values (all leaves).
        params_bytes: parameter bytes per device.
        grads_bytes: gradient bytes per device (one gradient per parameter, same shape and dtype; transient
            during a step, counted because it is live at the update).
        optimizer_bytes: optax state bytes per device (momentum traces, Adam moments and counts, the
            ``optax.MultiSteps`` accumulator: whatever ``tx.init`` really returns).
        step_bytes: NNX's optimizer step counter, bytes per device (4: one uint32, replicated).
        persistent_bytes: ``params_bytes + model_state_bytes + optimizer_bytes + step_bytes``: the state that
            outlives a step, which :func:`~shardcheck.memory.measure_memory` reads back from the live arrays.
        total_bytes: ``persistent_bytes + grads_bytes``. Not a peak: activations, gathered parameters,
            communication buffers and dtype-conversion copies are not counted (seed 001).
        unsharded_total_bytes: ``total_bytes`` of the same state on one device.
        even_split_params_bytes: seed 001's figure: all parameter bytes divided evenly over S,
            ``(D + 1) * K / S`` values times bytes per value for a Linear (may be fractional).
        even_split_formula: that figure written out, e.g. ``"(512 + 1) * 512 / 4 * 4 B"``.
        even_split_note: how ``params_bytes`` differs from the even split, and why.
        leaves: every leaf of every category, in the order params, model_state, grads, optimizer, step.
        model_state_bytes: the model's variables other than ``nnx.Param`` (RNG stream keys and counts), bytes per
            device; 0 for a model of parameters only, and for a parameter pytree.
        mesh_shape: the mesh placed on, ``(("data", 2), ("fsdp", 4))``; ``(("fsdp", S),)`` for ``num_shards=S``.
    """

    strategy: str
    num_shards: int
    num_devices: int
    param_count: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    step_bytes: int
    persistent_bytes: int
    total_bytes: int
    unsharded_total_bytes: int
    even_split_params_bytes: float
    even_split_formula: str
    even_split_note: str
    leaves: tuple[LeafMemory, ...]
    model_state_bytes: int = 0
    mesh_shape: tuple[tuple[str, int], ...] = ()

    def bytes_by_category(self) -> dict[str, int]:
        """``{"params": ..., "model_state": ..., "grads": ..., "optimizer": ..., "step": ...}``, bytes per device."""
        return {
            "params": self.params_bytes,
            "model_state": self.model_state_bytes,
            "grads": self.grads_bytes,
            "optimizer": self.optimizer_bytes,
            "step": self.step_bytes,
        }


# ----------------------------------------------------------------------------------------------- leaves


def _whole_reason(strategy, category, var, shape, mesh, num_devices) -> str:
    """Why a leaf is whole on every device, in words."""
    from shardcheck.mesh import fsdp_axis

    if num_devices == 1:
        return "one device"
    if strategy == "placed":
        return "placed replicated"
    if category not in SHARDED_CATEGORIES.get(strategy, SHARDED_CATEGORIES["fsdp"]):
        return f"{strategy} replicates {category}"
    annotation = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
    if annotation:
        return f"annotated {tuple(annotation)}: replicated"
    if shape == ():
        return "scalar"
    axis = fsdp_axis(mesh)
    size = int(mesh.shape[axis])
    if strategy == "gspmd" and any(d % size == 0 for d in shape):
        return "not annotated: gspmd places the model's annotations alone"
    return f"no dimension of {shape} divides by " + (
        f"S={size}" if len(mesh.axis_names) == 1 else f"{axis}={size}"
    )


def _leaf(category, path, var, sharding, strategy, mesh, num_devices) -> LeafMemory:
    """The :class:`LeafMemory` of one leaf placed by ``sharding`` (whole when the layout uses one device)."""
    from shardcheck.steps.sharded import spec_axes

    value = var.get_value() if isinstance(var, nnx.Variable) else var
    shape = tuple(int(d) for d in value.shape)
    size = itemsize(value.dtype)
    shard_shape = tuple(int(d) for d in sharding.shard_shape(shape)) if num_devices > 1 else shape
    spec = getattr(sharding, "spec", None)
    sharded = shard_shape != shape
    if spec is None:
        text = repr(sharding)
    else:
        text = repr(spec if num_devices > 1 else PartitionSpec())
    return LeafMemory(
        path=path,
        category=category,
        shape=shape,
        dtype=dtype_name(value.dtype),
        spec=text,
        shard_shape=shard_shape,
        sharded=sharded,
        replicated_reason="" if sharded else _whole_reason(strategy, category, var, shape, mesh, num_devices),
        global_bytes=math.prod(shape) * size,
        per_device_bytes=math.prod(shard_shape) * size,
        split_axes=spec_axes(spec) if sharded and spec is not None else (),
    )


def placed_leaves(fn, model, optimizer, mesh, strategy) -> dict[str, list[LeafMemory]]:
    """Every leaf of ``(model, optimizer)`` and every gradient, by category, placed as ``strategy`` places it."""
    from shardcheck.steps.sharded import flat_leaves

    state_shardings, grad_shardings = layout_shardings(strategy, model, optimizer, mesh, fn=fn)
    num_devices = 1 if one_device(strategy) else mesh.size
    by_category = {c: [] for c in CATEGORIES}
    flat = flat_leaves(nnx.state((model, optimizer)))  # no MaskedNode: as the shardings
    for (path, var), sharding in zip(flat, state_shardings, strict=True):
        category, name = category_and_path(path, var)
        by_category[category].append(_leaf(category, name, var, sharding, strategy, mesh, num_devices))
    param_flat = flat_leaves(nnx.state(model, nnx.Param))
    for (path, var), sharding in zip(param_flat, grad_shardings, strict=True):
        name = ".".join(map(str, path))
        by_category["grads"].append(_leaf("grads", name, var, sharding, strategy, mesh, num_devices))
    if not by_category["params"]:
        raise ValueError(f"{fn}: the model has no nnx.Param; pass a model with at least one parameter")
    return by_category


# ------------------------------------------------------------------------------------- seed 001's even split


def _linear_dims(params) -> tuple[int, int] | None:
    """``(D, K)`` when ``params`` is exactly one biased Linear's ``{"kernel": (D, K), "bias": (K,)}``."""
    if not isinstance(params, Mapping) or set(params) != {"kernel", "bias"}:
        return None
    kernel, bias = params["kernel"], params["bias"]
    if len(kernel.shape) == 2 and tuple(bias.shape) == (kernel.shape[1],):
        return int(kernel.shape[0]), int(kernel.shape[1])
    return None


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"


def _above_even_split(param_leaves: list[LeafMemory], num_devices: int) -> list[str]:
    """What puts the parameter bytes per device above the even split: replicated shards, then whole leaves,
    the largest first (trial 54: a 96-byte LayerNorm scale was listed and an 8 KiB embedding left to "and 12
    more")."""
    whole = sorted((leaf for leaf in param_leaves if not leaf.sharded), key=lambda leaf: -leaf.global_bytes)
    parts = [
        f"{leaf.path} {leaf.shape} replicated ({leaf.replicated_reason}): "
        f"+{_fmt_bytes(leaf.global_bytes - leaf.global_bytes / num_devices)}"
        for leaf in whole
    ]
    # split leaves whose shards are themselves replicated (over the mesh axes they are not split over)
    copies = sum(
        leaf.per_device_bytes - leaf.global_bytes / num_devices
        for leaf in param_leaves
        if leaf.sharded and leaf.per_device_bytes * num_devices > leaf.global_bytes
    )
    if copies > 0:
        parts.insert(
            0,
            f"split leaves' shards replicated over the mesh axes they are not split over: +{_fmt_bytes(copies)}",
        )
    return parts


def _even_split(params, param_leaves: list[LeafMemory], strategy: str, num_devices: int):
    """Seed 001's even-split figure, its formula, and how the real parameter bytes per device differ."""
    count = sum(math.prod(leaf.shape) for leaf in param_leaves)
    itemsizes = {jnp.dtype(leaf.dtype).itemsize for leaf in param_leaves}
    even = sum(leaf.global_bytes for leaf in param_leaves) / num_devices
    size = f"{itemsizes.pop()} B" if len(itemsizes) == 1 else "bytes per value"
    dims = _linear_dims(params)
    if dims is not None:
        formula = f"({dims[0]} + 1) * {dims[1]} / {num_devices} * {size}"
    else:
        formula = f"{count} / {num_devices} * {size}"
    real = sum(leaf.per_device_bytes for leaf in param_leaves)
    if num_devices == 1:
        note = "one device: the even split is the whole model"
    elif "params" not in SHARDED_CATEGORIES.get(strategy, CATEGORIES):
        note = (
            f"{strategy} keeps every parameter on every device by design: {_fmt_bytes(real)} per device, "
            f"{num_devices}x the even split"
        )
    elif real == even:
        note = f"equal to the even split: every parameter leaf divides by S={num_devices}"
    else:
        parts = _above_even_split(param_leaves, num_devices)
        hidden = len(parts) - 4
        more = f"; and {hidden} more replicated leaves" if hidden > 0 else ""
        note = f"{_fmt_bytes(real - even)} per device above the even split: " + "; ".join(parts[:4]) + more
    return count, even, formula, note


def _estimate(strategy, num_shards, num_devices, params, by_category, mesh_shape=()) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of per-category leaves: the sums per device, and seed 001's even split."""
    sums = {c: sum(leaf.per_device_bytes for leaf in leaves) for c, leaves in by_category.items()}
    unsharded = sum(leaf.global_bytes for leaves in by_category.values() for leaf in leaves)
    count, even, formula, note = _even_split(params, by_category["params"], strategy, num_devices)
    persistent = sums["params"] + sums["model_state"] + sums["optimizer"] + sums["step"]
    return MemoryEstimate(
        strategy=strategy,
        num_shards=num_shards,
        num_devices=num_devices,
        param_count=count,
        params_bytes=sums["params"],
        grads_bytes=sums["grads"],
        optimizer_bytes=sums["optimizer"],
        step_bytes=sums["step"],
        persistent_bytes=persistent,
        total_bytes=persistent + sums["grads"],
        unsharded_total_bytes=unsharded,
        even_split_params_bytes=even,
        even_split_formula=formula,
        even_split_note=note,
        leaves=tuple(leaf for c in CATEGORIES for leaf in by_category[c]),
        model_state_bytes=sums["model_state"],
        mesh_shape=mesh_shape,
    )


# --------------------------------------------------------------------------------------------- the estimate


def estimate_memory(
    model_or_abstract_state,
    optimizer=None,
    *,
    num_shards: int | None = None,
    strategy: str,
    param_dtype=None,
    mesh=None,
) -> MemoryEstimate:
    """Bytes per device of parameters, gradients, optimizer state and step counter under one strategy.

    Works from shapes alone: a Task's model is traced by ``nnx.eval_shape`` and nothing is allocated, however
    large the model. The optimizer state is what optax really allocates, ``nnx.Optimizer(model, tx,
    wrt=nnx.Param)`` under ``nnx.eval_shape``: none for ``optax.sgd(lr)``, one parameter-sized trace for
    momentum, two moments and an int32 count for Adam, a float32 accumulator for ``optax.MultiSteps``
    (``docs/reduction_cases.md`` C9), NNX's uint32 step counter (4 bytes). Gradients have the parameters' shapes
    and dtypes. A module's variables other than ``nnx.Param`` (RNG stream keys and counts) are ``model_state``.

    Every leaf is placed as the strategy places it (:mod:`shardcheck.memory.layouts`): the model's
    ``nnx.with_partitioning`` annotations where it has them (its optimizer state inherits them), else the FSDP
    rule over the FSDP axis, on the categories the layout splits; ``"dp"`` replicates everything; ``"placed"``
    reads the real ``sharding`` of every array of an already placed ``(model, optimizer)``. ``num_shards=S`` is
    the one-axis mesh ``{"fsdp": S}``: ``estimate_memory(task, num_shards=4)`` equals ``estimate_memory(task,
    mesh={"fsdp": 4})``. A leaf's bytes per device are ``prod(shard_shape) * itemsize``.

    This is storage, not peak: activations, gathered parameters, communication buffers and dtype-conversion
    copies are not counted (seed 001); :func:`~shardcheck.memory.measure_memory` reads the compiled step's.

    Args:
        model_or_abstract_state: a :class:`~shardcheck.Task`; an ``nnx.Module`` (real or abstract); an
            ``nnx.State`` or a pytree of arrays / ``jax.ShapeDtypeStruct`` holding the parameters (no
            annotations: placed by the FSDP rule).
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"`` (:func:`shardcheck.optimizers.make_tx`), an optax
            ``GradientTransformation`` (``optax.MultiSteps`` too), or an ``nnx.Optimizer`` (its ``tx``; with
            ``"placed"``, its real state); ``None`` (and only ``None``) with a Task, whose own optimizer is used.
        num_shards: S >= 1: the mesh ``{"fsdp": S}`` (no devices needed); with ``mesh=`` it may be omitted (else
            it must equal the mesh's size).
        strategy: ``"replicated"``, ``"dp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"``, ``"gspmd"`` or ``"placed"``
            (:data:`~shardcheck.memory.MESH_STRATEGIES`).
        param_dtype: if given, a floating dtype (``"float32"``, ``"bfloat16"``, ...) to which every floating
            parameter is cast before counting; the optimizer state follows whatever ``tx.init`` makes of it.
        mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh`` of named axes, or axis sizes (``{"data": 2, "fsdp":
            4}``, built as an ``AbstractMesh``).

    Returns:
        A :class:`MemoryEstimate`, all figures in bytes per device.

    Raises:
        TypeError: ``num_shards`` not an int, neither it nor ``mesh`` given, ``mesh`` of another type;
            ``optimizer`` or ``model_or_abstract_state`` of the wrong type; an optimizer passed with a Task, or
            none without one; ``"placed"`` without ``mesh=`` or a real ``nnx.Optimizer``.
        ValueError: unknown ``strategy`` or optimizer name, ``num_shards < 1`` or other than the mesh's size,
            ``param_dtype`` not a floating dtype, no parameters, an annotation the mesh cannot honour
            (:func:`~shardcheck.steps.sharded.state_specs`), ``"placed"`` with abstract arrays.

    Example::

        >>> from flax import nnx
        >>> from shardcheck.models import make_model
        >>> model = nnx.eval_shape(lambda: make_model("linear", 512, 512))
        >>> est = estimate_memory(model, "adam", num_shards=4, strategy="fsdp")
        >>> est.params_bytes, est.optimizer_bytes  # (512 + 1) * 512 / 4 * 4 B; mu and nu; the int32 count
        (262656, 525316)
    """
    fn = "estimate_memory"
    check_strategy(fn, strategy)
    placed = strategy == "placed"
    if placed and mesh is None:
        raise TypeError(f"{fn}: strategy='placed' needs mesh=, the jax.sharding.Mesh the state is placed on")
    mesh = placement_mesh(fn, mesh, num_shards)
    model, opt = training_state(
        fn, model_or_abstract_state, optimizer, placed=placed, param_dtype=param_dtype
    )
    by_category = placed_leaves(fn, model, opt, mesh, strategy)
    params = _abstract(fn, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    mesh_shape = tuple((str(a), int(n)) for a, n in mesh.shape.items())
    num_devices = 1 if one_device(strategy) else mesh.size
    return _estimate(strategy, mesh.size, num_devices, params, by_category, mesh_shape)
