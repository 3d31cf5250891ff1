"""Digit classification: scikit-learn's bundled 8 x 8 digits (no download) and a softmax cross-entropy MLP."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate, datasets
from shardcheck.models import MLP
from shardcheck.task import Task
from shardcheck.tasks.loading import DEFAULT_STEPS, check_sizes, resolve_optimizer

NUM_FEATURES = 64
NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as ``(x (1797, 64) float32 in [0, 1], label (1797,) int32 in [0, 10))``.

    ``x`` is scikit-learn's pixel intensities (0..16) divided by 16. Cached; the arrays are read-only.
    """
    from shardcheck.datasets import load_bundled  # the command line's copy, or scikit-learn

    data, target, _, _ = load_bundled("digits")
    x = (np.asarray(data, np.float64) / 16.0).astype(np.float32)
    label = np.asarray(target, np.int32)
    x.flags.writeable = False
    label.flags.writeable = False
    return x, label


def digits_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of ``model(batch["x"])`` ``(B, 10)`` logits against ``batch["label"]`` ``(B,)``.

    The logits are cast to float32 first (mixed-precision practice: the loss in float32 whatever the compute dtype).
    """
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def digits_task(
    *,
    hidden: int = 32,
    optimizer=None,
    lr: float | None = None,
    batch_size: int = 64,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    compute_dtype=None,
    param_dtype=None,
) -> Task:
    """Classify scikit-learn's 8 x 8 digits (1797 rows, 10 classes) with an MLP 64 -> ``hidden`` -> 10.

    Batches are dicts ``{"x": (B, 64) float32, "label": (B,) int32}``, rows drawn without replacement by
    :func:`shardcheck.datasets.minibatch_indices`. The loss is :func:`digits_loss`, a scalar mean over the B
    examples (equal-weight shards); ``reduction_size`` is B.

    Args:
        hidden: H, the hidden width of :class:`shardcheck.models.MLP` (ReLU).
        optimizer: ``None`` (``"adam"``), ``"sgd"``, ``"momentum"``, ``"adam"`` or an optax transformation.
        lr: learning rate of a named optimizer (default :data:`shardcheck.optimizers.DEFAULT_LR`).
        batch_size: B, default 64 (a multiple of 8, so 8 shards split evenly).
        steps: number of batches.
        seed: seed of the parameters (``nnx.Rngs(seed)``) and of the shuffling.
        compute_dtype: the ``dtype`` of both ``nnx.Linear`` layers (activations and matmuls), e.g.
            ``"bfloat16"``; default float32.
        param_dtype: the layers' ``param_dtype`` (the stored parameters, initialised in float32 and cast);
            default float32.

    Returns:
        The :class:`~shardcheck.task.Task`; its model factory returns identical parameters on every call.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: ``batch_size`` larger than 1797, a value out of range, an unknown optimizer name.
    """
    fn = "digits"
    hidden = _validate.check_int(fn, "hidden", hidden, example="hidden=32")
    tx = resolve_optimizer(fn, optimizer, lr)
    x, label = load_digits()
    n = x.shape[0]
    batch_size, steps, seed = check_sizes(fn, batch_size=batch_size, steps=steps, seed=seed, num_rows=n)
    drawn = itertools.islice(datasets.minibatch_indices(n, batch_size, seed=seed), steps)
    batches = [{"x": x[idx], "label": label[idx]} for _, idx in drawn]

    dtypes = {
        k: jnp.dtype(v) for k, v in (("dtype", compute_dtype), ("param_dtype", param_dtype)) if v is not None
    }

    def factory() -> nnx.Module:
        return MLP(NUM_FEATURES, hidden, NUM_CLASSES, **dtypes, rngs=nnx.Rngs(seed))

    return Task(
        model=factory,
        optimizer=tx,
        loss_fn=digits_loss,
        batches=batches,
        name="digits",
        reduction_size=batch_size,
    )
