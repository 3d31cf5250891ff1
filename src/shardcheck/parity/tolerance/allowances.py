"""The tolerance bookkeeping: how far a correct candidate may differ from the reference, per leaf.

Each reference step gives its :class:`_Bounds` (:func:`step_bounds`): the gradient's compute-rounding allowance
(measured at low precision from a correct S-shard split, :func:`split_gradients`) and the update's and the
optimizer state's sensitivity to the gradient's tolerance, propagated through the optimizer
(``shardcheck.parity.tolerance.propagation``). :func:`_accumulated` sums them over the steps, with each stored leaf's own
rounding (:func:`storage_rounding`); :func:`_precision_rule` is the rule's text at low precision.

The sensitivity pass (the reference's optimizer at 16 points of the gradient's tolerance) runs only where a
verdict reads it (:class:`_Sensitivity`). A step may first be compared against a lower bound of its allowances,
the accumulation with every deferred sensitivity taken as 0 (the allowance adds ``max(sensitivity, floor) >=
floor``, and each float operation is monotone, so the bound is below the exact allowance element by element): a
leaf within tolerance under it is within tolerance under the exact one. A step that the bound clears whole
(:func:`lower_bound`) is recorded with its inputs; the first step it does not clear computes every deferred pass,
in order (:func:`settle`), and is then compared as if none had been deferred.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.comparison import live as compare
from shardcheck.parity.comparison.live import flatten_state, host_tree
from shardcheck.parity.harness.state import _default_view, _PreStep, _Run
from shardcheck.parity.tolerance.matmul import gradients_at
from shardcheck.parity.tolerance.precision import (
    COMPUTE_SAFETY,
    Precision,
    measured_noise,
    output_rounding,
)
from shardcheck.parity.tolerance.propagation import gradient_tolerance, shadow_spread, update_sensitivity
from shardcheck.steps._core import params_value_and_grad
from shardcheck.task import batch_size as leading_size
from shardcheck.task import shards_with_state

MAX_DEFERRED_BYTES = 256 * 2**20
"""The most bytes of device arrays that deferred sensitivity passes hold (each keeps the reference's gradient,
optimizer state and parameters before its step); a step past it settles them (:func:`lower_bound`)."""


class _Sensitivity:
    """The update's and the optimizer state's sensitivity to the gradient's tolerance (``{dotted path: array}``
    each, :func:`~shardcheck.parity.tolerance.propagation.update_sensitivity`, plus the shadow spread at low-precision
    compute), computed on first read (:meth:`get`). Until then it holds its inputs, ``nbytes`` bytes of device
    arrays; ``shapes``: the two trees' ``{path: jax.ShapeDtypeStruct}``, known without computing them."""

    def __init__(self, tx, grads, pre: _PreStep, delta, shadow):
        inputs = (grads, pre.opt_state, pre.params, delta)
        # the shadow's inputs may be the candidate's own buffers, which its next step may donate: its spread is
        # taken now (one optimizer update each side); the reference's own arrays stay as they are (its step
        # donates nothing)
        spread = None if shadow is None else shadow_spread(tx, grads, pre.opt_state, pre.params, *shadow)
        self._inputs = (tx, inputs, spread)
        self._value: tuple[dict, dict] | None = None
        self.nbytes = sum(a.nbytes for a in jax.tree.leaves((inputs, spread)) if isinstance(a, jax.Array))
        self.shapes = _sensitivity_shapes(tx, inputs)

    @property
    def computed(self) -> bool:
        return self._value is not None

    def get(self) -> tuple[dict, dict]:
        """``(update sensitivity, state sensitivity)``, by dotted path (device arrays); computed once."""
        if self._value is None:
            tx, inputs, spread = self._inputs
            updates, states, _ = update_sensitivity(tx, *inputs)
            if spread is not None:
                updates, states = _tree_add((updates, states), spread)
            updates, states = _unless_skipped(inputs[0], (updates, states))
            self._value, self._inputs = (flatten_state(updates), flatten_state(states)), None
        return self._value


