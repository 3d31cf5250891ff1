"""Which devices a mesh is built from: the default backend's when it has enough, else fake CPU devices beside it.

On a host with one GPU, JAX's default backend is the GPU and ``jax.devices()`` lists one device, so a mesh of 2 or
8 devices cannot be built from it. ``jax_num_cpu_devices`` (set before the backends start) creates that many CPU
devices beside the accelerator, listed by ``jax.devices("cpu")``; :func:`select_devices` builds the mesh from
them then, and says so (:meth:`DeviceChoice.line`). Every mesh shardcheck builds (:func:`shardcheck.make_mesh`,
the command line, the pytest plugin) takes its devices from here.

The preferred platform is that of ``jax.config.jax_default_device`` when it is set, else JAX's default backend:
the command line sets the default device to the mesh's first device when the mesh is on another platform than
the default backend (``--platform cpu``, or a CPU mesh on a GPU host), so a step that runs alone (the reference,
the seeds' single-device computations) runs on the same platform, at the same matmul precision, as the mesh.
"""

from __future__ import annotations

import dataclasses

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
"""The platforms ``--platform`` (and ``select_devices(platform=...)``) name."""


def _host_platform() -> str:
    """JAX's default backend (``"cpu"``, ``"gpu"``, ``"tpu"``). The tests replace it to fake an accelerator."""
    return jax.default_backend()


def _platform_devices(platform: str) -> list:
    """``jax.devices(platform)``; raises ``RuntimeError`` for a platform this host lacks. Replaced by the tests."""
    return list(jax.devices(platform))


def preferred_platform() -> str:
    """The platform of ``jax_default_device`` when it is set (a device or a platform name), else the host's."""
    device = jax.config.jax_default_device
    if device is None:
        return _host_platform()
    return device if isinstance(device, str) else device.platform


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """Where a mesh runs, and why there.

    Attributes:
        devices: the mesh's devices, ``needed`` of them, in ``jax.devices(platform)`` order.
        platform: their platform, ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        host_platform: JAX's default backend on this host (``"gpu"`` on a GPU host whose mesh is on CPU).
        host_count: how many devices the default backend has.
        requested: the platform asked for (``--platform``), or None for the default.
        reason: why not the default backend's devices, in words; empty when they are.
    """

    devices: tuple
    platform: str
    host_platform: str
    host_count: int
    requested: str | None = None
    reason: str = ""

    @property
    def count(self) -> int:
        """The number of devices of the mesh."""
        return len(self.devices)

    @property
    def fake(self) -> bool:
        """Whether the devices are fake CPU devices (``jax_num_cpu_devices``): several CPU devices of one host."""
        return self.platform == "cpu" and self.count > 1

    @property
    def single_device(self) -> str:
        """Where a step that runs alone runs: the mesh's platform (the command line sets the default device so)."""
        return f"{self.platform}:0"

    @property
    def device_kind(self) -> str:
        """The devices' kind as JAX names it (``"NVIDIA H200"``, ``"TPU v5p"``, ``"cpu"``)."""
        return str(getattr(self.devices[0], "device_kind", self.platform))

    def why(self) -> str:
        """The reason in words: ``"fake CPU devices; the host's 1 x gpu is too few for data=2,fsdp=4; ..."``; the
        kind of an accelerator (``"NVIDIA H200"``)."""
        parts = ["fake CPU devices"] if self.fake else []
        if self.platform != "cpu":
            parts.append(self.device_kind)
        if self.reason:
            parts.append(self.reason)
        if self.platform != self.host_platform:
            parts.append(f"the single-device steps run on {self.single_device} too")
        return "; ".join(parts)

    def line(self) -> str:
        """One line for a report: ``"devices: 8 x cpu (fake CPU devices; the host's 1 x gpu is too few for
        data=2,fsdp=4; ...)"``."""
        why = self.why()
        return f"devices: {self.count} x {self.platform}" + (f" ({why})" if why else "")

    def to_dict(self) -> dict:
        """The ``--json`` form: ``{"platform", "device_kind", "count", "fake", "host_platform", "host_count",
        "requested", "single_device", "why"}``."""
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "count": self.count,
            "fake": self.fake,
            "host_platform": self.host_platform,
            "host_count": self.host_count,
            "requested": self.requested,
            "single_device": self.single_device,
            "why": self.why(),
        }


FAKE_FIX = (
    "fake {n} CPU devices with jax.config.update('jax_num_cpu_devices', {n}) before JAX starts its backends (the "
    "command line's --devices {n}, the pytest plugin's --shardcheck-devices {n})"
)
"""How to get ``n`` CPU devices, the advice of :func:`select_devices`'s errors (a format string of ``n``)."""


def _spell(flag: str, platform: str) -> str:
    """``platform='cpu'`` (an argument) or ``--platform cpu`` (a flag)."""
    return f"{flag}{platform!r}" if flag.endswith("=") else f"{flag}{platform}"


