"""Sentences new users' trials found false or missing (issue #36), each tested both ways on hand-built records
(no JAX): a CNN with SGD + Nesterov (trial 8) and a tensor-parallel VAE on a data=2 x model=2 mesh (trial 9).

- Nesterov off in the candidate only: every update is 0.5263 x the reference's from equal gradients. The Form
  offered "a loss scale" (the gradients matched, so no loss scale can be the cause) and did not say that
  0.5263 = 1/(1 + 0.9), a first Nesterov step's signature.
- An inverted weight-decay mask: the optimizer state differs while the gradients match, and the text said "the
  optimizer was given other gradients for these leaves".
- A LayerNorm gradient psum-ed over 'data' where the rest are averaged (x2 on a mesh whose 'data' and 'model'
  axes both have 2 devices): the text offered 'model' only.
"""

import dataclasses

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.rules import localized
from shardcheck.parity.diagnosis.topology import replicated_reduced_message

TOL = 1e-3
PATHS = ("conv1.kernel", "conv2.kernel", "n0.scale", "n0.bias")


def _leaf(kind, path, ratio=None):
    """A matching leaf, or one off by the constant factor ``ratio`` on a reference change of size 1."""
    if ratio is None:
        return LeafError(0, kind, path, 0.0, 0.0, TOL, True, shape=(4,))
    err = abs(ratio - 1)
    return LeafError(0, kind, path, err, err, TOL, False, ratio, 1.0, (ratio, ratio), (4,))


def _record(leaves, rerun=None):
    counters = (LeafError(0, "counter", "1.count", 0.0, 0.0, 0.0, True, shape=()),)
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (*leaves, *counters), 1, 1, optimizer_rerun=rerun)


def _update_factor(ratio):
    params = [_leaf("param", p, ratio) for p in PATHS]
    leaves = [_leaf("loss", "loss"), *(_leaf("grad", p) for p in PATHS), *params]
    return localize([_record(leaves, rerun=params)])


def test_a_first_nesterov_step_is_named_and_no_loss_scale_is_offered_where_the_gradients_match():
    loc = _update_factor(1 / 1.9)
    assert loc.stage == "optimizer" and loc.form.kind == "factor"
    assert "one scale of the whole update from equal gradients (a learning rate or its schedule; or, as " in (
        loc.form.sentence
    )
    assert "0.5263 = 1/(1 + 0.9), Nesterov momentum 0.9 on one side only" in loc.form.sentence
    assert "loss scale" not in loc.form.sentence


def test_a_factor_2_or_one_half_is_no_nesterov_signature():
    for ratio in (2.0, 0.5, 4.0):
        loc = _update_factor(ratio)
        assert "Nesterov" not in loc.form.sentence, ratio


def test_optimizer_state_that_differs_beside_matching_gradients_is_not_said_to_have_other_gradients():
    state = [_leaf("opt_state", f"1.0.trace.{p}", 1.5 if "kernel" in p else None) for p in PATHS]
    leaves = [_leaf("loss", "loss"), *(_leaf("grad", p) for p in PATHS), *(_leaf("param", p) for p in PATHS)]

    class Ctx:  # the fields `localized` reads
        first = _record([*leaves, *state])
        records = (first,)
        unexplained = True
        drifted = False
        facts = None
        mesh_shape = None

    found = localized(Ctx)
    assert found is not None
    assert "the optimizer updated its state differently from equal gradients" in found.message
    assert "given other gradients" not in found.message


def test_a_doubled_gradient_names_the_batch_axis_of_the_same_size_too():
    both = replicated_reduced_message(0, ["decoder.ln.scale"], 15, 2, {"data": 2, "model": 2})
    assert "x2 is the size of mesh axis 'model'" in both
    assert (
        "Or, as x2 is also the size of the batch axis 'data': these gradients were summed over 'data'" in both
    )
    other = replicated_reduced_message(0, ["decoder.ln.scale"], 15, 2, {"data": 4, "model": 2})
    assert "batch axis" not in other


def test_the_replicas_example_is_a_leaf_whose_own_gradient_differs():
    """Trial 9: a LayerNorm gradient left unreduced over 'data' under a global-norm clip: every leaf's copies
    differ (the clip spreads it), and the example was decoder.fc1.bias, whose gradient was reduced."""
    from shardcheck.parity.diagnosis.rules import replicas_differ

    grads = [_leaf("grad", "decoder.fc1.bias"), _leaf("grad", "decoder.ln.scale", 1.5)]

    class Ctx:
        records = (
            StepRecord(
                0,
                1e-5,
                1e-7,
                1.0,
                1.0,
                (_leaf("loss", "loss"), *grads),
                1,
                1,
                replica_mismatches=("param decoder.fc1.bias", "param decoder.ln.scale"),
            ),
        )

    found = replicas_differ(Ctx)
    assert found.message.startswith("Replicas differ across devices: param decoder.ln.scale holds")
    Ctx.records = (dataclasses.replace(Ctx.records[0], leaves=(_leaf("loss", "loss"), _leaf("grad", "x"))),)
    assert replicas_differ(Ctx).message.startswith(
        "Replicas differ across devices: param decoder.fc1.bias holds"
    )


