"""What a command says when shardcheck itself raises: one line and exit status 2, never the FAIL code.

An exception that no command turns into a message of its own (a refusal, a step of the user's that raised, an
``ERROR`` row) is a fault of shardcheck's, or of something in the user's code it could not foresee: Python would
print the traceback and exit 1, the status a CI reads as "the step is wrong" (issue #36, trial 38: every replay of
an explicit-sharding step died so). :func:`internal_error` prints instead::

    error: shardcheck verify: internal error: ShardingTypeError: Use `.at[...].get(out_sharding=)` ... (raised
    in shardcheck/parity/harness/true_gradients.py line 105, _raised); not a verdict on your step (exit status 2,
    not FAIL's 1); set SHARDCHECK_TRACEBACK=1 for the traceback, and please report it

and returns 2. With ``SHARDCHECK_TRACEBACK`` set (anything but empty or ``0``) the traceback follows the line.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

ENV_TRACEBACK = "SHARDCHECK_TRACEBACK"
"""Set (to anything but empty or ``0``), an internal error prints its traceback after its line."""

EXIT_STATUS = 2
"""An internal error's exit status: the one of bad input and ``ERROR`` rows, not a FAIL's 1."""

_PACKAGE = Path(__file__).resolve().parents[1]  # the shardcheck package's folder
_LIBRARIES = ("site-packages", "dist-packages", f"{os.sep}lib{os.sep}python")


def internal_error(command: str, err: BaseException) -> int:
    """Print ``err`` as ``command``'s internal error on stderr (one line: its type, its message's first line and
    where it was raised, :func:`raised_at`; the traceback too where :data:`ENV_TRACEBACK` is set) and return
    :data:`EXIT_STATUS`.

    Args:
        command: the command as the user typed it, e.g. ``"shardcheck verify"``.
        err: the exception no command handled.

    Returns:
        2.
    """
    text = str(err).strip().splitlines()
    message = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    where = raised_at(err)
    where = f" ({where})" if where else ""
    shown = os.environ.get(ENV_TRACEBACK, "") not in ("", "0")
    hint = "the traceback follows" if shown else f"set {ENV_TRACEBACK}=1 for the traceback"
    print(
        f"error: {command}: internal error: {message}{where}; not a verdict on your step (exit status "
        f"{EXIT_STATUS}, not FAIL's 1); {hint}, and please report it",
        file=sys.stderr,
    )
    if shown:
        traceback.print_exception(err, file=sys.stderr)
    return EXIT_STATUS


def raised_at(err: BaseException) -> str:
    """Where ``err`` was raised, for its line: ``"raised in shardcheck/<module path> line N, <function>"`` (the
    innermost frame of shardcheck's own code), and ``", calling <file> line M, <function>"`` where a frame of the
    user's code (neither shardcheck's nor an installed library's) lies deeper; ``""`` where no frame of either is
    on the traceback."""
    ours = theirs = None
    for frame, line in traceback.walk_tb(err.__traceback__):
        path = Path(frame.f_code.co_filename)
        if _inside(path, _PACKAGE):
            ours, theirs = (path, line, frame.f_code.co_name), None
        elif not any(part in str(path) for part in _LIBRARIES) and not str(path).startswith("<"):
            theirs = (path, line, frame.f_code.co_name)
    if ours is None and theirs is None:
        return ""
    parts = []
    if ours is not None:
        path, line, name = ours
        parts.append(f"raised in {path.relative_to(_PACKAGE.parent).as_posix()} line {line}, {name}")
    if theirs is not None:
        path, line, name = theirs
        parts.append(f"{'calling' if parts else 'raised in'} {_shown(path)} line {line}, {name}")
    return ", ".join(parts)


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder)
    except ValueError:
        return False
    return True


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies under it, else as it is."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)
