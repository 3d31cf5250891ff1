"""Issue #36, trial 46 (a GPipe pipeline step): the readings of a pipeline's stage axis and of replicated copies.

1. A reduction missed over a pipeline's stage axis (named 'stage', 'stages', 'pipe', 'pipeline' or 'pp', or the
   axis the stacked leaves are split along) read as a tensor-parallel layer's ("Megatron's g ...", "a replicated
   bias added on every shard before the psum over 'stage' (it counts 2 times ...)"): the head's gradient, taken on
   the last stage only and not psum-ed over 'stage', and the activations sent to the wrong stage by a ppermute
   are now said as a pipeline's.
2. A zero update on the compared copies of a leaf whose copies differ along an axis read "a learning rate of 0 at
   this step (a schedule read one step early)": it is the gradient's, 0 on some devices only. The live check of a
   step that returns its loss only said "the mean of the copies' changes is 0.5 x the reference's" (the 4 copies
   of data=2 x stage=2, 2 of them distinct) where the copies sum to the reference's: now the 1/2 reading.
3. A replay of a step whose difference lies in one stage's slice of the stacked leaves said "no simple form ...
   ratio runs from -0 to 1": its recorded samples are now read per slice where they locate one, else the replay
   says they cannot and points to the live check.

The task: a 2-stage pipeline (2 tanh(Linear(8, 8)) blocks stacked with ``nnx.vmap`` over
'stage', a replicated head Linear(8 -> 2), MSE, Adam), 2 micro-batches per data shard on mesh data=2 x stage=2
(4 fake CPU devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, said
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh, record_run
from shardcheck.parity.diagnosis.evidence import LeafError
from shardcheck.parity.diagnosis.form import form_from_leaves
from shardcheck.parity.diagnosis.grouping import LeafFacts
from shardcheck.parity.diagnosis.topology import missed_axes_message, pipeline_axes

H, D_OUT, STAGES, MICRO = 8, 2, 2, 2
PIPELINE = "holds the stages of a pipeline"
LR_ZERO = "a learning rate of 0 at this step"


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(H, H, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class Pipeline(nnx.Module):
    """2 blocks stacked over 'stage' (kernel (2, 8, 8), bias (2, 8)) and a replicated head."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=STAGES)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "stage"})
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(H, D_OUT, rngs=rngs)

    def __call__(self, x):
        graphdef, state = nnx.split(self.blocks)
        x, _ = jax.lax.scan(lambda x, s: (nnx.merge(graphdef, s)(x), None), x, state)
        return self.head(x)


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task():
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, H)).astype(np.float32), "y": rng.normal(size=(8, D_OUT)).astype(np.float32)}
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: Pipeline(nnx.Rngs(0)), optimizer=optax.adam(1e-2), loss_fn=_loss, batches=batches,
        name="pipeline",
    )  # fmt: skip


