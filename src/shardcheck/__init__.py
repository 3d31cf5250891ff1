"""shardcheck: prove that a sharded JAX / Flax NNX training step computes the update you meant."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from shardcheck import _deprecations

__version__ = "0.1.0"

# Each export and the module it comes from: imported on first use (PEP 562), so that `import shardcheck`
# (and `shardcheck --help`) does not import JAX, Flax and optax.
_EXPORTS = {
    "accumulated_sgd_step": "shardcheck.seeds",
    "make_accumulation_optimizer": "shardcheck.seeds",
    "fsdp_step": "shardcheck.seeds",
    "sgd_step": "shardcheck.seeds",
    "mse_loss": "shardcheck.losses",
    "weighted_squared_error": "shardcheck.losses",
    "LeafMemory": "shardcheck.memory",
    "MemoryEstimate": "shardcheck.memory",
    "MemoryMeasurement": "shardcheck.memory",
    "estimate_memory": "shardcheck.memory",
    "measure_memory": "shardcheck.memory",
    "measure_step": "shardcheck.memory",
    "compile_ahead_of_time": "shardcheck.ahead_of_time",
    "AheadOfTimeMemory": "shardcheck.ahead_of_time",
    "parse_device_memory": "shardcheck.device_memory",
    "MLP": "shardcheck.models",
    "make_model": "shardcheck.models",
    "make_tx": "shardcheck.optimizers",
    "Candidate": "shardcheck.parity",
    "CandidateError": "shardcheck.parity",
    "Diagnosis": "shardcheck.parity",
    "LeafError": "shardcheck.parity",
    "ParityError": "shardcheck.parity",
    "ParityReport": "shardcheck.parity",
    "StepRecord": "shardcheck.parity",
    "Tolerance": "shardcheck.parity",
    "assert_step_parity": "shardcheck.seeds.parity",
    "check_parity": "shardcheck.seeds.parity",
    "derive_tolerance": "shardcheck.parity",
    "strategy_candidate": "shardcheck.parity",
    "Recording": "shardcheck.parity.harness.recorded",
    "load_recording": "shardcheck.parity.harness.recorded",
    "record_run": "shardcheck.parity.harness.recorded",
    "RunComparison": "shardcheck.parity.comparison.digest",
    "compare_run": "shardcheck.parity.comparison.digest",
    "LeafPlacement": "shardcheck.placement",
    "placement_report": "shardcheck.placement",
    "placement_summary": "shardcheck.placement",
    "tree_mean": "shardcheck.seeds",
    "tree_sum": "shardcheck.seeds",
    "ReducedStep": "shardcheck.seeds",
    "reduced_sgd_step": "shardcheck.seeds",
    "simulated_data_parallel_step": "shardcheck.seeds",
    "data_parallel_sgd_step": "shardcheck.seeds",
    "make_mesh": "shardcheck.mesh",
    "STRATEGIES": "shardcheck.steps",
    "StepResult": "shardcheck.steps",
    "Strategy": "shardcheck.steps",
    "Task": "shardcheck.task",
    "load_task": "shardcheck.tasks",
    "run_task": "shardcheck.runner",
    "TrainReport": "shardcheck.seeds.training",
    "train": "shardcheck.seeds.training",
}

if TYPE_CHECKING:
    from shardcheck.ahead_of_time import AheadOfTimeMemory as AheadOfTimeMemory
    from shardcheck.ahead_of_time import compile_ahead_of_time as compile_ahead_of_time
    from shardcheck.device_memory import parse_device_memory as parse_device_memory
    from shardcheck.losses import mse_loss as mse_loss
    from shardcheck.losses import weighted_squared_error as weighted_squared_error
    from shardcheck.memory import LeafMemory as LeafMemory
    from shardcheck.memory import MemoryEstimate as MemoryEstimate
    from shardcheck.memory import MemoryMeasurement as MemoryMeasurement
    from shardcheck.memory import estimate_memory as estimate_memory
    from shardcheck.memory import measure_memory as measure_memory
    from shardcheck.memory import measure_step as measure_step
    from shardcheck.mesh import make_mesh as make_mesh
    from shardcheck.models import MLP as MLP
    from shardcheck.models import make_model as make_model
    from shardcheck.optimizers import make_tx as make_tx
    from shardcheck.parity import Candidate as Candidate
    from shardcheck.parity import CandidateError as CandidateError
    from shardcheck.parity import Diagnosis as Diagnosis
    from shardcheck.parity import LeafError as LeafError
    from shardcheck.parity import ParityError as ParityError
    from shardcheck.parity import ParityReport as ParityReport
    from shardcheck.parity import StepRecord as StepRecord
    from shardcheck.parity import Tolerance as Tolerance
    from shardcheck.parity import derive_tolerance as derive_tolerance
    from shardcheck.parity import strategy_candidate as strategy_candidate
    from shardcheck.parity.comparison.digest import RunComparison as RunComparison
    from shardcheck.parity.comparison.digest import compare_run as compare_run
    from shardcheck.parity.harness.recorded import Recording as Recording
    from shardcheck.parity.harness.recorded import load_recording as load_recording
    from shardcheck.parity.harness.recorded import record_run as record_run
    from shardcheck.placement import LeafPlacement as LeafPlacement
    from shardcheck.placement import placement_report as placement_report
    from shardcheck.placement import placement_summary as placement_summary
    from shardcheck.runner import run_task as run_task
    from shardcheck.seeds import ReducedStep as ReducedStep
    from shardcheck.seeds import accumulated_sgd_step as accumulated_sgd_step
    from shardcheck.seeds import data_parallel_sgd_step as data_parallel_sgd_step
    from shardcheck.seeds import fsdp_step as fsdp_step
    from shardcheck.seeds import (
        make_accumulation_optimizer as make_accumulation_optimizer,
    )
    from shardcheck.seeds import reduced_sgd_step as reduced_sgd_step
    from shardcheck.seeds import sgd_step as sgd_step
    from shardcheck.seeds import (
        simulated_data_parallel_step as simulated_data_parallel_step,
    )
    from shardcheck.seeds import tree_mean as tree_mean
    from shardcheck.seeds import tree_sum as tree_sum
    from shardcheck.seeds.parity import assert_step_parity as assert_step_parity
    from shardcheck.seeds.parity import check_parity as check_parity
    from shardcheck.seeds.training import TrainReport as TrainReport
    from shardcheck.seeds.training import train as train
    from shardcheck.steps import STRATEGIES as STRATEGIES
    from shardcheck.steps import StepResult as StepResult
    from shardcheck.steps import Strategy as Strategy
    from shardcheck.task import Task as Task
    from shardcheck.tasks import load_task as load_task


def _export(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule used as an attribute (shardcheck.spmd) was imported by the eager version
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# The other name of a pair (reference_step beside sgd_step, train_task beside train, fsdp_sgd_step beside
# fsdp_step) is imported from its own module; its old path here warns through the one deprecation table.
__getattr__ = _deprecations.module_getattr(__name__, fallback=_export)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "AheadOfTimeMemory",
    "Candidate",
    "CandidateError",
    "Diagnosis",
    "LeafError",
    "LeafMemory",
    "LeafPlacement",
    "MLP",
    "MemoryEstimate",
    "MemoryMeasurement",
    "ParityError",
    "ParityReport",
    "Recording",
    "ReducedStep",
    "RunComparison",
    "STRATEGIES",
    "StepResult",
    "Strategy",
    "Task",
    "StepRecord",
    "Tolerance",
    "TrainReport",
    "accumulated_sgd_step",
    "assert_step_parity",
    "check_parity",
    "compare_run",
    "compile_ahead_of_time",
    "data_parallel_sgd_step",
    "derive_tolerance",
    "estimate_memory",
    "fsdp_step",
    "load_recording",
    "load_task",
    "make_accumulation_optimizer",
    "make_mesh",
    "make_model",
    "make_tx",
    "measure_memory",
    "measure_step",
    "mse_loss",
    "parse_device_memory",
    "placement_report",
    "placement_summary",
    "record_run",
    "reduced_sgd_step",
    "run_task",
    "sgd_step",
    "simulated_data_parallel_step",
    "strategy_candidate",
    "train",
    "tree_mean",
    "tree_sum",
    "weighted_squared_error",
]
