"""optax.multi_transform (one optimizer per parameter group) through the built-in strategies and memory (trial 11).

A multi_transform keeps, for each group, ``MaskedNode`` where its inner optimizer does not update a parameter:
an entry of ``nnx.to_flat_state`` that is no leaf of ``jax.tree.leaves``. The placement listed one spec per flat
entry and applied them to the tree's leaves, so every spec after the first ``MaskedNode`` landed on another leaf:
``memory`` raised ``AttributeError: 'MaskedNode' object has no attribute 'shape'`` and dp, fsdp and gspmd ended
in ``zip() argument 2 is longer than argument 1``. Now one spec per leaf (``steps.sharded.flat_leaves``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

from shardcheck import Task, check_parity, estimate_memory, make_mesh
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps import Candidate
from shardcheck.steps.sharded import flat_leaves, state_specs


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.body = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.body(x)))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def labels(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "head" if "head" in str(path) else "body", params)


@functools.cache
def _task() -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
        for _ in range(2)
    ]
    tx = optax.multi_transform({"body": optax.adamw(1e-2), "head": optax.sgd(5e-2, momentum=0.9)}, labels)
    return Task(model=lambda: Net(nnx.Rngs(0)), optimizer=tx, loss_fn=mse, batches=batches, name="mt")


def test_one_spec_per_leaf_of_the_state_tree():
    model = _task().new_model()
    optimizer = _task().new_optimizer(model)
    state = nnx.state((model, optimizer))
    assert len(nnx.to_flat_state(state)) > len(jax.tree.leaves(state))  # the MaskedNode entries
    assert len(flat_leaves(state)) == len(jax.tree.leaves(state))
    specs, _ = state_specs("fsdp", model, optimizer, make_mesh({"data": 2}))
    assert len(specs) == len(jax.tree.leaves(state))


@require_devices(2)
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "gspmd"])
def test_multi_transform_passes_the_builtins(strategy):
    report = check_parity(strategy, _task(), mesh=make_mesh({"data": 2}))
    assert report.ok and report.verdict == "PASS", report.diagnosis
    assert {e.kind for r in report.steps for e in r.leaves} >= {"opt_state", "param", "grad"}


def test_memory_estimate_counts_only_the_arrays():
    est = estimate_memory(_task(), mesh={"data": 2}, strategy="fsdp")
    opt = [leaf for leaf in est.leaves if leaf.category == "optimizer"]
    # adamw's mu and nu for body's kernel and bias, sgd's trace for head's: 2 * 2 + 2 arrays, and the counts
    shaped = sorted(leaf.path for leaf in opt if leaf.shape)
    assert len(shaped) == 6, shaped
    assert est.leaves and all(leaf.global_bytes >= 0 for leaf in est.leaves)


def _own(tx) -> Candidate:
    """The task's step on an optimizer of its own, ``tx``, from its own init."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(mse)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    return Candidate(
        "own", step, num_shards=1, make_optimizer=lambda m, o: nnx.Optimizer(m, tx, wrt=nnx.Param)
    )


def test_labels_that_differ_replay_as_leaves_in_one_run_only():
    """Trial 11: the head's multi_transform label swapped in the candidate, replayed: its state lacks the leaves
    the recording holds. Said "Form: not finite (NaN or infinity)", and "At step 0 the loss, the gradients and
    the optimizer state match" from records that left those leaves out."""

    def swapped(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "body", params)

    rec = record_run(_task(), _own(_task().optimizer))
    tx = optax.multi_transform({"body": optax.adamw(1e-2), "head": optax.sgd(5e-2, momentum=0.9)}, swapped)
    report = check_parity(_own(tx), _task(), reference=rec)
    assert not report.ok and report.codes[0] == "structure" and "localized" not in report.codes
    loc = report.localization
    assert loc.form.kind == "shape" and "the optimizer state holds other leaves: " in loc.form.sentence
    assert "are in one run only, e.g. opt_state " in loc.form.sentence
    assert "not finite" not in loc.text() and "NaN" not in report.diagnosis


def test_labels_that_differ_fail_live_as_leaves_in_one_run_only():
    """Trial 11: the same swap checked live was refused ('its state is not laid out as the task optimizer's ...
    give the Candidate view_optimizer=...') while its replay compared it: most of its state lies where the task's
    does, so it is compared, and the leaves one side lacks are named as such (both sides' own), never as not
    finite; the task's own labels PASS."""

    def swapped(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "body", params)

    tx = optax.multi_transform({"body": optax.adamw(1e-2), "head": optax.sgd(5e-2, momentum=0.9)}, swapped)
    report = check_parity(_own(tx), _task())
    assert not report.ok and report.localization.stage == "optimizer", str(report)
    missing = sorted(e.path for e in report.steps[0].leaves if e.missing)
    assert any(".head." in p or p.endswith("head.bias") for p in missing), missing
    assert all(e.max_abs_err == float("inf") and not e.ok for e in report.steps[0].leaves if e.missing)
    assert report.localization.form.kind == "shape" and "in one run only" in report.localization.form.sentence
    assert "not finite" not in report.localization.text() and "NaN" not in report.diagnosis
    assert check_parity(_own(_task().optimizer), _task()).ok


def test_param_groups_read_the_multi_transform_labels_from_its_state():
    """Each parameter's label, read from where the optimizer's state keeps it (also inside a chain); plain SGD
    keeps no state for its group's parameters, which then have none; another optimizer has no groups."""
    from shardcheck.parity.harness.leaf_facts import param_groups

    params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), _task().optimizer)
    want = {"body.kernel": "body", "body.bias": "body", "head.kernel": "head", "head.bias": "head"}
    assert param_groups(params, tx) == want
    stateless = optax.multi_transform({"body": optax.adam(1e-2), "head": optax.sgd(1e-2)}, labels)
    assert param_groups(params, stateless) == {"body.kernel": "body", "body.bias": "body"}
    assert param_groups(params, optax.adam(1e-2)) == {}


def test_a_group_whose_learning_rate_differs_is_named_by_its_label():
    """Trial 11: a warm-up that differs for one multi_transform group said its failing leaves 'share no ndim,
    name or module that the matching ones lack'; they share the label."""
    tx = optax.multi_transform({"body": optax.adamw(1e-2), "head": optax.sgd(2.5e-2, momentum=0.9)}, labels)
    loc = check_parity(_own(tx), _task()).localization
    assert (
        "every failing leaf is in the optimizer's parameter group 'head' (an optax.multi_transform label)"
        in (loc.text())
    ), loc.text()
    assert "every leaf that is in the optimizer's parameter group 'body' matches" in loc.text()
    assert loc.form.kind == "factor" and "0.5 x the reference's" in loc.text()
