"""The ``shardcheck`` command line: the only place that parses arguments or prints.

Each subcommand lives in a module of this package exposing ``add_parser(subparsers)`` (which registers the
subcommand and sets ``func``) and is listed in ``SUBCOMMANDS``. Options that must act before JAX initializes
(``--devices``) are applied by :func:`configure_devices` before any computation.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("run", "launch", "train", "memory", "verify")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardcheck",
        description="Prove that a sharded JAX / Flax NNX training step computes the update you meant.",
    )
    from shardcheck import __version__

    parser.add_argument("--version", action="version", version=f"shardcheck {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"shardcheck.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardcheck`` console script; returns the process exit status."""
    from shardcheck.cli._common import OUTPUT_FLAGS, check_output_path

    parser = build_parser()
    args = parser.parse_args(argv)
    command = f"shardcheck {args.command}"
    try:  # before any work: an output that cannot be written is refused now, not after the computation
        for flag in OUTPUT_FLAGS:
            check_output_path(command, flag, getattr(args, flag, None))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command != "launch":  # join a multi-process run when SHARDCHECK_COORDINATOR etc. describe one
        from shardcheck import distributed

        try:
            distributed.initialize_from_env()
        except (ValueError, distributed.CoordinatorBindError) as err:
            print(f"shardcheck {args.command}: {err}", file=sys.stderr)
            return getattr(err, "exit_status", 2)
    try:
        return int(args.func(args) or 0)
    except OSError as err:  # a write that failed all the same (disk full, permissions changed meanwhile)
        print(f"error: {command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
