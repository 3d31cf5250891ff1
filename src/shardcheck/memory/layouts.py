"""The memory layouts: where each category of the training state lives, and the step measured for each.

The layouts are the ZeRO stages of Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (2020), over S devices:

============  ==========  =========  ==================  ===========================================
layout        parameters  gradients  optimizer state     step measured
============  ==========  =========  ==================  ===========================================
replicated    full        full       full (one device)   the registry's ``reference`` step
dp            full        full       full (S devices)    the registry's ``dp`` step
zero1         full        full       split               :func:`zero_step` (memory-only, below)
zero2         full        split      split               :func:`zero_step` (memory-only, below)
fsdp          split       split      split (ZeRO-3)      the registry's ``fsdp`` step
============  ==========  =========  ==================  ===========================================

"split" is the one placement the registry's FSDP step uses (:func:`shardcheck.steps.sharded.state_specs`): the
model's ``nnx.with_partitioning`` annotations where it has them (its optimizer state inherits them), else the FSDP
rule (:func:`~shardcheck.partitioning.fsdp_partition_spec`: the first dimension the FSDP axis divides, over that
axis; a leaf none of whose dimensions divides stays whole). ``num_shards=S`` is a one-axis mesh ``{"fsdp": S}``;
any mesh of named axes may be given, as a ``jax.sharding.Mesh`` or, for an estimate, as axis sizes
(``{"data": 2, "fsdp": 4}``: a ``jax.sharding.AbstractMesh``, no devices needed).

``replicated``, ``dp`` and ``fsdp`` stand for the registry's placements ``"single"``, ``"replicated"`` and
``"fsdp"`` (:data:`shardcheck.partitioning.LAYOUTS`); ``zero1`` and ``zero2`` are memory-only: no registered
strategy runs them, so their step is defined here. Beside the layouts, a mesh also takes ``"gspmd"`` (the
registry's GSPMD step, placed as that step places it, ``state_specs("gspmd")``: like ``fsdp`` on a model without
annotations, by the annotations alone on a model with some, an unannotated leaf replicated, as the Flax NNX
guide's ``nnx.get_named_sharding`` places it) and, for an estimate, ``"placed"``: the real shardings of a state a
step already placed.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from shardcheck import _validate
from shardcheck._catalog import xla_partitioned
from shardcheck.mesh import FSDP_AXIS, abstract_mesh, batch_axes
from shardcheck.partitioning import LAYOUTS, STRATEGIES
from shardcheck.steps._core import params_value_and_grad
from shardcheck.task import divide

SHARDED_CATEGORIES = {name: layout.splits for name, layout in LAYOUTS.items()}
"""Which categories each layout splits over the mesh (ZeRO stages 1, 2, 3; Rajbhandari et al. 2020)."""

MESH_STRATEGIES = (*STRATEGIES, "gspmd", "placed")
"""What an estimate places: the memory layouts, the registry's ``gspmd`` step (placed as that step places it:
like ``fsdp``, but on a model with annotations by the annotations alone: :func:`layout_shardings`), and ``"placed"``:
the real shardings of an already placed state (measurable: all but ``"placed"``)."""


def check_strategy(fn: str, strategy, choices=MESH_STRATEGIES) -> str:
    """``strategy`` must be one of ``choices`` (default :data:`MESH_STRATEGIES`)."""
    if not isinstance(strategy, str) or strategy not in choices:
        raise ValueError(f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(choices)}")
    return strategy


def one_device(strategy: str) -> bool:
    """The layout keeps the whole state on one device whatever the mesh (``replicated``)."""
    layout = LAYOUTS.get(strategy)
    return layout is not None and layout.one_device


def placement_mesh(fn: str, mesh, num_shards) -> Mesh | AbstractMesh:
    """The mesh an estimate places on: ``mesh`` (a Mesh, an AbstractMesh, or axis sizes), else ``{"fsdp": S}``.

    Raises:
        TypeError: neither given, ``num_shards`` not an int, ``mesh`` of another type.
        ValueError: ``num_shards < 1``, a bad axis, ``num_shards`` other than the mesh's size.
    """
    if mesh is None:
        if num_shards is None:
            raise TypeError(
                f"{fn}: pass mesh= (a jax.sharding.Mesh or axis sizes such as {{'data': 2, 'fsdp': 4}}) or "
                "num_shards=S (one axis 'fsdp' of S devices)"
            )
        return abstract_mesh(_validate.check_num_shards(fn, num_shards), FSDP_AXIS, fn=fn)
    if isinstance(mesh, Mapping):
        mesh = abstract_mesh(mesh, fn=fn)
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"{fn}: mesh must be a jax.sharding.Mesh, a jax.sharding.AbstractMesh or axis sizes such as "
            f"{{'data': 2, 'fsdp': 4}}, got {type(mesh).__name__}"
        )
    if num_shards is not None and num_shards != mesh.size:
        raise ValueError(
            f"{fn}: num_shards={num_shards} but the mesh has {mesh.size} devices; pass only mesh= (the batch is "
            "split over every device of the mesh)"
        )
    return mesh


def category_and_path(path, var) -> tuple[str, str]:
    """``(category, path inside it)`` of a leaf of ``nnx.to_flat_state(nnx.state((model, optimizer)))``."""
    keys = tuple(str(k) for k in path)
    if keys[0] == "0":
        return ("params" if isinstance(var, nnx.Param) else "model_state"), ".".join(keys[1:])
    if keys[1] == "step":
        return "step", ".".join(keys[1:])
    return "optimizer", ".".join(keys[2:] if keys[1] == "opt_state" else keys[1:])


def _placed_shardings(fn: str, flat) -> list:
    shardings = []
    for path, var in flat:
        value = var.get_value()
        if not isinstance(value, jax.Array):
            raise ValueError(
                f"{fn}: strategy='placed' needs real placed arrays, but leaf {'/'.join(map(str, path))} is "
                f"{type(value).__name__}; place the state first (run one step), or use strategy='fsdp'"
            )
        shardings.append(value.sharding)
    return shardings


def layout_shardings(
    strategy: str, model, optimizer, mesh, *, fn: str = "layout_shardings"
) -> tuple[list, list]:
    """The sharding of every ``(model, optimizer)`` state leaf and of every gradient under ``strategy`` on ``mesh``.

    ``"replicated"`` and ``"dp"``: everything replicated; ``"fsdp"``: the specs of
    :func:`shardcheck.steps.sharded.state_specs` (annotations, else the FSDP rule); ``"gspmd"``: the specs the
    registry's gspmd step places its state by (``state_specs("gspmd")``): on a model that annotates any leaf
    (:func:`annotated`) the annotations alone (an unannotated leaf and its optimizer state and gradient replicated,
    as a GSPMD step that places ``nnx.get_named_sharding`` of its state holds them; trial 43), on a model without
    annotations the FSDP rule, as ``"fsdp"``; ``"zero1"`` / ``"zero2"``:
    those specs for the categories the layout splits (:data:`SHARDED_CATEGORIES`), replicated otherwise;
    ``"placed"``: each array's own ``sharding`` (a gradient takes its parameter's). ``mesh`` may be abstract.

    Returns:
        ``(state_shardings, grad_shardings)``: one ``NamedSharding`` per leaf of
        ``jax.tree.leaves(nnx.state((model, optimizer)))`` and one per leaf of
        ``jax.tree.leaves(nnx.state(model, nnx.Param))``.

    Raises:
        ValueError: an annotation the mesh cannot honour (:func:`~shardcheck.steps.sharded.state_specs`),
            ``"placed"`` with abstract arrays.
    """
    from shardcheck.steps.sharded import flat_leaves, state_specs

    flat = flat_leaves(nnx.state((model, optimizer)))
    is_param = [isinstance(var, nnx.Param) and str(path[0]) == "0" for path, var in flat]
    if strategy == "placed":
        shardings = _placed_shardings(fn, flat)
        return shardings, [s for s, p in zip(shardings, is_param, strict=True) if p]
    splits = SHARDED_CATEGORIES.get(strategy, frozenset(SHARDED_CATEGORIES["fsdp"]))
    # gspmd: the registry's own placement (on an annotated model the annotations alone), the one its step holds
    placement = strategy if strategy in xla_partitioned() else ("fsdp" if splits else "dp")
    specs, param_specs = state_specs(placement, model, optimizer, mesh, fn=fn)
    whole = PartitionSpec()
    state = [
        NamedSharding(mesh, spec if category_and_path(path, var)[0] in splits else whole)
        for (path, var), spec in zip(flat, specs, strict=True)
    ]
    grads = [NamedSharding(mesh, spec if "grads" in splits else whole) for spec in param_specs]
    return state, grads


def annotated(model) -> bool:
    """Whether ``model`` annotates any Variable (``nnx.with_partitioning`` / ``sharding=`` metadata, an all-``None``
    annotation included): then ``"gspmd"`` places its state by the annotations alone, as a GSPMD step that puts
    ``nnx.get_named_sharding`` of the state does (an unannotated leaf replicated); concrete and abstract models
    alike (only metadata is read). :func:`shardcheck.steps.sharded.annotated`, the registry's own test."""
    from shardcheck.steps.sharded import annotated as registry_annotated

    return registry_annotated(model)


