"""Input checks shared by every step. Each raises before any model or optimizer state is touched.

Messages start with the public function's name, name the argument and the value received, state the rule and the
fix, in the habit of ``jnp.sum: where must be ...``.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck._tree import path_str


def _as_array(fn: str, name: str, a) -> jax.Array | np.ndarray:
    if isinstance(a, jax.Array | np.ndarray):
        return a
    try:
        arr = np.asarray(a)
    except Exception as err:  # ragged lists, objects numpy cannot hold
        raise TypeError(f"{fn}: {name} must be an array of numbers, got {type(a).__name__}") from err
    return arr


def _all_finite(a) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.isfinite(a).all())
    return bool(jnp.isfinite(a).all())


def check_batch(fn: str, x, y) -> tuple[jax.Array, jax.Array]:
    """Validate a ``(x, y)`` batch and return it as JAX arrays.

    Rules: numeric (integer or floating, not bool or complex) dtypes, integers converted to float32; both 2-D;
    the same non-zero batch size; no NaN or inf.

    Raises:
        TypeError: non-numeric dtype.
        ValueError: wrong rank, mismatched or empty batch, non-finite values.
    """
    x = _as_array(fn, "x", x)
    y = _as_array(fn, "y", y)
    arrays = {}
    for name, a in (("x", x), ("y", y)):
        dtype = np.dtype(a.dtype)
        if dtype.kind in "iu":
            a = a.astype(np.float32) if isinstance(a, np.ndarray) else a.astype(jnp.float32)
        elif dtype.kind != "f" and dtype != jnp.bfloat16:
            raise TypeError(
                f"{fn}: {name} has dtype {dtype}, which is not numeric; pass float (or integer) data, "
                f"e.g. {name}.astype(np.float32)"
            )
        if a.ndim != 2:
            fix = "(B, D)" if name == "x" else "(B, K); reshape a 1-D target with y[:, None]"
            raise ValueError(f"{fn}: {name} must be 2-D {fix}, got shape {tuple(a.shape)}")
        arrays[name] = a
    x, y = arrays["x"], arrays["y"]
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{fn}: x and y must have the same batch size, got x.shape[0]={x.shape[0]} and y.shape[0]={y.shape[0]}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"{fn}: the batch is empty (x.shape={tuple(x.shape)}); pass at least one example")
    for name, a in (("x", x), ("y", y)):
        if not _all_finite(a):
            raise ValueError(f"{fn}: {name} contains NaN or inf; clean or impute the data before stepping")
    return jnp.asarray(x), jnp.asarray(y)


def check_int(fn: str, name: str, value, *, minimum: int = 1, example: str | None = None) -> int:
    """``value`` must be an int (not bool, float, str or None) >= ``minimum``. Returns it as ``int``.

    Raises:
        TypeError: not an int.
        ValueError: below ``minimum``.
    """
    rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    fix = f"; pass e.g. {example}" if example else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: {name} must be {rule}, got {value!r} ({type(value).__name__}){fix}")
    if value < minimum:
        raise ValueError(f"{fn}: {name} must be {rule}, got {value}{fix}")
    return int(value)


def check_num_shards(fn: str, num_shards) -> int:
    """``num_shards`` must be a positive int (not bool, float or None). Returns it as ``int``."""
    return check_int(fn, "num_shards", num_shards, example="num_shards=2")


def valid_shard_counts(batch: int) -> list[int]:
    """The shard counts that split ``batch`` examples into equal shards (the divisors of ``batch``)."""
    return [s for s in range(1, batch + 1) if batch % s == 0]


def check_divisible(
    fn: str,
    rows: int,
    num_shards: int,
    *,
    fix: str,
    subject: str | None = None,
    by: str | None = None,
    counts: str = "num_shards",
) -> None:
    """The one batch-divisibility rule: ``rows`` examples split into ``num_shards`` equal, non-empty shards.

    Every equal-shard check (shards of a simulation, devices of a mesh, micro-batches, a task's batches, a
    training batch size; ``docs/reduction_cases.md`` C4, C6) calls this function, so there is one message:
    ``"{fn}: batch size B is not divisible by num_shards=S; equal shards are required (valid num_shards for this
    batch: <the divisors of B>; {fix})"``, or, with more shards than rows, ``"{fn}: num_shards=S is more shards
    than examples (batch size B); ..."``.

    Args:
        fn: the public function (or command) checking.
        rows: B, the batch's leading size.
        num_shards: S, the number of equal parts.
        fix: how to fix it, in the caller's terms (the last clause of the message).
        subject: what has B rows (default ``"batch size B"``; e.g. ``"batch_size=30"``).
        by: what S counts (default ``"num_shards=S"``; e.g. ``"the 4 devices of mesh axis 'data'"``).
        counts: the name of the valid values listed (default ``"num_shards"``).

    Raises:
        ValueError: S > B, or B not divisible by S.
    """
    subject = f"batch size {rows}" if subject is None else subject
    by = f"num_shards={num_shards}" if by is None else by
    if num_shards > rows:
        raise ValueError(
            f"{fn}: {by} is more shards than examples ({subject}); every shard needs at least one example: use "
            f"{counts} <= {rows}"
        )
    if rows % num_shards:
        valid = ", ".join(map(str, valid_shard_counts(rows)))
        raise ValueError(
            f"{fn}: {subject} is not divisible by {by}; equal shards are required (valid {counts} for this "
            f"batch: {valid}; {fix})"
        )


def check_equal_shards(fn: str, batch: int, num_shards: int, *, hint: str = "use weights= for uneven shards"):
    """``batch`` must split into ``num_shards`` equal, non-empty shards: :func:`check_divisible` (fix ``hint``)."""
    check_divisible(fn, batch, num_shards, fix=hint)


def check_lr(fn: str, lr, *, name: str = "lr", example: str = "lr=0.1") -> float:
    """``lr`` must be a finite positive real number. Returns it as ``float``. ``name`` and ``example``: how the
    message names the value and its fix (the command line's ``"--lr"`` and ``"--lr 0.1"``)."""
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(
            f"{fn}: {name} must be a finite positive number, got {lr!r} ({type(lr).__name__}); pass e.g. {example}"
        )
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{fn}: {name} must be a finite positive number, got {lr!r}; pass e.g. {example}")
    if lr > float(np.finfo(np.float32).max):
        raise ValueError(
            f"{fn}: {name}={lr!r} overflows float32 (largest {float(np.finfo(np.float32).max):.3g}), where the "
            f"update is computed; pass e.g. {example}"
        )
    return float(lr)


def check_seed(fn: str, seed) -> int:
    """``seed`` must be an int in ``[0, 2**31)`` (it travels into the jitted step as an int32)."""
    check_int(fn, "seed", seed, minimum=0, example="seed=0")
    if not 0 <= seed < 2**31:
        raise ValueError(f"{fn}: seed must be in [0, 2**31), got {seed}; pass e.g. seed=0")
    return int(seed)


def check_params(fn: str, params, in_features: int, out_features: int) -> dict[str, jax.Array] | None:
    """``params`` is None or a mapping with exactly ``kernel`` (D, K) and ``bias`` (K,), finite and numeric."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{fn}: params must be a mapping {{'kernel': (D, K), 'bias': (K,)}}, got {type(params).__name__}"
        )
    if set(params) != {"kernel", "bias"}:
        raise ValueError(
            f"{fn}: params must have exactly the keys 'kernel' and 'bias', got {sorted(map(str, params))}"
        )
    want = {"kernel": (in_features, out_features), "bias": (out_features,)}
    out = {}
    for key in ("kernel", "bias"):
        a = _as_array(fn, f"params[{key!r}]", params[key])
        if np.dtype(a.dtype).kind not in "iuf" and a.dtype != jnp.bfloat16:
            raise TypeError(f"{fn}: params[{key!r}] has dtype {a.dtype}, which is not numeric")
        if tuple(a.shape) != want[key]:
            raise ValueError(
                f"{fn}: params[{key!r}] must have shape {want[key]} for x of width D={in_features} and y of "
                f"width K={out_features}, got {tuple(a.shape)}"
            )
        if not _all_finite(a):
            raise ValueError(f"{fn}: params[{key!r}] contains NaN or inf")
        out[key] = jnp.asarray(a, dtype=jnp.float32)
    return out


def check_model(fn: str, model, x=None, y=None) -> None:
    """The one admission rule for models (``docs/reduction_cases.md`` C7), for a step on the batch ``(x, y)``.

    It is the Task's rule, :func:`shardcheck.task.check_model`, on the seeds' loss
    (:func:`shardcheck.losses.mse_batch_loss`): a model holding ``nnx.BatchStat`` variables (BatchNorm) is
    refused, since each shard would normalise with its own batch statistics; one holding RNG streams is
    accepted when its forward pass draws nothing from them (Dropout at rate 0, ``model.eval()``), and refused
    when it draws: the seeds' sharded steps run the forward pass per shard, every shard drawing with the same key
    (:func:`shardcheck.task.draws_refusal`; ``check_parity`` checks such a model against a GSPMD step). The forward pass is run once, on a clone, only for a
    model holding either kind of state. Without ``x`` and ``y`` (nothing to run) RNG streams are refused.

    With ``x`` and ``y`` given, first check that the model accepts ``x`` and maps it to ``y``'s shape: a target of
    another width would otherwise broadcast in ``(model(x) - y) ** 2`` and give a wrong loss and update, silently
    (see :func:`check_model_io`).

    Raises:
        TypeError: ``model`` not an ``nnx.Module``.
        ValueError: the refusals above; the errors of :func:`check_model_io`.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{fn}: model must be an nnx.Module, got {type(model).__name__}")
    if x is not None and y is not None:
        check_model_io(fn, model, x, y)
    stateful = jax.tree.leaves(nnx.state(model, nnx.BatchStat)) or jax.tree.leaves(
        nnx.state(model, nnx.RngState)
    )
    if not stateful:
        return
    if x is None or y is None:
        raise ValueError(
            f"{fn}: model {type(model).__name__} is refused because it holds batch statistics or RNG streams, "
            "and without a batch shardcheck cannot check that its forward pass draws nothing from them (seed 000)"
        )
    from shardcheck.losses import mse_batch_loss
    from shardcheck.task import check_model as task_rule

    task_rule(fn, model, mse_batch_loss, (x, y))


@functools.lru_cache(maxsize=256)
def _output_struct(graphdef, treedef, leaf_structs, x_struct) -> jax.ShapeDtypeStruct:
    state = jax.tree.unflatten(treedef, list(leaf_structs))
    return jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x_struct)