def _body(fault):
    """The shard_map body: local stage parameters, the head, the local batch -> (loss, grads)."""
    vma = fault not in ("head_not_psummed", "no_pmean_stage0")

    def body(w, b, hk, hb, x, y):
        s = jax.lax.axis_index("stage")
        if vma:
            w, b = jax.lax.pcast(w, "data", to="varying"), jax.lax.pcast(b, "data", to="varying")
            hk, hb = (jax.lax.pcast(a, ("data", "stage"), to="varying") for a in (hk, hb))

        def local_loss(w, b, hk, hb):
            xs, ys = x.reshape(MICRO, -1, H), y.reshape(MICRO, -1, D_OUT)
            perm = [(1, 0)] if fault == "perm_reversed" else [(0, 1)]
            state, total = jnp.zeros_like(xs[0]), 0.0
            for t in range(MICRO + STAGES - 1):
                inp = jnp.where(s == 0, xs[min(t, MICRO - 1)] * (t < MICRO), state)
                out = jnp.tanh(inp @ w[0] + b[0])
                idx = t - (STAGES - 1)
                if 0 <= idx < MICRO:
                    mb = ((out @ hk + hb - ys[idx]) ** 2).mean()
                    total = total + jnp.where(s == STAGES - 1, mb, 0.0)
                send = jax.lax.stop_gradient(out) if fault == "stop_grad" else out
                state = jax.lax.ppermute(send, "stage", perm)
            return total if fault == "loss_summed" else total / MICRO  # loss_summed: x MICRO

        loss, (gw, gb, ghk, ghb) = jax.value_and_grad(local_loss, argnums=(0, 1, 2, 3))(w, b, hk, hb)
        if fault == "no_pmean_stage0":  # stage 0 keeps its data shard's own gradient
            gw = jnp.where(s == 0, gw, jax.lax.pmean(gw, "data"))
            gb = jnp.where(s == 0, gb, jax.lax.pmean(gb, "data"))
        else:
            gw, gb = jax.lax.pmean(gw, "data"), jax.lax.pmean(gb, "data")
        if fault != "head_not_psummed":
            ghk, ghb = jax.lax.psum(ghk, "stage"), jax.lax.psum(ghb, "stage")
        ghk, ghb = jax.lax.pmean(ghk, "data"), jax.lax.pmean(ghb, "data")
        return jax.lax.pmean(jax.lax.psum(loss, "stage"), "data"), gw, gb, ghk, ghb

    return body, vma


def make_step(fault="", loss_only=False):
    """The user's GPipe step; ``fault``: ``"head_not_psummed"`` (the head's gradient, taken on the last stage only,
    not psum-ed over 'stage'), ``"perm_reversed"`` (the activations sent from the last stage to the first),
    ``"stop_grad"`` (a stop_gradient on the activations sent between stages: stage 0 never trains),
    ``"no_pmean_stage0"`` (stage 0's gradient not averaged over 'data'). ``loss_only``: the step returns the loss
    alone."""

    def step(model, optimizer, batch, mesh):
        body, vma = _body(fault)
        specs = (P("stage"), P("stage"), P(), P(), P("data"), P("data"))
        out_specs = (P(), P("stage"), P("stage"), P(), P())
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=vma))
        blk = model.blocks.linear
        loss, gw, gb, ghk, ghb = fn(
            blk.kernel[...], blk.bias[...], model.head.kernel[...], model.head.bias[...],
            jnp.asarray(batch["x"]), jnp.asarray(batch["y"]),
        )  # fmt: skip
        grads = jax.tree.map(lambda a: a, nnx.state(model, nnx.Param))
        grads.replace_by_pure_dict(
            {"blocks": {"linear": {"kernel": gw, "bias": gb}}, "head": {"kernel": ghk, "bias": ghb}}
        )
        optimizer.update(model, grads)
        return loss if loss_only else {"loss": loss, "grads": grads}

    step.__name__ = f"gpipe_{fault or 'good'}{'_loss' if loss_only else ''}"
    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "stage": 2})


@pytest.fixture(scope="module")
def recording(mesh):
    """The correct step's recording, as ``shardcheck record`` keeps it."""
    return record_run(_task(), make_step(), mesh=mesh)


def _check(fault, mesh, recording=None, loss_only=False):
    return check_parity(make_step(fault, loss_only), _task(), mesh=mesh, reference=recording)


@require_devices(4)
def test_correct_pipeline_passes_live(mesh):
    for report in (_check("", mesh), _check("", mesh, loss_only=True)):
        assert report.verdict == "PASS", str(report)
        assert PIPELINE not in str(report) and LR_ZERO not in str(report)


@require_devices(4)
def test_correct_pipeline_passes_replayed(mesh, recording):
    report = _check("", mesh, recording)
    assert report.verdict == "PASS", str(report)
    assert PIPELINE not in str(report) and "cannot locate a slice" not in str(report)


