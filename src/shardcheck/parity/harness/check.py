"""The parity harness: run a task's reference step and a candidate step side by side and compare every leaf.

Seed ``001_a85d1499a1a85057.txt``: "with equivalent initial parameters, loss normalization and optimizer settings,
a correctly synchronized sharded step should reproduce the intended baseline update within numerical tolerance.
Matching a single loss value alone does not verify that update". :func:`check_parity` runs the task's
single-device step (:func:`~shardcheck.steps.reference.reference_step`) and a candidate step from copies of one
model and optimizer over the task's batches, and records for every step the error of the loss, of every gradient
leaf (where the candidate exposes them), of every updated parameter, of every optimizer-state leaf and of the
step counters. When parity fails, :mod:`shardcheck.parity.diagnosis.rules` says why.

Tolerance (:func:`~shardcheck.parity.tolerance.derive.derive_tolerance`, ``docs/parity.md``)::

    rtol_t = 16 * eps * sqrt(n) * sqrt(t + 1)      atol_t = eps * sqrt(n) * sqrt(t + 1)
    leaf passes at step t  <=>  |cand - ref| <= atol_t + rtol_t * max|ref| + allowance      (moments: x2)

with ``n`` the task's reduction length (:meth:`Task.terms`). ``allowance`` is the update's sensitivity to the
gradient's own tolerance, propagated through the optimizer (``tx.update`` at ``g +- delta``) and summed over the
steps: negligible for SGD and for Adam on ordinary leaves, about ``lr`` for a leaf whose true gradient is 0 under
a normalizing optimizer (the gradient is rounding noise, and Adam turns noise into lr-sized steps). Such leaves
are reported (``rounding_level``) and remain checked through their gradients and optimizer state. A step is
compared against a lower bound of the allowance first, where its verdict may not need the exact one; the
sensitivity pass runs when a step needs it (:mod:`shardcheck.parity.tolerance.allowances`, ``docs/parity.md``).

This module is the step loop and each step's comparison; the run's admission and setup are
:mod:`shardcheck.parity.harness.setup`, its state :mod:`shardcheck.parity.harness.state`, the tolerance bookkeeping
:mod:`shardcheck.parity.tolerance.allowances` (per-leaf overrides: :mod:`shardcheck.parity.tolerance.overrides`), the hypothesis
reruns that explain a failure :mod:`shardcheck.parity.diagnosis.hypotheses` and the gradient-scale evidence
:mod:`shardcheck.parity.diagnosis.scale_evidence`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck._catalog import REFERENCE
from shardcheck.datasets import minibatch_indices
from shardcheck.parity.comparison import first_pass
from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import (
    LeafInput,
    counter_error,
    device_snapshots,
    flatten_state,
    is_int,
    leaf_error,
    leaf_errors,
    replica_mismatches,
    replicated_leaves,
    to_host,
)
from shardcheck.parity.comparison.model_state import (
    PREFIX,
    floating_arrays,
    floating_state,
    loss_access,
    loss_counters,
    model_state,
    model_state_leaves,
)
from shardcheck.parity.comparison.rng_counts import moved_count_leaves, rng_count_leaves
from shardcheck.parity.diagnosis.batch_stats import with_batch_stats
from shardcheck.parity.diagnosis.draws import with_count_readings, with_draws
from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord, batch_keys
from shardcheck.parity.diagnosis.hypotheses import _explained
from shardcheck.parity.diagnosis.later import with_later_non_finite
from shardcheck.parity.diagnosis.localization import consistent, localize
from shardcheck.parity.diagnosis.replica_form import copy_scales
from shardcheck.parity.diagnosis.resummed import with_program
from shardcheck.parity.diagnosis.rules import diagnose
from shardcheck.parity.diagnosis.scale_evidence import (
    _scale_evidence,
    scale_evidence_text,
    scale_shown,
    unresolvable,
)
from shardcheck.parity.diagnosis.shard_subset import with_shard_subset
from shardcheck.parity.diagnosis.skipped import with_skipped
from shardcheck.parity.diagnosis.topology import mismatch_axes
from shardcheck.parity.harness.candidates import run_step, step_jaxpr, unpack
from shardcheck.parity.harness.footprint import Footprint, allocator_peak_bytes, state_bytes
from shardcheck.parity.harness.leaf_facts import leaf_facts
from shardcheck.parity.harness.module_probe import module_evidence
from shardcheck.parity.harness.optimizer_rerun import localization_evidence, update_checked, verifies_update
from shardcheck.parity.harness.reference_trajectory import trajectory_for
from shardcheck.parity.harness.replay import against_recording, is_recording
from shardcheck.parity.harness.row_coupling import refuse_late_coupling
from shardcheck.parity.harness.setup import FULL_BATCH_FORWARD, _setup, check_options
from shardcheck.parity.harness.state import StepFn, _After, _kept_state, _PreStep, _Run, stepped_in_place
from shardcheck.parity.harness.state_reset import ignores_optimizer_state
from shardcheck.parity.report import CandidateError, ParityError, ParityReport
from shardcheck.parity.tolerance import allowances, matmul, recheck
from shardcheck.parity.tolerance.allowances import (
    Undecided,
    _param_dtype,
    _precision_rule,
    _reference_grads,
    _state_allowances,
    split_gradients,
    step_bounds,
)
from shardcheck.parity.tolerance.allowances import storage_rounding as storage_rounding
from shardcheck.parity.tolerance.derive import LOW_PRECISION_UPDATE_ULPS, MOMENT_FACTOR, derive_tolerance
from shardcheck.parity.tolerance.precision import ACCUMULATION_DTYPE, loss_compute_allowance
from shardcheck.steps import Candidate
from shardcheck.steps.reference import _reference_jit, reference_step
from shardcheck.task import Task
from shardcheck.task import check_model as check_model

FIRST_PASS = True
"""Whether a step's leaves go through the cheap first pass (:mod:`shardcheck.parity.comparison.first_pass`) before the full
comparison; ``False`` compares every leaf in full (the tests check that both give the same verdicts)."""


def _reference_finite(record: StepRecord, after: _After) -> bool:
    """The reference's loss (when it returned one) and its parameters and optimizer state after the step are finite
    (checked on their devices); a step its optimizer skipped (``StepRecord.skipped``: ``optax.apply_if_finite``, a
    loss-scale check) is no divergence, its loss and gradients compared by finiteness."""
    returned = any(e.kind == "loss" for e in record.leaves)
    lost = math.isinf(record.loss) or (math.isnan(record.loss) and returned)
    if lost and not record.skipped:
        return False
    return compare.all_finite([*after.ref_params.values(), *after.ref_state.values()])


def _returned(ref_loss, ref_grads) -> list:
    """The reference's loss (where it returned one) and its floating gradient leaves."""
    grads = {} if ref_grads is None else flatten_state(ref_grads)
    return [g for g in grads.values() if not is_int(g)] + ([] if ref_loss is None else [ref_loss])


def _skipped_step(ref_loss, ref_grads, before: dict, after: _After) -> bool:
    """Whether the reference's step is one its optimizer skipped (``StepRecord.skipped``): its loss (where it
    returned one) or a gradient leaf not finite, while its parameters after the step are exactly ``before``'s
    (its parameters before the step) and its optimizer state is finite (``optax.apply_if_finite`` left them, or
    a loss-scale check did). A loss that overflows while the parameters move (a learning rate too high) is a
    divergence, not a skipped step."""
    if compare.all_finite(_returned(ref_loss, ref_grads)):
        return False
    return compare.equal(before, after.ref_params) and compare.all_finite(list(after.ref_state.values()))


def _finite_or_skipped(ref_loss, ref_grads, before: dict, after: _After) -> tuple[bool, bool]:
    """``(finite, skipped)``: whether the reference's returned loss and gradients and its state after the step are
    all finite (one device reduction, the common case: then no step was skipped), and whether its step is one
    its optimizer skipped (:func:`_skipped_step`, read only where something is not finite)."""
    finite = compare.all_finite(
        [*_returned(ref_loss, ref_grads), *after.ref_params.values(), *after.ref_state.values()]
    )
    return finite, not finite and _skipped_step(ref_loss, ref_grads, before, after)


