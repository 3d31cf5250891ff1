"""A decoder LM with tied input and output embeddings: a zoo model (issue #34).

Written as the Flax NNX examples (the Gemma model of ``flax/examples``) tie a language model's head to its
input table: one ``nnx.Embed`` table ``(V, D)`` embeds the tokens and, through ``nnx.Embed.attend``, gives the
logits ``x @ table.T``, so the table's gradient is the sum of two uses. The block is pre-LayerNorm attention
(``nnx.MultiHeadAttention``) and a GELU MLP; the table is annotated ``(None, "fsdp")``, the kernels for FSDP.
Check it with::

    shardcheck verify --task examples/zoo/tied_lm.py:task --mesh data=2,fsdp=2 --candidate examples/zoo/tied_lm.py:step

``step`` is the user's GSPMD step: the state placed from its annotations with ``nnx.get_named_sharding``, the
batch split over ``data`` and ``fsdp``. ``FAULTS`` are a data-parallel step written by hand with
``jax.shard_map``, each with a reduction mistake.
"""

import jax
import jax.numpy as jnp
import optax
from _lm_steps import gspmd_step, shard_map_step  # the zoo's shared LM steps (a sibling file)
from flax import nnx

import shardcheck
from shardcheck.tasks.tiny_lm import lm_batches, lm_loss, vocab_size

D, HEADS, MLP, SEQ = 16, 2, 32, 16
MESH = {"data": 2, "fsdp": 2}
init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()


def linear(d_in, d_out, spec, rngs):
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.with_partitioning(init, spec),
        bias_init=nnx.with_partitioning(zeros, (None,)),
        rngs=rngs,
    )


class TiedLM(nnx.Module):
    """``(B, T)`` int32 tokens and a ``(B, T)`` validity mask -> ``(B, T, V)`` float32 next-token logits."""

    def __init__(self, rngs: nnx.Rngs):
        table_init = nnx.with_partitioning(nnx.initializers.normal(0.1), (None, "fsdp"))
        self.embed = nnx.Embed(vocab_size(), D, embedding_init=table_init, rngs=rngs)  # (V, D): in and out
        self.pos = nnx.Embed(SEQ, D, embedding_init=table_init, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=D,
            decode=False,
            kernel_init=nnx.with_partitioning(init, ("fsdp", None, None)),
            out_kernel_init=nnx.with_partitioning(init, (None, None, "fsdp")),
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = linear(D, MLP, ("fsdp", None), rngs)
        self.down = linear(MLP, D, (None, "fsdp"), rngs)
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens, mask):
        valid = mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        x = x + self.attn(self.ln1(x), mask=attn_mask)
        x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
        return self.embed.attend(self.ln_f(x))  # the tied head: x @ table.T, (B, T, V)


task = shardcheck.Task(
    model=lambda: TiedLM(nnx.Rngs(0)),
    optimizer=optax.chain(optax.clip_by_global_norm(10.0), optax.adam(3e-3)),
    loss_fn=lm_loss,  # (sum of cross-entropy over unmasked tokens, their count)
    batches=lm_batches(8, 2, seq_len=SEQ),
    name="tied-lm",
)


step = gspmd_step  # the user's correct step (_lm_steps.py)

FAULTS = {
    # the token count averaged over the shards, not summed: every gradient x S
    "count_averaged": (shard_map_step(count=jax.lax.pmean), "summed"),
    # each shard divides by its own token count, then the shards are averaged: a mean of per-shard means
    "per_shard_mean": (shard_map_step(mean=jax.lax.pmean, own_count=True), "normalization"),
}
