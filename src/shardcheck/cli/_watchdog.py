"""A bound on how long a command may wait without progress: a hung collective stops with one line, not a SIGABRT.

On (fake) CPU devices a program with collectives (``psum``, all-gather, ...) runs one thread per device, and the
threads meet at each collective. When one never arrives, XLA:CPU waits 40 s and then aborts the process
(SIGABRT, "Termination timeout for `all reduce ...` of 40 seconds exceeded"), with no word on which check hung
or what to do. ``docs/known_issues.md`` describes the one such hang seen so far (XLA:CPU's thread pool, too
small for back-to-back launches) and the minimal plain-JAX program that shows it.

While a command runs, :class:`Watchdog` samples the process's CPU time (every thread's). A hung collective
leaves every thread asleep, so the process uses no CPU; compiling and computing always do, however slow the
machine, so the bound applies to the wait, never to a long compilation or a long step. Past
``SHARDCHECK_COLLECTIVE_TIMEOUT`` seconds without progress (default :data:`DEFAULT_TIMEOUT_S`, below XLA's 40 s)
it prints one line naming where the command waits and the way out, and ends the process with
:data:`EXIT_STALLED`.

Nothing here imports JAX.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TextIO

ENV_TIMEOUT = "SHARDCHECK_COLLECTIVE_TIMEOUT"
"""Environment variable: seconds without progress before a command stops; ``off`` / ``0`` never stops it."""

DEFAULT_TIMEOUT_S = 30.0
"""Below XLA:CPU's own 40 s termination timeout, so the line comes before XLA's SIGABRT."""

XLA_TERMINATE_S = 40.0
"""XLA:CPU's termination timeout of a collective's rendezvous (``xla_cpu_collective_call_terminate_timeout_seconds``)."""

EXIT_STALLED = 3
"""Exit status of a command stopped by the watchdog (0-2 are verdicts and errors; see the README)."""

IDLE_CPU_FRACTION = 0.02
"""A poll interval in which the process used less than this fraction of one core counts as no progress."""

OFF_VALUES = frozenset({"off", "0", "false", "no"})

_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "threading", "concurrent")
"""Top-level packages whose frames are skipped when naming where the command waits."""


def timeout_from_env(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds ``SHARDCHECK_COLLECTIVE_TIMEOUT`` allows without progress: None when it is ``off`` (or ``0``).

    Unset or empty: :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        ValueError: the value is neither a positive number of seconds nor ``off``.
    """
    value = environ.get(ENV_TIMEOUT, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    if value.lower() in OFF_VALUES:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"{ENV_TIMEOUT}={value!r}: expected a positive number of seconds a command may wait without progress "
            f"(default {DEFAULT_TIMEOUT_S:g}), or off (or 0) to turn the watchdog off"
        )
    return seconds


def xla_terminate_flag(timeout_s: float | None) -> str | None:
    """The ``XLA_FLAGS`` entry that keeps XLA:CPU from aborting before a bound of ``timeout_s`` seconds fires.

    None when the bound is off (XLA's own timeout then stands) or below XLA's :data:`XLA_TERMINATE_S`; else
    XLA's termination timeout raised to ``timeout_s + 30``, so the watchdog's line, not XLA's SIGABRT, ends a
    hung command.
    """
    if timeout_s is None or timeout_s < XLA_TERMINATE_S:
        return None
    return f"--xla_cpu_collective_call_terminate_timeout_seconds={int(timeout_s) + 30}"


