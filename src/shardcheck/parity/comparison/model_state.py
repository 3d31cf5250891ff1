"""The model's state beside its parameters: compared after every step.

Two kinds of it, as the Flax NNX docs write them:

- integer (and boolean) state the forward pass writes (an ``nnx.Variable`` counter incremented in ``__call__``):
  the single-device step writes back what the forward pass wrote, once a step
  (:func:`shardcheck.steps._core.shard_value_and_grad`), as ``nnx.value_and_grad`` does; a candidate must leave
  the same values, exactly (``counter model.<path>``);
- floating state (``state model.<path>``), one rule live and in a replay, by what each step does to a leaf:

  - the reference's step leaves it bitwise as it was, and the loss reads it (a weight kept frozen in a Variable
    class of one's own, ``class Frozen(nnx.Variable)``, as LoRA's base weights are): the candidate must leave
    it too, exactly (``reference_change`` 0): a step that trains it by mistake FAILs at once (``frozen_state``).
    Judged on what each step did to it, not on a difference an earlier step left between the two: where neither
    step writes it, it matches (a target network's copy synced at step 1 from parameters that differ by rounding,
    accepted there by the rule for state both steps write, and left by both at step 2); where the candidate's
    writes it, its change is the error;
  - the reference's step leaves it as it was, the loss does not read it, and the candidate's step writes it (an
    EMA of the parameters, a shadow copy kept by the user's step after its update): not compared, since the
    task's reference step does not write it (a leaf of tolerance ``inf``, named by the PASS); whether the loss
    reads a leaf is decided once per check from the task's loss traced on the model's floating state
    (:func:`loss_reads`);
  - both steps write it (BatchNorm's running averages, ``nnx.BatchStat``): compared coarsely on its change in
    the step (after minus before, each side from its own state): FAILs only where the candidate's change differs
    from the reference's by more than :data:`COARSE` of the reference's largest change. No rounding tolerance is
    derived for such state (a running average of batch statistics goes through reductions whose order a sharded
    step changes, and rounds at each step), so only a difference no rounding can make is flagged: a momentum
    0.99 in place of 0.9 (a tenth of the change), a statistic computed another way;
    A change of a few units in the last place of the leaf's magnitude (:data:`ROUNDING_ULPS`) is rounding in
    either step, never a write told apart from none;
  - the reference's step writes it and the candidate's leaves it exactly as it was: the writes were dropped;
    where it leaves part of it so (some rows) and writes the rest as the reference does, a write that covers
    part of the leaf only (``LeafError.kept``, :mod:`~shardcheck.parity.comparison.partial_write`).

RNG streams are not compared here. The count of a stream the forward pass draws from (a VAE's ``eps``, Dropout) is
compared exactly by :mod:`shardcheck.parity.comparison.rng_counts` (a step that does not write it back draws the
same numbers again at the next step: a FAIL at the step that lost it, not a drifted trajectory); a stream nothing
draws from is the model's, moved by no step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import counter_error, is_int, to_host
from shardcheck.parity.comparison.partial_write import partial_write
from shardcheck.parity.diagnosis.evidence import LeafError

COARSE = 0.5
"""A both-written floating leaf FAILs where the candidate's change in a step differs from the reference's by more
than this fraction of the reference's largest change (elementwise, max over the leaf)."""

ROUNDING_ULPS = 4
"""A both-written floating leaf's change in a step of at most this many units in the last place (``eps`` of its
dtype) of the leaf's largest magnitude is at rounding level: no write and no dropped write can be told from
rounding there (an EMA ``d * e + (1 - d) * p`` of parameters a step at learning rate 0 left as they were changes
by one ulp; its rewrite ``e + (1 - d) * (p - e)`` by 0), so the candidate's change is allowed that much beside
:data:`COARSE` of the reference's, and a change of 0 against such a one is not a dropped write."""


