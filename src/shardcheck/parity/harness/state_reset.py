"""Whether a candidate's step ignores the optimizer state it is given: the probe that tells a step which does not
carry its optimizer state between steps (it resets it) from a step that is faulty on its own.

Both fail first at a step t > 0 and again when re-run from the reference's pre-step state (the step loop's
re-check): an optimizer state reset is invisible at step 0, where the state is the initial one, and so is a
fault the step-0 learning rate hides (a warm-up from 0). The candidate is stepped twice on one batch from the
reference's pre-step parameters: once with the reference's optimizer state, once with that optimizer's initial
state (``tx.init`` of the same parameters, the step counter kept). Where the pre-step state differs from the
initial one and the two steps leave bitwise the same parameters and optimizer state, the candidate ignored the
state it was given: the state is not carried between steps (the ``drift`` finding). Otherwise the step itself is
faulty and is localized as at step 0.
"""

from __future__ import annotations

from flax import nnx

from shardcheck._tree import copy_state
from shardcheck.parity.comparison.live import equal, flatten_state
from shardcheck.parity.harness.candidates import run_step
from shardcheck.parity.harness.state import _After, _opt_state, _Run


def ignores_optimizer_state(run: _Run, model: nnx.Module, optimizer: nnx.Optimizer, t: int, batch) -> bool:
    """Whether the candidate's step ``t`` on ``batch`` from ``model``'s parameters gives bitwise the same
    parameters and optimizer state from ``optimizer``'s state as from that optimizer's initial state.

    Args:
        run: the check's run (its candidate; its reference state is not touched).
        model: the reference's model before the step (left as it is: the probes step copies).
        optimizer: the reference's optimizer before the step (left as it is).
        t: the step index (for the candidate's error messages).
        batch: the step's batch.

    Returns:
        ``False`` where the pre-step optimizer state equals its initial state (the probe cannot tell: a
        stateless optimizer, an untouched state), else whether both probes agree bitwise.
    """
    initial = nnx.Optimizer(copy_state(model), optimizer.tx, wrt=optimizer.wrt)
    initial.step[...] = optimizer.step[...]
    if _same(flatten_state(_opt_state(optimizer)), flatten_state(_opt_state(initial))):
        return False
    carried, reset = (_stepped(run, model, opt, t, batch) for opt in (optimizer, initial))
    return all(_same(a, b) for a, b in zip(carried, reset, strict=True))


def _stepped(run: _Run, model: nnx.Module, optimizer: nnx.Optimizer, t: int, batch) -> tuple[dict, dict]:
    """The candidate's parameters and optimizer state after its step from copies of ``model`` and
    ``optimizer``."""
    probe = run.synchronized(model, optimizer)
    run_step("check_parity", probe.cand, probe.cand_model, probe.cand_opt, batch, probe.kwargs, t)
    after = _After.of(probe)
    return after.cand_params, after.cand_state


def _same(a: dict, b: dict) -> bool:
    """Both flat states (``{dotted path: leaf}``) hold the same paths and bitwise the same leaves
    (:func:`~shardcheck.parity.comparison.live.equal`: on the devices, PRNG keys through their raw data)."""
    return a.keys() == b.keys() and equal(a, b)
