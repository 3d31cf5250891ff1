"""``shardcheck train``: a real training run, sharded beside its single-device baseline, watched step by step.

Without ``--task`` it trains the regression task of ``--dataset`` (:func:`shardcheck.seeds.training.train`: test
split, standardization, shuffled mini-batches, epoch-end evaluation); with ``--task`` it trains the task's batches
(:func:`shardcheck.training.train_task`). The strategies are the registry's (``shardcheck.steps.STRATEGIES``).
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from shardcheck._catalog import COMPARED as TRAIN_STRATEGIES
from shardcheck._catalog import DEFAULT_STRATEGY, PLACEMENT_WORDS
from shardcheck.cli._common import (
    TRAIN_FLAGS,
    HelpFormatter,
    add_mesh_argument,
    add_platform_argument,
    apply_mesh,
    configure_devices,
    console_for,
    device_choice,
    library_to_flags,
    write_atomic,
    write_json,
)
from shardcheck.cli._task import add_precision_arguments, add_task_arguments, task_from_args

# max_abs_param_diff is over every element; the verdict reads max_abs_held_diff (the elements held to the
# tolerance, all but those whose gradient was at rounding level) against drift_tolerance (trial 57: the CSV alone
# read as drift 6 times its tolerance where the table said "never exceeded")
LOG_COLUMNS = (
    "step",
    "epoch",
    "loss_baseline",
    "loss_sharded",
    "max_abs_param_diff",
    "max_abs_held_diff",
    "drift_tolerance",
    "drift_exceeded",
)
# Without --task: the regression run's defaults (the flags default to None so that --task can tell them apart).
DATASET_DEFAULTS = {"optimizer": "adam", "batch_size": 64, "test_fraction": 0.2}
# Flags that shape the rows of --dataset, which a task does not have.
DATASET_ONLY = (("--target", "target"), ("--features", "features"), ("--test-fraction", "test_fraction"))


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a sharded strategy beside the single-device baseline on real data and watch them drift",
        description=(
            "Load a data set (default: scikit-learn's bundled diabetes data), hold out a test split, standardize "
            "features and targets with the training statistics, and train the chosen strategy and the "
            "single-device baseline in lock-step from identical initial parameters on the same shuffled "
            "mini-batches (the last incomplete batch of each epoch is dropped). With --task, train a task's own "
            "model, optimizer, loss and batches instead (--epochs passes over its batches). A progress bar shows "
            "epoch, loss and the current parameter drift; the end table gives the final losses of both runs, the "
            "largest drift and the first step at which it exceeded its tolerance."
        ),
        epilog="examples: shardcheck train --strategy fsdp --devices 4 --optimizer adam --epochs 30 "
        "--batch-size 64 --plot loss.png; shardcheck train --task tiny-lm --strategy dp --devices 4 --epochs 2",
        formatter_class=HelpFormatter,
    )
    add_task_arguments(p, optimizer_default_help="optax optimizer of both runs (default: adam; a task's own)")
    add_precision_arguments(p, harness=False)
    _add_run_arguments(p)
    p.add_argument("--plot", default=None, metavar="PATH.png", help="write loss curves and drift as a PNG")
    p.add_argument("--log", default=None, metavar="PATH.csv", help="write one CSV row per step")
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the results as JSON ('-': stdout)"
    )
    p.set_defaults(func=main)


def _add_run_arguments(p) -> None:
    """The options of the run itself: strategy, shard count, epochs, batches, split and seed."""
    p.add_argument(
        "--features",
        default=None,
        help="without --task: feature columns, comma-separated (default: every non-target column)",
    )
    p.add_argument(
        "--strategy",
        default=DEFAULT_STRATEGY,
        choices=TRAIN_STRATEGIES,
        help="the registered strategy trained",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="the shard count S: mesh devices for dp/fsdp (fake CPU devices are created, beside any accelerator, "
        "and used when it has too few), shards or micro-batches otherwise (default: 4 on a mesh, or every device under "
        "'shardcheck launch'; 2 otherwise)",
    )
    add_mesh_argument(p)
    add_platform_argument(p)
    p.add_argument(
        "--epochs", type=int, default=30, help="passes over the training split (--task: its batches)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="mini-batch size B, a multiple of the shard count (default: 64; a built-in task's own)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="with --task: batches per epoch (a built-in task draws N, default 5; a task file's first N)",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=None,
        help="without --task: share of rows held out for testing (default: 0.2)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the split, the shuffles and the initial parameters"
    )


def _fail(message: str) -> int:
    from rich.console import Console
    from rich.markup import escape

    Console(file=sys.stderr, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return 2


def _check_args(args) -> str | None:
    """The first problem with the options that needs no data, as a message; None when there is none."""
    fn = "shardcheck train"
    for flag, value, low in (
        ("--devices", args.devices, 1),
        ("--hidden", args.hidden, 1),
        ("--epochs", args.epochs, 1),
        ("--batch-size", args.batch_size, 1),
        ("--steps", args.steps, 1),
        ("--seed", args.seed, 0),
    ):
        if value is not None and value < low:
            return f"{fn}: {flag} must be an int >= {low}, got {value}"
    if args.lr is not None and not (args.lr > 0 and args.lr != float("inf")):
        return f"{fn}: --lr must be a finite positive number, got {args.lr}; for example --lr 0.01"
    if args.test_fraction is not None and not 0 < args.test_fraction < 1:
        return f"{fn}: --test-fraction must be in (0, 1), got {args.test_fraction}; for example --test-fraction 0.2"
    for flag, value, suffix in (("--plot", args.plot, ".png"), ("--log", args.log, ".csv")):
        if value is not None and Path(value).suffix.lower() != suffix:
            return f"{fn}: {flag} {value!r} must end in {suffix}; for example {flag} run{suffix}"
    if args.task is None and args.steps is not None:
        return f"{fn}: --steps applies with --task only; without it a run takes --epochs x (training rows // B) steps"
    tuned = _optimizer_flags(args)
    # trial 57: without --task they were ignored, the run the plain optimizer's
    if args.task is None and tuned:
        return (
            f"{fn}: {tuned[0]} applies with --task only (it configures the task's optimizer); without --task, train "
            "runs the seeds' regression step with --optimizer and --lr alone: pass --task diabetes (or linnerud, "
            f"the built-in data sets as tasks) with {tuned[0]}, or drop it"
        )
    given = [flag for flag, dest in DATASET_ONLY if getattr(args, dest) is not None]
    if args.task is not None and given:
        return f"{fn}: {given[0]} applies without --task only (to the rows of --dataset); --task {args.task} brings its own batches"
    return None


def _optimizer_flags(args) -> list[str]:
    """The optimizer flags given (``--weight-decay``, ``--clip-norm``, ``--warmup-steps``, ``--schedule``), as
    written on the command line."""
    from shardcheck.cli._task import _optimizer_options

    return ["--" + k.replace("_", "-") for k in _optimizer_options(args)]


def _num_shards(args) -> int:
    from shardcheck import distributed
    from shardcheck.steps import STRATEGIES
    from shardcheck.training import DEFAULT_NUM_SHARDS

    if args.devices is not None:
        return args.devices
    if STRATEGIES[args.strategy].uses_mesh and distributed.is_multiprocess():
        import jax  # shardcheck launch / a cluster: the mesh spans every process

        return jax.device_count()
    return DEFAULT_NUM_SHARDS[args.strategy]


def main(args) -> int:
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    from shardcheck.steps import STRATEGIES

    try:
        apply_mesh("shardcheck train", args)
    except ValueError as err:
        return _fail(str(err))
    num_shards = _num_shards(args)
    try:
        if STRATEGIES[args.strategy].uses_mesh:
            configure_devices(num_shards)
    except ValueError as err:
        return _fail(f"shardcheck train: {err}")
    from shardcheck.cli._common import select_for

    try:  # the mesh's devices (or the one device of a strategy without one), named in the report
        select_for("shardcheck train", args, num_shards if STRATEGIES[args.strategy].uses_mesh else 1)
    except ValueError as err:
        return _fail(str(err))
    return (_main_task if args.task is not None else _main_dataset)(args, num_shards)


def _main_dataset(args, num_shards: int) -> int:
    """``shardcheck train`` without ``--task``: :func:`shardcheck.seeds.training.train` on ``--dataset``."""
    from shardcheck import datasets
    from shardcheck.seeds.training import select_features, train

    try:
        data = datasets.load_dataset(args.dataset, target=args.target, standardize_data=False)
        data = select_features(data, args.features)
    except ValueError as err:
        return _fail(str(err))

    def run(callback):
        return train(
            data.x,
            data.y,
            strategy=args.strategy,
            num_shards=num_shards,
            model=args.model,
            hidden=args.hidden,
            optimizer=args.optimizer or DATASET_DEFAULTS["optimizer"],
            lr=args.lr,
            epochs=args.epochs,
            batch_size=DATASET_DEFAULTS["batch_size"] if args.batch_size is None else args.batch_size,
            test_fraction=DATASET_DEFAULTS["test_fraction"]
            if args.test_fraction is None
            else args.test_fraction,
            seed=args.seed,
            name=data.name,
            callback=callback,
        )

    return _run_and_report(args, run, render_table, _plot_dataset, report_json)


def _main_task(args, num_shards: int) -> int:
    """``shardcheck train --task``: :func:`shardcheck.training.train_task` on the task's batches."""
    from shardcheck.tasks import BUILTIN_TASKS
    from shardcheck.training import train_task

    builtin = args.task in BUILTIN_TASKS
    try:
        task = task_from_args(args, default_optimizer="adam", batch_size=args.batch_size, steps=args.steps)
        if args.steps is not None and not builtin:
            task = _first_batches(task, args.steps)
    except (ValueError, TypeError) as err:
        return _fail(str(err))

    def run(callback):
        from shardcheck.cli._common import mesh_from_args
        from shardcheck.mesh import data_shards
        from shardcheck.steps import STRATEGIES

        mesh = mesh_from_args(args, num_shards) if STRATEGIES[args.strategy].uses_mesh else None
        # --mesh sets num_shards to its devices; a mesh with model axes (data=2,expert=4) splits the batch over
        # its data axes only, so S is theirs (as verify and record count it)
        shards = num_shards if mesh is None else data_shards(mesh)
        return train_task(
            task, args.strategy, num_shards=shards, mesh=mesh, epochs=args.epochs, callback=callback
        )

    return _run_and_report(args, run, render_task_table, plot_task_training, task_report_json)


