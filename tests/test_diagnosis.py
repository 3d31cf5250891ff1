"""The rules of :func:`shardcheck.parity.diagnosis.rules.diagnose`, on hand-built records (no JAX).

Each rule is checked on both sides: it fires on its planted evidence, and it stays silent on a passing record
(where the findings are ``parity`` first, then possibly ``rounding_level``).
"""

from __future__ import annotations

import dataclasses

import pytest

from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import RULES, diagnose

TOL = 1e-3


def _leaf(kind, path, *, ok=True, ratio=None, step=0, change=1.0) -> LeafError:
    """A leaf within tolerance (error TOL/2) or out of it (error 100 TOL)."""
    tol = 0.0 if kind == "counter" else TOL
    err = (0.0 if ok else 3.0) if kind == "counter" else (TOL / 2 if ok else 100 * TOL)
    return LeafError(
        step,
        kind,
        path,
        err,
        err,
        tol,
        ok,
        ratio,
        change if kind in ("param", "opt_state") else None,
    )


def _record(step=0, *, bad=(), ratio=None, counter=None, **kw) -> StepRecord:
    """One step of a two-leaf model; the leaf names in ``bad`` (e.g. ``"param w"``) fail with ``ratio``."""
    leaves = []
    for kind, path in [("loss", "loss"), ("grad", "w"), ("grad", "b"), ("param", "w"), ("param", "b")]:
        name = kind if kind == "loss" else f"{kind} {path}"
        ok = name not in bad
        leaves.append(_leaf(kind, path, ok=ok, ratio=None if ok else ratio, step=step))
    leaves.append(_leaf("opt_state", "0.mu.w", ok="opt_state 0.mu.w" not in bad, step=step))
    got = step + 1 if counter is None else counter
    leaves.append(_leaf("counter", "step", ok=got == step + 1, step=step))
    fields = dict(
        rtol=1e-5, atol=1e-6, loss=1.5, candidate_loss=1.5, step_count=step + 1, candidate_step_count=got
    )
    return StepRecord(step, leaves=tuple(leaves), **{**fields, **kw})


def _passing(steps=2, **kw) -> list[StepRecord]:
    return [_record(t, **kw) for t in range(steps)]


def _codes(findings: list[Diagnosis]) -> list[str]:
    return [d.code for d in findings]


def _one(findings: list[Diagnosis], code: str) -> Diagnosis:
    (found,) = [d for d in findings if d.code == code]
    return found


UPDATE = ("grad w", "grad b", "param w", "param b")
FALLBACKS = {"scaled", "update_differs", "loss_only", "localized", "drift"}


def test_rules_are_named_functions():
    assert len(RULES) == len(set(RULES))
    assert [rule.__name__ for rule in RULES][0] == "parity"
    assert all(callable(rule) for rule in RULES)


def test_parity():
    out = diagnose(_passing(3))
    assert _codes(out) == ["parity"]
    assert "Parity holds: 7 leaves over 3 step(s)" in out[0].message
    assert "parity" not in _codes(diagnose([_record(bad=UPDATE, ratio=4.0)], 4))
    assert diagnose([]) == []


def test_a_pass_on_one_device_says_no_reduction_ran():
    """Trial 57 D: a 1-device check passed without saying that no collective ran; a mesh of several devices (a
    tensor-parallel data=1 x model=4 included: its reductions over ``model`` ran) says nothing of it."""
    said = "S=1 on one device: no all-reduce, all-gather or reduce-scatter ran"
    assert said in diagnose(_passing(2), 1)[0].message
    assert said in diagnose(_passing(2), 1, mesh_shape={"data": 1})[0].message
    assert said not in diagnose(_passing(2), 1, mesh_shape={"data": 1, "model": 4})[0].message
    assert said not in diagnose(_passing(2), 4)[0].message
    assert said not in diagnose(_passing(2))[0].message  # S not known


def test_reference_diverged():
    out = diagnose(_passing(2), reference_diverged_at=2)
    assert _codes(out) == ["reference_diverged"]
    assert "diverged (non-finite loss or parameters at step 2)" in out[0].message
    assert "reference_diverged" not in _codes(diagnose(_passing(2)))
    assert _codes(diagnose([], reference_diverged_at=0)) == ["reference_diverged"]


