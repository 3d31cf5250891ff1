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


def test_a_factor_far_from_one_names_a_loss_scale():
    """Trial 29: gradients unscaled after the clip (x0.0002252) read only as a count's mistake."""
    from shardcheck.parity.diagnosis.rules import _loss_scale_reading

    said = " ".join(d.message for d in diagnose([_record(0.0002252)], 4, mesh_shape={"data": 4}))
    assert "a factor this far from 1 (1/4440) is more like a mixed-precision loss scale" in said
    assert "(4096 = 2^12)" in _loss_scale_reading(4096.0)
    assert _loss_scale_reading(3.0) == "" and _loss_scale_reading(1 / 200) == ""
