"""``shardcheck run``, through the installed entry point and in-process."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardcheck.cli import main


def entry_point() -> str:
    exe = Path(sys.executable).with_name("shardcheck")
    return str(exe) if exe.exists() else shutil.which("shardcheck")


def run_cli(*args, timeout=240, env=None):
    return subprocess.run([entry_point(), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_through_entry_point():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "run" in out.stdout
    out = run_cli("run", "--help")
    assert out.returncode == 0
    for flag in ("--dataset", "--shards", "--lr", "--seed", "--json", "--strategy", "--devices", "--target"):
        assert flag in out.stdout


def test_default_run_on_diabetes_through_entry_point(tmp_path):
    """The main job with no arguments: diabetes, S=2, every computation agrees with the baseline.

    The two runs share a fresh cache folder, as two runs of a user's would: the second compiles nothing.
    """
    env = os.environ | {"SHARDCHECK_COMPILATION_CACHE": str(tmp_path / "cache")}
    out = run_cli("run", env=env)
    assert out.returncode == 0, out.stderr
    for word in ("diabetes", "baseline", "simulation", "dp", "fsdp", "(10+1)*1/2 x 4 = 22 B"):
        assert word in out.stdout
    out = run_cli("run", "--json", "-", env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # stdout carries the JSON alone
    assert report["dataset"] == "diabetes" and report["num_shards"] == 2 and report["lr"] == 0.1
    assert report["num_examples"] == 442 and report["param_storage_per_shard_bytes"] == 22.0
    results = report["results"]
    assert set(results) == {"baseline", "simulation", "dp", "fsdp"}
    base = results["baseline"]["loss"]
    for name, r in results.items():
        assert r["loss"] == pytest.approx(base, rel=1e-6), name
        assert r["max_abs_param_diff_vs_baseline"] < 1e-6, name
    sim = results["simulation"]
    assert np.mean(sim["shard_losses"]) == pytest.approx(base, rel=1e-6)
    assert max(sim["max_abs_grad_diff_vs_full_batch"].values()) < 1e-5


def test_json_values_in_process(capsys):
    assert (
        main(
            ["run", "--strategy", "simulation", "--shards", "13", "--lr", "0.5", "--seed", "3", "--json", "-"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["num_shards"] == 13 and report["lr"] == 0.5 and report["seed"] == 3
    assert len(report["results"]["simulation"]["shard_losses"]) == 13
    assert report["results"]["simulation"]["max_abs_param_diff_vs_baseline"] < 1e-6


def test_json_to_file_and_table_on_stdout(tmp_path, capsys):
    path = tmp_path / "out" / "run.json"
    assert main(["run", "--strategy", "simulation", "--json", str(path)]) == 0
    assert "simulation" in capsys.readouterr().out
    assert json.loads(path.read_text())["results"]["simulation"]["loss"] > 0


def test_csv_dataset_with_targets(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3))
    y = x @ np.array([[1.0, 0.5], [-2.0, 0.0], [0.5, 1.0]])
    path = tmp_path / "data.csv"
    rows = ["a,b,c,t1,t2"] + [",".join(f"{v:.6f}" for v in row) for row in np.hstack([x, y])]
    path.write_text("\n".join(rows) + "\n")
    assert (
        main(
            [
                "run",
                "--strategy",
                "simulation",
                "--dataset",
                str(path),
                "--target",
                "t1,t2",
                "--shards",
                "4",
                "--json",
                "-",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["dataset"] == "data.csv" and report["in_features"] == 3 and report["out_features"] == 2
    assert report["results"]["simulation"]["loss"] == pytest.approx(
        report["results"]["baseline"]["loss"], rel=1e-6
    )


def test_npz_dataset(tmp_path, capsys):
    rng = np.random.default_rng(1)
    path = tmp_path / "data.npz"
    np.savez(path, x=rng.normal(size=(8, 4)), y=rng.normal(size=(8,)))
    assert (
        main(["run", "--strategy", "simulation", "--dataset", str(path), "--shards", "4", "--json", "-"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["num_examples"], report["in_features"], report["out_features"]) == (8, 4, 1)


@pytest.mark.parametrize(
    "content,suffix,msg",
    [
        ("a,b\n1,x\n2,3\n", ".csv", "line 2, column 'b': 'x' is not a number"),
        ("a,b\n1,2,3\n", ".csv", "line 2 has 3 fields"),
        ("a,b\n1,nan\n2,3\n", ".csv", "NaN or inf"),
        ("a,b\n", ".csv", "header row and at least one data row"),
        ("not a zip", ".npz", "not a readable NPZ"),
    ],
)
def test_malformed_files(tmp_path, capsys, content, suffix, msg):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    assert main(["run", "--strategy", "simulation", "--dataset", str(path), "--shards", "1"]) == 2
    assert msg in capsys.readouterr().err.replace("\n", " ")


def test_npz_without_y_and_with_objects(tmp_path, capsys):
    path = tmp_path / "nox.npz"
    np.savez(path, x=np.ones((4, 2)))
    assert main(["run", "--strategy", "simulation", "--dataset", str(path), "--shards", "1"]) == 2
    assert "lacks array(s) ['y']" in capsys.readouterr().err
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([[1, None]], dtype=object), y=np.ones(1))
    assert main(["run", "--strategy", "simulation", "--dataset", str(path), "--shards", "1"]) == 2
    assert "not a readable NPZ" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--dataset", "nope.csv"], "file 'nope.csv' does not exist"),
        (["--dataset", "iris"], "neither a bundled data set"),
        (["--target", "y"], "target= applies to CSV files"),
        (["--shards", "0"], "--shards must be a positive int"),
    ],
)
def test_bad_arguments(capsys, args, msg):
    assert main(["run", "--strategy", "simulation", *args]) == 2
    assert msg in capsys.readouterr().err.replace("\n", " ")


def test_non_divisible_shard_count_lists_valid_counts():
    out = run_cli("run", "--shards", "3")
    assert out.returncode != 0
    err = " ".join(out.stderr.split())
    assert "batch size 442 is not divisible by num_shards=3" in err
    assert "1, 2, 13, 17, 26, 34, 221, 442" in err


@pytest.mark.parametrize(
    "path,msg",
    [
        ("/proc/shardcheck.json", "cannot be written"),
        (".", "is a folder; pass a file path"),
    ],
)
def test_unwritable_output_refused_before_any_work(capsys, path, msg):
    assert main(["run", "--strategy", "simulation", "--json", path]) == 2
    assert msg in capsys.readouterr().err.replace("\n", " ")


def test_output_under_a_file_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["run", "--strategy", "simulation", "--json", str(tmp_path / "afile" / "out.json")]) == 2
    assert "which is a file, not a folder" in capsys.readouterr().err.replace("\n", " ")


def test_an_output_in_a_folder_that_does_not_exist_is_written_with_a_note(tmp_path, capsys):
    """Trial 52: ``record --out /typo/dir/run.npz`` created the folder silently. It is still created (as before),
    and a note on stderr names it, before any work; an existing folder gets no note."""
    out = tmp_path / "new" / "sub" / "r.json"
    assert main(["run", "--strategy", "baseline", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        f"note: shardcheck run: --json {out}: the folder {out.parent} does not exist; it is created for the file"
    )
    assert json.loads(out.read_text())["results"]["baseline"]["loss"] > 0
    assert main(["run", "--strategy", "baseline", "--json", str(out)]) == 0
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "name,content,msg",
    [
        ("onecol.csv", b"t\n1\n2\n", "0 feature and 1 target column(s)"),
        ("binary.csv", b"a,b\n\xff\xfe,1\n", "is not UTF-8 text"),
        ("broken.npz", b"PK\x03\x04 this is not a zip archive", "is not a readable NPZ file"),
        ("huge.csv", b"a,t\n1.7e308,1\n-1.7e308,2\n", "too large to standardize"),
    ],
)
def test_more_malformed_data(tmp_path, capsys, name, content, msg):
    path = tmp_path / name
    path.write_bytes(content)
    assert main(["run", "--strategy", "simulation", "--dataset", str(path), "--shards", "1"]) == 2
    assert msg in capsys.readouterr().err.replace("\n", " ")


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_bad_seed(capsys, seed):
    assert main(["run", "--strategy", "simulation", "--seed", seed]) == 2
    assert "seed must be" in capsys.readouterr().err.replace("\n", " ")


def test_baseline_alone_needs_no_equal_shards(capsys):
    assert main(["run", "--strategy", "baseline", "--shards", "3", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["results"]["baseline"]["loss"] > 0


def test_version_and_python_dash_m():
    out = subprocess.run(
        [sys.executable, "-m", "shardcheck", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "shardcheck 0.1.0"


# ------------------------------------------------------------------------------------------------ --task


def test_seed_form_and_choices_come_from_the_registry():
    from shardcheck import runner
    from shardcheck.cli.run import STRATEGY_CHOICES
    from shardcheck.steps import STRATEGIES

    assert runner.xy_strategies() == ("baseline", "simulation", "dp", "fsdp") == runner.RUN_STRATEGIES
    assert STRATEGY_CHOICES == ("all", "baseline", *STRATEGIES)


def test_task_digits_every_registered_strategy_matches_the_reference(capsys):
    from shardcheck.steps import STRATEGIES

    assert main(["run", "--task", "digits", "--devices", "4", "--json", "-"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert "reference" in out.err and "skipped multiprocess" in " ".join(out.err.split())  # the table: stderr
    assert report["task"] == report["dataset"] == "digits"
    assert (report["num_examples"], report["num_shards"], report["seed"]) == (64, 4, 0)
    assert report["param_count"] == 64 * 32 + 32 + 32 * 10 + 10
    assert report["param_storage_per_shard_bytes"] == report["param_count"] * 4 / 4
    results = report["results"]
    # Every registered strategy ran, but multiprocess, which needs a launched run.
    assert list(results) == [name for name in STRATEGIES if name != "multiprocess"]
    assert (
        list(report["skipped"]) == ["multiprocess"]
        and "several JAX processes" in report["skipped"]["multiprocess"]
    )
    reference = results["reference"]
    assert reference["max_abs_param_diff_vs_baseline"] == 0.0 and reference["worst_param_leaf"] == ""
    for name, r in results.items():
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-6), name
        assert r["max_abs_param_diff_vs_baseline"] < 1e-5, name
        by_leaf = r["max_abs_param_diff_by_leaf"]
        assert set(by_leaf) == {"hidden.bias", "hidden.kernel", "out.bias", "out.kernel"}
        assert max(by_leaf.values()) == r["max_abs_param_diff_vs_baseline"]
        if name != "reference":
            assert by_leaf[r["worst_param_leaf"]] == r["max_abs_param_diff_vs_baseline"]
    assert len(results["simulation"]["shard_losses"]) == 4
    assert np.mean(results["simulation"]["shard_losses"]) == pytest.approx(reference["loss"], rel=1e-6)
    assert max(results["simulation"]["max_abs_grad_diff_vs_full_batch"].values()) < 1e-6
    # fsdp holds a quarter of every leaf but out.bias (10,): 2048 + 32 + 320 + 40 B; Adam 2x that + count + step.
    assert results["fsdp"]["placement"]["params_bytes"] == 2440
    assert results["fsdp"]["placement"]["optimizer_bytes"] == 2 * 2440 + 4 + 4
    assert results["dp"]["placement"]["params_bytes"] == 9640


def test_task_one_strategy_and_options(capsys):
    args = ["run", "--task", "digits", "--strategy", "accumulation", "--shards", "2", "--optimizer", "sgd"]
    assert main([*args, "--lr", "0.5", "--batch-size", "32", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["results"]) == ["reference", "accumulation"] and report["skipped"] == {}
    assert report["num_examples"] == 32 and report["num_shards"] == 2
    acc = report["results"]["accumulation"]
    assert acc["loss"] == pytest.approx(report["results"]["reference"]["loss"], rel=1e-6)
    assert acc["max_abs_param_diff_vs_baseline"] < 1e-6


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--task", "no-such-task"], "load_task: 'no-such-task' is not a built-in task"),
        (["--task", "missing.py:task"], "does not exist"),
        (["--task", "shardcheck.tasks:nothing"], "has no attribute 'nothing'"),
        (
            ["--task", "digits", "--strategy", "baseline"],
            "the baseline is the registered strategy 'reference'",
        ),
        (["--task", "digits", "--dataset", "linnerud"], "--dataset and --target apply without --task"),
        (["--task", "digits", "--shards", "3", "--devices", "3"], "is not divisible by num_shards=3"),
        (["--task", "digits", "--strategy", "multiprocess"], "needs several JAX processes"),
        (
            ["--task", "shardcheck.tasks:tiny_lm_task", "--lr", "0.1"],
            "--lr applies to the built-in tasks only",
        ),
        (["--strategy", "accumulation"], "--strategy accumulation needs --task"),
        (["--optimizer", "adam"], "--optimizer applies to a built-in --task only"),
    ],
)
def test_bad_task_arguments_exit_2(capsys, args, msg):
    assert main(["run", *args]) == 2
    assert msg in " ".join(capsys.readouterr().err.split())


# ------------------------------------------------------------------------------------------------ the verdict


def test_the_main_job_ends_with_a_verdict_from_the_parity_rule(capsys):
    """Trial 52: ``shardcheck run`` printed the numbers and no verdict. It says PASS (exit 0) where every
    computation's parameters lie within ``atol + rtol * max|params_baseline|`` of the baseline's after the step,
    with ``atol = eps * sqrt(B * K)`` and ``rtol = 16 * atol`` (B * K = 442 diabetes rows, one output)."""
    assert main(["run", "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    eps = float(np.finfo(np.float32).eps)
    atol = eps * np.sqrt(442.0)
    scale = max(float(np.max(np.abs(v))) for v in report["results"]["baseline"]["params"].values())
    assert report["ok"] is True
    assert report["allowed_abs_param_diff"] == pytest.approx(atol + 16 * atol * scale, rel=1e-6)
    worst = max(r["max_abs_param_diff_vs_baseline"] for r in report["results"].values())
    assert worst <= report["allowed_abs_param_diff"] / 10  # a correct split: far within
    assert "PASS: every computation's parameters after the step are within " in " ".join(captured.err.split())


def test_a_computation_beyond_the_tolerance_is_a_fail_and_exits_1(monkeypatch, capsys):
    import shardcheck.seeds
    from shardcheck.cli.run import run_verdict

    real = shardcheck.seeds.run_strategies

    def summed(*args, **kwargs):  # fsdp's parameters moved by a planted 1e-3 (a summed gradient moves 0.1)
        report = real(*args, **kwargs)
        fsdp = report.outcomes["fsdp"]
        report.outcomes["fsdp"] = dataclasses.replace(fsdp, max_abs_param_diff_vs_baseline=1e-3)
        return report

    monkeypatch.setattr(shardcheck.seeds, "run_strategies", summed)
    assert main(["run", "--json", "-"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is False
    said = " ".join(captured.err.split())
    assert "FAIL: fsdp differs from the baseline's parameters by more than " in said
    assert "(worst fsdp: 0.001; atol + rtol*max|params| after one step with n = 442 x 1 reduced terms" in said
    alone = real(np.ones((4, 1)), np.ones((4, 1)), num_shards=1, strategies=("baseline",))
    assert run_verdict(alone, 4) is None  # the baseline alone: nothing to judge
