"""``shardcheck run``: the main job. Both seed computations and the mesh steps on a real data set, side by side.

With ``--task``, one step of every registered strategy (:data:`shardcheck.steps.STRATEGIES`) on the task's first
batch, compared with the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from shardcheck._catalog import BASELINE, OPTIMIZERS, REFERENCE
from shardcheck._catalog import STRATEGY_SPECS as STRATEGIES  # names and uses_mesh: no JAX for --help
from shardcheck._catalog import seed_form as xy_strategies
from shardcheck.cli._common import (
    HelpFormatter,
    add_mesh_argument,
    add_platform_argument,
    apply_mesh,
    configure_devices,
    console_for,
    device_choice,
    write_json,
)
from shardcheck.cli._task import add_precision_arguments, check_lr_flag

STRATEGY_CHOICES = ("all", BASELINE, *STRATEGIES)
TASK_HELP = (
    "run one step of every registered strategy on this task's first batch instead: a built-in (diabetes, "
    "linnerud, digits, tiny-lm), FILE.py:ATTR or MODULE:ATTR (a shardcheck.Task or a zero-argument function "
    "returning one)"
)


DESCRIPTION = (
    "Load a data set (default: scikit-learn's bundled diabetes data, standardized), build one nnx.Linear, "
    "and run one SGD step of the single-device baseline (seed 001), the gradient-reduction simulation "
    "(seed 000), and the data-parallel and FSDP steps on a device mesh, all from the same initial "
    "parameters. Prints losses, gradient and parameter differences against the baseline, and the "
    "parameter storage per shard. With --task, one step of every registered strategy "
    f"({', '.join(STRATEGIES)}) on the task's first batch from one fresh model, each compared with the "
    "reference leaf by leaf."
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="one SGD step of each computation on a real data set, compared with the baseline",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--task", default=None, metavar="NAME|FILE.py:ATTR|MODULE:ATTR", help=TASK_HELP)
    add_precision_arguments(p, harness=False)
    p.add_argument("--dataset", default="diabetes", help="diabetes | linnerud | PATH.csv | PATH.npz")
    p.add_argument(
        "--target", default=None, help="CSV target column(s), comma-separated (default: last column)"
    )
    p.add_argument(
        "--strategy",
        default="all",
        choices=STRATEGY_CHOICES,
        help=f"which computation(s) to run: {', '.join(xy_strategies())} without --task; a registered strategy "
        "with it (the reference always runs) (default: all)",
    )
    p.add_argument(
        "--shards", type=int, default=None, help="number of shards S (default: --devices if given, else 2)"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices to create (beside any accelerator; used when it has too few devices for the "
        "mesh, or with --platform cpu) (default: the shard count)",
    )
    add_mesh_argument(p)
    add_platform_argument(p)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="SGD learning rate (default: 0.1; with a built-in --task: its optimizer's learning rate)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters")
    p.add_argument(
        "--optimizer",
        default=None,
        choices=OPTIMIZERS,
        help="with a built-in --task: its optimizer (default: the task's)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="with a built-in --task: rows B of its batch (default: the task's)",
    )
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the results as JSON ('-': stdout)"
    )
    p.set_defaults(func=main)


def _fail(console, message: str) -> int:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return 2


def main(args) -> int:
    from rich.console import Console

    err = Console(file=sys.stderr)
    for flag in ("shards", "devices", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return _fail(
                err, f"shardcheck run: --{flag.replace('_', '-')} must be a positive int, got {value}"
            )
    if args.task is not None:
        return main_task(args, err)
    try:
        strategies, on_mesh = _seed_form_setup(args)
        data, report = _seed_form_run(args, strategies, on_mesh)
    except (ValueError, TypeError) as e:
        return _fail(err, str(e))
    from shardcheck import distributed

    if not distributed.is_main_process():
        return 0  # every process computed the same report; process 0 alone prints it
    console = console_for(args)
    console.print(render_table(report, data))
    verdict = run_verdict(report, int(data.x.shape[0]))
    if verdict is not None:
        console.print(verdict.line, highlight=False, soft_wrap=True)
    console.print(device_choice(args).line(), highlight=False)
    document = report_json(report, data) | {"devices": device_choice(args).to_dict()}
    if verdict is not None:
        document |= {"ok": verdict.ok, "allowed_abs_param_diff": verdict.allowed}
    write_json(document, args.json)
    return 0 if verdict is None or verdict.ok else 1


@dataclasses.dataclass(frozen=True)
class RunVerdict:
    """``shardcheck run``'s verdict: whether every computation's parameters after the step lie within the parity
    tolerance of the baseline's (``allowed``, in parameter units), and the line that says so."""

    ok: bool
    allowed: float
    line: str


