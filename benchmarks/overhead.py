"""The parity harness's cost against the steps it checks: ``check_parity`` wall time / the bare steps' wall time.

Both sides are warm: each configuration runs once untimed first (compiles the reference step, the candidate step
and the harness's own jitted functions), then ``check_parity`` and the bare steps (the task's reference step and
the candidate step, each over the same batches from fresh copies of the model) are timed, best of ``repeats``.
Imported by ``benchmarks/run.py`` after JAX has its fake CPU devices.
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardcheck
from shardcheck.losses import mse_batch_loss
from shardcheck.models import MLP
from shardcheck.steps import STRATEGIES
from shardcheck.steps.reference import reference_step


def mlp_task(d_in: int, hidden: int, d_out: int, batch: int, steps: int) -> shardcheck.Task:
    """The issue's setup: MLP ``d_in -> hidden -> d_out``, Adam(1e-2), ``steps`` batches of ``batch`` rows, MSE."""
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.normal(size=(batch, d_in)).astype(np.float32),
            rng.normal(size=(batch, d_out)).astype(np.float32),
        )
        for _ in range(steps)
    ]

    def loss_fn(model, b):
        return mse_batch_loss(model, b)

    return shardcheck.Task(
        model=lambda: MLP(d_in, hidden, d_out, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=loss_fn,
        batches=batches,
        name=f"mlp {d_in}-{hidden}-{d_out}",
    )


def _bare_steps(task: shardcheck.Task, strategy: str, num_shards: int) -> float:
    """Wall seconds of the reference's and the candidate's steps alone over every batch (fresh models)."""
    from shardcheck.steps.registry import mesh_for

    spec = STRATEGIES[strategy]
    cand = spec.build(task.loss_fn, num_shards, mesh_for("benchmark", spec, num_shards, None))
    ref_model = task.model()
    ref_opt = nnx.Optimizer(ref_model, task.optimizer, wrt=nnx.Param)
    cand_model = task.model()
    cand_opt = nnx.Optimizer(cand_model, task.optimizer, wrt=nnx.Param)
    if cand.make_optimizer is not None:
        cand_opt = cand.make_optimizer(cand_model, cand_opt)
    batches = [jax.tree.map(jax.numpy.asarray, b) for b in task.batches]
    jax.block_until_ready(batches)
    t0 = time.perf_counter()
    for b in batches:
        reference_step(task.loss_fn, ref_model, ref_opt, b)
    jax.block_until_ready(nnx.state(ref_model))
    for b in batches:
        cand.step(cand_model, cand_opt, b)
    jax.block_until_ready(nnx.state(cand_model))
    return time.perf_counter() - t0


def _bare_reference(task: shardcheck.Task) -> float:
    """Wall seconds of the task's reference step alone over every batch (a fresh model)."""
    model = task.model()
    opt = nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)
    batches = [jax.tree.map(jax.numpy.asarray, b) for b in task.batches]
    jax.block_until_ready(batches)
    t0 = time.perf_counter()
    for b in batches:
        reference_step(task.loss_fn, model, opt, b)
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - t0


def _parity(task, strategy, num_shards) -> tuple[float, bool]:
    t0 = time.perf_counter()
    report = shardcheck.check_parity(strategy, task, num_shards=num_shards)
    return time.perf_counter() - t0, bool(report.ok)


def measure(task: shardcheck.Task, strategy: str, num_shards: int, repeats: int = 3) -> dict:
    """``{"check_parity_s", "bare_steps_s", "ratio", "ok", "without_sensitivity_s"}``: best of ``repeats`` each,
    after one warm-up of each, the three interleaved in every round (the load drifts); the last is
    ``check_parity`` with the update-sensitivity pass replaced by zeros (:func:`without_sensitivity`)."""
    rounds = [
        (
            _bare_steps(task, strategy, num_shards),
            _parity(task, strategy, num_shards),
            without_sensitivity(task, strategy, num_shards),
        )
        for _ in range(repeats + 1)
    ][1:]  # round 0 warms up
    bare, runs, dropped = ([r[i] for r in rounds] for i in range(3))
    parity = min(s for s, _ in runs)
    return {
        "strategy": strategy,
        "num_shards": num_shards,
        "steps": len(task.batches),
        "check_parity_s": parity,
        "bare_steps_s": min(bare),
        "ratio": parity / min(bare),
        "ok": all(ok for _, ok in runs),
        "without_sensitivity_s": min(dropped),
    }