def test_the_tensor_parallel_examples_are_conditional_where_every_module_matched():
    """Trial 9: beta applied twice in a GSPMD step: every module's output matched, the loss's difference reached
    encoder.* only, and the report still offered a row-parallel output not psum-ed as an example."""
    from shardcheck.parity.diagnosis.rules import _forward_hint

    class Ctx:
        mesh_shape = {"data": 2, "model": 2}

    plain = _forward_hint(Ctx)
    # not probed (a replay): one possible cause, said as one (trial 27: a z-loss coefficient doubled read "says
    # the sharded forward pass computes another function" as a fact)
    assert plain.startswith(
        " On a mesh that splits the model over ('model',), a loss that differs may also come from the sharded "
        "forward pass computing another function, e.g."
    )
    cleared = _forward_hint(Ctx, cleared=True)
    assert cleared.startswith(
        " If the step runs the model in a jax.shard_map of its own (which the module probe does not see into), a "
        "loss that differs"
    )
    Ctx.mesh_shape = {"data": 4}
    assert _forward_hint(Ctx, cleared=True) == ""


def test_a_factor_at_one_shard_is_no_sum_over_shards():
    """An lr x4 with matching gradients at num_shards=1 read "sum-reduced twice (x4 = 2^2)": with one shard no
    sum over shards exists; with S unknown or S=2 the reading stays."""
    from shardcheck.parity.diagnosis.rules import _name_factor

    assert _name_factor(4.0, 1) is None
    assert _name_factor(4.0, 2)[1].startswith("the gradient was sum-reduced twice (x4 = 2^2")
    assert _name_factor(4.0, None)[0] == "summed"


def test_a_square_of_s_also_reads_as_a_micro_batch_count_of_the_steps_own():
    """Trial 59: 4 micro-batches summed on data=2 (no reduction in the step) read "sum-reduced twice (x4 = 2^2)"
    alone, and divided by 4 twice "divided by S=2 three times"; both readings are said now, S^2's first."""
    from shardcheck.parity.diagnosis.rules import _name_factor

    code, said = _name_factor(4.0, 2)
    assert code == "summed" and said == (
        "the gradient was sum-reduced twice (x4 = 2^2; docs/reduction_cases.md C3), or scaled by a count of 4 of "
        "the step's own, such as 4 micro-batches summed where their mean was meant"
    )
    code, said = _name_factor(0.25, 2)
    assert code == "averaged_twice" and said == (
        "the gradient was divided by S=2 three times (x1/4), or divided once too often by a count of 4 of the "
        "step's own, such as 4 micro-batches (their sum divided by the micro-batch count twice)"
    )
    assert "micro-batch" not in _name_factor(2.0, 2)[1]  # x S: a sum over the shards


def test_a_ratio_around_one_names_a_small_term_too():
    """Trial 11: a weight decay of 1e-2 left out (about 1.3 tolerances) read only as values rounded another way."""
    from shardcheck.parity.diagnosis.form import _around_one

    form = _around_one(1.0, (0.99, 1.01), 2, "10th-90th percentile")
    assert form.kind == "none" and "a small term added or left out, such as a weight decay" in form.sentence


def test_a_step_naming_an_axis_the_mesh_lacks_is_told_the_fix():
    """Trial 11: --mesh batch=4 for a step whose PartitionSpec names 'data' read "... fix the step"."""
    from shardcheck import make_mesh
    from shardcheck.parity.harness.candidates import _mesh_axis_hint

    err = ValueError("Resource axis: data of P('data',) is not found in mesh: ('batch',).")
    hint = _mesh_axis_hint(err, make_mesh({"batch": 2}))
    assert hint.startswith(
        "the step names mesh axis 'data', and the mesh has ('batch',): give the mesh that axis"
    )
    assert "--mesh data=2" in hint
    assert _mesh_axis_hint(ValueError("another error"), make_mesh({"batch": 2})) == ""


def test_a_shard_map_spec_naming_an_axis_the_mesh_lacks_is_told_the_fix():
    """Trial 13: jax.shard_map's own wording ("in_specs argument must refer to an axis marked as manual ...
    in_specs[1] refers to 'data'") got no hint; an axis the mesh has is never blamed."""
    from shardcheck import make_mesh
    from shardcheck.parity.harness.candidates import _mesh_axis_hint

    err = ValueError(
        "shard_map in_specs argument must refer to an axis marked as manual (frozenset({'batch'})), but:\n\n"
        "  in_specs[1] refers to 'data'\n\nCheck the in_specs values passed to shard_map."
    )
    hint = _mesh_axis_hint(err, make_mesh({"batch": 2}))
    assert (
        hint.startswith("the step names mesh axis 'data', and the mesh has ('batch',)")
        and "--mesh data=2" in hint
    )
    assert _mesh_axis_hint(err, make_mesh({"data": 2})) == ""
