"""Sentences a tenth user's trial found false (issue #36): a tiny packed T5 with Adafactor under a MultiSteps
accumulation, on a data=2 x fsdp=2 mesh, float32 and bfloat16 compute. Each both ways, on hand-built records or
arrays where the rule allows, and one replay of the counter zoo.

- A token count taken per micro-batch (the loss differs at equal parameters, step 1) was called
  ``low_precision_reduction`` ("the gradients were likely all-reduced in bfloat16"): a reduction of the gradients
  cannot change the loss. Replayed, the same step read ``drift`` ("may be rounding divergence") although the
  replay's state before it hashed as the recording's: it ran from the recorded state exactly.
- Under bfloat16 compute the module probe compared every bfloat16 output exactly (numpy reads bfloat16 as not
  inexact: tolerance 0) and named a correct output projection, then (at 4 eps) a correct cross-attention.
- "every leaf differs but those at rounding level (a true gradient of 0 ...)" of parameters whose applied update
  differs; "every gradient but the rounding-level ones differs" beside "all 51 gradient leaves differ"; "the
  10th-90th percentile of its 1 recorded samples".
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from conftest import require_devices, zoo_module

from shardcheck import check_parity, make_mesh
from shardcheck.parity.comparison.digest import DIVERGENCE, divergence_refuted
from shardcheck.parity.diagnosis import rules
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord, percentiles
from shardcheck.parity.diagnosis.grouping import state_property
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.module_outputs import MATCHES, ModuleCall, compare, find_module
from shardcheck.parity.harness.recorded import record_run

TOL = 1e-3


def _leaf(kind, path, ok=True, ratio=None, spread=None, size=1.0):
    """A leaf of reference size ``size``: within tolerance, or off by ``ratio`` (1.0 error where none)."""
    if ok:
        return LeafError(0, kind, path, TOL / 2, TOL / 2 / size, TOL, True, None, None, None, (4,))
    err = abs(ratio - 1) * size if ratio is not None else 1.0
    return LeafError(0, kind, path, err, err / size, TOL, False, ratio, None, spread, (4,))


COUNTERS = (LeafError(0, "counter", "step", 0.0, 0.0, 0.0, True, shape=()),)


def _record(leaves, step=0, **kw):
    leaves = tuple(dataclasses.replace(e, step=step) for e in (*leaves, *COUNTERS))
    return StepRecord(step, 1e-5, 1e-7, 1.0, 1.0, leaves, step + 1, step + 1, **kw)


# ------------------------------------------------------------------------ 1. a loss that differs is no reduction


def test_a_bfloat16_reduction_is_never_said_where_the_loss_differs_at_that_step():
    grads = [_leaf("grad", "w", False, 0.98, (0.9, 1.05)), _leaf("grad", "b", False, 1.01, (0.95, 1.1))]
    params = [_leaf("param", "w", False, 0.99, (0.9, 1.05)), _leaf("param", "b")]
    loss_ok = _record([_leaf("loss", "loss"), *grads, *params], matches=("bf16_reduction",))
    codes = {d.code: d.message for d in rules.diagnose([loss_ok], 4)}
    assert (
        "low_precision_reduction" in codes and "all-reduced in bfloat16" in codes["low_precision_reduction"]
    )
    # the trial's: the loss 0.9999 x at equal parameters, every gradient off
    loss_off = dataclasses.replace(
        loss_ok,
        leaves=(_leaf("loss", "loss", False, 0.9999, (0.9999, 0.9999), size=4.0), *loss_ok.leaves[1:]),
    )
    codes = {d.code: d.message for d in rules.diagnose([loss_off], 4)}
    assert "low_precision_reduction" not in codes and not any("bfloat16" in m for m in codes.values())
    assert "update_differs" in codes


def _late_loss(identical: bool) -> list[StepRecord]:
    """A replay whose step 0 matched and whose step 1's loss differs (every gradient too), the optimizer rerun
    on its own gradients matching; ``identical``: its state before step 1 hashed as the recording's."""
    grads = [_leaf("grad", p, False, r, (r - 0.05, r + 0.05)) for p, r in (("w", 0.97), ("b", 1.04))]
    rerun = tuple(dataclasses.replace(_leaf("param", p), step=1) for p in ("w", "b"))
    leaves = [_leaf("loss", "loss", False, 0.9999, size=4.0), *grads, _leaf("param", "w", False, 0.98)]
    first = _record(leaves, step=1, optimizer_rerun=rerun, replayed=True, identical_start=identical)
    return [_record([_leaf("loss", "loss"), _leaf("param", "w")], replayed=True), first]


