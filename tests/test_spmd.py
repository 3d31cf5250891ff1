"""Data-parallel and FSDP steps on a mesh of fake CPU devices against the single-device baseline.

Every equivalence is asserted as values: the seeds' and ``docs/reduction_cases.md`` numbers, the baseline's updated state,
and the ratio (sharded update / baseline update) == 1 per leaf, so an S-times or 1/S error cannot pass.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from shardcheck import data_parallel_sgd_step, make_mesh, make_model, make_tx, mse_loss, sgd_step
from shardcheck.losses import mse_batch_loss
from shardcheck.partitioning import fsdp_partition_spec
from shardcheck.seeds import fsdp_sgd_step, mesh_steps
from shardcheck.steps import sharded as sharded_steps

P = PartitionSpec
STEPS = {"dp": data_parallel_sgd_step, "fsdp": fsdp_sgd_step}
SIZES = [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (1, 2, 4, 8)]

# docs/reduction_cases.md Fixture L: full-batch loss 7.5, grads kernel [[-6], [-2.5]], bias [-5]; SGD lr 0.1 from zero.
XL = np.array([[1, 0], [0, 1], [1, 1], [2, 0]], np.float32)
YL = np.array([[1], [2], [3], [4]], np.float32)
GRAD_KERNEL_L = np.array([[-6.0], [-2.5]])
GRAD_BIAS_L = np.array([-5.0])


def fixture_l(num_shards):
    """Fixture L's batch; for S=8 it is tiled twice, which leaves the full-batch loss and gradients unchanged."""
    reps = 2 if num_shards == 8 else 1
    return np.tile(XL, (reps, 1)), np.tile(YL, (reps, 1))


def zero_linear(tx=None):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((2, 1))
    model.bias[...] = jnp.zeros((1,))
    return model, nnx.Optimizer(model, tx or optax.sgd(0.1), wrt=nnx.Param)


def snapshot(model, optimizer) -> dict[str, np.ndarray]:
    """Host copies of every model and optimizer leaf, by dotted path."""
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    return {".".join(map(str, path)): np.array(var[...]) for path, var in flat}


def assert_same_update(before, got, want, rtol=1e-6):
    """Each leaf equals the baseline's, and (update / baseline update) == 1 as a projection ratio."""
    assert got.keys() == want.keys()
    for key in want:
        if not np.issubdtype(want[key].dtype, np.floating):  # step counters
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
            continue
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-6, err_msg=key)
        delta = got[key].astype(np.float64) - before[key]
        base = want[key].astype(np.float64) - before[key]
        if np.any(base):
            ratio = np.vdot(delta, base) / np.vdot(base, base)
            assert abs(ratio - 1) <= rtol, f"{key}: update / baseline update = {ratio}"


def problem(b=16, d=8, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, d)).astype(np.float32), rng.normal(size=(b, k)).astype(np.float32)


def fresh(kind, opt, d=8, k=4, hidden=16):
    model = make_model(kind, d, k, hidden=hidden, seed=0)
    return model, nnx.Optimizer(model, make_tx(opt, 0.1), wrt=nnx.Param)


@functools.cache
def baseline(kind, opt, b=16, d=8, k=4, hidden=16, steps=1):
    """(before, after, losses) of ``steps`` baseline steps; cached, it is the same for every S and strategy."""
    model, optimizer = fresh(kind, opt, d, k, hidden)
    x, y = problem(b, d, k)
    before = snapshot(model, optimizer)
    losses = [float(sgd_step(model, optimizer, x, y)) for _ in range(steps)]
    return before, snapshot(model, optimizer), losses


# ----------------------------------------------------------------------------------------------------- mesh


@pytest.mark.parametrize("num_devices", SIZES)
def test_make_mesh_first_devices_auto_axis(num_devices):
    mesh = make_mesh(num_devices)
    assert dict(mesh.shape) == {"data": num_devices}
    assert mesh.axis_types == (AxisType.Auto,)
    assert list(mesh.devices.flat) == jax.devices()[:num_devices]
    assert make_mesh(num_devices, axis_name="batch").axis_names == ("batch",)


