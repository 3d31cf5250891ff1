"""``shardcheck verify``: exit codes, JSON, user candidates (a planted wrong step fails with its diagnosis)."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kinked
import pytest
from conftest import require_devices

from shardcheck.cli import main

WRONG_STEP = textwrap.dedent(
    """
    import jax
    import numpy as np
    from flax import nnx

    from shardcheck import mse_loss


    def summed_step(model, optimizer, x, y):
        # a sum over 4 shards where a mean was meant
        xs, ys = np.split(np.asarray(x), 4), np.split(np.asarray(y), 4)
        pairs = [nnx.value_and_grad(mse_loss)(model, a, b) for a, b in zip(xs, ys)]
        optimizer.update(model, jax.tree.map(lambda *g: sum(g), *[g for _, g in pairs]))
        return np.mean([loss for loss, _ in pairs])


    def mesh_step(model, optimizer, x, y, mesh):
        from shardcheck import data_parallel_sgd_step

        return data_parallel_sgd_step(model, optimizer, x, y, mesh)


    def three_args(model, optimizer, x):
        return None


    def raises(model, optimizer, x, y):
        raise ValueError("planted failure")


    def garbage(model, optimizer, x, y):
        from shardcheck import sgd_step

        sgd_step(model, optimizer, x, y)
        return "not a loss"
    """
)


def entry_point() -> str:
    exe = Path(sys.executable).with_name("shardcheck")
    return str(exe) if exe.exists() else shutil.which("shardcheck")


@pytest.fixture
def steps_file(tmp_path):
    path = tmp_path / "my_steps.py"
    path.write_text(WRONG_STEP)
    return path


@require_devices(8)
def test_done_when_adam_20_steps_on_diabetes_passes_every_strategy(tmp_path, capsys):
    out = tmp_path / "verify.json"
    args = ["verify", "--devices", "8", "--optimizer", "adam", "--steps", "20", "--batch-size", "64"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["num_shards"] == 8 and report["steps"] == 20
    assert report["dataset"] == "diabetes" and report["optimizer"] == "adam" and report["lr"] == 0.01
    assert set(report["strategies"]) == {"simulation", "dp", "fsdp", "gspmd", "accumulation"}
    for name, r in report["strategies"].items():
        assert r["ok"] is True, name
        assert r["worst_leaf"] and r["max_abs_err"] < r["tolerance"] / 8, name
        assert r["diagnosis"].startswith("Parity holds"), name
        assert r["step_count"] == 20 and r["candidate_step_count"] == 20, name
    table = capsys.readouterr().out
    for word in (
        "shardcheck verify simulation: PASS",
        "shardcheck verify: summary",
        "worst leaf",
        "allowed abs err",
    ):
        assert word in table
    # a PASS says what it would have caught, as the report's own text and the JSON's scale_evidence say it
    evidence = report["strategies"]["dp"]["scale_evidence"]
    assert evidence == "a gradient x8 or x1/8 would have failed 2 leaves at step 0 (grad bias, grad kernel)."
    assert f"evidence: {evidence}" in " ".join(table.split())


@require_devices(4)
def test_planted_wrong_candidate_fails_with_its_diagnosis(steps_file, tmp_path, capsys):
    out = tmp_path / "verify.json"
    args = ["verify", "--devices", "4", "--strategies", "simulation", "--steps", "3", "--batch-size", "16"]
    code = main([*args, "--candidate", f"{steps_file}:summed_step", "--json", str(out)])
    assert code == 1
    report = json.loads(out.read_text())
    assert report["ok"] is False
    assert report["strategies"]["simulation"]["ok"] is True
    bad = report["strategies"]["candidate"]
    assert bad["ok"] is False and bad["codes"][0] == "summed"
    assert "summed instead of averaged (x4" in bad["diagnosis"]
    assert bad["worst_leaf"] and bad["max_abs_err"] > bad["tolerance"]
    assert bad["worst_by_kind"]["param"]["ok"] is False and bad["worst_by_kind"]["loss"]["step"] > 0
    printed = capsys.readouterr().out
    out = " ".join(printed.split())
    assert "shardcheck verify candidate: FAIL" in out
    # the cause first, each finding on its own line under its code, then the localization (trial 53: line 17 of 22)
    candidate = printed[printed.index("shardcheck verify candidate: FAIL") :]
    tagged = [line for line in candidate.splitlines() if line.startswith("[")]
    assert tagged[0].startswith("[summed] At step 0, ") and tagged[1].startswith(
        "[localization] First difference"
    )
    assert (
        bad["diagnosis"].startswith("At step 0, ") and " Localization: First difference" in bad["diagnosis"]
    )
    # the JSON names the summary's leaf too (trial 36: the text's first failing leaf, the JSON's worst overall)
    assert bad["first_failing_step"] == 0 and f"{bad['first_failing_leaf']} (step 0)" in out
    # and its numbers, the summary row's (trial 40: they differed from max_abs_err, the worst over every step)
    assert bad["first_failing_max_abs_err"] > bad["first_failing_tolerance"] > 0
    assert f"{bad['first_failing_max_abs_err']:.3g}" in out
    assert report["strategies"]["simulation"]["first_failing_leaf"] is None


@require_devices(2)
def test_candidate_module_with_a_mesh_argument_passes(steps_file, monkeypatch, capsys):
    monkeypatch.chdir(steps_file.parent)
    args = ["verify", "--devices", "2", "--strategies", "none", "--steps", "2", "--batch-size", "8"]
    assert main([*args, "--candidate", "my_steps:mesh_step", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)  # --json - : stdout carries the JSON alone
    assert list(report["strategies"]) == ["candidate"] and report["strategies"]["candidate"]["ok"] is True


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (
            ["--batch-size", "10", "--devices", "4"],
            "shardcheck verify: batch size 10 is not divisible by --devices 4; equal shards are required (valid "
            "--devices for this batch: 1, 2, 5, 10; pass --batch-size with a multiple of 4, e.g. --batch-size 12)",
        ),
        (
            ["--task", "tiny-lm", "--mesh", "data=3"],
            "shardcheck verify: batch size 8 is not divisible by the 3 devices of --mesh data=3; equal shards are "
            "required (valid batch-shard counts (the product of the sizes of --mesh's batch axes, data and fsdp) "
            "for this batch: 1, 2, 4, 8; pass --batch-size with a multiple of 3, e.g. --batch-size 9)",
        ),
        (
            ["--batch-size", "4", "--devices", "8"],
            "shardcheck verify: --devices 8 is more shards than examples (batch size 4); every shard needs at "
            "least one example: use --devices <= 4",
        ),
        (["--strategies", "simulation,zero"], "unknown ['zero']"),
        (["--strategies", "none"], "--strategies none needs --candidate"),
        (["--steps", "0"], "--steps must be a positive int"),
        (["--batch-size", "1000"], "batch_size=1000 is larger than the data's 442 rows"),
        (["--candidate", "nocolon"], "must be MODULE:FUNC or PATH.py:FUNC"),
        (
            ["--candidate", "missing_file.py:step"],
            "candidate file 'missing_file.py' (spec 'missing_file.py:step') does not exist",
        ),
        (
            ["--candidate", "no_such_module_xyz:step"],
            "module 'no_such_module_xyz' (spec 'no_such_module_xyz:step') is not importable",
        ),
        (["--dataset", "nope"], "neither a bundled data set"),
        (["--lr", "-1"], "lr must be a finite positive number"),
        (["--seed", "99999999999999999999"], "--seed must be an int in [0, 2**31), got 99999999999999999999"),
        (["--seed", "-5"], "--seed must be an int in [0, 2**31), got -5; pass e.g. --seed 0"),
        (["--strategies", "dp,dp"], "--strategies 'dp,dp' names dp twice"),
        (["--strategies", "simulation,,dp"], "--strategies 'simulation,,dp' has an empty name"),
        (["--devices", "10000"], "--devices 10000: at most 512 fake CPU devices can be created"),
    ],
)
def test_bad_arguments_exit_2(args, msg, capsys):
    assert main(["verify", "--steps", "1", "--batch-size", "8", *args]) == 2
    assert msg in " ".join(capsys.readouterr().err.split())


def test_candidate_with_a_wrong_signature_exits_2(steps_file, capsys):
    assert main(["verify", "--steps", "1", "--candidate", f"{steps_file}:three_args"]) == 2
    assert "it must take (model, optimizer, x, y)" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    "source, said",
    [
        (
            "def step(model, optimizer, *, batch):\n    return 0.0\n",
            "step takes (model, optimizer, *, batch); it must take (model, optimizer, batch) or (model, "
            "optimizer, batch, mesh) and update model and optimizer in place (batch after the '*' cannot be passed "
            "by position: drop the '*')",
        ),
        (
            "def step(model, optimizer):\n    return 0.0\n",
            "step takes (model, optimizer); it must take (model, optimizer, batch) or (model, optimizer, batch, "
            "mesh) and update model and optimizer in place",
        ),
    ],
)
def test_a_task_step_with_a_wrong_signature_is_shown_its_own(source, said, tmp_path, capsys):
    """Trial 51: a step with a keyword-only ``batch`` was reported as taking "(model, optimizer)"."""
    path = tmp_path / "steps.py"
    path.write_text(source)
    argv = ["verify", "--task", "tiny-lm", "--strategies", "none", "--candidate", f"{path}:step"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err == f"error: shardcheck verify: --candidate: {said}", err


def test_mlp_momentum_linnerud_passes(capsys):
    args = ["verify", "--model", "mlp", "--hidden", "4", "--optimizer", "momentum", "--dataset", "linnerud"]
    assert main([*args, "--steps", "3", "--batch-size", "4", "--strategies", "accumulation"]) == 0
    assert "shardcheck verify accumulation: PASS" in capsys.readouterr().out


def test_help_and_json_through_the_entry_point():
    out = subprocess.run([entry_point(), "verify", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in (
        "--model",
        "--dataset",
        "--strategies",
        "--optimizer",
        "--steps",
        "--batch-size",
        "--devices",
    ):
        assert flag in out.stdout
    assert "--candidate" in out.stdout and "--json" in out.stdout
    args = ["verify", "--devices", "4", "--steps", "2", "--batch-size", "16", "--strategies", "fsdp"]
    out = subprocess.run([entry_point(), *args, "--json", "-"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["num_shards"] == 4 and report["process_count"] == 1
    assert {k: v["ok"] for k, v in report["strategies"].items()} == {"fsdp": True}
    assert "shardcheck verify fsdp: PASS" in out.stderr  # the tables go to stderr when stdout holds the JSON


@pytest.mark.multiprocess
def test_verify_under_launch_two_processes(tmp_path):
    """dp and fsdp on a mesh spanning 2 processes x 2 devices; process 0 writes the JSON."""
    out = tmp_path / "mp.json"
    argv = ["launch", "--processes", "2", "--devices-per-process", "2", "--timeout", "200", "--"]
    argv += ["verify", "--strategies", "dp,fsdp", "--steps", "2", "--batch-size", "16", "--json", str(out)]
    done = subprocess.run([entry_point(), *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["process_count"] == 2 and report["num_shards"] == 4
    assert all(r["ok"] for r in report["strategies"].values())


def test_a_relu_flip_passes_per_step_and_exits_0(tmp_path, capsys):
    """The user's report: a ReLU flipped by rounding used to FAIL as `drift`; the step is correct (tests/kinked.py
    fixes the step it flips at by exact arithmetic)."""
    out, task = tmp_path / "v.json", Path(kinked.__file__)
    args = ["verify", "--task", f"{task}:task", "--candidate", f"{task}:rounded_step", "--devices", "2"]
    assert main([*args, "--strategies", "simulation", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["strategies"]["simulation"]["verdict"] == "PASS"
    r = report["strategies"]["candidate"]
    assert r["verdict"] == "PASS (per step)" and r["ok"] is False and r["step_ok"] is True
    assert r["codes"] == ["diverged_trajectory"] and r["diverged_at"] == kinked.DIVERGES_AT
    assert f"diverged at step {kinked.DIVERGES_AT}" in r["diagnosis"] and "ReLU" in r["diagnosis"]
    text = " ".join(capsys.readouterr().out.split())
    assert "PASS (per step)" in text and "drift" not in text


def test_a_diverging_reference_exits_2_without_a_verdict(capsys):
    args = ["verify", "--devices", "2", "--lr", "2", "--steps", "30", "--strategies", "dp,simulation"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "the reference run diverged (non-finite loss or parameters at step 16) with --optimizer sgd --lr 2"
        in err
    )
    assert "lower --lr (default 0.1)" in err and "loss_differs" not in err
    assert "or fix batch 16 where it makes the loss non-finite from finite parameters" in err


def test_a_raising_or_garbage_candidate_exits_2(steps_file, capsys):
    args = ["verify", "--devices", "2", "--steps", "2", "--batch-size", "8", "--strategies", "none"]
    assert main([*args, "--candidate", f"{steps_file}:raises"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "shardcheck verify: the candidate step raised ValueError: planted failure at step 0" in err
    assert main([*args, "--candidate", f"{steps_file}:garbage"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the candidate step 'candidate' returned str at step 0; it must return the scalar" in err


def test_a_candidate_returning_garbage_gets_an_error_row_beside_the_others(steps_file, tmp_path, capsys):
    """Trial 51: a step returning a tuple exited 2 with one line, no table and no --json, while a step that raised
    (or returned gradients that cannot be compared) got its ERROR row beside the other strategies' rows."""
    out = tmp_path / "v.json"
    argv = ["verify", "--devices", "2", "--steps", "1", "--batch-size", "8", "--strategies", "dp"]
    assert main([*argv, "--candidate", f"{steps_file}:garbage", "--json", str(out)]) == 2
    rows = json.loads(out.read_text())["strategies"]
    assert rows["dp"]["verdict"] == "PASS"
    said = (
        "the candidate step 'candidate' returned str at step 0; it must return the scalar pre-update loss, None, "
        "or an object or mapping with 'loss' (a scalar) and optionally 'grads'"
    )
    assert (rows["candidate"]["verdict"], rows["candidate"]["codes"]) == ("ERROR", ["error"])
    assert rows["candidate"]["error"] == dict(
        type="TypeError", message=said, step=0, builtin=False, refused=False
    )
    assert rows["candidate"]["diagnosis"] == f"shardcheck verify: {said}"
    assert f"error: shardcheck verify: {said}" in capsys.readouterr().err


