"""Issue #36: a replay (``record`` the correct step, then ``verify --against FILE`` with a faulty one) is
diagnosed by the same code as a live check, and reads what trial 39's live readings read where its records allow
(the model of :mod:`test_trial39_sync`: target copies of both kernels synced every 2 steps, 4 steps on data=2).

1. a target written as the psum of its replicas: live "as exactly 2 times the value the reference's step wrote,
   at every element (written x2 = the size of 'data')"; the replay read "by 24.4 to 46.7 times the reference's
   change ... a running-average momentum": it reads the factor from what its digests hold (the recorded samples,
   ``max|x|`` and the L2 norm), and says that is where it was read.
2. ``optax.clip_by_global_norm`` applied to each shard's gradient before the pmean: live ``clip_per_shard``; the
   replay read "localized ... no simple form": it reruns the hypothesis from the pre-step state it shares with
   the recording (step 0), as live.
3. a counter only the step advances (the target's sync count), advanced twice a step: live and replayed it read
   "The step runs the forward pass 2 times a step", "the forward pass ran 2 times a step", although the task's loss
   neither reads nor writes it: both blame the step (the recording keeps the counters the loss touches,
   ``meta["counters_touched"]``).
4. ``Diagnosis.code``'s docstring lists docs/parity.md's codes table, and every code the source gives is in it.
"""

import re
from pathlib import Path

import pytest
from conftest import require_devices
from test_trial39_sync import _task, make_step, mesh, ref_step  # noqa: F401  (mesh: the data=2 fixture)

import shardcheck
from shardcheck import check_parity
from shardcheck.parity.diagnosis.evidence import Diagnosis
from shardcheck.parity.harness.recorded import record_run


@pytest.fixture(scope="module")
def recording(mesh):  # noqa: F811
    """The correct step of the task without a clip, recorded."""
    return record_run(_task(), make_step(), mesh=mesh)


# ------------------------------------------------------------------- 1. a target written x the device count


@require_devices(2)
def test_a_replayed_target_written_as_the_psum_of_its_replicas_is_said_as_the_axis_size(mesh, recording):  # noqa: F811
    """Replayed, the copy written as the psum of its 2 replicas FAILs at step 1 as exactly x2 = the size of
    'data', read at every recorded sample and in the largest magnitude and the L2 norm (was "by 24.4 to 46.7
    times the reference's change ... a running-average momentum"), finding and Form; a copy moved at every step
    (no one factor) is never said as a factor."""
    task = _task()
    report = check_parity(make_step("target_psum"), task, mesh=mesh, reference=recording)
    assert not report.ok and report.codes[0] == "state_amount", report.codes
    msg = report.diagnoses[0].message
    assert msg.startswith(
        "The candidate's step wrote the model's state t1 and t2 at step 1 as exactly 2 times the value the "
        "reference's step wrote, at every sample the recording holds and in the largest magnitude and the L2 norm "
        "(written x2 = the size of 'data'): a psum where a pmean or no reduction was meant"
    ), msg
    assert "running-average momentum" not in str(report) and "at every element" not in msg
    form = report.localization.form.sentence
    assert form.startswith("written x2:") and "x2 = S, the shard count: a psum" in form
    other = check_parity(make_step("train_target"), task, mesh=mesh, reference=recording)
    assert not other.ok and "written x" not in str(other) and "times the value" not in str(other)


# ------------------------------------------------------------------- 2. a clip applied per shard


