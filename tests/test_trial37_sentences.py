"""Trial 37 (a message-passing GNN on padded graphs, a mean-teacher EMA in an ``nnx.Variable`` of its own, a
``jax.shard_map`` step on data=4): diagnosis sentences that were false or contradicted the same report. Each
checked on both sides, on records built by hand or on a tiny model of the same shape.

1. a factor that is both S^2 and the batch's loss weight read "sum-reduced twice" as a fact;
2. non-parameter state whose copies differ read "have gradients within tolerance";
3. an EMA the step writes after its update read as written by the forward pass, with the forward pass's advice;
4. the Form and the ``state_amount`` finding quoted two maxima of different leaves (0.117 against 0.00793);
5. a PASS note listed 16 EMA leaves in full, ending "is written".
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.floating import state_notes
from shardcheck.parity.diagnosis.form import form_from_leaves
from shardcheck.parity.diagnosis.localization import localize
from shardcheck.parity.diagnosis.rules import diagnose
from shardcheck.parity.diagnosis.topology import downstream_note, missed_axes_message

PATHS = ("head1.bias", "head1.kernel", "head2.bias", "head2.kernel")
EMA_KEYS = [f"layers/{i}/{m}/{k}" for i in range(3) for m in ("msg", "self_") for k in ("bias", "kernel")] + [
    f"head{i}/{k}" for i in (1, 2) for k in ("bias", "kernel")
]


def _leaf(kind, path, ok, ratio=None, err=1.0, tol=1e-3, change=None, shape=(4, 4)):
    spread = None if ratio is None else (ratio, ratio)
    return LeafError(
        0, kind, path, 0.0 if ok else err, 0.0 if ok else err, tol, ok, ratio, change, spread, shape
    )


def _record(leaves, **kw):
    return StepRecord(0, 1e-5, 1e-7, 1.0, 1.0, tuple(leaves), 1, 1, **kw)


# ------------------------------------------------------------------------------------- 1. weight or S^2


def _scaled_record(factor: float, weight: float) -> StepRecord:
    """Every gradient (and the update) ``factor`` x the reference's, the loss matching, a ``(loss_sum, weight)``
    loss of total weight ``weight``."""
    leaves = [_leaf("loss", "loss", True, shape=())]
    for p in PATHS:
        leaves += [_leaf("grad", p, False, factor), _leaf("param", p, False, factor)]
        leaves.append(_leaf("opt_state", f"0.trace.{p}", False, factor))
    leaves.append(_leaf("counter", "step", True, shape=()))
    return _record(leaves, loss_weight=weight)


def _finding(records, s):
    return next(d for d in diagnose(records, s) if d.code in ("scaled", "summed"))


def test_a_factor_both_s_squared_and_the_loss_weight_says_both_readings_weight_first():
    """Trial 37: 16 rows on data=4, the psum of the loss sums never divided by the weight 16 = 4^2: the finding
    read "sum-reduced twice (x16 = 4^2)" (code summed) as a fact beside a Form that said the weight."""
    record = _scaled_record(16.0, 16.0)
    found = _finding([record], 4)
    assert found.code == "scaled"
    msg = found.message
    assert msg.startswith(
        "At step 0, gradients are 16 x the reference's: either 16 is this batch's total loss weight"
    )
    assert "; or the gradient was sum-reduced twice (x16 = 4^2; docs/reduction_cases.md C3)" in msg
    assert "this batch's weight 16 is that factor too, so the factor cannot tell them apart" in msg
    form = localize([record], num_shards=4).form.sentence
    assert (
        "either 16 is this batch's total loss weight" in form and "or the gradient sum-reduced twice" in form
    )
    # the other side: a true double sum-reduction (weight 12) keeps its sentence; on data=2 (x16 is not 2 or 4)
    # the weight alone is named
    double = _finding([_scaled_record(16.0, 12.0)], 4)
    assert double.code == "summed" and "the gradient was sum-reduced twice (x16 = 4^2" in double.message
    assert "either" not in double.message and "loss weight" not in double.message
    two = _finding([record], 2)
    assert two.code == "scaled" and "16 is this batch's total loss weight" in two.message
    assert "either" not in two.message and "sum-reduced" not in two.message
    assert "either" not in localize([record], num_shards=2).form.sentence


def test_a_step_of_another_weight_run_from_the_reference_state_tells_the_readings_apart():
    """Where a later step run from the reference's state weighs 10 and shows x10, the weight is the cause: only
    its reading is said; where it shows x16 again, the shard count's is."""
    first = _scaled_record(16.0, 16.0)
    by_weight = dataclasses.replace(_scaled_record(10.0, 10.0), step=1, synchronized=True)
    found = _finding([first, by_weight], 4)
    assert found.code == "scaled" and "either" not in found.message
    assert "at step 1 (run from the reference's state, its batch's weight 10) they are 10 x" in found.message
    by_shards = dataclasses.replace(_scaled_record(16.0, 10.0), step=1, synchronized=True)
    found = _finding([first, by_shards], 4)
    assert found.code == "summed" and "either" not in found.message


