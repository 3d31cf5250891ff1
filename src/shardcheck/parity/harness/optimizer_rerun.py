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
import numpy as np
import optax
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state, is_int, leaf_error, to_host
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form, fit_form
from shardcheck.parity.diagnosis.grouping import param_path
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.replica_form import fit_replicas, replica_blocks
from shardcheck.parity.harness.state import _opt_state, _Run
from shardcheck.parity.tolerance.derive import MOMENT_FACTOR


@functools.partial(jax.jit, static_argnums=0)
def _rerun(tx, params, opt_state, grads):
    """``(params, opt_state)`` after one step of ``tx`` on ``grads`` (compiled once per transformation)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _rebuild(like, flat: dict):
    """``like``'s structure holding ``flat``'s leaves by path, or ``None`` where a path is missing."""
    paths = list(flatten_state(like))
    if any(p not in flat for p in paths):
        return None
    return jax.tree.unflatten(jax.tree.structure(like), [flat[p] for p in paths])


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
    if cand_grads is None or run.reference is not None:
        return None
    like_params = nnx.as_pure(nnx.state(run.ref_model, nnx.Param))
    like_state = nnx.as_pure(run.ref_opt.opt_state)
    _, cand_params0, _, cand_state0 = snapshots
    params = _rebuild(like_params, cand_params0)
    state = _rebuild(like_state, cand_state0)
    grads = _rebuild(like_params, flatten_state(nnx.as_pure(cand_grads)))
    if params is None or state is None or grads is None:
        return None
    try:
        new_params, new_state = _rerun(run.ref_opt.tx, params, state, grads)
    except (TypeError, ValueError):  # a transformation needing more than (grads, state, params): not observed
        return None
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


def known_lr(opt_state) -> float | None:
    """The learning rate an ``optax.inject_hyperparams`` state holds (``hyperparams["learning_rate"]``: after a
    step, the one that step applied), else ``None``. A schedule's own state (``hyperparams_states``, its count)
    is not a learning rate."""
    found = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if any(getattr(k, "key", None) in ("learning_rate", "lr") for k in path)
        and not any(getattr(k, "key", getattr(k, "name", None)) == "hyperparams_states" for k in path)
    ]
    if len(found) != 1:
        return None
    value = float(np.asarray(to_host(found[0])).reshape(-1)[0])
    return value if math.isfinite(value) and value > 0 else None


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
    lr = known_lr(nnx.as_pure(_opt_state(run.ref_opt)))
    form = fit_form(
        {p: to_host(before[p]) for p in bad if p in before},
        {p: to_host(ref[p]) for p in bad},
        {p: to_host(cand[p]) for p in bad},
        lr=lr,
        optimizer_stage=stage == "optimizer",
        update=stage != "gradients",
        tol=leaf_tolerances(record.leaves),
        state_params=state_params(bad, ref_params0),
        params={p: to_host(ref_params0[p]) for p in bad if p in ref_params0}
        if stage == "gradients"
        else None,
        quiet=quiet_keys(bad, near_zero(ref_grads, record.atol)) if stage != "gradients" else None,
    )
    return ((stage, form),)


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
