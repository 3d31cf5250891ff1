"""One reference trajectory for several checks of one task: ``shardcheck verify`` checks every strategy against
the same single-device steps, so inside :func:`shared_reference` each reference step runs once.

Per step ``t`` and tolerance ``(rtol, atol)``, the first check of a task stores the reference's loss, gradients,
:class:`~shardcheck.parity.tolerance.allowances._Bounds` (the update's sensitivity) and state after the step; a later check
of the same task, batches and starting state takes them instead of stepping. The reference's state before step t
is always its own trajectory's (a candidate never changes it; a re-check and the synchronized steps after a
divergence start from it), and at float32 the bounds depend on nothing else, so every report is the one a check
of its own would give. Not shared: checks whose starting state differs from the first's in any bit (a task whose
factory is not deterministic), low-precision runs (their bounds read the candidate's state), a user's reference
step, and steps beyond :data:`MAX_BYTES` of stored arrays.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
from flax import nnx

from shardcheck.parity.comparison import live as compare

MAX_BYTES = 512 * 2**20
"""The most bytes of device arrays one task's shared trajectory holds; later steps are not stored."""

_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shared_reference", default=None)


@dataclasses.dataclass
class Trajectory:
    """A task's stored reference steps: ``steps[(t, rtol, atol)] = (loss, grads, bounds, state after)``."""

    start: dict  # the reference's state before step 0, flattened
    steps: dict = dataclasses.field(default_factory=dict)
    nbytes: int = 0

    def get(self, t: int, rtol: float, atol: float):
        return self.steps.get((t, rtol, atol))

    def put(self, t: int, rtol: float, atol: float, value) -> None:
        size = sum(a.nbytes for a in jax.tree.leaves(value) if isinstance(a, jax.Array))
        if self.nbytes + size <= MAX_BYTES:
            self.steps[(t, rtol, atol)] = value
            self.nbytes += size


@contextlib.contextmanager
def shared_reference():
    """Within this block, checks of one task share its reference steps (module docstring)."""
    token = _ACTIVE.set({})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def trajectory_for(task, key: tuple, model: nnx.Module, optimizer: nnx.Optimizer) -> Trajectory | None:
    """The shared trajectory of ``task`` for runs keyed ``key`` (steps, starting state, precision) that start
    from ``(model, optimizer)``; ``None`` outside :func:`shared_reference`, or where this run's starting state
    is not, bit for bit, the stored one's."""
    memos = _ACTIVE.get()
    if memos is None:
        return None
    start = compare.flatten_state(nnx.state((model, optimizer)))
    # the task is held with its trajectory: its id is not reused by another task while the block runs
    _, stored = memos.setdefault((id(task), key), (task, Trajectory(start)))
    if stored.start is not start and not _same(stored.start, start):
        return None
    return stored


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and compare.equal(a, b)
