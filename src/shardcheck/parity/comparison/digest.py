"""A replayed run compared with a recorded one, digest by digest, within the parity harness's derived tolerances.

The harness passes a leaf at step t when, element by element (``docs/parity.md``),

    |c - r|  <=  tol = atol_t + rtol_t * max|r| + a          (optimizer moments: rtol, atol x MOMENT_FACTOR)

with ``(rtol_t, atol_t) = derive_tolerance(dtype, batch_size=task.terms(batch), step=t)`` and ``a`` the allowance
of a parameter whose gradient is at rounding level under a normalizing optimizer. A digest cannot see every
element, but what it holds follows from that rule, so comparing it is sound (a replay the rule passes passes
here too):

- ``|max|c| - max|r|| <= tol`` (the largest magnitudes move by at most the largest elementwise change);
- each fixed-index sample ``|c_i - r_i| <= tol``;
- ``| ||c|| - ||r|| | <= ||c - r|| <= sqrt(size) * tol`` (triangle inequality), plus the rounding of the two
  float32 norms (``eps32 * sqrt(size) * (||c|| + ||r||)``, the random-walk model of the harness's own rule);
- a parameter's update size ``|max|c_t - c_{t-1}| - max|r_t - r_{t-1}|| <= tol_t + tol_{t-1}`` (plus its
  float32 rounding);
- integer counters exactly; a shape or a dtype that changed fails by itself.

A leaf's placement (its sharding) is not a value: a refactor that moves a leaf from ``P()`` to ``P(None, 'fsdp')``
computes the same numbers, so a changed placement is listed in the notes (``path: recorded spec -> replayed
spec``) and fails only when the placement is pinned (``pin_placement=True``, ``verify --against --pin-placement``)
or the run was replayed on another mesh than the recorded one.

``a``: where the recording holds a parameter's gradient (else the replay's; where neither step returns one, the
task's own gradient the replay took beside its step, ``record_run(true_gradients=True)``, as a live check reads the
reference's) and its ``max|g| <= atol_t``, or some of its elements have had ``|g| <= atol_t`` at every step so far
(a fused qkv bias whose key third's true gradient is 0: the least of the elementwise largest ``|g|``, which the
replay keeps, :class:`~shardcheck.parity.harness.true_gradients.Peaks`) under an optimizer that normalizes that
leaf's update (``meta["normalized"]``: under SGD those elements move by ``lr`` times their noise, below any
tolerance, and the leaf is held to its own), the gradient (or those elements) is
rounding noise and Adam turns noise into an lr-sized step of either sign, its size set by that run's own noise
against Adam's eps, so the two runs' updates may differ by the sum of their update sizes ``max|u_r| + max|u_c|``
(neither run's bounds the other's: a correct step whose noise is 2.5x the recorded strategy's moves 2.5x as far;
a digest cannot tell which elements, so the whole leaf is allowed it but for its samples whose gradient the
replay saw above ``atol_t``, ``Peaks.sampled``); that is added to the parameter's tolerance at t and every later
step (the harness's ``floor``), and no cause is read from such a leaf's update ratio; the
leaf is ``unresolved`` at a step (the ``rounding_level`` note) where that allowance exceeds its own tolerance, as
the harness decides it, and only where its whole gradient is at rounding level (the harness's rule: a leaf only
some of whose elements are, such as a kernel's one element small by chance, is allowed them but named nowhere as
at rounding level, so that every sentence counts it with the failing or the matching leaves alike). At low-precision compute a replay measures, beside each step, the task's gradient with
every layer computing in float32 ``g_32`` and the compute noise ``N`` of its gradient as a live check measures it
(:func:`~shardcheck.parity.harness.true_gradients.rounding_noise`); a gradient is at rounding level where its true
gradient is within its tolerance of 0, ``max|g_32| <= atol_t`` (a bfloat16 step returns an attention key bias's
true gradient of 0 as noise some 40x ``atol_t``, which no ``max|g|`` rule tells from a small gradient: issue #36,
trial 14); that gradient is then allowed ``2 N`` (``N`` the largest so far: each run's lies within it of 0) and its
optimizer moments ``2 N``, and the elementwise peaks are not read (an element of a large leaf is small by chance).
The loss's tolerance adds what that allowance can move it by, ``sum ||g||_1 a <= sum
sqrt(size) ||g||_2 a`` (first order, as the harness's ``drift``; ``size * atol_t * a`` of a leaf only part of whose
gradient is at rounding level: only those elements, each ``|g| <= atol_t``, may differ by it), and the rest of the
live check's loss drift, ``sum |g_t| A_{t-1}`` with ``A`` the gradient's tolerance propagated through the task's
optimizer over the steps before t, which the replayed run measures on its own steps (``meta["loss_drift"]``,
:class:`~shardcheck.parity.tolerance.loss_drift.LossDrift`): the live check's rule, so that a loss it allows after
the first step the replay allows too (under SGD a replay had allowed 1.78e-05 where live allowed 2.72e-05).
Parameters or moments stored below float32 add one rounding of their own per step (``eps * max|r|``), as the harness does.

What a digest cannot do is re-run a step from identical state (the harness re-checks a late failure that way):
a first failure at step t > 0 may be rounding divergence through a non-smooth op, and the report says so, unless
its records refute it (:func:`divergence_refuted`: the optimizer rerun from equal inputs differs, or the failing
stage's difference has a constant factor, decay or zero form).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from shardcheck.parity.comparison.leaf_digest import SAMPLES
from shardcheck.parity.comparison.live import spread_ranks
from shardcheck.parity.comparison.partial_write import SAMPLED
from shardcheck.parity.comparison.state_digest import (
    PART_EVIDENCE,
    kept_samples,
    read_paths,
    sampled_value_factor,
    state_evidence,
    written_paths,
)
from shardcheck.parity.diagnosis.draws import with_draws
from shardcheck.parity.diagnosis.evidence import converted_counter
from shardcheck.parity.diagnosis.form import moment
from shardcheck.parity.diagnosis.grouping import LeafFacts, n_leaves
from shardcheck.parity.diagnosis.later import with_later_non_finite
from shardcheck.parity.diagnosis.localization import consistent, localize
from shardcheck.parity.diagnosis.rules import Diagnosis, LeafError, StepRecord, diagnose
from shardcheck.parity.diagnosis.skipped import with_skipped
from shardcheck.parity.diagnosis.topology import replicas_root
from shardcheck.parity.harness import true_gradients
from shardcheck.parity.harness.recorded import KINDS, Digests, Recording, optimizer_change, settings_diff
from shardcheck.parity.harness.setup import _check_tolerances
from shardcheck.parity.report import ParityReport
from shardcheck.parity.tolerance import matmul
from shardcheck.parity.tolerance.derive import MOMENT_FACTOR, SAFETY_FACTOR, derive_tolerance

EPS32 = float(np.finfo(np.float32).eps)
STRUCTURAL = ("missing", "shape", "dtype", "sharding")
# a state leaf's own rule (state_digest)
_STATE_EVIDENCE = ("update", "change at a sample", "not compared", PART_EVIDENCE)


@dataclasses.dataclass(frozen=True)
class DigestError:
    """One leaf at one step: its worst piece of evidence.

    Attributes:
        step: the 0-based step (``-1``: the initial state).
        name: the leaf (``"loss"``, ``"grad <path>"``, ``"param <path>"``, ``"opt_state <path>"``,
            ``"counter <path>"``).
        evidence: what decided: ``"max"``, ``"norm"``, ``"sample"``, ``"update"`` (a parameter's update size),
            ``"exact"`` (a counter), ``"nan"``, a floating model-state leaf's own (``"update"``, ``"change at a
            sample"``, ``"not compared"``: :mod:`~shardcheck.parity.comparison.state_digest`), or a structural
            change: ``"missing"``, ``"shape"``, ``"dtype"``, ``"sharding"``.
        recorded, replayed: that evidence's two values (numbers, or text for a structural change).
        err: ``|replayed - recorded|`` (inf for a structural change); allowed: the tolerance it was held to.
        ok: within it.
        ratio: the replay's over the recording's: the update size for a parameter, the value for a counter, the
            L2 norm otherwise (``None`` where the recorded one is 0).
    """

    step: int
    name: str
    evidence: str
    recorded: float | str
    replayed: float | str
    err: float
    allowed: float
    ok: bool
    ratio: float | None = None

    @property
    def kind(self) -> str:
        return self.name.split(" ", 1)[0]

    @property
    def badness(self) -> float:
        """``err / allowed`` (inf for an error where nothing is allowed, 0 for none)."""
        return _badness(self.err, self.allowed)


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """A replay against a recording (:func:`compare_run`).

    Attributes:
        run: the replayed run's name; recorded_run: the recording's.
        ok: every compared digest within its tolerance, nothing structural changed.
        steps: the steps compared.
        leaves: one :class:`DigestError` per compared leaf and point (the initial state first, then the steps).
        first_failure: the first failing leaf: the earliest step, then the first kind of :data:`KINDS` (the order
            a step computes them), then the worst; ``None`` when it passes.
        cause: the messages of :attr:`diagnoses` that name a cause, joined (``None`` when it passes): the
            live check's own diagnosis of the replay's records, with a changed structure or setting.
        evidence: which digests were compared, and how (one paragraph).
        notes: what the comparison cannot tell, and what differs between the two runs' settings.
        hashes_matched, hashes_compared: how many leaf digests' sha256 agreed, of those comparable (same shape,
            dtype and sharding).
        bitwise: every leaf's hash matched at every point: the replay is bitwise identical (the same machine and
            XLA, in practice).
        placement_changes: ``(leaf, recorded spec, replayed spec)`` of every leaf both runs hold whose sharding
            differs at some point (the first such point's), in the recording's leaf order; a failure only when
            the placement was pinned (:func:`compare_run`'s ``pin_placement``).
        pin_placement: whether a changed placement failed (``compare_run(..., pin_placement=True)``).
        matmul_precision: the looser of the two runs' matmul precisions, the one the tolerance assumed
            (:func:`looser_precision`).
        num_shards: the recording's S.
        records: one :class:`~shardcheck.parity.diagnosis.rules.StepRecord` per compared step (the initial
            state's, step -1, only where it differs), of :class:`~shardcheck.parity.diagnosis.rules.LeafError`
            as the live check's: the recording is the reference, the replay the candidate.
        facts: ``(parameter path, LeafFacts)`` of each recorded parameter: its shape, dtype and the mesh axes of
            its recorded placement (the localization's grouping reads them).
        diagnoses: :func:`~shardcheck.parity.diagnosis.rules.diagnose` of ``records`` (the live check's
            rules), with ``initial_state``, ``structure`` (a leaf missing, of another shape, dtype or pinned
            sharding) and ``settings_differ`` where they apply.
        replicas_compared: whether the replay compared each replicated leaf's copies across its devices after
            each step (``meta["replicas"]``, :func:`~shardcheck.parity.harness.recorded.replica_evidence`): its
            records then carry ``replica_mismatches`` as a live check's, and a copy that differs fails it
            (``replicas_differ``); ``False`` for a run recorded before that (its digests hash one copy).
    """

    run: str
    recorded_run: str
    ok: bool
    steps: int
    leaves: tuple[DigestError, ...]
    first_failure: DigestError | None
    cause: str | None
    evidence: str
    notes: tuple[str, ...]
    hashes_matched: int
    hashes_compared: int
    bitwise: bool
    placement_changes: tuple[tuple[str, str, str], ...] = ()
    pin_placement: bool = False
    matmul_precision: str = "float32"
    num_shards: int | None = None
    records: tuple[StepRecord, ...] = ()
    diagnoses: tuple[Diagnosis, ...] = ()
    facts: tuple[tuple[str, LeafFacts], ...] = ()
    replicas_compared: bool = False

    @property
    def verdict(self) -> str:
        return "PASS" if self.ok else "FAIL"

    @property
    def codes(self) -> tuple[str, ...]:
        """The :attr:`Diagnosis.code` of every finding, in order (as :attr:`ParityReport.codes`)."""
        return tuple(d.code for d in self.diagnoses)

    def report(self) -> ParityReport:
        """The :class:`~shardcheck.ParityReport` of this replay, as :func:`~shardcheck.check_parity` returns it
        with ``reference=`` a recording: :attr:`records`, :attr:`diagnoses`, and this comparison as its
        ``replay`` (the digests' evidence, hashes and notes)."""
        return ParityReport(
            strategy=self.run,
            ok=self.ok,
            steps=self.records,
            diagnoses=self.diagnoses,
            num_shards=self.num_shards,
            tolerance_rule=self.evidence.removeprefix("evidence: "),
            reference=f"the recording of {self.recorded_run}",
            matmul_precision=self.matmul_precision,
            matmul_precision_source="the looser of the recording's and the replay's",
            localization=self.localization(),
            replay=self,
        )

    def localization(self):
        """The :func:`~shardcheck.parity.diagnosis.localization.localize` of the step records, as a live check's
        (the replicas observed where the replay compared its copies, :attr:`replicas_compared`), with each
        parameter's recorded shape, dtype and placement axes; ``None`` when every step passed, and where the
        initial state's parameters or model state differ from the recording's (:meth:`started_elsewhere`): no
        step then ran from the recorded state, so no stage of one is "the first difference" (trial 42: a model of
        another initialization read "First difference at step 0: the forward pass ... at equal parameters"
        where its initial parameters differed by 0.392, said last)."""
        if self.started_elsewhere():
            return None
        steps = [r for r in self.records if r.step >= 0]
        found = localize(
            steps,
            facts=dict(self.facts),
            replicas_observed=self.replicas_compared,
            num_shards=self.num_shards,
        )
        # a replay's all the same (its start words, no module probed) where it observed the replicas
        return None if found is None else dataclasses.replace(found, live=False)

    def started_elsewhere(self) -> bool:
        """Whether the replay's initial state differs from the recording's in a parameter or the model's state
        (a value, not a structure): the ``initial_state`` finding, which then leads the report."""
        first = self.first_failure
        if first is None or first.step >= 0 or first.evidence in STRUCTURAL:
            return False
        return any(
            e.step < 0 and not e.ok and e.kind in ("param", "state") and e.evidence not in STRUCTURAL
            for e in self.leaves
        )

    @property
    def failures(self) -> tuple[DigestError, ...]:
        return tuple(e for e in self.leaves if not e.ok)

    def worst_by_kind(self) -> dict[str, DigestError]:
        """The worst digest error of each kind (in :data:`KINDS` order), by ``err / allowed``."""
        out: dict[str, DigestError] = {}
        for kind in KINDS:
            mine = [e for e in self.leaves if e.kind == kind]
            if mine:
                out[kind] = max(mine, key=lambda e: (not e.ok, e.badness))
        return out

    def to_dict(self) -> dict:
        """JSON-ready: the verdict, the first failure, the cause, the evidence, the notes, the worst per kind."""
        return {
            "run": self.run,
            "recorded_run": self.recorded_run,
            "verdict": self.verdict,
            "ok": self.ok,
            "steps": self.steps,
            "first_failure": _digest_dict(self.first_failure),
            "cause": self.cause,
            "evidence": self.evidence,
            "notes": list(self.notes),
            "bitwise": self.bitwise,
            "hashes_matched": self.hashes_matched,
            "hashes_compared": self.hashes_compared,
            "placement_changes": [
                {"leaf": leaf, "recorded": was, "replayed": now} for leaf, was, now in self.placement_changes
            ],
            "pin_placement": self.pin_placement,
            "matmul_precision": self.matmul_precision,
            "failures": len(self.failures),
            "codes": list(self.codes),
            "worst_by_kind": {k: _digest_dict(e) for k, e in self.worst_by_kind().items()},
        }

    def report_dict(self, report: dict) -> dict:
        """The ``--json`` entry of this replay: ``report``, the
        :meth:`~shardcheck.ParityReport.to_dict` of its records (the live check's fields: ``ok``, ``verdict``,
        ``codes``, ``diagnosis``, ``localization``, ``worst_leaf``, ``worst_step``, ``max_abs_err``,
        ``max_rel_err``, ``tolerance``, ``worst_by_kind``, ...), with this comparison's own fields beside them
        (:data:`REPLAY_FIELDS`), ``steps`` the steps compared (the initial state's record is no step), and each
        ``worst_by_kind`` entry (``leaf``, ``step``, ``max_abs_err``, ``max_rel_err``, ``tolerance``, ``ok``)
        with its digest's evidence (``name``, ``evidence``, ``recorded``, ``replayed``, ``err``, ``allowed``,
        ``ratio``, ``badness``)."""
        own = self.to_dict()
        digests = {(e.step, e.name): e for e in self.leaves}
        worst = {
            kind: entry | (_digest_dict(digests.get((entry["step"], entry["leaf"]))) or {})
            for kind, entry in report["worst_by_kind"].items()
        }
        return report | {k: own[k] for k in REPLAY_FIELDS} | {"steps": self.steps, "worst_by_kind": worst}

    def __str__(self) -> str:
        head = f"{self.run} against the recorded {self.recorded_run}: {self.verdict}"
        if self.bitwise:
            head += " (bitwise identical)"
        lines = [head]
        if self.first_failure is not None:
            e = self.first_failure
            where = "the initial state" if e.step < 0 else f"step {e.step}"
            lines.append(
                f"first failure: {where}, {e.name}: {e.evidence} recorded {e.recorded}, replayed {e.replayed} "
                f"(allowed {e.allowed:.3g})"
            )
            lines.append(f"cause: {self.cause}")
        return "\n".join([*lines, self.evidence, *self.notes])


REPLAY_FIELDS = (
    "run",
    "recorded_run",
    "first_failure",
    "cause",
    "evidence",
    "notes",
    "bitwise",
    "hashes_matched",
    "hashes_compared",
    "placement_changes",
    "pin_placement",
    "failures",
)
"""The fields of a replay's ``--json`` entry that a live check has no counterpart of
(:meth:`RunComparison.report_dict`)."""


def _digest_dict(e: DigestError | None) -> dict | None:
    """A :class:`DigestError` JSON-ready, with its ``badness`` (``None`` for none)."""
    return None if e is None else dataclasses.asdict(e) | {"badness": e.badness}


class _Leaf(NamedTuple):
    """One leaf's digest at one point, read from a :class:`Digests` (``present`` False: not digested there)."""

    present: bool
    shape: tuple[int, ...]
    dtype: str
    sharding: str
    norm: float
    max: float
    update: float
    samples: np.ndarray
    sha256: bytes
    sampled: np.ndarray  # (8,) bool: a sample was taken there (a leaf of fewer elements has fewer)

    @staticmethod
    def at(recording: Recording, digests: Digests, row: int, col: int | None) -> _Leaf:
        if col is None or not digests.present[row, col]:
            none = np.full(SAMPLES, np.nan)
            return _Leaf(False, (), "", "", math.nan, math.nan, math.nan, none, b"", np.zeros(SAMPLES, bool))
        return _Leaf(
            True,
            recording.shapes[col],
            recording.dtypes[col],
            str(digests.sharding[row, col]),
            float(digests.norm[row, col]),
            float(digests.max[row, col]),
            float(digests.update[row, col]),
            digests.samples[row, col],
            digests.sha256[row, col].tobytes(),
            recording.sample_index[col] >= 0,
        )

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def integer(self) -> bool:
        try:
            return np.dtype(self.dtype).kind in "iub"
        except TypeError:
            return False


def _badness(err: float, allowed: float) -> float:
    """``err / allowed``: 0 for no error, inf for an error where nothing is allowed (NaN counts as inf)."""
    if err == 0:
        return 0.0
    if allowed > 0 and not math.isnan(err):
        return err / allowed
    return math.inf


def _ratio(c: float, r: float) -> float | None:
    return c / r if r != 0 and math.isfinite(r) and math.isfinite(c) else None


def _structural(t: int, name: str, r: _Leaf, c: _Leaf) -> DigestError | None:
    """A change no tolerance covers and no value can be compared across: the leaf missing, another shape or dtype."""
    changed = [("shape", r.shape, c.shape), ("dtype", r.dtype, c.dtype)]
    if not c.present:
        return DigestError(t, name, "missing", "recorded", "absent", math.inf, 0.0, False)
    for evidence, was, now in changed:
        if was != now:
            return DigestError(t, name, evidence, str(was), str(now), math.inf, 0.0, False)
    return None


def _evidence(r: _Leaf, c: _Leaf, base: float, update_base: float | None, sample_base=None) -> list[tuple]:
    """``[(evidence, recorded, replayed, err, allowed)]`` of a floating leaf (module docstring); ``sample_base``:
    each sample's own tolerance where they differ (``(SAMPLES,)``: a leaf only part of whose gradient is at
    rounding level allows its allowance to those samples alone), else ``base``."""
    root = math.sqrt(max(r.size, 1))
    rows = [
        ("max", r.max, c.max, abs(c.max - r.max), base),
        ("norm", r.norm, c.norm, abs(c.norm - r.norm), root * base + EPS32 * root * (r.norm + c.norm)),
    ]
    both = r.sampled & ~(np.isnan(r.samples) | np.isnan(c.samples))
    if both.any():
        diff = np.where(both, np.abs(c.samples - r.samples), -1.0)
        allowed = np.full(SAMPLES, base) if sample_base is None else np.asarray(sample_base, float)
        i = max(np.flatnonzero(both), key=lambda k: (diff[k] > allowed[k], _badness(diff[k], allowed[k])))
        rows.append(("sample", float(r.samples[i]), float(c.samples[i]), float(diff[i]), float(allowed[i])))
    if update_base is not None and math.isfinite(r.update) and math.isfinite(c.update):
        allowed = update_base + EPS32 * (r.update + c.update)
        rows.append(("update", r.update, c.update, abs(c.update - r.update), allowed))
    return rows


def _nan_mismatch(t: int, name: str, r: _Leaf, c: _Leaf, base: float, samples: bool) -> DigestError | None:
    """A NaN in one run's digest where the other has a number: its max, norm, a sample (``samples``: both runs of
    one process, where a NaN sample is a NaN element, not one held by another process) or, for a parameter after
    a step, its update size (a NaN in both is the same run diverging the same way)."""
    pairs = [(r.max, c.max), (r.norm, c.norm)]
    if samples:
        pairs += [(float(a), float(b)) for a, b, s in zip(r.samples, c.samples, r.sampled, strict=True) if s]
    if name.startswith("param ") and t >= 0:
        pairs.append((r.update, c.update))
    for was, now in pairs:
        if math.isnan(was) != math.isnan(now):
            return DigestError(t, name, "nan", was, now, math.inf, base, False)
    return None


def _leaf_error(t, name, r: _Leaf, c: _Leaf, base, update_base, pair: _Pair, sample_base=None) -> DigestError:
    """The worst evidence of one leaf at one point: :func:`_structural`, then its value (:func:`_value_error`),
    then, where the placement is pinned and the value passed, a changed sharding."""
    structural = _structural(t, name, r, c)
    if structural is not None:
        return structural
    value = _value_error(t, name, r, c, base, update_base, pair, sample_base)
    if value.ok and pair.pinned and r.sharding != c.sharding:
        return DigestError(t, name, "sharding", r.sharding, c.sharding, math.inf, 0.0, False)
    return value


def _value_error(
    t, name, r: _Leaf, c: _Leaf, base, update_base, pair: _Pair, sample_base=None
) -> DigestError:
    """The worst value evidence of one leaf at one point: a NaN in one run only, exactness, or the tolerances."""
    nan = _nan_mismatch(t, name, r, c, base, pair.one_process)
    if nan is not None:
        return nan
    if r.integer:
        value_r, value_c = float(r.samples[0]), float(c.samples[0])
        err = max(
            abs(c.max - r.max),
            abs(c.norm - r.norm),
            float(np.nanmax(np.abs(c.samples - r.samples), initial=0)),
        )
        return DigestError(t, name, "exact", value_r, value_c, err, 0.0, err == 0, _ratio(value_c, value_r))
    rows = _evidence(r, c, base, update_base, sample_base)
    worst = max(rows, key=lambda row: (row[3] > row[4], _badness(row[3], row[4])))
    evidence, was, now, err, allowed = worst
    ratio = _ratio(c.update, r.update) if name.startswith("param ") else _ratio(c.norm, r.norm)
    return DigestError(t, name, evidence, was, now, err, allowed, bool(err <= allowed), ratio)


@dataclasses.dataclass
class _Bounds:
    """The tolerance bookkeeping of one comparison over its steps."""

    rtol: float | None
    atol: float | None
    # the tolerance's eps as a dtype, where a matmul precision is looser (looser_precision)
    dtype: str | None = None
    allowance: dict[str, float] = dataclasses.field(default_factory=dict)  # by parameter name, accumulated
    last_base: dict[str, float] = dataclasses.field(default_factory=dict)  # each parameter's base at t - 1
    # parameters whose gradient was at rounding level, by the first step it was (their update is normalized noise)
    rounding: dict[str, int] = dataclasses.field(default_factory=dict)
    # those of them whose whole gradient was at rounding level at some step (the others' only in part)
    whole: set[str] = dataclasses.field(default_factory=set)
    # by step, those whose allowance exceeds their own tolerance there: the update cannot be resolved (the live
    # check's StepRecord.unresolved rule)
    unresolved: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # eps of the looser compute dtype of the two runs, where coarser than float32 (compute_eps), else 0
    compute: float = 0.0
    # by parameter name, the largest gradient compute noise (true_gradients.rounding_noise) of the steps so far at
    # which its true gradient was within atol_t of 0: its gradient's and its moments' allowance (issue #36, trial 14)
    noise: dict[str, float] = dataclasses.field(default_factory=dict)
    # the parameters whose whole gradient is at rounding level at the step being compared
    quiet: set[str] = dataclasses.field(default_factory=set)
    # by parameter name, the compute-rounding allowance accumulated over the steps (compute_allowance)
    compute_acc: dict[str, float] = dataclasses.field(default_factory=dict)
    # the recording's per-term loss count of each step (meta["terms"]): the loss's compute allowance
    terms: tuple = ()
    # by (step, parameter name), of a parameter only part of whose gradient is at rounding level: the tolerance its
    # samples above rounding are held to (_sample_base), the one its record states (as a live check's elementwise
    # allowance states the tolerance its worst element was held to)
    resolved: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    # by step, each compared leaf's (name, recorded max|x|, its tolerance, recorded update size, the update's
    # tolerance or None): what a gradient off by S or 1/S would have moved (_scale_evidence)
    scale: dict[int, list[tuple[str, float, float, float, float | None]]] = dataclasses.field(
        default_factory=dict
    )

    def compute_allowance(self, name: str, r: _Leaf, t: int) -> float:
        """A leaf's allowance for the two runs' low-precision compute at step t (0 in float32, at the initial
        state, and under fixed ``rtol`` / ``atol``): ``rho_t = SAFETY_FACTOR eps_c sqrt(t + 1)`` of its recorded
        ``max|x|`` (optimizer state x MOMENT_FACTOR), and of a parameter (or floating model state) ``rho_t`` of
        its recorded update size, summed over the steps: a correct run's values carry the compute dtype's
        relative rounding, and a parameter's the rounding of each update that moved it, not of its size. The
        loss, a mean of n per-term losses each rounded independently, ``rho_t |loss| / sqrt(n)`` (the live
        check's derivation, ``precision.loss_compute_allowance``; n the recording's ``terms``): 16 eps_c of the
        loss let a 12% change of it pass (issue #36, trials 12 and 13), where correct bfloat16 replays of
        another step differed by at most 0.014 eps_c of it."""
        if not self.compute or t < 0 or self.rtol is not None or self.atol is not None:
            return 0.0
        rho = SAFETY_FACTOR * self.compute * math.sqrt(t + 1)
        if name == "loss" and t < len(self.terms):
            n = max(int(self.terms[t]), 1)
            return rho * r.max / math.sqrt(n) if math.isfinite(r.max) else 0.0
        if name.startswith(("param ", "state ")):
            if math.isfinite(r.update):
                self.compute_acc[name] = self.compute_acc.get(name, 0.0) + rho * r.update
            return self.compute_acc.get(name, 0.0)
        factor = MOMENT_FACTOR if name.startswith("opt_state ") else 1.0
        return factor * rho * r.max if math.isfinite(r.max) else 0.0

    def derived(self, meta: Mapping, t: int) -> tuple[float, float]:
        tol = derive_tolerance(
            self.dtype or meta["tolerance_dtype"], batch_size=int(meta["terms"][max(t, 0)]), step=max(t, 0)
        )
        return (tol.rtol if self.rtol is None else self.rtol), (tol.atol if self.atol is None else self.atol)

    def base(self, name: str, r: _Leaf, t: int, rtol: float, atol: float) -> float:
        """``atol + rtol * max|r|`` (moments x MOMENT_FACTOR) plus the accumulated allowance and storage rounding."""
        factor = MOMENT_FACTOR if name.startswith("opt_state ") else 1.0
        base = factor * (atol + rtol * r.max) + self.allowance.get(name, 0.0)
        eps = _eps(r.dtype)
        if eps > EPS32:  # stored below float32: one rounding per step (precision.py)
            base += eps * r.max * (max(t, 0) + 1)
        return base


def _eps(dtype: str) -> float:
    """The machine epsilon of a floating dtype's name (``"bfloat16"`` included), 0 for any other."""
    try:
        return float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
    except TypeError:  # a PRNG key's dtype
        return 0.0


class _Pair(NamedTuple):
    """The two runs, and each leaf name's column in each; ``pinned``: a changed sharding fails."""

    recording: Recording
    replayed: Recording
    pinned: bool
    columns: tuple[dict[str, int], dict[str, int]]
    full: (
        Recording  # the recording before leaves the replay lacks were left out: its gradients set allowances
    )
    skipped: frozenset[int] = frozenset()  # the steps the recorded run's optimizer skipped (skipped_steps)

    @staticmethod
    def of(recording: Recording, replayed: Recording, pinned: bool, full: Recording) -> _Pair:
        columns = tuple({n: i for i, n in enumerate(r.names)} for r in (recording, replayed))
        return _Pair(recording, replayed, pinned, columns, full, frozenset(skipped_steps(full)))

    def gradient(self, t: int, name: str) -> _Leaf:
        """The gradient digest ``name`` at step t: the recording's, else (a step that returned none) the
        replay's (a correct replay's gradients match the recording's, so either tells a rounding-level one)."""
        for rec in (self.full, self.replayed):
            if name in rec.names:
                g = _Leaf.at(rec, rec.steps, t, rec.names.index(name))
                if g.present:
                    return g
        return self.true_gradient(t, name.removeprefix("grad "))

    def true_gradient(self, t: int, path: str) -> _Leaf:
        """Where neither run returned parameter ``path``'s gradient at step t: the task's own gradient there, as
        a run kept its ``max|g|`` and norm (:mod:`shardcheck.parity.harness.true_gradients`: a replay keeps it,
        so that it tells a rounding-level gradient as a live check's reference does); else not present."""
        name = "param " + path
        for rec in (self.full, self.replayed):
            found = true_gradients.read(rec.meta, t, path)
            if found is not None and name in rec.names:
                top, norm = found
                none = np.full(SAMPLES, np.nan)
                shape = rec.shapes[rec.names.index(name)]
                return _Leaf(
                    True, shape, "float32", "", norm, top, math.nan, none, b"", np.zeros(SAMPLES, bool)
                )
        return _Leaf.at(self.full, self.full.steps, t, None)

    def exact_zero(self, t: int, path: str) -> bool:
        """Whether parameter ``path``'s gradient at step t is exactly 0 in both runs (each run's gradient digest,
        else the task's own gradient it kept: :mod:`~shardcheck.parity.harness.true_gradients`): no rounding noise
        drives either update there (a stop_gradient teacher's, a frozen group's), so neither run's update may
        widen the other's allowance; ``False`` where a run holds neither (trial 30: a teacher in a set_to_zero
        group decayed by the candidate's step, which returned no gradients, replayed as a PASS: its own update,
        2.84e-05 a step, had been added to its allowance as rounding noise's)."""
        name = "grad " + path
        for rec in (self.full, self.replayed):
            top = None
            if name in rec.names:
                leaf = _Leaf.at(rec, rec.steps, t, rec.names.index(name))
                top = leaf.max if leaf.present else None
            if top is None:
                found = true_gradients.read(rec.meta, t, path)
                top = None if found is None else found[0]
            if top is None or top != 0.0:
                return False
        return True

    def noise(self, t: int, path: str) -> tuple[float, float] | None:
        """Parameter ``path``'s float32-compute true gradient's ``max|g_32|`` and its gradient's compute noise at
        step t as a run measured them at low-precision compute (:func:`~shardcheck.parity.harness.
        true_gradients.rounding_noise`: a replay keeps them, the recording's first); ``None`` where neither
        holds them (float32 compute, an older recording replayed by an older version)."""
        return self._kept(true_gradients.read_noise, t, path)

    def least(self, t: int, path: str) -> float:
        """The least over parameter ``path``'s elements of each one's largest ``|g|`` up to step t, as a run kept
        it (:class:`~shardcheck.parity.harness.true_gradients.Peaks`: a replay keeps it), the recording's first;
        ``inf`` where neither holds it (an older recording replayed by an older version)."""
        found = self._kept(true_gradients.read_least, t, path)
        return math.inf if found is None else found

    def sampled(self, t: int, path: str) -> list[float | None] | None:
        """Parameter ``path``'s gradient peaks at its digest samples up to step t, as a run kept them
        (:attr:`~shardcheck.parity.harness.true_gradients.Peaks.sampled`), the recording's first; ``None`` where
        neither holds them."""
        return self._kept(true_gradients.read_sampled, t, path)

    def _kept(self, read, t: int, path: str):
        """What ``read(meta, t, path)`` finds in the recording's metadata, else the replay's; ``None`` in neither."""
        for rec in (self.full, self.replayed):
            found = read(rec.meta, t, path)
            if found is not None:
                return found
        return None

    @property
    def one_process(self) -> bool:
        """Both runs ran as one process (every sample read; in a launched run, only process 0's)."""
        return all(_processes(r.meta) == 1 for r in (self.recording, self.replayed))

    def leaf(self, which: str, row: int, name: str) -> _Leaf:
        """The recorded (``which == "recorded"``) or replayed digest of ``name`` at point ``row`` (-1: initial)."""
        mine = which != "recorded"
        rec = self.replayed if mine else self.recording
        digests = rec.initial if row < 0 else rec.steps
        found = _Leaf.at(rec, digests, max(row, 0), self.columns[mine].get(name))
        twin = _twin(name)
        if mine and not found.present and twin in self.columns[1] and twin not in self.columns[0]:
            # an optimizer-state leaf whose kind its dtype decides goes by the other name in the replay at this
            # point (an int32 count a pmean of the whole state made float32: "opt_state 1.0.count" for "counter
            # 1.0.count"): the same leaf, compared as such (its dtype changed), never as missing (trial 43)
            return _Leaf.at(rec, digests, max(row, 0), self.columns[1][twin])
        return found


def _sample_base(pair: _Pair, bounds: _Bounds, t: int, name: str, base: float, atol: float):
    """Each digest sample's tolerance of a parameter only part of whose gradient has been at rounding level, where
    the run kept its gradient's peaks at those samples (:attr:`~shardcheck.parity.harness.true_gradients.Peaks.
    sampled`): ``base`` at a sample within ``atol``, ``base`` less the allowance at the others (their gradient
    is not noise, so Adam's update of them is not either); ``None`` (every sample at ``base``) otherwise."""
    if name not in bounds.rounding or name in bounds.whole or t < 0:
        return None
    peaks = pair.sampled(t, name.removeprefix("param "))
    if peaks is None:
        return None
    resolved = base - bounds.allowance.get(name, 0.0)
    if any(p is not None and p > atol for p in peaks):
        bounds.resolved[(t, name)] = resolved
    return np.array([base if p is None or p <= atol else resolved for p in peaks])


def _loss_moves(bounds: _Bounds, param: str, g: _Leaf, atol: float) -> float:
    """How far the loss moves per unit of ``param``'s allowance, to first order: ``sqrt(size) ||g||_2``; of a leaf
    only part of whose gradient has been at rounding level, at most ``size * atol``: only those elements, each
    ``|g| <= atol``, carry the allowance (a digest allows it the whole leaf)."""
    moves = math.sqrt(max(g.size, 1)) * g.norm
    if param in bounds.rounding and param not in bounds.whole:
        return min(moves, max(g.size, 1) * atol)
    return moves


def _normalized(pair: _Pair, path: str) -> bool:
    """Whether the recorded task's optimizer normalizes ``path``'s update (``meta["normalized"]``,
    :func:`~shardcheck.parity.harness.recorded.normalized_params`): only then is an element whose gradient is
    rounding noise moved lr-far. A recording without the field (an older one) is read as normalizing."""
    names = pair.recording.meta.get("normalized")
    return names is None or path in names


def _normalized_of(pair: _Pair, unresolved: Sequence[str]) -> tuple[str, ...] | None:
    """The ``unresolved`` parameters (``"param PATH"``) whose update the recorded task's optimizer normalizes
    (``StepRecord.normalized``); ``None`` for a recording without ``meta["normalized"]`` (an older one)."""
    names = pair.recording.meta.get("normalized")
    return None if names is None else tuple(n for n in unresolved if n.removeprefix("param ") in names)


def _grow_allowance(pair: _Pair, bounds: _Bounds, t: int, atol: float) -> float:
    """Add step t's rounding-level allowance to every parameter whose gradient (:meth:`_Pair.gradient`) is within
    ``atol`` of 0 (module docstring); returns the loss's drift bound from the allowance before this step."""
    drift = 0.0
    grown = {}
    for param in pair.recording.names:
        if not param.startswith("param "):
            continue
        g = pair.gradient(t, "grad " + param.removeprefix("param "))
        if not g.present:
            continue
        drift += _loss_moves(bounds, param, g, atol) * bounds.allowance.get(param, 0.0)
        # the whole gradient at rounding level, or some of its elements at every step so far (a fused qkv bias's
        # key third) under an optimizer that normalizes them to an lr-sized update: its largest update bounds theirs
        if _at_rounding_level(pair, bounds, t, param, g, atol):
            bounds.rounding.setdefault(param, t)
            p, q = pair.leaf("recorded", t, param), pair.leaf("replayed", t, param)
            if p.present and math.isfinite(p.update):
                # |c_t - r_t| grows by at most max|u_c| + max|u_r|: each run's own noise sets its update's size
                # (Adam's g / (sqrt(v) + eps) is lr-sized or less by the noise against eps), so neither run's
                # update bounds the other's
                theirs = q.update if q.present and math.isfinite(q.update) else p.update
                grown[param] = p.update + theirs
    for param, a in grown.items():
        bounds.allowance[param] = bounds.allowance.get(param, 0.0) + a
    return drift


def _live_drift(pair: _Pair, t: int) -> float:
    """The live check's loss drift at step t as the replayed run measured it on its own steps (``meta["loss_drift"]``,
    :class:`~shardcheck.parity.tolerance.loss_drift.LossDrift`: the gradient's tolerance propagated through the
    task's optimizer, accumulated over the steps before t, times ``|g_t|``), which the loss's tolerance adds as a
    live check's does; 0 where the replay kept none (a run recorded before it was kept)."""
    kept = pair.replayed.meta.get("loss_drift") or ()
    return float(kept[t]) if 0 <= t < len(kept) and math.isfinite(kept[t]) else 0.0


def _at_rounding_level(pair: _Pair, bounds: _Bounds, t: int, param: str, g: _Leaf, atol: float) -> bool:
    """Whether ``param``'s gradient ``g`` is at rounding level at step t (module docstring), recorded in ``bounds``
    (``whole``, ``quiet``, ``noise``). At low-precision compute, where a run measured the task's gradient in
    float32 compute and its compute noise (:meth:`_Pair.noise`): where that true gradient's ``max|g_32| <=
    atol_t`` (an attention key bias's is 0; a bfloat16 step returns it as noise some 40x ``atol_t``, which no
    ``max|g|`` rule tells from a small gradient), its noise ``N`` kept (the largest so far, each step's measure
    one realization); the least of the elementwise peaks is not read there (an element of a large leaf is small
    at a step by chance: a bfloat16 MoE's ``w_in``)."""
    path = param.removeprefix("param ")
    found = pair.noise(t, path) if bounds.compute else None
    if found is None and g.max == 0.0 and pair.exact_zero(t, path):  # no noise at all: compared as it is
        return False
    at = g.max <= atol if found is None else found[0] <= atol
    if at and found is not None:
        bounds.noise[param] = max(bounds.noise.get(param, 0.0), found[1])
    if at:
        bounds.whole.add(param)
        bounds.quiet.add(param)
        return True
    return found is None and pair.least(t, path) <= atol and _normalized(pair, path)


def _rounding_allowance(bounds: _Bounds, name: str) -> float:
    """What a leaf of a parameter whose whole gradient is at rounding level is also allowed at low-precision
    compute, ``N`` its largest measured gradient noise so far: its gradient at this step ``2 N`` (each run's
    gradient lies within ``N`` of the true 0), its optimizer moments ``2 N`` at every step from the first
    (Adam's ``mu`` moves by at most ``(1 - b1)`` of the gradients' difference per step, decaying by ``b1``;
    ``nu`` by ``(1 - b2)`` of ``g^2``, less), as the live check allows each gradient its measured noise and
    propagates it through the optimizer; 0 for any other leaf."""
    kind, _, path = name.partition(" ")
    if kind == "grad" and "param " + path in bounds.quiet:
        return 2.0 * bounds.noise.get("param " + path, 0.0)
    if kind == "opt_state":
        ends = (
            a
            for p, a in bounds.noise.items()
            if p in bounds.whole and path.endswith("." + p.removeprefix("param "))
        )
        return 2.0 * max(ends, default=0.0)
    return 0.0


SKIPPED_KINDS = ("loss", "grad")
"""The leaf kinds a step its optimizer skipped leaves not finite (an overflow's loss and gradients); the parameters
stay as they were and the optimizer state finite (:func:`skipped_steps`)."""

KEPT_KINDS = ("param", "opt_state")
"""The leaf kinds whose digests stay finite at a skipped step."""


def skipped_steps(recording: Recording, steps: int | None = None) -> tuple[int, ...]:
    """The first ``steps`` recorded steps (default: all) that the recorded run's optimizer skipped
    (``StepRecord.skipped``): a loss or gradient digest not finite (``max|x|`` NaN or infinite, exactly when an
    element is) while every parameter's update size is 0 (the parameters exactly as they were) and every
    parameter and optimizer-state digest after the step is finite (``optax.apply_if_finite`` or a loss-scale
    check left them). Such a step is no divergence: a replay compares its loss and gradients by finiteness
    (:func:`_by_finiteness`). A loss that overflows while the parameters move is a divergence."""
    kinds = np.array([n.split(" ", 1)[0] for n in recording.names])
    d = recording.steps
    bad = d.present & ~np.isfinite(d.max)
    lost = bad & np.isin(kinds, SKIPPED_KINDS)[None, :]
    broken = bad & np.isin(kinds, KEPT_KINDS)[None, :]
    moved = d.present & (kinds == "param")[None, :] & (d.update != 0)  # NaN moved too
    n = recording.num_steps if steps is None else min(steps, recording.num_steps)
    return tuple(t for t in range(n) if lost[t].any() and not broken[t].any() and not moved[t].any())


def _by_finiteness(t: int, name: str, r: _Leaf, c: _Leaf) -> DigestError | None:
    """A loss or gradient leaf of a skipped step (:func:`skipped_steps`) not finite in either run, compared by
    finiteness alone (evidence ``"finite"``: both not finite matches, error 0; one run only fails, error inf);
    ``None`` where both are finite (compared by value) or the leaf changed structurally."""
    if _structural(t, name, r, c) is not None:
        return None
    sides = (math.isfinite(r.max), math.isfinite(c.max))
    if all(sides):
        return None
    ok = sides[0] == sides[1]
    return DigestError(t, name, "finite", r.max, c.max, 0.0 if ok else math.inf, 0.0, ok)


def _compare_point(pair: _Pair, bounds: _Bounds, t: int) -> list[DigestError]:
    """Every recorded leaf at point t (``-1``: the initial state, at step 0's tolerance)."""
    rtol, atol = bounds.derived(pair.recording.meta, t)
    bounds.quiet = set()
    drift = _grow_allowance(pair, bounds, t, atol) + _live_drift(pair, t) if t >= 0 else 0.0
    if t >= 0:
        # named as the live check names them (its at_rounding: the whole gradient within atol of 0); a leaf only
        # some of whose elements are (a fused qkv bias's key third, a kernel's element small by chance) keeps its
        # allowance but is not named: it passes or fails as any other leaf (issue #36, trials 18 and 19)
        bounds.unresolved[t] = tuple(
            n
            for n, first in bounds.rounding.items()
            if first <= t
            and n in bounds.whole
            and bounds.allowance.get(n, 0.0) > atol + rtol * pair.leaf("recorded", t, n).max
        )
    out = []
    for name in pair.recording.names:
        r = pair.leaf("recorded", t, name)
        if not r.present:
            continue
        c = pair.leaf("replayed", t, name)
        skips = t in pair.skipped and name.split(" ", 1)[0] in SKIPPED_KINDS
        finite = _by_finiteness(t, name, r, c) if skips else None
        if finite is not None:
            out.append(finite)
            continue
        base = bounds.base(name, r, t, rtol, atol) + (drift if name == "loss" else 0.0)
        base += bounds.compute_allowance(name, r, t) + _rounding_allowance(bounds, name)
        update_base = None
        if name.startswith("param "):
            update_base = base + bounds.last_base.get(name, base)
            bounds.last_base[name] = base
        state = _state_error(pair, t, name, r, c)
        if state is not None:
            out.append(state)
            continue
        if t >= 0:
            bounds.scale.setdefault(t, []).append((name, r.max, base, r.update, update_base))
        out.append(
            _leaf_error(
                t, name, r, c, base, update_base, pair, _sample_base(pair, bounds, t, name, base, atol)
            )
        )
    return out


def _state_error(pair: _Pair, t: int, name: str, r: _Leaf, c: _Leaf) -> DigestError | None:
    """A floating model-state leaf after a step by its own rule (:mod:`~shardcheck.parity.comparison.state_digest`:
    not compared, or its change compared coarsely), or ``None`` where its value is compared as any leaf's."""
    if not name.startswith("state ") or t < 0 or _structural(t, name, r, c) is not None:
        return None
    was = (pair.leaf("recorded", t - 1, name), pair.leaf("replayed", t - 1, name))
    metas = (pair.recording.meta, pair.replayed.meta)
    found = state_evidence(name, (r, c), was, read_paths(*metas), written_paths(*metas))
    return None if found is None else DigestError(t, name, *found)


def _placement_changes(pair: _Pair, steps: int) -> tuple[tuple[str, str, str], ...]:
    """``(leaf, recorded spec, replayed spec)`` of each leaf both runs hold whose sharding differs somewhere (the
    first point where it does), in the recording's leaf order."""
    out = []
    for name in pair.recording.names:
        for t in range(-1, steps):
            r, c = pair.leaf("recorded", t, name), pair.leaf("replayed", t, name)
            if r.present and c.present and r.sharding != c.sharding:
                out.append((name, r.sharding, c.sharding))
                break
    return tuple(out)


def _hashes(pair: _Pair, steps: int) -> tuple[int, int, bool]:
    """``(matched, compared, bitwise)`` over every point of the recorded leaves."""
    matched = compared = 0
    bitwise = True
    for t in range(-1, steps):
        for name in pair.recording.names:
            r, c = pair.leaf("recorded", t, name), pair.leaf("replayed", t, name)
            if not r.present:
                continue
            if not c.present or (r.shape, r.dtype, r.sharding) != (c.shape, c.dtype, c.sharding):
                bitwise = False
                continue
            compared += 1
            matched += r.sha256 == c.sha256
    return matched, compared, bitwise and matched == compared and compared > 0


def compare_run(
    recording: Recording,
    replayed: Recording,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    pin_placement: bool = False,
    loss_weight: Callable[[int], float | None] | None = None,
) -> RunComparison:
    """Compare a replayed run with a recording, leaf by leaf and step by step (module docstring: the rules and
    why they are sound).

    Args:
        recording: the recorded run (:func:`~shardcheck.parity.harness.recorded.load_recording`).
        replayed: the replay (:func:`~shardcheck.parity.harness.recorded.record_run` of the same task, mesh and batches).
        rtol, atol: fixed tolerances for every step instead of the derived ones.
        pin_placement: a leaf whose sharding differs from the recording's fails (evidence ``"sharding"``).
            Default False: a recording checks a refactor's values, and a changed placement (``P()`` recorded,
            ``P(None, 'fsdp')`` replayed) is listed in the notes and in ``placement_changes``, not a failure.
        loss_weight: ``step -> the batch's total weight`` of a ``(loss_sum, weight)`` loss (``None`` for a mean
            loss), called once, for the first failing step: its record's ``loss_weight``, as a live check sets it
            (a gradient factor equal to it is named as the loss sum not divided by its weight). ``None``: no
            weight known (two recordings compared; :func:`~shardcheck.parity.harness.replay.
            check_against_recording` passes the replayed task's).

    Returns:
        A :class:`RunComparison`: the verdict, the first failing step and leaf, its cause where the digests show
        one, the evidence used and the hashes' agreement.

    The runs are compared value by value; a leaf's sharding fails only with ``pin_placement=True``, or when the
    same strategy (or two user steps) was replayed on another mesh than the recorded one (the cause says so).
    Leaves only one run has fail when the runs are of the same kind (the same strategy, or two user steps), and
    are left out (and counted in the notes) otherwise.

    A loss or gradients the recording holds but the replayed step returns none of (a step that changed what it
    returns) are not compared, and the notes say so.

    The comparison emits the live check's records (``records``), diagnosed by the live check's
    :func:`~shardcheck.parity.diagnosis.rules.diagnose` (``diagnoses``, ``cause``): the recording is the
    reference, the replay the candidate. Each leaf's :class:`~shardcheck.parity.diagnosis.rules.LeafError` holds
    what a digest gives, and a digest is not every element:

    - ``max_abs_err``: the deciding digest's error (max, norm, a sample, the update size), not the largest
      elementwise error; ``max_rel_err`` that over the recorded ``max|x|``; ``tolerance``: what it was held to;
    - ``ratio`` and ``spread``: the median and the 10th-90th percentile of the elementwise ratio over the (up to
      8) fixed-index samples, of the step's change for a parameter or an optimizer-state leaf, of the value for
      the loss and a gradient: a factor is claimed constant across those samples, not across every element.
      Where no sample is usable, the whole leaf's ratio (update size, norm; a counter's value) with no spread,
      and ``samples`` 0 (a gradient, parameter or optimizer-state leaf: no factor across it is said from that);
    - ``reference_change``: the recorded update size ``max|r_t - r_{t-1}|`` of a parameter; ``None`` for an
      optimizer-state leaf (a digest keeps no update size of it);
    - ``shape``: the recorded shape.

    The replicas' agreement (``replica_mismatches``, ``replica_axes``) is no digest's (a digest hashes one copy
    of each slice): it is the replay's own comparison of its copies across its devices after each step
    (``replayed.meta["replicas"]``, :func:`~shardcheck.parity.harness.recorded.replica_evidence`), so a step that
    writes a replicated leaf on some devices only FAILs (``replicas_differ``), as live, and is never "bitwise
    identical" (trial 37); nor is a replay of a recording whose own copies differed (a note says so). A replayed
    run recorded before its copies were compared says in its notes that it compared none (``REPLICAS_UNSEEN``).
    Not measured by a digest, and so never read by a rule for a replay: the reruns of the known faulty reductions
    (``matches``) and the re-check of a late failure from identical state (``synchronized``). The scale evidence
    is read from the digests (:func:`_scale_evidence`: which recorded leaves a gradient off by S or 1/S would
    have moved beyond their tolerance), for the replay's verdict (``check_against_recording``).

    To compare a candidate step with a recording, ``check_parity(candidate, task, reference=recording)`` (or
    ``verify --against FILE``) replays it and returns this comparison's :meth:`RunComparison.report`; this
    function compares two recordings.

    Raises:
        TypeError: either argument not a :class:`~shardcheck.parity.harness.recorded.Recording`; ``pin_placement`` not a
            bool; ``loss_weight`` neither None nor callable.
        ValueError: the two are runs of different tasks; ``rtol`` / ``atol`` not a number >= 0.
        KeyError: a recording whose metadata lacks a field :func:`~shardcheck.parity.harness.recorded.load_recording`
            checks (one built by hand).
    """
    _check_options(recording, replayed, rtol, atol, pin_placement, loss_weight)
    steps = min(recording.num_steps, replayed.num_steps)
    pair, same, returned = _paired(recording, replayed, pin_placement)
    policy, dtype = looser_precision(recording.meta, replayed.meta)
    terms = tuple(recording.meta.get("terms") or ())
    bounds = _Bounds(rtol, atol, dtype, compute=compute_eps(recording.meta, replayed.meta), terms=terms)
    leaves = [e for t in range(-1, steps) for e in _compare_point(pair, bounds, t)]
    matched, compared, bitwise = _hashes(pair, steps)
    moved = _placement_changes(pair, steps)
    first = _first_failure(leaves, bounds.rounding)
    replicas = replayed.meta.get("replicas")  # None: a run recorded before its copies were compared
    records = _weighted(_records(pair, bounds, leaves, steps, replicas), loss_weight)
    differ = next((r for r in records if r.replica_mismatches), None)
    recorded_notes = _recorded_replicas_note(recording.meta, steps)  # the recorded run's own copies differed
    bitwise = bitwise and differ is None and not recorded_notes
    ok = first is None and differ is None
    findings = _bitwise_quiet(_diagnoses(recording, replayed, records, leaves, first), bitwise and ok)
    cause = None if ok else " ".join(d.message for d in findings if d.code not in QUIET)
    hashes, uncompared = (matched, compared, bitwise), _uncompared(leaves)
    notes = recorded_notes + _replicas_note(replayed.meta, ok) + _placement_note(pair, moved, same)
    comparison = RunComparison(
        run=str(replayed.meta["run"]),
        recorded_run=str(recording.meta["run"]),
        ok=ok,
        steps=steps,
        leaves=tuple(leaves),
        first_failure=first,
        cause=cause,
        evidence=_evidence_text(pair, steps, hashes, bounds, replicas, differ, uncompared, recorded_notes),
        notes=tuple(
            _notes(recording, replayed, steps, same or pair.pinned, returned)
            + notes
            + _precision_note(recording.meta, replayed.meta, policy, dtype)
            + _compute_note(recording.meta, replayed.meta, bounds.compute)
        ),
        hashes_matched=matched,
        hashes_compared=compared,
        bitwise=bitwise,
        placement_changes=moved,
        pin_placement=pin_placement,
        matmul_precision=policy,
        num_shards=recording.meta.get("num_shards"),
        records=records,
        diagnoses=findings,
        facts=_facts(recording),
        replicas_compared=replicas is not None,
    )
    return with_divergence_note(comparison)


def _paired(recording: Recording, replayed: Recording, pin_placement: bool) -> tuple[_Pair, bool, set[str]]:
    """``(pair, same, returned)``: the recorded leaves compared (those of the kinds the replay holds; of another
    strategy's run, only the leaves both hold) paired with the replay's, placement pinned where asked or where the
    same run was replayed on another mesh; whether the runs are of the same kind (the same strategy, or two user
    steps); the kinds of leaf the replay holds."""
    kinds = (recording.meta["run_kind"], replayed.meta["run_kind"])
    same = kinds == ("candidate", "candidate") or (
        kinds == ("strategy", "strategy") and recording.meta["run"] == replayed.meta["run"]
    )
    returned = {n.split(" ", 1)[0] for n in replayed.names}
    kept = _only(recording, [n for n in recording.names if n.split(" ", 1)[0] in returned])
    if not same:  # another strategy: only the leaves both runs have are compared
        kept = _only(kept, [n for n in kept.names if n in set(replayed.names)])
    other_mesh = same and recording.meta.get("mesh") != replayed.meta.get("mesh")
    return _Pair.of(kept, replayed, pin_placement or other_mesh, recording), same, returned


def _check_options(recording, replayed, rtol, atol, pin_placement, loss_weight) -> None:
    """:func:`compare_run`'s arguments checked, in the order its errors are listed."""
    _check_pair(recording, replayed)
    _check_tolerances("compare_run", rtol, atol)
    if not isinstance(pin_placement, bool):
        raise TypeError(
            f"compare_run: pin_placement must be True or False, got {pin_placement!r}; pass pin_placement=True "
            "to fail on a changed sharding"
        )
    if loss_weight is not None and not callable(loss_weight):
        raise TypeError(
            f"compare_run: loss_weight must be None or a callable step -> weight, got {type(loss_weight).__name__}; "
            "pass lambda t: the weight of batch t, or None"
        )


def looser_precision(was: Mapping, now: Mapping) -> tuple[str, str | None]:
    """The looser of two runs' matmul precisions (``meta["matmul_precision"]``, float32 where a recording has
    none), and the dtype whose eps the comparison's derived tolerance uses: the recording's ``tolerance_dtype``
    or, where the matmuls round more, that precision's (``matmul.EPS_DTYPE``: TF32 as float16's 2**-10, one
    bfloat16 pass as bfloat16's 2**-7); ``None`` when the ``tolerance_dtype`` stands."""
    policy = matmul.coarsest(was.get("matmul_precision", "float32"), now.get("matmul_precision", "float32"))
    eps = matmul.policy_eps(policy)
    return policy, matmul.EPS_DTYPE[policy] if eps > _eps(was["tolerance_dtype"]) else None


def compute_eps(was: Mapping, now: Mapping) -> float:
    """eps of the looser of two runs' compute dtypes (``meta["compute_dtype"]``, read from the model's layers as a
    live check reads it: :meth:`~shardcheck.parity.tolerance.precision.Precision.of`), where coarser than
    float32; 0 otherwise (a run recorded before it was stored counts as float32, so the replay's own stands)."""
    eps = max(_eps(m.get("compute_dtype") or "float32") for m in (was, now))
    return eps if eps > EPS32 else 0.0


def _compute_note(was: Mapping, now: Mapping, eps: float) -> list[str]:
    if not eps:
        return []
    sides = (
        f"recorded {was.get('compute_dtype') or 'float32'}, replayed {now.get('compute_dtype') or 'float32'}"
    )
    return [
        f"Compared within low-precision compute rounding ({sides}): each leaf is also allowed {SAFETY_FACTOR:g} "
        f"eps_c sqrt(t + 1) (eps_c = {eps:.3g}) of its recorded max|x|, a parameter of its recorded update size "
        "summed over the steps, the loss of |loss| / sqrt(n) for its n per-term losses (verify --compute-dtype)."
    ]


def _precision_note(was: Mapping, now: Mapping, policy: str, dtype: str | None) -> list[str]:
    if dtype is None:
        return []
    sides = f"recorded {was.get('matmul_precision', 'float32')}, replayed {now.get('matmul_precision', 'float32')}"
    return [
        f"Compared within {policy} matmul rounding ({sides}): the derived tolerance uses eps = "
        f"{matmul.policy_eps(policy):.3g} in place of {was['tolerance_dtype']}'s (verify --matmul-precision)."
    ]


PLACEMENTS_SHOWN = 8
"""Leaves a placement note or cause lists by name (the rest counted)."""


def _placement_list(moved: Sequence[tuple[str, str, str]]) -> str:
    """``"param w: P() -> P(None, 'fsdp'); ..."``, the first :data:`PLACEMENTS_SHOWN`, the rest counted."""
    text = "; ".join(f"{name}: {was} -> {now}" for name, was, now in moved[:PLACEMENTS_SHOWN])
    more = len(moved) - PLACEMENTS_SHOWN
    return text + (f"; and {more} more" if more > 0 else "")


def _placement_note(pair: _Pair, moved: Sequence[tuple[str, str, str]], same: bool) -> list[str]:
    """The note of a placement that changed and was not pinned (values compared, not the shardings); none for
    another strategy's replay, whose placement differs by design (its own note says so)."""
    if not moved or pair.pinned or not same:
        return []
    return [
        f"Placement changed on {n_leaves(len(moved))}, values compared (a recording checks what a refactor "
        f"computes, not where it keeps it; --pin-placement, pin_placement=True, fails on it): "
        f"{_placement_list(moved)}."
    ]


def _check_pair(recording, replayed) -> None:
    for arg, value in (("recording", recording), ("replayed", replayed)):
        if not isinstance(value, Recording):
            raise TypeError(
                f"compare_run: {arg} must be a Recording, got {type(value).__name__}; read a file with "
                "load_recording(path), make a run's with record_run(task, ...)"
            )
    # the task's name is how it was spelled; another task shows in the structure and the initial state


def _only(recording: Recording, names: Sequence[str]) -> Recording:
    """``recording`` restricted to ``names`` (the leaves another strategy's replay has too)."""
    cols = [recording.names.index(n) for n in names]

    def cut(d: Digests) -> Digests:
        return Digests(*(getattr(d, f.name)[:, cols] for f in dataclasses.fields(Digests)))

    return dataclasses.replace(
        recording,
        names=tuple(names),
        shapes=tuple(recording.shapes[i] for i in cols),
        dtypes=tuple(recording.dtypes[i] for i in cols),
        sample_index=recording.sample_index[cols],
        initial=cut(recording.initial),
        steps=cut(recording.steps),
    )


def _first_failure(leaves: list[DigestError], rounding: Mapping[str, int]) -> DigestError | None:
    """The first failing leaf: the earliest point, then the first kind of :data:`KINDS`, then a value before a
    pinned placement that changed, then a leaf not at rounding level (``rounding``: the parameters at rounding
    level, by the first step they were: :attr:`_Bounds.rounding`), then the worst."""
    failing = [e for e in leaves if not e.ok]
    if not failing:
        return None
    t = min(e.step for e in failing)
    order = {k: i for i, k in enumerate(KINDS)}
    noise = {n for n, first in rounding.items() if first <= t}
    return min(
        (e for e in failing if e.step == t),
        key=lambda e: (order.get(e.kind, len(KINDS)), e.evidence == "sharding", e.name in noise, -e.badness),
    )


def _twin(name: str) -> str | None:
    """An optimizer-state leaf's name under the other kind its dtype could give it (``"counter 1.0.count"`` <->
    ``"opt_state 1.0.count"``), else ``None``."""
    kind, _, path = name.partition(" ")
    other = {"counter": "opt_state", "opt_state": "counter"}.get(kind)
    return None if other is None or path.startswith("model.") or path == "step" else f"{other} {path}"


def _left_unplaced(moved: list[tuple[str, str, str]], now: Mapping) -> str:
    """Where every moved leaf of a user step's replay is on one device: why (trial 59: an optimizer's state left
    where shardcheck made it, read as the step moving it), else ``""``."""
    if now.get("run_kind") != "candidate" or any(replayed != "single device" for _, _, replayed in moved):
        return ""
    return (
        ". shardcheck gives a user step its model and optimizer unplaced, on one device, and these leaves stayed "
        "there: the step places some of the state it is given but not these (an optimizer made before its model "
        "was placed holds its state where the model was). Place every leaf in the step (jax.device_put of "
        "nnx.state((model, optimizer)) with your shardings), or compare the values alone (no --pin-placement)"
    )


def _structural_cause(structural: list[DigestError], was: Mapping, now: Mapping) -> str:
    """A leaf missing, or a changed shape, dtype or sharding (another mesh named as such)."""
    e, more = structural[0], len(structural) - 1
    tail = f" (and {more} more {'leaf' if more == 1 else 'leaves'})" if more else ""
    if e.evidence == "missing":
        return f"{e.name} is recorded but this run has none{tail}"
    if e.evidence == "dtype" and e.name.startswith(("counter ", "opt_state ")) and _integer_kind(e):
        converted = converted_counter(_dtype_record(e))  # as the localization says it
        return f"{converted}{tail}"
    if e.evidence == "sharding" and was.get("mesh") != now.get("mesh"):
        return (
            f"recorded on mesh {_axes(was.get('mesh'))}, replayed on {_axes(now.get('mesh'))}: another mesh "
            f"places the leaves elsewhere ({e.name}: {e.recorded} -> {e.replayed}{tail}); replay on the "
            "recorded mesh (load_recording(path, task=..., mesh=...) refuses another)"
        )
    if all(x.evidence == "sharding" for x in structural):
        moved = [(x.name, str(x.recorded), str(x.replayed)) for x in structural]
        return (
            f"the placement is pinned (--pin-placement, pin_placement=True) and {n_leaves(len(moved))} changed "
            f"sharding: {_placement_list(moved)}{_left_unplaced(moved, now)}"
        )
    return f"{e.name}: changed {e.evidence} {e.recorded} -> {e.replayed}{tail}"


# ------------------------------------------------------------------ the harness's records, and its diagnosis


def _integer_kind(e: DigestError) -> bool:
    """An optimizer-state leaf whose dtype changed between integer and float (a counter converted)."""
    ints = [str(d).startswith(("int", "uint", "bool")) for d in (e.recorded, e.replayed)]
    return e.evidence == "dtype" and e.name.startswith(("counter ", "opt_state ")) and ints[0] != ints[1]


def _dtype_record(e: DigestError) -> LeafError:
    kind, _, path = e.name.partition(" ")
    return LeafError(e.step, kind, path, math.inf, math.inf, 0.0, False, dtypes=(e.recorded, e.replayed))


def _sample_ratio(
    pair: _Pair, t: int, name: str
) -> tuple[float | None, tuple[float, float] | None, int | None]:
    """``(median, (p10, p90), n)`` of the replay's over the recording's elementwise ratio at the leaf's fixed-index
    samples, as :func:`shardcheck.parity.comparison.live.leaf_error` reads it over every element: of the change
    in step t for a parameter or an optimizer-state leaf (the point before: the initial state at t = 0), of the
    value for the loss and a gradient; over the samples whose recorded change is at least 1% of the largest
    sampled one, ``n`` of them. ``(None, None, None)`` where no sample is usable (none taken, a change of 0)."""
    kind = name.split(" ", 1)[0]
    r, c = pair.leaf("recorded", t, name), pair.leaf("replayed", t, name)
    if not (r.present and c.present) or r.shape != c.shape:
        return None, None, None
    dr, dc = r.samples, c.samples
    if kind in ("param", "opt_state"):
        r0, c0 = pair.leaf("recorded", t - 1, name), pair.leaf("replayed", t - 1, name)
        if not (r0.present and c0.present):
            return None, None, None
        dr, dc = dr - r0.samples, dc - c0.samples
    usable = r.sampled & np.isfinite(dr) & np.isfinite(dc)
    top = float(np.max(np.abs(dr[usable]), initial=0.0))
    keep = usable & (np.abs(dr) >= 0.01 * top) & (top > 0)
    if not keep.any():
        return None, None, None
    q = np.sort(dc[keep] / dr[keep])
    lo, hi = spread_ranks(len(q))
    return float(np.median(q)), (float(q[lo]), float(q[hi])), len(q)


def _sample_slices(pair: _Pair, t: int, name: str) -> tuple[tuple[int, float, bool], ...] | None:
    """``LeafError.slices`` of a stacked leaf (ndim >= 2, leading size >= 2) at step t, read from its recorded
    samples as :func:`_sample_ratio` reads them (the change in step t for a parameter or an optimizer-state leaf,
    else the value): per slice of the leading axis, the samples in it, their largest difference and whether the
    replay's are all exactly 0 there; ``None`` for another leaf (not a gradient, a parameter or an optimizer-state
    leaf; the initial state, t < 0), or where either side has no digest."""
    kind = name.split(" ", 1)[0]
    r, c = pair.leaf("recorded", t, name), pair.leaf("replayed", t, name)
    col = pair.columns[0].get(name)
    if (
        kind not in ("grad", "param", "opt_state")
        or t < 0
        or col is None
        or not (r.present and c.present)
        or r.shape != c.shape
        or len(r.shape) < 2
        or r.shape[0] < 2
    ):
        return None
    dr, dc = r.samples, c.samples
    if kind in ("param", "opt_state"):
        r0, c0 = pair.leaf("recorded", t - 1, name), pair.leaf("replayed", t - 1, name)
        if not (r0.present and c0.present):
            return None
        dr, dc = dr - r0.samples, dc - c0.samples
    usable = r.sampled & np.isfinite(dr) & np.isfinite(dc)
    where = np.where(usable, pair.recording.sample_index[col] // max(r.size // r.shape[0], 1), -1)
    return tuple(
        (
            int(np.sum(where == k)),
            float(np.max(np.abs(dc - dr)[where == k], initial=0.0)),
            bool(np.any(where == k)) and not np.any(dc[where == k]),
        )
        for k in range(r.shape[0])
    )


def _finite_record(pair: _Pair, e: DigestError) -> LeafError:
    """The :class:`LeafError` of a skipped step's loss or gradient compared by finiteness (evidence
    ``"finite"``: ``LeafError.finite``, the recording's and the replay's), else :func:`_leaf_record`'s."""
    if e.evidence != "finite":
        return _leaf_record(pair, e)
    kind, _, path = e.name.partition(" ")
    col = pair.columns[0].get(e.name)
    shape = None if col is None else tuple(pair.recording.shapes[col])
    sides = (math.isfinite(e.recorded), math.isfinite(e.replayed))
    return LeafError(e.step, kind, path or "loss", e.err, e.err, 0.0, e.ok, shape=shape, finite=sides)


def _leaf_record(pair: _Pair, e: DigestError) -> LeafError:
    """The harness's :class:`~shardcheck.parity.diagnosis.rules.LeafError` of one digest error (what a digest
    gives of each field: :func:`compare_run`'s docstring)."""
    kind, _, path = e.name.partition(" ")
    col = pair.columns[0].get(e.name)
    shape = None if col is None else tuple(pair.recording.shapes[col])
    if e.evidence in STRUCTURAL or e.evidence == "nan":
        other = tuple(pair.leaf("replayed", e.step, e.name).shape) if e.evidence == "shape" else None
        return LeafError(
            e.step,
            kind,
            path or "loss",
            math.nan if e.evidence == "nan" else e.err,  # NaN values, as a live leaf's error reads them
            math.inf,
            e.allowed,
            e.ok,
            shape=shape,
            cand_shape=other,
            missing=e.evidence == "missing",
            dtypes=(e.recorded, e.replayed) if e.evidence == "dtype" and _integer_kind(e) else None,
        )
    whole = kind == "counter" or e.step < 0 or (kind == "state" and e.evidence in _STATE_EVIDENCE)
    ratio, spread, samples = (None, None, None) if whole else _sample_ratio(pair, e.step, e.name)
    if ratio is None:  # no usable sample: the whole leaf's ratio (update size, norm, counter value)
        ratio = e.ratio
        # marked as read from no sample (LeafError.samples 0): no factor across the leaf is said from it
        samples = None if whole else 0
    top = pair.leaf("recorded", e.step, e.name).max
    rel = e.err / top if top > 0 else (0.0 if e.err == 0 else math.inf)
    r = pair.leaf("recorded", e.step, e.name)
    change = r.update if kind in ("param", "state") and e.step >= 0 and math.isfinite(r.update) else None
    if e.evidence == "not compared":  # state the task's reference step leaves as it was, as live (change 0)
        change = 0.0
    replayed = pair.leaf("replayed", e.step, e.name)
    zeros = kind == "grad" and top == 0 and replayed.max == 0  # both all zeros
    counts = (
        (int(_scalar(r, 0)), int(_scalar(replayed, 0)))
        if kind == "counter" and r.present and replayed.present
        else None
    )
    leaf = LeafError(
        e.step,
        kind,
        path or "loss",
        e.err,
        rel,
        e.allowed,
        e.ok,
        ratio,
        change,
        spread,
        shape,
        samples,
        zeros=zeros,
        counts=counts,
        # an accumulator the replay emptied where the recording's holds values (MultiSteps' acc_grads)
        cand_zeros=kind == "opt_state" and top > 0 and replayed.max == 0,
        slices=_sample_slices(pair, e.step, e.name),
    )
    if e.evidence != PART_EVIDENCE:
        return _with_value_factor(leaf, e, (r, replayed))
    was = (pair.leaf("recorded", e.step - 1, e.name), pair.leaf("replayed", e.step - 1, e.name))
    found = kept_samples((r, pair.leaf("replayed", e.step, e.name)), was)
    return leaf if found is None else dataclasses.replace(leaf, kept=(found[0], found[1], SAMPLED))


def _with_value_factor(leaf: LeafError, e: DigestError, now: tuple) -> LeafError:
    """``leaf`` (a failing ``state`` leaf the recorded step wrote at step ``e.step``) with
    ``LeafError.value_factor`` read from its digests ``now`` (recorded, replayed ``_Leaf``:
    :func:`~shardcheck.parity.comparison.state_digest.sampled_value_factor`, written x k of the recording's value:
    a psum of a replicated value, as live); ``leaf`` unchanged for any other leaf."""
    if leaf.kind != "state" or e.ok or e.step < 0 or e.evidence == "not compared" or not now[0].update > 0:
        return leaf
    return dataclasses.replace(leaf, value_factor=sampled_value_factor(now))


def _facts(recording: Recording) -> tuple[tuple[str, LeafFacts], ...]:
    """Each recorded parameter's :class:`~shardcheck.parity.diagnosis.grouping.LeafFacts`: shape, dtype and the
    mesh axes named in its ``PartitionSpec`` text (``"P(None, 'fsdp')"`` -> ``("fsdp",)``) after the first step,
    where the step placed it (a step that places the state itself, as a GSPMD step under ``jax.set_mesh`` does,
    starts from a state placed otherwise), else before it."""
    out = []
    for col, name in enumerate(recording.names):
        if name.startswith("param "):
            placed = str(recording.steps.sharding[0, col]) if len(recording.steps.sharding) else ""
            spec = placed or str(recording.initial.sharding[0, col])
            axes = tuple(re.findall(r"'([^']+)'", spec))
            leaf = LeafFacts(tuple(recording.shapes[col]), recording.dtypes[col], axes)
            out.append((name.removeprefix("param "), leaf))
    return tuple(out)


def _scalar(leaf: _Leaf, default):
    """A scalar leaf's value (its first sample), or ``default`` where the run has none."""
    return float(leaf.samples[0]) if leaf.present and math.isfinite(float(leaf.samples[0])) else default


def _replicas_counted(replicas: Sequence[Mapping] | None, t: int) -> tuple[int, int] | None:
    """``StepRecord.replicas_compared`` of step ``t`` from the replay's ``meta["replicas"]``: ``(leaves,
    devices)`` whose copies the replay compared; ``None`` where it compared none or did not count them (a
    recording made before the count was kept)."""
    if not replicas or not 0 <= t < len(replicas):
        return None
    found = replicas[t]
    leaves, devices = found.get("compared"), found.get("devices")
    return (int(leaves), int(devices)) if leaves and devices else None


def _replicas_at(replicas: Sequence[Mapping] | None, t: int, failing: bool) -> tuple[tuple, tuple]:
    """``(replica_mismatches, replica_axes)`` of step ``t`` from the replay's ``meta["replicas"]``, as a live
    check sets them: the parameters, optimizer-state, model-state and counter leaves whose copies differ, else on
    a ``failing`` step the returned gradients whose copies differ; ``((), ())`` where none was compared."""
    if not replicas or not 0 <= t < len(replicas):
        return (), ()
    found = replicas[t]
    names = tuple(found.get("leaves") or ()) or (tuple(found.get("grads") or ()) if failing else ())
    return names, tuple(found.get("axes") or ()) if names else ()


def _records(
    pair: _Pair,
    bounds: _Bounds,
    leaves: list[DigestError],
    steps: int,
    replicas: Sequence[Mapping] | None = None,
) -> tuple[StepRecord, ...]:
    """One :class:`~shardcheck.parity.diagnosis.rules.StepRecord` per compared step, as the live harness's: the
    recorded run is the reference, the replay the candidate; the initial state's record (step -1) only where
    it differs; ``identical_start`` where the state before a step t > 0 hashed as the recording's (and its copies
    agreed); ``replica_mismatches`` and ``replica_axes`` from the replay's own comparison of its copies
    (``replicas``: its ``meta["replicas"]``, :func:`_replicas_at`); ``scale_evidence`` from the digests
    (:func:`_scale_evidence`). Not measured by a digest, so left at their defaults: ``matches``,
    ``synchronized``."""
    meta = pair.recording.meta
    written = written_paths(meta, pair.replayed.meta)  # the forward pass's writes, as a live record's
    forward_writes = None if written is None else frozenset("model." + p for p in written)
    touched = next(
        (m["counters_touched"] for m in (meta, pair.replayed.meta) if "counters_touched" in m), None
    )
    # as live's; a drawn RNG stream's count is the forward pass's too (the loss draws from it)
    drawn = frozenset(f"model.{d}.count" for d in meta.get("drawn") or ())
    counters = None if touched is None else frozenset("model." + p for p in touched) | drawn
    out = []
    for t in range(-1, steps):
        at_t = [e for e in leaves if e.step == t]
        if t < 0 and all(e.ok for e in at_t):
            continue
        mismatches, axes = _replicas_at(replicas, t, not all(e.ok for e in at_t))
        before_agreed = not _replicas_at(replicas, t - 1, False)[0]
        rtol, atol = bounds.derived(meta, t)
        count = (pair.leaf(w, t, "counter step") for w in ("recorded", "replayed"))
        step_count, candidate_count = (int(_scalar(x, t + 1)) for x in count)
        out.append(
            StepRecord(
                step=t,
                rtol=rtol,
                atol=atol,
                loss=_scalar(pair.leaf("recorded", t, "loss"), math.nan),
                candidate_loss=_scalar(pair.leaf("replayed", t, "loss"), None),
                leaves=tuple(_resolved_record(_finite_record(pair, e), bounds) for e in at_t),
                step_count=step_count,
                candidate_step_count=candidate_count,
                unresolved=bounds.unresolved.get(t, ()),
                rounding_level=tuple(
                    n for n, first in bounds.rounding.items() if 0 <= first <= t and n in bounds.whole
                ),
                normalized=_normalized_of(pair, bounds.unresolved.get(t, ())),
                replayed=True,
                replicas_compared=_replicas_counted(replicas, t),
                identical_start=t > 0 and before_agreed and _identical_state(pair, t - 1),
                skipped=t in pair.skipped,
                replica_mismatches=mismatches,
                replica_axes=axes,
                forward_writes=forward_writes,
                loss_counters=counters,
                scale_evidence=_scale_evidence(bounds.scale.get(t, ()), _factors(pair, t))
                if t >= 0
                else None,
            )
        )
    return tuple(out)


def _factors(pair: _Pair, t: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((S, 1/S), (S', 1/S'))``: the factors of a sum for a mean and a mean taken twice (S the recording's
    ``num_shards``, 2 where unknown), and what the optimizer reads of them at step t. Under the task's global-norm
    clip (``meta["global_clip"]``, max norm M) that is the ratio of the clipped gradients at the replay's own
    gradient norm n (the task's gradient before the step, ``meta["true_gradients"]``): ``clip(c g) = g min(c,
    M / n)``, so ``c' = min(c, M / n) / min(1, M / n)``, 1 where the clip binds on both (trial 58: under a
    binding clip a sum for a mean replayed as a PASS, where the live check is CANNOT VERIFY); 1 where the norm is
    not known (a step that returned its gradients: they are compared themselves)."""
    num_shards = pair.recording.meta.get("num_shards")
    s = float(num_shards) if num_shards and num_shards > 1 else 2.0
    clip = pair.replayed.meta.get("global_clip") or pair.recording.meta.get("global_clip")
    if not clip:
        return (s, 1.0 / s), (s, 1.0 / s)
    params = [n.removeprefix("param ") for n in pair.recording.names if n.startswith("param ")]
    norms = [true_gradients.read(pair.replayed.meta, t, p) for p in params]
    if not norms or any(x is None for x in norms):
        return (s, 1.0 / s), (1.0, 1.0)
    ceiling = float(clip) / max(math.sqrt(sum(x[1] ** 2 for x in norms)), 1e-30)  # M / n
    return (s, 1.0 / s), tuple(min(c, ceiling) / min(1.0, ceiling) for c in (s, 1.0 / s))


def _scale_evidence(
    leaves: Sequence[tuple], factors: tuple[tuple[float, float], tuple[float, float]]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compared leaves of one step whose recorded digest a gradient times S, and times 1/S, would move beyond
    the tolerance it was held to: the live check's ``StepRecord.scale_evidence``, from the digests alone
    (``leaves``: :attr:`_Bounds.scale`'s entries of the step; ``factors``: :func:`_factors`, the gradient's and
    what the optimizer reads of it). A gradient's ``max|x|`` moves by ``|c - 1| max|x|``; a first moment's
    (linear in what the optimizer reads) by ``|c' - 1| max|x|``, a second moment's by ``|c'^2 - 1| max|x|``, and
    a parameter's update size by ``|c' - 1|`` of it only where the optimizer keeps no moment (plain SGD: Adam's
    update is normalized, Lion's a sign). Trial 57: a TF32 recording's tolerance, rtol 1.41, let a sum for a mean
    and a mean taken twice replay as a PASS."""
    moments = any(name.startswith("opt_state ") and moment(name) for name, *_ in leaves)
    shown = []
    for c, read in zip(*factors, strict=True):
        hit = []
        for name, top, allowed, update, update_allowed in leaves:
            kind, field = name.split(" ", 1)[0], moment(name) if name.startswith("opt_state ") else None
            if kind == "grad":
                change = abs(c - 1.0) * top
            elif field == "first":
                change = abs(read - 1.0) * top
            elif field == "second":
                change = abs(read * read - 1.0) * top
            elif kind == "param" and not moments and update_allowed is not None:
                change, allowed = abs(read - 1.0) * update, update_allowed
            else:
                continue
            if math.isfinite(change) and change > allowed:
                hit.append(name)
        shown.append(tuple(hit))
    return shown[0], shown[1]


def _resolved_record(leaf: LeafError, bounds: _Bounds) -> LeafError:
    """A passing parameter only part of whose gradient is at rounding level, stated with the tolerance its
    samples above rounding were held to (:attr:`_Bounds.resolved`), not the allowance of its noise elements: it
    is named at rounding level nowhere (as live), so its stated tolerance is what its other elements met; any
    other leaf as it is."""
    found = bounds.resolved.get((leaf.step, leaf.name))
    if found is None or not leaf.ok or leaf.kind != "param":
        return leaf
    return dataclasses.replace(leaf, tolerance=max(found, leaf.max_abs_err))


def _identical_state(pair: _Pair, t: int) -> bool:
    """Whether the replay's state after step ``t`` (every leaf but the loss and the gradients: the parameters,
    the optimizer state, the counters, the model's state) hashed as the recording's: the same sha256 at equal
    shape, dtype and placement, every recorded leaf present on both sides."""
    state = [n for n in pair.recording.names if n.split(" ", 1)[0] not in ("loss", "grad")]

    def same(name: str) -> bool:
        r, c = pair.leaf("recorded", t, name), pair.leaf("replayed", t, name)
        held = (r.shape, r.dtype, r.sharding, r.sha256) == (c.shape, c.dtype, c.sharding, c.sha256)
        return r.present and c.present and held

    return bool(state) and all(same(n) for n in state)


def _value_records(records: Sequence[StepRecord], structural: set[tuple[int, str]]) -> list[StepRecord]:
    """The step records (not the initial state's) less their structural leaves, which no rule reads."""
    return [
        dataclasses.replace(r, leaves=tuple(e for e in r.leaves if (e.step, e.name) not in structural))
        for r in records
        if r.step >= 0
    ]


def _drift_after_structure(
    findings: list[Diagnosis], structural: list[DigestError], values: Sequence[StepRecord]
) -> list[Diagnosis]:
    """``findings`` with the ``drift`` finding's "The first t step(s) agree" said of the values both runs hold
    where leaves differed in structure before step t (in one run only, or of another shape, dtype or placement,
    which the value records leave out): the steps before t do not agree, and the localization names the
    structure's first step (trial 42: a candidate's multi_transform with other labels, 4 optimizer-state leaves
    in one run only from the initial state on, read "First difference at step 0: the optimizer state" and "The
    first 1 step(s) agree; step 1 does not")."""
    t = next((r.step for r in values if not r.ok), None)
    early = [e for e in structural if t is not None and e.step < t]
    if not early:
        return findings
    head = f"The first {t} step(s) agree; step {t} does not ("
    at = min(e.step for e in early)
    where = "the initial state" if at < 0 else f"step {at}"
    names = sorted({e.name for e in early})
    missing = all(e.evidence == "missing" for e in early)
    said = "in one run only" if missing else "shaped, typed or placed otherwise"
    verb = "is" if len(names) == 1 else "are"
    lead = (
        f"The runs differ from {where} on: {n_leaves(len(names))} {verb} {said} (e.g. {names[0]}), a difference "
        f"of structure that no value comparison shows. The values both runs hold agree for the first {t} "
        f"step(s); at step {t} they do not ("
    )
    cause = (
        f" The structure that differs from {where} on is the likelier cause: another optimizer configuration "
        "(its state laid out otherwise) changes the update once the step uses that state."
        if missing and all(e.name.startswith(("opt_state", "counter")) for e in early)
        else ""
    )
    return [
        dataclasses.replace(d, message=lead + d.message[len(head) :] + cause)
        if d.code == "drift" and d.message.startswith(head)
        else d
        for d in findings
    ]


def _optimizer_changed(was: Mapping, now: Mapping) -> Diagnosis | None:
    """The ``settings_differ`` finding of a replay whose task's optimizer updates a probe gradient otherwise than
    the recorded run's (:func:`~shardcheck.parity.harness.recorded.optimizer_change`: a task file's learning rate
    changed since it was recorded, trial 52), else ``None``."""
    change = optimizer_change(was.get("optimizer"), now.get("optimizer"))
    if change is None:
        return None
    return Diagnosis(
        "settings_differ",
        f"The task's optimizer is not the recording's: {change} (another learning rate, schedule or "
        "transformation), so the updates differ from the recorded ones whatever the step does, and the "
        "optimizer's rerun below is this task's. Replay with the recorded run's optimizer, or record again.",
    )


def _diagnoses(
    recording: Recording,
    replayed: Recording,
    records,
    leaves: list[DigestError],
    first,
    facts: tuple[tuple[str, LeafFacts], ...] | None = None,
) -> tuple[Diagnosis, ...]:
    """The findings of a replay: those of :func:`~shardcheck.parity.diagnosis.rules.diagnose` on its value
    records (the live check's rules, the same code), with what only a recording can show around them: an
    initial state that differs, a leaf missing or of another shape, dtype or (pinned) sharding, and settings
    that differ from the recorded ones. ``facts``: each parameter's :class:`LeafFacts` the grouping reads
    (:attr:`RunComparison.facts`, with what the task's model adds: the optimizer's parameter groups); ``None``:
    the recording's own (:func:`_facts`)."""
    was, now = recording.meta, replayed.meta
    s = was.get("num_shards")
    structural = [e for e in leaves if not e.ok and e.evidence in STRUCTURAL]
    values = _value_records(records, {(e.step, e.name) for e in structural})
    findings = diagnose(
        values,
        s,
        mesh_shape=was.get("mesh") or None,
        micro_batches=now.get("micro_batches") or (s if was.get("run") == "accumulation" else None),
        facts=dict(_facts(recording) if facts is None else facts),
    )
    findings = consistent(findings, values)  # no sentence that the records contradict, as a live check
    findings = _drift_after_structure(findings, structural, values)
    draws = tuple(was.get("drawn") or ())
    if draws:  # the random draws named where the forward stage differs first, as a live check names them
        failing = next((r for r in values if not r.ok), None)
        where = localize(values) if failing is not None else None
        findings = with_draws(findings, where and where.stage, draws, failing)
    findings = with_skipped(findings, values)  # a step the recorded run's optimizer skipped, said once
    findings = with_later_non_finite(findings, values)  # NaN after the first failure, said once
    if structural:  # the value records lack those leaves: a stage they fill would read as matching
        findings = [d for d in findings if d.code != "localized"]
    if first is None:
        return tuple(findings)
    at_t = [e for e in structural if e.step == first.step]
    if first.step < 0 and first.evidence not in STRUCTURAL:
        findings = [Diagnosis("initial_state", initial_cause(leaves), first.name)]
    if at_t:
        text = _structural_cause(at_t, was, now)
        # a sentence that starts with a leaf's name keeps its spelling ("opt_state ...", never "Opt_state": trial 27)
        text = f"Leaf {text}" if text.startswith(at_t[0].name) else text[0].upper() + text[1:]
        found = Diagnosis("structure", text + ".", at_t[0].name)
        values = any(not e.ok and e.evidence not in STRUCTURAL and e.step == first.step for e in leaves)
        ahead = not values or any(e.evidence != "sharding" for e in at_t)
        findings = [found, *findings] if ahead else [*findings, found]
    differ = [d for d in _settings_differ(was, now) if not d.endswith(SAME_ARITHMETIC)]
    changed = None if differ else _optimizer_changed(was, now)
    findings = findings if changed is None else [changed, *findings]  # the likely cause, said first
    if differ:
        findings.append(
            Diagnosis(
                "settings_differ",
                f"The run's settings differ from the recording's ({', '.join(differ)}): it is another run, "
                "compared as if it were the same.",
            )
        )
    return tuple(d for d in findings if d.code != "parity")


def rediagnosed(
    comparison: RunComparison, recording: Recording, replayed: Recording, records: Sequence[StepRecord]
) -> tuple[Diagnosis, ...]:
    """The findings :func:`compare_run` gives ``comparison`` of ``recording`` and ``replayed``, for ``records``:
    its records with what a replay learns after the comparison (the optimizer rerun at the localized step,
    :func:`~shardcheck.parity.harness.replay.with_optimizer_rerun`), read by the live check's rules as a live
    check reads them."""
    # the facts the localization reads (the task's model adds the optimizer's parameter groups): one report
    # never names a group in its localization and "share no ndim, name or module" in a finding (trial 41)
    found = _diagnoses(
        recording, replayed, records, list(comparison.leaves), comparison.first_failure, comparison.facts
    )
    return _bitwise_quiet(found, comparison.bitwise and comparison.ok)


def _bitwise_quiet(findings: Sequence[Diagnosis], bitwise: bool) -> tuple[Diagnosis, ...]:
    """``findings`` less, where the replay is bitwise identical to the recording (every hash matched), the
    ``rounding_level`` note: its leaves "cannot be compared element by element" only where the runs differ by
    rounding, and here every element is equal (trial 43 said both of one replay). ``bitwise``: every hash matched
    and the replay passes (a failing replay's hashes of the compared leaves can all match while a leaf compared by
    its digest alone fails, and its rounding-level leaves are part of its diagnosis)."""
    return tuple(d for d in findings if not (bitwise and d.code == "rounding_level"))


_INITIAL = (
    "The initial state differs from the recorded one: another seed, initializer or model; every later step starts "
    "elsewhere."
)
"""What an initial state whose parameters differ means (:func:`initial_cause`)."""

_EVIDENCE_WORDS = {"max": "max|x|", "norm": "L2 norm", "sample": "value at a sample", "exact": "value"}

_INITIAL_KINDS = (
    ("param", "parameter", "another seed, initializer or model"),
    (
        "opt_state",
        "optimizer-state",
        "another optimizer initialization (e.g. adagrad's initial_accumulator_value), or a state the step "
        "resets",
    ),
    (
        "state",
        "model-state",
        "another initial value of the model's non-parameter state (a buffer, a statistic)",
    ),
    (
        "counter",
        "counter",
        "a step count that starts elsewhere (a counter the optimizer or model starts at another value)",
    ),
)
"""Each kind of leaf an initial state may differ in: its noun and what its difference means."""


def initial_cause(leaves: Sequence[DigestError]) -> str:
    """The ``initial_state`` finding: which kinds of leaf differ before the first step (``step`` -1), with an
    example's two values, and what each means: parameters, another seed, initializer or model (:data:`_INITIAL`);
    only optimizer state (the parameters matching), another optimizer initialization (trial 16: adagrad's
    ``initial_accumulator_value`` 0.0 against the recorded 0.1 was said as another seed or model, the parameters
    identical); model state or counters, theirs. ``leaves``: the comparison's digest errors (any step; those of
    step -1 that failed on a value are read)."""
    bad = [e for e in leaves if e.step < 0 and not e.ok and e.evidence not in STRUCTURAL]
    if any(e.kind == "param" for e in bad) or not bad:
        return _INITIAL
    params = sum(1 for e in leaves if e.step < 0 and e.kind == "param")
    parts = []
    for kind, noun, means in _INITIAL_KINDS:
        group = [e for e in bad if e.kind == kind]
        if not group:
            continue
        e = max(group, key=lambda x: x.badness)
        value = _EVIDENCE_WORDS.get(e.evidence, e.evidence)
        seen = (
            f"{e.name}'s {value} {e.recorded:.4g} recorded, {e.replayed:.4g} replayed"
            if not isinstance(e.recorded, str) and not isinstance(e.replayed, str)
            else e.name
        )
        count = f"1 {noun} leaf differs" if len(group) == 1 else f"{len(group)} {noun} leaves differ"
        parts.append(f"{count} (e.g. {seen}): {means}")
    held = f"the parameters match ({n_leaves(params)}); " if params else ""
    return (
        f"The initial state differs from the recorded one: {held}{'; '.join(parts)}; every later step starts "
        "elsewhere."
    )


QUIET = ("weak_check",)
"""Findings that say no cause: left out of :attr:`RunComparison.cause`."""


def _uncompared(leaves: Sequence[DigestError]) -> list[str]:
    """The leaves no step compared: every one of their errors after a step is ``"not compared"`` (the model's
    state the task's loss does not read, :mod:`~shardcheck.parity.comparison.state_digest`), in order."""
    seen: dict[str, bool] = {}
    for e in leaves:
        if e.step >= 0:
            seen[e.name] = seen.get(e.name, True) and e.evidence == "not compared"
    return [n for n, never in seen.items() if never]


def _evidence_text(
    pair: _Pair,
    steps: int,
    hashes: tuple[int, int, bool],
    bounds: _Bounds,
    replicas: Sequence[Mapping] | None = None,
    differ: StepRecord | None = None,
    uncompared: Sequence[str] = (),
    recorded_differ: Sequence[str] = (),
) -> str:
    """The ``evidence`` paragraph: the leaves recorded and compared (``uncompared``: those no step compared,
    counted apart, so the count reads beside the verdict's), the tolerances, the hashes (``(matched, compared,
    bitwise)``) and what they read: one copy of each slice, with each replicated leaf's copies compared across
    the devices where the replay kept ``replicas`` (``differ``: the first record whose copies differ;
    ``recorded_differ``: the note that the recorded run's own copies differed)."""
    matched, compared, bitwise = hashes
    names = pair.recording.names
    rule = (
        "fixed rtol/atol"
        if bounds.rtol is not None or bounds.atol is not None
        else "derived as the harness's"
    )
    held = f"the digests of {len(names)} leaves"
    if uncompared:
        kinds = {n.split(" ", 1)[0] for n in uncompared}
        noun = ("model-state " if kinds == {"state"} else "") + ("leaf" if len(uncompared) == 1 else "leaves")
        held = (
            f"the digests of {len(names)} leaves recorded, {len(names) - len(uncompared)} compared "
            f"({len(uncompared)} {noun} not compared, e.g. {uncompared[0]}: the task's loss does not read them, "
            "as a live check leaves them)"
        )
    text = (
        f"evidence: {held} at {steps} step(s) and the initial state: max|x| and {SAMPLES} "
        f"fixed-index samples within atol + rtol max|x| (moments x{MOMENT_FACTOR:g}), the L2 norm within sqrt(size) "
        f"times that, each parameter's update size, counters exactly ({rule}); a digest comparison within "
        f"tolerances, never bitwise across machines. sha256 matched for {matched} of {compared}"
        " (the leaf digests of equal shape, dtype and placement on both sides"
    )
    if replicas is None:  # a run recorded before its copies were compared: one copy of each slice hashed
        text += "; each hashes one device's copy of each slice)"
        return text + (": every hash matched, bitwise identical on the copies hashed" if bitwise else "")
    if differ is not None:
        first = replicas_root(differ)[0]
        return text + (
            "; each hashes one device's copy of each slice), but the replay's copies of "
            f"{n_leaves(len(differ.replica_mismatches))} differ across devices after step {differ.step} (e.g. "
            f"{first}): not bitwise identical"
        )
    text += "; each hashes one device's copy of each slice, and every replicated leaf's copies in the replay "
    text += "agreed across the devices after each step)"
    if recorded_differ:
        return text + ", but the recorded run's copies did not (below): not bitwise identical"
    return text + (": every hash matched, bitwise identical" if bitwise else "")


def _notes(recording: Recording, replayed: Recording, steps: int, same: bool, returned) -> list[str]:
    was, now = recording.meta, replayed.meta
    notes = _candidate_note(was, now)
    for kind, what in (("loss", "a loss"), ("grad", "gradients")):
        if kind not in returned and any(n.startswith(f"{kind} ") or n == kind for n in recording.names):
            notes.append(
                f"The recording holds {what}; this run's step returns none, so they were not compared (the "
                "parameters and optimizer state were)."
            )
    if not any(n.startswith("grad ") for n in recording.names):
        notes.append(
            "The recording holds no gradients (its step returned none): under a normalizing optimizer (Adam) a "
            "gradient off by S shows only in the optimizer's moments."
        )
    if not same:
        left_out = [n for n in recording.names if n not in set(replayed.names)]
        notes.append(
            f"Recorded {was['run']!r}, replayed {now['run']!r}: placements differ by design, so shardings are not "
            "compared"
            + (
                f"; {len(left_out)} recorded leaves this run does not have were left out."
                if left_out
                else "."
            )
        )
    processes = max(_processes(m) for m in (was, now))
    if processes > 1:
        notes.append(
            f"A run of {processes} processes: its hashes and samples cover the shards process 0 holds (the norms "
            "and maxima cover every shard)."
        )
    if steps < recording.num_steps:
        notes.append(f"Compared the first {steps} of the {recording.num_steps} recorded steps.")
    if steps < replayed.num_steps:
        notes.append(
            f"Compared the {steps} recorded step(s); the replay's {replayed.num_steps - steps} later ones "
            "have nothing to compare with."
        )
    differ = _settings_differ(was, now)
    if differ:
        notes.append(f"The settings differ from the recording's: {', '.join(differ)}.")
    for key in ("versions", "platform"):
        if was.get(key) != now.get(key):
            notes.append(f"Recorded with {key} {_short(was.get(key))}; this run: {_short(now.get(key))}.")
    return notes


SAME_ARITHMETIC = "in both runs: the same arithmetic)"


def _settings_differ(was: Mapping, now: Mapping) -> list[str]:
    """The settings the recording and the replay give differently (``settings_diff``), a ``compute_dtype`` flag
    whose runs both computed in one dtype (each meta's ``compute_dtype``, the model's own) said so, ending with
    :data:`SAME_ARITHMETIC` (trial 33: a bfloat16 model recorded with ``--compute-dtype bfloat16`` and replayed
    without it read "another run, compared as if it were the same" beside "recorded bfloat16, replayed
    bfloat16")."""
    computed = (was.get("compute_dtype") or "float32", now.get("compute_dtype") or "float32")
    out = []
    for d in settings_diff(was.get("settings"), now.get("settings"), skip=("candidate",)):
        if d.startswith("compute_dtype ") and computed[0] == computed[1]:
            d = f"{d} (the model computes in {computed[0]} {SAME_ARITHMETIC}"
        out.append(d)
    return out


REPLICAS_UNSEEN = "the replicas' agreement was not compared"
"""What a passing replay on a mesh of several devices notes (:func:`_replicas_note`)."""


def _replicas_note(now: Mapping, passed: bool) -> list[str]:
    """``[note]`` that a passing replay did not compare the copies of the replicated leaves across the devices of
    its mesh (a digest holds no device's own copy), and that a live check does; ``[]`` for a failing replay (its
    localization says "the replicas: not observed"), for a run on one device (no copies to compare) and for a
    run that compared its copies (``meta["replicas"]``: the evidence says so)."""
    mesh = now.get("mesh") or {}
    if not passed or math.prod(int(v) for v in mesh.values()) < 2 or now.get("replicas") is not None:
        return []
    return [
        f"A replay compares digests, which hold no device's own copy: {REPLICAS_UNSEEN} (whether each "
        f"replicated leaf holds the same values on every device of mesh {_axes(mesh)}). A live check compares "
        "them (check_parity against the reference; verify without --against)."
    ]


def _recorded_replicas_note(was: Mapping, steps: int) -> list[str]:
    """``[note]`` where the recorded run's own copies of a replicated leaf differed across its devices at a
    compared step (``meta["replicas"]``): the recording is of a step that writes some copies otherwise, no
    reference a correct step reproduces there; ``[]`` otherwise."""
    for t, found in enumerate((was.get("replicas") or [])[:steps]):
        names = list(found.get("leaves") or ())
        if names:
            return [
                f"The recorded run's own copies of {n_leaves(len(names))} differed across its devices after step "
                f"{t} (e.g. {names[0]}): it was recorded from a faulty step; record the correct step again."
            ]
    return []


def _candidate_note(was: Mapping, now: Mapping) -> list[str]:
    """``[note]`` naming both user steps where the replay runs another one than the recorded (its ``--candidate``
    spec, ``settings["candidate"]``, where both runs keep one; else its name): not a refusal, two implementations
    of the step may be compared. ``[]`` for the same step, and where either run is a strategy (the notes name
    both runs there)."""
    if (was["run_kind"], now["run_kind"]) != ("candidate", "candidate"):
        return []
    recorded, replayed = ((m.get("settings") or {}).get("candidate") for m in (was, now))
    if not (recorded and replayed):
        recorded, replayed = was["run"], now["run"]
    if _same_step(str(recorded), str(replayed)):
        return []
    return [
        f"The recording was made with candidate {recorded}; this replay runs {replayed}: two steps compared "
        "(the verdict says whether this one reproduces the recorded run)."
    ]


def _same_step(a: str, b: str) -> bool:
    """Whether two step specs (``FILE.py:ATTR``, ``MODULE:ATTR`` or a name) name one step: equal once their paths
    are normalized (``./step.py:f`` is ``step.py:f``), or the same attribute of one existing file (a relative and
    an absolute path to it)."""
    (fa, _, xa), (fb, _, xb) = a.rpartition(":"), b.rpartition(":")
    if xa != xb:
        return False
    if (fa and os.path.normpath(fa)) == (fb and os.path.normpath(fb)):
        return True
    try:
        return bool(fa and fb) and os.path.samefile(fa, fb)
    except OSError:  # a file that is not here (recorded elsewhere), a module's name
        return False


DIVERGENCE = "a recording cannot re-run that step from identical state"
"""What the note of a late first failure says (:func:`with_divergence_note`)."""

REFUTING_FORMS = ("zero", "reference_zero", "sign_flip", "decay")
"""Forms of a stage's difference that no rounding divergence makes, on any number of leaves."""

FACTOR_FORMS = ("factor", "per_group", "moments", "clip", "extra_step")
"""Forms of one constant factor (per group) across each leaf: no rounding divergence makes one on several
leaves (a single leaf's ratio, the loss's, is a number, not a form)."""


def with_divergence_note(comparison: RunComparison) -> RunComparison:
    """``comparison`` with the note that its first failure, at a step t > 0, may be rounding divergence through a
    non-smooth op (a recording cannot re-run that step from identical state) first among its notes, where its
    records do not refute that (:func:`divergence_refuted`), and without it elsewhere; read again where the
    records change (a replay's optimizer rerun, :func:`~shardcheck.parity.harness.replay.with_optimizer_rerun`)."""
    notes = tuple(n for n in comparison.notes if DIVERGENCE not in n)
    first = comparison.first_failure
    if first is not None and first.step > 0:
        if not divergence_refuted(comparison.localization(), comparison.records):
            notes = (
                f"The first failure is at step {first.step} > 0: {DIVERGENCE} (shardcheck verify against the "
                "reference can), so it may be rounding divergence through a non-smooth op rather than a faulty "
                "step.",
                *notes,
            )
    return dataclasses.replace(comparison, notes=notes)


def divergence_refuted(where, records: Sequence[StepRecord]) -> bool:
    """Whether the :class:`~shardcheck.parity.diagnosis.localization.Localization` ``where`` of ``records`` (``None``
    where every step passed) refutes a late first failure as rounding divergence: its stage is the optimizer's
    update rerun from equal inputs (the candidate's own gradients and pre-step state, ``StepRecord.
    optimizer_rerun``, give another update: the step itself is faulty), or the step ran from the recorded
    pre-step state bitwise (``StepRecord.identical_start``: nothing diverged before it), or the failing stage's
    difference has a
    form no divergence makes (:data:`REFUTING_FORMS`; :data:`FACTOR_FORMS` on 2 or more leaves, outside the forward
    pass)."""
    if where is None or where.stage is None:
        return False
    record = next((r for r in records if r.step == where.step), None)
    if record is not None and record.identical_start:  # run from the recorded state exactly: no divergence
        return True
    if where.stage == "optimizer" and record is not None and record.optimizer_rerun is not None:
        return True
    form = where.form
    if form is None:
        return False
    several = form.leaves >= 2 and where.stage != "forward"
    return form.kind in REFUTING_FORMS or (form.kind in FACTOR_FORMS and several)


def _weighted(records: tuple[StepRecord, ...], loss_weight) -> tuple[StepRecord, ...]:
    """``records`` with the first failing step's ``loss_weight`` (:func:`compare_run`'s ``loss_weight`` of its
    step), where one is given."""
    first = next((r for r in records if r.step >= 0 and not r.ok), None)
    if loss_weight is None or first is None:
        return records
    weight = loss_weight(first.step)
    return tuple(dataclasses.replace(r, loss_weight=weight) if r is first else r for r in records)


def _axes(mesh: Mapping | None) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "none (one device a shard)"


def _processes(meta: Mapping) -> int:
    return int(meta.get("platform", {}).get("processes", 1))


def _short(facts: Any) -> str:
    if not isinstance(facts, Mapping):
        return str(facts)
    return ", ".join(f"{k} {v}" for k, v in facts.items())


__all__ = [
    "DigestError",
    "RunComparison",
    "compare_run",
    "divergence_refuted",
    "rediagnosed",
    "with_divergence_note",
]
