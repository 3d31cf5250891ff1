"""``shardcheck train``: a real training run, sharded beside its single-device baseline, watched step by step."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from shardcheck.cli._common import HelpFormatter, configure_devices, console_for, write_atomic, write_json

STRATEGY_CHOICES = ("simulation", "dp", "fsdp")
MODEL_CHOICES = ("linear", "mlp")
OPTIMIZER_CHOICES = ("sgd", "momentum", "adam")
LOG_COLUMNS = ("step", "epoch", "loss_baseline", "loss_sharded", "max_abs_param_diff")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a sharded strategy beside the single-device baseline on real data and watch them drift",
        description=(
            "Load a data set (default: scikit-learn's bundled diabetes data), hold out a test split, standardize "
            "features and targets with the training statistics, and train the chosen strategy and the "
            "single-device baseline in lock-step from identical initial parameters on the same shuffled "
            "mini-batches (the last incomplete batch of each epoch is dropped). A progress bar shows epoch, loss "
            "and the current parameter drift; the end table gives the final train/test losses of both runs, the "
            "largest drift and the first step at which it exceeded its tolerance."
        ),
        epilog="example: shardcheck train --strategy fsdp --devices 4 --optimizer adam --epochs 30 "
        "--batch-size 64 --plot loss.png",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--dataset", default="diabetes", help="diabetes | linnerud | PATH.csv | PATH.npz")
    p.add_argument(
        "--target", default=None, help="CSV target column(s), comma-separated (default: last column)"
    )
    p.add_argument(
        "--features", default=None, help="feature columns, comma-separated (default: every non-target column)"
    )
    p.add_argument("--model", default="linear", choices=MODEL_CHOICES, help="the model trained by both runs")
    p.add_argument("--hidden", type=int, default=32, help="hidden width H of --model mlp")
    p.add_argument("--strategy", default="fsdp", choices=STRATEGY_CHOICES, help="the sharded run")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="the shard count S: mesh devices for dp/fsdp (fake CPU devices are created when no accelerator is "
        "present), simulated shards for simulation (default: 4 for dp/fsdp, or every device under "
        "'shardcheck launch'; 2 for simulation)",
    )
    p.add_argument(
        "--optimizer", default="adam", choices=OPTIMIZER_CHOICES, help="optax optimizer of both runs"
    )
    p.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: sgd 0.1, momentum 0.05, adam 0.01)"
    )
    p.add_argument("--epochs", type=int, default=30, help="passes over the training split")
    p.add_argument(
        "--batch-size", type=int, default=64, help="mini-batch size B, a multiple of the shard count"
    )
    p.add_argument("--test-fraction", type=float, default=0.2, help="share of rows held out for testing")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the split, the shuffles and the initial parameters"
    )
    p.add_argument("--plot", default=None, metavar="PATH.png", help="write loss curves and drift as a PNG")
    p.add_argument("--log", default=None, metavar="PATH.csv", help="write one CSV row per step")
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the results as JSON ('-': stdout)"
    )
    p.set_defaults(func=main)


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
        ("--seed", args.seed, 0),
    ):
        if value is not None and value < low:
            return f"{fn}: {flag} must be an int >= {low}, got {value}"
    if args.lr is not None and not (args.lr > 0 and args.lr != float("inf")):
        return f"{fn}: --lr must be a finite positive number, got {args.lr}; for example --lr 0.01"
    if not 0 < args.test_fraction < 1:
        return f"{fn}: --test-fraction must be in (0, 1), got {args.test_fraction}; for example --test-fraction 0.2"
    for flag, value, suffix in (("--plot", args.plot, ".png"), ("--log", args.log, ".csv")):
        if value is not None and Path(value).suffix.lower() != suffix:
            return f"{fn}: {flag} {value!r} must end in {suffix}; for example {flag} run{suffix}"
    return None


def _num_shards(args) -> int:
    from shardcheck import distributed

    if args.devices is not None:
        return args.devices
    if args.strategy == "simulation":
        return 2
    if distributed.is_multiprocess():  # shardcheck launch / a cluster: the mesh spans every process
        import jax

        return jax.device_count()
    return 4


def main(args) -> int:
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    num_shards = _num_shards(args)
    try:
        if args.strategy != "simulation":
            configure_devices(num_shards)
    except ValueError as err:
        return _fail(f"shardcheck train: {err}")

    from shardcheck import datasets
    from shardcheck.distributed import is_main_process
    from shardcheck.training import select_features, train

    main_process = is_main_process()
    try:
        data = datasets.load_dataset(args.dataset, target=args.target, standardize_data=False)
        data = select_features(data, args.features)
    except ValueError as err:
        return _fail(str(err))

    console = console_for(args)
    progress = _progress(console) if main_process else None
    try:
        if progress is None:
            report = _train(train, data, args, num_shards, None)
        else:
            with progress:
                report = _train(train, data, args, num_shards, _updater(progress))
    except (ValueError, TypeError) as err:
        return _fail(str(err))
    if not main_process:
        return 0

    console.print(render_table(report))
    if args.plot is not None:
        from shardcheck.plots import plot_training

        plot_training(report, args.plot)
        console.print(f"plot: {args.plot}", highlight=False)
    if args.log is not None:
        write_atomic(Path(args.log), log_csv(report).encode())
        console.print(f"log: {args.log} ({report.num_steps} steps)", highlight=False)
    write_json(report_json(report), args.json)
    return 0


def _train(train, data, args, num_shards: int, callback):
    return train(
        data.x,
        data.y,
        strategy=args.strategy,
        num_shards=num_shards,
        model=args.model,
        hidden=args.hidden,
        optimizer=args.optimizer,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        test_fraction=args.test_fraction,
        seed=args.seed,
        name=data.name,
        callback=callback,
    )


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
    """The :func:`shardcheck.training.train` callback that advances ``progress``."""
    task = None

    def update(event) -> None:
        nonlocal task
        s = event.step
        fields = {
            "epoch": f"{s.epoch}/{event.epochs}",
            "loss": f"{s.loss_baseline:.4g} / {s.loss_sharded:.4g}",
            "drift": f"{s.max_abs_param_diff:.2g}",
        }
        if task is None:
            task = progress.add_task("train", total=event.total_steps, **fields)
        progress.update(task, completed=s.step, **fields)

    return update


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
    """The ``--json`` object of ``shardcheck train``."""
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


def render_table(report):
    """The end-of-run summary: final losses of both runs, then drift, tolerance and timing."""
    from rich.console import Group
    from rich.table import Table

    first = report.first_exceeded_step
    last = report.steps[-1]
    table = Table(
        title=(
            f"shardcheck train: {report.dataset}, {report.model}, {report.strategy} S={report.num_shards} vs "
            f"baseline, {report.optimizer} lr={report.lr:g}"
        ),
        title_justify="left",
    )
    table.add_column("run")
    table.add_column("train loss (init)", justify="right")
    table.add_column("train loss (final)", justify="right")
    table.add_column("test loss (init)", justify="right")
    table.add_column("test loss (final)", justify="right")
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
    agree = sum(s.loss_agrees for s in report.steps)
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row(
        "data",
        f"{report.num_train} train / {report.num_test} test rows, {report.in_features} -> "
        f"{report.out_features}; B={report.batch_size}, {report.epochs} epochs x {report.steps_per_epoch} steps = "
        f"{report.num_steps} steps ({report.dropped_per_epoch} rows dropped per epoch)",
    )
    summary.add_row(
        "max drift",
        f"max |params_sharded - params_baseline| = {report.max_abs_param_diff:.3g} over the run "
        f"(tolerance at the last step {last.drift_tolerance:.3g})",
    )
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
    return Group(table, summary)
