"""The hypothesis reruns that name a failing step's faulty reduction (``StepRecord.matches``).

From the reference's state before the step, the reference's optimizer is rerun on the gradient of each faulty
reduction (the mean of per-shard means, S times or 1/S times the gradient, a bfloat16 all-reduce's rounding), and
the candidate's state is compared with each (:func:`_explained`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import flatten_state, host_tree, is_int, to_host
from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.parity.diagnosis.per_shard import per_shard_mean_grads
from shardcheck.parity.diagnosis.rules import _gradient_factor
from shardcheck.parity.diagnosis.token_split import (
    TokenSplit,
    token_grads_agree,
    token_loss_value,
    token_shard_grads,
    token_shard_weights,
    token_split,
)
from shardcheck.parity.harness.state import _default_view, _opt_state, _PreStep, _Run
from shardcheck.parity.tolerance.allowances import _reference_grads, _shard_magnitude
from shardcheck.parity.tolerance.derive import MOMENT_FACTOR
from shardcheck.parity.tolerance.matmul import rounded_loss
from shardcheck.parity.tolerance.propagation import (
    as_param_dtypes,
    grad_delta,
    scale_change,
    update_sensitivity,
)
from shardcheck.task import batch_weight, loss_terms, shards_with_state, split_batch


def _per_shard_mean_params(loss_fn, num_shards, graphdef, tx, params, rest, opt_state, batch):
    """``(params, opt_state)`` after the step whose gradient is the mean of per-shard means (each shard divided
    by its own weight), each shard with the whole non-parameter state ``rest``, or where the model does not trace
    so (a per-row carried state) its rows of it (:func:`~shardcheck.task.shards_with_state`); ``None`` where it
    traces neither way."""
    grads = per_shard_mean_grads(loss_fn, num_shards, graphdef, params, rest, batch)
    return None if grads is None else _scaled_params(tx, params, opt_state, grads, 1.0)


def clip_norm_of(tx, depth: int = 8) -> float | None:
    """The ``max_norm`` of an ``optax.clip_by_global_norm`` inside the optimizer ``tx`` (an
    ``optax.GradientTransformation``, chained or wrapped: found by walking its ``update`` function's closures,
    ``depth`` levels deep), else ``None`` (none found, or a norm that is not a plain number)."""
    seen: set[int] = set()

    def walk(f, d):
        if d < 0 or id(f) in seen:
            return None
        seen.add(id(f))
        if callable(f) and getattr(f, "__qualname__", "").startswith("clip_by_global_norm."):
            free = getattr(getattr(f, "__code__", None), "co_freevars", ())
            cells = dict(zip(free, f.__closure__ or (), strict=False))
            norm = cells.get("max_norm")
            value = None if norm is None else norm.cell_contents
            return float(value) if isinstance(value, (int, float)) and value > 0 else None
        items = ()
        if isinstance(f, (tuple, list)):
            items = f
        elif callable(f):
            items = [c.cell_contents for c in (getattr(f, "__closure__", None) or ()) if _filled(c)]
            items += [getattr(f, "update", None)] if not hasattr(f, "__code__") else []
        for x in items:
            found = walk(x, d - 1)
            if found is not None:
                return found
        return None

    return walk(getattr(tx, "update", None), depth)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def per_shard_clipped_grads(loss_fn, num_shards: int, max_norm: float, graphdef, params, rest, batch):
    """The mean over the ``num_shards`` shards of ``batch`` of each shard's own gradient clipped to global L2
    norm ``max_norm`` (``optax.clip_by_global_norm`` applied per shard, before the all-reduce), a tree like
    ``params``; ``None`` where the shards do not trace (a state shaped by the full batch). The first of
    :func:`per_shard_clipped_forms`."""
    forms = per_shard_clipped_forms(loss_fn, num_shards, max_norm, graphdef, params, rest, batch)
    return None if forms is None else forms[0]


def per_shard_clipped_forms(loss_fn, num_shards: int, max_norm: float, graphdef, params, rest, batch):
    """The gradients a clip applied to each of the ``num_shards`` shards' own gradient (its own mean: the loss's
    ``loss_sum / weight`` on the shard) before the all-reduce gives, each a tree like ``params``: the plain mean of
    the clipped shard gradients, and under a ``(loss_sum, weight)`` loss also their mean weighted by each shard's
    weight over the batch's (``sum_s (w_s / W) clip(g_s)``: a step that clips its token-weighted mean gradient and
    re-weights it by its token count before the psum, trial 44's packed-sequence LM). A tuple of one or two trees;
    ``None`` where the shards do not trace (a state shaped by the full batch), or where no shard's norm exceeds
    ``max_norm``: a clip that binds on no shard changes nothing, and a step whose gradients are the mean of the
    shards' unclipped ones differs for another reason (trial 55: a load-balancing term computed per shard, with a
    clip of 1.0 on shard norms of at most 0.68, read "a clip applied per shard")."""
    try:
        clipped, weights, binds = _per_shard_clipped(
            loss_fn, num_shards, max_norm, graphdef, params, rest, batch
        )
    except (TypeError, ValueError):
        return None
    if not bool(binds):
        return None
    mean = jax.tree.map(lambda g: jnp.mean(g, axis=0), clipped)
    if weights is None:
        return (mean,)
    w = weights / jnp.sum(weights)

    def weighted(g):
        return jnp.tensordot(w.astype(jnp.float32), g.astype(jnp.float32), axes=1).astype(g.dtype)

    return mean, jax.tree.map(weighted, clipped)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _per_shard_clipped(loss_fn, num_shards, max_norm, graphdef, params, rest, batch):
    """Each shard's own gradient clipped to ``max_norm``, stacked ``[num_shards, ...]``, and the shards' weights
    ``[num_shards]`` (``None`` for a scalar loss), and whether any shard's norm exceeds ``max_norm``."""
    xs, at = shards_with_state(batch, rest, num_shards, False)

    def shard_grad(x):
        shard, rest_s = at(x)

        def mean(p):
            total, weight = loss_terms(loss_fn, nnx.merge(graphdef, p, rest_s, copy=True), shard)
            mean = total if weight is None else total / weight  # an unweighted loss: the shard's own mean
            return mean, (jnp.zeros(()) if weight is None else weight)

        g, weight = jax.grad(mean, has_aux=True)(params)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(g)))
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
        return jax.tree.map(lambda x: (x * scale).astype(x.dtype), g), weight, norm > max_norm

    clipped, weights, binds = jax.lax.map(shard_grad, xs)
    shard, rest_s = at(jax.tree.map(lambda a: a[0], xs))
    weighted = loss_terms(loss_fn, nnx.merge(graphdef, params, rest_s, copy=True), shard)[1] is not None
    return clipped, (weights if weighted else None), jnp.any(binds)


