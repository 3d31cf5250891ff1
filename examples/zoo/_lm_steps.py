"""The steps the zoo's language models share (``rng_lm``, ``scan_lm``, ``stacked_lm``, ``tied_lm``): the user's
correct GSPMD step, and a data-parallel step written by hand with ``jax.shard_map`` whose reductions a fault
changes. A task file imports it as a sibling (the folder of a ``--task FILE.py:task`` is importable while it
loads); its name starts with ``_``, so the zoo's test driver does not take it for a model.

Every model's loss is ``shardcheck.tasks.tiny_lm.lm_loss``: ``(sum of the cross-entropy over unmasked tokens,
their count)``; the batch is split over the mesh axes ``data`` and ``fsdp``.
"""

import functools

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck.tasks.tiny_lm import lm_loss

BATCH_AXES = ("data", "fsdp")


@nnx.jit
def _train_step(model, optimizer, batch):
    def mean_loss(model):
        loss_sum, count = lm_loss(model, batch)
        return loss_sum / count

    loss, grads = nnx.value_and_grad(mean_loss)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def gspmd_step(model, optimizer, batch, mesh):
    """The user's GSPMD step: the state placed from its annotations (``nnx.get_named_sharding``; an unannotated
    leaf is replicated), the batch split over ``data`` and ``fsdp``, XLA inserting the collectives. Returns
    ``{"loss": (), "grads": the parameters' gradients}``."""
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    batch = jax.device_put(batch, NamedSharding(mesh, P(BATCH_AXES)))
    return _train_step(model, optimizer, batch)


def shard_map_step(grads_over=BATCH_AXES, count=jax.lax.psum, mean=jax.lax.psum, own_count=False):
    """A data-parallel step by hand: each shard's gradient of its loss sum, reduced with ``mean`` over
    ``grads_over`` and divided by the token count reduced with ``count``. The right choice: psum both over every
    batch axis. ``own_count``: each shard divides by its own token count before the reduction."""

    @functools.partial(nnx.jit, static_argnums=3)  # the whole step one program
    def train(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            def local(p):
                return lm_loss(nnx.merge(graphdef, p, rest), batch)

            (loss_sum, n), grads = jax.value_and_grad(local, has_aux=True)(params)
            scale = n if own_count else count(n, BATCH_AXES)
            grads = jax.tree.map(lambda g: mean(g / scale, grads_over), grads)
            return jax.lax.psum(loss_sum, BATCH_AXES) / jax.lax.psum(n, BATCH_AXES), grads

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), P(BATCH_AXES)), out_specs=P(), check_vma=False
        )
        loss, grads = mapped(params, rest, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    def faulty_step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))  # replicated before the step: one compile per mesh, every step
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, batch, mesh)

    return faulty_step
