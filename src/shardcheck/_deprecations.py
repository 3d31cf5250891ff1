"""The one table of deprecated import paths: each old path, the canonical one, and the release it goes in.

Every public name has one import path: the top-level ``shardcheck.X`` for the names of ``shardcheck.__all__``,
else the module that defines it (``shardcheck.steps.reference.reference_step``). The seed-era alias modules
(``shardcheck.spmd``, ``baseline``, ``simulation``, ``accumulation``, ``reductions``, ``parity.legacy``), the
names ``shardcheck.parity`` re-exported from the seeds' adapter, the seeds' training names once in
``shardcheck.training``, and the second name of a pair at the top level resolve through :func:`module_getattr`:
on first use of an old path a ``DeprecationWarning`` names the old path, the new one and the release that
removes it, and the value is the canonical object itself.

This is optax's pattern (``optax/_src/deprecations.py``: a module ``__getattr__`` built from a table of
deprecated names, PEP 562), with the targets named as strings and imported on first use, so that an alias module
imports nothing (``import shardcheck`` stays free of JAX) and the engine names no adapter module in an import.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

REMOVED_IN = "0.2.0"
"""The release in which every path of :data:`MOVED` goes (the alias modules were kept for one release)."""

_TOP = "shardcheck"
_MESH_STEPS = "shardcheck.seeds.mesh_steps"
_SEED_REFERENCE = "shardcheck.seeds.reference"
_SEED_SIMULATION = "shardcheck.seeds.simulation"

MOVED: dict[str, dict[str, str]] = {
    # one name of a pair at the top level: the README and the seeds use the other (train, sgd_step, fsdp_step)
    "shardcheck": {
        "reference_step": "shardcheck.steps.reference.reference_step",
        "train_task": "shardcheck.training.train_task",
        "fsdp_sgd_step": "shardcheck.seeds.fsdp_sgd_step",
    },
    # the seeds' adapter's form of check_parity, re-exported by the engine's package
    "shardcheck.parity": {
        "assert_step_parity": f"{_TOP}.assert_step_parity",
        "check_parity": f"{_TOP}.check_parity",
    },
    # the seeds' (x, y) training, moved to shardcheck.seeds.training
    "shardcheck.training": {
        "EpochRecord": "shardcheck.seeds.training.EpochRecord",
        "TrainReport": f"{_TOP}.TrainReport",
        "select_features": "shardcheck.seeds.training.select_features",
        "split_and_standardize": "shardcheck.seeds.training.split_and_standardize",
        "train": f"{_TOP}.train",
    },
    # the seed-era alias modules
    "shardcheck.spmd": {
        "make_mesh": f"{_TOP}.make_mesh",
        "LeafPlacement": f"{_TOP}.LeafPlacement",
        "placement_report": f"{_TOP}.placement_report",
        "placement_summary": f"{_TOP}.placement_summary",
        "STRATEGIES": f"{_MESH_STEPS}.STRATEGIES",
        "_prepare": f"{_MESH_STEPS}._prepare",
        "check_batch_divisible": f"{_MESH_STEPS}.check_batch_divisible",
        "check_mesh": f"{_MESH_STEPS}.check_mesh",
        "check_min_size": f"{_MESH_STEPS}.check_min_size",
        "check_params_only": f"{_MESH_STEPS}.check_params_only",
        "data_parallel_sgd_step": f"{_TOP}.data_parallel_sgd_step",
        "fsdp_sgd_step": "shardcheck.seeds.fsdp_sgd_step",
        "trace_sgd_step": "shardcheck.seeds.trace_sgd_step",
    },
    "shardcheck.baseline": {
        "_fsdp_step_jit": f"{_SEED_REFERENCE}._fsdp_step_jit",
        "_sgd_step_jit": f"{_SEED_REFERENCE}._sgd_step_jit",
        "fresh_linear": "shardcheck.seeds.fresh_linear",
        "fsdp_step": f"{_TOP}.fsdp_step",
        "sgd_step": f"{_TOP}.sgd_step",
        "validate_entrypoint": f"{_SEED_REFERENCE}.validate_entrypoint",
    },
    "shardcheck.simulation": {
        "ReducedStep": f"{_TOP}.ReducedStep",
        "_reduced_step_jit": f"{_SEED_SIMULATION}._reduced_step_jit",
        "_simulated_step_jit": f"{_SEED_SIMULATION}._simulated_step_jit",
        "apply_reduced_update": f"{_SEED_SIMULATION}.apply_reduced_update",
        "reduced_sgd_step": f"{_TOP}.reduced_sgd_step",
        "simulated_data_parallel_step": f"{_TOP}.simulated_data_parallel_step",
        "split_shards": f"{_SEED_SIMULATION}.split_shards",
    },
    "shardcheck.accumulation": {
        "accumulated_sgd_step": f"{_TOP}.accumulated_sgd_step",
        "make_accumulation_optimizer": f"{_TOP}.make_accumulation_optimizer",
    },
    "shardcheck.reductions": {
        "tree_mean": f"{_TOP}.tree_mean",
        "tree_sum": f"{_TOP}.tree_sum",
    },
    "shardcheck.parity.legacy": {
        name: f"shardcheck.seeds.parity.{name}"
        for name in (
            "adapt_candidate",
            "adapt_step",
            "regression_batches",
            "regression_loss",
            "regression_task",
        )
    },
}
"""``{old module: {name: canonical dotted path}}``: every deprecated import path of the package."""


def message(module: str, name: str) -> str:
    """The warning text for the old path ``module.name``: the old path, the new one, the release it goes in."""
    new = MOVED[module][name]
    where, _, attr = new.rpartition(".")
    return (
        f"{module}.{name} is deprecated and will be removed in shardcheck {REMOVED_IN}; use {new} "
        f"(from {where} import {attr})"
    )


def canonical(module: str, name: str):
    """The object at the canonical path of the deprecated ``module.name``, imported now; no warning."""
    where, _, attr = MOVED[module][name].rpartition(".")
    return getattr(importlib.import_module(where), attr)


def module_getattr(module: str, fallback: Callable[[str], object] | None = None) -> Callable[[str], object]:
    """A PEP 562 module ``__getattr__`` for ``module`` that resolves its deprecated names of :data:`MOVED`.

    Args:
        module: the dotted name of the module whose ``__getattr__`` this is (its ``__name__``).
        fallback: called with a name that is not deprecated (a package's own lazy exports); None raises
            ``AttributeError``.

    Returns:
        ``__getattr__(name)``: for a deprecated name, warns ``DeprecationWarning`` (:func:`message`) at the
        caller's line and returns the canonical object (not cached, so every use warns).

    Raises:
        ValueError: ``module`` has no entry in :data:`MOVED` (a programming error, raised at import).
    """
    if module not in MOVED:
        raise ValueError(
            f"module_getattr: module={module!r} has no deprecated names; add it to MOVED or drop it"
        )
    names = MOVED[module]

    def __getattr__(name: str):
        if name in names:
            warnings.warn(message(module, name), DeprecationWarning, stacklevel=2)
            return canonical(module, name)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
