"""shardcheck on a host with one GPU: the figures of issue #35, measured in one run of fresh processes.

Run on the GPU host from the source tree (no install needed)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python benchmarks/gpu.py --out DIR --budget 330

Each part is a fresh process with its own timeout, and appends one JSON line to ``DIR/gpu.jsonl``
(``{"part": ..., ...}``); the processes' output goes to ``DIR/log.txt``. A part that would start past the
budget is skipped and says so. The parts:

- ``env``: jax / jaxlib / flax versions and the devices;
- ``run``: ``shardcheck run`` (the README's main job): exit status, wall seconds, its devices line;
- ``verify8``: ``shardcheck verify --task tiny-lm --devices 8``: exit status, wall seconds, devices line, verdicts;
- ``check_cold`` / ``bare_cold``: ``check_parity`` of ``simulation`` and ``accumulation`` (S=4) on the GPU in a
  fresh process (nothing compiled before), against the same steps bare in another fresh process, with the
  backend compilations of each (``/jax/core/compile/backend_compile_duration`` events);
- ``check_warm``: three calls of each check, each followed by the bare steps (``benchmarks/overhead.py``
  ``_bare_steps``): seconds and compilations per call (call 0 compiles), the warm ratio (the best of calls 1-2),
  the matmul precision the tolerances assumed and the verdict, and the verdict when told float32;
- ``memory``: ``shardcheck memory --size tiny --mesh fsdp=1 --platform gpu``: XLA:GPU's compile on the card
  (compare with the deviceless ``--target h200`` figure of the same step, ``tests/test_gpu_target.py``);
- ``pytest`` (with ``--pytest PATHS``): those tests under ``JAX_PLATFORMS=cpu`` on 8 worker processes, in a
  thread beside the other parts (``-o addopts=``: the GPU image may lack the project's pytest plugins).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

COUNT = r"""
import json, os, sys, time
t0 = time.perf_counter()
import jax
from jax import monitoring
counts = {"compiles": 0, "compile_s": 0.0}
def _duration(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
        counts["compile_s"] += seconds
monitoring.register_event_duration_secs_listener(_duration)
from shardcheck.tasks import load_task
task = load_task("tiny-lm", steps=3)
STRATEGIES = ("simulation", "accumulation")
S = 4
"""

CHECK_COLD = r"""
import shardcheck
rows = {}
for name in STRATEGIES:
    c0, t = counts["compiles"], time.perf_counter()
    report = shardcheck.check_parity(name, task, num_shards=S)
    rows[name] = {"s": time.perf_counter() - t, "compiles": counts["compiles"] - c0, "ok": bool(report.ok),
                  "matmul_precision": report.matmul_precision, "devices": report.devices}
print("PART " + json.dumps({"rows": rows, **counts, "wall_s": time.perf_counter() - t0}))
"""

BARE_COLD = r"""
sys.path.insert(0, "benchmarks")
from overhead import _bare_steps
rows = {}
for name in STRATEGIES:
    c0, t = counts["compiles"], time.perf_counter()
    _bare_steps(task, name, S)
    rows[name] = {"s": time.perf_counter() - t, "compiles": counts["compiles"] - c0}
print("PART " + json.dumps({"rows": rows, **counts, "wall_s": time.perf_counter() - t0}))
"""

CHECK_WARM = r"""
sys.path.insert(0, "benchmarks")
import shardcheck
from overhead import _bare_steps
rows = {}
for name in STRATEGIES:
    row = {"check_s": [], "check_compiles": [], "bare_s": []}
    for i in range(3):  # call 0 compiles; calls 1 and 2 are warm
        c0, t = counts["compiles"], time.perf_counter()
        report = shardcheck.check_parity(name, task, num_shards=S)
        row["check_s"].append(time.perf_counter() - t)
        row["check_compiles"].append(counts["compiles"] - c0)
        row["bare_s"].append(_bare_steps(task, name, S))
        print(name, i, row["check_s"][-1], row["check_compiles"][-1], row["bare_s"][-1], flush=True)
    row["ok"], row["matmul_precision"] = bool(report.ok), report.matmul_precision
    row["ratio"] = min(row["check_s"][1:]) / min(row["bare_s"][1:])
    told = shardcheck.check_parity(name, task, num_shards=S, matmul_precision="float32")
    row["told_float32_ok"] = bool(told.ok)
    row["told_float32"] = str(told.diagnosis)[:300] if hasattr(told, "diagnosis") else None
    rows[name] = row
    print("PART " + json.dumps({"rows": rows, **counts, "wall_s": time.perf_counter() - t0}, default=str), flush=True)
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    parser.add_argument(
        "--pytest",
        default="",
        help="also run these test paths with JAX_PLATFORMS=cpu (-n 8, without the project's addopts), beside the other parts",
    )
    parser.add_argument("--pytest-timeout", type=float, default=200.0)
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src"), "PYTHONUNBUFFERED": "1"}
    log = open(args.out / "log.txt", "a")

    def emit(part: str, record: dict) -> None:
        line = json.dumps({"part": part, **record}, default=str)
        print(line, flush=True)
        with open(args.out / "gpu.jsonl", "a") as f:
            f.write(line + "\n")

    def proc(part: str, cmd: list[str], timeout: float, extra: dict | None = None) -> tuple[dict, str]:
        left = args.budget - (time.perf_counter() - start)
        if args.only and part not in args.only.split(","):
            return {"skipped": "not in --only"}, ""
        if left < 20:
            return {"skipped": f"{left:.0f} s of the budget left"}, ""
        t = time.perf_counter()
        try:
            p = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env={**env, **(extra or {})},
                timeout=min(timeout, left),
                cwd=HERE.parent,
            )
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (
                (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"),
                "timeout",
            )
        log.write(f"\n===== {part}: {' '.join(cmd)[:200]}\n{out}\n")
        log.flush()
        return {"rc": rc, "wall_s": round(time.perf_counter() - t, 2)}, out

    def lines_with(out: str, *keys: str) -> list[str]:
        return list(dict.fromkeys(ln.strip() for ln in out.splitlines() if any(k in ln for k in keys)))[:8]

    py = sys.executable

    def run_tests() -> None:
        rec, out = proc(
            "pytest",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-n",
                "8",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                *args.pytest.split(),
            ],
            args.pytest_timeout,
            {"JAX_PLATFORMS": "cpu"},
        )
        tail = [ln for ln in out.splitlines() if " passed" in ln or "FAILED" in ln or "ERROR" in ln]
        emit("pytest", {**rec, "summary": tail[-12:]})

    # the test slice runs on 8 of the host's CPU cores while the parts below use the GPU (and the other cores)
    tests = threading.Thread(target=run_tests) if args.pytest else None
    if tests is not None:
        tests.start()
    rec, out = proc(
        "env",
        [
            py,
            "-c",
            "import jax, jaxlib, flax, optax; print(jax.__version__, jaxlib.__version__, "
            "flax.__version__, optax.__version__, jax.devices())",
        ],
        60,
    )
    emit("env", {**rec, "out": out.strip()[-400:]})
    rec, out = proc("run", [py, "-m", "shardcheck", "run"], 150)
    emit("run", {**rec, "lines": lines_with(out, "devices", "ran on", "Error", "error")})
    rec, out = proc(
        "verify8",
        [
            py,
            "-m",
            "shardcheck",
            "verify",
            "--task",
            "tiny-lm",
            "--devices",
            "8",
            "--json",
            str(args.out / "verify8.json"),
        ],
        200,
    )
    emit("verify8", {**rec, "lines": lines_with(out, "devices", "ran on", "matmul", "Error")})
    rec, out = proc(
        "memory",
        [
            py,
            "-m",
            "shardcheck",
            "memory",
            "--size",
            "tiny",
            "--mesh",
            "fsdp=1",
            "--platform",
            "gpu",
            "--json",
            str(args.out / "memory.json"),
        ],
        90,
    )
    emit("memory", {**rec, "lines": lines_with(out, "peak", "compiler", "devices", "Error")})
    for part, body, timeout in (
        ("check_cold", CHECK_COLD, 150),
        ("bare_cold", BARE_COLD, 90),
        ("check_warm", CHECK_WARM, 150),
    ):
        rec, out = proc(part, [py, "-c", COUNT + body], timeout, {"SHARDCHECK_COMPILATION_CACHE": "off"})
        got = [ln for ln in out.splitlines() if ln.startswith("PART ")]
        emit(part, {**rec, **(json.loads(got[-1][5:]) if got else {"tail": out[-1500:]})})
    if tests is not None:
        tests.join()
    emit("total", {"wall_s": round(time.perf_counter() - start, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
