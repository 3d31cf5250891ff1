"""Trial 26 (issue #36): a clip by each shard's own gradient norm scaled every gradient by 0.4962 on every element
("spread 0.4962..0.4962") and read "x1/2: the gradient was averaged twice", a factor 0.76% from 1/2 named
within :data:`RATIO_RTOL` (2%). A factor is named only where the failing gradients' own ratios reach it; on
hand-built records (no JAX), both ways.
"""

from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import diagnose

TOL = 1e-3
PATHS = ("a.kernel", "a.bias", "b.kernel", "b.bias")


def _record(ratio, spread):
    err = abs(ratio - 1)
    grads = [
        LeafError(0, kind, p, err, err, TOL, False, ratio, 1.0, spread, (4,))
        for kind in ("grad", "param")
        for p in PATHS
    ]
    loss = LeafError(0, "loss", "loss", 0.0, 0.0, TOL, True, shape=())
    counter = LeafError(0, "counter", "count", 0.0, 0.0, 0.0, True, shape=())
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, (loss, *grads, counter), 1, 1)


def test_a_factor_measured_apart_from_one_half_is_not_named_one_half():
    found = diagnose([_record(0.4962, (0.4962, 0.4962))], num_shards=2)
    codes = [d.code for d in found]
    text = " ".join(d.message for d in found)
    assert "averaged_twice" not in codes and "unreduced" not in codes, codes
    assert "x1/2" not in text and "0.4962" in text


def test_a_factor_of_one_half_within_its_rounding_is_named():
    found = diagnose([_record(0.5, (0.49998, 0.50003))], num_shards=2)
    assert found[0].code == "averaged_twice" and "x1/2" in found[0].message
    # a bfloat16-wide spread around 1/2 still reaches it
    found = diagnose([_record(0.4985, (0.494, 0.503))], num_shards=2)
    assert found[0].code == "averaged_twice"


def test_a_factor_the_size_of_a_model_axis_is_one_reading_of_several():
    """Trial 26: a loss x2 inside jax.grad only (the micro-batch count; the returned loss unscaled), on data=2 x
    model=2, read "the gradients were psum-ed over 'model' too" as a fact, and "not the loss's normalization"."""
    from shardcheck.parity.diagnosis.localization import gradients_after_loss
    from shardcheck.parity.diagnosis.rules import _close
    from shardcheck.parity.diagnosis.topology import model_axis_factor

    code, phrase = model_axis_factor(2.0, 2, {"data": 2, "model": 2}, _close)
    # trial 34: S = 2 = the size of 'model': the sum over the batch shards first, and the psum over 'model'
    # not said as a fact (a sequence-parallel step splits its tokens over 'model' and needs that psum)
    assert code == "summed" and phrase.startswith(
        "x2: a sum over the 2 batch shards for their mean; or, 2 being"
    )
    assert (
        "the gradients psum-ed over 'model' too, counted 2 times where every device along it holds" in phrase
    )
    assert "as sequence parallelism does, needs that psum for the leaves replicated over it" in phrase
    assert "a loss or gradient scaled by a count, such as the micro-batch count" in phrase
    code, phrase = model_axis_factor(4.0, 2, {"data": 2, "model": 4}, _close)  # S is 2: the model axis alone
    assert phrase.startswith(
        "x4: the size of mesh axis 'model', which splits the model, not the batch. Either"
    )
    assert "a sum over the 4 batch shards" not in phrase
    assert "of the loss the gradients were taken of but not of the one returned" in gradients_after_loss(2.0)


def test_a_term_scaled_on_the_leaves_it_alone_reaches_is_given_its_factor():
    """Trial 24: a PPO value loss taken as each shard's mean and summed over 4 shards: the value head's gradients
    are 4 x on every element, the trunk's by no one factor, the policy head's match; the form said only "one term
    of the loss differs (the group)"."""
    from shardcheck.parity.diagnosis.form import Form
    from shardcheck.parity.diagnosis.localization import forward_form

    def grad(path, ratio, spread, ok=False):
        err = 0.0 if ok else abs(ratio - 1)
        return LeafError(0, "grad", path, err, err, TOL, ok, ratio, None, spread, (4,))

    grads = [
        grad("value.kernel", 4.0, (4.0, 4.0)),
        grad("value.bias", 4.0, (4.0, 4.0)),
        grad("trunk.kernel", 1.7, (0.4, 3.1)),
        grad("policy.kernel", 1.0, (1.0, 1.0), ok=True),
    ]
    loss = LeafError(0, "loss", "loss", 2.46, 2.8, TOL, False, 3.819, None, None, ())
    form = forward_form(Form("factor", "a factor 3.819", 3.819, (3.819, 3.819)), [loss], grads)
    assert (
        "one term of the loss differs (the group); value.bias, value.kernel: 4 x the reference's on every "
        "element (spread 4..4)" in form.sentence
    )
    assert "trunk" not in form.sentence.split("(the group)")[1]
    # no leaf of one factor: the sentence as before
    plain = forward_form(Form("factor", "a factor 3.819", 3.819, (3.819, 3.819)), [loss], grads[2:])
    assert plain.sentence.endswith("one term of the loss differs (the group)")
