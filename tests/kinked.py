"""A task whose trajectory splits at a ReLU kink on a step fixed by exact arithmetic (a task file for the tests).

``y = x @ w + relu(b - 1/2)`` under SGD at ``lr = 1/2`` with a mean loss: ``b``'s gradient is exactly 1 while
``b > 1/2`` and exactly 0 at the kink (JAX's ``relu'(0) = 0``), so the reference's ``b`` runs 2, 1.5, 1, 0.5, then
stays at 0.5 (every value exact in float32). ``rounded_step`` is that SGD step with a relative ``2**-22`` rounding
of ``b`` planted after each update, the size of what a reordered all-reduce leaves: always within the per-step
tolerance, but after step 2 its ``b`` sits a few float32 ulps above the kink, so at step 3 its ReLU is still on, its
``b`` drops by 0.5 and the two trajectories separate while the step itself, run from the reference's state, still
matches. The split step is the arithmetic's, not a compiler's rounding event.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardcheck

DIVERGES_AT = 3  # b: 2 -> 1.5 -> 1 -> 0.5 on both sides, then the candidate's ReLU is still on
STEPS = 6


class Kinked(nnx.Module):
    """``(B, 2) float32 -> (B, 1)``: a linear map plus a ReLU of a scalar bias."""

    def __init__(self):
        self.w = nnx.Param(jnp.full((2, 1), 0.25, jnp.float32))
        self.b = nnx.Param(jnp.array([2.0], jnp.float32))

    def __call__(self, x):
        return x @ self.w[...] + jax.nn.relu(self.b[...] - 0.5)


def loss_fn(model, x):
    return jnp.mean(model(x))


def _batches():
    rng = np.random.default_rng(0)
    return [rng.normal(size=(8, 2)).astype(np.float32) for _ in range(STEPS)]


task = shardcheck.Task(
    model=Kinked, optimizer=optax.sgd(0.5), loss_fn=loss_fn, batches=_batches(), name="kinked"
)


def rounded_step(model, optimizer, batch):
    """The correct SGD step, then ``b`` rounded up by a relative ``2**-22`` (a planted rounding-level error)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    model.b[...] = model.b[...] * (1 + 2.0**-22)
    return loss
