"""The two sides of a parity run and their state: the run itself (:class:`_Run`), the reference's state before a
step (:class:`_PreStep`) and both sides' state after it (:class:`_After`), and independent copies of a model and
its optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from shardcheck._tree import copy_state
from shardcheck.parity.comparison.live import flatten_state
from shardcheck.parity.tolerance.precision import Precision
from shardcheck.steps import Candidate
from shardcheck.task import Task

PyTree = Any


StepFn = Callable[..., Any]


def _kept_state(
    model: nnx.Module, optimizer: nnx.Optimizer, *, copy: bool
) -> tuple[nnx.Module, nnx.Optimizer]:
    """A model and optimizer holding the given ones' state as it is now: new graph objects over the same buffers
    (nothing is copied: a later step that does not donate them leaves them as they are), or copies with
    ``copy`` (a step that may donate them: a user's reference step)."""
    if copy:
        return copy_state(model, optimizer)
    return nnx.merge(*nnx.split((model, optimizer)))


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
    def of(model, optimizer) -> _PreStep:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return _PreStep(graphdef, nnx.as_pure(params), rest, nnx.as_pure(optimizer.opt_state))


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
            r_model, r_opt = copy_state(ref_model, ref_opt)
        c_model, c_opt = copy_state(ref_model, ref_opt)
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
        view = run.cand.view_optimizer or _default_view
        cand_view, cand_count = view(run.cand_opt)
        return _After(
            flatten_state(nnx.state(run.ref_model, nnx.Param)),
            flatten_state(nnx.state(run.cand_model, nnx.Param)),
            flatten_state(_opt_state(run.ref_opt)),
            flatten_state(cand_view),
            cand_count,
        )
