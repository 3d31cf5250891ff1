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
