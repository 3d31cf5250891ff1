"""Deprecated alias of :mod:`shardcheck.seeds.reference` (seed 001's baseline), kept for one release.

Import from :mod:`shardcheck.seeds` (or ``shardcheck``) instead.
"""

from shardcheck.seeds.reference import _fsdp_step_jit as _fsdp_step_jit
from shardcheck.seeds.reference import _sgd_step_jit as _sgd_step_jit
from shardcheck.seeds.reference import fresh_linear as fresh_linear
from shardcheck.seeds.reference import fsdp_step as fsdp_step
from shardcheck.seeds.reference import sgd_step as sgd_step
from shardcheck.seeds.reference import validate_entrypoint as validate_entrypoint
