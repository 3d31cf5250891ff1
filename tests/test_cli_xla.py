"""The command line's XLA:CPU code generation on a CPU-only machine (shardcheck.cli._xla)."""

from __future__ import annotations

import pytest

from shardcheck.cli import _xla
from shardcheck.cli._xla import CPU_COMPILE_FLAGS, use_cpu_compile_flags, with_cpu_compile_flags

ALL_THREE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)


@pytest.fixture(autouse=True)
def checked_jaxlib(monkeypatch):
    """The flags' logic as on the jaxlib they were checked on (0.10.x), whatever jaxlib runs the suite."""
    monkeypatch.setattr(_xla, "CHECKED_JAXLIB", _xla.importlib.metadata.version("jaxlib"))


def test_the_flags_are_added_to_an_empty_xla_flags_in_order():
    assert with_cpu_compile_flags("") == ALL_THREE


def test_a_flag_the_user_set_wins_and_other_flags_stay():
    flags = with_cpu_compile_flags("--xla_cpu_use_fusion_emitters=true --xla_dump_to=/tmp/x")
    assert flags == (
        "--xla_cpu_use_fusion_emitters=true --xla_dump_to=/tmp/x --xla_backend_optimization_level=0 "
        "--xla_cpu_parallel_codegen_split_count=1"
    )
    assert with_cpu_compile_flags(flags) == flags  # idempotent


@pytest.fixture
def before_jax_starts(monkeypatch):
    """As in a fresh ``shardcheck`` process: JAX's backends not started, no accelerator plugin installed."""
    monkeypatch.setattr(_xla, "_backends_started", lambda: False)
    monkeypatch.setattr(_xla.importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(_xla.importlib.util, "find_spec", lambda name: None)


def test_a_cpu_only_run_gets_the_flags(before_jax_starts):
    env = {}
    assert use_cpu_compile_flags(env) is True
    assert env == {"XLA_FLAGS": ALL_THREE}


@pytest.mark.parametrize(
    "env",
    [
        {"SHARDCHECK_XLA_CPU": "default"},
        {"SHARDCHECK_XLA_CPU": " Default "},
        {"JAX_PLATFORMS": "cuda"},
        {"JAX_PLATFORMS": "tpu,cpu"},
    ],
)
def test_xla_defaults_are_kept_when_asked_or_when_an_accelerator_is_requested(before_jax_starts, env):
    before = dict(env)
    assert use_cpu_compile_flags(env) is False
    assert env == before


def test_an_installed_accelerator_plugin_keeps_xla_defaults(before_jax_starts, monkeypatch):
    monkeypatch.setattr(
        _xla.importlib.util, "find_spec", lambda name: object() if name == "jax_plugins" else None
    )
    env = {}
    assert use_cpu_compile_flags(env) is False
    assert env == {}
    assert (
        use_cpu_compile_flags({"JAX_PLATFORMS": "cpu"}) is True
    )  # JAX_PLATFORMS=cpu: the plugin is not used


def test_nothing_changes_once_jax_has_started_its_backends():
    import jax

    jax.devices()  # this test process's backends are up
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert use_cpu_compile_flags(env) is False
    assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}


def test_the_suite_compiles_as_the_command_line_does(monkeypatch):
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.undo()  # the installed jaxlib's own answer: all three on 0.10.x, none on another release
    assert all(f"--{name}={value}" in flags for name, value in _xla.cpu_compile_flags().items())


def test_a_jaxlib_the_flags_were_not_checked_on_keeps_xla_defaults(monkeypatch):
    """XLA ends the process on a flag it does not know, so a jaxlib release the flags were not checked on gets
    none, 0.11.x the two its XLA knows, and the checked one (0.10.x) all three."""
    import importlib.metadata

    from shardcheck.cli import _xla

    monkeypatch.setattr(_xla, "CHECKED_JAXLIB", "0.10.")
    versions = {"jaxlib": "0.12.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    assert _xla.cpu_compile_flags() == {}
    assert with_cpu_compile_flags("--xla_dump_to=/tmp/x") == "--xla_dump_to=/tmp/x"
    versions["jaxlib"] = "0.11.2"  # its XLA ends the process on xla_cpu_use_fusion_emitters: the other two
    assert with_cpu_compile_flags("") == (
        "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
    )
    versions["jaxlib"] = "0.10.2"
    assert _xla.cpu_compile_flags() == CPU_COMPILE_FLAGS
    assert with_cpu_compile_flags("") == ALL_THREE
