"""A tiny character-level decoder-only transformer on the package's own corpus, with padded rows.

The model is written the way the Flax NNX examples write one: token embeddings (``nnx.Embed``) plus learned
position embeddings, ``num_layers`` pre-LayerNorm blocks of causal ``nnx.MultiHeadAttention`` and a GELU MLP, a
final ``nnx.LayerNorm`` and a projection to the vocabulary. It has no dropout and no batch statistics, so a
sharded step is equivalent to the full-batch one.

The corpus (``corpus.txt``, shipped as package data) is the two seed documents ``docs/seeds/*.txt`` joined by a
blank line. Token id 0 is padding; the characters, sorted, are ids 1..V.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import inspect
import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardcheck import _validate, datasets
from shardcheck.task import Task
from shardcheck.tasks.loading import DEFAULT_STEPS, check_sizes, resolve_optimizer

PAD_ID = 0
CORPUS_FILE = "corpus.txt"


# -------------------------------------------------------------------------------------------------- corpus


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
    """The package's corpus text (UTF-8), read with ``importlib.resources``."""
    return importlib.resources.files("shardcheck.tasks").joinpath(CORPUS_FILE).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def corpus_vocab() -> tuple[str, ...]:
    """The corpus's characters, sorted; character ``vocab[i]`` has token id ``i + 1`` (id 0 is padding)."""
    return tuple(sorted(set(load_corpus())))


def vocab_size() -> int:
    """V + 1: the corpus's distinct characters plus the padding id 0."""
    return len(corpus_vocab()) + 1


def encode(text: str) -> np.ndarray:
    """Token ids ``(len(text),)`` int32 of ``text``.

    Raises:
        ValueError: a character outside the corpus vocabulary (the message names it).
    """
    table = {c: i + 1 for i, c in enumerate(corpus_vocab())}
    unknown = sorted({c for c in text if c not in table})
    if unknown:
        raise ValueError(
            f"encode: character(s) {unknown} are not in the corpus vocabulary of {len(table)} characters"
        )
    return np.fromiter((table[c] for c in text), dtype=np.int32, count=len(text))


def decode(ids) -> str:
    """The text of token ids; padding (id 0) is dropped."""
    vocab = corpus_vocab()
    return "".join(vocab[int(i) - 1] for i in np.asarray(ids).ravel() if int(i) != PAD_ID)


