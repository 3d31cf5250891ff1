"""Gradient accumulation with optax.MultiSteps (``docs/reduction_cases.md`` C9) against the full-batch step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardcheck
from shardcheck import (
    accumulated_sgd_step,
    check_parity,
    make_accumulation_optimizer,
    make_model,
    make_tx,
    mse_loss,
)
from shardcheck.losses import mse_batch_loss
from shardcheck.steps.accumulation import accumulation_candidate

# Fixture L: full batch loss 7.5; after one SGD(0.1) step from zero: kernel [[0.6], [0.25]], bias [0.5].
XL = np.array([[1, 0], [0, 1], [1, 1], [2, 0]], np.float32)
YL = np.array([[1], [2], [3], [4]], np.float32)
RNG = np.random.default_rng(3)
X = RNG.normal(size=(48, 3)).astype(np.float32)
Y = RNG.normal(size=(48, 2)).astype(np.float32)
BATCHES = [(X[i * 12 : (i + 1) * 12], Y[i * 12 : (i + 1) * 12]) for i in range(4)]
TX = {"sgd": make_tx("sgd", 0.1), "momentum": make_tx("momentum", 0.05), "adam": make_tx("adam", 0.01)}


def zero_linear():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((2, 1))
    model.bias[...] = jnp.zeros((1,))
    return model


def test_c9_two_micro_steps_give_the_baseline():
    """The two S=2 shard gradients of Fixture L fed as micro-steps: no move, then exactly the baseline step."""
    model = zero_linear()
    optimizer = make_accumulation_optimizer(model, optax.sgd(0.1), 2)
    for i, (a, b) in enumerate(((0, 2), (2, 4))):
        loss, grads = nnx.value_and_grad(mse_loss)(model, XL[a:b], YL[a:b])
        np.testing.assert_allclose(loss, [2.5, 12.5][i])
        optimizer.update(model, grads)
        if i == 0:
            np.testing.assert_array_equal(model.kernel[...], [[0.0], [0.0]])
            np.testing.assert_array_equal(model.bias[...], [0.0])
    np.testing.assert_allclose(model.kernel[...], [[0.6], [0.25]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)
    assert int(optimizer.step[...]) == 2  # NNX counts micro-steps
    assert int(optimizer.opt_state.gradient_step[...]) == 1  # MultiSteps counts applied updates


def test_c9_a_sum_instead_of_a_mean_doubles_the_step():
    model = zero_linear()
    optimizer = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), 2, use_grad_mean=False), wrt=nnx.Param)
    for a, b in ((0, 2), (2, 4)):
        optimizer.update(model, nnx.grad(mse_loss)(model, XL[a:b], YL[a:b]))
    np.testing.assert_allclose(model.kernel[...], [[1.2], [0.5]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [1.0], rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulated_step_matches_the_full_batch_step_on_fixture_l(k):
    model = zero_linear()
    optimizer = make_accumulation_optimizer(model, optax.sgd(0.1), k)
    loss = accumulated_sgd_step(model, optimizer, XL, YL, k)
    np.testing.assert_allclose(loss, 7.5, rtol=1e-6)
    np.testing.assert_allclose(model.kernel[...], [[0.6], [0.25]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)
    assert int(optimizer.step[...]) == k and int(optimizer.opt_state.mini_step[...]) == 0


def test_the_accumulator_is_a_parameter_sized_float32_buffer_emptied_after_each_update():
    model = make_model("mlp", 3, 2, hidden=8)
    optimizer = make_accumulation_optimizer(model, optax.adam(0.01), 3)
    acc = optimizer.opt_state.acc_grads
    params = nnx.state(model, nnx.Param)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), acc) == jax.tree.map(
        lambda a: (a.shape, jnp.dtype(jnp.float32)), params
    )
    accumulated_sgd_step(model, optimizer, X[:12], Y[:12], 3)
    assert all(float(jnp.max(jnp.abs(a))) == 0.0 for a in jax.tree.leaves(optimizer.opt_state.acc_grads))


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_accumulation_candidate_passes_parity_and_checks_its_counters(opt):
    model = make_model("mlp", 3, 2, hidden=8, seed=2)
    optimizer = nnx.Optimizer(model, TX[opt], wrt=nnx.Param)
    report = check_parity(accumulation_candidate(mse_batch_loss, 4), model, optimizer, BATCHES)
    assert report.ok, str(report)
    last = report.steps[-1]
    assert last.step_count == 4 and last.candidate_step_count == 4  # gradient_step vs the reference's step
    extra = {e.path: e for e in last.leaves if e.path in ("step (NNX micro-steps)", "mini_step")}
    assert extra["step (NNX micro-steps)"].ok and extra["mini_step"].ok
    assert any(e.path.startswith("acc_grads.") for e in last.leaves)
    if opt == "adam":  # the inner Adam state is compared with the reference's
        assert {"0.mu.out.kernel", "0.nu.out.kernel", "0.count"} <= {e.path for e in last.leaves}


def test_accumulation_from_a_trained_optimizer_state():
    model = make_model("linear", 3, 2, seed=2)
    optimizer = nnx.Optimizer(model, TX["adam"], wrt=nnx.Param)
    for x, y in BATCHES[:2]:
        shardcheck.sgd_step(model, optimizer, x, y)
    report = check_parity("accumulation", model, optimizer, BATCHES[2:], num_shards=2)
    assert report.ok, str(report)
    assert report.steps[-1].step_count == 4 and report.steps[-1].candidate_step_count == 4


def test_summing_accumulator_is_diagnosed():
    def make_summing(model, optimizer):
        return nnx.Optimizer(model, optax.MultiSteps(optimizer.tx, 4, use_grad_mean=False), wrt=nnx.Param)

    candidate = dataclasses.replace(accumulation_candidate(mse_batch_loss, 4), make_optimizer=make_summing)
    model = make_model("linear", 3, 2, seed=2)
    optimizer = nnx.Optimizer(model, TX["momentum"], wrt=nnx.Param)
    report = check_parity(candidate, model, optimizer, BATCHES[:2])
    assert report.codes[0] == "summed" and "x4" in report.diagnosis


def test_bad_accumulation_inputs_are_refused_before_any_change():
    model = zero_linear()
    plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="accumulated_sgd_step: optimizer must wrap optax.MultiSteps"):
        accumulated_sgd_step(model, plain, XL, YL, 2)
    two = make_accumulation_optimizer(model, optax.sgd(0.1), 2)
    with pytest.raises(ValueError, match="every_k_schedule=2 micro-steps but num_micro_batches=4"):
        accumulated_sgd_step(model, two, XL, YL, 4)
    with pytest.raises(ValueError, match="batch size 4 is not divisible by num_micro_batches=3"):
        accumulated_sgd_step(model, make_accumulation_optimizer(model, optax.sgd(0.1), 3), XL, YL, 3)
    two.update(model, nnx.grad(mse_loss)(model, XL[:2], YL[:2]))  # now mid-cycle
    with pytest.raises(ValueError, match="in the middle of an accumulation cycle"):
        accumulated_sgd_step(model, two, XL, YL, 2)
    with pytest.raises(TypeError, match="num_micro_batches must be a positive int"):
        make_accumulation_optimizer(model, optax.sgd(0.1), 2.0)
    np.testing.assert_array_equal(model.bias[...], [0.0])


# ---------------------------------------------------------------- a scan-over-layers model (#34) and reuse (#35)
class _Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(self.norm(h))))


class _ScannedStack(nnx.Module):
    """Stacked layers as the Flax NNX transforms guide builds them: ``nnx.vmap`` creates the blocks (their
    parameters gain a leading layer axis), ``nnx.scan`` applies them (a transform of the model's own, inside the
    step's trace)."""

    def __init__(self, d_in: int, width: int, d_out: int, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Linear(d_in, width, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return _Block(width, rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(width, d_out, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return block(h)

        return self.head(forward(self.embed(x), self.blocks))


def _masked_loss(model, batch):
    """``(loss_sum, weight)``: the squared error summed over the rows the mask keeps, and their count."""
    err = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])


def _mean_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _scan_task(loss_fn, optimizer=None):
    rng = np.random.default_rng(5)
    batches = [
        {
            "x": rng.normal(size=(8, 3)).astype(np.float32),
            "y": rng.normal(size=(8, 2)).astype(np.float32),
            "mask": (rng.uniform(size=8) < 0.7).astype(np.float32),
        }
        for _ in range(2)
    ]
    return shardcheck.Task(
        model=lambda: _ScannedStack(3, 8, 2, 3, nnx.Rngs(0)),
        optimizer=optimizer or optax.sgd(0.1),
        loss_fn=loss_fn,
        batches=batches,
        name="scanned",
    )


def _param_ratios(report, step: int = 0) -> dict[str, float]:
    return {e.path: e.ratio for e in report.steps[step].leaves if e.kind == "param" and e.ratio is not None}


@pytest.mark.parametrize("loss_fn", [_masked_loss, _mean_loss], ids=["loss_sum_weight", "mean"])
def test_accumulation_on_a_scan_over_layers_model_passes(loss_fn):
    """#34: the model's own nnx.scan ran on a model merged outside the step's scan ("Cannot extract graph node
    from different trace level"); every nnx object is now merged in the trace that uses it. The update is the
    full-batch step's: each parameter's change is the reference's, ratio 1 to float32 rounding."""
    report = check_parity("accumulation", _scan_task(loss_fn), num_shards=2)
    assert report.verdict == "PASS" and report.codes == ("parity",), str(report)
    ratios = _param_ratios(report)
    assert {"blocks.up.kernel", "blocks.down.kernel", "blocks.norm.scale", "head.kernel"} <= set(ratios)
    assert all(abs(r - 1) < 1e-4 for r in ratios.values()), ratios


def test_a_summing_accumulator_on_the_scan_model_still_fails():
    """The planted fault (MultiSteps summing the k micro-gradients, not averaging them) on the same model: FAIL,
    diagnosed as a sum, every parameter's change twice the reference's (k = 2, SGD)."""

    def make_summing(model, optimizer):
        return nnx.Optimizer(model, optax.MultiSteps(optimizer.tx, 2, use_grad_mean=False), wrt=nnx.Param)

    candidate = dataclasses.replace(accumulation_candidate(_masked_loss, 2), make_optimizer=make_summing)
    report = check_parity(candidate, _scan_task(_masked_loss), num_shards=2)
    assert report.verdict == "FAIL" and report.codes[0] == "summed", str(report)
    ratios = _param_ratios(report)
    assert ratios and all(abs(r - 2) < 1e-4 for r in ratios.values()), ratios


def test_one_multisteps_per_transformation_and_k():
    """#35: the optimizer's tx is a static attribute of its graphdef, compared by identity; a new MultiSteps per
    check made every check's graphdef new, and the accumulation step traced and compiled again."""
    model = zero_linear()
    tx = optax.adam(0.01)
    graphdef = nnx.split((model, make_accumulation_optimizer(model, tx, 2)))[0]
    assert graphdef == nnx.split((model, make_accumulation_optimizer(model, tx, 2)))[0]
    assert make_accumulation_optimizer(model, tx, 2).tx is make_accumulation_optimizer(model, tx, 2).tx
    assert make_accumulation_optimizer(model, tx, 3).tx is not make_accumulation_optimizer(model, tx, 2).tx
    assert (
        make_accumulation_optimizer(model, optax.adam(0.01), 2).tx
        is not make_accumulation_optimizer(model, tx, 2).tx
    )