@require_devices(4)
def test_the_unnormalized_psum_on_data_4_says_both_readings_live():
    """The trial's fault on a tiny model: per-shard loss sums' gradients psum-ed over 'data', never divided by
    the total weight 16; the correct step passes."""
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 4)).astype(np.float32), "y": rng.normal(size=(16,)).astype(np.float32)}
        for _ in range(2)
    ]

    def loss_fn(model, batch):
        return jnp.sum((model(batch["x"])[:, 0] - batch["y"]) ** 2), jnp.float32(batch["y"].shape[0])

    task = shardcheck.Task(
        model=lambda: nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
        optimizer=optax.sgd(0.05),
        loss_fn=loss_fn,
        batches=batches,
    )

    def make(divide: bool):
        def step(model, optimizer, batch, mesh):
            graphdef, state = nnx.split((model, optimizer))

            def body(state, batch):
                m, o = nnx.merge(graphdef, state)
                (s, w), g = nnx.value_and_grad(loss_fn, has_aux=True)(m, batch)
                w = jax.lax.psum(w, "data")
                g = jax.tree.map(lambda x: jax.lax.psum(x, "data") / (w if divide else 1.0), g)
                o.update(m, g)
                return jax.lax.psum(s, "data") / w, g, nnx.state((m, o))

            specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
            loss, grads, state = jax.jit(jax.shard_map(body, **specs))(state, batch)
            nnx.update((model, optimizer), state)
            return {"loss": loss, "grads": grads}

        return step

    mesh = make_mesh({"data": 4})
    assert check_parity(make(True), task, mesh=mesh).ok
    report = check_parity(make(False), task, mesh=mesh)
    assert not report.ok and report.codes[0] == "scaled"
    msg = report.diagnoses[0].message
    assert (
        "either 16 is this batch's total loss weight" in msg
        and "or the gradient was sum-reduced twice" in msg
    )
    assert "either 16 is this batch's total loss weight" in report.localization.form.sentence


# ------------------------------------------------------------------------------ 2. state without gradients


def _replica_record(extra_graded: bool) -> StepRecord:
    """The head's 4 gradients left unreduced: their parameters and momenta differ across devices, and so do
    the 4 EMA copies of them (non-parameter state, no gradient); ``extra_graded``: a parameter whose gradient
    is within tolerance differs too."""
    leaves = [_leaf("loss", "loss", True, shape=())]
    leaves += [_leaf("grad", p, False, 1.3) for p in PATHS] + [_leaf("grad", "layers.0.kernel", True)]
    names = [f"param {p}" for p in PATHS] + [f"opt_state 0.trace.{p}" for p in PATHS]
    names += [f"state model.ema.{p.replace('.', '/')}" for p in PATHS]
    if extra_graded:
        names.append("param layers.0.kernel")
    return _record(leaves, replica_mismatches=tuple(names), replica_axes=("data",))


