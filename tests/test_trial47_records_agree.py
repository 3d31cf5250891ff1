"""Issue #36, trial 47 (ZeRO-1/2 by hand): sentences of the report that its own records contradicted.

1. A clip by each slice's own norm, replayed, read "the optimizer's update from equal inputs: differs (8 of 38
   parameters ...)" beside "the applied parameters ...: differs (0 of 38 parameters ...)", and live read 0 of 38
   in both rows. Every error of the 8 lay at an element whose gradient is a few ``atol`` from 0, which Adam's
   ``g / (sqrt(v) + eps)`` moves by up to ``lr`` when the gradient moves within its tolerance: the live rerun
   allows each element that (the applied parameters' own propagated allowance), the replay's rerun allowed
   ``atol + rtol max|x|`` alone. It now allows what live allows, and says so beside the digests' row.
2. A decay applied twice read "every failing leaf is an embedding or kernel or scale; every bias, pos matches":
   the biases and pos match only because c*lr*max|p| (3e-05 x some 3e-03, 0.06) is below their tolerance; a leaf
   the fitted decay cannot move beyond its tolerance is no evidence that it spares it, and is said so.
3. The same clip, live, listed "x1: blocks.1.down.kernel" among the local clip's factors: a leaf split between two
   devices' slices carries two factors and is left out, but its parameter's update (Adam's: blind to the
   gradient's scale) stood in for its moments. Such a parameter carries no factor, and a factor of 1 is no group.
4. The correct step in bfloat16 passed with pos at 0.006 against its tolerance 0.006 (2x its largest update) and no
   sentence said why: beside the rounding-level note, such a pass is said to be at the allowance of elements whose
   gradient is at rounding level.

The task: test_trial47_zero's MLP and ZeRO step (each device's slice of one flat buffer updated by adamw, the
moments split over 'data', the slices all-gathered) on batches whose first input feature is 1e-3 of the others:
the first row of ``up.kernel`` gets gradients a few ``atol`` from 0 (4 fake CPU devices); for 3, planted records
of that step (which leaf straddles two slices depends on the layout: trial 47's transformer, too slow here), and
for 4 planted records of a passing step.
"""

import dataclasses

import numpy as np
import optax
import pytest
from conftest import require_devices, said
from flax import nnx
from test_trial47_zero import LR, MAXNORM, MLP, WD, S, _loss, make_step

import shardcheck
from shardcheck import check_parity, make_mesh, record_run
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import Form
from shardcheck.parity.diagnosis.localization import decay_said, decay_unseen
from shardcheck.parity.diagnosis.rules import diagnose

PROPAGATED = "allowed as live the gradient's tolerance propagated through the update"


def _task():
    """test_trial47_zero's task, its first input feature scaled by 1e-3 (gradients near rounding level)."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        x = rng.normal(size=(8, 8)).astype(np.float32)
        x[:, 0] *= 1e-3
        batches.append({"x": x, "y": rng.normal(size=(8, 2)).astype(np.float32)})
    tx = optax.chain(optax.clip_by_global_norm(MAXNORM), optax.adamw(LR, weight_decay=WD))
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=batches, name="zero_small_x0"
    )


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": S})


@pytest.fixture(scope="module")
def recording(mesh):
    return record_run(_task(), make_step(), mesh=mesh)


def _stage(report, stage):
    return next(s for s in report.localization.stages if s.stage == stage)


def _failing(result, kind):
    return next(failing for k, _, failing in result.kinds if k == kind)


def _no_parameter_differs(report):
    """The local clip's report: localized at the optimizer's update from equal inputs, whose rerun and applied
    rows each count no parameter and all 12 optimizer-state leaves as differing."""
    assert report.verdict == "FAIL" and report.localization.stage == "optimizer"
    rerun, applied = _stage(report, "optimizer"), _stage(report, "parameters")
    assert (_failing(rerun, "param"), _failing(applied, "param")) == (0, 0), str(report)
    assert _failing(rerun, "opt_state") == _failing(applied, "opt_state") == 12
    return rerun


@require_devices(4)
def test_a_replayed_rerun_allows_what_the_live_rerun_allows(mesh, recording):
    """The local clip replayed: the optimizer's update from equal inputs and the applied parameters both differ
    in no parameter (the optimizer state carries the fault), and the rerun row says what it allows that the
    digests' row does not (before: 1 of 6 parameters differed in the rerun row alone)."""
    rerun = _no_parameter_differs(
        check_parity(make_step("local_norm"), _task(), mesh=mesh, reference=recording)
    )
    assert PROPAGATED in rerun.note


