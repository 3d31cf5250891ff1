"""Deprecated alias of :mod:`shardcheck.seeds.simulation` (seed 000's reduction), kept for one release.

Import from :mod:`shardcheck.seeds` (or ``shardcheck``) instead.
"""

from shardcheck.seeds.simulation import ReducedStep as ReducedStep
from shardcheck.seeds.simulation import _reduced_step_jit as _reduced_step_jit
from shardcheck.seeds.simulation import _simulated_step_jit as _simulated_step_jit
from shardcheck.seeds.simulation import apply_reduced_update as apply_reduced_update
from shardcheck.seeds.simulation import reduced_sgd_step as reduced_sgd_step
from shardcheck.seeds.simulation import simulated_data_parallel_step as simulated_data_parallel_step
from shardcheck.seeds.simulation import split_shards as split_shards
