"""The module probe: on a failing step localized to the forward pass, the first module whose output differs.

The task's forward, ``task.loss_fn(model, batch)``, runs twice at equal parameters (the reference's before the
localized step; at step 0, the task's initial model) on that step's batch, wrapped in
``nnx.capture(..., nnx.Intermediate, method_outputs=nnx.Intermediate)`` so that every module method's output is
kept:

- the reference side: the model on one device, as the reference runs;
- the candidate side: the same parameter values placed with the shardings the candidate's model holds (read from
  its arrays' ``.sharding``; the rest of the state and the batch replicated over its mesh), jitted under that mesh
  (``jax.set_mesh``), so that annotated (GSPMD) modules and modules whose ``__call__`` runs a ``jax.shard_map``
  over the mesh execute their parallel logic.

The outputs are compared in the order the modules finished: the index of the operation that produced each output
in the candidate's traced program (its ``jaxpr``, which records the operations in the order Python ran them), a
child before its parent where a parent returns its child's output unchanged. The first that differs is the
deepest module whose output differs while every module output computed before it matched (Megatron's rule;
:mod:`shardcheck.parity.diagnosis.module_outputs`).

Tolerance (:func:`module_tolerance`): each output, normwise, ``max|c - r| <= atol + rtol * max|r|`` with the rule
the check itself assumes at equal parameters (step 0, :func:`~shardcheck.parity.tolerance.derive.derive_tolerance`
for the task's reduction length, ``rtol = 16 eps sqrt(n)``, ``atol = eps sqrt(n)``, eps the parameters' unit
roundoff or float32's), plus ``COMPUTE_SAFETY * eps_c`` relative under a compute dtype or matmul precision coarser
than float32 (:attr:`~shardcheck.parity.tolerance.precision.Precision.compute_eps`): a correctly sharded module
reorders its contractions and, in a low-precision compute dtype, rounds each shard's partial result once.

Runs only on a forward-stage FAIL (two programs compiled once each); nothing runs on PASS. A capture that fails
(a tracer escaping a user's transform, a module run inside a ``shard_map`` body) is said as such and the
localization stays at the stage.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from shardcheck.parity.comparison.live import flatten_state, to_host
from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.module_outputs import DIFFERS, MATCHES, NOT_CAPTURED, ModuleFinding
from shardcheck.parity.harness.state import _Run
from shardcheck.parity.tolerance.derive import derive_tolerance
from shardcheck.parity.tolerance.precision import ACCUMULATION_DTYPE, COMPUTE_SAFETY


def module_evidence(run: _Run, record: StepRecord, snapshots, batch) -> StepRecord:
    """``record`` with :attr:`StepRecord.module` set (:func:`probe_modules`) where its localization's stage is the
    forward pass; ``record`` itself otherwise (nothing runs).

    Args:
        run: the parity run, after the step.
        record: the failing step's record.
        snapshots: both sides' state before the step (``check._snapshots``; the reference's parameters first).
        batch: the step's batch.
    """
    found = localize([record])
    if found is None or found.stage != "forward":
        return record
    return dataclasses.replace(record, module=probe_modules(run, snapshots[0], batch))


def probe_modules(run: _Run, ref_params0: dict, batch) -> ModuleFinding:
    """The first module whose output differs between the reference's forward and the candidate-placed one.

    Args:
        run: the parity run (its task, its reference model's graph and its candidate model's placement).
        ref_params0: the reference's parameters before the step, ``{dotted path: array}``.
        batch: the step's batch.

    Returns:
        A :class:`ModuleFinding`: ``"differs"`` with the module, its error, tolerance and how many outputs before
        it matched; ``"matches"`` with the worst output; or ``"not captured"`` naming the exception's type when
        the capture or a forward raised (never raised to the caller).
    """
    try:
        graphdef, params, rest = _model_parts(run, ref_params0)
        mesh = _candidate_mesh(run)
        ref, _ = _captured(graphdef, run.task.loss_fn, *_on_one_device(params, rest, batch))
        placed = _as_candidate(run, mesh, params, rest, batch)
        if mesh is None:
            cand, order = _captured(graphdef, run.task.loss_fn, *placed)
        else:
            with jax.set_mesh(mesh):
                cand, order = _captured(graphdef, run.task.loss_fn, *placed)
        return _first_difference(ref, cand, order, module_tolerance(run, batch), _where(mesh))
    except Exception as err:  # noqa: BLE001  (the probe adds evidence; it never fails the check)
        return ModuleFinding(NOT_CAPTURED, error=type(err).__name__)


def module_tolerance(run: _Run, batch) -> tuple[float, float]:
    """``(rtol, atol)`` of a module output (module docstring): the check's step-0 rule for the task's reduction
    length in the parameters' unit roundoff (float32's under low-precision parameters), plus
    ``COMPUTE_SAFETY * compute_eps`` relative under a coarser compute dtype or matmul precision."""
    precision = run.precision
    dtype = ACCUMULATION_DTYPE if precision.param_eps > 0 else precision.param_dtype
    derived = derive_tolerance(dtype, batch_size=run.task.terms(batch), step=0)
    return derived.rtol + COMPUTE_SAFETY * precision.compute_eps, derived.atol


def _model_parts(run: _Run, ref_params0: dict):
    """``(graphdef, parameters, rest)`` of the reference's model with the parameters ``ref_params0``."""
    graphdef, like, rest = nnx.split(run.ref_model, nnx.Param, ...)
    paths = list(flatten_state(like))
    params = jax.tree.unflatten(jax.tree.structure(like), [ref_params0[p] for p in paths])
    return graphdef, params, rest


