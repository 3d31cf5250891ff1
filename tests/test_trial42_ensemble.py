"""Trial 42 (issue #36): a deep ensemble stacked with ``nnx.split_rngs`` + ``nnx.vmap`` (annotated over 'model'),
Dropout in each member, checked by the user's ``jax.shard_map`` steps.

- A stacked Dropout stream holds one RNG count per member (shape ``(E,)``): every live check that reached the
  comparison stopped on ``int()`` of it ("Only scalar arrays can be converted to Python scalars"). The counts are
  compared elementwise; a correct step at a nonzero rate FAILs (each shard draws with the same key), the report
  leading with the draws and how to check the rest of the step, the row-coupling reading after it; the built-in
  gspmd PASSes.
- Every error of a step on a data-only mesh read "leaf 'members.head.kernel' is annotated P('model', None, None)
  but the mesh has no axis 'model'" first, also where the step never placed anything by the annotations: that
  hint is said only beside an error about it.
- A replay of a model whose initial parameters differ from the recording's led with "First difference at step 0:
  the forward pass ... at equal parameters": the initial state leads.
- A model factory that raised printed only Flax's message: the factory is named, where it is defined, and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.comparison.rng_counts import _count_error, rng_count_leaves
from shardcheck.parity.harness.candidates import _annotation_cause, _traced_hint, _varying_hint
from shardcheck.parity.report import CandidateError

E, DIN, DMID, DOUT, B = 2, 8, 16, 4, 8
STREAM = "members.drop.rngs"


class MLP(nnx.Module):
    def __init__(self, rate: float, *, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None))
        self.l1 = nnx.Linear(DIN, DMID, kernel_init=init, rngs=rngs)
        self.drop = nnx.Dropout(rate=rate, rngs=rngs)
        self.head = nnx.Linear(DMID, DOUT, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(nnx.relu(self.l1(x))))


class Ensemble(nnx.Module):
    """E members stacked on axis 0, annotated over 'model' (``transform_metadata``), each with its own stream."""

    def __init__(self, rate: float, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=E)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "model"})
        def create(rngs):
            return MLP(rate, rngs=rngs)

        self.members = create(rngs)

    def __call__(self, x):
        @nnx.vmap(in_axes=(0, None), out_axes=0)
        def forward(member, x):
            return member(x)

        return forward(self.members, x)  # (E, B, DOUT)


def loss_fn(model, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"][None, :])
    return jnp.mean(ce)  # the mean over members and rows: couples no rows


_rng = np.random.default_rng(0)
BATCHES = [
    {"x": _rng.normal(size=(B, DIN)).astype(np.float32), "y": _rng.integers(0, DOUT, B).astype(np.int32)}
    for _ in range(2)
]


def task(rate: float = 0.0, seed: int = 0, k: int = 1) -> Task:
    tx = optax.adam(1e-2)
    tx = tx if k == 1 else optax.MultiSteps(tx, every_k_schedule=k).gradient_transformation()
    return Task(
        model=lambda: Ensemble(rate, rngs=nnx.Rngs(params=seed, dropout=1)),
        optimizer=tx,
        loss_fn=loss_fn,
        batches=BATCHES,
    )


def make_step(fault: str = ""):
    """The user's data-parallel ``jax.shard_map`` step (state replicated, P()), as the trial's; ``fault``: one of
    the trial's earlier mistakes."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))

        def body(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            params = jax.tree.map(lambda a: a + 0, nnx.state(model, nnx.Param))
            nnx.update(model, jax.lax.pcast(params, "data", to="varying"))
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            nnx.update(model, params)
            if fault != "unreduced":
                grads = jax.lax.pmean(grads, "data")
            if fault != "loss_unreduced":
                loss = jax.lax.pmean(loss, "data")
            optimizer.update(model, grads)
            return loss, grads, nnx.state((model, optimizer))

        if fault == "captured":  # the model and optimizer closed over, not passed in

            def body(state, batch):  # noqa: F811
                loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
                optimizer.update(model, jax.lax.pmean(grads, "data"))
                return jax.lax.pmean(loss, "data"), grads, nnx.state((model, optimizer))

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P()))
        loss, grads, state = jax.jit(mapped)(state, batch)
        nnx.update((model, optimizer), state)
        return {"loss": loss, "grads": grads}

    return step


