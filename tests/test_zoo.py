"""The model zoo (``examples/zoo/*.py``) through every command, in-process (issue #34).

Each zoo file is a user's task file: ``task``, the user's correct ``step``, its ``MESH`` and ``FAULTS``
(``{name: (faulty_step, expected diagnosis code)}``). Every file found is checked by each test here:

- ``verify`` of every built-in strategy and ``--candidate step`` in one run on ``MESH``: each built-in row PASSes
  or is an ERROR row of its own naming in one line why it cannot run the model; the user's step PASSes; the exit
  status is the worst row's;
- each planted fault FAILs and its first diagnosis is the expected code (``check_parity``, one shared reference);
- ``verify --reference gspmd --strategies none --candidate step``: PASS against XLA's partitioning;
- ``memory --measure``: the estimate of the persistent state equals the live bytes and the compiled arguments;
- ``record --candidate step`` then ``verify --against``: the replay matches its recording;
- ``train``: the strategy and the baseline stay within tolerance at every step;
- the pytest plugin: one generated test file, ``shardcheck_mesh`` and ``assert_step_parity`` on every zoo step.

The CLI runs in this process (``shardcheck.cli.main``), so the tests share JAX's caches; the suite's conftest
turns the CLI's persistent compilation cache off.
"""

import json
import math
import os
from pathlib import Path

import pytest
from conftest import require_devices, zoo_module

from shardcheck import check_parity, make_mesh
from shardcheck.cli import main
from shardcheck.parity import shared_reference

ZOO = Path(__file__).resolve().parents[1] / "examples" / "zoo"
FILES = sorted(p for p in ZOO.glob("*.py") if not p.name.startswith("_"))
BUILTINS = ("simulation", "dp", "fsdp", "gspmd", "accumulation")
MAX_DEVICES = 8

pytest_plugins = ["pytester"]


MODULES = {path.stem: zoo_module(path) for path in FILES}
# Each model's tests run on one pytest-xdist worker (``--dist loadgroup``, pyproject.toml): they compile the same
# programs (its reference step, the built-ins on its mesh), which the worker's compilation cache (tests/conftest.py)
# then loads in the model's later tests instead of compiling them again on the other worker.
zoo = pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.xdist_group(n)) for n in sorted(MODULES)]
)
needs_devices = require_devices(MAX_DEVICES)


def _mesh_arg(name: str) -> str:
    return ",".join(f"{axis}={size}" for axis, size in MODULES[name].MESH.items())


def _task(name: str) -> str:
    return f"{ZOO / name}.py:task"


def _step(name: str) -> str:
    return f"{ZOO / name}.py:step"


def test_every_zoo_file_follows_the_layout():
    assert {"rng_lm", "scan_lm", "stacked_lm", "tied_lm"} <= set(MODULES)
    for name, module in MODULES.items():
        assert module.__doc__ and f"--task examples/zoo/{name}.py:task" in module.__doc__, name
        assert callable(module.step) and module.FAULTS, name
        assert math.prod(module.MESH.values()) <= MAX_DEVICES, name
        for fault, (faulty_step, code) in module.FAULTS.items():
            assert callable(faulty_step) and isinstance(code, str), (name, fault)


def _verify_json(argv: list[str], out: Path) -> tuple[int, dict]:
    code = main([*argv, "--json", str(out)])
    return code, json.loads(out.read_text())


def _assert_rows(code: int, report: dict, expected: tuple[str, ...]) -> None:
    """Every expected row is there; a built-in PASSes, or is an ERROR row with a one-line reason, or a REFUSED row
    (a documented limitation: the loss couples the rows); the user's step PASSes; the exit status is the worst
    counted row's (a REFUSED row is not counted)."""
    rows = report["strategies"]
    assert set(rows) == set(expected), rows.keys()
    errors = []
    for label, row in rows.items():
        if row["ok"]:
            assert row["verdict"].startswith("PASS") and row["codes"][0] == "parity", (label, row["codes"])
            continue
        assert label in BUILTINS, (label, row.get("verdict"), row.get("diagnosis"))  # never the user's step
        assert row["verdict"] in ("ERROR", "REFUSED"), (label, row["verdict"], row["diagnosis"])
        assert row["error"]["builtin"] is True, row["error"]
        assert row["error"]["refused"] == (row["verdict"] == "REFUSED"), row["error"]
        if row["verdict"] == "ERROR":
            assert "\n" not in row["error"]["message"], row["error"]
            errors.append(label)
    assert code == (2 if errors else 0), (code, errors)


