"""Deprecated alias of :mod:`shardcheck.seeds.reductions` (seed 000's leafwise reduction), kept for one release.

Import from :mod:`shardcheck.seeds` (or ``shardcheck``) instead.
"""

from shardcheck.seeds.reductions import tree_mean as tree_mean
from shardcheck.seeds.reductions import tree_sum as tree_sum