def _clipped_per_shard(run: _Run, pre: _PreStep, batch, record: StepRecord, cand_grads) -> bool:
    """:func:`clipped_per_shard` of a live check: the reference's optimizer and pre-step state (trial 39: the clip
    applied to each shard's local gradient inside a shard_map, before the pmean)."""
    state = (pre.graphdef, pre.params, pre.rest)
    return clipped_per_shard(
        run.task.loss_fn, run.ref_opt.tx, run.cand.num_shards, state, batch, record, cand_grads
    )


def clipped_per_shard(
    loss_fn, tx, num_shards: int | None, state: tuple, batch, record: StepRecord, cand_grads
) -> bool:
    """Whether the candidate's returned gradients ``cand_grads`` (a tree like the parameters) are, within
    ``record``'s gradient tolerances (one fitted factor of 1), the mean over the ``num_shards`` shards of each
    shard's own gradient clipped to the ``optax.clip_by_global_norm`` norm of the optimizer ``tx``
    (:func:`per_shard_clipped_grads` at ``state``, ``(graphdef, params, rest)``: the pre-step state both runs
    share) or, under a ``(loss_sum, weight)`` loss, their mean weighted by each shard's weight over the batch's
    (:func:`per_shard_clipped_forms`), where some returned gradient fails. ``False`` without such a clip, with one shard, without returned
    gradients, or where the shards do not trace. Live (:func:`_clipped_per_shard`) and replayed (the recording's
    pre-step state) alike."""
    max_norm = clip_norm_of(tx)
    if cand_grads is None or not num_shards or num_shards < 2 or max_norm is None:
        return False
    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    if not tolerance or all(e.ok for e in record.leaves if e.kind == "grad"):
        return False
    forms = per_shard_clipped_forms(loss_fn, num_shards, max_norm, *state, batch)
    if forms is None:
        return False
    cand = flatten_state(nnx.as_pure(cand_grads))
    for grads in forms:  # the plain mean of the clipped shards, then (a weighted loss) their weighted mean
        c = fitted_factor(cand, flatten_state(grads), tolerance)
        if c is not None and abs(c - 1.0) <= 1e-3:
            return True
    return False


def fitted_factor(cand: dict, alt: dict, tolerance: dict) -> float | None:
    """The one factor c with ``cand = c * alt`` leaf by leaf, each element within ``max(1, |c|)`` times its
    leaf's tolerance, or ``None`` where no such c fits (the gradients refute the hypothesis ``alt``).

    ``cand``, ``alt``: ``{path: gradient array}`` (the candidate's returned gradients, a hypothesis's); only the
    paths of ``tolerance`` (``{path: the gradient leaf's tolerance, absolute}``, a live or replayed record's) that
    both hold are read. c is the least-squares fit over them (float64); ``None`` where they hold no path or
    ``alt`` is all zeros there."""
    paths = [p for p in tolerance if p in cand and p in alt]
    pairs = [
        (np.asarray(to_host(cand[p]), np.float64), np.asarray(to_host(alt[p]), np.float64)) for p in paths
    ]
    if not pairs or any(c.shape != a.shape for c, a in pairs):
        return None
    den = sum(float(np.vdot(a, a)) for _, a in pairs)
    if not den > 0:
        return None
    c = sum(float(np.vdot(x, a)) for x, a in pairs) / den
    scale = max(1.0, abs(c))
    for p, (x, a) in zip(paths, pairs, strict=True):
        if not float(np.max(np.abs(x - c * a), initial=0.0)) <= scale * tolerance[p]:
            return None
    return c