def run_verdict(report, rows: int) -> RunVerdict | None:
    """The verdict of the seed form's one SGD step on ``rows`` examples: each computation's ``max|params -
    params_baseline|`` against ``atol + rtol * max|params_baseline|``, the parity rule after one step
    (:func:`shardcheck.training.step_tolerance` with n = ``rows * K`` reduced terms: what ``train`` and ``verify``
    allow; trial 52: the main job printed numbers and no verdict). ``None`` where the baseline ran alone."""
    import numpy as np

    from shardcheck.training import step_tolerance

    others = {k: o.max_abs_param_diff_vs_baseline for k, o in report.outcomes.items() if k != BASELINE}
    if BASELINE not in report.outcomes or not others:
        return None
    scale = max(float(np.max(np.abs(v))) for v in report.outcomes[BASELINE].params.values())
    tol = step_tolerance(rows, report.out_features, 1)
    allowed = tol.atol + tol.rtol * scale
    worst = max(others, key=others.get)
    rule = (
        f"atol + rtol*max|params| after one step with n = {rows} x {report.out_features} reduced terms, the rule "
        "of train and verify"
    )
    if all(d <= allowed for d in others.values()):
        line = (
            f"PASS: every computation's parameters after the step are within {allowed:.3g} of the baseline's "
            f"(worst {worst}: {others[worst]:.3g}; {rule}). shardcheck verify checks the gradients and the "
            "optimizer state too, leaf by leaf, over several steps."
        )
        return RunVerdict(True, allowed, line)
    failed = [k for k, d in others.items() if d > allowed]
    line = (
        f"FAIL: {', '.join(failed)} differ{'s' if len(failed) == 1 else ''} from the baseline's parameters by more "
        f"than {allowed:.3g} (worst {worst}: {others[worst]:.3g}; {rule}). shardcheck verify names the cause."
    )
    return RunVerdict(False, allowed, line)


def _seed_form_setup(args) -> tuple[tuple[str, ...], bool]:
    """The seed form's flags checked, its shard count and devices set: ``(strategies, on_mesh)``.

    Raises:
        ValueError: a flag of the task form, a strategy outside the seed form, a bad ``--mesh`` or device count.
    """
    for flag in ("optimizer", "batch_size"):
        if getattr(args, flag) is not None:
            raise ValueError(f"shardcheck run: --{flag.replace('_', '-')} applies to a built-in --task only")
    if args.lr is None:
        args.lr = 0.1
    from shardcheck import _validate, distributed, runner

    _validate.check_lr("shardcheck run", args.lr, name="--lr", example="--lr 0.1")

    seed_form = runner.xy_strategies()
    if args.strategy != "all" and args.strategy not in seed_form:
        raise ValueError(
            f"shardcheck run: --strategy {args.strategy} needs --task; without it the computations are "
            f"{', '.join(seed_form)}"
        )
    apply_mesh("shardcheck run", args, "shards")
    if args.shards is None and distributed.is_multiprocess():
        import jax

        args.shards = jax.device_count()  # shardcheck launch / a cluster: the mesh spans every process
    if args.shards is None:
        args.shards = args.devices if args.devices is not None else 2
    strategies = seed_form if args.strategy == "all" else (args.strategy,)
    on_mesh = any(STRATEGIES[REFERENCE if s == BASELINE else s].uses_mesh for s in strategies)
    try:
        configure_devices(args.devices if args.devices is not None else (args.shards if on_mesh else None))
    except ValueError as e:
        raise ValueError(f"shardcheck run: {e}") from None
    return strategies, on_mesh


def _seed_form_run(args, strategies, on_mesh):
    """The data set loaded and :func:`shardcheck.seeds.run_strategies` run: ``(data, report)``.

    Raises:
        ValueError: an unknown data set, too few devices, a shard count that does not divide the rows.
    """
    from shardcheck import datasets, runner
    from shardcheck.seeds import run_strategies

    data = datasets.load_dataset(args.dataset, target=args.target)
    from shardcheck.cli._common import needed_mesh

    if on_mesh:
        runner._validate.check_equal_shards(
            "shardcheck run", data.x.shape[0], args.shards, hint="choose --shards from this list"
        )
    mesh = needed_mesh("shardcheck run", args, args.shards, on_mesh)
    report = run_strategies(
        data.x, data.y, num_shards=args.shards, lr=args.lr, seed=args.seed, strategies=strategies, mesh=mesh
    )
    return data, report


def _task_args(args) -> argparse.Namespace:
    """The arguments :func:`shardcheck.cli._task.task_from_args` reads (``run`` has no --model / --hidden)."""
    return argparse.Namespace(
        task=args.task,
        dataset=None,
        target=None,
        model="linear",
        hidden=32,
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        compute_dtype=args.compute_dtype,
        param_dtype=args.param_dtype,
        precision_harness=False,
    )


