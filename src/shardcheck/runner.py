"""The main job: one step of each registered strategy from one initial state, compared with the reference.

Every computation comes from the registry of strategies (:data:`shardcheck.steps.STRATEGIES`): its step is
``Strategy.build(loss_fn, num_shards, mesh).step``, run on a copy of one initial model. Two forms:

* :func:`run_task`: a :class:`~shardcheck.Task`, on its first batch: every registered strategy (or those named),
  reported under its registry name (``reference`` is the baseline).
* :func:`shardcheck.seeds.run_strategies`: the seed form (it lives with the seeds' adapters, above this
  module), an adapter that runs :func:`run_task` on the regression task of an ``nnx.Linear(D, K)`` under MSE and
  ``optax.sgd(lr)`` on ``(x, y)``; the reference is reported as ``baseline`` (seed 001) and the computations are
  those of :func:`xy_strategies`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck._catalog import BASELINE as BASELINE  # the names live in the JAX-free catalog
from shardcheck._catalog import REFERENCE as REFERENCE
from shardcheck._catalog import seed_form
from shardcheck._tree import copy_state, path_str
from shardcheck.distributed import gather_to_host
from shardcheck.steps.registry import STRATEGIES, get_strategy, mesh_for
from shardcheck.task import Task


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One computation's result, on the host.

    Attributes:
        name: the strategy's registry name (``baseline`` for the reference of the seed form).
        loss: the pre-update loss the computation returned.
        shard_losses: the per-shard pre-update losses (simulation only), length S.
        params: the updated parameters, ``{path: array}`` (``kernel (D, K)``, ``bias (K,)`` for a Linear).
        max_abs_param_diff_vs_baseline: max over leaves and elements of ``|params - reference params|``.
        max_abs_grad_diff: per leaf, max ``|reduced shard gradient - full-batch gradient|`` (the strategies that
            return their gradients: simulation).
        placement: per-device bytes of parameters and optimizer state (the mesh strategies of a task; fsdp in
            the seed form).
        max_abs_param_diff_by_leaf: per parameter leaf, max ``|params - reference params|`` (task form only).
        worst_param_leaf: the leaf of the largest difference (task form only; ``""`` for the reference).
    """

    name: str
    loss: float
    params: dict[str, np.ndarray]
    max_abs_param_diff_vs_baseline: float = 0.0
    shard_losses: tuple[float, ...] | None = None
    max_abs_grad_diff: dict[str, float] | None = None
    placement: dict | None = None
    max_abs_param_diff_by_leaf: dict[str, float] | None = None
    worst_param_leaf: str | None = None


@dataclasses.dataclass(frozen=True)
class RunReport:
    """The main job's comparison of the seed computations and the mesh steps.

    Attributes:
        num_shards: S.
        lr: the SGD learning rate.
        seed: the ``nnx.Rngs`` seed of the shared initial parameters.
        in_features: D.
        out_features: K.
        outcomes: one :class:`StepOutcome` per computation, in run order (``baseline`` first).
        param_storage_per_shard_bytes: seed 001's storage figure ``(D + 1) * K / S * 4`` (float32 values).
    """

    num_shards: int
    lr: float
    seed: int
    in_features: int
    out_features: int
    outcomes: dict[str, StepOutcome]
    param_storage_per_shard_bytes: float


@dataclasses.dataclass(frozen=True)
class TaskRunReport:
    """One step of each registered strategy on a task's first batch, compared with the reference.

    Attributes:
        task: the task's name.
        num_shards: S.
        batch_size: B, the rows of the batch stepped on (``task.batches[0]``).
        param_count: parameter values of the model.
        param_bytes: bytes of all parameters (one unsharded copy).
        outcomes: one :class:`StepOutcome` per strategy run, in registry order (``reference`` first).
        skipped: ``{strategy: reason}`` for the registered strategies whose ``check`` refused this task
            (``multiprocess`` outside a launched run); only when no
            strategies were named.
        param_storage_per_shard_bytes: seed 001's "even split": ``param_bytes / S``.
    """

    task: str
    num_shards: int
    batch_size: int
    param_count: int
    param_bytes: int
    outcomes: dict[str, StepOutcome]
    skipped: dict[str, str]
    param_storage_per_shard_bytes: float


