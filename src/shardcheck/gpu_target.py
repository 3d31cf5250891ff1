"""Compile for a named GPU without one: XLA:GPU's own memory figures from a CPU-only machine (deviceless).

With the jax CUDA plugin installed (``pip install "shardcheck[gpu-aot]"``: ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` of the jaxlib in use), ``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=<text proto>, topology="1x1xN")`` describes N compile-only devices of that GPU: a mesh of them
(``topologies.make_mesh``) takes ``jax.ShapeDtypeStruct`` inputs, and ``jit(...).lower(...).compile()`` runs
XLA:GPU's whole pipeline (fusion, scheduling, buffer assignment) for the target, without a GPU or a CUDA driver.
Nothing can run on those devices; ``memory_analysis()`` gives the GPU's own figures.

The targets are text protos of XLA's ``stream_executor.GpuTargetConfigProto``, shipped in
``shardcheck/gpu_targets/`` (:data:`GPU_TARGETS`); each was written from the card's public specification, and
names its sources in a comment.

Measured (tiny-lm 350m, batch 3 x 2048, Adam, one device; jax 0.10.2 with the 0.10.2 plugin): the deviceless
compile for ``h200`` gives a peak of 56,983,531,212 B, the card's own compile on an H200 56,987,433,420 B
(0.007% apart); XLA:CPU's compile of the same step gives 80,546,861,492 B (:data:`RECORDED_CPU_OVER_GPU`).
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from collections.abc import Mapping, MutableMapping

GPU_TARGETS = ("h100", "h200", "a100-80gb", "a100-40gb", "l4")
"""The GPUs shardcheck can compile for without one; each is ``gpu_targets/<name>.txtpb`` and a key of
:data:`shardcheck.device_memory.DEVICE_KINDS`."""

PLUGIN_MODULE = "jax_plugins.xla_cuda12"
"""The module of the jax CUDA plugin (``jax-cuda12-plugin``), whose PJRT library compiles for a target config."""

GPU_AOT_PIN = "0.10.2"
"""The plugin version the ``gpu-aot`` extra pins (pyproject's optional dependencies): the jaxlib CI tests."""

EXTRA = "shardcheck[gpu-aot]"
"""The install that brings the plugin, pinned to the jaxlib shardcheck supports (pyproject's optional deps)."""

RECORDED_CPU_OVER_GPU = (
    (
        "tiny-lm 350m, batch 3 x 2048, Adam, one device, H200 (jax 0.10.2 / 0.11.2)",
        80_546_861_492,
        56_987_433_420,
    ),
)
"""Recorded cases of XLA:CPU's peak against XLA:GPU's for the same step: ``(case, cpu_peak_bytes,
gpu_peak_bytes)``; the GPU figure is the card's own compile (``shared/GPU.md``)."""


def plugin_installed() -> bool:
    """Whether the jax CUDA plugin is importable (without importing it or JAX)."""
    try:
        return importlib.util.find_spec(PLUGIN_MODULE) is not None
    except (ImportError, ValueError):
        return False


def target_config(kind: str) -> str:
    """The text proto (``GpuTargetConfigProto``) of a named GPU: ``target_config("h200")``.

    Raises:
        ValueError: ``kind`` is not one of :data:`GPU_TARGETS` (the message lists them).
    """
    key = str(kind).strip().lower().replace("_", "-")
    if key not in GPU_TARGETS:
        raise ValueError(
            f"target_config: kind={kind!r} is not a GPU shardcheck can compile for; use one of "
            f"{', '.join(GPU_TARGETS)}"
        )
    return importlib.resources.files("shardcheck").joinpath("gpu_targets", f"{key}.txtpb").read_text()


def cpu_figure_note() -> str:
    """The plain statement printed beside an XLA:CPU figure when no deviceless GPU compile was possible."""
    case, cpu, gpu = RECORDED_CPU_OVER_GPU[0]
    return (
        f"this figure is XLA:CPU's, not the GPU's: on the recorded case ({case}) XLA:CPU's peak was "
        f"{cpu / gpu:.2f}x XLA:GPU's ({cpu:,} B against {gpu:,} B), mostly temporaries; {install_hint()} "
        "(the jax CUDA plugin of the jaxlib in use) for XLA:GPU's own figure, compiled without a GPU"
    )


def install_hint() -> str:
    """How to install the jax CUDA plugin of the installed jaxlib: ``pip install 'shardcheck[gpu-aot]'`` on the
    jaxlib the extra pins (:data:`GPU_AOT_PIN`), else the plugin wheels of that jaxlib's version (the extra's
    would not load)."""
    from importlib import metadata

    jaxlib = metadata.version("jaxlib")
    return f"pip install {EXTRA!r}" if jaxlib == GPU_AOT_PIN else _pip_install(jaxlib)


def prepare_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Let the CUDA plugin register on a machine without CUDA; call before JAX starts its backends.

    The plugin checks the CUDA runtime's version when JAX starts it, and without CUDA it refuses to register (it
    logs a traceback), so no target can be described. ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` skips that check:
    the plugin registers, JAX starts the CPU backend as usual, and the compile-only GPU devices exist. Does
    nothing when the variable is set already or when ``JAX_PLATFORMS`` names the platforms without CUDA
    (the plugin then skips the check itself).
    """
    environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


CUDA_DRIVER = "libcuda.so.1"
"""The CUDA driver library; a machine where it cannot be loaded has no GPU the CUDA plugin could use."""


def cuda_driver_loadable() -> bool:
    """Whether the CUDA driver (:data:`CUDA_DRIVER`) loads in this process (on a GPU host the plugin loads it
    anyway); False on a CPU-only machine."""
    import ctypes

    try:
        ctypes.CDLL(CUDA_DRIVER)
    except OSError:
        return False
    return True


def quiet_without_cuda(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Keep the CUDA plugin's start-up traceback off a CPU-only machine; call before JAX starts its backends.

    With the plugin installed (``shardcheck[gpu-aot]``) and no CUDA driver, JAX's plugin discovery logs ~25
    lines ("Jax plugin configuration error ... Unable to load CUDA. Is it installed?") in every process. Here
    :func:`prepare_environment` runs instead: the plugin registers without its CUDA version check, finds no
    device, and JAX's default backend stays ``cpu``, as without the plugin. On a GPU host (the driver loads),
    with ``JAX_PLATFORMS`` set, or without the plugin nothing changes: the plugin still checks CUDA's versions
    and the GPU is JAX's default backend.

    Returns:
        Whether the environment was prepared (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` set when it was not).
    """
    if environ.get("JAX_PLATFORMS", "").strip() or not plugin_installed() or cuda_driver_loadable():
        return False
    prepare_environment(environ)
    return True


def plugin_version() -> str | None:
    """The installed ``jax-cuda12-plugin``'s version (from its metadata: nothing imported), or None."""
    from importlib import metadata

    try:
        return metadata.version("jax-cuda12-plugin")
    except metadata.PackageNotFoundError:
        return None


