"""The counts of the RNG streams a model's forward pass draws from, compared exactly after every step.

A stream ``nnx.Rngs(noise=...)`` holds a key and a count; each draw (``self.rngs.noise()``) folds the count into
the key and increments it. The reference and the candidate start from equal keys and counts, so a correct step
leaves equal counts: the single-device step and GSPMD's jit of it write the forward pass's count back, as
``nnx.value_and_grad`` does. A step that does not (a ``jax.shard_map`` step that splits the model and drops the
rest) draws this step's numbers again at the next, which looks like a trajectory that drifted, and is not one;
compared here (``counter model.rngs.noise.count``), it FAILs at the step that lost the count, at the forward stage.

A stream split over a stacked model (``nnx.split_rngs(splits=E)`` + ``nnx.vmap``: an ensemble of E members, each
with its own Dropout stream) holds one count per member, shape ``(E,)``; the counts are compared elementwise, and
the leaf reports the member whose count differs most.

Only the streams the forward pass draws from (:func:`shardcheck.task.check_model`'s ``drawn``) are compared: the
count of a stream nothing draws from (``params``, or Dropout at rate 0) is the model's, moved by no correct step.
A step that moves one all the same draws numbers the single-device step does not (Dropout at a nonzero rate in
the step, a model the task runs deterministic run in training mode): :func:`moved_count_leaves` reports such a
count, and only then, so a check that passes compares the same leaves as before (trial 52).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import counter_error
from shardcheck.parity.diagnosis.evidence import LeafError

PREFIX = "model."


def rng_count_arrays(model: nnx.Module, streams: Sequence[str]) -> dict:
    """``{"rngs.noise": count}`` of the model's streams named in ``streams`` (dotted paths, ``"rngs.noise"``),
    each count the 0-d ``uint32`` array its ``nnx.RngCount`` holds (what a recording digests)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.RngCount))
    counts = {".".join(map(str, p)).removesuffix(".count"): v[...] for p, v in flat}
    return {s: counts[s] for s in streams if s in counts}


def rng_counts(model: nnx.Module, streams: Sequence[str]) -> dict[str, np.ndarray]:
    """:func:`rng_count_arrays` as host ``int64`` arrays of the counts' own shapes (``()`` for one stream,
    ``(E,)`` for a stream split over E stacked members)."""
    return {s: np.asarray(c, dtype=np.int64) for s, c in rng_count_arrays(model, streams).items()}


def _count_error(step: int, path: str, ref: np.ndarray, cand: np.ndarray) -> LeafError:
    """The exact counter leaf of one stream: its counts compared elementwise, reported at the element that
    differs most (its ``counts`` are that element's ``(reference's, candidate's)`` values); counts of other
    shapes (a model stacked otherwise) fail with an infinite error."""
    if ref.shape != cand.shape:
        return LeafError(step, "counter", path, math.inf, math.inf, 0.0, False, None)
    if ref.ndim == 0:
        return counter_error(step, path, ref, cand)
    worst = np.unravel_index(np.argmax(np.abs(cand - ref)), ref.shape) if ref.size else ()
    return counter_error(step, path, ref[worst] if ref.size else 0, cand[worst] if ref.size else 0)


def rng_count_leaves(
    step: int, ref_model: nnx.Module, cand_model: nnx.Module, streams: Sequence[str]
) -> list[LeafError]:
    """One exact ``counter model.<stream>.count`` leaf per stream drawn (``streams``), the candidate's count
    against the reference's after step ``step``; ``[]`` for a model whose forward pass draws nothing."""
    if not streams:
        return []
    ref, cand = rng_counts(ref_model, streams), rng_counts(cand_model, streams)
    return [_count_error(step, f"{PREFIX}{s}.count", ref[s], cand[s]) for s in ref if s in cand]


def all_streams(model: nnx.Module) -> tuple[str, ...]:
    """The dotted paths of every RNG stream of ``model`` (``("dropout.rngs", "rngs.noise")``), drawn or not."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.RngCount))
    return tuple(".".join(map(str, p)).removesuffix(".count") for p, _ in flat)


def moved_count_leaves(
    step: int, ref_model: nnx.Module, cand_model: nnx.Module, streams: Sequence[str]
) -> list[LeafError]:
    """The failing ``counter model.<stream>.count`` leaves of ``streams`` (the streams the task's forward pass
    does not draw from) whose count the candidate's step moved away from the reference's; ``[]`` where none
    did (and without reading the model where there are no such streams)."""
    return [e for e in rng_count_leaves(step, ref_model, cand_model, streams) if not e.ok]