def test_state_whose_copies_differ_is_said_as_model_state_never_as_gradients_within_tolerance():
    """Trial 37 (FAULT=head_nopsum): "the other 4 have gradients within tolerance" named the EMA's copies, which
    have no gradient."""
    note = downstream_note(_replica_record(False))
    assert note.startswith(
        "8 of them are the values and optimizer state of the 4 parameters whose gradients differ;"
    )
    assert "the other 4 are non-parameter model state (state model.ema.head1/bias, " in note
    assert (
        "no gradient of their own): written in the step from the copies that differ downstream of those"
        in note
    )
    assert "within tolerance" not in note
    # the other side: a parameter whose own gradient is within tolerance keeps that reading, counted apart
    mixed = downstream_note(_replica_record(True))
    assert "of the other 5, 1 has a gradient within tolerance: its copies differ downstream of those" in mixed
    assert "; 4 are non-parameter model state (" in mixed
    # the wrong-axis message splits them the same way
    msg = missed_axes_message(
        0, list(_replica_record(True).replica_mismatches), ["data"], {"data": 4}, False, PATHS
    )
    assert "4 leaves whose copies differ are non-parameter model state (" in msg
    assert "The 1 leaf whose copies differ has gradients within tolerance" in msg
    only_state = missed_axes_message(
        0, list(_replica_record(False).replica_mismatches), ["data"], {"data": 4}, False, PATHS
    )
    assert "within tolerance" not in only_state and "non-parameter model state" in only_state


# ------------------------------------------------------------------------- 3. state the step writes itself


def _dropped_record(forward_writes):
    leaves = [_leaf("loss", "loss", True, shape=()), _leaf("grad", "w", True), _leaf("param", "w", True)]
    leaves += [
        _leaf("state", f"model.ema.{k}", False, 0.0, err=0.006, tol=0.0, change=0.006) for k in ("0", "1")
    ]
    leaves.append(_leaf("counter", "step", True, shape=()))
    return _record(leaves, forward_writes=forward_writes)


def test_state_the_loss_does_not_write_is_the_steps_and_gets_no_forward_pass_advice():
    """Trial 37 (FAULT=ema_before, reference=ref_step): "First difference ...: the forward pass (loss) (the
    forward pass writes the model's state another way ...)" and "jax.grad of a function of nnx.split parts
    discards the forward pass's writes", for an EMA the forward pass never writes."""
    step_written = _dropped_record(frozenset())
    where = localize([step_written])
    assert where.stage == "parameters"
    text = where.text()
    assert text.startswith(
        "First difference at step 0: the applied parameters (the step writes the model's state model.ema.* (2 "
        "leaves) another way (the task's loss does not write it: the step does, after the forward pass); the "
        "loss, gradients and parameters match)."
    )
    assert (
        "the step's own write of them (its forward pass writes none) was dropped, or wrote the values" in text
    )
    said = next(d.message for d in diagnose([step_written], 4) if d.code == "model_state")
    assert "after its forward pass: the task's loss does not write it) exactly as it was at step 0" in said
    assert "jax.grad" not in said and "jax.grad" not in text
    # the other side: state the forward pass writes (or where that is not known) stays the forward pass's
    for written in (frozenset({"model.ema.0", "model.ema.1"}), None):
        forward = _dropped_record(written)
        assert localize([forward]).stage == "forward"
        said = next(d.message for d in diagnose([forward], 4) if d.code == "model_state")
        assert "jax.grad of a function of nnx.split parts discards the forward pass's writes" in said


class EMA(nnx.Variable):
    """A mean-teacher copy of a parameter, written by the step after its update."""


