"""A LoRA-adapted MLP whose pretrained weights are kept frozen in a Variable class of the user's own.

Low-rank adaptation (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021): each adapted layer
computes ``x @ W + (alpha / r) * (x @ A) @ B`` with the pretrained ``W`` frozen and only ``A`` (``(d_in, r)``,
random) and ``B`` (``(r, d_out)``, zeros) trained. The frozen weights are held in ``class Frozen(nnx.Variable)``,
as the Flax NNX docs write custom state ("The Variable class"): ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
``nnx.value_and_grad``'s default differentiate and update the ``nnx.Param`` leaves only, so the single-device step
leaves them as they are. shardcheck compares such floating state after every step, exactly where the reference
left it. Check it with::

    shardcheck verify --task examples/zoo/lora.py:task --mesh data=2,fsdp=2
    shardcheck verify --task examples/zoo/lora.py:task --mesh data=2,fsdp=2 --candidate examples/zoo/lora.py:step

``step`` is the user's jitted GSPMD step: every leaf replicated, the batch split over both axes, XLA inserting
the collectives. The planted fault differentiates ``Frozen`` too (``nnx.DiffState(0, nnx.Any(nnx.Param,
Frozen))``, a filter widened to see the base weights' gradients) and applies that gradient to them by hand: a
weight meant to stay frozen, trained.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck

MESH = {"data": 2, "fsdp": 2}
D, H, OUT, RANK, ALPHA = 8, 16, 2, 2, 4.0


class Frozen(nnx.Variable):
    """A pretrained weight that fine-tuning leaves as it is (not an ``nnx.Param``)."""


class LoRALinear(nnx.Module):
    """``(B, d_in) -> (B, d_out)``: ``x @ W + b + (alpha / r) * (x @ A) @ B``, ``W`` and ``b`` frozen."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs):
        self.kernel = Frozen(jax.random.normal(rngs.params(), (d_in, d_out)) / np.sqrt(d_in))
        self.bias = Frozen(0.1 * jax.random.normal(rngs.params(), (d_out,)))
        self.lora_a = nnx.Param(jax.random.normal(rngs.params(), (d_in, RANK)) / np.sqrt(d_in))
        self.lora_b = nnx.Param(jnp.zeros((RANK, d_out)))

    def __call__(self, x):
        frozen = x @ self.kernel[...] + self.bias[...]
        return frozen + (ALPHA / RANK) * (x @ self.lora_a[...]) @ self.lora_b[...]


class LoRAMLP(nnx.Module):
    """``(B, D) -> (B, OUT)``: two LoRA-adapted layers with a ReLU between."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = LoRALinear(D, H, rngs=rngs)
        self.out = LoRALinear(H, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model, batch):
    """Mean squared error over the rows and outputs."""
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches(n=3, rows=16):
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(D, OUT)) / np.sqrt(D)
    out = []
    for _ in range(n):
        x = rng.normal(size=(rows, D)).astype(np.float32)
        out.append({"x": x, "y": np.tanh(x @ teacher).astype(np.float32)})
    return out


task = shardcheck.Task(
    model=lambda: LoRAMLP(nnx.Rngs(0)),
    optimizer=optax.adamw(1e-2, weight_decay=0.01),
    loss_fn=loss_fn,
    batches=_batches(),
    name="lora",
)


def _make_step(train_frozen=False):
    @nnx.jit
    def train_step(model, optimizer, batch):
        if not train_frozen:
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss
        # the filter widened to see the base weights' gradients, which are then applied to them by hand
        wide = nnx.DiffState(0, nnx.Any(nnx.Param, Frozen))
        loss, grads = nnx.value_and_grad(loss_fn, argnums=wide)(model, batch)
        optimizer.update(model, nnx.state(grads, nnx.Param))
        frozen = nnx.state(model, Frozen)
        nnx.update(model, jax.tree.map(lambda w, g: w - 1e-2 * g, frozen, nnx.state(grads, Frozen)))
        return loss

    def user_step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))  # data parallel: every leaf replicated
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        return train_step(model, optimizer, batch)

    return user_step


_correct = _make_step()


def step(model, optimizer, batch, mesh):
    """The user's GSPMD step on a ``data x fsdp`` mesh; returns the pre-update loss."""
    return _correct(model, optimizer, batch, mesh)


# the frozen weights differentiated and updated by hand beside the LoRA factors
frozen_trained = _make_step(train_frozen=True)

FAULTS = {
    "frozen_trained": (frozen_trained, "frozen_state"),
}
