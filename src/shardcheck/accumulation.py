"""Deprecated alias of :mod:`shardcheck.seeds.accumulation` (gradient accumulation, C9), kept for one release.

Import from :mod:`shardcheck.seeds` (or ``shardcheck``) instead.
"""

from shardcheck.seeds.accumulation import accumulated_sgd_step as accumulated_sgd_step
from shardcheck.seeds.accumulation import make_accumulation_optimizer as make_accumulation_optimizer
