"""``shardcheck launch``'s engine: P local worker processes joined by JAX's distributed runtime, supervised.

The workers are ordinary ``shardcheck`` processes whose environment carries the ``SHARDCHECK_*`` variables of
:mod:`shardcheck.distributed`; the coordinator listens on ``127.0.0.1`` only, on a free port. The launcher
streams their output, and stops all of them as soon as one fails or the run outlives its timeout.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from shardcheck import distributed

#: Exit status of :func:`launch` when the run outlived its timeout (as ``timeout(1)``).
EXIT_TIMEOUT = 124
#: Seconds between SIGTERM and SIGKILL when the launcher stops a worker's process group.
KILL_GRACE_S = 1.0
#: Output lines of a failed worker repeated in the launcher's error message.
TAIL_LINES = 20
# How long the other workers get to end after one exits with a status of its own (not a signal): a command that
# ends the same way in every process (a FAIL verdict, exit 1; bad input, exit 2) is its result, not a crash.
AGREE_GRACE_S = 10.0

_WORKER = "import sys; from shardcheck.cli import main; sys.exit(main(sys.argv[1:]))"

_PRCTL = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask Linux for SIGKILL when the launcher dies."""
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` the OS reports free now; another program may still take it before it is used."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def writes_json_to_stdout(argv: Sequence[str]) -> bool:
    """True when the subcommand ``argv`` writes its ``--json`` document to stdout (``--json -``)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return False
        if arg == "--json=-" or (arg == "--json" and argv[i + 1 : i + 2] == ["-"]):
            return True
    return False


@dataclasses.dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    tail: collections.deque
    threads: list[threading.Thread]


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by signal {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def _stop(workers: Sequence[_Worker]) -> None:
    """SIGTERM the process group of every live worker; SIGKILL what is left after ``KILL_GRACE_S`` seconds."""
    live = [w for w in workers if w.proc.poll() is None]
    for sig, grace_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        for w in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, sig)  # the worker leads its own session: its group is its pid
        deadline = time.monotonic() + grace_s
        for w in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        live = [w for w in live if w.proc.poll() is None]
        if not live:
            return


def _pump(pipe, sink: TextIO, prefix: str, tail: collections.deque, lock: threading.Lock) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            tail.append(line)
            with lock:
                sink.write(f"{prefix}{line}\n")
                sink.flush()


def launch(
    argv: Sequence[str],
    processes: int,
    devices_per_process: int,
    timeout_s: float = 120.0,
    *,
    port: int | None = None,
    max_attempts: int = 3,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``shardcheck ARGV`` (or any command ``ARGV``) as ``processes`` local processes of ``devices_per_process``
    CPU devices each.

    Each worker runs ``shardcheck.cli.main(argv)`` with this Python (or the command, see :func:`worker_command`), in its own session, with the
    ``SHARDCHECK_*`` variables of :mod:`shardcheck.distributed` set (coordinator ``127.0.0.1:PORT``, bound to
    ``127.0.0.1`` only) and ``JAX_PLATFORMS=cpu`` unless already set. Output is streamed line by line, each
    line prefixed ``[pR] ``: workers' stdout to ``stdout``, stderr to ``stderr``. When ``argv`` writes
    ``--json -``, process 0's stdout passes through unprefixed and the others' stdout goes to ``stderr``, so
    ``stdout`` carries exactly one JSON document.

    Faults: when a worker is killed, or exits non-zero and the others do not all end with the same status within
    ``AGREE_GRACE_S`` seconds, or the run outlives ``timeout_s``, every live worker's process group gets
    SIGTERM, then SIGKILL after ``KILL_GRACE_S`` seconds, and ``stderr`` gets a message naming the process, how
    it ended and its last ``TAIL_LINES`` output lines. On Linux workers also get
    SIGKILL if the launcher itself dies. When process 0 reports that its coordinator could not bind the port,
    the run starts again on another free port.

    Args:
        argv: the subcommand and its options, e.g. ``["run", "--strategy", "dp", "--json", "-"]``, or a command
            such as ``["python", "my_check.py"]``.
        processes: P >= 1.
        devices_per_process: N >= 1 fake CPU devices per process; the global mesh can use P * N devices.
        timeout_s: seconds the run may take, start-up included; a port retry restarts the clock.
        port: the coordinator port to try first (default: one the OS reports free).
        max_attempts: how many coordinator ports to try, >= 1.
        stdout: where results go (default ``sys.stdout``).
        stderr: where logs and errors go (default ``sys.stderr``).

    Returns:
        0 when every worker exits 0; ``EXIT_TIMEOUT`` (124) on timeout; else the first failed worker's exit
        status, or 128 + N when signal N killed it. A status that every worker exits with within
        ``AGREE_GRACE_S`` seconds of the first (a FAIL verdict, 1, in every process) is said in one line, as the
        command's own result, and no worker is stopped.

    Raises:
        ValueError: ``argv`` is empty or names no subcommand or command; ``processes``, ``devices_per_process`` or ``max_attempts`` < 1;
            ``timeout_s`` not a positive number; ``port`` outside ``[1, 65535]``. No process is started then.
    """
    fn = "launch"
    argv = list(argv)
    if not argv:
        raise ValueError(f"{fn}: argv is empty; give the subcommand to run, e.g. ['run', '--strategy', 'dp']")
    for name, value in (
        ("processes", processes),
        ("devices_per_process", devices_per_process),
        ("max_attempts", max_attempts),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{fn}: {name}={value!r} must be a positive int")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"{fn}: timeout_s={timeout_s!r} must be a positive number of seconds")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ValueError(f"{fn}: port={port!r} must be an int in [1, 65535], or None for a free port")
    worker_command(argv)  # a command that does not exist is refused before any process starts
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr

    status = 0
    for attempt in range(1, max_attempts + 1):
        address = f"127.0.0.1:{port if port is not None and attempt == 1 else free_port()}"
        status = _launch_once(argv, processes, devices_per_process, float(timeout_s), address, out, err)
        if status != distributed.EXIT_COORDINATOR_BIND_FAILED or attempt == max_attempts:
            break
        err.write(
            f"launch: the coordinator could not listen on {address}; retrying on another free port "
            f"(attempt {attempt + 1} of {max_attempts})\n"
        )
        err.flush()
    return status


def worker_command(argv: Sequence[str]) -> list[str]:
    """The command each worker runs: ``shardcheck ARGV`` for a subcommand, else ``ARGV`` itself.

    Any command works (``python my_check.py``, ``pytest tests/``); ``python`` and ``python3`` are this
    interpreter (``sys.executable``), so a script sees the same environment as the launcher. A user's script
    joins the run with :func:`shardcheck.distributed.initialize_from_env`.

    Raises:
        ValueError: ``argv[0]`` is neither a subcommand nor an executable on ``PATH`` (or a path to one).
    """
    from shardcheck._catalog import SUBCOMMANDS

    head, rest = argv[0], list(argv[1:])
    if head in SUBCOMMANDS:
        return [sys.executable, "-c", _WORKER, *argv]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    found = shutil.which(head)
    if found is None:
        raise ValueError(
            f"launch: {head!r} is not a shardcheck subcommand ({', '.join(SUBCOMMANDS)}) and no such command is on "
            "PATH; give a subcommand (-- verify ...) or a command (-- python my_check.py)"
        )
    return [found, *rest]


def _launch_once(argv, processes, devices_per_process, timeout_s, address, out, err) -> int:
    json_mode = writes_json_to_stdout(argv)
    lock = threading.Lock()
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(
        {
            distributed.ENV_COORDINATOR: address,
            distributed.ENV_COORDINATOR_BIND: address,
            distributed.ENV_NUM_PROCESSES: str(processes),
            distributed.ENV_DEVICES_PER_PROCESS: str(devices_per_process),
            distributed.ENV_INIT_TIMEOUT: str(max(1, int(timeout_s))),
            "PYTHONUNBUFFERED": "1",
        }
    )
    workers: list[_Worker] = []
    start = time.monotonic()
    try:
        # Every worker is started before any reader thread, so no thread runs while the children fork.
        for rank in range(processes):
            proc = subprocess.Popen(
                worker_command(argv),
                env=dict(env, **{distributed.ENV_PROCESS_ID: str(rank)}),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
            workers.append(_Worker(rank, proc, collections.deque(maxlen=TAIL_LINES), []))
        pids = " ".join(str(w.proc.pid) for w in workers)
        err.write(
            f"launch: {processes} processes x {devices_per_process} CPU devices, coordinator {address}, "
            f"pids {pids}\n"
        )
        err.flush()
        for w in workers:
            raw = json_mode and w.rank == 0
            streams = (
                (w.proc.stdout, out if raw or not json_mode else err, "" if raw else f"[p{w.rank}] "),
                (w.proc.stderr, err, f"[p{w.rank}] "),
            )
            for pipe, sink, prefix in streams:
                thread = threading.Thread(target=_pump, args=(pipe, sink, prefix, w.tail, lock), daemon=True)
                thread.start()
                w.threads.append(thread)
        return _supervise(workers, timeout_s, start, address, err, lock)
    finally:
        _stop(workers)
        for w in workers:
            for thread in w.threads:
                thread.join(timeout=5.0)


def _could_not_bind(status: int, worker: _Worker) -> bool:
    """Process 0 failed because its coordinator could not bind: its exit status, or gRPC's log line (gRPC
    sometimes crashes after a failed bind instead of raising)."""
    if status == distributed.EXIT_COORDINATOR_BIND_FAILED:
        return True
    for thread in worker.threads:
        thread.join(timeout=5.0)
    return any("Failed to add port to server" in line for line in worker.tail)


def _supervise(workers: list[_Worker], timeout_s: float, start: float, address: str, err, lock) -> int:
    deadline = start + timeout_s
    while True:
        statuses = [w.proc.poll() for w in workers]
        failed = next((w for w, s in zip(workers, statuses, strict=True) if s not in (None, 0)), None)
        if failed is not None:
            status = statuses[failed.rank]
            if failed.rank == 0 and _could_not_bind(status, failed):
                return distributed.EXIT_COORDINATOR_BIND_FAILED
            if status > 0:
                statuses = _wait_all(workers, min(deadline, time.monotonic() + AGREE_GRACE_S))
                if all(s == status for s in statuses):
                    _report_agreement(err, lock, workers, status, time.monotonic() - start)
                    return status
            running = sum(s is None for s in statuses)
            _stop(workers)
            message = (
                f"launch: process {failed.rank} (pid {failed.proc.pid}) {_describe(status)} after "
                f"{time.monotonic() - start:.1f} s; stopped the other {running} running process(es)"
            )
            _report(err, lock, message, failed)
            return status if status > 0 else 128 - status
        if all(s == 0 for s in statuses):
            return 0
        if time.monotonic() > deadline:
            running = [w for w, s in zip(workers, statuses, strict=True) if s is None]
            _stop(workers)
            message = (
                f"launch: timed out after {timeout_s:g} s (coordinator {address}); stopped process(es) "
                f"{', '.join(str(w.rank) for w in running)}; raise --timeout if the run is only slow"
            )
            _report(err, lock, message, running[0])
            return EXIT_TIMEOUT
        time.sleep(0.05)


def _wait_all(workers: Sequence[_Worker], until: float) -> list[int | None]:
    """Every worker's exit status once all have ended or ``until`` (a ``time.monotonic()``) has passed."""
    while any(w.proc.poll() is None for w in workers) and time.monotonic() < until:
        time.sleep(0.05)
    return [w.proc.poll() for w in workers]


def _report_agreement(err: TextIO, lock, workers: Sequence[_Worker], status: int, elapsed_s: float) -> None:
    """Every worker exited with the same ``status``: the command's own result, said in one line."""
    for w in workers:  # every line of output is out before the launcher's last word
        for thread in w.threads:
            thread.join(timeout=5.0)
    with lock:
        err.write(
            f"launch: all {len(workers)} processes exited with status {status} after {elapsed_s:.1f} s: the "
            "command's own result in every process, not a crash (the reason is in the output above)\n"
        )
        err.flush()


def _report(err: TextIO, lock: threading.Lock, message: str, worker: _Worker) -> None:
    for thread in worker.threads:  # the pipes close once the process group is gone: the tail is complete
        thread.join(timeout=5.0)
    with lock:
        err.write(f"{message}. Last output of process {worker.rank}:\n")
        for line in list(worker.tail) or ["(no output)"]:
            err.write(f"  [p{worker.rank}] {line}\n")
        err.flush()
