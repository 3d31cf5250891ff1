"""Deprecated alias of :mod:`shardcheck.seeds.mesh_steps` (the ``(x, y)`` mesh steps), kept for one release.

Import from :mod:`shardcheck.seeds` (or ``shardcheck``) instead.
"""

from shardcheck.mesh import make_mesh as make_mesh
from shardcheck.placement import LeafPlacement as LeafPlacement
from shardcheck.placement import placement_report as placement_report
from shardcheck.placement import placement_summary as placement_summary
from shardcheck.seeds.mesh_steps import STRATEGIES as STRATEGIES
from shardcheck.seeds.mesh_steps import _prepare as _prepare
from shardcheck.seeds.mesh_steps import check_batch_divisible as check_batch_divisible
from shardcheck.seeds.mesh_steps import check_mesh as check_mesh
from shardcheck.seeds.mesh_steps import check_min_size as check_min_size
from shardcheck.seeds.mesh_steps import check_params_only as check_params_only
from shardcheck.seeds.mesh_steps import data_parallel_sgd_step as data_parallel_sgd_step
from shardcheck.seeds.mesh_steps import fsdp_sgd_step as fsdp_sgd_step
from shardcheck.seeds.mesh_steps import trace_sgd_step as trace_sgd_step
