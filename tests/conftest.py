"""Test configuration: 8 fake CPU devices, set before JAX initializes its backend."""

import os

import jax
from hypothesis import settings

# The command line turns on JAX's persistent compilation cache; the tests keep compilation in memory, so that
# they neither write to the user's cache folder nor depend on what an earlier run left there.
os.environ.setdefault("SHARDCHECK_COMPILATION_CACHE", "off")

jax.config.update("jax_num_cpu_devices", 8)

# Jit compilation makes the first example of each shape slow: no per-example deadline.
settings.register_profile("shardcheck", deadline=None, max_examples=15, derandomize=True)
settings.load_profile("shardcheck")


def require_devices(n: int):
    """A pytest skip marker for tests needing ``n`` devices."""
    import pytest

    return pytest.mark.skipif(
        len(jax.devices()) < n, reason=f"needs {n} devices, {len(jax.devices())} available"
    )


def small_lm_config():
    """One block of the built-in tiny-lm's layers at width 16 (the default: two at 32): every leaf kind of the
    default model and each of its FSDP placements (split along dimension 0, along dimension 1, replicated: the
    77-id vocabulary splits neither 4 nor 8 ways), in about two thirds of its compile time. The default model
    itself is checked through the command line (tests/test_cli_task.py)."""
    from shardcheck.tasks import TinyLMConfig

    return TinyLMConfig(d_model=16, num_heads=2, num_layers=1, seq_len=16, mlp_dim=32)
