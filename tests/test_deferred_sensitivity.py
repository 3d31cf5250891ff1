"""The deferred sensitivity pass (``parity.allowances``: ``lower_bound``, ``settle``): a check that compares a
step against the lower bound of its allowances first, and runs the reference's optimizer at 16 points of the
gradient's tolerance only where a verdict reads it, gives the verdicts, diagnoses and leaf-by-leaf errors of a check
that runs every pass at its step; the tolerance it reports for a step the bound cleared is at most the exact one,
and a step after deferred ones is judged with exactly the allowances of a check that deferred nothing."""

import contextlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, scaled_from
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import shardcheck
from shardcheck.parity import shared_reference
from shardcheck.parity.tolerance import allowances, propagation
from shardcheck.tasks import digits_task

STEPS = 4


class ShiftedClassifier(nnx.Module):
    """A linear classifier with one learned logit shift shared by every class: softmax is blind to it, so its
    gradient is rounding noise, the case of an attention key's bias (a leaf at rounding level)."""

    def __init__(self, rngs: nnx.Rngs, shift: bool = True):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.shift = nnx.Param(jnp.zeros((1,))) if shift else None

    def __call__(self, x):
        return self.linear(x) if self.shift is None else self.linear(x) + self.shift[...]


def _loss(model, batch):
    x, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()


def _task(optimizer, seed: int, shift: bool = True) -> shardcheck.Task:
    rng = np.random.default_rng(seed)
    batches = [
        (rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, size=(8,)).astype(np.int32))
        for _ in range(STEPS)
    ]
    return shardcheck.Task(
        model=lambda: ShiftedClassifier(nnx.Rngs(seed), shift),
        optimizer=optimizer,
        loss_fn=_loss,
        batches=batches,
    )


def _scaled_from(step: int, factor: float):
    """The reference's step until ``step``, then one applying ``factor`` times the gradient."""
    return scaled_from(_loss, step, factor)


