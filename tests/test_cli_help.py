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
@pytest.mark.parametrize("command", ["verify", "run", "train", "memory", "launch"])
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
