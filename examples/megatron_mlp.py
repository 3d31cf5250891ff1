"""A user's tensor-parallel task and step: a Megatron-style MLP block on a ``data x model`` mesh.

The kernels are annotated the way the Flax NNX guide writes tensor parallelism: ``up`` column-parallel
``(None, "model")`` with its bias ``("model",)``, ``down`` row-parallel ``("model", None)`` with a replicated
bias. The batch is split over ``data`` and replicated over ``model``. Check it with::

    shardcheck verify --task examples/megatron_mlp.py:task --mesh data=2,model=4
    shardcheck verify --task examples/megatron_mlp.py:task --mesh data=2,model=4 --candidate examples/megatron_mlp.py:step

``step`` is the user's own ``jax.shard_map`` step (Shoeybi et al., "Megatron-LM", 2019, section 3): each device
holds its slice of ``up`` and ``down``, the row-parallel partial sum is psum-ed over ``model`` before the bias is
added (``check_vma=True`` inserts the all-reduce of the column-parallel input's gradient), and the gradients are
psum-ed over ``data`` and divided by the row count.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardcheck

D_IN, HIDDEN, D_OUT = 8, 32, 4


class MegatronMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init, bias = nnx.initializers.lecun_normal(), nnx.initializers.normal(0.1)
        self.up = nnx.Linear(
            D_IN,
            HIDDEN,
            kernel_init=nnx.with_partitioning(init, (None, "model")),  # column-parallel
            bias_init=nnx.with_partitioning(bias, ("model",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            HIDDEN,
            D_OUT,
            kernel_init=nnx.with_partitioning(init, ("model", None)),  # row-parallel
            bias_init=nnx.with_partitioning(bias, (None,)),  # replicated: added once, after the psum
            rngs=rngs,
        )

    def __call__(self, x, reduce=lambda y: y):
        h = nnx.gelu(x @ self.up.kernel[...] + self.up.bias[...])
        return reduce(h @ self.down.kernel[...]) + self.down.bias[...]


def loss_fn(model, batch, **kw):
    """``(sum of the squared errors, the number of rows)``."""
    err = model(batch["x"], **kw) - batch["y"]
    return jnp.sum(err**2), jnp.asarray(err.shape[0], jnp.float32)


_rng = np.random.default_rng(0)
task = shardcheck.Task(
    model=lambda: MegatronMLP(nnx.Rngs(0)),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=[
        {
            "x": _rng.normal(size=(16, D_IN)).astype(np.float32),
            "y": _rng.normal(size=(16, D_OUT)).astype(np.float32),
        }
        for _ in range(3)
    ],
    name="megatron-mlp",
)


def step(model, optimizer, batch, mesh):
    """The user's tensor-parallel step on a mesh with axes ``data`` and ``model``; returns the pre-update loss."""
    graphdef, params = nnx.split(model, nnx.Param)
    specs = nnx.get_partition_spec(params)
    params = jax.device_put(params, nnx.get_named_sharding(params, mesh))

    def body(p, b):
        p = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)  # no implicit psum over data

        def local(p):
            return loss_fn(nnx.merge(graphdef, p), b, reduce=lambda y: jax.lax.psum(y, "model"))

        (total, count), grads = jax.value_and_grad(local, has_aux=True)(p)
        count = jax.lax.psum(count, "data")
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "data") / count, grads)
        return jax.lax.psum(total, "data") / count, grads

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
    loss, grads = jax.jit(mapped)(params, batch)
    optimizer.update(model, grads)
    return loss
