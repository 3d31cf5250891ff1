"""The lock-step training loop: a sharded strategy beside the single-device baseline, on real data, over many steps.

Drift between a sharded run and its baseline often shows only after several steps (optimizer moments, step
counters, accumulated rounding). :func:`train` builds two identical models from one seed, one
:func:`~shardcheck.sgd_step` baseline and one sharded strategy (the gradient-reduction simulation of seed
``000_f7b4ea9cf28c5420.txt``, or the data-parallel / FSDP steps on a device mesh), feeds both the same shuffled
mini-batches in lock-step, and records after every step both pre-update losses and the largest parameter
difference between the two models; after every epoch it evaluates the train and test loss of both.

Mini-batches: the training rows are reshuffled each epoch with one ``np.random.default_rng(seed)`` and cut into
``N_train // B`` full batches; the last incomplete batch is **dropped** (at most ``B - 1`` rows an epoch, a
different set every epoch), so every step has the same shape and each step function is compiled once.

This module computes; it never prints. Progress goes to an optional callback (the CLI draws a rich progress bar).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck.baseline import sgd_step
from shardcheck.datasets import Dataset, minibatch_indices
from shardcheck.distributed import gather_to_host, global_batch, process_batch_indices
from shardcheck.losses import mse_loss
from shardcheck.models import MODEL_KINDS, make_model
from shardcheck.optimizers import DEFAULT_LR, OPTIMIZERS, make_tx
from shardcheck.parity.tolerance import Tolerance, derive_tolerance

STRATEGIES = ("simulation", "dp", "fsdp")
# The shard count S when none is given: 4 devices for the mesh strategies, 2 simulated shards.
DEFAULT_NUM_SHARDS = {"simulation": 2, "dp": 4, "fsdp": 4}


# --------------------------------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One lock-step step of both runs.

    Attributes:
        step: 1-based global step number.
        epoch: 1-based epoch the step belongs to.
        loss_baseline: the baseline's pre-update loss on this mini-batch (float32 computed, as float).
        loss_sharded: the sharded run's pre-update loss on the same mini-batch.
        max_abs_param_diff: after this step's update, ``max`` over parameter leaves of
            ``max|params_sharded - params_baseline|`` (parameter units; 0.0 when bitwise equal).
        loss_tolerance: the largest ``|loss_sharded - loss_baseline|`` this step's tolerance allows.
        drift_tolerance: the largest ``max_abs_param_diff`` this step's tolerance allows.
    """

    step: int
    epoch: int
    loss_baseline: float
    loss_sharded: float
    max_abs_param_diff: float
    loss_tolerance: float
    drift_tolerance: float

    @property
    def loss_agrees(self) -> bool:
        """``|loss_sharded - loss_baseline| <= loss_tolerance``."""
        return abs(self.loss_sharded - self.loss_baseline) <= self.loss_tolerance

    @property
    def drift_exceeded(self) -> bool:
        """``max_abs_param_diff > drift_tolerance``."""
        return self.max_abs_param_diff > self.drift_tolerance


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