def test_pipeline_axis_by_name_or_by_stacked_leaves():
    assert pipeline_axes({"data": 2, "stage": 2}) == ("stage",)
    assert pipeline_axes({"data": 2, "pp": 4}) == ("pp",)
    assert pipeline_axes({"data": 2, "model": 2}) == ()  # a tensor-parallel axis by its name
    stacked = {
        "blocks.kernel": LeafFacts(shape=(2, 8, 8), axes=("layers",)),
        "head.kernel": LeafFacts((8, 2)),
    }
    assert pipeline_axes({"data": 2, "layers": 2}, stacked) == ("layers",)
    split_rows = {"mlp.kernel": LeafFacts(shape=(8, 16), axes=("model",))}  # a layer split, not stacked
    assert pipeline_axes({"data": 2, "model": 2}, split_rows) == ()
    # trial 56: 2 stacked layers whose kernels are split along their hidden dimension over model=2 are a
    # tensor-parallel layer, not a pipeline's stages; stacked and split along the layers, they are stages
    tensor_parallel = {"blocks.mlp.up": LeafFacts(shape=(2, 8, 16), axes=("model",), dims=(2,))}
    assert pipeline_axes({"data": 2, "model": 2}, tensor_parallel) == ()
    staged = {"blocks.mlp.up": LeafFacts(shape=(2, 8, 16), axes=("model",), dims=(0,))}
    assert pipeline_axes({"data": 2, "model": 2}, staged) == ("model",)
    tp = missed_axes_message(0, ["param head.bias"], ("model",), {"data": 2, "model": 2})
    assert "Megatron's g" in tp and PIPELINE not in tp
    pp = missed_axes_message(0, ["param head.bias"], ("stage",), {"data": 2, "stage": 2})
    assert PIPELINE in pp and "jax.lax.psum(g, 'stage')" in pp and "Megatron" not in pp


@require_devices(4)
def test_head_not_psummed_over_the_stages_is_a_pipeline_s_gradient(mesh, recording):
    """Live and replayed: the head's gradient, 0 on stage 0's copies, is said as a pipeline's head gradient not
    psum-ed over 'stage', its zero as the gradient's on the compared copies, not a learning rate's."""
    for report in (_check("head_not_psummed", mesh), _check("head_not_psummed", mesh, recording)):
        assert report.verdict == "FAIL"
        msg = said(report, "wrong_axis_reduction")
        assert "'stage' holds the stages of a pipeline" in msg
        assert "the head's on the last stage" in msg and "jax.lax.psum(g, 'stage')" in msg
        assert "Megatron" not in msg and "tensor-parallel" not in msg
        assert report.localization.stage == "gradients"
        form = report.localization.form
        assert form.kind == "zero"
        assert form.sentence.startswith("zero values on the copies compared")
        assert (
            "the gradient is 0 on some devices and not on the others, not a learning rate of 0"
            in form.sentence
        )
        assert LR_ZERO not in str(report) and "a zero update" not in str(report)


@require_devices(4)
def test_head_not_psummed_with_the_loss_alone_sums_its_copies(mesh, recording):
    """A step that returns its loss alone: the copies' changes sum to the reference's (1/2 of it, the 2 distinct
    copies along 'stage' of the 4), and the zero update of the compared copy is the gradient's."""
    live = _check("head_not_psummed", mesh, loss_only=True)
    assert live.verdict == "FAIL" and live.localization.stage == "replicas"
    form = live.localization.form
    assert "the copies' changes sum to the reference's (their mean is 1/2 of it" in form.sentence
    assert "a sum over 'stage' missed" in form.sentence
    assert form.factor == pytest.approx(0.5, rel=1e-3)
    text = str(live)
    assert "0.5 x the reference's" not in text and LR_ZERO not in text
    assert "zero on the copies compared" in said(live, "localized")
    replayed = _check("head_not_psummed", mesh, recording, loss_only=True)
    assert replayed.verdict == "FAIL" and LR_ZERO not in str(replayed)
    assert PIPELINE in said(replayed, "wrong_axis_reduction")


