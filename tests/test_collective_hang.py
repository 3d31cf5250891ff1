"""No SIGABRT from XLA:CPU's collectives (issue #34): the command line's thread pool and its watchdog.

A Megatron-style tensor-parallel step aborted in 13 of 18 command-line runs with XLA:CPU's "Termination timeout
for `all reduce ...` of 40 seconds exceeded": XLA:CPU's client had max(cores, devices) threads, and a collective
program launched again before its previous launch finished left a device without a thread
(docs/known_issues.md). The command line now gives it 4 threads per device (``PJRT_NPROC``), and a command that
waits without using any CPU for ``SHARDCHECK_COLLECTIVE_TIMEOUT`` seconds stops with one line and exit status 3.
"""

import argparse
import io
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shardcheck.cli import _requested_devices, _xla
from shardcheck.cli._watchdog import (
    DEFAULT_TIMEOUT_S,
    ENV_TIMEOUT,
    EXIT_STALLED,
    Watchdog,
    blocked_at,
    stalled_message,
    timeout_from_env,
    xla_terminate_flag,
)

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "examples" / "megatron_mlp.py"
SHARDCHECK = Path(sys.executable).with_name("shardcheck")

# ------------------------------------------------------------------------------------- the watchdog, a unit


def _hang_in_user_step(release: threading.Event, started: threading.Event) -> None:
    started.set()
    release.wait()  # the fake hang: this thread waits, and no thread uses the CPU (cpu_time below is constant)


def test_a_wait_without_progress_stops_with_one_line_naming_the_place_and_status_3():
    release, started, stopped = threading.Event(), threading.Event(), threading.Event()
    waiter = threading.Thread(target=_hang_in_user_step, args=(release, started), daemon=True)
    waiter.start()
    started.wait(5)
    statuses, out = [], io.StringIO()
    dog = Watchdog(
        "shardcheck verify",
        0.5,
        thread_id=waiter.ident,
        stream=out,
        exit=lambda status: (statuses.append(status), stopped.set()),
        cpu_time=lambda: 12.0,  # no CPU used: no progress
        poll_s=0.05,
    )
    with dog:
        assert stopped.wait(30), "the watchdog never fired"
    release.set()
    assert statuses == [EXIT_STALLED] == [3] and dog.fired
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("shardcheck verify: stopped: a program made no progress for ")
    assert re.search(
        r"no progress for \d+ s, waiting at \S*test_collective_hang\.py:\d+ in _hang_in_user_step;", line
    )
    assert "SHARDCHECK_COMPILATION_CACHE=off" in line and "PJRT_NPROC=" in line and ENV_TIMEOUT in line
    assert "docs/known_issues.md" in line


def test_a_process_that_uses_the_cpu_is_never_stopped():
    """Compiling and computing use the CPU however long they take: the bound is on the wait, not the work."""
    ticks = iter(range(10**9))
    statuses = []
    with Watchdog(
        "shardcheck verify",
        0.2,
        stream=io.StringIO(),
        exit=statuses.append,
        cpu_time=lambda: float(next(ticks)),  # one CPU second per poll: always progress
        poll_s=0.02,
    ) as dog:
        time.sleep(0.6)  # three bounds' worth of polls
    assert statuses == [] and not dog.fired


def test_blocked_at_names_the_jitted_program_when_the_wait_is_in_jax_dispatch():
    namespace = {"__name__": "jax._src.interpreters.pxla", "sys": sys}
    exec(
        textwrap.dedent(
            """
            class ExecuteReplicated:
                name = "jit_tp_step"

                def __call__(self):
                    return sys._getframe()
            """
        ),
        namespace,
    )
    frame = namespace["ExecuteReplicated"]()()  # the frame of ExecuteReplicated.__call__, called from here
    program, place = blocked_at(frame)
    assert program == "jit_tp_step"
    assert re.fullmatch(
        r"\S*test_collective_hang\.py:\d+ in test_blocked_at_names_the_jitted_program_when_the_wait_is_in_jax_dispatch",
        place,
    )
    assert stalled_message("shardcheck run", 30.4, program, place).startswith(
        "shardcheck run: stopped: program jit_tp_step made no progress for 30 s, waiting at "
    )


@pytest.mark.parametrize(
    "value,seconds",
    [
        (None, DEFAULT_TIMEOUT_S),
        ("", DEFAULT_TIMEOUT_S),
        ("12.5", 12.5),
        ("off", None),
        ("0", None),
        ("No", None),
    ],
)
def test_the_bound_comes_from_the_environment(value, seconds):
    environ = {} if value is None else {ENV_TIMEOUT: value}
    assert timeout_from_env(environ) == seconds


@pytest.mark.parametrize("value", ["abc", "-3", "inf", "nan"])
def test_a_bound_that_is_not_seconds_is_refused_with_the_fix(value):
    with pytest.raises(
        ValueError, match=rf"{ENV_TIMEOUT}='{value}': expected a positive number of seconds .* or off"
    ):
        timeout_from_env({ENV_TIMEOUT: value})
    with pytest.raises(ValueError, match=r"Watchdog: timeout_s=0 must be > 0 seconds"):
        Watchdog("shardcheck verify", 0)


def test_the_default_bound_fires_before_xla_aborts_and_a_longer_one_raises_xla_s_timeout():
    assert (
        DEFAULT_TIMEOUT_S < 40
        and xla_terminate_flag(DEFAULT_TIMEOUT_S) is None
        and xla_terminate_flag(None) is None
    )
    assert xla_terminate_flag(60) == "--xla_cpu_collective_call_terminate_timeout_seconds=90"