def rounding_floor(dtype, magnitude: float) -> float:
    """:data:`ROUNDING_ULPS` units in the last place of ``magnitude`` (a leaf's largest ``|x|``, before or after
    the step) in ``dtype`` (a floating dtype or its name); 0 for a non-floating one."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or not math.isfinite(magnitude):
        return 0.0
    return ROUNDING_ULPS * float(jnp.finfo(dtype).eps) * magnitude


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


def set_model_state(model: nnx.Module, values: dict) -> None:
    """Write ``values`` (``{dotted path: integer array}``, as :func:`model_state` returns) into the model's
    integer state of those paths, each placed as the array it replaces (its sharding where that is committed,
    else uncommitted on the default device); other paths are left."""
    for path, v in _variables(model, None, ""):
        if path in values:
            old = v[...]
            new = np.asarray(values[path], old.dtype)
            if isinstance(old, jax.Array):
                new = jax.device_put(new, old.sharding) if old.committed else jax.device_put(new)
            v[...] = new


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


def _is_floating_state(_path, x) -> bool:
    """An ``nnx.split`` filter: a Variable that is neither a parameter nor an RNG stream, holding floating values."""
    if isinstance(x, nnx.Param | nnx.RngState) or not isinstance(x, nnx.Variable):
        return False
    a = x[...]
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def _is_int_state(_path, x) -> bool:
    """An ``nnx.split`` filter: a Variable that is neither a parameter nor an RNG stream, holding integers or
    booleans (a counter, as :func:`model_state`'s)."""
    if isinstance(x, nnx.Param | nnx.RngState) or not isinstance(x, nnx.Variable):
        return False
    return is_int(x[...])


def loss_reads(loss_fn, model: nnx.Module, batch) -> frozenset[str] | None:
    """The dotted paths (as :func:`floating_arrays`') of the model's floating state that ``loss_fn(model, batch)``
    reads: the task's loss traced once (``jax.make_jaxpr``, nothing computed) as a function of those leaves, a
    leaf read where some equation of the program takes it or the program returns it. A leaf the forward pass
    only writes from itself (a running average) counts as read; one no equation takes (an EMA of the parameters
    the user's step keeps) does not.

    Returns ``frozenset()`` for a model without floating state, and ``None`` where the loss cannot be traced on
    abstract values (a loss that converts a traced value to a Python number): every leaf then counts as read,
    so a frozen weight is still compared exactly."""
    return loss_access(loss_fn, model, batch)[0]


def loss_access(loss_fn, model: nnx.Module, batch) -> tuple[frozenset[str] | None, frozenset[str] | None]:
    """``(reads, writes)``: the dotted paths (as :func:`floating_arrays`') of the model's floating state that
    ``loss_fn(model, batch)`` reads (:func:`loss_reads`) and those its forward pass writes (a running average,
    a value stored for later: the leaf the model holds after the loss is another value of the program than the
    one it held before), from one trace of the task's loss (``jax.make_jaxpr``, nothing computed). A leaf the
    loss neither reads nor writes (an EMA of the parameters the user's step keeps after its update) is one the
    task's reference step leaves as it was: a replay does not compare it, as the live check does not
    (:mod:`~shardcheck.parity.comparison.state_digest`).

    Returns ``(frozenset(), frozenset())`` for a model without floating state, and ``(None, None)`` where the
    loss cannot be traced on abstract values (every leaf then counts as read and written)."""
    return _access(loss_fn, model, batch, _is_floating_state)


def loss_counters(loss_fn, model: nnx.Module, batch) -> frozenset[str] | None:
    """The dotted paths (as :func:`model_state`'s) of the model's integer state that ``loss_fn(model, batch)``
    reads or writes (a count its forward pass increments, a step count a schedule in the loss reads), from one
    trace of the task's loss (``jax.make_jaxpr``, nothing computed). A counter the loss neither reads nor writes
    (a step count the user's step keeps for a target network's sync) is one the task's reference step leaves as
    it was: :func:`model_state_leaves` does not compare it where only the candidate's step writes it.

    Returns ``frozenset()`` for a model without integer state, and ``None`` where the loss cannot be traced on
    abstract values (every counter then counts as touched: compared exactly)."""
    reads, writes = _access(loss_fn, model, batch, _is_int_state)
    return None if reads is None or writes is None else reads | writes


def _access(loss_fn, model: nnx.Module, batch, which) -> tuple[frozenset[str] | None, frozenset[str] | None]:
    """:func:`loss_access` of the model's Variables ``which`` (an ``nnx.split`` filter) selects."""
    graphdef, chosen, rest = nnx.split(model, which, ...)
    flat = list(nnx.to_flat_state(chosen))
    if not flat:
        return frozenset(), frozenset()

    def loss_of(arrays):
        state = nnx.from_flat_state([(p, v.replace(a)) for (p, v), a in zip(flat, arrays, strict=True)])
        merged = nnx.merge(graphdef, state, rest, copy=True)
        loss = loss_fn(merged, batch)
        after = dict(nnx.to_flat_state(nnx.state(merged, which)))
        return loss, [after[p][...] if p in after else a for (p, _), a in zip(flat, arrays, strict=True)]

    try:
        program = jax.make_jaxpr(loss_of)([v[...] for _, v in flat]).jaxpr
    except Exception:  # noqa: BLE001 -- undecidable here: every leaf counts as read (the exact rule stands)
        return None, None
    kept = program.outvars[len(program.outvars) - len(flat) :]
    loss_out = program.outvars[: len(program.outvars) - len(flat)]
    taken = {id(v) for eqn in program.eqns for v in eqn.invars} | {id(v) for v in loss_out}
    names = [".".join(map(str, p)) for p, _ in flat]
    reads = frozenset(n for n, v in zip(names, program.invars, strict=True) if id(v) in taken)
    writes = frozenset(n for n, v, w in zip(names, program.invars, kept, strict=True) if w is not v)
    return reads, writes


def model_state_leaves(
    step: int,
    ref_model: nnx.Module,
    cand_model: nnx.Module,
    found: dict | None = None,
    before: dict | None = None,
    cand_before: dict | None = None,
    read: frozenset[str] | None = None,
    counters: tuple | None = None,
) -> list[LeafError]:
    """The model-state leaves of one step, against the reference's.

    - One exact ``counter`` leaf per integer leaf both models hold (path ``model.<path>``); an array leaf's error
      is its largest elementwise difference. With ``counters`` (``(before, touched)``: :func:`model_state` of the
      reference before the step, and :func:`loss_counters`'s paths or ``None``), a counter the reference's step left as it was and the loss neither reads nor writes, whose
      candidate value differs, is not compared (tolerance ``inf``, ``ok``): the candidate's step keeps it (a step
      count for a target network's sync) and the reference's step does not write it, as floating state below.
    - With ``before`` (:func:`floating_state` of the reference before the step) one ``state`` leaf per floating
      leaf both models hold, by the module docstring's rule: exact (tolerance 0, ``reference_change`` 0) where
      the reference left it bitwise as it was and the loss reads it (``read``: :func:`loss_reads`'s paths;
      ``None``: every leaf counts as read), not compared (tolerance ``inf``, ``ok``) where the loss does not read
      it and the candidate's value differs, coarse on the change (tolerance :data:`COARSE` x the reference's
      largest change, ``reference_change`` that change, ``ratio`` the candidate's largest change over it, 0 where
      it is exactly 0) where the reference wrote it. ``cand_before``: the candidate's own floating state before
      the step (its change is taken from it; default ``before``).

    ``found``: as :func:`model_state`'s."""
    ref = model_state(ref_model, found, "model_state ref")
    cand = model_state(cand_model, found, "model_state cand")
    out = []
    for path, r in ref.items():
        if path not in cand:
            continue
        if np.size(r) == 1:
            leaf = counter_error(step, PREFIX + path, r, cand[path])
        else:
            r64, c64 = np.asarray(r, np.int64), np.asarray(cand[path], np.int64)
            leaf = _exact(step, "counter", path, r64, c64, None)
        if not leaf.ok and _step_only(path, r, counters):  # the candidate's step keeps it: not compared
            leaf = dataclasses.replace(leaf, tolerance=math.inf, ok=True)
        out.append(leaf)
    if before:
        arrays = floating_arrays(ref_model, found, "floating_state ref")
        sides = ({p: np.asarray(to_host(a), np.float64) for p, a in arrays.items()}, before)
        cand_sides = (floating_state(cand_model, found, "floating_state cand"), cand_before or before)
        dtypes = {p: a.dtype for p, a in arrays.items()}
        out += _floating_leaves(step, sides, cand_sides, read, dtypes)
    return out


def _step_only(path: str, r, counters: tuple | None) -> bool:
    """Whether the counter ``path`` (the reference's value ``r`` after the step) is one the reference's step left
    as it was and the task's loss neither reads nor writes (``counters``: as :func:`model_state_leaves`')."""
    if counters is None:
        return False
    ref_before, touched = counters
    if touched is None or path in touched or ref_before is None or path not in ref_before:
        return False
    return bool(np.array_equal(np.asarray(r), np.asarray(ref_before[path])))


def _floating_leaves(step, sides: tuple, cand_sides: tuple, read, dtypes: dict) -> list[LeafError]:
    (ref, before), (cand, cand_before) = sides, cand_sides
    out = []
    for path, r in ref.items():
        r0, c, c0 = before.get(path), cand.get(path), cand_before.get(path)
        if any(x is None or x.shape != r.shape for x in (r0, c, c0)):
            continue
        if not _same(r, r0):  # the reference wrote it: the candidate's change, coarsely
            out.append(_both_written(step, path, (r0, r), (c0, c), dtypes[path]))
        elif _same(c, c0):  # neither step wrote it: a match, whatever an earlier step left between them
            out.append(_exact(step, "state", path, r, r, 0.0))
        elif read is None or path in read or _same(c, r):  # so must the candidate: its change, exactly
            out.append(_exact(step, "state", path, c0, c, 0.0))
        else:  # written by the candidate only, read by nothing the loss computes: not compared
            out.append(
                dataclasses.replace(_exact(step, "state", path, r, c, 0.0), tolerance=math.inf, ok=True)
            )
    return out


def _both_written(step, path, ref: tuple, cand: tuple, dtype) -> LeafError:
    """A floating leaf the reference's step wrote: the candidate's change against the reference's, within
    :data:`COARSE` of the reference's largest change or :func:`rounding_floor`; exact where the candidate left it
    as it was (dropped) while the reference changed it by more than rounding."""
    (r0, r), (c0, c) = ref, cand
    with np.errstate(invalid="ignore", over="ignore"):
        dr, dc = r - r0, c - c0
        top, moved = float(np.max(np.abs(dr), initial=0.0)), float(np.max(np.abs(dc), initial=0.0))
        floor = rounding_floor(
            dtype, max(float(np.max(np.abs(r), initial=0.0)), float(np.max(np.abs(r0), initial=0.0)))
        )
        if moved == 0 and top > floor:
            return _exact(step, "state", path, r, c, top, ratio=0.0)
        diff = np.abs(dc - dr)
    err = float(np.max(diff, initial=0.0)) if not np.isnan(diff).any() else math.nan
    allowed = max(COARSE * top, floor)
    leaf = LeafError(
        step, "state", PREFIX + path, err, err / top, allowed, err <= allowed, moved / top, top, None, r.shape
    )
    if leaf.ok:
        return leaf
    return dataclasses.replace(leaf, kept=partial_write(r0, r, c, c0), value_factor=value_factor(r, c))


def value_factor(r: np.ndarray, c: np.ndarray) -> float | None:
    """The one constant k (not 1) with ``c = k r`` at every element where ``|r|`` is at least 1% of its largest,
    within 8 float32 ulps of k (a replicated value psum-ed over the devices: exactly x their count), else
    ``None`` (also where ``r`` is all zero or a value is not finite)."""
    r64, c64 = np.asarray(r, np.float64), np.asarray(c, np.float64)
    top = float(np.max(np.abs(r64), initial=0.0))
    if not top or not (np.isfinite(r64).all() and np.isfinite(c64).all()):
        return None
    big = np.abs(r64) >= 0.01 * top
    q = c64[big] / r64[big]
    k = float(np.median(q))
    if abs(k - 1) < 1e-3 or float(np.max(np.abs(q - k))) > 8 * 2.0**-23 * abs(k):
        return None
    return k


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b, equal_nan=True))


def _exact(step, kind, path, r, c, change, ratio=None) -> LeafError:
    """An exact leaf: its error the largest elementwise difference, its tolerance 0 (NaN where it is: fails)."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(np.asarray(c, np.float64) - np.asarray(r, np.float64))
    err = float(np.max(diff, initial=0.0)) if not np.isnan(diff).any() else float("nan")
    top = float(np.max(np.abs(r), initial=0))
    rel = err / top if top else (0.0 if err == 0 else np.inf)
    return LeafError(
        step, kind, PREFIX + path, err, rel, 0.0, err == 0, ratio, change, None, tuple(np.shape(r))
    )
