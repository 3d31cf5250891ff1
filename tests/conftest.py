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
