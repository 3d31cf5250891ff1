"""The Flax tutorials' decoder LM, with its RNG streams: a zoo model (issue #34).

Written as the Flax NNX tutorials write a small GPT ("Train a miniGPT language model with JAX"): token and
position ``nnx.Embed``, a pre-LayerNorm block of ``nnx.MultiHeadAttention`` (with its query / key / value and
output biases) under a causal and padding mask, ``nnx.Dropout`` and a GELU MLP, the model built with
``nnx.Rngs(params=0, dropout=1)``. Dropout is kept at rate 0, as the tutorials do for a deterministic run, so the
model holds RNG state (keys and counters) that a step must carry but never draws from. No parameter is annotated:
every strategy places the state by its own rule. Check it with::

    shardcheck verify --task examples/zoo/rng_lm.py:task --mesh data=2,fsdp=4 --candidate examples/zoo/rng_lm.py:step

``step`` is the user's GSPMD step: the state replicated, the batch split over both mesh axes, XLA inserting the
collectives. ``FAULTS`` are the same step written by hand with ``jax.shard_map``, each with a reduction mistake.
"""

import jax
import optax
from _lm_steps import gspmd_step, shard_map_step  # the zoo's shared LM steps (a sibling file)
from flax import nnx

import shardcheck
from shardcheck.tasks.tiny_lm import lm_batches, lm_loss, vocab_size

D, HEADS, MLP, SEQ, LAYERS = 16, 2, 32, 16, 1
MESH = {"data": 2, "fsdp": 4}


class TransformerBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, epsilon=1e-6, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.0, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, epsilon=1e-6, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(D, MLP, rngs=rngs), nnx.gelu, nnx.Linear(MLP, D, rngs=rngs))
        self.dropout2 = nnx.Dropout(rate=0.0, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout1(self.attn(self.ln1(x), mask=mask))
        return x + self.dropout2(self.mlp(self.ln2(x)))


class MiniGPT(nnx.Module):
    """``(B, T)`` int32 tokens and a ``(B, T)`` validity mask -> ``(B, T, V)`` float32 next-token logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(vocab_size(), D, rngs=rngs)
        self.pos_emb = nnx.Embed(SEQ, D, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(D, epsilon=1e-6, rngs=rngs)
        self.head = nnx.Linear(D, vocab_size(), rngs=rngs)

    def __call__(self, tokens, mask):
        valid = mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.token_emb(tokens) + self.pos_emb(jax.numpy.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.head(self.ln_f(x))


task = shardcheck.Task(
    model=lambda: MiniGPT(nnx.Rngs(params=0, dropout=1)),
    optimizer=optax.adamw(3e-3, weight_decay=0.01),
    loss_fn=lm_loss,  # (sum of cross-entropy over unmasked tokens, their count)
    batches=lm_batches(8, 2, seq_len=SEQ),
    name="rng-lm",
)


step = gspmd_step  # the user's correct step (_lm_steps.py)

FAULTS = {
    # a pmean of gradients already divided by the global count: x 1/S
    "averaged_twice": (shard_map_step(mean=jax.lax.pmean), "averaged_twice"),
    # the gradients reduced over 'data' only: the copies along 'fsdp' differ
    "missed_fsdp": (shard_map_step(grads_over=("data",)), "wrong_axis_reduction"),
}
