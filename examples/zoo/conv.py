"""A conv net with GroupNorm on scikit-learn's 8 x 8 digits, and the user's data-parallel ``jax.shard_map`` step.

The model is the Flax NNX MNIST tutorial's CNN ("MNIST tutorial": two ``nnx.Conv`` layers, ``nnx.avg_pool``
through a ``functools.partial``, two ``nnx.Linear`` layers), each convolution followed by ``nnx.GroupNorm`` (Wu and
He, "Group Normalization", 2018): a per-example normalization, so the sharded step can equal the full-batch one,
where BatchNorm's batch statistics could not. The data are scikit-learn's bundled digits (1797 images of 8 x 8
pixels, no download), as ``(B, 8, 8, 1)`` images. Each batch ends with padding rows (mask 0), as the last batch of
an epoch does; the loss is ``(sum of the cross-entropy over the real rows, their count)``. Check it with::

    shardcheck verify --task examples/zoo/conv.py:task --mesh data=2,fsdp=2
    shardcheck verify --task examples/zoo/conv.py:task --mesh data=2,fsdp=2 --candidate examples/zoo/conv.py:step

``step`` is the user's data-parallel step: every weight replicated, the batch split over both axes, each device's
gradient of its ``loss_sum`` and its row count summed over the mesh, divided once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck.tasks.digits import load_digits  # scikit-learn's load_digits, cached

MESH = {"data": 2, "fsdp": 2}
AXES = ("data", "fsdp")  # the batch is split over both
ROWS, REAL_ROWS = 32, (28, 30, 26)  # rows per batch, and the real ones (the rest is padding)


class CNN(nnx.Module):
    """``(B, 8, 8, 1)`` images -> ``(B, 10)`` logits."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.norm1 = nnx.GroupNorm(8, num_groups=4, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.norm2 = nnx.GroupNorm(16, num_groups=4, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.norm1(self.conv1(x))))  # (B, 4, 4, 8)
        x = self.avg_pool(nnx.relu(self.norm2(self.conv2(x))))  # (B, 2, 2, 16)
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    """``(sum over the real rows of the softmax cross-entropy, the number of real rows)``."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["image"]), batch["label"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"])


def _batches():
    x, label = load_digits()
    order = np.random.default_rng(0).permutation(len(x))
    out = []
    for i, real in enumerate(REAL_ROWS):
        idx = order[i * ROWS : (i + 1) * ROWS]
        out.append(
            {
                "image": x[idx].reshape(ROWS, 8, 8, 1),
                "label": label[idx],
                "mask": (np.arange(ROWS) < real).astype(np.float32),  # padding at the end of the batch
            }
        )
    return out


task = shardcheck.Task(
    model=lambda: CNN(rngs=nnx.Rngs(0)),
    optimizer=optax.adamw(3e-3, weight_decay=1e-2),
    loss_fn=loss_fn,
    batches=_batches(),
    name="conv",
)


def _make_step(*, reduce_axes=AXES, count_over=jax.lax.psum, per_shard_mean=False, check_vma=True):
    """The user's step; the keywords plant its faults (the defaults are the correct step)."""

    @functools.partial(nnx.jit, static_argnums=3)  # the whole step one program
    def train(model, optimizer, batch, mesh):
        graphdef, params = nnx.split(model, nnx.Param)

        def body(p, b):
            p = jax.tree.map(lambda a: jax.lax.pcast(a, AXES, to="varying"), p)  # local gradients (C2)
            (total, count), grads = jax.value_and_grad(
                lambda p: loss_fn(nnx.merge(graphdef, p), b), has_aux=True
            )(p)
            if per_shard_mean:  # each shard's own mean, then the mean over the shards
                grads = jax.tree.map(lambda g: jax.lax.pmean(g / count, reduce_axes), grads)
                return jax.lax.pmean(total / count, reduce_axes), grads
            count = count_over(count, reduce_axes)
            grads = jax.tree.map(lambda g: jax.lax.psum(g, reduce_axes) / count, grads)
            return jax.lax.psum(total, reduce_axes) / count, grads

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(AXES)), out_specs=(P(), P()), check_vma=check_vma
        )
        loss, grads = mapped(params, batch)
        optimizer.update(model, grads)
        return loss

    def user_step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))  # replicated before the step: one compile per mesh, every step
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, batch, mesh)

    return user_step


_correct = _make_step()


def step(model, optimizer, batch, mesh):
    """The user's data-parallel step on a ``data x fsdp`` mesh; returns the pre-update loss."""
    return _correct(model, optimizer, batch, mesh)


# the gradient sums psum-ed, the row counts pmean-ed: divided by the mean count of a shard, x4 (a sum for a mean)
count_pmeaned = _make_step(count_over=jax.lax.pmean)
# each device's mean loss, gradients pmean-ed: the mean of per-shard means, wrong when the shards hold different
# numbers of real rows (the padding; docs/reduction_cases.md C4-C6)
pmean_of_shard_means = _make_step(per_shard_mean=True)
# reduced over 'data' only; check_vma=False lets copies that differ along 'fsdp' out as if replicated
reduced_over_data_only = _make_step(reduce_axes=("data",), check_vma=False)

FAULTS = {
    "count_pmeaned": (count_pmeaned, "scaled"),  # loss and gradients x4: a factor in the loss or a psum
    "pmean_of_shard_means": (pmean_of_shard_means, "normalization"),
    "reduced_over_data_only": (reduced_over_data_only, "wrong_axis_reduction"),
}
