"""XLA:CPU code generation for the command line's runs on (fake) CPU devices: compiled for compile time.

A ``shardcheck`` command on a CPU compiles many small programs (the reference step, each strategy's step, the
comparisons) and runs each a few times, so compile time is most of a cold command. XLA:CPU's defaults are tuned
for programs that run long. On a CPU-only machine the command line sets, unless ``XLA_FLAGS`` already names
them:

- ``xla_backend_optimization_level=0``: LLVM at its lowest optimization level;
- ``xla_cpu_use_fusion_emitters=false``: the classic elemental emitters for fusions, not the MLIR ones;
- ``xla_cpu_parallel_codegen_split_count=1``: one LLVM module per program.

None of them changes what an operation computes, only which instructions compute it; the test suite runs under
the same flags (``tests/conftest.py`` reads :data:`CPU_COMPILE_FLAGS`). ``benchmarks/run.py`` measures the cold
commands both ways. A machine with an accelerator plugin installed (CUDA, ROCm, TPU) keeps XLA's defaults, since
``xla_backend_optimization_level`` applies to every backend, and so does any run with
``SHARDCHECK_XLA_CPU=default``.

XLA:CPU runs a program on several CPU devices with one thread of its client's thread pool per device, and sizes
that pool to the larger of the core count and the device count. On a machine with fewer cores than devices, a
program with collectives launched again before its previous launch finished can then leave one device without a
thread: the others wait at the collective until XLA aborts the process (docs/known_issues.md). The command line
gives the pool :data:`THREADS_PER_DEVICE` threads per device (``PJRT_NPROC``, which XLA reads when its CPU
client starts) unless ``PJRT_NPROC`` or ``NPROC`` is already set.

Nothing here imports JAX: the flags must be in the environment before JAX starts its first backend.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import MutableMapping

CPU_COMPILE_FLAGS = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
    "xla_cpu_parallel_codegen_split_count": "1",
}
"""The XLA flags of a CPU-only run, by name (jaxlib 0.10's; XLA refuses a flag it does not know)."""

ENV_XLA_CPU = "SHARDCHECK_XLA_CPU"
"""Environment variable: ``default`` keeps XLA's own code generation on a CPU-only machine."""

_ACCELERATOR_PLATFORMS = ("cuda", "gpu", "rocm", "tpu")


def accelerator_installed(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether JAX may find an accelerator: ``JAX_PLATFORMS`` asks for one, or (unless it says ``cpu``) libtpu or a
    PJRT plugin is installed (``jax_plugins`` entry points or namespace package, as JAX discovers them), except the
    CUDA plugin alone on a machine whose CUDA driver does not load: the ``gpu-aot`` extra on a CPU-only machine,
    which compiles for GPU targets but runs on the CPU (trial 49: it kept the CPU compile flags and the watchdog
    off there)."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if any(p in platforms for p in _ACCELERATOR_PLATFORMS):
        return True
    if platforms.strip() == "cpu":
        return False
    if importlib.util.find_spec("libtpu") is not None:
        return True
    plugins = installed_plugins()
    if plugins and plugins <= CUDA_PLUGINS:
        from shardcheck.gpu_target import cuda_driver_loadable

        return cuda_driver_loadable()
    return bool(plugins)


CUDA_PLUGINS = frozenset({"xla_cuda12", "xla_cuda13", "cuda", "cuda12", "cuda13"})
"""The names JAX's CUDA PJRT plugins register under (``jax_plugins`` entry points and namespace modules)."""


def installed_plugins() -> frozenset[str]:
    """The names of the installed PJRT plugins, as JAX discovers them: ``jax_plugins`` entry points and the
    modules of the ``jax_plugins`` namespace package (found, not imported)."""
    import pkgutil

    names = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        spec = None
    locations = getattr(spec, "submodule_search_locations", None)
    if spec is not None and not locations:  # a jax_plugins whose modules cannot be listed: an unknown plugin
        names.add("jax_plugins")
    if locations:
        names |= {m.name for m in pkgutil.iter_modules(list(locations))}
    return frozenset(names)


def _backends_started() -> bool:
    """Whether JAX has started its backends in this process (without importing JAX when it is not loaded)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bridge.backends_are_initialized()


CHECKED_JAXLIB = "0.10."
"""The jaxlib releases :data:`CPU_COMPILE_FLAGS` were checked on (a version prefix)."""

KNOWN_FLAGS = {"0.11.": ("xla_backend_optimization_level", "xla_cpu_parallel_codegen_split_count")}
"""Later jaxlib releases (version prefix) and the flags of :data:`CPU_COMPILE_FLAGS` their XLA still knows: jaxlib
0.11.2 ends the process on ``xla_cpu_use_fusion_emitters``, and with the other two a cold ``shardcheck verify
--task tiny-lm --devices 8`` took 22.5 s against 44.9 s under XLA's defaults (2 cores, 2026-12-04)."""


def cpu_compile_flags() -> dict[str, str]:
    """:data:`CPU_COMPILE_FLAGS` when the installed jaxlib is one they were checked on (:data:`CHECKED_JAXLIB`),
    those a later release still knows (:data:`KNOWN_FLAGS`), else ``{}`` (XLA's defaults). XLA ends the process on a flag it does not know (status 1; on jaxlib 0.11.2,
    under ``JAX_PLATFORMS=cpu``, the test suite exited so at its first backend, printing nothing), and flags
    come and go between releases."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return {}
    if version.startswith(CHECKED_JAXLIB):
        return dict(CPU_COMPILE_FLAGS)
    known = next((names for prefix, names in KNOWN_FLAGS.items() if version.startswith(prefix)), ())
    return {name: CPU_COMPILE_FLAGS[name] for name in known}


def with_cpu_compile_flags(xla_flags: str) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with every flag of :func:`cpu_compile_flags` it does not name."""
    flags = xla_flags.strip()
    for name, value in cpu_compile_flags().items():
        if name not in flags:
            flags = f"{flags} --{name}={value}".strip()
    return flags


def use_cpu_compile_flags(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Put :data:`CPU_COMPILE_FLAGS` into ``environ["XLA_FLAGS"]`` on a CPU-only machine; returns whether it did.

    Call before JAX initializes a backend (the flags are read once, when the first backend starts). Does nothing
    with ``SHARDCHECK_XLA_CPU=default``, when an accelerator may be present (:func:`accelerator_installed`), or
    once JAX has started its backends in this process.
    """
    if environ.get(ENV_XLA_CPU, "").strip().lower() == "default" or accelerator_installed(environ):
        return False
    if _backends_started():  # called as a library after JAX started: the flags could no longer apply
        return False
    environ["XLA_FLAGS"] = with_cpu_compile_flags(environ.get("XLA_FLAGS", ""))
    return True


THREADS_PER_DEVICE = 4
"""XLA:CPU client threads per (fake) CPU device. Two were enough in the minimal repro of docs/known_issues.md
(3,000 back-to-back launches on 8 devices, where 9 threads hung within 30 launches); four leave a margin."""

ENV_THREADS = ("PJRT_NPROC", "NPROC")
"""The environment variables XLA reads for its CPU client's thread count (``DefaultThreadPoolSize``), in order."""


def cpu_thread_pool_size(num_devices: int, cpu_count: int | None = None) -> int:
    """Threads for XLA:CPU's client with ``num_devices`` CPU devices: ``max(cores, 4 * num_devices)``.

    Raises:
        ValueError: ``num_devices`` < 1.
    """
    if num_devices < 1:
        raise ValueError(f"cpu_thread_pool_size: num_devices={num_devices!r} must be >= 1")
    cores = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    return max(cores, THREADS_PER_DEVICE * num_devices)


def use_cpu_thread_pool(num_devices: int, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``environ["PJRT_NPROC"]`` to :func:`cpu_thread_pool_size` of ``num_devices``; returns whether it did.

    Call before JAX starts its backends (XLA reads the variable when it creates its CPU client). Does nothing
    when ``PJRT_NPROC`` or ``NPROC`` is set (the user's choice), or once JAX has started its backends.
    """
    if any(environ.get(name, "").strip() for name in ENV_THREADS) or _backends_started():
        return False
    environ["PJRT_NPROC"] = str(cpu_thread_pool_size(num_devices))
    return True