def test_make_mesh_defaults_to_all_devices():
    assert make_mesh().size == len(jax.devices())


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(shape=0), ValueError, "make_mesh: the size of axis 'data' must be a positive int, got 0"),
        (dict(shape=10**6), ValueError, r"make_mesh: the mesh data=1000000 needs 1000000 devices, but"),
        (dict(shape=True), TypeError, "make_mesh: shape must be a device count N, a mapping"),
        (dict(shape=2.0), TypeError, "make_mesh: shape must be a device count N, a mapping"),
        (dict(axis_name=""), TypeError, "make_mesh: axis_name must be a non-empty str"),
        (
            dict(shape={"data": 2, "fsdp": 0}),
            ValueError,
            "make_mesh: the size of axis 'fsdp' must be a positive",
        ),
        (dict(shape={"data": 2, "fsdp": 10**6}), ValueError, "the mesh data=2 x fsdp=1000000 needs 2000000"),
        (dict(shape={"da ta": 2}), ValueError, "make_mesh: axis name 'da ta' is not an identifier"),
        (dict(shape={}), TypeError, "make_mesh: shape must be a device count N, a mapping"),
    ],
)
def test_make_mesh_rejects(kwargs, err, match):
    with pytest.raises(err, match=match):
        make_mesh(**kwargs)


@require_devices(4)
def test_auto_axes_let_gspmd_jit_run_where_explicit_axes_refuse():
    """Why make_mesh picks Auto: plain jit over NamedSharding inputs (the GSPMD path) must work too."""

    def f(x, w):
        return x @ w.T

    for mesh, ok in ((make_mesh(4), True), (jax.make_mesh((4,), ("data",)), False)):
        x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
        w = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P("data", None)))
        if ok:
            np.testing.assert_allclose(jax.jit(f)(x, w), 4.0)
        else:
            with pytest.raises(Exception, match="illegally sharded"):
                jax.jit(f)(x, w)


# ------------------------------------------------------------------------------------- equal to the baseline


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("num_shards", SIZES)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_step_equals_baseline(strategy, num_shards, opt):
    before, want, (want_loss,) = baseline("linear", opt)
    model, optimizer = fresh("linear", opt)
    x, y = problem()
    loss = STEPS[strategy](model, optimizer, x, y, make_mesh(num_shards))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    got = snapshot(model, optimizer)
    assert_same_update(before, got, want)
    assert int(optimizer.step[...]) == 1
    if opt == "adam":
        assert got["1.opt_state.0.count"] == 1
        assert {"1.opt_state.0.mu.kernel", "1.opt_state.0.nu.kernel"} <= got.keys()
    if opt == "momentum":
        assert "1.opt_state.0.trace.kernel" in got


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (2, 8)]
)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_mlp_equals_baseline(strategy, num_shards):
    """Two nnx.Linear with a ReLU; at S=8 the output bias (4,) stays replicated under FSDP."""
    before, want, (want_loss,) = baseline("mlp", "adam")
    model, optimizer = fresh("mlp", "adam")
    x, y = problem()
    loss = STEPS[strategy](model, optimizer, x, y, make_mesh(num_shards))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert_same_update(before, snapshot(model, optimizer), want)


