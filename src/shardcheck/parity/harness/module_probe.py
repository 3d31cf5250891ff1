"""The module probe: on a failing step localized to the forward pass, the first module whose output differs while
its inputs matched.

The task's forward, ``task.loss_fn(model, batch)``, runs twice at equal parameters (the reference's before the
localized step; at step 0, the task's initial model) on that step's batch, every module method call recorded
(:func:`recorded_calls`: its array arguments, the array leaves of its output, its start and end in the call
sequence and the call that made it; sown, collected with ``nnx.capture(..., ModuleCallRecord)``):

- the reference side: the model on one device, as the reference runs;
- the candidate side: the same parameter values placed with the shardings the candidate's model holds (read from
  its arrays' ``.sharding``; the rest of the state and the batch replicated over its mesh), jitted under that mesh
  (``jax.set_mesh``), so that annotated (GSPMD) modules and modules whose ``__call__`` runs a ``jax.shard_map``
  over the mesh execute their parallel logic.

:func:`~shardcheck.parity.diagnosis.module_outputs.find_module` reads the calls in the order they finished (a
child before its parent) and names the first whose output differs while its inputs matched (Megatron's rule),
with where in its own code the difference begins (between two children's calls, or after them).

Tolerance (:func:`module_tolerance`): each input and output, normwise, ``max|c - r| <= atol + rtol * max|r|`` with the rule
the check itself assumes at equal parameters (step 0, :func:`~shardcheck.parity.tolerance.derive.derive_tolerance`
for the task's reduction length, ``rtol = 16 eps sqrt(n)``, ``atol = eps sqrt(n)``, eps the parameters' unit
roundoff or float32's), plus ``OUTPUT_ROUNDING * eps_c`` (16 eps_c) relative under a compute dtype or matmul
precision coarser than float32 (:attr:`~shardcheck.parity.tolerance.precision.Precision.compute_eps`): a correctly
sharded module reorders its contractions and, in a low-precision compute dtype, rounds each shard's partial result
and its own intermediates (:data:`~shardcheck.parity.diagnosis.module_outputs.OUTPUT_ROUNDING`); an output held in
bfloat16 is allowed that much of its own dtype's rounding whatever the policy read.

Runs only on a forward-stage FAIL (two programs compiled once each); nothing runs on PASS. A module called inside a
transform of the forward (a recurrent cell in a ``jax.lax.scan`` body, a ``vmap``, ``jax.checkpoint`` or
``shard_map`` body) is not recorded, its arrays being that transform's own tracers: the finding names it, and the
module that runs the transform is compared in its place. A capture that fails otherwise is said as such and the
localization stays at the stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools

import jax
import numpy as np
from flax import nnx
from jax.extend.core import get_opaque_trace_state
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from shardcheck.parity.comparison.live import flatten_state, to_host
from shardcheck.parity.diagnosis.evidence import StepRecord
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.module_outputs import (
    NOT_CAPTURED,
    OUTPUT_ROUNDING,
    ModuleCall,
    ModuleFinding,
    find_module,
)
from shardcheck.parity.harness.state import _Run
from shardcheck.parity.tolerance.derive import derive_tolerance
from shardcheck.parity.tolerance.precision import ACCUMULATION_DTYPE


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
    """The first module whose output differs while its inputs matched, between the reference's forward and the
    candidate-placed one.

    Args:
        run: the parity run (its task, its reference model's graph and its candidate model's placement).
        ref_params0: the reference's parameters before the step, ``{dotted path: array}``.
        batch: the step's batch.

    Returns:
        A :class:`ModuleFinding` (:func:`~shardcheck.parity.diagnosis.module_outputs.find_module`): ``"differs"``
        with the module, its error and tolerance and where in its own code; ``"input differs"``; ``"matches"``
        with the worst output; or ``"not captured"`` naming the exception's type when the capture or a forward
        raised (never raised to the caller). ``inside_transforms`` names the module methods called inside a
        transform of the forward (a ``jax.lax.scan`` body, ...), which are not compared."""
    try:
        graphdef, params, rest = _model_parts(run, ref_params0)
        mesh = _candidate_mesh(run)
        ref, inside = _captured(graphdef, run.task.loss_fn, *_on_one_device(params, rest, batch))
        placed = _as_candidate(run, mesh, params, rest, batch)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            cand, cand_inside = _captured(graphdef, run.task.loss_fn, *placed)
        found = find_module(ref, cand, module_tolerance(run, batch), _where(mesh))
        return dataclasses.replace(found, inside_transforms=tuple(sorted({*inside, *cand_inside})))
    except Exception as err:  # noqa: BLE001  (the probe adds evidence; it never fails the check)
        return ModuleFinding(NOT_CAPTURED, error=type(err).__name__)


def module_tolerance(run: _Run, batch) -> tuple[float, float]:
    """``(rtol, atol)`` of a module output (module docstring): the check's step-0 rule for the task's reduction
    length in the parameters' unit roundoff (float32's under low-precision parameters), plus
    ``OUTPUT_ROUNDING * compute_eps`` relative under a coarser compute dtype or matmul precision."""
    precision = run.precision
    dtype = ACCUMULATION_DTYPE if precision.param_eps > 0 else precision.param_dtype
    derived = derive_tolerance(dtype, batch_size=run.task.terms(batch), step=0)
    return derived.rtol + OUTPUT_ROUNDING * precision.compute_eps, derived.atol


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


class ModuleCallRecord(nnx.Intermediate):
    """What :func:`recorded_calls` sows for one module method call: ``{"start", "end", "parent", "inputs",
    "output"}`` (:class:`~shardcheck.parity.diagnosis.module_outputs.ModuleCall`'s fields, arrays)."""


@contextlib.contextmanager
def recorded_calls(model: nnx.Module, inside: set | None = None):
    """Within the block, every call of ``__call__`` or a public method that the classes of ``model``'s modules
    define themselves (the methods ``nnx.capture(..., method_outputs=...)`` wraps) sows a
    :class:`ModuleCallRecord`: its array arguments, the array leaves of its output, and its start, end and calling
    call's start in one sequence (constants of the traced program). Collect them with
    ``nnx.capture(fn, ModuleCallRecord)``; the classes are restored on leaving the block, raise or not.

    A call made inside a transform of its own within the traced program (a ``jax.lax.scan`` body such as a
    recurrent cell's, a ``vmap``, a ``jax.checkpoint``, a ``shard_map`` body) sows nothing: its arrays are that
    transform's tracers, which would escape it (JAX's unexpected-tracer error). Its ``"Class.method"`` is added to
    ``inside`` (a set, when given); the module that runs the transform is still recorded."""
    counter, stack, originals = itertools.count(), [], {}
    outer = get_opaque_trace_state()
    for cls in {type(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}:
        for name, method in list(vars(cls).items()):
            if inspect.isfunction(method) and (name == "__call__" or not name.startswith("_")):
                originals[cls, name] = method
                setattr(cls, name, _recording(method, name, counter, stack, outer, inside))
    try:
        yield
    finally:
        for (cls, name), method in originals.items():
            setattr(cls, name, method)


def _recording(method, name: str, counter, stack: list, outer, inside: set | None):
    """``method`` sowing its call's :class:`ModuleCallRecord` after it returns (on a module being captured, in the
    trace ``outer`` the block was entered in; a call inside a nested transform is named in ``inside``)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        start = next(counter)
        parent = stack[-1] if stack else -1
        stack.append(start)
        try:
            out = method(self, *args, **kwargs)
        finally:
            stack.pop()
        if hasattr(self, "__captures__") and get_opaque_trace_state() != outer:
            if inside is not None:
                inside.add(f"{type(self).__name__}.{name}")
        elif hasattr(self, "__captures__"):
            numbers = {
                k: np.int32(v) for k, v in (("start", start), ("end", next(counter)), ("parent", parent))
            }
            self.sow(
                ModuleCallRecord, name, {**numbers, "inputs": _arrays((args, kwargs)), "output": _arrays(out)}
            )
        return out

    return wrapper


def _arrays(tree) -> list:
    """The array leaves of ``tree`` (modules and variables not entered; no PRNG key)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (nnx.Module, nnx.Variable)))
    return [
        x
        for x in leaves
        if isinstance(x, (jax.Array, np.ndarray)) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    ]