@dataclasses.dataclass(frozen=True)
class TrainReport:
    """Everything one :func:`train` run measured.

    Attributes:
        dataset: the data set's name.
        strategy: ``"simulation"``, ``"dp"`` or ``"fsdp"``.
        num_shards: S, simulated shards or mesh devices.
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
        steps: one :class:`TrainStep` per step, ``steps_per_epoch * epochs`` of them, in order.
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
    def num_steps(self) -> int:
        """Steps taken by each run."""
        return len(self.steps)

    @property
    def initial(self) -> EpochRecord:
        """Losses at initialization."""
        return self.epoch_records[0]

    @property
    def final(self) -> EpochRecord:
        """Losses after the last epoch."""
        return self.epoch_records[-1]

    @property
    def max_abs_param_diff(self) -> float:
        """The largest parameter drift over the whole run."""
        return max((s.max_abs_param_diff for s in self.steps), default=0.0)

    @property
    def first_exceeded_step(self) -> int | None:
        """The first step whose drift exceeded its tolerance, or None if none did."""
        return next((s.step for s in self.steps if s.drift_exceeded), None)

    @property
    def loss_curves_agree(self) -> bool:
        """True when the two per-step loss curves agree within tolerance at every step."""
        return all(s.loss_agrees for s in self.steps)


@dataclasses.dataclass(frozen=True)
class TrainProgress:
    """What the progress callback receives after every step.

    Attributes:
        step: the :class:`TrainStep` just taken.
        total_steps: steps the run will take in all.
        epochs: E.
        epoch_end: the :class:`EpochRecord` when this step ended an epoch, else None.
    """

    step: TrainStep
    total_steps: int
    epochs: int
    epoch_end: EpochRecord | None


# ------------------------------------------------------------------------------------------------ tolerance


def step_tolerance(batch_size: int, out_features: int, step: int, dtype="float32") -> Tolerance:
    """The parity harness's tolerance (:func:`~shardcheck.parity.tolerance.derive_tolerance`) after ``step`` steps (1-based).

    A value passes when ``|sharded - baseline| <= atol + rtol * |baseline|`` (max over elements); for the
    parameter drift the scale is ``max|params_baseline|`` over the whole model.

    Example::

        >>> tol = step_tolerance(64, 1, 1)
        >>> round(tol.rtol, 8), round(tol.atol, 9)
        (1.526e-05, 9.54e-07)
    """
    return derive_tolerance(dtype, batch_size=batch_size, out_features=out_features, step=step - 1)


TOLERANCE_RULE = (
    "atol = eps*sqrt(B*K)*sqrt(t), rtol = 16*atol (t = steps completed); pass when "
    "|sharded - baseline| <= atol + rtol*|baseline| (drift: scale max|params_baseline|)"
)


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


# ------------------------------------------------------------------------------------------------ the loop


def _divisible_batch_sizes(num_shards: int, num_train: int, around: int) -> str:
    """A few multiples of S near ``around`` that fit the training split."""
    sizes = [m for m in range(num_shards, num_train + 1, num_shards)]
    sizes.sort(key=lambda m: (abs(m - around), m))
    return ", ".join(map(str, sorted(sizes[:4])))


@functools.partial(jax.jit, static_argnums=0)
def _eval_losses(graphdef, params_baseline, params_sharded, x_train, y_train, x_test, y_test):
    """``(train_b, train_s, test_b, test_s)``: :func:`mse_loss` of both models on both splits, one dispatch."""
    out = []
    for params in (params_baseline, params_sharded):
        model = nnx.merge(graphdef, params)
        out.append((mse_loss(model, x_train, y_train), mse_loss(model, x_test, y_test)))
    (train_b, test_b), (train_s, test_s) = out
    return jnp.stack([train_b, train_s, test_b, test_s])


def _host_params(model: nnx.Module):
    """The model's parameters as host NumPy arrays (gathered over processes when sharded across them)."""
    return gather_to_host(nnx.state(model, nnx.Param))


