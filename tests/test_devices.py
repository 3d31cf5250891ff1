"""Device selection on the host you have (#35): the default backend's devices when they are enough for the mesh,
else fake CPU devices beside the accelerator, named in every command's output.

A GPU host is faked by replacing :mod:`shardcheck.devices`' view of JAX (``_host_platform``,
``_platform_devices``): the default backend reports one ``gpu`` device (an object that is no JAX device, so a mesh
that took it would fail), and the CPU backend lists the suite's 8 real CPU devices.
"""

import json

import jax
import pytest

from shardcheck import devices as devices_module
from shardcheck.cli import main
from shardcheck.devices import select_devices
from shardcheck.mesh import make_mesh


class FakeGpu:
    """A stand-in for one GPU: only what the selection reads (``platform``)."""

    platform = "gpu"
    id = 0
    device_kind = "NVIDIA H200"

    def __repr__(self) -> str:
        return "FakeGpu(id=0)"


def _fake_host(platforms: dict):
    def platform_devices(platform: str) -> list:
        if platform == "cpu":
            return list(jax.devices("cpu"))
        if platform not in platforms:
            raise RuntimeError(f"Unknown backend {platform}")
        return platforms[platform]

    return platform_devices


@pytest.fixture
def gpu_host(monkeypatch):
    """A host whose default backend is one GPU, with the suite's 8 CPU devices beside it."""
    monkeypatch.setattr(devices_module, "_host_platform", lambda: "gpu")
    monkeypatch.setattr(devices_module, "_platform_devices", _fake_host({"gpu": [FakeGpu()]}))
    yield
    jax.config.update("jax_default_device", None)  # a CPU mesh on the "GPU host" moved the default device


@pytest.fixture
def eight_gpu_host(monkeypatch):
    """A host with 8 GPUs (fake objects): enough for any mesh of the tests, so only --platform cpu is testable."""
    gpus = [FakeGpu() for _ in range(8)]
    monkeypatch.setattr(devices_module, "_host_platform", lambda: "gpu")
    monkeypatch.setattr(devices_module, "_platform_devices", _fake_host({"gpu": gpus}))
    yield
    jax.config.update("jax_default_device", None)


# --- the selection itself ---------------------------------------------------------------------------------------


def test_the_default_backend_when_it_has_enough():
    choice = select_devices(4)
    assert choice.platform == "cpu" and choice.devices == tuple(jax.devices()[:4])
    assert choice.line() == "devices: 4 x cpu (fake CPU devices)"
    assert select_devices(1).line() == "devices: 1 x cpu"


def test_one_gpu_and_a_mesh_of_8_gives_8_cpu_devices(gpu_host):
    choice = select_devices(8, what="the mesh data=2,fsdp=4")
    assert choice.platform == "cpu" and choice.devices == tuple(jax.devices("cpu"))
    assert choice.line() == (
        "devices: 8 x cpu (fake CPU devices; the host's 1 x gpu is too few for the mesh data=2,fsdp=4; the "
        "single-device steps run on cpu:0 too)"
    )
    assert choice.to_dict() == {
        "platform": "cpu",
        "device_kind": "cpu",
        "count": 8,
        "fake": True,
        "host_platform": "gpu",
        "host_count": 1,
        "requested": None,
        "single_device": "cpu:0",
        "why": choice.why(),
    }
    one = select_devices(1)  # a step that runs alone: the GPU is enough
    assert one.platform == "gpu" and one.line() == "devices: 1 x gpu (NVIDIA H200)"


def test_make_mesh_on_a_gpu_host_never_mixes_in_the_gpu(gpu_host):
    mesh = make_mesh({"data": 2, "fsdp": 4})
    assert {d.platform for d in mesh.devices.flat} == {"cpu"} and mesh.size == 8
    assert list(make_mesh(2, devices=jax.devices("cpu")[2:]).devices) == jax.devices("cpu")[2:4]


