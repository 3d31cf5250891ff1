"""The command line's ``--mesh NAME=SIZE[,NAME=SIZE...]`` as axis sizes: JAX-free, so that a malformed ``--mesh``
is refused before JAX and the task load (trial 43: 12 s to say a mesh flag was malformed).
:mod:`shardcheck.mesh` re-exports :func:`parse_mesh`.
"""

from __future__ import annotations

import difflib
import re

FSDP_AXIS = "fsdp"
"""The axis FSDP splits unannotated state over when the mesh has several axes."""

BATCH_AXIS_NAMES = ("data", FSDP_AXIS)
"""The names of the axes the batch is split over (:func:`shardcheck.mesh.batch_axes`); the other axes of a mesh
split the model."""

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (the command line's ``--mesh``); ``"8"`` -> ``{"data": 8}``.

    Raises:
        ValueError: text that is not ``NAME=SIZE[,NAME=SIZE...]`` with identifier names, sizes >= 1 and no
            repeated name (the message shows the expected form), or a name one typo from ``data`` / ``fsdp``
            (``dta``, ``fsdq``: difflib ratio >= 0.75), which would silently take another role.
    """
    form = "--mesh NAME=SIZE[,NAME=SIZE...], e.g. --mesh data=2,fsdp=4"
    text = str(text).strip()
    if text.isdigit():
        text = f"data={text}"
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        name, size = name.strip(), size.strip()
        if not sep or not _AXIS_NAME.match(name) or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: {part.strip()!r} is not NAME=SIZE with SIZE >= 1; use {form}")
        if name in axes:
            raise ValueError(f"--mesh {text!r}: axis {name!r} is given twice; use {form}")
        _check_spelling(text, name)
        axes[name] = int(size)
    return axes


def _check_spelling(text: str, name: str) -> None:
    """Refuse an axis name one typo from a batch axis name (``dta``): it would be read as another role."""
    close = difflib.get_close_matches(name, BATCH_AXIS_NAMES, n=1, cutoff=0.75)
    if close and name not in BATCH_AXIS_NAMES:
        raise ValueError(
            f"--mesh {text!r}: axis {name!r} is not a batch axis name ({', '.join(BATCH_AXIS_NAMES)}); did you mean "
            f"{close[0]!r}? The batch is split over the axes so named, and over every axis only where none is; "
            f"use {close[0]}=SIZE, or name the axis further from {close[0]!r}"
        )