@needs_devices
@zoo
def test_verify_every_builtin_and_the_users_step_in_one_run(name, tmp_path):
    argv = ["verify", "--task", _task(name), "--mesh", _mesh_arg(name), "--candidate", _step(name)]
    code, report = _verify_json(argv, tmp_path / "v.json")
    _assert_rows(code, report, (*BUILTINS, "candidate"))
    assert report["strategies"]["candidate"]["ok"] is True
    if name == "rng_lm":  # the regression below on its 2-D mesh, data=2,fsdp=4: every built-in PASSes
        _assert_every_builtin_passes(code, report, (*BUILTINS, "candidate"))


def _assert_every_builtin_passes(code: int, report: dict, expected: tuple[str, ...]) -> None:
    assert code == 0, report
    assert report["num_shards"] == 8
    assert set(report["strategies"]) == set(expected)
    assert all(row["verdict"] == "PASS" for row in report["strategies"].values()), report["strategies"]


@needs_devices
@pytest.mark.xdist_group("rng_lm")
def test_every_builtin_on_a_model_holding_rng_streams(tmp_path):
    """Regression (fixed in db54fe6): with a model holding RNG keys (Dropout and MultiHeadAttention built with
    ``rngs``), the shared reference compared starting states through NumPy and ``verify`` of every built-in
    exited 2 with "JAX array with PRNGKey dtype cannot be converted to a NumPy array". Here on a 1-D placement
    (``--devices 8``); on the 2-D one (rng_lm's ``MESH``, ``data=2,fsdp=4``) in the one-run test above, whose
    verify of every built-in is that check with the user's step added."""
    code, report = _verify_json(["verify", "--task", _task("rng_lm"), "--devices", "8"], tmp_path / "r.json")
    _assert_every_builtin_passes(code, report, BUILTINS)


@needs_devices
@zoo
def test_each_planted_fault_fails_with_its_cause(name):
    module = MODULES[name]
    mesh = make_mesh(module.MESH)
    with shared_reference():  # one reference run for all the faults of a model
        for fault, (faulty_step, expected) in module.FAULTS.items():
            report = check_parity(faulty_step, module.task, mesh=mesh, name=fault)
            codes = [d.code for d in report.diagnoses]
            assert report.verdict == "FAIL" and codes[0] == expected, (
                fault,
                codes,
                report.diagnoses[0].message,
            )


@needs_devices
@zoo
def test_the_users_step_against_xlas_partitioning(name, tmp_path):
    argv = ["verify", "--task", _task(name), "--mesh", _mesh_arg(name), "--candidate", _step(name)]
    code, report = _verify_json([*argv, "--reference", "gspmd", "--strategies", "none"], tmp_path / "g.json")
    _assert_rows(code, report, ("candidate",))


@needs_devices
@zoo
def test_memory_estimate_equals_the_measured_state(name, tmp_path):
    out = tmp_path / "m.json"
    assert (
        main(["memory", "--task", _task(name), "--mesh", _mesh_arg(name), "--measure", "--json", str(out)])
        == 0
    )
    (row,) = json.loads(out.read_text())["strategies"].values()
    persistent, measured, compiled = row["persistent_bytes"], row["measured"], row["ahead_of_time"]
    assert measured["estimated_persistent_bytes"] == persistent == measured["state_bytes"]
    assert measured["state_bytes_per_device"] == [persistent] * math.prod(MODULES[name].MESH.values())
    assert measured["accuracy_ratio"] == 1.0
    assert compiled["state_argument_bytes"] == compiled["persistent_bytes"] == persistent