def placed_step(model, optimizer, batch, mesh):
    """A step that places the state by its annotations (the Flax NNX sharding guide's way)."""
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    return make_step()(model, optimizer, batch, mesh)


# ------------------------------------------------------------------------------- 1. stacked RNG counts


def test_a_stacked_streams_counts_compare_elementwise():
    """One count per member: equal counts pass; the member whose count differs most is the one reported, with its
    two counts; counts of another shape fail."""
    ok = _count_error(0, "model.members.drop.rngs.count", np.array([3, 3]), np.array([3, 3]))
    assert ok.ok and ok.max_abs_err == 0 and ok.counts == (3, 3)
    bad = _count_error(1, "model.members.drop.rngs.count", np.array([3, 3]), np.array([3, 5]))
    assert not bad.ok and bad.max_abs_err == 2 and bad.counts == (3, 5) and bad.kind == "counter"
    assert _count_error(0, "c", np.array(2), np.array(2)).ok  # one stream: as before
    assert not _count_error(0, "c", np.array([1, 1]), np.array([1, 1, 1])).ok


def test_the_ensembles_counts_are_compared_after_a_forward_pass():
    """The trial's crash site, on the models themselves: both sides drew once (equal); one side drew twice."""
    ref = task(0.5).new_model()
    cand = nnx.clone(ref)
    ref(BATCHES[0]["x"]), cand(BATCHES[0]["x"])
    (same,) = rng_count_leaves(0, ref, cand, [STREAM])
    assert same.ok and same.counts == (1, 1), same
    cand(BATCHES[0]["x"])
    (ahead,) = rng_count_leaves(0, ref, cand, [STREAM])
    assert not ahead.ok and ahead.counts == (1, 2) and ahead.name == f"counter model.{STREAM}.count"


@require_devices(2)
def test_a_correct_step_with_dropout_fails_leading_with_the_draws_and_passes_at_rate_0():
    """At rate 0.5 each shard draws its rows' masks with the same key, so the correct step cannot equal the full
    batch's draws: a FAIL (never a crash, never a PASS) whose first sentence names the draws and how to check the
    rest of the step; the row-coupling reading comes after it. At rate 0 the same step PASSes."""
    mesh = make_mesh({"data": 2})
    report = check_parity(make_step(), task(0.5), mesh=mesh, steps=2)
    assert not report.ok and report.codes[0] == "per_shard_loss", report.codes
    said = report.diagnoses[0].message
    assert said.startswith(
        f"The model draws random numbers in its forward pass ({STREAM}: Dropout at a nonzero rate), and at step 0 "
        "the loss the step returns ("
    ), said
    assert "check it with the draws off (Dropout at rate 0, or deterministic=True)" in said
    assert said.index("Dropout at rate 0") < said.index("Otherwise a term of the loss that couples the rows")
    assert check_parity(make_step(), task(0.0), mesh=mesh, steps=2).ok


@require_devices(4)
def test_the_builtin_gspmd_passes_the_ensemble_with_dropout_on_data_and_model():
    """The built-in gspmd on data=2,model=2 stopped on the stacked count; it draws the full batch's numbers."""
    report = check_parity("gspmd", task(0.5), mesh=make_mesh({"data": 2, "model": 2}), steps=2)
    assert report.ok, report.diagnosis
    counts = [e for r in report.steps for e in r.leaves if e.name == f"counter model.{STREAM}.count"]
    assert [e.counts for e in counts] == [(1, 1), (2, 2)]


