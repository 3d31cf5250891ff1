"""The per-shard-normalization hypothesis where a step splits the tokens, not only the rows (issue #36 trial 45).

A context-parallel step places the batch ``P('data', 'seq')``: each device holds a block of rows and a block of
positions, and a ``(loss_sum, weight)`` loss divided per device by its own token count averages means of
``data x seq`` blocks, not of row shards. The row split of :func:`~shardcheck.parity.diagnosis.per_shard.
per_shard_mean_grads` then reproduces nothing; this split does. Each block's ``(loss_sum, weight)`` is read from
the whole batch's forward pass with the batch's floating ``(B, T)`` leaves (its per-token weights or mask) zeroed
outside the block, so the positions, the causal mask and the keys of earlier blocks are the full sequence's, as a
correct context-parallel forward pass computes them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardcheck.task import loss_terms


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    """A split of a batch into ``rows x blocks`` shards: ``rows`` blocks of its rows (over the mesh's batch axes
    ``row_axes``) times ``blocks`` blocks of its axis 1, the tokens (over the other axes ``token_axes``)."""

    rows: int
    blocks: int
    row_axes: tuple[str, ...]
    token_axes: tuple[str, ...]

    @property
    def shards(self) -> int:
        """S, the number of shards: ``rows * blocks``."""
        return self.rows * self.blocks

    def words(self) -> str:
        """The split in words: ``"data x seq blocks of tokens"``."""
        return f"{' x '.join((*self.row_axes, *self.token_axes))} blocks of tokens"


def token_split(mesh, batch) -> TokenSplit | None:
    """The split a step placing ``batch`` over every axis of ``mesh`` (rows over the batch axes, axis 1 over the
    others) gives, where ``mesh`` has an axis beside its batch axes, ``batch`` has a floating ``(B, T)`` leaf (the
    weights a ``(loss_sum, weight)`` loss reads) and the sizes divide B and T; ``None`` otherwise (no mesh, a mesh
    of batch axes only, no such leaf)."""
    from shardcheck.mesh import batch_axes, model_axes

    if mesh is None or not hasattr(mesh, "shape"):
        return None
    sizes = dict(mesh.shape)
    rows_ax, tokens_ax = batch_axes(mesh), model_axes(mesh)
    rows, blocks = math.prod(sizes[a] for a in rows_ax), math.prod(sizes[a] for a in tokens_ax)
    shape = _weights_shape(batch)
    if not tokens_ax or blocks < 2 or shape is None or shape[0] % rows or shape[1] % blocks:
        return None
    return TokenSplit(rows, blocks, tuple(rows_ax), tuple(tokens_ax))


def _weights_shape(batch) -> tuple[int, int] | None:
    """``(B, T)`` of ``batch``'s floating leaves of two dimensions; ``None`` where it has none or several shapes."""
    shapes = {tuple(np.shape(a)) for a in jax.tree.leaves(batch) if _is_weights(a)}
    return next(iter(shapes)) if len(shapes) == 1 else None


def _is_weights(a) -> bool:
    return np.ndim(a) == 2 and jnp.issubdtype(jnp.result_type(a), jnp.floating)


def _masks(split: TokenSplit, b: int, t: int) -> np.ndarray:
    """``[S, B, T]`` float32: shard ``r * blocks + j`` is 1 on rows block r and tokens block j (the device order
    of a ``P(row_axes, token_axes)`` placement)."""
    r = np.arange(b) // (b // split.rows)
    j = np.arange(t) // (t // split.blocks)
    shard = r[:, None] * split.blocks + j[None, :]
    return (shard[None] == np.arange(split.shards)[:, None, None]).astype(np.float32)


def _masked(batch, mask):
    return jax.tree.map(lambda a: a * mask.astype(a.dtype) if _is_weights(a) else a, batch)


def token_shard_grads(loss_fn, split: TokenSplit, graphdef, params, rest, batch):
    """The gradient of the mean over ``split``'s S shards of each shard's ``loss_sum / weight`` (a shard of weight
    0 adds 0), a tree like ``params``; ``None`` where the batch has no weights to mask or the loss does not trace
    so (a mean loss)."""
    shape = _weights_shape(batch)
    if shape is None:
        return None
    try:
        return _token_grads(loss_fn, graphdef, params, rest, batch, jnp.asarray(_masks(split, *shape)))
    except (TypeError, ValueError):
        return None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _token_grads(loss_fn, graphdef, params, rest, batch, masks):
    def shard_grad(mask):
        def mean(p):
            total, weight = loss_terms(loss_fn, nnx.merge(graphdef, p, rest, copy=True), _masked(batch, mask))
            if weight is None:
                raise TypeError("a mean loss: no weight to divide per shard")
            return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)

        return jax.grad(mean)(params)

    return jax.tree.map(lambda g: jnp.mean(g, axis=0), jax.lax.map(shard_grad, masks))


