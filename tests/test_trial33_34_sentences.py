"""Trials 33 (SimCLR with all-gathered negatives) and 34 (a Megatron block with sequence parallelism, written in
``jax.shard_map`` on data=2 x model=2): sentences that were false for a step that splits its tokens over 'model',
or that named an axis of size 1 as splitting the model. Each checked on both sides, without JAX."""

from conftest import require_devices

from shardcheck.parity.diagnosis.rules import _close, _forward_hint, _name_factor
from shardcheck.parity.diagnosis.topology import model_axis_factor, replicated_reduced_message

SP_MESH = {"data": 2, "model": 2}


def test_x2_on_a_mesh_whose_model_axis_is_the_batch_shards_size_reads_the_batch_sum_first():
    """Trial 34: a mean over 'data' taken as a sum read first "psum-ed over 'model' too, though every device along
    it holds the same batch rows", false under sequence parallelism."""
    code, phrase = model_axis_factor(2.0, 2, SP_MESH, _close)
    assert code == "summed" and phrase.startswith("x2: a sum over the 2 batch shards for their mean; or,")
    assert "though every device along it holds the same batch rows" not in phrase
    assert "where every device along it holds the same batch rows" in phrase
    assert "as sequence parallelism does, needs that psum for the leaves replicated over it" in phrase


def test_x1_over_the_model_axis_size_names_a_pmean_where_a_psum_was_due():
    """Trial 34: a pmean over 'model' where a psum was due read only "averaged twice"; on a mesh without a model
    axis of that size the reading is not offered."""
    _, phrase = _name_factor(0.5, 2, SP_MESH)
    assert phrase.startswith(
        "the gradient was averaged twice (or divided by S=2 twice): x1/2; or, 2 being the size"
    )
    assert "a pmean over 'model' where a psum was due" in phrase
    for shape in ({"data": 2}, {"data": 2, "model": 4}, {"data": 2, "model": 1}):
        assert "pmean over 'model'" not in _name_factor(0.5, 2, shape)[1]


def test_a_leaf_reduced_over_model_once_too_often_is_not_told_to_drop_the_reduction():
    """Trial 34: an embedding's gradient psum-ed over 'model' twice read "drop that reduction: the batch is replicated
    over it" (a sequence-parallel step needs one) and "added before the psum" first; a bias keeps that reading
    first."""
    embed = replicated_reduced_message(
        0, ["param embed.embedding", "opt_state 0.mu.embed.embedding"], 19, 2, SP_MESH
    )
    assert "once too often. Either their gradient was psum-ed over 'model' twice" in embed
    assert "needs exactly one" in embed and "the batch is replicated over it (drop that reduction)" in embed
    assert "where the step splits no tokens over 'model'" in embed
    bias = replicated_reduced_message(0, ["param wo.bias", "opt_state 0.mu.wo.bias"], 19, 2, SP_MESH)
    assert (
        "once too often. Either a parameter added before the psum over 'model' counts once per shard" in bias
    )


def test_an_axis_of_size_one_splits_nothing_in_the_forward_hint():
    """Trial 33: on data=4,model=1 every forward-stage FAIL read "a replicated bias added on every shard before the
    psum over 'model' (it counts 1 times ...)"."""

    class Ctx:
        mesh_shape = {"data": 4, "model": 1}

    assert _forward_hint(Ctx) == "" and _forward_hint(Ctx, cleared=True) == ""
    Ctx.mesh_shape = {"data": 2, "model": 2}
    assert "(it counts 2 times; add it after the psum)" in _forward_hint(Ctx)


def test_the_localized_finding_groups_by_placement_as_the_localization_does():
    """Trial 34 (bfloat16, a pmean over 'model' where a psum was due): the localization's group said "every failing
    leaf is replicated on every device; every leaf that is split over ('model',) matches" and the finding beside
    it "the failing leaves (...) share no ndim, name or module that the matching ones lack". Given the leaves'
    facts, the finding says the placement too; without them it says what it can."""
    from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
    from shardcheck.parity.diagnosis.grouping import NO_PROPERTY, LeafFacts
    from shardcheck.parity.diagnosis.rules import diagnose

    shapes = {"embed.embedding": (8, 4), "ln.bias": (4,), "w1.kernel": (4, 8), "w1.bias": (8,)}
    bad = {"embed.embedding", "ln.bias"}
    ratio = {"embed.embedding": (0.3, 0.9), "ln.bias": (-0.2, 1.7)}
    leaves = [LeafError(0, "loss", "loss", 0.0, 0.0, 1e-3, True, shape=())]
    for p, shape in shapes.items():
        lo, hi = ratio.get(p, (1.0, 1.0))
        err = 0.1 if p in bad else 0.0
        for kind in ("grad", "param"):
            leaves.append(
                LeafError(0, kind, p, err, err, 1e-3, p not in bad, (lo + hi) / 2, 1.0, (lo, hi), shape)
            )
    record = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, tuple(leaves), 1, 1)
    facts = {p: LeafFacts(shape=s, axes=() if p in bad else ("model",)) for p, s in shapes.items()}
    plain = next(d.message for d in diagnose([record], 2, mesh_shape=SP_MESH) if d.code == "localized")
    assert NO_PROPERTY in plain
    placed = next(
        d.message for d in diagnose([record], 2, mesh_shape=SP_MESH, facts=facts) if d.code == "localized"
    )
    assert NO_PROPERTY not in placed and "replicated on every device" in placed


