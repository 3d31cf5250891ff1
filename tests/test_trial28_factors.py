"""Trial 28 (issue #36): a scan-over-layers LM whose step divides its accumulated gradient by its 2 micro-batches
twice: on data=1,fsdp=4 the returned gradients x1/2 read ``clip_norm`` ("where the gradients are clipped by a
global norm ...", its optimizer clipping nothing); on data=2,fsdp=2 "averaged over 'data' or 'fsdp' once too
often", the micro-batch count unsaid. On hand-built records (no JAX), both ways.
"""

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import diagnose

TOL = 1e-3


def _record(ratio):
    err = abs(ratio - 1)
    leaves = [
        LeafError(0, kind, p, err, err, TOL, False, ratio, 1.0, (ratio, ratio), (4,))
        for kind in ("grad", "param")
        for p in ("a.kernel", "a.bias", "b.kernel")
    ]
    loss = LeafError(0, "loss", "loss", 0.0, 0.0, TOL, True, shape=())
    counter = LeafError(0, "counter", "count", 0.0, 0.0, 0.0, True, shape=())
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (loss, *leaves, counter), 1, 1)


def test_returned_gradients_at_one_half_read_a_count_twice_before_a_clip():
    found = diagnose([_record(0.5)], 4, mesh_shape={"data": 1, "fsdp": 4})
    assert found[0].code == "averaged_twice", [d.code for d in found]
    message = found[0].message
    assert (
        "x1/2: a gradient divided by 2 once too often (a micro-batch or shard count applied twice)" in message
    )
    assert message.index("divided by 2 once too often") < message.index("clips the gradients it returns")


def test_one_half_the_size_of_a_mesh_axis_also_reads_a_count_of_the_steps_own():
    found = diagnose([_record(0.5)], 4, mesh_shape={"data": 2, "fsdp": 2})
    assert found[0].code == "averaged_twice"
    assert (
        "or divided twice by another count of 2 of the step's own (a micro-batch count)" in found[0].message
    )


def test_a_counter_advanced_twice_beside_matching_updates_is_no_extra_step():
    """Trials 28 and 29: a schedule's count stepped per micro-batch (or once more a step) read "the update is 2 x
    the reference's, as 2 optimizer steps instead of one produce" beside matching parameters and moments."""
    from shardcheck.parity.diagnosis.localization import localize

    ok = [
        LeafError(0, kind, p, 0.0, 0.0, TOL, True, None, 1.0 if kind == "param" else None, None, (4,))
        for kind in ("grad", "param", "opt_state")
        for p in ("a.kernel", "a.bias")
    ]
    loss = LeafError(0, "loss", "loss", 0.0, 0.0, TOL, True, shape=())
    count = LeafError(0, "counter", "inner_state.count", 1.0, 1.0, 0.0, False, 2.0, None, None, ())
    where = localize([StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (loss, *ok, count), 1, 1)])
    assert where.stage == "counters"
    assert where.form.sentence.startswith(
        "a factor 2 on the counters (inner_state.count) alone: every parameter and optimizer-state leaf matches, "
        "so one update was applied while the counter advanced 2 times"
    )
    assert "optimizer steps instead of one" not in where.text()


def test_one_slice_of_a_stacked_leaf_is_named():
    """Trial 28: layer 2 of a 3-layer nnx.scan stack frozen read "no simple form: ... ratio runs from -0 to 1"."""
    import numpy as np

    from shardcheck.parity.diagnosis.form import fit_form

    rng = np.random.default_rng(0)
    before = {"blocks.up.kernel": rng.normal(size=(3, 4, 5)), "blocks.up.bias": rng.normal(size=(3, 5))}
    ref = {p: b - 1e-3 * np.sign(rng.normal(size=b.shape)) for p, b in before.items()}
    frozen = {p: np.concatenate([r[:2], before[p][2:]]) for p, r in ref.items()}
    form = fit_form(before, ref, frozen)
    assert form.kind == "slices" and form.sentence.startswith(
        "only slice 2 of the leading axis (size 3: layers stacked by nnx.scan or nnx.vmap) differs on all 2 "
        "failing leaves; every other slice matches: the candidate's update there is exactly 0 (frozen"
    )
    # every slice off alike: no slice is singled out; one matrix's rows are no layers (a partial write)
    spread = {p: before[p] + 0.5 * (r - before[p]) + 1e-4 * rng.normal(size=r.shape) for p, r in ref.items()}
    assert fit_form(before, ref, spread).kind != "slices"
    one = {"blocks.up.kernel": before["blocks.up.kernel"]}
    assert fit_form(one, {k: ref[k] for k in one}, {k: frozen[k] for k in one}).kind == "partial"


