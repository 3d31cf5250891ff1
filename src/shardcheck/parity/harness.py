"""The parity harness: run a task's reference step and a candidate step side by side and compare every leaf.

Seed ``001_a85d1499a1a85057.txt``: "with equivalent initial parameters, loss normalization and optimizer settings,
a correctly synchronized sharded step should reproduce the intended baseline update within numerical tolerance.
Matching a single loss value alone does not verify that update". :func:`check_parity` runs the task's
single-device step (:func:`~shardcheck.steps.reference.reference_step`) and a candidate step from copies of one
model and optimizer over the task's batches, and records for every step the error of the loss, of every gradient
leaf (where the candidate exposes them), of every updated parameter, of every optimizer-state leaf and of the
step counters. When parity fails, :mod:`shardcheck.parity.diagnosis` says why.

Tolerance (:func:`~shardcheck.parity.tolerance.derive_tolerance`, ``docs/parity.md``)::

    rtol_t = 16 * eps * sqrt(n) * sqrt(t + 1)      atol_t = eps * sqrt(n) * sqrt(t + 1)
    leaf passes at step t  <=>  |cand - ref| <= atol_t + rtol_t * max|ref| + allowance      (moments: x2)

with ``n`` the task's reduction length (:meth:`Task.terms`). ``allowance`` is the update's sensitivity to the
gradient's own tolerance, propagated through the optimizer (``tx.update`` at ``g +- delta``) and summed over the
steps: negligible for SGD and for Adam on ordinary leaves, about ``lr`` for a leaf whose true gradient is 0 under
a normalizing optimizer (the gradient is rounding noise, and Adam turns noise into lr-sized steps). Such leaves
are reported (``rounding_level``) and remain checked through their gradients and optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck import _validate
from shardcheck.datasets import minibatch_indices
from shardcheck.mesh import check_mesh, data_shards
from shardcheck.parity import compare
from shardcheck.parity.candidates import as_candidate, check_step_signature, unpack
from shardcheck.parity.compare import (
    LeafInput,
    counter_error,
    device_snapshot,
    flatten_state,
    host_tree,
    is_int,
    leaf_error,
    leaf_errors,
    replica_mismatches,
    to_host,
)
from shardcheck.parity.diagnosis import Diagnosis, LeafError, StepRecord, _gradient_factor, diagnose
from shardcheck.parity.precision import (
    ACCUMULATION_DTYPE,
    COMPUTE_SAFETY,
    Precision,
    compute_allowance,
    float32_compute,
    loss_compute_allowance,
    output_rounding,
)
from shardcheck.parity.propagation import grad_delta, scale_change, shadow_spread, update_sensitivity
from shardcheck.parity.report import CandidateError, ParityError, ParityReport
from shardcheck.parity.tolerance import MOMENT_FACTOR, derive_tolerance
from shardcheck.parity.topology import mismatch_axes
from shardcheck.steps import STRATEGIES, Candidate
from shardcheck.steps._core import params_value_and_grad
from shardcheck.steps.reference import reference_step
from shardcheck.steps.registry import mesh_for
from shardcheck.steps.sharded import state_specs
from shardcheck.task import Task, check_divisible, check_loss_output, loss_terms, split_batch
from shardcheck.task import batch_size as leading_size

PyTree = Any
StepFn = Callable[..., Any]


# ------------------------------------------------------------------------------------------------ state


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


# ------------------------------------------------------------------------------------------------ checks


@functools.partial(nnx.jit, static_argnums=0)
def _probe_loss(loss_fn, model, batch):
    return loss_fn(model, batch)


def check_model(fn: str, model: nnx.Module, loss_fn, batch) -> bool:
    """Refuse models whose sharded and full-batch steps differ (C7); returns whether the loss is weighted.

    ``nnx.BatchStat`` variables (BatchNorm) are refused. RNG streams are accepted when the forward pass does not
    draw from them (Dropout at rate 0, ``model.eval()``, ``deterministic=True``): ``loss_fn`` runs once on a
    clone and any stream whose counter moved is named in the refusal. The loss at step 0 is checked too.

    Raises:
        TypeError: ``model`` not an ``nnx.Module``; a malformed loss output.
        ValueError: BatchStat variables; RNG streams drawn in the forward pass; a non-finite loss at step 0.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{fn}: model must be an nnx.Module, got {type(model).__name__}")
    if jax.tree.leaves(nnx.state(model, nnx.BatchStat)):
        raise ValueError(
            f"{fn}: model {type(model).__name__} is refused because it holds nnx.BatchStat variables (e.g. "
            "BatchNorm): each shard would normalise with its own batch statistics, not the full batch's "
            "(docs/reduction_cases.md C7); use LayerNorm, or a model without batch statistics"
        )
    clone = nnx.clone(model)
    before = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(clone, nnx.RngCount))}
    try:
        out = _probe_loss(loss_fn, clone, batch)
    except Exception as err:
        raise type(err)(f"{fn}: the task's loss_fn raised on batch 0: {err}") from err
    after = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(clone, nnx.RngCount))}
    drawn = [".".join(map(str, p)) for p in before if not np.array_equal(before[p], after[p])]
    if drawn:
        raise ValueError(
            f"{fn}: model {type(model).__name__} draws random numbers in its forward pass (RNG stream(s) "
            f"{', '.join(drawn)} advanced): every shard would draw its own mask, so no sharded step can equal the "
            "full-batch one (seed 000). Make the forward pass deterministic (model.eval(), Dropout rate 0, "
            "deterministic=True) for the check"
        )
    return check_loss_output(fn, out)


def _check_tolerances(fn, rtol, atol):
    for label, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0
        ):
            raise ValueError(f"{fn}: {label} must be a number >= 0, got {value!r}")


def _task_batches(fn: str, task: Task, steps: int | None) -> list:
    if steps is None:
        return list(task.batches)
    steps = _validate.check_int(fn, "steps", steps)
    if steps > len(task.batches):
        raise ValueError(
            f"{fn}: steps={steps} but the task holds only {len(task.batches)} batch(es); pass more"
        )
    return list(task.batches[:steps])


# ------------------------------------------------------------------------------------ sensitivity, hypotheses


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 6))
def _shard_magnitude(loss_fn, num_shards, graphdef, params, rest, batch, reduce_dtype=None):
    """``(A, g_S, g_S')``: ``A = sum_s |grad loss_sum_s| / W`` (W the total weight, or S for a scalar loss), the
    scale of the terms a sharded step reorders; ``g_S = sum_s grad loss_sum_s / W``, the gradient of a correct
    S-shard split computed in the model's own precision, its sum over shards in the gradients' dtype
    (``shardcheck.parity.precision``); and ``g_S'``, the same split with each shard's gradient rounded to
    ``reduce_dtype`` and summed in it (how a GSPMD-partitioned bfloat16 backward pass all-reduces its partial
    products; ``None`` when ``reduce_dtype`` is ``None``). float32 trees."""
    low = jnp.float32 if reduce_dtype is None else reduce_dtype

    def shard(acc, shard_batch):
        total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, shard_batch)
        acc = jax.tree.map(
            lambda a, g: (a[0] + jnp.abs(g.astype(jnp.float32)), a[1] + g, a[2] + g.astype(low)),
            acc,
            grads,
            is_leaf=_is_pair,
        )
        return acc, weight

    # |g_s| summed in float32; g_s in the gradient's own dtype, as a step reducing its gradients as they are does
    zeros = jax.tree.map(
        lambda p: (jnp.zeros(p.shape, jnp.float32), jnp.zeros(p.shape, p.dtype), jnp.zeros(p.shape, low)),
        params,
    )
    summed, weights = jax.lax.scan(shard, zeros, split_batch(batch, num_shards))
    total_weight = num_shards if weights is None else jnp.sum(weights)

    def part(i):
        return jax.tree.map(lambda a: a[i].astype(jnp.float32) / total_weight, summed, is_leaf=_is_pair)

    return part(0), part(1), None if reduce_dtype is None else part(2)


def _is_pair(a) -> bool:
    return isinstance(a, tuple)


