"""The extra evidence of a failing step for its localization (:mod:`shardcheck.parity.diagnosis.localization`).

:func:`optimizer_rerun`: the reference's optimizer (the task's optax transformation) rerun on the candidate's own
gradients, parameters and optimizer state before the step, compared leaf by leaf with the candidate's state after
it, at the step's tolerances: equal gradients giving a different update or state place the mistake in how the
update was computed or applied. :func:`stage_forms`: the form of the difference of each stage's failing leaves
(:func:`~shardcheck.parity.diagnosis.form.fit_form`, float64 on the host). All run on a failing step only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck._tree import copy_arrays, path_str
from shardcheck.parity.comparison.live import flatten_state, host_tree, is_int, leaf_error, to_host
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form, fit_form
from shardcheck.parity.diagnosis.grouping import param_path
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.replica_form import fit_replicas, replica_blocks
from shardcheck.parity.harness.state import _default_view, _opt_state, _Run
from shardcheck.parity.tolerance.derive import MOMENT_FACTOR, UPDATE_GRAD_ULPS, UPDATE_RTOL, UPDATE_ULPS
from shardcheck.parity.tolerance.propagation import as_param_dtypes, update_sensitivity


@functools.partial(jax.jit, static_argnums=0)
def _rerun_jit(tx, params, opt_state, grads):
    updates, opt_state = tx.update(as_param_dtypes(grads, params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _rerun(tx, params, opt_state, grads):
    """``(params, opt_state)`` after one step of ``tx`` on ``grads``, from host copies of its inputs: compiled once
    per transformation, whatever placement the step left its arrays in (the first step's and the later ones'
    differ). The optimizer's arithmetic is elementwise, but for its norms: the same on any device."""
    return _rerun_jit(tx, *jax.tree.map(_host_array, (params, opt_state, grads)))


@functools.partial(jax.jit, static_argnums=0)
def _rerun_within_jit(tx, params, opt_state, grads, after, rel):
    """:func:`_rerun_jit` and whether every floating leaf of ``after`` (``(params, opt_state)``, the candidate's
    state after the step) lies within :func:`update_leaves`' rule of the rerun with room to spare: a float32
    test with a margin of 2**-20 of each side, so that a leaf it clears also clears the float64 test of
    :func:`_within`; a leaf at the margin, a NaN or an infinity reads ``False`` (the host decides)."""
    rerun = _rerun_jit(tx, params, opt_state, grads)
    margin = 2.0**-20

    def within(r, c, b):
        if not (jnp.issubdtype(c.dtype, jnp.floating) and jnp.issubdtype(r.dtype, jnp.floating)):
            return jnp.bool_(True)
        if c.shape != r.shape or b.shape != r.shape:
            return jnp.bool_(False)
        wide = jnp.promote_types(jnp.promote_types(c.dtype, r.dtype), jnp.float32)
        ulps = UPDATE_ULPS * float(jnp.finfo(c.dtype).eps)
        r, c, b = (x.astype(wide) for x in (r, c, b))
        bound = ulps * jnp.max(jnp.abs(r), initial=0.0) + rel * jnp.abs(r - b)
        ok = jnp.isfinite(c) & ((c == r) | (jnp.abs(c - r) * (1 + margin) < bound * (1 - margin)))
        return jnp.all(ok)

    flags = jax.tree.leaves(jax.tree.map(within, rerun, after, (params, opt_state)))
    return rerun, jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def _host_array(a):
    """``a`` as a NumPy array, a PRNG key as it is."""
    if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
        return a
    return to_host(a)


def _on_one_device(tree) -> bool:
    """Whether every ``jax.Array`` leaf of ``tree`` lives whole on one and the same device (a single-device
    strategy's state, and the snapshots of it): then a jitted call takes them as they are, with no host copy."""
    devices = {frozenset(a.sharding.device_set) for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)}
    return len(devices) == 1 and len(next(iter(devices))) == 1


def _rebuild(like, flat: dict):
    """``like``'s structure holding ``flat``'s leaves by path, or ``None`` where a path is missing (``like``: a
    pytree, or its :func:`_layout`)."""
    treedef, paths = like if isinstance(like, _Layout) else _layout(like)
    if any(p not in flat for p in paths):
        return None
    return jax.tree.unflatten(treedef, [flat[p] for p in paths])


class _Layout(tuple):
    """``(treedef, paths)`` of a pytree: what :func:`_rebuild` reads of it."""


def _layout(like) -> _Layout:
    return _Layout((jax.tree.structure(like), list(flatten_state(like))))


def _layouts(run: _Run) -> tuple[_Layout, _Layout]:
    """The layouts of the reference's parameters and optimizer state, found once per check (``run.layouts``)."""
    if run.layouts is None:
        like_params = nnx.as_pure(nnx.state(run.ref_model, nnx.Param))
        run.layouts = (_layout(like_params), _layout(nnx.as_pure(run.ref_opt.opt_state)))
    return run.layouts


def _rerun_inputs(run: _Run, snapshots, cand_grads):
    """``(params, opt_state, grads)``: the candidate's parameters and optimizer state before the step and the
    gradients it returned, as the task's optimizer takes them, or ``None`` where they cannot be given to it (see
    :func:`optimizer_rerun`)."""
    if cand_grads is None or run.reference is not None:
        return None
    kept = run.rerun_inputs  # the same step's, asked again (verifies_update, then update_check)
    if kept is not None and kept[0] is snapshots and kept[1] is cand_grads:
        return kept[2]
    inputs = _built_inputs(run, snapshots, cand_grads)
    run.rerun_inputs = (snapshots, cand_grads, inputs)
    return inputs