@require_devices(4)
def test_the_live_rerun_counts_the_same(mesh):
    """The local clip live: the same counts, and no such note (both rows hold the one allowance)."""
    rerun = _no_parameter_differs(check_parity(make_step("local_norm"), _task(), mesh=mesh))
    assert PROPAGATED not in rerun.note


@pytest.fixture(scope="module")
def decayed_twice(mesh, recording):
    """The decay applied again after the gather, replayed."""
    return check_parity(make_step("wd_twice"), _task(), mesh=mesh, reference=recording)


@require_devices(4)
def test_a_replayed_rerun_still_fails_an_update_applied_otherwise(decayed_twice):
    """The other side: a decay applied again after the gather moves the kernels and the LayerNorm scale by
    c*lr*p, far above the propagated allowance: the replay's rerun fails those 3 parameters."""
    report = decayed_twice
    rerun = _stage(report, "optimizer")
    assert report.verdict == "FAIL" and report.localization.stage == "optimizer"
    assert _failing(rerun, "param") == 3 and _failing(rerun, "opt_state") == 0
    assert rerun.worst.path == "ln.scale" and rerun.worst.max_abs_err > rerun.worst.tolerance


def _moments(mu: dict[str, tuple[float, float, float]]) -> StepRecord:
    """Step 0 of a step whose gradients match and whose Adam first moment of each leaf is x ``mu[leaf]`` (median,
    10th and 90th percentile of its elementwise ratio), its parameter's update at the reference's (Adam's update
    is blind to the gradient's scale)."""
    leaves = [LeafError(0, "loss", "loss", 0.0, 0.0, 1e-6, True, 1.0)]
    for path, (f, lo, hi) in mu.items():
        err = abs(f - 1) * 0.1
        leaves += [
            LeafError(0, "grad", path, 0.0, 0.0, 1e-6, True, 1.0),
            LeafError(0, "opt_state", f"1.0.mu.{path}", err, err, 1e-6, err <= 1e-6, f, 0.1, (lo, hi)),
            LeafError(0, "param", path, 1e-4, 1e-3, 1e-5, False, 1.0001, 0.1, (1.0, 1.0002)),
        ]
    return StepRecord(0, 1e-5, 1e-6, 2.3, 2.3, tuple(leaves), 1, 1)


def test_a_leaf_split_between_two_slices_is_no_factor_1_group():
    """3. A leaf split between two devices' slices (its moment x1.7 on one part, x2.2 on the other) is left out of
    the local clip's groups; its parameter's update, at the reference's under Adam, no longer stands in for it
    as a group "x1" (trial 47 live: "x1: blocks.1.down.kernel"). The other side: the two groups stay named, and
    with one group left no local clip is read."""
    whole = {"a.kernel": (1.7, 1.7, 1.7), "a.bias": (1.7, 1.7, 1.7), "b.kernel": (2.2, 2.2, 2.2)}
    found = diagnose([_moments({**whole, "c.kernel": (1.9, 1.7, 2.2)})], S)
    assert found[0].code == "local_clip_norm", found
    assert (
        "(Adam's first moments: x1.7: a.bias, a.kernel; x2.2: b.kernel), every factor >= 1"
        in found[0].message
    )
    assert "x1:" not in found[0].message and "c.kernel" not in found[0].message
    one = {"a.kernel": (1.7, 1.7, 1.7), "a.bias": (1.7, 1.7, 1.7), "c.kernel": (1.9, 1.7, 2.2)}
    assert "local_clip_norm" not in [d.code for d in diagnose([_moments(one)], S)]


SMALL = "every bias matches but is too small for the decay to show (c*lr*max|param| within tolerance"


