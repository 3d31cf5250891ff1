"""A user's task: a transformer whose parameters carry sharding annotations, with clip + AdamW on a schedule.

Written the way the Flax NNX guide "Scale up on multiple devices" and MaxText write a sharded model: every
kernel is created with ``nnx.with_partitioning(init, spec)`` naming the mesh axis ``"fsdp"``; biases and
LayerNorm scales are annotated replicated (``(None,)``). Check it with::

    shardcheck verify --task examples/annotated_lm.py:task --mesh data=2,fsdp=4
    shardcheck verify --task examples/annotated_lm.py:task --mesh data=2,fsdp=4 --candidate examples/annotated_lm.py:step
    shardcheck memory --task examples/annotated_lm.py:task --mesh data=2,fsdp=4 --measure

``step`` is the user's own jitted GSPMD step: state placed from the annotations with
``nnx.get_named_sharding``, the batch split over both axes, XLA inserting the collectives.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck.tasks.tiny_lm import lm_batches, lm_loss, vocab_size

D, HEADS, MLP, SEQ = 32, 2, 64, 16
init = nnx.initializers.lecun_normal()
zeros, ones = nnx.initializers.zeros_init(), nnx.initializers.ones_init()
replicated = (None,)


def linear(d_in, d_out, spec, rngs):
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.with_partitioning(init, spec),
        bias_init=nnx.with_partitioning(zeros, replicated),
        rngs=rngs,
    )


def layer_norm(rngs):
    return nnx.LayerNorm(
        D,
        scale_init=nnx.with_partitioning(ones, replicated),
        bias_init=nnx.with_partitioning(zeros, replicated),
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
            out_bias_init=nnx.with_partitioning(zeros, replicated),
            rngs=rngs,
        )
        self.ln2 = layer_norm(rngs)
        self.up = linear(D, MLP, ("fsdp", None), rngs)
        self.down = linear(MLP, D, (None, "fsdp"), rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class AnnotatedLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        embed_init = nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "fsdp"))
        self.embed = nnx.Embed(vocab_size(), D, embedding_init=embed_init, rngs=rngs)
        self.pos = nnx.Embed(SEQ, D, embedding_init=embed_init, rngs=rngs)
        self.block = Block(rngs)
        self.ln_f = layer_norm(rngs)
        self.head = linear(D, vocab_size(), ("fsdp", None), rngs)

    def __call__(self, tokens, mask):
        valid = mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        return self.head(self.ln_f(self.block(x, attn_mask)))


schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=10)
task = shardcheck.Task(
    model=lambda: AnnotatedLM(nnx.Rngs(0)),
    optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1)),
    loss_fn=lm_loss,  # (sum of cross-entropy over unmasked tokens, their count)
    batches=lm_batches(16, 5, seq_len=SEQ),
    name="annotated-lm",
)


@nnx.jit
def _train_step(model, optimizer, batch):
    def mean_loss(model):
        loss_sum, count = lm_loss(model, batch)
        return loss_sum / count

    loss, grads = nnx.value_and_grad(mean_loss)(model)
    optimizer.update(model, grads)
    return loss


def step(model, optimizer, batch, mesh):
    """The user's GSPMD step: state placed from its annotations, the batch over every mesh axis."""
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    return _train_step(model, optimizer, batch)
