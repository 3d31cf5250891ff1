"""Leafwise reductions of gradient trees: sum matching leaves, then divide once.

The arithmetic of seed ``000_f7b4ea9cf28c5420.txt``::

    summed = tree_map(sum corresponding leaves, shard gradients)
    average = tree_map(divide by shard count, summed)

Kernel leaves meet only kernel leaves and bias only bias; the division happens once, after the sum.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax

from shardcheck._tree import path_str

PyTree = Any


def _check_same_structure(fn: str, trees: Sequence[PyTree]) -> None:
    if isinstance(trees, dict) or not isinstance(trees, Sequence) or isinstance(trees, str):
        raise TypeError(
            f"{fn}: trees must be a sequence (list or tuple) of pytrees, got {type(trees).__name__}"
        )
    if len(trees) == 0:
        raise ValueError(f"{fn}: trees is empty; pass at least one gradient tree")
    ref, ref_def = jax.tree_util.tree_flatten_with_path(trees[0])
    ref_paths = [repr(path_str(p) or "<root>") for p, _ in ref]
    for i, tree in enumerate(trees[1:], start=1):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths = [repr(path_str(p) or "<root>") for p, _ in leaves]
        if treedef != ref_def:
            only_ref = [p for p in ref_paths if p not in paths]
            only_this = [p for p in paths if p not in ref_paths]
            if only_ref or only_this:
                where = f"{(only_ref or only_this)[0]} (present in tree {0 if only_ref else i} only)"
            else:
                first = next((a for a, b in zip(ref_paths, paths, strict=True) if a != b), "'<root>'")
                where = f"{first} (node types differ)"
            raise ValueError(
                f"{fn}: tree {i} differs in structure from tree 0 at path {where}; every shard's gradient tree "
                "must have the same leaves (kernel with kernel, bias with bias)"
            )
        for path, (_, a), (_, b) in zip(ref_paths, ref, leaves, strict=True):
            if jax.numpy.shape(a) != jax.numpy.shape(b):
                raise ValueError(
                    f"{fn}: leaf {path} of tree {i} has shape {jax.numpy.shape(b)}, but tree 0 has "
                    f"{jax.numpy.shape(a)}; matching leaves must have the same shape"
                )


def _leafwise_sum(trees: Sequence[PyTree]) -> PyTree:
    return jax.tree.map(lambda *leaves: functools.reduce(operator.add, leaves), *trees)


def tree_sum(trees: Sequence[PyTree]) -> PyTree:
    """Leafwise sum of same-structured pytrees (the first half of seed 000's reduction).

    Args:
        trees: S >= 1 pytrees with identical structure; matching leaves share shape and dtype.

    Returns:
        A pytree of the same structure; each leaf is the sum of the S matching leaves, in the input order.

    Raises:
        TypeError: if ``trees`` is not a sequence.
        ValueError: if ``trees`` is empty, or two trees differ in structure or in a leaf's shape (the message
            names the first differing path).

    Example::

        >>> import jax.numpy as jnp
        >>> g = [{"bias": jnp.array([1.0, 3.0])}, {"bias": jnp.array([5.0, 7.0])}]
        >>> tree_sum(g)["bias"]
        Array([ 6., 10.], dtype=float32)
    """
    _check_same_structure("tree_sum", trees)
    return _leafwise_sum(trees)


def tree_mean(trees: Sequence[PyTree]) -> PyTree:
    """Leafwise mean of same-structured pytrees: sum matching leaves, then divide by their count.

    This is the reduction of seed ``000_f7b4ea9cf28c5420.txt``: kernel leaves are combined only with kernel
    leaves, bias only with bias; the division happens once, after the sum.

    Args:
        trees: S >= 1 pytrees with identical structure; matching leaves share shape and dtype.

    Returns:
        A pytree with the same structure; each leaf has the shape and dtype of its inputs.

    Raises:
        TypeError: if ``trees`` is not a sequence.
        ValueError: if ``trees`` is empty, or two trees differ in structure or in a leaf's shape (the message
            names the first differing path).

    Example (the seed's two-shard reduction)::

        >>> import jax.numpy as jnp
        >>> g = [{"kernel": jnp.array([[2.0, 4.0]])}, {"kernel": jnp.array([[6.0, 8.0]])}]
        >>> tree_mean(g)["kernel"]
        Array([[4., 6.]], dtype=float32)
    """
    _check_same_structure("tree_mean", trees)
    return jax.tree.map(lambda leaf: leaf / len(trees), _leafwise_sum(trees))