def test_replicas_differ():
    records = [_record(0), _record(1, replica_mismatches=("param w", "param b"))]
    out = diagnose(records)
    d = _one(out, "replicas_differ")
    assert out[0] is d
    assert "Replicas differ" in d.message and "after step 1 (2 leaves)" in d.message
    assert d.leaf == "param w"
    assert "replicas_differ" not in _codes(diagnose(_passing()))


def test_never_stepped():
    out = diagnose([_record(0, counter=0), _record(1, counter=0)])
    d = _one(out, "never_stepped")
    assert "never stepped" in d.message and "after 1 step(s)" in d.message
    assert d.leaf == "counter step"
    assert "update_differs" not in _codes(out)
    assert "never_stepped" not in _codes(diagnose(_passing()))


def test_step_counter():
    out = diagnose([_record(0, counter=4)], 4)
    d = _one(out, "step_counter")
    assert "stepped 4 times" in d.message and "(S=4)" in d.message
    odd = _one(diagnose([_record(0), _record(1, counter=3)]), "step_counter")
    assert "counter is 3 after 2 step(s)" in odd.message
    assert "step_counter" not in _codes(diagnose(_passing()))


def test_an_optimizers_own_counter_ahead_is_named_per_micro_batch():
    """Gradient accumulation stepping Adam on every micro-batch (k = 2): the reported update count is right, Adam's
    own count is 2 after one step. Named step_counter per micro-batch where the candidate accumulates k = 2, per
    step otherwise; a counter off by no whole factor (a mini_step) is not taken for it."""
    record = _record(
        bad=("param w", "param b", "opt_state 0.mu.w")
    )  # no factor: loss_only, but for the count
    count = LeafError(0, "counter", "0.count", 1.0, 1.0, 0.0, False, 2.0)  # 2 against 1
    record = dataclasses.replace(record, leaves=(*record.leaves, count))
    out = diagnose([record], 2, micro_batches=2)
    d = _one(out, "step_counter")
    assert (
        "stepped per micro-batch (k = 2): the counter 0.count of its state is 2 after 1 step(s)" in d.message
    )
    assert "optax.MultiSteps(tx, every_k_schedule=k)" in d.message and d.leaf == "counter 0.count"
    assert not FALLBACKS & set(_codes(out))  # not loss_only
    # without the count: the gradients match, so not "only the loss matches" but the stage that differs
    assert "localized" in _codes(diagnose([dataclasses.replace(record, leaves=record.leaves[:-1])], 2))
    per_shard = _one(diagnose([record], 2), "step_counter")
    assert (
        "stepped 2 times per step: the counter 0.count of its state is 2 after 1 step(s)" in per_shard.message
    )
    mini = dataclasses.replace(count, path="mini_step", ratio=None, max_rel_err=float("inf"))
    other = dataclasses.replace(record, leaves=(*record.leaves[:-1], mini))
    assert "step_counter" not in _codes(diagnose([other], 2, micro_batches=2))
    # the reported count k times the steps, under accumulation: per micro-batch too
    reported = _one(diagnose([_record(0, counter=4)], 4, micro_batches=4), "step_counter")
    assert "stepped per micro-batch (k = 4): its counter is 4 after 1 step(s)" in reported.message


def test_well_resolved_moments_vote_alone():
    """Under bfloat16 compute a bias's first moment moved by 3.5 times its tolerance and read x4.17 for a sum
    over 4 shards; the leaves that moved by more than 10 times theirs read x4.00 and name it."""
    record = _record(bad=("param w", "param b"), ratio=1.0)
    moments = (
        LeafError(0, "opt_state", "0.mu.w", 1.0, 3.0, 0.01, False, 4.002, 0.3),  # 30 x its tolerance
        LeafError(0, "opt_state", "0.mu.k", 1.0, 3.0, 0.01, False, 3.998, 0.5),
        LeafError(0, "opt_state", "0.mu.b", 1.0, 3.0, 0.01, False, 4.17, 0.035),  # 3.5 x
    )
    leaves = [e for e in record.leaves if e.kind != "opt_state" and e.kind != "grad"]
    record = dataclasses.replace(record, leaves=(*leaves, *moments))
    d = _one(diagnose([record], 4), "summed")
    assert "optimizer moments are 4 x the reference's" in d.message
    blurred = dataclasses.replace(
        record, leaves=(*leaves, *(dataclasses.replace(e, reference_change=0.05) for e in moments))
    )
    assert "summed" not in _codes(diagnose([blurred], 4))  # none well resolved: all vote, and disagree