def _like(tree, values: dict):
    """``tree`` with every leaf replaced by ``values[dotted path]`` (cast to the leaf's dtype) where present."""
    leaves, treedef = jax.tree.flatten(tree)
    paths = flatten_state(tree)
    out = [
        jax.device_put(jnp.asarray(values[k], v.dtype), v.sharding)
        if k in values and np.dtype(values[k].dtype).kind not in "iub"
        else v
        for k, v in zip(paths, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _shadow_inputs(run: _Run, pre: _PreStep, batch):
    """The candidate's pre-step ``(gradient, optimizer state, parameters)`` as the reference would compute them
    (its gradient at the candidate's parameters), or ``None`` when the candidate's state is the reference's.

    Compared and moved onto the reference's devices device to device; a candidate spread over several processes
    is gathered to the host first."""
    view = run.cand.view_optimizer or _default_view
    cand_params = flatten_state(nnx.state(run.cand_model, nnx.Param))
    cand_state = flatten_state(view(run.cand_opt)[0])
    ref_params, ref_state = flatten_state(pre.params), flatten_state(pre.opt_state)
    cand = {**{f"p {k}": v for k, v in cand_params.items()}, **{f"s {k}": v for k, v in cand_state.items()}}
    ref = {**{f"p {k}": v for k, v in ref_params.items()}, **{f"s {k}": v for k, v in ref_state.items()}}
    if not all(isinstance(v, jax.Array) and v.is_fully_addressable for v in cand.values()):
        cand = host_tree(cand)
    if compare.equal(ref, cand):
        return None
    params = _like(pre.params, {k: cand[f"p {k}"] for k in cand_params})
    grads = _grads_at(run.task.loss_fn, pre.graphdef, params, pre.rest, batch)
    return grads, _like(pre.opt_state, {k: cand[f"s {k}"] for k in cand_state}), params


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _per_shard_mean_params(loss_fn, num_shards, graphdef, tx, params, rest, opt_state, batch):
    """``(params, opt_state)`` after the step whose gradient is the mean of per-shard means (each shard divided
    by its own weight)."""

    def shard_grad(shard):
        def mean(p):
            total, weight = loss_terms(loss_fn, nnx.merge(graphdef, p, rest), shard)
            return total / weight

        return jax.grad(mean)(params)

    grads = jax.tree.map(
        lambda g: jnp.mean(g, axis=0), jax.lax.map(shard_grad, split_batch(batch, num_shards))
    )
    return _stepped(tx, params, opt_state, grads)


@functools.partial(jax.jit, static_argnums=0)
def _scaled_params(tx, params, opt_state, grads, factor):
    """``(params, opt_state)`` after the reference's optimizer step on ``factor`` times its gradient."""
    return _stepped(tx, params, opt_state, jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads))


def _stepped(tx, params, opt_state, grads):
    """``(params, opt_state)`` after one step of ``tx`` on ``grads`` (traced, inside the hypotheses' jits)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state


@dataclasses.dataclass(frozen=True)
class _PreStep:
    """The reference's state before a step, kept on device for the sensitivity and the hypotheses."""

    graphdef: Any
    params: PyTree
    rest: PyTree
    opt_state: PyTree

    @staticmethod
    def of(model, optimizer) -> _PreStep:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return _PreStep(graphdef, nnx.as_pure(params), rest, nnx.as_pure(optimizer.opt_state))


# --------------------------------------------------------------------------------------------------- the run


@dataclasses.dataclass
class _Run:
    """The two sides of one :func:`check_parity` run (internal, mutable: the models change in place)."""

    task: Task
    ref_model: nnx.Module
    ref_opt: nnx.Optimizer
    reference: StepFn | None
    cand: Candidate
    cand_model: nnx.Module
    cand_opt: nnx.Optimizer
    kwargs: dict
    weighted: bool
    precision: Precision
    leaf_tolerance: dict[str, tuple[float, float]] | None  # by leaf name (_check_leaf_tolerance)
    graphdef32: Any = None  # the model computing in float32 (precision.float32_compute), or None
    allowance: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    state_allowance: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def tol(self, kind: str, path: str, rtol: float, atol: float) -> tuple[float, float]:
        """The leaf's ``(rtol, atol)``: the user's per-leaf override when one applies, else the derived ones."""
        if self.leaf_tolerance is None:
            return rtol, atol
        return self.leaf_tolerance.get("loss" if kind == "loss" else f"{kind} {path}", (rtol, atol))

    def synchronized(self, ref_model: nnx.Module, ref_opt: nnx.Optimizer) -> _Run:
        """A run whose candidate starts from a copy of the given reference state (model and optimizer).

        The reference side is this run's own (stepped in place) when ``ref_model`` is ``self.ref_model``, else a
        copy; the allowance starts from zero (one step from identical state).
        """
        if ref_model is self.ref_model:
            r_model, r_opt = self.ref_model, self.ref_opt
        else:
            r_model, r_opt = _copy_state(ref_model, ref_opt)
        c_model, c_opt = _copy_state(ref_model, ref_opt)
        if self.cand.make_optimizer is not None:
            c_opt = self.cand.make_optimizer(c_model, c_opt)
        return dataclasses.replace(
            self,
            ref_model=r_model,
            ref_opt=r_opt,
            cand_model=c_model,
            cand_opt=c_opt,
            allowance={},
            state_allowance={},
        )


def _reference_finite(record: StepRecord, after: _After) -> bool:
    """The reference's loss (when it returned one) and its parameters and optimizer state after the step are finite
    (checked on their devices)."""
    if math.isinf(record.loss) or (math.isnan(record.loss) and any(e.kind == "loss" for e in record.leaves)):
        return False
    return compare.all_finite([*after.ref_params.values(), *after.ref_state.values()])


@dataclasses.dataclass(frozen=True)
class _After:
    """Both sides' state after a step, flattened once (``{dotted path: leaf}``; an NNX graph flatten of a
    transformer's optimizer takes milliseconds): the parameters, the reference's optimizer state, and the
    candidate's view of its optimizer (state and step counter)."""

    ref_params: dict
    cand_params: dict
    ref_state: dict
    cand_state: dict
    cand_count: Any

    @staticmethod
    def of(run: _Run) -> _After:
        view = run.cand.view_optimizer or _default_view
        cand_view, cand_count = view(run.cand_opt)
        return _After(
            flatten_state(nnx.state(run.ref_model, nnx.Param)),
            flatten_state(nnx.state(run.cand_model, nnx.Param)),
            flatten_state(_opt_state(run.ref_opt)),
            flatten_state(cand_view),
            cand_count,
        )


@dataclasses.dataclass(frozen=True)
class _Bounds:
    """What one reference step lets a correct candidate differ by, per leaf, by dotted path (device arrays, but
    ``grad_max``).

    ``grad``: the compute-rounding allowance of each gradient element (``{}`` at float32); ``update`` and
    ``state``: the sensitivity of the update and of the optimizer state to the gradient's tolerance;
    ``grad_max``: ``max |g|`` per leaf (floats); ``grads``: the reference's gradient, by path and as its tree
    (``grad_tree``, for :func:`_scale_evidence`).
    """

    grad: dict
    update: dict
    state: dict
    grad_max: dict
    grads: dict
    grad_tree: Any


def _noise_shards(num_shards: int | None, batch) -> int:
    """The split whose gradient measures the compute noise: the candidate's S, else 2 (1 if B is odd)."""
    s = num_shards if num_shards and num_shards > 1 else 2
    return s if leading_size(batch) % s == 0 else 1


def _step_reference(run: _Run, batch, rtol: float, atol: float):
    """Step the reference; returns ``(loss, grads, pre-step state, _Bounds or None)``."""
    pre = _PreStep.of(run.ref_model, run.ref_opt)
    if run.reference is not None:
        loss, grads = unpack(run.reference(run.ref_model, run.ref_opt, batch), "reference")
        return loss, grads, pre, None
    noise = None
    if run.precision.compute_eps > 0:
        shards = _noise_shards(run.cand.num_shards, batch)
        # a correct split reduces its shards' gradients in float32 (shard_map) or, as GSPMD's partitioned
        # backward pass may, in the compute dtype: both realizations bound the compute noise
        low = run.precision.compute_dtype
        magnitude, split, split_low = _shard_magnitude(
            run.task.loss_fn, shards, pre.graphdef, pre.params, pre.rest, batch, low
        )
    result = reference_step(run.task.loss_fn, run.ref_model, run.ref_opt, batch)
    grads = nnx.as_pure(result.grads)
    shadow = None
    if run.precision.compute_eps > 0:
        shadow = _shadow_inputs(run, pre, batch)
        drifted = None if shadow is None else shadow[0]
        realizations = [split, split_low]
        if run.graphdef32 is not None:
            realizations.append(_grads_at(run.task.loss_fn, run.graphdef32, pre.params, pre.rest, batch))
        noise = functools.reduce(_tree_max, [compute_allowance(g, grads, drifted) for g in realizations])
        noise = _tree_add(noise, output_rounding(grads, magnitude, run.precision.compute_eps))
    delta = grad_delta(grads, noise, rtol, atol, 1.0)
    updates, states, grad_max = update_sensitivity(run.ref_opt.tx, grads, pre.opt_state, pre.params, delta)
    if shadow is not None:
        moved = shadow_spread(run.ref_opt.tx, grads, pre.opt_state, pre.params, *shadow)
        updates, states = _tree_add((updates, states), moved)
    base = grad_delta(grads, None, rtol, atol, 0.0)
    grad_allowance = {} if noise is None else flatten_state(_tree_subtract(delta, base))
    # the allowances stay on the device: the comparison reduces them there (compare.leaf_errors)
    bounds = _Bounds(
        grad_allowance,
        flatten_state(updates),
        flatten_state(states),
        {k: float(v) for k, v in jax.device_get(flatten_state(grad_max)).items()},
        flatten_state(grads),
        grads,
    )
    return result.loss, result.grads, pre, bounds


def _step_candidate(run: _Run, t: int, batch):
    try:
        out = run.cand.step(run.cand_model, run.cand_opt, batch, **run.kwargs)
    except Exception as err:
        s, rows = run.cand.num_shards, leading_size(batch)
        hint = (
            f"the batch's {rows} rows do not split over the {s} devices of the mesh: a likely cause; give a "
            "batch size divisible by the device count, or fewer devices"
            if s and s > 1 and rows % s
            else ""
        )
        # the likely cause first: a JAX error's own text can run to several lines
        cause = f" ({hint})" if hint else ""
        raise CandidateError(
            f"check_parity: the candidate step {run.cand.name!r} raised {type(err).__name__} at step {t}{cause}: "
            f"{err}",
            t,
            hint,
        ) from err
    return unpack(out, f"candidate {run.cand.name!r}", t)


def _compare_params(run: _Run, t, ref0, cand0, rtol, atol, bounds, after: _After) -> tuple[list, list, list]:
    """Param leaf errors (tolerance widened by the accumulated sensitivity and, for low-precision parameters,
    one rounding per step), replica mismatches, and the leaves whose gradient is at rounding level."""
    leaves, unresolved = [], []
    ref_params, cand_params = after.ref_params, after.cand_params
    tracked = [] if bounds is None else [p for p in ref_params if p in bounds.update and p in cand_params]
    # the per-leaf scalars the rules below read, each reduced on the device over every leaf at once
    eps = run.precision.param_eps
    scale = compare.max_abs({p: ref_params[p] for p in tracked}) if eps else {}
    noise = compare.max_abs({p: bounds.grad[p] for p in tracked if p in bounds.grad})
    # at rounding level: the gradient is within its own tolerance of 0, and the update it drives is not
    # resolvable at the parameter's tolerance
    at_rounding = [p for p in tracked if bounds.grad_max[p] <= atol + noise.get(p, 0.0)]
    moved = compare.max_abs_diff({p: ref_params[p] for p in at_rounding}, {p: ref0[p] for p in at_rounding})
    # the update of a noise gradient is any step the optimizer can take: the two sides' updates each lie within
    # it, so they differ by up to twice the reference's largest (Adam: ~2 lr)
    floor = {p: 2.0 * v for p, v in moved.items()}
    rounding = {p: eps * scale[p] if eps else 0.0 for p in tracked}
    if tracked:
        run.allowance.update(
            _accumulated(run.allowance, {p: bounds.update[p] for p in tracked}, floor, rounding)
        )
    for path, ref_leaf in ref_params.items():
        if path not in cand_params:
            leaves.append(LeafError(t, "param", path, math.inf, math.inf, 0.0, False))
            continue
        allowance = run.allowance[path] if path in tracked else None
        r_tol, a_tol = run.tol("param", path, rtol, atol)
        c = cand_params[path]
        leaves.append(
            LeafInput(t, "param", path, ref_leaf, c, r_tol, a_tol, ref0[path], cand0[path], allowance)
        )
    if at_rounding:
        widest = compare.max_abs({p: run.allowance[p] for p in at_rounding})
        size = compare.max_abs({p: ref_params[p] for p in at_rounding})
        unresolved = [f"param {p}" for p in at_rounding if widest[p] > atol + rtol * size[p]]
    differ = replica_mismatches(cand_params)
    mismatches = [f"param {p}" for p in ref_params if p in differ]
    return leaves, mismatches, unresolved


# Tree arithmetic in one compiled call per tree: eagerly, each operation on a new leaf shape compiles a program
# of its own (XLA:CPU: 40-80 ms each; 60 leaves' additions took 4.6 s eagerly, 1.2 s as one jitted tree).
_tree_add = jax.jit(functools.partial(jax.tree.map, jnp.add))
_tree_subtract = jax.jit(functools.partial(jax.tree.map, jnp.subtract))
_tree_max = jax.jit(functools.partial(jax.tree.map, jnp.maximum))


@jax.jit
def _accumulated(before: dict, step: dict, floor: dict, rounding: dict) -> dict:
    """Per path of ``step``: ``before + max(step, floor) + rounding``, the allowance accumulated over the steps
    (``before`` lacks a path on a run's first step, ``floor`` where there is none). Paths of ``before`` that
    ``step`` lacks are left out."""

    def one(p, s):
        s = jnp.maximum(s, floor[p]) if p in floor else s
        return (s if p not in before else before[p] + s) + rounding[p]

    return {p: one(p, s) for p, s in step.items()}


def storage_rounding(leaf) -> float:
    """How far two correct runs' copies of a stored leaf may differ by its own rounding: ``eps * max|leaf|`` for
    a floating dtype less precise than float32 (bfloat16: ``2**-7``, float16: ``2**-10``; each side rounds by at
    most half an ulp), else 0. ``max|leaf|`` is reduced on the leaf's devices."""
    eps = _storage_eps(leaf.dtype)
    return eps * compare.max_abs({"leaf": leaf})["leaf"] if eps else 0.0


def _storage_eps(dtype) -> float:
    """The dtype's eps where it is a floating dtype less precise than float32, else 0."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).eps <= jnp.finfo(jnp.float32).eps:
        return 0.0
    return float(jnp.finfo(dtype).eps)


def _state_allowances(run: _Run, ref_state: dict, bounds) -> None:
    """Accumulate each float optimizer-state leaf's sensitivity to the gradient's tolerance, plus its own
    rounding (:func:`storage_rounding`: bfloat16 moments of bfloat16 parameters), into ``run.state_allowance``."""
    if bounds is None:
        return
    paths = [p for p, r in ref_state.items() if p in bounds.state and np.dtype(r.dtype).kind not in "iub"]
    if paths:
        eps = {p: _storage_eps(ref_state[p].dtype) for p in paths}
        scale = compare.max_abs({p: ref_state[p] for p in paths if eps[p]})  # storage_rounding, in one call
        rounding = {p: eps[p] * scale[p] if eps[p] else 0.0 for p in paths}
        step = {p: bounds.state[p] for p in paths}
        run.state_allowance.update(_accumulated(run.state_allowance, step, {}, rounding))


def _compare_opt_state(run: _Run, t, ref0, cand0, rtol, atol, bounds, after: _After) -> tuple[list, list]:
    leaves, mismatches = [], []
    cand_state, ref_state = after.cand_state, after.ref_state
    _state_allowances(run, {p: r for p, r in ref_state.items() if p in cand_state}, bounds)
    for path, ref_leaf in ref_state.items():
        if path not in cand_state:
            leaves.append(LeafError(t, "opt_state", path, math.inf, math.inf, 0.0, False))
            continue
        r, c = ref_leaf, cand_state[path]
        if np.dtype(r.dtype).kind in "iub":
            leaves.append(counter_error(t, path, r, c))
        else:
            before = cand0.get(path, jnp.zeros_like(r))
            allowance = run.state_allowance.get(path) if bounds is not None and path in bounds.state else None
            r_tol, a_tol = run.tol("opt_state", path, MOMENT_FACTOR * rtol, MOMENT_FACTOR * atol)
            leaves.append(LeafInput(t, "opt_state", path, r, c, r_tol, a_tol, ref0[path], before, allowance))
    differ = replica_mismatches(cand_state)
    mismatches = [f"opt_state {p}" for p in ref_state if p in differ]
    return leaves, mismatches


def _extra_checks(run: _Run, t, completed, rtol, atol) -> list:
    if run.cand.extra_checks is None:
        return []
    out = []
    for path, value, expected in run.cand.extra_checks(run.cand_opt, completed):
        if is_int(value):
            out.append(counter_error(t, path, expected, value))
        else:
            out.append(leaf_error(t, "opt_state", path, to_host(expected), to_host(value), rtol, atol))
    return out


def _matches(
    run: _Run, pre: _PreStep, batch, rtol, atol, record: StepRecord, reference_grads
) -> tuple[str, ...]:
    """The faulty reductions whose step the candidate reproduces (checked on failure; ``reference_grads()``: the
    reference's gradient at ``pre``, computed once for every hypothesis of :func:`_explained`).

    ``per_shard_mean`` (weighted losses): the candidate's parameters and optimizer state match those of the step
    whose gradient is the mean of per-shard means, and the reference's differ from them in some leaf (under Adam
    and bfloat16 compute the parameters' allowance can hide the difference; the moments, unnormalized, show it).
    ``times_S`` / ``times_1/S``: they match the reference optimizer's step on S times (1/S times) the reference's
    gradient: a sum for a mean, a mean taken twice, whatever the optimizer does to the gradient's scale (global-
    norm clipping distorts the factor the moments show), tried when the moments' factor is not already S or 1/S.
    """
    s = run.cand.num_shards
    if not s or s < 2 or run.reference is not None:
        return ()
    found = []
    if run.weighted:
        alt = _per_shard_mean_params(
            run.task.loss_fn, s, pre.graphdef, run.ref_opt.tx, pre.params, pre.rest, pre.opt_state, batch
        )
        if _reproduces(run, *alt, rtol, atol):
            found.append("per_shard_mean")
    factor, _ = _gradient_factor(record)
    if not found and (factor is None or not any(abs(factor - c) <= 1e-3 * c for c in (s, 1 / s))):
        for name, factor in (("times_S", float(s)), ("times_1/S", 1.0 / s)):
            alt = _scaled_params(run.ref_opt.tx, pre.params, pre.opt_state, reference_grads(), factor)
            if _reproduces(run, *alt, rtol, atol):
                found.append(name)
                break
    return tuple(found)


def _reproduces(run: _Run, alt_params, alt_state, rtol, atol) -> bool:
    """Whether the candidate's parameters and optimizer state match an alternative step's, within the usual
    tolerances and allowances, and the reference's do not (host copies: a failing step only)."""
    view = run.cand.view_optimizer or _default_view
    sides = {  # kind: (the alternative, the candidate, the reference, the allowance, the tolerance factor)
        "param": (
            alt_params,
            nnx.state(run.cand_model, nnx.Param),
            nnx.state(run.ref_model, nnx.Param),
            run.allowance,
            1.0,
        ),
        "opt_state": (
            alt_state,
            view(run.cand_opt)[0],
            _opt_state(run.ref_opt),
            run.state_allowance,
            MOMENT_FACTOR,
        ),
    }
    reproduced, differs = True, False
    for kind, (alt, cand, ref, allowance, factor) in sides.items():
        alt, cand, ref = host_tree(alt), host_tree(cand), host_tree(ref)
        for p in alt:
            if p not in cand or p not in ref or is_int(alt[p]):
                continue
            allow = None if allowance.get(p) is None else to_host(allowance[p])
            r_tol, a_tol = factor * rtol, factor * atol
            reproduced &= leaf_error(0, kind, p, alt[p], cand[p], r_tol, a_tol, allowance=allow).ok
            differs |= not leaf_error(0, kind, p, ref[p], alt[p], r_tol, a_tol, allowance=allow).ok
    return reproduced and differs


def _low_precision_reduction(
    run: _Run, pre: _PreStep, batch, record: StepRecord, rtol, atol, reference_grads
) -> bool:
    """Whether a failing float32-compute step is off by no more than a bfloat16 all-reduce's rounding.

    The bound of that rounding, ``2 eps_bf16 sqrt(S) A`` on each gradient element (``A = sum_s |g_s| / W``), is
    propagated through the optimizer like the gradient's own tolerance; the step matches when every failing leaf
    is within it and at least one is off by more than 1/64 of it (an error at bfloat16's scale, not float32's).
    """
    s = run.cand.num_shards
    if run.precision.compute_eps > 0 or not s or s < 2 or run.reference is not None:
        return False
    magnitude, _, _ = _shard_magnitude(run.task.loss_fn, s, pre.graphdef, pre.params, pre.rest, batch)
    grads = reference_grads()
    bound = 2.0 * float(jnp.finfo(jnp.bfloat16).eps) * math.sqrt(s)
    delta = grad_delta(grads, magnitude, rtol, atol, bound)
    updates, states, _ = update_sensitivity(run.ref_opt.tx, grads, pre.opt_state, pre.params, delta)
    allowed = {
        "grad": {k: bound * v for k, v in host_tree(magnitude).items()},
        "param": host_tree(updates),
        "opt_state": host_tree(states),
    }
    used = []
    for e in record.leaves:
        if e.ok or e.kind not in allowed:
            continue
        extra = float(np.max(allowed[e.kind].get(e.path, np.inf), initial=0.0))
        if not e.max_abs_err <= e.tolerance + extra:
            return False
        used.append(e.max_abs_err / max(extra, 1e-30))
    return bool(used) and max(used) > 1 / 64


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads_at(loss_fn, graphdef, params, rest, batch):
    total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
    return grads if weight is None else jax.tree.map(lambda g: g / weight, grads)


def _reference_grads(loss_fn, pre: _PreStep, batch):
    return _grads_at(loss_fn, pre.graphdef, pre.params, pre.rest, batch)


def _compare_step(
    run: _Run,
    t: int,
    batch,
    rtol: float,
    atol: float,
    *,
    completed=None,
    synced=False,
    explain=True,
    check_scale=True,
) -> tuple[StepRecord, bool]:
    """Snapshot both sides, step both on one batch, compare every leaf; returns the record and whether the
    reference stayed finite (:func:`_reference_finite`).

    ``completed``: the candidate's full steps after this one (for ``extra_checks``; default ``t + 1``; 1 for a
    candidate started from the reference's state). ``explain``: on failure, look for the faulty reduction the
    candidate reproduces (:func:`_explained`; the step loop defers it where a re-check may clear the failure).
    ``check_scale``: whether to ask which compared leaves would show a gradient off by S or 1/S
    (:func:`_scale_evidence`; the step loop stops once the steps have shown both, which the verdict needs only
    once).
    """
    view = run.cand.view_optimizer or _default_view
    ref_params0 = device_snapshot(nnx.state(run.ref_model, nnx.Param))
    cand_params0 = device_snapshot(nnx.state(run.cand_model, nnx.Param))
    ref_opt0, cand_opt0 = device_snapshot(_opt_state(run.ref_opt)), device_snapshot(view(run.cand_opt)[0])

    ref_loss, ref_grads, pre, bounds = _step_reference(run, batch, rtol, atol)
    cand_loss, cand_grads = _step_candidate(run, t, batch)

    leaves: list[LeafError] = []
    ref_loss_f = float(np.asarray(ref_loss)) if ref_loss is not None else math.nan
    cand_loss_f = None if cand_loss is None else float(to_host(cand_loss))
    if ref_loss is not None and cand_loss is not None:
        # the parameters' accumulated allowance moves the loss by at most sum |g| * allowance (first order)
        drift = 0.0
        if bounds is not None:
            drift = compare.abs_dot(
                bounds.grads, {p: a for p, a in run.allowance.items() if p in bounds.grads}
            )
        drift += loss_compute_allowance(run.precision, ref_loss_f, run.task.terms(batch))
        r_tol, a_tol = run.tol("loss", "loss", rtol, atol)
        leaves.append(leaf_error(t, "loss", "loss", ref_loss_f, cand_loss_f, r_tol, a_tol, allowance=drift))
    grad_leaves, compared_grads = _grad_inputs(run, t, ref_grads, cand_grads, bounds, rtol, atol)
    leaves += grad_leaves
    after = _After.of(run)
    cand_count = after.cand_count
    params, mismatches, unresolved = _compare_params(
        run, t, ref_params0, cand_params0, rtol, atol, bounds, after
    )
    opt_leaves, opt_mismatches = _compare_opt_state(run, t, ref_opt0, cand_opt0, rtol, atol, bounds, after)
    ref_count = int(np.asarray(run.ref_opt.step[...]))
    leaves += params + opt_leaves
    # every float leaf of the step in one on-device comparison (compare.leaf_errors); the rest as they are
    compared = iter(leaf_errors([e for e in leaves if isinstance(e, LeafInput)]))
    leaves = [next(compared) if isinstance(e, LeafInput) else e for e in leaves]
    leaves.append(counter_error(t, "step", ref_count, cand_count))
    leaves += _extra_checks(run, t, t + 1 if completed is None else completed, rtol, atol)
    evidence, blind = None, False
    if check_scale:
        evidence, blind = _scale_evidence(run, pre, batch, rtol, atol, bounds, after, compared_grads, leaves)
    record = StepRecord(
        step=t,
        rtol=rtol,
        atol=atol,
        loss=ref_loss_f,
        candidate_loss=cand_loss_f,
        leaves=tuple(leaves),
        step_count=ref_count,
        candidate_step_count=int(np.asarray(cand_count)),
        replica_mismatches=tuple(mismatches + opt_mismatches),
        synchronized=synced,
        unresolved=tuple(unresolved),
        scale_hidden=evidence is not None and not all(evidence),
        scale_evidence=evidence,
        scale_blind=blind,
    )
    if not record.ok:
        record = dataclasses.replace(record, replica_axes=_replica_axes(after, record.replica_mismatches))
        if explain:
            record = _explained(run, pre, batch, record, rtol, atol)
    return record, _reference_finite(record, after)


def _grad_inputs(run: _Run, t, ref_grads, cand_grads, bounds, rtol, atol) -> tuple[list, dict]:
    """The gradient leaves to compare (``LeafInput``; a missing one fails) and the compared reference
    gradients, ``{path: leaf}`` (float leaves); both empty unless both sides returned gradients."""
    if ref_grads is None or cand_grads is None:
        return [], {}
    rg, cg = flatten_state(ref_grads), flatten_state(cand_grads)
    leaves = []
    for path, ref_leaf in rg.items():
        if path in cg:
            allowance = None if bounds is None else bounds.grad.get(path)
            r_tol, a_tol = run.tol("grad", path, rtol, atol)
            leaves.append(LeafInput(t, "grad", path, ref_leaf, cg[path], r_tol, a_tol, allowance=allowance))
        else:
            leaves.append(LeafError(t, "grad", path, math.inf, math.inf, 0.0, False))
    return leaves, {p: v for p, v in rg.items() if p in cg and not is_int(v)}


def _explained(run: _Run, pre: _PreStep, batch, record: StepRecord, rtol, atol) -> StepRecord:
    """A failing record with the faulty reductions the candidate reproduces (``StepRecord.matches``), recomputed
    from the reference's pre-step state ``pre``; the run's two sides are after the step."""
    reference_grads = functools.cache(lambda: nnx.as_pure(_reference_grads(run.task.loss_fn, pre, batch)))
    matches = _matches(run, pre, batch, rtol, atol, record, reference_grads)
    if not matches and _low_precision_reduction(run, pre, batch, record, rtol, atol, reference_grads):
        matches = ("bf16_reduction",)
    if {e.kind for e in record.leaves if not e.ok} == {"grad"}:
        # only the exposed gradients fail: a fault the optimizer hides (blind to the gradient's scale) or
        # gradients that were not the ones applied
        if _blind_to_scale(run, pre, reference_grads(), record.leaves):
            matches += ("scale_blind",)
    return dataclasses.replace(record, matches=matches)


# The optimizer is blind to the gradient's scale (global-norm clipping that binds) where a gradient off by a factor
# c moves no leaf by more than this share of |1 - c| times the reference's own change of it (SGD: all of it).
BLIND_RESPONSE = 0.01


def scale_factors(num_shards: int | None) -> tuple[float, float]:
    """``(S, 1 / S)``: the gradient factors of a sum for a mean and of a mean taken twice (S = 2 when unknown)."""
    s = float(num_shards) if num_shards and num_shards > 1 else 2.0
    return s, 1.0 / s


def _grad_evidence(run: _Run, grads: dict, bounds, rtol, atol, factor: float) -> list[str]:
    """The compared gradient leaves (``grads``: ``{path: reference gradient}``) that ``factor`` times the
    reference's gradient would leave: ``|factor - 1| |g|`` beyond the leaf's tolerance (and its compute
    allowance) in some element. No rerun: the scaled gradient is known."""
    if not grads:
        return []
    tols = {p: run.tol("grad", p, rtol, atol) for p in grads}
    allowances = {} if bounds is None else {p: bounds.grad[p] for p in grads if p in bounds.grad}
    hit = compare.exceeds(grads, grads, tols, allowances, scale=factor - 1.0)
    return [f"grad {p}" for p in grads if hit[p]]


def _rerun_evidence(run: _Run, pre: _PreStep, tree, rtol, atol, after: _After, factor: float, changes):
    """The compared parameter and float optimizer-state leaves that the reference's optimizer, rerun from
    ``pre`` on ``factor`` times its gradient ``tree`` (``propagation.scale_change``), would move beyond their
    tolerance and accumulated allowance, by name; each leaf's largest change goes into ``changes`` (``{name: max
    |change|}``, for the blindness test of :func:`_scale_evidence`)."""
    update, state = scale_change(run.ref_opt.tx, tree, pre.opt_state, pre.params, factor)
    params = {
        p: v for p, v in flatten_state(update).items() if p in after.ref_params and p in after.cand_params
    }
    state = {
        p: v
        for p, v in flatten_state(state).items()
        if p in after.ref_state and p in after.cand_state and not is_int(after.ref_state[p])
    }
    found = []
    for kind, moved, refs, allowance, k in (
        ("param", params, after.ref_params, run.allowance, 1.0),
        ("opt_state", state, after.ref_state, run.state_allowance, MOMENT_FACTOR),
    ):
        tols = {p: run.tol(kind, p, k * rtol, k * atol) for p in moved}
        hit = compare.exceeds(moved, refs, tols, {p: allowance[p] for p in moved if p in allowance})
        found += [f"{kind} {p}" for p in moved if hit[p]]
        changes.update({f"{kind} {p}": v for p, v in compare.max_abs(moved).items()})
    return found


def _scale_evidence(run: _Run, pre: _PreStep, batch, rtol, atol, bounds, after: _After, grads: dict, leaves):
    """Which compared leaves would have told the step apart from one whose gradient is off by S, and from one off
    by 1/S: ``((leaves for S, leaves for 1/S), blind)``.

    The hypothesis itself, from this step's pre-step state ``pre``: the compared gradient leaves ``grads`` show a
    factor c where ``|c - 1| |g|`` exceeds their tolerance (:func:`_grad_evidence`); when they do not show it, the
    reference's optimizer is rerun on ``c g`` (:func:`_rerun_evidence`). ``blind``: some factor showed in no leaf
    and moved none by more than :data:`BLIND_RESPONSE` of ``|1 - c|`` times its reference change (the optimizer
    rescales the gradient away: global-norm clipping that binds), rather than by less than its tolerance.
    """
    shown, blind = [], False
    tree = None
    change = {e.name: e.reference_change for e in leaves if e.reference_change is not None}
    for factor in scale_factors(run.cand.num_shards):
        found = _grad_evidence(run, grads, bounds, rtol, atol, factor)
        if not found:
            if tree is None:
                tree = (
                    bounds.grad_tree if bounds is not None else _reference_grads(run.task.loss_fn, pre, batch)
                )
            moved: dict[str, float] = {}
            found = _rerun_evidence(run, pre, nnx.as_pure(tree), rtol, atol, after, factor, moved)
            limit = BLIND_RESPONSE * abs(1.0 - factor)
            blind |= not found and all(m <= limit * change.get(n, 0.0) for n, m in moved.items())
        shown.append(tuple(found))
    return (shown[0], shown[1]), blind


def scale_shown(records) -> tuple[bool, bool]:
    """Whether some step's compared leaves would have shown a gradient off by S, and one off by 1/S
    (``StepRecord.scale_evidence``)."""
    checked = [r.scale_evidence for r in records if r.scale_evidence is not None]
    return any(e[0] for e in checked), any(e[1] for e in checked)


def _blind_to_scale(run: _Run, pre: _PreStep, grads, leaves) -> bool:
    """Whether the reference's optimizer, rerun from ``pre`` on ``S grads`` and ``grads / S``, moves no parameter
    or optimizer-state leaf of ``leaves`` beyond its tolerance."""
    s = run.cand.num_shards
    factor = float(s) if s and s > 1 else 2.0
    moved: dict[str, float] = {}
    for c in (factor, 1 / factor):
        update, state = scale_change(run.ref_opt.tx, grads, pre.opt_state, pre.params, c)
        named = {
            **{f"param {k}": v for k, v in flatten_state(update).items()},
            **{f"opt_state {k}": v for k, v in flatten_state(state).items()},
        }
        for k, v in compare.max_abs(named).items():  # NaN: moved
            moved[k] = min(math.inf if math.isnan(v) else v, moved.get(k, math.inf))
    compared = [e for e in leaves if e.kind in ("param", "opt_state") and e.name in moved]
    return bool(compared) and all(moved[e.name] <= e.tolerance for e in compared)


def _replica_axes(after: _After, mismatched: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes along which the candidate's mismatched copies differ (``topology.mismatch_axes``)."""
    if not mismatched:
        return ()
    arrays = {f"param {k}": v for k, v in after.cand_params.items()}
    arrays.update({f"opt_state {k}": v for k, v in after.cand_state.items()})
    axes = {a for name in mismatched if name in arrays for a in mismatch_axes(arrays[name])}
    return tuple(sorted(axes))


# ------------------------------------------------------------------------------------------------ the harness


def check_options(fn: str, *, rtol, atol, accept_weak, mesh, num_shards) -> int | None:
    """The run's options checked in the order the errors are reported: ``rtol``/``atol``, ``accept_weak``, the
    mesh, the shard count; returns S (``num_shards``, or the mesh's batch shards when only a mesh is given)."""
    _check_tolerances(fn, rtol, atol)
    if not isinstance(accept_weak, bool):
        raise TypeError(f"{fn}: accept_weak must be True or False, got {accept_weak!r}")
    if mesh is not None:
        check_mesh(fn, mesh)
    if num_shards is None and mesh is not None:
        # the batch is split over the batch axes: S = mesh.size unless the mesh has model axes
        num_shards = data_shards(mesh)
    if num_shards is not None:
        num_shards = _validate.check_num_shards(fn, num_shards)
    return num_shards


def _setup(
    fn, candidate, task, *, steps, num_shards, mesh, reference, name, dtypes, leaf_tolerance, initial_state
):
    """Validate everything and build the run; nothing runs and nothing of the caller's changes."""
    if isinstance(task, Task):
        if reference is not None:
            check_reference(fn, reference)
            check_step_signature(fn, "reference", reference, 3, False)
        if initial_state is None:
            model = task.new_model(fn)
            optimizer = task.new_optimizer(model)
        else:
            model, optimizer = initial_state
        data = _task_batches(fn, task, steps)
    else:
        raise TypeError(
            f"{fn}: task must be a shardcheck.Task (or, in the (model, optimizer, batches) form, an nnx.Module), got "
            f"{type(task).__name__}; build one with shardcheck.Task(model=..., optimizer=..., loss_fn=..., batches=...)"
        )
    named = isinstance(candidate, str)
    cand = as_candidate(fn, candidate, task, num_shards, mesh, name)
    weighted = check_model(fn, model, task.loss_fn, data[0])
    _check_weights_accepted(fn, cand, data)
    if named:
        strategy = STRATEGIES[candidate]
        if strategy.check is not None:
            strategy.check(fn, model, optimizer)
        if strategy.placement == "fsdp":  # the annotations and the mesh's axes must fit (no state is changed)
            state_specs(candidate, model, optimizer, mesh_for(fn, strategy, cand.num_shards, mesh), fn=fn)
    if cand.num_shards is not None and (named or cand.name in STRATEGIES):
        for batch in data:
            check_divisible(fn, batch, cand.num_shards, weighted=weighted)
    ref_model, ref_opt = _copy_state(model, optimizer)
    cand_model, cand_opt = _copy_state(model, optimizer)
    if cand.make_optimizer is not None:
        cand_opt = cand.make_optimizer(cand_model, cand_opt)
    kwargs = {"mesh": mesh} if cand.pass_mesh else {}
    precision = Precision.of(model, fn=fn, **dtypes)
    overrides = _check_leaf_tolerance(fn, leaf_tolerance, _leaf_names(model, optimizer))
    # the model's structure is fixed over the run: its float32-compute graph is built once
    graphdef32 = float32_compute(*nnx.split(model, nnx.Param, ...)) if precision.compute_eps > 0 else None
    run = _Run(
        task,
        ref_model,
        ref_opt,
        reference,
        cand,
        cand_model,
        cand_opt,
        kwargs,
        weighted,
        precision,
        overrides,
        graphdef32,
    )
    return run, data


def _leaf_names(model: nnx.Module, optimizer: nnx.Optimizer) -> list[str]:
    """Every name a per-leaf tolerance can take: ``"loss"``, ``"param <path>"``, ``"grad <path>"``,
    ``"opt_state <path>"`` (float leaves)."""
    params = flatten_state(nnx.state(model, nnx.Param))
    state = [k for k, v in flatten_state(_opt_state(optimizer)).items() if not is_int(v)]
    return [
        "loss",
        *(f"{kind} {p}" for kind in ("param", "grad") for p in params),
        *(f"opt_state {p}" for p in state),
    ]


def _tolerance_pair(fn: str, where: str, value) -> tuple[float, float]:
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)
    )
    if not ok:
        raise ValueError(f"{fn}: {where} must be a pair (rtol, atol) of numbers >= 0, got {value!r}")
    return float(value[0]), float(value[1])