@jax.jit
def _unless_skipped(grads, sensitivity):
    """``sensitivity`` (a tree of float arrays), or zeros like it where a leaf of ``grads`` holds a value that is
    not finite: a step whose gradients are not finite is one the reference's optimizer skipped (a loss-scale
    check, ``optax.apply_if_finite``; its parameters and state left as they were) or a divergence the run stops
    at, and a tolerance propagated through a plain optimizer from them is NaN (issue #36 trial 48: a user's
    loss-scale reference over ``optax.sgd``, where an error of 0 read 'max abs err 0 > tolerance nan'). Such a step
    adds no sensitivity: the allowance carries the earlier steps' unchanged."""
    finite = jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)] or [jnp.array(True)])
    )
    return jax.tree.map(lambda s: jnp.where(finite, s, jnp.zeros_like(s)), sensitivity)


# (tx, the inputs' tree structure, their (shape, dtype, weak_type)s) -> _Sensitivity.shapes: the last few
_SHAPES: collections.OrderedDict = collections.OrderedDict()
_SHAPES_KEPT = 16


def _sensitivity_shapes(tx, inputs: tuple) -> tuple[dict, dict]:
    """``update_sensitivity``'s update and state trees as ``{dotted path: jax.ShapeDtypeStruct}`` each, for
    ``inputs`` ``(grads, opt_state, params, delta)``: ``eval_shape`` at the first call for a ``tx`` and the
    inputs' structure, shapes and dtypes, then read again (the same at every step of a run; its ``eval_shape``
    took about 1.6 ms a step on the tiny-lm, its trace cache lookup included, issue #35). The two dicts are
    shared by every call with the same key: read only."""
    leaves, treedef = jax.tree.flatten(inputs)
    try:
        key = (tx, treedef, tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in leaves))
        shapes = _SHAPES.get(key)
    except (AttributeError, TypeError):  # (not seen: a leaf without a shape, an unhashable tx)
        key = shapes = None
    if shapes is None:
        updates, states, _ = update_sensitivity.eval_shape(tx, *inputs)  # traced once per tree, then cached
        shapes = (flatten_state(updates), flatten_state(states))
        if key is not None:
            _SHAPES[key] = shapes
            while len(_SHAPES) > _SHAPES_KEPT:
                _SHAPES.popitem(last=False)
    if key is not None:
        _SHAPES.move_to_end(key)
    return shapes


@dataclasses.dataclass(frozen=True)
class _Bounds:
    """What one reference step lets a correct candidate differ by, per leaf, by dotted path (device arrays, but
    ``grad_max``).

    ``grad``: the compute-rounding allowance of each gradient element (``{}`` at float32); ``update`` and
    ``state``: the sensitivity of the update and of the optimizer state to the gradient's tolerance (computed on
    first read, :class:`_Sensitivity`); ``grad_max``: ``max |g|`` per leaf (floats); ``grads``: the reference's
    gradient, by path and as its tree (``grad_tree``, for :func:`_scale_evidence`); ``loss_realizations``: the
    reference's loss in each measured realization (0-d device arrays: at a compute dtype coarser than float32,
    its loss with every layer in float32; under a coarse matmul precision, with the matmuls at the other
    precision), for the loss's allowance
    (``shardcheck.parity.tolerance.precision.loss_compute_allowance``); ``rounding``: the compute-rounding part
    of ``grad`` alone, without the drift of the candidate's parameters (``|g(p_cand) - g|``, which a diverged
    candidate makes as large as the gradient itself): what tells a gradient at rounding level (``{}`` at
    float32).
    """

    grad: dict
    grad_max: dict
    grads: dict
    grad_tree: Any
    sensitivity: _Sensitivity
    loss_realizations: tuple = ()
    rounding: dict = dataclasses.field(default_factory=dict)

    @property
    def update(self) -> dict:
        return self.sensitivity.get()[0]

    @property
    def state(self) -> dict:
        return self.sensitivity.get()[1]

    @property
    def update_paths(self):
        return self.sensitivity.shapes[0].keys()

    @property
    def state_paths(self):
        return self.sensitivity.shapes[1].keys()


def _noise_shards(num_shards: int | None, batch) -> int:
    """The split whose gradient measures the compute noise: the candidate's S, else 2 (1 if B is odd)."""
    s = num_shards if num_shards and num_shards > 1 else 2
    return s if leading_size(batch) % s == 0 else 1


