"""The lock-step training loop: a registered strategy beside the single-device reference, over many steps.

Drift between a sharded run and its reference often shows only after several steps (optimizer moments, step
counters, accumulated rounding). Both loops here take the strategy's step and the reference step from the one
registry, :data:`shardcheck.steps.STRATEGIES`, build them from a loss, start them from independent copies of one
model and optimizer, feed both the same batches in lock-step, and record after every step both pre-update
losses and the largest parameter difference between the two models, each against that step's tolerance:

* :func:`train_task` trains a :class:`~shardcheck.Task` (any model, optax optimizer, loss and batch pytrees) for
  ``epochs`` passes over its batches.
* :func:`train` trains the seeds' regression task on a data set: it holds out a test split, standardizes with
  the training statistics, draws shuffled mini-batches, and after every epoch evaluates the train and test loss
  of both models.

Mini-batches of :func:`train`: the training rows are reshuffled each epoch with one
``np.random.default_rng(seed)`` and cut into ``N_train // B`` full batches; the last incomplete batch is
**dropped** (at most ``B - 1`` rows an epoch, a different set every epoch), so every step has the same shape and
each step function is compiled once.

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
from shardcheck._catalog import COMPARED, REFERENCE
from shardcheck._tree import copy_state
from shardcheck.datasets import Dataset, minibatch_indices
from shardcheck.distributed import gather_to_host
from shardcheck.losses import mse_loss
from shardcheck.models import MODEL_KINDS, make_model
from shardcheck.optimizers import DEFAULT_LR, OPTIMIZERS, make_tx
from shardcheck.parity.propagation import grad_delta, update_sensitivity
from shardcheck.parity.tolerance import Tolerance, derive_tolerance
from shardcheck.steps.registry import STRATEGIES, Strategy, mesh_for
from shardcheck.task import LossFn, Task, check_divisible
from shardcheck.task import batch_size as leading_size

# The strategies a training loop runs beside the reference: every registered one but the reference itself.
TRAIN_STRATEGIES = COMPARED
# The shard count S when none is given: 4 devices for a mesh strategy, 2 shards (or micro-batches) otherwise.
DEFAULT_NUM_SHARDS = {name: 4 if s.uses_mesh else 2 for name, s in STRATEGIES.items()}


# --------------------------------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One lock-step step of both runs.

    Attributes:
        step: 1-based global step number.
        epoch: 1-based epoch the step belongs to.
        loss_baseline: the reference's pre-update loss on this batch (float32 computed, as float).
        loss_sharded: the strategy's pre-update loss on the same batch.
        max_abs_param_diff: after this step's update, ``max`` over parameter leaves of
            ``max|params_sharded - params_baseline|`` (parameter units; 0.0 when bitwise equal).
        loss_tolerance: the largest ``|loss_sharded - loss_baseline|`` this step's tolerance allows.
        drift_tolerance: the largest ``max_abs_param_diff`` this step's tolerance allows (with ``drift_within``:
            the widest tolerance of any element).
        drift_within: the element-by-element verdict of :func:`train` and :func:`train_task` (each element
            within its own tolerance, widened by the optimizer's sensitivity; :data:`TOLERANCE_RULE`); None for a
            record built without it, whose verdict is ``max_abs_param_diff <= drift_tolerance``.
    """

    step: int
    epoch: int
    loss_baseline: float
    loss_sharded: float
    max_abs_param_diff: float
    loss_tolerance: float
    drift_tolerance: float
    drift_within: bool | None = None

    @property
    def loss_agrees(self) -> bool:
        """``|loss_sharded - loss_baseline| <= loss_tolerance``."""
        return abs(self.loss_sharded - self.loss_baseline) <= self.loss_tolerance

    @property
    def drift_exceeded(self) -> bool:
        """``max_abs_param_diff > drift_tolerance`` (or, with ``drift_within``, some element beyond its own)."""
        if self.drift_within is not None:
            return not self.drift_within
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


