"""``shardcheck memory``: bytes per device under each strategy, estimated (and with ``--measure``, measured).

One row per strategy in the spirit of DeepSpeed's ``estimate_zero*_model_states_mem_needs`` and Accelerate's
``accelerate estimate-memory``: parameters, gradients, optimizer state and total per device, in human
units. Without ``--measure`` nothing is allocated (abstract shapes only), so models far larger than this
machine can be sized; ``--measure`` compiles the real step of each strategy on a mesh and reads XLA's
per-device figures.

With ``--task NAME|FILE.py:ATTR|MODULE:ATTR`` the task's own model and optimizer are sized instead (from
``nnx.eval_shape(task.model)``: nothing allocated), and ``--measure`` compiles the task's step on its first batch.
With ``--mesh data=2,fsdp=4`` the state is placed on that mesh (the model's annotations, else the FSDP rule), and
the real step is compiled ahead of time on abstract inputs for ``--batch-size`` rows over fake CPU devices
(nothing allocated); ``--device-memory 80GiB|h100|...`` says whether it fits and the largest batch that does.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from shardcheck._catalog import DEFAULT_STRATEGY, OPTIMIZERS, TINY_LM_SIZES, xla_partitioned
from shardcheck.cli._common import (
    HelpFormatter,
    add_platform_argument,
    configure_devices,
    console_for,
    reason_line,
    write_atomic,
    write_json,
)
from shardcheck.partitioning import LAYOUTS, STRATEGIES

STRATEGY_CHOICES = ("all", *STRATEGIES)
MESH_ONLY = xla_partitioned()  # registered strategies that are no memory layout: sized on --mesh only
MESH_STRATEGY_CHOICES = (*STRATEGY_CHOICES, *MESH_ONLY)
# the layouts that split the parameters, whose per-device share the note compares with seed 001's even split
PARAMS_SPLIT = tuple(name for name, layout in LAYOUTS.items() if "params" in layout.splits)
SIZE_CHOICES = TINY_LM_SIZES
OPTIMIZER_CHOICES = OPTIMIZERS
DTYPE_CHOICES = ("float32", "bfloat16")
TASK_HELP = (
    "size this training task instead of --in/--out: a built-in (diabetes, linnerud, digits, tiny-lm), "
    "FILE.py:ATTR or MODULE:ATTR (a shardcheck.Task or a zero-argument function returning one); its model, "
    "optimizer and first batch are used"
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="bytes per device of params, grads and optimizer state under each strategy (estimate, measured)",
        description=(
            "Estimate the memory per device of a Linear (or, with --hidden, an MLP of --layers Linear "
            "layers) under each strategy: replicated (one device), dp (everything replicated), zero1 "
            "(optimizer state sharded), zero2 (optimizer state and gradients sharded), fsdp (parameters "
            "too). Leaves are placed as the strategy's own step places them on a mesh of S devices on one "
            "axis fsdp (a task's nnx.with_partitioning annotations, else the FSDP rule: a leaf with no "
            "dimension divisible by S stays whole on every device). The estimate is storage, not peak (seed "
            "001). With --measure, each strategy's step is compiled on that mesh and XLA's per-device memory "
            "analysis and the live state arrays are shown beside the estimate. With --task, the task's own model and optimizer are "
            "sized (from nnx.eval_shape: nothing is allocated) and --measure compiles the task's step on its "
            "first batch. Exit status: 0, or 1 when --device-memory is given and a strategy's compiled step does "
            "not fit it (the report is printed and written all the same); 2 on bad input."
        ),
        formatter_class=HelpFormatter,
    )
    _add_model_arguments(p)
    _add_strategy_arguments(p)
    _add_mesh_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(func=main, memory_parser=p, early_problem=_check_arguments)


def _add_model_arguments(p) -> None:
    """What is sized: --task, or the Linear / MLP of --in, --out, --hidden, --layers."""
    p.add_argument("--task", default=None, metavar="NAME|FILE.py:ATTR|MODULE:ATTR", help=TASK_HELP)
    p.add_argument(
        "--in",
        dest="in_features",
        type=int,
        default=None,
        metavar="D",
        help="input width D (required without --task)",
    )
    p.add_argument(
        "--out",
        dest="out_features",
        type=int,
        default=None,
        metavar="K",
        help="output width K (required without --task)",
    )
    p.add_argument(
        "--hidden", type=int, default=None, metavar="H", help="hidden width H: an MLP instead of one Linear"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="L",
        help="number of Linear layers (default: 2 with --hidden, 1 without)",
    )


def _add_strategy_arguments(p) -> None:
    """How it is sized: --shards, --optimizer, --dtype, --strategy."""
    p.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="S",
        help="shards S: the state is placed on the mesh fsdp=S, as --mesh fsdp=S places it (default: --devices if "
        "given, else 8)",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        choices=OPTIMIZER_CHOICES,
        help="optax optimizer (default: sgd; with a built-in --task: the task's)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_CHOICES,
        help="parameter dtype (default: float32; not with --task)",
    )
    p.add_argument(
        "--strategy",
        default=None,
        choices=MESH_STRATEGY_CHOICES,
        help=f"which strategy, or all (default: all; with --mesh: {DEFAULT_STRATEGY}; {', '.join(MESH_ONLY)} only "
        "with --mesh)",
    )


def _add_mesh_arguments(p) -> None:
    """The ahead-of-time compile: --mesh, --size, --batch-size, --device-memory."""
    p.add_argument(
        "--mesh",
        default=None,
        metavar="NAME=SIZE[,NAME=SIZE...]",
        help="place the task's state on this mesh (e.g. data=2,fsdp=4; fake CPU devices are created) and compile "
        "its real step ahead of time on abstract inputs: nothing is allocated (needs --task or --size)",
    )
    p.add_argument(
        "--size",
        default=None,
        choices=SIZE_CHOICES,
        help="a named size of the tiny-lm task (implies --task tiny-lm): tiny, small, 125m, 350m, 1b (~1B "
        "Llama-like: 16 layers of width 2048, 32 heads, MLP 8192, vocab 32000, T 2048)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="global batch of the ahead-of-time compile with --mesh, of any task (a task file's too), a multiple "
        "of the mesh's batch shards (data=2,model=2 has 2; shapes only: never allocated; default: the task's first "
        "batch, rounded up to a multiple of the mesh size)",
    )
    p.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE|KIND",
        help="memory of one device, e.g. 80GiB, 80GB, 16e9, or a kind (h100, h200, a100-40gb, a100-80gb, l4, "
        "tpu-v4, tpu-v5e, tpu-v5p): says whether the --mesh step fits, and finds the largest batch that does; a "
        "GPU kind also compiles for that GPU, as --target does",
    )
    p.add_argument(
        "--target",
        default=None,
        metavar="KIND",
        help="compile the --mesh step with XLA:GPU for this GPU (h100, h200, a100-80gb, a100-40gb, l4) without "
        "one (deviceless; needs the jax CUDA plugin: pip install 'shardcheck[gpu-aot]'), without a fit question; "
        "without the plugin the figure is XLA:CPU's, and the report says how far that has been from XLA:GPU's",
    )


def _add_output_arguments(p) -> None:
    """--measure and what it runs on, and where the results go."""
    p.add_argument("--measure", action="store_true", help="also compile each step on a mesh and measure it")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="B",
        help="batch size of the measured step (default: 8 per shard; with a built-in --task: the task's; not with "
        "a task file, which brings its own batches)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="fake CPU devices to create (beside any accelerator; used when it has too few devices for the "
        "mesh, or with --platform cpu) (default with --measure: S)",
    )
    add_platform_argument(p)
    p.add_argument(
        "--json", default=None, metavar="PATH|-", help="also write the results as JSON ('-': stdout)"
    )
    p.add_argument(
        "--plot", default=None, metavar="PATH.png", help="also draw a stacked bar chart per strategy"
    )


def _fail(message: str) -> int:
    from rich.console import Console

    Console(file=sys.stderr).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return 2


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"1.00 KiB"``, ``"3.01 MiB"``, ``"2.00 GiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_arguments(args) -> str | None:
    """The problem with the arguments common to every form, or None (``--in`` / ``--out`` via argparse)."""
    name = "shardcheck memory"
    if args.task is None and args.size is None and args.mesh is None:
        missing = [
            flag
            for flag, dest in (("--in", "in_features"), ("--out", "out_features"))
            if getattr(args, dest) is None
        ]
        if missing:  # what argparse said when --in and --out were required: usage, the message, exit status 2
            args.memory_parser.error(f"the following arguments are required: {', '.join(missing)}")
    for flag, dest in (
        ("in", "in_features"),
        ("out", "out_features"),
        ("hidden", "hidden"),
        ("layers", "layers"),
        ("shards", "shards"),
        ("devices", "devices"),
        ("batch", "batch"),
        ("batch-size", "batch_size"),
    ):
        value = getattr(args, dest)
        if value is not None and value < 1:
            return f"{name}: --{flag} must be a positive int, got {value}"
    if args.plot is not None and args.plot.lower().rpartition(".")[2] != "png":  # trial 54: x.txt got a PNG
        return f"{name}: --plot {args.plot!r} must end in .png; for example --plot memory.png"
    from shardcheck._io import spec_file_problem  # before JAX and the task file (trial 43)

    missing = spec_file_problem("load_task", args.task, "task") if args.task is not None else None
    if missing is not None:
        return missing
    if args.size is not None and args.task not in (None, "tiny-lm"):
        return f"{name}: --size is a size of the tiny-lm task; drop --task {args.task} or --size"
    for flag, dest in (
        ("--batch-size", "batch_size"),
        ("--device-memory", "device_memory"),
        ("--target", "target"),
    ):
        if getattr(args, dest) is not None and args.mesh is None:
            return (
                f"{name}: {flag} applies to the ahead-of-time compile; pass --mesh too (e.g. --mesh fsdp=8)"
            )
    if args.mesh is not None and args.task is None and args.size is None:
        return (
            f"{name}: --mesh compiles a task's step; pass --task (e.g. --task tiny-lm --size 125m, or "
            "--task my_task.py:task)"
        )
    if args.mesh is None and args.strategy in MESH_ONLY:
        return f"{name}: --strategy {args.strategy} needs --mesh (e.g. --mesh data=2,fsdp=4)"
    return _device_count_problem(args)


def _device_count_problem(args) -> str | None:
    """The problem of a ``--devices`` that the device count set elsewhere contradicts, or None: with ``--mesh``
    the mesh's size (as ``verify`` refuses it), with ``--measure`` the shard count ``--shards`` (the measured
    mesh is fsdp=S); trial 49: both were ignored, or the fix named only one side."""
    name = "shardcheck memory"
    if args.devices is None:
        return None
    if args.mesh is not None:
        from shardcheck._mesh_text import parse_mesh  # JAX-free; a malformed --mesh is refused later

        try:
            size = math.prod(parse_mesh(args.mesh).values())
        except ValueError:
            return None
        if args.devices != size:
            return (
                f"{name}: --mesh {args.mesh} has {size} devices but --devices {args.devices} was given; they "
                "must agree (drop --devices: --mesh sets it)"
            )
        return None
    if args.measure and args.shards is not None and args.devices != args.shards:
        return (
            f"{name}: --shards {args.shards} and --devices {args.devices} disagree: --measure runs each strategy "
            f"on S = --shards devices; pass the same number to both (or drop --devices: it defaults to --shards)"
        )
    return None


def _model_flags_problem(args) -> str | None:
    """The problem of a flag that sizes the Linear / MLP model (``--in``, ``--out``, ``--hidden``, ``--layers``,
    ``--dtype``) beside ``--task``, with or without ``--mesh``, or None (trial 54: with ``--mesh``, ``--in`` read
    "the mesh sets the device count" and ``--hidden`` was ignored)."""
    name = "shardcheck memory"
    for flag, dest in (
        ("in", "in_features"),
        ("out", "out_features"),
        ("hidden", "hidden"),
        ("layers", "layers"),
    ):
        if getattr(args, dest) is not None:
            return f"{name}: --{flag} sizes the Linear / MLP model; with --task the task's own model is sized"
    if args.dtype is not None:
        return f"{name}: --dtype casts the Linear / MLP model; with --task the task's own dtypes are counted"
    return None


def main(args) -> int:
    problem = _check_arguments(args)
    if problem is not None:
        return _fail(problem)
    if args.size is not None:
        args.task = "tiny-lm"
    problem = _model_flags_problem(args) if args.task is not None else None
    if problem is not None:
        return _fail(problem)
    if args.mesh is not None:
        return main_mesh(args)
    args.strategy = "all" if args.strategy is None else args.strategy
    if args.task is not None:
        return main_task(args)
    return main_model(args)


def _measure_devices(args, estimates, strategies) -> str | None:
    """The problem when ``--measure`` has too few devices for the strategies on every usable platform, or None;
    the devices chosen (:func:`shardcheck.cli._common.select_for`, ``--platform``) are named in the report."""
    from shardcheck.cli._common import select_for

    needed = max(estimates[s].num_devices for s in strategies)
    try:
        select_for("shardcheck memory: --measure", args, needed)
    except ValueError as err:
        return str(err)
    return None


def main_model(args) -> int:
    """``shardcheck memory --in D --out K [--hidden H --layers L]``: the Linear / MLP (and --measure)."""
    args.optimizer = "sgd" if args.optimizer is None else args.optimizer
    args.dtype = "float32" if args.dtype is None else args.dtype
    if args.shards is None:
        args.shards = args.devices if args.devices is not None else 8
    strategies = STRATEGY_CHOICES[1:] if args.strategy == "all" else (args.strategy,)
    try:  # before anything touches a JAX backend; in-process (tests), enough existing devices are fine
        configure_devices(args.devices if args.devices is not None or not args.measure else args.shards)
    except ValueError as e:
        return _fail(f"shardcheck memory: {e}")

    from shardcheck import memory

    dims = dict(hidden=args.hidden, layers=args.layers, param_dtype=args.dtype)
    try:
        model = memory.make_memory_model(args.in_features, args.out_features, abstract=True, **dims)
        estimates = {
            s: memory.estimate_memory(
                model, args.optimizer, num_shards=args.shards, strategy=s, param_dtype=args.dtype
            )
            for s in strategies
        }
    except (ValueError, TypeError) as e:
        return _fail(str(e))
    measured = {}
    if args.measure:
        problem = _measure_devices(args, estimates, strategies)
        if problem is not None:
            return _fail(problem)
        batch = args.batch if args.batch is not None else 8 * args.shards
        try:
            measured = memory.measure_strategies(
                args.in_features,
                args.out_features,
                **dims,
                optimizer=args.optimizer,
                num_shards=args.shards,
                batch_size=batch,
                strategies=strategies,
            )
        except (ValueError, TypeError) as e:
            return _fail(str(e))
    return _report(args, estimates, measured)


def _report(args, estimates, measured, task=None, *, aot=None, fits=None, mesh=None) -> int:
    """Print the tables and the notes, write --json and --plot."""
    from shardcheck import distributed

    if not distributed.is_main_process():
        return 0  # under `shardcheck launch` every process computed the same figures; process 0 alone reports
    console = console_for(args)
    console.print(render_table(args, estimates, task, mesh))
    if aot:
        console.print(render_aot(estimates, aot))
        note = next(iter(aot.values())).backend_note
        console.print(f"[bold]backend[/]: {next(iter(aot.values())).backend}: {note}", highlight=False)
        compiler = getattr(args, "compiler", None) or {}
        if compiler.get("note"):
            from rich.markup import escape  # the note names the extra as shardcheck[gpu-aot]: not markup

            console.print(
                f"[bold]compiler[/]: {escape(compiler['name'])}: {escape(compiler['note'])}", highlight=False
            )
        compiled = next(iter(aot.values())).batch_size
        own = _task_batch_size(task)
        if getattr(args, "batch_size", None) is None and compiled != own:
            console.print(
                f"[bold]batch[/]: compiled at {compiled} rows, the task's batch of {own} rounded up to a multiple "
                f"of the mesh's {mesh.size} devices (--batch-size to choose another)",
                highlight=False,
            )
    if measured:
        console.print(render_measured(estimates, measured))
        if not aot:  # the --mesh path says it beside its ahead-of-time table
            _measured_backend(console, args)
    for s, (verdict, largest, peaks) in (fits or {}).items():
        console.print(render_fit(s, verdict, largest, peaks, aot[s].batch_size), highlight=False)
    for s in PARAMS_SPLIT:
        if s in estimates:
            est = estimates[s]
            console.print(
                f"[bold]even split[/] (seed 001, parameters only): {est.even_split_formula} = "
                f"{est.even_split_params_bytes:,.2f} B; {s} holds {est.params_bytes:,} B: "
                f"{est.even_split_note}",
                highlight=False,
            )
    rule = _rule_splits(estimates, task, mesh, args.shards) if task is not None else None
    if rule is not None:
        console.print(f"[bold]annotations[/]: {rule['note']}", highlight=False)
    console.print(
        "Storage of the training state, not peak memory: activations, gathered parameters and communication "
        "buffers are not in the estimate (seed 001)"
        + ("; the compiled step's peak is in the ahead-of-time table." if aot else ".")
        + (" XLA peak = argument + output - alias + temp." if measured or aot else ""),
        style="dim",
        highlight=False,
    )
    devices = _print_devices(console, args, mesh)
    document = report_json(args, estimates, measured, task, aot=aot, fits=fits, mesh=mesh)
    if rule is not None:
        document["strategies"][DEFAULT_STRATEGY]["unannotated_split"] = rule
    write_json(document | devices, args.json)
    if args.plot:
        memory_plot(estimates, measured, args.plot, title=_title(args, task, mesh), aot=aot)
    # a script asking "does it fit" reads the exit status (trial 49: "does not fit" exited 0)
    return 1 if any(not verdict.fits for verdict, _, _ in (fits or {}).values()) else 0


def _measured_backend(console, args) -> None:
    """On CPU devices, a line saying that the measured step's temp and peak are XLA:CPU's, and where a GPU's own
    figures come from (trial 57: --measure without --mesh said nothing of whose figures they were)."""
    from shardcheck.ahead_of_time import BACKEND_NOTE

    choice = getattr(args, "device_choice", None)
    if choice is not None and choice.platform == "cpu":
        console.print(
            f"[bold]backend[/]: cpu: the measured step was {BACKEND_NOTE['cpu']}; a GPU's own figures: --mesh with "
            "--target KIND (XLA:GPU, deviceless; docs/memory.md)",
            highlight=False,
        )


def _print_devices(console, args, mesh) -> dict:
    """Print the report's ``devices:`` line; return ``--json``'s ``{"devices": {...}}`` (``{}`` when nothing ran
    or compiled on devices: the estimates alone).

    The devices a step ran or compiled on (``args.device_choice``); for a deviceless compile (``--target``, a GPU
    ``--device-memory``, the plugin installed) the compile-only GPU devices: ``"devices: 4 x gpu, compiled for
    h100 (XLA:GPU, deviceless: ...)"`` and ``"devices"`` with ``deviceless: true`` and ``target``, and beside a
    ``--measure`` mesh, a ``compiled for:`` line and ``"compiled_for"`` (trial 49: ``--target`` had neither).
    """
    out = {}
    choice = getattr(args, "device_choice", None)  # None: nothing ran on a device
    if choice is not None:
        console.print(choice.line(), highlight=False)
        out["devices"] = choice.to_dict()
    compiler = getattr(args, "compiler", None) or {}
    if compiler.get("deviceless") and mesh is not None:
        import jax

        kind = compiler["target"]
        why = f"compiled for {kind} (XLA:GPU, deviceless: compile-only devices of the jax CUDA plugin; nothing ran)"
        devices = {
            "platform": "gpu",
            "device_kind": str(mesh.devices.flat[0].device_kind),
            "count": int(mesh.size),
            "fake": False,
            "host_platform": jax.default_backend(),
            "host_count": jax.device_count(),
            "requested": None,
            "single_device": None,
            "why": why,
            "deviceless": True,
            "target": kind,
        }
        word = "compiled for:" if choice is not None else "devices:"
        console.print(f"{word} {mesh.size} x gpu, {why}", highlight=False)
        out["compiled_for" if choice is not None else "devices"] = devices
    return out


def _rule_splits(estimates, task, mesh, shards) -> dict | None:
    """What the FSDP rule splits beyond a model's annotations, where ``fsdp`` is reported for an annotated model
    (trial 43: a Perceiver whose kernels were annotated and whose biases and LayerNorm scales were not read 12,488
    B of parameters a device, est / measured 1.0000, where the user's steps, placed by the annotations, hold
    13,456 B): ``{"count", "leaves", "params_bytes", "annotations_params_bytes",
    "annotations_persistent_bytes", "note"}``, or None where the rule splits no parameter the annotations leave
    whole (a model without annotations, or annotations on every leaf it splits)."""
    from shardcheck import memory
    from shardcheck.memory.layouts import annotated

    est = estimates.get(DEFAULT_STRATEGY)
    if est is None:
        return None
    model = memory.abstract_training_state("shardcheck memory", task)[0]
    if not annotated(model):
        return None
    where = {"mesh": mesh} if mesh is not None else {"num_shards": shards}
    gspmd = xla_partitioned()[0]  # the plain step under jax.jit on the annotations' placement
    own = estimates.get(gspmd) or memory.estimate_memory(task, strategy=gspmd, **where)
    whole = {leaf.path for leaf in own.leaves if leaf.category == "params" and not leaf.sharded}
    split = [
        leaf.path for leaf in est.leaves if leaf.category == "params" and leaf.sharded and leaf.path in whole
    ]
    if not split:
        return None
    kinds = {}  # one leaf of each kind first (a bias, a LayerNorm scale), then the rest in the model's order
    for path in split:
        kinds.setdefault(path.rsplit(".", 1)[-1], path)
    shown = [*kinds.values(), *(p for p in split if p not in kinds.values())][:4]
    named = ", ".join(shown) + (f", ... ({len(split) - 4} more)" if len(split) > 4 else "")
    one = len(split) == 1
    note = (
        f"fsdp also splits {len(split)} unannotated parameter{'' if one else 's'} that the model's annotations "
        f"leave replicated ({named}) by the FSDP rule, and {'its' if one else 'their'} optimizer state and "
        f"gradient{'' if one else 's'}: params {est.params_bytes:,} B a device, persistent "
        f"{est.persistent_bytes:,} B. Placed by the annotations alone (unannotated leaves replicated, as a GSPMD "
        f"step placing nnx.get_named_sharding holds them): params {own.params_bytes:,} B a device, persistent "
        f"{own.persistent_bytes:,} B; --strategy gspmd sizes that layout"
    )
    return {
        "count": len(split),
        "leaves": split,
        "params_bytes": est.params_bytes,
        "annotations_params_bytes": own.params_bytes,
        "annotations_persistent_bytes": own.persistent_bytes,
        "note": note,
    }


def render_aot(estimates, aot):
    from rich.table import Table

    first = next(iter(aot.values()))
    table = Table(
        title=f"compiled ahead of time per device (abstract inputs, nothing allocated), batch {first.batch_size}"
    )
    # the model's non-parameter state (running averages, an EMA, carried state) is counted with the parameters
    # here; the estimate's table shows it in a column of its own (trial 17: 72 B that read as unexplained)
    stateful = any(a.model_state_bytes for a in aot.values())
    for column in (
        "strategy",
        "params+state" if stateful else "params",
        "optimizer",
        "step",
        "persistent",
        "compiled state",
        "est / compiled",
    ):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for column in ("batch", "temporaries", "outputs", "peak"):
        table.add_column(column, justify="right")
    for name, a in aot.items():
        parts = a.breakdown()
        table.add_row(
            strategy_label(name, estimates.get(name)),
            human_bytes(a.params_bytes + a.model_state_bytes),
            human_bytes(a.optimizer_bytes),
            human_bytes(a.step_bytes),
            human_bytes(a.persistent_bytes),
            human_bytes(a.state_argument_bytes),
            f"{a.persistent_bytes / a.state_argument_bytes:.4f}",
            human_bytes(parts["batch"]),
            human_bytes(parts["temporaries"]),
            human_bytes(parts["outputs"]),
            human_bytes(a.peak_bytes),
        )
    return table


def render_fit(strategy, verdict, largest, peaks, batch_size) -> str:
    """One verdict line: fits or not, the headroom, the largest parts, the largest batch that fits."""
    word = "[bold green]fits[/]" if verdict.fits else "[bold red]does not fit[/]"
    headroom = (
        f"headroom {human_bytes(verdict.headroom_bytes)} ({verdict.headroom_fraction:.1%})"
        if verdict.fits
        else f"short by {human_bytes(-verdict.headroom_bytes)}"
    )
    parts = ", ".join(f"{part} {human_bytes(n)}" for part, n in verdict.largest)
    limit = verdict.device_memory_bytes
    tried = ", ".join(f"{b}: {_beside(p, limit)}" for b, p in sorted(peaks.items()))
    if any(human_bytes(p) == human_bytes(limit) for p in peaks.values()):
        tried += f"; the limit {limit:,} B"
    best = _largest_text(largest, peaks, limit)
    return (
        f"{strategy}, batch {batch_size}: {word} on {verdict.device}: peak {human_bytes(verdict.peak_bytes)} of "
        f"{human_bytes(verdict.device_memory_bytes)}, {headroom}; largest parts: {parts}. {best} (peaks compiled: "
        f"{tried})"
    )


def _largest_text(largest: int, peaks: dict[int, int], limit: int) -> str:
    """The largest batch in words: exact, or a lower bound said so (the cap, or the search's budget, stopped it;
    :func:`shardcheck.ahead_of_time.search_bounds`, with ``n`` the smallest size compiled)."""
    from shardcheck.ahead_of_time import MAX_ROWS_PER_SHARD, search_bounds

    if not largest:
        return "no batch fits (even one row per batch shard)"  # trial 54: "per device" on data=2,model=2
    step = min(peaks)
    bounds = search_bounds(largest, peaks, limit, step)
    if not bounds["largest_batch_is_lower_bound"]:
        return f"largest batch that fits: {largest}"
    failing = bounds["smallest_failing_batch_size"]
    if failing is not None:
        return (
            f"largest batch that fits: at least {largest}, fewer than {failing} (the search's time or compile "
            "budget ran out between them)"
        )
    if largest >= step * MAX_ROWS_PER_SHARD:
        return (
            f"largest batch that fits: at least {largest}, the largest searched (every size compiled fits; the "
            f"search compiles at most {MAX_ROWS_PER_SHARD:,} rows per batch shard)"
        )
    return (
        f"largest batch that fits: at least {largest} (every size compiled fits; the search's time or compile "
        "budget ran out)"
    )


def _beside(peak: int, limit: int) -> str:
    """A peak in binary units, or in exact bytes where those units print it as the limit (``80.00 GiB``
    beside ``80.00 GiB``: a fit and a miss must read apart)."""
    text = human_bytes(peak)
    return f"{peak:,} B" if text == human_bytes(limit) else text


def _task_args(args) -> argparse.Namespace:
    """The arguments :func:`shardcheck.cli._task.task_from_args` reads (memory has no --lr, --seed, --model)."""
    return argparse.Namespace(
        task=args.task,
        dataset=None,
        target=None,
        model="linear",
        hidden=32,
        optimizer=args.optimizer,
        lr=None,
        seed=0,
    )


def _build_task(args):
    """The task of ``--task`` (or ``--size``, a named size of tiny-lm); raises ValueError / TypeError."""
    if args.size is not None:
        from shardcheck.tasks.sizes import size_task

        return size_task(args.size, optimizer=args.optimizer, batch_size=args.batch)
    from shardcheck.cli._task import task_from_args

    return task_from_args(_task_args(args), default_optimizer="adam", batch_size=args.batch, steps=1)


def _check_batch_size(name: str, batch: int | None, mesh) -> None:
    """Refuse a ``--batch-size`` that does not split into the mesh's batch shards
    (:func:`shardcheck.mesh.data_shards`), before anything compiles (trial 54: ``--batch-size 3`` on data=2,
    model=2 read "the fsdp step does not compile for this task: ValueError: compile_batch_sizes: ...").

    Raises:
        ValueError: naming the flag, the value, the batch shards and a multiple that splits.
    """
    from shardcheck.mesh import data_shards

    n = data_shards(mesh)
    if batch is not None and batch % n:
        axes = ",".join(f"{a}={k}" for a, k in mesh.shape.items())
        raise ValueError(
            f"{name}: --batch-size {batch} does not split into the {n} batch shards of the mesh {axes}; pass a "
            f"multiple of {n}, e.g. --batch-size {-(-batch // n) * n}"
        )


def _task_batch_size(task) -> int:
    from shardcheck.task import batch_size

    return batch_size(task.batches[0])


def _default_batch_size(task, num_devices: int) -> int:
    """The task's first batch size rounded up to a multiple of the device count (the AOT default)."""
    return -(-_task_batch_size(task) // num_devices) * num_devices


def _mesh_arguments(args):
    """``(axes, device)`` of ``--mesh`` and ``--device-memory`` (None when not given); raises ValueError with the
    problem of these or of a flag that does not apply with ``--mesh``."""
    name = "shardcheck memory"
    from shardcheck.mesh import parse_mesh

    axes = parse_mesh(args.mesh)
    device = None
    if args.device_memory is not None:
        from shardcheck.device_memory import parse_device_memory

        device = parse_device_memory(args.device_memory)
    for flag, dest in (("--shards", "shards"), ("--in", "in_features"), ("--out", "out_features")):
        if getattr(args, dest) is not None:
            raise ValueError(f"{name}: {flag} does not apply with --mesh (the mesh sets the device count)")
    if args.dtype is not None:
        raise ValueError(
            f"{name}: --dtype casts the Linear / MLP model; with --task the task's own dtypes are counted"
        )
    from shardcheck.tasks import BUILTIN_TASKS

    if args.batch is not None and args.task not in BUILTIN_TASKS:  # trial 49: the refusal named --batch-size
        raise ValueError(
            f"{name}: --batch applies to a built-in --task only; a task file brings its own batches (--batch-size "
            "sets the global batch of the ahead-of-time compile, for a task file too)"
        )
    return axes, device


def main_mesh(args) -> int:
    """``shardcheck memory --task SPEC --mesh AXES``: placement on the mesh, the step compiled ahead of time."""
    import math

    name = "shardcheck memory"
    try:
        axes, device = _mesh_arguments(args)
    except ValueError as e:
        msg = str(e)
        return _fail(msg if msg.startswith(name) else f"{name}: {msg}")
    size = math.prod(axes.values())
    try:
        kind = _gpu_target_kind(args)
    except ValueError as e:
        return _fail(f"{name}: {e}")
    from shardcheck import gpu_target

    deviceless = kind is not None and gpu_target.unavailable_reason() is None
    if deviceless:
        gpu_target.prepare_environment()  # before JAX starts: the CUDA plugin registers without CUDA
    args.compiler = _compiler(kind, deviceless)
    try:
        configure_devices(max(size, args.devices or 0))
    except ValueError as e:
        return _fail(f"{name}: {e}")
    from shardcheck import memory
    from shardcheck.cli._common import mesh_from_args

    strategy = args.strategy or DEFAULT_STRATEGY
    strategies = STRATEGY_CHOICES[1:] if strategy == "all" else (strategy,)
    task = None
    try:
        run_mesh = mesh_from_args(args, size, command=name) if args.measure or not deviceless else None
        mesh = gpu_target.target_mesh(kind, axes) if deviceless else run_mesh
        task = _build_task(args)
        batch = args.batch_size or _default_batch_size(task, mesh.size)
        _check_batch_size(name, args.batch_size, mesh)
        estimates = {s: memory.estimate_memory(task, mesh=mesh, strategy=s) for s in strategies}
        compiled = {s: _compiled(name, task, mesh, s, batch, device) for s in strategies}
        aot = {s: compiled[s][batch] for s in strategies}
        measured = {}
        if args.measure:
            measured = {s: memory.measure_memory(task, strategy=s, mesh=run_mesh) for s in strategies}
        fits = _fits(task, mesh, compiled, aot, device) if device is not None else {}
    except (ValueError, TypeError) as e:  # the library's messages, named by the command (trial 12)
        return _fail(re.sub(r"^(estimate_memory|measure_memory): ", f"{name}: ", str(e)))
    except Exception as e:  # the user's loss_fn raising while the step is lowered: bad input, not a crash
        if not _raised_in(e, getattr(task, "loss_fn", None)):
            raise
        from shardcheck.task import _loss_raised

        return _fail(str(_loss_raised(name, e)))
    args.shards = mesh.size
    return _report(args, estimates, measured, task, aot=aot, fits=fits, mesh=mesh)


def _fits(task, mesh, compiled, aot, device) -> dict:
    """Each strategy's ``(verdict, largest batch, peaks)``: the largest-batch search within
    :data:`shardcheck.ahead_of_time.SEARCH_SECONDS`, its progress on stderr, the compiles already made reused."""
    from shardcheck import ahead_of_time, device_memory

    fits = {}
    for s in compiled:
        largest, peaks = ahead_of_time.largest_batch_that_fits(
            task,
            mesh,
            device[0],
            strategy=s,
            known={b: m.peak_bytes for b, m in compiled[s].items()},
            time_budget_s=ahead_of_time.SEARCH_SECONDS,
            progress=_search_progress(s),
        )
        fits[s] = (device_memory.fit_verdict(aot[s], device[0], device[1]), largest, peaks)
    return fits


def _search_progress(strategy: str):
    """The largest-batch search's progress line on stderr, one a round: the sizes it compiles and the seconds so
    far (trial 49: minutes of silence; stdout, and --json's document, stay as they were)."""

    def report(sizes: list[int], seconds: float) -> None:
        print(
            f"shardcheck memory: {strategy}: largest-batch search compiling batch "
            f"{', '.join(str(b) for b in sizes)} ({seconds:.0f} s so far)",
            file=sys.stderr,
            flush=True,
        )

    return report


def _compiled(name: str, task, mesh, strategy, batch, device) -> dict:
    """:func:`_compile_report_and_probes`, whose failure to compile names the strategy and the way out.

    Raises:
        ValueError: the step of ``strategy`` does not trace or compile for this task (trial 12: a carried hidden
            state of the full batch's rows met each device's rows in dp's and fsdp's per-device forward pass,
            and the command said only "Incompatible types for broadcasting").
    """
    try:
        return _compile_report_and_probes(task, mesh, strategy, batch, device)
    except (TypeError, ValueError) as err:
        first = reason_line(err)
        hint = (
            f" (a model state shaped by the full batch's rows, such as a carried hidden state, meets each "
            f"device's rows where {strategy}'s step runs the forward pass per device)"
            if "broadcast" in first.lower()
            else ""
        )
        raise ValueError(
            f"{name}: the {strategy} step does not compile for this task: {type(err).__name__}: {first}{hint}; "
            "size the other strategies with --strategy NAME (gspmd runs the forward pass on the whole batch)"
        ) from err


def _compile_report_and_probes(task, mesh, strategy, batch, device) -> dict:
    """The report's compile at ``batch`` and, with ``--device-memory``, the largest-batch search's first probes
    beside it (:func:`shardcheck.ahead_of_time.first_probe_sizes`), two at once: ``{batch_size: AOT memory}``."""
    from shardcheck import ahead_of_time

    probes = ahead_of_time.first_probe_sizes(mesh, strategy) if device is not None else []
    return ahead_of_time.compile_batch_sizes(task, mesh, [batch, *probes], strategy=strategy)


def _gpu_target_kind(args) -> str | None:
    """The GPU the ``--mesh`` step is compiled for: ``--target``, else a GPU kind named by ``--device-memory``.

    Raises:
        ValueError: ``--target`` names no GPU shardcheck can compile for; ``--device-memory`` names another device
            kind than ``--target`` (trial 49: the report gave the h100 verdict and never mentioned --target h200).
    """
    from shardcheck.device_memory import DEVICE_KINDS
    from shardcheck.gpu_target import GPU_TARGETS

    memory_kind = (args.device_memory or "").strip().lower().replace("_", "-").replace(" ", "")
    if args.target is not None:
        key = args.target.strip().lower().replace("_", "-")
        if key not in GPU_TARGETS:
            raise ValueError(
                f"--target {args.target!r} is not a GPU shardcheck can compile for; use one of "
                f"{', '.join(GPU_TARGETS)} (TPU kinds size with --device-memory, compiled by XLA:CPU)"
            )
        if memory_kind in DEVICE_KINDS and memory_kind != key:
            raise ValueError(
                f"--device-memory {args.device_memory} and --target {args.target} name different devices; name "
                f"one: --device-memory {key} (compiles for {key} and gives its fit), or --target {key} with "
                "--device-memory as a size (e.g. 80GiB)"
            )
        return key
    return memory_kind if memory_kind in GPU_TARGETS else None


def _compiler(kind: str | None, deviceless: bool) -> dict:
    """Which compiler gives the figures, as the report's ``compiler`` line and ``--json``'s ``compiler``."""
    from shardcheck import gpu_target

    if deviceless:
        return {
            "name": "XLA:GPU",
            "target": kind,
            "deviceless": True,
            "note": f"compiled by XLA:GPU for {kind} without a GPU (the jax CUDA plugin, from shardcheck's target "
            "config gpu_targets/"
            + f"{kind}.txtpb): the target's own fusion, scheduling and buffer assignment; "
            "nothing ran",
        }
    if kind is not None:  # the install hint said once, in the note (trial 54 read it twice in one line)
        reason = gpu_target.unavailable_reason().replace(f" ({gpu_target.install_hint()})", "")
        return {
            "name": "XLA:CPU",
            "target": kind,
            "deviceless": False,
            "note": f"{gpu_target.cpu_figure_note()} ({reason})",
        }
    return {"name": "XLA:CPU", "target": None, "deviceless": False, "note": ""}


def _raised_in(err: BaseException, fn) -> bool:
    """Whether ``err`` was raised inside ``fn`` (one of its frames is on the traceback)."""
    code = getattr(fn, "__code__", None)
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def main_task(args) -> int:
    """``shardcheck memory --task SPEC``: the estimate (and with --measure, the compiled step) of a task."""
    name = "shardcheck memory"
    from shardcheck.tasks import BUILTIN_TASKS

    if args.batch is not None and args.task not in BUILTIN_TASKS:
        return _fail(f"{name}: --batch applies to a built-in --task only; a task file brings its own batches")
    if args.shards is None:
        args.shards = args.devices if args.devices is not None else 8
    strategies = STRATEGY_CHOICES[1:] if args.strategy == "all" else (args.strategy,)
    try:
        configure_devices(args.devices if args.devices is not None or not args.measure else args.shards)
    except ValueError as e:
        return _fail(f"{name}: {e}")

    from shardcheck import memory

    try:
        task = _build_task(args)
        estimates = {s: memory.estimate_memory(task, num_shards=args.shards, strategy=s) for s in strategies}
    except (ValueError, TypeError) as e:
        return _fail(str(e))
    measured = {}
    if args.measure:
        problem = _measure_devices(args, estimates, strategies)
        if problem is not None:
            return _fail(problem)
        try:  # on the mesh the estimate placed on, {"fsdp": S}: the task's annotations hold in both
            measured = memory.measure_task_strategies(task, num_shards=args.shards, strategies=strategies)
        except (ValueError, TypeError) as e:  # the library's message, named by the command (trial 57)
            return _fail(
                re.sub(r"^(measure_task_strategies|measure_memory): ", "shardcheck memory: ", str(e))
            )
    return _report(args, estimates, measured, task)


def _title(args, task=None, mesh=None) -> str:
    if task is not None:
        from shardcheck.task import batch_size

        optimizer = args.optimizer or "its own optimizer"
        size = f" size {args.size}" if getattr(args, "size", None) else ""
        if mesh is not None:
            from shardcheck.mesh import describe

            return f"task {task.name}{size}, {optimizer}, mesh {describe(mesh)}"
        return f"task {task.name}{size} (B={batch_size(task.batches[0])}), {optimizer}, S={args.shards}"
    if args.hidden is None:
        model = f"Linear({args.in_features}, {args.out_features})"
    else:
        layers = args.layers if args.layers is not None else 2
        model = (
            f"MLP {args.in_features} -> {args.hidden} x{layers - 1} -> {args.out_features} ({layers} layers)"
        )
    return f"{model}, {args.optimizer}, {args.dtype}, S={args.shards}"


def strategy_label(name: str, est) -> str:
    """A table's strategy cell: ``name``, or for the default strategy where the model's annotations split its
    parameters over an axis that holds no batch shards (``model``), ``"fsdp (annotations: model)"``: the layout is
    the annotations', not the FSDP rule's, which splits over the batch axes only (trials 34 and 38: a
    tensor-parallel model's rows read "fsdp" on a data x model mesh)."""
    from shardcheck.mesh import batch_axis_names

    mesh = dict(getattr(est, "mesh_shape", ()) or ())
    if name != DEFAULT_STRATEGY or not mesh:
        return name
    batch = set(batch_axis_names(mesh))
    axes = sorted({a for leaf in est.leaves if leaf.category == "params" for a in leaf.split_axes} - batch)
    return f"{name} (annotations: {', '.join(axes)})" if axes else name


def render_table(args, estimates, task=None, mesh=None):
    from rich.table import Table

    table = Table(title=f"shardcheck memory (estimate per device): {_title(args, task, mesh)}")
    # The model's variables other than nnx.Param (RNG keys and counts): a column only when a model has some.
    model_state = any(est.model_state_bytes for est in estimates.values())
    table.add_column("strategy")
    table.add_column("devices", justify="right")
    table.add_column("params", justify="right")
    if model_state:
        table.add_column("model state", justify="right")
    table.add_column("grads", justify="right")
    table.add_column("optimizer", justify="right")
    table.add_column("step", justify="right")
    table.add_column("total", justify="right")
    table.add_column("persistent", justify="right")
    table.add_column("vs one device", justify="right")
    for name, est in estimates.items():
        extra = (human_bytes(est.model_state_bytes),) if model_state else ()
        table.add_row(
            strategy_label(name, est),
            str(est.num_devices),
            human_bytes(est.params_bytes),
            *extra,
            human_bytes(est.grads_bytes),
            human_bytes(est.optimizer_bytes),
            human_bytes(est.step_bytes),
            human_bytes(est.total_bytes),
            human_bytes(est.persistent_bytes),
            f"{est.total_bytes / est.unsharded_total_bytes:.3f}x",
        )
    return table


def render_measured(estimates, measured):
    from rich.table import Table

    table = Table(title="measured per device (compiled step, XLA memory_analysis and live arrays)")
    table.add_column("strategy")
    table.add_column("est. persistent", justify="right")
    table.add_column("live state", justify="right")
    table.add_column("est / measured", justify="right")
    table.add_column("XLA args", justify="right")
    table.add_column("data args", justify="right")
    table.add_column("output", justify="right")
    table.add_column("alias", justify="right")
    table.add_column("temp", justify="right")
    table.add_column("peak", justify="right")
    for name, m in measured.items():
        est = estimates[name]
        table.add_row(
            strategy_label(name, est),
            human_bytes(est.persistent_bytes),
            human_bytes(m.state_bytes),
            f"{m.accuracy_ratio:.4f}",
            human_bytes(m.argument_bytes),
            human_bytes(m.data_argument_bytes),
            human_bytes(m.output_bytes),
            human_bytes(m.alias_bytes),
            human_bytes(m.temp_bytes),
            human_bytes(m.peak_bytes),
        )
    return table


def _strategy_json(est, measured=None, aot=None, fit=None, *, task=None) -> dict:
    """One strategy's entry of the ``--json`` object: its estimate, and what was measured or compiled."""
    import dataclasses

    entry = {
        "num_devices": est.num_devices,
        "params_bytes": est.params_bytes,
        "grads_bytes": est.grads_bytes,
        "optimizer_bytes": est.optimizer_bytes,
        "step_bytes": est.step_bytes,
        "persistent_bytes": est.persistent_bytes,
        "total_bytes": est.total_bytes,
        "unsharded_total_bytes": est.unsharded_total_bytes,
        "even_split_params_bytes": est.even_split_params_bytes,
        "even_split_formula": est.even_split_formula,
        "even_split_note": est.even_split_note,
        "leaves": [dataclasses.asdict(leaf) for leaf in est.leaves],
    }
    if task is not None:
        entry["model_state_bytes"] = est.model_state_bytes
    if measured is not None:
        entry["measured"] = measured.to_json()
    if aot is not None:
        entry["ahead_of_time"] = aot.to_json()
    if fit is not None:
        from shardcheck.ahead_of_time import search_bounds

        verdict, largest, peaks = fit
        step = min(peaks) if peaks else 1  # n, the batch shards: the search compiles it first
        entry["device_memory"] = {
            **verdict.to_json(),
            **search_bounds(largest, peaks, verdict.device_memory_bytes, step),
            "peak_bytes_by_batch_size": {str(b): p for b, p in sorted(peaks.items())},
        }
    return entry


def _model_json(args, first) -> dict:
    """The ``model`` of the ``--json`` object of the Linear / MLP form."""
    return {
        "kind": "linear" if args.hidden is None else "mlp",
        "in_features": args.in_features,
        "out_features": args.out_features,
        "hidden": args.hidden,
        "layers": args.layers if args.layers is not None else (1 if args.hidden is None else 2),
        "param_dtype": args.dtype,
        "param_count": first.param_count,
    }


def report_json(args, estimates, measured, task=None, *, aot=None, fits=None, mesh=None) -> dict:
    """The ``--json`` object: exact bytes per device, by strategy (with ``task``: of the task's model).

    With ``--mesh`` each strategy also has ``ahead_of_time`` (:class:`shardcheck.ahead_of_time.AheadOfTimeMemory` fields
    and its ``breakdown``) and, with ``--device-memory``, ``device_memory`` (the verdict, ``largest_batch_size`` and
    ``peak_bytes_by_batch_size``); the top level has ``mesh`` and ``size``.
    """
    aot, fits = aot or {}, fits or {}
    out = {
        name: _strategy_json(est, measured.get(name), aot.get(name), fits.get(name), task=task)
        for name, est in estimates.items()
    }
    first = next(iter(estimates.values()))
    if task is None:
        return {
            "model": _model_json(args, first),
            "optimizer": args.optimizer,
            "num_shards": args.shards,
            "strategies": out,
        }
    from shardcheck.task import batch_size

    report = {
        "task": task.name,
        "model": {"kind": "task", "task": task.name, "param_count": first.param_count},
        "optimizer": args.optimizer,
        "batch_size": batch_size(task.batches[0]),
        "num_shards": args.shards,
        "strategies": out,
    }
    if mesh is not None:
        report["mesh"] = {str(a): int(n) for a, n in mesh.shape.items()}
        report["size"] = args.size
        report["compiler"] = getattr(args, "compiler", None)
    return report


def memory_plot(estimates, measured, path, *, title: str = "", aot=None) -> None:
    """A stacked bar per strategy (params, optimizer incl. step counter, grads) in MiB, written to ``path``.

    A model's variables other than ``nnx.Param`` (RNG keys and counts, usually none) are drawn with the params.
    With ``aot`` (``--mesh``) the compiled step's temporaries are stacked on top in place of the gradients: they
    include them (trial 57: stacked on the gradients, the bar rose above XLA's measured peak).

    With measurements, a marker shows the measured live state per device and a bar outline XLA's peak
    (argument + output - alias + temp).
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(estimates)
    mib = 1024.0**2
    parts = {  # persistent state first, so the measured-state marker sits on the top of its segment
        "params": [(estimates[n].params_bytes + estimates[n].model_state_bytes) / mib for n in names],
        "optimizer + step": [(estimates[n].optimizer_bytes + estimates[n].step_bytes) / mib for n in names],
    }
    # the compiled step's temporaries (activations, gradients, collective buffers): the gradients among them
    if aot:
        parts["temporaries, grads included (compiled)"] = [
            aot[n].temp_bytes / mib if n in aot else estimates[n].grads_bytes / mib for n in names
        ]
    else:
        parts["grads"] = [estimates[n].grads_bytes / mib for n in names]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4.5))
    bottom = [0.0] * len(names)
    for label, values in parts.items():
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if measured:
        xs = [i for i, n in enumerate(names) if n in measured]
        ax.scatter(
            xs,
            [measured[names[i]].state_bytes / mib for i in xs],
            marker="x",
            color="black",
            zorder=3,
            label="measured live state",
        )
        ax.bar(
            [names[i] for i in xs],
            [measured[names[i]].peak_bytes / mib for i in xs],
            fill=False,
            edgecolor="black",
            linestyle="--",
            label="XLA peak (measured)",
        )
    ax.set_ylabel("MiB per device")
    ax.set_title(title or "memory per device", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
