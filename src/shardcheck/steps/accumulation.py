"""Gradient accumulation of any task over micro-batches with ``optax.MultiSteps``: one full-batch step's update.

``docs/reduction_cases.md`` C9. A batch of B rows is cut into k equal micro-batches; every micro-step computes its
micro-batch's ``loss_sum`` gradient at the current parameters and calls ``optimizer.update`` once, with an
optimizer built on ``optax.MultiSteps(tx, every_k_schedule=k)``, which applies ``tx`` to the *mean* of the k
gradients it received at the k-th micro-step. To make that mean the full-batch gradient for a ``(loss_sum,
weight)`` loss, each micro-gradient is scaled by ``k / W`` with ``W`` the batch's total weight, computed first (a
forward pass of the weights alone, which XLA reduces to the mask sums): the mean of the micro-gradients is then
``sum_i grad(loss_sum_i) / W``. Taking each micro-batch's own mean instead (``grad(loss_sum_i) / weight_i``) is
the accumulation bug of token-weighted losses: it weighs short micro-batches' tokens more.

Counters: ``MultiSteps`` keeps ``gradient_step`` (updates applied) and ``mini_step`` (position in the cycle), and
the NNX optimizer's own ``step`` counts every ``update`` call, that is micro-steps: k per full step.
"""

from __future__ import annotations

import collections
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate
from shardcheck._tree import path_str
from shardcheck.steps._core import Candidate, StepResult, run_in_place, shard_value_and_grad
from shardcheck.task import Batch, LossFn, loss_terms, split_batch


def make_accumulation_optimizer(model: nnx.Module, tx: optax.GradientTransformation, num_micro_batches: int):
    """``nnx.Optimizer(model, optax.MultiSteps(tx, every_k_schedule=k), wrt=nnx.Param)``.

    Args:
        model: the model the optimizer updates.
        tx: the optax transformation of the equivalent full-batch step.
        num_micro_batches: k >= 1, micro-steps per applied update.

    Returns:
        The ``nnx.Optimizer``; its state holds ``acc_grads`` (parameter-shaped, float32), ``mini_step``,
        ``gradient_step`` and ``inner_opt_state`` (``tx``'s state).

    Raises:
        TypeError: ``num_micro_batches`` not an int.
        ValueError: ``num_micro_batches < 1``.
    """
    k = _validate.check_int(
        "make_accumulation_optimizer", "num_micro_batches", num_micro_batches, example="num_micro_batches=2"
    )
    return nnx.Optimizer(model, _multi_steps(tx, k), wrt=nnx.Param)


# (id(tx), k) -> (tx, its MultiSteps): the last few, tx held so that its id is not reused while it is a key
_MULTI_STEPS: collections.OrderedDict = collections.OrderedDict()
_MULTI_STEPS_KEPT = 16


def _multi_steps(tx: optax.GradientTransformation, k: int) -> optax.MultiSteps:
    """One ``optax.MultiSteps(tx, every_k_schedule=k)`` per ``(tx, k)``, built once and then reused.

    The optimizer's ``tx`` is a static attribute of its graphdef, compared by identity (MultiSteps has no
    ``__eq__``): a new MultiSteps per check made every check's graphdef new, and ``_accumulated_jit`` traced and
    compiled again on every call (issue #35).
    """
    key = (id(tx), k)
    kept = _MULTI_STEPS.get(key)
    if kept is None or kept[0] is not tx:
        kept = _MULTI_STEPS[key] = (tx, optax.MultiSteps(tx, every_k_schedule=k))
        while len(_MULTI_STEPS) > _MULTI_STEPS_KEPT:
            _MULTI_STEPS.popitem(last=False)
    _MULTI_STEPS.move_to_end(key)
    return kept[1]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _accumulated_jit(loss_fn, k, graphdef, state, batch):
    # Every nnx object is merged inside the trace that uses it (the eval_shape and the two scan bodies), from
    # arrays that enter that trace as its arguments or carry: a model merged out here, or from arrays closed over,
    # fails in any nnx transform the model applies itself (nnx.scan over stacked layers: "Cannot extract graph
    # node from different trace level", issue #34).
    micro = split_batch(batch, k)

    def weight_of(state, micro_batch):
        model, _ = nnx.merge(graphdef, state)
        return loss_terms(loss_fn, model, micro_batch)[1]

    weights = jax.eval_shape(weight_of, state, jax.tree.map(lambda a: a[0], micro))
    if weights is not None:  # a (loss_sum, weight) loss: the batch's total weight, computed first
        weights = jax.lax.scan(lambda s, b: (s, weight_of(s, b)), state, micro)[1]
    total_weight = k if weights is None else jnp.sum(weights)
    scale = k / total_weight

    def micro_step(carry, micro_batch):
        state, acc = carry
        model, optimizer = nnx.merge(graphdef, state)
        total, weight, grads = shard_value_and_grad(loss_fn, model, micro_batch)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        optimizer.update(model, grads)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return (nnx.state((model, optimizer)), acc), total

    params = nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (state, acc), totals = jax.lax.scan(micro_step, (state, zeros), micro)
    # the mean of the k micro-gradients, which MultiSteps applies: the full batch's gradient
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    return StepResult(jnp.sum(totals) / total_weight, grads), state


