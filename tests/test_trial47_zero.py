"""Issue #36, trial 47 (ZeRO-1/2 by hand): the readings of a step that updates each device's slice of the
parameters and all-gathers them.

1. The updated slices of some leaves not all-gathered (each device keeps its own slice updated, the rest stale),
   with gradients that match, read "the gradient is 0 on some devices and not on the others ... a replicated leaf
   used on one pipeline stage" on mesh data=4: a gradient's reading beside "the gradients: matches", and a
   pipeline's example on no pipeline axis. It is now the update's, applied on some devices or slices only, and the
   fix named is the all_gather of the updated slices.

2. A decay applied again after the gather read live "no simple form: no zero update, sign flip, constant factor or
   decay term fits the 19 leaves" (2 of 1024 elements whose gradient is at rounding level, lr-sized under Adam, in
   the decay's fit) and replayed "the candidate applies it and the reference does not" (the reference applies it
   too): now both say the decay applied twice, c = the task's own weight decay.
3. Adam's count stepped twice read "a constant factor 0.7441 ...: one scale of the whole update from equal
   gradients (a learning rate or its schedule)" beside "it sets no learning rate": now the bias correction's.
4. A clip by each slice's own norm was named ``local_clip_norm`` replayed and ``localized`` live ("opt_state
   1.0.mu.blocks.0.down.kernel has no constant factor": a leaf split between two devices' slices carries two
   factors): live now names it too.

5. The step that returns its all_gather(tiled=True) output with out_specs P() under check_vma raised JAX's
   replication error, read "a value computed per device and never reduced over 'data' (a loss or gradient without
   its pmean or psum over 'data')": now the all-gather's reading (check_vma=False, or reduce/pcast).

The task: an MLP (Linear(8, 16), LayerNorm, tanh, Linear(16, 2)), MSE, chain(clip_by_global_norm(1.0),
adamw(1e-2, weight_decay=0.01)); the step flattens every leaf into one buffer padded to a multiple of 4, keeps
Adam's moments split over 'data', psum_scatters the gradients (/4), clips by the global norm (the psum of each
slice's squared norm), runs adamw on each device's slice and all_gathers the slices (4 fake CPU devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, said
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardcheck
from shardcheck import check_parity, make_mesh, record_run
from shardcheck.parity.diagnosis.form import fit_form
from shardcheck.parity.harness.candidates import SAME_LINES_KEPT, _traced_hint, jax_text
from shardcheck.parity.harness.optimizer_rerun import task_decay
from shardcheck.parity.report import CandidateError

LR, WD, MAXNORM, S = 1e-2, 0.01, 1.0, 4
PIPELINE = "pipeline stage"
LR_ZERO = "a learning rate of 0 at this step"
GATHER = "jax.lax.all_gather(new_slice, 'data', tiled=True)"


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.down = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.ln(self.up(x))))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task():
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32)}
        for _ in range(2)
    ]
    tx = optax.chain(optax.clip_by_global_norm(MAXNORM), optax.adamw(LR, weight_decay=WD))
    return shardcheck.Task(
        model=lambda: MLP(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=batches, name="zero"
    )


def _flat(leaves, sizes, padded):
    return jnp.concatenate(
        [jnp.pad(a.reshape(-1), (0, p - n)) for a, n, p in zip(leaves, sizes, padded, strict=True)]
    )


def _unflat(buf, shapes, sizes, padded):
    out, off = [], 0
    for shape, n, p in zip(shapes, sizes, padded, strict=True):
        out.append(buf[off : off + n].reshape(shape))
        off += p
    return out


def _body(fault, k, mask, local_loss):
    """The shard_map body: the replicated flat parameters, this device's moments and batch -> (loss, the gathered
    parameters, the moments, the count, the gathered gradients)."""
    inner = optax.adamw(LR, weight_decay=WD)

    def body(pflat, mu, nu, count, batch):
        i = jax.lax.axis_index("data")
        loss, g = jax.value_and_grad(local_loss)(jax.lax.pcast(pflat, "data", to="varying"), batch)
        gs = jax.lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True) / S
        sq = jnp.sum(gs * gs)
        gnorm = jnp.sqrt(sq if fault == "local_norm" else jax.lax.psum(sq, "data"))  # local_norm: no psum
        gc = jnp.where(gnorm < MAXNORM, gs, gs / gnorm * MAXNORM)
        p_sl = jax.lax.dynamic_slice(pflat, (i * k,), (k,))
        c = count + 1 if fault == "count_twice" else count  # Adam's count stepped twice
        state = (optax.ScaleByAdamState(count=c, mu=mu, nu=nu), optax.EmptyState(), optax.EmptyState())
        upd, new_state = inner.update(gc, state, p_sl)
        new_sl = p_sl + upd
        full = jax.lax.all_gather(new_sl, "data", tiled=True)
        if fault == "nogather_small":  # the biases' and LayerNorm's updated slices kept on their own device
            full = jnp.where(mask, jax.lax.dynamic_update_slice(pflat, new_sl, (i * k,)), full)
        if fault == "wd_twice":  # the decay applied again after the gather (adamw already decayed once)
            full = full - LR * WD * full
        a = new_state[0]
        return (
            jax.lax.pmean(loss, "data"),
            full,
            a.mu,
            a.nu,
            a.count,
            jax.lax.all_gather(gs, "data", tiled=True),
        )

    return body


def make_step(fault=""):
    """The user's ZeRO step; ``fault``: ``"nogather_small"`` (the updated slices of the biases and the LayerNorm
    not all-gathered: each device keeps its own slice updated, the rest stale), ``"wd_twice"`` (the decay applied
    again after the gather), ``"count_twice"`` (Adam's count stepped twice), ``"local_norm"`` (the clip's norm
    from each device's slice only), ``"gather_vma"`` (the all-gathered values returned with out_specs P() and
    check_vma on: JAX refuses it)."""

    def step(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        leaves, treedef = jax.tree.flatten(params)
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        shapes = [a.shape for a in leaves]
        sizes = [int(np.prod(s)) for s in shapes]
        padded = [-(-n // S) * S for n in sizes]
        adam = nnx.state(optimizer)["opt_state"][1][0]
        split = NamedSharding(mesh, P("data"))
        mu, nu = (jax.device_put(_flat(jax.tree.leaves(adam[m]), sizes, padded), split) for m in ("mu", "nu"))
        small = [("bias" in n or "scale" in n) for n in names]
        mask = jnp.concatenate([jnp.full((p,), s) for s, p in zip(small, padded, strict=True)])

        def local_loss(pf, batch):
            params = jax.tree.unflatten(treedef, _unflat(pf, shapes, sizes, padded))
            return _loss(nnx.merge(graphdef, params, rest), batch)

        body = _body(fault, sum(padded) // S, mask, local_loss)
        specs = (P(), P("data"), P("data"), P(), P("data"))
        out_specs = (P(), P(), P("data"), P("data"), P(), P())
        vma = fault == "gather_vma"  # the gathered values returned with out_specs P() under check_vma
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=vma))
        batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, split)
        loss, full, mu, nu, count, gfull = fn(_flat(leaves, sizes, padded), mu, nu, adam["count"][...], batch)
        nnx.update(model, jax.tree.unflatten(treedef, _unflat(full, shapes, sizes, padded)))
        for m, buf in (("mu", mu), ("nu", nu)):
            adam[m] = jax.tree.unflatten(jax.tree.structure(adam[m]), _unflat(buf, shapes, sizes, padded))
        adam["count"] = count
        ost = nnx.state(optimizer)
        ost["opt_state"][1][0] = adam
        ost["step"] = ost["step"][...] + 1
        nnx.update(optimizer, ost)
        return {"loss": loss, "grads": jax.tree.unflatten(treedef, _unflat(gfull, shapes, sizes, padded))}

    step.__name__ = f"zero_{fault or 'good'}"
    return step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": S})


@pytest.fixture(scope="module")
def recording(mesh):
    """The correct step's recording, as ``shardcheck record`` keeps it."""
    return record_run(_task(), make_step(), mesh=mesh)


