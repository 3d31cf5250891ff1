"""The seeds' regression training on an ``(x, y)`` data set: :func:`train`, an adapter over the Task engine.

:func:`train` holds out a test split, standardizes with the training statistics, frames the regression task (MSE
of ``nnx.Linear`` or the MLP on ``(x, y)`` mini-batches) and runs :func:`shardcheck.training.train_task`: its
lock-step loop and drift rule, the data reshuffled every epoch (``epoch_batches``) and both runs' loss on the
whole train and test splits at initialization and after every epoch (``evaluate``).

Mini-batches: the training rows are reshuffled each epoch with one ``np.random.default_rng(seed)``
(:func:`shardcheck.datasets.minibatch_indices`) and cut into ``N_train // B`` full batches; the last incomplete
batch is **dropped** (at most ``B - 1`` rows an epoch, a different set every epoch), so every step has the same
shape and each step function is compiled once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from shardcheck import _validate
from shardcheck._catalog import DEFAULT_STRATEGY
from shardcheck.datasets import Dataset, minibatch_indices
from shardcheck.losses import mse_batch_loss
from shardcheck.models import MODEL_KINDS, make_model
from shardcheck.optimizers import DEFAULT_LR, OPTIMIZERS, make_tx
from shardcheck.steps.registry import STRATEGIES, mesh_for
from shardcheck.task import Task
from shardcheck.training import (
    DEFAULT_NUM_SHARDS,
    TRAIN_STRATEGIES,
    Evaluation,
    StepSummary,
    TrainProgress,
    TrainStep,
    train_task,
)


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """Full-split losses of both runs after an epoch (``epoch == 0``: at initialization, before any step).

    Attributes:
        epoch: 0 .. E.
        step: steps completed so far (0 at initialization).
        train_loss_baseline: :func:`~shardcheck.mse_loss` of the baseline on the whole training split.
        train_loss_sharded: the same for the sharded run.
        test_loss_baseline: :func:`~shardcheck.mse_loss` of the baseline on the held-out test split.
        test_loss_sharded: the same for the sharded run.
    """

    epoch: int
    step: int
    train_loss_baseline: float
    train_loss_sharded: float
    test_loss_baseline: float
    test_loss_sharded: float


def _epoch_record(evaluation: Evaluation | None) -> EpochRecord | None:
    """The engine's :class:`~shardcheck.training.Evaluation` of the ``train`` and ``test`` splits."""
    if evaluation is None:
        return None
    return EpochRecord(evaluation.epoch, evaluation.step, *evaluation.loss("train"), *evaluation.loss("test"))


def _relay(callback: Callable[[TrainProgress], None] | None):
    """:func:`train`'s ``callback`` as the engine's: an epoch's :class:`Evaluation` handed on as its record."""
    if callback is None:
        return None
    return lambda p: callback(dataclasses.replace(p, epoch_end=_epoch_record(p.epoch_end)))


@dataclasses.dataclass(frozen=True)
class TrainReport(StepSummary):
    """Everything one :func:`train` run measured.

    Attributes:
        dataset: the data set's name.
        strategy: the registered strategy trained (one of :data:`~shardcheck.training.TRAIN_STRATEGIES`).
        num_shards: S, shards, micro-batches or mesh devices.
        model: ``"linear"`` or ``"mlp"``.
        hidden: the MLP's hidden width H (recorded for ``"linear"`` too, unused there).
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"``.
        lr: learning rate.
        epochs: E.
        batch_size: B, a multiple of S.
        test_fraction: share of rows held out for the test split.
        seed: seed of the split, the shuffles and the initial parameters.
        num_train: rows in the training split.
        num_test: rows in the test split.
        in_features: D.
        out_features: K.
        steps_per_epoch: ``num_train // batch_size``.
        dropped_per_epoch: ``num_train % batch_size`` rows left out of each epoch (a different set each time).
        steps: one :class:`~shardcheck.training.TrainStep` per step, ``steps_per_epoch * epochs`` of them.
        epoch_records: E + 1 :class:`EpochRecord`, from initialization (epoch 0) to the end.
        tolerance_rule: how ``loss_tolerance`` and ``drift_tolerance`` were derived, in one line.
        wall_s: seconds for the whole loop, compilation included.
    """

    dataset: str
    strategy: str
    num_shards: int
    model: str
    hidden: int
    optimizer: str
    lr: float
    epochs: int
    batch_size: int
    test_fraction: float
    seed: int
    num_train: int
    num_test: int
    in_features: int
    out_features: int
    steps_per_epoch: int
    dropped_per_epoch: int
    steps: tuple[TrainStep, ...]
    epoch_records: tuple[EpochRecord, ...]
    tolerance_rule: str
    wall_s: float

    @property
    def initial(self) -> EpochRecord:
        """Losses at initialization."""
        return self.epoch_records[0]

    @property
    def final(self) -> EpochRecord:
        """Losses after the last epoch."""
        return self.epoch_records[-1]


