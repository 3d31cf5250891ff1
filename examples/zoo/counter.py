"""A model with non-parameter state that the step updates: an ``nnx.Variable`` subclass counting forward passes.

Written as the Flax NNX docs write custom state ("Flax NNX basics", "The Variable class": ``class
Count(nnx.Variable)``, incremented in ``__call__``): ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` updates the
parameters only, and ``nnx.value_and_grad`` differentiates the ``nnx.Param`` leaves and writes the forward pass's
update of the ``Count`` back to the model. shardcheck compares such state after every step, integers exactly:
one full-batch step is one forward pass, so the counter is the step count. Check it with::

    shardcheck verify --task examples/zoo/counter.py:task --mesh data=2,fsdp=2
    shardcheck verify --task examples/zoo/counter.py:task --mesh data=2,fsdp=2 --candidate examples/zoo/counter.py:step

``step`` is the user's jitted GSPMD step (the Flax NNX sharding guide's): the state replicated, the batch split
over both axes, ``nnx.value_and_grad`` then ``optimizer.update`` under ``nnx.jit``, XLA inserting the
collectives. Of the built-in strategies, ``gspmd`` writes the counter back as the single-device step does;
``simulation``, ``accumulation``, ``dp`` and ``fsdp`` run the forward pass once per shard, micro-batch or device
and refuse the model, each on its own row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck

D, H, OUT = 8, 16, 2
MESH = {"data": 2, "fsdp": 2}


class Count(nnx.Variable):
    """How many forward passes the model has run: an int32 scalar, not a parameter."""


class CountingMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(D, H, rngs=rngs)
        self.out = nnx.Linear(H, OUT, rngs=rngs)
        self.calls = Count(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
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
        out.append({"x": x, "y": np.sin(x @ teacher).astype(np.float32)})
    return out


task = shardcheck.Task(
    model=lambda: CountingMLP(nnx.Rngs(0)),
    optimizer=optax.sgd(0.1, momentum=0.9),
    loss_fn=loss_fn,
    batches=_batches(),
    name="counter",
)


def _make_step(forward_passes=1):
    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        for _ in range(forward_passes - 1):  # an extra forward pass (e.g. a logging one) counts too
            model(batch["x"])
        optimizer.update(model, grads)
        return loss

    def user_step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))  # data parallel: every leaf replicated, the counter too
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        return train_step(model, optimizer, batch)

    return user_step


_correct = _make_step()


def step(model, optimizer, batch, mesh):
    """The user's GSPMD step on a ``data x fsdp`` mesh; returns the pre-update loss."""
    return _correct(model, optimizer, batch, mesh)


# a second forward pass per step (an evaluation of the batch after the gradient): the counter runs x2
counted_twice = _make_step(forward_passes=2)

FAULTS = {
    "counted_twice": (counted_twice, "model_state"),
}