def hypothesis_rounding(tx, grads, opt_state, params, rtol: float, atol: float) -> tuple[dict, dict]:
    """``({param path: array}, {opt_state path: array})``: how far a hypothesis's update and new optimizer state
    move, element by element, when its recomputed gradient ``grads`` moves within the gradient's tolerance
    ``atol + rtol max|g|`` per leaf (:func:`~shardcheck.parity.tolerance.propagation.update_sensitivity`). The
    hypothesis is one more computation of the gradient, rounded its own way (a ``lax.map`` over the shards, one
    codegen or another): where its gradient lies near 0, a normalizing optimizer (Adam) turns that rounding into
    a change of up to ``lr`` that no bitwise agreement of the two codegens bounds (trial 16's mean of per-shard
    weighted means: the candidate's gradients within 1.5e-8 of it, its parameters 7.8e-6 apart under the command
    line's XLA flags, where the tolerance was 7.2e-6). ``grads``, ``opt_state``, ``params``: trees like the
    optimizer's (``nnx.as_pure``)."""
    delta = grad_delta(grads, None, rtol, atol, 0.0)
    updates, states, _ = update_sensitivity(tx, grads, opt_state, params, delta)
    return host_tree(updates), host_tree(states)


@functools.partial(jax.jit, static_argnums=0)
def _scaled_params(tx, params, opt_state, grads, factor):
    """``(params, opt_state)`` after the reference's optimizer step on ``factor`` times its gradient."""
    return _stepped(tx, params, opt_state, jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads))