def _built_inputs(run: _Run, snapshots, cand_grads):
    """:func:`_rerun_inputs`, built."""
    like_params, like_state = _layouts(run)
    _, cand_params0, _, cand_state0 = snapshots
    params = _rebuild(like_params, cand_params0)
    state = _rebuild(like_state, cand_state0)
    grads = _rebuild(like_params, flatten_state(nnx.as_pure(cand_grads)))
    if params is None or state is None or grads is None:
        return None
    return params, state, grads


def verifies_update(run: _Run, t: int, snapshots, cand_grads, after) -> bool:
    """Whether step ``t`` gets the :func:`update_check` where it passes: a step :func:`checks_step` checks, whose
    inputs the task's optimizer takes (:func:`_rerun_inputs`: the candidate's gradients returned, its optimizer
    state by the reference's paths, no user's reference step), an optimizer that reruns on ``(grads, state,
    params)`` alone (traced once per check: ``run.rerunnable``). Arguments as :func:`update_check`."""
    if not _checks(run, t, after):
        return False
    inputs = _rerun_inputs(run, snapshots, cand_grads)
    if inputs is None:
        return False
    if run.rerunnable is None:
        try:  # what _try_rerun catches, from the shapes alone
            jax.eval_shape(functools.partial(_rerun_jit, run.ref_opt.tx), *inputs)
            run.rerunnable = True
        except (TypeError, ValueError):
            run.rerunnable = False
    return run.rerunnable


def _rerun_from(run: _Run, snapshots, cand_grads):
    """``(params, opt_state)`` of the task's optimizer rerun on the candidate's own gradients, parameters and
    optimizer state before the step, or ``None`` where it cannot run (see :func:`optimizer_rerun`)."""
    inputs = _rerun_inputs(run, snapshots, cand_grads)
    return None if inputs is None else _try_rerun(run.ref_opt.tx, *inputs)


def _try_rerun(tx, params, state, grads):
    """:func:`_rerun`, or ``None`` where the transformation needs more than ``(grads, state, params)``."""
    try:
        return _rerun(tx, params, state, grads)
    except (TypeError, ValueError):  # a transformation needing more than (grads, state, params): not observed
        return None


def optimizer_rerun(
    run: _Run, t: int, snapshots, cand_grads, after, rtol, atol
) -> tuple[LeafError, ...] | None:
    """The reference's optimizer rerun from the candidate's own inputs, compared with the candidate's output.

    Args:
        run: the parity run, after the step.
        t: the step.
        snapshots: both sides' state before the step (``check._snapshots``: reference params, candidate params,
            reference optimizer state, candidate optimizer state; flat ``{path: array}``).
        cand_grads: the gradients the candidate returned, or ``None``.
        after: both sides' state after the step (``state._After``).
        rtol, atol: the step's tolerances (optimizer-state leaves: ``MOMENT_FACTOR`` times them).

    Returns:
        One ``param`` / ``opt_state`` :class:`LeafError` per float leaf (reference: the rerun; candidate: its
        state after the step; the ratio of the changes from its own state before), or ``None`` where it cannot
        run: no gradients returned, a user's reference step, or a state whose leaves are not the reference's.
    """
    found = _rerun_from(run, snapshots, cand_grads)
    if found is None:
        return None
    new_params, new_state = found
    _, cand_params0, _, cand_state0 = snapshots
    out = []
    sides = (
        ("param", new_params, after.cand_params, cand_params0, 1.0),
        ("opt_state", new_state, after.cand_state, cand_state0, MOMENT_FACTOR),
    )
    for kind, rerun, cand, before, factor in sides:
        for path, value in flatten_state(rerun).items():
            if path not in cand or is_int(value):
                continue
            r_tol, a_tol = run.tol(kind, path, factor * rtol, factor * atol)
            allowance = run.allowance.get(path) if kind == "param" else run.state_allowance.get(path)
            allowance = None if allowance is None else to_host(allowance)
            b = to_host(before[path])
            out.append(
                leaf_error(t, kind, path, to_host(value), to_host(cand[path]), r_tol, a_tol, b, b, allowance)
            )
    return tuple(out)


def update_check(
    run: _Run, t: int, snapshots, cand_grads, after, skipped: bool = False
) -> tuple[tuple[LeafError, ...], tuple] | None:
    """The candidate's state after the step against the task's optimizer rerun on its own gradients and state
    before it, at the optimizer's own rounding (:func:`checked_update`): the check of a step that passed its
    tolerances, which a fault of the update free of drift (a weight decay on leaves the mask leaves out, an lr a
    few percent off) may do while it accumulates below them.

    Args: as :func:`optimizer_rerun`, without tolerances; ``skipped``: the reference skipped the step
    (``StepRecord.skipped``), so a skip of the candidate's own is looked for before the rerun.

    Returns:
        :func:`checked_update`'s ``(leaves, arrays)``; ``None`` where the rerun cannot run (:func:`optimizer_rerun`)
        or the step is not checked (:func:`checks_step`).
    """
    if not _checks(run, t, after):
        return None
    inputs = _rerun_inputs(run, snapshots, cand_grads)
    if inputs is None:
        return None
    _, cand_params0, _, cand_state0 = snapshots
    sides = (after.cand_params, after.cand_state), (cand_params0, cand_state0)
    return checked_update(t, run.ref_opt.tx, inputs, *sides, run.precision.compute_dtype, skipped)