def main_task(args, err) -> int:
    """``shardcheck run --task SPEC``: one step of each registered strategy, compared with the reference."""
    name = "shardcheck run"
    if args.dataset != "diabetes" or args.target is not None:
        return _fail(
            err, f"{name}: --dataset and --target apply without --task; a task brings its own batches"
        )
    if args.strategy == BASELINE:
        return _fail(err, f"{name}: with --task the baseline is the registered strategy {REFERENCE!r}")
    from shardcheck import distributed

    try:
        check_lr_flag(name, args)
        apply_mesh(name, args, "shards")
    except ValueError as e:
        return _fail(err, str(e))
    if args.shards is None and distributed.is_multiprocess():
        import jax

        args.shards = jax.device_count()
    if args.shards is None:
        args.shards = args.devices if args.devices is not None else 2
    strategies = None if args.strategy == "all" else (args.strategy,)
    on_mesh = any(s.uses_mesh for n, s in STRATEGIES.items() if strategies is None or n in strategies)
    try:
        configure_devices(args.devices if args.devices is not None else (args.shards if on_mesh else None))
    except ValueError as e:
        return _fail(err, f"{name}: {e}")

    from shardcheck import runner
    from shardcheck.cli._common import needed_mesh
    from shardcheck.cli._task import task_from_args
    from shardcheck.tasks import BUILTIN_TASKS

    try:
        mesh = needed_mesh(name, args, args.shards, on_mesh)
        task = task_from_args(_task_args(args), default_optimizer="adam", batch_size=args.batch_size, steps=1)
        report = runner.run_task(task, num_shards=args.shards, strategies=strategies, mesh=mesh)
    except (ValueError, TypeError) as e:
        return _fail(err, str(e))

    if not distributed.is_main_process():
        return 0
    from rich.markup import escape

    console = console_for(args)
    console.print(render_task_table(report))
    for line in skipped_lines(report.skipped):
        console.print(f"[dim]{escape(line)}[/]", highlight=False, soft_wrap=True)
    console.print(device_choice(args).line(), highlight=False)
    document = task_report_json(report, args.seed if args.task in BUILTIN_TASKS else None)
    write_json(document | {"devices": device_choice(args).to_dict()}, args.json)
    return 0


def skipped_lines(skipped: dict[str, str]) -> list[str]:
    """The lines naming the strategies ``run --task`` skipped (``{name: reason}``): the strategies that share a
    reason on one line, a consequence or fix they all share said once after them (trial 52: a BatchNorm model's
    reason, 400 characters, was printed five times), a head they all share once before them, as ``verify``
    says its refusals."""
    from shardcheck.cli.verify import SHARED_HEAD, _own_parts, _refusal_reason
    from shardcheck.parity.diagnosis.grouping import words_and

    groups: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        groups.setdefault(_refusal_reason(name, reason), []).append(name)
    own, head, advice = _own_parts(list(groups))
    if head:
        every = [n for names in groups.values() for n in names]
        lines = [f"skipped {words_and(every)}: {head}{SHARED_HEAD.rstrip()}"]
        lines += [f"  - {words_and(names)}: {own(reason)}" for reason, names in groups.items()]
    else:
        lines = [f"skipped {words_and(names)}: {own(reason)}" for reason, names in groups.items()]
    if advice:
        lines.append(f"for all of them: {advice[:1].lower()}{advice[1:]}")
    return lines


def task_report_json(report, seed) -> dict:
    """The ``--json`` object of ``shardcheck run --task``: the fields of the seed form that apply to a task."""
    results = {}
    for name, o in report.outcomes.items():
        entry = {
            "loss": o.loss,
            "max_abs_param_diff_vs_baseline": o.max_abs_param_diff_vs_baseline,
            "worst_param_leaf": o.worst_param_leaf,
            "max_abs_param_diff_by_leaf": o.max_abs_param_diff_by_leaf,
        }
        if o.shard_losses is not None:
            entry["shard_losses"] = list(o.shard_losses)
        if o.max_abs_grad_diff is not None:
            entry["max_abs_grad_diff_vs_full_batch"] = o.max_abs_grad_diff
        if o.placement is not None:
            entry["placement"] = o.placement
        results[name] = entry
    return {
        "task": report.task,
        "dataset": report.task,
        "num_examples": report.batch_size,
        "param_count": report.param_count,
        "num_shards": report.num_shards,
        "seed": seed,
        "param_storage_per_shard_bytes": report.param_storage_per_shard_bytes,
        "results": results,
        "skipped": report.skipped,
    }