def test_a_replayed_step_run_from_the_recorded_state_reads_as_live_not_as_drift():
    live_like = _late_loss(True)
    codes = {d.code: d.message for d in rules.diagnose(live_like, 4)}
    # trial 44: the forward pass differs first and its update from equal inputs matches: forward_differs
    assert "drift" not in codes and "update_differs" not in codes
    assert codes["forward_differs"].startswith(
        "The update differs from the reference at step 1 (from a pre-step state bitwise the recording's) (grad b: "
        "max abs err 0.04 > tolerance 0.001"
    )
    loc = localize(live_like)
    assert loc.text().startswith(
        "First difference at step 1 (run from the reference's pre-step state): the forward"
    )
    assert divergence_refuted(loc, live_like)
    # the other side: a state that matched within tolerance only, not bitwise: which cause, a replay cannot tell
    drifted = _late_loss(False)
    codes = {d.code: d.message for d in rules.diagnose(drifted, 4)}
    assert not {"update_differs", "forward_differs"} & set(codes)
    assert "A replay cannot rerun step 1" in codes["drift"]
    assert "(run from the reference's pre-step state)" not in localize(drifted).text()
    assert not divergence_refuted(localize(drifted), drifted)


def _counter_zoo():
    return zoo_module(Path(__file__).resolve().parents[1] / "examples" / "zoo" / "counter.py")


@require_devices(4)
def test_a_replay_whose_state_before_the_failing_step_hashed_as_the_recordings_is_not_called_divergence():
    """The counter zoo recorded for 2 steps; replayed by a step whose returned loss is 1% off at step 1 only.
    Step 0 is bitwise the recording's, so step 1 ran from the recorded state: no divergence note, no drift. The
    same step nudging a bias by 1e-7 at step 0 (within tolerance, not bitwise) is read as before."""
    counter = _counter_zoo()
    mesh = make_mesh(counter.MESH)
    recording = record_run(counter.task, counter.step, mesh=mesh, steps=2)
    second = np.asarray(counter.task.batches[1]["x"])

    def late(nudge):
        def step(model, optimizer, batch, mesh):
            at_1 = np.array_equal(np.asarray(batch["x"]), second)
            loss = counter.step(model, optimizer, batch, mesh)
            if not at_1 and nudge:
                model.hidden.bias[...] = model.hidden.bias[...] + nudge
            return loss * 1.01 if at_1 else loss

        return step

    exact = check_parity(late(0.0), counter.task, mesh=mesh, reference=recording)
    first = next(r for r in exact.steps if not r.ok)
    assert exact.verdict == "FAIL" and first.step == 1 and first.identical_start
    text = " ".join(str(exact).split())
    assert "drift" not in exact.codes and DIVERGENCE not in text, text
    # a replay re-runs nothing from the reference's state: its step started bitwise from the recording's (trial 22)
    assert "First difference at step 1 (from a pre-step state bitwise the recording's)" in text
    nudged = check_parity(late(1e-7), counter.task, mesh=mesh, reference=recording)
    first = next(r for r in nudged.steps if not r.ok)
    assert nudged.verdict == "FAIL" and first.step == 1 and not first.identical_start
    assert nudged.steps[0].ok  # the nudge is within tolerance
    text = " ".join(str(nudged).split())
    assert "(run from the reference's pre-step state)" not in text and DIVERGENCE in text, text


# ------------------------------------------------------------------ 2. a module's bfloat16 output is not exact


def _attention(x, w, halves: int, keep: int | None = None):
    """A bfloat16 attention-like output: logits rounded to bfloat16 before a float32 softmax, the weights back in
    bfloat16, the value contraction summed over ``halves`` partial sums in bfloat16 (as a sharded contraction
    sums its shards); ``keep``: only that partial sum (a psum left out)."""
    logits = (x @ w).astype(jnp.bfloat16)
    weights = jnp.asarray(np.exp(np.asarray(logits, np.float32)), jnp.float32)
    weights = (weights / weights.sum(-1, keepdims=True)).astype(jnp.bfloat16)
    v = x.astype(jnp.bfloat16)
    n = v.shape[0] // halves
    parts = [
        (weights[:, i * n : (i + 1) * n] @ v[i * n : (i + 1) * n]).astype(jnp.bfloat16) for i in range(halves)
    ]
    if keep is not None:
        return np.asarray(parts[keep])
    return np.asarray(sum(parts[1:], parts[0]).astype(jnp.bfloat16))