# The update check brings the state to the host (its rerun and comparison run on host copies): at every step where
# the parameters and optimizer state hold at most this many bytes, at step 0 alone above it (a faulty update shows
# at every step; a large model's state is not copied out at each one).
UPDATE_CHECK_BYTES = 256 * 2**20


def checks_step(t: int, state) -> bool:
    """Whether the update check runs at step ``t`` on ``state`` (a pytree of the candidate's parameters and
    optimizer state): at step 0, and at later steps where it holds at most :data:`UPDATE_CHECK_BYTES`."""
    if t == 0:
        return True
    return sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(state)) <= UPDATE_CHECK_BYTES


def _checks(run: _Run, t: int, after) -> bool:
    """:func:`checks_step` of the candidate's state ``after`` step ``t`` (an ``_After``), its bytes counted once
    per check where the steps update in place (their shapes fixed: ``run.checks_every_step``; the count read
    every leaf twice a step, issue #35)."""
    if t == 0:
        return True
    if run.in_place and run.checks_every_step is not None:
        return run.checks_every_step
    every = checks_step(t, (after.cand_params, after.cand_state))
    if run.in_place:
        run.checks_every_step = every
    return every


def checked_update(t: int, tx, inputs: tuple, after, before, compute_dtype, skipped: bool = False):
    """The update check of one step: ``tx`` rerun on ``inputs`` (``(params, opt_state, grads)``, the candidate's
    before the step) against its state ``after`` it (:func:`update_leaves`). Where a leaf fails, it is decided
    again with each element's sensitivity to the gradient moving by
    :data:`~shardcheck.parity.tolerance.derive.UPDATE_GRAD_ULPS` units of its leaf's largest element added
    (:func:`~shardcheck.parity.tolerance.propagation.update_sensitivity`): a step may return its gradient
    computed in another order than the one it applied (the accumulation strategy's mean of the micro-batches and
    ``optax.MultiSteps``' running mean), and Adam turns the last bits of an element at rounding level into a
    change of its update far beyond them. A step the candidate skipped (:func:`skipped_by_candidate`) is its own
    and passes: the task's optimizer is not rerun on gradients the step never applied. ``skipped``: the reference
    skipped the step (its gradients not finite, its parameters left as they were), so the candidate's skip is
    looked for first and the optimizer not rerun where it is found (elsewhere a skip is looked for only where the
    rerun's rule fails). Returns ``(leaves, arrays)``, or ``None`` where ``tx`` needs more than ``(grads, state,
    params)``."""
    if skipped and skipped_by_candidate(inputs[2], after, before):
        return (), ({}, {}, {})  # both sides skipped: an optax.apply_if_finite rerun would only skip it again
    found = _rerun_within(tx, inputs, after, compute_dtype)
    if found is None:
        return None
    rerun, within = found
    # a skip is looked for only where the device's test fails (no program of its own on a passing step, issue #35)
    if (
        within
        or skipped_by_candidate(inputs[2], after, before)
        or _within(rerun, after, before, compute_dtype)
    ):
        return (), ({}, {}, {})  # every element within the rule, or a step the candidate skipped: no record
    checked = update_leaves(t, rerun, after, before, compute_dtype)
    if all(e.ok for e in checked[0]):
        return checked
    params, state, grads = jax.tree.map(_host_array, inputs)
    delta = jax.tree.map(
        lambda g: np.asarray(
            UPDATE_GRAD_ULPS * jnp.finfo(g.dtype).eps * np.max(np.abs(g), initial=0.0), g.dtype
        ),
        grads,
    )
    updates, states, _ = update_sensitivity(tx, grads, state, params, delta)
    allowance = (host_tree(updates), host_tree(states))
    return update_leaves(t, rerun, after, before, compute_dtype, allowance)


def skipped_by_candidate(grads, after, before) -> bool:
    """Whether a step is one the candidate skipped: its gradients (a pytree of arrays) hold a value that is not
    finite, and its parameters and optimizer state ``after`` the step (flat ``(params, opt_state)``, ``{path:
    array}`` each) are bitwise ``before``'s (a loss-scale check's skip), but for ``optax.apply_if_finite``'s count
    of the skip (:func:`_left_or_counted`: its ``notfinite_count`` and ``total_notfinite`` one more, its
    ``last_finite`` false, its inner state as it was; whether the counts are the reference's, the counters'
    comparison decides). Rerunning the task's plain optimizer on such gradients gives NaN where the step applied
    nothing (issue #36 trial 48: a replay read "the optimizer gives other values for param head.bias and 11 more
    (max abs err nan > nan" at a bitwise-identical run)."""
    if _all_finite(grads):
        return False
    for now, was in zip(after, before, strict=True):
        if now.keys() != was.keys():
            return False
        if not all(_left_or_counted(p, to_host(now[p]), to_host(was[p])) for p in now):
            return False
    return True


# optax.apply_if_finite's state (ApplyIfFiniteState): the counters a step it skips adds one to, and its flag
_SKIP_COUNTERS = ("notfinite_count", "total_notfinite")
_SKIP_FLAG = "last_finite"


