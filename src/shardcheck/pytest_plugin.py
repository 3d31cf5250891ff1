"""shardcheck's pytest plugin: N fake CPU devices and meshes, so a user's CI checks sharded steps on CPU.

Installed with shardcheck and loaded by pytest through the ``pytest11`` entry point ``shardcheck`` (disable it
with ``-p no:shardcheck``). It imports nothing from JAX until a test asks for a fixture, or the command line
asks for devices.

* ``--shardcheck-devices N`` (or the ini value ``shardcheck_devices = N``): JAX gets N CPU devices
  (``jax_num_cpu_devices``), set in ``pytest_configure``, before any test runs. Without it a suite that fakes its
  own devices (a ``conftest.py`` calling ``jax.config.update("jax_num_cpu_devices", 8)``) keeps them.
* Without the option, the first fixture that needs more devices than are configured creates them, when JAX's
  backends have not started yet: ``max(needed, 8)`` fake CPU devices (:data:`DEFAULT_FAKE_DEVICES`), so a suite
  run as plain ``pytest`` checks its meshes instead of skipping them.
* The devices come from :func:`shardcheck.devices.select_devices`: the default backend's when it has enough (8
  GPUs for an 8-device mesh), else the fake CPU devices beside it (a one-GPU host), never a mix.
* Too few devices all the same (JAX started before the fixture, with fewer): the test is skipped, with a reason
  and the fix, or, when the ``CI`` environment variable is set (``CI=true``, as GitHub Actions, GitLab CI and
  most CI services set it), it **fails** with that message, so a CI run never stays green with nothing checked.
* ``shardcheck_devices``: the fixture giving N devices (N from the option; without it, every device of the
  default backend).
* ``shardcheck_mesh``: a factory fixture, ``shardcheck_mesh(4)`` (a 1-D ``"data"`` mesh of 4 devices) or
  ``shardcheck_mesh({"data": 2, "fsdp": 4})`` (those axes, in that order), built by
  :func:`shardcheck.make_mesh` (``AxisType.Auto`` axes) on the selected devices.
* Under ``shardcheck launch -- python -m pytest`` (each worker's ``conftest.py`` joining the run with
  :func:`shardcheck.distributed.initialize_from_env`), the launcher's devices per process are the run's: the
  plugin creates none (trial 56: each process raised to 8 devices, every mesh fell on process 0, and process 1
  crashed), and a mesh takes the same number of devices from every process, or the test is skipped.

``docs/testing.md`` has a complete example test file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import pytest

OPTION = "--shardcheck-devices"
INI = "shardcheck_devices"

DEFAULT_FAKE_DEVICES = 8
"""The fewest fake CPU devices a fixture creates when it creates them (more when its mesh needs more): later
tests of the session, which cannot add devices once JAX has started, get up to 8."""


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


def _launched() -> bool:
    """Whether this is a worker of a multi-process run (``shardcheck launch``'s ``SHARDCHECK_NUM_PROCESSES`` > 1,
    or JAX's distributed runtime joined): its devices per process are the launcher's, not the plugin's to set."""
    import jax

    from shardcheck.distributed import ENV_NUM_PROCESSES

    return os.environ.get(ENV_NUM_PROCESSES, "1").strip() not in ("", "1") or jax.distributed.is_initialized()


def pytest_configure(config: pytest.Config) -> None:
    n = requested_devices(config)
    if n is None:
        return
    import jax

    if _launched():  # the launcher's --devices-per-process are the run's
        return

    _thread_pool(n)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # a conftest or plugin already ran a JAX computation
        raise pytest.UsageError(
            f"shardcheck pytest plugin: {OPTION} {n} came too late: JAX's backend had already started "
            f"({err}); remove the JAX computation from import time (conftest.py, a plugin), or set the "
            "devices there with jax.config.update('jax_num_cpu_devices', N) and drop the option"
        ) from None


def _thread_pool(num_devices: int) -> None:
    """Give XLA:CPU the command line's thread pool for ``num_devices`` fake devices (``PJRT_NPROC``; not when the
    user set it or JAX has started): with one thread per device, collective programs launched back to back can
    hang until XLA aborts the test process (``docs/known_issues.md``)."""
    from shardcheck.cli._xla import use_cpu_thread_pool

    use_cpu_thread_pool(num_devices)


def in_ci() -> bool:
    """Whether the ``CI`` environment variable says this is a CI run (set, and not ``0`` / ``false`` / ``no``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _create_devices(needed: int) -> None:
    """Ask JAX for ``max(needed, 8)`` fake CPU devices when fewer are configured and its backends have not
    started (``jax_num_cpu_devices`` cannot change after that: then nothing happens)."""
    import jax

    if jax.config.jax_num_cpu_devices >= needed or _launched():
        return
    _thread_pool(max(needed, DEFAULT_FAKE_DEVICES))
    try:
        jax.config.update("jax_num_cpu_devices", max(needed, DEFAULT_FAKE_DEVICES))
    except RuntimeError:  # JAX already started (a computation at import time, an earlier test): too late
        pass


def _devices_or_skip(config: pytest.Config, needed: int, what: str) -> list:
    """``needed`` devices (:func:`shardcheck.devices.select_devices`; without ``--shardcheck-devices``, created
    first when JAX has not started), or a skip, or under ``CI`` a failure, naming the fix."""
    import jax

    from shardcheck.devices import select_devices

    given = requested_devices(config)
    if given is None:
        _create_devices(needed)
    if jax.process_count() > 1:
        spanning = _across_processes(needed)
        if spanning is not None:
            return spanning
        available = len(jax.devices())
    else:
        try:
            return list(select_devices(needed, what=what, fn="shardcheck pytest plugin").devices)
        except ValueError:
            available = len(jax.devices("cpu"))
    fix = f"run pytest {OPTION} {needed}"
    if given is None:  # the plugin would have created them: JAX had started before the first fixture asked
        fix += " (JAX started before this test asked, so the plugin could not create them)"
    if jax.process_count() > 1:
        fix = (
            f"a mesh of a multi-process run takes the same number of devices from each of its "
            f"{jax.process_count()} processes ({available} in all); launch more processes or devices per process"
        )
    message = f"{what} needs {needed} devices, {available} available; {fix}"
    if in_ci():
        pytest.fail(f"shardcheck pytest plugin (CI is set, so no skip): {message}", pytrace=False)
    pytest.skip(message)


def _across_processes(needed: int) -> list | None:
    """``needed`` devices of a multi-process run, the same number from every process (process 0's first, in
    ``jax.devices()`` order): a mesh each process holds its part of; ``None`` where ``needed`` does not split
    evenly over the processes or some process has too few."""
    import jax

    count = jax.process_count()
    per, extra = divmod(needed, count)
    if extra or not per:
        return None
    by_process = [[d for d in jax.devices() if d.process_index == i] for i in range(count)]
    if any(len(devices) < per for devices in by_process):
        return None
    return [d for devices in by_process for d in devices[:per]]


@pytest.fixture
def shardcheck_devices(request: pytest.FixtureRequest) -> list:
    """N devices (N from ``--shardcheck-devices``; without it every device of the default backend, after
    creating 8 fake CPU devices when JAX has not started): the default backend's when it has N, else N fake CPU
    devices (a one-GPU host).

    Skips the test when fewer than N devices exist, or fails it when ``CI`` is set.
    """
    import jax

    n = requested_devices(request.config)
    if n is None:
        _create_devices(DEFAULT_FAKE_DEVICES)
    return _devices_or_skip(request.config, len(jax.devices()) if n is None else n, "this test")


@pytest.fixture
def shardcheck_mesh(request: pytest.FixtureRequest):
    """A factory: ``shardcheck_mesh(shape)`` is ``shardcheck.make_mesh(shape)``, or a skip.

    ``shape`` is a device count N (a 1-D mesh on axis ``"data"``) or a mapping of axis names to sizes such as
    ``{"data": 2, "fsdp": 4}``. The mesh's fake CPU devices are created when JAX has not started yet; when it has,
    with too few, the test is skipped with a reason, or fails when ``CI`` is set. Bad shapes raise
    :func:`shardcheck.make_mesh`'s ``TypeError`` / ``ValueError``.
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
            devices = _devices_or_skip(request.config, needed, f"the mesh {listed}")
            return shardcheck.make_mesh(shape, axis_name=axis_name, devices=devices)
        return shardcheck.make_mesh(shape, axis_name=axis_name)

    return build