@require_devices(4)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_consecutive_steps_equal_baseline_without_retrace_or_reshard(strategy):
    before, want, want_losses = baseline("mlp", "momentum", steps=3)
    model, optimizer = fresh("mlp", "momentum")
    x, y = problem()
    mesh = make_mesh(4)
    sharded_steps.compiled_step.cache_clear()  # a fresh jitted step, whatever earlier tests compiled
    losses = [float(STEPS[strategy](model, optimizer, x, y, mesh))]
    fn = STEPS[strategy].__name__
    # The jitted step (lru-cached per structure, placement and mesh): one compiled entry after the first call.
    step = mesh_steps._prepare(fn, strategy, model, optimizer, x, y, mesh, "data", 0)[0]
    assert step._cache_size() == 1
    kernel = model.hidden.kernel[...]
    want_spec = P() if strategy == "dp" else fsdp_partition_spec(kernel.shape, 4)
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), kernel.ndim)
    for _ in range(2):
        losses.append(float(STEPS[strategy](model, optimizer, jnp.asarray(x), y, mesh)))
        k = model.hidden.kernel[...]
        assert k.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), k.ndim)
    again = mesh_steps._prepare(fn, strategy, model, optimizer, jnp.asarray(x), y, mesh, "data", 0)[0]
    assert again is step, "a repeated call built a new step"
    assert step._cache_size() == 1, "a repeated call re-traced the step"
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert_same_update(before, snapshot(model, optimizer), want, rtol=2e-6)
    assert int(optimizer.step[...]) == 3


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (1, 4)]
)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_first_step_copies_then_state_is_donated(strategy, num_shards):
    """A clone shares its source's arrays: the first mesh step must not delete them (S=1 included)."""
    source, _ = fresh("linear", "sgd")
    clone = nnx.clone(source)
    assert clone.kernel[...] is source.kernel[...]
    optimizer = nnx.Optimizer(clone, optax.sgd(0.1), wrt=nnx.Param)
    mesh = make_mesh(num_shards)
    x, y = problem()
    STEPS[strategy](clone, optimizer, x, y, mesh)
    assert not source.kernel[...].is_deleted()
    placed = clone.kernel[...]
    STEPS[strategy](clone, optimizer, x, y, mesh)
    assert placed.is_deleted()  # steady state: the previous step's buffers are reused
    assert not clone.kernel[...].is_deleted()


@require_devices(4)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_accepts_placed_arrays_and_explicit_meshes(strategy):
    """Inputs already sharded on the mesh, or on another device; jax.make_mesh's default Explicit axes."""
    before, want, (want_loss,) = baseline("linear", "sgd")
    x, y = problem()
    for mesh in (make_mesh(4), jax.make_mesh((4,), ("data",))):
        model, optimizer = fresh("linear", "sgd")
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ys = jax.device_put(y, jax.devices()[5])
        np.testing.assert_allclose(STEPS[strategy](model, optimizer, xs, ys, mesh), want_loss, rtol=1e-6)
        assert_same_update(before, snapshot(model, optimizer), want)


@settings(max_examples=10)
@given(
    num_shards=st.sampled_from([1, 2, 4, 8]),
    rows=st.integers(1, 2),
    d=st.integers(1, 5),
    k=st.integers(1, 4),
    opt=st.sampled_from(["sgd", "momentum", "adam"]),
    kind=st.sampled_from(["linear", "mlp"]),
)
def test_property_dp_and_fsdp_equal_baseline(num_shards, rows, d, k, opt, kind):
    if len(jax.devices()) < num_shards:
        pytest.skip(f"needs {num_shards} devices")
    b = num_shards * rows
    x, y = problem(b, d, k, seed=b * 100 + d * 10 + k)
    model, optimizer = fresh(kind, opt, d, k, hidden=4)
    before = snapshot(model, optimizer)
    want_loss = sgd_step(model, optimizer, x, y)
    want = snapshot(model, optimizer)
    for step in STEPS.values():
        model, optimizer = fresh(kind, opt, d, k, hidden=4)
        np.testing.assert_allclose(step(model, optimizer, x, y, make_mesh(num_shards)), want_loss, rtol=1e-5)
        assert_same_update(before, snapshot(model, optimizer), want, rtol=1e-5)


# ----------------------------------------------------------------------------------- C1: sum instead of mean


