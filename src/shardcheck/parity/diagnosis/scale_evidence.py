"""The scale evidence: would the compared leaves have told the step apart from one whose gradient is off by S (a
sum for a mean) or by 1/S (a mean taken twice)? Asked of every step until both factors showed
(``StepRecord.scale_evidence``); a passing run that never showed one is ``CANNOT VERIFY`` (:func:`unresolvable`).
"""

from __future__ import annotations

from flax import nnx

from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import flatten_state, is_int
from shardcheck.parity.diagnosis.grouping import n_leaves
from shardcheck.parity.harness.state import _After, _PreStep, _Run
from shardcheck.parity.tolerance.allowances import _reference_grads
from shardcheck.parity.tolerance.derive import MOMENT_FACTOR
from shardcheck.parity.tolerance.precision import Precision
from shardcheck.parity.tolerance.propagation import scale_change

# The optimizer is blind to the gradient's scale (global-norm clipping that binds) where a gradient off by a factor
# c moves no leaf by more than this share of |1 - c| times the reference's own change of it (SGD: all of it).
BLIND_RESPONSE = 0.01


def scale_factors(num_shards: int | None) -> tuple[float, float]:
    """``(S, 1 / S)``: the gradient factors of a sum for a mean and of a mean taken twice (S = 2 when unknown)."""
    s = float(num_shards) if num_shards and num_shards > 1 else 2.0
    return s, 1.0 / s


def _grad_evidence(run: _Run, grads: dict, bounds, rtol, atol, factor: float) -> list[str]:
    """The compared gradient leaves (``grads``: ``{path: reference gradient}``) that ``factor`` times the
    reference's gradient would leave: ``|factor - 1| |g|`` beyond the leaf's tolerance (and its compute
    allowance) in some element. No rerun: the scaled gradient is known."""
    if not grads:
        return []
    tols = {p: run.tol("grad", p, rtol, atol) for p in grads}
    allowances = {} if bounds is None else {p: bounds.grad[p] for p in grads if p in bounds.grad}
    hit = compare.exceeds(grads, grads, tols, allowances, scale=factor - 1.0)
    return [f"grad {p}" for p in grads if hit[p]]


def _rerun_evidence(run: _Run, pre: _PreStep, tree, rtol, atol, after: _After, factor: float, changes):
    """The compared parameter and float optimizer-state leaves that the reference's optimizer, rerun from
    ``pre`` on ``factor`` times its gradient ``tree`` (``propagation.scale_change``), would move beyond their
    tolerance and accumulated allowance, by name; each leaf's largest change goes into ``changes`` (``{name: max
    |change|}``, for the blindness test of :func:`_scale_evidence`)."""
    update, state = scale_change(run.ref_opt.tx, tree, pre.opt_state, pre.params, factor)
    params = {
        p: v for p, v in flatten_state(update).items() if p in after.ref_params and p in after.cand_params
    }
    state = {
        p: v
        for p, v in flatten_state(state).items()
        if p in after.ref_state and p in after.cand_state and not is_int(after.ref_state[p])
    }
    found = []
    for kind, moved, refs, allowance, k in (
        ("param", params, after.ref_params, run.allowance, 1.0),
        ("opt_state", state, after.ref_state, run.state_allowance, MOMENT_FACTOR),
    ):
        tols = {p: run.tol(kind, p, k * rtol, k * atol) for p in moved}
        hit = compare.exceeds(moved, refs, tols, {p: allowance[p] for p in moved if p in allowance})
        found += [f"{kind} {p}" for p in moved if hit[p]]
        changes.update({f"{kind} {p}": v for p, v in compare.max_abs(moved).items()})
    return found


def _scale_evidence(run: _Run, pre: _PreStep, batch, rtol, atol, bounds, after: _After, grads: dict, leaves):
    """Which compared leaves would have told the step apart from one whose gradient is off by S, and from one off
    by 1/S: ``((leaves for S, leaves for 1/S), blind)``.

    The hypothesis itself, from this step's pre-step state ``pre``: the compared gradient leaves ``grads`` show a
    factor c where ``|c - 1| |g|`` exceeds their tolerance (:func:`_grad_evidence`); when they do not show it, the
    reference's optimizer is rerun on ``c g`` (:func:`_rerun_evidence`). ``blind``: some factor showed in no leaf
    and moved none by more than :data:`BLIND_RESPONSE` of ``|1 - c|`` times its reference change (the optimizer
    rescales the gradient away: global-norm clipping that binds), rather than by less than its tolerance.
    """
    shown, blind = [], False
    tree = None
    change = {e.name: e.reference_change for e in leaves if e.reference_change is not None}
    for factor in scale_factors(run.cand.num_shards):
        found = _grad_evidence(run, grads, bounds, rtol, atol, factor)
        if not found:
            if tree is None:
                tree = (
                    bounds.grad_tree if bounds is not None else _reference_grads(run.task.loss_fn, pre, batch)
                )
            moved: dict[str, float] = {}
            found = _rerun_evidence(run, pre, nnx.as_pure(tree), rtol, atol, after, factor, moved)
            limit = BLIND_RESPONSE * abs(1.0 - factor)
            blind |= not found and all(m <= limit * change.get(n, 0.0) for n, m in moved.items())
        shown.append(tuple(found))
    return (shown[0], shown[1]), blind


def scale_shown(records) -> tuple[bool, bool]:
    """Whether some step's compared leaves would have shown a gradient off by S, and one off by 1/S
    (``StepRecord.scale_evidence``)."""
    checked = [r.scale_evidence for r in records if r.scale_evidence is not None]
    return any(e[0] for e in checked), any(e[1] for e in checked)


