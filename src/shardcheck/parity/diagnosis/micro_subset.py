"""An accumulation that left micro-batches out: the update is the optimizer's step on some micro-batches' gradient.

A step that accumulates k micro-batches by hand (a Python loop, a ``jax.lax.scan``) and overwrites its accumulator
where it was to add to it (``acc = g``: the last micro-batch's gradient alone), or stops one micro-batch early,
applies the gradient of some of the k micro-batches. Trial 59's read "no constant factor ... ratio runs from 0 to
1", and where the micro-batches were strided (rows i::k) a generic ``forward_differs``.

Where no shard subset fits (:func:`~shardcheck.parity.diagnosis.shard_subset.shard_subset`), :func:`micro_subset`
computes each row's gradient of its loss once, at the reference's pre-step state
(:func:`~shardcheck.parity.diagnosis.per_shard.shard_terms` over the B rows, for a batch of at most
:data:`MAX_ROWS`), sums them into the k micro-batches of each :data:`LAYOUTS` (k in
:data:`~shardcheck.parity.diagnosis.hypotheses.MICRO_BATCHES` dividing B), and tries the first and the last alone and
all but the first or the last (:func:`ends`) as the shard subsets are tried
(:func:`~shardcheck.parity.diagnosis.shard_subset.first_subset`).
"""

from __future__ import annotations

import jax
import numpy as np

from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.parity.diagnosis.grouping import words_and
from shardcheck.parity.diagnosis.per_shard import shard_terms
from shardcheck.task import batch_size

MAX_ROWS = 64
"""The largest batch whose rows' gradients are computed one by one (B gradients held at once)."""

LAYOUTS = ("blocks", "strided")
"""How a step cuts B rows into k micro-batches: blocks of B/k consecutive rows, or rows i::k (every k-th row)."""


def members(rows: int, k: int, layout: str) -> np.ndarray:
    """``[k, rows]`` float32: 1 where a row belongs to a micro-batch of ``layout`` (:data:`LAYOUTS`)."""
    m = np.zeros((k, rows), np.float32)
    for j in range(k):
        rows_of = (
            np.arange(j * rows // k, (j + 1) * rows // k) if layout == "blocks" else np.arange(j, rows, k)
        )
        m[j, rows_of] = 1.0
    return m


def row_terms(run, pre, batch):
    """Each row's gradient of its loss and its weight (:func:`~shardcheck.parity.diagnosis.per_shard.shard_terms`
    over the B rows) at the reference's pre-step state; ``None`` above :data:`MAX_ROWS` rows or where the rows do
    not trace one by one. The shards' and the micro-batches' sums are read from it (:func:`grouped`), and the
    fitted clip's shard means (:mod:`~shardcheck.parity.diagnosis.shard_clip`): computed once a failing step
    (``_Run.read_once``)."""

    def read():
        rows = batch_size(batch)
        if rows > MAX_ROWS:
            return None
        terms = shard_terms(run.task.loss_fn, rows, pre.graphdef, pre.params, pre.rest, batch)
        return None if terms is None else (jax.tree.map(np.asarray, terms[0]), terms[1])

    return run.read_once("rows", read)


def grouped(terms, m: np.ndarray):
    """``terms`` (``(stack, weights)`` over rows) summed into the groups of ``m`` (``[k, rows]``, 0 or 1), on the
    host (float64 sums in the stack's dtype)."""
    stack, weights = terms
    m = m.astype(np.float64)

    def summed(g):
        g = np.asarray(g)
        return np.tensordot(m, g.astype(np.float64), axes=1).astype(g.dtype)

    return jax.tree.map(summed, stack), m @ weights


def ends(k: int) -> list[tuple[int, ...]]:
    """The micro-batch subsets tried: the last alone (an accumulator overwritten), the first alone, all but the
    last (a loop stopped early), all but the first; not every subset, as for shards (up to 2k optimizer reruns
    a layout and k, where a step returns no gradients to fit)."""
    every = tuple(range(k))
    return list(dict.fromkeys([(k - 1,), (0,), every[:-1], every[1:]]))


def micro_subset(run, pre, record: StepRecord, rtol, atol, cand_grads, rows):
    """``(kept, k, division, layout)`` where the candidate's step is the reference optimizer's on the gradient of
    the micro-batches ``kept`` only, of k micro-batches of ``layout``, divided as ``division`` says (the module
    docstring), read from ``rows`` (:func:`row_terms`); ``None`` where none does. The k blocks of a shard's size
    are the shard subsets' own, not tried again."""
    from shardcheck.parity.diagnosis.hypotheses import MICRO_BATCHES
    from shardcheck.parity.diagnosis.shard_subset import first_subset

    n, s = len(rows[1]), run.cand.num_shards or 1
    for k in MICRO_BATCHES:
        if n % k or n < 2 * k:
            continue
        for layout in LAYOUTS:
            if layout == "blocks" and k == s:
                continue
            micro = grouped(rows, members(n, k, layout))
            found = first_subset(run, pre, record, rtol, atol, cand_grads, micro, ends(k))
            if found is not None:
                return (*found, layout)
    return None


def micro_clause(subset: tuple[tuple[int, ...], int, str, str], weighted: bool) -> str:
    """:func:`micro_subset`'s reading in words: which micro-batches, divided by what, the likely mistakes and the
    fix."""
    kept, k, division, layout = subset
    rows = "consecutive rows" if layout == "blocks" else f"rows i::{k}, every {k}th row"
    from shardcheck.parity.diagnosis.shard_subset import divided_words

    left = [i for i in range(k) if i not in kept]
    full = "the batch's total weight" if weighted else f"k = {k}"
    if len(kept) == 1:
        which = f"micro-batch {kept[0]}'s gradient alone (of {k} micro-batches of {rows})"
        said = ", as the accumulated sum is"
        divided = divided_words(kept, k, division, full=full, mine="", full_said=said)
    else:
        which = (
            f"the gradient of micro-batches {words_and(kept)} of {k} only (micro-batch {words_and(left)} left "
            f"out; micro-batches of {rows})"
        )
        mine = "those micro-batches' own weight" if weighted else f"their own count, {len(kept)}"
        said = ", as the full accumulation's"
        divided = divided_words(kept, k, division, full=full, mine=mine, full_said=said)
    return (
        f"the step applied the optimizer's update to {which}, {divided}: an accumulation that left micro-batches "
        "out (an accumulator overwritten where it was to be added to, which keeps the last micro-batch's gradient; "
        "a loop that stops a micro-batch early); add every micro-batch's gradient, then divide once."
    )
