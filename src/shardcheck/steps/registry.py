"""The one registry of strategies: name -> how its step is built from a task, and where its state lives.

Parity, the training loop, the main job, the memory estimate and the command line all read :data:`STRATEGIES`;
no other list of strategy names exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from shardcheck.steps._core import Candidate
from shardcheck.task import LossFn


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How one strategy runs a task's step.

    Attributes:
        name: the registry key (``reference``, ``simulation``, ``dp``, ``fsdp``, ``accumulation``,
            ``multiprocess``).
        summary: one line for ``--help`` and reports.
        placement: where parameters and optimizer state live: ``"single"`` (one device), ``"replicated"``
            (every device of the mesh) or ``"fsdp"`` (split over the mesh axis).
        uses_mesh: the step runs on a device mesh of ``num_shards`` devices.
        build: ``build(loss_fn, num_shards, mesh) -> Candidate``; ``mesh`` is ``None`` for single-device
            strategies.
        check: ``check(fn, model, optimizer)`` raising ``ValueError`` when the strategy cannot run this model or
            optimizer (called before any state changes), or ``None``.
    """

    name: str
    summary: str
    placement: str
    uses_mesh: bool
    build: Callable[[LossFn, int, Mesh | None], Candidate]
    check: Callable[[str, nnx.Module, nnx.Optimizer], None] | None = None


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

        strategy = "fsdp" if name == "fsdp" else "dp"
        axis = mesh.axis_names[0]

        def step(model, optimizer, batch):
            return mesh_step(strategy, loss_fn, model, optimizer, batch, mesh, axis_name=axis)

        step.__name__ = name
        return Candidate(name, step, num_shards)

    return build


def _accumulation(loss_fn, num_shards, mesh):
    from shardcheck.steps.accumulation import accumulation_candidate

    return accumulation_candidate(loss_fn, num_shards)


def _check_multiprocess(fn, model, optimizer):
    if jax.process_count() == 1:
        raise ValueError(
            f"{fn}: strategy 'multiprocess' needs several JAX processes; run under `shardcheck launch "
            "--processes P --devices-per-process N -- verify ...` (there, dp and fsdp span every process too)"
        )


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("reference", "the task's single-device step (the baseline)", "single", False, _reference),
        Strategy(
            "simulation",
            "S equal shards on one device, gradients summed then divided once (seed 000)",
            "single",
            False,
            _simulation,
        ),
        Strategy(
            "dp",
            "data parallel: batch split over the mesh, state replicated, one psum per leaf",
            "replicated",
            True,
            _mesh_strategy("dp"),
        ),
        Strategy(
            "fsdp",
            "fully sharded: parameters and optimizer state split, all-gather and reduce-scatter",
            "fsdp",
            True,
            _mesh_strategy("fsdp"),
        ),
        Strategy(
            "accumulation",
            "gradient accumulation over S micro-batches with optax.MultiSteps",
            "single",
            False,
            _accumulation,
        ),
        Strategy(
            "multiprocess",
            "data parallel on a mesh spanning every process of a launched run",
            "replicated",
            True,
            _mesh_strategy("multiprocess"),
            _check_multiprocess,
        ),
    )
}
# The strategies compared against the reference by default (multiprocess needs a launched run).
CANDIDATES = tuple(name for name in STRATEGIES if name not in ("reference", "multiprocess"))


def get_strategy(fn: str, name) -> Strategy:
    """The registered :class:`Strategy` called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"{fn}: strategy {name!r} is unknown; use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def mesh_for(fn: str, strategy: Strategy, num_shards: int, mesh: Mesh | None) -> Mesh | None:
    """The mesh a strategy runs on: ``mesh`` (its size must be ``num_shards``), else the first S devices.

    Raises:
        ValueError: fewer devices than S, or a mesh of another size.
    """
    if not strategy.uses_mesh:
        return None
    if mesh is None:
        from shardcheck.spmd import make_mesh

        if len(jax.devices()) < num_shards:
            raise ValueError(
                f"{fn}: strategy {strategy.name!r} with num_shards={num_shards} needs {num_shards} devices, but "
                f"{len(jax.devices())} exist; use fewer shards or more devices (jax_num_cpu_devices on CPU)"
            )
        return make_mesh(num_shards)
    size = int(np.prod(list(mesh.shape.values())))
    if size != num_shards:
        raise ValueError(f"{fn}: mesh has {size} devices but num_shards={num_shards}; they must agree")
    return mesh