# ----------------------------------------------------------------------------------------------------- data


def select_features(data: Dataset, features: str | Sequence[str] | None) -> Dataset:
    """Keep only the named feature columns of ``data`` (None: all of them), in the order given.

    Args:
        data: a loaded :class:`~shardcheck.datasets.Dataset`.
        features: column names, a comma-separated string or a sequence; None keeps every feature.

    Returns:
        A :class:`~shardcheck.datasets.Dataset` with ``x: (N, D')`` holding the chosen columns.

    Raises:
        ValueError: an empty list, a name given twice, a column that is a target, or an unknown column (the
            message lists the feature columns).
    """
    fn = "train"
    if features is None:
        return data
    names = [f.strip() for f in features.split(",")] if isinstance(features, str) else list(features)
    if not names or any(not n for n in names):
        raise ValueError(f"{fn}: features={features!r} names no column; pass e.g. features='age,bmi'")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(
            f"{fn}: feature column(s) {dup} listed twice in features={features!r}; name each once"
        )
    both = [n for n in names if n in data.target_names]
    if both:
        raise ValueError(
            f"{fn}: column(s) {both} are listed as features but are also target(s) {list(data.target_names)}; "
            "a column cannot be both: drop it from the features or choose another target"
        )
    unknown = [n for n in names if n not in data.feature_names]
    if unknown:
        raise ValueError(
            f"{fn}: unknown feature column(s) {unknown} in {data.name}; its feature columns are "
            f"{list(data.feature_names)}"
        )
    idx = [data.feature_names.index(n) for n in names]
    return dataclasses.replace(data, x=data.x[:, idx], feature_names=tuple(names))


def split_and_standardize(x, y, test_fraction: float, seed: int):
    """Hold out a test split (scikit-learn ``train_test_split``), then standardize both with the train statistics.

    Features and targets get zero mean and unit variance per column on the training split; constant columns are
    centred only. Using the training statistics keeps the test split truly held out.

    Args:
        x: ``(N, D)`` features.
        y: ``(N, K)`` targets.
        test_fraction: share of rows held out, ``0 < f < 1``.
        seed: ``random_state`` of the split.

    Returns:
        ``(x_train, y_train, x_test, y_test)``, float32 NumPy arrays.
    """
    from sklearn.model_selection import train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(
        np.asarray(x, np.float64), np.asarray(y, np.float64), test_size=test_fraction, random_state=seed
    )

    def scale(train, test):
        mean, std = train.mean(axis=0), train.std(axis=0)
        std = np.where(std > 0, std, 1.0)
        return ((train - mean) / std).astype(np.float32), ((test - mean) / std).astype(np.float32)

    x_tr, x_te = scale(x_tr, x_te)
    y_tr, y_te = scale(y_tr, y_te)
    return x_tr, y_tr, x_te, y_te


# ---------------------------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class _Options:
    """:func:`train`'s settings, checked and with defaults filled in."""

    strategy: str
    num_shards: int
    model: str
    hidden: int
    optimizer: str
    lr: float
    epochs: int
    batch_size: int
    test_fraction: float
    seed: int


