"""Data-parallel, FSDP and GSPMD steps of any task on a device mesh with one or more named axes.

Every strategy splits the batch over the batch axes of the mesh (:func:`shardcheck.mesh.batch_axes`: ``data``
and ``fsdp``, or every axis of a mesh with neither), replicates it over the model axes (``model``, ``tensor``,
``expert``...) and places each ``(model, optimizer)`` state leaf by a ``PartitionSpec`` (:func:`state_specs`):

* ``dp`` (data parallel): every leaf replicated;
* ``fsdp`` and ``gspmd``: a leaf the model annotates (``nnx.with_partitioning`` / ``out_sharding`` metadata, read
  with ``nnx.get_partition_spec``; the optimizer's state inherits its parameter's annotation) is placed as
  annotated (an optimizer-state leaf shaped otherwise than its parameter, such as Adafactor's factored rank-1
  moments, keeps only the entries that fit it: see :func:`fit_inherited_spec`); under ``fsdp`` an unannotated leaf
  is split over the FSDP axis (:func:`shardcheck.mesh.fsdp_axis`) along its first divisible dimension
  (:func:`~shardcheck.partitioning.fsdp_partition_spec`) and replicated over the other axes (the FSDP rule);
* ``gspmd`` on a model that annotates any Variable (:func:`annotated`): the annotations alone, an unannotated leaf
  (a bias or LayerNorm scale left without ``nnx.with_partitioning``) replicated with its optimizer state and
  gradient, as ``nnx.get_partition_spec`` / ``nnx.get_named_sharding`` place it in the Flax NNX guide "Scale up
  on multiple devices"; on a model without annotations, the FSDP rule, as ``fsdp``.

``dp`` and ``fsdp`` compute the gradients in one ``jax.shard_map`` with explicit collectives: each parameter is
``all_gather``-ed (tiled) over the axes its spec splits it on (and so is the model's other state, such as the
``(L,)`` RNG keys of layers stacked for an ``nnx.scan``), the local shard's ``loss_sum`` is differentiated,
and its gradient is ``psum``-ed over the axes the leaf is replicated on and ``psum_scatter``-ed (tiled) over the
axes it is split on, then divided once by the total weight. On a ``("data", "fsdp")`` mesh this is hybrid
sharding: reduce-scatter over ``fsdp``, all-reduce over ``data`` (ZeRO-3 / FSDP: Rajbhandari et al., "ZeRO",
2020; Zhao et al., "PyTorch FSDP", 2023, section 3.2 "hybrid sharding"); data parallel is the case where every
leaf is replicated (one all-reduce per leaf). On a mesh with model axes (tensor parallelism, ``data=2,model=4``)
the devices along a model axis hold the same batch rows, so each computes the same local gradient: it is summed
over the batch axes only, and each device keeps its slice of the leaf (a sum over ``model`` would count the
gradient once per model shard). ``gspmd`` is what the Flax NNX sharding guide does: the plain
single-device step under ``jax.jit`` with the placed state, XLA inserting the collectives.

For all three the optimizer update runs on the global, placed arrays under the same ``jax.jit``, so any optax
transformation is exact: elementwise ones stay local to each shard, and one that needs the whole tree (a
global-norm clip) gets its cross-device reduction inserted by the compiler, each leaf counted once.

The trap of ``docs/reduction_cases.md`` C2: under ``jax.shard_map`` with ``check_vma=True`` a replicated input is
implicitly broadcast to every device, and the transpose of that broadcast is a ``psum``: the gradient of a local
loss with respect to a replicated parameter comes back *already summed*, and a further reduction leaves an update
S times too large. Each parameter is therefore cast to device-varying over the axes it is replicated on first
(``lax.pcast(..., to="varying")``, a no-op at run time), so each gradient is the local one and is reduced exactly
once.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardcheck import distributed
from shardcheck._catalog import STRATEGY_SPECS, xla_partitioned
from shardcheck._tree import path_str
from shardcheck.mesh import batch_axes, fsdp_axis, model_axes
from shardcheck.partitioning import fsdp_partition_spec
from shardcheck.steps._core import StepResult, params_value_and_grad
from shardcheck.task import Batch, LossFn, divide


def flat_leaves(state) -> list:
    """``nnx.to_flat_state(state)`` without the entries that hold no array: one ``(path, Variable)`` per leaf of
    ``jax.tree.leaves(state)``, in its order. optax's ``MaskedNode`` (the state a ``multi_transform`` or a masked
    transformation keeps for the leaves it does not update) is an entry of the first and no leaf of the second."""
    return [(path, var) for path, var in nnx.to_flat_state(state) if jax.tree.leaves(var)]


def _entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (``None``, ``"fsdp"`` or ``("data", "fsdp")``)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """Every mesh axis ``spec`` splits some dimension over, in dimension order."""
    return tuple(a for entry in spec for a in _entry_axes(entry))


def _replicated_axes(spec: PartitionSpec, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
    split = set(spec_axes(spec))
    return tuple(a for a in mesh_axes if a not in split)


def _all_gathered(a, spec: PartitionSpec):
    """This device's shard -> the whole leaf: a tiled ``all_gather`` along every dimension ``spec`` splits."""
    for dim, entry in enumerate(spec):
        if entry is not None:
            a = jax.lax.all_gather(a, entry, axis=dim, tiled=True)
    return a


