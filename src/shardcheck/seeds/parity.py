"""The ``(model, optimizer, batches)`` form of :func:`~shardcheck.parity.check_parity`: an adapter that builds the
seeds' regression task from live objects and runs the task harness (:func:`check_parity`,
:func:`assert_step_parity`; ``shardcheck.check_parity`` is this one).

``check_parity(candidate, model, optimizer, batches)`` with ``(x, y)`` or ``(x, y, weights)`` batches is the
seeds' task: MSE of the model on ``(x, y)`` (``(sum_i w_i mean_k err_ik^2, sum_i w_i)`` with weights, C4-C6),
started from the given model and optimizer state. Candidates and references take ``(model, optimizer, x, y)``
(``weights=`` in weighted mode, ``mesh`` when given). Everything else is the task harness.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck.losses import regression_batch_loss as regression_loss  # MSE, weighted with (x, y, w)
from shardcheck.parity.harness import check as harness
from shardcheck.parity.harness.candidates import accepts, check_step_signature
from shardcheck.parity.harness.setup import check_options, check_reference
from shardcheck.parity.report import ParityError
from shardcheck.steps import Candidate
from shardcheck.task import Task


def _check_weights(fn: str, i: int, x, w) -> jnp.ndarray:
    w = np.asarray(w, dtype=np.float32)
    problem = None
    if w.shape != (x.shape[0],):
        problem = f"must have shape ({x.shape[0]},) (one weight per row of x), got shape {w.shape}"
    elif not np.isfinite(w).all():
        problem = f"must be finite, got {int((~np.isfinite(w)).sum())} non-finite value(s)"
    elif (w < 0).any():
        problem = f"must be >= 0, got {int((w < 0).sum())} negative value(s) (min {float(w.min()):g})"
    elif w.sum() <= 0:
        problem = "must not be all zero (no example would count)"
    if problem is not None:
        raise ValueError(
            f"{fn}: batch {i} weights {problem}; pass example counts or a 0/1 mask of shape ({x.shape[0]},)"
        )
    return jnp.asarray(w)


def regression_batches(fn: str, batches, steps: int | None) -> list[tuple]:
    """Validated ``(x, y)`` / ``(x, y, weights)`` batches (a single tuple is repeated ``steps`` times)."""
    if isinstance(batches, tuple) and len(batches) in (2, 3) and all(hasattr(b, "shape") for b in batches):
        batches = [batches] * (1 if steps is None else steps)
    elif not isinstance(batches, Iterable):
        raise TypeError(
            f"{fn}: batches must be an iterable of (x, y) or (x, y, weights), got {type(batches).__name__}"
        )
    out = list(batches) if steps is None else _take(fn, batches, _validate.check_int(fn, "steps", steps))
    if not out:
        raise ValueError(f"{fn}: batches is empty; pass at least one (x, y) batch")
    clean = []
    for i, b in enumerate(out):
        if not isinstance(b, tuple | list) or len(b) not in (2, 3):
            raise ValueError(f"{fn}: batch {i} must be a pair (x, y) or a triple (x, y, weights)")
        x, y = _validate.check_batch(fn, b[0], b[1])
        if len(b) == 3 and b[2] is not None:
            clean.append((x, y, _check_weights(fn, i, x, b[2])))
        else:
            clean.append((x, y))
    return clean


def _take(fn, batches, steps):
    out = []
    for b in batches:
        if len(out) == steps:
            break
        out.append(b)
    if len(out) < steps:
        raise ValueError(f"{fn}: steps={steps} but batches holds only {len(out)}; pass more batches")
    return out


def regression_task(fn: str, model: nnx.Module, optimizer: nnx.Optimizer, batches, steps) -> Task:
    """The seeds' task over these batches; ``model`` and ``optimizer`` are the initial state (copied)."""
    data = regression_batches(fn, batches, steps)
    x, y = data[0][0], data[0][1]
    _validate.check_model_io(fn, model, x, y)
    return Task(
        model=lambda: model,
        optimizer=optimizer.tx,
        loss_fn=regression_loss,
        batches=data,
        name="regression",
        reduction_size=int(x.shape[0] * y.shape[1]),
    )


def adapt_step(fn: str, label: str, step, with_mesh: bool):
    """A ``(model, optimizer, x, y[, mesh][, weights=])`` step as a ``(model, optimizer, batch[, mesh])`` one."""
    check_step_signature(fn, label, step, 4, with_mesh)
    takes_weights = accepts(step, "weights", 99)

    def batch_step(model, optimizer, batch, **kw):
        if len(batch) == 3:
            if not takes_weights:
                raise TypeError(
                    f"{fn}: a batch carries weights but {label} {getattr(step, '__name__', label)!r} takes no "
                    "weights= argument; add a weights=None keyword to it, or pass (x, y) batches"
                )
            kw["weights"] = batch[2]
        return step(model, optimizer, batch[0], batch[1], **kw)

    batch_step.__name__ = getattr(step, "__name__", label)
    batch_step.takes_weights = takes_weights
    return batch_step