def test_a_bfloat16_module_output_is_held_to_its_dtypes_rounding_not_compared_exactly():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 16)) * 2, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(16, 16)), jnp.bfloat16)
    ref, sharded = _attention(x, w, 1), _attention(x, w, 2)
    assert (
        ref.dtype == jnp.bfloat16 and np.max(np.abs(ref.astype(np.float64) - sharded.astype(np.float64))) > 0
    )
    bound = 16 * 2.0**-7 * float(np.max(np.abs(ref.astype(np.float64))))
    same = compare((ref,), (sharded,), 0.0, 0.0)  # a policy that read no compute dtype: the array's own
    assert same.tolerance == bound and not same.differs
    # a psum left out: half the contraction, far beyond bfloat16's rounding
    partial = compare((ref,), (_attention(x, w, 2, keep=0),), 0.0, 0.0)
    assert partial.tolerance == bound and partial.differs and partial.max_abs_err > 4 * bound
    # integers are still compared exactly
    assert compare((np.array([1, 2]),), (np.array([1, 3]),), 0.1, 0.1).differs
    calls = {"attn.__call__": ModuleCall("attn.__call__", 0, 1, -1, (np.asarray(x),), (ref,))}
    cand = {"attn.__call__": dataclasses.replace(calls["attn.__call__"], output=(sharded,))}
    assert find_module(calls, cand, (1e-6, 1e-7), "mesh").status == MATCHES


# ----------------------------------------------------------- 3-5. rounding-level, every-gradient and one sample


def test_rounding_level_parameters_whose_applied_update_differs_are_not_said_to_match():
    failing = {"a.kernel": (4, 4), "b.bias": (4,)}
    matching = {"q.kernel": (4, 4)}
    params = {**failing, **matching}
    said = state_property(failing, matching, params, quiet={"q.kernel"})
    assert said == (
        "every leaf differs but those with elements whose gradient is at rounding level (near 0 at that step: a "
        "true gradient of 0, such as an attention key bias's, or one small by chance), allowed their noise: "
        "q.kernel"
    )
    # the trial's: it matched the optimizer's rerun only within its noise allowance; its applied update differs
    applied = state_property(
        failing, matching, params, quiet={"q.kernel"}, differ_later={"a.kernel", "q.kernel"}
    )
    assert applied == (
        "every leaf differs: those with elements whose gradient is at rounding level (near 0 at that step: a true "
        "gradient of 0, such as an attention key bias's, or one small by chance) match this stage only within "
        "their noise allowance, and their applied parameters differ: q.kernel"
    )
    assert "true gradient of 0 in all or some" not in said + applied


def test_the_rounding_level_note_says_small_by_chance_too():
    record = _record([_leaf("param", "w", False, 1.5, (1.4, 1.6))], unresolved=("w",), normalized=("w",))
    note = next(d.message for d in rules.diagnose([record], 4) if d.code == "rounding_level")
    assert (
        "(e.g. w: elements whose gradient is at rounding level (near 0 at that step: a true gradient of 0, such as "
        "an attention key bias, the key third of a fused qkv bias or a LoRA factor A while its B is still 0, or "
        "one small by chance))" in note
    )


def test_every_gradient_is_said_to_differ_where_none_is_at_rounding_level():
    grads = [
        _leaf("grad", "a.kernel", False, 1.5, (1.2, 1.8)),
        _leaf("grad", "b.kernel", False, 0.7, (0.5, 0.9)),
    ]
    for ratio in (1.008, 1.0000762):  # a factor, and one that prints as 1
        loc = localize([_record([_leaf("loss", "loss", False, ratio), *grads])])
        assert loc.group == "the loss's difference reaches every gradient: all 2 gradient leaves differ"
        assert (
            "every gradient differs" in loc.form.sentence and "rounding-level ones" not in loc.form.sentence
        )
    # a matching gradient at rounding level: said so
    quiet = _leaf("grad", "k.bias", size=1e-5)
    loc = localize([_record([_leaf("loss", "loss", False, 1.008), *grads, quiet])])
    assert "every gradient but the rounding-level ones differs, by no one factor" in loc.form.sentence


def test_one_recorded_sample_has_no_percentile():
    one = dataclasses.replace(_leaf("loss", "loss", False, 0.9999, (0.9999, 0.9999)), samples=1)
    assert percentiles(one) == "its 1 recorded sample"
    assert (
        percentiles(dataclasses.replace(one, samples=8)) == "10th-90th percentile of its 8 recorded samples"
    )
    assert percentiles(dataclasses.replace(one, samples=None)) == "10th-90th percentile"
    loc = localize([_record([one, _leaf("grad", "w", False, 1.5, (1.2, 1.8))])])
    # the loss is one number: its ratio is said as a number, with no spread over elements (trial 12), and not as
    # "a factor" where its gradients differ by no one factor (trial 31)
    assert loc.form.sentence.startswith("the loss at equal parameters is 0.9999 x")
    assert "1 recorded samples" not in loc.text() and "percentile" not in loc.form.sentence