def _left_or_counted(path: str, now, was) -> bool:
    """Whether a leaf (``path`` dotted, ``now``/``was`` host arrays) is as it was before a skipped step, bitwise
    (NaN equal to NaN), or is ``optax.apply_if_finite``'s count of the skip: ``notfinite_count`` and
    ``total_notfinite`` one more than before, ``last_finite`` false."""
    if np.array_equal(now, was, equal_nan=_inexact(now)):
        return True
    name = path.rsplit(".", 1)[-1]
    if name in _SKIP_COUNTERS:
        return now.shape == was.shape and bool(np.all(now.astype(np.int64) == was.astype(np.int64) + 1))
    return name == _SKIP_FLAG and now.shape == was.shape and not bool(np.any(now))


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _all_finite(tree) -> bool:
    """Whether every floating element of ``tree`` (a pytree of arrays) is finite (read on the host: no program
    compiled for it)."""
    return all(bool(np.all(np.isfinite(to_host(a)))) for a in jax.tree.leaves(tree) if _inexact(a))


def _rerun_within(tx, inputs: tuple, after, compute_dtype) -> tuple | None:
    """``(rerun, within)``: ``tx`` rerun on ``inputs`` (``(params, opt_state, grads)``) and whether the
    candidate's state ``after`` the step (flat ``(params, opt_state)``) clears the update check's rule on the
    device (:func:`_rerun_within_jit`; ``False`` where ``after`` lacks a path: the host decides), or ``None``
    where ``tx`` needs more than ``(grads, state, params)``."""
    params, state, _ = inputs
    after_trees = (_rebuild(params, after[0]), _rebuild(state, after[1]))
    if any(a is None for a in after_trees):
        rerun = _try_rerun(tx, *inputs)
        return None if rerun is None else (rerun, False)
    rel = np.float32(_update_rtol(compute_dtype))
    args = (*inputs, after_trees)
    if not _on_one_device(args):  # a mesh's placements: one call takes one device set, the host's copies
        args = jax.tree.map(_host_array, args)
    try:
        rerun, within = _rerun_within_jit(tx, *args, rel)
    except (TypeError, ValueError):  # a transformation needing more than (grads, state, params): not observed
        return None
    return rerun, bool(within)


def _update_rtol(compute_dtype) -> float:
    """The update check's allowance relative to each element's change: :data:`~shardcheck.parity.tolerance.
    derive.UPDATE_RTOL`, or 4 units of a compute dtype coarser than float32."""
    compute_eps = float(jnp.finfo(compute_dtype).eps)
    return UPDATE_RTOL if compute_eps <= np.finfo(np.float32).eps else 4 * compute_eps


def _float_sides(rerun, after, before):
    """``(side, path, rerun, candidate after, candidate before)`` host arrays of every floating leaf the rerun
    and both of the candidate's states hold (``side``: 0 the parameters, 1 the optimizer state)."""
    for side, (ran, cand, was) in enumerate(zip(rerun, after, before, strict=True)):
        for path, value in flatten_state(ran).items():
            if path not in cand or path not in was or is_int(value) or not hasattr(value, "dtype"):
                continue
            c = to_host(cand[path])
            if jnp.issubdtype(c.dtype, jnp.floating):
                yield side, path, to_host(value), c, to_host(was[path])


def _within(rerun, after, before, compute_dtype) -> bool:
    """Whether every float leaf of the candidate's state ``after`` the step lies within :func:`update_leaves`'s
    rule of the rerun, elementwise, read without the records' statistics (a passing step's fast path)."""
    rel = _update_rtol(compute_dtype)
    for _, _, r, c, b in _float_sides(rerun, after, before):
        ulps = UPDATE_ULPS * float(jnp.finfo(c.dtype).eps)
        r, c, b = (np.asarray(a, np.float64) for a in (r, c, b))
        if not np.all(
            np.abs(c - r) <= ulps * np.max(np.abs(r), initial=0.0) + rel * np.abs(r - b)
        ):  # NaN fails
            return False
    return True


def update_leaves(
    t: int, rerun, after, before, compute_dtype, allowance=({}, {})
) -> tuple[tuple[LeafError, ...], tuple]:
    """Each float leaf of the candidate's state after a step against the task's optimizer rerun on its own inputs,
    within the optimizer's own rounding: :data:`~shardcheck.parity.tolerance.derive.UPDATE_ULPS` units in the last
    place of the leaf's largest element (its dtype's) plus :data:`~shardcheck.parity.tolerance.derive.UPDATE_RTOL`
    of each element's change in the step (under a ``compute_dtype`` coarser than float32, 4 of its units).

    Args:
        t: the step.
        rerun: ``(params, opt_state)`` pytrees of the rerun.
        after, before: ``(params, opt_state)`` of the candidate after and before the step, flat ``{path: array}``.
        compute_dtype: the step's compute dtype (``Precision.compute_dtype``).
        allowance: ``(params, opt_state)`` flat ``{path: array}`` added element by element (the update's
            sensitivity to the gradient's last bits, :func:`checked_update`); a missing path adds nothing.

    Returns:
        ``(leaves, arrays)``: one ``param`` / ``opt_state`` :class:`LeafError` per float leaf (reference: the rerun),
        and ``(before, rerun, after)`` flat ``{key: host array}`` keyed as
        :func:`~shardcheck.parity.diagnosis.form.fit_form` reads them (a parameter by its path, an optimizer-state
        leaf as ``"opt_state <path>"``).
    """
    rel = _update_rtol(compute_dtype)
    leaves, arrays = [], ({}, {}, {})
    for side, path, r, c, b in _float_sides(rerun, after, before):
        kind = ("param", "opt_state")[side]
        change = rel * np.abs(np.asarray(r, np.float64) - np.asarray(b, np.float64))
        if path in allowance[side]:
            change = change + np.asarray(allowance[side][path], np.float64)
        ulps = UPDATE_ULPS * float(jnp.finfo(c.dtype).eps)
        leaves.append(leaf_error(t, kind, path, r, c, ulps, 0.0, b, b, change))
        key = path if kind == "param" else f"opt_state {path}"
        for arrays_side, a in zip(arrays, (b, r, c), strict=True):
            arrays_side[key] = a
    return tuple(leaves), arrays


