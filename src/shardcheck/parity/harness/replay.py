"""A recording as the reference: ``check_parity(candidate, task, reference=Recording or "run.npz")``.

A recording (:mod:`shardcheck.parity.harness.recorded`) is a kind of reference: the candidate runs on the recorded
task, mesh and batches (:func:`~shardcheck.parity.harness.recorded.record_run`, the harness's own admission and
step), its digests are compared with the recorded ones step by step within the harness's derived tolerances
(:func:`~shardcheck.parity.comparison.digest.compare_run`), and the comparison's records, the same
:class:`~shardcheck.parity.diagnosis.rules.LeafError` and :class:`~shardcheck.parity.diagnosis.rules.StepRecord` a
live check makes, are localized and diagnosed by the live check's code
(:func:`~shardcheck.parity.diagnosis.localization.localize`, :func:`~shardcheck.parity.diagnosis.rules.diagnose`),
with the live check's optimizer rerun where the localization needs it (:func:`with_optimizer_rerun`). The result
is a :class:`~shardcheck.ParityReport` whose ``replay`` holds the digest comparison. ``shardcheck verify --against
FILE`` is the command-line form.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardcheck.parity.comparison.digest import QUIET, with_divergence_note
from shardcheck.parity.diagnosis.hypotheses import clip_norm_of
from shardcheck.parity.harness.non_finite import diverged_report, first_non_finite, truncated
from shardcheck.parity.harness.optimizer_rerun import optimizer_form
from shardcheck.parity.harness.recorded import Recording, check_replayable, load_recording, record_run
from shardcheck.parity.report import ParityReport
from shardcheck.task import Task

UNSUPPORTED = ("param_dtype", "leaf_tolerance", "initial_state")
"""``check_parity`` options a recording cannot honour: it holds digests of one recorded run, not a step to
re-run at another parameter dtype, per-leaf tolerances of its own or another initial state (``compute_dtype``
applies: the replay's compute rounding, compared within the looser of it and the recording's)."""


def is_recording(reference) -> bool:
    """Whether ``reference`` names a recording: a :class:`Recording`, an ``os.PathLike``, or a str ending in
    ``.npz`` (no strategy's name does)."""
    return (
        isinstance(reference, Recording | os.PathLike)
        or isinstance(reference, str)
        and reference.endswith(".npz")
    )


def _recorded_mesh(recording: Recording, mesh, num_shards):
    """``(mesh, num_shards)`` of the replay: the caller's, else the recording's (its mesh rebuilt over the first
    devices, or its shard count)."""
    if mesh is not None or num_shards is not None:
        return mesh, num_shards
    axes = recording.meta.get("mesh")
    if axes:
        from shardcheck.mesh import make_mesh

        return make_mesh(dict(axes)), None
    return None, recording.meta["num_shards"]


def check_against_recording(
    candidate,
    task: Task,
    reference: Recording | str | os.PathLike,
    *,
    steps: int | None = None,
    num_shards: int | None = None,
    mesh=None,
    rtol: float | None = None,
    atol: float | None = None,
    name: str | None = None,
    matmul_precision: str | None = None,
    compute_dtype=None,
    pin_placement: bool = False,
    settings: Mapping[str, Any] | None = None,
    fn: str = "check_parity",
    shown: str | None = None,
    accept_weak: bool = False,
    **unsupported,
) -> ParityReport:
    """Replay ``candidate`` on ``task`` and compare it with the recording ``reference``, as a live check compares
    it with the task's reference step.

    Args:
        candidate: as :func:`~shardcheck.check_parity` (a strategy's name, a Candidate, a user step).
        task: the recorded task.
        reference: a :class:`Recording` (:func:`load_recording`, :func:`record_run`) or the path of the ``.npz``
            :meth:`Recording.save` wrote.
        steps: the steps to replay (default: every recorded one).
        num_shards, mesh: the replay's (default: the recording's mesh, rebuilt over the first devices, or its
            shard count).
        rtol, atol: fixed tolerances in place of the derived ones.
        name: the candidate's name (a user step's).
        matmul_precision: as :func:`~shardcheck.check_parity`; the comparison assumes the looser of the
            recording's and the replay's.
        compute_dtype: the replay's compute dtype for the tolerance (default: read from the model's layers, as
            a live check reads it); the comparison allows the looser of the recording's and the replay's compute
            rounding (:func:`~shardcheck.parity.comparison.digest.compare_run`).
        pin_placement: a leaf whose sharding differs from the recorded one fails (default: values compared).
        settings: the replay's settings (``record_run(settings=)``): those that differ are named.
        fn: how messages name the caller; shown: how they name the recording (default: its path, or
            ``"reference"``).
        accept_weak: accept a replay in which no recorded leaf would have shown a gradient off by S or by 1/S
            (``PASS (weak check accepted)``); default: such a replay is ``CANNOT VERIFY`` (:func:`_weak`), as a
            live check is. Tolerances the user set (``rtol``, ``atol``) accept it too, as live.
        **unsupported: ``check_parity`` options of :data:`UNSUPPORTED`: refused unless None.

    Returns:
        A :class:`~shardcheck.ParityReport`: the replay's records diagnosed by the live check's rules (the first
        failing step's record with its batch's total weight, ``StepRecord.loss_weight``, under a ``(loss_sum,
        weight)`` loss: :func:`loss_weight`); its ``replay`` is the
        :class:`~shardcheck.parity.comparison.digest.RunComparison`, whose notes name the recorded and the
        replayed step where they differ. Where the recording's loss, gradients, parameters or optimizer state
        went non-finite at a replayed step t, only the steps before t are compared and the report is a live
        check's whose reference diverged at t: ``reference_diverged_at`` t, verdict ``NO VERDICT``, finding
        ``reference_diverged`` saying whether the replay went non-finite there too
        (:func:`~shardcheck.parity.harness.non_finite.diverged_report`).

    Raises:
        TypeError: ``task`` not a Task; as :func:`record_run` and
            :func:`~shardcheck.parity.comparison.digest.compare_run`.
        ValueError: an option of :data:`UNSUPPORTED` given; as :func:`load_recording` (a file that is no
            recording, or a damaged one) and :func:`check_replayable` (another task, mesh, batches or state,
            more steps than recorded), before any step.
        CandidateError: the candidate raised during a step.
    """
    from shardcheck.parity.comparison.digest import compare_run, rediagnosed

    _check_call(fn, task, unsupported)
    recording = reference
    if not isinstance(reference, Recording):
        shown = shown or f"reference {str(reference)!r}"
        recording = load_recording(Path(reference), fn=fn, name=shown)
    mesh, num_shards = _recorded_mesh(recording, mesh, num_shards)
    where = {"mesh": mesh, "num_shards": num_shards, "fn": fn}
    check_replayable(recording, task, path=shown or "the recording", steps=steps, settings=settings, **where)
    replayed = record_run(
        task,
        candidate,
        steps=recording.num_steps if steps is None else steps,
        num_shards=num_shards,
        mesh=mesh,
        name=name,
        settings=settings,
        matmul_precision=matmul_precision,
        compute_dtype=compute_dtype,
        true_gradients=True,  # where it returns none: which gradients are at rounding level, as a live check
        update_checks=(checked := []),  # the update of each step from its own inputs, as a live check
    )
    # a recording that went non-finite is no reference from there: the steps before it are compared, as a live
    # check whose reference diverged stops there (reference_diverged: no verdict)
    diverged = first_non_finite(recording, replayed.num_steps)
    compared = (recording, replayed) if diverged is None else _before(diverged.step, recording, replayed)
    weight = functools.partial(loss_weight, task)  # the first failing step's, as a live check reads it
    comparison = compare_run(*compared, rtol=rtol, atol=atol, pin_placement=pin_placement, loss_weight=weight)
    if not comparison.ok:  # the grouping reads what only the task's model shows: tied leaves, their uses
        comparison = _with_task_facts(fn, comparison, task, compared)
    rules = functools.partial(rediagnosed, comparison, *compared)  # read again with the rerun
    where["name"] = name
    report = with_optimizer_rerun(comparison.report(), candidate, task, rules=rules, **where)
    report = with_update_check(report, checked[0] if checked else None, task, rules)
    report = _weak(_with_program(report, candidate, task, **where), task, accept_weak, rtol, atol)
    return report if diverged is None else diverged_report(report, diverged, recording, replayed)


def _weak(report: ParityReport, task: Task, accept_weak: bool, rtol, atol) -> ParityReport:
    """A passing replay (bitwise identical or not) in which no recorded leaf of any step would have shown a gradient
    off by S or by 1/S (``StepRecord.scale_evidence``, from the digests; under the task's global-norm clip, what
    the optimizer reads of it) as ``CANNOT VERIFY``, its text the cause (a coarser matmul precision, a binding
    clip with no gradients returned, or updates too small) and the fix; ``accept_weak``, or tolerances the user
    set (``rtol``, ``atol``), accept it: ``PASS (weak check accepted)``, as a live check's; else as it is.

    Trial 57: a TF32 recording replayed in float32 compares within TF32's eps over the derived rule's sqrt(B*K)
    terms (rtol 1.41 on a 1280-term step), under which a sum for a mean and a mean taken twice replayed as a
    PASS with a note."""
    from shardcheck.parity.diagnosis.evidence import Diagnosis
    from shardcheck.parity.diagnosis.scale_evidence import ACCEPT, ACCEPTED, scale_shown, unseen_factors

    replay, shown = report.replay, scale_shown(report.steps)
    # a bitwise identical replay too: a binding clip maps g and S g to the same bits (trial 58)
    if not report.ok or replay is None or all(shown):
        return report
    which = unseen_factors(shown, report.num_shards)[1]
    clip = clip_norm_of(task.optimizer)
    returned = any(e.kind == "grad" for r in report.steps for e in r.leaves)
    given = ", ".join(f"{k}={v:g}" for k, v in (("rtol", rtol), ("atol", atol)) if v is not None)
    if given:  # the user's own tolerances: accepted, as live (trial 58: --rtol 10 replayed as a plain PASS)
        why = f"the tolerances set ({given}) are wider than a factor's change of the recorded digests. Lower them"
    elif replay.matmul_precision != "float32":
        why = (
            f"its tolerance assumes {replay.matmul_precision} matmul rounding on every one of a step's terms (the "
            "looser of the two runs' precisions), wider than a factor's change of the recorded digests. Record and "
            "replay both with float32 matmuls (jax_default_matmul_precision='highest' on a GPU), or check the "
            "step live against the task's reference (verify without --against), where a coarser precision's "
            "rounding is measured, not assumed"
        )
    elif clip is not None and not returned:
        why = (
            f"the task's optimizer clips the gradient's global norm to {clip:g}, which, where it binds, maps the "
            "gradient and S times it to one update, and the step returned no gradients. Return them from the "
            "step ({'loss': loss, 'grads': grads}), or record with a clipping norm above the gradients' norm"
        )
    else:
        why = (
            "the recorded digests change too little for their tolerances (a tiny learning rate, or steps at which "
            "the parameters did not move). Record more steps or raise the learning rate"
        )
    said = (
        f"Cannot verify against this recording: in no replayed step would {which} move a recorded leaf beyond "
        f"its tolerance, so such an error would pass: {why}; "
    )
    if accept_weak or given:
        return dataclasses.replace(report, weak_accepted=said + ACCEPTED)
    findings = (
        Diagnosis("cannot_verify", said + ACCEPT),
        *[d for d in report.diagnoses if d.code != "parity"],
    )
    return dataclasses.replace(report, ok=False, cannot_verify=said + ACCEPT, diagnoses=findings)


def _with_program(report: ParityReport, candidate, task: Task, *, mesh, num_shards, name, fn) -> ParityReport:
    """``report`` whose leading finding is ``summed``, with what one abstract trace of the user's step shows
    (:func:`~shardcheck.parity.diagnosis.resummed.with_resummed`: a gradient autodiff summed, reduced again), as
    a live check says it; else as it is (trial 56: a replay's ``summed`` lacked it)."""
    from shardcheck.parity.diagnosis.resummed import with_program
    from shardcheck.parity.harness.candidates import as_candidate, step_jaxpr

    if not report.diagnoses or report.diagnoses[0].code != "summed":
        return report
    cand = as_candidate(fn, candidate, task, num_shards, mesh, name)

    def trace():
        model = task.new_model()
        kwargs = {"mesh": mesh} if cand.pass_mesh else {}
        return step_jaxpr(cand, model, task.new_optimizer(model), task.batches[0], kwargs)

    found = tuple(with_program(report.diagnoses, trace, mesh, cand.num_shards))
    if found == report.diagnoses:
        return report
    cause = " ".join(d.message for d in found if d.code not in QUIET)
    replay = (
        None if report.replay is None else dataclasses.replace(report.replay, diagnoses=found, cause=cause)
    )
    return dataclasses.replace(report, diagnoses=found, replay=replay)


def _with_task_facts(fn: str, comparison, task: Task, compared: tuple):
    """A failing ``comparison`` (a :class:`~shardcheck.parity.comparison.digest.RunComparison`) with the task's
    model's facts (:func:`model_facts`: tied leaves, their uses, the optimizer's parameter groups) and its findings
    read again with them, as the localization reads them: a finding's "share no ndim, name or module" never stands
    beside a localization's optimizer parameter group for the same leaves (trial 41)."""
    from shardcheck.parity.comparison.digest import rediagnosed

    comparison = dataclasses.replace(comparison, facts=model_facts(fn, comparison.facts, task))
    found = rediagnosed(comparison, *compared, comparison.records)
    cause = " ".join(d.message for d in found if d.code not in QUIET)
    return dataclasses.replace(comparison, diagnoses=found, cause=cause or comparison.cause)


def _before(t: int, *recordings: Recording) -> tuple[Recording, ...]:
    """Each of ``recordings`` with its first ``t`` steps only (:func:`~shardcheck.parity.harness.non_finite.
    truncated`)."""
    return tuple(truncated(r, t) for r in recordings)


def _check_call(fn: str, task, unsupported: Mapping[str, Any]) -> None:
    """Refuse an option of :data:`UNSUPPORTED` given (ValueError) and a ``task`` that is no Task (TypeError)."""
    given = sorted(k for k, v in unsupported.items() if v is not None)
    if given:
        raise ValueError(
            f"{fn}: {', '.join(given)} cannot apply against a recording (it holds the digests of one recorded "
            "run); drop them, or check against the task's reference step (reference=None)"
        )
    if not isinstance(task, Task):
        raise TypeError(f"{fn}: task must be a shardcheck.Task, got {type(task).__name__}")


def loss_weight(task: Task, step: int) -> float | None:
    """The total weight of ``task``'s batch at ``step`` under its ``(loss_sum, weight)`` loss, as a live check
    reads it for a failing step (:func:`~shardcheck.task.batch_weight`, on a model built inside the jit: the
    weight is a count, not a function of the parameters, and no state is allocated,
    :func:`~shardcheck.task.task_batch_weight`); ``None`` for a mean loss."""
    from shardcheck.task import task_batch_weight

    return task_batch_weight(task, task.batches[step])


def model_facts(fn: str, facts: tuple, task: Task) -> tuple:
    """The recorded ``(parameter path, LeafFacts)`` with what the task's model shows beside them, as a live check
    reads it (:func:`~shardcheck.parity.harness.leaf_facts.leaf_facts` of its abstract model, nothing allocated):
    the paths that share a tied leaf, the operations of the loss that read each leaf and its optimizer's
    parameter group."""
    from shardcheck.memory.state import abstract_training_state
    from shardcheck.parity.harness.leaf_facts import leaf_facts

    model, _ = abstract_training_state(fn, task)
    live = leaf_facts(model, task)
    return tuple(
        (
            p,
            dataclasses.replace(
                f,
                tied=live[p].tied,
                shared_by=live[p].shared_by,
                uses=live[p].uses,
                group=live[p].group,
                module=live[p].module,
            ),
        )
        if p in live
        else (p, f)
        for p, f in facts
    )


def with_optimizer_rerun(
    report: ParityReport, candidate, task: Task, *, mesh, num_shards, name, fn: str, rules=None
):
    """``report`` with the live check's optimizer evidence at its localized step, whatever stage it names (a live
    check reruns the optimizer on every failing step, so that the later stages read alike): the candidate is
    run again from a fresh state up to that step, and the task's optimizer
    (``task.optimizer``, also for a candidate that brings its own) rerun on its own gradients and pre-step state
    (the candidate's view of it, ``Candidate.view_optimizer``) is compared with its state after the step
    (``StepRecord.optimizer_rerun``, as :mod:`shardcheck.parity.harness.optimizer_rerun` does live), so that an
    update applied differently from equal inputs is localized to the optimizer's update, replayed as live. Where
    it is, the form of that stage is fitted on the arrays (``StepRecord.forms``,
    :func:`~shardcheck.parity.diagnosis.form.fit_form`, the rerun as the reference), as live, and a late failure
    that the rerun shows faulty from equal inputs is no longer called possible rounding divergence
    (:func:`~shardcheck.parity.comparison.digest.with_divergence_note`). ``rules``: ``records -> findings``, the
    replay's diagnosis (:func:`~shardcheck.parity.comparison.digest.rediagnosed`), rerun on the records with the
    rerun as a live check's rules read them (the optimizer on the returned gradients giving the applied update
    refutes "not the ones applied"); ``None``: only a ``drift`` the rerun refutes is replaced.
    Unchanged where the step returns no gradients, the candidate's optimizer state is not the task's by path,
    the run spans several processes, or the rerun cannot run."""
    where = report.localization
    if report.replay is None or where is None or where.stage is None:
        return report
    if jax.process_count() > 1:  # a step of collectives that every process would have to decide to run
        return report
    record = next(r for r in report.steps if r.step == where.step)
    # the recording's shard count where the replay was given a mesh alone: the per-shard-mean hypothesis's S
    found = _rerun_at(record, candidate, task, mesh, num_shards or report.num_shards, name, fn)
    counted = {**_weight_counted(record, task), **_batch_keys(record, task)}
    if (found is None or (found[0] is None and not found[1])) and not counted:
        return report
    rerun, matches, arrays, fields = (None, (), None, {}) if found is None else found
    # the task's clip, as a live check's failing step records it (hypotheses.clip_norm_of): a rule that blames a
    # clip coefficient reads whether the optimizer holds one
    clip = clip_norm_of(task.optimizer)
    with_rerun = dataclasses.replace(
        record, matches=record.matches + matches, global_clip=clip, **counted, **fields
    )
    if rerun is not None:
        with_rerun = dataclasses.replace(with_rerun, optimizer_rerun=rerun)
        forms = optimizer_form(with_rerun, arrays)
        with_rerun = dataclasses.replace(with_rerun, forms=forms) if forms else with_rerun
    return _rediagnosed(report, record, with_rerun, rules)


def _rediagnosed(report: ParityReport, record, replacement, rules) -> ParityReport:
    """``report`` with ``record`` replaced by ``replacement`` and diagnosed again: by ``rules`` (``records ->
    findings``, the live check's), or where ``None`` only a ``drift`` the new record refutes replaced; its replay's
    records, findings, cause, divergence note (the rerun may refute a late failure as rounding divergence) and
    localization with them."""
    steps = tuple(replacement if r is record else r for r in report.steps)
    found = rules(steps) if rules else _without_refuted_drift(report.diagnoses, steps, report.num_shards)
    cause = " ".join(d.message for d in found if d.code not in QUIET) if found != report.diagnoses else None
    # a record the rerun failed fails the replay: its ok (the exit status, --json's ok) with its verdict (trial
    # 29: a replay's update check FAILed and exited 0, ok true)
    ok = report.ok and replacement.ok
    replay = dataclasses.replace(
        report.replay, records=steps, diagnoses=found, cause=cause or report.replay.cause, ok=ok
    )
    replay = with_divergence_note(replay)
    return dataclasses.replace(
        report, ok=ok, steps=steps, diagnoses=found, replay=replay, localization=replay.localization()
    )


def with_update_check(report: ParityReport, found, task: Task, rules) -> ParityReport:
    """``report`` where the update check failed at a replayed step before any step the digests fail (``found``:
    ``(step, leaves, (before, rerun, after, lr))``, ``record_run(update_checks=)``): that step's record with the
    check as its optimizer rerun and the form fitted on its arrays
    (:func:`~shardcheck.parity.harness.optimizer_rerun.optimizer_form`), diagnosed by ``rules`` (the live
    check's), as a live check finds it. Unchanged otherwise."""
    if found is None or report.replay is None:
        return report
    t, leaves, (before, rerun, after, lr) = found
    if any(not r.ok for r in report.steps if r.step <= t):  # a failure the digests show first: read as it is
        return report
    record = next((r for r in report.steps if r.step == t), None)
    if record is None:
        return report
    with_check = dataclasses.replace(record, optimizer_rerun=leaves)
    forms = optimizer_form(with_check, (before, rerun, after, lr, {}))
    return _rediagnosed(report, record, dataclasses.replace(with_check, forms=forms), rules)


def _weight_counted(record, task: Task) -> dict:
    """``{"weight_count": (N, noun)}`` for ``record``'s batch where its loss weight is known and some count
    differs from it (:func:`~shardcheck.parity.diagnosis.hypotheses.weight_count`, as a live check sets it), else
    ``{}``."""
    from shardcheck.parity.diagnosis.hypotheses import weight_count

    if record.loss_weight is None or record.weight_count is not None or record.step >= len(task.batches):
        return {}
    count = weight_count(task.batches[record.step], record.loss_weight)
    return {} if count is None else {"weight_count": count}


def _batch_keys(record, task: Task) -> dict:
    """``{"batch_keys": keys}`` of ``record``'s batch (:func:`~shardcheck.parity.diagnosis.evidence.batch_keys`:
    a mapping's keys beside its inputs and labels, what ``forward_differs`` says the loss reads), as a live check
    sets them at every step; ``{}`` where there are none or the record has them."""
    from shardcheck.parity.diagnosis.evidence import batch_keys

    if record.batch_keys or not 0 <= record.step < len(task.batches):
        return {}
    keys = batch_keys(task.batches[record.step])
    return {"batch_keys": keys} if keys else {}


def _without_refuted_drift(diagnoses: tuple, steps: tuple, num_shards) -> tuple:
    """``diagnoses`` where a ``drift`` ("state not carried between steps") said before the optimizer rerun is
    refuted by it (the rerun at that step differs: the step is faulty from equal inputs, ``DiagnosisContext.
    drifted``): replaced by the findings the live rules give the records with the rerun (``localized``)."""
    if not any(d.code == "drift" for d in diagnoses):
        return diagnoses
    from shardcheck.parity.diagnosis.localization import consistent
    from shardcheck.parity.diagnosis.rules import diagnose

    fresh = [d for d in consistent(diagnose(steps, num_shards), steps) if d.code != "parity"]
    if any(d.code == "drift" for d in fresh):
        return diagnoses
    codes = {d.code for d in diagnoses}
    added = [d for d in fresh if d.code not in codes]
    return tuple(f for d in diagnoses for f in (added if d.code == "drift" else [d]))


def _rerun_at(record, candidate, task: Task, mesh, num_shards, name, fn: str):
    """``(LeafErrors, matches, arrays, fields)`` at ``record``'s step: the optimizer rerun (the rerun the
    reference, the candidate's state after the step the candidate), or ``None`` where the step returns no
    gradients or the transformation needs more than ``(grads, state, params)``; ``matches``:
    ``("per_shard_mean",)`` where the candidate's state after the step is the mean of per-shard means' step from
    its state before, as a live check's hypothesis finds it (``fields``: ``{"per_shard_factor": c}`` where its
    returned gradients are c x that mean's, c not 1, else ``{}``), and ``"scale_blind"`` where only the gradients
    fail and the task's optimizer is
    blind to their scale (:func:`_scale_blind`), else empty; ``arrays``: ``(before, rerun, after)`` flat
    ``{path: array}`` of parameters and ``"opt_state <path>"`` leaves, then the learning rate the state holds and
    the returned gradients' elements at rounding level
    (:func:`~shardcheck.parity.harness.optimizer_rerun.near_zero`), or ``None`` with no rerun.
    ``None`` where the candidate's optimizer state is not the task's by path."""
    from flax import nnx

    from shardcheck._tree import copy_arrays
    from shardcheck.mesh import auto_typed
    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.harness.candidates import run_step
    from shardcheck.parity.harness.optimizer_rerun import (
        _rebuild,
        known_lr,
        near_zero,
        schedule_at_micro_steps,
        task_decay,
    )
    from shardcheck.parity.harness.recorded import _start
    from shardcheck.parity.harness.state import _default_view

    t = record.step
    model, optimizer, data, cand, mesh, _ = _start(fn, task, candidate, t + 1, num_shards, mesh, name)
    view = cand.view_optimizer or _default_view  # the candidate's optimizer state as the task's
    kwargs = {"mesh": mesh} if cand.pass_mesh else {}
    for s in range(t):
        run_step(fn, cand, model, optimizer, data[s], kwargs, s)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = copy_arrays(nnx.as_pure((params, rest)))  # the step may donate them
    like = jax.eval_shape(task.optimizer.init, params)  # the task's optimizer state, by path
    state = _rebuild(like, flatten_state(copy_arrays(nnx.as_pure(view(optimizer)[0]))))
    _, grads = run_step(fn, cand, model, optimizer, data[t], kwargs, t)
    if state is None:
        return None
    after = (nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(view(optimizer)[0]))
    # a step in JAX's explicit sharding mode: its arrays as Auto ones (the same buffers), which the task's loss
    # and optimizer and shardcheck's own programs take as a GSPMD step's (trial 38)
    params, rest, state, grads, after = auto_typed((params, rest, state, grads, after))
    before = (graphdef, params, rest, state)
    matches, fields = _hypotheses(record, task, num_shards, mesh, before, data[t], after, grads)
    fields.update(_gradient_form(record, task, before, data[t], grads))
    rerun = _rerun_from(task, params, state, grads)
    if rerun is None:
        return None, matches, None, fields
    arrays = tuple(
        {**flatten_state(p), **{f"opt_state {k}": v for k, v in flatten_state(o).items()}}
        for p, o in ((params, state), rerun, after)
    )
    quiet = near_zero(grads, record.atol)  # the live check allows them one by one, so the rerun does too
    compared = _compared(
        record, rerun, after, (params, state), _rerun_allowance(task, params, state, grads, record), quiet
    )
    # the learning rate the task's optimizer applied at this step: its state after the rerun holds it (an
    # inject_hyperparams state), or its schedule at the count before the step (issue #36)
    lr = known_lr(rerun[1], task.optimizer, params)
    fields["micro_step_lr"] = schedule_at_micro_steps(task.optimizer, params, rerun[1])
    return compared, matches, (*arrays, lr, quiet, task_decay(task.optimizer, params)), fields


def _gradient_form(record, task: Task, before, batch, grads) -> dict:
    """``{"forms": (("gradients", Form),)}`` where ``record`` is localized at its gradients, whose records read
    no simple form (:func:`~shardcheck.parity.diagnosis.form.form_from_leaves`: ratios at the recorded samples),
    while the candidate's returned ``grads`` differ from the task's gradient at the candidate's own pre-step
    state ``before = (graphdef, params, rest, opt_state)`` (equal inputs, as the optimizer rerun reads them) by
    an additive form: :func:`~shardcheck.parity.diagnosis.form.fit_form` on the failing leaves' arrays, as live
    (:func:`~shardcheck.parity.harness.optimizer_rerun.stage_forms`), of kind ``offset`` (an L2 term ``c * param``
    added to the gradients, a constant), which no ratio shows (issue #36: ``g + 0.05 p`` replayed read "no simple
    form ... ratio runs from -2.926 to 3.127" where live read the L2 term, c = 0.05). ``{}`` otherwise."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state, is_int, to_host
    from shardcheck.parity.diagnosis.form import fit_form
    from shardcheck.parity.diagnosis.localization import localize
    from shardcheck.parity.harness.optimizer_rerun import leaf_tolerances
    from shardcheck.parity.tolerance.allowances import _grads_at

    found = localize([record])
    if grads is None or found is None or found.stage != "gradients" or found.form is None:
        return {}
    if found.form.kind != "none":
        return {}
    graphdef, params, rest, _ = before
    try:
        ref = flatten_state(nnx.as_pure(_grads_at(task.loss_fn, graphdef, params, rest, batch)))
    except (TypeError, ValueError):  # a loss that needs the step's mesh or inputs: nothing to fit
        return {}
    cand, plain = flatten_state(nnx.as_pure(grads)), flatten_state(params)
    bad = [e.path for e in record.leaves if e.kind == "grad" and not e.ok]
    bad = [p for p in bad if p in ref and p in cand and p in plain and not is_int(cand[p])]
    if not bad:
        return {}
    form = fit_form(
        {},
        {p: to_host(ref[p]) for p in bad},
        {p: to_host(cand[p]) for p in bad},
        update=False,
        tol=leaf_tolerances([e for e in record.leaves if e.kind == "grad"]),
        params={p: to_host(plain[p]) for p in bad},
    )
    return {"forms": (("gradients", form),)} if form.kind == "offset" else {}


def _hypotheses(
    record, task: Task, num_shards, mesh, before, batch, after, grads
) -> tuple[tuple[str, ...], dict]:
    """``(matches, fields)`` of ``record``'s step, the live check's hypotheses
    (:func:`~shardcheck.parity.diagnosis.hypotheses._explained`) rerun from the candidate's own pre-step state
    ``before = (graphdef, params, rest, opt_state)`` on ``batch``, its state ``after`` the step and its returned
    ``grads``: the mean of per-shard means (:func:`_per_shard_match`); where that state is the recording's (step
    0, or hashed equal) what reads the recording's loss (the task's loss, per shard, per token block); at any step
    each shard's gradient clipped before the mean (it reads the candidate's own gradients at its own state:
    ``clip_per_shard``), a bfloat16 reduction, a step blind to the gradients' scale, and, where none of these
    matched, the mean of micro-batches' means (:func:`_micro_match`, ``micro_means``), as live at every step (a
    fault from step 1 or 2 on was named otherwise than live: issue #36)."""
    from shardcheck.parity.diagnosis.hypotheses import (
        clipped_per_shard,
        loss_per_shard,
        recording_loss_differs,
    )
    from shardcheck.parity.diagnosis.token_split import token_loss_value, token_split

    graphdef, params, rest, state = before
    matches, per_shard = _per_shard_match(record, task, num_shards, before, batch, after, grads)
    fields: dict = {} if per_shard is None else {"per_shard_factor": per_shard}
    split = token_split(mesh, batch) if loss_weight(task, 0) is not None else None
    if not matches and (record.step == 0 or record.identical_start):  # the recording's state: its loss?
        found = recording_loss_differs(task.loss_fn, graphdef, params, rest, batch, record)
        if found is not None:  # the replayed step returns this task's loss; the recording does not
            fields["task_loss"] = found
        elif loss_per_shard(task.loss_fn, num_shards, graphdef, params, rest, batch, record):
            matches = ("per_shard_loss_value",)
        elif token_loss_value(task.loss_fn, split, graphdef, params, rest, batch, record):
            matches = (
                "per_shard_mean_value",
            )  # a context-parallel step's per-block means, as live (trial 45)
            fields["token_split"] = split
    clip = not matches and "task_loss" not in fields
    if clip and clipped_per_shard(task.loss_fn, task.optimizer, num_shards, before[:3], batch, record, grads):
        matches = ("clip_per_shard",)  # each shard's gradient clipped before the mean, as live
    if not matches and _bf16_reduction(record, task, num_shards, before, batch, grads):
        matches = ("bf16_reduction",)  # off by a bfloat16 all-reduce's rounding, as live (trial 43)
    matches += _scale_blind(record, task, num_shards, params, state, grads)
    micro = (
        None
        if set(matches) - {"scale_blind"}
        else _micro_match(record, task, num_shards, before, batch, after, grads)
    )
    if micro is not None:
        matches, fields["micro_means"] = (*matches, "per_micro_mean"), micro
    return matches, fields


