"""The ``shardcheck`` command line: the only place that parses arguments or prints.

Each subcommand lives in a module of this package exposing ``add_parser(subparsers)`` (which registers the
subcommand and sets ``func``) and is listed, with its one-line summary, in ``SUMMARIES``; :func:`main` imports
only the module of the subcommand it runs (none for ``shardcheck --help``). Options that must act before JAX initializes
(``--devices``) are applied by :func:`configure_devices` before any computation. Every subcommand but
``launch`` (whose workers are ``shardcheck`` processes that do it themselves) turns on JAX's persistent
compilation cache and the copy of the bundled data sets first (:mod:`shardcheck.cli._cache`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import importlib
import math
import os
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence

from shardcheck._catalog import SUBCOMMANDS as SUBCOMMANDS
from shardcheck._catalog import SUMMARIES as SUMMARIES

# The subcommands that compile (memory only with --measure); their --help says where the cache lives.
COMPILING = ("run", "train", "memory", "verify", "record")


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands', which take its class) whose "invalid int value" and "invalid float
    value" say what the option takes (trial 58 D: ``--devices abc`` read argparse's bare "invalid int value:
    'abc'")."""

    def error(self, message: str):
        found = re.match(r"argument ([^:]+): invalid (int|float) value: (.*)", message)
        if found:
            names, kind, value = found.groups()
            flag = names.split("/")[-1]
            wanted = f"a whole number, e.g. {flag} 4" if kind == "int" else f"a number, e.g. {flag} 0.01"
            message = f"argument {flag}: invalid {kind} value: {value}; {flag} takes {wanted}"
        super().error(message)


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``shardcheck`` parser with the full parsers of ``commands`` (default: every subcommand).

    The other subcommands are listed by name and summary only (:data:`SUMMARIES`): :func:`main` loads just the
    module of the subcommand it runs, and none for ``shardcheck --help``.
    """
    from shardcheck import __version__
    from shardcheck.cli._cache import ENV_CACHE, HELP

    load = set(SUBCOMMANDS if commands is None else commands)
    paragraphs = ("Prove that a sharded JAX / Flax NNX training step computes the update you meant.", HELP)
    parser = _Parser(
        prog="shardcheck",
        description="\n\n".join(textwrap.fill(text, 78) for text in paragraphs),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardcheck {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    note = (
        f"Compiled steps are cached in ~/.cache/shardcheck/jax, the bundled data in ~/.cache/shardcheck/datasets "
        f"({ENV_CACHE}=off|DIR; see shardcheck --help)."
    )
    for name in SUBCOMMANDS:
        if name not in load:
            sub.add_parser(name, help=SUMMARIES[name], add_help=False)
            continue
        importlib.import_module(f"shardcheck.cli.{name}").add_parser(sub)
        if name in COMPILING:
            p = sub.choices[name]
            p.epilog = f"{p.epilog.rstrip('. ')}. {note}" if p.epilog else note
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, whose error for an unrecognized option names the subcommand's closest one
    ("unrecognized arguments: --tsk tiny-lm; did you mean --task?": argparse suggests only from Python 3.14)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = parser._subparsers._group_actions[0].choices
        chosen = commands[args.command]  # the subcommand's own parser
        # every subcommand's options, loaded on this error only
        every = build_parser()._subparsers._group_actions[0].choices
        hint = _elsewhere(every, args.command, unknown) or _closest(chosen, unknown)
        chosen.error(
            f"unrecognized arguments: {' '.join(unknown)}{hint}"
        )  # the subcommand's usage (trial 53)
    return args


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]


def _closest(chosen: argparse.ArgumentParser, unknown: list[str]) -> str:
    """``"; did you mean --task?"``: the subcommand's options closest to the unrecognized ones, or ``""``."""
    flags = _flags(chosen)
    guesses = [
        close[0]
        for arg in unknown
        if arg.startswith("--") and (close := difflib.get_close_matches(arg.split("=")[0], flags, n=1))
    ]
    return f"; did you mean {' or '.join(dict.fromkeys(guesses))}?" if guesses else ""