def _by_finiteness(t: int, loss_leaves: list, grad_leaves: list, ref_loss, cand_loss) -> tuple[list, list]:
    """A skipped step's loss and gradient leaves (``StepRecord.skipped``): each leaf not finite on either side
    compared by finiteness alone (``LeafError.finite``: both not finite matches; one side only fails, with
    ``max_abs_err`` inf); a leaf finite on both sides by value as always, without an allowance that is not
    finite (its sensitivity read from gradients that are not)."""
    out_loss = []
    for e in loss_leaves:  # the loss's error, decided already: both sides' values are floats
        sides = tuple(math.isfinite(float(to_host(x))) for x in (ref_loss, cand_loss))
        out_loss.append(e if all(sides) else _finiteness(t, "loss", "loss", sides, ()))
    both = {f"{i} {side}": getattr(x, side) for i, x in enumerate(grad_leaves) for side in ("ref", "cand")}
    tops = compare.max_abs(both)  # NaN or inf where the leaf holds one
    out_grads = []
    for i, x in enumerate(grad_leaves):
        sides = (math.isfinite(tops[f"{i} ref"]), math.isfinite(tops[f"{i} cand"]))
        if not all(sides):
            out_grads.append(_finiteness(t, "grad", x.path, sides, tuple(x.ref.shape)))
        elif x.allowance is not None and not compare.all_finite([x.allowance]):
            out_grads.append(x._replace(allowance=None))
        else:
            out_grads.append(x)
    return out_loss, out_grads


def _finiteness(t: int, kind: str, path: str, sides: tuple[bool, bool], shape: tuple) -> LeafError:
    """The :class:`LeafError` of a leaf compared by finiteness (``sides``: the reference's and the candidate's,
    whether every element is finite): ``ok`` where both are not finite (error 0), else a FAIL of error inf."""
    ok = sides[0] == sides[1]
    err = 0.0 if ok else math.inf
    return LeafError(t, kind, path, err, err, 0.0, ok, shape=shape, finite=(bool(sides[0]), bool(sides[1])))


def _step_reference(run: _Run, t: int, batch, rtol: float, atol: float):
    """Step the reference: the task's single-device step, or the run's reference strategy on the candidate's mesh
    (``run.ref_strategy``), or a user's step (no bounds); or take step ``t`` from the task's shared trajectory
    (:mod:`.reference_trajectory`). Returns ``(loss, grads, pre-step state, _Bounds or None)``."""
    pre = _PreStep.of(run.ref_model, run.ref_opt, run)
    if run.reference is not None:
        return _step_user_reference(run, pre, batch, rtol, atol)
    stored = None if run.shared is None else run.shared.get(t, rtol, atol)
    if stored is not None:
        loss, grads, bounds, after = stored
        nnx.update((run.ref_model, run.ref_opt), after)
        return loss, grads, pre, bounds
    split = split_gradients(run, pre, batch)  # before the step, from the pre-step state
    if run.ref_strategy is None and run.in_place:  # its Variables found once, no graph traversal a step
        pair = (run.ref_model, run.ref_opt)
        result = stepped_in_place(run, "ref_step", _reference_jit, (run.task.loss_fn,), *pair, batch)
    elif run.ref_strategy is None:
        result = reference_step(run.task.loss_fn, run.ref_model, run.ref_opt, batch)
    else:  # a mesh strategy on the candidate's mesh; the sensitivity and hypotheses read its state as above
        result = run.ref_strategy.step(run.ref_model, run.ref_opt, batch)
    bounds = step_bounds(run, pre, batch, nnx.as_pure(result.grads), split, rtol, atol)
    if run.shared is not None:
        # its arrays, not its Variables: the run goes on stepping the reference in place
        after = nnx.as_pure(nnx.state((run.ref_model, run.ref_opt)))
        run.shared.put(t, rtol, atol, (result.loss, result.grads, bounds, after))
    return result.loss, result.grads, pre, bounds


def _step_user_reference(run: _Run, pre, batch, rtol: float, atol: float):
    """A user's reference step (``reference=``): ``(loss, grads, pre, bounds)``. At low-precision compute the
    tolerances are measured as the task's step's are (:func:`step_bounds` from a correct split of the task's loss
    at the same pre-step state ``pre``), about the gradients it returns, or, where it returns its loss only, the
    task's loss's gradient at ``pre`` (what its own gradient is, the task's loss being the one both steps
    minimize): without them a correct bfloat16 step failed at float32's tolerance (trial 39: 'grad l2.bias
    0.000389 > tolerance 2.74e-06', where the task's own reference measured 0.00165). At float32 compute no
    bounds (the tolerances from ``rtol``/``atol``, as before)."""
    low = run.precision.compute_eps > 0
    split = split_gradients(run, pre, batch) if low else None  # before the step, from the pre-step state
    loss, grads = unpack(run.reference(run.ref_model, run.ref_opt, batch), "the reference step")
    if not low:
        return loss, grads, pre, None
    about = _reference_grads(run.task.loss_fn, pre, batch) if grads is None else grads
    return loss, grads, pre, step_bounds(run, pre, batch, nnx.as_pure(about), split, rtol, atol)


def _step_candidate(run: _Run, t: int, batch):
    """The candidate's step ``t`` in place: ``(loss, grads)`` (:func:`run_step`, which a recorded run shares); a
    registered strategy with a ``program``, where the run steps in place, on its Variables found once."""
    step = None
    if run.in_place and run.cand.program is not None and not run.kwargs:
        step = functools.partial(stepped_in_place, run, "cand_step", *run.cand.program)
    return run_step("check_parity", run.cand, run.cand_model, run.cand_opt, batch, run.kwargs, t, step)


def _rounding_floor(at_rounding: list, after: _After, ref0: dict, cand0: dict, verifies) -> dict:
    """``{path: floor}``: the least allowance this step adds to a parameter whose gradient is at rounding level
    (``at_rounding``). A normalizing optimizer turns rounding noise into a step sized by each side's own noise
    against its eps (Adam: ``lr * g / (|g| + eps)``, about ``lr`` where ``|g| >> eps``, in proportion to ``g``
    near and below it), so two such updates differ by at most the sum of their sizes, ``max|u_ref| +
    max|u_cand|`` (each side's largest update of the leaf, reduced on its devices); twice the reference's is no
    bound where the candidate's noise is the larger near eps (issue #36: the two sides' updates of a correct dp
    step's key bias differed by 1.49 x twice the reference's largest at one step, tests/test_rounding_floor.py).

    The candidate's own size is taken only where the step gets the update check (``verifies()``, asked only
    where some leaf is at rounding level: :func:`~shardcheck.parity.harness.optimizer_rerun.verifies_update`):
    that check fails a passing step whose update is not the task's optimizer's of its own gradients and state, so
    an update a fault inflated widens its own allowance only on a step that then fails; it needs the step's
    gradients, which are compared too, so a candidate whose own gradient left rounding level (a trajectory split
    at a kink, tests/kinked.py) fails that comparison rather than widening its floor. Elsewhere it is ``2
    max|u_ref|``, as before. The floor decides the lower-bound pass (``allowances.lower_bound``: a trial's own
    sensitivity is 0) and the allowance a passing trial reports (the trial's 0.000232 of 0.000234 allowed); the
    exact pass also adds the update's sensitivity to the gradient's tolerance, which covered every correct step
    measured under either floor."""
    if not at_rounding:
        return {}
    verified = verifies()
    sides = {p: after.ref_params[p] for p in at_rounding}
    before = {p: ref0[p] for p in at_rounding}
    if verified:
        sides |= {"cand " + p: after.cand_params[p] for p in at_rounding}
        before |= {"cand " + p: cand0[p] for p in at_rounding}
    moved = compare.max_abs_diff(sides, before)
    return {p: moved[p] + (moved["cand " + p] if verified else moved[p]) for p in at_rounding}