def _shard_magnitude(loss_fn, num_shards, graphdef, params, rest, batch, reduce_dtype=None):
    """:func:`_split_magnitude` with the whole non-parameter state ``rest`` in every shard, or where the model
    does not trace so (a per-row carried state, issue #36 trial 12) with each shard's rows of it
    (:func:`~shardcheck.task.shards_with_state`).

    Raises:
        TypeError, ValueError: the model traces on a shard neither way (the shape error of the second try).
    """
    try:
        return _split_magnitude(loss_fn, num_shards, graphdef, False, params, rest, batch, reduce_dtype)
    except (TypeError, ValueError):  # a shape error at trace time: a state shaped by the full batch
        return _split_magnitude(loss_fn, num_shards, graphdef, True, params, rest, batch, reduce_dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 7))
def _split_magnitude(loss_fn, num_shards, graphdef, per_row, params, rest, batch, reduce_dtype=None):
    """``(A, g_S, g_S')``: ``A = sum_s |grad loss_sum_s| / W`` (W the total weight, or S for a scalar loss), the
    scale of the terms a sharded step reorders; ``g_S = sum_s grad loss_sum_s / W``, the gradient of a correct
    S-shard split computed in the model's own precision, its sum over shards in the gradients' dtype
    (``shardcheck.parity.tolerance.precision``); and ``g_S'``, the same split with each shard's gradient rounded to
    ``reduce_dtype`` and summed in it (how a GSPMD-partitioned bfloat16 backward pass all-reduces its partial
    products; ``None`` when ``reduce_dtype`` is ``None``). float32 trees."""
    low = jnp.float32 if reduce_dtype is None else reduce_dtype

    xs, at = shards_with_state(batch, rest, num_shards, per_row)

    def shard(acc, x):
        shard_batch, shard_rest = at(x)
        total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, shard_rest, shard_batch)
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
    summed, weights = jax.lax.scan(shard, zeros, xs)
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


def _committed(tree):
    """``tree``'s arrays committed to their own placement (the same buffers, no copy). The gradient's tolerance
    takes the reference's gradient committed at every step: a step whose candidate drifted brings committed
    arrays (:func:`_like`), and a program called with committed arguments after uncommitted ones compiles again
    (``measured_noise``, ``gradient_tolerance``, ``update_sensitivity``, ``_accumulate``: once each, not twice)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, jax.device_put(leaves, [a.sharding for a in leaves]))


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


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads_at(loss_fn, graphdef, params, rest, batch):
    total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
    return grads if weight is None else jax.tree.map(lambda g: g / weight, grads)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_grads_at(loss_fn, graphdef, params, rest, batch):
    """``(loss, grads)``: the task's mean loss (0-d; the weighted sum over the total weight) and its gradient (a
    tree like ``params``), in one program: with ``graphdef`` computing in float32
    (``shardcheck.parity.tolerance.precision.float32_compute``), the realization of the reference's loss whose
    distance from the low-precision one measures the loss's compute noise (issue #36 trial 15)."""
    total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
    if weight is None:
        return total, grads
    return total / weight, jax.tree.map(lambda g: g / weight, grads)


def _reference_grads(loss_fn, pre: _PreStep, batch):
    return _grads_at(loss_fn, pre.graphdef, pre.params, pre.rest, batch)


# Tree arithmetic in one compiled call per tree: eagerly, each operation on a new leaf shape compiles a program
# of its own (XLA:CPU: 40-80 ms each; 60 leaves' additions took 4.6 s eagerly, 1.2 s as one jitted tree).
_tree_add = jax.jit(functools.partial(jax.tree.map, jnp.add))


def _accumulated(before: dict, step: dict, floor: dict, rounding: dict) -> dict:
    """Per path of ``step``: ``before + max(step, floor) + rounding``, the allowance accumulated over the steps
    (``before`` lacks a path on a run's first step, ``floor`` where there is none: ``step`` is a sensitivity,
    >= 0). Paths of ``before`` that ``step`` lacks are left out.

    Every call with one ``step`` tree runs one compiled program (:func:`_accumulate`): the missing entries are
    filled, and flagged where they are not added."""
    fresh = {p: p not in before for p in step}
    return _accumulate(
        {p: step[p] if fresh[p] else before[p] for p in step},
        step,
        {p: floor.get(p, 0.0) for p in step},
        rounding,
        fresh,
    )


