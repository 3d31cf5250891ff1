"""A clip applied to each shard's gradient at a norm of the step's own, named with that norm (trial 58 C2).

A hand-written clip inside the step's ``jax.shard_map`` (``g * min(1, M / norm(g))`` before the pmean) at a norm M
other than the task's read "no constant factor ... no simple form". The harness now fits M from the returned
gradients (``shardcheck.parity.diagnosis.shard_clip``): every shard clipped, some of them, with the task clipping
nothing or at another norm; a correct step and a clip that binds on no shard pass, and a sum for a mean keeps its
own finding. The fit itself is checked against float64 NumPy on random shards, for any M.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import replicated_step, require_devices
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.shard_clip import _fit
from shardcheck.tasks.digits import digits_loss, digits_task

AX = ("data",)
S = 4


def _step(clip, fault="pmean"):
    """A data-parallel shard_map step that clips each shard's gradient to global norm ``clip`` (``None``: no
    clip) before its ``fault`` reduction (``"pmean"``, or ``"psum"``: a sum for a mean); ``"applied_x2"``: the
    pmean returned, twice it applied (an optimizer-side fault whose gradients match)."""

    @functools.partial(nnx.jit, static_argnums=3)
    def train(model, optimizer, batch, mesh):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def body(params, rest, batch):
            loss, g = jax.value_and_grad(lambda p: digits_loss(nnx.merge(graphdef, p, rest), batch))(params)
            if clip is not None:
                g = jax.tree.map(lambda x: x * jnp.minimum(1.0, clip / optax.tree.norm(g)), g)
            reduce = jax.lax.psum if fault == "psum" else jax.lax.pmean
            return jax.lax.pmean(loss, AX), reduce(g, AX)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(AX)), out_specs=P(), check_vma=False)
        loss, grads = mapped(params, rest, batch)
        optimizer.update(model, jax.tree.map(lambda g: 2 * g, grads) if fault == "applied_x2" else grads)
        return {"loss": loss, "grads": grads}

    return replicated_step(train)


def _task(clip, opt=optax.adam):
    tx = opt(1e-2) if clip is None else optax.chain(optax.clip_by_global_norm(clip), opt(1e-2))
    return digits_task(optimizer=tx, steps=2)


def _shard_norms(task) -> np.ndarray:
    """Each shard's own mean gradient's global norm at the task's initial state, first batch (descending)."""
    model, batch = task.new_model(), task.batches[0]
    shards = jax.tree.map(lambda a: np.asarray(a).reshape((S, -1) + np.shape(a)[1:]), batch)
    norms = [
        float(optax.tree.norm(nnx.grad(digits_loss)(model, jax.tree.map(lambda a, i=i: a[i], shards))))
        for i in range(S)
    ]
    return np.sort(norms)[::-1]


def _first_failing(report):
    return next(r for r in report.steps if not r.ok)


@require_devices(S)
@pytest.mark.parametrize("task_clip", [None, 10.0], ids=["task clips nothing", "task clips at 10"])
@pytest.mark.parametrize("binding", ["every shard", "two shards"])
def test_a_clip_per_shard_at_the_steps_own_norm_is_named_with_that_norm(task_clip, binding):
    task = _task(task_clip)
    norms = _shard_norms(task)
    clip = float(norms[-1] / 2) if binding == "every shard" else float((norms[1] + norms[2]) / 2)
    report = check_parity(_step(clip), task, mesh=make_mesh({"data": S}))
    assert report.verdict == "FAIL" and report.codes[0] == "clip_per_shard", str(report)
    fitted = _first_failing(report).shard_clip
    assert fitted == pytest.approx(clip, rel=1e-4)
    told = "clips nothing" if task_clip is None else "clips at 10"
    assert (
        f"clipped to a global norm of {fitted:.4g}, the step's own (fitted; the task's optimizer {told})"
        in report.diagnoses[0].message
    )


@require_devices(S)
def test_a_correct_step_a_clip_that_never_binds_and_a_sum_for_a_mean_are_not_read_so():
    task = _task(None)
    mesh = make_mesh({"data": S})
    assert check_parity(_step(None), task, mesh=mesh).verdict == "PASS"
    never = float(_shard_norms(task)[0] * 2)  # above every shard's norm: the clip changes nothing
    assert check_parity(_step(never), task, mesh=mesh).verdict == "PASS"
    summed = check_parity(_step(None, "psum"), task, mesh=mesh)
    assert summed.codes[0] == "summed" and _first_failing(summed).shard_clip is None, str(summed)
    # gradients that match, an update that does not (the bug reports' optimizer faults read as a clip at first)
    applied = check_parity(_step(None, "applied_x2"), _task(None, optax.sgd), mesh=mesh)
    assert applied.verdict == "FAIL" and "clip_per_shard" not in applied.codes, str(applied)
    assert _first_failing(applied).shard_clip is None


@require_devices(S)
def test_a_clip_per_shard_at_the_tasks_own_norm_keeps_the_tasks_wording():
    task = _task(None)
    norm = float(_shard_norms(task)[-1] / 2)
    report = check_parity(_step(norm), _task(norm), mesh=make_mesh({"data": S}))
    assert report.codes[0] == "clip_per_shard" and _first_failing(report).shard_clip is None, str(report)
    assert "clipped to the task's global norm" in report.diagnoses[0].message


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shards=st.integers(2, 6),
    quantile=st.floats(0.0, 0.95),
)
def test_the_fit_recovers_any_clip_norm_and_refutes_a_sum(seed, shards, quantile):
    """float64 NumPy oracle: the mean of each shard's gradient clipped to M, M anywhere below the largest
    shard norm, is fitted as M; the shards' sum (a psum for a pmean) is no clip."""
    rng = np.random.default_rng(seed)
    means = {"a": rng.normal(size=(shards, 3, 4)), "b": rng.normal(size=(shards, 5)) * rng.uniform(0.1, 3)}
    norms = np.sqrt(sum(np.sum(m.reshape(shards, -1) ** 2, axis=1) for m in means.values()))
    clip = float(np.quantile(norms, quantile)) * 0.999
    coeffs = np.full(shards, 1.0 / shards)
    scale = np.minimum(1.0, clip / norms)
    cand = {p: np.tensordot(coeffs * scale, m, axes=1) for p, m in means.items()}
    tolerance = {p: 1e-9 for p in means}
    assert _fit(cand, means, coeffs, norms, tolerance) == pytest.approx(clip, rel=1e-9)
    summed = {p: np.sum(m, axis=0) for p, m in means.items()}
    assert _fit(summed, means, coeffs, norms, tolerance) is None