@require_devices(4)
def test_biases_too_small_for_the_decay_are_no_evidence_that_it_spares_them(decayed_twice):
    """2. The decay applied twice (c*lr = 1e-4) moves a bias of some 1e-2 after its first update by 1e-6, within
    its tolerance (1.1e-6): the group and the localized finding no longer set "every bias matches" against the
    failing kernels and scale as what the fault spares (trial 47: "every bias, pos matches")."""
    report = decayed_twice
    form = report.localization.form
    assert form.kind == "decay" and form.term == pytest.approx(LR * WD, rel=0.02)
    group = report.localization.group
    assert group.startswith(f"every failing leaf is a kernel or scale; {SMALL}"), group
    assert SMALL in said(report, "localized") and "every bias matches." not in str(report)


def _param(path: str, size: float, tolerance: float, ok: bool = True) -> LeafError:
    """A parameter leaf whose reference's largest element is ``size`` (its error 1% of it)."""
    return LeafError(0, "param", path, 0.01 * size, 0.01, tolerance, ok, 1.0, 0.01)


def test_a_leaf_large_enough_for_the_decay_stays_its_evidence():
    """The other side: a matching leaf whose decay term (c*lr*max|p|) exceeds its tolerance is evidence that the
    decay spares it, and stays the group's contrast; only the small one is set aside, named, and the group read
    again without it; a form other than a decay sets none aside."""
    decay = Form("decay", "", coefficient=0.01, term=1e-4)
    leaves = [
        _param("a.kernel", 1.0, 1e-5, ok=False),
        _param("a.bias", 1e-2, 1e-5),
        _param("b.bias", 1.0, 1e-5),
    ]
    assert decay_unseen(decay, leaves) == ["a.bias"]
    assert decay_unseen(Form("factor", "", factor=2.0), leaves) == []
    group = "every failing leaf is a kernel; every bias matches"
    assert decay_said(group, [], True, lambda: "unused") == group
    mixed = decay_said(group, ["a.bias"], True, lambda: "only a.kernel differs; every other leaf matches")
    assert mixed == (
        "only a.kernel differs; every other leaf matches; a.bias: too small for the decay to show (c*lr*max|param| "
        "within tolerance: no evidence either way)"
    )


def _passing(err: float, tolerance: float = 0.006, change: float = 0.003) -> StepRecord:
    """Step 0 of a passing step whose parameter ``pos`` (its largest update ``change``) is ``err`` from the
    reference's within ``tolerance``."""
    leaves = (
        LeafError(0, "loss", "loss", 0.0, 0.0, 1e-6, True, 1.0),
        LeafError(0, "grad", "pos", 1e-7, 1e-4, 1e-6, True, 1.0),
        LeafError(0, "param", "pos", err, err / 0.07, tolerance, err <= tolerance, 1.0, change),
        LeafError(0, "grad", "key.bias", 1e-9, 1.0, 1e-6, True, 1.0),
        LeafError(0, "param", "key.bias", 0.004, 1.0, 0.006, True, 1.0, change),
    )
    # key.bias at rounding level as a whole: the note the others get, which the sentence joins
    return StepRecord(0, 1e-5, 1e-6, 2.3, 2.3, leaves, 1, 1, unresolved=("param key.bias",))


def test_a_pass_at_its_allowance_says_what_that_allowance_is():
    """4. The bfloat16 step passed with pos at 0.006 against 0.006, twice its largest update, and no sentence said
    why (trial 47). A parameter passing within 10% of a tolerance at least its whole update is now said to be at
    the allowance of elements whose gradient is at rounding level; the other side: at half its tolerance, or in a
    failing run, nothing is added."""
    found = {d.code: d for d in diagnose([_passing(0.00599)], S)}
    assert (
        "1 parameter leaf passes within 10% of a tolerance at least their largest update (e.g. param pos: max "
        in (found["rounding_level"].message)
    )
    assert "2x its largest update 0.003" in found["rounding_level"].message
    half = {d.code: d for d in diagnose([_passing(0.003)], S)}
    assert "passes within 10%" not in half["rounding_level"].message
    failing = diagnose([_passing(0.00599), dataclasses.replace(_passing(0.007), step=1)], S)
    assert "passes within 10%" not in " ".join(d.message for d in failing)