class _Counting:
    """``propagation.update_sensitivity``, counting the passes it runs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return propagation.update_sensitivity(*args)

    def eval_shape(self, *args):
        return propagation.update_sensitivity.eval_shape(*args)


class _Trials:
    """The lower-bound trials' outcomes, in order: ``"cleared"`` or ``"short"`` (the bound did not clear a step
    that the exact allowances passed)."""

    def __init__(self):
        self.outcomes = []

    @contextlib.contextmanager
    def recording(self):
        keep, short = allowances.keep, allowances.fell_short

        def kept(run):
            self.outcomes.append("cleared")
            keep(run)

        def fell_short(run):
            self.outcomes.append("short")
            short(run)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(allowances, "keep", kept)
            patch.setattr(allowances, "fell_short", fell_short)
            yield self


def _both(candidate, task, budget: int | None = None, **kwargs):
    """``(report, passes)`` with deferral (at most ``budget`` bytes deferred, when given), then without it."""
    out = []
    for defer in (True, False):
        counting = _Counting()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(allowances, "update_sensitivity", counting)
            patch.setattr(allowances, "DEFER", defer)
            if budget is not None:
                patch.setattr(allowances, "MAX_DEFERRED_BYTES", budget)
            out.append((shardcheck.check_parity(candidate, task, **kwargs), counting.calls))
    return out


def _same_verdicts(on, off):
    assert (on.verdict, on.codes, on.diagnosis) == (off.verdict, off.codes, off.diagnosis)
    assert (on.diverged_at, on.cannot_verify, on.scale_evidence) == (
        off.diverged_at,
        off.cannot_verify,
        off.scale_evidence,
    )
    for a, b in zip(on.steps, off.steps, strict=True):
        assert (a.ok, a.unresolved, a.scale_evidence, a.matches, a.synchronized) == (
            b.ok,
            b.unresolved,
            b.scale_evidence,
            b.matches,
            b.synchronized,
        )
        assert [(e.name, e.ok, e.max_abs_err, e.ratio) for e in a.leaves] == [
            (e.name, e.ok, e.max_abs_err, e.ratio) for e in b.leaves
        ]
        for x, y in zip(a.leaves, b.leaves, strict=True):
            assert x.tolerance <= y.tolerance  # a lower bound, where the bound cleared the step
            if not a.ok:  # a failing step is judged with the exact allowances, those before it settled
                assert x.tolerance == y.tolerance


OPTIMIZERS = {
    "adam": lambda lr: optax.adam(lr),
    "sgd momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "clipped adamw": lambda lr: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(lr)),
}


@settings(max_examples=8, deadline=None)
@given(
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    lr=st.sampled_from([1e-3, 3e-2]),
    seed=st.integers(0, 3),
    fault=st.sampled_from([None, (2, 2.0), (1, 0.5), (3, 1.0 + 1e-3)]),
)
def test_deferred_verdicts_are_the_step_by_step_ones(optimizer, lr, seed, fault):
    """Correct steps and faults planted at a later step (a sum for a mean, a mean taken twice, a 0.1% scale)
    under Adam, SGD with momentum and clipped AdamW, on a model with a leaf at rounding level: the same
    verdicts, diagnoses and errors, and fewer passes where the steps are correct."""
    task = _task(OPTIMIZERS[optimizer](lr), seed)
    candidate = _scaled_from(*fault) if fault else _scaled_from(10**9, 1.0)
    (on, passes_on), (off, passes_off) = _both(candidate, task, num_shards=2)
    _same_verdicts(on, off)
    assert on.ok == (fault is None)
    assert passes_off >= STEPS  # every reference step's pass (and the re-checked step's)
    assert passes_on <= passes_off


def test_a_correct_check_runs_the_first_pass_only_and_a_late_fault_settles_every_step():
    """SGD with momentum, no leaf at rounding level (the bound clears every later step): one pass for a correct
    candidate; a fault at the last step computes the deferred passes of every step before it, and that step's
    tolerances are the step-by-step check's, bit for bit. With the shift, at rounding level, SGD's small
    steps leave it resolved under the bound, which the exact allowance decides: the bound falls short at step 1
    and is not tried again."""
    task = _task(optax.sgd(0.05, momentum=0.9), seed=0, shift=False)
    trials = _Trials()
    with trials.recording():
        (good, passes_good), (good_off, passes_good_off) = _both(_scaled_from(10**9, 1.0), task)
    _same_verdicts(good, good_off)
    assert trials.outcomes == ["cleared"] * (STEPS - 1)  # every step after the first (the scale evidence)
    assert good.verdict == "PASS" and (passes_good, passes_good_off) == (1, STEPS)
    last = STEPS - 1
    (bad, passes_bad), (bad_off, _) = _both(_scaled_from(last, 2.0), task, num_shards=2)
    _same_verdicts(bad, bad_off)
    assert bad.verdict == "FAIL" and bad.steps[last].ok is False
    assert passes_bad >= STEPS  # the deferred ones, then the failing step's (and its re-check's)
    trials = _Trials()
    with trials.recording():
        (shifted, passes), (shifted_off, _) = _both(_scaled_from(10**9, 1.0), _task(optax.sgd(0.05, 0.9), 0))
    _same_verdicts(shifted, shifted_off)
    assert shifted.verdict == "PASS" and passes == STEPS
    assert trials.outcomes == [
        "short"
    ]  # tried at step 1 only: the run stops trying after the bound fell short


def test_past_the_byte_budget_nothing_is_deferred():
    task = _task(optax.sgd(0.05, momentum=0.9), seed=1)
    (on, passes_on), (off, passes_off) = _both(_scaled_from(10**9, 1.0), task, budget=0)
    _same_verdicts(on, off)
    assert on.verdict == "PASS" and passes_on == passes_off == STEPS


@require_devices(4)
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_deferred_verdicts_for_the_strategies(strategy):
    (on, passes_on), (off, passes_off) = _both(strategy, _task(optax.adam(1e-2), 0), num_shards=4)
    _same_verdicts(on, off)
    assert on.verdict == off.verdict and on.verdict.startswith("PASS")
    assert passes_on < passes_off


@require_devices(2)
@pytest.mark.parametrize("policy", [{"compute_dtype": "bfloat16"}, {"param_dtype": "bfloat16"}])
def test_at_low_precision_every_pass_runs_at_its_step(policy):
    """Low precision: the propagated compute noise, the shadow spread and the parameters' rounding are what
    cover a correct step, so the bound is not tried; every pass runs, the verdicts are the same."""
    task = digits_task(steps=STEPS, batch_size=32, **policy)
    trials = _Trials()
    with trials.recording():
        (on, passes_on), (off, passes_off) = _both("dp", task, num_shards=2)
    _same_verdicts(on, off)
    assert on.verdict == "PASS" and passes_on == passes_off == STEPS
    assert trials.outcomes == []


def test_a_check_in_a_verify_reports_what_it_would_alone():
    """In one shared reference (``verify``), a failing check computes the deferred passes of the steps before its
    fault; the passing check after it still compares those steps against the bound, so its report, tolerances
    included, is the one it gives alone."""
    task = _task(optax.sgd(0.05, momentum=0.9), seed=2, shift=False)
    alone = shardcheck.check_parity(_scaled_from(10**9, 1.0), task)
    with shared_reference():
        bad = shardcheck.check_parity(_scaled_from(STEPS - 1, 2.0), task)
        good = shardcheck.check_parity(_scaled_from(10**9, 1.0), task)
    assert bad.verdict == "FAIL" and good.verdict == alone.verdict == "PASS"
    _same_verdicts(good, alone)
    for a, b in zip(good.steps, alone.steps, strict=True):
        assert [e.tolerance for e in a.leaves] == [e.tolerance for e in b.leaves]
