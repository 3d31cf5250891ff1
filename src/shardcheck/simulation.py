"""Deprecated alias of :mod:`shardcheck.seeds.simulation` (seed 000's reduction), removed in shardcheck 0.2.0.

Every name here resolves on first use through the one deprecation table, :data:`shardcheck._deprecations.MOVED`,
with a ``DeprecationWarning`` that names its canonical import path.
"""

from shardcheck import _deprecations

__getattr__ = _deprecations.module_getattr(__name__)


def __dir__():
    return sorted(_deprecations.MOVED[__name__])
