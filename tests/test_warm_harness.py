"""The harness's host work per step (issue #35): each side's Variables found once and read at every step, the
reference's state kept for a re-check without another graph traversal, and what these keep exactly.

- ``state._kept_state`` holds the state as it was when kept, whatever a later in-place step writes;
- a re-check of a failing step starts from the reference's state before that step (``tests/kinked.py``);
- a check that finds its Variables once reports what a check traversing both graphs at every step reports.
"""

import jax
import kinked
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import shardcheck
from shardcheck.parity.comparison.live import leaf_error
from shardcheck.parity.harness import state


class _InPlaceRun:
    """What ``_kept_state`` reads of a run: whether its steps update in place, and its found Variables."""

    in_place = True

    def __init__(self):
        self.found = {}


def _pair():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)


def _step(model, optimizer):
    grads = nnx.grad(lambda m: (m(np.ones((4, 3), np.float32)) ** 2).sum())(model)
    optimizer.update(model, grads)


@pytest.mark.parametrize("run", [None, _InPlaceRun()], ids=["traversed", "found once"])
def test_kept_state_is_the_state_before_a_later_step(run):
    model, optimizer = _pair()
    kernel0, mu0 = model.kernel[...], optimizer.opt_state[0].mu["kernel"][...]
    kept = state._kept_state(model, optimizer, copy=False, run=run)
    _step(model, optimizer)  # writes into model's and optimizer's Variables
    assert int(optimizer.step[...]) == 1 and not np.array_equal(model.kernel[...], kernel0)
    k_model, k_opt = kept
    assert k_model.kernel is not model.kernel  # its own Variables...
    assert k_model.kernel[...] is kernel0 and k_opt.opt_state[0].mu["kernel"][...] is mu0  # ...same buffers
    assert int(k_opt.step[...]) == 0
    again = state._kept_state(model, optimizer, copy=False, run=run)  # now: the state after the step
    a_model, a_opt = again
    assert a_model.kernel[...] is model.kernel[...] and int(a_opt.step[...]) == 1
    if run is not None:
        assert run.found["kept"].obj is model  # found at the first call, read at the second


def test_a_recheck_starts_from_the_reference_state_before_the_failing_step():
    """The trajectories split at step t; the re-check of step t steps both sides once from the reference's state
    before step t: its reference loss is the trajectory's own at step t, bit for bit, and its counter t + 1."""
    report = shardcheck.check_parity(kinked.rounded_step, kinked.task, num_shards=2)
    t = kinked.DIVERGES_AT
    assert report.diverged_at == t and report.steps[t].synchronized
    assert report.steps[t].loss == report.diverged.loss
    assert report.steps[t].step_count == report.diverged.step_count == t + 1
    assert report.steps[t].candidate_step_count == t + 1


def test_all_zero_leaves_compare_as_the_full_rule_does():
    """An emptied accumulator (both sides all zeros) skips the rule's passes; the record is the full rule's (an
    all-zero allowance takes the full path)."""
    zeros = np.zeros((3, 4), np.float32)
    fast = leaf_error(2, "opt_state", "acc_grads.w", zeros, -zeros, 1e-6, 1e-7)
    full = leaf_error(2, "opt_state", "acc_grads.w", zeros, -zeros, 1e-6, 1e-7, allowance=zeros)
    assert fast == full
    assert (fast.max_abs_err, fast.tolerance, fast.ok, fast.ratio, fast.shape) == (
        0.0,
        1e-7,
        True,
        None,
        (3, 4),
    )
    nan = zeros.copy()
    nan[1, 2] = np.nan
    assert not leaf_error(2, "opt_state", "acc_grads.w", zeros, nan, 1e-6, 1e-7).ok


