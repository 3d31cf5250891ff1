"""Ahead-of-time memory of the ~1B tiny-lm configuration on 64 fake CPU devices: seconds to answer, host memory.

Runs ``shardcheck memory --task tiny-lm --size 1b --mesh fsdp=64 --json -`` in a fresh process (its own 64 fake
CPU devices), times it end to end, and reads that process's peak resident set size (``resource.getrusage(
RUSAGE_CHILDREN).ru_maxrss``, KiB on Linux). Goals: under 60 s, and a peak host memory well under the model's size
(nothing of the model or the batch is allocated: the state and the batch are ``jax.ShapeDtypeStruct``).

Writes ``benchmarks/memory_aot.json`` (``--out`` to change) and prints a table of the figures and their ratios to
the goals. Usage::

    python benchmarks/memory_aot.py [--size 1b] [--mesh fsdp=64] [--batch-size 64] [--out PATH]

With ``--device-memory h100`` the run also finds the largest batch that fits (the search compiles several batch
sizes); it is recorded as a row of the JSON's ``largest_batch_searches`` (one per command, compiler and ``--label``, e.g.
``before`` / ``after`` a change), the rest of the file kept. With the jax CUDA plugin on ``PYTHONPATH`` the
compiles are XLA:GPU's for that GPU (deviceless), else XLA:CPU's::

    PYTHONPATH=<gpu-aot> python benchmarks/memory_aot.py --mesh fsdp=8 --device-memory h100 --label after
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 60.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1b")
    p.add_argument("--mesh", default="fsdp=64")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--out", default=str(Path(__file__).with_name("memory_aot.json")))
    p.add_argument(
        "--device-memory", default=None, help="find the largest batch that fits this device (h100)"
    )
    p.add_argument("--label", default="", help="names the largest-batch row (before / after a change)")
    args = p.parse_args(argv)

    cmd = [sys.executable, "-m", "shardcheck", "memory", "--task", "tiny-lm", "--size", args.size]
    cmd += ["--mesh", args.mesh, "--json", "-"]
    if args.batch_size is not None:
        cmd += ["--batch-size", str(args.batch_size)]
    if args.device_memory is not None:
        cmd += ["--device-memory", args.device_memory]
    env = dict(os.environ, SHARDCHECK_COMPILATION_CACHE="off")  # a cold compile, as a first run would be
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        return done.returncode
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss_bytes = usage.ru_maxrss * 1024  # KiB on Linux
    report = json.loads(done.stdout)
    strategy, entry = next(iter(report["strategies"].items()))
    aot = entry["ahead_of_time"]
    params = report["model"]["param_count"]
    model_bytes = params * 4  # float32 parameters alone
    result = {
        "command": " ".join(["shardcheck", *cmd[3:]]),
        "size": args.size,
        "mesh": report["mesh"],
        "strategy": strategy,
        "param_count": params,
        "model_params_bytes": model_bytes,
        "batch_size": aot["batch_size"],
        "seconds_to_answer_s": round(seconds, 2),
        "goal_s": GOAL_S,
        "peak_host_rss_bytes": rss_bytes,
        "rss_over_model_params": round(rss_bytes / model_bytes, 4),
        "per_device_persistent_bytes": aot["persistent_bytes"],
        "per_device_temp_bytes": aot["temp_bytes"],
        "per_device_peak_bytes": aot["peak_bytes"],
        "backend": aot["backend"],
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    cpu_seconds = usage.ru_utime + usage.ru_stime  # the child's CPU time: less sensitive to a loaded machine
    if args.device_memory is not None:
        return _record_search(args, dict(result, cpu_seconds_s=cpu_seconds), report, entry, seconds)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("parameters", f"{params:,}", ""),
        ("seconds to answer", f"{seconds:.1f} s", f"{seconds / GOAL_S:.2f} of the {GOAL_S:.0f} s goal"),
        (
            "peak host RSS",
            f"{rss_bytes / 2**30:.2f} GiB",
            f"{rss_bytes / model_bytes:.3f} of the model's params",
        ),
        (
            "peak per device",
            f"{aot['peak_bytes'] / 2**30:.2f} GiB",
            f"temp {aot['temp_bytes'] / 2**30:.2f} GiB",
        ),
    ]
    for name, value, ratio in rows:
        print(f"{name:<20} {value:>16}  {ratio}")
    print(f"wrote {args.out}")
    return 0


def _record_search(args, result, report, entry, seconds) -> int:
    """Add the largest-batch search's row to ``--out`` (replacing one of the same command, compiler and label)."""
    fit = entry["device_memory"]
    row = {
        "label": args.label,
        "command": result["command"],
        "compiler": report.get("compiler", {}).get("name", ""),
        "seconds_to_answer_s": round(seconds, 2),
        "cpu_seconds_s": round(result["cpu_seconds_s"], 2),
        "goal_s": GOAL_S,
        "largest_batch_size": fit["largest_batch_size"],
        "sizes_compiled": len(fit["peak_bytes_by_batch_size"]),
        "peak_bytes_by_batch_size": fit["peak_bytes_by_batch_size"],
        "cpu_count": os.cpu_count(),
        "load_average_1min": result["load_average_1min"],
    }
    out = Path(args.out)
    document = json.loads(out.read_text()) if out.exists() else {}
    key = ("command", "compiler", "label")
    rows = [
        r for r in document.get("largest_batch_searches", []) if [r[k] for k in key] != [row[k] for k in key]
    ]
    document["largest_batch_searches"] = [*rows, row]
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(
        f"{row['label'] or 'search'}: largest batch {row['largest_batch_size']} ({row['compiler']}, "
        f"{row['sizes_compiled']} sizes) in {seconds:.1f} s, load {row['load_average_1min']}; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
