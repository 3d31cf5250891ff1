"""What every step shares: one optimizer step's result, the loss terms' gradients, and the in-place update.

Every strategy reduces a task's loss the one way of :mod:`shardcheck.task`: each shard gives ``(loss_sum,
weight)`` and the gradient of ``loss_sum``; the sums, the weights and the gradients are added over the shards and
divided once by the total weight (``docs/reduction_cases.md`` C4-C6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from shardcheck.task import LossFn, loss_terms

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step returns beside its in-place update.

    Attributes:
        loss: the 0-d pre-update loss (``sum of loss sums / sum of weights``).
        grads: the gradients applied, an ``nnx.State`` shaped like the parameters (``None`` when not exposed).
        shard_losses: ``(S,)`` per-shard losses ``loss_sum_s / weight_s`` (``None`` when not exposed).
        shard_grads: every shard's gradient of its ``loss_sum``, stacked on a leading axis of size S (each leaf
            ``(S, *shape)``); the simulation's, when asked for (``None`` otherwise).
    """

    loss: jax.Array
    grads: PyTree | None = None
    shard_losses: jax.Array | None = None
    shard_grads: PyTree | None = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step to verify, with what the parity harness needs to know about it.

    Attributes:
        name: shown in reports (``simulation``, ``dp``, ..., or the user's function name).
        step: ``(model, optimizer, batch, **kw) -> loss | result``, updating both in place. A result with
            ``.loss`` (and optionally ``.grads``) exposes more to compare; ``kw`` holds ``mesh=`` when
            ``pass_mesh``.
        num_shards: S, to recognise update ratios S and 1/S and to rerun the mean of per-shard means (the
            ``normalization`` diagnosis) on S shards. ``None``: the check's own ``num_shards`` (``check_parity``'s,
            or its mesh's batch shards); with neither, ratios are recognised from any integer and no
            per-shard-mean step is tried.
        make_optimizer: builds the candidate's optimizer from its model copy and a copy of the reference's
            optimizer (gradient accumulation wraps the transformation in ``optax.MultiSteps``).
        view_optimizer: ``optimizer -> (opt_state tree matching the reference's, update count)``; default:
            ``(nnx.state(optimizer)["opt_state"], optimizer.step)``.
        extra_checks: ``(optimizer, completed_steps) -> [(path, value, expected)]``: exact checks of the
            candidate's own counters and buffers, reported as ``counter``/``opt_state`` leaves.
        pass_mesh: pass ``mesh=`` to ``step``.
        program: ``(jitted, static)`` where ``step(model, optimizer, batch)`` is
            ``run_in_place(jitted, static, model, optimizer, batch)`` (:func:`run_in_place`: ``jitted(*static,
            graphdef, state, batch) -> (result, state)``), or ``None``. Where the parity harness builds the
            candidate from a strategy name and steps both sides in place, it calls ``jitted`` on the pair's
            Variables found once instead of ``step`` (no ``nnx.split`` / ``nnx.update`` a step): the same
            program on the same values.
        builtin: one of shardcheck's own strategies (built from its name by the parity harness): an error it
            raises is said as a limitation or a bug of shardcheck's step, not the user's candidate's.
        donates: whether ``step`` may donate the arrays of the state it is given (a mesh step does: they are
            invalid after it). ``False`` (a step that leaves them as they are, writing new arrays into the
            Variables) lets the parity harness read the candidate's state before a step from those arrays,
            without copying them first.
    """

    name: str
    step: Callable[..., Any]
    num_shards: int | None = None
    make_optimizer: Callable[[nnx.Module, nnx.Optimizer], nnx.Optimizer] | None = None
    view_optimizer: Callable[[nnx.Optimizer], tuple[PyTree, Any]] | None = None
    extra_checks: Callable[[nnx.Optimizer, int], list[tuple[str, Any, Any]]] | None = None
    pass_mesh: bool = False
    program: tuple[Callable[..., Any], tuple] | None = None
    builtin: bool = False
    donates: bool = True


def shard_value_and_grad(loss_fn: LossFn, model: nnx.Module, batch, *, update_state: bool = False):
    """``(loss_sum, weight, d loss_sum / d params)`` of ``loss_fn`` on one shard (traceable).

    Differentiates the ``nnx.Param`` leaves only; the rest of the model's state (RNG streams of a deterministic
    model, an ``nnx.Variable`` counter) is held fixed. With ``update_state``, what the forward pass wrote to that
    state (``self.count[...] += 1``) is written back to ``model``, as ``nnx.value_and_grad`` does.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = params_value_and_grad(loss_fn, graphdef, params, rest, batch, with_state=update_state)
    if update_state:
        nnx.update(model, out[3])
    return out[:3]


def params_value_and_grad(loss_fn: LossFn, graphdef, params, rest, batch, *, with_state: bool = False):
    """As :func:`shard_value_and_grad`, for a model given as ``nnx.split(model, nnx.Param, ...)`` parts;
    ``with_state``: a 4th output, the non-parameter state ``rest`` as the forward pass left it."""

    def terms(p):
        # new Variables (copy=True): the forward pass may write to its state (a counter) inside this trace
        model = nnx.merge(graphdef, p, rest, copy=True)
        total, weight = loss_terms(loss_fn, model, batch)
        return total, (weight, nnx.split(model, nnx.Param, ...)[2] if with_state else None)

    (total, (weight, after)), grads = jax.value_and_grad(terms, has_aux=True)(params)
    return (total, weight, grads, after) if with_state else (total, weight, grads)


def run_in_place(jitted, static: tuple, model: nnx.Module, optimizer: nnx.Optimizer, *args):
    """Call a jitted ``(*static, graphdef, state, *args) -> (out, state)`` and write the new state back."""
    graphdef, state = nnx.split((model, optimizer))
    out, state = jitted(*static, graphdef, state, *args)
    nnx.update((model, optimizer), state)
    return out
