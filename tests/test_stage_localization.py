"""Every FAIL is localized by stage, leaf group and form (``shardcheck.parity.diagnosis.localization``).

Faults planted in one tiny LM (shardcheck's ``tiny-lm`` task, one layer of width 16, one step) on dp, FSDP, a
data x model mesh and gradient accumulation; each report must name the first stage at which the steps part, what
the failing leaves share, and the form of their difference, with its numbers. The correct step still PASSes. A
hypothesis property test on hand-built records: the stage named is the first stage whose records fail.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck._tree import path_str
from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord
from shardcheck.parity.diagnosis.form import fit_form, form_from_leaves
from shardcheck.parity.diagnosis.grouping import LeafFacts, shared_property
from shardcheck.parity.diagnosis.localization import STAGES, consistent, contradiction, localize
from shardcheck.parity.diagnosis.replica_form import fit_replicas
from shardcheck.parity.harness.candidates import as_candidate
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps import Candidate
from shardcheck.steps._core import params_value_and_grad
from shardcheck.tasks import TinyLMConfig, load_task

CFG = TinyLMConfig(d_model=16, num_heads=2, num_layers=1, seq_len=16, mlp_dim=32)
LR, WD = 1e-2, 0.1


def _decayed(keep_scale: bool):
    """The weight-decay mask: every leaf but the biases (and, ``keep_scale=False``, but the norm scales)."""
    ends = ("bias",) if keep_scale else ("bias", "scale")

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: not path_str(p).endswith(ends), params)

    return mask


def _adamw(eps: float = 1e-8, keep_scale: bool = True, lr=LR):
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=lr, weight_decay=WD, eps=eps, mask=_decayed(keep_scale)
    )


@functools.cache
def _task(steps: int = 1, tensor_parallel=None, schedule: bool = False):
    tx = optax.adam(optax.exponential_decay(LR, 1, 0.5)) if schedule else _adamw()
    tp = None if tensor_parallel is None else dict(tensor_parallel)
    return load_task("tiny-lm", config=CFG, batch_size=8, steps=steps, optimizer=tx, tensor_parallel=tp)


def _with_tx(cand: Candidate, tx) -> Candidate:
    """``cand`` stepping its own optimizer transformation ``tx`` (same state structure as the reference's)."""
    inner = cand.make_optimizer

    def make(model, optimizer):
        own = nnx.Optimizer(model, tx, wrt=nnx.Param)
        nnx.update(own, nnx.state(optimizer))
        return own if inner is None else inner(model, own)

    return dataclasses.replace(cand, make_optimizer=make)


def _eps_for(prefix: str, eps: float):
    """The reference's AdamW, with Adam's epsilon ``eps`` for the leaves under ``prefix`` (the same state)."""
    base = _adamw()

    def update(grads, state, params=None):
        u, new = base.update(grads, state, params)
        hyper = {**state.hyperparams, "eps": jnp.asarray(eps, state.hyperparams["eps"].dtype)}
        v, _ = base.update(grads, state._replace(hyperparams=hyper), params)
        pick = lambda p, a, b: b if path_str(p).startswith(prefix) else a  # noqa: E731
        return jax.tree_util.tree_map_with_path(pick, u, v), new

    return optax.GradientTransformation(base.init, update)


def _scaled_grads(loss_fn, module: str, factor: float):
    """``loss_fn`` whose gradient of the leaves of ``module`` is ``factor`` times the true one (same value)."""

    def scaled(model, batch):
        mod = model
        for name in module.split("."):
            mod = mod[int(name)] if name.isdigit() else getattr(mod, name)
        for leaf in (mod.kernel, mod.bias):
            w = leaf[...]
            leaf[...] = factor * w - (factor - 1) * jax.lax.stop_gradient(w)
        return loss_fn(model, batch)

    return scaled


def _unreduced_step(loss_fn, mesh, prefix: str, returns_grads: bool = True):
    """A dp step whose gradients of the leaves under ``prefix`` are not psum-ed over ``data`` (each device keeps
    its own shard's), returned (``returns_grads``) and applied: ``shard_map`` with ``check_vma=False`` calls them
    replicated."""

    def step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, batch):
            total, weight, grads = params_value_and_grad(loss_fn, graphdef, params, rest, batch)
            weight = jax.lax.psum(weight, "data")
            grads = jax.tree_util.tree_map_with_path(
                lambda p, g: (g if path_str(p).startswith(prefix) else jax.lax.psum(g, "data")) / weight,
                grads,
            )
            return jax.lax.psum(total, "data") / weight, grads

        loss, grads = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
        )(params, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads} if returns_grads else loss

    return Candidate("unreduced", nnx.jit(step), num_shards=2)


