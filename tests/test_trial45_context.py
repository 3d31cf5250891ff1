"""Issue #36, trial 45 (a context-parallel decoder LM: the user's ``jax.shard_map`` step places the batch
``P('data', 'seq')``, each device a block of positions, keys and values all-gathered over 'seq'; a ``(loss_sum,
count)`` loss over right-padded rows): what the report said of it.

- A loss each device divides by its own token count (a mean of per-device means) read ``forward_differs``, "the
  forward pass computes another function of the parameters": the per-shard-normalization hypothesis split the
  batch's rows only. It now splits the tokens too (rows over 'data' x blocks of axis 1 over 'seq') and names
  ``normalization``: "each of the 4 shards (data x seq blocks of tokens) divided its loss sum by its own token
  count", from the loss the step returns (the gradients divided after the all-gather's transpose brought each
  device the other blocks' terms are no gradient of one loss) or from the whole step (the loss divided before the
  gradient).
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

VOCAB, DIM, T, B = 16, 8, 8, 8
AXES = ("data", "seq")


class LM(nnx.Module):
    """One causal attention layer over a learned position embedding, read by global position."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(jax.random.key(1), (T, DIM)) * 0.1)
        self.q, self.k, self.v = (nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs) for _ in range(3))
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions=None, gather=None):
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = self.embed(tokens) + self.pos[...][positions]
        q, k, v = self.q(x), self.k(x), self.v(x)
        k_pos = positions
        if gather is not None:  # keys and values of every block, by global position
            k, v = (jax.lax.all_gather(a, gather, axis=1, tiled=True) for a in (k, v))
            k_pos = jnp.arange(k.shape[1])
        s = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(DIM)
        s = jnp.where(positions[:, None] >= k_pos[None, :], s, -1e30)
        return self.head(x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v))


def loss_fn(model, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["tokens"]), batch["targets"])
    return jnp.sum(ce * batch["weights"]), jnp.sum(batch["weights"])