@require_devices(2)
def test_a_replayed_clip_applied_to_each_shards_gradient_is_named(mesh):  # noqa: F811
    """Recorded: the clip (0.5) left to the task's optimizer. Replayed, each shard's gradient clipped before the
    pmean FAILs at step 0 as ``clip_per_shard`` (was ``localized``, "no simple form read from the records"), the
    ratio's spread read from its recorded samples; the correct step replayed PASSes (gradients psum-ed, no clip per
    shard, are not said so: the same code as live, tests/test_trial39_sync.py)."""
    task = _task(clip=0.5)
    recorded = record_run(task, make_step(), mesh=mesh)
    report = check_parity(make_step("clip_per_shard", clip=0.5), task, mesh=mesh, reference=recorded)
    assert not report.ok and report.codes[0] == "clip_per_shard", report.codes
    assert "localized" not in report.codes and report.localization.step == 0
    msg = report.diagnoses[0].message
    assert msg.startswith("At step 0 the gradients differ (") and "recorded samples)" in msg, msg
    assert (
        "they are the mean of each shard's own gradient clipped to the task's global norm (rerun from the "
        "recording's pre-step state, the replay's own: each shard's local gradient" in msg
    )
    assert "a clip applied per shard (before the all-reduce)" in msg
    assert check_parity(make_step(), task, mesh=mesh, reference=recorded).ok


# ------------------------------------------------------------------- 3. a step's own counter advanced twice


def _says_the_step_advanced_it(report) -> None:
    assert not report.ok and report.codes[0] == "model_state", report.codes
    msg = report.diagnoses[0].message
    assert msg.startswith(
        "The model's state steps (not a parameter: an nnx.Variable counter the step advances itself; the task's "
        "loss neither reads nor writes it) differs from the reference's step's after 1 step(s) (max abs err 1): it "
        "is 2 times the reference's. The step advances it 2 times a step"
    ), msg
    assert "forward pass 2 times" not in str(report) and "forward pass ran" not in str(report)
    where = report.localization
    assert where.step == 0 and where.stage == "parameters", (where.step, where.stage)
    assert where.form.sentence.startswith(
        "a factor 2: the step's own counter model.steps (the task's loss neither reads nor writes it) is 2 x the "
        "reference's: the step advanced it 2 times a step"
    ), where.form.sentence


@require_devices(2)
def test_a_counter_only_the_step_advances_advanced_twice_blames_the_step_live_and_replayed(mesh, recording):  # noqa: F811
    """The sync count advanced by 2 a step FAILs at step 0 on ``counter model.steps``, live (the user's reference)
    and replayed, as the step's own counter advanced twice (was "The step runs the forward pass 2 times a step",
    Form "the forward pass ran 2 times a step", stage the forward pass): the recording keeps the counters the loss
    touches (none here)."""
    assert recording.meta["counters_touched"] == []
    task = _task()
    _says_the_step_advanced_it(check_parity(make_step("count_twice"), task, mesh=mesh, reference=ref_step))
    _says_the_step_advanced_it(check_parity(make_step("count_twice"), task, mesh=mesh, reference=recording))


# ------------------------------------------------------------------- 4. the codes, listed alike


def _table_codes() -> list[str]:
    """The codes of docs/parity.md's codes table (``| code | when | what it says |``), in order, once each."""
    text = (Path(__file__).parent.parent / "docs" / "parity.md").read_text()
    rows = text.split("| code | when | what it says |", 1)[1].split("\n\n", 1)[0]
    return list(dict.fromkeys(re.findall(r"^\| `([a-z0-9_]+)`", rows, re.M)))


def test_the_codes_docstring_lists_the_codes_table_and_every_code_the_source_emits():
    """``Diagnosis.code``'s docstring lists docs/parity.md's codes table, in its order (it lacked 12 of the
    table's 39 codes, this session's ``target_sync`` and ``clip_per_shard`` among them), and every
    code a ``Diagnosis("...")`` of the source gives is in the table (``model_state``, ``cannot_verify``,
    ``low_precision_reduction`` and a replay's ``initial_state``, ``structure``, ``settings_differ`` were not)."""
    table = _table_codes()
    assert len(table) == 47 and {"target_sync", "clip_per_shard", "forward_differs", "applied_scale"} <= set(
        table
    )
    doc = Diagnosis.__doc__.split("code:", 1)[1].split("message:", 1)[0]
    assert re.findall(r"``([a-z0-9_]+)``", doc) == table
    src = Path(shardcheck.__file__).parent
    emitted = {
        m for p in src.rglob("*.py") for m in re.findall(r'Diagnosis\(\s*"([a-z0-9_]+)"', p.read_text())
    }
    assert len(emitted) > 30 and emitted <= set(table), sorted(emitted - set(table))