@needs_devices
@zoo
def test_record_then_verify_against_the_recording(name, tmp_path, capsys):
    """The user's step replayed against its own recording matches bit for bit; against a recording of the
    built-in ``fsdp`` (a refactor that changed the placement, not the values) it PASSes, the placement a note.
    A model whose forward pass writes a counter is refused by ``record --strategy fsdp`` as by the live check
    (fsdp's shard_map does not carry that state out: its recording would hold 0 forward passes)."""
    mesh = ["--mesh", _mesh_arg(name)]
    for recorded in (["--candidate", _step(name)], ["--strategy", "fsdp"]):
        run = tmp_path / f"{recorded[-1].rsplit(':', 1)[-1]}.npz"
        code = main(["record", "--task", _task(name), *mesh, *recorded, "--out", str(run)])
        if name == "counter" and recorded[0] == "--strategy":
            err = " ".join(capsys.readouterr().err.split())
            assert (
                code == 2
                and "fsdp: cannot run this model: its forward pass writes non-parameter state" in err
            )
            assert not run.exists()
            continue
        assert code == 0
        argv = ["verify", "--task", _task(name), "--against", str(run), "--candidate", _step(name)]
        code, report = _verify_json([*argv, "--strategies", "none"], tmp_path / f"{run.stem}.json")
        assert set(report["strategies"]) == {"candidate"}, report["strategies"].keys()
        row = report["strategies"]["candidate"]
        assert code == 0 and row["ok"] is True, (recorded, row["verdict"], row["cause"])
        if recorded[0] == "--candidate":
            assert row["bitwise"] is True


@needs_devices
@zoo
def test_train_stays_within_tolerance(name, capsys):
    """``train`` with its default strategy (fsdp) stays within tolerance; a model whose forward pass writes a
    counter is refused by fsdp, as ``record --strategy fsdp`` and the live check refuse it, and trains under gspmd,
    which carries that state out (trial 52: train had refused a BatchNorm model for every strategy, gspmd too,
    and had not read what the forward pass writes)."""
    argv = ["train", "--task", _task(name), "--mesh", _mesh_arg(name), "--epochs", "1", "--json", "-"]
    if name == "counter":
        assert main(argv) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert (
            "error: fsdp: cannot run this model: its forward pass writes non-parameter state (calls)" in err
        )
        argv += ["--strategy", "gspmd"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == len(MODULES[name].task.batches)
    assert report["loss_curves_agree"] is True and report["first_exceeded_step"] is None
    assert not any(s["drift_exceeded"] for s in report["steps"])


PLUGIN_TEST = """
import importlib.util
import sys

import pytest

import shardcheck

FILES = {files!r}
sys.path.insert(0, {folder!r})  # the zoo's shared steps, _lm_steps.py


def _load(path):
    spec = importlib.util.spec_from_file_location("zoo_" + path.rsplit("/", 1)[-1][:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", FILES)
def test_zoo_step(path, shardcheck_mesh):
    zoo = _load(path)
    shardcheck.assert_step_parity(zoo.step, zoo.task, mesh=shardcheck_mesh(zoo.MESH))

"""


def test_the_pytest_plugin_checks_every_zoo_step(pytester, monkeypatch):
    """A user's own test file, run by ``pytest -p shardcheck`` in a fresh process: zoo steps PASS (the faults, and
    every step, are checked in-process above). The fresh process reads and writes the test session's compilation
    cache (tests/conftest.py), so the programs the in-process tests compiled (the same steps, the same
    references) load instead of compiling again: what runs, and what is asserted, are unchanged."""
    cache = os.environ.get("SHARDCHECK_TEST_XLA_CACHE", "off")
    if cache != "off":  # JAX reads its options from these variables when it starts
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", cache)
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # two of the zoo's steps (24 s for all of them; each one's PASS is checked in-process above): the suite's time
    files = [str(p) for p in FILES if p.stem in ("rng_lm", "tied_lm")]
    assert len(files) == 2
    pytester.makepyfile(test_zoo_steps=PLUGIN_TEST.format(files=files, folder=str(ZOO)))
    flags = ("-p", "shardcheck", "-p", "no:xdist", "-p", "no:cacheprovider", "--shardcheck-devices", "8")
    result = pytester.runpytest_subprocess(*flags, timeout=1200)
    result.assert_outcomes(passed=len(files))
