"""Parity: prove a sharded step against the single-device baseline, leaf by leaf, over many steps.

Seed ``001_a85d1499a1a85057.txt``: "with equivalent initial parameters, loss normalization and optimizer settings,
a correctly synchronized sharded step should reproduce the intended baseline update within numerical tolerance.
Matching a single loss value alone does not verify that update". :func:`check_parity` runs a reference step
(default :func:`~shardcheck.sgd_step`) and a candidate step from copies of one model and optimizer over the same
batches, and records for every step the error of the loss, of every gradient leaf (where the candidate exposes
them), of every updated parameter leaf, of every optimizer-state leaf and of the step counters. When parity fails
it says why (:class:`Diagnosis`): a sum where a mean was meant, a mean taken twice, replicas that disagree, an
optimizer stepped once per shard, an update that is not one reduced step, a loss that matches alone.

Tolerance rule (see :func:`derive_tolerance` and ``docs/parity.md``)::

    rtol_t = 16 * eps(dtype) * sqrt(n) * sqrt(t + 1)      atol_t = eps(dtype) * sqrt(n) * sqrt(t + 1)
    leaf passes at step t  <=>  max|cand - ref| <= atol_t + rtol_t * max|ref|      (optimizer moments: x2)

with ``n = B * K`` the length of the batch reduction of the loss (the one reduction a sharded step reorders).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck._tree import path_str
from shardcheck.baseline import sgd_step
from shardcheck.datasets import minibatch_indices
from shardcheck.diagnosis import KINDS as KINDS
from shardcheck.diagnosis import Diagnosis as Diagnosis
from shardcheck.diagnosis import LeafError as LeafError
from shardcheck.diagnosis import StepRecord as StepRecord
from shardcheck.diagnosis import diagnose as diagnose
from shardcheck.distributed import gather_to_host
from shardcheck.losses import mse_loss
from shardcheck.tolerance import MOMENT_FACTOR as MOMENT_FACTOR
from shardcheck.tolerance import Tolerance as Tolerance
from shardcheck.tolerance import derive_tolerance as derive_tolerance
from shardcheck.weighted import weighted_mean_loss, weighted_sgd_step

PyTree = Any
StepFn = Callable[..., Any]

STRATEGIES = ("simulation", "dp", "fsdp", "accumulation", "multiprocess")


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """The result of :func:`check_parity`.

    Attributes:
        strategy: the candidate's name.
        ok: parity holds: every leaf of every step within tolerance, replicas consistent.
        steps: one :class:`StepRecord` per step.
        diagnoses: the findings, most important first (``parity`` alone when ``ok`` and nothing to note).
        num_shards: S, when known (used to recognise ratios S and 1/S).
        tolerance_rule: how the tolerances were chosen (derived, or the user's ``rtol``/``atol``).
        diverged_at: the step t > 0 at which the trajectories first left tolerance while that step, re-run from the
            reference's pre-step state, matched (``diverged_trajectory``); ``steps`` from t on are then
            synchronized steps. ``None`` otherwise.
        diverged: the trajectory :class:`StepRecord` that failed at ``diverged_at`` (kept for the report).
        reference_diverged_at: the step at which the reference's loss or state became non-finite; the comparison
            stopped there (``reference_diverged``; ``steps`` holds the steps before it). ``None`` otherwise.
    """

    strategy: str
    ok: bool
    steps: tuple[StepRecord, ...]
    diagnoses: tuple[Diagnosis, ...]
    num_shards: int | None = None
    tolerance_rule: str = ""
    diverged_at: int | None = None
    diverged: StepRecord | None = None
    reference_diverged_at: int | None = None

    @property
    def step_ok(self) -> bool:
        """Every step is correct: ``ok``, or the trajectories diverged (``diverged_trajectory``) and every step
        from there on matched the reference from the reference's own pre-step state."""
        return self.reference_diverged_at is None and bool(self.steps) and all(r.ok for r in self.steps)

    @property
    def verdict(self) -> str:
        """``"PASS"`` (:attr:`ok`), ``"PASS (per step)"`` (trajectories diverged, every step correct from
        synchronized state), ``"NO VERDICT"`` (the reference diverged) or ``"FAIL"``."""
        if self.reference_diverged_at is not None:
            return "NO VERDICT"
        if self.ok:
            return "PASS"
        return "PASS (per step)" if self.step_ok else "FAIL"

    @property
    def worst(self) -> LeafError | None:
        """The leaf error with the largest ``max_abs_err / tolerance`` over all steps (the first, on ties)."""
        leaves = [leaf for record in self.steps for leaf in record.leaves]
        return max(leaves, key=lambda leaf: leaf.badness, default=None)

    @property
    def worst_leaf(self) -> str | None:
        """:attr:`worst`'s name, e.g. ``"param hidden.kernel"``."""
        return None if self.worst is None else self.worst.name

    @property
    def max_abs_err(self) -> float:
        """:attr:`worst`'s ``max_abs_err`` (errors of different leaves have different units: not a max of all)."""
        return 0.0 if self.worst is None else self.worst.max_abs_err

    @property
    def max_rel_err(self) -> float:
        """:attr:`worst`'s ``max_rel_err``."""
        return 0.0 if self.worst is None else self.worst.max_rel_err

    @property
    def codes(self) -> tuple[str, ...]:
        """The :attr:`Diagnosis.code` of every finding, in order."""
        return tuple(d.code for d in self.diagnoses)

    @property
    def diagnosis(self) -> str:
        """All findings' messages, joined into one paragraph."""
        return " ".join(d.message for d in self.diagnoses)

    def worst_by_kind(self) -> dict[str, LeafError]:
        """For each compared kind (``loss``, ``grad``, ...), its worst leaf error over all steps."""
        out: dict[str, LeafError] = {}
        for record in self.steps:
            for leaf in record.leaves:
                if leaf.kind not in out or leaf.badness > out[leaf.kind].badness:
                    out[leaf.kind] = leaf
        return {k: out[k] for k in KINDS if k in out}

    def to_dict(self) -> dict:
        """A JSON-ready summary: ``ok``, ``worst_leaf``, ``max_abs_err``, ``max_rel_err``, ``tolerance``,
        ``diagnosis``, ``codes``, ``steps``, ``num_shards``, ``worst_by_kind``, ``per_step``, weighted-mode errors.
        """
        worst = self.worst
        record_last = self.steps[-1] if self.steps else None
        ew_loss = [r.equal_weight_loss_abs_err for r in self.steps if r.equal_weight_loss_abs_err is not None]
        ew_grad = [r.equal_weight_grad_abs_err for r in self.steps if r.equal_weight_grad_abs_err is not None]
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "step_ok": self.step_ok,
            "diverged_at": self.diverged_at,
            "reference_diverged_at": self.reference_diverged_at,
            "worst_leaf": self.worst_leaf,
            "worst_step": None if worst is None else worst.step,
            "max_abs_err": self.max_abs_err,
            "max_rel_err": self.max_rel_err,
            "tolerance": None if worst is None else worst.tolerance,
            "diagnosis": self.diagnosis,
            "codes": list(self.codes),
            "steps": len(self.steps),
            "num_shards": self.num_shards,
            "tolerance_rule": self.tolerance_rule,
            "step_count": None if record_last is None else record_last.step_count,
            "candidate_step_count": None if record_last is None else record_last.candidate_step_count,
            "replica_mismatches": sorted({p for r in self.steps for p in r.replica_mismatches}),
            "equal_weight_loss_max_abs_err": max(ew_loss) if ew_loss else None,
            "equal_weight_grad_max_abs_err": max(ew_grad) if ew_grad else None,
            "worst_by_kind": {
                kind: {
                    "leaf": e.name,
                    "step": e.step,
                    "max_abs_err": e.max_abs_err,
                    "max_rel_err": e.max_rel_err,
                    "tolerance": e.tolerance,
                    "ok": e.ok,
                }
                for kind, e in self.worst_by_kind().items()
            },
            "per_step": [
                {
                    "step": r.step,
                    "ok": r.ok,
                    "synchronized": r.synchronized,
                    "loss": r.loss,
                    "candidate_loss": r.candidate_loss,
                    "rtol": r.rtol,
                    "atol": r.atol,
                    "worst_leaf": max(r.leaves, key=lambda e: e.badness).name if r.leaves else None,
                    "max_abs_err": max(r.leaves, key=lambda e: e.badness).max_abs_err if r.leaves else 0.0,
                }
                for r in self.steps
            ],
        }

    def __str__(self) -> str:
        verdict = self.verdict
        lines = [f"parity {verdict} for strategy {self.strategy!r} over {len(self.steps)} step(s)"]
        worst = self.worst
        if worst is not None:
            lines.append(
                f"  worst leaf: {worst.name} at step {worst.step}: max abs err {worst.max_abs_err:.3g}, "
                f"rel {worst.max_rel_err:.3g}, tolerance {worst.tolerance:.3g}"
            )
        for kind, e in self.worst_by_kind().items():
            lines.append(
                f"  {kind:<9} {e.path:<24} abs {e.max_abs_err:<10.3g} rel {e.max_rel_err:<10.3g} "
                f"tol {e.tolerance:<10.3g} {'ok' if e.ok else 'FAIL'}"
            )
        for d in self.diagnoses:
            lines.append(f"  [{d.code}] {d.message}")
        if self.tolerance_rule:
            lines.append(f"  tolerance: {self.tolerance_rule}")
        return "\n".join(lines)


