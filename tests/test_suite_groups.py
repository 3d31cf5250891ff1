"""The suite's own scheduling (tests/conftest.py): a fixture that a test module shares among its tests
(``scope="module"``) is built once under pytest-xdist, not once per worker, and each of its parameters once.

Run as the suite runs (``-n 2 --dist loadgroup``) on a small test folder whose conftest is the suite's, in a
subprocess; each fixture build appends a line to a file. It failed with pytest 9.2, which no longer reads the group
that pytest-xdist 3.8 appends to a test's node id (pyproject.toml pins pytest below it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = """
import os, time, pytest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["BUILDS"], "a") as f:
        f.write("shared\\n")
    return os.getpid()

@pytest.fixture(scope="module", params=["a", "b"])
def per_param(request):
    with open(os.environ["BUILDS"], "a") as f:
        f.write(f"per_param {request.param}\\n")
    return request.param

@pytest.mark.parametrize("i", range(8))
def test_shared(shared, i):
    time.sleep(0.2)
    assert shared == os.getpid()

@pytest.mark.parametrize("i", range(4))
def test_per_param(per_param, i):
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(8))
def test_alone(i):
    time.sleep(0.2)
"""


def test_a_module_scoped_fixture_is_built_once_and_each_parameter_once(tmp_path):
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.util
            spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
            suite = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(suite)
            pytest_itemcollected = suite.pytest_itemcollected
            """
        )
    )
    (tmp_path / "test_groups.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    builds = tmp_path / "builds.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["BUILDS"] = str(builds)
    args = ["-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q", "-c", "pytest.ini"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "24 passed" in proc.stdout
    assert sorted(builds.read_text().split("\n")[:-1]) == ["per_param a", "per_param b", "shared"]