# --------------------------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    """Sizes of :class:`TinyLM`.

    Attributes:
        vocab_size: token ids ``[0, vocab_size)``, id 0 padding; default the corpus's (:func:`vocab_size`).
        d_model: embedding width, divisible by ``num_heads``.
        num_heads: attention heads.
        num_layers: transformer blocks.
        seq_len: the longest sequence T (the number of learned positions).
        mlp_dim: hidden width of each block's MLP.

    Raises (on construction):
        TypeError: a size that is not an int.
        ValueError: a size < 1, or ``d_model`` not divisible by ``num_heads``.
    """

    vocab_size: int = dataclasses.field(default_factory=vocab_size)
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 2
    seq_len: int = 32
    mlp_dim: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _validate.check_int("TinyLMConfig", f.name, getattr(self, f.name))
        if self.vocab_size < 2:
            raise ValueError(
                f"TinyLMConfig: vocab_size must be >= 2 (padding plus one token), got {self.vocab_size}"
            )
        if self.d_model % self.num_heads:
            raise ValueError(
                f"TinyLMConfig: d_model={self.d_model} is not divisible by num_heads={self.num_heads}; each head "
                "gets d_model / num_heads features"
            )


def _partitioned(layer: type, axis: str | None, **specs: str) -> dict:
    """Each ``NAME_init`` of ``specs``: the layer's own default initializer wrapped in ``nnx.with_partitioning``,
    one character of the spec per dimension (``"M"``: the tensor-parallel ``axis``, ``"-"``: None); nothing when
    ``axis`` is None. The default is read from the layer's signature, so the values are the unannotated layer's."""
    if axis is None:
        return {}
    params = inspect.signature(layer.__init__).parameters
    out = {}
    for name, spec in specs.items():
        init = params[name].default
        if init is None:  # MultiHeadAttention's out_kernel_init / out_bias_init: kernel_init / bias_init
            init = params[name.removeprefix("out_")].default
        out[name] = nnx.with_partitioning(init, tuple(axis if c == "M" else None for c in spec))
    return out


class Block(nnx.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; ``(B, T, d)`` in and out.

    With ``tensor_axis`` its parameters carry Megatron-style tensor-parallel annotations (Shoeybi et al.,
    "Megatron-LM", 2019, section 3; written as the Flax NNX guide writes them, ``nnx.with_partitioning``): the
    attention's query / key / value kernels ``(d, heads, head_dim)`` and biases split by heads
    (column-parallel), its output kernel ``(heads, head_dim, d)`` split by heads (row-parallel), ``fc1``
    column-parallel ``(None, axis)`` with its bias ``(axis,)``, ``fc2`` row-parallel ``(axis, None)``; the
    row-parallel biases and the LayerNorms are annotated replicated.

    Args:
        config: the sizes.
        dtype: the computation dtype of every layer (default float32).
        param_dtype: the parameter dtype (default float32).
        tensor_axis: the mesh axis of tensor parallelism (e.g. ``"model"``), or None (no annotations).
        rngs: initializer keys.
    """

    def __init__(
        self,
        config: TinyLMConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        tensor_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        d, m = config.d_model, tensor_axis
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = _partitioned(nnx.LayerNorm, m, scale_init="-", bias_init="-")
        self.ln1 = nnx.LayerNorm(d, **kw, **norm)
        attn = _partitioned(
            nnx.MultiHeadAttention,
            m,
            kernel_init="-M-",
            bias_init="M-",
            out_kernel_init="M--",
            out_bias_init="-",
        )
        self.attn = nnx.MultiHeadAttention(
            num_heads=config.num_heads,
            in_features=d,
            qkv_features=d,
            out_features=d,
            decode=False,
            **kw,
            **attn,
        )
        self.ln2 = nnx.LayerNorm(d, **kw, **norm)
        self.fc1 = nnx.Linear(
            d, config.mlp_dim, **kw, **_partitioned(nnx.Linear, m, kernel_init="-M", bias_init="M")
        )
        self.fc2 = nnx.Linear(
            config.mlp_dim, d, **kw, **_partitioned(nnx.Linear, m, kernel_init="M-", bias_init="-")
        )

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class TinyLM(nnx.Module):
    """A decoder-only transformer: ``(B, T)`` int token ids -> ``(B, T, vocab_size)`` next-token logits.

    Args:
        config: the sizes (default :class:`TinyLMConfig` ()).
        dtype: the computation dtype of every layer (default float32).
        param_dtype: the parameter dtype (default float32).
        tensor_axis: the mesh axis of tensor parallelism, or None: each :class:`Block` is annotated
            Megatron-style over it; the embeddings, the final LayerNorm and the head are annotated replicated.
        rngs: initializer keys; ``nnx.Rngs(seed)`` gives the same parameters for the same seed (with or without
            ``tensor_axis``: the annotations change no value).
    """

    def __init__(
        self,
        config: TinyLMConfig | None = None,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        tensor_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        config = TinyLMConfig() if config is None else config
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        m = tensor_axis
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, **kw, **_partitioned(nnx.Embed, m, embedding_init="--")
        )
        self.pos_embed = nnx.Embed(
            config.seq_len, config.d_model, **kw, **_partitioned(nnx.Embed, m, embedding_init="--")
        )
        self.blocks = nnx.List([Block(config, **kw, tensor_axis=m) for _ in range(config.num_layers)])
        self.ln_f = nnx.LayerNorm(
            config.d_model, **kw, **_partitioned(nnx.LayerNorm, m, scale_init="-", bias_init="-")
        )
        head = _partitioned(nnx.Linear, m, kernel_init="--", bias_init="-")
        self.lm_head = nnx.Linear(config.d_model, config.vocab_size, **kw, **head)

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Logits ``(B, T, vocab_size)``.

        Args:
            tokens: ``(B, T)`` int token ids, T <= ``config.seq_len``.
            mask: ``(B, T)`` validity (nonzero: a real token); default ``tokens != 0``. Attention is causal and
                ignores padded positions.

        Raises:
            ValueError: ``tokens`` not 2-D, or longer than ``config.seq_len``.
        """
        if tokens.ndim != 2 or tokens.shape[1] > self.config.seq_len:
            raise ValueError(
                f"TinyLM: tokens must have shape (B, T) with T <= seq_len={self.config.seq_len}, got "
                f"{tuple(tokens.shape)}"
            )
        valid = tokens != PAD_ID if mask is None else mask > 0
        attn_mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(valid, valid))
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.lm_head(self.ln_f(x))


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Token-weighted next-token cross-entropy: ``(sum of CE over unmasked tokens, their count)``.

    Args:
        model: maps ``(tokens, mask)`` to ``(B, T, V)`` logits.
        batch: ``{"tokens": (B, T) int32, "targets": (B, T) int32, "mask": (B, T) float32}``.

    Returns:
        Two 0-d float32 arrays ``(jnp.sum(ce * mask), jnp.sum(mask))``.
    """
    logits = model(batch["tokens"], batch["mask"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


# -------------------------------------------------------------------------------------------------- batches


def lm_batches(
    batch_size: int, steps: int, *, seq_len: int = 32, seed: int = 0, pad_fraction: float = 0.5
) -> list[dict[str, np.ndarray]]:
    """``steps`` batches of next-character prediction on the corpus, with padded rows.

    The corpus is cut into non-overlapping windows of ``seq_len + 1`` characters; the windows are shuffled by
    :func:`shardcheck.datasets.minibatch_indices` (``seed``). In each batch ``max(1, round(pad_fraction * B))``
    rows (``B >= 2``: at most ``B - 1``, so full and cut rows mix) are cut at a random length in
    ``[1, seq_len)``: positions from that length on hold token and target 0 with mask 0. Every row keeps at least
    one real token. Deterministic for a given seed.

    Args:
        batch_size: B, at most the number of windows (215 for ``seq_len=32``).
        steps: number of batches.
        seq_len: T >= 2.
        seed: the shuffling and cutting seed.
        pad_fraction: the share of cut rows, in ``[0, 1]``.

    Returns:
        A list of dicts ``{"tokens": (B, T) int32, "targets": (B, T) int32, "mask": (B, T) float32}``;
        ``targets[:, t]`` is the character after ``tokens[:, t]``.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size out of range, ``pad_fraction`` outside ``[0, 1]``.
    """
    fn = "lm_batches"
    seq_len = _validate.check_int(fn, "seq_len", seq_len, minimum=2, example="seq_len=32")
    if not 0.0 <= pad_fraction <= 1.0:
        raise ValueError(f"{fn}: pad_fraction must be in [0, 1], got {pad_fraction!r}")
    ids = encode(load_corpus())
    num_windows = len(ids) // (seq_len + 1)
    if num_windows < 1:
        raise ValueError(f"{fn}: seq_len={seq_len} is longer than the corpus ({len(ids)} characters)")
    batch_size, steps, seed = check_sizes(
        fn, batch_size=batch_size, steps=steps, seed=seed, num_rows=num_windows, rows="windows"
    )
    windows = ids[: num_windows * (seq_len + 1)].reshape(num_windows, seq_len + 1)
    cut_rng = np.random.default_rng([seed, 1])
    num_cut = 0 if pad_fraction == 0 else max(1, round(pad_fraction * batch_size))
    if batch_size >= 2:
        num_cut = min(num_cut, batch_size - 1)
    batches = []
    positions = np.arange(seq_len)
    for _, idx in itertools.islice(datasets.minibatch_indices(num_windows, batch_size, seed=seed), steps):
        w = windows[idx]
        lengths = np.full(batch_size, seq_len)
        cut = cut_rng.choice(batch_size, size=num_cut, replace=False)
        lengths[cut] = cut_rng.integers(1, seq_len, size=num_cut)
        valid = positions[None, :] < lengths[:, None]
        batches.append(
            {
                "tokens": np.where(valid, w[:, :-1], PAD_ID).astype(np.int32),
                "targets": np.where(valid, w[:, 1:], PAD_ID).astype(np.int32),
                "mask": valid.astype(np.float32),
            }
        )
    return batches


def tiny_lm_task(
    *,
    config: TinyLMConfig | None = None,
    optimizer=None,
    lr: float | None = None,
    batch_size: int = 16,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    compute_dtype=None,
    param_dtype=None,
    tensor_parallel: Mapping[str, int] | None = None,
) -> Task:
    """Next-character prediction with :class:`TinyLM` on the package corpus, token-weighted.

    Batches (:func:`lm_batches`) are dicts ``{"tokens": (B, T) int32, "targets": (B, T) int32, "mask": (B, T)
    float32}`` with T = ``config.seq_len``; about half the rows are padded, so rows (and shards) hold different
    numbers of tokens. The loss is :func:`lm_loss`, the pair ``(sum of CE over unmasked tokens, their count)``,
    which shards reduce exactly for any split; ``reduction_size`` is ``B * T``.

    Args:
        config: the model sizes (default :class:`TinyLMConfig` (): d_model 32, 2 heads, 2 layers, T = 32, MLP
            128, the corpus vocabulary of 77 ids).
        optimizer: ``None`` (``"adam"``), ``"sgd"``, ``"momentum"``, ``"adam"`` or an optax transformation.
        lr: learning rate of a named optimizer (default :data:`shardcheck.optimizers.DEFAULT_LR`).
        batch_size: B, default 16 (a multiple of 8, so 8 shards split evenly).
        steps: number of batches.
        seed: seed of the parameters (``nnx.Rngs(seed)``), the shuffling and the cut lengths.
        compute_dtype: the layers' ``dtype`` (activations and matmuls), e.g. ``"bfloat16"``; default float32.
        param_dtype: the layers' ``param_dtype`` (the parameters, master weights); default float32.
        tensor_parallel: ``{axis: size}``, one mesh axis of tensor parallelism (``{"model": 4}``, what ``verify
            --task tiny-lm --mesh data=2,model=4`` passes): the tensor-parallel configuration, the model annotated
            Megatron-style over ``axis`` (:class:`Block`); without ``config`` its heads number
            ``max(2, size)`` so that they split ``size`` ways. Default None: no annotations.

    Returns:
        The :class:`~shardcheck.task.Task`; its model factory returns identical parameters on every call.

    Raises:
        TypeError: ``config`` not a :class:`TinyLMConfig`, an option of the wrong type.
        ValueError: ``config.vocab_size`` smaller than the corpus vocabulary, ``batch_size`` above the number of
            windows, a value out of range, an unknown optimizer name; ``tensor_parallel`` not one axis, or a size
            that does not divide the heads, the MLP width and ``d_model`` evenly.
    """
    fn = "tiny-lm"
    tensor_axis, config = _tensor_parallel(fn, tensor_parallel, config)
    if not isinstance(config, TinyLMConfig):
        raise TypeError(f"{fn}: config must be a TinyLMConfig, got {type(config).__name__}")
    if config.vocab_size < vocab_size():
        raise ValueError(
            f"{fn}: config.vocab_size={config.vocab_size} is smaller than the corpus vocabulary ({vocab_size()} "
            "ids with padding); leave vocab_size at its default"
        )
    tx = resolve_optimizer(fn, optimizer, lr)
    _validate.check_seed(fn, seed)
    try:
        batches = lm_batches(batch_size, steps, seq_len=config.seq_len, seed=seed)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("lm_batches:", f"{fn}:", 1)) from None

    dtypes = {
        k: jnp.dtype(v) for k, v in (("dtype", compute_dtype), ("param_dtype", param_dtype)) if v is not None
    }

    def factory() -> nnx.Module:
        return TinyLM(config, **dtypes, tensor_axis=tensor_axis, rngs=nnx.Rngs(seed))

    return Task(
        model=factory,
        optimizer=tx,
        loss_fn=lm_loss,
        batches=batches,
        name="tiny-lm",
        reduction_size=batch_size * config.seq_len,
    )


def _tensor_parallel(fn: str, tensor_parallel, config):
    """``(axis or None, config)``: the tensor-parallel axis and the config it runs (heads ``max(2, size)``)."""
    if tensor_parallel is None:
        return None, TinyLMConfig() if config is None else config
    if not isinstance(tensor_parallel, Mapping) or len(tensor_parallel) != 1:
        raise ValueError(
            f"{fn}: tensor_parallel must name one mesh axis and its size, such as {{'model': 4}}, got "
            f"{tensor_parallel!r}; the tensor-parallel configuration splits over one model axis"
        )
    ((axis, size),) = tensor_parallel.items()
    _validate.check_int(fn, f"tensor_parallel[{axis!r}]", size, minimum=1, example=f"{{{axis!r}: 4}}")
    if config is None:
        config = TinyLMConfig(num_heads=max(2, size)) if TinyLMConfig().d_model % max(2, size) == 0 else None
    sizes = {} if config is None else {"num_heads": config.num_heads, "mlp_dim": config.mlp_dim}
    if config is None or any(n % size for n in sizes.values()):
        raise ValueError(
            f"{fn}: the tensor-parallel axis {axis!r} of size {size} must divide the heads and the MLP width "
            f"evenly ({sizes or 'd_model 32'}); use a model axis of size 2 or 4 (e.g. --mesh data=2,model=4) or a "
            "TinyLMConfig whose num_heads and mlp_dim it divides"
        )
    return str(axis), config