def run_reduction_variant(reduce, num_shards, replicated_grad=False, psum_loss=False):
    """Fixture L on S devices: loss and reduced grads of a DP variant, and the variant's jaxpr.

    ``reduce`` maps the per-device gradient tree to the applied one. ``replicated_grad`` differentiates with
    respect to the replicated (invariant) parameters, the C2 trap; ``psum_loss`` differentiates a loss that was
    ``psum``-ed across devices.
    """
    x, y = fixture_l(num_shards)
    model, _ = zero_linear()
    graphdef, params = nnx.split(model)

    def body(params, x, y):
        if not replicated_grad:
            params = jax.lax.pcast(params, "data", to="varying")

        def loss_fn(p):
            loss = mse_loss(nnx.merge(graphdef, p), x, y)
            return jax.lax.psum(loss, "data") if psum_loss else loss

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.lax.pmean(loss, "data"), reduce(grads)

    fn = jax.jit(
        jax.shard_map(body, mesh=make_mesh(num_shards), in_specs=(P(), P("data"), P("data")), out_specs=P())
    )
    loss, grads = fn(params, x, y)
    return loss, grads, fn.trace(params, x, y).jaxpr


def psum(g):
    return jax.lax.psum(g, "data")


def pmean(g):
    return jax.lax.pmean(g, "data")


@pytest.mark.parametrize(
    "num_shards,kernel,bias",
    [
        pytest.param(2, [[1.2], [0.5]], [1.0], marks=require_devices(2)),
        pytest.param(4, [[2.4], [1.0]], [2.0], marks=require_devices(4)),
    ],
)
def test_c1_sum_reduction_is_s_times_the_step(num_shards, kernel, bias):
    _, grads, _ = run_reduction_variant(psum, num_shards)
    np.testing.assert_allclose(-0.1 * grads["kernel"][...], kernel, rtol=1e-6)
    np.testing.assert_allclose(-0.1 * grads["bias"][...], bias, rtol=1e-6)
    _, grads, _ = run_reduction_variant(pmean, num_shards)  # the right reduction
    np.testing.assert_allclose(-0.1 * grads["kernel"][...], [[0.6], [0.25]], rtol=1e-6)


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (1, 2, 4)]
)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_c1_fixture_l_numbers(strategy, num_shards):
    model, optimizer = zero_linear()
    loss = STEPS[strategy](model, optimizer, XL, YL, make_mesh(num_shards))
    np.testing.assert_allclose(loss, 7.5, rtol=1e-6)
    np.testing.assert_allclose(model.kernel[...], [[0.6], [0.25]], rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)
    # update / baseline update == 1 (the baseline update is -lr * grad from zero)
    np.testing.assert_allclose(model.kernel[...] / (-0.1 * GRAD_KERNEL_L), 1.0, rtol=1e-6)
    np.testing.assert_allclose(model.bias[...] / (-0.1 * GRAD_BIAS_L), 1.0, rtol=1e-6)
    assert int(optimizer.step[...]) == 1


# ------------------------------------------------------------------------ C2: gradient already summed in map


def per_device_grads(strategy, model, x, y, mesh, check_vma=True):
    """The reduced gradients each device holds inside the step (global arrays; one shard per device)."""
    num_shards = mesh.shape["data"]
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    specs = [P() if strategy == "dp" else fsdp_partition_spec(a.shape, num_shards) for a in leaves]

    def body(leaves, x, y):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        _, grads = sharded_steps.sharded_value_and_grad(mse_batch_loss, m, (x, y), tuple(specs), ("data",))
        return jax.tree.leaves(grads)

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs, check_vma=check_vma
        )
    )
    grads = fn(jax.device_put(leaves, [NamedSharding(mesh, s) for s in specs]), x, y)
    return dict(zip(["bias", "kernel"], grads, strict=True))  # nnx path order