@require_devices(2)
@pytest.mark.parametrize("strategy", ["dp", "accumulation"])
def test_variables_found_once_report_what_a_traversal_at_every_step_does(strategy, monkeypatch):
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))
        for _ in range(3)
    ]
    task = shardcheck.Task(
        model=lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(0.05),
        loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
        batches=batches,
    )
    found = shardcheck.check_parity(strategy, task, num_shards=2)
    monkeypatch.setattr(state._Found, "of", staticmethod(lambda *a, **k: None))  # traverse every time
    traversed = shardcheck.check_parity(strategy, task, num_shards=2)
    assert found.verdict == traversed.verdict == "PASS"
    assert [r.leaves for r in found.steps] == [r.leaves for r in traversed.steps]
    assert [(r.loss, r.candidate_loss) for r in found.steps] == [
        (r.loss, r.candidate_loss) for r in traversed.steps
    ]


def test_the_accumulation_view_reads_the_state_as_it_is_now():
    """#35: the accumulation candidate's view and extra checks find its optimizer's state once and read its
    Variables after: after a step they give what a fresh traversal gives, and another optimizer is found anew."""
    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.steps.accumulation import accumulation_candidate

    model, optimizer = _pair()
    cand = accumulation_candidate(lambda m, b: (m(b) ** 2).sum(), 2)
    acc = cand.make_optimizer(model, optimizer)
    before = flatten_state(cand.view_optimizer(acc)[0])
    cand.step(model, acc, np.ones((4, 3), np.float32))
    view, count = cand.view_optimizer(acc)
    fresh = flatten_state(nnx.state(acc)["opt_state"]["inner_opt_state"])
    assert all(np.array_equal(v, fresh[k]) for k, v in flatten_state(view).items()) and int(count) == 1
    assert not np.array_equal(flatten_state(view)["0.mu.kernel"], before["0.mu.kernel"])
    checks = {path: np.asarray(value) for path, value, _ in cand.extra_checks(acc, 1)}
    assert int(checks["step (NNX micro-steps)"]) == 2 and int(checks["mini_step"]) == 0
    other = cand.make_optimizer(model, optimizer)  # a new optimizer: its own state, at count 0
    assert int(cand.view_optimizer(other)[1]) == 0
    assert np.array_equal(flatten_state(cand.view_optimizer(other)[0])["0.mu.kernel"], before["0.mu.kernel"])