def _gather(a, spec: PartitionSpec, mesh_axes):
    """This device's shard -> the whole leaf, device-varying over every axis (no implicit psum, C2)."""
    replicated = _replicated_axes(spec, mesh_axes)
    if replicated:
        a = jax.lax.pcast(a, replicated, to="varying")
    return _all_gathered(a, spec)


def _whole_model_state(leaves, specs, treedef) -> list:
    """The ``(model, optimizer)`` state leaves with the model's variables other than ``nnx.Param`` whole.

    The forward pass reads the model's other state (RNG stream keys and counts, a counter) as the single-device
    step does: whole. Under ``fsdp`` such a leaf may be split: the per-layer RNG keys that ``nnx.split_rngs`` and
    ``nnx.vmap`` stack for an ``nnx.scan`` over layers are ``(L,)``, split over the FSDP axis like any unannotated
    leaf, and a forward pass given its shard would scan over ``L / S`` keys beside ``L`` layers. Each such leaf is
    ``all_gather``-ed (tiled) along the dimensions its spec splits; parameters and the optimizer's state are left
    as they are (the parameters are gathered where they are differentiated, :func:`sharded_value_and_grad`).
    """
    flat = flat_leaves(jax.tree.unflatten(treedef, leaves))
    return [
        _all_gathered(a, spec) if path[0] == 0 and not isinstance(var, nnx.Param) else a
        for (path, var), a, spec in zip(flat, leaves, specs, strict=True)
    ]


def _reduce(g, spec: PartitionSpec, mesh_axes):
    """The whole local gradient -> this device's shard of the sum over every device (each term once)."""
    replicated = _replicated_axes(spec, mesh_axes)
    if replicated:
        g = jax.lax.psum(g, replicated)
    for dim, entry in enumerate(spec):
        if entry is not None:
            g = jax.lax.psum_scatter(g, entry, scatter_dimension=dim, tiled=True)
    return g


def _vma(x) -> frozenset:
    """The mesh axes ``x`` is device-varying over inside ``shard_map`` (its type's varying manual axes)."""
    aval = jax.typeof(x)  # .manual_axis_type.varying in JAX 0.10, .vma before
    return frozenset(aval.manual_axis_type.varying if hasattr(aval, "manual_axis_type") else aval.vma)


def _invariant(x, axes):
    """``x``, made device-invariant over ``axes`` on which its copies are equal (``pmax`` of equal copies: exact)."""
    varying = tuple(a for a in axes if a in _vma(x))
    return jax.lax.pmax(x, varying) if varying else x