def _batch_form(step) -> bool:
    try:
        sig = inspect.signature(step)
        sig.bind(None, None, None)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(None, None, None, None)
    except TypeError:
        return True
    return False


def adapt_candidate(fn: str, candidate, mesh, name):
    """A legacy user step or :class:`Candidate` (``x, y`` form) in the batch form; names stay as they were."""
    if isinstance(candidate, Candidate):
        if _batch_form(candidate.step):  # shardcheck's own strategies already take (model, optimizer, batch)
            return candidate
        wrapped = adapt_step(fn, "candidate", candidate.step, candidate.pass_mesh)
        return dataclasses.replace(candidate, step=wrapped)
    if isinstance(candidate, str) or not callable(candidate):
        return candidate
    pass_mesh = mesh is not None and accepts(candidate, "mesh", 4)
    wrapped = adapt_step(fn, "candidate", candidate, pass_mesh)
    return Candidate(name or getattr(candidate, "__name__", "candidate"), wrapped, pass_mesh=pass_mesh)


def _seed_args(fn, model, args):
    if len(args) != 2:
        raise TypeError(
            f"{fn}: the (model, optimizer, batches) form needs model, optimizer and batches; got {1 + len(args)} "
            "of them. Or pass a shardcheck.Task"
        )
    return model, args[0], args[1]


def check_parity(
    candidate,
    task,
    *seed_args,
    steps=None,
    num_shards=None,
    mesh=None,
    reference=None,
    rtol=None,
    atol=None,
    name=None,
    compute_dtype=None,
    param_dtype=None,
    matmul_precision=None,
    leaf_tolerance=None,
    accept_weak=False,
):
    """:func:`shardcheck.parity.harness.check.check_parity`, also in the ``(model, optimizer, batches)`` form.

    ``check_parity(candidate, model, optimizer, batches)`` checks the seeds' regression task (MSE on ``(x, y)``
    batches, weighted with ``(x, y, weights)``; :func:`regression_task`) from that model and optimizer state; its
    candidate and ``reference`` take ``(model, optimizer, x, y)`` (:func:`adapt_candidate`, :func:`adapt_step`).
    With a :class:`~shardcheck.Task` it is the engine's ``check_parity`` as it is.

    Args:
        candidate: as the engine's, or a ``(model, optimizer, x, y[, mesh][, weights=])`` step.
        task: a :class:`~shardcheck.Task`, or the ``nnx.Module`` of the ``(model, optimizer, batches)`` form.
        *seed_args: the optimizer and the batches of that form (nothing beside a Task).
        steps, num_shards, mesh, reference, rtol, atol, name, compute_dtype, param_dtype, matmul_precision,
            leaf_tolerance, accept_weak: as the engine's.

    Raises:
        TypeError: model, optimizer and batches not all given; a model, optimizer or batches beside a Task; as the
            engine's.
        ValueError: malformed batches or weights; as the engine's.
    """
    fn = "check_parity"
    options = {"rtol": rtol, "atol": atol, "accept_weak": accept_weak, "mesh": mesh}
    check_options(fn, **options, num_shards=num_shards)
    initial_state = None
    if isinstance(task, nnx.Module):  # the (model, optimizer, batches) form: the seeds' regression task
        model, optimizer, batches = _seed_args(fn, task, seed_args)
        _validate.check_optimizer(fn, optimizer, model)
        task = regression_task(fn, model, optimizer, batches, steps)
        candidate = adapt_candidate(fn, candidate, mesh, name)
        if reference is not None:
            check_reference(fn, reference)
            reference = adapt_step(fn, "reference", reference, False)
        steps, initial_state = None, (model, optimizer)
    elif seed_args and isinstance(task, Task):
        raise TypeError(
            f"{fn}: with a Task, pass no model, optimizer or batches beside it (got {len(seed_args)})"
        )
    dtypes = {
        "compute_dtype": compute_dtype,
        "param_dtype": param_dtype,
        "matmul_precision": matmul_precision,
    }
    return harness.check_parity(
        candidate,
        task,
        **options,
        **dtypes,
        steps=steps,
        num_shards=num_shards,
        reference=reference,
        name=name,
        leaf_tolerance=leaf_tolerance,
        initial_state=initial_state,
    )


def assert_step_parity(candidate, task, *seed_args, **kwargs):
    """:func:`check_parity` (either form), raising when parity fails: for a user's own pytest suite.

    Returns:
        The passing :class:`~shardcheck.ParityReport` (``PASS`` or ``PASS (per step)``).

    Raises:
        ParityError: an ``AssertionError`` whose message is the report and whose ``report`` attribute is the
            :class:`~shardcheck.ParityReport`.
        TypeError, ValueError: as :func:`check_parity`.
    """
    report = check_parity(candidate, task, *seed_args, **kwargs)
    if not report.step_ok:
        raise ParityError(report)
    return report