def pre_update(model, optimizer, view) -> tuple:
    """``(params, opt_state)``: copies of a candidate's parameters and optimizer state (its ``view``,
    ``Candidate.view_optimizer``, or the optimizer's own) before a step, for :func:`recorded_update_check` (the
    step may donate them; copied by the runtime, :func:`~shardcheck._tree.copy_arrays`: no program per leaf)."""
    view = view or _default_view
    return copy_arrays((nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(view(optimizer)[0])))


def recorded_update_check(t: int, task, pre: tuple, grads, model, optimizer, view, compute_dtype):
    """:func:`update_check` of a step that :func:`~shardcheck.parity.harness.recorded.record_run` ran: the task's
    optimizer (``task.optimizer``) rerun on the gradients the step returned and its state before the step
    (``pre``: :func:`pre_update`), against its state after it. Returns ``(t, leaves, arrays)`` where some leaf
    fails, else ``None`` (also where the step returns no gradients, its optimizer state is not the task's by
    path, or the transformation needs more than ``(grads, state, params)``)."""
    if grads is None:
        return None
    params, state = pre
    state = _rebuild(jax.eval_shape(task.optimizer.init, params), flatten_state(state))
    grads = _rebuild(params, flatten_state(nnx.as_pure(grads)))
    if state is None or grads is None:
        return None
    view = view or _default_view
    after = (
        flatten_state(nnx.as_pure(nnx.state(model, nnx.Param))),
        flatten_state(state_after := nnx.as_pure(view(optimizer)[0])),
    )
    before = (flatten_state(params), flatten_state(state))
    checked = checked_update(t, task.optimizer, (params, state, grads), after, before, compute_dtype)
    if checked is None or all(e.ok for e in checked[0]):
        return None
    leaves, arrays = checked
    return t, leaves, (*arrays, known_lr(state_after))


def known_lr(opt_state, tx=None, params=None) -> float | None:
    """The learning rate the step that led to ``opt_state`` (the optimizer's state after it) applied, or ``None``.

    Read from an ``optax.inject_hyperparams`` state (``hyperparams["learning_rate"]``: after a step, the one that
    step applied; a schedule's own state, ``hyperparams_states``, is not a learning rate); else, given the
    transformation ``tx`` and a tree like its parameters ``params`` (arrays or ``jax.ShapeDtypeStruct``), from
    the one learning rate ``tx`` holds (:func:`_tx_learning_rate`): a schedule's value at the count before the
    step (its ``ScaleByScheduleState.count`` in ``opt_state``, minus 1: issue #36's warmup-cosine adamw, whose
    decay read "c*lr = 7.496e-05 (the learning rate unknown)" where lr(1) = 1.5e-3 gives c = 0.05), or a constant
    one. A positive float; ``None`` where none is found, or more than one could be it."""
    found = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if any(getattr(k, "key", None) in ("learning_rate", "lr") for k in path)
        and not any(getattr(k, "key", getattr(k, "name", None)) == "hyperparams_states" for k in path)
    ]
    if len(found) == 1:
        value = float(np.asarray(to_host(found[0])).reshape(-1)[0])
    elif not found and tx is not None and params is not None:
        value = _tx_learning_rate(tx, params, opt_state)
    else:
        return None
    return value if value is not None and math.isfinite(value) and value > 0 else None


def task_decay(tx, params) -> float | None:
    """``c*lr``, the decoupled weight decay ``tx`` (the task's optimizer) applies at its first step: its update
    from zero gradients at a fresh state is ``-c*lr*param`` (Adam's and a momentum's term is 0 there), read where
    one ratio holds over every leaf it moves (within 2%); ``None`` where it moves none, the ratios differ, or
    ``tx`` cannot update ``params`` (a pytree of arrays) so."""
    try:
        zeros = jax.tree.map(jnp.zeros_like, params)
        update, _ = tx.update(zeros, tx.init(params), params)
    except Exception:  # noqa: BLE001 - an optimizer that cannot step from zero gradients: no decay read
        return None
    ratios = []
    for u, p in zip(jax.tree.leaves(update), jax.tree.leaves(params), strict=False):
        u, p = np.asarray(to_host(u), np.float64), np.asarray(to_host(p), np.float64)
        keep = (np.abs(p) > 0) & (u != 0)
        if u.shape == p.shape and keep.any():
            ratios.append(float(np.median(u[keep] / p[keep])))
    if not ratios:
        return None
    r = float(np.median(ratios))
    ok = r < 0 and all(abs(x - r) <= 0.02 * abs(r) for x in ratios)
    return -r if ok else None


def _reference_lr(run: _Run) -> float | None:
    """:func:`known_lr` of the reference's optimizer after its step (its state, transformation and parameters)."""
    params = nnx.as_pure(nnx.state(run.ref_model, nnx.Param))
    return known_lr(nnx.as_pure(_opt_state(run.ref_opt)), run.ref_opt.tx, params)


