"""shardcheck: prove that a sharded JAX / Flax NNX training step computes the update you meant."""

from shardcheck.baseline import fsdp_step as fsdp_step
from shardcheck.baseline import sgd_step as sgd_step
from shardcheck.losses import mse_loss as mse_loss
from shardcheck.losses import weighted_squared_error as weighted_squared_error
from shardcheck.memory import LeafMemory as LeafMemory
from shardcheck.memory import MemoryEstimate as MemoryEstimate
from shardcheck.memory import MemoryMeasurement as MemoryMeasurement
from shardcheck.memory import estimate_memory as estimate_memory
from shardcheck.memory import measure_memory as measure_memory
from shardcheck.models import MLP as MLP
from shardcheck.models import make_model as make_model
from shardcheck.optimizers import make_tx as make_tx
from shardcheck.placement import LeafPlacement as LeafPlacement
from shardcheck.placement import placement_report as placement_report
from shardcheck.placement import placement_summary as placement_summary
from shardcheck.reductions import tree_mean as tree_mean
from shardcheck.reductions import tree_sum as tree_sum
from shardcheck.simulation import ReducedStep as ReducedStep
from shardcheck.simulation import reduced_sgd_step as reduced_sgd_step
from shardcheck.simulation import simulated_data_parallel_step as simulated_data_parallel_step
from shardcheck.spmd import data_parallel_sgd_step as data_parallel_sgd_step
from shardcheck.spmd import fsdp_sgd_step as fsdp_sgd_step
from shardcheck.spmd import make_mesh as make_mesh
from shardcheck.train import TrainReport as TrainReport
from shardcheck.train import train as train

__version__ = "0.1.0"

__all__ = [
    "LeafMemory",
    "LeafPlacement",
    "MLP",
    "MemoryEstimate",
    "MemoryMeasurement",
    "ReducedStep",
    "TrainReport",
    "data_parallel_sgd_step",
    "estimate_memory",
    "fsdp_sgd_step",
    "fsdp_step",
    "make_mesh",
    "make_model",
    "make_tx",
    "measure_memory",
    "mse_loss",
    "placement_report",
    "placement_summary",
    "reduced_sgd_step",
    "sgd_step",
    "simulated_data_parallel_step",
    "train",
    "tree_mean",
    "tree_sum",
    "weighted_squared_error",
]
