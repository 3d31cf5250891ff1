"""Trial 49: the command line's device and precision handling.

1. With the jax CUDA plugin installed and no CUDA, every command printed the plugin's ~25-line start-up traceback
   (:func:`shardcheck.gpu_target.quiet_without_cuda` now prepares the environment before JAX starts).
2. ``memory --task FILE --mesh ... --batch 8`` was refused naming ``--batch-size``, which works with a task file.
3. Conflicting flags were accepted silently: ``--device-memory`` of one kind beside ``--target`` of another,
   ``--devices`` against ``--mesh``; ``--shards 4 --devices 2 --measure`` advised ``--devices 4`` only.
4. ``--matmul-precision`` refused JAX's own names ``'highest'`` and ``'tensorfloat32'``.
5. A stated precision coarser than the backend's own widened the tolerances without a word.
6. ``memory --target`` printed no ``devices:`` line, and its ``--json`` had no ``"devices"``.

The plugin's tests run ``shardcheck`` in a subprocess with the plugin's folder on ``PYTHONPATH`` (``.ci/gpu-aot``,
as tests/test_gpu_target.py does), and skip, saying why, without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import require_devices
from test_gpu_target import ROOT, _plugin_folder, needs_plugin

from shardcheck import gpu_target
from shardcheck.cli import main
from shardcheck.parity.tolerance import matmul

TINY_TASK = """
import numpy as np
import optax
from flax import nnx

import shardcheck


def loss_fn(model, batch):
    return (model(batch["x"]) ** 2).mean()