def _check_leaf_tolerance(fn, leaf_tolerance, names: list[str]):
    """``leaf_tolerance`` as a table ``name -> (rtol, atol)`` over the task's leaf ``names``
    (:func:`_leaf_names`), checked before anything runs: a mapping's every key must name a leaf (as ``"param
    hidden.kernel"`` or the path alone, which applies to each kind); a callable is called once per name here and
    must return ``None`` or a pair."""
    if leaf_tolerance is None:
        return None
    if isinstance(leaf_tolerance, Mapping):
        table = {}
        for key, value in leaf_tolerance.items():
            pair = _tolerance_pair(fn, f"leaf_tolerance[{key!r}]", value)
            matched = [n for n in names if key in (n, n.split(" ", 1)[-1])] if isinstance(key, str) else []
            if not matched:
                examples = ", ".join(repr(n) for n in names[:4])
                raise ValueError(
                    f"{fn}: leaf_tolerance key {key!r} names no leaf of the task; a key is 'loss', "
                    f"'<kind> <path>' (kind: param, grad, opt_state) or a path alone, e.g. {examples} "
                    f"({len(names)} names); check its spelling"
                )
            for n in matched:
                if n == key or n not in table:  # a full name wins over its bare path
                    table[n] = pair
        return table
    if callable(leaf_tolerance):
        table = {}
        for name in names:
            try:
                value = leaf_tolerance(name)
            except Exception as err:
                raise ValueError(
                    f"{fn}: leaf_tolerance({name!r}) raised {type(err).__name__}: {err}; it is called with one "
                    "leaf name and returns (rtol, atol) or None"
                ) from err
            if value is not None:
                table[name] = _tolerance_pair(fn, f"leaf_tolerance({name!r})", value)
        return table
    raise TypeError(
        f"{fn}: leaf_tolerance must be a mapping {{leaf: (rtol, atol)}} or a callable leaf -> (rtol, atol) | None, "
        f"got {type(leaf_tolerance).__name__}"
    )


