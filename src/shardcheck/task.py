"""The user's training task: a model factory, an optax transformation, a loss and the batches.

A :class:`Task` is the unit every strategy, the parity harness, the training loop, the memory estimate and the
command line work on. Its loss is reduced across shards one way only (``docs/reduction_cases.md`` C4-C6: "psum
the weighted sums and psum the counts, then divide"): each shard's ``loss_fn`` gives a pair ``(sum, weight)``
(a scalar mean loss counts as ``(mean, 1)``, i.e. equal-weight shards), the sums and the weights are added over
the shards, and the total is divided once. For a scalar loss that is the mean of the shard means, which equals
the full-batch mean only when every shard holds the same number of examples; for a ``(sum, weight)`` loss it is
the full-batch ratio for any split.

Which models a task may hold is decided here too, once for every strategy, the harness, the training loop,
memory and the seeds' steps (:func:`check_model`, ``docs/reduction_cases.md`` C7).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck._tree import copy_arrays, path_str

Batch = Any  # a pytree (dict / tuple / array) whose every leaf has the batch axis first
LossFn = Callable[[nnx.Module, Batch], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A training task: what one optimizer step of the user's model computes.

    Attributes:
        model: a zero-argument callable returning a fresh ``nnx.Module``, with identical parameter values on
            every call (seed its ``nnx.Rngs``).
        optimizer: the ``optax.GradientTransformation`` of the step; wrapped as
            ``nnx.Optimizer(model, optimizer, wrt=nnx.Param)``. A gradient accumulation over steps is
            ``optax.MultiSteps(tx, every_k_schedule=k).gradient_transformation()`` (the ``MultiSteps`` object
            itself is not a transformation and is refused with that fix).
        loss_fn: ``loss_fn(model, batch)`` returning the scalar mean loss, or a pair ``(loss_sum, weight)`` of
            0-d arrays (a token-weighted cross-entropy returns the sum over unmasked tokens and their count). The
            weight must not depend on the parameters (it is a count or a mask sum).
        batches: a non-empty sequence of batch pytrees (dicts, tuples or arrays of any dtype and rank); every
            leaf of a batch has the same leading (batch) size B. Dtypes are kept: int token ids stay int.
        name: shown in reports.
        reduction_size: the number of terms the loss sums over in one batch, for the parity tolerance
            (``shardcheck.parity.tolerance.derive``); default: the element count of the batch's largest leaf (B * T for
            ``(B, T)`` token ids, B * K for ``(B, K)`` targets).

    Raises (on construction):
        TypeError: ``model`` or ``loss_fn`` not callable, ``optimizer`` not an ``optax.GradientTransformation``,
            ``batches`` not a sequence (a generator must be made a list), a batch leaf that is not an array of
            numbers.
        ValueError: ``batches`` empty; a batch whose leaves differ in leading size (the message names the leaf
            paths), a 0-d leaf, an empty batch, NaN/inf in a floating leaf; ``reduction_size < 1``.
    """

    model: Callable[[], nnx.Module]
    optimizer: optax.GradientTransformation
    loss_fn: LossFn
    batches: Sequence[Batch]
    name: str = "task"
    reduction_size: int | None = None

    def __post_init__(self):
        fn = "Task"
        if isinstance(self.model, nnx.Module) or not callable(self.model):
            raise TypeError(
                f"{fn}: model must be a zero-argument callable returning a fresh nnx.Module, got "
                f"{type(self.model).__name__}; pass e.g. model=lambda: MyModel(rngs=nnx.Rngs(0))"
            )
        if isinstance(self.optimizer, optax.MultiSteps):
            raise TypeError(
                f"{fn}: optimizer must be an optax.GradientTransformation, got MultiSteps (a wrapper object, not a "
                "transformation itself); pass optimizer=optax.MultiSteps(tx, every_k_schedule=k)"
                ".gradient_transformation()"
            )
        if not isinstance(self.optimizer, optax.GradientTransformation):
            raise TypeError(
                f"{fn}: optimizer must be an optax.GradientTransformation, got {type(self.optimizer).__name__}; "
                "pass e.g. optimizer=optax.adam(1e-3) (shardcheck wraps it in nnx.Optimizer itself)"
            )
        if not callable(self.loss_fn):
            raise TypeError(
                f"{fn}: loss_fn must be a callable loss_fn(model, batch) -> loss or (loss_sum, weight), got "
                f"{type(self.loss_fn).__name__}"
            )
        if isinstance(self.batches, str | bytes) or not isinstance(self.batches, Sequence):
            raise TypeError(
                f"{fn}: batches must be a sequence (list or tuple) of batch pytrees, got "
                f"{type(self.batches).__name__}; pass e.g. batches=list(my_iterator)"
            )
        if len(self.batches) == 0:
            raise ValueError(f"{fn}: batches is empty; pass at least one batch")
        checked = tuple(check_batch(fn, b, index=i) for i, b in enumerate(self.batches))
        object.__setattr__(self, "batches", checked)
        if self.reduction_size is not None:
            from shardcheck import _validate

            _validate.check_int(fn, "reduction_size", self.reduction_size, example="reduction_size=B * T")

    def new_model(self, fn: str = "Task.model") -> nnx.Module:
        """A fresh model from the factory, built with ``nnx.use_eager_sharding(False)``.

        A model whose parameters carry sharding annotations (``nnx.with_partitioning``) would otherwise need a
        mesh in context to be built at all (Flax places annotated variables eagerly); shardcheck builds it on
        the default device, keeps the annotations as metadata and places the state itself, per strategy
        (:func:`shardcheck.steps.sharded.state_specs`).

        Raises:
            TypeError: the factory needs arguments, or returns something that is not an ``nnx.Module``.
            ValueError: the factory raised anything else (a ``TypeError`` of its own stays one): the message
                names the factory, where it is defined (the task file and line) and its own error.
        """
        try:
            with nnx.use_eager_sharding(False):
                model = self.model()
        except TypeError as err:
            if "argument" not in str(err) or not _needs_arguments(self.model, err):
                raise TypeError(_factory_raised(fn, self.model, err)) from err
            raise TypeError(
                f"{fn}: the task's model must be callable with no arguments ({err}); pass e.g. "
                "model=lambda: MyModel(rngs=nnx.Rngs(0))"
            ) from None
        except Exception as err:  # noqa: BLE001 - the user's factory: said as such, its own error kept
            raise ValueError(_factory_raised(fn, self.model, err)) from err
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"{fn}: the task's model factory returned {type(model).__name__}, not an nnx.Module; it must "
                "build and return a fresh module"
            )
        return model

    def new_optimizer(self, model: nnx.Module) -> nnx.Optimizer:
        """``nnx.Optimizer(model, self.optimizer, wrt=nnx.Param)``."""
        return nnx.Optimizer(model, self.optimizer, wrt=nnx.Param)

    def initial_state(self, fn: str = "Task.model") -> tuple[nnx.Module, nnx.Optimizer]:
        """A fresh ``(model, optimizer)`` pair: :meth:`new_model` and :meth:`new_optimizer`, built once per task
        where their arrays hold at most :data:`CACHED_STATE_BYTES`, then new objects over copies of those arrays
        (the factory gives identical values on every call; a copy costs one ``jax.device_put``, a build the
        factory's eager initializers and the optimizer's ``init``: 25 ms and 7 ms of tiny-lm's, against 5 ms).

        Raises:
            TypeError: as :meth:`new_model`.
        """
        return initial_states(self, fn, 1)[0]

    def terms(self, batch: Batch) -> int:
        """The reduction length of one batch: :attr:`reduction_size`, or the size of its largest leaf."""
        if self.reduction_size is not None:
            return int(self.reduction_size)
        return max(int(np.size(a)) for a in jax.tree.leaves(batch))


