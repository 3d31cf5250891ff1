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
    from shardcheck._catalog import OPTIMIZERS

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
        help="learning rate of --optimizer (default: sgd 0.1, momentum 0.05, adam 0.01, adamw 0.01)",
    )
    add_optimizer_options(p)


def add_size_argument(p, *, sharded_by: str = "--reference gspmd") -> None:
    """``--size``: a named size of the tiny-lm task (:mod:`shardcheck.tasks.sizes`), implying ``--task tiny-lm``;
    ``sharded_by``: what of the command creates its state sharded (``record`` has no ``--reference``: trial 50)."""
    from shardcheck._catalog import TINY_LM_SIZES

    p.add_argument(
        "--size",
        default=None,
        choices=TINY_LM_SIZES,
        help="a named size of the tiny-lm task (implies --task tiny-lm): tiny, small, 125m, 350m, 1b; with "
        f"{sharded_by} its state is created sharded, never whole on one device",
    )


def _sized(args, options: dict) -> None:
    """``--size``: the tiny-lm config of that size into ``options``, and its default batch (the corpus holds 3
    windows of 2048 tokens: :func:`shardcheck.tasks.sizes.size_task`)."""
    from shardcheck.tasks.sizes import num_windows, size_config

    config = size_config(args.size)
    options["config"] = config
    options.setdefault("batch_size", min(16, num_windows(config.seq_len)))


def add_optimizer_options(p) -> None:
    """``--weight-decay``, ``--clip-norm``, ``--warmup-steps``, ``--schedule``: the LLM recipe's optimizer."""
    from shardcheck._catalog import SCHEDULES

    p.add_argument(
        "--weight-decay", type=float, default=None, help="adamw's decoupled weight decay (default 1e-4)"
    )
    p.add_argument(
        "--clip-norm",
        type=float,
        default=None,
        metavar="C",
        help="clip the gradients to global L2 norm C first (optax.clip_by_global_norm); default: no clipping",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="linear learning-rate warm-up from 0 over N steps",
    )
    p.add_argument(
        "--schedule",
        default="constant",
        choices=SCHEDULES,
        help="the learning rate after the warm-up: constant, or cosine decay to 0 over the run's steps",
    )


PRECISION_DTYPES = ("float32", "bfloat16", "float16")
# Built-in tasks whose factory builds its model in the dtypes given (compute_dtype=, param_dtype=).
PRECISION_TASKS = ("digits", "tiny-lm")


def add_precision_arguments(p, *, harness: bool) -> None:
    """``--compute-dtype`` and ``--param-dtype``: the precision policy (``shardcheck.parity.tolerance.precision``).

    ``harness``: whether the subcommand runs the parity harness, which can apply them to a user's task file.
    """
    where = (
        "; for a task file, the tolerance policy of the check (check_parity's compute_dtype= / param_dtype=): "
        "the file's model keeps its own dtypes"
        if harness
        else "; not for a task file (its model sets its own dtypes)"
    )
    for flag, what in (
        ("compute", "activations and matmuls (the layers' dtype)"),
        ("param", "the parameters"),
    ):
        p.add_argument(
            f"--{flag}-dtype",
            default=None,
            choices=PRECISION_DTYPES,
            help=f"dtype of {what} of the built-in {' / '.join(PRECISION_TASKS)} model (default: the task's "
            f"own model settings, float32){where}",
        )
    p.set_defaults(precision_harness=harness)


def precision_overrides(args) -> dict:
    """``{compute_dtype, param_dtype}`` for :func:`~shardcheck.check_parity` when ``--task`` is a user's file."""
    from shardcheck.tasks import BUILTIN_TASKS

    if args.task is None or args.task in BUILTIN_TASKS:
        return {}
    given = {
        "compute_dtype": getattr(args, "compute_dtype", None),
        "param_dtype": getattr(args, "param_dtype", None),
    }
    return {k: v for k, v in given.items() if v is not None}