def _data_spec(mesh) -> PartitionSpec:
    axes = batch_axes(mesh)
    return PartitionSpec(axes if len(axes) > 1 else axes[0])


def zero_step(loss_fn, graphdef, treedef, specs, param_specs, mesh):
    """The jitted step of the memory-only layouts ``zero1`` / ``zero2``, partitioned by GSPMD.

    ``(state_leaves, batch) -> (loss, state_leaves)``, the signature of the registry's steps
    (:attr:`shardcheck.steps.registry.Strategy.jit_step`): the full-batch loss and gradients of the task's loss
    (``loss_sum / weight``, as every strategy reduces it), each gradient constrained to ``param_specs`` (zero2:
    each device keeps its slice of the reduced gradient; zero1: replicated), then ``optimizer.update`` on the
    state placed by ``specs`` (in and out, donated); the batch split over every mesh axis.
    """

    def step(leaves, batch):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        g, params, rest = nnx.split(model, nnx.Param, ...)
        total, weight, grads = params_value_and_grad(loss_fn, g, params, rest, batch)
        if weight is not None:
            total, grads = total / weight, divide(grads, weight)
        flat, grad_def = jax.tree.flatten(grads)
        flat = [
            jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s))
            for a, s in zip(flat, param_specs, strict=True)
        ]
        optimizer.update(model, jax.tree.unflatten(grad_def, flat))
        return total, jax.tree.leaves(nnx.state((model, optimizer)))

    state = [NamedSharding(mesh, s) for s in specs]
    return jax.jit(
        step,
        in_shardings=(state, NamedSharding(mesh, _data_spec(mesh))),
        out_shardings=(NamedSharding(mesh, PartitionSpec()), state),
        donate_argnums=0,
    )


