"""Memory per device under each sharding strategy: estimated from shapes, and measured from the compiled step.

The estimate counts the persistent training state leaf by leaf (parameters, the optimizer state that optax
really allocates, NNX's step counter) plus one gradient per parameter, and places every leaf with the same
rule the FSDP step uses (:func:`shardcheck.partitioning.fsdp_partition_spec`). The strategies are the ZeRO
stages of Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (2020):

============  ==========  =========  ==================
strategy      parameters  gradients  optimizer state
============  ==========  =========  ==================
replicated    full        full       full (one device)
dp            full        full       full (S devices)
zero1         full        full       1/S
zero2         full        1/S        1/S
fsdp          1/S         1/S        1/S (ZeRO-3)
============  ==========  =========  ==================

"1/S" means: split by :func:`~shardcheck.partitioning.fsdp_partition_spec`; a leaf none of whose dimensions
divides by S (a bias of width 3 on 4 devices, a scalar counter) stays whole on every device. The layouts come from
the registry of strategies (:data:`shardcheck.partitioning.LAYOUTS`): ``replicated``, ``dp`` and ``fsdp`` are
its placements ``"single"``, ``"replicated"`` and ``"fsdp"``, measured with the registered steps ``reference``,
``dp`` and ``fsdp``; ``zero1`` and ``zero2`` are memory-only.

Everything takes a :class:`~shardcheck.Task` too: ``estimate_memory(task, num_shards=S, strategy=...)`` reads the
shapes from ``nnx.eval_shape(task.model)`` and ``jax.eval_shape(task.optimizer.init, params)`` (nothing is
allocated), ``measure_memory(task, strategy=..., mesh=...)`` compiles the strategy's step of the task on its first
batch (the registry's ``jax.shard_map`` steps via :func:`shardcheck.steps.sharded.prepare` for dp and fsdp).

On a mesh of any axes, ``estimate_memory(task, mesh=mesh, strategy=...)`` places every leaf as the registry's
steps do (:func:`shardcheck.steps.sharded.state_specs`: the model's ``nnx.with_partitioning`` annotations, else
the FSDP rule over the ``fsdp`` axis), or as an already placed state really is (``strategy="placed"``);
``measure_memory(step, task, mesh)`` (:func:`measure_step`) measures any step, a user's own jitted step included;
:func:`shardcheck.ahead_of_time.compile_ahead_of_time` lowers and compiles the real step (:func:`lower_step`) on
``jax.ShapeDtypeStruct`` inputs with their target shardings (nothing allocated: a billion-parameter model is
sized over fake CPU devices), and
:func:`~shardcheck.ahead_of_time.largest_batch_that_fits` and :mod:`shardcheck.device_memory` compare it with a
device's memory.

Seed ``001_a85d1499a1a85057.txt`` gives the parameter-storage figure of a biased Linear, ``(D + 1) * K / S``
values times bytes per value, and warns that it is neither a peak-memory formula nor proof that a model fits:
it omits gradients, activations, optimizer buffers, gathered parameters and communication buffers. The
estimate reports that "even split" beside the real per-device layout; :func:`measure_memory` compiles the real
step and reads XLA's own per-device figures, so the two can be compared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate
from shardcheck._tree import path_str
from shardcheck.mesh import check_mesh
from shardcheck.optimizers import OPTIMIZERS, make_tx
from shardcheck.partitioning import LAYOUTS, STRATEGIES, fsdp_partition_spec
from shardcheck.task import Task

PyTree = Any

CATEGORIES = ("params", "model_state", "grads", "optimizer", "step")
"""The categories of :class:`LeafMemory`: parameters, the model's other variables (RNG stream keys and counts;
none for most models), gradients, optax state, NNX's optimizer step counter."""

SHARDED_CATEGORIES = {name: layout.splits for name, layout in LAYOUTS.items()}
"""Which categories each strategy splits over the mesh axis (ZeRO stages 1, 2, 3; Rajbhandari et al. 2020)."""

DTYPES = ("float32", "bfloat16")
"""The parameter dtypes the CLI offers; :func:`estimate_memory` takes any floating dtype."""

STEP_COUNTER = jax.ShapeDtypeStruct((), jnp.uint32)
"""``nnx.Optimizer.step``: one uint32 scalar (4 bytes), replicated under every strategy."""


@dataclasses.dataclass(frozen=True)
class LeafMemory:
    """Where one leaf of the training state lives, and what it costs on each device.

    Attributes:
        path: ``"/"``-joined path inside its category, e.g. ``"kernel"``, ``"layers/0/bias"``,
            ``"0/mu/kernel"``.
        category: one of :data:`CATEGORIES`.
        shape: global shape.
        dtype: dtype name, e.g. ``"float32"``.
        spec: the ``PartitionSpec`` as text, ``"P()"`` when whole on every device.
        shard_shape: shape of the block one device holds (the global shape when replicated).
        sharded: whether the leaf is split over the devices.
        replicated_reason: why it is whole on every device (``""`` when sharded): the strategy replicates its
            category, or no dimension divides by S, or it is a scalar.
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
        strategy: one of :data:`shardcheck.partitioning.STRATEGIES`.
        num_shards: S, the mesh axis size asked for.
        num_devices: devices the strategy uses: 1 for ``"replicated"``, else S.
        param_count: number of parameter values (all leaves).
        params_bytes: parameter bytes per device.
        grads_bytes: gradient bytes per device (one gradient per parameter, same shape and dtype; transient
            during a step, counted because it is live at the update).
        optimizer_bytes: optax state bytes per device (momentum traces, Adam moments and counts, the
            ``optax.MultiSteps`` accumulator: whatever ``tx.init`` really returns).
        step_bytes: NNX's optimizer step counter, bytes per device (4: one uint32, replicated).
        persistent_bytes: ``params_bytes + model_state_bytes + optimizer_bytes + step_bytes``: the state that
            outlives a step, which :func:`measure_memory` reads back from the live arrays.
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
        mesh_shape: ``(("data", 2), ("fsdp", 4))``: the mesh of the ``mesh=`` form; ``()`` for ``num_shards=``.
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


def _is_array_like(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _abstract(fn: str, tree: PyTree) -> PyTree:
    """``tree`` with every leaf a ``jax.ShapeDtypeStruct``; refuses non-array leaves."""

    def one(path, leaf):
        if isinstance(leaf, nnx.Variable):
            leaf = leaf.get_value()
        if not _is_array_like(leaf):
            raise TypeError(
                f"{fn}: model_or_abstract_state leaf {path_str(path, '/') or '<root>'} is {type(leaf).__name__}, "
                "not an array; pass an nnx.Module, or a pytree of arrays / jax.ShapeDtypeStruct"
            )
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_params(fn: str, model_or_abstract_state, param_dtype=None) -> dict:
    """The parameters as a pure pytree of ``jax.ShapeDtypeStruct``; floating leaves cast to ``param_dtype``.

    Raises:
        TypeError: an unsupported container or a non-array leaf.
        ValueError: no parameters; ``param_dtype`` not floating.
    """
    src = model_or_abstract_state
    if isinstance(src, nnx.Module):
        tree = nnx.to_pure_dict(nnx.state(src, nnx.Param))
    elif isinstance(src, nnx.State):
        tree = nnx.to_pure_dict(src)
    elif isinstance(src, Mapping | list | tuple) or _is_array_like(src):
        tree = src
    else:
        raise TypeError(
            f"{fn}: model_or_abstract_state must be an nnx.Module (real or from nnx.eval_shape), an "
            f"nnx.State, or a pytree of arrays / jax.ShapeDtypeStruct, got {type(src).__name__}"
        )
    tree = _abstract(fn, tree)
    if not jax.tree.leaves(tree):
        raise ValueError(
            f"{fn}: model_or_abstract_state has no parameters; pass a model with at least one nnx.Param"
        )
    if param_dtype is not None:
        dtype = check_param_dtype(fn, param_dtype)
        tree = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s,
            tree,
        )
    return tree


def check_param_dtype(fn: str, param_dtype) -> np.dtype:
    """``param_dtype`` must name a floating dtype (``"float32"``, ``"bfloat16"``, ``jnp.float16``, ...)."""
    try:
        dtype = jnp.dtype(param_dtype)
    except TypeError as err:
        raise ValueError(
            f"{fn}: param_dtype={param_dtype!r} is not a dtype; use a floating dtype such as "
            f"{' or '.join(repr(d) for d in DTYPES)}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{fn}: param_dtype={param_dtype!r} is not a floating dtype; parameters are trained in floating "
            f"point: use {' or '.join(repr(d) for d in DTYPES)}"
        )
    return dtype


def check_strategy(fn: str, strategy) -> str:
    """``strategy`` must be one of :data:`shardcheck.partitioning.STRATEGIES`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
    return strategy