def check_model_io(fn: str, model, x, y) -> None:
    """``model(x)`` must be defined and have exactly ``y``'s shape ``(B, K)``.

    Evaluated on abstract shapes (``jax.eval_shape``, cached per model structure and batch shape): nothing runs.

    Raises:
        ValueError: ``x``'s width does not fit the model, or the model's output shape differs from ``y.shape``.
    """
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    structs = tuple(jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in leaves)
    try:
        out = _output_struct(graphdef, treedef, structs, jax.ShapeDtypeStruct(x.shape, x.dtype))
    except (TypeError, ValueError) as err:
        first = str(err).splitlines()[0]
        raise ValueError(
            f"{fn}: model {type(model).__name__} cannot take x of shape {tuple(x.shape)} ({first}); pass x with "
            "the model's input width"
        ) from None
    if tuple(out.shape) != tuple(y.shape):
        raise ValueError(
            f"{fn}: y has shape {tuple(y.shape)} but model {type(model).__name__} maps x to shape "
            f"{tuple(out.shape)}; y must have the model's output shape, or (model(x) - y) would broadcast "
            "into a wrong loss"
        )


def check_optimizer(fn: str, optimizer, model) -> None:
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"{fn}: optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}; build it with "
            "nnx.Optimizer(model, tx, wrt=nnx.Param)"
        )
    if optimizer.wrt is not nnx.Param and optimizer.wrt != nnx.Param:
        raise ValueError(
            f"{fn}: optimizer was built with wrt={optimizer.wrt!r}; shardcheck steps differentiate nnx.Param, so "
            "build it with nnx.Optimizer(model, tx, wrt=nnx.Param)"
        )


def check_batch_divisible(fn: str, batch: int, num_shards: int, axis_name: str) -> None:
    """Every device needs an equal, non-empty shard of the batch (:func:`check_divisible`)."""
    check_divisible(
        fn,
        batch,
        num_shards,
        by=f"the {num_shards} devices of mesh axis {axis_name!r}",
        counts="device counts",
        fix=f"padding or dropping examples would change the loss: pass a batch whose size is a multiple of "
        f"{num_shards}",
    )


def check_params_only(fn: str, model) -> None:
    """Refuse any variable but ``nnx.Param`` and RNG streams: the steps neither shard nor synchronise other state.

    RNG streams are judged by the one admission rule (:func:`check_model`): accepted when
    the forward pass draws nothing from them, and then placed as they are, replicated.
    """
    others = nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Any(nnx.Param, nnx.RngState))))
    if others:
        listed = ", ".join(f"{path_str(path)} ({type(var).__name__})" for path, var in others)
        raise ValueError(
            f"{fn}: model {type(model).__name__} holds non-Param state the step cannot shard or keep in sync "
            f"across devices: {listed}. The sharded steps differentiate and distribute nnx.Param variables only; "
            "make these nnx.Param (if trainable), or constants outside the module"
        )