class CandidateError(RuntimeError):
    """The candidate step raised; the original exception is ``__cause__`` and ``step`` the 0-based step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class ParityError(AssertionError):
    """Raised by :func:`assert_step_parity`; ``report`` holds the :class:`ParityReport`."""

    def __init__(self, report: ParityReport):
        super().__init__(str(report))
        self.report = report


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step to verify, with what the harness needs to know about it.

    Attributes:
        name: shown in reports (``simulation``, ``dp``, ..., ``candidate``).
        step: ``(model, optimizer, x, y, **kw) -> loss | result``, updating both in place. A result object
            with ``.loss`` (and optionally ``.grads``, ``.equal_weight_loss``, ``.equal_weight_grads``) exposes
            more to compare. ``kw`` holds ``weights=`` in weighted mode and ``mesh=`` when ``pass_mesh``.
        num_shards: S, to recognise update ratios S and 1/S (``None``: recognised from any integer ratio).
        make_optimizer: builds the candidate's optimizer from its model copy and a copy of the reference's
            optimizer (gradient accumulation wraps the transformation in ``optax.MultiSteps``).
        view_optimizer: ``optimizer -> (opt_state tree matching the reference's, update count)``; default:
            ``(nnx.state(optimizer)["opt_state"], optimizer.step)``.
        extra_checks: ``(optimizer, completed_steps) -> [(path, value, expected)]``: exact checks of the
            candidate's own counters and buffers, reported as ``counter``/``opt_state`` leaves.
        pass_mesh: pass ``mesh=`` to ``step``.
        accepts_weights: ``step`` takes ``weights=`` (weighted mode).
    """

    name: str
    step: StepFn
    num_shards: int | None = None
    make_optimizer: Callable[[nnx.Module, nnx.Optimizer], nnx.Optimizer] | None = None
    view_optimizer: Callable[[nnx.Optimizer], tuple[PyTree, Any]] | None = None
    extra_checks: Callable[[nnx.Optimizer, int], list[tuple[str, Any, Any]]] | None = None
    pass_mesh: bool = False
    accepts_weights: bool = False