def optimizer_transform(fn: str, optimizer) -> optax.GradientTransformation:
    """The optax transformation behind ``optimizer``: a name, a transformation, or an ``nnx.Optimizer``."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"{fn}: optimizer={optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}, or pass an "
                "optax GradientTransformation"
            )
        return make_tx(optimizer)
    if isinstance(optimizer, nnx.Optimizer):
        return optimizer.tx
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return optimizer
    raise TypeError(
        f"{fn}: optimizer must be a name ({', '.join(OPTIMIZERS)}), an optax GradientTransformation or an "
        f"nnx.Optimizer, got {type(optimizer).__name__}"
    )


def _itemsize(dtype) -> int:
    """Bytes per element; an extended dtype (a PRNG key, ``key<fry>``) reports its own (8 for threefry)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(dtype.itemsize)
    return int(jnp.dtype(dtype).itemsize)


def _dtype_name(dtype) -> str:
    return str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype).name


def _leaf(category: str, path: str, s: jax.ShapeDtypeStruct, num_devices: int, strategy: str) -> LeafMemory:
    shape = tuple(int(d) for d in s.shape)
    itemsize = _itemsize(s.dtype)
    global_bytes = math.prod(shape) * itemsize
    wants_split = category in SHARDED_CATEGORIES[strategy] and num_devices > 1
    spec = fsdp_partition_spec(shape, num_devices) if wants_split else jax.sharding.PartitionSpec()
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    shard_shape = tuple(d if axis is None else d // num_devices for d, axis in zip(shape, axes, strict=True))
    sharded = any(axis is not None for axis in spec)
    if sharded:
        reason = ""
    elif num_devices == 1:
        reason = "one device"
    elif not wants_split:
        reason = f"{strategy} replicates {category}"
    elif shape == ():
        reason = "scalar"
    else:
        reason = f"no dimension of {shape} divides by S={num_devices}"
    return LeafMemory(
        path=path,
        category=category,
        shape=shape,
        dtype=_dtype_name(s.dtype),
        spec=repr(spec),
        shard_shape=shard_shape,
        sharded=sharded,
        replicated_reason=reason,
        global_bytes=global_bytes,
        per_device_bytes=math.prod(shard_shape) * itemsize,
    )


def _leaves(category: str, tree: PyTree, num_devices: int, strategy: str) -> list[LeafMemory]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [_leaf(category, path_str(path, "/"), s, num_devices, strategy) for path, s in flat]


def _linear_dims(params: PyTree) -> tuple[int, int] | None:
    """``(D, K)`` when ``params`` is exactly one biased Linear's ``{"kernel": (D, K), "bias": (K,)}``."""
    if not isinstance(params, Mapping) or set(params) != {"kernel", "bias"}:
        return None
    kernel, bias = params["kernel"], params["bias"]
    if len(kernel.shape) == 2 and tuple(bias.shape) == (kernel.shape[1],):
        return int(kernel.shape[0]), int(kernel.shape[1])
    return None


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"


def _even_split(params: PyTree, param_leaves: list[LeafMemory], strategy: str, num_devices: int):
    """Seed 001's even-split figure, its formula, and how the real parameter bytes per device differ."""
    count = sum(math.prod(leaf.shape) for leaf in param_leaves)
    itemsizes = {jnp.dtype(leaf.dtype).itemsize for leaf in param_leaves}
    global_bytes = sum(leaf.global_bytes for leaf in param_leaves)
    even = global_bytes / num_devices
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
        whole = [leaf for leaf in param_leaves if not leaf.sharded]
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
        hidden = len(parts) - 4
        more = f"; and {hidden} more replicated leaves" if hidden > 0 else ""
        note = f"{_fmt_bytes(real - even)} per device above the even split: " + "; ".join(parts[:4]) + more
    return count, even, formula, note


def abstract_task_model(fn: str, task: Task) -> nnx.Module:
    """The task's model under ``nnx.eval_shape``: every variable a ``jax.ShapeDtypeStruct``, nothing allocated.

    Raises:
        TypeError: the factory needs arguments or returns something other than an ``nnx.Module``.
    """
    return nnx.eval_shape(lambda: task.new_model(fn))


def abstract_model_state(model: nnx.Module) -> dict:
    """The model's variables other than ``nnx.Param`` (RNG keys and counts) as ``jax.ShapeDtypeStruct``."""
    return _abstract("estimate_memory", nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))


