"""The two sides of a parity run and their state: the run itself (:class:`_Run`), the reference's state before a
step (:class:`_PreStep`) and both sides' state after it (:class:`_After`), and independent copies of a model and
its optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from shardcheck._tree import copy_state
from shardcheck.parity.comparison.live import flatten_state
from shardcheck.parity.comparison.model_state import set_model_state
from shardcheck.parity.tolerance.precision import Precision
from shardcheck.steps import Candidate
from shardcheck.task import Task

PyTree = Any


StepFn = Callable[..., Any]


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass
class _Found:
    """The Variables of one graph object's state (``nnx.state(obj, ...)``, or ``nnx.split`` of it), found by one
    graph traversal and read at every later step without another (an NNX graph flatten of the tiny-lm's model
    and optimizer takes milliseconds, and the harness read both sides several times a step). Valid while the
    object's steps write their new values into the same Variables, as ``nnx.update`` and
    ``nnx.Optimizer.update`` do: the steps of the task and of the registered strategies (:attr:`_Run.in_place`).

    ``paths``: :func:`flatten_state`'s dotted paths, in the order of ``variables``; ``treedef``: the state's
    structure with a Variable at each leaf; ``graphdef``: ``nnx.split``'s, where the state came from it."""

    obj: Any
    paths: list[str]
    variables: list[nnx.Variable]
    treedef: Any
    graphdef: Any = None

    @staticmethod
    def of(obj, state, graphdef=None) -> _Found | None:
        """``None`` where a Variable is not one leaf of ``state`` (its paths would not pair with the Variables)."""
        variables, treedef = jax.tree.flatten(state, is_leaf=_is_variable)
        paths = list(flatten_state(state))
        if len(paths) != len(variables) or not all(map(_is_variable, variables)):
            return None
        return _Found(obj, paths, variables, treedef, graphdef)

    def values(self) -> list:
        return [v.get_raw_value() for v in self.variables]

    def flat(self) -> dict[str, Any]:
        """``flatten_state(nnx.state(obj, ...))`` as the state is now: ``{dotted path: array}``."""
        return dict(zip(self.paths, self.values(), strict=True))


def _found(run: _Run | None, key: str, obj, state_fn: Callable[[], Any]) -> dict[str, Any]:
    """``flatten_state(state_fn())``, ``state_fn`` reading ``obj``'s state: found once per object and ``key`` in
    ``run.found`` where the run's steps update in place (:attr:`_Run.in_place`), else traversed every time."""
    if run is None or not run.in_place:
        return flatten_state(state_fn())
    entry = run.found.get(key)
    if entry is None or entry.obj is not obj:
        state = state_fn()
        entry = _Found.of(obj, state)
        if entry is None:
            return flatten_state(state)
        run.found[key] = entry
    return entry.flat()


def stepped_in_place(run: _Run, key: str, jitted, static: tuple, model, optimizer, *args):
    """:func:`shardcheck.steps._core.run_in_place` for a run whose steps update in place (:attr:`_Run.in_place`):
    the pair's Variables found once (``run.found[key]``), their arrays passed to ``jitted`` and its new state
    written into them as ``nnx.update`` writes it (``Variable.update_from_state``), without the graph traversals
    of ``nnx.split`` and ``nnx.update`` at every step (about 4 and 2.6 ms for the tiny-lm's model and optimizer,
    as much as its step's arithmetic on CPU). The same program on the same values: the same results."""
    entry = run.found.get(key)
    if entry is None or entry.obj is not model or entry.graphdef is None:
        graphdef, state = nnx.split((model, optimizer))
        entry = _Found.of(model, state, graphdef)
        if entry is None:  # (not seen: a Variable of several leaves)
            out, state = jitted(*static, graphdef, state, *args)
            nnx.update((model, optimizer), state)
            return out
        run.found[key] = entry
    # the state as ``nnx.split`` gives it, over the pair's own Variables: the program ``run_in_place`` calls
    out, state = jitted(*static, entry.graphdef, jax.tree.unflatten(entry.treedef, entry.variables), *args)
    new = jax.tree.leaves(state, is_leaf=_is_variable)
    for variable, value in zip(entry.variables, new, strict=True):
        variable.update_from_state(value)
    return out


class _Kept:
    """A model and optimizer holding given ones' state as it was when kept (:func:`_kept_state`): the graph
    objects are built from the kept arrays when first unpacked (``model, optimizer = kept``), which a step loop
    does only to re-check a failing step."""

    def __init__(self, graphdef, state):
        self._parts = (graphdef, state)
        self._objects = None

    def __iter__(self):
        if self._objects is None:
            self._objects = nnx.merge(*self._parts)
        return iter(self._objects)