def accumulated_step(
    loss_fn: LossFn,
    num_micro_batches: int,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: Batch,
    *,
    with_grads: bool = False,
) -> jax.Array | StepResult:
    """One full step of a task as ``num_micro_batches`` accumulated micro-steps, in place.

    Args:
        loss_fn: the task's loss.
        num_micro_batches: k >= 1, dividing the batch size (checked by the caller).
        model: updated in place (once, at the k-th micro-step).
        optimizer: from :func:`make_accumulation_optimizer` with the same k, at the start of a cycle.
        batch: a batch pytree of leading size B.
        with_grads: also return the gradient the step applied.

    Returns:
        The 0-d pre-update loss ``sum_i loss_sum_i / sum_i weight_i`` (every micro-batch is measured at the same
        parameters); with ``with_grads``, a :class:`~shardcheck.steps.StepResult` holding it and ``grads``, the
        mean of the k scaled micro-gradients that ``optax.MultiSteps`` averages and applies (``sum_i grad
        loss_sum_i / W``, summed in float32, in the parameters' dtypes and tree): the full batch's gradient,
        which the parity check compares like the other strategies' reduced gradients (an optimizer blind to the
        gradient's scale, such as a clip that binds, hides it in the update).
    """
    result = run_in_place(_accumulated_jit, (loss_fn, num_micro_batches), model, optimizer, batch)
    return result if with_grads else result.loss


class _FoundState:
    """``nnx.state(optimizer)["opt_state"]`` of the last optimizer asked about, found by one graph traversal and
    read again at later calls: its Variables are the optimizer's, into which the step writes its new values in
    place (``nnx.update``), so they hold the state as it is now. Found again for another optimizer, or where its
    ``opt_state`` was rebound (its ``mini_step`` Variable is another). The harness reads the candidate's view
    and its extra checks at every step; a traversal of the tiny-lm's optimizer takes about 1.5 ms (issue #35)."""

    def __init__(self):
        self._optimizer = None  # a weak reference: the state of a finished check is not kept alive
        self._state = None

    def __call__(self, optimizer: nnx.Optimizer) -> nnx.State:
        known = self._optimizer is not None and self._optimizer() is optimizer
        if not known or self._state["mini_step"] is not optimizer.opt_state.mini_step:
            self._optimizer, self._state = weakref.ref(optimizer), nnx.state(optimizer)["opt_state"]
        return self._state