def _scalar(a) -> float:
    """A 0-d loss as float; a loss replicated over several processes is read from a local copy."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        a = a.addressable_data(0)
    return float(a)


def _max_abs(tree) -> float:
    return max(float(np.max(np.abs(a))) for a in jax.tree.leaves(tree))


def _max_abs_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(u - v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def train(
    x,
    y,
    *,
    strategy: str = "fsdp",
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
    """Train a sharded strategy and the single-device baseline in lock-step and record how far they drift apart.

    Both runs start from the same parameters (two models built by :func:`~shardcheck.make_model` from ``seed``)
    and the same optimizer (:func:`~shardcheck.make_tx`), and take the same shuffled mini-batches
    (:func:`~shardcheck.datasets.minibatch_indices`: reshuffled each epoch, the last incomplete batch dropped). The baseline is
    :func:`~shardcheck.sgd_step`; the sharded run is :func:`~shardcheck.reduced_sgd_step` with S shards
    (``"simulation"``), or ``data_parallel_sgd_step`` / ``fsdp_sgd_step`` of :mod:`shardcheck.spmd` on a
    1-D mesh of S devices (``"dp"``, ``"fsdp"``). Every step is compiled once (all batches share one shape);
    the full-split evaluation is one jitted function.

    Data: ``x``/``y`` are split by :func:`split_and_standardize` (``train_test_split`` with ``seed``) and
    standardized with the training statistics.

    In a multi-process run (``shardcheck launch``) every process must call this with the same arguments: the
    mesh spans all processes, each feeds its rows of every global batch, and each also runs the (cheap)
    baseline itself; every process returns the same report.

    Args:
        x: ``(N, D)`` numeric features, unstandardized.
        y: ``(N, K)`` numeric targets (``(N,)`` is taken as K = 1).
        strategy: ``"simulation"``, ``"dp"`` or ``"fsdp"``.
        num_shards: S >= 1; default 2 for ``"simulation"`` and 4 for ``"dp"``/``"fsdp"``, or the mesh axis size
            when ``mesh`` is given.
        model: ``"linear"`` or ``"mlp"``.
        hidden: H, the MLP's hidden width.
        optimizer: ``"sgd"``, ``"momentum"`` or ``"adam"``.
        lr: learning rate; default per optimizer (``DEFAULT_LR``: sgd 0.1, momentum 0.05, adam 0.01).
        epochs: E >= 1.
        batch_size: B >= 1, a multiple of S, at most the number of training rows.
        test_fraction: share of rows held out, ``0 < f < 1``; at least one row must land in each split.
        seed: seed of the split, the shuffles and the initial parameters.
        mesh: for ``"dp"``/``"fsdp"``, a 1-D mesh with axis ``"data"``; built with ``make_mesh(S)`` when None.
        name: the data set's name, for the report.
        callback: called with a :class:`TrainProgress` after every step (and on every process).

    Returns:
        A :class:`TrainReport`.

    Raises:
        ValueError: unknown ``strategy``/``model``/``optimizer``; a non-positive or non-int count; ``lr`` not
            finite and positive; ``test_fraction`` outside (0, 1); ``x``/``y`` not 2-D, different row counts,
            NaN or inf; a training split smaller than ``batch_size``; ``batch_size`` not divisible by S (the
            message lists nearby valid batch sizes); more mesh devices than exist. All checked before any step.
    """
    fn = "train"
    t0 = time.perf_counter()
    for arg, value, choices in (
        ("strategy", strategy, STRATEGIES),
        ("model", model, MODEL_KINDS),
        ("optimizer", optimizer, OPTIMIZERS),
    ):
        if value not in choices:
            raise ValueError(f"{fn}: {arg}={value!r} is unknown; use one of {', '.join(choices)}")
    if mesh is not None and num_shards is None:
        num_shards = int(mesh.shape["data"]) if "data" in mesh.axis_names else None
    if num_shards is None:
        num_shards = DEFAULT_NUM_SHARDS[strategy]
    num_shards = _validate.check_int(fn, "num_shards", num_shards, minimum=1, example="num_shards=4")
    hidden = _validate.check_int(fn, "hidden", hidden, minimum=1, example="hidden=32")
    epochs = _validate.check_int(fn, "epochs", epochs, minimum=1, example="epochs=10")
    batch_size = _validate.check_int(fn, "batch_size", batch_size, minimum=1, example="batch_size=64")
    seed = _validate.check_int(fn, "seed", seed, minimum=0, example="seed=0")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    lr = _validate.check_lr(fn, lr)
    if (
        isinstance(test_fraction, bool)
        or not isinstance(test_fraction, numbers.Real)
        or not 0 < test_fraction < 1
    ):
        raise ValueError(f"{fn}: test_fraction={test_fraction!r} must be a number in (0, 1); pass e.g. 0.2")

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
    n = x.shape[0]
    num_test = math.ceil(test_fraction * n)  # train_test_split's rule for a float test_size
    num_train = n - num_test
    if num_train < 1 or num_test < 1:
        raise ValueError(
            f"{fn}: {n} rows with test_fraction={test_fraction} leave {num_train} training and {num_test} test "
            "rows; each split needs at least one row: use more data or another test_fraction"
        )
    if num_train < num_shards:
        raise ValueError(
            f"{fn}: the training split has {num_train} rows ({n} rows, test_fraction={test_fraction}), fewer than "
            f"the S={num_shards} shards; every shard needs at least one example of each batch: use fewer shards "
            "(devices) or more data"
        )
    if num_train < batch_size:
        raise ValueError(
            f"{fn}: the training split has {num_train} rows ({n} rows, test_fraction={test_fraction}), fewer than "
            f"batch_size={batch_size}; every step needs a full batch: use a batch size <= {num_train} (a multiple "
            f"of S={num_shards}, e.g. {_divisible_batch_sizes(num_shards, num_train, num_train)}) or a smaller "
            "test_fraction"
        )
    if batch_size % num_shards:
        valid = ", ".join(str(s) for s in range(1, batch_size + 1) if batch_size % s == 0)
        raise ValueError(
            f"{fn}: batch_size={batch_size} is not divisible by the shard count S={num_shards}; every shard needs "
            f"an equal share of each batch: use a batch size that is a multiple of {num_shards} (e.g. "
            f"{_divisible_batch_sizes(num_shards, num_train, batch_size)}) or a shard count from {valid}"
        )

    step_sharded, mesh = _sharded_step(fn, strategy, num_shards, mesh)
    x_tr, y_tr, x_te, y_te = split_and_standardize(x, y, test_fraction, seed)
    d, k = x_tr.shape[1], y_tr.shape[1]

    model_b = make_model(model, d, k, hidden=hidden, seed=seed)
    model_s = make_model(model, d, k, hidden=hidden, seed=seed)  # built apart: the mesh steps donate buffers
    opt_b = nnx.Optimizer(model_b, make_tx(optimizer, lr), wrt=nnx.Param)
    opt_s = nnx.Optimizer(model_s, make_tx(optimizer, lr), wrt=nnx.Param)
    graphdef = nnx.graphdef(model_b)
    dtype = jax.tree.leaves(nnx.state(model_b, nnx.Param))[0].dtype
    x_tr_dev, y_tr_dev, x_te_dev, y_te_dev = (jnp.asarray(a) for a in (x_tr, y_tr, x_te, y_te))

    def evaluate(epoch: int, step: int, params_b, params_s) -> EpochRecord:
        values = np.asarray(
            _eval_losses(graphdef, params_b, params_s, x_tr_dev, y_tr_dev, x_te_dev, y_te_dev)
        )
        return EpochRecord(epoch, step, *(float(v) for v in values))

    params_b, params_s = _host_params(model_b), _host_params(model_s)
    records = [evaluate(0, 0, params_b, params_s)]
    steps: list[TrainStep] = []
    steps_per_epoch = num_train // batch_size
    total = steps_per_epoch * epochs
    for epoch, idx in itertools.islice(
        minibatch_indices(num_train, batch_size, seed=seed), epochs * (num_train // batch_size)
    ):
        xb, yb = x_tr[idx], y_tr[idx]
        loss_b = sgd_step(model_b, opt_b, xb, yb)
        loss_s = step_sharded(model_s, opt_s, xb, yb)
        params_b, params_s = _host_params(model_b), _host_params(model_s)
        t = len(steps) + 1
        tol = step_tolerance(batch_size, k, t, dtype)
        lb, ls = _scalar(loss_b), _scalar(loss_s)
        record = TrainStep(
            step=t,
            epoch=epoch,
            loss_baseline=lb,
            loss_sharded=ls,
            max_abs_param_diff=_max_abs_diff(params_s, params_b),
            loss_tolerance=tol.atol + tol.rtol * abs(lb),
            drift_tolerance=tol.atol + tol.rtol * _max_abs(params_b),
        )
        steps.append(record)
        epoch_end = None
        if t % steps_per_epoch == 0:
            epoch_end = evaluate(epoch, t, params_b, params_s)
            records.append(epoch_end)
        if callback is not None:
            callback(TrainProgress(step=record, total_steps=total, epochs=epochs, epoch_end=epoch_end))

    return TrainReport(
        dataset=name,
        strategy=strategy,
        num_shards=num_shards,
        model=model,
        hidden=hidden,
        optimizer=optimizer,
        lr=float(lr),
        epochs=epochs,
        batch_size=batch_size,
        test_fraction=float(test_fraction),
        seed=seed,
        num_train=num_train,
        num_test=num_test,
        in_features=d,
        out_features=k,
        steps_per_epoch=steps_per_epoch,
        dropped_per_epoch=num_train % batch_size,
        steps=tuple(steps),
        epoch_records=tuple(records),
        tolerance_rule=TOLERANCE_RULE,
        wall_s=time.perf_counter() - t0,
    )


def _sharded_step(fn: str, strategy: str, num_shards: int, mesh):
    """The sharded step ``(model, optimizer, x, y) -> loss`` of ``strategy``, and its mesh (None for simulation)."""
    if strategy == "simulation":
        from shardcheck.simulation import reduced_sgd_step

        return (lambda m, o, x, y: reduced_sgd_step(m, o, x, y, num_shards).loss), None
    from shardcheck import spmd

    if mesh is None:
        if num_shards > len(jax.devices()):
            raise ValueError(
                f"{fn}: strategy={strategy!r} with S={num_shards} needs {num_shards} devices, but "
                f"{len(jax.devices())} exist; use num_shards <= {len(jax.devices())} (on CPU, fake more devices "
                "with --devices N, or jax.config.update('jax_num_cpu_devices', N) before JAX initializes)"
            )
        mesh = spmd.make_mesh(num_shards)
    elif "data" not in mesh.axis_names or int(mesh.shape["data"]) != num_shards:
        raise ValueError(
            f"{fn}: mesh has shape {dict(mesh.shape)}, but num_shards={num_shards} needs a 1-D mesh with axis "
            f"'data' of size {num_shards}; build it with make_mesh({num_shards})"
        )
    step = spmd.data_parallel_sgd_step if strategy == "dp" else spmd.fsdp_sgd_step
    if jax.process_count() == 1:
        return (lambda m, o, x, y: step(m, o, x, y, mesh)), mesh

    rows = {}

    def multiprocess_step(m, o, x, y):
        if x.shape[0] not in rows:
            rows[x.shape[0]] = process_batch_indices(x.shape[0], mesh)
        idx = rows[x.shape[0]]
        return step(m, o, *global_batch(x[idx], y[idx], mesh), mesh)

    return multiprocess_step, mesh
