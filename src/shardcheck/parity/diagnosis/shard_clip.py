"""A clip applied to each shard's gradient at a norm of the step's own: its max norm, fitted.

A data-parallel step that clips each shard's local gradient before the all-reduce, at the task's
``optax.clip_by_global_norm`` norm, is named ``clip_per_shard`` by the hypothesis of
:func:`~shardcheck.parity.diagnosis.hypotheses.clipped_per_shard`. A step that clips with a constant of its own
(``g * min(1, 0.5 / norm(g))`` inside its ``jax.shard_map``, or a clip where the task has none) read "no constant
factor ... no simple form" (trial 58 C2).

With each shard's own mean gradient ``m_s`` and its global L2 norm ``n_s``, the step's gradient is, for the k
shards whose norm exceeds the max norm M (the k largest),

    g(M) = (1/S) sum_{s not clipped} m_s + M (1/S) sum_{s clipped} m_s / n_s,

linear in M. :func:`fitted_shard_clip` fits M by least squares (float64) for each k = 1..S, keeps the M that
lies where it clips exactly those k shards, and accepts it where the candidate's returned gradients are ``g(M)``
within each leaf's tolerance. Under a ``(loss_sum, weight)`` loss the shards' means are averaged plainly, or by
each shard's weight over the batch's, as the ``clip_per_shard`` hypothesis reads them.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state, to_host
from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.parity.diagnosis.per_shard import shard_terms


def _shard_means(run, pre, batch) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """``({path: [S, ...] float64}, weights [S])``: each shard's own mean gradient (its loss sum's gradient over
    its weight), summed from each row's (:func:`~shardcheck.parity.diagnosis.micro_subset.row_terms`, the program
    the shard subsets read too), else from :func:`~shardcheck.parity.diagnosis.per_shard.shard_terms`; ``None``
    where it does not trace or a shard weighs 0."""
    from shardcheck.parity.diagnosis.micro_subset import grouped, members, row_terms

    s = run.cand.num_shards
    rows = row_terms(run, pre, batch)
    if rows is not None:
        terms = grouped(rows, members(len(rows[1]), s, "blocks"))
    else:
        terms = shard_terms(run.task.loss_fn, s, pre.graphdef, pre.params, pre.rest, batch)
    if terms is None or not np.all(terms[1] > 0):
        return None
    stack, weights = terms
    flat = flatten_state(nnx.as_pure(stack))
    means = {p: np.asarray(to_host(g), np.float64) / _column(weights, g.ndim) for p, g in flat.items()}
    return means, weights


def _column(weights: np.ndarray, ndim: int) -> np.ndarray:
    return weights.reshape((-1,) + (1,) * (ndim - 1))


def _fit(cand: dict, means: dict, coeffs: np.ndarray, norms: np.ndarray, tolerance: dict) -> float | None:
    """The max norm M whose clip of the shards' means ``means``, combined with ``coeffs`` (the shards' shares of
    the mean), gives ``cand`` within ``tolerance`` on every leaf, clipping exactly the shards whose norm exceeds
    it; ``None`` where none does."""
    order = np.argsort(-norms)
    for k in range(1, len(norms) + 1):
        clipped = np.zeros(len(norms), bool)
        clipped[order[:k]] = True
        offset = {p: np.tensordot(coeffs * ~clipped, m, axes=1) for p, m in means.items()}
        slope = {p: np.tensordot(coeffs * clipped / norms, m, axes=1) for p, m in means.items()}
        num = sum(float(np.sum((cand[p] - offset[p]) * slope[p])) for p in tolerance)
        den = sum(float(np.sum(slope[p] ** 2)) for p in tolerance)
        if den == 0.0:
            continue
        m = num / den
        below = norms[order[k]] if k < len(norms) else 0.0
        if not (below <= m < norms[order[k - 1]]):
            continue
        if all(np.max(np.abs(cand[p] - offset[p] - m * slope[p])) <= tolerance[p] for p in tolerance):
            return m
    return None


def fitted_shard_clip(run, pre, batch, record: StepRecord, cand_grads) -> float | None:
    """The max norm M of a global-norm clip that the candidate applied to each shard's own gradient before
    averaging them (module docstring), where its returned gradients ``cand_grads`` are that, within the
    record's gradient tolerances, and some of them fail; ``None`` where they are not, where every returned
    gradient matches the reference's (a clip just below the largest shard norm changes the mean by less than
    its tolerance: the bug reports' optimizer faults read as clips), with one shard, without returned gradients,
    on a loss that couples the rows, against a reference step of the user's, or where the shards do not trace.
    Runs one per-shard gradient computation (jitted) and ``S`` least-squares fits on the host (float64)."""
    s = run.cand.num_shards or 1
    grads = [e for e in record.leaves if e.kind == "grad"]
    tolerance = {e.path: e.tolerance for e in grads}
    refused = s < 2 or run.reference is not None or run.rows_coupled
    if refused or cand_grads is None or all(e.ok for e in grads):
        return None  # gradients that match the reference's: a clip just below the largest norm would fit them
    found = _shard_means(run, pre, batch)
    if found is None:
        return None
    means, weights = found
    cand = {p: np.asarray(to_host(g), np.float64) for p, g in flatten_state(nnx.as_pure(cand_grads)).items()}
    tolerance = {p: t for p, t in tolerance.items() if p in cand and p in means}
    if not tolerance or any(cand[p].shape != means[p].shape[1:] for p in tolerance):
        return None
    shares = [np.full(s, 1.0 / s)] + ([weights / np.sum(weights)] if run.weighted else [])
    for coeffs in shares:
        m = _clip_fit(cand, means, coeffs, tolerance)
        if m is not None:
            return m
    return None


def _clip_fit(cand: dict, groups: dict, coeffs: np.ndarray, tolerance: dict) -> float | None:
    """:func:`_fit` of ``groups`` (``{path: [G, ...]}``, each group's gradient) combined with ``coeffs``, where
    their plain combination alone does not give ``cand`` within ``tolerance`` (no clip shows there)."""
    plain = {p: np.tensordot(coeffs, groups[p], axes=1) for p in tolerance}
    if all(np.max(np.abs(cand[p] - plain[p])) <= tolerance[p] for p in tolerance):
        return None
    g = len(coeffs)
    norms = np.sqrt(sum(np.sum(v.reshape(g, -1) ** 2, axis=1) for v in groups.values()))
    return _fit(cand, groups, coeffs, norms, tolerance)


def fitted_micro_clip(run, pre, batch, record: StepRecord, cand_grads) -> tuple[float, int, str, str] | None:
    """``(M, k, layout, of)`` where the candidate's returned gradients are the plain mean over k micro-batches of
    each one's own gradient clipped to global norm M (fitted as :func:`fitted_shard_clip` fits a shard's): the
    gradient of its loss sum (``of`` ``"sum"``) or of its mean (``"mean"``, its sum over its own weight), or
    either (``"either"``: a clip that binds on every micro-batch clips the two alike), for the
    k micro-batches of ``layout`` (:data:`~shardcheck.parity.diagnosis.micro_subset.LAYOUTS`; k in
    :data:`~shardcheck.parity.diagnosis.hypotheses.MICRO_BATCHES` dividing the batch's rows, the shards' own
    blocks left to :func:`fitted_shard_clip`): an accumulation by hand that clipped each micro-batch's gradient
    before adding them (trial 61: "no constant factor" on a character LM). Read from each row's gradient
    (:func:`~shardcheck.parity.diagnosis.micro_subset.row_terms`, computed once a failing step); ``None`` where
    none fits, where every returned gradient matches, without returned gradients, on a loss that couples the
    rows, against a reference step of the user's, or where the rows do not trace one by one."""
    from shardcheck.parity.diagnosis.hypotheses import MICRO_BATCHES
    from shardcheck.parity.diagnosis.micro_subset import LAYOUTS, grouped, members, row_terms

    grads = [e for e in record.leaves if e.kind == "grad"]
    if cand_grads is None or run.reference is not None or run.rows_coupled or all(e.ok for e in grads):
        return None
    rows = row_terms(run, pre, batch)
    if rows is None:
        return None
    n, s = len(rows[1]), run.cand.num_shards
    cand = {p: np.asarray(to_host(g), np.float64) for p, g in flatten_state(nnx.as_pure(cand_grads)).items()}
    for k in MICRO_BATCHES:
        if n < 2 * k or n % k:
            continue
        for layout in LAYOUTS:
            if k == s and layout == "blocks":
                continue  # the shards' own: fitted_shard_clip's
            found = _micro_fit(cand, grouped(rows, members(n, k, layout)), grads)
            if found is not None:
                return found[0], k, layout, found[1]
    return None


