"""shardcheck's pytest plugin: N fake CPU devices and meshes, so a user's CI checks sharded steps on CPU.

Installed with shardcheck and loaded by pytest through the ``pytest11`` entry point ``shardcheck`` (disable it
with ``-p no:shardcheck``). It imports nothing from JAX until a test asks for a fixture, or the command line
asks for devices.

* ``--shardcheck-devices N`` (or the ini value ``shardcheck_devices = N``): JAX gets N CPU devices
  (``jax_num_cpu_devices``), set in ``pytest_configure``, before any test runs. Without it the plugin changes
  nothing, so a suite that fakes its own devices (a ``conftest.py`` calling
  ``jax.config.update("jax_num_cpu_devices", 8)``) keeps them.
* ``shardcheck_devices``: the fixture giving the first N devices of ``jax.devices()`` (all of them without the
  option); the test is skipped, with a reason, when fewer exist.
* ``shardcheck_mesh``: a factory fixture, ``shardcheck_mesh(4)`` (a 1-D ``"data"`` mesh of 4 devices) or
  ``shardcheck_mesh({"data": 2, "fsdp": 4})`` (those axes, in that order), built by
  :func:`shardcheck.make_mesh` (``AxisType.Auto`` axes); the test is skipped, with a reason, when the mesh
  needs more devices than exist.

``docs/testing.md`` has a complete example test file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest

OPTION = "--shardcheck-devices"
INI = "shardcheck_devices"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardcheck", "shardcheck: fake CPU devices and meshes for sharded-step tests")
    group.addoption(
        OPTION,
        dest=INI,
        default=None,
        metavar="N",
        help="give JAX N fake CPU devices (jax_num_cpu_devices) before any test runs; default: unchanged",
    )
    parser.addini(INI, help="as --shardcheck-devices N (the command line wins)", default=None)


def requested_devices(config: pytest.Config) -> int | None:
    """N from ``--shardcheck-devices N``, else from the ini value ``shardcheck_devices``; None when unset.

    Raises:
        pytest.UsageError: a value that is not an integer >= 1.
    """
    for source, value in ((OPTION, config.getoption(INI)), (INI, config.getini(INI))):
        if value is None or str(value).strip() == "":
            continue
        text = str(value).strip()
        if not text.isdigit() or int(text) < 1:
            raise pytest.UsageError(
                f"shardcheck pytest plugin: {source}={text!r} is not a device count; give an integer >= 1, "
                f"e.g. {OPTION} 8"
            )
        return int(text)
    return None


def pytest_configure(config: pytest.Config) -> None:
    n = requested_devices(config)
    if n is None:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # a conftest or plugin already ran a JAX computation
        raise pytest.UsageError(
            f"shardcheck pytest plugin: {OPTION} {n} came too late: JAX's backend had already started "
            f"({err}); remove the JAX computation from import time (conftest.py, a plugin), or set the "
            "devices there with jax.config.update('jax_num_cpu_devices', N) and drop the option"
        ) from None


def _skip_unless(needed: int, what: str) -> list:
    import jax

    devices = jax.devices()
    if needed > len(devices):
        fix = f"on CPU run pytest {OPTION} {needed}"
        if jax.process_count() > 1:
            fix = "launch more processes or devices per process"
        pytest.skip(f"{what} needs {needed} devices, {len(devices)} available; {fix}")
    return devices[:needed]


@pytest.fixture
def shardcheck_devices(request: pytest.FixtureRequest) -> list:
    """The first N devices of ``jax.devices()`` (N from ``--shardcheck-devices``; every device without it).

    Skips the test when fewer than N devices exist (``--shardcheck-devices`` fakes CPU devices only: on an
    accelerator JAX lists the real ones).
    """
    import jax

    n = requested_devices(request.config)
    return _skip_unless(len(jax.devices()) if n is None else n, "this test")


@pytest.fixture
def shardcheck_mesh():
    """A factory: ``shardcheck_mesh(shape)`` is ``shardcheck.make_mesh(shape)``, or a skip.

    ``shape`` is a device count N (a 1-D mesh on axis ``"data"``) or a mapping of axis names to sizes such as
    ``{"data": 2, "fsdp": 4}``. The test is skipped, with a reason, when the mesh needs more devices than
    exist; bad shapes raise :func:`shardcheck.make_mesh`'s ``TypeError`` / ``ValueError``.
    """

    def build(shape, axis_name: str = "data"):
        import shardcheck

        if isinstance(shape, Mapping):
            sizes = list(shape.values())
            needed = math.prod(sizes) if all(isinstance(s, int) for s in sizes) else 0
            listed = " x ".join(f"{name}={size}" for name, size in shape.items())
        else:
            needed = shape if isinstance(shape, int) and not isinstance(shape, bool) else 0
            listed = f"{axis_name}={shape}"
        if needed > 0:
            _skip_unless(needed, f"the mesh {listed}")
        return shardcheck.make_mesh(shape, axis_name=axis_name)

    return build
