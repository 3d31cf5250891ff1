"""A reduction that left batch shards out: the update is the optimizer's step on some shards' gradient only.

A data-parallel step whose psum masks a device's gradient (``jnp.where(axis_index == k, 0, g)``), broadcasts one
device's gradient in place of the all-reduce, or reduces over a subset of the devices, applies the gradient of
some of the S batch shards. Trial 57's "only shard 0's gradient" read "Only the loss matches ... no constant
factor", and "the last shard left out" (divided by S, or by S - 1) "no simple form".

:func:`shard_subset` tries, at the first failing step and from the reference's pre-step state, every shard alone
and every shard but one, divided as the full batch's gradient is (by S; a ``(loss_sum, weight)`` loss by the
batch's total weight), by the kept shards' own count (weight), or (a loss whose shards weigh unequally) by the
total weight and scaled by S over the shards kept, as for their share of it (trial 58 C1: device 0's gradient
broadcast x S / W read "no simple form"): where the candidate's returned gradients are that
gradient, or its parameters and optimizer state are the reference optimizer's step on it, the record says which
(``StepRecord.shard_subset``), and :func:`with_shard_subset` says it first in the leading finding where that is a
generic one (``localized``, ``loss_only``, ``update_differs``, ``forward_differs``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state
from shardcheck.parity.diagnosis.evidence import Diagnosis, StepRecord
from shardcheck.parity.diagnosis.grouping import words_and
from shardcheck.parity.diagnosis.per_shard import shard_terms

GENERIC = ("localized", "loss_only", "update_differs", "forward_differs")
"""The leading findings that name no cause: the shards' reading is said first in them."""


def subsets(num_shards: int) -> list[tuple[int, ...]]:
    """Every shard alone, then every shard but one (S >= 2; each subset once)."""
    alone = [(j,) for j in range(num_shards)]
    but_one = [tuple(i for i in range(num_shards) if i != j) for j in range(num_shards)]
    return list(dict.fromkeys(alone + but_one))


DIVISIONS = ("full", "own", "share")
"""How the kept shards' gradient sum is divided: by the full batch's count (weight), by the kept shards' own, or
by the full batch's and scaled by S / (shards kept), their share of it (``"share"``: tried where the shards'
weights differ; otherwise it is ``"own"``)."""


def _combined(stack, weights, kept: tuple[int, ...], division: str):
    """The kept shards' gradient sum, divided as ``division`` (:data:`DIVISIONS`) says, on the host (``stack``:
    NumPy arrays, summed in float64 and returned in their dtype: a few hundred eager device ops a failing check
    took seconds); ``None`` where the kept shards weigh 0 and their own weight divides."""
    mask = np.zeros(len(weights), np.float64)
    mask[list(kept)] = 1.0
    total = float(np.sum(weights))
    denominator = {
        "full": total,
        "own": float(np.sum(weights * mask)),
        "share": total * len(kept) / len(weights),
    }[division]
    if denominator == 0.0:  # kept parts that weigh nothing: no such mean
        return None
    return jax.tree.map(lambda g: (np.tensordot(mask, g, axes=1) / denominator).astype(g.dtype), stack)


def _terms(run, pre, batch):
    """:func:`~shardcheck.parity.diagnosis.per_shard.shard_terms` of the task's loss at ``pre``."""
    return shard_terms(run.task.loss_fn, run.cand.num_shards, pre.graphdef, pre.params, pre.rest, batch)


def shard_subset(run, pre, batch, record: StepRecord, rtol, atol, cand_grads=None):
    """``(kept, S, division, "shards")`` where the candidate's step is the reference optimizer's on the gradient
    of the shards ``kept`` only (:func:`subsets`), divided as ``division`` (:data:`DIVISIONS`) says: its returned
    gradients that gradient (within the record's gradient tolerances), and its parameters and optimizer state that
    step's (within the hypothesis's rounding); else the same of micro-batches
    (:func:`~shardcheck.parity.diagnosis.micro_subset.micro_subset`, ``(kept, k, division, layout)``); ``None``
    where none does, on a loss that couples the rows, or against a reference step of the user's (on one shard,
    micro-batches only)."""
    from shardcheck.parity.diagnosis.micro_subset import grouped, members, micro_subset, row_terms

    s = run.cand.num_shards or 1
    if run.reference is not None or run.rows_coupled:
        return None
    rows = row_terms(run, pre, batch)  # the shards' sums read from the rows', one program for both
    if s < 2:
        terms = None
    elif rows is not None:
        terms = grouped(rows, members(len(rows[1]), s, "blocks"))
    else:
        terms = _terms(run, pre, batch)
    found = None if terms is None else first_subset(run, pre, record, rtol, atol, cand_grads, terms)
    if found is not None:
        return (*found, "shards")
    return None if rows is None else micro_subset(run, pre, record, rtol, atol, cand_grads, rows)