CACHED_STATE_BYTES = 64 * 2**20
"""The largest initial state (parameters and optimizer state, bytes) :meth:`Task.initial_state` keeps for the
checks after the first: a larger model is built afresh each time rather than held twice."""

_INITIAL_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def initial_states(task: Task, fn: str, n: int) -> list[tuple[nnx.Module, nnx.Optimizer]]:
    """``n`` independent fresh ``(model, optimizer)`` pairs of ``task`` (:meth:`Task.initial_state`, ``n``
    times): where the task keeps its initial state, ``n`` new graphs over copies of its arrays made by one
    ``jax.device_put`` (a check's setup takes three: its probes', the reference's and the candidate's; copying the
    first twice traversed its graph twice, issue #35); else one built afresh and ``n - 1`` copies of it.

    Raises:
        TypeError: as :meth:`Task.new_model`.
    """
    cached = _INITIAL_STATE.get(task)
    if cached is None:
        model = task.new_model(fn)
        pair = (model, task.new_optimizer(model))
        graphdef, state = nnx.split(pair)
        if sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(state)) > CACHED_STATE_BYTES:
            return [pair, *(nnx.merge(graphdef, copy_arrays(state)) for _ in range(n - 1))]
        cached = _INITIAL_STATE[task] = (graphdef, state)
    graphdef, state = cached
    return [nnx.merge(graphdef, copied) for copied in copy_arrays([state] * n)]