def _varying(x, axes):
    """``x``, typed device-varying over ``axes`` (``pcast``: a no-op at run time, and its values unchanged).

    The batch is replicated over the model axes, the gathered parameters vary over every axis (C2): a loss that
    carries the batch through a ``lax.scan`` (layers stacked by ``nnx.vmap``, a pipeline's stages) would enter
    the scan's carry invariant over the model axes and leave it varying, which ``check_vma`` refuses (the carry's
    type must not change). The batch is not differentiated, so its cast adds no reduction.
    """
    cast = tuple(a for a in axes if a not in _vma(x))
    return jax.lax.pcast(x, cast, to="varying") if cast else x


def _reduce_model_split(g, spec: PartitionSpec, batch, model):
    """The whole local gradient on a mesh with model axes -> this device's shard of the sum over the batch shards.

    The batch is replicated over the ``model`` axes, so every device along them computed the same local
    gradient: it is summed over the ``batch`` axes only (a psum over a model axis would count it once per
    shard), made invariant over the model axes (its copies are equal), and this device's slice taken along
    every dimension the spec splits (row-major over an entry's axes, as a tiled ``all_gather`` concatenates).
    """
    g = _invariant(jax.lax.psum(g, batch), model)
    for dim, entry in enumerate(spec):
        axes = _entry_axes(entry)
        if axes:
            n = g.shape[dim] // jax.lax.axis_size(axes)
            g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(axes) * n, n, axis=dim)
    return g


def sharded_value_and_grad(
    loss_fn: LossFn, model: nnx.Module, batch: Batch, param_specs, mesh_axes, tensor_axes=()
):
    """Inside ``shard_map``: gather the parameters, differentiate the local loss, reduce each gradient once.

    Args:
        loss_fn: the task's loss.
        model: the model holding this device's parameter shards (``param_specs`` give each ``nnx.Param``
            leaf's split, in ``jax.tree.leaves(nnx.state(model, nnx.Param))`` order).
        batch: this device's shard of the batch.
        param_specs: one ``PartitionSpec`` per parameter leaf (``PartitionSpec()``: replicated).
        mesh_axes: the batch axes of the mesh (:func:`shardcheck.mesh.batch_axes`).
        tensor_axes: the model axes (:func:`shardcheck.mesh.model_axes`): the batch is replicated over them.

    Returns:
        ``(loss, grads)``: the full-batch loss ``psum(loss_sum) / psum(weight)`` over the batch axes and an
        ``nnx.State`` of gradient shards, each ``reduce(g) / psum(weight)``: without model axes ``reduce`` is a
        ``psum`` over the axes the leaf is replicated on and a ``psum_scatter`` over the axes it is split on; with
        them, a ``psum`` over the batch axes and this device's slice (:func:`_reduce_model_split`).
    """
    graphdef, local, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(local)
    every = (*mesh_axes, *tensor_axes)
    full = [_gather(a, s, every) for a, s in zip(leaves, param_specs, strict=True)]
    batch = jax.tree.map(lambda x: _varying(x, tensor_axes), batch)  # as the parameters vary (_varying)
    total, weight, grads = params_value_and_grad(
        loss_fn, graphdef, jax.tree.unflatten(treedef, full), rest, batch
    )
    # A scalar loss is a mean per shard: the weight of each shard is 1, the total the shard count (a constant).
    weight = (
        jax.lax.axis_size(mesh_axes)
        if weight is None
        else _invariant(jax.lax.psum(weight, mesh_axes), tensor_axes)
    )
    if tensor_axes:
        reduced = [
            _reduce_model_split(g, s, mesh_axes, tensor_axes)
            for g, s in zip(jax.tree.leaves(grads), param_specs, strict=True)
        ]
    else:
        reduced = [_reduce(g, s, mesh_axes) for g, s in zip(jax.tree.leaves(grads), param_specs, strict=True)]
    total = _invariant(jax.lax.psum(total, mesh_axes), tensor_axes)
    return total / weight, jax.tree.unflatten(treedef, divide(reduced, weight))


