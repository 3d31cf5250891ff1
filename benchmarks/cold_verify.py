"""The user's view of ``shardcheck verify``: cold and warm, beside the cold and warm cost of the bare steps it checks.

Each figure is the wall time of a fresh process, as a CI runner sees it:

- ``verify``: ``shardcheck verify ARGS`` (the console script's ``main``);
- ``bare``: the same task's reference step and the step of every strategy that ``verify`` checks, built from the
  registry (``STRATEGIES[name].build``) on the same mesh, each run over the same batches from fresh state, and
  nothing else: what the user would pay to compile and run the steps without checking them.

Cold: a fresh compilation-cache folder; warm: the same command again over the folder the cold run filled. Both
sides set up JAX as the command line does (fake CPU devices, the persistent compilation cache, XLA:CPU's
compile-time flags on a CPU-only machine: ``shardcheck.cli._xla``). Each process counts its backend compilations
(``/jax/core/compile/backend_compile_duration`` events) and the compilation-cache hits.

``python benchmarks/cold_verify.py`` prints the table and writes ``benchmarks/cold_verify.json``;
``benchmarks/run.py`` imports :func:`measure` for its targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (name, verify's arguments, the bare steps' setup: task spec, load_task options, devices, mesh)
CONFIGS = (
    ("tiny-lm f32, 8 devices", ["--task", "tiny-lm", "--devices", "8"], ("tiny-lm", {}, 8, None)),
    (
        "tiny-lm bf16 compute, 4 devices",
        ["--task", "tiny-lm", "--devices", "4", "--compute-dtype", "bfloat16"],
        ("tiny-lm", {"compute_dtype": "bfloat16"}, 4, None),
    ),
    (
        "tiny-lm bf16 compute, 8 devices",
        ["--task", "tiny-lm", "--devices", "8", "--compute-dtype", "bfloat16"],
        ("tiny-lm", {"compute_dtype": "bfloat16"}, 8, None),
    ),
    (
        "annotated_lm, mesh data=2 x fsdp=4",
        ["--task", "examples/annotated_lm.py:task", "--mesh", "data=2,fsdp=4"],
        ("examples/annotated_lm.py:task", {}, 8, {"data": 2, "fsdp": 4}),
    ),
)
# verify's default strategies (its --strategies help); the bare side builds the same ones
STRATEGIES = ("simulation", "dp", "fsdp", "gspmd", "accumulation")

# Run in a fresh interpreter: sets up JAX as the command line does, counts compilations, runs ``BODY``.
PRELUDE = r"""
import json, os, sys, time
t0 = time.perf_counter()
from shardcheck.cli._xla import use_cpu_compile_flags
use_cpu_compile_flags()
import jax
from jax import monitoring
counts = {"compiles": 0, "compile_s": 0.0, "cache_hits": 0}
def _duration(event, seconds, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
        counts["compile_s"] += seconds
def _event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        counts["cache_hits"] += 1
monitoring.register_event_duration_secs_listener(_duration)
monitoring.register_event_listener(_event)
"""

VERIFY_BODY = r"""
from shardcheck.cli import main
sys.argv = ["shardcheck", "verify", *json.loads(os.environ["BENCH_ARGS"])]
code = main()
print("BENCH " + json.dumps({**counts, "wall_s": time.perf_counter() - t0, "returncode": code}))
"""

BARE_BODY = r"""
spec, options, devices, mesh_axes, steps_count = json.loads(os.environ["BENCH_ARGS"])
jax.config.update("jax_num_cpu_devices", devices)
from shardcheck.cli._cache import enable_compilation_cache
enable_compilation_cache()
from flax import nnx
import shardcheck
from shardcheck.steps import STRATEGIES
from shardcheck.steps.reference import reference_step
from shardcheck.steps.registry import mesh_for
from shardcheck.tasks import load_task
task = load_task(spec, **options)
batches = [jax.tree.map(jax.numpy.asarray, b) for b in task.batches[:steps_count]]
mesh = shardcheck.make_mesh(mesh_axes) if mesh_axes else None
def fresh():  # as the engine builds them: an annotated model needs no mesh in context
    with nnx.use_eager_sharding(False):
        model = task.new_model()
        return model, task.new_optimizer(model)
model, opt = fresh()
for b in batches:
    reference_step(task.loss_fn, model, opt, b)
jax.block_until_ready(nnx.state(model))
for name in json.loads(os.environ["BENCH_STRATEGIES"]):
    spec_ = STRATEGIES[name]
    cand = spec_.build(task.loss_fn, devices, mesh_for("benchmark", spec_, devices, mesh))
    model, opt = fresh()
    if cand.make_optimizer is not None:
        opt = cand.make_optimizer(model, opt)
    for b in batches:
        cand.step(model, opt, b)
    jax.block_until_ready(nnx.state(model))
print("BENCH " + json.dumps({**counts, "wall_s": time.perf_counter() - t0, "returncode": 0}))
"""


def _python(body: str, args, cache: str, extra_env: dict | None = None) -> dict:
    env = {
        **os.environ,
        "SHARDCHECK_COMPILATION_CACHE": cache,
        "BENCH_ARGS": json.dumps(args),
        "BENCH_STRATEGIES": json.dumps(STRATEGIES),
        **(extra_env or {}),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + body],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=HERE.parent,
    )
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    if not lines:
        raise RuntimeError(f"benchmark process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("BENCH ") :])
    out["process_wall_s"] = wall  # with interpreter start-up and imports, as the user waits
    return out


def measure_config(name: str, verify_args, bare, *, default_xla: bool = False) -> dict:
    """Cold and warm ``verify`` and bare steps of one configuration (see the module docstring); the bare steps
    run as many steps as ``verify`` checked (read from its JSON report)."""
    spec, options, devices, mesh = bare
    row = {"name": name, "verify_args": list(verify_args)}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [*verify_args, "--json", str(report)]
        vcache, bcache = os.path.join(tmp, "v"), os.path.join(tmp, "b")
        row["verify_cold"] = _python(VERIFY_BODY, argv, vcache)
        row["steps"] = steps = int(json.loads(report.read_text())["steps"])
        row["verify_warm"] = _python(VERIFY_BODY, argv, vcache)
        row["verdicts"] = {k: v["verdict"] for k, v in json.loads(report.read_text())["strategies"].items()}
        row["bare_cold"] = _python(BARE_BODY, [spec, options, devices, mesh, steps], bcache)
        row["bare_warm"] = _python(BARE_BODY, [spec, options, devices, mesh, steps], bcache)
        if default_xla:
            row["verify_cold_default_xla"] = _python(
                VERIFY_BODY, argv, os.path.join(tmp, "d"), {"SHARDCHECK_XLA_CPU": "default"}
            )
    for side in ("cold", "warm"):
        row[f"{side}_ratio"] = row[f"verify_{side}"]["process_wall_s"] / row[f"bare_{side}"]["process_wall_s"]
    return row


def measure(configs=CONFIGS) -> dict:
    """Every configuration of :data:`CONFIGS`; the first also cold under XLA's default code generation."""
    rows = [measure_config(n, v, b, default_xla=i == 0) for i, (n, v, b) in enumerate(configs)]
    return {"strategies": list(STRATEGIES), "rows": rows}


def render(result: dict) -> str:
    lines = [
        "| configuration | steps | verify cold s (compiles) | bare cold s (compiles) | cold ratio | "
        "verify warm s | bare warm s | warm ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        vc, bc, vw, bw = r["verify_cold"], r["bare_cold"], r["verify_warm"], r["bare_warm"]
        lines.append(
            f"| {r['name']} | {r['steps']} | {vc['process_wall_s']:.1f} ({vc['compiles']}) | "
            f"{bc['process_wall_s']:.1f} ({bc['compiles']}) | {r['cold_ratio']:.2f} | {vw['process_wall_s']:.1f} | "
            f"{bw['process_wall_s']:.1f} | {r['warm_ratio']:.2f} |"
        )
    first = result["rows"][0]
    if "verify_cold_default_xla" in first:
        d = first["verify_cold_default_xla"]
        lines += [
            "",
            f"{first['name']}, cold verify under XLA's default code generation (SHARDCHECK_XLA_CPU=default): "
            f"{d['process_wall_s']:.1f} s ({d['compiles']} compiles, {d['compile_s']:.1f} s in the backend) against "
            f"{first['verify_cold']['process_wall_s']:.1f} s ({first['verify_cold']['compile_s']:.1f} s).",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "cold_verify.json")
    parser.add_argument("--only", help="run only the configurations whose name contains this text")
    args = parser.parse_args(argv)
    configs = [c for c in CONFIGS if args.only is None or args.only in c[0]]
    result = {
        "loadavg_start": list(os.getloadavg()),
        **measure(configs),
        "loadavg_end": list(os.getloadavg()),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