def _micro_fit(cand: dict, terms, grads) -> tuple[float, str] | None:
    """``(M, of)``: the max norm whose clip of each group's gradient sum (``of`` ``"sum"``) or mean (``"mean"``),
    averaged plainly, gives ``cand`` within each leaf's tolerance (:func:`_fit`), where the plain mean alone does
    not (``"either"`` where both fit); ``None`` where neither does."""
    stack, weights = terms
    if not np.all(weights > 0):
        return None
    sums = {p: np.asarray(to_host(g), np.float64) for p, g in flatten_state(nnx.as_pure(stack)).items()}
    tolerance = {e.path: e.tolerance for e in grads if e.path in cand and e.path in sums}
    k = len(weights)
    if not tolerance or any(cand[p].shape != sums[p].shape[1:] for p in tolerance):
        return None
    coeffs = np.full(k, 1.0 / k)
    fitted = {}
    for of in ("sum", "mean"):
        groups = sums if of == "sum" else {p: g / _column(weights, g.ndim) for p, g in sums.items()}
        m = _clip_fit(cand, groups, coeffs, tolerance)
        if m is not None:
            fitted[of] = m
    if len(fitted) == 2:  # a clip that binds on every group: its sum and its mean clip alike
        return fitted["sum"], "either"
    return next(((m, of) for of, m in fitted.items()), None)