def _stepped(tx, params, opt_state, grads):
    """``(params, opt_state)`` after one step of ``tx`` on ``grads`` (traced, inside the hypotheses' jits)."""
    updates, opt_state = tx.update(as_param_dtypes(grads, params), opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state


def _matches(
    run: _Run, pre: _PreStep, batch, rtol, atol, record: StepRecord, reference_grads, cand_grads=None
) -> tuple[tuple[str, ...], float | None, TokenSplit | None]:
    """The faulty reductions whose step the candidate reproduces (checked on failure; ``reference_grads()``: the
    reference's gradient at ``pre``, computed once for every hypothesis of :func:`_explained`), the factor c
    of the per-shard means (below; ``None`` where it is 1 or not named) and the rows x tokens split whose shards
    they are (:func:`~shardcheck.parity.diagnosis.token_split.token_split`; ``None``: the rows split over the
    batch axes, tried first).

    ``per_shard_mean`` (weighted losses): the candidate's parameters and optimizer state match those of the step
    whose gradient is the mean of per-shard means, and the reference's differ from them in some leaf (under Adam
    and bfloat16 compute the parameters' allowance can hide the difference; the moments, unnormalized, show it).
    The hypothesis is compared within its own rounding too (:func:`hypothesis_rounding`). Where the step returned
    its gradients (``cand_grads``), they must be one factor c times that gradient (:func:`fitted_factor`, within
    the record's gradient tolerances): c = 1, the means averaged; c = S, summed (a psum of per-shard means,
    trial 17, whose binding global-norm clip left only the optimizer state to show it); the step compared is then
    the optimizer's on c times that gradient. Gradients that are no factor of it refute the hypothesis.
    ``times_S`` / ``times_1/S``: they match the reference optimizer's step on S times (1/S times) the reference's
    gradient: a sum for a mean, a mean taken twice, whatever the optimizer does to the gradient's scale (global-
    norm clipping distorts the factor the moments show), tried when the moments' factor is not already S or 1/S.
    """
    s = run.cand.num_shards or 1
    split = token_split(run.kwargs.get("mesh"), batch) if run.weighted else None
    if (s < 2 and split is None) or run.reference is not None:
        return (), None, None
    found, per_shard, used = [], None, None
    if run.weighted and not run.rows_coupled:  # a coupled loss per shard is another loss, no hypothesis
        # the rows split over the batch axes; then, on a mesh with an axis beside them, the rows x tokens blocks
        # of a step that places the batch over every axis (context parallelism, trial 45)
        for how in [h for h in (None, split) if (h is not None or s >= 2)]:
            tried = _per_shard_tried(run, pre, batch, rtol, atol, record, reference_grads, cand_grads, how)
            if tried is not None:
                found.append(tried[0])
                per_shard, used = tried[1], how
                break
    factor, _ = _gradient_factor(record)
    if s >= 2 and not found and (factor is None or not any(abs(factor - c) <= 1e-3 * c for c in (s, 1 / s))):
        for name, factor in (("times_S", float(s)), ("times_1/S", 1.0 / s)):
            alt = _scaled_params(run.ref_opt.tx, pre.params, pre.opt_state, reference_grads(), factor)
            if _reproduces(run, *alt, rtol, atol):
                found.append(name)
                break
    return tuple(found), per_shard, used


def _per_shard_tried(
    run: _Run, pre: _PreStep, batch, rtol, atol, record, reference_grads, cand_grads, split
) -> tuple[str, float | None] | None:
    """``(name, c)`` where the candidate reproduces the mean of per-shard means (``"per_shard_mean"``, or
    ``"per_shard_loss"`` with shards of equal weight) times c (``None`` where c is 1), the shards the rows split
    over the batch axes (``split`` ``None``) or ``split``'s rows x tokens blocks; ``None`` where it does not."""
    s = run.cand.num_shards or 1
    # where the reference's matmul rounding is emulated, the candidate's is taken to be that too: the
    # hypothesis computes as it does (a gradient at rounding level would otherwise flip its update's sign)
    emulated = run.matmul_realization not in (None, "float32")
    loss_fn = rounded_loss(run.task.loss_fn, run.precision.matmul) if emulated else run.task.loss_fn
    args = (pre.graphdef, pre.params, pre.rest, batch)
    if split is None:
        grads = per_shard_mean_grads(loss_fn, s, *args)
    else:
        grads = token_shard_grads(loss_fn, split, *args)
    c = None if grads is None else _per_shard_factor(record, grads, cand_grads, reference_grads)
    if c is None:
        return None
    # a step that returns no gradients shows no c: the per-shard means averaged (c = 1), else summed (c = S; trial
    # 50: a psum of per-shard means under Adam, named with its gradients returned, read "not a single reduced
    # step" without them)
    tried = (c, float(s)) if cand_grads is None and s > 1 else (c,)
    c = next((k for k in tried if _per_shard_reproduces(run, pre, grads, k, rtol, atol)), None)
    if c is None:
        return None
    if not run.weighted and c != 1.0:  # a mean loss's shard means are the full batch's unless a term couples the
        # rows: a step that is also c x the reference's gradient is a plain factor, for the factor rules to name
        alt = _scaled_params(run.ref_opt.tx, pre.params, pre.opt_state, reference_grads(), c)
        if _reproduces(run, *alt, rtol, atol):
            return None
    if split is None:
        weights = shard_weights(loss_fn, s, *args)
    else:
        weights = token_shard_weights(loss_fn, split, *args)
    equal = not run.weighted or (
        weights is not None and max(weights) - min(weights) <= 1e-6 * max(abs(w) for w in weights)
    )
    return "per_shard_loss" if equal else "per_shard_mean", None if abs(c - 1.0) <= 1e-3 else c


def _per_shard_reproduces(run: _Run, pre: _PreStep, grads, c: float, rtol, atol) -> bool:
    """Whether the reference's optimizer on ``c`` x the per-shard means' ``grads``, from ``pre``, reproduces the
    candidate's parameters and optimizer state (within the hypothesis's rounding)."""
    tx = run.ref_opt.tx
    alt = _scaled_params(tx, pre.params, pre.opt_state, grads, c)
    scaled = jax.tree.map(lambda g: (g * c).astype(g.dtype), grads)
    rounding = hypothesis_rounding(tx, scaled, pre.opt_state, pre.params, rtol, atol)
    return _reproduces(run, *alt, rtol, atol, rounding)


def _per_shard_factor(record: StepRecord, grads, cand_grads, reference_grads) -> float | None:
    """The factor c of the candidate's returned gradients ``cand_grads`` over the per-shard means' ``grads``
    (:func:`fitted_factor`, at ``record``'s gradient tolerances): 1.0 where it returned none (the hypothesis as it
    stands); ``None`` where they are no one factor of it (the gradients refute it), or where c is not 1 and they
    are one factor of the full batch's gradient ``reference_grads()`` too (shards of equal weight: the per-shard
    means are the full batch's mean, and the factor rules name the factor)."""
    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    if cand_grads is None or not tolerance:
        return 1.0
    cand = flatten_state(nnx.as_pure(cand_grads))
    c = fitted_factor(cand, flatten_state(grads), tolerance)
    if c is None or abs(c - 1.0) <= 1e-3:
        return c
    return None if fitted_factor(cand, flatten_state(reference_grads()), tolerance) is not None else c


def equal_shard_weights(loss_fn, num_shards: int, graphdef, params, rest, batch) -> bool:
    """Whether the S shards of ``batch`` carry equal weights under a ``(loss_sum, weight)`` loss (within 1e-6
    relative): then the mean of per-shard means is the full batch's normalization, and a step that reproduces it
    computed a term of the loss per shard, not a count (trial 14: a load-balancing loss over each shard's routing,
    53 and 53 tokens). ``False`` where a shard's weight cannot be read (a model that does not run on a shard)."""
    weights = shard_weights(loss_fn, num_shards, graphdef, params, rest, batch)
    if weights is None:
        return False
    return max(weights) - min(weights) <= 1e-6 * max(abs(w) for w in weights)


def shard_weights(loss_fn, num_shards: int, graphdef, params, rest, batch) -> tuple[float, ...] | None:
    """Each of the ``num_shards`` shards' own loss weight under a ``(loss_sum, weight)`` loss (the batch split as
    :func:`~shardcheck.task.split_batch` splits it: shard i is the i-th block of rows, the i-th device of the batch
    axes), floats in shard order; ``None`` where a shard's weight cannot be read (a mean loss, a model that does
    not run on a shard)."""
    try:
        weights = [
            batch_weight(loss_fn, graphdef, params, rest, jax.tree.map(lambda a, i=i: a[i], shards))
            for shards in (split_batch(batch, num_shards),)
            for i in range(num_shards)
        ]
    except (TypeError, ValueError):
        return None
    if any(w is None for w in weights):
        return None
    return tuple(float(w) for w in weights)


def _reproduces(run: _Run, alt_params, alt_state, rtol, atol, rounding=None) -> bool:
    """Whether the candidate's parameters and optimizer state match an alternative step's, within the usual
    tolerances and allowances, and the reference's do not (host copies: a failing step only). ``rounding``:
    ``(params, opt_state)`` allowances ``{path: array}`` of the alternative's own rounding
    (:func:`hypothesis_rounding`), added to the candidate's side only (the reference must differ beyond the usual
    allowance). Stops at the first leaf the alternative does not reproduce."""
    own = ({}, {}) if rounding is None else rounding
    against_ref = []  # (the reference's leaf, the alternative's, rtol, atol, allowance), read once all reproduce
    for (cand, ref, allowance, factor), alt, extra in zip(
        _host_sides(run).values(), (alt_params, alt_state), own, strict=True
    ):
        r_tol, a_tol = factor * rtol, factor * atol
        for p, a in flatten_state(alt).items():
            if p not in cand or p not in ref or is_int(a):
                continue
            a, allow = to_host(a), allowance.get(p)
            widened = allow if p not in extra else extra[p] + (0.0 if allow is None else allow)
            if not compare.within(a, cand[p], r_tol, a_tol, widened):
                return False
            against_ref.append((ref[p], a, r_tol, a_tol, allow))
    return any(not compare.within(*leaves) for leaves in against_ref)


def _host_sides(run: _Run) -> dict[str, tuple]:
    """``{kind: (the candidate's, the reference's, the allowance, the tolerance factor)}`` for ``"param"`` and
    ``"opt_state"``: both sides after the step, and the allowances, as host copies ``{path: array}``; read once
    while :func:`_explained` tries its hypotheses (``_Run.read_once``: the models do not change there, and a
    failing check read them afresh for each of up to ~100 hypotheses, ~20 ms each)."""

    def read():
        view = run.cand.view_optimizer or _default_view
        return {
            "param": (
                host_tree(nnx.state(run.cand_model, nnx.Param)),
                host_tree(nnx.state(run.ref_model, nnx.Param)),
                {p: to_host(a) for p, a in run.allowance.items() if a is not None},
                1.0,
            ),
            "opt_state": (
                host_tree(view(run.cand_opt)[0]),
                host_tree(_opt_state(run.ref_opt)),
                {p: to_host(a) for p, a in run.state_allowance.items() if a is not None},
                MOMENT_FACTOR,
            ),
        }

    return run.read_once("sides", read)


def _low_precision_reduction(
    run: _Run, pre: _PreStep, batch, record: StepRecord, rtol, atol, reference_grads
) -> bool:
    """Whether a failing float32-compute step is off by no more than a bfloat16 all-reduce's rounding.

    The bound of that rounding, ``2 eps_bf16 sqrt(S) A`` on each gradient element (``A = sum_s |g_s| / W``), is
    propagated through the optimizer like the gradient's own tolerance; the step matches when every failing leaf
    is within it and at least one is off by more than 1/64 of it (an error at bfloat16's scale, not float32's).
    A step whose loss differs is never one: a reduction of the gradients cannot change the forward pass.
    """
    s = run.cand.num_shards
    if run.precision.compute_eps > 0 or not s or s < 2 or run.reference is not None or run.rows_coupled:
        return False
    if any(e.kind == "loss" and not e.ok for e in record.leaves):
        return False
    try:
        magnitude, _, _ = _shard_magnitude(run.task.loss_fn, s, pre.graphdef, pre.params, pre.rest, batch)
    except (TypeError, ValueError):  # a model that does not run on a shard: no hypothesis of its shards
        return False
    grads = reference_grads()
    bound = 2.0 * float(jnp.finfo(jnp.bfloat16).eps) * math.sqrt(s)
    delta = grad_delta(grads, magnitude, rtol, atol, bound)
    updates, states, _ = update_sensitivity(run.ref_opt.tx, grads, pre.opt_state, pre.params, delta)
    allowed = {
        "grad": {k: bound * v for k, v in host_tree(magnitude).items()},
        "param": host_tree(updates),
        "opt_state": host_tree(states),
    }
    used = []
    for e in record.leaves:
        if e.ok or e.kind not in allowed:
            continue
        extra = float(np.max(allowed[e.kind].get(e.path, np.inf), initial=0.0))
        if not e.max_abs_err <= e.tolerance + extra:
            return False
        used.append(e.max_abs_err / max(extra, 1e-30))
    return bool(used) and max(used) > 1 / 64


def _explained(
    run: _Run, pre: _PreStep, batch, record: StepRecord, rtol, atol, cand_grads=None
) -> StepRecord:
    """:func:`_hypotheses_tried`, with what several hypotheses read (both sides' host copies, :func:`_host_sides`;
    each row's gradient, :func:`~shardcheck.parity.diagnosis.micro_subset.row_terms`) read once for all."""
    run.step_reads = {}
    try:
        return _hypotheses_tried(run, pre, batch, record, rtol, atol, cand_grads)
    finally:
        run.step_reads = None


def _hypotheses_tried(
    run: _Run, pre: _PreStep, batch, record: StepRecord, rtol, atol, cand_grads=None
) -> StepRecord:
    """A failing record with the faulty reductions the candidate reproduces (``StepRecord.matches``,
    ``StepRecord.per_shard_factor``), recomputed from the reference's pre-step state ``pre``; the run's two sides
    are after the step. ``cand_grads``: the gradients the candidate returned at this step, or ``None``; the
    record's loss weight and its count (``StepRecord.loss_weight``, ``StepRecord.weight_count``) under a
    ``(loss_sum, weight)`` loss."""
    from shardcheck.parity.diagnosis.shard_subset import shard_subset
    from shardcheck.parity.diagnosis.shared_uses import uses_left_out

    reference_grads = functools.cache(lambda: nnx.as_pure(_reference_grads(run.task.loss_fn, pre, batch)))
    matches, per_shard, split = _matches(run, pre, batch, rtol, atol, record, reference_grads, cand_grads)
    if not matches and _loss_per_shard(run, pre, batch, record):
        matches = ("per_shard_loss_value",)
    if not matches and not run.weighted:  # a mean loss's shard means: the full batch's unless a term couples
        # the rows (trial 55: a load-balancing term over each shard's routing read "a clip applied per shard")
        tried = _per_shard_tried(run, pre, batch, rtol, atol, record, reference_grads, cand_grads, None)
        matches, per_shard = ((), None) if tried is None else ((tried[0],), tried[1])
    token_grads = None
    if not matches and run.weighted:  # the loss value of a rows x tokens split's per-shard means (trial 45)
        split = token_split(run.kwargs.get("mesh"), batch)
        matches, token_grads = _token_value(run, pre, batch, record, split, cand_grads)
    matches, shard_clip, micro_clip = _clips(run, pre, batch, record, cand_grads, matches)
    if not matches and _low_precision_reduction(run, pre, batch, record, rtol, atol, reference_grads):
        matches = ("bf16_reduction",)
    # no catalog reduction: some shards' gradient only (trial 57)
    subset = None if matches else shard_subset(run, pre, batch, record, rtol, atol, cand_grads)
    if {e.kind for e in record.leaves if not e.ok} == {"grad"}:
        # only the exposed gradients fail: a fault the optimizer hides (blind to the gradient's scale) or
        # gradients that were not the ones applied
        if _blind_to_scale(run, pre, reference_grads(), record.leaves):
            matches += ("scale_blind",)
    weight = (
        batch_weight(run.task.loss_fn, pre.graphdef, pre.params, pre.rest, batch) if run.weighted else None
    )
    s = run.cand.num_shards
    shards = (
        shard_weights(run.task.loss_fn, s, pre.graphdef, pre.params, pre.rest, batch)
        if record.replica_scales is not None and run.weighted and s and s == len(record.replica_scales)
        else None
    )
    micro = (
        None
        if set(matches) - {"scale_blind"}
        else _micro_batch_means(run, pre, batch, record, rtol, atol, cand_grads)
    )
    # a module's parameters read by several calls, some of whose gradient terms are missing (trial 61)
    uses = () if matches or micro or subset else uses_left_out(run, pre, batch, record, cand_grads)
    return dataclasses.replace(
        record,
        matches=matches if micro is None else (*matches, "per_micro_mean"),
        loss_weight=weight,
        per_shard_factor=per_shard,
        token_split=split
        if set(matches) & {"per_shard_mean", "per_shard_loss", "per_shard_mean_value"}
        else None,
        token_grads=token_grads,
        weight_count=weight_count(batch, weight),
        shard_weights=shards,
        micro_means=micro,
        shard_subset=subset,
        shard_clip=shard_clip,
        micro_clip=micro_clip,
        uses_left_out=uses,
        global_clip=clip_norm_of(run.ref_opt.tx),  # a clip whose coefficient reads every gradient (trial 44)
    )


def _clips(run: _Run, pre: _PreStep, batch, record: StepRecord, cand_grads, matches: tuple):
    """``(matches, shard_clip, micro_clip)``: ``matches`` with ``"clip_per_shard"`` where none matched yet and the
    step clipped each shard's gradient at the task's norm, or at a norm of its own (``shard_clip``, fitted: trial
    58 C2), or each micro-batch's (``micro_clip``: trial 61)."""
    from shardcheck.parity.diagnosis.shard_clip import fitted_micro_clip, fitted_shard_clip

    if matches:
        return matches, None, None
    if _clipped_per_shard(run, pre, batch, record, cand_grads):
        return ("clip_per_shard",), None, None
    shard_clip = fitted_shard_clip(run, pre, batch, record, cand_grads)
    micro_clip = None if shard_clip is not None else fitted_micro_clip(run, pre, batch, record, cand_grads)
    found = shard_clip is not None or micro_clip is not None
    return ("clip_per_shard",) if found else (), shard_clip, micro_clip


def _token_value(
    run: _Run, pre: _PreStep, batch, record: StepRecord, split, cand_grads
) -> tuple[tuple, tuple | None]:
    """``(("per_shard_mean_value",), token_grads)`` where the loss the step returned is the mean of ``split``'s
    per-shard means (:func:`~shardcheck.parity.diagnosis.token_split.token_loss_value`), ``token_grads`` the
    returned gradient leaves that are that mean's gradient and those that are not
    (:func:`~shardcheck.parity.diagnosis.token_split.token_grads_agree`: the loss alone names the cause, the
    gradients bear it out or not; trial 45); ``((), None)`` where the loss is not that mean."""
    args = (pre.graphdef, pre.params, pre.rest, batch)
    if not token_loss_value(run.task.loss_fn, split, *args, record):
        return (), None
    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    return ("per_shard_mean_value",), token_grads_agree(run.task.loss_fn, split, *args, cand_grads, tolerance)


# the micro-batch counts tried where a step accumulates by hand (trial 40: 2 micro-batches on data=2 x fsdp=2)
MICRO_BATCHES = (2, 4, 8)


def _micro_batch_means(
    run: _Run, pre: _PreStep, batch, record: StepRecord, rtol, atol, cand_grads
) -> tuple[int, tuple[float, ...], str, float] | None:
    """``(k, weights, layout, c)`` where the candidate's step is the one whose gradient is c times the mean of the
    means of k micro-batches (the batch's k blocks of rows or its rows i::k, :func:`_micro_layouts`; each its loss
    sum over its own weight) under a ``(loss_sum, weight)`` loss whose micro-batches carry unequal weights
    (``weights``, the k micro-batches' own, in order): an accumulation by hand that averaged the micro-batches'
    means (c = 1), summed them (c = k) or divided their mean by k again (c = 1/k; trial 61) where their sums
    over the total weight were meant (trial 40: uneven padding over 2 micro-batches on 4 shards). k is tried
    over :data:`MICRO_BATCHES` (c over :func:`micro_factors`), dividing the batch's
    rows, other than the shard count (the per-shard means' own hypothesis, :func:`_matches`). The candidate's
    returned gradients (where it returns them) must be that gradient within the record's gradient tolerances, and
    its parameters and optimizer state the optimizer's step on it (:func:`_reproduces`, the reference's
    differing); ``None`` otherwise, and for an unweighted loss, a coupled one, or a user's reference step."""
    if not run.weighted or run.rows_coupled or run.reference is not None:
        return None
    if cand_grads is not None and all(e.ok for e in record.leaves if e.kind == "grad"):
        return None  # the gradients match: not a gradient the micro-batches' means give
    leaves = jax.tree.leaves(batch)
    rows = leaves[0].shape[0] if leaves and getattr(leaves[0], "ndim", 0) else 0
    emulated = run.matmul_realization not in (None, "float32")
    loss_fn = rounded_loss(run.task.loss_fn, run.precision.matmul) if emulated else run.task.loss_fn
    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    cand = None if cand_grads is None else flatten_state(nnx.as_pure(cand_grads))
    for k, layout, micro in _micro_layouts(batch, rows, run.cand.num_shards):
        weights = shard_weights(loss_fn, k, pre.graphdef, pre.params, pre.rest, micro)
        if weights is None or max(weights) - min(weights) <= 1e-6 * max(abs(w) for w in weights):
            continue  # equal micro-batches: their means averaged are the full batch's mean
        grads = per_shard_mean_grads(loss_fn, k, pre.graphdef, pre.params, pre.rest, micro)
        if grads is None:
            continue
        tx = run.ref_opt.tx
        for c in micro_factors(k, cand, grads, tolerance):
            alt = _scaled_params(tx, pre.params, pre.opt_state, grads, c)
            scaled = grads if c == 1.0 else jax.tree.map(lambda g, c=c: (g * c).astype(g.dtype), grads)
            rounding = hypothesis_rounding(tx, scaled, pre.opt_state, pre.params, rtol, atol)
            if _reproduces(run, *alt, rtol, atol, rounding):
                return k, weights, layout, c
    return None


def micro_factors(k: int, cand: dict | None, grads, tolerance: dict) -> tuple[float, ...]:
    """The factors c on the mean of k micro-batches' own means that the micro-batch hypotheses try: 1 (averaged),
    k (summed), 1/k (averaged and divided by k again); where the step returned its gradients (``cand``, flat),
    only the one they are, within ``tolerance`` (:func:`fitted_factor`, to 1e-3)."""
    factors = (1.0, float(k), 1.0 / k)
    if cand is None or not tolerance:
        return factors
    fitted = fitted_factor(cand, flatten_state(grads), tolerance)
    return tuple(c for c in factors if fitted is not None and abs(fitted - c) <= 1e-3 * c)


def _micro_layouts(batch, rows: int, num_shards: int | None):
    """``(k, layout, batch)`` for each k of :data:`MICRO_BATCHES` dividing ``rows`` (at least 2 rows a micro-batch): the
    batch as it is, its k blocks of consecutive rows the micro-batches (not for k = S, the per-shard means' own),
    then with rows i::k gathered in order, its k blocks the strided micro-batches (trial 59: a step averaging the
    means of rows i::k read forward_differs)."""
    for k in MICRO_BATCHES:
        if rows < 2 * k or rows % k:
            continue
        if k != num_shards:
            yield k, "blocks", batch
        order = np.argsort(np.arange(rows) % k, kind="stable")
        yield k, "strided", jax.tree.map(lambda a, order=order: a[order], batch)


def _loss_per_shard(run: _Run, pre: _PreStep, batch, record: StepRecord) -> bool:
    """:func:`loss_per_shard` of a live check's failing ``record`` from the reference's pre-step state ``pre``
    (only at a step run from it: step 0, a re-check; never against a user's reference step)."""
    at_reference = record.step == 0 or record.synchronized
    if not at_reference or run.reference is not None:
        return False
    return loss_per_shard(
        run.task.loss_fn, run.cand.num_shards, pre.graphdef, pre.params, pre.rest, batch, record
    )


def loss_per_shard(loss_fn, num_shards, graphdef, params, rest, batch, record: StepRecord) -> bool:
    """Whether the loss the candidate returned (``record.candidate_loss``) from the state ``(graphdef, params,
    rest)`` is the task's loss computed over each shard's own rows and combined (``sum_s loss_sum_s / sum_s
    weight_s``; the mean of per-shard means for a scalar loss:
    :func:`~shardcheck.parity.harness.row_coupling._full_and_combined`), within the loss's tolerance, while the
    full batch's loss differs from that by more: a term that couples the rows computed per shard (trial 22: a
    contrastive loss with each shard's negatives only, its loss 3.78552 where the full batch's is 6.412211).
    ``False`` where the loss matched, the candidate returned none, there is one shard, or the loss does not trace
    per shard."""
    from shardcheck.parity.harness.row_coupling import _full_and_combined

    loss = next((e for e in record.leaves if e.kind == "loss"), None)
    if loss is None or loss.ok or record.candidate_loss is None or not num_shards or num_shards < 2:
        return False
    try:
        full, combined, *_ = _full_and_combined(loss_fn, num_shards, graphdef, False, params, rest, batch)
    except (TypeError, ValueError):  # a state shaped by the full batch: no per-shard loss to compare
        return False
    full, combined = float(full), float(combined)
    return abs(record.candidate_loss - combined) <= loss.tolerance < abs(combined - full)


def recording_loss_differs(loss_fn, graphdef, params, rest, batch, record: StepRecord) -> float | None:
    """The task's full-batch loss at the state ``(graphdef, params, rest)`` a replayed step ran from (the
    recording's), where the replayed step returned it within the loss's tolerance while the recorded loss
    (``record.loss``) is further from it: the recording does not hold this task's loss (trial 27: a task whose
    capacity factor changed after its recording, replayed with a correct step, read "not a single reduced step").
    ``None`` otherwise (the loss matched, no loss returned, or the loss does not trace alone)."""
    loss = next((e for e in record.leaves if e.kind == "loss"), None)
    if loss is None or loss.ok or record.candidate_loss is None:
        return None
    try:
        total, weight = loss_terms(loss_fn, nnx.merge(graphdef, params, rest, copy=True), batch)
    except (TypeError, ValueError):  # a loss that needs the step's mesh or inputs: nothing to compare
        return None
    full = float(total if weight is None else total / weight)
    near = abs(record.candidate_loss - full) <= loss.tolerance < abs(record.loss - full)
    return full if near else None


def _blind_to_scale(run: _Run, pre: _PreStep, grads, leaves) -> bool:
    """Whether the reference's optimizer, rerun from ``pre`` on ``S grads`` and ``grads / S``, moves no parameter
    or optimizer-state leaf of ``leaves`` beyond its tolerance (:func:`blind_to_scale`)."""
    return blind_to_scale(run.ref_opt.tx, grads, pre.opt_state, pre.params, run.cand.num_shards, leaves)


def blind_to_scale(tx, grads, opt_state, params, num_shards: int | None, leaves) -> bool:
    """Whether the optimizer ``tx``, stepped from ``(params, opt_state)`` on ``c grads`` and on ``grads / c``
    (``c = num_shards``, or 2 with fewer than two shards), moves no parameter or optimizer-state leaf of
    ``leaves`` (:class:`~shardcheck.parity.comparison.live.LeafError`) beyond that leaf's tolerance in either
    direction's better case (:func:`~shardcheck.parity.tolerance.propagation.scale_change`): global-norm
    clipping that binds, a normalizing optimizer's first step. ``grads`` is a tree like ``params``; a leaf moved
    by NaN counts as moved; ``False`` where ``leaves`` holds no parameter or optimizer-state leaf of the
    optimizer's. The live check's ``scale_blind`` hypothesis (on the reference's gradient) and the replay's (on
    the candidate's, :func:`~shardcheck.parity.harness.replay.with_optimizer_rerun`)."""
    factor = float(num_shards) if num_shards and num_shards > 1 else 2.0
    moved: dict[str, float] = {}
    for c in (factor, 1 / factor):
        update, state = scale_change(tx, grads, opt_state, params, c)
        named = {
            **{f"param {k}": v for k, v in flatten_state(update).items()},
            **{f"opt_state {k}": v for k, v in flatten_state(state).items()},
        }
        for k, v in compare.max_abs(named).items():  # NaN: moved
            moved[k] = min(math.inf if math.isnan(v) else v, moved.get(k, math.inf))
    compared = [e for e in leaves if e.kind in ("param", "opt_state") and e.name in moved]
    return bool(compared) and all(moved[e.name] <= e.tolerance for e in compared)


def weight_count(batch, weight: float | None) -> tuple[int, str] | None:
    """``(N, noun)``: what a step that divides by a count in place of the loss's weight would divide by, for a
    batch whose ``(loss_sum, weight)`` loss weighs ``weight`` (``StepRecord.weight_count``): the number of
    elements of the batch leaf whose sum is ``weight`` (within 1e-6 relative: the weights or the mask), ``"rows"``
    where that leaf is 1-D, ``"entries of batch['mask']"`` otherwise; where no leaf sums to it, the batch's rows
    (the leading dimension all its leaves share). ``None`` for a mean loss (``weight`` None), where the count
    equals the weight (no row weighs other than 1), or where the leaves share no leading dimension. A gradient
    off by ``weight / N`` was divided by N where the weight was due (trial 16: 16 rows, weight 8)."""
    if not weight:
        return None
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, leaf in leaves:
        a = np.asarray(leaf) if np.ndim(leaf) else None
        if a is None or not np.issubdtype(a.dtype, np.floating) or a.size == round(weight):
            continue
        if abs(float(np.sum(a, dtype=np.float64)) - weight) <= 1e-6 * abs(weight):
            noun = "rows" if a.ndim == 1 else f"entries of batch{jax.tree_util.keystr(path)}"
            return a.size, noun
    rows = {np.shape(leaf)[0] for _, leaf in leaves if np.ndim(leaf)}
    if len(rows) != 1 or rows == {round(weight)}:
        return None
    return rows.pop(), "rows"