def _check_options(
    fn, *, strategy, num_shards, model, hidden, optimizer, lr, epochs, batch_size, test_fraction, seed, mesh,
    callback,
) -> _Options:  # fmt: skip
    """The settings of :func:`train`, validated in the order of its signature, defaults filled in."""
    if not isinstance(strategy, str) or strategy not in TRAIN_STRATEGIES:
        raise ValueError(f"{fn}: strategy={strategy!r} is unknown; use one of {', '.join(TRAIN_STRATEGIES)}")
    for arg, value, choices in (("model", model, MODEL_KINDS), ("optimizer", optimizer, OPTIMIZERS)):
        if value not in choices:
            raise ValueError(f"{fn}: {arg}={value!r} is unknown; use one of {', '.join(choices)}")
    if mesh is not None and num_shards is None:
        num_shards = int(mesh.size) if isinstance(mesh, jax.sharding.Mesh) else None
    if num_shards is None:
        num_shards = DEFAULT_NUM_SHARDS[strategy]
    num_shards = _validate.check_int(fn, "num_shards", num_shards, minimum=1, example="num_shards=4")
    hidden, epochs, batch_size = (
        _validate.check_int(fn, label, value, minimum=1, example=f"{label}={example}")
        for label, value, example in (
            ("hidden", hidden, 32),
            ("epochs", epochs, 10),
            ("batch_size", batch_size, 64),
        )
    )
    seed = _validate.check_int(fn, "seed", seed, minimum=0, example="seed=0")
    lr = _validate.check_lr(fn, DEFAULT_LR[optimizer] if lr is None else lr)
    if (
        isinstance(test_fraction, bool)
        or not isinstance(test_fraction, numbers.Real)
        or not 0 < test_fraction < 1
    ):
        raise ValueError(f"{fn}: test_fraction={test_fraction!r} must be a number in (0, 1); pass e.g. 0.2")
    if callback is not None and not callable(callback):
        raise TypeError(f"{fn}: callback must be None or a callable, got {type(callback).__name__}")
    return _Options(
        strategy,
        num_shards,
        model,
        hidden,
        optimizer,
        float(lr),
        epochs,
        batch_size,
        float(test_fraction),
        seed,
    )


