"""Memory figures of a target GPU without one: the shipped target configs, the deviceless XLA:GPU compile through
the gpu-aot extra, and the plain XLA:CPU statement without it.

The extra (the jax CUDA plugin) is not installed in the test environment: installed, JAX would try to start CUDA
in every test. ``.ci/run`` installs it into ``.ci/gpu-aot`` (or ``SHARDCHECK_TEST_GPU_AOT`` names a folder), and the
deviceless compiles run ``shardcheck memory`` in a subprocess with that folder on ``PYTHONPATH``; without it they
skip and say why. Reference figures (shared/GPU.md): tiny-lm 350m, batch 3 x 2048, Adam, one device; the H200's
own compile gives a peak of 56,987,433,420 B, XLA:CPU's 80,546,861,492 B.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_devices

from shardcheck import gpu_target
from shardcheck.cli import main
from shardcheck.device_memory import DEVICE_KINDS

ROOT = Path(__file__).resolve().parents[1]
H200_350M_PEAK = 56_987_433_420  # the H200's own compile of the 350m step (jax 0.11.2; shared/GPU.md)
# the H200's own compile of tiny-lm's tiny size, batch 16, fsdp=1 (jax 0.11.2, 2026-12-04;
# benchmarks/gpu_results.json "memory_tiny_fsdp1_h200"): (argument, output, alias, temp, peak) bytes
H200_TINY = (384_164, 378_960, 378_020, 3_199_264, 3_584_368)


def _plugin_folder() -> str | None:
    """The folder holding the jax CUDA plugin for the subprocesses, "" when it is in this environment, else None."""
    if gpu_target.plugin_installed():
        return ""
    folder = Path(os.environ.get("SHARDCHECK_TEST_GPU_AOT", ROOT / ".ci" / "gpu-aot"))
    jaxlib = importlib.metadata.version("jaxlib")  # the plugin loads only beside the jaxlib it was built with
    same = (folder / f"jax_cuda12_plugin-{jaxlib}.dist-info").is_dir()
    return str(folder) if same and (folder / "jax_plugins" / "xla_cuda12").is_dir() else None


needs_plugin = pytest.mark.skipif(
    _plugin_folder() is None,
    reason="the gpu-aot extra (jax-cuda12-plugin, jax-cuda12-pjrt of the jaxlib in use, at its version) is not "
    "installed in "
    ".ci/gpu-aot, SHARDCHECK_TEST_GPU_AOT or this environment (.ci/run installs it)",
)


def memory_json(*args: str, timeout: int = 600) -> dict:
    """``shardcheck memory ARGS --json -`` in a subprocess that sees the plugin; its report."""
    env = dict(os.environ)
    folder = _plugin_folder()
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-m", "shardcheck", "memory", *args, "--json", "-"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


# ------------------------------------------------------------------------------- the target configs (no plugin)


def field(text: str, name: str) -> str:
    match = re.search(rf"^\s*{name}: (\S+)", text, re.M)
    assert match is not None, name
    return match.group(1)


@pytest.mark.parametrize(
    "kind, sms, cc, l2_mib",
    [
        ("h100", 132, "9 0", 50),
        ("h200", 132, "9 0", 50),
        ("a100-80gb", 108, "8 0", 40),
        ("a100-40gb", 108, "8 0", 40),
        ("l4", 58, "8 9", 48),
    ],
)
def test_every_named_gpu_ships_a_target_config(kind, sms, cc, l2_mib):
    """The SM count, compute capability and L2 of the cards' datasheets and whitepapers; the memory is the one
    ``--device-memory KIND`` checks against, so the compiler and the fit verdict see the same card."""
    text = gpu_target.target_config(kind)
    assert int(field(text, "core_count")) == sms
    assert re.search(r"cuda_compute_capability \{ major: (\d) minor: (\d) \}", text).group(1, 2) == tuple(
        cc.split()
    )
    assert int(field(text, "l2_cache_size")) == l2_mib * 2**20
    assert int(field(text, "device_memory_size")) == DEVICE_KINDS[kind].memory_bytes
    assert "# Sources:" in text and field(text, "platform_name") == '"CUDA"'


def test_unknown_target_is_refused():
    with pytest.raises(ValueError, match=r"target_config: kind='v100' .* use one of h100, h200, a100-80gb"):
        gpu_target.target_config("v100")


def test_cli_refuses_a_target_it_cannot_compile_for(capsys):
    assert main(["memory", "--task", "digits", "--mesh", "fsdp=1", "--target", "tpu-v5e"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--target 'tpu-v5e' is not a GPU shardcheck can compile for; use one of h100, h200" in err


@pytest.mark.parametrize(
    "target, device_memory, kind",
    [(None, "H100", "h100"), (None, "a100_80gb", "a100-80gb"), (None, "80GiB", None), (None, "tpu-v5e", None)]
    + [("L4", None, "l4"), ("h200", "80GiB", "h200"), ("h200", "H200", "h200"), (None, None, None)],
)
def test_which_gpu_the_step_is_compiled_for(target, device_memory, kind):
    """``--target``, else a GPU kind named by ``--device-memory``; a size or a TPU kind compiles on XLA:CPU."""
    from argparse import Namespace

    from shardcheck.cli.memory import _gpu_target_kind

    assert _gpu_target_kind(Namespace(target=target, device_memory=device_memory)) == kind


def test_a_device_memory_kind_other_than_the_target_is_refused():
    """Trial 49: ``--device-memory h100 --target h200`` gave the H100's fit and never mentioned the H200."""
    from argparse import Namespace

    from shardcheck.cli.memory import _gpu_target_kind

    with pytest.raises(ValueError, match="--device-memory h100 and --target h200 name different devices"):
        _gpu_target_kind(Namespace(target="h200", device_memory="h100"))