def _compare_params(
    run: _Run, t, ref0, cand0, rtol, atol, bounds, after: _After, lower: bool, verifies
) -> tuple[list, list, list, list]:
    """Param leaf errors (tolerance widened by the accumulated sensitivity and, for low-precision parameters,
    one rounding per step), replica mismatches, the leaves whose update the allowance leaves unresolved, and every
    leaf whose gradient is at rounding level (``"param PATH"``). ``verifies()``: whether the step gets the update
    check (:func:`_rounding_floor`).

    Raises:
        Undecided: against the lower bound (``lower``), a leaf at rounding level that the bound resolves (the
            exact allowance may not).
    """
    leaves, unresolved = [], []
    ref_params, cand_params = after.ref_params, after.cand_params
    tracked = (
        [] if bounds is None else [p for p in ref_params if p in bounds.update_paths and p in cand_params]
    )
    # the per-leaf scalars the rules below read, each reduced on the device over every leaf at once
    eps = run.precision.param_eps
    scale = compare.max_abs({p: ref_params[p] for p in tracked}) if eps else {}
    # the compute rounding alone (allowances._Bounds.rounding): the drift of a diverged candidate's parameters
    # widens the gradient's allowance, not the rounding noise of its true gradient
    noise = compare.max_abs({p: bounds.rounding[p] for p in tracked if p in bounds.rounding})
    # at rounding level: the gradient is within its own tolerance of 0, and the update it drives is not
    # resolvable at the parameter's tolerance
    at_rounding = [p for p in tracked if bounds.grad_max[p] <= atol + noise.get(p, 0.0)]
    floor = _rounding_floor(at_rounding, after, ref0, cand0, verifies)
    rounding = {p: eps * scale[p] if eps else 0.0 for p in tracked}
    if eps:  # the update computed in the parameters' precision: its own rounding, on each side
        change = compare.max_abs_diff({p: ref_params[p] for p in tracked}, {p: ref0[p] for p in tracked})
        rounding = {p: r + LOW_PRECISION_UPDATE_ULPS * eps * change[p] for p, r in rounding.items()}
    if tracked:
        allowances.accumulate(run, "param", bounds, tracked, floor, rounding)
    for path, ref_leaf in ref_params.items():
        if path not in cand_params:
            leaves.append(_missing(t, "param", path, ref_leaf))
            continue
        allowance = run.allowance[path] if path in tracked else None
        r_tol, a_tol = run.tol("param", path, rtol, atol)
        c = cand_params[path]
        leaves.append(
            LeafInput(t, "param", path, ref_leaf, c, r_tol, a_tol, ref0[path], cand0[path], allowance)
        )
    if at_rounding:
        widest = compare.max_abs({p: run.allowance[p] for p in at_rounding})
        size = compare.max_abs({p: ref_params[p] for p in at_rounding})
        unresolved = [f"param {p}" for p in at_rounding if widest[p] > atol + rtol * size[p]]
        if lower and len(unresolved) < len(at_rounding):  # a wider allowance can only leave more unresolved
            raise Undecided
    differ = replica_mismatches(cand_params)
    mismatches = [f"param {p}" for p in ref_params if p in differ]
    return leaves, mismatches, unresolved, [f"param {p}" for p in at_rounding]


def _compare_opt_state(run: _Run, t, ref0, cand0, rtol, atol, bounds, after: _After) -> tuple[list, list]:
    leaves, mismatches = [], []
    cand_state, ref_state = after.cand_state, after.ref_state
    _state_allowances(run, {p: r for p, r in ref_state.items() if p in cand_state}, bounds)
    for path, ref_leaf in ref_state.items():
        if path not in cand_state:
            leaves.append(_missing(t, "opt_state", path, ref_leaf))
            continue
        r, c = ref_leaf, cand_state[path]
        if np.dtype(r.dtype).kind in "iub":
            leaves.append(counter_error(t, path, r, c))
        else:
            before = cand0[path] if path in cand0 else jnp.zeros_like(r)  # no eager op per leaf
            tracked = bounds is not None and path in bounds.state_paths
            allowance = run.state_allowance.get(path) if tracked else None
            r_tol, a_tol = run.tol("opt_state", path, MOMENT_FACTOR * rtol, MOMENT_FACTOR * atol)
            leaves.append(LeafInput(t, "opt_state", path, r, c, r_tol, a_tol, ref0[path], before, allowance))
    # the candidate's leaves the reference lacks (a multi_transform whose labels differ keeps its state for
    # other leaves: trial 11), each said as in one run only, as a replay says it
    leaves += [_missing(t, "opt_state", p, c) for p, c in cand_state.items() if p not in ref_state]
    differ = replica_mismatches(cand_state)
    mismatches = [f"opt_state {p}" for p in ref_state if p in differ]
    return leaves, mismatches


def _missing(t: int, kind: str, path: str, leaf) -> LeafError:
    """A leaf that one side holds and the other lacks (``LeafError.missing``): a FAIL with an infinite error,
    said as missing, never as not finite."""
    return LeafError(t, kind, path, math.inf, math.inf, 0.0, False, shape=tuple(leaf.shape), missing=True)


def _extra_checks(run: _Run, t, completed, rtol, atol) -> list:
    if run.cand.extra_checks is None:
        return []
    out = []
    for path, value, expected in run.cand.extra_checks(run.cand_opt, completed):
        if is_int(value):
            out.append(counter_error(t, path, expected, value))
        else:
            out.append(leaf_error(t, "opt_state", path, to_host(expected), to_host(value), rtol, atol))
    return out


def _compare_step(
    run: _Run,
    t: int,
    batch,
    rtol: float,
    atol: float,
    *,
    completed=None,
    synced=False,
    explain=True,
    check_scale=True,
) -> tuple[StepRecord, bool]:
    """Snapshot both sides, step both on one batch, compare every leaf; returns the record and whether the
    reference stayed finite (:func:`_reference_finite`).

    ``completed``: the candidate's full steps after this one (for ``extra_checks``; default ``t + 1``; 1 for a
    candidate started from the reference's state). ``explain``: on failure, look for the faulty reduction the
    candidate reproduces (:func:`_explained`; the step loop defers it where a re-check may clear the failure).
    ``check_scale``: whether to ask which compared leaves would show a gradient off by S or 1/S
    (:func:`_scale_evidence`; the step loop stops once the steps have shown both, which the verdict needs only
    once).
    """
    snapshots = _snapshots(run)
    _floating_before(run)
    ref_loss, ref_grads, pre, bounds = _step_reference(run, t, batch, rtol, atol)
    _measure(run)
    cand_loss, cand_grads = _step_candidate(run, t, batch)
    after = _After.of(run)
    _measure(run, after)
    finite, skipped = _finite_or_skipped(ref_loss, ref_grads, snapshots[0], after)
    stepped = (ref_loss, ref_grads, cand_loss, cand_grads, bounds)
    completed = t + 1 if completed is None else completed
    args = (run, t, rtol, atol, batch, stepped, snapshots, after, completed, skipped)
    compared = _against_the_bound_first(args, bounds, exact=t == 0 or check_scale or skipped)
    leaves, ref_loss_f, cand_loss_f, compared_grads, mismatches, unresolved, ref_count, rounding = compared
    evidence, blind = None, False
    if check_scale and not skipped:
        evidence, blind = _scale_evidence(run, pre, batch, rtol, atol, bounds, after, compared_grads, leaves)
    _measure(run)  # after the comparison (what it returned; what it held inside its calls is gone)
    record = StepRecord(
        step=t,
        rtol=rtol,
        atol=atol,
        loss=ref_loss_f,
        candidate_loss=cand_loss_f,
        leaves=tuple(leaves),
        step_count=ref_count,
        candidate_step_count=int(np.asarray(after.cand_count)),
        replica_mismatches=tuple(mismatches),
        replicas_compared=_replicas_compared(after),
        synchronized=synced,
        unresolved=tuple(unresolved),
        rounding_level=tuple(rounding),
        normalized=_normalized(run, unresolved),
        scale_hidden=evidence is not None and not all(evidence),
        scale_evidence=evidence,
        scale_blind=blind,
        skipped=skipped,
        batch_keys=batch_keys(batch),
    )
    if not record.ok:
        record = _failing_record(run, record, after, cand_grads)
        if explain:
            record = _explained(run, pre, batch, record, rtol, atol, cand_grads)
            record = localization_evidence(run, record, snapshots, stepped, after, rtol, atol)
            record = module_evidence(run, record, snapshots, batch)  # a forward-stage FAIL only
    else:  # within its tolerances: the update from its own inputs, at the optimizer's own rounding
        record = update_checked(run, record, snapshots, stepped, after)
    run.last = after
    return record, (finite and not math.isinf(record.loss)) or _reference_finite(record, after)


def _normalized(run: _Run, unresolved: list[str]) -> tuple[str, ...]:
    """The ``unresolved`` parameters (``"param PATH"``) whose update the task's optimizer normalizes
    (``StepRecord.normalized``: :func:`~shardcheck.parity.harness.recorded.normalized_params`, probed only where
    some leaf is unresolved, once per check: ``run.normalized``)."""
    if not unresolved:
        return ()
    if run.normalized is None:
        from shardcheck.parity.harness.recorded import normalized_params

        run.normalized = frozenset(normalized_params(run.task, run.ref_model))
    return tuple(n for n in unresolved if n.removeprefix("param ") in run.normalized)