def _first_batches(task, steps: int):
    """The task with its first ``steps`` batches (``--steps`` with a task file)."""
    import dataclasses

    if steps > len(task.batches):
        raise ValueError(
            f"shardcheck train: --steps {steps} but task {task.name!r} holds only {len(task.batches)} batch(es); "
            f"pass --steps {len(task.batches)} or fewer"
        )
    return dataclasses.replace(task, batches=list(task.batches[:steps]))


def _diverged(args, step: int) -> str:
    """The message of a run whose baseline went non-finite at ``step`` (1-based): its settings and the fix."""
    from shardcheck.cli._common import lr_setting

    name = args.optimizer or (DATASET_DEFAULTS["optimizer"] if args.task is None else None)
    setting, default = lr_setting(args, name, args.task)
    return (
        f"shardcheck train: the single-device baseline diverged (a non-finite loss or parameters at step {step}) "
        f"{setting}; no verdict about the sharded run, and nothing written; lower --lr{default}"
    )


def _run_and_report(args, run, table, plot, to_json) -> int:
    """``run(callback)`` under a progress bar, then (process 0 only) the table, ``--plot``, ``--log``, ``--json``."""
    from shardcheck.distributed import is_main_process

    main_process = is_main_process()
    console = console_for(args)
    progress = _progress(console) if main_process else None
    try:
        report = run(None if progress is None else _updater(progress))
    except (ValueError, TypeError) as err:  # in the command line's terms: --devices (or --mesh), --batch-size
        return _fail(
            library_to_flags(str(err), "train", TRAIN_FLAGS, functions=("train", "train_task"), args=args)
        )
    finally:
        if progress is not None and progress.live.is_started:
            progress.stop()
    if report.baseline_diverged_at is not None:  # no verdict; nothing written (as verify's reference run)
        return _fail(_diverged(args, report.baseline_diverged_at))
    if not main_process:
        return 0
    console.print(table(report))
    console.print(device_choice(args).line(), highlight=False)
    if args.plot is not None:
        plot(report, args.plot)
        console.print(f"plot: {args.plot}", highlight=False)
    if args.log is not None:
        write_atomic(Path(args.log), log_csv(report).encode())
        console.print(f"log: {args.log} ({report.num_steps} steps)", highlight=False)
    write_json(to_json(report) | {"devices": device_choice(args).to_dict()}, args.json)
    return 0


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("epoch {task.fields[epoch]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("max|Δparam| {task.fields[drift]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _updater(progress):
    """The training loop's callback that starts ``progress`` at the first step and advances it."""
    task = None

    def update(event) -> None:
        nonlocal task
        s = event.step
        fields = {
            "epoch": f"{s.epoch}/{event.epochs}",
            "loss": f"{s.loss_baseline:.4g} / {s.loss_sharded:.4g}",
            "drift": f"{s.held_param_diff:.2g}",
        }
        if task is None:  # the bar starts with the first step: a refusal before it leaves no empty bar behind
            progress.start()
            task = progress.add_task("train", total=event.total_steps, **fields)
        progress.update(task, completed=s.step, **fields)

    return update


# ---------------------------------------------------------------------------------------------- the outputs


def log_csv(report) -> str:
    """The ``--log`` CSV: a header and one row per step (floats written with 9 significant digits)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(LOG_COLUMNS)
    for s in report.steps:
        w.writerow(
            [
                s.step,
                s.epoch,
                f"{s.loss_baseline:.9g}",
                f"{s.loss_sharded:.9g}",
                f"{s.max_abs_param_diff:.9g}",
                f"{s.held_param_diff:.9g}",
                f"{s.drift_tolerance:.9g}",
                int(s.drift_exceeded),
            ]
        )
    return buf.getvalue()


def _losses(r) -> dict:
    return {
        "train_loss_baseline": r.train_loss_baseline,
        "train_loss_sharded": r.train_loss_sharded,
        "test_loss_baseline": r.test_loss_baseline,
        "test_loss_sharded": r.test_loss_sharded,
    }


def report_json(report) -> dict:
    """The ``--json`` object of ``shardcheck train`` without ``--task``."""
    return {
        "dataset": report.dataset,
        "strategy": report.strategy,
        "num_shards": report.num_shards,
        "model": report.model,
        "hidden": report.hidden,
        "optimizer": report.optimizer,
        "lr": report.lr,
        "epochs": report.epochs,
        "batch_size": report.batch_size,
        "test_fraction": report.test_fraction,
        "seed": report.seed,
        "num_train": report.num_train,
        "num_test": report.num_test,
        "in_features": report.in_features,
        "out_features": report.out_features,
        "steps_per_epoch": report.steps_per_epoch,
        "dropped_per_epoch": report.dropped_per_epoch,
        "num_steps": report.num_steps,
        "tolerance_rule": report.tolerance_rule,
        "loss_curves_agree": report.loss_curves_agree,
        "first_exceeded_step": report.first_exceeded_step,
        "wall_s": report.wall_s,
        "initial": _losses(report.initial),
        "final": {**_losses(report.final), "max_abs_param_diff": report.max_abs_param_diff},
        "history": [{"epoch": r.epoch, "step": r.step, **_losses(r)} for r in report.epoch_records],
    }


def _step_json(s) -> dict:
    return {
        "step": s.step,
        "epoch": s.epoch,
        "loss_baseline": s.loss_baseline,
        "loss_sharded": s.loss_sharded,
        "max_abs_param_diff": s.max_abs_param_diff,
        "loss_tolerance": s.loss_tolerance,
        "drift_tolerance": s.drift_tolerance,
        "drift_exceeded": s.drift_exceeded,
        "max_abs_held_diff": s.max_abs_held_diff,
        "rounding_level_elements": s.rounding_level_elements,
    }


def task_report_json(report) -> dict:
    """The ``--json`` object of ``shardcheck train --task``."""
    first, last = report.first_step, report.last_step
    return {
        "task": report.task,
        "strategy": report.strategy,
        "num_shards": report.num_shards,
        "placement": report.placement,
        "epochs": report.epochs,
        "steps_per_epoch": report.steps_per_epoch,
        "batch_size": report.batch_size,
        "num_steps": report.num_steps,
        "tolerance_rule": report.tolerance_rule,
        "loss_curves_agree": report.loss_curves_agree,
        "first_exceeded_step": report.first_exceeded_step,
        "wall_s": report.wall_s,
        "initial": {"loss_baseline": first.loss_baseline, "loss_sharded": first.loss_sharded},
        "final": {
            "loss_baseline": last.loss_baseline,
            "loss_sharded": last.loss_sharded,
            "max_abs_param_diff": report.max_abs_param_diff,
        },
        "steps": [_step_json(s) for s in report.steps],
    }


def _drift_line(report) -> str:
    """The summary's drift: the largest over the run, of the elements held to the tolerance where some were left
    out (their gradient at rounding level: :attr:`shardcheck.training.TrainStep.rounding_level_elements`)."""
    last = report.steps[-1]
    left_out = last.rounding_level_elements
    if not left_out:
        return (
            f"max |params_sharded - params_baseline| = {report.max_abs_param_diff:.3g} over the run "
            f"(tolerance at the last step {last.drift_tolerance:.3g})"
        )
    held = max(s.held_param_diff for s in report.steps)
    return (
        f"max |params_sharded - params_baseline| = {held:.3g} over the run (tolerance at the last step "
        f"{last.drift_tolerance:.3g}) in the elements held to it: all but {left_out:,} whose gradient was at "
        "rounding level (a true gradient of 0, e.g. the weight of an input that is always 0, a bias before a "
        "BatchNorm, an attention key bias), which a normalizing optimizer moves on rounding noise and which do not "
        f"change the loss; over every element: {report.max_abs_param_diff:.3g}"
    )


def _summary(report, rows):
    """The grid under a table: ``rows``, then the drift, tolerance and timing lines both reports share."""
    from rich.table import Table

    first = report.first_exceeded_step
    agree = sum(s.loss_agrees for s in report.steps)
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    for row in rows:
        summary.add_row(*row)
    summary.add_row("max drift", _drift_line(report))
    summary.add_row(
        "first exceeded", "never" if first is None else f"drift exceeded tolerance first at step {first}"
    )
    summary.add_row(
        "loss curves",
        f"agree within tolerance at {agree}/{report.num_steps} steps"
        + ("" if agree == report.num_steps else " (!)"),
    )
    summary.add_row("tolerance", report.tolerance_rule)
    summary.add_row("time", f"{report.wall_s:.1f} s (both runs, compilation included)")
    return summary


def render_table(report):
    """The end-of-run summary: final losses of both runs, then drift, tolerance and timing."""
    from rich.console import Group
    from rich.table import Table

    table = Table(
        title=(
            f"shardcheck train: {report.dataset}, {report.model}, {report.strategy} S={report.num_shards} vs "
            f"baseline, {report.optimizer} lr={report.lr:g}"
        ),
        title_justify="left",
    )
    table.add_column("run")
    for column in ("train loss (init)", "train loss (final)", "test loss (init)", "test loss (final)"):
        table.add_column(column, justify="right")
    i, f = report.initial, report.final
    for label, which in (
        ("baseline (1 device)", "baseline"),
        (f"{report.strategy} (S={report.num_shards})", "sharded"),
    ):
        table.add_row(
            label,
            *(
                f"{getattr(r, f'{split}_loss_{which}'):.6g}"
                for split, r in (("train", i), ("train", f), ("test", i), ("test", f))
            ),
        )
    data = (
        f"{report.num_train} train / {report.num_test} test rows, {report.in_features} -> "
        f"{report.out_features}; B={report.batch_size}, {report.epochs} epochs x {report.steps_per_epoch} steps = "
        f"{report.num_steps} steps ({report.dropped_per_epoch} rows dropped per epoch)"
    )
    return Group(table, _summary(report, [("data", data)]))


def render_task_table(report):
    """The end-of-run summary of ``--task``: both runs' first and final batch losses, then drift and timing."""
    from rich.console import Group
    from rich.table import Table

    table = Table(
        title=f"shardcheck train --task {report.task}: {report.strategy} S={report.num_shards} vs baseline",
        title_justify="left",
    )
    table.add_column("run")
    table.add_column("loss (first step)", justify="right")
    table.add_column("loss (final step)", justify="right")
    first, last = report.first_step, report.last_step
    table.add_row("baseline (1 device)", f"{first.loss_baseline:.6g}", f"{last.loss_baseline:.6g}")
    table.add_row(
        f"{report.strategy} (S={report.num_shards})", f"{first.loss_sharded:.6g}", f"{last.loss_sharded:.6g}"
    )
    steps = (
        f"B={report.batch_size}, {report.epochs} epochs x {report.steps_per_epoch} batches = {report.num_steps} "
        f"steps; state placement: {PLACEMENT_WORDS.get(report.placement, report.placement)} (losses measured before "
        "each step's update)"
    )
    return Group(table, _summary(report, [("steps", steps)]))


def _plot_dataset(report, path) -> None:
    from shardcheck.plots import plot_training

    plot_training(report, path)


def plot_task_training(report, path) -> Path:
    """The ``--plot`` of ``--task``: both runs' batch losses per step (left), the drift per step (right, log).

    Same size and conventions as :func:`shardcheck.plots.plot_training` (1300 x 500 pixels; drift values below
    ``DRIFT_FLOOR`` drawn at it; the file written whole through a temporary file).
    """
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from shardcheck.plots import DPI, DRIFT_FLOOR, FIGSIZE_IN

    steps = np.array([s.step for s in report.steps])
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    ax_loss, ax_drift = fig.subplots(1, 2)
    label = f"{report.strategy} (S={report.num_shards})"
    xlabel = f"step ({report.steps_per_epoch} batches per epoch)"
    ax_loss.plot(steps, [s.loss_baseline for s in report.steps], color="0.55", lw=1.2, label="baseline")
    ax_loss.plot(steps, [s.loss_sharded for s in report.steps], color="0.2", lw=1.0, ls="--", label=label)
    ax_loss.set(
        xlabel=xlabel, ylabel="batch loss (before the step's update)", title="Loss: curves should overlap"
    )
    drift = np.array([s.held_param_diff for s in report.steps])  # of the elements held to the tolerance
    ax_drift.plot(steps, np.maximum(drift, DRIFT_FLOOR), color="tab:purple", lw=1.2, label="max |Δparam|")
    tolerance = [s.drift_tolerance for s in report.steps]
    ax_drift.plot(steps, tolerance, color="tab:green", ls=":", lw=1.5, label="widest element tolerance")
    if report.first_exceeded_step is not None:
        ax_drift.axvline(report.first_exceeded_step, color="tab:red", lw=1.0, label="first exceeded")
    ax_drift.set_yscale("log")
    ax_drift.set(
        xlabel=xlabel, ylabel=f"max |params_sharded - params_baseline| (< {DRIFT_FLOOR:g} drawn at it)"
    )
    ax_drift.set_title(f"Parameter drift per step (max {max(drift):.3g})")
    for ax in (ax_loss, ax_drift):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"shardcheck train --task {report.task}: {label} vs single-device baseline, B={report.batch_size}"
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    write_atomic(Path(path), buf.getvalue())
    return Path(path)