def measure_against_reference(
    task: shardcheck.Task, strategy: str, num_shards: int, repeats: int = 3
) -> dict:
    """Issue #35's accumulation row: warm ``check_parity(strategy)`` / twice the bare reference steps (the check
    runs the reference and a candidate whose arithmetic is the reference's, ``num_shards`` micro-batches of it).
    Best of ``repeats`` each after one warm-up of each, interleaved round by round. The keys of :func:`measure`,
    ``bare_steps_s`` being twice ``bare_reference_s`` and ``without_sensitivity_s`` not measured (``None``)."""
    # round 0 warms up
    rounds = [(_bare_reference(task), _parity(task, strategy, num_shards)) for _ in range(repeats + 1)][1:]
    ref = min(r[0] for r in rounds)
    parity = min(r[1][0] for r in rounds)
    return {
        "strategy": strategy,
        "num_shards": num_shards,
        "steps": len(task.batches),
        "check_parity_s": parity,
        "bare_reference_s": ref,
        "bare_steps_s": 2 * ref,
        "ratio": parity / (2 * ref),
        "ok": all(r[1][1] for r in rounds),
        "without_sensitivity_s": None,
    }


def without_sensitivity(task: shardcheck.Task, strategy: str, num_shards: int) -> float:
    """Wall seconds of one ``check_parity`` with the update-sensitivity pass replaced by zeros: what the pass
    costs, measured by dropping it rather than read from a profile, whose attribution an asynchronous dispatch
    blurs (a call that reads a result waits there for the device's work). A timing only: without the pass the
    tolerances are not the check's, so its verdicts are not read."""
    from shardcheck.parity.tolerance import allowances

    real = allowances.update_sensitivity
    allowances.update_sensitivity = _zero_sensitivity
    try:
        return _parity(task, strategy, num_shards)[0]
    finally:
        allowances.update_sensitivity = real


@functools.partial(jax.jit, static_argnums=0)
def _zero_sensitivity(tx, grads, opt_state, params, delta):
    """``propagation.update_sensitivity``'s outputs, with zero sensitivities (one optimizer update, for the
    shapes, where the real pass runs 17)."""
    updates, states = tx.update(grads, opt_state, params)
    zeros = jax.tree.map(jnp.zeros_like, (updates, states))
    return (*zeros, jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads))


# Where a warm check_parity's time goes: (category, module path suffix, function name) of the functions whose
# cumulative time is reported. They nest (leaf_error calls the host copies of its inputs), so they do not add up.
PROFILE_ROWS = (
    ("whole check_parity", "parity/harness/check.py", "check_parity"),
    ("reference steps + sensitivity (_step_reference)", "parity/harness/check.py", "_step_reference"),
    ("candidate steps (_step_candidate)", "parity/harness/check.py", "_step_candidate"),
    (
        "on-device leaf comparisons, one call per step (leaf_errors)",
        "parity/comparison/live.py",
        "leaf_errors",
    ),
    ("float64 host comparisons (leaf_error: the loss, fallbacks)", "parity/comparison/live.py", "leaf_error"),
    ("  of which the median update ratio (_ratio)", "parity/comparison/live.py", "_ratio"),
    ("host copies of leaves (to_host: np.asarray / gather)", "parity/comparison/live.py", "to_host"),
    ("the rules' per-leaf maxima (max_abs)", "parity/comparison/live.py", "max_abs"),
    ("the loss's drift allowance (abs_dot)", "parity/comparison/live.py", "abs_dot"),
    ("before-step snapshots on the device (device_snapshot)", "parity/comparison/live.py", "device_snapshot"),
    ("replica agreement (replica_mismatches)", "parity/comparison/live.py", "replica_mismatches"),
    ("state copies for the re-check (copy_state)", "shardcheck/_tree.py", "copy_state"),
    ("reference finiteness check (_reference_finite)", "parity/harness/check.py", "_reference_finite"),
    (
        "the step's bounds: tolerance, low-precision noise (step_bounds)",
        "parity/tolerance/allowances.py",
        "step_bounds",
    ),
    ("update sensitivity, where a step reads it (_Sensitivity.get)", "parity/tolerance/allowances.py", "get"),
    ("deferred passes computed and replayed (settle)", "parity/tolerance/allowances.py", "settle"),
    (
        "per-shard gradient split for the sensitivity (split_gradients)",
        "parity/tolerance/allowances.py",
        "split_gradients",
    ),
    ("first pass (first_pass.clear)", "parity/comparison/first_pass.py", "clear"),
    ("scale evidence (_scale_evidence)", "parity/diagnosis/scale_evidence.py", "_scale_evidence"),
    ("hypothesis reruns of a failure (_explained)", "parity/diagnosis/hypotheses.py", "_explained"),
    ("nnx.state / graph flatten", "flax/nnx/graphlib.py", "state"),
    (
        "every NNX graph traversal, the steps' own included (graphlib.flatten)",
        "flax/nnx/graphlib.py",
        "flatten",
    ),
    (
        "first pass: committing every leaf to its place (first_pass._moved: device_put)",
        "first_pass.py",
        "_moved",
    ),
)