@jax.jit
def _accumulate(before: dict, step: dict, floor: dict, rounding: dict, fresh: dict) -> dict:
    def one(p, s):
        # a sensitivity that is not a number adds none (never a NaN tolerance: an error of 0 against it fails)
        s = jnp.maximum(jnp.where(jnp.isnan(s), 0.0, s), floor[p])
        return jnp.where(fresh[p], s, before[p] + s) + rounding[p]

    return {p: one(p, s) for p, s in step.items()}


DEFER = True
"""Whether a step is compared against the lower bound before its sensitivity pass runs (:func:`lower_bound`);
``False`` runs every pass at its step (the tests check that both give the same verdicts)."""


class Undecided(Exception):
    """Raised inside a lower-bound comparison that the bound cannot decide: the step is compared again with the
    exact allowances (:func:`settle`)."""


@dataclasses.dataclass
class _Deferred:
    """The accumulations whose sensitivity has not been computed: the run's exact allowances before the first of
    them, then per accumulation ``(kind, bounds, paths, floor, rounding)`` (:func:`accumulate`'s arguments);
    ``nbytes``: what their inputs hold; ``trying``: the number of accumulations before the step being tried."""

    allowance: dict
    state_allowance: dict
    steps: list = dataclasses.field(default_factory=list)
    nbytes: int = 0
    trying: int | None = None


def lower_bound(run: _Run, bounds: _Bounds | None, exact: bool) -> bool:
    """Whether this step is compared against the lower bound first; if so, the trial begins (ended by
    :func:`keep` or :func:`settle`).

    Not for a step whose verdict reads the exact allowances anyway (``exact``: the first step, whose ratios the
    report reads, and the steps that look for the gradient-scale evidence), without bounds (a user's reference
    step), on the candidate's mesh (what the devices hold is measured), past :data:`MAX_DEFERRED_BYTES`, at low
    precision (the propagated compute noise and parameter rounding are what cover a correct step there: the bound
    fell short at the first step it was tried on under both bfloat16 policies), or in a run where the bound fell
    short (``state.BoundStats``).

    A step whose sensitivity another check of a ``verify`` already computed (a shared reference step) is tried
    all the same: a check's report does not depend on the checks before it."""
    if not DEFER or exact or bounds is None or run.footprint is not None:
        return False
    if run.precision.low or run.bound_stats.short:
        return False
    held = 0 if run.deferred is None else run.deferred.nbytes
    if held + bounds.sensitivity.nbytes > MAX_DEFERRED_BYTES:
        return False
    if run.deferred is None:
        run.deferred = _Deferred(dict(run.allowance), dict(run.state_allowance))
    run.deferred.trying = len(run.deferred.steps)
    run.deferred.nbytes += bounds.sensitivity.nbytes
    return True


def keep(run: _Run) -> None:
    """End a trial that cleared its step: its accumulations stay deferred."""
    run.deferred.trying = None


def fell_short(run: _Run) -> None:
    """Note a step that the bound did not clear and the exact allowances passed (``state.BoundStats``)."""
    run.bound_stats.short += 1


def settle(run: _Run) -> None:
    """Compute every deferred sensitivity and replay the accumulations in order, from the exact allowances before
    the first: the run's allowances are then the ones computed step by step (a trial's own accumulations are
    dropped; its step is compared again)."""
    deferred, run.deferred = run.deferred, None
    if deferred is None:
        return
    steps = deferred.steps if deferred.trying is None else deferred.steps[: deferred.trying]
    for ledger, base in (
        (run.allowance, deferred.allowance),
        (run.state_allowance, deferred.state_allowance),
    ):
        ledger.clear()
        ledger.update(base)
    for args in steps:
        accumulate(run, *args)


