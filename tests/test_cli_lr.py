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


TASK_FILE = """
import numpy as np, optax
from flax import nnx
from shardcheck import Task

def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()

x = np.ones((8, 2), np.float32)
task = Task(model=lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.1), loss_fn=loss_fn,
            batches=[{"x": x, "y": x[:, :1]}])
"""


@pytest.mark.parametrize("command", ["run", "verify", "record"])
def test_a_bad_lr_beside_a_task_file_is_told_that_the_file_takes_none(command, tmp_path, capsys):
    """Trial 53: ``verify --task FILE:task --lr -1`` was told "--lr must be a finite positive number ...; pass e.g.
    --lr 0.1", and with 0.1 that a task file takes no --lr: the flag's place is said first, for any value."""
    (tmp_path / "my_task.py").write_text(TASK_FILE)
    out = tmp_path / "run.npz"
    spec = f"{tmp_path}/my_task.py:task"
    for lr in ("-1", "0.1"):
        argv = [command, "--task", spec, f"--lr={lr}"] + (["--out", str(out)] if command == "record" else [])
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert (
            f"--task {spec}: --lr applies to the built-in tasks only; a task file sets its own optimizer"
            in err
        )
        assert "finite positive" not in err and not out.exists()