def _kept_state(model: nnx.Module, optimizer: nnx.Optimizer, *, copy: bool, run: _Run | None = None):
    """A model and optimizer holding the given ones' state as it is now (unpack it: ``model, optimizer =
    kept``): new graph objects with new Variables over the same buffers (nothing is copied: a later step that
    does not donate them leaves them as they are, and writes its new values into the given ones' Variables, not
    these), or copies with ``copy`` (a step that may donate them: a user's reference step). The graph objects are
    built when first unpacked, which a step loop does only to re-check a failing step.

    With ``run`` (whose steps update in place, :attr:`_Run.in_place`) the pair's Variables are found once and
    their arrays read at each later call."""
    if copy:
        return copy_state(model, optimizer)
    entry = None if run is None or not run.in_place else run.found.get("kept")
    if entry is None or entry.obj is not model or entry.graphdef is None:
        graphdef, state = nnx.split((model, optimizer))
        entry = _Found.of(model, state, graphdef)
        if entry is None:  # (not seen: a Variable of several leaves) its arrays as they are now
            return _Kept(graphdef, nnx.as_pure(state))
        if run is not None and run.in_place:
            run.found["kept"] = entry
    return _Kept(entry.graphdef, jax.tree.unflatten(entry.treedef, entry.values()))


def _opt_state(optimizer: nnx.Optimizer) -> PyTree:
    """The optimizer's ``opt_state`` sub-state (``{}`` for a stateless transformation such as ``optax.sgd``)."""
    state = nnx.state(optimizer)
    return state["opt_state"] if "opt_state" in state else {}


def _default_view(optimizer: nnx.Optimizer) -> tuple[PyTree, Any]:
    return _opt_state(optimizer), optimizer.step[...]


@dataclasses.dataclass(frozen=True)
class _PreStep:
    """The reference's state before a step, kept on device for the sensitivity and the hypotheses."""

    graphdef: Any
    params: PyTree
    rest: PyTree
    opt_state: PyTree

    @staticmethod
    def of(model, optimizer, run: _Run | None = None) -> _PreStep:
        """The state of ``model`` and ``optimizer`` now, as values (``rest`` too: a step that writes the model's
        state in place leaves them as they were); with ``run`` (whose steps update in place,
        :attr:`_Run.in_place`) the model's graph is traversed at its first call only: its graph definition and
        the State of its other Variables (the same Variables at every step) are kept, their values read."""
        entry = None if run is None or not run.in_place else run.found.get("pre_step")
        if entry is None or entry[0] is not model:
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            found = _Found.of(model, params, graphdef)
            if run is not None and run.in_place and found is not None:
                run.found["pre_step"] = (model, found, rest)
            return _PreStep(
                graphdef, nnx.as_pure(params), nnx.as_pure(rest), nnx.as_pure(optimizer.opt_state)
            )
        _, found, rest = entry
        params = jax.tree.unflatten(found.treedef, found.values())
        # the values now: the Variables are the model's own, and a forward pass that writes its state (a carried
        # hidden state, a counter) writes them in place during the step (trial 12: the hypotheses read the
        # post-step carry)
        return _PreStep(found.graphdef, params, nnx.as_pure(rest), _opt_values(run, optimizer))


def _opt_values(run: _Run, optimizer: nnx.Optimizer) -> PyTree:
    """``nnx.as_pure(optimizer.opt_state)`` for a run whose steps update in place: its Variables found once
    (``run.found["pre_opt"]``, while ``opt_state`` is the same object) and their values read (no tree map over
    the optimizer's state a step, issue #35)."""
    opt_state = optimizer.opt_state
    entry = run.found.get("pre_opt")
    if entry is None or entry.obj is not opt_state:
        entry = _Found.of(opt_state, opt_state)
        if entry is None:  # (not seen: a leaf that is not one Variable of one array)
            return nnx.as_pure(opt_state)
        run.found["pre_opt"] = entry
    return jax.tree.unflatten(entry.treedef, entry.values())