@functools.cache
def _recording(task, candidate, num_shards=None, mesh=None):
    """A one-step recording of the right step ``candidate`` (what ``shardcheck record`` saves), one per task."""
    return record_run(task, candidate, num_shards=num_shards, mesh=mesh)


def _replayed_as_live(live, candidate, task, right, *, num_shards=None, mesh=None):
    """The fault replayed against a recording of the ``right`` step (``check_parity(..., reference=recording)``,
    what ``verify --against`` runs) is localized as ``live`` is: the same step, stage, group and form (kind,
    sentence and numbers). The replicas too: a replay compares its own copies across the devices after each step
    (trial 37; a digest hashes one copy of each slice), so where they differ live they differ replayed. Returns
    the replay's localization."""
    rec = _recording(task, right, num_shards, mesh)
    replayed = _loc(check_parity(candidate, task, num_shards=num_shards, mesh=mesh, reference=rec))
    assert (replayed.step, replayed.stage, replayed.group) == (live.step, live.stage, live.group), (
        live.text(),
        replayed.text(),
    )
    same = ("kind", "leaves", "groups")
    assert [getattr(replayed.form, k) for k in same] == [getattr(live.form, k) for k in same], (
        live.form,
        replayed.form,
    )
    for k in ("factor", "coefficient"):
        want = getattr(live.form, k)
        assert getattr(replayed.form, k) == (want if want is None else pytest.approx(want, rel=1e-3)), k
    assert replayed.status("replicas") == live.status("replicas") != "not observed"
    assert "Not observed: the replicas" not in replayed.text()
    # every stage up to the localized one reads the same (a later one may be read otherwise: a replay reruns the
    # optimizer only where it localizes the optimizer or the parameters)
    for stage in STAGES[: STAGES.index(live.stage) + 1]:
        assert replayed.status(stage) == live.status(stage), stage
    return replayed


def _loc(report):
    assert not report.ok
    loc = report.localization
    assert loc is not None and loc.stage is not None
    text = str(report)
    # the leading finding first, then the localization, then the other findings (trial 53: the cause first)
    lead, *others = report.diagnoses
    assert text.index(f"[{lead.code}]") < text.index("[localization]")
    assert all(text.index("[localization]") < text.index(f"[{d.code}]") for d in others)
    assert report.diagnosis_lines[:2] == (
        f"[{lead.code}] {report.findings[0][1]}",
        f"[localization] {loc.text()}",  # a cause that names no form leaves "no simple form" as it is
    )
    assert report.to_dict()["localization"]["stage"] == loc.stage
    assert report.diagnosis.startswith(f"{report.findings[0][1]} Localization: {loc.text()}")  # as the CLI's
    return loc


# ------------------------------------------------------------------------------------- planted faults


@require_devices(2)
def test_a_correct_dp_step_passes_with_no_localization():
    report = check_parity("dp", _task(), num_shards=2)
    assert report.ok and report.localization is None
    assert report.to_dict()["localization"] is None


