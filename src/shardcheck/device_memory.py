"""A device's memory: named accelerator kinds, sizes such as ``80GiB``, and whether a compiled step fits.

Used by ``shardcheck memory --device-memory`` with the figures of :mod:`shardcheck.ahead_of_time`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardcheck.ahead_of_time import AheadOfTimeMemory


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """A named accelerator's memory: the vendor's figure, in bytes.

    Attributes:
        name: the key (``"h100"``).
        label: in words (``"NVIDIA H100 SXM 80 GB"``).
        memory_bytes: the memory per device, as the vendor states it (GiB as 2**30, GB as 10**9).
        source: where the number comes from.
    """

    name: str
    label: str
    memory_bytes: int
    source: str


GiB, GB = 2**30, 10**9
DEVICE_KINDS: dict[str, DeviceKind] = {
    kind.name: kind
    for kind in (
        DeviceKind(
            "h100", "NVIDIA H100 80 GB", 80 * GiB, "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3"
        ),
        DeviceKind(
            "h200", "NVIDIA H200 141 GB", 141 * GB, "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e"
        ),
        DeviceKind(
            "a100-40gb", "NVIDIA A100 40 GB", 40 * GiB, "NVIDIA A100 Tensor Core GPU datasheet: 40 GB HBM2"
        ),
        DeviceKind(
            "a100-80gb", "NVIDIA A100 80 GB", 80 * GiB, "NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e"
        ),
        DeviceKind("l4", "NVIDIA L4 24 GB", 24 * GiB, "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6"),
        DeviceKind(
            "tpu-v4", "Google TPU v4 32 GiB", 32 * GiB, "Google Cloud TPU v4 documentation: 32 GiB HBM2"
        ),
        DeviceKind(
            "tpu-v5e", "Google TPU v5e 16 GiB", 16 * GiB, "Google Cloud TPU v5e documentation: 16 GiB HBM2"
        ),
        DeviceKind(
            "tpu-v5p", "Google TPU v5p 95 GiB", 95 * GiB, "Google Cloud TPU v5p documentation: 95 GiB HBM2e"
        ),
    )
}
"""Named device kinds for ``--device-memory``; the memory is the vendor's nominal figure per device (what a
program can really use is somewhat less: the runtime and, on GPU, the CUDA context keep some)."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS.update({"gib": GiB, "tib": 2**40, "k": 10**3, "m": 10**6, "g": GB, "t": 10**12})


def parse_device_memory(text: str) -> tuple[int, str]:
    """``"80GiB"`` -> ``(85899345920, "80 GiB")``; ``"80GB"``, ``"16e9"``, ``"h100"``, ``"a100-40gb"`` likewise.

    A size is a number (``80``, ``16e9``, ``1.5``) and an optional unit: ``B``, ``KB``/``MB``/``GB``/``TB``
    (powers of 10) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 2), case-insensitive; a bare number is bytes.
    A name is a key of :data:`DEVICE_KINDS` (case-insensitive).

    Returns:
        ``(bytes, label)``.

    Raises:
        ValueError: an unknown name, a malformed size, or a size < 1 byte (the message lists the forms and the
            named kinds).
    """
    import re

    kinds = ", ".join(DEVICE_KINDS)
    form = f"a size such as 80GiB, 80GB or 16e9 (bytes), or a device kind: {kinds}"
    raw = str(text).strip()
    key = raw.lower().replace("_", "-").replace(" ", "")
    if key in DEVICE_KINDS:
        kind = DEVICE_KINDS[key]
        return kind.memory_bytes, f"{kind.label} ({kind.source})"
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", key)
    if match is None or match.group(2) not in _UNITS:
        near = [k for k in DEVICE_KINDS if k.split("-")[0] in key]
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise ValueError(
            f"--device-memory {raw!r} is neither a size nor a known device kind{hint}; use {form}"
        )
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value < 1:
        raise ValueError(f"--device-memory {raw!r} is less than one byte; use {form}")
    return int(value), f"{raw} ({int(value):,} B)"


@dataclasses.dataclass(frozen=True)
class FitVerdict:
    """Whether a compiled step fits in one device's memory.

    Attributes:
        device_memory_bytes: the memory of one device.
        device: the device in words (a named kind with its source, or the size given).
        peak_bytes: the step's peak per device (:attr:`AheadOfTimeMemory.peak_bytes`).
        fits: ``peak_bytes <= device_memory_bytes``.
        headroom_bytes: ``device_memory_bytes - peak_bytes`` (negative: the shortfall).
        headroom_fraction: ``headroom_bytes / device_memory_bytes``.
        largest: the three largest parts of the peak (:meth:`AheadOfTimeMemory.breakdown`), ``(part, bytes)``.
    """

    device_memory_bytes: int
    device: str
    peak_bytes: int
    fits: bool
    headroom_bytes: int
    headroom_fraction: float
    largest: tuple[tuple[str, int], ...]

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["largest"] = dict(self.largest)
        return out


def fit_verdict(compiled: AheadOfTimeMemory, device_memory_bytes: int, device: str = "") -> FitVerdict:
    """Fits / does not fit, the headroom, and the largest parts of the peak (see :class:`FitVerdict`)."""
    peak = compiled.peak_bytes
    parts = sorted(compiled.breakdown().items(), key=lambda kv: -kv[1])[:3]
    headroom = int(device_memory_bytes) - peak
    return FitVerdict(
        device_memory_bytes=int(device_memory_bytes),
        device=device or f"{int(device_memory_bytes):,} B",
        peak_bytes=peak,
        fits=headroom >= 0,
        headroom_bytes=headroom,
        headroom_fraction=headroom / int(device_memory_bytes),
        largest=tuple(parts),
    )
