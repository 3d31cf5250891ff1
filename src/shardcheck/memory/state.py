"""The training state memory sizes: ``(model, nnx.Optimizer)`` from shapes alone, and the checks of its inputs.

Every form :func:`~shardcheck.memory.estimate_memory` takes (a :class:`~shardcheck.Task`, an ``nnx.Module`` real or
from ``nnx.eval_shape``, an ``nnx.State`` or a plain parameter pytree) becomes one ``(model, optimizer)`` pair, an
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` traced by ``nnx.eval_shape`` (nothing allocated): the optimizer state
is what ``tx.init`` really returns, and inherits the parameters' ``nnx.with_partitioning`` annotations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck._tree import path_str
from shardcheck.optimizers import OPTIMIZERS, make_tx
from shardcheck.steps.sharded_init import abstract_training_state as abstract_training_state
from shardcheck.task import Task

PyTree = Any

CATEGORIES = ("params", "model_state", "grads", "optimizer", "step")
"""The categories of :class:`~shardcheck.memory.LeafMemory`: parameters, the model's other variables (RNG stream
keys and counts; none for most models), gradients, optax state, NNX's optimizer step counter."""

DTYPES = ("float32", "bfloat16")
"""The parameter dtypes the CLI offers; :func:`~shardcheck.memory.estimate_memory` takes any floating dtype."""


def check_param_dtype(fn: str, param_dtype) -> np.dtype:
    """``param_dtype`` must name a floating dtype (``"float32"``, ``"bfloat16"``, ``jnp.float16``, ...)."""
    try:
        dtype = jnp.dtype(param_dtype)
    except TypeError as err:
        raise ValueError(
            f"{fn}: param_dtype={param_dtype!r} is not a dtype; use a floating dtype such as "
            f"{' or '.join(repr(d) for d in DTYPES)}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{fn}: param_dtype={param_dtype!r} is not a floating dtype; parameters are trained in floating "
            f"point: use {' or '.join(repr(d) for d in DTYPES)}"
        )
    return dtype


def optimizer_transform(fn: str, optimizer) -> optax.GradientTransformation:
    """The optax transformation behind ``optimizer``: a name, a transformation, or an ``nnx.Optimizer``."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"{fn}: optimizer={optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}, or pass an "
                "optax GradientTransformation"
            )
        return make_tx(optimizer)
    if isinstance(optimizer, nnx.Optimizer):
        optimizer = optimizer.tx
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return optimizer
    raise TypeError(
        f"{fn}: optimizer must be a name ({', '.join(OPTIMIZERS)}), an optax GradientTransformation or an "
        f"nnx.Optimizer, got {type(optimizer).__name__}"
    )


def itemsize(dtype) -> int:
    """Bytes per element; an extended dtype (a PRNG key, ``key<fry>``) reports its own (8 for threefry)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(dtype.itemsize)
    return int(jnp.dtype(dtype).itemsize)


def dtype_name(dtype) -> str:
    """``"float32"``, ``"key<fry>"``: the name of a dtype, extended ones included."""
    return str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype).name


def _is_array_like(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _abstract(fn: str, tree: PyTree) -> PyTree:
    """``tree`` with every leaf a ``jax.ShapeDtypeStruct``; refuses non-array leaves."""

    def one(path, leaf):
        if isinstance(leaf, nnx.Variable):
            leaf = leaf.get_value()
        if not _is_array_like(leaf):
            raise TypeError(
                f"{fn}: model_or_abstract_state leaf {path_str(path, '/') or '<root>'} is {type(leaf).__name__}, "
                "not an array; pass an nnx.Module, or a pytree of arrays / jax.ShapeDtypeStruct"
            )
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_params(fn: str, model_or_abstract_state, param_dtype=None) -> dict:
    """The parameters as a pure pytree of ``jax.ShapeDtypeStruct``; floating leaves cast to ``param_dtype``.

    Raises:
        TypeError: an unsupported container or a non-array leaf.
        ValueError: no parameters; ``param_dtype`` not floating.
    """
    src = model_or_abstract_state
    if isinstance(src, nnx.Module):
        tree = nnx.to_pure_dict(nnx.state(src, nnx.Param))
    elif isinstance(src, nnx.State):
        tree = nnx.to_pure_dict(src)
    elif isinstance(src, Mapping | list | tuple) or _is_array_like(src):
        tree = src
    else:
        raise TypeError(
            f"{fn}: model_or_abstract_state must be an nnx.Module (real or from nnx.eval_shape), an "
            f"nnx.State, or a pytree of arrays / jax.ShapeDtypeStruct, got {type(src).__name__}"
        )
    tree = _abstract(fn, tree)
    if not jax.tree.leaves(tree):
        raise ValueError(
            f"{fn}: model_or_abstract_state has no parameters; pass a model with at least one nnx.Param"
        )
    return _cast(fn, tree, param_dtype)


def _cast(fn: str, tree: PyTree, param_dtype) -> PyTree:
    """Every floating ``jax.ShapeDtypeStruct`` of ``tree`` in ``param_dtype`` (``None``: unchanged)."""
    if param_dtype is None:
        return tree
    dtype = check_param_dtype(fn, param_dtype)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s, tree
    )