def test_a_per_shard_loss_of_a_model_that_draws_leads_with_the_draws():
    """The sentence on its own: the measured loss kept, the draws first, the coupled-rows reading last."""
    from shardcheck.parity.diagnosis.draws import with_draws
    from shardcheck.parity.diagnosis.evidence import Diagnosis

    measured = (
        "At step 0 the loss the step returns (2.32) is the task's loss computed over each shard's own rows and "
        "combined over 2 shards, where the full batch's is 2.34: a term of the loss that couples the rows of the "
        "batch was computed per shard. Compute it over the whole batch."
    )
    found = [Diagnosis("per_shard_loss", measured, "loss")]
    (said,) = with_draws(found, "forward", ("rngs.noise",), None)
    assert said.message.startswith(
        "The model draws random numbers in its forward pass (rngs.noise), and at step 0 the loss the step returns "
        "(2.32) is the task's loss computed over each shard's own rows and combined over 2 shards, where the full "
        "batch's is 2.34: what a forward pass run per shard computes, every shard drawing from the same key"
    ), said.message
    assert said.message.endswith(
        "Otherwise a term of the loss that couples the rows of the batch was computed per shard. Compute it over "
        "the whole batch."
    )
    assert with_draws(found, "forward", (), None) == found  # a model that draws nothing: the coupling alone


# ------------------------------------------------------------------------------- 2. the annotation hint


def test_the_annotation_hint_is_said_only_beside_an_error_about_it():
    model = task().new_model()
    mesh = make_mesh({"data": 2})
    missing = (
        "leaf 'members.head.kernel' is annotated P('model', None, None) but the mesh has no axis 'model'"
    )
    for about in (
        ValueError("Resource axis: model of P('model', None, None) is not found in mesh: ('data',)."),
        ValueError("Mesh has no axis named 'model' for the sharding NamedSharding(...)"),
    ):
        assert _annotation_cause(about, model, mesh).startswith(missing), about
    trace = ValueError(
        "Cannot extract graph node from different trace level, got RngCount(eager_sharding=False)"
    )
    replication = ValueError(
        "shard_map applied to the function 'body' was given out_specs which require replication which can't be "
        "statically inferred given the mesh:\n\nThe mesh given has shape (2,) with corresponding axis names "
        "('data',).\n\nout_specs[0] is P() which implies that the corresponding output value is replicated across "
        "mesh axis 'data', but could not infer replication over any axes"
    )
    cond = TypeError(
        "cond branches must have equal output types but they differ.\n\n  * the output of true_fun at path "
        "[0]['members']['head']['bias'] has type float32[2,4] but the corresponding output of false_fun has type "
        "float32[2,4]{V:data}, so the manual axis types do not match;"
    )
    for unrelated in (trace, replication, cond):
        assert _annotation_cause(unrelated, model, mesh) == "", unrelated
    assert _traced_hint(trace).startswith("a Flax object made outside the function the step traces")
    assert (  # trial 53: the step split outside and merged inside jax.shard_map, then captured it in jax.grad
        "a model merged inside jax.shard_map and captured by the function jax.grad / jax.value_and_grad "
        "differentiates" in _traced_hint(trace)
    )
    assert (  # trial 61: merged inside the differentiated function without a copy, a scanned model's RNG counts
        "merge a copy inside the differentiated function (nnx.merge(graphdef, params, rest, copy=True))"
        in _traced_hint(trace)
    )
    assert _traced_hint(replication).startswith(
        "the step's jax.shard_map returns as replicated over 'data' (out_specs[0] P()) a value computed per device"
    )
    assert _varying_hint(cond).startswith(
        "values vary over 'data' inside the step's jax.shard_map where they must not, e.g. "
        "[0]['members']['head']['bias'] (float32[2,4]{V:data})"
    )
    assert _traced_hint(cond) == "" and _varying_hint(trace) == ""