def _micro_match(
    record, task: Task, num_shards, before, batch, after, grads
) -> tuple[int, tuple[float, ...], str, float] | None:
    """``(k, weights, "blocks", c)`` where the candidate's state ``after`` the step is the task optimizer's step
    from its own state ``before`` (``(graphdef, params, rest, opt_state)``) on c times the mean of k micro-batches'
    own means (c over :func:`~shardcheck.parity.diagnosis.hypotheses.micro_factors`: 1, k, their sum, or 1/k;
    the batch's k blocks of rows, each its loss sum over its own weight, of unequal weights ``weights``), within
    the record's tolerances widened by that step's rounding, while the full batch's step from the same state
    differs; its returned ``grads`` (where given, and some fails) that gradient within the gradient
    tolerances. The live check's hypothesis (:func:`~shardcheck.parity.diagnosis.hypotheses._micro_batch_means`,
    over :data:`~shardcheck.parity.diagnosis.hypotheses.MICRO_BATCHES`, k other than the shard count), from the
    replay's own state. ``None`` otherwise, and for a mean loss."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.diagnosis.hypotheses import (
        MICRO_BATCHES,
        _scaled_params,
        hypothesis_rounding,
        micro_factors,
        shard_weights,
    )
    from shardcheck.parity.diagnosis.per_shard import per_shard_mean_grads

    if loss_weight(task, 0) is None:
        return None
    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    if grads is not None and tolerance and all(e.ok for e in record.leaves if e.kind == "grad"):
        return None  # the gradients match: not a gradient the micro-batches' means give
    graphdef, params, rest, state = before
    leaves = jax.tree.leaves(batch)
    rows = leaves[0].shape[0] if leaves and getattr(leaves[0], "ndim", 0) else 0
    tx, cand = task.optimizer, None if grads is None else flatten_state(nnx.as_pure(grads))
    for k in MICRO_BATCHES:
        if k == num_shards or rows < 2 * k or rows % k:
            continue
        weights = shard_weights(task.loss_fn, k, graphdef, params, rest, batch)
        if weights is None or max(weights) - min(weights) <= 1e-6 * max(abs(w) for w in weights):
            continue  # equal micro-batches: their means averaged are the full batch's mean
        mean, full = (per_shard_mean_grads(task.loss_fn, s, graphdef, params, rest, batch) for s in (k, 1))
        if mean is None or full is None:
            continue
        for c in micro_factors(k, cand, mean, tolerance):
            alt = _scaled_params(tx, params, state, mean, c)
            scaled = mean if c == 1.0 else jax.tree.map(lambda g, c=c: (g * c).astype(g.dtype), mean)
            rounding = hypothesis_rounding(tx, scaled, state, params, record.rtol, record.atol)
            near = _compared(record, alt, after, (params, state), rounding)
            apart = _compared(record, alt, _scaled_params(tx, params, state, full, 1.0), (params, state))
            if all(e.ok for e in near) and not all(e.ok for e in apart):
                return k, tuple(float(w) for w in weights), "blocks", c
    return None


def _bf16_reduction(record, task: Task, num_shards, before, batch, grads) -> bool:
    """Whether ``record``'s failing leaves are each within a bfloat16 all-reduce's rounding of the gradients, as
    the live check's hypothesis reads it (:func:`~shardcheck.parity.diagnosis.hypotheses._low_precision_reduction`):
    the bound ``2 eps_bf16 sqrt(S) sum_s |g_s| / W`` per gradient element, from the task's loss on each shard of
    ``batch`` at the candidate's pre-step ``before = (graphdef, params, rest, state)``, propagated through the
    task's optimizer on the candidate's returned ``grads``; each digest's error against its own tolerance widened
    by that bound in the digest's own measure (``tolerance / (atol + rtol max|x|)``: a norm's is its size's square
    root), and one at least 1/64 of it (bfloat16's scale, not float32's). ``False`` where the loss differs (no
    reduction changes the forward pass), no gradients were returned, the model computes in less than float32
    (its matmul operands: a bfloat16 model's own rounding reads the same), or the model does not run on a
    shard."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state, host_tree
    from shardcheck.parity.harness.optimizer_rerun import _rebuild
    from shardcheck.parity.tolerance.allowances import _shard_magnitude
    from shardcheck.parity.tolerance.derive import MOMENT_FACTOR
    from shardcheck.parity.tolerance.precision import traced_compute_dtype
    from shardcheck.parity.tolerance.propagation import grad_delta, update_sensitivity

    s = num_shards
    if grads is None or not s or s < 2 or any(e.kind == "loss" and not e.ok for e in record.leaves):
        return False
    graphdef, params, rest, state = before
    try:
        least = traced_compute_dtype(task.loss_fn, nnx.merge(graphdef, params, rest), batch)
        if least is not None and jnp.finfo(least).bits < 32:
            return False
        magnitude, _, _ = _shard_magnitude(task.loss_fn, s, graphdef, params, rest, batch)
    except (TypeError, ValueError):  # a model that does not run on a shard: no hypothesis of its shards
        return False
    grads = _rebuild(params, flatten_state(nnx.as_pure(grads)))
    if grads is None:
        return False
    bound = 2.0 * float(jnp.finfo(jnp.bfloat16).eps) * math.sqrt(s)
    delta = grad_delta(grads, magnitude, record.rtol, record.atol, bound)
    try:
        updates, states, _ = update_sensitivity(task.optimizer, grads, state, params, delta)
    except (TypeError, ValueError):  # a transformation that needs more than (grads, state, params)
        return False
    allowed = {
        "grad": {k: bound * v for k, v in host_tree(magnitude).items()},
        "param": host_tree(updates),
        "opt_state": host_tree(states),
    }
    used = []
    for e in record.leaves:
        if e.ok:
            continue
        if e.kind not in allowed:
            return False
        extra = float(np.max(allowed[e.kind].get(e.path, np.inf), initial=0.0))
        rtol = record.rtol * (MOMENT_FACTOR if e.kind == "opt_state" else 1.0)
        atol = record.atol * (MOMENT_FACTOR if e.kind == "opt_state" else 1.0)
        top = e.max_abs_err / e.max_rel_err if e.max_rel_err and math.isfinite(e.max_rel_err) else 0.0
        measure = max(e.tolerance / (atol + rtol * top), 1.0) if atol + rtol * top > 0 else 1.0
        if not (math.isfinite(extra) and e.max_abs_err <= e.tolerance + measure * extra):
            return False
        used.append(e.max_abs_err / max(measure * extra, 1e-30))
    return bool(used) and max(used) > 1 / 64


def _rerun_from(task: Task, params, state, grads):
    """``(params, opt_state)`` after the task's optimizer step on the candidate's returned ``grads`` (rebuilt
    by path), or ``None`` where it returned none or the transformation needs more than ``(grads, state,
    params)``."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.harness.optimizer_rerun import _rebuild, _try_rerun

    grads = None if grads is None else _rebuild(params, flatten_state(nnx.as_pure(grads)))
    return None if grads is None else _try_rerun(task.optimizer, params, state, grads)


def _scale_blind(record, task: Task, num_shards, params, state, grads) -> tuple[str, ...]:
    """``("scale_blind",)`` where only ``record``'s gradients fail and the task's optimizer, stepped from the
    candidate's pre-step ``(params, state)`` on S times and 1/S times the candidate's returned ``grads``, moves no
    compared parameter or optimizer-state leaf beyond its tolerance
    (:func:`~shardcheck.parity.diagnosis.hypotheses.blind_to_scale`, the live check's hypothesis, which reads the
    reference's gradient: the candidate's is the one the replay has, and a factor c between the two is blind
    either way); else ``()`` (also where the step returns no gradients or the optimizer needs more than
    ``(grads, state, params)``). With it, the live rules read the gradients' factor (``summed``,
    ``averaged_twice``) as a live check does."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.diagnosis.hypotheses import blind_to_scale
    from shardcheck.parity.harness.optimizer_rerun import _rebuild

    if grads is None or {e.kind for e in record.leaves if not e.ok} != {"grad"}:
        return ()
    grads = _rebuild(params, flatten_state(nnx.as_pure(grads)))
    try:
        blind = grads is not None and blind_to_scale(
            task.optimizer, grads, state, params, num_shards, record.leaves
        )
    except (TypeError, ValueError):
        return ()
    return ("scale_blind",) if blind else ()


