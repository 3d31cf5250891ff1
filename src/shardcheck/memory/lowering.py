"""The step of a layout or strategy, lowered for its placed state and batch: real arrays or abstract shapes.

The program lowered is the one the strategy runs (:func:`~shardcheck.memory.layouts.step_builder`: the registry's
``Strategy.jit_step``, or the memory-only ``zero_step``), over the state placed by
:func:`~shardcheck.memory.layouts.layout_shardings` and the batch split over every mesh axis; XLA's
``memory_analysis()`` of the compiled, SPMD-partitioned executable gives one device's figures
(``jax.stages.Compiled.memory_analysis``, ``CompiledMemoryStats``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardcheck.memory.layouts import layout_shardings, run_mesh, step_builder
from shardcheck.mesh import batch_axes


def data_sharding(mesh) -> NamedSharding:
    """The batch's sharding: the leading dimension split over every axis (:func:`shardcheck.mesh.batch_axes`)."""
    axes = batch_axes(mesh)
    return NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))


def _argument(a, sharding):
    """A ``jax.ShapeDtypeStruct`` with ``sharding`` for an abstract leaf; a real leaf copied onto ``sharding``."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.device_put(
        jnp.copy(a), sharding
    )  # copied: the steps donate their state, the caller's survives


def lower_step(strategy: str, loss_fn, model, optimizer, batch, mesh: jax.sharding.Mesh):
    """Lower the step ``strategy`` runs, for this state and batch: real arrays or abstract shapes alike.

    The step is the strategy's own program (:func:`~shardcheck.memory.layouts.step_builder`), on ``mesh`` or, for
    a one-device layout (``"replicated"``), on its first device
    (:func:`~shardcheck.memory.layouts.run_mesh`). The state is placed by
    :func:`~shardcheck.memory.layouts.layout_shardings`, the batch split over every mesh axis. A leaf that is a
    ``jax.ShapeDtypeStruct`` (from ``nnx.eval_shape``, or a batch of shapes) becomes a ``jax.ShapeDtypeStruct``
    with its target sharding, so nothing is allocated; a real leaf is copied onto it.

    Returns:
        ``(lowered, arguments, treedef)``: the ``jax.stages.Lowered`` step ``(state_leaves, batch) -> (loss,
        state_leaves)``, the arguments it takes (for a real run: ``lowered.compile()(*arguments)``), and the
        treedef of the state leaves.

    Raises:
        ValueError: an annotation the mesh cannot honour.
    """
    devices = run_mesh(strategy, mesh)
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    state_shardings, grad_shardings = layout_shardings(strategy, model, optimizer, devices, fn=strategy)
    data = data_sharding(devices)
    args = (
        [_argument(a, s) for a, s in zip(leaves, state_shardings, strict=True)],
        jax.tree.map(lambda a: _argument(a, data), batch),
    )
    specs = tuple(s.spec for s in state_shardings)
    param_specs = tuple(s.spec for s in grad_shardings)
    step = step_builder(strategy)(loss_fn, graphdef, treedef, specs, param_specs, devices)
    return step.lower(*args), args, treedef


def run_lowered(lowered, args, treedef, model, optimizer):
    """Compile ``lowered``, run it once on ``args`` and write the new state into ``model`` and ``optimizer``."""
    compiled = lowered.compile()
    _, out = compiled(*args)
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, out))
    return compiled


def memory_stats(compiled) -> dict[str, int]:
    """XLA's per-device figures of a compiled step, and ``peak_bytes = argument + output - alias + temp``.

    Raises:
        ValueError: a backend that returns no ``memory_analysis()``.
    """
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
