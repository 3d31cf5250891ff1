"""Helpers shared by the subcommands: device setup, JSON output, the rich console."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from shardcheck._catalog import REFERENCE
from shardcheck._io import write_atomic as write_atomic

if TYPE_CHECKING:  # rich is imported when a console is made, not when the parser is built
    from rich.console import Console


# More fake CPU devices than this take minutes to create and are no mesh anyone checks on one machine.
MAX_FAKE_DEVICES = 512


def configure_devices(num_devices: int | None) -> None:
    """Ask for ``num_devices`` fake CPU devices; must run before JAX initializes its backend.

    On a machine with an accelerator the CPU devices are created beside it; a mesh the accelerator is too small
    for is built from them (:func:`shardcheck.devices.select_devices`). In a process started by
    ``shardcheck launch`` the launcher has already configured the devices.

    Raises:
        ValueError: ``num_devices`` above :data:`MAX_FAKE_DEVICES`.
    """
    if num_devices is None:
        return
    if num_devices > MAX_FAKE_DEVICES:
        raise ValueError(
            f"--devices {num_devices}: at most {MAX_FAKE_DEVICES} fake CPU devices can be created; pass a device "
            "count that splits your batch, e.g. --devices 8"
        )
    import jax

    if os.environ.get("SHARDCHECK_DEVICES_PER_PROCESS"):
        return
    try:
        jax.config.update("jax_num_cpu_devices", int(num_devices))
    except RuntimeError:
        # JAX already initialized in this process (shardcheck called as a library, as the tests do):
        # fine when enough devices exist already, on the default backend or as CPU devices beside it.
        from shardcheck.devices import select_devices

        try:
            select_devices(int(num_devices))
        except ValueError:
            raise ValueError(
                f"--devices {num_devices}: JAX is already initialized with {len(jax.devices('cpu'))} CPU devices "
                "in this process; set jax_num_cpu_devices before JAX initializes"
            ) from None


MESH_HELP = (
    "a mesh with named axes, e.g. data=2,fsdp=4 or data=2,model=4: the batch is split over the axes named 'data' "
    "and 'fsdp' (over every axis when none is) and replicated over the others, which split the model as its "
    "annotations say (tensor parallelism: 'model'; tiny-lm then runs its tensor-parallel configuration); FSDP "
    "splits the unannotated state over 'fsdp' (else 'data') and replicates it over the other axes; S is the "
    "number of batch shards; creates that many fake CPU devices, like --devices (which it replaces; a given "
    "--devices must equal the product)"
)


# the library's argument names as ``verify`` and ``train`` spell them on their command lines (``library_to_flags``)
VERIFY_FLAGS = {
    "compute_dtype": "--compute-dtype",
    "param_dtype": "--param-dtype",
    "num_shards": "--devices",
    "accept_weak": "--accept-weak",
}
TRAIN_FLAGS = {"num_shards": "--devices", "batch_size": "--batch-size"}


MESH_SHARD_COUNTS = "batch-shard counts (the product of the sizes of --mesh's batch axes, data and fsdp)"
"""What the valid shard counts are under ``--mesh`` (:func:`shard_words`)."""


def shard_words(args, num_shards: int) -> tuple[str, str]:
    """What the shard count S is on this command line, as :func:`shardcheck._validate.check_divisible` names it.

    Returns ``(by, counts)``: ``("--devices 4", "--devices")``, or under ``--mesh``
    ``("the 3 devices of --mesh data=3", ...)`` (``"the 2 batch shards of --mesh data=2,model=4"`` when the mesh
    has model axes) with ``counts`` :data:`MESH_SHARD_COUNTS`.
    """
    mesh = getattr(args, "mesh", None)
    if not mesh:
        return f"--devices {num_shards}", "--devices"
    spec = ",".join(f"{k}={v}" for k, v in mesh.items())
    over = "devices" if math.prod(mesh.values()) == num_shards else "batch shards"
    return f"the {num_shards} {over} of --mesh {spec}", MESH_SHARD_COUNTS


def library_to_flags(
    message: str,
    command: str,
    flags: dict[str, str] = VERIFY_FLAGS,
    *,
    functions: tuple[str, ...] = ("check_parity",),
    args=None,
) -> str:
    """A library error as the command line's: ``check_parity: compute_dtype='float32' ...; omit compute_dtype``
    becomes ``shardcheck verify: --compute-dtype float32 ...; omit --compute-dtype`` (each name of ``flags``
    spelled as its flag, its quoted value unquoted; a message of one of ``functions`` is the command's).

    Under ``--mesh`` (``args.mesh``), the library's ``num_shards=S`` is the mesh's batch shards, not a
    ``--devices`` the user never gave: it reads as :func:`shard_words` names it (``the 3 devices of --mesh
    data=3``), in the one wording of :func:`shardcheck._validate.check_divisible`.
    """
    import re

    for fn in functions:
        message = re.sub(rf"^{fn}: ", f"shardcheck {command}: ", message)
    if getattr(args, "mesh", None):
        message = re.sub(r"\bnum_shards=(\d+)", lambda m: shard_words(args, int(m.group(1)))[0], message)
        message = re.sub(r"\bnum_shards\b", MESH_SHARD_COUNTS, message)
    message = re.sub(r"\bsteps=(\d+)", r"--steps \1", message)  # "steps" alone is a word of the messages
    for name, flag in flags.items():
        message = re.sub(rf"\b{name}='([^']*)'", rf"{flag} \1", message)
        message = re.sub(rf"\b{name}=", f"{flag} ", message)
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


def lr_setting(args, name: str | None, task_name: str) -> tuple[str, str]:
    """``(setting, default)`` of a run that diverged, in the command line's words: ``("with --optimizer sgd --lr
    1e+06", " (default 0.1)")`` for the optimizer ``name`` (``None``: a task file's own, ``("on task 'x'", " (or the
    task's learning rate)")``), for the message's "lower --lr{default}"."""
    from shardcheck.optimizers import DEFAULT_LR

    if name is None:
        return f"on task {task_name!r}", " (or the task's learning rate)"
    lr = DEFAULT_LR[name] if args.lr is None else args.lr
    return f"with --optimizer {name} --lr {lr:g}", f" (default {DEFAULT_LR[name]:g})"


def reason_line(err: BaseException, limit: int = 400) -> str:
    """An exception's reason on one line: its first non-empty line, joined with the next ones while a line ends
    with ``:`` (JAX's "scan body function carry input and carry output must have equal types, but they differ:"
    gives its reason on the next line; trial 19 read it cut off there), at most ``limit`` characters; its class
    name when it has no message."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    out = lines[0]
    for line in lines[1:3]:
        if not out.endswith(":"):
            break
        out = f"{out} {line}"
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _mesh_type(text: str) -> dict[str, int]:
    from shardcheck._mesh_text import parse_mesh  # JAX-free: a malformed --mesh is refused at once

    try:
        return parse_mesh(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--mesh {text!r}: ")) from None


MATMUL_PRECISIONS = ("float32", "tf32", "bfloat16", "highest", "tensorfloat32")
"""``--matmul-precision``'s choices: shardcheck's policies and JAX's names of the same precisions ('highest' is
float32, 'tensorfloat32' tf32; :data:`shardcheck.parity.tolerance.matmul.JAX_NAMES`), JAX-free for the parser."""

POSITIVE_FIXES = {
    "steps": "pass --steps 1 or more (at most the task's number of batches: a task file's default is all of them)",
    "batch_size": "pass --batch-size 1 or more (a multiple of the batch shards)",
    "devices": "pass --devices 1 or more (or drop it: --mesh sets it)",
    "hidden": "pass --hidden 1 or more",
}
"""The fix each positive-int flag's refusal gives (trial 43: "--steps must be a positive int, got 0" said none)."""


def positive_problem(command: str, flag: str, value) -> str | None:
    """``"<command>: --steps must be a positive int, got 0; pass --steps 1 or more (...)"`` for a value below 1 of
    the flag whose ``args`` name is ``flag`` (``"batch_size"``), else None."""
    if value is None or value >= 1:
        return None
    name = flag.replace("_", "-")
    fix = POSITIVE_FIXES.get(flag, f"pass --{name} 1 or more")
    return f"{command}: --{name} must be a positive int, got {value}; {fix}"


def early_checks(command: str, args, positive: tuple[str, ...] = ("steps", "batch_size", "devices")) -> None:
    """What can be refused before JAX starts and the task file runs (trial 43: a missing file or ``--steps 0``
    took 14-37 s to be said): a ``positive`` flag below 1, and a ``--task`` / ``--candidate`` / ``--reference``
    ``FILE.py:ATTR`` whose file is missing (:func:`shardcheck._io.spec_file_problem`, the loader's own text). A
    malformed ``--mesh`` is refused by argparse already, JAX-free (:mod:`shardcheck._mesh_text`).

    Raises:
        ValueError: the first problem, naming the flag, the value and the fix.
    """
    from shardcheck._io import spec_file_problem

    for flag in positive:
        problem = positive_problem(command, flag, getattr(args, flag, None))
        if problem is not None:
            raise ValueError(problem)
    for flag, fn, kind in (
        ("task", "load_task", "task"),
        ("candidate", f"{command}: --candidate", "candidate"),
        (
            REFERENCE,
            f"{command}: --reference",
            "candidate",
        ),  # the flag --reference, as the loader names a step's file
    ):
        spec = getattr(args, flag, None)
        problem = spec_file_problem(fn, spec, kind) if isinstance(spec, str) else None
        if problem is not None:
            raise ValueError(problem)


def early_problem_of(command: str, positive: tuple[str, ...] = ("steps", "batch_size", "devices")):
    """A subcommand's ``early_problem(args) -> str | None`` (its parser's default, which :func:`shardcheck.cli.main`
    calls before JAX starts): :func:`early_checks`' problem, or None."""

    def early_problem(args) -> str | None:
        try:
            early_checks(command, args, positive)
        except ValueError as err:
            return str(err)
        return None

    return early_problem


def add_mesh_argument(p) -> None:
    """``--mesh NAME=SIZE[,NAME=SIZE...]`` (parsed by :func:`shardcheck.mesh.parse_mesh`)."""
    p.add_argument("--mesh", type=_mesh_type, default=None, metavar="NAME=SIZE,...", help=MESH_HELP)


def apply_mesh(command: str, args, devices_flag: str = "devices") -> None:
    """With ``--mesh``, set ``args.<devices_flag>`` to the mesh's device count (the shard count S).

    Raises:
        ValueError: ``--devices`` given and not the product of the mesh's axis sizes.
    """
    axes = getattr(args, "mesh", None)
    if axes is None:
        return
    size = math.prod(axes.values())
    given = getattr(args, devices_flag)
    if given is not None and given != size:
        listed = ",".join(f"{k}={v}" for k, v in axes.items())
        raise ValueError(
            f"{command}: --mesh {listed} has {size} devices but --{devices_flag.replace('_', '-')} {given} was "
            f"given; they must agree (drop --{devices_flag.replace('_', '-')}: --mesh sets it)"
        )
    setattr(args, devices_flag, size)


PLATFORM_HELP = (
    "the platform of the mesh's devices: cpu (fake CPU devices, created beside any accelerator), gpu or tpu "
    "(default: the default backend when it has enough devices for the mesh, else cpu); the devices used are "
    "named in the output"
)


def add_platform_argument(p) -> None:
    """``--platform cpu|gpu|tpu`` (:func:`shardcheck.devices.select_devices`'s ``platform``)."""
    p.add_argument("--platform", default=None, choices=("cpu", "gpu", "tpu"), help=PLATFORM_HELP)


def select_for(command: str, args, num_devices: int):
    """The devices of the command's mesh (:func:`shardcheck.devices.select_devices` with ``--platform``), kept on
    ``args.device_choice`` for the report; the default device moved to the mesh's platform when it is not the
    default backend's (:func:`shardcheck.devices.use_platform_of`).

    Raises:
        ValueError: a platform this host lacks, or too few devices on every usable platform; the message starts
            with ``command`` and says what works (``--platform cpu``, ``--devices N``), never "fewer devices" when
            fewer would not help.
    """
    from shardcheck.devices import select_devices, use_platform_of

    axes = getattr(args, "mesh", None)
    if isinstance(axes, str):  # memory's --mesh is parsed by the command itself
        from shardcheck.mesh import parse_mesh

        axes = parse_mesh(axes)
    what = (
        "the mesh " + ",".join(f"{k}={v}" for k, v in axes.items())
        if axes
        else f"a mesh of {num_devices} devices"
    )
    from shardcheck.distributed import is_multiprocess

    fix = "pass --devices {n} (fake CPU devices are created before JAX starts)"
    if is_multiprocess():  # trial 56: under launch, --devices repeated the same refusal
        fix = (
            "launch more devices: shardcheck launch --processes P --devices-per-process N with P x N = {n} "
            "(--devices does not apply in a launched run)"
        )
    choice = select_devices(
        num_devices,
        platform=getattr(args, "platform", None),
        what=what,
        fn=command,
        fake_fix=fix,
        platform_flag="--platform ",
    )
    use_platform_of(choice)
    args.device_choice = choice
    return choice


def device_choice(args):
    """The devices the command ran on: ``args.device_choice`` (set by :func:`select_for`), else one device of
    ``--platform`` (or the default backend)."""
    choice = getattr(args, "device_choice", None)
    if choice is None:
        from shardcheck.devices import select_devices

        choice = select_devices(1, platform=getattr(args, "platform", None))
    return choice


def needed_mesh(command: str, args, num_devices: int, needed: bool):
    """The mesh a subcommand runs on (:func:`mesh_from_args`), or ``None`` when nothing it runs needs one (its
    one device then chosen by :func:`select_for`, which honours ``--platform``).

    Raises:
        ValueError: fewer devices than ``num_devices`` on every usable platform (:func:`select_for`).
    """
    if not needed:
        select_for(command, args, 1)
        return None
    return mesh_from_args(args, num_devices, command=command)


def mesh_from_args(args, num_devices: int, command: str | None = None):
    """The mesh of ``--mesh`` (``shardcheck.make_mesh`` of its axes), else a 1-D mesh of ``num_devices``, on the
    devices :func:`select_for` picks (``--platform``; the CPU devices when the default backend has too few).

    Raises:
        ValueError: as :func:`select_for`.
    """
    from shardcheck.mesh import make_mesh

    command = command or f"shardcheck {getattr(args, 'command', '')}".strip()
    axes = getattr(args, "mesh", None)
    if isinstance(axes, str):  # memory's --mesh is parsed by the command
        from shardcheck.mesh import parse_mesh

        axes = parse_mesh(axes)
    size = math.prod(axes.values()) if axes is not None else num_devices
    choice = select_for(command, args, size)
    return make_mesh(axes if axes is not None else num_devices, devices=choice.devices)


OUTPUT_FLAGS = ("json", "plot", "log", "out")
INPUT_FLAGS = ("against", "candidate", "task")
"""The flags that name a file a command reads (``--candidate FILE.py:step``, ``--task FILE.py:task``)."""


def _input_files(args) -> dict[str, Path]:
    """``{flag: file}`` of the inputs ``args`` names that exist as files (a ``FILE.py:name`` spec's file)."""
    out = {}
    for flag in INPUT_FLAGS:
        value = getattr(args, flag, None)
        if not isinstance(value, str):
            continue
        path = value.rsplit(":", 1)[0] if ":" in value else value
        if Path(path).is_file():
            out[flag] = Path(path)
    return out


def check_outputs_apart(command: str, args) -> None:
    """Refuse, before any work, an output flag naming a file the command reads (``--json run.npz`` with
    ``--against run.npz`` would replace the recording with the report), or two outputs naming one file.

    Raises:
        ValueError: one line naming both flags and the fix.
    """
    inputs = _input_files(args)
    seen: dict[Path, str] = {}
    for flag in OUTPUT_FLAGS:
        value = getattr(args, flag, None)
        if not isinstance(value, str) or value == "-":
            continue
        target = Path(value).resolve()
        for source_flag, source in inputs.items():
            if source.resolve() == target:
                raise ValueError(
                    f"{command}: --{flag} {value} is the file --{source_flag} reads; writing it would replace "
                    f"it; pass another path to --{flag}"
                )
        if target in seen:
            raise ValueError(f"{command}: --{flag} {value} is also --{seen[target]}; pass another path")
        seen[target] = flag


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` once: not for a None default, nor when the help text already states its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return True


def check_output_path(command: str, flag: str, path: str | None) -> str | None:
    """Refuse, before any work, an output path that cannot be written.

    ``-`` (stdout) and None pass. Missing parent folders are created when the file is written; the nearest
    existing ancestor must be a folder this process can create files in (tried with a temp file).

    Returns:
        A note naming the folder that will be created, where the path's folder does not exist (trial 52: a
        typo in ``--out``'s folder made a new folder silently), else None.

    Raises:
        ValueError: the path is a folder, lies under a file, or its folder is not writable; a ``--json`` path
            holding a file that is not JSON (never overwritten).
    """
    if path is None or path == "-":
        return None
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{command}: --{flag} {path} is a folder; pass a file path")
    if flag == "json" and target.is_file() and target.stat().st_size and not _is_json(target):
        raise ValueError(
            f"{command}: --json {path} exists and is not a JSON file (a recording, a source file ...), so it is not "
            "overwritten; pass another path"
        )
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{command}: --{flag} {path} lies under {ancestor}, which is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as err:
        raise ValueError(
            f"{command}: --{flag} {path} cannot be written: {err.strerror} in {ancestor}"
        ) from None
    if ancestor == target.parent:
        return None
    return (
        f"{command}: --{flag} {path}: the folder {target.parent} does not exist; it is created for the file"
    )


def console_for(args) -> Console:
    """A console on stdout, or on stderr when ``--json -`` owns stdout."""
    from rich.console import Console

    stream = sys.stderr if getattr(args, "json", None) == "-" else sys.stdout
    # Off a terminal rich assumes 80 columns; tables of numbers read better wider.
    width = None if stream.isatty() else 140
    return Console(file=stream, width=width)


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_json(obj, path: str | None) -> None:
    """Write one JSON object to ``path``, or to stdout alone when ``path == "-"``; atomic for files."""
    if path is None:
        return
    text = json.dumps(_clean(obj), indent=2, sort_keys=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    write_atomic(Path(path), text.encode())
