"""One import path per public name; every other path goes through the one deprecation table.

The canonical paths (``shardcheck.X`` for the names of ``shardcheck.__all__``, else the defining module) import
without any warning; each deprecated path of :data:`shardcheck._deprecations.MOVED` warns with a
``DeprecationWarning`` naming the old path, the new one and the release that removes it, at the caller's line,
and gives the canonical object itself. The project's own code, tests, examples and docs use no deprecated path.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

import shardcheck
from shardcheck import _deprecations
from shardcheck._deprecations import MOVED, REMOVED_IN

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "shardcheck"
ALIAS_MODULES = tuple(m for m in MOVED if m not in ("shardcheck", "shardcheck.parity", "shardcheck.training"))
OLD_PATHS = [(module, name) for module, names in MOVED.items() for name in names]
# The files that use old paths on purpose: this one, the seeds' adapters' test of the aliases, and the import
# rules' planted sources (text only, never imported).
USES_OLD_PATHS = {"tests/test_deprecations.py", "tests/test_seed_adapters.py", "tests/test_import_rules.py"}


def _canonical(path: str):
    """The object at a dotted path, imported with every warning an error (a canonical path never warns)."""
    where, _, attr = path.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return getattr(importlib.import_module(where), attr)


def test_every_canonical_name_imports_without_a_warning():
    """In a fresh interpreter, every name of ``shardcheck.__all__`` and every module of the package but the
    alias modules import with all warnings errors."""
    modules = sorted(
        ".".join(("shardcheck", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
    )
    modules = [m for m in modules if m not in ALIAS_MODULES and m not in ("shardcheck.__main__",)]
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error')\n"
        "import shardcheck\n"
        "values = [getattr(shardcheck, n) for n in shardcheck.__all__]\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(len(values))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_cpu_env(), check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == len(shardcheck.__all__)


def _cpu_env():
    import os

    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_the_top_level_lists_each_name_once_and_no_deprecated_name():
    assert len(set(shardcheck.__all__)) == len(shardcheck.__all__)
    assert not set(MOVED["shardcheck"]) & set(shardcheck.__all__)
    assert not set(MOVED["shardcheck"]) & set(dir(shardcheck))
    # the pairs: the name the README and the seeds use stays; the other is deprecated
    assert {"train", "sgd_step", "fsdp_step"} <= set(shardcheck.__all__)
    assert set(MOVED["shardcheck"]) == {"train_task", "reference_step", "fsdp_sgd_step"}


@pytest.mark.parametrize(("module", "name"), OLD_PATHS, ids=[f"{m}.{n}" for m, n in OLD_PATHS])
def test_a_deprecated_path_warns_and_gives_the_canonical_object(module, name):
    new = MOVED[module][name]
    where, _, attr = new.rpartition(".")
    want = _canonical(new)
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(mod, name)
    assert value is want
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"{module}.{name} is deprecated and will be removed in shardcheck 0.2.0; use {new} "
        f"(from {where} import {attr})"
    )
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert REMOVED_IN == "0.2.0"


def test_a_from_import_of_an_old_path_warns_at_the_import():
    with pytest.warns(DeprecationWarning, match=r"^shardcheck\.spmd\.make_mesh is deprecated") as caught:
        from shardcheck.spmd import make_mesh
    assert make_mesh is shardcheck.make_mesh
    assert caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"use shardcheck\.check_parity \(from shardcheck import"):
        from shardcheck.parity import check_parity
    assert check_parity is shardcheck.check_parity


def test_the_table_points_only_at_canonical_paths():
    """No target is itself deprecated (a chain would warn twice), and every target exists."""
    for module, names in MOVED.items():
        for name, new in names.items():
            where, _, attr = new.rpartition(".")
            assert attr not in MOVED.get(where, {}), f"{module}.{name} -> {new}, itself deprecated"
            assert where not in ALIAS_MODULES
            _canonical(new)


@pytest.mark.parametrize("module", sorted(MOVED))
def test_an_unknown_name_is_still_an_attribute_error(module):
    mod = importlib.import_module(module)
    with pytest.raises(AttributeError, match=f"module '{re.escape(module)}' has no attribute 'no_such_name'"):
        mod.no_such_name  # noqa: B018


def test_an_alias_module_lists_its_old_names():
    from shardcheck import reductions

    assert dir(reductions) == ["tree_mean", "tree_sum"]


def test_module_getattr_refuses_a_module_without_deprecated_names():
    with pytest.raises(ValueError, match="module_getattr: module='shardcheck.task' has no deprecated names"):
        _deprecations.module_getattr("shardcheck.task")


# ------------------------------------------------------------------ the project itself uses canonical paths


def _old_uses_in_python(source: str) -> list[str]:
    """Old paths ``source`` names: ``from M import N`` / ``import M`` / ``M.N`` for an entry of the table, also
    in a string constant that is Python source itself (a test writes a candidate module from one)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "shardcheck" in node.value:
            try:
                found += _old_uses_in_python(textwrap.dedent(node.value))
            except SyntaxError:
                pass
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module in ALIAS_MODULES or f"{node.module}.{alias.name}" in ALIAS_MODULES:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif alias.name in MOVED.get(node.module, {}):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in ALIAS_MODULES]
        elif isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if node.attr in MOVED.get(owner, {}) or owner in ALIAS_MODULES:
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


_OLD_IN_TEXT = re.compile(
    r"\bshardcheck\.(?:(?:"
    + "|".join(re.escape(m.removeprefix("shardcheck.")) for m in ALIAS_MODULES)
    + r")\.\w+|(?:"
    + "|".join(MOVED["shardcheck"])
    + r")\b|parity\.(?:check_parity|assert_step_parity)\b)"
)


def _project_files(suffix: str) -> list[pathlib.Path]:
    folders = ("src", "tests", "examples", "benchmarks", "docs")
    files = [p for f in folders for p in (ROOT / f).rglob(f"*{suffix}")]
    return sorted(p for p in files if p.relative_to(ROOT).as_posix() not in USES_OLD_PATHS)


def test_the_project_imports_every_name_from_its_canonical_path():
    found = []
    for path in _project_files(".py"):
        if path.relative_to(ROOT).as_posix().startswith("src/shardcheck/_deprecations"):
            continue
        found += [f"{path.relative_to(ROOT)}:{line}" for line in _old_uses_in_python(path.read_text())]
    for path in [*_project_files(".md"), ROOT / "README.md"]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "deprecated" in line:
                continue
            found += [f"{path.relative_to(ROOT)}:{i}: {m}" for m in _OLD_IN_TEXT.findall(line)]
    assert found == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from shardcheck.spmd import make_mesh\n", ["1: from shardcheck.spmd import make_mesh"]),
        ("from shardcheck import spmd\n", ["1: from shardcheck import spmd"]),
        (
            "from shardcheck.parity import ParityError, check_parity\n",
            ["1: from shardcheck.parity import check_parity"],
        ),
        ("import shardcheck\nshardcheck.reference_step\n", ["2: shardcheck.reference_step"]),
        ("from shardcheck import check_parity, make_mesh\nfrom shardcheck.seeds import fsdp_sgd_step\n", []),
        (
            'STEPS = """\n    from shardcheck.baseline import sgd_step\n"""\n',
            ["2: from shardcheck.baseline import sgd_step"],
        ),
    ],
)
def test_the_scan_finds_a_planted_old_path(source, expected):
    assert _old_uses_in_python(source) == expected