@require_devices(2)
def test_a_norm_scale_left_out_of_the_decay_mask_is_the_optimizer_stage_with_its_decay_coefficient():
    cand = _with_tx(as_candidate("t", "dp", _task(), 2, None, None), _adamw(keep_scale=False))
    report = check_parity(cand, _task(), num_shards=2)
    loc = _loc(report)
    assert loc.stage == "optimizer"
    assert [loc.status(s) for s in STAGES[:3]] == ["matches", "matches", "matches"]
    assert loc.group.startswith("every failing leaf is a scale; every bias, embedding, kernel matches")
    assert loc.form.kind == "decay" and loc.form.coefficient == pytest.approx(WD, rel=1e-3)
    assert loc.form.leaves == 3  # ln1, ln2, ln_f
    # one true sentence for the decay, said the same by the localization and the [localized] finding (a new
    # user's trial read "coefficient 0.1 x lr" in one and "a constant factor" in the other)
    said = (
        "Form: a decoupled weight decay term c*lr*param with c = 0.1 (learning rate 0.01 at this step) on all 3 "
        "failing leaves (the difference"
    )
    assert said in loc.text() and "the reference applies it and the candidate skipped it" in loc.text()
    localized = next(d.message for d in report.diagnoses if d.code == "localized")
    assert said in localized and "factor" not in localized and " x lr" not in report.diagnosis
    # the stages of parameters and optimizer state count each kind (the applied parameters read "3 of 72
    # leaves": 22 parameters and 50 optimizer-state leaves)
    for stage in (
        "the optimizer's update from equal inputs",
        "the applied parameters and the optimizer state",
    ):
        assert f"{stage}: differs (3 of 22 parameters and 0 of 50 optimizer-state leaves; worst" in loc.text()
    # replayed: the task's optimizer rerun on the candidate's gradients (its own optimizer beside), the decay
    # fitted on the rerun's arrays as live
    _replayed_as_live(loc, cand, _task(), "dp", num_shards=2)


@require_devices(2)
def test_an_adam_epsilon_of_one_module_under_fsdp_is_the_optimizer_stage_under_that_module():
    cand = _with_tx(as_candidate("t", "fsdp", _task(), 2, None, None), _eps_for("blocks.0.fc1", 1e-3))
    loc = _loc(check_parity(cand, _task(), num_shards=2))
    assert loc.stage == "optimizer" and loc.status("gradients") == "matches"
    assert loc.group.startswith("every failing leaf is under blocks.0.fc1; every other leaf matches")
    assert loc.form.kind == "none"
    lo, hi = (float(v) for v in loc.form.sentence.split("runs from ")[1].split(" (")[0].split(" to "))
    assert 0 < lo < hi < 1  # a larger epsilon shrinks each element's step by its own amount: no one factor
    assert _replayed_as_live(loc, cand, _task(), "fsdp", num_shards=2).form.sentence == loc.form.sentence


@require_devices(4)
def test_one_modules_gradients_scaled_on_a_data_x_model_mesh_is_the_gradient_stage_with_its_factor():
    task = _task(tensor_parallel=(("model", 2),))
    mesh = make_mesh({"data": 2, "model": 2})
    faulty = dataclasses.replace(task, loss_fn=_scaled_grads(task.loss_fn, "blocks.0.fc2", 3.0))
    cand = as_candidate("t", "dp", faulty, 2, mesh, None)
    loc = _loc(check_parity(cand, task, mesh=mesh))
    assert loc.stage == "gradients" and loc.status("forward") == "matches"
    assert loc.group.startswith("every failing leaf is under blocks.0.fc2; every other leaf matches")
    assert loc.form.kind == "factor" and loc.form.factor == pytest.approx(3.0, rel=1e-3)
    lo, hi = loc.form.spread
    assert 2.99 < lo <= hi < 3.01 and "constant factor 3 on all 2 failing leaves" in loc.text()
    right = as_candidate("t", "dp", task, 2, mesh, None)
    replayed = _replayed_as_live(loc, cand, task, right, mesh=mesh)
    # the same sentence as live, its spread read from the recorded samples (a trial's replay said less)
    head = (
        "a constant factor 3 on all 2 failing leaves (each leaf's elementwise ratio within 3..3, 10th-90th "
    )
    meaning = "these values scaled by one factor (a scale applied to these leaves only)"
    assert head in loc.form.sentence and meaning in loc.form.sentence
    assert head in replayed.form.sentence and meaning in replayed.form.sentence


def test_a_learning_rate_schedule_one_step_ahead_under_accumulation_is_the_optimizer_stage_x_one_half():
    task = _task(schedule=True)
    ahead = optax.adam(lambda count: optax.exponential_decay(LR, 1, 0.5)(count + 1))
    cand = _with_tx(as_candidate("t", "accumulation", task, 4, None, None), ahead)
    loc = _loc(check_parity(cand, task, num_shards=4))
    assert loc.stage == "optimizer" and loc.status("gradients") == "matches"
    assert loc.form.kind == "factor" and loc.form.factor == pytest.approx(0.5, rel=1e-3)
    # every parameter but the attention key bias, whose gradient is rounding noise; the optimizer state matches
    assert loc.group.startswith("all 22 parameter leaves but blocks.0.attn.key.bias differ")
    assert "every optimizer-state leaf of this stage matches" in loc.group
    # replayed: the key bias's rerun update (of a rounding-level gradient) within the digests' allowance, as live
    assert _replayed_as_live(loc, cand, task, "accumulation", num_shards=4).form.sentence == loc.form.sentence