@pytest.mark.parametrize("num_shards", SIZES)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_c2_every_device_holds_the_baseline_gradient(strategy, num_shards):
    x, y = fixture_l(num_shards)
    model, optimizer = zero_linear()
    mesh = make_mesh(num_shards)
    grads = per_device_grads(strategy, model, x, y, mesh)
    for name, want in (("kernel", GRAD_KERNEL_L), ("bias", GRAD_BIAS_L)):
        assert len(grads[name].addressable_shards) == num_shards
        for shard in grads[name].addressable_shards:
            np.testing.assert_allclose(
                shard.data, want[shard.index], rtol=1e-6, err_msg=f"{name} on {shard.device}"
            )
    # ... and the step applies it once: every device's parameters equal the baseline's (slice).
    STEPS[strategy](model, optimizer, x, y, mesh)
    for name, want in (("kernel", [[0.6], [0.25]]), ("bias", [0.5])):
        for shard in getattr(model, name)[...].addressable_shards:
            np.testing.assert_allclose(shard.data, np.asarray(want)[shard.index], rtol=1e-6)


@require_devices(2)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_c2_formulation_is_right_without_replication_checking_too(strategy):
    """With check_vma=False there is no implicit psum; pcast + one reduction still gives the mean."""
    model, _ = zero_linear()
    grads = per_device_grads(strategy, model, XL, YL, make_mesh(2), check_vma=False)
    np.testing.assert_allclose(grads["kernel"], GRAD_KERNEL_L, rtol=1e-6)
    np.testing.assert_allclose(grads["bias"], GRAD_BIAS_L, rtol=1e-6)


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (2, 4, 8)]
)
def test_c2_traps_give_s_times_the_gradient(num_shards):
    """The two silent mistakes of C2 produce S * the mean; the step's formulation gives the mean."""
    implicit_psum_then_pmean = run_reduction_variant(pmean, num_shards, replicated_grad=True)[1]
    psum_loss_then_pmean = run_reduction_variant(pmean, num_shards, replicated_grad=True, psum_loss=True)[1]
    right = run_reduction_variant(pmean, num_shards)[1]
    for grads, factor in (
        (implicit_psum_then_pmean, num_shards),
        (psum_loss_then_pmean, num_shards),
        (right, 1),
    ):
        np.testing.assert_allclose(grads["bias"][...], factor * GRAD_BIAS_L, rtol=1e-6)
        np.testing.assert_allclose(grads["kernel"][...], factor * GRAD_KERNEL_L, rtol=1e-6)


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (2, 4, 8)]
)
def test_dp_replicas_bitwise_identical(num_shards):
    model, optimizer = fresh("mlp", "adam")
    mesh = make_mesh(num_shards)
    data_parallel_sgd_step(model, optimizer, *problem(), mesh)
    for path, var in nnx.to_flat_state(nnx.state((model, optimizer))):
        array = var[...]
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, P()), array.ndim), path
        shards = [np.asarray(s.data) for s in array.addressable_shards]
        assert len(shards) == num_shards
        for s in shards[1:]:
            assert s.tobytes() == shards[0].tobytes(), f"{path}: replicas differ"


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (2, 8)]
)
def test_fsdp_shards_equal_baseline_slices_and_replicated_leaves_agree(num_shards):
    _, want, _ = baseline("mlp", "adam")
    model, optimizer = fresh("mlp", "adam")
    fsdp_sgd_step(model, optimizer, *problem(), make_mesh(num_shards))
    for path, var in nnx.to_flat_state(nnx.state((model, optimizer))):
        array, key = var[...], ".".join(map(str, path))
        for shard in array.addressable_shards:
            np.testing.assert_allclose(shard.data, want[key][shard.index], rtol=1e-6, atol=1e-7, err_msg=key)
        if array.sharding.is_fully_replicated:
            first = np.asarray(array.addressable_shards[0].data).tobytes()
            assert all(np.asarray(s.data).tobytes() == first for s in array.addressable_shards), key


# ---------------------------------------------------------------------------- C3: one reduction per leaf


REDUCTIONS = ("psum", "psum_invariant", "reduce_scatter")