def _floating_before(run: _Run) -> None:
    """Both sides' floating non-parameter state before a step (``run.state_before``), and once per check which
    of it the task's loss reads and writes (``run.state_read``, ``run.state_written``: ``model_state.loss_access``);
    nothing for a model without. The same of its integer state: the reference's before the step
    (``run.counters_before``, with the counters the loss reads or writes, ``run.counters_touched``:
    ``model_state.loss_counters``, once per check)."""
    found = run.found if run.in_place else None
    ref = floating_state(run.ref_model, found, "floating_state ref")
    run.state_before = (ref, floating_state(run.cand_model, found, "floating_state cand") if ref else None)
    if ref and run.state_read is None:
        reads, writes = loss_access(run.task.loss_fn, run.ref_model, run.task.batches[0])
        run.state_read = frozenset(ref) if reads is None else reads
        run.state_written = None if writes is None else frozenset(PREFIX + p for p in writes)
    counters = model_state(run.ref_model, found, "model_state ref")
    if counters and run.counters_touched is None:
        touched = loss_counters(run.task.loss_fn, run.ref_model, run.task.batches[0])
        run.counters_touched = frozenset(counters) if touched is None else touched
    run.counters_before = (
        ({p: np.asarray(to_host(a)) for p, a in counters.items()}, run.counters_touched) if counters else None
    )


def _failing_record(run: _Run, record: StepRecord, after: _After, cand_grads) -> StepRecord:
    """A failing ``record`` with its replica evidence (:func:`_with_replicas`) and the model's floating state the
    task's loss writes (``StepRecord.forward_writes``: state the reference's step writes otherwise is the
    step's own, not the forward pass's), and the counters it reads or writes (``StepRecord.loss_counters``)."""
    record = _with_replicas(record, after, cand_grads)
    touched = run.counters_touched
    drawn = frozenset(f"{PREFIX}{d}.count" for d in run.draws)  # the streams the loss draws from: its counts
    counters = None if touched is None else frozenset(PREFIX + p for p in touched) | drawn
    from shardcheck.parity.harness.optimizer_rerun import schedule_at_micro_steps

    micro_step_lr = schedule_at_micro_steps(run.task.optimizer, after.ref_params, after.ref_state)
    return dataclasses.replace(
        record, forward_writes=run.state_written, loss_counters=counters, micro_step_lr=micro_step_lr
    )


def _against_the_bound_first(args: tuple, bounds, exact: bool):
    """:func:`_compare_leaves` of ``args`` (the step's ``bounds`` among them) against the lower bound of the
    allowances first, where the verdict may not need the exact ones (``exact``: it does;
    ``allowances.lower_bound``); with the exact allowances where the bound does not decide the step, after the
    deferred passes are settled."""
    run = args[0]
    tried = allowances.lower_bound(run, bounds, exact)
    if tried:
        try:
            compared = _compare_leaves(*args, True)
            allowances.keep(run)
            run.rerun_inputs = None  # the update check's inputs, kept within the comparison: not in the peak
            return compared
        except Undecided:
            pass
    allowances.settle(run)
    compared = _compare_leaves(*args, False)
    if tried and all(e.ok for e in compared[0]) and not compared[4]:
        allowances.fell_short(run)  # the bound did not clear a step that passes
    run.rerun_inputs = None
    return compared


def _compare_leaves(
    run: _Run, t, rtol, atol, batch, stepped, snapshots, after: _After, completed, skipped: bool, lower: bool
):
    """Every leaf of a stepped pair compared, ``(leaves, reference loss, candidate loss, compared reference
    gradients, replica mismatches, unresolved leaves, the reference's step count, the leaves at rounding level)``;
    each float leaf through the first pass and, where it cannot clear it, the full comparison (:func:`_two_pass`).

    ``stepped``: ``(reference loss, reference grads, candidate loss, candidate grads, bounds)``; ``snapshots``:
    :func:`_snapshots` before the step; ``completed``: the candidate's full steps (``extra_checks``); ``skipped``:
    a step the reference's optimizer skipped, its loss and gradients compared by finiteness (:func:`_by_finiteness`).

    Raises:
        Undecided: against the lower bound of the allowances (``lower``), a step it does not clear whole.
    """
    ref_loss, ref_grads, cand_loss, cand_grads, bounds = stepped
    ref_params0, cand_params0, ref_opt0, cand_opt0 = snapshots
    leaves, ref_loss_f, cand_loss_f = _loss_leaves(run, t, batch, ref_loss, cand_loss, bounds, rtol, atol)
    grad_leaves, compared_grads = _grad_inputs(run, t, ref_grads, cand_grads, bounds, rtol, atol)
    if skipped:
        leaves, grad_leaves = _by_finiteness(t, leaves, grad_leaves, ref_loss, cand_loss)
    leaves += grad_leaves
    verifies = functools.partial(verifies_update, run, t, snapshots, cand_grads, after)
    params, mismatches, unresolved, rounding = _compare_params(
        run, t, ref_params0, cand_params0, rtol, atol, bounds, after, lower, verifies
    )
    opt_leaves, opt_mismatches = _compare_opt_state(run, t, ref_opt0, cand_opt0, rtol, atol, bounds, after)
    ref_count = int(np.asarray(run.ref_opt.step[...]))
    leaves += params + opt_leaves
    leaves.append(counter_error(t, "step", ref_count, after.cand_count))
    # the model's state beside its parameters (its Variables found once where the steps update in place)
    found = run.found if run.in_place else None
    before = run.state_before
    leaves += model_state_leaves(
        t, run.ref_model, run.cand_model, found, *before, read=run.state_read, counters=run.counters_before
    )
    if before[
        0
    ]:  # its copies agree across devices too, compared or not (trial 23: an EMA written per device)
        state = floating_arrays(run.cand_model, found, "floating_state cand")
        differ = replica_mismatches(state)
        mismatches += [f"state {PREFIX}{p}" for p in state if p in differ]
    leaves += _extra_checks(run, t, completed, rtol, atol)
    leaves += rng_count_leaves(t, run.ref_model, run.cand_model, run.draws)  # the streams drawn from
    leaves += moved_count_leaves(t, run.ref_model, run.cand_model, run.undrawn)  # the others, where moved
    # every float leaf of the step: the first pass clears what it can, the second pass decides the rest
    decided = [e for e in leaves if not isinstance(e, LeafInput)]
    full = t == 0 or skipped or not all(e.ok for e in decided) or bool(mismatches or opt_mismatches)
    if lower and full:
        raise Undecided
    inputs = [e for e in leaves if isinstance(e, LeafInput)]
    compared = iter(_update_seen(inputs, _two_pass(inputs, full, lower), lower))
    leaves = [next(compared) if isinstance(e, LeafInput) else e for e in leaves]
    mismatches += opt_mismatches
    return leaves, ref_loss_f, cand_loss_f, compared_grads, mismatches, unresolved, ref_count, rounding


def _measure(run: _Run, after: _After | None = None) -> None:
    """One sample of what the devices hold (``run.footprint``: a check on the candidate's mesh only); with
    ``after``, both sides' own states per device too (:mod:`shardcheck.parity.harness.footprint`)."""
    if run.footprint is None:
        return
    run.footprint.sample()
    if after is not None:
        own = (
            state_bytes([after.ref_params, after.ref_state]),
            state_bytes([after.cand_params, after.cand_state]),
        )
        run.footprint.state = max(run.footprint.state, *own)


def _two_pass(inputs: list, full: bool, lower: bool = False) -> list:
    """The :class:`LeafError` of every input: cleared by the first pass (:func:`first_pass.clear`) where it can
    prove the leaf within tolerance, else by the full comparison (:func:`compare.leaf_errors`).

    Every leaf gets the full comparison when ``full`` (step 0, whose update ratios and tolerances the report and
    ``weak_update`` read; a step that a counter, an extra check or a replica already failed) or when one of the
    leaves fails (the rules read every leaf's update ratio). So every verdict and diagnosis is the full
    comparison's.

    Raises:
        Undecided: ``lower`` (the allowances are a lower bound) and a leaf that the first pass cannot clear, or
            that fails: the exact allowances decide.
    """
    if full or not FIRST_PASS:
        out = leaf_errors(inputs)
    else:
        out = first_pass.clear(inputs)
        undecided = [i for i, e in enumerate(out) if e is None]
        if lower and undecided:
            raise Undecided
        cleared = [i for i, e in enumerate(out) if e is not None]
        _fill(out, inputs, undecided)
        if not all(e.ok for e in out):
            _fill(out, inputs, cleared)
    if lower and not all(e.ok for e in out):
        raise Undecided
    return out


