"""``shardcheck record``: run a strategy (or your own step) on a task and save every step's per-leaf digests; and
the replay of such a recording that ``shardcheck verify --against`` runs."""

from __future__ import annotations

import sys

from shardcheck._catalog import COMPARED, DEFAULT_STRATEGY, REFERENCE, SUMMARIES
from shardcheck.cli._common import (
    MATMUL_PRECISIONS,
    HelpFormatter,
    add_mesh_argument,
    add_platform_argument,
    apply_mesh,
    configure_devices,
    console_for,
    device_choice,
    early_problem_of,
    library_to_flags,
    needed_mesh,
    write_json,
)
from shardcheck.cli._task import (
    add_precision_arguments,
    add_size_argument,
    add_task_arguments,
    precision_overrides,
    task_from_args,
)

DESCRIPTION = (
    "Run one strategy (--strategy) or your own step (--candidate) on a task for --steps steps, from a fresh state "
    "(a mesh strategy's created directly sharded), and save after every step the digest of every leaf: the loss, "
    "the gradients (when the step returns them), every parameter, every optimizer-state leaf and the counters. A "
    "digest is the leaf's shape, dtype and sharding, its L2 norm and max|x| (reduced on the devices), a "
    "parameter's update size, 8 elements at fixed indices and a sha256 of its shards: a few hundred bytes a "
    "leaf, small enough to commit. shardcheck verify --against FILE replays the run and names the first step "
    "and leaf that left the recording's tolerance (derived as verify's; never bitwise across machines). Exit "
    "status: 0 when recorded, 2 on bad input, a step that raises, or a run that goes non-finite (a NaN or an "
    "infinity in the loss, a gradient, a parameter or the optimizer state: nothing is written, the step and "
    "leaves are named; --steps N records the finite steps before it). A step whose loss and gradients alone are "
    "not finite, its parameters left exactly as they were, is one its optimizer skipped (optax.apply_if_finite, "
    "a loss-scale check): it is recorded, and a replay compares it by finiteness."
)
EPILOG = (
    "example: shardcheck record --task tiny-lm --mesh fsdp=4 --steps 3 --out run.npz, then "
    "shardcheck verify --task tiny-lm --against run.npz (the recorded mesh, steps and run are the defaults)"
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "record",
        help=SUMMARIES["record"],
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_task_arguments(p, optimizer_default_help="the optax optimizer (default: sgd; a built-in task's own)")
    add_size_argument(p, sharded_by="a mesh strategy (--strategy, default fsdp)")
    add_precision_arguments(p, harness=True)
    p.add_argument(
        "--strategy",
        default=None,
        choices=COMPARED,
        help=f"the registered strategy to record (default: {DEFAULT_STRATEGY}; not with --candidate)",
    )
    p.add_argument(
        "--candidate",
        default=None,
        metavar="MODULE:FUNC|PATH.py:FUNC",
        help="record your own in-place step (model, optimizer, batch[, mesh]) instead; return {'loss': loss, "
        "'grads': grads} to have the gradients recorded",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps recorded (default: a built-in task's 5; a task file's: all its batches)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="rows per batch of a built-in task (default: its own)"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="S: shards per step, and fake CPU devices to create (default: every device of a launched run, else 2)",
    )
    add_mesh_argument(p)
    add_platform_argument(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and the shuffling")
    p.add_argument(
        "--matmul-precision",
        default=None,
        choices=MATMUL_PRECISIONS,
        help="the precision of the run's float32 matmuls, stored in the recording (default: what the backend "
        "uses: tf32 on a GPU, bfloat16 on a TPU, float32 on a CPU; JAX's 'tensorfloat32' and 'highest' are "
        "tf32 and float32); verify --against compares within the looser of the recording's and the replay's",
    )
    p.add_argument("--out", required=True, metavar="PATH.npz", help="the recording to write")
    p.set_defaults(func=main, early_problem=_early_problem)


def _fail(message) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _both_given(args) -> str | None:
    """The refusal of ``--strategy`` beside ``--candidate``, or None."""
    if args.candidate is None or args.strategy is None:
        return None
    return (
        f"shardcheck record: --strategy {args.strategy} and --candidate {args.candidate} were both given; a "
        "recording holds one run: pass one of them"
    )


def _early_problem(args) -> str | None:
    """What is refused before JAX and the task file (:func:`shardcheck.cli._common.early_checks`), the two runs
    named at once first."""
    return _both_given(args) or early_problem_of("shardcheck record")(args)


def _check_args(args) -> tuple[str | None, int]:
    """The strategy (None with --candidate) and the device count, after the argument checks; fakes the CPU devices.

    Raises:
        ValueError: a bad flag value (the message names the flag and the fix).
    """
    from shardcheck import _validate, distributed

    apply_mesh("shardcheck record", args)
    from shardcheck.cli._common import positive_problem

    for flag in ("steps", "batch_size", "devices"):
        problem = positive_problem("shardcheck record", flag, getattr(args, flag))
        if problem is not None:
            raise ValueError(problem)
    _validate.check_seed("shardcheck record: --seed", args.seed)
    from shardcheck.cli._task import check_lr_flag

    check_lr_flag("shardcheck record", args)
    if _both_given(args):
        raise ValueError(_both_given(args))
    configure_devices(args.devices if args.devices is not None or distributed.is_multiprocess() else 2)
    import jax

    from shardcheck.parity.harness.recorded import check_out_path

    check_out_path("shardcheck record", args.out, f"--out {args.out}")
    devices = args.devices or (jax.device_count() if distributed.is_multiprocess() else 2)
    return (None if args.candidate else args.strategy or DEFAULT_STRATEGY), devices


def run_settings(args) -> dict:
    """What the command line knows of a run, for the recording's metadata: the optimizer and its learning rate
    (a built-in task's; a task file sets its own), the seed, the batch size, tiny-lm's size, the optimizer
    options and the precision, and the ``--candidate`` spec (a replay's hint names it)."""
    from shardcheck.optimizers import DEFAULT_LR
    from shardcheck.tasks import BUILTIN_TASKS
    from shardcheck.tasks.loading import DEFAULT_OPTIMIZER

    optimizer = lr = None
    if args.task is None or args.task in BUILTIN_TASKS:
        optimizer = args.optimizer or ("sgd" if args.task is None else DEFAULT_OPTIMIZER)
        lr = DEFAULT_LR[optimizer] if args.lr is None else float(args.lr)
    keys = (
        "seed",
        "batch_size",
        "weight_decay",
        "clip_norm",
        "warmup_steps",
        "schedule",
        "compute_dtype",
        "param_dtype",
        "size",
        "candidate",
    )
    return {"optimizer": optimizer, "lr": lr} | {k: getattr(args, k, None) for k in keys}


def _compute_override(args) -> str | None:
    """``--compute-dtype`` for a task file: the compute dtype the recording's tolerance assumes, in place of the
    one read from the file's model (its layers' ``dtype``, as verify reads it); a built-in task builds its model
    in it instead. ``--param-dtype`` with a task file is refused: the recording holds its parameters as they are.

    Raises:
        ValueError: ``--param-dtype`` given with a task file.
    """
    given = precision_overrides(args)
    if "param_dtype" in given:
        raise ValueError(
            f"shardcheck record: --param-dtype {given['param_dtype']} does not apply to a task file: its "
            "parameters are recorded in the dtype its model holds them; drop --param-dtype (the compute dtype is "
            "read from the model's layers, and --compute-dtype may name a less precise one)"
        )
    return given.get("compute_dtype")


def _load_step(args):
    from shardcheck.cli.verify import load_candidate

    try:
        return load_candidate(args.candidate)
    except ValueError as err:
        raise ValueError(str(err).replace("shardcheck verify:", "shardcheck record:", 1)) from None


def _step_name(args) -> str:
    """The recorded name of ``--candidate FILE.py:ATTR``: ``ATTR`` as the command line named it (the function's own
    ``__name__`` may be a factory's inner name)."""
    return args.candidate.rsplit(":", 1)[-1]


def main(args) -> int:
    from shardcheck import distributed

    try:
        strategy, devices = _check_args(args)
    except (TypeError, ValueError) as err:
        return _fail(err)
    from shardcheck import parity
    from shardcheck.mesh import data_shards
    from shardcheck.parity.harness.non_finite import first_non_finite, refusal
    from shardcheck.parity.harness.recorded import record_run
    from shardcheck.steps import STRATEGIES

    num_shards = devices if args.mesh is None else data_shards(args.mesh)
    try:
        task = task_from_args(args, default_optimizer="sgd", batch_size=args.batch_size, steps=args.steps)
        candidate = _load_step(args) if strategy is None else strategy
        mesh = needed_mesh(
            "shardcheck record", args, devices, strategy is None or STRATEGIES[strategy].uses_mesh
        )
        recording = record_run(
            task,
            candidate,
            steps=args.steps,
            num_shards=num_shards,
            mesh=mesh,
            settings=run_settings(args),
            matmul_precision=args.matmul_precision,
            name=_step_name(args) if strategy is None else None,
            compute_dtype=_compute_override(args),
        )
    except parity.CandidateError as err:
        return _fail(f"shardcheck record: {str(err).removeprefix('record_run: ')}")
    except (ValueError, TypeError) as err:
        return _fail(
            library_to_flags(str(err).replace("record_run:", "shardcheck record:", 1), "record", args=args)
        )
    diverged = first_non_finite(recording)
    if diverged is not None:  # no reference: refused as verify refuses a reference that diverges
        return _fail(refusal("shardcheck record", diverged, args.out))
    if distributed.is_main_process():
        size = recording.save(args.out)
        meta = recording.meta
        where = (
            ""
            if meta["mesh"] is None
            else " on mesh " + ",".join(f"{k}={v}" for k, v in meta["mesh"].items())
        )
        print(
            f"recorded {meta['run']} on task {meta['task']}{where} (S={meta['num_shards']}): {recording.num_steps} "
            f"step(s), {len(recording.names)} leaves a step, matmul precision {meta['matmul_precision']} -> "
            f"{args.out} ({size} bytes)"
        )
        print(device_choice(args).line())
    return 0


# ------------------------------------------------------------------------------------------ verify --against


def recorded_defaults(args):
    """``verify --against``: the recording (refused now when it is none), and the flags left out taken from it:
    its mesh (or shard count), its steps, and its run (its strategy; a user step needs ``--candidate``).

    Raises:
        ValueError: one line: a file that is no recording (:func:`~shardcheck.parity.harness.recorded.load_recording`),
            a recorded user step without ``--candidate``, ``--reference`` given.
    """
    from shardcheck.parity.harness.recorded import load_recording

    fn = "shardcheck verify"
    recording = load_recording(args.against, fn=fn, name=f"--against {args.against}")
    meta = recording.meta
    if args.reference != REFERENCE:
        raise ValueError(
            f"{fn}: --reference {args.reference} does not apply with --against: the replay is compared with the "
            "recording; drop --reference"
        )
    if args.mesh is None and args.devices is None:
        if meta["mesh"]:
            args.mesh = dict(meta["mesh"])
        else:
            args.devices = meta["num_shards"]
    if args.steps is None:
        args.steps = recording.num_steps
    if args.strategies is None:
        args.strategies = meta["run"] if meta["run_kind"] == "strategy" else "none"
    if args.strategies == "none" and args.candidate is None and meta["run_kind"] == "strategy":
        raise ValueError(
            f"{fn}: --strategies none and no --candidate leave nothing to replay; drop --strategies to replay the "
            f"recorded {meta['run']}, or pass --candidate FILE.py:step"
        )
    _check_recorded_task(fn, args, meta)
    if args.strategies == "none" and args.candidate is None:
        spec = meta.get("settings", {}).get("candidate") or f"FILE.py:{meta['run']}"
        raise ValueError(
            f"{fn}: --against {args.against} records the user step {meta['run']!r}; pass it with --candidate "
            f"{spec} (or another strategy with --strategies)"
        )
    if args.candidate is not None and args.task is None:
        raise ValueError(
            f"{fn}: --against replays --candidate on a task; pass --task (a built-in or FILE.py:task)"
        )
    return recording


def _check_recorded_task(fn: str, args, meta) -> None:
    """A built-in ``--task`` against a recording of another task: refused first, before any advice on what to
    replay (trial 40: ``--task tiny-lm --against`` a recording of a task file's step was told to pass
    ``--candidate``, and only then that it records another task)."""
    from shardcheck.tasks import BUILTIN_TASKS

    if args.task in BUILTIN_TASKS and meta.get("task") not in (None, args.task):
        raise ValueError(
            f"{fn}: --against {args.against} records another task (it records task {meta['task']!r}, this run's is "
            f"{args.task!r}); replay it with the task it records, or record this task"
        )


def verify_against(args, task, runs, num_shards: int, mesh, recording) -> int:
    """Replay each ``(label, strategy or step)`` of ``runs`` against ``recording``: ``check_parity(..., reference=
    recording)`` (:func:`~shardcheck.parity.harness.replay.check_against_recording`), whose report is diagnosed
    by the live check's rules and rendered by ``verify``'s renderer. Prints a table per run (process 0) and returns
    the exit status: 0 when all pass, 1 when one fails, 2 when the recording cannot be compared with this run
    (another task, mesh, steps, batches or state: one line) or went non-finite at a replayed step (its table
    reads NO VERDICT: as verify's exit status where the reference run diverges)."""
    from shardcheck import distributed
    from shardcheck.parity.harness.recorded import check_replayable
    from shardcheck.parity.harness.replay import check_against_recording

    settings = run_settings(args)
    where = dict(
        fn="shardcheck verify", mesh=mesh, num_shards=num_shards, steps=args.steps, settings=settings
    )
    try:
        check_replayable(recording, task, path=f"--against {args.against}", **where)
    except ValueError as err:
        return _fail(err)
    reports = {}
    for label, candidate in runs:
        reports[label] = check_against_recording(
            candidate,
            task,
            recording,
            rtol=args.rtol,
            atol=args.atol,
            name=_step_name(args) if label == "candidate" else None,
            matmul_precision=getattr(args, "matmul_precision", None),
            compute_dtype=precision_overrides(args).get("compute_dtype"),
            pin_placement=args.pin_placement,
            shown=f"--against {args.against}",
            accept_weak=args.accept_weak,
            **where,
        )
    ok = all(r.ok for r in reports.values())
    if distributed.is_main_process():
        _print(args, task, reports, recording, ok)
    if any(r.reference_diverged_at is not None for r in reports.values()):
        return 2
    return 0 if ok else 1


def _print(args, task, reports, recording, ok: bool) -> None:
    meta = recording.meta
    from shardcheck.cli.verify import render_report

    console = console_for(args)
    mesh = "" if not meta["mesh"] else " on mesh " + ",".join(f"{k}={v}" for k, v in meta["mesh"].items())
    setup = (
        f"task {task.name}, {meta['steps']} recorded step(s) of {meta['run']}{mesh}, S={meta['num_shards']}"
    )
    for report in reports.values():
        console.print(render_report(report, setup, against=args.against))
    console.print(device_choice(args).line(), highlight=False)
    document = {
        "command": "verify",
        "against": args.against,
        "ok": ok,
        "task": task.name,
        "recorded": {
            k: meta.get(k)
            for k in ("run", "run_kind", "steps", "mesh", "num_shards", "settings", "versions", "platform")
        },
        # each run as a live check's entry (ParityReport.to_dict: the diagnosis of its records by the live
        # check's rules), with its digest comparison's own fields beside
        "strategies": {label: r.to_dict() for label, r in reports.items()},
        "devices": device_choice(args).to_dict(),
    }
    # as verify's document (a keyword: the command line holds no strategy name as a string literal)
    document.update(reference=next(iter(reports.values())).reference if reports else None)
    write_json(document, args.json)