def test_summed():
    out = diagnose([_record(bad=UPDATE, ratio=4.0)], 4)
    d = _one(out, "summed")
    assert "x4" in d.message and "summed" in d.message and "gradients are 4 x" in d.message
    assert not FALLBACKS & set(_codes(out))
    twice = _one(diagnose([_record(bad=UPDATE, ratio=16.0)], 4), "summed")
    assert "sum-reduced twice" in twice.message
    assert "summed" not in _codes(diagnose(_passing(), 4))


def test_a_noise_gradient_times_s_does_not_spoil_the_factor():
    """From a new user's trial (bfloat16 compute, a psum for a pmean returning its gradients under a clip that
    binds): an attention key bias's gradient is rounding noise, 4 times the noise fails too, with a ratio of
    1.17; the other leaves' 4.0 names the fault. A leaf is noise when its reference, max_abs_err / max_rel_err,
    lies within its tolerance of 0."""
    record = _record(bad=("grad w", "grad b"), ratio=4.0, matches=("scale_blind",))  # the clip hides it
    noise = LeafError(0, "grad", "attn.key.bias", 3 * TOL, 3.0, 4 * TOL, False, 1.17, None)  # |ref| = TOL
    record = dataclasses.replace(record, leaves=(*record.leaves, noise))
    d = _one(diagnose([record], 4), "summed")
    assert "gradients are 4 x" in d.message
    # the same leaf with a reference above its tolerance is evidence, and spoils the consensus as before
    signal = dataclasses.replace(noise, max_rel_err=0.3)  # |ref| = 10 TOL
    spoiled = dataclasses.replace(record, leaves=(*record.leaves[:-1], signal))
    assert "summed" not in _codes(diagnose([spoiled], 4))


def test_averaged_twice():
    out = diagnose([_record(bad=UPDATE, ratio=0.25)], 4)
    d = _one(out, "averaged_twice")
    assert "averaged twice" in d.message and "x1/4" in d.message
    assert not FALLBACKS & set(_codes(out))
    assert "averaged_twice" not in _codes(diagnose(_passing(), 4))


def test_normalization():
    out = diagnose([_record(bad=UPDATE, matches=("per_shard_mean",))], 2)
    d = _one(out, "normalization")
    assert "At step 0 the step reproduces the mean of per-shard means (parameters and optimizer" in d.message
    assert "token count" in d.message and "C4-C6" in d.message
    assert d.leaf.startswith(("grad", "param"))
    assert "normalization" not in _codes(diagnose([_record(bad=UPDATE)], 2))
    assert "normalization" not in _codes(diagnose(_passing(), 2))


def test_normalization_suppresses_scaled_and_fallbacks():
    matched = ("per_shard_mean",)
    scaled = diagnose([_record(bad=UPDATE, ratio=1.7, matches=matched)], 2)
    assert _codes(scaled) == ["normalization"]
    no_factor = diagnose([_record(bad=UPDATE, matches=matched)], 2)
    assert _codes(no_factor) == ["normalization"]
    drifting = diagnose([_record(0), _record(1, bad=("param w",), matches=matched)], 2)
    assert _codes(drifting) == ["normalization"]
    # The shard-count factors and the counter rules are not affected.
    summed = diagnose([_record(bad=UPDATE, ratio=2.0, matches=matched)], 2)
    assert _codes(summed) == ["summed", "normalization"]
    counter = diagnose([_record(bad=UPDATE, counter=2, matches=matched)], 2)
    assert _codes(counter) == ["step_counter", "normalization"]


def test_scaled():
    out = diagnose([_record(bad=UPDATE, ratio=1.7)], 4)
    d = _one(out, "scaled")
    assert "1.7 x the reference's" in d.message and "not a shard count" in d.message
    assert "update_differs" not in _codes(out)
    assert "scaled" not in _codes(diagnose(_passing(), 4))


def test_loss_differs():
    out = diagnose([_record(bad=("loss",), candidate_loss=2.0)])
    d = _one(out, "loss_differs")
    assert "Only the returned loss differs" in d.message and "2 vs reference 1.5" in d.message
    assert _codes(out) == ["loss_differs"]
    assert "loss_differs" not in _codes(diagnose(_passing()))


