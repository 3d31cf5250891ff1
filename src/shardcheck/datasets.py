"""Real data for the main job: scikit-learn's bundled regression sets (no download), CSV and NPZ files.

Importing scikit-learn's loaders costs about a second (they import SciPy). After :func:`use_cache` (the
command line calls it), the arrays scikit-learn returns are kept in an ``.npz`` file named after the data set
and the installed scikit-learn version, and a later process reads that file instead of importing scikit-learn.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from shardcheck._io import write_atomic

BUNDLED = ("diabetes", "linnerud")
SKLEARN_LOADERS = {"diabetes": "load_diabetes", "linnerud": "load_linnerud", "digits": "load_digits"}
"""The scikit-learn data sets :func:`load_bundled` reads, each with its ``sklearn.datasets`` loader."""

_cache_dir: Path | None = None  # set by use_cache; None: scikit-learn is asked every time


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A regression data set, as float32 NumPy arrays.

    Attributes:
        name: ``"diabetes"``, ``"linnerud"`` or the file's name.
        x: ``(N, D)`` float32 features.
        y: ``(N, K)`` float32 targets.
        feature_names: D column names.
        target_names: K column names.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    feature_names: tuple[str, ...]
    target_names: tuple[str, ...]


def use_cache(folder: str | os.PathLike | None) -> None:
    """Keep a copy of each bundled data set :func:`load_bundled` reads in ``folder``; ``None`` keeps none.

    The setting is process-wide, like JAX's compilation cache folder: the ``shardcheck`` subcommands call it
    once at start (with :func:`shardcheck.cli._cache.dataset_cache_dir`); a program that never calls it keeps
    no copy and writes nothing. The folder is created with the first copy; a folder that cannot be written
    only means that scikit-learn is asked each time.
    """
    global _cache_dir
    _cache_dir = None if folder is None else Path(folder)


def _sklearn_version() -> str | None:
    from importlib import metadata  # JAX has imported it already: no cost on the command line

    try:
        return metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        return None


def _read_copy(path: Path) -> tuple[np.ndarray, np.ndarray, list[str], list[str]] | None:
    """The arrays of a copy :func:`_write_copy` wrote; None when it is missing, unreadable or incomplete."""
    try:
        with np.load(path, allow_pickle=False) as f:
            data, target = f["data"], f["target"]
            names = [str(n) for n in f["feature_names"]], [str(n) for n in f["target_names"]]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if data.ndim != 2 or target.ndim not in (1, 2) or len(target) != len(data):
        return None
    return data, target, *names


def _write_copy(path: Path, data, target, feature_names, target_names) -> None:
    """Write the copy whole (temp file, then rename); a folder that cannot be written is skipped silently."""
    buffer = io.BytesIO()
    names = {
        "feature_names": np.array(feature_names, dtype=str),
        "target_names": np.array(target_names, dtype=str),
    }
    np.savez(buffer, data=data, target=target, **names)
    try:
        write_atomic(path, buffer.getvalue())
    except OSError:
        pass


def load_bundled(name: str) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """A bundled scikit-learn data set as its ``sklearn.datasets`` loader returns it (no download).

    After :func:`use_cache` the arrays come from ``<folder>/<name>-scikit-learn-<version>.npz`` when that file
    exists, without importing scikit-learn. The file is written on the first load, so it holds the loader's
    arrays bit for bit; another scikit-learn version reads and writes its own file.

    Args:
        name: a key of :data:`SKLEARN_LOADERS` (``"diabetes"``, ``"linnerud"``, ``"digits"``).

    Returns:
        ``(data, target, feature_names, target_names)``: ``data`` ``(N, D)`` and ``target`` ``(N,)`` or
        ``(N, K)`` in the loader's dtypes (float64; int64 digit labels), the names as lists of strings
        (``target_names`` empty when the loader has none).

    Raises:
        ValueError: ``name`` is not one of them.
    """
    if name not in SKLEARN_LOADERS:
        raise ValueError(
            f"load_bundled: name={name!r} is not a bundled scikit-learn data set; use one of "
            f"{', '.join(SKLEARN_LOADERS)}"
        )
    version = _sklearn_version() if _cache_dir is not None else None
    path = None if version is None else _cache_dir / f"{name}-scikit-learn-{version}.npz"
    copy = None if path is None else _read_copy(path)
    if copy is not None:
        return copy
    from sklearn import datasets as skd

    bunch = getattr(skd, SKLEARN_LOADERS[name])()
    loaded = (
        bunch.data,
        bunch.target,
        [str(n) for n in bunch.feature_names],
        [str(n) for n in getattr(bunch, "target_names", ())],
    )
    if path is not None:
        _write_copy(path, *loaded)
    return loaded


def standardize(a: np.ndarray) -> np.ndarray:
    """Zero mean, unit variance per column (float64 arithmetic, float32 result); constant columns stay zero."""
    a = np.asarray(a, dtype=np.float64)
    std = a.std(axis=0)
    return ((a - a.mean(axis=0)) / np.where(std > 0, std, 1.0)).astype(np.float32)


def _targets(fn: str, target, columns: Sequence[str]) -> list[str]:
    if target is None:
        return [columns[-1]]
    names = [t.strip() for t in target.split(",")] if isinstance(target, str) else list(target)
    if not names or any(not n for n in names):
        raise ValueError(f"{fn}: target={target!r} names no column; pass e.g. target='y' or 'y1,y2'")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{fn}: target column(s) {dup} listed twice; name each target once")
    unknown = [n for n in names if n not in columns]
    if unknown:
        raise ValueError(f"{fn}: unknown target column(s) {unknown}; the file has columns {list(columns)}")
    if len(names) == len(columns):
        raise ValueError(f"{fn}: every column is a target; leave at least one feature column")
    return names


def _load_csv(fn: str, path: Path, target) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{fn}: {path.name} is not UTF-8 text (byte {err.start}: {err.reason}); save it as a UTF-8 CSV"
        ) from None
    rows = [r for r in rows if any(c.strip() for c in r)]
    if len(rows) < 2:
        raise ValueError(
            f"{fn}: {path.name} needs a header row and at least one data row, got {len(rows)} row(s)"
        )
    header = [c.strip() for c in rows[0]]
    if len(set(header)) != len(header):
        raise ValueError(f"{fn}: {path.name} has duplicate column names in its header {header}")
    values = np.empty((len(rows) - 1, len(header)), dtype=np.float64)
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ValueError(
                f"{fn}: {path.name} line {i} has {len(row)} fields, the header has {len(header)}"
            )
        for j, cell in enumerate(row):
            try:
                values[i - 2, j] = float(cell)
            except ValueError:
                raise ValueError(
                    f"{fn}: {path.name} line {i}, column {header[j]!r}: {cell!r} is not a number; every column must "
                    "be numeric"
                ) from None
    targets = _targets(fn, target, header)
    features = [c for c in header if c not in targets]
    x = values[:, [header.index(c) for c in features]]
    y = values[:, [header.index(c) for c in targets]]
    return x, y, features, targets


def _load_npz(fn: str, path: Path, target) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    if target is not None:
        raise ValueError(
            f"{fn}: target= applies to CSV files; an NPZ file holds its targets in the array 'y'"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("x", "y") if k not in data.files]
            if missing:
                raise ValueError(
                    f"{fn}: {path.name} lacks array(s) {missing}; it must hold arrays 'x' and 'y'"
                )
            x, y = data["x"], data["y"]
    except ValueError as err:
        if str(err).startswith(fn):
            raise
        raise ValueError(
            f"{fn}: {path.name} is not a readable NPZ of numeric arrays (it is not an .npz archive, or holds "
            "object arrays, which are never unpickled); save it with np.savez(path, x=..., y=...)"
        ) from None
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{fn}: {path.name} is not a readable NPZ file ({err})") from None
    for name, a in (("x", x), ("y", y)):
        if a.dtype.kind not in "iuf":
            raise ValueError(f"{fn}: {path.name} array {name!r} has dtype {a.dtype}; it must be numeric")
    y = y[:, None] if y.ndim == 1 else y
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{fn}: {path.name} must hold x of shape (N, D) and y of shape (N, K) or (N,), got {x.shape} and "
            f"{y.shape}"
        )
    return x, y, [f"x{i}" for i in range(x.shape[1])], [f"y{i}" for i in range(y.shape[1])]


def load_dataset(source: str = "diabetes", *, target=None, standardize_data: bool = True) -> Dataset:
    """Load a regression data set as float32 arrays, standardized per column by default.

    Sources: ``"diabetes"`` (scikit-learn's bundled diabetes data, 442 x 10 -> 1), ``"linnerud"`` (20 x 3 -> 3),
    a ``.csv`` file (a header row, numeric columns; ``target`` names the target columns, comma-separated, default
    the last column) or a ``.npz`` file (arrays ``x (N, D)`` and ``y (N, K)`` or ``(N,)``, read with
    ``allow_pickle=False``). Nothing is downloaded.

    Args:
        source: a bundled name or a file path.
        target: CSV target column name(s): a comma-separated string or a sequence.
        standardize_data: standardize features and targets to zero mean and unit variance.

    Returns:
        A :class:`Dataset`.

    Raises:
        ValueError: unknown name, missing file, unknown or duplicated target column, non-numeric value, NaN or
            inf, wrong array shapes, too few rows.
    """
    fn = "load_dataset"
    if source in BUNDLED:
        if target is not None:
            raise ValueError(f"{fn}: target= applies to CSV files, not to the bundled {source!r} data")
        x, y, features, targets = load_bundled(source)
        y = y[:, None] if y.ndim == 1 else y
        if len(targets) != y.shape[1]:
            targets = ["target"]
        name = source
    else:
        path = Path(source)
        if path.suffix.lower() not in (".csv", ".npz"):
            raise ValueError(
                f"{fn}: source={source!r} is neither a bundled data set ({', '.join(BUNDLED)}) nor a .csv / .npz "
                "file"
            )
        if not path.is_file():
            raise ValueError(f"{fn}: file {source!r} does not exist")
        loader = _load_csv if path.suffix.lower() == ".csv" else _load_npz
        x, y, features, targets = loader(fn, path, target)
        name = path.name
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    for label, a in (("features", x), ("targets", y)):
        if not np.isfinite(a).all():
            bad = np.argwhere(~np.isfinite(a))[0]
            raise ValueError(
                f"{fn}: {name} {label} hold NaN or inf (first at row {bad[0]}); clean the data first"
            )
    if x.shape[0] < 1:
        raise ValueError(f"{fn}: {name} has no rows")
    if x.shape[1] < 1 or y.shape[1] < 1:
        raise ValueError(
            f"{fn}: {name} has {x.shape[1]} feature and {y.shape[1]} target column(s); at least one of each is "
            "needed"
        )
    if standardize_data:
        with np.errstate(over="ignore", invalid="ignore"):
            stats_finite = all(np.isfinite([a.mean(axis=0), a.std(axis=0)]).all() for a in (x, y))
        if not stats_finite:
            raise ValueError(
                f"{fn}: {name} holds values too large to standardize in float64 (a column's mean or variance "
                "overflows); rescale the data"
            )
        x, y = standardize(x), standardize(y)
    return Dataset(name, x.astype(np.float32), y.astype(np.float32), tuple(features), tuple(targets))


def minibatch_indices(num_rows: int, batch_size: int, *, seed: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """Endless ``(epoch, indices)`` of full mini-batches: a fresh permutation each epoch, the last partial dropped.

    One ``np.random.default_rng(seed)`` draws every epoch's permutation, so the order is reproducible and the same
    in every process of a multi-process run. ``shardcheck train`` and ``shardcheck verify`` both draw their
    batches here; take as many as needed with ``itertools.islice``.

    Args:
        num_rows: N >= ``batch_size``.
        batch_size: B >= 1.
        seed: the generator's seed.

    Yields:
        ``(epoch, idx)``: the 1-based epoch and ``(B,)`` int64 row indices.

    Raises:
        ValueError: ``batch_size`` < 1 or larger than ``num_rows`` (raised on the first ``next``).
    """
    if not 1 <= batch_size <= num_rows:
        raise ValueError(
            f"minibatch_indices: batch_size must be in [1, {num_rows}] (the data has {num_rows} rows), "
            f"got {batch_size}"
        )
    rng = np.random.default_rng(seed)
    epoch = 0
    while True:
        epoch += 1
        perm = rng.permutation(num_rows)
        for i in range(num_rows // batch_size):
            yield epoch, perm[i * batch_size : (i + 1) * batch_size]
