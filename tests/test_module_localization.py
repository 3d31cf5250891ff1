"""The forward stage one level down: the first module whose output differs while its inputs matched
(``parity/harness/module_probe.py``, ``parity/diagnosis/module_outputs.py``).

A tiny model written the Flax NNX way: two blocks, each a head-parallel attention and a column/row-parallel MLP
whose ``__call__`` runs a ``jax.shard_map`` over the mesh's ``model`` axis when the current mesh has one (else it
computes directly, as on the reference's one device). A user's GSPMD step runs it under ``jax.set_mesh`` on a
data=2 x model=2 mesh. Planted: the row-parallel ``psum`` over ``model`` left out of block 1's MLP only; the
report FAILs at the forward stage and names exactly ``blocks.1.mlp.__call__`` (a module that calls no other) with
its numbers, every module output before it matching. Both sides: the correct model PASSes (no probe), and a fault
outside every module (a step that scales its loss) FAILs at the forward stage with every module's output matching.

A second tiny model puts the fault in a parent's own code, as trial 6 did (a wrong attention scale, a log of 0,
between a child's call and the next child's): the probe names the parent, not the rate-0 ``Dropout`` child after
the fault whose input already differs; where the fault is after the last child, the parent with every child
matching; a NaN is said "not finite"; and a loss that changes the model's input under the mesh is said as a
difference before every module.
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, make_mesh
from shardcheck.parity.diagnosis.module_outputs import ModuleFinding

D, HEADS, HEAD_DIM, MLP_DIM, FEATURES, SEQ, BATCH = 8, 2, 4, 16, 4, 4, 8
INIT = nnx.initializers.lecun_normal()


def _model_axis() -> bool:
    return "model" in jax.sharding.get_abstract_mesh().axis_names


def _tensor_parallel(body, specs, *args):
    """``body(*args)`` as a ``shard_map`` over ``model`` (``specs``: the arguments' specs) under a mesh with that
    axis, else directly."""
    if not _model_axis():
        return body(*args)
    mapped = jax.shard_map(body, in_specs=specs, out_specs=P(), axis_names={"model"}, check_vma=False)
    return mapped(*args)


class Attention(nnx.Module):
    """Head-parallel attention: query/key/value split over heads, the output projection's partial sums psum-ed."""

    def __init__(self, rngs: nnx.Rngs):
        self.qkv = nnx.Param(INIT(rngs.params(), (3, D, HEADS, HEAD_DIM)), out_sharding=(None, None, "model"))
        self.out = nnx.Param(INIT(rngs.params(), (HEADS, HEAD_DIM, D)), out_sharding=("model", None, None))

    def __call__(self, x):
        def body(x, qkv, out):
            q, k, v = (jnp.einsum("btd,dhe->bthe", x, w) for w in qkv)
            weights = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(HEAD_DIM), axis=-1)
            y = jnp.einsum("bhqk,bkhe,hed->bqd", weights, v, out)
            return jax.lax.psum(y, "model") if _model_axis() else y

        specs = (P(), P(None, None, "model"), P("model"))
        return _tensor_parallel(body, specs, x, self.qkv[...], self.out[...])


class MLP(nnx.Module):
    """Column-parallel ``up``, row-parallel ``down``; ``reduce=False`` leaves the row-parallel psum out."""

    def __init__(self, rngs: nnx.Rngs, reduce: bool = True):
        self.up = nnx.Param(INIT(rngs.params(), (D, MLP_DIM)), out_sharding=(None, "model"))
        self.down = nnx.Param(INIT(rngs.params(), (MLP_DIM, D)), out_sharding=("model", None))
        self.reduce = reduce

    def __call__(self, x):
        def body(x, up, down):
            y = nnx.gelu(x @ up) @ down
            return jax.lax.psum(y, "model") if _model_axis() and self.reduce else y

        return _tensor_parallel(body, (P(), P(None, "model"), P("model")), x, self.up[...], self.down[...])


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, reduce: bool = True):
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = Attention(rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = MLP(rngs, reduce)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTP(nnx.Module):
    """``embed`` -> two blocks -> ``head``; ``unreduced``: the block whose MLP leaves its psum out, or ``None``."""

    def __init__(self, rngs: nnx.Rngs, unreduced: int | None = None):
        self.embed = nnx.Linear(FEATURES, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs, reduce=i != unreduced) for i in range(2)])
        self.head = nnx.Linear(D, FEATURES, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@functools.cache
def _task(unreduced: int | None = None) -> Task:
    rng = np.random.default_rng(0)
    batch = tuple(rng.normal(size=(BATCH, SEQ, FEATURES)).astype(np.float32) for _ in range(2))
    return Task(
        model=lambda: TinyTP(nnx.Rngs(0), unreduced),
        optimizer=optax.sgd(0.1),
        loss_fn=_loss,
        batches=[batch],
        name=f"tiny-tp-{unreduced}",
    )


def _gspmd(loss_scale: float = 1.0, loss=_loss):
    """A user's GSPMD step, the Flax NNX guide's way: the state placed from its annotations, the batch split over
    ``data``, a jitted step under ``jax.set_mesh`` (so the modules see the ``model`` axis). ``loss_scale``: a
    fault outside every module, the step's own loss scaled; ``loss``: the loss the step differentiates."""

    @nnx.jit
    def train(model, optimizer, batch):
        value, grads = nnx.value_and_grad(lambda m: loss_scale * loss(m, batch))(model)
        optimizer.update(model, grads)
        return {"loss": value, "grads": grads}

    def gspmd_step(model, optimizer, batch, mesh):
        with jax.set_mesh(mesh):
            state = nnx.state((model, optimizer))
            nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
            return train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P("data"))))

    return gspmd_step


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "model": 2})


