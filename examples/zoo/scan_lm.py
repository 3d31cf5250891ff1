"""A scan-over-layers LM annotated for a ``data x fsdp x model`` mesh: a zoo model (issue #34).

Written as the Flax NNX docs and the large JAX trainers (MaxText) write a deep decoder: the blocks are built once
with ``nnx.vmap`` over ``nnx.split_rngs`` (one stacked copy of every parameter, a leading layer axis, annotated
replicated with ``transform_metadata={nnx.PARTITION_NAME: None}``) and applied with ``nnx.scan`` over that axis,
each block under ``nnx.remat``. The block is a Llama-style one: ``nnx.RMSNorm``, causal self-attention with rotary
position embeddings (Su et al., "RoFormer", 2021), and a SwiGLU MLP (Shazeer, "GLU Variants Improve Transformer",
2020). Every kernel carries ``nnx.with_partitioning`` annotations: column-parallel projections ``("fsdp",
"model")``, row-parallel ones ``("model", "fsdp")``. Check it with::

    shardcheck verify --task examples/zoo/scan_lm.py:task --mesh data=2,fsdp=2,model=2 --candidate examples/zoo/scan_lm.py:step

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

D, HEADS, MLP, SEQ, LAYERS = 32, 2, 64, 16, 2
HEAD_DIM = D // HEADS
MESH = {"data": 2, "fsdp": 2, "model": 2}
init = nnx.initializers.lecun_normal()


def linear(d_in, d_out, spec, rngs):
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=nnx.with_partitioning(init, spec), rngs=rngs)


def rms_norm(rngs):
    return nnx.RMSNorm(D, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (None,)), rngs=rngs)


def rotary(x, positions, base=10000.0):
    """Rotary position embedding of ``x`` ``(B, T, H, Dh)`` at ``positions`` ``(T,)`` (RoFormer, eq. 34)."""
    freq = base ** (-jnp.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angle = positions[:, None] * freq[None]  # (T, Dh / 2)
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(rngs)
        self.wq = linear(D, D, ("fsdp", "model"), rngs)
        self.wk = linear(D, D, ("fsdp", "model"), rngs)
        self.wv = linear(D, D, ("fsdp", "model"), rngs)
        self.wo = linear(D, D, ("model", "fsdp"), rngs)
        self.mlp_norm = rms_norm(rngs)
        self.w_gate = linear(D, MLP, ("fsdp", "model"), rngs)
        self.w_up = linear(D, MLP, ("fsdp", "model"), rngs)
        self.w_down = linear(MLP, D, ("model", "fsdp"), rngs)

    def __call__(self, x, mask):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).reshape(b, t, HEADS, HEAD_DIM) for w in (self.wq, self.wk, self.wv))
        positions = jnp.arange(t, dtype=jnp.float32)
        q, k = rotary(q, positions), rotary(k, positions)
        attn = nnx.dot_product_attention(q, k, v, mask=mask)
        x = x + self.wo(attn.reshape(b, t, D))
        h = self.mlp_norm(x)
        return x + self.w_down(nnx.silu(self.w_gate(h)) * self.w_up(h))


class ScanLM(nnx.Module):
    """``(B, T)`` int32 tokens and a ``(B, T)`` validity mask -> ``(B, T, V)`` float32 next-token logits."""

    def __init__(self, rngs: nnx.Rngs):
        embed_init = nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "fsdp"))
        self.embed = nnx.Embed(vocab_size(), D, embedding_init=embed_init, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create_blocks(rngs):
            return Block(rngs)

        self.blocks = create_blocks(rngs)  # every leaf (LAYERS, ...)
        self.norm = rms_norm(rngs)
        self.head = linear(D, vocab_size(), ("fsdp", None), rngs)

    def __call__(self, tokens, mask):
        valid = mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))

        @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, block, attn_mask):
            return block(x, attn_mask)

        x = forward(self.embed(tokens), self.blocks, attn_mask)
        return self.head(self.norm(x))


task = shardcheck.Task(
    model=lambda: ScanLM(nnx.Rngs(0)),
    optimizer=optax.adamw(3e-3, weight_decay=0.01),
    loss_fn=lm_loss,  # (sum of cross-entropy over unmasked tokens, their count)
    batches=lm_batches(8, 2, seq_len=SEQ),
    name="scan-lm",
)


step = gspmd_step  # the user's correct step (_lm_steps.py)

FAULTS = {
    # the token count averaged over the shards, not summed: every gradient x S
    "count_averaged": (shard_map_step(count=jax.lax.pmean), "summed"),
    # the gradients reduced over 'data' only: the copies along 'fsdp' differ
    "missed_fsdp": (shard_map_step(grads_over=("data",)), "wrong_axis_reduction"),
}
