"""The seeds' ``(model, optimizer, x, y)`` API, as thin adapters over the Task engine.

Seeds ``000_f7b4ea9cf28c5420.txt`` (the gradient-reduction simulation) and ``001_a85d1499a1a85057.txt`` (the
single-device SGD baseline) and the cases of ``docs/reduction_cases.md`` are stated for an ``nnx.Linear`` under
MSE on ``(x, y)`` arrays. Each entrypoint here validates ``x``/``y`` (:func:`shardcheck._validate.check_batch`),
frames the regression task (loss :func:`shardcheck.losses.mse_batch_loss` of the batch ``(x, y)``) and calls the
engine's step of the registered strategy (:data:`shardcheck.steps.STRATEGIES`):

* :func:`sgd_step`, :func:`fsdp_step`: the ``reference`` step (seed 001);
* :func:`simulated_data_parallel_step`: the ``simulation`` step (seed 000); :func:`reduced_sgd_step` is the
  seed's reduction with its saved per-shard gradient trees and weighted (uneven, masked) shards;
* :func:`data_parallel_sgd_step`, :func:`fsdp_sgd_step`, :func:`trace_sgd_step`: the ``dp`` / ``fsdp`` mesh steps;
* :func:`accumulated_sgd_step`: the ``accumulation`` step (C9);
* :func:`tree_sum`, :func:`tree_mean`: seed 000's leafwise reduction of gradient trees.
* :func:`run_strategies`: the seed form of the main job, :func:`shardcheck.runner.run_task`
  on the seed task; :mod:`shardcheck.seeds.parity`: the ``(model, optimizer, batches)`` form of ``check_parity``.
* :func:`train`: the regression training on an ``(x, y)`` data set (test split, shuffled mini-batches, train and
  test loss per epoch), :func:`shardcheck.training.train_task` on the seed task.

The old module paths (``shardcheck.baseline``, ``shardcheck.simulation``, ``shardcheck.spmd``,
``shardcheck.accumulation``, ``shardcheck.reductions``) are deprecated aliases of these modules;
``shardcheck.training.train`` (and its report) is a deprecated alias of :func:`train`.
"""

from shardcheck.seeds.accumulation import accumulated_sgd_step as accumulated_sgd_step
from shardcheck.seeds.accumulation import make_accumulation_optimizer as make_accumulation_optimizer
from shardcheck.seeds.mesh_steps import data_parallel_sgd_step as data_parallel_sgd_step
from shardcheck.seeds.mesh_steps import fsdp_sgd_step as fsdp_sgd_step
from shardcheck.seeds.mesh_steps import trace_sgd_step as trace_sgd_step
from shardcheck.seeds.reductions import tree_mean as tree_mean
from shardcheck.seeds.reductions import tree_sum as tree_sum
from shardcheck.seeds.reference import fresh_linear as fresh_linear
from shardcheck.seeds.reference import fsdp_step as fsdp_step
from shardcheck.seeds.reference import sgd_step as sgd_step
from shardcheck.seeds.run import run_strategies as run_strategies
from shardcheck.seeds.simulation import ReducedStep as ReducedStep
from shardcheck.seeds.simulation import reduced_sgd_step as reduced_sgd_step
from shardcheck.seeds.simulation import simulated_data_parallel_step as simulated_data_parallel_step
from shardcheck.seeds.training import TrainReport as TrainReport
from shardcheck.seeds.training import train as train

__all__ = [
    "ReducedStep",
    "TrainReport",
    "accumulated_sgd_step",
    "data_parallel_sgd_step",
    "fresh_linear",
    "fsdp_sgd_step",
    "fsdp_step",
    "make_accumulation_optimizer",
    "reduced_sgd_step",
    "run_strategies",
    "sgd_step",
    "simulated_data_parallel_step",
    "trace_sgd_step",
    "train",
    "tree_mean",
    "tree_sum",
]
