"""What a check on one mesh holds per device, measured while it runs (``ParityReport.peak_bytes_per_device``).

A check against a strategy on the candidate's mesh (``check_parity(..., reference="gspmd")``) keeps both sides'
states sharded and compares them where they live. :class:`Footprint` samples what the devices hold: after each
reference step, candidate step and comparison, the bytes of every live ``jax.Array``'s addressable shards, per
device (``jax.live_arrays()``), less what each device held when the check began; the report gives the largest
sample of any device beside the larger of the two sides' own states per device. A sample sees arrays, not the
temporaries inside a compiled call; where the devices keep allocator statistics (``Device.memory_stats()`` on GPU
and TPU: ``peak_bytes_in_use``, the process's peak since it started, temporaries included) the report gives that
too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax


def _pieces(a: jax.Array):
    """``(device, buffer key, bytes)`` of each addressable shard of ``a`` (a single-device array: itself)."""
    if len(a.sharding.device_set) == 1:
        return [(next(iter(a.sharding.device_set)), a, a.nbytes)]
    return [(s.device, s.data, s.data.nbytes) for s in a.addressable_shards]


def _key(device, data) -> tuple:
    """The device buffer a single-device array holds: a shard's ``data`` (itself a live array) and the array it
    belongs to share one buffer, counted once."""
    try:
        return device, data.unsafe_buffer_pointer()
    except Exception:  # a backend without buffer pointers: the array object
        return device, id(data)


def device_bytes(arrays: Iterable) -> dict[jax.Device, int]:
    """``{device: bytes}`` that ``arrays`` (``jax.Array`` s; anything else is skipped) hold on each of this
    process's devices: every addressable shard's ``data.nbytes`` counted on its device, each buffer once (an
    array and the single-device views of its shards share their buffers)."""
    out: dict[jax.Device, int] = {}
    seen = set()
    for a in arrays:
        if not isinstance(a, jax.Array) or a.is_deleted():
            continue
        for device, data, n in _pieces(a):
            key = _key(device, data)
            if key not in seen:
                seen.add(key)
                out[device] = out.get(device, 0) + n
    return out


def state_bytes(tree) -> int:
    """The bytes of ``tree``'s arrays on the device that holds most of them (one side's state per device)."""
    return max(device_bytes(jax.tree.leaves(tree)).values(), default=0)


@dataclasses.dataclass
class Footprint:
    """The running measurement of one check: ``baseline`` (``{device: bytes}`` live when it began), ``peak``
    (the largest sample since, above the baseline, of any device) and ``state`` (the larger of the two sides'
    own states per device, :func:`state_bytes`)."""

    baseline: dict
    state: int = 0
    peak: int = 0

    @staticmethod
    def start() -> Footprint:
        return Footprint(device_bytes(jax.live_arrays()))

    def sample(self) -> None:
        """Take one sample: every live array's shards, per device, above the baseline."""
        now = device_bytes(jax.live_arrays())
        above = max((n - self.baseline.get(d, 0) for d, n in now.items()), default=0)
        self.peak = max(self.peak, above)


def allocator_peak_bytes() -> int | None:
    """The largest ``peak_bytes_in_use`` of this process's devices of the preferred platform
    (:mod:`shardcheck.devices`: the default device's, which the command line moves to a CPU mesh's platform, so a
    CPU check on a GPU host never reports the GPU's allocator), from ``Device.memory_stats()`` (GPU, TPU); ``None``
    where the devices keep no such statistics (CPU)."""
    from shardcheck.devices import preferred_platform

    try:
        devices = jax.local_devices(backend=preferred_platform())
    except RuntimeError:  # no such backend in this process
        devices = jax.local_devices()
    peaks = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without allocator statistics
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None
