"""The model's state beside its parameters: compared after every step.

Two kinds of it, as the Flax NNX docs write them:

- integer (and boolean) state the forward pass writes (an ``nnx.Variable`` counter incremented in ``__call__``):
  the single-device step writes back what the forward pass wrote, once a step
  (:func:`shardcheck.steps._core.shard_value_and_grad`), as ``nnx.value_and_grad`` does; a candidate must leave
  the same values, exactly (``counter model.<path>``);
- floating state (a weight kept frozen in a Variable class of one's own, ``class Frozen(nnx.Variable)``, as
  LoRA's base weights are): where the reference's step leaves a leaf bitwise as it was, the candidate must too,
  exactly (``state model.<path>``, ``reference_change`` 0): a step that trains it by mistake FAILs at once.
  Where the reference's step writes it and the candidate's leaves it as it was, the candidate dropped the writes
  (``reference_change`` > 0). Floating state both steps write (a running statistic of the activations) is not
  compared: its rounding has no derived tolerance.

RNG streams are not compared (their keys are the model's, drawn nowhere in a checked step), nor ``nnx.BatchStat``
(refused: :func:`shardcheck.task.check_model`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import counter_error, is_int, to_host
from shardcheck.parity.diagnosis.evidence import LeafError

PREFIX = "model."
"""The path prefix of a model-state leaf in a report (``counter model.calls``, ``state model.l1.base``), beside
the optimizer's counters."""


def _variables(model: nnx.Module, found: dict | None, key: str) -> list:
    """``[(dotted path, Variable)]`` of the model's state that is neither a parameter nor an RNG stream; where
    ``found`` is given, kept under ``key`` when first found (one graph traversal) and read at every later call."""
    entry = None if found is None else found.get(key)
    if entry is None or entry[0] is not model:
        flat = nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))))
        entry = (model, [(".".join(map(str, p)), v) for p, v in flat])
        if found is not None:
            found[key] = entry
    return entry[1]


def model_state(model: nnx.Module, found: dict | None = None, key: str = "model_state") -> dict:
    """``{dotted path: array}`` of the model's integer state that is neither a parameter nor an RNG stream.

    ``found``: where the model's steps write into its Variables in place, a mapping in which the Variables are
    kept under ``key`` when first found (one graph traversal), and read at every later call without another."""
    return {path: v[...] for path, v in _variables(model, found, key) if is_int(v[...])}


def floating_arrays(model: nnx.Module, found: dict | None = None, key: str = "floating_state") -> dict:
    """``{dotted path: array}`` (the arrays as the Variables hold them) of the model's floating state that is
    neither a parameter nor an RNG stream: a frozen weight in a Variable class of one's own. ``found``: as
    :func:`model_state`'s."""
    out = {}
    for path, v in _variables(model, found, key):
        a = v[...]
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating):  # bfloat16 too; no PRNG key
            out[path] = a
    return out


def floating_state(model: nnx.Module, found: dict | None = None, key: str = "floating_state") -> dict:
    """:func:`floating_arrays` as host copies (float64 ``np.ndarray``)."""
    return {p: np.asarray(to_host(a), np.float64) for p, a in floating_arrays(model, found, key).items()}


def model_state_leaves(
    step: int,
    ref_model: nnx.Module,
    cand_model: nnx.Module,
    found: dict | None = None,
    before: dict | None = None,
) -> list[LeafError]:
    """The model-state leaves of one step, against the reference's.

    - One exact ``counter`` leaf per integer leaf both models hold (path ``model.<path>``); an array leaf's error
      is its largest elementwise difference.
    - With ``before`` (:func:`floating_state` of the reference before the step), one exact ``state`` leaf per
      floating leaf the reference left bitwise as it was (``reference_change`` 0) or the candidate did while the
      reference wrote it (``reference_change`` its largest change); a leaf both wrote is not compared.

    ``found``: as :func:`model_state`'s."""
    ref = model_state(ref_model, found, "model_state ref")
    cand = model_state(cand_model, found, "model_state cand")
    out = []
    for path, r in ref.items():
        if path not in cand:
            continue
        if np.size(r) == 1:
            out.append(counter_error(step, PREFIX + path, r, cand[path]))
            continue
        r64, c64 = np.asarray(r, np.int64), np.asarray(cand[path], np.int64)
        out.append(_exact(step, "counter", path, r64, c64, None))
    if before:
        out += _floating_leaves(step, ref_model, cand_model, found, before)
    return out


def _floating_leaves(step, ref_model, cand_model, found, before: dict) -> list[LeafError]:
    ref = floating_state(ref_model, found, "floating_state ref")
    cand = floating_state(cand_model, found, "floating_state cand")
    out = []
    for path, r in ref.items():
        r0, c = before.get(path), cand.get(path)
        if r0 is None or c is None or r0.shape != r.shape or c.shape != r.shape:
            continue
        if _same(r, r0):  # the reference left it as it was: so must the candidate
            out.append(_exact(step, "state", path, r, c, 0.0))
        elif _same(c, r0):  # the reference wrote it; the candidate left it as it was
            change = float(np.max(np.abs(r - r0), initial=0.0))
            out.append(_exact(step, "state", path, r, c, change))
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b, equal_nan=True))


def _exact(step, kind, path, r, c, change) -> LeafError:
    """An exact leaf: its error the largest elementwise difference, its tolerance 0 (NaN where it is: fails)."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(np.asarray(c, np.float64) - np.asarray(r, np.float64))
    err = float(np.max(diff, initial=0.0)) if not np.isnan(diff).any() else float("nan")
    top = float(np.max(np.abs(r), initial=0))
    rel = err / top if top else (0.0 if err == 0 else np.inf)
    return LeafError(
        step, kind, PREFIX + path, err, rel, 0.0, err == 0, None, change, None, tuple(np.shape(r))
    )
