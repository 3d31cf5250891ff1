"""A bad ``--lr`` is named as the flag it was given as, with a command-line fix, before anything runs (trial 51:
``verify --lr -0.1`` said "pass e.g. lr=0.1", in Python's keyword style; ``run --lr -1`` said "run_strategies: lr
must be ...", wrapped at 80 columns)."""

import pytest

from shardcheck.cli import main

COMMANDS = {
    "run": ["run"],
    "run --task": ["run", "--task", "tiny-lm"],
    "verify": ["verify"],
    "verify --task": ["verify", "--task", "tiny-lm"],
    "record": ["record", "--task", "tiny-lm", "--out", "{out}"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "lr, said",
    [
        ("-0.1", "--lr must be a finite positive number, got -0.1; pass e.g. --lr 0.1"),
        ("0", "--lr must be a finite positive number, got 0.0; pass e.g. --lr 0.1"),
        ("nan", "--lr must be a finite positive number, got nan; pass e.g. --lr 0.1"),
        (
            "1e40",
            "--lr=1e+40 overflows float32 (largest 3.4e+38), where the update is computed; pass e.g. --lr 0.1",
        ),
    ],
)
def test_a_bad_lr_is_named_as_its_flag(command, lr, said, tmp_path, capsys):
    out = tmp_path / "run.npz"
    argv = [a.format(out=out) for a in COMMANDS[command]]
    assert main([*argv, f"--lr={lr}"]) == 2
    err = capsys.readouterr().err
    name = argv[0]
    assert err.strip() == f"error: shardcheck {name}: {said}", err
    assert not out.exists()
