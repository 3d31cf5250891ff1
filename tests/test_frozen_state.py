"""Floating model state beside the parameters (issue #36, a new user's LoRA trial): a weight kept frozen in a
Variable class of one's own (``class Frozen(nnx.Variable)``) that a step trains by mistake PASSed live, as a
diverged trajectory, since only integer model state was compared. It is now compared exactly where the
reference's step leaves it as it was and the loss reads it; each side of the rule tested with values (state the
loss does not read, and state both steps write: tests/test_floating_state.py).

The zoo's ``examples/zoo/lora.py`` runs the same fault through every command (``tests/test_zoo.py``).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardcheck.parity.comparison.model_state import floating_state, model_state_leaves
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import form_from_leaves
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.rules import diagnose


class Frozen(nnx.Variable):
    pass


class Ema(nnx.Variable):
    pass


class Model(nnx.Module):
    def __init__(self, dtype=jnp.float32):
        self.w = nnx.Param(jnp.ones((2, 3), dtype))
        self.base = Frozen(jnp.arange(6, dtype=dtype).reshape(2, 3))
        self.ema = Ema(jnp.zeros(3, dtype))
        self.calls = nnx.Variable(jnp.array(0, jnp.int32))


def _leaves(ref: Model, cand: Model, before: dict) -> dict[str, LeafError]:
    return {e.path: e for e in model_state_leaves(0, ref, cand, None, before)}


def test_a_frozen_weight_the_reference_leaves_is_compared_exactly_and_fails_when_the_candidate_moves_it():
    ref, cand = Model(), Model()
    before = floating_state(ref)
    assert set(before) == {"base", "ema"}  # no Param, no integer state; host float64 copies
    assert before["base"].dtype == np.float64
    cand.base[...] = cand.base[...].at[1, 2].add(0.25)
    leaves = _leaves(ref, cand, before)
    base = leaves["model.base"]
    assert base.kind == "state" and not base.ok
    assert base.max_abs_err == 0.25 and base.tolerance == 0.0 and base.reference_change == 0.0
    assert base.max_rel_err == pytest.approx(0.25 / 5) and base.shape == (2, 3)
    assert leaves["model.ema"].ok  # both left it: equal, exactly
    assert leaves["model.calls"].kind == "counter" and leaves["model.calls"].ok
    # nothing moved: every state leaf passes with error 0
    assert all(e.ok and e.max_abs_err == 0 for e in _leaves(ref, Model(), before).values())


def test_a_bfloat16_frozen_weight_is_floating_state_too():
    ref, cand = Model(jnp.bfloat16), Model(jnp.bfloat16)
    before = floating_state(ref)
    assert set(before) == {"base", "ema"}
    cand.base[...] = cand.base[...] * 2
    assert not _leaves(ref, cand, before)["model.base"].ok


def test_state_both_steps_write_is_compared_coarsely_and_state_the_candidate_drops_fails():
    """A running statistic both steps write has no derived tolerance: compared on its change within half of the
    reference's largest change, so its rounding never FAILs a correct step; the candidate leaving it exactly as
    it was while the reference wrote it FAILs (the writes dropped, ratio 0)."""
    ref, cand = Model(), Model()
    before = floating_state(ref)
    ref.ema[...] = jnp.array([0.1, 0.2, 0.3])
    cand.ema[...] = jnp.array([0.1, 0.2, 0.3]) * (1 + 2**-20)  # written too, rounded another way
    both = _leaves(ref, cand, before)["model.ema"]
    assert both.ok and both.tolerance == pytest.approx(0.15) and both.max_abs_err < 1e-6
    dropped = _leaves(ref, Model(), before)["model.ema"]
    assert not dropped.ok and dropped.reference_change == pytest.approx(0.3) and dropped.ratio == 0.0
    assert dropped.max_abs_err == pytest.approx(0.3)


def _record(state: LeafError) -> StepRecord:
    loss = LeafError(0, "loss", "loss", 0.0, 0.0, 1e-6, True)
    param = LeafError(0, "param", "w", 0.0, 0.0, 1e-6, True, shape=(2, 3))
    count = LeafError(0, "counter", "step", 0.0, 0.0, 0.0, True)
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (loss, param, state, count), 1, 1)


def _state(ok: bool, change: float) -> LeafError:
    err = 0.0 if ok else 0.25
    ratio = 0.0 if change else None  # a written leaf the candidate left exactly as it was
    return LeafError(0, "state", "model.base", err, err / 5, 0.0, ok, ratio, change, None, (2, 3))


def test_a_trained_frozen_weight_is_named_at_the_parameters_stage_and_never_as_a_schedule():
    record = _record(_state(False, 0.0))
    found = diagnose([record])
    assert found[0].code == "frozen_state"
    assert "changed the model's state base at step 0 (max abs err 0.25)" in found[0].message
    assert "A weight meant to stay frozen was trained" in found[0].message
    where = localize([record])
    assert where.stage == "parameters"
    assert where.group == "only state model.base differs; every parameter leaf of this stage matches"
    assert (
        where.form.kind == "reference_zero"
        and "a weight meant to stay frozen was trained" in where.form.sentence
    )
    assert "warm-up" not in where.form.sentence and "schedule" not in where.text()
    assert "0 of 1 parameter and 1 of 1 non-parameter state leaf" in where.text()
    # the same record with the state matching: no finding about it, and parity
    ok = _record(_state(True, 0.0))
    assert ok.ok and [d.code for d in diagnose([ok])][0] == "parity"
    assert "frozen_state" not in [d.code for d in diagnose([ok])]


def test_dropped_writes_of_floating_state_are_a_forward_stage_zero_update():
    record = _record(_state(False, 0.25))
    codes = [d.code for d in diagnose([record])]
    assert codes[0] == "model_state" and "frozen_state" not in codes
    assert "exactly as it was at step 0: the step's writes were dropped" in diagnose([record])[0].message
    where = localize([record])
    assert where.stage == "forward" and where.form.kind == "zero"
    assert "writes were dropped" in where.form.sentence
    assert form_from_leaves([_state(False, 0.25)]).factor == 0.0


def test_a_recording_holds_the_floating_state_and_a_replay_names_a_trained_frozen_weight():
    """The zoo's LoRA model replayed (benchmarks/fail_audit.py read its one-step replay as a PASS, the frozen
    weights not recorded): a recording now holds ``state model.<path>`` leaves with their update size, the
    correct step PASSes against it and the planted fault FAILs at step 0 as ``frozen_state``, as live."""
    from conftest import require_devices, zoo_module

    from shardcheck import check_parity, make_mesh
    from shardcheck.parity.harness.recorded import record_run

    require_devices(4)
    from pathlib import Path

    lora = zoo_module(Path(__file__).resolve().parents[1] / "examples" / "zoo" / "lora.py")
    mesh = make_mesh(lora.MESH)
    recording = record_run(lora.task, lora.step, mesh=mesh, name="step")
    frozen = [n for n in recording.names if n.startswith("state ")]
    assert frozen == [f"state model.{m}.{p}" for m in ("hidden", "out") for p in ("bias", "kernel")]
    assert check_parity(lora.step, lora.task, mesh=mesh, reference=recording).ok
    faulty = check_parity(lora.frozen_trained, lora.task, mesh=mesh, reference=recording)
    assert faulty.codes[0] == "frozen_state" and faulty.steps[0].replayed
    assert faulty.localization.stage == "parameters" and faulty.localization.form.kind == "reference_zero"
    assert "as they were" in faulty.localization.form.sentence