def test_the_summary_names_an_update_check_that_failed_before_any_leaf():
    """Trial 33: a norm scale decayed by the candidate's optimizer failed its update check at step 0 and its
    parameter at step 1; the summary named step 1's parameter beside a localization at step 0. The first failure
    is the summary's leaf, whichever kind; where a leaf fails first, that leaf."""
    from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
    from shardcheck.parity.report import ParityReport

    def leaf(step, kind, ok, err):
        return LeafError(step, kind, "norm.scale", err, err, 1e-3, ok, shape=(4,))

    step0 = StepRecord(
        0,
        1e-5,
        1e-7,
        1.0,
        1.0,
        (leaf(0, "param", True, 0.0),),
        1,
        1,
        optimizer_rerun=(leaf(0, "param", False, 0.01),),
    )
    step1 = StepRecord(1, 1e-5, 1e-7, 1.0, 1.0, (leaf(1, "param", False, 0.02),), 2, 2)
    report = ParityReport("candidate", False, (step0, step1), ())
    assert (report.first_worst.kind, report.first_worst.step) == ("update", 0)
    late = StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (leaf(0, "param", False, 0.03),), 1, 1)
    assert ParityReport("candidate", False, (late, step1), ()).first_worst == late.leaves[0]


def test_a_refusal_probed_in_float32_says_its_losses_are_float32s():
    """Trial 33: a bfloat16 model's refusal said "on the first batch the full-batch loss is 1.928493", the float32
    probe's loss (the bfloat16 model's is 1.927934); a float32 model's refusal is unchanged."""
    import pytest

    from shardcheck.parity.harness.row_coupling import Coupling, RowCouplingError, check_rows_separable

    coupling = Coupling(1.928493, 0.9012, None, 0.0, 0.0)
    with pytest.raises(
        RowCouplingError, match=r"the full-batch loss \(computed in float32, where the model's low"
    ):
        check_rows_separable("check_parity", "dp", coupling, 4, in_float32=True)
    with pytest.raises(
        RowCouplingError, match=r"on the first batch the full-batch loss is 1\.928493, and its 4"
    ):
        check_rows_separable("check_parity", "dp", coupling, 4)


def test_a_compute_dtype_flag_left_off_a_replay_of_a_model_that_computes_alike_is_no_other_run():
    """Trial 33: a bfloat16 model recorded with --compute-dtype bfloat16 and replayed without it read "it is another
    run, compared as if it were the same" beside "recorded bfloat16, replayed bfloat16"; where the runs computed in
    different dtypes the flag's change stays another run."""
    from shardcheck.parity.comparison.digest import SAME_ARITHMETIC, _settings_differ

    was = {"settings": {"compute_dtype": "bfloat16", "lr": 0.01}, "compute_dtype": "bfloat16"}
    same = _settings_differ(
        was, {"settings": {"compute_dtype": None, "lr": 0.01}, "compute_dtype": "bfloat16"}
    )
    assert same == [f"compute_dtype 'bfloat16' -> default (the model computes in bfloat16 {SAME_ARITHMETIC}"]
    other = _settings_differ(
        was, {"settings": {"compute_dtype": None, "lr": 0.02}, "compute_dtype": "float32"}
    )
    assert other == ["compute_dtype 'bfloat16' -> default", "lr 0.01 -> 0.02"]


@require_devices(4)
def test_a_shard_count_that_splits_over_no_mesh_axis_is_refused_before_any_step():
    """Trial 33 (and 32): num_shards=3 on a data=4 mesh was accepted silently, and the diagnosis read its factors
    as 3's. S must be a multiple of some axes' sizes together (the batch shards, times any micro-batches)."""
    import pytest

    from shardcheck import check_parity, make_mesh
    from shardcheck.parity.harness.setup import check_options

    mesh = make_mesh({"data": 2, "model": 2})
    with pytest.raises(
        ValueError, match=r"check_parity: num_shards=3 splits the batch over none of the mesh"
    ):
        check_parity("dp", None, mesh=mesh, num_shards=3)
    options = {"rtol": None, "atol": None, "accept_weak": False, "mesh": mesh}
    for ok in (2, 4, 6, 8):  # the batch shards, every device, and micro-batches on top
        assert check_options("check_parity", **options, num_shards=ok) == ok