def _on_one_device(params, rest, batch):
    """The three trees on the reference parameters' first device (where the reference runs)."""
    leaf = next(a for a in jax.tree.leaves(params) if isinstance(a, jax.Array))
    one = SingleDeviceSharding(min(leaf.devices(), key=lambda d: d.id))
    return jax.device_put((params, rest, batch), one)


def _candidate_mesh(run: _Run):
    """The mesh of the candidate's parameters' ``NamedSharding`` (the first found), else ``None``."""
    for leaf in flatten_state(nnx.state(run.cand_model, nnx.Param)).values():
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _as_candidate(run: _Run, mesh, params, rest, batch):
    """The trees placed as the candidate holds them: each parameter with the sharding of the candidate's leaf of
    its path, the rest and the batch replicated over ``mesh`` (or on the candidate's first device)."""
    cand = flatten_state(nnx.state(run.cand_model, nnx.Param))
    if mesh is not None:
        whole = NamedSharding(mesh, P())
    else:
        leaf = next(a for a in cand.values() if isinstance(a, jax.Array))
        whole = SingleDeviceSharding(min(leaf.devices(), key=lambda d: d.id))
    paths = list(flatten_state(params))
    shardings = [getattr(cand.get(p), "sharding", whole) for p in paths]
    placed = [jax.device_put(a, s) for a, s in zip(jax.tree.leaves(params), shardings, strict=True)]
    params = jax.tree.unflatten(jax.tree.structure(params), placed)
    return params, jax.device_put(rest, whole), jax.device_put(batch, whole)


@functools.lru_cache(maxsize=8)
def _forward(graphdef, loss_fn):
    """The jitted forward of ``loss_fn`` on the model ``graphdef`` that returns every module method's captured
    outputs, ``{"module.path.method": (output of each call, ...)}`` (one per graph and loss: a later failing step
    of the same run reuses its programs)."""

    def forward(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        capture = nnx.capture(loss_fn, nnx.Intermediate, method_outputs=nnx.Intermediate)
        _, sown = capture(model, batch)
        return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(sown)}

    return jax.jit(forward)