class _StepSummary:
    """What both reports derive from their ``steps`` (a tuple of :class:`TrainStep`)."""

    steps: tuple[TrainStep, ...]

    @property
    def num_steps(self) -> int:
        """Steps taken by each run."""
        return len(self.steps)

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
class TrainReport(_StepSummary):
    """Everything one :func:`train` run measured.

    Attributes:
        dataset: the data set's name.
        strategy: the registered strategy trained (one of :data:`TRAIN_STRATEGIES`).
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
    def initial(self) -> EpochRecord:
        """Losses at initialization."""
        return self.epoch_records[0]

    @property
    def final(self) -> EpochRecord:
        """Losses after the last epoch."""
        return self.epoch_records[-1]


@dataclasses.dataclass(frozen=True)
class TaskTrainReport(_StepSummary):
    """Everything one :func:`train_task` run measured.

    Attributes:
        task: the task's name.
        strategy: the registered strategy trained (one of :data:`TRAIN_STRATEGIES`).
        num_shards: S, shards, micro-batches or mesh devices.
        placement: where the strategy keeps parameters and optimizer state (the registry's ``placement``).
        epochs: E, passes over the task's batches.
        steps_per_epoch: the task's number of batches.
        batch_size: B of the task's first batch.
        steps: one :class:`TrainStep` per step, ``steps_per_epoch * epochs`` of them, in order.
        tolerance_rule: how ``loss_tolerance`` and ``drift_tolerance`` were derived, in one line.
        wall_s: seconds for the whole loop, compilation included.
    """

    task: str
    strategy: str
    num_shards: int
    placement: str
    epochs: int
    steps_per_epoch: int
    batch_size: int
    steps: tuple[TrainStep, ...]
    tolerance_rule: str
    wall_s: float

    @property
    def first_step(self) -> TrainStep:
        """The first step: both runs' losses at the initial parameters."""
        return self.steps[0]

    @property
    def last_step(self) -> TrainStep:
        """The last step: both runs' final losses (measured before the last update) and drift."""
        return self.steps[-1]


@dataclasses.dataclass(frozen=True)
class TrainProgress:
    """What the progress callback receives after every step.

    Attributes:
        step: the :class:`TrainStep` just taken.
        total_steps: steps the run will take in all.
        epochs: E.
        epoch_end: the :class:`EpochRecord` when this step ended an epoch of :func:`train`, else None.
    """

    step: TrainStep
    total_steps: int
    epochs: int
    epoch_end: EpochRecord | None


# ------------------------------------------------------------------------------------------------ tolerance


def step_tolerance(batch_size: int, out_features: int, step: int, dtype="float32") -> Tolerance:
    """The parity harness's tolerance (:func:`~shardcheck.parity.tolerance.derive_tolerance`) after ``step`` steps (1-based).

    A value passes when ``|sharded - baseline| <= atol + rtol * |baseline|`` (max over elements); for the
    parameter drift the scale is ``max|params_baseline|`` over the whole model. For a task, pass its reduction
    length (``task.terms(batch)``) as ``batch_size`` and ``out_features=1``.

    Example::

        >>> tol = step_tolerance(64, 1, 1)
        >>> round(tol.rtol, 8), round(tol.atol, 9)
        (1.526e-05, 9.54e-07)
    """
    return derive_tolerance(dtype, batch_size=batch_size, out_features=out_features, step=step - 1)


TOLERANCE_RULE = (
    "atol = eps*sqrt(n)*sqrt(t), rtol = 16*atol (n = the task's reduction length per batch, B*K for a regression "
    "batch; t = steps completed); loss: pass when |sharded - baseline| <= atol + rtol*|baseline|; drift: every "
    "element within atol + rtol*max|params_baseline| + the optimizer's accumulated sensitivity to gradient "
    "rounding (as in parity)"
)
"""The one drift rule of :func:`train` and :func:`train_task` (:func:`_task_step`)."""

TASK_TOLERANCE_RULE = TOLERANCE_RULE  # the name train_task's reports used; the same rule


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


# --------------------------------------------------------------------------------------- the lock-step pair


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


def _param_dtype(model: nnx.Module):
    """The least precise floating dtype among the parameters (its eps sets the tolerance)."""
    dtypes = {jnp.dtype(a.dtype) for a in jax.tree.leaves(nnx.state(model, nnx.Param))}
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)] or [jnp.dtype(jnp.float32)]
    return max(floats, key=lambda d: float(jnp.finfo(d).eps))