def estimate_memory(
    model_or_abstract_state,
    optimizer=None,
    *,
    num_shards: int | None = None,
    strategy: str,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
) -> MemoryEstimate:
    """Bytes per device of parameters, gradients, optimizer state and step counter under one strategy.

    Works from shapes alone: pass ``nnx.eval_shape(lambda: make_model(...))`` and nothing is allocated,
    however large the model. The optimizer state is what optax really allocates, read from
    ``jax.eval_shape(tx.init, params)``: none for ``optax.sgd(lr)``, one parameter-sized trace for momentum,
    two moments and an int32 count for Adam, a float32 accumulator for ``optax.MultiSteps``
    (``docs/reduction_cases.md`` C9). NNX's ``nnx.Optimizer.step`` adds one uint32 (4 bytes). Gradients have the
    parameters' shapes and dtypes. A module's variables other than ``nnx.Param`` (RNG stream keys and counts)
    are counted as ``model_state``, placed like the parameters.

    The task form, ``estimate_memory(task, num_shards=S, strategy=...)``, sizes a :class:`~shardcheck.Task`:
    the model is ``nnx.eval_shape(task.model)`` (the factory is traced, no parameter is allocated) and the
    optimizer ``task.optimizer``, so the figures are those of the task's own step (``nnx.Optimizer(model,
    task.optimizer, wrt=nnx.Param)``).

    Each leaf is placed with :func:`~shardcheck.partitioning.fsdp_partition_spec` when its category is split
    under ``strategy`` (see the module docstring's table, after ZeRO, Rajbhandari et al. 2020), and its
    per-device bytes are ``prod(shard_shape) * itemsize``. Seed ``001_a85d1499a1a85057.txt``'s "even split",
    ``(D + 1) * K / S * bytes`` for a Linear, is reported beside the real parameter bytes with the reason for
    any difference (a bias whose width does not divide by S stays whole on every device).

    This is storage, not peak: activations, gathered parameters, communication buffers and dtype-conversion
    copies are not counted (seed 001); :func:`measure_memory` reads the compiled step's real figures.

    Args:
        model_or_abstract_state: a :class:`~shardcheck.Task`; an ``nnx.Module`` (real or abstract; its
            ``nnx.Param`` leaves are the parameters, its other variables the model state), an ``nnx.State``,
            or a pytree of arrays / ``jax.ShapeDtypeStruct`` holding the parameters.
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"`` (:func:`shardcheck.optimizers.make_tx`), an optax
            ``GradientTransformation`` (``optax.MultiSteps`` too), or an ``nnx.Optimizer`` (its ``tx``);
            ``None`` (and only ``None``) with a Task, whose own optimizer is used.
        num_shards: S >= 1, the size of the mesh axis (ignored by ``"replicated"``, which uses one device).
            With ``mesh=`` it may be omitted (else it must equal ``mesh.size``).
        strategy: ``"replicated"``, ``"dp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``
            (:data:`shardcheck.partitioning.STRATEGIES`); with ``mesh=`` also ``"gspmd"`` and ``"placed"``
            (:data:`MESH_STRATEGIES`).
        param_dtype: if given, a floating dtype (``"float32"``, ``"bfloat16"``, ...) to which every floating
            parameter is cast before counting; the optimizer state follows whatever ``tx.init`` makes of it.
            Not with ``mesh=``.
        mesh: a ``jax.sharding.Mesh`` of one or more named axes (:func:`shardcheck.mesh.make_mesh`). Then every
            leaf is placed as the registry's steps place it on that mesh
            (:func:`shardcheck.steps.sharded.state_specs`): the model's ``nnx.with_partitioning`` annotations
            where it has them (its optimizer state inherits them), else the FSDP rule over the FSDP axis
            (:func:`shardcheck.mesh.fsdp_axis`); ``"dp"`` replicates everything; ``"zero1"`` / ``"zero2"`` split
            only their categories; ``"placed"`` reads the real ``sharding`` of every array of an already placed
            ``(model, optimizer)`` (pass the real ``nnx.Optimizer``). A leaf's bytes per device are its global
            bytes divided by the product of the sizes of the axes it is split over (replicated: in full).
            The model must be an ``nnx.Module`` or a Task (not a parameter pytree).

    Returns:
        A :class:`MemoryEstimate`, all figures in bytes per device.

    Raises:
        TypeError: ``num_shards`` not an int; ``optimizer`` or ``model_or_abstract_state`` of the wrong type;
            an optimizer passed with a Task, or none without one; a task whose factory does not build an
            ``nnx.Module``.
        ValueError: unknown ``strategy`` or optimizer name, ``num_shards < 1``, ``param_dtype`` not a floating
            dtype, no parameters; with ``mesh=``: ``num_shards`` other than ``mesh.size``, an annotation the mesh
            cannot honour (:func:`~shardcheck.steps.sharded.state_specs`), ``"placed"`` with abstract arrays.

    Example::

        >>> from flax import nnx
        >>> from shardcheck.models import make_model
        >>> model = nnx.eval_shape(lambda: make_model("linear", 512, 512))
        >>> est = estimate_memory(model, "adam", num_shards=4, strategy="fsdp")
        >>> est.params_bytes, est.optimizer_bytes  # (512 + 1) * 512 / 4 * 4 B; mu and nu; the int32 count
        (262656, 525316)
    """
    fn = "estimate_memory"
    if mesh is not None:
        return _estimate_on_mesh(
            fn, model_or_abstract_state, optimizer, mesh, strategy, num_shards, param_dtype
        )
    if num_shards is None:
        raise TypeError(
            f"{fn}: pass mesh= (a jax.sharding.Mesh, e.g. shardcheck.make_mesh({{'data': 2, 'fsdp': 4}})) or "
            "num_shards=S (one axis of S devices)"
        )
    check_strategy(fn, strategy)
    num_shards = _validate.check_num_shards(fn, num_shards)
    source = model_or_abstract_state
    if isinstance(source, Task):
        if optimizer is not None:
            raise TypeError(
                f"{fn}: with a Task pass no optimizer (got {type(optimizer).__name__}); the task's own "
                "task.optimizer is the one its step uses"
            )
        optimizer = source.optimizer
        source = abstract_task_model(fn, source)
    elif optimizer is None:
        raise TypeError(
            f"{fn}: optimizer is missing; pass a name ({', '.join(OPTIMIZERS)}), an optax GradientTransformation or "
            "an nnx.Optimizer, or pass a shardcheck.Task, which carries its own"
        )
    tx = optimizer_transform(fn, optimizer)
    params = abstract_params(fn, source, param_dtype)
    model_state = abstract_model_state(source) if isinstance(source, nnx.Module) else {}
    opt_state = jax.eval_shape(tx.init, params)
    num_devices = 1 if LAYOUTS[strategy].one_device else num_shards

    by_category = {
        "params": _leaves("params", params, num_devices, strategy),
        "model_state": _leaves("model_state", model_state, num_devices, strategy),
        "grads": _leaves("grads", params, num_devices, strategy),
        "optimizer": _leaves("optimizer", opt_state, num_devices, strategy),
        "step": _leaves("step", {"step": STEP_COUNTER}, num_devices, strategy),
    }
    return _estimate(strategy, num_shards, num_devices, params, by_category)


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


# ------------------------------------------------------------------------------------------- on a mesh

MESH_STRATEGIES = (*STRATEGIES, "gspmd", "placed")
"""The strategies of the ``mesh=`` form: the memory layouts, the registry's ``gspmd`` (placed like ``fsdp``), and
``"placed"``: the real shardings of an already placed state."""


