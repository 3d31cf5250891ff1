"""Named sizes of the tiny-lm task, up to a ~1B-parameter Llama-like shape, for sizing memory ahead of time.

Each size is a :class:`~shardcheck.tasks.tiny_lm.TinyLMConfig` (layers, width, heads, MLP width, vocabulary,
sequence length) of the same decoder-only :class:`~shardcheck.tasks.tiny_lm.TinyLM`: learned position embeddings,
pre-LayerNorm blocks of biased multi-head attention and a GELU MLP, an untied output projection. The large shapes
follow published models' layer shapes:

========  ======  =====  =====  =====  ======  =====  ============  ==========================================
size      layers  width  heads  MLP    vocab   T      parameters    shape of
========  ======  =====  =====  =====  ======  =====  ============  ==========================================
tiny      2       32     2      128    77      32     31,501        the default ``TinyLMConfig()``
small     4       128    4      512    77      128    829,517       (a quick multi-device run)
125m      12      768    12     3072   32,000  2048   135,812,864   GPT-3 Small (Brown et al. 2020, Table 2.1)
350m      24      1024   16     4096   32,000  2048   369,976,576   GPT-3 Medium (Brown et al. 2020, Table 2.1)
1b        16      2048   32     8192   32,000  2048   941,034,752   Llama 3.2 1B's blocks (16 x 2048, 32 heads,
                                                                    MLP 8192; Meta's model card) with the
                                                                    32,000-token vocabulary of Llama 2
========  ======  =====  =====  =====  ======  =====  ============  ==========================================

The counts differ from the named models' because TinyLM keeps biases, a two-matrix GELU MLP (not SwiGLU), learned
positions and an untied output projection (:func:`param_count` gives the formula). The corpus has 77 token ids,
so a size with a larger vocabulary trains on the corpus's first 77 ids; its embedding tables are full size.
"""

from __future__ import annotations

from shardcheck.task import Task
from shardcheck.tasks.tiny_lm import TinyLMConfig, encode, load_corpus, tiny_lm_task, vocab_size

LLAMA2_VOCAB = 32_000
"""The vocabulary of the Llama 2 tokenizer (Touvron et al. 2023), used by the sizes from 125m up."""


def _sizes() -> dict[str, dict[str, int]]:
    corpus = vocab_size()
    return {
        "tiny": {},
        "small": dict(num_layers=4, d_model=128, num_heads=4, mlp_dim=512, seq_len=128, vocab_size=corpus),
        "125m": dict(
            num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, seq_len=2048, vocab_size=LLAMA2_VOCAB
        ),
        "350m": dict(
            num_layers=24, d_model=1024, num_heads=16, mlp_dim=4096, seq_len=2048, vocab_size=LLAMA2_VOCAB
        ),
        "1b": dict(
            num_layers=16, d_model=2048, num_heads=32, mlp_dim=8192, seq_len=2048, vocab_size=LLAMA2_VOCAB
        ),
    }


SIZES: tuple[str, ...] = ("tiny", "small", "125m", "350m", "1b")
"""The names :func:`size_config` knows, smallest first."""


def size_config(name: str) -> TinyLMConfig:
    """The :class:`TinyLMConfig` of a named size (see the module's table).

    Raises:
        ValueError: an unknown name (the message lists :data:`SIZES`).
    """
    if name not in SIZES:
        raise ValueError(f"--size {name!r} is not a tiny-lm size; use one of {', '.join(SIZES)}")
    return TinyLMConfig(**_sizes()[name])


def param_count(config: TinyLMConfig) -> int:
    """The number of parameters of :class:`TinyLM` with ``config``, by its layers.

    ``V d`` (token embedding) ``+ T d`` (positions) ``+ L (4 d^2 + 4 d`` (query, key, value, output kernels and
    biases) ``+ 4 d`` (two LayerNorms) ``+ 2 d m + m + d)`` (the MLP) ``+ 2 d`` (final LayerNorm) ``+ d V + V``
    (output projection), with V the vocabulary, T the sequence length, L layers, d the width and m the MLP width.
    """
    v, t, d, m, n = config.vocab_size, config.seq_len, config.d_model, config.mlp_dim, config.num_layers
    block = 4 * d * d + 4 * d + 4 * d + 2 * d * m + m + d
    return v * d + t * d + n * block + 2 * d + d * v + v


def num_windows(seq_len: int) -> int:
    """How many training rows of ``seq_len + 1`` characters the corpus holds (the largest batch it gives)."""
    return len(encode(load_corpus())) // (seq_len + 1)


def size_task(
    name: str, *, optimizer=None, lr: float | None = None, batch_size: int | None = None, seed: int = 0
) -> Task:
    """The tiny-lm task at a named size: :func:`~shardcheck.tasks.tiny_lm.tiny_lm_task` with :func:`size_config`.

    Its real batch (one step) has ``batch_size`` rows, default ``min(16, rows the corpus holds at that sequence
    length)``: 3 rows of 2048 tokens for the sizes from 125m up. Sizing a larger batch needs no data: compile the
    step for any batch with :func:`shardcheck.ahead_of_time.compile_ahead_of_time` (``batch_size=``), which builds the
    batch as shapes only.

    Raises:
        ValueError: an unknown size, and the errors of ``tiny_lm_task`` (a batch larger than the corpus gives).
    """
    config = size_config(name)
    rows = min(16, num_windows(config.seq_len)) if batch_size is None else batch_size
    return tiny_lm_task(config=config, optimizer=optimizer, lr=lr, batch_size=rows, steps=1, seed=seed)