def _check(fault, mesh, recording=None):
    return check_parity(make_step(fault), _task(), mesh=mesh, reference=recording)


@require_devices(4)
def test_correct_zero_step_passes_live_and_replayed(mesh, recording):
    for report in (_check("", mesh), _check("", mesh, recording)):
        assert report.verdict == "PASS", str(report)
        assert GATHER not in str(report)


@require_devices(4)
def test_slices_not_gathered_are_the_update_s_not_the_gradient_s(mesh, recording):
    """Live and replayed: the gradients match and the copies differ along 'data': the zero on the compared copies
    is an update applied on some devices or slices only (all_gather named), never a gradient's or a pipeline's."""
    live, replayed = _check("nogather_small", mesh), _check("nogather_small", mesh, recording)
    for report in (live, replayed):
        assert report.verdict == "FAIL"
        text = str(report)
        assert "the gradients: matches" in text
        msg = said(report, "localized")
        assert "zero on the copies compared" in msg
        assert "and the gradients match: the update was applied on some devices or slices only" in msg
        assert GATHER in msg
        assert (
            "the gradient is 0 on some devices" not in text and PIPELINE not in text and LR_ZERO not in text
        )
    form = live.localization.form
    assert form.kind == "replicas" and form.factor == pytest.approx(1 / S, rel=1e-3)
    assert (
        "(their mean is 1/4 of it, within 0.25..0.25): each device kept its own shard's part" in form.sentence
    )
    assert "not a gradient's sum over 'data' but the update's" in form.sentence and GATHER in form.sentence


@require_devices(4)
def test_a_decay_applied_twice_is_said_so_live_and_replayed(mesh, recording):
    for report in (_check("wd_twice", mesh), _check("wd_twice", mesh, recording)):
        assert report.verdict == "FAIL" and report.localization.stage == "optimizer"
        form = report.localization.form
        assert form.kind == "decay" and form.coefficient == pytest.approx(WD, rel=0.02)
        assert "the candidate applies it twice (c = the task's own weight decay, 0.01)" in form.sentence
        assert "the reference does not" not in str(report) and "no simple form" not in form.sentence
        # the paragraph below the table says the form once (the localized finding repeated it word for word)
        assert report.diagnosis.count("a decoupled weight decay term") == 1