def _check_data(fn: str, x, y) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as ``(N, D)`` and ``y`` as ``(N, K)`` NumPy arrays of finite numbers."""
    x = np.asarray(x)
    y = np.asarray(y)
    y = y[:, None] if y.ndim == 1 else y
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{fn}: x must be (N, D) and y (N, K) or (N,) with the same N, got shapes {x.shape} and {y.shape}"
        )
    for label, a in (("x", x), ("y", y)):
        if a.dtype.kind not in "iuf":
            raise ValueError(f"{fn}: {label} has dtype {a.dtype}; pass numeric data")
        if not np.isfinite(a).all():
            raise ValueError(f"{fn}: {label} holds NaN or inf; clean or impute the data first")
    return x, y


def _divisible_batch_sizes(num_shards: int, num_train: int, around: int) -> str:
    """A few multiples of S near ``around`` that fit the training split."""
    sizes = [m for m in range(num_shards, num_train + 1, num_shards)]
    sizes.sort(key=lambda m: (abs(m - around), m))
    return ", ".join(map(str, sorted(sizes[:4])))


def _check_split(fn: str, n: int, o: _Options) -> tuple[int, int]:
    """``(num_train, num_test)`` of ``n`` rows; each split non-empty, the batches full and divisible by S."""
    num_test = math.ceil(o.test_fraction * n)  # train_test_split's rule for a float test_size
    num_train = n - num_test
    rows = f"the training split has {num_train} rows ({n} rows, test_fraction={o.test_fraction})"
    s, b = o.num_shards, o.batch_size
    if num_train < 1 or num_test < 1:
        raise ValueError(
            f"{fn}: {n} rows with test_fraction={o.test_fraction} leave {num_train} training and {num_test} test "
            "rows; each split needs at least one row: use more data or another test_fraction"
        )
    if num_train < s:
        raise ValueError(
            f"{fn}: {rows}, fewer than the S={s} shards; every shard needs at least one example of each batch: "
            "use fewer shards (devices) or more data"
        )
    if num_train < b:
        raise ValueError(
            f"{fn}: {rows}, fewer than batch_size={b}; every step needs a full batch: use a batch size <= "
            f"{num_train} (a multiple of S={s}, e.g. {_divisible_batch_sizes(s, num_train, num_train)}) or a "
            "smaller test_fraction"
        )
    _validate.check_divisible(
        fn,
        b,
        s,
        subject=f"batch_size={b}",
        fix=f"or use a batch size that is a multiple of {s}, e.g. {_divisible_batch_sizes(s, num_train, b)}",
    )
    return num_train, num_test


def _check_mesh(fn: str, o: _Options, mesh):
    """The mesh of a mesh strategy (``num_shards`` devices, any axes; default ``make_mesh(S)``), else None."""
    strategy = STRATEGIES[o.strategy]
    if not strategy.uses_mesh:
        return None
    if mesh is None:  # the default backend's devices when enough, else the CPU devices beside it
        from shardcheck.devices import select_devices
        from shardcheck.mesh import make_mesh

        what = f"strategy={o.strategy!r} with S={o.num_shards}"
        mesh = make_mesh(o.num_shards, devices=select_devices(o.num_shards, what=what, fn=fn).devices)
    return mesh_for(fn, strategy, o.num_shards, mesh)


def _regression_task(o: _Options, x_train: np.ndarray, y_train: np.ndarray, name: str):
    """The regression task of :func:`train` on epoch 1's shuffled full mini-batches, and ``epoch_batches``.

    ``epoch_batches(e)`` draws the next epoch's mini-batches from the one shuffle of :func:`minibatch_indices`
    (the engine asks for epochs 2, 3, ... once each, in order). The reduction length is ``B * K``.
    """
    d, k = x_train.shape[1], y_train.shape[1]
    per_epoch = len(x_train) // o.batch_size
    draws = minibatch_indices(len(x_train), o.batch_size, seed=o.seed)

    def epoch_batches(epoch: int | None = None) -> list:
        return [(x_train[idx], y_train[idx]) for _, idx in itertools.islice(draws, per_epoch)]

    task = Task(
        model=lambda: make_model(o.model, d, k, hidden=o.hidden, seed=o.seed),
        optimizer=make_tx(o.optimizer, o.lr),
        loss_fn=mse_batch_loss,
        batches=epoch_batches(1),
        name=name,
        reduction_size=o.batch_size * k,
    )
    return task, epoch_batches


def train(
    x,
    y,
    *,
    strategy: str = DEFAULT_STRATEGY,
    num_shards: int | None = None,
    model: str = "linear",
    hidden: int = 32,
    optimizer: str = "adam",
    lr: float | None = None,
    epochs: int = 10,
    batch_size: int = 64,
    test_fraction: float = 0.2,
    seed: int = 0,
    mesh=None,
    name: str = "data",
    callback: Callable[[TrainProgress], None] | None = None,
) -> TrainReport:
    """Train a registered strategy and the single-device reference in lock-step and record how far they drift apart.

    The seeds' regression task run by the engine, :func:`shardcheck.training.train_task`: both runs start from
    independent copies of one model (:func:`~shardcheck.make_model` from ``seed``) and its optimizer
    (:func:`~shardcheck.make_tx`), and take the same shuffled mini-batches
    (:func:`~shardcheck.datasets.minibatch_indices`: reshuffled each epoch, the last incomplete batch dropped).
    Both steps come from the registry :data:`shardcheck.steps.STRATEGIES`, built from the regression task's loss
    (:func:`shardcheck.losses.mse_batch_loss`, MSE on ``(x, y)`` batches): the reference is its single-device
    step; ``strategy`` is any of :data:`~shardcheck.training.TRAIN_STRATEGIES` (``"simulation"``: S shards on one
    device; ``"dp"`` / ``"fsdp"``: a 1-D mesh of S devices; ``"accumulation"``: S micro-batches). Every step is
    compiled once (all batches share one shape); after every epoch both runs' MSE on the whole train and test
    splits is the engine's evaluation (``train_task(evaluate=...)``), one jitted function.

    Data: ``x``/``y`` are split by :func:`split_and_standardize` (``train_test_split`` with ``seed``) and
    standardized with the training statistics.

    In a multi-process run (``shardcheck launch``) every process must call this with the same arguments: the
    mesh spans all processes, every process passes the same global batch (each device takes its rows), and
    each also runs the (cheap) reference itself; every process returns the same report.

    Args:
        x: ``(N, D)`` numeric features, unstandardized.
        y: ``(N, K)`` numeric targets (``(N,)`` is taken as K = 1).
        strategy: a key of :data:`~shardcheck.training.TRAIN_STRATEGIES` (default
            :data:`shardcheck._catalog.DEFAULT_STRATEGY`, ``"fsdp"``).
        num_shards: S >= 1; default :data:`~shardcheck.training.DEFAULT_NUM_SHARDS` (2 on one device, 4 on a
            mesh), or the mesh axis
            size when ``mesh`` is given.
        model: ``"linear"`` or ``"mlp"``.
        hidden: H, the MLP's hidden width.
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"``.
        lr: learning rate; default per optimizer (``DEFAULT_LR``: sgd 0.1, momentum 0.05, adam 0.01).
        epochs: E >= 1.
        batch_size: B >= 1, a multiple of S, at most the number of training rows.
        test_fraction: share of rows held out, ``0 < f < 1``; at least one row must land in each split.
        seed: seed of the split, the shuffles and the initial parameters.
        mesh: for a mesh strategy, a mesh of S devices (any axes: :func:`shardcheck.make_mesh`); built with
            ``make_mesh(S)`` when None.
        name: the data set's name, for the report.
        callback: called with a :class:`~shardcheck.training.TrainProgress` after every step (and on every
            process); its ``epoch_end`` is the :class:`EpochRecord` on an epoch's last step.

    Returns:
        A :class:`TrainReport`.

    Raises:
        TypeError: ``callback`` not callable.
        ValueError: unknown ``strategy``/``model``/``optimizer``; a non-positive or non-int count; ``lr`` not
            finite and positive; ``test_fraction`` outside (0, 1); ``x``/``y`` not 2-D, different row counts,
            NaN or inf; a training split smaller than ``batch_size``; ``batch_size`` not divisible by S (the
            message lists nearby valid batch sizes); more mesh devices than exist. All checked before any step.
    """
    fn = "train"
    t0 = time.perf_counter()
    o = _check_options(
        fn, strategy=strategy, num_shards=num_shards, model=model, hidden=hidden, optimizer=optimizer, lr=lr,
        epochs=epochs, batch_size=batch_size, test_fraction=test_fraction, seed=seed, mesh=mesh, callback=callback,
    )  # fmt: skip
    x, y = _check_data(fn, x, y)
    num_train, num_test = _check_split(fn, x.shape[0], o)
    mesh = _check_mesh(fn, o, mesh)
    x_train, y_train, x_test, y_test = split_and_standardize(x, y, o.test_fraction, o.seed)
    task, epoch_batches = _regression_task(o, x_train, y_train, name)
    run = train_task(
        task, o.strategy, num_shards=o.num_shards, mesh=mesh, epochs=o.epochs, callback=_relay(callback),
        evaluate={"train": (x_train, y_train), "test": (x_test, y_test)}, epoch_batches=epoch_batches,
    )  # fmt: skip
    return TrainReport(
        dataset=name, **dataclasses.asdict(o), num_train=num_train, num_test=num_test,
        in_features=x_train.shape[1], out_features=y_train.shape[1], steps_per_epoch=run.steps_per_epoch,
        dropped_per_epoch=num_train % o.batch_size, steps=run.steps,
        epoch_records=tuple(map(_epoch_record, run.evaluations)), tolerance_rule=run.tolerance_rule,
        wall_s=time.perf_counter() - t0,
    )  # fmt: skip