def abstract_training_state(fn: str, task: Task) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)`` of a task under ``nnx.eval_shape``: shapes, dtypes and annotations, nothing allocated.

    The pair is ``task.new_model()`` and ``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)`` traced by
    ``nnx.eval_shape`` (the optimizer state is ``task.optimizer.init`` of the abstract parameters, and inherits
    their sharding annotations), built under ``nnx.use_eager_sharding(False)`` so that an annotated model needs
    no mesh in context.
    """

    def build():
        model = task.new_model(fn)
        return model, task.new_optimizer(model)

    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


def _training_state(fn: str, source, optimizer, strategy: str):
    """The ``(model, optimizer)`` pair the ``mesh=`` form sizes: abstract for a Task or a transformation."""
    if isinstance(source, Task):
        if optimizer is not None:
            raise TypeError(
                f"{fn}: with a Task pass no optimizer (got {type(optimizer).__name__}); the task's own "
                "task.optimizer is the one its step uses"
            )
        return abstract_training_state(fn, source)
    if not isinstance(source, nnx.Module):
        raise TypeError(
            f"{fn}: with mesh= pass a shardcheck.Task or an nnx.Module (real or from nnx.eval_shape), got "
            f"{type(source).__name__}"
        )
    if isinstance(optimizer, nnx.Optimizer):
        return source, optimizer
    if strategy == "placed":
        raise TypeError(
            f"{fn}: strategy='placed' reads the shardings of the real arrays: pass the model and its "
            "nnx.Optimizer after they were placed (e.g. after one step), not an optimizer name or transformation"
        )
    if optimizer is None:
        raise TypeError(
            f"{fn}: optimizer is missing; pass a name, an optax transformation or an nnx.Optimizer"
        )
    tx = optimizer_transform(fn, optimizer)
    with nnx.use_eager_sharding(False):
        return source, nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), source)


def _category_and_path(path, var) -> tuple[str, str]:
    """``(category, path inside it)`` of a leaf of ``nnx.to_flat_state(nnx.state((model, optimizer)))``."""
    keys = tuple(str(k) for k in path)
    if keys[0] == "0":
        return ("params" if isinstance(var, nnx.Param) else "model_state"), "/".join(keys[1:])
    if keys[1] == "step":
        return "step", "/".join(keys[1:])
    return "optimizer", "/".join(keys[2:] if keys[1] == "opt_state" else keys[1:])


def layout_shardings(
    strategy: str, model, optimizer, mesh: jax.sharding.Mesh, *, fn: str = "layout_shardings"
) -> tuple[list, list]:
    """The sharding of every ``(model, optimizer)`` state leaf and of every gradient under ``strategy`` on ``mesh``.

    ``"replicated"`` and ``"dp"``: everything replicated; ``"fsdp"`` / ``"gspmd"``: the specs of
    :func:`shardcheck.steps.sharded.state_specs` (annotations, else the FSDP rule); ``"zero1"`` / ``"zero2"``:
    those specs for the categories the layout splits (:data:`SHARDED_CATEGORIES`), replicated otherwise;
    ``"placed"``: each array's own ``sharding`` (a gradient takes its parameter's).

    Returns:
        ``(state_shardings, grad_shardings)``: one sharding per leaf of
        ``jax.tree.leaves(nnx.state((model, optimizer)))`` and one per leaf of
        ``jax.tree.leaves(nnx.state(model, nnx.Param))``.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    from shardcheck.steps.sharded import state_specs

    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    is_param = [isinstance(var, nnx.Param) and str(path[0]) == "0" for path, var in flat]
    if strategy == "placed":
        shardings = []
        for path, var in flat:
            value = var.get_value()
            if not isinstance(value, jax.Array):
                raise ValueError(
                    f"{fn}: strategy='placed' needs real placed arrays, but leaf {'/'.join(map(str, path))} is "
                    f"{type(value).__name__}; place the state first (run one step), or use strategy='fsdp'"
                )
            shardings.append(value.sharding)
        return shardings, [s for s, p in zip(shardings, is_param, strict=True) if p]
    placement = "dp" if strategy in ("replicated", "dp") else "fsdp"
    specs, param_specs = state_specs(placement, model, optimizer, mesh, fn=fn)
    splits = SHARDED_CATEGORIES.get(strategy, frozenset(CATEGORIES))
    whole = PartitionSpec()
    state = [
        NamedSharding(mesh, spec if _category_and_path(path, var)[0] in splits else whole)
        for (path, var), spec in zip(flat, specs, strict=True)
    ]
    grads = [NamedSharding(mesh, spec if "grads" in splits else whole) for spec in param_specs]
    return state, grads


def _whole_reason(strategy, category, var, shape, mesh, num_devices) -> str:
    """Why a leaf is whole on every device, in words."""
    from shardcheck.mesh import fsdp_axis

    if num_devices == 1:
        return "one device"
    if strategy == "placed":
        return "placed replicated"
    if category not in SHARDED_CATEGORIES.get(strategy, frozenset(CATEGORIES)):
        return f"{strategy} replicates {category}"
    annotation = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
    if annotation:
        return f"annotated {tuple(annotation)}: replicated"
    if shape == ():
        return "scalar"
    axis = fsdp_axis(mesh)
    return f"no dimension of {shape} divides by {axis}={int(mesh.shape[axis])}"


def _mesh_leaf(category, path, var, sharding, strategy, mesh, num_devices) -> LeafMemory:
    from shardcheck.steps.sharded import spec_axes

    value = var.get_value() if isinstance(var, nnx.Variable) else var
    shape = tuple(int(d) for d in value.shape)
    itemsize = _itemsize(value.dtype)
    shard_shape = tuple(int(d) for d in sharding.shard_shape(shape)) if num_devices > 1 else shape
    spec = getattr(sharding, "spec", None)
    axes = spec_axes(spec) if spec is not None and num_devices > 1 else ()
    sharded = shard_shape != shape
    return LeafMemory(
        path=path,
        category=category,
        shape=shape,
        dtype=_dtype_name(value.dtype),
        spec=repr(spec if num_devices > 1 else jax.sharding.PartitionSpec())
        if spec is not None
        else repr(sharding),
        shard_shape=shard_shape,
        sharded=sharded,
        replicated_reason="" if sharded else _whole_reason(strategy, category, var, shape, mesh, num_devices),
        global_bytes=math.prod(shape) * itemsize,
        per_device_bytes=math.prod(shard_shape) * itemsize,
        split_axes=axes if sharded else (),
    )


