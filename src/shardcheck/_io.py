"""File output that never leaves a partial file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and a rename: never a partial file.

    The file gets the mode a plain ``open()`` would give it (0666 less the umask), not ``mkstemp``'s 0600.
    Missing parent folders are created.

    Raises:
        OSError: the folder cannot be created or written; the temp file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def spec_file_problem(fn: str, spec: str, kind: str = "task") -> str | None:
    """The problem with the file of a ``FILE.py:ATTR`` spec that names a missing file (or a folder), else None
    (a ``MODULE:ATTR`` spec, a malformed spec: those are the loader's to refuse). JAX-free, so the command line
    refuses a missing file before JAX and the task load (trial 43: 14-37 s to say so).

    ``fn`` opens the message (``"load_task"``, ``"shardcheck verify: --candidate"``), ``kind`` names the file
    (``"task"``, ``"candidate"``).
    """
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not attr or not target.endswith(".py"):
        return None
    path = Path(target)
    if path.is_file():
        return None
    where = "is a folder, not a file" if path.is_dir() else "does not exist"
    return (
        f"{fn}: {kind} file {target!r} (spec {spec!r}) {where}; pass FILE.py:ATTR with the path of an existing "
        "Python file"
    )
