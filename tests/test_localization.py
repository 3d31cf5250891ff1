"""No diagnosis sentence the records contradict (issue #36, a first step).

Two shapes of public bug reports, planted in a small model on a data-parallel mesh: a decoupled weight decay
applied to the 1-D leaves too while the gradients and Adam's state match (the report names the parameters stage
and the 1-D group, never "only the loss matches"), and a gradient scaled on part of one leaf (no "x k" is
claimed: the ratio's spread is named). Beside them, the pieces on their own: :func:`shared_property`,
:func:`constant_ratio` and the ratio's spread of :func:`leaf_error` against a float64 NumPy oracle.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import check_parity, make_mesh
from shardcheck.parity.comparison.live import leaf_error, spread_ranks
from shardcheck.parity.diagnosis.evidence import LeafError, constant_ratio
from shardcheck.parity.diagnosis.grouping import shared_property
from shardcheck.task import Task

LR, WD = 0.05, 0.1

# ------------------------------------------------------------------------------------- the grouping sentence


def test_shared_property_names_the_ndim_the_failing_leaves_share():
    failing = {"block.ln.scale": (8,), "block.proj.bias": (8,)}
    matching = {"block.proj.kernel": (8, 8), "embed.embedding": (16, 8)}
    assert shared_property(failing, matching) == (
        "every failing leaf is 1-D (bias, scale); every leaf of ndim >= 2 matches"
    )
    assert shared_property(matching, failing) == (
        "every failing leaf is 2-D (embedding, kernel); every leaf of ndim <= 1 matches"
    )
    assert shared_property(failing, {}) == "every failing leaf is 1-D (bias, scale)"


def test_shared_property_names_a_suffix_or_a_module_else_says_none_separates():
    # the same ndim on both sides: the name suffix separates them
    assert (
        shared_property({"a.bias": (4,)}, {"a.scale": (4,)})
        == "every failing leaf is a bias; every scale matches"
    )
    # one suffix on both sides: the module prefix separates them
    failing = {"blocks.1.attn.kernel": (4, 4), "blocks.1.mlp.kernel": (4, 4)}
    matching = {"blocks.0.attn.kernel": (4, 4), "blocks.0.mlp.kernel": (4, 4)}
    assert (
        shared_property(failing, matching) == "every failing leaf is under blocks.1; every other leaf matches"
    )
    # nothing separates them: said so, with the names
    assert shared_property({"a.kernel": (4, 4), "b.bias": (4,)}, {"c.kernel": (4, 4), "c.bias": (4,)}) == (
        "the failing leaves (a.kernel, b.bias) share no ndim, name or module that the matching ones lack"
    )
    assert shared_property({"a.b.kernel": (4, 4)}, {"a.b.c.kernel": (4, 4)}) == (
        "only a.b.kernel differs; every other leaf matches"
    )
    with pytest.raises(ValueError, match="shared_property: failing is empty"):
        shared_property({}, {"a": (1,)})


# ------------------------------------------------------------------------------------- the ratio's spread


def test_the_spread_is_the_10th_and_90th_percentile_of_the_elementwise_ratio():
    """Float64 NumPy oracle: 100 elements, the first 30 of the candidate's change x3, the rest x1."""
    rng = np.random.default_rng(0)
    before = rng.normal(size=100)
    dr = rng.uniform(0.5, 1.0, size=100) * rng.choice([-1, 1], size=100)
    dc = dr * np.where(np.arange(100) < 30, 3.0, 1.0)
    e = leaf_error(0, "param", "w", before + dr, before + dc, 1e-6, 1e-7, before, before)
    q = np.sort(dc / dr)
    lo, hi = spread_ranks(100)
    assert (lo, hi) == (9, 90)
    assert e.spread == (q[lo], q[hi]) and e.spread == pytest.approx((1.0, 3.0), rel=1e-12)
    assert e.ratio == pytest.approx(1.0, rel=1e-12) and e.shape == (100,)
    assert not constant_ratio(e)
    # the whole leaf x3: one factor, spread 0
    even = leaf_error(0, "param", "w", before + dr, before + 3 * dr, 1e-6, 1e-7, before, before)
    assert even.spread == pytest.approx((3.0, 3.0), rel=1e-12) and constant_ratio(even)


def test_a_spread_within_the_ratios_rounding_is_a_constant_factor():
    base = LeafError(0, "grad", "w", 1.0, 1.0, 1e-6, False, 2.0, None, (1.999, 2.001))
    assert constant_ratio(base)  # within RATIO_RTOL of the median
    assert not constant_ratio(dataclasses.replace(base, spread=(1.0, 2.0)))
    # a loose tolerance widens what rounding alone can spread: tolerance 0.004 of max|ref| 1, read down to 1%
    assert constant_ratio(dataclasses.replace(base, spread=(1.9, 2.1), tolerance=4e-3))
    assert constant_ratio(dataclasses.replace(base, spread=None))  # not measured: the median stands


# ------------------------------------------------------------------------------------- planted on a dp mesh


