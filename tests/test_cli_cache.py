"""The command line's persistent compilation cache (``shardcheck.cli._cache``) and a parser that imports no JAX.

The commands run in subprocesses: the cache is process-wide JAX configuration, which these tests must not turn
on in the test process itself.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardcheck import datasets
from shardcheck.cli._cache import (
    ENV_CACHE,
    cache_dir_from_env,
    dataset_cache_dir,
    default_cache_dir,
    enable_dataset_cache,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "shardcheck"
HEAVY = ("jax", "jaxlib", "flax", "optax")


def entry_point() -> str:
    exe = Path(sys.executable).with_name("shardcheck")
    return str(exe) if exe.exists() else shutil.which("shardcheck")


def cli_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """The test's environment with a private XDG cache home and no cache setting inherited from outside."""
    out = {k: v for k, v in os.environ.items() if k not in (ENV_CACHE, "JAX_COMPILATION_CACHE_DIR")}
    out["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    out.update(env)
    return out


def run_cli(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([entry_point(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def entries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


# ------------------------------------------------------------------------------------------- where the cache is


def test_default_folder_is_under_xdg_cache_home(tmp_path):
    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "shardcheck" / "jax"
    home = Path.home() / ".cache" / "shardcheck" / "jax"
    assert default_cache_dir({}) == home
    assert default_cache_dir({"XDG_CACHE_HOME": ""}) == home
    assert (
        default_cache_dir({"XDG_CACHE_HOME": "relative/dir"}) == home
    )  # the XDG spec ignores relative paths
    assert cache_dir_from_env({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "shardcheck" / "jax"
    assert (
        cache_dir_from_env({"XDG_CACHE_HOME": str(tmp_path), ENV_CACHE: " "})
        == tmp_path / "shardcheck" / "jax"
    )


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "False", "no"])
def test_env_turns_the_cache_off(value):
    assert cache_dir_from_env({ENV_CACHE: value}) is None


def test_env_moves_the_cache(tmp_path, monkeypatch):
    assert cache_dir_from_env({ENV_CACHE: str(tmp_path / "c")}) == tmp_path / "c"
    monkeypatch.chdir(tmp_path)
    assert cache_dir_from_env({ENV_CACHE: "rel/c"}) == tmp_path / "rel" / "c"  # made absolute
    assert cache_dir_from_env({ENV_CACHE: "~/c"}) == Path.home() / "c"


def test_data_sets_are_kept_beside_the_compiled_steps(tmp_path):
    assert dataset_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "shardcheck" / "datasets"
    assert dataset_cache_dir({}) == Path.home() / ".cache" / "shardcheck" / "datasets"
    assert dataset_cache_dir({ENV_CACHE: str(tmp_path / "c")}) == tmp_path / "c" / "datasets"
    assert dataset_cache_dir({ENV_CACHE: "off", "XDG_CACHE_HOME": str(tmp_path)}) is None


def test_help_says_where_the_cache_is_and_how_to_turn_it_off(tmp_path):
    out = run_cli("--help", env=cli_env(tmp_path))
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for words in ("compilation cache", "~/.cache/shardcheck/jax", f"{ENV_CACHE}=off", f"{ENV_CACHE}=DIR"):
        assert words in text
    for command in ("run", "verify", "train", "memory"):
        sub = run_cli(command, "--help", env=cli_env(tmp_path))
        assert sub.returncode == 0, sub.stderr
        assert ENV_CACHE in " ".join(sub.stdout.split()), command
    assert not (tmp_path / "xdg").exists()  # --help compiles nothing and creates no cache folder


# -------------------------------------------------------------------------------------------- the cache at work


def test_run_fills_the_cache_and_a_repeated_run_loads_it(tmp_path):
    import sklearn

    cache = tmp_path / "c"
    env = cli_env(tmp_path, **{ENV_CACHE: str(cache)})
    first = run_cli("run", "--json", "-", env=env)  # the default main job
    assert first.returncode == 0, first.stderr
    assert "warning" not in first.stderr
    written = sorted(p.name for p in entries(cache))
    compiled = [name for name in written if name.endswith("-cache")]  # JAX's entries (jit_NAME-KEY-cache)
    assert compiled, "shardcheck run left the cache folder empty"
    data_copy = f"diabetes-scikit-learn-{sklearn.__version__}.npz"
    assert sorted(set(written) - set(compiled)) == [data_copy]
    assert (cache / "datasets" / data_copy).is_file()
    assert not (tmp_path / "xdg").exists()  # the variable moved the cache: nothing under XDG_CACHE_HOME
    # Repeated: every step is found in the cache (no new entry), the data set is read from its copy without
    # importing scikit-learn, and the report is the same, number for number.
    again = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shardcheck", "run", "--json", "-"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert again.returncode == 0, again.stderr
    imported = {line.split("|")[-1].strip() for line in again.stderr.splitlines() if "|" in line}
    assert "numpy" in imported and not [m for m in imported if m.split(".")[0] in ("sklearn", "scipy")]
    assert sorted(p.name for p in entries(cache)) == written
    assert json.loads(again.stdout) == json.loads(first.stdout)


def test_default_cache_lands_under_xdg_cache_home(tmp_path):
    out = run_cli("run", "--strategy", "baseline", env=cli_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert entries(tmp_path / "xdg" / "shardcheck" / "jax")


def test_cache_off_creates_no_folder(tmp_path):
    out = run_cli("run", "--strategy", "baseline", env=cli_env(tmp_path, **{ENV_CACHE: "off"}))
    assert out.returncode == 0, out.stderr
    assert "baseline" in out.stdout
    assert not (tmp_path / "xdg").exists()  # neither compiled steps nor a copy of the diabetes data


# ------------------------------------------------------------------------------- the copy of the bundled data


@pytest.fixture
def no_copy_after():
    """Leave the process-wide setting of :func:`shardcheck.datasets.use_cache` as the tests found it: off."""
    yield
    datasets.use_cache(None)


def _fields(data: datasets.Dataset) -> tuple:
    return data.name, data.x.dtype, data.y.dtype, data.feature_names, data.target_names


@pytest.mark.parametrize("name", ["diabetes", "linnerud"])
def test_the_copy_equals_the_scikit_learn_load_exactly(name, tmp_path, monkeypatch, no_copy_after):
    import sklearn
    from sklearn import datasets as skd

    datasets.use_cache(None)
    data, target, features, targets = datasets.load_bundled(name)
    standardized, raw = datasets.load_dataset(name), datasets.load_dataset(name, standardize_data=False)
    assert not list(tmp_path.iterdir())
    datasets.use_cache(tmp_path)
    datasets.load_bundled(name)  # the first load asks scikit-learn and writes the copy
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}-scikit-learn-{sklearn.__version__}.npz"]

    def refuse():
        raise AssertionError("scikit-learn's loader was called although the copy exists")

    monkeypatch.setattr(skd, datasets.SKLEARN_LOADERS[name], refuse)
    copy = datasets.load_bundled(name)
    assert copy[2:] == (features, targets)
    for got, want in zip(copy[:2], (data, target), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    for got, want in (
        (datasets.load_dataset(name), standardized),
        (datasets.load_dataset(name, standardize_data=False), raw),
    ):
        assert _fields(got) == _fields(want)
        assert np.array_equal(got.x, want.x) and np.array_equal(got.y, want.y)


def test_cache_off_keeps_no_copy(tmp_path, no_copy_after):
    environ = {ENV_CACHE: "off", "XDG_CACHE_HOME": str(tmp_path)}
    assert enable_dataset_cache(environ) is None
    assert datasets.load_dataset("linnerud").x.shape == (20, 3)
    assert not list(tmp_path.iterdir())


def test_a_damaged_copy_is_replaced(tmp_path, no_copy_after):
    datasets.use_cache(tmp_path)
    _, target, _, names = datasets.load_bundled("linnerud")
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"not an npz")
    assert np.array_equal(datasets.load_bundled("linnerud")[1], target)
    assert datasets.load_bundled("linnerud")[3] == names  # read back from the rewritten copy
    with np.load(path, allow_pickle=False) as f:
        assert np.array_equal(f["target"], target)


def test_a_folder_that_cannot_be_written_only_skips_the_copy(tmp_path, no_copy_after):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    datasets.use_cache(blocker / "datasets")
    assert datasets.load_bundled("linnerud")[3] == ["Weight", "Waist", "Pulse"]
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and blocker.read_text() == "not a folder"


def test_load_bundled_refuses_an_unknown_name():
    with pytest.raises(
        ValueError, match=r"load_bundled: name='iris' .* use one of diabetes, linnerud, digits"
    ):
        datasets.load_bundled("iris")


def test_unusable_cache_folder_warns_once_and_the_command_still_succeeds(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    target = blocker / "c"  # under a file: cannot be created, not even by root
    out = run_cli("run", "--strategy", "baseline", env=cli_env(tmp_path, **{ENV_CACHE: str(target)}))
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, out.stderr
    assert "compilation cache" in warnings[0] and str(target) in warnings[0]
    assert "continuing without it" in warnings[0]
    assert "baseline" in out.stdout
    assert blocker.read_text() == "not a folder" and not (tmp_path / "xdg").exists()


def test_launch_itself_does_not_enable_the_cache(tmp_path):
    """launch only supervises; its workers (shardcheck processes) enable the cache themselves."""
    out = run_cli("launch", "--processes", "1", "--devices-per-process", "1", env=cli_env(tmp_path))
    assert out.returncode == 2  # no subcommand given: refused before any worker starts
    assert not (tmp_path / "xdg").exists()


# ------------------------------------------------------------------------------------------- nothing heavy early


def _imported_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bypassing_package_init(code: str) -> str:
    """``code`` run with ``shardcheck/__init__.py`` (which imports the whole library) replaced by a bare package."""
    return (
        "import types\n"
        f"pkg = types.ModuleType('shardcheck'); pkg.__path__ = [{str(SRC)!r}]; pkg.__version__ = '0'\n"
        "sys.modules['shardcheck'] = pkg\n" + code
    )


def test_cli_plumbing_imports_no_jax():
    """``shardcheck.cli``, its cache and its helpers import no JAX, and the top-level parser loads no subcommand."""
    code = (
        "import shardcheck.cli, shardcheck.cli._cache, shardcheck.cli._common\n"
        "from shardcheck.cli import _command_in, build_parser\n"
        "shardcheck.cli._cache.cache_dir_from_env({})\n"
        "build_parser(_command_in(['--help'])).format_help()\n"
        "assert not [m for m in sys.modules if m.startswith('shardcheck.cli.') and m[15:] in shardcheck.cli.SUMMARIES]"
    )
    assert _imported_after(_bypassing_package_init(code)) == []


def test_command_in_argv():
    from shardcheck.cli import _command_in

    assert _command_in([]) == ()
    assert _command_in(["--help"]) == ()
    assert _command_in(["--version"]) == ()
    assert _command_in(["bogus", "--help"]) == ()
    assert _command_in(["run", "--help"]) == ("run",)
    assert _command_in(["-h", "verify", "--devices", "4"]) == ("verify",)
    assert _command_in(["launch", "--processes", "2", "--", "train"]) == ("launch",)


def test_summaries_are_the_subcommands_own_help():
    """The top-level help lists each subcommand with the one line its own module registers."""
    from shardcheck.cli import SUBCOMMANDS, SUMMARIES, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert tuple(sub.choices) == SUBCOMMANDS
    assert {a.dest: a.help for a in sub._choices_actions} == SUMMARIES
    lazy = build_parser(())
    assert lazy.format_help() == parser.format_help()


def test_help_imports_no_jax():
    """What ``shardcheck --help`` imports, the package ``__init__`` included."""
    code = "from shardcheck.cli import _command_in, build_parser\nbuild_parser(_command_in(['--help'])).format_help()"
    assert _imported_after(code) == []


def test_only_the_cli_process_raises_the_gc_threshold(monkeypatch, capsys):
    import gc

    from shardcheck.cli import CLI_GC_THRESHOLD, main

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults (the suite's conftest runs with the command line's)
    try:
        with pytest.raises(SystemExit):
            main(["--version"])  # a program calling main keeps its own thresholds
        assert gc.get_threshold() == (700, 10, 10)
        monkeypatch.setattr(sys, "argv", ["shardcheck", "--version"])
        with pytest.raises(SystemExit):
            main()  # the shardcheck process itself
        assert gc.get_threshold() == CLI_GC_THRESHOLD
    finally:
        gc.set_threshold(*before)
    assert capsys.readouterr().out.startswith("shardcheck ")


# ------------------------------------------------------------------------------------- entries written whole


@pytest.fixture
def jax_put(monkeypatch):
    """JAX's ``LRUCache`` class, its ``put`` restored after the test (the patch is process-wide)."""
    from jax._src import lru_cache

    monkeypatch.setattr(lru_cache.LRUCache, "put", lru_cache.LRUCache.put)
    return lru_cache.LRUCache


def test_an_entry_is_renamed_into_place_whole_with_the_permissions_jax_gives(tmp_path, jax_put, monkeypatch):
    """Another process reading the folder finds no entry or the whole one: the bytes are written beside it and
    renamed onto its name, never written in place (docs/known_issues.md: a worker read one half written)."""
    from shardcheck.cli._cache import whole_cache_entries

    plain = jax_put(str(tmp_path / "jax"), max_size=-1)
    plain.put("k1", b"x" * 1000)  # JAX's own write, for its permissions
    assert whole_cache_entries()
    wrapped = jax_put.put
    assert getattr(wrapped, "whole_entries", False)
    assert whole_cache_entries() and jax_put.put is wrapped  # idempotent: wrapped once
    renamed = []
    replace = os.replace

    def watched(src, dst):
        src, dst = Path(src), Path(dst)
        renamed.append((src.parent == dst.parent, src.name.startswith(f".{dst.name}."), src.read_bytes()))
        assert not dst.exists()  # nothing stood under the entry's name before the rename
        replace(src, dst)

    monkeypatch.setattr(os, "replace", watched)
    cache = jax_put(str(tmp_path / "ours"), max_size=-1)
    value = bytes(range(256)) * 40
    cache.put("k1", value)
    assert renamed == [(True, True, value)]
    assert cache.get("k1") == value
    cache.put("k1", b"another")  # as JAX: an entry already written is kept
    assert cache.get("k1") == value and len(renamed) == 1
    assert [p.name for p in (tmp_path / "ours").iterdir()] == ["k1-cache"]  # no temporary file left
    mode = (tmp_path / "jax" / "k1-cache").stat().st_mode & 0o777
    assert (tmp_path / "ours" / "k1-cache").stat().st_mode & 0o777 == mode
    with pytest.raises(ValueError, match="key cannot be empty"):  # JAX's own refusal
        cache.put("", value)


def test_a_size_limited_cache_is_left_to_jaxs_locked_writes(tmp_path, jax_put, monkeypatch):
    """A cache with a size limit (``eviction_enabled``: JAX locks its reads and writes, with the ``filelock``
    package) keeps JAX's own write: nothing is renamed. Its lock is stood in for here, so the test needs no
    ``filelock``."""
    from shardcheck.cli._cache import whole_cache_entries

    class Lock:  # the acquire and release JAX calls around a write
        held = 0

        def acquire(self, timeout=None):
            Lock.held += 1

        def release(self):
            Lock.held -= 1

    whole_cache_entries()
    monkeypatch.setattr(os, "replace", lambda *a: pytest.fail("a size-limited cache's entry was renamed"))
    cache = jax_put(str(tmp_path / "limited"), max_size=-1)
    cache.eviction_enabled, cache.max_size, cache.lock_timeout_secs, cache.lock = True, 10_000, 1, Lock()
    cache.put("k2", b"y" * 100)
    assert (tmp_path / "limited" / "k2-cache").read_bytes() == b"y" * 100 and Lock.held == 0