def abstract_training_state(fn: str, task: Task) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)`` of a task under ``nnx.eval_shape``: shapes, dtypes and annotations, nothing allocated.

    The pair is ``task.new_model()`` and ``nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)`` traced by
    ``nnx.eval_shape`` (the optimizer state is ``task.optimizer.init`` of the abstract parameters, and inherits
    their sharding annotations), built under ``nnx.use_eager_sharding(False)`` so that an annotated model needs
    no mesh in context.
    """

    def build():
        model = task.new_model(fn)
        return model, task.new_optimizer(model)

    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


# ------------------------------------------------------------------------------------------------- batches


def _as_leaf(fn: str, path: str, a) -> Any:
    if isinstance(a, jax.Array | np.ndarray):
        arr = a
    else:
        try:
            arr = np.asarray(a)
        except Exception as err:  # ragged lists, objects numpy cannot hold
            raise TypeError(
                f"{fn}: batch leaf {path!r} must be an array of numbers, got {type(a).__name__}"
            ) from err
    dtype = np.dtype(arr.dtype) if arr.dtype != jnp.bfloat16 else None
    if dtype is not None and dtype.kind not in "biuf":
        raise TypeError(
            f"{fn}: batch leaf {path!r} has dtype {arr.dtype}, which is not numeric; pass int, float or bool "
            "arrays (token ids as int32)"
        )
    return arr


def check_batch(fn: str, batch: Batch, *, index: int | str = 0) -> Batch:
    """Validate one batch pytree and return it with every leaf an array (dtypes kept).

    Rules: at least one leaf; every leaf numeric (bool, int, float), at least 1-D, with the same non-zero
    leading size B; no NaN or inf in floating leaves (a host check; arrays spread over several processes are
    not read).

    Raises:
        TypeError: a non-numeric leaf.
        ValueError: no leaves, a 0-d leaf, different leading sizes (naming two leaf paths and their sizes), an
            empty batch, non-finite values (naming the leaf).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise ValueError(f"{fn}: batch {index} has no array leaves; a batch is a pytree of arrays")
    leaves, sizes = [], {}
    for p, a in flat:
        path = path_str(p) or "<root>"
        a = _as_leaf(fn, path, a)
        if a.ndim == 0:
            raise ValueError(
                f"{fn}: batch {index} leaf {path!r} is 0-d; every leaf needs the batch axis first (shape (B, ...)); "
                "put per-batch constants in loss_fn, not the batch"
            )
        sizes[path] = int(a.shape[0])
        if a.dtype.kind == "f" and (not isinstance(a, jax.Array) or a.is_fully_addressable):
            if not bool(np.isfinite(np.asarray(a)).all()):
                raise ValueError(
                    f"{fn}: batch {index} leaf {path!r} contains NaN or inf; clean the data first"
                )
        leaves.append(a)
    if len(set(sizes.values())) > 1:
        (p0, b0), (p1, b1) = next((a, b) for a in sizes.items() for b in sizes.items() if a[1] != b[1])
        raise ValueError(
            f"{fn}: batch {index} leaves differ in leading (batch) size: {p0!r} has {b0} rows but {p1!r} has "
            f"{b1}; every leaf must have the batch axis first with the same size"
        )
    if next(iter(sizes.values())) == 0:
        raise ValueError(f"{fn}: batch {index} is empty (leading size 0); pass at least one example")
    return jax.tree.unflatten(treedef, leaves)