@require_devices(2)
def test_a_gradient_left_unreduced_over_data_for_one_module_is_the_gradient_stage_and_its_replicas_differ():
    task = _task()
    mesh = make_mesh({"data": 2})
    cand = _unreduced_step(task.loss_fn, mesh, "blocks.0.fc1")
    loc = _loc(check_parity(cand, task, num_shards=2))
    assert loc.stage == "gradients"
    assert loc.group.startswith("every failing leaf is under blocks.0.fc1")
    assert loc.status("replicas") == "differs"
    replicas = next(s for s in loc.stages if s.stage == "replicas")
    assert "along 'data'" in replicas.note
    assert loc.form.kind in ("none", "factor", "per_group") and loc.form.leaves == 2
    # replayed: the same stage, group and form; the replicas, which the replay compares too (trial 37), differ
    # along 'data' as live
    replayed = _replayed_as_live(loc, cand, task, "dp", num_shards=2)
    assert replayed.status("replicas") == "differs" and "along 'data'" in replayed.text()


@require_devices(2)
def test_the_replicas_stage_gives_the_form_of_the_copies_disagreement():
    """The unreduced fault from a step that returns no gradients: the first stage that differs is the replicas.
    Adam's first moment is linear in the gradient, so its two copies' changes sum to the reference's (their mean
    is 1/2 of it); the parameters (a normalized update) and the second moment (squares) have no simple form."""
    task = _task()
    cand = _unreduced_step(task.loss_fn, make_mesh({"data": 2}), "blocks.0.fc1", returns_grads=False)
    loc = _loc(check_parity(cand, task, num_shards=2))
    assert (loc.stage, loc.status("gradients")) == ("replicas", "not observed")
    # the optimizer-state leaves read as the parameters they belong to
    assert (
        loc.group
        == "every leaf whose copies differ is under blocks.0.fc1; every other leaf has copies that agree"
    )
    assert loc.form.kind == "replicas" and loc.form.leaves == 6 and loc.form.factor is None
    lo, hi = loc.form.spread
    assert 0 < lo <= hi  # the copies differ, by up to this fraction of the reference's largest change
    text = loc.form.sentence
    assert text.startswith(
        f"the copies along 'data' differ by up to {hi:.3g} of the reference's largest change"
    )
    mu = "inner_state.0.mu.blocks.0.fc1.bias, inner_state.0.mu.blocks.0.fc1.kernel (2 leaves)"
    assert (
        f"on opt_state {mu.replace(', ', ', opt_state ')} the copies' changes sum to the reference's" in text
    )
    assert (
        "(their mean is 1/2 of it, within 0.5..0.5)" in text or "(their mean is 1/2 of it, within 0.4" in text
    )
    assert "each device kept its own shard's part, a sum over 'data' missed" in text
    assert "(4 leaves) no simple form" in text and "param blocks.0.fc1.bias" in text
    assert f"Form: {text}." in loc.text()


def test_the_replicas_form_on_arrays_sum_mean_and_none():
    rng = np.random.default_rng(0)
    before, dr = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    ref = before + dr
    parts = rng.uniform(0.2, 0.8, size=(4, 3))
    halves = [before + parts * dr, before + (1 - parts) * dr]  # two shards' parts of a sum
    f = fit_replicas({"opt_state mu.a": ([((slice(None),) * 2, halves)], before, ref)}, ("data",))
    assert f.kind == "replicas" and f.factor == pytest.approx(0.5)
    assert (
        "sum to the reference's (their mean is 1/2 of it" in f.sentence and "over 'data' missed" in f.sentence
    )
    spread = [before + 2 * parts * dr, before + 2 * (1 - parts) * dr]  # two copies averaging to the reference
    g = fit_replicas({"param a": ([((slice(None),) * 2, spread)], before, ref)}, ("data",))
    assert g.factor == pytest.approx(1.0) and "average to the reference's" in g.sentence
    assert "a mean over 'data' missed" in g.sentence
    # trial 9's clip by each device's local norm: the gradients matched, so no mean of them was missed
    after = fit_replicas({"param a": ([((slice(None),) * 2, spread)], before, ref)}, ("data",), True)
    assert "each copy moved by its own amount around it, from gradients that match" in after.sentence
    assert "missed" not in after.sentence.replace("not a mean of the gradients missed", "")
    noise = [before + rng.normal(size=(4, 3)), before + rng.normal(size=(4, 3))]
    h = fit_replicas({"param a": ([((slice(None),) * 2, noise)], before, ref)})
    assert h.factor is None and "no simple form" in h.sentence
    with pytest.raises(ValueError, match="fit_replicas: leaves is empty"):
        fit_replicas({})