def _update_seen(inputs: list, out: list, lower: bool) -> list:
    """``out`` (the :class:`LeafError` of each input) with ``update_seen`` set on every ``param`` leaf compared
    under an elementwise allowance: whether some element's reference update exceeds that element's tolerance
    (``compare.exceeds`` of ``r_t - r_{t-1}``, one reduction for them all), so that a wrong update of the leaf
    fails. The leaf's ``tolerance`` is one element's, and an element whose gradient is at rounding level has an
    allowance of ~2 lr under Adam: its update is no measure of the others' (trial 19). Only where every input
    passes (``weak_update`` reads passing reports) and the allowances are exact (not ``lower``)."""
    if lower or not all(e.ok for e in out):
        return out
    which = [
        i
        for i, x in enumerate(inputs)
        if x.kind == "param" and x.allowance is not None and out[i].reference_change is not None
    ]
    if not which:
        return out
    items = {inputs[i].path: inputs[i] for i in which}
    seen = compare.exceeds(
        {p: x.ref for p, x in items.items()},
        {p: x.ref for p, x in items.items()},
        {p: (x.rtol, x.atol) for p, x in items.items()},
        {p: x.allowance for p, x in items.items()},
        before={p: x.before_ref for p, x in items.items()},
    )
    out = list(out)
    for i in which:
        out[i] = dataclasses.replace(out[i], update_seen=seen[inputs[i].path])
    return out


def _fill(out: list, inputs: list, which: list[int]) -> None:
    """``out[i]`` = the full comparison of ``inputs[i]`` for every ``i`` of ``which`` (one call)."""
    for i, e in zip(which, leaf_errors([inputs[i] for i in which]), strict=True):
        out[i] = e


def _snapshots(run: _Run) -> tuple[dict, dict, dict, dict]:
    """Both sides' state before a step: the reference's and the candidate's parameters, then their optimizer
    states (the candidate's view of its optimizer). The candidate's are copied on their devices (its step may
    donate them), unless it declares that it does not (``Candidate.donates``: the accumulation step, whose new
    state is new arrays); the reference's are its arrays as they are, unless a user's step is the reference: the task's
    step and a reference strategy (``donate=False``) leave them intact, and the run keeps them anyway (the
    pre-step state of the sensitivity, the hypotheses and a re-check), so a copy would hold them twice."""
    # the state after this run's last step is the state before this one: nothing steps the models in between
    last = run.last if run.last is not None else _After.of(run)
    once = run.last is None  # before the first step: a runtime copy (no program for a placement seen once)
    if run.reference is not None:  # every tree copied in one call (one program)
        return device_snapshots(last.ref_params, last.cand_params, last.ref_state, last.cand_state, once=once)
    if not run.cand.donates:  # its step leaves them intact too (the accumulation step: ~1.5 ms a step, #35)
        return dict(last.ref_params), dict(last.cand_params), dict(last.ref_state), dict(last.cand_state)
    cand_params, cand_state = device_snapshots(last.cand_params, last.cand_state, once=once)
    return dict(last.ref_params), cand_params, dict(last.ref_state), cand_state


def _loss_leaves(
    run: _Run, t, batch, ref_loss, cand_loss, bounds, rtol, atol
) -> tuple[list, float, float | None]:
    """``(leaves, reference loss, candidate loss)``: the loss's error (no leaf unless both sides returned a
    loss), the reference's loss as a float (NaN when it returned none) and the candidate's (``None`` then)."""
    ref_loss_f = float(np.asarray(ref_loss)) if ref_loss is not None else math.nan
    cand_loss_f = None if cand_loss is None else float(to_host(cand_loss))
    if ref_loss is None or cand_loss is None:
        return [], ref_loss_f, cand_loss_f
    # the parameters' accumulated allowance moves the loss by at most sum |g| * allowance (first order)
    drift = 0.0
    if bounds is not None:
        drift = compare.abs_dot(bounds.grads, {p: a for p, a in run.allowance.items() if p in bounds.grads})
        drift = drift if math.isfinite(drift) else 0.0  # gradients not finite: a skipped step
    measured = () if bounds is None else tuple(float(to_host(r)) for r in bounds.loss_realizations)
    drift += loss_compute_allowance(run.precision, ref_loss_f, run.task.terms(batch), measured)
    r_tol, a_tol = run.tol("loss", "loss", rtol, atol)
    leaf = leaf_error(t, "loss", "loss", ref_loss_f, cand_loss_f, r_tol, a_tol, allowance=drift)
    return [leaf], ref_loss_f, cand_loss_f