class Net(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.ema = nnx.List([EMA(jnp.array(p)) for p in jax.tree.leaves(nnx.state(self, nnx.Param))])

    def __call__(self, x):
        return self.lin(x)


def _ema_step(before: bool, decay: float = 0.5, swapped: bool = False):
    """A GSPMD step updating the EMA at ``decay`` after the optimizer's update (``before``: before it, from the
    parameters it still equals at step 0; ``swapped``: d and 1 - d swapped)."""

    def update_ema(model):
        for e, p in zip(model.ema, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
            e[...] = (1 - decay) * e[...] + decay * p if swapped else decay * e[...] + (1 - decay) * p

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_mse)(model, batch)
        if before:
            update_ema(model)
        optimizer.update(model, grads)
        if not before:
            update_ema(model)
        return loss, grads

    def step(model, optimizer, batch, mesh=None):
        if mesh is not None:
            state = nnx.state((model, optimizer))
            nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        loss, grads = train(model, optimizer, batch)
        return {"loss": loss, "grads": grads}

    return step


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _ema_task():
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(model=Net, optimizer=optax.sgd(0.1), loss_fn=_mse, batches=batches)


@require_devices(2)
def test_an_ema_updated_before_the_optimizer_is_localized_at_the_step_not_the_forward_pass():
    """The trial's ema_before on a tiny model, against a reference step that writes the EMA after its update:
    the forward pass writes no EMA, so the step is named, without the forward pass's advice; the correct step
    passes."""
    task, mesh = _ema_task(), make_mesh({"data": 2})
    reference = _ema_step(before=False)
    assert check_parity(_ema_step(before=False), task, mesh=mesh, reference=reference).ok
    report = check_parity(_ema_step(before=True), task, mesh=mesh, reference=reference)
    assert not report.ok and report.localization.stage == "parameters"
    text = report.localization.text()
    assert "the step writes the model's state model.ema.* (2 leaves) another way" in text
    assert "the forward pass writes the model's state another way" not in text
    said = " ".join(d.message for d in report.diagnoses)
    assert (
        "jax.grad" not in said
        and "the step's own write of it was dropped, or wrote the value it held" in said
    )


# ------------------------------------------------------------------------------ 4. the two changes differ


def test_the_form_and_the_finding_quote_one_leafs_numbers():
    """Trial 37 (FAULT=ema_swapped): the Form said "differ by up to 0.117, more than 0.5 of the reference's
    largest change" (ema.head2/kernel's difference, a bound of no leaf) and the finding "differ by up to
    0.00793, more than 0.000496" (ema.layers/0/msg/kernel's, the worst over its tolerance)."""
    changes = {"head2/kernel": (0.1172, 0.014644), "layers/0/msg/kernel": (0.007934, 0.000992)}
    bad = [
        _leaf("state", f"model.ema.{k}", False, 9.0, err=err, tol=0.5 * chg, change=chg)
        for k, (err, chg) in changes.items()
    ]
    form = form_from_leaves(bad, update=True).sentence
    record = _record([_leaf("loss", "loss", True, shape=()), *bad])
    finding = next(d.message for d in diagnose([record], 4) if d.code == "state_amount")
    said = (
        "the two changes differ by up to 0.117 (ema.head2/kernel: the reference's step changed it by up to "
        "0.0146, the candidate's by up to 0.132), more than half of the reference's largest change in each of "
        "these 2 leaves"
    )
    assert said in form and said in finding
    assert "0.00793" not in finding and "0.000496" not in finding
    one = form_from_leaves(bad[1:], update=True).sentence
    assert (
        "differ by up to 0.00793 (ema.layers/0/msg/kernel: the reference's step changed it by up to 0.000992"
        in one
    )
    assert "more than half of the reference's largest change there" in one


@require_devices(2)
def test_a_swapped_decay_fails_with_one_leafs_numbers_in_both_sentences():
    task, mesh = _ema_task(), make_mesh({"data": 2})
    reference = _ema_step(before=False, decay=0.9)
    report = check_parity(
        _ema_step(before=False, decay=0.9, swapped=True), task, mesh=mesh, reference=reference
    )
    assert not report.ok and report.codes[0] == "state_amount"
    form = report.localization.form.sentence
    said = form[form.index("the two changes differ") : form.index(", which no rounding makes")]
    assert said in report.diagnoses[0].message
    assert "(its largest change 9 times the reference's)" in report.diagnoses[0].message
    assert "d and 1 - d swapped" in report.diagnoses[0].message


# ------------------------------------------------------------------------------------- 5. the PASS note


def test_a_pass_note_names_many_ema_leaves_in_short_and_agrees_in_number():
    """Trial 37: a PASS listed 16 EMA leaves (``model.ema.layers/0/msg/kernel`` ...) one by one, ending "is
    written"; docs/parity.md promises "model.ema.* (11 leaves) is written"."""
    leaves = [
        LeafError(0, "state", f"model.ema.{k}", 0.1, 1.0, float("inf"), True, None, 0.0, None, (4,))
        for k in EMA_KEYS
    ]
    note = state_notes([_record(leaves)])
    assert note.startswith(
        "The model's state model.ema.* (16 leaves) is written by the candidate's step only and not read by the loss"
    )
    # a few families keep their own names; several families take "are"
    few = [dataclasses.replace(leaves[0], path=p) for p in ("model.bn.mean", "model.ema.0", "model.ema.1")]
    note = state_notes([_record(few)])
    assert note.startswith("The model's state model.bn.mean, state model.ema.* (2 leaves) are written by")
    one = state_notes([_record(few[:1])])
    assert one.startswith("The model's state model.bn.mean is written by")