def batch_size(batch: Batch) -> int:
    """The leading size B shared by every leaf of a checked batch."""
    return int(jax.tree.leaves(batch)[0].shape[0])


def check_divisible(
    fn: str,
    batch: Batch,
    num_shards: int,
    *,
    weighted: bool,
    by: str | None = None,
    counts: str = "num_shards",
) -> None:
    """``batch`` must split into ``num_shards`` equal, non-empty shards along its leading axis.

    A scalar mean loss (``weighted=False``) also needs equal shards for the mean of the shard means to be the
    full-batch mean; a ``(sum, weight)`` loss needs them only because a device mesh splits arrays evenly. ``by``
    and ``counts``: what S counts and the name of the valid values listed, in the caller's terms
    (:func:`shardcheck._validate.check_divisible`).

    Raises:
        ValueError: more shards than rows, or B not divisible by S: the one message of
            :func:`shardcheck._validate.check_divisible`, naming a leaf, listing the shard counts that divide B,
            and giving the fix.
    """
    from shardcheck import _validate

    b = batch_size(batch)
    path = path_str(jax.tree_util.tree_flatten_with_path(batch)[0][0][0]) or "<root>"
    fix = (
        "pad the batch to a multiple of S and mask the padding out of the loss's (sum, weight)"
        if weighted
        else "return (loss_sum, weight) from loss_fn and pad the batch to a multiple of S with weight-0 rows, "
        "so that uneven shards are reduced exactly"
    ) + (
        "; a loss that couples the rows, such as a contrastive one scoring each row against the batch, would "
        "still see padding rows: give it a batch size divisible by S instead"
    )
    subject = f"batch size {b} (batch leaf {path!r})"
    _validate.check_divisible(fn, b, num_shards, subject=subject, fix=fix, by=by, counts=counts)


def batch_shape_hint(batches) -> str:
    """Where a batch's leaf is shaped otherwise than batch 0's beyond its leading size, that in words
    (``"batch 1's leaf 'obs' is shaped (16, 11) where batch 0's is (16, 12)"``): the likely cause of a step that
    raises on that batch (a ``dot_general`` of mismatched sizes names no batch); ``""`` where every batch's leaves
    share batch 0's trailing shapes (a task may still mean batches of other shapes: a hint, not an error)."""
    first = {path_str(p): np.shape(a) for p, a in jax.tree_util.tree_flatten_with_path(batches[0])[0]}
    for index, batch in enumerate(batches[1:], start=1):
        for p, a in jax.tree_util.tree_flatten_with_path(batch)[0]:
            path, shape = path_str(p), np.shape(a)
            if path in first and tuple(shape[1:]) != tuple(first[path][1:]):
                return f"batch {index}'s leaf {path!r} is shaped {tuple(shape)} where batch 0's is {tuple(first[path])}"
    return ""


