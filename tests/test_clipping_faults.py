"""The clipping faults of a user's sharded step, planted and diagnosed by name: each device clipping its FSDP
shard of the gradient by its own local norm (``local_clip_norm``), a clip coefficient from the mean of the
per-device norms (``clip_coefficient``), and, told apart from both, a norm counted once per replica
(``clip_norm``, 1/sqrt(R)). Each step returns the correct (reduced, unclipped) gradients, so they match; the fault
shows in the optimizer's state only."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.rules import diagnose
from shardcheck.parity.diagnosis.topology import factor_groups
from shardcheck.tasks import load_task

MAX_NORM = 0.05  # the digits MLP's gradient norm at step 0 is about 0.43: the clip binds
# the optimizer after the clip: the same state as optax.chain(optax.clip_by_global_norm(...), adam)
UNCLIPPED = optax.chain(optax.identity(), optax.adam(1e-2))


def _task():
    task = load_task("digits", steps=1, batch_size=64)
    return dataclasses.replace(
        task, optimizer=optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(1e-2))
    )


def _split(a, s: int) -> bool:
    """Whether FSDP splits this leaf over S devices (along dimension 0), else it stays whole on each."""
    return a.ndim > 0 and a.shape[0] % s == 0


def _clipping_step(norm: str, seen: dict):
    """A user's data-parallel step in ``jax.shard_map`` that clips by hand, then applies Adam.

    The gradients are all-reduced correctly and returned as they are; the norm of the clip is ``"global"`` (the
    right one), ``"local"`` (each device clips its FSDP shard, dimension 0 split S ways, by that shard's norm),
    ``"mean"`` (one coefficient from the mean of the S shards' norms) or ``"replica"`` (sqrt(psum) of the
    replicated gradients' squares: each leaf counted S times). ``seen`` receives the first step's norms.
    """
    loss_fn = _task().loss_fn

    def step(model, optimizer, batch, mesh):
        axis, s = mesh.axis_names[0], mesh.size
        loss = loss_fn(model, batch)
        graphdef, params = nnx.split(model, nnx.Param)

        def body(params, b):
            g = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), b))(params)
            g = jax.tree.map(lambda a: jax.lax.psum(a, axis) / s, g)
            i = jax.lax.axis_index(axis)

            def shard(a):  # this device's FSDP shard of the leaf
                n = a.shape[0] // s
                return jax.lax.dynamic_slice_in_dim(a, i * n, n, 0) if _split(a, s) else a

            local = jnp.sqrt(sum(jnp.sum(shard(a) ** 2) for a in jax.tree.leaves(g)))
            return g, local[None], jax.lax.pmean(local, axis)

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=(P(), P(axis), P()), check_vma=False
        )
        grads, local, mean = jax.jit(mapped)(params, batch)
        total = optax.tree.norm(grads)
        if not seen:
            seen.update(total=float(total), local=np.asarray(local), mean=float(mean))
        if norm == "local":
            coeff = jnp.minimum(1.0, MAX_NORM / local)  # (S,): device d's coefficient

            def scale(a):
                if not _split(a, s):
                    return a * coeff[0]  # a whole leaf: device 0's copy
                rows = jnp.repeat(coeff, a.shape[0] // s)
                return a * rows.reshape((-1,) + (1,) * (a.ndim - 1))

            clipped = jax.tree.map(scale, grads)
        else:
            used = {"global": total, "mean": mean, "replica": total * math.sqrt(s)}[norm]
            clipped = jax.tree.map(lambda a: a * jnp.minimum(1.0, MAX_NORM / used), grads)
        pure = nnx.as_pure(nnx.state(model, nnx.Param))
        updates, state = UNCLIPPED.update(nnx.as_pure(clipped), nnx.as_pure(optimizer.opt_state), pure)
        nnx.update(model, optax.apply_updates(pure, updates))
        nnx.update(optimizer.opt_state, nnx.state(state))
        optimizer.step[...] += 1
        return {"loss": loss, "grads": grads}

    return step


def _check(norm: str, s: int):
    seen: dict = {}
    report = check_parity(_clipping_step(norm, seen), _task(), mesh=make_mesh(s))
    return report, seen


def _first_moments(report) -> dict[str, float]:
    return {
        e.path.split(".mu.", 1)[1]: e.ratio
        for e in report.steps[0].leaves
        if e.kind == "opt_state" and ".mu." in f".{e.path}."
    }


@require_devices(4)
@pytest.mark.parametrize("s", [2, 4])
def test_a_clip_by_the_global_norm_passes(s):
    report, seen = _check("global", s)
    assert report.ok, report.diagnoses
    assert seen["total"] > MAX_NORM  # the clip bound
    assert [d.code for d in report.diagnoses] == ["parity"]


@require_devices(4)
@pytest.mark.parametrize("s", [2, 4])
def test_a_clip_coefficient_from_the_mean_of_per_rank_norms_is_named(s):
    report, seen = _check("mean", s)
    assert not report.ok
    assert all(e.ok for e in report.steps[0].leaves if e.kind == "grad")  # the gradients match
    factor = seen["total"] / seen["mean"]  # both clips bind: c / mean over c / global
    assert factor > 1  # near sqrt(S) where the shards' norms are alike (S=2: 1.415), yet not 1/sqrt(R)
    np.testing.assert_allclose(list(_first_moments(report).values()), factor, rtol=1e-4)
    first = report.diagnoses[0]
    assert first.code == "clip_coefficient", report.diagnoses
    assert f"Adam's first moments are {factor:.4g} x the reference's" in first.message
    assert "a mean of per-rank norms" in first.message and "not the global one" in first.message
    assert "loss_only" not in [d.code for d in report.diagnoses]


@require_devices(4)
@pytest.mark.parametrize("s", [2, 4])
def test_each_shard_clipped_by_its_local_norm_is_named(s):
    report, seen = _check("local", s)
    assert not report.ok
    assert all(e.ok for e in report.steps[0].leaves if e.kind == "grad")
    first = report.diagnoses[0]
    assert first.code == "local_clip_norm", report.diagnoses
    # device d's factor: (c / norm(local_d)) / (c / norm(global)); a leaf split over the devices holds several
    # of them, its ratio (a median over its elements) lies between them
    factors = seen["total"] / seen["local"]
    assert np.all(factors >= 1) and np.ptp(factors) > 0.05
    moments = _first_moments(report)
    for leaf, ratio in moments.items():
        assert factors.min() * (1 - 1e-4) <= ratio <= factors.max() * (1 + 1e-4), (leaf, ratio, factors)
    for ratio in {f"x{r:.4g}" for r in moments.values()}:
        assert ratio in first.message
    assert all(leaf in first.message for leaf in moments)
    assert "psum the squared norms" in first.message and "local norm" in first.message
    assert first.leaf.startswith("param ")


def _clip_inside_shard_map_step(model, optimizer, batch, mesh):
    """A user's FSDP step that runs the task's own optimizer, ``clip_by_global_norm`` and Adam, inside
    ``jax.shard_map`` on each device's shard of the parameters, state and gradient: the clip sees the local norm.
    A leaf that does not split (``out.bias`` at S=4) stays whole and is clipped differently on each device."""
    axis, s = mesh.axis_names[0], mesh.size
    loss_fn = _task().loss_fn
    loss = loss_fn(model, batch)
    graphdef, params = nnx.split(model, nnx.Param)
    params, state = nnx.as_pure(params), nnx.as_pure(optimizer.opt_state)
    pspec, sspec = (jax.tree.map(lambda a: P(axis) if _split(a, s) else P(), t) for t in (params, state))

    def body(p, st, b):
        def gather(a, spec):
            return jax.lax.all_gather(a, axis, axis=0, tiled=True) if spec == P(axis) else a

        full = jax.tree.map(gather, p, pspec)
        g = jax.grad(lambda q: loss_fn(nnx.merge(graphdef, q), b))(full)
        g = jax.tree.map(lambda a: jax.lax.psum(a, axis) / s, g)
        i = jax.lax.axis_index(axis)

        def shard(a, spec):
            n = a.shape[0] // s
            return jax.lax.dynamic_slice_in_dim(a, i * n, n, 0) if spec == P(axis) else a

        updates, st = optimizer.tx.update(jax.tree.map(shard, g, pspec), st, p)
        return optax.apply_updates(p, updates), st, g

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(pspec, sspec, P(axis)), out_specs=(pspec, sspec, P()), check_vma=False
    )
    params, state, grads = jax.jit(mapped)(params, state, batch)
    nnx.update(model, params)
    nnx.update(optimizer.opt_state, nnx.state(state))
    optimizer.step[...] += 1
    return {"loss": loss, "grads": grads}


@require_devices(4)
@pytest.mark.parametrize("s", [2, 4])
def test_clip_by_global_norm_inside_shard_map_is_a_local_clip_norm(s):
    report = check_parity(_clip_inside_shard_map_step, _task(), mesh=make_mesh(s))
    assert not report.ok
    codes = [d.code for d in report.diagnoses]
    # at S=4 the whole out.bias is clipped by 4 different norms: its copies differ, named first
    assert codes[: 1 + (s == 4)] == (
        ["replicas_differ", "local_clip_norm"] if s == 4 else ["local_clip_norm"]
    )
    message = next(d.message for d in report.diagnoses if d.code == "local_clip_norm")
    factors = _first_moments(report)
    assert min(factors.values()) > 1 and max(factors.values()) > 1.02 * min(factors.values())
    assert all(f"x{f:.4g}" in message for f in factors.values()), (factors, message)
    assert not {"loss_only", "update_differs"} & set(codes)


@require_devices(4)
@pytest.mark.parametrize("s", [2, 4])
def test_a_norm_counted_once_per_replica_is_still_clip_norm(s):
    report, _ = _check("replica", s)
    assert not report.ok
    first = report.diagnoses[0]
    assert first.code == "clip_norm", report.diagnoses
    assert f"sqrt({s})" in first.message and "once per replica" in first.message
    # said where a clip is (the records hold no optimizer); x1/2 of S=4 also reads as a count applied twice
    assert "where the gradients are clipped by a global norm" in first.message
    assert ("without such a clip, x1/2: a gradient divided by 2 once too often" in first.message) is (s == 4)
    np.testing.assert_allclose(list(_first_moments(report).values()), 1 / math.sqrt(s), rtol=1e-4)
    assert not {"clip_coefficient", "local_clip_norm"} & {d.code for d in report.diagnoses}


# ----------------------------------------------------------------------------- the rules on planted records


def _record(mu: dict[str, float], grads_ok: bool = True, clip: float | None = 1.0) -> StepRecord:
    """Step 0 of a step whose gradients match (ratio 1) and whose Adam first moments are x ``mu[leaf]``, under an
    optimizer whose global-norm clip is ``clip`` (``None``: it holds none)."""
    leaves = []
    for path, f in mu.items():
        leaves.append(LeafError(0, "grad", path, 0.0 if grads_ok else 1.0, 0.0, 1e-6, grads_ok, 1.0))
        err = abs(f - 1) * 0.1
        leaves.append(LeafError(0, "opt_state", f"1.0.mu.{path}", err, err, 1e-6, err <= 1e-6, f, 0.1))
        leaves.append(LeafError(0, "param", path, 1e-4, 1e-3, 1e-5, False, 1.0001, 0.1))
    leaves.append(LeafError(0, "loss", "loss", 0.0, 0.0, 1e-6, True, 1.0))
    return StepRecord(0, 1e-5, 1e-6, 2.3, 2.3, tuple(leaves), 1, 1, global_clip=clip)


def test_a_uniform_factor_with_matching_gradients_is_a_clip_coefficient():
    found = diagnose([_record({"a.kernel": 1.0256, "a.bias": 1.0256, "b.kernel": 1.0256})], 4)
    assert found[0].code == "clip_coefficient", found
    assert "1.026 x the reference's on every leaf" in found[0].message
    assert "loss_only" not in [d.code for d in found]
    # x1/sqrt(2) and x1/2 at S=4: a norm counted once per replica, as when the gradients show it
    for f, r in ((1 / math.sqrt(2), 2), (0.5, 4)):
        found = diagnose([_record({"a.kernel": f, "b.kernel": f})], 4)
        assert found[0].code == "clip_norm" and f"sqrt({r})" in found[0].message, found
    # x S: the optimizer was given a sum while the returned gradients are the mean, or another factor S
    found = diagnose([_record({"a.kernel": 4.0, "b.kernel": 4.0})], 4)[0]
    assert (
        found.code == "summed"
        and "or another factor 4 applied to the gradients after they were" in found.message
    )
    # no clip in the optimizer (trial 50): no clip coefficient to blame, the gradients scaled after they were returned
    found = diagnose([_record({"a.kernel": 1.0256, "b.kernel": 1.0256}, clip=None)], 4)[0]
    assert found.code == "applied_scale" and "(the task's optimizer holds no clip)" in found.message
    assert "clipping coefficient" not in found.message


def test_factors_that_differ_by_leaf_group_are_a_local_clip_norm():
    found = diagnose([_record({"a.kernel": 1.7, "a.bias": 1.7, "b.kernel": 2.2, "b.bias": 1.0})], 2)
    assert found[0].code == "local_clip_norm", found
    message = found[0].message
    # b.bias's moment matches (x1): a factor of 1 is no group (issue #36, trial 47's "x1: blocks.1.down.kernel")
    assert "(Adam's first moments: x1.7: a.bias, a.kernel; x2.2: b.kernel)" in message
    assert found[0].leaf == "param b.kernel"
    # a factor below 1 is no clip by a smaller (local) norm: the generic finding stays, naming the optimizer state
    # as the first stage that differs (the gradients match: not "only the loss matches", issue #36)
    found = diagnose([_record({"a.kernel": 0.6, "b.kernel": 1.7})], 2)
    assert found[0].code == "localized", found
    assert "the loss and the gradients match; the optimizer state differs (2 of 2 leaves)" in found[0].message
    # gradients that differ are not this fault
    found = diagnose([_record({"a.kernel": 1.7, "b.kernel": 2.2}, grads_ok=False)], 2)
    assert not {"local_clip_norm", "clip_coefficient"} & {d.code for d in found}, found


def test_a_failing_counter_is_named_alone():
    """An optimizer stepped twice per step also moves its moments by factors that differ by leaf: the counter
    names it, not a clip."""
    record = _record({"a.kernel": 1.7, "b.kernel": 2.2})
    counter = LeafError(0, "counter", "step", 1.0, 1.0, 0.0, False, 2.0)
    record = dataclasses.replace(record, leaves=(*record.leaves, counter), candidate_step_count=2)
    codes = [d.code for d in diagnose([record], 2)]
    assert codes[0] == "step_counter" and not {"local_clip_norm", "clip_coefficient"} & set(codes), codes


def test_factor_groups():
    groups = factor_groups({"a": 1.0, "b": 1.01, "c": 2.0, "d": 1.99, "e": 3.0}, 0.02)
    assert groups == [(1.005, ["a", "b"]), (1.995, ["c", "d"]), (3.0, ["e"])]