def profile(task: shardcheck.Task, strategy: str, num_shards: int, *, warm: bool = False) -> dict:
    """cProfile of one warm ``check_parity`` run: ``{category: cumulative seconds}`` (:data:`PROFILE_ROWS`),
    ``profiled_s`` (the run under the profiler) and ``top`` (the 25 functions by cumulative time, as text).

    ``warm``: this configuration already ran in this process (:func:`measure`), so no untimed run comes first.
    """
    if not warm:
        _parity(task, strategy, num_shards)
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    _parity(task, strategy, num_shards)
    wall = time.perf_counter() - t0
    prof.disable()
    stats = pstats.Stats(prof)
    by_category = {}
    for category, suffix, name in PROFILE_ROWS:
        by_category[category] = sum(
            row[3] for (path, _, func), row in stats.stats.items() if func == name and path.endswith(suffix)
        )
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return {"profiled_s": wall, "cumulative_s": by_category, "top": out.getvalue()}


ROWS = ("dp", "fsdp", "tiny_lm", "tiny_lm_accumulation")
"""The harness rows of ``benchmarks/run.py`` (``harness.rows``): dp and fsdp on the MLP, dp on tiny-lm, and
issue #35's accumulation row (tiny-lm, S=4: the check over twice the bare reference steps)."""


def harness_row(name: str, steps: int, repeats: int, mlp_size=(512, 1024, 512, 256)) -> tuple[dict, tuple]:
    """``(row, (task, strategy))`` of one of :data:`ROWS` (4 shards)."""
    if name in ("dp", "fsdp"):
        task = mlp_task(*mlp_size, steps)
        return measure(task, name, 4, repeats), (task, name)
    from shardcheck.tasks import load_task

    lm = load_task("tiny-lm", optimizer="adam", steps=steps)
    if name == "tiny_lm":
        return measure(lm, "dp", 4, repeats), (lm, "dp")
    return measure_against_reference(lm, "accumulation", 4, repeats), (lm, "accumulation")


def main(argv=None) -> int:
    """Only the harness rows, quickly: ``python benchmarks/overhead.py --rows tiny_lm,tiny_lm_accumulation
    --profile --json OUT`` (8 fake CPU devices, the compilation cache off, as ``benchmarks/run.py``)."""
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=10, help="steps of every row (benchmarks/run.py: 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (best of)")
    p.add_argument("--profile", action="store_true", help="also one cProfile run of each row, printed")
    p.add_argument("--json", default=None, help="write the rows (and profiles) to this JSON file")
    args = p.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    out = {"loadavg_start": list(os.getloadavg()), "rows": {}, "profiles": {}}
    for name in args.rows.split(","):
        row, (task, strategy) = harness_row(name, args.steps, args.repeats)
        out["rows"][name] = row
        print(f"{name}: check {row['check_parity_s']:.3f} s / bare {row['bare_steps_s']:.3f} s = "
              f"{row['ratio']:.2f} (ok {row['ok']})", flush=True)  # fmt: skip
        if args.profile:
            prof = profile(task, strategy, 4, warm=True)
            out["profiles"][name] = {k: prof[k] for k in ("profiled_s", "cumulative_s")}
            print(prof["top"], flush=True)
    out["loadavg_end"] = list(os.getloadavg())
    print("load average", out["loadavg_start"][0], "->", out["loadavg_end"][0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