@dataclasses.dataclass
class _Lockstep:
    """The reference run and the strategy's run, each with its own model and optimizer."""

    reference: Callable
    step: Callable
    ref_model: nnx.Module
    ref_opt: nnx.Optimizer
    model: nnx.Module
    opt: nnx.Optimizer

    def advance(self, batch):
        """One step of both runs on ``batch``: the reference's ``StepResult`` and both pre-update losses."""
        ref_out = self.reference(self.ref_model, self.ref_opt, batch)
        out = self.step(self.model, self.opt, batch)
        return ref_out, (_scalar(ref_out.loss), _scalar(getattr(out, "loss", out)))

    def params(self):
        """Both runs' parameters on the host: ``(reference, strategy)``."""
        return _host_params(self.ref_model), _host_params(self.model)


def _lockstep(fn, strategy: Strategy, loss_fn: LossFn, model, optimizer, num_shards: int, mesh) -> _Lockstep:
    """The strategy's step and the reference step, built by the registry from ``loss_fn``, on copies of the state.

    The strategy's own check (e.g. multiprocess needs a launched run) runs first; a strategy that builds its own
    optimizer from the reference's (gradient accumulation wraps it in ``optax.MultiSteps``) gets it here.
    """
    if strategy.check is not None:
        strategy.check(fn, model, optimizer)
    candidate = strategy.build(loss_fn, num_shards, mesh)
    reference = STRATEGIES[REFERENCE].build(loss_fn, num_shards, None)
    ref_model, ref_opt = copy_state(model, optimizer)
    cand_model, cand_opt = copy_state(model, optimizer)
    if candidate.make_optimizer is not None:
        cand_opt = candidate.make_optimizer(cand_model, cand_opt)
    return _Lockstep(reference.step, candidate.step, ref_model, ref_opt, cand_model, cand_opt)


def _step_record(t: int, epoch: int, losses, params, tol: Tolerance) -> TrainStep:
    """The :class:`TrainStep` of step ``t`` from both losses, both parameter trees and the step's tolerance."""
    (loss_b, loss_s), (params_b, params_s) = losses, params
    return TrainStep(
        step=t,
        epoch=epoch,
        loss_baseline=loss_b,
        loss_sharded=loss_s,
        max_abs_param_diff=_max_abs_diff(params_s, params_b),
        loss_tolerance=tol.atol + tol.rtol * abs(loss_b),
        drift_tolerance=tol.atol + tol.rtol * _max_abs(params_b),
    )


def _trainable(fn: str, name) -> Strategy:
    """The registered strategy ``name``, one a training loop can put beside the reference."""
    if not isinstance(name, str) or name not in TRAIN_STRATEGIES:
        raise ValueError(f"{fn}: strategy={name!r} is unknown; use one of {', '.join(TRAIN_STRATEGIES)}")
    return STRATEGIES[name]


# ------------------------------------------------------------------------------------------- train_task


def _check_task_run(fn, task, strategy, num_shards, mesh, epochs, callback):
    """Validate a :func:`train_task` call and build its lock-step pair; nothing runs. Returns ``(pair, epochs)``."""
    from shardcheck.task import check_model

    if not isinstance(task, Task):
        raise TypeError(
            f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}; build one with "
            "shardcheck.Task(model=..., optimizer=..., loss_fn=..., batches=...) or shardcheck.tasks.load_task"
        )
    chosen = _trainable(fn, strategy)
    num_shards = _validate.check_num_shards(fn, num_shards)
    epochs = _validate.check_int(fn, "epochs", epochs, example="epochs=1")
    if callback is not None and not callable(callback):
        raise TypeError(f"{fn}: callback must be None or a callable, got {type(callback).__name__}")
    mesh = mesh_for(fn, chosen, num_shards, mesh)
    model = task.new_model(fn)
    optimizer = task.new_optimizer(model)
    weighted = check_model(fn, model, task.loss_fn, task.batches[0])
    for batch in task.batches:
        check_divisible(fn, batch, num_shards, weighted=weighted)
    return _lockstep(fn, chosen, task.loss_fn, model, optimizer, num_shards, mesh), epochs