def _elsewhere(commands: dict, command: str, unknown: list[str]) -> str:
    """``"; --candidate is an option of shardcheck record and verify, not of train"``: where an unrecognized
    option is another subcommand's (trial 61: ``train --candidate`` was asked "did you mean --dataset?"), or
    ``""``."""
    for arg in unknown:
        flag = arg.split("=")[0]
        owners = sorted(name for name, p in commands.items() if name != command and flag in _flags(p))
        if arg.startswith("--") and owners:
            return f"; {flag} is an option of shardcheck {' and '.join(owners)}, not of {command}"
    return ""


def _command_in(argv: Sequence[str]) -> tuple[str, ...]:
    """The subcommand ``argv`` names, as a 1-tuple, or ``()``: its first argument that is not an option.

    The top-level options (``--help``, ``--version``) take no value, so that argument is the subcommand.
    """
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    return (command,) if command in SUMMARIES else ()


def _negative_values_joined(argv: Sequence[str]) -> list[str]:
    """``argv`` with an option's value that starts with ``-`` and a digit joined to it (``--device-memory -5GB``
    -> ``--device-memory=-5GB``): argparse reads such a value as an option and says only "expected one argument",
    where the option's own check names the value and the fix (trial 50). A bare negative number (``-5``) argparse
    already reads as a value; ``--lr -0.1`` is joined the same way. Nothing after a bare ``--`` is changed: that
    is the command ``shardcheck launch`` runs, whose own parser reads it."""
    end = argv.index("--") if "--" in argv else len(argv)
    out: list[str] = []
    for arg in argv[:end]:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return [*out, *argv[end:]]


