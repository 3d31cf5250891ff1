"""A task's model and optimizer created directly in a strategy's placement: never whole on one device.

``Task.new_model`` builds every parameter on the default device before a strategy places it, so a model larger
than one device cannot be built that way. :func:`sharded_training_state` traces the same factory and
``nnx.Optimizer`` under ``nnx.eval_shape`` (shapes, dtypes, annotations: nothing allocated), derives each state
leaf's ``PartitionSpec`` (:func:`shardcheck.steps.sharded.state_specs`: the model's ``nnx.with_partitioning``
annotations, else the FSDP rule; every leaf replicated under ``dp``), and runs the factory under ``jax.jit`` with
those shardings as ``out_shardings``: XLA's partitioner computes each device's shard where it lives. This is the
Flax NNX sharding guide's "sharded model initialization" (``nnx.jit`` + ``jax.lax.with_sharding_constraint``),
written with ``out_shardings`` so that a model without annotations is split too.

The values are the factory's up to rounding: random initializers under ``jax.jit`` draw the same bits as eagerly
(JAX's partitionable Threefry), but XLA may fuse the arithmetic that turns them into floats (a normal
initializer's ``erfinv``) differently, so a leaf can differ from ``task.new_model()``'s in its last bit (measured:
the tiny-lm's embeddings, 6e-8). Both sides of a check start from this one state, so this changes no verdict.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardcheck._tree import path_str
from shardcheck.steps.sharded import state_specs
from shardcheck.task import Task


def abstract_training_state(fn: str, task: Task) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)`` of a task under ``nnx.eval_shape``: shapes, dtypes and annotations, nothing allocated.

    The pair is ``task.new_model()`` and ``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)`` traced by
    ``nnx.eval_shape`` (the optimizer state is ``task.optimizer.init`` of the abstract parameters, and inherits
    their sharding annotations), built under ``nnx.use_eager_sharding(False)`` so that an annotated model needs
    no mesh in context. (Also ``shardcheck.memory.abstract_training_state``, which sizes it.)
    """

    def build():
        model = task.new_model(fn)
        return model, task.new_optimizer(model)

    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


def sharded_training_state(
    fn: str, task: Task, strategy: str, mesh: Mesh
) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)`` of ``task``, each state leaf created on ``mesh`` in ``strategy``'s placement.

    Args:
        fn: the calling function's name, for error messages.
        task: the :class:`~shardcheck.Task`; its factory runs once, traced.
        strategy: a registered strategy with a mesh placement (``dp``, ``fsdp``, ``gspmd``, ``multiprocess``).
        mesh: the mesh the state lives on.

    Returns:
        The model and its ``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)``, every leaf a ``jax.Array``
        with ``NamedSharding(mesh, spec)`` (the spec of :func:`~shardcheck.steps.sharded.state_specs`), of the
        dtypes ``task.new_model()`` gives and its values up to rounding (module docstring).

    Raises:
        TypeError: as ``Task.new_model`` (a factory needing arguments, or returning no ``nnx.Module``).
        ValueError: an annotation that does not fit the mesh (as :func:`~shardcheck.steps.sharded.state_specs`).
    """
    abstract_model, abstract_opt = abstract_training_state(fn, task)
    specs, _ = state_specs(strategy, abstract_model, abstract_opt, mesh, fn=fn)
    graphdef, abstract = nnx.split((abstract_model, abstract_opt))
    treedef = jax.tree.structure(abstract)

    def build():
        model = task.new_model(fn)
        return jax.tree.leaves(nnx.state((model, task.new_optimizer(model))))

    with nnx.use_eager_sharding(False):
        leaves = jax.jit(build, out_shardings=[NamedSharding(mesh, spec) for spec in specs])()
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def largest_shard_bytes(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, int]:
    """The bytes of the largest addressable shard of each state leaf, by dotted path; read from the arrays'
    ``addressable_shards``, so it is what the devices hold, not what a rule predicts."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state((model, optimizer)))[0]
    return {
        path_str(path): max(s.data.nbytes for s in a.addressable_shards)
        for path, a in leaves
        if isinstance(a, jax.Array)
    }