def check_reference(fn, reference):
    if not callable(reference):
        raise TypeError(
            f"{fn}: reference must be None (the task's single-device step) or an in-place step, got "
            f"{type(reference).__name__} {reference!r}"
        )


def _check_weights_accepted(fn, cand: Candidate, data):
    if getattr(cand.step, "takes_weights", True) or not any(
        len(b) == 3 for b in data if isinstance(b, tuple)
    ):
        return
    i = next(i for i, b in enumerate(data) if isinstance(b, tuple) and len(b) == 3)
    raise TypeError(
        f"{fn}: batch {i} carries weights but candidate {cand.name!r} takes no weights= argument; add a "
        "weights=None keyword to it, or pass (x, y) batches"
    )


def _param_dtype(model):
    """The least precise floating dtype among the parameters (float32 for shardcheck's models)."""
    dtypes = {jnp.dtype(a.dtype) for a in jax.tree.leaves(nnx.state(model, nnx.Param))}
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)] or [jnp.dtype(jnp.float32)]
    return max(floats, key=lambda d: float(jnp.finfo(d).eps))


def check_parity(
    candidate: StepFn | str | Candidate,
    task: Task,
    *,
    steps: int | None = None,
    num_shards: int | None = None,
    mesh=None,
    reference: StepFn | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    name: str | None = None,
    compute_dtype=None,
    param_dtype=None,
    leaf_tolerance=None,
    accept_weak: bool = False,
    initial_state: tuple[nnx.Module, nnx.Optimizer] | None = None,
) -> ParityReport:
    """Run the task's reference step and a candidate step side by side from one initial state; compare every leaf.

    Both start from independent copies of one fresh model (``task.model()``) and its optimizer and see the same
    batches. After each step the harness compares, per leaf: the pre-update loss; the gradients, when the
    candidate returns an object with ``.grads``; every ``nnx.Param``; every optimizer-state leaf (momentum trace,
    Adam ``mu``/``nu``); and exactly, the integer counters (the NNX ``step``, Adam's ``count``). Replicated
    candidate leaves are checked bitwise across this process's devices. Then the diagnosis explains a failure.
    A first failure at a step t > 0 is re-run from the reference's pre-step state: if that step matches, the
    trajectories diverged through rounding (``PASS (per step)``, ``diverged_trajectory``).

    The ``(model, optimizer, batches)`` form of ``shardcheck.check_parity`` is the seeds' adapter
    (:func:`shardcheck.seeds.parity.check_parity`), which builds the regression task and calls this one.

    Args:
        candidate: a strategy name (``simulation``, ``dp``, ``fsdp``, ``accumulation``, ``multiprocess``; needs
            ``num_shards``), a :class:`~shardcheck.steps.Candidate`, or a user step ``(model, optimizer, batch)
            -> loss`` (``(model, optimizer, batch, mesh)`` when it accepts ``mesh`` and ``mesh`` is given) that
            updates both in place and returns the loss, ``None``, or an object/mapping with ``loss`` and
            optionally ``grads``.
        task: the :class:`~shardcheck.Task`.
        steps: how many of the task's batches to use (default: all).
        num_shards: S: the shard count of a named strategy; lets the diagnosis recognise ratios S and 1/S and
            recompute the mean of per-shard means.
        mesh: passed to mesh strategies (default: the first S devices) and to candidates accepting ``mesh``.
        reference: a step to compare against instead of the task's single-device step (same signature as a
            candidate); gradients are compared only when it returns ``.grads``.
        rtol: fixed relative tolerance for every step (default: derived from the parameters' dtype, the
            reduction length and the step).
        atol: fixed absolute tolerance for every step (default: derived).
        name: the candidate's name in the report.
        compute_dtype: override the compute dtype read from the model's layers (``dtype``), for the tolerance
            (``shardcheck.parity.precision``).
        param_dtype: override the parameters' dtype read from the model, for the tolerance.
        leaf_tolerance: per-leaf ``(rtol, atol)`` for the cases a rule cannot know: a mapping from a leaf name
            (``"param hidden.kernel"``, ``"opt_state 0.mu.bias"``, ``"loss"``; or its path alone) or a callable
            ``name -> (rtol, atol) | None``, called once per leaf name before the run.
        accept_weak: accept a check in which no compared leaf would have shown a gradient off by S or by 1/S
            (:func:`unresolvable`; otherwise the verdict is ``CANNOT VERIFY``); user-set ``rtol``/``atol`` count
            as accepting it.
        initial_state: the ``(model, optimizer)`` both sides start from (copied; nothing of them changes), in
            place of a fresh ``task.model()`` and its optimizer.

    Returns:
        A :class:`~shardcheck.ParityReport`.

    Raises:
        TypeError: ``task`` not a Task; ``accept_weak`` not a bool; ``candidate`` not a name, Candidate or
            callable, or a callable whose signature fits neither form; a malformed ``loss_fn`` output.
        ValueError: a model with batch statistics, or one drawing random numbers in its forward pass (C7); a
            non-finite loss at step 0; ``steps`` larger than the batches; a named strategy with a batch that does
            not split into S equal shards (the message names the leaf and the fix); an unknown strategy; negative
            ``rtol``/``atol``; a ``leaf_tolerance`` key that names no leaf, or a value (or a callable's result)
            that is not a pair of numbers >= 0, or a callable that raises. All checked before any step runs.
        CandidateError: the candidate raised during a step (the original error is its ``__cause__``).
    """
    fn = "check_parity"
    num_shards = check_options(
        fn, rtol=rtol, atol=atol, accept_weak=accept_weak, mesh=mesh, num_shards=num_shards
    )
    run, data = _setup(
        fn,
        candidate,
        task,
        steps=steps,
        num_shards=num_shards,
        mesh=mesh,
        reference=reference,
        name=name,
        dtypes={"compute_dtype": compute_dtype, "param_dtype": param_dtype},
        leaf_tolerance=leaf_tolerance,
        initial_state=initial_state,
    )
    # float32 accumulation under low-precision parameters; their own rounding is added per leaf (precision.py)
    dtype = ACCUMULATION_DTYPE if run.precision.param_eps > 0 else _param_dtype(run.ref_model)

    def tolerances(batch, t):
        derived = derive_tolerance(dtype, batch_size=run.task.terms(batch), step=t)
        return (
            derived.rtol if rtol is None else float(rtol),
            derived.atol if atol is None else float(atol),
            derived,
        )

    records, diverged, diverged_at, reference_diverged_at = _run_steps(run, data, tolerances)
    derived = tolerances(data[0], max(len(records) - 1, 0))
    if rtol is None and atol is None:
        rule = derived[2].rule + _precision_rule(run.precision)
    else:
        rule = f"rtol={derived[0]:g}, atol={derived[1]:g} (user-set where given, else derived; fixed for every step)"
    accepted = accept_weak or rtol is not None or atol is not None
    weak = None if accepted else unresolvable(records, run.cand.num_shards, run.precision)
    findings = diagnose(
        records,
        run.cand.num_shards,
        diverged=diverged,
        reference_diverged_at=reference_diverged_at,
        mesh_shape=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
        micro_batches=run.cand.num_shards if run.cand.make_optimizer is not None else None,
    )
    if weak is not None:
        findings = [Diagnosis("cannot_verify", weak), *[d for d in findings if d.code != "parity"]]
    return ParityReport(
        strategy=run.cand.name,
        ok=bool(records)
        and all(r.ok for r in records)
        and diverged_at is None
        and reference_diverged_at is None
        and weak is None,
        steps=tuple(records),
        diagnoses=tuple(findings),
        cannot_verify=weak,
        scale_evidence=scale_evidence_text(records, run.cand.num_shards),
        num_shards=run.cand.num_shards,
        tolerance_rule=rule,
        diverged_at=diverged_at,
        diverged=diverged,
        reference_diverged_at=reference_diverged_at,
    )


