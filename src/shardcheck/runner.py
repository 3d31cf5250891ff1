"""The main job: run the baseline and each sharded computation from one initial state, and compare them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate
from shardcheck._tree import path_str
from shardcheck.baseline import sgd_step
from shardcheck.distributed import gather_to_host, global_batch, process_batch_indices
from shardcheck.losses import mse_loss
from shardcheck.simulation import reduced_sgd_step

RUN_STRATEGIES = ("baseline", "simulation", "dp", "fsdp")
SHARDED_ON_MESH = ("dp", "fsdp")


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One computation's result, on the host.

    Attributes:
        name: ``baseline``, ``simulation``, ``dp`` or ``fsdp``.
        loss: the pre-update loss the computation returned.
        shard_losses: the per-shard pre-update losses (simulation only), length S.
        params: the updated parameters, ``{path: array}`` (``kernel (D, K)``, ``bias (K,)``).
        max_abs_param_diff_vs_baseline: max over leaves and elements of ``|params - baseline params|``.
        max_abs_grad_diff: per leaf, max ``|averaged shard gradient - full-batch gradient|`` (simulation only).
        placement: per-device bytes of parameters and optimizer state (fsdp only).
    """

    name: str
    loss: float
    params: dict[str, np.ndarray]
    max_abs_param_diff_vs_baseline: float = 0.0
    shard_losses: tuple[float, ...] | None = None
    max_abs_grad_diff: dict[str, float] | None = None
    placement: dict | None = None


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


def to_host(tree) -> dict[str, np.ndarray]:
    """Flatten a state tree to ``{"kernel": np.ndarray, ...}`` keyed by its path, on the host.

    Arrays split or replicated across processes are gathered first (a collective: every process calls this).
    """
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    tree = gather_to_host(tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(path): np.asarray(leaf) for path, leaf in flat}


def _max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def run_strategies(
    x,
    y,
    *,
    num_shards: int,
    lr: float = 0.1,
    seed: int = 0,
    strategies: Sequence[str] = RUN_STRATEGIES,
    mesh=None,
) -> RunReport:
    """Run one SGD step of each computation on a fresh ``nnx.Linear(D, K)``, all from the same initial state.

    ``baseline`` is :func:`~shardcheck.sgd_step` (seed 001); ``simulation`` is
    :func:`~shardcheck.reduced_sgd_step` (seed 000); ``dp`` and ``fsdp`` are the mesh steps of
    :mod:`shardcheck.spmd` on ``mesh`` (a 1-D mesh of ``num_shards`` devices, built when not given). The baseline
    always runs, as the reference.

    Args:
        x: ``(B, D)`` float inputs.
        y: ``(B, K)`` float targets.
        num_shards: S >= 1 dividing B.
        lr: SGD learning rate.
        seed: ``nnx.Rngs`` seed for the shared initial parameters.
        strategies: names from ``RUN_STRATEGIES``.
        mesh: the mesh of the ``dp``/``fsdp`` steps.

    Returns:
        A :class:`RunReport`.

    Raises:
        ValueError: unknown strategy, or the bad inputs of the steps (uneven shards, too few devices, ...),
            all checked before any step runs.
    """
    fn = "run_strategies"
    unknown = [s for s in strategies if s not in RUN_STRATEGIES]
    if unknown:
        raise ValueError(f"{fn}: unknown strategies {unknown}; choose from {', '.join(RUN_STRATEGIES)}")
    x, y = _validate.check_batch(fn, x, y)
    num_shards = _validate.check_num_shards(fn, num_shards)
    if any(s != "baseline" for s in strategies):  # the baseline alone does not shard
        _validate.check_equal_shards(fn, x.shape[0], num_shards, hint="choose --shards from this list")
    lr = _validate.check_lr(fn, lr)
    seed = _validate.check_seed(fn, seed)
    if any(s in SHARDED_ON_MESH for s in strategies) and mesh is None:
        from shardcheck.spmd import make_mesh

        mesh = make_mesh(num_shards)
    d, k = x.shape[1], y.shape[1]
    x_mesh, y_mesh = x, y
    if mesh is not None and jax.process_count() > 1:
        # Many processes (docs/distributed.md): each feeds the mesh steps only the rows its devices hold.
        rows = process_batch_indices(x.shape[0], mesh)
        x_mesh, y_mesh = global_batch(
            np.asarray(x)[rows], np.asarray(y)[rows], mesh, global_batch_size=x.shape[0]
        )
    initial = nnx.Linear(d, k, rngs=nnx.Rngs(seed))

    def fresh():
        model = nnx.clone(initial)
        return model, nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)

    outcomes: dict[str, StepOutcome] = {}
    model, optimizer = fresh()
    full_grads = to_host(nnx.grad(mse_loss)(model, x, y))
    loss = sgd_step(model, optimizer, x, y)
    base = to_host(nnx.state(model, nnx.Param))
    outcomes["baseline"] = StepOutcome("baseline", float(loss), base)

    for name in strategies:
        if name == "baseline":
            continue
        model, optimizer = fresh()
        extra = {}
        if name == "simulation":
            result = reduced_sgd_step(model, optimizer, x, y, num_shards)
            loss = result.loss
            grads = to_host(result.grads)
            extra = dict(
                shard_losses=tuple(float(v) for v in np.asarray(result.shard_losses)),
                max_abs_grad_diff={k_: float(np.max(np.abs(grads[k_] - full_grads[k_]))) for k_ in grads},
            )
        else:
            from shardcheck import spmd

            step = spmd.data_parallel_sgd_step if name == "dp" else spmd.fsdp_sgd_step
            loss = step(model, optimizer, x_mesh, y_mesh, mesh)
            if name == "fsdp":
                extra = dict(placement=spmd.placement_summary(model, optimizer))
        params = to_host(nnx.state(model, nnx.Param))
        outcomes[name] = StepOutcome(
            name, float(loss), params, max_abs_param_diff_vs_baseline=_max_abs_diff(params, base), **extra
        )
    return RunReport(
        num_shards=num_shards,
        lr=lr,
        seed=seed,
        in_features=d,
        out_features=k,
        outcomes=outcomes,
        param_storage_per_shard_bytes=(d + 1) * k / num_shards * 4,
    )
