"""The loss's first-order allowance of a replayed run, by the live check's rule.

A live check allows the loss at step t what the parameters' accumulated allowance can move it by, to first order:
``sum |g_t| * A_{t-1}`` over every parameter element (``check._loss_leaves``: ``compare.abs_dot(bounds.grads,
run.allowance)``), where ``A`` sums, over the steps before t, the update's sensitivity to the gradient's tolerance
``atol_s + rtol_s max|g_s|`` (per leaf) propagated through the task's optimizer
(:func:`~shardcheck.parity.tolerance.propagation.update_sensitivity`, a step whose gradients are not finite adding
none). A digest holds no element of the gradient, so a replay took only the part of it from a rounding-level
gradient (``digest._grow_allowance``): under SGD the replay's loss tolerance at step 1 was 1.78e-05 where the live
check's was 2.72e-05, and a loss verdict after the first step could differ between them (issue #36).
:class:`LossDrift` takes that term on the replayed run's own steps (its pre-step parameters and optimizer state,
its returned gradients, the tolerance's float32 rule), kept as ``meta["loss_drift"]``: the digest comparison adds
it to the loss's tolerance, so a loss the live check allows the replay allows too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.parity.comparison.live import flatten_state, host_tree
from shardcheck.parity.tolerance.derive import derive_tolerance


class LossDrift:
    """The live check's loss drift ``sum |g_t| * A_{t-1}`` of each step of a run (:attr:`values`, floats by
    step), its allowance ``A`` accumulated from the steps' sensitivities (module docstring).

    Args:
        tx: the task's optimizer (``task.optimizer``), whose update the sensitivity propagates through.
    """

    def __init__(self, tx):
        self.tx = tx
        self.allowance: dict[str, np.ndarray] = {}
        self.values: list[float] = []

    def step(self, t: int, terms: int, pre: tuple, grads) -> None:
        """Append step ``t``'s drift and add its sensitivity to the allowance: ``pre``, the run's ``(params,
        opt_state)`` before the step (pure trees; the state as the task's optimizer's,
        :func:`~shardcheck.parity.harness.optimizer_rerun.pre_update`), ``grads`` the gradients it returned (a
        tree like the parameters) or ``None`` (no drift read, no sensitivity added: 0), ``terms`` the batch's
        reduction length (``Task.terms``). A step whose gradients or state do not rebuild as the task's optimizer
        reads them, or whose transformation needs more than ``(grads, state, params)``, adds 0 too."""
        from shardcheck.parity.harness.optimizer_rerun import _rebuild

        params, state = pre
        grads = None if grads is None else _rebuild(params, flatten_state(nnx.as_pure(grads)))
        state = _rebuild(jax.eval_shape(self.tx.init, params), flatten_state(state))
        if grads is None or state is None:
            self.values.append(0.0)
            return
        flat = {p: np.asarray(g, np.float64) for p, g in host_tree(flatten_state(grads)).items()}
        drift = sum(float(np.sum(np.abs(flat[p]) * a)) for p, a in self.allowance.items() if p in flat)
        self.values.append(drift if math.isfinite(drift) else 0.0)
        tol = derive_tolerance(_least_dtype(params), batch_size=terms, step=t)
        try:
            updates = _sensitivity(self.tx, grads, state, params, tol.rtol, tol.atol)
        except (TypeError, ValueError):  # a transformation that needs more than (grads, state, params)
            return
        for p, s in host_tree(flatten_state(updates)).items():
            s = np.nan_to_num(np.asarray(s, np.float64), nan=0.0)
            self.allowance[p] = self.allowance[p] + s if p in self.allowance else s


@functools.partial(jax.jit, static_argnums=0)
def _sensitivity(tx, grads, state, params, rtol, atol):
    """The update's sensitivity to the gradient's tolerance ``atol + rtol max|g|`` (per leaf), as the live check
    takes it (:func:`~shardcheck.parity.tolerance.propagation.update_sensitivity`; 0 where a gradient is not
    finite), one program per optimizer and tree (not one per step)."""
    from shardcheck.parity.tolerance.allowances import _unless_skipped
    from shardcheck.parity.tolerance.propagation import grad_delta, update_sensitivity

    delta = grad_delta(grads, None, rtol, atol, 0.0)
    return _unless_skipped(grads, update_sensitivity(tx, grads, state, params, delta)[0])


def _least_dtype(params) -> str:
    """The tolerance's dtype of ``params`` (``meta["tolerance_dtype"]``'s rule): the least precise floating
    parameter dtype, float32 where that is coarser (low-precision parameters accumulate in float32)."""
    dtypes = [jnp.dtype(a.dtype) for a in jax.tree.leaves(params) if jnp.issubdtype(a.dtype, jnp.floating)]
    least = max(dtypes or [jnp.dtype(jnp.float32)], key=lambda d: float(jnp.finfo(d).eps))
    return str(jnp.dtype(jnp.float32) if jnp.finfo(least).eps > jnp.finfo(jnp.float32).eps else least)
