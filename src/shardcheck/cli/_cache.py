"""The command line's caches: a repeated command loads its compiled steps and its bundled data set.

JAX's persistent compilation cache lives in ``$XDG_CACHE_HOME/shardcheck/jax`` (``~/.cache/shardcheck/jax``
when ``XDG_CACHE_HOME`` is unset), the copies of scikit-learn's bundled data sets
(:func:`shardcheck.datasets.use_cache`) beside it in ``.../shardcheck/datasets``. ``SHARDCHECK_COMPILATION_CACHE``
moves both (a folder ``DIR``: compiled steps in ``DIR``, data sets in ``DIR/datasets``) or turns both off
(``off``, ``0``, ``false``, ``no``). Without that variable a cache folder already given to JAX itself
(``JAX_COMPILATION_CACHE_DIR``, or ``jax_compilation_cache_dir`` set by a program that calls
:func:`shardcheck.cli.main`) is kept as it is.

Nothing here imports JAX until :func:`enable_compilation_cache` runs, so building the parser stays cheap.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ENV_CACHE = "SHARDCHECK_COMPILATION_CACHE"
"""Environment variable: a folder for the caches, or ``off`` / ``0`` / ``false`` / ``no`` to turn them off."""

OFF_VALUES = frozenset({"off", "0", "false", "no"})

HELP = (
    f"Compiled steps are kept in JAX's persistent compilation cache, so a repeated run, verify, train or memory "
    f"--measure skips compilation: the cache lives in $XDG_CACHE_HOME/shardcheck/jax (default "
    f"~/.cache/shardcheck/jax), with a copy of the bundled scikit-learn data beside it (shardcheck/datasets); "
    f"set {ENV_CACHE}=off to turn both off, or {ENV_CACHE}=DIR to move them."
)
"""One paragraph for ``--help``."""


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/shardcheck/jax``; ``~/.cache/shardcheck/jax`` when ``XDG_CACHE_HOME`` is unset or empty.

    A relative ``XDG_CACHE_HOME`` is ignored, as the XDG base directory specification asks.
    """
    xdg = environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "shardcheck" / "jax"


def cache_dir_from_env(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The folder ``SHARDCHECK_COMPILATION_CACHE`` asks for: None when it turns the cache off.

    Unset or empty: :func:`default_cache_dir`. A path (``~`` expanded) is made absolute.
    """
    value = environ.get(ENV_CACHE, "").strip()
    if value.lower() in OFF_VALUES:
        return None
    if not value:
        return default_cache_dir(environ)
    return Path(value).expanduser().absolute()


def _writable_folder(path: Path) -> None:
    """Create ``path`` (and its parents) and check a file can be created in it; raises OSError otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass


def enable_compilation_cache(environ: Mapping[str, str] = os.environ) -> str | None:
    """Point JAX's persistent compilation cache at the command line's cache folder; returns it, or None if off.

    Every compiled computation is cached (no minimum compile time or entry size). Must run before the first
    compilation of the process; it does not start a JAX backend, so ``jax_num_cpu_devices`` can still be set
    afterwards. A folder that cannot be created or written prints one warning line on stderr and the command
    goes on without the cache. Without ``SHARDCHECK_COMPILATION_CACHE``, a cache folder JAX was already given
    (``JAX_COMPILATION_CACHE_DIR``) is used as it is, with JAX's own thresholds.
    """
    path = cache_dir_from_env(environ)
    if path is None:
        return None
    import jax

    if not environ.get(ENV_CACHE, "").strip():
        configured = jax.config.jax_compilation_cache_dir
        if configured:  # the user (or the calling program) chose JAX's cache folder: leave it alone
            return str(configured)
    try:
        _writable_folder(path)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        print(
            f"shardcheck: warning: compilation cache {path} cannot be used ({reason}); continuing without it "
            f"(set {ENV_CACHE}=DIR to move it, or =off)",
            file=sys.stderr,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)


def dataset_cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The folder of the bundled data sets' copies; None when ``SHARDCHECK_COMPILATION_CACHE`` turns it off.

    Unset or empty: ``$XDG_CACHE_HOME/shardcheck/datasets``, beside :func:`default_cache_dir`; a folder ``DIR``:
    ``DIR/datasets``.
    """
    if not environ.get(ENV_CACHE, "").strip():
        return default_cache_dir(environ).with_name("datasets")
    path = cache_dir_from_env(environ)
    return None if path is None else path / "datasets"


def enable_dataset_cache(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Keep copies of the bundled data sets in :func:`dataset_cache_dir` (:func:`shardcheck.datasets.use_cache`).

    Returns the folder, or None when the cache is off. Nothing is written until a bundled data set is loaded; a
    folder that cannot be written means scikit-learn is asked each time, without a warning (the compilation
    cache already warns about its folder).
    """
    from shardcheck import datasets

    path = dataset_cache_dir(environ)
    datasets.use_cache(path)
    return path
