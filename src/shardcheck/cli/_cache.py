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
import secrets
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

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

    Every compiled computation is cached (no minimum compile time or entry size), each entry written whole
    (:func:`whole_cache_entries`: processes sharing the folder never read one half written). Must run before the
    first compilation of the process; it does not start a JAX backend, so ``jax_num_cpu_devices`` can still be
    set afterwards. A folder that cannot be created or written prints one warning line on stderr and the command
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
    whole_cache_entries()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)


def whole_entry_put(put: Callable[[Any, str, bytes], None]) -> Callable[[Any, str, bytes], None]:
    """JAX's ``LRUCache.put`` (``put``), writing each entry whole: into a temporary file beside it, then renamed
    onto the entry's name (``os.replace``, atomic within one file system), with the permissions JAX's own write
    gives (``0o666`` less the umask).

    Without a size limit (``jax_compilation_cache_max_size`` -1, the default) JAX's put takes no lock and writes
    the entry in place (``write_bytes``, jax 0.10.2), so another process reading the same folder (a ``launch``
    worker) can find it half written and load a truncated executable (docs/known_issues.md). With the returned
    put a reader finds no entry or a whole one, and two writers of one entry each rename a whole copy onto it. A
    cache with a size limit (JAX then locks every read and write itself) or in a folder that is not local (a
    ``gs://`` URL) is written by ``put``, as JAX writes it; so is an empty key (JAX's ValueError).
    """

    def put_whole(self, key: str, value: bytes) -> None:
        folder = str(getattr(self, "path", ""))
        if getattr(self, "eviction_enabled", True) or not key or "://" in folder:
            return put(self, key, value)
        entry = Path(folder) / f"{key}{_JAX_ENTRY_SUFFIX}"
        if entry.exists():  # as JAX: an entry already written is kept
            return None
        part = entry.with_name(f".{entry.name}.{secrets.token_hex(8)}.part")
        with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(value)
        os.replace(part, entry)
        return None

    put_whole.whole_entries = True
    return put_whole


_JAX_ENTRY_SUFFIX = "-cache"
"""The suffix of an entry's file name in JAX's cache folder (``jax._src.lru_cache._CACHE_SUFFIX``)."""


def whole_cache_entries() -> bool:
    """Make this process's JAX write its persistent cache's entries whole (:func:`whole_entry_put` in place of
    ``jax._src.lru_cache.LRUCache.put``); the command line calls it when it turns the cache on. Idempotent.

    Returns:
        True when entries are written whole (now or already); False when this JAX's cache is not the one
        described (no ``LRUCache.put``, another entry suffix): its entries are then written as JAX writes them.
    """
    try:
        from jax._src import lru_cache
    except ImportError:
        return False
    cls = getattr(lru_cache, "LRUCache", None)
    put = getattr(cls, "put", None)
    if put is None or getattr(lru_cache, "_CACHE_SUFFIX", None) != _JAX_ENTRY_SUFFIX:
        return False
    if not getattr(put, "whole_entries", False):
        cls.put = whole_entry_put(put)
    return True


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