def _precision_options(args, *, harness: bool) -> dict:
    """The dtype options of a built-in task's factory; refuses them where they cannot apply."""
    given = {
        "compute_dtype": getattr(args, "compute_dtype", None),
        "param_dtype": getattr(args, "param_dtype", None),
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given or args.task in PRECISION_TASKS:
        return given
    flag = "--" + next(iter(given)).replace("_", "-")
    from shardcheck.tasks import BUILTIN_TASKS

    if args.task is None or args.task in BUILTIN_TASKS:
        raise ValueError(
            f"{flag} applies to --task {' or '.join(PRECISION_TASKS)} (or a task file with verify); the "
            f"{args.task or 'regression'} model is float32 only"
        )
    if not harness:
        raise ValueError(
            f"--task {args.task}: {flag} applies to a task file in verify and record only (as the tolerance "
            "policy); this command runs the file's model in the dtypes its layers set, which shardcheck reads: "
            f"drop {flag}"
        )
    return {}


def _optimizer_options(args) -> dict:
    """The ``--weight-decay`` / ``--clip-norm`` / ``--warmup-steps`` / ``--schedule`` flags that were given."""
    given = {
        "weight_decay": getattr(args, "weight_decay", None),
        "clip_norm": getattr(args, "clip_norm", None),
        "warmup_steps": getattr(args, "warmup_steps", 0) or None,
        "schedule": None if getattr(args, "schedule", "constant") == "constant" else args.schedule,
    }
    return {k: v for k, v in given.items() if v is not None}


def _named_optimizer(args, name: str, steps: int | None):
    """``--optimizer`` with its options as one optax transformation (``shardcheck.optimizers.make_tx``)."""
    from shardcheck.optimizers import DEFAULT_LR, make_tx

    options = _optimizer_options(args)
    if options.get("schedule") == "cosine":
        options["decay_steps"] = max(int(steps or 10), int(options.get("warmup_steps", 0)) + 1)
    lr = DEFAULT_LR[name] if args.lr is None else args.lr
    return make_tx(name, lr, **options)


def _model_axes(args) -> dict[str, int]:
    """The model axes of ``--mesh`` (those not named 'data' or 'fsdp', when one is) with their sizes."""
    from shardcheck.mesh import batch_axis_names

    axes = getattr(args, "mesh", None) or {}
    batch = batch_axis_names(axes)
    return {a: n for a, n in axes.items() if a not in batch}


def task_from_args(args, *, default_optimizer: str, batch_size: int | None, steps: int | None):
    """The :class:`~shardcheck.Task` the arguments name.

    A built-in task gets the options given on the command line (``--optimizer``, ``--lr``, ``--batch-size``,
    ``--steps``, ``--seed``; ``--model`` for diabetes / linnerud; ``--compute-dtype`` / ``--param-dtype`` for
    digits / tiny-lm; tiny-lm's tensor-parallel configuration for a ``--mesh`` with a model axis, such as
    ``data=2,model=4``); a user's task is used as it is (a subcommand that runs the parity harness applies the dtype
    flags to its check instead: :func:`precision_overrides`).

    Raises:
        ValueError, TypeError: from :func:`shardcheck.tasks.load_task` (a bad spec, a task file that fails to
            import, an option that does not apply), with the message naming the flag.
    """
    from shardcheck.tasks import BUILTIN_TASKS, load_task, regression_task
    from shardcheck.tasks.loading import DEFAULT_OPTIMIZER

    if getattr(args, "size", None) is not None:
        if args.task not in (None, "tiny-lm"):
            raise ValueError(f"--size is a size of the tiny-lm task; drop --task {args.task} or --size")
        args.task = "tiny-lm"

    if args.task is not None and getattr(args, "target", None) is not None:
        raise ValueError(
            f"--target {args.target} is the CSV target column of --dataset and applies without --task only; "
            f"--task {args.task} brings its own batches (to size a step for a GPU kind, use shardcheck memory "
            "--target KIND)"
        )
    optimizer = args.optimizer
    lr = args.lr
    if _optimizer_options(args):
        # The options make one optax transformation; built-in tasks take it whole (its rate inside it).
        default = default_optimizer if args.task is None else DEFAULT_OPTIMIZER
        if args.task is None or args.task in BUILTIN_TASKS:
            optimizer, lr = _named_optimizer(args, optimizer or default, steps), None
    harness = getattr(args, "precision_harness", False)
    _precision_options(args, harness=harness)  # refuse the dtype flags where they cannot apply
    if args.task is None:
        return regression_task(
            args.dataset,
            target=args.target,
            model=args.model,
            hidden=args.hidden,
            optimizer=optimizer or default_optimizer,
            lr=lr,
            batch_size=64 if batch_size is None else batch_size,
            steps=10 if steps is None else steps,
            seed=args.seed,
        )
    if args.task in BUILTIN_TASKS:
        options = {"seed": args.seed}
        for key, value in (
            ("optimizer", optimizer),
            ("lr", lr),
            ("batch_size", batch_size),
            ("steps", steps),
        ):
            if value is not None:
                options[key] = value
        if args.task in ("diabetes", "linnerud"):
            options.update(model=args.model, hidden=args.hidden)
        if args.task == "tiny-lm" and _model_axes(args):  # --mesh data=2,model=4: its tensor-parallel config
            options["tensor_parallel"] = _model_axes(args)
        if getattr(args, "size", None) is not None:
            _sized(args, options)
        options.update(_precision_options(args, harness=harness))
        return load_task(args.task, **options)
    return _task_file(args, optimizer, batch_size)


BUILTIN_ONLY = "applies to the built-in tasks only; a task file sets its own optimizer and batches"
"""Why a flag that sets the optimizer or the batches is refused beside a task file."""


def check_lr_flag(fn: str, args) -> None:
    """Refuse a bad ``--lr`` before any work: beside a task file, that the flag applies to the built-in tasks only
    (said first: trial 53 was told "--lr must be a finite positive number ...; pass e.g. --lr 0.1", then, with
    0.1, that a task file takes no --lr); else a value :func:`shardcheck._validate.check_lr` refuses.

    Raises:
        ValueError: as said, naming ``fn`` (``"shardcheck verify"``) and the flag.
    """
    from shardcheck import _validate
    from shardcheck.tasks import BUILTIN_TASKS

    if args.lr is None:
        return
    task = getattr(args, "task", None)
    if task is not None and task not in BUILTIN_TASKS:
        raise ValueError(f"--task {task}: --lr {BUILTIN_ONLY}")
    _validate.check_lr(fn, args.lr, name="--lr", example="--lr 0.1")


def _task_file(args, optimizer, batch_size):
    """The task of a task file (``--task FILE.py:ATTR`` / ``MODULE:ATTR``), after refusing the flags that only the
    built-in tasks read: an optimizer, a rate, a batch size, a seed, a dataset, a model shape (trial 36: ``--seed
    3`` and ``--dataset linnerud`` beside a task file ran seed 0's check and exited 0)."""
    from shardcheck.tasks import load_task

    flags = [("--optimizer", optimizer), ("--lr", args.lr), ("--batch-size", batch_size)]
    flags += [(f"--{k.replace('_', '-')}", v) for k, v in _optimizer_options(args).items()]
    for flag, value in flags:
        if value is not None:
            raise ValueError(f"--task {args.task}: {flag} {BUILTIN_ONLY}")
    given = [
        ("--seed", getattr(args, "seed", 0), 0, "its model's nnx.Rngs seed its parameters"),
        ("--dataset", getattr(args, "dataset", "diabetes"), "diabetes", "it brings its own batches"),
        ("--model", getattr(args, "model", "linear"), "linear", "it builds its own model"),
        ("--hidden", getattr(args, "hidden", 32), 32, "it builds its own model"),
    ]
    for flag, value, default, why in given:
        if value is not None and value != default:
            raise ValueError(
                f"--task {args.task}: {flag} {value} applies to the built-in tasks only ({why}); drop {flag}, or "
                "change the task file"
            )
    try:
        return load_task(args.task)
    except (TypeError, ValueError) as err:  # the flag named first (trial 51: "load_task: ..." named none)
        raise (TypeError if isinstance(err, TypeError) else ValueError)(f"--task {args.task}: {err}") from err