ACCEPT = "pass accept_weak=True (verify --accept-weak) to accept the weak check."
ACCEPTED = "accepted as a weak check (accept_weak=True, verify --accept-weak, or a user-set rtol/atol)."


def unseen_factors(shown: tuple[bool, bool], num_shards: int | None) -> tuple[str, str]:
    """``(times, which)`` in words of the factors that ``shown`` (:func:`scale_shown`) says no step showed:
    ``("times 4 or times 1/4", "a x4 or x1/4 error (a sum for a mean, a mean taken twice)")``."""
    s = int(scale_factors(num_shards)[0])
    return {
        (False, False): (
            f"times {s} or times 1/{s}",
            f"a x{s} or x1/{s} error (a sum for a mean, a mean taken twice)",
        ),
        (True, False): (f"times 1/{s}", f"a x1/{s} error (a mean taken twice; a x{s} one would have failed)"),
        (False, True): (f"times {s}", f"a x{s} error (a sum for a mean; a x1/{s} one would have failed)"),
    }[shown]


def unresolvable(
    records, num_shards: int | None, precision: Precision, *, accepted: bool = False, user_set: str = ""
) -> str | None:
    """Why the steps cannot tell the step from one whose gradient is off by S (a sum for a mean) or by 1/S (a
    mean taken twice), or ``None``. The text ends with how to accept the weak check, or (``accepted``: the user
    accepted it or set the tolerance) says that it was accepted. ``user_set``: the tolerances the user set and
    those derived, ``"rtol=10, atol=10; derived: rtol=2.4e-06, atol=1e-06"`` (``""``: derived): too wide
    tolerances are then said as theirs, with the fix to lower them, never "run the check in float32" of a float32
    run (trial 49).

    Decided by the hypothesis itself (``StepRecord.scale_evidence``): from each step's pre-step state, would the
    compared leaves (the gradients when returned; else the parameters and optimizer state after the reference's
    optimizer rerun on ``S g`` and ``g / S``) have told each factor apart within their tolerances? A factor that
    no step shows makes the verdict ``CANNOT VERIFY``, its text the cause: the parameters never moved (a learning
    rate of 0, the first step of a warm-up), an optimizer blind to the scale (``StepRecord.scale_blind``:
    global-norm clipping that binds), or tolerances too wide for the updates (precision, a tiny learning rate).
    Only for passing runs: a failing one has found its error.
    """
    if not records or not all(r.ok for r in records):
        return None
    shown = scale_shown(records)
    if all(shown):
        return None
    times, which = unseen_factors(shown, num_shards)
    accept = ACCEPTED if accepted else ACCEPT
    # a step that returned its gradients is never told to return them (trial 12: bfloat16, gradients compared)
    returned = any(e.kind == "grad" for r in records for e in r.leaves)
    params = [e for r in records for e in r.leaves if e.kind == "param" and e.reference_change is not None]
    if params and all(e.reference_change == 0 for e in params):
        return (
            f"Cannot verify: the reference's parameters did not move in any of the {len(records)} steps checked "
            f"(a learning rate of 0, as at the first step of a warm-up schedule), and no compared leaf would show "
            f"{which}, so a wrong gradient would pass. Check more steps (steps=, verify --steps), past the "
            f"schedule's first{'' if returned else ', or return the gradients from the step'}; {accept}"
        )
    checked = [r for r in records if r.scale_evidence is not None]
    if all(r.scale_blind for r in checked):
        grads = (
            "the returned gradients' tolerances are too wide to show it"
            if returned
            else "no gradient was compared that shows it"
        )
        fix = (
            ""
            if returned
            else "Return the gradients from the step ({'loss': loss, 'grads': grads}), or check"
        )
        return (
            f"Cannot verify the gradient's scale: in every step the optimizer's update and state come out the "
            f"same, within their tolerance, for the gradient {times} (global-norm clipping that binds rescales "
            f"the gradient), and {grads}, so {which} would pass. {fix or 'Check'} with a clipping norm above the "
            f"gradients' norm; {accept}"
        )
    leaves = (
        "the returned gradients, parameters, optimizer state" if returned else "parameters, optimizer state"
    )
    if user_set:
        return (
            f"Cannot verify with the tolerances set ({user_set}): in no step would {which} move a compared leaf "
            f"({leaves}) beyond them, so such an error would pass. Lower rtol/atol, or leave them derived; {accept}"
        )
    fix = "" if returned else "Return the gradients from the step ({'loss': loss, 'grads': grads}), "
    return (
        f"Cannot verify at this precision ({precision.describe()}): in no step would {which} move a compared "
        f"leaf ({leaves}) beyond its tolerance, so such an error would pass. {fix}{'run' if fix else 'Run'} the "
        f"check in float32, or raise the learning rate; {accept}"
    )


def scale_evidence_text(records, num_shards: int | None) -> str | None:
    """Which leaves carried the evidence that the step's gradient is not off by S or 1/S: the first step that
    showed each factor and its leaves (``StepRecord.scale_evidence``), or ``None`` when none did."""
    s = int(scale_factors(num_shards)[0])
    found = {}  # (step, leaves): the factors they showed
    for i, label in enumerate((f"x{s}", f"x1/{s}")):
        record = next((r for r in records if r.scale_evidence is not None and r.scale_evidence[i]), None)
        if record is not None:
            found.setdefault((record.step, record.scale_evidence[i]), []).append(label)
    parts = []
    for (step, names), labels in found.items():
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(
            f"a gradient {' or '.join(labels)} would have failed {n_leaves(len(names))} at step {step} ({listed})"
        )
    return None if not parts else "; ".join(parts) + "."