def _forward_module(report) -> ModuleFinding:
    assert not report.ok
    loc = report.localization
    assert loc.stage == "forward" and loc.module is not None
    assert report.to_dict()["localization"]["module"] == loc.module.to_dict()
    # shown right after the forward stage's line, before the group and the stages
    text = loc.text()
    assert text.index("First difference at step 0: the forward pass") < text.index("Module: ")
    assert text.index("Module: ") < text.index("Stages: ")
    return loc.module


@require_devices(4)
def test_the_correct_tensor_parallel_model_passes_with_no_module_probe(mesh):
    report = check_parity(_gspmd(), _task(), mesh=mesh)
    assert report.ok and report.localization is None, str(report)


@require_devices(4)
def test_a_psum_left_out_of_one_blocks_mlp_is_named_as_the_first_module_that_differs(mesh):
    task = _task(unreduced=1)
    found = _forward_module(check_parity(_gspmd(), task, mesh=mesh))
    assert (found.status, found.module, found.where) == (
        "differs",
        "blocks.1.mlp.__call__",
        "mesh data=2 x model=2",
    )
    # embed, then block 0 (norm1, attn, norm2, mlp, the block) and block 1's norm1, attn and norm2 finished first
    assert found.matched_before == 9 and found.compared == 13
    rtol, atol = module_tolerance_for(task)
    assert found.tolerance == pytest.approx(atol + rtol * _max_ref_mlp_output(task), rel=1e-6)
    # one model shard's partial sum instead of the whole: off by about the output itself, far beyond rounding
    assert found.max_abs_err > 0.1 and found.max_abs_err > 1e4 * found.tolerance
    assert (found.input_of, found.children_matched, found.not_finite) == ("", (), 0)
    assert found.text() == (
        "the first module whose output differs while its inputs match, under the candidate's placement (mesh "
        f"data=2 x model=2), is blocks.1.mlp.__call__ (max abs err {found.max_abs_err:.3g} > tolerance "
        f"{found.tolerance:.3g}, at equal parameters): the difference begins in blocks.1.mlp.__call__'s own "
        "computation as sharded (it calls no captured module)"
    )


@require_devices(4)
def test_a_loss_scaled_in_the_step_is_the_forward_stage_with_every_module_output_matching(mesh):
    found = _forward_module(check_parity(_gspmd(loss_scale=2.0), _task(), mesh=mesh))
    assert found.status == "matches" and found.compared == 13 and found.matched_before == 13
    assert found.max_abs_err <= found.tolerance
    assert found.text().startswith(
        "every module's output matches under the candidate's placement (mesh data=2 x model=2; 13 captured "
        "outputs at equal parameters"
    )
    assert "the forward difference is in the step's own forward or loss, not in a module" in found.text()


@require_devices(4)
def test_a_forward_whose_module_outputs_cannot_be_captured_keeps_the_stage_and_says_why(mesh):
    """A loss that runs the model inside ``jax.checkpoint``: every module call is inside that transform, whose
    values would escape it (JAX's unexpected-tracer error), so none is recorded; the probe says so in words (no
    exception name) with what to do, and the localization stays at the forward stage."""

    def checkpointed(model, batch):
        return jax.checkpoint(lambda x, y: jnp.mean((model(x) - y) ** 2))(*batch)

    task = dataclasses.replace(_task(), loss_fn=checkpointed, name="checkpointed")
    found = _forward_module(check_parity(_gspmd(loss_scale=2.0), task, mesh=mesh))
    assert (found.status, found.error, found.compared) == (
        "not captured",
        "no module output on both sides",
        0,
    )
    assert found.inside_transforms == (
        "Attention.__call__", "Block.__call__", "LayerNorm.__call__", "Linear.__call__", "MLP.__call__",
        "TinyTP.__call__",
    )  # fmt: skip
    assert found.text().startswith(
        "no module call could be compared: every module method the forward calls runs inside a transform of the "
        "loss (Attention.__call__, Block.__call__, LayerNorm.__call__, Linear.__call__ and 2 more; a "
        "jax.checkpoint"
    )
    assert "call the model outside such a transform in the task's loss_fn" in found.text()
    assert "Error" not in found.text()