# ------------------------------------------------------------------------------------- the form, on arrays


def test_the_form_fits_each_planted_difference_with_its_numbers():
    rng = np.random.default_rng(0)
    before = {"a": rng.normal(size=(8, 4)), "b": rng.normal(size=8)}
    dr = {k: rng.normal(size=v.shape) for k, v in before.items()}
    after = {k: before[k] + dr[k] for k in before}

    def cand(f):
        return {k: before[k] + f(k) for k in before}

    assert fit_form(before, after, cand(lambda k: 0 * dr[k])).kind == "zero"
    assert fit_form(before, after, cand(lambda k: -dr[k])).kind == "sign_flip"
    f = fit_form(before, after, cand(lambda k: 0.7 * dr[k]))
    assert (f.kind, round(f.factor, 6)) == ("factor", 0.7)
    assert fit_form(before, after, cand(lambda k: 2 * dr[k])).kind == "extra_step"
    g = fit_form(before, after, cand(lambda k: (3.0 if k == "a" else 1.5) * dr[k]))
    assert g.kind == "per_group" and [(round(x, 6), p) for x, p in g.groups] == [(1.5, ("b",)), (3.0, ("a",))]
    d = fit_form(before, after, cand(lambda k: dr[k] - 0.05 * 0.1 * before[k]), lr=0.05)
    assert d.kind == "decay" and d.coefficient == pytest.approx(0.1, rel=1e-9) and "applies" in d.sentence
    noise = fit_form(before, after, cand(lambda k: dr[k] * rng.uniform(0.5, 2.0, size=dr[k].shape)))
    assert noise.kind == "none" and "runs from" in noise.sentence
    with pytest.raises(ValueError, match="fit_form: cand_after is empty"):
        fit_form({}, {}, {})


def test_the_form_from_records_claims_a_factor_only_when_each_leaf_is_constant():
    def e(path, ratio, spread):
        return LeafError(0, "grad", path, 1.0, 1.0, 1e-3, False, ratio, None, spread, (4,))

    assert form_from_leaves([e("a", 2.0, (2.0, 2.0)), e("b", 2.01, (2.0, 2.02))]).factor == pytest.approx(
        2.005
    )
    blurred = form_from_leaves([e("a", 2.0, (0.5, 3.5))])
    assert blurred.kind == "none" and "runs from 0.5 to 3.5" in blurred.sentence
    # constant factors that differ by leaf: every group listed, as fit_form lists them on arrays
    leaves = [
        e("a", 3.0, (3.0, 3.0)),
        e("b", 1.5, (1.5, 1.5)),
        e("c", 1.5, (1.5, 1.5)),
        e("d", 0.5, (0.5, 0.5)),
    ]
    grouped = form_from_leaves(leaves, update=False)
    assert grouped.kind == "per_group" and grouped.groups == ((0.5, ("d",)), (1.5, ("b", "c")), (3.0, ("a",)))
    assert "x0.5 on d (1 leaf); x1.5 on b, c (2 leaves); x3 on a (1 leaf)" in grouped.sentence
    # a constant 2 on an update: as fit_form says it (the localization then checks it against the counters)
    assert form_from_leaves([e("a", 2.0, (2.0, 2.0))]).kind == "extra_step"


