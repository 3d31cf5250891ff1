"""Readable names for pytree leaves, shared by the parity report, the memory estimate and the main job."""

from __future__ import annotations

import jax


def path_str(path, sep: str = ".") -> str:
    """A ``jax.tree_util`` key path as ``"hidden.kernel"`` (``sep`` between the parts).

    Dict keys, sequence indices and attribute names become the parts; the ``value`` attribute of an
    ``nnx.Variable`` is left out, so a parameter reads as ``"kernel"``, not ``"kernel.value"``.
    """
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return sep.join(parts)