def _tx_learning_rate(tx, params, opt_state) -> float | None:
    """The learning rate ``tx`` applied at the step that led to ``opt_state``: its one ``scale_by_schedule`` (what
    ``optax.scale_by_learning_rate`` builds from a schedule, inside ``adamw``, ``sgd``, ...) at its state's count
    minus 1, or its one ``optax.scale`` (a constant learning rate); ``None`` where ``tx`` holds neither, or more
    than one of them, or the schedule's count is not in ``opt_state``."""
    found = _scales_of(tx)
    if len(found) == 1 and found[0][0] == "constant":
        return abs(float(np.asarray(found[0][1])))
    read = _schedule_count(tx, params, opt_state, found)
    if read is None:
        return None
    schedule, count = read
    return abs(float(np.asarray(schedule(max(count - 1, 0)))))


def _schedule_count(tx, params, opt_state, found=None) -> tuple[object, int] | None:
    """``(schedule, count)``: the one learning-rate schedule ``tx`` holds (``scale_by_schedule``'s
    ``step_size_fn``) and its state's count in ``opt_state`` (after the step: one more than the count the step
    read); ``None`` where ``tx`` holds no schedule or more than one scaling, or the count is not in
    ``opt_state``. ``found``: ``tx``'s scalings where already read (:func:`_scales_of`)."""
    found = _scales_of(tx) if found is None else found
    if len(found) != 1 or found[0][0] != "schedule":
        return None
    try:
        like = jax.eval_shape(tx.init, params)
    except Exception:  # noqa: BLE001 - a transformation that cannot initialize from this tree: no count to read
        return None
    schedule_states = [
        path_str(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            like, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
        )[0]
        if isinstance(leaf, optax.ScaleByScheduleState)
    ]
    flat = flatten_state(opt_state)
    keys = [f"{p}.count" if p else "count" for p in schedule_states]
    if len(keys) != 1 or keys[0] not in flat:
        return None
    return found[0][1], int(np.asarray(to_host(flat[keys[0]])).reshape(-1)[0])


MICRO_STEPS = tuple(range(2, 9))
"""The micro-steps a step k of :func:`schedule_at_micro_steps` (a schedule counting k micro-steps a step)."""


def schedule_at_micro_steps(tx, params, opt_state) -> tuple[tuple[int, int, int, float], ...]:
    """``((k, c, m, lr(m) / lr(c)), ...)``: the task's learning-rate schedule read at a count of micro-steps against
    the count ``c`` the step read (``tx``'s one schedule, :func:`_schedule_count`; ``opt_state``: the optimizer's
    state after the step), for k in :data:`MICRO_STEPS` micro-steps a step and the two counts m a schedule that
    counts them reads when the update is applied: ``k c`` (the schedule called with the micro-step count) and
    ``k c + k - 1`` (a scaling outside ``optax.MultiSteps``, its count advanced at every micro-step). A candidate
    whose update is one of these ratios x the reference's, its counters matching, may read its schedule so (trial
    60: ``MultiSteps(adamw(lambda c: schedule(2 * c)), every_k_schedule=2)`` read "a learning rate 2 x, or the
    update applied 2 times", 2 micro-steps unnamed). Empty where there is no one schedule with its count, or
    ``lr(c)`` is 0 or not finite; ratios of 1 or not finite are left out."""
    read = _schedule_count(tx, params, opt_state)
    if read is None:
        return ()
    schedule, count = read
    c = max(count - 1, 0)

    def lr(n: int) -> float:
        return abs(float(np.asarray(schedule(n))))

    try:
        base = lr(c)
        if not (base > 0 and math.isfinite(base)):
            return ()
        found = [(k, m, lr(m) / base) for k in MICRO_STEPS for m in dict.fromkeys((k * c, k * c + k - 1))]
    except Exception:  # noqa: BLE001 - a schedule that cannot be read at another count: nothing to say
        return ()
    return tuple((k, c, m, r) for k, m, r in found if math.isfinite(r) and abs(r - 1.0) > 1e-6)


def _scales_of(tx) -> list[tuple[str, object]]:
    """``[("schedule", fn) | ("constant", step_size), ...]``: the learning-rate scalings inside the optax
    transformation ``tx``, found through its functions' closures (``scale_by_schedule``'s ``step_size_fn``,
    ``scale``'s ``step_size``)."""
    found: list[tuple[str, object]] = []
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if depth > 64 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):  # multi_transform's transforms by label
            obj = tuple(obj.values())
        if isinstance(obj, tuple | list):
            for item in obj:
                visit(item, depth + 1)
            return
        if isinstance(obj, functools.partial):
            visit((obj.func, *obj.args, *obj.keywords.values()), depth + 1)
            return
        owner = getattr(obj, "__self__", None)
        if owner is not None and hasattr(obj, "__func__"):
            # a bound method (optax.MultiSteps' gradient_transformation(): its update is MultiSteps.update): the
            # transformations its object holds (MultiSteps' inner optimizer)
            visit(tuple(getattr(owner, "__dict__", {}).values()), depth + 1)
            return
        code = getattr(obj, "__code__", None)
        if code is None:
            # not a function: an object holding its update function (a GradientTransformation is a NamedTuple,
            # visited as a tuple above)
            update = getattr(obj, "update", None)
            if update is not None and callable(update):
                visit(update, depth + 1)
            return
        cells = {}
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                cells[name] = cell.cell_contents
            except ValueError:  # an empty cell
                continue
        qualname = getattr(obj, "__qualname__", "")
        if qualname == "scale_by_schedule.<locals>.update_fn" and "step_size_fn" in cells:
            found.append(("schedule", cells["step_size_fn"]))
        elif qualname == "scale.<locals>.update_fn" and "step_size" in cells:
            found.append(("constant", cells["step_size"]))
        else:
            for value in cells.values():
                visit(value, depth + 1)

    visit(tx, 0)
    return found