def split_batch(batch: Batch, num_shards: int) -> Batch:
    """Every leaf reshaped ``(B, ...) -> (S, B/S, ...)``: S contiguous shards (seed 000's equal split)."""
    return jax.tree.map(
        lambda a: a.reshape((num_shards, a.shape[0] // num_shards) + tuple(a.shape[1:])), batch
    )


def shards_with_state(batch: Batch, rest, num_shards: int, per_row_state: bool):
    """``(xs, at)`` for a per-shard evaluation of the loss (traceable): ``xs`` to ``jax.lax.map`` / ``scan`` over,
    and ``at(x) -> (shard batch, shard rest)`` for its elements.

    ``rest``: the model's non-parameter state (``nnx.split(model, nnx.Param, ...)``'s third part). With
    ``per_row_state``, each of its leaves whose leading dimension is the batch's row count (per-row state: a
    truncated-BPTT hidden state carried between batches, issue #36 trial 12) is cut into the S shards' rows as
    the batch is; the other leaves (and all of them without it) are whole in every shard. Callers try without
    first and cut only where the model does not trace on a shard with its whole state.
    """
    leaves, treedef = jax.tree.flatten(rest)
    rows = {np.shape(a)[0] for a in jax.tree.leaves(batch) if np.ndim(a)}
    (b,) = rows if len(rows) == 1 else (None,)
    cut = [per_row_state and b is not None and np.ndim(a) >= 1 and np.shape(a)[0] == b for a in leaves]
    parts = tuple(
        a.reshape((num_shards, b // num_shards) + tuple(a.shape[1:]))
        for a, c in zip(leaves, cut, strict=True)
        if c
    )

    def at(x):
        shard, mine = x
        it = iter(mine)
        return shard, jax.tree.unflatten(
            treedef, [next(it) if c else a for a, c in zip(leaves, cut, strict=True)]
        )

    return (split_batch(batch, num_shards), parts), at


# ---------------------------------------------------------------------------------------------------- loss


def loss_terms(loss_fn: LossFn, model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array | None]:
    """``(loss_sum, weight)`` of ``loss_fn`` on one shard; ``(loss, None)`` for a scalar loss.

    ``None`` stands for a weight of 1 per shard (equal-weight shards), so that the steps divide by the shard
    count, a constant, rather than reduce a constant across devices. The weight is passed through
    ``jax.lax.stop_gradient``: it is a count, not a function of the parameters. Traceable; the shapes are
    checked by :func:`check_loss_output` before any step runs.
    """
    out = loss_fn(model, batch)
    if isinstance(out, tuple | list):
        total, weight = out
        return jnp.asarray(total), jax.lax.stop_gradient(jnp.asarray(weight, dtype=jnp.result_type(total)))
    return jnp.asarray(out), None


def mean_loss(loss_fn: LossFn, model: nnx.Module, batch: Batch) -> jax.Array:
    """The full-batch loss: ``loss_sum / weight``, or the scalar loss itself (traceable)."""
    total, weight = loss_terms(loss_fn, model, batch)
    return total if weight is None else total / weight


def batch_weight(loss_fn: LossFn, graphdef, params, rest, batch: Batch) -> float | None:
    """The batch's total weight under a ``(loss_sum, weight)`` loss (the count it divides the sum by, e.g. the
    unmasked tokens), a Python float; ``None`` for a scalar mean loss.

    ``graphdef, params, rest`` is the model as ``nnx.split(model, nnx.Param, ...)`` gives it (any parameter values:
    the weight is a count, not a function of them, :func:`loss_terms`); ``batch`` the whole batch (not a shard).
    Runs ``loss_fn`` once, jitted (compiled once per loss and model structure)."""
    weight = _weight_of(loss_fn, graphdef, params, rest, batch)
    return None if weight is None else float(weight)


def task_batch_weight(task: Task, batch: Batch) -> float | None:
    """:func:`batch_weight` of ``task``'s loss on ``batch``, on a model its factory builds inside the jit: the
    compiled computation keeps only what the weight reads (a count of the batch), so no parameter of the model's
    size is allocated (a model too large for one device included). A factory that reads concrete values as it
    builds the model (it cannot be traced) builds it eagerly instead (:meth:`Task.new_model`)."""
    try:
        weight = _fresh_weight(task.model, task.loss_fn, batch)
    except jax.errors.JAXTypeError:  # a concretization or a tracer converted to NumPy in the factory
        return batch_weight(task.loss_fn, *nnx.split(task.new_model(), nnx.Param, ...), batch)
    return None if weight is None else float(weight)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _weight_of(loss_fn, graphdef, params, rest, batch):
    # new Variables (copy=True): the model's own would belong to the caller's trace (issue #34)
    _, weight = loss_terms(loss_fn, nnx.merge(graphdef, params, rest, copy=True), batch)
    return weight


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fresh_weight(factory, loss_fn, batch):
    with nnx.use_eager_sharding(False):
        graphdef, params, rest = nnx.split(factory(), nnx.Param, ...)
    return _weight_of(loss_fn, graphdef, params, rest, batch)


def divide(tree, weight):
    """Every leaf divided by ``weight`` and cast back to its own dtype (bf16 gradients stay bf16)."""
    return jax.tree.map(lambda g: (g / weight).astype(g.dtype), tree)


def is_weighted(out) -> bool:
    """Whether a ``loss_fn`` output is a ``(loss_sum, weight)`` pair."""
    return isinstance(out, tuple | list)


def check_loss_output(fn: str, out, *, step: int = 0) -> bool:
    """Validate a concrete ``loss_fn`` output at step ``step``; returns whether it is a ``(sum, weight)`` pair.

    Raises:
        TypeError: not a scalar or a pair of scalars.
        ValueError: a pair of the wrong length or shapes, a non-finite value, a weight <= 0.
    """
    rule = "loss_fn(model, batch) must return a 0-d mean loss or a pair (loss_sum, weight) of 0-d arrays"
    if isinstance(out, tuple | list):
        if len(out) != 2:
            raise ValueError(f"{fn}: loss_fn returned a sequence of {len(out)} values at step {step}; {rule}")
        parts = {"loss_sum": out[0], "weight": out[1]}
    else:
        parts = {"loss": out}
    for name, v in parts.items():
        if not hasattr(v, "shape") and not isinstance(v, int | float):
            raise TypeError(
                f"{fn}: loss_fn returned {name} of type {type(v).__name__} at step {step}; {rule}"
            )
        if np.ndim(v) != 0:
            raise ValueError(f"{fn}: loss_fn returned {name} of shape {np.shape(v)} at step {step}; {rule}")
        if not np.isfinite(float(np.asarray(v, np.float64))):
            raise ValueError(
                f"{fn}: loss_fn returned a non-finite {name} ({float(np.asarray(v, np.float64))}) at step {step}; "
                "check the model's initialization, the data and the loss's masking"
            )
    if "weight" in parts and not float(np.asarray(parts["weight"], np.float64)) > 0:
        raise ValueError(
            f"{fn}: loss_fn returned weight {float(np.asarray(parts['weight'], np.float64))} at step {step}; the "
            "weight (e.g. the count of unmasked tokens) must be > 0 for the full batch"
        )
    return "weight" in parts


# ------------------------------------------------------------------------------------------- admission


@functools.partial(nnx.jit, static_argnums=0)
def _probe_loss(loss_fn, model, batch):
    return loss_fn(model, batch)


def _other_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """``{dotted path: value}`` of the model's state that is neither a parameter nor an RNG stream."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))))
    return {".".join(map(str, p)): np.array(_raw(v[...])) for p, v in flat}


def _raw(a):
    """``a``, or a PRNG key's raw ``uint32`` data (NumPy cannot hold a key)."""
    if hasattr(a, "dtype") and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(a)
    return a


def _check_param_dtypes(fn: str, model: nnx.Module) -> None:
    """Every ``nnx.Param`` of ``model`` is floating (or complex): ``jax.grad`` differentiates no integer or bool
    leaf, so neither side's step could run (trial 57: an int32 Param read as a bug of every built-in strategy,
    with JAX's "grad requires real- or complex-valued inputs")."""
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        dtype = np.dtype(getattr(leaf.get_value(), "dtype", np.float32))
        if not (np.issubdtype(dtype, np.inexact) or dtype.name == "bfloat16"):
            name = ".".join(str(p) for p in path)
            raise TypeError(
                f"{fn}: model {type(model).__name__}'s parameter {name!r} is an nnx.Param of dtype {dtype.name}; "
                "gradients need floating parameters: keep integer or bool state in an nnx.Variable of its own "
                "(e.g. class Count(nnx.Variable): ...), or make it a float Param"
            )


def check_model(
    fn: str,
    model: nnx.Module,
    loss_fn,
    batch,
    *,
    updated: list | None = None,
    drawn: list | None = None,
    batch_stats: bool = False,
) -> bool:
    """Refuse models whose sharded and full-batch steps differ (C7); returns whether the loss is weighted.

    ``nnx.BatchStat`` variables (BatchNorm) are refused unless ``batch_stats``: a check of a step of the user's
    (``check_parity``, ``record_run``, the memory measurements) accepts them, since a GSPMD step computes the full
    batch's statistics and a ``shard_map`` step can sync them (``axis_name``); a BatchNorm in training mode then
    writes its running averages in the forward pass, ``updated`` names them, and a built-in strategy that computes
    them per shard is refused by name (``parity.harness.setup``). ``loss_fn`` runs once on a clone; the loss at step 0 is
    checked too. ``updated``: a list that receives the dotted paths of the other non-parameter state the forward
    pass wrote (an ``nnx.Variable`` counter incremented in ``__call__``), for the strategies that cannot carry it.
    ``drawn``: a list that receives the RNG streams the forward pass draws from (``rngs.noise``: a VAE's
    ``eps = jax.random.normal(self.rngs.noise(), ...)``, Dropout at a nonzero rate), each a stream whose counter
    moved. Such a model is accepted: a GSPMD step (the full-batch program under ``jax.jit`` on sharded inputs)
    draws the full batch's numbers however the batch is split (``jax_threefry_partitionable``, on by default),
    so the caller refuses only the strategies that run the forward pass per shard or per micro-batch
    (:func:`draws_refusal`). Without ``drawn`` (a caller whose steps all run per shard) such a model is refused.

    Raises:
        TypeError: ``model`` not an ``nnx.Module``; an ``nnx.Param`` that is not floating (an integer or
            bool one: no gradient); a malformed loss output.
        ValueError: BatchStat variables (without ``batch_stats``); RNG streams drawn in the forward pass when ``drawn`` is not given; a
            non-finite loss at step 0; a ``loss_fn`` that raises anything but a TypeError (named in the message;
            a stream the model's ``nnx.Rngs`` lacks is said to be fixed in the model factory).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{fn}: model must be an nnx.Module, got {type(model).__name__}")
    _check_param_dtypes(fn, model)
    if not batch_stats and jax.tree.leaves(nnx.state(model, nnx.BatchStat)):
        raise ValueError(
            f"{fn}: model {type(model).__name__} is refused because it holds nnx.BatchStat variables (e.g. "
            "BatchNorm): each shard would normalise with its own batch statistics, not the full batch's "
            "(docs/reduction_cases.md C7); use LayerNorm, or a model without batch statistics"
        )
    clone = nnx.clone(model)
    before = _rng_counts(clone)
    state_before = _other_state(clone)
    out = _run_loss(fn, loss_fn, clone, batch)
    after = _rng_counts(clone)
    streams = [p.removesuffix(".count") for p in before if not np.array_equal(before[p], after[p])]
    if updated is not None:
        state_after = _other_state(clone)
        updated += [p for p, a in state_before.items() if not np.array_equal(a, state_after.get(p))]
    if streams and drawn is None:
        raise ValueError(draws_refusal(fn, type(model).__name__, streams))
    if drawn is not None:
        drawn += streams
    return check_loss_output(fn, out)


def written_batch_stats(model: nnx.Module, updated) -> tuple[str, ...]:
    """The dotted paths of ``updated`` (:func:`check_model`'s: the state its forward pass writes) that hold
    ``nnx.BatchStat`` variables: a BatchNorm in training mode (``("bn.mean", "bn.var")``), which normalizes with
    the batch's own mean and variance."""
    stats = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.BatchStat))}
    return tuple(p for p in updated if p in stats)


def _rng_counts(model: nnx.Module) -> dict[str, np.ndarray]:
    """``{dotted path: count}`` of the model's RNG streams (``rngs.noise.count``)."""
    return {
        ".".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.RngCount))
    }