def to_host(tree) -> dict[str, np.ndarray]:
    """Flatten a state tree to ``{"kernel": np.ndarray, ...}`` keyed by its path, on the host.

    Arrays split or replicated across processes are gathered first (a collective: every process calls this).
    """
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    tree = gather_to_host(tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(path): np.asarray(leaf) for path, leaf in flat}


def _leaf_diffs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.max(np.abs(a[k] - b[k]))) if a[k].size else 0.0 for k in a}


def xy_strategies() -> tuple[str, ...]:
    """The computations of the seed form (:func:`run_strategies`), from the registry, in registry order.

    They are the registered single-device strategies that step the optimizer they are given (not one of their
    own, as gradient accumulation's ``optax.MultiSteps``), and the first registered mesh strategy of each
    placement (data parallel, FSDP; ``multiprocess`` is the data-parallel placement again): ``("baseline",
    "simulation", "dp", "fsdp")``, the reference named ``baseline``.
    """
    return seed_form()


def __getattr__(name: str):
    if name == "RUN_STRATEGIES":  # the seed form's computations, kept under their old name
        return xy_strategies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _unpack(out):
    """``(loss, grads, shard_losses)`` of a registered step's return value (a loss or a StepResult)."""
    if hasattr(out, "loss"):
        return out.loss, getattr(out, "grads", None), getattr(out, "shard_losses", None)
    return out, None, None


def run_task(
    task: Task,
    *,
    num_shards: int,
    strategies: Sequence[str] | None = None,
    mesh=None,
) -> TaskRunReport:
    """One step of each registered strategy on ``task.batches[0]``, all from the same fresh ``task.model()``.

    The model is built once; every strategy steps a copy of it with a fresh ``nnx.Optimizer(model,
    task.optimizer, wrt=nnx.Param)`` (or the optimizer its candidate builds from that one: ``optax.MultiSteps``
    for accumulation), through ``Strategy.build(task.loss_fn, num_shards, mesh).step``. The reference always
    runs first; each other strategy's updated parameters are compared with the reference's, leaf by leaf.

    Args:
        task: the :class:`~shardcheck.Task`.
        num_shards: S >= 1; the first batch must split into S equal shards (unless only the reference runs).
        strategies: registry names (default: every registered strategy; those whose ``Strategy.check`` refuses
            the task, such as ``multiprocess`` outside a launched run, are skipped with the reason).
        mesh: the mesh of the mesh strategies (default: the first S devices).

    Returns:
        A :class:`TaskRunReport`.

    Raises:
        TypeError: ``task`` not a Task; a loss of the wrong form; ``num_shards`` not an int.
        ValueError: an unknown strategy name; a batch that does not split into S shards; fewer devices than S
            for a mesh strategy; a model the strategies cannot shard (BatchStat); a named strategy whose check
            refuses the task, or that runs the forward pass per shard or per micro-batch (every one but gspmd)
            where it draws random numbers (an unnamed one is skipped with the reason). All checked before any step runs.
    """
    fn = "run_task"
    if not isinstance(task, Task):
        raise TypeError(
            f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}; build one with "
            "shardcheck.Task(model=..., optimizer=..., loss_fn=..., batches=...)"
        )
    num_shards = _validate.check_num_shards(fn, num_shards)
    names = list(STRATEGIES) if strategies is None else [get_strategy(fn, s).name for s in strategies]
    names = [REFERENCE] + [s for s in dict.fromkeys(names) if s != REFERENCE]
    from shardcheck.task import batch_size, check_divisible, check_model

    batch = task.batches[0]
    initial = task.new_model(fn)
    # the state the forward pass writes (BatchNorm's running statistics) and the RNG streams it draws: only a
    # GSPMD step computes and draws the full batch's (trial 52: a BatchNorm model was refused for gspmd too)
    updated: list[str] = []
    drawn: list[str] = []
    weighted = check_model(fn, initial, task.loss_fn, batch, updated=updated, drawn=drawn, batch_stats=True)
    if len(names) > 1:
        check_divisible(fn, batch, num_shards, weighted=weighted)
    forward = (initial, updated, drawn)
    plan, skipped = _plan(fn, task, forward, names, num_shards, mesh, named=strategies is not None)
    outcomes: dict[str, StepOutcome] = {}
    base = None  # the reference's (params, grads) on the host
    for name, strategy, step_mesh in plan:
        model = copy_state(initial)
        optimizer = task.new_optimizer(model)
        candidate = strategy.build(task.loss_fn, num_shards, step_mesh)
        if candidate.make_optimizer is not None:
            optimizer = candidate.make_optimizer(model, optimizer)
        out = candidate.step(model, optimizer, batch)
        outcomes[name], host = _outcome(name, strategy, out, model, optimizer, base)
        base = host if base is None else base
    base = base[0]
    nbytes = sum(int(a.nbytes) for a in base.values())
    return TaskRunReport(
        task=task.name,
        num_shards=num_shards,
        batch_size=batch_size(batch),
        param_count=sum(int(a.size) for a in base.values()),
        param_bytes=nbytes,
        outcomes=outcomes,
        skipped=skipped,
        param_storage_per_shard_bytes=nbytes / num_shards,
    )