def test_platform_cpu_forces_cpu_where_the_gpus_are_enough(eight_gpu_host):
    assert select_devices(8).line() == "devices: 8 x gpu (NVIDIA H200)"
    choice = select_devices(8, platform="cpu")
    assert choice.platform == "cpu" and choice.requested == "cpu"
    assert "platform='cpu'; the host's default is 8 x gpu" in choice.line()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(needed=2, platform="tpu"),
            "select_devices: platform='tpu': this host has no tpu devices (JAX's default backend is 1 x gpu); "
            "omit it to use the default",
        ),
        (
            dict(needed=2, platform="gpu"),
            "select_devices: a mesh of 2 devices needs 2 devices, but the host has 1 x gpu; use platform='cpu' to "
            "run the mesh on 2 fake CPU devices",
        ),
        (
            dict(needed=16),
            "select_devices: a mesh of 16 devices needs 16 devices; the 1 x gpu are too few and 8 CPU device(s) "
            "exist; fake 16 CPU devices with jax.config.update('jax_num_cpu_devices', 16)",
        ),
        (dict(needed=2, platform="npu"), "platform must be one of cpu, gpu, tpu or None, got 'npu'"),
        (dict(needed=0), "needed must be an int >= 1"),
    ],
)
def test_what_cannot_work_says_what_will(gpu_host, kwargs, message):
    with pytest.raises(ValueError) as info:
        select_devices(**kwargs)
    assert message in str(info.value)
    assert "or fewer" not in str(info.value)


# --- every command ------------------------------------------------------------------------------------------------

CPU_MESH_OF_2 = (
    "devices: 2 x cpu (fake CPU devices; the host's 1 x gpu is too few for a mesh of 2 devices; the "
    "single-device steps run on cpu:0 too)"
)


def _devices_json(text: str) -> dict:
    return json.loads(text)["devices"]