def _task_step(pair: _Lockstep, batch, t: int, epoch: int, tol: Tolerance, allowance):
    """One :func:`train_task` step: both runs, the drift checked element by element; returns the new allowance.

    An element passes when ``|sharded - reference| <= atol + rtol * max|params_reference| + allowance``, the
    allowance accumulating over the steps :func:`~shardcheck.parity.propagation.update_sensitivity` of the reference's update.
    """
    params0 = nnx.as_pure(nnx.state(pair.ref_model, nnx.Param))
    opt_state0 = nnx.as_pure(pair.ref_opt.opt_state)
    ref_out, losses = pair.advance(batch)
    grads = nnx.as_pure(ref_out.grads)
    delta = grad_delta(grads, None, tol.rtol, tol.atol, 0.0)
    sens, _, _ = update_sensitivity(pair.ref_opt.tx, grads, opt_state0, params0, delta)
    sens = [np.asarray(a, np.float64) for a in jax.tree.leaves(sens)]
    allowance = sens if allowance is None else [a + b for a, b in zip(allowance, sens, strict=True)]
    params = pair.params()
    record = _step_record(t, epoch, losses, params, tol)
    base = record.drift_tolerance
    leaves = zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), allowance, strict=True)
    within = all(bool(np.all(np.abs(s - b) <= base + a)) for b, s, a in leaves)
    widest = base + max(float(np.max(a, initial=0.0)) for a in allowance)
    return dataclasses.replace(record, drift_tolerance=widest, drift_within=within), allowance


def train_task(
    task: Task,
    strategy: str,
    *,
    num_shards: int,
    mesh=None,
    epochs: int = 1,
    callback: Callable[[TrainProgress], None] | None = None,
) -> TaskTrainReport:
    """Train a registered strategy's step and the reference step of a task in lock-step; record how they drift.

    Both runs start from independent copies of one ``task.model()`` and its optimizer
    (``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)``; gradient accumulation wraps a copy in
    ``optax.MultiSteps``) and take the task's batches in order, ``epochs`` times. The reference is the registry's
    ``reference`` step (:func:`shardcheck.steps.reference.reference_step`); the strategy's step is built by the
    registry from ``task.loss_fn``. After every step both pre-update losses and the parameter drift are checked
    against the parity tolerance of that step (:func:`step_tolerance` with the batch's reduction length
    ``task.terms(batch)`` and the parameters' least precise float dtype). As in the parity harness, the drift
    tolerance is widened element by element by the optimizer's accumulated sensitivity to gradient rounding:
    Adam divides a gradient by its own scale, so an element whose gradient is zero up to rounding (an attention
    key bias) moves by up to ``lr`` on noise alone, in any correct sharded run.

    Args:
        task: the :class:`~shardcheck.Task`.
        strategy: a key of :data:`shardcheck.steps.STRATEGIES` other than ``"reference"`` (see
            :data:`TRAIN_STRATEGIES`).
        num_shards: S >= 1: shards, micro-batches, or mesh devices; every batch must split into S equal shards.
        mesh: for a mesh strategy, the mesh of S devices (default: the first S devices).
        epochs: E >= 1 passes over the task's batches.
        callback: called with a :class:`TrainProgress` after every step (``epoch_end`` is None).

    Returns:
        A :class:`TaskTrainReport`.

    Raises:
        TypeError: ``task`` not a Task; a malformed ``loss_fn`` output; ``callback`` not callable.
        ValueError: an unknown strategy; a non-positive count; fewer devices than S; a batch S does not split;
            a model with batch statistics or random draws in its forward pass; an optimizer the strategy cannot
            run. All checked before any step.
    """
    fn = "train_task"
    t0 = time.perf_counter()
    pair, epochs = _check_task_run(fn, task, strategy, num_shards, mesh, epochs, callback)
    dtype = _param_dtype(pair.ref_model)
    total = epochs * len(task.batches)
    steps: list[TrainStep] = []
    allowance = None
    for epoch, batch in ((e, b) for e in range(1, epochs + 1) for b in task.batches):
        t = len(steps) + 1
        tol = step_tolerance(task.terms(batch), 1, t, dtype)
        record, allowance = _task_step(pair, batch, t, epoch, tol, allowance)
        steps.append(record)
        if callback is not None:
            callback(TrainProgress(step=record, total_steps=total, epochs=epochs, epoch_end=None))
    return TaskTrainReport(
        task=task.name,
        strategy=strategy,
        num_shards=num_shards,
        placement=STRATEGIES[strategy].placement,
        epochs=epochs,
        steps_per_epoch=len(task.batches),
        batch_size=leading_size(task.batches[0]),
        steps=tuple(steps),
        tolerance_rule=TOLERANCE_RULE,
        wall_s=time.perf_counter() - t0,
    )