def _precision_rule(precision: Precision) -> str:
    if not precision.low:
        return ""
    parts = []
    if precision.compute_eps > 0:
        parts.append(
            f"compute {precision.compute_dtype.name}: gradients + {COMPUTE_SAFETY:g} * (max|g_S - g| + "
            "|g(p_cand) - g|) (measured: a correct S-shard split in this precision, and the gradient at the "
            f"candidate's parameters) + eps_c * (|g| + sum_s|g_s|) (its output roundings; "
            f"eps_c={precision.compute_eps:.3g})"
        )
    if precision.param_eps > 0:
        parts.append(
            f"params {precision.param_dtype.name}: +eps_p * max|p| per step (eps_p={precision.param_eps:.3g})"
        )
    return "; " + "; ".join(parts) + "; propagated through the optimizer into params and state"


def unresolvable(records, num_shards: int | None, precision: Precision) -> str | None:
    """Why the steps cannot tell the step from one whose gradient is off by S (a sum for a mean) or by 1/S (a
    mean taken twice), or ``None`` (asked unless the user accepted a weak check or set the tolerance).

    Decided by the hypothesis itself (``StepRecord.scale_evidence``): from each step's pre-step state, would the
    compared leaves (the gradients when returned; else the parameters and optimizer state after the reference's
    optimizer rerun on ``S g`` and ``g / S``) have told each factor apart within their tolerances? A factor that
    no step shows makes the verdict ``CANNOT VERIFY``, its text the cause: the parameters never moved (a learning
    rate of 0, the first step of a warm-up), an optimizer blind to the scale (``StepRecord.scale_blind``:
    global-norm clipping that binds), or tolerances too wide for the updates (precision, a tiny learning rate).
    Only for passing runs: a failing one has found its error.
    """
    if not records or not all(r.ok for r in records):
        return None
    shown = scale_shown(records)
    if all(shown):
        return None
    s = int(scale_factors(num_shards)[0])
    times, which = {
        (False, False): (
            f"times {s} or times 1/{s}",
            f"a x{s} or x1/{s} error (a sum for a mean, a mean taken twice)",
        ),
        (True, False): (f"times 1/{s}", f"a x1/{s} error (a mean taken twice; a x{s} one would have failed)"),
        (False, True): (f"times {s}", f"a x{s} error (a sum for a mean; a x1/{s} one would have failed)"),
    }[shown]
    accept = "pass accept_weak=True (verify --accept-weak) to accept the weak check."
    params = [e for r in records for e in r.leaves if e.kind == "param" and e.reference_change is not None]
    if params and all(e.reference_change == 0 for e in params):
        return (
            f"Cannot verify: the reference's parameters did not move in any of the {len(records)} steps checked "
            f"(a learning rate of 0, as at the first step of a warm-up schedule), and no compared leaf would show "
            f"{which}, so a wrong gradient would pass. Check more steps (steps=, verify --steps), past the "
            f"schedule's first, or return the gradients from the step; {accept}"
        )
    checked = [r for r in records if r.scale_evidence is not None]
    if all(r.scale_blind for r in checked):
        return (
            f"Cannot verify the gradient's scale: in every step the optimizer's update and state come out the "
            f"same, within their tolerance, for the gradient {times} (global-norm clipping that binds rescales "
            f"the gradient), and no gradient was compared that shows it, so {which} would pass. "
            "Return the gradients from the step ({'loss': loss, 'grads': grads}), or check with a clipping norm "
            f"above the gradients' norm; {accept}"
        )
    return (
        f"Cannot verify at this precision ({precision.describe()}): in no step would {which} move a compared "
        "leaf (parameters, optimizer state) beyond its tolerance, so such an error would pass. Return the "
        "gradients from the step ({'loss': loss, 'grads': grads}), run the check in float32, or raise the "
        f"learning rate; {accept}"
    )