def _estimate_on_mesh(fn, source, optimizer, mesh, strategy, num_shards, param_dtype) -> MemoryEstimate:
    """:func:`estimate_memory`'s ``mesh=`` form (see there)."""
    check_mesh(fn, mesh)
    if strategy not in MESH_STRATEGIES:
        raise ValueError(f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(MESH_STRATEGIES)}")
    if num_shards is not None and num_shards != mesh.size:
        raise ValueError(
            f"{fn}: num_shards={num_shards} but the mesh has {mesh.size} devices; pass only mesh= (the batch is "
            "split over every device of the mesh)"
        )
    if param_dtype is not None:
        raise ValueError(
            f"{fn}: param_dtype= applies to the num_shards= form; with mesh= the model's own dtypes are counted "
            "(build the model in the dtype you mean)"
        )
    model, opt = _training_state(fn, source, optimizer, strategy)
    state_shardings, grad_shardings = layout_shardings(strategy, model, opt, mesh, fn=fn)
    num_devices = 1 if strategy == "replicated" else mesh.size
    by_category = {c: [] for c in CATEGORIES}
    flat = nnx.to_flat_state(nnx.state((model, opt)))
    for (path, var), sharding in zip(flat, state_shardings, strict=True):
        category, name = _category_and_path(path, var)
        by_category[category].append(_mesh_leaf(category, name, var, sharding, strategy, mesh, num_devices))
    param_flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for (path, var), sharding in zip(param_flat, grad_shardings, strict=True):
        name = "/".join(map(str, path))
        by_category["grads"].append(_mesh_leaf("grads", name, var, sharding, strategy, mesh, num_devices))
    if not by_category["params"]:
        raise ValueError(f"{fn}: the model has no nnx.Param; pass a model with at least one parameter")
    params = _abstract(fn, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    mesh_shape = tuple((str(a), int(n)) for a, n in mesh.shape.items())
    return _estimate(strategy, mesh.size, num_devices, params, by_category, mesh_shape)


@dataclasses.dataclass(frozen=True)
class MemoryMeasurement:
    """What one compiled step of a strategy really uses per device, beside the estimate.

    XLA's figures come from ``jax.stages.Compiled.memory_analysis()`` (``CompiledMemoryStats``) of the
    SPMD-partitioned executable, so they are per device. The live-state figures add up
    ``shard.data.nbytes`` over ``array.addressable_shards`` of every model and optimizer array after one real
    step.

    Attributes:
        strategy: one of :data:`shardcheck.partitioning.STRATEGIES`.
        num_devices: devices of the mesh the step ran on (1 for ``"replicated"``).
        argument_bytes: XLA ``argument_size_in_bytes``: every input buffer of one device (state and data).
        output_bytes: XLA ``output_size_in_bytes`` (new state, the loss, and XLA's tuple index tables).
        alias_bytes: XLA ``alias_size_in_bytes``: outputs written into donated inputs (0 without donation).
        temp_bytes: XLA ``temp_size_in_bytes``: scratch buffers (gradients, activations, gathered parameters).
        generated_code_bytes: XLA ``generated_code_size_in_bytes``.
        peak_bytes: ``argument_bytes + output_bytes - alias_bytes + temp_bytes``, an upper bound of the live
            bytes of one device during the step (XLA's own ``peak_memory_in_bytes`` omits temp on CPU).
        reported_peak_bytes: XLA's ``peak_memory_in_bytes`` as reported, or -1 where not available.
        data_argument_bytes: bytes of this device's blocks of ``x`` and ``y`` (of every leaf of a task's batch)
            among the arguments.
        state_argument_bytes: ``argument_bytes - data_argument_bytes``: the model and optimizer state
            passed in.
        state_bytes_per_device: live state bytes on each device of the mesh, in mesh order, after one step.
        state_bytes: the largest of ``state_bytes_per_device``.
        estimated_persistent_bytes: :attr:`MemoryEstimate.persistent_bytes` for the same strategy and S.
        accuracy_ratio: ``estimated_persistent_bytes / state_bytes`` (1.0: the estimate is exact).
    """

    strategy: str
    num_devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    reported_peak_bytes: int
    data_argument_bytes: int
    state_argument_bytes: int
    state_bytes_per_device: tuple[int, ...]
    state_bytes: int
    estimated_persistent_bytes: int
    accuracy_ratio: float

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict (tuples as lists)."""
        out = dataclasses.asdict(self)
        out["state_bytes_per_device"] = list(self.state_bytes_per_device)
        return out


def _mean_loss(loss_fn):
    """``(model, batch) -> loss_sum / weight`` of a task's loss (the scalar itself for a scalar loss)."""
    from shardcheck.task import loss_terms

    def mean(model, batch):
        total, weight = loss_terms(loss_fn, model, batch)
        return total if weight is None else total / weight

    return mean


def _gspmd_step(graphdef, treedef, loss_fn, state_shardings, grad_shardings, data_sharding, mesh):
    """The jitted step of zero1 / zero2 for ``loss_fn(model, batch)``, partitioned by GSPMD.

    ``(state_leaves, batch) -> (loss, state_leaves)``: the state enters and leaves with ``state_shardings`` and
    is donated, as in the ``shard_map`` steps of :mod:`shardcheck.steps.sharded`; the gradients are constrained
    to ``grad_shardings`` (zero2: each device keeps its slice of the reduced gradient; zero1: replicated); the
    batch is split over every mesh axis (``data_sharding``).
    """
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    mean = _mean_loss(loss_fn)

    def step(leaves, batch):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        loss, grads = nnx.value_and_grad(mean)(model, batch)
        flat, grad_def = jax.tree.flatten(grads)
        flat = [jax.lax.with_sharding_constraint(g, s) for g, s in zip(flat, grad_shardings, strict=True)]
        optimizer.update(model, jax.tree.unflatten(grad_def, flat))
        return loss, jax.tree.leaves(nnx.state((model, optimizer)))

    return jax.jit(
        step,
        in_shardings=(list(state_shardings), data_sharding),
        out_shardings=(replicated, list(state_shardings)),
        donate_argnums=0,
    )


def _data_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """The batch's sharding: the leading dimension split over every axis (:func:`shardcheck.mesh.batch_axes`)."""
    from shardcheck.mesh import batch_axes

    axes = batch_axes(mesh)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes if len(axes) > 1 else axes[0]))


def _argument(a, sharding):
    """A ``jax.ShapeDtypeStruct`` with ``sharding`` for an abstract leaf; a real leaf copied onto ``sharding``."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.device_put(
        jnp.copy(a), sharding
    )  # copied: the steps donate their state, the caller's survives


def lower_step(strategy: str, loss_fn, model, optimizer, batch, mesh: jax.sharding.Mesh):
    """Lower the registry's step of ``strategy`` for this state and batch: real arrays or abstract shapes alike.

    ``"replicated"`` is the reference step (:func:`shardcheck.steps.reference.reference_step`'s jitted body) on
    the mesh's first device; ``"dp"``, ``"fsdp"`` and ``"gspmd"`` the registry's steps
    (:func:`shardcheck.steps.sharded.compiled_step`); ``"zero1"`` / ``"zero2"`` a GSPMD ``jax.jit`` over their
    layout. The state is placed by :func:`layout_shardings`, the batch split over every mesh axis. A leaf that
    is a ``jax.ShapeDtypeStruct`` (from ``nnx.eval_shape``, or a batch of shapes) becomes a
    ``jax.ShapeDtypeStruct`` with its target sharding, so nothing is allocated; a real leaf is copied onto it.

    Returns:
        ``(lowered, arguments, treedef)``: the ``jax.stages.Lowered`` step, the arguments it takes (for a real
        run: ``lowered.compile()(*arguments)``), and the treedef of the state leaves.
    """
    from jax.sharding import SingleDeviceSharding

    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    if strategy == "replicated":
        from shardcheck.steps.reference import _reference_jit  # the jitted body of reference_step

        one = SingleDeviceSharding(mesh.devices.flat[0])
        state_arg = jax.tree.unflatten(treedef, [_argument(a, one) for a in leaves])
        batch_arg = jax.tree.map(lambda a: _argument(a, one), batch)
        return _reference_jit.lower(loss_fn, graphdef, state_arg, batch_arg), (state_arg, batch_arg), treedef
    state_shardings, grad_shardings = layout_shardings(strategy, model, optimizer, mesh, fn=strategy)
    data = _data_sharding(mesh)
    args = ([_argument(a, s) for a, s in zip(leaves, state_shardings, strict=True)], jax.tree.map(
        lambda a: _argument(a, data), batch
    ))  # fmt: skip
    if strategy in ("dp", "fsdp", "gspmd"):
        from shardcheck.steps.sharded import compiled_step

        specs = tuple(s.spec for s in state_shardings)
        param_specs = tuple(s.spec for s in grad_shardings)
        step = compiled_step(strategy, loss_fn, graphdef, treedef, specs, param_specs, mesh)
    else:
        step = _gspmd_step(graphdef, treedef, loss_fn, state_shardings, grad_shardings, data, mesh)
    return step.lower(*args), args, treedef


def _run_lowered(strategy, lowered, args, treedef, model, optimizer):
    """Compile ``lowered``, run it once on ``args`` and write the new state into ``model`` and ``optimizer``."""
    compiled = lowered.compile()
    _, out = compiled(*args)
    state = out if strategy == "replicated" else jax.tree.unflatten(treedef, out)
    nnx.update((model, optimizer), state)
    return compiled


def _device_bytes(tree, devices) -> tuple[int, ...]:
    """Bytes of every array's addressable shards, summed per device, in the order of ``devices``."""
    acc = {d: 0 for d in devices}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            acc[shard.device] = acc.get(shard.device, 0) + shard.data.nbytes
    return tuple(acc[d] for d in devices)


def _memory_stats(compiled) -> dict[str, int]:
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError("measure_memory: this backend returns no memory_analysis() for compiled executables")
    stats = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "generated_code_bytes": int(ma.generated_code_size_in_bytes),
        "reported_peak_bytes": int(getattr(ma, "peak_memory_in_bytes", -1)),
    }
    stats["peak_bytes"] = (
        stats["argument_bytes"] + stats["output_bytes"] - stats["alias_bytes"] + stats["temp_bytes"]
    )
    return stats


