"""``shardcheck run``: the main job. Both seed computations and the mesh steps on a real data set, side by side."""

from __future__ import annotations

import sys

from shardcheck.cli._common import HelpFormatter, configure_devices, console_for, write_json

STRATEGY_CHOICES = ("all", "baseline", "simulation", "dp", "fsdp")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="one SGD step of each computation on a real data set, compared with the baseline",
        description=(
            "Load a data set (default: scikit-learn's bundled diabetes data, standardized), build one nnx.Linear, "
            "and run one SGD step of the single-device baseline (seed 001), the gradient-reduction simulation "
            "(seed 000), and the data-parallel and FSDP steps on a device mesh, all from the same initial "
            "parameters. Prints losses, gradient and parameter differences against the baseline, and the "
            "parameter storage per shard."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--dataset", default="diabetes", help="diabetes | linnerud | PATH.csv | PATH.npz")
    p.add_argument(
        "--target", default=None, help="CSV target column(s), comma-separated (default: last column)"
    )
    p.add_argument("--strategy", default="all", choices=STRATEGY_CHOICES, help="which computation(s) to run")
    p.add_argument(
        "--shards", type=int, default=None, help="number of shards S (default: --devices if given, else 2)"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices to create when no accelerator is present (default: the shard count)",
    )
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters")
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the results as JSON ('-': stdout)"
    )
    p.set_defaults(func=main)


def _fail(console, message: str) -> int:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    return 2


def main(args) -> int:
    from rich.console import Console

    err = Console(file=sys.stderr)
    for flag in ("shards", "devices"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return _fail(err, f"shardcheck run: --{flag} must be a positive int, got {value}")
    from shardcheck import distributed

    if args.shards is None and distributed.is_multiprocess():
        import jax

        args.shards = jax.device_count()  # shardcheck launch / a cluster: the mesh spans every process
    if args.shards is None:
        args.shards = args.devices if args.devices is not None else 2
    strategies = ("baseline", "simulation", "dp", "fsdp") if args.strategy == "all" else (args.strategy,)
    on_mesh = any(s in ("dp", "fsdp") for s in strategies)
    configure_devices(args.devices if args.devices is not None else (args.shards if on_mesh else None))

    from shardcheck import datasets, runner

    try:
        data = datasets.load_dataset(args.dataset, target=args.target)
    except ValueError as e:
        return _fail(err, str(e))
    mesh = None
    if on_mesh:
        import jax

        if len(jax.devices()) < args.shards:
            return _fail(
                err,
                f"shardcheck run: --shards {args.shards} needs {args.shards} devices for dp/fsdp, but "
                f"{len(jax.devices())} exist; pass --devices {args.shards} or fewer shards",
            )
    try:
        if on_mesh:
            from shardcheck.spmd import make_mesh

            runner._validate.check_equal_shards(
                "shardcheck run", data.x.shape[0], args.shards, hint="choose --shards from this list"
            )
            mesh = make_mesh(args.shards)
        report = runner.run_strategies(
            data.x,
            data.y,
            num_shards=args.shards,
            lr=args.lr,
            seed=args.seed,
            strategies=strategies,
            mesh=mesh,
        )
    except (ValueError, TypeError) as e:
        return _fail(err, str(e))

    if not distributed.is_main_process():
        return 0  # every process computed the same report; process 0 alone prints it
    console = console_for(args)
    console.print(render_table(report, data))
    write_json(report_json(report, data), args.json)
    return 0


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