def test_target_needs_a_mesh(capsys):
    assert main(["memory", "--task", "digits", "--target", "h100"]) == 2
    assert "pass --mesh too" in capsys.readouterr().err


@require_devices(4)
def test_without_the_plugin_the_figure_is_xla_cpus_and_says_so(monkeypatch, capsys):
    """No plugin: the step is compiled by XLA:CPU, and the report says so with the recorded ratio (1.41x)."""
    monkeypatch.setattr(gpu_target, "plugin_installed", lambda: False)
    args = ["memory", "--task", "digits", "--mesh", "fsdp=4", "--batch-size", "64", "--target", "h100"]
    assert main([*args, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    compiler = report["compiler"]
    assert compiler["name"] == "XLA:CPU" and compiler["target"] == "h100" and compiler["deviceless"] is False
    assert "1.41x XLA:GPU's (80,546,861,492 B against 56,987,433,420 B)" in compiler["note"]
    assert compiler["note"].count(gpu_target.install_hint()) == 1  # trial 54: said twice in one line
    assert compiler["note"].endswith("(the jax CUDA plugin is not installed)")
    assert report["strategies"]["fsdp"]["ahead_of_time"]["backend"].startswith("cpu")
    assert main(args) == 0
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "compiler: XLA:CPU: this figure is XLA:CPU's, not the GPU's" in text
    assert gpu_target.install_hint() in text  # printed as written, not read as rich markup
    if importlib.metadata.version("jaxlib") == gpu_target.GPU_AOT_PIN:
        assert "pip install 'shardcheck[gpu-aot]'" in text


# ------------------------------------------------------------------------- deviceless XLA:GPU compiles (plugin)


@needs_plugin
def test_deviceless_compile_for_a_mesh_of_eight_gpus():
    """digits on data=2 x fsdp=4 H100s: XLA:GPU's own figures; the state arguments are the estimate's exactly
    (2,440 B of params, Adam's 4,884 B, the 4 B step), as on XLA:CPU; the batch is 64 rows over 8 devices."""
    report = memory_json(
        "--task", "digits", "--mesh", "data=2,fsdp=4", "--batch-size", "64", "--target", "h100"
    )
    assert report["compiler"]["name"] == "XLA:GPU" and report["compiler"]["deviceless"] is True
    aot = report["strategies"]["fsdp"]["ahead_of_time"]
    assert aot["backend"] == "gpu (NVIDIA H100 80GB HBM3)" and aot["num_devices"] == 8
    assert aot["state_argument_bytes"] == aot["persistent_bytes"] == 2440 + 4884 + 4
    assert aot["data_argument_bytes"] == (64 * 64 * 4 + 64 * 4) // 8
    assert sum(aot["breakdown"].values()) == aot["peak_bytes"]


@needs_plugin
def test_deviceless_h200_peak_of_the_350m_step_is_the_cards_own():
    """tiny-lm 350m, batch 3 x 2048, Adam, one device, compiled for an H200 on this CPU-only machine: within 1%
    of the card's own compile (measured: 56,983,531,212 B, 0.007% below); XLA:CPU's figure is 1.41x it."""
    report = memory_json("--size", "350m", "--mesh", "fsdp=1", "--batch-size", "3", "--target", "h200")
    aot = report["strategies"]["fsdp"]["ahead_of_time"]
    assert report["compiler"]["name"] == "XLA:GPU" and aot["backend"] == "gpu (NVIDIA H200)"
    assert abs(aot["peak_bytes"] / H200_350M_PEAK - 1) < 0.01
    assert aot["argument_bytes"] == 4_439_792_648  # the card's own: the state and the batch, exactly


@needs_plugin
def test_deviceless_h200_figures_of_a_small_step_are_the_cards_own():
    """tiny-lm tiny, batch 16, one device, compiled for an H200 without one (jax 0.10.2 here), against the same
    step compiled on a real H200 under jax 0.11.2 (``benchmarks/gpu.py``'s ``memory`` part): the state and batch
    bytes are the card's exactly, the temporaries and the peak within 1% (they were equal to the byte)."""
    report = memory_json("--size", "tiny", "--mesh", "fsdp=1", "--target", "h200")
    aot = report["strategies"]["fsdp"]["ahead_of_time"]
    argument, output, alias, temp, peak = H200_TINY
    assert aot["batch_size"] == 16 and aot["backend"] == "gpu (NVIDIA H200)"
    assert (aot["argument_bytes"], aot["output_bytes"], aot["alias_bytes"]) == (argument, output, alias)
    assert abs(aot["temp_bytes"] / temp - 1) < 0.01 and abs(aot["peak_bytes"] / peak - 1) < 0.01


def test_a_plugin_of_another_version_than_jaxlib_is_named_with_the_install_that_fits(monkeypatch):
    """The plugin does not name jaxlib among its requirements, so pip can leave one of another version: the
    reason names both versions and the install of the jaxlib's own."""
    from importlib import metadata

    versions = {"jaxlib": "0.11.2", "jax-cuda12-plugin": "0.10.2"}
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    monkeypatch.setattr(gpu_target, "plugin_installed", lambda: True)
    assert gpu_target.unavailable_reason() == (
        "the jax CUDA plugin is 0.10.2 but jaxlib is 0.11.2; install the same version: "
        'pip install "jax-cuda12-plugin==0.11.2" "jax-cuda12-pjrt==0.11.2"'
    )
    monkeypatch.setattr(gpu_target, "plugin_installed", lambda: False)
    assert gpu_target.unavailable_reason() == (
        'the jax CUDA plugin is not installed (pip install "jax-cuda12-plugin==0.11.2" "jax-cuda12-pjrt==0.11.2")'
    )
    versions["jaxlib"] = gpu_target.GPU_AOT_PIN
    assert (
        gpu_target.unavailable_reason()
        == "the jax CUDA plugin is not installed (pip install 'shardcheck[gpu-aot]')"
    )