def test_grads_differ():
    out = diagnose([_record(bad=("grad w",))])
    d = _one(out, "grads_differ")
    assert "exposed gradients differ (grad w, step 0)" in d.message
    assert _codes(out) == ["grads_differ"]
    assert "grads_differ" not in _codes(diagnose(_passing()))


def test_drift():
    out = diagnose([_record(0), _record(1), _record(2, bad=("param w",))])
    d = _one(out, "drift")
    assert "The first 2 step(s) agree; step 2 does not (param w: max abs err" in d.message
    assert _codes(out) == ["drift"]
    assert "drift" not in _codes(diagnose(_passing()))


def test_loss_only():
    out = diagnose([_record(bad=(*UPDATE, "opt_state 0.mu.w"))])
    d = _one(out, "loss_only")
    assert "Only the loss matches" in d.message and "(grad w: max abs err 0.1 > tolerance 0.001)" in d.message
    assert "this is not parity" in d.message
    assert _codes(out) == ["loss_only"]
    assert "loss_only" not in _codes(diagnose(_passing()))
    # the gradients and the optimizer state match: "only the loss matches" would be false (issue #36)
    assert _codes(diagnose([_record(bad=("param w", "param b"))])) == ["localized"]
    assert _codes(diagnose([_record(bad=("grad w", "param w", "param b", "opt_state 0.mu.w"))])) == [
        "localized"
    ]


def test_update_differs():
    out = diagnose([_record(bad=("loss", "param w"))])
    d = _one(out, "update_differs")
    assert "The update differs from the reference at step 0 (loss: max abs err" in d.message
    # the loss differs at step 0: computed another way, or at other parameters (shards one after another)
    assert (
        "not a single reduced step: the loss it returns is not the full-batch loss at its starting"
        in d.message
    )
    assert "or taken at other parameters (shards applied one after another)" in d.message
    assert _codes(out) == ["update_differs"]
    synced = diagnose([_record(0), _record(1, bad=("loss", "param w"), synchronized=True)])
    assert "(run from the reference's pre-step state)" in _one(synced, "update_differs").message
    assert "update_differs" not in _codes(diagnose(_passing()))
    # every parameter matches at that step (Adam's first step hides a gradient's size): "the update differs"
    # would be false; the sentence names what does differ (issue #36)
    hidden = _one(diagnose([_record(bad=("loss", "grad w", "opt_state 0.mu.w"))]), "update_differs").message
    assert hidden.startswith(
        "The loss, the gradients and the optimizer state differ from the reference at step 0"
    )
    assert "though the applied parameters match at this step (2 leaves)" in hidden
    assert "The update differs" not in hidden
    # a replay's parameters match only as far as their digests show (trial 35: live, 3 of 10 differed)
    import dataclasses

    replayed = dataclasses.replace(_record(bad=("loss", "grad w", "opt_state 0.mu.w")), replayed=True)
    said = _one(diagnose([replayed]), "update_differs").message
    assert (
        "though the applied parameters match at this step as far as the recorded digests show (2 leaves"
        in said
    )


def test_weak_check():
    loose = diagnose(_passing(rtol=0.2))
    assert _codes(loose) == ["parity", "weak_check"]
    assert "rtol=0.2 is too loose" in loose[1].message
    record = _record(0)
    tiny = _leaf("param", "b", change=TOL / 10)
    weak = dataclasses.replace(record, leaves=(*record.leaves, tiny))
    out = diagnose([weak])
    assert _codes(out) == ["parity", "weak_check"]
    assert "first update of param b is not larger than the tolerance" in out[1].message
    both = diagnose([dataclasses.replace(weak, rtol=0.2)])
    assert _codes(both) == ["parity", "weak_check"]  # merged into one finding
    assert "too loose" in both[1].message and "param b" in both[1].message
    assert "weak_check" not in _codes(diagnose(_passing()))


def _with_b(record: StepRecord, change: float) -> StepRecord:
    """``record`` with one more param leaf ``b2`` whose reference update is ``change`` (its tolerance TOL)."""
    return dataclasses.replace(
        record, leaves=(*record.leaves, _leaf("param", "b2", step=record.step, change=change))
    )