def test_run_on_one_gpu_builds_a_cpu_mesh(gpu_host, capsys):
    assert main(["run", "--json", "-"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["devices"]["platform"] == "cpu" and report["devices"]["count"] == 2
    assert report["devices"]["host_platform"] == "gpu"
    for name in ("dp", "fsdp"):
        assert report["results"][name]["max_abs_param_diff_vs_baseline"] < 1e-6
    jax.config.update("jax_default_device", None)  # as in a fresh process
    assert main(["run", "--strategy", "dp"]) == 0
    assert CPU_MESH_OF_2 in capsys.readouterr().out.replace("\n", " ")


def test_verify_on_one_gpu_with_8_devices_passes_on_a_cpu_mesh(gpu_host, capsys):
    """The issue's `verify --devices 8` on a one-GPU host: once 'pass --devices 1 or fewer', now a CPU mesh."""
    args = ["verify", "--steps", "1", "--batch-size", "8", "--strategies", "dp,fsdp", "--devices", "8"]
    assert main([*args, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and set(report["strategies"]) == {"dp", "fsdp"}
    assert report["devices"] == {
        "platform": "cpu",
        "device_kind": "cpu",
        "count": 8,
        "fake": True,
        "host_platform": "gpu",
        "host_count": 1,
        "requested": None,
        "single_device": "cpu:0",
        "why": "fake CPU devices; the host's 1 x gpu is too few for a mesh of 8 devices; the single-device steps "
        "run on cpu:0 too",
    }
    jax.config.update("jax_default_device", None)
    assert main([*args, "--mesh", "data=2,fsdp=4", "--devices", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "devices: 8 x cpu (fake CPU devices; the host's 1 x gpu is too few for the mesh data=2,fsdp=4;" in out
    )


def test_verify_platform_cpu_forces_cpu_and_a_missing_platform_exits_2(eight_gpu_host, capsys):
    args = ["verify", "--steps", "1", "--batch-size", "8", "--strategies", "dp"]
    assert main([*args, "--platform", "cpu", "--json", "-"]) == 0
    devices = _devices_json(capsys.readouterr().out)
    assert (devices["platform"], devices["count"], devices["requested"]) == ("cpu", 2, "cpu")
    assert devices["why"].startswith("fake CPU devices; --platform cpu; the host's default is 8 x gpu")
    assert main([*args, "--platform", "tpu"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "shardcheck verify: --platform tpu: this host has no tpu devices (JAX's default backend is 8 x gpu); "
        "omit it to use the default" in err
    )


def test_a_gpu_platform_on_one_gpu_says_what_works(gpu_host, capsys):
    assert (
        main(["verify", "--steps", "1", "--batch-size", "8", "--strategies", "dp", "--platform", "gpu"]) == 2
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "shardcheck verify: a mesh of 2 devices needs 2 devices, but the host has 1 x gpu; use --platform cpu to "
        "run the mesh on 2 fake CPU devices" in err
    )
    assert "fewer" not in err


def test_train_on_one_gpu_builds_a_cpu_mesh(gpu_host, capsys):
    args = ["train", "--strategy", "fsdp", "--epochs", "1", "--batch-size", "64", "--devices", "4"]
    assert main([*args, "--json", "-"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["devices"]["platform"] == "cpu" and report["devices"]["count"] == 4
    assert report["final"]["max_abs_param_diff"] < 1e-5
    assert "devices: 4 x cpu (fake CPU devices; the host's 1 x gpu is too few" in " ".join(out.err.split())


def test_record_and_replay_on_one_gpu_name_the_cpu_mesh(gpu_host, tmp_path, capsys):
    recording = tmp_path / "run.npz"
    args = ["--steps", "2", "--batch-size", "8"]
    assert main(["record", *args, "--mesh", "fsdp=4", "--out", str(recording)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "devices: 4 x cpu (fake CPU devices; the host's 1 x gpu is too few for the mesh fsdp=4;" in out
    from shardcheck.parity.harness.recorded import load_recording

    platform = load_recording(recording).meta["platform"]
    assert (platform["backend"], platform["devices"]) == ("cpu", 4)
    jax.config.update("jax_default_device", None)
    assert main(["verify", *args, "--against", str(recording), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["devices"]["platform"] == "cpu" and report["devices"]["count"] == 4


def test_memory_measure_on_one_gpu_measures_on_cpu_devices(gpu_host, capsys):
    args = ["memory", "--in", "16", "--out", "6", "--shards", "4", "--devices", "4", "--optimizer", "adam"]
    assert main([*args, "--measure", "--strategy", "zero2", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["strategies"]["zero2"]["measured"]
    assert (
        m["state_bytes_per_device"] == [656] * 4
    )  # the figures of tests/test_cli_memory.py, on 4 CPU devices
    assert report["devices"]["platform"] == "cpu" and report["devices"]["count"] == 4
    assert report["devices"]["host_platform"] == "gpu"
    assert main([*args, "--strategy", "zero2", "--json", "-"]) == 0  # estimates only: no device ran anything
    assert "devices" not in json.loads(capsys.readouterr().out)


def test_memory_mesh_on_one_gpu_compiles_on_the_cpu_mesh(gpu_host, capsys):
    assert (
        main(["memory", "--task", "diabetes", "--mesh", "data=2,fsdp=2", "--strategy", "fsdp", "--json", "-"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == {"data": 2, "fsdp": 2}
    assert report["devices"]["platform"] == "cpu" and report["devices"]["count"] == 4
    assert report["devices"]["why"].startswith(
        "fake CPU devices; the host's 1 x gpu is too few for the mesh data=2,fsdp=2"
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="this host has an accelerator")
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_platform_this_cpu_host_lacks_exits_2(platform, capsys):
    assert main(["run", "--strategy", "dp", "--platform", platform]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"shardcheck run: --platform {platform}: this host has no {platform} devices (JAX's default backend is 8 x "
        "cpu); omit it to run on fake CPU devices"
    ) in err


def test_describe_names_each_platform_with_its_count_and_an_accelerators_kind():
    cpus = list(jax.devices("cpu"))
    assert devices_module.describe(cpus[:1]) == "1 x cpu"
    assert devices_module.describe(cpus[:8]) == "8 x cpu"
    assert devices_module.describe([FakeGpu()]) == "1 x gpu (NVIDIA H200)"
    assert devices_module.describe([*cpus[:2], FakeGpu()]) == "2 x cpu + 1 x gpu (NVIDIA H200)"


def test_a_report_says_where_each_side_ran():
    """The reference steps on one device, the candidate on its mesh: both named in the report and its JSON; the
    text says it only when the sides' platforms differ."""
    import numpy as np
    import optax
    from flax import nnx

    import shardcheck
    from shardcheck.losses import mse_batch_loss
    from shardcheck.models import MLP
    from shardcheck.parity.report import ParityReport

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))]
    task = shardcheck.Task(
        model=lambda: MLP(3, 4, 1, rngs=nnx.Rngs(0)),
        optimizer=optax.sgd(0.1),
        loss_fn=mse_batch_loss,
        batches=batches,
    )
    report = shardcheck.check_parity("dp", task, mesh=make_mesh(4))
    assert report.ok and report.devices == {"reference": "1 x cpu", "candidate": "4 x cpu"}
    assert report.to_dict()["devices"] == report.devices
    assert "ran on:" not in str(report)
    mixed = ParityReport(
        "dp",
        True,
        report.steps,
        report.diagnoses,
        devices={"reference": "1 x gpu (NVIDIA H200)", "candidate": "4 x cpu"},
    )
    assert "  ran on: reference 1 x gpu (NVIDIA H200), candidate 4 x cpu" in str(mixed).splitlines()
