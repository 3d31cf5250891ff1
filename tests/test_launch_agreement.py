"""``launch``: a status every process exits with is the command's result; one process's alone is a fault.

A FAIL verdict exits 1 in every process of a launched ``verify``: the launcher says so in one line, stops
nobody and exits 1. A process that ends alone (its peers blocked or ending otherwise) is a fault: the others are
stopped and its last lines repeated. The workers here are plain Python (no JAX), so each test takes a second.
"""

import io
import re
import sys

import pytest

from shardcheck import distributed, launcher

# process 0 and process 1 each run the branch of their rank
TWO_WAYS = (
    "import os, sys, time\n"
    "rank = int(os.environ['{env}'])\n"
    "print(f'rank {{rank}} ends', flush=True)\n"
    "{body}\n"
)


def launched(body: str, tmp_path, grace_s: float | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """Launch ``body`` as 2 processes; their exit status, stdout and stderr."""
    script = tmp_path / "worker.py"
    script.write_text(TWO_WAYS.format(env=distributed.ENV_PROCESS_ID, body=body))
    if grace_s is not None:
        monkeypatch.setattr(launcher, "AGREE_GRACE_S", grace_s)
    out, err = io.StringIO(), io.StringIO()
    status = launcher.launch(["python", str(script)], 2, 1, timeout_s=60, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


def test_the_same_status_in_every_process_is_the_commands_result_in_one_line(tmp_path):
    # process 1 fails first; process 0 follows 0.5 s later with the same status, as verify's FAIL does
    status, out, err = launched("time.sleep(0.5 if rank == 0 else 0.0); sys.exit(1)", tmp_path)
    assert status == 1
    last = err.splitlines()[-1]
    assert re.fullmatch(
        r"launch: all 2 processes exited with status 1 after \d+\.\d s: the command's own result in every "
        r"process, not a crash \(the reason is in the output above\)",
        last,
    ), err
    assert "stopped the other" not in err and "Last output" not in err
    assert sorted(out.splitlines()) == [
        "[p0] rank 0 ends",
        "[p1] rank 1 ends",
    ]  # every line out before the last


def test_a_process_that_exits_alone_is_a_fault_and_the_others_are_stopped(tmp_path, monkeypatch):
    status, out, err = launched("sys.exit(3) if rank == 1 else time.sleep(60)", tmp_path, 0.5, monkeypatch)
    assert status == 3
    assert re.search(
        r"launch: process 1 \(pid \d+\) exited with status 3 after \d+\.\d s; stopped the other 1 running "
        r"process\(es\)\. Last output of process 1:\n  \[p1\] rank 1 ends\n",
        err,
    ), err
    assert "all 2 processes" not in err


def _after_rank_1(tmp_path, rank_1: str, rank_0: str) -> str:
    """A body in which rank 1 runs ``rank_1`` and rank 0 runs ``rank_0`` 0.5 s after rank 1 got there, however
    late either process started (a fixed 0.5 s head start lost to a slow start under a loaded CI machine: rank 0
    ended first, and its status was read as the fault)."""
    flag = tmp_path / "rank1"
    return (
        f"(open({str(flag)!r}, 'w').close(), {rank_1}) if rank == 1 else "
        f"([time.sleep(0.05) for _ in iter(lambda: os.path.exists({str(flag)!r}), True)], time.sleep(0.5), "
        f"{rank_0})"
    )


def test_different_statuses_are_a_fault_of_the_first(tmp_path):
    status, out, err = launched(_after_rank_1(tmp_path, "sys.exit(1)", "sys.exit(2)"), tmp_path)
    assert status == 1
    assert re.search(
        r"launch: process 1 \(pid \d+\) exited with status 1 after \d+\.\d s; stopped the other 0 ", err
    ), err
    assert "all 2 processes" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and process groups as on Linux")
def test_a_killed_process_is_a_fault_at_once_even_if_the_others_follow(tmp_path):
    # the grace is for statuses the command chose, not for signals: no waiting on the others
    status, out, err = launched(_after_rank_1(tmp_path, "os.kill(os.getpid(), 9)", "sys.exit(137)"), tmp_path)
    assert status == 128 + 9
    assert re.search(r"launch: process 1 \(pid \d+\) was killed by signal SIGKILL", err), err
    assert "all 2 processes" not in err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--processes", "0", "--devices-per-process", "2"],
            "--processes must be a positive int, got 0; pass --processes 1 or more",
        ),
        (
            ["--processes", "2", "--devices-per-process", "-1"],
            "--devices-per-process must be a positive int, got -1; pass --devices-per-process 1 or more",
        ),
        (
            ["--processes", "2", "--devices-per-process", "1", "--timeout", "nan"],
            "--timeout nan must be a positive number of seconds; pass e.g. --timeout 120",
        ),
        (
            ["--processes", "2", "--devices-per-process", "1", "--port", "70000"],
            "--port 70000 must be in [1, 65535]; leave it out for a free port",
        ),
    ],
)
def test_launchs_own_flags_are_refused_by_their_flag_before_any_process_starts(flags, said, capsys):
    # trial 55: --processes 0 read "processes=0 must be a positive int", the library's argument, not the flag
    from shardcheck.cli import main

    assert main(["launch", *flags, "--", "run"]) == 2
    err = capsys.readouterr().err
    assert err == f"shardcheck launch: {said}\n"


@pytest.mark.multiprocess
def test_a_launched_run_with_too_few_devices_is_told_to_launch_more_not_to_pass_devices():
    # trial 56: under launch, "pass --devices 8" was advised, and --devices 8 repeated the same refusal
    out, err = io.StringIO(), io.StringIO()
    argv = ["verify", "--task", "linnerud", "--mesh", "data=8", "--strategies", "dp"]
    assert launcher.launch(argv, 2, 2, timeout_s=120, stdout=out, stderr=err) == 2
    text = err.getvalue()
    for rank in (0, 1):
        assert (
            f"[p{rank}] error: shardcheck verify: the mesh data=8 needs 8 devices, but 4 CPU device(s) exist; launch "
            "more devices: shardcheck launch --processes P --devices-per-process N with P x N = 8" in text
        ), text
    assert "pass --devices" not in text
    assert text.splitlines()[-1].startswith("launch: all 2 processes exited with status 2")
