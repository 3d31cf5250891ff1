"""``shardcheck train``: in-process through ``shardcheck.cli.main``, once through the installed entry point."""

import csv
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from conftest import require_devices

from shardcheck.cli import main
from shardcheck.training import step_tolerance

FINAL_KEYS = {
    "train_loss_baseline",
    "train_loss_sharded",
    "test_loss_baseline",
    "test_loss_sharded",
    "max_abs_param_diff",
}


def entry_point() -> str:
    exe = Path(sys.executable).with_name("shardcheck")
    return str(exe) if exe.exists() else shutil.which("shardcheck")


def read_log(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def assert_log_agrees(rows: list[dict], batch_size: int, out_features: int = 1):
    """Every step's two losses agree within that step's tolerance (shardcheck.training.step_tolerance)."""
    for row in rows:
        tol = step_tolerance(batch_size, out_features, int(row["step"]))
        base, sharded = float(row["loss_baseline"]), float(row["loss_sharded"])
        assert abs(sharded - base) <= tol.atol + tol.rtol * abs(base), row


def write_csv(path: Path, x, y, names):
    rows = [",".join(names)] + [",".join(f"{v:.6f}" for v in row) for row in np.hstack([x, y])]
    path.write_text("\n".join(rows) + "\n")


@require_devices(4)
def test_fsdp_adam_on_diabetes_writes_plot_log_and_json(tmp_path, capsys):
    """The done-when command, shortened to 6 epochs."""
    plot, log, out = tmp_path / "loss.png", tmp_path / "steps.csv", tmp_path / "out" / "train.json"
    argv = ["train", "--strategy", "fsdp", "--devices", "4", "--optimizer", "adam", "--epochs", "6"]
    argv += ["--batch-size", "64", "--plot", str(plot), "--log", str(log), "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for word in (
        "baseline (1 device)",
        "fsdp (S=4)",
        "test loss (final)",
        "max drift",
        "first exceeded",
        "never",
    ):
        assert word in text
    report = json.loads(out.read_text())
    assert FINAL_KEYS <= set(report["final"])
    assert (report["strategy"], report["num_shards"], report["optimizer"], report["lr"]) == (
        "fsdp",
        4,
        "adam",
        0.01,
    )
    assert (
        report["num_steps"] == 6 * 5 and report["first_exceeded_step"] is None and report["loss_curves_agree"]
    )
    final, initial = report["final"], report["initial"]
    assert final["test_loss_sharded"] < initial["test_loss_sharded"]
    assert final["test_loss_baseline"] < initial["test_loss_baseline"]
    assert final["test_loss_sharded"] == pytest.approx(final["test_loss_baseline"], rel=1e-5)
    assert final["max_abs_param_diff"] < 1e-5
    assert len(report["history"]) == 7 and report["history"][0]["step"] == 0

    rows = read_log(log)
    assert len(rows) == report["num_steps"]  # one row per step
    assert list(rows[0]) == [
        "step",
        "epoch",
        "loss_baseline",
        "loss_sharded",
        "max_abs_param_diff",
        "max_abs_held_diff",
        "drift_tolerance",
        "drift_exceeded",
    ]
    # the verdict's columns: the held drift within its tolerance on every row of a correct run
    assert all(float(r["max_abs_held_diff"]) <= float(r["drift_tolerance"]) for r in rows)
    assert {r["drift_exceeded"] for r in rows} == {"0"}
    assert [int(r["step"]) for r in rows] == list(range(1, 31))
    assert max(float(r["max_abs_param_diff"]) for r in rows) == pytest.approx(final["max_abs_param_diff"])
    assert_log_agrees(rows, 64)

    assert matplotlib.image.imread(plot).shape == (500, 1300, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "out", "steps.csv"]  # no temp files


def test_csv_made_here_mlp_simulation_json_on_stdout(tmp_path, capsys):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(100, 4))
    y = (x @ np.array([[1.0], [-0.5], [0.0], [2.0]])) ** 2 / 4 + 0.1 * rng.normal(size=(100, 1))
    path = tmp_path / "made.csv"
    write_csv(path, x, y, ["a", "b", "c", "d", "y"])
    log = tmp_path / "log.csv"
    argv = ["train", "--dataset", str(path), "--target", "y", "--features", "a,b,d", "--model", "mlp"]
    argv += [
        "--hidden",
        "16",
        "--strategy",
        "simulation",
        "--devices",
        "4",
        "--epochs",
        "20",
        "--batch-size",
        "16",
    ]
    argv += ["--lr", "0.03", "--seed", "2", "--log", str(log), "--json", "-"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout carries the JSON alone; the table went to stderr
    assert "simulation (S=4)" in captured.err
    assert (report["dataset"], report["in_features"], report["model"], report["num_shards"]) == (
        "made.csv",
        3,
        "mlp",
        4,
    )
    assert report["num_steps"] == 20 * (80 // 16) == len(read_log(log))
    assert report["final"]["test_loss_sharded"] < report["initial"]["test_loss_sharded"]
    assert_log_agrees(read_log(log), 16)


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--dataset", "--target", "--features", "--model", "--hidden", "--strategy", "--devices", "--optimizer",
        "--lr", "--epochs", "--batch-size", "--test-fraction", "--seed", "--plot", "--log", "--json",
    ):  # fmt: skip
        assert flag in text


BAD_FILES = {
    "nonnumeric.csv": ("a,b,y\n1,x,3\n2,3,4\n", "line 2, column 'b': 'x' is not a number"),
    "nan.csv": ("a,b,y\n1,nan,3\n2,3,4\n", "features hold NaN or inf"),
}


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--dataset", "missing.csv"], "file 'missing.csv' does not exist"),
        (["--dataset", "{good}", "--target", "nope"], "unknown target column(s) ['nope']"),
        (["--dataset", "{good}", "--features", "a,zz"], "unknown feature column(s) ['zz']"),
        (
            ["--dataset", "{good}", "--target", "y", "--features", "a,y"],
            "['y'] are listed as features but are also",
        ),
        (["--dataset", "{nonnumeric.csv}"], "'x' is not a number"),
        (["--dataset", "{nan.csv}"], "NaN or inf"),
        (
            ["--dataset", "{good}", "--batch-size", "64"],
            "the training split has 32 rows (40 rows, test_fraction=0.2)",
        ),
        (
            ["--batch-size", "30", "--strategy", "simulation", "--devices", "4"],
            "shardcheck train: --batch-size 30 is not divisible by --devices 4; equal shards are required (valid "
            "--devices for this batch: 1, 2, 3, 5, 6, 10, 15, 30; or use a batch size that is a multiple of 4, "
            "e.g. 24, 28, 32, 36)",
        ),
        (["--epochs", "0"], "--epochs must be an int >= 1, got 0"),
        (["--test-fraction", "1.5"], "--test-fraction must be in (0, 1)"),
    ],
)
def test_data_and_argument_errors_exit_2_and_write_nothing(tmp_path, capsys, args, msg):
    rng = np.random.default_rng(0)
    write_csv(tmp_path / "good.csv", rng.normal(size=(40, 2)), rng.normal(size=(40, 1)), ["a", "b", "y"])
    for name, (content, _) in BAD_FILES.items():
        (tmp_path / name).write_text(content)
    args = [
        str(tmp_path / a.strip("{}").replace("good", "good.csv")) if a.startswith("{") else a for a in args
    ]
    outputs = tmp_path / "out"
    argv = ["train", "--strategy", "simulation", "--epochs", "2", *args]
    argv += [
        "--plot",
        str(outputs / "p.png"),
        "--log",
        str(outputs / "l.csv"),
        "--json",
        str(outputs / "r.json"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err.replace("\n", " ")
    assert not outputs.exists()  # nothing written, not even partially


def test_bad_output_suffix_is_refused_before_training(tmp_path, capsys):
    assert main(["train", "--strategy", "simulation", "--plot", str(tmp_path / "loss.jpg")]) == 2
    assert "--plot" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_through_the_entry_point(tmp_path):
    out = subprocess.run(
        [entry_point(), "train", "--strategy", "dp", "--devices", "2", "--optimizer", "sgd", "--epochs", "3"]
        + ["--batch-size", "32", "--log", str(tmp_path / "log.csv"), "--json", "-"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert FINAL_KEYS <= set(report["final"]) and report["num_shards"] == 2 and report["lr"] == 0.1
    rows = read_log(tmp_path / "log.csv")
    assert len(rows) == report["num_steps"] == 3 * 11
    assert_log_agrees(rows, 32)
    assert "dp (S=2)" in out.stderr  # the table, beside the progress bar, on stderr when --json -


@pytest.mark.multiprocess
@require_devices(4)
def test_under_launch_process_0_alone_reports_the_single_process_result(tmp_path, capsys):
    """2 processes x 2 devices: one JSON document on stdout, one plot, the numbers of the 4-device run."""
    args = ["train", "--strategy", "dp", "--epochs", "2", "--batch-size", "64", "--dataset", "diabetes"]
    assert main([*args, "--devices", "4", "--json", "-"]) == 0
    single = json.loads(capsys.readouterr().out)
    plot = tmp_path / "loss.png"
    out = subprocess.run(
        [entry_point(), "launch", "--processes", "2", "--devices-per-process", "2", "--timeout", "120", "--"]
        + [*args, "--plot", str(plot), "--json", "-"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    launched = json.loads(out.stdout)  # exactly one JSON document: process 1 printed nothing
    assert launched["num_shards"] == single["num_shards"] == 4
    assert launched["num_steps"] == single["num_steps"] == 10
    for key, value in single["final"].items():
        assert launched["final"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert launched["loss_curves_agree"] and launched["first_exceeded_step"] is None
    p1 = [line for line in out.stderr.splitlines() if line.startswith("[p1]")]
    assert not [line for line in p1 if "baseline" in line or "epoch" in line]  # process 1: no table, no bar
    assert "dp (S=4)" in out.stderr  # process 0's table
    assert matplotlib.image.imread(plot).shape == (500, 1300, 4)


# ------------------------------------------------------------------------------------------------ --task

TASK_FILE = """
import numpy as np
import optax
from flax import nnx

import shardcheck


def loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def make():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8, 2)).astype(np.float32)
    batches = [{"x": b, "y": b @ np.array([[1.0], [-2.0]], np.float32)} for b in x]
    return shardcheck.Task(
        model=lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
        optimizer=optax.sgd(0.1),
        loss_fn=loss,
        batches=batches,
        name="made-here",
    )
"""


@require_devices(4)
def test_task_tiny_lm_fsdp_writes_json_log_and_plot(tmp_path, capsys):
    out, log, plot = tmp_path / "out" / "t.json", tmp_path / "t.csv", tmp_path / "t.png"
    argv = ["train", "--task", "tiny-lm", "--devices", "4", "--strategy", "fsdp", "--epochs", "1"]
    assert main([*argv, "--json", str(out), "--log", str(log), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    for word in (
        "--task tiny-lm: fsdp S=4",
        "baseline (1 device)",
        "fsdp (S=4)",
        "loss (final step)",
        "never",
    ):
        assert word in text
    # the placement in words, the JSON's key as it was (trial 53: gspmd's read "state placement: fsdp")
    assert "state placement: split by the model's annotations, else over the fsdp axis" in " ".join(
        text.split()
    )
    report = json.loads(out.read_text())
    assert (report["task"], report["strategy"], report["num_shards"], report["placement"]) == (
        "tiny-lm",
        "fsdp",
        4,
        "fsdp",
    )
    assert (report["epochs"], report["steps_per_epoch"], report["num_steps"], report["batch_size"]) == (
        1,
        5,
        5,
        16,
    )
    assert report["loss_curves_agree"] is True and report["first_exceeded_step"] is None
    final, initial = report["final"], report["initial"]
    assert final["loss_sharded"] == pytest.approx(final["loss_baseline"], rel=1e-5)
    assert final["loss_baseline"] < initial["loss_baseline"]  # 5 Adam steps learn something
    assert final["max_abs_param_diff"] == max(s["max_abs_param_diff"] for s in report["steps"])
    assert [s["step"] for s in report["steps"]] == [1, 2, 3, 4, 5]
    assert not any(s["drift_exceeded"] for s in report["steps"])
    assert all(s["max_abs_held_diff"] <= s["drift_tolerance"] for s in report["steps"])
    assert all(s["rounding_level_elements"] > 0 for s in report["steps"])  # the key biases, left out
    rows = read_log(log)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert float(rows[-1]["loss_sharded"]) == pytest.approx(final["loss_sharded"], rel=1e-8)
    assert_log_agrees(rows, 16 * 32)  # the tolerance of n = B*T = 512 reduced terms
    assert matplotlib.image.imread(plot).shape == (500, 1300, 4)


def test_task_file_with_steps_and_epochs_json_on_stdout(tmp_path, capsys):
    (tmp_path / "my_task.py").write_text(TASK_FILE)
    argv = [
        "train",
        "--task",
        f"{tmp_path / 'my_task.py'}:make",
        "--strategy",
        "simulation",
        "--devices",
        "2",
    ]
    assert main([*argv, "--epochs", "2", "--steps", "2", "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "simulation (S=2)" in captured.err
    assert (report["task"], report["steps_per_epoch"], report["num_steps"], report["batch_size"]) == (
        "made-here",
        2,
        4,
        8,
    )
    assert [(s["epoch"], s["step"]) for s in report["steps"]] == [(1, 1), (1, 2), (2, 3), (2, 4)]
    # epoch 2 replays the same two batches from trained parameters
    assert report["steps"][2]["loss_baseline"] < report["steps"][0]["loss_baseline"]
    assert report["loss_curves_agree"] and report["final"]["max_abs_param_diff"] < 1e-6


@pytest.mark.parametrize(
    "args,msg",
    [
        (
            ["--task", "nope"],
            "load_task: 'nope' is not a built-in task; built-in tasks: diabetes, linnerud, digits",
        ),
        (["--task", "tiny_lm"], "did you mean 'tiny-lm'?"),
        (["--task", "{dir}/missing.py:task"], "missing.py' (spec"),
        (["--task", "{dir}/my_task.py:nothing"], "has no attribute 'nothing'"),
        (["--task", "{dir}/my_task.py:make", "--lr", "0.1"], "--lr applies to the built-in tasks only"),
        (["--task", "{dir}/my_task.py:make", "--steps", "9"], "--steps 9 but task 'made-here' holds only 3"),
        (["--task", "digits", "--features", "a"], "--features applies without --task only"),
        (["--task", "digits", "--test-fraction", "0.3"], "--test-fraction applies without --task only"),
        (
            ["--task", "digits", "--batch-size", "30", "--devices", "4"],
            "shardcheck train: batch size 30 (batch leaf 'label') is not divisible by --devices 4; equal shards",
        ),
        (
            ["--task", "digits", "--batch-size", "30", "--mesh", "data=4", "--strategy", "dp"],
            "batch size 30 (batch leaf 'label') is not divisible by the 4 devices of --mesh data=4; equal shards",
        ),
        (["--task", "digits", "--steps", "0"], "--steps must be an int >= 1, got 0"),
        (["--steps", "3"], "--steps applies with --task only"),
        (
            ["--task", "digits", "--strategy", "multiprocess"],
            "strategy 'multiprocess' needs several JAX processes",
        ),
    ],
)
def test_task_errors_exit_2_and_write_nothing(tmp_path, capsys, args, msg):
    (tmp_path / "my_task.py").write_text(TASK_FILE)
    args = [a.replace("{dir}", str(tmp_path)) for a in args]
    outputs = tmp_path / "out"
    argv = ["train", "--strategy", "simulation", "--epochs", "1", *args]
    argv += [
        "--json",
        str(outputs / "r.json"),
        "--log",
        str(outputs / "l.csv"),
        "--plot",
        str(outputs / "p.png"),
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.replace("\n", " ")
    assert msg in err and err.count("error:") == 1
    assert captured.out == ""  # refused before the progress bar started
    assert not outputs.exists()


def test_help_offers_the_registry_strategies_and_task(capsys):
    from shardcheck.steps import STRATEGIES

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--task" in text and "--steps" in text
    trainable = [name for name in STRATEGIES if name != "reference"]
    assert "{" + ",".join(trainable) + "}" in text  # --strategy's choices: the registry's, in its order


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--clip-norm", "0.01"], "--clip-norm"),
        (["--warmup-steps", "3"], "--warmup-steps"),
        (["--schedule", "cosine"], "--schedule"),
        (["--optimizer", "adamw", "--weight-decay", "0.5"], "--weight-decay"),
    ],
)
def test_optimizer_flags_without_a_task_are_refused_not_ignored(flags, flag, capsys):
    """Trial 57: without --task, train ran the seeds' regression step with the plain optimizer and ignored these
    flags (the final loss equal to the last bit, exit 0). They are refused before any step (exit 2), naming the
    built-in task that takes them; with --task diabetes the flag takes effect (another loss than without it)."""
    base = ["train", "--strategy", "simulation", "--devices", "2", "--epochs", "2", "--optimizer", "sgd"]
    assert main([*base, *flags]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(
        f"error: shardcheck train: {flag} applies with --task only (it configures the task's optimizer); without "
        "--task, train runs the seeds' regression step with --optimizer and --lr alone: pass --task diabetes (or "
        f"linnerud, the built-in data sets as tasks) with {flag}, or drop it"
    ), err
    if flag != "--clip-norm":
        return
    losses = []
    for extra in ([], flags):
        assert main([*base, "--task", "diabetes", *extra, "--json", "-"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["final"]["loss_baseline"])
    assert losses[0] != losses[1]


@pytest.mark.parametrize("task", [None, "diabetes"])
def test_a_diverging_baseline_stops_the_run_and_says_so(task, tmp_path, capsys):
    """Trial 57: --lr 1e6 took the baseline to NaN; the report said "drift exceeded tolerance first at step 6"
    (exit 0) with numpy warnings. Now the run stops at the first non-finite baseline step: exit 2, one line naming
    it with the optimizer, the learning rate and the fix, nothing written, no warning; a finite run is unchanged."""
    argv = ["train", "--strategy", "simulation", "--devices", "2", "--epochs", "2", "--optimizer", "sgd"]
    argv += [] if task is None else ["--task", task]
    log = tmp_path / "log.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail the test
        assert main([*argv, "--lr", "1e6", "--log", str(log)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "error: shardcheck train: the single-device baseline diverged (a non-finite loss or parameters at step "
        in err
    )
    assert (
        "with --optimizer sgd --lr 1e+06; no verdict about the sharded run, and nothing written; lower --lr (default 0.1)"
        in err
    )
    assert not log.exists()
    assert main([*argv, "--lr", "0.01", "--log", str(log)]) == 0 and log.exists()