def _per_shard_match(
    record, task: Task, num_shards, before, batch, after, grads=None
) -> tuple[tuple[str, ...], float | None]:
    """``(("per_shard_mean",), c)`` (``("per_shard_loss",)`` where the shards carry equal weights:
    :func:`~shardcheck.parity.diagnosis.hypotheses.equal_shard_weights`) where the candidate's state ``after`` the
    step is, leaf by leaf, the task optimizer's step on c times the mean of per-shard means' gradient from its own
    state ``before`` it (``(graphdef, params, rest, opt_state)``), within the record's tolerances widened by that
    step's own rounding (:func:`~shardcheck.parity.diagnosis.hypotheses.hypothesis_rounding`), and that step
    differs from the full batch's from the same state (the live check's ``per_shard_mean`` hypothesis, which also
    asks that the reference's differ from it: with equal weights per shard the two are one step, and every
    candidate whose update matches would reproduce it). c: the factor of the candidate's returned ``grads`` over
    that gradient (:func:`~shardcheck.parity.diagnosis.hypotheses.fitted_factor`: 1 without gradients; the
    returned ``c`` is ``None`` where it is 1); gradients that are no one factor of it refute it, and so do
    gradients c (not 1) times the full batch's too (shards of equal weight: a factor the rules name). ``((), None)``
    otherwise, and for a mean loss, one shard, or a model that does not run per shard."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.diagnosis.hypotheses import (
        _scaled_params,
        equal_shard_weights,
        fitted_factor,
        hypothesis_rounding,
    )
    from shardcheck.parity.diagnosis.per_shard import per_shard_mean_grads

    if not num_shards or num_shards < 2 or loss_weight(task, 0) is None:
        return (), None
    graphdef, params, rest, state = before
    mean, full = (
        per_shard_mean_grads(task.loss_fn, s, graphdef, params, rest, batch) for s in (num_shards, 1)
    )
    if mean is None or full is None:
        return (), None
    c = 1.0
    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    if grads is not None and tolerance:
        cand = flatten_state(nnx.as_pure(grads))
        c = fitted_factor(cand, flatten_state(mean), tolerance)
        if c is None:
            return (), None
        if abs(c - 1.0) > 1e-3 and fitted_factor(cand, flatten_state(full), tolerance) is not None:
            return (
                (),
                None,
            )  # a factor of the full batch's gradient too (shards of equal weight): not per shard
    tx = task.optimizer
    alt = _scaled_params(tx, params, state, mean, c)
    scaled = jax.tree.map(lambda g: (g * c).astype(g.dtype), mean)
    rounding = hypothesis_rounding(tx, scaled, state, params, record.rtol, record.atol)
    apart = _compared(record, alt, _scaled_params(tx, params, state, full, 1.0), (params, state))
    excess = _recorded_excess(record, apart)  # the digest comparison's compute rounding (bfloat16), else ~0
    widened = tuple(
        {p: own.get(p, 0.0) + more.get(p, 0.0) for p in {*own, *more}}
        for own, more in zip(rounding, excess, strict=True)
    )
    near = _compared(record, alt, after, (params, state), widened)
    reproduced = all(e.ok for e in near)
    differs = not all(e.ok for e in apart)
    if reproduced and any(excess):  # within the replay's own allowance: closer to it than the full batch's is
        extra = {**excess[0], **excess[1]}
        off = max((e.max_abs_err / (e.tolerance + extra.get(e.path, 0.0)) for e in apart), default=0.0)
        reproduced = max((e.max_abs_err / e.tolerance for e in near), default=0.0) <= off / PER_SHARD_MARGIN
    if not (reproduced and differs):
        return (), None
    equal = equal_shard_weights(task.loss_fn, num_shards, graphdef, params, rest, batch)
    return ("per_shard_loss",) if equal else ("per_shard_mean",), None if abs(c - 1.0) <= 1e-3 else c


# how much closer (in shares of the replay's tolerances) the candidate's step must lie to the per-shard means' step
# than the full batch's step does, where the replay's compute rounding widens them (bfloat16)
PER_SHARD_MARGIN = 4.0


def _recorded_excess(record, compared) -> tuple[dict, dict]:
    """``({param path: float}, {opt_state path: float})``: how much more the replay's digest comparison allowed each
    leaf of ``record`` than the rerun's own tolerance of it (``compared``, :func:`_compared`'s leaves): the
    compute dtype's rounding of a bfloat16 replay (``16 eps_c sqrt(t + 1)`` of the recorded size), which the
    rerun's float32 ``rtol`` / ``atol`` leave out; empty where nothing is (issue #36, trial 18: a bfloat16 replay
    of the mean of per-shard means was 29 x the rerun's tolerance from that step, 0.06 x the replay's)."""
    allowed = {(e.kind, e.path): e.tolerance for e in record.leaves}
    out: tuple[dict, dict] = ({}, {})
    for e in compared:
        extra = allowed.get((e.kind, e.path), 0.0) - e.tolerance
        if np.isfinite(extra) and extra > 0:
            out[e.kind == "opt_state"][e.path] = extra
    return out


def _rerun_allowance(task: Task, params, state, grads, record) -> tuple[dict, dict] | None:
    """``({param path: array}, {opt_state path: array})``: the gradient's tolerance ``atol + rtol max|g|`` (the
    record's) propagated through the task's optimizer update from the candidate's pre-step ``(params, state)`` at
    its returned ``grads`` (:func:`~shardcheck.parity.diagnosis.hypotheses.hypothesis_rounding`), the allowance a
    live check's optimizer rerun holds each element to (``run.allowance``, ``run.state_allowance``: its applied
    parameters' own). Without it a replay's rerun held the elements whose gradient lies a few ``atol`` from 0,
    whose Adam update the gradient's tolerance moves by up to ``lr``, to ``atol + rtol max|x|`` alone (trial 47, a
    clip by each slice's own norm: "the optimizer's update from equal inputs: differs (8 of 38 parameters" beside
    live's 0 of 38, every error at such an element). ``None`` where the step returns no gradients or the
    optimizer needs more than ``(grads, state, params)``."""
    from flax import nnx

    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.diagnosis.hypotheses import hypothesis_rounding
    from shardcheck.parity.harness.optimizer_rerun import _rebuild

    grads = None if grads is None else _rebuild(params, flatten_state(nnx.as_pure(grads)))
    if grads is None:
        return None
    try:
        return hypothesis_rounding(task.optimizer, grads, state, params, record.rtol, record.atol)
    except (TypeError, ValueError):  # a transformation that needs more than (grads, state, params)
        return None


def _compared(record, rerun, after, before, rounding=None, quiet=None) -> tuple:
    """Each float leaf of the rerun ``(params, opt_state)`` against the candidate's ``after``, from ``before``,
    at ``record``'s tolerances (optimizer state: x ``MOMENT_FACTOR``), as the live check's rerun. A parameter
    whose gradient is at rounding level (``record.unresolved``) gets, as the digest comparison gives it, an
    allowance of both sides' largest update (a normalizing optimizer's update of rounding noise); one only some
    of whose elements are (``quiet``: ``{param path: bool array}``,
    :func:`~shardcheck.parity.harness.optimizer_rerun.near_zero`) gets it on those elements alone.
    ``rounding``: ``({param path: array}, {opt_state path: array})`` allowances added (a hypothesis's own
    rounding, :func:`~shardcheck.parity.diagnosis.hypotheses.hypothesis_rounding`), or ``None``."""
    from shardcheck.parity.comparison.live import flatten_state, is_int, leaf_error, to_host
    from shardcheck.parity.tolerance.derive import MOMENT_FACTOR

    noise = {name.removeprefix("param ") for name in record.unresolved}
    out = []
    for kind, ref, cand, was, factor in zip(
        ("param", "opt_state"), rerun, after, before, (1.0, MOMENT_FACTOR), strict=True
    ):
        cand, was = flatten_state(cand), flatten_state(was)
        for path, value in flatten_state(ref).items():
            if path not in cand or is_int(value):
                continue
            b, r, c = to_host(was[path]), to_host(value), to_host(cand[path])
            rtol, atol = factor * record.rtol, factor * record.atol
            allowance = None
            if kind == "param" and (path in noise or path in (quiet or {})):
                allowance = float(np.max(np.abs(r - b), initial=0.0) + np.max(np.abs(c - b), initial=0.0))
                near = None if path in noise else quiet[path]
                if near is not None and near.shape == r.shape:
                    allowance = np.where(near, allowance, 0.0)
            own = None if rounding is None else rounding[kind == "opt_state"].get(path)
            if own is not None:
                allowance = own if allowance is None else own + allowance
            out.append(leaf_error(record.step, kind, path, r, c, rtol, atol, b, b, allowance))
    return tuple(out)


def against_recording(call: Mapping[str, Any]) -> ParityReport:
    """:func:`check_against_recording` of ``check_parity``'s arguments ``call`` (its ``locals()``), whose
    ``reference`` is a recording (:func:`is_recording`); ``accept_weak`` as a live check's (a replay's verdict
    reads the scale evidence from the digests)."""
    keys = (
        "steps",
        "num_shards",
        "mesh",
        "rtol",
        "atol",
        "name",
        "matmul_precision",
        "compute_dtype",
        "accept_weak",
    )
    options = {k: call[k] for k in keys}
    unsupported = {k: call[k] for k in UNSUPPORTED}
    return check_against_recording(
        call["candidate"], call["task"], call["reference"], **options, **unsupported
    )


__all__ = [
    "against_recording",
    "check_against_recording",
    "is_recording",
    "loss_weight",
    "with_optimizer_rerun",
]
