"""How fast and how lean each shardcheck computation is, side by side in one process, against its limits.

Usage::

    python benchmarks/run.py                    # the default problem B=8192, D=K=512, S=8 (a few minutes on 2 cores)
    python benchmarks/run.py --quick --out /tmp/r.json    # tiny sizes, seconds (the test suite's smoke run)
    python benchmarks/run.py --help

What is timed (``time.perf_counter`` around one call and ``jax.block_until_ready``; median of ``--repeats`` calls
after ``--warmup`` calls; every row is timed once per round and the rounds are interleaved, so machine load hits
all rows alike):

* ``full``: the jitted core of :func:`shardcheck.sgd_step` (``baseline._sgd_step_jit``) on already-placed
  arrays: loss, gradients and one SGD update of an ``nnx.Linear(D, K)`` on the whole ``(B, D)`` batch;
* ``sim_saved`` / ``sim_stream``: the jitted core of :func:`shardcheck.reduced_sgd_step`
  (``simulation._reduced_step_jit``) on pre-split ``(S, B/S, D)`` shards, keeping every shard's gradients
  (seed 000) or only their running sum;
* ``naive_eager``: the obvious implementation, a Python loop over the S shards calling
  ``nnx.value_and_grad`` eagerly, then :func:`shardcheck.tree_mean` and ``optimizer.update`` (no jit);
* ``matmul_bound``: the two matrix products every step needs, ``x @ W`` and ``x.T @ g``, jitted;
* ``matmul_blocked``: the same products in S row blocks in a ``lax.scan`` (the simulation's arithmetic alone);
* ``dp`` / ``fsdp``: the compiled ``shard_map`` steps of :mod:`shardcheck.seeds.mesh_steps` on ``--mesh-devices`` fake CPU
  devices, state already placed (each call consumes the state the previous one returned: the buffers are donated);
* ``*_public``: the public functions end to end (validation, ``nnx.split``/``nnx.update``, placement checks):
  subtract the matching core row to get the per-call host overhead.

Memory is XLA's own per-device figure, ``jax.jit(f).lower(...).compile().memory_analysis()`` (argument, output,
alias, temp bytes). Compile time is trace + lower + XLA compile of a fresh ``jax.jit`` (no cache), median of
``--compile-repeats``. Fields carry their unit (``*_s``, ``*_ms``, ``*_bytes``); ``ratios`` are unitless.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# target: (limit, what). A ratio meets its target when it is <= the limit.
TARGETS = {
    "sim_stream_over_full": (1.02, "streaming simulation step / full-batch step (S={S})"),
    "sim_saved_over_full": (
        1.20,
        "simulation step keeping every shard's gradients / full-batch step (S={S})",
    ),
    "full_over_matmul": (1.20, "full-batch step / bare matmul bound (x @ W and x.T @ g)"),
    "compile_s128_over_s1": (1.5, "simulation compile time S={cmax} / S={cmin} (worse of the two modes)"),
    "compile_s128_over_s2": (
        1.2,
        "simulation compile time S={cmax} / S=2 (worse of the two modes; S=1 is loop-free)",
    ),
    "stream_temp_s128_over_s8": (1.1, "streaming simulation temp bytes S={mmax} / S={mmin}"),
    "fsdp_temp_over_dp_temp": (0.65, "FSDP temp bytes / DP temp bytes, B={fb}, D=K={fd}, {fn} devices"),
    "repeat_call_ms": (
        1.0,
        "repeat seed-000 entrypoint call, B={lb}, D={ld}, K={lk}, a new lr each call (ms)",
    ),
    "parity_over_steps_dp": (
        2.0,
        "check_parity('dp') / bare reference + dp steps, {hsetup} (warm)",
    ),
    "parity_over_steps_fsdp": (
        2.0,
        "check_parity('fsdp') / bare reference + fsdp steps, {hsetup} (warm)",
    ),
    "parity_over_steps_tiny_lm": (
        1.5,
        "check_parity('dp') / bare steps on the tiny-lm task, {lmsetup} (warm)",
    ),
    "parity_over_steps_tiny_lm_accumulation": (
        3.0,
        "check_parity('accumulation') / twice the bare reference steps on the tiny-lm task, {lmsetup} (warm; "
        "issue #35)",
    ),
    "cli_run_s": (2.5, "repeated `shardcheck run` (diabetes), caches warm, median of {cr} (s)"),
    "cli_verify_s": (
        3.0,
        "repeated `shardcheck verify --devices 4 --steps 5`, caches warm, median of {cr} (s)",
    ),
    "cli_help_s": (1.0, "`shardcheck --help`, median of {cr} (s; no JAX import)"),
    "cold_verify_tiny_lm_s": (15.0, "cold `shardcheck verify --task tiny-lm --devices 8`, a fresh cache (s)"),
    "cold_verify_tiny_lm_over_bare": (
        1.5,
        "cold `verify --task tiny-lm --devices 8` / cold bare steps of the same strategies (fresh processes)",
    ),
    "cold_verify_bf16_s": (
        40.0,
        "cold `shardcheck verify --task tiny-lm --devices 4 --compute-dtype bfloat16`, a fresh cache (s)",
    ),
}
# Rows that --quick does not measure (minutes of compiling): recorded as None with the reason.
HEAVY_ROWS = (
    "parity_over_steps_tiny_lm",
    "parity_over_steps_tiny_lm_accumulation",
    "cli_run_s",
    "cli_verify_s",
    "cold_verify_tiny_lm_s",
    "cold_verify_tiny_lm_over_bare",
    "cold_verify_bf16_s",
)


def _relative_paths(text: str) -> str:
    """A profile's text with this checkout's and the environment's folders left out (no machine paths recorded)."""
    text = text.replace(str(HERE.parent) + "/", "")
    return re.sub(r"/[^\s:()]*?/site-packages/", "site-packages/", text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--batch", "-B", type=int, default=8192, help="batch size B of the main problem")
    p.add_argument("--features", "-D", type=int, default=512, help="input width D")
    p.add_argument("--outputs", "-K", type=int, default=512, help="output width K")
    p.add_argument("--shards", "-S", type=int, default=8, help="shard count S of the simulation")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per row (median reported)")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed calls per row first (compiles, warms caches)"
    )
    p.add_argument("--naive-repeats", type=int, default=5, help="timed calls of the slow eager loop")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices to create (before JAX starts)")
    p.add_argument(
        "--mesh-devices", type=int, default=8, help="devices of the DP / FSDP mesh for the timing rows"
    )
    p.add_argument("--compile-shards", default="1,2,8,32,128", help="S values for the compile-time rows")
    p.add_argument("--compile-repeats", type=int, default=5, help="fresh compiles per S (median reported)")
    p.add_argument("--memory-shards", default="8,128", help="S values for the simulation temp-memory rows")
    p.add_argument("--fsdp-batch", type=int, default=256, help="B of the FSDP / DP memory comparison")
    p.add_argument("--fsdp-dim", type=int, default=4096, help="D = K of the FSDP / DP memory comparison")
    p.add_argument("--fsdp-devices", type=int, default=4, help="devices of the FSDP / DP memory comparison")
    p.add_argument("--latency-batch", type=int, default=64, help="B of the repeated entrypoint call")
    p.add_argument("--latency-features", type=int, default=16, help="D of the repeated entrypoint call")
    p.add_argument("--latency-outputs", type=int, default=4, help="K of the repeated entrypoint call")
    p.add_argument("--latency-repeats", type=int, default=200, help="timed entrypoint calls")
    p.add_argument(
        "--harness-size",
        default="512,1024,512,256",
        help="D,H,K,B of the harness-overhead MLP (Adam, 4 devices)",
    )
    p.add_argument("--harness-steps", type=int, default=10, help="steps of the harness-overhead rows")
    p.add_argument("--harness-repeats", type=int, default=3, help="timed runs of the harness rows (best)")
    p.add_argument("--cli-repeats", type=int, default=3, help="timed runs of each command line row (median)")
    p.add_argument("--out", type=Path, default=HERE / "results.json", help="where to write the JSON")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="also print the README's benchmark table (Markdown) at the end",
    )
    p.add_argument(
        "--readme", type=Path, nargs="?", const=HERE / "README.md", default=None,
        help="rewrite the results section of this README (default benchmarks/README.md) with the new figures, and "
        "the ratio table of the project's README.md",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (smoke test, seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.features, args.outputs, args.shards = 64, 8, 8, 4
        args.repeats, args.warmup, args.naive_repeats, args.compile_repeats = 3, 1, 1, 1
        args.compile_shards, args.memory_shards = "1,2", "2,4"
        args.fsdp_batch, args.fsdp_dim, args.fsdp_devices = 16, 16, 4
        args.latency_repeats = 10
        args.devices, args.mesh_devices = 4, 4
        args.harness_size, args.harness_steps, args.harness_repeats, args.cli_repeats = "8,16,8,16", 2, 1, 1
    args.compile_shards = sorted({2, *(int(s) for s in str(args.compile_shards).split(","))})
    args.harness_size = tuple(int(v) for v in str(args.harness_size).split(","))
    args.memory_shards = sorted({int(s) for s in str(args.memory_shards).split(",")})
    for s in args.compile_shards + args.memory_shards + [args.shards]:
        if args.batch % s:
            p.error(f"every shard count must divide --batch {args.batch}; {s} does not")
    if args.batch % args.mesh_devices or args.fsdp_batch % args.fsdp_devices:
        p.error("--batch must divide over --mesh-devices and --fsdp-batch over --fsdp-devices")
    if max(args.mesh_devices, args.fsdp_devices, 4) > args.devices:
        p.error("--devices must be at least 4 (the harness rows), --mesh-devices and --fsdp-devices")
    return args


ARGS = parse_args() if __name__ == "__main__" else None

# JAX must learn the fake device count before it initializes a backend: configure it before importing shardcheck.
import jax  # noqa: E402

if ARGS is not None:
    jax.config.update("jax_num_cpu_devices", ARGS.devices)
jax.config.update("jax_enable_compilation_cache", False)  # compile times are of fresh compiles

import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import shardcheck  # noqa: E402
from shardcheck.losses import mse_loss  # noqa: E402
from shardcheck.memory import measure_memory  # noqa: E402
from shardcheck.mesh import make_mesh  # noqa: E402
from shardcheck.seeds import mesh_steps as spmd  # noqa: E402
from shardcheck.seeds import reference as baseline  # noqa: E402
from shardcheck.seeds import simulation  # noqa: E402

# ------------------------------------------------------------------------------------------------- helpers


def block(out):
    return jax.block_until_ready(out)


def summary(samples: list[float]) -> dict:
    q = np.quantile(samples, [0.25, 0.5, 0.75]) if samples else [math.nan] * 3
    return {
        "median_s": float(statistics.median(samples)) if samples else math.nan,
        "min_s": float(min(samples)) if samples else math.nan,
        "p25_s": float(q[0]),
        "p75_s": float(q[2]),
        "repeats": len(samples),
    }


def memory_of(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {k: None for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")}
    return {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
    }


def kernel_profile(compiled) -> dict:
    """What XLA:CPU compiles into separate kernels (each fusion is one LLVM-generated function)."""
    text = compiled.as_text()
    return {
        "fusions": text.count(" fusion("),
        "library_dots": text.count(" dot("),
        "while_loops": text.count(" while("),
    }


def linear(d: int, k: int, seed: int = 0):
    model = nnx.Linear(d, k, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def naive_eager_step(model, optimizer, x, y, num_shards: int):
    """The obvious implementation of seed 000: a Python loop over the shards, eager, then sum / S and update."""
    losses, grads = [], []
    for xs, ys in zip(jnp.split(x, num_shards), jnp.split(y, num_shards), strict=True):
        loss, g = nnx.value_and_grad(mse_loss)(model, xs, ys)
        losses.append(loss)
        grads.append(g)
    mean = shardcheck.tree_mean(grads)
    optimizer.update(model, mean)
    return jnp.mean(jnp.stack(losses)), mean


def fresh_sim_jit(graphdef, keep: bool):
    """A new ``jax.jit`` of the simulation core (as ``simulation._reduced_step_jit``): nothing cached."""

    def core(state, xs, ys):
        model, optimizer = nnx.merge(graphdef, state)
        result = simulation.apply_reduced_update(model, optimizer, xs, ys, None, keep)
        return result, nnx.state((model, optimizer))

    return jax.jit(core)


class Chained:
    """A donated mesh step ``(state_leaves, batch) -> (loss, state_leaves)``: each call feeds the state the
    previous call returned."""

    def __init__(self, step, placed, batch):
        self.step, self.state, self.batch = step, placed, batch

    def __call__(self):
        loss, self.state = self.step(self.state, self.batch)
        return loss, self.state


# ---------------------------------------------------------------------------------------------- the benchmark


class Clock:
    """Wall time of each section of the run (``section_wall_s`` in the JSON)."""

    def __init__(self):
        self.t, self.laps = time.perf_counter(), {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now


def run(args) -> dict:
    clock = Clock()
    B, D, K, S = args.batch, args.features, args.outputs, args.shards
    results: dict = {
        "schema": 1,
        "machine": {
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "system": platform.system(),
            "python": platform.python_version(),
            "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__,
            "flax_version": __import__("flax").__version__,
            "optax_version": optax.__version__,
            "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind,
            "num_devices": len(jax.devices()),
            "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out", "readme")
        },
    }
    kx, ky, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, D), jnp.float32)
    y = jax.random.normal(ky, (B, K), jnp.float32)
    g = jax.random.normal(kg, (B, K), jnp.float32)
    xs, ys, _ = simulation.split_shards("benchmark", x, y, S)

    model, optimizer = linear(D, K)
    graphdef, state = nnx.split((model, optimizer))
    w = model.kernel[...]

    matmul = jax.jit(lambda x, w, g: (x @ w, x.T @ g))
    gs = g.reshape(S, B // S, K)

    @jax.jit
    def matmul_blocked(xs, w, gs):
        """The same two products in S row blocks, as the simulation's scan does them (a running sum of x_s.T @ g_s)."""

        def block(acc, xg):
            xb, gb = xg
            return acc + xb.T @ gb, xb @ w

        acc, out = jax.lax.scan(block, jnp.zeros((D, K), jnp.float32), (xs, gs))
        return out, acc

    naive_model, naive_opt = linear(D, K)
    pub_model, pub_opt = linear(D, K)
    pub_sim_model, pub_sim_opt = linear(D, K)

    mesh = make_mesh(args.mesh_devices)
    mesh_rows = {}
    for strategy in ("dp", "fsdp"):
        m, o = linear(D, K)
        step, placed_args, _ = spmd._prepare(
            f"benchmark_{strategy}", strategy, m, o, x, y, mesh, "data", 0
        )  # the compiled shard_map step and its already-placed arguments (validation done once, here)
        mesh_rows[strategy] = (step, placed_args, m, o)
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    x_mesh, y_mesh = jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding)
    dp_pub = linear(D, K)
    fsdp_pub = linear(D, K)

    rows = {
        "full": (
            "jitted sgd_step core (baseline._sgd_step_jit), placed arrays",
            lambda: baseline._sgd_step_jit(graphdef, state, x, y),
        ),
        "sim_saved": (
            f"jitted reduced_sgd_step core, S={S}, every shard's grads kept",
            lambda: simulation._reduced_step_jit(graphdef, state, xs, ys, None, True),
        ),
        "sim_stream": (
            f"jitted reduced_sgd_step core, S={S}, streaming running sum",
            lambda: simulation._reduced_step_jit(graphdef, state, xs, ys, None, False),
        ),
        "matmul_bound": ("jitted x @ W and x.T @ g only", lambda: matmul(x, w, g)),
        "matmul_blocked": (
            f"the same products in S={S} row blocks (lax.scan, running sum): the simulation's arithmetic alone",
            lambda: matmul_blocked(xs, w, gs),
        ),
        "naive_eager": (
            f"eager Python loop over S={S} shards, tree_mean, update",
            lambda: naive_eager_step(naive_model, naive_opt, x, y, S),
        ),
        "dp": (
            f"compiled DP shard_map step, {args.mesh_devices} CPU devices, placed state",
            Chained(mesh_rows["dp"][0], *mesh_rows["dp"][1]),
        ),
        "fsdp": (
            f"compiled FSDP shard_map step, {args.mesh_devices} CPU devices, placed state",
            Chained(mesh_rows["fsdp"][0], *mesh_rows["fsdp"][1]),
        ),
        "full_public": (
            "sgd_step(model, optimizer, x, y): core + host overhead",
            lambda: shardcheck.sgd_step(pub_model, pub_opt, x, y),
        ),
        "sim_saved_public": (
            f"reduced_sgd_step(..., S={S}): core + host overhead (split, validation)",
            lambda: shardcheck.reduced_sgd_step(pub_sim_model, pub_sim_opt, x, y, S),
        ),
        "dp_public": (
            "data_parallel_sgd_step on mesh-placed x, y: core + host overhead",
            lambda: spmd.data_parallel_sgd_step(*dp_pub, x_mesh, y_mesh, mesh),
        ),
        "fsdp_public": (
            "fsdp_sgd_step on mesh-placed x, y: core + host overhead",
            lambda: spmd.fsdp_sgd_step(*fsdp_pub, x_mesh, y_mesh, mesh),
        ),
    }

    clock.lap("setup")
    # Same result: the simulation (both modes) and the naive loop against the full-batch gradient.
    full_grads = nnx.grad(mse_loss)(model, x, y)
    ref = np.asarray(full_grads["kernel"][...])
    scale = float(np.max(np.abs(ref))) or 1.0
    checks = {}
    for keep in (True, False):
        r, _ = simulation._reduced_step_jit(graphdef, state, xs, ys, None, keep)
        checks[f"sim_{'saved' if keep else 'stream'}_kernel_grad_rel_err"] = float(
            np.max(np.abs(np.asarray(r.grads["kernel"][...]) - ref)) / scale
        )
    check_model, check_opt = linear(D, K)
    _, naive_grads = naive_eager_step(check_model, check_opt, x, y, S)
    checks["naive_kernel_grad_rel_err"] = float(
        np.max(np.abs(np.asarray(naive_grads["kernel"][...]) - ref)) / scale
    )
    results["checks"] = checks

    clock.lap("checks")
    # Memory of each compiled computation, per device (before timing: the mesh steps donate their state).
    memory = {
        "full": memory_of(baseline._sgd_step_jit.lower(graphdef, state, x, y).compile()),
        "sim_saved": memory_of(
            simulation._reduced_step_jit.lower(graphdef, state, xs, ys, None, True).compile()
        ),
        "sim_stream": memory_of(
            simulation._reduced_step_jit.lower(graphdef, state, xs, ys, None, False).compile()
        ),
        "matmul_bound": memory_of(matmul.lower(x, w, g).compile()),
        "matmul_blocked": memory_of(matmul_blocked.lower(xs, w, gs).compile()),
        "naive_eager": {"note": "no single compiled program: one dispatch per operation"},
    }
    for strategy, (step, placed_args, _, _) in mesh_rows.items():
        memory[strategy] = memory_of(step.lower(*placed_args).compile())
    results["memory"] = memory

    clock.lap("memory")
    # Warm-up (compiles everything), then interleaved rounds.
    for _, fn in rows.values():
        for _ in range(args.warmup):
            block(fn())
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for i in range(args.repeats):
        for name, (_, fn) in rows.items():
            if name == "naive_eager" and i >= args.naive_repeats:
                continue
            t0 = time.perf_counter()
            block(fn())
            samples[name].append(time.perf_counter() - t0)
    timing = {name: {"what": what, **summary(samples[name])} for name, (what, _) in rows.items()}
    # The same ratios per round (both rows timed in the same round), then their median: less sensitive to drift.
    paired = {
        f"paired_{a}_over_{b}": float(statistics.median(np.divide(samples[a], samples[b])))
        for a, b in (("sim_stream", "full"), ("sim_saved", "full"), ("full", "matmul_bound"))
    }
    for name in ("full", "sim_saved", "dp", "fsdp"):
        # Per-call host work of the public function: its time minus its core's, paired by round (median), and
        # the difference of the fastest calls (less sensitive to load). Noise can make either slightly negative.
        pub, core = samples[f"{name}_public"], samples[name]
        timing[f"{name}_public"]["host_overhead_s"] = float(statistics.median(np.subtract(pub, core)))
        timing[f"{name}_public"]["host_overhead_min_s"] = float(min(pub) - min(core))
    results["timing"] = timing

    clock.lap("timing")
    # The simulation's temp bytes as S grows (B fixed).
    sim_temp = {"saved": {}, "stream": {}}
    for s in args.memory_shards:
        sxs = jax.ShapeDtypeStruct((s, B // s, D), jnp.float32)
        sys_ = jax.ShapeDtypeStruct((s, B // s, K), jnp.float32)
        for keep in (True, False):
            compiled = simulation._reduced_step_jit.lower(graphdef, state, sxs, sys_, None, keep).compile()
            sim_temp["saved" if keep else "stream"][str(s)] = memory_of(compiled)
    results["sim_memory_by_shards"] = sim_temp

    clock.lap("sim_memory")
    # Compile time of the simulation as S grows: fresh jit each time, trace + lower, then XLA compile.
    compile_rows: dict = {"saved": {}, "stream": {}}
    for rep in range(args.compile_repeats):
        for s in args.compile_shards:
            sxs = jax.ShapeDtypeStruct((s, B // s, D), jnp.float32)
            sys_ = jax.ShapeDtypeStruct((s, B // s, K), jnp.float32)
            for keep in (True, False):
                t0 = time.perf_counter()
                lowered = fresh_sim_jit(graphdef, keep).lower(state, sxs, sys_)
                t1 = time.perf_counter()
                compiled = lowered.compile()
                t2 = time.perf_counter()
                row = compile_rows["saved" if keep else "stream"].setdefault(
                    str(s), {"lower": [], "compile": []}
                )
                row["lower"].append(t1 - t0)
                row["compile"].append(t2 - t1)
                if rep == 0:
                    row.update(kernel_profile(compiled))
    for mode in compile_rows.values():
        for row in mode.values():
            lower, comp = row.pop("lower"), row.pop("compile")
            row["trace_lower_s"] = statistics.median(lower)
            row["xla_compile_s"] = statistics.median(comp)
            row["total_s"] = statistics.median([a + b for a, b in zip(lower, comp, strict=True)])
    results["compile"] = compile_rows

    clock.lap("compile")
    # FSDP against DP memory per device on a wide layer: shardcheck.memory.measure_memory compiles each
    # strategy's real step, reads XLA's memory_analysis and the live state bytes after one step.
    fb, fd, fn_ = args.fsdp_batch, args.fsdp_dim, args.fsdp_devices
    fmesh = make_mesh(fn_)
    fx = np.asarray(jax.random.normal(kx, (fb, fd), jnp.float32))
    fy = np.asarray(jax.random.normal(ky, (fb, fd), jnp.float32))
    fsdp_mem = {"batch": fb, "features": fd, "outputs": fd, "devices": fn_}
    for strategy in ("dp", "fsdp"):
        m, o = linear(fd, fd)
        measured = measure_memory(m, o, fx, fy, strategy=strategy, mesh=fmesh)
        fsdp_mem[strategy] = {
            k: v
            for k, v in dataclasses.asdict(measured).items()
            if k.endswith("_bytes") and isinstance(v, int)
        }
        del m, o, measured
    results["fsdp_vs_dp_memory"] = fsdp_mem

    clock.lap("fsdp_memory")
    # Latency of a repeated seed entrypoint call on a tiny problem, a new lr each call.
    rng = np.random.default_rng(0)
    lx = rng.normal(size=(args.latency_batch, args.latency_features)).astype(np.float32)
    ly = rng.normal(size=(args.latency_batch, args.latency_outputs)).astype(np.float32)
    ls = max(s for s in (S, 4, 2, 1) if args.latency_batch % s == 0)
    entrypoints = {
        "seed000_numpy": (shardcheck.simulated_data_parallel_step, lx, ly),
        "seed000_jax": (shardcheck.simulated_data_parallel_step, jnp.asarray(lx), jnp.asarray(ly)),
        "seed001_numpy": (shardcheck.fsdp_step, lx, ly),
        "seed001_jax": (shardcheck.fsdp_step, jnp.asarray(lx), jnp.asarray(ly)),
    }
    lat = {name: [] for name in entrypoints}
    for i in range(max(args.warmup, 1)):
        for fn, a, b in entrypoints.values():
            block(fn(a, b, num_shards=ls, lr=0.5 + i))
    for i in range(args.latency_repeats):
        for name, (fn, a, b) in entrypoints.items():
            lr = 0.01 + 1e-4 * i  # a new value every call: it travels as a traced scalar, no re-trace
            t0 = time.perf_counter()
            block(fn(a, b, num_shards=ls, lr=lr))
            lat[name].append(time.perf_counter() - t0)
    results["latency"] = {
        "batch": args.latency_batch,
        "features": args.latency_features,
        "outputs": args.latency_outputs,
        "num_shards": ls,
        **{f"{name}_ms": 1e3 * statistics.median(v) for name, v in lat.items()},
        **{f"{name}_p75_ms": 1e3 * float(np.quantile(v, 0.75)) for name, v in lat.items()},
    }

    clock.lap("latency")
    results["harness"] = harness_rows(args)
    clock.lap("harness")
    results["cli"] = cli_rows(args)
    clock.lap("cli")
    results["cold_verify"] = cold_verify_rows(args)
    clock.lap("cold_verify")
    # Ratios against targets.
    med = {name: t["median_s"] for name, t in timing.items()}
    cmin, cmax = min(args.compile_shards), max(args.compile_shards)
    mmin, mmax = min(args.memory_shards), max(args.memory_shards)
    compile_ratio = {
        mode: compile_rows[mode][str(cmax)]["total_s"] / compile_rows[mode][str(cmin)]["total_s"]
        for mode in compile_rows
    }
    ratios = {
        "sim_stream_over_full": med["sim_stream"] / med["full"],
        "sim_saved_over_full": med["sim_saved"] / med["full"],
        "full_over_matmul": med["full"] / med["matmul_bound"],
        "compile_s128_over_s1": max(compile_ratio.values()),
        "stream_temp_s128_over_s8": sim_temp["stream"][str(mmax)]["temp_bytes"]
        / max(sim_temp["stream"][str(mmin)]["temp_bytes"], 1),
        "fsdp_temp_over_dp_temp": fsdp_mem["fsdp"]["temp_bytes"] / max(fsdp_mem["dp"]["temp_bytes"], 1),
        "repeat_call_ms": max(results["latency"]["seed000_numpy_ms"], results["latency"]["seed000_jax_ms"]),
        "compile_s128_over_s2": max(
            compile_rows[mode][str(cmax)]["total_s"] / compile_rows[mode]["2"]["total_s"]
            for mode in compile_rows
        ),
        **{f"parity_over_steps_{k}": (v or {}).get("ratio") for k, v in results["harness"]["rows"].items()},
        **{f"cli_{k}_s": v.get("median_s") for k, v in results["cli"].items()},
        **cold_verify_ratios(results["cold_verify"]),
    }
    results["ratios"] = ratios
    looped = [s for s in args.compile_shards if s >= 2] or [cmin]  # the smallest S that compiles the loop
    results["other_ratios"] = {
        **paired,
        "naive_over_sim_saved": med["naive_eager"] / med["sim_saved"],
        "dp_over_full": med["dp"] / med["full"],
        "fsdp_over_full": med["fsdp"] / med["full"],
        "sim_stream_over_matmul": med["sim_stream"] / med["matmul_bound"],
        "matmul_blocked_over_matmul": med["matmul_blocked"] / med["matmul_bound"],
        "sim_stream_over_matmul_blocked": med["sim_stream"] / med["matmul_blocked"],
        "paired_matmul_blocked_over_matmul": float(
            statistics.median(np.divide(samples["matmul_blocked"], samples["matmul_bound"]))
        ),
        "compile_saved_s128_over_s1": compile_ratio["saved"],
        "compile_stream_s128_over_s1": compile_ratio["stream"],
        "compile_saved_max_over_smallest_looped_s": compile_rows["saved"][str(cmax)]["total_s"]
        / compile_rows["saved"][str(looped[0])]["total_s"],
        "compile_stream_max_over_smallest_looped_s": compile_rows["stream"][str(cmax)]["total_s"]
        / compile_rows["stream"][str(looped[0])]["total_s"],
        "saved_temp_s128_over_s8": sim_temp["saved"][str(mmax)]["temp_bytes"]
        / max(sim_temp["saved"][str(mmin)]["temp_bytes"], 1),
    }
    fmt = {
        "S": S, "cmin": cmin, "cmax": cmax, "mmin": mmin, "mmax": mmax, "fb": fb, "fd": fd, "fn": fn_,
        "lb": args.latency_batch, "ld": args.latency_features, "lk": args.latency_outputs,
        "hsetup": results["harness"]["setup"], "lmsetup": results["harness"]["tiny_lm_setup"],
        "cr": args.cli_repeats,
    }  # fmt: skip
    results["targets"] = {}
    for key, (limit, what) in TARGETS.items():
        if ratios[key] is None:  # not measured in this run (--quick)
            results["targets"][key] = {
                "what": what.format(**fmt),
                "target": limit,
                "value": None,
                "met": None,
                "why_not": "not measured with --quick",
            }
            continue
        met = bool(ratios[key] <= limit)
        results["targets"][key] = {
            "what": what.format(**fmt),
            "target": limit,
            "value": ratios[key],
            "met": met,
            "why_not": None if met else explain(key, results, args),
        }
    clock.lap("ratios")
    results["section_wall_s"] = clock.laps
    results["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return results


def harness_rows(args) -> dict:
    """check_parity / bare steps (benchmarks/overhead.py) for dp and fsdp on the MLP, dp on tiny-lm; a profile."""
    import overhead

    d, h, k, b = args.harness_size
    task = overhead.mlp_task(d, h, k, b, args.harness_steps)
    rows = {s: overhead.measure(task, s, 4, args.harness_repeats) for s in ("dp", "fsdp")}
    lm_setup = f"{args.harness_steps} steps of B=16 x T=32 tokens, Adam, S=4"
    if args.quick:
        rows["tiny_lm"] = rows["tiny_lm_accumulation"] = None
    else:
        from shardcheck.tasks import load_task

        lm = load_task("tiny-lm", optimizer="adam", steps=args.harness_steps)
        rows["tiny_lm"] = overhead.measure(lm, "dp", 4, args.harness_repeats)
        rows["tiny_lm_accumulation"] = overhead.measure_against_reference(
            lm, "accumulation", 4, args.harness_repeats
        )
    prof = overhead.profile(task, "dp", 4, warm=True)
    out = {
        "setup": f"MLP {d} -> {h} -> {k}, Adam, B={b}, {args.harness_steps} steps, 4 CPU devices",
        "tiny_lm_setup": lm_setup,
        "rows": rows,
        "profile_dp": {"profiled_s": prof["profiled_s"], "cumulative_s": prof["cumulative_s"]},
        "profile_dp_top": _relative_paths(prof["top"]),
    }
    if not args.quick:  # the tiny-lm's own profile: many small leaves, where the MLP has few large ones
        prof = overhead.profile(lm, "dp", 4, warm=True)
        out["profile_tiny_lm"] = {"profiled_s": prof["profiled_s"], "cumulative_s": prof["cumulative_s"]}
    return out


def cli_rows(args) -> dict:
    """Wall seconds of the command line in subprocesses: ``shardcheck --help``, ``run``, ``verify --devices 4
    --steps 5``, each run ``--cli-repeats`` times after one run that fills a fresh cache folder (compiled steps
    and the copy of the diabetes data); the median and the best of the repeated runs."""
    import shutil
    import subprocess
    import tempfile

    # this interpreter's own entry point first: a ``shardcheck`` earlier on PATH may belong to another Python
    beside = Path(sys.executable).with_name("shardcheck")
    exe = str(beside) if beside.exists() else shutil.which("shardcheck")
    commands = {"help": ["--help"], "run": ["run"], "verify": ["verify", "--devices", "4", "--steps", "5"]}
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SHARDCHECK_COMPILATION_CACHE": cache}
        for name, argv in commands.items():
            if args.quick and name != "help":
                out[name] = {"argv": argv, "median_s": None, "best_s": None}
                continue
            times = []
            for _ in range(args.cli_repeats + 1):
                t0 = time.perf_counter()
                proc = subprocess.run([exe, *argv], capture_output=True, text=True, env=env, timeout=600)
                times.append(time.perf_counter() - t0)
            out[name] = {
                "argv": argv,
                "first_s": times[0],
                "median_s": statistics.median(times[1:]),
                "best_s": min(times[1:]),
                "all_s": times,
                "returncode": proc.returncode,
            }
    return out


def cold_verify_rows(args) -> dict | None:
    """The user's view of ``verify`` (benchmarks/cold_verify.py): cold and warm, beside the bare steps."""
    if args.quick:
        return None
    import cold_verify

    return cold_verify.measure()


def _cold_row(cold: dict | None, name: str) -> dict | None:
    return None if cold is None else next(r for r in cold["rows"] if r["name"] == name)


def cold_verify_ratios(cold: dict | None) -> dict:
    lm, bf16 = _cold_row(cold, "tiny-lm f32, 8 devices"), _cold_row(cold, "tiny-lm bf16 compute, 4 devices")
    return {
        "cold_verify_tiny_lm_s": lm and lm["verify_cold"]["process_wall_s"],
        "cold_verify_tiny_lm_over_bare": lm and lm["cold_ratio"],
        "cold_verify_bf16_s": bf16 and bf16["verify_cold"]["process_wall_s"],
    }


def _explain_cold(key: str, cold: dict) -> str:
    """Where a cold ``verify``'s time goes: its compilations against the bare steps' (benchmarks/cold_verify.py)."""
    name = "tiny-lm bf16 compute, 4 devices" if key == "cold_verify_bf16_s" else "tiny-lm f32, 8 devices"
    row = _cold_row(cold, name)
    v, b = row["verify_cold"], row["bare_cold"]
    return (
        f"{name}, {row['steps']} steps: cold verify {v['process_wall_s']:.1f} s, of which {v['compile_s']:.1f} s in "
        f"{v['compiles']} backend compilations; the cold bare steps of the same strategies {b['process_wall_s']:.1f} "
        f"s, {b['compile_s']:.1f} s in {b['compiles']} compilations; warm, verify {row['verify_warm']['process_wall_s']:.1f} "
        f"s against {row['bare_warm']['process_wall_s']:.1f} s. The compilations beyond the bare steps' are the "
        "check's own programs: the first pass's leaf statistics (one, for every strategy of the verify), the "
        "loss probe, the gradient's tolerance (one), its update sensitivity (one, compiled at step 0), the "
        "accumulated allowance (one per tree: parameters, optimizer state) and the zeros standing for a deferred "
        "sensitivity, and under bfloat16 compute the low-precision realizations; "
        "copies compile nothing. " + _warm_share(row) + _cold_floor(key, v, b)
    )


def _warm_share(row: dict) -> str:
    """How much of the check's cold cost beyond the bare steps is still there warm (host work, not compiles)."""
    cold = row["verify_cold"]["process_wall_s"] - row["bare_cold"]["process_wall_s"]
    warm = row["verify_warm"]["process_wall_s"] - row["bare_warm"]["process_wall_s"]
    return (
        f"Of the {cold:.1f} s the check adds cold, {warm:.1f} s remain warm, every program loaded from the cache: "
        "the check's host-side work (tracing its programs, the comparisons), not its compiles. "
    )


def _cold_floor(key: str, verify: dict, bare: dict) -> str:
    """Whether the cold target is within reach of any check: the bare steps' own cold time against it, and the
    time a check spends beyond them (what dropping every check would save at most)."""
    limit = TARGETS[key][0]
    extra = verify["process_wall_s"] - bare["process_wall_s"]
    if key.endswith("_over_bare"):
        return f"Beyond the bare steps the check spends {extra:.1f} s cold ({verify['compiles'] - bare['compiles']} more compilations)."
    if bare["process_wall_s"] >= limit:
        return (
            f"The bare steps alone take {bare['process_wall_s']:.1f} s cold, over the {limit:g} s target: dropping "
            "every check would not meet it on this machine (the time is JAX's start, tracing and XLA:CPU's compiles "
            "of the steps themselves)."
        )
    return (
        f"The bare steps take {bare['process_wall_s']:.1f} s cold: meeting {limit:g} s would mean saving "
        f"{verify['process_wall_s'] - limit:.1f} s of the check's {extra:.1f} s, i.e. dropping the sensitivity pass "
        "and the on-device comparisons' compiles (no check is dropped)."
    )


# The checks check_parity adds to the two steps it runs, by the profile rows that time them (benchmarks/overhead.py)
SENSITIVITY = "the update-sensitivity pass (the propagated tolerance of Adam's rounding-level leaves)"
HARNESS_CHECKS = {
    SENSITIVITY: (
        "the step's bounds: tolerance, low-precision noise (step_bounds)",
        "update sensitivity, where a step reads it (_Sensitivity.get)",
        "per-shard gradient split for the sensitivity (split_gradients)",
    ),
    "the per-leaf comparisons (first pass, the full pass at step 0 and on failure, the loss on the host)": (
        "first pass (first_pass.clear)",
        "on-device leaf comparisons, one call per step (leaf_errors)",
        "float64 host comparisons (leaf_error: the loss, fallbacks)",
    ),
    "the replica agreement": ("replica agreement (replica_mismatches)",),
    "the scale evidence (which leaves would show a gradient off by S)": ("scale evidence (_scale_evidence)",),
    "the state kept for a re-check": ("state copies for the re-check (copy_state)",),
    "the reference's finiteness check": ("reference finiteness check (_reference_finite)",),
}


def _what_to_drop(key: str, row: dict, prof: dict) -> str:
    """Which checks the harness would have to drop to meet the target: the largest first, by their profiled
    seconds scaled to the unprofiled run, until the check fits ``target x bare steps``."""
    limit = TARGETS[key][0]
    budget, measured = limit * row["bare_steps_s"], row["check_parity_s"]
    scale = measured / prof["profiled_s"]  # the profiler's own overhead, spread evenly
    costs = {
        name: scale * sum(prof["cumulative_s"].get(k, 0.0) for k in rows)
        for name, rows in HARNESS_CHECKS.items()
    }
    if row.get("without_sensitivity_s") is not None:
        # measured by dropping it, in place of its profiled seconds
        costs[SENSITIVITY] = max(measured - row["without_sensitivity_s"], 0.0)
    excess, dropped = measured - budget, []
    for name, cost in sorted(costs.items(), key=lambda kv: -kv[1]):
        if excess <= 0 or cost < 0.005:
            break
        dropped.append(f"{name} (~{cost:.2f} s)")
        excess -= cost
    need = "; ".join(dropped) + (" and still more" if excess > 0 else "")
    return f"Meeting <= {limit} (a check of at most {budget:.2f} s) would mean dropping {need}; no check is dropped. "


def _sensitivity_dropped(row: dict) -> str:
    """What the update-sensitivity pass costs, measured by dropping it (``overhead.without_sensitivity``)."""
    if row.get("without_sensitivity_s") is None:
        return ""
    without, full = row["without_sensitivity_s"], row["check_parity_s"]
    return (
        f"With the update-sensitivity pass replaced by zeros (a timing only, interleaved with the check's runs) "
        f"check_parity took {without:.2f} s: the pass, where it still runs, costs {full - without:+.2f} s "
        f"({(full - without) / full:+.0%}), "
        f"and a check that never ran it would stand at {without / row['bare_steps_s']:.2f}x the bare steps. "
    )


def explain(key: str, r: dict, args) -> str:
    """Why a target was missed, from the figures of this run (the profile behind the number)."""
    load = r["machine"].get("loadavg_start")
    load_txt = f" Load average at start {load[0]:.1f} on {r['machine']['cpu_count']} CPUs." if load else ""
    t = r["timing"]

    def spread(name):
        return f"{name} median {1e3 * t[name]['median_s']:.1f} ms (p25-p75 {1e3 * t[name]['p25_s']:.1f}-{1e3 * t[name]['p75_s']:.1f})"

    if key == "compile_s128_over_s1":
        o = r["other_ratios"]
        parts = []
        cmin, cmax = min(args.compile_shards), max(args.compile_shards)
        for mode, rows in r["compile"].items():
            lo, hi = rows[str(cmin)], rows[str(cmax)]
            parts.append(
                f"{mode}: S={cmin} {lo['total_s']:.2f} s with {lo['fusions']} fusions + {lo['library_dots']} dots, "
                f"{lo['while_loops']} loops; S={cmax} {hi['total_s']:.2f} s with {hi['fusions']} fusions + "
                f"{hi['library_dots']} dots, {hi['while_loops']} loops"
            )
        return (
            "XLA deletes a while loop whose trip count is 1, so S=1 compiles a loop-free program with fewer "
            "kernels; every S >= 2 compiles the same loop (no unrolling) and XLA:CPU's compile time is mostly "
            "LLVM code generation, roughly proportional to the number of kernels. "
            + "; ".join(parts)
            + ". Largest S over the smallest S >= 2: saved "
            f"{o['compile_saved_max_over_smallest_looped_s']:.2f}, stream "
            f"{o['compile_stream_max_over_smallest_looped_s']:.2f}"
            + (
                " (flat in S)."
                if max(o[f"compile_{m}_max_over_smallest_looped_s"] for m in r["compile"]) <= 1.5
                else "."
            )
            + load_txt
        )
    if key in ("sim_stream_over_full", "sim_saved_over_full"):
        name = "sim_stream" if key == "sim_stream_over_full" else "sim_saved"
        o = r["other_ratios"]
        return (
            f"{spread(name)} against {spread('full')}. The profile of the gap: the step's two matrix products "
            f"done in S={args.shards} row blocks, as the scan does them, and nothing else ({spread('matmul_blocked')}) take "
            f"{o['matmul_blocked_over_matmul']:.2f}x the same products on the whole batch "
            f"({o['paired_matmul_blocked_over_matmul']:.2f}x paired by round), while the full-batch step takes "
            f"{r['ratios']['full_over_matmul']:.2f}x its products and the streaming step "
            f"{o['sim_stream_over_matmul_blocked']:.2f}x its blocked products: what the simulation adds beyond XLA:CPU's "
            "slower blocked matmuls (B/S-row operands, S library calls in a while loop) is the per-shard slice and "
            "the running sum." + load_txt
        )
    if key == "full_over_matmul":
        return f"{spread('full')} against {spread('matmul_bound')}." + load_txt
    if key == "stream_temp_s128_over_s8":
        return f"streaming temp bytes by S: {r['sim_memory_by_shards']['stream']}"
    if key == "fsdp_temp_over_dp_temp":
        m = r["fsdp_vs_dp_memory"]
        return (
            f"DP temp {m['dp']['temp_bytes']} B, FSDP temp {m['fsdp']['temp_bytes']} B: FSDP's temp holds the "
            "all-gathered parameters and the full local gradient before its reduce-scatter (steps/sharded.py)."
        )
    if key == "repeat_call_ms":
        return f"per-call host work (validation, dispatch): {r['latency']}" + load_txt
    if key == "compile_s128_over_s2":
        rows = {
            mode: (v["2"]["total_s"], v[str(max(args.compile_shards))]["total_s"])
            for mode, v in r["compile"].items()
        }
        return f"total compile s (S=2, S=max) by mode: {rows}." + load_txt
    if key.startswith("parity_over_steps_"):
        h = r["harness"]
        row = h["rows"][key.removeprefix("parity_over_steps_")]
        profiled = h.get("profile_tiny_lm") if key.endswith("tiny_lm") else None
        which = "tiny-lm dp" if profiled else "dp"
        profiled = profiled or h["profile_dp"]
        prof = profiled["cumulative_s"]
        top = ", ".join(f"{k} {v:.2f} s" for k, v in prof.items())
        ref_s = prof["reference steps + sensitivity (_step_reference)"]
        return (
            f"check_parity {row['check_parity_s']:.2f} s against the bare steps {row['bare_steps_s']:.2f} s. "
            + _sensitivity_dropped(row)
            + "Each "
            "step the harness also snapshots both sides' state on the device, runs the update-sensitivity pass "
            "(the reference's optimizer at 16 points of the gradient's tolerance, a fori_loop: the propagated "
            "tolerance) where a verdict reads it (step 0, the steps looking for the scale evidence, a step that the "
            "allowances' lower bound does not clear, which then runs every deferred pass), reduces the few per-leaf scalars its rules read (the loss's drift, the rounding-level rule, "
            "the reference's finiteness), clears the leaves it can in a first pass (per-leaf maxima on the devices) "
            "and compares the rest in full (every leaf at step 0 and on a failing step: float64 on the host on "
            "XLA:CPU, whose buffers they are). On a CPU these passes read several times the bytes a step does, so "
            f"the ratio cannot reach its target without dropping a check: in the {which} profile below the "
            f"reference side (its step and the sensitivity pass) took {ref_s:.2f} s under the profiler, "
            f"{ref_s / row['bare_steps_s']:.1f}x the bare steps timed without it. Dispatch is asynchronous: a call "
            "that reads a result (a host copy, a device_put) waits there for the device's work, so the profile's "
            f"seconds are where the host waited, not what each pass computes. Profile of one warm {which} run under "
            f"cProfile ({profiled['profiled_s']:.2f} s, cumulative, nested): {top}. "
            + _what_to_drop(key, row, profiled)
            + load_txt
        )
    if key.startswith("cold_verify_"):
        return _explain_cold(key, r["cold_verify"]) + load_txt
    if key.startswith("cli_"):
        c = r["cli"][key.removeprefix("cli_").removesuffix("_s")]
        return (
            f"first run (empty cache) {c['first_s']:.2f} s, repeated {', '.join(f'{t:.2f}' for t in c['all_s'][1:])} s: "
            "with the caches warm (no XLA compilation, no scikit-learn import) what remains is importing "
            "JAX/Flax/optax (~1-1.5 s), tracing and lowering every step and every eager op (the cache keys on the "
            "lowered program, so tracing is not skipped), loading the executables, and the parity harness's "
            "host-side comparison." + load_txt
        )
    return ""


# --------------------------------------------------------------------------------------------------- output


def human_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    m = r["machine"]
    load = (
        f", load average {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}"
        if m["loadavg_start"]
        else ""
    )
    console.print(
        f"[bold]shardcheck benchmarks[/bold]: {m['cpu_count']} CPUs, jax {m['jax_version']}, backend "
        f"{m['backend']} ({m['device_kind']}, {m['num_devices']} devices){load}"
    )
    c = r["config"]
    full = r["timing"]["full"]["median_s"]
    tt = Table(
        title=f"Step time, B={c['batch']}, D={c['features']}, K={c['outputs']}, S={c['shards']} (median)"
    )
    for col in ("row", "median ms", "p25-p75 ms", "/ full", "XLA temp", "what is timed"):
        tt.add_column(
            col, justify="right" if col not in ("row", "what is timed") else "left", overflow="fold"
        )
    for name, t in r["timing"].items():
        mem = r["memory"].get(name, {})
        temp = mem.get("temp_bytes")
        tt.add_row(
            name,
            f"{1e3 * t['median_s']:.2f}",
            f"{1e3 * t['p25_s']:.1f}-{1e3 * t['p75_s']:.1f}",
            f"{t['median_s'] / full:.3f}",
            human_bytes(temp),
            t["what"]
            + (
                f" [host overhead {1e3 * t['host_overhead_s']:.1f} ms paired, {1e3 * t['host_overhead_min_s']:.1f} ms min]"
                if "host_overhead_s" in t
                else ""
            ),
        )
    console.print(tt)

    mt = Table(title="XLA memory per device (memory_analysis of the compiled program)")
    for col in ("computation", "argument", "output", "alias", "temp"):
        mt.add_column(col, justify="right" if col != "computation" else "left")
    rows = [(k, v) for k, v in r["memory"].items() if "temp_bytes" in v]
    rows += [(f"sim_{mode} S={s}", v) for mode, d in r["sim_memory_by_shards"].items() for s, v in d.items()]
    f = r["fsdp_vs_dp_memory"]
    rows += [(f"{k} B={f['batch']} D=K={f['features']} N={f['devices']}", f[k]) for k in ("dp", "fsdp")]
    for name, v in rows:
        mt.add_row(
            name,
            *(human_bytes(v[k]) for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")),
        )
    console.print(mt)

    ct = Table(title="Simulation compile time (fresh jit: trace + lower + XLA compile, median)")
    for col in ("mode", "S", "total s", "trace+lower s", "XLA s", "fusions", "dots", "loops"):
        ct.add_column(col, justify="right")
    for mode, d in r["compile"].items():
        for s, v in d.items():
            ct.add_row(
                mode, s, f"{v['total_s']:.3f}", f"{v['trace_lower_s']:.3f}", f"{v['xla_compile_s']:.3f}",
                str(v["fusions"]), str(v["library_dots"]), str(v["while_loops"]),
            )  # fmt: skip
    console.print(ct)

    rt = Table(title="Ratios against targets (one run)")
    for col in ("ratio", "measured", "target", "met"):
        rt.add_column(col, justify="right" if col != "ratio" else "left")
    for key, t in r["targets"].items():
        rt.add_row(
            f"{key}: {t['what']}",
            "-" if t["value"] is None else f"{t['value']:.3f}",
            f"<= {t['target']}",
            "[yellow]not measured" if t["met"] is None else "[green]yes" if t["met"] else "[red]NO",
        )
    console.print(rt)
    for key, t in r["targets"].items():
        if t["met"] is False:
            console.print(f"[red]{key} missed[/red]: {t['why_not']}")
    console.print(f"other ratios: { {k: round(v, 3) for k, v in r['other_ratios'].items()} }")
    console.print(f"same result (max |grad - full-batch grad| / max |grad|): {r['checks']}")


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def _explanations(missed: list[tuple[str, dict]]) -> list[str]:
    """One line per missed target; an explanation whose text after its first sentence (the figures of this
    row) was already given for another row says so instead of repeating it."""
    lines, seen = [], {}
    for key, t in missed:
        first, sep, rest = t["why_not"].partition(". ")
        if sep and len(rest) > 200 and rest in seen:
            lines.append(
                f"- **{key} missed**: {first}. The explanation and the profile are those of `{seen[rest]}`."
            )
        else:
            seen.setdefault(rest, key)
            lines.append(f"- **{key} missed**: {t['why_not']}")
    return lines


def render_markdown(r: dict) -> str:
    """The latest figures as Markdown tables (what ``--readme`` writes between the README's markers)."""
    m, c = r["machine"], r["config"]
    load = m.get("loadavg_start") or [math.nan]
    end = m.get("loadavg_end") or [math.nan]
    out = [
        f"Machine: {m['cpu_count']} CPUs ({m['machine']}, {m['system']}), backend `{m['backend']}` with "
        f"{m['num_devices']} devices, jax {m['jax_version']}, flax {m['flax_version']}, optax {m['optax_version']}; "
        f"load average {load[0]:.1f} at the start, {end[0]:.1f} at the end (other jobs shared the machine). "
        f"Problem B={c['batch']}, D={c['features']}, K={c['outputs']}, S={c['shards']}; {c['repeats']} interleaved "
        f"repeats after {c['warmup']} warm-ups; run took {r.get('wall_s', math.nan):.0f} s.",
        "",
        "| ratio | measured | target | met |",
        "|---|---:|---:|:---:|",
    ]
    for key, t in r["targets"].items():
        out.append(f"| `{key}`: {t['what']} | {_value(t)} | <= {t['target']} | {_met(t)} |")
    missed = [(k, t) for k, t in r["targets"].items() if t["met"] is False]
    if missed:
        out.append("")
        out += _explanations(missed)
    full = r["timing"]["full"]["median_s"]
    out += [
        "",
        "| row | median ms | p25-p75 ms | / full | XLA temp | what is timed |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, t in r["timing"].items():
        temp = r["memory"].get(name, {}).get("temp_bytes")
        extra = (
            f" (host overhead {1e3 * t['host_overhead_s']:.1f} ms paired, {1e3 * t['host_overhead_min_s']:.1f} ms min)"
            if "host_overhead_s" in t
            else ""
        )
        out.append(
            f"| {name} | {1e3 * t['median_s']:.1f} | {1e3 * t['p25_s']:.1f}-{1e3 * t['p75_s']:.1f} | "
            f"{t['median_s'] / full:.3f} | {human_bytes(temp)} | {t['what']}{extra} |"
        )
    out += ["", "| XLA memory per device | argument | output | alias | temp |", "|---|---:|---:|---:|---:|"]
    fields = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")
    rows = [(k, v) for k, v in r["memory"].items() if "temp_bytes" in v]
    rows += [(f"sim_{mode} S={s}", v) for mode, d in r["sim_memory_by_shards"].items() for s, v in d.items()]
    f = r["fsdp_vs_dp_memory"]
    rows += [(f"{k} B={f['batch']} D=K={f['features']} N={f['devices']}", f[k]) for k in ("dp", "fsdp")]
    out += [f"| {name} | " + " | ".join(human_bytes(v[k]) for k in fields) + " |" for name, v in rows]
    out += [
        "",
        "| compile (fresh jit) | S | total s | trace+lower s | XLA s | fusions | library dots | while loops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, d in r["compile"].items():
        for s, v in d.items():
            out.append(
                f"| {mode} | {s} | {v['total_s']:.3f} | {v['trace_lower_s']:.3f} | {v['xla_compile_s']:.3f} | "
                f"{v['fusions']} | {v['library_dots']} | {v['while_loops']} |"
            )
    lat = r["latency"]
    out += [
        "",
        f"Repeated entrypoint call, B={lat['batch']}, D={lat['features']}, K={lat['outputs']}, "
        f"num_shards={lat['num_shards']}, a new `lr` each call (median ms): "
        + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in lat.items() if k.endswith("_ms") and "_p75" not in k)
        + ".",
        "",
        "Other ratios: " + ", ".join(f"`{k}` {v:.3f}" for k, v in r["other_ratios"].items()) + ".",
        "",
        "Same result (max |kernel grad - full-batch kernel grad| / max |full-batch kernel grad|): "
        + ", ".join(f"`{k}` {v:.1e}" for k, v in r["checks"].items())
        + ".",
    ]
    return "\n".join(out)


def _value(t: dict) -> str:
    return "-" if t["value"] is None else f"{t['value']:.3g}"


def _met(t: dict) -> str:
    return "not measured" if t["met"] is None else "yes" if t["met"] else "**no**"


def render_ratios_markdown(r: dict) -> str:
    """The top-level README's ratio table (between its ``<!-- ratios:start -->`` markers): every target."""
    out = ["| ratio | measured | target | met |", "|---|---:|---:|:--:|"]
    out += [f"| {t['what']} | {_value(t)} | <= {t['target']} | {_met(t)} |" for t in r["targets"].values()]
    if any(t["met"] is False for t in r["targets"].values()):
        out += [
            "",
            "Where a target is not met, [benchmarks/README.md](benchmarks/README.md) says why, with the profile of "
            "the run.",
        ]
    return "\n".join(out)


RATIOS_START, RATIOS_END = "<!-- ratios:start -->", "<!-- ratios:end -->"
TOP_README = HERE.parent / "README.md"


def update_readme(path: Path, markdown: str, markers: tuple[str, str] = (README_START, README_END)) -> None:
    """Replace the text between ``markers`` in ``path`` with ``markdown``."""
    text = path.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    path.write_text(text[:start] + "\n" + markdown + "\n" + text[end:])


def main(argv=None) -> int:
    args = ARGS if argv is None and ARGS is not None else parse_args(argv)
    t0 = time.perf_counter()
    results = run(args)
    results["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")
    tmp.replace(args.out)
    render(results)
    print(f"wrote {args.out.name} ({results['wall_s']:.0f} s)")
    if args.readme is not None:
        update_readme(args.readme, render_markdown(results))
        print(f"updated the results section of {args.readme.name}")
        if TOP_README.exists() and RATIOS_START in TOP_README.read_text():
            update_readme(TOP_README, render_ratios_markdown(results), (RATIOS_START, RATIOS_END))
            print("updated the ratio table of the project's README.md")
    if args.markdown:
        print(render_ratios_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