def scale_evidence_text(records, num_shards: int | None) -> str | None:
    """Which leaves carried the evidence that the step's gradient is not off by S or 1/S: the first step that
    showed each factor and its leaves (``StepRecord.scale_evidence``), or ``None`` when none did."""
    s = int(scale_factors(num_shards)[0])
    found = {}  # (step, leaves): the factors they showed
    for i, label in enumerate((f"x{s}", f"x1/{s}")):
        record = next((r for r in records if r.scale_evidence is not None and r.scale_evidence[i]), None)
        if record is not None:
            found.setdefault((record.step, record.scale_evidence[i]), []).append(label)
    parts = []
    for (step, names), labels in found.items():
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(
            f"a gradient {' or '.join(labels)} would have failed {len(names)} leaf/leaves at step {step} ({listed})"
        )
    return None if not parts else "; ".join(parts) + "."


def _run_steps(run: _Run, data, tolerances):
    """The step loop: trajectory mode, a re-check of the first late failure, then synchronized mode."""
    records: list[StepRecord] = []
    diverged = diverged_at = reference_diverged_at = None
    rechecked = False
    for t, batch in enumerate(data):
        undecided = not all(scale_shown(records))  # the verdict reads the scale until both factors showed
        if diverged_at is None:
            pre = _copy_state(run.ref_model, run.ref_opt) if not rechecked else None
            r_tol, a_tol, _ = tolerances(batch, t)
            recheck = t > 0 and not rechecked  # a failure here is re-checked from identical state first
            record, finite = _compare_step(
                run, t, batch, r_tol, a_tol, explain=not recheck, check_scale=undecided
            )
            if not finite:
                reference_diverged_at = t
                break
            if not record.ok and recheck:
                rechecked = True
                r0, a0, _ = tolerances(batch, 0)
                synced, _ = _compare_step(
                    run.synchronized(*pre), t, batch, r0, a0, completed=1, synced=True, check_scale=undecided
                )
                if synced.ok:
                    diverged, diverged_at, record = record, t, synced
                elif synced.matches:  # a real failure, explained like for like: the re-check's candidate
                    # started from the reference's state before this step, as the hypotheses do
                    record = dataclasses.replace(record, matches=synced.matches)
                else:  # explained from the reference's state before this step
                    record = _explained(run, _PreStep.of(*pre), batch, record, r_tol, a_tol)
        else:
            # After diverged_trajectory: each step starts the candidate from a copy of the reference's state.
            r_tol, a_tol, _ = tolerances(batch, 0)
            record, finite = _compare_step(
                run.synchronized(run.ref_model, run.ref_opt),
                t,
                batch,
                r_tol,
                a_tol,
                completed=1,
                synced=True,
                check_scale=undecided,
            )
            if not finite:
                reference_diverged_at = t
                break
        records.append(record)
    return records, diverged, diverged_at, reference_diverged_at


def assert_step_parity(candidate: StepFn | str | Candidate, task: Task, **kwargs) -> ParityReport:
    """:func:`check_parity`, raising when parity fails: for a user's own pytest suite.

    Args:
        candidate: as :func:`check_parity`.
        task: as :func:`check_parity`.
        **kwargs: ``steps``, ``num_shards``, ``mesh``, ``reference``, ``rtol``, ``atol``, ``name``.

    Returns:
        The passing :class:`~shardcheck.ParityReport` (``PASS`` or ``PASS (per step)``).

    Raises:
        ParityError: an ``AssertionError`` whose message is the report (worst leaf, errors, tolerance,
            diagnosis) and whose ``report`` attribute is the :class:`~shardcheck.ParityReport`.
        TypeError, ValueError: as :func:`check_parity`.
    """
    report = check_parity(candidate, task, **kwargs)
    if not report.step_ok:
        raise ParityError(report)
    return report


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


__all__ = ["ParityError", "ParityReport", "assert_step_parity", "check_parity", "minibatches"]