MEMORY_ONLY_STEPS = {"zero1": zero_step, "zero2": zero_step}
"""The step builder of each memory-only layout (:data:`shardcheck.partitioning.MEMORY_ONLY`)."""


def step_builder(strategy: str):
    """``build(loss_fn, graphdef, treedef, specs, param_specs, mesh) -> jitted step`` of a layout or strategy.

    The registered strategy the layout stands for (:attr:`shardcheck.partitioning.Layout.strategy`; ``gspmd``
    itself) lowers with its own builder (:attr:`shardcheck.steps.registry.Strategy.jit_step`: the program its
    runs execute); a memory-only layout with :data:`MEMORY_ONLY_STEPS`.
    """
    from shardcheck.steps.registry import STRATEGIES as REGISTRY

    layout = LAYOUTS.get(strategy)
    name = strategy if layout is None else layout.strategy
    return MEMORY_ONLY_STEPS[strategy] if name is None else REGISTRY[name].jit_step


def run_mesh(strategy: str, mesh: Mesh) -> Mesh:
    """The devices a layout's step runs on: the mesh's first device for a one-device layout, else ``mesh``."""
    if not one_device(strategy):
        return mesh
    first = np.asarray(mesh.devices).flat[0]
    return Mesh(
        np.array([first]).reshape((1,) * len(mesh.axis_names)), mesh.axis_names, axis_types=mesh.axis_types
    )
