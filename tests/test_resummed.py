"""A gradient that ``jax.shard_map``'s autodiff already summed, reduced again by the step (``resummed``).

Under ``check_vma=True`` the gradient of each shard's loss with respect to a replicated input comes out summed
over the batch axis; ``pmean(grad(local_loss))``, right under ``pmap`` and ``check_vma=False``, then keeps the sum
(x S). Before, the diagnosis said "summed instead of averaged" of a step whose only reduction was a pmean. Both
sides: the program reading finds the pattern where it is and nowhere else, and a check says it only where the
step has it.
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity
from shardcheck.mesh import make_mesh
from shardcheck.parity.diagnosis.evidence import Diagnosis
from shardcheck.parity.diagnosis.resummed import (
    applied_clause,
    read_step,
    resummed_clause,
    with_resummed,
)
from shardcheck.tasks import load_task

pytestmark = require_devices(4)


def _local_loss(w, x):
    return jnp.mean((x @ w) ** 2)


def _program(body, check_vma=True, wrap=lambda f: f):
    mesh = make_mesh(4)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma)
    return jax.make_jaxpr(wrap(mapped))(jnp.ones((3, 2)), jnp.ones((8, 3)))


def pmean_after_grad(w, x):
    return jax.lax.pmean(jax.grad(_local_loss)(w, x), "data")


def psum_after_grad(w, x):
    return jax.lax.psum(jax.grad(_local_loss)(w, x), "data")


def grad_of_the_mean(w, x):
    return jax.grad(lambda w: jax.lax.pmean(_local_loss(w, x), "data"))(w)


def penalty_of_the_params(w, x):  # a pmean of a replicated value that no gradient made: harmless, not it
    return grad_of_the_mean(w, x) + jax.lax.pmean(jnp.sum(w**2), "data") * w


def reduced_in_a_branch(w, x):  # the reduction inside a lax.cond: the nested program's inputs are followed
    g = jax.grad(_local_loss)(w, x)
    return jax.lax.cond(jnp.all(jnp.isfinite(g)), lambda g: jax.lax.pmean(g, "data"), lambda g: g, g)


def layers_in_a_scan(w, x):  # the replicated weight meets the batch inside a lax.scan body (stacked layers)
    def loss(w):
        out, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w @ w.T), None), x, None, length=2)
        return jnp.mean(out**2)

    return jax.lax.pmean(jax.grad(loss)(w), "data")


def _synced_norm_loss(w, x):  # BatchNorm's way with axis_name: the batch's mean pmean-ed over 'data'
    h = x @ w
    mean = jax.lax.pmean(jnp.mean(h, axis=0), "data")
    return jnp.mean((h - mean) ** 2)


def synced_norm_varying_params(w, x):  # trial 60: parameters cast to varying, each shard's gradient its own
    w = jax.lax.pcast(w, "data", to="varying")
    return jax.lax.psum(jax.grad(_synced_norm_loss)(w, x), "data")


def synced_norm_replicated_params(w, x):  # replicated: autodiff sums the gradient, then it is pmean-ed
    return jax.lax.pmean(jax.grad(_synced_norm_loss)(w, x), "data")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (synced_norm_varying_params, ()),
        (synced_norm_replicated_params, ("data",)),
        (pmean_after_grad, ("data",)),
        (psum_after_grad, ("data",)),
        (reduced_in_a_branch, ("data",)),
        (layers_in_a_scan, ("data",)),
        (grad_of_the_mean, ()),
        (penalty_of_the_params, ()),
    ],
)
def test_the_program_reading_finds_a_reduction_of_an_autodiff_summed_gradient_and_nothing_else(
    body, expected
):
    assert read_step(_program(body))[0] == expected


def test_without_check_vma_autodiff_sums_nothing_and_nothing_is_found():
    assert read_step(_program(psum_after_grad, check_vma=False))[0] == ()
    assert read_step(_program(pmean_after_grad, check_vma=False))[0] == ()


def test_a_step_jitted_around_its_shard_map_is_read_through_the_jit():
    assert read_step(_program(pmean_after_grad, wrap=jax.jit))[0] == ("data",)


def test_the_clause_names_the_axes_the_factors_and_the_fix():
    clause = resummed_clause(("data",), 4)
    assert clause.startswith(
        "The step reduces over 'data' a gradient that jax.grad had already summed over 'data'"
    )
    assert "a pmean after it keeps the sum (x4) and a psum sums it again (x16)" in clause
    assert "jax.lax.pmean(loss, 'data')" in clause and "jax.lax.pcast(params, 'data', to='varying')" in clause
    two = resummed_clause(("data", "fsdp"), None)
    assert "over 'data' and 'fsdp'" in two and "jax.lax.pmean(loss, ('data', 'fsdp'))" in two
    assert "(xS)" in two and "(xS^2)" in two
    summed = [Diagnosis("summed", "x4."), Diagnosis("localized", "y")]
    assert [d.message for d in with_resummed(summed, (("data",), ("data",)), (4, 4))] == [
        f"x4. {clause}",
        "y",
    ]
    applied = applied_clause(("data",), 4)
    assert [d.message for d in with_resummed(summed, ((), ("data",)), (None, 4))] == [f"x4. {applied}", "y"]
    assert with_resummed(summed, ((), ()), (None, None)) == summed  # nothing read: as it was
    other = [Diagnosis("scaled", "x0.5."), *summed[1:]]
    assert with_resummed(other, (("data",), ()), (4, None)) == other  # only a summed finding is explained so


# --------------------------------------------------------------------------- a check of the user's own step


def _shard_map_step(reduce, check_vma=True, loss_mean=False, varying=False):
    """A data-parallel step on ``jax.shard_map``: the gradient of each shard's loss, reduced by ``reduce``."""

    def step(model, optimizer, batch, mesh):
        graphdef, state = nnx.split(model)

        def body(state, b):
            if varying:  # each shard's gradient its own: no implicit psum (C2)
                state = jax.lax.pcast(state, "data", to="varying")

            def loss(state):
                x, y = b
                local = jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)
                return jax.lax.pmean(local, "data") if loss_mean else local

            value, grads = jax.value_and_grad(loss)(state)
            return jax.lax.pmean(value, "data"), reduce(grads)

        specs = dict(in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=check_vma)
        value, grads = jax.shard_map(body, mesh=mesh, **specs)(state, batch)
        optimizer.update(model, grads)
        return value

    return step