def test_one_shards_block_of_stacked_experts_scaled_is_named_with_its_factor():
    """Trial 59: model rank 1's experts (slices 2, 3 of 4, split over 'model') with their gradients x2 read
    "only slices 2, 3 ... layers stacked by nnx.scan ... the candidate's gradient there differs"; the block one
    shard holds and the factor are said. Slices that are no aligned block name no shard."""
    import numpy as np

    from shardcheck.parity.diagnosis.form import fit_form

    rng = np.random.default_rng(0)
    before = {"moe.w_in": rng.normal(size=(4, 3, 5)), "moe.b_in": rng.normal(size=(4, 5))}
    ref = {p: b - 1e-3 * rng.normal(size=b.shape) for p, b in before.items()}

    def scaled(rows):
        return {
            p: np.concatenate([(r - before[p])[i : i + 1] * (2.0 if i in rows else 1.0) for i in range(4)])
            + before[p]
            for p, r in ref.items()
        }

    form = fit_form(before, ref, scaled({2, 3}))
    assert form.kind == "slices" and form.sentence == (
        "only slices 2, 3 of the leading axis (size 4: layers stacked by nnx.scan or nnx.vmap) differ on all 2 "
        "failing leaves (the block shard 1 of 2 holds where this axis is split 2 ways over a mesh axis, as experts "
        "over 'model' are: that device's slices); every other slice matches: the candidate's update there is 2 x "
        "the reference's"
    )
    odd = fit_form(before, ref, scaled({1, 2}))  # not an aligned block
    assert (
        odd.kind == "slices"
        and "shard" not in odd.sentence
        and odd.sentence.endswith("is 2 x the reference's")
    )


def test_a_factor_far_from_one_names_a_loss_scale():
    """Trial 29: gradients unscaled after the clip (x0.0002252) read only as a count's mistake."""
    from shardcheck.parity.diagnosis.rules import _loss_scale_reading

    said = " ".join(d.message for d in diagnose([_record(0.0002252)], 4, mesh_shape={"data": 4}))
    assert "a factor this far from 1 (1/4440) is more like a mixed-precision loss scale" in said
    assert "(4096 = 2^12)" in _loss_scale_reading(4096.0)
    assert _loss_scale_reading(3.0) == "" and _loss_scale_reading(1 / 200) == ""


def _edited_record(state_ok: bool, rerun: bool = True):
    """Step 0 of a step that reverses its stacked layers in place before its forward pass (trial 28's
    swap_layers): the loss and every gradient differ; the reference's optimizer rerun on the candidate's own
    gradients and pre-step state gives its optimizer state but not the two kernels it reversed."""
    loss = LeafError(0, "loss", "loss", 0.05, 0.05, TOL, False, 1.05, None, None, ())
    grads = [
        LeafError(0, "grad", p, 0.3, 1.0, TOL, False, 0.8, None, (-0.5, 2.0), (3, 4)) for p in ("a", "b")
    ]
    params = [
        LeafError(0, "param", p, 0.4, 1.0, TOL, False, 0.8, 1.0, (-0.5, 2.0), (3, 4)) for p in ("a", "b")
    ]
    state = [
        LeafError(0, "opt_state", f"mu.{p}", 0.3, 1.0, TOL, False, None, None, None, (3, 4)) for p in "ab"
    ]
    redo = [
        LeafError(0, "param", "a", 0.4, 1.0, TOL, False, None, 1.0, None, (3, 4)),
        LeafError(0, "param", "b", 0.0, 0.0, TOL, True, None, 1.0, None, (3, 4)),
        *(
            LeafError(0, "opt_state", f"mu.{p}", 0.0 if state_ok else 0.3, 1.0, TOL, state_ok, shape=(3, 4))
            for p in "ab"
        ),
    ]
    return StepRecord(
        0,
        1e-5,
        1e-7,
        1.0,
        1.05,
        (loss, *grads, *params, *state),
        1,
        1,
        optimizer_rerun=tuple(redo) if rerun else None,
    )


def test_parameters_the_step_wrote_itself_are_named_from_the_optimizer_rerun():
    """Trial 28: a step that reversed its nnx.scan stack in place read only "computed another way (the loss's
    terms, labels, weights or normalization)"; the rerun's evidence (its optimizer state right, one parameter
    not) says the step wrote that parameter itself. Without that evidence the sentence is not said."""
    text = " ".join(d.message for d in diagnose([_edited_record(True)], 2))
    assert (
        "the step changed 1 of 2 parameters itself (a): the reference's optimizer rerun on the candidate's own "
        "gradients and pre-step state gives its optimizer state (2 leaves match) but not these parameters "
        "(worst a: max abs err 0.4 > tolerance 0.001), so its loss and gradients were taken at other parameters"
    ) in text
    for record in (_edited_record(False), _edited_record(True, rerun=False)):
        assert "parameters itself" not in " ".join(d.message for d in diagnose([record], 2))