def module_tolerance_for(task: Task) -> tuple[float, float]:
    """The probe's tolerance for ``task`` (float32, reduction length 128): ``16 eps sqrt(128)``, ``eps sqrt(128)``."""
    eps = float(jnp.finfo(jnp.float32).eps)
    assert task.terms(task.batches[0]) == BATCH * SEQ * FEATURES
    return 16 * eps * np.sqrt(128), eps * np.sqrt(128)


def _max_ref_mlp_output(task: Task) -> float:
    """``max |blocks.1.mlp(...)|`` of the reference's forward (one device, no mesh)."""
    model = task.new_model()
    _, sown = nnx.capture(_loss, nnx.Intermediate, method_outputs=nnx.Intermediate)(model, task.batches[0])
    return float(jnp.max(jnp.abs(sown["blocks"][1]["mlp"]["__call__"][0])))


# ------------------------------------------------------------------------- a fault in a parent's own code


class Planted(nnx.Module):
    """Three children, called in turn: ``up`` (column-parallel), a rate-0 ``drop`` (a no-op) and ``down``
    (row-parallel, no bias). ``fault``, on the sharded path only (under a mesh with ``model``): ``"between"``
    scales ``up``'s activation by 1.25 before ``drop`` (trial 6's attention scale), ``"nan"`` adds ``0 * log 0``
    there (trial 6's NaN), ``"after"`` scales ``down``'s output by 1.25 (after every child)."""

    def __init__(self, rngs: nnx.Rngs, fault: str = ""):
        self.up = nnx.Linear(D, MLP_DIM, kernel_init=nnx.with_partitioning(INIT, (None, "model")), rngs=rngs)
        self.drop = nnx.Dropout(0.0, rngs=rngs)
        self.down = nnx.Linear(
            MLP_DIM, D, use_bias=False, kernel_init=nnx.with_partitioning(INIT, ("model", None)), rngs=rngs
        )
        self.fault = fault

    def __call__(self, x):
        h = nnx.gelu(self.up(x))
        planted = self.fault if _model_axis() else ""
        if planted == "between":
            h = 1.25 * h
        if planted == "nan":
            h = h + 0.0 * jnp.log(jnp.zeros_like(h))
        y = self.down(self.drop(h))
        return 1.25 * y if planted == "after" else y


class PlantedNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, fault: str = ""):
        self.embed = nnx.Linear(FEATURES, D, rngs=rngs)
        self.mlp = Planted(rngs, fault)
        self.head = nnx.Linear(D, FEATURES, rngs=rngs)

    def __call__(self, x):
        return self.head(self.mlp(self.embed(x)))


def _input_scaled_loss(model, batch):
    """The loss with the model's input scaled by 1.25 under a mesh with ``model``: code outside every module."""
    x, y = batch
    return jnp.mean((model(1.25 * x if _model_axis() else x) - y) ** 2)


def _planted_task(fault: str, loss=_loss) -> Task:
    return dataclasses.replace(
        _task(), model=lambda: PlantedNet(nnx.Rngs(0), fault), loss_fn=loss, name=f"planted-{fault}"
    )


def _reference_max(task: Task, key: str) -> float:
    """``max |output|`` of the module method ``key`` (``"mlp.drop.__call__"``) in the reference's forward."""
    model = task.new_model()
    _, sown = nnx.capture(task.loss_fn, nnx.Intermediate, method_outputs=nnx.Intermediate)(
        model, task.batches[0]
    )
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(sown)}
    return float(jnp.max(jnp.abs(flat[key][0])))