@pytest.fixture(scope="module")
def linnerud():
    return load_task("linnerud", optimizer="adam")


def test_a_pmean_after_an_autodiff_summed_gradient_is_named_so(linnerud):
    step = _shard_map_step(lambda g: jax.lax.pmean(g, "data"))
    report = check_parity(step, linnerud, mesh=make_mesh(4), steps=2)
    assert not report.ok
    lead = report.diagnoses[0]
    assert lead.code == "summed"
    assert "summed instead of averaged (x4: a sum over 4 shards)" in lead.message
    assert lead.message.endswith(resummed_clause(("data",), 4))


def test_a_psum_after_it_is_named_so_with_its_square(linnerud):
    step = _shard_map_step(lambda g: jax.lax.psum(g, "data"))
    lead = check_parity(step, linnerud, mesh=make_mesh(4), steps=1).diagnoses[0]
    assert lead.code == "summed" and "sum-reduced twice (x16 = 4^2" in lead.message
    assert lead.message.endswith(resummed_clause(("data",), 4))


def test_the_right_steps_pass_and_a_plain_psum_for_a_pmean_is_not_told_of_autodiff(linnerud):
    mesh = make_mesh(4)
    for step in (
        _shard_map_step(lambda g: g, loss_mean=True),  # the gradient of the mean loss, no reduction after it
        _shard_map_step(lambda g: jax.lax.pmean(g, "data"), check_vma=False),  # pmap's way, without check_vma
        _shard_map_step(lambda g: jax.lax.pmean(g, "data"), varying=True),  # the clause's other fix
    ):
        report = check_parity(step, linnerud, mesh=mesh, steps=2)
        assert report.ok, report
    # without check_vma a psum is the only reduction: summed, and nothing said of autodiff
    lead = check_parity(
        _shard_map_step(lambda g: jax.lax.psum(g, "data"), check_vma=False), linnerud, mesh=mesh, steps=1
    ).diagnoses[0]
    assert lead.code == "summed" and "summed instead of averaged (x4" in lead.message
    assert "jax.grad had already summed" not in lead.message