# ------------------------------------------------------------------------------------------- tree utilities


def flatten_state(tree: PyTree) -> dict[str, Any]:
    """``{dotted path: leaf}`` of a pytree (``nnx.State`` included), e.g. ``{"hidden.kernel": Array}``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(p): leaf for p, leaf in leaves}


def to_host(a) -> np.ndarray:
    """A leaf as a NumPy array; arrays spread over several processes are gathered first."""
    return np.asarray(gather_to_host(a))


def replica_mismatch(a) -> bool:
    """True when two of this process's devices hold different bytes for the same slice of ``a``.

    A replicated (or partially replicated) ``jax.Array`` keeps one buffer per device; JAX trusts that they are
    equal (``shard_map`` with ``check_vma=False`` and ``out_specs=P()`` does not check). Compared bitwise.
    """
    if not isinstance(a, jax.Array):
        return False
    shards = a.addressable_shards
    if len(shards) < 2:
        return False
    seen: dict[tuple, bytes] = {}
    for shard in shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        data = np.asarray(shard.data).tobytes()
        if key in seen and seen[key] != data:
            return True
        seen.setdefault(key, data)
    return False


def _copy_state(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[nnx.Module, nnx.Optimizer]:
    """Independent copies of a model and its optimizer: new graph and new buffers (a step may donate them)."""
    graphdef, state = nnx.split((model, optimizer))
    state = jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, state)
    return nnx.merge(graphdef, state)


def _opt_state(optimizer: nnx.Optimizer) -> PyTree:
    """The optimizer's ``opt_state`` sub-state (``{}`` for a stateless transformation such as ``optax.sgd``)."""
    state = nnx.state(optimizer)
    return state["opt_state"] if "opt_state" in state else {}


def _default_view(optimizer: nnx.Optimizer) -> tuple[PyTree, Any]:
    return _opt_state(optimizer), optimizer.step[...]


def _is_scalar_like(out) -> bool:
    return isinstance(out, jax.Array | np.ndarray | np.generic | float | int) and np.ndim(out) == 0


def _unpack(out, who: str = "candidate", step: int = 0) -> tuple[Any, Any, Any, Any]:
    """``(loss, grads, equal_weight_loss, equal_weight_grads)`` from a step's return value.

    Raises:
        TypeError: ``out`` is not a scalar loss, ``None``, or a mapping / object with ``loss`` (itself a scalar
            or ``None``).
    """
    if out is None:
        return None, None, None, None
    if _is_scalar_like(out):
        return out, None, None, None
    rule = (
        "it must return the scalar pre-update loss, None, or an object or mapping with 'loss' (a scalar) and "
        "optionally 'grads'"
    )
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise TypeError(
                f"check_parity: the {who} step returned a mapping without 'loss' (keys {sorted(map(str, out))}) "
                f"at step {step}; {rule}"
            )
        get = out.get
    elif hasattr(out, "loss") and not isinstance(out, str | bytes | np.ndarray | jax.Array):

        def get(name, default=None):
            return getattr(out, name, default)

    else:
        shape = f" of shape {np.shape(out)}" if hasattr(out, "shape") else ""
        raise TypeError(
            f"check_parity: the {who} step returned {type(out).__name__}{shape} at step {step}; {rule}"
        )
    loss = get("loss")
    if loss is not None and not _is_scalar_like(loss):
        raise TypeError(
            f"check_parity: the {who} step returned loss of type {type(loss).__name__}"
            f"{f' and shape {np.shape(loss)}' if hasattr(loss, 'shape') else ''} at step {step}; {rule}"
        )
    return loss, get("grads"), get("equal_weight_loss"), get("equal_weight_grads")


# ------------------------------------------------------------------------------------------------ comparison