def _plain_loss_and_grads(loss_fn, model, batch):
    """The single-device step's loss and gradients of the full batch (GSPMD partitions it); what the forward
    pass writes to the model's non-parameter state (a counter) is written back, as in the reference step."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    total, weight, grads, after = params_value_and_grad(
        loss_fn, graphdef, params, rest, batch, with_state=True
    )
    nnx.update(model, after)
    if weight is None:
        return total, grads
    return total / weight, divide(grads, weight)


@functools.lru_cache(maxsize=64)
def compiled_step(
    strategy, loss_fn, graphdef, treedef, specs, param_specs, mesh, with_grads=False, donate=True
):
    """The jitted step for one (strategy, loss, structure, placement, mesh); jit caches shapes itself.

    ``dp`` / ``fsdp``: the gradients are computed and reduced inside one ``jax.shard_map`` with explicit
    collectives (above). ``gspmd``: the plain full-batch loss and gradients, partitioned by XLA from the
    arguments' shardings. Then the optimizer update runs on the global, placed arrays under the same
    ``jax.jit``; the state keeps its placement (``out_shardings``). Signature of the result:
    ``(state_leaves, batch) -> (loss, state_leaves)``; the state leaves are donated. ``with_grads``: ``(loss,
    grad_leaves, state_leaves)``, the reduced gradients it applied, placed as the parameters (the parity check
    compares them; an optimizer blind to the gradient's scale, such as a clip that binds, hides it in the update).
    ``donate=False``: the state is not donated (a parity reference, whose state before the step is read after it).
    """
    mesh_axes, tensor_axes = batch_axes(mesh), model_axes(mesh)
    batch_spec = PartitionSpec(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])

    def grads_body(leaves, batch):
        leaves = _whole_model_state(leaves, specs, treedef)
        model, _ = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        loss, grads = sharded_value_and_grad(loss_fn, model, batch, param_specs, mesh_axes, tensor_axes)
        return loss, jax.tree.leaves(grads)

    mapped = jax.shard_map(
        grads_body,
        mesh=mesh,
        in_specs=(list(specs), batch_spec),
        out_specs=(PartitionSpec(), list(param_specs)),
        check_vma=True,  # the default, stated: the C2 formulation above is right with it on or off
    )

    def step(leaves, batch):
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        params = nnx.state(model, nnx.Param)
        if not STRATEGY_SPECS[strategy].explicit_collectives:  # gspmd: XLA partitions the plain step
            loss, grads = _plain_loss_and_grads(loss_fn, model, batch)
        else:
            loss, grad_leaves = mapped(leaves, batch)
            grads = jax.tree.unflatten(jax.tree.structure(params), grad_leaves)
        optimizer.update(model, grads)
        state = jax.tree.leaves(nnx.state((model, optimizer)))
        return (loss, jax.tree.leaves(grads), state) if with_grads else (loss, state)

    state_shardings = [NamedSharding(mesh, spec) for spec in specs]
    loss_sharding = NamedSharding(mesh, PartitionSpec())
    grad_shardings = [NamedSharding(mesh, spec) for spec in param_specs]
    return jax.jit(
        step,
        donate_argnums=0 if donate else (),
        in_shardings=(state_shardings, NamedSharding(mesh, batch_spec)),
        out_shardings=(loss_sharding, grad_shardings, state_shardings)
        if with_grads
        else (loss_sharding, state_shardings),
    )


# ---------------------------------------------------------------------------------------------- placement


def _annotation(var) -> tuple | None:
    """The ``out_sharding`` annotation of an ``nnx.Variable`` (``nnx.with_partitioning``), or None."""
    sharding = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
    return tuple(sharding) if sharding else None


def _check_axes(fn: str, path: str, spec: PartitionSpec, mesh: Mesh) -> None:
    """An annotated spec must name axes of ``mesh`` (the message names the leaf, the annotation and the mesh)."""
    for axis in spec_axes(spec):
        if axis not in mesh.axis_names:
            raise ValueError(
                f"{fn}: leaf {path!r} is annotated {spec} but the mesh has no axis {axis!r} (its axes: "
                f"{tuple(mesh.axis_names)}); build the mesh with that axis (e.g. --mesh {axis}=2 among its axes, or {axis}=1 to keep the annotation and split nothing) or "
                "change the annotation"
            )


def check_annotated_axes(fn: str, model, mesh: Mesh) -> None:
    """Every sharding annotation (``nnx.with_partitioning``) of ``model``'s Variables names an axis of ``mesh``:
    what a user's step on ``mesh`` is checked for before its first step, as a registered strategy's placement is
    (:func:`state_specs`), so that a misspelt ``--mesh`` axis is named before JAX's own error inside the step.

    Works on concrete and abstract (``nnx.eval_shape``) models alike: only metadata is read.

    Raises:
        ValueError: a leaf annotated with an axis the mesh lacks; the message names the leaf (its dotted path),
            the annotation, the mesh's axes and the fix.
    """
    for path, spec in _annotated_specs(model):
        _check_axes(fn, path, spec, mesh)


def check_annotations_fit(fn: str, model, mesh: Mesh) -> None:
    """Every sharding annotation of ``model`` names axes of ``mesh`` and splits its dimensions evenly over them
    (:func:`check_annotated_axes`, then each dimension's size against the product of its axes' sizes): what
    names the likely cause of a user's step that places its state by its annotations and raised on ``mesh``.

    Raises:
        ValueError: the first leaf that does not fit; the message names the leaf, its shape, its annotation, the
            dimension and the fix.
    """
    check_annotated_axes(fn, model, mesh)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if _annotation(var) is not None:
            shape = tuple(np.shape(var.get_value()))
            _check_annotation(fn, path_str(path), nnx.get_partition_spec(var).get_value(), shape, mesh)


def annotations_missing_axes(model, mesh: Mesh) -> list[tuple[str, PartitionSpec, tuple[str, ...]]]:
    """``(dotted path, annotation, the axes of it that mesh lacks)`` of every Variable of ``model`` whose sharding
    annotation names an axis ``mesh`` lacks, in the model's order; concrete and abstract models alike."""
    out = []
    for path, spec in _annotated_specs(model):
        lacking = tuple(a for a in spec_axes(spec) if a not in mesh.axis_names)
        if lacking:
            out.append((path, spec, lacking))
    return out


def annotated_axes(model) -> frozenset[str]:
    """The mesh axes that ``model``'s sharding annotations (``nnx.with_partitioning``) split some leaf over;
    concrete and abstract (``nnx.eval_shape``) models alike (only metadata is read)."""
    return frozenset(a for _, spec in _annotated_specs(model) for a in spec_axes(spec))


def _annotated_specs(model):
    """``(dotted path, PartitionSpec)`` of every annotated Variable of ``model``."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if _annotation(var) is not None:
            yield path_str(path), nnx.get_partition_spec(var).get_value()


def _check_annotation(fn: str, path: str, spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """An annotated spec must name mesh axes, fit the leaf's rank and split dimensions evenly."""
    _check_axes(fn, path, spec, mesh)
    if len(spec) > len(shape):
        raise ValueError(
            f"{fn}: leaf {path!r} of shape {tuple(shape)} is annotated {spec}, which names more dimensions than "
            "it has; give one entry per dimension"
        )
    for dim, entry in enumerate(spec):
        ways = math.prod(int(mesh.shape[a]) for a in _entry_axes(entry))
        if shape[dim] % ways:
            raise ValueError(
                f"{fn}: leaf {path!r} of shape {tuple(shape)} is annotated {spec}: dimension {dim} ({shape[dim]}) "
                f"does not split into {ways} equal parts over {entry!r}; change the mesh or the annotation"
            )
    return spec


def fit_inherited_spec(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """The part of an annotation inherited from a parameter that fits an optimizer-state leaf of ``shape``.

    ``nnx.Optimizer`` copies a parameter's annotation onto every state leaf made from it, but an optimizer may
    keep state shaped otherwise (Adafactor's factored second moments: rank 1 for a 2-D kernel, ``(1,)``
    placeholders where unfactored). The user cannot change that annotation, so it is fitted, not refused: a leaf
    of lower rank than the spec has entries is replicated (``P()``: which dimension an entry meant is unknown),
    and on any other leaf an entry whose mesh axes do not split its dimension evenly is
    dropped (``None``: that dimension replicated). A leaf shaped like its parameter keeps the spec unchanged.

    Args:
        spec: the inherited ``PartitionSpec``; shape: the state leaf's shape (a tuple of ints); mesh: the mesh.

    Returns:
        the fitted ``PartitionSpec``.
    """
    if len(spec) > len(shape):
        return PartitionSpec()
    entries = [
        entry if shape[dim] % math.prod(int(mesh.shape[a]) for a in _entry_axes(entry)) == 0 else None
        for dim, entry in enumerate(spec)
    ]
    return PartitionSpec(*entries)


def annotated(model) -> bool:
    """Whether ``model`` annotates any Variable (``nnx.with_partitioning`` / ``sharding=`` metadata, an all-``None``
    annotation included): then ``gspmd`` places its state by the annotations alone (:func:`state_specs`).
    Concrete and abstract (``nnx.eval_shape``) models alike: only metadata is read."""
    return any(_annotation(var) is not None for _, var in nnx.to_flat_state(nnx.state(model)))


def state_specs(
    strategy: str, model, optimizer, mesh: Mesh, *, min_size: int = 0, fn: str = "state_specs"
) -> tuple[tuple[PartitionSpec, ...], tuple[PartitionSpec, ...]]:
    """The ``PartitionSpec`` of every ``(model, optimizer)`` state leaf under ``strategy``, and of the params.

    Works on concrete and abstract (``nnx.eval_shape``) models alike: only shapes and metadata are read.

    Args:
        strategy: ``"dp"`` (every leaf replicated), ``"fsdp"`` (annotations, else the FSDP rule) or ``"gspmd"``
            (on a model that annotates any Variable, :func:`annotated`, the annotations alone: an unannotated leaf,
            its optimizer state and gradient replicated, ``P()``, as ``nnx.get_partition_spec`` /
            ``nnx.get_named_sharding`` place it in the Flax NNX sharding guide; on a model without annotations
            the FSDP rule, as ``"fsdp"``).
        model: the ``nnx.Module``; optimizer: its ``nnx.Optimizer`` (its state leaves carry their parameter's
            annotation, as ``nnx.Optimizer`` copies it).
        mesh: the mesh.
        min_size: leaves with fewer elements that the FSDP rule places stay replicated.

    Returns:
        ``(specs, param_specs)``: one spec per leaf of ``jax.tree.leaves(nnx.state((model, optimizer)))``, and
        one per leaf of ``jax.tree.leaves(nnx.state(model, nnx.Param))``.

    Raises:
        ValueError: an annotation naming an axis the mesh lacks, or a parameter's (model leaf's) own annotation
            with more entries than the leaf's rank or splitting a dimension unevenly (the leaf and the axis are
            named; an optimizer-state leaf's inherited annotation is fitted instead, :func:`fit_inherited_spec`);
            an unannotated leaf placed by the FSDP rule on a several-axis mesh without an ``"fsdp"`` axis.
    """
    alone = strategy in xla_partitioned() and annotated(model)  # gspmd: the annotations alone

    def spec_of(path, var):
        shape = tuple(np.shape(var.get_value() if isinstance(var, nnx.Variable) else var))
        if STRATEGY_SPECS[strategy].placement == "replicated":  # dp, multiprocess
            return PartitionSpec()
        if _annotation(var) is not None:
            name, spec = path_str(path), nnx.get_partition_spec(var).get_value()
            if path[0] == "optimizer":  # inherited from its parameter, whose own annotation is checked
                _check_axes(fn, name, spec, mesh)
                return fit_inherited_spec(spec, shape, mesh)
            return _check_annotation(fn, name, spec, shape, mesh)
        if alone or not shape:  # unannotated beside annotations; a scalar (a step counter) on any mesh
            return PartitionSpec()
        axis = fsdp_axis(mesh)
        return fsdp_partition_spec(shape, int(mesh.shape[axis]), axis, min_size=min_size)

    def named(path):  # (0, "fc", "kernel") -> ("fc", "kernel"); (1, "opt_state", ...) -> ("opt_state", ...)
        return path[1:] if path[0] == 0 else ("optimizer", *path[1:])

    flat = flat_leaves(nnx.state((model, optimizer)))
    all_specs = tuple(spec_of(named(path), var) for path, var in flat)
    param_flat = flat_leaves(nnx.state(model, nnx.Param))
    return all_specs, tuple(spec_of(path, var) for path, var in param_flat)


def place_state(leaves, specs, mesh: Mesh) -> list:
    """Each leaf on ``mesh`` with its spec, copied unless already placed there (the step donates its inputs).

    Arrays not yet in the step's placement (a model's first step) are copied into it by
    :func:`shardcheck.distributed.place_host_tree` (no cross-process communication, so it cannot deadlock in a
    multi-process run; RNG keys included), so the caller's arrays survive even when a clone shares them
    (``nnx.clone`` does not copy arrays). Arrays already placed (the outputs of the previous step) are passed
    through and donated; a buffer shared by two leaves is copied once.
    """
    placed, seen = [], set()
    for a, spec in zip(leaves, specs, strict=True):
        target = NamedSharding(mesh, spec)
        placed_already = isinstance(a.sharding, NamedSharding) and a.sharding.is_equivalent_to(target, a.ndim)
        shared = id(a) in seen
        seen.add(id(a))
        if placed_already and shared:
            a = jax.numpy.copy(a)  # one buffer donated twice: copy it once
        placed.append(distributed.place_host_tree(a, target))  # no communication; places RNG keys too
    return placed


def place_batch(batch: Batch, mesh: Mesh) -> Batch:
    """The batch split over the batch axes of ``mesh`` (:func:`shardcheck.mesh.batch_axes`) along its leading
    dimension, replicated over the model axes."""
    axes = batch_axes(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))
    return distributed.place_host_tree(batch, sharding)


def prepare(
    strategy,
    loss_fn,
    model,
    optimizer,
    batch,
    mesh,
    axis_name=None,
    min_size=0,
    with_grads=False,
    donate=True,
):
    """The compiled step (:func:`compiled_step`), its placed arguments and the state treedef (nothing is changed).

    ``axis_name`` is accepted for the one-axis callers and must be an axis of ``mesh``; the placement reads the
    mesh's axes (:func:`state_specs`).
    """
    if axis_name is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"prepare: mesh has axes {tuple(mesh.axis_names)}, not {axis_name!r}")
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    specs, param_specs = state_specs(strategy, model, optimizer, mesh, min_size=min_size, fn=strategy)
    step = compiled_step(strategy, loss_fn, graphdef, treedef, specs, param_specs, mesh, with_grads, donate)
    return step, (place_state(leaves, specs, mesh), place_batch(batch, mesh)), treedef