def _wrapped_optimizer(model: nnx.Module, optimizer: nnx.Optimizer, k: int) -> nnx.Optimizer:
    """:func:`make_accumulation_optimizer` of ``optimizer.tx`` whose inner state is ``optimizer``'s (its arrays,
    not copies) and whose ``gradient_step`` is ``optimizer``'s step count: the candidate's optimizer.

    The same graph, Variables and arrays as building it with ``optax.MultiSteps.init`` and writing the inner
    state over it, without that init's eager zeros (three parameter-shaped trees, of which only ``acc_grads`` is
    kept: about 9 ms of a tiny-lm check's setup, issue #35): the wrapped transformation's ``init`` gives the
    MultiSteps state with ``optimizer``'s inner state in place (its Variables' values and metadata, as
    ``nnx.update`` would write them; ``nnx.Optimizer`` wraps each leaf as it wraps ``tx.init``'s), and ``tx`` is
    the shared ``MultiSteps`` (:func:`_multi_steps`) once the optimizer is built.

    Args:
        model: the candidate's model.
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` (its state the candidate starts from).
        k: micro-batches per step.

    Returns:
        The ``nnx.Optimizer`` over ``optax.MultiSteps(tx, every_k_schedule=k)``.
    """
    multi = _multi_steps(optimizer.tx, k)
    # the inner state as tx.init gives it: a Variable where nnx.Optimizer wrapped one, else the array
    inner = jax.tree.map(
        lambda v: v if isinstance(v, nnx.OptVariable) else v.get_value(),
        optimizer.opt_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )

    # MultiSteps accumulates in its private accumulator_dtype (float32 by default: bfloat16 parameters' gradients
    # are summed in float32; None: each parameter's dtype), as zeros_like(params, dtype=...) in its init
    accumulator_dtype = getattr(multi, "_accumulator_dtype", jnp.float32)

    def init(params):  # optax.MultiSteps.init's state (its skip_state: the default skip function's ())
        return optax.MultiStepsState(
            mini_step=jnp.zeros([], dtype=jnp.int32),
            gradient_step=jnp.zeros([], dtype=jnp.int32),
            inner_opt_state=inner,
            acc_grads=optax.tree.zeros_like(params, dtype=accumulator_dtype),
            skip_state=(),
        )

    acc = nnx.Optimizer(model, optax.GradientTransformation(init, multi.update), wrt=nnx.Param)
    acc.tx = multi
    acc.opt_state.gradient_step[...] = jnp.asarray(optimizer.step[...], jnp.int32)
    return acc


def accumulation_candidate(loss_fn: LossFn, num_micro_batches: int) -> Candidate:
    """Gradient accumulation over k micro-batches as a parity :class:`~shardcheck.steps.Candidate`.

    The candidate's optimizer is built from a copy of the reference's: ``optax.MultiSteps`` around the same
    ``tx``, with the inner state and the update counter copied from it. Parity compares the inner state with the
    reference's optimizer state and ``gradient_step`` with the reference's ``step``; it also checks, exactly, that
    the NNX counter is ``k * steps`` (it counts micro-steps), that ``mini_step`` is 0 and that ``acc_grads`` is
    zero after every full step. The step returns the gradient it applied (:func:`accumulated_step`'s
    ``with_grads``), compared with the reference's; its ``program`` is that step's jitted program, which the
    harness calls on the pair's Variables found once where it steps in place (no graph traversal a step).
    """
    k = num_micro_batches

    def make_optimizer(model, optimizer):
        return _wrapped_optimizer(model, optimizer, k)

    found = _FoundState()

    def view(optimizer):
        state = found(optimizer)
        inner = state["inner_opt_state"] if "inner_opt_state" in state else {}
        return inner, optimizer.opt_state.gradient_step[...]

    def extra(optimizer, completed):
        state = found(optimizer)
        checks = [
            ("step (NNX micro-steps)", optimizer.step[...], np.uint32(k * completed)),
            ("mini_step", state["mini_step"][...], np.int32(0)),
        ]
        for path, leaf in jax.tree_util.tree_flatten_with_path(state["acc_grads"])[0]:
            checks.append(("acc_grads." + path_str(path), leaf, np.zeros(np.shape(leaf), np.float32)))
        return checks

    def step(model, optimizer, batch):
        return accumulated_step(loss_fn, k, model, optimizer, batch, with_grads=True)

    return Candidate(
        "accumulation",
        step,
        num_shards=k,
        make_optimizer=make_optimizer,
        view_optimizer=view,
        extra_checks=extra,
        program=(_accumulated_jit, (loss_fn, k)),
        donates=False,  # its program donates nothing: the state before a step stays valid after it
    )
