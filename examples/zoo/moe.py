"""A top-k routed mixture-of-experts regressor, and the user's expert-parallel ``jax.shard_map`` step.

The layer is written as the Flax NNX docs write a custom layer (``nnx.Param`` for the stacked weights, an
``nnx.Linear`` router) and as Switch / GShard write routing: a router ``nnx.Linear`` scores the E experts per
token, ``jax.lax.top_k`` keeps the best K, their softmax gates the experts' outputs (Shazeer et al., "Outrageously
large neural networks", 2017; Fedus et al., "Switch Transformers", 2021). The E experts' weights are two stacked
parameters ``(E, D, H)`` and ``(E, H, D)`` annotated ``("expert", None, None)``. Each token is sent to its
experts without a capacity limit (no token is dropped, so the split of the batch cannot change the routing).
The loss adds ST-MoE's router z-loss (Zoph et al., "ST-MoE", 2022: the mean of ``logsumexp(logits)^2``), a
per-token term, so the loss is a sum over tokens and the sharded step can equal the full-batch one. Check it
with::

    shardcheck verify --task examples/zoo/moe.py:task --mesh data=2,expert=4
    shardcheck verify --task examples/zoo/moe.py:task --mesh data=2,expert=4 --candidate examples/zoo/moe.py:step

``step`` is the user's expert-parallel step (DeepSpeed-MoE, GShard): the tokens are split over every device
(``data`` x ``expert``); each device routes its tokens, the ``expert`` group all-gathers them (the dispatch),
each device runs its E/4 experts on the group's tokens, and the combined outputs are reduce-scattered back to
the tokens' owners (the combine). The router and the other replicated weights are reduced over both axes, the
experts over ``data`` (the expert group's tokens are already in their gradient), all divided once by the total
token count.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardcheck

D, H, E, K, OUT = 8, 16, 4, 2, 4  # width, expert hidden width, experts, experts per token, outputs
Z_LOSS = 1e-2  # weight of the router z-loss
MESH = {"data": 2, "expert": 4}
TOKENS = ("data", "expert")  # the user's step splits the tokens over every device


class MoE(nnx.Module):
    """Top-K routed experts: ``x (N, D) -> (y (N, D), z (N,))``, ``z`` the router's ``logsumexp(logits)^2``."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (E, D, H)), out_sharding=("expert", None, None))
        self.w_out = nnx.Param(init(rngs.params(), (E, H, D)), out_sharding=("expert", None, None))

    def __call__(self, x, expert_axis=None):
        logits = self.router(x)  # (N, E)
        top, index = jax.lax.top_k(logits, K)  # (N, K): the K best experts of each token
        gates = jax.nn.softmax(top, axis=-1)
        combine = jnp.einsum("nk,nke->ne", gates, jax.nn.one_hot(index, E, dtype=gates.dtype))  # (N, E)
        z = jax.nn.logsumexp(logits, axis=-1) ** 2
        if expert_axis is not None:  # inside shard_map: this device holds E / |expert| of the experts
            x = jax.lax.all_gather(x, expert_axis, tiled=True)  # dispatch: the group's tokens
            combine = jax.lax.all_gather(combine, expert_axis, tiled=True)
            local = self.w_in.shape[0]
            start = jax.lax.axis_index(expert_axis) * local
            combine = jax.lax.dynamic_slice_in_dim(combine, start, local, axis=1)
        h = nnx.gelu(jnp.einsum("nd,edh->neh", x, self.w_in[...]))
        y = jnp.einsum("ne,ned->nd", combine, jnp.einsum("neh,ehd->ned", h, self.w_out[...]))
        if expert_axis is not None:  # combine: each token's output back to its owner, summed over the experts
            y = jax.lax.psum_scatter(y, expert_axis, scatter_dimension=0, tiled=True)
        return y, z


class MoERegressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.moe = MoE(rngs)
        self.head = nnx.Linear(D, OUT, rngs=rngs)

    def __call__(self, x, expert_axis=None):
        y, z = self.moe(self.norm(x), expert_axis)
        return self.head(x + y), z


def loss_fn(model, batch, **kw):
    """``(sum over rows of the squared error + Z_LOSS * z, the number of rows)``."""
    pred, z = model(batch["x"], **kw)
    per_row = jnp.sum((pred - batch["y"]) ** 2, axis=-1) + Z_LOSS * z
    return jnp.sum(per_row), jnp.asarray(per_row.shape[0], jnp.float32)


def _batches(n=3, rows=32):
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(D, OUT)) / np.sqrt(D)
    out = []
    for _ in range(n):
        x = rng.normal(size=(rows, D)).astype(np.float32)
        out.append({"x": x, "y": np.tanh(x @ teacher).astype(np.float32)})
    return out


task = shardcheck.Task(
    model=lambda: MoERegressor(nnx.Rngs(0)),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=_batches(),
    name="moe",
)


def _expert_leaf(spec) -> bool:
    return "expert" in tuple(spec)


def _reduce(grads, specs, count_local, *, expert_count_axes=TOKENS, replicated_axes=TOKENS):
    """Each gradient summed over the axes its leaf is replicated on, divided by the token count."""
    total = jax.lax.psum(count_local, TOKENS)
    expert_total = jax.lax.psum(count_local, expert_count_axes)

    def one(g, spec):
        if _expert_leaf(spec):
            return jax.lax.psum(g, "data") / expert_total
        return jax.lax.psum(g, replicated_axes) / total

    return jax.tree.map(one, grads, specs, is_leaf=lambda x: isinstance(x, P))


def _make_step(check_vma=True, **reduce_kw):
    @functools.partial(nnx.jit, static_argnums=3)  # the whole step one program
    def train(model, optimizer, batch, mesh):
        graphdef, params = nnx.split(model, nnx.Param)
        specs = nnx.get_partition_spec(params)

        def body(p, b):
            # every local gradient stays local (no implicit psum, docs/reduction_cases.md C2): reduced below
            p = jax.tree.map(lambda a, s: jax.lax.pcast(a, _replicated(s), to="varying"), p, specs)

            def local(p):
                return loss_fn(nnx.merge(graphdef, p), b, expert_axis="expert")

            (total, count), grads = jax.value_and_grad(local, has_aux=True)(p)
            loss = jax.lax.psum(total, TOKENS) / jax.lax.psum(count, TOKENS)
            return loss, _reduce(grads, specs, count, **reduce_kw)

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(specs, P(TOKENS)), out_specs=(P(), specs), check_vma=check_vma
        )
        loss, grads = mapped(params, batch)
        optimizer.update(model, grads)
        return loss

    def user_step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))  # placed as annotated before the step: one compile per mesh
        nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        return train(model, optimizer, batch, mesh)

    return user_step


def _replicated(spec) -> tuple[str, ...]:
    return ("data",) if _expert_leaf(spec) else TOKENS


_correct = _make_step()


def step(model, optimizer, batch, mesh):
    """The user's expert-parallel step on a ``data x expert`` mesh; returns the pre-update loss."""
    return _correct(model, optimizer, batch, mesh)


# The experts' gradients divided by the token count of the axes they were summed over (data: 1/4 of the tokens):
# they sum the whole expert group's tokens, so they come out x4, the size of the expert group.
experts_not_divided_by_group = _make_step(expert_count_axes=("data",))
# The replicated weights (router, norm, head) summed over 'data' only, as if the tokens were not split over
# 'expert' too; check_vma=False lets the step return copies that differ along 'expert'.
router_reduced_over_data_only = _make_step(check_vma=False, replicated_axes=("data",))

FAULTS = {
    "experts_not_divided_by_group": (experts_not_divided_by_group, "expert_scaling"),
    "router_reduced_over_data_only": (router_reduced_over_data_only, "wrong_axis_reduction"),
}
