"""``shardcheck launch``: run another subcommand as several local JAX processes forming one mesh."""

from __future__ import annotations

import argparse
import sys

from shardcheck import launcher
from shardcheck.cli._common import positive_problem


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="run a subcommand as P local processes x N CPU devices over JAX's distributed runtime",
        description=(
            "Start P processes on this machine, each with N fake CPU devices, joined by jax.distributed "
            "(coordinator on 127.0.0.1 and a free port, gloo CPU collectives) into one mesh of P*N devices, "
            "and run the shardcheck subcommand after '--' in every one (or any command: -- python my_check.py, -- pytest; "
            "a script joins with shardcheck.distributed.initialize_from_env()); process 0 prints the result. If a "
            "process fails alone or the timeout passes, all are stopped; a status that every process exits with "
            "(1 for verify's FAIL) is the command's own result, said in one line. On a cluster, set SHARDCHECK_COORDINATOR, "
            "SHARDCHECK_NUM_PROCESSES and SHARDCHECK_PROCESS_ID instead (docs/distributed.md). Exit status: 0 "
            "only if every process exits 0; 124 on timeout."
        ),
        epilog="example: shardcheck launch --processes 2 --devices-per-process 2 -- run --strategy all",
    )
    p.add_argument("--processes", type=int, required=True, metavar="P", help="number of processes (>= 1)")
    p.add_argument(
        "--devices-per-process", type=int, required=True, metavar="N", help="fake CPU devices per process"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="stop every process and fail if the run takes longer (default 120)",
    )
    p.add_argument(
        "--port", type=int, default=None, help="coordinator port to try first (default: a free port)"
    )
    p.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- SUBCOMMAND|COMMAND ...",
        help="the subcommand or command to run",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(
            "shardcheck launch: no subcommand or command given; for example: -- run --strategy dp, or -- python "
            "my_check.py",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "launch":
        print("shardcheck launch: cannot launch 'launch' itself; give the subcommand to run", file=sys.stderr)
        return 2
    problem = _flag_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        return launcher.launch(argv, args.processes, args.devices_per_process, args.timeout, port=args.port)
    except ValueError as err:
        print(f"shardcheck {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the workers were stopped on the way out
        print("shardcheck launch: interrupted; every worker was stopped", file=sys.stderr)
        return 130


def _flag_problem(args) -> str | None:
    """The first of ``launch``'s own flags that is out of range, said by its flag (trial 55: ``--processes 0``
    read "processes=0 must be a positive int", the library's words); ``None`` where all are in range."""
    for flag in ("processes", "devices_per_process"):
        problem = positive_problem("shardcheck launch", flag, getattr(args, flag))
        if problem:
            return problem
    if not args.timeout > 0:  # NaN too
        return (
            f"shardcheck launch: --timeout {args.timeout:g} must be a positive number of seconds; pass e.g. "
            "--timeout 120"
        )
    if args.port is not None and not 1 <= args.port <= 65535:
        return f"shardcheck launch: --port {args.port} must be in [1, 65535]; leave it out for a free port"
    return None