def _mse(model, batch):
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def test_a_reference_step_on_found_variables_is_the_step_bit_for_bit():
    """#35: the harness steps the reference on its Variables found once (no ``nnx.split`` / ``nnx.update`` a
    step): after two steps the state, the loss and the gradients are ``reference_step``'s, bit for bit."""
    from shardcheck.steps.reference import _reference_jit, reference_step

    run = _InPlaceRun()
    (a_model, a_opt), (b_model, b_opt) = _pair(), _pair()
    batch = (np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), np.ones((4, 2), np.float32))
    for _ in range(2):
        plain = reference_step(_mse, a_model, a_opt, batch)
        found = state.stepped_in_place(run, "ref_step", _reference_jit, (_mse,), b_model, b_opt, batch)
    assert run.found["ref_step"].obj is b_model and int(b_opt.step[...]) == 2
    assert float(plain.loss) == float(found.loss)
    for x, y in zip(jax.tree.leaves(plain.grads), jax.tree.leaves(found.grads), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    a, b = jax.tree.leaves(nnx.state((a_model, a_opt))), jax.tree.leaves(nnx.state((b_model, b_opt)))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _late_fault(real):
    """``real`` (the accumulation step's program) with the hidden layer's kernel scaled by 1 + 1e-3 in the state
    it returns once the optimizer has applied 2 updates (a late fault: steps 0 and 1 are correct)."""

    def faulty(loss_fn, k, graphdef, state, batch):
        result, new = real(loss_fn, k, graphdef, state, batch)
        if int(state[1]["opt_state"]["gradient_step"][...]) >= 2:
            new[0]["hidden"]["kernel"][...] = new[0]["hidden"]["kernel"][...] * (1 + 1e-3)
        return result, new

    return faulty


@require_devices(2)
@pytest.mark.parametrize("fault", [False, True], ids=["correct", "late fault"])
def test_the_accumulation_step_on_found_variables_reports_what_its_step_does(fault, monkeypatch):
    """#35: ``check_parity("accumulation")`` steps the candidate's program on its Variables found once (no
    ``nnx.split`` / ``nnx.update`` a step); every StepRecord is the one of the same candidate given as a
    :class:`Candidate`, whose step traverses both graphs at every step, bit for bit, in the same jitted program
    (no new cache entry). A correct step PASSes; a kernel scaled by 1.001 from step 2 on FAILs there, alike."""
    from shardcheck.losses import mse_batch_loss
    from shardcheck.models import MLP
    from shardcheck.parity.harness import check
    from shardcheck.steps import accumulation

    rng = np.random.default_rng(0)
    task = shardcheck.Task(
        model=lambda: MLP(3, 4, 2, rngs=nnx.Rngs(0)),
        optimizer=optax.adam(0.05),
        loss_fn=mse_batch_loss,
        batches=[(rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32))]
        * 4,
    )
    real = accumulation._accumulated_jit
    if fault:
        monkeypatch.setattr(accumulation, "_accumulated_jit", _late_fault(real))
    traversed = shardcheck.check_parity(accumulation.accumulation_candidate(mse_batch_loss, 2), task)
    programs = real._cache_size()
    keys, stepped = [], state.stepped_in_place
    monkeypatch.setattr(
        check, "stepped_in_place", lambda run, key, *a: keys.append(key) or stepped(run, key, *a)
    )
    found = shardcheck.check_parity("accumulation", task, num_shards=2)
    assert (
        keys.count("cand_step") == 4 + fault
    )  # its 4 steps, and the re-check of step 2 from identical state
    assert real._cache_size() == programs
    assert found.verdict == traversed.verdict == ("FAIL" if fault else "PASS"), str(found)
    assert found.steps == traversed.steps
    if fault:
        assert [r.ok for r in found.steps] == [True, True, False, False] and found.codes == traversed.codes


def test_the_sensitivity_shapes_are_traced_once_per_structure_and_shape(monkeypatch):
    """#35: a step's sensitivity shapes (``update_sensitivity.eval_shape``, 1.6 ms a step on the tiny-lm) are
    found once per ``tx`` and inputs' structure, shapes and dtypes, and read again: the same paths, shapes and
    dtypes as ``eval_shape``'s; inputs of another shape are traced anew (no stale shapes)."""
    from shardcheck.parity.comparison.live import flatten_state
    from shardcheck.parity.tolerance import allowances
    from shardcheck.parity.tolerance.propagation import update_sensitivity

    traced = []

    class Counted:
        def eval_shape(self, *args):
            traced.append(args)
            return update_sensitivity.eval_shape(*args)

    monkeypatch.setattr(allowances, "update_sensitivity", Counted())
    monkeypatch.setattr(allowances, "_SHAPES", type(allowances._SHAPES)())
    tx = optax.adam(0.1)

    def inputs(n):
        params = {"w": np.ones((n, 2), np.float32), "b": np.zeros((2,), np.float32)}
        return params, tx.init(params), params, params

    first = allowances._sensitivity_shapes(tx, inputs(3))
    again = allowances._sensitivity_shapes(tx, inputs(3))
    other = allowances._sensitivity_shapes(tx, inputs(5))
    assert len(traced) == 2 and again is first
    updates, states, _ = update_sensitivity.eval_shape(tx, *inputs(3))
    assert first == (flatten_state(updates), flatten_state(states))
    assert first[0]["w"].shape == (3, 2) and other[0]["w"].shape == (5, 2)
    assert {p: (s.shape, s.dtype) for p, s in first[1].items()} == {
        "0.count": ((), np.int32),
        "0.mu.b": ((2,), np.float32),
        "0.mu.w": ((3, 2), np.float32),
        "0.nu.b": ((2,), np.float32),
        "0.nu.w": ((3, 2), np.float32),
    }
