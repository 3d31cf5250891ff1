"""A replay and a recording are as trustworthy as a live check (issue #36, a new user's trial).

- Every array of a recording is covered by its checksum: a digest edited after ``record`` wrote the file (any
  finite element of any array, ``initial_max`` among them) is refused as damaged, never replayed.
- An exception in a candidate's ``make_optimizer`` or ``view_optimizer`` names the candidate, the hook and the
  step (a ValueError / TypeError whose ``__cause__`` is the original), from the API and the command line.
- A replay reads the task's model for what a recording does not hold: a tied table's uses in the loss (the
  grouping names them as live); the module probe, which needs a live model, is said not to have run.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_devices
from flax import nnx
from test_tied_leaves import _cut, _task

from shardcheck import Candidate, check_parity
from shardcheck.cli import main
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.harness.recorded import load_recording, record_run
from shardcheck.steps.reference import reference_step


@pytest.fixture(scope="module")
def tied_recording():
    """The dp step of a tiny LM whose head reads the embedding's table (``embed.attend``-like), recorded."""
    require_devices(2)
    return record_run(_task("one path"), "dp", num_shards=2)


@require_devices(2)
def test_every_array_of_a_recording_is_covered_by_its_checksum(tied_recording, tmp_path):
    path = tmp_path / "run.npz"
    tied_recording.save(path)
    assert load_recording(path).names == tied_recording.names
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    edited = [k for k in arrays if k != "meta"]
    assert {"initial_max", "initial_norm", "initial_samples", "steps_update", "sample_index"} <= set(edited)
    for key in edited:
        changed = dict(arrays)
        a = np.array(arrays[key])
        if a.dtype.kind == "f":
            finite = np.flatnonzero(np.isfinite(a) & (a != 0))  # NaN x 3 is NaN, 0 x 3 is 0: the same bytes
            if finite.size:
                a.flat[finite[0]] *= 3
            else:  # initial_update: NaN everywhere (no update before step 0)
                a.flat[0] = 1.0
        elif a.dtype.kind == "U":
            a = np.char.add(a, "x")
        elif a.dtype.kind == "b":
            a = ~a
        else:
            a = a + 1
        changed[key] = a
        target = tmp_path / f"{key}.npz"
        np.savez(target, **changed)  # uncompressed, the metadata (and its checksum) intact
        with pytest.raises(ValueError, match="is a damaged shardcheck recording") as err:
            load_recording(target)
        assert "its contents do not match its checksum" in str(err.value), key


def _hooked(make=None, view=None) -> Candidate:
    task = _task("one path")

    def step(model, optimizer, batch):
        return reference_step(task.loss_fn, model, optimizer, batch).loss

    return Candidate(name="mine", step=step, make_optimizer=make, view_optimizer=view)


def _bad_make(model, optimizer):
    raise KeyError("Cannot set key 0 on immutable node")


def _bad_view(optimizer):
    if int(optimizer.step[...]) >= 1:  # after step 0's update
        raise TypeError("no view of this state\nsecond line")
    return nnx.state(optimizer.opt_state), optimizer.step[...]


@require_devices(1)
def test_an_error_in_a_candidates_optimizer_hook_names_the_candidate_the_hook_and_the_step():
    task = _task("one path")
    for run, fn in (
        (lambda c: check_parity(c, task, num_shards=1), "check_parity"),
        (lambda c: record_run(task, c, num_shards=1), "record_run"),
    ):
        with pytest.raises(ValueError) as err:
            run(_hooked(make=_bad_make))
        assert str(err.value) == (
            f"{fn}: make_optimizer of the candidate 'mine' raised KeyError before step 0: 'Cannot set key 0 on "
            "immutable node'; fix make_optimizer (the original error, with its traceback, is this one's __cause__)"
        )
        assert isinstance(err.value.__cause__, KeyError)
        with pytest.raises(TypeError) as err:
            run(_hooked(view=_bad_view))
        assert str(err.value).startswith(
            f"{fn}: view_optimizer of the candidate 'mine' raised TypeError at step 0: no view of this state; "
            "fix view_optimizer"
        )
        assert isinstance(err.value.__cause__, TypeError)
    # a right hook: no error, and the check passes
    assert check_parity(_hooked(view=lambda o: (nnx.state(o.opt_state), o.step[...])), task, num_shards=1).ok


HOOK_FILE = """
from flax import nnx
import shardcheck
from shardcheck.steps.reference import reference_step
from shardcheck.tasks import load_task

task = load_task("diabetes", model="mlp", hidden=8, optimizer="adam", batch_size=16, steps=2)


def _step(model, optimizer, batch):
    return reference_step(task.loss_fn, model, optimizer, batch).loss


def _make(model, optimizer):
    mine = nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)
    raise ValueError("Cannot set key 0 on immutable node of type PartitionState")


bad = shardcheck.Candidate(name="mine", step=_step, make_optimizer=_make)
"""


@require_devices(2)
def test_the_command_line_names_the_candidates_hook_and_step(tmp_path, capsys):
    script = tmp_path / "hooks.py"
    script.write_text(HOOK_FILE)
    args = ["verify", "--task", f"{script}:task", "--candidate", f"{script}:bad", "--strategies", "none"]
    assert main([*args, "--devices", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(
        "error: shardcheck verify: make_optimizer of the candidate 'mine' raised ValueError before step 0: Cannot "
        "set key 0 on immutable node of type PartitionState; fix make_optimizer"
    ), err


@require_devices(2)
def test_a_replay_keeps_a_tied_tables_uses_group_as_live(tied_recording):
    task = _task("one path")
    live = check_parity(_cut(task), task, num_shards=2).localization
    replayed = check_parity(_cut(task), task, reference=tied_recording).localization
    group = (
        "every failing leaf is read by several operations of the loss, one weight with several uses (shared or "
        "tied): embed.embedding by gather and transpose; every leaf read by one operation matches"
    )
    assert (live.stage, live.group) == (replayed.stage, replayed.group) == ("gradients", group)
    # the later stages read alike: the optimizer rerun on the candidate's gradients, both ways (the errors are
    # the arrays' live and the digests' replayed: their sizes differ)
    counts = [
        [(s.noun, s.status, s.compared, s.failing, s.kinds) for s in r.stages if s.stage != "replicas"]
        for r in (live, replayed)
    ]
    assert counts[0] == counts[1]
    assert counts[0][2:] == [
        ("the optimizer's update from equal inputs", "matches", 9, 0, (("param", 3, 0), ("opt_state", 6, 0))),
        # against the reference's, the table and its moments differ (its gradient did): downstream of the gradients
        (
            "the applied parameters and the optimizer state",
            "differs",
            9,
            3,
            (("param", 3, 1), ("opt_state", 6, 2)),
        ),
        ("the optimizer's counters", "matches", 2, 0, ()),
    ]


def test_a_replays_forward_stage_says_no_module_was_probed():
    tol = 1e-3
    loss = LeafError(0, "loss", "loss", 0.5, 0.5, tol, False, 2.0, None, (2.0, 2.0), ())
    grad = LeafError(0, "grad", "a.kernel", tol / 2, tol / 2, tol, True, None, None, None, (4,))
    record = StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, (loss, grad), 1, 1)
    replayed = localize([record], replicas_observed=False)
    assert replayed.stage == "forward" and not replayed.live
    assert (
        "Module: not probed (a replay has no live model to run module by module; a live check of this step runs "
        "the module probe, which looks for the first module whose output differs while its inputs match)."
        in replayed.text()
    )
    assert "Module:" not in localize([record]).text()  # live: the probe's finding, or nothing where none ran