def _run_loss(fn: str, loss_fn, model: nnx.Module, batch):
    """``loss_fn(model, batch)`` under ``nnx.jit``; what it raises is re-raised naming ``fn`` and the fix."""
    try:
        return _probe_loss(loss_fn, model, batch)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{fn}: the task's loss_fn raised on batch 0: {err}") from err
    except AttributeError as err:
        missing = re.search(r"No RngStream named '([^']+)'", str(err))
        if missing is None:
            raise _loss_raised(fn, err) from err
        raise ValueError(
            f"{fn}: the model's forward pass draws from an RNG stream its nnx.Rngs lacks ({err}); the fix is in "
            f"the task's model factory, not the loss: name the stream there, e.g. model=lambda: "
            f"MyModel(rngs=nnx.Rngs(params=0, {missing[1]}=1))"
        ) from err
    except Exception as err:  # a KeyError ... in the user's loss: bad input, not a crash
        raise _loss_raised(fn, err) from err


def _loss_raised(fn: str, err: Exception) -> ValueError:
    """The loss's error, naming ``fn`` and the fix: where it is JAX's unbound axis name (a layer of the model
    that names a mesh axis, such as ``nnx.BatchNorm(..., axis_name="data")``), that the task's model runs on one
    device, outside any ``shard_map``, and where the axis belongs (trial 60: "fix the loss function (a batch key
    or a model attribute it names?)")."""
    unbound = re.search(r"unbound axis name: (\w+)", str(err))
    if unbound is not None:
        axis = unbound[1]
        return ValueError(
            f"{fn}: the task's loss_fn raised {type(err).__name__} on batch 0: a layer of the model names mesh axis "
            f"{axis!r} (e.g. nnx.BatchNorm(..., axis_name={axis!r})), and the task's model runs on one device, "
            f"outside any shard_map, where no axis is bound (the single-device reference, and the GSPMD steps, "
            f"run it so); build the task's model without axis_name, and set it in your own step, inside its "
            f"jax.shard_map (model.bn.axis_name = {axis!r} before the forward pass): ({err})"
        )
    return ValueError(
        f"{fn}: the task's loss_fn raised {type(err).__name__} on batch 0: {err}; fix the loss function (a batch "
        "key or a model attribute it names?) and run again"
    )