@dataclasses.dataclass
class BoundStats:
    """How a run's steps fared against the allowances' lower bound (``parity.allowances.lower_bound``): ``short``,
    the steps it did not clear although the exact allowances passed them. A run stops trying the bound after one
    such step: there the propagated sensitivity is what covers a correct step, so each later trial would only
    repeat the comparison."""

    short: int = 0


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
    last: Any = None  # the _After of this run's last step: its state before the next step (no re-flatten)
    shared: Any = None  # the task's shared reference trajectory (parity.reference_trajectory), or None
    # a registered strategy stepping the reference side in place of the single-device step (same mesh as the
    # candidate; its sensitivity and hypotheses are the reference's), and how the report names the reference
    ref_strategy: Candidate | None = None
    reference_name: str = "reference"
    # the RNG streams the model's forward pass draws from (task.check_model's drawn: "rngs.noise"), for the report
    draws: tuple[str, ...] = ()
    # the batch statistics the forward pass writes (nnx.BatchStat in training mode: "bn.mean"), for the report
    batch_stats: tuple[str, ...] = ()
    # the RNG streams the task's forward pass does not draw from: a count the candidate moves there is reported
    undrawn: tuple[str, ...] = ()
    # what the devices hold, sampled during a check on the candidate's mesh (parity.footprint.Footprint), or None
    footprint: Any = None
    # the accumulations whose sensitivity pass is deferred (parity.allowances._Deferred), or None
    deferred: Any = None
    # how the allowances' lower bound fared, shared with the synchronized runs
    bound_stats: BoundStats = dataclasses.field(default_factory=BoundStats)
    # how the matmul precision was chosen, and the policy at which the reference's gradient is recomputed to
    # measure its rounding (parity.matmul.resolve), or None where the matmuls round no more than the compute dtype
    matmul_source: str = ""
    matmul_realization: str | None = None
    # whether both sides' steps write their new state into their Variables in place (the task's step, the
    # registered strategies): their Variables are then found once and read at each step (_Found, by key)
    in_place: bool = False
    found: dict = dataclasses.field(default_factory=dict)
    # the reference's and the candidate's floating non-parameter state before the step being compared (host
    # copies, parity.comparison.model_state.floating_state), and the paths of it the task's loss reads
    # (model_state.loss_reads, once per check)
    state_before: tuple = (None, None)
    state_read: frozenset | None = None
    # the paths (``model.<path>``) of that state the task's loss writes (model_state.loss_access; None: not known)
    state_written: frozenset | None = None
    # the reference's integer model state before the step being compared (host copies) with the paths of it the
    # task's loss reads or writes (``(before, touched)`` for model_state_leaves' counters; None for a model
    # without), and those paths alone (model_state.loss_counters, once per check)
    counters_before: tuple | None = None
    counters_touched: frozenset | None = None
    # what a failing step's hypotheses read more than once (both sides' host copies, each row's gradient), while
    # they are tried (parity.diagnosis.hypotheses._explained: {key: value}, filled at each first read; read_once)
    step_reads: dict | None = None
    # the task's loss couples the rows of a batch (parity.harness.row_coupling, probed at low-precision compute
    # only): its loss run per shard is another loss, so no split of it measures a correct step's rounding
    rows_coupled: bool = False
    # the parameters whose update the task's optimizer normalizes (recorded.normalized_params), probed once per
    # check where a step first has unresolved leaves
    normalized: frozenset | None = None
    # (treedef, paths) of the reference's parameters and optimizer state (optimizer_rerun._layouts), found once
    layouts: tuple | None = None
    # whether the task's optimizer reruns on (grads, state, params) alone (optimizer_rerun.verifies_update), once
    rerunnable: bool | None = None
    # the update check's inputs of the step being compared, with what they were built from (optimizer_rerun's
    # _rerun_inputs: asked twice a step), and, where the steps update in place (the shapes fixed), whether the
    # candidate's state is small enough for the check at every step (optimizer_rerun.checks_step), once per check
    rerun_inputs: tuple | None = None
    checks_every_step: bool | None = None

    def read_once(self, key: str, build):
        """``build()``, once while a failing step's hypotheses are tried (``step_reads`` is a dict), else at each
        call."""
        if self.step_reads is None:
            return build()
        if key not in self.step_reads:
            self.step_reads[key] = build()
        return self.step_reads[key]

    def tol(self, kind: str, path: str, rtol: float, atol: float) -> tuple[float, float]:
        """The leaf's ``(rtol, atol)``: the user's per-leaf override when one applies, else the derived ones."""
        if self.leaf_tolerance is None:
            return rtol, atol
        return self.leaf_tolerance.get("loss" if kind == "loss" else f"{kind} {path}", (rtol, atol))

    def synchronized(
        self, ref_model: nnx.Module, ref_opt: nnx.Optimizer, carried: dict | None = None
    ) -> _Run:
        """A run whose candidate starts from a copy of the given reference state (model and optimizer).

        The reference side is this run's own (stepped in place) when ``ref_model`` is ``self.ref_model``, else a
        copy; the allowance starts from zero (one step from identical state). ``carried``: the candidate's own
        values of integer model state the check does not take from the reference (``{dotted path: array}``: a
        counter only the candidate's step keeps, ``check._carried_counters``), written into its copy.
        """
        if ref_model is self.ref_model:
            r_model, r_opt = self.ref_model, self.ref_opt
        else:
            r_model, r_opt = copy_state(ref_model, ref_opt)
        c_model, c_opt = copy_state(ref_model, ref_opt)
        if carried:
            set_model_state(c_model, carried)
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
            last=None,
            deferred=None,
            found={},
            rerun_inputs=None,
        )


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
        if run.cand.view_optimizer is None:
            cand_state = _found(run, "cand_state", run.cand_opt, lambda: _opt_state(run.cand_opt))
            cand_count = run.cand_opt.step[...]
        else:
            cand_view, cand_count = run.cand.view_optimizer(run.cand_opt)
            cand_state = flatten_state(cand_view)
        return _After(
            _found(run, "ref_params", run.ref_model, lambda: nnx.state(run.ref_model, nnx.Param)),
            _found(run, "cand_params", run.cand_model, lambda: nnx.state(run.cand_model, nnx.Param)),
            _found(run, "ref_state", run.ref_opt, lambda: _opt_state(run.ref_opt)),
            cand_state,
            cand_count,
        )
