"""Test configuration: 8 fake CPU devices, set before JAX initializes its backend."""

import jax
from hypothesis import settings

jax.config.update("jax_num_cpu_devices", 8)

# Jit compilation makes the first example of each shape slow: no per-example deadline.
settings.register_profile("shardcheck", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("shardcheck")


def require_devices(n: int):
    """A pytest skip marker for tests needing ``n`` devices."""
    import pytest

    return pytest.mark.skipif(
        len(jax.devices()) < n, reason=f"needs {n} devices, {len(jax.devices())} available"
    )