def _library_frame(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__", "") or ""
    return module.split(".")[0] in _LIBRARIES or frame.f_code.co_filename.startswith("<frozen")


def blocked_at(frame: FrameType | None) -> tuple[str | None, str]:
    """Where a blocked thread waits: ``(program, place)``.

    ``program`` is the name of the jitted program JAX is running in that stack (``ExecuteReplicated.name``,
    e.g. ``"jit_body"``) when the wait is inside JAX's Python dispatch, else None (JAX's C++ fast path runs
    programs without a Python frame). ``place`` is the innermost frame outside JAX, Flax, optax and NumPy, as
    ``"FILE:LINE in FUNCTION"``: the line of the user's step or of shardcheck that waits.
    """
    program, place = None, "an unknown place"
    stack = traceback.walk_stack(frame)
    for f, lineno in stack:
        owner = f.f_locals.get("self")
        if program is None and type(owner).__name__ == "ExecuteReplicated":
            program = getattr(owner, "name", None)
        if not _library_frame(f):
            place = f"{_short_path(f.f_code.co_filename)}:{lineno} in {f.f_code.co_name}"
            break
    return program, place


def _short_path(path: str) -> str:
    """``path`` relative to the working directory when it is below it, else from its ``site-packages`` on."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    if not relative.startswith(".."):
        return relative
    marker = f"site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path


def stalled_message(command: str, waited_s: float, program: str | None, place: str) -> str:
    """The one line a stalled command prints: what waited, where, why, and the ways out."""
    what = f"program {program}" if program else "a program"
    return (
        f"{command}: stopped: {what} made no progress for {waited_s:.0f} s, waiting at {place}; a collective "
        f"(psum, all-gather, ...) that never completes on CPU devices is an XLA:CPU hang (docs/known_issues.md), "
        f"not a verdict on your step. Rerun with SHARDCHECK_COMPILATION_CACHE=off, or with more XLA:CPU threads "
        f"(PJRT_NPROC=64); {ENV_TIMEOUT}=SECONDS or =off changes this bound"
    )


class Watchdog:
    """Ends the process with one line and :data:`EXIT_STALLED` when it makes no progress for ``timeout_s``.

    Use as a context manager around a command's work; the thread it starts is a daemon and stops on exit.
    Progress is CPU time: a poll interval in which the process (every thread of it) used at least
    :data:`IDLE_CPU_FRACTION` of one core restarts the clock.

    Args:
        command: the line's prefix, e.g. ``"shardcheck verify"``.
        timeout_s: seconds without progress, > 0.
        thread_id: the thread whose stack names the wait (``threading.get_ident()``); default the caller's.
        stream: where the line goes (default ``sys.stderr``, read when it fires).
        exit: called with :data:`EXIT_STALLED` after the line (default ``os._exit``: the main thread is blocked
            inside XLA and cannot be interrupted).
        cpu_time: the process's CPU seconds (default ``time.process_time``).
        clock: a monotonic clock in seconds (default ``time.monotonic``).
        poll_s: seconds between samples (default ``min(1, timeout_s / 10)``).

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """

    def __init__(
        self,
        command: str,
        timeout_s: float,
        *,
        thread_id: int | None = None,
        stream: TextIO | None = None,
        exit: Callable[[int], object] = os._exit,
        cpu_time: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s={timeout_s!r} must be > 0 seconds")
        self.command, self.timeout_s = command, float(timeout_s)
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self._stream, self._exit, self._cpu_time, self._clock = stream, exit, cpu_time, clock
        self.poll_s = min(1.0, self.timeout_s / 10) if poll_s is None else poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def __enter__(self) -> Watchdog:
        self._thread = threading.Thread(target=self._watch, name="shardcheck-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        last_cpu, last_t = self._cpu_time(), self._clock()
        progress_t = last_t
        while not self._stop.wait(self.poll_s):
            cpu, now = self._cpu_time(), self._clock()
            if cpu - last_cpu >= IDLE_CPU_FRACTION * max(now - last_t, 1e-9):
                progress_t = now
            last_cpu, last_t = cpu, now
            if now - progress_t >= self.timeout_s:
                self._fire(now - progress_t)
                return

    def _fire(self, waited_s: float) -> None:
        self.fired = True
        program, place = blocked_at(sys._current_frames().get(self.thread_id))
        stream = sys.stderr if self._stream is None else self._stream
        try:
            sys.stdout.flush()
        except (OSError, ValueError):  # a closed or broken stdout: the line still goes out
            pass
        print(stalled_message(self.command, waited_s, program, place), file=stream, flush=True)
        self._exit(EXIT_STALLED)