def _leaf_error(step, kind, path, ref, cand, rtol, atol, before_ref=None, before_cand=None) -> LeafError:
    r = np.asarray(ref, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if r.shape != c.shape:
        return LeafError(
            step, kind, path, math.inf, math.inf, atol + rtol * float(np.max(np.abs(r), initial=0)), False
        )
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(c - r)
    max_abs = float(np.max(diff, initial=0.0)) if not np.isnan(diff).any() else math.nan
    scale = float(np.max(np.abs(r), initial=0.0))
    rel = (max_abs / scale) if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    tol = atol + rtol * scale
    ratio = change = None
    if before_ref is not None:
        dr = r - np.asarray(before_ref, np.float64)
        dc = c - np.asarray(before_cand, np.float64)
    else:
        dr, dc = r, c
    big = np.abs(dr)
    top = float(np.max(big, initial=0.0))
    if before_ref is not None:
        change = top
    if top > 0:
        mask = big >= 0.01 * top
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = float(np.median(dc[mask] / dr[mask]))
    return LeafError(step, kind, path, max_abs, rel, tol, bool(max_abs <= tol), ratio, change)


def _counter_error(step, path, ref, cand) -> LeafError:
    r, c = int(np.asarray(ref)), int(np.asarray(cand))
    err = float(abs(c - r))
    rel = (err / abs(r)) if r else (0.0 if err == 0 else math.inf)
    return LeafError(step, "counter", path, err, rel, 0.0, c == r, (c / r) if r else None)


def _is_int(a) -> bool:
    return np.dtype(np.asarray(a).dtype).kind in "iub"


# --------------------------------------------------------------------------------------------- the reference


@jax.jit
def _grads_jit(graphdef, state, x, y):
    model = nnx.merge(graphdef, state)
    return nnx.grad(mse_loss)(model, x, y)


@jax.jit
def _weighted_grads_jit(graphdef, state, x, y, w):
    model = nnx.merge(graphdef, state)
    return nnx.grad(weighted_mean_loss)(model, x, y, w)


def _reference_grads(model, x, y, w):
    graphdef, state = nnx.split(model)
    if w is None:
        return _grads_jit(graphdef, state, x, y)
    return _weighted_grads_jit(graphdef, state, x, y, w)


# ------------------------------------------------------------------------------------------- the candidates


def _accepts(fn: Callable, name: str, position: int) -> bool:
    """Whether ``fn`` takes keyword ``name`` or a positional argument at ``position`` (0-based)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params) or name in sig.parameters:
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) > position or any(p.kind is p.VAR_POSITIONAL for p in params)


def strategy_candidate(
    name: str, *, num_shards: int, mesh=None, shard_sizes: Sequence[int] | None = None
) -> Candidate:
    """One of shardcheck's own strategies as a :class:`Candidate`.

    Args:
        name: ``"simulation"`` (:func:`~shardcheck.reduced_sgd_step`, S shards, exposes gradients),
            ``"dp"`` / ``"fsdp"`` (the mesh steps of ``shardcheck.spmd`` on ``mesh``; weighted mode uses
            :func:`~shardcheck.weighted_data_parallel_sgd_step`), ``"accumulation"`` (``optax.MultiSteps`` over
            S micro-batches, :mod:`shardcheck.accumulation`) or ``"multiprocess"`` (the data-parallel step on a
            mesh spanning every process of a ``shardcheck launch`` run).
        num_shards: S >= 1.
        mesh: the mesh of ``dp`` / ``fsdp`` / ``multiprocess`` (built from the first S devices when ``None``).
        shard_sizes: weighted mode, ``simulation`` only: uneven shard sizes.

    Returns:
        The :class:`Candidate`.

    Raises:
        ValueError: unknown ``name``, bad ``num_shards``, fewer devices than S for a mesh strategy, a mesh of
            another size, ``"multiprocess"`` in a single-process run.
    """
    fn = "strategy_candidate"
    num_shards = _validate.check_num_shards(fn, num_shards)
    if name == "simulation":
        from shardcheck.simulation import reduced_sgd_step

        def simulation(model, optimizer, x, y, weights=None):
            if weights is None:
                return reduced_sgd_step(model, optimizer, x, y, num_shards)
            return reduced_sgd_step(
                model, optimizer, x, y, num_shards, weights=weights, shard_sizes=shard_sizes
            )

        return Candidate("simulation", simulation, num_shards, accepts_weights=True)
    if name == "accumulation":
        from shardcheck.accumulation import accumulation_candidate

        return accumulation_candidate(num_shards)
    if name in ("dp", "fsdp", "multiprocess"):
        from shardcheck import spmd

        if name == "multiprocess" and jax.process_count() == 1:
            raise ValueError(
                f"{fn}: strategy 'multiprocess' needs several JAX processes; run under `shardcheck launch "
                "--processes P --devices-per-process N -- verify ...` (there, dp and fsdp span every process too)"
            )
        if mesh is None:
            if len(jax.devices()) < num_shards:
                raise ValueError(
                    f"{fn}: strategy {name!r} with num_shards={num_shards} needs {num_shards} devices, but "
                    f"{len(jax.devices())} exist; use fewer shards or more devices (jax_num_cpu_devices on CPU)"
                )
            mesh = spmd.make_mesh(num_shards)
        mesh_size = int(np.prod(list(mesh.shape.values())))
        if mesh_size != num_shards:
            raise ValueError(
                f"{fn}: mesh has {mesh_size} devices but num_shards={num_shards}; they must agree"
            )
        if name == "fsdp":

            def fsdp(model, optimizer, x, y):
                return spmd.fsdp_sgd_step(model, optimizer, x, y, mesh)

            return Candidate("fsdp", fsdp, num_shards)
        from shardcheck.weighted import weighted_data_parallel_sgd_step

        def dp(model, optimizer, x, y, weights=None):
            if weights is None:
                return spmd.data_parallel_sgd_step(model, optimizer, x, y, mesh)
            return weighted_data_parallel_sgd_step(model, optimizer, x, y, mesh, weights=weights)

        return Candidate(name, dp, num_shards, accepts_weights=True)
    raise ValueError(f"{fn}: strategy {name!r} is unknown; use one of {', '.join(STRATEGIES)}")


def _check_step_signature(fn: str, label: str, step: Callable, kwargs: dict) -> None:
    """``step`` must accept ``(model, optimizer, x, y, **kwargs)``; a TypeError naming ``label`` otherwise."""
    try:
        sig = inspect.signature(step)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature: let the call decide
    try:
        sig.bind(None, None, None, None, **kwargs)
    except TypeError as err:
        name = getattr(step, "__name__", type(step).__name__)
        raise TypeError(
            f"{fn}: {label} {name}{sig} cannot be called as {label}(model, optimizer, x, y"
            f"{', mesh=mesh' if kwargs else ''}) ({err}); it must take (model, optimizer, x, y), or "
            "(model, optimizer, x, y, mesh) with mesh= given, and update model and optimizer in place"
        ) from None


def _as_candidate(fn, candidate, num_shards, mesh, name) -> Candidate:
    if isinstance(candidate, Candidate):
        if num_shards is not None and candidate.num_shards is None:
            candidate = dataclasses.replace(candidate, num_shards=num_shards)
        return dataclasses.replace(candidate, name=name) if name else candidate
    if isinstance(candidate, str):
        if num_shards is None:
            raise ValueError(f"{fn}: strategy {candidate!r} needs num_shards=S; pass e.g. num_shards=2")
        c = strategy_candidate(candidate, num_shards=num_shards, mesh=mesh)
        return dataclasses.replace(c, name=name) if name else c
    if not callable(candidate):
        raise TypeError(
            f"{fn}: candidate must be a strategy name ({', '.join(STRATEGIES)}), a Candidate or a callable "
            f"(model, optimizer, x, y) -> loss, got {type(candidate).__name__}"
        )
    pass_mesh = mesh is not None and _accepts(candidate, "mesh", 4)
    _check_step_signature(fn, "candidate", candidate, {"mesh": mesh} if pass_mesh else {})
    return Candidate(
        name or getattr(candidate, "__name__", "candidate"),
        candidate,
        num_shards,
        pass_mesh=pass_mesh,
        accepts_weights=_accepts(candidate, "weights", 99),
    )


# ------------------------------------------------------------------------------------------------- batches


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


def _normalize_batches(fn: str, batches, steps: int | None) -> list[tuple]:
    if isinstance(batches, tuple) and len(batches) in (2, 3) and all(hasattr(b, "shape") for b in batches):
        batches = [batches] * (1 if steps is None else steps)
    elif not isinstance(batches, Iterable):
        raise TypeError(
            f"{fn}: batches must be an iterable of (x, y) or (x, y, weights), got {type(batches).__name__}"
        )
    if steps is not None:
        steps = _validate.check_int(fn, "steps", steps)
        out = []
        for b in batches:
            if len(out) == steps:
                break
            out.append(b)
        if len(out) < steps:
            raise ValueError(f"{fn}: steps={steps} but batches holds only {len(out)}; pass more batches")
    else:
        out = list(batches)
    if not out:
        raise ValueError(f"{fn}: batches is empty; pass at least one (x, y) batch")
    clean = []
    for i, b in enumerate(out):
        if not isinstance(b, tuple | list) or len(b) not in (2, 3):
            raise ValueError(f"{fn}: batch {i} must be a pair (x, y) or a triple (x, y, weights)")
        x, y = _validate.check_batch(fn, b[0], b[1])
        w = None
        if len(b) == 3 and b[2] is not None:
            w = np.asarray(b[2], dtype=np.float32)
            problem = None
            if w.shape != (x.shape[0],):
                problem = f"must have shape ({x.shape[0]},) (one weight per row of x), got shape {w.shape}"
            elif not np.isfinite(w).all():
                problem = f"must be finite, got {int((~np.isfinite(w)).sum())} non-finite value(s)"
            elif (w < 0).any():
                problem = f"must be >= 0, got {int((w < 0).sum())} negative value(s) (min {float(w.min()):g})"
            elif w.sum() <= 0:
                problem = "must not be all zero (no example would count)"
            if problem is not None:
                raise ValueError(
                    f"{fn}: batch {i} weights {problem}; pass example counts or a 0/1 mask of shape "
                    f"({x.shape[0]},)"
                )
            w = jnp.asarray(w)
        clean.append((x, y, w))
    return clean


# ------------------------------------------------------------------------------------------------ the harness


def check_parity(
    candidate: StepFn | str | Candidate,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batches,
    *,
    steps: int | None = None,
    num_shards: int | None = None,
    mesh=None,
    reference: StepFn | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    name: str | None = None,
) -> ParityReport:
    """Run a reference and a candidate step side by side from one initial state and compare every leaf.

    Both start from independent copies of ``model`` and ``optimizer`` (which are left unchanged) and see the same
    batches. After each step the harness compares, per leaf: the pre-update loss; the gradients, when the
    candidate returns an object with ``.grads`` (reference: ``nnx.grad`` of the full-batch loss at the same
    pre-step parameters); every ``nnx.Param``; every optimizer-state leaf (momentum trace, Adam ``mu``/``nu``);
    and exactly, the integer counters (the NNX ``step``, Adam's ``count``). Replicated candidate leaves are checked
    bitwise across this process's devices. Then :class:`Diagnosis` findings explain a failure.

    Weighted mode: batches given as ``(x, y, weights)`` (``weights (B,)``: example counts or a 0/1 mask) make the
    reference the full-batch weighted step (:func:`~shardcheck.weighted_sgd_step`) and pass ``weights=`` to the
    candidate; a candidate reporting ``equal_weight_loss``/``equal_weight_grads`` (the simulation does) gets the
    naive equal-weight mean's error recorded beside its own (``docs/reduction_cases.md`` C4-C6).

    Args:
        candidate: a strategy name (``simulation``, ``dp``, ``fsdp``, ``accumulation``, ``multiprocess``; needs
            ``num_shards``), a :class:`Candidate`, or any in-place step ``(model, optimizer, x, y) -> loss``
            (``(model, optimizer, x, y, mesh)`` when it accepts ``mesh`` and ``mesh`` is given). It may return
            the loss, ``None``, or an object/mapping with ``loss`` and optionally ``grads``.
        model: an ``nnx.Module`` without ``BatchStat`` variables or RNG streams (``docs/reduction_cases.md`` C7).
        optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.
        batches: an iterable of ``(x (B, D), y (B, K))`` or ``(x, y, weights (B,))``; or one such tuple,
            repeated ``steps`` times.
        steps: how many batches to use (default: all).
        num_shards: S: selects the shard count of a named strategy and lets the diagnosis recognise ratios S
            and 1/S.
        mesh: passed to mesh strategies and to candidates accepting ``mesh``.
        reference: an in-place step to compare against (default :func:`~shardcheck.sgd_step`, or
            :func:`~shardcheck.weighted_sgd_step` in weighted mode). Gradients are compared only against the
            default reference or a reference returning ``.grads``.
        rtol: fixed relative tolerance for every step (default: :func:`derive_tolerance` with the parameters'
            least precise floating dtype).
        atol: fixed absolute tolerance for every step (default: :func:`derive_tolerance`).
        name: the candidate's name in the report.

    Returns:
        A :class:`ParityReport`.

    Raises:
        TypeError: ``candidate`` not a name, :class:`Candidate` or callable; bad batch dtypes; wrong model or
            optimizer types; a weighted batch for a candidate without ``weights=``.
        ValueError: a model with batch statistics or RNG streams (C7); empty or malformed batches; ``steps``
            larger than the batches; a named strategy with ``B % S != 0`` and no weights (equal shards are
            required: pass ``(x, y, weights)`` for weighted mode, C4/C6); negative ``rtol``/``atol``.
            Checked before any step runs.
    """
    fn = "check_parity"
    _validate.check_model(fn, model)
    _validate.check_optimizer(fn, optimizer, model)
    for label, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0
        ):
            raise ValueError(f"{fn}: {label} must be a number >= 0, got {value!r}")
    if num_shards is not None:
        num_shards = _validate.check_num_shards(fn, num_shards)
    if reference is not None:
        if not callable(reference):
            raise TypeError(
                f"{fn}: reference must be None (sgd_step) or an in-place step (model, optimizer, x, y) -> loss, "
                f"got {type(reference).__name__} {reference!r}"
            )
        _check_step_signature(fn, "reference", reference, {})
    if isinstance(candidate, Candidate) and not callable(candidate.step):
        raise TypeError(
            f"{fn}: Candidate {candidate.name!r} has step of type {type(candidate.step).__name__}; it must be a "
            "callable (model, optimizer, x, y) -> loss"
        )
    named = isinstance(candidate, str)
    cand = _as_candidate(fn, candidate, num_shards, mesh, name)
    num_shards = cand.num_shards
    data = _normalize_batches(fn, batches, steps)
    for i, (x, _, w) in enumerate(data):
        if w is not None and not cand.accepts_weights:
            raise TypeError(
                f"{fn}: batch {i} carries weights but candidate {cand.name!r} takes no weights= argument; "
                "add a weights=None keyword to it, or pass (x, y) batches"
            )
        if w is None and num_shards is not None and (named or cand.name in STRATEGIES):
            _validate.check_equal_shards(
                fn,
                x.shape[0],
                num_shards,
                hint="pass (x, y, weights) batches for uneven shards (weighted mode)",
            )
    ref_model, ref_opt = _copy_state(model, optimizer)
    cand_model, cand_opt = _copy_state(model, optimizer)
    if cand.make_optimizer is not None:
        cand_opt = cand.make_optimizer(cand_model, cand_opt)
    run = _Run(
        ref_model, ref_opt, reference, cand, cand_model, cand_opt, {"mesh": mesh} if cand.pass_mesh else {}
    )

    records: list[StepRecord] = []
    # the least precise floating dtype among the parameters sets eps (float32 for shardcheck's models)
    dtypes = {jnp.dtype(a.dtype) for a in jax.tree.leaves(nnx.state(model, nnx.Param))}
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)] or [jnp.dtype(jnp.float32)]
    dtype = max(floats, key=lambda d: float(jnp.finfo(d).eps))

    def tolerances(x, y, t):
        derived = derive_tolerance(dtype, batch_size=int(x.shape[0]), out_features=int(y.shape[1]), step=t)
        return (
            derived.rtol if rtol is None else float(rtol),
            derived.atol if atol is None else float(atol),
            derived,
        )

    diverged = diverged_at = reference_diverged_at = None
    rechecked = False
    for t, (x, y, w) in enumerate(data):
        if diverged_at is None:
            # Trajectory mode: both sides carry their own state. Keep the reference's pre-step state, so that a
            # first failure at t > 0 can be re-checked from synchronized state.
            pre = _copy_state(run.ref_model, run.ref_opt) if not rechecked else None
            r_tol, a_tol, derived = tolerances(x, y, t)
            record = _compare_step(run, t, x, y, w, r_tol, a_tol)
            if not _reference_finite(run, record):
                reference_diverged_at = t
                break
            if not record.ok and t > 0 and not rechecked:
                rechecked = True
                r0, a0, _ = tolerances(x, y, 0)
                synced = _compare_step(_synchronized(run, *pre), t, x, y, w, r0, a0, completed=1, synced=True)
                if synced.ok:
                    diverged, diverged_at = record, t
                    record = synced
            records.append(record)
        else:
            # Synchronized mode (after diverged_trajectory): each step starts the candidate from a copy of the
            # reference's pre-step state and compares at the step-0 tolerance.
            r_tol, a_tol, derived = tolerances(x, y, 0)
            sync_run = _synchronized(run, run.ref_model, run.ref_opt)
            record = _compare_step(sync_run, t, x, y, w, r_tol, a_tol, completed=1, synced=True)
            if not _reference_finite(run, record):
                reference_diverged_at = t
                break
            records.append(record)
        pre = None
    if rtol is None and atol is None:
        rule = derived.rule
    else:
        rule = f"rtol={r_tol:g}, atol={a_tol:g} (user-set where given, else derived; fixed for every step)"
    return ParityReport(
        strategy=cand.name,
        ok=bool(records)
        and all(r.ok for r in records)
        and diverged_at is None
        and reference_diverged_at is None,
        steps=tuple(records),
        diagnoses=tuple(
            diagnose(records, num_shards, diverged=diverged, reference_diverged_at=reference_diverged_at)
        ),
        num_shards=num_shards,
        tolerance_rule=rule,
        diverged_at=diverged_at,
        diverged=diverged,
        reference_diverged_at=reference_diverged_at,
    )


@dataclasses.dataclass
class _Run:
    """The two sides of one :func:`check_parity` run (internal, mutable: the models change in place)."""

    ref_model: nnx.Module
    ref_opt: nnx.Optimizer
    reference: StepFn | None
    cand: Candidate
    cand_model: nnx.Module
    cand_opt: nnx.Optimizer
    kwargs: dict


def _synchronized(run: _Run, ref_model: nnx.Module, ref_opt: nnx.Optimizer) -> _Run:
    """A run whose candidate starts from a copy of the given reference state (model and optimizer).

    The reference side is ``run``'s own (stepped in place) when ``ref_model`` is ``run.ref_model``, else a copy.
    """
    if ref_model is run.ref_model:
        r_model, r_opt = run.ref_model, run.ref_opt
    else:
        r_model, r_opt = _copy_state(ref_model, ref_opt)
    c_model, c_opt = _copy_state(ref_model, ref_opt)
    if run.cand.make_optimizer is not None:
        c_opt = run.cand.make_optimizer(c_model, c_opt)
    return _Run(r_model, r_opt, run.reference, run.cand, c_model, c_opt, run.kwargs)


def _reference_finite(run: _Run, record: StepRecord) -> bool:
    """The reference's loss (when it returned one) and its parameters and optimizer state after the step are finite."""
    if math.isinf(record.loss) or (math.isnan(record.loss) and any(e.kind == "loss" for e in record.leaves)):
        return False
    trees = (nnx.state(run.ref_model, nnx.Param), _opt_state(run.ref_opt))
    for leaf in jax.tree.leaves(trees):
        a = to_host(leaf)
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return False
    return True


def _compare_step(
    run: _Run,
    t: int,
    x,
    y,
    w,
    rtol: float,
    atol: float,
    *,
    completed: int | None = None,
    synced: bool = False,
) -> StepRecord:
    """Snapshot both sides, step both on one batch, compare every leaf.

    ``completed``: the candidate's full steps after this one (for ``extra_checks``; default ``t + 1``; 1 for a
    candidate started from the reference's state).
    """
    ref_model, ref_opt, cand, cand_model, cand_opt = (
        run.ref_model,
        run.ref_opt,
        run.cand,
        run.cand_model,
        run.cand_opt,
    )
    view = cand.view_optimizer or _default_view

    ref_params0 = {k: to_host(v) for k, v in flatten_state(nnx.state(ref_model, nnx.Param)).items()}
    cand_params0 = {k: to_host(v) for k, v in flatten_state(nnx.state(cand_model, nnx.Param)).items()}
    ref_opt0 = {k: to_host(v) for k, v in flatten_state(_opt_state(ref_opt)).items()}
    cand_opt0 = {k: to_host(v) for k, v in flatten_state(view(cand_opt)[0]).items()}

    ref_grads = None
    if run.reference is None:
        ref_grads = _reference_grads(ref_model, x, y, w)
        ref_out = (
            sgd_step(ref_model, ref_opt, x, y)
            if w is None
            else weighted_sgd_step(ref_model, ref_opt, x, y, w)
        )
    else:
        ref_out = run.reference(ref_model, ref_opt, x, y, **({} if w is None else {"weights": w}))
    ref_loss, exposed, _, _ = _unpack(ref_out, "reference", t)
    ref_grads = exposed if exposed is not None else ref_grads

    kw = dict(run.kwargs)
    if w is not None:
        kw["weights"] = w
    try:
        cand_out = cand.step(cand_model, cand_opt, x, y, **kw)
    except Exception as err:
        raise CandidateError(
            f"check_parity: the candidate step {cand.name!r} raised {type(err).__name__}: {err} at step {t}",
            t,
        ) from err
    cand_loss, cand_grads, ew_loss, ew_grads = _unpack(cand_out, f"candidate {cand.name!r}", t)

    leaves: list[LeafError] = []
    ref_loss_f = float(np.asarray(ref_loss)) if ref_loss is not None else math.nan
    cand_loss_f = None if cand_loss is None else float(to_host(cand_loss))
    if ref_loss is not None and cand_loss is not None:
        leaves.append(_leaf_error(t, "loss", "loss", ref_loss_f, cand_loss_f, rtol, atol))

    if ref_grads is not None and cand_grads is not None:
        rg, cg = flatten_state(ref_grads), flatten_state(cand_grads)
        for path, ref_leaf in rg.items():
            if path in cg:
                leaves.append(_leaf_error(t, "grad", path, to_host(ref_leaf), to_host(cg[path]), rtol, atol))
            else:
                leaves.append(LeafError(t, "grad", path, math.inf, math.inf, 0.0, False))

    mismatches = []
    ref_params = flatten_state(nnx.state(ref_model, nnx.Param))
    cand_params = flatten_state(nnx.state(cand_model, nnx.Param))
    for path, ref_leaf in ref_params.items():
        if path not in cand_params:
            leaves.append(LeafError(t, "param", path, math.inf, math.inf, 0.0, False))
            continue
        if replica_mismatch(cand_params[path]):
            mismatches.append(f"param {path}")
        leaves.append(
            _leaf_error(
                t,
                "param",
                path,
                to_host(ref_leaf),
                to_host(cand_params[path]),
                rtol,
                atol,
                ref_params0[path],
                cand_params0[path],
            )
        )

    ref_state = flatten_state(_opt_state(ref_opt))
    cand_view, cand_count = view(cand_opt)
    cand_state = flatten_state(cand_view)
    for path, ref_leaf in ref_state.items():
        if path not in cand_state:
            leaves.append(LeafError(t, "opt_state", path, math.inf, math.inf, 0.0, False))
            continue
        if replica_mismatch(cand_state[path]):
            mismatches.append(f"opt_state {path}")
        r, c = to_host(ref_leaf), to_host(cand_state[path])
        if _is_int(r):
            leaves.append(_counter_error(t, path, r, c))
        else:
            leaves.append(
                _leaf_error(
                    t,
                    "opt_state",
                    path,
                    r,
                    c,
                    MOMENT_FACTOR * rtol,
                    MOMENT_FACTOR * atol,
                    ref_opt0[path],
                    cand_opt0.get(path, np.zeros_like(r)),
                )
            )
    ref_count = int(np.asarray(ref_opt.step[...]))
    leaves.append(_counter_error(t, "step", ref_count, cand_count))
    if cand.extra_checks is not None:
        for path, value, expected in cand.extra_checks(cand_opt, t + 1 if completed is None else completed):
            if _is_int(value):
                leaves.append(_counter_error(t, path, expected, value))
            else:
                leaves.append(
                    _leaf_error(t, "opt_state", path, to_host(expected), to_host(value), rtol, atol)
                )

    ew_loss_f = ew_loss_err = ew_grad_err = None
    if ew_loss is not None:
        ew_loss_f = float(to_host(ew_loss))
        ew_loss_err = abs(ew_loss_f - ref_loss_f)
    if ew_grads is not None and ref_grads is not None:
        rg, eg = flatten_state(ref_grads), flatten_state(ew_grads)
        ew_grad_err = max(
            float(np.max(np.abs(to_host(eg[p]).astype(np.float64) - to_host(rg[p])), initial=0.0))
            for p in rg
            if p in eg
        )
    return StepRecord(
        step=t,
        rtol=rtol,
        atol=atol,
        loss=ref_loss_f,
        candidate_loss=cand_loss_f,
        leaves=tuple(leaves),
        step_count=ref_count,
        candidate_step_count=int(np.asarray(cand_count)),
        replica_mismatches=tuple(mismatches),
        equal_weight_loss=ew_loss_f,
        equal_weight_loss_abs_err=ew_loss_err,
        equal_weight_grad_abs_err=ew_grad_err,
        synchronized=synced,
    )


def assert_step_parity(
    candidate: StepFn | str | Candidate, model: nnx.Module, optimizer: nnx.Optimizer, batches, **kwargs
) -> ParityReport:
    """:func:`check_parity`, raising when parity fails: for a user's own pytest suite.

    Args:
        candidate: as :func:`check_parity`.
        model: as :func:`check_parity`.
        optimizer: as :func:`check_parity`.
        batches: as :func:`check_parity`.
        **kwargs: ``steps``, ``num_shards``, ``mesh``, ``reference``, ``rtol``, ``atol``, ``name``.

    Returns:
        The passing :class:`ParityReport`.

    Raises:
        ParityError: an ``AssertionError`` whose message is the report (worst leaf, errors, tolerance,
            diagnosis) and whose ``report`` attribute is the :class:`ParityReport`.
        TypeError, ValueError: as :func:`check_parity`.
    """
    report = check_parity(candidate, model, optimizer, batches, **kwargs)
    if not report.step_ok:
        raise ParityError(report)
    return report