def draws_refusal(
    fn: str, model: str, streams: Sequence[str], strategy: str | None = None, why: str = ""
) -> str:
    """Why a step that runs the forward pass per shard or per micro-batch cannot check a model that draws random
    numbers in it (``streams``: ``["rngs.noise"]``), and what works: a GSPMD step, or keys folded per global row.

    ``strategy``: the built-in strategy refused, ``why``: how it runs the forward pass and what it draws there
    (``"runs the forward pass per device in jax.shard_map, every shard drawing with the same key"``); ``None``:
    every step ``fn`` admits a model for may be of that kind (the message then names ``fn`` alone)."""
    subject = strategy or "the sharded steps"
    why = why or "run the forward pass per shard or per micro-batch, every shard drawing with the same key"
    return (
        f"{strategy or fn}: {'cannot run this model: ' if strategy else ''}model {model} draws random numbers in its "
        f"forward pass (RNG stream(s) {', '.join(streams)}), and {subject} {why}: that gives the full batch's "
        "numbers only where the model keys each row's draws by its global index carried in the batch, which "
        f"{subject} cannot see, so the check is refused. Check it with a GSPMD step (strategy gspmd, or your own "
        "step jitted over sharded inputs: it draws the full batch's numbers however the rows are split), or in a "
        "step of your own draw with keys folded per global row index (jax.random.fold_in(key, row)), which give "
        "the same numbers however the rows are split"
        + (f" ({fn}, strategy {strategy!r})" if strategy else "")
    )


