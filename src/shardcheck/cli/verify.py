"""``shardcheck verify``: parity of every strategy (or a user's own step) against the baseline, over many steps."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

from shardcheck.cli._common import configure_devices, console_for, write_json
from shardcheck.optimizers import DEFAULT_LR

STRATEGY_NAMES = ("simulation", "dp", "fsdp", "accumulation")
DEFAULT_STRATEGIES = "simulation,dp,fsdp,accumulation"
MESH_STRATEGIES = ("dp", "fsdp")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="prove each sharded step against the single-device baseline, leaf by leaf, over many steps",
        description=(
            "Draw --steps successive mini-batches of --batch-size rows from a data set (reshuffled every epoch "
            "with --seed), run the single-device baseline (sgd_step) and each strategy from the same initial "
            "model and optimizer, and compare after every step the loss, the gradients (where exposed), every "
            "parameter, every optimizer-state leaf and the step counters, within tolerances derived from float32 "
            "rounding and the batch size. Prints a table per strategy with its worst leaf, error, tolerance, "
            "verdict and diagnosis. Exit status: 0 when every strategy passes (PASS, or PASS (per step): the "
            "trajectories diverged through a non-smooth op but every step matched from the reference's state), 1 "
            "when any fails, 2 on bad input, a candidate that raises, or a reference run that diverges (lower --lr)."
        ),
        epilog=(
            "example: shardcheck verify --devices 8 --optimizer adam --steps 20 --batch-size 64; "
            "your own step: shardcheck verify --candidate my_steps.py:dp_step --devices 4"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="linear", choices=("linear", "mlp"), help="the model both steps train")
    p.add_argument("--hidden", type=int, default=32, help="hidden width H of --model mlp")
    p.add_argument("--dataset", default="diabetes", help="diabetes | linnerud | PATH.csv | PATH.npz")
    p.add_argument(
        "--target", default=None, help="CSV target column(s), comma-separated (default: last column)"
    )
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated strategies from {', '.join(STRATEGY_NAMES)}; 'none' with --candidate",
    )
    p.add_argument("--optimizer", default="sgd", choices=tuple(DEFAULT_LR), help="the optax optimizer")
    p.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: sgd 0.1, momentum 0.05, adam 0.01)"
    )
    p.add_argument("--steps", type=int, default=10, help="number of steps (mini-batches) compared")
    p.add_argument("--batch-size", type=int, default=64, help="rows per mini-batch B (a multiple of S)")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="S: shards per step, and fake CPU devices to create (default: every device of a launched run, else 2)",
    )
    p.add_argument(
        "--candidate",
        default=None,
        metavar="MODULE:FUNC|PATH.py:FUNC",
        help="also verify your own in-place step (model, optimizer, x, y) or (model, optimizer, x, y, mesh)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and the shuffling")
    p.add_argument("--rtol", type=float, default=None, help="fixed relative tolerance (default: derived)")
    p.add_argument("--atol", type=float, default=None, help="fixed absolute tolerance (default: derived)")
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the reports as JSON ('-': stdout)"
    )
    p.set_defaults(func=main)


def _fail(message: str) -> int:
    from rich.console import Console

    Console(file=sys.stderr).print(f"[bold red]error:[/] {message}", highlight=False)
    return 2


def load_candidate(spec: str):
    """The function ``spec`` names: ``package.module:func`` or ``path/to/file.py:func``.

    Raises:
        ValueError: malformed spec, missing file or module, missing or non-callable attribute, or a function
            that does not take ``(model, optimizer, x, y)`` or ``(model, optimizer, x, y, mesh)``.
    """
    fn = "shardcheck verify: --candidate"
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{fn} {spec!r} must be MODULE:FUNC or PATH.py:FUNC, e.g. my_steps.py:dp_step")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{fn}: file {target!r} does not exist")
        name = f"shardcheck_candidate_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise ValueError(f"{fn}: importing {target!r} failed: {type(err).__name__}: {err}") from err
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except Exception as err:
            raise ValueError(
                f"{fn}: importing module {target!r} failed: {type(err).__name__}: {err}"
            ) from err
    func = getattr(module, attr, None)
    if func is None or not callable(func):
        raise ValueError(f"{fn}: {target!r} has no callable {attr!r}")
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return func
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 5 or (len(positional) < 4 and not any(p.kind is p.VAR_POSITIONAL for p in params)):
        raise ValueError(
            f"{fn}: {attr} takes ({', '.join(p.name for p in positional)}); it must take (model, optimizer, x, y) "
            "or (model, optimizer, x, y, mesh) and update model and optimizer in place"
        )
    return func


def _parse_strategies(text: str, has_candidate: bool) -> list[str]:
    if text.strip().lower() == "none":
        if not has_candidate:
            raise ValueError("shardcheck verify: --strategies none needs --candidate; nothing to verify")
        return []
    names = [s.strip() for s in text.split(",")]
    rule = f"choose from {', '.join(STRATEGY_NAMES)}, comma-separated, each at most once"
    if not any(names) or "" in names:
        raise ValueError(f"shardcheck verify: --strategies {text!r} has an empty name; {rule}")
    unknown = [s for s in names if s not in STRATEGY_NAMES]
    if unknown:
        raise ValueError(f"shardcheck verify: --strategies {text!r}: unknown {unknown}; {rule}")
    repeated = sorted({s for s in names if names.count(s) > 1})
    if repeated:
        raise ValueError(
            f"shardcheck verify: --strategies {text!r} names {', '.join(repeated)} twice; {rule}"
        )
    return names


def main(args) -> int:
    for flag in ("steps", "batch_size", "devices", "hidden"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return _fail(f"shardcheck verify: --{flag.replace('_', '-')} must be a positive int, got {value}")
    from shardcheck import _validate, distributed

    try:
        _validate.check_seed("shardcheck verify: --seed", args.seed)
    except (TypeError, ValueError) as err:
        return _fail(
            f"shardcheck verify: --seed must be an int in [0, 2**31), got {args.seed}; pass e.g. --seed 0"
            if isinstance(args.seed, int)
            else str(err)
        )
    try:
        strategies = _parse_strategies(args.strategies, args.candidate is not None)
        # Like `shardcheck run`: without --devices, fake as many CPU devices as shards (2) before JAX starts;
        # a launched run (shardcheck launch) has its devices configured already.
        configure_devices(args.devices if args.devices is not None or distributed.is_multiprocess() else 2)
    except ValueError as err:
        return _fail(str(err))

    import jax
    from flax import nnx

    from shardcheck import datasets, parity
    from shardcheck.models import make_model
    from shardcheck.optimizers import make_tx

    num_shards = args.devices or (jax.device_count() if distributed.is_multiprocess() else 2)
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    try:
        lr = _validate.check_lr("shardcheck verify: --lr", lr)
        candidate = load_candidate(args.candidate) if args.candidate else None
        data = datasets.load_dataset(args.dataset, target=args.target)
        n = data.x.shape[0]
        if args.batch_size > n:
            raise ValueError(
                f"shardcheck verify: --batch-size {args.batch_size} is larger than {data.name}'s {n} rows"
            )
        _validate.check_equal_shards(
            "shardcheck verify",
            args.batch_size,
            num_shards,
            hint=f"choose --batch-size a multiple of {num_shards}, or --devices from this list",
        )
        needs_mesh = any(s in MESH_STRATEGIES for s in strategies) or candidate is not None
        mesh = None
        if needs_mesh:
            if jax.device_count() < num_shards:
                raise ValueError(
                    f"shardcheck verify: S={num_shards} shards need {num_shards} devices for dp/fsdp/--candidate, "
                    f"but {jax.device_count()} exist; pass --devices {num_shards} or fewer"
                )
            from shardcheck.spmd import make_mesh

            mesh = make_mesh(num_shards)
        batches = parity.minibatches(data.x, data.y, args.batch_size, args.steps, seed=args.seed)
        d, k = data.x.shape[1], data.y.shape[1]

        def fresh():
            model = make_model(args.model, d, k, hidden=args.hidden, seed=args.seed)
            return model, nnx.Optimizer(model, make_tx(args.optimizer, lr), wrt=nnx.Param)

        reports = {}
        runs = [(name, name) for name in strategies]
        if candidate is not None:
            runs.append(("candidate", candidate))
        for label, cand in runs:
            model, optimizer = fresh()
            reports[label] = parity.check_parity(
                cand,
                model,
                optimizer,
                batches,
                num_shards=num_shards,
                mesh=mesh,
                rtol=args.rtol,
                atol=args.atol,
                name=label,
            )
    except parity.CandidateError as err:
        cause = err.__cause__
        return _fail(
            f"shardcheck verify: the {label} step raised {type(cause).__name__}: {cause} at step {err.step}; "
            "fix the step (the traceback is the exception's cause when called through check_parity)"
        )
    except (ValueError, TypeError) as err:
        return _fail(str(err))

    diverged = next((r for r in reports.values() if r.reference_diverged_at is not None), None)
    if diverged is not None:
        return _fail(
            f"shardcheck verify: the reference run diverged (non-finite loss or parameters at step "
            f"{diverged.reference_diverged_at}) with --optimizer {args.optimizer} --lr {lr:g}; no verdict about "
            f"the candidates; lower --lr (default {DEFAULT_LR[args.optimizer]:g})"
        )
    ok = all(r.step_ok for r in reports.values())
    if not distributed.is_main_process():
        return 0 if ok else 1  # every process computed the same reports; process 0 alone prints them
    console = console_for(args)
    setup = (
        f"{data.name} ({n} x {d} -> {k}), model {args.model}, {args.optimizer} lr={lr:g}, {args.steps} steps of "
        f"B={args.batch_size}, S={num_shards}"
    )
    for report in reports.values():
        console.print(render_report(report, setup))
    console.print(render_summary(reports, setup))
    write_json(
        {
            "command": "verify",
            "ok": ok,
            "dataset": data.name,
            "model": args.model,
            "optimizer": args.optimizer,
            "lr": lr,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "num_shards": num_shards,
            "seed": args.seed,
            "process_count": jax.process_count(),
            "strategies": {name: r.to_dict() for name, r in reports.items()},
        },
        args.json,
    )
    return 0 if ok else 1


def _verdict(ok: bool | str) -> str:
    if ok == "PASS (per step)":
        return "[bold yellow]PASS (per step)[/]"
    if isinstance(ok, str):
        ok = ok == "PASS"
    return "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"


def render_report(report, setup: str):
    """One strategy's table: the worst leaf of each compared kind, with its error, tolerance and verdict."""
    from rich.table import Table

    table = Table(
        title=f"shardcheck verify {report.strategy}: {_verdict(report.verdict)}",
        caption=f"{setup}\n{report.diagnosis}",
        caption_justify="left",
    )
    table.add_column("compared")
    table.add_column("worst leaf")
    table.add_column("step", justify="right")
    table.add_column("max abs err", justify="right")
    table.add_column("max rel err", justify="right")
    table.add_column("allowed abs err", justify="right")
    table.add_column("verdict")
    for kind, e in report.worst_by_kind().items():
        table.add_row(
            kind,
            e.path,
            str(e.step),
            f"{e.max_abs_err:.3g}",
            f"{e.max_rel_err:.3g}",
            f"{e.tolerance:.3g}",
            _verdict(e.ok),
        )
    return table


def render_summary(reports, setup: str):
    """One row per strategy: verdict, worst leaf, its error and tolerance, the diagnosis codes."""
    from rich.table import Table

    table = Table(title="shardcheck verify: summary", caption=setup)
    table.add_column("strategy")
    table.add_column("verdict")
    table.add_column("worst leaf")
    table.add_column("max abs err", justify="right")
    table.add_column("max rel err", justify="right")
    table.add_column("allowed abs err", justify="right")
    table.add_column("diagnosis")
    for name, r in reports.items():
        worst = r.worst
        table.add_row(
            name,
            _verdict(r.verdict),
            r.worst_leaf or "-",
            f"{r.max_abs_err:.3g}",
            f"{r.max_rel_err:.3g}",
            "-" if worst is None else f"{worst.tolerance:.3g}",
            ", ".join(r.codes),
        )
    return table