def test_the_task_s_own_decay_and_a_decay_fit_past_rounding_level_elements():
    """The task's optimizer's own c*lr (a probe from zero gradients); a decay term fitted on the elements whose
    gradient is not at rounding level (one such element moved by an lr-sized amount, as under Adam)."""
    tx = optax.chain(optax.clip_by_global_norm(MAXNORM), optax.adamw(LR, weight_decay=WD))
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    assert task_decay(tx, params) == pytest.approx(LR * WD, rel=1e-4)
    assert task_decay(optax.adam(LR), params) is None  # no decay: nothing moves from zero gradients
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(size=(16, 16))}
    ref = {"w": before["w"] + rng.normal(size=(16, 16)) * 1e-3}
    cand = {"w": ref["w"] - LR * WD * before["w"]}
    cand["w"][0, 0] += LR  # an element whose gradient is at rounding level
    quiet = {"w": np.zeros((16, 16), bool)}
    quiet["w"][0, 0] = True
    assert fit_form(before, ref, cand, lr=LR).kind != "decay"
    twice = fit_form(before, ref, cand, lr=LR, quiet=quiet, task_decay=LR * WD)
    assert twice.kind == "decay" and twice.coefficient == pytest.approx(WD, rel=1e-3)
    assert "applies it twice (c = the task's own weight decay, 0.01)" in twice.sentence
    once = fit_form(before, ref, cand, lr=LR, quiet=quiet)  # the task's decay unknown: the one-sided reading
    assert once.kind == "decay" and "the candidate applies it and the reference does not" in once.sentence


@require_devices(4)
def test_a_count_stepped_twice_is_the_bias_correction_s_factor(mesh, recording):
    for report in (_check("count_twice", mesh), _check("count_twice", mesh, recording)):
        assert report.verdict == "FAIL"
        form = report.localization.form
        assert form.kind == "factor" and 0 < form.factor < 1
        assert "one scale of the whole update from Adam's bias correction at another count (its count" in (
            form.sentence
        )
        assert "a learning rate or its schedule" not in str(report)


@require_devices(4)
def test_a_clip_by_each_slice_s_own_norm_is_named_live_and_replayed(mesh, recording):
    for report in (_check("local_norm", mesh), _check("local_norm", mesh, recording)):
        assert report.verdict == "FAIL"
        codes = [d.code for d in report.diagnoses]
        assert "local_clip_norm" in codes, codes
        assert "psum the squared norms" in said(report, "local_clip_norm")


def test_jax_text_cuts_a_run_of_lines_alike_and_keeps_the_rest():
    bullets = [
        f"  * out_specs[1]['layer{i}']['kernel'] is P() which implies it is replicated" for i in range(50)
    ]
    err = ValueError(
        "\n".join(["shard_map applied to the function 'body' was given out_specs ...", *bullets, "end"])
    )
    lines = jax_text(err).splitlines()
    assert lines == [
        "shard_map applied to the function 'body' was given out_specs ...",
        *bullets[:SAME_LINES_KEPT],
        f"... and {50 - SAME_LINES_KEPT} more lines like these",
        "end",
    ]
    short = ValueError("\n".join(bullets[:4]))  # four alike: one more than kept is said as it is
    assert jax_text(short) == str(short)


@require_devices(4)
def test_a_gathered_value_returned_as_replicated_under_check_vma_is_the_all_gather_s():
    with pytest.raises(CandidateError) as raised:
        check_parity(make_step("gather_vma"), _task(), mesh=make_mesh({"data": S}), steps=1)
    hint = raised.value.hint
    # JAX's own text after the hint, with its one bullet per leaf cut to three (trial 58 D: about 50 of them)
    said = str(raised.value)
    bullets = [line for line in said.splitlines() if "which implies that the corresponding output" in line]
    assert 1 <= len(bullets) <= SAME_LINES_KEPT, said
    assert "more lines like these" in said or len(bullets) < SAME_LINES_KEPT
    assert hint.startswith(
        "the step's jax.shard_map returns as replicated over 'data' (out_specs[1] P()) a value "
        "its function builds with jax.lax.all_gather"
    ), hint
    assert "return it with check_vma=False" in hint
    # an error of a function that gathers nothing keeps the unreduced reading
    err = ValueError(
        "shard_map applied to the function 'nothing_here' was given out_specs which require replication which "
        "can't be statically inferred given the mesh:\n\nout_specs[0] is P() which implies that the corresponding "
        "output value is replicated across mesh axis 'data', but could not infer replication over any axes"
    )
    assert _traced_hint(err).startswith(
        "the step's jax.shard_map returns as replicated over 'data' (out_specs[0] P()) a value computed per device"
    )