def _task(pad: bool = True) -> Task:
    rng = np.random.default_rng(45)
    batches = []
    for _ in range(3):
        toks = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
        lengths = rng.integers(2, T + 1, (B,))  # right-padded rows: the later blocks hold more padding
        w = (
            (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
            if pad
            else np.ones((B, T), np.float32)
        )
        batches.append({"tokens": toks[:, :T], "targets": toks[:, 1:], "weights": w})
    tx = optax.adamw(optax.linear_schedule(1e-3, 1e-2, 2), weight_decay=0.1)
    return Task(model=LM, optimizer=tx, loss_fn=loss_fn, batches=batches)


def make_step(fault: str = ""):
    """The user's context-parallel step; ``fault``: ``"per_shard_mean"`` (each device's gradients and loss divided
    by its own count, then averaged), ``"loss_divided"`` (each device's loss divided by its own count before the
    gradient, then averaged; ``"loss_divided_seq_sum"``: psum-ed over 'seq'), ``"no_gather"`` (attention within the
    block), ``"forgot_seq"`` (gradients reduced over 'data' only), ``"grad_seq_sum"`` (as ``per_shard_mean``, the gradients psum-ed over 'seq')."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)

        def body(leaves, batch):
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            gdef, params = nnx.split(model, nnx.Param)
            params = jax.lax.pcast(params, AXES, to="varying")
            block = batch["tokens"].shape[1]
            positions = jax.lax.axis_index("seq") * block + jnp.arange(block)

            def local(p):
                logits = nnx.merge(gdef, p)(
                    batch["tokens"], positions, None if fault == "no_gather" else "seq"
                )
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
                total, count = jnp.sum(ce * batch["weights"]), jnp.sum(batch["weights"])
                return (total / count if fault.startswith("loss_divided") else total), count

            (lsum, cnt), grads = jax.value_and_grad(local, has_aux=True)(params)
            if fault in ("per_shard_mean", "grad_seq_sum"):
                grads = jax.tree.map(lambda g: g / cnt, grads)
                grads = (
                    jax.lax.pmean(jax.lax.psum(grads, "seq"), "data") if fault == "grad_seq_sum" else grads
                )
                loss = jax.lax.pmean(lsum / cnt, AXES)
                grads = grads if fault == "grad_seq_sum" else jax.lax.pmean(grads, AXES)
            elif fault == "forgot_seq":  # reduced over 'data' only
                total = jax.lax.psum(cnt, AXES)
                grads = jax.tree.map(lambda g: g * 2 / total, jax.lax.psum(grads, "data"))
                loss = jax.lax.psum(lsum, AXES) / total
            elif fault == "loss_divided":
                grads, loss = jax.lax.pmean(grads, AXES), jax.lax.pmean(lsum, AXES)
            elif fault == "loss_divided_seq_sum":
                grads, loss = jax.lax.pmean(jax.lax.psum(grads, "seq"), "data"), jax.lax.pmean(lsum, AXES)
            else:
                total = jax.lax.psum(cnt, AXES)
                grads = jax.tree.map(lambda g: g / total, jax.lax.psum(grads, AXES))
                loss = jax.lax.psum(lsum, AXES) / total
            optimizer.update(model, grads)
            return loss, grads, jax.tree.leaves(nnx.state((model, optimizer)))

        specs = (P(), P("data", "seq"))
        vma = fault != "forgot_seq"
        mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P(), P()), check_vma=vma)
        loss, grads, leaves = jax.jit(mapped)(leaves, batch)
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, leaves))
        return {"loss": loss, "grads": grads}

    from shardcheck import Candidate

    return Candidate(name=f"cp_{fault or 'good'}", step=step, pass_mesh=True)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "seq": 2})


def _said(report, code):
    return next((d.message for d in report.diagnoses if d.code == code), "")


@require_devices(4)
def test_correct_context_parallel_step_passes(mesh):
    report = check_parity(make_step(), _task(), mesh=mesh, steps=2)
    assert report.verdict == "PASS", str(report)


@require_devices(4)
@pytest.mark.parametrize("fault", ["per_shard_mean", "loss_divided"])
def test_per_device_mean_is_named_over_the_token_blocks(mesh, fault):
    report = check_parity(make_step(fault), _task(), mesh=mesh, steps=2)
    assert report.verdict == "FAIL"
    message = _said(report, "normalization")
    assert "each of the 4 shards (data x seq blocks of tokens) divided its loss sum by its own" in message, (
        str(report)
    )
    assert "forward_differs" not in {d.code for d in report.diagnoses}


@require_devices(4)
def test_per_block_means_summed_over_seq(mesh):
    report = check_parity(make_step("grad_seq_sum"), _task(), mesh=mesh, steps=2)
    message = _said(report, "normalization")
    assert "each of the 4 shards (data x seq blocks of tokens)" in message, str(report)
    report = check_parity(make_step("loss_divided_seq_sum"), _task(), mesh=mesh, steps=2)
    message = _said(report, "normalization")
    assert "the returned gradients are 2 x the mean of per-shard means" in message, str(report)
    assert "the per-block means were summed over 'seq' (a psum) where their mean" in message
    assert "'data' only" not in message


def test_gradient_offset_of_c_times_the_parameter_reads_as_an_l2_term():
    from shardcheck.parity.diagnosis.form import fit_form

    rng = np.random.default_rng(0)
    ref = {"norm.scale": rng.normal(size=(6,)), "head.bias": rng.normal(size=(4,))}
    ones = {p: np.ones_like(g) for p, g in ref.items()}
    varied = {p: rng.uniform(0.5, 2.0, size=g.shape) for p, g in ref.items()}
    for params, offset_too in ((ones, True), (varied, False)):
        cand = {p: g + 0.1 * params[p] for p, g in ref.items()}
        form = fit_form({}, ref, cand, update=False, params=params)
        assert form.sentence.startswith(
            "an L2 / weight-decay term c x the parameter added to the gradients, c = 0.1"
        )
        assert form.coefficient == pytest.approx(0.1)
        assert ("it is also a constant offset +0.1" in form.sentence) == offset_too
    # a constant offset on parameters of many values is no L2 term
    form = fit_form({}, ref, {p: g + 0.1 for p, g in ref.items()}, update=False, params=varied)
    assert form.sentence.startswith("a constant offset +0.1 on every element") and "L2" not in form.sentence


def test_header_says_the_built_in_placement_where_a_candidate_is_checked():
    from argparse import Namespace

    from shardcheck.cli.verify import _placement_text

    mesh = {"data": 2, "seq": 2}
    own = _placement_text(Namespace(mesh=mesh, candidate="cp_lm.py:step"), _task())
    assert own == (
        " (the built-in steps' placement: batch over data; replicated over seq; a step of its own may split it "
        "otherwise)"
    )
    assert (
        _placement_text(Namespace(mesh=mesh, candidate=None), _task())
        == " (batch over data; replicated over seq)"
    )
    assert _placement_text(Namespace(mesh={"data": 4}, candidate="x.py:step"), _task()) == ""


def test_a_factor_of_a_sequence_axis_reads_as_per_block_means_summed():
    from shardcheck.parity.diagnosis.topology import model_axis_factor, sequence_axes

    def close(a, b):
        return abs(a - b) <= 1e-3 * abs(b)

    assert sequence_axes({"data": 2, "seq": 2}) == ("seq",)
    assert sequence_axes({"data": 2, "CP": 4}) == ("CP",)
    assert sequence_axes({"data": 2, "model": 2}) == ()
    assert sequence_axes({"data": 2, "seq": 1}) == ()
    code, phrase = model_axis_factor(4.0, 1, {"data": 1, "seq": 4}, close)
    assert code == "summed"
    assert phrase.startswith("x4: the per-block means summed over 'seq' (a psum) where their mean")
    assert "splits the model, not the batch" not in phrase and "only:" not in phrase
    _, phrase = model_axis_factor(2.0, 2, {"data": 2, "seq": 2}, close)
    assert phrase.startswith("x2: the per-block means summed over 'seq'")
    assert (
        "or a sum over the 2 batch shards for their mean" in phrase and "batch axes 'data' only" not in phrase
    )
    _, phrase = model_axis_factor(4.0, 1, {"data": 1, "model": 4}, close)  # a model axis: as it was
    assert "which splits the model, not the batch" in phrase


@require_devices(4)
def test_grad_seq_sum_without_padding_is_summed_over_seq(mesh):
    report = check_parity(make_step("grad_seq_sum"), _task(pad=False), mesh=mesh, steps=2)
    message = _said(report, "summed")
    assert "gradients are 2 x the reference's: x2: the per-block means summed over 'seq'" in message, str(
        report
    )
    assert "'data' only" not in message


@require_devices(4)
def test_forward_and_replica_readings_of_a_sequence_axis(mesh):
    report = check_parity(make_step("no_gather"), _task(pad=False), mesh=mesh, steps=2)
    message = _said(report, "forward_differs")
    assert "a mesh that splits the tokens over ('seq',)" in message, str(report)
    assert "by its name 'seq' splits the sequence (context parallelism" in message
    assert "keys and values not gathered over 'seq'" in message and "Megatron" not in message
    assert "row-parallel" not in message
    report = check_parity(make_step("forgot_seq"), _task(pad=False), mesh=mesh, steps=2)
    message = _said(report, "wrong_axis_reduction")
    assert (
        "differ along mesh axis 'seq' and agree along 'data': by its name 'seq' splits the tokens, not the"
        in (message)
    ), str(report)
    assert "the gradients were not psum-ed over 'seq'" in message and "Megatron" not in message