def _pip_install(version: str) -> str:
    return f'pip install "jax-cuda12-plugin=={version}" "jax-cuda12-pjrt=={version}"'


def unavailable_reason(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a deviceless GPU compile cannot run in this process, or None when it can: the plugin installed, at the
    jaxlib's own version (the plugin's PJRT library must be built with the jaxlib that loads it; pip does not
    check it, since the plugin does not name jaxlib among its requirements)."""
    from importlib import metadata

    jaxlib = metadata.version("jaxlib")
    if not plugin_installed():
        return f"the jax CUDA plugin is not installed ({install_hint()})"
    plugin = plugin_version()
    if plugin is not None and plugin != jaxlib:
        return f"the jax CUDA plugin is {plugin} but jaxlib is {jaxlib}; install the same version: {_pip_install(jaxlib)}"
    return None


def target_mesh(kind: str, axes: Mapping[str, int]):
    """A mesh of compile-only devices of the GPU ``kind``, shaped ``axes`` (``{"fsdp": 8}``).

    The devices are those of ``jax.experimental.topologies.get_topology_desc(platform="cuda",
    target_config=target_config(kind), topology=f"1x1x{n}")`` (one slice, one host, ``n = prod(axes)`` GPUs),
    arranged by ``topologies.make_mesh``. A step lowered on them with ``jax.ShapeDtypeStruct`` arguments compiles
    with XLA:GPU for that GPU; nothing runs.

    Args:
        kind: one of :data:`GPU_TARGETS`.
        axes: axis name -> size, each >= 1.

    Returns:
        A ``jax.sharding.Mesh`` whose devices have platform ``"gpu"`` and the target's ``device_kind``.

    Raises:
        ValueError: an unknown kind; the plugin not installed (the message says how to install it); the plugin
            refusing the topology (the message quotes it).
    """
    import math

    text = target_config(kind)
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"target_mesh: cannot compile for {kind} without a GPU: {reason}")
    import jax
    from jax.experimental import topologies

    # A compile-only executable cannot be loaded back from JAX's persistent cache (the plugin's compiler has no
    # client to load it into: a warning, then a recompile), so the cache is off for the rest of this process.
    jax.config.update("jax_enable_compilation_cache", False)

    n = math.prod(int(v) for v in axes.values())
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=text, topology=f"1x1x{n}")
    except (NotImplementedError, RuntimeError) as err:
        raise ValueError(
            f"target_mesh: the CUDA plugin did not describe {n} x {kind} ({err}); was JAX started before "
            "shardcheck.gpu_target.prepare_environment() ran, without CUDA on this machine?"
        ) from err
    return topologies.make_mesh(topology, tuple(int(v) for v in axes.values()), tuple(axes))
