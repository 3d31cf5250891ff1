"""A model that draws random numbers in its forward pass (a VAE's ``eps = normal(self.rngs.noise(), ...)``, Dropout at
a nonzero rate), issue #36 trial 9.

Under ``jax.jit`` on sharded inputs the draw gives the full batch's numbers however the batch is split
(``jax_threefry_partitionable``, JAX's default), so a GSPMD step equals the single-device one: it PASSes, the count
of the stream drawn advancing alike on both sides, compared exactly (a step that puts it back FAILs on it). A step
that runs the forward pass per shard draws the same key on every shard: a user's ``jax.shard_map`` step FAILs at
the forward stage, the report naming the random draws; the built-in ``dp`` is refused up front with that reason
and what works, by ``check_parity``, ``train_task`` and ``run_task`` alike. A stream the model's ``nnx.Rngs`` lacks
is said to be fixed in the model factory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, said
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.runner import run_task
from shardcheck.task import check_model
from shardcheck.training import train_task

X = np.linspace(-1.0, 1.0, 2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
Y = np.cos(X[..., :3] * 2.0)
BATCHES = [{"x": X[i], "y": Y[i]} for i in range(2)]
SCALE = 0.5  # the noise's scale: large enough that another draw moves the loss far past its tolerance


class Noisy(nnx.Module):
    """A Linear plus noise drawn from the ``noise`` stream in ``__call__`` (a VAE's reparameterization)."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        h = self.lin(x)
        return h + SCALE * jax.random.normal(self.rngs.noise(), h.shape)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


TASK = Task(
    model=lambda: Noisy(nnx.Rngs(params=0, noise=1)),
    optimizer=optax.adam(1e-2),
    loss_fn=loss_fn,
    batches=BATCHES,
)


def same_key_step(model, optimizer, batch, mesh):
    """Data parallel in ``jax.shard_map``: each shard runs the forward pass on its rows, drawing from the same key."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def body(p, rest, b):
        local = lambda p: loss_fn(nnx.merge(graphdef, p, rest, copy=True), b)  # noqa: E731
        loss, grads = jax.value_and_grad(local)(
            jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
        )
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    loss, grads = jax.jit(mapped)(params, rest, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def test_check_model_lists_the_streams_drawn_and_accepts_the_model():
    drawn: list[str] = []
    model = TASK.new_model()
    count = model.rngs.noise.count[...]
    assert check_model("f", model, loss_fn, BATCHES[0], drawn=drawn) is False
    assert drawn == ["rngs.noise"] and model.rngs.noise.count[...] == count  # run on a clone: nothing moved
    with pytest.raises(
        ValueError, match=r"^f: model Noisy draws random numbers .*\(RNG stream\(s\) rngs.noise\)"
    ):
        check_model("f", model, loss_fn, BATCHES[0])  # a caller whose steps all run per shard still refuses


@require_devices(2)
def test_a_gspmd_step_draws_the_full_batchs_numbers_and_passes():
    """The built-in gspmd step (the plain step jitted over the sharded batch) equals the single-device one for 2
    steps: the loss to rounding, though each draw adds noise of variance SCALE**2 (the loss ~0.5)."""
    assert jax.config.jax_threefry_partitionable  # JAX's default since 0.5: what makes the draws agree
    report = check_parity("gspmd", TASK, mesh=make_mesh(2))
    assert report.ok and report.codes[0] == "parity", str(report)
    assert len(report.steps) == 2
    loss = next(e for e in report.steps[1].leaves if e.kind == "loss")
    assert loss.max_abs_err < 1e-6 < loss.tolerance


@nnx.jit
def _jitted_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss, grads


def _gspmd_step(model, optimizer, batch, mesh):
    """The user's GSPMD step: the plain step under nnx.jit, the batch split over 'data'."""
    loss, grads = _jitted_step(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    return {"loss": loss, "grads": grads}


def count_kept_step(model, optimizer, batch, mesh):
    """A GSPMD step (the full batch's draws) that puts the RNG count back: the next step repeats this one's draws."""
    count = model.rngs.noise.count[...]
    loss, grads = _jitted_step(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    model.rngs.noise.count[...] = count
    return {"loss": loss, "grads": grads}


@require_devices(2)
def test_a_step_that_does_not_write_the_rng_count_back_fails_on_the_count():
    """Both sides advance the count of the stream drawn (1 after step 0, 2 after step 1), compared exactly: a GSPMD
    step that puts it back draws the full batch's numbers at step 0 (the loss within 1e-6) and FAILs there on the
    count, at the forward stage, not as a drifted trajectory (re-run from the reference's state it would match)."""
    correct = check_parity(_gspmd_step, TASK, mesh=make_mesh(2))
    assert correct.ok, str(correct)
    counts = [next(e for e in r.leaves if e.name == "counter model.rngs.noise.count") for r in correct.steps]
    assert [(e.ok, e.max_abs_err) for e in counts] == [(True, 0.0), (True, 0.0)]
    assert not any(
        "params" in e.name for e in correct.steps[0].leaves if e.kind == "counter"
    )  # nothing draws it

    report = check_parity(count_kept_step, TASK, mesh=make_mesh(2), steps=1)
    (record,) = report.steps
    count = next(e for e in record.leaves if e.name == "counter model.rngs.noise.count")
    assert not count.ok and count.max_abs_err == 1.0 and count.ratio == 0.0  # 0 against the reference's 1
    loss = next(e for e in record.leaves if e.kind == "loss")
    assert loss.ok and loss.max_abs_err < 1e-6
    assert report.localization.stage == "forward" and report.codes[0] != "diverged_trajectory"
    # the loss matches: the writes were dropped (trial 60 C4: "The forward pass differs" had followed)
    said = report.diagnoses[0].message
    assert said.startswith(
        "The count of the RNG stream rngs.noise, which the task's forward pass draws from, did not move in the "
        "step's model, though the loss the step returns at step 0 matches the reference's"
    ), said
    assert said.endswith("A count left as it was draws this step's numbers again at the next step."), said


@require_devices(2)
def test_a_shard_map_step_drawing_the_same_key_on_every_shard_fails_at_the_forward_stage():
    report = check_parity(same_key_step, TASK, mesh=make_mesh(2), steps=1)
    assert not report.ok
    assert report.localization.stage == "forward" and report.localization.step == 0
    loss = next(e for e in report.steps[0].leaves if e.kind == "loss")
    assert loss.max_abs_err > 100 * loss.tolerance
    text = report.diagnoses[0].message
    assert (
        "The forward pass differs, and the model draws random numbers in it (rngs.noise): a step that draws other "
        "numbers than the full batch's differs here (a forward pass per shard that draws from the same key on "
        "every shard, or from a key folded with the shard's index" in text
    ), text
    assert (
        "draw by the global row index (jax.random.fold_in of each row's index, carried in the batch)" in text
    )


def folded_key_step(model, optimizer, batch, mesh):
    """Data parallel in ``jax.shard_map``, each shard drawing from the key folded with its index (the usual
    recipe), the stream's count written back: other numbers than the full batch's, and no count that differs."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def body(p, rest, b):
        index = jax.lax.axis_index("data")
        rest = jax.tree.map(
            lambda x: jax.random.fold_in(x, index) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
            rest,
        )

        def local(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return loss_fn(m, b), nnx.state(m, nnx.RngCount)

        (loss, counts), grads = jax.value_and_grad(local, has_aux=True)(p)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data"), counts

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False
    )
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    loss, grads, counts = jax.jit(mapped)(params, rest, batch)
    nnx.update(model, counts)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


@require_devices(2)
def test_keys_folded_with_the_shard_index_lead_the_finding_with_the_draws():
    """Trial 53: keys folded per shard (fold_in of the shard's index) read a 10-line forward finding that listed
    masks and positions, then "(the same key on every shard)", false for this step, and no fix; the draws now lead
    the finding, with both ways of drawing other numbers and the global-row-index fix."""
    report = check_parity(folded_key_step, TASK, mesh=make_mesh(2), steps=1)
    assert not report.ok and report.localization.stage == "forward", str(report)
    counts = [e for e in report.steps[0].leaves if e.name == "counter model.rngs.noise.count"]
    assert [e.ok for e in counts] == [True]  # the count was written back: the draws alone differ
    lead = report.diagnoses[0]
    assert lead.code in ("forward_differs", "update_differs", "loss_differs"), str(report)
    assert lead.message.startswith(
        "The forward pass differs, and the model draws random numbers in it (rngs.noise): a step that draws other "
        "numbers than the full batch's differs here (a forward pass per shard that draws from the same key on "
        "every shard, or from a key folded with the shard's index: each row must get the numbers it gets in the "
        "full batch). Check the rest of the step with the draws off"
    ), lead.message
    assert report.diagnosis_lines[0].startswith(f"[{lead.code}] The forward pass differs")  # printed first


@require_devices(2)
def test_dp_is_refused_with_the_reason_and_what_works():
    with pytest.raises(ValueError) as info:
        check_parity("dp", TASK, mesh=make_mesh(2))
    text = str(info.value)
    assert text.startswith(
        "dp: cannot run this model: model Noisy draws random numbers in its forward pass "
        "(RNG stream(s) rngs.noise), and dp runs the forward pass per device in jax.shard_map, "
        "every shard drawing with the same key"
    ), text
    assert "Check it with a GSPMD step (strategy gspmd" in text and "jax.random.fold_in(key, row)" in text
    # trial 19: a model keyed per global row (carried in the batch) draws the full batch's numbers per shard too;
    # the refusal says it cannot tell, never that the step cannot equal the single-device one
    assert "only where the model keys each row's draws by its global index carried in the batch" in text
    assert "cannot equal" not in text
    assert "(check_parity, strategy 'dp')" in text


def test_a_stream_the_rngs_lack_is_fixed_in_the_model_factory():
    """The missing stream is named in the fix; any other AttributeError is still the loss's to fix."""
    model = Noisy(nnx.Rngs(params=0))
    with pytest.raises(ValueError) as info:
        check_model("f", model, loss_fn, BATCHES[0])
    assert str(info.value) == (
        "f: the model's forward pass draws from an RNG stream its nnx.Rngs lacks (No RngStream named 'noise' found "
        "in Rngs.); the fix is in the task's model factory, not the loss: name the stream there, e.g. "
        "model=lambda: MyModel(rngs=nnx.Rngs(params=0, noise=1))"
    )
    with pytest.raises(
        ValueError, match=r"^f: the task's loss_fn raised AttributeError .*fix the loss function"
    ):
        check_model("f", TASK.new_model(), lambda m, b: m.decoder(b["x"]), BATCHES[0])


@require_devices(2)
def test_train_and_run_task_refuse_only_the_strategies_that_draw_per_shard():
    """``train_task`` trains gspmd beside the reference (the losses agree at every step) and refuses dp with the
    reason; ``run_task`` runs the reference and gspmd (parameters within 1e-6) and skips the others, each with why."""
    trained = train_task(TASK, "gspmd", num_shards=2)
    assert trained.loss_curves_agree and trained.first_exceeded_step is None
    with pytest.raises(ValueError, match=r"^dp: cannot run this model: model Noisy draws random numbers"):
        train_task(TASK, "dp", num_shards=2)
    ran = run_task(TASK, num_shards=2, mesh=make_mesh(2))
    assert set(ran.outcomes) == {"reference", "gspmd"}
    assert ran.outcomes["gspmd"].max_abs_param_diff_vs_baseline < 1e-6
    for name in ("simulation", "dp", "fsdp", "accumulation"):
        assert ran.skipped[name].startswith(f"{name}: cannot run this model: model Noisy draws random"), name


@require_devices(2)
def test_a_replay_compares_the_rng_counts_and_names_the_draws_as_live():
    """A recording keeps each drawn stream's count (``counter model.rngs.noise.count``, the streams in
    ``meta["drawn"]``): a replay of the step that puts the count back FAILs at step 0 on it, at the forward stage,
    with the live check's sentences (the draws named; the form a dropped write, never 'a learning rate of 0'),
    where it used to FAIL at step 1 by its loss; the correct GSPMD step PASSes the same replay."""
    from shardcheck.parity.harness.recorded import record_run

    recording = record_run(TASK, "gspmd", mesh=make_mesh(2))
    assert recording.meta["drawn"] == ["rngs.noise"] and "counter model.rngs.noise.count" in recording.names
    assert check_parity(_gspmd_step, TASK, mesh=make_mesh(2), reference=recording).ok
    for reference in (None, recording):
        report = check_parity(count_kept_step, TASK, mesh=make_mesh(2), reference=reference)
        loc = report.localization
        assert (loc.step, loc.stage, report.codes[0]) == (0, "forward", "model_state"), str(report)
        assert (
            "a zero change: the candidate left the forward pass's counter model.rngs.noise.count"
            in loc.text()
        )
        assert "a learning rate of 0" not in loc.form.sentence
        said = report.diagnoses[0].message
        if reference is None:  # live: the loss matches, so the count's write was dropped (trial 60 C4)
            assert (
                "did not move in the step's model, though the loss the step returns at step 0 matches" in said
            )
        else:  # a replay reads the count's digest, not its arrays: the draws named after its model_state
            assert "the model draws random numbers in it (rngs.noise)" in said


def test_the_draws_are_named_only_beside_a_finding_that_names_no_cause():
    """Trial 19: every forward-stage FAIL of a model that draws (a SpecAugment mask keyed per global row) was told
    'a step that draws other numbers than the full batch's ... differs here', beside a named normalization or an
    exact x0.5469 loss scale whose draws were the reference's; the clause now follows a finding that names no
    cause (or a stream's count that differs) only."""
    from shardcheck.parity.diagnosis.draws import with_draws
    from shardcheck.parity.diagnosis.evidence import Diagnosis

    named = [Diagnosis("normalization", "At step 0 the step reproduces the mean of per-shard means.", None)]
    assert with_draws(named, "forward", ("rngs.augment",), None) == named
    generic = [Diagnosis("update_differs", "The loss differs.", "loss")]
    (said,) = with_draws(generic, "forward", ("rngs.augment",), None)
    assert said.message == (
        "The forward pass differs, and the model draws random numbers in it (rngs.augment): a step that draws "
        "other numbers than the full batch's differs here (a forward pass per shard that draws from the same key "
        "on every shard, or from a key folded with the shard's index: each row must get the numbers it gets in "
        "the full batch). Check the rest of the step with the draws off (Dropout at rate 0, or "
        "deterministic=True), or draw by the global row index (jax.random.fold_in of each row's index, carried in "
        "the batch). The loss differs."
    )
    assert with_draws(generic, "gradients", ("rngs.augment",), None) == generic


def test_the_draws_are_not_named_where_the_steps_before_matched_with_them():
    """Trial 60: a mean of per-shard means matched at steps 0-2 (equal shards) and first differed at the padded
    batch's step 3, and its forward_differs was led by "a step that draws other numbers than the full batch's
    differs here": a step drawing other numbers differs from step 0, so after matching steps the draws are not
    named, unless a stream's count differs (its numbers drawn again at the next step)."""
    from shardcheck.parity.diagnosis.draws import with_draws
    from shardcheck.parity.diagnosis.evidence import Diagnosis, LeafError, StepRecord

    generic = [Diagnosis("forward_differs", "The loss differs.", "loss")]
    loss = LeafError(3, "loss", "loss", 0.07, 0.03, 2e-4, False, 1.03)
    count = LeafError(3, "counter", "model.drop.rngs.count", 1.0, 0.25, 0.0, False, 0.75)

    def at(step, *leaves):
        return StepRecord(
            step, leaves=leaves, rtol=1e-5, atol=1e-6, loss=2.4, candidate_loss=2.47, step_count=step + 1,
            candidate_step_count=step + 1,
        )  # fmt: skip

    assert with_draws(generic, "forward", ("drop.rngs",), at(3, loss)) == generic
    (said,) = with_draws(generic, "forward", ("drop.rngs",), at(0, dataclasses.replace(loss, step=0)))
    assert said.message.startswith("The forward pass differs, and the model draws random numbers in it")
    (said,) = with_draws(generic, "forward", ("drop.rngs",), at(3, loss, count))
    assert "(counter model.drop.rngs.count) draws this step's numbers again at the next" in said.message


def test_a_loss_per_shard_of_a_model_that_draws_names_the_draws_per_shard():
    """Trial 35: a VAE whose shard_map step drew its noise with the same key on every shard read only "a term of
    the loss that couples the rows ... was computed per shard. Compute it over the whole batch: gather ...": the
    per-shard loss of a model that draws is also the draws per shard, said with its fix; a model that draws nothing
    keeps the row-coupling reading alone."""
    from shardcheck.parity.diagnosis.draws import with_draws
    from shardcheck.parity.diagnosis.evidence import Diagnosis

    coupled = [
        Diagnosis(
            "per_shard_loss", "At step 0 a term of the loss that couples the rows was computed per shard."
        )
    ]
    assert with_draws(coupled, "forward", (), None) == coupled
    (said,) = with_draws(coupled, "forward", ("encoder.rngs.noise",), None)
    # trial 42: the draws lead (a mean cross-entropy couples no rows), the coupled-rows reading after them
    assert said.message.startswith(
        "The model draws random numbers in its forward pass (encoder.rngs.noise), and the step's loss is the one "
        "computed per shard: what a forward pass run per shard computes, every shard drawing from the same key"
    ), said.message
    assert (
        "Where the loss couples no rows (a mean of per-row losses), the draws per shard are the cause"
        in said.message
    )
    assert (
        "draw by the global row index (jax.random.fold_in of each row's index, carried in the batch) or carry the "
        "noise in the batch. Otherwise at step 0 a term of the loss that couples the rows was computed per shard."
    ) in said.message
    assert said.message.endswith("Otherwise " + coupled[0].message[0].lower() + coupled[0].message[1:])


def test_refusals_of_a_drawing_model_group_by_reason_and_give_their_fix_once():
    """Trial 35: verify's note repeated one ~600-character refusal per built-in (simulation, dp, fsdp,
    accumulation), each naming itself; dp's and fsdp's are one reason, and the fix every one gives is said once."""
    from shardcheck.cli.verify import ErrorRow, _refusal_reason, _refusals_message

    fix = "Check it with a GSPMD step (strategy gspmd), or keys folded per global row index"
    how = {
        "simulation": "once per shard",
        "dp": "per device in jax.shard_map",
        "fsdp": "per device in jax.shard_map",
        "accumulation": "once per micro-batch",
    }
    rows = {}
    for name, runs in how.items():
        whole = f"{name}: cannot run this model: it draws, and {name} runs the forward pass {runs}, which {name} cannot see. {fix}"
        rows[name] = ErrorRow(
            name, whole, "ValueError", _refusal_reason(name, whole), None, True, True, "draws"
        )
    rows["gspmd"] = object()  # a row that ran
    said = _refusals_message(rows)
    assert said.count("refused this task") == 1 and said.count(fix[6:]) == 1
    # the head they share said once, then each group's own part on a line of its own (trial 53: one line of
    # 1,800 characters), then the tail they share
    assert said.startswith(
        "shardcheck verify: the built-in strategies 'simulation', 'dp', 'fsdp' and 'accumulation' refused this "
        "task: cannot run this model: it draws, and\n  - 'simulation': it runs the forward pass once per shard, "
        "which it cannot see;\n  - 'dp' and 'fsdp': it runs the forward pass per device in jax.shard_map, which it "
        "cannot see;\n  - 'accumulation': it runs the forward pass once per micro-batch, which it cannot see.\n"
        "For all of them: check it with a GSPMD step"
    ), said
    assert said.count("it draws") == 1
    assert "dp runs" not in said and "which simulation cannot see" not in said
    assert (
        _refusal_reason("fsdp", "fsdp: fsdp splits it; try --mesh fsdp=4")
        == "it splits it; try --mesh fsdp=4"
    )
    one = _refusals_message({"dp": rows["dp"], "gspmd": object()})  # one refusal: its fix in its place
    assert one.count(fix) == 1 and "For all of them" not in one


def test_refusals_that_share_a_consequence_say_it_once():
    """Trial 51: a BatchNorm model's refusal note repeated its batch statistics clause for every group of
    strategies (one stderr line of 1,900 characters). A tail the reasons share after ", so" is said once."""
    from shardcheck.cli.verify import ErrorRow, _refusals_message

    stats = (
        "its batch statistics (nnx.BatchStat: BatchNorm) would be computed over part of the batch, not the full batch "
        "(docs/reduction_cases.md C7): a GSPMD step computes the full batch's; check it with gspmd or your own step"
    )
    how = {
        "simulation": "once per shard",
        "dp": "per device in jax.shard_map",
        "accumulation": "once per micro-batch",
    }
    rows = {
        name: ErrorRow(
            name, "", "ValueError", f"it writes state, and it runs {runs}, so {stats}", None, True, True
        )
        for name, runs in how.items()
    }
    rows["gspmd"] = object()  # a row that ran
    said = _refusals_message(rows)
    assert said.count("refused this task") == 1 and said.count("its batch statistics") == 1
    assert said.count("it writes state") == 1
    assert (
        "\n  - 'accumulation': it runs once per micro-batch.\nFor all of them: its batch statistics (" in said
    )
    assert "\n  - 'dp': it runs per device in jax.shard_map;\n" in said


class Dropped(nnx.Module):
    """A Linear then Dropout at ``rate``, its stream ``drop.rngs``."""

    def __init__(self, rate: float):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.lin(x))


def _dropped_task(rate: float) -> Task:
    return Task(model=lambda: Dropped(rate), optimizer=optax.adam(1e-2), loss_fn=loss_fn, batches=BATCHES)


def _step_running(switch):
    """The single-device step, its model switched by ``switch(model, on)`` for the forward pass only."""

    def step(model, optimizer, batch):
        switch(model, True)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        switch(model, False)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return step


@require_devices(2)
def test_a_step_drawing_what_the_task_does_not_and_the_reverse_are_told_as_draws():
    """Trial 52: Dropout on in the step (rate 0.5) while the task's is 0 read "the step must write it as one
    forward pass over the full batch does" (and its count was not compared at all); the task's Dropout at 0.5 and
    the step's model in eval mode read "the forward pass's writes were dropped or undone"."""

    def rate_on(model, on):
        model.drop.rate = 0.5 if on else 0.0

    def eval_mode(model, on):
        model.eval() if on else model.train()

    mesh = make_mesh(2)
    on = check_parity(_step_running(rate_on), _dropped_task(0.0), mesh=mesh, steps=1)
    assert (on.verdict, on.diagnoses[0].code) == ("FAIL", "model_state")
    assert on.diagnoses[0].message.startswith(
        "The step draws random numbers that the single-device step does not: the count of the RNG stream "
        "drop.rngs moved in the step's model and not in the task's, whose forward pass draws nothing from it"
    )
    off = check_parity(_step_running(eval_mode), _dropped_task(0.5), mesh=mesh, steps=1)
    assert (off.verdict, off.diagnoses[0].code) == ("FAIL", "model_state")
    assert off.diagnoses[0].message.startswith(
        "The count of the RNG stream drop.rngs, which the task's forward pass draws from, did not move in the "
        "step's model: the step ran the model without its draws (model.eval(), deterministic=True"
    )
    same = check_parity(_step_running(lambda m, on: None), _dropped_task(0.0), mesh=mesh, steps=1)
    assert same.ok and not any(e.kind == "counter" and "drop" in e.path for e in same.steps[0].leaves)


def _writes_dropped(model, optimizer, batch):
    """jax.grad of a function of nnx.split parts: the forward pass draws, and its count's write is dropped."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = jax.value_and_grad(lambda p, r: loss_fn(nnx.merge(graphdef, p, r), batch))(
        nnx.as_pure(params), nnx.as_pure(rest)
    )
    grads = jax.tree.map(
        lambda v, g: v.replace(g), params, grads, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


@require_devices(2)
def test_a_count_left_as_it_was_beside_a_matching_loss_is_read_as_dropped_writes():
    """Trial 60 C4: a step whose jax.grad of nnx.split parts dropped the forward pass's writes (a Dropout count,
    BatchNorm's statistics) read "ran the model without its draws (model.eval() ...) or dropped the count's
    write", then "The forward pass differs", though its loss matched: with a matching loss only the dropped
    writes are said, and no draws clause follows."""
    report = check_parity(_writes_dropped, _dropped_task(0.5), mesh=make_mesh(2), steps=1)
    said = report.diagnoses[0]
    assert (report.verdict, said.code) == ("FAIL", "model_state"), str(report)
    assert said.message.startswith(
        "The count of the RNG stream drop.rngs, which the task's forward pass draws from, did not move in the "
        "step's model, though the loss the step returns at step 0 matches the reference's (it ran the model with "
        "its draws): the step dropped what its forward pass writes (jax.grad of a function of nnx.split parts"
    ), said.message
    assert "model.eval()" not in said.message and "The forward pass differs" not in said.message


@require_devices(2)
def test_values_gone_non_finite_after_the_first_failure_are_said_once():
    """Trial 52: a fault named at step 0 went on to NaN at step 2; every table row showed nan, no sentence said so.
    Here a gradient x2 at step 0 (summed, S = 2), then NaN gradients at step 1."""

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        t = int(optimizer.step[...])
        grads = jax.tree.map(lambda g: g * (2.0 if t == 0 else jnp.nan), grads)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    report = check_parity(step, _dropped_task(0.0), mesh=make_mesh(2))
    assert [d.code for d in report.diagnoses] == ["summed", "non_finite"]
    said = report.diagnoses[-1].message
    assert said.startswith("From step 1 the candidate holds NaN or infinite values (first in grad lin.")
    assert said.endswith(
        "what the failure at step 0 led to, or another fault of the step; fix the first failure first."
    )


@require_devices(2)
def test_a_replay_whose_task_optimizer_changed_says_so_first():
    """Trial 52: a task file's learning rate doubled since its recording replayed as a FAIL that said "the
    optimizer's update from equal inputs: matches", then "the update was applied differently". A recording keeps
    its optimizer's update of a probe gradient (``meta["optimizer"]``); a replay whose task's optimizer updates
    otherwise says so first. A recording without it (made before) compares as before."""
    from shardcheck.parity.harness.recorded import record_run

    def adam(lr):
        return Task(model=lambda: Dropped(0.0), optimizer=optax.adam(lr), loss_fn=loss_fn, batches=BATCHES)

    mesh = make_mesh(2)
    recording = record_run(adam(1e-2), "gspmd", mesh=mesh)
    assert set(recording.meta["optimizer"]) == {"advances", "lin.bias", "lin.kernel"}
    assert recording.meta["optimizer"]["advances"] == 0.0 and recording.meta["optimizer"]["lin.bias"] > 0
    assert check_parity("gspmd", adam(1e-2), mesh=mesh, reference=recording).ok
    doubled = check_parity("gspmd", adam(2e-2), mesh=mesh, reference=recording)
    assert doubled.verdict == "FAIL" and doubled.diagnoses[0].code == "settings_differ"
    assert doubled.diagnoses[0].message.startswith(
        "The task's optimizer is not the recording's: its update of a probe gradient at param lin."
    )
    assert "is 2 x the recorded one (another learning rate, schedule or transformation)" in said(
        doubled, "settings_differ"
    )
    del recording.meta["optimizer"]
    older = check_parity("gspmd", adam(2e-2), mesh=mesh, reference=recording)
    assert older.verdict == "FAIL" and "settings_differ" not in [d.code for d in older.diagnoses]