def token_grads_agree(
    loss_fn, split: TokenSplit, graphdef, params, rest, batch, cand_grads, tolerance: dict
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``(agree, differ)``: the gradient leaves (dotted paths, sorted) where the candidate's returned gradients
    ``cand_grads`` (a tree like ``params``) are, within ``tolerance`` (``{path: allowed abs err}``, the record's
    gradient tolerances), the gradient of the mean of ``split``'s per-shard means (:func:`token_shard_grads`),
    and where they are not; ``None`` where no gradients were returned or that gradient cannot be computed. A
    context-parallel step that divides each device's gradient by its own block's count (trial 45) gives it on
    the leaves whose gradient holds the device's own block's terms only (the head, the embeddings' rows it
    reads), not on those the other blocks' tokens send terms back to (the keys' and values' kernels, through
    the all-gather's transpose)."""
    from shardcheck.parity.comparison.live import flatten_state

    if cand_grads is None or not tolerance:
        return None
    grads = token_shard_grads(loss_fn, split, graphdef, params, rest, batch)
    if grads is None:
        return None
    cand, hyp = flatten_state(nnx.as_pure(cand_grads)), flatten_state(grads)
    agree, differ = [], []
    for path, tol in sorted(tolerance.items()):
        if path not in cand or path not in hyp:
            continue
        c, h = np.asarray(cand[path], np.float64), np.asarray(hyp[path], np.float64)
        close = c.shape == h.shape and float(np.max(np.abs(c - h), initial=0.0)) <= tol
        (agree if close else differ).append(path)
    return tuple(agree), tuple(differ)


def token_shard_weights(
    loss_fn, split: TokenSplit, graphdef, params, rest, batch
) -> tuple[float, ...] | None:
    """Each of ``split``'s S shards' own loss weight (floats in shard order); ``None`` where it cannot be read."""
    from shardcheck.task import batch_weight

    shape = _weights_shape(batch)
    if shape is None:
        return None
    try:
        weights = [
            batch_weight(loss_fn, graphdef, params, rest, _masked(batch, jnp.asarray(m)))
            for m in _masks(split, *shape)
        ]
    except (TypeError, ValueError):
        return None
    return None if any(w is None for w in weights) else tuple(float(w) for w in weights)


def token_loss_value(loss_fn, split: TokenSplit | None, graphdef, params, rest, batch, record) -> bool:
    """Whether the loss the candidate returned (``record.candidate_loss``) from the state ``(graphdef, params,
    rest)`` is the mean over ``split``'s S shards of each shard's ``loss_sum / weight`` (each rows x tokens block
    divided by its own count, the means averaged), within the loss's tolerance, while the full batch's loss differs
    from it by more (trial 45: a context-parallel step's per-device means, loss 1.025 x the reference's; its
    gradients, each device's divided by its own count after the all-gather's transpose brought it the other
    blocks' terms, are no gradient of one loss). ``False`` where the loss matched, none was returned, there is
    no split, or the loss does not trace so."""
    loss = next((e for e in record.leaves if e.kind == "loss"), None)
    shape = _weights_shape(batch)
    if split is None or loss is None or loss.ok or record.candidate_loss is None or shape is None:
        return False
    try:
        full, means = _token_means(loss_fn, graphdef, params, rest, batch, jnp.asarray(_masks(split, *shape)))
    except (TypeError, ValueError):
        return False
    full, mean = float(full), float(jnp.mean(means))
    return abs(record.candidate_loss - mean) <= loss.tolerance < abs(mean - full)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _token_means(loss_fn, graphdef, params, rest, batch, masks):
    model = lambda: nnx.merge(graphdef, params, rest, copy=True)  # noqa: E731

    def shard_mean(mask):
        total, weight = loss_terms(loss_fn, model(), _masked(batch, mask))
        if weight is None:
            raise TypeError("a mean loss: no weight to divide per shard")
        return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)

    total, weight = loss_terms(loss_fn, model(), batch)
    return total / weight, jax.lax.map(shard_mean, masks)