def test_the_grouping_reads_the_placement_and_dtype_of_each_leaf():
    facts = {
        "a.kernel": LeafFacts((4, 4), "float32", ("model",)),
        "b.kernel": LeafFacts((4, 4), "float32", ("model",)),
        "c.kernel": LeafFacts((4, 4), "float32", ()),
        "d.kernel": LeafFacts((4, 4), "bfloat16", ()),
    }
    failing = {"a.kernel": (4, 4), "b.kernel": (4, 4)}
    matching = {"c.kernel": (4, 4), "d.kernel": (4, 4)}
    assert shared_property(failing, matching, facts) == (
        "every failing leaf is split over ('model',); every leaf that is replicated on every device matches"
    )
    # an optimizer-state path is read as the parameter it ends in
    assert shared_property({"0.mu.d.kernel": (4, 4)}, {"0.mu.c.kernel": (4, 4)}, facts) == (
        "every failing leaf is bfloat16; every leaf that is float32 matches"
    )


# ------------------------------------------------------------------------------------- nothing contradicted


def _record(kinds_failing: set[str], *, grads=True, rerun=None, replicas=False) -> StepRecord:
    leaves = []
    for kind, paths in (
        ("loss", ["loss"]),
        ("grad", ["a.kernel", "a.bias"]),
        ("param", ["a.kernel", "a.bias"]),
        ("opt_state", ["0.mu.a.kernel"]),
        ("counter", ["step"]),
    ):
        if kind == "grad" and not grads:
            continue
        for p in paths:
            ok = kind not in kinds_failing
            leaves.append(
                LeafError(
                    0,
                    kind,
                    p,
                    0.0 if ok else 1.0,
                    0.0,
                    1e-3 if kind != "counter" else 0.0,
                    ok,
                    None if ok else 2.0,
                    None,
                    None,
                    (4, 4),
                )
            )
    mism = ("param a.kernel",) if replicas else ()
    return StepRecord(
        0,
        1e-5,
        1e-6,
        1.0,
        1.0,
        tuple(leaves),
        1,
        1,
        replica_mismatches=mism,
        replica_axes=("data",) if replicas else (),
        optimizer_rerun=rerun,
    )


def test_no_sentence_the_records_contradict():
    rec = _record({"param"})
    only = Diagnosis("loss_only", "Only the loss matches: the pre-update loss agrees at step 0 ...")
    assert contradiction(only.message, [rec]) == "only the loss matches"  # gradients and state match
    assert consistent([only, Diagnosis("x", "The update differs.")], [rec]) == [
        Diagnosis("x", "The update differs.")
    ]
    assert contradiction(only.message, [_record({"grad", "param", "opt_state"})]) is None
    assert (
        contradiction("The exposed gradients differ (a, step 0) while the update matches", [rec]) is not None
    )


def test_a_stage_not_observed_is_never_claimed_to_match():
    loc = localize([_record({"param", "opt_state"}, grads=False)])
    assert loc.status("gradients") == "not observed" and loc.stage == "optimizer"
    assert loc.unobserved_before == ("gradients",) and "Not observed: the gradients" in loc.text()
    assert "the gradients match" not in loc.text()
    # nor cleared: without the candidate's gradients no equal inputs were seen (a new user's loss-only summed step
    # read "... not in the gradients" while the cause was a sum for a mean)
    assert "not in the gradients" not in loc.text()
    assert (
        "First difference at step 0: the optimizer state (the state the optimizer kept differs; the gradients"
        in (loc.text())
    )
    seen = localize([_record({"param", "opt_state"})])
    assert seen.stage == "optimizer" and "not in the gradients" in seen.text()


FAULTS = ("forward", "gradients", "replicas", "optimizer", "parameters", "counters")
KIND_OF = {
    "forward": "loss",
    "gradients": "grad",
    "optimizer": "opt_state",
    "parameters": "param",
    "counters": "counter",
}


@given(st.sets(st.sampled_from(FAULTS), min_size=1), st.booleans())
def test_the_stage_named_is_the_first_stage_whose_records_fail(planted, with_rerun):
    kinds = {KIND_OF[s] for s in planted if s in KIND_OF}
    rerun = None
    if with_rerun:  # the reference's optimizer rerun on the candidate's gradients: it fails where planted
        bad = "optimizer" in planted
        rerun = (LeafError(0, "param", "a.kernel", float(bad), 0.0, 1e-3, not bad, 2.0 if bad else None),)
    loc = localize([_record(kinds, rerun=rerun, replicas="replicas" in planted)])
    assert loc.stage == next(s for s in STAGES if s in planted)
    assert all(loc.status(s) != "differs" for s in STAGES[: STAGES.index(loc.stage)])
