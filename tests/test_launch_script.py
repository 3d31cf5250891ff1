"""``shardcheck launch -- python my_check.py``: a user's own script checks its own step across processes.

The script is the one ``docs/distributed.md`` shows (read from there, so the documented example is the tested
one): it joins the run with ``initialize_from_env()``, places its state and batch with ``place_host_tree`` (its
processes reach a barrier and the placement in different orders, which ``jax.device_put`` would turn into a
collective mismatch) and runs ``assert_step_parity`` on its own jitted data-parallel step. One run passes, one
with a planted fault fails with the diagnosis; every run is bounded by timeouts and leaves no process behind.
"""

import re
import uuid
from pathlib import Path

import pytest
from test_distributed import Launched, needs_proc

from shardcheck.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
LAUNCH = ["launch", "--processes", "2", "--devices-per-process", "2", "--timeout", "90", "--"]


def documented_script() -> str:
    """The Python block after the marker comment in docs/distributed.md."""
    text = DOC.read_text()
    marker = text.index("<!-- the script below is tests/test_launch_script.py's")
    return re.search(r"```python\n(.*?)```", text[marker:], re.DOTALL).group(1)


@pytest.fixture
def my_check(tmp_path) -> str:
    path = tmp_path / "my_check.py"
    path.write_text(documented_script())
    return str(path)


def run_script(script: str, *args: str) -> Launched:
    run = Launched([*LAUNCH, "python", script, *args], f"shardcheck-test-{uuid.uuid4()}")
    try:
        run.finish(120)
    finally:
        run.cleanup()
    return run


@pytest.mark.multiprocess
@needs_proc
def test_a_users_script_passes_its_own_step_across_two_processes(my_check):
    run = run_script(my_check)
    assert run.proc.returncode == 0, run.err
    assert run.out.splitlines() == ["[p0] PASS over 2 processes x 2 devices"]  # process 0 alone prints
    assert "Traceback" not in run.err
    assert run.leftovers == []


@pytest.mark.multiprocess
@needs_proc
def test_a_planted_fault_in_the_script_exits_1_with_the_diagnosis(my_check):
    run = run_script(my_check, "sum")
    assert run.proc.returncode == 1, run.err
    assert re.search(r"launch: all 2 processes exited with status 1 after \d+\.\d s: the command's own", run.err)
    assert "stopped the other" not in run.err  # a verdict, not a crash
    for rank in (0, 1):  # every process reached the same verdict
        assert (
            f"[p{rank}] shardcheck.parity.report.ParityError: parity FAIL for step 'my_step'" in run.err
        )
        assert (
            f"[p{rank}]   [summed] At step 0, parameter updates are 4 x the reference's: the gradient "
            "reduction summed instead of averaged (x4: a sum over 4 shards)."
        ) in run.err
    assert "PASS" not in run.out
    assert run.leftovers == []


def test_a_launch_command_that_does_not_exist_is_refused_before_any_process_starts(capsys):
    assert main([*LAUNCH, "no-such-program", "--flag"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardcheck launch: 'no-such-program' is not a shardcheck subcommand (")
    assert "and no such command is on PATH; give a subcommand (-- verify ...) or a command" in err
    assert "pids" not in err  # the launcher's first line, written once the workers exist