def accumulate(run: _Run, kind: str, bounds: _Bounds, paths: list, floor: dict, rounding: dict) -> None:
    """Add one step's allowance to the run's (``kind`` ``"param"``: ``run.allowance``; ``"state"``:
    ``run.state_allowance``) by :func:`_accumulated`: the step's sensitivity, or 0 during a trial, where the
    accumulation is deferred (replayed by :func:`settle`)."""
    if not paths:
        return
    ledger = run.allowance if kind == "param" else run.state_allowance
    if run.deferred is not None and run.deferred.trying is not None:
        run.deferred.steps.append((kind, bounds, paths, floor, rounding))
        if _adds_nothing(ledger, paths, floor, rounding):
            return
        shapes = bounds.sensitivity.shapes[0 if kind == "param" else 1]
        # host zeros: :func:`_accumulate` takes them as it takes the device's (no program of their own)
        step = {p: np.zeros(shapes[p].shape, shapes[p].dtype) for p in paths}
    else:
        sensitivity = bounds.update if kind == "param" else bounds.state
        step = {p: sensitivity[p] for p in paths}
    ledger.update(_accumulated(ledger, step, floor, rounding))


def _adds_nothing(ledger: dict, paths: list, floor: dict, rounding: dict) -> bool:
    """Whether a trial's accumulation (a step of zeros) leaves ``ledger`` as it is, bit for bit, so that its
    :func:`_accumulate` call (one argument per leaf and field: ~3 ms a step for the tiny-lm's optimizer state,
    issue #35) can be skipped: every path already held (none fresh), no floor and no rounding, where
    ``before + max(0, 0) + 0`` is ``before`` (an allowance is never -0: each is a sum ending in ``+ rounding``)."""
    return not floor and all(p in ledger for p in paths) and not any(rounding.get(p, 0.0) for p in paths)


def storage_rounding(leaf) -> float:
    """How far two correct runs' copies of a stored leaf may differ by its own rounding: ``eps * max|leaf|`` for
    a floating dtype less precise than float32 (bfloat16: ``2**-7``, float16: ``2**-10``; each side rounds by at
    most half an ulp), else 0. ``max|leaf|`` is reduced on the leaf's devices."""
    eps = _storage_eps(leaf.dtype)
    return eps * compare.max_abs({"leaf": leaf})["leaf"] if eps else 0.0