def _plan(fn, task: Task, model, names, num_shards: int, mesh, *, named: bool):
    """``([(name, strategy, mesh or None)], {skipped name: reason})``: each strategy's check run first (a named
    strategy's refusal raises, an unnamed one is skipped), one mesh shared by the mesh strategies. ``model``:
    ``(initial model, the non-parameter state its forward pass writes, the RNG streams it draws)``: a strategy
    that runs it per shard is refused."""
    from shardcheck.parity.harness.setup import _check_state_carried

    plan, skipped, shared_mesh = [], {}, None
    initial, updated, drawn = model
    for name in names:
        strategy = STRATEGIES[name]
        try:
            _check_state_carried(fn, name, updated, drawn, initial)
            if strategy.check is not None:
                strategy.check(fn, initial, task.new_optimizer(copy_state(initial)))
        except ValueError as err:
            if named:
                raise
            skipped[name] = str(err)
            continue
        if strategy.uses_mesh and shared_mesh is None:
            shared_mesh = mesh_for(fn, strategy, num_shards, mesh)
        plan.append((name, strategy, shared_mesh if strategy.uses_mesh else None))
    return plan, skipped


def _outcome(name, strategy, out, model, optimizer, base) -> tuple[StepOutcome, tuple]:
    """One strategy's :class:`StepOutcome` and its host ``(params, grads)``; ``base`` is the reference's host
    ``(params, grads)``, or None for the reference itself."""
    loss, grads, shard_losses = _unpack(out)
    params = to_host(nnx.state(model, nnx.Param))
    grads = None if grads is None else to_host(grads)
    if base is None:
        diffs = {k: 0.0 for k in params}
        outcome = StepOutcome(
            name, float(loss), params, max_abs_param_diff_by_leaf=diffs, worst_param_leaf=""
        )
        return outcome, (params, grads)
    diffs = _leaf_diffs(params, base[0])
    worst = max(diffs, key=diffs.get)
    extra = {}
    if shard_losses is not None:
        extra["shard_losses"] = tuple(float(v) for v in np.asarray(shard_losses))
    if grads is not None and base[1] is not None:
        extra["max_abs_grad_diff"] = _leaf_diffs(grads, base[1])
    if strategy.uses_mesh:
        from shardcheck.placement import placement_summary

        extra["placement"] = placement_summary(model, optimizer)
    outcome = StepOutcome(
        name,
        float(loss),
        params,
        max_abs_param_diff_vs_baseline=diffs[worst],
        max_abs_param_diff_by_leaf=diffs,
        worst_param_leaf=worst,
        **extra,
    )
    return outcome, (params, grads)