def params_module(tree: PyTree) -> nnx.Module:
    """A plain parameter pytree as a module of ``nnx.Param`` leaves at the same paths (keys as ``str``).

    Mappings become ``nnx.Dict``, lists and tuples ``nnx.List``; a lone array is ``nnx.List([array])`` (path
    ``"0"``). The module has no annotations, so it is placed by the FSDP rule, as any unannotated model.
    """

    def wrap(x):
        if isinstance(x, Mapping):
            return nnx.Dict({str(k): wrap(v) for k, v in x.items()})
        if isinstance(x, list | tuple):
            return nnx.List([wrap(v) for v in x])
        return nnx.Param(x)

    module = wrap(tree)
    return module if isinstance(module, nnx.Module) else nnx.List([module])


def _cast_module(fn: str, model: nnx.Module, param_dtype) -> nnx.Module:
    """The model with abstract parameters in ``param_dtype`` (its other variables and annotations kept)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype), params)
    return nnx.merge(graphdef, _cast(fn, params, param_dtype), rest)


def training_state(fn: str, source, optimizer, *, placed: bool, param_dtype=None):
    """The ``(model, optimizer)`` pair an estimate sizes, from any form :func:`estimate_memory` takes.

    A Task: its model under ``nnx.eval_shape`` and ``task.optimizer``; a module as given; an ``nnx.State`` or a
    parameter pytree as :func:`params_module`. Its floating parameters are cast to ``param_dtype`` when given, and
    the optimizer is ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` under ``nnx.eval_shape`` (its state follows the
    cast). ``placed``: the real, placed pair as given.

    Raises:
        TypeError: an optimizer with a Task, none without one, a source of another type, ``placed`` without a real
            ``nnx.Optimizer``.
        ValueError: no parameters, a bad ``param_dtype`` or optimizer name.
    """
    if isinstance(source, Task):
        if optimizer is not None:
            raise TypeError(
                f"{fn}: with a Task pass no optimizer (got {type(optimizer).__name__}); the task's own "
                "task.optimizer is the one its step uses"
            )
        if param_dtype is None:
            return abstract_training_state(fn, source)
        model, tx = abstract_training_state(fn, source)[0], source.optimizer
    elif placed:
        if not isinstance(source, nnx.Module) or not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"{fn}: strategy='placed' reads the shardings of the real arrays: pass the model and its "
                "nnx.Optimizer after they were placed (e.g. after one step), not an optimizer name or transformation"
            )
        return source, optimizer
    elif optimizer is None:
        raise TypeError(
            f"{fn}: optimizer is missing; pass a name ({', '.join(OPTIMIZERS)}), an optax GradientTransformation or "
            "an nnx.Optimizer, or pass a shardcheck.Task, which carries its own"
        )
    else:
        tx = optimizer_transform(fn, optimizer)
        params = abstract_params(fn, source)  # validates every form, and that it has parameters
        model = source if isinstance(source, nnx.Module) else params_module(params)
    if param_dtype is not None:
        model = _cast_module(fn, model, param_dtype)
    with nnx.use_eager_sharding(False):
        return model, nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), model)