@pytest.mark.parametrize(
    ("changes", "weak"),
    [
        (
            (0.0, 10 * TOL, 10 * TOL),
            False,
        ),  # a warm-up from lr 0: the first update is 0, the later ones are seen
        ((0.0, TOL / 10, 10 * TOL), False),  # seen at one step suffices
        ((0.0, TOL / 10, TOL / 10), True),  # below tolerance at every step: blind to that leaf
        ((TOL / 10,), True),  # one step below
        ((10 * TOL, 0.0), False),
    ],
)
def test_weak_check_needs_an_update_below_tolerance_at_every_step(changes, weak):
    """Issue #34: every PASS of a run warming up linearly from lr 0 warned that the first update is not larger
    than the tolerance. The warning names a leaf whose update is below its tolerance at every step."""
    out = diagnose([_with_b(_record(t), c) for t, c in enumerate(changes)])
    assert _codes(out) == (["parity", "weak_check"] if weak else ["parity"])
    if weak:
        which = (
            "first update" if len(changes) == 1 else f"update at every one of the run's {len(changes)} steps"
        )
        assert out[1].message.startswith(
            f"The reference's {which} of param b2 is not larger than the tolerance"
        )
        assert out[1].leaf == "param b2"


def test_diverged_trajectory():
    diverged = _record(1, bad=("param w",))
    records = [_record(0), _record(1, synchronized=True), _record(2, synchronized=True)]
    out = diagnose(records, diverged=diverged)
    assert _codes(out) == ["diverged_trajectory"]
    assert "diverged at step 1 (param w: max abs err" in out[0].message
    assert "every step from 1 on (2 step(s))" in out[0].message
    # trial 18: a weight decay on one more leaf (pos_embed) stayed within each step's tolerance and accumulated;
    # "a property of the model, not a bug in the step" was false: both causes are named, and the leaf nearest its
    # tolerance from identical state, but one whose gradient is at rounding level (its update follows noise)
    assert "a property of the model, not a bug" not in out[0].message
    assert (
        "or a difference smaller than each step's tolerance that accumulates over the steps" in out[0].message
    )
    assert "from identical state, param w came nearest its tolerance (0.5 of it, step 1)" in out[0].message
    quiet = [_record(0), _record(1, synchronized=True, unresolved=("param w",))]
    assert "param b came nearest its tolerance" in diagnose(quiet, diverged=diverged)[0].message
    later = [
        _record(0),
        _record(1, synchronized=True),
        _record(2, bad=("loss", "param w"), synchronized=True),
    ]
    failing = diagnose(later, diverged=diverged)
    assert _codes(failing) == ["update_differs", "diverged_trajectory"]
    assert "but a later step did not" in failing[1].message
    assert "diverged_trajectory" not in _codes(diagnose(_passing()))
    # step 0 itself failed: "parity holds per step" would be false, whatever step 1's re-check says
    first = [
        _record(0, bad=("loss", "param w")),
        _record(1, synchronized=True),
        _record(2, synchronized=True),
    ]
    assert "diverged_trajectory" not in _codes(diagnose(first, diverged=diverged))


def test_rounding_level():
    records = [_record(0, unresolved=("param attn.key.bias",)), _record(1, unresolved=("param a.bias",))]
    out = diagnose(records)
    assert all(r.ok for r in records)
    assert _codes(out) == ["parity", "rounding_level"]
    d = out[1]
    assert "2 leaves have a gradient at rounding level (e.g. param a.bias:" in d.message
    assert d.leaf == "param a.bias"
    failing = diagnose([_record(bad=UPDATE, ratio=4.0, unresolved=("param b",))], 4)
    assert _codes(failing) == ["summed", "rounding_level"]
    assert _codes(diagnose(_passing())) == ["parity"]


def test_findings_order():
    records = [_record(0, bad=UPDATE, ratio=4.0, counter=4, replica_mismatches=("param w",), rtol=0.2)]
    out = diagnose(records, 4, reference_diverged_at=1)
    # a loose rtol is a passing report's caveat (weak_check): a failing one has found its error
    assert _codes(out) == ["reference_diverged", "replicas_differ", "step_counter", "summed"]