def first_subset(run, pre, record: StepRecord, rtol, atol, cand_grads, terms, tried=None):
    """``(kept, n, division)``: the first of ``tried`` (default :func:`subsets`) of the n parts whose gradient sums
    and weights ``terms`` holds (``(stack, weights)``, :func:`~shardcheck.parity.diagnosis.per_shard.shard_terms`),
    and of :data:`DIVISIONS`, that the candidate reproduces; ``None`` where none does."""
    from shardcheck.parity.diagnosis.hypotheses import (
        _reproduces,
        _scaled_params,
        fitted_factor,
        hypothesis_rounding,
    )

    tolerance = {e.path: e.tolerance for e in record.leaves if e.kind == "grad"}
    cand = flatten_state(nnx.as_pure(cand_grads)) if cand_grads is not None and tolerance else None
    tx = run.ref_opt.tx
    terms = (jax.tree.map(np.asarray, terms[0]), terms[1])  # on the host once
    divisions = DIVISIONS if np.ptp(terms[1]) > 0 else DIVISIONS[:2]
    n = len(terms[1])
    for kept in subsets(n) if tried is None else tried:
        for division in divisions:
            grads = _combined(*terms, kept, division)
            if grads is None:
                continue
            if cand is not None:
                c = fitted_factor(cand, flatten_state(grads), tolerance)
                if c is None or abs(c - 1.0) > 1e-3:
                    continue
            rounding = hypothesis_rounding(tx, grads, pre.opt_state, pre.params, rtol, atol)
            if _reproduces(
                run, *_scaled_params(tx, pre.params, pre.opt_state, grads, 1.0), rtol, atol, rounding
            ):
                return kept, n, division
    return None


def divided_words(
    kept: tuple[int, ...], n: int, division: str, *, full: str, mine: str, full_said: str
) -> str:
    """How the kept parts (of n shards or micro-batches) were divided, in words: ``division`` of
    :data:`DIVISIONS`, ``full`` the whole's count or weight, ``mine`` the kept parts' own (several kept),
    ``full_said`` what follows the whole's."""
    one = len(kept) == 1
    share = f"x {n}" if one else f"x {n}/{len(kept)}"
    them = ("it", "its") if one else ("they", "their")
    return {
        "own": f"in place of the mean over all {n}" if one else f"divided by {mine}",
        "full": f"divided by {full}{full_said}",
        "share": f"divided by {full} and scaled {share}, as if {them[0]} weighed {them[1]} share of the batch",
    }[division]


def subset_clause(subset: tuple[tuple[int, ...], int, str, str], weighted: bool) -> str:
    """The reading in words: which shards, divided by what (``subset``: :func:`shard_subset`'s), the likely
    mistakes and the fix; of micro-batches, :func:`~shardcheck.parity.diagnosis.micro_subset.micro_clause`."""
    kept, s, division, parts = subset
    if parts != "shards":
        from shardcheck.parity.diagnosis.micro_subset import micro_clause

        return micro_clause(subset, weighted)
    left = [i for i in range(s) if i not in kept]
    full = "the batch's total weight" if weighted else f"S = {s}"
    if len(kept) == 1:
        which = f"shard {kept[0]}'s gradient alone (of {s} batch shards)"
        divided = divided_words(kept, s, division, full=full, mine="", full_said="")
    else:
        which = f"the gradient of shards {words_and(kept)} of {s} only (shard {words_and(left)} left out)"
        mine = "those shards' own weight" if weighted else f"their own count, {len(kept)}"
        divided = divided_words(kept, s, division, full=full, mine=mine, full_said=", as the full batch's")
    return (
        f"the step applied the optimizer's update to {which}, {divided}: a reduction that left shards out (a "
        "psum whose input masks a device's gradient, one device's gradient broadcast in place of the all-reduce, "
        "or a reduction over a subset of the devices); reduce every shard's gradient (jax.lax.pmean over every "
        f"batch axis, or a psum of the loss sums and the weights, divided once). In a step that accumulates {s} "
        "micro-batches of consecutive rows the numbers are the same: there, the update took those micro-batches' "
        "gradient only (a loop that stops early, a gradient overwritten where it was to be added)."
    )


def with_shard_subset(findings, records, weighted: bool) -> list[Diagnosis]:
    """``findings`` with :func:`subset_clause` said first in the leading finding where that names no cause
    (:data:`GENERIC`) and the first failing record carries a ``shard_subset``; else as they are."""
    findings = list(findings)
    first = next((r for r in records if not r.ok), None)
    if not findings or first is None or first.shard_subset is None or findings[0].code not in GENERIC:
        return findings
    lead = findings[0]
    said = f"At step {first.step} {subset_clause(first.shard_subset, weighted)} {lead.message}"
    return [dataclasses.replace(lead, message=said), *findings[1:]]
