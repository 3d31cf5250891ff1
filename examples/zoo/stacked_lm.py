"""A decoder LM whose layers are stacked the way the Flax sharding guide stacks them: a zoo model (issue #34).

Written as the Flax NNX guide "Scale up on multiple devices" and MaxText build a layer stack: the blocks are
created by ``nnx.vmap`` over ``nnx.split_rngs``, with ``transform_metadata={nnx.PARTITION_NAME: "layers"}``, so
every stacked parameter's annotation gains the mesh axis ``layers`` on its leading (layer) dimension; the stack is
applied with a plain ``jax.lax.scan`` over its split state (``nnx.split``, then ``nnx.merge`` of one layer's
slice in the scan body). Inside a block the kernels are annotated for FSDP (``"fsdp"`` on one dimension), so a
stacked kernel ``(LAYERS, D, F)`` is placed ``("layers", "fsdp", None)``: each device holds one layer's shard.
The batch is split over ``data`` and ``fsdp`` and replicated over ``layers``. Check it with::

    shardcheck verify --task examples/zoo/stacked_lm.py:task --mesh data=2,fsdp=2,layers=2 --candidate examples/zoo/stacked_lm.py:step

``step`` is the user's GSPMD step: the state placed from its annotations with ``nnx.get_named_sharding``, XLA
inserting the collectives. ``FAULTS`` are a data-parallel step written by hand with ``jax.shard_map``, each with
a reduction mistake.
"""

import jax
import jax.numpy as jnp
import optax
from _lm_steps import gspmd_step, shard_map_step  # the zoo's shared LM steps (a sibling file)
from flax import nnx

import shardcheck
from shardcheck.tasks.tiny_lm import lm_batches, lm_loss, vocab_size

D, HEADS, MLP, SEQ, LAYERS = 16, 2, 32, 16, 2
MESH = {"data": 2, "fsdp": 2, "layers": 2}
init, zeros, ones = (
    nnx.initializers.lecun_normal(),
    nnx.initializers.zeros_init(),
    nnx.initializers.ones_init(),
)


def layer_norm(rngs):
    return nnx.LayerNorm(
        D,
        scale_init=nnx.with_partitioning(ones, (None,)),
        bias_init=nnx.with_partitioning(zeros, (None,)),
        rngs=rngs,
    )


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = layer_norm(rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=D,
            decode=False,
            kernel_init=nnx.with_partitioning(init, ("fsdp", None, None)),  # (D, heads, head_dim)
            out_kernel_init=nnx.with_partitioning(init, (None, None, "fsdp")),  # (heads, head_dim, D)
            bias_init=nnx.with_partitioning(zeros, (None, None)),
            out_bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )
        self.ln2 = layer_norm(rngs)
        self.up = nnx.Linear(
            D,
            MLP,
            kernel_init=nnx.with_partitioning(init, ("fsdp", None)),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            MLP,
            D,
            kernel_init=nnx.with_partitioning(init, (None, "fsdp")),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class StackedLM(nnx.Module):
    """``(B, T)`` int32 tokens and a ``(B, T)`` validity mask -> ``(B, T, V)`` float32 next-token logits."""

    def __init__(self, rngs: nnx.Rngs):
        embed_init = nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "fsdp"))
        self.embed = nnx.Embed(vocab_size(), D, embedding_init=embed_init, rngs=rngs)
        self.pos = nnx.Embed(SEQ, D, embedding_init=embed_init, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_blocks(rngs):
            return Block(rngs)

        self.blocks = create_blocks(rngs)  # every leaf (LAYERS, ...), its leading dimension over 'layers'
        self.ln_f = layer_norm(rngs)
        self.head = nnx.Linear(
            D,
            vocab_size(),
            kernel_init=nnx.with_partitioning(init, ("fsdp", None)),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )

    def __call__(self, tokens, mask):
        valid = mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        graphdef, state = nnx.split(self.blocks)

        def scan_over_layers(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, attn_mask), None

        x, _ = jax.lax.scan(scan_over_layers, x, state)
        return self.head(self.ln_f(x))


task = shardcheck.Task(
    model=lambda: StackedLM(nnx.Rngs(0)),
    optimizer=optax.adam(3e-3),
    loss_fn=lm_loss,  # (sum of cross-entropy over unmasked tokens, their count)
    batches=lm_batches(8, 2, seq_len=SEQ),
    name="stacked-lm",
)


step = gspmd_step  # the user's correct step (_lm_steps.py)

FAULTS = {
    # a pmean of gradients already divided by the global token count: x 1/S
    "averaged_twice": (shard_map_step(mean=jax.lax.pmean), "averaged_twice"),
    # each shard divides by its own token count, then the shards are averaged: a mean of per-shard means
    "per_shard_mean": (shard_map_step(mean=jax.lax.pmean, own_count=True), "normalization"),
}