# ------------------------------------------------------------------------------------ XLA:CPU's thread pool


def test_the_thread_pool_has_four_threads_per_device_and_at_least_the_cores():
    assert _xla.cpu_thread_pool_size(8, cpu_count=2) == 32
    assert _xla.cpu_thread_pool_size(2, cpu_count=64) == 64
    with pytest.raises(ValueError, match=r"cpu_thread_pool_size: num_devices=0 must be >= 1"):
        _xla.cpu_thread_pool_size(0)


def test_the_thread_pool_is_set_before_jax_starts_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(_xla, "_backends_started", lambda: False)
    environ = {}
    assert _xla.use_cpu_thread_pool(8, environ) and int(environ["PJRT_NPROC"]) >= 32
    for chosen in ({"PJRT_NPROC": "12"}, {"NPROC": "12"}):
        assert not _xla.use_cpu_thread_pool(8, dict(chosen))
    monkeypatch.setattr(_xla, "_backends_started", lambda: True)
    assert not _xla.use_cpu_thread_pool(8, environ := {}) and environ == {}


@pytest.mark.parametrize(
    "devices,mesh,n",
    [
        (None, None, 8),
        (16, None, 16),
        (None, {"data": 2, "model": 8}, 16),
        (None, "data=4,fsdp=8", 32),
        (2, "x", 8),
    ],
)
def test_the_pool_is_sized_for_the_devices_the_command_asks_for(devices, mesh, n):
    assert _requested_devices(argparse.Namespace(devices=devices, mesh=mesh)) == n


# ------------------------------------------------------------------ the command line, as a user runs it


def _shardcheck(args, cache, tmp_path, **env):
    """``shardcheck ARGS`` in a fresh process with the persistent cache in ``cache``, bounded by a timeout (its
    process is killed at the bound: nothing is left behind). Returns the CompletedProcess."""
    environ = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC", ENV_TIMEOUT)
    }
    environ.update(SHARDCHECK_COMPILATION_CACHE=str(cache), **env)
    return subprocess.run(
        [str(SHARDCHECK), *args], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=170
    )


BACK_TO_BACK = f"""
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, {str(MEGATRON.parent)!r})
from megatron_mlp import step as _step  # noqa: E402
from megatron_mlp import task  # noqa: E402, F401


def _row_parallel(w, x):
    return jax.lax.psum(jnp.sum(jax.lax.psum(x @ w, "model")), "data")


def step(model, optimizer, batch, mesh):
    # the minimal repro of docs/known_issues.md inside a user's step: a collective program launched 300 times
    # without waiting, which hung XLA:CPU with max(cores, devices) threads
    w = jax.device_put(jnp.ones((8, 32)), NamedSharding(mesh, P(None, "model")))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    f = jax.jit(jax.shard_map(_row_parallel, mesh=mesh, in_specs=(P(None, "model"), P("data")), out_specs=P()))
    for _ in range(300):
        out = f(w, x)
    assert float(out) == 16 * 32 * 8
    return _step(model, optimizer, batch, mesh)
"""


def test_tensor_parallel_steps_under_the_persistent_cache_never_abort(tmp_path):
    """The user's Megatron step cold then warm, and a step of 300 back-to-back collective launches, warm: every
    run exits 0 with every row PASS (aborts: 0)."""
    cache = tmp_path / "cache"
    (tmp_path / "back_to_back.py").write_text(BACK_TO_BACK)
    megatron = ["verify", "--task", f"{MEGATRON}:task", "--mesh", "data=2,model=4"]
    runs = [
        [
            *megatron,
            "--candidate",
            f"{MEGATRON}:step",
            "--strategies",
            "none",
        ],  # cold: compiles, fills the cache
        [*megatron, "--candidate", f"{MEGATRON}:step", "--strategies", "none"],  # warm: every program loaded
        [*megatron, "--candidate", "back_to_back.py:step", "--strategies", "none"],
    ]
    results = [_shardcheck(args, cache, tmp_path) for args in runs]
    aborts = [r.returncode for r in results if r.returncode != 0]
    assert aborts == [], [r.stderr[-2000:] for r in results if r.returncode]
    for r in results:
        assert "Termination timeout" not in r.stderr
        assert [
            line.split("│")[2].strip() for line in r.stdout.splitlines() if line.startswith("│ candidate")
        ] == ["PASS"]
    assert any(cache.iterdir()), "the persistent cache stayed empty"


FAKE_HANG = f"""
import sys
import time

sys.path.insert(0, {str(MEGATRON.parent)!r})
from megatron_mlp import task  # noqa: E402, F401


def step(model, optimizer, batch, mesh):
    time.sleep(600)  # the fake hang: the process waits and uses no CPU, as in a hung collective
"""


def test_a_command_that_hangs_stops_with_one_line_and_status_3(tmp_path):
    (tmp_path / "hang.py").write_text(FAKE_HANG)
    args = ["verify", "--task", f"{MEGATRON}:task", "--mesh", "data=2,model=4", "--candidate", "hang.py:step"]
    r = _shardcheck([*args, "--strategies", "none"], "off", tmp_path, **{ENV_TIMEOUT: "3"})
    assert r.returncode == EXIT_STALLED == 3, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert re.match(
        r"shardcheck verify: stopped: a program made no progress for \d+ s, waiting at hang\.py:\d+ in step;",
        line,
    )
    assert "SHARDCHECK_COMPILATION_CACHE=off" in line