@require_devices(4)
def test_activations_sent_to_the_wrong_stage_are_a_pipeline_s_forward(mesh):
    report = _check("perm_reversed", mesh)
    assert report.verdict == "FAIL" and report.localization.stage == "forward"
    text = str(report)
    assert "'stage' holds the stages of a pipeline, e.g. the activations sent to the wrong stage" in text
    assert "jax.lax.ppermute over 'stage'" in text and "the bubble's steps not masked" in text
    assert "counts 2 times" not in text and "row-parallel" not in text


@require_devices(4)
def test_a_replay_locates_the_stage_slice_as_live(mesh, recording):
    """A stop_gradient on the activations sent between stages (stage 0 never trains): the replay's recorded
    samples locate slice 0, as the live check does (stage 0's gradient not averaged over 'data' likewise, next)."""
    live = _check("stop_grad", mesh)
    replayed = _check("stop_grad", mesh, recording)
    for report in (live, replayed):
        assert report.verdict == "FAIL" and report.localization.stage == "gradients"
        form = report.localization.form
        assert form.kind == "slices"
        assert form.sentence.startswith(
            "only slice 0 of the leading axis (size 2: layers stacked by nnx.scan"
        )
        assert "the candidate's gradient there is exactly 0 (zeroed, or left out of the step's gradient)" in (
            form.sentence
        )
        assert "no simple form" not in str(report) and "-0 " not in str(report)
    assert "at their recorded samples (16 in all); every other slice's samples match" in (
        replayed.localization.form.sentence
    )


@require_devices(4)
def test_a_replay_locates_a_stage_slice_not_averaged(mesh, recording):
    other = _check("no_pmean_stage0", mesh, recording).localization.form
    assert other.kind == "slices"
    assert other.sentence.startswith("only slice 0 of the leading axis")
    assert other.sentence.endswith("the candidate's gradient there differs")


def _grad(path, shape, slices, spread=(-0.0, 1.0)):
    return LeafError(0, "grad", path, 0.04, 1.0, 1e-5, False, 1.0, None, spread, shape, 8, slices=slices)


def test_samples_that_cannot_locate_a_slice_say_so():
    """The form the records allow: a slice is located where each slice differs or matches at some leaf's samples
    (a leaf whose samples all lie in one slice says nothing of the others); where no sample falls in a slice, no
    simple form, said with the pointer to the live check (and a ratio of -0 printed as 0)."""
    kernel, bias = ("k", (2, 8, 8)), ("b", (2, 8))
    located = form_from_leaves(
        [
            _grad(*kernel, ((8, 0.04, True), (0, 0.0, False))),
            _grad(*bias, ((3, 0.02, True), (5, 0.0, False))),
        ],
        update=False,
    )
    assert located.kind == "slices" and located.sentence.startswith("only slice 0 of the leading axis")
    assert "at their recorded samples (16 in all)" in located.sentence
    assert "the candidate's gradient there is exactly 0" in located.sentence
    unsampled = form_from_leaves(
        [
            _grad(*kernel, ((8, 0.04, True), (0, 0.0, False))),
            _grad(*bias, ((8, 0.02, True), (0, 0.0, False))),
        ],
        update=False,
    )
    assert unsampled.kind == "none"
    assert "ratio runs from 0 to 1" in unsampled.sentence and "-0" not in unsampled.sentence
    assert (
        "the replay's recorded samples cannot locate a slice here: the live check (verify without --against)"
        in (unsampled.sentence)
    )
    everywhere = form_from_leaves(  # both slices differ: no slice to locate, and the leaves are stacked
        [
            _grad(*kernel, ((4, 0.04, True), (4, 0.03, False))),
            _grad(*bias, ((3, 0.02, True), (5, 0.02, False))),
        ],
        update=False,
    )
    assert everywhere.kind == "none" and "cannot locate a slice" in everywhere.sentence
    flat = form_from_leaves([_grad("k", (8, 8), None), _grad("b", (8,), None)], update=False)
    assert flat.kind == "none" and "cannot locate" not in flat.sentence  # not stacked: no slice to locate