def collectives(jaxpr) -> list[tuple[str, tuple[int, ...]]]:
    """(primitive, operand shape) of every collective in a jaxpr and its sub-jaxprs."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in (*REDUCTIONS, "all_gather"):
            out += [(eqn.primitive.name, tuple(v.aval.shape)) for v in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += collectives(inner)
    return out


def hlo_collective_operands(text: str) -> dict[str, int]:
    """Operand counts of all-reduce / reduce-scatter / all-gather in compiled HLO (XLA may tuple several)."""
    counts = {"all-reduce": 0, "reduce-scatter": 0, "all-gather": 0}
    for op, operands in re.findall(r"\s(all-reduce|reduce-scatter|all-gather)(?:-start)?\(([^)]*)\)", text):
        counts[op] += operands.count("%")
    return counts


def reductions_per_shape(found):
    shapes = {}
    for prim, shape in found:
        if prim in REDUCTIONS:
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


@pytest.mark.parametrize(
    "num_shards", [pytest.param(s, marks=require_devices(s), id=f"S{s}") for s in (2, 4, 8)]
)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_c3_one_gradient_reduction_per_leaf_in_jaxpr_and_hlo(strategy, num_shards):
    """MLP(8, 16, 4) with Adam: jaxpr and compiled HLO hold exactly one reduction per gradient leaf + the loss."""
    model, optimizer = fresh("mlp", "adam")
    x, y = problem()
    traced = mesh_steps.trace_sgd_step(strategy, model, optimizer, x, y, make_mesh(num_shards))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    specs = [fsdp_partition_spec(p.shape, num_shards) for p in params]
    sharded = [p for p, s in zip(params, specs, strict=True) if strategy == "fsdp" and s != P()]
    found = collectives(traced.jaxpr.jaxpr)
    # The reduced operand: the whole gradient (all-reduce) or the whole gradient scattered (reduce-scatter).
    want = {(): 1}
    for p in params:
        want[p.shape] = want.get(p.shape, 0) + 1
    assert reductions_per_shape(found) == want
    assert sum(prim == "reduce_scatter" for prim, _ in found) == len(sharded)
    assert sum(prim == "all_gather" for prim, _ in found) == len(sharded)
    hlo = hlo_collective_operands(traced.lower().compile().as_text())
    assert hlo == {
        "all-reduce": len(params) - len(sharded) + 1,
        "reduce-scatter": len(sharded),
        "all-gather": len(sharded),
    }
    if strategy == "fsdp" and num_shards == 8:
        assert len(sharded) == 3  # out.bias (4,) is replicated on 8 devices and all-reduced


@require_devices(4)
def test_c3_reductions_applied_twice_fixture_l():
    """Fixture L, S=4: sum+sum 16x (-80), sum then mean 4x (-20), mean then mean harmless (-5)."""
    variants = {
        "sum_sum": (lambda g: psum(psum(g)), -80.0),
        "sum_mean": (lambda g: pmean(psum(g)), -20.0),
        "mean_mean": (lambda g: pmean(pmean(g)), -5.0),
        "mean": (pmean, -5.0),
    }
    for name, (reduce, bias) in variants.items():
        _, grads, jaxpr = run_reduction_variant(reduce, 4)
        np.testing.assert_allclose(grads["bias"][...], [bias], rtol=1e-6, err_msg=name)
        # the counting of test_c3_one_gradient_reduction_per_leaf catches the doubled ones
        per_leaf = reductions_per_shape(collectives(jaxpr.jaxpr))
        assert per_leaf[(1,)] == (1 if name == "mean" else 2), name
    model, optimizer = zero_linear()
    data_parallel_sgd_step(model, optimizer, XL, YL, make_mesh(4))
    np.testing.assert_allclose(model.bias[...], [0.5], rtol=1e-6)


# ---------------------------------------------------------------------------------------------- bad input


class Counter(nnx.Variable):
    pass


class CountingLinear(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return self.linear(x)


class Normed(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
        self.norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.norm(self.linear(x))


def _bad_cases(strategy, fn):
    x, y = problem()
    mesh4 = make_mesh(4)
    linear = lambda: fresh("linear", "sgd")  # noqa: E731
    with_opt = lambda m: (m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))  # noqa: E731
    cases = {
        "uneven batch": (
            linear(),
            (x[:10], y[:10], mesh4),
            {},
            ValueError,
            rf"{fn}: batch size 10 is not divisible by the 4 devices of mesh axis 'data'.*1, 2, 5, 10",
        ),
        "missing axis": (
            linear(),
            (x, y, make_mesh(4, axis_name="model")),
            {},
            ValueError,
            rf"{fn}: mesh has axes \('model',\), not axis_name='data'",
        ),
        "wrong axis_name": (
            linear(),
            (x, y, mesh4),
            {"axis_name": "batch"},
            ValueError,
            "not axis_name='batch'",
        ),
        "not a mesh": (linear(), (x, y, "mesh"), {}, TypeError, rf"{fn}: mesh must be a jax.sharding.Mesh"),
        "non-Param state": (
            with_opt(CountingLinear()),
            (x, y, mesh4),
            {},
            ValueError,
            rf"{fn}: model CountingLinear holds non-Param state .*calls \(Counter\)",
        ),
        "batch stats": (
            with_opt(Normed()),
            (x, y, mesh4),
            {},
            ValueError,
            rf"{fn}: model Normed is refused.*BatchStat",
        ),
        "not an optimizer": (
            (make_model("linear", 8, 4), optax.sgd(0.1)),
            (x, y, mesh4),
            {},
            TypeError,
            rf"{fn}: optimizer must be an nnx.Optimizer",
        ),
        "1-D y": (linear(), (x, y[:, 0], mesh4), {}, ValueError, rf"{fn}: y must be 2-D"),
    }
    if strategy == "fsdp":
        cases["min_size"] = (
            linear(),
            (x, y, mesh4),
            {"min_size": -1},
            ValueError,
            rf"{fn}: min_size must be an int >= 0, got -1",
        )
        cases["min_size type"] = (
            linear(),
            (x, y, mesh4),
            {"min_size": 1.5},
            TypeError,
            "min_size must be an int",
        )
    return cases


@require_devices(4)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_bad_input_raises_and_changes_nothing(strategy):
    fn = STEPS[strategy].__name__
    for name, ((model, optimizer), args, kwargs, err, match) in _bad_cases(strategy, fn).items():
        before = snapshot(model, optimizer) if isinstance(optimizer, nnx.Optimizer) else None
        with pytest.raises(err, match=match):
            STEPS[strategy](model, optimizer, *args, **kwargs)
        if before is not None:
            after = snapshot(model, optimizer)  # readable: nothing was donated
            assert after.keys() == before.keys(), name
            for key in before:
                np.testing.assert_array_equal(after[key], before[key], err_msg=f"{name}: {key} changed")
            assert int(optimizer.step[...]) == 0, name


@require_devices(4)
def test_dp_accepts_non_elementwise_optimizers():
    """Global-norm clipping is fine in DP: every replica holds the whole mean gradient."""
    x, y = problem()
    results = []
    for step in (sgd_step, lambda m, o, x, y: data_parallel_sgd_step(m, o, x, y, make_mesh(4))):
        model = make_model("linear", 8, 4)
        optimizer = nnx.Optimizer(
            model, optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1)), wrt=nnx.Param
        )
        step(model, optimizer, x, y)
        results.append(snapshot(model, optimizer))
    for key in results[0]:
        np.testing.assert_allclose(results[1][key], results[0][key], rtol=1e-6, atol=1e-7)


def test_trace_sgd_step_rejects_unknown_strategy():
    model, optimizer = zero_linear()
    with pytest.raises(ValueError, match="trace_sgd_step: strategy='zero3' is unknown; use one of dp, fsdp"):
        mesh_steps.trace_sgd_step("zero3", model, optimizer, XL, YL, make_mesh(1))
