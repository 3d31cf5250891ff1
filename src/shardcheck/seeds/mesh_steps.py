"""Data-parallel and FSDP SGD steps on a JAX device mesh, each equal to the single-device :func:`sgd_step`.

Both steps are one ``jax.shard_map`` inside one ``jax.jit``, compiled once per (model structure, optimizer,
shapes, mesh) and cached; repeated calls do not re-trace. They update ``model`` and ``optimizer`` in place, as
``optimizer.update(model, grads)`` does, and return the pre-update loss (the mean of the shard losses, seed
``000_f7b4ea9cf28c5420.txt``).

Data parallel (DP): the batch is split over the mesh axis, parameters and optimizer state are replicated. Each
device differentiates its shard's loss and the gradients are averaged with exactly one ``lax.pmean`` per leaf.

Fully sharded (FSDP): every parameter and optimizer-state leaf is split over the mesh axis along the dimension
chosen by :func:`~shardcheck.partitioning.fsdp_partition_spec` (leaves with no divisible dimension stay
replicated). Inside the map each sharded parameter is ``all_gather``-ed (tiled) for the forward and backward
pass, its gradient is ``psum_scatter``-ed (tiled) and divided by S, so every device receives the mean gradient of
its own shard only, and the optimizer update runs on the local shards. This is the ZeRO-3 / FSDP pattern
(Rajbhandari et al., "ZeRO", 2020; Zhao et al., "PyTorch FSDP", 2023), written with explicit collectives rather
than left to GSPMD, which may lower the same computation to an all-reduce followed by a slice.

The trap of ``docs/reduction_cases.md`` C2: under ``jax.shard_map`` with replication checking on (``check_vma=True``,
the default), a replicated (device-invariant) input is implicitly broadcast to every device, and the transpose of
that broadcast is a ``psum``. The gradient of a local loss with respect to a replicated parameter therefore
comes back *already summed* over the axis, and a further ``pmean`` leaves an update S times too large, with no
error. Here the parameters are first cast to device-varying (``lax.pcast(..., to="varying")``, a no-op at run
time), so the gradient is the local one, and exactly one ``pmean`` (DP) or ``psum_scatter / S`` (FSDP) reduces
it. This formulation is also right with ``check_vma=False``, where no implicit ``psum`` exists.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from shardcheck import _validate
from shardcheck import mesh as mesh_lib
from shardcheck._catalog import STRATEGY_SPECS, seed_form
from shardcheck.losses import mse_batch_loss
from shardcheck.steps import sharded

STRATEGIES = tuple(
    name for name in seed_form() if STRATEGY_SPECS.get(name) and STRATEGY_SPECS[name].uses_mesh
)
"""The registered mesh strategies of the ``(x, y)`` form, from the registry: one per placement (``dp``, ``fsdp``)."""


# ----------------------------------------------------------------------------------------------- validation

# The mesh steps' checks, shared with the engine (``memory``'s seeds form): defined in ``mesh`` and ``_validate``.
check_mesh = mesh_lib.check_mesh_axis
check_batch_divisible = _validate.check_batch_divisible
check_params_only = _validate.check_params_only


def check_min_size(fn: str, min_size) -> int:
    """``min_size`` (FSDP's replication threshold, in elements) must be an int >= 0."""
    return _validate.check_int(
        fn, "min_size", min_size, minimum=0, example="min_size=0 (shard every divisible leaf)"
    )


# ------------------------------------------------------------------------------------------------ the steps


def _prepare(fn, strategy, model, optimizer, x, y, mesh, axis_name, min_size):
    """Validate everything, then return the compiled step and its placed arguments (nothing is changed)."""
    x, y = _validate.check_batch(fn, x, y)
    _validate.check_model(fn, model, x, y)
    check_params_only(fn, model)
    _validate.check_optimizer(fn, optimizer, model)
    check_mesh(fn, mesh, axis_name)
    check_batch_divisible(fn, x.shape[0], mesh.size, axis_name)
    min_size = check_min_size(fn, min_size)
    return sharded.prepare(strategy, mse_batch_loss, model, optimizer, (x, y), mesh, axis_name, min_size)


def trace_sgd_step(
    strategy: str,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x,
    y,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    min_size: int = 0,
) -> jax.stages.Traced:
    """The traced (not executed) step of ``strategy``, for inspection; model and optimizer are not changed.

    ``.jaxpr`` shows the collectives, ``.lower().compile()`` gives the compiled HLO (``as_text()``) and its
    ``memory_analysis()``. The validation is that of the step itself.

    Args:
        strategy: one of :data:`STRATEGIES` (``"dp"`` or ``"fsdp"``).
        model, optimizer, x, y, mesh, axis_name, min_size: as in :func:`data_parallel_sgd_step` /
            :func:`fsdp_sgd_step`; errors are named ``trace_sgd_step``.

    Returns:
        A ``jax.stages.Traced``.

    Raises:
        ValueError: unknown ``strategy``, and the errors of the step.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"trace_sgd_step: strategy={strategy!r} is unknown; use one of {', '.join(STRATEGIES)}"
        )
    step, args, _ = _prepare("trace_sgd_step", strategy, model, optimizer, x, y, mesh, axis_name, min_size)
    return step.trace(*args)


def _run(fn, strategy, model, optimizer, x, y, mesh, axis_name, min_size) -> jax.Array:
    step, args, treedef = _prepare(fn, strategy, model, optimizer, x, y, mesh, axis_name, min_size)
    loss, leaves = step(*args)
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
    return loss


def data_parallel_sgd_step(
    model: nnx.Module, optimizer: nnx.Optimizer, x, y, mesh: Mesh, *, axis_name: str = "data"
) -> jax.Array:
    """One data-parallel optimizer step on a device mesh, in place; equal to :func:`~shardcheck.sgd_step`.

    The batch is placed with ``NamedSharding(mesh, P(axis_name))`` (S equal shards of ``B/S`` rows); parameters
    and optimizer state are replicated on every device of the mesh (and stay so between steps). Inside one
    ``jax.shard_map`` each device computes its shard's loss ``jnp.mean((model(x_s) - y_s) ** 2)`` and gradients,
    the gradients are averaged with exactly one ``lax.pmean`` per leaf (sum over devices, divided by S: the
    reduction of seed ``000_f7b4ea9cf28c5420.txt``), and every replica applies the same
    ``optimizer.update(model, grads)``. With equal shards the mean of the shard gradients is the full-batch
    gradient, so any optax transformation gives the baseline update. See the module docstring for the
    ``docs/reduction_cases.md`` C2 trap and how it is avoided.

    Compiled once per (model structure, optimizer, shapes, mesh). Buffer donation: a model's first mesh step
    copies its arrays into the mesh placement (the caller's arrays, and those of any ``nnx.clone`` sharing them,
    stay valid); from then on the placed state buffers are donated to each step, so an array read from the model
    or optimizer after a mesh step is deleted by the next one (copy it with ``np.asarray`` or ``jnp.copy``).

    Args:
        model: an ``nnx.Module`` holding only ``nnx.Param`` variables; updated in place.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; state and step counter updated in place.
        x: ``(B, D)`` float inputs: NumPy, or any ``jax.Array`` (already placed, or a global array);
            integers are converted to float32.
        y: ``(B, K)`` float targets.
        mesh: a ``Mesh`` with an axis ``axis_name`` of size S dividing B (see :func:`make_mesh`).
        axis_name: the mesh axis the batch is split over.

    Returns:
        The pre-update loss, the mean of the S shard losses: a 0-d float32 array replicated on the mesh.

    Raises:
        TypeError: non-numeric ``x``/``y``; ``model``, ``optimizer`` or ``mesh`` of the wrong type.
        ValueError: ``x``/``y`` not 2-D, batch sizes differ or are zero, NaN/inf in the data; ``B`` not
            divisible by S (the message lists the device counts that divide B); ``mesh`` without
            ``axis_name``; a model holding batch statistics, RNG streams or any other non-Param variable.
            Nothing is changed when an error is raised.
    """
    return _run("data_parallel_sgd_step", "dp", model, optimizer, x, y, mesh, axis_name, 0)


def fsdp_sgd_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    x,
    y,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    min_size: int = 0,
) -> jax.Array:
    """One fully sharded (FSDP / ZeRO-3) optimizer step on a device mesh, in place; equal to ``sgd_step``.

    Placement: each parameter and optimizer-state leaf is split over ``axis_name`` by
    :func:`~shardcheck.partitioning.fsdp_partition_spec` (its first dimension that S divides; a leaf without one,
    e.g. a bias of length 3 on 4 devices, and scalars such as the step counters stay replicated; so do leaves
    with fewer than ``min_size`` elements). A state leaf of a parameter's shape gets that parameter's spec. The
    arrays stay in this placement between steps, so a second step does not re-shard.

    Step (one ``jax.shard_map``): each sharded parameter is ``all_gather``-ed (tiled) for the forward and
    backward pass on the local ``(B/S, D)`` batch shard; its gradient is ``psum_scatter``-ed (tiled) and divided
    by S, so each device receives the mean gradient of its own parameter shard only; replicated leaves are
    ``pmean``-ed. ``optimizer.update`` then runs on the placed global arrays under the same ``jit``: elementwise
    transformations stay local to each shard, and any other optax transformation (global-norm clipping, trust
    ratios, factored moments) gets the reduction it needs inserted by XLA, exactly.

    Compiled once per (model structure, optimizer, shapes, mesh, placement); the state buffers are donated, as
    in :func:`data_parallel_sgd_step`.

    Args:
        model: an ``nnx.Module`` holding only ``nnx.Param`` variables; updated in place, its arrays left sharded.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with an elementwise ``tx``; updated in place.
        x: ``(B, D)`` float inputs: NumPy, or any ``jax.Array`` (already placed, or a global array).
        y: ``(B, K)`` float targets.
        mesh: a ``Mesh`` with an axis ``axis_name`` of size S dividing B (see :func:`make_mesh`).
        axis_name: the mesh axis the batch and the state are split over.
        min_size: leaves with fewer elements stay replicated; 0 (default) shards every divisible leaf.

    Returns:
        The pre-update loss, the mean of the S shard losses: a 0-d float32 array replicated on the mesh.

    Raises:
        TypeError: as :func:`data_parallel_sgd_step`; ``min_size`` not an int.
        ValueError: as :func:`data_parallel_sgd_step`; ``min_size < 0``; an optimizer that is not
            elementwise or whose state is not parameter-shaped. Nothing is changed when an error is raised.
    """
    return _run("fsdp_sgd_step", "fsdp", model, optimizer, x, y, mesh, axis_name, min_size)
