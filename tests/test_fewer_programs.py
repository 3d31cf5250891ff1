"""The check's own programs, fused or avoided (``benchmarks/README.md``, "Fewer programs"): each gives the values of
what it replaces, bit for bit.

- ``_tree.copy_arrays``: new buffers, the same values, sharding and committedness, and no XLA program;
- ``propagation.gradient_tolerance``: ``grad_delta``, ``max |g|`` and the allowance ``extra`` adds, in one
  program (the sensitivity pass reads ``delta``);
- ``allowances._accumulated``: ``before + max(step, floor) + rounding`` with entries missing, one program per tree.
"""

import collections
import contextlib
import logging
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax import monitoring
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck._tree import copy_arrays
from shardcheck.parity.tolerance.allowances import _accumulate, _accumulated
from shardcheck.parity.tolerance.propagation import grad_delta, gradient_tolerance, update_sensitivity

_COMPILES = []
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: (
        _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
)


def _compiles() -> int:
    return len(_COMPILES)


@require_devices(4)
def test_copy_arrays_copies_every_array_in_place_and_compiles_nothing():
    mesh = jax.make_mesh((4,), ("d",))
    split = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("d")))
    committed = jax.device_put(jnp.arange(5, dtype=jnp.int32), jax.devices()[2])
    loose = jnp.linspace(0.0, 1.0, 7)  # uncommitted
    tree = {"split": split, "committed": committed, "loose": loose, "name": "kept", "n": 3}
    before = _compiles()
    out = copy_arrays(tree)
    jax.block_until_ready(out)
    assert _compiles() == before
    assert out["name"] == "kept" and out["n"] == 3
    for k in ("split", "committed", "loose"):
        a, b = tree[k], out[k]
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        assert b.dtype == a.dtype and b.sharding == a.sharding and b.committed == a.committed
        ours = {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
        assert all(s.data.unsafe_buffer_pointer() != ours[s.device] for s in b.addressable_shards)
    assert not out["loose"].committed  # still free to join a computation on other devices
    tree["split"].delete()  # what a donating step does to its inputs
    np.testing.assert_array_equal(np.asarray(out["split"]), np.arange(32.0).reshape(8, 4))


def _adam_inputs(seed: int):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    tx = optax.adam(1e-2)
    state = tx.init(params)
    # a step of history: w with momentum (Adam's update is then not monotone in g); b none, its gradient 0
    warm = {"w": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    _, state = tx.update(warm, state, params)
    grads = {"w": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    return tx, grads, state, params, rng


@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_tolerance_is_grad_delta_and_the_allowance_extra_adds(seed, with_extra):
    tx, grads, state, params, rng = _adam_inputs(seed)
    rtol, atol = 1e-5, 1e-7
    extra = None
    if with_extra:
        extra = jax.tree.map(
            lambda g: jnp.asarray(np.abs(rng.normal(size=g.shape)) * 1e-4, jnp.float32), grads
        )
    delta, grad_max, allowance = gradient_tolerance(grads, extra, rtol, atol)
    for k in grads:
        np.testing.assert_array_equal(
            np.asarray(delta[k]), np.asarray(grad_delta(grads, extra, rtol, atol, 1.0)[k])
        )
        assert float(grad_max[k]) == float(np.max(np.abs(np.asarray(grads[k]))))
    if extra is None:
        assert allowance is None
    else:
        base = grad_delta(grads, None, rtol, atol, 0.0)
        for k in grads:
            np.testing.assert_array_equal(np.asarray(allowance[k]), np.asarray(delta[k] - base[k]))
            # the allowance is what extra adds, to float32 rounding of the tolerance it rides on
            np.testing.assert_allclose(np.asarray(allowance[k]), np.asarray(extra[k]), rtol=0, atol=1e-6)
    # propagated: the rounding-level leaf b (g = 0 under momentum) moves by about lr, the ordinary one far less
    updates, _, _ = update_sensitivity(tx, grads, state, params, delta)
    assert float(jnp.max(updates["b"])) > 1e-3 > float(jnp.max(updates["w"]))


# normal float32 values only: XLA:CPU flushes subnormals to zero, NumPy keeps them (a clean environment's
# hypothesis found step 1.03e-39 -> 0 against NumPy's 1.03e-39), and no allowance is that small
def _normal(top):
    return st.floats(0, float(np.float32(top)), width=32, allow_subnormal=False)


_ENTRY = hnp.arrays(np.float32, (3,), elements=_normal(4))


@settings(max_examples=40, deadline=None)
@given(
    step=st.tuples(_ENTRY, _ENTRY),
    before=st.tuples(_ENTRY, _ENTRY),
    has_before=st.tuples(st.booleans(), st.booleans()),
    floor=st.tuples(_normal(4), _normal(4)),
    has_floor=st.tuples(st.booleans(), st.booleans()),
    rounding=st.tuples(_normal(1e-3), _normal(1e-3)),
)
def test_accumulated_is_before_plus_floored_step_plus_rounding(
    step, before, has_before, floor, has_floor, rounding
):
    """Against a float32 NumPy oracle of the rule, entry by entry, with any entries of ``before`` and ``floor``
    missing: equal bit for bit."""
    paths = ("a", "b")
    step_d = {p: jnp.asarray(s) for p, s in zip(paths, step, strict=True)}
    before_d = {p: jnp.asarray(b) for p, b, h in zip(paths, before, has_before, strict=True) if h}
    floor_d = {p: f for p, f, h in zip(paths, floor, has_floor, strict=True) if h}
    rounding_d = dict(zip(paths, rounding, strict=True))
    out = _accumulated(before_d, step_d, floor_d, rounding_d)
    assert set(out) == set(paths)
    for i, p in enumerate(paths):
        s = np.maximum(step[i], np.float32(floor_d[p])) if p in floor_d else step[i]
        expected = (s if p not in before_d else before[i] + s) + np.float32(rounding[i])
        np.testing.assert_array_equal(np.asarray(out[p]), expected.astype(np.float32))


def test_accumulated_compiles_once_per_tree():
    """A first step (no earlier allowance), a later one, and one with a floor on a single leaf: one program."""
    step = {"a": jnp.ones((2, 3)), "b": jnp.ones((4,))}
    rounding = {"a": 0.0, "b": 1e-6}
    _accumulate.clear_cache()
    first = _accumulated({}, step, {}, rounding)
    later = _accumulated(first, step, {}, rounding)
    _accumulated(later, step, {"b": 2.0}, rounding)
    assert _accumulate._cache_size() == 1


def _mlp_task(steps: int):
    """A small MLP regression task (4 -> 8 -> 2, Adam, batches of 8 rows): ``steps`` copies of one batch."""
    from flax import nnx

    import shardcheck
    from shardcheck.losses import mse_batch_loss
    from shardcheck.models import MLP

    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))
    ] * steps
    return shardcheck.Task(
        model=lambda: MLP(4, 8, 2, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(1e-2),
        loss_fn=mse_batch_loss,
        batches=batches,
    )


@require_devices(2)
@pytest.mark.parametrize("strategy", ["accumulation", "simulation", "dp", "fsdp", "gspmd"])
def test_a_second_check_of_a_task_compiles_nothing(strategy):
    """#35: one trace and compile per task and strategy. The accumulation step compiled again on every check (a
    new optax.MultiSteps in its optimizer's graphdef each time: 1 program and about 4 s of a warm tiny-lm check);
    every built-in's second check now loads no program, the persistent cache's included (the event counts those
    too)."""
    import shardcheck

    task = _mlp_task(2)
    before = _compiles()
    first = shardcheck.check_parity(strategy, task, num_shards=2)
    assert first.verdict == "PASS" and _compiles() > before, str(first)
    before = _compiles()
    second = shardcheck.check_parity(strategy, task, num_shards=2)
    assert second.verdict == "PASS" and _compiles() == before
    assert [[(e.path, e.max_abs_err) for e in r.leaves] for r in second.steps] == [
        [(e.path, e.max_abs_err) for e in r.leaves] for r in first.steps
    ]


class _CompileNames(logging.Handler):
    """The names of the programs JAX compiles while attached (``jax_log_compiles``'s "Compiling NAME" records)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        found = re.match(r"Compiling (?:jit\()?(\w+)\)? ", record.getMessage())
        if found:
            self.names.append(found.group(1))


@contextlib.contextmanager
def _compiled_names():
    """The names of the programs JAX compiles inside the ``with`` block, a list filled as they compile."""
    handler, logger = _CompileNames(), logging.getLogger("jax")
    logger.addHandler(handler)
    saved = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler.names
    finally:
        jax.config.update("jax_log_compiles", saved)
        logger.removeHandler(handler)


def _cold_check_programs(strategy: str, num_shards: int, **kwargs) -> collections.Counter:
    """``{program name: compilations}`` of one ``check_parity`` of a small MLP task after ``jax.clear_caches()``,
    the task's own construction (model, optimizer) compiled before counting."""
    from flax import nnx

    import shardcheck

    task = _mlp_task(3)
    jax.clear_caches()
    nnx.Optimizer(task.model(), task.optimizer, wrt=nnx.Param)  # the user's eager construction, not counted
    with _compiled_names() as names:
        report = shardcheck.check_parity(strategy, task, num_shards=num_shards, **kwargs)
    assert report.verdict == "PASS", str(report)
    return collections.Counter(names)


# the steps themselves: the reference's and the candidate's (not the check's own)
_STEPS = {"_reference_jit", "_simulation_jit", "_accumulated_jit", "step"}
# float32: the loss probe, the row-coupling probe (the strategies here compute the loss per shard), the snapshot
# copy, the first pass's statistics, the gradient's tolerance and its sensitivity, the accumulated allowance of the
# parameters and of the optimizer state (the accumulation strategy's optimizer wrapper adds one eager cast, of its
# step count; optax.MultiSteps.init's skip flag, a second, is no longer built), the optimizer rerun on the
# candidate's own gradients (the update check of a passing step)
_F32 = {
    "_probe_loss": 1,
    "_full_and_combined": 1,
    "_copy": 1,
    "_stats": 1,
    "gradient_tolerance": 1,
    "update_sensitivity": 1,
    "_unless_skipped": 1,  # the sensitivity taken as 0 at a step whose gradients are not finite (trial 48)
    "_accumulate": 2,
    "_rerun_within_jit": 1,
}
# tf32 matmuls (a GPU's default): also the correct split, the gradient at the other matmul precision, the
# gradient at the candidate's parameters, the measured noise, the output rounding, the two tree additions
# (noise + rounding, sensitivity + shadow spread) and the shadow's spread
_TF32 = {
    **_F32,
    "_split_magnitude": 1,
    "gradients_at": 1,
    "_grads_at": 1,
    "measured_noise": 1,
    "output_rounding": 1,
    "map": 2,
    "shadow_spread": 1,
}


def _accumulation(programs: dict) -> dict:
    """The accumulation strategy's: its step donates nothing, so its state before a step is read without the
    snapshot's copy (``Candidate.donates``), and its optimizer wrapper adds one eager cast (``_F32``)."""
    return {**{k: v for k, v in programs.items() if k != "_copy"}, "convert_element_type": 1}


@require_devices(4)
@pytest.mark.parametrize(
    ("strategy", "kwargs", "expected"),
    [
        ("simulation", {}, _F32),
        ("simulation", {"matmul_precision": "tf32"}, _TF32),
        ("accumulation", {}, _accumulation(_F32)),
        ("accumulation", {"matmul_precision": "tf32"}, _accumulation(_TF32)),
        ("dp", {}, _F32),
        ("dp", {"matmul_precision": "tf32"}, _TF32),
    ],
)
def test_a_cold_check_compiles_each_of_its_own_programs_once(strategy, kwargs, expected):
    """#35: the check's own programs of a cold check (3 steps), counted by name: each compiled once. Before, the
    candidate's snapshots compiled one program per tree (2; 4 on a mesh, whose first snapshot is uncommitted), the
    deferred sensitivity's zeros one per tree (2), and under tf32 a step whose candidate drifted brought committed
    arrays that compiled the tolerance's programs again (simulation: 26 programs of its own, now 15; dp: 29, now
    16)."""
    names = _cold_check_programs(strategy, 4, **kwargs)
    own = {k: v for k, v in names.items() if k not in _STEPS}
    assert own == expected, names


@require_devices(2)
def test_a_replayed_users_step_copies_its_state_without_a_program_per_leaf():
    """A replay's run of the user's step (``record_run`` with ``update_checks``, as ``verify --against``) copies
    the state before each step for its update check by the runtime (``_tree.copy_arrays``). An eager
    ``jax.tree.map(jnp.copy, ...)`` compiled one program per leaf shape and placement: 48 of a 3-step replay of
    examples/annotated_lm.py's step, 68 programs in all, now 20."""
    from flax import nnx
    from jax.sharding import Mesh

    from shardcheck.losses import mse_batch_loss
    from shardcheck.parity.harness import recorded

    task = _mlp_task(2)

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(mse_batch_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    def step(model, optimizer, batch, mesh):  # replicated state, rows split: XLA's all-reduce
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
        return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    checks: list = []
    with (
        _compiled_names() as names,
        mock.patch.object(recorded, "pre_update", wraps=recorded.pre_update) as copied,
    ):
        recorded.record_run(task, step, mesh=mesh, steps=2, update_checks=checks)
    assert (
        copied.call_count == 2 and checks == []
    )  # both steps' states copied and their updates checked: passed
    assert "copy" not in names, collections.Counter(names)