def mesh_step(
    strategy: str,
    loss_fn: LossFn,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: Batch,
    mesh: Mesh,
    *,
    min_size: int = 0,
    with_grads: bool = False,
    donate: bool = True,
) -> jax.Array | StepResult:
    """One DP, FSDP or GSPMD step of a task on ``mesh``, in place; returns the 0-d pre-update loss, or with
    ``with_grads`` a :class:`~shardcheck.steps._core.StepResult` with the reduced gradients it applied (an
    ``nnx.State`` like the parameters, placed as they are).

    The caller validates: the batch divisible by the number of batch shards (:func:`shardcheck.mesh.data_shards`;
    ``mesh.size`` without model axes), a model without batch statistics. ``donate=False`` keeps the arrays the
    model held before the step alive (a parity reference's state before the step).
    """
    step, args, treedef = prepare(
        strategy,
        loss_fn,
        model,
        optimizer,
        batch,
        mesh,
        min_size=min_size,
        with_grads=with_grads,
        donate=donate,
    )
    grads_structure = jax.tree.structure(nnx.state(model, nnx.Param))
    out = step(*args)  # (loss, state) or (loss, grads, state)
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, out[-1]))
    return StepResult(out[0], jax.tree.unflatten(grads_structure, out[1]), None) if with_grads else out[0]
