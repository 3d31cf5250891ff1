"""A subcommand's ``--help`` imports no JAX, and still offers every registered strategy.

The parsers read the strategy and optimizer names from :mod:`shardcheck._catalog`, which the registry builds on;
the import checks run in subprocesses, since this test process has JAX loaded already (tests/conftest.py).
"""

import json
import subprocess
import sys

import pytest

from shardcheck.cli import main

HEAVY = ("jax", "jaxlib", "flax", "optax")


def _heavy_after_help(command: str) -> list[str]:
    probe = (
        "import json, sys\n"
        "from shardcheck.cli import main\n"
        "try:\n"
        f"    main([{command!r}, '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# memory's parser reads its layouts from shardcheck.partitioning, which imports jax.sharding at its top.
@pytest.mark.parametrize("command", ["verify", "run", "train", "memory", "launch", "record"])
def test_subcommand_help_imports_no_jax(command):
    assert _heavy_after_help(command) == []


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare word sequences


def test_help_lists_every_registered_strategy(capsys):
    from shardcheck import runner
    from shardcheck.steps import STRATEGIES

    compared = [name for name in STRATEGIES if name != "reference"]
    assert f"comma-separated strategies from {', '.join(compared)};" in _help(capsys, "verify")
    assert "{" + ",".join(compared) + "}" in _help(capsys, "train")  # train --strategy's choices
    text = _help(capsys, "run")
    assert "{" + ",".join(["all", "baseline", *STRATEGIES]) + "}" in text  # run --strategy's choices
    assert f"({', '.join(STRATEGIES)})" in text
    # The seed form named in --help (from the catalog) is the one run computes (from the built steps).
    assert f"which computation(s) to run: {', '.join(runner.xy_strategies())} without --task" in text


def test_catalog_is_the_registry_without_its_steps():
    from shardcheck import _catalog, optimizers
    from shardcheck.steps import CANDIDATES, STRATEGIES

    specs = [(s.name, s.summary, s.placement, s.uses_mesh) for s in _catalog.STRATEGY_SPECS.values()]
    assert specs == [(s.name, s.summary, s.placement, s.uses_mesh) for s in STRATEGIES.values()]
    assert _catalog.CANDIDATES == CANDIDATES
    assert _catalog.OPTIMIZERS == optimizers.OPTIMIZERS


def test_catalog_names_the_default_and_the_xla_partitioned_strategies():
    from shardcheck import _catalog
    from shardcheck.partitioning import LAYOUTS
    from shardcheck.steps import STRATEGIES

    assert _catalog.DEFAULT_STRATEGY == "fsdp" and STRATEGIES["fsdp"].placement == "fsdp"
    assert _catalog.xla_partitioned() == ("gspmd",)
    assert all(STRATEGIES[n].uses_mesh and not STRATEGIES[n].explicit_collectives for n in ("gspmd",))
    assert not {layout.strategy for layout in LAYOUTS.values()} & set(_catalog.xla_partitioned())


def test_memory_help_and_refusal_name_the_mesh_only_strategies_from_the_catalog(capsys):
    text = _help(capsys, "memory")
    assert "{all,replicated,dp,zero1,zero2,fsdp,gspmd}" in text  # the layouts, then the mesh-only strategies
    assert "(default: all; with --mesh: fsdp; gspmd only with --mesh)" in text


def test_the_command_line_names_no_strategy_literally():
    """Strategy names live in the registry and the JAX-free catalog: no module of the command line holds one as a
    string (docstrings aside), so a strategy added to the registry reaches every subcommand."""
    import ast
    import pathlib

    from shardcheck import _catalog, cli
    from shardcheck.partitioning import LAYOUTS

    names = set(_catalog.STRATEGY_SPECS) | set(LAYOUTS)
    found = []
    for path in sorted(pathlib.Path(cli.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and ast.get_docstring(node) is not None
        }
        found += [
            f"{path.name}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
        ]
    assert found == []


@pytest.mark.parametrize(
    "argv, said",
    [
        (["verify", "--tsk", "tiny-lm"], "unrecognized arguments: --tsk tiny-lm; did you mean --task?"),
        (
            ["verify", "--task", "tiny-lm", "--stratgies=dp", "--mech", "fsdp=4"],
            "unrecognized arguments: --stratgies=dp --mech fsdp=4; did you mean --strategies or --mesh?",
        ),
        (["train", "--zzz"], "unrecognized arguments: --zzz"),
        (
            ["train", "--task", "tiny-lm", "--candidate", "steps.py:step"],
            "unrecognized arguments: --candidate steps.py:step; --candidate is an option of shardcheck record "
            "and verify, not of train",
        ),
    ],
)
def test_a_misspelt_option_is_told_the_subcommands_closest(argv, said, capsys):
    """Trial 51: ``--tsk`` got argparse's "unrecognized arguments" alone (it suggests only from Python 3.14);
    trial 53: below the top-level usage, not the subcommand's; trial 61: another subcommand's option
    (``train --candidate``) was asked "did you mean --dataset?"."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"shardcheck {argv[0]}: error: {said}"
    assert lines[0].startswith(f"usage: shardcheck {argv[0]} [-h]"), lines[0]