# ------------------------------------------------------------------------------------------------- train


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
    fn, *, strategy, num_shards, model, hidden, optimizer, lr, epochs, batch_size, test_fraction, seed, mesh
) -> _Options:
    """The settings of :func:`train`, validated in the order of its signature, defaults filled in."""
    _trainable(fn, strategy)
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
        by=f"the shard count S={s}",
        counts="shard counts",
        fix=f"or use a batch size that is a multiple of {s}, e.g. {_divisible_batch_sizes(s, num_train, b)}",
    )
    return num_train, num_test


def _check_mesh(fn: str, o: _Options, mesh):
    """The mesh of a mesh strategy (``num_shards`` devices, any axes; default ``make_mesh(S)``), else None."""
    strategy = STRATEGIES[o.strategy]
    if not strategy.uses_mesh:
        return None
    if mesh is None and o.num_shards > len(jax.devices()):
        raise ValueError(
            f"{fn}: strategy={o.strategy!r} with S={o.num_shards} needs {o.num_shards} devices, but "
            f"{len(jax.devices())} exist; use num_shards <= {len(jax.devices())} (on CPU, fake more devices "
            "with --devices N, or jax.config.update('jax_num_cpu_devices', N) before JAX initializes)"
        )
    return mesh_for(fn, strategy, o.num_shards, mesh)


@functools.partial(jax.jit, static_argnums=0)
def _eval_losses(graphdef, params_baseline, params_sharded, x_train, y_train, x_test, y_test):
    """``(train_b, train_s, test_b, test_s)``: :func:`mse_loss` of both models on both splits, one dispatch."""
    out = []
    for params in (params_baseline, params_sharded):
        model = nnx.merge(graphdef, params)
        out.append((mse_loss(model, x_train, y_train), mse_loss(model, x_test, y_test)))
    (train_b, test_b), (train_s, test_s) = out
    return jnp.stack([train_b, train_s, test_b, test_s])


@dataclasses.dataclass(frozen=True)
class _Split:
    """The standardized train and test splits (host arrays, and device copies for the evaluation)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def evaluate(self, graphdef, epoch: int, step: int, params_b, params_s) -> EpochRecord:
        """Both models' full-split losses as the :class:`EpochRecord` of ``epoch``."""
        arrays = (self.x_train, self.y_train, self.x_test, self.y_test)
        values = np.asarray(_eval_losses(graphdef, params_b, params_s, *map(jnp.asarray, arrays)))
        return EpochRecord(epoch, step, *(float(v) for v in values))


def _regression_pair(fn: str, o: _Options, split: _Split, mesh) -> _Lockstep:
    """The lock-step pair of the regression task: MSE of ``o.model`` under ``o.optimizer``, built from ``o.seed``."""
    from shardcheck.tasks.regression import regression_loss

    d, k = split.x_train.shape[1], split.y_train.shape[1]
    model = make_model(o.model, d, k, hidden=o.hidden, seed=o.seed)
    optimizer = nnx.Optimizer(model, make_tx(o.optimizer, o.lr), wrt=nnx.Param)
    return _lockstep(fn, STRATEGIES[o.strategy], regression_loss, model, optimizer, o.num_shards, mesh)