def _devices_of(fn: str, platform: str, host: str, host_count: int, flag: str) -> list:
    try:
        return _platform_devices(platform)
    except RuntimeError:
        fix = "omit it to use the default" if host != "cpu" else "omit it to run on fake CPU devices"
        raise ValueError(
            f"{fn}: {_spell(flag, platform)}: this host has no {platform} devices (JAX's default backend is "
            f"{host_count} x {host}); {fix}"
        ) from None


def select_devices(
    needed: int,
    *,
    platform: str | None = None,
    what: str | None = None,
    fn: str = "select_devices",
    fake_fix: str = FAKE_FIX,
    platform_flag: str = "platform=",
) -> DeviceChoice:
    """The devices of a mesh of ``needed`` devices: the preferred platform's when it has enough, else CPU devices.

    The preferred platform is ``platform`` when given, else that of ``jax_default_device`` when set, else JAX's
    default backend. Without ``platform``, a backend with too few devices (one GPU, a mesh of 8) gives way to the
    CPU backend's devices, which ``jax_num_cpu_devices`` creates beside the accelerator.

    Args:
        needed: the mesh's device count, an int >= 1.
        platform: ``"cpu"``, ``"gpu"``, ``"tpu"``, or None (the default, with the CPU fallback).
        what: what the devices are for, in words, for the report and errors (default ``"a mesh of N devices"``).
        fn: the function (or command) named in errors.
        fake_fix: how to get ``n`` CPU devices, a format string of ``n`` (:data:`FAKE_FIX`; the command line
            says ``--devices {n}``).
        platform_flag: how the errors spell the platform argument (``"platform="``, ``"--platform "``).

    Returns:
        A :class:`DeviceChoice` of exactly ``needed`` devices.

    Raises:
        ValueError: ``needed`` < 1 or not an int; a ``platform`` outside :data:`PLATFORMS` or absent on this host;
            too few devices on every platform that may be used (the message says what will work).
    """
    if not isinstance(needed, int) or isinstance(needed, bool) or needed < 1:
        raise ValueError(f"{fn}: needed must be an int >= 1 (a mesh's device count), got {needed!r}")
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"{fn}: platform must be one of {', '.join(PLATFORMS)} or None, got {platform!r}")
    what = what or f"a mesh of {needed} devices"
    host = _host_platform()
    host_count = len(_platform_devices(host))
    preferred = platform or preferred_platform()
    devices = _devices_of(fn, preferred, host, host_count, platform_flag)
    on_host = dict(host_platform=host, host_count=host_count, requested=platform)
    if len(devices) >= needed:
        reason = ""
        if preferred != host:
            by = _spell(platform_flag, preferred) if platform else f"jax_default_device is on {preferred}"
            reason = f"{by}; the host's default is {host_count} x {host}"
        return DeviceChoice(tuple(devices[:needed]), preferred, reason=reason, **on_host)
    if preferred != "cpu" and platform is None:
        cpu = _platform_devices("cpu")
        if len(cpu) >= needed:
            reason = f"the host's {len(devices)} x {preferred} is too few for {what}"
            return DeviceChoice(tuple(cpu[:needed]), "cpu", reason=reason, **on_host)
        raise ValueError(
            f"{fn}: {what} needs {needed} devices; the {len(devices)} x {preferred} are too few and "
            f"{len(cpu)} CPU device(s) exist; {fake_fix.format(n=needed)}"
        )
    if preferred == "cpu":
        fix = fake_fix.format(n=needed)
        raise ValueError(
            f"{fn}: {what} needs {needed} devices, but {len(devices)} CPU device(s) exist; {fix}"
        )
    fewer = f", or a mesh of at most {len(devices)} devices" if len(devices) > 1 else ""
    raise ValueError(
        f"{fn}: {what} needs {needed} devices, but the host has {len(devices)} x {preferred}; use "
        f"{_spell(platform_flag, 'cpu')} to run the mesh on {needed} fake CPU devices{fewer}"
    )


def describe(devices) -> str:
    """Devices in words, for a report: ``"1 x cpu"``, ``"8 x cpu"``, ``"1 x gpu (NVIDIA H200)"``; several
    platforms joined with ``" + "`` (largest first)."""
    by_platform: dict[str, list] = {}
    for device in devices:
        by_platform.setdefault(device.platform, []).append(device)
    parts = []
    for platform, group in sorted(by_platform.items(), key=lambda item: -len(item[1])):
        kind = str(getattr(group[0], "device_kind", platform))
        parts.append(f"{len(group)} x {platform}" + (f" ({kind})" if platform != "cpu" else ""))
    return " + ".join(parts)


def use_platform_of(choice: DeviceChoice) -> None:
    """Make the mesh's first device the default device (``jax_default_device``) when the mesh is not on the
    default backend, so a step that runs alone runs beside the mesh, at its precision; a no-op otherwise."""
    if choice.platform != choice.host_platform or choice.platform != preferred_platform():
        jax.config.update("jax_default_device", choice.devices[0])