@require_devices(4)
@pytest.mark.parametrize("fault", ["between", "after"])
def test_a_fault_in_a_parents_own_code_names_the_parent_and_the_children_around_it(mesh, fault):
    """Trial 6: a wrong scale between ``up`` and the rate-0 ``drop`` was named ``mlp.drop.__call__`` (the first
    output that differs, though its input differed already). The parent is named, with the child that got a
    different input and the children before it that matched; after the last child, every child matches."""
    task = _planted_task(fault)
    found = _forward_module(check_parity(_gspmd(), task, mesh=mesh))
    assert (found.status, found.module, found.compared) == ("differs", "mlp.__call__", 7)
    # the output is 1.25 x the reference's (down has no bias): off by 0.25 of its largest entry
    assert found.max_abs_err == pytest.approx(0.25 * _reference_max(task, "mlp.__call__"), rel=1e-4)
    rtol, atol = module_tolerance_for(task)
    assert found.tolerance == pytest.approx(atol + rtol * _reference_max(task, "mlp.__call__"), rel=1e-6)
    head = (
        "the first module whose output differs while its inputs match, under the candidate's placement (mesh "
    )
    head += f"data=2 x model=2), is mlp.__call__ (max abs err {found.max_abs_err:.3g} > tolerance "
    head += f"{found.tolerance:.3g}, at equal parameters): the difference begins in mlp.__call__'s own code "
    if fault == "after":
        assert (found.input_of, found.matched_before) == ("", 4)  # embed, up, drop, down
        assert found.children_matched == ("mlp.up.__call__", "mlp.drop.__call__", "mlp.down.__call__")
        assert found.text() == head + (
            "after its children's calls: every child's input and output matched (mlp.up.__call__, "
            "mlp.drop.__call__, mlp.down.__call__)"
        )
        return
    assert (found.input_of, found.children_matched, found.matched_before) == (
        "mlp.drop.__call__",
        ("mlp.up.__call__",),
        2,  # embed and up; drop and down (inputs already different) differ before it
    )
    drop = _reference_max(task, "mlp.drop.__call__")  # the rate-0 dropout returns its input: gelu(up(x))
    assert found.input_max_abs_err == pytest.approx(0.25 * drop, rel=1e-4)
    assert found.input_tolerance == pytest.approx(atol + rtol * drop, rel=1e-6)
    assert found.text() == head + (
        "between its children's calls: its child mlp.drop.__call__ got a different input (max abs err "
        f"{found.input_max_abs_err:.3g} > tolerance {found.input_tolerance:.3g}) while every earlier child's "
        "output (mlp.up.__call__) matched"
    )


@require_devices(4)
def test_a_nan_in_a_parents_own_code_is_said_not_finite_with_its_count(mesh):
    """Trial 6's ``h + 0 * log(0)`` between ``up`` and ``drop`` was "max abs err inf > tolerance 0" at the
    dropout; now the parent, every entry of the activation and of the output not finite, counted."""
    found = _forward_module(check_parity(_gspmd(), _planted_task("nan"), mesh=mesh))
    assert (found.status, found.module, found.input_of) == ("differs", "mlp.__call__", "mlp.drop.__call__")
    assert (found.not_finite, found.input_not_finite) == (BATCH * SEQ * D, BATCH * SEQ * MLP_DIM)
    assert found.text().endswith(
        "is mlp.__call__ (not finite: 256 entries NaN or infinite where the reference's are finite, at equal "
        "parameters): the difference begins in mlp.__call__'s own code between its children's calls: its child "
        "mlp.drop.__call__ got a different input (not finite: 512 entries NaN or infinite where the reference's "
        "are finite) while every earlier child's output (mlp.up.__call__) matched"
    )
    assert "inf >" not in found.text() and "tolerance 0" not in found.text()


@require_devices(4)
def test_a_loss_that_changes_the_models_input_is_a_difference_before_every_module(mesh):
    """Every output that differs got a different input: no module is named as the place; the first (``embed``)
    is said with its input's error, 0.25 x the batch's largest feature."""
    task = _planted_task("", loss=_input_scaled_loss)
    found = _forward_module(check_parity(_gspmd(loss=_input_scaled_loss), task, mesh=mesh))
    assert (found.status, found.module, found.input_of, found.matched_before) == (
        "input differs",
        "embed.__call__",
        "embed.__call__",
        0,
    )
    x = task.batches[0][0]
    assert found.input_max_abs_err == pytest.approx(0.25 * float(np.max(np.abs(x))), rel=1e-6)
    assert found.text().startswith(
        "no module's output differs while its inputs match under the candidate's placement (mesh data=2 x "
        "model=2): the first module whose output differs, embed.__call__ (max abs err "
    )
    assert found.text().endswith(
        f"got a different input already (max abs err {found.input_max_abs_err:.3g} > tolerance "
        f"{found.input_tolerance:.3g}): the difference begins before it, in code outside every captured module "
        "call (the step's own forward or loss)"
    )