def _train_epochs(pair: _Lockstep, split: _Split, o: _Options, callback):
    """The loop of :func:`train`: shuffled full mini-batches, a record per step and per epoch."""
    graphdef, dtype = nnx.graphdef(pair.ref_model), _param_dtype(pair.ref_model)
    num_train, k = split.x_train.shape[0], split.y_train.shape[1]
    per_epoch = num_train // o.batch_size
    total = per_epoch * o.epochs
    records = [split.evaluate(graphdef, 0, 0, *pair.params())]
    steps: list[TrainStep] = []
    allowance = None
    for epoch, idx in itertools.islice(minibatch_indices(num_train, o.batch_size, seed=o.seed), total):
        t = len(steps) + 1
        tol = step_tolerance(o.batch_size, k, t, dtype)  # n = B * K, the regression task's reduction length
        record, allowance = _task_step(
            pair, (split.x_train[idx], split.y_train[idx]), t, epoch, tol, allowance
        )
        steps.append(record)
        epoch_end = None
        if t % per_epoch == 0:
            epoch_end = split.evaluate(graphdef, epoch, t, *pair.params())
            records.append(epoch_end)
        if callback is not None:
            callback(TrainProgress(step=steps[-1], total_steps=total, epochs=o.epochs, epoch_end=epoch_end))
    return tuple(steps), tuple(records)


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
    """Train a registered strategy and the single-device reference in lock-step and record how far they drift apart.

    Both runs start from independent copies of one model (:func:`~shardcheck.make_model` from ``seed``) and its
    optimizer (:func:`~shardcheck.make_tx`), and take the same shuffled mini-batches
    (:func:`~shardcheck.datasets.minibatch_indices`: reshuffled each epoch, the last incomplete batch dropped).
    Both steps come from the registry :data:`shardcheck.steps.STRATEGIES`, built from the regression task's loss
    (:func:`shardcheck.tasks.regression.regression_loss`, MSE on ``(x, y)`` batches): the reference is its
    single-device step; ``strategy`` is any of :data:`TRAIN_STRATEGIES` (``"simulation"``: S shards on one
    device; ``"dp"`` / ``"fsdp"``: a 1-D mesh of S devices; ``"accumulation"``: S micro-batches). Every step is
    compiled once (all batches share one shape); the full-split evaluation is one jitted function.

    Data: ``x``/``y`` are split by :func:`split_and_standardize` (``train_test_split`` with ``seed``) and
    standardized with the training statistics.

    In a multi-process run (``shardcheck launch``) every process must call this with the same arguments: the
    mesh spans all processes, every process passes the same global batch (each device takes its rows), and
    each also runs the (cheap) reference itself; every process returns the same report.

    Args:
        x: ``(N, D)`` numeric features, unstandardized.
        y: ``(N, K)`` numeric targets (``(N,)`` is taken as K = 1).
        strategy: a key of :data:`TRAIN_STRATEGIES`.
        num_shards: S >= 1; default :data:`DEFAULT_NUM_SHARDS` (2 on one device, 4 on a mesh), or the mesh axis
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
    o = _check_options(
        fn, strategy=strategy, num_shards=num_shards, model=model, hidden=hidden, optimizer=optimizer, lr=lr,
        epochs=epochs, batch_size=batch_size, test_fraction=test_fraction, seed=seed, mesh=mesh,
    )  # fmt: skip
    x, y = _check_data(fn, x, y)
    num_train, num_test = _check_split(fn, x.shape[0], o)
    mesh = _check_mesh(fn, o, mesh)
    split = _Split(*split_and_standardize(x, y, o.test_fraction, o.seed))
    steps, records = _train_epochs(_regression_pair(fn, o, split, mesh), split, o, callback)
    return TrainReport(
        dataset=name,
        **dataclasses.asdict(o),
        num_train=num_train,
        num_test=num_test,
        in_features=split.x_train.shape[1],
        out_features=split.y_train.shape[1],
        steps_per_epoch=num_train // o.batch_size,
        dropped_per_epoch=num_train % o.batch_size,
        steps=steps,
        epoch_records=records,
        tolerance_rule=TOLERANCE_RULE,
        wall_s=time.perf_counter() - t0,
    )