def _needs_arguments(factory, err: TypeError) -> bool:
    """Whether ``err``, raised calling ``factory()``, says that the factory itself asks for arguments (its
    signature does not bind none, or the error names it: "MLP.__init__() missing 1 required positional
    argument"), as opposed to a ``TypeError`` about an argument of some call inside the model's ``__init__``."""
    name = getattr(factory, "__qualname__", None)
    if name is not None and re.match(rf"{re.escape(name)}(\.__init__)?\(\)", str(err)):
        return True
    try:
        inspect.signature(factory).bind()
    except TypeError:
        return True
    except ValueError:  # no signature to read (a builtin): as the error says
        return True
    return False


def _factory_raised(fn: str, factory, err: BaseException) -> str:
    """What a task's model factory that raised says: the factory (its name, and the file and line it is defined
    at where Python knows them: the task file), its error, and the fix (trial 42: an ``nnx.vmap`` whose
    ``in_axes`` were all ``None`` printed only "error: vmap must have at least one non-None value in in_axes or
    axis_size must be specified")."""
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    code = getattr(factory, "__code__", None)
    where = f" ({code.co_filename}, line {code.co_firstlineno})" if code is not None else ""
    return (
        f"{fn}: the task's model factory {name}{where} raised {type(err).__name__} building the model: {err}; "
        "fix the factory or the modules it builds (the error is theirs, not the step's nor shardcheck's)"
    )
