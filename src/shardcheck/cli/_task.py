"""``--task`` for the subcommands: a built-in task, a user's ``FILE.py:ATTR`` / ``MODULE:ATTR``, or the regression
task of ``--dataset``."""

from __future__ import annotations

TASK_HELP = (
    "the training task: a built-in (diabetes, linnerud, digits, tiny-lm), FILE.py:ATTR or MODULE:ATTR (a "
    "shardcheck.Task or a zero-argument function returning one; the file's folder is importable while it loads); "
    "default: the regression task of --dataset and --model"
)


def add_task_arguments(p, *, optimizer_default_help: str) -> None:
    """``--task``, ``--dataset``, ``--target``, ``--model``, ``--hidden``, ``--optimizer``, ``--lr``."""
    from shardcheck.optimizers import OPTIMIZERS

    p.add_argument("--task", default=None, metavar="NAME|FILE.py:ATTR|MODULE:ATTR", help=TASK_HELP)
    p.add_argument(
        "--dataset", default="diabetes", help="without --task: diabetes | linnerud | PATH.csv | PATH.npz"
    )
    p.add_argument(
        "--target", default=None, help="CSV target column(s), comma-separated (default: last column)"
    )
    p.add_argument("--model", default="linear", choices=("linear", "mlp"), help="without --task: the model")
    p.add_argument("--hidden", type=int, default=32, help="hidden width H of --model mlp")
    p.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help=optimizer_default_help)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate of --optimizer (default: sgd 0.1, momentum 0.05, adam 0.01)",
    )


def task_from_args(args, *, default_optimizer: str, batch_size: int | None, steps: int | None):
    """The :class:`~shardcheck.Task` the arguments name.

    A built-in task gets the options given on the command line (``--optimizer``, ``--lr``, ``--batch-size``,
    ``--steps``, ``--seed``; ``--model`` for diabetes / linnerud); a user's task is used as it is.

    Raises:
        ValueError, TypeError: from :func:`shardcheck.tasks.load_task` (a bad spec, a task file that fails to
            import, an option that does not apply), with the message naming the flag.
    """
    from shardcheck.tasks import BUILTIN_TASKS, load_task, regression_task

    optimizer = args.optimizer
    if args.task is None:
        return regression_task(
            args.dataset,
            target=args.target,
            model=args.model,
            hidden=args.hidden,
            optimizer=optimizer or default_optimizer,
            lr=args.lr,
            batch_size=64 if batch_size is None else batch_size,
            steps=10 if steps is None else steps,
            seed=args.seed,
        )
    if args.task in BUILTIN_TASKS:
        options = {"seed": args.seed}
        for key, value in (
            ("optimizer", optimizer),
            ("lr", args.lr),
            ("batch_size", batch_size),
            ("steps", steps),
        ):
            if value is not None:
                options[key] = value
        if args.task in ("diabetes", "linnerud"):
            options.update(model=args.model, hidden=args.hidden)
        return load_task(args.task, **options)
    for flag, value in (("--optimizer", optimizer), ("--lr", args.lr), ("--batch-size", batch_size)):
        if value is not None:
            raise ValueError(
                f"--task {args.task}: {flag} applies to the built-in tasks only; a task file sets its own optimizer "
                "and batches"
            )
    return load_task(args.task)