class Net(nnx.Module):
    """Linear(4, 8) -> LayerNorm(8) -> tanh -> Linear(8, 2), biases drawn (not 0: a decay of them shows)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.5)
        self.inp = nnx.Linear(4, 8, bias_init=init, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 2, bias_init=init, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.norm(self.inp(x))))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task() -> Task:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    # AdamW decaying the matrices only (the usual mask: no decay of biases and norm scales)
    tx = optax.adamw(LR, weight_decay=WD, mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p))
    return Task(model=lambda: Net(nnx.Rngs(0)), optimizer=tx, loss_fn=_loss, batches=[{"x": x, "y": y}])


def _dp_step(fault: str):
    """A user's data-parallel step: per-device gradients in ``jax.shard_map``, pmean-ed, then AdamW; ``fault``:
    ``"decay_1d"`` decays the 1-D leaves too after the update (the mask left out), ``"part"`` doubles the
    gradient of the first 3 rows of ``inp.kernel`` (of 4) before the update, ``"none"`` is the right step."""

    def step(model, optimizer, batch, mesh):
        axis = mesh.axis_names[0]
        loss = _loss(model, batch)
        graphdef, params = nnx.split(model, nnx.Param)

        def body(params, b):
            g = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), b))(params)
            return jax.tree.map(lambda a: jax.lax.pmean(a, axis), g)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(), check_vma=False)
        grads = jax.jit(mapped)(params, batch)
        if fault == "part":
            rows = (jnp.arange(4) < 3).astype(jnp.float32)[:, None]
            grads["inp"]["kernel"][...] = grads["inp"]["kernel"][...] * (1 + rows)
        optimizer.update(model, grads)
        if fault == "decay_1d":  # decoupled weight decay on every leaf, the 1-D ones included
            for _, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
                if p[...].ndim == 1:
                    p[...] = p[...] - LR * WD * p[...]
        return {"loss": loss, "grads": grads}

    return step


@require_devices(2)
def test_the_right_dp_step_passes():
    assert check_parity(_dp_step("none"), _task(), mesh=make_mesh(2)).codes == ("parity",)


@require_devices(2)
def test_a_weight_decay_of_the_1d_leaves_is_localized_to_the_parameters_not_only_the_loss():
    report = check_parity(_dp_step("decay_1d"), _task(), mesh=make_mesh(2))
    step = report.steps[0]
    assert report.verdict == "FAIL"
    # the evidence: the loss, every gradient and every Adam moment match; only the 1-D parameters differ
    assert all(e.ok for e in step.leaves if e.kind in ("loss", "grad", "opt_state", "counter"))
    bad = sorted(e.path for e in step.leaves if not e.ok)
    assert bad == ["inp.bias", "norm.bias", "norm.scale", "out.bias"]
    assert report.codes[0] == "localized", report.diagnosis
    assert "loss_only" not in report.codes and "Only the loss matches" not in report.diagnosis
    message = report.diagnoses[0].message
    assert (
        "the loss, the gradients and the optimizer state match; the parameters differ (4 of 6 leaves)"
        in message
    )
    assert "the update was applied differently" in message
    assert "Every failing leaf is 1-D (bias, scale); every leaf of ndim >= 2 matches." in message
    # the change of each 1-D leaf is the Adam update plus -lr wd p: no one factor is claimed across them
    assert "x the reference's, a constant factor" not in message


@require_devices(2)
def test_a_gradient_scaled_on_part_of_a_leaf_claims_no_factor_and_names_the_spread():
    report = check_parity(_dp_step("part"), _task(), mesh=make_mesh(2))
    step = report.steps[0]
    kernel = next(e for e in step.leaves if e.name == "grad inp.kernel")
    assert not kernel.ok and kernel.shape == (4, 8)
    # 24 of 32 elements x2, 8 x1: median 2, 10th percentile 1, 90th 2
    assert kernel.ratio == pytest.approx(2.0, rel=1e-5)
    assert kernel.spread == pytest.approx((1.0, 2.0), rel=1e-5)
    assert not constant_ratio(kernel)
    codes = set(report.codes)
    assert not codes & {"scaled", "summed", "averaged_twice", "clip_coefficient", "loss_only"}, (
        report.diagnosis
    )
    assert "x the reference's: a constant factor" not in report.diagnosis
    assert report.codes[0] == "localized", report.diagnosis
    message = report.diagnoses[0].message
    assert "the loss matches; the gradients differ (1 of 6 leaves)" in message
    assert "Only inp.kernel differs; every other leaf matches." in message
    assert (
        "grad inp.kernel has no constant factor: its elementwise ratio runs from 1 to 2 (10th-90th" in message
    )


def test_failing_leaves_of_two_kinds_that_share_nothing_together_are_grouped_per_kind():
    """A clip coefficient from a mean of per-device norms (``tests/test_clipping_faults.py``): Adam's first
    moments and one kernel fail from equal gradients, the second moments and the other parameters match. Taken
    together the failing leaves share no ndim, name or module; each kind's do, and that is said."""
    from shardcheck.parity.diagnosis.evidence import StepRecord
    from shardcheck.parity.diagnosis.localization import localize

    def leaf(kind, path, shape, ok):
        err = 1e-4 if ok else 1.0
        return LeafError(0, kind, path, err, err, 1e-3, ok, None if ok else 1.415, None, None, shape)

    params = [leaf("param", "a.kernel", (4, 4), False), leaf("param", "b.kernel", (4, 4), True)]
    params.append(leaf("param", "b.bias", (4,), True))
    state = [leaf("opt_state", f"0.{m}.{p}", s, m == "nu") for m in ("mu", "nu") for p, s in SHAPES.items()]
    grads = [leaf("grad", p, s, True) for p, s in SHAPES.items()]
    leaves = (leaf("loss", "loss", (), True), *grads, *params, *state)
    record = StepRecord(0, 1e-5, 1e-6, 1.0, 1.0, leaves, 1, 1, optimizer_rerun=(*params, *state))
    loc = localize([record])
    assert loc.stage == "optimizer"
    assert loc.group == (
        "optimizer-state leaves: every failing leaf is under 0.mu; every other leaf matches; and parameter leaves: "
        "every failing leaf is under a; every other leaf matches"
    )


SHAPES = {"a.kernel": (4, 4), "b.kernel": (4, 4), "b.bias": (4,)}
