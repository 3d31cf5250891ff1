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
    """A named accelerator's memory, in bytes.

    Attributes:
        name: the key (``"h100"``).
        label: in words, with the figure used (``"NVIDIA H100 80GB HBM3, 81,559 MiB"``).
        memory_bytes: the memory per device, bytes: a GPU's total as its driver reports it (``nvidia-smi``'s
            ``memory.total``, MiB as 2**20 bytes), a TPU's HBM as Google states it (GiB as 2**30).
        source: where the number comes from.
    """

    name: str
    label: str
    memory_bytes: int
    source: str


MiB, GiB, GB = 2**20, 2**30, 10**9
_SMI = "nvidia-smi's memory.total"
DEVICE_KINDS: dict[str, DeviceKind] = {
    kind.name: kind
    for kind in (
        DeviceKind(
            "h100",
            "NVIDIA H100 80GB HBM3, 81,559 MiB",
            81_559 * MiB,
            f"{_SMI} on an H100 SXM; the datasheet's 80 GB HBM3",
        ),
        DeviceKind(
            "h200",
            "NVIDIA H200, 143,771 MiB",
            143_771 * MiB,
            f"{_SMI} on the H200 benchmarks/gpu_results.json was measured on; the datasheet's 141 GB HBM3e",
        ),
        DeviceKind(
            "a100-40gb",
            "NVIDIA A100 40GB, 40,960 MiB",
            40_960 * MiB,
            f"{_SMI} on an A100 SXM4 40GB; the datasheet's 40 GB HBM2",
        ),
        DeviceKind(
            "a100-80gb",
            "NVIDIA A100 80GB, 81,920 MiB",
            81_920 * MiB,
            f"{_SMI} on an A100 SXM4 80GB; the datasheet's 80 GB HBM2e",
        ),
        DeviceKind(
            "l4", "NVIDIA L4, 23,034 MiB", 23_034 * MiB, f"{_SMI} on an L4; the datasheet's 24 GB GDDR6"
        ),
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
"""Named device kinds for ``--device-memory``. A GPU's figure is the memory its driver reports (``nvidia-smi
--query-gpu=memory.total``, in MiB: H100 80GB HBM3 81,559 MiB = 85,520,809,984 B; A100 80GB 81,920 MiB and 40GB
40,960 MiB; L4 23,034 MiB = 24,152,899,584 B; H200 143,771 MiB = 150,754,820,096 B, the figure recorded with the
measurements in benchmarks/gpu_results.json), not the datasheet's round number, whose GB (10**9: H200 141 GB,
L4 24 GB) and GiB readings differ by up to 7%; a TPU's is Google's HBM in GiB. What a program can really use is
somewhat less: the runtime and, on GPU, the CUDA context keep some. The GPU target configs
(``gpu_targets/*.txtpb``, ``device_memory_size``) carry the same bytes."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS.update({"gib": GiB, "tib": 2**40, "k": 10**3, "m": 10**6, "g": GB, "t": 10**12})


BARE_MIN = 2**20
"""The least a bare number (no unit) given as a device's memory may be, in bytes: 1 MiB. Below it a number is a
size whose unit was left out (``80`` for 80 GB), refused by :func:`parse_device_memory`."""


MAX_BYTES = 2**50
"""The most a size given as a device's memory may be, in bytes: 1 PiB, thousands of times any accelerator's; above
it a size is a typo (``1e30``, ``1e400``, which is infinite as a float), refused by :func:`parse_device_memory`."""


def parse_device_memory(text: str) -> tuple[int, str]:
    """``"80GiB"`` -> ``(85899345920, "80 GiB")``; ``"80GB"``, ``"16e9"``, ``"h100"``, ``"a100-40gb"`` likewise.

    A size is a number (``80``, ``16e9``, ``1.5``) and an optional unit: ``B``, ``KB``/``MB``/``GB``/``TB``
    (powers of 10) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 2), case-insensitive; a bare number is bytes,
    and must be at least :data:`BARE_MIN` (1 MiB): ``80`` is refused, not read as 80 B (trial 49: ``--device-memory
    80`` meant 80 GB and read as 80 B, "does not fit"); ``80B`` is 80 bytes.
    A name is a key of :data:`DEVICE_KINDS` (case-insensitive).

    Returns:
        ``(bytes, label)``.

    Raises:
        ValueError: an unknown name, a malformed size, a negative size, a size < 1 byte or above
            :data:`MAX_BYTES` (1 PiB), or a bare number below 1 MiB (the message lists the forms and the named
            kinds; of a bare number, the same number with a unit).
    """
    import re

    kinds = ", ".join(DEVICE_KINDS)
    form = f"a size such as 80GiB, 80GB or 16e9 (bytes), or a device kind: {kinds}"
    raw = str(text).strip()
    key = raw.lower().replace("_", "-").replace(" ", "")
    if key in DEVICE_KINDS:
        kind = DEVICE_KINDS[key]
        return kind.memory_bytes, f"{kind.label} ({kind.source})"
    if key.startswith("-"):  # trial 54: "-5GB" read "neither a size nor a known device kind"
        raise ValueError(
            f"--device-memory {raw!r} is negative: a device's memory is a positive size; use {form}"
        )
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", key)
    if match is None or match.group(2) not in _UNITS:
        near = [k for k in DEVICE_KINDS if k.split("-")[0] in key]
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise ValueError(
            f"--device-memory {raw!r} is neither a size nor a known device kind{hint}; use {form}"
        )
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not value <= MAX_BYTES:  # 1e400 is inf: int() of it raised OverflowError (trial 54)
        raise ValueError(
            f"--device-memory {raw!r} is more than any device holds (the most accepted is 1 PiB, {MAX_BYTES:,} B); "
            f"use {form}"
        )
    if value < 1:
        raise ValueError(f"--device-memory {raw!r} is less than one byte; use {form}")
    if not match.group(2) and value < BARE_MIN:
        number = match.group(1)
        raise ValueError(
            f"--device-memory {raw!r} is a bare number, read as {int(value):,} bytes: less than any device holds; "
            f"give its unit: --device-memory {number}GiB or {number}GB (or {number}B for bytes)"
        )
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
