"""The bugs the zoo's MoE, conv and counter models found in shardcheck, one test each (issue #34).

The zoo itself runs through every command in ``tests/test_zoo.py``; these pin the fixes with values.
"""

import json
from pathlib import Path

from conftest import require_devices

from shardcheck.cli import main

ZOO = Path(__file__).resolve().parents[1] / "examples" / "zoo"


@require_devices(8)
def test_train_on_a_mesh_with_an_expert_axis_splits_the_batch_over_the_data_axis_only(capsys):
    """``train --mesh data=2,expert=4`` exited 2 ("has 8 devices but ... num_shards=8"): --mesh set S to the
    mesh's 8 devices, where the batch is split over 'data' only (S=2, as verify and record count it)."""
    argv = ["train", "--task", f"{ZOO / 'moe.py'}:task", "--mesh", "data=2,expert=4", "--epochs", "1"]
    assert main([*argv, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_shards"] == 2
    assert report["strategy"] == "fsdp"
    assert len(report["steps"]) == 3  # the task's 3 batches, one epoch
    assert report["loss_curves_agree"] is True
    assert report["first_exceeded_step"] is None
    assert not any(s["drift_exceeded"] for s in report["steps"])
