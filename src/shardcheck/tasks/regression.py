"""The seeds' regression tasks: MSE of a ``nnx.Linear`` (or the two-layer MLP) on standardized tabular data.

The loss is :func:`shardcheck.losses.mse_loss`, ``jnp.mean((model(x) - y) ** 2)`` over the ``(B, K)`` batch
(seeds ``000_f7b4ea9cf28c5420.txt`` and ``001_a85d1499a1a85057.txt``); the data are
:func:`shardcheck.datasets.load_dataset`'s, standardized per column.
"""

from __future__ import annotations

import itertools

from flax import nnx

from shardcheck import _validate, datasets
from shardcheck.losses import mse_batch_loss as regression_loss  # MSE of an (x, y) batch (seeds 000, 001)
from shardcheck.models import MODEL_KINDS, make_model
from shardcheck.task import Task
from shardcheck.tasks.loading import DEFAULT_STEPS, check_sizes, resolve_optimizer

DEFAULT_BATCH_SIZE = {"diabetes": 64, "linnerud": 16}


def regression_task(
    source: str = "diabetes",
    *,
    target=None,
    model: str = "linear",
    hidden: int = 32,
    optimizer=None,
    lr: float | None = None,
    batch_size: int = 64,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    name: str | None = None,
) -> Task:
    """A regression task on a bundled data set or a CSV / NPZ file (``datasets.load_dataset``, standardized).

    Batches are tuples ``(x, y)``: ``x`` ``(B, D)`` float32, ``y`` ``(B, K)`` float32, drawn without replacement by
    :func:`shardcheck.datasets.minibatch_indices` (a fresh permutation each epoch, the same for the same seed).
    The loss is :func:`regression_loss` (scalar mean, equal-weight shards); ``reduction_size`` is ``B * K``.

    Args:
        source: ``"diabetes"``, ``"linnerud"``, a ``.csv`` or a ``.npz`` path.
        target: CSV target column(s), see :func:`shardcheck.datasets.load_dataset`.
        model: ``"linear"`` (``nnx.Linear(D, K)``) or ``"mlp"`` (:class:`shardcheck.models.MLP`, ``hidden``
            units).
        hidden: H, the MLP's hidden width.
        optimizer: ``None`` (``"adam"``), ``"sgd"``, ``"momentum"``, ``"adam"`` or an optax transformation.
        lr: learning rate of a named optimizer (default :data:`shardcheck.optimizers.DEFAULT_LR`).
        batch_size: B (default a multiple of 8, so 8 shards split evenly).
        steps: number of batches.
        seed: seed of the parameters (``nnx.Rngs(seed)``) and of the shuffling.
        name: the task's name (default: the data set's).

    Returns:
        The :class:`~shardcheck.task.Task`; its model factory returns identical parameters on every call.

    Raises:
        ValueError: unknown ``model`` or data source, ``batch_size`` larger than the data, a value out of range,
            the errors of :func:`shardcheck.datasets.load_dataset`.
        TypeError: an option of the wrong type.
    """
    fn = name or (source if source in datasets.BUNDLED else "regression_task")
    if model not in MODEL_KINDS:
        raise ValueError(f"{fn}: model={model!r} is unknown; use one of {', '.join(MODEL_KINDS)}")
    hidden = _validate.check_int(fn, "hidden", hidden, example="hidden=32")
    tx = resolve_optimizer(fn, optimizer, lr)
    data = datasets.load_dataset(source, target=target)
    n, d = data.x.shape
    k = data.y.shape[1]
    batch_size, steps, seed = check_sizes(fn, batch_size=batch_size, steps=steps, seed=seed, num_rows=n)
    drawn = itertools.islice(datasets.minibatch_indices(n, batch_size, seed=seed), steps)
    batches = [(data.x[idx], data.y[idx]) for _, idx in drawn]

    def factory() -> nnx.Module:
        return make_model(model, d, k, hidden=hidden, seed=seed)

    return Task(
        model=factory,
        optimizer=tx,
        loss_fn=regression_loss,
        batches=batches,
        name=name or data.name,
        reduction_size=batch_size * k,
    )


def diabetes_task(
    *,
    model: str = "linear",
    hidden: int = 32,
    optimizer=None,
    lr: float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE["diabetes"],
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
) -> Task:
    """scikit-learn's bundled diabetes data (442 x 10 -> 1, standardized): seed 001's Linear regression.

    Batches ``(x (B, 10) float32, y (B, 1) float32)``, default B = 64. See :func:`regression_task` for the
    options and the errors raised.
    """
    return regression_task(
        "diabetes",
        model=model,
        hidden=hidden,
        optimizer=optimizer,
        lr=lr,
        batch_size=batch_size,
        steps=steps,
        seed=seed,
    )


def linnerud_task(
    *,
    model: str = "linear",
    hidden: int = 32,
    optimizer=None,
    lr: float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE["linnerud"],
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
) -> Task:
    """scikit-learn's bundled linnerud data (20 x 3 -> 3, standardized): seed 000's multi-output Linear.

    Batches ``(x (B, 3) float32, y (B, 3) float32)``, default B = 16 (of 20 rows). See :func:`regression_task`
    for the options and the errors raised.
    """
    return regression_task(
        "linnerud",
        model=model,
        hidden=hidden,
        optimizer=optimizer,
        lr=lr,
        batch_size=batch_size,
        steps=steps,
        seed=seed,
    )
