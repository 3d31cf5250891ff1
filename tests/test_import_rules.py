"""The package's import rules, read from the source with ``ast`` (nothing is imported, so a rule also holds for
imports inside functions and for modules that need JAX).

- ``steps/`` (how each strategy's step is built) imports nothing from the layers that use it: the parity
  harness, memory, the runner, the training loop, the built-in tasks or the command line.
- ``launcher`` (the multi-process launch) imports nothing from the command line; the subcommands' names come
  from the JAX-free catalog.
- No module of the engine imports the seeds' adapters (``shardcheck.seeds``, nor their deprecated alias
  ``shardcheck.parity.legacy``): they sit on top of it. An import by name (``importlib.import_module("...")``)
  counts as an import; the one exception is named in ``DEPRECATED_ALIASES``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "shardcheck"

# (modules a rule applies to, modules they must not import); a name covers its submodules.
RULES = (
    (
        ("shardcheck.steps",),
        (
            "shardcheck.parity",
            "shardcheck.memory",
            "shardcheck.ahead_of_time",
            "shardcheck.runner",
            "shardcheck.training",
            "shardcheck.tasks",
            "shardcheck.cli",
        ),
    ),
    (("shardcheck.launcher",), ("shardcheck.cli",)),
)
# The seeds' adapters, their deprecated module aliases, the command line and the packages' lazy re-exports sit
# above the engine; every other module is the engine and must not import the adapters.
ABOVE_THE_ENGINE = (
    "shardcheck",
    "shardcheck.parity",
    "shardcheck.seeds",
    "shardcheck.cli",
    "shardcheck.spmd",
    "shardcheck.baseline",
    "shardcheck.simulation",
    "shardcheck.accumulation",
    "shardcheck.reductions",
    "shardcheck.parity.legacy",
    "shardcheck.__main__",
)
# Packages above the engine only as themselves (their lazy re-exports), not with their modules.
PACKAGE_FACES = ("shardcheck", "shardcheck.parity")
# What the engine must not import: the seeds' adapters and their alias in the parity package.
ADAPTERS = ("shardcheck.seeds", "shardcheck.parity.legacy")
# Engine modules that keep a moved seeds' name importable for one release, resolved by name on first use (PEP
# 562 ``__getattr__``): the module and the one adapter module it may name. Nothing of the engine runs through it.
DEPRECATED_ALIASES = {"shardcheck.training": "shardcheck.seeds.training"}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: pathlib.Path) -> str:
    """``src/shardcheck/steps/sharded.py`` -> ``shardcheck.steps.sharded``; a package's ``__init__`` -> its name."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(module: str, source: str, *, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, anywhere in it, as absolute dotted names.

    ``from a.b import c`` counts as ``a.b`` and ``a.b.c`` (``c`` may be a submodule); relative imports are
    resolved against ``module``'s package.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif _imports_by_name(node):
            names.add(node.args[0].value)
    return names


