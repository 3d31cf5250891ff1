"""Adam's moments from a scaled gradient, read as one factor (trial 56 D2).

A step that summed its gradients where a mean was due and returned no gradients shows them only in Adam's state:
first moments x S, second moments x S^2, the parameters (whose update mu / (sqrt(nu) + eps) cancels the scale)
as the reference's. The localization read it "no simple form ... x4, x16" while the rules said x4; it now reads
the gradient's factor from the pair, and nothing else that merely looks alike (moments not in a square's ratio, a
parameter that moved otherwise, momentum's trace alone).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.form import fit_form
from shardcheck.tasks.digits import digits_loss, digits_task

RNG = np.random.default_rng(0)
MU, NU = RNG.normal(size=(8, 4)), RNG.random((8, 4)) + 0.1
UPDATE = RNG.normal(size=(8, 4))


def _fit(mu_factor: float, nu_factor: float, param_factor: float | None = 1.0):
    """fit_form of mu and nu leaves scaled by their factors, and a parameter leaf whose update is scaled by
    ``param_factor`` (left out where ``None``); every ``before`` 0 but the parameter's."""
    ref = {"opt_state 0.mu.w": MU, "opt_state 0.nu.w": NU}
    cand = {"opt_state 0.mu.w": mu_factor * MU, "opt_state 0.nu.w": nu_factor * NU}
    before = {}
    if param_factor is not None:
        before["w"] = np.ones((8, 4))
        ref["w"], cand["w"] = 1 + UPDATE, 1 + param_factor * UPDATE
    return fit_form(before, ref, cand)


@pytest.mark.parametrize("c", [4.0, 0.5, 8.0])
@pytest.mark.parametrize("param_factor", [1.0, 1.03, None])
def test_first_moments_c_and_second_c_squared_read_the_gradients_factor(c, param_factor):
    form = _fit(c, c * c, param_factor)
    assert form.kind == "moments" and form.factor == pytest.approx(c)
    assert form.sentence.startswith(
        f"the optimizer's first moments are {c:.4g} x the reference's (1 leaf) and its second moments "
        f"{c * c:.4g} x (1 leaf, the square): the gradient the optimizer read was {c:.4g} x the reference's"
    )
    said = "the parameters that differ (1 leaf) moved as the reference's (median update ratio"
    assert (said in form.sentence) is (param_factor is not None)


@pytest.mark.parametrize(
    "mu_factor, nu_factor, param_factor",
    [
        (4.0, 4.0, 1.0),  # both moments x4: no square, a scale of the state alone
        (4.0, 16.0, 4.0),  # the parameters moved x4 too: not Adam's normalized update
        (4.0, 12.0, 1.0),  # a second moment off the square
    ],
)
def test_moments_that_are_no_scaled_gradients_square_are_not_read_as_one(mu_factor, nu_factor, param_factor):
    form = _fit(mu_factor, nu_factor, param_factor)
    assert form.kind != "moments" and "the gradient the optimizer read" not in form.sentence


def test_a_momentum_trace_alone_is_a_constant_factor():
    form = fit_form({}, {"opt_state 0.trace.w": MU}, {"opt_state 0.trace.w": 4 * MU})
    assert form.kind in ("factor", "extra_step") and form.factor == pytest.approx(4.0)


AX = ("data",)


def _step(reduce):
    @functools.partial(nnx.jit, static_argnums=3)
    def train(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            loss, grads = jax.value_and_grad(lambda p: digits_loss(nnx.merge(graphdef, p, rest), batch))(
                params
            )
            return jax.lax.pmean(loss, AX), jax.tree.map(lambda g: reduce(g, AX), grads)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=P(), check_vma=False)
        loss, grads = mapped(params, rest, batch)
        optimizer.update(model, grads)
        return loss  # the gradients are not returned: only Adam's state shows them

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, batch, mesh)

    return step


@require_devices(4)
@pytest.mark.parametrize("reduce", [jax.lax.pmean, jax.lax.psum], ids=["pmean", "psum"])
def test_a_sum_for_a_mean_under_adam_reads_x4_in_the_rules_and_the_localization(reduce):
    task = digits_task(optimizer=optax.adam(1e-2), steps=2)
    report = check_parity(_step(reduce), task, mesh=make_mesh({"data": 4}))
    if reduce is jax.lax.pmean:
        assert report.ok
        return
    assert not report.ok and "summed" in report.codes
    form = report.localization.form
    assert form.kind == "moments" and form.factor == pytest.approx(4.0, rel=1e-3)
    assert "the gradient the optimizer read was 4 x the reference's" in form.sentence
    assert "no simple form" not in str(report)


@require_devices(4)
def test_a_replay_reads_the_moments_as_the_live_check_does():
    """A recording of the correct step, replayed against the psum step: the records alone (each moment's ratio
    over its samples) read the same x4 as the arrays do live."""
    from shardcheck.parity.harness.recorded import record_run

    task = digits_task(optimizer=optax.adam(1e-2), steps=2)
    mesh = make_mesh({"data": 4})
    recording = record_run(task, _step(jax.lax.pmean), mesh=mesh)
    replayed = check_parity(_step(jax.lax.psum), task, reference=recording, mesh=mesh)
    form = replayed.localization.form
    assert not replayed.ok and form.kind == "moments" and form.factor == pytest.approx(4.0, rel=1e-3)
    assert "the gradient the optimizer read was 4 x the reference's" in form.sentence