def render_task_table(report):
    from rich.table import Table

    s = report.num_shards
    table = Table(
        title=(
            f"shardcheck run: task {report.task} (first batch, B={report.batch_size}; {report.param_count:,} "
            f"parameters), S={s}"
        ),
        caption=(
            f"parameter storage per shard (seed 001's even split): {report.param_bytes:,} B / {s} = "
            f"{report.param_storage_per_shard_bytes:,.6g} B; not a peak-memory figure"
        ),
    )
    table.add_column("strategy")
    table.add_column("pre-update loss", justify="right")
    table.add_column("shard losses", justify="right")
    table.add_column("max|Δgrad| vs reference", justify="right")
    table.add_column("max|Δparams| vs reference", justify="right")
    table.add_column("worst leaf", overflow="fold")
    table.add_column("params / opt state per device", justify="right")
    for name, o in report.outcomes.items():
        shards = "-"
        if o.shard_losses:
            shown = ", ".join(f"{v:.6g}" for v in o.shard_losses[:4])
            shards = shown + (f", … ({len(o.shard_losses)})" if len(o.shard_losses) > 4 else "")
        grad = "-" if not o.max_abs_grad_diff else f"{max(o.max_abs_grad_diff.values()):.3g}"
        place = "-"
        if o.placement:
            p = o.placement
            place = (
                f"{p['params_bytes']:,} / {p['optimizer_bytes']:,} B "
                f"(of {p['params_total_bytes']:,} / {p['optimizer_total_bytes']:,} B)"
            )
        table.add_row(
            name,
            f"{o.loss:.7g}",
            shards,
            grad,
            f"{o.max_abs_param_diff_vs_baseline:.3g}",
            o.worst_param_leaf or "-",
            place,
        )
    return table


def report_json(report, data) -> dict:
    """The ``--json`` object of ``shardcheck run``."""
    results = {}
    for name, o in report.outcomes.items():
        entry = {
            "loss": o.loss,
            "max_abs_param_diff_vs_baseline": o.max_abs_param_diff_vs_baseline,
            "params": {k: v.tolist() for k, v in o.params.items()},
        }
        if o.shard_losses is not None:
            entry["shard_losses"] = list(o.shard_losses)
        if o.max_abs_grad_diff is not None:
            entry["max_abs_grad_diff_vs_full_batch"] = o.max_abs_grad_diff
        if o.placement is not None:
            entry["placement"] = o.placement
        results[name] = entry
    return {
        "dataset": data.name,
        "num_examples": int(data.x.shape[0]),
        "in_features": report.in_features,
        "out_features": report.out_features,
        "num_shards": report.num_shards,
        "lr": report.lr,
        "seed": report.seed,
        "param_storage_per_shard_bytes": report.param_storage_per_shard_bytes,
        "results": results,
    }


def render_table(report, data):
    from rich.table import Table

    d, k, s = report.in_features, report.out_features, report.num_shards
    table = Table(
        title=f"shardcheck run: {data.name} ({data.x.shape[0]} x {d} -> {k}), S={s}, lr={report.lr:g}",
        caption=(
            f"parameter storage per shard (seed 001): (D+1)*K/S x 4 B = ({d}+1)*{k}/{s} x 4 = "
            f"{report.param_storage_per_shard_bytes:g} B; not a peak-memory figure"
        ),
    )
    table.add_column("computation")
    table.add_column("pre-update loss", justify="right")
    table.add_column("shard losses", justify="right")
    table.add_column("max|Δgrad| kernel", justify="right")
    table.add_column("max|Δgrad| bias", justify="right")
    table.add_column("max|Δparams| vs baseline", justify="right")
    table.add_column("params / opt state per device", justify="right")
    for name, o in report.outcomes.items():
        shards = "-"
        if o.shard_losses:
            shown = ", ".join(f"{v:.6g}" for v in o.shard_losses[:4])
            shards = shown + (f", … ({len(o.shard_losses)})" if len(o.shard_losses) > 4 else "")
        g = o.max_abs_grad_diff or {}
        gk = next((v for key, v in g.items() if key.endswith("kernel")), None)
        gb = next((v for key, v in g.items() if key.endswith("bias")), None)
        place = "-"
        if o.placement:
            p = o.placement
            place = (
                f"{p['params_bytes']} / {p['optimizer_bytes']} B "
                f"(of {p['params_total_bytes']} / {p['optimizer_total_bytes']} B)"
            )
        table.add_row(
            name,
            f"{o.loss:.7g}",
            shards,
            "-" if gk is None else f"{gk:.3g}",
            "-" if gb is None else f"{gb:.3g}",
            f"{o.max_abs_param_diff_vs_baseline:.3g}",
            place,
        )
    return table
