"""The seed form of the main job: :func:`run_strategies`, an adapter over :func:`shardcheck.runner.run_task`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import optax
from flax import nnx

from shardcheck import _validate
from shardcheck._catalog import BASELINE, REFERENCE, seed_form
from shardcheck.losses import mse_batch_loss
from shardcheck.runner import RunReport, StepOutcome, run_task
from shardcheck.steps.registry import STRATEGIES
from shardcheck.task import Task


def _check_names(fn: str, strategies) -> tuple[str, ...]:
    allowed = seed_form()
    strategies = allowed if strategies is None else tuple(strategies)
    unknown = [s for s in strategies if s not in allowed]
    if unknown:
        raise ValueError(f"{fn}: unknown strategies {unknown}; choose from {', '.join(allowed)}")
    return strategies


def _seed_outcome(name: str, outcome: StepOutcome) -> StepOutcome:
    """A task-form outcome as the seed form reports it: ``baseline`` for the reference, no per-leaf fields, and
    the per-device placement of the ``fsdp``-placed strategies only."""
    spec = STRATEGIES[outcome.name]
    return dataclasses.replace(
        outcome,
        name=name,
        max_abs_param_diff_by_leaf=None,
        worst_param_leaf=None,
        placement=outcome.placement if spec.placement == "fsdp" else None,
    )


def run_strategies(
    x,
    y,
    *,
    num_shards: int,
    lr: float = 0.1,
    seed: int = 0,
    strategies: Sequence[str] | None = None,
    mesh=None,
) -> RunReport:
    """One SGD step of each computation of the seed form on a fresh ``nnx.Linear(D, K)``, from one initial state.

    The regression task (``nnx.Linear(D, K, rngs=nnx.Rngs(seed))``, ``optax.sgd(lr)``, the loss
    :func:`~shardcheck.losses.mse_batch_loss` of the one batch ``(x, y)``) run by
    :func:`~shardcheck.runner.run_task`: ``baseline`` is the registry's ``reference`` step (seed 001),
    ``simulation`` the reduction of seed 000, ``dp`` and ``fsdp`` the ``jax.shard_map`` steps on ``mesh`` (the
    first S devices when not given). The baseline always runs, as the reference; gradient differences are
    against its full-batch gradients.

    Args:
        x: ``(B, D)`` float inputs.
        y: ``(B, K)`` float targets.
        num_shards: S >= 1 dividing B.
        lr: SGD learning rate.
        seed: ``nnx.Rngs`` seed for the shared initial parameters.
        strategies: names from :func:`shardcheck.runner.xy_strategies` (default: all of them).
        mesh: the mesh of the ``dp``/``fsdp`` steps, of S devices.

    Returns:
        A :class:`~shardcheck.runner.RunReport`.

    Raises:
        ValueError: unknown strategy, or the bad inputs of the steps (uneven shards, too few devices, ...),
            all checked before any step runs.
    """
    fn = "run_strategies"
    strategies = _check_names(fn, strategies)
    x, y = _validate.check_batch(fn, x, y)
    num_shards = _validate.check_num_shards(fn, num_shards)
    if any(s != BASELINE for s in strategies):  # the baseline alone does not shard
        _validate.check_equal_shards(fn, x.shape[0], num_shards, hint="choose --shards from this list")
    lr, seed = _validate.check_lr(fn, lr), _validate.check_seed(fn, seed)
    d, k = x.shape[1], y.shape[1]
    task = Task(
        model=lambda: nnx.Linear(d, k, rngs=nnx.Rngs(seed)),
        optimizer=optax.sgd(lr),
        loss_fn=mse_batch_loss,
        batches=[(x, y)],
        name="regression",
    )
    names = {REFERENCE if s == BASELINE else s: s for s in (BASELINE, *strategies)}
    report = run_task(task, num_shards=num_shards, strategies=list(names), mesh=mesh)
    return RunReport(
        num_shards=num_shards,
        lr=lr,
        seed=seed,
        in_features=d,
        out_features=k,
        outcomes={names[n]: _seed_outcome(names[n], o) for n, o in report.outcomes.items()},
        param_storage_per_shard_bytes=(d + 1) * k / num_shards * 4,
    )