# Collect the youngest generation after 50,000 net allocations instead of CPython's 700: importing JAX, Flax and
# optax and tracing the steps allocate millions of objects that live until the process ends, and the default
# spends about 0.4 s of a 3 s `shardcheck verify` in 400 collections (gc.callbacks); this leaves 5.
CLI_GC_THRESHOLD = (50_000, 20, 100)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardcheck`` console script; returns the process exit status.

    Without ``argv`` (the ``shardcheck`` process itself: its console script, ``python -m shardcheck``) it first
    sets the garbage collector's thresholds to :data:`CLI_GC_THRESHOLD` and watches for a hung collective
    (:func:`_command_watchdog`, which ends the process); a program that passes ``argv`` keeps its own thresholds
    and is never ended by shardcheck.

    An exception that the command turns into no message of its own is shardcheck's internal error: one line on
    stderr naming it and exit status 2, not the FAIL status 1 (:mod:`shardcheck.cli._internal`;
    ``SHARDCHECK_TRACEBACK=1`` prints its traceback too).
    """
    from shardcheck.cli._common import OUTPUT_FLAGS, check_output_path, check_outputs_apart

    own_process = argv is None
    if own_process:
        gc.set_threshold(*CLI_GC_THRESHOLD)
    argv = _negative_values_joined(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_in(argv))  # only the module of the subcommand that runs
    args = _parse(parser, argv)
    command = f"shardcheck {args.command}"
    from shardcheck.gpu_target import quiet_without_cuda

    quiet_without_cuda()  # before JAX starts: no CUDA plugin traceback on a CPU-only machine (trial 49)
    try:  # before any work: an output that cannot be written is refused now, not after the computation
        check_outputs_apart(command, args)  # first: an output over an input is named as such
        for flag in OUTPUT_FLAGS:
            note = check_output_path(command, flag, getattr(args, flag, None))
            if note is not None:
                print(f"note: {note}", file=sys.stderr)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    early = getattr(args, "early_problem", None)
    problem = early(args) if early is not None else None
    if problem:  # what the subcommand refuses before JAX starts and the task file runs (trial 43: 12-37 s)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.command != "launch":  # launch's workers are shardcheck processes: each does this itself
        from shardcheck import distributed
        from shardcheck.cli._cache import enable_compilation_cache, enable_dataset_cache
        from shardcheck.cli._xla import use_cpu_compile_flags, use_cpu_thread_pool

        use_cpu_compile_flags()  # before JAX starts a backend: a CPU-only run compiles for compile time
        use_cpu_thread_pool(_requested_devices(args))  # enough XLA:CPU threads for back-to-back collectives
        enable_compilation_cache()  # before any compilation; a folder it cannot use only prints a warning
        enable_dataset_cache()  # a repeated run reads the bundled data without importing scikit-learn
        try:  # join a multi-process run when SHARDCHECK_COORDINATOR etc. describe one
            distributed.initialize_from_env()
        except (ValueError, distributed.CoordinatorBindError) as err:
            print(f"shardcheck {args.command}: {err}", file=sys.stderr)
            return getattr(err, "exit_status", 2)
    try:
        guard = _command_watchdog(command, args) if own_process else contextlib.nullcontext()
    except ValueError as err:  # SHARDCHECK_COLLECTIVE_TIMEOUT that is not a number of seconds
        print(f"error: {command}: {err}", file=sys.stderr)
        return 2
    try:  # a hung collective's wait ends in one line and exit status 3, not XLA's SIGABRT
        with guard, _one_module_per_file(args.command):
            return int(args.func(args) or 0)
    except OSError as err:  # a write that failed all the same (disk full, permissions changed meanwhile)
        print(f"error: {command}: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001  (shardcheck's own fault: exit 2 with one line, never FAIL's 1)
        from shardcheck.cli._internal import internal_error

        return internal_error(command, err)


def _one_module_per_file(command: str):
    """A task file named by both ``--task`` and ``--candidate`` runs once: one module, its globals shared
    (:func:`shardcheck.tasks.loading.one_module_per_file`); ``launch`` loads no task (its workers do)."""
    if command == "launch":
        return contextlib.nullcontext()
    from shardcheck.tasks.loading import one_module_per_file

    return one_module_per_file()


def _requested_devices(args: argparse.Namespace) -> int:
    """The most CPU devices the command may create: its ``--devices``, its ``--mesh``'s product, at least 8."""
    counts = [8]
    devices = getattr(args, "devices", None)
    if isinstance(devices, int) and devices > 0:
        counts.append(devices)
    mesh = getattr(args, "mesh", None)
    if isinstance(mesh, str):  # memory keeps --mesh as text
        from shardcheck.mesh import parse_mesh

        try:
            mesh = parse_mesh(mesh)
        except ValueError:  # the subcommand reports it
            mesh = None
    if isinstance(mesh, dict) and mesh:
        counts.append(math.prod(mesh.values()))
    return max(counts)


def _command_watchdog(command: str, args: argparse.Namespace):
    """A :class:`~shardcheck.cli._watchdog.Watchdog` around a compiling subcommand on a CPU-only machine,
    single-process (a launched worker may wait on its peers); otherwise a context that does nothing. A bound
    of 40 s or more also raises XLA:CPU's own termination timeout above it, before JAX starts its backends.

    Raises:
        ValueError: ``SHARDCHECK_COLLECTIVE_TIMEOUT`` is not a number of seconds or ``off``.
    """
    from shardcheck.cli._watchdog import Watchdog, timeout_from_env, xla_terminate_flag
    from shardcheck.cli._xla import _backends_started, accelerator_installed

    timeout_s = timeout_from_env()
    launched = any(
        os.environ.get(name) for name in ("SHARDCHECK_COORDINATOR", "SHARDCHECK_DEVICES_PER_PROCESS")
    )
    if timeout_s is None or args.command not in COMPILING or launched or accelerator_installed():
        return contextlib.nullcontext()
    flag = xla_terminate_flag(timeout_s)
    flags = os.environ.get("XLA_FLAGS", "")
    if flag and flag.split("=")[0] not in flags and not _backends_started():
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return Watchdog(command, timeout_s)


if __name__ == "__main__":
    sys.exit(main())