FROM_EQUAL_INPUTS = "the reference's update from equal inputs"
"""What the optimizer stage's form reads its ratio against, live (the reference's step, from the gradients and
state the candidate's match) and replayed (the task's optimizer rerun on the replay's own): said beside the
ratio, since a replay's report also gives one over its recorded samples (trial 43)."""


def stage_forms(
    run: _Run, record: StepRecord, snapshots, stepped, after, stage: str
) -> tuple[tuple[str, Form], ...]:
    """``((stage, Form),)``: the form of ``stage``'s failing leaves (``gradients``: the two sides' gradients;
    ``optimizer`` / ``parameters``: the reference's state before and after the step and the candidate's after
    it; ``replicas``: :func:`replicas_form`), or ``()`` where the stage has no arrays (the loss, the counters)."""
    ref_params0, _, ref_state0, _ = snapshots
    _, ref_grads, _, cand_grads, _ = stepped
    if stage == "replicas":
        return replicas_form(record, snapshots, after)
    if stage == "gradients":
        bad = [e.path for e in record.leaves if e.kind == "grad" and not e.ok]
        ref, cand = flatten_state(nnx.as_pure(ref_grads)), flatten_state(nnx.as_pure(cand_grads))
        before: dict = {}
    elif stage in ("optimizer", "parameters"):
        bad_params = [e.path for e in record.leaves if e.kind == "param" and not e.ok]
        bad_state = [e.path for e in record.leaves if e.kind == "opt_state" and not e.ok]
        # a candidate stepping an optimizer of its own holds other state paths (no view_optimizer): not fitted
        bad_state = [
            p for p in bad_state if p in after.cand_state and p in after.ref_state and p in ref_state0
        ]
        bad = bad_params + [f"opt_state {p}" for p in bad_state]
        ref = {**after.ref_params, **{f"opt_state {p}": after.ref_state[p] for p in bad_state}}
        cand = {**after.cand_params, **{f"opt_state {p}": after.cand_state[p] for p in bad_state}}
        before = {**ref_params0, **{f"opt_state {p}": ref_state0[p] for p in bad_state}}
    else:
        return ()
    bad = [p for p in bad if p in ref and p in cand and not is_int(cand[p])]
    if not bad:
        return ()
    lr = _reference_lr(run)
    form = fit_form(
        {p: to_host(before[p]) for p in bad if p in before},
        {p: to_host(ref[p]) for p in bad},
        {p: to_host(cand[p]) for p in bad},
        lr=lr,
        optimizer_stage=stage == "optimizer",
        update=stage != "gradients",
        source=FROM_EQUAL_INPUTS if stage == "optimizer" else "",
        tol=leaf_tolerances(
            [e for e in record.leaves if (e.kind == "grad") == (stage == "gradients")]
        ),  # a gradient and its parameter share a path: each stage its own kind's tolerance
        state_params=state_params(bad, ref_params0),
        params={p: to_host(ref_params0[p]) for p in bad if p in ref_params0}
        if stage == "gradients"
        else None,
        quiet=quiet_keys(bad, near_zero(ref_grads, record.atol)) if stage != "gradients" else None,
        task_decay=_reference_decay(run) if stage != "gradients" else None,
    )
    return ((stage, form),)


def _reference_decay(run: _Run) -> float | None:
    """:func:`task_decay` of the reference's optimizer on its parameters."""
    return task_decay(run.ref_opt.tx, nnx.as_pure(nnx.state(run.ref_model, nnx.Param)))


def near_zero(grads, atol: float) -> dict:
    """``{param path: bool array}``: the elements of the gradient ``grads`` (an ``nnx.State`` or pytree of
    arrays) within ``atol`` of 0 (at rounding level: a fused qkv bias's key third, a kernel's element small by
    chance), of the leaves some but not all of whose elements are; ``{}`` where there are no gradients."""
    if grads is None:
        return {}
    out = {}
    for path, g in flatten_state(nnx.as_pure(grads)).items():
        if is_int(g):
            continue
        near = np.abs(np.asarray(to_host(g), np.float64)) <= atol
        if near.any() and not near.all():
            out[path] = near
    return out


def quiet_keys(keys, quiet: dict) -> dict:
    """``{key: bool array}`` of the fit's ``keys`` (a parameter's path, ``"opt_state <path>"``) whose parameter
    (:func:`~shardcheck.parity.diagnosis.grouping.param_path`) has elements at rounding level in ``quiet``
    (``{param path: bool array}``): what :func:`~shardcheck.parity.diagnosis.form.fit_form` leaves out of a
    factor's fit (an optimizer-state leaf of another shape is ignored there)."""
    if not quiet:
        return {}
    plain = list(quiet)
    out = {}
    for k in keys:
        q = param_path(k.removeprefix("opt_state "), plain) if k.startswith("opt_state ") else k
        if q in quiet:
            out[k] = quiet[q]
    return out


def state_params(keys, params) -> dict:
    """``{"opt_state <path>": the matching parameter's value before the step (host array)}`` of the
    optimizer-state ``keys`` whose parameter (:func:`~shardcheck.parity.diagnosis.grouping.param_path`) is in
    ``params`` (``{path: array}``; keys ``"opt_state ..."`` in it are skipped): what
    :func:`~shardcheck.parity.diagnosis.form.fit_form` reads a coupled weight decay from (``state_decay``)."""
    plain = [p for p in params if not p.startswith("opt_state ")]
    out = {}
    for k in keys:
        q = param_path(k.removeprefix("opt_state "), plain) if k.startswith("opt_state ") else None
        if q in plain:
            out[k] = to_host(params[q])
    return out


