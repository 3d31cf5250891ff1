"""The built-in ``gspmd`` strategy and memory's ``gspmd`` row place a partly annotated model by one rule.

The rule (``steps/sharded.py`` ``state_specs``): on a model that annotates any Variable, the annotations alone, an
unannotated leaf replicated with its optimizer state and gradient, as the Flax NNX guide "Scale up on multiple
devices" places a model (``nnx.get_partition_spec`` / ``nnx.get_named_sharding``: ``P()`` for an unannotated
Variable); on a model without annotations, the FSDP rule, as ``fsdp``. Before, the step split the unannotated
leaves by the FSDP rule while memory's row kept them whole, and ``measure_memory`` measured memory's placement, so
``est / measured`` read 1.0 for a layout the step that ``verify`` runs did not hold.

Hand counts, float32 = 4 B, on data=2 x fsdp=4 (8 devices; ``fsdp`` splits in four, ``data`` holds copies):

===========  =======  ============  =====================  ====================
leaf         shape    annotated     gspmd (annotations)    FSDP rule (fsdp)
===========  =======  ============  =====================  ====================
fc1.kernel   (16, 32) (None, fsdp)  (16, 8) = 128 floats   128
fc1.bias     (32,)    no            32 (replicated)        8
fc2.kernel   (32, 8)  no            256 (replicated)       (8, 8) = 64
fc2.bias     (8,)     no            8 (replicated)         2
===========  =======  ============  =====================  ====================

Parameters a device: gspmd 424 floats = 1696 B, the rule 202 floats = 808 B. Adam holds two moments placed as
their parameter and an int32 count (4 B); NNX's step counter is 4 B. Persistent: gspmd 3 * 1696 + 8 = 5096 B,
the rule 3 * 808 + 8 = 2432 B. Without annotations (fc1.kernel split by the rule: (4, 32) = 128 floats) gspmd is
the rule's 202 floats, 2432 B.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardcheck import Task, check_parity, estimate_memory, make_mesh, measure_memory
from shardcheck.memory import layout_shardings
from shardcheck.steps.sharded import flat_leaves, mesh_step, state_specs

MESH = {"data": 2, "fsdp": 4}
GSPMD_PARAMS, RULE_PARAMS = 424 * 4, 202 * 4
GSPMD_PERSISTENT, RULE_PERSISTENT = 3 * GSPMD_PARAMS + 8, 3 * RULE_PARAMS + 8
GSPMD_SPECS = {"fc1.kernel": P(None, "fsdp"), "fc1.bias": P(), "fc2.kernel": P(), "fc2.bias": P()}
RULE_SPECS = {"fc1.kernel": P("fsdp"), "fc1.bias": P("fsdp"), "fc2.kernel": P("fsdp"), "fc2.bias": P("fsdp")}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, annotated: bool = True):
        init = nnx.initializers.lecun_normal()
        kernel = nnx.with_partitioning(init, (None, "fsdp")) if annotated else init
        self.fc1 = nnx.Linear(16, 32, kernel_init=kernel, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _task(annotated: bool = True) -> Task:
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.normal(size=(16, 8)).astype(np.float32)}
        for _ in range(2)
    ]
    return Task(
        model=lambda: MLP(nnx.Rngs(0), annotated),
        optimizer=optax.adam(1e-2),
        loss_fn=loss_fn,
        batches=batches,
        name="mlp",
    )


def _state(task):
    with nnx.use_eager_sharding(False):
        model = task.model()
    return model, nnx.Optimizer(model, task.optimizer, wrt=nnx.Param)


def _dotted(path) -> str:
    return ".".join(str(k) for k in path)


def _stepped(task, mesh):
    """The state after one step of the registered gspmd strategy, and the gradients it applied."""
    model, optimizer = _state(task)
    result = mesh_step("gspmd", task.loss_fn, model, optimizer, task.batches[0], mesh, with_grads=True)
    return model, optimizer, result


@require_devices(8)
@pytest.mark.parametrize("annotated", [True, False])
def test_the_gspmd_steps_state_is_placed_as_memorys_layout(annotated):
    """Leaf by leaf, the shardings the built-in gspmd step's state and gradients hold after a step equal
    memory's ``layout_shardings("gspmd")``: the hand table above, for the partly annotated model and (the FSDP
    rule, unchanged) for the model without annotations."""
    task, mesh = _task(annotated), make_mesh(MESH)
    model, optimizer, result = _stepped(task, mesh)
    layout, grad_layout = layout_shardings("gspmd", *_state(task), mesh)
    flat = flat_leaves(nnx.state((model, optimizer)))
    assert len(flat) == len(layout) == 14  # 4 params, their 2 moments each, adam's count, nnx's step
    for (path, var), want in zip(flat, layout, strict=True):
        got = var.get_value().sharding
        assert got.is_equivalent_to(want, var.get_value().ndim), (_dotted(path), got.spec, want.spec)
    expected = GSPMD_SPECS if annotated else RULE_SPECS
    params = {_dotted(p): v.get_value().sharding.spec for p, v in flat_leaves(nnx.state(model, nnx.Param))}
    assert params == expected
    grads = jax.tree.leaves(result.grads)
    assert [g.sharding.spec for g in grads] == [s.spec for s in grad_layout]
    assert [g.sharding.spec for g in grads] == [expected[k] for k in sorted(expected)]


@require_devices(8)
def test_fsdp_keeps_its_rule_on_the_partly_annotated_model():
    """The other side: fsdp splits the unannotated leaves by its rule (its documented placement, unchanged)."""
    model, optimizer = _state(_task())
    _, param_specs = state_specs("fsdp", model, optimizer, make_mesh(MESH))
    names = [_dotted(p) for p, _ in flat_leaves(nnx.state(model, nnx.Param))]
    assert dict(zip(names, param_specs, strict=True)) == RULE_SPECS | {"fc1.kernel": P(None, "fsdp")}


@require_devices(8)
@pytest.mark.parametrize(
    "annotated,params,persistent",
    [(True, GSPMD_PARAMS, GSPMD_PERSISTENT), (False, RULE_PARAMS, RULE_PERSISTENT)],
)
def test_the_estimate_equals_the_state_the_gspmd_step_holds(annotated, params, persistent):
    """Bytes per device: the estimate, ``measure_memory`` (XLA's figures for the compiled step) and the arrays the
    registered step really left on each device all equal the hand count."""
    task, mesh = _task(annotated), make_mesh(MESH)
    est = estimate_memory(task, mesh=MESH, strategy="gspmd")
    assert (est.params_bytes, est.persistent_bytes) == (params, persistent)
    measured = measure_memory(task, strategy="gspmd", mesh=mesh)
    assert measured.state_bytes == persistent and measured.accuracy_ratio == 1.0
    model, optimizer, _ = _stepped(task, mesh)
    leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    for device in mesh.devices.flat:
        held = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)
        assert held == persistent, device
    model_leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(a.addressable_shards[0].data.nbytes for a in model_leaves) == params


def guide_step(scale: float = 1.0):
    """A user's GSPMD step as the Flax NNX guide writes it: the state placed by ``nnx.get_named_sharding`` (an
    unannotated leaf replicated), the plain step under ``nnx.jit``. ``scale``: the loss multiplied (a fault at 2)."""

    @nnx.jit
    def train(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: scale * loss_fn(m, batch))(model)
        optimizer.update(model, grads)
        return loss, grads

    def step(model, optimizer, batch, mesh):
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        loss, grads = train(model, optimizer, jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp")))))
        return {"loss": loss, "grads": grads}

    return step


@require_devices(8)
def test_check_parity_with_gspmd_passes_a_correct_step_and_fails_a_doubled_loss():
    task, mesh = _task(), make_mesh(MESH)
    builtin = check_parity("gspmd", task, mesh=mesh, steps=2)  # against the single-device step
    assert builtin.verdict == "PASS" and builtin.codes[0] == "parity", str(builtin)
    good = check_parity(guide_step(), task, mesh=mesh, steps=2, reference="gspmd")
    assert good.reference == "gspmd on data=2,fsdp=4" and good.verdict == "PASS", str(good)
    bad = check_parity(guide_step(2.0), task, mesh=mesh, steps=2, reference="gspmd")
    assert bad.verdict == "FAIL", str(bad)
    assert bad.codes[0] == "scaled", str(bad)
    message = bad.diagnoses[0].message
    assert "the loss the step returns at equal parameters is 2 x the reference's" in message, message
    assert "gradients are 2 x too" in message, message