@require_devices(2)
@pytest.mark.parametrize(
    "fault, k, said",
    [
        ("captured", 1, "a Flax object made outside the function the step traces"),
        (
            "loss_unreduced",
            1,
            "the step's jax.shard_map returns as replicated over 'data' (out_specs[0] P())",
        ),
        ("unreduced", 2, "values vary over 'data' inside the step's jax.shard_map where they must not"),
    ],
)
def test_a_step_that_ignores_the_annotations_is_told_its_own_error(fault, k, said):
    """The trial's three errors on data=2, from steps that never place the state by the annotations: each with its
    own cause, never the annotation over 'model' the mesh lacks."""
    with pytest.raises(CandidateError) as raised:
        check_parity(make_step(fault), task(k=k), mesh=make_mesh({"data": 2}), steps=1)
    assert raised.value.hint.startswith(said), raised.value.hint
    assert "is annotated" not in str(raised.value)


@require_devices(2)
def test_a_step_that_places_by_the_annotations_is_told_the_axis_the_mesh_lacks():
    with pytest.raises(CandidateError) as raised:
        check_parity(placed_step, task(), mesh=make_mesh({"data": 2}), steps=1)
    assert raised.value.hint.startswith(
        "leaf 'members.head.kernel' is annotated P('model', None, None) but the mesh has no axis 'model' (its "
        "axes: ('data',))"
    ), raised.value.hint


# ------------------------------------------------------------------------------- 3. a replay started elsewhere


@require_devices(2)
def test_a_replay_of_another_initialization_leads_with_the_initial_state():
    """Recorded with one parameter seed, replayed with another: no stage of a step is the first difference (no
    localization), the initial state leads; the same model's replay PASSes."""
    from shardcheck.parity.harness.recorded import record_run

    mesh = make_mesh({"data": 2})
    recording = record_run(task(), make_step(), mesh=mesh, steps=2)
    assert check_parity(make_step(), task(), mesh=mesh, reference=recording).ok
    report = check_parity(make_step(), task(seed=1), mesh=mesh, reference=recording)
    assert not report.ok and report.localization is None
    assert report.codes[0] == "initial_state"
    assert report.diagnosis.startswith(
        "The initial state differs from the recorded one: another seed, initializer or model"
    ), report.diagnosis
    assert "First difference at step 0" not in report.diagnosis


# ------------------------------------------------------------------------------- 4. a model factory that raises


def _unsplit_ensemble():
    """The trial's ``nnx.vmap`` with every ``in_axes`` None and no ``axis_size``: Flax raises building it."""

    @nnx.vmap(in_axes=(None,), out_axes=0)
    def create(rngs):
        return MLP(0.0, rngs=rngs)

    return create(nnx.Rngs(0))


def test_a_model_factory_that_raises_is_named_with_its_file_and_the_fix():
    bad = Task(model=_unsplit_ensemble, optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=BATCHES)
    with pytest.raises(ValueError) as raised:
        check_parity(make_step(), bad, steps=1)
    said = str(raised.value)
    assert said.startswith(f"check_parity: the task's model factory _unsplit_ensemble ({__file__}, line "), (
        said
    )
    assert (
        "raised ValueError building the model: vmap must have at least one non-None value in in_axes" in said
    )
    assert said.endswith(
        "fix the factory or the modules it builds (the error is theirs, not the step's nor shardcheck's)"
    )
    assert isinstance(raised.value.__cause__, ValueError)

    def typo():
        return MLP(0.0, rngs=nnx.Rngs(0), width=3)  # a TypeError of its own: stays a TypeError, named alike

    with pytest.raises(TypeError, match=r"^Task.model: the task's model factory .*typo .* raised TypeError"):
        Task(model=typo, optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=BATCHES).new_model()
    # the other side: a factory that needs arguments is still told so
    with pytest.raises(TypeError, match=r"must be callable with no arguments"):
        Task(model=MLP, optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=BATCHES).new_model()