def _listed(paths: list[str], most: int = 6) -> str:
    shown = ", ".join(repr(p) for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def check_grad_paths(name: str, t: int, ref_grads: dict, cand_grads: dict) -> None:
    """The candidate's gradients must have the reference's leaves (the model's parameters), path for path.

    Raises:
        CandidateError: leaves missing or extra, named with the fix (no ``__cause__``: the step ran; what it
            returned cannot be compared).
    """
    missing = [p for p in ref_grads if p not in cand_grads]
    extra = [p for p in cand_grads if p not in ref_grads]
    if not missing and not extra:
        return
    parts = [f"missing {_listed(missing)}" if missing else "", f"extra {_listed(extra)}" if extra else ""]
    fix = (
        "return grads with the structure of nnx.state(model, nnx.Param), e.g. nnx.grad(loss)(model) or "
        "jax.grad of a function of nnx.state(model, nnx.Param)"
    )
    raise CandidateError(
        f"check_parity: the candidate step {name!r} returned grads whose structure differs from the model's "
        f"parameters at step {t} ({'; '.join(p for p in parts if p)}; the parameters' leaves are "
        f"{_listed(list(ref_grads))}): {fix}",
        t,
        fix,
    )


def _grad_inputs(run: _Run, t, ref_grads, cand_grads, bounds, rtol, atol) -> tuple[list, dict]:
    """The gradient leaves to compare (``LeafInput``) and the compared reference gradients, ``{path: leaf}``
    (float leaves); both empty unless both sides returned gradients, which must have the same leaves
    (:func:`check_grad_paths`)."""
    if ref_grads is None or cand_grads is None:
        return [], {}
    rg, cg = flatten_state(ref_grads), flatten_state(cand_grads)
    check_grad_paths(run.cand.name, t, rg, cg)
    leaves = []
    for path, ref_leaf in rg.items():
        allowance = None if bounds is None else bounds.grad.get(path)
        r_tol, a_tol = run.tol("grad", path, rtol, atol)
        leaves.append(LeafInput(t, "grad", path, ref_leaf, cg[path], r_tol, a_tol, allowance=allowance))
    return leaves, {p: v for p, v in rg.items() if not is_int(v)}


def _replicas_compared(after: _After) -> tuple[int, int] | None:
    """``StepRecord.replicas_compared``: how many of the candidate's replicated parameters and optimizer-state
    leaves had their copies compared after the step, across how many devices; ``None`` where none had copies."""
    arrays = {f"param {p}": a for p, a in after.cand_params.items()}
    arrays |= {f"opt_state {p}": a for p, a in after.cand_state.items()}
    leaves, devices = replicated_leaves(arrays)
    return (leaves, devices) if leaves else None


def _with_replicas(record: StepRecord, after: _After, cand_grads) -> StepRecord:
    """A failing ``record`` with its replica evidence: the returned gradients' copies where nothing else's differ
    (:func:`_with_gradient_replicas`), the axes the copies differ along (:func:`_replica_axes`) and, where the
    returned gradients' copies are one array times a constant per device, those constants
    (``StepRecord.replica_scales``: a gradient all-reduced, then divided by a quantity of each shard's own)."""
    record = _with_gradient_replicas(record, cand_grads)
    scales = None
    if record.replica_mismatches and cand_grads is not None:
        scales = copy_scales(flatten_state(nnx.as_pure(cand_grads)))
    return dataclasses.replace(
        record,
        replica_axes=_replica_axes(after, record.replica_mismatches, cand_grads),
        replica_scales=scales,
    )


def _with_gradient_replicas(record: StepRecord, cand_grads) -> StepRecord:
    """A failing ``record`` with the candidate's returned gradients whose copies differ across devices added to
    its ``replica_mismatches`` (``"grad <path>"``): a gradient left unreduced whose update was then applied to a
    parameter placed otherwise (split over the axis it differs along) leaves the parameter's own copies equal
    (trial 33, a gspmd reference: "the replicas: agree" while the returned gradients' copies differed). Read
    only on a failing step (a correct step's all-reduced gradients are the same bits on every device), and only
    where no parameter's or state leaf's copies differ (those say it already, with the leaves they name)."""
    if cand_grads is None or record.replica_mismatches:
        return record
    differ = replica_mismatches(flatten_state(cand_grads))
    added = tuple(f"grad {p}" for p in sorted(differ) if f"grad {p}" not in record.replica_mismatches)
    return (
        dataclasses.replace(record, replica_mismatches=record.replica_mismatches + added) if added else record
    )


def _replica_axes(after: _After, mismatched: tuple[str, ...], cand_grads=None) -> tuple[str, ...]:
    """The mesh axes along which the candidate's mismatched copies differ (``topology.mismatch_axes``)."""
    if not mismatched:
        return ()
    arrays = {f"param {k}": v for k, v in after.cand_params.items()}
    arrays.update({f"opt_state {k}": v for k, v in after.cand_state.items()})
    if cand_grads is not None:
        arrays.update({f"grad {k}": v for k, v in flatten_state(cand_grads).items()})
    axes = {a for name in mismatched if name in arrays for a in mismatch_axes(arrays[name])}
    return tuple(sorted(axes))


def check_parity(
    candidate: StepFn | str | Candidate,
    task: Task,
    *,
    steps: int | None = None,
    num_shards: int | None = None,
    mesh=None,
    reference: StepFn | str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    name: str | None = None,
    compute_dtype=None,
    param_dtype=None,
    matmul_precision: str | None = None,
    leaf_tolerance=None,
    accept_weak: bool = False,
    initial_state: tuple[nnx.Module, nnx.Optimizer] | None = None,
) -> ParityReport:
    """Run the task's reference step and a candidate step side by side from one initial state; compare every leaf.

    Both start from independent copies of one fresh model (``task.model()``) and its optimizer and see the same
    batches. After each step the harness compares, per leaf: the pre-update loss; the gradients, when the
    candidate returns an object with ``.grads``; every ``nnx.Param``; every optimizer-state leaf (momentum trace,
    Adam ``mu``/``nu``); and exactly, the integer counters (the NNX ``step``, Adam's ``count``). Replicated
    candidate leaves are checked bitwise across this process's devices. Then the diagnosis explains a failure.
    A first failure at a step t > 0 is re-run from the reference's pre-step state: if that step matches, the
    trajectories diverged through rounding (``PASS (per step)``, ``diverged_trajectory``).

    The ``(model, optimizer, batches)`` form of ``shardcheck.check_parity`` is the seeds' adapter
    (:func:`shardcheck.seeds.parity.check_parity`), which builds the regression task and calls this one.

    Args:
        candidate: a strategy name (``simulation``, ``dp``, ``fsdp``, ``accumulation``, ``multiprocess``; needs
            ``num_shards``), a :class:`~shardcheck.steps.Candidate`, or a user step ``(model, optimizer, batch)
            -> loss`` (``(model, optimizer, batch, mesh)`` when it accepts ``mesh`` and ``mesh`` is given) that
            updates both in place and returns the loss, ``None``, or an object/mapping with ``loss`` and
            optionally ``grads``.
        task: the :class:`~shardcheck.Task`.
        steps: how many of the task's batches to use (default: all).
        num_shards: S: the shard count of a named strategy; lets the diagnosis recognise ratios S and 1/S and
            recompute the mean of per-shard means.
        mesh: passed to mesh strategies (default: the first S devices) and to candidates accepting ``mesh``.
        reference: what the candidate is compared with. ``None`` (or ``"reference"``): the task's single-device
            step. A mesh strategy's name (``"gspmd"``: the plain step jitted over the model's annotations, XLA's
            partitioner keeping single-device semantics; or ``"dp"``, ``"fsdp"``, ``"multiprocess"``): that
            strategy on the candidate's ``mesh``, the state created directly sharded on it (never whole on one
            device: :func:`~shardcheck.steps.sharded_init.sharded_training_state`) and compared on the devices;
            tolerances, sensitivity and diagnoses as against the single-device step; the report names it
            (``ParityReport.reference``). A step function (same signature as a candidate): gradients are compared
            only when it returns ``.grads``, and no update sensitivity is derived. A recording (a
            :class:`~shardcheck.Recording`, or the path of its ``.npz``): the candidate is replayed on the
            recorded task, mesh and batches and its digests compared with the recorded ones, its records diagnosed
            by the same rules (:mod:`shardcheck.parity.harness.replay`; ``param_dtype``, ``leaf_tolerance`` and
            ``initial_state`` do not apply; ``compute_dtype`` is the replay's).
        rtol: fixed relative tolerance for every step (default: derived from the parameters' dtype, the
            reduction length and the step).
        atol: fixed absolute tolerance for every step (default: derived).
        name: the candidate's name in the report.
        compute_dtype: override the compute dtype read from the model's layers (``dtype``), for the tolerance
            (``shardcheck.parity.tolerance.precision``).
        param_dtype: override the parameters' dtype read from the model, for the tolerance.
        matmul_precision: the precision of the steps' float32 matmuls and convolutions, for the tolerance:
            ``"float32"``, ``"tf32"`` (a 10-bit mantissa: a GPU's default since Ampere) or ``"bfloat16"`` (one
            bfloat16 pass: a TPU's default). ``None``: the coarsest that the two sides' backends use for the
            task's gradient (``jax_default_matmul_precision`` and the ``precision`` the step's matmuls set;
            ``shardcheck.parity.tolerance.matmul``). The report states it (``ParityReport.matmul_precision``).
        leaf_tolerance: per-leaf ``(rtol, atol)`` for the cases a rule cannot know: a mapping from a leaf name
            (``"param hidden.kernel"``, ``"opt_state 0.mu.bias"``, ``"loss"``; or its path alone) or a callable
            ``name -> (rtol, atol) | None``, called once per leaf name before the run.
        accept_weak: accept a check in which no compared leaf would have shown a gradient off by S or by 1/S
            (:func:`unresolvable`; otherwise the verdict is ``CANNOT VERIFY``); user-set ``rtol``/``atol`` count
            as accepting it.
        initial_state: the ``(model, optimizer)`` both sides start from (copied; nothing of them changes), in
            place of a fresh ``task.model()`` and its optimizer.

    Returns:
        A :class:`~shardcheck.ParityReport`.

    Raises:
        TypeError: ``task`` not a Task; ``accept_weak`` not a bool; ``candidate`` not a name, Candidate or
            callable, or a callable whose signature fits neither form; a malformed ``loss_fn`` output.
        ValueError: a model with batch statistics (C7) or drawing random numbers in its forward pass with a
            named strategy (candidate or reference) that runs it per shard or per micro-batch (``simulation``,
            ``dp``, ``fsdp``, ``accumulation``, ``multiprocess``: the message names the strategy, why, and the
            GSPMD step that works); a non-finite loss at step 0; ``steps`` larger than the batches; a named strategy with a batch that does
            not split into S equal shards (the message names the leaf and the fix); an unknown strategy; a
            ``reference`` strategy that does not run on a mesh, or one without ``mesh``/``num_shards``; negative
            ``rtol``/``atol``; ``matmul_precision`` not one of ``None``, ``"float32"``, ``"tf32"``,
            ``"bfloat16"``; a ``leaf_tolerance`` key that names no leaf, or a value (or a callable's result)
            that is not a pair of numbers >= 0, or a callable that raises; ``num_shards`` > 1 that no product of
            the mesh's axis sizes divides (3 on ``data=4``). All checked before any step runs; but for one
            (``RowCouplingError``, a ValueError): a named strategy that computes the loss per shard whose check
            FAILs as ``per_shard_loss`` first, the loss coupling the rows at a later step, which the probe of the
            first batch at the initial parameters did not see.
        CandidateError: the candidate raised during a step (the original error is its ``__cause__``), or returned
            gradients whose leaves are not the model's parameters' (naming the missing and extra leaf paths).
    """
    call = dict(locals())  # the arguments, for a re-check at "highest" (recheck.py)
    if is_recording(reference):  # a recording is a kind of reference, replayed and diagnosed alike
        return against_recording(call)
    num_shards = check_options(
        "check_parity", rtol=rtol, atol=atol, accept_weak=accept_weak, mesh=mesh, num_shards=num_shards
    )
    # on one mesh, what the devices hold is measured from before the state is created (footprint.py)
    footprint = Footprint.start() if isinstance(reference, str) and reference != REFERENCE else None
    run, data = _setup(
        "check_parity",
        candidate,
        task,
        steps=steps,
        num_shards=num_shards,
        mesh=mesh,
        reference=reference,
        name=name,
        dtypes=dict(compute_dtype=compute_dtype, param_dtype=param_dtype, matmul_precision=matmul_precision),
        leaf_tolerance=leaf_tolerance,
        initial_state=initial_state,
    )
    run.footprint = None if run.ref_strategy is None else footprint
    if run.reference is None and run.ref_strategy is None and not run.precision.low:
        # one reference trajectory for the checks of a verify
        run.shared = trajectory_for(task, (len(data), recheck.setting()), run.ref_model, run.ref_opt)
    # float32 accumulation under low-precision parameters; their own rounding is added per leaf (precision.py)
    dtype = ACCUMULATION_DTYPE if run.precision.param_eps > 0 else _param_dtype(run.ref_model)

    def tolerances(batch, t):
        derived = derive_tolerance(dtype, batch_size=run.task.terms(batch), step=t)
        return (
            derived.rtol if rtol is None else float(rtol),
            derived.atol if atol is None else float(atol),
            derived,
        )

    with compare.on_devices(run.ref_strategy is not None):  # a sharded check compares where its leaves live
        outcome = _steps_shaped(run, data, tolerances)
    derived = tolerances(data[0], max(len(outcome[0]) - 1, 0))
    rule = _rule_text(rtol, atol, derived, run.precision)
    accepted = accept_weak or rtol is not None or atol is not None
    user_set = "" if rtol is None and atol is None else _user_set(rtol, atol, derived[2])
    weak = unresolvable(outcome[0], run.cand.num_shards, run.precision, accepted=accepted, user_set=user_set)
    report = _report(run, outcome, rule, (None, weak) if accepted else (weak, None), mesh)
    if isinstance(candidate, str) and candidate not in FULL_BATCH_FORWARD:  # a built-in per-shard loss
        refuse_late_coupling("check_parity", candidate, report, run.cand.num_shards)
    return recheck.at_highest(report, matmul.devices_of(run.ref_model, mesh), call)


def _rule_text(rtol: float | None, atol: float | None, derived: tuple, precision) -> str:
    """The report's tolerance rule: the derivation's (``derived``: ``(rtol, atol, derive_tolerance result)`` of the
    last step) with the precision policy's, or the tolerances a user set."""
    if rtol is None and atol is None:
        return derived[2].rule + _precision_rule(precision)
    return (
        f"rtol={derived[0]:g}, atol={derived[1]:g} (user-set where given, else derived; fixed for every step)"
    )


def _user_set(rtol: float | None, atol: float | None, derived) -> str:
    """``"rtol=10, atol=10; derived: rtol=2.4e-06, atol=1e-06"``: the tolerances a user set, beside those derived
    for the last step (``derived``: a ``derive_tolerance`` result), for :func:`unresolvable`'s text."""
    given = ", ".join(f"{k}={v:g}" for k, v in (("rtol", rtol), ("atol", atol)) if v is not None)
    return f"{given}; derived: rtol={derived.rtol:.2g}, atol={derived.atol:.2g}"


def _report(run: _Run, outcome, rule: str, weak: tuple[str | None, str | None], mesh) -> ParityReport:
    """The run's report from the step loop's ``outcome`` (:func:`_run_steps`), the tolerance rule's text and
    ``weak``: the cause of a weak check (:func:`unresolvable`), as ``(cannot_verify, weak_accepted)``: the first
    when the caller did not accept it (``CANNOT VERIFY``), the second when they did (``PASS (weak check
    accepted)``); ``(None, None)`` for a check that could tell a factor-S error apart."""
    weak, weak_accepted = weak
    records, diverged, diverged_at, reference_diverged_at = outcome
    facts = leaf_facts(run.cand_model, run.task)
    findings = diagnose(
        records,
        run.cand.num_shards,
        diverged=diverged,
        reference_diverged_at=reference_diverged_at,
        mesh_shape=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
        micro_batches=run.cand.num_shards if run.cand.make_optimizer is not None else None,
        facts=facts,
    )
    findings = consistent(findings, records)  # no sentence that the records contradict
    findings = with_program(findings, functools.partial(_step_jaxpr, run), mesh, run.cand.num_shards)
    findings = with_shard_subset(findings, records, run.weighted)
    shape = None if mesh is None else {k: int(v) for k, v in mesh.shape.items()}
    localization = localize(records, facts=facts, num_shards=run.cand.num_shards, mesh_shape=shape)
    first = next((r for r in records if not r.ok), None)
    # before the draws' clause is added
    findings = with_count_readings(findings, run.draws, run.undrawn, first)
    findings = with_draws(findings, localization and localization.stage, run.draws, first)
    findings = with_batch_stats(findings, run.batch_stats)
    findings = with_skipped(findings, records)  # a step the reference's optimizer skipped, said once
    findings = with_later_non_finite(findings, records)  # NaN after the first failure, said once
    if weak is not None:
        findings = [Diagnosis("cannot_verify", weak), *[d for d in findings if d.code != "parity"]]
    return ParityReport(
        strategy=run.cand.name,
        builtin=run.cand.builtin,
        ok=bool(records)
        and all(r.ok for r in records)
        and diverged_at is None
        and reference_diverged_at is None
        and weak is None,
        steps=tuple(records),
        diagnoses=tuple(findings),
        cannot_verify=weak,
        weak_accepted=weak_accepted,
        scale_evidence=scale_evidence_text(records, run.cand.num_shards),
        reference=run.reference_name,
        num_shards=run.cand.num_shards,
        tolerance_rule=rule,
        diverged_at=diverged_at,
        diverged=diverged,
        reference_diverged_at=reference_diverged_at,
        matmul_precision=run.precision.matmul,
        matmul_precision_source=run.matmul_source,
        compute_dtype=run.precision.compute_dtype.name,
        devices=_sides_devices(run, mesh),
        localization=localization,
        **_footprint_fields(run),
    )


def _step_jaxpr(run: _Run):
    """One abstract trace of the user's step on the run's first batch
    (:func:`~shardcheck.parity.harness.candidates.step_jaxpr`)."""
    return step_jaxpr(run.cand, run.cand_model, run.cand_opt, run.task.batches[0], run.kwargs)


def _sides_devices(run: _Run, mesh) -> dict[str, str]:
    """Where each side ran, in words: the reference's arrays' devices (the mesh's, for a strategy on it), the
    candidate's mesh (its arrays' devices without one)."""
    from shardcheck.devices import describe

    def placed(model) -> set:
        return {
            d
            for leaf in jax.tree.leaves(nnx.state(model))
            if isinstance(leaf, jax.Array)
            for d in leaf.devices()
        }

    candidate = set(mesh.devices.flat) if mesh is not None else placed(run.cand_model)
    reference = candidate if run.ref_strategy is not None and mesh is not None else placed(run.ref_model)
    return {"reference": describe(reference), "candidate": describe(candidate)}


def _footprint_fields(run: _Run) -> dict:
    """The report's measured footprint (a check on the candidate's mesh), else ``None`` for each field."""
    fp = run.footprint
    return {
        "peak_bytes_per_device": None if fp is None else fp.peak,
        "state_bytes_per_device": None if fp is None else fp.state,
        "allocator_peak_bytes": None if fp is None else allocator_peak_bytes(),
    }


def _explained_trajectory(
    run: _Run, record: StepRecord, synced: StepRecord, pre, batch, rtol, atol
) -> StepRecord:
    """The trajectory's failing ``record`` of a step whose candidate ignores the optimizer state it is given,
    with the faulty reductions it reproduces: the re-check's (its candidate started from the reference's state
    before this step, as the hypotheses do), else found from that state (``pre``)."""
    if synced.matches:
        return dataclasses.replace(record, matches=synced.matches)
    return _explained(run, _PreStep.of(*pre), batch, record, rtol, atol)


def _steps_shaped(run: _Run, data, tolerances):
    """:func:`_run_steps`, where a step that raises on a batch shaped otherwise than batch 0 is told so
    (:func:`~shardcheck.task.batch_shape_hint`; trial 24: a batch whose leaf had 11 columns for 12 raised
    "dot_general requires contracting dimensions to have the same shape", naming no batch)."""
    from shardcheck.task import batch_shape_hint

    try:
        return _run_steps(run, data, tolerances)
    except CandidateError as err:
        hint = "" if err.hint else batch_shape_hint(data)
        if not hint:
            raise
        raise CandidateError(f"{err} ({hint})", err.step, hint) from err.__cause__
    except (TypeError, ValueError) as err:
        hint = batch_shape_hint(data)
        if not hint:
            raise
        raise type(err)(
            f"check_parity: the task's loss raised {type(err).__name__} in the reference's step or the check's "
            f"own computation on it ({hint}; give every batch the shapes of batch 0, or check each shape with a "
            f"task of its own): {err}"
        ) from err


def _run_steps(run: _Run, data, tolerances):
    """The step loop: trajectory mode, a re-check of the first failure after step 0 (:func:`_rechecked`), then
    synchronized mode."""
    records: list[StepRecord] = []
    diverged = diverged_at = reference_diverged_at = None
    rechecked = failed = False
    for t, batch in enumerate(data):
        undecided = not all(scale_shown(records))  # the verdict reads the scale until both factors showed
        failed = failed or (bool(records) and not records[-1].ok)  # then the trajectory's record stands
        if diverged_at is None:
            # the reference's state before the step, for a re-check; the task's reference step donates nothing
            keep = not rechecked
            pre = (
                _kept_state(run.ref_model, run.ref_opt, copy=run.reference is not None, run=run)
                if keep
                else None
            )
            carried = _carried_counters(run) if keep else None
            r_tol, a_tol, _ = tolerances(batch, t)
            recheck = t > 0 and not rechecked  # a failure here is re-checked from identical state first
            record, finite = _compare_step(
                run, t, batch, r_tol, a_tol, explain=failed or not recheck, check_scale=undecided
            )
            if not finite:
                reference_diverged_at = t
                break
            if not record.ok and recheck:
                rechecked = True
                flags = (failed, undecided)
                record, diverged, carried = _rechecked(
                    run, (t, batch), record, pre, carried, tolerances, flags
                )
                diverged_at = None if diverged is None else t
        else:
            # After diverged_trajectory: each step starts the candidate from a copy of the reference's state.
            r_tol, a_tol, _ = tolerances(batch, 0)
            rerun = run.synchronized(run.ref_model, run.ref_opt, carried)
            record, finite = _compare_step(
                rerun,
                t,
                batch,
                r_tol,
                a_tol,
                completed=1,
                synced=True,
                check_scale=undecided,
            )
            if not finite:
                reference_diverged_at = t
                break
            carried = _carried_counters(rerun)
        records.append(record)
    return records, diverged, diverged_at, reference_diverged_at


def _rechecked(run: _Run, step: tuple, record: StepRecord, pre, carried, tolerances, flags: tuple):
    """The re-check of a failing step t > 0 (``step``: ``(t, batch)``; ``record``: the trajectory's): the step
    re-run from the reference's pre-step state ``pre`` (with the candidate's own ``carried`` counters), compared
    at the step-0 tolerance; ``flags``: ``(failed, undecided)``, whether an earlier step failed and whether the
    scale evidence is still read (``_compare_step``'s ``check_scale``). Returns ``(record, diverged, carried)``:
    the record that stands for step t, the trajectory's record where the re-run matched (the trajectories
    diverged there), else ``None``, and the re-run's counters.

    It tells a step that differs by itself from trajectories that drifted apart over steps that each matched:
    where no step failed before it, the re-run stands for step t with its whole evidence (the hypotheses, the
    optimizer rerun, the forms, the module probe), as at step 0; where it matches, the trajectories diverged;
    where the candidate ignores the optimizer state it is given, the trajectory's record stays (``drift``).
    Where an earlier step failed, the trajectory is known to differ and the re-run says nothing of it (Adam given
    the reference's moments and the candidate's gradient moved a parameter the trajectory's step left as the
    reference's: issue #36, trial 46): the trajectory's record stands, the re-run beside it (``StepRecord.rerun``),
    evidence of the step from equal inputs only (a factor another batch's weight tells apart, said as run from
    the reference's state)."""
    (t, batch), (failed, undecided) = step, flags
    r0, a0, _ = tolerances(batch, 0)
    rerun = run.synchronized(*pre, carried)
    synced, _ = _compare_step(rerun, t, batch, r0, a0, completed=1, synced=True, check_scale=undecided)
    carried = _carried_counters(rerun)
    if failed:
        return dataclasses.replace(record, rerun=synced), None, carried
    if synced.ok:
        return synced, record, carried
    if ignores_optimizer_state(run, *pre, t, batch):  # state not carried between steps (drift)
        r_tol, a_tol, _ = tolerances(batch, t)
        return _explained_trajectory(run, record, synced, pre, batch, r_tol, a_tol), None, carried
    return synced, None, carried


def _carried_counters(run: _Run) -> dict | None:
    """The candidate's integer model state the task's loss neither reads nor writes (``{dotted path: host
    array}``, ``None`` where there is none or that is not known yet): a counter only the candidate's step keeps
    (a target network's sync count) is not compared where the reference's step leaves it
    (``model_state.model_state_leaves``), so a step run from the reference's state carries the candidate's own
    value of it (the reference's, never written, would start the candidate's count again: a sync every K steps
    then never comes, and a write the reference's step does not make is never seen). Values of a counter both
    steps write are equal wherever no step has failed yet, so carrying them changes nothing."""
    touched = run.counters_touched
    if touched is None:
        return None
    found = run.found if run.in_place else None
    counters = model_state(run.cand_model, found, "model_state cand")
    out = {p: np.asarray(to_host(a)) for p, a in counters.items() if p not in touched}
    return out or None


def assert_step_parity(candidate: StepFn | str | Candidate, task: Task, **kwargs) -> ParityReport:
    """:func:`check_parity`, raising when parity fails: for a user's own pytest suite.

    Args:
        candidate: as :func:`check_parity`.
        task: as :func:`check_parity`.
        **kwargs: ``steps``, ``num_shards``, ``mesh``, ``reference``, ``rtol``, ``atol``, ``name``.

    Returns:
        The passing :class:`~shardcheck.ParityReport` (``PASS`` or ``PASS (per step)``).

    Raises:
        ParityError: an ``AssertionError`` whose message is the report (worst leaf, errors, tolerance,
            diagnosis) and whose ``report`` attribute is the :class:`~shardcheck.ParityReport`.
        TypeError, ValueError: as :func:`check_parity`.
    """
    report = check_parity(candidate, task, **kwargs)
    if not report.step_ok:
        raise ParityError(report)
    return report


def minibatches(x, y, batch_size: int, steps: int, *, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` successive mini-batches of ``batch_size`` rows, reshuffled every epoch.

    Epoch e visits the rows in the order ``np.random.default_rng(seed)``'s e-th permutation (one generator for
    the whole run); the last ``N % batch_size`` rows of an epoch are skipped, so every batch has exactly
    ``batch_size`` rows (equal shards need ``batch_size % S == 0``).

    Args:
        x: ``(N, D)`` inputs.
        y: ``(N, K)`` targets.
        batch_size: 1 <= B <= N.
        steps: number of batches, >= 1.
        seed: the shuffling seed.

    Returns:
        A list of ``steps`` pairs ``(x_b (B, D), y_b (B, K))`` of NumPy arrays.

    Raises:
        ValueError: ``batch_size`` out of range, ``steps < 1``, ``x`` and ``y`` of different lengths.
    """
    fn = "minibatches"
    x, y = np.asarray(x), np.asarray(y)
    n = x.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"{fn}: x has {n} rows but y has {y.shape[0]}; they must match")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ValueError(
            f"{fn}: batch_size must be an int in [1, {n}] (the data has {n} rows), got {batch_size!r}"
        )
    steps = _validate.check_int(fn, "steps", steps)
    drawn = itertools.islice(minibatch_indices(n, batch_size, seed=seed), steps)
    return [(x[idx], y[idx]) for _, idx in drawn]


__all__ = ["ParityError", "ParityReport", "assert_step_parity", "check_parity", "minibatches"]