def leaf_tolerances(leaves) -> dict[str, float]:
    """``{key: tolerance}`` of ``leaves`` (:class:`~shardcheck.parity.diagnosis.evidence.LeafError`), keyed as
    :func:`~shardcheck.parity.diagnosis.form.fit_form` reads its arrays: a gradient or a parameter by its path, an
    optimizer-state leaf as ``"opt_state <path>"``."""
    return {(f"opt_state {e.path}" if e.kind == "opt_state" else e.path): e.tolerance for e in leaves}


def optimizer_form(record: StepRecord, arrays) -> tuple:
    """``(("optimizer", Form),)``: the form of the optimizer stage's failing leaves (``record.optimizer_rerun``),
    fitted on the rerun's arrays as :func:`stage_forms` fits a stage's, where the record is localized there; else
    ``()``. ``arrays``: ``(before, rerun, after, lr, quiet)``: flat ``{key: array}`` keyed as
    :func:`~shardcheck.parity.diagnosis.form.fit_form` reads them, the learning rate the state holds
    (:func:`known_lr`) and the elements at rounding level (:func:`near_zero`)."""
    found = localize([record])
    if found is None or found.stage != "optimizer":
        return ()
    before, rerun, after, lr, quiet, *decay = arrays
    keys = [
        e.path if e.kind == "param" else f"opt_state {e.path}" for e in record.optimizer_rerun if not e.ok
    ]
    keys = [k for k in keys if k in rerun and k in after and not is_int(after[k])]
    if not keys:
        return ()
    form = fit_form(
        {k: to_host(before[k]) for k in keys},
        {k: to_host(rerun[k]) for k in keys},
        {k: to_host(after[k]) for k in keys},
        lr=lr,
        optimizer_stage=True,
        tol=leaf_tolerances(record.optimizer_rerun),
        source=FROM_EQUAL_INPUTS,
        state_params=state_params(keys, before),
        quiet=quiet_keys(keys, quiet),
        task_decay=decay[0] if decay else None,
    )
    return (("optimizer", form),)


def replicas_form(record: StepRecord, snapshots, after) -> tuple[tuple[str, Form], ...]:
    """``(("replicas", Form),)``: the form of the copies of each mismatched leaf (``record.replica_mismatches``)
    against the reference (:func:`~shardcheck.parity.diagnosis.replica_form.fit_replicas`: the candidate's
    copies after the step, its value before it, the reference's after it), or ``()`` where no leaf has copies to
    read (one process's devices hold none of them twice)."""
    _, cand_params0, _, cand_state0 = snapshots
    sides = {
        "param": (after.cand_params, cand_params0, after.ref_params),
        "opt_state": (after.cand_state, cand_state0, after.ref_state),
    }
    leaves = {}
    for name in record.replica_mismatches:
        kind, _, path = name.partition(" ")
        cand, before, ref = sides.get(kind, ({}, {}, {}))
        if path not in cand or path not in before or path not in ref or is_int(cand[path]):
            continue
        blocks = replica_blocks(cand[path])
        if blocks:
            leaves[name] = (blocks, to_host(before[path]), to_host(ref[path]))
    if not leaves:
        return ()
    grads = [e for e in record.leaves if e.kind == "grad"]
    after_gradients = bool(grads) and all(e.ok for e in record.leaves if e.kind in ("loss", "grad"))
    return (("replicas", fit_replicas(leaves, record.replica_axes, after_gradients)),)


def update_checked(run: _Run, record: StepRecord, snapshots, stepped, after) -> StepRecord:
    """A passing ``record`` with the :func:`update_check` (the optimizer rerun on the candidate's own inputs at the
    optimizer's own rounding) and its form as ``optimizer_rerun`` / ``forms`` where it fails, which fails the
    record; ``record`` unchanged otherwise (the check passes or cannot run)."""
    checked = update_check(run, record.step, snapshots, stepped[3], after, record.skipped)
    run.rerun_inputs = None  # not kept into the next step (its peak per device)
    if checked is None:
        return record
    if all(e.ok for e in checked[0]):
        return dataclasses.replace(record, update_checked=True)
    leaves, (before, rerun, cand) = checked
    record = dataclasses.replace(record, optimizer_rerun=leaves)
    lr = _reference_lr(run)
    quiet = near_zero(stepped[1], record.atol)
    arrays = (before, rerun, cand, lr, quiet, _reference_decay(run))
    return dataclasses.replace(record, forms=optimizer_form(record, arrays))


def localization_evidence(run: _Run, record: StepRecord, snapshots, stepped, after, rtol, atol) -> StepRecord:
    """A failing record with the localization's extra evidence: the optimizer rerun on the candidate's own
    gradients (``optimizer_rerun``) and the form of the first differing stage's failing leaves (``forms``)."""
    cand_grads = stepped[3]
    rerun = optimizer_rerun(run, record.step, snapshots, cand_grads, after, rtol, atol)
    record = dataclasses.replace(record, optimizer_rerun=rerun)
    found = localize([record])
    if found is None or found.stage is None:
        return record
    return dataclasses.replace(record, forms=stage_forms(run, record, snapshots, stepped, after, found.stage))