def test_a_candidate_error_repeats_no_line_and_stays_short():
    from shardcheck.cli.verify import _short

    jax_like = "\n".join(
        ["shard_map check failed:", *["* out_specs[1] is P() which implies replication"] * 120]
    )
    assert _short(jax_like) == "shard_map check failed:\n* out_specs[1] is P() which implies replication"
    many = "\n".join(f"line {i}" for i in range(20))
    assert _short(many).splitlines()[-1] == "... (8 more lines)" and len(_short(many).splitlines()) == 13


def test_repeated_findings_are_shown_once(capsys):
    args = ["verify", "--devices", "2", "--steps", "1", "--batch-size", "8", "--strategies", "simulation"]
    assert main([*args, "--rtol", "1e9", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["strategies"]["simulation"]["codes"] == [
        "parity",
        "weak_check",
    ]


def test_verify_without_devices_fakes_the_shard_count():
    """Like `shardcheck run`: no --devices means S=2 fake CPU devices, created before JAX starts."""
    args = ["verify", "--steps", "2", "--batch-size", "16", "--strategies", "dp,fsdp", "--json", "-"]
    out = subprocess.run([entry_point(), *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["num_shards"] == 2 and {k: v["ok"] for k, v in report["strategies"].items()} == {
        "dp": True,
        "fsdp": True,
    }


def test_library_errors_name_the_flags_on_the_command_line():
    from shardcheck.cli._common import library_to_flags

    message = (
        "check_parity: compute_dtype='float32' is more precise than the model's own bfloat16 (its layers): ...; "
        "omit compute_dtype or pass 'bfloat16'"
    )
    assert library_to_flags(message, "verify") == (
        "shardcheck verify: --compute-dtype float32 is more precise than the model's own bfloat16 (its layers): "
        "...; omit --compute-dtype or pass 'bfloat16'"
    )
    assert library_to_flags("check_parity: batch size 30 is not divisible by num_shards=4", "verify") == (
        "shardcheck verify: batch size 30 is not divisible by --devices 4"
    )
    assert (
        library_to_flags("run_step: num_shards_total stays", "verify") == "run_step: num_shards_total stays"
    )


def test_shard_counts_read_as_the_command_line_gave_them():
    """One wording (shardcheck._validate.check_divisible), S named by --devices or by the mesh's batch shards."""
    import argparse

    from shardcheck.cli._common import MESH_SHARD_COUNTS, TRAIN_FLAGS, library_to_flags, shard_words

    plain, tensor = argparse.Namespace(mesh=None), argparse.Namespace(mesh={"data": 2, "model": 4})
    assert shard_words(plain, 4) == ("--devices 4", "--devices")
    assert shard_words(argparse.Namespace(mesh={"data": 3}), 3) == (
        "the 3 devices of --mesh data=3",
        MESH_SHARD_COUNTS,
    )
    assert shard_words(tensor, 2) == ("the 2 batch shards of --mesh data=2,model=4", MESH_SHARD_COUNTS)
    message = (
        "train_task: batch size 30 (batch leaf 'x') is not divisible by num_shards=2; equal shards are required "
        "(valid num_shards for this batch: 1, 2, 3, 5, 6, 10, 15, 30; pad the batch)"
    )
    assert library_to_flags(message, "train", TRAIN_FLAGS, functions=("train_task",), args=tensor) == (
        "shardcheck train: batch size 30 (batch leaf 'x') is not divisible by the 2 batch shards of --mesh "
        "data=2,model=4; equal shards are required (valid batch-shard counts (the product of the sizes of --mesh's "
        "batch axes, data and fsdp) for this batch: 1, 2, 3, 5, 6, 10, 15, 30; pad the batch)"
    )
    assert library_to_flags(
        "train: batch_size=30 ... num_shards=4", "train", TRAIN_FLAGS, functions=("train",)
    ) == ("shardcheck train: --batch-size 30 ... --devices 4")


CANDIDATE_FILE = """
import optax
from flax import nnx

import shardcheck
from shardcheck.steps.reference import reference_step
from shardcheck.tasks import load_task

task = load_task("digits", optimizer="adam", lr=1e-2, steps=3, batch_size=32)
# a step with its own optimizer wrapper: gradient accumulation over 2 micro-batches (optax.MultiSteps)
accumulate = shardcheck.strategy_candidate(task, "accumulation", num_shards=2)


def _double_lr(model, optimizer):
    return nnx.Optimizer(model, optax.adam(2 * 1e-2), wrt=nnx.Param)


def _step(model, optimizer, batch):
    return reference_step(task.loss_fn, model, optimizer, batch).loss


# a planted fault in the wrapper: the candidate's optimizer runs at twice the task's learning rate
double_lr = shardcheck.Candidate(name="double_lr", step=_step, make_optimizer=_double_lr)
not_a_step = shardcheck.Candidate(name="broken", step=42)
"""


@pytest.fixture
def candidate_file(tmp_path):
    path = tmp_path / "my_candidates.py"
    path.write_text(CANDIDATE_FILE)
    return path


def test_a_candidate_with_its_own_optimizer_wrapper_is_verified(candidate_file, tmp_path):
    out = tmp_path / "c.json"
    args = ["verify", "--task", f"{candidate_file}:task", "--strategies", "none", "--devices", "2"]
    assert main([*args, "--candidate", f"{candidate_file}:accumulate", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["strategies"]["candidate"]
    assert r["verdict"] == "PASS" and r["steps"] == 3 and r["num_shards"] == 2


def test_a_candidate_whose_wrapper_is_wrong_fails(candidate_file, tmp_path):
    out = tmp_path / "c.json"
    args = ["verify", "--task", f"{candidate_file}:task", "--strategies", "none", "--devices", "2"]
    assert main([*args, "--candidate", f"{candidate_file}:double_lr", "--json", str(out)]) == 1
    r = json.loads(out.read_text())["strategies"]["candidate"]
    assert r["verdict"] == "FAIL"
    assert "update ratio 2" in r["diagnosis"]  # Adam's first update is lr * sign: twice the reference's


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--task", "{file}:task", "--candidate", "{file}:not_a_step"],
            "is a shardcheck.Candidate whose step is a int, not a callable",
        ),
        (["--candidate", "{file}:accumulate"], "pass the task it runs on with --task"),
    ],
)
def test_a_bad_candidate_object_exits_2_naming_the_fix(candidate_file, capsys, extra, message):
    argv = [
        "verify",
        "--strategies",
        "none",
        "--devices",
        "2",
        *[a.format(file=candidate_file) for a in extra],
    ]
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_a_task_file_batch_that_does_not_split_over_the_mesh_names_the_mesh(candidate_file, capsys):
    """From the new-user trial: under --mesh the refusal named a '--devices 3' the user never gave."""
    argv = ["verify", "--task", f"{candidate_file}:task", "--mesh", "data=3", "--strategies", "dp"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "is not divisible by the 3 devices of --mesh data=3; equal shards are required (valid batch-shard "
        in err
    )
    assert "--devices" not in err and "num_shards" not in err


CLIPPED_FILE = """
import numpy as np
import optax
from flax import nnx

import shardcheck
from shardcheck.losses import mse_batch_loss

rng = np.random.default_rng(0)
x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
# global-norm clipping that binds (1e-3, far below the gradient's norm): g and 2 g give one update
task = shardcheck.Task(
    model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
    optimizer=optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1)),
    loss_fn=mse_batch_loss,
    batches=[(x, y), (y @ np.ones((2, 3), np.float32), x[:, :2])],
    name="clipped",
)


def summed(model, optimizer, batch):  # a sum for a mean over 2 shards; the mean's loss, no gradients
    loss, grads = nnx.value_and_grad(lambda m: 2 * mse_batch_loss(m, batch))(model)
    optimizer.update(model, grads)
    return loss / 2
"""


def test_an_accepted_weak_check_is_marked_in_the_summary_and_the_json(tmp_path, capsys):
    """From the trial: --accept-weak turned a loss-only sum for a mean under a binding clip into a bare PASS."""
    path = tmp_path / "clipped.py"
    path.write_text(CLIPPED_FILE)
    argv = ["verify", "--task", f"{path}:task", "--candidate", f"{path}:summed", "--devices", "2"]
    argv += ["--strategies", "none"]
    assert main(argv) == 1
    assert "CANNOT VERIFY" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "report.json"
    assert main([*argv, "--accept-weak", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "shardcheck verify candidate: PASS (weak check accepted)" in text  # the strategy's table
    assert "│ candidate │ PASS (weak check accepted) │" in text  # the summary row
    assert "weak check accepted: Cannot verify the gradient's scale" in text
    report = json.loads(out.read_text())["strategies"]["candidate"]
    assert report["ok"] is True and report["verdict"] == "PASS (weak check accepted)"
    assert report["weak_accepted"].startswith("Cannot verify the gradient's scale: in every step")
    assert report["cannot_verify"] is None


def test_gradients_of_another_structure_exit_2_naming_the_leaves(tmp_path, capsys):
    path = tmp_path / "tuple_grads.py"
    path.write_text(
        CLIPPED_FILE
        + """

def tuple_grads(model, optimizer, batch):  # the right step, its gradients returned as a tuple
    loss, grads = nnx.value_and_grad(mse_batch_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": (grads["kernel"], grads["bias"])}
"""
    )
    argv = ["verify", "--task", f"{path}:task", "--candidate", f"{path}:tuple_grads", "--devices", "2"]
    assert main([*argv, "--strategies", "none"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "error: shardcheck verify: the candidate step 'candidate' returned grads whose structure differs from "
        "the model's parameters at step 0 (missing 'bias', 'kernel'; extra '0', '1'; the parameters' leaves are "
        "'bias', 'kernel'): return grads with the structure of nnx.state(model, nnx.Param)"
    ) in err
    assert "NoneType" not in err


@require_devices(2)
@pytest.mark.parametrize("mistake", ['batch["token"]', "model.missing_layer"])
def test_a_typo_in_the_task_loss_is_bad_input_not_a_crash(mistake, tmp_path, capsys):
    """A KeyError / AttributeError raised by the user's loss_fn: verify, train and memory exit 2 with one line
    naming the exception (a traceback and exit 1 before)."""
    task_file = tmp_path / "typo_task.py"
    task_file.write_text(
        textwrap.dedent(
            f"""
            import numpy as np
            import optax
            from flax import nnx
            import shardcheck

            def loss_fn(model, batch):
                x = {mistake if "batch" in mistake else 'batch["x"]'}
                out = {"model(x)" if "batch" in mistake else mistake + "(x)"}
                return ((out - batch["y"]) ** 2).mean()

            rng = np.random.default_rng(0)
            batches = [{{"x": rng.normal(size=(4, 3)).astype(np.float32), "y": np.zeros((4, 2), np.float32)}}]
            task = shardcheck.Task(
                model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.1),
                loss_fn=loss_fn, batches=batches,
            )
            """
        )
    )
    spec = f"{task_file}:task"
    for argv in (
        ["verify", "--task", spec, "--devices", "2", "--strategies", "dp"],
        ["train", "--task", spec, "--devices", "2", "--epochs", "1", "--plot", str(tmp_path / "p.png")],
        ["memory", "--task", spec, "--mesh", "fsdp=2", "--measure"],
    ):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        kind = "KeyError" if "batch" in mistake else "AttributeError"
        assert f"loss_fn raised {kind} on batch 0" in err and "Traceback" not in err, (argv, err)


# --------------------------------------------------------------- one strategy's failure never hides the others (#34)
def _raising_strategy(monkeypatch, name: str, where: str):
    """Make the built-in ``name`` raise a two-line RuntimeError: in its step (at step 0), or while it is built
    (before any step)."""
    import dataclasses

    from shardcheck.steps import STRATEGIES

    strategy = STRATEGIES[name]

    def build(loss_fn, num_shards, mesh):
        if where == "build":
            raise RuntimeError("planted limitation\nsecond line")
        candidate = strategy.build(loss_fn, num_shards, mesh)

        def step(model, optimizer, batch):  # a first line ending in a period, as JAX's errors do
            raise RuntimeError("planted limitation.\nsecond line")

        return dataclasses.replace(candidate, step=step)

    monkeypatch.setitem(STRATEGIES, name, dataclasses.replace(strategy, build=build))


def _rows(text: str) -> dict[str, str]:
    """The summary table's verdict per strategy."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 7 and cells[0] in ("dp", "fsdp", "simulation", "accumulation", "gspmd", "candidate"):
            rows[cells[0]] = cells[1]
    return rows


@require_devices(2)
@pytest.mark.parametrize(("where", "step"), [("step", 0), ("build", None)])
def test_a_built_in_that_raises_gets_its_own_error_row_and_the_others_theirs(
    where, step, monkeypatch, tmp_path, capsys
):
    """From the new-user trial: a built-in strategy that could not run the model was reported as "the candidate
    step raised ... fix the step", exit 2, and no row was printed. Now it is its own ERROR row naming the strategy
    and the exception's type and first line; every other row is printed and in the JSON; the exit status is the
    worst row's (2)."""
    _raising_strategy(monkeypatch, "fsdp", where)
    out = tmp_path / "r.json"
    argv = [
        "verify",
        "--devices",
        "2",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--strategies",
        "dp,fsdp,simulation",
    ]
    assert main([*argv, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    at = "" if step is None else f" at step {step}"
    assert (
        f"error: shardcheck verify: the built-in strategy 'fsdp' could not run this task{at}: RuntimeError: "
        "planted limitation. A limitation or a bug of shardcheck's fsdp step, not a fault of your model or step"
    ) in err
    assert "candidate" not in err and "second line" not in err and ".." not in err  # one period, not two
    assert _rows(captured.out) == {"dp": "PASS", "fsdp": "ERROR", "simulation": "PASS"}
    assert "RuntimeError: planted limitation" in captured.out  # the summary row's reason
    report = json.loads(out.read_text())
    assert report["ok"] is False
    rows = report["strategies"]
    assert [rows[k]["verdict"] for k in ("dp", "fsdp", "simulation")] == ["PASS", "ERROR", "PASS"]
    assert rows["dp"]["ok"] is True and rows["simulation"]["ok"] is True and rows["fsdp"]["ok"] is False
    assert rows["fsdp"]["codes"] == ["error"]
    assert rows["fsdp"]["error"] == {
        "type": "RuntimeError",
        "message": "planted limitation" + ("." if where == "step" else ""),
        "step": step,
        "builtin": True,
        "refused": False,  # an error, not a refusal (REFUSED: tests/test_trial27_cli.py)
    }


@require_devices(2)
def test_a_raising_candidate_keeps_its_message_in_its_own_row(steps_file, monkeypatch, tmp_path, capsys):
    """The user's candidate that raises: its message as before ("the candidate step raised ... fix the step"), in
    its own row; the built-ins' rows beside it, one of them an ERROR of its own; exit 2."""
    _raising_strategy(monkeypatch, "simulation", "step")
    out = tmp_path / "r.json"
    argv = ["verify", "--devices", "2", "--steps", "2", "--batch-size", "8", "--strategies", "dp,simulation"]
    assert main([*argv, "--candidate", f"{steps_file}:raises", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert (
        "shardcheck verify: the candidate step raised ValueError: planted failure at step 0; fix the step"
        in err
    )
    assert "the built-in strategy 'simulation' could not run this task at step 0: RuntimeError" in err
    assert _rows(captured.out) == {"dp": "PASS", "simulation": "ERROR", "candidate": "ERROR"}
    rows = json.loads(out.read_text())["strategies"]
    assert rows["dp"]["verdict"] == "PASS"
    assert rows["candidate"]["error"] == {
        "type": "ValueError",
        "message": "planted failure",
        "step": 0,
        "builtin": False,
        "refused": False,
    }
    assert rows["candidate"]["diagnosis"].startswith(
        "shardcheck verify: the candidate step raised ValueError"
    )


@require_devices(2)
def test_an_error_row_beside_a_fail_exits_2_and_a_fail_alone_1(steps_file, monkeypatch, capsys):
    """The worst row's status: FAIL (1) below ERROR (2)."""
    argv = ["verify", "--devices", "4", "--steps", "1", "--batch-size", "8", "--strategies", "dp"]
    argv += ["--candidate", f"{steps_file}:summed_step"]
    assert main(argv) == 1
    assert _rows(capsys.readouterr().out) == {"dp": "PASS", "candidate": "FAIL"}
    _raising_strategy(monkeypatch, "dp", "step")
    assert main(argv) == 2
    assert _rows(capsys.readouterr().out) == {"dp": "ERROR", "candidate": "FAIL"}


@pytest.mark.parametrize("command", ["verify", "record"])
def test_a_csv_target_column_beside_a_task_is_refused_not_ignored(command, tmp_path, capsys):
    """``--target`` names --dataset's CSV target column; beside --task it was silently ignored (a user meaning
    a GPU kind, as ``memory --target h100`` takes, got a check that never read it)."""
    argv = [command, "--task", "tiny-lm", "--target", "h100", "--steps", "1"]
    if command == "record":
        argv += ["--out", str(tmp_path / "run.npz")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--target h100 is the CSV target column of --dataset and applies without --task only" in err
    assert "shardcheck memory --target KIND" in err
    assert not (tmp_path / "run.npz").exists()