@functools.lru_cache(maxsize=64)
def _storage_eps(dtype) -> float:
    """The dtype's eps where it is a floating dtype less precise than float32, else 0 (once per dtype: a check
    asks it of every optimizer-state leaf at every step)."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).eps <= jnp.finfo(jnp.float32).eps:
        return 0.0
    return float(jnp.finfo(dtype).eps)


def _state_allowances(run: _Run, ref_state: dict, bounds) -> None:
    """Accumulate each float optimizer-state leaf's sensitivity to the gradient's tolerance, plus its own
    rounding (:func:`storage_rounding`: bfloat16 moments of bfloat16 parameters), into ``run.state_allowance``."""
    if bounds is None:
        return
    tracked = bounds.state_paths
    paths = [p for p, r in ref_state.items() if p in tracked and np.dtype(r.dtype).kind not in "iub"]
    if paths:
        eps = {p: _storage_eps(ref_state[p].dtype) for p in paths}
        scale = compare.max_abs({p: ref_state[p] for p in paths if eps[p]})  # storage_rounding, in one call
        rounding = {p: eps[p] * scale[p] if eps[p] else 0.0 for p in paths}
        accumulate(run, "state", bounds, paths, {}, rounding)


def _precision_rule(precision: Precision) -> str:
    if not precision.low:
        return ""
    parts = []
    if precision.compute_eps > 0:
        what = (
            f"matmuls {precision.matmul}"
            if precision.matmul_coarser
            else f"compute {precision.compute_dtype.name}"
        )
        g_r, measured = (
            ("g_M", "the reference's gradient with its matmuls at the other precision")
            if precision.matmul_coarser
            else ("g_S", "a correct S-shard split in this precision")
        )
        parts.append(
            f"{what}: gradients + {COMPUTE_SAFETY:g} * (max|{g_r} - g| + |g(p_cand) - g|) (measured: {measured}, "
            "and the gradient at the candidate's parameters) + eps_c * (|g| + sum_s|g_s|) (its output roundings; "
            f"eps_c={precision.compute_eps:.3g})"
        )
        loss = "eps_c * |loss| / sqrt(n)"
        if precision.matmul_coarser:
            loss += f" + {COMPUTE_SAFETY:g} * |loss_M - loss| (loss_M: the reference's loss at the other precision)"
        else:
            loss += f" + {COMPUTE_SAFETY:g} * |loss_32 - loss| (loss_32: the reference's loss computed in float32)"
        parts.append(f"loss + {loss}")
    if precision.param_eps > 0:
        parts.append(
            f"params {precision.param_dtype.name}: +eps_p * max|p| per step (eps_p={precision.param_eps:.3g})"
        )
    return "; " + "; ".join(parts) + "; propagated through the optimizer into params and state"


def _param_dtype(model):
    """The least precise floating dtype among the parameters (float32 for shardcheck's models)."""
    dtypes = {jnp.dtype(a.dtype) for a in jax.tree.leaves(nnx.state(model, nnx.Param))}
    floats = [d for d in dtypes if jnp.issubdtype(d, jnp.floating)] or [jnp.dtype(jnp.float32)]
    return max(floats, key=lambda d: float(jnp.finfo(d).eps))


def split_gradients(run: _Run, pre: _PreStep, batch):
    """At low-precision compute, :func:`_shard_magnitude` of a correct split of ``batch`` from the reference's
    pre-step state ``pre``: ``(A, g_S, g_S')``; else ``None``."""
    if run.precision.compute_eps > 0:
        # a loss that couples the rows has no correct per-shard split: the full batch, unsplit
        shards = 1 if run.rows_coupled else _noise_shards(run.cand.num_shards, batch)
        # a correct split reduces its shards' gradients in float32 (shard_map) or, as GSPMD's partitioned
        # backward pass may, in the compute dtype: both realizations bound the compute noise
        low = run.precision.compute_dtype
        low = None if _storage_eps(low) == 0 else low  # float32 compute under a coarser matmul precision
        return _shard_magnitude(run.task.loss_fn, shards, pre.graphdef, pre.params, pre.rest, batch, low)
    return None


def step_bounds(run: _Run, pre: _PreStep, batch, grads, split, rtol: float, atol: float) -> _Bounds:
    """The :class:`_Bounds` of the reference's step from ``pre`` whose gradient is ``grads`` (pure), with the
    correct split ``split`` (:func:`split_gradients`) at low-precision compute."""
    noise = rounding = None
    shadow = None
    losses = ()
    if run.precision.compute_eps > 0:
        magnitude, split_grads, split_low = split
        shadow = _shadow_inputs(run, pre, batch)
        grads = _committed(grads)
        drifted = grads if shadow is None else _committed(shadow[0])
        realizations = [g for g in (split_grads, split_low) if g is not None]
        if run.graphdef32 is not None:  # every layer in float32: the reference's loss and gradient, unrounded
            loss_32, grads_32 = _loss_grads_at(run.task.loss_fn, run.graphdef32, pre.params, pre.rest, batch)
            realizations.append(grads_32)
            losses += (loss_32,)
        if run.matmul_realization is not None:  # the reference's loss and gradient at the other precision
            loss_m, grads_m = gradients_at(
                run.task.loss_fn, pre.graphdef, pre.params, pre.rest, batch, run.matmul_realization
            )
            realizations.append(grads_m)
            losses += (loss_m,)
        output = output_rounding(grads, magnitude, run.precision.compute_eps)
        noise = _tree_add(measured_noise(realizations, grads, drifted), output)
        # the rounding alone, without the candidate's parameter drift: what tells a gradient at rounding level
        rounding = noise if shadow is None else _tree_add(measured_noise(realizations, grads, grads), output)
    delta, grad_max, extra = gradient_tolerance(grads, noise, rtol, atol)
    grad_allowance = {} if extra is None else flatten_state(extra)
    # the allowances stay on the device: the comparison reduces them there (compare.leaf_errors)
    return _Bounds(
        grad_allowance,
        {k: float(v) for k, v in jax.device_get(flatten_state(grad_max)).items()},
        flatten_state(grads),
        grads,
        _Sensitivity(run.ref_opt.tx, grads, pre, delta, shadow),
        losses,
        {} if rounding is None else flatten_state(rounding),
    )
