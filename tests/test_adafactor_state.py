"""Optimizer state not shaped like the parameters (Adafactor's factored second moments) through placement, the
built-in strategies, memory, the form and the rules (trial 10).

An annotated kernel's annotation is inherited by every optimizer-state leaf ``nnx.Optimizer`` makes from it, and
Adafactor's factored ``v_row``/``v_col`` (rank 1) and ``(1,)`` placeholders cannot take a 2-D spec: they are
placed by the entries that fit (:func:`~shardcheck.steps.sharded.fit_inherited_spec`), while a parameter's own
annotation that does not fit is still refused. A candidate whose optimizer state is shaped otherwise fails, live
and replayed, as shaped otherwise (never "not finite"); a decay-rate fault of Adafactor names no clip.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, estimate_memory, make_mesh
from shardcheck.parity.diagnosis.evidence import LeafError, StepRecord
from shardcheck.parity.diagnosis.form import fit_form
from shardcheck.parity.diagnosis.rules import _applied_factors
from shardcheck.parity.harness.candidates import _state_shape_hint
from shardcheck.parity.harness.recorded import record_run
from shardcheck.steps import Candidate
from shardcheck.steps.sharded import fit_inherited_spec, state_specs


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, down=("fsdp", None)):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, (None, "fsdp")), rngs=rngs)
        self.down = nnx.Linear(
            16, 4, kernel_init=nnx.with_partitioning(init, down), use_bias=False, rngs=rngs
        )

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def adafactor(**kw):
    return optax.adafactor(1e-2, min_dim_size_to_factor=4, **kw)


@functools.cache
def _task(down=("fsdp", None)) -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
        for _ in range(2)
    ]
    return Task(
        model=lambda: Net(nnx.Rngs(0), down), optimizer=adafactor(), loss_fn=mse, batches=batches, name="af"
    )


def test_an_inherited_spec_keeps_only_the_entries_that_fit():
    mesh = make_mesh({"data": 2, "fsdp": 2})
    assert fit_inherited_spec(P(None, "fsdp"), (1,), mesh) == P()  # a (1,) placeholder: fewer dims
    assert fit_inherited_spec(P(None, "fsdp"), (16,), mesh) == P()  # a factored v_row: which dim is unknown
    assert fit_inherited_spec(P(None, "fsdp"), (8, 16), mesh) == P(None, "fsdp")  # shaped as its parameter
    assert fit_inherited_spec(P("fsdp", None), (3, 16), mesh) == P(None, None)  # 3 does not split in 2
    assert fit_inherited_spec(P(("data", "fsdp")), (8,), mesh) == P(("data", "fsdp"))


def test_factored_state_is_placed_and_a_parameters_own_misfit_refused():
    task, mesh = _task(), make_mesh({"data": 2, "fsdp": 2})
    model = task.new_model()
    optimizer = task.new_optimizer(model)
    specs, params = state_specs("fsdp", model, optimizer, mesh)
    names = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state((model, optimizer)))]
    by = dict(zip(names, specs, strict=True))
    # down.kernel, up.bias (unannotated: the FSDP rule), up.kernel
    assert params == (P("fsdp", None), P("fsdp"), P(None, "fsdp"))
    assert by["1.opt_state.0.v_row.up.kernel"] == P() and by["1.opt_state.0.v.up.kernel"] == P()  # (8,), (1,)
    assert by["1.opt_state.0.v_col.down.kernel"] == P()
    bad = dataclasses.replace(_task(), model=lambda: Net(nnx.Rngs(0), down=("fsdp", None, None))).new_model()
    opt = nnx.Optimizer(bad, adafactor(), wrt=nnx.Param)
    with pytest.raises(
        ValueError, match=r"'down.kernel' of shape \(16, 4\) is annotated .*names more dimensions"
    ):
        state_specs("fsdp", bad, opt, mesh)


@require_devices(4)
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "gspmd"])
def test_adafactor_passes_every_builtin(strategy):
    report = check_parity(strategy, _task(), mesh=make_mesh({"data": 2, "fsdp": 2}))
    assert report.ok and report.verdict == "PASS", report.diagnosis
    assert {e.kind for r in report.steps for e in r.leaves} >= {"opt_state", "param", "grad"}


def test_memory_estimate_places_the_factored_moments():
    est = estimate_memory(_task(), mesh={"data": 2, "fsdp": 2}, strategy="fsdp")
    opt = {leaf.path: leaf for leaf in est.leaves if leaf.category == "optimizer"}
    assert opt["0.v_row.up.kernel"].shard_shape == (8,) and not opt["0.v_row.up.kernel"].sharded
    assert opt["0.v_col.up.kernel"].shard_shape == (16,)
    params = {leaf.path: leaf for leaf in est.leaves if leaf.category == "params"}
    assert params["up.kernel"].shard_shape == (8, 8)  # the parameter keeps its annotation


def _own(tx, copy: bool) -> Candidate:
    """The task's step on an optimizer of its own, ``tx``, from the task's state (``copy``) or its own init."""

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(mse)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "grads": grads}

    def make(model, optimizer):
        own = nnx.Optimizer(model, tx, wrt=nnx.Param)
        if copy:
            nnx.update(own, nnx.state(optimizer))
        return own

    return Candidate("own", step, num_shards=1, make_optimizer=make)


def test_fit_form_sets_aside_leaves_of_another_shape():
    z = np.zeros
    form = fit_form({"opt_state a": z(1)}, {"opt_state a": z(1) + 1}, {"opt_state a": np.ones((4, 4))})
    assert form.kind == "shape" and form.leaves == 1
    assert form.sentence.startswith(
        "the optimizer state is shaped otherwise: 1 leaf differs in shape, e.g. opt_state a (4, 4) against the "
        "reference's (1,): another optimizer configuration (Adafactor's factored=False"
    )
    mixed = fit_form(
        {"a": z(3), "b": z(1)},
        {"a": np.arange(1.0, 4.0), "b": z(1)},
        {"a": 1.5 * np.arange(1.0, 4.0), "b": z(5)},
    )
    assert mixed.kind == "factor" and mixed.factor == pytest.approx(1.5) and mixed.leaves == 1


def test_state_shaped_otherwise_fails_as_such_live_and_replayed():
    task = _task()
    cand = _own(adafactor(factored=False), copy=False)  # a fresh unfactored state: (16, 4) against (1,)
    rec = record_run(task, _own(adafactor(), copy=True))
    live, replayed = check_parity(cand, task), check_parity(cand, task, reference=rec)
    for report in (live, replayed):
        loc = report.localization
        assert not report.ok and loc.stage in ("optimizer", "parameters") and loc.form.kind == "shape"
        assert "the optimizer state is shaped otherwise: 6 leaves differ in shape" in loc.text(), loc.text()
        assert [w for w in ("not finite", "NaN", "max abs err inf") if w in report.diagnosis] == []
    assert live.codes == (
        "localized",
    ) and "They are shaped otherwise than the reference's (e.g. opt_state " in (live.diagnosis)
    assert replayed.codes[0] == "structure"
    assert (
        "Leaf opt_state 0.v.down.kernel: changed shape (1,) -> (16, 4) (and 5 more leaves)"
        in replayed.diagnosis
    )


def test_copied_state_of_another_shape_is_named_when_the_step_raises():
    model = _task().new_model()
    task_opt = nnx.Optimizer(model, adafactor(), wrt=nnx.Param)
    own = nnx.Optimizer(model, adafactor(factored=False), wrt=nnx.Param)
    assert _state_shape_hint(model, own) == ""  # its own init: nothing to say
    nnx.update(own, nnx.state(task_opt))
    assert _state_shape_hint(model, own).startswith(
        "the optimizer made by make_optimizer holds state shaped otherwise than its transformation makes (6 "
        "leaves, e.g. opt_state 0.v.down.kernel: (1,) held, (16, 4) from its init): a likely cause"
    )


def _state_leaf(path: str, ratio: float) -> LeafError:
    return LeafError(0, "opt_state", path, 1e-3, 0.1, 1e-6, False, ratio, 1e-2, (ratio, ratio), (16,))


def test_a_second_moments_factor_is_not_a_gradient_factor():
    """Adafactor's decay rate 0.9 for 0.8 moves v by (1 - beta2) x, 0.933 on each, the gradients equal: no
    factor of the gradient the optimizer was given (no clip); a first moment (Adam's mu, momentum's trace) off by
    0.933 on every leaf still reads as that factor."""
    grads = tuple(LeafError(0, "grad", p, 0.0, 0.0, 1e-6, True, 1.0, None, (1.0, 1.0), (16,)) for p in "ab")

    def applied(paths):
        bad = tuple(_state_leaf(p, 0.933) for p in paths)
        return _applied_factors(StepRecord(0, 1e-5, 1e-6, 1.0, None, grads + bad, 1, 1), bad, None, (), None)

    assert applied(["0.v.a", "0.v_row.b", "0.v_col.b"]) == (None, "", ())
    f, evidence, _ = applied(["0.mu.a", "0.mu.b"])
    assert f == pytest.approx(0.933) and evidence == "Adam's first moments"
    f, evidence, _ = applied(["0.trace.a", "0.trace.b"])
    assert f == pytest.approx(0.933) and evidence == "momentum traces"


def test_adafactor_decay_rate_fault_names_no_clip():
    task = _task()
    report = check_parity(_own(adafactor(decay_rate=0.9), copy=True), task)
    assert not report.ok
    assert not {"clip_coefficient", "local_clip_norm"} & set(report.codes), report.codes
    assert "clip" not in report.diagnosis.lower()
    right = check_parity(_own(adafactor(), copy=True), task)
    assert right.ok, right.diagnosis


def test_a_step_that_raises_on_copied_state_names_it():
    """The trial's candidate: the task's factored state copied into MultiSteps(adafactor(factored=False)); its
    step raises inside MultiSteps' cond, and the error names the state's shapes as the likely cause."""
    from shardcheck.parity.report import CandidateError

    def make(model, optimizer):
        own = nnx.Optimizer(model, optax.MultiSteps(adafactor(factored=False), 1), wrt=nnx.Param)
        nnx.update(own, nnx.State({"opt_state": {"inner_opt_state": nnx.state(optimizer)["opt_state"]}}))
        return own

    def view(opt):
        return nnx.state(opt)["opt_state"]["inner_opt_state"], opt.opt_state.gradient_step[...]

    cand = dataclasses.replace(_own(adafactor(), copy=False), make_optimizer=make, view_optimizer=view)
    with pytest.raises(
        CandidateError,
        match=r"raised TypeError at step 0 \(the optimizer made by make_optimizer "
        r"holds state shaped otherwise than its transformation makes \(6 leaves, e\.g\. opt_state "
        r"inner_opt_state\.0\.v\.down\.kernel: \(1,\) held, \(16, 4\) from its init\)",
    ):
        check_parity(cand, _task())