def _expert_record() -> StepRecord:
    """Step 0 of a mixture: the experts' leaves are x4 (gradients, updates, first moments), the gate's match."""
    leaves = [_leaf("loss", "loss")]
    for path, ratio in (("experts.w_in", 4.0), ("experts.w_out", 4.0), ("gate.kernel", 1.0)):
        ok = ratio == 1.0
        leaves += [
            _leaf("grad", path, ok=ok, ratio=ratio),
            _leaf("param", path, ok=ok, ratio=ratio),
            _leaf("opt_state", f"0.mu.{path}", ok=ok, ratio=ratio),
        ]
    leaves.append(_leaf("counter", "step"))
    return StepRecord(
        0, leaves=tuple(leaves), rtol=1e-5, atol=1e-6, loss=1.5, candidate_loss=1.5, step_count=1,
        candidate_step_count=1,
    )  # fmt: skip


def test_expert_leaves_scaled_by_the_expert_group_are_an_expert_parallel_scaling_fault():
    found = diagnose([_expert_record()], 2, mesh_shape={"data": 2, "expert": 4})
    assert _codes(found)[0] == "expert_scaling"
    message = found[0].message
    assert "(experts.w_in, experts.w_out) is x4 the reference's" in message
    assert "x4 is the size of mesh axis 'expert', the expert-parallel group" in message
    assert "divide their gradients by 4" in message and "summed instead of averaged" not in message
    # trial 27: a psum over 'expert' taken twice reads the same: named beside the normalization, with its fix
    assert "or they were psum-ed over 'expert' once too often (a second psum after the reduction" in message


def test_the_same_factor_on_a_tensor_axis_is_a_replicated_leaf_added_before_the_psum():
    found = diagnose([_expert_record()], 2, mesh_shape={"data": 2, "model": 4})
    assert _codes(found)[0] == "replicated_reduced"
    assert "added before the psum over 'model' counts once per shard" in found[0].message
    assert "expert-parallel" not in found[0].message


def test_a_factor_on_every_gradient_is_still_read_as_the_whole_gradient_s():
    record = _expert_record()
    every = tuple(
        dataclasses.replace(e, ok=False, ratio=4.0) if e.kind in ("grad", "param", "opt_state") else e
        for e in record.leaves
    )
    found = diagnose([dataclasses.replace(record, leaves=every)], 2, mesh_shape={"data": 2, "expert": 4})
    assert _codes(found)[0] == "summed"


def test_a_factor_one_over_s_beside_differing_replicas_is_a_gradient_never_all_reduced():
    """x1/S with replicated leaves that differ after the same step: each device applied its own shard's share
    (trial 11: a local sum over the global count, no psum; the step returned the devices' average), not 'averaged
    twice', which would leave the replicas equal; with equal replicas the factor still reads averaged twice."""
    unequal = diagnose(
        [_record(bad=UPDATE, ratio=0.25, replica_mismatches=("param b",), replica_axes=("data",))], 4
    )
    d = _one(unequal, "unreduced")
    assert "x1/4" in d.message and "differ across devices along 'data'" in d.message
    assert "psum the gradients before dividing" in d.message and "averaged_twice" not in _codes(unequal)
    assert "averaged_twice" in _codes(diagnose([_record(bad=UPDATE, ratio=0.25)], 4))
    summed = diagnose([_record(bad=UPDATE, ratio=4.0, replica_mismatches=("param b",))], 4)
    assert "unreduced" not in _codes(summed) and "summed" in _codes(summed)


def test_a_factor_that_is_one_mesh_axis_size_names_the_axis():
    """Trial 15: biases psum-ed over 'fsdp' once too often on data=2,fsdp=2 (S=4) were x2 and read 'a constant
    factor that is not a shard count'; the size of one axis of several is named, and S itself still reads as S."""
    mesh = {"data": 2, "fsdp": 2}
    d = _one(diagnose([_record(bad=UPDATE, ratio=2.0)], 4, mesh_shape=mesh), "summed")
    assert "x2, the size of mesh axes 'data' or 'fsdp' (each): the gradient was summed over" in d.message
    halved = diagnose([_record(bad=UPDATE, ratio=0.5)], 4, mesh_shape={"data": 4, "fsdp": 2})
    assert "x1/2, the size of mesh axis 'fsdp'" in _one(halved, "averaged_twice").message
    assert (
        "the size of mesh axis"
        not in _one(diagnose([_record(bad=UPDATE, ratio=4.0)], 4, mesh_shape=mesh), "summed").message
    )
    assert "scaled" in _codes(diagnose([_record(bad=UPDATE, ratio=3.0)], 4, mesh_shape=mesh))