def _deep_copy(model: nnx.Module, optimizer: nnx.Optimizer):
    """A model and optimizer with fresh buffers: the steps donate their state, the caller's must survive."""
    graphdef, state = nnx.split((model, optimizer))
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _compile_and_run(strategy, model, optimizer, x, y, mesh):
    """Compile the step of ``strategy`` and run it once, in place on ``model`` and ``optimizer`` (copies).

    Returns the compiled executable and the per-device bytes of this device's blocks of ``x`` and ``y``.
    """
    from shardcheck import spmd
    from shardcheck.baseline import _sgd_step_jit, sgd_step
    from shardcheck.losses import mse_batch_loss

    if strategy == "replicated":  # the baseline's own jitted step on one device
        x, y = jax.device_put((x, y), mesh.devices.flat[0])
        graphdef, state = nnx.split((model, optimizer))
        compiled = _sgd_step_jit.lower(graphdef, state, x, y).compile()
        sgd_step(model, optimizer, x, y)
    elif strategy in spmd.STRATEGIES:  # dp, fsdp: the shard_map steps of shardcheck.spmd
        compiled = spmd.trace_sgd_step(strategy, model, optimizer, x, y, mesh).lower().compile()
        (spmd.data_parallel_sgd_step if strategy == "dp" else spmd.fsdp_sgd_step)(
            model, optimizer, x, y, mesh
        )
    else:  # zero1, zero2: jit over the strategy's NamedShardings, partitioned by GSPMD
        lowered, args, treedef = lower_step(strategy, mse_batch_loss, model, optimizer, (x, y), mesh)
        compiled = _run_lowered(strategy, lowered, args, treedef, model, optimizer)
    num_shards = 1 if strategy == "replicated" else int(mesh.shape["data"])
    data_bytes = sum(math.prod(a.shape) // num_shards * a.dtype.itemsize for a in (x, y))
    return compiled, data_bytes


def _block_bytes(batch, device) -> int:
    """Bytes of ``device``'s blocks of every leaf of a placed batch."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(batch)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def _measurement(strategy, compiled, data_bytes, model, optimizer, devices, estimate) -> MemoryMeasurement:
    stats = _memory_stats(compiled)
    per_device = _device_bytes(nnx.state((model, optimizer)), devices)
    measured = max(per_device)
    return MemoryMeasurement(
        strategy=strategy,
        num_devices=len(devices),
        data_argument_bytes=data_bytes,
        state_argument_bytes=stats["argument_bytes"] - data_bytes,
        state_bytes_per_device=per_device,
        state_bytes=measured,
        estimated_persistent_bytes=estimate.persistent_bytes,
        accuracy_ratio=estimate.persistent_bytes / measured,
        **stats,
    )


def _check_task_mesh(fn: str, mesh, axis_name) -> jax.sharding.Mesh:
    """A mesh for the task form: default every device on ``axis_name``; a one-axis mesh must be that axis."""
    from shardcheck import spmd

    if mesh is None:
        return spmd.make_mesh(axis_name=axis_name)
    if not isinstance(mesh, jax.sharding.Mesh) or len(mesh.axis_names) == 1:
        spmd.check_mesh(fn, mesh, axis_name)
    return mesh


def _measure_task(fn, task: Task, strategy, mesh, axis_name, weighted=None) -> MemoryMeasurement:
    """``measure_memory`` of a task; ``weighted`` (the loss form) is given when the task was checked already."""
    from shardcheck.parity.harness import check_model
    from shardcheck.steps.registry import STRATEGIES as REGISTRY
    from shardcheck.task import check_divisible

    if strategy not in MESH_STRATEGIES[:-1]:
        raise ValueError(
            f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(MESH_STRATEGIES[:-1])}"
        )
    mesh = _check_task_mesh(fn, mesh, axis_name)
    batch = task.batches[0]
    model = task.new_model(fn)
    optimizer = task.new_optimizer(model)
    if weighted is None:  # BatchStat and RNG-drawing models refused, the loss's output checked on batch 0
        weighted = check_model(fn, model, task.loss_fn, batch)
    if strategy != "replicated":
        check_divisible(fn, batch, mesh.size, weighted=weighted)
    layout = LAYOUTS.get(strategy)
    registered = REGISTRY.get(layout.strategy if layout is not None else strategy)
    if registered is not None and registered.check is not None:
        registered.check(fn, model, optimizer)
    estimate = estimate_memory(task, mesh=mesh, strategy=strategy)
    lowered, args, treedef = lower_step(strategy, task.loss_fn, model, optimizer, batch, mesh)
    compiled = _run_lowered(strategy, lowered, args, treedef, model, optimizer)
    first = mesh.devices.flat[0]
    devices = (first,) if strategy == "replicated" else tuple(mesh.devices.flat)
    return _measurement(strategy, compiled, _block_bytes(args[1], first), model, optimizer, devices, estimate)


def _user_step_compiled(step, model, optimizer, batch, mesh, pass_mesh: bool):
    """The compiled executable of a user's step, lowered on the state it placed (after its first run).

    A step with ``.lower`` (``jax.jit`` / ``nnx.jit`` of ``(model, optimizer, batch)``) is lowered itself; any
    other is traced whole under one ``jax.jit`` of ``(state, batch) -> (loss, new state)`` (its own jitted
    functions inline into it), so XLA's figures are those of the step as one program.
    """
    extra = (mesh,) if pass_mesh else ()
    if callable(getattr(step, "lower", None)):
        try:
            return step.lower(model, optimizer, batch, *extra).compile()
        except TypeError:
            pass  # not a jit of (model, optimizer, batch): trace it whole
    graphdef, state = nnx.split((model, optimizer))

    def whole(state, batch):
        m, o = nnx.merge(graphdef, state)
        loss = step(m, o, batch, *extra)
        return getattr(loss, "loss", loss), nnx.state((m, o))

    return jax.jit(whole).lower(state, batch).compile()


def measure_step(step, task: Task, mesh: jax.sharding.Mesh, *, strategy: str = "gspmd") -> MemoryMeasurement:
    """The memory of any step of a task on ``mesh``, a user's own jitted step included.

    ``step`` is a registered strategy's name (``"dp"``, ``"fsdp"``, ``"gspmd"``, or a memory layout: as
    ``measure_memory(task, strategy=step, mesh=mesh)``) or a user's step ``step(model, optimizer, batch[, mesh])``
    that updates ``model`` and ``optimizer`` in place, as ``shardcheck verify --candidate`` takes it (the example
    ``examples/annotated_lm.py:step`` places the state from its annotations with ``nnx.get_named_sharding`` and
    runs an ``nnx.jit`` step). The user's step runs once on a fresh ``task.model()`` with ``task.optimizer`` on the
    task's first batch (placed over every mesh axis), then the live bytes of every device are read from the
    arrays' ``addressable_shards``, and the step is compiled again on the state as it left it
    (:func:`_user_step_compiled`) for XLA's per-device argument, output, alias and temp bytes.

    Args:
        step: a strategy name or a callable as above.
        task: the :class:`~shardcheck.Task`.
        mesh: the device mesh (:func:`shardcheck.mesh.make_mesh`).
        strategy: for a user's step, the placement the estimate beside it assumes: ``"gspmd"`` (the model's
            annotations, else the FSDP rule; what a GSPMD step placed by ``nnx.get_named_sharding`` holds),
            ``"dp"``, ``"fsdp"``, ...; ``"placed"`` estimates from the shardings the step left (equal by
            construction).

    Returns:
        A :class:`MemoryMeasurement`: bytes per device, ``accuracy_ratio = estimate / measured live bytes``.

    Raises:
        TypeError: ``step`` neither a name nor a callable, ``task`` not a Task, ``mesh`` not a Mesh, a step whose
            signature takes neither 3 nor 4 arguments.
        ValueError: an unknown strategy, a first batch that does not split over ``mesh.size`` devices, a model
            with batch statistics or a random forward pass (as ``verify`` refuses them).
    """
    from shardcheck.parity.candidates import accepts, check_step_signature
    from shardcheck.parity.harness import check_model
    from shardcheck.task import check_divisible

    fn = "measure_step"
    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")
    check_mesh(fn, mesh)
    if isinstance(step, str):
        return _measure_task(fn, task, step, mesh, "data")
    if not callable(step):
        raise TypeError(
            f"{fn}: step must be a strategy name ({', '.join(MESH_STRATEGIES[:-1])}) or a callable "
            f"step(model, optimizer, batch[, mesh]), got {type(step).__name__}"
        )
    if strategy not in MESH_STRATEGIES:
        raise ValueError(f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(MESH_STRATEGIES)}")
    pass_mesh = accepts(step, "mesh", 3)
    check_step_signature(fn, "step", step, 3, pass_mesh)
    model = task.new_model(fn)
    optimizer = task.new_optimizer(model)
    batch = task.batches[0]
    weighted = check_model(fn, model, task.loss_fn, batch)
    check_divisible(fn, batch, mesh.size, weighted=weighted)
    if strategy != "placed":
        estimate = estimate_memory(task, mesh=mesh, strategy=strategy)
    batch = jax.device_put(batch, _data_sharding(mesh))
    step(model, optimizer, batch, *((mesh,) if pass_mesh else ()))
    if strategy == "placed":
        estimate = estimate_memory(model, optimizer, mesh=mesh, strategy="placed")
    compiled = _user_step_compiled(step, model, optimizer, batch, mesh, pass_mesh)
    first = mesh.devices.flat[0]
    return _measurement(
        getattr(step, "__name__", "step"),
        compiled,
        _block_bytes(batch, first),
        model,
        optimizer,
        tuple(mesh.devices.flat),
        estimate,
    )


def measure_memory(
    model: nnx.Module | Task,
    optimizer: nnx.Optimizer | None = None,
    x=None,
    y=None,
    *,
    strategy: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axis_name: str = "data",
) -> MemoryMeasurement:
    """Compile the real step of ``strategy`` on ``mesh``, run it once on a copy, and read its memory.

    ``measure_memory(step, task, mesh)`` measures any step of a task, a user's own jitted step included: see
    :func:`measure_step` (``strategy=`` is then the placement the estimate beside it assumes).

    The steps: ``"replicated"`` is the baseline's jitted step (:func:`shardcheck.baseline.sgd_step`) on the
    mesh's first device; ``"dp"`` and ``"fsdp"`` are the ``jax.shard_map`` steps of :mod:`shardcheck.spmd`
    (lowered through :func:`shardcheck.spmd.trace_sgd_step`); ``"zero1"`` and ``"zero2"``, which have no
    hand-written step, are ``jax.jit`` over the strategy's ``NamedSharding`` placement
    (:func:`layout_shardings`) partitioned by GSPMD, the gradients constrained to the FSDP layout for
    ``"zero2"``.

    The task form, ``measure_memory(task, strategy=..., mesh=...)``, measures the task's own step on its first
    batch, on a fresh ``task.model()`` with ``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)``:
    ``"replicated"`` is the registry's reference step on the mesh's first device, ``"dp"`` and ``"fsdp"`` the
    registry's ``jax.shard_map`` steps compiled through :func:`shardcheck.steps.sharded.prepare`, ``"zero1"`` /
    ``"zero2"`` GSPMD as above with the task's loss; ``"gspmd"`` the registry's GSPMD step. ``mesh`` may have
    several axes (``make_mesh({"data": 2, "fsdp": 4})``): the batch is split over all of them and the state
    placed as :func:`estimate_memory` with ``mesh=`` places it (the model's annotations, else the FSDP rule).

    XLA's ``memory_analysis()`` of the partitioned executable gives argument, output, alias and temp bytes of
    one device (``CompiledMemoryStats``, see the JAX docs of ``jax.stages.Compiled.memory_analysis``). The
    step is then run once on a deep copy of the model and optimizer, and the ``shard.data.nbytes`` of every
    addressable shard of every state array is added up per device. ``model`` and ``optimizer`` are left as
    they were.

    Args:
        model: a :class:`~shardcheck.Task` (then pass no optimizer, x or y), or an ``nnx.Module`` holding only
            ``nnx.Param`` variables (real arrays, not abstract).
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; any optax ``tx``.
        x: ``(B, D)`` float inputs; B must divide by the mesh size.
        y: ``(B, K)`` float targets.
        strategy: ``"replicated"``, ``"dp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
        mesh: a mesh with an ``axis_name`` axis (:func:`shardcheck.spmd.make_mesh`); default: all devices.
            Ignored by ``"replicated"`` except for its first device.
        axis_name: the mesh axis the batch (and the FSDP state) is split over; the (model, optimizer, x, y) form
            uses ``"data"`` only.

    Returns:
        A :class:`MemoryMeasurement` in bytes per device, with the estimate of the persistent state beside it
        and ``accuracy_ratio = estimate / measured``.

    Raises:
        TypeError: ``model``, ``optimizer``, ``mesh`` or the data of the wrong type; an optimizer or data passed
            with a Task.
        ValueError: unknown ``strategy``; a model with non-Param state; bad data; a batch that does not split
            evenly over the mesh; a mesh without the axis; an optimizer ``"fsdp"`` cannot shard; a task whose
            registered strategy refuses it (``Strategy.check``). Nothing is changed when an error is raised.
    """
    from shardcheck import spmd

    fn = "measure_memory"
    if isinstance(optimizer, Task):  # measure_memory(step, task, mesh): any step, a user's own included
        return measure_step(
            model, optimizer, mesh if x is None else x, **({} if strategy is None else {"strategy": strategy})
        )
    if strategy is None:
        raise TypeError(f"{fn}: strategy= is missing; pass one of {', '.join(MESH_STRATEGIES[:-1])}")
    if isinstance(model, Task):
        if optimizer is not None or x is not None or y is not None:
            raise TypeError(
                f"{fn}: with a Task pass no optimizer, x or y; its own optimizer and first batch are measured"
            )
        return _measure_task(fn, model, strategy, mesh, axis_name)
    if axis_name != "data":
        raise ValueError(
            f"{fn}: axis_name={axis_name!r} applies to the task form; the (model, optimizer, x, y) form measures "
            "on a mesh axis 'data'"
        )
    check_strategy(fn, strategy)
    x, y = _validate.check_batch(fn, x, y)
    _validate.check_model(fn, model, x, y)
    spmd.check_params_only(fn, model)
    _validate.check_optimizer(fn, optimizer, model)
    if mesh is None:
        mesh = spmd.make_mesh()
    num_shards = spmd.check_mesh(fn, mesh, "data")
    if strategy != "replicated":
        spmd.check_batch_divisible(fn, x.shape[0], num_shards, "data")
    estimate = estimate_memory(model, optimizer, num_shards=num_shards, strategy=strategy)

    model, optimizer = _deep_copy(model, optimizer)
    compiled, data_bytes = _compile_and_run(strategy, model, optimizer, x, y, mesh)
    devices = (mesh.devices.flat[0],) if strategy == "replicated" else tuple(mesh.devices.flat)
    return _measurement(strategy, compiled, data_bytes, model, optimizer, devices, estimate)


def measure_task_strategies(
    task: Task, *, num_shards: int, strategies=STRATEGIES, axis_name: str = "data"
) -> dict[str, MemoryMeasurement]:
    """:func:`measure_memory` of a task for each strategy: what ``shardcheck memory --task ... --measure`` runs.

    The mesh is :func:`shardcheck.spmd.make_mesh` of the first ``num_shards`` devices; each strategy steps a
    fresh ``task.model()`` once on ``task.batches[0]``.

    Returns:
        ``{strategy: MemoryMeasurement}`` in the order of ``strategies``.

    Raises:
        TypeError: ``task`` not a :class:`~shardcheck.Task`, ``num_shards`` not an int.
        ValueError: unknown strategy, fewer devices than ``num_shards``, and the errors of
            :func:`measure_memory` (a first batch that does not split into ``num_shards`` equal shards, ...).
    """
    fn = "measure_task_strategies"
    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")
    num_shards = _validate.check_num_shards(fn, num_shards)
    for s in strategies:
        check_strategy(fn, s)
    if len(jax.devices()) < num_shards:
        raise ValueError(
            f"{fn}: num_shards={num_shards} needs {num_shards} devices, but {len(jax.devices())} exist; use "
            "fewer shards, or fake CPU devices with jax.config.update('jax_num_cpu_devices', S) at startup"
        )
    from shardcheck.parity.harness import check_model
    from shardcheck.spmd import make_mesh

    mesh = make_mesh(num_shards, axis_name)
    weighted = check_model(fn, task.new_model(fn), task.loss_fn, task.batches[0])  # once for every strategy
    return {s: _measure_task(fn, task, s, mesh, axis_name, weighted) for s in strategies}


def measure_strategies(
    in_features: int,
    out_features: int,
    *,
    hidden: int | None = None,
    layers: int | None = None,
    param_dtype="float32",
    optimizer: str = "sgd",
    num_shards: int,
    batch_size: int,
    strategies=STRATEGIES,
    seed: int = 0,
) -> dict[str, MemoryMeasurement]:
    """:func:`measure_memory` of one fresh model for each strategy: what ``shardcheck memory --measure`` runs.

    The model is :func:`make_memory_model` (seed ``seed``) with ``nnx.Optimizer(model, make_tx(optimizer),
    wrt=nnx.Param)``, the batch standard-normal float32 ``x: (batch_size, D)``, ``y: (batch_size, K)`` from
    ``jax.random.key(seed)``, the mesh :func:`shardcheck.spmd.make_mesh` of the first ``num_shards`` devices.

    Returns:
        ``{strategy: MemoryMeasurement}`` in the order of ``strategies``.

    Raises:
        TypeError: ``num_shards`` not an int.
        ValueError: bad widths or dtype (:func:`make_memory_model`), unknown optimizer or strategy, fewer
            devices than ``num_shards``, ``batch_size`` < 1 or not divisible by ``num_shards``, and the
            errors of :func:`measure_memory`.
    """
    fn = "measure_strategies"
    num_shards = _validate.check_num_shards(fn, num_shards)
    for s in strategies:
        check_strategy(fn, s)
    tx = optimizer_transform(fn, optimizer)
    if len(jax.devices()) < num_shards:
        raise ValueError(
            f"{fn}: num_shards={num_shards} needs {num_shards} devices, but {len(jax.devices())} exist; use "
            "fewer shards, or fake CPU devices with jax.config.update('jax_num_cpu_devices', S) at startup"
        )
    _validate.check_int(fn, "batch_size", batch_size, example="batch_size=8 * num_shards")
    if any(s != "replicated" for s in strategies):
        from shardcheck.spmd import check_batch_divisible

        check_batch_divisible(fn, batch_size, num_shards, "data")
    model = make_memory_model(
        in_features, out_features, hidden=hidden, layers=layers, param_dtype=param_dtype, seed=seed
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (batch_size, in_features), jnp.float32)
    y = jax.random.normal(ky, (batch_size, out_features), jnp.float32)
    from shardcheck.spmd import make_mesh

    mesh = make_mesh(num_shards)
    return {s: measure_memory(model, opt, x, y, strategy=s, mesh=mesh) for s in strategies}
