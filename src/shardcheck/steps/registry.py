"""The one registry of strategies: name -> how its step is built from a task, and where its state lives.

Parity, the training loop, the main job, the memory estimate and the command line all read :data:`STRATEGIES`;
no other list of strategy names exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from shardcheck._catalog import CANDIDATES as CANDIDATES
from shardcheck._catalog import STRATEGY_SPECS, StrategySpec
from shardcheck.mesh import batch_axes, check_mesh, data_shards
from shardcheck.steps._core import Candidate
from shardcheck.task import LossFn


@dataclasses.dataclass(frozen=True)
class Strategy(StrategySpec):
    """How one strategy runs a task's step: its :class:`~shardcheck._catalog.StrategySpec` (name, summary,
    placement, uses_mesh, wraps_optimizer) and its step.

    Attributes:
        build: ``build(loss_fn, num_shards, mesh) -> Candidate``; ``mesh`` is ``None`` for single-device
            strategies.
        check: ``check(fn, model, optimizer)`` raising ``ValueError`` when the strategy cannot run this model or
            optimizer (called before any state changes), or ``None``.
        jit_step: ``jit_step(loss_fn, graphdef, treedef, specs, param_specs, mesh)``: the jitted program one step
            of the strategy runs, ``(state_leaves, batch) -> (loss, state_leaves)`` with the state placed by
            ``specs`` on ``mesh`` (and donated), for lowering it on abstract or real inputs (the memory
            measurement, the ahead-of-time compile); ``None`` for a step that is not one such program.
    """

    build: Callable[[LossFn, int, Mesh | None], Candidate] = dataclasses.field(kw_only=True)
    check: Callable[[str, nnx.Module, nnx.Optimizer], None] | None = dataclasses.field(
        default=None, kw_only=True
    )
    jit_step: Callable[..., Callable] | None = dataclasses.field(default=None, kw_only=True)


def _reference(loss_fn, num_shards, mesh):
    from shardcheck.steps.reference import reference_step

    def reference(model, optimizer, batch):
        return reference_step(loss_fn, model, optimizer, batch)

    return Candidate("reference", reference, num_shards)


def _simulation(loss_fn, num_shards, mesh):
    from shardcheck.steps.simulation import simulation_step

    def simulation(model, optimizer, batch):
        return simulation_step(loss_fn, num_shards, model, optimizer, batch)

    return Candidate("simulation", simulation, num_shards)


def _mesh_strategy(name: str):
    def build(loss_fn, num_shards, mesh):
        from shardcheck.steps.sharded import mesh_step

        def step(model, optimizer, batch):  # the gradients too: the parity check compares them
            return mesh_step(name, loss_fn, model, optimizer, batch, mesh, with_grads=True)

        step.__name__ = name
        return Candidate(name, step, num_shards)

    return build


def _mesh_jit_step(name: str):
    def jit_step(loss_fn, graphdef, treedef, specs, param_specs, mesh):
        from shardcheck.steps.sharded import compiled_step

        return compiled_step(name, loss_fn, graphdef, treedef, specs, param_specs, mesh)

    return jit_step


def _reference_jit_step(loss_fn, graphdef, treedef, specs, param_specs, mesh):
    from shardcheck.steps.reference import reference_jit_step

    return reference_jit_step(loss_fn, graphdef, treedef, specs, mesh)


def _accumulation(loss_fn, num_shards, mesh):
    from shardcheck.steps.accumulation import accumulation_candidate

    return accumulation_candidate(loss_fn, num_shards)


def _check_multiprocess(fn, model, optimizer):
    if jax.process_count() == 1:
        raise ValueError(
            f"{fn}: strategy 'multiprocess' needs several JAX processes; run under `shardcheck launch "
            "--processes P --devices-per-process N -- verify ...` (there, dp and fsdp span every process too)"
        )


_BUILDERS = {
    "reference": _reference,
    "simulation": _simulation,
    "dp": _mesh_strategy("dp"),
    "fsdp": _mesh_strategy("fsdp"),
    "gspmd": _mesh_strategy("gspmd"),
    "accumulation": _accumulation,
    "multiprocess": _mesh_strategy("multiprocess"),
}
_CHECKS = {"multiprocess": _check_multiprocess}
_JIT_STEPS = {
    "reference": _reference_jit_step,
    "dp": _mesh_jit_step("dp"),
    "fsdp": _mesh_jit_step("fsdp"),
    "gspmd": _mesh_jit_step("gspmd"),
    "multiprocess": _mesh_jit_step("dp"),
}

# The names, summaries and placements are the catalog's (importable without JAX, for the command line).
STRATEGIES: dict[str, Strategy] = {
    name: Strategy(
        **dataclasses.asdict(spec),
        build=_BUILDERS[name],
        check=_CHECKS.get(name),
        jit_step=_JIT_STEPS.get(name),
    )
    for name, spec in STRATEGY_SPECS.items()
}


def get_strategy(fn: str, name) -> Strategy:
    """The registered :class:`Strategy` called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"{fn}: strategy {name!r} is unknown; use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def mesh_for(fn: str, strategy: Strategy, num_shards: int, mesh: Mesh | None) -> Mesh | None:
    """The mesh a strategy runs on: ``mesh`` (its batch shards must number ``num_shards``), else the first S
    devices.

    The batch is split over the mesh's batch axes (:func:`shardcheck.mesh.batch_axes`), so S is
    :func:`shardcheck.mesh.data_shards`: ``mesh.size`` unless the mesh has model axes (``data=2,model=4``: S = 2).

    Raises:
        TypeError: ``mesh`` not a ``jax.sharding.Mesh``.
        ValueError: fewer devices than S, or a mesh of another number of batch shards.
    """
    if not strategy.uses_mesh:
        return None
    if mesh is None:
        from shardcheck.devices import select_devices
        from shardcheck.mesh import make_mesh

        what = f"strategy {strategy.name!r} with num_shards={num_shards}"
        return make_mesh(num_shards, devices=select_devices(num_shards, what=what, fn=fn).devices)
    check_mesh(fn, mesh)
    shards = data_shards(mesh)
    if shards != num_shards:
        if shards == mesh.size:
            why = "the batch is split over every device"
        else:
            why = f"the batch is split over its axes {batch_axes(mesh)} ({shards} shards), replicated over the others"
        raise ValueError(
            f"{fn}: the mesh {dict(mesh.shape)} has {mesh.size} devices but num_shards={num_shards}; {why}, so pass "
            f"num_shards={shards} (or a mesh of {num_shards} batch shards)"
        )
    return mesh
