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

import pytest

from shardcheck.cli._cache import ENV_CACHE, cache_dir_from_env, default_cache_dir

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
    cache = tmp_path / "c"
    env = cli_env(tmp_path, **{ENV_CACHE: str(cache)})
    first = run_cli("run", "--json", "-", env=env)  # the default main job
    assert first.returncode == 0, first.stderr
    assert "warning" not in first.stderr
    written = sorted(p.name for p in entries(cache))
    assert written, "shardcheck run left the cache folder empty"
    assert all(name.endswith("-cache") for name in written)  # JAX's entries (jit_NAME-KEY-cache)
    assert not (tmp_path / "xdg").exists()  # the variable moved the cache: nothing under XDG_CACHE_HOME
    # Repeated: every step is found in the cache (no new entry) and the report is the same, number for number.
    again = run_cli("run", "--json", "-", env=env)
    assert again.returncode == 0, again.stderr
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
    assert not (tmp_path / "xdg").exists()


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