def test_the_flax_way_nnx_shard_map_and_nnx_value_and_grad_is_read_alike(linnerud):
    def step(model, optimizer, batch, mesh):
        @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
        def body(model, optimizer, batch):
            x, y = batch
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, jax.lax.pmean(grads, "data"))
            return jax.lax.pmean(loss, "data")

        return body(model, optimizer, batch)

    lead = check_parity(step, linnerud, mesh=make_mesh(4), steps=1).diagnoses[0]
    assert lead.code == "summed" and lead.message.endswith(resummed_clause(("data",), 4))


def test_s_counting_micro_batches_too_names_the_axis_and_the_axis_factors(linnerud):
    # trial 55: num_shards=4 on a data=2 mesh (S counting 2 micro-batches a device) and a pmean after an autodiff
    # sum, x2, read "a constant factor that is not a shard count"; the clause's factors are the axis's, not S's
    step = _shard_map_step(lambda g: jax.lax.pmean(g, "data"))
    lead = check_parity(step, linnerud, mesh=make_mesh(2), num_shards=4, steps=1).diagnoses[0]
    assert lead.code == "summed"
    assert (
        "x2, the size of mesh axis 'data': the gradient was summed over 'data' once too often" in lead.message
    )
    assert lead.message.endswith(resummed_clause(("data",), 2))
    assert "keeps the sum (x2) and a psum sums it again (x4)" in lead.message


def test_a_forgotten_pmean_of_an_autodiff_summed_gradient_is_named_so(linnerud):
    # trial 55: no reduction after jax.grad under check_vma=True read "summed instead of averaged" alone; the
    # step's program shows the sum autodiff made reaching the update
    step = _shard_map_step(lambda g: g)
    lead = check_parity(step, linnerud, mesh=make_mesh(4), steps=1).diagnoses[0]
    assert lead.code == "summed" and "summed instead of averaged (x4: a sum over 4 shards)" in lead.message
    assert lead.message.endswith(applied_clause(("data",), 4))
    assert "jax.grad had already summed" not in lead.message


def test_the_program_reading_says_which_sum_reaches_the_outputs():
    # (reduced again, applied): a pmean after autodiff's sum is both; the right step's gradient is autodiff's sum
    assert read_step(_program(pmean_after_grad)) == (("data",), ("data",))
    assert read_step(_program(grad_of_the_mean)) == ((), ("data",))
    assert read_step(_program(lambda w, x: jax.grad(_local_loss)(w, x))) == ((), ("data",))
    assert read_step(_program(psum_after_grad, check_vma=False)) == ((), ())


def test_a_replay_names_the_autodiff_sum_as_the_live_check_does(linnerud):
    """Trial 56: a replay's summed lacked the program's reading (the replay runs the user's step too, so it can
    trace it). The pmap-style port against a recording of the right step: the same clause as live; the step
    without check_vma, a plain psum for a pmean: summed, and nothing said of autodiff."""
    from shardcheck.parity.harness.recorded import record_run

    mesh = make_mesh(4)
    recording = record_run(linnerud, _shard_map_step(lambda g: g, loss_mean=True), mesh=mesh, steps=2)
    port = _shard_map_step(lambda g: jax.lax.pmean(g, "data"))
    replayed, live = (
        check_parity(port, linnerud, mesh=mesh, steps=2, **r) for r in ({"reference": recording}, {})
    )
    assert replayed.diagnoses[0].code == live.diagnoses[0].code == "summed"
    assert replayed.diagnoses[0].message.endswith(resummed_clause(("data",), 4))
    assert resummed_clause(("data",), 4) in replayed.replay.cause
    plain = _shard_map_step(lambda g: jax.lax.psum(g, "data"), check_vma=False)
    lead = check_parity(plain, linnerud, mesh=mesh, steps=1, reference=recording).diagnoses[0]
    assert lead.code == "summed" and "jax.grad had already summed" not in lead.message