@functools.lru_cache(maxsize=8)
def _forward(graphdef, loss_fn):
    """``(jitted, inside)``: the jitted forward of ``loss_fn`` on the model ``graphdef`` that returns every module
    method call's record, ``{"module.path.method": (record of each call, ...)}``, and the set its tracing fills with
    the ``"Class.method"`` of calls made inside a transform of the forward, not recorded (:func:`recorded_calls`).
    One per graph and loss: a later failing step of the same run reuses its programs."""
    inside: set = set()

    def forward(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        with recorded_calls(model, inside):
            _, sown = nnx.capture(loss_fn, ModuleCallRecord)(model, batch)
        return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(sown)}

    return jax.jit(forward), inside


def _captured(graphdef, loss_fn, params, rest, batch) -> tuple[dict[str, ModuleCall], tuple[str, ...]]:
    """Every module method call of one jitted forward, ``{name: ModuleCall}`` with host arrays, and the sorted
    ``"Class.method"`` names of calls made inside a transform of the forward (not recorded)."""
    args = (nnx.as_pure(params), nnx.as_pure(rest), batch)  # arrays only: the callers' trees stay as they are
    try:
        jitted, inside = _forward(graphdef, loss_fn)
    except TypeError:  # an unhashable loss callable: its own program, not kept
        jitted, inside = _forward.__wrapped__(graphdef, loss_fn)
    calls = {}
    for key, records in jitted(*args).items():
        for i, r in enumerate(records):
            host = [tuple(np.asarray(to_host(a)) for a in r[part]) for part in ("inputs", "output")]
            name = key if i == 0 else f"{key} (call {i + 1})"
            calls[name] = ModuleCall(name, int(r["start"]), int(r["end"]), int(r["parent"]), *host)
    return calls, tuple(sorted(inside))


def _where(mesh) -> str:
    """``"mesh data=2 x model=2"``, or ``"the candidate's device"`` without a mesh."""
    if mesh is None:
        return "the candidate's device"
    return "mesh " + " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