def _captured(graphdef, loss_fn, params, rest, batch) -> tuple[dict, list]:
    """Every module method's outputs of one jitted forward, ``{(module.method, call): [host arrays]}``, and those
    keys in the order they finished (the traced program's producing operation; deeper first on a tie)."""
    args = (nnx.as_pure(params), nnx.as_pure(rest), batch)  # arrays only: the callers' trees stay as they are
    try:
        jitted = _forward(graphdef, loss_fn)
    except TypeError:  # an unhashable loss callable: its own program, not kept
        jitted = _forward.__wrapped__(graphdef, loss_fn)
    traced = jitted.trace(*args)  # the order in which the outputs were made; the call below runs the program
    out = jitted(*args)
    jaxpr = traced.jaxpr.jaxpr
    made = {id(v): i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    finished: dict[tuple[str, int], int] = {}
    outputs: dict[tuple[str, int], list] = {}
    flat = jax.tree_util.tree_flatten_with_path(out)[0]
    for (path, value), var in zip(flat, jaxpr.outvars, strict=True):
        key = (path[0].key, path[1].idx)
        finished[key] = max(finished.get(key, -1), made.get(id(var), -1))
        outputs.setdefault(key, []).append(np.asarray(to_host(value)))
    order = sorted(finished, key=lambda k: (finished[k], -k[0].count("."), k[1]))
    return outputs, order


def _error(ref: list, cand: list, rtol: float, atol: float) -> tuple[float, float]:
    """``(max abs err, tolerance)`` of one module output: of its array that exceeds its tolerance the most (or
    comes nearest to it). Each array normwise, ``atol + rtol max|r|``; integers and booleans exactly; ``inf``
    where the shapes or the non-finite entries differ."""
    pairs = [_array_error(r, c, rtol, atol) for r, c in zip(ref, cand, strict=True)]
    return max(pairs, key=lambda p: p[0] - p[1], default=(0.0, 0.0))


def _array_error(r: np.ndarray, c: np.ndarray, rtol: float, atol: float) -> tuple[float, float]:
    if r.shape != c.shape:
        return float("inf"), 0.0
    exact = not np.issubdtype(r.dtype, np.inexact)
    r, c = r.astype(np.float64), c.astype(np.float64)
    finite = np.isfinite(r)
    if not np.array_equal(finite, np.isfinite(c)) or not np.array_equal(
        r[~finite], c[~finite], equal_nan=True
    ):
        return float("inf"), 0.0
    err = float(np.max(np.abs(r[finite] - c[finite]), initial=0.0))
    return err, 0.0 if exact else atol + rtol * float(np.max(np.abs(r[finite]), initial=0.0))


def _name(key: tuple[str, int]) -> str:
    return key[0] if key[1] == 0 else f"{key[0]} (call {key[1] + 1})"


def _first_difference(
    ref: dict, cand: dict, order: list, tol: tuple[float, float], where: str
) -> ModuleFinding:
    """The :class:`ModuleFinding` of the outputs both sides captured, read in ``order``."""
    keys = [k for k in order if k in ref and len(ref[k]) == len(cand[k])]
    if not keys:  # the forward called no module method that capture wraps, or the two sides none in common
        return ModuleFinding(NOT_CAPTURED, error="no module output on both sides", where=where)
    worst = None
    for i, key in enumerate(keys):
        err, bound = _error(ref[key], cand[key], *tol)
        if err > bound:
            return ModuleFinding(DIFFERS, _name(key), err, bound, i, len(keys), where)
        if worst is None or err / max(bound, 1e-300) > worst[1] / max(worst[2], 1e-300):
            worst = (key, err, bound)
    key, err, bound = worst
    return ModuleFinding(MATCHES, _name(key), err, bound, len(keys), len(keys), where)


def _where(mesh) -> str:
    """``"mesh data=2 x model=2"``, or ``"the candidate's device"`` without a mesh."""
    if mesh is None:
        return "the candidate's device"
    return "mesh " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