task = shardcheck.Task(
    model=lambda: nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
    optimizer=optax.sgd(0.1),
    loss_fn=loss_fn,
    batches=[{"x": np.ones((8, 4), np.float32)}],
)
"""


def _with_plugin(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python ARGV`` with the plugin's folder on ``PYTHONPATH`` and no JAX platform or CUDA check settings."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    }
    folder = _plugin_folder()
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------------------------- 1. the CUDA plugin, no CUDA


@pytest.mark.parametrize(
    ("installed", "driver", "environ", "prepared", "after"),
    [
        (
            True,
            False,
            {},
            True,
            {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"},
        ),  # a CPU-only machine with the plugin
        (True, True, {}, False, {}),  # a GPU host: the plugin checks CUDA's versions as it always did
        (
            True,
            False,
            {"JAX_PLATFORMS": "cpu"},
            False,
            {"JAX_PLATFORMS": "cpu"},
        ),  # JAX skips the plugin's check
        (False, False, {}, False, {}),  # no plugin: nothing to quiet
        (
            True,
            False,
            {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "0"},
            True,
            {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "0"},
        ),
    ],
)
def test_quiet_without_cuda_prepares_only_a_machine_without_the_driver(
    monkeypatch, installed, driver, environ, prepared, after
):
    monkeypatch.setattr(gpu_target, "plugin_installed", lambda: installed)
    monkeypatch.setattr(gpu_target, "cuda_driver_loadable", lambda: driver)
    environ = dict(environ)
    assert gpu_target.quiet_without_cuda(environ) is prepared
    assert environ == after


@needs_plugin
def test_jax_with_the_plugin_and_no_cuda_logs_the_traceback_which_quiet_without_cuda_removes():
    """Both ways: JAX alone logs the plugin's traceback on this machine; prepared first, it does not, and its
    default backend is the CPU, as without the plugin."""
    if gpu_target.cuda_driver_loadable():
        pytest.skip("the CUDA driver loads on this machine: the plugin starts without the traceback anyway")
    plain = _with_plugin("-c", "import jax; print(jax.default_backend())")
    assert "Jax plugin configuration error" in plain.stderr and "Unable to load CUDA" in plain.stderr
    quiet = _with_plugin(
        "-c",
        "from shardcheck.gpu_target import quiet_without_cuda; print(quiet_without_cuda()); import jax; "
        "print(jax.default_backend(), jax.device_count())",
    )
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stdout.split() == ["True", "cpu", "1"]
    assert "Traceback" not in quiet.stderr and "plugin configuration error" not in quiet.stderr


@needs_plugin
def test_verify_with_the_plugin_and_no_cuda_passes_without_the_traceback():
    if gpu_target.cuda_driver_loadable():
        pytest.skip("the CUDA driver loads on this machine: the plugin starts without the traceback anyway")
    out = _with_plugin("-m", "shardcheck", "verify", "--devices", "2", "--steps", "1", "--strategies", "dp")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "plugin configuration error" not in text
    assert "shardcheck verify dp: PASS" in out.stdout
    assert "devices: 2 x cpu (fake CPU devices)" in " ".join(out.stdout.split())


# ---------------------------------------------------------------------------------- 2. --batch against --batch-size


def test_memory_refuses_batch_with_a_task_file_naming_batch(tmp_path, capsys):
    f = tmp_path / "tiny_task.py"
    f.write_text(TINY_TASK)
    assert main(["memory", "--task", f"{f}:task", "--mesh", "fsdp=4", "--batch", "8"]) == 2
    assert _err(capsys) == (
        "error: shardcheck memory: --batch applies to a built-in --task only; a task file brings its own batches "
        "(--batch-size sets the global batch of the ahead-of-time compile, for a task file too)"
    )


@require_devices(2)
def test_memory_compiles_a_task_file_at_its_batch_size(tmp_path, capsys):
    f = tmp_path / "tiny_task.py"
    f.write_text(TINY_TASK)
    args = ["memory", "--task", f"{f}:task", "--mesh", "fsdp=2", "--strategy", "fsdp", "--json", "-"]
    assert main([*args, "--batch-size", "12"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategies"]["fsdp"]["ahead_of_time"]["batch_size"] == 12
    assert report["batch_size"] == 8  # the task's own batch, which --batch-size does not change
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["strategies"]["fsdp"]["ahead_of_time"]["batch_size"] == 8


def test_memory_batch_size_help_says_it_applies_to_a_task_file(capsys):
    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "global batch of the ahead-of-time compile with --mesh, of any task (a task file's too)" in text
    assert "not with a task file, which brings its own batches" in text


# ---------------------------------------------------------------------------------- 3. flags that disagree


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--device-memory", "h100", "--target", "h200"],
            "--device-memory h100 and --target h200 name different devices; name one: --device-memory h200 "
            "(compiles for h200 and gives its fit), or --target h200 with --device-memory as a size (e.g. 80GiB)",
        ),
        (
            ["--device-memory", "tpu-v4", "--target", "h100"],
            "--device-memory tpu-v4 and --target h100 name different devices; name one: --device-memory h100 "
            "(compiles for h100 and gives its fit), or --target h100 with --device-memory as a size (e.g. 80GiB)",
        ),
        (
            ["--devices", "2"],
            "--mesh fsdp=4 has 4 devices but --devices 2 was given; they must agree (drop --devices: --mesh sets it)",
        ),
    ],
)
def test_memory_refuses_flags_that_disagree_with_the_mesh(flags, message, capsys):
    assert main(["memory", "--task", "tiny-lm", "--size", "tiny", "--mesh", "fsdp=4", *flags]) == 2
    assert _err(capsys) == f"error: shardcheck memory: {message}"


def test_memory_refuses_shards_and_devices_that_disagree_under_measure(capsys):
    assert main(["memory", "--in", "64", "--out", "64", "--shards", "4", "--measure", "--devices", "2"]) == 2
    assert _err(capsys) == (
        "error: shardcheck memory: --shards 4 and --devices 2 disagree: --measure runs each strategy on S = "
        "--shards devices; pass the same number to both (or drop --devices: it defaults to --shards)"
    )


@require_devices(2)
def test_memory_takes_agreeing_flags(capsys):
    """The other way: the same kind twice, and --devices equal to the mesh's or the shards' count, run."""
    assert main(["memory", "--in", "64", "--out", "64", "--shards", "2", "--measure", "--devices", "2"]) == 0
    assert "devices: 2 x cpu" in capsys.readouterr().out
    assert (
        main(["memory", "--in", "64", "--out", "64", "--shards", "4", "--devices", "2"]) == 0
    )  # nothing runs
    capsys.readouterr()
    if gpu_target.plugin_installed():
        pytest.skip(
            "the plugin is installed in this environment: --target compiles deviceless (tested below)"
        )
    args = [
        "memory",
        "--size",
        "tiny",
        "--mesh",
        "fsdp=2",
        "--devices",
        "2",
        "--strategy",
        "fsdp",
        "--json",
        "-",
    ]
    assert main([*args, "--device-memory", "H100", "--target", "h100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiler"]["target"] == "h100" and report["compiler"]["name"] == "XLA:CPU"
    assert report["strategies"]["fsdp"]["device_memory"]["device"].startswith("NVIDIA H100")
    assert report["devices"]["platform"] == "cpu" and "deviceless" not in report["devices"]


def test_a_negative_value_after_its_option_gets_the_options_own_message(capsys):
    """Trial 50: ``--device-memory -5GB`` got argparse's "expected one argument" (it read -5GB as an option);
    the value now reaches the option's own check, as ``--device-memory=-5GB`` did."""
    for flags in (["--device-memory", "-5GB"], ["--device-memory=-5GB"]):
        assert main(["memory", "--task", "tiny-lm", "--size", "tiny", "--mesh", "fsdp=4", *flags]) == 2
        assert _err(capsys).startswith(
            "error: shardcheck memory: --device-memory '-5GB' is negative: a device's memory is a positive size; "
            "use a size such as 80GiB"
        )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["verify", "--devices", "abc"],
            "invalid int value: 'abc'; --devices takes a whole number, e.g. --devices 4",
        ),
        (["train", "--lr", "fast"], "invalid float value: 'fast'; --lr takes a number, e.g. --lr 0.01"),
        (["memory", "--batch-size", "1.5"], "--batch-size takes a whole number, e.g. --batch-size 4"),
    ],
)
def test_a_value_of_another_type_is_told_what_the_option_takes(argv, said, capsys):
    """Trial 58 D: ``--devices abc`` read argparse's bare "invalid int value: 'abc'", no fix."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(said)


def test_a_command_after_a_bare_double_dash_is_passed_on_as_written():
    """``shardcheck launch ... -- COMMAND``: the command's own arguments are not joined (its parser may not read
    ``--flag=value``); before the ``--`` they are."""
    from shardcheck.cli import _negative_values_joined

    argv = ["launch", "--processes", "-2", "--", "python", "check.py", "--threshold", "-1e-3"]
    assert _negative_values_joined(argv) == [
        "launch",
        "--processes=-2",
        "--",
        "python",
        "check.py",
        "--threshold",
        "-1e-3",
    ]


# ---------------------------------------------------------------------------------- 4. JAX's precision names


def test_check_policy_takes_jax_names_of_the_same_precisions():
    assert matmul.check_policy("check_parity", "highest") == "float32"
    assert matmul.check_policy("check_parity", "TensorFloat32") == "tf32"
    assert matmul.check_policy("check_parity", "bfloat16") == "bfloat16"
    for name in ("high", "default"):
        with pytest.raises(ValueError) as err:
            matmul.check_policy("check_parity", name)
        assert str(err.value) == (
            f"check_parity: matmul_precision={name!r} is not a matmul precision; pass None (what the backend "
            "uses), 'float32', 'tf32', 'bfloat16', or JAX's 'highest' (float32), 'tensorfloat32' (tf32) "
            "('default' and 'high' depend on the backend: pass None, or the precision it computes)"
        )


@require_devices(2)
def test_verify_takes_highest_as_float32_and_says_so_in_help(capsys):
    args = ["verify", "--devices", "2", "--strategies", "dp", "--steps", "1", "--json", "-"]
    assert main([*args, "--matmul-precision", "highest"]) == 0
    dp = json.loads(capsys.readouterr().out)["strategies"]["dp"]
    assert (dp["matmul_precision"], dp["matmul_precision_source"]) == ("float32", "set by the caller")
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "tf32 (a GPU's default; JAX's 'tensorfloat32')" in text and "float32 (a CPU; JAX's 'highest')" in text
    )
    with pytest.raises(SystemExit):
        main(["verify", "--matmul-precision", "high"])
    assert "invalid choice: 'high'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- 5. coarser than the backend


COARSER_ON_CPU = (
    "set by the caller; coarser than the backend's own (float32 on cpu): the tolerances are tf32's"
)


@require_devices(2)
def test_verify_says_a_stated_precision_is_coarser_than_the_cpus(capsys):
    args = ["verify", "--devices", "2", "--strategies", "dp", "--steps", "1", "--json", "-"]
    assert main([*args, "--matmul-precision", "tensorfloat32"]) == 0
    dp = json.loads(capsys.readouterr().out)["strategies"]["dp"]
    assert (dp["matmul_precision"], dp["matmul_precision_source"]) == ("tf32", COARSER_ON_CPU)
    assert main(args[:-2] + ["--matmul-precision", "tf32"]) == 0
    assert f"matmul precision tf32 ({COARSER_ON_CPU})" in " ".join(capsys.readouterr().out.split())


def test_resolve_names_a_coarser_precision_only_where_the_backend_computes_finer(monkeypatch):
    from shardcheck.tasks import load_task

    task = load_task("diabetes")
    call = (task.loss_fn, task.model(), task.batches[0], None)
    assert matmul.resolve("check_parity", "tf32", *call) == ("tf32", COARSER_ON_CPU, "tf32")
    assert matmul.resolve("check_parity", "float32", *call) == ("float32", "set by the caller", "float32")
    monkeypatch.setattr(
        matmul, "platforms_of", lambda devices: {("gpu", "9.0")}
    )  # a GPU computes tf32 itself
    assert matmul.resolve("check_parity", "tf32", *call) == ("tf32", "set by the caller", "float32")
    bf16 = "set by the caller; coarser than the backend's own (tf32 on gpu): the tolerances are bfloat16's"
    assert matmul.resolve("check_parity", "bfloat16", *call) == ("bfloat16", bf16, "bfloat16")


# ---------------------------------------------------------------------------------- 6. memory --target's devices


@needs_plugin
def test_memory_target_names_the_gpu_it_compiled_for(tmp_path):
    args = ["--size", "tiny", "--mesh", "fsdp=2", "--target", "h100", "--strategy", "fsdp"]
    out = _with_plugin("-m", "shardcheck", "memory", *args, "--json", str(tmp_path / "m.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "m.json").read_text())
    why = "compiled for h100 (XLA:GPU, deviceless: compile-only devices of the jax CUDA plugin; nothing ran)"
    assert report["devices"] == {
        "platform": "gpu",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "count": 2,
        "fake": False,
        "host_platform": "cpu",
        "host_count": 2,
        "requested": None,
        "single_device": None,
        "why": why,
        "deviceless": True,
        "target": "h100",
    }
    assert f"devices: 2 x gpu, {why}" in " ".join(out.stdout.split())  # the report, beside the JSON file
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------- 7. one device: no reduction


@require_devices(2)
def test_verify_on_one_device_notes_that_no_reduction_was_exercised(capsys):
    """Trial 49: ``verify --devices 1`` passed every strategy at S=1 without a word that nothing was split: no
    collective ran, and a sum for a mean (x S = x1) could not show. Now a note and ``reduction_exercised: false``;
    on 2 devices neither the note nor ``false``."""
    args = ["verify", "--strategies", "dp", "--steps", "1", "--json", "-"]
    assert main([*args, "--devices", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["reduction_exercised"] is False
    err = " ".join(out.err.split())
    assert "note: S=1, one device: every strategy ran unsplit, so no all-reduce" in err
    assert "pass --devices 2 or more" in err
    assert main([*args, "--devices", "2"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["reduction_exercised"] is True and "S=1, one device" not in out.err


# ---------------------------------------------------------------------------------- 8. the extra on a CPU machine


def test_the_cuda_plugin_alone_without_a_driver_is_no_accelerator(monkeypatch):
    """Trial 49: with the gpu-aot extra installed on a CPU-only machine, ``accelerator_installed()`` was True, so
    the command line kept XLA:CPU's compile flags and the collective watchdog off. The CUDA plugin alone counts
    only where the CUDA driver loads; another plugin, or JAX_PLATFORMS naming an accelerator, still counts."""
    from shardcheck.cli import _xla

    env = {}
    monkeypatch.setattr(_xla, "installed_plugins", lambda: frozenset({"xla_cuda12"}))
    monkeypatch.setattr(gpu_target, "cuda_driver_loadable", lambda: False)
    assert _xla.accelerator_installed(env) is False  # so the CPU compile flags and the watchdog apply
    assert _xla.accelerator_installed({"JAX_PLATFORMS": "cuda"}) is True
    monkeypatch.setattr(gpu_target, "cuda_driver_loadable", lambda: True)  # a GPU host
    assert _xla.accelerator_installed({}) is True and _xla.use_cpu_compile_flags({}) is False
    assert _xla.accelerator_installed({"JAX_PLATFORMS": "cpu"}) is False
    monkeypatch.setattr(gpu_target, "cuda_driver_loadable", lambda: False)
    monkeypatch.setattr(_xla, "installed_plugins", lambda: frozenset({"xla_cuda12", "xla_rocm"}))
    assert _xla.accelerator_installed({}) is True


@needs_plugin
def test_the_installed_extra_is_found_as_the_cuda_plugin_and_no_accelerator_here():
    """The extra's own folder (``.ci/gpu-aot``): its plugin is found by name, and where the CUDA driver does not
    load (CI's CPU-only machine) it is no accelerator."""
    code = (
        "from shardcheck.cli._xla import accelerator_installed, installed_plugins; "
        "print(sorted(installed_plugins()), accelerator_installed())"
    )
    env = {**os.environ, "PYTHONPATH": str(_plugin_folder())}
    env.pop("JAX_PLATFORMS", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    expected = gpu_target.cuda_driver_loadable()  # False on CI's CPU-only machine; a GPU host has the driver
    assert done.stdout.strip() == f"['xla_cuda12'] {expected}", done.stderr