def _imports_by_name(node: ast.AST) -> bool:
    """``importlib.import_module("a.b")`` / ``import_module("a.b")`` / ``__import__("a.b")`` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    return (
        called in ("import_module", "__import__")
        and isinstance(first, ast.Constant)
        and isinstance(first.value, str)
    )


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """The broken rules of one module, as ``"importer imports forbidden"`` lines."""
    found = []
    names = imported(module, source, is_package=is_package)
    for importers, forbidden in RULES:
        if any(_within(module, m) for m in importers):
            found += [f"{module} imports {n}" for n in sorted(names) if any(_within(n, f) for f in forbidden)]
    if not any(module == m or _within(module, m) and m not in PACKAGE_FACES for m in ABOVE_THE_ENGINE):
        allowed = DEPRECATED_ALIASES.get(module)
        found += [
            f"{module} imports {n}"
            for n in sorted(names)
            if any(_within(n, a) for a in ADAPTERS) and not (allowed and _within(n, allowed))
        ]
    return found


def _package_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_keeps_its_import_rules():
    broken = []
    for path in _package_modules():
        broken += violations(module_name(path), path.read_text(), is_package=path.name == "__init__.py")
    assert broken == []


def test_the_rules_read_every_module_of_the_package():
    names = {module_name(p) for p in _package_modules()}
    assert {"shardcheck.steps.sharded", "shardcheck.launcher", "shardcheck.parity.harness.check"} <= names


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        # a planted forbidden import at the top, inside a function, and relative
        (
            "shardcheck.steps.sharded",
            "from shardcheck.parity.comparison import live\n",
            [
                "shardcheck.steps.sharded imports shardcheck.parity.comparison",
                "shardcheck.steps.sharded imports shardcheck.parity.comparison.live",
            ],
        ),
        (
            "shardcheck.steps.registry",
            "def f():\n    import shardcheck.cli.verify\n",
            ["shardcheck.steps.registry imports shardcheck.cli.verify"],
        ),
        (
            "shardcheck.steps.registry",
            "from ..memory import estimate_memory\n",
            [
                "shardcheck.steps.registry imports shardcheck.memory",
                "shardcheck.steps.registry imports shardcheck.memory.estimate_memory",
            ],
        ),
        (
            "shardcheck.launcher",
            "def f():\n    from shardcheck.cli import SUBCOMMANDS\n",
            [
                "shardcheck.launcher imports shardcheck.cli",
                "shardcheck.launcher imports shardcheck.cli.SUBCOMMANDS",
            ],
        ),
        (
            "shardcheck.parity.harness.check",
            "from shardcheck.seeds import fsdp_step\n",
            [
                "shardcheck.parity.harness.check imports shardcheck.seeds",
                "shardcheck.parity.harness.check imports shardcheck.seeds.fsdp_step",
            ],
        ),
        (
            "shardcheck.parity.harness.check",
            "from shardcheck.parity import compare, legacy\n",
            ["shardcheck.parity.harness.check imports shardcheck.parity.legacy"],
        ),
        (
            "shardcheck.parity.comparison.live",
            "def f():\n    from shardcheck.seeds.parity import regression_task\n",
            [
                "shardcheck.parity.comparison.live imports shardcheck.seeds.parity",
                "shardcheck.parity.comparison.live imports shardcheck.seeds.parity.regression_task",
            ],
        ),
        # an import by name is an import; the training module's alias names its one adapter module only
        (
            "shardcheck.runner",
            "def f():\n    return importlib.import_module('shardcheck.seeds.training')\n",
            ["shardcheck.runner imports shardcheck.seeds.training"],
        ),
        (
            "shardcheck.training",
            "def __getattr__(name):\n    return __import__('shardcheck.seeds.parity')\n",
            ["shardcheck.training imports shardcheck.seeds.parity"],
        ),
        (
            "shardcheck.training",
            "from shardcheck.seeds import train\n",
            [
                "shardcheck.training imports shardcheck.seeds",
                "shardcheck.training imports shardcheck.seeds.train",
            ],
        ),
    ],
)
def test_a_planted_forbidden_import_is_caught(module, source, expected):
    assert violations(module, source) == expected


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (
            "shardcheck.steps.sharded",
            "from shardcheck.task import divide\nfrom shardcheck.mesh import fsdp_axis\n",
        ),
        ("shardcheck.launcher", "from shardcheck._catalog import SUBCOMMANDS\n"),
        ("shardcheck.seeds.baseline", "from shardcheck.steps import STRATEGIES\n"),
        ("shardcheck.cli.run", "from shardcheck.seeds import fsdp_step\n"),
        ("shardcheck.spmd", "from shardcheck.seeds.mesh_steps import fsdp_sgd_step\n"),
        ("shardcheck.parity", "from shardcheck.seeds import parity as adapter\n"),
        ("shardcheck.parity.legacy", "from shardcheck.seeds.parity import regression_task\n"),
        (
            "shardcheck.training",
            "def __getattr__(name):\n    return importlib.import_module('shardcheck.seeds.training')\n",
        ),
    ],
)
def test_an_allowed_import_passes(module, source):
    assert violations(module, source) == []


def test_a_relative_import_resolves_against_the_package():
    assert imported("shardcheck.steps", "from . import sharded\n", is_package=True) == {
        "shardcheck.steps",
        "shardcheck.steps.sharded",
    }
    assert "shardcheck.parity" in imported("shardcheck.steps.sharded", "from ..parity import x\n")
