"""shardcheck's pytest plugin, run under ``pytester`` in fresh pytest processes (so JAX starts fresh in each).

The example test file is read from ``docs/testing.md``: the documented file is the tested one. It passes on 4
fake devices as written (its 8-device case skipped with the reason), and fails with the diagnosis once a fault
is planted in its step.
"""

import io
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
NO_XDIST = ("-p", "no:xdist", "-p", "no:cacheprovider")

FIXTURES = """
import jax
import pytest
from jax.sharding import AxisType


def test_devices(shardcheck_devices):
    assert len(shardcheck_devices) == 4 == jax.device_count()
    assert {d.platform for d in shardcheck_devices} == {"cpu"}


def test_mesh_shapes(shardcheck_mesh):
    mesh = shardcheck_mesh({"data": 2, "fsdp": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2} and mesh.axis_types == (AxisType.Auto,) * 2
    assert dict(shardcheck_mesh(3, axis_name="batch").shape) == {"batch": 3}


def test_a_bad_shape_is_make_mesh_error(shardcheck_mesh):
    with pytest.raises(ValueError, match="make_mesh"):
        shardcheck_mesh({"data": 0})


def test_too_few_devices(shardcheck_mesh):
    shardcheck_mesh(16)
"""


@pytest.fixture(autouse=True)
def not_in_ci(monkeypatch):
    """The pytester runs inherit the environment: without ``CI`` a short mesh skips (the tests that need ``CI``
    set it themselves)."""
    monkeypatch.delenv("CI", raising=False)


def documented_example() -> str:
    text = DOC.read_text()
    marker = text.index("<!-- the file below is the one tests/test_pytest_plugin.py runs under pytester -->")
    return re.search(r"```python\n(.*?)```", text[marker:], re.DOTALL).group(1)


def test_the_plugin_is_the_pytest11_entry_point_and_loads_without_jax():
    (point,) = [p for p in entry_points(group="pytest11") if p.name == "shardcheck"]
    assert point.value == "shardcheck.pytest_plugin"
    probe = "import sys, shardcheck.pytest_plugin; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert imported.stdout.strip() == "[]", imported.stderr  # a suite's own device setup still comes first


def test_the_documented_example_passes_on_four_fake_devices(pytester):
    pytester.makepyfile(test_my_step=documented_example(), test_fixtures=FIXTURES)
    result = pytester.runpytest_subprocess("--shardcheck-devices", "4", *NO_XDIST, "-rs", timeout=120)
    result.assert_outcomes(passed=5, skipped=2)
    out = result.stdout.str()
    for needed, mesh in ((8, "data=2 x fsdp=4"), (16, "data=16")):
        assert (
            f"the mesh {mesh} needs {needed} devices, 4 available; run pytest --shardcheck-devices {needed}"
        ) in out


def test_a_planted_fault_in_the_example_fails_with_the_diagnosis(pytester):
    correct = "    optimizer.update(model, grads)\n"
    faulty = "    optimizer.update(model, jax.tree.map(lambda g: g * jax.device_count(), grads))\n"
    source = documented_example()
    assert source.count(correct) == 1
    pytester.makepyfile(test_my_step=source.replace(correct, faulty))
    pytester.makeini("[pytest]\nshardcheck_devices = 4\n")  # the ini form of the option
    result = pytester.runpytest_subprocess(*NO_XDIST, "-k", "data4", timeout=120)
    result.assert_outcomes(failed=1, deselected=2)
    result.stdout.fnmatch_lines(
        [
            "*ParityError: parity FAIL for step 'data_parallel_step'*",
            "*summed instead of averaged (x4*",
        ]
    )


@pytest.mark.parametrize("value", ["two", "0"])
def test_a_bad_device_count_is_a_usage_error(pytester, value):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--shardcheck-devices", value, *NO_XDIST, timeout=60)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"*shardcheck pytest plugin: --shardcheck-devices='{value}' is not a device count; give an integer >= 1*"
        ]
    )


NO_OPTION = """
import os

import jax


def test_mesh_of_8(shardcheck_mesh):
    mesh = shardcheck_mesh({"data": 2, "fsdp": 4})
    assert mesh.size == 8 and {d.platform for d in mesh.devices.flat} == {"cpu"}
    # XLA:CPU's thread pool sized as the command line sizes it (docs/known_issues.md): 4 threads a device
    assert os.environ["PJRT_NPROC"] == str(max(os.cpu_count(), 4 * 8))


def test_devices(shardcheck_devices):
    assert len(shardcheck_devices) == jax.device_count() == 8
"""

STARTED_EARLY = """
import jax

STARTED = jax.devices()  # JAX starts at import, with one CPU device: too late to create more


def test_mesh_of_4(shardcheck_mesh):
    shardcheck_mesh(4)
"""


def test_without_the_option_the_mesh_fixtures_create_their_devices(pytester, monkeypatch):
    """A plain `pytest` run checks its meshes: the first fixture creates max(needed, 8) fake CPU devices, and
    gives XLA:CPU enough threads for their collectives."""
    for name in ("PJRT_NPROC", "NPROC"):  # this suite's conftest sets it for itself
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_no_option=NO_OPTION)
    result = pytester.runpytest_subprocess(*NO_XDIST, "-rs", timeout=120)
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("ci", [None, "true"])
def test_too_few_devices_skip_or_under_ci_fail_loudly(pytester, monkeypatch, ci):
    pytester.makepyfile(test_started=STARTED_EARLY)
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_subprocess(*NO_XDIST, "-rs", timeout=120)
    why = (
        "the mesh data=4 needs 4 devices, 1 available; run pytest --shardcheck-devices 4 (JAX started before this "
        "test asked, so the plugin could not create them)"
    )
    if ci is None:
        result.assert_outcomes(skipped=1)
        assert why in " ".join(result.stdout.str().split())
    else:
        result.assert_outcomes(failed=1)
        assert f"shardcheck pytest plugin (CI is set, so no skip): {why}" in " ".join(
            result.stdout.str().split()
        )


@pytest.mark.multiprocess
def test_the_documented_example_under_launch_spans_both_processes(tmp_path, monkeypatch):
    """Trial 56: under ``shardcheck launch -- python -m pytest`` (a conftest joining the run), the mesh fixture
    raised each process to 8 devices and put every mesh on process 0: process 1 crashed ("Array has no
    addressable shards") and process 0 passed an 8-device mesh on a 4-device run. Now the launcher's devices are
    the run's: the 4-device meshes span both processes and pass in each, the 8-device one is skipped with why."""
    from shardcheck import launcher

    (tmp_path / "test_my_step.py").write_text(documented_example())
    (tmp_path / "conftest.py").write_text(
        "import shardcheck.distributed\n\nshardcheck.distributed.initialize_from_env()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CI", raising=False)  # a skip, not a CI failure, is what is asserted
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    out, err = io.StringIO(), io.StringIO()
    argv = ["python", "-m", "pytest", "-q", "-rs", "-p", "no:randomly", *NO_XDIST, "test_my_step.py"]
    status = launcher.launch(argv, 2, 2, timeout_s=240, stdout=out, stderr=err)
    text = out.getvalue()
    assert status == 0, text + err.getvalue()
    for rank in (0, 1):  # every process checks its part of every mesh it can build
        assert re.search(rf"\[p{rank}\] 2 passed, 1 skipped", text), text
        assert (
            f"[p{rank}] SKIPPED [1]" in text
            and "the mesh data=2 x fsdp=4 needs 8 devices, 4 available; a mesh of a multi-process run takes the "
            "same number of devices from each of its 2 processes (4 in all)"
            in text
        )
    assert "no addressable shards" not in text + err.getvalue()
